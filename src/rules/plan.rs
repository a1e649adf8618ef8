//! Plan: for one event, which counters it feeds (under which dimension key, with which delta),
//! and which rules judge it. Pure.

use super::expr::{Context, Expr, Num, Val};
use super::model::{Counter, KeyPart, MatchValue, Rule, Scope};
use crate::decimal::MICROS_PER_UNIT;
use crate::event::{Decimal, Event, FieldValue, Projection, Scalar};
use crate::window::{Aggregate, Delta, LastValue};

/// A `match` with its table fields resolved to projection slots.
#[derive(Debug, Clone)]
pub(crate) enum PlannedScope {
    All,
    Table(Vec<(usize, AnyOf)>),
    /// The conjuncts of the `match` expression (`a && b && …` holds exactly when each holds),
    /// each with its slot in a [`ScopeMemo`]: counters and rules repeat the same tests
    /// (`type == 'payment'`), so each distinct conjunct is evaluated at most once per event,
    /// however many scopes share it.
    Expr(Vec<(usize, Expr)>),
}

/// The `match` conjuncts evaluated for the current event (one slot per distinct conjunct).
#[derive(Debug, Clone, Default)]
pub struct ScopeMemo(Vec<u8>);

/// Slot states in a [`ScopeMemo`].
const NOT_YET: u8 = 0;
const FALSE: u8 = 1;
const TRUE: u8 = 2;

impl ScopeMemo {
    /// Forgets every result: call before each event.
    #[inline]
    pub fn reset(&mut self) {
        self.0.fill(NOT_YET);
    }
}

/// Gives each distinct `match` conjunct (by [`Expr::identity`]) a memo slot.
#[derive(Debug, Default)]
pub(crate) struct ScopeSlots(hashbrown::HashMap<String, usize>);

impl ScopeSlots {
    fn slot(&mut self, conjunct: &Expr) -> usize {
        let next = self.0.len();
        *self.0.entry(conjunct.identity()).or_insert(next)
    }

    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }
}

impl PlannedScope {
    fn new(scope: &Scope, projection: &mut Projection, slots: &mut ScopeSlots) -> PlannedScope {
        match scope {
            Scope::All => PlannedScope::All,
            Scope::Table(matchers) => PlannedScope::Table(
                matchers
                    .iter()
                    .map(|m| (projection.slot(&m.path), AnyOf::new(&m.any_of)))
                    .collect(),
            ),
            Scope::Expr(compiled) => PlannedScope::Expr(
                compiled
                    .expr
                    .conjuncts()
                    .into_iter()
                    .map(|conjunct| (slots.slot(conjunct), conjunct.clone()))
                    .collect(),
            ),
        }
    }

    #[inline]
    fn holds(&self, event: &Event<'_>, memo: &mut ScopeMemo) -> bool {
        match self {
            PlannedScope::All => true,
            PlannedScope::Table(matchers) => matchers
                .iter()
                .all(|(slot, any_of)| any_of.matches(event.field(*slot))),
            PlannedScope::Expr(conjuncts) => {
                conjuncts
                    .iter()
                    .all(|(slot, conjunct)| match memo.0[*slot] {
                        TRUE => true,
                        FALSE => false,
                        _ => {
                            let holds = conjunct.holds(&mut FieldsOnly(event));
                            memo.0[*slot] = if holds { TRUE } else { FALSE };
                            holds
                        }
                    })
            }
        }
    }
}

/// A `match` reads fields only.
struct FieldsOnly<'r, 'e>(&'r Event<'e>);

impl<'r, 'e> Context<'r> for FieldsOnly<'r, 'e> {
    fn field(&self, slot: usize) -> &'r FieldValue<'r> {
        self.0.field(slot)
    }
    fn counter(&mut self, _: usize) -> Option<Num> {
        None
    }
    fn counter_raw(&mut self, _: usize) -> Option<i64> {
        None
    }
    fn event_time(&self) -> Option<i64> {
        Some(self.0.ts)
    }
}

/// One entry of a key, resolved: a projection slot, or an expression over the event's fields.
#[derive(Debug, Clone)]
pub(crate) enum KeySlot {
    Field(usize),
    Expr(Expr),
}

/// A key's entries resolved (`dimensions`, a hold key, a rollout key, an entity, a tuple).
#[derive(Debug, Clone, Default)]
pub(crate) struct KeyPlan(pub(crate) Vec<KeySlot>);

impl KeyPlan {
    pub(crate) fn new(parts: &[KeyPart], projection: &mut Projection) -> KeyPlan {
        KeyPlan(
            parts
                .iter()
                .map(|part| match part {
                    KeyPart::Path(p) => KeySlot::Field(projection.slot(p)),
                    KeyPart::Expr { compiled, .. } => KeySlot::Expr(compiled.expr.clone()),
                })
                .collect(),
        )
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Each entry's value for `event`, in order: `f(position, value)`; a value that cannot
    /// key (unknown, null, an object or an array) is `None`.
    pub(crate) fn for_each_value<'e>(
        &'e self,
        event: &'e Event<'e>,
        mut f: impl FnMut(usize, Option<Scalar<'_>>),
    ) {
        for (i, part) in self.0.iter().enumerate() {
            match part {
                KeySlot::Field(slot) => f(i, event.field(*slot).scalar()),
                KeySlot::Expr(expr) => with_scalar(expr.eval(&mut FieldsOnly(event)), |s| f(i, s)),
            }
        }
    }
}

/// An expression's value as a key value (`None`: it cannot key).
fn with_scalar<R>(value: Val<'_>, f: impl FnOnce(Option<Scalar<'_>>) -> R) -> R {
    match value {
        Val::Str(s) => f(Some(Scalar::Str(&s))),
        Val::Bool(b) => f(Some(Scalar::Bool(b))),
        Val::Num(n) => match n.exact {
            Some(d) => f(Some(Scalar::Number(&d))),
            // Made by arithmetic: its shortest decimal.
            None => match Decimal::from_f64(n.float) {
                Some(d) => f(Some(Scalar::Number(&d))),
                None => f(None),
            },
        },
        _ => f(None),
    }
}

/// A counter with its fields resolved to projection slots.
#[derive(Debug, Clone)]
pub(crate) struct PlannedCounter {
    pub(crate) index: usize,
    scope: PlannedScope,
    pub(crate) dimensions: KeyPlan,
    field: Option<usize>,
    /// A distinct tuple's entries (empty: the single `field`).
    tuple: KeyPlan,
    aggregate: Aggregate,
    allow_negative: bool,
}

impl PlannedCounter {
    pub(crate) fn new(
        index: usize,
        counter: &Counter,
        projection: &mut Projection,
        slots: &mut ScopeSlots,
    ) -> PlannedCounter {
        PlannedCounter {
            index,
            scope: PlannedScope::new(&counter.scope, projection, slots),
            dimensions: KeyPlan::new(&counter.dimensions, projection),
            field: counter.field.as_ref().map(|p| projection.slot(p)),
            tuple: KeyPlan::new(&counter.tuple, projection),
            aggregate: counter.aggregate(),
            allow_negative: counter.allow_negative,
        }
    }
}

/// A rule with its `match` table resolved to projection slots.
#[derive(Debug, Clone)]
pub(crate) struct PlannedRule {
    pub(crate) index: usize,
    scope: PlannedScope,
    /// The hold key (empty: no hold).
    hold_key: KeyPlan,
    /// The rollout key (empty: no rollout).
    rollout_key: KeyPlan,
}

impl PlannedRule {
    pub(crate) fn new(
        index: usize,
        rule: &Rule,
        projection: &mut Projection,
        slots: &mut ScopeSlots,
    ) -> PlannedRule {
        let hold_key = rule
            .hold
            .as_ref()
            .map_or_else(KeyPlan::default, |h| KeyPlan::new(&h.key, projection));
        let rollout_key = rule
            .rollout
            .as_ref()
            .map_or_else(KeyPlan::default, |r| KeyPlan::new(&r.key, projection));
        PlannedRule {
            index,
            scope: PlannedScope::new(&rule.scope, projection, slots),
            hold_key,
            rollout_key,
        }
    }

    /// The hold key, resolved (empty: no hold).
    pub(crate) fn hold_plan(&self) -> &KeyPlan {
        &self.hold_key
    }
}

/// Why an event in a counter's scope was not counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SkipReason {
    /// A dimension field is missing, null, an object or an array (the key cannot be formed).
    Dimension,
    /// The summed field is not a number.
    SumField,
    /// The summed amount is outside the counter's range (`[0, 1e12)`, or `(-1e12, 1e12)` with
    /// `allow_negative`).
    SumRange,
    /// The distinct field is missing, null, an object or an array.
    DistinctField,
    /// A `last` counter's field is missing, null, an object or an array.
    LastField,
    /// A `last` counter's field is a string longer than 256 bytes.
    ValueTooLong,
}

impl SkipReason {
    /// Every reason, in the order of [`SkipReason::index`].
    pub const ALL: [SkipReason; 6] = [
        SkipReason::Dimension,
        SkipReason::SumField,
        SkipReason::SumRange,
        SkipReason::DistinctField,
        SkipReason::LastField,
        SkipReason::ValueTooLong,
    ];

    /// Position in [`SkipReason::ALL`] (per-reason counters are arrays).
    pub fn index(self) -> usize {
        self as usize
    }

    /// Low-cardinality code for metrics.
    pub fn code(self) -> &'static str {
        match self {
            SkipReason::Dimension => "missing_dimension",
            SkipReason::SumField => "non_numeric_sum_field",
            SkipReason::SumRange => "sum_range",
            SkipReason::DistinctField => "missing_distinct_field",
            SkipReason::LastField => "missing_last_field",
            SkipReason::ValueTooLong => "value_too_long",
        }
    }
}

/// What one counter does with one event.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Plan {
    /// The `match` does not hold.
    NoMatch,
    Skip(SkipReason),
    /// Add `delta` to the window of the key written into the caller's buffer.
    Observe(Delta),
}

/// Longest string a `last` counter keeps (a longer one skips: `value_too_long`).
pub const MAX_LAST_BYTES: usize = 256;

/// Whether a number's canonical text is longer than a `last` counter keeps.
fn number_too_long(n: &Decimal) -> bool {
    n.may_be_long() && n.to_string().len() > MAX_LAST_BYTES
}

/// Largest summed amount, exclusive: 10^12 units in micro-units.
const SUM_LIMIT_MICROS: i64 = 1_000_000_000_000 * MICROS_PER_UNIT;

impl PlannedCounter {
    /// Plans this counter for `event`, writing its canonical dimension key into `key` (cleared
    /// first) unless the result is [`Plan::NoMatch`] or a dimension skip.
    #[inline]
    pub(crate) fn plan(&self, event: &Event<'_>, key: &mut Vec<u8>, memo: &mut ScopeMemo) -> Plan {
        if !self.scope.holds(event, memo) {
            return Plan::NoMatch;
        }
        if !encode_key(&self.dimensions, event, key) {
            return Plan::Skip(SkipReason::Dimension);
        }
        let field = self.field.map(|slot| event.field(slot));
        let delta = match (self.aggregate, field) {
            (Aggregate::Count, _) => Delta::Count,
            (Aggregate::Sum | Aggregate::Max | Aggregate::Min, Some(FieldValue::Number(n))) => {
                let low = if self.allow_negative {
                    -SUM_LIMIT_MICROS
                } else {
                    -1
                };
                match n.exact.to_micros_half_even() {
                    Some(micros) if micros > low && micros < SUM_LIMIT_MICROS => {
                        if self.aggregate == Aggregate::Sum {
                            Delta::Sum(micros)
                        } else {
                            Delta::Extreme(micros)
                        }
                    }
                    _ => return Plan::Skip(SkipReason::SumRange),
                }
            }
            (Aggregate::Sum | Aggregate::Max | Aggregate::Min, _) => {
                return Plan::Skip(SkipReason::SumField)
            }
            (Aggregate::Last, Some(value)) => match value {
                FieldValue::Str(s) if s.len() > MAX_LAST_BYTES => {
                    return Plan::Skip(SkipReason::ValueTooLong)
                }
                FieldValue::Number(n) if number_too_long(&n.exact) => {
                    return Plan::Skip(SkipReason::ValueTooLong)
                }
                FieldValue::Str(_) | FieldValue::Number(_) | FieldValue::Bool(_) => Delta::Last,
                _ => return Plan::Skip(SkipReason::LastField),
            },
            (Aggregate::Last, None) => return Plan::Skip(SkipReason::LastField),
            (Aggregate::Distinct, Some(value)) => match value.scalar() {
                Some(scalar) => Delta::Distinct(digest(&scalar)),
                None => return Plan::Skip(SkipReason::DistinctField),
            },
            // A tuple: the digest of its entries' key encoding.
            (Aggregate::Distinct, None) if !self.tuple.is_empty() => {
                let mut bytes = Vec::with_capacity(64);
                if !encode_key(&self.tuple, event, &mut bytes) {
                    return Plan::Skip(SkipReason::DistinctField);
                }
                Delta::Distinct(digest_bytes(&bytes))
            }
            (Aggregate::Distinct, None) => return Plan::Skip(SkipReason::DistinctField),
        };
        Plan::Observe(delta)
    }

    /// Whether `event` touches this counter's window, writing its key into `key`: the key can
    /// be formed, and a rule reads the counter (`read`) or its `match` holds. [`Self::plan`]
    /// without the delta (no digest, no decimal): an event whose field the counter skips still
    /// touches it, a read too many for a store reading ahead, never one too few.
    pub(crate) fn touches(
        &self,
        event: &Event<'_>,
        key: &mut Vec<u8>,
        memo: &mut ScopeMemo,
        read: bool,
    ) -> bool {
        (read || self.scope.holds(event, memo)) && encode_key(&self.dimensions, event, key)
    }

    /// A `last` counter's value for `event` (its field, a scalar), owned for the store.
    pub(crate) fn last_value(&self, event: &Event<'_>) -> Option<LastValue> {
        Some(match event.field(self.field?) {
            FieldValue::Str(s) if s.len() <= MAX_LAST_BYTES => LastValue::Str(s.as_ref().into()),
            FieldValue::Number(n) if !number_too_long(&n.exact) => LastValue::Num(n.exact.clone()),
            FieldValue::Bool(b) => LastValue::Bool(*b),
            _ => return None,
        })
    }

    /// Writes this counter's dimension key for `event` into `key`; false if a dimension value
    /// is missing, null, an object or an array.
    #[inline]
    pub(crate) fn key(&self, event: &Event<'_>, key: &mut Vec<u8>) -> bool {
        encode_key(&self.dimensions, event, key)
    }

    /// Whether one of this counter's dimension values for `event` is `message_key` (a string
    /// with those bytes, or a number of that value): then the key decides the message key, and
    /// with it the partition, so no other partition feeds it.
    pub(crate) fn follows_message_key(&self, event: &Event<'_>, message_key: &[u8]) -> bool {
        // Parsed only for a number dimension: most keys are strings, and this runs per counter.
        let as_number = || {
            std::str::from_utf8(message_key)
                .ok()
                .and_then(Decimal::parse)
        };
        self.dimensions.0.iter().any(|part| match part {
            KeySlot::Field(slot) => match event.field(*slot) {
                FieldValue::Str(s) => s.as_bytes() == message_key,
                FieldValue::Number(n) => as_number().is_some_and(|k| k == n.exact),
                _ => false,
            },
            // A derived value (a /24 of the key) spans many message keys.
            KeySlot::Expr(_) => false,
        })
    }
}

impl PlannedRule {
    /// Writes this rule's hold key for `event` into `key` (encoded like a dimension key); false
    /// if a hold-key value is missing, null, an object or an array.
    #[inline]
    pub(crate) fn hold_key(&self, event: &Event<'_>, key: &mut Vec<u8>) -> bool {
        encode_key(&self.hold_key, event, key)
    }

    /// The rollout bucket (0..10 000) of `event` for rule `id`: the first 8 bytes, big-endian,
    /// of SHA-256 of `<id> "\n" <canonical key>` modulo 10 000, the canonical key being the
    /// compact JSON array of the key values. `None`: the key cannot be formed.
    pub(crate) fn rollout_bucket(&self, id: &str, event: &Event<'_>) -> Option<u32> {
        use sha2::Digest;
        let mut text = Vec::with_capacity(64);
        text.extend_from_slice(id.as_bytes());
        text.extend_from_slice(b"\n[");
        let mut formed = true;
        self.rollout_key
            .for_each_value(event, |i, value| match value {
                Some(value) => {
                    if i > 0 {
                        text.push(b',');
                    }
                    super::json::write_scalar_exact(&mut text, value);
                }
                None => formed = false,
            });
        if !formed {
            return None;
        }
        text.push(b']');
        let hash = sha2::Sha256::digest(&text);
        let mut first = [0u8; 8];
        first.copy_from_slice(&hash[..8]);
        Some((u64::from_be_bytes(first) % 10_000) as u32)
    }

    /// Whether this rule judges `event` (its `match` holds).
    #[inline]
    pub(crate) fn in_scope(&self, event: &Event<'_>, memo: &mut ScopeMemo) -> bool {
        self.scope.holds(event, memo)
    }
}

impl ScopeMemo {
    /// A memo of `slots` conjuncts, none evaluated yet.
    pub(crate) fn with_slots(slots: usize) -> ScopeMemo {
        ScopeMemo(vec![NOT_YET; slots])
    }
}

/// Longest canonical key kept as it is: a longer one (a megabyte of `user_agent`) is replaced by
/// its digest, so no event makes one key cost more than a few hundred bytes of state, in
/// process or in the Redis store's local view.
pub const MAX_KEY_BYTES: usize = 256;

/// Writes the canonical key of `plan`'s entries for `event` into `key` (cleared first); false
/// if one is missing, null, an object or an array.
#[inline]
pub(crate) fn encode_key(plan: &KeyPlan, event: &Event<'_>, key: &mut Vec<u8>) -> bool {
    key.clear();
    for part in &plan.0 {
        let formed = match part {
            KeySlot::Field(slot) => match event.field(*slot).scalar() {
                Some(scalar) => {
                    scalar.encode_into(key);
                    true
                }
                None => false,
            },
            KeySlot::Expr(expr) => with_scalar(expr.eval(&mut FieldsOnly(event)), |s| {
                s.map(|s| s.encode_into(key)).is_some()
            }),
        };
        if !formed {
            return false;
        }
    }
    if key.len() > MAX_KEY_BYTES {
        compact_key(key);
    }
    true
}

/// `#` and the 32-byte BLAKE3 of the key: a canonical key starts with a type tag, never `#`,
/// and a cryptographic hash keeps two long values from sharing a key.
#[cold]
fn compact_key(key: &mut Vec<u8>) {
    let hash = blake3::hash(key);
    key.clear();
    key.push(b'#');
    key.extend_from_slice(hash.as_bytes());
}

/// The values a `match` table entry accepts: scanned when few, hashed when many (an any-of array
/// of 500 000 IPs is one lookup per event, not a scan).
#[derive(Debug, Clone)]
pub(crate) enum AnyOf {
    Few(Vec<MatchValue>),
    Many {
        strings: hashbrown::HashSet<String>,
        numbers: hashbrown::HashSet<Decimal>,
        bools: [bool; 2],
    },
}

impl AnyOf {
    fn new(values: &[MatchValue]) -> AnyOf {
        if values.len() <= 8 {
            return AnyOf::Few(values.to_vec());
        }
        let (mut strings, mut numbers, mut bools) = (
            hashbrown::HashSet::new(),
            hashbrown::HashSet::new(),
            [false; 2],
        );
        for value in values {
            match value {
                MatchValue::Str(s) => {
                    strings.insert(s.clone());
                }
                MatchValue::Number(d) => {
                    numbers.insert(d.clone());
                }
                MatchValue::Bool(b) => bools[usize::from(*b)] = true,
            }
        }
        AnyOf::Many {
            strings,
            numbers,
            bools,
        }
    }

    fn matches(&self, value: &FieldValue<'_>) -> bool {
        match self {
            AnyOf::Few(values) => values.iter().any(|v| value_matches(value, v)),
            AnyOf::Many {
                strings,
                numbers,
                bools,
            } => match value {
                FieldValue::Str(s) => strings.contains(s.as_ref()),
                FieldValue::Number(n) => numbers.contains(&n.exact),
                FieldValue::Bool(b) => bools[usize::from(*b)],
                _ => false,
            },
        }
    }
}

/// Strict JSON-typed equality: strings only equal strings, numbers compare by decimal value.
#[inline]
fn value_matches(value: &FieldValue<'_>, expected: &MatchValue) -> bool {
    match (value, expected) {
        (FieldValue::Str(s), MatchValue::Str(e)) => s.as_ref() == e.as_str(),
        (FieldValue::Number(n), MatchValue::Number(e)) => n.exact == *e,
        (FieldValue::Bool(b), MatchValue::Bool(e)) => b == e,
        _ => false,
    }
}

/// A 128-bit digest of a scalar's canonical encoding: the identity of a distinct value. A
/// cryptographic hash, so crafted values cannot collide to hide from a distinct count.
pub fn digest(scalar: &Scalar<'_>) -> u128 {
    let mut bytes = Vec::with_capacity(32);
    scalar.encode_into(&mut bytes);
    digest_bytes(&bytes)
}

/// A distinct value's digest from its key encoding (a tuple's: its entries' in turn, which
/// never equals one value's).
fn digest_bytes(bytes: &[u8]) -> u128 {
    let hash = blake3::hash(bytes);
    let mut first = [0u8; 16];
    first.copy_from_slice(&hash.as_bytes()[..16]);
    u128::from_le_bytes(first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::decode;
    use crate::rules::RuleSet;

    fn set(extra: &str) -> RuleSet {
        let text = format!(
            "[[rule]]\nid='r'\naction='block'\ndimensions=['user_id','device.id']\nwindow='1m'\nlimit=1\n{extra}\n"
        );
        RuleSet::from_sources([("r.toml", text.as_str())]).unwrap()
    }

    fn plan(rules: &RuleSet, line: &str) -> (Plan, Vec<u8>) {
        let event = decode(line.as_bytes(), rules.projection()).unwrap();
        let mut key = Vec::new();
        (
            rules.plan(0, &event, &mut key, &mut rules.scope_memo()),
            key,
        )
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

    /// A key past `MAX_KEY_BYTES` is a fixed-size digest, and two long values that differ only
    /// in their last byte are still two keys; short keys are unchanged.
    #[test]
    fn long_keys_are_digests_and_stay_apart() {
        let rules = set("");
        let key = |user: &str| {
            plan(
                &rules,
                &format!(r#"{{"ts":1,"user_id":"{user}","device":{{"id":"d"}}}}"#),
            )
            .1
        };
        let long = "u".repeat(1_000_000);
        let (a, b) = (key(&format!("{long}a")), key(&format!("{long}b")));
        assert_eq!((a.len(), a[0]), (33, b'#'));
        assert_ne!(a, b);
        assert_eq!(a, key(&format!("{long}a")));
        let short = key("u-17");
        assert!(short.len() < MAX_KEY_BYTES && short[0] == b's', "{short:?}");
    }

    /// Past eight values an any-of array is hashed; it must accept exactly what the scan does.
    #[test]
    fn large_any_of_arrays_are_as_strict_as_small_ones() {
        let mut values: Vec<String> = (0..500).map(|i| format!("'ip-{i}'")).collect();
        values.extend(["7".into(), "2.50".into(), "true".into()]);
        let rules = set(&format!("match = {{ v = [{}] }}", values.join(", ")));
        let hit = |v: &str| {
            plan(
                &rules,
                &format!(r#"{{"ts":1,"user_id":"u","device":{{"id":"d"}},"v":{v}}}"#),
            )
            .0 != Plan::NoMatch
        };
        for yes in [r#""ip-0""#, r#""ip-499""#, "7", "7.0", "2.5", "true"] {
            assert!(hit(yes), "{yes}");
        }
        for no in [
            r#""ip-500""#,
            r#""7""#,
            "8",
            "false",
            r#""true""#,
            "null",
            "[7]",
            r#"{"a":7}"#,
        ] {
            assert!(!hit(no), "{no}");
        }
    }

    #[test]
    fn keys_distinguish_types_but_not_number_spelling() {
        let rules = set("");
        let key = |uid: &str| {
            plan(
                &rules,
                &format!(r#"{{"ts":1,"user_id":{uid},"device":{{"id":1}}}}"#),
            )
            .1
        };
        assert_eq!(key("17"), key("17.0"));
        assert_ne!(key("17"), key("\"17\""));
        assert_eq!(key("\"a\""), key("\"\\u0061\""));
    }

    #[test]
    fn a_key_follows_the_message_key_when_one_of_its_values_is_that_key() {
        let rules = set("");
        let follows = |event: &str, message_key: &[u8]| {
            let event = decode(event.as_bytes(), rules.projection()).unwrap();
            rules.counter_follows_message_key(0, &event, message_key)
        };
        let user = |uid: &str| format!(r#"{{"ts":1,"user_id":{uid},"device":{{"id":"d-1"}}}}"#);
        assert!(follows(&user("\"u-7\""), b"u-7"));
        assert!(follows(&user("\"u-7\""), b"d-1"), "any of the dimensions");
        assert!(follows(&user("17"), b"17"));
        assert!(follows(&user("17.0"), b"17"), "a number by value");
        assert!(!follows(&user("\"u-7\""), b"u-70"));
        assert!(!follows(&user("\"u-7\""), b""));
        assert!(!follows(&user("17"), b"x"));
        assert!(!follows(&user("\"17\""), b"17.0"), "a string by its bytes");
    }

    #[test]
    fn unusable_dimensions_and_fields_skip() {
        let rules = set("");
        for uid in ["null", "{}", "[1]"] {
            let line = format!(r#"{{"ts":1,"user_id":{uid},"device":{{"id":1}}}}"#);
            assert_eq!(
                plan(&rules, &line).0,
                Plan::Skip(SkipReason::Dimension),
                "{uid}"
            );
        }
        assert_eq!(
            plan(&rules, r#"{"ts":1,"user_id":1}"#).0,
            Plan::Skip(SkipReason::Dimension)
        );

        let sum = set("aggregate='sum'\nfield='amount'");
        let line = |amount: &str| {
            format!(r#"{{"ts":1,"user_id":1,"device":{{"id":1}},"amount":{amount}}}"#)
        };
        assert_eq!(
            plan(&sum, &line("\"12\"")).0,
            Plan::Skip(SkipReason::SumField)
        );
        assert_eq!(
            plan(&sum, &line("12.5")).0,
            Plan::Observe(Delta::Sum(12_500_000))
        );
        assert_eq!(plan(&sum, &line("-1")).0, Plan::Skip(SkipReason::SumRange));
        assert_eq!(
            plan(&sum, &line("1e12")).0,
            Plan::Skip(SkipReason::SumRange)
        );
        assert_eq!(
            plan(&sum, &line("0.0000005")).0,
            Plan::Observe(Delta::Sum(0))
        );

        let distinct = set("aggregate='distinct'\nfield='ip'");
        let with_ip = |ip: &str| format!(r#"{{"ts":1,"user_id":1,"device":{{"id":1}},"ip":{ip}}}"#);
        assert_eq!(
            plan(&distinct, &with_ip("null")).0,
            Plan::Skip(SkipReason::DistinctField)
        );
        assert_eq!(
            plan(&distinct, r#"{"ts":1,"user_id":1,"device":{"id":1}}"#).0,
            Plan::Skip(SkipReason::DistinctField)
        );
        let (Plan::Observe(Delta::Distinct(a)), _) = plan(&distinct, &with_ip("1")) else {
            panic!()
        };
        let (Plan::Observe(Delta::Distinct(b)), _) = plan(&distinct, &with_ip("1.0")) else {
            panic!()
        };
        let (Plan::Observe(Delta::Distinct(c)), _) = plan(&distinct, &with_ip("\"1\"")) else {
            panic!()
        };
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    /// Scopes repeating a test share its memo slot, and a scope holds exactly when its whole
    /// expression is true (three-valued: an unknown conjunct is not true).
    #[test]
    fn match_conjuncts_are_shared_and_exact() {
        let text = r#"
[[counter]]
id = "a"
match = "type == 'pay' && amount > 5"
dimensions = ["user"]
window = "1m"

[[counter]]
id = "b"
match = "type=='pay' && (result == 'ok' || amount > 5)"
dimensions = ["user"]
window = "1m"

[[rule]]
id = "r"
action = "alert"
match = "type == 'pay' && !(amount <= 5) && amount > 5"
when = "$a > 0 || $b > 0"
"#;
        let rules = RuleSet::from_sources([("r.toml", text)]).unwrap();
        // `type == 'pay'` and `amount > 5` once each, the `||` and the `!`: four slots, not six.
        assert_eq!(rules.scope_memo().0.len(), 4);
        let mut memo = rules.scope_memo();
        for (line, a, b, r) in [
            (
                r#"{"ts":1,"user":"u","type":"pay","amount":9}"#,
                true,
                true,
                true,
            ),
            (
                r#"{"ts":1,"user":"u","type":"pay","amount":1,"result":"ok"}"#,
                false,
                true,
                false,
            ),
            (
                r#"{"ts":1,"user":"u","type":"pay","result":"ok"}"#,
                false,
                true,
                false,
            ),
            (r#"{"ts":1,"user":"u","type":"pay"}"#, false, false, false),
            (
                r#"{"ts":1,"user":"u","type":"login","amount":9}"#,
                false,
                false,
                false,
            ),
            (r#"{"ts":1,"user":"u","amount":9}"#, false, false, false),
        ] {
            let event = decode(line.as_bytes(), rules.projection()).unwrap();
            memo.reset();
            let mut key = Vec::new();
            let fed = |position: usize, memo: &mut ScopeMemo, key: &mut Vec<u8>| {
                rules.plan(position, &event, key, memo) != Plan::NoMatch
            };
            assert_eq!(fed(0, &mut memo, &mut key), a, "{line}");
            assert_eq!(fed(1, &mut memo, &mut key), b, "{line}");
            assert_eq!(rules.in_scope(0, &event, &mut memo), r, "{line}");
        }
    }

    /// The rollout bucket is SHA-256 of `<rule id> "\n" <compact JSON array of the key>`, its
    /// first 8 bytes big-endian, modulo 10 000: pinned so another service can reproduce it
    /// (`printf 'new-limit-30\n["alice"]' | sha256sum`).
    #[test]
    fn rollout_buckets_are_pinned() {
        let rules = RuleSet::from_sources([(
            "r.toml",
            "[[rule]]\nid='new-limit-30'\naction='block'\nrollout=30\nrollout_key=['user']\n[[rule]]\nid='two'\naction='block'\nrollout=12.5\nrollout_key=['user', 'lower(email)']\n",
        )])
        .unwrap();
        let bucket = |position: usize, fields: &str| {
            let line = format!("{{\"ts\":1,{fields}}}");
            let event = decode(line.as_bytes(), rules.projection()).unwrap();
            rules.rollout_bucket(position, &event)
        };
        for (user, want) in [
            (r#""alice""#, 401),
            (r#""frank""#, 1464),
            (r#""42""#, 687),
            (r#""bob""#, 4638),
            (r#""carol""#, 8005),
            ("42", 8659),
            ("42.0", 8659),
            ("4.2e1", 8659),
        ] {
            assert_eq!(
                bucket(0, &format!(r#""user":{user}"#)),
                Some(want),
                "{user}"
            );
        }
        assert_eq!(bucket(0, r#""user":null"#), None);
        assert_eq!(bucket(0, r#""other":1"#), None);
        assert_eq!(bucket(0, r#""user":{"a":1}"#), None);
        // Two entries, one an expression: `two\n["u1","a@b.c"]`.
        let mut hasher = <sha2::Sha256 as sha2::Digest>::new();
        sha2::Digest::update(&mut hasher, b"two\n[\"u1\",\"a@b.c\"]");
        let hash = sha2::Digest::finalize(hasher);
        let want = (u64::from_be_bytes(hash[..8].try_into().unwrap()) % 10_000) as u32;
        assert_eq!(bucket(1, r#""user":"u1","email":"A@B.c""#), Some(want));
    }

    /// A key entry may be an expression: its value is the key value; one that cannot be formed
    /// (unknown, null) skips the counter. A distinct tuple is one value per combination.
    #[test]
    fn expression_dimensions_and_tuples() {
        let rules = RuleSet::from_sources([(
            "r.toml",
            "[[counter]]\nid='net'\ndimensions=['ip_prefix(ip, 24)']\nwindow='1m'\n[[counter]]\nid='pairs'\ndimensions=['u']\nwindow='1m'\naggregate='distinct'\nfield=['card', 'device']\n[[rule]]\nid='r'\naction='block'\nwhen='$net > 0 || $pairs > 0'\n",
        )])
        .unwrap();
        let plan_of = |position: usize, fields: &str| {
            let line = format!("{{\"ts\":1,{fields}}}");
            let event = decode(line.as_bytes(), rules.projection()).unwrap();
            let mut key = Vec::new();
            let plan = rules.plan(position, &event, &mut key, &mut rules.scope_memo());
            (plan, key)
        };
        let (a, key_a) = plan_of(0, r#""ip":"203.0.113.5""#);
        let (_, key_b) = plan_of(0, r#""ip":"203.0.113.77""#);
        let (_, key_c) = plan_of(0, r#""ip":"203.0.114.1""#);
        assert!(matches!(a, Plan::Observe(Delta::Count)));
        assert_eq!(key_a, key_b);
        assert_ne!(key_a, key_c);
        assert_eq!(
            plan_of(0, r#""ip":"nope""#).0,
            Plan::Skip(SkipReason::Dimension)
        );
        let pair = |card: &str, device: &str| match plan_of(
            1,
            &format!(r#""u":"x","card":{card},"device":{device}"#),
        )
        .0
        {
            Plan::Observe(Delta::Distinct(d)) => Some(d),
            _ => None,
        };
        assert_eq!(pair(r#""c1""#, r#""d1""#), pair(r#""c1""#, r#""d1""#));
        assert_ne!(pair(r#""c1""#, r#""d1""#), pair(r#""c1""#, r#""d2""#));
        assert_ne!(pair(r#""c1""#, r#""d2""#), pair(r#""c2""#, r#""d1""#));
        assert_eq!(pair(r#""c1""#, "null"), None);
    }
}
