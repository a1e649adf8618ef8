//! A real Kafka-protocol broker (tansu, in-memory storage) on a free loopback port, killed by PID
//! on drop; a producer and a reader for tests; and `vigil run` worker processes.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};

use super::free_port;

/// The tansu binary: `$TANSU`, else where `scripts/test.sh` installs it
/// (`~/.cache/vigil-tools/tansu-0.6.0/bin/tansu`, built with in-memory and SQLite storage), else
/// `~/.cargo/bin/tansu`, else `tansu` on the PATH.
fn tansu() -> PathBuf {
    if let Some(path) = std::env::var_os("TANSU") {
        return PathBuf::from(path);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
    [".cache/vigil-tools/tansu-0.6.0/bin/tansu", ".cargo/bin/tansu"]
        .into_iter()
        .map(|p| home.join(p))
        .find(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("tansu"))
}

pub struct Broker {
    child: Child,
    pub port: u16,
    /// SQLite storage directory of a persistent broker (`None`: in memory).
    storage: Option<PathBuf>,
}

impl Broker {
    /// Starts tansu with in-memory storage on a free port and waits until it answers a metadata
    /// request.
    pub fn start() -> Broker {
        Broker::start_in(None)
    }

    /// Starts tansu storing its topics and groups in a SQLite file in `dir`: a restart keeps them.
    pub fn start_persistent(dir: &Path) -> Broker {
        Broker::start_in(Some(dir.to_path_buf()))
    }

    fn spawn(port: u16, storage: Option<&Path>) -> Child {
        let url = format!("tcp://127.0.0.1:{port}");
        let mut command = Command::new(tansu());
        command
            .args(["broker", "--listener-url", &url, "--advertised-listener-url", &url])
            .args(["--cluster-id", "vigil-test"])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        match storage {
            // tansu opens the SQLite file relative to its working directory.
            Some(dir) => command.current_dir(dir).args(["--storage-engine", "sqlite://tansu.db"]),
            None => command.args(["--storage-engine", "memory://tansu/"]),
        };
        command.spawn().expect("tansu not found: run scripts/test.sh, which installs it")
    }

    fn start_in(storage: Option<PathBuf>) -> Broker {
        for _ in 0..5 {
            let port = free_port();
            let child = Broker::spawn(port, storage.as_deref());
            let mut broker = Broker { child, port, storage: storage.clone() };
            if broker.wait_until_serving() {
                return broker;
            }
        }
        panic!("could not start tansu on a free port (a persistent broker needs tansu built with SQLite storage: scripts/test.sh)");
    }

    /// Kills the broker (SIGKILL); `start_again` brings it back.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Kills the broker (SIGKILL) and starts it again on the same port with the same storage.
    pub fn restart(&mut self) {
        self.kill();
        self.start_again();
    }

    /// Starts a killed broker again on its port with its storage.
    pub fn start_again(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            self.child = Broker::spawn(self.port, self.storage.as_deref());
            if self.wait_until_serving() {
                return;
            }
            assert!(Instant::now() < deadline, "the broker did not come back on port {}", self.port);
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// True once this child serves metadata on the port; false if it exited (port taken).
    fn wait_until_serving(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if self.child.try_wait().ok().flatten().is_some() {
                return false;
            }
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                let consumer: BaseConsumer = ClientConfig::new()
                    .set("bootstrap.servers", self.bootstrap())
                    .set("log_level", "0")
                    .create()
                    .expect("metadata client");
                if consumer.fetch_metadata(None, Duration::from_secs(2)).is_ok() && self.child.try_wait().ok().flatten().is_none() {
                    return true;
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn create_topic(&self, name: &str, partitions: u32) {
        let status = Command::new(tansu())
            .args(["topic", "create", "--broker", &format!("tcp://127.0.0.1:{}", self.port)])
            .args(["--partitions", &partitions.to_string(), name])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("tansu topic create");
        assert!(status.success(), "tansu topic create {name} failed");
    }

    /// Produces `records` (key, payload) in order, each to `partition` if given, else by key.
    ///
    /// One record per batch: tansu 0.6.0's in-memory storage answers a fetch from an offset
    /// inside a batch with the batches *after* it (`offsets.split_off(&offset)` in
    /// tansu-storage's dynostore.rs), so a consumer resuming mid-batch would silently skip the
    /// rest of that batch. Apache Kafka returns the containing batch and the client skips what
    /// it did not ask for.
    pub fn produce(&self, topic: &str, records: &[(Option<Vec<u8>>, Vec<u8>)], partition: Option<i32>) {
        let producer: BaseProducer = ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .set("enable.idempotence", "true")
            .set("batch.num.messages", "1")
            .create()
            .expect("test producer");
        for (key, payload) in records {
            let mut record = BaseRecord::to(topic).payload(payload);
            if let Some(key) = key {
                record = record.key(key);
            }
            if let Some(partition) = partition {
                record = record.partition(partition);
            }
            record = record.headers(OwnedHeaders::new().insert(Header { key: "origin", value: Some("test") }));
            let mut record = record;
            loop {
                match producer.send(record) {
                    Ok(()) => break,
                    Err((_, back)) => {
                        record = back;
                        producer.poll(Duration::from_millis(10));
                    }
                }
            }
            producer.poll(Duration::ZERO);
        }
        producer.flush(Duration::from_secs(180)).expect("test records delivered");
    }

    /// Reads `topic` from the start of every partition until `wanted(records)` holds and no new
    /// record arrived for `quiet`, or `timeout` passes.
    pub fn read(&self, topic: &str, partitions: i32, wanted: impl Fn(&[Record]) -> bool, quiet: Duration, timeout: Duration) -> Vec<Record> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .set("group.id", format!("reader-{}", std::process::id()))
            .set("enable.auto.commit", "false")
            .create()
            .expect("test reader");
        let mut list = TopicPartitionList::new();
        for p in 0..partitions {
            list.add_partition_offset(topic, p, Offset::Beginning).unwrap();
        }
        consumer.assign(&list).expect("assign");
        let deadline = Instant::now() + timeout;
        let mut records = Vec::new();
        let mut last_new = Instant::now();
        while Instant::now() < deadline {
            match consumer.poll(Duration::from_millis(100)) {
                Some(Ok(m)) => {
                    let headers = m
                        .headers()
                        .map(|h| h.iter().map(|h| (h.key.to_owned(), String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned())).collect())
                        .unwrap_or_default();
                    records.push(Record {
                        partition: m.partition(),
                        offset: m.offset(),
                        key: m.key().map(<[u8]>::to_vec),
                        payload: m.payload().map(<[u8]>::to_vec).unwrap_or_default(),
                        headers,
                    });
                    last_new = Instant::now();
                }
                Some(Err(e)) => eprintln!("reader: {e}"),
                None => {
                    if wanted(&records) && last_new.elapsed() >= quiet {
                        break;
                    }
                }
            }
        }
        records
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The topics a worker uses: `events` with `events_partitions` partitions, `decisions` and
/// `events.dlq` with one each.
pub fn topics(broker: &Broker, events_partitions: u32) {
    broker.create_topic("events", events_partitions);
    broker.create_topic("decisions", 1);
    broker.create_topic("events.dlq", 1);
}

/// A record read back.
#[derive(Debug, Clone)]
pub struct Record {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    pub headers: BTreeMap<String, String>,
}

impl Record {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.payload).expect("a JSON record")
    }
}

/// A `vigil run` process with its config file and log, killed on drop.
pub struct Worker {
    child: Child,
    pub http_port: u16,
    pub log: PathBuf,
}

impl Worker {
    /// Writes `config` (its `[http]` section is added here) to `dir/name.toml` and starts the
    /// worker.
    pub fn start(dir: &Path, name: &str, config: &str) -> Worker {
        let http_port = free_port();
        let config_path = dir.join(format!("{name}.toml"));
        std::fs::write(&config_path, format!("{config}\n[http]\nlisten = \"127.0.0.1:{http_port}\"\n")).unwrap();
        let log = dir.join(format!("{name}.log"));
        let log_file = std::fs::OpenOptions::new().create(true).append(true).open(&log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_vigil"))
            .args(["run", "--config"])
            .arg(&config_path)
            .env("RUST_LOG", "info,librdkafka=warn,rdkafka=warn")
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("vigil binary");
        Worker { child, http_port, log }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// GET `path` on the worker's HTTP port: (status, body).
    pub fn get(&self, path: &str) -> Option<(u16, String)> {
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", self.http_port)).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(stream, "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").ok()?;
        let mut response = String::new();
        stream.read_to_string(&mut response).ok()?;
        let status = response.split_whitespace().nth(1)?.parse().ok()?;
        let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
        Some((status, body))
    }

    pub fn wait_ready(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("worker exited with {status} before it was ready:\n{}", self.log_text());
            }
            if self.get("/readyz").is_some_and(|(status, _)| status == 200) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("worker not ready in {timeout:?}:\n{}", self.log_text());
    }

    /// The value of a metric line (`name{labels}` exactly as exported), if present.
    pub fn metric(&self, series: &str) -> Option<f64> {
        let (_, body) = self.get("/metrics")?;
        body.lines().find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill").args([&format!("-{signal}"), &self.child.id().to_string()]).status().unwrap();
        assert!(status.success());
    }

    /// Waits for the process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.kill();
    }
}
