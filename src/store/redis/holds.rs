//! Hold views: each rule's hold on a key as this process knows it (what Redis told last, raised
//! by what this process set since), and reading, sending and acknowledging holds. A view older
//! than a flush interval (by the store's clock) is read again.

use std::time::{Duration, Instant};

use hashbrown::HashMap;
use redis::Value;

use super::early::{EarlyReader, PendingRead};
use super::RedisStore;
use crate::clock::MonotonicClock;
use crate::store::counter_store::{HoldSpace, StoreError};
use crate::store::keys::{key_name, KeyBytes, KeyRef, StoredKey};
use crate::store::link::Batch;
use crate::store::scripts::{HOLD, RELEASE_HOLD_SOURCE};

/// A rule's hold on one key as this process knows it: what Redis said last, raised by what this
/// process set since.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct HoldView {
    /// Until when the key is held (`None`: not held, as far as this process knows).
    pub(super) until: Option<i64>,
    /// What Redis told last (`until` without this process's raises since).
    stored: Option<i64>,
    /// When Redis last told the hold (`None`: never). Older than a flush interval, it is read again.
    read_at: Option<Instant>,
    /// A raise not sent yet, with the counted index it was made at.
    pub(super) pending: Option<(i64, u64)>,
    /// The raise in flight.
    pub(super) inflight: Option<(i64, u64)>,
    /// The highest raise of batches not journaled yet (`batches.rs`): in `until`, not sent.
    pub(super) unjournaled: Option<i64>,
    /// How many times support released the hold, as Redis told last: raises carry it, and
    /// Redis refuses those made before a release they had not seen.
    generation: u64,
    /// [`HoldViews::epoch`] when Redis last told this view something: a read sent ahead before
    /// that is older than what the view knows, and is not taken in.
    changed: u64,
}

impl HoldView {
    /// Whether Redis told the hold less than `interval` before `now` (by the store's clock).
    #[inline]
    fn fresh(&self, now: Instant, interval: Duration) -> bool {
        self.read_at
            .is_some_and(|at| now.saturating_duration_since(at) < interval)
    }

    /// What Redis told (`stored`, at `generation`), raised by this process's unacknowledged
    /// raises.
    fn learn(&mut self, stored: Option<i64>, generation: u64, at: Instant) {
        self.generation = generation;
        self.stored = stored;
        self.raise_to_known();
        self.read_at = Some(at);
    }

    /// `until` becomes what Redis told, raised by this process's raises not acknowledged yet.
    pub(super) fn raise_to_known(&mut self) {
        self.until = self.journaled_until().max(self.unjournaled);
    }

    /// What Redis told, raised by the raises of journaled batches not acknowledged yet.
    pub(super) fn journaled_until(&self) -> Option<i64> {
        let raises = self
            .pending
            .into_iter()
            .chain(self.inflight)
            .map(|(until, _)| until);
        self.stored.into_iter().chain(raises).max()
    }

    /// What a flush's reply told (`stored` at `generation`), Redis having run the raise at some
    /// time after `sent`. A view read after `sent` may know a later state than the reply; holds
    /// only rise within a generation and a release starts the next, so the later state is the
    /// higher generation, else the later time — kept, and as fresh as that read.
    fn learn_acknowledged(&mut self, stored: Option<i64>, generation: u64, sent: Instant) {
        match self.read_at {
            Some(read) if read > sent => {
                let (generation, stored) = (self.generation, self.stored).max((generation, stored));
                self.learn(stored, generation, read);
            }
            _ => self.learn(stored, generation, sent),
        }
    }
}

/// A hold's value in Redis (see `lua/hold.lua`): until when it holds (`None`: released, or not a
/// time) and its generation (how many times it was released).
fn parse_hold(text: &str) -> (Option<i64>, u64) {
    if let Some(generation) = text.strip_prefix('r') {
        return (None, generation.parse().unwrap_or(0));
    }
    match text.split_once(':') {
        Some((until, generation)) => (until.parse().ok(), generation.parse().unwrap_or(0)),
        None => (text.parse().ok(), 0),
    }
}

/// A hold's GET reply: until when it holds and its generation (nothing or anything unreadable:
/// not held).
fn stored_hold(reply: Value) -> (Option<i64>, u64) {
    match redis::from_redis_value::<Option<String>>(reply) {
        Ok(Some(text)) => parse_hold(&text),
        _ => (None, 0),
    }
}

/// Holds past this many views are pruned at each flush: views read over a flush interval ago
/// would be read again anyway.
const HOLD_VIEWS_KEPT: usize = 4096;

/// The holds this process knows.
#[derive(Default)]
pub(super) struct HoldViews {
    /// Holds read or raised recently (the key's `window` is its hold space).
    pub(super) views: HashMap<StoredKey, HoldView, foldhash::fast::RandomState>,
    /// Hold views with a raise not sent yet.
    pub(super) pending: usize,
    /// When the batch being judged had its holds read (`prefetch_holds`): a view fresh then
    /// stays fresh for the batch, as its windows do, rather than costing a round trip per
    /// event once the batch runs longer than a flush interval.
    pub(super) prefetched_at: Option<Instant>,
    /// Counts what Redis told the views (reads, acknowledged raises): each view records the
    /// count when it last learned, so a read sent ahead knows which views learned since.
    epoch: u64,
    /// The latest `changed` of any view dropped: a read sent ahead before it is not taken in
    /// for a key that has no view (it may have been that one).
    dropped_changed: u64,
    /// Reads sent ahead at an epoch below this are not taken in at all: a release, a discarded
    /// batch, a failover or lost data since.
    void_below: u64,
    /// The holds of the next batch, read while this one is judged.
    ahead: Option<HoldReadsAhead>,
}

/// Hold reads sent ahead of the batch that needs them (replay knows its next batch's holds
/// while it judges this one): taken in by its prefetch for each key whose view learned nothing
/// from Redis since they were sent, so a read never takes a view back to an older state.
pub(super) struct HoldReadsAhead {
    reads: EarlyHoldReads,
    pending: PendingRead,
}

/// Holds to read for a batch before it takes the engine (a worker's partition loop reads them
/// with the engine free, on the early hold reader), taken in under the engine as the reads
/// replay sends ahead are ([`RedisStore::take_early_hold_reads`]).
pub struct EarlyHoldReads {
    keys: Vec<StoredKey>,
    /// [`HoldViews::epoch`] when planned.
    epoch: u64,
    /// When planned, before they are sent: whatever the replies tell is at least this recent.
    sent: Instant,
    batch: Batch,
}

impl EarlyHoldReads {
    /// The reads to send (once).
    pub(super) fn take_batch(&mut self) -> Batch {
        std::mem::take(&mut self.batch)
    }
}

impl HoldViews {
    /// The next epoch, for a view that just learned from Redis.
    fn next_epoch(&mut self) -> u64 {
        self.epoch += 1;
        self.epoch
    }

    /// `key`'s view learns what a read of its hold (a GET's reply) told, as of `at`.
    fn learn_read(&mut self, key: StoredKey, reply: Value, at: Instant) {
        let (stored, generation) = stored_hold(reply);
        let epoch = self.next_epoch();
        let view = self.views.entry(key).or_default();
        view.learn(stored, generation, at);
        view.changed = epoch;
    }

    /// No read sent ahead until now is taken in.
    pub(super) fn void_reads_ahead(&mut self) {
        self.epoch += 1;
        self.void_below = self.epoch;
        self.ahead = None;
    }
}

impl<C: MonotonicClock> RedisStore<C> {
    /// The Redis key of a rule's hold on a hold key: `vg:h:<rule id>:<digest>` (user bytes never
    /// reach Redis raw).
    pub fn redis_hold_key(&self, space: HoldSpace, key: &[u8]) -> String {
        key_name("vg:h:", self.hold_spaces.name(space.0), &blake3::hash(key))
    }

    /// The hold as Redis told it within the last flush interval (read again if older), raised by
    /// what this process set; while Redis is unavailable, what this process knows.
    pub(super) fn hold(&mut self, space: HoldSpace, key: &[u8]) -> Result<Option<i64>, StoreError> {
        let lookup = KeyRef {
            window: space.0,
            key,
        };
        let now = self.holds.prefetched_at.unwrap_or_else(|| self.clock.now());
        match self.holds.views.get(&lookup) {
            Some(view) if self.breaker.is_open() || view.fresh(now, self.config.flush_interval) => {
                return Ok(view.until)
            }
            None if self.breaker.is_open() => return Ok(None),
            _ => {}
        }
        self.read_holds(&[(space, key)]);
        Ok(self.holds.views.get(&lookup).and_then(|v| v.until))
    }

    /// Raised locally at once (so this process is exact), written behind with the next flush
    /// (so other workers see it within a flush interval).
    pub(super) fn raise_hold(
        &mut self,
        space: HoldSpace,
        key: &[u8],
        until_ms: i64,
    ) -> Result<i64, StoreError> {
        let current = self.hold(space, key)?;
        let covered = current.is_some_and(|held| held >= until_ms);
        if covered {
            let lookup = KeyRef {
                window: space.0,
                key,
            };
            let journaled = self
                .holds
                .views
                .get(&lookup)
                .and_then(HoldView::journaled_until);
            if journaled.is_some_and(|held| held >= until_ms) || !self.batches.counting() {
                return Ok(current.unwrap_or(until_ms));
            }
            // Held only by a batch not journaled yet, which may be taken back: this batch's
            // raise is kept too (below), as if it were the only one.
        }
        self.counted += 1;
        let index = self.counted;
        let stored_key = StoredKey {
            window: space.0,
            key: KeyBytes::new(key),
        };
        // A batch being counted keeps its raise until its records are journaled.
        let unjournaled = self.batches.record_raise(&stored_key, until_ms, index);
        if covered {
            return Ok(current.unwrap_or(until_ms));
        }
        let view = self.holds.views.entry(stored_key).or_default();
        view.until = Some(until_ms);
        if unjournaled {
            view.unjournaled = view.unjournaled.max(Some(until_ms));
            return Ok(until_ms);
        }
        view.pending = Some(match view.pending {
            Some((raised, first)) => (raised.max(until_ms), first),
            None => {
                self.holds.pending += 1;
                (until_ms, index)
            }
        });
        Ok(until_ms)
    }

    /// Ends the hold of `key` in `space` in Redis, and in this process's view: a raise this
    /// process has not written yet goes with it (the release covers it), one in flight is
    /// refused by Redis (it is not later than what was released).
    pub(super) fn release(
        &mut self,
        space: HoldSpace,
        key: &[u8],
    ) -> Result<Option<i64>, StoreError> {
        let lookup = KeyRef {
            window: space.0,
            key,
        };
        let known = self.holds.views.get(&lookup).and_then(|view| view.until);
        let name = self.redis_hold_key(space, key);
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(RELEASE_HOLD_SOURCE)
            .arg(1)
            .arg(&name)
            .arg(known.map(|t| t.to_string()).unwrap_or_default());
        let mut commands = vec![(name.clone(), cmd)];
        // As flushes do: a failover must not bring the released hold back.
        if let Some(timeout) = self.config.replica_ack_timeout {
            let mut wait = redis::cmd("WAIT");
            wait.arg(1).arg(timeout.as_millis().max(1) as u64);
            commands.push((name, wait));
        }
        let reply = self.run_each(commands)?.into_iter().next();
        let (released, generation) = reply
            .and_then(|r| redis::from_redis_value::<(String, String)>(r).ok())
            .and_then(|(until, generation)| {
                let until = match until.as_str() {
                    "" => None,
                    text => Some(text.parse::<i64>().ok()?),
                };
                Some((until, generation.parse::<u64>().ok()?))
            })
            .ok_or_else(|| StoreError::Protocol("release_hold: unexpected reply".into()))?;
        let at = self.clock.now();
        // A hold read sent before the release would bring the hold back.
        self.holds.void_reads_ahead();
        let epoch = self.holds.next_epoch();
        let stored_key = StoredKey {
            window: space.0,
            key: KeyBytes::new(key),
        };
        self.batches.forget_raises(&stored_key);
        if let Some(view) = self.holds.views.get_mut(&lookup) {
            if view.pending.take().is_some() {
                self.holds.pending -= 1;
            }
            view.inflight = None;
            view.unjournaled = None;
            view.learn(None, generation, at);
            view.changed = epoch;
        }
        Ok(released)
    }

    /// Reads, in one pipeline, the holds of `keys` not told within the last flush interval.
    pub(super) fn prefetch_hold_views(&mut self, keys: &[(HoldSpace, Vec<u8>)]) {
        self.holds.prefetched_at = None;
        if self.breaker.is_open() {
            self.holds.ahead = None;
            return;
        }
        self.finish_hold_reads_ahead();
        let now = self.clock.now();
        self.holds.prefetched_at = Some(now);
        let wanted = self.hold_keys_to_read(keys, now);
        if !wanted.is_empty() {
            self.read_holds(&wanted);
        }
    }

    /// The keys of `keys` whose hold views were not told within the last flush interval at
    /// `now`, each once: what a batch must read.
    fn hold_keys_to_read<'k>(
        &self,
        keys: &'k [(HoldSpace, Vec<u8>)],
        now: Instant,
    ) -> Vec<(HoldSpace, &'k [u8])> {
        let interval = self.config.flush_interval;
        let mut wanted = Vec::new();
        let mut seen: hashbrown::HashSet<KeyRef<'_>, foldhash::fast::RandomState> =
            Default::default();
        for (space, key) in keys {
            let lookup = KeyRef {
                window: space.0,
                key,
            };
            let fresh = self
                .holds
                .views
                .get(&lookup)
                .is_some_and(|v| v.fresh(now, interval));
            if !fresh && seen.insert(lookup) {
                wanted.push((*space, key.as_slice()));
            }
        }
        wanted
    }

    /// Hold views are read again (another worker may have raised them meanwhile).
    pub(super) fn forget_hold_reads(&mut self) {
        self.holds.void_reads_ahead();
        for view in self.holds.views.values_mut() {
            view.read_at = None;
        }
    }

    /// Reads the holds of `keys` from Redis (pipelined GETs) into their views. A failure opens
    /// the breaker: the views stay as they are.
    fn read_holds(&mut self, keys: &[(HoldSpace, &[u8])]) {
        let names: Vec<String> = keys
            .iter()
            .map(|&(space, key)| self.redis_hold_key(space, key))
            .collect();
        let at = self.clock.now();
        let replies = match self.read_each("GET", names) {
            Ok(replies) => replies,
            Err(e) => {
                self.fail(&e, "reading holds");
                return;
            }
        };
        for (&(space, key), reply) in keys.iter().zip(replies) {
            let key = StoredKey {
                window: space.0,
                key: KeyBytes::new(key),
            };
            self.holds.learn_read(key, reply, at);
        }
    }

    /// The reads of the holds of `keys` this process has not read within the last flush
    /// interval, if any (and Redis is available).
    fn plan_hold_reads(&mut self, keys: &[(HoldSpace, Vec<u8>)]) -> Option<EarlyHoldReads> {
        if self.breaker.is_open() {
            return None;
        }
        let sent = self.clock.now();
        let wanted: Vec<StoredKey> = self
            .hold_keys_to_read(keys, sent)
            .into_iter()
            .map(|(space, key)| StoredKey {
                window: space.0,
                key: KeyBytes::new(key),
            })
            .collect();
        if wanted.is_empty() {
            return None;
        }
        let names: Vec<String> = wanted
            .iter()
            .map(|key| self.redis_hold_key(HoldSpace(key.window), key.key.as_slice()))
            .collect();
        Some(EarlyHoldReads {
            keys: wanted,
            epoch: self.holds.epoch,
            sent,
            batch: self.batch_of("GET", names),
        })
    }

    /// Sends, on the early reader's connection, the reads of the holds of `keys` this process
    /// has not read within the last flush interval: the next batch's, while this one is judged.
    /// Its prefetch takes them in ([`RedisStore::finish_hold_reads_ahead`]).
    pub(super) fn start_hold_reads_ahead(&mut self, keys: &[(HoldSpace, Vec<u8>)]) {
        self.holds.ahead = None;
        let Some(mut reads) = self.plan_hold_reads(keys) else {
            return;
        };
        // One read out at a time: a reader stuck on a silent connection is not sent more.
        let Some(reader) = self.early_hold_reader().filter(|r| r.idle()) else {
            return;
        };
        if let Ok(pending) = reader.send(reads.take_batch()) {
            self.holds.ahead = Some(HoldReadsAhead { reads, pending });
        }
    }

    /// The holds of `keys` the batch's prefetch would read now, with the reader to read them
    /// on before the batch takes the engine; `None` if there are none (or Redis is unavailable).
    pub fn plan_early_hold_reads(
        &mut self,
        keys: &[(HoldSpace, Vec<u8>)],
    ) -> Option<(EarlyHoldReads, EarlyReader)> {
        let reads = self.plan_hold_reads(keys)?;
        Some((reads, self.early_hold_reader()?))
    }

    /// Takes in what [`EarlyReader::start_holds`] brought back for `reads`, as the reads sent
    /// ahead are taken in; what is not taken in, the batch's prefetch reads.
    pub fn take_early_hold_reads(
        &mut self,
        reads: EarlyHoldReads,
        replies: Result<Vec<Value>, StoreError>,
    ) {
        if let Ok(replies) = replies {
            self.take_in_hold_reads(reads, replies);
        }
    }

    /// Takes in the hold reads sent ahead, if they are back (never waiting: the prefetch reads
    /// what is not).
    fn finish_hold_reads_ahead(&mut self) {
        let Some(ahead) = self.holds.ahead.take() else {
            return;
        };
        if let Some(Ok(replies)) = ahead.pending.ready() {
            self.take_in_hold_reads(ahead.reads, replies);
        }
    }

    /// Each reply of `reads` for a key whose view learned nothing from Redis since they were
    /// planned (and that was not dropped since), as if read when planned.
    fn take_in_hold_reads(&mut self, reads: EarlyHoldReads, replies: Vec<Value>) {
        if replies.len() != reads.keys.len() {
            return;
        }
        // As for any read: a failover these replies may come from is followed first (which
        // voids them).
        self.catch_up_failover();
        if reads.epoch < self.holds.void_below {
            return;
        }
        let mut taken = 0u64;
        for (key, reply) in reads.keys.into_iter().zip(replies) {
            let known = match self.holds.views.get(&key) {
                Some(view) => view.changed > reads.epoch,
                None => self.holds.dropped_changed > reads.epoch,
            };
            if known {
                continue;
            }
            self.holds.learn_read(key, reply, reads.sent);
            taken += 1;
        }
        self.stats.early_hold_loads += taken;
    }

    /// The raises of `holds` did not happen (or are not known to have): they go again.
    pub(super) fn unsent_holds(&mut self, holds: &[StoredKey]) {
        for key in holds {
            let Some(view) = self.holds.views.get_mut(key) else {
                continue;
            };
            if let Some(inflight) = view.inflight.take() {
                if view.pending.is_none() {
                    self.holds.pending += 1;
                }
                view.pending = Some(match view.pending {
                    Some((until, _)) => (until.max(inflight.0), inflight.1),
                    None => inflight,
                });
            }
        }
    }

    /// Moves every pending hold raise in flight, adding its script call to `batch`; prunes views
    /// that would be read again anyway.
    pub(super) fn send_holds(&mut self, batch: &mut Batch) -> Vec<StoredKey> {
        // Not while Redis is away: the views are then all this process knows of its holds.
        if self.holds.views.len() > HOLD_VIEWS_KEPT && !self.breaker.is_open() {
            // Fresh as the batch being judged sees them (`hold`): a view its prefetch read
            // stays for the whole batch, rather than being read again, key by key, by every
            // event after a flush that runs once the batch is a flush interval old.
            let now = self.holds.prefetched_at.unwrap_or_else(|| self.clock.now());
            let interval = self.config.flush_interval;
            let mut dropped_changed = self.holds.dropped_changed;
            self.holds.views.retain(|_, v| {
                let keep = v.pending.is_some()
                    || v.inflight.is_some()
                    || v.unjournaled.is_some()
                    || v.fresh(now, interval);
                if !keep {
                    dropped_changed = dropped_changed.max(v.changed);
                }
                keep
            });
            self.holds.dropped_changed = dropped_changed;
        }
        if self.holds.pending == 0 {
            return Vec::new();
        }
        let mut sent = Vec::with_capacity(self.holds.pending);
        for (key, view) in self.holds.views.iter_mut() {
            if let Some(raise) = view.pending.take() {
                view.inflight = Some(raise);
                sent.push(key.clone());
            }
        }
        self.holds.pending = 0;
        for key in &sent {
            let space = HoldSpace(key.window);
            let name = self.redis_hold_key(space, key.key.as_slice());
            let view = &self.holds.views[key];
            let ((until, _), generation) = (view.inflight.expect("just moved"), view.generation);
            let mut cmd = redis::cmd("EVALSHA");
            cmd.arg(HOLD.get_hash())
                .arg(1)
                .arg(&name)
                .arg(until)
                .arg(self.hold_spaces.ttl_ms(key.window))
                .arg(generation);
            batch.command(self.cluster, &name, cmd);
        }
        sent
    }

    /// Takes in the replies to the hold raises of a flush: each is the hold as Redis has it now
    /// (told at `sent`, by the store's clock). A raise Redis refused is dropped (it would be
    /// refused again) and reported.
    pub(super) fn acknowledge_holds(
        &mut self,
        holds: &[StoredKey],
        replies: &[Value],
        sent: Instant,
    ) -> Result<(), StoreError> {
        if replies.len() != holds.len() {
            self.unsent_holds(holds);
            return Err(StoreError::Protocol(format!(
                "{} replies for {} hold raises",
                replies.len(),
                holds.len()
            )));
        }
        let mut refused = None;
        for (key, reply) in holds.iter().zip(replies) {
            let epoch = self.holds.next_epoch();
            let Some(view) = self.holds.views.get_mut(key) else {
                continue;
            };
            view.changed = epoch;
            let Some((raised, _)) = view.inflight.take() else {
                continue;
            };
            let text = redis::from_redis_value::<String>(reply.clone()).ok();
            match text.as_deref().map(|t| (t, parse_hold(t))) {
                Some((_, (Some(stored), generation))) => {
                    view.learn_acknowledged(Some(stored), generation, sent)
                }
                // Released (`lua/release_hold.lua`) after this raise was made: not held.
                Some((t, (None, generation))) if t.starts_with('r') => {
                    view.learn_acknowledged(None, generation, sent)
                }
                _ => {
                    view.learn_acknowledged(Some(raised), view.generation, sent);
                    refused.get_or_insert_with(|| {
                        StoreError::Protocol(format!("hold raise refused: {reply:?}"))
                    });
                }
            }
        }
        refused.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualMonotonic;

    #[test]
    fn a_hold_view_is_fresh_for_one_interval_of_the_injected_clock() {
        let clock = ManualMonotonic::new();
        let interval = Duration::from_millis(50);
        let mut view = HoldView::default();
        assert!(!view.fresh(clock.now(), interval), "never read");
        view.learn(Some(7), 0, clock.now());
        assert!(view.fresh(clock.now(), interval));
        clock.advance(interval - Duration::from_nanos(1));
        assert!(view.fresh(clock.now(), interval));
        clock.advance(Duration::from_nanos(1));
        assert!(
            !view.fresh(clock.now(), interval),
            "read again once an interval passed"
        );
    }
}
