//! The plain-words descriptions `vigil check` prints: what a counter counts, which events a rule
//! judges, when it fires and what it does. Pure.

use super::model::{format_duration, Counter, Form, MatchValue, Rule, Scope};
use super::set::RuleSet;
use crate::window::Aggregate;

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
        Scope::Expr(compiled) => Some(source.map_or_else(
            || format!("an expression over {}", paths(&compiled.paths)),
            str::to_owned,
        )),
    }
}

fn paths(paths: &[crate::event::FieldPath]) -> String {
    paths
        .iter()
        .map(|p| p.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

fn what_counts(counter: &Counter) -> String {
    let dims: Vec<&str> = counter.dimensions.iter().map(|p| p.text()).collect();
    let what = match (&counter.field, counter.aggregate()) {
        (Some(f), Aggregate::Sum) => format!(
            "sum of {f}{}",
            if counter.allow_negative {
                " (negative allowed)"
            } else {
                ""
            }
        ),
        (Some(f), Aggregate::Distinct) => {
            format!("distinct {f} (at most {})", counter.window.max_distinct)
        }
        (None, Aggregate::Distinct) if !counter.tuple.is_empty() => {
            let tuple: Vec<&str> = counter.tuple.iter().map(|p| p.text()).collect();
            format!(
                "distinct ({}) (at most {})",
                tuple.join(", "),
                counter.window.max_distinct
            )
        }
        (Some(f), Aggregate::Max) => format!("largest {f}"),
        (Some(f), Aggregate::Min) => format!("smallest {f}"),
        (Some(f), Aggregate::Last) => format!("{f} of the previous event"),
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
    let scope = describe_scope(&counter.scope, counter.scope_text.as_deref())
        .map_or_else(String::new, |s| format!(" where {s}"));
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
            let scope =
                scope.map_or_else(|| "every event".to_owned(), |s| format!("events where {s}"));
            match (&rule.when, &rule.when_text) {
                (Some(_), Some(text)) => format!("judges {scope}; fires when {text}"),
                _ => format!("fires on {scope}"),
            }
        }
    };
    let hold = rule.hold.as_ref().map_or_else(String::new, |hold| {
        let key: Vec<String> = hold.key.iter().map(ToString::to_string).collect();
        format!(
            "; then holds {} for {}",
            key.join(" + "),
            format_duration(hold.ms)
        )
    });
    let mut v3 = String::new();
    if rule.priority != 0 || rule.is_final {
        v3.push_str(&format!("; priority {}", rule.priority));
        if rule.is_final {
            v3.push_str(", final (suppresses lower priorities)");
        }
    }
    if let Some(score) = rule.score {
        v3.push_str(&format!(
            "; score {}",
            crate::decimal::Decimal::from_micros(score)
        ));
    }
    if rule.calls_score {
        v3.push_str("; judged after the scoring rules");
    }
    if let Some(rollout) = &rule.rollout {
        let key: Vec<&str> = rollout.key.iter().map(|p| p.text()).collect();
        v3.push_str(&format!(
            "; {} for {}% of {} (shadow for the rest)",
            rule.mode.as_str(),
            rollout.percent,
            key.join(" + ")
        ));
    }
    // Unless it is the hold key (said already).
    if !rule.entity.is_empty() && rule.hold.as_ref().is_none_or(|h| h.key != rule.entity) {
        let entity: Vec<&str> = rule.entity.iter().map(|p| p.text()).collect();
        v3.push_str(&format!("; about {}", entity.join(" + ")));
    }
    format!("{head} {body}{hold}{v3}  [{origin}]", origin = rule.origin)
}

/// One line per counter and per rule for `vigil check`.
pub fn summaries(rules: &RuleSet) -> Vec<String> {
    // In file order: counters and rules as they are written.
    let mut lines: Vec<((&str, usize), String)> = Vec::new();
    for counter in rules.counters() {
        if !counter.from_rule {
            lines.push((
                (&counter.origin.file, counter.origin.line),
                describe_counter(counter),
            ));
        }
    }
    for rule in rules.rules() {
        lines.push((
            (&rule.origin.file, rule.origin.line),
            describe_rule(rules, rule),
        ));
    }
    lines.sort_by_key(|(key, _)| *key);
    lines.into_iter().map(|(_, l)| l).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_and_rules_read_as_plain_words() {
        let text = r#"
[[counter]]
id = "spend"
match = "type == 'pay'"
dimensions = ["card.id"]
window = "1h"
aggregate = "sum"
field = "amount"

[[rule]]
id = "v1"
action = "review"
match = { type = ["login", "signup"] }
dimensions = ["user"]
window = "10m"
limit = 5
enabled = false

[[rule]]
id = "v2"
action = "block"
mode = "shadow"
when = "$spend > 100"
hold = "30m"
hold_key = ["card.id"]
"#;
        let rules = RuleSet::from_sources([("r.toml", text)]).unwrap();
        let lines: Vec<String> = std::iter::once(describe_counter(&rules.counters()[0]))
            .chain(rules.rules().iter().map(|rule| describe_rule(&rules, rule)))
            .collect();
        assert_eq!(
            lines,
            [
                "counter spend: sum of amount per card.id over 1h (bucket 1m) where type == 'pay'  [r.toml:2:1]",
                "rule v1 (disabled): review/enforce count of events per user over 10m (bucket 10s) > 5 where type is one of \"login\", \"signup\"  [r.toml:10:1]",
                "rule v2: block/shadow judges every event; fires when $spend > 100; then holds card.id for 30m  [r.toml:19:1]",
            ]
        );
    }
}
