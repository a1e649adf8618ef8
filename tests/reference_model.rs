//! Property test: the engine against a deliberately simple reference model of the rule language, the window semantics and the decision record on
//! random rule sets and random event streams (out-of-order and late events, missing and mistyped
//! fields, bad lines, every aggregate, shadow and disabled rules).
//!
//! The reference shares no code with the engine: it parses each line into a `serde_json::Value`,
//! keeps every bucket of every key in a `BTreeMap`, and recomputes window values from scratch
//! (the window model of `support/reference.rs`, shared with `reference_v2`).

mod support;

use std::sync::Arc;

use proptest::prelude::*;
use serde_json::{json, Map, Value};

use support::reference::{
    aggregate_field, get, key_of, key_record, num, scalar_id, scalar_out, Observation, Window,
    Windows,
};
use vigil::clock::FixedClock;
use vigil::event::TimeBounds;
use vigil::pipeline::{replay, Engine, ReplayOptions};
use vigil::rules::RuleSet;
use vigil::store::MemoryStore;

#[derive(Debug, Clone)]
struct RuleParams {
    aggregate: &'static str,
    dims: Vec<&'static str>,
    matcher: Option<(&'static str, Vec<Value>)>,
    bucket_ms: i64,
    buckets: i64,
    limit: f64,
    action: &'static str,
    shadow: bool,
    enabled: bool,
}

impl RuleParams {
    fn field(&self) -> Option<&'static str> {
        aggregate_field(self.aggregate)
    }

    fn window_ms(&self) -> i64 {
        self.bucket_ms * self.buckets
    }

    fn window(&self) -> Window {
        Window {
            aggregate: self.aggregate,
            bucket_ms: self.bucket_ms,
            buckets: self.buckets,
        }
    }

    fn toml(&self, id: &str) -> String {
        let dims: Vec<String> = self.dims.iter().map(|d| format!("{d:?}")).collect();
        let mut t = format!(
            "[[rule]]\nid = {id:?}\naction = {:?}\nmode = {:?}\nenabled = {}\ndimensions = [{}]\nwindow = \"{}ms\"\nbucket = \"{}ms\"\naggregate = {:?}\nlimit = {}\n",
            self.action,
            if self.shadow { "shadow" } else { "enforce" },
            self.enabled,
            dims.join(", "),
            self.window_ms(),
            self.bucket_ms,
            self.aggregate,
            if self.limit.fract() == 0.0 { format!("{}", self.limit as i64) } else { format!("{}", self.limit) },
        );
        if let Some(field) = self.field() {
            t.push_str(&format!("field = {field:?}\n"));
        }
        if let Some((path, values)) = &self.matcher {
            let vals: Vec<String> = values.iter().map(toml_value).collect();
            t.push_str(&format!("match = {{ {path:?} = [{}] }}\n", vals.join(", ")));
        }
        t
    }
}

fn toml_value(v: &Value) -> String {
    match v {
        Value::String(s) => format!("{s:?}"),
        Value::Number(n) if n.is_f64() => format!("{:?}", n.as_f64().unwrap()),
        other => other.to_string(),
    }
}

fn rule_strategy() -> impl Strategy<Value = RuleParams> {
    let dims = prop::sample::subsequence(vec!["user", "dev.id", "n"], 1..=2);
    let matcher = prop_oneof![
        Just(None),
        Just(Some(("kind", vec![json!("a")]))),
        Just(Some(("kind", vec![json!("a"), json!("b")]))),
        Just(Some(("code", vec![json!(1)]))),
        Just(Some(("code", vec![json!(1.5), json!(true)]))),
    ];
    (
        prop::sample::select(vec!["count", "sum", "distinct"]),
        dims,
        matcher,
        prop::sample::select(vec![1i64, 5, 10, 100]),
        1i64..=6,
        prop::sample::select(vec![0.0, 1.0, 2.0, 2.5, 4.0]),
        prop::sample::select(vec!["block", "review", "alert"]),
        prop::bool::weighted(0.2),
        prop::bool::weighted(0.9),
    )
        .prop_map(
            |(aggregate, dims, matcher, bucket_ms, buckets, limit, action, shadow, enabled)| {
                RuleParams {
                    aggregate,
                    dims,
                    matcher,
                    bucket_ms,
                    buckets,
                    limit,
                    action,
                    shadow,
                    enabled,
                }
            },
        )
}

/// One input line: a field soup that exercises types, missing values and bad lines.
fn line_strategy(max_lateness: i64) -> impl Strategy<Value = (i64, i64, String)> {
    let scalar_or_not = |values: Vec<Value>| {
        prop::sample::select(values)
            .prop_map(Some)
            .boxed()
            .prop_union(Just(None).boxed())
    };
    let user = scalar_or_not(vec![
        json!("u1"),
        json!("u2"),
        json!("u3"),
        json!(1),
        json!(1.0),
        json!("1"),
        Value::Null,
        json!({"x":1}),
    ]);
    let dev = scalar_or_not(vec![
        json!({"id":"d1"}),
        json!({"id":"d2"}),
        json!({"id":2}),
        json!({}),
        json!("flat"),
    ]);
    let n = scalar_or_not(vec![json!(0), json!(7), json!(-7), json!(7.0)]);
    let kind = scalar_or_not(vec![json!("a"), json!("b"), json!("c"), json!(1)]);
    let code = scalar_or_not(vec![
        json!(1),
        json!(1.0),
        json!("1"),
        json!(1.5),
        json!(true),
    ]);
    let amount = scalar_or_not(vec![
        json!(1),
        json!(2.5),
        json!(-3),
        json!(0.25),
        json!("7"),
        Value::Null,
    ]);
    let val = scalar_or_not(vec![
        json!("x"),
        json!("y"),
        json!(1),
        json!(1.0),
        json!(true),
        Value::Null,
        json!([1]),
    ]);
    let shape = prop::sample::select(vec![
        0u8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7,
    ]);
    (
        0i64..40,
        0..=max_lateness,
        prop::bool::weighted(0.15),
        (user, dev, n, kind),
        (code, amount, val),
        shape,
        prop::bool::weighted(0.1),
    )
        .prop_map(
            move |(
                step,
                lateness,
                is_late,
                (user, dev, n, kind),
                (code, amount, val),
                shape,
                rfc3339,
            )| {
                (step, if is_late { lateness } else { 0 }, {
                    let mut obj = Map::new();
                    for (k, v) in [
                        ("user", user),
                        ("dev", dev),
                        ("n", n),
                        ("kind", kind),
                        ("code", code),
                        ("amount", amount),
                        ("val", val),
                    ] {
                        if let Some(v) = v {
                            obj.insert(k.to_owned(), v);
                        }
                    }
                    // The timestamp is filled in by the caller (placeholder), so that time advances.
                    match shape {
                        1 => "this is not json".to_owned(),
                        2 => "[1,2,3]".to_owned(),
                        3 => "{\"ts\":-5}".to_owned(),
                        4 => serde_json::to_string(&Value::Object(obj)).unwrap(), // no ts
                        5 => "{\"ts\":1.5}".to_owned(),
                        6 => String::new(), // blank line
                        7 => {
                            // Near or past the future bound of the fixed clock: `ts` set by the caller.
                            obj.insert("ts".to_owned(), json!("FUTURE"));
                            serde_json::to_string(&Value::Object(obj)).unwrap()
                        }
                        _ => {
                            obj.insert(
                                "ts".to_owned(),
                                json!(if rfc3339 { "RFC3339" } else { "MS" }),
                            );
                            serde_json::to_string(&Value::Object(obj)).unwrap()
                        }
                    }
                })
            },
        )
}

/// The wall clock of the property tests, and their future bound: inputs start at `START_MS` and
/// advance at most 40 ms per line, so only "FUTURE" lines come near the clock.
const START_MS: i64 = 1_000_000;
const CLOCK_MS: i64 = START_MS + 20_000;
const SKEW_MS: i64 = 1_000;

/// Builds the input text: time advances by each line's step; late lines go back by their lateness;
/// "FUTURE" lines are just past the future bound (refused, unless the bound is off).
fn build_input(lines: &[(i64, i64, String)]) -> String {
    let mut now: i64 = START_MS;
    let mut out = String::new();
    for (i, (step, lateness, text)) in lines.iter().enumerate() {
        now += step;
        let ts = (now - lateness).max(0);
        let text = if text.contains("\"FUTURE\"") {
            text.replace("\"FUTURE\"", &(CLOCK_MS + SKEW_MS + 1 + step).to_string())
        } else if text.contains("\"MS\"") {
            text.replace("\"MS\"", &ts.to_string())
        } else if text.contains("\"RFC3339\"") {
            let dt = chrono::DateTime::from_timestamp_millis(ts).unwrap();
            text.replace(
                "\"RFC3339\"",
                &format!(
                    "\"{}\"",
                    dt.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
                ),
            )
        } else {
            text.clone()
        };
        out.push_str(&text);
        out.push_str(if i % 7 == 3 { "\r\n" } else { "\n" });
    }
    out
}

// ---------------------------------------------------------------- the reference model

fn json_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        _ => a == b,
    }
}

/// Time bounds as the reference applies them, with the wall clock at `CLOCK_MS`.
#[derive(Debug, Clone, Copy)]
struct Bounds {
    skew: Option<i64>,
    lateness: Option<i64>,
}

impl Bounds {
    fn engine(self) -> TimeBounds {
        TimeBounds {
            max_future_skew_ms: self.skew,
            max_lateness_ms: self.lateness,
        }
    }
}

fn reference(rules: &[RuleParams], input: &str, bounds: Bounds) -> Vec<Value> {
    let mut windows = Windows::default();
    let mut records = Vec::new();
    let mut newest: Option<i64> = None;
    for (i, line) in input.split('\n').enumerate() {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if line.trim().is_empty() {
            continue;
        }
        let Ok(event) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if !event.is_object() {
            continue;
        }
        let ts = match event.get("ts") {
            Some(Value::Number(n)) if n.is_u64() => n.as_u64().unwrap() as i64,
            Some(Value::String(s)) => match chrono::DateTime::parse_from_rfc3339(s) {
                Ok(dt) if dt.timestamp_millis() >= 0 => dt.timestamp_millis(),
                _ => continue,
            },
            _ => continue,
        };
        if !(0..=253_402_300_799_999).contains(&ts)
            || bounds.skew.is_some_and(|skew| ts > CLOCK_MS + skew)
        {
            continue; // a bad line: neither counted nor judged, the watermark stays
        }
        // Behind the watermark: late for every rule (and a v1 rule judges only what it counts).
        if let (Some(newest), Some(lateness)) = (newest, bounds.lateness) {
            if ts < newest - lateness {
                continue;
            }
        }
        newest = Some(newest.map_or(ts, |n| n.max(ts)));
        let mut hits = Vec::new();
        for (r, rule) in rules.iter().enumerate() {
            if !rule.enabled {
                continue;
            }
            if let Some((path, any_of)) = &rule.matcher {
                let Some(v) = get(&event, path) else { continue };
                if !any_of.iter().any(|want| json_eq(v, want)) {
                    continue;
                }
            }
            let Some(dims) = key_of(&event, &rule.dims) else {
                continue;
            };
            let field = rule.field().and_then(|f| get(&event, f));
            // Sums: micro-units of the amount, which must lie in [0, 1e12) (the generated
            // amounts are exact in binary, so the double gives their micro-units exactly).
            let seen = match rule.aggregate {
                "sum" => match field {
                    Some(Value::Number(n)) if (0.0..1e12).contains(&n.as_f64().unwrap()) => {
                        Observation::Add((n.as_f64().unwrap() * 1e6).round() as i64)
                    }
                    _ => continue,
                },
                "distinct" => match field.and_then(scalar_id) {
                    Some(id) => Observation::Distinct(id),
                    None => continue,
                },
                _ => Observation::Add(1),
            };
            let Some(value) = windows.observe(r, dims, &rule.window(), ts, seen) else {
                continue;
            }; // late
            if value > rule.limit {
                hits.push((r, value, key_record(&event, &rule.dims)));
            }
        }
        if hits.is_empty() {
            continue;
        }
        records.push(record(rules, i, &event, ts, hits));
    }
    records
}

/// The decision record of line `i` (0-based) from its hits: (rule index, window value, key).
fn record(
    rules: &[RuleParams],
    i: usize,
    event: &Value,
    ts: i64,
    hits: Vec<(usize, f64, Map<String, Value>)>,
) -> Value {
    let severity = |a: &str| {
        ["alert", "review", "block"]
            .iter()
            .position(|x| *x == a)
            .unwrap()
    };
    let action = hits
        .iter()
        .filter(|(r, _, _)| !rules[*r].shadow)
        .map(|(r, _, _)| rules[*r].action)
        .max_by_key(|a| severity(a))
        .unwrap_or("allow");
    let event_id = match event.get("event_id") {
        Some(v @ (Value::String(_) | Value::Number(_))) => scalar_out(v),
        _ => Value::Null,
    };
    let hits: Vec<Value> = hits
        .into_iter()
        .map(|(r, value, key)| {
            json!({"rule_id": format!("r{r}"), "mode": if rules[r].shadow {"shadow"} else {"enforce"},
                   "action": rules[r].action, "key": key, "value": num(value),
                   "limit": num(rules[r].limit), "window_ms": rules[r].window_ms()})
        })
        .collect();
    json!({"decision_id": format!("line/{}", i + 1), "event_id": event_id, "ts": ts, "action": action,
           "hits": hits, "source": {"line": i + 1}})
}

// ---------------------------------------------------------------- the property

fn engine_records(
    rules: &[RuleParams],
    input: &str,
    store: MemoryStore,
    bounds: Bounds,
) -> Vec<Value> {
    let toml: String = rules
        .iter()
        .enumerate()
        .map(|(i, r)| r.toml(&format!("r{i}")))
        .collect();
    let set = RuleSet::from_sources([("gen.toml", toml.as_str())])
        .unwrap_or_else(|e| panic!("{e}\n{toml}"));
    let mut engine =
        Engine::new(set, store).with_time(bounds.engine(), Arc::new(FixedClock::new(CLOCK_MS)));
    let mut out = Vec::new();
    replay(
        &mut engine,
        input.as_bytes(),
        &mut out,
        std::io::sink(),
        ReplayOptions::default(),
    )
    .unwrap();
    // The rules version is a hash of the rule text: checked for its form, then set aside.
    String::from_utf8(out)
        .unwrap()
        .lines()
        .map(|l| {
            let mut record: Value = serde_json::from_str(l).unwrap();
            let version = record
                .as_object_mut()
                .unwrap()
                .remove("rules_version")
                .unwrap();
            assert!(
                version
                    .as_str()
                    .is_some_and(|v| v.len() == 12 && v.bytes().all(|b| b.is_ascii_hexdigit())),
                "{version}"
            );
            record
        })
        .collect()
}

fn assert_same(
    rules: &[RuleParams],
    input: &str,
    store: MemoryStore,
    bounds: Bounds,
) -> Result<(), TestCaseError> {
    let want = reference(rules, input, bounds);
    let got = engine_records(rules, input, store, bounds);
    for (g, w) in got.iter().zip(&want) {
        prop_assert_eq!(g, w, "first differing record\ninput:\n{}", input);
    }
    prop_assert_eq!(got.len(), want.len(), "record count\ninput:\n{}", input);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Any lateness and no lateness bound: the store keeps every key, so it must equal the
    /// reference exactly.
    #[test]
    fn engine_equals_reference(
        rules in prop::collection::vec(rule_strategy(), 1..=5),
        lines in prop::collection::vec(line_strategy(2_000), 1..300),
    ) {
        let input = build_input(&lines);
        assert_same(&rules, &input, MemoryStore::new(), Bounds { skew: Some(SKEW_MS), lateness: None })?;
    }

    /// Arbitrary disorder (events up to many windows late) under any lateness bound, with a
    /// store that sweeps before every observation: it drops only keys that no event within the bound
    /// can observe, so it stays exact whatever the order.
    #[test]
    fn sweeping_store_equals_reference_under_any_disorder_and_bounds(
        rules in prop::collection::vec(rule_strategy(), 1..=3),
        lines in prop::collection::vec(line_strategy(4_000), 1..300),
        lateness in prop_oneof![Just(None), (0i64..=4_000).prop_map(Some)],
        skew in prop_oneof![1 => Just(None), 4 => Just(Some(SKEW_MS))],
    ) {
        // Most late lines land just inside the lateness bound, where the store's horizon is:
        // a key dropped a bucket too early would be seen there.
        let edge = lateness.unwrap_or(4_000);
        let lines: Vec<_> = lines
            .into_iter()
            .map(|(step, late, text)| (step, if late > 0 && late % 4 != 0 { (edge - late % 60).max(0) } else { late }, text))
            .collect();
        let input = build_input(&lines);
        assert_same(&rules, &input, MemoryStore::with_sweep_interval(0), Bounds { skew, lateness })?;
    }
}

#[test]
fn reference_sanity_on_a_known_stream() {
    let rule = RuleParams {
        aggregate: "count",
        dims: vec!["user"],
        matcher: None,
        bucket_ms: 10,
        buckets: 3,
        limit: 2.0,
        action: "block",
        shadow: false,
        enabled: true,
    };
    let input = (0..5)
        .map(|i| format!("{{\"ts\":{},\"user\":\"u\"}}\n", i * 10))
        .collect::<String>();
    let bounds = Bounds {
        skew: Some(SKEW_MS),
        lateness: Some(15),
    };
    let records = reference(std::slice::from_ref(&rule), &input, bounds);
    // Counts 1,2,3,3,3 in a 3-bucket window: events 3..5 exceed 2.
    let lines: Vec<u64> = records
        .iter()
        .map(|r| r["source"]["line"].as_u64().unwrap())
        .collect();
    assert_eq!(lines, [3, 4, 5]);
    assert_eq!(
        engine_records(
            std::slice::from_ref(&rule),
            &input,
            MemoryStore::new(),
            bounds
        ),
        records
    );

    // An event behind the watermark (newest 40 - lateness 15 = 25) is late for every rule (it
    // would have been counted in bucket 2 otherwise); one past the clock's future bound is a bad
    // line and moves nothing; then bucket 2 counts again.
    let input = format!("{input}{{\"ts\":24,\"user\":\"u\"}}\n{{\"ts\":{},\"user\":\"u\"}}\n{{\"ts\":25,\"user\":\"u\"}}\n", CLOCK_MS + SKEW_MS + 1);
    let records = reference(std::slice::from_ref(&rule), &input, bounds);
    let lines: Vec<u64> = records
        .iter()
        .map(|r| r["source"]["line"].as_u64().unwrap())
        .collect();
    assert_eq!(lines, [3, 4, 5, 8]);
    assert_eq!(
        engine_records(&[rule], &input, MemoryStore::new(), bounds),
        records
    );
}
