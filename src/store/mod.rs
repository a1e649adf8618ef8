//! Counter stores: where sliding-window state lives (see [RELIABILITY.md](RELIABILITY.md)). A store knows named windows and
//! opaque keys, never rules: the pipeline maps each rule to a window and each event to a key.
//!
//! - `memory`: the in-process store, over `key_table` (its keys, in slots an event's keys can be
//!   prefetched from before they are counted). `redis`: the Redis store (merged views, write-behind,
//!   exactly-once offsets, circuit breaker, data-loss detection). `link`: its connections (single
//!   server or cluster, timeouts, retries). `codec`: windows as Redis holds them and as flushes
//!   write them. `scripts`: the Lua script and the calls to it. `journal`: the decision journal
//!   that makes duplicates after a crash identical. `board`: where each partition of a group
//!   stands in event time, shared by its workers. `replay_lane`: one `replay --redis` of an input
//!   at a time, and how far a finished one got. `keys`: exact key identities, and how keys
//!   are named in Redis.

pub mod any;
pub mod board;
mod codec;
mod counter_store;
pub mod journal;
mod key_table;
mod keys;
mod link;
pub mod memory;
pub mod redis;
pub mod replay_lane;
mod scripts;

pub use any::AnyStore;
pub use codec::decode_untrusted;
pub use counter_store::{
    BatchSeal, CounterStore, Deferred, HoldSpace, InputPosition, Inspected, Observed, Planned,
    StateStats, StoreError, WindowId,
};
pub use journal::{Journal, JournalError, JournalReply, JournalWrite, JournalWriter};
/// Lower-case hex, as Redis key names write digests (the Redis benchmark names its keys alike).
#[cfg(feature = "harness")]
pub(crate) use keys::push_hex;
pub use memory::{MemoryStore, DEFAULT_MAX_KEYS};
pub use redis::{
    EarlyHoldReads, EarlyReader, EarlyReads, EarlyReplies, FlushSample, PendingRead, RedisStats,
    RedisStore, RedisStoreConfig,
};
