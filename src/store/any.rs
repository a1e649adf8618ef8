//! The store a command was configured with, in process or Redis, behind one type.

use super::counter_store::{
    BatchSeal, CounterStore, Deferred, HoldSpace, InputPosition, Inspected, Observed, Planned,
    StateStats, StoreError, WindowId,
};
use super::memory::MemoryStore;
use super::redis::RedisStore;
use crate::window::{Delta, WindowSpec};

/// The store `vigil run` was configured with. One per engine, so the in-process variant's few
/// hundred bytes are kept inline: its every call is on the counting path.
#[allow(clippy::large_enum_variant)]
pub enum AnyStore {
    Memory(MemoryStore),
    Redis(Box<RedisStore>),
}

macro_rules! delegate {
    ($self:ident, $store:ident => $call:expr) => {
        match $self {
            AnyStore::Memory($store) => $call,
            AnyStore::Redis($store) => $call,
        }
    };
}

impl CounterStore for AnyStore {
    fn open_window(&mut self, name: &str, spec: WindowSpec) -> WindowId {
        delegate!(self, s => s.open_window(name, spec))
    }
    fn apply(
        &mut self,
        window: WindowId,
        key: &[u8],
        ts_ms: i64,
        delta: Delta,
    ) -> Result<Observed, StoreError> {
        delegate!(self, s => s.apply(window, key, ts_ms, delta))
    }
    fn read(&mut self, window: WindowId, key: &[u8], ts_ms: i64) -> Result<Observed, StoreError> {
        delegate!(self, s => s.read(window, key, ts_ms))
    }
    fn apply_last(
        &mut self,
        window: WindowId,
        key: &[u8],
        ts_ms: i64,
        value: crate::window::LastValue,
    ) -> Result<(Observed, Option<crate::window::LastValue>), StoreError> {
        delegate!(self, s => s.apply_last(window, key, ts_ms, value))
    }
    fn read_last(
        &mut self,
        window: WindowId,
        key: &[u8],
        ts_ms: i64,
    ) -> Result<(Observed, Option<crate::window::LastValue>), StoreError> {
        delegate!(self, s => s.read_last(window, key, ts_ms))
    }
    fn open_holds(&mut self, name: &str, ttl_ms: i64) -> HoldSpace {
        delegate!(self, s => s.open_holds(name, ttl_ms))
    }
    fn held_until(&mut self, space: HoldSpace, key: &[u8]) -> Result<Option<i64>, StoreError> {
        delegate!(self, s => s.held_until(space, key))
    }
    fn hold_dropped(&mut self, space: HoldSpace, key: &[u8], ts_ms: i64) -> bool {
        delegate!(self, s => s.hold_dropped(space, key, ts_ms))
    }
    fn hold_unknown(&mut self, space: HoldSpace, key: &[u8]) -> bool {
        delegate!(self, s => s.hold_unknown(space, key))
    }
    fn extend_hold(
        &mut self,
        space: HoldSpace,
        key: &[u8],
        until_ms: i64,
    ) -> Result<i64, StoreError> {
        delegate!(self, s => s.extend_hold(space, key, until_ms))
    }
    fn inspect(&mut self, window: WindowId, key: &[u8]) -> Result<Inspected, StoreError> {
        delegate!(self, s => s.inspect(window, key))
    }
    fn release_hold(&mut self, space: HoldSpace, key: &[u8]) -> Result<Option<i64>, StoreError> {
        delegate!(self, s => s.release_hold(space, key))
    }
    fn prefetch_holds(&mut self, keys: &[(HoldSpace, Vec<u8>)]) -> Result<(), StoreError> {
        delegate!(self, s => s.prefetch_holds(keys))
    }
    fn fetch_ahead(&self, window: WindowId, key: &[u8]) {
        delegate!(self, s => s.fetch_ahead(window, key))
    }
    fn set_origin(&mut self, origin: Option<InputPosition>) {
        delegate!(self, s => s.set_origin(origin))
    }
    fn set_shared(&mut self, shared: bool) {
        delegate!(self, s => s.set_shared(shared))
    }
    fn count_ahead(&mut self, planned: &[Planned]) -> Result<(), StoreError> {
        delegate!(self, s => s.count_ahead(planned))
    }
    fn set_horizon(&mut self, horizon_ms: i64) {
        delegate!(self, s => s.set_horizon(horizon_ms))
    }
    fn prefetches(&self) -> bool {
        delegate!(self, s => s.prefetches())
    }
    fn prefetch(&mut self, keys: &[(WindowId, Vec<u8>)]) -> Result<(), StoreError> {
        delegate!(self, s => s.prefetch(keys))
    }
    fn read_ahead(&mut self, keys: &[(WindowId, Vec<u8>)]) {
        delegate!(self, s => s.read_ahead(keys))
    }
    fn read_holds_ahead(&mut self, keys: &[(HoldSpace, Vec<u8>)]) {
        delegate!(self, s => s.read_holds_ahead(keys))
    }
    fn flush(&mut self) -> Result<(), StoreError> {
        delegate!(self, s => s.flush())
    }
    fn live_keys(&self) -> usize {
        delegate!(self, s => s.live_keys())
    }
    fn state_stats(&self) -> StateStats {
        delegate!(self, s => s.state_stats())
    }
    fn counted_mark(&self) -> u64 {
        delegate!(self, s => s.counted_mark())
    }
    fn judged_as_held(&self) -> u64 {
        delegate!(self, s => s.judged_as_held())
    }
    fn durable_mark(&self) -> u64 {
        delegate!(self, s => s.durable_mark())
    }
    fn tick(&mut self) -> Result<(), StoreError> {
        delegate!(self, s => s.tick())
    }
    fn saturated(&self) -> bool {
        delegate!(self, s => s.saturated())
    }
    fn begin_batch(&mut self, lane: u64, since: i64) {
        delegate!(self, s => s.begin_batch(lane, since))
    }
    fn seal_batch(&mut self) -> BatchSeal {
        delegate!(self, s => s.seal_batch())
    }
    fn seal_batch_deferring(&mut self) -> (BatchSeal, Deferred) {
        delegate!(self, s => s.seal_batch_deferring())
    }
    fn discard_batch(&mut self, lane: u64, since: i64) -> Result<(), StoreError> {
        delegate!(self, s => s.discard_batch(lane, since))
    }
    fn forget_cached(&mut self) {
        delegate!(self, s => s.forget_cached())
    }
}
