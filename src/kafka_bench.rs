//! `vigil bench --kafka BROKERS`: the worker end to end on a real broker. Events are produced to
//! a fresh topic first; one in-process worker (`pipeline::worker::run`, the code `vigil run` runs)
//! then drains it at saturation; then events are produced at half that rate with their event time
//! set to the wall clock, and the latency from production to the decision being consumed is
//! measured on the decisions topic.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};

use crate::config::Config;
use crate::pipeline::worker;
use crate::rules::RuleSet;
use crate::shutdown::Shutdown;
use crate::store::{AnyStore, MemoryStore, RedisStore};
use crate::telemetry::http::Health;
use crate::telemetry::Metrics;
use crate::workload::{generate, WorkloadSpec};

pub struct KafkaBenchArgs {
    pub brokers: String,
    pub redis: Option<String>,
    pub rules_path: std::path::PathBuf,
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

fn lines(spec: &WorkloadSpec) -> Result<Vec<Vec<u8>>, String> {
    let mut out = Vec::new();
    generate(spec, &mut out).map_err(|e| e.to_string())?;
    Ok(out.split(|&b| b == b'\n').filter(|l| !l.is_empty()).map(<[u8]>::to_vec).collect())
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
fn reader(brokers: &str, group: &str, properties: &std::collections::BTreeMap<String, String>) -> Result<BaseConsumer, String> {
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

pub fn run(args: &KafkaBenchArgs, rules: RuleSet, out: &mut impl Write) -> Result<(), String> {
    let run_id = format!("{}-{}", std::process::id(), now_ms());
    let (events_topic, decisions_topic, dlq_topic) =
        (format!("bench-{run_id}-events"), format!("bench-{run_id}-decisions"), format!("bench-{run_id}-dlq"));
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &args.brokers)
        .create()
        .map_err(|e| format!("admin client: {e}"))?;
    let topics = [
        NewTopic::new(&events_topic, args.partitions, TopicReplication::Fixed(1)),
        NewTopic::new(&decisions_topic, 1, TopicReplication::Fixed(1)),
        NewTopic::new(&dlq_topic, 1, TopicReplication::Fixed(1)),
    ];
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    for result in runtime.block_on(admin.create_topics(&topics, &AdminOptions::new())).map_err(|e| format!("create topics: {e}"))? {
        result.map_err(|(topic, e)| format!("create topic {topic}: {e}"))?;
    }

    // Phase 1: the backlog.
    let backlog = lines(&args.workload)?;
    let producer = producer(&args.brokers)?;
    let started = Instant::now();
    for line in &backlog {
        send(&producer, &events_topic, line);
        producer.poll(Duration::ZERO);
    }
    producer.flush(Duration::from_secs(300)).map_err(|e| format!("flush: {e}"))?;
    let produce_secs = started.elapsed().as_secs_f64();
    writeln!(out, "vigil bench --kafka (one worker, {} partitions, {} active rules)", args.partitions, rules.active().len())
        .map_err(|e| e.to_string())?;
    writeln!(out, "  backlog          {} events produced in {produce_secs:.1}s ({:.0} events/s)", backlog.len(), backlog.len() as f64 / produce_secs)
        .map_err(|e| e.to_string())?;

    // The broker alone: how fast a bare consumer drains the same backlog (the ceiling for any
    // consumer on this machine), with the same librdkafka properties as the worker.
    let config_env: Vec<(String, String)> = std::env::vars().collect();
    let properties = Config::parse("bench", &format!("[kafka]\nbrokers = {:?}\n", args.brokers), config_env.clone())
        .map_err(|e| e.to_string())?
        .kafka
        .properties;
    let bare = reader(&args.brokers, &format!("bench-{run_id}-bare"), &properties)?;
    let mut list = TopicPartitionList::new();
    for p in 0..args.partitions {
        list.add_partition_offset(&events_topic, p, Offset::Beginning).map_err(|e| e.to_string())?;
    }
    bare.assign(&list).map_err(|e| e.to_string())?;
    let (mut seen, mut first) = (0u64, None);
    let bare_deadline = Instant::now() + Duration::from_secs(600);
    while seen < backlog.len() as u64 && Instant::now() < bare_deadline {
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

    // The worker, in this process.
    let redis_line = args.redis.as_ref().map(|u| format!("url = {u:?}\n")).unwrap_or_default();
    let text = format!(
        "[kafka]\nbrokers = {:?}\ngroup_id = \"bench-{run_id}\"\ninput_topics = [{events_topic:?}]\n\
         decisions_topic = {decisions_topic:?}\ndead_letter_topic = {dlq_topic:?}\nstatistics_interval = \"1s\"\n\
         [redis]\n{redis_line}[rules]\npath = {:?}\nreload_interval = \"1h\"\n[http]\nlisten = \"127.0.0.1:0\"\n",
        args.brokers,
        args.rules_path.display().to_string()
    );
    let config = Config::parse("bench", &text, config_env).map_err(|e| e.to_string())?;
    let (store, journal) = match &args.redis {
        None => (AnyStore::Memory(MemoryStore::new()), None),
        Some(url) => (
            AnyStore::Redis(Box::new(RedisStore::connect(url, config.redis_store()).map_err(|e| e.to_string())?)),
            Some(crate::store::JournalWriter::connect(url, &config.redis_store(), &config.kafka.group_id).map_err(|e| e.to_string())?),
        ),
    };
    let metrics = Arc::new(Metrics::new());
    let shutdown = Shutdown::new();
    let worker_thread = {
        let (metrics, shutdown) = (Arc::clone(&metrics), shutdown.clone());
        std::thread::spawn(move || worker::run(config, rules, store, journal, metrics, Arc::new(Health::default()), shutdown))
    };
    let processed = || -> u64 {
        ["decided", "allowed", "dead_lettered"]
            .iter()
            .map(|o| metrics.events.get_or_create(&crate::telemetry::OutcomeLabels { outcome: o }).get())
            .sum()
    };
    let total = backlog.len() as u64;
    let deadline = Instant::now() + Duration::from_secs(1800);
    while processed() == 0 {
        if Instant::now() > deadline || worker_thread.is_finished() {
            shutdown.trigger();
            return Err("the worker processed nothing".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let (t0, c0) = (Instant::now(), processed());
    while processed() < total {
        if Instant::now() > deadline || worker_thread.is_finished() {
            shutdown.trigger();
            return Err(format!("the worker stopped after {} of {total} events", processed()));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let secs = t0.elapsed().as_secs_f64();
    let saturation = (total - c0) as f64 / secs;
    writeln!(out, "  saturation       {saturation:.0} events/s ({} events in {secs:.2}s after the first)", total - c0).map_err(|e| e.to_string())?;
    writeln!(
        out,
        "  vs target        {:.2}x of 100 000 events/s; {:.2}x of the bare consumer on this broker",
        saturation / 100_000.0,
        saturation / bare_rate.max(1e-9)
    )
    .map_err(|e| e.to_string())?;

    // Phase 2: half load, event time = wall clock; latency = decision consumed - event produced.
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
    let latencies = paced(&producer, &events_topic, &reader(&args.brokers, &format!("bench-{run_id}-reader"), &properties)?, &decisions_topic, &Pace { lines: &live, rate, start: live_start }, &|| processed() >= total + count)?;
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

    // One hop through the broker alone at the same rate: its share of the two hops above.
    let echo_topic = format!("bench-{run_id}-echo");
    runtime
        .block_on(admin.create_topics(&[NewTopic::new(&echo_topic, 1, TopicReplication::Fixed(1))], &AdminOptions::new()))
        .map_err(|e| format!("create topic: {e}"))?;
    let live_start = now_ms() + 500;
    let live = lines(&WorkloadSpec { start_ms: live_start, ..spec })?;
    let echo = paced(&producer, &echo_topic, &reader(&args.brokers, &format!("bench-{run_id}-echo"), &properties)?, &echo_topic, &Pace { lines: &live, rate, start: live_start }, &|| true)?;
    writeln!(
        out,
        "  broker alone     one hop at {rate} events/s: latency p50 {} ms, p99 {} ms (vigil's path is two hops)",
        percentile(&echo, 0.50),
        percentile(&echo, 0.99),
    )
    .map_err(|e| e.to_string())?;

    shutdown.trigger();
    match worker_thread.join() {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("worker: {e}")),
        Err(_) => Err("the worker panicked".into()),
    }
}
