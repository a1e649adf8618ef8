//! The pipeline: decode → plan → count → decide → record. The only module that knows every stage:
//! [`Engine`] evaluates one event (`engine.rs`; judging one rule in `judge.rs`), [`replay`] a
//! JSON-lines stream (`replay.rs`), [`backtest`] compares rule sets over one, and
//! [`crate::worker`] runs the Kafka worker around the same engine.

pub mod backtest;
mod engine;
pub mod inspect;
mod judge;
mod replay;
mod touched;
pub mod tuning;

pub use engine::{CounterChanges, CounterCounts, Engine, EvalCounts, RuleCounts};
pub use replay::{
    input_lane, read_line_bounded, replay, LineRead, ReplayError, ReplayOptions, ReplaySummary,
    DEFAULT_MAX_EVENT_BYTES,
};
pub use touched::Touched;
