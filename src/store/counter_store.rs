//! The interface every counter store implements ([`CounterStore`]): named windows and hold spaces
//! opened by id, observations applied or read at an event's time, the input position that makes
//! counting exactly-once, and the store's error type.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::window::{Applied, Delta, LastValue, WindowSpec, WindowState};

/// Handle of a window opened on a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WindowId(pub u32);

/// The named windows a store has opened: the same name and spec give the same [`WindowId`].
#[derive(Debug, Default)]
pub(super) struct Windows(Vec<(String, WindowSpec)>);

impl Windows {
    pub(crate) fn open(&mut self, name: &str, spec: WindowSpec) -> WindowId {
        let position = self
            .0
            .iter()
            .position(|(n, s)| n == name && *s == spec)
            .unwrap_or_else(|| {
                self.0.push((name.to_owned(), spec));
                self.0.len() - 1
            });
        WindowId(position as u32)
    }

    pub(crate) fn spec(&self, window: u32) -> WindowSpec {
        self.0[window as usize].1
    }

    pub(crate) fn name(&self, window: u32) -> &str {
        &self.0[window as usize].0
    }
}

/// Handle of the holds of one rule, opened on a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HoldSpace(pub u32);

/// The hold spaces a store has opened, by name (a rule id), with how long a shared store keeps a
/// hold after setting it.
#[derive(Debug, Default)]
pub(super) struct HoldSpaces(Vec<(String, i64)>);

impl HoldSpaces {
    pub(crate) fn open(&mut self, name: &str, ttl_ms: i64) -> HoldSpace {
        let position = match self.0.iter().position(|(n, _)| n == name) {
            Some(position) => {
                // The same rule with another hold length keeps its holds (they are absolute times).
                self.0[position].1 = ttl_ms;
                position
            }
            None => {
                self.0.push((name.to_owned(), ttl_ms));
                self.0.len() - 1
            }
        };
        HoldSpace(position as u32)
    }

    pub(crate) fn name(&self, space: u32) -> &str {
        &self.0[space as usize].0
    }

    pub(crate) fn ttl_ms(&self, space: u32) -> i64 {
        self.0[space as usize].1
    }
}

/// Where the observations being applied come from: an ordered input (`lane`, e.g. a Kafka
/// partition) and the position in it. A store that records the highest offset it applied per lane
/// and key counts an input replayed after a crash only once (see [RELIABILITY.md](RELIABILITY.md)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InputPosition {
    pub lane: u64,
    pub offset: i64,
}

/// An observation a batch is about to count (`CounterStore::count_ahead`): what `apply` will
/// be called with, and from where.
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    pub window: WindowId,
    pub key: Vec<u8>,
    pub ts_ms: i64,
    pub delta: Delta,
    pub origin: InputPosition,
    /// The key includes the message key its event was read with (events keyed by user, a
    /// per-user counter): only one partition feeds it, so it is never counted ahead.
    pub follows_message_key: bool,
}

/// Work a store leaves to the caller for once the engine is released
/// ([`CounterStore::seal_batch_deferring`]), so that other partitions are not kept waiting for
/// it. Dropped without being run, it runs then.
#[must_use = "the work runs when this is run or dropped"]
#[derive(Default)]
pub struct Deferred(Option<Box<dyn FnOnce() + Send>>);

impl Deferred {
    /// Nothing to do.
    pub fn none() -> Deferred {
        Deferred(None)
    }

    pub fn new(work: impl FnOnce() + Send + 'static) -> Deferred {
        Deferred(Some(Box::new(work)))
    }

    /// Runs the work now (dropping it does: see `Drop`).
    pub fn run(self) {}
}

impl Drop for Deferred {
    fn drop(&mut self) {
        if let Some(work) = self.0.take() {
            work();
        }
    }
}

impl std::fmt::Debug for Deferred {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Deferred(work)"
        } else {
            "Deferred(none)"
        })
    }
}

/// A counted batch whose records are being journaled ([`CounterStore::seal_batch`]): what it
/// counted stays out of the shared store until [`BatchSeal::journaled`] is called or the seal
/// is dropped. Taking the batch back instead is [`CounterStore::discard_batch`], under the store.
/// Free of the store, so that the journal is written while other batches are counted.
#[derive(Debug)]
#[must_use = "the batch's counts are held back until the seal is journaled or dropped"]
pub struct BatchSeal(Option<Arc<AtomicBool>>);

impl BatchSeal {
    /// A seal of nothing (a store that holds nothing back).
    pub fn none() -> BatchSeal {
        BatchSeal(None)
    }

    /// A seal the store watches through `journaled`.
    pub fn watching(journaled: Arc<AtomicBool>) -> BatchSeal {
        BatchSeal(Some(journaled))
    }

    /// The batch's records are journaled: its counts may go out.
    pub fn journaled(self) {}
}

impl Drop for BatchSeal {
    fn drop(&mut self) {
        if let Some(journaled) = &self.0 {
            journaled.store(true, Ordering::Release);
        }
    }
}

/// The size of a store's local state and what its bound made it drop.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateStats {
    /// Estimated bytes of local state (0 where the store does not estimate it).
    pub bytes: usize,
    /// (window, key) states evicted because the store was at its bound of keys or bytes.
    pub evicted_keys: u64,
    /// Holds dropped because the store was at its bound of holds.
    pub evicted_holds: u64,
}

/// What counting one observation gave.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Observed {
    pub applied: Applied,
    /// The value was computed from local state only, because the shared store was unavailable
    /// (other workers' recent counts may be missing from it).
    pub degraded: bool,
    /// Part of the key's window was dropped at the store's bound: the value is a lower bound.
    pub state_dropped: bool,
}

impl Observed {
    /// A value computed with the shared store's view.
    pub fn exact(applied: Applied) -> Observed {
        Observed {
            applied,
            degraded: false,
            state_dropped: false,
        }
    }
}

/// What a store holds for one (window, key), to show it (`CounterStore::inspect`).
#[derive(Debug, Clone)]
pub struct Inspected {
    /// The window as this process counts with it: what the backing service holds, with what
    /// this process counted and has not written yet.
    pub state: WindowState,
    /// The highest input offset applied to the key, per input lane.
    pub offsets: Vec<(u64, i64)>,
    /// Milliseconds until the backing service forgets the key (`None`: no expiry, or in
    /// process).
    pub ttl_ms: Option<i64>,
    /// Where the key lives in the backing service (`None`: in process).
    pub location: Option<String>,
    /// The prefix of the window's fields there, when the key is shared by several counters'
    /// windows (`None`: every field is this window's).
    pub field_prefix: Option<String>,
    /// This process counted into the key and has not written it to the backing service yet.
    pub unflushed: bool,
}

/// A store failure.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The backing service could not be reached or refused the operation.
    #[error("counter store unavailable: {0}")]
    Unavailable(String),
    /// The backing service answered something this version does not understand.
    #[error("counter store protocol error: {0}")]
    Protocol(String),
    /// The backing service is set up so that counts could be lost silently (a Redis that may
    /// evict keys): refused unless the operator overrides it.
    #[error("counter store refused: {0}")]
    Unsafe(String),
    /// Another process holds what this one needs alone (an input lane being replayed).
    #[error("{0}")]
    Claimed(String),
}

impl StoreError {
    /// Low-cardinality code for metrics.
    pub fn code(&self) -> &'static str {
        match self {
            StoreError::Unavailable(_) => "unavailable",
            StoreError::Protocol(_) => "protocol",
            StoreError::Unsafe(_) => "unsafe",
            StoreError::Claimed(_) => "claimed",
        }
    }
}

/// Sliding-window counters keyed by (window, canonical key bytes).
pub trait CounterStore {
    /// Opens (or finds again) the window called `name` with `spec`. The same name and spec give
    /// the same handle, so counters survive a rule reload that leaves a rule unchanged.
    fn open_window(&mut self, name: &str, spec: WindowSpec) -> WindowId;

    /// Applies one observation at event time `ts_ms` to `key` in `window`, returning the key's
    /// window value or [`Applied::Late`].
    fn apply(
        &mut self,
        window: WindowId,
        key: &[u8],
        ts_ms: i64,
        delta: Delta,
    ) -> Result<Observed, StoreError>;

    /// Reads `key` in `window` at event time `ts_ms` without changing anything (a counter an
    /// event refers to but does not feed): late if the time's bucket slid out of the key's
    /// window, else the part of the window an event at that time would see; 0 for a key never
    /// counted.
    fn read(&mut self, window: WindowId, key: &[u8], ts_ms: i64) -> Result<Observed, StoreError>;

    /// Counts an event at `ts_ms` with `value` into `key` of a `last` window: the previous
    /// event's time as the value (or [`Applied::Empty`], or [`Applied::Late`]), and its value.
    fn apply_last(
        &mut self,
        window: WindowId,
        key: &[u8],
        ts_ms: i64,
        value: LastValue,
    ) -> Result<(Observed, Option<LastValue>), StoreError>;

    /// Reads `key` of a `last` window at `ts_ms` without changing anything: the time and value
    /// of the event with the greatest time an event at `ts_ms` would see.
    fn read_last(
        &mut self,
        window: WindowId,
        key: &[u8],
        ts_ms: i64,
    ) -> Result<(Observed, Option<LastValue>), StoreError>;

    /// Opens (or finds again) the holds of the rule called `name`. A shared store keeps a hold
    /// for `ttl_ms` after setting it (at least the hold's length).
    fn open_holds(&mut self, name: &str, ttl_ms: i64) -> HoldSpace;

    /// Until when (event time, ms) `key` is held in `space`; `None` if it never was (or the
    /// shared store forgot it after its TTL).
    fn held_until(&mut self, space: HoldSpace, key: &[u8]) -> Result<Option<i64>, StoreError>;

    /// Whether a hold of `key` in `space` that would still hold at `ts_ms` may have been dropped
    /// at the store's bound (so "not held" is not known).
    fn hold_dropped(&mut self, _space: HoldSpace, _key: &[u8], _ts_ms: i64) -> bool {
        false
    }

    /// Whether the store cannot tell now whether `key` is held in `space`: the shared store is
    /// unavailable and this process knows of no hold on the key (another process may have set
    /// one that is still running).
    fn hold_unknown(&mut self, _space: HoldSpace, _key: &[u8]) -> bool {
        false
    }

    /// Raises the hold of `key` in `space` to `until_ms` unless it is already later, and returns
    /// the hold as it stands after.
    fn extend_hold(
        &mut self,
        space: HoldSpace,
        key: &[u8],
        until_ms: i64,
    ) -> Result<i64, StoreError>;

    /// What the store holds for `key` in `window`, to show it: changes nothing, counts nothing.
    fn inspect(&mut self, window: WindowId, key: &[u8]) -> Result<Inspected, StoreError>;

    /// Ends the hold of `key` in `space` (support released it): until when it held, `None` if
    /// it did not. An event judged after the release finds no hold; a raise this process or
    /// another made for the hold being released before it is not written back.
    fn release_hold(&mut self, space: HoldSpace, key: &[u8]) -> Result<Option<i64>, StoreError>;

    /// Loads the holds of `keys` that are not known locally (or not recently), in as few round
    /// trips as possible, ahead of the `held_until` calls that will need them.
    fn prefetch_holds(&mut self, _keys: &[(HoldSpace, Vec<u8>)]) -> Result<(), StoreError> {
        Ok(())
    }

    /// Tags the observations applied from now on with `origin` (`None`: untagged, as in replay).
    /// An observation whose offset is at or below the one the store recorded for its lane and key
    /// was counted before (an input replayed after a crash): it is judged against the window but
    /// not counted again.
    fn set_origin(&mut self, _origin: Option<InputPosition>) {}

    /// `key` of `window` is about to be counted or read: a store that keeps it in memory may
    /// start fetching it, so the misses of an event's several keys overlap instead of following
    /// one another. A hint only: nothing observable changes.
    #[inline]
    fn fetch_ahead(&self, _window: WindowId, _key: &[u8]) {}

    /// Whether other processes count into the same keys now (other workers of the group own
    /// partitions). A store keeping views of a shared store then reads a view another writer
    /// touched again once it is a flush interval old, so a value lacks about one flush interval
    /// of the others' counts, not whatever they counted while the view stayed cached.
    fn set_shared(&mut self, _shared: bool) {}

    /// The `apply` calls the next batch will make, in order (none other may come before
    /// `end_batch`). A store shared with other writers may apply at once, in one atomic step per
    /// key, those on keys the others count too, and have `apply` count them on the window as it
    /// stood just before that step: then no value misses what another writer counted before
    /// it, however long this process held the key's view or its batch. Whatever it did not
    /// take goes the usual way.
    fn count_ahead(&mut self, _planned: &[Planned]) -> Result<(), StoreError> {
        Ok(())
    }

    /// A promise from the caller: no observation older than `horizon_ms` will be applied or read
    /// from now on (they are late for every window). A store may then drop the keys
    /// no such event can observe. The horizon never moves back.
    fn set_horizon(&mut self, _horizon_ms: i64) {}

    /// Whether [`CounterStore::prefetch`] does anything: callers skip collecting keys otherwise.
    fn prefetches(&self) -> bool {
        false
    }

    /// Loads the windows of `keys` that are not held locally, in as few round trips as
    /// possible, ahead of the `apply` calls that will need them. Each key is best listed once
    /// (`pipeline::Touched`): a repeat costs a lookup, never a second read.
    fn prefetch(&mut self, _keys: &[(WindowId, Vec<u8>)]) -> Result<(), StoreError> {
        Ok(())
    }

    /// The windows of `keys` are the next batch's, wanted after the one being counted: a store
    /// that reads them may start now, so that the read overlaps the counting (the next
    /// `prefetch` takes in what came back). A hint only: nothing observable changes.
    fn read_ahead(&mut self, _keys: &[(WindowId, Vec<u8>)]) {}

    /// The holds of `keys` are the next batch's: a store that reads holds may start reading them
    /// now (the next `prefetch_holds` takes in what came back). A hint only, as `read_ahead`.
    fn read_holds_ahead(&mut self, _keys: &[(HoldSpace, Vec<u8>)]) {}

    /// Makes every applied observation durable in the backing service (no-op in memory).
    fn flush(&mut self) -> Result<(), StoreError>;

    /// Number of (window, key) states currently held in this process.
    fn live_keys(&self) -> usize;

    /// How much state this process holds and what it dropped to stay within its bound.
    fn state_stats(&self) -> StateStats {
        StateStats::default()
    }

    /// How many observations so far were judged on a window that already held them: applied
    /// before (by a partition's previous owner, or by this process before a crash), and not
    /// taken back — a batch counting ahead takes a count's or a sum's back, never a distinct,
    /// max, min or `last` window's. Such a judgement may have seen later events of the batch
    /// they were applied with; the caller tells whether its decision was delivered before.
    fn judged_as_held(&self) -> u64 {
        0
    }

    /// A mark that grows with every counted observation. With [`CounterStore::durable_mark`] it
    /// tells a caller when what it counted is durable (to commit input offsets after).
    fn counted_mark(&self) -> u64 {
        0
    }

    /// Every observation counted up to this mark is durable in the backing service.
    fn durable_mark(&self) -> u64 {
        self.counted_mark()
    }

    /// Lets a store that writes behind take in finished writes and start due ones (or wait for
    /// Redis under backpressure). Callers run it between events (replay), after each batch is
    /// sealed (worker), and while they have no events (nothing to do in memory).
    fn tick(&mut self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Marks the start of a batch of `lane`'s events from offset `since`, which
    /// [`CounterStore::discard_batch`] may take back until its records are journaled. Nothing
    /// it counts is sent to a shared store before its seal ([`CounterStore::seal_batch`]) says
    /// so, nor when it is discarded.
    fn begin_batch(&mut self, _lane: u64, _since: i64) {}

    /// The batch begun last is counted: the next one may begin while its records are
    /// journaled. What it counted goes out with the first flush after the seal is
    /// [`BatchSeal::journaled`] (or dropped): flushes meanwhile send everything else.
    fn seal_batch(&mut self) -> BatchSeal {
        BatchSeal::none()
    }

    /// [`CounterStore::seal_batch`], leaving what needs no engine (caching the windows the
    /// batch read, with Redis) to the caller, to run once it has released the engine.
    fn seal_batch_deferring(&mut self) -> (BatchSeal, Deferred) {
        (self.seal_batch(), Deferred::none())
    }

    /// Takes back what `lane`'s batch (begun, sealed or not, and not journaled) counted at
    /// offsets `since` and later, and the holds it raised: another worker owns that input now
    /// and counts those events itself, so none of it may reach the shared store. Everything
    /// else counted is flushed, and the windows the batch touched are read again when needed.
    /// In process there is nothing to take back: the counts are this process's own and the next
    /// owner keeps its own.
    fn discard_batch(&mut self, _lane: u64, _since: i64) -> Result<(), StoreError> {
        Ok(())
    }

    /// Drops every clean window held locally (views read from the shared store): they are read
    /// again when needed. After a rebalance, views of keys another worker counted meanwhile
    /// would be stale.
    fn forget_cached(&mut self) {}

    /// Whether the local state the shared store has not acknowledged reached its bound (during
    /// an outage): the caller should stop feeding events (they wait in their input) and `tick`
    /// until it clears.
    fn saturated(&self) -> bool {
        false
    }
}
