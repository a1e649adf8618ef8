//! Test harness: real servers started on free loopback ports and stopped by PID on drop.

#![allow(dead_code)]

pub mod kafka;
pub mod proxy;
pub mod reference;
pub mod store_replay;
pub mod stream;

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` owned by one test: its own port, no persistence, killed on drop.
pub struct RedisServer {
    child: Child,
    pub port: u16,
    extra: Vec<String>,
}

/// A fresh test CA and a server certificate for 127.0.0.1 it signed, made with `openssl` in a
/// directory (PEM files; the key unencrypted PKCS#8).
pub struct TestCertificates {
    pub ca: std::path::PathBuf,
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
}

impl TestCertificates {
    pub fn make(dir: &std::path::Path) -> TestCertificates {
        let file = |name: &str| dir.join(name).to_str().unwrap().to_owned();
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n",
        )
        .unwrap();
        let openssl = |args: &[&str]| {
            let status = Command::new("openssl")
                .args(args)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .expect("openssl not found: run scripts/test.sh, which installs it");
            assert!(status.success(), "openssl {args:?}");
        };
        let (ca_key, ca, key, csr, cert, ext) = (
            file("ca.key"),
            file("ca.pem"),
            file("key.pem"),
            file("server.csr"),
            file("cert.pem"),
            file("server.ext"),
        );
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=vigil test CA",
            "-keyout",
            &ca_key,
            "-out",
            &ca,
        ]);
        openssl(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            &key,
            "-out",
            &csr,
        ]);
        openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &ext,
            "-out",
            &cert,
        ]);
        TestCertificates {
            ca: ca.into(),
            cert: cert.into(),
            key: key.into(),
        }
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// Spawns `redis-server` (TLS-only when `extra` has `--tls-port`) on `port` and waits until the
/// server answering there is this child (parallel tests can race for a freed port). `None` if the
/// child lost the port.
fn spawn_redis(port: u16, extra: &[String]) -> Option<Child> {
    let tls = extra.iter().any(|a| a == "--tls-port");
    // A configuration file must come first (a sentinel's: Sentinel rewrites it as it learns).
    let (config, extra) = match extra.first() {
        Some(file) if file.ends_with(".conf") => (vec![file.clone()], &extra[1..]),
        _ => (Vec::new(), extra),
    };
    let mut args: Vec<String> = config;
    args.extend(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"].map(String::from));
    args.extend([
        "--port".to_owned(),
        if tls {
            "0".to_owned()
        } else {
            port.to_string()
        },
    ]);
    args.extend(extra.iter().cloned());
    let mut child = Command::new("redis-server")
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server not found: run scripts/test.sh, which installs it");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if child.try_wait().ok().flatten().is_some() {
            return None; // exited: the port was taken
        }
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            if tls {
                return Some(child);
            }
            let info: Option<String> = redis::Client::open(format!("redis://127.0.0.1:{port}/"))
                .and_then(|c| c.get_connection())
                .and_then(|mut c| redis::cmd("INFO").arg("server").query(&mut c))
                .ok();
            let pid = info.as_deref().and_then(|i| {
                i.lines()
                    .find_map(|l| l.strip_prefix("process_id:"))
                    .and_then(|p| p.trim().parse::<u32>().ok())
            });
            if pid == Some(child.id()) {
                return Some(child);
            }
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl RedisServer {
    pub fn start() -> RedisServer {
        RedisServer::start_with(|_| Vec::new())
    }

    /// Starts `redis-server` on a free port with extra arguments (which may name the port),
    /// trying other ports if another process takes the chosen one first.
    fn start_with(extra: impl Fn(u16) -> Vec<String>) -> RedisServer {
        for _ in 0..10 {
            let port = free_port();
            let args = extra(port);
            if let Some(child) = spawn_redis(port, &args) {
                return RedisServer {
                    child,
                    port,
                    extra: args,
                };
            }
        }
        panic!("could not start redis-server on a free port");
    }

    /// A TLS-only server with a certificate for 127.0.0.1 signed by a fresh test CA. Returns the
    /// server and the path of the CA certificate.
    pub fn start_tls(dir: &std::path::Path) -> (RedisServer, std::path::PathBuf) {
        let certificates = TestCertificates::make(dir);
        let (cert, key, ca) = (
            certificates.cert.display().to_string(),
            certificates.key.display().to_string(),
            certificates.ca.display().to_string(),
        );
        let extra = |port: u16| {
            [
                "--tls-port",
                &port.to_string(),
                "--tls-cert-file",
                &cert,
                "--tls-key-file",
                &key,
                "--tls-ca-cert-file",
                &ca,
                "--tls-auth-clients",
                "no",
            ]
            .map(String::from)
            .to_vec()
        };
        (RedisServer::start_with(extra), certificates.ca)
    }

    /// A server that logs every write to an append-only file in `dir` and fsyncs it before
    /// answering (`appendfsync always`): a SIGKILL loses nothing it acknowledged.
    pub fn start_persistent(dir: &std::path::Path) -> RedisServer {
        let dir = dir.to_str().unwrap().to_owned();
        RedisServer::start_with(move |_| {
            [
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--dir",
                &dir,
            ]
            .map(String::from)
            .to_vec()
        })
    }

    /// Kills the server (SIGKILL) and starts it again on the same port: empty, or with what its
    /// append-only file kept for a persistent server.
    pub fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = spawn_redis(self.port, &self.extra).expect("restart redis-server on its port");
    }

    /// Kills the server (SIGKILL) for good, and waits for it to be gone.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether this server is still running (not killed).
    pub fn alive(&mut self) -> bool {
        self.child.try_wait().ok().flatten().is_none()
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing is answered.
    pub fn pause(&self) {
        signal(self.child.id(), "STOP");
    }

    /// Lets a paused server go on (SIGCONT).
    pub fn resume(&self) {
        signal(self.child.id(), "CONT");
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub fn connection(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .unwrap()
            .get_connection()
            .unwrap()
    }
}

/// Sends `signal` (e.g. "STOP") to a process this test started.
pub fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill -{signal} {pid}");
}

/// A master and one replica managed by three Redis Sentinels (quorum 2, a master unreachable for
/// one second is down), all on free loopback ports, ready once every sentinel knows the replica
/// and the other sentinels.
pub struct RedisSentinels {
    pub master: RedisServer,
    pub replica: RedisServer,
    pub sentinels: Vec<RedisServer>,
    _dir: tempfile::TempDir,
}

impl RedisSentinels {
    /// The name the sentinels monitor the master by.
    pub const SERVICE: &'static str = "vigil-test";

    pub fn start() -> RedisSentinels {
        let dir = tempfile::tempdir().unwrap();
        // In the temporary directory: a replica's full sync writes the master's snapshot there.
        let data = |name: &str| {
            let path = dir.path().join(name);
            std::fs::create_dir_all(&path).unwrap();
            vec!["--dir".to_owned(), path.to_str().unwrap().to_owned()]
        };
        let master = RedisServer::start_with(|_| data("master"));
        let master_port = master.port.to_string();
        let replica = RedisServer::start_with(|_| {
            let mut args = data("replica");
            args.extend([
                "--replicaof".to_owned(),
                "127.0.0.1".to_owned(),
                master_port.clone(),
            ]);
            args
        });
        let sentinels: Vec<RedisServer> = (0..3)
            .map(|_| {
                RedisServer::start_with(|port| {
                    let config = dir.path().join(format!("sentinel-{port}.conf"));
                    let text = format!(
                        "sentinel monitor {service} 127.0.0.1 {master_port} 2\n\
                         sentinel down-after-milliseconds {service} 1000\n\
                         sentinel failover-timeout {service} 10000\n\
                         sentinel parallel-syncs {service} 1\n",
                        service = RedisSentinels::SERVICE
                    );
                    std::fs::write(&config, text).unwrap();
                    vec![
                        config.to_str().unwrap().to_owned(),
                        "--sentinel".to_owned(),
                        "--dir".to_owned(),
                        dir.path().to_str().unwrap().to_owned(),
                    ]
                })
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let replication: String = redis::cmd("INFO")
                .arg("replication")
                .query(&mut replica.connection())
                .unwrap();
            let known = sentinels.iter().all(|sentinel| {
                let mut conn = sentinel.connection();
                let replicas: Vec<redis::Value> = redis::cmd("SENTINEL")
                    .arg("REPLICAS")
                    .arg(RedisSentinels::SERVICE)
                    .query(&mut conn)
                    .unwrap_or_default();
                let others: Vec<redis::Value> = redis::cmd("SENTINEL")
                    .arg("SENTINELS")
                    .arg(RedisSentinels::SERVICE)
                    .query(&mut conn)
                    .unwrap_or_default();
                replicas.len() == 1 && others.len() == 2
            });
            if replication.contains("master_link_status:up") && known {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the sentinels did not learn the replica and each other"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        RedisSentinels {
            master,
            replica,
            sentinels,
            _dir: dir,
        }
    }

    /// `redis+sentinel://` naming every sentinel.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        format!(
            "redis+sentinel://{}/{}",
            hosts.join(","),
            RedisSentinels::SERVICE
        )
    }

    /// The port the sentinels name as the master now.
    pub fn master_port(&self) -> u16 {
        let (_, port): (String, u16) = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(RedisSentinels::SERVICE)
            .query(&mut self.sentinels[0].connection())
            .unwrap();
        port
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // Only the process this test started, by its PID (resumed first if a test paused it;
        // not if a test killed it already).
        if self.alive() {
            let _ = Command::new("kill")
                .args(["-CONT", &self.child.id().to_string()])
                .status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A Redis Cluster of three masters (and, from `start_with_replicas`, one replica each), each a
/// `redis-server` this test started; all killed on drop.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
    _dir: tempfile::TempDir,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        RedisCluster::start_with_replicas(0)
    }

    /// Three masters with `replicas` replicas each (`cluster-node-timeout 2000`: a master gone for
    /// two seconds is failed over), once every node says `cluster_state:ok`, every replica is
    /// in sync with its master and every node's slot map names every replica.
    pub fn start_with_replicas(replicas: usize) -> RedisCluster {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_str().unwrap().to_owned();
        let nodes: Vec<RedisServer> = (0..3 * (1 + replicas))
            .map(|_| {
                RedisServer::start_with(|port| {
                    [
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        &format!("nodes-{port}.conf"),
                        "--cluster-node-timeout",
                        "2000",
                        "--dir",
                        &path,
                    ]
                    .map(String::from)
                    .to_vec()
                })
            })
            .collect();
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let status = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addresses)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli not found: run scripts/test.sh, which installs it");
        assert!(status.success(), "redis-cli --cluster create failed");
        let deadline = Instant::now() + Duration::from_secs(30);
        for node in &nodes {
            loop {
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query(&mut node.connection())
                    .unwrap();
                let replication: String = redis::cmd("INFO")
                    .arg("replication")
                    .query(&mut node.connection())
                    .unwrap();
                let synced = !replication.contains("role:slave")
                    || replication.contains("master_link_status:up");
                // Every node's slot map names every replica (a client learns them from it).
                let slots: Vec<redis::Value> = redis::cmd("CLUSTER")
                    .arg("SLOTS")
                    .query(&mut node.connection())
                    .unwrap();
                let listed = slots.len() == 3
                    && slots.iter().all(|range| matches!(range, redis::Value::Array(items) if items.len() == 3 + replicas));
                if info.contains("cluster_state:ok") && synced && listed {
                    break;
                }
                assert!(Instant::now() < deadline, "cluster did not become ok");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        RedisCluster { nodes, _dir: dir }
    }

    /// The indexes of the nodes alive that are masters now.
    pub fn masters(&mut self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| {
                self.nodes[i].alive() && {
                    let role: Vec<redis::Value> = redis::cmd("ROLE")
                        .query(&mut self.nodes[i].connection())
                        .unwrap();
                    matches!(role.first(), Some(redis::Value::BulkString(r)) if r == b"master")
                }
            })
            .collect()
    }

    /// Waits until every live node says `cluster_state:ok` (after a failover); how long it took.
    pub fn wait_ok(&mut self, timeout: Duration) -> Duration {
        let start = Instant::now();
        for i in 0..self.nodes.len() {
            if !self.nodes[i].alive() {
                continue;
            }
            loop {
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query(&mut self.nodes[i].connection())
                    .unwrap();
                if info.contains("cluster_state:ok") {
                    break;
                }
                assert!(
                    start.elapsed() < timeout,
                    "cluster did not become ok again within {timeout:?}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        start.elapsed()
    }

    /// The counters of every live master (`redis_totals` over the whole cluster).
    pub fn totals(&mut self) -> BTreeMap<String, (i128, usize)> {
        let mut totals = BTreeMap::new();
        for i in self.masters() {
            totals.extend(redis_totals(&mut self.nodes[i].connection()));
        }
        totals
    }

    /// The URL of one node: the store finds the rest.
    pub fn url(&self) -> String {
        self.nodes[0].url()
    }

    /// The replica of the master on `port`, by index in `nodes`.
    pub fn replica_of(&self, port: u16) -> usize {
        self.nodes
            .iter()
            .position(|n| {
                let info: String = redis::cmd("INFO")
                    .arg("replication")
                    .query(&mut n.connection())
                    .unwrap();
                info.lines()
                    .any(|l| l.trim() == format!("master_port:{port}"))
            })
            .expect("every master has a replica")
    }

    pub fn node_id(node: &RedisServer) -> String {
        redis::cmd("CLUSTER")
            .arg("MYID")
            .query(&mut node.connection())
            .unwrap()
    }

    /// Moves every key of `slot` from the node that serves it to another, as `redis-cli
    /// --cluster reshard` does: clients holding the old slot map then get MOVED/ASK replies.
    pub fn migrate_slot(&self, slot: u16) {
        let serves = |node: &RedisServer| -> bool {
            let n: i64 = redis::cmd("CLUSTER")
                .arg("COUNTKEYSINSLOT")
                .arg(slot)
                .query(&mut node.connection())
                .unwrap();
            n > 0
        };
        let source = self
            .nodes
            .iter()
            .position(serves)
            .expect("a node holds keys of the slot");
        let target = (source + 1) % self.nodes.len();
        let (src, dst) = (&self.nodes[source], &self.nodes[target]);
        let (src_id, dst_id) = (Self::node_id(src), Self::node_id(dst));
        let _: () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("IMPORTING")
            .arg(&src_id)
            .query(&mut dst.connection())
            .unwrap();
        let _: () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("MIGRATING")
            .arg(&dst_id)
            .query(&mut src.connection())
            .unwrap();
        loop {
            let keys: Vec<String> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(100)
                .query(&mut src.connection())
                .unwrap();
            if keys.is_empty() {
                break;
            }
            let _: () = redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(dst.port)
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS")
                .arg(&keys)
                .query(&mut src.connection())
                .unwrap();
        }
        for node in &self.nodes {
            let _: () = redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg("NODE")
                .arg(&dst_id)
                .query(&mut node.connection())
                .unwrap();
        }
    }
}

/// The counter keys in a Redis: every `vg:*` key but the epoch, the decision journals and the
/// holds (`vg:h:<rule>:<digest>`; a counter's key has one colon fewer).
pub fn counter_keys(conn: &mut redis::Connection) -> Vec<String> {
    let keys: Vec<String> = redis::cmd("KEYS").arg("vg:*").query(conn).unwrap();
    let hold = |k: &str| k.starts_with("vg:h:") && k.matches(':').count() == 3;
    let internal = |k: &str| {
        k.starts_with("vg:epoch")
            || k.starts_with("vg:j:")
            || k.starts_with("vg:align:")
            || k.starts_with("vg:r:{")
    };
    keys.into_iter()
        .filter(|k| !internal(k) && !hold(k))
        .collect()
}

/// Asserts that the totals `got` from Redis equal those of one clean pass (`want`): the same keys
/// with the same values; on failure, how many differ, five examples and `context` (a log).
pub fn assert_totals_equal(
    got: &BTreeMap<String, (i128, usize)>,
    want: &BTreeMap<String, (i128, usize)>,
    context: &str,
) {
    eprintln!("comparing {} Redis keys with one clean pass", want.len());
    let differing: Vec<_> = want
        .iter()
        .filter(|(k, v)| got.get(*k) != Some(*v))
        .take(5)
        .map(|(k, v)| (k, v, got.get(k)))
        .collect();
    let extra = got.keys().filter(|k| !want.contains_key(*k)).count();
    assert!(
        differing.is_empty() && extra == 0,
        "{} of {} keys differ, {extra} extra, e.g. (key, want, got) {differing:?}\n{context}",
        want.iter().filter(|(k, v)| got.get(*k) != Some(*v)).count(),
        want.len()
    );
}

/// Sum of every live count/sum bucket (sums in micro-units, exact) and the number of live distinct
/// values, per Redis key — per section of a hash shared by counters over the same dimensions
/// (`vg:_:<digest>`, fields `<8 hex digits>.<field>`), as `<key>#<prefix>`.
pub fn redis_totals(conn: &mut redis::Connection) -> BTreeMap<String, (i128, usize)> {
    type Fields = Vec<(Vec<u8>, String)>;
    let mut sections: Vec<(String, Fields)> = Vec::new();
    for key in counter_keys(conn) {
        let fields: Vec<(Vec<u8>, String)> = redis::cmd("HGETALL").arg(&key).query(conn).unwrap();
        if !key.starts_with("vg:_:") {
            sections.push((key, fields));
            continue;
        }
        let mut by_prefix: BTreeMap<String, Fields> = BTreeMap::new();
        for (field, value) in fields {
            assert!(
                field.len() > 9 && field[8] == b'.',
                "{key}: field {:?} is in no section",
                String::from_utf8_lossy(&field)
            );
            let prefix = String::from_utf8_lossy(&field[..9]).into_owned();
            by_prefix
                .entry(prefix)
                .or_default()
                .push((field[9..].to_vec(), value));
        }
        for (prefix, fields) in by_prefix {
            sections.push((format!("{key}#{prefix}"), fields));
        }
    }
    sections
        .into_iter()
        .map(|(key, fields)| {
            // Bucket fields are slot numbers (digits only); distinct fields start with 'd'; a
            // last window's kept event is `l` = "<bucket>:<time>:<value>", its time counted here.
            let total: i128 = fields
                .iter()
                .filter(|(f, _)| f.iter().all(u8::is_ascii_digit))
                .map(|(_, v)| {
                    v.parse::<i128>()
                        .unwrap_or_else(|_| panic!("{key}: bucket {v:?} is not an integer"))
                })
                .sum::<i128>()
                + fields
                    .iter()
                    .filter(|(f, _)| f.as_slice() == b"l")
                    .map(|(_, v)| {
                        v.split(':')
                            .nth(1)
                            .and_then(|t| t.parse::<i128>().ok())
                            .unwrap_or(-1)
                    })
                    .sum::<i128>();
            let distinct = fields.iter().filter(|(f, _)| f[0] == b'd').count();
            (key, (total, distinct))
        })
        .collect()
}

/// How many EVALSHA calls (vigil's flushes) a node has served.
/// Whether `node`'s view of the cluster flags the node on `port` failed (`fail`, not the
/// suspicion `fail?`).
pub fn cluster_flags_failed(node: &mut redis::Connection, port: u16) -> bool {
    let nodes: String = redis::cmd("CLUSTER").arg("NODES").query(node).unwrap();
    nodes.lines().any(|line| {
        let fields: Vec<&str> = line.split(' ').collect();
        fields.len() > 2
            && fields[1].starts_with(&format!("127.0.0.1:{port}@"))
            && fields[2].split(',').any(|flag| flag == "fail")
    })
}

pub fn evalsha_calls(node: &mut redis::Connection) -> u64 {
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(node)
        .unwrap_or_default();
    stats
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Watches the replica at `url` after its master was killed at `killed`: when it became a master
/// (what the failover itself took, before vigil can do a thing) and when it served its first
/// flush (its EVALSHA count: as a replica it only receives the scripts' effects), both counted
/// from the kill; `None` if no flush came within a minute.
pub fn first_flush_on(
    url: String,
    killed: Instant,
) -> std::thread::JoinHandle<Option<(Duration, Duration)>> {
    std::thread::spawn(move || {
        let client = redis::Client::open(url).unwrap();
        let mut conn = None;
        let mut promoted = None;
        while killed.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(20));
            // Sentinel closes the promoted node's client connections: open another.
            if conn.is_none() {
                conn = client.get_connection().ok();
            }
            let Some(node) = conn.as_mut() else { continue };
            if promoted.is_none() {
                match redis::cmd("ROLE").query::<Vec<redis::Value>>(node) {
                    Ok(role) if matches!(role.first(), Some(redis::Value::BulkString(r)) if r == b"master") => {
                        promoted = Some(killed.elapsed())
                    }
                    Ok(_) => {}
                    Err(_) => {
                        conn = None;
                        continue;
                    }
                }
            }
            if evalsha_calls(node) > 0 {
                return Some((
                    promoted.unwrap_or_else(|| killed.elapsed()),
                    killed.elapsed(),
                ));
            }
        }
        None
    })
}
