//! `vigil bench --kafka BROKERS`: the worker end to end on a real broker. Events (the generated
//! workload, or the lines of `--input`) are produced to a fresh topic first; one in-process
//! worker (`worker::run`, the code `vigil run` runs) then drains it at saturation; then
//! generated events are produced at half that rate with their event time set to the wall clock,
//! and the latency from production to the decision being consumed is measured on the decisions
//! topic.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication, TopicResult};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaResult;
use rdkafka::message::Message;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};

use crate::config::Config;
use crate::worker;
use crate::rules::RuleSet;
use crate::shutdown::Shutdown;
use crate::telemetry::http::Health;
use crate::telemetry::Metrics;
use super::workload::{generate, WorkloadSpec};

/// librdkafka properties, as `kafka.properties` holds them.
type Properties = std::collections::BTreeMap<String, String>;

/// What `vigil bench --kafka` was asked to measure.
pub struct KafkaBenchArgs {
    pub brokers: String,
    /// Count in this Redis instead of in process.
    pub redis: Option<String>,
    pub rules_path: std::path::PathBuf,
    /// Produce this file's lines as the backlog instead of the generated workload.
    pub input: Option<std::path::PathBuf>,
    pub workload: WorkloadSpec,
    pub partitions: i32,
    pub latency_seconds: u64,
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

fn user_key(line: &[u8]) -> Option<&[u8]> {
    // Generated lines carry `"user_id":"u-N"`; the key is the value's bytes.
    let start = line.windows(11).position(|w| w == b"\"user_id\":\"")? + 11;
    let len = line[start..].iter().position(|&b| b == b'"')?;
    Some(&line[start..start + len])
}

/// The generated events of `spec`, one line each.
fn lines(spec: &WorkloadSpec) -> Result<Vec<Vec<u8>>, String> {
    let mut out = Vec::new();
    generate(spec, &mut out).map_err(|e| e.to_string())?;
    Ok(split_lines(&out))
}

/// The non-empty lines of `bytes`, each one record.
fn split_lines(bytes: &[u8]) -> Vec<Vec<u8>> {
    bytes.split(|&b| b == b'\n').filter(|l| !l.is_empty()).map(<[u8]>::to_vec).collect()
}

fn producer(brokers: &str) -> Result<BaseProducer, String> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("linger.ms", "1")
        .set("queue.buffering.max.messages", "1000000")
        .create()
        .map_err(|e| format!("producer: {e}"))
}

fn send(producer: &BaseProducer, topic: &str, line: &[u8]) {
    let mut record = BaseRecord::<[u8], [u8]>::to(topic).payload(line);
    if let Some(key) = user_key(line) {
        record = record.key(key);
    }
    let mut record = record;
    loop {
        match producer.send(record) {
            Ok(()) => return,
            Err((_, back)) => {
                record = back;
                producer.poll(Duration::from_millis(1));
            }
        }
    }
}

/// A consumer outside any group (assigned by hand) with the given librdkafka properties.
fn reader(brokers: &str, group: &str, properties: &Properties) -> Result<BaseConsumer, String> {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", brokers).set("group.id", group).set("enable.auto.commit", "false");
    for (key, value) in properties {
        config.set(key, value);
    }
    config.create().map_err(|e| format!("reader: {e}"))
}

/// A paced production: `lines` at `rate` per second from `start` (epoch ms).
struct Pace<'a> {
    lines: &'a [Vec<u8>],
    rate: u64,
    start: i64,
}

/// Produces the paced lines to `topic` (each line's `ts` is its due time) while `reader` reads
/// `read_topic` from its end; returns the latencies in ms (time read minus `ts`) of records with
/// `ts >= start`, sorted.
fn paced(
    producer: &BaseProducer,
    topic: &str,
    reader: &BaseConsumer,
    read_topic: &str,
    pace: &Pace<'_>,
    settled: &dyn Fn() -> bool,
) -> Result<Vec<i64>, String> {
    let Pace { lines, rate, start } = *pace;
    let (_, high) = reader.fetch_watermarks(read_topic, 0, Duration::from_secs(10)).map_err(|e| format!("watermarks: {e}"))?;
    let mut list = TopicPartitionList::new();
    list.add_partition_offset(read_topic, 0, Offset::Offset(high)).map_err(|e| e.to_string())?;
    reader.assign(&list).map_err(|e| e.to_string())?;
    let mut latencies = Vec::new();
    std::thread::scope(|scope| {
        let reading = Shutdown::new();
        let reader_thread = {
            let reading = reading.clone();
            scope.spawn(move || {
                let mut latencies = Vec::new();
                while !reading.is_triggered() {
                    if let Some(Ok(message)) = reader.poll(Duration::from_millis(50)) {
                        let received = now_ms();
                        let ts = message
                            .payload()
                            .and_then(|p| serde_json::from_slice::<serde_json::Value>(p).ok())
                            .and_then(|v| v["ts"].as_i64());
                        if let Some(ts) = ts.filter(|&ts| ts >= start) {
                            latencies.push(received - ts);
                        }
                    }
                }
                latencies
            })
        };
        while now_ms() < start {
            std::thread::sleep(Duration::from_millis(1));
        }
        for (n, line) in lines.iter().enumerate() {
            let due = start + (n as i64 * 1000) / rate as i64;
            while now_ms() < due {
                producer.poll(Duration::ZERO);
                std::thread::sleep(Duration::from_micros(200));
            }
            send(producer, topic, line);
            producer.poll(Duration::ZERO);
        }
        let _ = producer.flush(Duration::from_secs(60));
        let deadline = Instant::now() + Duration::from_secs(60);
        while !settled() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_secs(1));
        reading.trigger();
        latencies = reader_thread.join().unwrap_or_default();
    });
    latencies.sort_unstable();
    Ok(latencies)
}

/// `vigil gen --kafka`: produces the generated events to `topic`, keyed by user, and waits for
/// every acknowledgement. Returns how many were produced. Streams: memory stays bounded.
pub fn produce_generated(brokers: &str, topic: &str, spec: &WorkloadSpec) -> Result<u64, String> {
    /// Splits what the generator writes into lines, each produced as one record.
    struct Lines<'a> {
        producer: &'a BaseProducer,
        topic: &'a str,
        partial: Vec<u8>,
        produced: u64,
    }
    impl Write for Lines<'_> {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.partial.extend_from_slice(bytes);
            while let Some(end) = self.partial.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.partial.drain(..=end).collect();
                send(self.producer, self.topic, &line[..line.len() - 1]);
                self.producer.poll(Duration::ZERO);
                self.produced += 1;
            }
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let producer = producer(brokers)?;
    let mut lines = Lines { producer: &producer, topic, partial: Vec::new(), produced: 0 };
    generate(spec, &mut lines).map_err(|e| e.to_string())?;
    let produced = lines.produced;
    producer.flush(Duration::from_secs(120)).map_err(|e| format!("not every event was acknowledged: {e}"))?;
    Ok(produced)
}

fn percentile(sorted: &[i64], p: f64) -> i64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1]
}

/// Runs the benchmark and writes its report: the backlog (`--input`'s lines, else the generated
/// workload) produced to fresh topics, the bare consumer's rate, the worker's saturation, then
/// latency at half that load and the broker's own one-hop latency.
pub fn run(args: &KafkaBenchArgs, rules: RuleSet, out: &mut impl Write) -> Result<(), String> {
    // Read first: a bad --input fails before anything is created on the cluster.
    let backlog = backlog(args)?;
    let topics = Topics::fresh();
    let admin = Admin::connect(&args.brokers)?;
    admin.create_all(&[(&topics.events, args.partitions), (&topics.decisions, 1), (&topics.dead_letters, 1)])?;

    // Phase 1: the backlog.
    let producer = producer(&args.brokers)?;
    let produce_secs = produce_backlog(&producer, &topics.events, &backlog)?;
    let from = args.input.as_ref().map(|p| format!(" from {}", p.display())).unwrap_or_default();
    writeln!(out, "vigil bench --kafka (one worker, {} partitions, {} active rules)", args.partitions, rules.active().len())
        .map_err(|e| e.to_string())?;
    writeln!(out, "  backlog          {} events{from} produced in {produce_secs:.1}s ({:.0} events/s)", backlog.len(), backlog.len() as f64 / produce_secs)
        .map_err(|e| e.to_string())?;

    let config_env: Vec<(String, String)> = std::env::vars().collect();
    let properties = Config::parse("bench", &format!("[kafka]\nbrokers = {:?}\n", args.brokers), config_env.clone())
        .map_err(|e| e.to_string())?
        .kafka
        .properties;
    let bare_rate = bare_consumer_rate(args, &topics, backlog.len() as u64, &properties, out)?;

    // The worker, in this process.
    let worker = BenchWorker::start(worker_config(args, &topics, config_env)?, rules)?;
    let total = backlog.len() as u64;
    let saturation = worker.saturation(total, bare_rate, out)?;

    if args.input.is_some() {
        writeln!(out, "  (the latency phases produce generated events: their event time must be the wall clock)").map_err(|e| e.to_string())?;
    }
    let phase = LatencyPhase { args, admin: &admin, topics: &topics, producer: &producer, properties: &properties };
    let (rate, spec) = phase.through_worker(&worker, total, saturation, out)?;
    phase.broker_alone(rate, spec, out)?;
    worker.stop()
}

/// The topics of one benchmark run, all fresh (`bench-<pid>-<ms>-…`).
struct Topics {
    run_id: String,
    events: String,
    decisions: String,
    dead_letters: String,
}

impl Topics {
    fn fresh() -> Topics {
        let run_id = format!("{}-{}", std::process::id(), now_ms());
        let (events, decisions, dead_letters) =
            (format!("bench-{run_id}-events"), format!("bench-{run_id}-decisions"), format!("bench-{run_id}-dlq"));
        Topics { run_id, events, decisions, dead_letters }
    }
}

/// Creates topics on the cluster, one replica each.
struct Admin {
    client: AdminClient<DefaultClientContext>,
    runtime: tokio::runtime::Runtime,
}

impl Admin {
    fn connect(brokers: &str) -> Result<Admin, String> {
        let client = ClientConfig::new().set("bootstrap.servers", brokers).create().map_err(|e| format!("admin client: {e}"))?;
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
        Ok(Admin { client, runtime })
    }

    fn request(&self, topics: &[(&str, i32)]) -> KafkaResult<Vec<TopicResult>> {
        let topics: Vec<NewTopic<'_>> =
            topics.iter().map(|&(name, partitions)| NewTopic::new(name, partitions, TopicReplication::Fixed(1))).collect();
        self.runtime.block_on(self.client.create_topics(&topics, &AdminOptions::new()))
    }

    /// Creates `(name, partitions)` topics; any one that fails is an error.
    fn create_all(&self, topics: &[(&str, i32)]) -> Result<(), String> {
        for result in self.request(topics).map_err(|e| format!("create topics: {e}"))? {
            result.map_err(|(topic, e)| format!("create topic {topic}: {e}"))?;
        }
        Ok(())
    }

    /// Creates one topic; only a failed request is an error (an existing topic is fine).
    fn create(&self, topic: &str, partitions: i32) -> Result<(), String> {
        self.request(&[(topic, partitions)]).map_err(|e| format!("create topic: {e}"))?;
        Ok(())
    }
}

/// The backlog's events: the lines of `--input` if given (what the user asked to produce), else
/// the generated workload.
fn backlog(args: &KafkaBenchArgs) -> Result<Vec<Vec<u8>>, String> {
    match &args.input {
        Some(path) => {
            let bytes = std::fs::read(path).map_err(|e| format!("{}: cannot read input: {e}", path.display()))?;
            Ok(split_lines(&bytes))
        }
        None => lines(&args.workload),
    }
}

/// Produces every line to `topic` and waits for the acknowledgements; returns the seconds taken.
fn produce_backlog(producer: &BaseProducer, topic: &str, backlog: &[Vec<u8>]) -> Result<f64, String> {
    let started = Instant::now();
    for line in backlog {
        send(producer, topic, line);
        producer.poll(Duration::ZERO);
    }
    producer.flush(Duration::from_secs(300)).map_err(|e| format!("flush: {e}"))?;
    Ok(started.elapsed().as_secs_f64())
}

/// The broker alone: how fast a bare consumer drains the backlog of `total` events (the ceiling
/// for any consumer on this machine), with the same librdkafka properties as the worker. Writes
/// the line and returns the events/s.
fn bare_consumer_rate(args: &KafkaBenchArgs, topics: &Topics, total: u64, properties: &Properties, out: &mut impl Write) -> Result<f64, String> {
    let bare = reader(&args.brokers, &format!("bench-{}-bare", topics.run_id), properties)?;
    let mut list = TopicPartitionList::new();
    for p in 0..args.partitions {
        list.add_partition_offset(&topics.events, p, Offset::Beginning).map_err(|e| e.to_string())?;
    }
    bare.assign(&list).map_err(|e| e.to_string())?;
    let (mut seen, mut first) = (0u64, None);
    let bare_deadline = Instant::now() + Duration::from_secs(600);
    while seen < total && Instant::now() < bare_deadline {
        if let Some(Ok(_)) = bare.poll(Duration::from_millis(100)) {
            first.get_or_insert_with(Instant::now);
            seen += 1;
        }
    }
    drop(bare);
    let bare_secs = first.map_or(0.0, |f| f.elapsed().as_secs_f64());
    let bare_rate = seen as f64 / bare_secs.max(1e-9);
    writeln!(out, "  broker alone     a bare consumer reads {seen} events in {bare_secs:.2}s ({bare_rate:.0} events/s)")
        .map_err(|e| e.to_string())?;
    Ok(bare_rate)
}

/// The worker's configuration: the fresh topics, `--redis` if given, the rules at `--rules`,
/// then the `VIGIL_*` variables of `env`.
fn worker_config(args: &KafkaBenchArgs, topics: &Topics, env: Vec<(String, String)>) -> Result<Config, String> {
    let Topics { run_id, events, decisions, dead_letters } = topics;
    let redis_line = args.redis.as_ref().map(|u| format!("url = {u:?}\n")).unwrap_or_default();
    let text = format!(
        "[kafka]\nbrokers = {:?}\ngroup_id = \"bench-{run_id}\"\ninput_topics = [{events:?}]\n\
         decisions_topic = {decisions:?}\ndead_letter_topic = {dead_letters:?}\nstatistics_interval = \"1s\"\n\
         [redis]\n{redis_line}[rules]\npath = {:?}\nreload_interval = \"1h\"\n[http]\nlisten = \"127.0.0.1:0\"\n",
        args.brokers,
        args.rules_path.display().to_string()
    );
    Config::parse("bench", &text, env).map_err(|e| e.to_string())
}

/// One worker (`worker::run`, the code `vigil run` runs) on a thread of this process.
struct BenchWorker {
    metrics: Arc<Metrics>,
    shutdown: Shutdown,
    thread: std::thread::JoinHandle<Result<(), String>>,
}

impl BenchWorker {
    /// Opens the configured store (and journal) as `vigil run` does, and starts the worker.
    fn start(config: Config, rules: RuleSet) -> Result<BenchWorker, String> {
        let (store, journal) = config.store_setup().open().map_err(|e| e.to_string())?;
        let metrics = Arc::new(Metrics::new());
        let shutdown = Shutdown::new();
        let thread = {
            let (metrics, shutdown) = (Arc::clone(&metrics), shutdown.clone());
            std::thread::spawn(move || {
                worker::run(config, rules, store, journal, metrics, Arc::new(Health::default()), shutdown).map_err(|e| e.to_string())
            })
        };
        Ok(BenchWorker { metrics, shutdown, thread })
    }

    /// Events the worker is done with: decided, allowed or dead-lettered.
    fn processed(&self) -> u64 {
        ["decided", "allowed", "dead_lettered"]
            .iter()
            .map(|o| self.metrics.events.get_or_create(&crate::telemetry::OutcomeLabels { outcome: o }).get())
            .sum()
    }

    /// Waits until the backlog of `total` events is drained; writes the rate after the first
    /// event was processed (against the bare consumer's `bare_rate`) and returns it.
    fn saturation(&self, total: u64, bare_rate: f64, out: &mut impl Write) -> Result<f64, String> {
        let deadline = Instant::now() + Duration::from_secs(1800);
        while self.processed() == 0 {
            if Instant::now() > deadline || self.thread.is_finished() {
                self.shutdown.trigger();
                return Err("the worker processed nothing".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let (t0, c0) = (Instant::now(), self.processed());
        while self.processed() < total {
            if Instant::now() > deadline || self.thread.is_finished() {
                self.shutdown.trigger();
                return Err(format!("the worker stopped after {} of {total} events", self.processed()));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let secs = t0.elapsed().as_secs_f64();
        let saturation = (total - c0) as f64 / secs;
        writeln!(out, "  saturation       {saturation:.0} events/s ({} events in {secs:.2}s after the first)", total - c0)
            .map_err(|e| e.to_string())?;
        writeln!(
            out,
            "  vs target        {:.2}x of 100 000 events/s; {:.2}x of the bare consumer on this broker",
            saturation / 100_000.0,
            saturation / bare_rate.max(1e-9)
        )
        .map_err(|e| e.to_string())?;
        Ok(saturation)
    }

    /// Stops the worker and says how it ended.
    fn stop(self) -> Result<(), String> {
        self.shutdown.trigger();
        match self.thread.join() {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(format!("worker: {e}")),
            Err(_) => Err("the worker panicked".into()),
        }
    }
}

/// Phase 2: events produced at half the saturation rate with their event time set to the wall
/// clock; latency is the time from production to the decision being consumed.
struct LatencyPhase<'a> {
    args: &'a KafkaBenchArgs,
    admin: &'a Admin,
    topics: &'a Topics,
    producer: &'a BaseProducer,
    properties: &'a Properties,
}

impl LatencyPhase<'_> {
    /// Through the worker, after its backlog of `backlog` events. Returns the rate and the
    /// workload it produced.
    fn through_worker(&self, worker: &BenchWorker, backlog: u64, saturation: f64, out: &mut impl Write) -> Result<(u64, WorkloadSpec), String> {
        let args = self.args;
        let rate = (saturation / 2.0).max(1.0) as u64;
        let count = rate * args.latency_seconds;
        let live_start = now_ms() + 500;
        let spec = WorkloadSpec {
            events: count,
            rate_per_sec: rate,
            start_ms: live_start,
            out_of_order: 0.0,
            late: 0.0,
            seed: args.workload.seed + 1,
            ..args.workload.clone()
        };
        let live = lines(&spec)?;
        let reader = reader(&args.brokers, &format!("bench-{}-reader", self.topics.run_id), self.properties)?;
        let pace = Pace { lines: &live, rate, start: live_start };
        let latencies = paced(self.producer, &self.topics.events, &reader, &self.topics.decisions, &pace, &|| worker.processed() >= backlog + count)?;
        writeln!(
            out,
            "  half load        {rate} events/s for {}s: {} decisions, latency p50 {} ms, p95 {} ms, p99 {} ms, max {} ms",
            args.latency_seconds,
            latencies.len(),
            percentile(&latencies, 0.50),
            percentile(&latencies, 0.95),
            percentile(&latencies, 0.99),
            latencies.last().copied().unwrap_or(0)
        )
        .map_err(|e| e.to_string())?;
        writeln!(out, "  vs target        p99 {} ms of 10 ms", percentile(&latencies, 0.99)).map_err(|e| e.to_string())?;
        Ok((rate, spec))
    }

    /// One hop through the broker alone at the same rate: its share of the worker's two hops.
    fn broker_alone(&self, rate: u64, spec: WorkloadSpec, out: &mut impl Write) -> Result<(), String> {
        let echo_topic = format!("bench-{}-echo", self.topics.run_id);
        self.admin.create(&echo_topic, 1)?;
        let live_start = now_ms() + 500;
        let live = lines(&WorkloadSpec { start_ms: live_start, ..spec })?;
        let reader = reader(&self.args.brokers, &echo_topic, self.properties)?;
        let echo = paced(self.producer, &echo_topic, &reader, &echo_topic, &Pace { lines: &live, rate, start: live_start }, &|| true)?;
        writeln!(
            out,
            "  broker alone     one hop at {rate} events/s: latency p50 {} ms, p99 {} ms (vigil's path is two hops)",
            percentile(&echo, 0.50),
            percentile(&echo, 0.99),
        )
        .map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(input: Option<std::path::PathBuf>) -> KafkaBenchArgs {
        KafkaBenchArgs {
            brokers: "127.0.0.1:1".into(),
            redis: None,
            rules_path: "rules".into(),
            input,
            workload: WorkloadSpec { events: 5, ..WorkloadSpec::default() },
            partitions: 1,
            latency_seconds: 1,
        }
    }

    #[test]
    fn the_backlog_is_the_input_s_lines_when_one_is_given() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        std::fs::write(&path, "{\"ts\":1,\"user_id\":\"a\"}\n\n{\"ts\":2}\n{\"ts\":3}").unwrap();
        let lines = backlog(&args(Some(path))).unwrap();
        assert_eq!(lines, [&b"{\"ts\":1,\"user_id\":\"a\"}"[..], b"{\"ts\":2}", b"{\"ts\":3}"]);
        assert_eq!(backlog(&args(None)).unwrap().len(), 5);
        let error = backlog(&args(Some(dir.path().join("missing.jsonl")))).unwrap_err();
        assert!(error.contains("missing.jsonl: cannot read input:"), "{error}");
    }
}
