//! Apache Kafka itself for the tests: single-node KRaft brokers (Kafka's own storage format step,
//! then the broker) on free loopback ports with temporary log directories, started from the jars
//! `scripts/test.sh` fetches from Maven Central and stopped by PID; Kafka's own command-line tools;
//! a producer and a reader for tests; and `vigil run` worker processes.
//!
//! Most tests share one broker per test binary ([`Broker::shared`]) with topics and a consumer
//! group of their own ([`Broker::topics`]); a test that kills or restarts the broker starts its
//! own ([`Broker::start`]). A failing test prints the broker's log.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};

use super::free_port;

/// The Kafka version pinned in `scripts/kafka/pom.xml` (the one place it is written).
fn kafka_version() -> String {
    let pom = std::fs::read_to_string(scripts().join("pom.xml")).expect("scripts/kafka/pom.xml");
    pom.lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("<kafka.version>")
                .and_then(|rest| rest.strip_suffix("</kafka.version>"))
        })
        .expect("a <kafka.version> line in scripts/kafka/pom.xml")
        .to_owned()
}

fn scripts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/kafka")
}

/// The broker's jars: `$VIGIL_KAFKA_LIBS`, else where `scripts/test.sh` puts them
/// (`~/.cache/vigil-tools/kafka-<version>/libs`).
pub fn kafka_libs() -> PathBuf {
    if let Some(path) = std::env::var_os("VIGIL_KAFKA_LIBS") {
        return PathBuf::from(path);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    let libs = home.join(format!(".cache/vigil-tools/kafka-{}/libs", kafka_version()));
    assert!(
        libs.join(".complete").exists(),
        "Apache Kafka's jars are not in {}: run scripts/test.sh, which fetches them",
        libs.display()
    );
    libs
}

/// `java` running one of Kafka's command-line tools (`class`), its own logs on stderr.
pub fn kafka_tool(class: &str) -> Command {
    let mut command = Command::new("java");
    command
        .arg(format!(
            "-Dlog4j2.configurationFile={}",
            scripts().join("log4j2-tools.properties").display()
        ))
        .arg("-cp")
        .arg(format!("{}/*", kafka_libs().display()))
        .arg(class);
    command
}

/// Spawns children from one thread that lives as long as the test process, each with a parent
/// death signal: the kernel kills a broker when the test process ends, however it ends (the
/// signal follows the spawning *thread*, so a test thread would take the shared broker with it).
fn spawn_for_life(mut command: Command) -> std::io::Result<Child> {
    type Request = (Command, mpsc::Sender<std::io::Result<Child>>);
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<Request>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("kafka-spawner".into())
            .spawn(move || {
                while let Ok((mut command, reply)) = rx.recv() {
                    let _ = reply.send(command.spawn());
                }
                // Never returns while the process lives: the senders are in a static.
                loop {
                    std::thread::park();
                }
            })
            .expect("spawner thread");
        Mutex::new(tx)
    });
    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        use std::os::unix::process::CommandExt;
        command.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let (reply, answer) = mpsc::channel();
    spawner
        .lock()
        .unwrap()
        .send((command, reply))
        .expect("spawner alive");
    answer.recv().expect("spawner answers")
}

/// How a broker's clients connect: the listener's security protocol and what a client needs
/// for it.
#[derive(Clone, Default)]
pub struct Security {
    /// Broker properties for the client listener (`listener.name.…`, `ssl.…`, `sasl.…`).
    pub broker_properties: Vec<(String, String)>,
    /// Extra arguments to Kafka's storage format step (`--add-scram …`).
    pub format_args: Vec<String>,
    /// The client listener's protocol: `PLAINTEXT` when empty.
    pub protocol: String,
    /// librdkafka properties the harness's own clients use (admin, producer, reader).
    pub client_properties: Vec<(String, String)>,
}

impl Security {
    /// A client listener that takes SASL/SCRAM-SHA-256 over TLS only: the broker's certificate
    /// is `certificates.cert` (signed by `certificates.ca`), and `user` / `password` is the one
    /// credential, created by the storage format step.
    pub fn scram_over_tls(
        dir: &Path,
        certificates: &super::TestCertificates,
        user: &str,
        password: &str,
    ) -> Security {
        // Kafka's PEM keystore: the private key, then the certificate.
        let keystore = dir.join("broker-keystore.pem");
        let pem = std::fs::read_to_string(&certificates.key).unwrap()
            + &std::fs::read_to_string(&certificates.cert).unwrap();
        std::fs::write(&keystore, pem).unwrap();
        let pairs = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|&(k, v)| (k.to_owned(), v.to_owned()))
                .collect::<Vec<_>>()
        };
        Security {
            broker_properties: pairs(&[
                ("sasl.enabled.mechanisms", "SCRAM-SHA-256"),
                // The server side of SCRAM needs a login module, not a credential: brokers talk
                // among themselves on a plaintext listener.
                (
                    "listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config",
                    "org.apache.kafka.common.security.scram.ScramLoginModule required;",
                ),
                ("ssl.keystore.type", "PEM"),
                ("ssl.keystore.location", &keystore.display().to_string()),
            ]),
            format_args: vec![
                "--add-scram".into(),
                format!("SCRAM-SHA-256=[name={user},password={password}]"),
            ],
            protocol: "SASL_SSL".into(),
            client_properties: pairs(&[
                ("security.protocol", "SASL_SSL"),
                ("sasl.mechanism", "SCRAM-SHA-256"),
                ("sasl.username", user),
                ("sasl.password", password),
                ("ssl.ca.location", &certificates.ca.display().to_string()),
            ]),
        }
    }
}

pub struct Broker {
    child: Option<Child>,
    pub port: u16,
    controller_port: u16,
    inter_broker_port: u16,
    dir: PathBuf,
    /// Removes `dir` when this broker is dropped (not for the shared broker, removed at exit).
    _owned_dir: Option<tempfile::TempDir>,
    security: Security,
}

/// A record to produce: key, payload and timestamp (`None`: the producer's clock).
pub type StampedRecord = (Option<Vec<u8>>, Vec<u8>, Option<i64>);

impl Broker {
    /// A broker of this test's own (for a test that kills or restarts it).
    pub fn start() -> Broker {
        Broker::start_secured(Security::default())
    }

    /// A broker of this test's own whose client listener is secured as `security` says.
    pub fn start_secured(security: Security) -> Broker {
        let dir = tempfile::Builder::new()
            .prefix("vigil-kafka-")
            .tempdir()
            .expect("broker directory");
        let path = dir.path().to_path_buf();
        Broker::launch(path, Some(dir), security)
    }

    /// The broker this test binary's tests share (started on first use, stopped when the test
    /// process exits). Give each test its own topics and group with [`Broker::topics`].
    pub fn shared() -> SharedBroker {
        static SHARED: OnceLock<Broker> = OnceLock::new();
        let broker = SHARED.get_or_init(|| {
            remove_stale_shared_dirs();
            let dir =
                std::env::temp_dir().join(format!("vigil-kafka-shared-{}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("shared broker directory");
            let broker = Broker::launch(dir, None, Security::default());
            stop_at_exit(broker.child.as_ref().map_or(0, Child::id), &broker.dir);
            broker
        });
        let log_from = std::fs::metadata(broker.log_path()).map_or(0, |m| m.len());
        SharedBroker { broker, log_from }
    }

    fn launch(dir: PathBuf, owned_dir: Option<tempfile::TempDir>, security: Security) -> Broker {
        let mut broker = Broker {
            child: None,
            port: 0,
            controller_port: 0,
            inter_broker_port: 0,
            dir,
            _owned_dir: owned_dir,
            security,
        };
        for attempt in 0..5 {
            (
                broker.port,
                broker.controller_port,
                broker.inter_broker_port,
            ) = (free_port(), free_port(), free_port());
            broker.write_properties();
            if attempt == 0 {
                broker.format();
            }
            broker.child = Some(broker.spawn());
            if broker.wait_until_serving() {
                return broker;
            }
            broker.kill();
        }
        panic!(
            "could not start Apache Kafka on free ports; its log:\n{}",
            broker.log_tail(200)
        );
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("broker.log")
    }

    fn properties_path(&self) -> PathBuf {
        self.dir.join("server.properties")
    }

    fn secured(&self) -> bool {
        !self.security.protocol.is_empty() && self.security.protocol != "PLAINTEXT"
    }

    /// A single node that is both controller and broker. With a secured client listener, brokers
    /// talk among themselves on a plaintext listener of their own.
    fn write_properties(&self) {
        let (port, controller, inter) = (self.port, self.controller_port, self.inter_broker_port);
        let mut properties = vec![
            ("process.roles".to_owned(), "broker,controller".to_owned()),
            ("node.id".into(), "1".into()),
            (
                "controller.quorum.voters".into(),
                format!("1@127.0.0.1:{controller}"),
            ),
            ("controller.listener.names".into(), "CONTROLLER".into()),
            ("log.dirs".into(), self.data_dir().display().to_string()),
            ("num.partitions".into(), "1".into()),
            ("offsets.topic.replication.factor".into(), "1".into()),
            ("offsets.topic.num.partitions".into(), "1".into()),
            (
                "transaction.state.log.replication.factor".into(),
                "1".into(),
            ),
            ("transaction.state.log.min.isr".into(), "1".into()),
            (
                "share.coordinator.state.topic.replication.factor".into(),
                "1".into(),
            ),
            ("share.coordinator.state.topic.min.isr".into(), "1".into()),
            ("group.initial.rebalance.delay.ms".into(), "0".into()),
            // The crash tests give members a 1.5 s session so a killed worker's partitions move
            // on quickly (the broker's default floor is 6 s).
            ("group.min.session.timeout.ms".into(), "500".into()),
        ];
        if self.secured() {
            let protocol = &self.security.protocol;
            properties.extend([
                ("listeners".into(), format!("{protocol}://127.0.0.1:{port},BROKER://127.0.0.1:{inter},CONTROLLER://127.0.0.1:{controller}")),
                ("advertised.listeners".into(), format!("{protocol}://127.0.0.1:{port},BROKER://127.0.0.1:{inter}")),
                ("listener.security.protocol.map".into(), format!("{protocol}:{protocol},BROKER:PLAINTEXT,CONTROLLER:PLAINTEXT")),
                ("inter.broker.listener.name".into(), "BROKER".into()),
            ]);
        } else {
            properties.extend([
                (
                    "listeners".into(),
                    format!("PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller}"),
                ),
                (
                    "advertised.listeners".into(),
                    format!("PLAINTEXT://127.0.0.1:{port}"),
                ),
                (
                    "listener.security.protocol.map".into(),
                    "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT".into(),
                ),
                ("inter.broker.listener.name".into(), "PLAINTEXT".into()),
            ]);
        }
        properties.extend(self.security.broker_properties.iter().cloned());
        let text: String = properties
            .iter()
            .map(|(k, v)| format!("{k}={v}\n"))
            .collect();
        std::fs::write(self.properties_path(), text).expect("server.properties");
    }

    /// Kafka's storage format step: a fresh cluster id, and whatever `format_args` adds.
    fn format(&self) {
        let cluster_id = random_kafka_uuid();
        let output = kafka_tool("kafka.tools.StorageTool")
            .args(["format", "-t", &cluster_id, "-c"])
            .arg(self.properties_path())
            .args(&self.security.format_args)
            .output()
            .expect("java (Kafka's storage tool): run scripts/test.sh, which installs Java");
        assert!(
            output.status.success(),
            "Kafka's storage format step failed:\n{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }

    fn spawn(&self) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("broker.log");
        let mut command = Command::new("java");
        command
            .args(["-Xms128m", "-Xmx512m"])
            .arg(format!(
                "-Dlog4j2.configurationFile={}",
                scripts().join("log4j2-broker.properties").display()
            ))
            .arg("-cp")
            .arg(format!("{}/*", kafka_libs().display()))
            .arg("kafka.Kafka")
            .arg(self.properties_path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("broker.log"))
            .stderr(log);
        spawn_for_life(command).expect("java: run scripts/test.sh, which installs Java")
    }

    /// True once this child answers a metadata request; false if it exited (a port was taken).
    fn wait_until_serving(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if self
                .child
                .as_mut()
                .is_none_or(|c| c.try_wait().ok().flatten().is_some())
            {
                return false;
            }
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                let consumer: BaseConsumer = self
                    .client_config()
                    .set("log_level", "0")
                    .create()
                    .expect("metadata client");
                if consumer
                    .fetch_metadata(None, Duration::from_secs(2))
                    .is_ok_and(|m| !m.brokers().is_empty())
                {
                    return true;
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    /// A client config for this broker, with the client listener's security properties.
    pub fn client_config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", self.bootstrap());
        for (key, value) in &self.security.client_properties {
            config.set(key, value);
        }
        config
    }

    /// Kills the broker (SIGKILL); `start_again` brings it back.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts a killed broker again on its ports with its log directory.
    pub fn start_again(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            self.child = Some(self.spawn());
            if self.wait_until_serving() {
                return;
            }
            self.kill();
            assert!(
                Instant::now() < deadline,
                "the broker did not come back on port {}:\n{}",
                self.port,
                self.log_tail(100)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The last `lines` lines of the broker's log.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(
            &std::fs::read_to_string(self.log_path()).unwrap_or_default(),
            lines,
        )
    }

    pub fn create_topic(&self, name: &str, partitions: u32) {
        let admin: AdminClient<DefaultClientContext> =
            self.client_config().create().expect("admin client");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let topic = NewTopic::new(name, partitions as i32, TopicReplication::Fixed(1));
        let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
        let results = runtime
            .block_on(admin.create_topics([&topic], &options))
            .expect("create topics request");
        for result in results {
            result.unwrap_or_else(|(topic, e)| panic!("create topic {topic}: {e}"));
        }
    }

    /// Fresh topics (events with `events_partitions` partitions, decisions and dead letters with
    /// one each) and a consumer group, named after `test` and unique in this process.
    pub fn topics(&self, test: &str, events_partitions: u32) -> Topics {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = |what: &str| format!("{test}-{n}-{what}");
        let topics = Topics {
            events: name("events"),
            decisions: name("decisions"),
            dead_letters: name("dlq"),
            group: name("group"),
        };
        self.create_topic(&topics.events, events_partitions);
        self.create_topic(&topics.decisions, 1);
        self.create_topic(&topics.dead_letters, 1);
        topics
    }

    /// Produces `records` (key, payload) in order, each to `partition` if given, else by key, as
    /// a user's producer would: idempotent, `acks=all`, batched (`linger.ms` 5).
    pub fn produce(
        &self,
        topic: &str,
        records: &[(Option<Vec<u8>>, Vec<u8>)],
        partition: Option<i32>,
    ) {
        let unstamped: Vec<_> = records
            .iter()
            .map(|(k, p)| (k.clone(), p.clone(), None))
            .collect();
        self.produce_stamped(topic, &unstamped, partition);
    }

    /// [`Broker::produce`] with each record's timestamp (`None`: the producer's clock).
    pub fn produce_stamped(&self, topic: &str, records: &[StampedRecord], partition: Option<i32>) {
        let producer: BaseProducer = self
            .client_config()
            .set("enable.idempotence", "true")
            .set("linger.ms", "5")
            .create()
            .expect("test producer");
        for (key, payload, timestamp) in records {
            let mut record = BaseRecord::to(topic).payload(payload);
            if let Some(timestamp) = timestamp {
                record = record.timestamp(*timestamp);
            }
            if let Some(key) = key {
                record = record.key(key);
            }
            if let Some(partition) = partition {
                record = record.partition(partition);
            }
            let mut record = record.headers(OwnedHeaders::new().insert(Header {
                key: "origin",
                value: Some("test"),
            }));
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
        producer
            .flush(Duration::from_secs(180))
            .expect("test records delivered");
    }

    /// The number of records in each batch of `topic`'s `partition`, in log order, as Kafka's
    /// own log dump tool reads them from the broker's log directory.
    pub fn batch_sizes(&self, topic: &str, partition: i32) -> Vec<u64> {
        let dir = self.data_dir().join(format!("{topic}-{partition}"));
        let mut segments: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "log"))
            .collect();
        segments.sort();
        let output = kafka_tool("org.apache.kafka.tools.DumpLogSegments")
            .arg("--files")
            .arg(
                segments
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(","),
            )
            .output()
            .expect("DumpLogSegments");
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter_map(|l| l.split(" count: ").nth(1))
            .map(|rest| rest.split_whitespace().next().unwrap().parse().unwrap())
            .collect()
    }

    /// Reads `topic` from the start of every partition until `wanted(records)` holds and no new
    /// record arrived for `quiet`, or `timeout` passes.
    pub fn read(
        &self,
        topic: &str,
        partitions: i32,
        wanted: impl Fn(&[Record]) -> bool,
        quiet: Duration,
        timeout: Duration,
    ) -> Vec<Record> {
        let consumer: BaseConsumer = self
            .client_config()
            .set("group.id", format!("reader-{}", std::process::id()))
            .set("enable.auto.commit", "false")
            .set("fetch.wait.max.ms", "50")
            .create()
            .expect("test reader");
        let mut list = TopicPartitionList::new();
        for p in 0..partitions {
            list.add_partition_offset(topic, p, Offset::Beginning)
                .unwrap();
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
                        .map(|h| {
                            h.iter()
                                .map(|h| {
                                    (
                                        h.key.to_owned(),
                                        String::from_utf8_lossy(h.value.unwrap_or_default())
                                            .into_owned(),
                                    )
                                })
                                .collect()
                        })
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
        self.kill();
        if std::thread::panicking() {
            eprintln!(
                "--- broker log ({}), last 200 lines ---\n{}",
                self.log_path().display(),
                self.log_tail(200)
            );
        }
    }
}

/// The shared broker, for one test: prints what the broker logged during the test if it fails.
pub struct SharedBroker {
    broker: &'static Broker,
    log_from: u64,
}

impl std::ops::Deref for SharedBroker {
    type Target = Broker;
    fn deref(&self) -> &Broker {
        self.broker
    }
}

impl Drop for SharedBroker {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let mut text = String::new();
        if let Ok(mut file) = std::fs::File::open(self.broker.log_path()) {
            let _ = file.seek(SeekFrom::Start(self.log_from));
            let _ = file.read_to_string(&mut text);
        }
        eprintln!(
            "--- shared broker log during this test ({}), last 200 lines ---\n{}",
            self.broker.log_path().display(),
            tail(&text, 200)
        );
    }
}

/// Removes shared-broker directories left by test processes that are gone (one that failed
/// before its broker started registers no exit hook).
fn remove_stale_shared_dirs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("vigil-kafka-shared-"))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Registers the shared broker's PID and directory to be stopped and removed when the test
/// process exits normally (the parent death signal covers every other way it ends).
fn stop_at_exit(pid: u32, dir: &Path) {
    static SHARED_AT_EXIT: OnceLock<(u32, PathBuf)> = OnceLock::new();
    extern "C" fn stop() {
        if let Some((pid, dir)) = SHARED_AT_EXIT.get() {
            // SAFETY: plain syscalls on the child this process started.
            unsafe {
                libc::kill(*pid as libc::pid_t, libc::SIGKILL);
                libc::waitpid(*pid as libc::pid_t, std::ptr::null_mut(), 0);
            }
            let _ = std::fs::remove_dir_all(dir);
        }
    }
    if SHARED_AT_EXIT.set((pid, dir.to_path_buf())).is_ok() {
        // SAFETY: registers a plain function.
        unsafe {
            libc::atexit(stop);
        }
    }
}

/// A Kafka cluster id: 16 random bytes, base64url without padding, as Kafka's `Uuid` prints it.
fn random_kafka_uuid() -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut bytes: [u8; 16] = rand::random();
    // An id starting with '-' reads as an option to the storage tool's argument parser (seen:
    // one failed run in 64): the first character comes from the top six bits.
    if bytes[0] >> 2 == 62 {
        bytes[0] &= 0x7f;
    }
    let mut bits = 0u32;
    let mut held = 0;
    let mut out = String::new();
    for byte in bytes {
        bits = (bits << 8) | u32::from(byte);
        held += 8;
        while held >= 6 {
            held -= 6;
            out.push(ALPHABET[((bits >> held) & 63) as usize] as char);
        }
    }
    if held > 0 {
        out.push(ALPHABET[((bits << (6 - held)) & 63) as usize] as char);
    }
    out
}

/// One test's topics and consumer group on a (possibly shared) broker.
#[derive(Debug, Clone)]
pub struct Topics {
    pub events: String,
    pub decisions: String,
    pub dead_letters: String,
    pub group: String,
}

impl Topics {
    /// The `[kafka]` section of a worker's config for these topics on `broker` (more keys of
    /// that section may follow it).
    pub fn kafka_section(&self, broker: &Broker) -> String {
        format!(
            "[kafka]\nbrokers = \"{}\"\ngroup_id = \"{}\"\ninput_topics = [\"{}\"]\ndecisions_topic = \"{}\"\ndead_letter_topic = \"{}\"\n",
            broker.bootstrap(),
            self.group,
            self.events,
            self.decisions,
            self.dead_letters
        )
    }
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
        Worker::start_with_env(dir, name, config, &[])
    }

    /// As [`Worker::start`], with extra environment variables.
    pub fn start_with_env(dir: &Path, name: &str, config: &str, env: &[(&str, &str)]) -> Worker {
        let http_port = free_port();
        let config_path = dir.join(format!("{name}.toml"));
        std::fs::write(
            &config_path,
            format!("{config}\n[http]\nlisten = \"127.0.0.1:{http_port}\"\n"),
        )
        .unwrap();
        let log = dir.join(format!("{name}.log"));
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_vigil"))
            .args(["run", "--config"])
            .arg(&config_path)
            .env("RUST_LOG", "info,librdkafka=warn,rdkafka=warn")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("vigil binary");
        Worker {
            child,
            http_port,
            log,
        }
    }

    /// Starts a worker that is expected to stop on its own (a refused configuration) and waits up
    /// to 30 s for it: its exit code, how long it ran and its log. Panics if it still runs.
    pub fn run_until_it_stops(
        dir: &Path,
        name: &str,
        config: &str,
        env: &[(&str, &str)],
    ) -> (Option<i32>, Duration, String) {
        let started = Instant::now();
        let mut worker = Worker::start_with_env(dir, name, config, env);
        let status = worker.wait_exit(Duration::from_secs(30));
        let log = worker.log_text();
        let status = status.unwrap_or_else(|| {
            panic!("the worker still runs after 30 s (it must not retry a refusal forever):\n{log}")
        });
        (status.code(), started.elapsed(), log)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// GET `path` on the worker's HTTP port: (status, body).
    pub fn get(&self, path: &str) -> Option<(u16, String)> {
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", self.http_port)).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut response = String::new();
        stream.read_to_string(&mut response).ok()?;
        let status = response.split_whitespace().nth(1)?.parse().ok()?;
        let body = response
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        Some((status, body))
    }

    pub fn wait_ready(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!(
                    "worker exited with {status} before it was ready:\n{}",
                    self.log_text()
                );
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
        body.lines().find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.strip_prefix(' '))
                .and_then(|v| v.trim().parse().ok())
        })
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .unwrap();
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
        // A failed test shows what its workers logged (their directory goes with the test).
        if std::thread::panicking() {
            let text = self.log_text();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(300)..];
            eprintln!(
                "--- {} (last {} lines) ---\n{}",
                self.log.display(),
                tail.len(),
                tail.join("\n")
            );
        }
    }
}
