//! `vigil gen` with injected fraud, and `vigil backtest` on it: the report agrees with replay's
//! decisions and says which patterns each rule caught.

use std::collections::BTreeMap;
use std::process::Command;

fn vigil(args: &[&str]) -> std::process::Output {
    let output = Command::new(env!("CARGO_BIN_EXE_vigil"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "vigil {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

#[test]
fn backtest_reports_hits_keys_and_caught_fraud_consistently_with_replay() {
    let dir = tempfile::tempdir().unwrap();
    let events = dir.path().join("events.jsonl");
    let generated = vigil(&[
        "gen", "--events", "60000", "--users", "5000", "--fraud", "0.03", "--seed", "5",
    ]);
    std::fs::write(&events, &generated.stdout).unwrap();
    let text = String::from_utf8(generated.stdout).unwrap();
    let tagged = |pattern: &str| {
        text.lines()
            .filter(|l| l.contains(&format!("\"fraud\":\"{pattern}\"")))
            .count() as u64
    };

    let report: serde_json::Value = serde_json::from_slice(
        &vigil(&[
            "backtest",
            "--rules",
            "rules",
            "--input",
            events.to_str().unwrap(),
            "--json",
        ])
        .stdout,
    )
    .unwrap();
    assert_eq!(report["events"], 60_000);
    for pattern in ["credential_stuffing", "card_testing", "account_takeover"] {
        assert!(tagged(pattern) > 100, "{pattern}: {}", tagged(pattern));
        assert_eq!(
            report["fraud_events"][pattern].as_u64(),
            Some(tagged(pattern)),
            "{pattern}"
        );
    }

    // Hits per rule and first/last hit equal what replay decides.
    let replay = vigil(&[
        "replay",
        "--rules",
        "rules",
        "--input",
        events.to_str().unwrap(),
    ]);
    let mut hits: BTreeMap<String, (u64, i64, i64)> = BTreeMap::new();
    for line in String::from_utf8(replay.stdout).unwrap().lines() {
        let record: serde_json::Value = serde_json::from_str(line).unwrap();
        let ts = record["ts"].as_i64().unwrap();
        for hit in record["hits"].as_array().unwrap() {
            let entry = hits
                .entry(hit["rule_id"].as_str().unwrap().to_owned())
                .or_insert((0, ts, ts));
            entry.0 += 1;
            entry.2 = ts;
        }
    }
    let rules = report["rules"].as_array().unwrap();
    assert_eq!(rules.len(), 20);
    for rule in rules {
        let id = rule["rule_id"].as_str().unwrap();
        let (n, first, last) = hits.get(id).copied().unwrap_or((0, 0, 0));
        assert_eq!(rule["hits"].as_u64(), Some(n), "{id}");
        if n > 0 {
            assert_eq!(rule["first_hit_ts"].as_i64(), Some(first), "{id}");
            assert_eq!(rule["last_hit_ts"].as_i64(), Some(last), "{id}");
            assert!(
                rule["keys_hit"].as_u64().unwrap() >= 1 && rule["keys_hit"].as_u64().unwrap() <= n,
                "{id}"
            );
        }
        assert!(rule["matched"].as_u64().unwrap() >= n, "{id}");
    }
    // Each pattern is caught by the rule written for it.
    let caught = |rule: &str, pattern: &str| {
        rules.iter().find(|r| r["rule_id"] == rule).unwrap()["fraud_caught"][pattern]
            .as_u64()
            .unwrap_or(0)
    };
    assert!(
        caught("login-stuffing-ip", "credential_stuffing") * 2 > tagged("credential_stuffing") / 3
    );
    assert!(caught("pay-card-testing", "card_testing") > 0);
    assert!(caught("pay-approved-after-declines", "card_testing") > 0);
    assert!(caught("login-many-devices", "account_takeover") * 2 > tagged("account_takeover"));

    let table = String::from_utf8(
        vigil(&[
            "backtest",
            "--rules",
            "rules",
            "--input",
            events.to_str().unwrap(),
        ])
        .stdout,
    )
    .unwrap();
    assert!(
        table.starts_with(&format!(
            "60000 events (0 bad lines, {} late for every counter)",
            report["late_events"]
        )),
        "{table}"
    );
    assert!(!table.contains("warning:"), "{table}");
    assert!(
        table.contains("login-stuffing-ip") && table.contains("credential_stuffing "),
        "{table}"
    );
    assert!(
        table.contains("injected fraud caught by enforce-mode rules:"),
        "{table}"
    );
}

#[test]
fn gen_by_duration_and_without_fraud() {
    let out = vigil(&["gen", "--duration", "10s", "--rate", "100", "--fraud", "0"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.lines().count(), 1000);
    assert!(!text.contains("\"fraud\""));
}

/// A backtest of which no line decodes exits 1; `--max-bad-ratio` bounds the share of bad lines.
#[test]
fn a_backtest_with_no_usable_line_or_too_many_bad_ones_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "not json\n{\"ts\":\"yesterday\"}\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_vigil"))
        .args([
            "backtest",
            "--rules",
            "rules",
            "--input",
            bad.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("backtest: no input line could be decoded (2 bad lines"),
        "{stderr}"
    );
    let mixed = dir.path().join("mixed.jsonl");
    std::fs::write(&mixed, "{\"ts\":1,\"type\":\"login\"}\nnot json\n").unwrap();
    let args = |ratio: &str| {
        Command::new(env!("CARGO_BIN_EXE_vigil"))
            .args([
                "backtest",
                "--rules",
                "rules",
                "--input",
                mixed.to_str().unwrap(),
                "--max-bad-ratio",
                ratio,
            ])
            .output()
            .unwrap()
    };
    assert_eq!(args("0.5").status.code(), Some(0));
    let strict = args("0.1");
    assert_eq!(strict.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&strict.stderr)
        .contains("backtest: 1 of 2 lines were bad (50.0 %), more than --max-bad-ratio 0.1"));
}

/// `vigil gen` refuses arguments that would give no or nonsensical events, naming the argument,
/// and documents the events it writes in `--help`.
#[test]
fn gen_validates_its_arguments_and_documents_its_events() {
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_vigil"))
            .arg("gen")
            .args(args)
            .output()
            .unwrap()
    };
    for (args, wanted) in [
        (&["--fraud", "2"][..], "--fraud"),
        (&["--events", "0"][..], "--events"),
        (&["--users", "0"][..], "--users"),
        (&["--rate", "0"][..], "--rate"),
        (&["--ips", "0"][..], "--ips"),
        (&["--skew=-1"][..], "--skew"),
        (&["--duration", "1 fortnight"][..], "--duration"),
        (
            &["--duration", "500ms", "--rate", "1"][..],
            "--duration 500ms at --rate 1 events/s gives no event",
        ),
    ] {
        let out = run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(wanted),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Durations as rule files write them.
    for (duration, events) in [("90s", 90), ("15m", 900), ("1d", 86_400), ("1w", 604_800)] {
        let out = run(&["--duration", duration, "--rate", "1", "--fraud", "0"]);
        assert!(out.status.success(), "{duration}");
        assert_eq!(
            out.stdout.iter().filter(|&&b| b == b'\n').count(),
            events,
            "{duration}"
        );
    }
    let help = String::from_utf8(run(&["--help"]).stdout).unwrap();
    for wanted in [
        "event_id",
        "user_id",
        "merchant_id",
        "credential_stuffing",
        "keyed by its user_id",
    ] {
        assert!(help.contains(wanted), "{wanted} not in:\n{help}");
    }
}

/// A reader that stops reading (`vigil … | head -1`) ends the command quietly, exit 0.
#[test]
fn a_closed_stdout_ends_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let events = dir.path().join("events.jsonl");
    let generated = Command::new(env!("CARGO_BIN_EXE_vigil"))
        .args(["gen", "--events", "20000"])
        .output()
        .unwrap();
    std::fs::write(&events, &generated.stdout).unwrap();
    for args in [
        &[
            "backtest",
            "--rules",
            "rules",
            "--input",
            events.to_str().unwrap(),
        ][..],
        &[
            "backtest",
            "--rules",
            "rules",
            "--input",
            events.to_str().unwrap(),
            "--json",
        ][..],
        &["check", "rules"][..],
        &[
            "replay",
            "--rules",
            "rules",
            "--input",
            events.to_str().unwrap(),
            "--emit-allow",
        ][..],
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_vigil"))
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // The reader goes away before anything is written.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("Broken pipe") && !stderr.contains("panicked"),
            "{args:?}: {stderr}"
        );
    }
}

/// One event two days ahead in front of an input moves the watermark past all the others: the
/// backtest counts them late (in total and per counter) and names the line that did it; an input
/// without it has nothing late and no warning.
#[test]
fn a_line_that_makes_the_rest_late_is_named_and_late_events_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("fails.toml");
    std::fs::write(
        &rules,
        "[[counter]]\nid = \"fails-user-10m\"\ndimensions = [\"user_id\"]\nwindow = \"10m\"\n\
         [[rule]]\nid = \"many-fails\"\naction = \"block\"\nwhen = \"$fails-user-10m > 1\"\n",
    )
    .unwrap();
    let history: String = (0..4)
        .map(|i| {
            format!(
                "{{\"ts\":{},\"user_id\":\"u\"}}\n",
                1_700_000_000_000i64 + i * 1_000
            )
        })
        .collect();
    let stray = "{\"ts\":1700172800000,\"user_id\":\"x\"}\n";
    let run = |input: &str, json: bool| {
        let path = dir.path().join("events.jsonl");
        std::fs::write(&path, input).unwrap();
        let mut args = vec![
            "backtest",
            "--rules",
            rules.to_str().unwrap(),
            "--input",
            path.to_str().unwrap(),
        ];
        if json {
            args.push("--json");
        }
        vigil(&args)
    };

    let clean = run(&history, true);
    let report: serde_json::Value = serde_json::from_slice(&clean.stdout).unwrap();
    assert_eq!(
        (
            &report["late_events"],
            &report["watermark_jumps"],
            &report["rules"][0]["hits"]
        ),
        (
            &serde_json::json!(0),
            &serde_json::json!([]),
            &serde_json::json!(3)
        )
    );
    assert!(
        clean.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&clean.stderr)
    );

    let poisoned = format!("{stray}{history}");
    let out = run(&poisoned, true);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["late_events"], 4);
    assert_eq!(report["rules"][0]["hits"], 0);
    assert_eq!(
        report["watermark_jumps"],
        serde_json::json!([{"line": 1, "ts": 1_700_172_800_000i64, "next_ts": 1_700_000_000_000i64, "late_events": 4}])
    );
    let counters = report["counters"].as_array().unwrap();
    assert_eq!(counters.len(), 1);
    for (field, want) in [
        ("counter_id", serde_json::json!("fails-user-10m")),
        ("counted", serde_json::json!(1)),
        ("late", serde_json::json!(4)),
        ("skipped", serde_json::json!({})),
        ("distinct_capped", serde_json::json!(0)),
    ] {
        assert_eq!(counters[0][field], want, "{field}");
    }
    let warning = "warning: line 1: its time (2023-11-16 22:13:20 UTC) is 2days ahead of the event after it \
                   (2023-11-14 22:13:20 UTC): it moved the watermark past the input's other events, and 4 of them \
                   were then late for every counter. A stray event from another time? Remove it, or raise --max-lateness\n";
    assert_eq!(String::from_utf8_lossy(&out.stderr), warning);

    let table = String::from_utf8(run(&poisoned, false).stdout).unwrap();
    assert!(
        table.starts_with("5 events (0 bad lines, 4 late for every counter), 0 with a hit"),
        "{table}"
    );
    assert!(
        table.contains(
            "\nfails-user-10m         1         4         1         1         1         1  -\n"
        ),
        "{table}"
    );
    assert!(table.ends_with(warning), "{table}");
}

/// The tuning part of a backtest: each counter's value distribution and top keys, precision and
/// recall against a label field, and a v1-form rule re-judged at candidate limits in one pass —
/// every figure checked by hand on a small input.
#[test]
fn a_backtest_tunes_a_limit_with_labels_distributions_and_a_sweep() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.toml");
    std::fs::write(
        &rules,
        "[[rule]]\nid = 'fails'\naction = 'block'\nmatch = { result = 'fail' }\ndimensions = ['user_id']\nwindow = '1h'\nlimit = 2\n",
    )
    .unwrap();
    // u1 fails 4 times (labelled fraud), u2 twice (labelled legitimate), u3 3 times (no label).
    let mut lines = Vec::new();
    let mut ts = 1_700_000_000_000i64;
    for (user, times, label) in [
        ("u1", 4, ",\"bad\":true"),
        ("u2", 2, ",\"bad\":false"),
        ("u3", 3, ""),
    ] {
        for _ in 0..times {
            ts += 1000;
            lines.push(format!(
                r#"{{"ts":{ts},"result":"fail","user_id":"{user}"{label}}}"#
            ));
        }
    }
    let events = dir.path().join("events.jsonl");
    std::fs::write(&events, lines.join("\n")).unwrap();
    let args = |json: bool| {
        let mut args = vec![
            "backtest".to_owned(),
            "--rules".into(),
            rules.to_str().unwrap().into(),
            "--input".into(),
            events.to_str().unwrap().into(),
            "--label".into(),
            "bad".into(),
            "--sweep".into(),
            "fails=0,1,3".into(),
        ];
        if json {
            args.push("--json".into());
        }
        args
    };
    let json_args = args(true);
    let out = vigil(&json_args.iter().map(String::as_str).collect::<Vec<_>>());
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (
            report["labelled_fraud"].as_u64(),
            report["labelled_legit"].as_u64()
        ),
        (Some(4), Some(2))
    );
    let rule = &report["rules"][0];
    assert_eq!(rule["hits"], 3);
    assert_eq!(
        rule["labelled"],
        serde_json::json!({"fraud_hits": 2, "legit_hits": 0, "unlabelled_hits": 1, "precision": 1.0, "recall": 0.5})
    );
    let counter = &report["counters"][0];
    assert_eq!(
        counter["values"],
        serde_json::json!({"counted": 9, "sampled": false, "p50": 2, "p90": 4, "p99": 4, "max": 4})
    );
    assert_eq!(
        counter["top_keys"],
        serde_json::json!([
            {"key": {"user_id": "u1"}, "peak": 4},
            {"key": {"user_id": "u3"}, "peak": 3},
            {"key": {"user_id": "u2"}, "peak": 2}
        ])
    );
    let candidates = &report["sweeps"][0]["candidates"];
    let row = |i: usize| {
        let c = &candidates[i];
        (
            c["limit"].as_u64().unwrap(),
            c["hits"].as_u64().unwrap(),
            c["keys"].as_u64().unwrap(),
            c["fraud_hits"].as_u64().unwrap(),
            c["legit_hits"].as_u64().unwrap(),
            c["unlabelled_hits"].as_u64().unwrap(),
        )
    };
    assert_eq!(row(0), (0, 9, 3, 4, 2, 3));
    assert_eq!(row(1), (1, 6, 3, 3, 1, 2));
    assert_eq!(row(2), (3, 1, 1, 1, 0, 0));
    assert_eq!(candidates[0]["precision"].as_f64().unwrap(), 4.0 / 6.0);
    assert_eq!(candidates[1]["recall"].as_f64().unwrap(), 0.75);
    // The table shows the same.
    let table_args = args(false);
    let table = vigil(&table_args.iter().map(String::as_str).collect::<Vec<_>>());
    let table = String::from_utf8(table.stdout).unwrap();
    assert!(
        table.contains("labels (bad): 4 fraud, 2 legitimate, 3 unlabelled events"),
        "{table}"
    );
    assert!(table.contains("sweep of fails:"), "{table}");
    assert!(
        table.contains(r#"{"user_id":"u1"} 4, {"user_id":"u3"} 3, {"user_id":"u2"} 2"#),
        "{table}"
    );
    // --compare: the same rule at limit 3 decides u1's 3rd event (line 3) and u3's 3rd (line 9)
    // differently; both records are listed.
    let other = dir.path().join("other.toml");
    std::fs::write(
        &other,
        "[[rule]]\nid = 'fails'\naction = 'block'\nmatch = { result = 'fail' }\ndimensions = ['user_id']\nwindow = '1h'\nlimit = 3\n",
    )
    .unwrap();
    let out = vigil(&[
        "backtest",
        "--rules",
        rules.to_str().unwrap(),
        "--input",
        events.to_str().unwrap(),
        "--compare",
        other.to_str().unwrap(),
        "--json",
    ]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["differing_events"], 2);
    let differences = report["differences"].as_array().unwrap();
    assert_eq!(
        differences
            .iter()
            .map(|d| d["line"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [3, 9]
    );
    assert_eq!(differences[0]["record"]["action"], "block");
    assert_eq!(differences[0]["other_record"]["action"], "allow");
    assert_eq!(
        differences[0]["other_record"]["hits"],
        serde_json::json!([])
    );
    let out = vigil(&[
        "backtest",
        "--rules",
        rules.to_str().unwrap(),
        "--input",
        events.to_str().unwrap(),
        "--compare",
        other.to_str().unwrap(),
    ]);
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.contains("2 events decided differently by the other rule set\n  line 3: block [fails] → allow []\n  line 9: block [fails] → allow []\n"), "{table}");
    // A sweep of a rule without `limit` is refused, saying why.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_vigil"))
        .args([
            "backtest",
            "--rules",
            rules.to_str().unwrap(),
            "--input",
            events.to_str().unwrap(),
            "--sweep",
            "nope=1",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "--sweep: no rule \"nope\""
    );
}

/// A rule whose whole `when` compares a counter with a number is swept too: the number is
/// replaced, the rule judges every event in its scope (fed the counter or not), and each
/// candidate fires exactly as the rule would with that number written in. Any other `when` is
/// refused, saying which forms a sweep re-judges.
#[test]
fn a_sweep_re_judges_a_when_that_compares_a_counter_with_a_number() {
    let dir = tempfile::tempdir().unwrap();
    let counter = "[[counter]]\nid = 'fails'\nmatch = \"result == 'fail'\"\ndimensions = ['user_id']\nwindow = '1h'\n";
    let rule = |id: &str, when: &str| {
        format!("[[rule]]\nid = '{id}'\naction = 'challenge'\nmatch = \"result == 'ok'\"\nwhen = \"{when}\"\n")
    };
    let swept = dir.path().join("swept.toml");
    std::fs::write(
        &swept,
        format!(
            "{counter}{}{}",
            rule("ok-after", "$fails >= 2"),
            rule("other", "$fails > 1 && user_id != 'x'")
        ),
    )
    .unwrap();
    // u1: 3 failures then a success; u2: 1 failure then a success; u3: a success only.
    let mut lines = Vec::new();
    let mut ts = 1_700_000_000_000i64;
    for (user, fails) in [("u1", 3), ("u2", 1), ("u3", 0)] {
        for _ in 0..fails {
            ts += 1000;
            lines.push(format!(
                r#"{{"ts":{ts},"result":"fail","user_id":"{user}"}}"#
            ));
        }
        ts += 1000;
        lines.push(format!(r#"{{"ts":{ts},"result":"ok","user_id":"{user}"}}"#));
    }
    let events = dir.path().join("events.jsonl");
    std::fs::write(&events, lines.join("\n")).unwrap();
    let run = |rules: &std::path::Path, sweep: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_vigil"))
            .args([
                "backtest",
                "--rules",
                rules.to_str().unwrap(),
                "--input",
                events.to_str().unwrap(),
                "--json",
                "--sweep",
                sweep,
            ])
            .output()
            .unwrap()
    };
    let out = run(&swept, "ok-after=0,1,2,3,4");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let hits: Vec<(u64, u64)> = report["sweeps"][0]["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["hits"].as_u64().unwrap(), c["keys"].as_u64().unwrap()))
        .collect();
    // >= 0: every success (3, by 3 users); >= 1: u1 and u2; >= 2 and >= 3: u1; >= 4: none.
    assert_eq!(hits, vec![(3, 3), (2, 2), (1, 1), (1, 1), (0, 0)]);
    // The counter's distribution holds its value at the events it counted (4 failures) and at
    // those the rule judged with it (3 successes): 1 2 3 1 | 3 1 0.
    let values = &report["counters"][0]["values"];
    assert_eq!(
        (
            values["counted"].clone(),
            values["p50"].clone(),
            values["max"].clone()
        ),
        (
            serde_json::json!(7),
            serde_json::json!(1),
            serde_json::json!(3)
        )
    );
    // The candidate equal to the rule's own number gives the rule's own hits.
    let own = report["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["rule_id"] == "ok-after")
        .unwrap();
    assert_eq!(own["hits"], 1);
    let out = run(&swept, "other=1");
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "--sweep: rule \"other\" has neither a `limit` nor a `when` of the form \"$counter > N\" or \"$counter >= N\" (the two forms a sweep re-judges)"
    );
}

/// "Why does this counter count nothing?": each skip reason with the field that made it, a
/// dimension entry counted event by event, the summed field for the other reasons.
#[test]
fn skipped_events_name_the_field_that_failed() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.toml");
    std::fs::write(
        &rules,
        "[[counter]]\nid = 'spend'\ndimensions = ['user_id', 'card.id']\nwindow = '1h'\naggregate = 'sum'\nfield = 'amount'\n\n[[rule]]\nid = 'big'\naction = 'review'\nwhen = '$spend > 100'\n",
    )
    .unwrap();
    let lines = [
        r#"{"ts":1700000000000,"user_id":"u1","card":{"id":"c1"},"amount":5}"#,
        r#"{"ts":1700000001000,"card":{"id":"c1"},"amount":5}"#,
        r#"{"ts":1700000002000,"user_id":"u1","amount":5}"#,
        r#"{"ts":1700000003000,"user_id":"u1","card":{"id":null},"amount":5}"#,
        r#"{"ts":1700000004000,"user_id":"u1","card":{"id":"c1"},"amount":"5"}"#,
    ];
    let events = dir.path().join("events.jsonl");
    std::fs::write(&events, lines.join("\n")).unwrap();
    let run = |json: bool| {
        let mut args = vec![
            "backtest",
            "--rules",
            rules.to_str().unwrap(),
            "--input",
            events.to_str().unwrap(),
        ];
        if json {
            args.push("--json");
        }
        std::process::Command::new(env!("CARGO_BIN_EXE_vigil"))
            .args(args)
            .output()
            .unwrap()
    };
    let report: serde_json::Value = serde_json::from_slice(&run(true).stdout).unwrap();
    assert_eq!(
        report["counters"][0]["skipped_fields"],
        serde_json::json!({"missing_dimension": {"user_id": 1, "card.id": 2}, "non_numeric_sum_field": {"amount": 1}})
    );
    let table = String::from_utf8(run(false).stdout).unwrap();
    assert!(
        table.contains(
            "missing_dimension 3 (card.id 2, user_id 1), non_numeric_sum_field 1 (amount)"
        ),
        "{table}"
    );
}
