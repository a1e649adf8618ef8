//! One key as the engine sees it: a counter's live window (`vigil inspect`, the worker's `/v1`
//! lookups), a rule's hold with the counters its condition reads, and ending a hold (`vigil hold
//! release`). The key is given as field values typed as in rule files (`user_id=17` the number,
//! `user_id='17'` the string), made into an event at the time asked, so a key is formed exactly
//! as the engine forms it for an event with those fields (paths and expressions alike).

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::value::RawValue;

use super::engine::Engine;
use crate::event::{FieldPath, TimeSource};
use crate::rules::model::Form;
use crate::rules::record;
use crate::rules::RuleSet;
use crate::store::{CounterStore, StoreError};
use crate::window::{Aggregate, Applied};

/// Field values a lookup may carry at most (a key has at most 4 entries; expressions may read
/// a few more fields).
pub const MAX_FIELDS: usize = 16;

/// Longest value a lookup accepts, in bytes.
pub const MAX_VALUE_BYTES: usize = 4096;

/// Why a lookup could not be made.
#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    #[error("{0}")]
    BadField(String),
    #[error("no counter or rule {id:?}{hint}")]
    UnknownId { id: String, hint: String },
    #[error("rule {0:?} has no hold")]
    NoHold(String),
    #[error("the key of {what} cannot be formed from the fields given ({needs})")]
    KeyNotFormed { what: String, needs: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl InspectError {
    /// Low-cardinality code for metrics and HTTP status.
    pub fn code(&self) -> &'static str {
        match self {
            InspectError::BadField(_) => "bad_field",
            InspectError::UnknownId { .. } => "unknown_id",
            InspectError::NoHold(_) => "no_hold",
            InspectError::KeyNotFormed { .. } => "key_not_formed",
            InspectError::Store(_) => "store",
        }
    }
}

/// The fields of a lookup: each path with its value as JSON text.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KeyFields(Vec<(FieldPath, String)>);

impl KeyFields {
    /// Parses `FIELD=VALUE` arguments (see [`KeyFields::push`]).
    pub fn parse<'a>(args: impl IntoIterator<Item = &'a str>) -> Result<KeyFields, InspectError> {
        let mut fields = KeyFields::default();
        for arg in args {
            let (field, value) = arg.split_once('=').ok_or_else(|| {
                InspectError::BadField(format!("{arg:?}: expected FIELD=VALUE (e.g. user_id=u-17)"))
            })?;
            fields.push(field, value)?;
        }
        Ok(fields)
    }

    /// Adds `field` (a dotted path) with `value` typed as in rule files: `'…'` or `"…"` a
    /// string, `true` / `false` / `null`, a JSON number a number, anything else the string as
    /// written.
    pub fn push(&mut self, field: &str, value: &str) -> Result<(), InspectError> {
        let path = FieldPath::parse(field).ok_or_else(|| {
            InspectError::BadField(format!(
                "{field:?} is not a field path (e.g. user_id, card.country)"
            ))
        })?;
        if value.len() > MAX_VALUE_BYTES {
            return Err(InspectError::BadField(format!(
                "{field}: the value is longer than {MAX_VALUE_BYTES} bytes"
            )));
        }
        if self.0.len() >= MAX_FIELDS {
            return Err(InspectError::BadField(format!(
                "more than {MAX_FIELDS} fields in one lookup"
            )));
        }
        if self.0.iter().any(|(p, _)| overlaps(p, &path)) {
            return Err(InspectError::BadField(format!(
                "{field} is given twice (or inside another field given)"
            )));
        }
        self.0.push((path, typed_value(value)));
        Ok(())
    }

    /// The time the fields state in the event's time field (`ts`, or the field event time is
    /// taken from), as epoch milliseconds or RFC 3339: the time to look at.
    pub fn stated_time(&self, time: &TimeSource) -> Result<Option<i64>, InspectError> {
        let path = match time {
            TimeSource::Ts => "ts",
            TimeSource::Field(path) => path.as_str(),
            TimeSource::Record => return Ok(None),
        };
        let Some((_, text)) = self.0.iter().find(|(p, _)| p.as_str() == path) else {
            return Ok(None);
        };
        let parsed = match serde_json::from_str::<serde_json::Value>(text) {
            Ok(serde_json::Value::Number(n)) => n.as_i64(),
            Ok(serde_json::Value::String(s)) => chrono::DateTime::parse_from_rfc3339(&s)
                .ok()
                .map(|t| t.timestamp_millis()),
            _ => None,
        };
        parsed.map(Some).ok_or_else(|| {
            InspectError::BadField(format!(
                "{path}: {text} is not a time (epoch milliseconds or RFC 3339)"
            ))
        })
    }

    /// The event these fields make at `at_ms` (its time field set unless given).
    fn event_json(&self, time: &TimeSource, at_ms: i64) -> String {
        let mut root = Node::default();
        for (path, value) in &self.0 {
            root.insert(&path.segments().collect::<Vec<_>>(), value);
        }
        let time_path = match time {
            TimeSource::Ts | TimeSource::Record => Some("ts"),
            TimeSource::Field(path) => Some(path.as_str()),
        };
        if let Some(time_path) = time_path {
            let time_path = FieldPath::parse(time_path).expect("a valid path");
            if !self.0.iter().any(|(p, _)| overlaps(p, &time_path)) {
                root.insert(
                    &time_path.segments().collect::<Vec<_>>(),
                    &at_ms.to_string(),
                );
            }
        }
        let mut out = String::new();
        root.write(&mut out);
        out
    }
}

/// Whether one path is the other or inside it.
fn overlaps(a: &FieldPath, b: &FieldPath) -> bool {
    let (a, b) = (a.as_str(), b.as_str());
    let (short, long) = if a.len() <= b.len() { (a, b) } else { (b, a) };
    long == short
        || long
            .strip_prefix(short)
            .is_some_and(|rest| rest.starts_with('.'))
}

/// A value typed as in rule files, as JSON text.
fn typed_value(value: &str) -> String {
    let quoted = |q: char| {
        value
            .strip_prefix(q)
            .and_then(|v| v.strip_suffix(q))
            .filter(|_| value.len() >= 2)
    };
    if let Some(inner) = quoted('\'').or_else(|| quoted('"')) {
        return serde_json::to_string(inner).unwrap_or_default();
    }
    match value {
        "true" | "false" | "null" => return value.to_owned(),
        _ => {}
    }
    if serde_json::from_str::<&RawValue>(value).is_ok_and(|raw| {
        raw.get()
            .starts_with(|c: char| c == '-' || c.is_ascii_digit())
    }) {
        return value.to_owned();
    }
    serde_json::to_string(value).unwrap_or_default()
}

/// A JSON object being built from paths.
#[derive(Default)]
struct Node(BTreeMap<String, Result<String, Node>>);

impl Node {
    fn insert(&mut self, segments: &[&str], value: &str) {
        match segments {
            [] => {}
            [last] => {
                self.0.insert((*last).to_owned(), Ok(value.to_owned()));
            }
            [first, rest @ ..] => {
                let child = self
                    .0
                    .entry((*first).to_owned())
                    .or_insert_with(|| Err(Node::default()));
                if let Err(node) = child {
                    node.insert(rest, value);
                }
            }
        }
    }

    fn write(&self, out: &mut String) {
        out.push('{');
        for (i, (name, value)) in self.0.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(&serde_json::to_string(name).unwrap_or_default());
            out.push(':');
            match value {
                Ok(text) => out.push_str(text),
                Err(node) => node.write(out),
            }
        }
        out.push('}');
    }
}

/// A counter's window for one key, as an event at `at_ms` would see it.
#[derive(Debug, Serialize)]
pub struct CounterView {
    pub counter: String,
    pub aggregate: &'static str,
    pub window_ms: i64,
    pub bucket_ms: i64,
    /// The key, as decision records show it.
    pub key: Box<RawValue>,
    pub at_ms: i64,
    /// `counted` (a value), `empty` (nothing in the window: a `last`, `max` or `min` counter is
    /// then unknown) or `late` (the window has moved past `at_ms`).
    pub state: &'static str,
    /// The value an event at `at_ms` would read (null: unknown); for `last`, the kept value.
    pub value: Box<RawValue>,
    /// `last` counters: the kept event's time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value_time_ms: Option<i64>,
    /// The newest bucket counted: its start (`null`: never counted).
    pub head_ms: Option<i64>,
    pub buckets: Vec<BucketView>,
    /// Distinct counters: the values in the window at `at_ms`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub distinct_values: Option<i64>,
    /// The highest input offset applied to the key, per input lane (a Kafka partition).
    pub offsets: Vec<OffsetView>,
    /// Milliseconds until Redis forgets the key (`null`: in process, or no expiry).
    pub ttl_ms: Option<i64>,
    /// The key's name in Redis (`null`: in process).
    pub redis_key: Option<String>,
    /// The prefix of this counter's fields in that hash, when counters over the same dimensions
    /// share it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redis_field_prefix: Option<String>,
    /// This process counted into the key and has not written it to Redis yet.
    pub unflushed: bool,
}

/// One non-empty bucket of a window.
#[derive(Debug, Serialize)]
pub struct BucketView {
    pub from_ms: i64,
    /// Exclusive.
    pub to_ms: i64,
    /// Its count, sum, extreme, or (distinct) the values last seen in it.
    pub value: Box<RawValue>,
    /// Whether an event at `at_ms` sees it.
    pub in_window: bool,
}

#[derive(Debug, Serialize)]
pub struct OffsetView {
    pub lane: u64,
    pub offset: i64,
}

/// A rule's hold on one key and the counters its condition reads.
#[derive(Debug, Serialize)]
pub struct RuleView {
    pub rule: String,
    pub action: &'static str,
    pub mode: &'static str,
    pub at_ms: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hold: Option<HoldView>,
    /// Each counter the rule reads: its window, or why its key cannot be formed.
    pub counters: Vec<RuleCounter>,
}

#[derive(Debug, Serialize)]
pub struct HoldView {
    pub hold_ms: i64,
    /// The hold key (`null`: cannot be formed from the fields given).
    pub key: Option<Box<RawValue>>,
    /// Until when (event time) the key is held (`null`: not held).
    pub held_until_ms: Option<i64>,
    /// The event time of the firing that set it (`held_until - hold`).
    pub set_by_event_at_ms: Option<i64>,
    /// Whether an event at `at_ms` is held.
    pub held_at: bool,
}

#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum RuleCounter {
    Window(Box<CounterView>),
    NotFormed { counter: String, not_formed: String },
}

/// A hold ended by support (`vigil hold release`, `DELETE /v1/rules/{id}/hold`).
#[derive(Debug, Clone, Serialize)]
pub struct HoldRelease {
    pub kind: &'static str,
    pub rule: String,
    pub key: Box<RawValue>,
    pub reason: String,
    /// When it was released (wall clock, epoch ms).
    pub time: i64,
    /// Until when the key was held (`null`: it was not held).
    pub released_until: Option<i64>,
    pub rules_version: String,
}

impl HoldRelease {
    /// The audit record written to the decisions topic.
    pub fn record(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// A hold key: its bytes in the store, and as records show it.
type HoldKey = (Vec<u8>, String);

fn raw(text: String) -> Box<RawValue> {
    RawValue::from_string(text).unwrap_or_else(|_| RawValue::from_string("null".into()).unwrap())
}

/// Finds a counter or rule by id: `Ok(counter index)` or `Err(rule index)`; an unknown id is
/// an error naming the closest one.
pub fn find(rules: &RuleSet, id: &str) -> Result<Result<usize, usize>, InspectError> {
    if let Some(i) = rules.counters().iter().position(|c| c.id == id) {
        return Ok(Ok(i));
    }
    if let Some(i) = rules.rules().iter().position(|r| r.id == id) {
        return Ok(Err(i));
    }
    let ids = rules
        .counters()
        .iter()
        .map(|c| c.id.as_str())
        .chain(rules.rules().iter().map(|r| r.id.as_str()));
    let hint = ids
        .map(|known| (strsim::damerau_levenshtein(known, id), known))
        .filter(|&(d, _)| d <= 3)
        .min()
        .map_or(String::new(), |(_, known)| {
            format!(" (did you mean {known:?}?)")
        });
    Err(InspectError::UnknownId {
        id: id.to_owned(),
        hint,
    })
}

impl<S: CounterStore> Engine<S> {
    /// A counter's window (`id` a counter) or a rule's hold and counters (`id` a rule) for the
    /// key `fields` make, as an event at `at_ms` would see it (or at the time the fields give
    /// for the event's time field, `ts`).
    pub fn inspect(
        &mut self,
        id: &str,
        fields: &KeyFields,
        at_ms: i64,
    ) -> Result<Result<CounterView, RuleView>, InspectError> {
        let at_ms = fields.stated_time(&self.time_source)?.unwrap_or(at_ms);
        match find(self.rules(), id)? {
            Ok(counter) => {
                let json = fields.event_json(&self.time_source, at_ms);
                self.counter_view(counter, &json, at_ms).map(Ok)
            }
            Err(rule) => self.rule_view(rule, fields, at_ms).map(Err),
        }
    }

    fn counter_view(
        &mut self,
        counter: usize,
        event_json: &str,
        at_ms: i64,
    ) -> Result<CounterView, InspectError> {
        let rules = self.rules();
        let def = rules.counter(counter);
        let id = def.id.clone();
        let Some(position) = rules.counter_position(counter) else {
            return Err(InspectError::KeyNotFormed {
                what: format!("counter {id:?}"),
                needs: "it is disabled".into(),
            });
        };
        let event = crate::event::decode_at(event_json.as_bytes(), rules.projection(), Some(at_ms))
            .map_err(|e| InspectError::BadField(format!("the fields do not make an event: {e}")))?;
        let mut key = Vec::new();
        if !rules.counter_key(position, &event, &mut key) {
            let needs: Vec<&str> = def.dimensions.iter().map(|d| d.text()).collect();
            return Err(InspectError::KeyNotFormed {
                what: format!("counter {id:?}"),
                needs: format!("its dimensions: {}", needs.join(", ")),
            });
        }
        let key_json = record::key_json(rules, &event, counter);
        let spec = def.window;
        let window = self.windows[position];
        let inspected = self.store_mut().inspect(window, &key)?;
        let state = &inspected.state;
        let at_bucket = spec.bucket_of(at_ms);
        let amount = spec.aggregate.is_amount();
        let render = |v: i64| {
            if amount {
                record::micros_json(v)
            } else {
                v.to_string()
            }
        };
        let (state_name, value, value_time_ms) = if spec.aggregate == Aggregate::Last {
            match state.read_last(&spec, at_bucket) {
                (Applied::Counted(t), value) => {
                    ("counted", record::last_value_json(value.as_ref()), Some(t))
                }
                (Applied::Late, _) => ("late", "null".into(), None),
                _ => ("empty", "null".into(), None),
            }
        } else {
            match state.read(&spec, at_bucket) {
                Applied::Counted(v) => ("counted", render(v), None),
                Applied::Late => ("late", "null".into(), None),
                _ => ("empty", "null".into(), None),
            }
        };
        let head = state.head();
        let oldest_seen = head.unwrap_or(at_bucket).max(at_bucket) - spec.buckets + 1;
        let buckets = state
            .contributions(&spec)
            .into_iter()
            .map(|(bucket, contribution)| BucketView {
                from_ms: bucket.saturating_mul(spec.bucket_ms),
                to_ms: bucket.saturating_add(1).saturating_mul(spec.bucket_ms),
                value: raw(match spec.aggregate {
                    Aggregate::Last => contribution.to_string(),
                    _ => render(contribution),
                }),
                in_window: bucket >= oldest_seen && head.is_some_and(|h| bucket > h - spec.buckets),
            })
            .collect();
        Ok(CounterView {
            counter: id,
            aggregate: spec.aggregate.as_str(),
            window_ms: spec.window_ms(),
            bucket_ms: spec.bucket_ms,
            key: raw(key_json),
            at_ms,
            state: state_name,
            distinct_values: (spec.aggregate == Aggregate::Distinct && state_name == "counted")
                .then(|| value.parse().unwrap_or(0)),
            value: raw(value),
            value_time_ms,
            head_ms: head.map(|h| h.saturating_mul(spec.bucket_ms)),
            buckets,
            offsets: inspected
                .offsets
                .iter()
                .map(|&(lane, offset)| OffsetView { lane, offset })
                .collect(),
            ttl_ms: inspected.ttl_ms,
            redis_key: inspected.location,
            redis_field_prefix: inspected.field_prefix,
            unflushed: inspected.unflushed,
        })
    }

    /// The active position of rule `rule` and its hold key for `fields` at `at_ms` (`None`:
    /// not formed), after checking the rule is active.
    fn hold_key_of(
        &self,
        rule: usize,
        event_json: &str,
        at_ms: i64,
    ) -> Result<(usize, Option<HoldKey>), InspectError> {
        let rules = self.rules();
        let id = &rules.rule(rule).id;
        let position = rules
            .rule_position(rule)
            .ok_or_else(|| InspectError::KeyNotFormed {
                what: format!("rule {id:?}"),
                needs: "it is disabled".into(),
            })?;
        let event = crate::event::decode_at(event_json.as_bytes(), rules.projection(), Some(at_ms))
            .map_err(|e| InspectError::BadField(format!("the fields do not make an event: {e}")))?;
        let mut key = Vec::new();
        let formed = rules.hold_key(position, &event, &mut key);
        let json = record::hold_key_json(rules, &event, position);
        Ok((position, formed.then_some(key).zip(json)))
    }

    fn rule_view(
        &mut self,
        rule: usize,
        fields: &KeyFields,
        at_ms: i64,
    ) -> Result<RuleView, InspectError> {
        let json = fields.event_json(&self.time_source, at_ms);
        let (position, hold_key) = self.hold_key_of(rule, &json, at_ms)?;
        let def = self.rules().rule(rule);
        let (rule_id, action, mode) = (def.id.clone(), def.action.as_str(), def.mode.as_str());
        let hold_ms = def.hold.as_ref().map(|h| h.ms);
        let mut read: Vec<usize> = def.counters().to_vec();
        if let Form::V1 { counter, .. } = def.form {
            if !read.contains(&counter) {
                read.insert(0, counter);
            }
        }
        let hold = match (hold_ms, self.hold_spaces[position]) {
            (Some(hold_ms), Some(space)) => Some(match hold_key {
                Some((key, key_json)) => {
                    let until = self.store_mut().held_until(space, &key)?;
                    HoldView {
                        hold_ms,
                        key: Some(raw(key_json)),
                        held_until_ms: until,
                        set_by_event_at_ms: until.map(|u| u - hold_ms),
                        held_at: until.is_some_and(|u| at_ms < u),
                    }
                }
                None => HoldView {
                    hold_ms,
                    key: None,
                    held_until_ms: None,
                    set_by_event_at_ms: None,
                    held_at: false,
                },
            }),
            _ => None,
        };
        let mut counters = Vec::with_capacity(read.len());
        for counter in read {
            counters.push(match self.counter_view(counter, &json, at_ms) {
                Ok(view) => RuleCounter::Window(Box::new(view)),
                Err(InspectError::KeyNotFormed { needs, .. }) => RuleCounter::NotFormed {
                    counter: self.rules().counter(counter).id.clone(),
                    not_formed: needs,
                },
                Err(e) => return Err(e),
            });
        }
        Ok(RuleView {
            rule: rule_id,
            action,
            mode,
            at_ms,
            hold,
            counters,
        })
    }

    /// Ends the hold of rule `id` on the key `fields` make: the next event of that key is judged
    /// as if it had never been set. `now_ms` is the wall-clock time of the release.
    pub fn release_hold(
        &mut self,
        id: &str,
        fields: &KeyFields,
        reason: &str,
        now_ms: i64,
    ) -> Result<HoldRelease, InspectError> {
        let rule = match find(self.rules(), id)? {
            Err(rule) => rule,
            Ok(_) => {
                return Err(InspectError::BadField(format!(
                    "{id:?} is a counter: a hold belongs to a rule"
                )))
            }
        };
        if reason.trim().is_empty() {
            return Err(InspectError::BadField("a release needs a reason".into()));
        }
        let json = fields.event_json(&self.time_source, now_ms);
        let (position, hold_key) = self.hold_key_of(rule, &json, now_ms)?;
        let def = self.rules().rule(rule);
        let (Some(hold), Some(space)) = (&def.hold, self.hold_spaces[position]) else {
            return Err(InspectError::NoHold(id.to_owned()));
        };
        let Some((key, key_json)) = hold_key else {
            let needs: Vec<&str> = hold.key.iter().map(|k| k.text()).collect();
            return Err(InspectError::KeyNotFormed {
                what: format!("rule {id:?}"),
                needs: format!("its hold_key: {}", needs.join(", ")),
            });
        };
        let rules_version = self.rules().version().to_owned();
        let released_until = self.store_mut().release_hold(space, &key)?;
        Ok(HoldRelease {
            kind: "hold_release",
            rule: id.to_owned(),
            key: raw(key_json),
            reason: reason.to_owned(),
            time: now_ms,
            released_until,
            rules_version,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_typed_as_in_rule_files() {
        assert_eq!(typed_value("17"), "17");
        assert_eq!(typed_value("-1.5e3"), "-1.5e3");
        assert_eq!(typed_value("'17'"), "\"17\"");
        assert_eq!(typed_value("\"17\""), "\"17\"");
        assert_eq!(typed_value("u-17"), "\"u-17\"");
        assert_eq!(typed_value("true"), "true");
        assert_eq!(typed_value("null"), "null");
        assert_eq!(typed_value("'"), "\"'\"");
        assert_eq!(typed_value("[1]"), "\"[1]\"");
        assert_eq!(typed_value("18446744073709551615"), "18446744073709551615");
    }

    #[test]
    fn fields_make_a_nested_event_with_its_time() {
        let fields =
            KeyFields::parse(["card.country=FR", "user_id=17", "card.bin='4111'"]).unwrap();
        assert_eq!(
            fields.event_json(&TimeSource::Ts, 5),
            r#"{"card":{"bin":"4111","country":"FR"},"ts":5,"user_id":17}"#
        );
        let given = KeyFields::parse(["ts=9"]).unwrap();
        assert_eq!(given.event_json(&TimeSource::Ts, 5), r#"{"ts":9}"#);
    }

    #[test]
    fn a_released_hold_no_longer_holds_the_key_in_process() {
        use crate::store::MemoryStore;
        let rules = crate::rules::RuleSet::from_sources([(
            "r.toml",
            "[[rule]]\nid = \"big\"\naction = \"block\"\nwhen = \"amount > 100\"\nhold = \"1h\"\nhold_key = [\"card\"]\n",
        )])
        .unwrap();
        let mut engine = Engine::new(rules, MemoryStore::new()).with_time(
            crate::event::TimeBounds::default(),
            std::sync::Arc::new(crate::clock::FixedClock::new(1_000)),
        );
        let lines = r#"{"ts":1000,"card":"c-1","amount":500}
{"ts":2000,"card":"c-1","amount":5}
"#;
        let mut out = Vec::new();
        crate::pipeline::replay(
            &mut engine,
            lines.as_bytes(),
            &mut out,
            std::io::sink(),
            Default::default(),
        )
        .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out)
                .matches("\"reason\":\"held\"")
                .count(),
            1,
            "held: {}",
            String::from_utf8_lossy(&out)
        );
        let card = KeyFields::parse(["card=c-1"]).unwrap();
        let Err(view) = engine.inspect("big", &card, 2_000).unwrap() else {
            panic!("a rule")
        };
        assert_eq!(view.hold.as_ref().unwrap().held_until_ms, Some(3_601_000));
        let release = engine.release_hold("big", &card, "ticket 1", 99).unwrap();
        assert_eq!(
            release.record(),
            r#"{"kind":"hold_release","rule":"big","key":{"card":"c-1"},"reason":"ticket 1","time":99,"released_until":3601000,"rules_version":"#.to_owned()
                + &format!("{:?}}}", engine.rules().version())
        );
        let Err(view) = engine.inspect("big", &card, 2_000).unwrap() else {
            panic!("a rule")
        };
        assert_eq!(view.hold.unwrap().held_until_ms, None);
        out.clear();
        let next = r#"{"ts":3000,"card":"c-1","amount":5}"#;
        crate::pipeline::replay(
            &mut engine,
            next.as_bytes(),
            &mut out,
            std::io::sink(),
            Default::default(),
        )
        .unwrap();
        assert_eq!(String::from_utf8_lossy(&out), "", "not held any more");
        assert_eq!(
            engine
                .release_hold("big", &KeyFields::parse(["amount=1"]).unwrap(), "x", 0)
                .unwrap_err()
                .to_string(),
            "the key of rule \"big\" cannot be formed from the fields given (its hold_key: card)"
        );
        assert_eq!(
            engine
                .release_hold("big", &card, " ", 0)
                .unwrap_err()
                .to_string(),
            "a release needs a reason"
        );
    }

    #[test]
    fn bad_fields_say_why() {
        let message = |args: &[&str]| {
            KeyFields::parse(args.iter().copied())
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            message(&["user_id"]),
            "\"user_id\": expected FIELD=VALUE (e.g. user_id=u-17)"
        );
        assert_eq!(
            message(&["a=1", "a.b=2"]),
            "a.b is given twice (or inside another field given)"
        );
        assert_eq!(
            message(&["a..b=1"]),
            "\"a..b\" is not a field path (e.g. user_id, card.country)"
        );
    }
}
