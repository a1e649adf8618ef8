//! The merged per-key view: a key with deltas Redis has not acknowledged ([`Dirty`]: the last
//! window read from Redis plus every delta since), a clean window as Redis returned it
//! ([`Cached`]), how a replayed observation is judged, when a write refreshes the key's TTL; and
//! the store's counting and reading on those views (a view it lacks is read from Redis).

use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hashbrown::HashMap;

use super::slices::Slices;
use super::RedisStore;
use crate::clock::MonotonicClock;
use crate::store::codec::{self, Observation, Offsets, Stored};
use crate::store::counter_store::{Observed, StoreError, WindowId};
use crate::store::keys::{key_name, KeyBytes, KeyRef, StoredKey};
use crate::window::{Aggregate, Applied, Delta, LastValue, WindowSpec, WindowState};

/// This process's views of windows.
pub(super) struct Views {
    /// Keys with unacknowledged deltas. Never evicted: nothing counted is dropped before Redis
    /// has acknowledged it. Each view is boxed, so that the table itself stays small: see
    /// `RedisStore::measure_local_bytes`, which shrinks it under the engine lock.
    pub(super) dirty: HashMap<StoredKey, Box<Dirty>, foldhash::fast::RandomState>,
    /// Clean windows as Redis last returned them: a bounded, time-to-idle read cache.
    pub(super) cache: CleanViews,
    /// Keys the batch being counted counts ahead (see `ahead.rs`).
    pub(super) ahead: HashMap<StoredKey, super::ahead::Ahead, foldhash::fast::RandomState>,
    /// Other processes count into the same keys now (`CounterStore::set_shared`).
    pub(super) shared: bool,
    /// By window: what its keys' recorded offsets told of whether they span partitions.
    locality: Vec<Locality>,
    /// The lanes this process counted since its views were last forgotten: a key only they
    /// wrote changes in Redis only through this process.
    own_lanes: Vec<u64>,
    /// Hashes of the keys the last plan of reads ahead found with a clean view, and of those its
    /// early reads took in (alone only): the next prefetch does not look them up again (each
    /// lookup in the large tables is a cache miss or more). A view evicted or dropped in between
    /// is read when counted, as any view not cached is.
    pub(super) cached_at_plan: hashbrown::HashSet<u64, foldhash::fast::RandomState>,
    pub(super) plan_hasher: foldhash::fast::RandomState,
    /// By aggregate, the view of a key Redis holds nothing for: shared by every such key (most
    /// keys a cold workload reads, a rule's counter of failures for an account that never
    /// failed, say), which then costs the cache an entry but no window of its own.
    empty: [Arc<Cached>; 6],
}

/// How [`RedisStore::wanted_windows`] treats the cache: look every key up, and note the hashes of
/// those with a clean view (`Record`), or take those noted as cached (`Trust`).
pub(super) enum CacheCheck<'s> {
    Record(&'s mut hashbrown::HashSet<u64, foldhash::fast::RandomState>),
    Trust(&'s hashbrown::HashSet<u64, foldhash::fast::RandomState>),
}

/// How many entries the cache's table is sized for at start: as many as it may hold, up to a
/// million (moka then allocates 2²¹ bucket pointers, 16 MiB) and one per 256 bytes of its
/// bound. Grown from empty, the table was copied at every doubling while the cache filled, on
/// whichever thread inserted: 4–5 % of a cold replay's time, and of a cold worker's partition
/// threads.
fn presized_entries(capacity: u64, cache_bytes: u64) -> usize {
    let entries = capacity.min(cache_bytes / 256).min(1_000_000);
    usize::try_from(entries).unwrap_or(0)
}

// A slot of the dirty table, as `RedisStore::measure_local_bytes` counts it.
const _: () = assert!(size_of::<(StoredKey, Box<Dirty>)>() == 48);

impl Views {
    /// Views whose clean windows take at most `cache_bytes` (estimated) and number at most
    /// `capacity`.
    pub(super) fn new(capacity: u64, cache_bytes: u64, time_to_idle: Duration) -> Views {
        // An eighth of the bound for the keys Redis held nothing for (`Empties`: a table slot
        // each), the rest for moka.
        let empties_bytes = cache_bytes / 8;
        let moka_bytes = cache_bytes - empties_bytes;
        // Each window weighs its bytes, but at least its share of the bound: so the cache keeps
        // at most `capacity` windows of any size and at most `cache_bytes` whatever their sizes.
        let share = (cache_bytes / capacity.max(1)).clamp(1, u64::from(u32::MAX)) as u32;
        let presence = Arc::new(Presence::default());
        let listening = Arc::clone(&presence);
        let empty = [
            Aggregate::Count,
            Aggregate::Sum,
            Aggregate::Distinct,
            Aggregate::Max,
            Aggregate::Min,
            Aggregate::Last,
        ]
        .map(|aggregate| {
            Arc::new(Cached {
                state: WindowState::new(aggregate),
                version: Some(0),
                refreshed: None,
                offsets: Offsets::new(),
            })
        });
        let max_empty_keys = capacity.min(empties_bytes / Empties::SLOT_BYTES as u64);
        Views {
            dirty: HashMap::default(),
            cache: CleanViews {
                cache: Cache {
                    moka: moka::sync::Cache::builder()
                        .max_capacity(moka_bytes.max(1))
                        .initial_capacity(presized_entries(capacity, moka_bytes))
                        .weigher(move |key: &StoredKey, cached: &Arc<Cached>| {
                            let bytes =
                                u32::try_from(cached_bytes(key, cached)).unwrap_or(u32::MAX);
                            bytes.max(share)
                        })
                        .time_to_idle(time_to_idle)
                        .eviction_listener(move |key, _, cause| {
                            // Replaced: the key stays, with its newer view.
                            if cause != moka::notification::RemovalCause::Replaced {
                                listening.forget(&*key);
                            }
                        })
                        .build_with_hasher(foldhash::fast::RandomState::default()),
                    presence,
                    empties: Arc::new(std::sync::Mutex::new(Empties::new(
                        usize::try_from(max_empty_keys).unwrap_or(usize::MAX),
                        time_to_idle,
                        empty.clone(),
                    ))),
                },
                loaded: Tallied::default(),
                recent: Tallied::default(),
                aging: Tallied::default(),
                aging_pace: None,
                settling: Vec::new(),
                watchers: 0,
                touched: Default::default(),
                generation: 0,
                early_taken: false,
            },
            ahead: HashMap::default(),
            shared: false,
            locality: Vec::new(),
            own_lanes: Vec::new(),
            cached_at_plan: Default::default(),
            plan_hasher: Default::default(),
            empty,
        }
    }

    /// The view of a key Redis holds nothing for, in a window of `aggregate`.
    pub(super) fn empty_view(&self, aggregate: Aggregate) -> Arc<Cached> {
        let view = &self.empty[aggregate as usize];
        debug_assert!(view.state == WindowState::new(aggregate) && view.version == Some(0));
        Arc::clone(view)
    }

    /// Looks `key`'s dirty view up now, and asks for the lines counting into it will touch (the
    /// view and the end of its pending deltas) without waiting for them: the misses of an
    /// event's several keys then overlap instead of following one another. A hint only.
    #[inline]
    pub(super) fn fetch_ahead(&self, window: WindowId, key: &[u8]) {
        use crate::store::key_table::prefetch_line;
        let lookup = KeyRef {
            window: window.0,
            key,
        };
        if let Some(dirty) = self.dirty.get(&lookup) {
            let at = std::ptr::from_ref::<Dirty>(dirty).cast::<u8>();
            for line in 0..size_of::<Dirty>().div_ceil(64) {
                prefetch_line(at.wrapping_add(line * 64));
            }
            prefetch_line(dirty.pending.as_ptr_range().end);
        }
    }

    /// Notes that this process counts `lane`'s events.
    #[inline]
    pub(super) fn own_lane(&mut self, lane: u64) {
        if self.own_lanes.last() != Some(&lane) && !self.own_lanes.contains(&lane) {
            self.own_lanes.push(lane);
        }
    }

    /// Drops every clean view and what this process knows of its lanes (it may lose some).
    pub(super) fn forget_cached(&mut self) {
        self.ahead.clear();
        self.cache.invalidate_all();
        self.cached_at_plan.clear();
        self.own_lanes.clear();
    }

    /// Whether, while other processes count into the same keys, a key of `window` with these
    /// recorded offsets may change in Redis without this process: its window's keys span
    /// partitions, or a lane this process does not count wrote it. Such a key's clean view is
    /// read again for every batch (and counted ahead where the batch counts it), so it never
    /// misses what the others wrote while it stayed cached.
    pub(super) fn shared_key(&self, window: u32, offsets: &Offsets) -> bool {
        self.shared
            && (self
                .locality
                .get(window as usize)
                .is_none_or(Locality::spanning)
                || offsets
                    .iter()
                    .any(|(lane, _)| !self.own_lanes.contains(lane)))
    }

    /// Learns from a key's recorded offsets whether its window's keys span partitions. A key
    /// written from one partition tells something only if it holds `several` observations (a
    /// key seen once is on one partition whatever its counter).
    #[inline]
    pub(super) fn learn(&mut self, window: u32, offsets: &Offsets, several: impl FnOnce() -> bool) {
        let window = window as usize;
        if self.locality.len() <= window {
            self.locality.resize(window + 1, Locality::default());
        }
        let locality = &mut self.locality[window];
        if locality.two_lanes {
            return;
        }
        match offsets.len() {
            0 => {}
            // Only while it can still change the answer: counting observations is not free.
            1 if locality.one_lane < Locality::LOCAL_AFTER && several() => locality.one_lane += 1,
            1 => {}
            _ => locality.two_lanes = true,
        }
    }
}

/// Clean windows: the bounded moka read cache, and in front of it the windows read for the batch
/// being counted. Most of those the batch counts into at once (a key first seen), and a counted
/// key's view is its dirty one until its flush puts the window Redis acknowledged in the cache:
/// so they never need the cache's insert and lookup, which cost more than the rest of counting
/// a key (concurrent maps, eviction bookkeeping). [`CleanViews::settle`] moves the others in.
pub(super) struct CleanViews {
    cache: Cache,
    /// Read since the last `settle`, not in `cache`.
    loaded: Tallied,
    /// Windows the last flush brought back, newer than what `cache` may hold for their keys.
    /// A hot key is counted into again before the next flush comes back, and then never passes
    /// through moka; the others go to `aging` then ([`CleanViews::age`]).
    recent: Tallied,
    /// Windows the flush before the last brought back, on their way to `cache` a slice per
    /// tick ([`CleanViews::age_some`]): a moka insert costs microseconds, a flush brings back
    /// thousands of windows, and the engine waits while they are moved.
    aging: Tallied,
    /// How `aging` is spread over ticks (see `slices`).
    aging_pace: Option<Slices>,
    /// Windows sealed batches read, on their way to `cache` without the engine ([`Settling`]),
    /// oldest first.
    settling: Vec<Arc<Settling>>,
    /// Early reads out (see `early.rs`): while there are some, `touched` records every key
    /// whose clean view was taken in, replaced or dropped.
    watchers: u32,
    touched: hashbrown::HashSet<StoredKey, foldhash::fast::RandomState>,
    /// Grows when every clean view is dropped at once (or `touched` would grow too large): the
    /// early reads planned before are not taken in.
    generation: u64,
    /// `loaded` holds the early reads of the batch about to be counted.
    pub(super) early_taken: bool,
}

/// The moka cache of clean views, and the hashes of the keys it holds beside it; and the keys
/// Redis held nothing for, apart ([`Empties`]). A batch's read plan asks about every key it
/// touches, and a moka lookup costs several cache misses (a key compared, through its `Arc`, at
/// every bucket its table probes); the set answers with one or two. A hash in the set says
/// "maybe" (moka may have dropped the key a moment ago, or another key has the same hash):
/// whoever needs the view itself asks moka.
#[derive(Clone)]
struct Cache {
    moka: moka::sync::Cache<StoredKey, Arc<Cached>, foldhash::fast::RandomState>,
    presence: Arc<Presence>,
    /// A key is in `moka` or here, never in both.
    empties: Arc<std::sync::Mutex<Empties>>,
}

impl Cache {
    fn empties(&self) -> std::sync::MutexGuard<'_, Empties> {
        // Nothing panics while holding it.
        self.empties.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn get<Q: std::hash::Hash + hashbrown::Equivalent<StoredKey>>(
        &self,
        key: &Q,
    ) -> Option<Arc<Cached>> {
        // The empty keys first: their table is flat (one or two misses), and on a cold workload
        // most keys asked for are there. Then moka, not asked of the set first: most keys asked
        // for are cached (the reads were planned on it).
        if let Some(view) = self.empties().get(key) {
            return Some(view);
        }
        self.moka.get(key)
    }

    fn contains_key<Q: std::hash::Hash + hashbrown::Equivalent<StoredKey>>(&self, key: &Q) -> bool {
        self.empties().contains(key) || (self.presence.may_hold(key) && self.moka.contains_key(key))
    }

    /// Whether the cache may hold `key`: `false` means it does not.
    fn may_hold<Q: std::hash::Hash + hashbrown::Equivalent<StoredKey>>(&self, key: &Q) -> bool {
        self.presence.may_hold(key) || self.empties().contains(key)
    }

    fn insert(&self, key: StoredKey, cached: Arc<Cached>) {
        let mut empties = self.empties();
        if let Some(aggregate) = empties.aggregate_of(&cached) {
            // An older, non-empty view of the key must not outlive this one in moka.
            if self.presence.may_hold(&key) {
                self.presence.forget(&key);
                self.moka.invalidate(&key);
            }
            empties.insert(key, aggregate);
            return;
        }
        empties.remove(&key);
        drop(empties);
        self.presence.note(&key);
        self.moka.insert(key, cached);
    }

    fn invalidate(&self, key: &StoredKey) {
        self.empties().remove(key);
        self.presence.forget(key);
        self.moka.invalidate(key);
    }

    fn invalidate_all(&self) {
        self.empties().clear();
        self.presence.clear();
        self.moka.invalidate_all();
    }

    /// Every view the cache holds.
    fn views(&self) -> Vec<(StoredKey, Arc<Cached>)> {
        let mut all = self.empties().views();
        all.extend(
            self.moka
                .iter()
                .map(|(key, cached)| ((*key).clone(), cached)),
        );
        all
    }

    fn entry_count(&self) -> u64 {
        self.moka.entry_count() + self.empties().len() as u64
    }

    fn run_pending_tasks(&self) {
        self.empties().expire(Instant::now());
        self.moka.run_pending_tasks();
    }

    /// The estimated bytes of what the cache holds (moka's charge: each window at least its
    /// share), of the set beside it, and of the empty keys.
    fn bytes(&self) -> usize {
        usize::try_from(self.moka.weighted_size())
            .unwrap_or(usize::MAX)
            .saturating_add(self.presence.bytes())
            .saturating_add(self.empties().bytes())
    }
}

/// The clean views of keys Redis held nothing for, by key alone. On a cold workload most windows
/// read are of such keys (an account's first payment reads its every counter), and as moka
/// entries each cost its maps and eviction bookkeeping several hundred bytes and a few thousand
/// instructions to insert, for a view all of them share ([`Views::empty_view`]); here a key costs
/// a table slot. Bounded by count, and by idle time as moka is, in two generations: a key is
/// looked up in both and moved to the young one when found in the old one; when the young one is
/// full, or a time-to-idle old, it becomes the old one and the old one is dropped. So an empty key
/// stays between one and two time-to-idle periods after its last use, unless a flood of others
/// pushes it out (it is then read again when needed: nothing counted is lost).
struct Empties {
    young: HashMap<StoredKey, u8, foldhash::fast::RandomState>,
    old: HashMap<StoredKey, u8, foldhash::fast::RandomState>,
    /// When `young` began.
    since: Instant,
    /// Most keys in one generation.
    max_per_generation: usize,
    time_to_idle: Duration,
    /// The keys' heap bytes (long keys).
    heap: usize,
    /// By aggregate, the view shared by every key here ([`Views::empty_view`]).
    views: [Arc<Cached>; 6],
}

impl Empties {
    /// The most bytes one key costs here (its slot, and the control byte beside it).
    const SLOT_BYTES: usize = size_of::<(StoredKey, u8)>() + 1;

    fn new(max_keys: usize, time_to_idle: Duration, views: [Arc<Cached>; 6]) -> Empties {
        Empties {
            young: HashMap::default(),
            old: HashMap::default(),
            since: Instant::now(),
            max_per_generation: (max_keys / 2).max(1),
            time_to_idle,
            heap: 0,
            views,
        }
    }

    /// The aggregate whose shared empty view `cached` is, if it is one.
    fn aggregate_of(&self, cached: &Arc<Cached>) -> Option<u8> {
        self.views
            .iter()
            .position(|view| Arc::ptr_eq(view, cached))
            .map(|at| at as u8)
    }

    fn get<Q: std::hash::Hash + hashbrown::Equivalent<StoredKey>>(
        &mut self,
        key: &Q,
    ) -> Option<Arc<Cached>> {
        let aggregate = match self.young.get(key) {
            Some(&aggregate) => aggregate,
            None => {
                // Used: it moves to the young generation.
                let (stored, aggregate) = self.old.remove_entry(key)?;
                self.heap -= stored.key.heap_bytes();
                self.insert_young(stored, aggregate);
                aggregate
            }
        };
        Some(Arc::clone(&self.views[usize::from(aggregate)]))
    }

    fn contains<Q: std::hash::Hash + hashbrown::Equivalent<StoredKey>>(&self, key: &Q) -> bool {
        self.young.contains_key(key) || self.old.contains_key(key)
    }

    fn insert(&mut self, key: StoredKey, aggregate: u8) {
        if let Some((old, _)) = self.old.remove_entry(&key) {
            self.heap -= old.key.heap_bytes();
        }
        if let Some(held) = self.young.get_mut(&key) {
            *held = aggregate;
            return;
        }
        self.insert_young(key, aggregate);
    }

    fn insert_young(&mut self, key: StoredKey, aggregate: u8) {
        if self.young.len() >= self.max_per_generation {
            self.next_generation(Instant::now());
        }
        self.heap += key.key.heap_bytes();
        self.young.insert(key, aggregate);
    }

    fn remove(&mut self, key: &StoredKey) {
        if let Some((stored, _)) = self
            .young
            .remove_entry(key)
            .or_else(|| self.old.remove_entry(key))
        {
            self.heap -= stored.key.heap_bytes();
        }
    }

    /// The young generation becomes the old one; the old one's keys are dropped.
    fn next_generation(&mut self, now: Instant) {
        let capacity = self.young.capacity();
        let old = std::mem::replace(
            &mut self.old,
            std::mem::replace(
                &mut self.young,
                HashMap::with_capacity_and_hasher(capacity, Default::default()),
            ),
        );
        self.heap -= old.keys().map(|key| key.key.heap_bytes()).sum::<usize>();
        self.since = now;
    }

    /// Drops the keys not used for a time-to-idle period, roughly (see [`Empties`]).
    fn expire(&mut self, now: Instant) {
        if now.saturating_duration_since(self.since) >= self.time_to_idle {
            self.next_generation(now);
        }
    }

    fn clear(&mut self) {
        self.young.clear();
        self.old.clear();
        self.heap = 0;
    }

    fn views(&self) -> Vec<(StoredKey, Arc<Cached>)> {
        self.young
            .iter()
            .chain(&self.old)
            .map(|(key, &aggregate)| (key.clone(), Arc::clone(&self.views[usize::from(aggregate)])))
            .collect()
    }

    fn len(&self) -> usize {
        self.young.len() + self.old.len()
    }

    fn bytes(&self) -> usize {
        (self.young.capacity() + self.old.capacity()) * Self::SLOT_BYTES + self.heap
    }
}

/// The hashes of the keys in the moka cache: added on insert, removed by its eviction listener
/// (which moka calls on whichever thread runs its upkeep: hence the mutex, never contended).
#[derive(Default)]
struct Presence {
    hasher: foldhash::fast::RandomState,
    hashes: std::sync::Mutex<hashbrown::HashSet<u64, foldhash::fast::RandomState>>,
}

impl Presence {
    fn hashes(
        &self,
    ) -> std::sync::MutexGuard<'_, hashbrown::HashSet<u64, foldhash::fast::RandomState>> {
        // Nothing panics while holding it.
        self.hashes.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn note(&self, key: &StoredKey) {
        let hash = self.hasher.hash_one(key);
        self.hashes().insert(hash);
    }

    fn forget<Q: std::hash::Hash>(&self, key: &Q) {
        let hash = self.hasher.hash_one(key);
        self.hashes().remove(&hash);
    }

    /// Whether the cache may hold `key`: `false` means it does not.
    fn may_hold<Q: std::hash::Hash>(&self, key: &Q) -> bool {
        let hash = self.hasher.hash_one(key);
        self.hashes().contains(&hash)
    }

    fn clear(&self) {
        self.hashes().clear();
    }

    /// The set's heap: a hash and a control byte per slot.
    fn bytes(&self) -> usize {
        self.hashes().capacity() * (std::mem::size_of::<u64>() + 1)
    }
}

/// A table of clean views beside the cache, with their bytes (`cached_bytes`) kept as views come
/// and go: summing them at each measurement would walk thousands of windows under the engine.
#[derive(Default)]
struct Tallied {
    map: HashMap<StoredKey, Arc<Cached>, foldhash::fast::RandomState>,
    bytes: usize,
}

impl Tallied {
    fn with_capacity(capacity: usize) -> Tallied {
        Tallied {
            map: HashMap::with_capacity_and_hasher(capacity, Default::default()),
            bytes: 0,
        }
    }

    fn get<Q: std::hash::Hash + hashbrown::Equivalent<StoredKey>>(
        &self,
        key: &Q,
    ) -> Option<&Arc<Cached>> {
        self.map.get(key)
    }

    fn contains_key<Q: std::hash::Hash + hashbrown::Equivalent<StoredKey>>(&self, key: &Q) -> bool {
        self.map.contains_key(key)
    }

    fn insert(&mut self, key: StoredKey, cached: Arc<Cached>) {
        match self.map.entry(key) {
            hashbrown::hash_map::Entry::Occupied(mut entry) => {
                self.bytes -= cached_bytes(entry.key(), entry.get());
                self.bytes += cached_bytes(entry.key(), &cached);
                entry.insert(cached);
            }
            hashbrown::hash_map::Entry::Vacant(entry) => {
                self.bytes += cached_bytes(entry.key(), &cached);
                entry.insert(cached);
            }
        }
    }

    fn remove<Q: std::hash::Hash + hashbrown::Equivalent<StoredKey>>(
        &mut self,
        key: &Q,
    ) -> Option<Arc<Cached>> {
        let (key, cached) = self.map.remove_entry(key)?;
        self.bytes -= cached_bytes(&key, &cached);
        Some(cached)
    }

    fn drain(&mut self) -> hashbrown::hash_map::Drain<'_, StoredKey, Arc<Cached>> {
        self.bytes = 0;
        self.map.drain()
    }

    fn clear(&mut self) {
        self.bytes = 0;
        self.map.clear();
    }

    fn len(&self) -> usize {
        self.map.len()
    }

    fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

impl CleanViews {
    pub(super) fn get<Q: std::hash::Hash + hashbrown::Equivalent<StoredKey>>(
        &self,
        key: &Q,
    ) -> Option<Arc<Cached>> {
        match self
            .loaded
            .get(key)
            .or_else(|| self.recent.get(key))
            .or_else(|| self.aging.get(key))
            .or_else(|| self.settling_view(key))
        {
            Some(view) => Some(Arc::clone(view)),
            None => self.cache.get(key),
        }
    }

    pub(super) fn contains_key<Q: std::hash::Hash + hashbrown::Equivalent<StoredKey>>(
        &self,
        key: &Q,
    ) -> bool {
        self.held_beside(key) || self.cache.contains_key(key)
    }

    /// Whether `key`'s view is in one of the tables beside the cache.
    fn held_beside<Q: std::hash::Hash + hashbrown::Equivalent<StoredKey>>(&self, key: &Q) -> bool {
        self.loaded.contains_key(key)
            || self.recent.contains_key(key)
            || self.aging.contains_key(key)
            || self.settling_view(key).is_some()
    }

    /// `key`'s view in a sealed batch's windows on their way to the cache, unless retired (the
    /// newest batch first).
    fn settling_view<Q: std::hash::Hash + hashbrown::Equivalent<StoredKey>>(
        &self,
        key: &Q,
    ) -> Option<&Arc<Cached>> {
        self.settling.iter().rev().find_map(|batch| batch.view(key))
    }

    /// `key`'s view changes (or goes): whatever a sealed batch still has on its way to the cache
    /// for it must not get there.
    fn retire<Q: std::hash::Hash + hashbrown::Equivalent<StoredKey>>(&self, key: &Q) {
        for batch in &self.settling {
            batch.retire(key);
        }
    }

    /// Whether there may be a clean view of `key`, without asking moka: a key it holds is
    /// always found, and one it dropped a moment ago may be too (its view is then read when
    /// the key is counted, as any view not cached is). Planning reads, most keys asked about
    /// are cached, and moka costs a lookup several cache misses.
    pub(super) fn may_hold<Q: std::hash::Hash + hashbrown::Equivalent<StoredKey>>(
        &self,
        key: &Q,
    ) -> bool {
        self.held_beside(key) || self.cache.may_hold(key)
    }

    /// A window as Redis returned it now, to the cache.
    pub(super) fn insert(&mut self, key: StoredKey, cached: Arc<Cached>) {
        self.record(&key);
        self.retire(&key);
        self.loaded.remove(&key);
        self.recent.remove(&key);
        self.aging.remove(&key);
        self.cache.insert(key, cached);
    }

    /// A window a flush brought back (the key's deltas acknowledged): kept beside the cache
    /// until the next flush comes back.
    pub(super) fn acknowledged(&mut self, key: StoredKey, cached: Arc<Cached>) {
        self.record(&key);
        self.retire(&key);
        self.loaded.remove(&key);
        self.aging.remove(&key);
        self.recent.insert(key, cached);
    }

    /// A flush came back: the windows the previous one brought back that nothing counted into
    /// since start their way to the cache. What is still on its way from the flush before goes
    /// now, first: a key is in one of `loaded`, `recent` and `aging` at most, and none of them
    /// reaches moka after a newer view of its key.
    /// `within`: how long the slices may take (before the next flush is likely back), `budget` per
    /// tick.
    pub(super) fn age(&mut self, within: Duration, budget: Duration) {
        for (key, cached) in self.aging.drain() {
            self.cache.insert(key, cached);
        }
        std::mem::swap(&mut self.aging, &mut self.recent);
        self.aging_pace = (!self.aging.is_empty())
            .then(|| Slices::new(self.aging.len(), within, budget, Instant::now()));
    }

    /// Moves the next slice of `aging` to the cache (a tick that began at `tick`).
    pub(super) fn age_some(&mut self, tick: Instant) {
        let Some(pace) = &mut self.aging_pace else {
            return;
        };
        // What the iterator has not reached stays in `aging`.
        let Tallied { map, bytes } = &mut self.aging;
        let mut aging = map.extract_if(|_, _| true);
        pace.begin_tick(tick);
        while pace.more(Instant::now()) {
            let Some((key, cached)) = aging.next() else {
                break;
            };
            *bytes -= cached_bytes(&key, &cached);
            self.cache.insert(key, cached);
            pace.did_one();
        }
        drop(aging);
        if self.aging.is_empty() {
            self.aging_pace = None;
            // Taken out one by one, the entries left tombstones that every lookup of a key not
            // there would probe past once this table is `recent` again: a fresh one instead.
            self.aging = Tallied::with_capacity(self.aging.map.capacity());
        }
    }

    /// Notes, while early reads are out, that `key`'s clean view changed.
    fn record(&mut self, key: &StoredKey) {
        if self.watchers == 0 {
            return;
        }
        if self.touched.len() >= Self::MAX_TOUCHED {
            self.void_early_reads();
        } else {
            self.touched.insert(key.clone());
        }
    }

    const MAX_TOUCHED: usize = 1 << 20;

    fn void_early_reads(&mut self) {
        self.generation += 1;
        self.touched.clear();
    }

    /// An early read is planned: from now on, changed views are recorded. Returns the generation
    /// the read belongs to (a later one voids it).
    pub(super) fn watch(&mut self) -> u64 {
        self.watchers += 1;
        self.generation
    }

    /// An early read is back (or given up); whether something voided it is `generation`'s to
    /// tell.
    pub(super) fn unwatch(&mut self) {
        self.release();
        self.forget_if_unwatched();
    }

    /// An early read being taken in stops watching, but what was recorded stays until
    /// [`CleanViews::forget_if_unwatched`]: its own take-ins are then not recorded (nor can they
    /// void it half way) unless another read is out.
    pub(super) fn release(&mut self) {
        self.watchers = self.watchers.saturating_sub(1);
    }

    pub(super) fn forget_if_unwatched(&mut self) {
        if self.watchers == 0 {
            self.touched.clear();
        }
    }

    pub(super) fn generation(&self) -> u64 {
        self.generation
    }

    /// Whether `key`'s clean view changed since the early reads out were planned.
    pub(super) fn touched(&self, key: &StoredKey) -> bool {
        self.touched.contains(key)
    }

    /// A window read for the batch being counted.
    pub(super) fn load(&mut self, key: StoredKey, cached: Arc<Cached>) {
        self.record(&key);
        self.retire(&key);
        self.recent.remove(&key);
        self.aging.remove(&key);
        self.loaded.insert(key, cached);
    }

    /// [`CleanViews::load`] for a key known to have no clean view anywhere (an early read's,
    /// planned when it had none and recorded by none since): nothing beside `loaded` to retire
    /// or remove, which is three or more lookups in large tables.
    pub(super) fn load_unheld(&mut self, key: StoredKey, cached: Arc<Cached>) {
        debug_assert!(!self.held_beside(&key));
        self.record(&key);
        self.loaded.insert(key, cached);
    }

    /// Whether enough was read since the last `settle` to settle now, whoever forgets to: the
    /// windows read for one batch stay bounded.
    fn overfull(&self) -> bool {
        self.loaded.len() >= Self::MAX_LOADED
    }

    /// Far above what a batch reads (8 192 messages of a few keys each).
    const MAX_LOADED: usize = 1 << 17;

    /// Removes a window read for this batch: the batch counts into its key, whose clean view is
    /// not used again before its flush brings a newer one.
    fn unload<Q: std::hash::Hash + hashbrown::Equivalent<StoredKey>>(
        &mut self,
        key: &Q,
    ) -> Option<Arc<Cached>> {
        self.retire(key);
        self.loaded
            .remove(key)
            .or_else(|| self.recent.remove(key))
            .or_else(|| self.aging.remove(key))
    }

    pub(super) fn invalidate(&mut self, key: &StoredKey) {
        self.record(key);
        self.retire(key);
        self.loaded.remove(key);
        self.recent.remove(key);
        self.aging.remove(key);
        self.cache.invalidate(key);
    }

    pub(super) fn invalidate_all(&mut self) {
        self.void_early_reads();
        self.loaded.clear();
        self.recent.clear();
        self.aging.clear();
        self.aging_pace = None;
        self.retire_settling();
        self.cache.invalidate_all();
    }

    /// Nothing sealed batches still have on their way to the cache gets there.
    fn retire_settling(&mut self) {
        for batch in self.settling.drain(..) {
            batch.retire_all();
        }
    }

    /// Every clean view, emptying them all.
    pub(super) fn drain(&mut self) -> Vec<(StoredKey, Arc<Cached>)> {
        self.void_early_reads();
        // The newest view of each key: read for the batch, else brought back by the last
        // flush, else by the one before, else cached.
        let mut newest: HashMap<StoredKey, Arc<Cached>, foldhash::fast::RandomState> =
            self.cache.views().into_iter().collect();
        for batch in &self.settling {
            newest.extend(batch.live_views());
        }
        self.retire_settling();
        newest.extend(self.aging.drain());
        newest.extend(self.recent.drain());
        newest.extend(self.loaded.drain());
        let all: Vec<(StoredKey, Arc<Cached>)> = newest.into_iter().collect();
        self.aging_pace = None;
        self.cache.invalidate_all();
        all
    }

    pub(super) fn entry_count(&self) -> u64 {
        let settling: usize = self.settling.iter().map(|batch| batch.views.len()).sum();
        (self.loaded.len() + self.recent.len() + self.aging.len() + settling) as u64
            + self.cache.entry_count()
    }

    /// Estimated bytes of the clean views: the cache's (with its set of hashes) and those beside
    /// it.
    pub(super) fn bytes(&self) -> usize {
        // Evictions the cache still owes, so that its charge is within its bound.
        self.cache.run_pending_tasks();
        let settling: usize = self.settling.iter().map(|batch| batch.bytes).sum();
        let beside = self.loaded.bytes + self.recent.bytes + self.aging.bytes + settling;
        beside.saturating_add(self.cache.bytes())
    }

    /// Hands the windows read for the sealed batch, but for those it made dirty, to a job that
    /// puts them in the cache without the engine ([`Settling`]); `None` if there are none.
    pub(super) fn settle_later(
        &mut self,
        dirty: &HashMap<StoredKey, Box<Dirty>, foldhash::fast::RandomState>,
    ) -> Option<SettleJob> {
        self.settling.retain(|batch| !batch.done());
        let mut views = HashMap::with_capacity_and_hasher(self.loaded.len(), Default::default());
        let mut bytes = 0;
        for (key, cached) in self.loaded.drain() {
            if !dirty.contains_key(&key) {
                bytes += cached_bytes(&key, &cached);
                views.insert(key, cached);
            }
        }
        if views.is_empty() {
            return None;
        }
        let settling = Arc::new(Settling {
            views,
            bytes,
            retired: Default::default(),
            done: Default::default(),
        });
        self.settling.push(Arc::clone(&settling));
        Some(SettleJob {
            settling: Some(settling),
            cache: self.cache.clone(),
        })
    }

    /// Moves the windows read for the last batch into the cache, but for those it made dirty.
    pub(super) fn settle(
        &mut self,
        dirty: &HashMap<StoredKey, Box<Dirty>, foldhash::fast::RandomState>,
    ) {
        self.settling.retain(|batch| !batch.done());
        for (key, cached) in self.loaded.drain() {
            if !dirty.contains_key(&key) {
                self.cache.insert(key, cached);
            }
        }
    }
}

/// The windows a sealed batch read and did not count into, on their way to the moka cache.
///
/// A moka insert costs microseconds (its maps, its eviction bookkeeping, a key lock while an
/// eviction listener is set), a batch of a cold workload reads thousands of windows, and every
/// other partition waits for the engine while they are inserted: so the batch's partition
/// inserts them once it has released the engine ([`SettleJob`]). Meanwhile lookups find them
/// here. A key whose view changes or goes in between (read again, brought back by a flush,
/// counted into, dropped) is retired and never inserted, so the cache never takes a window after
/// a newer one of its key, nor one dropped since.
pub(super) struct Settling {
    views: HashMap<StoredKey, Arc<Cached>, foldhash::fast::RandomState>,
    /// The views' estimated bytes (`cached_bytes`).
    bytes: usize,
    /// Held while the job checks a key and inserts it, and while a key is retired: the two never
    /// interleave.
    retired: std::sync::Mutex<Retired>,
    /// The job is over.
    done: std::sync::atomic::AtomicBool,
}

#[derive(Default)]
struct Retired {
    all: bool,
    keys: hashbrown::HashSet<StoredKey, foldhash::fast::RandomState>,
}

impl Settling {
    fn retired(&self) -> std::sync::MutexGuard<'_, Retired> {
        // Nothing panics while holding it.
        self.retired.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn view<Q: std::hash::Hash + hashbrown::Equivalent<StoredKey>>(
        &self,
        key: &Q,
    ) -> Option<&Arc<Cached>> {
        let (stored, view) = self.views.get_key_value(key)?;
        let retired = self.retired();
        (!retired.all && !retired.keys.contains(stored)).then_some(view)
    }

    fn retire<Q: std::hash::Hash + hashbrown::Equivalent<StoredKey>>(&self, key: &Q) {
        if let Some((stored, _)) = self.views.get_key_value(key) {
            self.retired().keys.insert(stored.clone());
        }
    }

    fn retire_all(&self) {
        self.retired().all = true;
    }

    /// The views not retired.
    fn live_views(&self) -> Vec<(StoredKey, Arc<Cached>)> {
        let retired = self.retired();
        if retired.all {
            return Vec::new();
        }
        self.views
            .iter()
            .filter(|(key, _)| !retired.keys.contains(*key))
            .map(|(key, view)| (key.clone(), Arc::clone(view)))
            .collect()
    }

    fn done(&self) -> bool {
        self.done.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// Puts a sealed batch's windows in the cache ([`Settling`]): run without the engine. Dropped
/// without being run, it runs then.
pub(super) struct SettleJob {
    settling: Option<Arc<Settling>>,
    cache: Cache,
}

impl SettleJob {
    pub fn run(mut self) {
        self.insert_all();
    }

    fn insert_all(&mut self) {
        let Some(settling) = self.settling.take() else {
            return;
        };
        for (key, view) in &settling.views {
            let retired = settling.retired();
            if retired.all {
                break;
            }
            if !retired.keys.contains(key) {
                self.cache.insert(key.clone(), Arc::clone(view));
            }
        }
        settling
            .done
            .store(true, std::sync::atomic::Ordering::Release);
    }
}

impl Drop for SettleJob {
    fn drop(&mut self) {
        self.insert_all();
    }
}

/// Estimated bytes of a clean view of `key` (the entry, the key's and the window's heap).
pub(super) fn cached_bytes(key: &StoredKey, cached: &Cached) -> usize {
    size_of::<(StoredKey, Arc<Cached>)>()
        + size_of::<Cached>()
        + key.key.heap_bytes()
        + cached.state.heap_bytes()
        + offsets_heap_bytes(&cached.offsets)
}

/// Estimated heap bytes of a key with deltas Redis has not acknowledged (the key's and the
/// window's, the observations kept for it).
pub(super) fn dirty_heap_bytes(key: &StoredKey, dirty: &Dirty) -> usize {
    size_of::<Dirty>()
        + key.key.heap_bytes()
        + dirty.state.heap_bytes()
        + offsets_heap_bytes(&dirty.offsets)
        + (dirty.inflight.capacity() + dirty.pending.capacity()) * size_of::<Observation>()
        + dirty
            .inflight
            .iter()
            .chain(&dirty.pending)
            .filter_map(|o| o.last.as_ref())
            .map(|last| size_of::<(i64, LastValue)>() + last.1.heap_bytes())
            .sum::<usize>()
}

fn offsets_heap_bytes(offsets: &Offsets) -> usize {
    if offsets.spilled() {
        offsets.capacity() * size_of::<(u64, i64)>()
    } else {
        0
    }
}

/// Whether `state` holds at least two observations (for a sum: in two buckets at least).
pub(super) fn several_observations(spec: &WindowSpec, state: &WindowState) -> bool {
    match (spec.aggregate, state) {
        (Aggregate::Sum, WindowState::Series(series))
        | (Aggregate::Max, WindowState::Max(series))
        | (Aggregate::Min, WindowState::Min(series)) => series.buckets().nth(1).is_some(),
        // One kept event says nothing about how many there were.
        (Aggregate::Last, _) => false,
        _ => state.value() >= 2,
    }
}

/// Whether a window's keys span partitions, as far as their recorded offsets tell: once one
/// key was written from two lanes, yes for good (a per-IP counter when events are keyed by
/// user; a per-card one the first time a card is used from two accounts); until then, yes
/// until enough keys were seen written from one lane only (a per-user counter).
#[derive(Clone, Copy, Default)]
pub(super) struct Locality {
    two_lanes: bool,
    one_lane: u32,
}

impl Locality {
    /// Keys seen written from one lane only, with none from two, before a window is taken as
    /// partition-local.
    const LOCAL_AFTER: u32 = 1_000;

    fn spanning(&self) -> bool {
        self.two_lanes || self.one_lane < Self::LOCAL_AFTER
    }
}

/// A key with deltas Redis has not acknowledged: the merged view (last window from Redis + every
/// delta since), the deltas of the flush in flight, and those counted after it was sent.
pub(super) struct Dirty {
    pub(super) state: WindowState,
    /// The Redis version (`v`) the view is based on (0: Redis held nothing); `None` if unknown.
    pub(super) version: Option<u64>,
    /// The head Redis holds at `version`.
    pub(super) base_head: Option<i64>,
    /// The head of the view when the in-flight deltas were sent: Redis' head once they land.
    pub(super) sent_head: Option<i64>,
    /// When this process last had Redis refresh the key's TTL (see `refresh_due`).
    pub(super) refreshed: Option<Instant>,
    /// Whether the flush in flight asks for a TTL refresh.
    pub(super) refresh_sent: bool,
    /// Highest offset per lane Redis has applied to this key, as far as this view knows.
    pub(super) offsets: Offsets,
    pub(super) inflight: Vec<Observation>,
    /// The counted index of the oldest in-flight observation.
    pub(super) inflight_oldest: Option<u64>,
    pub(super) pending: Vec<Observation>,
    /// The counted index of the oldest pending observation.
    pub(super) pending_oldest: Option<u64>,
    /// Redis could not be read when the key was first needed: the view holds local counts only
    /// until a flush brings the window back.
    pub(super) base_unknown: bool,
    /// The key is gone from Redis: the next flush writes the whole view (at version 0).
    pub(super) full: bool,
}

impl Dirty {
    /// A key with `pending` observations (the oldest counted as `pending_oldest`) over a view of
    /// Redis at `version`, nothing in flight. Boxed, as the dirty table holds it (see
    /// [`Views::dirty`]).
    pub(super) fn new(
        state: WindowState,
        version: Option<u64>,
        base_head: Option<i64>,
        refreshed: Option<Instant>,
        offsets: Offsets,
    ) -> Box<Dirty> {
        Box::new(Dirty {
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
        })
    }

    pub(super) fn push(&mut self, observation: Observation, index: u64) {
        self.pending.push(observation);
        self.pending_oldest.get_or_insert(index);
    }

    /// Puts the in-flight deltas back in front of those counted since, to be sent again.
    pub(super) fn send_again(&mut self) {
        let mut again = std::mem::take(&mut self.inflight);
        again.append(&mut self.pending);
        self.pending = again;
        self.pending_oldest = self.inflight_oldest.take().or(self.pending_oldest);
    }

    /// Redis lost the key: write the whole view again, as a new key.
    pub(super) fn rewrite(&mut self) {
        self.full = true;
        self.version = Some(0);
        self.base_head = None;
    }
}

/// How a replayed observation is judged without counting it: the window as it stands (or late,
/// if its bucket slid out).
pub(super) fn judge(state: &WindowState, spec: &WindowSpec, bucket: i64) -> Applied {
    match state.head() {
        Some(head) if bucket <= head - spec.buckets => Applied::Late,
        _ => Applied::Counted(state.value()),
    }
}

/// [`judge`], for any window: a `last` window's previous event is unknown.
pub(super) fn judged(
    state: &WindowState,
    spec: &WindowSpec,
    bucket: i64,
) -> (Applied, Option<LastValue>) {
    match state {
        // The window holds this event itself now (it was applied before): which event came
        // before it is no longer known.
        WindowState::Last(_) => match state.head() {
            Some(head) if bucket <= head - spec.buckets => (Applied::Late, None),
            _ => (Applied::Empty, None),
        },
        _ => (judge(state, spec, bucket), None),
    }
}

/// A clean window as Redis holds it at `version` (0: Redis held nothing; `None`: unknown).
#[derive(Clone)]
pub(super) struct Cached {
    pub(super) state: WindowState,
    pub(super) version: Option<u64>,
    /// When this process last had Redis refresh the key's TTL.
    pub(super) refreshed: Option<Instant>,
    pub(super) offsets: Offsets,
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
pub(super) fn ttl_ms(spec: &WindowSpec, max_lateness: Option<i64>) -> i64 {
    let window = spec.window_ms();
    let by_lateness = max_lateness.map_or(0, |lateness| {
        window.saturating_mul(2).saturating_add(lateness)
    });
    window
        .saturating_mul(TTL_WINDOWS)
        .max(by_lateness)
        .clamp(1, MAX_TTL_MS)
}

/// Whether a write should refresh the key's TTL (see `TTL_WINDOWS`), `now` by the store's clock.
#[inline]
pub(super) fn refresh_due(
    spec: &WindowSpec,
    version: Option<u64>,
    refreshed: Option<Instant>,
    now: Instant,
) -> bool {
    let window = Duration::from_millis(spec.window_ms().max(0) as u64);
    version.is_none_or(|v| v == 0)
        || refreshed.is_none_or(|at| now.saturating_duration_since(at) >= window)
}

/// Where a window's keys live in Redis: each in a hash of its own, or as a section of a hash
/// shared by the windows of one group (`WindowSpec::group`: counters over the same dimensions),
/// one per key. Sharing makes one read serve every counter of a key an event touches (an
/// account's count, last country and last amount: one `HGETALL` instead of three).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Layout {
    Own,
    /// Fields named `<prefix><field>`; the prefix, 8 hex digits and a dot, is a digest of the
    /// counter's name and window shape, so every worker derives the same one.
    Shared {
        group: u64,
        prefix: [u8; 9],
    },
}

impl Layout {
    /// The layout of a window opened as `name` with `spec`, after the windows of `opened`: its
    /// group's, unless its section's prefix is one another window of the group already has (two
    /// counters whose digests collide: the second keeps hashes of its own).
    pub(super) fn of(name: &str, spec: &WindowSpec, opened: &[Layout]) -> Layout {
        if spec.group == 0 {
            return Layout::Own;
        }
        let mut hasher = blake3::Hasher::new();
        hasher.update(b"section\0");
        hasher.update(name.as_bytes());
        hasher.update(b"\0");
        hasher.update(&spec.bucket_ms.to_le_bytes());
        hasher.update(&spec.buckets.to_le_bytes());
        hasher.update(spec.aggregate.as_str().as_bytes());
        hasher.update(&spec.identity.to_le_bytes());
        let mut hex = String::with_capacity(8);
        crate::store::keys::push_hex(&mut hex, &hasher.finalize().as_bytes()[..4]);
        let mut prefix = [b'.'; 9];
        prefix[..8].copy_from_slice(hex.as_bytes());
        let layout = Layout::Shared {
            group: spec.group,
            prefix,
        };
        if opened.contains(&layout) {
            tracing::warn!(
                counter = name,
                "this counter's section digest collides with another counter's over the same \
                 dimensions: it keeps Redis hashes of its own"
            );
            return Layout::Own;
        }
        layout
    }

    /// The prefix of the window's fields in its hash (empty: the hash is its own).
    pub(super) fn prefix(&self) -> &[u8] {
        match self {
            Layout::Own => b"",
            Layout::Shared { prefix, .. } => prefix,
        }
    }
}

impl<C: MonotonicClock> RedisStore<C> {
    /// The layout of `window`'s keys' hashes.
    pub(super) fn layout(&self, window: u32) -> Layout {
        self.layouts
            .get(window as usize)
            .copied()
            .unwrap_or(Layout::Own)
    }

    /// The prefix of `window`'s fields in its keys' hashes (empty: each key's hash is its own).
    pub(super) fn section(&self, window: u32) -> &[u8] {
        self.layouts
            .get(window as usize)
            .map_or(b"", Layout::prefix)
    }

    /// The Redis keys of `keys`, each named once, and for each of `keys` the index of its own:
    /// the windows of a shared hash are sections of one key, named (hashed) only for the first.
    pub(super) fn unique_redis_keys<'k>(
        &self,
        keys: impl Iterator<Item = (WindowId, &'k [u8])>,
    ) -> (Vec<String>, Vec<usize>) {
        let mut unique: Vec<String> = Vec::new();
        // By (shared, group or window, key): cheaper to look up than a name is to make.
        let mut positions: HashMap<(bool, u64, &[u8]), usize, foldhash::fast::RandomState> =
            HashMap::default();
        let index_of = keys
            .map(|(window, key)| {
                let hash = match self.layouts.get(window.0 as usize) {
                    Some(Layout::Shared { group, .. }) => (true, *group, key),
                    _ => (false, u64::from(window.0), key),
                };
                *positions.entry(hash).or_insert_with(|| {
                    unique.push(self.redis_key(window, key));
                    unique.len() - 1
                })
            })
            .collect();
        (unique, index_of)
    }

    /// The Redis key of (window, canonical key bytes): `vg:<name>:<digest>`, where the digest
    /// covers the window's shape, what it counts and the key, so user bytes never reach Redis raw
    /// and a counter whose window, dimensions or field change starts on fresh counters; for a
    /// window in a shared hash, `vg:_:<digest>` of its group and the key (the section's prefix
    /// then tells the window's fields apart; no counter id starts with `_`, so no counter's keys
    /// share that name space).
    pub fn redis_key(&self, window: WindowId, key: &[u8]) -> String {
        // The digest's input in one buffer, hashed at once: the same digest as feeding its parts
        // in turn, without a streaming hasher's bookkeeping per part (a name is built for every
        // key read or flushed).
        let mut input: smallvec::SmallVec<[u8; 128]> = smallvec::SmallVec::new();
        if let Some(Layout::Shared { group, .. }) = self.layouts.get(window.0 as usize) {
            input.extend_from_slice(&group.to_le_bytes());
            input.extend_from_slice(key);
            return key_name("vg:", "_", &blake3::hash(&input));
        }
        let spec = self.windows.spec(window.0);
        let name = self.windows.name(window.0);
        input.extend_from_slice(&spec.bucket_ms.to_le_bytes());
        input.extend_from_slice(&spec.buckets.to_le_bytes());
        input.extend_from_slice(spec.aggregate.as_str().as_bytes());
        input.extend_from_slice(&spec.identity.to_le_bytes());
        input.extend_from_slice(key);
        key_name("vg:", name, &blake3::hash(&input))
    }

    /// What Redis holds for the key now (its window, recorded offsets, TTL), or this process's
    /// view of it while that has deltas Redis has not acknowledged (`CounterStore::inspect`).
    pub(super) fn inspect_key(
        &mut self,
        window: WindowId,
        key: &[u8],
    ) -> Result<crate::store::Inspected, StoreError> {
        let spec = self.windows.spec(window.0);
        let name = self.redis_key(window, key);
        let mut hash = redis::cmd("HGETALL");
        hash.arg(&name);
        let mut ttl = redis::cmd("PTTL");
        ttl.arg(&name);
        let mut replies = self
            .run_each(vec![(name.clone(), hash), (name.clone(), ttl)])?
            .into_iter();
        let (Some(hash), Some(ttl)) = (replies.next(), replies.next()) else {
            return Err(StoreError::Protocol("inspection: missing replies".into()));
        };
        let stored = codec::decode_section(&spec, self.section(window.0), &codec::flat(hash)?)?;
        let ttl_ms = redis::from_redis_value::<i64>(ttl)
            .ok()
            .filter(|&ms| ms >= 0);
        let lookup = KeyRef {
            window: window.0,
            key,
        };
        let (state, mut offsets, unflushed) = match self.views.dirty.get(&lookup) {
            Some(dirty) => (dirty.state.clone(), dirty.offsets.clone(), true),
            None => (stored.state, Offsets::new(), false),
        };
        for &(lane, offset) in &stored.offsets {
            codec::raise(&mut offsets, lane, offset);
        }
        offsets.sort_unstable();
        Ok(crate::store::Inspected {
            state,
            offsets: offsets.into_vec(),
            ttl_ms,
            location: Some(name),
            field_prefix: Some(self.section(window.0))
                .filter(|p| !p.is_empty())
                .map(|p| String::from_utf8_lossy(p).into_owned()),
            unflushed,
        })
    }

    /// Counts one observation on the key's view (`CounterStore::apply`).
    pub(super) fn count(
        &mut self,
        window: WindowId,
        key: &[u8],
        ts_ms: i64,
        delta: Delta,
    ) -> Result<Observed, StoreError> {
        self.count_with(window, key, ts_ms, delta, None)
            .map(|(observed, _)| observed)
    }

    /// Counts one observation on the key's view; a `last` window's with its value (`last`),
    /// giving back the previous event's value (`CounterStore::apply_last`).
    pub(super) fn count_with(
        &mut self,
        window: WindowId,
        key: &[u8],
        ts_ms: i64,
        delta: Delta,
        last: Option<LastValue>,
    ) -> Result<(Observed, Option<LastValue>), StoreError> {
        let spec = self.windows.spec(window.0);
        let bucket = spec.bucket_of(ts_ms);
        // A `last` window is never counted ahead (`plan_counts` leaves it out): its deltas
        // carry a value.
        if !self.views.ahead.is_empty() && last.is_none() {
            if let Some(observed) = self.count_on_ahead(window, key, bucket, delta) {
                return Ok((observed, None));
            }
        }
        let lookup = KeyRef {
            window: window.0,
            key,
        };
        let last = last.map(|value| Arc::new((ts_ms, value)));
        let observation = Observation::new(bucket, delta, self.origin, last.clone());
        let origin = observation.origin;
        let apply = |state: &mut WindowState| match &last {
            Some(last) => state.apply_last(&spec, bucket, last.0, last.1.clone()),
            None => (state.apply(&spec, bucket, delta), None),
        };
        let index = self.counted + 1;
        let ((applied, previous), counted, base_unknown) = match self.views.dirty.get_mut(&lookup) {
            Some(dirty) if codec::replayed(&dirty.offsets, origin) => (
                judged(&dirty.state, &spec, bucket),
                false,
                dirty.base_unknown,
            ),
            Some(dirty) => {
                let (applied, previous) = apply(&mut dirty.state);
                let counted = applied.is_counted();
                if counted {
                    dirty.push(observation, index);
                }
                ((applied, previous), counted, dirty.base_unknown)
            }
            None => {
                let clean = self.clean_view(window, key);
                match clean {
                    Some(clean) if codec::replayed(&clean.offsets, origin) => {
                        (judged(&clean.state, &spec, bucket), false, false)
                    }
                    Some(clean) => {
                        // The key turns dirty at once (but for a late observation): a view read
                        // for this batch is moved into its dirty view rather than copied.
                        drop(self.views.cache.unload(&lookup));
                        let Cached {
                            mut state,
                            version,
                            refreshed,
                            offsets,
                        } = Arc::try_unwrap(clean).unwrap_or_else(|shared| Cached::clone(&shared));
                        let base_head = state.head();
                        let (applied, previous) = apply(&mut state);
                        let counted = applied.is_counted();
                        let stored = StoredKey {
                            window: window.0,
                            key: KeyBytes::new(key),
                        };
                        if counted {
                            let mut dirty =
                                Dirty::new(state, version, base_head, refreshed, offsets);
                            dirty.push(observation, index);
                            self.views.dirty.insert(stored, dirty);
                        } else {
                            // Late: the window did not change; it stays the clean view.
                            self.views.cache.load(
                                stored,
                                Arc::new(Cached {
                                    state,
                                    version,
                                    refreshed,
                                    offsets,
                                }),
                            );
                        }
                        ((applied, previous), counted, false)
                    }
                    None => {
                        // Redis is unavailable: count from nothing; the deltas are merged into
                        // whatever Redis holds when it answers again (applied ones skipped).
                        let mut state = WindowState::new(spec.aggregate);
                        let (applied, previous) = apply(&mut state);
                        let mut dirty = Dirty::new(state, None, None, None, Offsets::new());
                        dirty.base_unknown = true;
                        dirty.push(observation, index);
                        self.views.dirty.insert(
                            StoredKey {
                                window: window.0,
                                key: KeyBytes::new(key),
                            },
                            dirty,
                        );
                        ((applied, previous), true, true)
                    }
                }
            }
        };
        let degraded = base_unknown || self.breaker.is_open();
        if counted {
            self.pending += 1;
            self.counted += 1;
            if degraded {
                self.stats.degraded_observations += 1;
            }
        } else if origin.is_some() && applied.is_counted() {
            // Applied before: judged on a window that holds it already.
            self.stats.skipped_applied += 1;
            self.stats.judged_as_held += 1;
        }
        // Writing behind is left to `tick`, which the caller runs between events: a flush then
        // never carries part of an event's deltas.
        Ok((
            Observed {
                applied,
                degraded,
                state_dropped: false,
            },
            previous,
        ))
    }

    /// Reads the key's view without changing it (`CounterStore::read`).
    pub(super) fn observe(
        &mut self,
        window: WindowId,
        key: &[u8],
        ts_ms: i64,
    ) -> Result<Observed, StoreError> {
        self.observe_with(window, key, ts_ms)
            .map(|(observed, _)| observed)
    }

    /// Reads the key's view without changing it, with a `last` window's value
    /// (`CounterStore::read_last`).
    pub(super) fn observe_with(
        &mut self,
        window: WindowId,
        key: &[u8],
        ts_ms: i64,
    ) -> Result<(Observed, Option<LastValue>), StoreError> {
        let spec = self.windows.spec(window.0);
        let bucket = spec.bucket_of(ts_ms);
        let read = |state: &WindowState| match state {
            WindowState::Last(_) => state.read_last(&spec, bucket),
            _ => (state.read(&spec, bucket), None),
        };
        if !self.views.ahead.is_empty() {
            if let Some(applied) = self.read_ahead(window, key, bucket) {
                return Ok((
                    Observed {
                        applied,
                        degraded: false,
                        state_dropped: false,
                    },
                    None,
                ));
            }
        }
        let lookup = KeyRef {
            window: window.0,
            key,
        };
        if let Some(dirty) = self.views.dirty.get(&lookup) {
            let degraded = dirty.base_unknown || self.breaker.is_open();
            let (applied, value) = read(&dirty.state);
            return Ok((
                Observed {
                    applied,
                    degraded,
                    state_dropped: false,
                },
                value,
            ));
        }
        let clean = self.clean_view(window, key);
        Ok(match clean {
            Some(clean) => {
                let (applied, value) = read(&clean.state);
                (
                    Observed {
                        applied,
                        degraded: self.breaker.is_open(),
                        state_dropped: false,
                    },
                    value,
                )
            }
            // Redis is unavailable and nothing was counted here: what this process knows is
            // nothing (0 for a count).
            None => (
                Observed {
                    applied: Applied::never_counted(spec.aggregate),
                    degraded: true,
                    state_dropped: false,
                },
                None,
            ),
        })
    }

    /// One pipeline reading every key of the batch that is neither dirty nor cached. A failure
    /// opens the breaker: the keys are then counted locally.
    pub(super) fn prefetch_windows(&mut self, keys: &[(WindowId, Vec<u8>)]) {
        // The windows read ahead for this batch first (given up instead when Redis became
        // unavailable meanwhile: `fail`).
        self.finish_read_ahead();
        if self.breaker.is_open() {
            return;
        }
        // What the previous batch read and did not count into goes to the cache first (unless
        // what was read is this batch's: its early reads).
        if !std::mem::take(&mut self.views.cache.early_taken) {
            self.views.cache.settle(&self.views.dirty);
        }
        let mut cached = std::mem::take(&mut self.views.cached_at_plan);
        let wanted = self.wanted_windows(keys, CacheCheck::Trust(&cached));
        cached.clear();
        self.views.cached_at_plan = cached;
        if !wanted.is_empty() {
            if let Err(e) = self.read(&wanted) {
                self.fail(&e, "prefetching windows");
            }
        }
    }

    /// The keys of `keys` to read before counting: neither dirty nor counted ahead, and without
    /// a clean view, or (while others count too) with one of a shared key. The caller lists each
    /// key once (`pipeline::Touched`): a key listed twice is looked up twice (and read once).
    pub(super) fn wanted_windows<'k>(
        &self,
        keys: &'k [(WindowId, Vec<u8>)],
        mut check: CacheCheck<'_>,
    ) -> Vec<(WindowId, &'k [u8])> {
        let mut wanted: Vec<(WindowId, &[u8])> = Vec::new();
        for (window, key) in keys {
            let lookup = KeyRef {
                window: window.0,
                key,
            };
            // Alone, any view will do: a key noted with a clean view needs no read whether or
            // not it is dirty since, and the small set of notes answers before the large dirty
            // table is probed (a cache miss each).
            if let (false, CacheCheck::Trust(cached)) = (self.views.shared, &check) {
                if cached.contains(&self.views.plan_hasher.hash_one(&lookup)) {
                    continue;
                }
            }
            if self.views.dirty.contains_key(&lookup) || self.views.ahead.contains_key(&lookup) {
                continue;
            }
            // Alone, any cached view will do, and its hash says whether there is one.
            let fresh = match self.views.shared {
                false => match &mut check {
                    CacheCheck::Trust(_) => self.views.cache.may_hold(&lookup),
                    CacheCheck::Record(cached) => {
                        let fresh = self.views.cache.may_hold(&lookup);
                        if fresh {
                            cached.insert(self.views.plan_hasher.hash_one(&lookup));
                        }
                        fresh
                    }
                },
                true => self
                    .views
                    .cache
                    .get(&lookup)
                    .is_some_and(|cached| !self.views.shared_key(window.0, &cached.offsets)),
            };
            if !fresh {
                wanted.push((*window, key));
            }
        }
        wanted
    }

    /// Reads the windows of `keys` from Redis (one pipelined HGETALL per key, grouped per
    /// master on a cluster) and caches them. A plain read needs no script: every field a hash
    /// holds is live for its head, which the script maintains on every write.
    fn read(&mut self, keys: &[(WindowId, &[u8])]) -> Result<Vec<Arc<Cached>>, StoreError> {
        let (names, reply_of) = self.unique_redis_keys(keys.iter().copied());
        let replies = self.read_each("HGETALL", names)?;
        if self.views.cache.overfull() {
            self.views.cache.settle(&self.views.dirty);
        }
        self.stats.loads += replies.len() as u64;
        let replies = replies
            .into_iter()
            .map(codec::flat)
            .collect::<Result<Vec<_>, _>>()?;
        let mut states = Vec::with_capacity(keys.len());
        for (&(window, key), &reply) in keys.iter().zip(&reply_of) {
            states.push(self.take_in_read(
                StoredKey {
                    window: window.0,
                    key: KeyBytes::new(key),
                },
                &replies[reply],
            )?);
        }
        Ok(states)
    }

    /// Takes in a window Redis returned for `key` (its hash's fields, as `HGETALL` gives them)
    /// as its clean view, and what its recorded offsets tell of its counter's locality.
    pub(super) fn take_in_read(
        &mut self,
        key: StoredKey,
        hash: &[Vec<u8>],
    ) -> Result<Arc<Cached>, StoreError> {
        let spec = self.windows.spec(key.window);
        let stored = codec::decode_section(&spec, self.section(key.window), hash)?;
        Ok(self.take_in_stored(key, stored))
    }

    /// Takes in a window Redis returned for `key`, decoded, as [`RedisStore::take_in_read`]
    /// does.
    pub(super) fn take_in_stored(&mut self, key: StoredKey, stored: Stored) -> Arc<Cached> {
        let cached = self.view_of_stored(&key, stored);
        self.views.cache.load(key, Arc::clone(&cached));
        cached
    }

    /// The clean view of a window Redis returned for `key`, decoded (the shared empty view if
    /// Redis held nothing), and what its recorded offsets tell of its counter's locality.
    pub(super) fn view_of_stored(&mut self, key: &StoredKey, stored: Stored) -> Arc<Cached> {
        let spec = self.windows.spec(key.window);
        let Stored {
            state,
            version,
            offsets,
        } = stored;
        self.views
            .learn(key.window, &offsets, || several_observations(&spec, &state));
        let empty = version == 0 && offsets.is_empty() && state == WindowState::new(spec.aggregate);
        if empty {
            self.views.empty_view(spec.aggregate)
        } else {
            Arc::new(Cached {
                state,
                version: Some(version),
                refreshed: None,
                offsets,
            })
        }
    }

    /// The clean view of a key that is not dirty: cached, else read from Redis; `None` while
    /// Redis is unavailable.
    fn clean_view(&mut self, window: WindowId, key: &[u8]) -> Option<Arc<Cached>> {
        match self.views.cache.get(&KeyRef {
            window: window.0,
            key,
        }) {
            Some(state) => Some(state),
            None => self.load(window, key),
        }
    }

    /// The view of a key that is neither dirty nor cached: read from Redis, or `None` while Redis
    /// is unavailable (the read failing opens the breaker).
    fn load(&mut self, window: WindowId, key: &[u8]) -> Option<Arc<Cached>> {
        if self.breaker.is_open() {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualMonotonic;
    use crate::window::Aggregate;

    /// A clean count window Redis holds at version 1.
    fn cached() -> Arc<Cached> {
        Arc::new(Cached {
            state: WindowState::new(Aggregate::Count),
            version: Some(1),
            refreshed: None,
            offsets: Offsets::new(),
        })
    }

    /// The cache's table is sized at start for what the cache may hold, within a million entries
    /// and one per 256 bytes of its bound (a small bound does not buy a large table).
    #[test]
    fn the_cache_table_is_presized_for_what_the_bounds_let_it_hold() {
        let defaults = super::super::RedisStoreConfig::default();
        assert_eq!(
            presized_entries(defaults.cache_capacity, defaults.max_state_bytes as u64 / 2),
            1_000_000
        );
        assert_eq!(presized_entries(100, 100 * 4_096), 100);
        assert_eq!(presized_entries(1_000_000, 1 << 20), 4_096);
        assert_eq!(presized_entries(50_000_000, 1 << 40), 1_000_000);
        assert_eq!(presized_entries(0, 1 << 30), 0);
    }

    /// A sealed batch's windows reach the cache through a job run without the engine, and are
    /// found meanwhile; a key whose view changed or went before the job ran keeps what replaced
    /// it (or nothing), and the cache never takes the older window after it.
    #[test]
    fn windows_a_sealed_batch_read_reach_the_cache_after_it_unless_their_key_changed_meanwhile() {
        let mut views = Views::new(1_000, 1 << 30, Duration::from_secs(60));
        let no_dirty = HashMap::default();
        let key = |name: &str| StoredKey {
            window: 0,
            key: KeyBytes::new(name.as_bytes()),
        };
        let view = |version: u64| {
            Arc::new(Cached {
                state: WindowState::new(Aggregate::Count),
                version: Some(version),
                refreshed: None,
                offsets: Offsets::new(),
            })
        };
        let version = |views: &Views, name: &str| {
            views
                .cache
                .get(&key(name))
                .map(|v| v.version.expect("known"))
        };
        let in_moka = |views: &Views, name: &str| {
            views
                .cache
                .cache
                .get(&key(name))
                .map(|v| v.version.expect("known"))
        };
        for name in ["kept", "read-again", "flushed", "counted", "dropped"] {
            views.cache.load(key(name), view(1));
        }
        let mut dirty = HashMap::default();
        dirty.insert(
            key("counted-in-batch"),
            Dirty::new(
                WindowState::new(Aggregate::Count),
                Some(1),
                None,
                None,
                Offsets::new(),
            ),
        );
        views.cache.load(key("counted-in-batch"), view(1));
        let job = views.cache.settle_later(&dirty).expect("windows to settle");
        assert_eq!(
            views.cache.entry_count(),
            5,
            "a dirty key's window is not settled"
        );
        assert!(views.cache.bytes() > 0);
        // Before the job runs: found, not in moka yet.
        assert_eq!(version(&views, "kept"), Some(1));
        assert!(views.cache.contains_key(&key("kept")) && views.cache.may_hold(&key("kept")));
        assert_eq!(in_moka(&views, "kept"), None);
        // Meanwhile, under the engine: views change or go.
        views.cache.load(key("read-again"), view(2));
        views.cache.acknowledged(key("flushed"), view(3));
        drop(views.cache.unload(&key("counted")));
        views.cache.invalidate(&key("dropped"));
        assert_eq!(version(&views, "read-again"), Some(2));
        assert_eq!(version(&views, "flushed"), Some(3));
        assert_eq!(
            version(&views, "counted"),
            None,
            "its dirty view holds it now"
        );
        assert_eq!(version(&views, "dropped"), None);
        job.run();
        assert_eq!(in_moka(&views, "kept"), Some(1));
        for name in [
            "read-again",
            "flushed",
            "counted",
            "dropped",
            "counted-in-batch",
        ] {
            assert_eq!(
                in_moka(&views, name),
                None,
                "{name}: retired, never inserted"
            );
        }
        assert_eq!(
            version(&views, "read-again"),
            Some(2),
            "the newer view stays found"
        );
        // The next settle lets the batch go: found in moka alone.
        views.cache.settle(&no_dirty);
        assert!(views.cache.settling.is_empty());
        assert_eq!(version(&views, "kept"), Some(1));

        // Everything dropped before the job runs: nothing reaches the cache, even a job dropped
        // unrun (which runs then).
        views.cache.load(key("late"), view(4));
        let job = views
            .cache
            .settle_later(&no_dirty)
            .expect("windows to settle");
        views.cache.invalidate_all();
        assert_eq!(version(&views, "late"), None);
        drop(job);
        assert_eq!(in_moka(&views, "late"), None);
        assert_eq!(views.cache.entry_count(), 0);
        // A job dropped unrun inserts what it holds.
        views.cache.load(key("unrun"), view(5));
        drop(views.cache.settle_later(&no_dirty));
        assert_eq!(in_moka(&views, "unrun"), Some(5));
        // Drained (every clean view at once): a settling window is among them, then gone.
        views.cache.load(key("drained"), view(6));
        let job = views
            .cache
            .settle_later(&no_dirty)
            .expect("windows to settle");
        let drained = views.cache.drain();
        assert!(drained
            .iter()
            .any(|(k, v)| *k == key("drained") && v.version == Some(6)));
        job.run();
        assert_eq!(in_moka(&views, "drained"), None);
    }

    /// The hashes kept beside the moka cache follow it: every key it holds has one, and keys it
    /// evicted (for size), dropped or forgot altogether leave none behind, so the set neither
    /// hides a cached view nor grows past the cache.
    #[test]
    fn the_hashes_beside_the_cache_follow_what_it_holds() {
        // Room for about 100 windows.
        let views = Views::new(100, 100 * 4_096, Duration::from_secs(3_600));
        let cache = &views.cache.cache;
        let key = |i: u32| StoredKey {
            window: i % 3,
            key: KeyBytes::new(format!("user-{i}").as_bytes()),
        };
        let in_step = |cache: &Cache| {
            cache.run_pending_tasks();
            let held: Vec<StoredKey> = cache.moka.iter().map(|(key, _)| (*key).clone()).collect();
            for key in &held {
                assert!(cache.presence.may_hold(key), "{key:?} is cached");
                assert!(cache.contains_key(key) && cache.get(key).is_some());
            }
            assert_eq!(cache.presence.hashes().len(), held.len());
        };
        for i in 0..2_000 {
            cache.insert(key(i), cached());
            // Some inserted again (replaced: the key stays).
            if i % 7 == 0 {
                cache.insert(key(i / 2), cached());
            }
        }
        in_step(cache);
        assert!(cache.entry_count() <= 110, "{}", cache.entry_count());
        let some = cache
            .moka
            .iter()
            .next()
            .map(|(key, _)| (*key).clone())
            .unwrap();
        cache.invalidate(&some);
        assert!(!cache.presence.may_hold(&some) && cache.get(&some).is_none());
        in_step(cache);
        cache.invalidate_all();
        cache.run_pending_tasks();
        assert_eq!(cache.presence.hashes().len(), 0);
        assert!(cache.get(&key(1_999)).is_none());
        // Inserted again after everything was dropped: found again.
        cache.insert(key(1_999), cached());
        in_step(cache);
        assert!(cache.get(&key(1_999)).is_some());
    }

    /// While early reads are out, every view taken in from a flush or dropped is recorded (an
    /// eviction after it cannot hide it); when none are out, nothing is kept.
    #[test]
    fn keys_redis_held_nothing_for_are_kept_apart_from_moka_and_never_beside_a_view_of_theirs() {
        let views = Views::new(1_000, 1 << 30, Duration::from_secs(60));
        let cache = &views.cache.cache;
        let key = |i: u32| StoredKey {
            window: 1,
            key: KeyBytes::new(format!("account-{i}").as_bytes()),
        };
        let empty = views.empty_view(Aggregate::Count);
        cache.insert(key(1), Arc::clone(&empty));
        cache.run_pending_tasks();
        // Held apart, found as the shared view, counted and charged.
        assert_eq!(cache.moka.entry_count(), 0);
        assert!(!cache.presence.may_hold(&key(1)));
        assert!(cache.may_hold(&key(1)) && cache.contains_key(&key(1)));
        assert!(Arc::ptr_eq(&cache.get(&key(1)).unwrap(), &empty));
        assert_eq!(cache.entry_count(), 1);
        assert!(cache.empties().bytes() > 0);
        // A window with counts replaces it: found in moka only.
        cache.insert(key(1), cached());
        cache.run_pending_tasks();
        assert_eq!(cache.empties().len(), 0);
        assert_eq!(cache.get(&key(1)).unwrap().version, Some(1));
        // Redis lost the key: the empty view replaces the one with counts, which moka drops.
        cache.insert(key(1), Arc::clone(&empty));
        cache.run_pending_tasks();
        assert_eq!(cache.moka.entry_count(), 0);
        assert!(Arc::ptr_eq(&cache.get(&key(1)).unwrap(), &empty));
        // Every view, both kinds, when the views are drained.
        cache.insert(key(2), cached());
        let mut all: Vec<(u32, Option<u64>)> = cache
            .views()
            .into_iter()
            .map(|(k, view)| (k.key.as_slice()[8] as u32 - u32::from(b'0'), view.version))
            .collect();
        all.sort();
        assert_eq!(all, vec![(1, Some(0)), (2, Some(1))]);
        cache.invalidate(&key(1));
        assert!(cache.get(&key(1)).is_none() && !cache.may_hold(&key(1)));
        cache.invalidate_all();
        assert_eq!(cache.entry_count(), 0);
    }

    #[test]
    fn empty_keys_last_one_to_two_idle_periods_and_a_flood_pushes_out_the_unused_first() {
        let idle = Duration::from_secs(60);
        let views = Views::new(1_000, 1 << 30, idle);
        let empty = views.empty_view(Aggregate::Sum);
        let key = |i: u32| StoredKey {
            window: 0,
            key: KeyBytes::new(&i.to_le_bytes()),
        };
        let start = Instant::now();
        let mut empties = Empties::new(4, idle, views.empty.clone());
        empties.since = start;
        let sum = empties.aggregate_of(&empty).unwrap();
        assert_eq!(empties.aggregate_of(&cached()), None);
        // Two generations of two keys: the fifth key drops the first two unless used.
        for i in 0..4 {
            empties.insert(key(i), sum);
        }
        assert!(
            empties.get(&key(0)).is_some(),
            "used: moves to the young generation"
        );
        empties.insert(key(4), sum);
        assert!(empties.contains(&key(0)) && empties.contains(&key(4)));
        assert!(!empties.contains(&key(1)), "unused and oldest: dropped");
        assert!(Arc::ptr_eq(&empties.get(&key(4)).unwrap(), &empty));
        // Idle time: kept through one period, dropped after two; a long key's bytes counted
        // while it is there, however often it moves between generations.
        let long = StoredKey {
            window: 0,
            key: KeyBytes::new(&[7; 100]),
        };
        let mut long_keys = Empties::new(1_000, idle, views.empty.clone());
        long_keys.since = start;
        long_keys.insert(long.clone(), sum);
        assert_eq!(long_keys.heap, long.key.heap_bytes());
        long_keys.expire(start + idle);
        assert!(
            long_keys.get(&long).is_some(),
            "used: back in the young generation"
        );
        assert_eq!(long_keys.heap, long.key.heap_bytes());
        long_keys.insert(long.clone(), sum);
        assert_eq!(long_keys.heap, long.key.heap_bytes());
        long_keys.remove(&long);
        assert_eq!(long_keys.heap, 0);
        let mut idle_keys = Empties::new(1_000, idle, views.empty.clone());
        idle_keys.since = start;
        idle_keys.insert(key(7), sum);
        idle_keys.expire(start + idle / 2);
        assert!(idle_keys.contains(&key(7)));
        idle_keys.expire(start + idle);
        assert!(idle_keys.contains(&key(7)), "one period idle: still there");
        idle_keys.expire(start + idle * 2);
        assert!(!idle_keys.contains(&key(7)) && idle_keys.len() == 0);
        assert_eq!(idle_keys.heap, 0);
    }

    #[test]
    fn clean_views_record_changes_while_early_reads_are_out() {
        let mut views = Views::new(1_000, 1 << 30, Duration::from_secs(60));
        let key = |name: &[u8]| StoredKey {
            window: 0,
            key: KeyBytes::new(name),
        };
        views.cache.insert(key(b"before"), cached());
        let generation = views.cache.watch();
        assert!(
            !views.cache.touched(&key(b"before")),
            "changed before the read was planned"
        );
        views.cache.insert(key(b"flushed"), cached());
        views.cache.invalidate(&key(b"dropped"));
        views.cache.load(key(b"read"), cached());
        assert!(views.cache.touched(&key(b"flushed")) && views.cache.touched(&key(b"dropped")));
        assert!(
            views.cache.touched(&key(b"read")),
            "a view read since is recorded too: taking in an early read then needs no cache lookup"
        );
        views.cache.unwatch();
        assert_eq!(
            views.cache.generation(),
            generation,
            "nothing voided the read"
        );
        assert!(
            !views.cache.touched(&key(b"flushed")),
            "forgotten once no read is out"
        );
        views.cache.insert(key(b"unwatched"), cached());
        assert!(!views.cache.touched(&key(b"unwatched")));
        // Dropping every view voids the reads out.
        let generation = views.cache.watch();
        views.cache.invalidate_all();
        views.cache.unwatch();
        assert_ne!(
            views.cache.generation(),
            generation,
            "dropping every view voids the reads out"
        );
    }

    /// A window a flush brought back waits beside the cache until the next flush comes back:
    /// counted into meanwhile (a hot key), it never passes through moka; otherwise it goes
    /// there, a slice per tick. Whatever holds it, the newest view of a key is the one found.
    #[test]
    fn windows_a_flush_brought_back_reach_the_cache_only_if_not_counted_into_before_the_next() {
        let mut views = Views::new(1_000, 1 << 30, Duration::from_secs(60));
        let key = |name: &[u8]| StoredKey {
            window: 0,
            key: KeyBytes::new(name),
        };
        let cached = |version: u64| {
            Arc::new(Cached {
                state: WindowState::new(Aggregate::Count),
                version: Some(version),
                refreshed: None,
                offsets: Offsets::new(),
            })
        };
        let version =
            |views: &Views, name: &[u8]| views.cache.get(&key(name)).and_then(|c| c.version);
        // The bytes kept beside the cache are what a pass over those views would sum.
        let tallied = |views: &Views| {
            for table in [&views.cache.loaded, &views.cache.recent, &views.cache.aging] {
                let summed: usize = table.map.iter().map(|(k, c)| cached_bytes(k, c)).sum();
                assert_eq!(table.bytes, summed);
            }
        };
        let long = b"a key long enough to be kept on the heap, not inline".as_slice();
        views.cache.acknowledged(key(long), cached(1));
        views.cache.load(key(long), cached(2));
        tallied(&views);
        assert!(views.cache.unload(&key(long)).is_some());
        tallied(&views);
        // `hot` and `cold` were cached at version 1, turned dirty, and their flush came back.
        views.cache.insert(key(b"hot"), cached(1));
        views.cache.insert(key(b"cold"), cached(1));
        views.cache.acknowledged(key(b"hot"), cached(2));
        views.cache.acknowledged(key(b"cold"), cached(2));
        assert_eq!(
            (version(&views, b"hot"), version(&views, b"cold")),
            (Some(2), Some(2)),
            "newer than the cache"
        );
        assert!(views.cache.contains_key(&key(b"hot")));
        tallied(&views);
        // The next batch counts into `hot`: its view leaves, moved into its dirty one.
        assert_eq!(
            views.cache.unload(&key(b"hot")).and_then(|c| c.version),
            Some(2)
        );
        // The next flush comes back: `cold` is on its way to the cache, nothing of `hot` is.
        views.cache.acknowledged(key(b"again"), cached(2));
        views
            .cache
            .age(Duration::from_secs(1), Duration::from_micros(500));
        assert!(views.cache.recent.is_empty());
        assert_eq!(views.cache.aging.len(), 2);
        tallied(&views);
        assert_eq!(version(&views, b"cold"), Some(2), "on its way, still found");
        assert_eq!(
            views.cache.cache.get(&key(b"cold")).and_then(|c| c.version),
            Some(1),
            "not in moka yet"
        );
        // `again` comes back newer meanwhile: that view waits in `recent`, and the older never
        // reaches moka. The next tick moves the rest (two windows fit in its budget).
        views.cache.acknowledged(key(b"again"), cached(3));
        views.cache.age_some(Instant::now());
        assert!(views.cache.aging.is_empty() && views.cache.aging_pace.is_none());
        assert_eq!(
            views.cache.cache.get(&key(b"cold")).and_then(|c| c.version),
            Some(2)
        );
        assert!(
            views.cache.cache.get(&key(b"again")).is_none(),
            "the older view stayed out"
        );
        assert_eq!(version(&views, b"again"), Some(3));
        tallied(&views);
        views
            .cache
            .age(Duration::from_secs(1), Duration::from_micros(500));
        views.cache.unload(&key(b"again"));
        assert_eq!(
            views.cache.cache.get(&key(b"hot")).and_then(|c| c.version),
            Some(1),
            "what moka held, never re-inserted"
        );
        // A key read again for a batch (another writer may have moved it) hides what a flush
        // brought back; dropping every view hands each key's newest once.
        views.cache.acknowledged(key(b"shared"), cached(3));
        views.cache.load(key(b"shared"), cached(4));
        assert_eq!(version(&views, b"shared"), Some(4));
        tallied(&views);
        views.cache.acknowledged(key(b"flushed"), cached(5));
        let mut drained: Vec<(Vec<u8>, Option<u64>)> = views
            .cache
            .drain()
            .into_iter()
            .map(|(k, c)| (k.key.as_slice().to_vec(), c.version))
            .collect();
        drained.sort();
        assert_eq!(
            drained,
            vec![
                (b"cold".to_vec(), Some(2)),
                (b"flushed".to_vec(), Some(5)),
                (b"hot".to_vec(), Some(1)),
                (b"shared".to_vec(), Some(4))
            ]
        );
        assert_eq!(views.cache.entry_count(), 0);
        tallied(&views);
        assert_eq!(
            views.cache.loaded.bytes + views.cache.recent.bytes + views.cache.aging.bytes,
            0
        );
    }

    #[test]
    fn a_ttl_refresh_is_due_once_a_window_of_the_injected_clock_passed() {
        let clock = ManualMonotonic::new();
        let spec = WindowSpec::new(1_000, 60, Aggregate::Count);
        let at = clock.now();
        assert!(
            refresh_due(&spec, None, Some(at), clock.now()),
            "an unknown version"
        );
        assert!(
            refresh_due(&spec, Some(0), Some(at), clock.now()),
            "a new key"
        );
        assert!(
            refresh_due(&spec, Some(5), None, clock.now()),
            "never refreshed"
        );
        assert!(!refresh_due(&spec, Some(5), Some(at), clock.now()));
        clock.advance(Duration::from_millis(59_999));
        assert!(!refresh_due(&spec, Some(5), Some(at), clock.now()));
        clock.advance(Duration::from_millis(1));
        assert!(
            refresh_due(&spec, Some(5), Some(at), clock.now()),
            "a window passed"
        );
    }
}
