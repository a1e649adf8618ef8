//! `vigil check --events`: what a sample of real events says about a rule set — the mistakes that
//! pass validation and only ever show up as "0 hits": a mistyped field path, a number where the
//! events carry a string (`mcc = 8398` against `"8398"`), `ts` in epoch seconds. Pure: the
//! caller feeds the sample's lines ([`Sample::add_line`]) and prints the warnings.

use std::collections::BTreeMap;
use std::fmt::Write;

use super::expr::{BinOp, Compiled, Expr, Literal};
use super::lists::ListSet;
use super::model::KeyPart;
use super::model::{FileLocation, MatchValue, Scope};
use super::RuleSet;
use crate::event::{shorten, FieldPath};

/// JSON types as bits.
const NULL: u8 = 1;
const BOOL: u8 = 2;
const NUMBER: u8 = 4;
const STRING: u8 = 8;
const OBJECT: u8 = 16;
const ARRAY: u8 = 32;

/// Deepest object nesting the sample's paths are collected from.
const MAX_DEPTH: usize = 16;

/// Most distinct paths remembered (a sample of hostile lines cannot grow it without bound).
const MAX_PATHS: usize = 100_000;

/// What the sample's events carry: every path (through objects) with the JSON types seen there.
#[derive(Debug, Default)]
pub struct Sample {
    /// Lines that were JSON objects.
    pub events: u64,
    paths: BTreeMap<String, Seen>,
    /// Numeric values of the time field, for the unit check.
    numeric_times: Vec<f64>,
    time_field: String,
}

#[derive(Debug, Default)]
struct Seen {
    kinds: u8,
    /// The first value seen, shortened, for messages.
    example: String,
}

impl Sample {
    /// A sample whose events carry their time in `time_field` (`ts` by default).
    pub fn new(time_field: &str) -> Sample {
        Sample {
            time_field: time_field.to_owned(),
            ..Sample::default()
        }
    }

    /// Adds one line; false if it is not a JSON object (the caller counts it as bad).
    pub fn add_line(&mut self, line: &[u8]) -> bool {
        let Ok(serde_json::Value::Object(map)) = serde_json::from_slice(line) else {
            return false;
        };
        self.events += 1;
        let mut prefix = String::new();
        self.walk(&map, &mut prefix, 0);
        if let Some(time) = map
            .get(&self.time_field)
            .and_then(serde_json::Value::as_f64)
        {
            if self.numeric_times.len() < 100_000 {
                self.numeric_times.push(time);
            }
        }
        true
    }

    fn walk(
        &mut self,
        map: &serde_json::Map<String, serde_json::Value>,
        prefix: &mut String,
        depth: usize,
    ) {
        for (name, value) in map {
            let at = prefix.len();
            if !prefix.is_empty() {
                prefix.push('.');
            }
            prefix.push_str(name);
            let kind = match value {
                serde_json::Value::Null => NULL,
                serde_json::Value::Bool(_) => BOOL,
                serde_json::Value::Number(_) => NUMBER,
                serde_json::Value::String(_) => STRING,
                serde_json::Value::Object(_) => OBJECT,
                serde_json::Value::Array(_) => ARRAY,
            };
            if self.paths.len() < MAX_PATHS || self.paths.contains_key(prefix.as_str()) {
                let seen = self.paths.entry(prefix.clone()).or_default();
                if seen.kinds & kind == 0 && matches!(kind, NUMBER | STRING | BOOL) {
                    if !seen.example.is_empty() {
                        seen.example.push_str(", ");
                    }
                    let text = value.to_string();
                    seen.example.push_str(&shorten(&text));
                }
                seen.kinds |= kind;
            }
            if let serde_json::Value::Object(inner) = value {
                if depth < MAX_DEPTH {
                    self.walk(inner, prefix, depth + 1);
                }
            }
            prefix.truncate(at);
        }
    }
}

/// Who reads a path: "counter X" or "rule Y", and where it is defined.
struct Reader<'r> {
    what: String,
    origin: &'r FileLocation,
}

/// One field a counter or rule compares with literals of `kinds` (bits), e.g. `mcc = 8398`.
struct Comparison {
    path: FieldPath,
    kinds: u8,
    written: String,
}

/// The warnings the sample gives about `rules`, each starting with the `file:line:col` of the
/// counter or rule concerned.
pub fn lint(rules: &RuleSet, sample: &Sample) -> Vec<String> {
    let mut warnings = Vec::new();
    if sample.events == 0 {
        return warnings;
    }
    // The paths each active counter and rule reads, and what they compare them with.
    let mut reads: BTreeMap<String, Vec<Reader<'_>>> = BTreeMap::new();
    let mut comparisons: Vec<(Reader<'_>, Comparison)> = Vec::new();
    let slots = SlotPaths::new(rules);
    for index in rules.active_counters() {
        let counter = rules.counter(index);
        let reader = || Reader {
            what: format!("counter {}", counter.id),
            origin: &counter.origin,
        };
        let mut paths: Vec<FieldPath> =
            counter.dimensions.iter().flat_map(KeyPart::paths).collect();
        paths.extend(counter.field.clone());
        paths.extend(counter.tuple.iter().flat_map(KeyPart::paths));
        scope_paths(&counter.scope, &slots, &mut paths, &mut |c| {
            comparisons.push((reader(), c))
        });
        for path in paths {
            reads
                .entry(path.as_str().to_owned())
                .or_default()
                .push(reader());
        }
    }
    for index in rules.active() {
        let rule = rules.rule(index);
        let reader = || Reader {
            what: format!("rule {}", rule.id),
            origin: &rule.origin,
        };
        let mut paths: Vec<FieldPath> = Vec::new();
        scope_paths(&rule.scope, &slots, &mut paths, &mut |c| {
            comparisons.push((reader(), c))
        });
        if let Some(when) = &rule.when {
            expr_paths(when, &slots, &mut paths, &mut |c| {
                comparisons.push((reader(), c))
            });
        }
        if let Some(hold) = &rule.hold {
            paths.extend(hold.key.iter().flat_map(KeyPart::paths));
        }
        paths.extend(rule.entity.iter().flat_map(KeyPart::paths));
        if let Some(rollout) = &rule.rollout {
            paths.extend(rollout.key.iter().flat_map(KeyPart::paths));
        }
        for path in paths {
            reads
                .entry(path.as_str().to_owned())
                .or_default()
                .push(reader());
        }
    }
    for (path, readers) in &reads {
        if sample.paths.contains_key(path) {
            continue;
        }
        let mut readers_text = readers.iter().map(|r| r.what.clone()).collect::<Vec<_>>();
        readers_text.dedup();
        let mut message = format!(
            "{}: field \"{}\" ({}) never occurs in the {} sample events",
            readers[0].origin,
            shorten(path),
            readers_text.join(", "),
            sample.events
        );
        if let Some(parent) = non_object_parent(sample, path) {
            let _ = write!(message, ": \"{parent}\" is never an object there");
        } else if let Some(near) = nearest(sample, path) {
            let _ = write!(message, "; did you mean \"{near}\"?");
        }
        warnings.push(message);
    }
    for (reader, comparison) in comparisons {
        let Some(seen) = sample.paths.get(comparison.path.as_str()) else {
            continue;
        };
        let scalars = seen.kinds & (NUMBER | STRING | BOOL);
        if scalars != 0 && scalars & comparison.kinds == 0 {
            warnings.push(format!(
                "{}: {} compares \"{}\" with {}, but the sample's \"{}\" is {} (e.g. {}): it can never be equal",
                reader.origin,
                reader.what,
                comparison.path,
                comparison.written,
                comparison.path,
                kinds_text(scalars),
                seen.example
            ));
        }
    }
    if let Some(warning) = time_unit(sample) {
        warnings.push(warning);
    }
    warnings
}

/// A numeric time field whose values look like seconds or microseconds, not milliseconds.
fn time_unit(sample: &Sample) -> Option<String> {
    let mut times = sample.numeric_times.clone();
    if times.is_empty() {
        return None;
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let field = &sample.time_field;
    // Epoch milliseconds of this century are 13 digits; seconds 10, microseconds 16.
    if (1e8..1e11).contains(&median) {
        Some(format!(
            "\"{field}\" looks like epoch seconds (median {median:.0}): vigil reads it as milliseconds, so these events are in January 1970 — multiply by 1000 or send an RFC 3339 string"
        ))
    } else if median >= 1e14 {
        Some(format!(
            "\"{field}\" looks like epoch microseconds or nanoseconds (median {median:.0}): vigil reads milliseconds, up to the end of year 9999 — divide it, or send an RFC 3339 string"
        ))
    } else {
        None
    }
}

/// The first proper prefix of `path` that the sample carries but never as an object.
fn non_object_parent(sample: &Sample, path: &str) -> Option<String> {
    let mut at = 0;
    while let Some(dot) = path[at..].find('.') {
        let parent = &path[..at + dot];
        if let Some(seen) = sample.paths.get(parent) {
            if seen.kinds & OBJECT == 0 {
                return Some(parent.to_owned());
            }
        }
        at += dot + 1;
    }
    None
}

/// The sample path closest to `path`, if close enough to be a typo of it.
fn nearest(sample: &Sample, path: &str) -> Option<String> {
    closest(path, sample.paths.keys().map(String::as_str)).map(str::to_owned)
}

/// The candidate `word` is most likely a typo of (Jaro–Winkler similarity at least 0.85), for
/// "did you mean" in rule files and in `check --events`.
pub(crate) fn closest<'c>(
    word: &str,
    candidates: impl Iterator<Item = &'c str>,
) -> Option<&'c str> {
    candidates
        .map(|candidate| (strsim::jaro_winkler(word, candidate), candidate))
        .filter(|(score, _)| *score >= 0.85)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, candidate)| candidate)
}

fn kinds_text(kinds: u8) -> String {
    let names: Vec<&str> = [
        (STRING, "a string"),
        (NUMBER, "a number"),
        (BOOL, "a boolean"),
    ]
    .iter()
    .filter(|(bit, _)| kinds & bit != 0)
    .map(|&(_, name)| name)
    .collect();
    names.join(" or ")
}

/// Projection slots back to paths, for the expressions' `Field(slot)`.
struct SlotPaths(BTreeMap<usize, FieldPath>);

impl SlotPaths {
    fn new(rules: &RuleSet) -> SlotPaths {
        let mut projection = rules.projection().clone();
        let mut map = BTreeMap::new();
        let mut add = |compiled: &Compiled| {
            for path in &compiled.paths {
                // Slots exist already: asking again returns the same one.
                map.insert(projection.slot(path), path.clone());
            }
        };
        for counter in rules.counters() {
            if let Scope::Expr(compiled) = &counter.scope {
                add(compiled);
            }
        }
        for rule in rules.rules() {
            if let Scope::Expr(compiled) = &rule.scope {
                add(compiled);
            }
            if let Some(when) = &rule.when {
                add(when);
            }
        }
        SlotPaths(map)
    }
}

fn scope_paths(
    scope: &Scope,
    slots: &SlotPaths,
    paths: &mut Vec<FieldPath>,
    found: &mut dyn FnMut(Comparison),
) {
    match scope {
        Scope::All => {}
        Scope::Table(matchers) => {
            for matcher in matchers {
                paths.push(matcher.path.clone());
                let kinds = matcher.any_of.iter().fold(0, |k, v| {
                    k | match v {
                        MatchValue::Bool(_) => BOOL,
                        MatchValue::Number(_) => NUMBER,
                        MatchValue::Str(_) => STRING,
                    }
                });
                let written: Vec<String> = matcher
                    .any_of
                    .iter()
                    .take(3)
                    .map(|v| match v {
                        MatchValue::Bool(b) => b.to_string(),
                        MatchValue::Number(d) => format!("{d} (a number)"),
                        MatchValue::Str(s) => format!("{:?} (a string)", shorten(s)),
                    })
                    .collect();
                found(Comparison {
                    path: matcher.path.clone(),
                    kinds,
                    written: written.join(", "),
                });
            }
        }
        Scope::Expr(compiled) => expr_paths(compiled, slots, paths, found),
    }
}

fn expr_paths(
    compiled: &Compiled,
    slots: &SlotPaths,
    paths: &mut Vec<FieldPath>,
    found: &mut dyn FnMut(Comparison),
) {
    paths.extend(compiled.paths.iter().cloned());
    comparisons(&compiled.expr, slots, found);
}

fn literal_kind(literal: &Literal) -> (u8, String) {
    match literal {
        Literal::Null => (NULL, "null".into()),
        Literal::Bool(b) => (BOOL, b.to_string()),
        Literal::Num(d) => (NUMBER, format!("{d} (a number)")),
        Literal::Str(s) => (STRING, format!("{:?} (a string)", shorten(s))),
    }
}

/// Every `field OP literal` (either way round) and `field in [...]` / `in @list` in `expr`.
fn comparisons(expr: &Expr, slots: &SlotPaths, found: &mut dyn FnMut(Comparison)) {
    let mut report = |slot: usize, kinds: u8, written: String| {
        if let Some(path) = slots.0.get(&slot) {
            found(Comparison {
                path: path.clone(),
                kinds,
                written,
            });
        }
    };
    match expr {
        Expr::FieldIsStr { slot, text, .. } => {
            report(*slot, STRING, format!("{:?} (a string)", shorten(text)))
        }
        Expr::Bin(op, l, r) if !matches!(op, BinOp::And | BinOp::Or) => {
            let literal = |e: &Expr| match e {
                Expr::Num(n) => n
                    .exact
                    .as_ref()
                    .map(|d| (NUMBER, format!("{d} (a number)"))),
                Expr::Lit(Literal::Null) => None,
                Expr::Lit(l) => Some(literal_kind(l)),
                _ => None,
            };
            match (&**l, &**r) {
                (Expr::Field(slot), other) | (other, Expr::Field(slot)) => {
                    if let Some((kinds, written)) = literal(other) {
                        report(*slot, kinds, written);
                    }
                }
                _ => {}
            }
            comparisons(l, slots, found);
            comparisons(r, slots, found);
        }
        Expr::InSet {
            value,
            strings,
            set,
            ..
        } => {
            if let Expr::Field(slot) = &**value {
                let mut kinds = if strings.is_empty() { 0 } else { STRING };
                for literal in set {
                    kinds |= literal_kind(literal).0;
                }
                report(*slot, kinds & !NULL, "the values of its [...] list".into());
            }
        }
        Expr::InList { value, list, .. } => {
            if let Expr::Field(slot) = &**value {
                let (kinds, what) = match &**list {
                    ListSet::Strings(_) => (STRING, "a string list"),
                    ListSet::Numbers(_) => (NUMBER, "a number list"),
                    ListSet::Networks(_) => (STRING, "a cidr list (of string addresses)"),
                    ListSet::StringMap(_) => (STRING, "a map with string keys"),
                    ListSet::NumberMap(_) => (NUMBER, "a map with number keys"),
                };
                report(*slot, kinds, what.into());
            }
        }
        Expr::Bin(_, l, r)
        | Expr::StartsWith(l, r)
        | Expr::EndsWith(l, r)
        | Expr::Contains(l, r) => {
            comparisons(l, slots, found);
            comparisons(r, slots, found);
        }
        Expr::Not(e) | Expr::Neg(e) | Expr::Lower(e) | Expr::Matches(e, _) => {
            comparisons(e, slots, found)
        }
        _ => {}
    }
}
