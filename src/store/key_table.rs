//! The in-process store's table of keys: open addressing with linear probing over one tag byte
//! per slot. Unlike hashbrown's tables, the slot where a key's probe starts is known from its
//! hash alone, so [`KeyTable::prefetch`] can ask for that slot's cache lines before the key is
//! looked up: an event's keys (an account, a card, a merchant, an address) are then fetched from
//! memory at once instead of one miss after another. A lookup usually ends at that first slot.
//!
//! Growth follows hashbrown's rules (7/8 load counting tombstones, rehash in place when at most
//! half full, else double): the store foresees a doubling from [`KeyTable::capacity`] and
//! [`KeyTable::full_capacity`] and counts the table by [`KeyTable::allocated_bytes`].

use std::hash::BuildHasher;

use super::keys::KeyBytes;

const EMPTY: u8 = 0;
/// A removed key: probes go on past it.
const DELETED: u8 = 1;

/// A full slot's tag: the hash's top seven bits, high bit set (never `EMPTY` or `DELETED`).
#[inline]
fn tag_of(hash: u64) -> u8 {
    (hash >> 57) as u8 | 0x80
}

/// Keys a table of `slots` slots holds before it must grow (hashbrown's 7/8, all but one when
/// tiny).
fn full_capacity(slots: usize) -> usize {
    if slots < 8 {
        slots.saturating_sub(1)
    } else {
        slots / 8 * 7
    }
}

/// Slots for `keys` keys (a power of two).
fn slots_for(keys: usize) -> usize {
    if keys < 4 {
        4
    } else if keys < 8 {
        8
    } else {
        (keys * 8 / 7).next_power_of_two()
    }
}

/// Asks for the cache line at `at` without waiting for it (a hint: never faults).
#[inline]
fn prefetch_line<T>(at: *const T) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch is a hint; it reads nothing architecturally and never faults,
        // whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at.cast::<i8>()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}

/// Asks the kernel to back a large table, before its pages are first touched, with huge pages:
/// lookups land at random across hundreds of megabytes, and with 4 KiB pages nearly every one
/// also missed the TLB (measured: 3–12 % of a replay on the shipped rules). A hint: where
/// transparent huge pages are off, or the call fails, nothing changes.
fn advise_huge_pages<T>(buffer: &Vec<T>) {
    #[cfg(target_os = "linux")]
    {
        const HUGE_PAGE: usize = 2 << 20;
        const PAGE: usize = 4096;
        let bytes = buffer.capacity() * size_of::<T>();
        if bytes < 2 * HUGE_PAGE {
            return;
        }
        let start = (buffer.as_ptr() as usize).next_multiple_of(PAGE);
        let end = (buffer.as_ptr() as usize + bytes) / PAGE * PAGE;
        // SAFETY: madvise with MADV_HUGEPAGE changes how the kernel backs the range, never its
        // contents or mapping; the range lies inside this buffer's own allocation.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = buffer;
}

/// Keys (canonical bytes) and their values.
#[derive(Debug)]
pub(super) struct KeyTable<V> {
    tags: Vec<u8>,
    slots: Vec<Option<(KeyBytes, V)>>,
    len: usize,
    deleted: usize,
    hasher: foldhash::fast::RandomState,
}

impl<V> Default for KeyTable<V> {
    fn default() -> Self {
        KeyTable {
            tags: Vec::new(),
            slots: Vec::new(),
            len: 0,
            deleted: 0,
            hasher: foldhash::fast::RandomState::default(),
        }
    }
}

impl<V> KeyTable<V> {
    /// Bytes a slot takes: its entry and its tag.
    pub(super) const SLOT_BYTES: usize = size_of::<Option<(KeyBytes, V)>>() + 1;

    #[inline]
    fn hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// Starts fetching the slot where `key`'s probe begins.
    #[inline]
    pub(super) fn prefetch(&self, key: &[u8]) {
        if self.slots.is_empty() {
            return;
        }
        let at = self.hash(key) as usize & self.mask();
        prefetch_line(&self.tags[at]);
        prefetch_line(&self.slots[at]);
    }

    /// The slot holding `key`.
    #[inline]
    fn find(&self, key: &[u8]) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let hash = self.hash(key);
        let tag = tag_of(hash);
        let mask = self.mask();
        let mut at = hash as usize & mask;
        // Ends: the load bound leaves an empty slot.
        loop {
            match self.tags[at] {
                EMPTY => return None,
                t if t == tag => {
                    if let Some((stored, _)) = &self.slots[at] {
                        if stored.as_slice() == key {
                            return Some(at);
                        }
                    }
                }
                _ => {}
            }
            at = (at + 1) & mask;
        }
    }

    #[inline]
    pub(super) fn get(&self, key: &[u8]) -> Option<&V> {
        let at = self.find(key)?;
        self.slots[at].as_ref().map(|(_, value)| value)
    }

    #[inline]
    pub(super) fn get_mut(&mut self, key: &[u8]) -> Option<&mut V> {
        let at = self.find(key)?;
        self.slots[at].as_mut().map(|(_, value)| value)
    }

    pub(super) fn contains_key(&self, key: &[u8]) -> bool {
        self.find(key).is_some()
    }

    /// Inserts `key`, which the table does not hold, with `value`; the value in place.
    pub(super) fn insert_new(&mut self, key: KeyBytes, value: V) -> &mut V {
        debug_assert!(!self.contains_key(key.as_slice()));
        self.reserve_one();
        let hash = self.hash(key.as_slice());
        let at = self.free_slot(hash);
        if self.tags[at] == DELETED {
            self.deleted -= 1;
        }
        self.tags[at] = tag_of(hash);
        self.len += 1;
        &mut self.slots[at].insert((key, value)).1
    }

    /// The first empty or removed slot of `hash`'s probe.
    fn free_slot(&self, hash: u64) -> usize {
        let mask = self.mask();
        let mut at = hash as usize & mask;
        while self.tags[at] > DELETED {
            at = (at + 1) & mask;
        }
        at
    }

    /// Room for one more key: past the load bound, rehashed in place when at most half full
    /// (dropping tombstones), else into twice the slots.
    fn reserve_one(&mut self) {
        let full = full_capacity(self.slots.len());
        if self.len + self.deleted < full {
            return;
        }
        let slots = if self.len < full / 2 {
            self.slots.len()
        } else {
            slots_for((self.len + 1).max(full + 1))
        };
        self.rebuild(slots);
    }

    fn rebuild(&mut self, slots: usize) {
        let old = std::mem::take(&mut self.slots);
        self.tags = Vec::with_capacity(slots);
        advise_huge_pages(&self.tags);
        self.tags.resize(slots, EMPTY);
        self.slots = Vec::with_capacity(slots);
        advise_huge_pages(&self.slots);
        self.slots.resize_with(slots, || None);
        self.deleted = 0;
        for (key, value) in old.into_iter().flatten() {
            let hash = self.hash(key.as_slice());
            let at = self.free_slot(hash);
            self.tags[at] = tag_of(hash);
            self.slots[at] = Some((key, value));
        }
    }

    /// Empties slot `at`: a tombstone unless no probe can pass it (the next slot is empty).
    fn clear(&mut self, at: usize) -> Option<(KeyBytes, V)> {
        let entry = self.slots[at].take();
        if entry.is_some() {
            self.len -= 1;
            if self.tags[(at + 1) & self.mask()] == EMPTY {
                self.tags[at] = EMPTY;
            } else {
                self.tags[at] = DELETED;
                self.deleted += 1;
            }
        }
        entry
    }

    pub(super) fn remove(&mut self, key: &[u8]) -> Option<V> {
        let at = self.find(key)?;
        self.clear(at).map(|(_, value)| value)
    }

    /// Keeps the keys `keep` says to keep.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(&KeyBytes, &mut V) -> bool) {
        for at in 0..self.slots.len() {
            let kept = match &mut self.slots[at] {
                Some((key, value)) => keep(key, value),
                None => true,
            };
            if !kept {
                self.clear(at);
            }
        }
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&KeyBytes, &V)> {
        self.slots
            .iter()
            .filter_map(|slot| slot.as_ref().map(|(key, value)| (key, value)))
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keys it holds before growing (hashbrown's meaning: tombstones take room until a rehash).
    pub(super) fn capacity(&self) -> usize {
        self.full_capacity() - self.deleted.min(self.full_capacity())
    }

    /// Keys its slots hold at most, tombstones or not (7/8 of them).
    pub(super) fn full_capacity(&self) -> usize {
        full_capacity(self.slots.len())
    }

    /// What its slots and tags take: the allocation, whatever they hold.
    pub(super) fn allocated_bytes(&self) -> usize {
        self.slots.len() * Self::SLOT_BYTES
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u64) -> KeyBytes {
        KeyBytes::new(&i.to_le_bytes())
    }

    #[test]
    fn it_finds_what_it_holds_through_growth_removal_and_retain() {
        let mut table = KeyTable::default();
        let mut model = std::collections::HashMap::new();
        // Pseudo-random keys, removals and re-insertions, checked against a std map.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for round in 0..200_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let k = x % 5_000;
            match round % 3 {
                0 | 1 => {
                    if let Some(v) = table.get_mut(&k.to_le_bytes()) {
                        *v += 1;
                        *model.get_mut(&k).unwrap() += 1;
                    } else {
                        table.insert_new(key(k), 1u64);
                        model.insert(k, 1u64);
                    }
                }
                _ => assert_eq!(table.remove(&k.to_le_bytes()), model.remove(&k)),
            }
            if round % 50_000 == 49_999 {
                table.retain(|_, v| *v % 2 == 0);
                model.retain(|_, v| *v % 2 == 0);
            }
        }
        assert_eq!(table.len(), model.len());
        for k in 0..5_000u64 {
            assert_eq!(table.get(&k.to_le_bytes()), model.get(&k), "key {k}");
        }
        assert_eq!(table.iter().count(), model.len());
        // Never full: an empty slot always ends a probe.
        assert!(table.len + table.deleted < table.slots.len());
    }

    #[test]
    fn long_keys_and_an_empty_table() {
        let mut table: KeyTable<u8> = KeyTable::default();
        assert!(table.get(b"x").is_none());
        assert!(table.remove(b"x").is_none());
        table.prefetch(b"x");
        let long = vec![7u8; 300];
        table.insert_new(KeyBytes::new(&long), 1);
        table.insert_new(KeyBytes::new(b""), 2);
        assert_eq!(table.get(&long), Some(&1));
        assert_eq!(table.get(b""), Some(&2));
        assert_eq!(table.get(&long[..299]), None);
    }
}
