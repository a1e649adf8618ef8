//! Test harness: real servers started on free loopback ports and stopped by PID on drop.

#![allow(dead_code)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` owned by one test: its own port, no persistence, killed on drop.
pub struct RedisServer {
    child: Child,
    pub port: u16,
    extra: Vec<String>,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

/// Spawns `redis-server` (TLS-only when `extra` has `--tls-port`) and waits for its port.
fn spawn_redis(port: u16, extra: &[String]) -> Child {
    let tls = extra.iter().any(|a| a == "--tls-port");
    let mut args: Vec<String> = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"].map(String::from).to_vec();
    args.extend(["--port".to_owned(), if tls { "0".to_owned() } else { port.to_string() }]);
    args.extend(extra.iter().cloned());
    let child = Command::new("redis-server")
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server not found: run scripts/test.sh, which installs it");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "redis-server on port {port} did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

impl RedisServer {
    pub fn start() -> RedisServer {
        RedisServer::start_with(free_port(), &[])
    }

    /// Starts `redis-server` on `port` with extra arguments, waiting until it answers.
    fn start_with(port: u16, extra: &[String]) -> RedisServer {
        let child = spawn_redis(port, extra);
        RedisServer { child, port, extra: extra.to_vec() }
    }

    /// A TLS-only server with a certificate for 127.0.0.1 signed by a fresh test CA. Returns the
    /// server and the path of the CA certificate.
    pub fn start_tls(dir: &std::path::Path) -> (RedisServer, std::path::PathBuf) {
        let file = |name: &str| dir.join(name).to_str().unwrap().to_owned();
        std::fs::write(dir.join("server.ext"), "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n").unwrap();
        let openssl = |args: &[&str]| {
            let status = Command::new("openssl")
                .args(args)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .expect("openssl not found: run scripts/test.sh, which installs it");
            assert!(status.success(), "openssl {args:?}");
        };
        let (ca_key, ca, key, csr, cert, ext) =
            (file("ca.key"), file("ca.pem"), file("key.pem"), file("server.csr"), file("cert.pem"), file("server.ext"));
        openssl(&["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=vigil test CA", "-keyout", &ca_key, "-out", &ca]);
        openssl(&["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", &key, "-out", &csr]);
        openssl(&["x509", "-req", "-in", &csr, "-CA", &ca, "-CAkey", &ca_key, "-CAcreateserial", "-days", "2", "-extfile", &ext, "-out", &cert]);
        let port = free_port();
        let extra = [
            "--tls-port", &port.to_string(), "--tls-cert-file", &cert, "--tls-key-file", &key,
            "--tls-ca-cert-file", &ca, "--tls-auth-clients", "no",
        ]
        .map(String::from);
        (RedisServer::start_with(port, &extra), dir.join("ca.pem"))
    }

    /// Kills the server and starts a new, empty one on the same port (a Redis restart).
    pub fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = spawn_redis(self.port, &self.extra);
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub fn connection(&self) -> redis::Connection {
        redis::Client::open(self.url()).unwrap().get_connection().unwrap()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // Only the process this test started, by its PID.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
