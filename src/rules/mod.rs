//! Rules: the TOML rule language, compiled into a [`RuleSet`] that plans which window each event
//! touches and decides on the resulting values. Pure: no I/O (the caller reads rule files).

pub mod compile;
pub mod decide;
pub mod model;
pub mod plan;

pub use compile::{check_ids, compile_file, Diagnostic};
pub use decide::{Decision, Hit, Reason, Source};
pub use model::{Action, Mode, OnStoreError, Origin, Rule};
pub use plan::{Plan, SkipReason};

use crate::event::Projection;

/// Every error in a set of rule files, each as `file:line:col: message`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
pub struct RuleErrors(pub Vec<Diagnostic>);

impl RuleErrors {
    /// Low-cardinality code for metrics.
    pub fn code(&self) -> &'static str {
        "invalid_rules"
    }
}

/// Validated rules, ready to evaluate, in rule-file order.
#[derive(Debug, Clone)]
pub struct RuleSet {
    rules: Vec<Rule>,
    /// Enabled rules with their projection slots, in rule-file order.
    active: Vec<plan::CompiledRule>,
    projection: Projection,
}

impl RuleSet {
    /// Compiles `(file name, text)` pairs in the order given. Every error of every file is
    /// reported; no rule set is built if there is any.
    pub fn from_sources<'a>(sources: impl IntoIterator<Item = (&'a str, &'a str)>) -> Result<RuleSet, RuleErrors> {
        let mut rules = Vec::new();
        let mut diagnostics = Vec::new();
        for (name, text) in sources {
            let (file_rules, file_diags) = compile_file(name, text);
            rules.extend(file_rules);
            diagnostics.extend(file_diags);
        }
        diagnostics.extend(check_ids(&rules));
        if !diagnostics.is_empty() {
            return Err(RuleErrors(diagnostics));
        }
        Ok(RuleSet::new(rules))
    }

    /// A set without rules (nothing matches).
    pub fn empty() -> RuleSet {
        RuleSet::new(Vec::new())
    }

    /// Builds a set from rules that are already valid and uniquely named.
    pub fn new(rules: Vec<Rule>) -> RuleSet {
        let mut projection = Projection::new();
        let active = rules
            .iter()
            .enumerate()
            .filter(|(_, r)| r.enabled)
            .map(|(index, rule)| plan::CompiledRule::new(index, rule, &mut projection))
            .collect();
        RuleSet { rules, active, projection }
    }

    /// All rules, disabled ones included, in rule-file order.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    pub fn rule(&self, index: usize) -> &Rule {
        &self.rules[index]
    }

    /// The paths events must be decoded for.
    pub fn projection(&self) -> &Projection {
        &self.projection
    }

    /// Indices (into [`RuleSet::rules`]) of the enabled rules, in order.
    pub fn active(&self) -> impl ExactSizeIterator<Item = usize> + '_ {
        self.active.iter().map(|c| c.index)
    }
}
