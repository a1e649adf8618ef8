//! Decide: hits → a [`Decision`], and its JSON record; and the plain-words descriptions
//! `vigil check` prints. Pure.

use serde::ser::{SerializeMap, SerializeSeq, Serializer};
use serde::Serialize;
use smallvec::SmallVec;

use super::model::{format_duration, Action, Counter, Form, MatchValue, Mode, Rule, Scope};
use super::RuleSet;
use crate::decimal::Decimal;
use crate::event::{Event, FieldValue, Scalar};
use crate::window::Aggregate;

/// Why a rule fired, when the record says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Its condition held.
    When,
    /// Its hold key is held (the rule fired for it by its condition less than `hold` ago).
    Held,
    /// The shared counter store was unavailable and the rule's `on_store_error` is `block`.
    StoreUnavailable,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::When => "when",
            Reason::Held => "held",
            Reason::StoreUnavailable => "store_unavailable",
        }
    }
}

/// One rule that fired.
#[derive(Debug, Clone, PartialEq)]
pub struct Hit {
    /// Index into [`RuleSet::rules`].
    pub rule: usize,
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
}

/// A counter's raw value (count, micro-units, distinct count) as the exact decimal it means.
pub fn counter_value(aggregate: Aggregate, raw: i64) -> Decimal {
    match aggregate {
        Aggregate::Sum => Decimal::from_micros(raw),
        Aggregate::Count | Aggregate::Distinct => Decimal::from_i64(raw),
    }
}

/// The outcome for one event.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Decision {
    /// Every hit, in rule-file order, shadow ones included.
    pub hits: Vec<Hit>,
}

impl Decision {
    /// `Allow` if an enforce-mode allow rule hit (allow rules override); else the most severe
    /// enforce-mode action; `None` (serialised as `allow`) when only shadow rules hit or
    /// nothing did.
    pub fn action(&self, rules: &RuleSet) -> Option<Action> {
        let enforced = self.hits.iter().map(|h| rules.rule(h.rule)).filter(|r| r.mode == Mode::Enforce);
        let mut most = None;
        for rule in enforced {
            if rule.action == Action::Allow {
                return Some(Action::Allow);
            }
            most = most.max(Some(rule.action));
        }
        most
    }

    pub fn is_empty(&self) -> bool {
        self.hits.is_empty()
    }
}

/// Where an event came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source<'a> {
    /// Replay: 1-based line number of the input.
    Line(u64),
    Kafka { topic: &'a str, partition: i32, offset: i64 },
}

impl Source<'_> {
    /// A deterministic id for downstream de-duplication.
    fn decision_id(&self) -> String {
        match *self {
            Source::Line(line) => format!("line/{line}"),
            Source::Kafka { topic, partition, offset } => format!("{topic}/{partition}/{offset}"),
        }
    }
}

impl Serialize for Source<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match *self {
            Source::Line(line) => {
                let mut m = s.serialize_map(Some(1))?;
                m.serialize_entry("line", &line)?;
                m.end()
            }
            Source::Kafka { topic, partition, offset } => {
                let mut m = s.serialize_map(Some(3))?;
                m.serialize_entry("topic", topic)?;
                m.serialize_entry("partition", &partition)?;
                m.serialize_entry("offset", &offset)?;
                m.end()
            }
        }
    }
}

/// Appends the decision record for `event` to `out` as one JSON object (no newline).
pub fn write_record(out: &mut Vec<u8>, rules: &RuleSet, event: &Event<'_>, decision: &Decision, source: Source<'_>) {
    let record = Record { rules, event, decision, source };
    // Serialising plain data into a Vec cannot fail.
    serde_json::to_writer(out, &record).expect("decision record serialises");
}

struct Record<'r, 'e> {
    rules: &'r RuleSet,
    event: &'r Event<'e>,
    decision: &'r Decision,
    source: Source<'r>,
}

impl Serialize for Record<'_, '_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(7))?;
        m.serialize_entry("decision_id", &self.source.decision_id())?;
        let event_id = match self.event.event_id() {
            FieldValue::Str(_) | FieldValue::Number(_) => self.event.event_id().scalar(),
            _ => None,
        };
        m.serialize_entry("event_id", &event_id)?;
        m.serialize_entry("ts", &self.event.ts)?;
        let action = self.decision.action(self.rules).map_or("allow", Action::as_str);
        m.serialize_entry("action", action)?;
        m.serialize_entry("rules_version", self.rules.version())?;
        let hits: Vec<HitRecord<'_, '_>> =
            self.decision.hits.iter().map(|hit| HitRecord { rules: self.rules, event: self.event, hit }).collect();
        m.serialize_entry("hits", &hits)?;
        m.serialize_entry("source", &self.source)?;
        m.end()
    }
}

struct HitRecord<'r, 'e> {
    rules: &'r RuleSet,
    event: &'r Event<'e>,
    hit: &'r Hit,
}

impl Serialize for HitRecord<'_, '_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let rule = self.rules.rule(self.hit.rule);
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("rule_id", &rule.id)?;
        m.serialize_entry("mode", rule.mode.as_str())?;
        m.serialize_entry("action", rule.action.as_str())?;
        if let Some(reason) = self.hit.reason {
            m.serialize_entry("reason", reason.as_str())?;
        }
        match rule.form {
            Form::V1 { counter, limit, .. } => {
                let c = self.rules.counter(counter);
                m.serialize_entry("key", &KeyRecord { rules: self.rules, event: self.event, counter })?;
                m.serialize_entry("value", &self.hit.value.map(|v| counter_value(c.aggregate(), v)))?;
                m.serialize_entry("limit", &limit)?;
                m.serialize_entry("window_ms", &c.window.window_ms())?;
            }
            Form::V2 => {
                m.serialize_entry("counters", &CountersRecord { rules: self.rules, event: self.event, hit: self.hit })?;
            }
        }
        if rule.hold.is_some() {
            m.serialize_entry("held_until", &self.hit.held_until)?;
        }
        if self.hit.degraded {
            m.serialize_entry("degraded", &true)?;
        }
        m.end()
    }
}

struct CountersRecord<'r, 'e> {
    rules: &'r RuleSet,
    event: &'r Event<'e>,
    hit: &'r Hit,
}

impl Serialize for CountersRecord<'_, '_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.hit.counters.len()))?;
        for &(counter, raw) in &self.hit.counters {
            seq.serialize_element(&CounterRecord { rules: self.rules, event: self.event, counter, raw })?;
        }
        seq.end()
    }
}

struct CounterRecord<'r, 'e> {
    rules: &'r RuleSet,
    event: &'r Event<'e>,
    counter: usize,
    raw: i64,
}

impl Serialize for CounterRecord<'_, '_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let c = self.rules.counter(self.counter);
        let mut m = s.serialize_map(Some(4))?;
        m.serialize_entry("id", &c.id)?;
        m.serialize_entry("key", &KeyRecord { rules: self.rules, event: self.event, counter: self.counter })?;
        m.serialize_entry("value", &counter_value(c.aggregate(), self.raw))?;
        m.serialize_entry("window_ms", &c.window.window_ms())?;
        m.end()
    }
}

/// A counter's dimension values for this event, by path, as canonical JSON scalars.
struct KeyRecord<'r, 'e> {
    rules: &'r RuleSet,
    event: &'r Event<'e>,
    counter: usize,
}

impl Serialize for KeyRecord<'_, '_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let counter = self.rules.counter(self.counter);
        let slots = self.rules.dimension_slots(self.counter);
        let mut m = s.serialize_map(Some(slots.len()))?;
        for (path, &slot) in counter.dimensions.iter().zip(slots) {
            let value: Option<Scalar<'_>> = self.event.field(slot).scalar();
            m.serialize_entry(path.as_str(), &value)?;
        }
        m.end()
    }
}

// ---------------------------------------------------------------------------------------------
// Descriptions for `vigil check`

fn describe_value(v: &MatchValue) -> String {
    match v {
        MatchValue::Str(s) => format!("{s:?}"),
        MatchValue::Number(n) => n.to_string(),
        MatchValue::Bool(b) => b.to_string(),
    }
}

/// A `match` in words: the values a table matches, or the expression as written.
fn describe_scope(scope: &Scope, source: Option<&str>) -> Option<String> {
    match scope {
        Scope::All => None,
        Scope::Table(matchers) => Some(
            matchers
                .iter()
                .map(|m| {
                    let values: Vec<String> = m.any_of.iter().map(describe_value).collect();
                    if values.len() == 1 {
                        format!("{} is {}", m.path, values[0])
                    } else {
                        format!("{} is one of {}", m.path, values.join(", "))
                    }
                })
                .collect::<Vec<_>>()
                .join(" and "),
        ),
        Scope::Expr(compiled) => Some(source.map_or_else(|| format!("an expression over {}", paths(&compiled.paths)), str::to_owned)),
    }
}

fn paths(paths: &[crate::event::FieldPath]) -> String {
    paths.iter().map(|p| p.as_str()).collect::<Vec<_>>().join(", ")
}

fn what_counts(counter: &Counter) -> String {
    let dims: Vec<&str> = counter.dimensions.iter().map(|p| p.as_str()).collect();
    let what = match (&counter.field, counter.aggregate()) {
        (Some(f), Aggregate::Sum) => format!("sum of {f}{}", if counter.allow_negative { " (negative allowed)" } else { "" }),
        (Some(f), Aggregate::Distinct) => format!("distinct {f} (at most {})", counter.window.max_distinct),
        _ => "count of events".to_owned(),
    };
    format!(
        "{what} per {} over {} (bucket {})",
        dims.join("+"),
        format_duration(counter.window.window_ms()),
        format_duration(counter.window.bucket_ms)
    )
}

/// One line: what a counter counts, in words a reviewer can read.
pub fn describe_counter(counter: &Counter) -> String {
    let scope = describe_scope(&counter.scope, counter.scope_text.as_deref()).map_or_else(String::new, |s| format!(" where {s}"));
    format!(
        "counter {id}{disabled}: {what}{scope}  [{origin}]",
        id = counter.id,
        disabled = if counter.enabled { "" } else { " (disabled)" },
        what = what_counts(counter),
        origin = counter.origin,
    )
}

/// One line: which events a rule judges, when it fires and what it does.
pub fn describe_rule(rules: &RuleSet, rule: &Rule) -> String {
    let head = format!(
        "rule {id}{disabled}: {action}/{mode}",
        id = rule.id,
        disabled = if rule.enabled { "" } else { " (disabled)" },
        action = rule.action.as_str(),
        mode = rule.mode.as_str(),
    );
    let scope = describe_scope(&rule.scope, rule.scope_text.as_deref());
    let body = match &rule.form {
        Form::V1 { counter, limit, .. } => {
            let c = rules.counter(*counter);
            let scope = scope.map_or_else(String::new, |s| format!(" where {s}"));
            format!("{} > {limit}{scope}", what_counts(c))
        }
        Form::V2 => {
            let scope = scope.map_or_else(|| "every event".to_owned(), |s| format!("events where {s}"));
            match (&rule.when, &rule.when_text) {
                (Some(_), Some(text)) => format!("judges {scope}; fires when {text}"),
                _ => format!("fires on {scope}"),
            }
        }
    };
    let hold = rule.hold.as_ref().map_or_else(String::new, |hold| {
        let key: Vec<String> = hold.key.iter().map(ToString::to_string).collect();
        format!("; then holds {} for {}", key.join(" + "), format_duration(hold.ms))
    });
    format!("{head} {body}{hold}  [{origin}]", origin = rule.origin)
}
