//! The in-process store: exact, single-process, memory proportional to live keys.

use hashbrown::HashMap;
use smallvec::SmallVec;

use super::keys::{BytesRef, KeyBytes, KeyRef, StoredKey};
use super::{CounterStore, HoldSpace, HoldSpaces, Observed, StoreError, WindowId, Windows};
use crate::window::{Delta, WindowSpec, WindowState};

/// Fewest new keys between two sweeps, so small workloads never pay for one.
const MIN_SWEEP_INTERVAL: usize = 4096;

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
#[derive(Debug)]
pub struct MemoryStore {
    windows: Windows,
    states: HashMap<KeyBytes, KeyWindows, foldhash::fast::RandomState>,
    /// (window, key) pairs held: what `live_keys` reports.
    pairs: usize,
    hold_spaces: HoldSpaces,
    /// Held keys (the key's `window` is its hold space) and until when. Kept for good: an event
    /// of any age is held if its time is before its key's hold, and there is at most one entry
    /// per (rule, key) that fired by its condition.
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
            hold_spaces: HoldSpaces::default(),
            holds: HashMap::default(),
            horizon: None,
            inserts_since_sweep: 0,
            sweep_after: floor,
            sweep_interval_floor: floor,
        }
    }

    /// Drops keys that can no longer affect a decision.
    fn sweep(&mut self) {
        if let Some(horizon) = self.horizon {
            let windows = &self.windows;
            let mut pairs = 0;
            self.states.retain(|_, entry| {
                entry.retain(|(window, state)| {
                    let spec = windows.spec(*window);
                    state.head().is_none_or(|head| !spec.can_drop(head, horizon))
                });
                pairs += entry.len();
                !entry.is_empty()
            });
            self.pairs = pairs;
        }
        self.inserts_since_sweep = 0;
        self.sweep_after = self.pairs.max(self.sweep_interval_floor);
    }
}

impl CounterStore for MemoryStore {
    fn open_window(&mut self, name: &str, spec: WindowSpec) -> WindowId {
        self.windows.open(name, spec)
    }

    fn apply(&mut self, window: WindowId, key: &[u8], ts_ms: i64, delta: Delta) -> Result<Observed, StoreError> {
        let spec = self.windows.spec(window.0);
        let bucket = spec.bucket_of(ts_ms);
        let entry = match self.states.get_mut(&BytesRef(key)) {
            Some(entry) => entry,
            None => self.states.entry(KeyBytes::new(key)).or_default(),
        };
        let applied = match entry.iter_mut().find(|(w, _)| *w == window.0) {
            Some((_, state)) => state.apply(&spec, bucket, delta),
            None => {
                let mut state = WindowState::new(spec.aggregate);
                let applied = state.apply(&spec, bucket, delta);
                entry.push((window.0, state));
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
        let state = self.states.get(&BytesRef(key)).and_then(|entry| entry.iter().find(|(w, _)| *w == window.0));
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
        Ok(self.holds.get(&KeyRef { window: space.0, key }).copied())
    }

    fn extend_hold(&mut self, space: HoldSpace, key: &[u8], until_ms: i64) -> Result<i64, StoreError> {
        let until = match self.holds.get_mut(&KeyRef { window: space.0, key }) {
            Some(held) => {
                *held = (*held).max(until_ms);
                *held
            }
            None => {
                self.holds.insert(StoredKey { window: space.0, key: KeyBytes::new(key) }, until_ms);
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
        let other = WindowSpec { buckets: 5, ..COUNT_1S_X10 };
        assert_ne!(s.open_window("a", other), a);
    }

    #[test]
    fn keys_are_separate_per_window_and_bytes() {
        let mut s = MemoryStore::new();
        let a = s.open_window("a", COUNT_1S_X10);
        let b = s.open_window("b", COUNT_1S_X10);
        assert_eq!(s.apply(a, b"k", 0, Delta::Count).unwrap().applied, Applied::Counted(1));
        assert_eq!(s.apply(a, b"k", 1, Delta::Count).unwrap().applied, Applied::Counted(2));
        assert_eq!(s.apply(b, b"k", 2, Delta::Count).unwrap().applied, Applied::Counted(1));
        assert_eq!(s.apply(a, b"k2", 3, Delta::Count).unwrap().applied, Applied::Counted(1));
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
            assert!(s.live_keys() <= 2 * 300 + 16, "{} keys live at {i}", s.live_keys());
        }
    }

    #[test]
    fn without_a_horizon_nothing_is_dropped() {
        let mut s = MemoryStore::with_sweep_interval(1);
        let w = s.open_window("w", COUNT_1S_X10);
        for i in 0..1_000u64 {
            s.apply(w, &i.to_le_bytes(), (i * 10_000) as i64, Delta::Count).unwrap();
        }
        assert_eq!(s.live_keys(), 1_000);
        // A key a year old still counts its old window exactly.
        assert_eq!(s.apply(w, &0u64.to_le_bytes(), 5, Delta::Count).unwrap().applied, Applied::Counted(2));
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
        assert_eq!(s.apply(w, b"old", 1_899, Delta::Count).unwrap().applied, Applied::Counted(2));
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
}
