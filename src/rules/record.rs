//! The decision record: a [`Decision`] for one event written as one JSON object, mostly
//! copied from the constant parts of the rule set's records, rendered once at load. Pure.

use super::decide::{counter_value, Decision, Hit};
use super::json::{
    write_decimal, write_int, write_number, write_scalar, write_str, write_str_body,
};
use super::model::{Action, Form, Mode};
use super::record_parts::RecordParts;
use super::set::RuleSet;
use crate::event::{Event, FieldValue, Scalar};
use crate::window::{Aggregate, LastValue};

/// Where an event came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventSource<'a> {
    /// Replay: 1-based line number of the input.
    Line(u64),
    Kafka {
        topic: &'a str,
        partition: i32,
        offset: i64,
    },
}

/// Appends the decision record for `event` to `out` as one JSON object (no newline): its
/// `decision_id` (from `source`, deterministic, for downstream de-duplication), `event_id`,
/// `ts`, `action`, `rules_version`, `hits` and `source`.
pub fn write_record(
    out: &mut Vec<u8>,
    rules: &RuleSet,
    event: &Event<'_>,
    decision: &Decision,
    source: EventSource<'_>,
) {
    let parts = rules.record_parts();
    out.extend_from_slice(b"{\"decision_id\":\"");
    match source {
        EventSource::Line(line) => {
            out.extend_from_slice(b"line/");
            write_int(out, line);
        }
        EventSource::Kafka {
            topic,
            partition,
            offset,
        } => {
            write_str_body(out, topic);
            out.push(b'/');
            write_int(out, partition);
            out.push(b'/');
            write_int(out, offset);
        }
    }
    out.extend_from_slice(b"\",\"event_id\":");
    // As the event wrote it: an id is text to whoever issued it (`1.50` stays `1.50`, `1e3` stays `1e3`).
    match event.event_id() {
        FieldValue::Number(n) => write_number(out, &n.exact, event.event_id_text()),
        id @ FieldValue::Str(_) => write_scalar(out, id.scalar()),
        _ => write_scalar(out, None),
    }
    out.extend_from_slice(b",\"ts\":");
    write_int(out, event.ts);
    out.extend_from_slice(b",\"action\":\"");
    out.extend_from_slice(
        decision
            .action(rules)
            .map_or("allow", Action::as_str)
            .as_bytes(),
    );
    out.push(b'"');
    if let Some(score) = decision.score {
        out.extend_from_slice(b",\"score\":");
        write_decimal(out, &crate::decimal::Decimal::from_micros(score));
    }
    out.extend_from_slice(&parts.version);
    for (i, hit) in decision.hits.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_hit(out, rules, parts, event, hit);
    }
    out.extend_from_slice(b"],\"source\":");
    match source {
        EventSource::Line(line) => {
            out.extend_from_slice(b"{\"line\":");
            write_int(out, line);
        }
        EventSource::Kafka {
            topic,
            partition,
            offset,
        } => {
            out.extend_from_slice(b"{\"topic\":");
            write_str(out, topic);
            out.extend_from_slice(b",\"partition\":");
            write_int(out, partition);
            out.extend_from_slice(b",\"offset\":");
            write_int(out, offset);
        }
    }
    out.extend_from_slice(b"}}");
}

fn write_hit(
    out: &mut Vec<u8>,
    rules: &RuleSet,
    parts: &RecordParts,
    event: &Event<'_>,
    hit: &Hit,
) {
    let rule = rules.rule(hit.rule);
    out.extend_from_slice(&parts.rule_heads[hit.rule][usize::from(hit.mode == Mode::Shadow)]);
    if let Some(reason) = hit.reason {
        out.extend_from_slice(b",\"reason\":\"");
        out.extend_from_slice(reason.as_str().as_bytes());
        out.push(b'"');
    }
    match rule.form {
        Form::V1 { counter, .. } => {
            out.extend_from_slice(b",\"key\":");
            write_key(out, rules, parts, event, counter);
            out.extend_from_slice(b",\"value\":");
            match hit.value {
                Some(v) => {
                    write_decimal(out, &counter_value(rules.counter(counter).aggregate(), v))
                }
                None => out.extend_from_slice(b"null"),
            }
            out.extend_from_slice(&parts.rule_limits[hit.rule]);
        }
        Form::V2 => {
            out.extend_from_slice(b",\"counters\":[");
            for (i, &(counter, raw)) in hit.counters.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(&parts.counter_heads[counter]);
                write_key(out, rules, parts, event, counter);
                out.extend_from_slice(b",\"value\":");
                match rules.counter(counter).aggregate() {
                    Aggregate::Last => write_last(
                        out,
                        hit.values
                            .iter()
                            .find(|(c, _)| *c == counter)
                            .map(|(_, v)| v),
                    ),
                    aggregate => write_decimal(out, &counter_value(aggregate, raw)),
                }
                out.extend_from_slice(&parts.counter_tails[counter]);
            }
            out.push(b']');
        }
    }
    if rule.hold.is_some() {
        out.extend_from_slice(b",\"held_until\":");
        match hit.held_until {
            Some(until) => write_int(out, until),
            None => out.extend_from_slice(b"null"),
        }
    }
    write_entity(out, rules, parts, event, hit.rule);
    out.extend_from_slice(&parts.rule_tails[hit.rule]);
    if hit.degraded {
        out.extend_from_slice(b",\"degraded\":true");
    }
    out.push(b'}');
}

/// A `last` counter's value (null if unknown).
fn write_last(out: &mut Vec<u8>, value: Option<&LastValue>) {
    write_scalar(
        out,
        value.map(|v| match v {
            LastValue::Bool(b) => Scalar::Bool(*b),
            LastValue::Num(d) => Scalar::Number(d),
            LastValue::Str(s) => Scalar::Str(s),
        }),
    );
}

/// A `last` counter's value as records show it (`null` if unknown).
pub fn last_value_json(value: Option<&LastValue>) -> String {
    let mut out = Vec::new();
    write_last(&mut out, value);
    String::from_utf8(out).unwrap_or_default()
}

/// An amount in micro-units as records show a sum.
pub fn micros_json(micros: i64) -> String {
    let mut out = Vec::new();
    write_decimal(&mut out, &crate::decimal::Decimal::from_micros(micros));
    String::from_utf8(out).unwrap_or_default()
}

/// `,"entity":{…}` when the rule names one and every value of it can be formed.
fn write_entity(
    out: &mut Vec<u8>,
    rules: &RuleSet,
    parts: &RecordParts,
    event: &Event<'_>,
    rule: usize,
) {
    let plan = rules.entity_plan(rule);
    if plan.is_empty() {
        return;
    }
    let mark = out.len();
    out.extend_from_slice(b",\"entity\":{");
    let mut formed = true;
    plan.for_each_value(event, |i, value| match value {
        Some(value) if formed => {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(&parts.entity_names[rule][i]);
            write_scalar(out, Some(value));
        }
        _ => formed = false,
    });
    if formed {
        out.push(b'}');
    } else {
        out.truncate(mark);
    }
}

/// A counter's key for `event` as records show it (`{"user_id":"u-17"}`: canonical values, long
/// ones quoted by prefix, length and digest).
pub fn key_json(rules: &RuleSet, event: &Event<'_>, counter: usize) -> String {
    let mut out = Vec::new();
    write_key(&mut out, rules, rules.record_parts(), event, counter);
    String::from_utf8(out).unwrap_or_default()
}

/// The hold key of the rule at active `position` for `event`, as records show keys; `None` if
/// the rule has no hold or a value is missing.
pub fn hold_key_json(rules: &RuleSet, event: &Event<'_>, position: usize) -> Option<String> {
    let rule = rules.rule(rules.active().nth(position)?);
    let hold = rule.hold.as_ref()?;
    let mut out = vec![b'{'];
    let mut formed = true;
    rules.hold_plan(position).for_each_value(event, |i, value| {
        if i > 0 {
            out.push(b',');
        }
        super::json::write_str(&mut out, hold.key[i].text());
        out.push(b':');
        formed &= value.is_some();
        write_scalar(&mut out, value);
    });
    out.push(b'}');
    formed.then(|| String::from_utf8(out).unwrap_or_default())
}

/// A counter's dimension values for this event, by path, as canonical JSON scalars.
fn write_key(
    out: &mut Vec<u8>,
    rules: &RuleSet,
    parts: &RecordParts,
    event: &Event<'_>,
    counter: usize,
) {
    out.push(b'{');
    let names = &parts.counter_paths[counter];
    rules
        .dimension_plan(counter)
        .for_each_value(event, |i, value| {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(&names[i]);
            write_scalar(out, value);
        });
    out.push(b'}');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::decode;
    use crate::rules::decide::Reason;
    use serde_json::{json, Value};
    use smallvec::SmallVec;

    fn rules() -> RuleSet {
        RuleSet::from_sources([(
            "r.toml",
            r#"
[[rule]]
id = "v1-sum"
action = "review"
match = { type = "pay" }
dimensions = ["card.id", "geo"]
window = "1h"
aggregate = "sum"
field = "amount"
limit = 10.5

[[counter]]
id = "fails"
dimensions = ["user"]
window = "10m"

[[rule]]
id = "v2"
action = "block"
mode = "shadow"
when = "$fails > 0 && $v1-sum >= 0"
hold = "30m"
hold_key = ["user"]
"#,
        )])
        .unwrap()
    }

    #[test]
    fn a_record_is_the_json_object_the_documentation_shows() {
        let rules = rules();
        let line = br#"{"event_id":"e\"1","ts":1700000000000,"type":"pay","user":"u\n1","card":{"id":7},"geo":"FR","amount":1.25}"#;
        let event = decode(line, rules.projection()).unwrap();
        let (v1, v2) = (
            rules.rules().iter().position(|r| r.id == "v1-sum").unwrap(),
            1,
        );
        let (sum, fails) = (
            rules
                .counters()
                .iter()
                .position(|c| c.id == "v1-sum")
                .unwrap(),
            rules
                .counters()
                .iter()
                .position(|c| c.id == "fails")
                .unwrap(),
        );
        let decision = Decision {
            hits: vec![
                Hit {
                    rule: v1,
                    mode: Mode::Enforce,
                    value: Some(12_500_000),
                    reason: None,
                    degraded: false,
                    counters: SmallVec::new(),
                    held_until: None,
                    values: Vec::new(),
                },
                Hit {
                    rule: v2,
                    mode: Mode::Shadow,
                    value: None,
                    reason: Some(Reason::Held),
                    degraded: true,
                    counters: [(fails, 3), (sum, 1_250_000)].into_iter().collect(),
                    held_until: Some(1_700_001_800_000),
                    values: Vec::new(),
                },
            ],
            score: None,
        };
        let mut out = Vec::new();
        write_record(
            &mut out,
            &rules,
            &event,
            &decision,
            EventSource::Kafka {
                topic: "ev\"ents",
                partition: 3,
                offset: 42,
            },
        );
        let record: Value = serde_json::from_slice(&out).unwrap();
        let expected = json!({
            "decision_id": "ev\"ents/3/42",
            "event_id": "e\"1",
            "ts": 1_700_000_000_000i64,
            "action": "review",
            "rules_version": rules.version(),
            "hits": [
                {"rule_id": "v1-sum", "mode": "enforce", "action": "review", "key": {"card.id": 7, "geo": "FR"},
                 "value": 12.5, "limit": 10.5, "window_ms": 3_600_000},
                {"rule_id": "v2", "mode": "shadow", "action": "block", "reason": "held",
                 "counters": [
                    {"id": "fails", "key": {"user": "u\n1"}, "value": 3, "window_ms": 600_000},
                    {"id": "v1-sum", "key": {"card.id": 7, "geo": "FR"}, "value": 1.25, "window_ms": 3_600_000}
                 ],
                 "held_until": 1_700_001_800_000i64, "entity": {"user": "u\n1"}, "degraded": true}
            ],
            "source": {"topic": "ev\"ents", "partition": 3, "offset": 42}
        });
        assert_eq!(record, expected);
        // Exact decimals are printed as written, never through a double.
        assert!(String::from_utf8(out)
            .unwrap()
            .contains(r#""value":12.5,"limit":10.5,"#));
    }

    #[test]
    fn a_replay_record_has_a_line_id_and_null_for_what_is_missing() {
        let rules = rules();
        let event = decode(
            br#"{"ts":5,"type":"pay","user":"u","card":{"id":"c"},"geo":"FR","amount":1}"#,
            rules.projection(),
        )
        .unwrap();
        let decision = Decision {
            hits: vec![Hit {
                rule: 1,
                mode: Mode::Shadow,
                value: None,
                reason: Some(Reason::When),
                degraded: false,
                counters: SmallVec::new(),
                held_until: None,
                values: Vec::new(),
            }],
            score: None,
        };
        let mut out = Vec::new();
        write_record(&mut out, &rules, &event, &decision, EventSource::Line(9));
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            text,
            format!(
                r#"{{"decision_id":"line/9","event_id":null,"ts":5,"action":"allow","rules_version":"{}","hits":[{{"rule_id":"v2","mode":"shadow","action":"block","reason":"when","counters":[],"held_until":null,"entity":{{"user":"u"}}}}],"source":{{"line":9}}}}"#,
                rules.version()
            )
        );
    }
}
