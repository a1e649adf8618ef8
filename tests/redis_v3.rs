//! Rules v3 against real `redis-server` processes started by the test harness: every public
//! scenario counted in Redis gives exactly its expected decisions, and a `last` window's pending
//! values survive a Redis restart.

mod support;

use std::process::Command;

use support::RedisServer;
use vigil::store::{CounterStore, RedisStore, RedisStoreConfig};
use vigil::window::{Aggregate, LastValue, WindowSpec};

/// Each conformance scenario replayed with `--redis` into its own empty Redis gives exactly its
/// `expected.jsonl` (compared by `tests/conformance/compare.py`, as the in-process run is).
#[test]
fn every_conformance_scenario_decides_the_same_counted_in_redis() {
    let mut scenarios: Vec<_> = std::fs::read_dir("tests/conformance")
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    scenarios.sort();
    assert!(scenarios.len() >= 24, "{scenarios:?}");
    let dir = tempfile::tempdir().unwrap();
    for scenario in &scenarios {
        let name = scenario.file_name().unwrap().to_string_lossy().into_owned();
        let redis = RedisServer::start();
        let out = Command::new(env!("CARGO_BIN_EXE_vigil"))
            .arg("replay")
            .arg("--rules")
            .arg(scenario.join("rules"))
            .arg("--input")
            .arg(scenario.join("events.jsonl"))
            .args(["--redis", &redis.url()])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        // Scenario 19 has bad lines: replay still exits 0 while most lines decode.
        assert!(out.status.success(), "{name}: {stderr}");
        let actual = dir.path().join(format!("{name}.jsonl"));
        std::fs::write(&actual, &out.stdout).unwrap();
        let compared = Command::new("python3")
            .arg("tests/conformance/compare.py")
            .arg(scenario.join("expected.jsonl"))
            .arg(&actual)
            .output()
            .unwrap();
        assert!(
            compared.status.success(),
            "{name} in Redis:\n{}{}",
            String::from_utf8_lossy(&compared.stdout),
            String::from_utf8_lossy(&compared.stderr)
        );
    }
}

/// A `last` window's pending events (not flushed yet) reach Redis after it restarts empty:
/// every key ends with its latest event.
#[test]
fn a_redis_restart_keeps_pending_last_values() {
    let mut redis = RedisServer::start();
    let config = RedisStoreConfig {
        max_pending: usize::MAX,
        flush_interval: std::time::Duration::MAX,
        ..RedisStoreConfig::default()
    };
    let mut store = RedisStore::connect(&redis.url(), config).unwrap();
    let mut spec = WindowSpec::new(1_000, 60, Aggregate::Last);
    spec.identity = 7;
    let window = store.open_window("restart-last", spec);
    for i in 0..5_000u64 {
        let (observed, previous) = store
            .apply_last(
                window,
                &(i % 500).to_le_bytes(),
                1_000_000 + i as i64,
                LastValue::Str(format!("v{i}").into()),
            )
            .unwrap();
        // The previous event of the key is 500 events (ms) earlier.
        match i.checked_sub(500) {
            Some(before) => assert_eq!(
                (observed.applied.value(), previous),
                (
                    Some(1_000_000 + before as i64),
                    Some(LastValue::Str(format!("v{before}").into()))
                )
            ),
            None => assert_eq!(previous, None),
        }
    }
    redis.restart();
    store.flush().unwrap();
    assert!(store.stats().retries >= 1, "{:?}", store.stats());
    let mut conn = redis.connection();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("vg:restart-last:*")
        .query(&mut conn)
        .unwrap();
    assert_eq!(keys.len(), 500);
    let mut kept: Vec<String> = keys
        .iter()
        .map(|k| {
            let l: String = redis::cmd("HGET").arg(k).arg("l").query(&mut conn).unwrap();
            l.rsplit(":s").next().unwrap().to_owned()
        })
        .collect();
    kept.sort();
    let mut want: Vec<String> = (4_500..5_000).map(|i| format!("v{i}")).collect();
    want.sort();
    assert_eq!(kept, want);
    // A fresh process reads them back as each key's previous event.
    let mut fresh = RedisStore::connect(&redis.url(), RedisStoreConfig::default()).unwrap();
    let window = fresh.open_window("restart-last", spec);
    let (observed, value) = fresh
        .read_last(window, &7u64.to_le_bytes(), 1_006_000)
        .unwrap();
    assert_eq!(
        (observed.applied.value(), value),
        (Some(1_004_507), Some(LastValue::Str("v4507".into())))
    );
}
