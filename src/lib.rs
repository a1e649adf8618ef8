//! vigil: a risk-control stream processor. Events in, exact sliding-window rules, decisions out.
//!
//! # Layout
//!
//! Pure core (no I/O; no tokio, redis, rdkafka or moka — tested in microseconds):
//!
//! - [`event`]: JSON bytes → [`event::Event`], decoding only the fields the rules use
//!   (a [`event::Projection`]), with JSON-typed scalars and canonical keys; the event-time bounds
//!   ([`event::TimeBounds`]: future skew, watermark).
//! - [`decimal`]: exact decimals — numbers compared by the value their text writes, micro-unit
//!   sums, the shortest exact text.
//! - [`window`]: exact bucket math of the window semantics — bucket index, late events, the per-key
//!   [`window::WindowState`] for count, sum (micro-units, saturating) and distinct (bounded by
//!   `max_distinct`), and reading a window at an event's time without changing it.
//! - [`rules`]: the TOML rule language. `compile` validates files (counters, rules) and reports
//!   every error as `file:line:col: message`; `expr` parses, resolves and evaluates expressions in
//!   three-valued logic; `lists` holds `[[list]]` sets (strings, exact numbers, networks by prefix
//!   length); `plan` says which counters an event feeds (key bytes, delta), which rules judge it
//!   (each distinct `match` conjunct evaluated at most once per event) and their hold keys;
//!   `decide` turns hits into a [`rules::Decision`] and writes its JSON record from parts rendered
//!   once at load.
//!
//! Around it:
//!
//! - [`store`]: the [`store::CounterStore`] trait (named windows, opaque keys — it does not know
//!   rules), the in-process [`store::MemoryStore`] (drops a key only once the watermark passed
//!   it; one entry per key holds every counter's window over it; holds kept exactly), and
//!   [`store::RedisStore`]: windows in Redis hashes updated by `lua/apply_window.lua`, holds as keys
//!   of their own raised by `lua/hold.lua` (written behind, re-read after a flush interval), a
//!   local merged view, batched write-behind on a flusher thread, reads on a reader thread the
//!   counting path waits on with a deadline, a circuit breaker that counts locally while Redis is
//!   away, an epoch key that reveals a Redis that lost its data, and per-key recorded input
//!   offsets so a re-read input is counted once. [`store::JournalWriter`]: each partition's
//!   decision journal (`lua/journal.lua`), written before records go out, fenced per owner; a
//!   batch's counts are sent only once it is journaled, and taken back if its write is fenced.
//! - [`clock`]: the injected wall clock (the future bound).
//! - [`rule_files`]: reads rule files and directories from disk.
//! - [`pipeline`]: the only module that knows every stage; [`pipeline::Engine`] runs
//!   decode → plan → count → decide for one event, [`pipeline::replay`] for a JSON-lines stream.
//! - [`config`]: the `vigil run` configuration: TOML over embedded defaults, `VIGIL_*` overrides.
//! - [`source`]: the Kafka consumer's settings, message decoding with dead-letter reasons, and
//!   per-partition offset [`source::Progress`] (what may be committed).
//! - [`sink`]: the idempotent producer of decisions and dead letters; deliveries report back to
//!   the partition's progress.
//! - [`pipeline::worker`]: `vigil run` — consumer loop, one ordered loop per partition over a
//!   shared engine, committer, rule watcher, rebalance and shutdown handling.
//! - [`telemetry`]: the one [`telemetry::Metrics`] struct, `/metrics` `/healthz` `/readyz`, logs.
//! - [`shutdown`]: the shutdown signal every loop waits on.
//! - [`workload`]: deterministic synthetic events for benchmarks and tests.
//! - [`fuzzing`]: the bodies of the fuzz targets (`fuzz/`) and of their bounded variants in the
//!   test suite: arbitrary bytes into event decoding, rule and expression compiling, judging, and
//!   Redis reply decoding.
//! - [`kafka_bench`]: `vigil bench --kafka`, one worker end to end on a real broker.
//! - [`redis_bench`]: `vigil bench --redis`, the Redis store against per-event scripts.
//! - `app` / `main`: the command line (`check`, `replay`, `run`, `gen`, `bench`), the only users
//!   of `anyhow`.
//!
//! # Data flow
//!
//! ```text
//! JSON line ─► event::decode ─► Engine::admit (future bound) ─► watermark of the input lane
//!           ─► count: per counter in file order, rules::plan (match? key bytes, delta)
//!              ─► store.apply (window value or late; degraded while Redis is away)
//!           ─► judge: per rule in file order, scope (`match`), then `when` — counters the event
//!              did not feed are read (store.read, no state change) on first reference
//!           ─► rules::decide (allow override, severity, on_store_error) ─► decision record
//!
//! vigil run:  consumer poll ─► partition loop (ordered) ─► the same engine, under one lock
//!             ─► journal the batch (records, watermark; fenced) ─► sink (decision / dead
//!                letter, ticket → source::Progress)
//!             committer: store write-behind ─► durable mark ─► offsets stored at batch ends
//!                        ─► committed ─► journal trimmed
//! ```

pub mod clock;
pub mod decimal;
pub mod config;
pub mod event;
#[cfg(feature = "harness")]
pub mod harness;
pub mod pipeline;
pub mod rule_files;
pub mod rules;
pub mod shutdown;
pub mod sink;
pub mod source;
pub mod store;
pub mod telemetry;
pub mod window;
pub mod worker;
