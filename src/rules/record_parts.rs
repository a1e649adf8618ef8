//! The constant parts of a rule set's decision records (rule heads, limits, counter ids, paths
//! and windows), rendered as JSON once at load.

use super::json::{render, write_decimal, write_int, write_str};
use super::model::{Counter, Form, Mode, Rule};
use crate::decimal::Decimal;

/// `"name":`
fn name(text: &str) -> Box<[u8]> {
    render(|out| {
        write_str(out, text);
        out.push(b':');
    })
}

/// The constant parts of a rule set's decision records, rendered as JSON once at load: a record
/// is then mostly copied, not serialised field by field.
#[derive(Debug, Clone, Default)]
pub(crate) struct RecordParts {
    /// `,"rules_version":"…","hits":[`
    pub(super) version: Box<[u8]>,
    /// Per rule, per mode (enforce, shadow): `{"rule_id":"…","mode":"…","action":"…"`
    pub(super) rule_heads: Vec<[Box<[u8]>; 2]>,
    /// Per rule: `,"score":…` and `,"rollout":…` when it has them.
    pub(super) rule_tails: Vec<Box<[u8]>>,
    /// Per rule: `"name":` for each entry of its entity, in order.
    pub(super) entity_names: Vec<Vec<Box<[u8]>>>,
    /// Per v1-form rule: `,"limit":…,"window_ms":…` (empty for the new form).
    pub(super) rule_limits: Vec<Box<[u8]>>,
    /// Per counter: `{"id":"…","key":`
    pub(super) counter_heads: Vec<Box<[u8]>>,
    /// Per counter: `"path":` for each dimension, in order.
    pub(super) counter_paths: Vec<Vec<Box<[u8]>>>,
    /// Per counter: `,"window_ms":…}`
    pub(super) counter_tails: Vec<Box<[u8]>>,
}

impl RecordParts {
    pub(crate) fn new(rules: &[Rule], counters: &[Counter], version: &str) -> RecordParts {
        RecordParts {
            version: render(|out| {
                out.extend_from_slice(b",\"rules_version\":");
                write_str(out, version);
                out.extend_from_slice(b",\"hits\":[");
            }),
            rule_heads: rules
                .iter()
                .map(|rule| {
                    [Mode::Enforce, Mode::Shadow].map(|mode| {
                        render(|out| {
                            out.extend_from_slice(b"{\"rule_id\":");
                            write_str(out, &rule.id);
                            out.extend_from_slice(b",\"mode\":");
                            write_str(out, mode.as_str());
                            out.extend_from_slice(b",\"action\":");
                            write_str(out, rule.action.as_str());
                        })
                    })
                })
                .collect(),
            rule_tails: rules
                .iter()
                .map(|rule| {
                    render(|out| {
                        if let Some(score) = rule.score {
                            out.extend_from_slice(b",\"score\":");
                            write_decimal(out, &Decimal::from_micros(score));
                        }
                        if let Some(rollout) = &rule.rollout {
                            out.extend_from_slice(b",\"rollout\":");
                            write_decimal(out, &rollout.percent);
                        }
                    })
                })
                .collect(),
            entity_names: rules
                .iter()
                .map(|rule| rule.entity.iter().map(|part| name(part.text())).collect())
                .collect(),
            rule_limits: rules
                .iter()
                .map(|rule| {
                    render(|out| {
                        if let Form::V1 {
                            counter, ref limit, ..
                        } = rule.form
                        {
                            out.extend_from_slice(b",\"limit\":");
                            write_decimal(out, limit);
                            out.extend_from_slice(b",\"window_ms\":");
                            write_int(out, counters[counter].window.window_ms());
                        }
                    })
                })
                .collect(),
            counter_heads: counters
                .iter()
                .map(|c| {
                    render(|out| {
                        out.extend_from_slice(b"{\"id\":");
                        write_str(out, &c.id);
                        out.extend_from_slice(b",\"key\":");
                    })
                })
                .collect(),
            counter_paths: counters
                .iter()
                .map(|c| c.dimensions.iter().map(|part| name(part.text())).collect())
                .collect(),
            counter_tails: counters
                .iter()
                .map(|c| {
                    render(|out| {
                        out.extend_from_slice(b",\"window_ms\":");
                        write_int(out, c.window.window_ms());
                        out.push(b'}');
                    })
                })
                .collect(),
        }
    }
}
