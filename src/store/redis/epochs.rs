//! Data-loss detection: Redis holds an epoch key (per master on a cluster) that flushes check;
//! when it vanished or changed (a restart without persistence, FLUSHALL), or a cluster's slot map
//! named a new master (a failover: the promoted replica holds the epoch key, but replication is
//! asynchronous and the last writes the old master acknowledged may be missing), every key this
//! process holds a view of is written again from that view.
//!
//! A failover is followed by `failover` instead, which writes again exactly what no replica
//! confirmed; writing every view again is its fallback when that was not kept (a view written
//! again replaces a key only where it is gone: a key the promoted replica holds at an older
//! version is taken as re-created by another writer, and stands).

use std::sync::Arc;
use std::time::Instant;

use redis::Value;

use super::view::{Cached, Dirty};
use super::RedisStore;
use crate::clock::MonotonicClock;
use crate::store::counter_store::StoreError;
use crate::store::keys::{push_hex, StoredKey};
use crate::store::link::{slot, Batch};

/// The keys that tell whether Redis lost its data (one per master on a cluster), with the value
/// this process knows each holds.
pub(super) struct Epochs {
    pub(super) keys: Vec<String>,
    pub(super) known: Vec<Option<Vec<u8>>>,
    /// The cluster failovers taken in so far (a promoted replica may lack acknowledged writes
    /// even though it holds the epoch key: it counts as a change of epoch).
    pub(super) promotions: u64,
    /// What this process writes into an absent epoch key.
    candidate: Vec<u8>,
    /// When a flush last checked the epoch keys.
    pub(super) last_check: Instant,
    /// The next flush checks the epoch keys whenever the last check was (`flush` asks for it).
    pub(super) due: bool,
}

impl Epochs {
    /// One epoch key on a single server; on a cluster one per master, in the first slot it
    /// serves. Nothing is known of them yet.
    pub(super) fn new(cluster: bool, first_slots: Vec<u16>) -> Epochs {
        let keys: Vec<String> = if cluster {
            first_slots.into_iter().map(epoch_key_in_slot).collect()
        } else {
            vec!["vg:epoch".to_owned()]
        };
        Epochs {
            known: vec![None; keys.len()],
            keys,
            promotions: 0,
            candidate: {
                let mut text = String::new();
                push_hex(&mut text, &rand::random::<[u8; 16]>());
                text.into_bytes()
            },
            last_check: Instant::now(),
            due: false,
        }
    }

    /// `SET key candidate NX GET` for each key: sets the ones that are absent and returns what
    /// each held before.
    pub(super) fn add_checks(&self, batch: &mut Batch, cluster: bool) {
        for key in &self.keys {
            let mut set = redis::cmd("SET");
            set.arg(key).arg(&self.candidate).arg("NX").arg("GET");
            batch.command(cluster, key, set);
        }
    }

    /// Asks each master (the one holding each epoch key) for its memory settings: `INFO memory`
    /// tells its `maxmemory-policy`.
    pub(super) fn add_policy_checks(&self, batch: &mut Batch, cluster: bool) {
        for key in &self.keys {
            let mut info = redis::cmd("INFO");
            info.arg("memory");
            batch.command(cluster, key, info);
        }
    }

    /// Takes in the replies of `add_checks`: true if an epoch this process knew vanished or
    /// changed (Redis lost its data).
    pub(super) fn check(&mut self, replies: &[Value]) -> Result<bool, StoreError> {
        let mut lost = false;
        for (known, reply) in self.known.iter_mut().zip(replies) {
            let now = match reply {
                Value::Nil => self.candidate.clone(),
                other => redis::from_redis_value::<Vec<u8>>(other.clone())
                    .map_err(|e| StoreError::Protocol(format!("epoch: {e}")))?,
            };
            if known
                .as_ref()
                .is_some_and(|k| *reply == Value::Nil || *k != now)
            {
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

impl<C: MonotonicClock> RedisStore<C> {
    /// Redis lost its data: every key this process holds a view of is written again from it,
    /// with the deltas Redis has not acknowledged (in case someone re-created the key first).
    pub(super) fn reseed(&mut self) {
        self.stats.data_losses += 1;
        let cached: Vec<(StoredKey, Arc<Cached>)> = self.views.cache.drain();
        let mut count = self.views.dirty.len();
        for dirty in self.views.dirty.values_mut() {
            dirty.rewrite();
        }
        // Keys the batch counts ahead are written again once it has counted them all.
        for ahead in self.views.ahead.values_mut() {
            ahead.lost = true;
        }
        for (key, cached) in cached {
            if self.views.dirty.contains_key(&key) || cached.state.head().is_none() {
                continue;
            }
            let mut dirty = Dirty::new(
                cached.state.clone(),
                Some(0),
                None,
                None,
                cached.offsets.clone(),
            );
            dirty.rewrite();
            self.views.dirty.insert(key, dirty);
            count += 1;
        }
        self.raise_holds_again();
        self.stats.reseeded_keys += count as u64;
        tracing::error!(
            keys = count,
            "Redis lost its data (its epoch key vanished or changed, or a failover promoted a replica): writing every counter this worker holds again from its local view"
        );
    }

    /// Every hold this process knows is raised again (a hold raise is idempotent: the later
    /// time stands).
    pub(super) fn raise_holds_again(&mut self) {
        // What was read before may be what Redis lost, or the old master's.
        self.holds.void_reads_ahead();
        let index = self.counted + 1;
        for view in self.holds.views.values_mut() {
            // A batch not journaled yet raises its own once it is.
            if let (Some(until), None, None) = (view.journaled_until(), view.pending, view.inflight)
            {
                view.pending = Some((until, index));
                self.holds.pending += 1;
            }
        }
    }
}
