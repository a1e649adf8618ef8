//! `vigil bench --kafka BROKERS`: the worker end to end on a real broker. Events (the generated
//! workload, or the lines of `--input`) are produced to a fresh topic first; one in-process
//! worker (`worker::run`, the code `vigil run` runs) then drains it at saturation; then
//! generated events are produced at half that rate (or `--latency-rate`) with their event time
//! set to the wall clock, and three latencies are measured at that rate, side by side: each
//! event handed to the producer → its decision consumed from the decisions topic (end to end);
//! vigil's own share, from the worker's `vigil_processing_latency_seconds` over the phase; and
//! one hop through the broker alone (produce → consume with a plain client, the same client
//! settings). vigil's path is one hop in, its own share, one hop out.

use std::collections::HashMap;
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

use super::divergence::{self, Divergence, Records};
use super::workload::{generate, WorkloadSpec};
use crate::config::{Config, KafkaConfig};
use crate::rules::RuleSet;
use crate::shutdown::Shutdown;
use crate::telemetry::http::Health;
use crate::telemetry::{Metrics, Stages};
use crate::worker;
use crate::{sink, source};

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
    /// The latency phases' rate (events/s); `None`: half the measured saturation.
    pub latency_rate: Option<u64>,
    /// Workers in the group (above 1 needs `redis`).
    pub workers: usize,
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// The wall clock in µs: one-hop latencies on a local broker are a few ms, too close to a
/// millisecond clock's resolution.
fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// The line number a generated event's id carries (`e-N`, or `f-N` in a fraud burst), which
/// its decision record repeats: it ties a record read back to the moment its event was sent.
fn line_number(event_id: &str) -> Option<usize> {
    event_id
        .strip_prefix("e-")
        .or_else(|| event_id.strip_prefix("f-"))?
        .parse()
        .ok()
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
    bytes
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .map(<[u8]>::to_vec)
        .collect()
}

/// The producer of `vigil gen --kafka`.
fn producer(brokers: &str) -> Result<BaseProducer, String> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("linger.ms", "1")
        .set("queue.buffering.max.messages", "1000000")
        .create()
        .map_err(|e| format!("producer: {e}"))
}

/// The bench's producer of events: the settings of vigil's sink (`sink::producer_config`: acks,
/// `linger.ms`, compression, `kafka.properties`), so the events' hop into the worker and the
/// broker-alone hop cost what the decisions' hop out of it costs. A deep queue holds the backlog.
fn bench_producer(kafka: &KafkaConfig) -> Result<BaseProducer, String> {
    let mut config = sink::producer_config(kafka);
    config.set("client.id", "vigil-bench");
    if config.get("queue.buffering.max.messages").is_none() {
        config.set("queue.buffering.max.messages", "1000000");
    }
    config.create().map_err(|e| format!("producer: {e}"))
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
    config
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false");
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

/// What a paced production measured. Latencies run from the moment each event was handed to
/// the producer (`send`), not from its due time: a producer that falls behind its schedule on
/// a busy machine would otherwise add its own lateness to every figure. How far behind it fell
/// is reported apart (`slip_us`).
struct Paced {
    /// Read time minus send time of every record read back, µs, sorted.
    latencies_us: Vec<i64>,
    /// The p50 and the max of those latencies per second of the phase (by send time), in ms:
    /// the p50s show whether a queue grows or drains while the phase runs, the maxima when a
    /// stall happened.
    by_second_ms: Vec<(f64, f64)>,
    /// Send time minus due time of every event, µs, sorted.
    slip_us: Vec<i64>,
    /// Events per second actually sent, first send to last.
    sent_rate: f64,
    /// How long after the planned start the schedule began (generating the events took longer
    /// than the margin allowed), ms.
    late_start_ms: i64,
    /// `; CPU: …` from the first send to the last.
    cpu: String,
}

/// Produces the paced lines to `topic` (each line's `ts` is its due time) while `reader` reads
/// `read_topic` from its end; measures every record read back that belongs to this production
/// (`ts >= start`, its event id naming one of `lines`).
fn paced(
    producer: &BaseProducer,
    topic: &str,
    reader: &BaseConsumer,
    read_topic: &str,
    pace: &Pace<'_>,
    settled: &dyn Fn() -> bool,
) -> Result<Paced, String> {
    let Pace { lines, rate, start } = *pace;
    let (_, high) = reader
        .fetch_watermarks(read_topic, 0, Duration::from_secs(10))
        .map_err(|e| format!("watermarks: {e}"))?;
    let mut list = TopicPartitionList::new();
    list.add_partition_offset(read_topic, 0, Offset::Offset(high))
        .map_err(|e| e.to_string())?;
    reader.assign(&list).map_err(|e| e.to_string())?;
    let mut sent_us = vec![0i64; lines.len()];
    let mut received = Vec::new();
    let (mut begin, mut cpu) = (start, String::new());
    std::thread::scope(|scope| {
        let reading = Shutdown::new();
        let reader_thread = {
            let reading = reading.clone();
            scope.spawn(move || {
                // (line number, read time µs); matched with the send times once both are done.
                let mut received = Vec::new();
                while !reading.is_triggered() {
                    if let Some(Ok(message)) = reader.poll(Duration::from_millis(50)) {
                        let at = now_us();
                        let Some(record) = message
                            .payload()
                            .and_then(|p| serde_json::from_slice::<serde_json::Value>(p).ok())
                        else {
                            continue;
                        };
                        let ours = record["ts"].as_i64().is_some_and(|ts| ts >= start);
                        if let Some(n) = record["event_id"]
                            .as_str()
                            .and_then(line_number)
                            .filter(|_| ours)
                        {
                            received.push((n, at));
                        }
                    }
                }
                received
            })
        };
        while now_ms() < start {
            std::thread::sleep(Duration::from_millis(1));
        }
        // The schedule starts now if getting here took longer than `start` allowed for:
        // catching up would send a burst faster than `rate`.
        begin = now_ms().max(start);
        let cpu_at_begin = CpuTicks::now();
        for (n, line) in lines.iter().enumerate() {
            let due = begin + (n as i64 * 1000) / rate as i64;
            while now_ms() < due {
                producer.poll(Duration::ZERO);
                std::thread::sleep(Duration::from_micros(200));
            }
            sent_us[n] = now_us();
            send(producer, topic, line);
            producer.poll(Duration::ZERO);
        }
        cpu = cpu_since(cpu_at_begin);
        let _ = producer.flush(Duration::from_secs(60));
        let deadline = Instant::now() + Duration::from_secs(60);
        while !settled() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_secs(1));
        reading.trigger();
        received = reader_thread.join().unwrap_or_default();
    });
    let slip_us: Vec<i64> = {
        let mut slip: Vec<i64> = sent_us
            .iter()
            .enumerate()
            .map(|(n, &at)| at - (begin + (n as i64 * 1000) / rate as i64) * 1000)
            .collect();
        slip.sort_unstable();
        slip
    };
    let mut by_second: Vec<Vec<i64>> = Vec::new();
    let mut latencies_us = Vec::with_capacity(received.len());
    for (n, at) in received {
        let Some(&sent) = sent_us.get(n) else {
            continue;
        };
        let latency = at - sent;
        let second = usize::try_from((sent - begin * 1000) / 1_000_000).unwrap_or(0);
        if by_second.len() <= second {
            by_second.resize_with(second + 1, Vec::new);
        }
        by_second[second].push(latency);
        latencies_us.push(latency);
    }
    latencies_us.sort_unstable();
    let by_second_ms = by_second
        .iter_mut()
        .map(|second| {
            second.sort_unstable();
            let max = second.last().copied().unwrap_or(0);
            (
                percentile(second, 0.50) as f64 / 1000.0,
                max as f64 / 1000.0,
            )
        })
        .collect();
    let span_secs = match (sent_us.first(), sent_us.last()) {
        (Some(first), Some(last)) if last > first => (last - first) as f64 / 1e6,
        _ => 0.0,
    };
    let sent_rate = if span_secs > 0.0 {
        (sent_us.len() - 1) as f64 / span_secs
    } else {
        0.0
    };
    Ok(Paced {
        latencies_us,
        by_second_ms,
        slip_us,
        sent_rate,
        late_start_ms: begin - start,
        cpu,
    })
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
    let mut lines = Lines {
        producer: &producer,
        topic,
        partial: Vec::new(),
        produced: 0,
    };
    generate(spec, &mut lines).map_err(|e| e.to_string())?;
    let produced = lines.produced;
    producer
        .flush(Duration::from_secs(120))
        .map_err(|e| format!("not every event was acknowledged: {e}"))?;
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
    if args.workers > 1 && args.redis.is_none() {
        return Err(
            "--workers above 1 needs --redis: workers without it would each count alone".into(),
        );
    }
    // Read first: a bad --input fails before anything is created on the cluster.
    let backlog = backlog(args)?;
    let topics = Topics::fresh();
    let admin = Admin::connect(&args.brokers)?;
    admin.create_all(&[
        (&topics.events, args.partitions),
        (&topics.decisions, 1),
        (&topics.dead_letters, 1),
    ])?;

    // The worker's Kafka settings (the defaults and `VIGIL_*` overrides), which the bench's own
    // producer and readers share.
    let config_env: Vec<(String, String)> = std::env::vars().collect();
    let config = Config::parse(
        "bench",
        &format!("[kafka]\nbrokers = {:?}\n", args.brokers),
        config_env.clone(),
    )
    .map_err(|e| e.to_string())?;
    let properties = config.kafka.properties.clone();

    // Phase 1: the backlog.
    let producer = bench_producer(&config.kafka)?;
    let produce_secs = produce_backlog(&producer, &topics.events, &backlog)?;
    let from = args
        .input
        .as_ref()
        .map(|p| format!(" from {}", p.display()))
        .unwrap_or_default();
    let workers = if args.workers == 1 {
        "one worker".to_owned()
    } else {
        format!("{} workers", args.workers)
    };
    writeln!(
        out,
        "vigil bench --kafka ({workers}, {} partitions, {} active rules)",
        args.partitions,
        rules.active().len()
    )
    .map_err(|e| e.to_string())?;
    writeln!(out, "  client settings  {}", client_settings(&config)).map_err(|e| e.to_string())?;
    writeln!(
        out,
        "  backlog          {} events{from} produced in {produce_secs:.1}s ({:.0} events/s)",
        backlog.len(),
        backlog.len() as f64 / produce_secs
    )
    .map_err(|e| e.to_string())?;

    let bare_rate = bare_consumer_rate(args, &topics, backlog.len() as u64, &properties, out)?;

    // The workers, in this process, in one consumer group.
    let worker = BenchWorker::start(
        args.workers.max(1),
        &worker_config(args, &topics, config_env)?,
        &rules,
    )?;
    let total = backlog.len() as u64;
    let saturation = worker.saturation(total, bare_rate, out)?;
    worker.durable(total, out)?;

    if args.input.is_some() {
        writeln!(out, "  (the latency phases produce generated events: their event time must be the wall clock)").map_err(|e| e.to_string())?;
    }
    let phase = LatencyPhase {
        args,
        admin: &admin,
        topics: &topics,
        producer: &producer,
        properties: &properties,
    };
    let through = phase.through_worker(&worker, total, saturation, out)?;
    let echo = phase.broker_alone(&through, out)?;
    side_by_side(&through, &echo, out)?;
    // Both phases' decisions against single-order runs of their events.
    let (after_backlog, live) =
        read_decisions(&args.brokers, &topics, &properties, through.spec.start_ms)?;
    Divergence::between(&after_backlog, &divergence::single_order(&rules, &backlog)?)
        .write("after the backlog", out)
        .map_err(|e| e.to_string())?;
    Divergence::between(&live, &divergence::single_order(&rules, &through.lines)?)
        .write("live", out)
        .map_err(|e| e.to_string())?;
    worker.stop()
}

/// Every decision on the decisions topic, the first copy of each event's: those of events
/// before `live_start` (the backlog) and the others (the latency phase).
fn read_decisions(
    brokers: &str,
    topics: &Topics,
    properties: &Properties,
    live_start: i64,
) -> Result<(Records, Records), String> {
    let reader = reader(
        brokers,
        &format!("bench-{}-divergence", topics.run_id),
        properties,
    )?;
    let (_, high) = reader
        .fetch_watermarks(&topics.decisions, 0, Duration::from_secs(10))
        .map_err(|e| format!("watermarks: {e}"))?;
    let mut list = TopicPartitionList::new();
    list.add_partition_offset(&topics.decisions, 0, Offset::Beginning)
        .map_err(|e| e.to_string())?;
    reader.assign(&list).map_err(|e| e.to_string())?;
    let (mut backlog, mut live) = (Records::new(), Records::new());
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut next = 0;
    while next < high {
        if Instant::now() > deadline {
            return Err(format!("read {next} of {high} decisions"));
        }
        match reader.poll(Duration::from_millis(200)) {
            Some(Ok(message)) => {
                next = message.offset() + 1;
                let Some(record) = message
                    .payload()
                    .and_then(|p| serde_json::from_slice::<serde_json::Value>(p).ok())
                else {
                    continue;
                };
                let into = if record["ts"].as_i64().is_some_and(|ts| ts >= live_start) {
                    &mut live
                } else {
                    &mut backlog
                };
                divergence::keep_first(into, record);
            }
            Some(Err(e)) => return Err(format!("reading decisions: {e}")),
            None => {}
        }
    }
    Ok((backlog, live))
}

/// The client settings latency depends on, as every client of the run has them (the worker's
/// consumer and producer, the bench's producer and readers): librdkafka's defaults where neither
/// vigil nor `kafka.properties` sets one.
fn client_settings(config: &Config) -> String {
    let producer = sink::producer_config(&config.kafka);
    let consumer = source::consumer_config(&config.kafka, &config.worker);
    // A property or its librdkafka alias.
    let get = |client: &ClientConfig, keys: &[&str], default: &str| {
        keys.iter()
            .find_map(|k| client.get(k))
            .unwrap_or(default)
            .to_owned()
    };
    format!(
        "producers acks={} (idempotent), linger.ms={}, compression.type={}; consumers fetch.wait.max.ms={}, fetch.min.bytes={}",
        get(&producer, &["acks", "request.required.acks"], "all"),
        get(&producer, &["linger.ms", "queue.buffering.max.ms"], "5"),
        get(&producer, &["compression.type", "compression.codec"], "none"),
        get(&consumer, &["fetch.wait.max.ms"], "500"),
        get(&consumer, &["fetch.min.bytes"], "1"),
    )
}

/// CPU time so far, in clock ticks: the machine's, all cores (`/proc/stat`), and this
/// process's — the worker and the bench's own producer and readers (`/proc/self/stat`). On a
/// shared machine a latency means little without what else ran meanwhile. Linux only: `None`
/// elsewhere, and the line is left out.
#[derive(Clone, Copy)]
struct CpuTicks {
    busy: u64,
    total: u64,
    cores: u64,
    process: u64,
}

impl CpuTicks {
    fn now() -> Option<CpuTicks> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        // user nice system idle iowait irq softirq steal (guest time is within user).
        let all: Vec<u64> = stat
            .lines()
            .next()?
            .split_whitespace()
            .skip(1)
            .take(8)
            .map(|v| v.parse().unwrap_or(0))
            .collect();
        let total: u64 = all.iter().sum();
        let idle = all.get(3)? + all.get(4).copied().unwrap_or(0);
        let cores = stat
            .lines()
            .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
            .count() as u64;
        let own = std::fs::read_to_string("/proc/self/stat").ok()?;
        // After the command name: state is field 3, utime 14 and stime 15.
        let fields: Vec<&str> = own.get(own.rfind(')')? + 2..)?.split_whitespace().collect();
        let process = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
        Some(CpuTicks {
            busy: total - idle,
            total,
            cores: cores.max(1),
            process,
        })
    }

    /// `machine N% of M% busy, this process P%` (100% = one core) since `earlier`.
    fn since(&self, earlier: &CpuTicks) -> String {
        let total = self.total.saturating_sub(earlier.total).max(1) as f64;
        let per_core = |ticks: u64| 100.0 * ticks as f64 * self.cores as f64 / total;
        format!(
            "machine {:.0}% of {}% busy, this process {:.0}%",
            per_core(self.busy.saturating_sub(earlier.busy)),
            100 * self.cores,
            per_core(self.process.saturating_sub(earlier.process)),
        )
    }
}

/// `; CPU: …` for a phase that started at `earlier`, or nothing off Linux.
fn cpu_since(earlier: Option<CpuTicks>) -> String {
    match (earlier, CpuTicks::now()) {
        (Some(earlier), Some(now)) => format!("; CPU: {}", now.since(&earlier)),
        _ => String::new(),
    }
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
        let (events, decisions, dead_letters) = (
            format!("bench-{run_id}-events"),
            format!("bench-{run_id}-decisions"),
            format!("bench-{run_id}-dlq"),
        );
        Topics {
            run_id,
            events,
            decisions,
            dead_letters,
        }
    }
}

/// Creates topics on the cluster, one replica each.
struct Admin {
    client: AdminClient<DefaultClientContext>,
    runtime: tokio::runtime::Runtime,
}

impl Admin {
    fn connect(brokers: &str) -> Result<Admin, String> {
        let client = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()
            .map_err(|e| format!("admin client: {e}"))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Admin { client, runtime })
    }

    fn request(&self, topics: &[(&str, i32)]) -> KafkaResult<Vec<TopicResult>> {
        let topics: Vec<NewTopic<'_>> = topics
            .iter()
            .map(|&(name, partitions)| NewTopic::new(name, partitions, TopicReplication::Fixed(1)))
            .collect();
        self.runtime
            .block_on(self.client.create_topics(&topics, &AdminOptions::new()))
    }

    /// Creates `(name, partitions)` topics; any one that fails is an error.
    fn create_all(&self, topics: &[(&str, i32)]) -> Result<(), String> {
        for result in self
            .request(topics)
            .map_err(|e| format!("create topics: {e}"))?
        {
            result.map_err(|(topic, e)| format!("create topic {topic}: {e}"))?;
        }
        Ok(())
    }

    /// Creates one topic; only a failed request is an error (an existing topic is fine).
    fn create(&self, topic: &str, partitions: i32) -> Result<(), String> {
        self.request(&[(topic, partitions)])
            .map_err(|e| format!("create topic: {e}"))?;
        Ok(())
    }
}

/// The backlog's events: the lines of `--input` if given (what the user asked to produce), else
/// the generated workload.
fn backlog(args: &KafkaBenchArgs) -> Result<Vec<Vec<u8>>, String> {
    match &args.input {
        Some(path) => {
            let bytes = std::fs::read(path)
                .map_err(|e| format!("{}: cannot read input: {e}", path.display()))?;
            Ok(split_lines(&bytes))
        }
        None => lines(&args.workload),
    }
}

/// Produces every line to `topic` and waits for the acknowledgements; returns the seconds taken.
fn produce_backlog(
    producer: &BaseProducer,
    topic: &str,
    backlog: &[Vec<u8>],
) -> Result<f64, String> {
    let started = Instant::now();
    for line in backlog {
        send(producer, topic, line);
        producer.poll(Duration::ZERO);
    }
    producer
        .flush(Duration::from_secs(300))
        .map_err(|e| format!("flush: {e}"))?;
    Ok(started.elapsed().as_secs_f64())
}

/// The broker alone: how fast a bare consumer drains the backlog of `total` events (the ceiling
/// for any consumer on this machine), with the same librdkafka properties as the worker. Writes
/// the line and returns the events/s.
fn bare_consumer_rate(
    args: &KafkaBenchArgs,
    topics: &Topics,
    total: u64,
    properties: &Properties,
    out: &mut impl Write,
) -> Result<f64, String> {
    let bare = reader(
        &args.brokers,
        &format!("bench-{}-bare", topics.run_id),
        properties,
    )?;
    let mut list = TopicPartitionList::new();
    for p in 0..args.partitions {
        list.add_partition_offset(&topics.events, p, Offset::Beginning)
            .map_err(|e| e.to_string())?;
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
fn worker_config(
    args: &KafkaBenchArgs,
    topics: &Topics,
    env: Vec<(String, String)>,
) -> Result<Config, String> {
    let Topics {
        run_id,
        events,
        decisions,
        dead_letters,
    } = topics;
    let redis_line = args
        .redis
        .as_ref()
        .map(|u| format!("url = {u:?}\n"))
        .unwrap_or_default();
    let text = format!(
        "[kafka]\nbrokers = {:?}\ngroup_id = \"bench-{run_id}\"\ninput_topics = [{events:?}]\n\
         decisions_topic = {decisions:?}\ndead_letter_topic = {dead_letters:?}\nstatistics_interval = \"1s\"\n\
         [redis]\n{redis_line}[rules]\npath = {:?}\nreload_interval = \"1h\"\n[http]\nlisten = \"127.0.0.1:0\"\n",
        args.brokers,
        args.rules_path.display().to_string()
    );
    Config::parse("bench", &text, env).map_err(|e| e.to_string())
}

/// The workers (`worker::run`, the code `vigil run` runs), each on a thread of this process with
/// its own store and metrics, in one consumer group.
struct BenchWorker {
    metrics: Vec<Arc<Metrics>>,
    shutdown: Shutdown,
    threads: Vec<std::thread::JoinHandle<Result<(), String>>>,
}

impl BenchWorker {
    /// Opens the configured store (and journal) as `vigil run` does, and starts `count` workers.
    fn start(count: usize, config: &Config, rules: &RuleSet) -> Result<BenchWorker, String> {
        let shutdown = Shutdown::new();
        let mut group = BenchWorker {
            metrics: Vec::new(),
            shutdown: shutdown.clone(),
            threads: Vec::new(),
        };
        for _ in 0..count {
            let (store, journal) = match config.store_setup().open() {
                Ok(opened) => opened,
                Err(e) => {
                    let _ = group.stop();
                    return Err(e.to_string());
                }
            };
            let metrics = Arc::new(Metrics::new());
            let (config, rules) = (config.clone(), rules.clone());
            let thread = {
                let (metrics, shutdown) = (Arc::clone(&metrics), shutdown.clone());
                std::thread::spawn(move || {
                    worker::run(
                        config,
                        rules,
                        store,
                        journal,
                        metrics,
                        Arc::new(Health::default()),
                        &worker::Lookups::new(),
                        shutdown,
                    )
                    .map_err(|e| e.to_string())
                })
            };
            group.metrics.push(metrics);
            group.threads.push(thread);
        }
        Ok(group)
    }

    /// Events the workers are done with: decided, allowed or dead-lettered.
    fn processed(&self) -> u64 {
        let outcomes = ["decided", "allowed", "dead_lettered"];
        self.metrics
            .iter()
            .flat_map(|m| {
                outcomes.iter().map(move |o| {
                    m.events
                        .get_or_create(&crate::telemetry::OutcomeLabels { outcome: o })
                        .get()
                })
            })
            .sum()
    }

    /// Whether a worker stopped.
    fn any_finished(&self) -> bool {
        self.threads
            .iter()
            .any(std::thread::JoinHandle::is_finished)
    }

    /// Every worker's metrics text.
    fn encode(&self) -> Vec<String> {
        self.metrics.iter().map(|m| m.encode()).collect()
    }

    /// Waits until the backlog of `total` events is drained; writes the rate after the first
    /// event was processed (against the bare consumer's `bare_rate`) and returns it.
    fn saturation(&self, total: u64, bare_rate: f64, out: &mut impl Write) -> Result<f64, String> {
        let deadline = Instant::now() + Duration::from_secs(1800);
        while self.processed() == 0 {
            if Instant::now() > deadline || self.any_finished() {
                self.shutdown.trigger();
                return Err("the worker processed nothing".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let (t0, c0, cpu, before) = (
            Instant::now(),
            self.processed(),
            CpuTicks::now(),
            self.encode(),
        );
        while self.processed() < total {
            if Instant::now() > deadline || self.any_finished() {
                self.shutdown.trigger();
                return Err(format!(
                    "the worker stopped after {} of {total} events",
                    self.processed()
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let secs = t0.elapsed().as_secs_f64();
        let saturation = (total - c0) as f64 / secs;
        writeln!(out, "  saturation       {saturation:.0} events/s ({} events in {secs:.2}s after the first{})", total - c0, cpu_since(cpu))
            .map_err(|e| e.to_string())?;
        write_stages(&before, &self.encode(), out)?;
        writeln!(
            out,
            "  vs target        {:.2}x of 100 000 events/s; {:.2}x of the bare consumer on this broker",
            saturation / 100_000.0,
            saturation / bare_rate.max(1e-9)
        )
        .map_err(|e| e.to_string())?;
        Ok(saturation)
    }

    /// Waits until every backlog event is durable: its counts flushed to the store and its offset
    /// committed (the sum over partitions of the highest committed offset reaches `total`), so
    /// that the latency phase measures a steady load, not the write-behind of the backlog's last
    /// second still going to Redis. Writes how long that took.
    fn durable(&self, total: u64, out: &mut impl Write) -> Result<(), String> {
        let started = Instant::now();
        let deadline = started + Duration::from_secs(120);
        let committed = |texts: &[String]| -> u64 {
            let mut by_partition: HashMap<&str, u64> = HashMap::new();
            for text in texts {
                for line in text.lines() {
                    let Some(rest) = line.strip_prefix("vigil_committed_offset{") else {
                        continue;
                    };
                    let Some((labels, value)) = rest.rsplit_once("} ") else {
                        continue;
                    };
                    let value = value.trim().parse::<u64>().unwrap_or(0);
                    let slot = by_partition.entry(labels).or_default();
                    *slot = (*slot).max(value);
                }
            }
            by_partition.values().sum()
        };
        loop {
            let texts = self.encode();
            if committed(&texts) >= total {
                break;
            }
            if Instant::now() > deadline || self.any_finished() {
                self.shutdown.trigger();
                return Err(format!(
                    "the backlog was not committed within 120 s ({} of {total})",
                    committed(&texts)
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        writeln!(
            out,
            "  durable          every backlog event flushed and committed {:.2}s after the last was processed",
            started.elapsed().as_secs_f64()
        )
        .map_err(|e| e.to_string())
    }

    /// Stops the workers and says how the first that failed ended.
    fn stop(self) -> Result<(), String> {
        self.shutdown.trigger();
        let mut result = Ok(());
        for thread in self.threads {
            let ended = match thread.join() {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(format!("worker: {e}")),
                Err(_) => Err("a worker panicked".into()),
            };
            result = result.and(ended);
        }
        result
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

/// What the phase through the worker measured, for the side-by-side line.
struct ThroughWorker {
    rate: u64,
    spec: WorkloadSpec,
    /// The phase's events, in the order they were produced.
    lines: Vec<Vec<u8>>,
    end_to_end: Paced,
    /// `vigil_processing_latency_seconds{until="produced"}` over this phase only.
    own_produced: Buckets,
    /// `vigil_processing_latency_seconds{until="acknowledged"}` over this phase only.
    own_acknowledged: Buckets,
}

const OWN_LATENCY: &str = "vigil_processing_latency_seconds";

fn ms(us: i64) -> f64 {
    us as f64 / 1000.0
}

impl LatencyPhase<'_> {
    /// Through the worker, after its backlog of `backlog` events.
    fn through_worker(
        &self,
        worker: &BenchWorker,
        backlog: u64,
        saturation: f64,
        out: &mut impl Write,
    ) -> Result<ThroughWorker, String> {
        let args = self.args;
        let rate = args
            .latency_rate
            .unwrap_or((saturation / 2.0) as u64)
            .max(1);
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
        let reader = reader(
            &args.brokers,
            &format!("bench-{}-reader", self.topics.run_id),
            self.properties,
        )?;
        let pace = Pace {
            lines: &live,
            rate,
            start: live_start,
        };
        // vigil's own latency is read from its metric, as an operator would, over this phase:
        // the worker is idle between the snapshots and the phase.
        let before = worker.encode();
        let end_to_end = paced(
            self.producer,
            &self.topics.events,
            &reader,
            &self.topics.decisions,
            &pace,
            &|| worker.processed() >= backlog + count,
        )?;
        let after = worker.encode();
        let own = |until: &str| {
            let label = format!("until=\"{until}\"");
            let phase = |(after, before): (&String, &String)| {
                Buckets::read(after, OWN_LATENCY, &label).since(&Buckets::read(
                    before,
                    OWN_LATENCY,
                    &label,
                ))
            };
            after
                .iter()
                .zip(&before)
                .map(phase)
                .reduce(|a, b| a.plus(&b))
                .unwrap_or_default()
        };
        let (own_produced, own_acknowledged) = (own("produced"), own("acknowledged"));
        write_stages(&before, &after, out)?;
        let e2e = &end_to_end.latencies_us;
        writeln!(
            out,
            "  {:<16} {rate} events/s for {}s (began {} ms after the planned start): sent at {:.0} events/s, behind schedule p50 {:.1} ms, p99 {:.1} ms{}",
            if args.latency_rate.is_some() { "latency phase" } else { "half load" },
            args.latency_seconds,
            end_to_end.late_start_ms,
            end_to_end.sent_rate,
            ms(percentile(&end_to_end.slip_us, 0.50)),
            ms(percentile(&end_to_end.slip_us, 0.99)),
            end_to_end.cpu,
        )
        .map_err(|e| e.to_string())?;
        writeln!(
            out,
            "  end to end       {} decisions, event sent → decision consumed: p50 {:.1} ms, p95 {:.1} ms, p99 {:.1} ms, p99.9 {:.1} ms, max {:.1} ms",
            e2e.len(),
            ms(percentile(e2e, 0.50)),
            ms(percentile(e2e, 0.95)),
            ms(percentile(e2e, 0.99)),
            ms(percentile(e2e, 0.999)),
            ms(e2e.last().copied().unwrap_or(0)),
        )
        .map_err(|e| e.to_string())?;
        let by_second = |pick: fn(&(f64, f64)) -> f64| -> String {
            let values: Vec<String> = end_to_end
                .by_second_ms
                .iter()
                .map(|second| format!("{:.1}", pick(second)))
                .collect();
            values.join(" ")
        };
        writeln!(
            out,
            "                   p50 per second of the phase (ms): {}",
            by_second(|second| second.0)
        )
        .map_err(|e| e.to_string())?;
        writeln!(
            out,
            "                   max per second of the phase (ms): {}",
            by_second(|second| second.1)
        )
        .map_err(|e| e.to_string())?;
        writeln!(
            out,
            "  vigil's own      {} decisions, poll → handed to the producer: {}; → acknowledged by the broker: {} ({OWN_LATENCY})",
            own_produced.count(),
            own_produced.summary(),
            own_acknowledged.summary(),
        )
        .map_err(|e| e.to_string())?;
        writeln!(
            out,
            "  vs target        p99 {:.1} ms of 10 ms",
            ms(percentile(e2e, 0.99))
        )
        .map_err(|e| e.to_string())?;
        Ok(ThroughWorker {
            rate,
            spec,
            lines: live,
            end_to_end,
            own_produced,
            own_acknowledged,
        })
    }

    /// One hop through the broker alone at the same rate: its share of the worker's two hops.
    fn broker_alone(&self, worker: &ThroughWorker, out: &mut impl Write) -> Result<Paced, String> {
        let rate = worker.rate;
        let echo_topic = format!("bench-{}-echo", self.topics.run_id);
        self.admin.create(&echo_topic, 1)?;
        let live_start = now_ms() + 500;
        let live = lines(&WorkloadSpec {
            start_ms: live_start,
            ..worker.spec.clone()
        })?;
        let reader = reader(&self.args.brokers, &echo_topic, self.properties)?;
        let echo = paced(
            self.producer,
            &echo_topic,
            &reader,
            &echo_topic,
            &Pace {
                lines: &live,
                rate,
                start: live_start,
            },
            &|| true,
        )?;
        let hop = &echo.latencies_us;
        writeln!(
            out,
            "  broker alone     one hop at {rate} events/s (sent at {:.0}/s): p50 {:.1} ms, p95 {:.1} ms, p99 {:.1} ms, max {:.1} ms{}",
            echo.sent_rate,
            ms(percentile(hop, 0.50)),
            ms(percentile(hop, 0.95)),
            ms(percentile(hop, 0.99)),
            ms(hop.last().copied().unwrap_or(0)),
            echo.cpu,
        )
        .map_err(|e| e.to_string())?;
        Ok(echo)
    }
}

/// The three latencies of one run at one rate, side by side: vigil's path is one hop in, its
/// own processing, one hop out, so end to end should be near two hops plus vigil's own.
fn side_by_side(worker: &ThroughWorker, echo: &Paced, out: &mut impl Write) -> Result<(), String> {
    let (e2e, hop) = (&worker.end_to_end.latencies_us, &echo.latencies_us);
    let quantiles = |q: f64| {
        let own = worker
            .own_produced
            .quantile(q)
            .map_or_else(|| "-".to_owned(), |s| format!("{:.2}", s * 1000.0));
        let acked = worker
            .own_acknowledged
            .quantile(q)
            .map_or_else(|| "-".to_owned(), |s| format!("{:.2}", s * 1000.0));
        format!(
            "end to end {:.1}, broker one hop {:.1} (x2 {:.1}), vigil's own {own} (to the ack {acked})",
            ms(percentile(e2e, q)),
            ms(percentile(hop, q)),
            2.0 * ms(percentile(hop, q)),
        )
    };
    writeln!(out, "  side by side     at {} events/s, ms:", worker.rate)
        .map_err(|e| e.to_string())?;
    for (name, q) in [
        ("p50", 0.50),
        ("p95", 0.95),
        ("p99", 0.99),
        ("p99.9", 0.999),
    ] {
        writeln!(out, "                   {name:<5} {}", quantiles(q))
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

const STAGES: &str = "vigil_processing_stage_seconds";

/// Where the partition batches' time went between two snapshots of the workers' metrics, by
/// stage (`vigil_processing_stage_seconds`): each stage's share of the batches' time, its mean,
/// p50, p99 and max per batch; and the batches' sizes.
fn write_stages(before: &[String], after: &[String], out: &mut impl Write) -> Result<(), String> {
    let phase = |name: &str, label: &str| {
        let buckets = after
            .iter()
            .zip(before)
            .map(|(after, before)| {
                Buckets::read(after, name, label).since(&Buckets::read(before, name, label))
            })
            .reduce(|a, b| a.plus(&b))
            .unwrap_or_default();
        let sum: f64 = after
            .iter()
            .zip(before)
            .map(|(after, before)| read_sum(after, name, label) - read_sum(before, name, label))
            .sum();
        (buckets, sum)
    };
    let stages: Vec<(&str, Buckets, f64)> = Stages::NAMES
        .iter()
        .map(|&stage| {
            let (buckets, sum) = phase(STAGES, &format!("stage=\"{stage}\""));
            (stage, buckets, sum)
        })
        .collect();
    let total: f64 = stages.iter().map(|s| s.2).sum();
    let (sizes, messages) = phase("vigil_batch_messages", "");
    let batches = sizes.count();
    if batches == 0 || total <= 0.0 {
        return writeln!(out, "  batch stages     no batch observed").map_err(|e| e.to_string());
    }
    writeln!(
        out,
        "  batch stages     {batches} batches of {:.0} messages on average (p50 {:.0}, p99 {:.0}); share of their time, mean / p50 / p99 / max per batch in ms (the max as its histogram bucket's upper bound; {STAGES}):",
        messages / batches as f64,
        sizes.quantile(0.5).unwrap_or(0.0),
        sizes.quantile(0.99).unwrap_or(0.0),
    )
    .map_err(|e| e.to_string())?;
    let cells: Vec<String> = stages
        .iter()
        .map(|(stage, buckets, sum)| {
            let q = |q: f64| buckets.quantile(q).unwrap_or(0.0) * 1000.0;
            format!(
                "{stage} {:.0} % {:.2}/{:.2}/{:.2}/{:.1}",
                100.0 * sum / total,
                1000.0 * sum / batches as f64,
                q(0.5),
                q(0.99),
                q(1.0)
            )
        })
        .collect();
    for row in cells.chunks(4) {
        writeln!(out, "                   {}", row.join(", ")).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The `{name}_sum` of the series of `text` whose labels include `label` (all if empty).
fn read_sum(text: &str, name: &str, label: &str) -> f64 {
    let prefix = format!("{name}_sum");
    text.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(&prefix)?;
            let (labels, value) = match rest.strip_prefix('{') {
                Some(rest) => rest.split_once("} ")?,
                None => ("", rest.strip_prefix(' ')?),
            };
            (label.is_empty() || labels.split(',').any(|l| l == label))
                .then(|| value.trim().parse::<f64>().ok())?
        })
        .sum()
}

/// A histogram's cumulative counts per upper bound (`le`), read from the metrics text the
/// worker serves on `/metrics`.
#[derive(Debug, Default, PartialEq)]
struct Buckets(Vec<(f64, u64)>);

impl Buckets {
    /// The `{name}_bucket` series of `text` whose labels include `label` (e.g. `until="produced"`;
    /// empty: a histogram without labels).
    fn read(text: &str, name: &str, label: &str) -> Buckets {
        let prefix = format!("{name}_bucket{{");
        let mut buckets = Vec::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix(&prefix) else {
                continue;
            };
            let Some((labels, value)) = rest.split_once("} ") else {
                continue;
            };
            if !label.is_empty() && !labels.split(',').any(|l| l == label) {
                continue;
            }
            let le = labels
                .split(',')
                .find_map(|l| l.strip_prefix("le=\"")?.strip_suffix('"'));
            if let (Some(Ok(le)), Ok(count)) =
                (le.map(str::parse::<f64>), value.trim().parse::<u64>())
            {
                buckets.push((le, count));
            }
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        Buckets(buckets)
    }

    /// What was observed after `earlier` (same bounds).
    fn since(&self, earlier: &Buckets) -> Buckets {
        Buckets(
            self.0
                .iter()
                .map(|&(le, n)| {
                    (
                        le,
                        n - earlier.0.iter().find(|e| e.0 == le).map_or(0, |e| e.1),
                    )
                })
                .collect(),
        )
    }

    fn count(&self) -> u64 {
        self.0.last().map_or(0, |b| b.1)
    }

    /// Both histograms' observations (same bounds): several workers' together.
    fn plus(&self, other: &Buckets) -> Buckets {
        Buckets(
            self.0
                .iter()
                .map(|&(le, n)| {
                    (
                        le,
                        n + other.0.iter().find(|o| o.0 == le).map_or(0, |o| o.1),
                    )
                })
                .collect(),
        )
    }

    /// The `q` quantile in seconds, interpolated within its bucket as Prometheus'
    /// `histogram_quantile` does (so within a bucket's width of the truth); the largest finite
    /// bound if it falls in `+Inf`; `None` if nothing was observed.
    fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.count();
        if total == 0 {
            return None;
        }
        let rank = q * total as f64;
        let (mut lower, mut below) = (0.0, 0u64);
        for &(le, n) in &self.0 {
            if n as f64 >= rank {
                if le.is_infinite() {
                    return Some(lower);
                }
                let within = (n - below).max(1) as f64;
                return Some(lower + (le - lower) * (rank - below as f64) / within);
            }
            (lower, below) = (le, n);
        }
        Some(lower)
    }

    /// `p50 x ms, p95 y ms, p99 z ms`, or `none observed`.
    fn summary(&self) -> String {
        let quantiles: Option<Vec<String>> = [
            ("p50", 0.50),
            ("p95", 0.95),
            ("p99", 0.99),
            ("p99.9", 0.999),
        ]
        .iter()
        .map(|&(name, q)| Some(format!("{name} {:.2} ms", self.quantile(q)? * 1000.0)))
        .collect();
        quantiles.map_or_else(|| "none observed".to_owned(), |q| q.join(", "))
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
            workload: WorkloadSpec {
                events: 5,
                ..WorkloadSpec::default()
            },
            partitions: 1,
            latency_seconds: 1,
            latency_rate: None,
            workers: 1,
        }
    }

    #[test]
    fn the_backlog_is_the_input_s_lines_when_one_is_given() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        std::fs::write(
            &path,
            "{\"ts\":1,\"user_id\":\"a\"}\n\n{\"ts\":2}\n{\"ts\":3}",
        )
        .unwrap();
        let lines = backlog(&args(Some(path))).unwrap();
        assert_eq!(
            lines,
            [
                &b"{\"ts\":1,\"user_id\":\"a\"}"[..],
                b"{\"ts\":2}",
                b"{\"ts\":3}"
            ]
        );
        assert_eq!(backlog(&args(None)).unwrap().len(), 5);
        let error = backlog(&args(Some(dir.path().join("missing.jsonl")))).unwrap_err();
        assert!(
            error.contains("missing.jsonl: cannot read input:"),
            "{error}"
        );
    }

    #[test]
    fn records_are_tied_to_their_line_by_event_id() {
        assert_eq!(line_number("e-0"), Some(0));
        assert_eq!(line_number("f-1234"), Some(1234));
        assert_eq!(line_number("x-1"), None);
        assert_eq!(line_number("e-"), None);
    }

    /// vigil's own latency, as the worker exports it, read over one phase.
    #[test]
    fn own_latency_quantiles_come_from_the_exported_histogram() {
        let metrics = Metrics::new();
        let empty = Buckets::read(&metrics.encode(), OWN_LATENCY, "until=\"produced\"");
        assert!(
            empty.0.len() > 20,
            "both series are exported from the start: {empty:?}"
        );
        assert_eq!((empty.count(), empty.quantile(0.5)), (0, None));
        assert_eq!(empty.summary(), "none observed");
        for _ in 0..10 {
            metrics.processing_produced.observe(0.050);
        }
        let before = Buckets::read(&metrics.encode(), OWN_LATENCY, "until=\"produced\"");
        for ms in 1..=100 {
            metrics
                .processing_produced
                .observe(f64::from(ms) / 10_000.0);
        }
        metrics.processing_acknowledged.observe(100.0);
        let text = metrics.encode();
        let phase = Buckets::read(&text, OWN_LATENCY, "until=\"produced\"").since(&before);
        assert_eq!(phase.count(), 100, "only what the phase observed");
        // 0.1 ms to 10 ms evenly: the quantiles are within a bucket (a factor of 1.5) of the truth.
        for (q, truth) in [(0.5, 0.005), (0.95, 0.0095), (0.99, 0.0099)] {
            let got = phase.quantile(q).unwrap();
            assert!(
                got > truth / 1.5 && got < truth * 1.5,
                "q{q}: {got} for {truth}"
            );
        }
        // Beyond the last finite bound: that bound.
        let acked = Buckets::read(&text, OWN_LATENCY, "until=\"acknowledged\"");
        assert_eq!(acked.count(), 1);
        let last = acked.quantile(0.5).unwrap();
        assert!(last > 9.0 && last < 10.0, "{last}");
    }

    /// The stage breakdown reads only what was observed between the two snapshots.
    #[test]
    fn batch_stages_are_read_over_one_phase() {
        let metrics = Metrics::new();
        let mut out = Vec::new();
        write_stages(&[metrics.encode()], &[metrics.encode()], &mut out).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "  batch stages     no batch observed\n"
        );
        metrics.stages.judge.observe(1.0);
        metrics.batch_messages.observe(1000.0);
        let before = metrics.encode();
        for _ in 0..4 {
            metrics.batch_messages.observe(10.0);
            metrics.stages.judge.observe(0.003);
            metrics.stages.journal.observe(0.001);
        }
        let mut out = Vec::new();
        write_stages(&[before], &[metrics.encode()], &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.contains("4 batches of 10 messages on average"),
            "{text}"
        );
        assert!(text.contains("judge 75 % 3.00/"), "{text}");
        assert!(text.contains("journal 25 % 1.00/"), "{text}");
        assert!(text.contains("queued 0 % 0.00/0.00/0.00"), "{text}");
    }

    #[test]
    fn buckets_are_read_from_prometheus_text() {
        let text = "# TYPE x histogram\nx_bucket{until=\"a\",le=\"0.5\"} 2\nx_bucket{until=\"a\",le=\"1.0\"} 4\n\
                    x_bucket{until=\"a\",le=\"+Inf\"} 4\nx_bucket{until=\"b\",le=\"0.5\"} 9\nx_count{until=\"a\"} 4\n";
        let a = Buckets::read(text, "x", "until=\"a\"");
        assert_eq!(a, Buckets(vec![(0.5, 2), (1.0, 4), (f64::INFINITY, 4)]));
        assert_eq!(a.quantile(0.5), Some(0.5));
        assert_eq!(
            a.quantile(0.25),
            Some(0.25),
            "interpolated within the bucket"
        );
        assert_eq!(a.quantile(0.75), Some(0.75));
        assert_eq!(Buckets::read(text, "x", "until=\"c\"").count(), 0);
    }
}
