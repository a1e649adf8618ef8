//! What `vigil backtest` adds for tuning a limit: the distribution of each counter's value at the
//! events it counted or a rule read it at, the keys that peaked highest, labelled events (precision and recall), and
//! the hits a rule would have at candidate limits (`--sweep`: a v1-form rule's `limit`, or the
//! number a `when = "$counter > N"` compares with). Pure.

use std::collections::HashMap;

use serde::Serialize;

use crate::decimal::Decimal;
use crate::event::FieldPath;
use crate::rules::decide::counter_value;
use crate::window::Aggregate;

/// Most values a distribution keeps: beyond, a uniform sample of this many (a fixed seed, so a
/// backtest repeats exactly).
pub const MAX_SAMPLED_VALUES: usize = 1_000_000;

/// Most keys whose peak is tracked per counter; later keys are not (said in the report).
pub const MAX_TRACKED_KEYS: usize = 100_000;

/// Top keys reported per counter.
pub const TOP_KEYS: usize = 5;

/// A counter's values at the events it counted or a rule read it at, exact up to [`MAX_SAMPLED_VALUES`] values.
#[derive(Debug, Clone, Default)]
pub struct Values {
    seen: u64,
    kept: Vec<i64>,
    rng: u64,
}

impl Values {
    pub fn add(&mut self, raw: i64) {
        self.seen += 1;
        if self.kept.len() < MAX_SAMPLED_VALUES {
            self.kept.push(raw);
            return;
        }
        // Reservoir sampling (Algorithm R) with a xorshift generator of fixed seed.
        if self.rng == 0 {
            self.rng = 0x9E37_79B9_7F4A_7C15;
        }
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let slot = self.rng % self.seen;
        if let Some(kept) = self.kept.get_mut(slot as usize) {
            *kept = raw;
        }
    }

    /// p50 / p90 / p99 / max, as the counter's values (micro-units shown as decimals).
    pub fn summary(&mut self, aggregate: Aggregate) -> Option<Distribution> {
        if self.kept.is_empty() {
            return None;
        }
        self.kept.sort_unstable();
        let at = |p: f64| {
            let rank = ((p * self.kept.len() as f64).ceil() as usize).clamp(1, self.kept.len());
            counter_value(aggregate, self.kept[rank - 1])
        };
        Some(Distribution {
            counted: self.seen,
            sampled: self.seen > self.kept.len() as u64,
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
            max: at(1.0),
        })
    }
}

/// Percentiles (nearest rank) of a counter's value at the events it counted or a rule read it at.
#[derive(Debug, Clone, Serialize)]
pub struct Distribution {
    pub counted: u64,
    /// True when the percentiles come from a uniform sample of [`MAX_SAMPLED_VALUES`] values.
    pub sampled: bool,
    pub p50: Decimal,
    pub p90: Decimal,
    pub p99: Decimal,
    pub max: Decimal,
}

/// Each key's highest value, for the top keys.
#[derive(Debug, Clone, Default)]
pub struct Peaks {
    peaks: HashMap<Vec<u8>, (i64, String), foldhash::fast::RandomState>,
    pub untracked: bool,
}

impl Peaks {
    /// `key` (the canonical bytes) reached `raw`; `render` gives its JSON text when first seen.
    pub fn add(&mut self, key: &[u8], raw: i64, render: impl FnOnce() -> String) {
        if let Some((peak, _)) = self.peaks.get_mut(key) {
            *peak = (*peak).max(raw);
        } else if self.peaks.len() < MAX_TRACKED_KEYS {
            self.peaks.insert(key.to_vec(), (raw, render()));
        } else {
            self.untracked = true;
        }
    }

    pub fn top(&self, aggregate: Aggregate) -> Vec<TopKey> {
        let mut all: Vec<&(i64, String)> = self.peaks.values().collect();
        // Highest first; ties by key text so the report is stable.
        all.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        all.into_iter()
            .take(TOP_KEYS)
            .filter_map(|(raw, key)| {
                Some(TopKey {
                    key: serde_json::value::RawValue::from_string(key.clone()).ok()?,
                    peak: counter_value(aggregate, *raw),
                })
            })
            .collect()
    }
}

/// A key (its JSON object, as records show it) and its highest value.
#[derive(Debug, Clone, Serialize)]
pub struct TopKey {
    pub key: Box<serde_json::value::RawValue>,
    pub peak: Decimal,
}

/// What a labelled event says: fraud, legitimate, or nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Label {
    Fraud,
    Legit,
    Unlabelled,
}

/// The label of a line: its `field` (a dotted path) true or a non-empty string (a fraud
/// pattern) is fraud, false or an empty string legitimate; absent or anything else unlabelled.
/// Only lines that mention the field's last name are parsed.
pub fn label_of(line: &[u8], field: &FieldPath) -> Label {
    let last = field.segments().last().unwrap_or_default();
    let needle = format!("\"{last}\"");
    if memchr::memmem::find(line, needle.as_bytes()).is_none() {
        return Label::Unlabelled;
    }
    let Ok(mut value) = serde_json::from_slice::<serde_json::Value>(line) else {
        return Label::Unlabelled;
    };
    for segment in field.segments() {
        match value.get_mut(segment) {
            Some(inner) => value = inner.take(),
            None => return Label::Unlabelled,
        }
    }
    match value {
        serde_json::Value::Bool(true) => Label::Fraud,
        serde_json::Value::Bool(false) => Label::Legit,
        serde_json::Value::String(s) if s.is_empty() => Label::Legit,
        serde_json::Value::String(_) => Label::Fraud,
        _ => Label::Unlabelled,
    }
}

/// Hits split by label, with precision (labelled hits that were fraud) and recall (fraud events
/// hit), when they are defined.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Labelled {
    pub fraud_hits: u64,
    pub legit_hits: u64,
    pub unlabelled_hits: u64,
    pub precision: Option<f64>,
    pub recall: Option<f64>,
}

impl Labelled {
    pub fn hit(&mut self, label: Label) {
        match label {
            Label::Fraud => self.fraud_hits += 1,
            Label::Legit => self.legit_hits += 1,
            Label::Unlabelled => self.unlabelled_hits += 1,
        }
    }

    pub fn finish(&mut self, fraud_events: u64) {
        let labelled = self.fraud_hits + self.legit_hits;
        self.precision = (labelled > 0).then(|| self.fraud_hits as f64 / labelled as f64);
        self.recall = (fraud_events > 0).then(|| self.fraud_hits as f64 / fraud_events as f64);
    }
}

/// One candidate limit of a `--sweep`.
#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    pub limit: Decimal,
    /// The limit on the counter's raw scale, rounded down (`value > limit` ⇔ `raw > threshold`)
    /// and up (`value >= limit` ⇔ `raw >= ceiling`).
    #[serde(skip)]
    pub threshold: i64,
    #[serde(skip)]
    pub ceiling: i64,
    pub hits: u64,
    pub keys: u64,
    #[serde(flatten)]
    pub labelled: Labelled,
    #[serde(skip)]
    pub keys_hit: std::collections::HashSet<Vec<u8>>,
}

/// A `--sweep RULE=L1,L2,…`: the rule re-judged at each limit in the same pass.
#[derive(Debug, Clone, Serialize)]
pub struct Sweep {
    pub rule_id: String,
    #[serde(skip)]
    pub counter: usize,
    /// How the rule compares its counter with the limit.
    #[serde(skip)]
    pub form: SweptForm,
    pub candidates: Vec<Candidate>,
}

/// The two forms a sweep re-judges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweptForm {
    /// `window` + `limit`: fires when the event fed the counter and its value exceeds the limit.
    V1,
    /// `when = "$counter > N"` (or `>=`): fires when the rule judges the event (its `match`
    /// holds; rule index) and the counter's value, fed by the event or not, is above (or at)
    /// the limit.
    When { rule: usize, at_least: bool },
}

impl Candidate {
    /// Whether a raw value fires the rule at this candidate.
    pub fn fires(&self, form: SweptForm, raw: i64) -> bool {
        match form {
            SweptForm::When { at_least: true, .. } => raw >= self.ceiling,
            _ => raw > self.threshold,
        }
    }
}

/// Parses `RULE=L1,L2,…`.
pub fn parse_sweep(text: &str) -> Result<(String, Vec<Decimal>), String> {
    let (rule, limits) = text
        .split_once('=')
        .ok_or_else(|| format!("--sweep {text:?}: expected RULE=L1,L2,…"))?;
    let limits = limits
        .split(',')
        .map(|l| {
            Decimal::parse(l.trim())
                .filter(|d| !d.is_negative())
                .ok_or_else(|| format!("--sweep {text:?}: {:?} is not a number >= 0", l.trim()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if rule.is_empty() || limits.is_empty() {
        return Err(format!("--sweep {text:?}: expected RULE=L1,L2,…"));
    }
    Ok((rule.to_owned(), limits))
}
