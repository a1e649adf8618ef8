//! The Redis store: per key, the last window read from Redis merged with this
//! process's deltas since; deltas written behind by a flusher thread in batched script calls
//! (`lua/apply_window.lua`, up to 256 keys per call; one hash slot per call on a Redis Cluster).
//!
//! Exactness: a single process sees exactly what the in-memory store sees. Counts are integers;
//! sums are added in counting order in IEEE doubles (by this process, or by the script in Lua's
//! doubles, in the same order) and stored as the shortest text that reads back bit-for-bit;
//! distinct values keep their latest bucket. When a flush is acknowledged, the key's state becomes
//! the window the script returned (which also holds other workers' deltas) plus the deltas
//! counted since the flush was sent.
//!
//! Cost: windows are loaded with plain pipelined HGETALLs. A flush for a key whose Redis version
//! is still the one this view is based on (the common case: nobody else wrote it) sends the
//! key's new fields, not its deltas, and the script only checks the version and writes them;
//! otherwise the deltas are sent and merged field by field.
//!
//! Exactly-once counting: observations carry their input position ([`Origin`]); each key records
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
//! when it has vanished or changed (a restart without persistence, FLUSHALL, a failover to a stale
//! replica) the flush writes nothing and every key this process holds a view of is written again
//! from that view. A key written at a version this process knew that is gone is written again
//! from the view too (the script answers `?`).

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use hashbrown::HashMap;
use redis::Value;

use super::codec::{self, KeyFlush, Observation, Offsets, Reply, Stored};
use super::keys::{KeyBytes, KeyRef, StoredKey};
use super::link::{slot, unavailable, Batch, Link, Op, Target, Timeouts};
use super::scripts::{ScriptCall, HOLD};
use super::{CounterStore, HoldSpace, HoldSpaces, Observed, Origin, StoreError, WindowId, Windows};
use crate::window::{Applied, Delta, WindowSpec, WindowState};

const FLUSHER_STOPPED: &str = "the flusher thread stopped";

/// Keys served by one script call. Bounded so one call never blocks Redis for long.
const KEYS_PER_CALL: usize = 256;

/// Most keys one flush carries: a re-seed after a data loss is spread over several flushes.
const MAX_FLUSH_KEYS: usize = 16_384;

/// Tuning of the Redis store.
#[derive(Debug, Clone)]
pub struct RedisStoreConfig {
    /// Flush pending deltas at least this often.
    pub flush_interval: Duration,
    /// Flush as soon as this many observations are pending.
    pub max_pending: usize,
    /// Attempts per flush before it counts as failed (its deltas are kept either way); window
    /// reads on the counting path make at most two.
    pub attempts: u32,
    /// First retry delay; doubles per attempt.
    pub retry_backoff: Duration,
    /// The longest a connection attempt may take.
    pub connect_timeout: Duration,
    /// The longest a reply may take.
    pub response_timeout: Duration,
    /// While Redis is unavailable, how often the flusher tries it again.
    pub probe_interval: Duration,
    /// Most keys with deltas Redis has not acknowledged; beyond, [`CounterStore::saturated`]
    /// asks the caller to stop feeding events until Redis takes them.
    pub max_local_keys: usize,
    /// Most clean windows (read from Redis, nothing pending) kept in the local cache.
    pub cache_capacity: u64,
    /// A clean window not used for this long is dropped from the local cache.
    pub cache_time_to_idle: Duration,
    /// PEM file of the CA that signed the server's certificate, for `rediss://` servers whose
    /// certificate is not in the system trust store.
    pub tls_ca_file: Option<std::path::PathBuf>,
    /// The callers' lateness bound in ms (`None`: unbounded): keys live at least this long past
    /// their window, so an event within the bound never finds its key expired.
    pub max_lateness: Option<i64>,
}

impl Default for RedisStoreConfig {
    fn default() -> Self {
        RedisStoreConfig {
            flush_interval: Duration::from_millis(50),
            max_pending: 10_000,
            attempts: 3,
            retry_backoff: Duration::from_millis(20),
            connect_timeout: Duration::from_millis(500),
            response_timeout: Duration::from_secs(2),
            probe_interval: Duration::from_secs(1),
            max_local_keys: 1_000_000,
            cache_capacity: 1_000_000,
            cache_time_to_idle: Duration::from_secs(600),
            tls_ca_file: None,
            max_lateness: Some(3_600_000),
        }
    }
}

/// What the store did, for the summary and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RedisStats {
    /// Script calls made (each serves up to 256 keys).
    pub script_calls: u64,
    pub flushes: u64,
    /// Keys read from Redis on a local miss.
    pub loads: u64,
    /// Failed attempts that were retried.
    pub retries: u64,
    /// Deltas the script refused as late (another worker had moved the key's head on).
    pub refused_late: u64,
    /// Observations judged but not counted again: their offset was at or below the one recorded
    /// for their key (input replayed after a crash or a rebalance, or a flush sent again).
    pub skipped_applied: u64,
    /// Keys whose writes met a version another writer had moved on; their deltas went again.
    pub stale_writes: u64,
    /// Flushes that failed after every retry (their deltas were kept and sent again).
    pub failed_flushes: u64,
    /// Times Redis became unavailable (the circuit breaker opened).
    pub outages: u64,
    /// Observations counted on local state only, while Redis was unavailable.
    pub degraded_observations: u64,
    /// Times Redis was found to have lost its data (its epoch key vanished or changed).
    pub data_losses: u64,
    /// Keys gone from Redis at a version this process knew (lost or expired), written again.
    pub lost_keys: u64,
    /// Keys written again from this process's view after Redis lost its data.
    pub reseeded_keys: u64,
}

/// One acknowledged flush, for the flush size and latency metrics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlushSample {
    pub keys: usize,
    pub observations: usize,
    pub elapsed: Duration,
}

/// A key with deltas Redis has not acknowledged: the merged view (last window from Redis + every
/// delta since), the deltas of the flush in flight, and those counted after it was sent.
struct Dirty {
    state: WindowState,
    /// The Redis version (`v`) the view is based on (0: Redis held nothing); `None` if unknown.
    version: Option<u64>,
    /// The head Redis holds at `version`.
    base_head: Option<i64>,
    /// The head of the view when the in-flight deltas were sent: Redis' head once they land.
    sent_head: Option<i64>,
    /// When this process last had Redis refresh the key's TTL (see `refresh_due`).
    refreshed: Option<Instant>,
    /// Whether the flush in flight asks for a TTL refresh.
    refresh_sent: bool,
    /// Highest offset per lane Redis has applied to this key, as far as this view knows.
    offsets: Offsets,
    inflight: Vec<Observation>,
    /// The counted index of the oldest in-flight observation.
    inflight_oldest: Option<u64>,
    pending: Vec<Observation>,
    /// The counted index of the oldest pending observation.
    pending_oldest: Option<u64>,
    /// Redis could not be read when the key was first needed: the view holds local counts only
    /// until a flush brings the window back.
    base_unknown: bool,
    /// The key is gone from Redis: the next flush writes the whole view (at version 0).
    full: bool,
}

impl Dirty {
    /// A key with `pending` observations (the oldest counted as `pending_oldest`) over a view of
    /// Redis at `version`, nothing in flight.
    fn new(state: WindowState, version: Option<u64>, base_head: Option<i64>, refreshed: Option<Instant>, offsets: Offsets) -> Dirty {
        Dirty {
            state,
            version,
            base_head,
            sent_head: None,
            refreshed,
            refresh_sent: false,
            offsets,
            inflight: Vec::new(),
            inflight_oldest: None,
            pending: Vec::new(),
            pending_oldest: None,
            base_unknown: false,
            full: false,
        }
    }

    fn push(&mut self, observation: Observation, index: u64) {
        self.pending.push(observation);
        self.pending_oldest.get_or_insert(index);
    }

    /// Puts the in-flight deltas back in front of those counted since, to be sent again.
    fn send_again(&mut self) {
        let mut again = std::mem::take(&mut self.inflight);
        again.append(&mut self.pending);
        self.pending = again;
        self.pending_oldest = self.inflight_oldest.take().or(self.pending_oldest);
    }

    /// Redis lost the key: write the whole view again, as a new key.
    fn rewrite(&mut self) {
        self.full = true;
        self.version = Some(0);
        self.base_head = None;
    }
}

/// How a replayed observation is judged without counting it: the window as it stands (or late,
/// if its bucket slid out).
fn judge(state: &WindowState, spec: &WindowSpec, bucket: i64) -> Applied {
    match state.head() {
        Some(head) if bucket <= head - spec.buckets => Applied::Late,
        _ => Applied::Counted(state.value()),
    }
}

/// A clean window as Redis holds it at `version` (0: Redis held nothing; `None`: unknown).
struct Cached {
    state: WindowState,
    version: Option<u64>,
    /// When this process last had Redis refresh the key's TTL.
    refreshed: Option<Instant>,
    offsets: Offsets,
}

/// A rule's hold on one key as this process knows it: what Redis said last, raised by what this
/// process set since.
#[derive(Debug, Default, Clone, Copy)]
struct HoldView {
    /// Until when the key is held (`None`: not held, as far as this process knows).
    until: Option<i64>,
    /// When Redis last told the hold (`None`: never). Older than a flush interval, it is read again.
    read_at: Option<Instant>,
    /// A raise not sent yet, with the counted index it was made at.
    pending: Option<(i64, u64)>,
    /// The raise in flight.
    inflight: Option<(i64, u64)>,
}

impl HoldView {
    fn fresh(&self, interval: Duration) -> bool {
        self.read_at.is_some_and(|at| at.elapsed() < interval)
    }

    /// What Redis told (`stored`), raised by this process's unacknowledged raises.
    fn learn(&mut self, stored: Option<i64>, at: Instant) {
        let raises = self.pending.into_iter().chain(self.inflight).map(|(until, _)| until);
        self.until = stored.into_iter().chain(raises).max();
        self.read_at = Some(at);
    }
}

/// Holds past this many views are pruned at each flush: views read over a flush interval ago
/// would be read again anyway.
const HOLD_VIEWS_KEPT: usize = 4096;

/// The keys that tell whether Redis lost its data (one per master on a cluster), with the value
/// this process knows each holds.
struct Epochs {
    keys: Vec<String>,
    known: Vec<Option<Vec<u8>>>,
    /// What this process writes into an absent epoch key.
    candidate: Vec<u8>,
}

impl Epochs {
    /// `SET key candidate NX GET` for each key: sets the ones that are absent and returns what
    /// each held before.
    fn add_checks(&self, batch: &mut Batch, cluster: bool) {
        for key in &self.keys {
            let mut set = redis::cmd("SET");
            set.arg(key).arg(&self.candidate).arg("NX").arg("GET");
            batch.command(cluster, key, set);
        }
    }

    /// Takes in the replies of `add_checks`: true if an epoch this process knew vanished or
    /// changed (Redis lost its data).
    fn check(&mut self, replies: &[Value]) -> Result<bool, StoreError> {
        let mut lost = false;
        for (known, reply) in self.known.iter_mut().zip(replies) {
            let now = match reply {
                Value::Nil => self.candidate.clone(),
                other => redis::from_redis_value::<Vec<u8>>(other.clone())
                    .map_err(|e| StoreError::Protocol(format!("epoch: {e}")))?,
            };
            if known.as_ref().is_some_and(|k| *reply == Value::Nil || *k != now) {
                lost = true;
            }
            *known = Some(now);
        }
        Ok(lost)
    }
}

/// The epoch key living in hash slot `target` (a hash tag that hashes there).
fn epoch_key_in_slot(target: u16) -> String {
    (0u64..)
        .map(|n| format!("vg:epoch:{{e{n}}}"))
        .find(|key| slot(key) == target)
        .expect("some tag hashes to every slot")
}

/// A flush for the flusher thread: first the epoch checks, then, if no data loss showed, the
/// script calls.
struct FlushJob {
    first: Batch,
    epochs: usize,
    known: Vec<Option<Vec<u8>>>,
    scripts: Batch,
    attempts: u32,
}

/// What the flusher thread sends back for one flush.
struct FlushDone {
    /// The replies of the first phase, and of the scripts (`None`: not run, data loss seen).
    result: Result<(Vec<Value>, Option<Vec<Value>>), StoreError>,
    retries: u64,
}

struct Inflight {
    keys: Vec<StoredKey>,
    order: Vec<usize>,
    observations: usize,
    sent: Instant,
    /// How many epoch checks the flush starts with.
    epochs: usize,
    /// The holds raised by this flush: their calls follow the epoch checks.
    holds: Vec<StoredKey>,
}

/// The write-behind task: runs flushes on its own connection while the caller goes on.
fn flusher(mut link: Link, jobs: mpsc::Receiver<FlushJob>, done: mpsc::Sender<FlushDone>) {
    for job in jobs {
        let (first, mut retries) = link.query(&job.first, job.attempts);
        let result = first.and_then(|first| {
            // Compared here, before any script runs: after a data loss nothing is merged into
            // the emptied keys; the store writes its views again instead.
            let lost = first.iter().take(job.epochs).zip(&job.known).any(|(reply, known)| match (reply, known) {
                (_, None) => false,
                (Value::Nil, Some(_)) => true,
                (reply, Some(known)) => redis::from_redis_value::<Vec<u8>>(reply.clone()).ok().as_ref() != Some(known),
            });
            if lost || job.scripts.is_empty() {
                return Ok((first, if lost { None } else { Some(Vec::new()) }));
            }
            let (scripts, more) = link.query(&job.scripts, job.attempts);
            retries += more;
            scripts.map(|scripts| (first, Some(scripts)))
        });
        if done.send(FlushDone { result, retries }).is_err() {
            return;
        }
    }
}

/// A read for the reader thread: windows (HGETALL per key).
struct ReadJob {
    id: u64,
    batch: Batch,
    attempts: u32,
}

struct ReadDone {
    id: u64,
    result: Result<Vec<Value>, StoreError>,
    retries: u64,
}

/// Runs reads on their own connection, so that the counting path can stop waiting for a Redis
/// that stopped answering: a pipeline against a frozen server waits for each of its replies in
/// turn (redis-rs), far longer than one response timeout.
fn reader(mut link: Link, jobs: mpsc::Receiver<ReadJob>, done: mpsc::Sender<ReadDone>) {
    for job in jobs {
        let (result, retries) = link.query(&job.batch, job.attempts);
        if done.send(ReadDone { id: job.id, result, retries }).is_err() {
            return;
        }
    }
}

/// Appends `bytes` as lowercase hex: how digests appear in Redis key names.
pub(crate) fn push_hex(out: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for &byte in bytes {
        out.push(char::from(HEX[usize::from(byte >> 4)]));
        out.push(char::from(HEX[usize::from(byte & 15)]));
    }
}

/// `<prefix><name>:<first 16 bytes of digest in hex>`: how store keys are named in Redis.
fn key_name(prefix: &str, name: &str, digest: &blake3::Hash) -> String {
    let mut key_name = String::with_capacity(prefix.len() + name.len() + 33);
    key_name.push_str(prefix);
    key_name.push_str(name);
    key_name.push(':');
    push_hex(&mut key_name, &digest.as_bytes()[..16]);
    key_name
}

/// A key's TTL is at least this many windows. Every write that may create or re-create a key sets
/// it; a write that finds the key at the version this process last wrote refreshes it only once a
/// window (of wall time) has passed since this process last did: the TTL then never falls below
/// 2 × window (nor below window + lateness, see `ttl_ms`), and most writes save a PEXPIRE.
const TTL_WINDOWS: i64 = 3;

/// The longest TTL set: ten years (far below what PEXPIRE can represent).
const MAX_TTL_MS: i64 = 10 * 365 * 86_400_000;

/// The TTL a write sets: max(3 × window, 2 × window + lateness), so that between two refreshes (a
/// window apart) it stays above max(2 × window, window + lateness).
fn ttl_ms(spec: &WindowSpec, max_lateness: Option<i64>) -> i64 {
    let window = spec.window_ms();
    let by_lateness = max_lateness.map_or(0, |lateness| window.saturating_mul(2).saturating_add(lateness));
    window.saturating_mul(TTL_WINDOWS).max(by_lateness).clamp(1, MAX_TTL_MS)
}

/// Whether a write should refresh the key's TTL (see `TTL_WINDOWS`).
fn refresh_due(spec: &WindowSpec, version: Option<u64>, refreshed: Option<Instant>) -> bool {
    let window = Duration::from_millis(spec.window_ms().max(0) as u64);
    version.is_none_or(|v| v == 0) || refreshed.is_none_or(|at| at.elapsed() >= window)
}

pub struct RedisStore {
    /// Reads (loads, prefetches) go to the reader thread; the caller waits at most
    /// `read_deadline` for each.
    reads: Option<mpsc::Sender<ReadJob>>,
    read_done: mpsc::Receiver<ReadDone>,
    reader: Option<std::thread::JoinHandle<()>>,
    read_seq: u64,
    /// A read the caller stopped waiting for: until it comes back, reads fail at once.
    read_outstanding: Option<u64>,
    config: RedisStoreConfig,
    windows: Windows,
    /// Keys with unacknowledged deltas. Never evicted: nothing counted is dropped before Redis
    /// has acknowledged it.
    dirty: HashMap<StoredKey, Dirty, foldhash::fast::RandomState>,
    /// Clean windows as Redis last returned them: a bounded, time-to-idle read cache.
    cache: moka::sync::Cache<StoredKey, Arc<Cached>, foldhash::fast::RandomState>,
    /// Observations counted and not yet sent.
    pending: usize,
    /// The flush in flight: its keys, its batch's reply order, its observation count and when it
    /// was sent.
    inflight: Option<Inflight>,
    /// The origin `apply` tags observations with.
    origin: Option<Origin>,
    /// Observations counted so far (`CounterStore::counted_mark`).
    counted: u64,
    /// Every observation up to this mark is in Redis (`CounterStore::durable_mark`).
    durable: u64,
    /// Acknowledged flushes not yet taken by `take_flush_samples`.
    samples: Vec<FlushSample>,
    /// The last flush failure not yet reported.
    last_error: Option<StoreError>,
    jobs: Option<mpsc::Sender<FlushJob>>,
    /// Cluster mode: script calls hold keys of one slot only.
    cluster: bool,
    done: mpsc::Receiver<FlushDone>,
    flusher: Option<std::thread::JoinHandle<()>>,
    last_flush: Instant,
    /// When a flush last checked the epoch keys.
    last_epoch_check: Instant,
    /// The next flush checks the epoch keys whenever the last check was (`flush` asks for it).
    epoch_due: bool,
    /// Since when Redis has been unavailable (the circuit breaker is open), and why.
    outage: Option<(Instant, String)>,
    epochs: Epochs,
    stats: RedisStats,
    hold_spaces: HoldSpaces,
    /// Holds read or raised recently (the key's `window` is its hold space).
    holds: HashMap<StoredKey, HoldView, foldhash::fast::RandomState>,
    /// Hold views with a raise not sent yet.
    holds_pending: usize,
    /// Why Redis was first taken as unavailable (for a replay's summary).
    first_outage: Option<String>,
    /// While a batch runs (`begin_batch`): each hold view as it was before the batch first
    /// raised it (`None`: there was none), to take the raises back if the batch is discarded.
    batch: Option<HashMap<StoredKey, Option<HoldView>, foldhash::fast::RandomState>>,
}

/// Where `url` points: one server or a Redis Cluster (found from a node with cluster mode on), and
/// for a cluster the first slot each master serves.
pub(super) fn open_target(url: &str, config: &RedisStoreConfig) -> Result<(Target, bool, Vec<u16>), StoreError> {
    // rustls needs a process-wide crypto provider; a second install attempt is harmless.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = match &config.tls_ca_file {
        Some(path) => {
            let root_cert = std::fs::read(path)
                .map_err(|e| StoreError::Unavailable(format!("cannot read CA file {}: {e}", path.display())))?;
            let certs = redis::TlsCertificates { client_tls: None, root_cert: Some(root_cert) };
            redis::Client::build_with_tls(url, certs).map_err(unavailable)?
        }
        None => redis::Client::open(url).map_err(unavailable)?,
    };
    let mut probe = client.get_connection_with_timeout(config.connect_timeout).map_err(unavailable)?;
    probe.set_read_timeout(Some(config.response_timeout)).map_err(unavailable)?;
    let info: String = redis::cmd("INFO").arg("cluster").query(&mut probe).map_err(unavailable)?;
    if !info.lines().any(|l| l.trim() == "cluster_enabled:1") {
        return Ok((Target::Single(client), false, Vec::new()));
    }
    let ranges: Vec<Value> = redis::cmd("CLUSTER").arg("SLOTS").query(&mut probe).map_err(unavailable)?;
    let mut first_slots: Vec<u16> = ranges
        .iter()
        .filter_map(|range| match range {
            Value::Array(items) => redis::from_redis_value::<u16>(items.first()?.clone()).ok(),
            _ => None,
        })
        .collect();
    first_slots.sort_unstable();
    let cluster = redis::cluster::ClusterClientBuilder::new(vec![url])
        .connection_timeout(config.connect_timeout)
        .response_timeout(config.response_timeout)
        .build()
        .map_err(unavailable)?;
    Ok((Target::Cluster { seed: client, cluster: Box::new(cluster) }, true, first_slots))
}

impl RedisStore {
    /// Connects to `url` (`redis://`, `redis://user:pass@host`, `rediss://`).
    pub fn connect(url: &str, config: RedisStoreConfig) -> Result<RedisStore, StoreError> {
        let (target, cluster, first_slots) = open_target(url, &config)?;
        let timeouts = Timeouts { connect: config.connect_timeout, response: config.response_timeout };
        // One epoch key on a single server; on a cluster one per master, in the first slot it serves.
        let epoch_keys = if cluster { first_slots.into_iter().map(epoch_key_in_slot).collect() } else { vec!["vg:epoch".to_owned()] };
        let mut link = Link::open(target.clone(), timeouts, config.retry_backoff)?;
        let flusher_link = Link::open(target, timeouts, config.retry_backoff)?;
        let mut epochs = Epochs {
            known: vec![None; epoch_keys.len()],
            keys: epoch_keys,
            candidate: {
                let mut text = String::new();
                push_hex(&mut text, &rand::random::<[u8; 16]>());
                text.into_bytes()
            },
        };
        let mut batch = Batch::default();
        epochs.add_checks(&mut batch, cluster);
        let (replies, _) = link.query(&batch, config.attempts);
        epochs.check(&replies?)?;
        let (jobs, job_rx) = mpsc::channel();
        let (done_tx, done) = mpsc::channel();
        let flusher = std::thread::Builder::new()
            .name("vigil-flusher".into())
            .spawn(move || flusher(flusher_link, job_rx, done_tx))
            .map_err(|e| StoreError::Unavailable(format!("cannot start the flusher thread: {e}")))?;
        let (reads, read_rx) = mpsc::channel();
        let (read_tx, read_done) = mpsc::channel();
        let reader = std::thread::Builder::new()
            .name("vigil-reader".into())
            .spawn(move || reader(link, read_rx, read_tx))
            .map_err(|e| StoreError::Unavailable(format!("cannot start the reader thread: {e}")))?;
        Ok(RedisStore {
            reads: Some(reads),
            read_done,
            reader: Some(reader),
            read_seq: 0,
            read_outstanding: None,
            windows: Windows::default(),
            dirty: HashMap::default(),
            cache: moka::sync::Cache::builder()
                .max_capacity(config.cache_capacity)
                .time_to_idle(config.cache_time_to_idle)
                .build_with_hasher(foldhash::fast::RandomState::default()),
            pending: 0,
            inflight: None,
            origin: None,
            counted: 0,
            durable: 0,
            samples: Vec::new(),
            last_error: None,
            jobs: Some(jobs),
            cluster,
            done,
            flusher: Some(flusher),
            last_flush: Instant::now(),
            last_epoch_check: Instant::now(),
            epoch_due: false,
            outage: None,
            epochs,
            stats: RedisStats::default(),
            hold_spaces: HoldSpaces::default(),
            holds: HashMap::default(),
            holds_pending: 0,
            first_outage: None,
            batch: None,
            config,
        })
    }

    pub fn stats(&self) -> RedisStats {
        self.stats
    }

    /// Why Redis was first taken as unavailable, if it ever was.
    pub fn first_outage(&self) -> Option<&str> {
        self.first_outage.as_deref()
    }

    /// Whether Redis answers (the circuit breaker is closed).
    pub fn available(&self) -> bool {
        self.outage.is_none()
    }

    /// The flushes acknowledged since the last call, oldest first.
    pub fn take_flush_samples(&mut self) -> Vec<FlushSample> {
        std::mem::take(&mut self.samples)
    }

    /// The last flush failure since the last call (its deltas are kept and sent again).
    pub fn take_flush_error(&mut self) -> Option<StoreError> {
        self.last_error.take()
    }

    /// The Redis key of (window, canonical key bytes): `vg:<name>:<digest>`, where the digest
    /// covers the window's shape, what it counts and the key, so user bytes never reach Redis raw
    /// and a counter whose window, dimensions or field change starts on fresh counters.
    pub fn redis_key(&self, window: WindowId, key: &[u8]) -> String {
        let spec = self.windows.spec(window.0);
        let name = self.windows.name(window.0);
        let mut hasher = blake3::Hasher::new();
        hasher.update(&spec.bucket_ms.to_le_bytes());
        hasher.update(&spec.buckets.to_le_bytes());
        hasher.update(spec.aggregate.as_str().as_bytes());
        hasher.update(&spec.identity.to_le_bytes());
        hasher.update(key);
        key_name("vg:", name, &hasher.finalize())
    }

    /// The Redis key of a rule's hold on a hold key: `vg:h:<rule id>:<digest>` (user bytes never
    /// reach Redis raw).
    pub fn redis_hold_key(&self, space: HoldSpace, key: &[u8]) -> String {
        key_name("vg:h:", self.hold_spaces.name(space.0), &blake3::hash(key))
    }

    /// One `command` per key name, pipelined on the reader thread (grouped per master on a
    /// cluster): a reply per name, in order.
    fn read_each(&mut self, command: &str, names: &[String]) -> Result<Vec<Value>, StoreError> {
        let mut batch = Batch::default();
        for name in names {
            let mut cmd = redis::cmd(command);
            cmd.arg(name);
            batch.command(self.cluster, name, cmd);
        }
        // Every attempt (a dropped connection fails at once and is worth another), but within
        // two read deadlines: the counting path does not wait out a long outage.
        let replies = self.query_read(batch, self.config.attempts)?;
        if replies.len() != names.len() {
            return Err(StoreError::Protocol(format!("{} replies for {} {command} reads", replies.len(), names.len())));
        }
        Ok(replies)
    }

    /// Reads the holds of `keys` from Redis (pipelined GETs) into their views. A failure opens
    /// the breaker: the views stay as they are.
    fn read_holds(&mut self, keys: &[(HoldSpace, &[u8])]) {
        let names: Vec<String> = keys.iter().map(|&(space, key)| self.redis_hold_key(space, key)).collect();
        let at = Instant::now();
        let replies = match self.read_each("GET", &names) {
            Ok(replies) => replies,
            Err(e) => {
                self.fail(&e, "reading holds");
                return;
            }
        };
        for (&(space, key), reply) in keys.iter().zip(replies) {
            let stored = match redis::from_redis_value::<Option<String>>(reply) {
                Ok(text) => text.and_then(|t| t.parse::<i64>().ok()),
                Err(_) => None,
            };
            let view = self.holds.entry(StoredKey { window: space.0, key: KeyBytes::new(key) }).or_default();
            view.learn(stored, at);
        }
    }

    /// The raises of `holds` did not happen (or are not known to have): they go again.
    fn unsent_holds(&mut self, holds: &[StoredKey]) {
        for key in holds {
            let Some(view) = self.holds.get_mut(key) else { continue };
            if let Some(inflight) = view.inflight.take() {
                if view.pending.is_none() {
                    self.holds_pending += 1;
                }
                view.pending = Some(match view.pending {
                    Some((until, _)) => (until.max(inflight.0), inflight.1),
                    None => inflight,
                });
            }
        }
    }

    /// The longest the counting path waits for Redis: a connection and a reply.
    fn read_deadline(&self) -> Duration {
        self.config.connect_timeout + self.config.response_timeout
    }

    /// Runs `batch` on the reader thread, waiting at most `read_deadline` for it.
    fn query_read(&mut self, batch: Batch, attempts: u32) -> Result<Vec<Value>, StoreError> {
        if let Some(outstanding) = self.read_outstanding {
            // A read the caller gave up on: Redis is taken as unavailable until it answers it.
            loop {
                match self.read_done.try_recv() {
                    Ok(done) if done.id == outstanding => {
                        self.read_outstanding = None;
                        break;
                    }
                    Ok(_) => continue,
                    Err(mpsc::TryRecvError::Empty) => {
                        return Err(StoreError::Unavailable("an earlier read is still waiting for Redis".into()))
                    }
                    Err(mpsc::TryRecvError::Disconnected) => return Err(StoreError::Unavailable("the reader thread stopped".into())),
                }
            }
        }
        self.read_seq += 1;
        let id = self.read_seq;
        let reads = self.reads.as_ref().expect("the reader runs until drop");
        reads
            .send(ReadJob { id, batch, attempts })
            .map_err(|_| StoreError::Unavailable("the reader thread stopped".into()))?;
        let deadline = Instant::now() + self.read_deadline().saturating_mul(attempts.clamp(1, 2));
        loop {
            match self.read_done.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(done) if done.id == id => {
                    self.stats.retries += done.retries;
                    return done.result;
                }
                Ok(_) => continue,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    self.read_outstanding = Some(id);
                    return Err(StoreError::Unavailable(format!("no reply from Redis within {:?}", self.read_deadline())));
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return Err(StoreError::Unavailable("the reader thread stopped".into())),
            }
        }
    }

    /// Redis failed: open the breaker (count locally) if it is not open yet.
    fn fail(&mut self, error: &StoreError, during: &str) {
        if self.outage.is_none() {
            self.stats.outages += 1;
            tracing::warn!(error = %error, during, "Redis unavailable: counting locally until it answers again");
            self.first_outage.get_or_insert_with(|| format!("{error} (while {during})"));
            self.outage = Some((Instant::now(), error.to_string()));
        }
    }

    /// Redis answered: close the breaker.
    fn recovered(&mut self) {
        if let Some((since, _)) = self.outage.take() {
            tracing::info!(
                after_ms = since.elapsed().as_millis() as u64,
                keys = self.dirty.len(),
                "Redis available again: merging what was counted locally"
            );
        }
    }

    /// Script calls covering the in-flight deltas of `keys`, up to `KEYS_PER_CALL` keys per
    /// call; in cluster mode each call holds keys of one hash slot.
    fn batch(&self, keys: &[StoredKey]) -> Batch {
        let mut groups: Vec<(u16, Vec<usize>, ScriptCall)> = Vec::new();
        let mut open: HashMap<u16, usize> = HashMap::new();
        let mut batch = Batch::default();
        for (index, key) in keys.iter().enumerate() {
            let window = WindowId(key.window);
            let name = self.redis_key(window, key.key.as_slice());
            let group_slot = if self.cluster { slot(&name) } else { 0 };
            let group = match open.get(&group_slot) {
                Some(&g) => g,
                None => {
                    groups.push((group_slot, Vec::new(), ScriptCall::default()));
                    open.insert(group_slot, groups.len() - 1);
                    groups.len() - 1
                }
            };
            let dirty = &self.dirty[key];
            let spec = self.windows.spec(key.window);
            let flush = KeyFlush {
                spec: &spec,
                ttl_ms: ttl_ms(&spec, self.config.max_lateness),
                version: dirty.version,
                refresh: dirty.refresh_sent,
                state: &dirty.state,
                base_head: dirty.base_head,
                offsets: &dirty.offsets,
                deltas: &dirty.inflight,
                full: dirty.full,
            };
            codec::add_key(&mut groups[group].2, &name, &flush);
            groups[group].1.push(index);
            if groups[group].1.len() == KEYS_PER_CALL {
                open.remove(&group_slot);
            }
        }
        for (group_slot, members, call) in groups {
            batch.order.extend(members);
            batch.calls.push(Op::Script(call));
            batch.slots.push(group_slot);
        }
        batch
    }

    /// Flattens per-call replies back into the order the keys were given.
    fn replies(&mut self, calls: Vec<Value>, order: &[usize]) -> Result<Vec<codec::KeyReply>, StoreError> {
        self.stats.script_calls += calls.len() as u64;
        let mut flat = Vec::with_capacity(order.len());
        for call in calls {
            flat.extend(codec::key_replies(call)?);
        }
        if flat.len() != order.len() {
            return Err(StoreError::Protocol(format!("{} replies for {} keys", flat.len(), order.len())));
        }
        let mut replies = vec![Vec::new(); order.len()];
        for (reply, &index) in flat.into_iter().zip(order) {
            replies[index] = reply;
        }
        Ok(replies)
    }

    /// Hands the pending deltas of up to `MAX_FLUSH_KEYS` keys and the epoch checks to the
    /// flusher.
    fn send(&mut self) -> Result<(), StoreError> {
        debug_assert!(self.inflight.is_none());
        self.last_flush = Instant::now();
        let keys: Vec<StoredKey> = self
            .dirty
            .iter()
            .filter(|(_, d)| !d.pending.is_empty() || d.full)
            .map(|(k, _)| k.clone())
            .take(MAX_FLUSH_KEYS)
            .collect();
        if keys.is_empty() && self.pending == 0 && self.holds_pending == 0 {
            // Nothing pending and nothing in flight: everything counted is in Redis.
            self.durable = self.counted;
            // Idle: the epoch is still checked, but only once per probe interval.
            if !self.epoch_due && self.last_epoch_check.elapsed() < self.config.probe_interval {
                return Ok(());
            }
        }
        for key in &keys {
            let spec = self.windows.spec(key.window);
            let dirty = self.dirty.get_mut(key).expect("listed above");
            self.pending -= dirty.pending.len();
            dirty.inflight = std::mem::take(&mut dirty.pending);
            dirty.inflight_oldest = dirty.pending_oldest.take();
            dirty.sent_head = dirty.state.head();
            dirty.refresh_sent = refresh_due(&spec, dirty.version, dirty.refreshed);
        }
        let observations = keys.iter().map(|k| self.dirty[k].inflight.len()).sum();
        let scripts = self.batch(&keys);
        let order = scripts.order.clone();
        // The epoch is checked once per probe interval (and on every flush while Redis is away):
        // a round trip before the scripts. In between, a key lost at a version this process knew
        // is still caught by the script ("?").
        let mut first = Batch::default();
        let check_epochs =
            self.epoch_due || self.outage.is_some() || self.last_epoch_check.elapsed() >= self.config.probe_interval;
        if check_epochs {
            self.epoch_due = false;
            self.last_epoch_check = Instant::now();
            self.epochs.add_checks(&mut first, self.cluster);
        }
        let epochs = if check_epochs { self.epochs.keys.len() } else { 0 };
        // Hold raises go with the epoch checks: one round trip before the scripts.
        let holds = self.send_holds(&mut first);
        let job = FlushJob { first, epochs, known: self.epochs.known.clone(), scripts, attempts: self.config.attempts };
        let jobs = self.jobs.as_ref().expect("the flusher runs until drop");
        jobs.send(job).map_err(|_| StoreError::Unavailable(FLUSHER_STOPPED.into()))?;
        self.inflight = Some(Inflight { keys, order, observations, sent: Instant::now(), epochs, holds });
        Ok(())
    }

    /// Moves every pending hold raise in flight, adding its script call to `batch`; prunes views
    /// that would be read again anyway.
    fn send_holds(&mut self, batch: &mut Batch) -> Vec<StoredKey> {
        if self.holds.len() > HOLD_VIEWS_KEPT {
            let interval = self.config.flush_interval;
            self.holds.retain(|_, v| v.pending.is_some() || v.inflight.is_some() || v.fresh(interval));
        }
        if self.holds_pending == 0 {
            return Vec::new();
        }
        let mut sent = Vec::with_capacity(self.holds_pending);
        for (key, view) in self.holds.iter_mut() {
            if let Some(raise) = view.pending.take() {
                view.inflight = Some(raise);
                sent.push(key.clone());
            }
        }
        self.holds_pending = 0;
        for key in &sent {
            let space = HoldSpace(key.window);
            let name = self.redis_hold_key(space, key.key.as_slice());
            let (until, _) = self.holds[key].inflight.expect("just moved");
            let mut cmd = redis::cmd("EVALSHA");
            cmd.arg(HOLD.get_hash()).arg(1).arg(&name).arg(until).arg(self.hold_spaces.ttl_ms(key.window));
            batch.command(self.cluster, &name, cmd);
        }
        sent
    }

    /// The longest the caller waits for a flush: every attempt's connection and reply, twice
    /// (a flush has two round trips).
    fn flush_deadline(&self) -> Duration {
        (self.config.connect_timeout + self.config.response_timeout).saturating_mul(2 * self.config.attempts.max(1))
    }

    /// Takes in the flush in flight: waits for it if `wait` (at most `flush_deadline`: Redis is
    /// then taken as unavailable, and the flush is taken in whenever it ends), else only if it
    /// is already done.
    fn complete(&mut self, wait: bool) -> Result<(), StoreError> {
        if self.inflight.is_none() {
            return Ok(());
        }
        let done = if wait {
            match self.done.recv_timeout(self.flush_deadline()) {
                Ok(done) => done,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let error = StoreError::Unavailable(format!("a flush got no reply within {:?}", self.flush_deadline()));
                    self.fail(&error, "flushing");
                    return Err(error);
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return Err(StoreError::Unavailable(FLUSHER_STOPPED.into())),
            }
        } else {
            match self.done.try_recv() {
                Ok(done) => done,
                Err(mpsc::TryRecvError::Empty) => return Ok(()),
                Err(mpsc::TryRecvError::Disconnected) => {
                    return Err(StoreError::Unavailable(FLUSHER_STOPPED.into()))
                }
            }
        };
        let Inflight { keys, order, observations, sent, epochs, holds } = self.inflight.take().expect("checked above");
        self.stats.retries += done.retries;
        let (first, scripts) = match done.result {
            Ok(replies) => replies,
            Err(e) => {
                self.unsent_holds(&holds);
                self.unsent(&keys);
                self.stats.failed_flushes += 1;
                self.fail(&e, "flushing");
                return Err(e);
            }
        };
        self.recovered();
        let lost = match self.epochs.check(&first[..epochs.min(first.len())]) {
            Ok(lost) => lost || scripts.is_none(),
            Err(e) => {
                self.unsent_holds(&holds);
                self.unsent(&keys);
                return Err(e);
            }
        };
        if let Err(e) = self.acknowledge_holds(&holds, first.get(epochs..).unwrap_or_default(), sent) {
            self.last_error = Some(e);
        }
        if lost {
            // Nothing of this flush's deltas was written: they go again, over views written
            // again in full.
            self.unsent(&keys);
            self.reseed();
            return Ok(());
        }
        let replies = match self.replies(scripts.unwrap_or_default(), &order) {
            Ok(replies) => replies,
            Err(e) => {
                // Not applied (or not known to be): the deltas go back in front of what was
                // counted since, and the next flush sends them again (they are tagged: the
                // script skips what it applied).
                self.unsent(&keys);
                self.stats.failed_flushes += 1;
                return Err(e);
            }
        };
        self.stats.flushes += 1;
        self.samples.push(FlushSample { keys: keys.len(), observations, elapsed: sent.elapsed() });
        if self.samples.len() > 4096 {
            // Nobody takes them (replay): keep the newest only.
            self.samples.drain(..2048);
        }
        // Redis ran every call: each key's in-flight deltas are done unless its writes were
        // refused as stale or the key was gone. A reply we cannot read only costs the cached copy.
        let mut first_error = None;
        for (key, reply) in keys.into_iter().zip(replies) {
            let spec = self.windows.spec(key.window);
            let parsed = codec::parse_reply(&spec, &reply);
            if let Ok((_, counts)) = &parsed {
                self.stats.refused_late += counts.late;
                self.stats.skipped_applied += counts.skipped;
            }
            match parsed {
                Ok((Reply::Stale, _)) => {
                    let dirty = self.dirty.get_mut(&key).expect("in flight keys stay dirty");
                    if dirty.full && dirty.inflight.is_empty() && dirty.pending.is_empty() {
                        // A view written again in full found the key re-created by someone
                        // else: theirs stands, ours is read again when needed.
                        self.dirty.remove(&key);
                        continue;
                    }
                    // Another writer moved the key on: send the deltas to be merged, and learn
                    // its window from that reply.
                    self.pending += dirty.inflight.len();
                    dirty.send_again();
                    dirty.version = None;
                    dirty.full = false;
                    self.stats.stale_writes += 1;
                    continue;
                }
                Ok((Reply::Missing, _)) => {
                    // The key is gone at a version we knew: write the view again (its deltas
                    // were not applied).
                    let dirty = self.dirty.get_mut(&key).expect("in flight keys stay dirty");
                    self.pending += dirty.inflight.len();
                    dirty.send_again();
                    dirty.rewrite();
                    self.stats.lost_keys += 1;
                    continue;
                }
                _ => {}
            }
            let dirty = self.dirty.remove(&key).expect("in flight keys stay dirty");
            // Conservative: the refresh happened after the flush was sent.
            let refreshed = if dirty.refresh_sent || dirty.full { Some(sent) } else { dirty.refreshed };
            let (state, version, base_head, offsets) = match parsed {
                // Nobody else wrote since our view: it already holds the in-flight deltas and
                // those counted since, exactly as Redis now does plus what it has not seen.
                Ok((Reply::Current { version }, _)) => {
                    let mut offsets = dirty.offsets;
                    for origin in dirty.inflight.iter().filter_map(|o| o.origin) {
                        codec::raise(&mut offsets, origin.lane, origin.offset);
                    }
                    (dirty.state, Some(version), dirty.sent_head, offsets)
                }
                Ok((reply @ (Reply::Window(_) | Reply::Empty), _)) => {
                    // The window as Redis has it now, plus what was counted since it was sent.
                    let Stored { mut state, version, offsets } = match reply {
                        Reply::Window(stored) => stored,
                        _ => Stored { state: WindowState::new(spec.aggregate), version: 0, offsets: Offsets::new() },
                    };
                    let base_head = state.head();
                    for o in &dirty.pending {
                        state.apply(&spec, o.bucket, o.delta);
                    }
                    (state, Some(version), base_head, offsets)
                }
                Ok((Reply::Stale | Reply::Missing, _)) => unreachable!("handled above"),
                Err(e) => {
                    // Keep our own merged view, which already holds every delta; with no known
                    // version the next flush asks for the whole window.
                    first_error.get_or_insert(e);
                    (dirty.state, None, None, dirty.offsets)
                }
            };
            if dirty.pending.is_empty() {
                self.cache.insert(key, Arc::new(Cached { state, version, refreshed, offsets }));
            } else {
                let mut again = Dirty::new(state, version, base_head, refreshed, offsets);
                again.pending = dirty.pending;
                again.pending_oldest = dirty.pending_oldest;
                self.dirty.insert(key, again);
            }
        }
        self.update_durable();
        first_error.map_or(Ok(()), Err)
    }

    /// Takes in the replies to the hold raises of a flush: each is the hold as Redis has it now.
    /// A raise Redis refused is dropped (it would be refused again) and reported.
    fn acknowledge_holds(&mut self, holds: &[StoredKey], replies: &[Value], sent: Instant) -> Result<(), StoreError> {
        if replies.len() != holds.len() {
            self.unsent_holds(holds);
            return Err(StoreError::Protocol(format!("{} replies for {} hold raises", replies.len(), holds.len())));
        }
        let mut refused = None;
        for (key, reply) in holds.iter().zip(replies) {
            let Some(view) = self.holds.get_mut(key) else { continue };
            let Some((raised, _)) = view.inflight.take() else { continue };
            match redis::from_redis_value::<String>(reply.clone()).ok().and_then(|t| t.parse::<i64>().ok()) {
                Some(stored) => view.learn(Some(stored), sent),
                None => {
                    view.learn(Some(raised), sent);
                    refused.get_or_insert_with(|| StoreError::Protocol(format!("hold raise refused: {reply:?}")));
                }
            }
        }
        refused.map_or(Ok(()), Err)
    }

    /// Durable: everything counted before the oldest observation Redis has not acknowledged.
    fn update_durable(&mut self) {
        let holds = self.holds.values().filter_map(|h| h.inflight.into_iter().chain(h.pending).map(|(_, index)| index).min());
        let oldest = self.dirty.values().filter_map(|d| d.inflight_oldest.into_iter().chain(d.pending_oldest).min()).chain(holds).min();
        self.durable = oldest.map_or(self.counted, |oldest| oldest - 1);
    }

    /// The flush of `keys` did not happen (or is not known to have): their deltas go again with
    /// the next one.
    fn unsent(&mut self, keys: &[StoredKey]) {
        for key in keys {
            let dirty = self.dirty.get_mut(key).expect("in flight keys stay dirty");
            self.pending += dirty.inflight.len();
            dirty.send_again();
        }
    }

    /// Redis lost its data: every key this process holds a view of is written again from it,
    /// with the deltas Redis has not acknowledged (in case someone re-created the key first).
    fn reseed(&mut self) {
        self.stats.data_losses += 1;
        let cached: Vec<(Arc<StoredKey>, Arc<Cached>)> = self.cache.iter().collect();
        self.cache.invalidate_all();
        let mut count = self.dirty.len();
        for dirty in self.dirty.values_mut() {
            dirty.rewrite();
        }
        for (key, cached) in cached {
            let key = (*key).clone();
            if self.dirty.contains_key(&key) || cached.state.head().is_none() {
                continue;
            }
            let mut dirty = Dirty::new(cached.state.clone(), Some(0), None, None, cached.offsets.clone());
            dirty.rewrite();
            self.dirty.insert(key, dirty);
            count += 1;
        }
        let index = self.counted + 1;
        for view in self.holds.values_mut() {
            if let (Some(until), None, None) = (view.until, view.pending, view.inflight) {
                view.pending = Some((until, index));
                self.holds_pending += 1;
            }
        }
        self.stats.reseeded_keys += count as u64;
        tracing::error!(
            keys = count,
            "Redis lost its data (its epoch key vanished or changed): writing every counter this worker holds again from its local view"
        );
    }

    /// Takes in a finished flush and starts the next when one is due; waits for Redis only under
    /// backpressure while it answers. A failed flush is kept for `take_flush_error`, not returned:
    /// its deltas stay pending. Only a stopped flusher thread is an error.
    fn write_behind(&mut self) -> Result<(), StoreError> {
        let mut result = self.complete(false);
        let outage = self.outage.is_some();
        let interval = if outage { self.config.probe_interval } else { self.config.flush_interval };
        let full = self.pending >= self.config.max_pending;
        let due = (full && !outage) || self.last_flush.elapsed() >= interval;
        if due && self.inflight.is_none() {
            self.send()?;
        } else if !outage && self.pending >= self.config.max_pending.max(1).saturating_mul(2) {
            // Backpressure: Redis is slower than counting; wait for it rather than grow (a Redis
            // that stops answering meanwhile opens the breaker).
            result = result.and(self.complete(true));
            if self.inflight.is_none() {
                self.send()?;
            }
        }
        match result {
            Err(StoreError::Unavailable(m)) if m == FLUSHER_STOPPED => Err(StoreError::Unavailable(m)),
            Err(e) => {
                self.last_error = Some(e);
                Ok(())
            }
            Ok(()) => Ok(()),
        }
    }

    /// Reads the windows of `keys` from Redis (one pipelined HGETALL per key, grouped per
    /// master on a cluster) and caches them. A plain read needs no script: every field a hash
    /// holds is live for its head, which the script maintains on every write.
    fn read(&mut self, keys: &[(WindowId, &[u8])]) -> Result<Vec<Arc<Cached>>, StoreError> {
        let names: Vec<String> = keys.iter().map(|&(window, key)| self.redis_key(window, key)).collect();
        let replies = self.read_each("HGETALL", &names)?;
        self.stats.loads += replies.len() as u64;
        let mut states = Vec::with_capacity(keys.len());
        for (&(window, key), reply) in keys.iter().zip(replies) {
            let Stored { state, version, offsets } = codec::decode_hash(&self.windows.spec(window.0), &codec::flat(reply)?)?;
            let cached = Arc::new(Cached { state, version: Some(version), refreshed: None, offsets });
            self.cache.insert(StoredKey { window: window.0, key: KeyBytes::new(key) }, Arc::clone(&cached));
            states.push(cached);
        }
        Ok(states)
    }

    /// The clean view of a key that is not dirty: cached, else read from Redis; `None` while
    /// Redis is unavailable.
    fn clean_view(&mut self, window: WindowId, key: &[u8]) -> Option<Arc<Cached>> {
        match self.cache.get(&KeyRef { window: window.0, key }) {
            Some(state) => Some(state),
            None => self.load(window, key),
        }
    }

    /// The view of a key that is neither dirty nor cached: read from Redis, or `None` while Redis
    /// is unavailable (the read failing opens the breaker).
    fn load(&mut self, window: WindowId, key: &[u8]) -> Option<Arc<Cached>> {
        if self.outage.is_some() {
            return None;
        }
        match self.read(&[(window, key)]) {
            Ok(mut states) => states.pop(),
            Err(e) => {
                self.fail(&e, "reading a window");
                None
            }
        }
    }
}

impl CounterStore for RedisStore {
    fn open_window(&mut self, name: &str, spec: WindowSpec) -> WindowId {
        self.windows.open(name, spec)
    }

    fn apply(&mut self, window: WindowId, key: &[u8], ts_ms: i64, delta: Delta) -> Result<Observed, StoreError> {
        let spec = self.windows.spec(window.0);
        let bucket = spec.bucket_of(ts_ms);
        let lookup = KeyRef { window: window.0, key };
        let observation = Observation { bucket, delta, origin: self.origin };
        let index = self.counted + 1;
        let (applied, counted, base_unknown) = match self.dirty.get_mut(&lookup) {
            Some(dirty) if codec::replayed(&dirty.offsets, observation.origin) => {
                (judge(&dirty.state, &spec, bucket), false, dirty.base_unknown)
            }
            Some(dirty) => {
                let applied = dirty.state.apply(&spec, bucket, delta);
                let counted = applied.is_counted();
                if counted {
                    dirty.push(observation, index);
                }
                (applied, counted, dirty.base_unknown)
            }
            None => {
                let clean = self.clean_view(window, key);
                match clean {
                    Some(clean) if codec::replayed(&clean.offsets, observation.origin) => {
                        (judge(&clean.state, &spec, bucket), false, false)
                    }
                    Some(clean) => {
                        let mut state = clean.state.clone();
                        let applied = state.apply(&spec, bucket, delta);
                        let counted = applied.is_counted();
                        if counted {
                            let stored = StoredKey { window: window.0, key: KeyBytes::new(key) };
                            let mut dirty =
                                Dirty::new(state, clean.version, clean.state.head(), clean.refreshed, clean.offsets.clone());
                            dirty.push(observation, index);
                            self.dirty.insert(stored, dirty);
                        }
                        (applied, counted, false)
                    }
                    None => {
                        // Redis is unavailable: count from nothing; the deltas are merged into
                        // whatever Redis holds when it answers again (applied ones skipped).
                        let mut state = WindowState::new(spec.aggregate);
                        let applied = state.apply(&spec, bucket, delta);
                        let mut dirty = Dirty::new(state, None, None, None, Offsets::new());
                        dirty.base_unknown = true;
                        dirty.push(observation, index);
                        self.dirty.insert(StoredKey { window: window.0, key: KeyBytes::new(key) }, dirty);
                        (applied, true, true)
                    }
                }
            }
        };
        let degraded = base_unknown || self.outage.is_some();
        if counted {
            self.pending += 1;
            self.counted += 1;
            if degraded {
                self.stats.degraded_observations += 1;
            }
        } else if observation.origin.is_some() && applied.is_counted() {
            self.stats.skipped_applied += 1;
        }
        // Writing behind is left to `tick`, which the caller runs between events: a flush then
        // never carries part of an event's deltas.
        Ok(Observed { applied, degraded })
    }

    fn read(&mut self, window: WindowId, key: &[u8], ts_ms: i64) -> Result<Observed, StoreError> {
        let spec = self.windows.spec(window.0);
        let bucket = spec.bucket_of(ts_ms);
        let lookup = KeyRef { window: window.0, key };
        if let Some(dirty) = self.dirty.get(&lookup) {
            let degraded = dirty.base_unknown || self.outage.is_some();
            return Ok(Observed { applied: dirty.state.read(&spec, bucket), degraded });
        }
        let clean = self.clean_view(window, key);
        Ok(match clean {
            Some(clean) => Observed { applied: clean.state.read(&spec, bucket), degraded: self.outage.is_some() },
            // Redis is unavailable and nothing was counted here: what this process knows is 0.
            None => Observed { applied: Applied::Counted(0), degraded: true },
        })
    }

    fn open_holds(&mut self, name: &str, ttl_ms: i64) -> HoldSpace {
        self.hold_spaces.open(name, ttl_ms)
    }

    /// The hold as Redis told it within the last flush interval (read again if older), raised by
    /// what this process set; while Redis is unavailable, what this process knows.
    fn held_until(&mut self, space: HoldSpace, key: &[u8]) -> Result<Option<i64>, StoreError> {
        let lookup = KeyRef { window: space.0, key };
        match self.holds.get(&lookup) {
            Some(view) if self.outage.is_some() || view.fresh(self.config.flush_interval) => return Ok(view.until),
            None if self.outage.is_some() => return Ok(None),
            _ => {}
        }
        self.read_holds(&[(space, key)]);
        Ok(self.holds.get(&lookup).and_then(|v| v.until))
    }

    /// Raised locally at once (so this process is exact), written behind with the next flush
    /// (so other workers see it within a flush interval).
    fn extend_hold(&mut self, space: HoldSpace, key: &[u8], until_ms: i64) -> Result<i64, StoreError> {
        let current = self.held_until(space, key)?;
        if current.is_some_and(|held| held >= until_ms) {
            return Ok(current.unwrap_or(until_ms));
        }
        self.counted += 1;
        let index = self.counted;
        if let Some(undo) = &mut self.batch {
            let before = self.holds.get(&KeyRef { window: space.0, key }).copied();
            undo.entry(StoredKey { window: space.0, key: KeyBytes::new(key) }).or_insert(before);
        }
        let view = self.holds.entry(StoredKey { window: space.0, key: KeyBytes::new(key) }).or_default();
        view.until = Some(until_ms);
        view.pending = Some(match view.pending {
            Some((_, first)) => (until_ms, first),
            None => {
                self.holds_pending += 1;
                (until_ms, index)
            }
        });
        Ok(until_ms)
    }

    fn prefetch_holds(&mut self, keys: &[(HoldSpace, Vec<u8>)]) -> Result<(), StoreError> {
        if self.outage.is_some() {
            return Ok(());
        }
        let interval = self.config.flush_interval;
        let mut wanted: Vec<(HoldSpace, &[u8])> = Vec::new();
        let mut seen: hashbrown::HashSet<KeyRef<'_>, foldhash::fast::RandomState> = Default::default();
        for (space, key) in keys {
            let lookup = KeyRef { window: space.0, key };
            if self.holds.get(&lookup).is_some_and(|v| v.fresh(interval)) {
                continue;
            }
            if seen.insert(KeyRef { window: space.0, key }) {
                wanted.push((*space, key));
            }
        }
        if !wanted.is_empty() {
            self.read_holds(&wanted);
        }
        Ok(())
    }

    fn set_origin(&mut self, origin: Option<Origin>) {
        self.origin = origin;
    }

    fn prefetches(&self) -> bool {
        self.outage.is_none()
    }

    /// One pipeline reading every key of the batch that is neither dirty nor cached. A failure
    /// opens the breaker: the keys are then counted locally.
    fn prefetch(&mut self, keys: &[(WindowId, Vec<u8>)]) -> Result<(), StoreError> {
        if self.outage.is_some() {
            return Ok(());
        }
        let mut wanted: Vec<(WindowId, &[u8])> = Vec::new();
        let mut seen: hashbrown::HashSet<KeyRef<'_>, foldhash::fast::RandomState> = Default::default();
        for (window, key) in keys {
            let lookup = KeyRef { window: window.0, key };
            if self.dirty.contains_key(&lookup) || self.cache.contains_key(&lookup) {
                continue;
            }
            if seen.insert(KeyRef { window: window.0, key }) {
                wanted.push((*window, key));
            }
        }
        if !wanted.is_empty() {
            if let Err(e) = self.read(&wanted) {
                self.fail(&e, "prefetching windows");
            }
        }
        Ok(())
    }

    /// Waits for the flush in flight, then sends everything still pending and waits for it: on
    /// success Redis holds every delta counted so far. Keys whose writes met another writer, or
    /// that were gone, come back pending and go again; a large re-seed takes several flushes.
    fn flush(&mut self) -> Result<(), StoreError> {
        self.complete(true)?;
        // Whoever waits for everything to be in Redis also learns whether Redis lost it.
        self.epoch_due = true;
        loop {
            self.send()?;
            self.complete(true)?;
            let settled = self.pending == 0 && self.holds_pending == 0 && !self.dirty.values().any(|d| d.full);
            if settled {
                self.update_durable();
                return Ok(());
            }
        }
    }

    fn live_keys(&self) -> usize {
        self.dirty.len() + self.cache.entry_count() as usize
    }

    fn counted_mark(&self) -> u64 {
        self.counted
    }

    fn durable_mark(&self) -> u64 {
        self.durable
    }

    fn tick(&mut self) -> Result<(), StoreError> {
        self.write_behind()
    }

    fn saturated(&self) -> bool {
        self.dirty.len() >= self.config.max_local_keys
    }

    fn forget_cached(&mut self) {
        self.cache.invalidate_all();
        // Hold views are read again too: another worker may have raised them meanwhile.
        for view in self.holds.values_mut() {
            view.read_at = None;
        }
    }

    fn begin_batch(&mut self) {
        self.batch = Some(HashMap::default());
    }

    fn end_batch(&mut self) {
        self.batch = None;
    }

    fn discard_batch(&mut self, lane: u64, since: i64) -> Result<(), StoreError> {
        // Hold raises: each view goes back to what it was before the batch raised it (before the
        // flush in flight is taken in below: a restored view still carries that flush's raise).
        for (key, before) in self.batch.take().unwrap_or_default() {
            match before {
                Some(view) => self.holds.insert(key, view),
                None => self.holds.remove(&key),
            };
        }
        self.holds_pending = self.holds.values().filter(|view| view.pending.is_some()).count();
        // Window deltas: none of the batch's has been sent (nothing is sent while a batch runs),
        // so once the flush in flight is in, they are all pending, tagged with lane and offset.
        let completed = self.complete(true);
        let fenced = |o: &Observation| o.origin.is_some_and(|origin| origin.lane == lane && origin.offset >= since);
        let (mut discarded, mut relearned) = (0, 0);
        let mut emptied = Vec::new();
        for (key, dirty) in self.dirty.iter_mut() {
            let before = dirty.pending.len();
            dirty.pending.retain(|o| !fenced(o));
            let removed = before - dirty.pending.len();
            if removed == 0 {
                continue;
            }
            self.pending -= removed;
            discarded += removed;
            if dirty.pending.is_empty() && dirty.inflight.is_empty() && !dirty.full {
                // Only the batch was unsent: the view is read again from Redis when needed.
                emptied.push(key.clone());
            } else {
                // Its view still holds the batch: with no known version, the next flush of the
                // rest brings back Redis' window, and the view becomes that plus what is pending.
                // (A key Redis lost is written from its view in full, batch included: after a
                // data loss the view is all there is.)
                dirty.pending_oldest = dirty.pending_oldest.filter(|_| !dirty.pending.is_empty());
                dirty.version = None;
                relearned += 1;
            }
        }
        for key in &emptied {
            self.dirty.remove(key);
            self.cache.invalidate(key);
        }
        tracing::warn!(discarded, dropped = emptied.len(), relearned, "counts of a batch another worker now owns taken back");
        // The rest goes now, so that no view holds the batch longer than this call.
        completed.and(self.flush())
    }

}

impl Drop for RedisStore {
    /// Shutdown flushes: what was counted reaches Redis unless Redis stays unreachable through
    /// every retry.
    fn drop(&mut self) {
        let _ = self.flush();
        // The threads end with their channels, once what they are doing returns (not waited
        // for: it may be waiting on a Redis that stopped answering).
        self.jobs = None;
        self.reads = None;
        drop(self.flusher.take());
        drop(self.reader.take());
    }
}
