//! The Redis store (DESIGN §5–§6): per key, the last window read from Redis merged with this
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

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use hashbrown::HashMap;

use super::keys::{KeyBytes, KeyRef, StoredKey};
use super::link::{slot, unavailable, Batch, Calls, KeyReply, Link, Target};
use super::scripts::ScriptCall;
use super::{CounterStore, Observed, Origin, StoreError, WindowId, Windows};
use crate::window::{Aggregate, Applied, Delta, WindowSpec, WindowState};

const FLUSHER_STOPPED: &str = "the flusher thread stopped";

/// Keys served by one script call. Bounded so one call never blocks Redis for long.
const KEYS_PER_CALL: usize = 256;

/// Tuning of the Redis store.
#[derive(Debug, Clone)]
pub struct RedisStoreConfig {
    /// Flush pending deltas at least this often.
    pub flush_interval: Duration,
    /// Flush as soon as this many observations are pending.
    pub max_pending: usize,
    /// Attempts per flush or load before giving up (pending deltas are kept either way).
    pub attempts: u32,
    /// First retry delay; doubles per attempt.
    pub retry_backoff: Duration,
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
            attempts: 5,
            retry_backoff: Duration::from_millis(20),
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
    /// for their key (input replayed after a crash or a rebalance).
    pub skipped_applied: u64,
    /// Keys whose writes met a version another writer had moved on; their deltas went again.
    pub stale_writes: u64,
    /// Flushes that failed after every retry (their deltas were kept and sent again).
    pub failed_flushes: u64,
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
}

impl Dirty {
    /// A key with `pending` observations (the oldest counted as `pending_oldest`) over a view of
    /// Redis at `version`, nothing in flight.
    fn new(
        state: WindowState,
        version: Option<u64>,
        base_head: Option<i64>,
        refreshed: Option<Instant>,
        offsets: Offsets,
        pending: Vec<Observation>,
        pending_oldest: Option<u64>,
    ) -> Dirty {
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
            pending,
            pending_oldest,
        }
    }

    /// Puts the in-flight deltas back in front of those counted since, to be sent again.
    fn send_again(&mut self) {
        let mut again = std::mem::take(&mut self.inflight);
        again.append(&mut self.pending);
        self.pending = again;
        self.pending_oldest = self.inflight_oldest.take().or(self.pending_oldest);
    }
}

/// One counted observation Redis has not acknowledged.
#[derive(Debug, Clone, Copy)]
struct Observation {
    bucket: i64,
    delta: Delta,
    origin: Option<Origin>,
}

/// Highest applied offset per lane (`o:<lane>` in Redis).
type Offsets = smallvec::SmallVec<[(u64, i64); 1]>;

fn offset_of(offsets: &Offsets, lane: u64) -> Option<i64> {
    offsets.iter().find(|(l, _)| *l == lane).map(|&(_, o)| o)
}

fn raise(offsets: &mut Offsets, lane: u64, offset: i64) {
    match offsets.iter_mut().find(|(l, _)| *l == lane) {
        Some(entry) => entry.1 = entry.1.max(offset),
        None => offsets.push((lane, offset)),
    }
}

/// A recorded offset field (`o:<lane>` → offset). Lanes vigil does not write (not a number)
/// are someone else's business: `None`.
fn recorded_offset(field: &[u8], value: &[u8]) -> Option<(u64, i64)> {
    let lane = std::str::from_utf8(field.strip_prefix(b"o:")?).ok()?.parse().ok()?;
    let offset = std::str::from_utf8(value).ok()?.parse().ok()?;
    Some((lane, offset))
}

/// Whether an observation from `origin` was applied before (its input is being replayed).
fn replayed(offsets: &Offsets, origin: Option<Origin>) -> bool {
    origin.is_some_and(|o| offset_of(offsets, o.lane).is_some_and(|applied| o.offset <= applied))
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

/// A parsed script reply for one key.
enum Reply {
    /// The key holds nothing.
    Empty,
    /// The caller's view was current (`=`): it holds what Redis holds now.
    Current { version: u64 },
    /// Redis' window (`*`), other writers' deltas included.
    Window { version: u64, state: WindowState, offsets: Offsets },
    /// Writes for a stale version, not made (`!`): the deltas are sent again.
    Stale,
}

/// What the flusher thread sends back for one pipeline.
struct FlushDone {
    result: Result<Calls, StoreError>,
    retries: u64,
}

struct Inflight {
    keys: Vec<StoredKey>,
    order: Vec<usize>,
    observations: usize,
    sent: Instant,
}

/// The write-behind task: runs flush batches on its own connection while the caller goes on.
fn flusher(mut link: Link, jobs: mpsc::Receiver<Batch<ScriptCall>>, done: mpsc::Sender<FlushDone>) {
    for batch in jobs {
        let (result, retries) = link.query(&batch);
        if done.send(FlushDone { result, retries }).is_err() {
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

/// Most slots one write may delete: a head that moved further is merged by the script instead.
const MAX_WRITE_DELETES: i64 = 64;

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

/// A version for a key created by this process: random, so that a key that expired and was
/// created again does not come back to a version someone's cached view was based on.
fn fresh_version() -> u64 {
    use std::hash::BuildHasher;
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEED: std::sync::LazyLock<foldhash::fast::RandomState> = std::sync::LazyLock::new(Default::default);
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    // Below 2^52: Lua's doubles then count up from it exactly.
    SEED.hash_one(COUNTER.fetch_add(1, Ordering::Relaxed)) % (1 << 52) + 1
}

/// Appends what a flush writes if Redis still holds `version` (the fast path of
/// `lua/apply_window.lua`): whether to refresh the TTL, the count of field/value entries, the entries — the next version
/// (`v`), the head (`h`), each bucket the deltas touched with its value in `state` (the view with
/// the deltas applied), or each distinct value with its latest bucket, by slot — then the slots
/// that slid out since `base_head`. False when that is not known here (a distinct window whose
/// head moved: the values that slid out are not kept): the script merges the deltas instead.
fn add_writes(
    call: &mut ScriptCall,
    spec: &WindowSpec,
    version: u64,
    refresh: bool,
    state: &WindowState,
    base_head: Option<i64>,
    deltas: &[Observation],
) -> bool {
    let Some(head) = state.head() else { return false };
    let k = spec.buckets;
    let oldest_live = head - k + 1;
    let moved = base_head.map_or(0, |base| head - base);
    call.arg(if refresh { b"1" } else { b"0" });
    let sets_count = call.placeholder();
    let sets_start = call.args();
    call.arg(b"v");
    call.int(if version == 0 { fresh_version() } else { version + 1 } as i64);
    call.arg(b"h");
    call.int(head);
    match state {
        WindowState::Series(_) => {
            let mut touched: smallvec::SmallVec<[i64; 4]> =
                deltas.iter().map(|o| o.bucket).filter(|&b| b >= oldest_live).collect();
            touched.sort_unstable();
            touched.dedup();
            for &bucket in &touched {
                let Some(value) = state.bucket_value(bucket) else { return false };
                call.int(bucket.rem_euclid(k));
                match spec.aggregate {
                    Aggregate::Sum => call.float(value),
                    _ => call.int(value as i64),
                }
            }
            add_offsets(call, deltas);
            call.fill(sets_count, call.args() - sets_start);
            if let Some(base) = base_head {
                if moved.min(k) > MAX_WRITE_DELETES {
                    return false;
                }
                for bucket in (base - k + 1)..=base.min(head - k) {
                    let slot = bucket.rem_euclid(k);
                    if !touched.iter().any(|&b| b.rem_euclid(k) == slot) {
                        call.int(slot);
                    }
                }
            }
        }
        WindowState::Distinct(_) => {
            if moved > 0 {
                return false;
            }
            let mut values: smallvec::SmallVec<[u128; 4]> = deltas
                .iter()
                .filter_map(|o| if let Delta::Distinct(v) = o.delta { Some(v) } else { None })
                .collect();
            values.sort_unstable();
            values.dedup();
            for value in values {
                let Some(latest) = state.latest_bucket(value) else { return false };
                if latest >= oldest_live {
                    let mut field = [0u8; 17];
                    field[0] = b'd';
                    field[1..].copy_from_slice(&value.to_le_bytes());
                    call.arg(&field);
                    call.int(latest.rem_euclid(k));
                }
            }
            add_offsets(call, deltas);
            call.fill(sets_count, call.args() - sets_start);
        }
    }
    true
}

/// The highest offset per lane of `deltas`, as `o:<lane>` fields.
fn add_offsets(call: &mut ScriptCall, deltas: &[Observation]) {
    let mut offsets = Offsets::new();
    for origin in deltas.iter().filter_map(|o| o.origin) {
        raise(&mut offsets, origin.lane, origin.offset);
    }
    for (lane, offset) in offsets {
        let mut field = itoa::Buffer::new().format(lane).as_bytes().to_vec();
        field.splice(0..0, *b"o:");
        call.arg(&field);
        call.int(offset);
    }
}

/// A key's window from its raw hash (HGETALL): fields by slot relative to the head `h`,
/// distinct values as `d<digest>`; `v` the version (an empty hash: version 0, nothing counted).
fn decode_hash(spec: &WindowSpec, flat: &[Vec<u8>]) -> Result<Cached, StoreError> {
    if flat.is_empty() {
        return Ok(Cached { state: WindowState::new(spec.aggregate), version: Some(0), refreshed: None, offsets: Offsets::new() });
    }
    let bad = |what: &str| StoreError::Protocol(format!("stored window: {what}"));
    fn text(bytes: &[u8]) -> Result<&str, StoreError> {
        std::str::from_utf8(bytes).map_err(|_| StoreError::Protocol("stored window: not text".into()))
    }
    if flat.len() % 2 != 0 {
        return Err(bad("odd field count"));
    }
    let (mut head, mut version) = (None, None);
    for pair in flat.chunks_exact(2) {
        match pair[0].as_slice() {
            b"h" => head = Some(text(&pair[1])?.parse::<i64>().map_err(|_| bad("bad head"))?),
            b"v" => version = Some(text(&pair[1])?.parse::<u64>().map_err(|_| bad("bad version"))?),
            _ => {}
        }
    }
    let head = head.ok_or_else(|| bad("no head"))?;
    let k = spec.buckets;
    let unslot = |slot: i64| head - (head - slot).rem_euclid(k);
    let (mut buckets, mut values, mut offsets) = (Vec::new(), Vec::new(), Offsets::new());
    for pair in flat.chunks_exact(2) {
        let (field, value) = (&pair[0], &pair[1]);
        if field.starts_with(b"o:") {
            if let Some((lane, offset)) = recorded_offset(field, value) {
                raise(&mut offsets, lane, offset);
            }
        } else if !field.is_empty() && field.iter().all(u8::is_ascii_digit) {
            let slot = text(field)?.parse::<i64>().map_err(|_| bad("bad slot"))?;
            let amount = text(value)?.parse::<f64>().map_err(|_| bad("bad amount"))?;
            buckets.push((unslot(slot), amount));
        } else if field.len() == 17 && field[0] == b'd' {
            let mut digest = [0u8; 16];
            digest.copy_from_slice(&field[1..]);
            let slot = text(value)?.parse::<i64>().map_err(|_| bad("bad slot"))?;
            values.push((u128::from_le_bytes(digest), unslot(slot)));
        }
    }
    let state = WindowState::from_window(spec, head, buckets, values);
    Ok(Cached { state, version: Some(version.unwrap_or(0)), refreshed: None, offsets })
}

pub struct RedisStore {
    /// For reads (loads and prefetches) on the caller's thread.
    link: Link,
    config: RedisStoreConfig,
    windows: Windows,
    /// Keys with unacknowledged deltas. Never evicted: nothing counted is dropped before Redis
    /// has acknowledged it.
    dirty: HashMap<StoredKey, Dirty, foldhash::fast::RandomState>,
    /// Clean windows as Redis last returned them: a bounded, time-to-idle read cache.
    cache: moka::sync::Cache<StoredKey, Arc<Cached>, foldhash::fast::RandomState>,
    /// Observations counted and not yet sent.
    pending: usize,
    /// The flush in flight: its keys, its batch's reply order, the counted mark it covers, its
    /// observation count and when it was sent.
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
    jobs: Option<mpsc::Sender<Batch<ScriptCall>>>,
    /// Cluster mode: script calls hold keys of one slot only.
    cluster: bool,
    done: mpsc::Receiver<FlushDone>,
    flusher: Option<std::thread::JoinHandle<()>>,
    last_flush: Instant,
    stats: RedisStats,
}

impl RedisStore {
    /// Connects to `url` (`redis://`, `redis://user:pass@host`, `rediss://`).
    pub fn connect(url: &str, config: RedisStoreConfig) -> Result<RedisStore, StoreError> {
        // rustls needs a process-wide crypto provider; a second install attempt is harmless.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = match &config.tls_ca_file {
            Some(path) => {
                let root_cert = std::fs::read(path).map_err(|e| {
                    StoreError::Unavailable(format!("cannot read CA file {}: {e}", path.display()))
                })?;
                let certs = redis::TlsCertificates { client_tls: None, root_cert: Some(root_cert) };
                redis::Client::build_with_tls(url, certs).map_err(unavailable)?
            }
            None => redis::Client::open(url).map_err(unavailable)?,
        };
        // A node with cluster mode on means a Redis Cluster: use the cluster client, seeded with it.
        let info: String = client
            .get_connection()
            .and_then(|mut conn| redis::cmd("INFO").arg("cluster").query(&mut conn))
            .map_err(unavailable)?;
        let cluster = info.lines().any(|l| l.trim() == "cluster_enabled:1");
        let target = if cluster {
            let cluster = redis::cluster::ClusterClient::new(vec![url]).map_err(unavailable)?;
            Target::Cluster { seed: client, cluster: Box::new(cluster) }
        } else {
            Target::Single(client)
        };
        let link = Link::open(target.clone(), &config)?;
        let flusher_link = Link::open(target, &config)?;
        let (jobs, job_rx) = mpsc::channel();
        let (done_tx, done) = mpsc::channel();
        let flusher = std::thread::Builder::new()
            .name("vigil-flusher".into())
            .spawn(move || flusher(flusher_link, job_rx, done_tx))
            .map_err(|e| StoreError::Unavailable(format!("cannot start the flusher thread: {e}")))?;
        Ok(RedisStore {
            link,
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
            stats: RedisStats::default(),
            config,
        })
    }

    pub fn stats(&self) -> RedisStats {
        self.stats
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
    /// covers the window's shape and the key, so user bytes never reach Redis raw and a rule whose
    /// window changes starts on fresh counters.
    pub fn redis_key(&self, window: WindowId, key: &[u8]) -> String {
        let spec = self.windows.spec(window.0);
        let name = self.windows.name(window.0);
        let mut hasher = blake3::Hasher::new();
        hasher.update(&spec.bucket_ms.to_le_bytes());
        hasher.update(&spec.buckets.to_le_bytes());
        hasher.update(spec.aggregate.as_str().as_bytes());
        hasher.update(key);
        let digest = hasher.finalize();
        let mut key_name = String::with_capacity(4 + name.len() + 32);
        key_name.push_str("vg:");
        key_name.push_str(name);
        key_name.push(':');
        push_hex(&mut key_name, &digest.as_bytes()[..16]);
        key_name
    }

    /// Appends one key to a script call: the key, its header, and either the writes to make if
    /// Redis still holds the version the view is based on (see `add_writes`), or the in-flight
    /// deltas for the script to merge.
    fn add_key(&self, call: &mut ScriptCall, name: &str, window: WindowId, dirty: &Dirty) {
        let spec = self.windows.spec(window.0);
        let deltas = &dirty.inflight;
        // With every delta tagged, the script skips those it applied before (stride 4).
        let tagged = deltas.iter().all(|o| o.origin.is_some());
        call.key(name.as_bytes());
        call.arg(match spec.aggregate {
            Aggregate::Count => b"c",
            Aggregate::Sum => b"s",
            Aggregate::Distinct => b"d",
        });
        call.int(spec.buckets);
        call.int(ttl_ms(&spec, self.config.max_lateness));
        call.int(if tagged { 4 } else { 2 });
        match dirty.version {
            Some(version) => call.int(version as i64),
            None => call.arg(b""),
        }
        let deltas_count = call.placeholder();
        let writes_count = call.placeholder();
        if let Some(version) = dirty.version {
            let mark = call.mark();
            if add_writes(call, &spec, version, dirty.refresh_sent, &dirty.state, dirty.base_head, deltas) {
                call.fill(writes_count, call.args() - mark.1);
                return;
            }
            call.truncate(mark);
        }
        let deltas_start = call.args();
        if !tagged && spec.aggregate == Aggregate::Count {
            // Untagged increments commute: one per bucket.
            let mut per_bucket: smallvec::SmallVec<[(i64, i64); 4]> = Default::default();
            for o in deltas {
                match per_bucket.iter_mut().find(|(b, _)| *b == o.bucket) {
                    Some(entry) => entry.1 += 1,
                    None => per_bucket.push((o.bucket, 1)),
                }
            }
            for (bucket, n) in per_bucket {
                call.int(bucket);
                call.int(n);
            }
        } else {
            for o in deltas {
                call.int(o.bucket);
                match o.delta {
                    Delta::Count => call.int(1),
                    Delta::Sum(amount) => call.float(amount),
                    Delta::Distinct(value) => call.arg(&value.to_le_bytes()),
                }
                if let (true, Some(origin)) = (tagged, o.origin) {
                    call.uint(origin.lane);
                    call.int(origin.offset);
                }
            }
        }
        call.fill(deltas_count, call.args() - deltas_start);
    }

    /// Script calls covering the in-flight deltas of `keys`, up to `KEYS_PER_CALL` keys per
    /// call; in cluster mode each call holds keys of one hash slot.
    fn batch(&self, keys: &[StoredKey]) -> Batch<ScriptCall> {
        let mut groups: Vec<(u16, Vec<usize>, ScriptCall)> = Vec::new();
        let mut open: HashMap<u16, usize> = HashMap::new();
        let mut batch = Batch { calls: Vec::new(), slots: Vec::new(), order: Vec::new() };
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
            self.add_key(&mut groups[group].2, &name, window, &self.dirty[key]);
            groups[group].1.push(index);
            if groups[group].1.len() == KEYS_PER_CALL {
                open.remove(&group_slot);
            }
        }
        for (group_slot, members, call) in groups {
            batch.order.extend(members);
            batch.calls.push(call);
            batch.slots.push(group_slot);
        }
        batch
    }

    /// Flattens per-call replies back into the order the keys were given.
    fn replies(&mut self, calls: Calls, order: &[usize]) -> Result<Vec<KeyReply>, StoreError> {
        self.stats.script_calls += calls.len() as u64;
        let flat: Vec<KeyReply> = calls.into_iter().flatten().collect();
        if flat.len() != order.len() {
            return Err(StoreError::Protocol(format!("{} replies for {} keys", flat.len(), order.len())));
        }
        let mut replies = vec![Vec::new(); order.len()];
        for (reply, &index) in flat.into_iter().zip(order) {
            replies[index] = reply;
        }
        Ok(replies)
    }

    /// Parses the script's reply for one key.
    fn parse_reply(&mut self, window: WindowId, reply: KeyReply) -> Result<Reply, StoreError> {
        let spec = self.windows.spec(window.0);
        if reply.is_empty() {
            return Ok(Reply::Empty);
        }
        if reply.len() == 1 && reply[0] == b"!" {
            return Ok(Reply::Stale);
        }
        let bad = |what: &str| StoreError::Protocol(format!("apply_window reply: {what}"));
        let number = |bytes: &[u8]| -> Result<f64, StoreError> {
            std::str::from_utf8(bytes).ok().and_then(|s| s.parse::<f64>().ok()).ok_or_else(|| bad("not a number"))
        };
        if reply.len() < 5 || reply.len() % 2 == 0 {
            return Err(bad("wrong length"));
        }
        let head = number(&reply[0])? as i64;
        self.stats.refused_late += number(&reply[1])? as u64;
        self.stats.skipped_applied += number(&reply[2])? as u64;
        let version = number(&reply[3])? as u64;
        match reply[4].as_slice() {
            b"=" => return Ok(Reply::Current { version }),
            b"*" => {}
            _ => return Err(bad("unknown marker")),
        }
        let (mut buckets, mut values, mut offsets) = (Vec::new(), Vec::new(), Offsets::new());
        for pair in reply[5..].chunks_exact(2) {
            let (field, value) = (&pair[0], &pair[1]);
            if field.starts_with(b"o:") {
                if let Some((lane, offset)) = recorded_offset(field, value) {
                    raise(&mut offsets, lane, offset);
                }
                continue;
            }
            match field.first() {
                Some(b'b') => buckets.push((number(&field[1..])? as i64, number(value)?)),
                Some(b'd') if field.len() == 17 => {
                    let mut digest = [0u8; 16];
                    digest.copy_from_slice(&field[1..]);
                    values.push((u128::from_le_bytes(digest), number(value)? as i64));
                }
                _ => return Err(bad("unknown field")),
            }
        }
        let state = WindowState::from_window(&spec, head, buckets, values);
        Ok(Reply::Window { version, state, offsets })
    }

    /// Hands every pending delta to the flusher, one script call per 256 dirty keys.
    fn send(&mut self) -> Result<(), StoreError> {
        debug_assert!(self.inflight.is_none());
        self.last_flush = Instant::now();
        let keys: Vec<StoredKey> =
            self.dirty.iter().filter(|(_, d)| !d.pending.is_empty()).map(|(k, _)| k.clone()).collect();
        if keys.is_empty() {
            // Nothing pending and nothing in flight: everything counted is in Redis.
            self.durable = self.counted;
            return Ok(());
        }
        for key in &keys {
            let dirty = self.dirty.get_mut(key).expect("listed above");
            dirty.inflight = std::mem::take(&mut dirty.pending);
            dirty.inflight_oldest = dirty.pending_oldest.take();
            dirty.sent_head = dirty.state.head();
            dirty.refresh_sent = refresh_due(&self.windows.spec(key.window), dirty.version, dirty.refreshed);
        }
        let batch = self.batch(&keys);
        let order = batch.order.clone();
        let jobs = self.jobs.as_ref().expect("the flusher runs until drop");
        jobs.send(batch).map_err(|_| StoreError::Unavailable(FLUSHER_STOPPED.into()))?;
        self.inflight = Some(Inflight { keys, order, observations: self.pending, sent: Instant::now() });
        self.pending = 0;
        Ok(())
    }

    /// Takes in the flush in flight: waits for it if `wait`, else only if it is already done.
    fn complete(&mut self, wait: bool) -> Result<(), StoreError> {
        if self.inflight.is_none() {
            return Ok(());
        }
        let done = if wait {
            self.done.recv().map_err(|_| StoreError::Unavailable(FLUSHER_STOPPED.into()))?
        } else {
            match self.done.try_recv() {
                Ok(done) => done,
                Err(mpsc::TryRecvError::Empty) => return Ok(()),
                Err(mpsc::TryRecvError::Disconnected) => {
                    return Err(StoreError::Unavailable(FLUSHER_STOPPED.into()))
                }
            }
        };
        let Inflight { keys, order, observations, sent } = self.inflight.take().expect("checked above");
        self.stats.retries += done.retries;
        let replies = match done.result.and_then(|calls| self.replies(calls, &order)) {
            Ok(replies) => replies,
            Err(e) => {
                // Not applied (or not known to be): the deltas go back in front of what was
                // counted since, and the next flush sends them again.
                for key in &keys {
                    let dirty = self.dirty.get_mut(key).expect("in flight keys stay dirty");
                    self.pending += dirty.inflight.len();
                    dirty.send_again();
                }
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
        // refused as stale. A reply we cannot read only costs the cached copy.
        let mut first_error = None;
        for (key, reply) in keys.into_iter().zip(replies) {
            let window = WindowId(key.window);
            let spec = self.windows.spec(key.window);
            let parsed = self.parse_reply(window, reply);
            if let Ok(Reply::Stale) = parsed {
                // Another writer moved the key on: send the deltas to be merged, and learn its
                // window from that reply.
                let dirty = self.dirty.get_mut(&key).expect("in flight keys stay dirty");
                self.pending += dirty.inflight.len();
                dirty.send_again();
                dirty.version = None;
                self.stats.stale_writes += 1;
                continue;
            }
            let dirty = self.dirty.remove(&key).expect("in flight keys stay dirty");
            // Conservative: the refresh happened after the flush was sent.
            let refreshed = if dirty.refresh_sent { Some(sent) } else { dirty.refreshed };
            let (state, version, base_head, offsets) = match parsed {
                // Nobody else wrote since our view: it already holds the in-flight deltas and
                // those counted since, exactly as Redis now does plus what it has not seen.
                Ok(Reply::Current { version }) => {
                    let mut offsets = dirty.offsets;
                    for origin in dirty.inflight.iter().filter_map(|o| o.origin) {
                        raise(&mut offsets, origin.lane, origin.offset);
                    }
                    (dirty.state, Some(version), dirty.sent_head, offsets)
                }
                Ok(reply @ (Reply::Window { .. } | Reply::Empty)) => {
                    // The window as Redis has it now, plus what was counted since it was sent.
                    let (mut state, version, offsets) = match reply {
                        Reply::Window { version, state, offsets } => (state, version, offsets),
                        _ => (WindowState::new(spec.aggregate), 0, Offsets::new()),
                    };
                    let base_head = state.head();
                    for o in &dirty.pending {
                        state.apply(&spec, o.bucket, o.delta);
                    }
                    (state, Some(version), base_head, offsets)
                }
                Ok(Reply::Stale) => unreachable!("handled above"),
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
                let dirty = Dirty::new(state, version, base_head, refreshed, offsets, dirty.pending, dirty.pending_oldest);
                self.dirty.insert(key, dirty);
            }
        }
        // Durable: everything counted before the oldest observation Redis has not acknowledged.
        let oldest = self.dirty.values().filter_map(|d| d.pending_oldest).min();
        self.durable = oldest.map_or(self.counted, |oldest| oldest - 1);
        first_error.map_or(Ok(()), Err)
    }

    /// Takes in a finished flush and starts the next when one is due; waits for Redis only under
    /// backpressure. A failed flush is kept for `take_flush_error`, not returned: its deltas stay
    /// pending. Only a stopped flusher thread is an error.
    fn write_behind(&mut self) -> Result<(), StoreError> {
        let mut result = self.complete(false);
        let due = self.pending >= self.config.max_pending || self.last_flush.elapsed() >= self.config.flush_interval;
        if due && self.inflight.is_none() {
            self.send()?;
        } else if self.pending >= self.config.max_pending.max(1).saturating_mul(2) {
            // Backpressure: Redis is slower than counting; wait for it rather than grow.
            result = result.and(self.complete(true));
            self.send()?;
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
        let mut batch = Batch { calls: Vec::with_capacity(keys.len()), slots: Vec::new(), order: Vec::new() };
        for &(window, key) in keys {
            let name = self.redis_key(window, key);
            batch.slots.push(if self.cluster { slot(&name) } else { 0 });
            let mut hgetall = redis::cmd("HGETALL");
            hgetall.arg(name);
            batch.calls.push(hgetall);
        }
        let (replies, retries) = self.link.query(&batch);
        self.stats.retries += retries;
        let replies = replies?;
        if replies.len() != keys.len() {
            return Err(StoreError::Protocol(format!("{} replies for {} reads", replies.len(), keys.len())));
        }
        self.stats.loads += replies.len() as u64;
        let mut states = Vec::with_capacity(keys.len());
        for (&(window, key), reply) in keys.iter().zip(replies) {
            let cached = Arc::new(decode_hash(&self.windows.spec(window.0), &reply)?);
            self.cache.insert(StoredKey { window: window.0, key: KeyBytes::new(key) }, Arc::clone(&cached));
            states.push(cached);
        }
        Ok(states)
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
        let (applied, counted) = match self.dirty.get_mut(&lookup) {
            Some(dirty) if replayed(&dirty.offsets, observation.origin) => (judge(&dirty.state, &spec, bucket), false),
            Some(dirty) => {
                let applied = dirty.state.apply(&spec, bucket, delta);
                let counted = matches!(applied, Applied::Counted(_));
                if counted {
                    dirty.pending.push(observation);
                    dirty.pending_oldest.get_or_insert(index);
                }
                (applied, counted)
            }
            None => {
                let clean = match self.cache.get(&lookup) {
                    Some(state) => state,
                    None => self.read(&[(window, key)])?.pop().expect("one state per key"),
                };
                if replayed(&clean.offsets, observation.origin) {
                    (judge(&clean.state, &spec, bucket), false)
                } else {
                    let mut state = clean.state.clone();
                    let applied = state.apply(&spec, bucket, delta);
                    let counted = matches!(applied, Applied::Counted(_));
                    if counted {
                        let stored = StoredKey { window: window.0, key: KeyBytes::new(key) };
                        let base_head = clean.state.head();
                        let offsets = clean.offsets.clone();
                        let dirty =
                            Dirty::new(state, clean.version, base_head, clean.refreshed, offsets, vec![observation], Some(index));
                        self.dirty.insert(stored, dirty);
                    }
                    (applied, counted)
                }
            }
        };
        if counted {
            self.pending += 1;
            self.counted += 1;
        } else if observation.origin.is_some() && matches!(applied, Applied::Counted(_)) {
            self.stats.skipped_applied += 1;
        }
        // The observation is counted whatever happens to the write-behind: a failed flush keeps
        // its deltas for the next one and is reported through `take_flush_error`.
        self.write_behind()?;
        Ok(Observed::exact(applied))
    }

    fn set_origin(&mut self, origin: Option<Origin>) {
        self.origin = origin;
    }

    fn prefetches(&self) -> bool {
        true
    }

    /// One pipeline reading every key of the batch that is neither dirty nor cached.
    fn prefetch(&mut self, keys: &[(WindowId, Vec<u8>)]) -> Result<(), StoreError> {
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
            self.read(&wanted)?;
        }
        Ok(())
    }

    /// Waits for the flush in flight, then sends everything still pending and waits for it: on
    /// return Redis holds every delta counted so far.
    fn flush(&mut self) -> Result<(), StoreError> {
        self.complete(true)?;
        self.send()?;
        self.complete(true)
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
}

impl Drop for RedisStore {
    /// Shutdown flushes: what was counted reaches Redis unless Redis stays unreachable through
    /// every retry. Then the flusher thread ends with its channel.
    fn drop(&mut self) {
        let _ = self.flush();
        self.jobs = None;
        if let Some(flusher) = self.flusher.take() {
            let _ = flusher.join();
        }
    }
}
