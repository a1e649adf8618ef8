//! The in-process store: exact, single-process, memory proportional to live keys, and bounded.

use hashbrown::HashMap;
use smallvec::SmallVec;

use super::counter_store::{
    CounterStore, HoldSpace, HoldSpaces, Observed, StateStats, StoreError, WindowId, Windows,
};
use super::keys::{BytesRef, KeyBytes, KeyRef, StoredKey};
use crate::window::{Delta, WindowSpec, WindowState};

/// Fewest new keys between two sweeps, so small workloads never pay for one.
const MIN_SWEEP_INTERVAL: usize = 4096;

/// The default bound on (window, key) states and on holds: about 0.5–1 GiB of state.
pub const DEFAULT_MAX_KEYS: usize = 4_000_000;

/// Exact counters in a hash map. Keys are the exact canonical bytes (no digests), so two
/// different keys can never share a counter.
///
/// One entry per key holds the windows of every counter over that key: counters over the same
/// dimensions (a rule reading the failures of the account whose success it judges, three
/// counters per card) find each other's state in the entry they already loaded, one random
/// probe per key instead of one per counter.
///
/// A key is dropped only when no event the caller may still count or read can observe it: the
/// caller promises, through [`CounterStore::set_horizon`], that no event older than the horizon
/// (its inputs' watermark) will come, and a key is dropped once every event at or after the
/// horizon would see it as never counted (`WindowSpec::can_drop`). So the store is exact for any
/// input order within the caller's lateness bound; without a horizon it keeps every key.
///
/// Bounded: past `max_keys` (window, key) states — an input of millions of distinct keys within
/// one lateness bound, by accident or by attack — the keys whose newest counted event is oldest
/// are evicted (ties broken by key bytes, so the same input always evicts the same keys) until a
/// sixteenth of the bound is free; an evicted key counts from nothing if it comes back. Holds are
/// bounded by the same number: past it, the holds that end first are dropped. Both are counted
/// in [`StateStats`].
#[derive(Debug)]
pub struct MemoryStore {
    windows: Windows,
    states: HashMap<KeyBytes, KeyEntry, foldhash::fast::RandomState>,
    /// (window, key) pairs held: what `live_keys` reports.
    pairs: usize,
    /// Estimated bytes of `states` and `holds` (entries, keys on the heap, windows).
    bytes: usize,
    max_keys: usize,
    evicted_keys: u64,
    evicted_holds: u64,
    hold_spaces: HoldSpaces,
    /// Held keys (the key's `window` is its hold space) and until when. Kept for good (up to the
    /// bound): an event of any age is held if its time is before its key's hold, and there is at
    /// most one entry per (rule, key) that fired by its condition.
    holds: HashMap<StoredKey, i64, foldhash::fast::RandomState>,
    horizon: Option<i64>,
    inserts_since_sweep: usize,
    /// Sweep once this many new keys arrived: the live count after the last sweep (at least the
    /// floor), so sweeping costs amortised O(1) per new key and memory stays within ~2× live.
    sweep_after: usize,
    sweep_interval_floor: usize,
}

/// The windows of one key, by window id (two inline: most keys feed one or two counters).
type KeyWindows = SmallVec<[(u32, WindowState); 2]>;

#[derive(Debug)]
struct KeyEntry {
    /// The newest event time counted into any of the windows: the eviction order.
    newest_ts: i64,
    windows: KeyWindows,
}

impl KeyEntry {
    /// Estimated bytes this entry and its key own outside the table's slot.
    fn bytes(&self, key: &KeyBytes) -> usize {
        let windows_heap = if self.windows.spilled() {
            self.windows.capacity() * size_of::<(u32, WindowState)>()
        } else {
            0
        };
        let states: usize = self
            .windows
            .iter()
            .map(|(_, state)| state.heap_bytes())
            .sum();
        key.heap_bytes() + windows_heap + states
    }
}

fn hold_bytes(key: &StoredKey) -> usize {
    key.key.heap_bytes()
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl MemoryStore {
    pub fn new() -> MemoryStore {
        MemoryStore::with_sweep_interval(MIN_SWEEP_INTERVAL)
    }

    /// A store that sweeps expired keys after at least `floor` new keys; 0 sweeps on every
    /// observation (tests, to drop keys as early as the horizon allows).
    pub fn with_sweep_interval(floor: usize) -> MemoryStore {
        MemoryStore {
            windows: Windows::default(),
            states: HashMap::default(),
            pairs: 0,
            bytes: 0,
            max_keys: DEFAULT_MAX_KEYS,
            evicted_keys: 0,
            evicted_holds: 0,
            hold_spaces: HoldSpaces::default(),
            holds: HashMap::default(),
            horizon: None,
            inserts_since_sweep: 0,
            sweep_after: floor,
            sweep_interval_floor: floor,
        }
    }

    /// Bounds the (window, key) states and the holds to `max_keys` each (at least 1).
    pub fn with_max_keys(mut self, max_keys: usize) -> MemoryStore {
        self.max_keys = max_keys.max(1);
        self.sweep_after = self.sweep_after.min(self.max_keys + 1);
        self
    }

    /// Drops keys that can no longer affect a decision, then, past the bound, the keys whose
    /// newest event is oldest.
    fn sweep(&mut self) {
        let windows = &self.windows;
        let horizon = self.horizon;
        let (mut pairs, mut bytes) = (0, 0);
        self.states.retain(|key, entry| {
            if let Some(horizon) = horizon {
                entry.windows.retain(|(window, state)| {
                    let spec = windows.spec(*window);
                    state
                        .head()
                        .is_none_or(|head| !spec.can_drop(head, horizon))
                });
            }
            pairs += entry.windows.len();
            bytes += entry.bytes(key);
            !entry.windows.is_empty()
        });
        self.pairs = pairs;
        self.bytes = bytes + self.holds.keys().map(hold_bytes).sum::<usize>();
        if self.pairs > self.max_keys {
            self.evict();
        }
        self.inserts_since_sweep = 0;
        self.sweep_after = self
            .pairs
            .max(self.sweep_interval_floor)
            .min(self.max_keys - self.pairs.min(self.max_keys) + 1);
    }

    /// Evicts the keys with the oldest newest event (then the smallest key bytes) until about a
    /// sixteenth of the bound is free. A round costs O(n) and frees n/16 slots: O(1) amortised
    /// per new key.
    fn evict(&mut self) {
        let target = self.max_keys - self.max_keys / 16;
        let mut order: Vec<(i64, &[u8])> = self
            .states
            .iter()
            .map(|(key, entry)| (entry.newest_ts, key.as_slice()))
            .collect();
        // Keys, in proportion to the windows to free; the smallest in (newest event, key bytes)
        // order, a total order, so the same set whatever the table's iteration order. Selecting
        // them is linear (no sort).
        let evict = (order.len() * (self.pairs - target))
            .div_ceil(self.pairs.max(1))
            .clamp(1, order.len());
        order.select_nth_unstable(evict - 1);
        let victims: Vec<KeyBytes> = order[..evict]
            .iter()
            .map(|&(_, key)| KeyBytes::new(key))
            .collect();
        for key in &victims {
            if let Some(entry) = self.states.remove(key) {
                self.pairs -= entry.windows.len();
                self.bytes = self.bytes.saturating_sub(entry.bytes(key));
                self.evicted_keys += entry.windows.len() as u64;
            }
        }
    }

    /// Past the bound, drops the holds that end first (then by key) until a sixteenth is free.
    fn evict_holds(&mut self) {
        let target = self.max_keys - self.max_keys / 16;
        let mut order: Vec<(i64, u32, &[u8])> = self
            .holds
            .iter()
            .map(|(key, &until)| (until, key.window, key.key.as_slice()))
            .collect();
        let evict = self.holds.len() - target;
        order.select_nth_unstable(evict - 1);
        let victims: Vec<StoredKey> = order[..evict]
            .iter()
            .map(|&(_, window, key)| StoredKey {
                window,
                key: KeyBytes::new(key),
            })
            .collect();
        for key in &victims {
            self.holds.remove(key);
            self.bytes = self.bytes.saturating_sub(hold_bytes(key));
            self.evicted_holds += 1;
        }
    }
}

impl CounterStore for MemoryStore {
    fn open_window(&mut self, name: &str, spec: WindowSpec) -> WindowId {
        self.windows.open(name, spec)
    }

    fn apply(
        &mut self,
        window: WindowId,
        key: &[u8],
        ts_ms: i64,
        delta: Delta,
    ) -> Result<Observed, StoreError> {
        let spec = self.windows.spec(window.0);
        let bucket = spec.bucket_of(ts_ms);
        let entry = match self.states.get_mut(&BytesRef(key)) {
            Some(entry) => entry,
            None => {
                let key = KeyBytes::new(key);
                let entry = KeyEntry {
                    newest_ts: ts_ms,
                    windows: KeyWindows::new(),
                };
                self.bytes += entry.bytes(&key);
                self.states.entry(key).or_insert(entry)
            }
        };
        entry.newest_ts = entry.newest_ts.max(ts_ms);
        let applied = match entry.windows.iter_mut().find(|(w, _)| *w == window.0) {
            Some((_, state)) => {
                let before = state.heap_bytes();
                let applied = state.apply(&spec, bucket, delta);
                self.bytes = (self.bytes + state.heap_bytes()).saturating_sub(before);
                applied
            }
            None => {
                let mut state = WindowState::new(spec.aggregate);
                let applied = state.apply(&spec, bucket, delta);
                let heap = |w: &KeyWindows| {
                    if w.spilled() {
                        w.capacity() * size_of::<(u32, WindowState)>()
                    } else {
                        0
                    }
                };
                let before = heap(&entry.windows);
                self.bytes += state.heap_bytes();
                entry.windows.push((window.0, state));
                self.bytes += heap(&entry.windows) - before;
                self.pairs += 1;
                self.inserts_since_sweep += 1;
                applied
            }
        };
        if self.inserts_since_sweep >= self.sweep_after || self.sweep_interval_floor == 0 {
            self.sweep();
        }
        Ok(Observed::exact(applied))
    }

    fn read(&mut self, window: WindowId, key: &[u8], ts_ms: i64) -> Result<Observed, StoreError> {
        let spec = self.windows.spec(window.0);
        let state = self
            .states
            .get(&BytesRef(key))
            .and_then(|entry| entry.windows.iter().find(|(w, _)| *w == window.0));
        let applied = match state {
            Some((_, state)) => state.read(&spec, spec.bucket_of(ts_ms)),
            None => crate::window::Applied::Counted(0),
        };
        Ok(Observed::exact(applied))
    }

    fn open_holds(&mut self, name: &str, ttl_ms: i64) -> HoldSpace {
        self.hold_spaces.open(name, ttl_ms)
    }

    fn held_until(&mut self, space: HoldSpace, key: &[u8]) -> Result<Option<i64>, StoreError> {
        Ok(self
            .holds
            .get(&KeyRef {
                window: space.0,
                key,
            })
            .copied())
    }

    fn extend_hold(
        &mut self,
        space: HoldSpace,
        key: &[u8],
        until_ms: i64,
    ) -> Result<i64, StoreError> {
        let until = match self.holds.get_mut(&KeyRef {
            window: space.0,
            key,
        }) {
            Some(held) => {
                *held = (*held).max(until_ms);
                *held
            }
            None => {
                let key = StoredKey {
                    window: space.0,
                    key: KeyBytes::new(key),
                };
                self.bytes += hold_bytes(&key);
                self.holds.insert(key, until_ms);
                if self.holds.len() > self.max_keys {
                    self.evict_holds();
                }
                until_ms
            }
        };
        Ok(until)
    }

    fn set_horizon(&mut self, horizon_ms: i64) {
        self.horizon = Some(self.horizon.map_or(horizon_ms, |h| h.max(horizon_ms)));
    }

    fn flush(&mut self) -> Result<(), StoreError> {
        Ok(())
    }

    fn live_keys(&self) -> usize {
        self.pairs
    }

    fn state_stats(&self) -> StateStats {
        // The tables' slots by capacity (hashbrown: one control byte per slot; it grows by
        // doubling), plus what entries own on the heap.
        let tables = self.states.capacity() * (size_of::<(KeyBytes, KeyEntry)>() + 1)
            + self.holds.capacity() * (size_of::<(StoredKey, i64)>() + 1);
        StateStats {
            bytes: tables + self.bytes,
            evicted_keys: self.evicted_keys,
            evicted_holds: self.evicted_holds,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::window::{Aggregate, Applied};

    const COUNT_1S_X10: WindowSpec = WindowSpec::new(100, 10, Aggregate::Count);

    #[test]
    fn same_name_and_spec_reopen_the_same_window() {
        let mut s = MemoryStore::new();
        let a = s.open_window("a", COUNT_1S_X10);
        assert_eq!(s.open_window("a", COUNT_1S_X10), a);
        assert_ne!(s.open_window("b", COUNT_1S_X10), a);
        let other = WindowSpec {
            buckets: 5,
            ..COUNT_1S_X10
        };
        assert_ne!(s.open_window("a", other), a);
    }

    #[test]
    fn keys_are_separate_per_window_and_bytes() {
        let mut s = MemoryStore::new();
        let a = s.open_window("a", COUNT_1S_X10);
        let b = s.open_window("b", COUNT_1S_X10);
        assert_eq!(
            s.apply(a, b"k", 0, Delta::Count).unwrap().applied,
            Applied::Counted(1)
        );
        assert_eq!(
            s.apply(a, b"k", 1, Delta::Count).unwrap().applied,
            Applied::Counted(2)
        );
        assert_eq!(
            s.apply(b, b"k", 2, Delta::Count).unwrap().applied,
            Applied::Counted(1)
        );
        assert_eq!(
            s.apply(a, b"k2", 3, Delta::Count).unwrap().applied,
            Applied::Counted(1)
        );
        assert_eq!(s.live_keys(), 3);
    }

    #[test]
    fn memory_follows_live_keys_not_total_keys() {
        let mut s = MemoryStore::with_sweep_interval(16);
        let w = s.open_window("w", COUNT_1S_X10);
        // 100 000 keys, each seen once, time advancing 10 ms per key, the horizon one window
        // behind: only the last few windows' worth (3 windows = 300 keys) can be live.
        for i in 0..100_000u64 {
            let t = (i * 10) as i64;
            s.set_horizon(t - 1_000);
            s.apply(w, &i.to_le_bytes(), t, Delta::Count).unwrap();
            assert!(
                s.live_keys() <= 2 * 300 + 16,
                "{} keys live at {i}",
                s.live_keys()
            );
        }
    }

    #[test]
    fn without_a_horizon_nothing_is_dropped() {
        let mut s = MemoryStore::with_sweep_interval(1);
        let w = s.open_window("w", COUNT_1S_X10);
        for i in 0..1_000u64 {
            s.apply(w, &i.to_le_bytes(), (i * 10_000) as i64, Delta::Count)
                .unwrap();
        }
        assert_eq!(s.live_keys(), 1_000);
        // A key a year old still counts its old window exactly.
        assert_eq!(
            s.apply(w, &0u64.to_le_bytes(), 5, Delta::Count)
                .unwrap()
                .applied,
            Applied::Counted(2)
        );
    }

    #[test]
    fn keys_are_dropped_exactly_when_the_horizon_passes_their_window() {
        let mut s = MemoryStore::with_sweep_interval(0);
        let w = s.open_window("w", COUNT_1S_X10);
        // "old" has head bucket 9 (t = 950): an event in bucket 18 still sees it.
        s.apply(w, b"old", 950, Delta::Count).unwrap();
        s.set_horizon(1_899);
        for i in 0..10u64 {
            s.apply(w, &i.to_le_bytes(), 5_000, Delta::Count).unwrap();
        }
        assert_eq!(
            s.apply(w, b"old", 1_899, Delta::Count).unwrap().applied,
            Applied::Counted(2)
        );
        // Old's head is now bucket 18: kept until the horizon reaches bucket 28.
        s.set_horizon(2_799);
        s.apply(w, b"new", 5_000, Delta::Count).unwrap();
        assert!(s.states.iter().any(|(k, _)| k.as_slice() == b"old"));
        s.set_horizon(2_800);
        s.apply(w, b"newer", 5_000, Delta::Count).unwrap();
        assert!(s.states.iter().all(|(k, _)| k.as_slice() != b"old"));
        // The horizon never moves back.
        s.set_horizon(0);
        assert_eq!(s.horizon, Some(2_800));
    }

    #[test]
    fn past_the_bound_the_keys_whose_newest_event_is_oldest_are_evicted() {
        let mut s = MemoryStore::new().with_max_keys(160);
        let w = s.open_window("w", WindowSpec::new(1_000, 3_600, Aggregate::Count));
        // One key counted now and then stays; 10 000 one-off keys flood the store.
        for i in 0..10_000u64 {
            let t = i as i64;
            if i % 50 == 0 {
                s.apply(w, b"victim", t, Delta::Count).unwrap();
            }
            s.apply(w, &i.to_le_bytes(), t, Delta::Count).unwrap();
            assert!(s.live_keys() <= 160, "{} keys at {i}", s.live_keys());
        }
        assert_eq!(
            s.apply(w, b"victim", 10_000, Delta::Count).unwrap().applied,
            Applied::Counted(201)
        );
        let stats = s.state_stats();
        assert!(stats.evicted_keys >= 10_000 - 160, "{stats:?}");
        assert!(stats.bytes > 0 && stats.bytes < 160 * 1024, "{stats:?}");
        // The newest flood keys are the ones kept.
        assert_eq!(
            s.read(w, &9_999u64.to_le_bytes(), 10_000).unwrap().applied,
            Applied::Counted(1)
        );
        assert_eq!(
            s.read(w, &0u64.to_le_bytes(), 10_000).unwrap().applied,
            Applied::Counted(0)
        );
    }

    #[test]
    fn eviction_is_deterministic_and_breaks_ties_by_key() {
        let run = || {
            let mut s = MemoryStore::new().with_max_keys(32);
            let w = s.open_window("w", COUNT_1S_X10);
            // Every key at the same time: the order is the key bytes alone.
            for i in 0..100u64 {
                s.apply(w, &(i * 7919 % 100).to_be_bytes(), 5, Delta::Count)
                    .unwrap();
            }
            let mut kept: Vec<Vec<u8>> = s.states.keys().map(|k| k.as_slice().to_vec()).collect();
            kept.sort();
            kept
        };
        let kept = run();
        assert_eq!(kept, run());
        assert!(kept.len() <= 32);
        // The largest keys survive (the smallest were evicted first).
        assert_eq!(kept.last().unwrap(), &99u64.to_be_bytes().to_vec());
    }

    #[test]
    fn holds_are_bounded_too_and_the_first_to_end_go_first() {
        let mut s = MemoryStore::new().with_max_keys(64);
        let h = s.open_holds("r", 60_000);
        for i in 0..1_000u64 {
            s.extend_hold(h, &i.to_le_bytes(), 1_000 + i as i64)
                .unwrap();
            assert!(s.holds.len() <= 64);
        }
        assert_eq!(s.held_until(h, &999u64.to_le_bytes()).unwrap(), Some(1_999));
        assert_eq!(s.held_until(h, &0u64.to_le_bytes()).unwrap(), None);
        assert!(s.state_stats().evicted_holds >= 1_000 - 64);
    }
}
