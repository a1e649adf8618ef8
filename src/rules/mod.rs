//! Rules: the TOML rule language — counters (what to count), rules (what to judge) and
//! expressions — compiled into a [`RuleSet`] that plans what each event counts, and decides on
//! the values. Pure: no I/O (the caller reads rule files).
//!
//! - `model`: the validated counters and rules. `compile`: rule files → model, every error at
//!   `file:line:col`. `expr`: the expression language (parse, resolve, three-valued evaluation).
//!   `plan`: per event, which counters it feeds, under which key, with which delta; which rules
//!   judge it. `set`: the [`RuleSet`] those resolve into at load. `decide`: hits → the decision.
//!   `record`: the decision's JSON record (`record_parts`: its constant parts, rendered once;
//!   `json`: JSON text escaped as serde_json does). `describe`: the descriptions `vigil check`
//!   prints; `lint`: what a sample of events says about a rule set (`vigil check --events`).

pub mod compile;
pub mod decide;
pub mod describe;
pub mod expr;
mod json;
pub mod lint;
pub mod lists;
pub mod model;
pub mod plan;
pub mod record;
mod record_parts;
mod set;

pub use compile::Diagnostic;
pub use decide::{Decision, Hit, Reason};
pub use model::{Action, Counter, FileLocation, Form, Mode, OnStoreError, Rule, Scope};
pub use plan::{Plan, ScopeMemo, SkipReason};
pub use record::EventSource;
pub use set::{RuleErrors, RuleSet};
