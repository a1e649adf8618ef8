//! `vigil backtest`: replay with the in-process store, plus what a rule author wants to know per
//! rule — how many events it matched and hit, how many distinct keys, when it first and last hit,
//! and, on `vigil gen` input, how many of the injected fraud events it caught.

use std::collections::{BTreeMap, HashSet};
use std::io::{self, BufRead, Write};

use serde::Serialize;

use super::engine::Engine;
use super::replay::{read_line_bounded, LineRead, ReplayError, DEFAULT_MAX_EVENT_BYTES};
use crate::event::{decode, Event};
use crate::rules::{Decision, Form, RuleSet};
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
    /// Injected fraud events hit, by pattern.
    pub fraud_caught: BTreeMap<String, u64>,
}

/// The whole report.
#[derive(Debug, Clone, Default, Serialize)]
pub struct BacktestReport {
    pub lines: u64,
    pub events: u64,
    pub bad_lines: u64,
    /// Events with at least one hit.
    pub decided: u64,
    /// Injected fraud events in the input (`"fraud":"<pattern>"`), by pattern.
    pub fraud_events: BTreeMap<String, u64>,
    /// Injected fraud events hit by at least one enforce-mode rule, by pattern.
    pub fraud_caught: BTreeMap<String, u64>,
    pub rules: Vec<RuleReport>,
}

/// The pattern of an injected event (`"fraud":"…"`), read only from lines that mention it.
fn fraud_tag(line: &[u8]) -> Option<String> {
    if !line.windows(8).any(|w| w == b"\"fraud\":") {
        return None;
    }
    let value: serde_json::Value = serde_json::from_slice(line).ok()?;
    value.get("fraud")?.as_str().map(str::to_owned)
}

/// Runs the rules of `engine` over `input`; `progress` is called with the lines read so far every
/// 65 536 lines.
pub fn backtest(
    engine: &mut Engine<MemoryStore>,
    input: impl BufRead,
    mut progress: impl FnMut(u64),
) -> Result<BacktestReport, ReplayError> {
    let rules = engine.rules().clone();
    let mut tally = Tally::new(&rules);
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
        tally.decision(&rules, &event, &decision, fraud.as_ref());
    }
    Ok(tally.finish(engine))
}

/// The report being built, with each active rule's set of keys hit.
struct Tally {
    report: BacktestReport,
    /// The active rules' indexes, in report order.
    active: Vec<usize>,
    keys: Vec<HashSet<Vec<u8>>>,
    key: Vec<u8>,
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
        }
    }

    /// Counts one event's decision: per rule hit, its times, fraud caught and key.
    fn decision(
        &mut self,
        rules: &RuleSet,
        event: &Event,
        decision: &Decision,
        fraud: Option<&String>,
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
            rule.first_hit_ts.get_or_insert(event.ts);
            rule.last_hit_ts = Some(event.ts);
            if let Some(tag) = fraud {
                *rule.fraud_caught.entry(tag.clone()).or_default() += 1;
            }
            // The key of the counter the rule fires on (a v1 rule's own, else the first its
            // condition names).
            let counter = match rules.rule(hit.rule).form {
                Form::V1 { counter, .. } => Some(counter),
                Form::V2 => rules.rule(hit.rule).counters().first().copied(),
            };
            let formed = counter
                .and_then(|c| rules.counter_position(c))
                .is_some_and(|p| rules.counter_key(p, event, &mut self.key));
            if formed && !self.keys[position].contains(&self.key) {
                self.keys[position].insert(self.key.clone());
            }
        }
    }

    /// The engine's counts (events, rules in scope) and the shares.
    fn finish(mut self, engine: &mut Engine<MemoryStore>) -> BacktestReport {
        let report = &mut self.report;
        report.events = engine.counts().events;
        for (position, counts) in engine.take_rule_counts() {
            if let Some(p) = self.active.iter().position(|&i| i == position) {
                report.rules[p].matched = counts.matched;
            }
        }
        for (rule, keys) in report.rules.iter_mut().zip(&self.keys) {
            rule.keys_hit = keys.len() as u64;
            rule.hit_share = rule.hits as f64 / report.events.max(1) as f64;
        }
        self.report
    }
}

fn time(ts: Option<i64>) -> String {
    ts.and_then(chrono::DateTime::from_timestamp_millis)
        .map_or_else(
            || "-".to_owned(),
            |t| t.format("%Y-%m-%d %H:%M:%S").to_string(),
        )
}

/// The report as a table for the terminal.
pub fn write_table(report: &BacktestReport, out: &mut impl Write) -> io::Result<()> {
    writeln!(
        out,
        "{} events ({} bad lines), {} with a hit ({:.2}%)",
        report.events,
        report.bad_lines,
        report.decided,
        100.0 * report.decided as f64 / report.events.max(1) as f64
    )?;
    writeln!(
        out,
        "{:<28} {:<7} {:<6} {:>9} {:>8} {:>7} {:<19} {:<19} {:>7}  caught",
        "rule", "mode", "action", "matched", "hits", "keys", "first hit", "last hit", "hit %"
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
            "{:<28} {:<7} {:<6} {:>9} {:>8} {:>7} {:<19} {:<19} {:>6.2}%  {}",
            rule.rule_id,
            rule.mode,
            rule.action,
            rule.matched,
            rule.hits,
            rule.keys_hit,
            time(rule.first_hit_ts),
            time(rule.last_hit_ts),
            100.0 * rule.hit_share,
            if caught.is_empty() {
                "-".to_owned()
            } else {
                caught.join(", ")
            }
        )?;
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
