//! `vigil replay` as a user runs it: decision records on stdout, bad lines and a summary on
//! stderr, exit 0 unless rules or input cannot be opened.

use std::io::Write;
use std::process::{Command, Output, Stdio};

const RULES: &str = r#"
[[rule]]
id = "fails-per-user"
action = "block"
match = { type = "login", result = "fail" }
dimensions = ["user_id"]
window = "1m"
bucket = "1s"
limit = 2

[[rule]]
id = "amount-per-card"
action = "review"
mode = "shadow"
match = { type = "payment" }
dimensions = ["card.id"]
window = "1h"
aggregate = "sum"
field = "amount"
limit = 100
"#;

fn vigil(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_vigil"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn vigil");
    let mut pipe = child.stdin.take().unwrap();
    // vigil may exit before reading stdin (bad rules): a broken pipe here is expected.
    let _ = pipe.write_all(stdin.unwrap_or("").as_bytes());
    drop(pipe);
    child.wait_with_output().unwrap()
}

fn rules_file(dir: &tempfile::TempDir) -> String {
    let path = dir.path().join("rules.toml");
    std::fs::write(&path, RULES).unwrap();
    path.to_str().unwrap().to_owned()
}

const INPUT: &str = concat!(
    r#"{"event_id":"a1","ts":100000,"type":"login","result":"fail","user_id":"u1"}"#,
    "\n",
    "this is not json\n",
    r#"{"event_id":"a2","ts":101000,"type":"login","result":"fail","user_id":"u1"}"#,
    "\n",
    "\n",
    "[1,2,3]\n",
    r#"{"event_id":"a3","type":"login","result":"fail","user_id":"u1"}"#,
    "\n",
    r#"{"event_id":"a4","ts":"not a time","type":"login"}"#,
    "\n",
    r#"{"event_id":17,"ts":"1970-01-01T00:01:42.000Z","type":"login","result":"fail","user_id":"u1"}"#,
    "\r\n",
    r#"{"ts":103000,"type":"login","result":"fail","user_id":null}"#,
    "\n",
    r#"{"event_id":"p1","ts":104000,"type":"payment","card":{"id":"c9"},"amount":99.5}"#,
    "\n",
    r#"{"event_id":"p2","ts":105000,"type":"payment","card":{"id":"c9"},"amount":"12"}"#,
    "\n",
    r#"{"event_id":"p3","ts":106000,"type":"payment","card":{"id":"c9"},"amount":0.75}"#,
    "\n",
    r#"{"event_id":"late","ts":1,"type":"login","result":"fail","user_id":"u1"}"#,
    "\n",
    r#"{"ts":1"#,
);

/// The rules version the first record names.
fn rules_version(stdout: &str) -> String {
    let first: serde_json::Value = serde_json::from_str(stdout.lines().next().unwrap()).unwrap();
    first["rules_version"].as_str().unwrap().to_owned()
}

#[test]
fn decisions_on_stdout_bad_lines_and_summary_on_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let rules = rules_file(&dir);
    let input = dir.path().join("events.jsonl");
    std::fs::write(&input, INPUT).unwrap();
    let out = vigil(
        &[
            "replay",
            "--rules",
            &rules,
            "--input",
            input.to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(0));

    let stdout = String::from_utf8(out.stdout).unwrap();
    let version = rules_version(&stdout);
    assert_eq!(version.len(), 12);
    assert_eq!(
        stdout.lines().collect::<Vec<_>>(),
        [
            format!(
                r#"{{"decision_id":"line/8","event_id":17,"ts":102000,"action":"block","rules_version":"{version}","hits":[{{"rule_id":"fails-per-user","mode":"enforce","action":"block","key":{{"user_id":"u1"}},"value":3,"limit":2,"window_ms":60000}}],"source":{{"line":8}}}}"#
            ),
            format!(
                r#"{{"decision_id":"line/12","event_id":"p3","ts":106000,"action":"allow","rules_version":"{version}","hits":[{{"rule_id":"amount-per-card","mode":"shadow","action":"review","key":{{"card.id":"c9"}},"value":100.25,"limit":100,"window_ms":3600000}}],"source":{{"line":12}}}}"#
            ),
        ]
    );

    let stderr = String::from_utf8(out.stderr).unwrap();
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 6, "{stderr}");
    assert!(
        lines[0].starts_with(
            "line 2: bad event (invalid_json): invalid JSON: expected ident at line 1 column 2"
        ),
        "{}",
        lines[0]
    );
    assert_eq!(
        lines[1],
        "line 5: bad event (not_an_object): not a JSON object (found array)"
    );
    assert_eq!(lines[2], "line 6: bad event (missing_ts): missing ts");
    assert!(
        lines[3]
            .starts_with("line 7: bad event (bad_ts): unusable ts: \"not a time\" is not RFC 3339"),
        "{}",
        lines[3]
    );
    assert!(
        lines[4].starts_with("line 14: bad event (invalid_json): invalid JSON: EOF while parsing"),
        "{}",
        lines[4]
    );
    assert!(
        lines[5].starts_with(
            "replay: 8 events read, 2 decisions, 5 bad lines, 1 late (0 events behind the watermark), \
             2 skipped (1 dimension, 1 sum field, 0 sum range, 0 distinct field), 0 counter reads, \
             0 distinct values over max_distinct, 2 live keys (peak 2, ~0.0 MiB of state), "
        ),
        "{}",
        lines[5]
    );
    assert!(lines[5].ends_with(" events/s"));
}

#[test]
fn stdin_gives_the_same_records_as_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let rules = rules_file(&dir);
    let input = dir.path().join("events.jsonl");
    std::fs::write(&input, INPUT).unwrap();
    let from_file = vigil(
        &[
            "replay",
            "--rules",
            &rules,
            "--input",
            input.to_str().unwrap(),
        ],
        None,
    );
    let from_stdin = vigil(&["replay", "--rules", &rules, "--input", "-"], Some(INPUT));
    assert_eq!(from_stdin.status.code(), Some(0));
    assert!(!from_file.stdout.is_empty());
    assert_eq!(from_file.stdout, from_stdin.stdout);
}

#[test]
fn emit_allow_prints_a_record_for_every_event() {
    let dir = tempfile::tempdir().unwrap();
    let rules = rules_file(&dir);
    let out = vigil(
        &["replay", "--rules", &rules, "--input", "-", "--emit-allow"],
        Some(INPUT),
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.lines().count(), 8);
    let version = rules_version(&stdout);
    assert!(stdout.starts_with(&format!(
        r#"{{"decision_id":"line/1","event_id":"a1","ts":100000,"action":"allow","rules_version":"{version}","hits":[],"source":{{"line":1}}}}"#
    )));
}

#[test]
fn unopenable_input_or_bad_rules_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let rules = rules_file(&dir);
    let out = vigil(
        &[
            "replay",
            "--rules",
            &rules,
            "--input",
            "/nonexistent/events.jsonl",
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("/nonexistent/events.jsonl: cannot open input"));

    let out = vigil(
        &[
            "replay",
            "--rules",
            "tests/fixtures/rules/invalid/bad_action.toml",
            "--input",
            "-",
        ],
        Some(INPUT),
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr)
        .starts_with("tests/fixtures/rules/invalid/bad_action.toml:3:10: invalid action"));
    assert!(out.stdout.is_empty());
}

#[test]
fn shipped_examples_show_every_kind_of_decision() {
    let out = vigil(
        &[
            "replay",
            "--rules",
            "rules",
            "--input",
            "examples/events.jsonl",
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(0));
    let records: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let fired = |rule: &str, action: &str| {
        records.iter().any(|r| {
            r["action"] == action
                && r["hits"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|h| h["rule_id"] == rule)
        })
    };
    assert!(fired("login-stuffing-ip", "block"), "credential stuffing");
    assert!(fired("login-brute-force", "block"), "brute force");
    assert!(
        fired("login-success-after-fails", "challenge"),
        "the success after the failures"
    );
    assert!(fired("login-many-devices", "alert"), "account takeover");
    assert!(fired("pay-card-testing", "block"), "card testing");
    assert!(
        fired("pay-approved-after-declines", "block"),
        "the approval after the declines"
    );
    assert!(
        fired("pay-merchant-decline-ratio", "block"),
        "a merchant under attack"
    );
    assert!(
        fired("pay-geo-mismatch-large", "challenge"),
        "a large payment with a foreign card"
    );
    assert!(fired("pay-cash-out", "review"), "cash-out");
    assert!(
        fired("pay-stolen-card", "block"),
        "a card on the stolen-card list"
    );
    assert!(
        fired("login-from-datacenter", "challenge"),
        "a login from a datacenter network"
    );
    // Test cards are allowed and end the judging (`final`): no other payment rule hits them.
    assert!(fired("pay-test-cards", "allow"), "test cards are allowed");
    assert!(
        records.iter().all(|r| {
            let hits = r["hits"].as_array().unwrap();
            !hits.iter().any(|h| h["rule_id"] == "pay-test-cards") || hits.len() == 1
        }),
        "a test card's payment has no other hit"
    );
    assert!(
        fired("login-qa-accounts", "allow") && fired("login-brute-force", "allow"),
        "QA accounts override blocks"
    );
    assert!(
        fired("login-users-ip-shadow", "allow"),
        "shadow rule alone decides allow"
    );
    let held = records
        .iter()
        .flat_map(|r| r["hits"].as_array().unwrap())
        .find(|h| h["reason"] == "held")
        .expect("a held login");
    assert_eq!(
        held["rule_id"], "login-brute-force",
        "the brute-forced account stays blocked after its failures slid out"
    );
    assert!(held["held_until"].is_i64());
    // Every shipped rule fires somewhere in the examples.
    let rules = vigil::rule_files::load(std::path::Path::new("rules")).unwrap();
    for rule in rules.rules() {
        assert!(
            records.iter().any(|r| r["hits"]
                .as_array()
                .unwrap()
                .iter()
                .any(|h| h["rule_id"] == rule.id.as_str())),
            "{} never fires",
            rule.id
        );
    }
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.starts_with("replay: 181 events read, 54 decisions, 0 bad lines, 0 late"),
        "{stderr}"
    );
}

#[test]
fn timestamps_out_of_range_or_in_the_future_are_bad_lines() {
    let dir = tempfile::tempdir().unwrap();
    let rules = rules_file(&dir);
    let input = concat!(
        r#"{"ts":9223372036854775807,"type":"login","result":"fail","user_id":"u"}"#,
        "\n",
        r#"{"ts":253402300799999,"type":"login","result":"fail","user_id":"u"}"#,
        "\n",
        r#"{"ts":"9999-12-31T23:59:59.999Z","type":"login","result":"fail","user_id":"u"}"#,
        "\n",
        r#"{"ts":253402300799999,"type":"login","result":"fail","user_id":"u"}"#,
        "\n",
        r#"{"ts":0,"type":"login","result":"fail","user_id":"u"}"#,
        "\n",
        r#"{"ts":9223372036854775808,"type":"login","result":"fail","user_id":"u"}"#,
        "\n",
        r#"{"ts":"+262142-12-31T23:59:59Z","type":"login","result":"fail","user_id":"u"}"#,
        "\n",
    );
    // One event from a broken clock must not push u's window into the future: events past the
    // future bound are bad lines, and u's real events still count.
    let out = vigil(&["replay", "--rules", &rules, "--input", "-"], Some(input));
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        "",
        "only one event of u was counted"
    );
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(stderr.contains("line 1: bad event (bad_ts): unusable ts: 9223372036854775807 is outside 0..=253402300799999"), "{stderr}");
    for line in [2, 3, 4] {
        assert!(stderr.contains(&format!("line {line}: bad event (future_ts): ts 253402300799999 is more than 300000 ms ahead")), "{stderr}");
    }
    assert!(stderr.contains("line 6: bad event (bad_ts)"), "{stderr}");
    assert!(stderr.contains("line 7: bad event (bad_ts)"), "{stderr}");
    assert!(
        stderr.contains("1 events read, 0 decisions, 6 bad lines"),
        "{stderr}"
    );

    // Without the future bound, the year-9999 events are judged (the third exceeds the limit of
    // 2), and the one at 0 is behind the watermark.
    let out = vigil(
        &[
            "replay",
            "--rules",
            &rules,
            "--input",
            "-",
            "--max-future-skew",
            "off",
        ],
        Some(input),
    );
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    assert!(stdout.contains(r#""value":3"#), "{stdout}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains(
            "4 events read, 1 decisions, 3 bad lines, 1 late (1 events behind the watermark)"
        ),
        "{stderr}"
    );
}

/// A line longer than `--max-event-bytes` is a bad line (`too_large`), read through without being
/// held; the lines around it are judged as usual; a stream with no newline at all ends as one
/// too-large line instead of growing without bound.
#[test]
fn overlong_lines_are_bad_lines_and_never_held_whole() {
    let mut input = String::new();
    input.push_str(
        r#"{"event_id":"a","ts":1700000000000,"type":"login","result":"fail","user_id":"u"}"#,
    );
    input.push('\n');
    input.push_str(&format!(
        r#"{{"event_id":"big","ts":1700000000001,"pad":"{}"}}"#,
        "x".repeat(5_000)
    ));
    input.push('\n');
    input.push_str(
        r#"{"event_id":"b","ts":1700000000002,"type":"login","result":"fail","user_id":"u"}"#,
    );
    input.push('\n');
    let out = vigil(
        &[
            "replay",
            "--rules",
            "rules",
            "--input",
            "-",
            "--emit-allow",
            "--max-event-bytes",
            "4096",
        ],
        Some(&input),
    );
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let ids: Vec<String> = stdout
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["event_id"].to_string())
        .collect();
    assert_eq!(ids, ["\"a\"", "\"b\""]);
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(stderr.contains("line 2: bad event (too_large): line of 5046 bytes is longer than max_event_bytes (4096)"), "{stderr}");

    let endless = "{".repeat(3_000_000);
    let out = vigil(
        &[
            "replay",
            "--rules",
            "rules",
            "--input",
            "-",
            "--max-event-bytes",
            "65536",
        ],
        Some(&endless),
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "its one line is bad: nothing could be decoded"
    );
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains("line 1: bad event (too_large): line of 3000000 bytes"),
        "{stderr}"
    );
}

/// Crafted amounts cannot cancel, overflow or blind a sum: each one outside [0, 1e12) is skipped
/// (reason sum_range) and the window stays exact, so the honest payments after them still fire.
#[test]
fn hostile_amounts_cannot_cancel_overflow_or_blind_a_sum() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("sum.toml");
    std::fs::write(
        &rules,
        "[[counter]]\nid = 'spend'\ndimensions = ['acct']\nwindow = '1h'\naggregate = 'sum'\nfield = 'amount'\n\n\
         [[rule]]\nid = 'big-spender'\naction = 'review'\nwhen = '$spend > 100'\n",
    )
    .unwrap();
    let mut input = String::new();
    for (i, amount) in [
        "-1e308",
        "-1e308",
        "1e308",
        "1e308",
        "-1e18",
        "1e12",
        "999999999999.9999999",
        "60",
        "50.000001",
    ]
    .iter()
    .enumerate()
    {
        input.push_str(&format!(
            "{{\"event_id\":\"e{i}\",\"ts\":{},\"acct\":\"a\",\"amount\":{amount}}}\n",
            1_700_000_000_000i64 + i as i64
        ));
    }
    let out = vigil(
        &["replay", "--rules", rules.to_str().unwrap(), "--input", "-"],
        Some(&input),
    );
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let records: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(records.len(), 1, "{stdout}");
    assert_eq!(records[0]["event_id"], "e8");
    assert_eq!(
        records[0]["hits"][0]["counters"][0]["value"].to_string(),
        "110.000001",
        "exact, never NaN or null"
    );
    let stderr = String::from_utf8(out.stderr).unwrap();
    // 999999999999.9999999 rounds half-to-even to 1e12 micro-units: out of range too.
    assert!(
        stderr.contains("7 skipped (0 dimension, 0 sum field, 7 sum range, 0 distinct field)"),
        "{stderr}"
    );
}

/// A flood of distinct keys within one lateness bound (300 000 one-off users and IPs in five
/// minutes) cannot grow the state past `--max-keys`, and an account being attacked meanwhile is
/// still counted exactly: eviction takes the keys with the fewest events first.
#[test]
fn a_flood_of_distinct_keys_stays_within_max_keys_and_spares_active_accounts() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("flood.toml");
    std::fs::write(
        &rules,
        "[[counter]]\nid = 'fails-user'\nmatch = \"result == 'fail'\"\ndimensions = ['user_id']\nwindow = '15m'\n\n\
         [[counter]]\nid = 'logins-ip'\ndimensions = ['ip']\nwindow = '1h'\n\n\
         [[rule]]\nid = 'brute-force'\naction = 'block'\nwhen = '$fails-user > 5'\nhold = '1h'\nhold_key = ['user_id']\n",
    )
    .unwrap();
    let mut input = String::with_capacity(30 << 20);
    for i in 0..300_000u64 {
        let ts = 1_700_000_000_000 + i;
        input.push_str(&format!("{{\"ts\":{ts},\"user_id\":\"flood-{i}\",\"ip\":\"10.{}.{}.{}\",\"result\":\"fail\"}}\n", i >> 16, (i >> 8) & 255, i & 255));
        // The victim fails every 2 000 flood events (4 000 new keys): far fewer than the bound.
        if i % 2_000 == 0 {
            input.push_str(&format!("{{\"event_id\":\"v{i}\",\"ts\":{ts},\"user_id\":\"victim\",\"ip\":\"192.0.2.1\",\"result\":\"fail\"}}\n"));
        }
    }
    let path = dir.path().join("flood.jsonl");
    std::fs::write(&path, &input).unwrap();
    let out = vigil(
        &[
            "replay",
            "--rules",
            rules.to_str().unwrap(),
            "--input",
            path.to_str().unwrap(),
            "--max-keys",
            "20000",
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let blocked: Vec<String> = stdout
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r["hits"][0]["rule_id"] == "brute-force")
        .map(|r| r["event_id"].as_str().unwrap_or("").to_owned())
        .collect();
    // The victim's 6th failure onwards (v10000 ..= v298000): its window survived the flood.
    let expected: Vec<String> = (5..150).map(|n| format!("v{}", n * 2_000)).collect();
    assert_eq!(blocked, expected);
    let stderr = String::from_utf8(out.stderr).unwrap();
    let summary = stderr
        .lines()
        .find(|l| l.starts_with("replay:") && l.contains("live keys"))
        .unwrap();
    let peak: usize = summary
        .split("(peak ")
        .nth(1)
        .unwrap()
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(peak <= 20_000, "{summary}");
    assert!(summary.contains("MiB of state"), "{summary}");
    assert!(summary.contains("holds evicted at the bound"), "{summary}");
    assert!(
        stderr.contains("the counter state is at its bound (--max-state-bytes / --max-keys)"),
        "{stderr}"
    );
    eprintln!("{summary}");
}

/// An input of which no line decodes is refused (exit 1, saying so), whatever `--max-bad-ratio`;
/// more bad lines than `--max-bad-ratio` allows also exits 1, after every record is out; an
/// empty input is not an error.
#[test]
fn an_input_with_no_usable_line_or_too_many_bad_ones_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let rules = rules_file(&dir);
    let out = vigil(
        &["replay", "--rules", &rules, "--input", "-"],
        Some("not json\n[1]\n{\"no\":\"ts\"}\n"),
    );
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "replay: no input line could be decoded (3 bad lines; the reasons are above)"
        ),
        "{stderr}"
    );
    let out = vigil(
        &[
            "replay",
            "--rules",
            &rules,
            "--input",
            "-",
            "--max-bad-ratio",
            "1",
        ],
        Some("not json\n"),
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "none decoded: refused whatever the ratio"
    );

    // INPUT: 8 events decode, 5 lines are bad (of 13 non-blank).
    let out = vigil(&["replay", "--rules", &rules, "--input", "-"], Some(INPUT));
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let strict = vigil(
        &[
            "replay",
            "--rules",
            &rules,
            "--input",
            "-",
            "--max-bad-ratio",
            "0.3",
        ],
        Some(INPUT),
    );
    assert_eq!(strict.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&strict.stderr);
    assert!(
        stderr.contains("replay: 5 of 13 lines were bad (38.5 %), more than --max-bad-ratio 0.3"),
        "{stderr}"
    );
    assert_eq!(strict.stdout, out.stdout, "every record is still written");
    let lenient = vigil(
        &[
            "replay",
            "--rules",
            &rules,
            "--input",
            "-",
            "--max-bad-ratio",
            "0.4",
        ],
        Some(INPUT),
    );
    assert_eq!(lenient.status.code(), Some(0));

    let empty = vigil(&["replay", "--rules", &rules, "--input", "-"], Some("\n\n"));
    assert_eq!(
        empty.status.code(),
        Some(0),
        "nothing to decode is not a bad input"
    );
    let bad_ratio = vigil(
        &[
            "replay",
            "--rules",
            &rules,
            "--input",
            "-",
            "--max-bad-ratio",
            "2",
        ],
        None,
    );
    assert_eq!(bad_ratio.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&bad_ratio.stderr).contains("\"2\" is not a share between 0 and 1"),
        "{}",
        String::from_utf8_lossy(&bad_ratio.stderr)
    );
}

/// `--input -` on a pipe is a live sidecar: each record comes out as soon as its line is read,
/// while the pipe stays open.
#[test]
fn a_piped_stdin_gets_each_record_as_soon_as_its_line_is_written() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    let rules = rules_file(&dir);
    let mut child = Command::new(env!("CARGO_BIN_EXE_vigil"))
        .args(["replay", "--rules", &rules, "--input", "-", "--emit-allow"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    for n in 1..=3 {
        writeln!(
            stdin,
            r#"{{"event_id":"live-{n}","ts":{},"type":"login","result":"fail","user_id":"u1"}}"#,
            100_000 + n
        )
        .unwrap();
        stdin.flush().unwrap();
        // Read back before writing the next line (the pipe is still open): a record held for a
        // batch to fill would block here until the test's timeout.
        let mut record = String::new();
        stdout.read_line(&mut record).unwrap();
        assert!(
            record.contains(&format!("\"event_id\":\"live-{n}\"")),
            "{record}"
        );
    }
    drop(stdin);
    assert!(child.wait().unwrap().success());
}

const ONE_EVENT: &str =
    r#"{"event_id":"a1","ts":100000,"type":"login","result":"fail","user_id":"u1"}"#;

/// A lateness bound not longer than the future bound lets one event stamped ahead make every
/// on-time event late: replay and backtest refuse it before reading anything.
#[test]
fn a_lateness_bound_one_future_event_defeats_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let rules = rules_file(&dir);
    for command in ["replay", "backtest"] {
        let out = vigil(
            &[
                command,
                "--rules",
                &rules,
                "--input",
                "-",
                "--max-lateness",
                "2m",
            ],
            Some(INPUT),
        );
        assert_eq!(out.status.code(), Some(2), "{command}");
        assert_eq!(
            String::from_utf8_lossy(&out.stderr),
            "error: --max-lateness 2m must be longer than --max-future-skew 5m: one event stamped that far ahead \
             would make every event on time late\n",
            "{command}"
        );
        assert!(out.stdout.is_empty());
        let out = vigil(
            &[
                command,
                "--rules",
                &rules,
                "--input",
                "-",
                "--max-lateness",
                "2m",
                "--max-future-skew",
                "off",
            ],
            Some(ONE_EVENT),
        );
        assert_eq!(
            out.status.code(),
            Some(0),
            "{command} with the future bound off: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Flags that would disarm a replay are refused as the worker's settings are, naming the flag.
#[test]
fn flags_that_disarm_a_replay_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let rules = rules_file(&dir);
    for (flag, value, why) in [
        (
            "--max-event-bytes",
            "0",
            "0 is too small: must be at least 64 (bytes)",
        ),
        (
            "--max-keys",
            "0",
            "0 is too small: must be at least 1 (windows)",
        ),
        (
            "--max-lateness",
            "0s",
            "0 would refuse or pause everything: write \"off\" to disable the bound",
        ),
        (
            "--max-future-skew",
            "0ms",
            "0 would refuse or pause everything: write \"off\" to disable the bound",
        ),
    ] {
        let out = vigil(
            &["replay", "--rules", &rules, "--input", "-", flag, value],
            Some(ONE_EVENT),
        );
        assert_eq!(out.status.code(), Some(2), "{flag}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.starts_with(&format!("error: invalid value '{value}' for '{flag} ")),
            "{stderr}"
        );
        assert!(stderr.contains(why), "{stderr}");
    }
}

/// An event that names a key twice is a bad line with its own reason: the amount an upstream
/// validator saw (the first) and the one vigil would judge (the last) differ.
#[test]
fn an_event_naming_a_key_twice_is_a_bad_line() {
    let dir = tempfile::tempdir().unwrap();
    let rules = rules_file(&dir);
    let input = format!(
        "{ONE_EVENT}\n{}\n",
        r#"{"event_id":"s","ts":100500,"type":"payment","card":{"id":"c9"},"amount":1,"amount":900}"#
    );
    let out = vigil(&["replay", "--rules", &rules, "--input", "-"], Some(&input));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            r#"line 2: bad event (duplicate_key): duplicate key "amount" at line 1 column 88"#
        ),
        "{stderr}"
    );
    assert!(stderr.contains("1 bad lines"), "{stderr}");
}

/// A UTF-8 byte order mark before the first line (as editors on Windows write) is not part of
/// the first event; a directory given as input is named in one clear error.
#[test]
fn a_byte_order_mark_is_skipped_and_a_directory_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let rules = rules_file(&dir);
    let out = vigil(
        &["replay", "--rules", &rules, "--input", "-", "--emit-allow"],
        Some(&format!("\u{feff}{ONE_EVENT}\n")),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("0 bad lines"), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1);
    let input = dir.path().to_str().unwrap();
    let out = vigil(&["replay", "--rules", &rules, "--input", input], None);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        format!("error: {input}: cannot open input: it is a directory (give a JSON-lines file, or - for stdin)\n")
    );
}

/// `--time FIELD`: event time from another field of the event (here the record time an export
/// kept), so a `ts` stamped ahead to make later events late changes nothing; `ts` itself is the
/// default, and a replay has no Kafka record to take time from.
#[test]
fn replay_and_backtest_take_event_time_from_the_field_named_by_time() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("fails.toml");
    std::fs::write(
        &rules,
        "[[counter]]\nid = \"fails-user-1m\"\ndimensions = [\"user_id\"]\nwindow = \"1m\"\nbucket = \"1s\"\n\
         [[rule]]\nid = \"many-fails\"\naction = \"block\"\nwhen = \"$fails-user-1m > 2\"\n",
    )
    .unwrap();
    let rules = rules.to_str().unwrap();
    // The second event is stamped 4m50s ahead of its real time.
    let input = "{\"ts\":100000,\"kafka\":{\"ts\":100000},\"user_id\":\"u\"}\n\
                 {\"ts\":390000,\"kafka\":{\"ts\":101000},\"user_id\":\"u\"}\n\
                 {\"ts\":102000,\"kafka\":{\"ts\":102000},\"user_id\":\"u\"}\n\
                 {\"ts\":103000,\"user_id\":\"u\"}\n";
    let lines = |out: &Output| -> Vec<(i64, i64)> {
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .map(|r| {
                (
                    r["source"]["line"].as_i64().unwrap(),
                    r["ts"].as_i64().unwrap(),
                )
            })
            .collect()
    };
    let by_ts = vigil(&["replay", "--rules", rules, "--input", "-"], Some(input));
    assert_eq!(by_ts.status.code(), Some(0));
    assert_eq!(lines(&by_ts), vec![], "by ts, lines 3 and 4 are late");
    let stderr = String::from_utf8_lossy(&by_ts.stderr);
    assert!(stderr.contains(" 2 late "), "{stderr}");

    let by_field = vigil(
        &[
            "replay", "--rules", rules, "--input", "-", "--time", "kafka.ts",
        ],
        Some(input),
    );
    assert_eq!(by_field.status.code(), Some(0));
    assert_eq!(lines(&by_field), vec![(3, 102_000)]);
    assert!(
        String::from_utf8_lossy(&by_field.stderr)
            .contains("line 4: bad event (bad_ts): missing kafka.ts (the event's time)"),
        "{}",
        String::from_utf8_lossy(&by_field.stderr)
    );
    let backtest = vigil(
        &[
            "backtest", "--rules", rules, "--input", "-", "--time", "kafka.ts", "--json",
        ],
        Some(input),
    );
    let report: serde_json::Value = serde_json::from_slice(&backtest.stdout).unwrap();
    assert_eq!(report["rules"][0]["hits"], 1, "{report}");

    let out = vigil(
        &[
            "replay", "--rules", rules, "--input", "-", "--time", "kafka",
        ],
        Some(input),
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains(
        "a replay reads no Kafka record: name the field of the event that holds the record timestamp"
    ));
}

/// The attack on the state bound: five failed logins on an account, then a flood of failed logins
/// from fresh users (the newest events of all), then five more failures. At a small byte bound the
/// flood is evicted before the account (fewest events first), so the account is blocked from its
/// 6th failure as without any bound. When the account does lose its window (it had fewer events
/// than the flood's keys), its next decision says so: `on_store_error = "block"` fires with
/// reason `state_dropped`, and the summary counts the judgement.
#[test]
fn a_flood_of_fresh_keys_does_not_evict_an_account_close_to_firing() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("flood.toml");
    std::fs::write(
        &rules,
        "[[counter]]\nid = 'fails-user'\ndimensions = ['user_id']\nwindow = '15m'\n\n\
         [[rule]]\nid = 'brute-force'\naction = 'block'\nmatch = \"starts_with(user_id, 'victim')\"\nwhen = '$fails-user > 5'\non_store_error = 'block'\n",
    )
    .unwrap();
    let run = |input: &str, bound: &str| {
        let path = dir.path().join("flood.jsonl");
        std::fs::write(&path, input).unwrap();
        let out = vigil(
            &[
                "replay",
                "--rules",
                rules.to_str().unwrap(),
                "--input",
                path.to_str().unwrap(),
                "--max-state-bytes",
                bound,
            ],
            None,
        );
        assert_eq!(out.status.code(), Some(0));
        let hits: Vec<(String, String, serde_json::Value)> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|r| r["event_id"].is_string())
            .map(|r| {
                let hit = &r["hits"][0];
                (
                    r["event_id"].as_str().unwrap().to_owned(),
                    hit["reason"].as_str().unwrap().to_owned(),
                    hit["counters"][0]["value"].clone(),
                )
            })
            .collect();
        (hits, String::from_utf8(out.stderr).unwrap())
    };
    let t0 = 1_700_000_000_000i64;
    let victim =
        |n: u32, ts: i64| format!("{{\"event_id\":\"v{n}\",\"ts\":{ts},\"user_id\":\"victim\"}}\n");
    let flood = |input: &mut String, per_key: u64| {
        for i in 0..60_000i64 {
            for _ in 0..per_key {
                input.push_str(&format!(
                    "{{\"ts\":{},\"user_id\":\"flood-{i}\"}}\n",
                    t0 + 1_000 + i
                ));
            }
        }
    };

    let mut input: String = (1..=5).map(|n| victim(n, t0 + i64::from(n))).collect();
    flood(&mut input, 1);
    input.extend((6..=10).map(|n| victim(n, t0 + 100_000 + i64::from(n))));
    for bound in ["2MiB", "1GiB"] {
        let (hits, stderr) = run(&input, bound);
        let expected: Vec<_> = (6..=10)
            .map(|n| {
                (
                    format!("v{n}"),
                    "when".to_owned(),
                    serde_json::Value::from(n),
                )
            })
            .collect();
        assert_eq!(hits, expected, "--max-state-bytes {bound}: {stderr}");
        if bound == "2MiB" {
            assert!(
                stderr.contains(
                    "keys and 0 holds evicted at the bound, 0 rule judgements on dropped state"
                ),
                "{stderr}"
            );
        }
    }

    // One failure, then a flood whose keys have two events each (some lose their window between
    // the two, which is flagged too, but the rule judges only the account): the account is the
    // lightest and goes; its next failure is judged on a lower bound, and the policy blocks.
    let mut input = victim(1, t0);
    flood(&mut input, 2);
    input.push_str(&victim(2, t0 + 100_000));
    let (hits, stderr) = run(&input, "2MiB");
    assert_eq!(
        hits,
        vec![(
            "v2".to_owned(),
            "state_dropped".to_owned(),
            serde_json::Value::from(1)
        )],
        "{stderr}"
    );
    assert!(
        stderr.contains(", 1 rule judgements on dropped state"),
        "{stderr}"
    );
}

/// 64-bit ids and longer numbers stay distinct everywhere: an allow rule for one id does not
/// cover its neighbour, two ids never share a counter key, a number list entry matches only
/// itself, and records echo every number as the event wrote it — each one still JSON that
/// serde_json reads (a number beyond a double's range becomes a string of its text).
#[test]
fn numbers_of_any_length_stay_distinct_and_are_echoed_as_written() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.toml");
    std::fs::write(
        &rules,
        r#"
[[list]]
id = "stolen"
kind = "number"
# Past 64 bits TOML wants a fraction; vigil reads the number exactly as written.
values = [10000000000000000001.0]

[[rule]]
id = "vip"
action = "allow"
when = "user_id == 18446744073709551615"

[[rule]]
id = "stolen-card"
action = "block"
when = "card in @stolen"

[[rule]]
id = "second-try"
action = "review"
dimensions = ["user_id"]
window = "1h"
limit = 1
"#,
    )
    .unwrap();
    let long = format!("{}1", "7".repeat(60));
    let long_too = format!("{}2", "7".repeat(60));
    let lines = [
        // The VIP (allowed), then its neighbour twice: not allowed, and counted on its own key.
        r#"{"event_id":18446744073709551616123,"ts":1000,"user_id":18446744073709551615,"card":1}"#
            .to_owned(),
        r#"{"event_id":1.50,"ts":2000,"user_id":18446744073709551614,"card":1}"#.to_owned(),
        r#"{"event_id":"e3","ts":3000,"user_id":18446744073709551614,"card":1.50}"#.to_owned(),
        // A list entry matches only itself.
        r#"{"event_id":"e4","ts":4000,"user_id":"u4","card":10000000000000000009}"#.to_owned(),
        r#"{"event_id":"e5","ts":5000,"user_id":"u5","card":10000000000000000001.0}"#.to_owned(),
        // Longer than any machine integer: two keys, then the first one again.
        format!(r#"{{"event_id":1e400,"ts":6000,"user_id":{long},"card":1}}"#),
        format!(r#"{{"event_id":"e7","ts":7000,"user_id":{long_too},"card":1}}"#),
        format!(r#"{{"event_id":"e8","ts":8000,"user_id":{long}.0,"card":1}}"#),
    ];
    let input = lines.join("\n") + "\n";
    let out = vigil(
        &[
            "replay",
            "--rules",
            rules.to_str().unwrap(),
            "--input",
            "-",
            "--emit-allow",
        ],
        Some(&input),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let records: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(records.len(), 8, "{stdout}");
    let fired = |r: &serde_json::Value| -> Vec<String> {
        r["hits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h["rule_id"].as_str().unwrap().to_owned())
            .collect()
    };
    let line: Vec<&str> = stdout.lines().collect();
    // The record echoes the id's text, every digit of it.
    assert!(
        line[0].contains(r#""event_id":18446744073709551616123,"#),
        "{}",
        line[0]
    );
    assert!(line[1].contains(r#""event_id":1.50,"#), "{}", line[1]);
    assert_eq!(fired(&records[0]), ["vip"]);
    assert_eq!(records[0]["action"], "allow");
    // The neighbour is not the VIP: its second event is its own key's second.
    assert_eq!(fired(&records[1]), Vec::<String>::new());
    assert_eq!(fired(&records[2]), ["second-try"]);
    assert!(
        line[2].contains(r#""key":{"user_id":18446744073709551614}"#),
        "{}",
        line[2]
    );
    assert_eq!(
        fired(&records[3]),
        Vec::<String>::new(),
        "list entry matched its neighbour"
    );
    assert_eq!(fired(&records[4]), ["stolen-card"]);
    // 1e400 is beyond a double: a string of its text, so serde_json reads the record.
    assert_eq!(records[5]["event_id"], "1e400");
    assert_eq!(fired(&records[5]), Vec::<String>::new());
    assert_eq!(
        fired(&records[6]),
        Vec::<String>::new(),
        "two long ids shared a key"
    );
    assert_eq!(fired(&records[7]), ["second-try"]);
    // The key is the canonical text of the value, every digit of it (the same for `….0`).
    let key = format!(r#""key":{{"user_id":{long}}}"#);
    assert!(line[7].contains(&key), "{}", line[7]);
}

/// Megabyte-scale dimension values and ids cost a bounded amount: one key stays a few hundred
/// bytes of state whatever its values (a digest past 256 bytes), two long values that differ
/// only at their end are still two keys, and a record quotes a long value by its first
/// characters, its length and a digest instead of whole.
#[test]
fn long_values_cost_bounded_state_and_bounded_records() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.toml");
    std::fs::write(
        &rules,
        "[[rule]]\nid = \"per-user\"\naction = \"review\"\ndimensions = [\"user_id\"]\nwindow = \"1h\"\nlimit = 1\n",
    )
    .unwrap();
    let filler = "x".repeat(100_000);
    let mut input = String::new();
    for i in 0..300 {
        input.push_str(&format!(
            "{{\"event_id\":\"{filler}{i}\",\"ts\":{},\"user_id\":\"{filler}{i}\"}}\n",
            1000 + i
        ));
    }
    // The first user again (its second event: fires), then one more new one (does not).
    input.push_str(&format!(
        "{{\"event_id\":\"{filler}0\",\"ts\":2000,\"user_id\":\"{filler}0\"}}\n"
    ));
    input.push_str(&format!(
        "{{\"event_id\":\"{filler}300\",\"ts\":2001,\"user_id\":\"{filler}300\"}}\n"
    ));
    let path = dir.path().join("events.jsonl");
    std::fs::write(&path, &input).unwrap();
    let out = vigil(
        &[
            "replay",
            "--rules",
            rules.to_str().unwrap(),
            "--input",
            path.to_str().unwrap(),
        ],
        None,
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines.len(),
        1,
        "{}",
        stdout.chars().take(2000).collect::<String>()
    );
    assert!(
        lines[0].len() < 1024,
        "a record of {} bytes",
        lines[0].len()
    );
    let record: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
    assert_eq!(record["hits"][0]["value"], 2);
    let quoted = |v: &serde_json::Value| v.as_str().unwrap().to_owned();
    let key = quoted(&record["hits"][0]["key"]["user_id"]);
    let id = quoted(&record["event_id"]);
    assert!(
        key.starts_with(&"x".repeat(64)) && key.contains("… (100001 bytes, blake3 "),
        "{key}"
    );
    assert_eq!(key, id, "the same value is quoted the same way");
    // 301 keys of 100 kB values: a few hundred bytes each, not 30 MB.
    let mib: f64 = stderr
        .split(" MiB of state")
        .next()
        .and_then(|s| s.rsplit('~').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no state figure in {stderr}"));
    assert!(mib < 1.0, "{mib} MiB of state for 301 keys: {stderr}");
}
