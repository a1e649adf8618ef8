//! The reference window model both reference property tests compare the engine against: every
//! bucket of every key kept in a `BTreeMap` and window values recomputed from scratch, on events
//! read as `serde_json::Value`s; with the keys and numbers as a decision record prints them. It
//! shares no code with the engine.

use std::collections::{BTreeMap, HashMap};

use serde_json::{json, Map, Value};

/// The event field the generated rules aggregate: `amount` for sums, `val` for distinct values
/// (what both tests' line strategies fill in).
pub fn aggregate_field(aggregate: &str) -> Option<&'static str> {
    match aggregate {
        "sum" => Some("amount"),
        "distinct" => Some("val"),
        _ => None,
    }
}

/// The value at a dotted `path` of an event, if every step is an object that has it.
pub fn get<'v>(event: &'v Value, path: &str) -> Option<&'v Value> {
    path.split('.')
        .try_fold(event, |v, seg| v.as_object()?.get(seg))
}

/// A scalar's identity: type tag plus value, numbers by mathematical value.
pub fn scalar_id(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(format!("s:{s}")),
        Value::Bool(b) => Some(format!("b:{b}")),
        Value::Number(n) => Some(format!("n:{}", n.as_f64().unwrap())),
        _ => None,
    }
}

/// A scalar as the decision record prints it: integral numbers as integers.
pub fn scalar_out(v: &Value) -> Value {
    match v {
        Value::Number(n) => num(n.as_f64().unwrap()),
        other => other.clone(),
    }
}

/// A number as the decision record prints it: integral values as integers.
pub fn num(x: f64) -> Value {
    if x.fract() == 0.0 && x.abs() < 9e15 {
        json!(x as i64)
    } else {
        json!(x)
    }
}

/// The key an event counts under for `dims`: the identities of its dimension values joined by
/// `|`; `None` if one is missing or not a scalar.
pub fn key_of(event: &Value, dims: &[&str]) -> Option<String> {
    dims.iter()
        .map(|d| get(event, d).and_then(scalar_id))
        .collect::<Option<Vec<_>>>()
        .map(|k| k.join("|"))
}

/// The `key` object a decision record prints for `dims` (the event has every dimension).
pub fn key_record(event: &Value, dims: &[&str]) -> Map<String, Value> {
    dims.iter()
        .map(|d| (d.to_string(), scalar_out(get(event, d).unwrap())))
        .collect()
}

/// The shape of one window: its aggregate (`count`, `sum` or `distinct`) and its buckets.
#[derive(Debug, Clone, Copy)]
pub struct Window {
    pub aggregate: &'static str,
    pub bucket_ms: i64,
    pub buckets: i64,
}

/// What one event adds to its key's window.
pub enum Observation {
    /// One event counted, or a sum's amount in micro-units.
    Add(i64),
    /// A distinct value's identity.
    Distinct(String),
}

/// One key's window: its newest bucket, every live bucket, and each distinct value's newest bucket.
#[derive(Default)]
pub struct KeyState {
    head: Option<i64>,
    /// Counts, or sums in micro-units.
    buckets: BTreeMap<i64, i64>,
    latest: HashMap<String, i64>,
}

impl KeyState {
    /// Counts an event at `ts`: the window value it sees, or `None` (nothing changed) if it is
    /// late, i.e. its bucket already left the window.
    pub fn observe(&mut self, window: &Window, ts: i64, seen: Observation) -> Option<f64> {
        let bucket = ts.div_euclid(window.bucket_ms);
        if self
            .head
            .is_some_and(|head| bucket <= head - window.buckets)
        {
            return None;
        }
        let head = self.head.map_or(bucket, |h| h.max(bucket));
        self.head = Some(head);
        match seen {
            Observation::Distinct(id) => {
                let latest = self.latest.entry(id).or_insert(bucket);
                *latest = (*latest).max(bucket);
            }
            Observation::Add(amount) => *self.buckets.entry(bucket).or_insert(0) += amount,
        }
        let oldest = head - window.buckets + 1;
        self.buckets.retain(|&b, _| b >= oldest);
        self.read(window, ts)
    }

    /// The window value an event at `ts` sees, without changing anything; `None` if late.
    pub fn read(&self, window: &Window, ts: i64) -> Option<f64> {
        let bucket = ts.div_euclid(window.bucket_ms);
        let Some(head) = self.head else {
            return Some(0.0);
        };
        if bucket <= head - window.buckets {
            return None;
        }
        let oldest = head.max(bucket) - window.buckets + 1;
        Some(match window.aggregate {
            "distinct" => self.latest.values().filter(|&&b| b >= oldest).count() as f64,
            "sum" => self.buckets.range(oldest..).map(|(_, v)| v).sum::<i64>() as f64 / 1e6,
            _ => self.buckets.range(oldest..).map(|(_, v)| v).sum::<i64>() as f64,
        })
    }
}

/// Every window of a rule set: one [`KeyState`] per (counter or rule index, key).
#[derive(Default)]
pub struct Windows {
    keys: HashMap<(usize, String), KeyState>,
}

impl Windows {
    /// Counts an event at `ts` in window `index` under `key`: see [`KeyState::observe`].
    pub fn observe(
        &mut self,
        index: usize,
        key: String,
        window: &Window,
        ts: i64,
        seen: Observation,
    ) -> Option<f64> {
        self.keys
            .entry((index, key))
            .or_default()
            .observe(window, ts, seen)
    }

    /// The value an event at `ts` sees in window `index` under `key` (0 for a key never
    /// counted); `None` if late.
    pub fn read(&self, index: usize, key: String, window: &Window, ts: i64) -> Option<f64> {
        match self.keys.get(&(index, key)) {
            Some(state) => state.read(window, ts),
            None => KeyState::default().read(window, ts),
        }
    }
}
