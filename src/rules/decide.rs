//! Decide: hits → a [`Decision`] (its record is written by `record`). Pure.

use smallvec::SmallVec;

use super::model::{Action, Mode};
use super::set::RuleSet;
use crate::decimal::Decimal;
use crate::window::{Aggregate, LastValue};

/// Why a rule fired, when the record says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Its condition held.
    When,
    /// Its hold key is held (the rule fired for it by its condition less than `hold` ago).
    Held,
    /// The shared counter store was unavailable and the rule's `on_store_error` is `block`.
    StoreUnavailable,
    /// Part of the state the rule reads was dropped at the in-process bound: its value is only
    /// a lower bound (or its hold unknown), and `on_store_error = "block"` fires.
    StateDropped,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::When => "when",
            Reason::Held => "held",
            Reason::StoreUnavailable => "store_unavailable",
            Reason::StateDropped => "state_dropped",
        }
    }
}

/// One rule that fired.
#[derive(Debug, Clone, PartialEq)]
pub struct Hit {
    /// Index into [`RuleSet::rules`].
    pub rule: usize,
    /// The mode it fired in: the rule's, or shadow outside its rollout.
    pub mode: Mode,
    /// A v1-form rule: its counter's value (raw: a count, micro-units or a distinct count).
    pub value: Option<i64>,
    /// Set when the record names a reason.
    pub reason: Option<Reason>,
    /// Its counters were counted locally because the shared store was unavailable.
    pub degraded: bool,
    /// A rule in the new form: each counter its `when` refers to whose value is known, in order
    /// of first reference, as (counter index, raw value).
    pub counters: SmallVec<[(usize, i64); 2]>,
    /// A rule with a hold: until when its hold key is held (`None`: the key cannot be formed).
    pub held_until: Option<i64>,
    /// The values of the `last` counters in `counters` (their raw value is a time).
    pub values: Vec<(usize, LastValue)>,
}

/// A counter's raw value (count, micro-units, distinct count) as the exact decimal it means.
pub fn counter_value(aggregate: Aggregate, raw: i64) -> Decimal {
    match aggregate {
        Aggregate::Sum | Aggregate::Max | Aggregate::Min => Decimal::from_micros(raw),
        // A `last` counter's raw value is its event's time (its value travels in `Hit::values`).
        Aggregate::Count | Aggregate::Distinct | Aggregate::Last => Decimal::from_i64(raw),
    }
}

/// The outcome for one event.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Decision {
    /// Every hit, in rule-file order, shadow ones included.
    pub hits: Vec<Hit>,
    /// The event's score in micro-units (the sum of the enforce-mode hits' scores), when the
    /// rule set has a scoring rule.
    pub score: Option<i64>,
}

impl Decision {
    /// `Allow` if an enforce-mode allow rule hit (allow rules override); else the most severe
    /// enforce-mode action; `None` (serialised as `allow`) when only shadow rules hit or
    /// nothing did.
    pub fn action(&self, rules: &RuleSet) -> Option<Action> {
        let enforced = self
            .hits
            .iter()
            .filter(|h| h.mode == Mode::Enforce)
            .map(|h| rules.rule(h.rule).action);
        let mut most = None;
        for action in enforced {
            match action {
                Action::Allow => return Some(Action::Allow),
                // A score decides nothing by itself.
                Action::Score => {}
                action => most = most.max(Some(action)),
            }
        }
        most
    }

    pub fn is_empty(&self) -> bool {
        self.hits.is_empty()
    }
}
