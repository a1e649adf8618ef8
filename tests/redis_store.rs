//! The Redis store against real `redis-server` processes started by the test harness: decisions
//! equal to the in-process store's, exactly-once counting across crashes, processes and restarts,
//! a Redis Cluster, holds, the decision journal, and batches taken back.

mod support;

use std::process::Command;

use support::store_replay::{replay_rules, replay_with, workload, RULES};
use support::{redis_totals, RedisServer};
use vigil::clock::ManualMonotonic;
use vigil::event::TimeBounds;
use vigil::harness::workload::{generate, WorkloadSpec};
use vigil::pipeline::{replay, Engine, ReplayOptions};
use vigil::store::{CounterStore, InputPosition, MemoryStore, RedisStore, RedisStoreConfig};

#[test]
fn redis_replay_decides_exactly_like_the_memory_store() {
    let redis = RedisServer::start();
    let input = workload(100_000);
    let (memory, _) = replay_with(MemoryStore::new(), &input);
    let config = RedisStoreConfig {
        max_pending: 2_000,
        ..RedisStoreConfig::default()
    };
    let (from_redis, engine) =
        replay_with(RedisStore::connect(&redis.url(), config).unwrap(), &input);
    let stats = engine.store().stats();
    assert!(memory.len() > 10_000, "the workload must produce decisions");
    assert_eq!(
        String::from_utf8(from_redis).unwrap(),
        String::from_utf8(memory).unwrap()
    );
    assert!(stats.flushes > 10, "{stats:?}");
    assert_eq!(
        stats.refused_late, 0,
        "a single writer never has deltas refused"
    );
    // Each batch's new windows were read while the batch before it was counted.
    assert!(stats.early_loads > 10_000, "{stats:?}");
}

/// With Redis, replay decodes each batch while the one before it is judged (to read its windows
/// meanwhile) and admits its events only when their turn comes: bad lines, and events too far in
/// the future, are reported at the same line numbers and leave the same counts as in process.
#[test]
fn lines_read_ahead_are_refused_and_reported_like_lines_judged_at_once() {
    let redis = RedisServer::start();
    let mut input = workload(5_000);
    // In the third batch of 1 024 lines: a line from a broken clock, for a user seen before and
    // after it (counted, it would raise that user's windows).
    let user = "\"user_id\":\"";
    let text = String::from_utf8(input.clone()).unwrap();
    let at = text.match_indices('\n').nth(3_000).unwrap().0 + 1;
    let someone = &text[at..];
    let id_start = someone.find(user).unwrap() + user.len();
    let id = &someone[id_start..id_start + someone[id_start..].find('"').unwrap()];
    let future = format!(
        "{{\"ts\":253402300799999,\"type\":\"login\",\"result\":\"fail\",\"user_id\":\"{id}\",\"ip\":\"10.0.0.1\"}}\n"
    );
    input.splice(at..at, future.into_bytes());
    let rules = std::path::Path::new(RULES);
    let (memory, memory_diagnostics, _) =
        replay_rules(rules, MemoryStore::new(), &input, ReplayOptions::default());
    let store = RedisStore::connect(&redis.url(), RedisStoreConfig::default()).unwrap();
    let (from_redis, redis_diagnostics, engine) =
        replay_rules(rules, store, &input, ReplayOptions::default());
    assert!(
        engine.store().stats().early_loads > 0,
        "batches were read ahead"
    );
    let memory_diagnostics = String::from_utf8(memory_diagnostics).unwrap();
    assert!(
        memory_diagnostics.contains("line 3002: bad event (future_ts)"),
        "{memory_diagnostics}"
    );
    assert!(
        memory_diagnostics.contains("bad event (invalid_json)"),
        "and the workload's own bad lines: {memory_diagnostics}"
    );
    // The same lines, the same reasons (the wall clock each was judged against aside).
    let lines = |diagnostics: &str| -> Vec<String> {
        let cut = |line: &str| {
            line.split(" of the wall clock (")
                .next()
                .unwrap()
                .to_owned()
        };
        diagnostics.lines().map(cut).collect()
    };
    assert_eq!(
        lines(&String::from_utf8(redis_diagnostics).unwrap()),
        lines(&memory_diagnostics)
    );
    assert_eq!(
        String::from_utf8(from_redis).unwrap(),
        String::from_utf8(memory).unwrap()
    );
}

/// Replay reads its next batch of lines before judging the one it holds (so that the store can
/// read that batch's windows meanwhile). Input that fails while the next batch is read still
/// gets the decisions of every line before it, then the error.
#[test]
fn an_input_error_while_reading_ahead_comes_after_the_decisions_before_it() {
    use std::io::{BufRead, BufReader, Read};
    /// `data`, then an I/O error.
    struct FailsAfter(std::io::Cursor<Vec<u8>>);
    impl Read for FailsAfter {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            match self.0.read(buf)? {
                0 => Err(std::io::Error::other("the disk went away")),
                n => Ok(n),
            }
        }
    }
    let redis = RedisServer::start();
    let input = workload(3_000);
    // The first 1 500 lines: one whole batch of 1 024 and part of the next.
    let lines: Vec<&[u8]> = input.split_inclusive(|&b| b == b'\n').collect();
    let head = lines[..1_500].concat();
    let first_batch = lines[..1_024].concat();
    let (expected, _) = replay_with(MemoryStore::new(), &first_batch);
    let rules = vigil::rule_files::load(std::path::Path::new(RULES)).unwrap();
    let store = RedisStore::connect(&redis.url(), RedisStoreConfig::default()).unwrap();
    let mut engine = Engine::new(rules, store);
    let mut out = Vec::new();
    let reader: Box<dyn BufRead> = Box::new(BufReader::new(FailsAfter(std::io::Cursor::new(head))));
    let result = replay(
        &mut engine,
        reader,
        &mut out,
        std::io::sink(),
        ReplayOptions::default(),
    );
    let error = result.expect_err("the input failed");
    assert!(error.to_string().contains("the disk went away"), "{error}");
    assert!(expected.len() > 100, "the first batch decides something");
    assert_eq!(
        String::from_utf8(out).unwrap(),
        String::from_utf8(expected).unwrap(),
        "every decision of the first batch, before the error"
    );
}

#[test]
fn a_tiny_read_cache_evicts_and_reloads_without_changing_a_decision() {
    let redis = RedisServer::start();
    let input = workload(30_000);
    let (memory, _) = replay_with(MemoryStore::new(), &input);
    let config = RedisStoreConfig {
        cache_capacity: 64,
        max_pending: 300,
        ..RedisStoreConfig::default()
    };
    let (from_redis, engine) =
        replay_with(RedisStore::connect(&redis.url(), config).unwrap(), &input);
    let stats = engine.store().stats();
    assert_eq!(
        String::from_utf8(from_redis).unwrap(),
        String::from_utf8(memory).unwrap()
    );
    // Far more loads than keys: evicted windows were read back from Redis. Besides the cache and
    // the pending keys, the store holds the windows read for the last batch (1 024 lines) that
    // it did not count into.
    let last_batch = 1024 * engine.rules().counters().len();
    assert!(
        engine.store().live_keys() <= 64 + 300 + 64 + last_batch,
        "{}",
        engine.store().live_keys()
    );
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
    let (head, tail) = (
        lines[..lines.len() / 2].concat(),
        lines[lines.len() / 2..].concat(),
    );
    let mut out = Vec::new();
    let mut engine = Engine::new(rules(), first);
    replay(
        &mut engine,
        head.as_slice(),
        &mut out,
        std::io::sink(),
        ReplayOptions::default(),
    )
    .unwrap();
    // The second half is another input (its line numbers start again at 1).
    let mut engine = Engine::new(rules(), between(engine.into_store()));
    replay(
        &mut engine,
        tail.as_slice(),
        &mut out,
        std::io::sink(),
        ReplayOptions {
            lane: 1,
            ..ReplayOptions::default()
        },
    )
    .unwrap();
    (out, engine.into_store())
}

#[test]
fn script_flush_mid_run_is_recovered_without_losing_deltas() {
    let redis = RedisServer::start();
    let input = workload(20_000);
    let (memory, _) = replay_with(MemoryStore::new(), &input);
    let config = RedisStoreConfig {
        max_pending: 500,
        ..RedisStoreConfig::default()
    };
    let mut admin = redis.connection();
    let (out, store) = replay_in_halves(
        &input,
        RedisStore::connect(&redis.url(), config).unwrap(),
        |store| {
            let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut admin).unwrap();
            store
        },
    );
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
fn count_lines(
    store: RedisStore,
    lines: &[&[u8]],
    range: std::ops::Range<usize>,
    lane: u64,
) -> RedisStore {
    let mut engine = Engine::new(
        vigil::rule_files::load(std::path::Path::new(RULES)).unwrap(),
        store,
    )
    .with_time(
        TimeBounds::OFF,
        std::sync::Arc::new(vigil::clock::SystemClock),
    );
    for i in range {
        let line = lines[i].strip_suffix(b"\n").unwrap_or(lines[i]);
        let event = vigil::event::decode(line, engine.rules().projection()).unwrap();
        engine
            .evaluate(
                &event,
                InputPosition {
                    lane,
                    offset: i as i64,
                },
            )
            .unwrap();
        engine.store_mut().tick().unwrap();
    }
    let mut store = engine.into_store();
    store.flush().unwrap();
    store
}

#[test]
fn input_replayed_after_a_crash_is_judged_but_not_counted_again() {
    // Event time inside every rule's window and in order: the exact totals are well defined.
    let spec = WorkloadSpec {
        events: 20_000,
        users: 2_000,
        ips: 500,
        rate_per_sec: 800,
        late: 0.0,
        out_of_order: 0.0,
        seed: 9,
        ..WorkloadSpec::default()
    };
    let mut all = Vec::new();
    generate(&spec, &mut all).unwrap();
    let lines: Vec<&[u8]> = all.split_inclusive(|&b| b == b'\n').collect();
    let connect = |redis: &RedisServer| {
        RedisStore::connect(&redis.url(), RedisStoreConfig::default()).unwrap()
    };

    let reference = RedisServer::start();
    drop(count_lines(connect(&reference), &lines, 0..20_000, 3));

    // The first process counted and flushed up to line 15 000 but its input position was only
    // committed up to 10 000 when it died; its successor reads 10 000.. again.
    let crashed = RedisServer::start();
    drop(count_lines(connect(&crashed), &lines, 0..15_000, 3));
    let successor = count_lines(connect(&crashed), &lines, 10_000..20_000, 3);
    assert!(
        successor.stats().skipped_applied >= 5_000,
        "{:?}",
        successor.stats()
    );
    assert_eq!(
        redis_totals(&mut crashed.connection()),
        redis_totals(&mut reference.connection())
    );

    // Control: tagged as two different inputs, the same crash counts lines 10 000..15 000 twice.
    let untagged = RedisServer::start();
    drop(count_lines(connect(&untagged), &lines, 0..15_000, 3));
    drop(count_lines(connect(&untagged), &lines, 10_000..20_000, 4));
    assert_ne!(
        redis_totals(&mut untagged.connection()),
        redis_totals(&mut reference.connection())
    );
}

#[test]
fn two_processes_into_one_redis_end_with_exact_totals() {
    // Event time spans 50 s, inside every rule's window: nothing can be late in any interleaving,
    // so the final counters must equal one process replaying everything.
    let spec = WorkloadSpec {
        events: 40_000,
        users: 3_000,
        ips: 1_000,
        rate_per_sec: 800,
        late: 0.0,
        out_of_order: 0.0,
        seed: 5,
        ..WorkloadSpec::default()
    };
    let mut all = Vec::new();
    generate(&spec, &mut all).unwrap();
    let lines: Vec<&[u8]> = all.split_inclusive(|&b| b == b'\n').collect();
    let dir = tempfile::tempdir().unwrap();
    let (odd, even) = (dir.path().join("odd.jsonl"), dir.path().join("even.jsonl"));
    std::fs::write(
        &odd,
        lines
            .iter()
            .step_by(2)
            .copied()
            .collect::<Vec<_>>()
            .concat(),
    )
    .unwrap();
    std::fs::write(
        &even,
        lines
            .iter()
            .skip(1)
            .step_by(2)
            .copied()
            .collect::<Vec<_>>()
            .concat(),
    )
    .unwrap();

    let shared = RedisServer::start();
    let spawn = |input: &std::path::Path| {
        Command::new(env!("CARGO_BIN_EXE_vigil"))
            .args([
                "replay",
                "--rules",
                RULES,
                "--input",
                input.to_str().unwrap(),
                "--redis",
                &shared.url(),
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn(&odd), spawn(&even));
    for child in [a, b] {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
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
    let config = RedisStoreConfig {
        max_pending: usize::MAX,
        flush_interval: std::time::Duration::MAX,
        ..RedisStoreConfig::default()
    };
    let mut store = RedisStore::connect(&redis.url(), config).unwrap();
    let spec = vigil::window::WindowSpec::new(1_000, 60, vigil::window::Aggregate::Count);
    let window = store.open_window("restart", spec);
    for i in 0..5_000u64 {
        store
            .apply(
                window,
                &(i % 500).to_le_bytes(),
                1_000_000 + i as i64,
                vigil::window::Delta::Count,
            )
            .unwrap();
    }
    // Everything is pending (no flush yet); Redis goes away and comes back empty.
    redis.restart();
    store.flush().unwrap();
    assert!(store.stats().retries >= 1, "{:?}", store.stats());
    let totals = redis_totals(&mut redis.connection());
    assert_eq!(totals.len(), 500);
    assert_eq!(
        totals.values().map(|(total, _)| *total).sum::<i128>(),
        5_000
    );
}

#[test]
fn redis_cluster_spreads_keys_and_survives_a_slot_migration() {
    let cluster = support::RedisCluster::start();
    let input = workload(20_000);
    let (memory, _) = replay_with(MemoryStore::new(), &input);
    let connect = || {
        RedisStore::connect(
            &cluster.url(),
            RedisStoreConfig {
                max_pending: 500,
                ..RedisStoreConfig::default()
            },
        )
        .unwrap()
    };
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
        cluster
            .nodes
            .iter()
            .position(|n| {
                let exists: i64 = redis::cmd("EXISTS")
                    .arg(key)
                    .query(&mut n.connection())
                    .unwrap_or(0);
                exists == 1
            })
            .expect("the hot key exists on some master")
    };
    let mut before = usize::MAX;
    let (out, store) = replay_in_halves(&input, connect(), |store| {
        before = owner(&hot_key);
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(&hot_key)
            .query(&mut cluster.nodes[0].connection())
            .unwrap();
        cluster.migrate_slot(slot);
        store
    });
    assert_ne!(
        owner(&hot_key),
        before,
        "the hot key's slot moved to another master"
    );
    assert_eq!(decisions(&out), decisions(&memory));
    let sizes: Vec<i64> = cluster
        .nodes
        .iter()
        .map(|n| redis::cmd("DBSIZE").query(&mut n.connection()).unwrap())
        .collect();
    assert!(
        sizes.iter().all(|&n| n > 100),
        "keys spread over every master: {sizes:?}"
    );
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
        records: records
            .iter()
            .map(|(o, r)| (*o, r.as_bytes().to_vec()))
            .collect(),
    };
    first
        .write(3, &batch(11, &[(10, "r10"), (11, "r11")]))
        .unwrap();
    // The lane moves to a second worker: it sees what the first recorded...
    let journal = second.claim(3).unwrap();
    assert_eq!(journal.produced(10), Some(Some(&b"r10"[..])));
    assert_eq!(journal.produced(9), Some(None));
    assert_eq!(journal.produced(12), None);
    assert_eq!(journal.newest_before(12), Some(1_700_000_000_011));
    // ...and the first, still running, can no longer write.
    assert!(matches!(
        first.write(3, &batch(12, &[(12, "stale")])),
        Err(JournalError::Fenced)
    ));
    second.write(3, &batch(12, &[(12, "r12")])).unwrap();
    // Committed past 11: the records before it go with the next write.
    second.trim(3, 12);
    second.write(3, &batch(13, &[])).unwrap();
    let journal = JournalWriter::connect(&redis.url(), &config, "group")
        .unwrap()
        .claim(3)
        .unwrap();
    assert_eq!(
        journal
            .records
            .keys()
            .copied()
            .collect::<std::collections::BTreeSet<_>>(),
        [12].into()
    );
    assert_eq!(journal.covered, Some(13));
    // Another consumer group's lane 3 is another journal.
    assert_eq!(
        JournalWriter::connect(&redis.url(), &config, "other")
            .unwrap()
            .claim(3)
            .unwrap()
            .covered,
        None
    );
}

/// A claim lost with Redis' data (a restart without persistence, a failover to a replica that
/// never got it) does not stop the lane's owner: its next write sets the claim again. Claims
/// are ranked, so the later owner still fences the earlier one.
#[test]
fn a_journal_claim_lost_with_redis_data_is_set_again_by_the_latest_owner() {
    use vigil::store::journal::JournalBatch;
    use vigil::store::{JournalError, JournalWriter};
    let redis = RedisServer::start();
    let config = RedisStoreConfig::default();
    let mut earlier = JournalWriter::connect(&redis.url(), &config, "group").unwrap();
    let mut later = JournalWriter::connect(&redis.url(), &config, "group").unwrap();
    let batch = |covered: i64| JournalBatch {
        covered: Some(covered),
        mark: None,
        records: vec![(covered, format!("r{covered}").into_bytes())],
    };
    earlier.claim(5).unwrap();
    later.claim(5).unwrap();
    let mut conn = redis.connection();
    let owner = |conn: &mut redis::Connection| -> Option<String> {
        let keys: Vec<String> = redis::cmd("KEYS").arg("vg:j:*").query(conn).unwrap();
        keys.first().and_then(|key| {
            redis::cmd("HGET")
                .arg(key)
                .arg("owner")
                .query(conn)
                .unwrap()
        })
    };
    let latest = owner(&mut conn).expect("claimed");

    // Redis restarted empty: whoever writes first sets its claim again...
    redis::cmd("FLUSHALL").exec(&mut conn).unwrap();
    earlier.write(5, &batch(1)).unwrap();
    let stale = owner(&mut conn).expect("set again");
    assert_ne!(stale, latest);
    // ...but the later owner's claim ranks above it, and once it has written, the earlier
    // owner is fenced again.
    later.write(5, &batch(2)).unwrap();
    assert_eq!(owner(&mut conn), Some(latest.clone()));
    assert!(matches!(
        earlier.write(5, &batch(3)),
        Err(JournalError::Fenced)
    ));

    // A failover to a replica that got only the earlier claim.
    let keys: Vec<String> = redis::cmd("KEYS").arg("vg:j:*").query(&mut conn).unwrap();
    redis::cmd("HSET")
        .arg(&keys[0])
        .arg("owner")
        .arg(&stale)
        .exec(&mut conn)
        .unwrap();
    later.write(5, &batch(4)).unwrap();
    assert_eq!(owner(&mut conn), Some(latest.clone()));
    assert!(matches!(
        earlier.write(5, &batch(5)),
        Err(JournalError::Fenced)
    ));

    // A claim made after the data was lost ranks above those made before it (Redis' clock
    // past the later claim's generation, at most a millisecond on).
    let generation: u64 = latest.split(' ').next().unwrap().parse().unwrap();
    while {
        let (seconds, micros): (u64, u64) = redis::cmd("TIME").query(&mut conn).unwrap();
        seconds * 1000 + micros / 1000 <= generation
    } {}
    redis::cmd("FLUSHALL").exec(&mut conn).unwrap();
    let mut newest = JournalWriter::connect(&redis.url(), &config, "group").unwrap();
    newest.claim(5).unwrap();
    assert!(matches!(
        later.write(5, &batch(6)),
        Err(JournalError::Fenced)
    ));
    newest.write(5, &batch(6)).unwrap();

    // An owner written by an earlier release (a bare token, no generation) is never taken over.
    redis::cmd("HSET")
        .arg(&keys[0])
        .arg("owner")
        .arg("0a1b2c")
        .exec(&mut conn)
        .unwrap();
    assert!(matches!(
        newest.write(5, &batch(7)),
        Err(JournalError::Fenced)
    ));
}

/// Partitions hand their journal writes over and wait without the writer: writes of several
/// lanes out at once go in one round trip, each gets its own answer (one lane fenced among
/// them), and each lands.
#[test]
fn journal_writes_of_several_lanes_out_at_once_each_get_their_own_answer() {
    use vigil::store::journal::JournalBatch;
    use vigil::store::{JournalError, JournalWriter};
    let redis = RedisServer::start();
    let config = RedisStoreConfig::default();
    let mut writer = JournalWriter::connect(&redis.url(), &config, "group").unwrap();
    let mut other = JournalWriter::connect(&redis.url(), &config, "group").unwrap();
    for lane in 0..4 {
        writer.claim(lane).unwrap();
    }
    // Lane 2 moved to another worker meanwhile.
    other.claim(2).unwrap();
    let batch = |lane: u64| JournalBatch {
        covered: Some(100 + lane as i64),
        mark: None,
        records: vec![(
            100 + lane as i64,
            format!("record of lane {lane}").into_bytes(),
        )],
    };
    let writes: Vec<_> = (0..4)
        .map(|lane| writer.begin_write(lane, &batch(lane)).unwrap())
        .collect();
    let answered: Vec<_> = std::thread::scope(|scope| {
        let waits: Vec<_> = writes
            .into_iter()
            .map(|write| {
                scope.spawn(move || {
                    let reply = write.wait();
                    (write, reply)
                })
            })
            .collect();
        waits.into_iter().map(|w| w.join().unwrap()).collect()
    });
    for (lane, (write, reply)) in answered.into_iter().enumerate() {
        let result = writer.finish_write(write, reply);
        if lane == 2 {
            assert!(matches!(result, Err(JournalError::Fenced)), "{result:?}");
        } else {
            result.unwrap();
        }
    }
    let mut reader = JournalWriter::connect(&redis.url(), &config, "group").unwrap();
    for lane in 0..4u64 {
        let journal = reader.claim(lane).unwrap();
        let offset = 100 + lane as i64;
        let expected = format!("record of lane {lane}").into_bytes();
        let expected = (lane != 2).then_some(Some(expected.as_slice()));
        assert_eq!(journal.produced(offset), expected, "lane {lane}");
    }
}

/// While Redis does not answer, the journal costs the partitions one wait (the call that found
/// the outage), then fails at once while probes nobody waits for look for Redis; a lane assigned
/// meanwhile goes unjournaled (never "fenced": its batches still go out) until it is claimed.
#[test]
fn a_journal_outage_costs_one_wait_and_a_lane_assigned_during_it_still_runs() {
    use std::time::{Duration, Instant};
    use vigil::store::journal::JournalBatch;
    use vigil::store::{JournalError, JournalWriter};
    let redis = RedisServer::start();
    let config = RedisStoreConfig {
        connect_timeout: Duration::from_millis(100),
        response_timeout: Duration::from_millis(200),
        probe_interval: Duration::from_millis(20),
        ..RedisStoreConfig::default()
    };
    let deadline = (config.connect_timeout + config.response_timeout) * 2;
    let mut journal = JournalWriter::connect(&redis.url(), &config, "group").unwrap();
    journal.claim(1).unwrap();
    let batch = |covered: i64| JournalBatch {
        covered: Some(covered),
        mark: None,
        records: vec![(covered, b"r".to_vec())],
    };
    journal.write(1, &batch(1)).unwrap();
    redis.pause();
    assert!(matches!(
        journal.write(1, &batch(2)),
        Err(JournalError::Store(_))
    ));
    // Forty more batches (probes going out meanwhile) take less than one more wait in all.
    let started = Instant::now();
    for covered in 3..43 {
        assert!(matches!(
            journal.write(1, &batch(covered)),
            Err(JournalError::Store(_))
        ));
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(
        started.elapsed() < deadline,
        "{:?} for forty calls",
        started.elapsed()
    );
    // A lane assigned now is not claimed; its batches are not fenced.
    assert!(journal.claim(2).is_err());
    assert!(matches!(
        journal.write(2, &batch(1)),
        Err(JournalError::Store(_))
    ));
    redis.resume();
    let back = Instant::now();
    let mut covered = 43;
    while journal.write(1, &batch(covered)).is_err() {
        assert!(
            back.elapsed() < Duration::from_secs(10),
            "the journal never came back"
        );
        std::thread::sleep(Duration::from_millis(10));
        covered += 1;
    }
    assert!(matches!(
        journal.write(2, &batch(2)),
        Err(JournalError::Store(_))
    ));
    journal.claim(2).unwrap();
    journal.write(2, &batch(3)).unwrap();
    let other = JournalWriter::connect(&redis.url(), &config, "group")
        .unwrap()
        .claim(1)
        .unwrap();
    assert_eq!(other.covered, Some(covered));
}

/// Reads go 256 keys per round trip, and a Redis that stops answering costs a reader one response
/// timeout per attempt whatever their number: the replies are read one by one and the attempt
/// ends at the first that does not come (read as a whole pipeline, each reply would wait its own
/// timeout: 256 reads, 256 timeouts, while the reader can read nothing else).
#[test]
fn a_silent_redis_costs_a_large_read_one_timeout_per_attempt() {
    use std::time::Duration;
    use vigil::window::{Aggregate, Applied, Delta, WindowSpec};
    let redis = RedisServer::start();
    let config = RedisStoreConfig {
        attempts: 2,
        connect_timeout: Duration::from_millis(200),
        response_timeout: Duration::from_millis(500),
        retry_backoff: Duration::from_millis(10),
        ..RedisStoreConfig::default()
    };
    let spec = WindowSpec::new(60_000, 60, Aggregate::Count);
    let at = 1_700_000_000_000;
    let keys = |window| -> Vec<_> {
        (0..1_000u32)
            .map(|key| (window, key.to_be_bytes().to_vec()))
            .collect()
    };
    // A thousand keys counted and flushed, then read by another process in one prefetch.
    let mut store = RedisStore::connect(&redis.url(), config.clone()).unwrap();
    let window = store.open_window("silent", spec);
    store.prefetch(&keys(window)).unwrap();
    for (_, key) in keys(window) {
        store.apply(window, &key, at, Delta::Count).unwrap();
    }
    store.flush().unwrap();
    let mut other = RedisStore::connect(&redis.url(), config.clone()).unwrap();
    let window = other.open_window("silent", spec);
    other.prefetch(&keys(window)).unwrap();
    assert_eq!((other.stats().loads, other.stats().retries), (1_000, 0));
    assert_eq!(
        other
            .read(window, &999u32.to_be_bytes(), at)
            .unwrap()
            .applied,
        Applied::Counted(1)
    );
    assert_eq!(other.stats().loads, 1_000, "read by the prefetch");

    // A reader sends a thousand reads to a Redis that stopped answering: its own error comes
    // back within the wait for it (2 × 700 ms), not the wait's end: the first attempt waits one
    // reply (500 ms), the second a connection, whose setup waits up to the connect timeout for
    // each of its two replies (2 × 200 ms). Read as whole pipelines, the first 16 of the 1 000
    // replies alone would take 8 s.
    let mut late = RedisStore::connect(&redis.url(), config.clone()).unwrap();
    let window = late.open_window("silent", spec);
    let reader = late.early_reader().expect("Redis answers");
    let mut reads = late.plan_early_reads(&keys(window)).unwrap();
    assert_eq!(reads.len(), 1_000);
    redis.pause();
    let failed = reader.read(&mut reads).unwrap_err().to_string();
    redis.resume();
    assert!(
        !failed.contains("no early read reply"),
        "the reader was still waiting: {failed}"
    );
    // And it reads again as soon as Redis answers.
    let mut again = late.plan_early_reads(&keys(window)).unwrap();
    let replies = reader.read(&mut again);
    let replies = again.decode(replies);
    assert_eq!(late.take_early_reads(again, replies), 1_000);
    assert_eq!(
        late.read(window, &0u32.to_be_bytes(), at).unwrap().applied,
        Applied::Counted(1)
    );
}

/// A hold set by one process is seen by another through Redis within one flush interval, and
/// by a process started later (a hold survives a restart); its key holds no event bytes.
#[test]
fn holds_are_shared_through_redis_and_survive_a_restart() {
    let redis = RedisServer::start();
    let config = RedisStoreConfig {
        flush_interval: std::time::Duration::from_millis(20),
        ..RedisStoreConfig::default()
    };
    // Time passes on the stores' freshness clock, advanced here rather than slept.
    let clock = std::sync::Arc::new(ManualMonotonic::new());
    let mut a =
        RedisStore::connect_with_clock(&redis.url(), config.clone(), std::sync::Arc::clone(&clock))
            .unwrap();
    let mut b =
        RedisStore::connect_with_clock(&redis.url(), config.clone(), std::sync::Arc::clone(&clock))
            .unwrap();
    let space_a = a.open_holds("brute-force", 3_600_000);
    let space_b = b.open_holds("brute-force", 3_600_000);
    let key = b"s\x05{evil}\x00user";
    assert_eq!(b.held_until(space_b, key).unwrap(), None);
    assert_eq!(
        a.extend_hold(space_a, key, 1_700_000_600_000).unwrap(),
        1_700_000_600_000
    );
    assert_eq!(
        a.extend_hold(space_a, key, 1_700_000_100_000).unwrap(),
        1_700_000_600_000,
        "never shortened"
    );
    assert_eq!(
        a.held_until(space_a, key).unwrap(),
        Some(1_700_000_600_000),
        "the setter sees it at once"
    );
    // Written behind: the next flush carries it; b's view of the key is older than a flush
    // interval by then, so b reads it again.
    clock.advance(config.flush_interval * 2);
    a.tick().unwrap();
    a.flush().unwrap();
    assert_eq!(b.held_until(space_b, key).unwrap(), Some(1_700_000_600_000));
    // b extends it; a learns the later time on its next read.
    assert_eq!(
        b.extend_hold(space_b, key, 1_700_000_900_000).unwrap(),
        1_700_000_900_000
    );
    b.flush().unwrap();
    clock.advance(config.flush_interval * 2);
    assert_eq!(a.held_until(space_a, key).unwrap(), Some(1_700_000_900_000));
    drop(a);
    drop(b);
    let mut c = RedisStore::connect(&redis.url(), config).unwrap();
    let space_c = c.open_holds("brute-force", 3_600_000);
    assert_eq!(
        c.held_until(space_c, key).unwrap(),
        Some(1_700_000_900_000),
        "a new process sees the hold"
    );
    let name = c.redis_hold_key(space_c, key);
    assert!(
        name.starts_with("vg:h:brute-force:") && name.len() == "vg:h:brute-force:".len() + 32,
        "{name}"
    );
    let mut conn = redis.connection();
    let keys: Vec<String> = redis::cmd("KEYS").arg("vg:h:*").query(&mut conn).unwrap();
    assert_eq!(keys, std::slice::from_ref(&name));
    let ttl: i64 = redis::cmd("PTTL").arg(&name).query(&mut conn).unwrap();
    assert!(ttl > 3_000_000, "TTL at least the hold: {ttl}");
}

/// Two stores on `redis` with the same holds open ("ato", an hour): another worker's and this
/// one's, on the injected `clock`.
fn two_holders(
    redis: &RedisServer,
    config: &RedisStoreConfig,
    clock: &std::sync::Arc<ManualMonotonic>,
) -> (
    RedisStore<std::sync::Arc<ManualMonotonic>>,
    RedisStore<std::sync::Arc<ManualMonotonic>>,
    vigil::store::HoldSpace,
    vigil::store::HoldSpace,
) {
    let connect = || {
        RedisStore::connect_with_clock(&redis.url(), config.clone(), std::sync::Arc::clone(clock))
            .unwrap()
    };
    let (mut other, mut store) = (connect(), connect());
    let (theirs, space) = (
        other.open_holds("ato", 3_600_000),
        store.open_holds("ato", 3_600_000),
    );
    (other, store, theirs, space)
}

/// Replay reads the next batch's holds while it judges this one. A read is taken in only for a
/// view that learned nothing from Redis since it was sent, so it never takes a hold back to an
/// older state: a raise acknowledged meanwhile stays, a release meanwhile stays released.
#[test]
fn holds_read_ahead_never_take_a_hold_back_to_an_older_state() {
    use vigil::store::HoldSpace;
    use vigil::window::{Aggregate, WindowSpec};
    let redis = RedisServer::start();
    let config = RedisStoreConfig::default();
    let clock = std::sync::Arc::new(ManualMonotonic::new());
    let (mut other, mut store, theirs, space) = two_holders(&redis, &config, &clock);
    let window = store.open_window("w", WindowSpec::new(1_000, 60, Aggregate::Count));
    let keys = |names: &[&[u8]]| -> Vec<(HoldSpace, Vec<u8>)> {
        names.iter().map(|n| (space, n.to_vec())).collect()
    };
    // The hold reads' reader answers in order: once a read sent after the hold reads is back,
    // they have run in Redis and their replies wait to be taken in (nothing waits for them).
    let settle = |store: &mut RedisStore<_>, name: &[u8]| {
        let mut reads = store
            .plan_early_reads(&[(window, name.to_vec())])
            .expect("an unread window");
        store.early_hold_reader().unwrap().read(&mut reads).unwrap();
    };
    let until = 1_700_000_600_000;

    // Another worker holds `theirs-1` and `theirs-2`; read ahead, both are taken in.
    other.extend_hold(theirs, b"theirs-1", until).unwrap();
    other.extend_hold(theirs, b"theirs-2", until).unwrap();
    other.flush().unwrap();
    store.read_holds_ahead(&keys(&[b"theirs-1", b"theirs-2", b"free"]));
    settle(&mut store, b"z");
    store
        .prefetch_holds(&keys(&[b"theirs-1", b"theirs-2", b"free"]))
        .unwrap();
    assert_eq!(store.stats().early_hold_loads, 3);
    assert_eq!(store.held_until(space, b"theirs-1").unwrap(), Some(until));
    assert_eq!(store.held_until(space, b"free").unwrap(), None);

    // This store raises `mine` (its view read first), a flush interval passes, the next
    // batch's reads go out and find nothing in Redis yet; then the raise is flushed and
    // acknowledged. The read is older than the acknowledgement: not taken in.
    store.extend_hold(space, b"mine", until).unwrap();
    clock.advance(config.flush_interval * 2);
    store.read_holds_ahead(&keys(&[b"mine", b"theirs-2"]));
    settle(&mut store, b"a");
    store.flush().unwrap();
    store
        .prefetch_holds(&keys(&[b"mine", b"theirs-2"]))
        .unwrap();
    assert_eq!(store.held_until(space, b"mine").unwrap(), Some(until));
    assert_eq!(store.stats().early_hold_loads, 4, "`theirs-2` is taken in");

    // Support releases `theirs-1` and `theirs-3` (a key this store never read) after the next
    // batch's reads went out (they saw both held).
    other.extend_hold(theirs, b"theirs-3", until).unwrap();
    other.flush().unwrap();
    clock.advance(config.flush_interval * 2);
    store.read_holds_ahead(&keys(&[b"theirs-1", b"theirs-3"]));
    settle(&mut store, b"b");
    assert_eq!(store.release_hold(space, b"theirs-1").unwrap(), Some(until));
    assert_eq!(store.release_hold(space, b"theirs-3").unwrap(), Some(until));
    store
        .prefetch_holds(&keys(&[b"theirs-1", b"theirs-3"]))
        .unwrap();
    assert_eq!(store.held_until(space, b"theirs-1").unwrap(), None);
    assert_eq!(store.held_until(space, b"theirs-3").unwrap(), None);
    assert_eq!(store.stats().early_hold_loads, 4);

    // A read whose batch starts over a flush interval later is taken in but read again.
    other.extend_hold(theirs, b"late", until).unwrap();
    store.read_holds_ahead(&keys(&[b"late"]));
    settle(&mut store, b"c");
    other.flush().unwrap();
    clock.advance(config.flush_interval * 2);
    store.prefetch_holds(&keys(&[b"late"])).unwrap();
    assert_eq!(store.held_until(space, b"late").unwrap(), Some(until));
}

/// A reader that has just handed back a reply is idle for whoever received it: the next batch's
/// hold reads, sent right after, go out rather than being skipped as if a read were still out
/// (they were, now and then, when the reader counted its answer after delivering it).
#[test]
fn hold_reads_sent_right_after_an_early_read_came_back_always_go_out() {
    use vigil::window::{Aggregate, WindowSpec};
    let redis = RedisServer::start();
    let config = RedisStoreConfig::default();
    let clock = std::sync::Arc::new(ManualMonotonic::new());
    let (mut other, mut store, theirs, space) = two_holders(&redis, &config, &clock);
    let window = store.open_window("w", WindowSpec::new(1_000, 60, Aggregate::Count));
    let until = 1_700_000_600_000;
    let rounds: u64 = 200;
    for round in 0..rounds {
        let name = format!("held-{round}").into_bytes();
        other.extend_hold(theirs, &name, until).unwrap();
    }
    other.flush().unwrap();
    for round in 0..rounds {
        let mut reads = store
            .plan_early_reads(&[(window, format!("w-{round}").into_bytes())])
            .expect("an unread window");
        store.early_hold_reader().unwrap().read(&mut reads).unwrap();
        let held = vec![(space, format!("held-{round}").into_bytes())];
        store.read_holds_ahead(&held);
        let mut reads = store
            .plan_early_reads(&[(window, format!("x-{round}").into_bytes())])
            .expect("an unread window");
        store.early_hold_reader().unwrap().read(&mut reads).unwrap();
        store.prefetch_holds(&held).unwrap();
        assert_eq!(
            store.stats().early_hold_loads,
            round + 1,
            "round {round}: the hold read went out and was taken in"
        );
    }
}

/// A worker's partition loop reads its batch's holds with the engine free: planned under it,
/// read on the hold reader's connection, taken in before the batch is judged, and not read again
/// by its prefetch. A read older than what the view learned since is not taken in.
#[test]
fn holds_read_before_a_batch_takes_the_engine_are_taken_in_unless_the_view_learned_since() {
    use vigil::store::{HoldSpace, PendingRead};
    let redis = RedisServer::start();
    let config = RedisStoreConfig::default();
    let clock = std::sync::Arc::new(ManualMonotonic::new());
    let (mut other, mut store, theirs, space) = two_holders(&redis, &config, &clock);
    let keys = |names: &[&[u8]]| -> Vec<(HoldSpace, Vec<u8>)> {
        names.iter().map(|n| (space, n.to_vec())).collect()
    };
    let until = 1_700_000_600_000;
    other.extend_hold(theirs, b"theirs", until).unwrap();
    other.flush().unwrap();

    let (mut reads, reader) = store
        .plan_early_hold_reads(&keys(&[b"theirs", b"free", b"mine"]))
        .expect("holds never read");
    let replies = reader.start_holds(&mut reads).and_then(PendingRead::wait);
    assert!(replies.is_ok(), "{replies:?}");
    // Meanwhile another worker holds `free` (after the read ran), and this store raises `mine`
    // and its flush comes back.
    other.extend_hold(theirs, b"free", until).unwrap();
    other.flush().unwrap();
    store.extend_hold(space, b"mine", until + 1).unwrap();
    store.flush().unwrap();
    store.take_early_hold_reads(reads, replies);
    assert_eq!(
        store.stats().early_hold_loads,
        2,
        "`mine` learned more since: its read stays out"
    );
    store
        .prefetch_holds(&keys(&[b"theirs", b"free", b"mine"]))
        .unwrap();
    assert_eq!(store.held_until(space, b"theirs").unwrap(), Some(until));
    assert_eq!(
        store.held_until(space, b"free").unwrap(),
        None,
        "read for this batch: not read again within a flush interval"
    );
    assert_eq!(store.held_until(space, b"mine").unwrap(), Some(until + 1));
    assert!(
        store
            .plan_early_hold_reads(&keys(&[b"theirs", b"free"]))
            .is_none(),
        "nothing to read while the views are fresh"
    );

    // A flush interval later, the next batch reads again what went stale.
    clock.advance(config.flush_interval * 2);
    let (mut reads, reader) = store
        .plan_early_hold_reads(&keys(&[b"free"]))
        .expect("a stale view");
    let replies = reader.start_holds(&mut reads).and_then(PendingRead::wait);
    store.take_early_hold_reads(reads, replies);
    assert_eq!(store.stats().early_hold_loads, 3);
    assert_eq!(store.held_until(space, b"free").unwrap(), Some(until));
}

/// A batch reads its holds once, before it is judged, as it reads its windows: a view fresh
/// then stays so for the whole batch (a batch that runs longer than a flush interval does not
/// pay a round trip per event), and the next batch reads again what went stale.
#[test]
fn holds_read_for_a_batch_stay_as_they_were_for_the_whole_batch() {
    let redis = RedisServer::start();
    let config = RedisStoreConfig {
        flush_interval: std::time::Duration::from_millis(20),
        ..RedisStoreConfig::default()
    };
    let clock = std::sync::Arc::new(ManualMonotonic::new());
    let connect = || {
        RedisStore::connect_with_clock(&redis.url(), config.clone(), std::sync::Arc::clone(&clock))
            .unwrap()
    };
    let (mut setter, mut judge) = (connect(), connect());
    let (space_setter, space_judge) = (
        setter.open_holds("ato", 3_600_000),
        judge.open_holds("ato", 3_600_000),
    );
    let key = b"u-17";
    let batch = vec![(space_judge, key.to_vec())];
    judge.begin_batch(0, 0);
    judge.prefetch_holds(&batch).unwrap();
    assert_eq!(judge.held_until(space_judge, key).unwrap(), None);
    // Another worker holds the key meanwhile; the batch runs on past a flush interval.
    setter
        .extend_hold(space_setter, key, 1_700_000_600_000)
        .unwrap();
    setter.flush().unwrap();
    clock.advance(config.flush_interval * 3);
    assert_eq!(
        judge.held_until(space_judge, key).unwrap(),
        None,
        "as read for the batch"
    );
    judge.seal_batch().journaled();
    // The next batch reads it again.
    judge.begin_batch(0, 0);
    judge.prefetch_holds(&batch).unwrap();
    assert_eq!(
        judge.held_until(space_judge, key).unwrap(),
        Some(1_700_000_600_000)
    );
    judge.seal_batch().journaled();
    // Outside a batch, a view older than a flush interval is read again at once.
    setter
        .extend_hold(space_setter, key, 1_700_000_900_000)
        .unwrap();
    setter.flush().unwrap();
    clock.advance(config.flush_interval * 3);
    assert_eq!(
        judge.held_until(space_judge, key).unwrap(),
        Some(1_700_000_900_000)
    );
}
#[test]
fn a_discarded_batch_leaves_no_count_and_no_hold_in_redis() {
    use vigil::window::{Aggregate, Applied, Delta, WindowSpec};
    let redis = RedisServer::start();
    let config = RedisStoreConfig {
        max_pending: usize::MAX,
        flush_interval: std::time::Duration::MAX,
        ..RedisStoreConfig::default()
    };
    let mut store = RedisStore::connect(&redis.url(), config.clone()).unwrap();
    let spec = WindowSpec::new(1_000, 60, Aggregate::Count);
    let window = store.open_window("fenced", spec);
    let holds = store.open_holds("fenced-hold", 3_600_000);
    let at = 1_000_000;
    let count = |store: &mut RedisStore, key: &[u8], lane: u64, offset: i64| {
        store.set_origin(Some(InputPosition { lane, offset }));
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
    store.begin_batch(1, 2);
    for (offset, key) in [(2, b"a"), (3, b"b"), (4, b"c"), (5, b"a")] {
        count(&mut store, key, 1, offset);
    }
    store.extend_hold(holds, b"h", at + 9_000).unwrap();
    store.extend_hold(holds, b"new", at + 9_000).unwrap();
    assert_eq!(
        store.read(window, b"a", at).unwrap().applied,
        Applied::Counted(4)
    );
    // Its journal write was fenced: the batch is taken back.
    store.discard_batch(1, 2).unwrap();

    // This process and Redis agree on exactly what was counted outside the batch.
    for (key, expected) in [(&b"a"[..], 2), (b"b", 1), (b"c", 0)] {
        assert_eq!(
            store.read(window, key, at).unwrap().applied,
            Applied::Counted(expected),
            "{key:?}"
        );
    }
    assert_eq!(store.held_until(holds, b"h").unwrap(), Some(at + 1_000));
    assert_eq!(store.held_until(holds, b"new").unwrap(), None);
    drop(store);
    let mut fresh = RedisStore::connect(&redis.url(), config).unwrap();
    let window = fresh.open_window("fenced", spec);
    let holds = fresh.open_holds("fenced-hold", 3_600_000);
    for (key, expected) in [(&b"a"[..], 2), (b"b", 1), (b"c", 0)] {
        assert_eq!(
            fresh.read(window, key, at).unwrap().applied,
            Applied::Counted(expected),
            "{key:?}"
        );
    }
    assert_eq!(fresh.held_until(holds, b"h").unwrap(), Some(at + 1_000));
    assert_eq!(fresh.held_until(holds, b"new").unwrap(), None);
    // The next owner counts the batch's events itself: once each.
    fresh.begin_batch(1, 2);
    for (offset, key) in [(2, b"a"), (3, b"b"), (4, b"c"), (5, b"a")] {
        fresh.set_origin(Some(InputPosition { lane: 1, offset }));
        fresh.apply(window, key, at, Delta::Count).unwrap();
    }
    fresh.seal_batch().journaled();
    fresh.flush().unwrap();
    let totals = redis_totals(&mut redis.connection());
    assert_eq!(totals.values().map(|(total, _)| *total).sum::<i128>(), 7);
}

/// A worker journals a batch's records without the engine: other partitions count and flush
/// meanwhile. Those flushes send everything but what that batch counted (on the same keys too)
/// and its hold raises; once it is journaled they go, and if it is fenced instead, nothing of
/// it ever reaches Redis, while what other batches raised on the same hold stays.
#[test]
fn flushes_while_a_batch_is_journaled_hold_back_exactly_that_batch() {
    use vigil::window::{Aggregate, Applied, Delta, WindowSpec};
    let redis = RedisServer::start();
    let config = RedisStoreConfig {
        max_pending: usize::MAX,
        flush_interval: std::time::Duration::MAX,
        ..RedisStoreConfig::default()
    };
    let spec = WindowSpec::new(1_000, 60, Aggregate::Count);
    let at = 1_000_000;
    for fenced in [false, true] {
        let name = if fenced { "fenced" } else { "journaled" };
        let mut store = RedisStore::connect(&redis.url(), config.clone()).unwrap();
        let window = store.open_window(name, spec);
        let holds = store.open_holds(name, 3_600_000);
        let count = |store: &mut RedisStore, key: &[u8], lane: u64, offset: i64| {
            store.set_origin(Some(InputPosition { lane, offset }));
            store.apply(window, key, at, Delta::Count).unwrap();
        };
        // Lane 2 counted a before either batch.
        count(&mut store, b"a", 2, 7);
        // Lane 1's batch from offset 2 is counted and sealed; its journal write is under way.
        store.begin_batch(1, 2);
        count(&mut store, b"a", 1, 2);
        count(&mut store, b"b", 1, 3);
        store.extend_hold(holds, b"h", at + 5_000).unwrap();
        store.extend_hold(holds, b"k", at + 5_000).unwrap();
        let first = store.seal_batch();
        // Lane 2's next batch is counted, sealed and journaled meanwhile.
        store.begin_batch(2, 8);
        count(&mut store, b"a", 2, 8);
        store.extend_hold(holds, b"h", at + 9_000).unwrap();
        store.extend_hold(holds, b"g", at + 9_000).unwrap();
        store.seal_batch().journaled();
        store.tick().unwrap();
        store.flush().unwrap();
        assert!(
            store.durable_mark() < store.counted_mark(),
            "{name}: the first batch is not in Redis"
        );
        // Redis has everything but the first batch; this process sees it all.
        let mut other = RedisStore::connect(&redis.url(), config.clone()).unwrap();
        let other_window = other.open_window(name, spec);
        let other_holds = other.open_holds(name, 3_600_000);
        for (key, in_redis, here) in [(&b"a"[..], 2, 3), (b"b", 0, 1)] {
            assert_eq!(
                other.read(other_window, key, at).unwrap().applied,
                Applied::Counted(in_redis),
                "{name}: {key:?} in Redis"
            );
            assert_eq!(
                store.read(window, key, at).unwrap().applied,
                Applied::Counted(here),
                "{name}: {key:?} here"
            );
        }
        for (key, in_redis) in [
            (&b"h"[..], Some(at + 9_000)),
            (b"g", Some(at + 9_000)),
            (b"k", None),
        ] {
            assert_eq!(
                other.held_until(other_holds, key).unwrap(),
                in_redis,
                "{name}: hold {key:?} in Redis"
            );
        }
        assert_eq!(store.held_until(holds, b"k").unwrap(), Some(at + 5_000));
        let expected = if fenced {
            store.discard_batch(1, 2).unwrap();
            drop(first);
            [(&b"a"[..], 2), (b"b", 0)]
        } else {
            first.journaled();
            store.flush().unwrap();
            [(&b"a"[..], 3), (b"b", 1)]
        };
        assert_eq!(store.durable_mark(), store.counted_mark(), "{name}");
        let held = (!fenced).then_some(at + 5_000);
        assert_eq!(store.held_until(holds, b"k").unwrap(), held, "{name}");
        assert_eq!(
            store.held_until(holds, b"h").unwrap(),
            Some(at + 9_000),
            "{name}"
        );
        drop(store);
        let mut fresh = RedisStore::connect(&redis.url(), config.clone()).unwrap();
        let fresh_window = fresh.open_window(name, spec);
        let fresh_holds = fresh.open_holds(name, 3_600_000);
        for (key, total) in expected {
            assert_eq!(
                fresh.read(fresh_window, key, at).unwrap().applied,
                Applied::Counted(total),
                "{name}: {key:?}"
            );
        }
        assert_eq!(fresh.held_until(fresh_holds, b"k").unwrap(), held, "{name}");
        assert_eq!(
            fresh.held_until(fresh_holds, b"h").unwrap(),
            Some(at + 9_000),
            "{name}"
        );
    }
}

/// A flush that meets a key counted both by journaled batches and by one not journaled yet sends
/// only the journaled part, and Redis merges it: the view's fields are not what Redis should hold
/// (they hold the batch held back, which may have moved the view's head and slid buckets out of
/// it). Redis holds exactly the journaled counts, at the head they reach, whether the held-back
/// count is at that head or past it.
#[test]
fn a_count_held_back_never_reaches_redis_whether_or_not_it_moved_the_head() {
    use vigil::window::{Aggregate, Applied, Delta, WindowSpec};
    let redis = RedisServer::start();
    let config = RedisStoreConfig {
        max_pending: usize::MAX,
        flush_interval: std::time::Duration::MAX,
        ..RedisStoreConfig::default()
    };
    // Three buckets of a second.
    let spec = WindowSpec::new(1_000, 3, Aggregate::Count);
    let at = 1_000_000;
    // Held back at the head the journaled counts reach, then one bucket past it: the view's
    // window then slides its first bucket out, which Redis' must not.
    for held_at in [at + 2_000, at + 3_000] {
        let name = format!("held-{held_at}");
        let mut store = RedisStore::connect(&redis.url(), config.clone()).unwrap();
        let window = store.open_window(&name, spec);
        let count = |store: &mut RedisStore, lane: u64, offset: i64, ts: i64| {
            store.set_origin(Some(InputPosition { lane, offset }));
            store.apply(window, b"ip", ts, Delta::Count).unwrap();
        };
        count(&mut store, 2, 1, at);
        store.flush().unwrap();
        count(&mut store, 2, 2, at + 2_000);
        store.begin_batch(1, 5);
        count(&mut store, 1, 5, held_at);
        let seal = store.seal_batch();
        store.flush().unwrap();
        let mut other = RedisStore::connect(&redis.url(), config.clone()).unwrap();
        let other_window = other.open_window(&name, spec);
        assert_eq!(
            other.read(other_window, b"ip", at + 2_000).unwrap().applied,
            Applied::Counted(2),
            "{name}: Redis holds both journaled counts, in a window still at their head"
        );
        seal.journaled();
        store.flush().unwrap();
        other.forget_cached();
        let expected = if held_at == at + 2_000 { 3 } else { 2 };
        assert_eq!(
            other.read(other_window, b"ip", held_at).unwrap().applied,
            Applied::Counted(expected),
            "{name}: and the held-back count once journaled"
        );
        assert_eq!(
            store.read(window, b"ip", held_at).unwrap().applied,
            Applied::Counted(expected),
            "{name}: as this process sees it"
        );
    }
}

/// Batches of several lanes counted on shared keys, sealed, then journaled or fenced in any order,
/// with ticks and flushes (write-behind every millisecond) in between: after every flush Redis
/// holds exactly what the journaled batches counted and raised, never anything of a batch still
/// out or taken back, while this process sees everything not taken back.
#[test]
fn batches_of_several_lanes_reach_redis_exactly_when_journaled_in_any_order() {
    use rand::{Rng, SeedableRng};
    use vigil::store::BatchSeal;
    use vigil::window::{Aggregate, Applied, Delta, WindowSpec};
    let redis = RedisServer::start();
    let spec = WindowSpec::new(1_000, 60, Aggregate::Count);
    let at = 1_000_000;
    let keys: [&[u8]; 4] = [b"k0", b"k1", b"k2", b"k3"];
    let hold_keys: [&[u8]; 2] = [b"h0", b"h1"];
    struct Open {
        seal: BatchSeal,
        since: i64,
        counts: [i64; 4],
        raise: Option<(usize, i64)>,
    }
    let journal = |journaled: &mut [i64; 4], held: &mut [Option<i64>; 2], batch: &Open| {
        for (total, counted) in journaled.iter_mut().zip(batch.counts) {
            *total += counted;
        }
        if let Some((h, until)) = batch.raise {
            held[h] = held[h].max(Some(until));
        }
    };
    for seed in 0..32u64 {
        // From seed 16, flushes are built a key per tick: batches begin and seal between the
        // slices of one flush.
        let sliced = seed >= 16;
        let config = RedisStoreConfig {
            flush_interval: std::time::Duration::from_millis(1),
            exclusive_flush_interval: std::time::Duration::from_millis(1),
            tick_budget: if sliced {
                std::time::Duration::ZERO
            } else {
                RedisStoreConfig::default().tick_budget
            },
            ..RedisStoreConfig::default()
        };
        let name = format!("lanes-{seed}");
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut store = RedisStore::connect(&redis.url(), config.clone()).unwrap();
        let window = store.open_window(&name, spec);
        let holds = store.open_holds(&name, 3_600_000);
        let mut open: Vec<Option<Open>> = (0..3).map(|_| None).collect();
        let mut next_offset = [0i64; 3];
        // What the journaled batches counted and raised, and what every batch not taken back did.
        let (mut journaled, mut kept) = ([0i64; 4], [0i64; 4]);
        let mut held: [Option<i64>; 2] = [None; 2];
        let check_redis = |journaled: &[i64; 4], held: &[Option<i64>; 2], step: usize| {
            let mut observer = RedisStore::connect(&redis.url(), config.clone()).unwrap();
            let observed = observer.open_window(&name, spec);
            let observed_holds = observer.open_holds(&name, 3_600_000);
            for (k, key) in keys.iter().enumerate() {
                assert_eq!(
                    observer.read(observed, key, at).unwrap().applied,
                    Applied::Counted(journaled[k]),
                    "seed {seed} step {step}: {key:?} in Redis"
                );
            }
            for (h, key) in hold_keys.iter().enumerate() {
                assert_eq!(
                    observer.held_until(observed_holds, key).unwrap(),
                    held[h],
                    "seed {seed} step {step}: hold {key:?} in Redis"
                );
            }
        };
        for step in 0..150 {
            let lanes_open: Vec<usize> = (0..3).filter(|&l| open[l].is_some()).collect();
            match rng.random_range(0..10) {
                0..=3 => {
                    let lane = rng.random_range(0..3);
                    if open[lane].is_some() {
                        continue;
                    }
                    let since = next_offset[lane];
                    store.begin_batch(lane as u64, since);
                    let events = rng.random_range(1..5);
                    let mut counts = [0; 4];
                    for offset in since..since + events {
                        let k = rng.random_range(0..4);
                        store.set_origin(Some(InputPosition {
                            lane: lane as u64,
                            offset,
                        }));
                        // Over a few buckets, so that a batch's count sometimes moves a key's
                        // head past what Redis will hold without it, and sometimes does not.
                        let ts = at + rng.random_range(0..5) * 1_000;
                        store.apply(window, keys[k], ts, Delta::Count).unwrap();
                        counts[k] += 1;
                        kept[k] += 1;
                    }
                    next_offset[lane] = since + events;
                    let raise = rng
                        .random_bool(0.5)
                        .then(|| (rng.random_range(0..2), at + rng.random_range(1..10_000)));
                    if let Some((h, until)) = raise {
                        store.extend_hold(holds, hold_keys[h], until).unwrap();
                    }
                    let seal = store.seal_batch();
                    store.tick().unwrap();
                    open[lane] = Some(Open {
                        seal,
                        since,
                        counts,
                        raise,
                    });
                }
                4..=6 if !lanes_open.is_empty() => {
                    let lane = lanes_open[rng.random_range(0..lanes_open.len())];
                    let batch = open[lane].take().unwrap();
                    journal(&mut journaled, &mut held, &batch);
                    batch.seal.journaled();
                }
                7 if !lanes_open.is_empty() => {
                    // Its journal write was fenced: taken back (the rest is flushed).
                    let lane = lanes_open[rng.random_range(0..lanes_open.len())];
                    let batch = open[lane].take().unwrap();
                    store.discard_batch(lane as u64, batch.since).unwrap();
                    drop(batch.seal);
                    for (kept, taken_back) in kept.iter_mut().zip(batch.counts) {
                        *kept -= taken_back;
                    }
                    check_redis(&journaled, &held, step);
                }
                8 => store.tick().unwrap(),
                _ => {
                    store.flush().unwrap();
                    check_redis(&journaled, &held, step);
                }
            }
            for (k, key) in keys.iter().enumerate() {
                assert_eq!(
                    store.read(window, key, at).unwrap().applied,
                    Applied::Counted(kept[k]),
                    "seed {seed} step {step}: {key:?} here"
                );
            }
        }
        for batch in open.iter_mut().filter_map(Option::take) {
            journal(&mut journaled, &mut held, &batch);
            batch.seal.journaled();
        }
        store.flush().unwrap();
        assert_eq!(journaled, kept, "seed {seed}");
        assert_eq!(store.durable_mark(), store.counted_mark(), "seed {seed}");
        check_redis(&journaled, &held, 150);
    }
}

/// A worker's partition loop reads the windows its batch lacks before it takes the engine, while
/// other partitions count. A read that the store's own counting overtook meanwhile is not taken
/// in: the value stays the store's, never the older window Redis had when it was read.
#[test]
fn early_reads_never_take_in_a_window_older_than_what_the_store_counted_since() {
    use vigil::window::{Aggregate, Applied, Delta, WindowSpec};
    let redis = RedisServer::start();
    let spec = WindowSpec::new(1_000, 60, Aggregate::Count);
    let at = 1_000_000;
    // Another worker counted `shared` once.
    let mut other = RedisStore::connect(&redis.url(), RedisStoreConfig::default()).unwrap();
    let window = other.open_window("early", spec);
    other.apply(window, b"shared", at, Delta::Count).unwrap();
    other.flush().unwrap();

    let mut store = RedisStore::connect(&redis.url(), RedisStoreConfig::default()).unwrap();
    let window = store.open_window("early", spec);
    let keys = |names: &[&[u8]]| {
        names
            .iter()
            .map(|n| (window, n.to_vec()))
            .collect::<Vec<_>>()
    };
    let mut reads = store
        .plan_early_reads(&keys(&[b"mine", b"shared", b"untouched"]))
        .unwrap();
    assert_eq!(reads.len(), 3);
    let reader = store.early_reader().unwrap();
    let replies = reader.read(&mut reads);
    let replies = reads.decode(replies);
    assert!(replies.is_ok(), "{replies:?}");
    // Meanwhile another partition's batch counted `mine` twice and its flush came back.
    store.apply(window, b"mine", at, Delta::Count).unwrap();
    store.apply(window, b"mine", at, Delta::Count).unwrap();
    store.flush().unwrap();
    assert_eq!(
        store.take_early_reads(reads, replies),
        2,
        "`mine` has a newer view: its read stays out"
    );
    let value = |store: &mut RedisStore, key: &[u8]| store.read(window, key, at).unwrap().applied;
    assert_eq!(value(&mut store, b"mine"), Applied::Counted(2));
    assert_eq!(value(&mut store, b"shared"), Applied::Counted(1));
    assert_eq!(value(&mut store, b"untouched"), Applied::Counted(0));
    assert_eq!(store.stats().early_loads, 2);
    // Nothing to read early for keys with views.
    assert!(store
        .plan_early_reads(&keys(&[b"mine", b"shared"]))
        .is_none());
    // The batch's prefetch would take them as cached without looking again; every view dropped
    // in between (and what the plan found with them) and they are read again. (A view evicted
    // in between is read when counted: the tiny-cache test evicts between the two all along.)
    store.forget_cached();
    let loads = store.stats().loads;
    store.prefetch(&keys(&[b"mine", b"shared"])).unwrap();
    assert_eq!(value(&mut store, b"mine"), Applied::Counted(2));
    assert_eq!(value(&mut store, b"shared"), Applied::Counted(1));
    assert_eq!(store.stats().loads, loads + 2);

    // Every view dropped while reads are out (Redis lost its data, a rebalance): none is taken.
    let mut reads = store.plan_early_reads(&keys(&[b"later"])).unwrap();
    let replies = reader.read(&mut reads);
    let replies = reads.decode(replies);
    store.forget_cached();
    assert_eq!(store.take_early_reads(reads, replies), 0);
    // A hash that does not decode (written by something else) is not taken in: the key is read
    // again when needed (and that read says why).
    let mut conn = redis.connection();
    redis::cmd("HSET")
        .arg(store.redis_key(window, b"garbled"))
        .arg("v")
        .arg("not a version")
        .exec(&mut conn)
        .unwrap();
    let mut reads = store
        .plan_early_reads(&keys(&[b"garbled", b"fine"]))
        .unwrap();
    let replies = reader.read(&mut reads);
    let replies = reads.decode(replies);
    assert_eq!(replies.decoded(), 1, "{replies:?}");
    let early_loads = store.stats().early_loads;
    assert_eq!(store.take_early_reads(reads, replies), 1);
    assert_eq!(store.stats().early_loads, early_loads + 1);
    assert_eq!(value(&mut store, b"fine"), Applied::Counted(0));
    // A read that failed is not taken either; the batch's prefetch reads the key.
    let reads = store.plan_early_reads(&keys(&[b"later"])).unwrap();
    assert_eq!(
        store.take_early_reads(
            reads,
            vigil::store::EarlyReplies::failed(vigil::store::StoreError::Unavailable(
                "test".into()
            ))
        ),
        0
    );
    assert_eq!(value(&mut store, b"later"), Applied::Counted(0));
}

/// While other workers count into the same Redis, a batch's observations on keys they may
/// count too are applied in Redis before the batch is judged. A key that includes the event's
/// message key has no other writer (its partition alone feeds it), so it is never counted
/// ahead: were the worker to stop between that step and its decision journal, the partition's
/// next owner would judge the batch's first events on a window already holding all of it.
#[test]
fn a_key_of_the_message_key_is_never_counted_ahead() {
    use vigil::store::Planned;
    use vigil::window::{Aggregate, Applied, Delta, WindowSpec};
    let redis = RedisServer::start();
    let spec = WindowSpec::new(1_000, 60, Aggregate::Count);
    let at = 1_000_000;
    let mut store = RedisStore::connect(&redis.url(), RedisStoreConfig::default()).unwrap();
    let window = store.open_window("ahead", spec);
    store.set_shared(true);
    // Both keys have clean views, which is what counting ahead steps from.
    for key in [&b"per-ip"[..], b"per-user"] {
        assert_eq!(
            store.read(window, key, at).unwrap().applied,
            Applied::Counted(0)
        );
    }
    let planned = |key: &[u8], offset: i64, follows_message_key: bool| Planned {
        window,
        key: key.to_vec(),
        ts_ms: at,
        delta: Delta::Count,
        origin: InputPosition { lane: 3, offset },
        follows_message_key,
    };
    let batch = [
        planned(b"per-ip", 10, false),
        planned(b"per-user", 10, true),
        planned(b"per-ip", 11, false),
        planned(b"per-user", 11, true),
    ];
    store.begin_batch(3, 10);
    store.count_ahead(&batch).unwrap();
    assert_eq!(
        store.stats().counted_ahead,
        2,
        "only the per-IP key's two observations go ahead"
    );
    let mut other = RedisStore::connect(&redis.url(), RedisStoreConfig::default()).unwrap();
    let other_window = other.open_window("ahead", spec);
    let in_redis =
        |other: &mut RedisStore, key: &[u8]| other.read(other_window, key, at).unwrap().applied;
    assert_eq!(in_redis(&mut other, b"per-ip"), Applied::Counted(2));
    assert_eq!(
        in_redis(&mut other, b"per-user"),
        Applied::Counted(0),
        "nothing of the per-user key reached Redis"
    );
    // The batch counts as planned: each event sees exactly the events before it.
    for (i, p) in batch.iter().enumerate() {
        store.set_origin(Some(p.origin));
        let expected = if i < 2 { 1 } else { 2 };
        assert_eq!(
            store
                .apply(window, &p.key, at, Delta::Count)
                .unwrap()
                .applied,
            Applied::Counted(expected),
            "{i}"
        );
    }
    store.seal_batch().journaled();
    store.flush().unwrap();
    other.forget_cached();
    assert_eq!(in_redis(&mut other, b"per-ip"), Applied::Counted(2));
    assert_eq!(in_redis(&mut other, b"per-user"), Applied::Counted(2));
}

/// A worker that counted a step ahead and stopped before journaling its decisions (killed, or
/// stalled until fenced) leaves the step's observations in Redis. The partition's next owner
/// counts the same step ahead: Redis skips what it holds, and the owner judges each event on the
/// window as it stood before that event, not on one already holding the rest of the step. A
/// count or a sum takes the held observations out and counts them back in order; a distinct
/// window cannot (what it held before is not kept) and is judged as Redis holds it. Whatever
/// the path, every observation is in Redis exactly once.
#[test]
fn a_step_a_stopped_owner_counted_ahead_is_judged_again_as_it_stood_before_each_event() {
    use vigil::store::Planned;
    use vigil::window::{Aggregate, Applied, Delta, WindowSpec};
    let redis = RedisServer::start();
    let at = 1_000_000;
    let specs = [
        ("fails-ip", WindowSpec::new(1_000, 60, Aggregate::Count)),
        ("amount-ip", WindowSpec::new(1_000, 60, Aggregate::Sum)),
        ("users-ip", WindowSpec::new(1_000, 60, Aggregate::Distinct)),
    ];
    let open = || {
        let mut store = RedisStore::connect(&redis.url(), RedisStoreConfig::default()).unwrap();
        let windows: Vec<_> = specs
            .iter()
            .map(|(name, spec)| store.open_window(name, *spec))
            .collect();
        store.set_shared(true);
        (store, windows)
    };
    // Event i of the step, at offset 10 + i: one failure, 1.5 × (i + 1) spent, user i.
    let deltas = |i: i64| {
        [
            Delta::Count,
            Delta::Sum(1_500_000 * (i + 1)),
            Delta::Distinct(i as u128),
        ]
    };
    let step = |windows: &[vigil::store::WindowId]| -> Vec<Planned> {
        (0..4i64)
            .flat_map(|i| {
                windows
                    .iter()
                    .zip(deltas(i))
                    .map(move |(&window, delta)| Planned {
                        window,
                        key: b"203.0.113.7".to_vec(),
                        ts_ms: at + i * 100,
                        delta,
                        origin: InputPosition {
                            lane: 3,
                            offset: 10 + i,
                        },
                        follows_message_key: false,
                    })
            })
            .collect()
    };
    let read_all = |store: &mut RedisStore, windows: &[vigil::store::WindowId]| {
        windows
            .iter()
            .map(|&w| store.read(w, b"203.0.113.7", at + 400).unwrap().applied)
            .collect::<Vec<_>>()
    };

    // Another worker's event on the same IP, before the step (its own partition, lane 7).
    let (mut other, other_windows) = open();
    other.set_origin(Some(InputPosition { lane: 7, offset: 1 }));
    for (&w, delta) in
        other_windows
            .iter()
            .zip([Delta::Count, Delta::Sum(1_000_000), Delta::Distinct(99)])
    {
        other.apply(w, b"203.0.113.7", at, delta).unwrap();
    }
    other.flush().unwrap();

    // The first owner counts the step ahead and stops before judging it.
    let (mut stopped, windows) = open();
    read_all(&mut stopped, &windows);
    stopped.begin_batch(3, 10);
    stopped.count_ahead(&step(&windows)).unwrap();
    assert_eq!(stopped.stats().counted_ahead, 12);
    drop(stopped);

    // The next owner reads the same events again.
    let (mut owner, windows) = open();
    read_all(&mut owner, &windows);
    owner.begin_batch(3, 10);
    owner.count_ahead(&step(&windows)).unwrap();
    assert_eq!(
        owner.stats().taken_back,
        8,
        "the count's and the sum's observations are taken back, not the distinct set's"
    );
    for i in 0..4i64 {
        owner.set_origin(Some(InputPosition {
            lane: 3,
            offset: 10 + i,
        }));
        let seen: Vec<_> = windows
            .iter()
            .zip(deltas(i))
            .map(|(&w, delta)| {
                owner
                    .apply(w, b"203.0.113.7", at + i * 100, delta)
                    .unwrap()
                    .applied
            })
            .collect();
        // Before the step: the other worker's event (1 failure, 1.0 spent).
        let spent: i64 = 1_000_000 + (0..=i).map(|j| 1_500_000 * (j + 1)).sum::<i64>();
        assert_eq!(
            seen,
            [
                Applied::Counted(1 + i + 1),
                Applied::Counted(spent),
                Applied::Counted(5),
            ],
            "event {i}: the count and the sum as they stood; the distinct set as Redis holds it"
        );
    }
    owner.seal_batch().journaled();
    owner.flush().unwrap();
    assert_eq!(owner.stats().skipped_applied, 12);
    assert_eq!(
        owner.judged_as_held(),
        4,
        "the distinct set's four, judged on the window as Redis holds it"
    );

    // Redis holds every observation once.
    other.forget_cached();
    assert_eq!(
        read_all(&mut other, &other_windows),
        [
            Applied::Counted(5),
            Applied::Counted(1_000_000 + 15_000_000),
            Applied::Counted(5),
        ]
    );
    // And the owner's view of the key after the batch is Redis' own.
    assert_eq!(
        read_all(&mut owner, &windows),
        read_all(&mut other, &other_windows)
    );
}

/// A Redis that may evict keys (any `maxmemory-policy` but `noeviction`) would drop counter keys
/// and their counts without a trace: the store refuses it at connect, unless the operator
/// allows it knowingly (then the stats, and the worker's metric, say so). `vigil replay` too.
#[test]
fn a_redis_that_may_evict_keys_is_refused_unless_allowed() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let policy = |conn: &mut redis::Connection, policy: &str| {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory-policy")
            .arg(policy)
            .query(conn)
            .unwrap();
    };
    policy(&mut conn, "allkeys-lru");
    match RedisStore::connect(&redis.url(), RedisStoreConfig::default()) {
        Err(e) => {
            assert_eq!(e.code(), "unsafe");
            assert!(
                e.to_string().starts_with(
                    "counter store refused: Redis has maxmemory-policy allkeys-lru: it may evict counter keys"
                ),
                "{e}"
            );
        }
        Ok(_) => panic!("a Redis that may evict keys was accepted"),
    }
    let allowed = RedisStore::connect(
        &redis.url(),
        RedisStoreConfig {
            allow_eviction: true,
            ..RedisStoreConfig::default()
        },
    )
    .unwrap();
    assert!(allowed.stats().eviction_allowed);
    drop(allowed);

    let rules = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("rules");
    let input = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/events.jsonl");
    let replay = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_vigil"))
            .args([
                "replay",
                "--rules",
                rules.to_str().unwrap(),
                "--input",
                input.to_str().unwrap(),
                "--redis",
                &redis.url(),
            ])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = replay(&[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("maxmemory-policy allkeys-lru"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.stdout.is_empty(), "nothing judged");
    let out = replay(&["--redis-allow-eviction", "--max-future-skew", "off"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    policy(&mut conn, "noeviction");
    let store = RedisStore::connect(&redis.url(), RedisStoreConfig::default()).unwrap();
    assert!(!store.stats().eviction_allowed);
}

/// `max`, `min` and `last` counters kept in Redis (the script keeps each bucket's largest or
/// smallest amount, exactly, as two limbs, and a last key's one value and time) decide exactly as
/// in process, through flushes and a read cache small enough to reload windows from Redis.
#[test]
fn max_min_and_last_in_redis_decide_exactly_like_the_memory_store() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("extremes.toml"),
        r#"
[[counter]]
id         = "max-amount-user-1h"
match      = "type == 'payment'"
dimensions = ["user_id"]
window     = "1h"
aggregate  = "max"
field      = "amount"

[[counter]]
id         = "min-amount-card-10m"
match      = "type == 'payment'"
dimensions = ["card.id"]
window     = "10m"
bucket     = "10s"
aggregate  = "min"
field      = "amount"

[[rule]]
id     = "amount-spread"
action = "review"
match  = "type == 'payment'"
when   = "$max-amount-user-1h > 200 && $min-amount-card-10m < 20"

[[rule]]
id     = "login-after-big-payment"
action = "alert"
match  = "type == 'login'"
when   = "$max-amount-user-1h >= 400"

[[counter]]
id         = "last-country-user-1h"
dimensions = ["user_id"]
window     = "1h"
aggregate  = "last"
field      = "geo.country"

[[counter]]
id         = "last-result-device-10m"
dimensions = ["device.id"]
window     = "10m"
bucket     = "10s"
aggregate  = "last"
field      = "result"

[[rule]]
id     = "country-changed"
action = "challenge"
when   = "$last-country-user-1h != geo.country && since($last-country-user-1h) < 600000"

[[rule]]
id     = "first-on-device"
action = "alert"
match  = "type == 'login'"
when   = "!exists($last-result-device-10m) || $last-result-device-10m == 'fail'"
"#,
    )
    .unwrap();
    let input = workload(40_000);
    // The decisions name `last` values of events read back from Redis.
    let (memory, _, _) = support::store_replay::replay_rules(
        dir.path(),
        MemoryStore::new(),
        &input,
        ReplayOptions::default(),
    );
    let config = RedisStoreConfig {
        cache_capacity: 64,
        max_pending: 300,
        ..RedisStoreConfig::default()
    };
    let (from_redis, _, engine) = support::store_replay::replay_rules(
        dir.path(),
        RedisStore::connect(&redis.url(), config).unwrap(),
        &input,
        ReplayOptions::default(),
    );
    let records = decisions(&memory);
    let fired = |id: &str| {
        records
            .iter()
            .filter(|r| {
                r["hits"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|h| h["rule_id"] == id)
            })
            .count()
    };
    for rule in [
        "amount-spread",
        "login-after-big-payment",
        "country-changed",
        "first-on-device",
    ] {
        assert!(fired(rule) > 100, "{rule} must fire: {}", fired(rule));
    }
    assert_eq!(
        String::from_utf8(from_redis).unwrap(),
        String::from_utf8(memory).unwrap()
    );
    assert!(
        engine.store().stats().loads > 1_000,
        "{:?}",
        engine.store().stats()
    );
}

/// A release (support) ends the hold for every process: the releasing process's own raise not
/// yet written goes with it, another process's raise made before the release (an extension still
/// on its way) is refused when it arrives, and a firing judged after the release holds the key
/// anew.
#[test]
fn a_released_hold_stays_released_whatever_raises_were_on_their_way() {
    let redis = RedisServer::start();
    let config = RedisStoreConfig {
        flush_interval: std::time::Duration::from_millis(20),
        ..RedisStoreConfig::default()
    };
    let clock = std::sync::Arc::new(ManualMonotonic::new());
    let connect = || {
        RedisStore::connect_with_clock(&redis.url(), config.clone(), std::sync::Arc::clone(&clock))
            .unwrap()
    };
    let (mut a, mut b) = (connect(), connect());
    let (space_a, space_b) = (
        a.open_holds("brute-force", 3_600_000),
        b.open_holds("brute-force", 3_600_000),
    );
    let key = b"u-7";
    // Both processes hold the key; b's extension is not written yet, nor is a's raise.
    assert_eq!(a.extend_hold(space_a, key, 1_000_000).unwrap(), 1_000_000);
    a.flush().unwrap();
    clock.advance(config.flush_interval * 2);
    assert_eq!(b.held_until(space_b, key).unwrap(), Some(1_000_000));
    assert_eq!(b.extend_hold(space_b, key, 2_000_000).unwrap(), 2_000_000);
    assert_eq!(a.extend_hold(space_a, key, 1_500_000).unwrap(), 1_500_000);
    // a releases: what it knows (its own raise included) is released; it holds nothing now.
    assert_eq!(a.release_hold(space_a, key).unwrap(), Some(1_500_000));
    assert_eq!(a.held_until(space_a, key).unwrap(), None);
    a.flush().unwrap();
    // b's extension, made before the release, arrives: refused, and b learns it.
    b.flush().unwrap();
    let mut conn = redis.connection();
    let name = a.redis_hold_key(space_a, key);
    let stored: String = redis::cmd("GET").arg(&name).query(&mut conn).unwrap();
    assert_eq!(stored, "r1");
    assert_eq!(b.held_until(space_b, key).unwrap(), None);
    clock.advance(config.flush_interval * 2);
    assert_eq!(a.held_until(space_a, key).unwrap(), None);
    assert_eq!(b.held_until(space_b, key).unwrap(), None);
    // A firing judged after the release (b read the new generation) holds the key again, even
    // for an earlier event time; a sees it.
    assert_eq!(b.extend_hold(space_b, key, 1_200_000).unwrap(), 1_200_000);
    b.flush().unwrap();
    clock.advance(config.flush_interval * 2);
    assert_eq!(a.held_until(space_a, key).unwrap(), Some(1_200_000));
    let stored: String = redis::cmd("GET").arg(&name).query(&mut conn).unwrap();
    assert_eq!(stored, "1200000:1");
    // Releasing a key nobody holds says so.
    assert_eq!(a.release_hold(space_a, b"u-8").unwrap(), None);
}

/// Two workers that both believe they own one partition (the old owner stalled past its session
/// timeout and came back still counting, a zombie) count its events into one Redis, each at its
/// own pace, flushing, batching, counting ahead and dropping its views at random points: every
/// event is counted once. Each observation carries its lane and offset, and the script skips an
/// offset at or below the one the key recorded, whichever writer recorded it. Seeds from 24 on
/// spread each flush's bookkeeping one key per tick over many keys: batches are counted between
/// the slices of a flush being built, being taken in, and of windows moving to the cache.
#[test]
fn two_owners_of_one_partition_count_each_of_its_events_once() {
    use rand::{Rng, SeedableRng};
    use vigil::store::Planned;
    use vigil::window::{Aggregate, Applied, Delta, WindowSpec};
    let redis = RedisServer::start();
    let at = 1_000_000;
    let kinds = [
        (Aggregate::Count, "count"),
        (Aggregate::Sum, "sum"),
        (Aggregate::Distinct, "distinct"),
    ];
    for seed in 0..32u64 {
        let sliced = seed >= 24;
        let names: Vec<Vec<u8>> = if sliced {
            (0..40).map(|k| format!("ip-{k}").into_bytes()).collect()
        } else {
            vec![b"ip-1".to_vec(), b"ip-2".to_vec(), b"user-3".to_vec()]
        };
        let keys = names.as_slice();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let lane = 7;
        let events: Vec<(usize, i64)> = (0..80)
            .map(|_| (rng.random_range(0..keys.len()), rng.random_range(1..5)))
            .collect();
        let delta = |aggregate: Aggregate, amount: i64| match aggregate {
            Aggregate::Count => Delta::Count,
            Aggregate::Sum => Delta::Sum(amount * 1_000_000),
            _ => Delta::Distinct(amount as u128),
        };
        struct Owner {
            store: RedisStore,
            windows: Vec<vigil::store::WindowId>,
            next: usize,
            stop: usize,
        }
        // Write-behind every millisecond: a batch is often counted while a flush is in flight,
        // and that flush's reply (the window another writer moved on) is merged with it.
        let config = RedisStoreConfig {
            flush_interval: std::time::Duration::from_millis(if sliced { 20 } else { 1 }),
            exclusive_flush_interval: std::time::Duration::from_millis(if sliced { 20 } else { 1 }),
            tick_budget: if sliced {
                std::time::Duration::ZERO
            } else {
                RedisStoreConfig::default().tick_budget
            },
            ..RedisStoreConfig::default()
        };
        let open = |stop: usize| {
            let mut store = RedisStore::connect(&redis.url(), config.clone()).unwrap();
            let windows = kinds
                .iter()
                .map(|(aggregate, name)| {
                    store.open_window(
                        &format!("owners-{seed}-{name}"),
                        WindowSpec::new(1_000, 600, *aggregate),
                    )
                })
                .collect();
            Owner {
                store,
                windows,
                next: 0,
                stop,
            }
        };
        // The zombie stops somewhere; the new owner reads the partition from its start (nothing
        // was committed) to its end.
        let mut owners = [open(rng.random_range(10..events.len())), open(events.len())];
        while owners.iter().any(|o| o.next < o.stop) {
            let owner = &mut owners[rng.random_range(0..2)];
            match rng.random_range(0..10) {
                0 => owner.store.flush().unwrap(),
                1 => owner.store.forget_cached(),
                2 => owner.store.set_shared(rng.random_bool(0.5)),
                _ if owner.next < owner.stop => {
                    // A batch of a few events, counted ahead where the store chooses to.
                    let end = (owner.next + rng.random_range(1..6)).min(owner.stop);
                    let batch = &events[owner.next..end];
                    let planned: Vec<Planned> = (owner.next..end)
                        .zip(batch)
                        .flat_map(|(offset, &(key, amount))| {
                            kinds.iter().zip(&owner.windows).map(
                                move |((aggregate, _), &window)| Planned {
                                    window,
                                    key: keys[key].to_vec(),
                                    ts_ms: at + offset as i64,
                                    delta: delta(*aggregate, amount),
                                    origin: InputPosition {
                                        lane,
                                        offset: offset as i64,
                                    },
                                    follows_message_key: false,
                                },
                            )
                        })
                        .collect();
                    owner.store.begin_batch(lane, owner.next as i64);
                    owner.store.count_ahead(&planned).unwrap();
                    for p in &planned {
                        owner.store.set_origin(Some(p.origin));
                        let applied = owner
                            .store
                            .apply(p.window, &p.key, p.ts_ms, p.delta)
                            .unwrap();
                        assert!(!matches!(applied.applied, Applied::Late), "{seed}");
                    }
                    owner.store.seal_batch().journaled();
                    owner.next = end;
                    owner.store.tick().unwrap();
                }
                _ => owner.store.tick().unwrap(),
            }
        }
        for owner in &mut owners {
            owner.store.flush().unwrap();
        }
        let mut reader = open(0);
        for (k, key) in keys.iter().enumerate() {
            let mine: Vec<i64> = events
                .iter()
                .filter(|(e, _)| *e == k)
                .map(|&(_, amount)| amount)
                .collect();
            let distinct = mine.iter().collect::<std::collections::BTreeSet<_>>().len();
            let expected = [
                mine.len() as i64,
                mine.iter().sum::<i64>() * 1_000_000,
                distinct as i64,
            ];
            for (w, want) in expected.iter().enumerate() {
                let window = reader.windows[w];
                let got = reader.store.read(window, key, at + 100).unwrap().applied;
                assert_eq!(
                    got,
                    Applied::Counted(*want),
                    "seed {seed}, key {}, {}",
                    String::from_utf8_lossy(key),
                    kinds[w].1
                );
            }
        }
    }
}

/// The windows Redis has not acknowledged are measured a slice per tick (a pass over thousands
/// of them would hold the engine for milliseconds): spread over ticks, the pass comes to what it
/// measures in one.
#[test]
fn the_local_state_measured_a_slice_per_tick_comes_to_what_one_pass_measures() {
    use std::sync::Arc;
    use std::time::Duration;
    use vigil::window::{Aggregate, Delta, WindowSpec};
    let redis = RedisServer::start();
    let clock = Arc::new(ManualMonotonic::new());
    let spec = WindowSpec::new(1_000, 60, Aggregate::Distinct);
    let measured = |tick_budget: Duration| {
        let config = RedisStoreConfig {
            tick_budget,
            // Nothing is flushed while the test ticks: every window stays unacknowledged.
            exclusive_flush_interval: Duration::from_secs(3_600),
            flush_interval: Duration::from_secs(3_600),
            ..RedisStoreConfig::default()
        };
        let mut store =
            RedisStore::connect_with_clock(&redis.url(), config, Arc::clone(&clock)).unwrap();
        let window = store.open_window("sliced", spec);
        for key in 0..2_000u32 {
            for value in 0..(key % 7) as u128 {
                store
                    .apply(
                        window,
                        &key.to_be_bytes(),
                        1_000_000,
                        Delta::Distinct(value),
                    )
                    .unwrap();
            }
        }
        clock.advance(Duration::from_secs(1));
        assert_eq!(store.state_stats().bytes, 0, "not measured yet");
        let mut ticks = 0;
        while store.state_stats().bytes == 0 && ticks < 1_000 {
            store.tick().unwrap();
            ticks += 1;
        }
        (store.state_stats().bytes, ticks)
    };
    let (whole, ticks_whole) = measured(Duration::from_secs(10));
    let (sliced, ticks_sliced) = measured(Duration::ZERO);
    assert_eq!(ticks_whole, 1, "one tick measures all of it");
    assert!(ticks_sliced > 20, "64 windows a tick: {ticks_sliced} ticks");
    assert!(whole > 2_000 * 100, "{whole}");
    assert_eq!(sliced, whole);
}

/// A worker's local state with Redis stays within its byte bound (`memory.max_state_bytes`):
/// clean windows are a read cache charged by their bytes (a key of a large distinct window
/// weighs what it holds, not one slot), and the windows Redis has not acknowledged (while it is
/// away) have the caller wait once they take the other half. Nothing counted is lost.
#[test]
fn a_redis_stores_local_state_stays_within_its_byte_bound() {
    use std::sync::Arc;
    use std::time::Duration;
    use vigil::window::{Aggregate, Applied, Delta, WindowSpec};
    let redis = RedisServer::start();
    let clock = Arc::new(ManualMonotonic::new());
    let bound = 4 << 20;
    let config = RedisStoreConfig {
        max_state_bytes: bound,
        response_timeout: Duration::from_millis(200),
        ..RedisStoreConfig::default()
    };
    let spec = WindowSpec::new(1_000, 60, Aggregate::Distinct);
    let mut store =
        RedisStore::connect_with_clock(&redis.url(), config.clone(), Arc::clone(&clock)).unwrap();
    let window = store.open_window("bytes", spec);
    let at = 1_000_000;
    let values = 200u128;
    let count = |store: &mut RedisStore<Arc<ManualMonotonic>>, key: u32| {
        for value in 0..values {
            store
                .apply(window, &key.to_be_bytes(), at, Delta::Distinct(value))
                .unwrap();
        }
    };
    // 2 000 keys of 200 distinct values each: several times the bound, counted and flushed.
    for key in 0..2_000u32 {
        count(&mut store, key);
        if key % 50 == 49 {
            store.flush().unwrap();
        }
    }
    store.flush().unwrap();
    // The store measures its bytes as it ticks, at most every 100 ms.
    clock.advance(Duration::from_secs(1));
    store.tick().unwrap();
    let stats = store.state_stats();
    assert!(
        stats.bytes > bound / 4 && stats.bytes <= bound / 2 + bound / 10,
        "clean windows take about half the bound: {} of {bound}",
        stats.bytes
    );
    assert!(store.live_keys() < 1_000, "{}", store.live_keys());
    for key in [0u32, 999, 1_999] {
        assert_eq!(
            store.read(window, &key.to_be_bytes(), at).unwrap().applied,
            Applied::Counted(values as i64),
            "read again from Redis"
        );
    }

    // Redis stops answering: the windows counted meanwhile wait in this process, until they take
    // half the bound; then the store asks its caller to wait (far below `max_local_keys`).
    redis.pause();
    let mut key = 10_000u32;
    while !store.saturated() {
        count(&mut store, key);
        key += 1;
        clock.advance(Duration::from_secs(1));
        store.tick().unwrap();
        assert!(
            key < 12_000,
            "never saturated: {}",
            store.state_stats().bytes
        );
    }
    let waiting = key - 10_000;
    assert!(
        (50..1_000).contains(&waiting),
        "{waiting} windows of 200 values fill half of {bound} bytes"
    );
    assert!(store.state_stats().bytes <= bound + bound / 10);
    redis.resume();
    store.flush().unwrap();
    clock.advance(Duration::from_secs(1));
    store.tick().unwrap();
    assert!(!store.saturated());
    let mut fresh = RedisStore::connect(&redis.url(), config).unwrap();
    let window = fresh.open_window("bytes", spec);
    for key in (0..2_000u32).chain(10_000..key) {
        assert_eq!(
            fresh.read(window, &key.to_be_bytes(), at).unwrap().applied,
            Applied::Counted(values as i64),
            "key {key}"
        );
    }
}

/// While Redis is away, a hold this process never saw may still be running (another worker set
/// it): "no view" is not taken for "not held". Each rule's `on_store_error` decides, as for a
/// value counted then (`block` fires with reason `store_unavailable`; `local` judges on what it
/// knows, and its hits are marked degraded), and a hold set meanwhile is marked degraded: its
/// `held_until` is what this process knows, and the hold in force may run later (here an
/// out-of-order event sets one that ends before the one another worker set). Redis keeps the
/// later of the two once it is back.
#[test]
fn a_hold_unknown_while_redis_is_away_is_judged_by_the_rules_policy() {
    use std::sync::Arc;
    use std::time::Duration;
    use vigil::clock::SystemClock;
    use vigil::rules::Reason;
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("box.toml");
    std::fs::write(
        &rules,
        "[[rule]]\nid = 'box-local'\naction = 'block'\nwhen = 'amount > 100'\nhold = '30m'\nhold_key = ['u']\n\n\
         [[rule]]\nid = 'box-block'\naction = 'review'\nwhen = 'amount > 100'\nhold = '30m'\nhold_key = ['u']\non_store_error = 'block'\n",
    )
    .unwrap();
    let redis = RedisServer::start();
    let config = RedisStoreConfig {
        response_timeout: Duration::from_millis(200),
        ..RedisStoreConfig::default()
    };
    let engine = |config: &RedisStoreConfig| {
        let store = RedisStore::connect(&redis.url(), config.clone()).unwrap();
        Engine::new(vigil::rule_files::load(&rules).unwrap(), store)
            .with_time(TimeBounds::OFF, Arc::new(SystemClock))
    };
    let t0 = 1_700_000_000_000i64;
    let hold = 30 * 60_000;
    type Hits = Vec<(String, Option<Reason>, bool, Option<i64>)>;
    let judge = |engine: &mut Engine<RedisStore>, ts: i64, amount: u32, offset: i64| -> Hits {
        let line = format!(r#"{{"ts":{ts},"u":"victim","amount":{amount}}}"#);
        let projection = engine.rules().projection().clone();
        let event = vigil::event::decode(line.as_bytes(), &projection).unwrap();
        let decision = engine
            .evaluate(&event, InputPosition { lane: 0, offset })
            .unwrap();
        decision
            .hits
            .iter()
            .map(|h| {
                (
                    engine.rules().rule(h.rule).id.clone(),
                    h.reason,
                    h.degraded,
                    h.held_until,
                )
            })
            .collect()
    };
    // Another worker put the victim in both penalty boxes.
    let mut other = engine(&config);
    assert_eq!(judge(&mut other, t0, 500, 0).len(), 2);
    other.store_mut().flush().unwrap();

    // With Redis up, a new worker sees the holds.
    let mut up = engine(&config);
    let held = |reason| {
        vec![
            ("box-local".to_owned(), Some(reason), false, Some(t0 + hold)),
            ("box-block".to_owned(), Some(reason), false, Some(t0 + hold)),
        ]
    };
    assert_eq!(judge(&mut up, t0 + 60_000, 1, 1), held(Reason::Held));
    assert_eq!(
        judge(&mut up, t0 - 10_000, 500, 2),
        held(Reason::When),
        "an earlier event extends nothing"
    );

    // With Redis frozen, a worker that never saw the holds cannot tell.
    let mut away = engine(&config);
    redis.pause();
    assert_eq!(
        judge(&mut away, t0 + 60_000, 1, 1),
        vec![(
            "box-block".to_owned(),
            Some(Reason::StoreUnavailable),
            true,
            None
        )],
        "box-local judges on what it knows (not held) and does not fire; box-block fires"
    );
    assert_eq!(
        judge(&mut away, t0 - 10_000, 500, 2),
        vec![
            (
                "box-local".to_owned(),
                Some(Reason::When),
                true,
                Some(t0 - 10_000 + hold)
            ),
            (
                "box-block".to_owned(),
                Some(Reason::When),
                true,
                Some(t0 - 10_000 + hold)
            ),
        ],
        "holds set meanwhile say they may not be the hold in force"
    );
    redis.resume();
    away.store_mut().flush().unwrap();
    let mut after = engine(&config);
    assert_eq!(judge(&mut after, t0 + 120_000, 1, 3), held(Reason::Held));
}

/// Counters over the same dimensions (one `WindowSpec::group`) keep each key in one Redis hash,
/// each counter's window a section of it: one read brings every section a batch needs, each
/// section counts exactly what its counter counted, and a counter outside the group keeps its
/// own hashes.
#[test]
fn counters_over_the_same_dimensions_share_one_hash_per_key_and_one_read() {
    use vigil::window::{Aggregate, Applied, Delta, WindowSpec};
    let redis = RedisServer::start();
    let grouped = |aggregate| WindowSpec {
        group: 42,
        identity: 7,
        ..WindowSpec::new(1_000, 60, aggregate)
    };
    let open = |store: &mut RedisStore| {
        (
            store.open_window("fails", grouped(Aggregate::Count)),
            store.open_window("amount", grouped(Aggregate::Sum)),
            store.open_window("largest", grouped(Aggregate::Max)),
            store.open_window("alone", WindowSpec::new(1_000, 60, Aggregate::Count)),
        )
    };
    let mut store = RedisStore::connect(&redis.url(), RedisStoreConfig::default()).unwrap();
    let (count, sum, max, alone) = open(&mut store);
    let at = 1_000_000i64;
    let mut want: std::collections::BTreeMap<String, (i64, i64, i64, i64)> = Default::default();
    for i in 0..300i64 {
        let key = format!("u{}", i % 20);
        let ts = at + i * 100;
        store
            .apply(count, key.as_bytes(), ts, Delta::Count)
            .unwrap();
        store
            .apply(sum, key.as_bytes(), ts, Delta::Sum(i * 1_000_000))
            .unwrap();
        store
            .apply(max, key.as_bytes(), ts, Delta::Extreme((i % 7) * 1_000_000))
            .unwrap();
        let entry = want.entry(key.clone()).or_default();
        if i % 3 == 0 {
            store
                .apply(alone, key.as_bytes(), ts, Delta::Count)
                .unwrap();
            entry.3 += 1;
        }
        entry.0 += 1;
        entry.1 += i * 1_000_000;
        entry.2 = entry.2.max((i % 7) * 1_000_000);
    }
    store.flush().unwrap();
    let mut conn = redis.connection();
    let keys = support::counter_keys(&mut conn);
    assert_eq!(
        (
            keys.iter().filter(|k| k.starts_with("vg:_:")).count(),
            keys.iter().filter(|k| k.starts_with("vg:alone:")).count(),
            keys.len()
        ),
        (20, 20, 40),
        "{keys:?}"
    );
    let totals = redis_totals(&mut conn);
    assert_eq!(
        totals.len(),
        20 * 3 + 20,
        "a section per grouped counter and key"
    );

    // A fresh process: one read per hash brings the three grouped windows of a key.
    let mut fresh = RedisStore::connect(&redis.url(), RedisStoreConfig::default()).unwrap();
    let (count, sum, max, alone) = open(&mut fresh);
    let wanted: Vec<(vigil::store::WindowId, Vec<u8>)> = want
        .keys()
        .flat_map(|k| [count, sum, max, alone].map(|w| (w, k.as_bytes().to_vec())))
        .collect();
    fresh.prefetch(&wanted).unwrap();
    assert_eq!(fresh.stats().loads, 40, "{:?}", fresh.stats());
    let last = at + 299 * 100;
    for (key, (n, total, largest, others)) in &want {
        let value = |store: &mut RedisStore, window| {
            store.read(window, key.as_bytes(), last).unwrap().applied
        };
        assert_eq!(value(&mut fresh, count), Applied::Counted(*n), "{key}");
        assert_eq!(value(&mut fresh, sum), Applied::Counted(*total), "{key}");
        assert_eq!(value(&mut fresh, max), Applied::Counted(*largest), "{key}");
        assert_eq!(value(&mut fresh, alone), Applied::Counted(*others), "{key}");
    }
    assert_eq!(fresh.stats().loads, 40, "nothing read twice");
    // Counting on from the fresh process: its writes land in their sections only.
    for key in want.keys() {
        fresh
            .apply(count, key.as_bytes(), last, Delta::Count)
            .unwrap();
    }
    fresh.flush().unwrap();
    let after = redis_totals(&mut conn);
    let changed = totals
        .iter()
        .filter(|(k, v)| after.get(*k) != Some(*v))
        .count();
    assert_eq!((after.len(), changed), (totals.len(), 20));
}

/// A counter's Redis key name is a contract with the data already in Redis: a release that named
/// keys differently would start every counter from nothing. The name is `vg:<counter>:` and the
/// first 16 bytes (hex) of BLAKE3 over the window's shape, what it counts and the key.
#[test]
fn redis_key_names_stay_what_earlier_releases_wrote() {
    let redis = RedisServer::start();
    let mut store = RedisStore::connect(&redis.url(), RedisStoreConfig::default()).unwrap();
    let spec = vigil::window::WindowSpec::new(60_000, 15, vigil::window::Aggregate::Count);
    let window = store.open_window("login_failures", spec);
    for value in [
        "u-1",
        "a key longer than one BLAKE3 block of sixty-four bytes, hashed whole",
    ] {
        let mut key = Vec::new();
        vigil::event::Scalar::Str(value).encode_into(&mut key);
        let mut hasher = blake3::Hasher::new();
        hasher.update(&spec.bucket_ms.to_le_bytes());
        hasher.update(&spec.buckets.to_le_bytes());
        hasher.update(spec.aggregate.as_str().as_bytes());
        hasher.update(&spec.identity.to_le_bytes());
        hasher.update(&key);
        let hex = hasher.finalize().to_hex();
        assert_eq!(
            store.redis_key(window, &key),
            format!("vg:login_failures:{}", &hex[..32])
        );
    }
}

/// Alone in its keys (no other process counts into them), the store writes behind at the
/// exclusive interval, so that a key counted many times in between is written once; once others
/// count too, at the flush interval. A flush that fills up (more keys pending than one flush
/// takes) goes on at once until every key is sent, whatever the interval: none waits past its
/// turn, nor holds back the durable mark.
#[test]
fn alone_the_store_writes_behind_seldom_and_with_others_at_the_flush_interval() {
    use std::time::{Duration, Instant};
    use vigil::window::{Aggregate, Delta, WindowSpec};
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let at = 1_000_000;
    let written = |conn: &mut redis::Connection| -> u64 {
        let keys: Vec<String> = redis::cmd("KEYS").arg("vg:*").query(conn).unwrap();
        keys.len() as u64
    };
    // Ticks the store until Redis holds `want` counter keys; false after thirty seconds. Redis
    // is asked every 20 ms only: a KEYS over thousands of keys after every tick took more time
    // than the ticks themselves, and a slow machine did not finish the flush in time.
    let ticked_until = |store: &mut RedisStore, conn: &mut redis::Connection, want: u64| {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut asked = Instant::now();
        while Instant::now() < deadline {
            store.tick().unwrap();
            if asked.elapsed() >= Duration::from_millis(20) {
                if written(conn) >= want {
                    return true;
                }
                asked = Instant::now();
            }
            std::thread::yield_now();
        }
        written(conn) >= want
    };

    let config = RedisStoreConfig {
        flush_interval: Duration::ZERO,
        exclusive_flush_interval: Duration::from_secs(3_600),
        ..RedisStoreConfig::default()
    };
    let mut store = RedisStore::connect(&redis.url(), config).unwrap();
    let window = store.open_window("alone", WindowSpec::new(1_000, 600, Aggregate::Count));
    for offset in 0..100 {
        store.set_origin(Some(InputPosition { lane: 1, offset }));
        store.apply(window, b"k", at, Delta::Count).unwrap();
        store.tick().unwrap();
    }
    assert_eq!(
        support::evalsha_calls(&mut conn),
        0,
        "alone, nothing is written before the exclusive interval"
    );
    store.set_shared(true);
    assert!(
        ticked_until(&mut store, &mut conn, 1),
        "with others, the next tick writes (a flush interval of zero)"
    );
    store.flush().unwrap();
    let calls = support::evalsha_calls(&mut conn);
    let before = written(&mut conn);

    // Alone, with more keys than one flush takes pending at once.
    let config = RedisStoreConfig {
        exclusive_flush_interval: Duration::from_secs(3_600),
        max_pending: 20_000,
        ..RedisStoreConfig::default()
    };
    let mut store = RedisStore::connect(&redis.url(), config).unwrap();
    let window = store.open_window("many", WindowSpec::new(1_000, 600, Aggregate::Count));
    let keys: Vec<_> = (0..20_000)
        .map(|n| (window, format!("key-{n}").into_bytes()))
        .collect();
    store.prefetch(&keys).unwrap();
    for (offset, (_, key)) in keys.iter().enumerate() {
        store.set_origin(Some(InputPosition {
            lane: 2,
            offset: offset as i64,
        }));
        store.apply(window, key, at, Delta::Count).unwrap();
    }
    assert_eq!(
        support::evalsha_calls(&mut conn),
        calls,
        "not yet sent: the store did not tick"
    );
    assert!(
        ticked_until(&mut store, &mut conn, before + 20_000),
        "a full flush goes on until every key is in Redis: {} keys there, {} flushes",
        written(&mut conn),
        store.stats().flushes,
    );
    assert!(store.stats().flushes >= 2, "{:?}", store.stats());
}

/// `vigil bench --redis` as a user runs it on a small workload: every approach's row with its
/// Redis calls and Redis CPU per event, and vigil against the fastest per-event script in events/s
/// and in Redis CPU per event.
#[test]
fn the_redis_bench_reports_every_row_and_both_ratios() {
    let redis = RedisServer::start();
    let url = redis.url();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_vigil"))
        .args([
            "bench", "--rules", "rules", "--redis", &url, "--events", "3000", "--users", "200",
        ])
        .output()
        .expect("spawn vigil");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for row in [
        "vigil (write-behind)",
        "per-event zset script",
        "per-event hash script",
        "per-event ring",
    ] {
        let line = stdout
            .lines()
            .find(|l| l.trim_start().starts_with(row) && l.contains("events/s"))
            .unwrap_or_else(|| panic!("no {row} row in {stdout}"));
        let per_event: f64 = line
            .split("redis cpu ")
            .nth(1)
            .and_then(|rest| rest.split('(').nth(1))
            .and_then(|rest| rest.split(" µs/event)").next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no Redis CPU per event in {line:?}"));
        assert!(per_event > 0.0, "{line}");
    }
    assert!(stdout.contains("vigil / fastest per-event ("), "{stdout}");
    let ratio: f64 = stdout
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("vigil's redis cpu per event / fastest per-event's: ")
        })
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no Redis CPU ratio in {stdout}"));
    // Write-behind sends fewer, larger calls than a script call per event and counter.
    assert!(ratio > 0.0 && ratio < 1.0, "{ratio}\n{stdout}");
}
