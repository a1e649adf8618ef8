//! Decide: window values against limits → a [`Decision`], and its JSON record. Pure.

use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;

use super::model::{Action, Mode};
use super::RuleSet;
use crate::event::{CanonicalNumber, Event, FieldValue, Scalar};

/// Why a rule fired, when the record says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Its condition held.
    When,
    /// The shared counter store was unavailable and the rule's `on_store_error` is `block`.
    StoreUnavailable,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::When => "when",
            Reason::StoreUnavailable => "store_unavailable",
        }
    }
}

/// One rule that fired.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hit {
    /// Index into [`RuleSet::rules`].
    pub rule: usize,
    pub value: f64,
    /// Set when the record names a reason.
    pub reason: Option<Reason>,
    /// Its counters were counted locally because the shared store was unavailable.
    pub degraded: bool,
}

/// Whether a window value fires a rule: strictly greater than the limit.
pub fn exceeds(value: f64, limit: CanonicalNumber) -> bool {
    value > limit.as_f64()
}

/// The outcome for one event.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Decision {
    /// Every hit, in rule-file order, shadow ones included.
    pub hits: Vec<Hit>,
}

impl Decision {
    /// The most severe enforce-mode action, or `None` (serialised as `allow`) when only
    /// shadow rules hit or nothing did.
    pub fn action(&self, rules: &RuleSet) -> Option<Action> {
        self.hits
            .iter()
            .map(|h| rules.rule(h.rule))
            .filter(|r| r.mode == Mode::Enforce)
            .map(|r| r.action)
            .max()
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
        let mut m = s.serialize_map(Some(5))?;
        let event_id = match self.event.event_id() {
            FieldValue::Str(_) | FieldValue::Number(_) => self.event.event_id().scalar(),
            _ => None,
        };
        m.serialize_entry("event_id", &event_id)?;
        m.serialize_entry("ts", &self.event.ts)?;
        let action = self.decision.action(self.rules).map_or("allow", Action::as_str);
        m.serialize_entry("action", action)?;
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
        m.serialize_entry("key", &KeyRecord { rules: self.rules, event: self.event, rule: self.hit.rule })?;
        m.serialize_entry("value", &JsonNumber(self.hit.value))?;
        m.serialize_entry("limit", &rule.limit)?;
        m.serialize_entry("window_ms", &rule.window.window_ms())?;
        if self.hit.degraded {
            m.serialize_entry("degraded", &true)?;
        }
        m.end()
    }
}

/// The hit's dimension values, by path, as canonical JSON scalars.
struct KeyRecord<'r, 'e> {
    rules: &'r RuleSet,
    event: &'r Event<'e>,
    rule: usize,
}

impl Serialize for KeyRecord<'_, '_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let rule = self.rules.rule(self.rule);
        let slots = self.rules.dimension_slots(self.rule);
        let mut m = s.serialize_map(Some(slots.len()))?;
        for (path, &slot) in rule.dimensions.iter().zip(slots) {
            let value: Option<Scalar<'_>> = self.event.field(slot).scalar();
            m.serialize_entry(path.as_str(), &value)?;
        }
        m.end()
    }
}

/// A window value: integral values print as JSON integers (`6`, not `6.0`).
struct JsonNumber(f64);

impl Serialize for JsonNumber {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        const EXACT: f64 = 9_007_199_254_740_992.0; // 2^53
        if self.0.fract() == 0.0 && self.0.abs() < EXACT {
            s.serialize_i64(self.0 as i64)
        } else {
            s.serialize_f64(self.0)
        }
    }
}
