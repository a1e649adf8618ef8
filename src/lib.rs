//! vigil: a risk-control stream processor. Events in, exact sliding-window rules, decisions out.
//!
//! # Layout
//!
//! Pure core (no I/O; no tokio, redis, rdkafka or moka — tested in microseconds):
//!
//! - [`event`]: JSON bytes → [`event::Event`], decoding only the fields the rules use
//!   (a [`event::Projection`]; a one-pass scanner for the usual line, `serde_json` for the
//!   rest), with JSON-typed scalars and canonical keys; the event-time bounds
//!   ([`event::TimeBounds`]: future skew, watermark).
//! - [`decimal`]: exact decimals — numbers compared by the value their text writes, micro-unit
//!   sums, the shortest exact text.
//! - [`window`]: exact bucket math of the window semantics — bucket index, late events, the per-key
//!   [`window::WindowState`] for count, sum (micro-units, saturating), distinct (bounded by
//!   `max_distinct`), max / min (each bucket's extreme) and last (the event with the greatest
//!   time), and reading a window at an event's time without changing it.
//! - [`rules`]: the TOML rule language, compiled into a [`rules::RuleSet`].
//!   - `rules::compile`: rule files → validated model, every error as `file:line:col: message`
//!     (`positions`: line index and diagnostics; `fields`: typed value readers; `tables`: one
//!     reader per `[[counter]]` / `[[rule]]` / `[[list]]`; `resolve`: ids, names and expressions
//!     across tables and files).
//!   - `rules::expr`: the expression language — `lex`, `parse` (one precedence table), `resolve`
//!     (names → projection slots, counters, lists), `eval` (three-valued, no allocation), `deep`
//!     (`==` on arrays and objects, one pass over their JSON text).
//!   - `rules::lists`: `[[list]]` sets (strings, exact numbers, networks by prefix length) and
//!     maps (key → JSON scalar).
//!   - `rules::model`: the validated counters and rules. `rules::plan`: which counters an event
//!     feeds (key bytes from paths or expressions, delta), which rules judge it (each distinct
//!     `match` conjunct evaluated at most once per event), hold, rollout and entity keys.
//!     `rules::decide`: hits → a [`rules::Decision`] (the action; the pipeline's judge orders
//!     rollouts, `final` suppression, the score and holds).
//!     `rules::record`: its JSON record, from parts rendered once at load. `rules::describe`:
//!     what `vigil check` says of each counter and rule; `rules::lint`: what a sample of events
//!     says of them (`vigil check --events`).
//!
//! Around it:
//!
//! - [`store`]: the [`store::CounterStore`] interface (named windows, opaque keys — it does not know
//!   rules; `counter_store.rs`), the in-process [`store::MemoryStore`] (drops a key only once the
//!   watermark passed it; one entry per key holds every counter's window over it; bounded; its
//!   `key_table` lets the engine prefetch an event's keys before counting them), and
//!   [`store::RedisStore`] (`store/redis/`, split by role: `view` the merged per-key views and
//!   where keys live (counters over the same dimensions share one hash per key; the windows a
//!   worker's batch read reach the moka cache after its handover, without the engine; windows of
//!   keys Redis holds nothing for are kept beside moka, in a table of their own),
//!   `holds` hold views, `epochs` data-loss detection, `failover` what no replica confirmed,
//!   written again after a failover, `reader` the reader thread, `flusher` the write-behind,
//!   `slices` the write-behind's bookkeeping spread over ticks (building a flush, taking in its
//!   replies, moving windows into the cache), so that no tick holds the engine long,
//!   `ahead` a batch's observations on keys other workers count too, applied in Redis before
//!   the batch is judged, `early` the windows a batch lacks, read before it takes the engine
//!   (in replay: while the batch before it is judged),
//!   `config` its settings and stats) over `link` (connections: one server, Sentinel, cluster;
//!   retries, replica confirmations), `codec` (windows as Redis holds them), `scripts` (`lua/`),
//!   `keys` (key identities and names). [`store::JournalWriter`]: each partition's decision
//!   journal, written before records go out, fenced per owner. [`store::board`]: where each
//!   partition of a group stands in event time, shared by its workers. [`store::AnyStore`]: the
//!   store a command was configured with.
//! - [`clock`]: the injected clocks (wall clock for the future bound, monotonic for freshness).
//! - [`rule_files`]: reads rule files and directories from disk.
//! - [`pipeline`]: the only module that knows every stage. `engine`: [`pipeline::Engine`] runs
//!   decode → plan → count → decide for one event, with the watermark of each input lane;
//!   `judge`: one rule over one event; `touched`: the windows a batch touches, each listed
//!   once, for the store's reads ahead; `replay`: [`pipeline::replay`] over a JSON-lines stream;
//!   [`pipeline::backtest`]: the per-rule report, with [`pipeline::tuning`] (value percentiles,
//!   top keys, labels, limit sweeps); [`pipeline::inspect`]: one key as the engine sees it (a
//!   counter's window, a rule's hold and counters) and ending a hold — `vigil inspect`,
//!   `vigil hold release` and the worker's `/v1` endpoints.
//! - [`config`]: the `vigil run` configuration: TOML over embedded defaults (every default in
//!   `config_defaults.toml`), `VIGIL_*` overrides; [`config::StoreSetup`] opens the store and
//!   journal for `replay`, `run` and the benchmarks alike.
//! - [`source`]: the Kafka consumer's settings, message decoding with dead-letter reasons, and
//!   per-partition offset [`source::Progress`] (what may be committed).
//! - [`sink`]: the idempotent producer of decisions and dead letters; deliveries report back to
//!   the partition's progress. `sink::audit`: one audit record (a hold released), waited for.
//! - [`broker`]: the client failures retrying cannot fix (a refused credential, an untrusted
//!   certificate), which stop the worker instead of leaving it retrying forever.
//! - [`worker`]: `vigil run`, one file per thread — `poll` (the consumer loop), `context`
//!   (rdkafka callbacks, rebalances), `partition` (one ordered loop per partition over the shared
//!   engine; it waits while more than `input.max_partition_skew` ahead of the slowest partition),
//!   `committer` (write-behind, durable marks, commits, metric export), `watcher` (rule hot
//!   reload), `alignment` (partitions in step: positions, the board exchange), `lookups` (the
//!   `/v1` lookups and hold releases, on the HTTP runtime); `shared` holds what they share.
//! - [`telemetry`]: the one [`telemetry::Metrics`] struct, `/metrics` `/healthz` `/readyz` (the
//!   worker merges its `/v1` routes in), logs.
//! - [`shutdown`]: the shutdown signal every loop waits on.
//! - `harness` (cargo feature `harness`, on by default; off the product path): `workload`
//!   (deterministic synthetic events), `fuzzing` (the fuzz targets' bodies, also run bounded in
//!   the suite), `replay_bench`, `redis_bench`, `kafka_bench` (`vigil bench`), `divergence`
//!   (decisions against a single-order run).
//! - The binary: `main.rs` (clap) and `cli/`, one file per command (`check`, `replay`,
//!   `backtest`, `inspect` with `hold release`, `run`, `gen`, `bench`) — the only users of
//!   `anyhow`.
//!
//! # Data flow
//!
//! ```text
//! JSON line ─► event::decode ─► Engine::admit (future bound) ─► watermark of the input lane
//!           ─► count: per counter in file order, rules::plan (match? key bytes, delta)
//!              ─► store.apply (window value or late; degraded while Redis is away)
//!           ─► judge: per rule in file order, scope (`match`), then `when` — counters the event
//!              did not feed are read (store.read, no state change) on first reference
//!           ─► rules::decide (allow override, severity, on_store_error) ─► rules::record
//!
//! vigil run:  consumer poll ─► partition loop (ordered, batches of at most 1 024 messages;
//!             waits while ahead of the slowest partition of the group) ─► decode (with the
//!             engine free), list the windows the batch lacks, read and decode them from Redis
//!             with the engine free (store::RedisStore::plan_early_reads, EarlyReads::decode)
//!             ─► the same engine, under one lock: while other workers
//!             count too, the batch's observations on keys spanning partitions are counted
//!             ahead (Engine::plan_counts ─► store.count_ahead), then count and judge as above,
//!             seal the batch (store.seal_batch: its counts held back from write-behind)
//!             ─► with the engine free: journal the batch (records, watermark; fenced: the
//!                batch is taken back), writes of several partitions in one round trip
//!             ─► the seal released ─► sink (decision / dead letter, ticket → source::Progress)
//!             committer: store write-behind ─► durable mark ─► offsets stored at batch ends
//!                        ─► committed ─► journal trimmed
//! ```

pub mod broker;
pub mod clock;
pub mod config;
pub mod decimal;
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
