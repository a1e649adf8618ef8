//! Exact (window, key) identities for local state: canonical key bytes, never digests, so two
//! different keys can never share a counter.

use std::hash::{Hash, Hasher};

use hashbrown::Equivalent;

/// Longest key held inside the table entry itself; longer keys go to the heap.
const INLINE_KEY: usize = 30;

/// A key's canonical bytes, inline when short: the lookup then compares bytes in the entry it
/// already loaded instead of chasing a pointer (a second cache miss per lookup).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyBytes {
    Inline { len: u8, bytes: [u8; INLINE_KEY] },
    Heap(Box<[u8]>),
}

impl KeyBytes {
    pub(crate) fn new(key: &[u8]) -> KeyBytes {
        if key.len() <= INLINE_KEY {
            let mut bytes = [0u8; INLINE_KEY];
            bytes[..key.len()].copy_from_slice(key);
            KeyBytes::Inline { len: key.len() as u8, bytes }
        } else {
            KeyBytes::Heap(key.into())
        }
    }

    /// Bytes held on the heap (a long key).
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            KeyBytes::Inline { .. } => 0,
            KeyBytes::Heap(b) => b.len(),
        }
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        match self {
            KeyBytes::Inline { len, bytes } => &bytes[..*len as usize],
            KeyBytes::Heap(b) => b,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredKey {
    pub(crate) window: u32,
    pub(crate) key: KeyBytes,
}

/// Borrowed form of [`StoredKey`] for lookups without allocating.
#[derive(PartialEq, Eq)]
pub(crate) struct KeyRef<'a> {
    pub(crate) window: u32,
    pub(crate) key: &'a [u8],
}

impl Hash for StoredKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        KeyRef { window: self.window, key: self.key.as_slice() }.hash(state)
    }
}

impl Hash for KeyRef<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u32(self.window);
        state.write(self.key);
    }
}

impl Equivalent<StoredKey> for KeyRef<'_> {
    fn equivalent(&self, stored: &StoredKey) -> bool {
        self.window == stored.window && self.key == stored.key.as_slice()
    }
}

impl Hash for KeyBytes {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write(self.as_slice())
    }
}

/// Borrowed form of [`KeyBytes`] for lookups without allocating.
#[derive(PartialEq, Eq)]
pub(crate) struct BytesRef<'a>(pub(crate) &'a [u8]);

impl Hash for BytesRef<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write(self.0)
    }
}

impl Equivalent<KeyBytes> for BytesRef<'_> {
    fn equivalent(&self, stored: &KeyBytes) -> bool {
        self.0 == stored.as_slice()
    }
}
