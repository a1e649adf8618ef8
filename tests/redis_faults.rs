//! `vigil replay --redis` under Redis faults, against real `redis-server` processes started here:
//! a proxy that drops connections after Redis executed a request, the same input replayed twice,
//! Redis frozen (SIGSTOP) for ten seconds, killed and restarted with its append-only file, and
//! restarted empty. Each ends with the counters in Redis equal to one clean pass over the input:
//! nothing lost, nothing counted twice.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use support::proxy::Proxy;
use support::{assert_totals_equal, redis_totals, RedisServer};
use vigil::harness::workload::{generate, WorkloadSpec};

/// Events in order inside every rule's window (so the exact totals do not depend on timing), with
/// enough keys for many flushes.
fn events(n: u64, seed: u64) -> Vec<String> {
    let spec = WorkloadSpec {
        events: n,
        users: 3_000,
        ips: 1_000,
        rate_per_sec: 400,
        late: 0.0,
        out_of_order: 0.02,
        seed,
        ..WorkloadSpec::default()
    };
    let mut out = Vec::new();
    generate(&spec, &mut out).unwrap();
    String::from_utf8(out)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

fn vigil() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vigil"));
    // Historic event times: the future bound does not matter, the lateness bound must not bite.
    cmd.env("RUST_LOG", "warn");
    cmd
}

/// `vigil replay --redis url` of `lines` as a file; returns (stdout, stderr).
fn replay_file(
    dir: &std::path::Path,
    name: &str,
    lines: &[String],
    redis: &str,
) -> (String, String) {
    replay_file_with(dir, name, lines, redis, &[])
}

/// `vigil replay --rules rules --input INPUT --redis REDIS`.
fn replay_command(input: &std::path::Path, redis: &str) -> Command {
    let mut command = vigil();
    command.args([
        "replay",
        "--rules",
        "rules",
        "--input",
        input.to_str().unwrap(),
        "--redis",
        redis,
    ]);
    command
}

/// [`replay_file`] with more arguments.
fn replay_file_with(
    dir: &std::path::Path,
    name: &str,
    lines: &[String],
    redis: &str,
    extra: &[&str],
) -> (String, String) {
    let input = dir.join(name);
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let out = replay_command(&input, redis).args(extra).output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    );
    assert!(out.status.success(), "replay failed: {stderr}");
    (stdout, stderr)
}

/// The counters one clean pass over `lines` leaves in a fresh Redis.
fn reference_totals(
    dir: &std::path::Path,
    lines: &[String],
) -> std::collections::BTreeMap<String, (i128, usize)> {
    let reference = RedisServer::start();
    replay_file(dir, "reference.jsonl", lines, &reference.url());
    redis_totals(&mut reference.connection())
}

/// The in-process replay's decision records (the exact decisions).
fn memory_records(dir: &std::path::Path, lines: &[String]) -> String {
    let input = dir.join("memory.jsonl");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let out = vigil()
        .args([
            "replay",
            "--rules",
            "rules",
            "--input",
            input.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn a_proxy_that_drops_connections_after_redis_executed_doubles_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let lines = events(60_000, 21);
    let want = reference_totals(dir.path(), &lines);
    let exact = memory_records(dir.path(), &lines);

    let redis = RedisServer::start();
    let proxy = Proxy::start(redis.port);
    proxy.drop_every(100);
    // Flushing as often as a worker among others: many flushes for the proxy to break.
    let (stdout, stderr) = replay_file_with(
        dir.path(),
        "events.jsonl",
        &lines,
        &proxy.url(),
        &["--redis-flush-interval", "50ms"],
    );
    assert!(
        proxy.dropped() >= 5,
        "the proxy dropped {} replies",
        proxy.dropped()
    );
    eprintln!(
        "the proxy dropped {} replies after Redis executed them",
        proxy.dropped()
    );
    assert_totals_equal(&redis_totals(&mut redis.connection()), &want, "");
    // A lost reply costs a retry on a new connection, never a count or a decision.
    assert!(!stderr.contains("unavailable"), "{stderr}");
    assert_eq!(stdout, exact, "{stderr}");
}

/// A finished replay records that its input is applied: the next replay of the same input is
/// refused (it would only re-judge events against counts that hold all of them) unless
/// `--rejudge`, which counts nothing twice and says so.
#[test]
fn replaying_the_same_input_twice_into_one_redis_counts_it_once() {
    let dir = tempfile::tempdir().unwrap();
    let lines = events(20_000, 22);
    let want = reference_totals(dir.path(), &lines);
    let redis = RedisServer::start();
    let (first, _) = replay_file(dir.path(), "events.jsonl", &lines, &redis.url());
    let input = dir.path().join("events.jsonl");
    let refused = replay_command(&input, &redis.url()).output().unwrap();
    assert_eq!(refused.status.code(), Some(1));
    assert!(refused.stdout.is_empty());
    let stderr = String::from_utf8(refused.stderr).unwrap();
    assert!(
        stderr
            .contains(": this input was already replayed into this Redis (20000 lines, finished ")
            && stderr.contains("pass --rejudge to do that anyway, or give another --input-id"),
        "{stderr}"
    );
    let (_, stderr) = replay_file_with(
        dir.path(),
        "events.jsonl",
        &lines,
        &redis.url(),
        &["--rejudge"],
    );
    assert_totals_equal(&redis_totals(&mut redis.connection()), &want, "");
    assert!(
        stderr.contains("re-judging an input this Redis already holds (20000 lines, replayed ")
            && stderr.contains("already counted in Redis (by an earlier run of this input"),
        "{stderr}"
    );
    assert!(!first.is_empty());

    // The same events through stdin under one --input-id count once too; stdin without one is a
    // new input each time, and the run says so.
    let again = RedisServer::start();
    let run = |id: Option<&str>, rejudge: bool| {
        let mut cmd = vigil();
        cmd.args([
            "replay",
            "--rules",
            "rules",
            "--input",
            "-",
            "--redis",
            &again.url(),
        ]);
        if let Some(id) = id {
            cmd.args(["--input-id", id]);
        }
        if rejudge {
            cmd.arg("--rejudge");
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all((lines.join("\n") + "\n").as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stderr).unwrap()
    };
    run(Some("batch-7"), false);
    run(Some("batch-7"), true);
    assert_totals_equal(&redis_totals(&mut again.connection()), &want, "");
    assert!(run(None, false).contains("without --input-id"));
}

/// A replay reading its events from a pipe, so a test can act between two parts of the input.
struct StreamingReplay {
    child: Child,
    stdin: Option<std::process::ChildStdin>,
    stdout: std::sync::mpsc::Receiver<String>,
    records: Vec<String>,
}

impl StreamingReplay {
    fn start(redis: &str) -> StreamingReplay {
        let mut child = vigil()
            .args([
                "replay",
                "--rules",
                "rules",
                "--input",
                "-",
                "--emit-allow",
                "--redis",
                redis,
                "--input-id",
                "stream",
                // Flushing as often as a worker among others: a fault lands between flushes
                // within the tests' short waits.
                "--redis-flush-interval",
                "50ms",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        StreamingReplay {
            stdin: child.stdin.take(),
            child,
            stdout: rx,
            records: Vec::new(),
        }
    }

    fn feed(&mut self, lines: &[String]) {
        let stdin = self.stdin.as_mut().unwrap();
        stdin
            .write_all((lines.join("\n") + "\n").as_bytes())
            .unwrap();
        stdin.flush().unwrap();
    }

    /// Waits until `n` records came out (output is buffered: a batch at a time).
    fn wait_records(&mut self, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.records.len() < n && Instant::now() < deadline {
            if let Ok(line) = self.stdout.recv_timeout(Duration::from_millis(50)) {
                self.records.push(line);
            }
        }
        self.records.len() >= n
    }

    /// Closes the input and waits for the end: (success, stderr).
    fn finish(mut self) -> (bool, String, Vec<String>) {
        drop(self.stdin.take());
        let mut stderr = String::new();
        use std::io::Read;
        self.child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .unwrap();
        let status = self.child.wait().unwrap();
        while let Ok(line) = self.stdout.recv_timeout(Duration::from_secs(1)) {
            self.records.push(line);
        }
        (status.success(), stderr, std::mem::take(&mut self.records))
    }
}

impl Drop for StreamingReplay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn redis_frozen_for_ten_seconds_mid_replay_costs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let lines = events(40_000, 23);
    let want = reference_totals(dir.path(), &lines);
    let redis = RedisServer::start();
    let mut replay = StreamingReplay::start(&redis.url());
    replay.feed(&lines[..20_000]);
    assert!(
        replay.wait_records(10_000, Duration::from_secs(60)),
        "the first half is decided"
    );
    redis.pause();
    let paused = Instant::now();
    replay.feed(&lines[20_000..30_000]);
    // While Redis answers nothing, the replay goes on (on local counts, marked degraded).
    assert!(
        replay.wait_records(28_000, Duration::from_secs(9)),
        "decisions go on while Redis is frozen ({} so far)",
        replay.records.len()
    );
    let frozen_for = paused.elapsed();
    std::thread::sleep(Duration::from_secs(10).saturating_sub(frozen_for));
    redis.resume();
    replay.feed(&lines[30_000..]);
    let (ok, stderr, records) = replay.finish();
    assert!(ok, "{stderr}");
    assert_eq!(records.len(), lines.len(), "a record per event");
    assert!(
        records.iter().any(|r| r.contains("\"degraded\":true")),
        "hits during the outage are marked degraded"
    );
    assert!(stderr.contains("redis: unavailable 1 times"), "{stderr}");
    // Everything counted locally was merged once when Redis came back.
    assert_totals_equal(&redis_totals(&mut redis.connection()), &want, "");
}

#[test]
fn redis_killed_and_restarted_from_its_append_only_file_mid_replay_ends_exact() {
    let dir = tempfile::tempdir().unwrap();
    let lines = events(40_000, 24);
    let want = reference_totals(dir.path(), &lines);
    let exact = memory_records(dir.path(), &lines);
    let data = tempfile::tempdir().unwrap();
    let mut redis = RedisServer::start_persistent(data.path());
    let mut replay = StreamingReplay::start(&redis.url());
    replay.feed(&lines[..20_000]);
    assert!(replay.wait_records(10_000, Duration::from_secs(60)));
    redis.restart();
    replay.feed(&lines[20_000..]);
    let (ok, stderr, records) = replay.finish();
    assert!(ok, "{stderr}");
    assert_eq!(records.len(), lines.len());
    assert_totals_equal(&redis_totals(&mut redis.connection()), &want, "");
    // Nothing was lost: no data loss was detected, and decisions made on Redis' view are exact.
    // (A restart between two flushes is only a reconnect: no outage line is printed at all.)
    assert!(
        !stderr.contains("lost its data") || stderr.contains("lost its data 0 times"),
        "{stderr}"
    );
    assert_hits_exact_unless_degraded(&records, &exact);
}

#[test]
fn redis_restarted_empty_or_flushed_mid_replay_is_written_again_from_local_views() {
    for flushall in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let lines = events(30_000, 25);
        let want = reference_totals(dir.path(), &lines);
        let mut redis = RedisServer::start();
        let mut replay = StreamingReplay::start(&redis.url());
        replay.feed(&lines[..15_000]);
        assert!(replay.wait_records(8_000, Duration::from_secs(60)));
        if flushall {
            let _: () = redis::cmd("FLUSHALL")
                .query(&mut redis.connection())
                .unwrap();
        } else {
            redis.restart();
        }
        replay.feed(&lines[15_000..]);
        let (ok, stderr, records) = replay.finish();
        assert!(ok, "{stderr}");
        assert_eq!(records.len(), lines.len());
        assert!(
            stderr.contains("lost its data 1 times"),
            "the loss is detected and reported: {stderr}"
        );
        // One process held a view of every key: writing them again restores every counter.
        assert_totals_equal(&redis_totals(&mut redis.connection()), &want, "");
    }
}

#[test]
fn a_cluster_master_killed_mid_replay_fails_over_and_ends_exact() {
    master_killed_mid_replay(HighAvailability::cluster(), false);
}

/// The lost-write case: writes the dying master acknowledged never reached the replica that
/// replaces it. No replica confirmed them, so they were kept, and are written again.
#[test]
fn a_cluster_master_killed_with_unreplicated_writes_ends_exact() {
    master_killed_mid_replay(HighAvailability::cluster(), true);
}

/// The same on a master and replica managed by Redis Sentinel, reached by `redis+sentinel://`.
#[test]
fn a_sentinel_managed_master_killed_with_unreplicated_writes_ends_exact() {
    master_killed_mid_replay(
        HighAvailability::Sentinel(support::RedisSentinels::start()),
        true,
    );
}

/// Redis with a replica to fail over to: a 3+3 Cluster (the victim: the master the URL names)
/// or a Sentinel-managed pair.
enum HighAvailability {
    Cluster {
        cluster: support::RedisCluster,
        victim: usize,
        replica: usize,
    },
    Sentinel(support::RedisSentinels),
}

impl HighAvailability {
    fn cluster() -> HighAvailability {
        let mut cluster = support::RedisCluster::start_with_replicas(1);
        let victim = cluster.masters()[0];
        let replica = cluster.replica_of(cluster.nodes[victim].port);
        HighAvailability::Cluster {
            cluster,
            victim,
            replica,
        }
    }

    fn url(&self) -> String {
        match self {
            // The master the replay's URL names dies: the store must find the cluster through
            // the other nodes it has seen.
            HighAvailability::Cluster {
                cluster, victim, ..
            } => cluster.nodes[*victim].url(),
            HighAvailability::Sentinel(sentinels) => sentinels.url(),
        }
    }

    fn victim(&mut self) -> &mut support::RedisServer {
        match self {
            HighAvailability::Cluster {
                cluster, victim, ..
            } => &mut cluster.nodes[*victim],
            HighAvailability::Sentinel(sentinels) => &mut sentinels.master,
        }
    }

    fn replica(&mut self) -> &mut support::RedisServer {
        match self {
            HighAvailability::Cluster {
                cluster, replica, ..
            } => &mut cluster.nodes[*replica],
            HighAvailability::Sentinel(sentinels) => &mut sentinels.replica,
        }
    }

    /// Once the failover is over: every counter in Redis.
    fn totals(&mut self) -> std::collections::BTreeMap<String, (i128, usize)> {
        match self {
            HighAvailability::Cluster { cluster, .. } => {
                cluster.wait_ok(Duration::from_secs(10));
                cluster.totals()
            }
            HighAvailability::Sentinel(sentinels) => {
                assert_eq!(
                    sentinels.master_port(),
                    sentinels.replica.port,
                    "the sentinels promoted the replica"
                );
                support::redis_totals(&mut sentinels.replica.connection())
            }
        }
    }
}

/// A replay whose master is SIGKILLed mid-run; with `lose_writes`, its replica is first cut
/// off so that writes the master acknowledged are surely missing on it.
fn master_killed_mid_replay(mut redis: HighAvailability, lose_writes: bool) {
    let dir = tempfile::tempdir().unwrap();
    let lines = events(40_000, 26);
    let want = reference_totals(dir.path(), &lines);
    let exact = memory_records(dir.path(), &lines);
    let mut replay = StreamingReplay::start(&redis.url());
    replay.feed(&lines[..20_000]);
    assert!(
        replay.wait_records(10_000, Duration::from_secs(60)),
        "the first half is decided"
    );
    let mut unreplicated = 0;
    if lose_writes {
        // The first half written behind in full before the cut: every write the replica then
        // misses comes after it, with no confirmation of the old link in between.
        assert!(replay.wait_records(20_000, Duration::from_secs(60)));
        wait_for_script_calls_to_stop(&mut redis.victim().connection());
        // The replica misses the master's last writes (replication is asynchronous; made sure
        // of here): frozen, its replication link cut by the master (what the master sent before
        // sits in the replica's socket buffer, so freezing alone loses nothing), the master
        // acknowledges flushes the replica never gets, then dies.
        redis.replica().pause();
        let cut = kill_clients(&mut redis.victim().connection(), "replica");
        assert_eq!(cut, 1, "the master's link to its replica is cut");
        // Looks at the master now name no replica (`ROLE`; a slot map once the cluster has
        // flagged the replica failed); the store's connections are cut too, so its first flush
        // after this reconnects and looks. A master that names no replica has nothing to
        // confirm, but this one's replica is only away, and a failover may still promote it:
        // the writes it lacks must still be kept.
        let cluster_replica = match &redis {
            HighAvailability::Cluster {
                cluster, replica, ..
            } => Some(cluster.nodes[*replica].port),
            HighAvailability::Sentinel(_) => None,
        };
        if let Some(replica_port) = cluster_replica {
            let deadline = Instant::now() + Duration::from_secs(20);
            while !support::cluster_flags_failed(&mut redis.victim().connection(), replica_port) {
                assert!(
                    Instant::now() < deadline,
                    "the cluster flags the frozen replica failed"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        kill_clients(&mut redis.victim().connection(), "normal");
        let cut_off = Instant::now();
        let before = support::evalsha_calls(&mut redis.victim().connection());
        replay.feed(&lines[20_000..24_000]);
        while support::evalsha_calls(&mut redis.victim().connection()) == before
            && cut_off.elapsed() < Duration::from_secs(1)
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(200));
        unreplicated = support::evalsha_calls(&mut redis.victim().connection()) - before;
        assert!(
            unreplicated > 0,
            "the master acknowledged flushes while its replica was frozen"
        );
    } else {
        replay.feed(&lines[20_000..24_000]);
    }
    redis.victim().kill();
    let killed = Instant::now();
    if lose_writes {
        redis.replica().resume();
    }
    let (stderr, records, promoted, first_flush) =
        finish_after_failover(&mut redis, replay, &lines[24_000..], killed);
    let finished = killed.elapsed();
    eprintln!(
        "master killed{}: replica promoted after {:.2} s, first flush on it after {:.2} s, replay done after {:.2} s",
        if lose_writes { format!(" ({unreplicated} script calls it acknowledged never reached its replica)") } else { String::new() },
        promoted.as_secs_f64(),
        first_flush.as_secs_f64(),
        finished.as_secs_f64()
    );
    eprintln!(
        "{}",
        stderr
            .lines()
            .filter(|l| l.contains("redis:"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(records.len(), lines.len(), "a record per event");
    // Writes the dead master acknowledged may be missing on the replica: what no replica
    // confirmed is written again to the new master.
    assert!(
        stderr.contains("followed 1 failovers"),
        "the failover is followed: {stderr}"
    );
    if lose_writes {
        assert!(
            !stderr.contains("; 0 observations no replica had confirmed"),
            "what the replica lacks was kept and written again: {stderr}"
        );
    }
    assert_totals_equal(&redis.totals(), &want, &stderr);
    assert_hits_exact_unless_degraded(&records, &exact);
}

/// After the master was killed at `killed` (its replica resumed, if frozen): feeds `rest` and
/// waits for the replay's end, which must succeed. Its stderr and records, and how long after
/// the kill the replica was promoted and served its first flush.
fn finish_after_failover(
    redis: &mut HighAvailability,
    mut replay: StreamingReplay,
    rest: &[String],
    killed: Instant,
) -> (String, Vec<String>, Duration, Duration) {
    let first_flush = support::first_flush_on(redis.replica().url(), killed);
    replay.feed(rest);
    let (ok, stderr, records) = replay.finish();
    assert!(ok, "{stderr}");
    let (promoted, first_flush) = first_flush
        .join()
        .unwrap()
        .expect("the promoted replica served a flush");
    (stderr, records, promoted, first_flush)
}

/// Waits until `node` has run no script for 1.5 s (at most 15 s): what was decided so far is
/// written behind in full.
fn wait_for_script_calls_to_stop(node: &mut redis::Connection) {
    let (mut calls, mut since, deadline) = (
        support::evalsha_calls(node),
        Instant::now(),
        Instant::now() + Duration::from_secs(15),
    );
    while since.elapsed() < Duration::from_millis(1500) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        let now = support::evalsha_calls(node);
        if now != calls {
            (calls, since) = (now, Instant::now());
        }
    }
}

/// A replay that starts while the replica is cut off from its master: the master's `ROLE`
/// names no replica, but the sentinels still list it, and a failover may promote it once it is
/// back. So the replay's writes are confirmed and kept as if the replica were there, and written
/// again to it when it is promoted.
#[test]
fn a_replay_started_while_the_sentinels_replica_is_cut_off_keeps_what_it_lacks() {
    replay_started_while_the_replica_is_cut_off(HighAvailability::Sentinel(
        support::RedisSentinels::start(),
    ));
}

/// The same on a Cluster, whose slot map leaves out a replica flagged failed.
#[test]
fn a_replay_started_while_a_cluster_replica_is_flagged_failed_keeps_what_it_lacks() {
    replay_started_while_the_replica_is_cut_off(HighAvailability::cluster());
}

/// An earlier replay writes to this Redis with the replica there (so the promoted replica
/// knows the store's epoch and the failover is not taken for a data loss, whose fallback would
/// write every local view again); then the replica is frozen and cut off, a replay starts and
/// writes to the master alone, and the master dies.
fn replay_started_while_the_replica_is_cut_off(mut redis: HighAvailability) {
    let dir = tempfile::tempdir().unwrap();
    let lines = events(22_000, 27);
    let want = reference_totals(dir.path(), &lines);
    replay_file(dir.path(), "earlier.jsonl", &lines[..2_000], &redis.url());
    let replicated: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(10_000)
        .query(&mut redis.victim().connection())
        .unwrap();
    assert_eq!(
        replicated, 1,
        "the earlier replay's writes are on the replica"
    );
    redis.replica().pause();
    let cut = kill_clients(&mut redis.victim().connection(), "replica");
    assert_eq!(cut, 1, "the master's link to its replica is cut");
    let role: Vec<redis::Value> = redis::cmd("ROLE")
        .query(&mut redis.victim().connection())
        .unwrap();
    assert_eq!(
        role.get(2),
        Some(&redis::Value::Array(Vec::new())),
        "the master names no replica"
    );
    if let HighAvailability::Cluster {
        cluster, replica, ..
    } = &redis
    {
        // Until then the slot map still names it.
        let (port, deadline) = (
            cluster.nodes[*replica].port,
            Instant::now() + Duration::from_secs(20),
        );
        while !support::cluster_flags_failed(&mut redis.victim().connection(), port) {
            assert!(
                Instant::now() < deadline,
                "the cluster flags the replica failed"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let before = support::evalsha_calls(&mut redis.victim().connection());
    let mut replay = StreamingReplay::start(&redis.url());
    replay.feed(&lines[2_000..12_000]);
    assert!(replay.wait_records(10_000, Duration::from_secs(60)));
    wait_for_script_calls_to_stop(&mut redis.victim().connection());
    let unreplicated = support::evalsha_calls(&mut redis.victim().connection()) - before;
    assert!(unreplicated > 0, "the replay wrote to the master alone");
    redis.victim().kill();
    let killed = Instant::now();
    redis.replica().resume();
    let (stderr, records, promoted, first_flush) =
        finish_after_failover(&mut redis, replay, &lines[12_000..], killed);
    eprintln!(
        "master killed ({unreplicated} script calls its replica never got): replica promoted after {:.2} s, first flush on it after {:.2} s",
        promoted.as_secs_f64(),
        first_flush.as_secs_f64(),
    );
    assert_eq!(records.len(), lines.len() - 2_000, "a record per event");
    assert!(
        stderr.contains("followed 1 failovers"),
        "the failover is followed: {stderr}"
    );
    assert!(
        !stderr.contains("; 0 observations no replica had confirmed"),
        "what the replica lacks was kept and written again: {stderr}"
    );
    assert_totals_equal(&redis.totals(), &want, &stderr);
}

/// `CLIENT KILL TYPE <kind>` (the caller's own connection is spared): how many were cut.
fn kill_clients(node: &mut redis::Connection, kind: &str) -> i64 {
    redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg(kind)
        .query(node)
        .unwrap()
}

/// Every record with a hit not marked degraded (decided on Redis' view) is one of the exact
/// decisions (`exact`: the in-process run's output).
fn assert_hits_exact_unless_degraded(records: &[String], exact: &str) {
    let exact: std::collections::HashSet<&str> = exact.lines().collect();
    let wrong: Vec<&String> = records
        .iter()
        .filter(|r| {
            r.contains("\"hits\":[{") && !r.contains("\"degraded\"") && !exact.contains(r.as_str())
        })
        .take(3)
        .collect();
    assert!(
        wrong.is_empty(),
        "records differ from the exact decisions: {wrong:?}"
    );
}

/// `redis-cli --cluster reshard` moves a third of the slots from one master to another (keys
/// migrated in small pipelines: while it runs, calls meet MOVED, ASK and TRYAGAIN) while a
/// replay counts into them: nothing lost, nothing doubled.
#[test]
fn a_live_reshard_mid_replay_loses_and_doubles_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let lines = events(60_000, 27);
    let want = reference_totals(dir.path(), &lines);
    let exact = memory_records(dir.path(), &lines);
    let mut cluster = support::RedisCluster::start();
    let mut replay = StreamingReplay::start(&cluster.url());
    replay.feed(&lines[..20_000]);
    assert!(
        replay.wait_records(10_000, Duration::from_secs(60)),
        "the first part is decided"
    );
    let masters = cluster.masters();
    let from = support::RedisCluster::node_id(&cluster.nodes[masters[0]]);
    let to = support::RedisCluster::node_id(&cluster.nodes[masters[1]]);
    let keys_before: i64 = redis::cmd("DBSIZE")
        .query(&mut cluster.nodes[masters[0]].connection())
        .unwrap();
    let seed = format!("127.0.0.1:{}", cluster.nodes[masters[0]].port);
    let started = Instant::now();
    let reshard = std::thread::spawn(move || {
        Command::new("redis-cli")
            .args([
                "--cluster",
                "reshard",
                &seed,
                "--cluster-from",
                &from,
                "--cluster-to",
                &to,
            ])
            .args([
                "--cluster-slots",
                "5000",
                "--cluster-pipeline",
                "10",
                "--cluster-yes",
            ])
            .stdout(std::process::Stdio::null())
            .output()
            .expect("redis-cli")
    });
    // The rest goes in while the slots move.
    for chunk in lines[20_000..].chunks(1_000) {
        replay.feed(chunk);
        std::thread::sleep(Duration::from_millis(100));
    }
    let output = reshard.join().unwrap();
    let resharded = started.elapsed();
    assert!(
        output.status.success(),
        "redis-cli --cluster reshard failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let (ok, stderr, records) = replay.finish();
    assert!(ok, "{stderr}");
    let keys_after: i64 = redis::cmd("DBSIZE")
        .query(&mut cluster.nodes[masters[0]].connection())
        .unwrap();
    eprintln!(
        "reshard of 5000 slots took {:.2} s (the source master held {keys_before} keys before, {keys_after} after)",
        resharded.as_secs_f64()
    );
    eprintln!(
        "{}",
        stderr
            .lines()
            .filter(|l| l.contains("redis:"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(records.len(), lines.len(), "a record per event");
    // The replay met the moving slots (redirected or retried calls), and still ends exact.
    let retries: u64 = stderr
        .lines()
        .find_map(|l| {
            l.strip_prefix("redis: ")
                .and_then(|l| l.split("), ").nth(1))
                .and_then(|l| l.split(' ').next())
        })
        .and_then(|n| n.parse().ok())
        .expect("the replay's Redis summary");
    assert!(retries > 0, "the replay ran while slots moved: {stderr}");
    assert_totals_equal(&cluster.totals(), &want, &stderr);
    assert_hits_exact_unless_degraded(&records, &exact);
}

/// Two replays of one input at once could each count what the other had not yet recorded: the
/// second is refused while the first runs, naming it; a replay killed with SIGKILL leaves a
/// claim that the next one on this host takes over at once (it never finished, so it is not
/// "already replayed" either), and the counts end exact.
#[test]
fn a_second_replay_of_an_input_being_replayed_is_refused_and_a_killed_ones_claim_is_taken_over() {
    let dir = tempfile::tempdir().unwrap();
    let lines = events(6_000, 23);
    let want = reference_totals(dir.path(), &lines);
    let redis = RedisServer::start();
    let second = |extra: &[&str]| {
        let input = dir.path().join("second.jsonl");
        std::fs::write(&input, lines.join("\n") + "\n").unwrap();
        replay_command(&input, &redis.url())
            .args(["--input-id", "stream"])
            .args(extra)
            .output()
            .unwrap()
    };

    let mut first = StreamingReplay::start(&redis.url());
    first.feed(&lines[..3_000]);
    assert!(
        first.wait_records(1, Duration::from_secs(60)),
        "the first replay judges"
    );
    let refused = second(&[]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(refused.stdout.is_empty());
    let stderr = String::from_utf8(refused.stderr).unwrap();
    let pid = first.child.id();
    assert!(
        stderr.contains(&format!(
            "another replay of this input is writing to this Redis (process {pid} on "
        )) && stderr.contains("two at once could count an event twice"),
        "{stderr}"
    );

    // Killed mid-run: its claim stays (its TTL has not passed), but its process is gone.
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    drop(first);
    let resumed = second(&[]);
    assert!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    assert_totals_equal(&redis_totals(&mut redis.connection()), &want, "");
    // Finished now: the next one is told the input is applied.
    let again = second(&[]);
    assert_eq!(again.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&again.stderr)
        .contains("this input was already replayed into this Redis (6000 lines"));
}
