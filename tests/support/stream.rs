//! The event streams the end-to-end worker tests produce to Kafka, and the clean pass they are
//! judged against: generated event lines keyed by user as produced, and one replay of the same
//! lines (in process for the decisions, into a fresh `redis-server` for the counters).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;
use vigil::harness::workload::{generate, WorkloadSpec};
use vigil::pipeline::ReplayOptions;
use vigil::store::MemoryStore;

use super::store_replay::{replay_rules, RULES};
use super::{redis_totals, RedisServer};

/// Shipped rules keyed by `user_id`, the Kafka message key: a partition's owner sees all of a
/// user's events in order, so these decide exactly as replay whatever the partitioning.
pub const USER_KEYED: [&str; 5] = [
    "login-brute-force",
    "login-success-after-fails",
    "login-many-devices",
    "pay-many-cards",
    "pay-country-spend",
];

/// The generated events of `spec`, one line each (each line one Kafka message).
pub fn workload_lines(spec: &WorkloadSpec) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    generate(spec, &mut out).unwrap();
    out.split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .map(<[u8]>::to_vec)
        .collect()
}

/// The Kafka key of an event line: its `user_id`, if it has one.
pub fn user_key(line: &[u8]) -> Option<Vec<u8>> {
    let value: Value = serde_json::from_slice(line).ok()?;
    value
        .get("user_id")?
        .as_str()
        .map(|s| s.as_bytes().to_vec())
}

/// Records keyed as produced: (key, line).
pub fn keyed(lines: &[Vec<u8>]) -> Vec<(Option<Vec<u8>>, Vec<u8>)> {
    lines.iter().map(|l| (user_key(l), l.clone())).collect()
}

/// Replay of `lines` (in this order) with the in-process store and the rules at `rules`: each
/// decision record by its line's 0-based index, without `source` and `decision_id` (a worker's
/// records name a Kafka position there instead), and replay's diagnostics.
pub fn replay_lines(
    rules: &Path,
    lines: &[Vec<u8>],
    emit_allow: bool,
) -> (Vec<(usize, Value)>, Vec<u8>) {
    let options = ReplayOptions {
        emit_allow,
        ..ReplayOptions::default()
    };
    let (out, diagnostics, _engine) =
        replay_rules(rules, MemoryStore::new(), &lines.join(&b'\n'), options);
    let records = out
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| {
            let mut record: Value = serde_json::from_slice(l).unwrap();
            let line = record["source"]["line"].as_u64().unwrap() as usize;
            record.as_object_mut().unwrap().remove("source");
            record.as_object_mut().unwrap().remove("decision_id");
            (line - 1, record)
        })
        .collect();
    (records, diagnostics)
}

/// The counters one clean pass over `lines` (`vigil replay --redis` with the shipped rules)
/// leaves in a fresh Redis.
pub fn reference_totals(dir: &Path, lines: &[Vec<u8>]) -> BTreeMap<String, (i128, usize)> {
    let reference = RedisServer::start();
    let input = dir.join("reference.jsonl");
    std::fs::write(&input, lines.join(&b'\n')).unwrap();
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_vigil"))
        .args([
            "replay",
            "--rules",
            RULES,
            "--input",
            input.to_str().unwrap(),
            "--redis",
            &reference.url(),
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    redis_totals(&mut reference.connection())
}
