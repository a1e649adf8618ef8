//! `vigil backtest`: replay with the in-process store, plus what a rule author wants to know per
//! rule — how many events it matched and hit, how many distinct keys, when it first and last hit,
//! and, on `vigil gen` input, how many of the injected fraud events it caught.

use std::collections::{BTreeMap, HashSet};
use std::io::{self, BufRead, Write};

use serde::Serialize;

use super::engine::Engine;
use super::replay::{read_line_bounded, LineRead, ReplayError, DEFAULT_MAX_EVENT_BYTES};
use super::tuning::{self, Distribution, Label, Labelled, Peaks, Sweep, SweptForm, TopKey, Values};
use crate::decimal::Decimal;
use crate::event::{decode, Event, FieldPath};
use crate::rules::expr::{CounterCmp, Expr};
use crate::rules::{Decision, Form, RuleSet, ScopeMemo, SkipReason};
use crate::store::{InputPosition, MemoryStore};

/// One rule's results.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RuleReport {
    pub rule_id: String,
    pub mode: &'static str,
    pub action: &'static str,
    /// Events whose `match` held.
    pub matched: u64,
    /// Events the rule hit.
    pub hits: u64,
    /// Distinct dimension keys among the hits.
    pub keys_hit: u64,
    /// Event time (epoch ms) of the first and last hit.
    pub first_hit_ts: Option<i64>,
    pub last_hit_ts: Option<i64>,
    /// Hits / events judged.
    pub hit_share: f64,
    /// Hits / events in its scope (`matched`).
    pub hit_share_in_scope: f64,
    /// Injected fraud events hit, by pattern.
    pub fraud_caught: BTreeMap<String, u64>,
    /// Its hits by the events' label (`--label`), with precision and recall.
    pub labelled: Labelled,
}

/// One counter's results: what it counted, what it could not count, and why.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CounterReport {
    pub counter_id: String,
    /// Events it counted.
    pub counted: u64,
    /// Events in its scope it did not count because they were late for their key's window or
    /// behind the input's watermark.
    pub late: u64,
    /// Events in its scope not counted, by reason.
    pub skipped: BTreeMap<&'static str, u64>,
    /// The same, by reason and the field (a dimension entry, or the counted field) that made
    /// each event skip.
    pub skipped_fields: BTreeMap<&'static str, BTreeMap<String, u64>>,
    /// Distinct values not recorded: the key's window held `max_distinct` values.
    pub distinct_capped: u64,
    /// Its value at the events it counted or a rule judged with it (read without counting).
    pub values: Option<Distribution>,
    /// The keys whose value peaked highest.
    pub top_keys: Vec<TopKey>,
    /// More keys than tracked for `top_keys` (the later ones were not).
    pub keys_untracked: bool,
}

/// A line whose time was more than the lateness bound ahead of the line after it: it moved the
/// watermark past the input's other events, which were then late for every counter.
#[derive(Debug, Clone, Default, Serialize)]
pub struct WatermarkJump {
    pub line: u64,
    /// Its event time (epoch ms).
    pub ts: i64,
    /// The event time of the next event (epoch ms).
    pub next_ts: i64,
    /// Events behind the watermark while this line set it.
    pub late_events: u64,
}

/// Most watermark jumps tracked (an input of nothing but jumps costs no more).
const MAX_JUMPS: usize = 1_000;

/// The whole report.
#[derive(Debug, Clone, Default, Serialize)]
pub struct BacktestReport {
    pub lines: u64,
    pub events: u64,
    pub bad_lines: u64,
    /// Events behind the input's watermark (`--max-lateness`): late for every counter.
    pub late_events: u64,
    /// Lines that moved the watermark past the input's other events and made them late, most
    /// late events first.
    pub watermark_jumps: Vec<WatermarkJump>,
    /// Events with at least one hit.
    pub decided: u64,
    /// Injected fraud events in the input (`"fraud":"<pattern>"`), by pattern.
    pub fraud_events: BTreeMap<String, u64>,
    /// Injected fraud events hit by at least one enforce-mode rule, by pattern.
    pub fraud_caught: BTreeMap<String, u64>,
    pub rules: Vec<RuleReport>,
    pub counters: Vec<CounterReport>,
    /// The label field (`--label`) and the events it marks as fraud and as legitimate.
    pub label: String,
    pub labelled_fraud: u64,
    pub labelled_legit: u64,
    /// `--sweep`: v1-form rules re-judged at candidate limits.
    pub sweeps: Vec<Sweep>,
    /// `--compare`: events the other rule set decided differently (action, or which rules hit
    /// in which mode with which action), and the first [`MAX_DIFFERENCES`] of them.
    pub differing_events: Option<u64>,
    pub differences: Vec<Difference>,
}

/// Most differing events a `--compare` report lists (all are counted).
pub const MAX_DIFFERENCES: usize = 10_000;

/// One event decided differently by the two rule sets: its line and both records.
#[derive(Debug, Clone, Serialize)]
pub struct Difference {
    pub line: u64,
    pub record: Box<serde_json::value::RawValue>,
    pub other_record: Box<serde_json::value::RawValue>,
}

/// What a backtest measures beyond hits: the label field, the rules to sweep, and another rule
/// set to compare decisions with (its own engine, bounded as the first).
pub struct BacktestOptions {
    pub label: FieldPath,
    pub sweeps: Vec<Sweep>,
    pub compare: Option<Engine<MemoryStore>>,
}

impl Default for BacktestOptions {
    fn default() -> Self {
        BacktestOptions {
            label: FieldPath::parse("fraud").expect("a valid path"),
            sweeps: Vec::new(),
            compare: None,
        }
    }
}

/// What identifies a decision for `--compare`: the action and each hit's rule, mode and action.
fn decision_shape<'r>(
    rules: &'r RuleSet,
    decision: &Decision,
) -> (
    Option<&'static str>,
    Vec<(&'r str, &'static str, &'static str)>,
) {
    (
        decision.action(rules).map(|a| a.as_str()),
        decision
            .hits
            .iter()
            .map(|hit| {
                let rule = rules.rule(hit.rule);
                (rule.id.as_str(), hit.mode.as_str(), rule.action.as_str())
            })
            .collect(),
    )
}

fn record_json(
    rules: &RuleSet,
    event: &Event,
    decision: &Decision,
    line: u64,
) -> Box<serde_json::value::RawValue> {
    let mut out = Vec::new();
    crate::rules::record::write_record(
        &mut out,
        rules,
        event,
        decision,
        crate::rules::EventSource::Line(line),
    );
    serde_json::value::RawValue::from_string(String::from_utf8(out).unwrap_or_default())
        .unwrap_or_else(|_| {
            serde_json::value::RawValue::from_string("null".into()).expect("valid JSON")
        })
}

/// Checks `--sweep` requests against the rules: each names an enabled rule in the v1 form
/// (`window` + `limit`), whose limit the sweep replaces, or one whose whole `when` compares a
/// counter with a number (`$c > N`, `$c >= N`), whose number it replaces.
pub fn plan_sweeps(
    rules: &RuleSet,
    requests: &[(String, Vec<Decimal>)],
) -> Result<Vec<Sweep>, String> {
    requests
        .iter()
        .map(|(rule_id, limits)| {
            let index = rules
                .rules()
                .iter()
                .position(|r| &r.id == rule_id)
                .ok_or_else(|| format!("--sweep: no rule {rule_id:?}"))?;
            let rule = rules.rule(index);
            let (counter, form) = match (&rule.form, rule.when.as_deref().map(|w| &w.expr)) {
                (Form::V1 { counter, .. }, _) => (*counter, SweptForm::V1),
                (
                    _,
                    Some(Expr::CounterCmp {
                        cmp: cmp @ (CounterCmp::Gt | CounterCmp::Ge),
                        index: counter,
                        ..
                    }),
                ) => (
                    *counter,
                    SweptForm::When {
                        rule: index,
                        at_least: *cmp == CounterCmp::Ge,
                    },
                ),
                _ => {
                    return Err(format!(
                        "--sweep: rule {rule_id:?} has neither a `limit` nor a `when` of the form \"$counter > N\" or \"$counter >= N\" (the two forms a sweep re-judges)"
                    ))
                }
            };
            if rules.counter_position(counter).is_none() || rules.rule_position(index).is_none() {
                return Err(format!("--sweep: rule {rule_id:?} is disabled"));
            }
            let scale = if rules.counter(counter).aggregate().is_amount() {
                6
            } else {
                0
            };
            Ok(Sweep {
                rule_id: rule_id.clone(),
                counter,
                form,
                candidates: limits
                    .iter()
                    .map(|limit| tuning::Candidate {
                        limit: limit.clone(),
                        threshold: limit.floor_scaled(scale),
                        ceiling: (-limit)
                            .floor_scaled(scale)
                            .checked_neg()
                            .unwrap_or(i64::MAX),
                        hits: 0,
                        keys: 0,
                        labelled: Labelled::default(),
                        keys_hit: HashSet::new(),
                    })
                    .collect(),
            })
        })
        .collect()
}

/// The pattern of an injected event (`"fraud":"…"`), read only from lines that mention it.
fn fraud_tag(line: &[u8]) -> Option<String> {
    memchr::memmem::find(line, b"\"fraud\":")?;
    let value: serde_json::Value = serde_json::from_slice(line).ok()?;
    value.get("fraud")?.as_str().map(str::to_owned)
}

/// Runs the rules of `engine` over `input`; `progress` is called with the lines read so far every
/// 65 536 lines.
pub fn backtest(
    engine: &mut Engine<MemoryStore>,
    input: impl BufRead,
    options: BacktestOptions,
    mut progress: impl FnMut(u64),
) -> Result<BacktestReport, ReplayError> {
    let rules = engine.rules().clone();
    let mut tally = Tally::new(&rules);
    tally.report.label = options.label.as_str().to_owned();
    tally.report.sweeps = options.sweeps;
    let mut other = options.compare.map(|engine| {
        let rules = engine.rules().clone();
        (engine, rules)
    });
    if other.is_some() {
        tally.report.differing_events = Some(0);
    }
    let mut input = input;
    let mut line = Vec::new();
    loop {
        line.clear();
        match read_line_bounded(&mut input, &mut line, DEFAULT_MAX_EVENT_BYTES)? {
            LineRead::End => break,
            LineRead::Line => {}
            LineRead::TooLarge(_) => {
                tally.report.lines += 1;
                tally.report.bad_lines += 1;
                continue;
            }
        }
        tally.report.lines += 1;
        if tally.report.lines % 65_536 == 0 {
            progress(tally.report.lines);
        }
        let text = line.strip_suffix(b"\n").unwrap_or(&line);
        let text = text.strip_suffix(b"\r").unwrap_or(text);
        if text.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let event = match decode(text, rules.projection())
            .and_then(|event| engine.admit(&event).map(|()| event))
        {
            Ok(event) => event,
            Err(_) => {
                tally.report.bad_lines += 1;
                continue;
            }
        };
        tally.watch_watermark(engine, &event);
        let fraud = fraud_tag(text);
        if let Some(tag) = &fraud {
            *tally.report.fraud_events.entry(tag.clone()).or_default() += 1;
        }
        let decision = engine.evaluate(
            &event,
            InputPosition {
                lane: 0,
                offset: tally.report.lines as i64,
            },
        )?;
        let label = tuning::label_of(text, &options.label);
        match label {
            Label::Fraud => tally.report.labelled_fraud += 1,
            Label::Legit => tally.report.labelled_legit += 1,
            Label::Unlabelled => {}
        }
        if let Some((other, other_rules)) = &mut other {
            compare(
                &mut tally.report,
                other,
                other_rules,
                text,
                &rules,
                &event,
                &decision,
            )?;
        }
        tally.decision(&rules, &event, &decision, fraud.as_ref(), label);
        tally.values(engine, &rules, &event, label);
        tally.count_late(engine, &event);
    }
    Ok(tally.finish(engine, &rules))
}

/// Judges the same line with the other rule set and records the event if its decision differs.
fn compare(
    report: &mut BacktestReport,
    other: &mut Engine<MemoryStore>,
    other_rules: &RuleSet,
    text: &[u8],
    rules: &RuleSet,
    event: &Event,
    decision: &Decision,
) -> Result<(), ReplayError> {
    let line = report.lines;
    // Its own projection: the other rules may read other fields.
    let Ok(other_event) = decode(text, other_rules.projection()) else {
        return Ok(());
    };
    if other.admit(&other_event).is_err() {
        return Ok(());
    }
    let other_decision = other.evaluate(
        &other_event,
        InputPosition {
            lane: 0,
            offset: line as i64,
        },
    )?;
    if decision_shape(rules, decision) != decision_shape(other_rules, &other_decision) {
        let count = report.differing_events.get_or_insert(0);
        *count += 1;
        if report.differences.len() < MAX_DIFFERENCES {
            report.differences.push(Difference {
                line,
                record: record_json(rules, event, decision, line),
                other_record: record_json(other_rules, &other_event, &other_decision, line),
            });
        }
    }
    Ok(())
}

/// The report being built, with each active rule's set of keys hit.
struct Tally {
    report: BacktestReport,
    /// The active rules' indexes, in report order.
    active: Vec<usize>,
    keys: Vec<HashSet<Vec<u8>>>,
    key: Vec<u8>,
    /// The line holding the input's newest event time, and that time.
    newest: Option<(u64, i64)>,
    /// The newest event time of the other lines.
    runner_up: Option<i64>,
    /// The last line that jumped the watermark.
    jump: Option<u64>,
    /// Events behind the watermark so far (to tell whether the last one was).
    behind: u64,
    /// Per active counter: its values at counted events, and its keys' peaks.
    values: Vec<Values>,
    peaks: Vec<Peaks>,
    /// Lines that jumped the watermark, by line.
    jumps: BTreeMap<u64, WatermarkJump>,
    /// For the sweeps of `when` rules: whether the rule judges the event.
    memo: ScopeMemo,
    /// Per active counter: its dimension skips so far, and by dimension entry.
    dimension_skips: Vec<u64>,
    missing_dimensions: Vec<BTreeMap<usize, u64>>,
}

impl Tally {
    fn new(rules: &RuleSet) -> Tally {
        let active: Vec<usize> = rules.active().collect();
        let report = BacktestReport {
            rules: active
                .iter()
                .map(|&index| {
                    let rule = rules.rule(index);
                    RuleReport {
                        rule_id: rule.id.clone(),
                        mode: rule.mode.as_str(),
                        action: rule.action.as_str(),
                        ..RuleReport::default()
                    }
                })
                .collect(),
            ..BacktestReport::default()
        };
        Tally {
            report,
            keys: vec![HashSet::new(); active.len()],
            active,
            key: Vec::new(),
            newest: None,
            runner_up: None,
            jump: None,
            behind: 0,
            jumps: BTreeMap::new(),
            values: vec![Values::default(); rules.active_counters().len()],
            peaks: vec![Peaks::default(); rules.active_counters().len()],
            memo: rules.scope_memo(),
            dimension_skips: vec![0; rules.active_counters().len()],
            missing_dimensions: vec![BTreeMap::new(); rules.active_counters().len()],
        }
    }

    /// Before `event` is judged: the line holding the newest time jumped the watermark if it is
    /// more than the lateness bound ahead of both the newest event before it and this one.
    fn watch_watermark(&mut self, engine: &Engine<MemoryStore>, event: &Event) {
        let Some(lateness) = engine.bounds().max_lateness_ms else {
            return;
        };
        let Some((line, ts)) = self.newest else {
            return;
        };
        let ahead_of = |other: i64| ts.saturating_sub(other) > lateness;
        if ahead_of(event.ts)
            && self.runner_up.is_none_or(ahead_of)
            && !self.jumps.contains_key(&line)
            && self.jumps.len() < MAX_JUMPS
        {
            self.jumps.insert(
                line,
                WatermarkJump {
                    line,
                    ts,
                    next_ts: event.ts,
                    late_events: 0,
                },
            );
            self.jump = Some(line);
        }
    }

    /// After `event` is judged: a late event that the last jump alone made late is charged to
    /// it; the newest time moves on.
    fn count_late(&mut self, engine: &Engine<MemoryStore>, event: &Event) {
        let behind = engine.counts().behind_watermark;
        if behind > self.behind {
            let lateness = engine.bounds().max_lateness_ms.unwrap_or(i64::MAX);
            if let Some(jump) = self.jump.and_then(|line| self.jumps.get_mut(&line)) {
                if jump.ts.saturating_sub(lateness) > event.ts {
                    jump.late_events += behind - self.behind;
                }
            }
            self.behind = behind;
        }
        match self.newest {
            Some((_, ts)) if event.ts <= ts => {
                self.runner_up = Some(self.runner_up.map_or(event.ts, |r| r.max(event.ts)));
            }
            previous => {
                self.runner_up = previous.map(|(_, ts)| ts).or(self.runner_up);
                self.newest = Some((self.report.lines, event.ts));
            }
        }
    }

    /// Counts one event's decision: per rule hit, its times, fraud caught and key.
    fn decision(
        &mut self,
        rules: &RuleSet,
        event: &Event,
        decision: &Decision,
        fraud: Option<&String>,
        label: Label,
    ) {
        let report = &mut self.report;
        if !decision.is_empty() {
            report.decided += 1;
            if let (Some(tag), Some(_)) = (fraud, decision.action(rules)) {
                *report.fraud_caught.entry(tag.clone()).or_default() += 1;
            }
        }
        for hit in &decision.hits {
            let Some(position) = self.active.iter().position(|&i| i == hit.rule) else {
                continue;
            };
            let rule = &mut report.rules[position];
            rule.hits += 1;
            rule.labelled.hit(label);
            rule.first_hit_ts.get_or_insert(event.ts);
            rule.last_hit_ts = Some(event.ts);
            if let Some(tag) = fraud {
                *rule.fraud_caught.entry(tag.clone()).or_default() += 1;
            }
            // Whom the hit is about: the rule's entity, else the key of the counter it fires
            // on (a v1 rule's own, else the first its condition names).
            let counter = match rules.rule(hit.rule).form {
                Form::V1 { counter, .. } => Some(counter),
                Form::V2 => rules.rule(hit.rule).counters().first().copied(),
            };
            let formed = rules.entity_key(hit.rule, event, &mut self.key)
                || counter
                    .and_then(|c| rules.counter_position(c))
                    .is_some_and(|p| rules.counter_key(p, event, &mut self.key));
            if formed && !self.keys[position].contains(&self.key) {
                self.keys[position].insert(self.key.clone());
            }
        }
    }

    /// After `event` is judged: each counter's value if the event fed it, its key's peak, and
    /// the sweeps' candidates.
    fn values(
        &mut self,
        engine: &Engine<MemoryStore>,
        rules: &RuleSet,
        event: &Event,
        label: Label,
    ) {
        for (position, index) in rules.active_counters().enumerate() {
            let skips = engine.dimension_skips(position);
            if skips > self.dimension_skips[position] {
                self.dimension_skips[position] = skips;
                if let Some(entry) = rules.missing_dimension(index, event) {
                    *self.missing_dimensions[position].entry(entry).or_default() += 1;
                }
            }
            // A `last` counter's value is no amount: it has no distribution or peak.
            if rules.counter(index).aggregate() == crate::window::Aggregate::Last {
                continue;
            }
            let Some((raw, key)) = engine.known_value(position) else {
                continue;
            };
            self.values[position].add(raw);
            self.peaks[position].add(key, raw, || {
                crate::rules::record::key_json(rules, event, index)
            });
        }
        for sweep in &mut self.report.sweeps {
            let Some(position) = rules.counter_position(sweep.counter) else {
                continue;
            };
            let value = match sweep.form {
                SweptForm::V1 => engine.counted_value(position),
                SweptForm::When { rule, .. } => {
                    self.memo.reset();
                    let judged = rules
                        .rule_position(rule)
                        .is_some_and(|p| rules.in_scope(p, event, &mut self.memo));
                    judged.then(|| engine.known_value(position)).flatten()
                }
            };
            let Some((raw, key)) = value else {
                continue;
            };
            for candidate in &mut sweep.candidates {
                if candidate.fires(sweep.form, raw) {
                    candidate.hits += 1;
                    candidate.labelled.hit(label);
                    if !candidate.keys_hit.contains(key) {
                        candidate.keys_hit.insert(key.to_vec());
                    }
                }
            }
        }
    }

    /// The engine's counts (events, rules in scope) and the shares.
    fn finish(mut self, engine: &mut Engine<MemoryStore>, rules: &RuleSet) -> BacktestReport {
        let report = &mut self.report;
        report.events = engine.counts().events;
        report.late_events = engine.counts().behind_watermark;
        let mut jumps: Vec<WatermarkJump> = std::mem::take(&mut self.jumps)
            .into_values()
            .filter(|jump| jump.late_events > 0)
            .collect();
        jumps.sort_by(|a, b| b.late_events.cmp(&a.late_events).then(a.line.cmp(&b.line)));
        report.watermark_jumps = jumps;
        let mut counts: BTreeMap<usize, crate::pipeline::CounterCounts> =
            engine.take_counter_counts().collect();
        report.counters = rules
            .active_counters()
            .enumerate()
            .map(|(position, index)| {
                let counts = counts.remove(&index).unwrap_or_default();
                let aggregate = rules.counter(index).aggregate();
                CounterReport {
                    counter_id: rules.counter(index).id.clone(),
                    counted: counts.counted,
                    late: counts.late,
                    skipped: SkipReason::ALL
                        .iter()
                        .map(|reason| (reason.code(), counts.skipped[reason.index()]))
                        .filter(|&(_, n)| n > 0)
                        .collect(),
                    skipped_fields: skipped_fields(
                        rules.counter(index),
                        &counts.skipped,
                        &self.missing_dimensions[position],
                    ),
                    distinct_capped: counts.capped,
                    values: self.values[position].summary(aggregate),
                    top_keys: self.peaks[position].top(aggregate),
                    keys_untracked: self.peaks[position].untracked,
                }
            })
            .collect();
        for (position, counts) in engine.take_rule_counts() {
            if let Some(p) = self.active.iter().position(|&i| i == position) {
                report.rules[p].matched = counts.matched;
            }
        }
        for (rule, keys) in report.rules.iter_mut().zip(&self.keys) {
            rule.keys_hit = keys.len() as u64;
            rule.hit_share = rule.hits as f64 / report.events.max(1) as f64;
            rule.hit_share_in_scope = rule.hits as f64 / rule.matched.max(1) as f64;
            rule.labelled.finish(report.labelled_fraud);
        }
        for sweep in &mut report.sweeps {
            for candidate in &mut sweep.candidates {
                candidate.keys = candidate.keys_hit.len() as u64;
                candidate.keys_hit = HashSet::new();
                candidate.labelled.finish(report.labelled_fraud);
            }
        }
        self.report
    }
}

/// Skips by reason and the field that made them: a dimension entry for a missing dimension (as
/// counted event by event), the counted field (or a tuple's entries) for the other reasons.
fn skipped_fields(
    counter: &crate::rules::Counter,
    skipped: &[u64],
    missing: &BTreeMap<usize, u64>,
) -> BTreeMap<&'static str, BTreeMap<String, u64>> {
    let mut fields = BTreeMap::new();
    for reason in SkipReason::ALL {
        let n = skipped[reason.index()];
        if n == 0 {
            continue;
        }
        let by_field: BTreeMap<String, u64> = match reason {
            SkipReason::Dimension => missing
                .iter()
                .filter_map(|(&i, &n)| Some((counter.dimensions.get(i)?.text().to_owned(), n)))
                .collect(),
            _ => {
                let field = match &counter.field {
                    Some(path) => path.as_str().to_owned(),
                    None => counter
                        .tuple
                        .iter()
                        .map(|k| k.text())
                        .collect::<Vec<_>>()
                        .join(", "),
                };
                BTreeMap::from([(field, n)])
            }
        };
        fields.insert(reason.code(), by_field);
    }
    fields
}

/// Most watermark jumps named in warnings (the JSON report lists them all).
const JUMPS_WARNED: usize = 10;

/// A warning per line that moved the watermark past the input's other events (most late events
/// first), and how many more there were.
pub fn watermark_warnings(report: &BacktestReport) -> Vec<String> {
    let mut warnings: Vec<String> = report
        .watermark_jumps
        .iter()
        .take(JUMPS_WARNED)
        .map(|jump| {
            let ahead = std::time::Duration::from_millis(jump.ts.saturating_sub(jump.next_ts).max(0) as u64 / 1000 * 1000);
            format!(
                "line {}: its time ({}) is {} ahead of the event after it ({}): it moved the watermark past the \
                 input's other events, and {} of them were then late for every counter. A stray event from another \
                 time? Remove it, or raise --max-lateness",
                jump.line,
                time(Some(jump.ts)),
                humantime::format_duration(ahead),
                time(Some(jump.next_ts)),
                jump.late_events,
            )
        })
        .collect();
    if report.watermark_jumps.len() > JUMPS_WARNED {
        warnings.push(format!(
            "{} more lines moved the watermark past other events (see --json)",
            report.watermark_jumps.len() - JUMPS_WARNED
        ));
    }
    warnings
}

fn time(ts: Option<i64>) -> String {
    ts.and_then(chrono::DateTime::from_timestamp_millis)
        .map_or_else(
            || "-".to_owned(),
            |t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string(),
        )
}

/// The report as a table for the terminal.
pub fn write_table(report: &BacktestReport, out: &mut impl Write) -> io::Result<()> {
    writeln!(
        out,
        "{} events ({} bad lines, {} late for every counter), {} with a hit ({:.2}%)",
        report.events,
        report.bad_lines,
        report.late_events,
        report.decided,
        100.0 * report.decided as f64 / report.events.max(1) as f64
    )?;
    let id_width = report
        .rules
        .iter()
        .map(|r| r.rule_id.chars().count())
        .max()
        .unwrap_or(0)
        .max(4);
    writeln!(
        out,
        "{:<id_width$} {:<7} {:<9} {:>9} {:>8} {:>7} {:<23} {:<23} {:>7} {:>9}  caught",
        "rule",
        "mode",
        "action",
        "matched",
        "hits",
        "keys",
        "first hit",
        "last hit",
        "hit %",
        "in scope"
    )?;
    for rule in &report.rules {
        let caught: Vec<String> = rule
            .fraud_caught
            .iter()
            .map(|(pattern, n)| {
                format!(
                    "{pattern} {n}/{}",
                    report.fraud_events.get(pattern).copied().unwrap_or(0)
                )
            })
            .collect();
        writeln!(
            out,
            "{:<id_width$} {:<7} {:<9} {:>9} {:>8} {:>7} {:<23} {:<23} {:>6.2}% {:>8.2}%  {}",
            rule.rule_id,
            rule.mode,
            rule.action,
            rule.matched,
            rule.hits,
            rule.keys_hit,
            time(rule.first_hit_ts),
            time(rule.last_hit_ts),
            100.0 * rule.hit_share,
            100.0 * rule.hits as f64 / rule.matched.max(1) as f64,
            if caught.is_empty() {
                "-".to_owned()
            } else {
                caught.join(", ")
            }
        )?;
    }
    let width = report
        .counters
        .iter()
        .map(|c| c.counter_id.len())
        .max()
        .unwrap_or(0)
        .max(7);
    writeln!(
        out,
        "{:<width$} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}  not counted",
        "counter", "counted", "late", "p50", "p90", "p99", "max"
    )?;
    for counter in &report.counters {
        let (p50, p90, p99, max) = counter.values.as_ref().map_or_else(
            || {
                (
                    "-".to_owned(),
                    "-".to_owned(),
                    "-".to_owned(),
                    "-".to_owned(),
                )
            },
            |d| {
                (
                    d.p50.to_string(),
                    d.p90.to_string(),
                    d.p99.to_string(),
                    d.max.to_string(),
                )
            },
        );
        let mut reasons: Vec<String> = counter
            .skipped
            .iter()
            .map(|(reason, n)| {
                let fields = counter.skipped_fields.get(reason);
                match fields.map(|f| f.iter().collect::<Vec<_>>()).as_deref() {
                    Some([(field, _)]) => format!("{reason} {n} ({field})"),
                    Some(many) if !many.is_empty() => format!(
                        "{reason} {n} ({})",
                        many.iter()
                            .map(|(field, n)| format!("{field} {n}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                    _ => format!("{reason} {n}"),
                }
            })
            .collect();
        if counter.distinct_capped > 0 {
            reasons.push(format!("over max_distinct {}", counter.distinct_capped));
        }
        writeln!(
            out,
            "{:<width$} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}  {}",
            counter.counter_id,
            counter.counted,
            counter.late,
            p50,
            p90,
            p99,
            max,
            if reasons.is_empty() {
                "-".to_owned()
            } else {
                reasons.join(", ")
            }
        )?;
    }
    if report.counters.iter().any(|c| !c.top_keys.is_empty()) {
        writeln!(out, "top keys by peak value:")?;
        for counter in &report.counters {
            let top: Vec<String> = counter
                .top_keys
                .iter()
                .map(|k| format!("{} {}", k.key, k.peak))
                .collect();
            if !top.is_empty() {
                writeln!(out, "  {:<width$} {}", counter.counter_id, top.join(", "))?;
            }
        }
    }
    let ratio = |r: Option<f64>| r.map_or_else(|| "-".to_owned(), |r| format!("{:.1}%", 100.0 * r));
    let labelled_line = |out: &mut dyn Write, name: &str, l: &Labelled| {
        writeln!(
            out,
            "  {:<26} {:>10} {:>10} {:>10} {:>9} {:>7}",
            name,
            l.fraud_hits,
            l.legit_hits,
            l.unlabelled_hits,
            ratio(l.precision),
            ratio(l.recall)
        )
    };
    if report.labelled_fraud + report.labelled_legit > 0 {
        writeln!(
            out,
            "labels ({}): {} fraud, {} legitimate, {} unlabelled events",
            report.label,
            report.labelled_fraud,
            report.labelled_legit,
            report
                .events
                .saturating_sub(report.labelled_fraud + report.labelled_legit)
        )?;
        writeln!(
            out,
            "  {:<26} {:>10} {:>10} {:>10} {:>9} {:>7}",
            "rule", "fraud hits", "legit hits", "unlabelled", "precision", "recall"
        )?;
        for rule in &report.rules {
            labelled_line(out, &rule.rule_id, &rule.labelled)?;
        }
    }
    for sweep in &report.sweeps {
        writeln!(out, "sweep of {}:", sweep.rule_id)?;
        writeln!(
            out,
            "  {:<12} {:>8} {:>7} {:>10} {:>10} {:>10} {:>9} {:>7}",
            "limit",
            "hits",
            "keys",
            "fraud hits",
            "legit hits",
            "unlabelled",
            "precision",
            "recall"
        )?;
        for c in &sweep.candidates {
            writeln!(
                out,
                "  {:<12} {:>8} {:>7} {:>10} {:>10} {:>10} {:>9} {:>7}",
                c.limit.to_string(),
                c.hits,
                c.keys,
                c.labelled.fraud_hits,
                c.labelled.legit_hits,
                c.labelled.unlabelled_hits,
                ratio(c.labelled.precision),
                ratio(c.labelled.recall)
            )?;
        }
    }
    if let Some(differing) = report.differing_events {
        writeln!(
            out,
            "{differing} events decided differently by the other rule set{}",
            if differing > 20 {
                " (the first 20; --json lists up to 10 000)"
            } else {
                ""
            }
        )?;
        let shape = |record: &serde_json::value::RawValue| {
            let value: serde_json::Value = serde_json::from_str(record.get()).unwrap_or_default();
            let hits: Vec<String> = value["hits"]
                .as_array()
                .map(|hits| {
                    hits.iter()
                        .map(|h| match h["mode"].as_str() {
                            Some("shadow") => {
                                format!("{} (shadow)", h["rule_id"].as_str().unwrap_or("?"))
                            }
                            _ => h["rule_id"].as_str().unwrap_or("?").to_owned(),
                        })
                        .collect()
                })
                .unwrap_or_default();
            format!(
                "{} [{}]",
                value["action"].as_str().unwrap_or("allow"),
                hits.join(", ")
            )
        };
        for difference in report.differences.iter().take(20) {
            writeln!(
                out,
                "  line {}: {} → {}",
                difference.line,
                shape(&difference.record),
                shape(&difference.other_record)
            )?;
        }
    }
    for warning in watermark_warnings(report) {
        writeln!(out, "warning: {warning}")?;
    }
    if !report.fraud_events.is_empty() {
        writeln!(out, "injected fraud caught by enforce-mode rules:")?;
        for (pattern, total) in &report.fraud_events {
            let caught = report.fraud_caught.get(pattern).copied().unwrap_or(0);
            writeln!(
                out,
                "  {pattern:<22} {caught}/{total} events ({:.1}%)",
                100.0 * caught as f64 / (*total).max(1) as f64
            )?;
        }
    }
    Ok(())
}
