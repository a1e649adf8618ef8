//! Plan: for one event and one rule, whether the rule applies, under which dimension key, and
//! what to add to its window. Pure.

use super::model::{MatchValue, Rule};
use super::RuleSet;
use crate::event::{Event, FieldValue, Projection, Scalar};
use crate::window::{Aggregate, Delta};

/// A rule with its fields resolved to projection slots.
#[derive(Debug, Clone)]
pub(crate) struct CompiledRule {
    pub(crate) index: usize,
    matchers: Vec<(usize, Vec<MatchValue>)>,
    dimensions: Vec<usize>,
    field: Option<usize>,
    aggregate: Aggregate,
}

impl CompiledRule {
    pub(crate) fn new(index: usize, rule: &Rule, projection: &mut Projection) -> CompiledRule {
        CompiledRule {
            index,
            matchers: rule.matchers.iter().map(|m| (projection.slot(&m.path), m.any_of.clone())).collect(),
            dimensions: rule.dimensions.iter().map(|p| projection.slot(p)).collect(),
            field: rule.field.as_ref().map(|p| projection.slot(p)),
            aggregate: rule.aggregate(),
        }
    }
}

/// Why a matching event was not counted for a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SkipReason {
    /// A dimension field is missing, null, an object or an array.
    Dimension,
    /// The summed field is not a number.
    SumField,
    /// The distinct field is missing, null, an object or an array.
    DistinctField,
}

impl SkipReason {
    /// Low-cardinality code for metrics.
    pub fn code(self) -> &'static str {
        match self {
            SkipReason::Dimension => "missing_dimension",
            SkipReason::SumField => "non_numeric_sum_field",
            SkipReason::DistinctField => "missing_distinct_field",
        }
    }
}

/// What one rule does with one event.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Plan {
    /// The `match` does not hold.
    NoMatch,
    Skip(SkipReason),
    /// Add `delta` to the window of the key written into the caller's buffer.
    Observe(Delta),
}

impl RuleSet {
    /// Plans the `position`-th active rule for `event`, writing its canonical dimension key into
    /// `key` (cleared first) when the result is [`Plan::Observe`].
    pub fn plan(&self, position: usize, event: &Event<'_>, key: &mut Vec<u8>) -> Plan {
        let rule = &self.active[position];
        let matches = rule
            .matchers
            .iter()
            .all(|(slot, any_of)| any_of.iter().any(|v| value_matches(event.field(*slot), v)));
        if !matches {
            return Plan::NoMatch;
        }
        key.clear();
        for &slot in &rule.dimensions {
            match event.field(slot).scalar() {
                Some(scalar) => scalar.encode_into(key),
                None => return Plan::Skip(SkipReason::Dimension),
            }
        }
        let field = rule.field.map(|slot| event.field(slot));
        let delta = match (rule.aggregate, field) {
            (Aggregate::Count, _) => Delta::Count,
            (Aggregate::Sum, Some(FieldValue::Number(n))) => Delta::Sum(n.as_f64()),
            (Aggregate::Sum, _) => return Plan::Skip(SkipReason::SumField),
            (Aggregate::Distinct, Some(value)) => match value.scalar() {
                Some(scalar) => Delta::Distinct(digest(&scalar)),
                None => return Plan::Skip(SkipReason::DistinctField),
            },
            (Aggregate::Distinct, None) => return Plan::Skip(SkipReason::DistinctField),
        };
        Plan::Observe(delta)
    }

    /// Projection slots of a rule's dimensions (empty for a disabled rule).
    pub fn dimension_slots(&self, rule: usize) -> &[usize] {
        self.active.iter().find(|c| c.index == rule).map_or(&[], |c| &c.dimensions)
    }

    /// The number of active rules, i.e. valid `position`s for [`RuleSet::plan`].
    pub fn active_len(&self) -> usize {
        self.active.len()
    }
}

/// Strict JSON-typed equality: strings only equal strings, numbers compare by value.
fn value_matches(value: &FieldValue<'_>, expected: &MatchValue) -> bool {
    match (value.scalar(), expected) {
        (Some(Scalar::Str(s)), MatchValue::Str(e)) => s == e,
        (Some(Scalar::Number(n)), MatchValue::Number(e)) => n == *e,
        (Some(Scalar::Bool(b)), MatchValue::Bool(e)) => b == *e,
        _ => false,
    }
}

/// A 128-bit digest of a scalar's canonical encoding: the identity of a distinct value. A
/// cryptographic hash, so crafted values cannot collide to hide from a distinct count.
pub fn digest(scalar: &Scalar<'_>) -> u128 {
    let mut bytes = Vec::with_capacity(32);
    scalar.encode_into(&mut bytes);
    let hash = blake3::hash(&bytes);
    let mut first = [0u8; 16];
    first.copy_from_slice(&hash.as_bytes()[..16]);
    u128::from_le_bytes(first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::decode;

    fn set(extra: &str) -> RuleSet {
        let text = format!(
            "[[rule]]\nid='r'\naction='block'\ndimensions=['user_id','device.id']\nwindow='1m'\nlimit=1\n{extra}\n"
        );
        RuleSet::from_sources([("r.toml", text.as_str())]).unwrap()
    }

    fn plan(rules: &RuleSet, line: &str) -> (Plan, Vec<u8>) {
        let event = decode(line.as_bytes(), rules.projection()).unwrap();
        let mut key = Vec::new();
        (rules.plan(0, &event, &mut key), key)
    }

    #[test]
    fn match_is_strict_on_json_types() {
        let rules = set("match = { code = 1, kind = ['a', 'b'], ok = true }");
        let base = r#""ts":1,"user_id":"u","device":{"id":"d"}"#;
        let hit = |fields: &str| plan(&rules, &format!("{{{base},{fields}}}")).0 != Plan::NoMatch;
        assert!(hit(r#""code":1,"kind":"b","ok":true"#));
        assert!(hit(r#""code":1.0,"kind":"a","ok":true"#));
        assert!(!hit(r#""code":"1","kind":"a","ok":true"#));
        assert!(!hit(r#""code":1,"kind":"c","ok":true"#));
        assert!(!hit(r#""code":1,"kind":"a","ok":"true""#));
        assert!(!hit(r#""code":1,"kind":"a""#));
    }

    #[test]
    fn keys_distinguish_types_but_not_number_spelling() {
        let rules = set("");
        let key = |uid: &str| plan(&rules, &format!(r#"{{"ts":1,"user_id":{uid},"device":{{"id":1}}}}"#)).1;
        assert_eq!(key("17"), key("17.0"));
        assert_ne!(key("17"), key("\"17\""));
        assert_eq!(key("\"a\""), key("\"\\u0061\""));
    }

    #[test]
    fn unusable_dimensions_and_fields_skip() {
        let rules = set("");
        for uid in ["null", "{}", "[1]"] {
            let line = format!(r#"{{"ts":1,"user_id":{uid},"device":{{"id":1}}}}"#);
            assert_eq!(plan(&rules, &line).0, Plan::Skip(SkipReason::Dimension), "{uid}");
        }
        assert_eq!(plan(&rules, r#"{"ts":1,"user_id":1}"#).0, Plan::Skip(SkipReason::Dimension));

        let sum = set("aggregate='sum'\nfield='amount'");
        let line = |amount: &str| format!(r#"{{"ts":1,"user_id":1,"device":{{"id":1}},"amount":{amount}}}"#);
        assert_eq!(plan(&sum, &line("\"12\"")).0, Plan::Skip(SkipReason::SumField));
        assert_eq!(plan(&sum, &line("12.5")).0, Plan::Observe(Delta::Sum(12.5)));

        let distinct = set("aggregate='distinct'\nfield='ip'");
        let with_ip = |ip: &str| format!(r#"{{"ts":1,"user_id":1,"device":{{"id":1}},"ip":{ip}}}"#);
        assert_eq!(plan(&distinct, &with_ip("null")).0, Plan::Skip(SkipReason::DistinctField));
        assert_eq!(plan(&distinct, r#"{"ts":1,"user_id":1,"device":{"id":1}}"#).0, Plan::Skip(SkipReason::DistinctField));
        let (Plan::Observe(Delta::Distinct(a)), _) = plan(&distinct, &with_ip("1")) else { panic!() };
        let (Plan::Observe(Delta::Distinct(b)), _) = plan(&distinct, &with_ip("1.0")) else { panic!() };
        let (Plan::Observe(Delta::Distinct(c)), _) = plan(&distinct, &with_ip("\"1\"")) else { panic!() };
        assert_eq!(a, b);
        assert_ne!(a, c);
    }
}
