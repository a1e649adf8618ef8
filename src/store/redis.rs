//! The Redis store (DESIGN §5–§6): per key, the last window read from Redis merged with this
//! process's deltas since; deltas written behind by a flusher thread in batched script calls
//! (`lua/apply_window.lua`, up to 256 keys per call; one hash slot per call on a Redis Cluster).
//!
//! Exactness: a single process sees exactly what the in-memory store sees. Counts are integers;
//! sums are sent as the individual amounts in counting order and added by the script in that same
//! order in IEEE doubles (Lua's numbers), stored as the shortest text that reads back bit-for-bit;
//! distinct values keep their latest bucket. When a flush is acknowledged, the key's state becomes
//! the window the script returned (which also holds other workers' deltas) plus the deltas
//! counted since the flush was sent.

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use hashbrown::HashMap;

use super::keys::{KeyBytes, KeyRef, StoredKey};
use super::scripts::APPLY_WINDOW;
use super::{CounterStore, StoreError, WindowId, Windows};
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
    /// Deltas skipped as already applied (offset at or below the recorded one).
    pub skipped_applied: u64,
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
    /// The Redis version (`v`) the view is based on; `None` if Redis held nothing.
    version: Option<u64>,
    inflight: Vec<(i64, Delta)>,
    pending: Vec<(i64, Delta)>,
}

/// A clean window as Redis returned it, with its version.
struct Cached {
    state: WindowState,
    version: Option<u64>,
}

/// A parsed script reply for one key.
struct Reply {
    version: u64,
    /// The window, unless the caller's view was current (`=`).
    window: Option<WindowState>,
}

/// One key's reply: its items (head, late, skipped, field, value, …).
type KeyReply = Vec<Vec<u8>>;
/// One script call's reply: per key.
type CallReply = Vec<KeyReply>;
/// A batch's replies: per call.
type Calls = Vec<CallReply>;

/// What the flusher thread sends back for one pipeline.
struct FlushDone {
    result: Result<Calls, StoreError>,
    retries: u64,
}

/// Where the store connects: one Redis, or a Redis Cluster (found from the URL's node, whose
/// client also gives the credentials and TLS settings for direct connections to each master).
#[derive(Clone)]
enum Target {
    Single(redis::Client),
    Cluster { seed: redis::Client, cluster: Box<redis::cluster::ClusterClient> },
}

enum Conn {
    Single(redis::Connection),
    Cluster(Box<ClusterConn>),
}

/// A Redis Cluster: calls are pipelined per master on direct connections, by the slot map; a call
/// answered with MOVED/ASK (the map changed) is sent again through the cluster client, which
/// follows redirects, and the map is read anew.
struct ClusterConn {
    cluster: redis::cluster::ClusterConnection,
    seed: redis::Client,
    /// Master index per hash slot.
    slot_owner: Vec<usize>,
    masters: Vec<(String, u16, Option<redis::Connection>)>,
}

impl ClusterConn {
    fn open(seed: &redis::Client, cluster: &redis::cluster::ClusterClient) -> redis::RedisResult<ClusterConn> {
        let mut conn = ClusterConn {
            cluster: cluster.get_connection()?,
            seed: seed.clone(),
            slot_owner: vec![0; 16384],
            masters: Vec::new(),
        };
        conn.read_slot_map()?;
        Ok(conn)
    }

    /// `CLUSTER SLOTS`: each range's master.
    fn read_slot_map(&mut self) -> redis::RedisResult<()> {
        let mut any = self.seed.get_connection()?;
        let ranges: Vec<(u16, u16, (String, u16))> = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query::<Vec<redis::Value>>(&mut any)?
            .into_iter()
            .filter_map(|range| {
                let redis::Value::Array(items) = range else { return None };
                let start: u16 = redis::from_redis_value(items.first()?.clone()).ok()?;
                let end: u16 = redis::from_redis_value(items.get(1)?.clone()).ok()?;
                let redis::Value::Array(master) = items.get(2)? else { return None };
                let host: String = redis::from_redis_value(master.first()?.clone()).ok()?;
                let port: u16 = redis::from_redis_value(master.get(1)?.clone()).ok()?;
                Some((start, end, (host, port)))
            })
            .collect();
        for (start, end, (host, port)) in ranges {
            let index = match self.masters.iter().position(|(h, p, _)| *h == host && *p == port) {
                Some(index) => index,
                None => {
                    self.masters.push((host, port, None));
                    self.masters.len() - 1
                }
            };
            for slot in start..=end.min(16383) {
                self.slot_owner[usize::from(slot)] = index;
            }
        }
        Ok(())
    }

    /// A direct connection to a master, with the seed's credentials and TLS settings.
    fn master(&mut self, index: usize) -> redis::RedisResult<&mut redis::Connection> {
        let (host, port, conn) = &mut self.masters[index];
        if conn.is_none() {
            let info = self.seed.get_connection_info().clone();
            let addr = match info.addr() {
                redis::ConnectionAddr::TcpTls { insecure, tls_params, .. } => redis::ConnectionAddr::TcpTls {
                    host: host.clone(),
                    port: *port,
                    insecure: *insecure,
                    tls_params: tls_params.clone(),
                },
                _ => redis::ConnectionAddr::Tcp(host.clone(), *port),
            };
            *conn = Some(redis::Client::open(info.set_addr(addr))?.get_connection()?);
        }
        Ok(conn.as_mut().expect("opened above"))
    }

    /// Runs every call, grouped per master, keeping each call's result across attempts: only
    /// calls that have not run are sent again (after a reconnect or a fresh slot map), so no call
    /// is applied twice because another master failed.
    fn run(&mut self, batch: &Batch, attempts: u32, backoff: Duration) -> (redis::RedisResult<Calls>, u64) {
        let mut results: Vec<Option<CallReply>> = vec![None; batch.calls.len()];
        let mut delay = backoff;
        let mut retries = 0;
        loop {
            let (redirected, error) = match self.run_pending(batch, &mut results) {
                Ok(redirected) => (redirected, None),
                Err(e) => (0, Some(e)),
            };
            retries += redirected;
            if results.iter().all(Option::is_some) {
                let calls = results.into_iter().map(|r| r.expect("checked above")).collect();
                return (Ok(calls), retries);
            }
            let error = error.unwrap_or_else(|| redis::RedisError::from((redis::ErrorKind::Io, "calls left unanswered")));
            if retries + 1 >= u64::from(attempts) {
                return (Err(error), retries);
            }
            retries += 1;
            std::thread::sleep(delay);
            delay *= 2;
            let _ = self.read_slot_map();
        }
    }

    /// One pass over the calls without a result; returns how many were redirected (MOVED/ASK or
    /// NOSCRIPT) and run again through the cluster client.
    fn run_pending(&mut self, batch: &Batch, results: &mut [Option<CallReply>]) -> redis::RedisResult<u64> {
        let mut per_master: Vec<Vec<usize>> = vec![Vec::new(); self.masters.len()];
        for (call, &slot) in batch.slots.iter().enumerate() {
            if results[call].is_none() {
                per_master[self.slot_owner[usize::from(slot)]].push(call);
            }
        }
        let mut first_error = None;
        let mut redirected = Vec::new();
        for (master, calls) in per_master.into_iter().enumerate().filter(|(_, c)| !c.is_empty()) {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            for &call in &calls {
                pipe.invoke_script(&batch.calls[call]);
            }
            let replies: redis::RedisResult<Vec<redis::RedisResult<CallReply>>> =
                self.master(master).and_then(|conn| pipe.query(conn));
            let replies = match replies {
                Ok(replies) => replies,
                Err(e) => {
                    // This master's calls stay pending; a new connection is opened next pass.
                    self.masters[master].2 = None;
                    first_error.get_or_insert(e);
                    continue;
                }
            };
            for (call, reply) in calls.into_iter().zip(replies) {
                match reply {
                    Ok(reply) => results[call] = Some(reply),
                    Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                        load_on_all_masters(&mut self.cluster)?;
                        redirected.push(call);
                    }
                    // MOVED/ASK: the call did not run on this node.
                    Err(e) if e.is_cluster_error() => redirected.push(call),
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
            }
        }
        let redirects = redirected.len() as u64;
        if !redirected.is_empty() {
            for call in redirected {
                match batch.calls[call].invoke(&mut self.cluster) {
                    Ok(reply) => results[call] = Some(reply),
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
            }
            self.read_slot_map()?;
        }
        first_error.map_or(Ok(redirects), Err)
    }
}

impl Target {
    fn connect(&self) -> redis::RedisResult<Conn> {
        match self {
            Target::Single(client) => client.get_connection().map(Conn::Single),
            Target::Cluster { seed, cluster } => ClusterConn::open(seed, cluster).map(|c| Conn::Cluster(Box::new(c))),
        }
    }
}

/// Script calls covering a set of keys: the calls, each call's hash slot (all its keys share
/// it in cluster mode), and for each reply (in call order) the index of its key.
struct Batch {
    calls: Vec<redis::ScriptInvocation<'static>>,
    slots: Vec<u16>,
    order: Vec<usize>,
}

/// A connection that reconnects, and retries with exponential backoff, when Redis goes away; and
/// loads the script and retries on NOSCRIPT (after a Redis restart or `SCRIPT FLUSH`).
struct Link {
    target: Target,
    conn: Conn,
    attempts: u32,
    backoff: Duration,
}

impl Link {
    fn open(target: Target, config: &RedisStoreConfig) -> Result<Link, StoreError> {
        let conn = target.connect().map_err(unavailable)?;
        Ok(Link { target, conn, attempts: config.attempts, backoff: config.retry_backoff })
    }

    /// Runs `batch`; also returns how many failed attempts were retried. A cluster retries call by
    /// call (`ClusterConn::run`); a single Redis runs the batch as one pipeline, retried whole.
    fn query(&mut self, batch: &Batch) -> (Result<Calls, StoreError>, u64) {
        if let Conn::Cluster(conn) = &mut self.conn {
            let (result, retries) = conn.run(batch, self.attempts, self.backoff);
            return (result.map_err(unavailable), retries);
        }
        let mut pipe = redis::pipe();
        for call in &batch.calls {
            pipe.invoke_script(call);
        }
        let mut delay = self.backoff;
        let mut retries = 0;
        loop {
            let Conn::Single(conn) = &mut self.conn else { unreachable!("handled above") };
            let error = match pipe.query(conn) {
                Ok(replies) => return (Ok(replies), retries),
                Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                    APPLY_WINDOW.prepare_invoke().load(conn).err()
                }
                Err(e) => Some(e),
            };
            if let Some(e) = error {
                if retries + 1 >= u64::from(self.attempts) {
                    return (Err(unavailable(e)), retries);
                }
                std::thread::sleep(delay);
                delay *= 2;
                if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
                    if let Ok(conn) = self.target.connect() {
                        self.conn = conn;
                    }
                }
            }
            retries += 1;
        }
    }
}

/// Every master needs the script: SCRIPT LOAD routed to all of them.
fn load_on_all_masters(conn: &mut redis::cluster::ClusterConnection) -> redis::RedisResult<()> {
    let mut load = redis::cmd("SCRIPT");
    load.arg("LOAD").arg(include_str!("../../lua/apply_window.lua"));
    let route = redis::cluster_routing::RoutingInfo::MultiNode((
        redis::cluster_routing::MultipleNodeRoutingInfo::AllMasters,
        None,
    ));
    conn.route_command(&load, route).map(drop)
}

struct Inflight {
    keys: Vec<StoredKey>,
    order: Vec<usize>,
    mark: u64,
    observations: usize,
    sent: Instant,
}

/// The write-behind task: runs flush batches on its own connection while the caller goes on.
fn flusher(mut link: Link, jobs: mpsc::Receiver<Batch>, done: mpsc::Sender<FlushDone>) {
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

/// The Redis Cluster hash slot of a key (CRC16/XMODEM mod 16384). vigil's keys never hold `{`,
/// so the whole key is hashed.
fn slot(key: &str) -> u16 {
    let mut crc: u16 = 0;
    for &byte in key.as_bytes() {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc % 16384
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
    /// Observations counted so far (`CounterStore::counted_mark`).
    counted: u64,
    /// Every observation up to this mark is in Redis (`CounterStore::durable_mark`).
    durable: u64,
    /// Acknowledged flushes not yet taken by `take_flush_samples`.
    samples: Vec<FlushSample>,
    /// The last flush failure not yet reported.
    last_error: Option<StoreError>,
    jobs: Option<mpsc::Sender<Batch>>,
    /// Cluster mode: script calls hold keys of one slot only.
    cluster: bool,
    done: mpsc::Receiver<FlushDone>,
    flusher: Option<std::thread::JoinHandle<()>>,
    last_flush: Instant,
    stats: RedisStats,
}

fn unavailable(e: redis::RedisError) -> StoreError {
    StoreError::Unavailable(e.to_string())
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

    /// Appends one key to a script invocation: the key, its header and its `deltas` (none: just
    /// read the window).
    fn add_key(
        &self,
        inv: &mut redis::ScriptInvocation<'_>,
        name: String,
        window: WindowId,
        expected: Option<u64>,
        deltas: &[(i64, Delta)],
    ) {
        let spec = self.windows.spec(window.0);
        let mut args: Vec<Vec<u8>> = Vec::with_capacity(2 * deltas.len());
        match spec.aggregate {
            Aggregate::Count => {
                // Increments commute: one per bucket.
                let mut per_bucket: Vec<(i64, i64)> = Vec::new();
                for &(bucket, _) in deltas {
                    match per_bucket.iter_mut().find(|(b, _)| *b == bucket) {
                        Some(entry) => entry.1 += 1,
                        None => per_bucket.push((bucket, 1)),
                    }
                }
                for (bucket, n) in per_bucket {
                    args.push(bucket.to_string().into_bytes());
                    args.push(n.to_string().into_bytes());
                }
            }
            Aggregate::Sum => {
                for &(bucket, delta) in deltas {
                    if let Delta::Sum(amount) = delta {
                        // `{:?}` is the shortest text that parses back to the same double.
                        args.push(bucket.to_string().into_bytes());
                        args.push(format!("{amount:?}").into_bytes());
                    }
                }
            }
            Aggregate::Distinct => {
                for &(bucket, delta) in deltas {
                    if let Delta::Distinct(value) = delta {
                        args.push(bucket.to_string().into_bytes());
                        args.push(value.to_le_bytes().to_vec());
                    }
                }
            }
        }
        inv.key(name)
            .arg(match spec.aggregate {
                Aggregate::Count => "c",
                Aggregate::Sum => "s",
                Aggregate::Distinct => "d",
            })
            .arg(spec.buckets)
            .arg(2 * spec.window_ms())
            .arg(2)
            .arg(expected.map_or_else(String::new, |v| v.to_string()))
            .arg(args.len());
        for a in args {
            inv.arg(a);
        }
    }

    /// Script calls covering `keys` (with their deltas), up to `KEYS_PER_CALL` keys per call; in
    /// cluster mode each call holds keys of one hash slot.
    fn batch<'k>(&self, keys: impl Iterator<Item = (WindowId, &'k [u8], Option<u64>, &'k [(i64, Delta)])>) -> Batch {
        let mut groups: Vec<(u16, Vec<usize>, redis::ScriptInvocation<'static>)> = Vec::new();
        let mut open: HashMap<u16, usize> = HashMap::new();
        let mut batch = Batch { calls: Vec::new(), slots: Vec::new(), order: Vec::new() };
        for (index, (window, key, expected, deltas)) in keys.enumerate() {
            let name = self.redis_key(window, key);
            let group_slot = if self.cluster { slot(&name) } else { 0 };
            let group = match open.get(&group_slot) {
                Some(&g) => g,
                None => {
                    groups.push((group_slot, Vec::new(), APPLY_WINDOW.prepare_invoke()));
                    open.insert(group_slot, groups.len() - 1);
                    groups.len() - 1
                }
            };
            self.add_key(&mut groups[group].2, name, window, expected, deltas);
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

    /// Runs a read batch on the caller's thread: one reply per key, in the keys' order.
    fn run(&mut self, batch: &Batch) -> Result<Vec<KeyReply>, StoreError> {
        let (calls, retries) = self.link.query(batch);
        self.stats.retries += retries;
        self.replies(calls?, &batch.order)
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

    /// Parses the script's reply for one key (`None`: the key holds nothing).
    fn parse_reply(&mut self, window: WindowId, reply: KeyReply) -> Result<Option<Reply>, StoreError> {
        let spec = self.windows.spec(window.0);
        if reply.is_empty() {
            return Ok(None);
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
            b"=" => return Ok(Some(Reply { version, window: None })),
            b"*" => {}
            _ => return Err(bad("unknown marker")),
        }
        let mut buckets = Vec::new();
        let mut values = Vec::new();
        for pair in reply[5..].chunks_exact(2) {
            let (field, value) = (&pair[0], &pair[1]);
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
        let window = WindowState::from_window(&spec, head, buckets, values);
        Ok(Some(Reply { version, window: Some(window) }))
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
        }
        let batch = self.batch(keys.iter().map(|k| {
            let dirty = &self.dirty[k];
            (WindowId(k.window), k.key.as_slice(), dirty.version, dirty.inflight.as_slice())
        }));
        let order = batch.order.clone();
        let jobs = self.jobs.as_ref().expect("the flusher runs until drop");
        jobs.send(batch).map_err(|_| StoreError::Unavailable(FLUSHER_STOPPED.into()))?;
        self.inflight = Some(Inflight { keys, order, mark: self.counted, observations: self.pending, sent: Instant::now() });
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
        let Inflight { keys, order, mark, observations, sent } = self.inflight.take().expect("checked above");
        self.stats.retries += done.retries;
        let replies = match done.result.and_then(|calls| self.replies(calls, &order)) {
            Ok(replies) => replies,
            Err(e) => {
                // Not applied (or not known to be): the deltas go back in front of what was
                // counted since, and the next flush sends them again.
                for key in &keys {
                    let dirty = self.dirty.get_mut(key).expect("in flight keys stay dirty");
                    let mut again = std::mem::take(&mut dirty.inflight);
                    self.pending += again.len();
                    again.append(&mut dirty.pending);
                    dirty.pending = again;
                }
                self.stats.failed_flushes += 1;
                return Err(e);
            }
        };
        self.stats.flushes += 1;
        self.durable = mark;
        self.samples.push(FlushSample { keys: keys.len(), observations, elapsed: sent.elapsed() });
        if self.samples.len() > 4096 {
            // Nobody takes them (replay): keep the newest only.
            self.samples.drain(..2048);
        }
        // Redis applied every call: each key's in-flight deltas are done whatever its reply. A
        // reply we cannot read only costs the cached copy.
        let mut first_error = None;
        for (key, reply) in keys.into_iter().zip(replies) {
            let window = WindowId(key.window);
            let spec = self.windows.spec(key.window);
            let parsed = self.parse_reply(window, reply);
            let dirty = self.dirty.remove(&key).expect("in flight keys stay dirty");
            let (state, version) = match parsed {
                // Nobody else wrote since our view: it already holds the in-flight deltas and
                // those counted since, exactly as Redis now does plus what it has not seen.
                Ok(Some(Reply { version, window: None })) => (dirty.state, Some(version)),
                Ok(fresh) => {
                    // The window as Redis has it now, plus what was counted since it was sent.
                    let (mut state, version) = match fresh {
                        Some(Reply { version, window: Some(state) }) => (state, Some(version)),
                        _ => (WindowState::new(spec.aggregate), None),
                    };
                    for &(bucket, delta) in &dirty.pending {
                        state.apply(&spec, bucket, delta);
                    }
                    (state, version)
                }
                Err(e) => {
                    // Keep our own merged view, which already holds every delta; with no known
                    // version the next flush asks for the whole window.
                    first_error.get_or_insert(e);
                    (dirty.state, None)
                }
            };
            if dirty.pending.is_empty() {
                self.cache.insert(key, Arc::new(Cached { state, version }));
            } else {
                self.dirty.insert(key, Dirty { state, version, inflight: Vec::new(), pending: dirty.pending });
            }
        }
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

    /// Reads the windows of `keys` from Redis in one batch and caches them.
    fn read(&mut self, keys: &[(WindowId, &[u8])]) -> Result<Vec<Arc<Cached>>, StoreError> {
        let batch = self.batch(keys.iter().map(|&(window, key)| (window, key, None, &[][..])));
        let replies = self.run(&batch)?;
        self.stats.loads += replies.len() as u64;
        let mut states = Vec::with_capacity(keys.len());
        for (&(window, key), reply) in keys.iter().zip(replies) {
            let spec = self.windows.spec(window.0);
            let cached = match self.parse_reply(window, reply)? {
                Some(Reply { version, window: Some(state) }) => Cached { state, version: Some(version) },
                Some(Reply { window: None, .. }) => return Err(StoreError::Protocol("a read was answered \"=\"".into())),
                None => Cached { state: WindowState::new(spec.aggregate), version: None },
            };
            let cached = Arc::new(cached);
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

    fn apply(&mut self, window: WindowId, key: &[u8], ts_ms: i64, delta: Delta) -> Result<Applied, StoreError> {
        let spec = self.windows.spec(window.0);
        let bucket = spec.bucket_of(ts_ms);
        let lookup = KeyRef { window: window.0, key };
        let applied = match self.dirty.get_mut(&lookup) {
            Some(dirty) => {
                let applied = dirty.state.apply(&spec, bucket, delta);
                if let Applied::Counted(_) = applied {
                    dirty.pending.push((bucket, delta));
                }
                applied
            }
            None => {
                let clean = match self.cache.get(&lookup) {
                    Some(state) => state,
                    None => self.read(&[(window, key)])?.pop().expect("one state per key"),
                };
                let mut state = clean.state.clone();
                let applied = state.apply(&spec, bucket, delta);
                if let Applied::Counted(_) = applied {
                    let stored = StoredKey { window: window.0, key: KeyBytes::new(key) };
                    let version = clean.version;
                    self.dirty.insert(stored, Dirty { state, version, inflight: Vec::new(), pending: vec![(bucket, delta)] });
                }
                applied
            }
        };
        if let Applied::Counted(_) = applied {
            self.pending += 1;
            self.counted += 1;
        }
        // The observation is counted whatever happens to the write-behind: a failed flush keeps
        // its deltas for the next one and is reported through `take_flush_error`.
        self.write_behind()?;
        Ok(applied)
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

#[cfg(test)]
mod tests {
    use super::slot;

    #[test]
    fn slots_follow_the_cluster_spec() {
        // The Redis Cluster specification's CRC16 check value, and slots redis-cli reports.
        assert_eq!(slot("123456789"), 0x31C3);
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("bar"), 5061);
    }
}
