//! The Redis store's tuning ([`RedisStoreConfig`]) and what it reports: counters of what it did
//! ([`RedisStats`]) and one sample per acknowledged flush ([`FlushSample`]).

use std::time::Duration;

/// Tuning of the Redis store.
#[derive(Debug, Clone)]
pub struct RedisStoreConfig {
    /// Flush pending deltas at least this often while other processes count into the same keys
    /// ([`CounterStore::set_shared`]): what their values may lack of this process's counts.
    ///
    /// [`CounterStore::set_shared`]: crate::store::CounterStore::set_shared
    pub flush_interval: Duration,
    /// Flush pending deltas at least this often while no other process counts into the same
    /// keys (never more often than `flush_interval`): nobody reads them sooner, and a key counted
    /// several times in between is written once.
    pub exclusive_flush_interval: Duration,
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
    /// How long a flush waits for a replica to confirm its writes (`WAIT 1`), on a master with
    /// replicas; `None`: not asked (a failover then writes every local view again).
    pub replica_ack_timeout: Option<Duration>,
    /// Most keys with deltas Redis has not acknowledged; beyond, [`CounterStore::saturated`]
    /// asks the caller to stop feeding events until Redis takes them.
    ///
    /// [`CounterStore::saturated`]: crate::store::CounterStore::saturated
    pub max_local_keys: usize,
    /// Most clean windows (read from Redis, nothing pending) kept in the local cache.
    pub cache_capacity: u64,
    /// A clean window not used for this long is dropped from the local cache.
    pub cache_time_to_idle: Duration,
    /// Most estimated bytes of local state: half for clean windows (the read cache, which also
    /// keeps at most `cache_capacity` of them: a window is charged at least its share), half for
    /// windows with deltas Redis has not acknowledged (beyond, [`CounterStore::saturated`] asks
    /// the caller to wait, as at `max_local_keys`).
    ///
    /// [`CounterStore::saturated`]: crate::store::CounterStore::saturated
    pub max_state_bytes: usize,
    /// PEM file of the CA that signed the server's certificate, for `rediss://` servers whose
    /// certificate is not in the system trust store.
    pub tls_ca_file: Option<std::path::PathBuf>,
    /// The callers' lateness bound in ms (`None`: unbounded): keys live at least this long past
    /// their window, so an event within the bound never finds its key expired.
    pub max_lateness: Option<i64>,
    /// Connect to a Redis whose `maxmemory-policy` may evict keys (anything but `noeviction`):
    /// an evicted counter key silently lowers its count. Off, such a Redis is refused.
    pub allow_eviction: bool,
    /// What one tick may spend on the write-behind's bookkeeping (building a flush, taking in
    /// its replies, moving windows into the cache) while that work is on schedule to be done
    /// within a flush interval: the engine, and every partition waiting for it, waits that long
    /// at most. A tick does one item at least (zero: one per tick). 100 µs: at 0.5 ms (each of
    /// the three parts) a worker's own p99 at 2 000 events/s was 7.6–10.1 ms, at 100 µs
    /// 2.9–3.8 ms, saturation alike (BENCHMARKS.md).
    pub tick_budget: Duration,
}

impl Default for RedisStoreConfig {
    fn default() -> Self {
        RedisStoreConfig {
            flush_interval: Duration::from_millis(50),
            exclusive_flush_interval: Duration::from_secs(1),
            max_pending: 200_000,
            attempts: 3,
            retry_backoff: Duration::from_millis(20),
            connect_timeout: Duration::from_millis(500),
            response_timeout: Duration::from_secs(2),
            probe_interval: Duration::from_secs(1),
            replica_ack_timeout: Some(Duration::from_millis(20)),
            max_local_keys: 1_000_000,
            cache_capacity: 1_000_000,
            cache_time_to_idle: Duration::from_secs(600),
            max_state_bytes: 1 << 30,
            tls_ca_file: None,
            max_lateness: Some(3_600_000),
            allow_eviction: false,
            tick_budget: Duration::from_micros(100),
        }
    }
}

/// What the store did, for the summary and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RedisStats {
    /// Redis' `maxmemory-policy` may evict keys, and `allow_eviction` let the store connect.
    pub eviction_allowed: bool,
    /// Script calls made (each serves up to 32 keys written behind, or 256 of a step counted
    /// ahead).
    pub script_calls: u64,
    pub flushes: u64,
    /// Hashes read from Redis on a local miss (one read serves every section of a hash the
    /// counters over the same dimensions share).
    pub loads: u64,
    /// Windows read before their batch took the engine and taken in (see `early.rs`).
    pub early_loads: u64,
    /// Holds read while the batch before theirs was judged and taken in (see `holds.rs`).
    pub early_hold_loads: u64,
    /// Failed attempts that were retried.
    pub retries: u64,
    /// Deltas the script refused as late (another worker had moved the key's head on).
    pub refused_late: u64,
    /// Observations judged but not counted again: their offset was at or below the one recorded
    /// for their key (input replayed after a crash or a rebalance, or a flush sent again).
    pub skipped_applied: u64,
    /// Observations applied in Redis before their batch was judged, on keys other workers
    /// count too (see `ahead.rs`).
    pub counted_ahead: u64,
    /// Observations a previous owner had counted ahead (its decisions never went out), taken
    /// out of a count's or a sum's window and counted back in order when judged again here.
    pub taken_back: u64,
    /// Observations applied before (a previous owner's, or this process's before a crash),
    /// judged again on the window as Redis holds them, not taken back
    /// ([`CounterStore::judged_as_held`]).
    ///
    /// [`CounterStore::judged_as_held`]: crate::store::CounterStore::judged_as_held
    pub judged_as_held: u64,
    /// Keys whose writes met a version another writer had moved on; their deltas went again.
    pub stale_writes: u64,
    /// Flushes that failed after every retry (their deltas were kept and sent again).
    pub failed_flushes: u64,
    /// Times Redis became unavailable (the circuit breaker opened).
    pub outages: u64,
    /// Observations counted on local state only, while Redis was unavailable.
    pub degraded_observations: u64,
    /// Times Redis was found to have lost its data (its epoch key vanished or changed) or may
    /// have (a cluster failover).
    pub data_losses: u64,
    /// Keys gone from Redis at a version this process knew (lost or expired), written again.
    pub lost_keys: u64,
    /// Keys written again from this process's view after Redis lost its data.
    pub reseeded_keys: u64,
    /// Failovers followed (a promoted replica became a master).
    pub failovers: u64,
    /// Observations written again after a failover because no replica had confirmed them.
    pub rewritten_unconfirmed: u64,
    /// Unconfirmed observations no longer kept for a failover (a replica was away too long).
    pub unconfirmed_dropped: u64,
}

/// One acknowledged flush, for the flush size and latency metrics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlushSample {
    pub keys: usize,
    pub observations: usize,
    pub elapsed: Duration,
}
