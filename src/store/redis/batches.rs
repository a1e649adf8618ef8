//! Batches whose records are being journaled. A worker's partition seals its batch once it is
//! counted and judged, and writes the journal without the engine, while other partitions count.
//! Until the seal says the records are journaled, nothing the batch counted may reach Redis (a
//! batch fenced at its journal write is taken back and must leave no trace there). Meanwhile
//! flushes send everything else: a key the batch counted sends the other deltas it holds, to be
//! merged by the script, whose reply brings the window back; the batch's hold raises wait in
//! the batch, raising the views (so that every later event sees them) but not their pending
//! raise.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::view::Dirty;
use super::RedisStore;
use crate::clock::MonotonicClock;
use crate::store::counter_store::{BatchSeal, InputPosition, StoreError};
use crate::store::keys::StoredKey;

/// A batch begun and not yet journaled.
struct OpenBatch {
    lane: u64,
    /// Its first offset: its observations are its lane's at this offset and later.
    since: i64,
    /// The counted index when it began: what it counted is above.
    ticket: u64,
    /// Its hold raises: key, until when, counted index.
    raises: Vec<(StoredKey, i64, u64)>,
    /// The keys it counted ahead: read again if it is taken back.
    ahead: Vec<StoredKey>,
    /// Set once its records are journaled (`None`: it is being counted, not sealed yet).
    journaled: Option<Arc<AtomicBool>>,
}

/// The batches begun and not yet journaled, oldest first; at most one per lane, and at most
/// one being counted (the last).
#[derive(Default)]
pub(super) struct OpenBatches {
    batches: Vec<OpenBatch>,
}

impl OpenBatches {
    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    /// Whether an observation from `origin` was counted by a batch not journaled yet.
    #[inline]
    pub(super) fn holds_back(&self, origin: Option<InputPosition>) -> bool {
        origin.is_some_and(|origin| {
            self.batches
                .iter()
                .any(|b| b.lane == origin.lane && origin.offset >= b.since)
        })
    }

    /// The first counted index any open batch may have used: nothing from it on is in Redis.
    pub(super) fn oldest_index(&self) -> Option<u64> {
        self.batches.iter().map(|b| b.ticket + 1).min()
    }

    /// Whether a batch is being counted (begun, not sealed).
    pub(super) fn counting(&self) -> bool {
        self.batches.last().is_some_and(|b| b.journaled.is_none())
    }

    /// Records a hold raise of the batch being counted, if one is: `false` when no batch is.
    pub(super) fn record_raise(&mut self, key: &StoredKey, until: i64, index: u64) -> bool {
        match self.batches.last_mut() {
            Some(batch) if batch.journaled.is_none() => {
                batch.raises.push((key.clone(), until, index));
                true
            }
            _ => false,
        }
    }

    /// The highest raise of `key` an open batch holds.
    pub(super) fn unjournaled(&self, key: &StoredKey) -> Option<i64> {
        self.batches
            .iter()
            .flat_map(|b| &b.raises)
            .filter(|(raised, _, _)| raised == key)
            .map(|&(_, until, _)| until)
            .max()
    }

    /// Drops the open batches' raises of `key` (support released the hold: the release covers
    /// them, as it covers a raise not sent yet).
    pub(super) fn forget_raises(&mut self, key: &StoredKey) {
        for batch in &mut self.batches {
            batch.raises.retain(|(raised, _, _)| raised != key);
        }
    }
}

impl<C: MonotonicClock> RedisStore<C> {
    /// `CounterStore::begin_batch`.
    pub(super) fn begin_open_batch(&mut self, lane: u64, since: i64) {
        self.reap_journaled();
        // A caller that begins again without a journaled seal on this lane, or without sealing
        // the batch before: that batch stands, as a dropped seal says.
        let (stale, open): (Vec<OpenBatch>, Vec<OpenBatch>) =
            std::mem::take(&mut self.batches.batches)
                .into_iter()
                .partition(|b| b.lane == lane || b.journaled.is_none());
        self.batches.batches = open;
        for batch in stale {
            self.settle_raises(batch.raises, true);
        }
        self.batches.batches.push(OpenBatch {
            lane,
            since,
            ticket: self.counted,
            raises: Vec::new(),
            ahead: Vec::new(),
            journaled: None,
        });
    }

    /// `CounterStore::seal_batch`: the windows the batch counted ahead and read settle, and its
    /// counts wait for the seal.
    pub(super) fn seal_open_batch(&mut self) -> BatchSeal {
        let ahead: Vec<StoredKey> = self.views.ahead.keys().cloned().collect();
        self.settle_ahead();
        self.views.cache.settle(&self.views.dirty);
        self.holds.prefetched_at = None;
        match self.batches.batches.last_mut() {
            Some(batch) if batch.journaled.is_none() => {
                let journaled = Arc::new(AtomicBool::new(false));
                batch.ahead = ahead;
                batch.journaled = Some(Arc::clone(&journaled));
                BatchSeal::watching(journaled)
            }
            _ => BatchSeal::none(),
        }
    }

    /// The batches whose seals say journaled close: their hold raises join the views' pending
    /// ones, and their deltas go with the next flush.
    pub(super) fn reap_journaled(&mut self) {
        let journaled = |b: &OpenBatch| {
            b.journaled
                .as_ref()
                .is_some_and(|flag| flag.load(Ordering::Acquire))
        };
        if !self.batches.batches.iter().any(journaled) {
            return;
        }
        let (done, open): (Vec<OpenBatch>, Vec<OpenBatch>) =
            std::mem::take(&mut self.batches.batches)
                .into_iter()
                .partition(journaled);
        self.batches.batches = open;
        for batch in done {
            self.settle_raises(batch.raises, true);
        }
    }

    /// Takes `raises` out of the open batches' care: kept, each becomes (or joins) its view's
    /// pending raise; dropped (the batch is taken back), each view falls back to what else
    /// raised it.
    fn settle_raises(&mut self, raises: Vec<(StoredKey, i64, u64)>, keep: bool) {
        for (key, until, index) in raises {
            let unjournaled = self.batches.unjournaled(&key);
            let Some(view) = self.holds.views.get_mut(&key) else {
                // Released meanwhile (its raises went with it).
                continue;
            };
            view.unjournaled = unjournaled;
            if keep {
                view.pending = Some(match view.pending {
                    Some((raised, first)) => (raised.max(until), first.min(index)),
                    None => {
                        self.holds.pending += 1;
                        (until, index)
                    }
                });
            }
            view.raise_to_known();
        }
    }

    /// `CounterStore::discard_batch`: `lane`'s open batch (sealed or not) is taken back: its
    /// hold raises, the views of what it counted ahead, and its deltas.
    pub(super) fn discard_open_batch(&mut self, lane: u64, since: i64) -> Result<(), StoreError> {
        self.reap_journaled();
        let batch = self
            .batches
            .batches
            .iter()
            .position(|b| b.lane == lane)
            .map(|at| self.batches.batches.remove(at));
        // A hold read sent before may carry what is taken back now.
        self.holds.void_reads_ahead();
        let mut ahead: Vec<StoredKey> = std::mem::take(&mut self.views.ahead).into_keys().collect();
        if let Some(batch) = batch {
            ahead.extend(batch.ahead);
            self.settle_raises(batch.raises, false);
        }
        // What the batch counted ahead is in Redis already (a next owner skips it by its
        // offsets); the views of those keys are read again.
        for key in &ahead {
            self.views.cache.invalidate(key);
        }
        self.take_back_batch(lane, since)
    }

    /// Whether every window delta left to send (and every view left to write again in full)
    /// waits for a batch not journaled yet: a flush of everything may stop there.
    pub(super) fn only_held_back_left(&self) -> bool {
        let waits = |d: &Dirty| d.pending.iter().any(|o| self.batches.holds_back(o.origin));
        let pending_waits = |d: &Dirty| d.pending.iter().all(|o| self.batches.holds_back(o.origin));
        self.views
            .dirty
            .values()
            .all(|d| (!d.full || waits(d)) && (self.pending == 0 || pending_waits(d)))
    }
}
