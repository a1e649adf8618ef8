//! The Redis store: per key, the last window read from Redis merged with this
//! process's deltas since; deltas written behind by a flusher thread in batched script calls
//! (`lua/apply_window.lua`, up to 32 keys per call and one call per round trip, so that Redis
//! serves the partitions' reads between them; one hash slot per call on a Redis Cluster).
//!
//! Layout: a window's keys are hashes of their own, or (counters over the same dimensions, but
//! `distinct` ones) sections of one hash per key the counters share, so one read serves them all
//! (`view::Layout`).
//!
//! Exactness: a single process sees exactly what the in-memory store sees. Counts are integers;
//! sums are exact 64-bit integers of micro-units (the script adds them in two exact limbs);
//! distinct values keep their latest bucket. When a flush is acknowledged, the key's state becomes
//! the window the script returned (which also holds other workers' deltas) plus the deltas
//! counted since the flush was sent.
//!
//! Cost: windows are loaded with plain pipelined HGETALLs. A flush for a key whose Redis version
//! is still the one this view is based on (the common case: nobody else wrote it) sends the
//! key's new fields, not its deltas, and the script only checks the version and writes them;
//! otherwise the deltas are sent and merged field by field.
//!
//! Exactly-once counting: observations carry their input position ([`InputPosition`]); each key records
//! the highest offset applied per lane, and an observation at or below it is judged, not counted.
//! So a flush sent again (its reply was lost, it timed out) or an input read again (after a
//! crash, or replayed a second time) counts each observation once.
//!
//! Outages: every Redis call has connect and response timeouts and a bounded number of attempts.
//! When one fails, the store stops calling Redis on the counting path (the circuit breaker opens)
//! and counts locally: a key it has no view of starts empty. Those values are *degraded* (other
//! workers' counts are missing). The flusher keeps trying (every `probe_interval`); when Redis
//! answers, the local deltas are merged exactly once (they are tagged with their positions) and
//! the keys' windows come back with the replies. Nothing counted is dropped: keys with deltas are
//! never evicted, and the caller is told when they outgrow `max_local_keys`.
//!
//! Data loss: Redis holds an epoch key (per master on a cluster). Every flush first checks it;
//! when it has vanished or changed (a restart without persistence, FLUSHALL), or the cluster's
//! slot map named a new master (a failover: the promoted replica may lack the last writes the
//! old master acknowledged), the flush's scripts are not taken in and every key this process
//! holds a view of is written again from that view. A key written at a version this process
//! knew that is gone is written again from the view too (the script answers `?`).
//!
//! Files, by role: `config` (tuning and stats), `view` (the merged per-key view and counting on
//! it), `holds` (hold views, and their reads before a batch takes the engine), `batches` (batches
//! being journaled: what they counted is held back from flushes), `epochs`
//! (data-loss detection), `reader` (the reader thread), `early` (window reads a partition loop
//! makes before its batch takes the engine, and replay while the batch before is judged),
//! `ahead` (counting ahead on keys other workers count too), `failover` (writes no replica
//! confirmed), `flusher` (the flusher thread: batching, sending, completing, durable marks),
//! `slices` (work spread over ticks: building a flush, taking in its keys, moving windows to the
//! cache). This file holds the store itself, connecting, the circuit breaker, the local-state
//! measurement and the [`CounterStore`] entry points.

mod ahead;
mod batches;
mod config;
mod early;
mod epochs;
mod failover;
mod flusher;
mod holds;
mod reader;
mod slices;
mod view;

use std::time::{Duration, Instant};

use redis::Value;

pub use config::{FlushSample, RedisStats, RedisStoreConfig};
pub use early::{EarlyReader, EarlyReads, EarlyReplies, PendingRead};
pub use holds::EarlyHoldReads;

use super::counter_store::{
    BatchSeal, CounterStore, Deferred, HoldSpace, HoldSpaces, InputPosition, Inspected, Observed,
    Planned, StateStats, StoreError, WindowId, Windows,
};
use super::keys::{KeyRef, StoredKey};
use super::link::{unavailable, Batch, Link, SentinelTarget, Target, Timeouts, Topology};
use crate::clock::{MonotonicClock, SystemMonotonic};
use crate::window::{Delta, WindowSpec};
use epochs::Epochs;
use flusher::Flushing;
use holds::HoldViews;
use reader::Reads;
use view::Views;

/// The Redis store. `C` is the clock that tells whether a hold view is still fresh and whether a
/// key's TTL refresh is due (the real monotonic clock except in tests); flushes, probes and the
/// waits for Redis go by real time.
pub struct RedisStore<C: MonotonicClock = SystemMonotonic> {
    config: RedisStoreConfig,
    windows: Windows,
    /// By window: where its keys live in Redis.
    layouts: Vec<view::Layout>,
    hold_spaces: HoldSpaces,
    /// Cluster mode: script calls hold keys of one slot only.
    cluster: bool,
    stats: RedisStats,
    /// The origin `apply` tags observations with.
    origin: Option<InputPosition>,
    /// Observations counted so far (`CounterStore::counted_mark`).
    counted: u64,
    /// Every observation up to this mark is in Redis (`CounterStore::durable_mark`).
    durable: u64,
    /// Observations counted and not yet sent.
    pending: usize,
    /// Windows: keys with unacknowledged deltas, and the read cache.
    views: Views,
    /// Holds read or raised recently.
    holds: HoldViews,
    /// Batches begun whose records are not journaled yet: what they counted is held back.
    batches: batches::OpenBatches,
    /// The flusher thread, the flush in flight and what acknowledged flushes left to report.
    flushing: Flushing,
    /// The reader thread.
    reads: Reads,
    /// The epoch keys, and when a flush last checked them.
    epochs: Epochs,
    /// Deltas Redis acknowledged that no replica has confirmed: written again after a failover.
    unconfirmed: failover::Unconfirmed,
    /// Where the links connect: tells the failovers any of them has seen.
    target: Target,
    /// Reads a partition loop makes before its batch takes the engine (opened when first asked).
    early: Option<EarlyReader>,
    /// Its own for holds read ahead (`holds.rs`).
    early_holds: Option<EarlyReader>,
    /// The next batch's windows, being read while this one is counted (replay).
    read_ahead: Option<(EarlyReads, PendingRead)>,
    breaker: Breaker,
    clock: C,
    /// Estimated bytes of the local state.
    local_bytes: LocalBytes,
}

/// Estimated bytes of the local state. The clean views beside the cache keep their own tally
/// (`view::Tallied`); the windows with unacknowledged deltas are measured by a pass over them now
/// and then (`RedisStore::measure_local_bytes`), spread over ticks: keeping a byte count exact at
/// every change would cost the counting path, and those windows only grow past a flush's worth
/// while Redis is away.
#[derive(Default)]
struct LocalBytes {
    /// Windows with deltas Redis has not acknowledged.
    dirty: usize,
    /// Clean windows and hold views.
    clean: usize,
    /// When (by the store's clock) the last pass ended.
    measured: Option<Instant>,
    /// Until the next pass: 50 times what the last one took, at least `MIN_EVERY` (the passes
    /// cost at most 2 % of the time).
    every: Duration,
    /// The pass under way, if one is.
    pass: Option<DirtyPass>,
    /// The most windows with unacknowledged deltas lately: the largest count a pass began
    /// with, losing 1/32 at each pass (a pass every 100 ms at least).
    dirty_peak: usize,
}

impl LocalBytes {
    const MIN_EVERY: Duration = Duration::from_millis(100);
    /// Windows a pass visits at most: beyond, the mean over these (the first in the table's
    /// order, which follows a seeded hash, not the keys) stands for the rest.
    const SAMPLE: usize = 1 << 14;
    /// Windows visited between two looks at the clock.
    const CHUNK: usize = 64;
}

/// A pass over the windows with unacknowledged deltas, a slice per tick. The table may change
/// between slices; what the pass saw is a sample of it, scaled to its size when the pass ends.
#[derive(Default)]
struct DirtyPass {
    /// Windows visited (the table's first ones, in its order).
    seen: usize,
    /// Their heap bytes.
    owned: usize,
    /// The time the slices took.
    spent: Duration,
}

/// The circuit breaker: open while Redis is unavailable (the store counts locally).
#[derive(Default)]
struct Breaker {
    /// Since when Redis has been unavailable (the circuit breaker is open), and why.
    outage: Option<(Instant, String)>,
    /// Why Redis was first taken as unavailable (for a replay's summary).
    first_outage: Option<String>,
}

impl Breaker {
    #[inline]
    fn is_open(&self) -> bool {
        self.outage.is_some()
    }
}

/// Where `url` points: one server, a master found through Redis Sentinel (`redis+sentinel://`),
/// or a Redis Cluster (found from a node with cluster mode on), and
/// for a cluster the first slot each master serves.
/// Timeouts of a connection that asks no replica to confirm its writes: the side tasks', and
/// the one that checks a Sentinel target at start.
pub(super) fn side_timeouts(config: &RedisStoreConfig) -> Timeouts {
    Timeouts {
        connect: config.connect_timeout,
        response: config.response_timeout,
        replica_ack: None,
    }
}

/// A connection of its own to the Redis at `url` for a side task (the decision journal, the
/// progress board, a replay's claim), and whether the target is a cluster.
pub(in crate::store) fn open_side_link(
    url: &str,
    config: &RedisStoreConfig,
) -> Result<(Link, bool), StoreError> {
    let (target, cluster, _) = open_target(url, config)?;
    let link = Link::open(target, side_timeouts(config), config.retry_backoff)?;
    Ok((link, cluster))
}

pub(super) fn open_target(
    url: &str,
    config: &RedisStoreConfig,
) -> Result<(Target, bool, Vec<u16>), StoreError> {
    // rustls needs a process-wide crypto provider; a second install attempt is harmless.
    let _ = rustls::crypto::ring::default_provider().install_default();
    if let Some(sentinel) = SentinelUrl::parse(url)? {
        let seed = client_for(&sentinel.seed_url, config)?;
        let target = SentinelTarget {
            sentinels: sentinel.sentinels,
            service: sentinel.service,
            seed,
            master: std::sync::Mutex::new((None, 0)),
            answered: Default::default(),
        };
        let timeouts = side_timeouts(config);
        // Fails here, naming the reason, when no sentinel answers or none names a master.
        target.connect(timeouts).map_err(unavailable)?;
        return Ok((
            Target::Sentinel(std::sync::Arc::new(target)),
            false,
            Vec::new(),
        ));
    }
    let client = client_for(url, config)?;
    let mut probe = client
        .get_connection_with_timeout(config.connect_timeout)
        .map_err(unavailable)?;
    probe
        .set_read_timeout(Some(config.response_timeout))
        .map_err(unavailable)?;
    let info: String = redis::cmd("INFO")
        .arg("cluster")
        .query(&mut probe)
        .map_err(unavailable)?;
    if !info.lines().any(|l| l.trim() == "cluster_enabled:1") {
        return Ok((Target::Single(client), false, Vec::new()));
    }
    let ranges: Vec<Value> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query(&mut probe)
        .map_err(unavailable)?;
    let mut first_slots: Vec<u16> = ranges
        .iter()
        .filter_map(|range| match range {
            Value::Array(items) => redis::from_redis_value::<u16>(items.first()?.clone()).ok(),
            _ => None,
        })
        .collect();
    first_slots.sort_unstable();
    // The URL's node is where the store first asks for the slot map; every node a map names is
    // added as it is read (`link`), so the URL's node may die later.
    let (host, port) = match client.get_connection_info().addr() {
        redis::ConnectionAddr::Tcp(host, port)
        | redis::ConnectionAddr::TcpTls { host, port, .. } => (host.clone(), *port),
        other => {
            return Err(StoreError::Unavailable(format!(
                "a Redis Cluster needs a TCP address, not {other}"
            )))
        }
    };
    let topology = std::sync::Arc::new(std::sync::Mutex::new(Topology::new(host, port)));
    Ok((
        Target::Cluster {
            seed: client,
            topology,
        },
        true,
        first_slots,
    ))
}

/// A `redis+sentinel://` URL: the sentinels, the master's name, and a plain URL with the data
/// nodes' credentials, database and TLS choice (at the first sentinel's address: the master's
/// is asked of the sentinels on every connection).
#[derive(Debug, PartialEq)]
struct SentinelUrl {
    sentinels: Vec<(String, u16)>,
    service: String,
    seed_url: String,
}

impl SentinelUrl {
    /// `redis+sentinel://[user:password@]host[:port][,host[:port]…]/master-name[/db]`
    /// (`rediss+sentinel://` for TLS to the sentinels and the master; port 26379 by default).
    /// `None`: not a Sentinel URL.
    fn parse(url: &str) -> Result<Option<SentinelUrl>, StoreError> {
        let (scheme, rest) = match url.split_once("://") {
            Some(("redis+sentinel", rest)) => ("redis", rest),
            Some(("rediss+sentinel", rest)) => ("rediss", rest),
            _ => return Ok(None),
        };
        let bad = |why: &str| {
            StoreError::Unavailable(format!("invalid Sentinel URL ({why}): expected {scheme}+sentinel://[user:password@]host[:port][,host[:port]...]/master-name[/db]"))
        };
        let (authority, path) = rest.split_once('/').ok_or_else(|| bad("no master name"))?;
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => (Some(userinfo), hosts),
            None => (None, authority),
        };
        let mut sentinels = Vec::new();
        for host in hosts.split(',') {
            let (name, port) = match host.rsplit_once(':') {
                Some((name, port)) => (
                    name,
                    port.parse::<u16>()
                        .map_err(|_| bad("a port is not a number"))?,
                ),
                None => (host, 26379),
            };
            if name.is_empty() {
                return Err(bad("a sentinel has no host"));
            }
            sentinels.push((name.to_owned(), port));
        }
        let mut segments = path.trim_end_matches('/').split('/');
        let service = segments
            .next()
            .filter(|s| !s.is_empty())
            .ok_or_else(|| bad("no master name"))?
            .to_owned();
        let db = match segments.next() {
            Some(db) => db
                .parse::<i64>()
                .map_err(|_| bad("the database is not a number"))?,
            None => 0,
        };
        if segments.next().is_some() {
            return Err(bad("more path than master name and database"));
        }
        let (host, port) = &sentinels[0];
        let credentials = userinfo.map(|u| format!("{u}@")).unwrap_or_default();
        let seed_url = format!("{scheme}://{credentials}{host}:{port}/{db}");
        Ok(Some(SentinelUrl {
            sentinels,
            service,
            seed_url,
        }))
    }
}

/// A client for a plain `redis://` or `rediss://` URL, trusting `tls_ca_file` if set.
fn client_for(url: &str, config: &RedisStoreConfig) -> Result<redis::Client, StoreError> {
    match &config.tls_ca_file {
        Some(path) => {
            let root_cert = std::fs::read(path).map_err(|e| {
                StoreError::Unavailable(format!("cannot read CA file {}: {e}", path.display()))
            })?;
            let certs = redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(root_cert),
            };
            redis::Client::build_with_tls(url, certs).map_err(unavailable)
        }
        None => redis::Client::open(url).map_err(unavailable),
    }
}

impl RedisStore {
    /// Connects to `url` (`redis://`, `redis://user:pass@host`, `rediss://`).
    pub fn connect(url: &str, config: RedisStoreConfig) -> Result<RedisStore, StoreError> {
        RedisStore::connect_with_clock(url, config, SystemMonotonic)
    }
}

/// The first `maxmemory-policy` other than `noeviction` among `INFO memory` replies (one per
/// master); a reply that does not tell (a proxy that hides `INFO`) is taken as telling nothing.
fn evicting_policy(replies: &[redis::Value]) -> Option<String> {
    replies.iter().find_map(|reply| {
        let text: String = redis::from_redis_value(reply.clone()).ok()?;
        let policy = text
            .lines()
            .find_map(|line| line.strip_prefix("maxmemory_policy:"))?
            .trim();
        (policy != "noeviction").then(|| policy.to_owned())
    })
}

impl<C: MonotonicClock> RedisStore<C> {
    /// Measures the local state's bytes again, a slice per tick, if the last pass is old enough
    /// (see [`LocalBytes`]).
    fn measure_local_bytes(&mut self) {
        let now = self.clock.now();
        let due = self
            .local_bytes
            .measured
            .is_none_or(|at| now.duration_since(at) >= self.local_bytes.every);
        let mut pass = match self.local_bytes.pass.take() {
            Some(pass) => pass,
            None if due => {
                let dirty = &mut self.views.dirty;
                let peak = &mut self.local_bytes.dirty_peak;
                *peak = dirty.len().max(*peak - *peak / 32);
                // A table that held an outage's keys keeps its allocation once they are
                // flushed: give most of it back, so that an emptied table does not stay counted
                // against the bound. Not what the last flush emptied, though: its keys come
                // back within the next interval, and growing the table again (rehashing, and
                // first touching fresh pages) took ~5 % of a replay's samples when it shrank to
                // its emptiest each second. Nor as soon as the peak has fallen a little: a
                // shrink moves the table into a new one whose pages the kernel zeroes as they
                // are first touched, under the engine lock. Shrinking at a quarter, as the peak
                // decayed after a backlog, stalled every partition for 64-365 ms at a time (the
                // views inline, 280 bytes a slot); at a sixteenth it happens a few times as
                // rarely, into a table at most an eighth of the old one, and an empty slot
                // left counted meanwhile weighs 48 bytes (the views boxed).
                if dirty.capacity() > 1024 && *peak < dirty.capacity() / 16 {
                    dirty.shrink_to(*peak * 2);
                }
                DirtyPass::default()
            }
            None => return,
        };
        let started = Instant::now();
        let wanted = self.views.dirty.len().min(LocalBytes::SAMPLE);
        // The windows a slice before visited are passed over without being read.
        let mut windows = self.views.dirty.iter().skip(pass.seen);
        let mut ended = false;
        while !ended {
            for _ in 0..LocalBytes::CHUNK {
                match windows.next().filter(|_| pass.seen < wanted) {
                    Some((key, dirty)) => {
                        pass.owned += view::dirty_heap_bytes(key, dirty);
                        pass.seen += 1;
                    }
                    None => {
                        ended = true;
                        break;
                    }
                }
            }
            if started.elapsed() >= self.config.tick_budget {
                break;
            }
        }
        pass.spent += started.elapsed();
        if !ended {
            self.local_bytes.pass = Some(pass);
            return;
        }
        let finishing = Instant::now();
        let dirty = &self.views.dirty;
        // The table's slots (an entry and a control byte each), then what each entry owns.
        let entries = dirty.capacity() * (size_of::<(StoredKey, Box<view::Dirty>)>() + 1);
        let owned = match pass.seen {
            0 => 0,
            seen => pass.owned.saturating_mul(dirty.len()) / seen,
        };
        let holds = self.holds.views.capacity() * (size_of::<(StoredKey, holds::HoldView)>() + 1)
            + self
                .holds
                .views
                .keys()
                .map(|key| key.key.heap_bytes())
                .sum::<usize>();
        self.local_bytes = LocalBytes {
            dirty: entries + owned,
            clean: self.views.cache.bytes() + holds,
            measured: Some(now),
            every: (pass.spent + finishing.elapsed())
                .saturating_mul(50)
                .max(LocalBytes::MIN_EVERY),
            pass: None,
            dirty_peak: self.local_bytes.dirty_peak,
        };
    }

    /// Connects to `url` with `clock` telling when hold views and TTL refreshes grow stale.
    pub fn connect_with_clock(
        url: &str,
        config: RedisStoreConfig,
        clock: C,
    ) -> Result<RedisStore<C>, StoreError> {
        let (target, cluster, first_slots) = open_target(url, &config)?;
        let timeouts = Timeouts {
            connect: config.connect_timeout,
            response: config.response_timeout,
            replica_ack: config.replica_ack_timeout,
        };
        let mut link = Link::open(target.clone(), timeouts, config.retry_backoff)?;
        let flusher_link = Link::open(target.clone(), timeouts, config.retry_backoff)?;
        let mut epochs = Epochs::new(cluster, first_slots);
        let mut batch = Batch::default();
        epochs.add_checks(&mut batch, cluster);
        let checks = batch.calls.len();
        epochs.add_policy_checks(&mut batch, cluster);
        let (replies, _) = link.query(&batch, config.attempts);
        let replies = replies?;
        epochs.check(&replies[..checks.min(replies.len())])?;
        let evicting = evicting_policy(replies.get(checks..).unwrap_or_default());
        let eviction_allowed = match evicting {
            Some(policy) if !config.allow_eviction => {
                return Err(StoreError::Unsafe(format!(
                    "Redis has maxmemory-policy {policy}: it may evict counter keys, and every count they held would be lost \
                     without a trace; set maxmemory-policy noeviction (or, knowingly, allow eviction: redis.allow_eviction, \
                     --redis-allow-eviction)"
                )));
            }
            Some(policy) => {
                tracing::warn!(policy, "Redis may evict counter keys (maxmemory-policy); allowed by the configuration: counts may be lost silently");
                true
            }
            None => false,
        };
        let flushing = Flushing::start(flusher_link)?;
        let reads = Reads::start(link)?;
        // The check just made counts as the last one.
        epochs.last_check = Instant::now();
        Ok(RedisStore {
            windows: Windows::default(),
            layouts: Vec::new(),
            hold_spaces: HoldSpaces::default(),
            cluster,
            stats: RedisStats {
                eviction_allowed,
                ..RedisStats::default()
            },
            origin: None,
            counted: 0,
            durable: 0,
            pending: 0,
            views: Views::new(
                config.cache_capacity,
                (config.max_state_bytes / 2) as u64,
                config.cache_time_to_idle,
            ),
            holds: HoldViews::default(),
            batches: batches::OpenBatches::default(),
            flushing,
            reads,
            epochs,
            unconfirmed: failover::Unconfirmed::default(),
            target,
            early: None,
            early_holds: None,
            read_ahead: None,
            breaker: Breaker::default(),
            clock,
            config,
            local_bytes: LocalBytes::default(),
        })
    }

    pub fn stats(&self) -> RedisStats {
        self.stats
    }

    /// Why Redis was first taken as unavailable, if it ever was.
    pub fn first_outage(&self) -> Option<&str> {
        self.breaker.first_outage.as_deref()
    }

    /// Whether Redis answers (the circuit breaker is closed).
    pub fn available(&self) -> bool {
        !self.breaker.is_open()
    }

    /// The flushes acknowledged since the last call, oldest first.
    pub fn take_flush_samples(&mut self) -> Vec<FlushSample> {
        std::mem::take(&mut self.flushing.samples)
    }

    /// The last flush failure since the last call (its deltas are kept and sent again).
    pub fn take_flush_error(&mut self) -> Option<StoreError> {
        self.flushing.last_error.take()
    }

    /// Redis failed: open the breaker (count locally) if it is not open yet.
    fn fail(&mut self, error: &StoreError, during: &str) {
        self.give_up_read_ahead();
        if self.breaker.outage.is_none() {
            self.stats.outages += 1;
            tracing::warn!(error = %error, during, "Redis unavailable: counting locally until it answers again");
            self.breaker
                .first_outage
                .get_or_insert_with(|| format!("{error} (while {during})"));
            self.breaker.outage = Some((Instant::now(), error.to_string()));
        }
    }

    /// Redis answered: close the breaker.
    fn recovered(&mut self) {
        if let Some((since, _)) = self.breaker.outage.take() {
            tracing::info!(
                after_ms = since.elapsed().as_millis() as u64,
                keys = self.views.dirty.len(),
                "Redis available again: merging what was counted locally"
            );
        }
    }
}

impl<C: MonotonicClock> CounterStore for RedisStore<C> {
    fn open_window(&mut self, name: &str, spec: WindowSpec) -> WindowId {
        let window = self.windows.open(name, spec);
        if window.0 as usize == self.layouts.len() {
            let layout = view::Layout::of(name, &spec, &self.layouts);
            self.layouts.push(layout);
        }
        window
    }

    fn apply(
        &mut self,
        window: WindowId,
        key: &[u8],
        ts_ms: i64,
        delta: Delta,
    ) -> Result<Observed, StoreError> {
        self.count(window, key, ts_ms, delta)
    }

    fn read(&mut self, window: WindowId, key: &[u8], ts_ms: i64) -> Result<Observed, StoreError> {
        self.observe(window, key, ts_ms)
    }

    fn apply_last(
        &mut self,
        window: WindowId,
        key: &[u8],
        ts_ms: i64,
        value: crate::window::LastValue,
    ) -> Result<(Observed, Option<crate::window::LastValue>), StoreError> {
        self.count_with(window, key, ts_ms, Delta::Last, Some(value))
    }

    fn read_last(
        &mut self,
        window: WindowId,
        key: &[u8],
        ts_ms: i64,
    ) -> Result<(Observed, Option<crate::window::LastValue>), StoreError> {
        self.observe_with(window, key, ts_ms)
    }

    fn open_holds(&mut self, name: &str, ttl_ms: i64) -> HoldSpace {
        self.hold_spaces.open(name, ttl_ms)
    }

    /// The hold as Redis told it within the last flush interval (read again if older), raised by
    /// what this process set; while Redis is unavailable, what this process knows.
    fn held_until(&mut self, space: HoldSpace, key: &[u8]) -> Result<Option<i64>, StoreError> {
        self.hold(space, key)
    }

    /// While Redis is away, "not held" is known only of a hold this process holds a view of
    /// with an end (set here or read): another worker may have set one meanwhile on any other.
    fn hold_unknown(&mut self, space: HoldSpace, key: &[u8]) -> bool {
        self.breaker.is_open()
            && self
                .holds
                .views
                .get(&KeyRef {
                    window: space.0,
                    key,
                })
                .is_none_or(|view| view.until.is_none())
    }

    /// Raised locally at once (so this process is exact), written behind with the next flush
    /// (so other workers see it within a flush interval).
    fn extend_hold(
        &mut self,
        space: HoldSpace,
        key: &[u8],
        until_ms: i64,
    ) -> Result<i64, StoreError> {
        self.raise_hold(space, key, until_ms)
    }

    fn inspect(&mut self, window: WindowId, key: &[u8]) -> Result<Inspected, StoreError> {
        self.inspect_key(window, key)
    }

    fn release_hold(&mut self, space: HoldSpace, key: &[u8]) -> Result<Option<i64>, StoreError> {
        self.release(space, key)
    }

    fn prefetch_holds(&mut self, keys: &[(HoldSpace, Vec<u8>)]) -> Result<(), StoreError> {
        self.prefetch_hold_views(keys);
        Ok(())
    }

    fn set_origin(&mut self, origin: Option<InputPosition>) {
        if let Some(origin) = origin {
            self.views.own_lane(origin.lane);
        }
        self.origin = origin;
    }

    fn set_shared(&mut self, shared: bool) {
        self.views.shared = shared;
    }

    #[inline]
    fn fetch_ahead(&self, window: WindowId, key: &[u8]) {
        self.views.fetch_ahead(window, key);
    }

    fn count_ahead(&mut self, planned: &[Planned]) -> Result<(), StoreError> {
        self.count_planned_ahead(planned)
    }

    fn prefetches(&self) -> bool {
        !self.breaker.is_open()
    }

    /// One pipeline reading every key of the batch that is neither dirty nor cached. A failure
    /// opens the breaker: the keys are then counted locally.
    fn prefetch(&mut self, keys: &[(WindowId, Vec<u8>)]) -> Result<(), StoreError> {
        self.prefetch_windows(keys);
        Ok(())
    }

    fn read_ahead(&mut self, keys: &[(WindowId, Vec<u8>)]) {
        self.start_read_ahead(keys);
    }

    fn read_holds_ahead(&mut self, keys: &[(HoldSpace, Vec<u8>)]) {
        self.start_hold_reads_ahead(keys);
    }

    /// Waits for the flush in flight, then sends everything still pending and waits for it: on
    /// success Redis holds every delta counted so far. Keys whose writes met another writer, or
    /// that were gone, come back pending and go again; a large re-seed takes several flushes.
    fn flush(&mut self) -> Result<(), StoreError> {
        self.flush_all()
    }

    fn live_keys(&self) -> usize {
        self.views.dirty.len() + self.views.cache.entry_count() as usize
    }

    fn counted_mark(&self) -> u64 {
        self.counted
    }

    fn judged_as_held(&self) -> u64 {
        self.stats.judged_as_held
    }

    fn durable_mark(&self) -> u64 {
        self.durable
    }

    fn tick(&mut self) -> Result<(), StoreError> {
        self.reap_journaled();
        let result = self.write_behind();
        self.views.cache.age_some(Instant::now());
        // After taking in what Redis acknowledged, so that a drained table stops saturating.
        self.measure_local_bytes();
        result
    }

    fn saturated(&self) -> bool {
        self.views.dirty.len() >= self.config.max_local_keys
            || self.local_bytes.dirty >= self.config.max_state_bytes / 2
    }

    /// As last measured (at most `LocalBytes::every` ago, by `tick`): replay asks after every
    /// event.
    fn state_stats(&self) -> StateStats {
        StateStats {
            bytes: self
                .local_bytes
                .dirty
                .saturating_add(self.local_bytes.clean),
            evicted_keys: 0,
            evicted_holds: 0,
        }
    }

    fn forget_cached(&mut self) {
        self.views.forget_cached();
        // Hold views are read again too: another worker may have raised them meanwhile.
        self.forget_hold_reads();
    }

    fn begin_batch(&mut self, lane: u64, since: i64) {
        self.begin_open_batch(lane, since);
    }

    fn seal_batch(&mut self) -> BatchSeal {
        self.seal_open_batch()
    }

    fn seal_batch_deferring(&mut self) -> (BatchSeal, Deferred) {
        let settle = self.views.cache.settle_later(&self.views.dirty);
        let seal = self.seal_open_batch();
        (
            seal,
            settle.map_or_else(Deferred::none, |job| Deferred::new(move || job.run())),
        )
    }

    fn discard_batch(&mut self, lane: u64, since: i64) -> Result<(), StoreError> {
        self.discard_open_batch(lane, since)
    }
}

impl<C: MonotonicClock> Drop for RedisStore<C> {
    /// Shutdown flushes: what was counted reaches Redis unless Redis stays unreachable through
    /// every retry.
    fn drop(&mut self) {
        let _ = self.flush_all();
        // The threads end with their channels, once what they are doing returns (not waited
        // for: it may be waiting on a Redis that stopped answering).
        self.flushing.jobs = None;
        self.reads.jobs = None;
        drop(self.flushing.thread.take());
        drop(self.reads.thread.take());
    }
}

#[cfg(test)]
mod tests {
    use super::SentinelUrl;

    #[test]
    fn sentinel_urls_name_the_sentinels_the_master_and_the_data_nodes_credentials() {
        let url = SentinelUrl::parse(
            "redis+sentinel://app:s3cret@10.0.0.1:26379,10.0.0.2,[::1]:26380/risk/2",
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            url.sentinels,
            vec![
                ("10.0.0.1".to_owned(), 26379),
                ("10.0.0.2".to_owned(), 26379),
                ("[::1]".to_owned(), 26380)
            ]
        );
        assert_eq!(url.service, "risk");
        assert_eq!(url.seed_url, "redis://app:s3cret@10.0.0.1:26379/2");
        let tls = SentinelUrl::parse("rediss+sentinel://h:1/m")
            .unwrap()
            .unwrap();
        assert_eq!(tls.seed_url, "rediss://h:1/0");
        assert!(SentinelUrl::parse("redis://h:6379").unwrap().is_none());
        for bad in [
            "redis+sentinel://h:1",
            "redis+sentinel://h:1/",
            "redis+sentinel://h:x/m",
            "redis+sentinel://:1/m",
            "redis+sentinel://h/m/x",
        ] {
            let error = SentinelUrl::parse(bad).unwrap_err().to_string();
            assert!(
                error.contains("invalid Sentinel URL") && error.contains("master-name"),
                "{bad}: {error}"
            );
        }
    }
}
