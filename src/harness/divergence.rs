//! Cross-partition divergence, for `vigil bench --kafka`: how the decisions a group of workers
//! produced differ from a single-order run of the same events (an in-process replay in the
//! order they were generated). Rules whose counters are keyed like the events' Kafka key match
//! exactly; the others may differ by how the partitions interleaved. Reported per rule (hits
//! against the single-order run's), and per event: a different decision (action or rules
//! fired), or the same rules with other values.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;

use serde_json::Value;

use crate::pipeline::{self, Engine, ReplayOptions};
use crate::rules::RuleSet;
use crate::store::MemoryStore;

/// Decision records by event id (the first copy of each), as JSON.
pub type Records = HashMap<String, Value>;

/// The single-order run: `lines` replayed in this order with the in-process store.
pub fn single_order(rules: &RuleSet, lines: &[Vec<u8>]) -> Result<Records, String> {
    let mut engine = Engine::new(rules.clone(), MemoryStore::new());
    let input = lines.join(&b'\n');
    let mut output = Vec::new();
    pipeline::replay(
        &mut engine,
        input.as_slice(),
        &mut output,
        std::io::sink(),
        ReplayOptions::default(),
    )
    .map_err(|e| format!("single-order replay: {e}"))?;
    let mut records = Records::new();
    for line in output.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        let record: Value =
            serde_json::from_slice(line).map_err(|e| format!("single-order replay: {e}"))?;
        keep_first(&mut records, record);
    }
    Ok(records)
}

/// Adds `record` unless its event already has one.
pub fn keep_first(records: &mut Records, record: Value) {
    if let Some(id) = record["event_id"].as_str().map(str::to_owned) {
        records.entry(id).or_insert(record);
    }
}

/// How `got` differs from `want`.
#[derive(Debug, Default, PartialEq)]
pub struct Divergence {
    /// Per rule: (hits, single-order hits).
    pub per_rule: BTreeMap<String, (u64, u64)>,
    /// Events decided differently: another action, or other rules fired.
    pub decisions: usize,
    /// Events with the same rules fired but other values (counter values, hold ends).
    pub values: usize,
    /// Events with a record in either run.
    pub events: usize,
}

impl Divergence {
    pub fn between(got: &Records, want: &Records) -> Divergence {
        let mut divergence = Divergence::default();
        let mut count = |records: &Records, slot: fn(&mut (u64, u64)) -> &mut u64| {
            for record in records.values() {
                for hit in record["hits"].as_array().into_iter().flatten() {
                    let rule = hit["rule_id"].as_str().unwrap_or_default().to_owned();
                    *slot(divergence.per_rule.entry(rule).or_default()) += 1;
                }
            }
        };
        count(got, |pair| &mut pair.0);
        count(want, |pair| &mut pair.1);
        let ids: std::collections::BTreeSet<&String> = got.keys().chain(want.keys()).collect();
        divergence.events = ids.len();
        for id in ids {
            let (a, b) = (got.get(id), want.get(id));
            let fired = |r: Option<&Value>| -> Vec<String> {
                r.and_then(|r| r["hits"].as_array())
                    .map(|hits| {
                        hits.iter()
                            .map(|h| h["rule_id"].as_str().unwrap_or_default().to_owned())
                            .collect()
                    })
                    .unwrap_or_default()
            };
            let action = |r: Option<&Value>| r.map(|r| r["action"].clone()).unwrap_or(Value::Null);
            if fired(a) != fired(b) || action(a) != action(b) {
                divergence.decisions += 1;
            } else if a.map(|r| &r["hits"]) != b.map(|r| &r["hits"]) {
                divergence.values += 1;
            }
        }
        divergence
    }

    /// The largest difference of a rule's hits from the single-order run's, in percent of them
    /// (0 if no rule fired in either).
    pub fn worst_rule_percent(&self) -> f64 {
        self.per_rule
            .values()
            .map(|&(got, want)| {
                if want == 0 {
                    if got == 0 {
                        0.0
                    } else {
                        100.0
                    }
                } else {
                    got.abs_diff(want) as f64 * 100.0 / want as f64
                }
            })
            .fold(0.0, f64::max)
    }

    /// Two lines of the report, for the phase named `phase`.
    pub fn write(&self, phase: &str, out: &mut impl Write) -> std::io::Result<()> {
        writeln!(
            out,
            "  divergence       {phase}: {} events with a record; {} decided otherwise than a single-order run, {} with other values; worst rule {:.2} % off",
            self.events,
            self.decisions,
            self.values,
            self.worst_rule_percent()
        )?;
        let rules: Vec<String> = self
            .per_rule
            .iter()
            .map(|(rule, (got, want))| format!("{rule} {got}/{want}"))
            .collect();
        writeln!(
            out,
            "                   hits / single-order hits: {}",
            rules.join(", ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn records(list: &[Value]) -> Records {
        let mut records = Records::new();
        for record in list {
            keep_first(&mut records, record.clone());
        }
        records
    }

    #[test]
    fn differences_are_told_apart_by_rules_fired_and_by_values() {
        let hit = |rule: &str, value: i64| json!({"rule_id": rule, "value": value});
        let want = records(&[
            json!({"event_id": "e-1", "action": "block", "hits": [hit("a", 6)]}),
            json!({"event_id": "e-2", "action": "block", "hits": [hit("a", 7)]}),
            json!({"event_id": "e-3", "action": "review", "hits": [hit("b", 1)]}),
        ]);
        let got = records(&[
            json!({"event_id": "e-1", "action": "block", "hits": [hit("a", 6)]}),
            json!({"event_id": "e-2", "action": "block", "hits": [hit("a", 8)]}),
            json!({"event_id": "e-4", "action": "review", "hits": [hit("b", 1)]}),
            // A second copy (redelivery) does not count.
            json!({"event_id": "e-4", "action": "block", "hits": [hit("a", 1)]}),
        ]);
        let divergence = Divergence::between(&got, &want);
        assert_eq!(divergence.events, 4);
        assert_eq!(
            divergence.decisions, 2,
            "e-3 only in one, e-4 only in the other"
        );
        assert_eq!(divergence.values, 1, "e-2");
        assert_eq!(
            divergence.per_rule,
            BTreeMap::from([("a".into(), (2, 2)), ("b".into(), (1, 1))])
        );
        assert_eq!(divergence.worst_rule_percent(), 0.0);
    }
}
