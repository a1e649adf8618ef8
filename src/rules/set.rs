//! The rule set: validated counters, rules and lists, with what planning needs resolved once at
//! load (projection slots, `match` conjunct slots, the constant parts of its records), and the
//! version that names it.

use std::sync::Arc;

use super::compile::{self, Diagnostic};
use super::lists;
use super::model::{Counter, Rule};
use super::plan::{self, Plan, ScopeMemo};
use super::record_parts::RecordParts;
use crate::event::Event;
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

/// Validated counters and rules, ready to evaluate, in rule-file order.
#[derive(Debug, Clone)]
pub struct RuleSet {
    counters: Vec<Counter>,
    rules: Vec<Rule>,
    /// Every list by id (shared with the expressions that test them).
    lists: Vec<(String, std::sync::Arc<lists::ListSet>)>,
    /// The list files read, by path.
    list_files: Vec<String>,
    /// Enabled counters with their projection slots, in order: a counter's active position.
    active_counters: Vec<plan::PlannedCounter>,
    /// Active position of each counter (`None`: disabled).
    counter_position: Vec<Option<usize>>,
    /// Enabled rules with their projection slots, in order.
    active_rules: Vec<plan::PlannedRule>,
    /// Per active counter: whether an enabled rule's `when` reads it.
    read: Vec<bool>,
    /// Per rule (by index): whom its hits are about (empty: no one).
    entities: Vec<plan::KeyPlan>,
    /// Whether a rule has a `score` (records then carry the event's score).
    scoring: bool,
    /// Distinct `match` expressions (slots of a [`ScopeMemo`]).
    scope_slots: usize,
    /// Shared, so that a worker's partitions decode with it without holding the engine.
    projection: Arc<Projection>,
    version: String,
    /// The constant parts of its decision records, rendered once.
    record_parts: RecordParts,
    warnings: Vec<Diagnostic>,
}

impl RuleSet {
    /// Compiles `(file name, text)` pairs in the order given. Every error of every file is
    /// reported; no rule set is built if there is any.
    pub fn from_sources<'a>(
        sources: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<RuleSet, RuleErrors> {
        RuleSet::from_sources_with_files(sources, &compile::no_files)
    }

    /// [`RuleSet::from_sources`], reading list files with `read` (paths relative to their rule
    /// file's directory).
    pub fn from_sources_with_files<'a>(
        sources: impl IntoIterator<Item = (&'a str, &'a str)>,
        read: compile::ReadFile<'_>,
    ) -> Result<RuleSet, RuleErrors> {
        let sources: Vec<(&str, &str)> = sources.into_iter().collect();
        let compiled = compile::compile_sources(&sources, read).map_err(RuleErrors)?;
        let mut hasher = blake3::Hasher::new();
        let list_files = compiled
            .list_files
            .iter()
            .map(|(n, t)| (n.as_str(), t.as_str()));
        for (name, text) in sources.iter().copied().chain(list_files) {
            // The file's own name, not where the directory happens to be.
            let name = name.rsplit(['/', '\\']).next().unwrap_or(name);
            hasher.update(&(name.len() as u64).to_le_bytes());
            hasher.update(name.as_bytes());
            hasher.update(&(text.len() as u64).to_le_bytes());
            hasher.update(text.as_bytes());
        }
        let version = hasher.finalize().to_hex()[..12].to_owned();
        Ok(RuleSet::build(compiled, version))
    }

    /// A set without counters or rules (nothing matches).
    pub fn empty() -> RuleSet {
        let compiled = compile::CompiledSet {
            counters: Vec::new(),
            rules: Vec::new(),
            lists: Vec::new(),
            list_files: Vec::new(),
            projection: Projection::new(),
            warnings: Vec::new(),
        };
        RuleSet::build(compiled, "000000000000".to_owned())
    }

    fn build(compiled: compile::CompiledSet, version: String) -> RuleSet {
        let compile::CompiledSet {
            counters,
            rules,
            lists,
            list_files,
            mut projection,
            warnings,
        } = compiled;
        let list_files = list_files.into_iter().map(|(name, _)| name).collect();
        let mut counter_position = vec![None; counters.len()];
        let mut active_counters = Vec::new();
        let mut slots = plan::ScopeSlots::default();
        for (index, counter) in counters.iter().enumerate() {
            if counter.enabled {
                counter_position[index] = Some(active_counters.len());
                active_counters.push(plan::PlannedCounter::new(
                    index,
                    counter,
                    &mut projection,
                    &mut slots,
                ));
            }
        }
        let active_rules = rules
            .iter()
            .enumerate()
            .filter(|(_, r)| r.enabled)
            .map(|(index, rule)| plan::PlannedRule::new(index, rule, &mut projection, &mut slots))
            .collect();
        let scope_slots = slots.len();
        let mut read = vec![false; active_counters.len()];
        for rule in rules.iter().filter(|r| r.enabled) {
            for &counter in rule.counters() {
                if let Some(position) = counter_position[counter] {
                    read[position] = true;
                }
            }
        }
        let record_parts = RecordParts::new(&rules, &counters, &version);
        let entities = rules
            .iter()
            .map(|rule| plan::KeyPlan::new(&rule.entity, &mut projection))
            .collect();
        let scoring = rules.iter().any(|r| r.enabled && r.score.is_some());
        RuleSet {
            entities,
            scoring,
            record_parts,
            counters,
            rules,
            lists,
            list_files,
            active_counters,
            counter_position,
            active_rules,
            read,
            scope_slots,
            projection: Arc::new(projection),
            version,
            warnings,
        }
    }

    /// All rules, disabled ones included, in rule-file order.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    pub fn rule(&self, index: usize) -> &Rule {
        &self.rules[index]
    }

    /// Every list, by id, with its size (for metrics and `vigil check`).
    pub fn lists(&self) -> impl Iterator<Item = (&str, &lists::ListSet)> + '_ {
        self.lists
            .iter()
            .map(|(id, set)| (id.as_str(), set.as_ref()))
    }

    /// The list files the rules read (paths as loaded), for the reload watcher.
    pub fn list_file_names(&self) -> &[String] {
        &self.list_files
    }

    /// All counters (those v1-form rules define included), disabled ones too.
    pub fn counters(&self) -> &[Counter] {
        &self.counters
    }

    pub fn counter(&self, index: usize) -> &Counter {
        &self.counters[index]
    }

    /// The paths events must be decoded for.
    pub fn projection(&self) -> &Projection {
        &self.projection
    }

    /// The projection, to decode with apart from this set (it does not change while the set is
    /// in force).
    pub fn shared_projection(&self) -> Arc<Projection> {
        Arc::clone(&self.projection)
    }

    /// Takes event time from `source` when decoding for this set.
    pub fn set_time_source(&mut self, source: &crate::event::TimeSource) {
        Arc::make_mut(&mut self.projection).set_time(source);
    }

    /// Indices (into [`RuleSet::rules`]) of the enabled rules, in order.
    pub fn active(&self) -> impl ExactSizeIterator<Item = usize> + '_ {
        self.active_rules.iter().map(|r| r.index)
    }

    /// Indices (into [`RuleSet::counters`]) of the enabled counters, by active position.
    pub fn active_counters(&self) -> impl ExactSizeIterator<Item = usize> + '_ {
        self.active_counters.iter().map(|c| c.index)
    }

    /// The active position of a counter (`None` if disabled).
    pub fn counter_position(&self, index: usize) -> Option<usize> {
        self.counter_position[index]
    }

    /// Whether a rule's `when` reads the counter at active `position`.
    pub fn is_read(&self, position: usize) -> bool {
        self.read[position]
    }

    /// A short hash of the rule files' names and contents: changes whenever a rule does.
    pub(crate) fn record_parts(&self) -> &RecordParts {
        &self.record_parts
    }

    pub fn version(&self) -> &str {
        &self.version
    }

    /// Likely mistakes found while loading (not errors: the set loaded).
    pub fn warnings(&self) -> &[Diagnostic] {
        &self.warnings
    }

    /// Plans the counter at active `position` for `event`, writing its canonical dimension key
    /// into `key` (cleared first) unless the result is [`Plan::NoMatch`] or a dimension skip.
    #[inline]
    pub fn plan(
        &self,
        position: usize,
        event: &Event<'_>,
        key: &mut Vec<u8>,
        memo: &mut ScopeMemo,
    ) -> Plan {
        self.active_counters[position].plan(event, key, memo)
    }

    /// Whether `event` touches the window of the counter at active `position` (its key written
    /// into `key`): what a store reading ahead lists. [`RuleSet::plan`] without the delta.
    #[inline]
    pub fn touches(
        &self,
        position: usize,
        event: &Event<'_>,
        key: &mut Vec<u8>,
        memo: &mut ScopeMemo,
    ) -> bool {
        self.active_counters[position].touches(event, key, memo, self.read[position])
    }

    /// Whether the key of the counter at active `position` for `event` includes `message_key`
    /// (the event's Kafka key) as one of its values: only that key's partition feeds it.
    #[inline]
    pub fn counter_follows_message_key(
        &self,
        position: usize,
        event: &Event<'_>,
        message_key: &[u8],
    ) -> bool {
        self.active_counters[position].follows_message_key(event, message_key)
    }

    /// The value a `last` counter at active `position` counts for `event` (`None`: its field
    /// is not a scalar it keeps).
    pub fn last_value(
        &self,
        position: usize,
        event: &Event<'_>,
    ) -> Option<crate::window::LastValue> {
        self.active_counters[position].last_value(event)
    }

    /// Writes the counter's dimension key for `event` into `key`; false if a dimension value is
    /// missing, null, an object or an array.
    #[inline]
    pub fn counter_key(&self, position: usize, event: &Event<'_>, key: &mut Vec<u8>) -> bool {
        self.active_counters[position].key(event, key)
    }

    /// Writes the hold key of the rule at active `position` for `event` into `key` (encoded like
    /// a dimension key); false if a hold-key value is missing, null, an object or an array.
    #[inline]
    pub fn hold_key(&self, position: usize, event: &Event<'_>, key: &mut Vec<u8>) -> bool {
        self.active_rules[position].hold_key(event, key)
    }

    /// Whether the rule at active `position` judges `event` (its `match` holds).
    #[inline]
    pub fn in_scope(&self, position: usize, event: &Event<'_>, memo: &mut ScopeMemo) -> bool {
        self.active_rules[position].in_scope(event, memo)
    }

    /// A memo for [`RuleSet::plan`] and [`RuleSet::in_scope`] (reset it before each event).
    pub fn scope_memo(&self) -> ScopeMemo {
        ScopeMemo::with_slots(self.scope_slots)
    }

    /// A counter's dimensions, resolved (empty for a disabled counter).
    pub(crate) fn dimension_plan(&self, counter: usize) -> &plan::KeyPlan {
        static NONE: plan::KeyPlan = plan::KeyPlan(Vec::new());
        self.counter_position[counter].map_or(&NONE, |p| &self.active_counters[p].dimensions)
    }

    /// The hold key of the rule at active `position`, resolved (empty: no hold).
    pub(crate) fn hold_plan(&self, position: usize) -> &plan::KeyPlan {
        self.active_rules[position].hold_plan()
    }

    /// The active position of the rule at `index` (`None`: disabled).
    pub fn rule_position(&self, index: usize) -> Option<usize> {
        self.active_rules.iter().position(|r| r.index == index)
    }

    /// The first dimension (by index into the counter's `dimensions`) whose value `event` lacks
    /// (missing, null, an object or an array), if any.
    pub fn missing_dimension(&self, counter: usize, event: &Event<'_>) -> Option<usize> {
        let mut missing = None;
        self.dimension_plan(counter)
            .for_each_value(event, |i, value| {
                if value.is_none() && missing.is_none() {
                    missing = Some(i);
                }
            });
        missing
    }

    /// A rule's entity, resolved (empty: its hits name no one).
    pub(crate) fn entity_plan(&self, rule: usize) -> &plan::KeyPlan {
        &self.entities[rule]
    }

    /// Writes the entity of rule `rule` (by index) for `event` into `key` (encoded like a
    /// dimension key); false if the rule names none or it cannot be formed.
    pub fn entity_key(&self, rule: usize, event: &Event<'_>, key: &mut Vec<u8>) -> bool {
        let plan = &self.entities[rule];
        !plan.is_empty() && plan::encode_key(plan, event, key)
    }

    /// Whether a rule has a `score`: records then carry the event's score.
    pub fn is_scoring(&self) -> bool {
        self.scoring
    }

    /// The rollout bucket (0..10 000) of `event` for the rule at active `position` (`None`: its
    /// rollout key cannot be formed).
    pub fn rollout_bucket(&self, position: usize, event: &Event<'_>) -> Option<u32> {
        let rule = &self.active_rules[position];
        rule.rollout_bucket(&self.rules[rule.index].id, event)
    }

    /// The number of active counters, i.e. valid `position`s for [`RuleSet::plan`].
    pub fn active_len(&self) -> usize {
        self.active_counters.len()
    }
}
