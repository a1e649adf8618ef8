//! Redis Lua scripts, one per file under `lua/`, compiled into the binary. Invoked by SHA
//! (EVALSHA); a NOSCRIPT reply (after a Redis restart or `SCRIPT FLUSH`) makes the caller load the
//! script and retry.

use std::sync::LazyLock;

/// Applies a key's pending deltas, refuses late ones, prunes, refreshes the TTL and returns the
/// key's window (see the header of `lua/apply_window.lua` for the protocol).
pub static APPLY_WINDOW: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("../../lua/apply_window.lua")));
