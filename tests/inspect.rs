//! `vigil inspect` and `vigil hold release` as an analyst and support run them: a key's live
//! window after replaying a file in process, the same key in a real `redis-server` after
//! `replay --redis` (with its recorded offsets and TTL), a hold ended with its audit record on
//! the decisions topic of Apache Kafka, and the worker's `/v1` endpoints on a running worker.

mod support;

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::kafka::{Broker, Record, Worker};
use support::RedisServer;

const RULES: &str = r#"
[[counter]]
id = "fails-user-10m"
match = "type == 'login' && result == 'fail'"
dimensions = ["user_id"]
window = "10m"
bucket = "1m"

[[counter]]
id = "amount-card-1h"
match = "type == 'pay'"
dimensions = ["card.id"]
window = "1h"
bucket = "10m"
aggregate = "sum"
field = "amount"

[[counter]]
id = "devices-user-1h"
dimensions = ["user_id"]
window = "1h"
bucket = "10m"
aggregate = "distinct"
field = "device"

[[counter]]
id = "last-country-user-1h"
match = "type == 'pay'"
dimensions = ["user_id"]
window = "1h"
bucket = "10m"
aggregate = "last"
field = "country"

[[counter]]
id = "fails-net-10m"
match = "type == 'login' && result == 'fail'"
dimensions = ["ip_prefix(ip, 24)"]
window = "10m"
bucket = "1m"

[[rule]]
id = "brute-force"
action = "block"
match = "type == 'login'"
when = "$fails-user-10m > 3"
hold = "30m"
hold_key = ["user_id"]

[[rule]]
id = "country-changed"
action = "review"
match = "type == 'pay'"
when = "exists($last-country-user-1h) && $last-country-user-1h != country && $amount-card-1h > 100"
"#;

/// 2023-11-14T22:00:00Z (a whole hour: buckets start at T0).
const T0: i64 = 1_699_999_200_000;

/// Five failed logins of user 7 (the number) a minute apart from two IPs of one /24, one of
/// user "7" (the string), payments on card c-1 of 30.5 and 80, a device each login.
fn events() -> String {
    let mut lines = Vec::new();
    for i in 0..5 {
        lines.push(json!({"event_id": format!("f{i}"), "ts": T0 + i * 60_000, "type": "login", "result": "fail",
            "user_id": 7, "ip": format!("10.1.2.{}", 10 + i % 2), "device": format!("d-{}", i % 3)}));
    }
    lines.push(json!({"event_id": "s0", "ts": T0 + 30_000, "type": "login", "result": "fail", "user_id": "7",
        "ip": "10.9.9.9", "device": "d-x"}));
    lines.push(json!({"event_id": "p0", "ts": T0 + 100_000, "type": "pay", "user_id": 7, "card": {"id": "c-1"},
        "amount": 30.5, "country": "FR"}));
    lines.push(json!({"event_id": "p1", "ts": T0 + 700_000, "type": "pay", "user_id": 7, "card": {"id": "c-1"},
        "amount": 80, "country": "DE"}));
    lines.iter().map(|l| format!("{l}\n")).collect::<String>()
}

fn vigil(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vigil"))
        .args(args)
        .output()
        .expect("spawn vigil")
}

fn setup(dir: &Path) -> (String, String) {
    let rules = dir.join("rules.toml");
    std::fs::write(&rules, RULES).unwrap();
    let input = dir.join("events.jsonl");
    std::fs::write(&input, events()).unwrap();
    (rules.display().to_string(), input.display().to_string())
}

fn inspect_json(args: &[&str]) -> Value {
    let out = vigil(&[&["inspect", "--json", "--max-future-skew", "off"], args].concat());
    assert!(
        out.status.success(),
        "inspect {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

/// The parts of a counter view that do not depend on where it was read.
fn window_of(view: &Value) -> Value {
    json!({
        "key": view["key"], "state": view["state"], "value": view["value"], "head_ms": view["head_ms"],
        "buckets": view["buckets"], "distinct_values": view["distinct_values"],
        "value_time_ms": view["value_time_ms"],
    })
}

#[test]
fn inspect_after_replaying_a_file_shows_each_window_as_the_engine_counted_it() {
    let dir = tempfile::tempdir().unwrap();
    let (rules, input) = setup(dir.path());
    let at = (T0 + 240_000).to_string();
    let fails = inspect_json(&[
        "--rules",
        &rules,
        "--input",
        &input,
        "--at",
        &at,
        "fails-user-10m",
        "user_id=7",
    ]);
    assert_eq!(fails["key"], json!({"user_id": 7}));
    assert_eq!(fails["state"], "counted");
    assert_eq!(fails["value"], 5);
    assert_eq!(fails["head_ms"], T0 + 240_000);
    let buckets: Vec<(i64, i64, bool)> = fails["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                b["from_ms"].as_i64().unwrap(),
                b["value"].as_i64().unwrap(),
                b["in_window"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        buckets,
        (0..5)
            .map(|i| (T0 + i * 60_000, 1, true))
            .collect::<Vec<_>>()
    );
    assert_eq!(fails["offsets"], json!([]));
    assert_eq!(fails["ttl_ms"], Value::Null);

    // Typed as in rule files: '7' is the string, another key.
    let string_key = inspect_json(&[
        "--rules",
        &rules,
        "--input",
        &input,
        "--at",
        &at,
        "fails-user-10m",
        "user_id='7'",
    ]);
    assert_eq!(string_key["key"], json!({"user_id": "7"}));
    assert_eq!(string_key["value"], 1);

    // --at earlier: the events after it are not replayed, and the window is as it stood.
    let early = inspect_json(&[
        "--rules",
        &rules,
        "--input",
        &input,
        "--at",
        &(T0 + 90_000).to_string(),
        "fails-user-10m",
        "user_id=7",
    ]);
    assert_eq!(early["value"], 2);
    // The event's time field, when given, is the time looked at.
    let stated = inspect_json(&[
        "--rules",
        &rules,
        "--input",
        &input,
        "fails-user-10m",
        "user_id=7",
        &format!("ts={}", T0 + 90_000),
    ]);
    assert_eq!(
        (stated["value"].clone(), stated["at_ms"].clone()),
        (json!(2), json!(T0 + 90_000))
    );
    // Later: the older buckets slid out of the window.
    let late = inspect_json(&[
        "--rules",
        &rules,
        "--input",
        &input,
        "--at",
        &(T0 + 780_000).to_string(),
        "fails-user-10m",
        "user_id=7",
    ]);
    assert_eq!(
        (
            late["value"].clone(),
            late["buckets"][0]["in_window"].clone()
        ),
        (json!(1), json!(false))
    );
    assert_eq!(late["buckets"][4]["in_window"], true);

    // A derived key: the /24 of the IP given.
    let net = inspect_json(&[
        "--rules",
        &rules,
        "--input",
        &input,
        "--at",
        &at,
        "fails-net-10m",
        "ip=10.1.2.200",
    ]);
    assert_eq!(net["key"], json!({"ip_prefix(ip, 24)": "10.1.2.0/24"}));
    assert_eq!(net["value"], 5);

    // Sums are exact decimals, distinct counts the values, last keeps the previous event.
    let at = (T0 + 720_000).to_string();
    let sum = inspect_json(&[
        "--rules",
        &rules,
        "--input",
        &input,
        "--at",
        &at,
        "amount-card-1h",
        "card.id=c-1",
    ]);
    assert_eq!(
        (sum["value"].clone(), sum["key"].clone()),
        (json!(110.5), json!({"card.id": "c-1"}))
    );
    let devices = inspect_json(&[
        "--rules",
        &rules,
        "--input",
        &input,
        "--at",
        &at,
        "devices-user-1h",
        "user_id=7",
    ]);
    assert_eq!(
        (devices["value"].clone(), devices["distinct_values"].clone()),
        (json!(3), json!(3))
    );
    let last = inspect_json(&[
        "--rules",
        &rules,
        "--input",
        &input,
        "--at",
        &at,
        "last-country-user-1h",
        "user_id=7",
    ]);
    assert_eq!(
        (last["value"].clone(), last["value_time_ms"].clone()),
        (json!("DE"), json!(T0 + 700_000))
    );

    // A rule: its hold (set by the 4th failure: > 3) and the counters it reads.
    let rule = inspect_json(&[
        "--rules",
        &rules,
        "--input",
        &input,
        "--at",
        &(T0 + 240_000).to_string(),
        "brute-force",
        "user_id=7",
    ]);
    assert_eq!(rule["hold"]["key"], json!({"user_id": 7}));
    assert_eq!(rule["hold"]["held_until_ms"], T0 + 240_000 + 1_800_000);
    assert_eq!(rule["hold"]["set_by_event_at_ms"], T0 + 240_000);
    assert_eq!(rule["hold"]["held_at"], true);
    assert_eq!(rule["counters"][0]["counter"], "fails-user-10m");
    assert_eq!(rule["counters"][0]["value"], 5);
    // A rule whose counters need fields not given says which.
    let review = inspect_json(&[
        "--rules",
        &rules,
        "--input",
        &input,
        "--at",
        &at,
        "country-changed",
        "user_id=7",
    ]);
    assert_eq!(review["counters"][0]["value"], "DE");
    assert_eq!(
        review["counters"][1],
        json!({"counter": "amount-card-1h", "not_formed": "its dimensions: card.id"})
    );

    // The table a person reads.
    let out = vigil(&[
        "inspect",
        "--rules",
        &rules,
        "--input",
        &input,
        "--at",
        "2023-11-14T22:04:00Z",
        "brute-force",
        "user_id=7",
    ]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("rule     brute-force (block, enforce)\nat       2023-11-14T22:04:00.000Z\nhold     30m on {\"user_id\":7}: held until 2023-11-14T22:34:00.000Z (set by an event at 2023-11-14T22:04:00.000Z)\n"), "{text}");
    assert!(text.contains("  value    5\n"), "{text}");
}

#[test]
fn inspect_refuses_what_it_cannot_look_up_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let (rules, input) = setup(dir.path());
    let cases: [(&[&str], i32, &str); 5] = [
        (&["fails-usr-10m", "user_id=7"], 1, "error: no counter or rule \"fails-usr-10m\" (did you mean \"fails-user-10m\"?)\n"),
        (&["fails-user-10m", "user_id"], 2, "error: \"user_id\": expected FIELD=VALUE (e.g. user_id=u-17)\n"),
        (&["fails-user-10m", "ip=1.2.3.4"], 1, "error: the key of counter \"fails-user-10m\" cannot be formed from the fields given (its dimensions: user_id)\n"),
        (&["fails-user-10m", "card=1", "card.id=2"], 2, "error: card.id is given twice (or inside another field given)\n"),
        (&["fails-user-10m", "a..b=1"], 2, "error: \"a..b\" is not a field path (e.g. user_id, card.country)\n"),
    ];
    for (args, code, message) in cases {
        let out = vigil(&[&["inspect", "--rules", &rules, "--input", &input], args].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {stderr}");
        assert!(stderr.ends_with(message), "{args:?}: {stderr}");
    }
    let out = vigil(&["inspect", "--rules", &rules, "fails-user-10m", "user_id=7"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--redis <URL>"));
    let out = vigil(&[
        "inspect",
        "--rules",
        &rules,
        "--input",
        &input,
        "--at",
        "yesterday",
        "fails-user-10m",
        "user_id=7",
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains(
        "\"yesterday\" is not a time: give RFC 3339 (2026-11-26T10:00:00Z) or epoch milliseconds"
    ));
}

#[test]
fn inspect_in_redis_shows_what_replay_counted_there_with_offsets_and_ttl() {
    let dir = tempfile::tempdir().unwrap();
    let (rules, input) = setup(dir.path());
    let redis = RedisServer::start();
    let url = redis.url();
    let out = vigil(&[
        "replay",
        "--rules",
        &rules,
        "--input",
        &input,
        "--redis",
        &url,
        "--max-future-skew",
        "off",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut conn = redis.connection();
    for (id, fields, at) in [
        ("fails-user-10m", "user_id=7", T0 + 240_000),
        ("fails-user-10m", "user_id='7'", T0 + 240_000),
        ("fails-net-10m", "ip=10.1.2.1", T0 + 240_000),
        ("amount-card-1h", "card.id=c-1", T0 + 720_000),
        ("devices-user-1h", "user_id=7", T0 + 720_000),
        ("last-country-user-1h", "user_id=7", T0 + 720_000),
    ] {
        let at = at.to_string();
        let in_redis = inspect_json(&["--rules", &rules, "--redis", &url, "--at", &at, id, fields]);
        let in_file = inspect_json(&[
            "--rules", &rules, "--input", &input, "--at", &at, id, fields,
        ]);
        assert_eq!(window_of(&in_redis), window_of(&in_file), "{id} {fields}");
        let name = in_redis["redis_key"].as_str().unwrap();
        let exists: bool = redis::cmd("EXISTS").arg(name).query(&mut conn).unwrap();
        assert!(exists, "{name}");
        let ttl = in_redis["ttl_ms"].as_i64().unwrap();
        assert!(ttl > 0, "{id}: ttl {ttl}");
        let offsets = in_redis["offsets"].as_array().unwrap();
        assert_eq!(offsets.len(), 1, "{id}: one input lane: {offsets:?}");
        assert!(offsets[0]["offset"].as_i64().unwrap() >= 1);
        assert_eq!(in_redis["unflushed"], false);
    }
    let rule = inspect_json(&[
        "--rules",
        &rules,
        "--redis",
        &url,
        "--at",
        &(T0 + 240_000).to_string(),
        "brute-force",
        "user_id=7",
    ]);
    assert_eq!(rule["hold"]["held_until_ms"], T0 + 240_000 + 1_800_000);
    // A key never counted: nothing in Redis, value 0.
    let none = inspect_json(&[
        "--rules",
        &rules,
        "--redis",
        &url,
        "fails-user-10m",
        "user_id=8",
    ]);
    assert_eq!(
        (
            none["value"].clone(),
            none["head_ms"].clone(),
            none["ttl_ms"].clone()
        ),
        (json!(0), Value::Null, Value::Null)
    );
}

fn decisions_with(broker: &Broker, topic: &str, wanted: impl Fn(&[Record]) -> bool) -> Vec<Value> {
    broker
        .read(
            topic,
            1,
            wanted,
            Duration::from_millis(200),
            Duration::from_secs(120),
        )
        .iter()
        .map(Record::json)
        .collect()
}

#[test]
fn hold_release_ends_the_hold_in_redis_and_writes_an_audit_record() {
    let dir = tempfile::tempdir().unwrap();
    let (rules, input) = setup(dir.path());
    let redis = RedisServer::start();
    let broker = Broker::shared();
    let topics = broker.topics("release-cli", 1);
    let url = redis.url();
    let out = vigil(&[
        "replay",
        "--rules",
        &rules,
        "--input",
        &input,
        "--redis",
        &url,
        "--max-future-skew",
        "off",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A reason is required.
    let out = vigil(&[
        "hold",
        "release",
        "--rules",
        &rules,
        "--redis",
        &url,
        "--brokers",
        &broker.bootstrap(),
        "brute-force",
        "user_id=7",
    ]);
    assert_eq!(out.status.code(), Some(2));
    // Without a decisions topic (no --brokers, --config or VIGIL_KAFKA_BROKERS) the release is
    // made and its audit record printed only, said so.
    let out = vigil(&[
        "hold",
        "release",
        "--rules",
        &rules,
        "--redis",
        &url,
        "--reason",
        "t",
        "brute-force",
        "user_id=8",
    ]);
    assert_eq!(out.status.code(), Some(0));
    let printed: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (printed["key"].clone(), printed["released_until"].clone()),
        (json!({"user_id": 8}), Value::Null)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains(
        "warning: no decisions topic given (--config, --brokers or VIGIL_KAFKA_BROKERS): the audit record above was not written to Kafka"
    ));
    let out = vigil(&[
        "hold",
        "release",
        "--rules",
        &rules,
        "--redis",
        &url,
        "--brokers",
        &broker.bootstrap(),
        "--reason",
        "t",
        "fails-user-10m",
        "user_id=7",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("\"fails-user-10m\" is a counter: a hold belongs to a rule"));

    let out = vigil(&[
        "hold",
        "release",
        "--rules",
        &rules,
        "--redis",
        &url,
        "--brokers",
        &broker.bootstrap(),
        "--topic",
        &topics.decisions,
        "--reason",
        "ticket 4711: customer verified",
        "brute-force",
        "user_id=7",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let printed: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(printed["kind"], "hold_release");
    assert_eq!(printed["rule"], "brute-force");
    assert_eq!(printed["key"], json!({"user_id": 7}));
    assert_eq!(printed["reason"], "ticket 4711: customer verified");
    assert_eq!(printed["released_until"], T0 + 240_000 + 1_800_000);
    assert!(
        stderr.contains(
            "released: brute-force on {\"user_id\":7} was held until 2023-11-14T22:34:00.000Z"
        ),
        "{stderr}"
    );
    let records = decisions_with(&broker, &topics.decisions, |r| !r.is_empty());
    assert_eq!(
        records,
        vec![printed.clone()],
        "the audit record is on the decisions topic"
    );

    // Not held any more; the next login of the key is judged as if it had never been.
    let rule = inspect_json(&[
        "--rules",
        &rules,
        "--redis",
        &url,
        "--at",
        &(T0 + 300_000).to_string(),
        "brute-force",
        "user_id=7",
    ]);
    assert_eq!(rule["hold"]["held_until_ms"], Value::Null);
    let next = dir.path().join("next.jsonl");
    std::fs::write(
        &next,
        json!({"event_id": "ok1", "ts": T0 + 1_000_000, "type": "login", "result": "ok", "user_id": 7}).to_string() + "\n",
    )
    .unwrap();
    let out = vigil(&[
        "replay",
        "--rules",
        &rules,
        "--input",
        &next.display().to_string(),
        "--redis",
        &url,
        "--max-future-skew",
        "off",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "",
        "not held: no decision"
    );
    // Releasing again: nothing held, said so, and audited all the same.
    let out = vigil(&[
        "hold",
        "release",
        "--rules",
        &rules,
        "--redis",
        &url,
        "--brokers",
        &broker.bootstrap(),
        "--topic",
        &topics.decisions,
        "--reason",
        "again",
        "brute-force",
        "user_id=7",
    ]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("was not held"));
}

/// HTTP/1.1 request to the worker: (status, body).
fn request(
    worker: &Worker,
    method: &str,
    path: &str,
    headers: &[&str],
    body: &str,
) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", worker.http_port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    for h in headers {
        head.push_str(h);
        head.push_str("\r\n");
    }
    write!(stream, "{head}\r\n{body}").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let status = response.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

#[test]
fn a_running_worker_serves_lookups_and_releases_a_hold_only_with_the_admin_token() {
    let dir = tempfile::tempdir().unwrap();
    let (rules, _) = setup(dir.path());
    let (broker, redis) = (Broker::shared(), RedisServer::start());
    let topics = broker.topics("lookups", 1);
    let config = format!(
        "{}[redis]\nurl = \"{}\"\n[rules]\npath = \"{rules}\"\n[worker]\nemit_allow = true\ncommit_interval = \"200ms\"\n",
        topics.kafka_section(&broker),
        redis.url()
    );
    let mut worker = Worker::start_with_env(
        dir.path(),
        "w",
        &config,
        &[("VIGIL_HTTP_ADMIN_TOKEN", "s3cret-token")],
    );
    worker.wait_ready(Duration::from_secs(240));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
        - 20 * 60_000;
    let login = |id: &str, ts: i64, result: &str| -> (Option<Vec<u8>>, Vec<u8>) {
        (
            Some(b"u-42".to_vec()),
            json!({"event_id": id, "ts": ts, "type": "login", "result": result, "user_id": "u-42"})
                .to_string()
                .into_bytes(),
        )
    };
    let fails: Vec<_> = (0..4)
        .map(|i| login(&format!("f{i}"), now + i * 1_000, "fail"))
        .collect();
    broker.produce(&topics.events, &fails, Some(0));
    let decided = decisions_with(&broker, &topics.decisions, |r| r.len() >= 4);
    let held_until = decided
        .iter()
        .find(|r| r["event_id"] == "f3")
        .map(|r| r["hits"][0]["held_until"].clone())
        .unwrap();
    assert_eq!(held_until, json!(now + 3_000 + 1_800_000));

    // Read-only lookups, typed as in rule files, at the time `ts` gives (default: now).
    let at = now + 3_000;
    let (status, body) = request(
        &worker,
        "GET",
        "/v1/counters/fails-user-10m?user_id=u-42",
        &[],
        "",
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["value"],
        0,
        "now, the failures slid out"
    );
    let (status, body) = request(
        &worker,
        "GET",
        &format!("/v1/counters/fails-user-10m?user_id=u-42&ts={at}"),
        &[],
        "",
    );
    assert_eq!(status, 200, "{body}");
    let counter: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (counter["key"].clone(), counter["value"].clone()),
        (json!({"user_id": "u-42"}), json!(4))
    );
    // A count over the account: a section of the hash the account's counters share.
    assert!(counter["redis_key"].as_str().unwrap().starts_with("vg:_:"));
    assert_eq!(
        counter["redis_field_prefix"].as_str().map(str::len),
        Some(9),
        "{counter}"
    );
    let (status, body) = request(
        &worker,
        "GET",
        &format!("/v1/rules/brute-force?user_id=u-42&ts={at}"),
        &[],
        "",
    );
    assert_eq!(status, 200, "{body}");
    let rule: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(rule["hold"]["held_until_ms"], held_until);
    assert_eq!(rule["counters"][0]["value"], 4);
    let (status, body) = request(
        &worker,
        "GET",
        "/v1/rules/brute-force/hold?user_id=u-42",
        &[],
        "",
    );
    assert_eq!(
        (
            status,
            serde_json::from_str::<Value>(&body).unwrap()["hold"]["held_until_ms"].clone()
        ),
        (200, held_until.clone())
    );
    for (path, status, code) in [
        ("/v1/counters/nope?user_id=u-42", 404, "unknown_id"),
        (
            "/v1/counters/brute-force?user_id=u-42",
            404,
            "not_a_counter",
        ),
        ("/v1/rules/fails-user-10m?user_id=u-42", 404, "not_a_rule"),
        (
            "/v1/counters/fails-user-10m?ip=1.2.3.4",
            400,
            "key_not_formed",
        ),
        ("/v1/counters/fails-user-10m?a..b=1", 400, "bad_field"),
        (
            "/v1/counters/fails-user-10m?user_id=u-42&ts=soon",
            400,
            "bad_field",
        ),
    ] {
        let (got, body) = request(&worker, "GET", path, &[], "");
        assert_eq!(
            (
                got,
                serde_json::from_str::<Value>(&body).unwrap()["error"].clone()
            ),
            (status, json!(code)),
            "{path}: {body}"
        );
    }

    // Writes need the token, and a reason.
    let release = "/v1/rules/brute-force/hold?user_id=u-42";
    let reason = r#"{"reason":"ticket 4711"}"#;
    for headers in [
        &[][..],
        &["Authorization: Bearer wrong"][..],
        &["Authorization: s3cret-token"][..],
    ] {
        let (status, body) = request(&worker, "DELETE", release, headers, reason);
        assert_eq!(status, 403, "{headers:?}: {body}");
    }
    let auth = [
        "Authorization: Bearer s3cret-token",
        "Content-Type: application/json",
    ];
    let (status, body) = request(&worker, "DELETE", release, &auth, "{}");
    assert_eq!(status, 400, "{body}");
    let (status, body) = request(&worker, "DELETE", release, &auth, reason);
    assert_eq!(status, 200, "{body}");
    let audit: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (
            audit["kind"].clone(),
            audit["rule"].clone(),
            audit["key"].clone(),
            audit["reason"].clone(),
            audit["released_until"].clone()
        ),
        (
            json!("hold_release"),
            json!("brute-force"),
            json!({"user_id": "u-42"}),
            json!("ticket 4711"),
            held_until
        )
    );

    // The next login of the key, 15 minutes later (the failures are out of its window, the hold
    // would still stand), is judged as if the hold had never been set: allowed.
    broker.produce(
        &topics.events,
        &[login("ok1", now + 15 * 60_000, "ok")],
        Some(0),
    );
    let records = decisions_with(&broker, &topics.decisions, |r| {
        r.iter().any(|r| r.json()["event_id"] == "ok1")
    });
    assert!(
        records.contains(&audit),
        "the audit record is on the decisions topic"
    );
    let ok = records.iter().find(|r| r["event_id"] == "ok1").unwrap();
    assert_eq!(
        (ok["action"].clone(), ok["hits"].clone()),
        (json!("allow"), json!([]))
    );
    let (_, body) = request(
        &worker,
        "GET",
        "/v1/rules/brute-force?user_id=u-42",
        &[],
        "",
    );
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["hold"]["held_until_ms"],
        Value::Null
    );

    // Counted by endpoint and status; no key in the metrics or the log.
    let metrics = request(&worker, "GET", "/metrics", &[], "").1;
    assert!(
        metrics.contains("vigil_lookups_total{endpoint=\"release\",status=\"200\"} 1"),
        "{metrics}"
    );
    assert!(!metrics.contains("u-42"));
    let started = Instant::now();
    while !worker.log_text().contains("hold released by an operator")
        && started.elapsed() < Duration::from_secs(10)
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = worker.log_text();
    assert!(log.contains("hold released by an operator"), "{log}");
    assert!(
        !log.contains("u-42") && !log.contains("ticket 4711"),
        "{log}"
    );
}

#[test]
fn without_an_admin_token_every_write_endpoint_answers_403() {
    let dir = tempfile::tempdir().unwrap();
    let (rules, _) = setup(dir.path());
    let broker = Broker::shared();
    let topics = broker.topics("no-token", 1);
    let config = format!(
        "{}[rules]\npath = \"{rules}\"\n",
        topics.kafka_section(&broker)
    );
    let mut worker = Worker::start(dir.path(), "w", &config);
    worker.wait_ready(Duration::from_secs(240));
    let (status, body) = request(
        &worker,
        "DELETE",
        "/v1/rules/brute-force/hold?user_id=7",
        &["Authorization: Bearer anything"],
        r#"{"reason":"x"}"#,
    );
    assert_eq!(status, 403);
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["error"],
        "no_admin_token"
    );
    // Reads work on the in-process store too.
    let (status, body) = request(
        &worker,
        "GET",
        "/v1/counters/fails-user-10m?user_id=7",
        &[],
        "",
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["redis_key"],
        Value::Null
    );
}
