//! `vigil bench --redis URL`: vigil's Redis store against the classic per-event approach on the
//! same Redis and the same events, plus Redis bytes per live key for each window layout.
//!
//! The Redis database must be empty (the benchmark owns it and empties it when done).

use std::fs::File;
use std::io::{self, BufRead, BufReader, Write};
use std::path::Path;
use std::time::Instant;

use crate::config::StoreSetup;
use crate::event::decode;
use crate::pipeline::{replay, Engine, ReplayError, ReplayOptions, Touched};
use crate::rules::RuleSet;
use crate::store::{push_hex, AnyStore, CounterStore, MemoryStore, RedisStore, StoreError};
use crate::window::{Aggregate, Delta, WindowSpec};

/// Commands in flight per pipeline for the per-event baselines: the same depth as the script
/// calls of one vigil flush.
const PIPELINE_DEPTH: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum RedisBenchError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Replay(#[from] ReplayError),
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error("the Redis database holds {0} keys: the benchmark needs an empty one it may flush")]
    NotEmpty(i64),
}

impl RedisBenchError {
    pub fn code(&self) -> &'static str {
        match self {
            RedisBenchError::Redis(_) => "redis",
            RedisBenchError::Store(e) => e.code(),
            RedisBenchError::Replay(e) => e.code(),
            RedisBenchError::Io(_) => "io",
            RedisBenchError::NotEmpty(_) => "not_empty",
        }
    }
}

/// One measured approach.
#[derive(Debug, Clone, Copy)]
pub struct Throughput {
    pub events: u64,
    pub seconds: f64,
    pub script_calls: u64,
    /// Every command sent to Redis: script calls plus plain reads.
    pub redis_calls: u64,
    pub redis_cpu_seconds: f64,
}

impl Throughput {
    pub fn events_per_second(&self) -> f64 {
        self.events as f64 / self.seconds.max(1e-9)
    }

    /// Redis CPU seconds per event (Redis is what the workers share).
    pub fn redis_cpu_per_event(&self) -> f64 {
        self.redis_cpu_seconds / self.events.max(1) as f64
    }
}

/// Redis CPU seconds so far (user + system), from `INFO cpu`.
fn redis_cpu(conn: &mut redis::Connection) -> Result<f64, RedisBenchError> {
    let info: String = redis::cmd("INFO").arg("cpu").query(conn)?;
    Ok(info
        .lines()
        .filter_map(|l| {
            l.strip_prefix("used_cpu_user:")
                .or_else(|| l.strip_prefix("used_cpu_sys:"))
        })
        .filter_map(|v| v.trim().parse::<f64>().ok())
        .sum())
}

fn flushdb(conn: &mut redis::Connection) -> Result<(), RedisBenchError> {
    redis::cmd("FLUSHDB").query::<()>(conn)?;
    Ok(())
}

/// vigil's Redis store at `url` with the built-in defaults, opened as every command opens it.
fn open_store(url: &str) -> Result<RedisStore, RedisBenchError> {
    match StoreSetup::redis_at(url).open()?.0 {
        AnyStore::Redis(store) => Ok(*store),
        AnyStore::Memory(_) => unreachable!("a setup with a Redis URL opens the Redis store"),
    }
}

/// vigil: replay with the Redis store (write-behind, batched script calls).
pub fn vigil(url: &str, rules: &RuleSet, input: &Path) -> Result<Throughput, RedisBenchError> {
    let mut conn = redis::Client::open(url)?.get_connection()?;
    let cpu_before = redis_cpu(&mut conn)?;
    let store = open_store(url)?;
    let mut engine = Engine::new(rules.clone(), store);
    let reader = BufReader::with_capacity(1 << 16, File::open(input)?);
    let summary = replay(
        &mut engine,
        reader,
        io::sink(),
        io::sink(),
        ReplayOptions::default(),
    )?;
    Ok(Throughput {
        events: summary.counts.events,
        seconds: summary.elapsed.as_secs_f64(),
        script_calls: engine.store().stats().script_calls,
        redis_calls: engine.store().stats().script_calls + engine.store().stats().loads,
        redis_cpu_seconds: redis_cpu(&mut conn)? - cpu_before,
    })
}

/// Which per-event script to drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PerEvent {
    /// One ZSET member per event: ZREMRANGEBYSCORE, ZADD, ZCARD, PEXPIRE.
    Zset,
    /// Hash buckets read and pruned on every event: HGETALL, HDEL, HINCRBY, PEXPIRE.
    Hash,
    /// A ring of buckets with a running total: only the buckets the window slid past are read
    /// and deleted (the strongest per-event script we know; same arguments as `Hash`).
    Ring,
}

impl PerEvent {
    /// The script's source (`lua/bench/`).
    pub fn script(self) -> &'static str {
        match self {
            PerEvent::Zset => include_str!("../../lua/bench/per_event_zset.lua"),
            PerEvent::Hash => include_str!("../../lua/bench/per_event_hash.lua"),
            PerEvent::Ring => include_str!("../../lua/bench/per_event_ring.lua"),
        }
    }

    /// Its row in the report.
    pub fn row(self) -> &'static str {
        match self {
            PerEvent::Zset => "per-event zset script",
            PerEvent::Hash => "per-event hash script",
            PerEvent::Ring => "per-event ring",
        }
    }
}

/// The per-event approach: one EVALSHA per event per matching rule, pipelined.
pub fn per_event(
    url: &str,
    rules: &RuleSet,
    input: &Path,
    kind: PerEvent,
) -> Result<Throughput, RedisBenchError> {
    let script = redis::Script::new(kind.script());
    let mut conn = redis::Client::open(url)?.get_connection()?;
    script.prepare_invoke().load(&mut conn)?;
    let cpu_before = redis_cpu(&mut conn)?;
    // The engine only plans here (which rule, which key); the store is never used.
    let mut planner = Engine::new(rules.clone(), MemoryStore::new());
    let specs: Vec<WindowSpec> = rules
        .active_counters()
        .map(|i| rules.counter(i).window)
        .collect();
    let started = Instant::now();
    let (mut events, mut calls) = (0u64, 0u64);
    let mut pipe = redis::pipe();
    let mut in_pipe = 0;
    let mut touched = Touched::default();
    let mut line = Vec::new();
    let mut reader = BufReader::with_capacity(1 << 16, File::open(input)?);
    while reader.read_until(b'\n', &mut line)? > 0 {
        if let Ok(event) = decode(
            line.strip_suffix(b"\n").unwrap_or(&line),
            rules.projection(),
        ) {
            events += 1;
            touched.clear();
            planner.touched_keys(&event, &mut touched);
            for (window, key) in touched.keys() {
                let spec = specs[window.0 as usize];
                let mut name = format!("pe:{}:", window.0);
                push_hex(&mut name, &blake3::hash(key).as_bytes()[..16]);
                let mut inv = script.key(name);
                match kind {
                    PerEvent::Zset => inv.arg(event.ts).arg(spec.window_ms()).arg(events),
                    PerEvent::Hash | PerEvent::Ring => inv
                        .arg(spec.bucket_of(event.ts))
                        .arg(spec.buckets)
                        .arg(2 * spec.window_ms()),
                };
                pipe.invoke_script(&inv);
                in_pipe += 1;
                if in_pipe == PIPELINE_DEPTH {
                    pipe.query::<()>(&mut conn)?;
                    calls += in_pipe as u64;
                    pipe = redis::pipe();
                    in_pipe = 0;
                }
            }
        }
        line.clear();
    }
    if in_pipe > 0 {
        pipe.query::<()>(&mut conn)?;
        calls += in_pipe as u64;
    }
    Ok(Throughput {
        events,
        seconds: started.elapsed().as_secs_f64(),
        script_calls: calls,
        redis_calls: calls,
        redis_cpu_seconds: redis_cpu(&mut conn)? - cpu_before,
    })
}

/// Average `MEMORY USAGE` of the keys matching `pattern`.
fn memory_per_key(conn: &mut redis::Connection, pattern: &str) -> Result<f64, RedisBenchError> {
    let keys: Vec<String> = redis::cmd("KEYS").arg(pattern).query(conn)?;
    let mut total = 0u64;
    for key in &keys {
        let bytes: Option<u64> = redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(key)
            .arg("SAMPLES")
            .arg(0)
            .query(conn)?;
        total += bytes.unwrap_or(0);
    }
    Ok(total as f64 / keys.len().max(1) as f64)
}

/// Bytes per live key for one window layout, vigil's hash vs one ZSET member per event.
#[derive(Debug, Clone)]
pub struct MemoryRow {
    pub layout: &'static str,
    pub vigil_bytes: f64,
    pub zset_bytes: f64,
}

/// Writes `events_per_window` events into each of `keys` keys for four layouts and measures
/// Redis bytes per key.
pub fn memory(
    url: &str,
    keys: u64,
    events_per_window: i64,
) -> Result<Vec<MemoryRow>, RedisBenchError> {
    let layouts: [(&str, WindowSpec); 4] = [
        (
            "count, 10 buckets (10m/1m)",
            WindowSpec::new(60_000, 10, Aggregate::Count),
        ),
        (
            "count, 60 buckets (1h/1m)",
            WindowSpec::new(60_000, 60, Aggregate::Count),
        ),
        (
            "sum, 60 buckets (1h/1m)",
            WindowSpec::new(60_000, 60, Aggregate::Sum),
        ),
        (
            "distinct, 60 buckets, 10 values",
            WindowSpec::new(60_000, 60, Aggregate::Distinct),
        ),
    ];
    let mut conn = redis::Client::open(url)?.get_connection()?;
    let mut rows = Vec::new();
    for (n, (layout, spec)) in layouts.into_iter().enumerate() {
        let name = format!("mem{n}");
        let mut store = open_store(url)?;
        let window = store.open_window(&name, spec);
        let step = spec.window_ms() / events_per_window;
        let mut pipe = redis::pipe();
        for key in 0..keys {
            for i in 0..events_per_window {
                let ts = 1_700_000_000_000 + i * step;
                let delta = match spec.aggregate {
                    Aggregate::Count => Delta::Count,
                    Aggregate::Sum => Delta::Sum((i * 37) % 5000 * 10_000),
                    Aggregate::Distinct => {
                        Delta::Distinct(u128::from((i % 10) as u64) << 64 | u128::from(key))
                    }
                    Aggregate::Max | Aggregate::Min => Delta::Extreme((i * 37) % 5000 * 10_000),
                    Aggregate::Last => Delta::Last,
                };
                store.apply(window, &key.to_le_bytes(), ts, delta)?;
                store.tick()?;
                let member = format!("e-{}-{i}", key * 1000);
                pipe.cmd("ZADD")
                    .arg(format!("mz:{n}:{key}"))
                    .arg(ts)
                    .arg(member)
                    .ignore();
            }
            pipe.query::<()>(&mut conn)?;
            pipe = redis::pipe();
        }
        store.flush()?;
        rows.push(MemoryRow {
            layout,
            vigil_bytes: memory_per_key(&mut conn, &format!("vg:{name}:*"))?,
            zset_bytes: memory_per_key(&mut conn, &format!("mz:{n}:*"))?,
        });
    }
    Ok(rows)
}

/// Runs every measurement on an empty Redis database and prints a report.
pub fn run(
    url: &str,
    rules: &RuleSet,
    input: &Path,
    out: &mut impl Write,
) -> Result<(), RedisBenchError> {
    let mut conn = redis::Client::open(url)?.get_connection()?;
    let keys: i64 = redis::cmd("DBSIZE").query(&mut conn)?;
    if keys > 0 {
        return Err(RedisBenchError::NotEmpty(keys));
    }
    let rows = memory(url, 1_000, 100)?;
    flushdb(&mut conn)?;
    writeln!(
        out,
        "redis memory per live key, 100 events per window (MEMORY USAGE, 1000 keys each)"
    )?;
    for row in &rows {
        writeln!(
            out,
            "  {:<34} vigil {:>7.0} B   zset {:>7.0} B   vigil/zset {:.3}",
            row.layout,
            row.vigil_bytes,
            row.zset_bytes,
            row.vigil_bytes / row.zset_bytes
        )?;
    }
    let mut results = vec![("vigil (write-behind)", vigil(url, rules, input)?)];
    for kind in [PerEvent::Zset, PerEvent::Hash, PerEvent::Ring] {
        flushdb(&mut conn)?;
        results.push((kind.row(), per_event(url, rules, input, kind)?));
    }
    flushdb(&mut conn)?;
    writeln!(
        out,
        "throughput on the same Redis, {} events, pipeline depth {PIPELINE_DEPTH}",
        results[0].1.events
    )?;
    for (name, t) in &results {
        writeln!(
            out,
            "  {name:<24} {:>9.0} events/s   {:.4} script calls/event   {:.4} redis calls/event   redis cpu {:.1}s ({:.1} µs/event)   wall {:.1}s",
            t.events_per_second(),
            t.script_calls as f64 / t.events.max(1) as f64,
            t.redis_calls as f64 / t.events.max(1) as f64,
            t.redis_cpu_seconds,
            t.redis_cpu_per_event() * 1e6,
            t.seconds
        )?;
    }
    let vigil_eps = results[0].1.events_per_second();
    for (name, t) in &results[1..] {
        writeln!(
            out,
            "  vigil / {name}: {:.2}x",
            vigil_eps / t.events_per_second()
        )?;
    }
    // The targets are against the fastest per-event row, whichever it is on this machine.
    if let Some((name, fastest)) = results[1..]
        .iter()
        .max_by(|a, b| a.1.events_per_second().total_cmp(&b.1.events_per_second()))
    {
        writeln!(
            out,
            "  vigil / fastest per-event ({name}): {:.2}x",
            vigil_eps / fastest.events_per_second()
        )?;
        // Redis CPU per event, the other half of the comparison.
        if fastest.redis_cpu_per_event() > 0.0 {
            writeln!(
                out,
                "  vigil's redis cpu per event / fastest per-event's: {:.2}",
                results[0].1.redis_cpu_per_event() / fastest.redis_cpu_per_event()
            )?;
        }
    }
    Ok(())
}
