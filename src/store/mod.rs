//! Counter stores: where sliding-window state lives (DESIGN §6). A store knows named windows and
//! opaque keys, never rules: the pipeline maps each rule to a window and each event to a key.

mod keys;
pub mod memory;
pub mod redis;
mod scripts;

pub use memory::MemoryStore;
pub use redis::{RedisStore, RedisStoreConfig};

use crate::window::{Applied, Delta, WindowSpec};

/// Handle of a window opened on a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WindowId(pub u32);

/// The named windows a store has opened: the same name and spec give the same [`WindowId`].
#[derive(Debug, Default)]
pub(crate) struct Windows(Vec<(String, WindowSpec)>);

impl Windows {
    pub(crate) fn open(&mut self, name: &str, spec: WindowSpec) -> WindowId {
        let position = self.0.iter().position(|(n, s)| n == name && *s == spec).unwrap_or_else(|| {
            self.0.push((name.to_owned(), spec));
            self.0.len() - 1
        });
        WindowId(position as u32)
    }

    pub(crate) fn spec(&self, window: u32) -> WindowSpec {
        self.0[window as usize].1
    }

    pub(crate) fn name(&self, window: u32) -> &str {
        &self.0[window as usize].0
    }
}

/// A store failure.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The backing service could not be reached or refused the operation.
    #[error("counter store unavailable: {0}")]
    Unavailable(String),
    /// The backing service answered something this version does not understand.
    #[error("counter store protocol error: {0}")]
    Protocol(String),
}

impl StoreError {
    /// Low-cardinality code for metrics.
    pub fn code(&self) -> &'static str {
        match self {
            StoreError::Unavailable(_) => "unavailable",
            StoreError::Protocol(_) => "protocol",
        }
    }
}

/// Sliding-window counters keyed by (window, canonical key bytes).
pub trait CounterStore {
    /// Opens (or finds again) the window called `name` with `spec`. The same name and spec give
    /// the same handle, so counters survive a rule reload that leaves a rule unchanged.
    fn open_window(&mut self, name: &str, spec: WindowSpec) -> WindowId;

    /// Applies one observation at event time `ts_ms` to `key` in `window`, returning the key's
    /// window value (DESIGN §3) or [`Applied::Late`].
    fn apply(&mut self, window: WindowId, key: &[u8], ts_ms: i64, delta: Delta) -> Result<Applied, StoreError>;

    /// Whether [`CounterStore::prefetch`] does anything: callers skip collecting keys otherwise.
    fn prefetches(&self) -> bool {
        false
    }

    /// Loads the windows of `keys` that are not held locally, in as few round trips as
    /// possible, ahead of the `apply` calls that will need them.
    fn prefetch(&mut self, _keys: &[(WindowId, Vec<u8>)]) -> Result<(), StoreError> {
        Ok(())
    }

    /// Makes every applied observation durable in the backing service (no-op in memory).
    fn flush(&mut self) -> Result<(), StoreError>;

    /// Number of (window, key) states currently held in this process.
    fn live_keys(&self) -> usize;
}
