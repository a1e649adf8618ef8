//! The Redis store against real `redis-server` processes started by the test harness.

mod support;

use std::collections::BTreeMap;
use std::process::Command;

use support::{redis_totals, RedisServer};
use vigil::event::TimeBounds;
use vigil::pipeline::{replay, Engine, ReplayOptions};
use vigil::store::{CounterStore, MemoryStore, Origin, RedisStore, RedisStoreConfig};
use vigil::harness::workload::{generate, WorkloadSpec};

fn script() -> redis::Script {
    redis::Script::new(include_str!("../lua/apply_window.lua"))
}

type Reply = Vec<Vec<u8>>;

fn call(conn: &mut redis::Connection, key: &str, kind: &str, k: i64, stride: i64, args: &[&str]) -> Vec<String> {
    let script = script();
    let mut inv = script.key(key);
    inv.arg(kind).arg(k).arg(if kind == "d" { 10_000 } else { 0 }).arg(60_000).arg(stride).arg("").arg(args.len()).arg(0);
    for a in args {
        inv.arg(*a);
    }
    let mut replies: Vec<Reply> = inv.invoke(conn).unwrap();
    assert_eq!(replies.len(), 1);
    replies.pop().unwrap().into_iter().map(|b| String::from_utf8_lossy(&b).into_owned()).collect()
}

#[test]
fn one_script_call_serves_many_keys_independently() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let script = script();
    let mut inv = script.key("vg:t:m1");
    inv.arg("c").arg(3).arg(0).arg(60_000).arg(2).arg("").arg(4).arg(0).arg(5).arg(2).arg(6).arg(1);
    inv.key("vg:t:m2").arg("c").arg(3).arg(0).arg(60_000).arg(2).arg("").arg(0).arg(0);
    inv.key("vg:t:m3").arg("s").arg(2).arg(0).arg(60_000).arg(2).arg("").arg(2).arg(0).arg(9).arg("1500000");
    let replies: Vec<Reply> = inv.invoke(&mut conn).unwrap();
    let text = |r: &Reply| r.iter().map(|b| String::from_utf8_lossy(b).into_owned()).collect::<Vec<_>>();
    let first = text(&replies[0]);
    assert_eq!(first[..3], ["6", "0", "0"]);
    assert_eq!(first[4], "*");
    let window: BTreeMap<_, _> = first[5..].chunks(2).map(|p| (p[0].clone(), p[1].clone())).collect();
    assert_eq!(window, BTreeMap::from([("b5".into(), "2".into()), ("b6".into(), "1".into())]));
    assert!(replies[1].is_empty(), "a key that holds nothing");
    let third = text(&replies[2]);
    assert_eq!([&third[..3], &third[4..]].concat(), ["9", "0", "0", "*", "b9", "1500000"]);
}

#[test]
fn script_counts_refuses_late_prunes_and_sets_ttl() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    // k = 3 buckets. Buckets 10, 11, 10 → head 11, window 9..=11.
    let out = call(&mut conn, "vg:t:a", "c", 3, 2, &["10", "2", "11", "1", "10", "1"]);
    assert_eq!(out[..3], ["11", "0", "0"]);
    // A new key's version starts at the server's clock in microseconds; each write adds one.
    let created: u64 = out[3].parse().unwrap();
    assert!(created > 1_700_000_000_000_000, "{created}");
    let window: BTreeMap<_, _> = out[5..].chunks(2).map(|p| (p[0].clone(), p[1].clone())).collect();
    assert_eq!(window, BTreeMap::from([("b10".into(), "3".into()), ("b11".into(), "1".into())]));
    // Bucket 8 is late (8 <= 11 - 3); bucket 13 moves the head and prunes bucket 10.
    let out = call(&mut conn, "vg:t:a", "c", 3, 2, &["8", "1", "13", "5"]);
    assert_eq!(out[..5], ["13", "1", "0", &(created + 1).to_string(), "*"]);
    let window: BTreeMap<_, _> = out[5..].chunks(2).map(|p| (p[0].clone(), p[1].clone())).collect();
    assert_eq!(window, BTreeMap::from([("b11".into(), "1".into()), ("b13".into(), "5".into())]));
    // Stored compactly: buckets by slot (bucket mod k), bucket 10 (slot 1) pruned.
    let stored: BTreeMap<String, String> = redis::cmd("HGETALL").arg("vg:t:a").query(&mut conn).unwrap();
    assert_eq!(
        stored,
        BTreeMap::from([
            ("h".into(), "13".into()),
            ("v".into(), (created + 1).to_string()),
            ("2".into(), "1".into()),
            ("1".into(), "5".into())
        ])
    );
    let ttl: i64 = redis::cmd("PTTL").arg("vg:t:a").query(&mut conn).unwrap();
    assert!(ttl > 59_000 && ttl <= 60_000, "ttl {ttl}");
    // A read with no deltas returns the window and does not write.
    assert_eq!(call(&mut conn, "vg:t:a", "c", 3, 2, &[])[..1], ["13"]);
    assert!(call(&mut conn, "vg:t:missing", "c", 3, 2, &[]).is_empty());
    let exists: i64 = redis::cmd("EXISTS").arg("vg:t:missing").query(&mut conn).unwrap();
    assert_eq!(exists, 0);
}

#[test]
fn script_sums_exact_64_bit_micro_units_and_tracks_distinct_latest() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    // Micro-units beyond 2^53 (where a Lua double stops being exact), negative amounts with
    // carries across the 10^9 limb, and saturation at the 64-bit limits, exactly as Rust adds.
    let big = "999999999999999999"; // 10^18 - 1
    let out = call(
        &mut conn,
        "vg:t:s",
        "s",
        5,
        2,
        &["1", "100000", "1", "200000", "2", big, "2", big, "2", "7", "3", "1000000000", "3", "-1", "4", "-5000000000", "4", "4000000001"],
    );
    let window: BTreeMap<_, _> = out[5..].chunks(2).map(|p| (p[0].clone(), p[1].clone())).collect();
    assert_eq!(window["b1"], "300000");
    assert_eq!(window["b2"], "2000000000000000005", "2 × (10^18 - 1) + 7, exact");
    assert_eq!(window["b3"], "999999999");
    assert_eq!(window["b4"], "-999999999");
    let rust = [big.parse::<i64>().unwrap(), big.parse().unwrap(), 7].iter().fold(0i64, |a, &v| a.saturating_add(v));
    assert_eq!(window["b2"], rust.to_string());
    // Saturation: 10 × (10^18 - 1) stops at i64::MAX, as the Rust side's saturating_add does.
    let many: Vec<&str> = (0..10).flat_map(|_| ["5", big]).collect();
    let out = call(&mut conn, "vg:t:sat", "s", 5, 2, &many);
    let window: BTreeMap<_, _> = out[5..].chunks(2).map(|p| (p[0].clone(), p[1].clone())).collect();
    assert_eq!(window["b5"], i64::MAX.to_string());
    // Amounts must be integers of at most 19 digits: anything else is refused before a write.
    let script = script();
    let mut inv = script.key("vg:t:bad");
    inv.arg("s").arg(5).arg(0).arg(60_000).arg(2).arg("").arg(2).arg(0).arg("1").arg("0.5");
    assert!(inv.invoke::<Vec<Reply>>(&mut conn).unwrap_err().to_string().contains("bad amount"));

    let (a, b) = ("aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb");
    call(&mut conn, "vg:t:d", "d", 3, 2, &["5", a, "4", b, "3", a]);
    // a's latest stays 5 (an older sighting does not move it back); head 7 drops b (latest 4).
    let out = call(&mut conn, "vg:t:d", "d", 3, 2, &["7", b]);
    let window: BTreeMap<_, _> = out[5..].chunks(2).map(|p| (p[0].clone(), p[1].clone())).collect();
    assert_eq!(window, BTreeMap::from([(format!("d{a}"), "5".into()), (format!("d{b}"), "7".into())]));
}

#[test]
fn script_returns_the_window_only_when_another_writer_changed_it() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let run = |conn: &mut redis::Connection, expected: &str, args: &[&str]| -> Vec<String> {
        let script = script();
        let mut inv = script.key("vg:t:v");
        inv.arg("c").arg(10).arg(0).arg(60_000).arg(2).arg(expected).arg(args.len()).arg(0);
        for a in args {
            inv.arg(*a);
        }
        let mut replies: Vec<Reply> = inv.invoke(conn).unwrap();
        replies.pop().unwrap().into_iter().map(|b| String::from_utf8_lossy(&b).into_owned()).collect()
    };
    // A caller whose view is "the key holds nothing" (version 0) is current on a new key.
    let out = run(&mut conn, "0", &["5", "1"]);
    assert_eq!([&out[..3], &out[4..]].concat(), ["5", "0", "0", "="]);
    let v1: u64 = out[3].parse().unwrap();
    // Our view is v1 and nobody else wrote: no window comes back.
    assert_eq!(run(&mut conn, &v1.to_string(), &["5", "2"]), ["5", "0", "0", &(v1 + 1).to_string(), "="]);
    // Another writer moves the key on; a caller still at v1 + 1 gets the whole window.
    run(&mut conn, "", &["6", "1"]);
    let out = run(&mut conn, &(v1 + 1).to_string(), &["6", "1"]);
    assert_eq!(out[..5], ["6", "0", "0", &(v1 + 3).to_string(), "*"]);
    let window: BTreeMap<_, _> = out[5..].chunks(2).map(|p| (p[0].clone(), p[1].clone())).collect();
    assert_eq!(window, BTreeMap::from([("b5".into(), "3".into()), ("b6".into(), "2".into())]));
    // A refused late delta also means the caller's view is off: the window comes back.
    let current = (v1 + 3).to_string();
    assert_eq!(run(&mut conn, &current, &["-20", "1"])[..5], ["6", "1", "0", current.as_str(), "*"]);
}

#[test]
fn script_takes_the_callers_writes_only_at_the_callers_version() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let run = |conn: &mut redis::Connection, expected: &str, deltas: &[&str], writes: &[&str]| -> Vec<String> {
        let script = script();
        let mut inv = script.key("vg:t:w");
        inv.arg("c").arg(4).arg(0).arg(60_000).arg(2).arg(expected).arg(deltas.len()).arg(writes.len());
        for a in deltas.iter().chain(writes) {
            inv.arg(*a);
        }
        let mut replies: Vec<Reply> = inv.invoke(conn).unwrap();
        replies.pop().unwrap().into_iter().map(|b| String::from_utf8_lossy(&b).into_owned()).collect()
    };
    let stored = |conn: &mut redis::Connection| -> BTreeMap<String, String> {
        redis::cmd("HGETALL").arg("vg:t:w").query(conn).unwrap()
    };
    let map = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
        pairs.iter().map(|(f, v)| (f.to_string(), v.to_string())).collect()
    };
    // A new key and a caller whose view is "nothing" (version 0): its writes are taken as they are
    // (refresh the TTL; v, h, and bucket 10 in slot 2).
    let out = run(&mut conn, "0", &["10", "2"], &["1", "6", "v", "500", "h", "10", "2", "2"]);
    assert_eq!(out, ["10", "0", "0", "500", "="]);
    assert_eq!(stored(&mut conn), map(&[("v", "500"), ("h", "10"), ("2", "2")]));
    let ttl: i64 = redis::cmd("PTTL").arg("vg:t:w").query(&mut conn).unwrap();
    assert!(ttl > 59_000, "ttl {ttl}");
    // At version 500: bucket 15 (slot 3) moves the head on and bucket 10 (slot 2) slides out.
    // No refresh asked: the TTL is left as it is.
    let _: () = redis::cmd("PEXPIRE").arg("vg:t:w").arg(5_000).query(&mut conn).unwrap();
    let out = run(&mut conn, "500", &["15", "1"], &["0", "6", "v", "501", "h", "15", "3", "1", "2"]);
    assert_eq!(out, ["15", "0", "0", "501", "="]);
    assert_eq!(stored(&mut conn), map(&[("v", "501"), ("h", "15"), ("3", "1")]));
    let ttl: i64 = redis::cmd("PTTL").arg("vg:t:w").query(&mut conn).unwrap();
    assert!(ttl <= 5_000, "ttl {ttl}");
    // A caller at a stale version: its writes are ignored, its deltas merged, the window returned,
    // and the TTL refreshed.
    let out = run(&mut conn, "499", &["15", "2"], &["0", "6", "v", "500", "h", "15", "3", "99"]);
    assert_eq!(out, ["15", "0", "0", "502", "*", "b15", "3"]);
    assert_eq!(stored(&mut conn), map(&[("v", "502"), ("h", "15"), ("3", "3")]));
    let ttl: i64 = redis::cmd("PTTL").arg("vg:t:w").query(&mut conn).unwrap();
    assert!(ttl > 59_000, "ttl {ttl}");
    // Writes alone (no deltas to merge) for a stale version: nothing is written, "!" comes back.
    let out = run(&mut conn, "501", &[], &["1", "6", "v", "502", "h", "15", "3", "7"]);
    assert_eq!(out, ["!"]);
    assert_eq!(stored(&mut conn), map(&[("v", "502"), ("h", "15"), ("3", "3")]));
    // Writes carry the highest offset applied per partition.
    let out = run(&mut conn, "502", &[], &["0", "8", "v", "503", "h", "15", "3", "4", "o:2", "41"]);
    assert_eq!(out, ["15", "0", "0", "503", "="]);
    assert_eq!(stored(&mut conn), map(&[("v", "503"), ("h", "15"), ("3", "4"), ("o:2", "41")]));
}

#[test]
fn script_skips_deltas_at_or_below_the_recorded_offset() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    // (bucket, value, partition, offset)
    let out = call(&mut conn, "vg:t:o", "c", 10, 4, &["1", "1", "3", "100", "1", "1", "3", "101"]);
    assert_eq!([&out[..3], &out[4..7]].concat(), ["1", "0", "0", "*", "b1", "2"]);
    // After a crash the same events are replayed, followed by a new one.
    let out = call(&mut conn, "vg:t:o", "c", 10, 4, &["1", "1", "3", "100", "1", "1", "3", "101", "1", "1", "3", "102", "1", "1", "0", "7"]);
    assert_eq!([&out[..3], &out[4..7]].concat(), ["1", "0", "2", "*", "b1", "4"]);
    let recorded: Vec<String> = redis::cmd("HMGET").arg("vg:t:o").arg("o:3").arg("o:0").query(&mut conn).unwrap();
    assert_eq!(recorded, ["102", "7"]);
}

const RULES: &str = "rules";

fn workload(events: u64) -> Vec<u8> {
    let spec = WorkloadSpec { events, users: 5_000, ips: 2_000, rate_per_sec: 200, late: 0.01, out_of_order: 0.05, seed: 3, ..WorkloadSpec::default() };
    let mut out = Vec::new();
    generate(&spec, &mut out).unwrap();
    // Bad lines in the middle: skipped by both stores alike.
    let mut text = String::from_utf8(out).unwrap();
    text.insert_str(text.len() / 2, "not json\n[1]\n{\"no\":\"ts\"}\n");
    text.into_bytes()
}

fn replay_with<S: CounterStore>(store: S, input: &[u8]) -> (Vec<u8>, Engine<S>) {
    let rules = vigil::rule_files::load(std::path::Path::new(RULES)).unwrap();
    let mut engine = Engine::new(rules, store);
    let mut out = Vec::new();
    replay(&mut engine, input, &mut out, std::io::sink(), ReplayOptions::default()).unwrap();
    (out, engine)
}

#[test]
fn redis_replay_decides_exactly_like_the_memory_store() {
    let redis = RedisServer::start();
    let input = workload(100_000);
    let (memory, _) = replay_with(MemoryStore::new(), &input);
    let config = RedisStoreConfig { max_pending: 2_000, ..RedisStoreConfig::default() };
    let (from_redis, engine) = replay_with(RedisStore::connect(&redis.url(), config).unwrap(), &input);
    let stats = engine.store().stats();
    assert!(memory.len() > 10_000, "the workload must produce decisions");
    assert_eq!(String::from_utf8(from_redis).unwrap(), String::from_utf8(memory).unwrap());
    assert!(stats.flushes > 10, "{stats:?}");
    assert_eq!(stats.refused_late, 0, "a single writer never has deltas refused");
}

#[test]
fn a_tiny_read_cache_evicts_and_reloads_without_changing_a_decision() {
    let redis = RedisServer::start();
    let input = workload(30_000);
    let (memory, _) = replay_with(MemoryStore::new(), &input);
    let config = RedisStoreConfig { cache_capacity: 64, max_pending: 300, ..RedisStoreConfig::default() };
    let (from_redis, engine) = replay_with(RedisStore::connect(&redis.url(), config).unwrap(), &input);
    let stats = engine.store().stats();
    assert_eq!(String::from_utf8(from_redis).unwrap(), String::from_utf8(memory).unwrap());
    // Far more loads than keys: evicted windows were read back from Redis.
    assert!(engine.store().live_keys() <= 64 + 300 + 64, "{}", engine.store().live_keys());
    assert!(stats.loads > 30_000, "{stats:?}");
}

/// Decision records without `source` (line numbers restart when input is replayed in parts).
fn decisions(bytes: &[u8]) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(bytes)
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            v.as_object_mut().unwrap().remove("source");
            v.as_object_mut().unwrap().remove("decision_id");
            v
        })
        .collect()
}

/// Replays the first half of `input` with `first`, runs `between`, then the second half with the
/// store `between` returns (the same one, or a fresh process's).
fn replay_in_halves(
    input: &[u8],
    first: RedisStore,
    between: impl FnOnce(RedisStore) -> RedisStore,
) -> (Vec<u8>, RedisStore) {
    let rules = || vigil::rule_files::load(std::path::Path::new(RULES)).unwrap();
    let lines: Vec<&[u8]> = input.split_inclusive(|&b| b == b'\n').collect();
    let (head, tail) = (lines[..lines.len() / 2].concat(), lines[lines.len() / 2..].concat());
    let mut out = Vec::new();
    let mut engine = Engine::new(rules(), first);
    replay(&mut engine, head.as_slice(), &mut out, std::io::sink(), ReplayOptions::default()).unwrap();
    // The second half is another input (its line numbers start again at 1).
    let mut engine = Engine::new(rules(), between(engine.into_store()));
    replay(&mut engine, tail.as_slice(), &mut out, std::io::sink(), ReplayOptions { lane: 1, ..ReplayOptions::default() }).unwrap();
    (out, engine.into_store())
}

#[test]
fn script_flush_mid_run_is_recovered_without_losing_deltas() {
    let redis = RedisServer::start();
    let input = workload(20_000);
    let (memory, _) = replay_with(MemoryStore::new(), &input);
    let config = RedisStoreConfig { max_pending: 500, ..RedisStoreConfig::default() };
    let mut admin = redis.connection();
    let (out, store) = replay_in_halves(&input, RedisStore::connect(&redis.url(), config).unwrap(), |store| {
        let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut admin).unwrap();
        store
    });
    assert!(store.stats().retries >= 1, "NOSCRIPT was seen and handled");
    assert_eq!(decisions(&out), decisions(&memory));
}

#[test]
fn a_new_process_continues_from_the_counters_in_redis() {
    let redis = RedisServer::start();
    let input = workload(20_000);
    let (memory, _) = replay_with(MemoryStore::new(), &input);
    let connect = || RedisStore::connect(&redis.url(), RedisStoreConfig::default()).unwrap();
    // The first process flushes on its way out (replay ends with a flush); the second starts
    // with nothing local and must load every key it touches from Redis.
    let (out, store) = replay_in_halves(&input, connect(), |first| {
        drop(first);
        connect()
    });
    assert!(store.stats().loads > 1_000);
    assert_eq!(decisions(&out), decisions(&memory));
}

/// Counts `lines[range]` (each tagged `lane`, offset = its index) with `store`, flushes and
/// returns the store.
fn count_lines(store: RedisStore, lines: &[&[u8]], range: std::ops::Range<usize>, lane: u64) -> RedisStore {
    let mut engine = Engine::new(vigil::rule_files::load(std::path::Path::new(RULES)).unwrap(), store)
        .with_time(TimeBounds::OFF, std::sync::Arc::new(vigil::clock::SystemClock));
    for i in range {
        let line = lines[i].strip_suffix(b"\n").unwrap_or(lines[i]);
        let event = vigil::event::decode(line, engine.rules().projection()).unwrap();
        engine.evaluate(&event, Origin { lane, offset: i as i64 }).unwrap();
        engine.store_mut().tick().unwrap();
    }
    let mut store = engine.into_store();
    store.flush().unwrap();
    store
}

#[test]
fn input_replayed_after_a_crash_is_judged_but_not_counted_again() {
    // Event time inside every rule's window and in order: the exact totals are well defined.
    let spec = WorkloadSpec { events: 20_000, users: 2_000, ips: 500, rate_per_sec: 800, late: 0.0, out_of_order: 0.0, seed: 9, ..WorkloadSpec::default() };
    let mut all = Vec::new();
    generate(&spec, &mut all).unwrap();
    let lines: Vec<&[u8]> = all.split_inclusive(|&b| b == b'\n').collect();
    let connect = |redis: &RedisServer| RedisStore::connect(&redis.url(), RedisStoreConfig::default()).unwrap();

    let reference = RedisServer::start();
    drop(count_lines(connect(&reference), &lines, 0..20_000, 3));

    // The first process counted and flushed up to line 15 000 but its input position was only
    // committed up to 10 000 when it died; its successor reads 10 000.. again.
    let crashed = RedisServer::start();
    drop(count_lines(connect(&crashed), &lines, 0..15_000, 3));
    let successor = count_lines(connect(&crashed), &lines, 10_000..20_000, 3);
    assert!(successor.stats().skipped_applied >= 5_000, "{:?}", successor.stats());
    assert_eq!(redis_totals(&mut crashed.connection()), redis_totals(&mut reference.connection()));

    // Control: tagged as two different inputs, the same crash counts lines 10 000..15 000 twice.
    let untagged = RedisServer::start();
    drop(count_lines(connect(&untagged), &lines, 0..15_000, 3));
    drop(count_lines(connect(&untagged), &lines, 10_000..20_000, 4));
    assert_ne!(redis_totals(&mut untagged.connection()), redis_totals(&mut reference.connection()));
}

#[test]
fn two_processes_into_one_redis_end_with_exact_totals() {
    // Event time spans 50 s, inside every rule's window: nothing can be late in any interleaving,
    // so the final counters must equal one process replaying everything.
    let spec = WorkloadSpec { events: 40_000, users: 3_000, ips: 1_000, rate_per_sec: 800, late: 0.0, out_of_order: 0.0, seed: 5, ..WorkloadSpec::default() };
    let mut all = Vec::new();
    generate(&spec, &mut all).unwrap();
    let lines: Vec<&[u8]> = all.split_inclusive(|&b| b == b'\n').collect();
    let dir = tempfile::tempdir().unwrap();
    let (odd, even) = (dir.path().join("odd.jsonl"), dir.path().join("even.jsonl"));
    std::fs::write(&odd, lines.iter().step_by(2).copied().collect::<Vec<_>>().concat()).unwrap();
    std::fs::write(&even, lines.iter().skip(1).step_by(2).copied().collect::<Vec<_>>().concat()).unwrap();

    let shared = RedisServer::start();
    let spawn = |input: &std::path::Path| {
        Command::new(env!("CARGO_BIN_EXE_vigil"))
            .args(["replay", "--rules", RULES, "--input", input.to_str().unwrap(), "--redis", &shared.url()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn(&odd), spawn(&even));
    for child in [a, b] {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }

    let single = RedisServer::start();
    let config = RedisStoreConfig::default();
    replay_with(RedisStore::connect(&single.url(), config).unwrap(), &all);

    let concurrent = redis_totals(&mut shared.connection());
    let reference = redis_totals(&mut single.connection());
    assert_eq!(concurrent.len(), reference.len(), "same keys");
    assert!(reference.len() > 1_000);
    for (key, (total, distinct)) in &reference {
        let (got_total, got_distinct) = concurrent[key];
        assert_eq!(got_distinct, *distinct, "{key}");
        // Sums are exact micro-units: the addition order cannot change them.
        assert_eq!(got_total, *total, "{key}");
    }
}

#[test]
fn a_redis_restart_keeps_pending_deltas_and_reconnects() {
    let mut redis = RedisServer::start();
    let config = RedisStoreConfig { max_pending: usize::MAX, flush_interval: std::time::Duration::MAX, ..RedisStoreConfig::default() };
    let mut store = RedisStore::connect(&redis.url(), config).unwrap();
    let spec = vigil::window::WindowSpec::new(1_000, 60, vigil::window::Aggregate::Count);
    let window = store.open_window("restart", spec);
    for i in 0..5_000u64 {
        store.apply(window, &(i % 500).to_le_bytes(), 1_000_000 + i as i64, vigil::window::Delta::Count).unwrap();
    }
    // Everything is pending (no flush yet); Redis goes away and comes back empty.
    redis.restart();
    store.flush().unwrap();
    assert!(store.stats().retries >= 1, "{:?}", store.stats());
    let totals = redis_totals(&mut redis.connection());
    assert_eq!(totals.len(), 500);
    assert_eq!(totals.values().map(|(total, _)| *total).sum::<i128>(), 5_000);
}

#[test]
fn acl_users_and_redacted_passwords() {
    let redis = RedisServer::start();
    let mut admin = redis.connection();
    let _: () = redis::cmd("ACL").arg("SETUSER").arg("vigil").arg("on").arg(">s3cret").arg("~vg:*").arg("+@all").query(&mut admin).unwrap();
    let url = |password: &str| format!("redis://vigil:{password}@127.0.0.1:{}/", redis.port);
    let events = "{\"ts\":1,\"type\":\"login\",\"result\":\"fail\",\"user_id\":\"u\"}\n";
    let run = |url: &str| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_vigil"))
            .args(["replay", "--rules", RULES, "--input", "-", "--redis", url])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        let _ = child.stdin.take().unwrap().write_all(events.as_bytes());
        child.wait_with_output().unwrap()
    };
    let ok = run(&url("s3cret"));
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let keys: Vec<String> = redis::cmd("KEYS").arg("vg:*").query(&mut admin).unwrap();
    assert!(!keys.is_empty(), "counted through the ACL user");

    let refused = run(&url("wrong-password"));
    assert_eq!(refused.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("redis://vigil:***@127.0.0.1"), "{stderr}");
    assert!(!stderr.contains("wrong-password"), "password leaked: {stderr}");
}

#[test]
fn rediss_urls_verify_the_server_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let (tls, ca) = RedisServer::start_tls(dir.path());
    let url = format!("rediss://127.0.0.1:{}/", tls.port);
    let input = workload(2_000);
    let (memory, _) = replay_with(MemoryStore::new(), &input);
    let config = RedisStoreConfig { tls_ca_file: Some(ca), ..RedisStoreConfig::default() };
    let (over_tls, _) = replay_with(RedisStore::connect(&url, config).unwrap(), &input);
    assert_eq!(over_tls, memory);
    // Without the CA the self-signed certificate is refused.
    let untrusted = RedisStore::connect(&url, RedisStoreConfig { attempts: 1, ..RedisStoreConfig::default() });
    assert!(untrusted.is_err(), "an unverified certificate must be refused");
}

#[test]
fn redis_cluster_spreads_keys_and_survives_a_slot_migration() {
    let cluster = support::RedisCluster::start();
    let input = workload(20_000);
    let (memory, _) = replay_with(MemoryStore::new(), &input);
    let connect = || RedisStore::connect(&cluster.url(), RedisStoreConfig { max_pending: 500, ..RedisStoreConfig::default() }).unwrap();
    // First half, then move a slot that holds keys to another master, then the second half
    // through the same store (stale slot map: MOVED), then check every counter landed.
    // The key of the hottest user (u-1, zipf rank 1) for the first rule, failed logins per user:
    // certainly written again in the second half.
    let hot_key = {
        let rules = vigil::rule_files::load(std::path::Path::new(RULES)).unwrap();
        let mut probe = connect();
        let first = rules.counter(rules.active_counters().next().unwrap());
        let window = probe.open_window(&first.id, first.window);
        let mut key = Vec::new();
        vigil::event::Scalar::Str("u-1").encode_into(&mut key);
        probe.redis_key(window, &key)
    };
    let owner = |key: &str| -> usize {
        cluster.nodes.iter().position(|n| {
            let exists: i64 = redis::cmd("EXISTS").arg(key).query(&mut n.connection()).unwrap_or(0);
            exists == 1
        }).expect("the hot key exists on some master")
    };
    let mut before = usize::MAX;
    let (out, store) = replay_in_halves(&input, connect(), |store| {
        before = owner(&hot_key);
        let slot: u16 = redis::cmd("CLUSTER").arg("KEYSLOT").arg(&hot_key).query(&mut cluster.nodes[0].connection()).unwrap();
        cluster.migrate_slot(slot);
        store
    });
    assert_ne!(owner(&hot_key), before, "the hot key's slot moved to another master");
    assert_eq!(decisions(&out), decisions(&memory));
    let sizes: Vec<i64> =
        cluster.nodes.iter().map(|n| redis::cmd("DBSIZE").query(&mut n.connection()).unwrap()).collect();
    assert!(sizes.iter().all(|&n| n > 100), "keys spread over every master: {sizes:?}");
    // The store's slot map was stale after the migration: its calls for that slot were
    // redirected (MOVED) and counted as retries.
    let stats = store.stats();
    assert!(stats.retries >= 1, "{stats:?}");
}

#[test]
fn a_journal_claim_fences_the_previous_owner_of_the_lane() {
    use vigil::store::journal::JournalBatch;
    use vigil::store::{JournalError, JournalWriter};
    let redis = RedisServer::start();
    let config = RedisStoreConfig::default();
    let mut first = JournalWriter::connect(&redis.url(), &config, "group").unwrap();
    let mut second = JournalWriter::connect(&redis.url(), &config, "group").unwrap();
    assert_eq!(first.claim(3).unwrap(), vigil::store::Journal::default());
    let batch = |covered: i64, records: &[(i64, &str)]| JournalBatch {
        covered: Some(covered),
        mark: Some((covered, 1_700_000_000_000 + covered)),
        records: records.iter().map(|(o, r)| (*o, r.as_bytes().to_vec())).collect(),
    };
    first.write(3, &batch(11, &[(10, "r10"), (11, "r11")])).unwrap();
    // The lane moves to a second worker: it sees what the first recorded...
    let journal = second.claim(3).unwrap();
    assert_eq!(journal.produced(10), Some(Some(&b"r10"[..])));
    assert_eq!(journal.produced(9), Some(None));
    assert_eq!(journal.produced(12), None);
    assert_eq!(journal.newest_before(12), Some(1_700_000_000_011));
    // ...and the first, still running, can no longer write.
    assert!(matches!(first.write(3, &batch(12, &[(12, "stale")])), Err(JournalError::Fenced)));
    second.write(3, &batch(12, &[(12, "r12")])).unwrap();
    // Committed past 11: the records before it go with the next write.
    second.trim(3, 12);
    second.write(3, &batch(13, &[])).unwrap();
    let journal = JournalWriter::connect(&redis.url(), &config, "group").unwrap().claim(3).unwrap();
    assert_eq!(journal.records.keys().copied().collect::<std::collections::BTreeSet<_>>(), [12].into());
    assert_eq!(journal.covered, Some(13));
    // Another consumer group's lane 3 is another journal.
    assert_eq!(JournalWriter::connect(&redis.url(), &config, "other").unwrap().claim(3).unwrap().covered, None);
}

#[test]
fn the_script_checks_every_argument_before_its_first_write() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let script = script();
    // Two keys: the first well formed, the second with a bad TTL. Nothing may be written.
    let mut inv = script.key("vg:t:first");
    inv.arg("c").arg(3).arg(0).arg(60_000).arg(2).arg("").arg(2).arg(0).arg(5).arg(1);
    inv.key("vg:t:second").arg("c").arg(3).arg(0).arg(0).arg(2).arg("").arg(2).arg(0).arg(5).arg(1);
    let error = inv.invoke::<Vec<Reply>>(&mut conn).unwrap_err();
    assert!(error.to_string().contains("key 2: bad TTL"), "{error}");
    let exists: i64 = redis::cmd("EXISTS").arg("vg:t:first").query(&mut conn).unwrap();
    assert_eq!(exists, 0, "the first key was not written");
    // A key known at a version that is gone: "?" and nothing written.
    let mut inv = script.key("vg:t:gone");
    inv.arg("c").arg(3).arg(0).arg(60_000).arg(2).arg("12345").arg(2).arg(0).arg(5).arg(1);
    let replies: Vec<Reply> = inv.invoke(&mut conn).unwrap();
    assert_eq!(replies, [vec![b"?".to_vec()]]);
    let exists: i64 = redis::cmd("EXISTS").arg("vg:t:gone").query(&mut conn).unwrap();
    assert_eq!(exists, 0);
    // Out of memory: Redis refuses the whole call before it runs (the script declares itself).
    let _: () = redis::cmd("SET").arg("filler").arg("x".repeat(1 << 20)).query(&mut conn).unwrap();
    let used: String = redis::cmd("INFO").arg("memory").query(&mut conn).unwrap();
    let used: u64 = used.lines().find_map(|l| l.strip_prefix("used_memory:")).unwrap().trim().parse().unwrap();
    let _: () = redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg(used / 2).query(&mut conn).unwrap();
    let _: () = redis::cmd("CONFIG").arg("SET").arg("maxmemory-policy").arg("noeviction").query(&mut conn).unwrap();
    let mut inv = script.key("vg:t:oom");
    inv.arg("c").arg(3).arg(0).arg(60_000).arg(2).arg("").arg(2).arg(0).arg(5).arg(1);
    let error = inv.invoke::<Vec<Reply>>(&mut conn).unwrap_err();
    assert!(error.to_string().contains("OOM"), "{error}");
    let _: () = redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg(0).query(&mut conn).unwrap();
    let exists: i64 = redis::cmd("EXISTS").arg("vg:t:oom").query(&mut conn).unwrap();
    assert_eq!(exists, 0);
}

fn hold_script() -> redis::Script {
    redis::Script::new(include_str!("../lua/hold.lua"))
}

#[test]
fn hold_script_keeps_the_later_time_and_refuses_bad_arguments() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let raise = |conn: &mut redis::Connection, until: &str, ttl: i64| -> redis::RedisResult<String> {
        hold_script().key("vg:h:r:k").arg(until).arg(ttl).invoke(conn)
    };
    assert_eq!(raise(&mut conn, "1700000600000", 3_600_000).unwrap(), "1700000600000");
    assert_eq!(raise(&mut conn, "1700000500000", 3_600_000).unwrap(), "1700000600000", "never shortened");
    assert_eq!(raise(&mut conn, "1700000900000", 7_200_000).unwrap(), "1700000900000");
    let ttl: i64 = redis::cmd("PTTL").arg("vg:h:r:k").query(&mut conn).unwrap();
    assert!(ttl > 7_100_000 && ttl <= 7_200_000, "the raise set its TTL: {ttl}");
    // Times past 2^53 or not integers would not be exact in Lua: refused, nothing written.
    for bad in ["9007199254740993", "1.5", "-1", "1e3", ""] {
        assert!(raise(&mut conn, bad, 1000).is_err(), "{bad:?}");
    }
    assert!(raise(&mut conn, "1", 0).is_err(), "a TTL of zero");
    let stored: String = redis::cmd("GET").arg("vg:h:r:k").query(&mut conn).unwrap();
    assert_eq!(stored, "1700000900000");
}

/// A hold set by one process is seen by another through Redis within one flush interval, and
/// by a process started later (a hold survives a restart); its key holds no event bytes.
#[test]
fn holds_are_shared_through_redis_and_survive_a_restart() {
    let redis = RedisServer::start();
    let config = RedisStoreConfig { flush_interval: std::time::Duration::from_millis(20), ..RedisStoreConfig::default() };
    let mut a = RedisStore::connect(&redis.url(), config.clone()).unwrap();
    let mut b = RedisStore::connect(&redis.url(), config.clone()).unwrap();
    let space_a = a.open_holds("brute-force", 3_600_000);
    let space_b = b.open_holds("brute-force", 3_600_000);
    let key = b"s\x05{evil}\x00user";
    assert_eq!(b.held_until(space_b, key).unwrap(), None);
    assert_eq!(a.extend_hold(space_a, key, 1_700_000_600_000).unwrap(), 1_700_000_600_000);
    assert_eq!(a.extend_hold(space_a, key, 1_700_000_100_000).unwrap(), 1_700_000_600_000, "never shortened");
    assert_eq!(a.held_until(space_a, key).unwrap(), Some(1_700_000_600_000), "the setter sees it at once");
    // Written behind: the next flush carries it; b's view of the key is older than a flush
    // interval by then, so b reads it again.
    std::thread::sleep(config.flush_interval * 2);
    a.tick().unwrap();
    a.flush().unwrap();
    assert_eq!(b.held_until(space_b, key).unwrap(), Some(1_700_000_600_000));
    // b extends it; a learns the later time on its next read.
    assert_eq!(b.extend_hold(space_b, key, 1_700_000_900_000).unwrap(), 1_700_000_900_000);
    b.flush().unwrap();
    std::thread::sleep(config.flush_interval * 2);
    assert_eq!(a.held_until(space_a, key).unwrap(), Some(1_700_000_900_000));
    drop(a);
    drop(b);
    let mut c = RedisStore::connect(&redis.url(), config).unwrap();
    let space_c = c.open_holds("brute-force", 3_600_000);
    assert_eq!(c.held_until(space_c, key).unwrap(), Some(1_700_000_900_000), "a new process sees the hold");
    let name = c.redis_hold_key(space_c, key);
    assert!(name.starts_with("vg:h:brute-force:") && name.len() == "vg:h:brute-force:".len() + 32, "{name}");
    let mut conn = redis.connection();
    let keys: Vec<String> = redis::cmd("KEYS").arg("vg:h:*").query(&mut conn).unwrap();
    assert_eq!(keys, std::slice::from_ref(&name));
    let ttl: i64 = redis::cmd("PTTL").arg(&name).query(&mut conn).unwrap();
    assert!(ttl > 3_000_000, "TTL at least the hold: {ttl}");
}

/// The script's `max_distinct` against the in-process window on random sequences (values coming
/// back, out-of-order and late buckets, slides that make room), sent in random chunks so every
/// call merges into what the previous calls stored.
#[test]
fn the_script_bounds_distinct_values_exactly_as_the_window_does() {
    use vigil::window::{Aggregate, Applied, Delta, WindowSpec, WindowState};
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let script = script();
    let mut capped_somewhere = false;
    for case in 0..60 {
        let cap = 1 + next(6) as u32;
        let k = 1 + next(5) as i64;
        let spec = WindowSpec { max_distinct: cap, ..WindowSpec::new(1_000, k, Aggregate::Distinct) };
        let mut state = WindowState::new(Aggregate::Distinct);
        let key = format!("vg:t:cap{case}");
        let mut newest = 10i64;
        let mut sent = 0;
        while sent < 80 {
            let chunk = 1 + next(8) as usize;
            let mut args: Vec<String> = Vec::new();
            for _ in 0..chunk {
                newest += next(3) as i64;
                let bucket = newest - next(k as u64 + 2) as i64;
                let value = next(12) as u128;
                if matches!(state.apply(&spec, bucket, Delta::Distinct(value)), Applied::Counted(n) if n == i64::from(cap)) {
                    capped_somewhere = true;
                }
                args.push(bucket.to_string());
                args.push(format!("{value:016}"));
            }
            sent += chunk;
            let mut inv = script.key(&key);
            inv.arg("d").arg(k).arg(cap).arg(60_000).arg(2).arg("").arg(args.len()).arg(0);
            for a in &args {
                inv.arg(a);
            }
            let mut replies: Vec<Reply> = inv.invoke(&mut conn).unwrap();
            let reply: Vec<String> = replies.pop().unwrap().into_iter().map(|b| String::from_utf8(b).unwrap()).collect();
            let from_script: BTreeMap<String, i64> =
                reply[5..].chunks(2).map(|p| (p[0].clone(), p[1].parse().unwrap())).collect();
            let WindowState::Distinct(set) = &state else { unreachable!("a distinct window") };
            let expected: BTreeMap<String, i64> = set.live_values(&spec).map(|(v, b)| (format!("d{v:016}"), b)).collect();
            assert_eq!(from_script, expected, "case {case}: cap {cap}, k {k}, after {sent} deltas");
            assert!(from_script.len() <= cap as usize);
        }
    }
    assert!(capped_somewhere, "the sequences must reach the bound");
}

/// The attack of one IP with a million distinct users: its Redis hash stays at `max_distinct`
/// values (default 10 000), no script call scans a million fields, and the decisions are those
/// of the in-process store.
#[test]
fn a_million_distinct_values_on_one_key_stay_bounded_in_redis() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("ip.toml"),
        "[[counter]]\nid = \"users-per-ip\"\ndimensions = [\"ip\"]\nwindow = \"1h\"\naggregate = \"distinct\"\nfield = \"user_id\"\n\n\
         [[rule]]\nid = \"shared-ip\"\naction = \"review\"\nwhen = \"$users-per-ip >= 10000\"\n",
    )
    .unwrap();
    let rules = || vigil::rule_files::load(dir.path()).unwrap();
    let mut input = Vec::new();
    for i in 0..1_000_000u64 {
        // 100 events per second: the attack spans 2.8 hours, so the window slides through it.
        input.extend_from_slice(format!("{{\"ts\":{},\"ip\":\"203.0.113.9\",\"user_id\":\"u-{i}\"}}\n", 1_700_000_000_000 + i * 10).as_bytes());
    }
    let run = |store| {
        let mut engine = Engine::new(rules(), store);
        let mut out = Vec::new();
        replay(&mut engine, &input[..], &mut out, std::io::sink(), ReplayOptions::default()).unwrap();
        (out, engine)
    };
    let memory = run(vigil::store::AnyStore::Memory(MemoryStore::new())).0;
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let _: () = redis::cmd("SLOWLOG").arg("RESET").query(&mut conn).unwrap();
    let started = std::time::Instant::now();
    let (from_redis, _engine) = run(vigil::store::AnyStore::Redis(Box::new(RedisStore::connect(&redis.url(), RedisStoreConfig::default()).unwrap())));
    let elapsed = started.elapsed();
    assert_eq!(from_redis.len(), memory.len());
    assert!(from_redis == memory, "Redis and the in-process store decide alike");
    let keys: Vec<String> = redis::cmd("KEYS").arg("vg:users-per-ip:*").query(&mut conn).unwrap();
    assert_eq!(keys.len(), 1);
    let fields: usize = redis::cmd("HLEN").arg(&keys[0]).query(&mut conn).unwrap();
    // 10 000 values plus the head, the version and the recorded offset.
    assert!(fields <= 10_003, "{fields} fields");
    let bytes: u64 = redis::cmd("MEMORY").arg("USAGE").arg(&keys[0]).query(&mut conn).unwrap();
    assert!(bytes < 2 << 20, "{bytes} bytes");
    let slow: Vec<redis::Value> = redis::cmd("SLOWLOG").arg("GET").arg(1000).query(&mut conn).unwrap();
    let durations: Vec<i64> = slow
        .iter()
        .filter_map(|entry| match entry {
            redis::Value::Array(items) => match items.get(2) {
                Some(redis::Value::Int(us)) => Some(*us),
                _ => None,
            },
            _ => None,
        })
        .collect();
    let slowest_us = durations.iter().copied().max().unwrap_or(0);
    let over_100ms = durations.iter().filter(|&&us| us > 100_000).count();
    let decisions = memory.iter().filter(|&&b| b == b'\n').count();
    eprintln!(
        "1M distinct on one key: {fields} fields, {bytes} bytes, replay through Redis {elapsed:?}, \
         {} slowlog entries over 10 ms ({over_100ms} over 100 ms), slowest {slowest_us} µs, {decisions} decisions",
        slow.len()
    );
}

/// Dimension values an attacker controls (braces that would pick a Cluster hash slot,
/// separators, NUL, a megabyte, numbers that look like strings) never reach a Redis key: every
/// key is `vg:<counter>:<32 hex digits>`, distinct tuples get distinct keys, and the key of an
/// honest value is the same whatever hostile values came before it.
#[test]
fn hostile_dimension_values_cannot_steer_redis_keys() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("steer.toml"),
        "[[counter]]\nid = \"pair\"\ndimensions = [\"user_id\", \"ip\"]\nwindow = \"1h\"\n\n\
         [[rule]]\nid = \"many\"\naction = \"alert\"\nwhen = \"$pair > 100\"\n",
    )
    .unwrap();
    let megabyte = "{".repeat(1 << 20);
    let hostile: Vec<(String, String)> = vec![
        (r#""{victim}""#.into(), r#""1.2.3.4""#.into()),
        (r#""victim""#.into(), r#""{1.2.3.4}""#.into()),
        (r#""{""#.into(), r#""}""#.into()),
        (r#""a:b""#.into(), r#""c""#.into()),
        (r#""a""#.into(), r#""b:c""#.into()),
        (r#""a\u0000b""#.into(), r#""c""#.into()),
        (r#""a""#.into(), r#""\u0000bc""#.into()),
        (r#""17""#.into(), r#""x""#.into()),
        ("17".into(), r#""x""#.into()),
        ("17.0".into(), r#""x""#.into()),
        ("true".into(), r#""x""#.into()),
        (r#""true""#.into(), r#""x""#.into()),
        (format!("\"{megabyte}\""), r#""x""#.into()),
        (format!("\"{megabyte}\""), r#""y""#.into()),
    ];
    // 17 and 17.0 are one key (numbers by value): 13 distinct tuples.
    let distinct = hostile.len() - 1;
    let victim = r#"{"ts":1700000000500,"user_id":"victim","ip":"1.2.3.4"}"#;
    let mut with_hostile = String::new();
    for (i, (user, ip)) in hostile.iter().enumerate() {
        with_hostile.push_str(&format!("{{\"ts\":{},\"user_id\":{user},\"ip\":{ip}}}\n", 1_700_000_000_000u64 + i as u64));
    }
    // A lone surrogate is not a string JSON can carry: a bad line, counted nowhere.
    with_hostile.push_str("{\"ts\":1700000000100,\"user_id\":\"\\ud800\",\"ip\":\"x\"}\n");
    with_hostile.push_str(victim);
    with_hostile.push('\n');

    let keys_after = |input: &str| {
        let redis = RedisServer::start();
        let rules = vigil::rule_files::load(dir.path()).unwrap();
        let store = RedisStore::connect(&redis.url(), RedisStoreConfig::default()).unwrap();
        let mut engine = Engine::new(rules, store);
        let mut out = Vec::new();
        // Lines of a megabyte and more are allowed here (the default limit is 1 MiB per line).
        let options = ReplayOptions { max_event_bytes: 4 << 20, ..ReplayOptions::default() };
        let summary = replay(&mut engine, input.as_bytes(), &mut out, std::io::sink(), options).unwrap();
        let mut conn = redis.connection();
        let keys: Vec<String> = redis::cmd("KEYS").arg("vg:pair:*").query(&mut conn).unwrap();
        (keys, summary.bad_lines)
    };
    let (keys, bad) = keys_after(&with_hostile);
    assert_eq!(bad, 1);
    assert_eq!(keys.len(), distinct + 1, "{keys:?}");
    for key in &keys {
        let digest = key.strip_prefix("vg:pair:").unwrap();
        assert_eq!(digest.len(), 32, "{key}");
        assert!(digest.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()), "{key}");
    }
    let (alone, _) = keys_after(&format!("{victim}\n"));
    assert_eq!(alone.len(), 1);
    assert!(keys.contains(&alone[0]), "the victim's key does not depend on what came before");
}

#[test]
fn a_discarded_batch_leaves_no_count_and_no_hold_in_redis() {
    use vigil::window::{Aggregate, Applied, Delta, WindowSpec};
    let redis = RedisServer::start();
    let config = RedisStoreConfig { max_pending: usize::MAX, flush_interval: std::time::Duration::MAX, ..RedisStoreConfig::default() };
    let mut store = RedisStore::connect(&redis.url(), config.clone()).unwrap();
    let spec = WindowSpec::new(1_000, 60, Aggregate::Count);
    let window = store.open_window("fenced", spec);
    let holds = store.open_holds("fenced-hold", 3_600_000);
    let at = 1_000_000;
    let count = |store: &mut RedisStore, key: &[u8], lane: u64, offset: i64| {
        store.set_origin(Some(Origin { lane, offset }));
        store.apply(window, key, at, Delta::Count).unwrap();
    };
    // Flushed before the batch: key a = 1.
    count(&mut store, b"a", 1, 1);
    store.flush().unwrap();
    // Pending from another partition (lane 2), not flushed yet: a = 2, b = 1.
    count(&mut store, b"a", 2, 7);
    count(&mut store, b"b", 2, 8);
    store.extend_hold(holds, b"h", at + 1_000).unwrap();
    // The batch of lane 1 from offset 2: a, b and c counted, a hold raised further and a new one.
    store.begin_batch();
    for (offset, key) in [(2, b"a"), (3, b"b"), (4, b"c"), (5, b"a")] {
        count(&mut store, key, 1, offset);
    }
    store.extend_hold(holds, b"h", at + 9_000).unwrap();
    store.extend_hold(holds, b"new", at + 9_000).unwrap();
    assert_eq!(store.read(window, b"a", at).unwrap().applied, Applied::Counted(4));
    // Its journal write was fenced: the batch is taken back.
    store.discard_batch(1, 2).unwrap();

    // This process and Redis agree on exactly what was counted outside the batch.
    for (key, expected) in [(&b"a"[..], 2), (b"b", 1), (b"c", 0)] {
        assert_eq!(store.read(window, key, at).unwrap().applied, Applied::Counted(expected), "{key:?}");
    }
    assert_eq!(store.held_until(holds, b"h").unwrap(), Some(at + 1_000));
    assert_eq!(store.held_until(holds, b"new").unwrap(), None);
    drop(store);
    let mut fresh = RedisStore::connect(&redis.url(), config).unwrap();
    let window = fresh.open_window("fenced", spec);
    let holds = fresh.open_holds("fenced-hold", 3_600_000);
    for (key, expected) in [(&b"a"[..], 2), (b"b", 1), (b"c", 0)] {
        assert_eq!(fresh.read(window, key, at).unwrap().applied, Applied::Counted(expected), "{key:?}");
    }
    assert_eq!(fresh.held_until(holds, b"h").unwrap(), Some(at + 1_000));
    assert_eq!(fresh.held_until(holds, b"new").unwrap(), None);
    // The next owner counts the batch's events itself: once each.
    fresh.begin_batch();
    for (offset, key) in [(2, b"a"), (3, b"b"), (4, b"c"), (5, b"a")] {
        fresh.set_origin(Some(Origin { lane: 1, offset }));
        fresh.apply(window, key, at, Delta::Count).unwrap();
    }
    fresh.end_batch();
    fresh.flush().unwrap();
    let totals = redis_totals(&mut redis.connection());
    assert_eq!(totals.values().map(|(total, _)| *total).sum::<i128>(), 7);
}
