//! The (window, key) pairs a batch's events touch, each listed once: what a store reads ahead
//! of counting ([`crate::store::CounterStore::prefetch`] and `read_ahead`).

use std::hash::BuildHasher;

use crate::store::WindowId;

/// A batch's touched windows, each once, in the order first touched. A batch of a thousand
/// events names a few thousand keys a dozen thousand times; listing each once here (one probe of
/// a small table) spares the store looking each repeat up in its views, twice per batch with
/// reads ahead, and spares a copy of the key.
///
/// A window is known again by the 64-bit hash of its window and key (seeded per process), not by
/// its bytes, so a repeat costs no look at the key listed before. Two keys of one batch with one
/// hash would leave the second unlisted: it is then read when counted, as any key a prefetch
/// missed is — slower, never wrong.
///
/// Cleared between batches, it keeps its buffers: after the first batches, listing a key
/// allocates nothing.
#[derive(Default)]
pub struct Touched {
    /// `keys[..len]` are the batch's; the buffers past `len` wait for reuse.
    keys: Vec<(WindowId, Vec<u8>)>,
    len: usize,
    /// The hashes of the windows listed.
    index: hashbrown::HashTable<u64>,
    hasher: foldhash::fast::RandomState,
}

impl Touched {
    /// The windows listed since the last [`Touched::clear`], each once.
    pub fn keys(&self) -> &[(WindowId, Vec<u8>)] {
        &self.keys[..self.len]
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets the windows listed, keeping the buffers.
    pub fn clear(&mut self) {
        self.len = 0;
        self.index.clear();
    }

    /// Lists `key` of `window` unless it is listed already.
    pub fn insert(&mut self, window: WindowId, key: &[u8]) {
        let hash = self.hasher.hash_one((window.0, key));
        match self
            .index
            .entry(hash, |&listed| listed == hash, |&listed| listed)
        {
            hashbrown::hash_table::Entry::Occupied(_) => return,
            hashbrown::hash_table::Entry::Vacant(vacant) => {
                vacant.insert(hash);
            }
        }
        match self.keys.get_mut(self.len) {
            Some((w, k)) => {
                *w = window;
                k.clear();
                k.extend_from_slice(key);
            }
            None => self.keys.push((window, key.to_vec())),
        }
        self.len += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_window_is_listed_once_in_the_order_first_touched_and_buffers_are_reused() {
        let mut touched = Touched::default();
        touched.insert(WindowId(1), b"u-1");
        touched.insert(WindowId(2), b"u-1");
        touched.insert(WindowId(1), b"u-1");
        touched.insert(WindowId(1), b"u-2");
        touched.insert(WindowId(2), b"u-1");
        assert_eq!(
            touched.keys(),
            &[
                (WindowId(1), b"u-1".to_vec()),
                (WindowId(2), b"u-1".to_vec()),
                (WindowId(1), b"u-2".to_vec()),
            ]
        );
        let buffer = touched.keys()[0].1.as_ptr();
        touched.clear();
        assert!(touched.is_empty());
        touched.insert(WindowId(3), b"u-3");
        touched.insert(WindowId(3), b"u-3");
        assert_eq!(touched.keys(), &[(WindowId(3), b"u-3".to_vec())]);
        assert_eq!(
            touched.keys()[0].1.as_ptr(),
            buffer,
            "the first buffer is reused"
        );
    }

    #[test]
    fn many_windows_survive_the_index_growing() {
        let mut touched = Touched::default();
        for round in 0..2 {
            for i in 0..10_000u32 {
                touched.insert(WindowId(i % 7), &i.to_be_bytes());
            }
            assert_eq!(touched.keys().len(), 10_000, "round {round}");
            for (i, (window, key)) in touched.keys().iter().enumerate() {
                assert_eq!(*window, WindowId(i as u32 % 7));
                assert_eq!(key.as_slice(), (i as u32).to_be_bytes());
            }
            touched.clear();
        }
    }
}
