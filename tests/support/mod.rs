//! Test harness: real servers started on free loopback ports and stopped by PID on drop.

#![allow(dead_code)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` owned by one test: its own port, no persistence, killed on drop.
pub struct RedisServer {
    child: Child,
    pub port: u16,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

impl RedisServer {
    pub fn start() -> RedisServer {
        let port = free_port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server not found: run scripts/test.sh, which installs it");
        let server = RedisServer { child, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut conn) = redis::Client::open(server.url()).and_then(|c| c.get_connection()) {
                if redis::cmd("PING").query::<String>(&mut conn).is_ok() {
                    return server;
                }
            }
            assert!(Instant::now() < deadline, "redis-server on port {port} did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
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
