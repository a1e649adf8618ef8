//! The in-process store: exact, single-process, memory proportional to live keys.

use hashbrown::HashMap;

use super::keys::{KeyBytes, KeyRef, StoredKey};
use super::{CounterStore, StoreError, WindowId, Windows};
use crate::window::{Applied, Delta, WindowSpec, WindowState};

/// Fewest new keys between two sweeps, so small workloads never pay for one.
const MIN_SWEEP_INTERVAL: usize = 4096;

/// Exact counters in a hash map. Keys are the exact canonical bytes (no digests), so two
/// different keys can never share a counter.
///
/// A key is dropped once its whole window ends more than a window before the newest event time
/// seen (`WindowSpec::is_expired` with one window of lateness): events up to one window older
/// than the newest are therefore judged exactly as if nothing had been dropped.
#[derive(Debug)]
pub struct MemoryStore {
    windows: Windows,
    states: HashMap<StoredKey, WindowState, foldhash::fast::RandomState>,
    newest_ts: i64,
    inserts_since_sweep: usize,
    /// Sweep once this many new keys arrived: the live count after the last sweep (at least the
    /// floor), so sweeping costs amortised O(1) per new key and memory stays within ~2× live.
    sweep_after: usize,
    sweep_interval_floor: usize,
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

    /// A store that sweeps expired keys after at least `floor` new keys (tests use small values
    /// to sweep often).
    pub fn with_sweep_interval(floor: usize) -> MemoryStore {
        MemoryStore {
            windows: Windows::default(),
            states: HashMap::default(),
            newest_ts: i64::MIN,
            inserts_since_sweep: 0,
            sweep_after: floor,
            sweep_interval_floor: floor,
        }
    }

    /// Drops keys that can no longer affect a decision.
    fn sweep(&mut self) {
        let newest = self.newest_ts;
        let windows = &self.windows;
        self.states.retain(|k, state| {
            let spec = windows.spec(k.window);
            state.head().is_none_or(|head| !spec.is_expired(head, newest, spec.window_ms()))
        });
        self.inserts_since_sweep = 0;
        self.sweep_after = self.states.len().max(self.sweep_interval_floor);
    }
}

impl CounterStore for MemoryStore {
    fn open_window(&mut self, name: &str, spec: WindowSpec) -> WindowId {
        self.windows.open(name, spec)
    }

    fn apply(&mut self, window: WindowId, key: &[u8], ts_ms: i64, delta: Delta) -> Result<Applied, StoreError> {
        let spec = self.windows.spec(window.0);
        self.newest_ts = self.newest_ts.max(ts_ms);
        let bucket = spec.bucket_of(ts_ms);
        let lookup = KeyRef { window: window.0, key };
        let applied = match self.states.get_mut(&lookup) {
            Some(state) => state.apply(&spec, bucket, delta),
            None => {
                let mut state = WindowState::new(spec.aggregate);
                let applied = state.apply(&spec, bucket, delta);
                self.states.insert(StoredKey { window: window.0, key: KeyBytes::new(key) }, state);
                self.inserts_since_sweep += 1;
                applied
            }
        };
        if self.inserts_since_sweep >= self.sweep_after {
            self.sweep();
        }
        Ok(applied)
    }

    fn flush(&mut self) -> Result<(), StoreError> {
        Ok(())
    }

    fn live_keys(&self) -> usize {
        self.states.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::window::Aggregate;

    const COUNT_1S_X10: WindowSpec = WindowSpec { bucket_ms: 100, buckets: 10, aggregate: Aggregate::Count };

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
        assert_eq!(s.apply(a, b"k", 0, Delta::Count).unwrap(), Applied::Counted(1.0));
        assert_eq!(s.apply(a, b"k", 1, Delta::Count).unwrap(), Applied::Counted(2.0));
        assert_eq!(s.apply(b, b"k", 2, Delta::Count).unwrap(), Applied::Counted(1.0));
        assert_eq!(s.apply(a, b"k2", 3, Delta::Count).unwrap(), Applied::Counted(1.0));
        assert_eq!(s.live_keys(), 3);
    }

    #[test]
    fn memory_follows_live_keys_not_total_keys() {
        let mut s = MemoryStore::with_sweep_interval(16);
        let w = s.open_window("w", COUNT_1S_X10);
        // 100 000 keys, each seen once, time advancing 10 ms per key: only the last few
        // windows' worth (3 windows = 300 keys) can be live at any moment.
        for i in 0..100_000u64 {
            s.apply(w, &i.to_le_bytes(), (i * 10) as i64, Delta::Count).unwrap();
            assert!(s.live_keys() <= 2 * 300 + 16, "{} keys live at {i}", s.live_keys());
        }
    }

    #[test]
    fn keys_within_one_window_of_lateness_are_kept_and_older_ones_dropped() {
        let mut s = MemoryStore::with_sweep_interval(1);
        let w = s.open_window("w", COUNT_1S_X10);
        // "old" has head bucket 9: its window ends at 1000 ms.
        s.apply(w, b"old", 950, Delta::Count).unwrap();
        // The newest time goes as far as it can while an event one window behind it could still
        // reach bucket 9: an event at 1899 ms (bucket 18) has window 9..=18.
        for i in 0..100u64 {
            s.apply(w, &i.to_le_bytes(), 2_899, Delta::Count).unwrap();
        }
        assert_eq!(s.apply(w, b"old", 1_899, Delta::Count).unwrap(), Applied::Counted(2.0));
        // Old's head is now bucket 18 (window ends at 1900): once the newest time is a window
        // plus a window of lateness past that, it goes.
        let before = s.live_keys();
        for i in 100..200u64 {
            s.apply(w, &i.to_le_bytes(), 3_900, Delta::Count).unwrap();
        }
        assert!(s.states.iter().all(|(k, _)| k.key.as_slice() != b"old"));
        assert!(s.live_keys() <= before + 100);
    }
}
