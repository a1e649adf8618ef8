//! Key identities: exact (window, key) identities for local state (canonical key bytes, never
//! digests, so two different keys can never share a counter), and how keys are named in Redis
//! (digests in hex, so user bytes never reach Redis raw).

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
            KeyBytes::Inline {
                len: key.len() as u8,
                bytes,
            }
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
        KeyRef {
            window: self.window,
            key: self.key.as_slice(),
        }
        .hash(state)
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

/// Appends `bytes` as lowercase hex: how digests appear in Redis key names.
pub(crate) fn push_hex(out: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    // A run of ASCII digits at a time: pushing chars one by one costs more than the hashing
    // that made them (a Redis key's name is built for every key read or flushed).
    let mut text = [0u8; 64];
    for chunk in bytes.chunks(text.len() / 2) {
        for (pair, &byte) in text.chunks_exact_mut(2).zip(chunk) {
            pair[0] = HEX[usize::from(byte >> 4)];
            pair[1] = HEX[usize::from(byte & 15)];
        }
        if let Ok(text) = std::str::from_utf8(&text[..chunk.len() * 2]) {
            out.push_str(text);
        }
    }
}

/// `<prefix><name>:<first 16 bytes of digest in hex>`: how store keys are named in Redis.
pub(crate) fn key_name(prefix: &str, name: &str, digest: &blake3::Hash) -> String {
    let mut key_name = String::with_capacity(prefix.len() + name.len() + 33);
    key_name.push_str(prefix);
    key_name.push_str(name);
    key_name.push(':');
    push_hex(&mut key_name, &digest.as_bytes()[..16]);
    key_name
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_is_lowercase_two_digits_per_byte_at_any_length() {
        let bytes: Vec<u8> = (0..=255u8).collect();
        let mut text = String::from("x:");
        push_hex(&mut text, &bytes);
        let expected: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(text, format!("x:{expected}"));
        let mut empty = String::new();
        push_hex(&mut empty, &[]);
        assert_eq!(empty, "");
    }

    #[test]
    fn a_key_name_is_its_prefix_name_and_the_digest_s_first_sixteen_bytes() {
        let digest = blake3::hash(b"card:4111");
        let name = key_name("vg:", "fails", &digest);
        assert_eq!(name, format!("vg:fails:{}", &digest.to_hex()[..32]));
    }
}
