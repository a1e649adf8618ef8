//! Following a failover without losing what the old master acknowledged: replication is
//! asynchronous, so a replica promoted in its place may lack its last writes. Each flush asks a
//! replica of every master it wrote to confirm the writes (`WAIT 1`, in the same round trip,
//! for at most `replica_ack_timeout`); the deltas of flushes no replica has confirmed yet are
//! kept here. A confirmation covers every earlier write on that master, so the list is emptied
//! as soon as every master is confirmed again: normally it holds one flush or none.
//!
//! When the store sees a failover (a cluster slot map or the sentinels name a new master), it
//! sends those deltas again over views whose Redis versions it forgets: the script skips every
//! delta whose input position the key has recorded, so what the promoted replica got is not
//! counted twice and what it lacks is counted once. Without confirmations (`replica_ack_timeout
//! = "off"`, or more unconfirmed deltas than the bound while a replica is away), every view is
//! written again instead (`reseed`), which restores a key only if nobody wrote it since.

use super::view::Dirty;
use super::RedisStore;
use crate::clock::MonotonicClock;
use crate::store::codec::{Observation, Offsets};
use crate::store::keys::StoredKey;
use crate::window::WindowState;

/// Most unconfirmed observations kept (about 40 MB): beyond, a replica has been away for long,
/// and the list is dropped rather than grow with it.
const MAX_UNCONFIRMED: usize = 1_000_000;

/// Deltas Redis acknowledged that no replica has confirmed yet.
#[derive(Default)]
pub(super) struct Unconfirmed {
    keys: Vec<(StoredKey, Vec<Observation>)>,
    observations: usize,
    /// The counted index of the oldest kept observation: nothing from it on is durable.
    pub(super) oldest: Option<u64>,
    /// The bound was hit since the last confirmation: the list is incomplete.
    overflowed: bool,
}

impl<C: MonotonicClock> RedisStore<C> {
    /// Keeps the deltas a flush wrote for `key` (the oldest counted as `oldest`) until a replica
    /// confirms them.
    pub(super) fn keep_unconfirmed(
        &mut self,
        key: StoredKey,
        observations: Vec<Observation>,
        oldest: Option<u64>,
    ) {
        let kept = &mut self.unconfirmed;
        if kept.overflowed || observations.is_empty() {
            return;
        }
        kept.observations += observations.len();
        kept.oldest = kept.oldest.min(oldest).or(kept.oldest).or(oldest);
        kept.keys.push((key, observations));
        if kept.observations > MAX_UNCONFIRMED {
            tracing::warn!(
                observations = kept.observations,
                "no Redis replica has confirmed the last flushes: if a failover came now, writes only the master has could be lost"
            );
            self.stats.unconfirmed_dropped += kept.observations as u64;
            *kept = Unconfirmed {
                overflowed: true,
                ..Unconfirmed::default()
            };
        }
    }

    /// Every master's replica confirmed every write so far.
    pub(super) fn confirmed(&mut self) {
        self.unconfirmed = Unconfirmed::default();
    }

    /// Follows a failover another link of this store has seen (a read that met the promoted
    /// replica) before anything read from it is used.
    pub(super) fn catch_up_failover(&mut self) {
        let seen = self.target.promotions();
        if seen > self.epochs.promotions {
            self.epochs.promotions = seen;
            self.follow_failover();
        }
    }

    /// A failover was seen: the deltas no replica confirmed go again, exactly once by their
    /// input positions, over views whose versions are forgotten (the promoted replica's
    /// versions are not the old master's). Falls back to writing every view again when the
    /// deltas were not kept.
    pub(super) fn follow_failover(&mut self) {
        self.stats.failovers += 1;
        if self.config.replica_ack_timeout.is_none() || self.unconfirmed.overflowed {
            self.unconfirmed = Unconfirmed::default();
            self.reseed();
            return;
        }
        let Unconfirmed {
            keys,
            observations,
            oldest,
            ..
        } = std::mem::take(&mut self.unconfirmed);
        let index = oldest.unwrap_or(self.counted + 1);
        for (key, again) in keys {
            self.pending += again.len();
            if let Some(dirty) = self.views.dirty.get_mut(&key) {
                // Older than anything pending: in front.
                let mut merged = again;
                merged.append(&mut dirty.pending);
                dirty.pending = merged;
                dirty.pending_oldest = Some(dirty.pending_oldest.map_or(index, |o| o.min(index)));
                continue;
            }
            let (state, offsets, base_unknown) = match self.views.cache.get(&key) {
                Some(cached) => (cached.state.clone(), cached.offsets.clone(), false),
                None => {
                    // Its view left the cache: it holds these counts only until the flush
                    // brings the window back (hits on it are marked degraded meanwhile).
                    let spec = self.windows.spec(key.window);
                    let mut state = WindowState::new(spec.aggregate);
                    for o in &again {
                        o.apply_to(&mut state, &spec);
                    }
                    (state, Offsets::new(), true)
                }
            };
            let mut dirty = Dirty::new(state, None, None, None, offsets);
            dirty.base_unknown = base_unknown;
            dirty.pending = again;
            dirty.pending_oldest = Some(index);
            self.views.dirty.insert(key, dirty);
        }
        for dirty in self.views.dirty.values_mut() {
            dirty.version = None;
            dirty.full = false;
        }
        self.views.cache.invalidate_all();
        self.raise_holds_again();
        self.stats.rewritten_unconfirmed += observations as u64;
        tracing::warn!(
            observations,
            "followed a Redis failover: counts no replica had confirmed are written again to the new master (exactly once)"
        );
    }
}
