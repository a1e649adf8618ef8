//! Counting ahead: while other workers count into the same keys (a per-IP counter fed by
//! partitions several workers own), a batch's observations on those keys are applied in Redis
//! before the batch is judged, one atomic script step per key, and the script sends back the
//! window as it stood just before. The batch then counts on that window: each shared key sees
//! the batch as one step of its history, so no value misses what another worker counted
//! before it — however far the worker's batch reaches in event time (a backlog's batch spans
//! minutes) and however long its view was cached. Keys only this worker writes keep writing
//! behind.
//!
//! Exactly once as ever: each delta carries its lane and offset, so what the script applied
//! here is skipped by any later flush or by a next owner re-reading the events. A batch that
//! does not count everything planned (it stopped early) leaves a view short of what Redis holds:
//! that view is dropped and read again.

use std::sync::Arc;

use hashbrown::HashMap;

use super::flusher::KEYS_PER_CALL;
use super::view::{ttl_ms, Cached, Dirty};
use super::RedisStore;
use crate::clock::MonotonicClock;
use crate::store::codec::{self, KeyFlush, Observation, Offsets, Reply, Stored};
use crate::store::counter_store::{InputPosition, Observed, Planned, StoreError, WindowId};
use crate::store::keys::{KeyBytes, KeyRef, StoredKey};
use crate::window::{Applied, Delta, WindowState};

/// A key the batch counts ahead: the window as Redis held it just before the batch's step, with
/// the batch's observations applied as `apply` counts them.
pub(super) struct Ahead {
    pub(super) state: WindowState,
    /// The offsets Redis had recorded before the step: an observation at or below them was
    /// skipped by the script, and is judged, not counted, here too.
    prior_offsets: Offsets,
    /// Redis' version and offsets after the step.
    version: u64,
    offsets: Offsets,
    /// Planned observations `apply` has not counted yet.
    remaining: usize,
    /// Redis lost its data while the batch ran: the view is written again in full.
    pub(super) lost: bool,
    /// The prior offsets raised by what `apply` counted here: what a rewrite may claim.
    counted: Offsets,
    /// Observations of the batch Redis already held (a previous owner counted them ahead and
    /// stopped before journaling its decisions), taken out of `state` so that each event is
    /// judged on the window as it stood before it: `apply` counts each back in, in order.
    taken_back: Vec<(InputPosition, i64, Delta)>,
}

impl<C: MonotonicClock> RedisStore<C> {
    /// `CounterStore::count_ahead`: applies the planned observations on shared keys (a clean
    /// view another writer touched) in Redis, through the flusher (after the flush in flight, so
    /// what this process counted before lands first), and keeps each key's prior window for
    /// `apply`. On any failure nothing is kept: the batch counts the usual way and its deltas
    /// go with a later flush, skipped where this step applied them.
    pub(super) fn count_planned_ahead(&mut self, planned: &[Planned]) -> Result<(), StoreError> {
        self.settle_ahead();
        if !self.views.shared || self.breaker.is_open() || planned.is_empty() {
            return Ok(());
        }
        // The flush in flight first: its keys may turn clean (and shared) with it.
        match self.complete(true) {
            Ok(()) => {}
            Err(StoreError::Unavailable(m)) if m == super::flusher::FLUSHER_STOPPED => {
                return Err(StoreError::Unavailable(m))
            }
            Err(e) => {
                self.flushing.last_error = Some(e);
                return Ok(());
            }
        }
        let mut keys: Vec<(StoredKey, Vec<Observation>)> = Vec::new();
        // Decided once per key: all of a key's observations go ahead, or none (the cache may
        // evict a view between two of them).
        let mut index: HashMap<StoredKey, Option<usize>, foldhash::fast::RandomState> =
            HashMap::default();
        // A key of the message key has no other writer to count ahead of, and counting it
        // ahead would cost the partition's next owner its exact values: re-reading the batch
        // after a crash between the step and the decision journal, it would judge the batch's
        // first events on a window that holds the whole batch.
        for p in planned.iter().filter(|p| p.follows_message_key) {
            if !index.contains_key(&KeyRef {
                window: p.window.0,
                key: &p.key,
            }) {
                index.insert(
                    StoredKey {
                        window: p.window.0,
                        key: KeyBytes::new(&p.key),
                    },
                    None,
                );
            }
        }
        for p in planned {
            let lookup = KeyRef {
                window: p.window.0,
                key: &p.key,
            };
            let at = match index.get(&lookup) {
                Some(&decided) => decided,
                None => {
                    let ahead = !self.views.dirty.contains_key(&lookup)
                        && match self.views.cache.get(&lookup) {
                            Some(cached) => self.views.shared_key(p.window.0, &cached.offsets),
                            None => false,
                        };
                    let stored = StoredKey {
                        window: p.window.0,
                        key: KeyBytes::new(&p.key),
                    };
                    let decided = ahead.then_some(keys.len());
                    if ahead {
                        keys.push((stored.clone(), Vec::new()));
                    }
                    index.insert(stored, decided);
                    decided
                }
            };
            let Some(at) = at else { continue };
            let bucket = self.windows.spec(p.window.0).bucket_of(p.ts_ms);
            keys[at]
                .1
                .push(Observation::new(bucket, p.delta, Some(p.origin), None));
        }
        if keys.is_empty() {
            return Ok(());
        }
        let replies = match self.run_ahead(&keys) {
            Ok(Some(replies)) => replies,
            // A failover crossed the step: whatever it wrote goes again with the batch's flush.
            Ok(None) => return Ok(()),
            Err(e) => {
                self.fail(&e, "counting ahead");
                return Ok(());
            }
        };
        // The step's observations are counted now, and durable once a replica has them.
        let oldest = self.counted + 1;
        let observations: usize = keys.iter().map(|(_, o)| o.len()).sum();
        self.counted += observations as u64;
        self.stats.counted_ahead += observations as u64;
        let (replies, replicated) = replies;
        let keep = !replicated && self.config.replica_ack_timeout.is_some();
        for ((key, observed), reply) in keys.into_iter().zip(replies) {
            // Its view is the prior window now, or (a reply not as asked: Redis has the deltas
            // or not, a flush will tell) read again when needed.
            self.views.cache.invalidate(&key);
            let spec = self.windows.spec(key.window);
            if let Ok((
                Reply::Before(Stored {
                    mut state,
                    version,
                    offsets: prior_offsets,
                }),
                counts,
            )) = codec::parse_reply(&spec, &reply)
            {
                self.stats.refused_late += counts.late;
                // What the script skipped is counted as `apply` judges it (`count_on_ahead`).
                let mut offsets = prior_offsets.clone();
                for origin in observed.iter().filter_map(|o| o.origin) {
                    codec::raise(&mut offsets, origin.lane, origin.offset);
                }
                self.views.learn(key.window, &offsets, || {
                    observed.len() >= 2 || super::view::several_observations(&spec, &state)
                });
                // Observations Redis held before the step are events of a previous owner's
                // step, counted ahead, whose decisions never went out: judged again here, each
                // must not see the events after it. A count or a sum can take them out and
                // count them back in order; other windows are judged as Redis holds them.
                let mut taken_back = Vec::new();
                for o in &observed {
                    let Some(origin) = o.origin else { continue };
                    if codec::replayed(&prior_offsets, Some(origin))
                        && state.take_back(&spec, o.bucket, o.delta())
                    {
                        taken_back.push((origin, o.bucket, o.delta()));
                    }
                }
                self.stats.taken_back += taken_back.len() as u64;
                let (remaining, counted) = (observed.len(), prior_offsets.clone());
                self.views.ahead.insert(
                    key.clone(),
                    Ahead {
                        state,
                        prior_offsets,
                        version,
                        offsets,
                        remaining,
                        lost: false,
                        counted,
                        taken_back,
                    },
                );
            }
            if keep {
                self.keep_unconfirmed(key, observed, Some(oldest));
            }
        }
        self.update_durable();
        Ok(())
    }

    /// Sends the step on the flusher's link (one job, waited for): the flattened per-key
    /// replies and whether a replica confirmed them; `None` if a failover crossed it.
    #[allow(clippy::type_complexity)]
    fn run_ahead(
        &mut self,
        keys: &[(StoredKey, Vec<Observation>)],
    ) -> Result<Option<(Vec<codec::KeyReply>, bool)>, StoreError> {
        let empty = Offsets::new();
        let mut batch = self.script_batch(
            keys,
            KEYS_PER_CALL,
            |(key, _)| key,
            |(key, observations), call, name| {
                let spec = self.windows.spec(key.window);
                let unused = WindowState::new(spec.aggregate);
                let flush = KeyFlush {
                    spec: &spec,
                    prefix: self.section(key.window),
                    ttl_ms: ttl_ms(&spec, self.config.max_lateness),
                    version: None,
                    refresh: true,
                    state: &unused,
                    base_head: None,
                    offsets: &empty,
                    deltas: observations,
                    full: false,
                    before: true,
                };
                codec::add_key(call, name, &flush);
            },
        );
        batch.confirm = true;
        let order = batch.order.clone();
        let Some((calls, replicated)) = self.run_on_flusher(batch)? else {
            return Ok(None);
        };
        let replies = self.replies(calls, &order)?;
        Ok(Some((replies, replicated)))
    }

    /// The view `apply` counts a key on while the batch counts it ahead.
    #[inline]
    pub(super) fn count_on_ahead(
        &mut self,
        window: WindowId,
        key: &[u8],
        bucket: i64,
        delta: Delta,
    ) -> Option<Observed> {
        let ahead = self.views.ahead.get_mut(&KeyRef {
            window: window.0,
            key,
        })?;
        let spec = self.windows.spec(window.0);
        let origin = self.origin;
        let applied = if codec::replayed(&ahead.prior_offsets, origin) {
            self.stats.skipped_applied += 1;
            let taken_back = origin.and_then(|origin| {
                ahead
                    .taken_back
                    .iter()
                    .position(|&taken| taken == (origin, bucket, delta))
            });
            match taken_back {
                // In Redis already: counted back here only.
                Some(at) => {
                    ahead.taken_back.swap_remove(at);
                    ahead.state.apply(&spec, bucket, delta)
                }
                None => {
                    self.stats.judged_as_held += 1;
                    super::view::judge(&ahead.state, &spec, bucket)
                }
            }
        } else {
            if let Some(origin) = origin {
                codec::raise(&mut ahead.counted, origin.lane, origin.offset);
            }
            ahead.state.apply(&spec, bucket, delta)
        };
        ahead.remaining = ahead.remaining.saturating_sub(1);
        Some(Observed {
            applied,
            degraded: false,
            state_dropped: false,
        })
    }

    /// A read of a key the batch counts ahead.
    #[inline]
    pub(super) fn read_ahead(&self, window: WindowId, key: &[u8], bucket: i64) -> Option<Applied> {
        let ahead = self.views.ahead.get(&KeyRef {
            window: window.0,
            key,
        })?;
        Some(ahead.state.read(&self.windows.spec(window.0), bucket))
    }

    /// At a batch's end (or before the next): a key that counted everything planned holds what
    /// Redis holds, and is cached as such; any other is read again when needed.
    pub(super) fn settle_ahead(&mut self) {
        for (key, mut ahead) in std::mem::take(&mut self.views.ahead) {
            if ahead.lost {
                // What Redis held is claimed by the offsets: every observation taken back goes
                // in again, counted back or not.
                let spec = self.windows.spec(key.window);
                for (_, bucket, delta) in ahead.taken_back.drain(..) {
                    ahead.state.apply(&spec, bucket, delta);
                }
                // Written again in full with the next flush, as `reseed` does for every view.
                let mut dirty = Dirty::new(ahead.state, Some(0), None, None, ahead.counted);
                dirty.rewrite();
                self.views.dirty.insert(key, dirty);
            } else if ahead.remaining == 0 {
                let cached = Cached {
                    state: ahead.state,
                    version: Some(ahead.version),
                    // The step refreshed the TTL only if it wrote: leave the next write to.
                    refreshed: None,
                    offsets: ahead.offsets,
                };
                self.views.cache.insert(key, Arc::new(cached));
            } else {
                self.views.cache.invalidate(&key);
            }
        }
    }
}
