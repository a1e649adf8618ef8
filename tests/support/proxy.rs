//! A TCP proxy in front of a server, for fault tests: it forwards both ways, and while told to,
//! closes a connection right after the server answered a request, instead of passing the answer
//! on. The client then sees a dropped connection for a request the server did execute: exactly
//! the case where a retry must not apply the request twice.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub struct Proxy {
    pub port: u16,
    state: Arc<State>,
}

struct State {
    stop: AtomicBool,
    /// Every `drop_every`-th reply closes its connection instead of reaching the client; 0: none.
    drop_every: AtomicU64,
    replies: AtomicU64,
    /// Replies dropped so far.
    dropped: AtomicU64,
}

impl Proxy {
    /// A proxy on a free loopback port in front of `127.0.0.1:target`.
    pub fn start(target: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy port");
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(State {
            stop: AtomicBool::new(false),
            drop_every: AtomicU64::new(0),
            replies: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        });
        let accept_state = Arc::clone(&state);
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if accept_state.stop.load(Ordering::Acquire) {
                    return;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let state = Arc::clone(&accept_state);
                let (client_in, server_out) =
                    (client.try_clone().unwrap(), server.try_clone().unwrap());
                std::thread::spawn(move || pump(client_in, server_out, None));
                std::thread::spawn(move || pump(server, client, Some(state)));
            }
        });
        Proxy { port, state }
    }

    /// From now on, every `n`-th reply from the server closes its connection (0: none).
    pub fn drop_every(&self, n: u64) {
        self.state.drop_every.store(n, Ordering::Release);
    }

    /// Replies the proxy dropped so far.
    pub fn dropped(&self) -> u64 {
        self.state.dropped.load(Ordering::Acquire)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}

/// Copies `from` to `to` until either side closes; on the reply side (`state` given), drops the
/// connection instead of forwarding every `drop_every`-th chunk.
fn pump(mut from: TcpStream, mut to: TcpStream, state: Option<Arc<State>>) {
    let mut buf = vec![0u8; 64 * 1024];
    let _ = from.set_read_timeout(Some(Duration::from_millis(500)));
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                if state
                    .as_ref()
                    .is_some_and(|s| s.stop.load(Ordering::Acquire))
                {
                    break;
                }
                continue;
            }
            Err(_) => break,
        };
        if let Some(state) = &state {
            let every = state.drop_every.load(Ordering::Acquire);
            let count = state.replies.fetch_add(1, Ordering::AcqRel) + 1;
            if every > 0 && count % every == 0 {
                state.dropped.fetch_add(1, Ordering::AcqRel);
                break;
            }
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Release);
        // Wakes the accept loop so it sees the flag.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}
