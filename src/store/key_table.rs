//! The in-process store's table of keys: open addressing with linear probing over one tag byte
//! per slot. Unlike hashbrown's tables, the slot where a key's probe starts is known from its
//! hash alone, so [`KeyTable::prefetch`] can ask for that slot's cache lines before the key is
//! looked up: an event's keys (an account, a card, a merchant, an address) are then fetched from
//! memory at once instead of one miss after another. A lookup usually ends at that first slot.
//!
//! Growth follows hashbrown's rules (7/8 load counting tombstones, rehash in place when at most
//! half full, else double): the store foresees a doubling from [`KeyTable::capacity`] and
//! [`KeyTable::full_capacity`] and counts the table by [`KeyTable::allocated_bytes`]. A doubling
//! too is a rehash in place, into slot memory extended where it lies ([`Slots`]).

use std::alloc::Layout;
use std::hash::BuildHasher;
use std::mem::MaybeUninit;
use std::ptr::NonNull;

use super::keys::KeyBytes;

const EMPTY: u8 = 0;
/// A removed key: probes go on past it.
const DELETED: u8 = 1;
/// While rebuilding: a key not yet placed anew.
const REHASH: u8 = 2;

#[cfg(target_os = "linux")]
const PAGE: usize = 4096;

/// Whether a tag marks a slot holding a key (as [`tag_of`] makes them).
#[inline]
fn is_full(tag: u8) -> bool {
    tag >= 0x80
}

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
pub(super) fn prefetch_line<T>(at: *const T) {
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

/// Asks the kernel to back a large table (`count` items from `start`), before its pages are
/// first touched, with huge pages: lookups land at random across hundreds of megabytes, and with
/// 4 KiB pages nearly every one also missed the TLB (measured: 3–12 % of a replay on the shipped
/// rules). A hint: where transparent huge pages are off (the `vigil` binary turns them off for its
/// process unless asked: in a VM a fresh huge page can cost more to fault in than its TLB misses
/// save), or the call fails, nothing changes.
fn advise_huge_pages<T>(start: *mut T, count: usize) {
    #[cfg(target_os = "linux")]
    {
        const HUGE_PAGE: usize = 2 << 20;
        let bytes = count * size_of::<T>();
        if bytes < 2 * HUGE_PAGE {
            return;
        }
        let first = (start as usize).next_multiple_of(PAGE);
        let end = (start as usize + bytes) / PAGE * PAGE;
        // SAFETY: madvise with MADV_HUGEPAGE changes how the kernel backs the range, never its
        // contents or mapping; the range lies inside the caller's own allocation.
        unsafe {
            libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (start, count);
}

/// Memory for a table's entries that grows in place: on Linux the mapping is extended with
/// `mremap`, which keeps the pages already backed and adds zero pages behind them, so a table
/// that doubles touches each new page once (the rehash moves about half of the entries into the
/// new half) instead of writing every entry into a fresh table twice the size while the old one
/// is still held. In a VM a first touch is what a cold table's growth costs most (measured:
/// a quarter of a cold replay's samples zeroing pages for the rebuilds).
///
/// Which slots hold a value is the owner's to know (the tags); this only holds the memory.
struct Slots<T> {
    ptr: NonNull<MaybeUninit<T>>,
    len: usize,
}

// SAFETY: `Slots` owns its memory exclusively, as a `Vec<MaybeUninit<T>>` would.
unsafe impl<T: Send> Send for Slots<T> {}
// SAFETY: shared access hands out only shared references to `T`.
unsafe impl<T: Sync> Sync for Slots<T> {}

impl<T> std::fmt::Debug for Slots<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slots").field("len", &self.len).finish()
    }
}

impl<T> Slots<T> {
    const fn empty() -> Self {
        Slots {
            ptr: NonNull::dangling(),
            len: 0,
        }
    }

    /// Slot `at` (below `len`): its address, for reading or writing a value in place.
    #[inline]
    fn at(&self, at: usize) -> *mut T {
        debug_assert!(at < self.len);
        // SAFETY: `at < len`, so the offset stays inside the allocation.
        unsafe { self.ptr.as_ptr().add(at).cast::<T>() }
    }

    fn layout(len: usize) -> Layout {
        Layout::array::<T>(len).expect("a key table's size fits the address space")
    }

    /// Grows to `len` slots (more than now), keeping what the first ones hold; the new slots are
    /// uninitialized (on Linux, zero pages not yet backed), never read before written.
    fn grow(&mut self, len: usize) {
        debug_assert!(len > self.len);
        let new = Self::layout(len);
        if new.size() == 0 {
            self.len = len;
            return;
        }
        #[cfg(all(target_os = "linux", not(miri)))]
        let ptr = {
            let bytes = new.size().next_multiple_of(PAGE);
            // SAFETY: a fresh anonymous mapping, or the mapping this owns extended (moved if
            // needed: nothing else points into it while `&mut self` is held).
            let mapped = unsafe {
                if self.len == 0 {
                    libc::mmap(
                        std::ptr::null_mut(),
                        bytes,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                        -1,
                        0,
                    )
                } else {
                    libc::mremap(
                        self.ptr.as_ptr().cast(),
                        Self::layout(self.len).size().next_multiple_of(PAGE),
                        bytes,
                        libc::MREMAP_MAYMOVE,
                    )
                }
            };
            if mapped == libc::MAP_FAILED {
                std::alloc::handle_alloc_error(new);
            }
            advise_huge_pages(mapped.cast::<u8>(), bytes);
            mapped.cast::<MaybeUninit<T>>()
        };
        #[cfg(not(all(target_os = "linux", not(miri))))]
        let ptr = {
            // SAFETY: `new` has a non-zero size; the old allocation (if any) was made with
            // `layout(self.len)` and is copied before it is freed.
            unsafe {
                let fresh = std::alloc::alloc(new).cast::<MaybeUninit<T>>();
                if fresh.is_null() {
                    std::alloc::handle_alloc_error(new);
                }
                if self.len > 0 {
                    std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), fresh, self.len);
                    std::alloc::dealloc(self.ptr.as_ptr().cast(), Self::layout(self.len));
                }
                fresh
            }
        };
        self.ptr = NonNull::new(ptr).expect("an allocation is never null");
        self.len = len;
    }
}

impl<T> Drop for Slots<T> {
    fn drop(&mut self) {
        let layout = Self::layout(self.len);
        if layout.size() == 0 {
            return;
        }
        // SAFETY: the mapping or allocation `grow` made for `len` slots; the values in it were
        // dropped by their owner.
        unsafe {
            #[cfg(all(target_os = "linux", not(miri)))]
            libc::munmap(
                self.ptr.as_ptr().cast(),
                layout.size().next_multiple_of(PAGE),
            );
            #[cfg(not(all(target_os = "linux", not(miri))))]
            std::alloc::dealloc(self.ptr.as_ptr().cast(), layout);
        }
    }
}

/// Keys (canonical bytes) and their values.
///
/// A slot holds a value exactly when its tag is full (`>= 0x80`).
#[derive(Debug)]
pub(super) struct KeyTable<V> {
    tags: Vec<u8>,
    slots: Slots<(KeyBytes, V)>,
    len: usize,
    deleted: usize,
    hasher: foldhash::fast::RandomState,
}

impl<V> Default for KeyTable<V> {
    fn default() -> Self {
        KeyTable {
            tags: Vec::new(),
            slots: Slots::empty(),
            len: 0,
            deleted: 0,
            hasher: foldhash::fast::RandomState::default(),
        }
    }
}

impl<V> Drop for KeyTable<V> {
    fn drop(&mut self) {
        for at in 0..self.tags.len() {
            if is_full(self.tags[at]) {
                // SAFETY: a full tag marks an initialized slot, dropped once here.
                unsafe { std::ptr::drop_in_place(self.slots.at(at)) };
            }
        }
    }
}

impl<V> KeyTable<V> {
    /// Bytes a slot takes: its entry and its tag.
    pub(super) const SLOT_BYTES: usize = size_of::<(KeyBytes, V)>() + 1;

    #[inline]
    fn hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    #[inline]
    fn mask(&self) -> usize {
        self.tags.len() - 1
    }

    /// The entry in slot `at`, whose tag must be full (or, while rebuilding, `REHASH`).
    #[inline]
    fn entry(&self, at: usize) -> &(KeyBytes, V) {
        debug_assert!(is_full(self.tags[at]) || self.tags[at] == REHASH);
        // SAFETY: full and `REHASH` tags mark initialized slots.
        unsafe { &*self.slots.at(at) }
    }

    #[inline]
    fn entry_mut(&mut self, at: usize) -> &mut (KeyBytes, V) {
        debug_assert!(is_full(self.tags[at]));
        // SAFETY: a full tag marks an initialized slot; `&mut self` makes the access unique.
        unsafe { &mut *self.slots.at(at) }
    }

    /// Starts fetching the slot where `key`'s probe begins.
    #[inline]
    pub(super) fn prefetch(&self, key: &[u8]) {
        if self.tags.is_empty() {
            return;
        }
        let at = self.hash(key) as usize & self.mask();
        prefetch_line(&self.tags[at]);
        prefetch_line(self.slots.at(at));
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
                t if t == tag && self.entry(at).0.as_slice() == key => return Some(at),
                _ => {}
            }
            at = (at + 1) & mask;
        }
    }

    #[inline]
    pub(super) fn get(&self, key: &[u8]) -> Option<&V> {
        let at = self.find(key)?;
        Some(&self.entry(at).1)
    }

    #[inline]
    pub(super) fn get_mut(&mut self, key: &[u8]) -> Option<&mut V> {
        let at = self.find(key)?;
        Some(&mut self.entry_mut(at).1)
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
        // SAFETY: the slot's tag is empty or deleted, so it holds nothing to overwrite.
        unsafe { self.slots.at(at).write((key, value)) };
        self.tags[at] = tag_of(hash);
        self.len += 1;
        &mut self.entry_mut(at).1
    }

    /// The first empty or removed slot of `hash`'s probe.
    fn free_slot(&self, hash: u64) -> usize {
        let mask = self.mask();
        let mut at = hash as usize & mask;
        while is_full(self.tags[at]) {
            at = (at + 1) & mask;
        }
        at
    }

    /// Room for one more key: past the load bound, rehashed in place when at most half full
    /// (dropping tombstones), else into twice the slots.
    fn reserve_one(&mut self) {
        let full = full_capacity(self.tags.len());
        if self.len + self.deleted < full {
            return;
        }
        let slots = if self.len < full / 2 {
            self.tags.len()
        } else {
            slots_for((self.len + 1).max(full + 1))
        };
        self.rebuild(slots);
    }

    /// Rehashes every key into `slots` slots (as many as now, or more), in place: hashbrown's
    /// `rehash_in_place` for linear probing. Every key is first marked `REHASH`, then each in
    /// turn goes to the first slot of its probe that is empty or still marked (swapping with a
    /// marked one, which is then placed in its turn). A placed key's probe crosses only placed
    /// keys, and a slot left empty was never on one, so every probe ends where it should.
    fn rebuild(&mut self, slots: usize) {
        debug_assert!(slots >= self.tags.len() && slots.is_power_of_two());
        if slots > self.tags.len() {
            self.slots.grow(slots);
            let mut tags = Vec::with_capacity(slots);
            advise_huge_pages(tags.as_mut_ptr(), slots);
            tags.extend_from_slice(&self.tags);
            tags.resize(slots, EMPTY);
            self.tags = tags;
        }
        for tag in &mut self.tags {
            *tag = if is_full(*tag) { REHASH } else { EMPTY };
        }
        self.deleted = 0;
        let mask = self.mask();
        for at in 0..self.tags.len() {
            while self.tags[at] == REHASH {
                let hash = self.hash(self.entry(at).0.as_slice());
                let mut to = hash as usize & mask;
                // Ends at `at` at the latest: it is marked.
                while !matches!(self.tags[to], EMPTY | REHASH) {
                    to = (to + 1) & mask;
                }
                if to == at {
                    self.tags[at] = tag_of(hash);
                } else if self.tags[to] == EMPTY {
                    // SAFETY: `at` holds a value and `to` none; the value moves, and `at`'s
                    // empty tag says it holds nothing any more.
                    unsafe {
                        std::ptr::copy_nonoverlapping(self.slots.at(at), self.slots.at(to), 1)
                    };
                    self.tags[to] = tag_of(hash);
                    self.tags[at] = EMPTY;
                } else {
                    // SAFETY: both slots hold values (marked), distinct slots.
                    unsafe {
                        std::ptr::swap_nonoverlapping(self.slots.at(at), self.slots.at(to), 1)
                    };
                    self.tags[to] = tag_of(hash);
                }
            }
        }
    }

    /// Empties slot `at`: a tombstone unless no probe can pass it (the next slot is empty).
    fn clear(&mut self, at: usize) -> Option<(KeyBytes, V)> {
        if !is_full(self.tags[at]) {
            return None;
        }
        // SAFETY: a full tag marks an initialized slot; the tag is cleared below, so the value
        // is read out once.
        let entry = unsafe { self.slots.at(at).read() };
        self.len -= 1;
        if self.tags[(at + 1) & self.mask()] == EMPTY {
            self.tags[at] = EMPTY;
        } else {
            self.tags[at] = DELETED;
            self.deleted += 1;
        }
        Some(entry)
    }

    pub(super) fn remove(&mut self, key: &[u8]) -> Option<V> {
        let at = self.find(key)?;
        self.clear(at).map(|(_, value)| value)
    }

    /// Keeps the keys `keep` says to keep.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(&KeyBytes, &mut V) -> bool) {
        for at in 0..self.tags.len() {
            if !is_full(self.tags[at]) {
                continue;
            }
            let (key, value) = self.entry_mut(at);
            if !keep(key, value) {
                self.clear(at);
            }
        }
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&KeyBytes, &V)> {
        (0..self.tags.len())
            .filter(|&at| is_full(self.tags[at]))
            .map(|at| {
                let (key, value) = self.entry(at);
                (key, value)
            })
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
        full_capacity(self.tags.len())
    }

    /// What its slots and tags take: the allocation, whatever they hold.
    pub(super) fn allocated_bytes(&self) -> usize {
        self.tags.len() * Self::SLOT_BYTES
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
        assert!(table.len + table.deleted < table.tags.len());
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

    #[test]
    fn every_value_is_dropped_once_whether_removed_kept_or_left_in_the_table() {
        use std::rc::Rc;
        let alive = Rc::new(());
        let mut table = KeyTable::default();
        // Through several doublings and in-place rehashes (removals leave tombstones).
        for i in 0..20_000u64 {
            table.insert_new(key(i), Rc::clone(&alive));
            if i % 3 == 0 {
                assert!(table.remove(&(i / 2).to_le_bytes()).is_some());
            }
        }
        table.retain(|k, _| k.as_slice()[0] % 2 == 0);
        let held = table.len();
        assert_eq!(Rc::strong_count(&alive), held + 1);
        assert_eq!(table.iter().count(), held);
        drop(table);
        assert_eq!(Rc::strong_count(&alive), 1);
    }

    #[test]
    fn a_large_table_keeps_every_key_through_its_doublings() {
        let mut table = KeyTable::default();
        for i in 0..300_000u64 {
            *table.insert_new(key(i), 0u64) = i;
        }
        // Past two huge pages: its slots are a mapping extended in place.
        assert!(table.allocated_bytes() > 4 << 20);
        for i in 0..300_000u64 {
            assert_eq!(table.get(&i.to_le_bytes()), Some(&i), "key {i}");
        }
        assert_eq!(table.get(&300_000u64.to_le_bytes()), None);
    }
}
