//! `vigil run` end to end: a real Kafka-protocol broker (tansu) and a real `redis-server`, both
//! started here on free loopback ports; worker processes started, signalled and killed by PID.
//! The reference is `vigil replay` (the in-process engine) on the same events.

mod support;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::kafka::{Broker, Record, Worker};
use support::RedisServer;
use vigil::pipeline::{replay, Engine, ReplayOptions};
use vigil::store::MemoryStore;
use vigil::workload::{generate, WorkloadSpec};

/// Rules keyed by `user_id`, the Kafka message key: a partition's owner sees all of a user's
/// events in order, so these decide exactly as replay whatever the partitioning.
const USER_KEYED: [&str; 4] =
    ["login-fail-user-10m", "login-devices-user-24h", "pay-cards-user-24h", "pay-amount-user-country-1d"];

const LONG: Duration = Duration::from_secs(240);

/// Generated events (every aggregate's fields, out-of-order and late ones) with bad lines spread
/// through: each line is one Kafka message.
fn workload(events: u64, seed: u64) -> Vec<Vec<u8>> {
    let spec = WorkloadSpec { events, users: 3_000, ips: 1_500, rate_per_sec: 300, late: 0.01, out_of_order: 0.05, seed, ..WorkloadSpec::default() };
    let mut out = Vec::new();
    generate(&spec, &mut out).unwrap();
    let mut lines: Vec<Vec<u8>> = out.split(|&b| b == b'\n').filter(|l| !l.is_empty()).map(<[u8]>::to_vec).collect();
    let bad: [&[u8]; 5] = [b"not json", b"[1]", br#"{"no":"ts"}"#, br#"{"ts":"yesterday","user_id":"u-1"}"#, b"{\"ts\":1,\"x\":\"\xff\"}"];
    let step = lines.len() / (bad.len() + 1);
    for (i, line) in bad.iter().enumerate().rev() {
        lines.insert(step * (i + 1), line.to_vec());
    }
    lines
}

/// The Kafka key of an event line: its `user_id`, if it has one.
fn user_key(line: &[u8]) -> Option<Vec<u8>> {
    let value: Value = serde_json::from_slice(line).ok()?;
    value.get("user_id")?.as_str().map(|s| s.as_bytes().to_vec())
}

/// Replay of `lines` with the in-process store: decision records by 0-based line index, and the
/// bad lines' reason codes by index.
fn reference(rules: &Path, lines: &[Vec<u8>], emit_allow: bool) -> (BTreeMap<usize, Value>, BTreeMap<usize, String>) {
    let mut engine = Engine::new(vigil::rule_files::load(rules).unwrap(), MemoryStore::new());
    let input = lines.join(&b'\n');
    let (mut out, mut diagnostics) = (Vec::new(), Vec::new());
    replay(&mut engine, &input[..], &mut out, &mut diagnostics, ReplayOptions { emit_allow }).unwrap();
    let decisions = out
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| {
            let mut record: Value = serde_json::from_slice(l).unwrap();
            let line = record["source"]["line"].as_u64().unwrap() as usize;
            record.as_object_mut().unwrap().remove("source");
            (line - 1, record)
        })
        .collect();
    let bad = String::from_utf8(diagnostics)
        .unwrap()
        .lines()
        .map(|l| {
            let (line, rest) = l.strip_prefix("line ").unwrap().split_once(": bad event (").unwrap();
            (line.parse::<usize>().unwrap() - 1, rest.split_once(')').unwrap().0.to_owned())
        })
        .collect();
    (decisions, bad)
}

/// A copy of the shipped rules in `dir`, so a test can edit them.
fn copy_rules(dir: &Path) -> PathBuf {
    let rules = dir.join("rules");
    std::fs::create_dir_all(&rules).unwrap();
    for file in ["login.toml", "payments.toml"] {
        std::fs::copy(Path::new("rules").join(file), rules.join(file)).unwrap();
    }
    rules
}

fn config(broker: &Broker, redis: &RedisServer, rules: &Path, worker: &str) -> String {
    format!(
        r#"
[kafka]
brokers = "{}"
group_id = "vigil-test"
statistics_interval = "1s"
[kafka.properties]
"session.timeout.ms" = 6000
"heartbeat.interval.ms" = 500
[redis]
url = "{}"
[rules]
path = "{}"
reload_interval = "200ms"
[worker]
shutdown_timeout = "15s"
commit_interval = "200ms"
{worker}
"#,
        broker.bootstrap(),
        redis.url(),
        rules.display()
    )
}

fn topics(broker: &Broker, events_partitions: u32) {
    broker.create_topic("events", events_partitions);
    broker.create_topic("decisions", 1);
    broker.create_topic("events.dlq", 1);
}

/// Records keyed as produced: (key, line).
fn keyed(lines: &[Vec<u8>]) -> Vec<(Option<Vec<u8>>, Vec<u8>)> {
    lines.iter().map(|l| (user_key(l), l.clone())).collect()
}

fn without_source(record: &Record) -> (Value, Value) {
    let mut json = record.json();
    let source = json.as_object_mut().unwrap().remove("source").unwrap();
    (json, source)
}

/// The rule ids of a record's hits, restricted to `rules`.
fn hits_of(record: &Value, rules: &[&str]) -> Vec<(String, String)> {
    record["hits"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|h| rules.contains(&h["rule_id"].as_str().unwrap()))
        .map(|h| (h["rule_id"].as_str().unwrap().to_owned(), h["value"].to_string()))
        .collect()
}

#[test]
fn one_worker_decides_exactly_like_replay_and_dead_letters_bad_events() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, redis) = (Broker::start(), RedisServer::start());
    topics(&broker, 1);
    let mut lines = workload(50_000, 11);
    // Valid JSON that no rule matches, but over worker.max_event_bytes: dead-lettered as too large.
    let too_large = lines.len() / 3;
    lines.insert(too_large, format!(r#"{{"ts":1700000000000,"type":"noise","pad":"{}"}}"#, "x".repeat(5000)).into_bytes());
    let (expected, bad) = reference(Path::new("rules"), &lines, false);
    assert!(expected.len() > 1_000 && bad.len() == 5, "{} decisions, {} bad", expected.len(), bad.len());
    broker.produce("events", &keyed(&lines), Some(0));

    let mut worker = Worker::start(dir.path(), "w", &config(&broker, &redis, Path::new("rules"), "max_event_bytes = 4096"));
    worker.wait_ready(LONG);
    let decisions = broker.read("decisions", 1, |r| r.len() >= expected.len(), Duration::from_secs(1), LONG);
    let dead = broker.read("events.dlq", 1, |r| r.len() > bad.len(), Duration::from_millis(200), LONG);

    // Decisions: the same records as replay, in order, with the Kafka source of each event.
    let got: Vec<(usize, Value)> = decisions
        .iter()
        .map(|r| {
            let (json, source) = without_source(r);
            assert_eq!(source["topic"], "events");
            assert_eq!(source["partition"], 0);
            (source["offset"].as_u64().unwrap() as usize, json)
        })
        .collect();
    let want: Vec<(usize, Value)> = expected.into_iter().collect();
    assert_eq!(got.len(), want.len());
    for (got, want) in got.iter().zip(&want) {
        assert_eq!(got, want);
    }
    // Decision messages are keyed by the event's Kafka key.
    for record in decisions.iter().take(100) {
        let offset = without_source(record).1["offset"].as_u64().unwrap() as usize;
        assert_eq!(record.key, user_key(&lines[offset]));
    }

    // Dead letters: original bytes and headers, plus the reason and where the event came from.
    let mut want_dead = bad.clone();
    want_dead.insert(too_large, "too_large".to_owned());
    assert_eq!(dead.len(), want_dead.len());
    for (record, (&index, reason)) in dead.iter().zip(&want_dead) {
        assert_eq!(record.payload, lines[index]);
        assert_eq!(record.headers["vigil.reason"], *reason);
        assert_eq!(record.headers["vigil.source.topic"], "events");
        assert_eq!(record.headers["vigil.source.partition"], "0");
        assert_eq!(record.headers["vigil.source.offset"], index.to_string());
        assert!(!record.headers["vigil.error"].is_empty());
        assert_eq!(record.headers["origin"], "test");
    }

    // Metrics: dead letters by reason, late events, decisions, flushes, lag.
    let deadline = Instant::now() + Duration::from_secs(10);
    while worker.metric("vigil_consumer_lag{topic=\"events\",partition=\"0\"}") != Some(0.0) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    let (status, metrics) = worker.get("/metrics").unwrap();
    assert_eq!(status, 200);
    assert_eq!(worker.metric("vigil_dead_letters_total{reason=\"too_large\"}"), Some(1.0), "{metrics}");
    assert_eq!(worker.metric("vigil_dead_letters_total{reason=\"invalid_json\"}"), Some(2.0), "{metrics}");
    assert_eq!(worker.metric("vigil_dead_letters_total{reason=\"not_an_object\"}"), Some(1.0));
    assert_eq!(worker.metric("vigil_dead_letters_total{reason=\"missing_ts\"}"), Some(1.0));
    assert_eq!(worker.metric("vigil_dead_letters_total{reason=\"bad_ts\"}"), Some(1.0));
    assert_eq!(worker.metric("vigil_events_total{outcome=\"dead_lettered\"}"), Some(6.0));
    assert_eq!(
        worker.metric("vigil_events_total{outcome=\"decided\"}").unwrap() as usize,
        decisions.len(),
        "every decided event has one record"
    );
    assert!(worker.metric("vigil_late_events_total{rule=\"login-fail-user-10m\"}").unwrap() > 0.0);
    assert!(worker.metric("vigil_flush_batch_keys_count").unwrap() > 0.0);
    assert!(worker.metric("vigil_decision_latency_seconds_count").unwrap() > 0.0);
    assert_eq!(worker.metric("vigil_consumer_lag{topic=\"events\",partition=\"0\"}"), Some(0.0), "{metrics}");
    assert!(metrics.contains("vigil_rule_hits_total{rule=\"login-fail-user-10m\",mode=\"enforce\",action=\"block\"}"));
    assert!(!metrics.contains("u-1\""), "no user data in labels");
    assert_eq!(worker.get("/healthz").unwrap().0, 200);

    worker.signal("TERM");
    let status = worker.wait_exit(Duration::from_secs(20)).expect("exits after SIGTERM");
    assert!(status.success(), "{status}\n{}", worker.log_text());
}
