//! Bodies of the fuzz targets (`fuzz/`, run with cargo-fuzz) and of their bounded variants in
//! the test suite (`tests/fuzz_bounded.rs`): each takes arbitrary bytes and must return without
//! panicking, overflowing the stack or allocating without bound. Apart from the product path;
//! the targets exercise the same functions the product calls.

use crate::event::{decode, FieldPath, Projection};
use crate::pipeline::{replay, Engine, ReplayOptions};
use crate::rules::RuleSet;
use crate::store::MemoryStore;

/// Rules the event targets judge with: every aggregate, an expression using every operator and
/// function family, a hold and lists.
const RULES: &str = r#"
[[list]]
id = "bad-cards"
values = ["c-1", "c-2"]

[[list]]
id = "nets"
kind = "cidr"
values = ["10.0.0.0/8", "2001:db8::/32", "192.0.2.7"]

[[list]]
id = "amounts"
kind = "number"
values = [1, 2.5, 1e3]

[[counter]]
id = "fails"
match = "type == 'login' && result != 'ok'"
dimensions = ["user_id"]
window = "15m"
bucket = "1m"

[[counter]]
id = "spend"
dimensions = ["card.id", "geo.country"]
window = "1h"
aggregate = "sum"
field = "amount"
allow_negative = true

[[counter]]
id = "users-per-ip"
dimensions = ["ip"]
window = "10m"
aggregate = "distinct"
field = "user_id"
max_distinct = 5

[[rule]]
id = "brute"
action = "block"
match = "type == 'login'"
when = "$fails > 2 || ($users-per-ip >= 3 && !exists(device.id))"
hold = "5m"
hold_key = ["user_id"]

[[rule]]
id = "money"
action = "review"
when = """
$spend * 2 - amount / 3 > 100 && card.id not in @bad-cards && ip in @nets && amount in @amounts
|| lower(`geo`.country) in ['fr', 'de'] && starts_with(email, 'a') && ends_with(email, '.io')
|| contains(ua, 'bot') && matches(ua, '^[a-z]+/[0-9.]+$') && ip in cidr('172.16.0.0/12', '::1')
|| 'vip' in tags && -amount < 0 && $spend != null && amount >= 0.5
"""

[[rule]]
id = "v1-form"
action = "alert"
mode = "shadow"
match = { type = ["payment", "refund"], geo = { country = "US" } }
dimensions = ["device.id"]
window = "1m"
limit = 1
"#;

/// Event decoding with a projection of nested paths: never panics.
pub fn decode_event(data: &[u8]) {
    let mut projection = Projection::new();
    for path in [
        "user_id",
        "device.id",
        "device.os.name",
        "tags",
        "amount",
        "geo.country",
        "a.b.c.d",
    ] {
        projection.slot(&FieldPath::parse(path).expect("valid path"));
    }
    if let Ok(event) = decode(data, &projection) {
        for slot in 0..projection.slot_count() {
            let _ = event.field(slot).kind();
        }
    }
}

/// Rule files: compile errors are fine, panics and unbounded work are not.
pub fn compile_rules(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let _ = RuleSet::from_sources([("fuzz.toml", text.as_ref())]);
}

/// An expression, as the `when` of a rule next to `RULES`' counters and lists; when it
/// compiles, it judges a few fixed events.
pub fn expression(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let quoted = toml_basic_string(&text);
    let rules =
        format!("{RULES}\n[[rule]]\nid = \"fuzzed\"\naction = \"block\"\nwhen = {quoted}\n");
    if let Ok(set) = RuleSet::from_sources([("fuzz.toml", rules.as_str())]) {
        judge(set, EVENTS.as_bytes());
    }
}

/// Arbitrary event lines judged by `RULES` in the in-process store.
pub fn events(data: &[u8]) {
    let set = RuleSet::from_sources([("fuzz.toml", RULES)]).expect("the fuzz rules compile");
    judge(set, data);
}

/// Redis replies from a server this process does not control.
pub fn redis_reply(data: &[u8]) {
    crate::store::decode_untrusted(data);
}

/// `text` as a TOML basic string.
fn toml_basic_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

const EVENTS: &str = concat!(
    r#"{"ts":1700000000000,"type":"login","result":"fail","user_id":"u1","ip":"10.1.2.3","tags":["vip",1,null]}"#,
    "\n",
    r#"{"ts":1700000001000,"type":"payment","amount":600.25,"card":{"id":"c-9"},"geo":{"country":"FR"},"email":"a@b.io","ua":"curl/8.1","ip":"2001:db8::1"}"#,
    "\n",
    r#"{"ts":"2023-11-14T22:13:22Z","type":"login","result":"ok","user_id":17,"device":{"id":null},"amount":-3}"#,
    "\n",
);

fn judge(set: RuleSet, input: &[u8]) {
    let mut engine = Engine::new(set, MemoryStore::new().with_max_keys(1_000));
    let options = ReplayOptions {
        max_event_bytes: 1 << 16,
        ..ReplayOptions::default()
    };
    let _ = replay(
        &mut engine,
        input,
        std::io::sink(),
        std::io::sink(),
        options,
    );
}
