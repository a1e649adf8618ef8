//! Every kind of rule-validation error has a fixture under `tests/fixtures/rules/invalid/`, and
//! `vigil check` must report exactly the messages in its `.expected` file (`file:line:col: message`,
//! every error at once) and exit 1.

use std::fs;
use std::path::Path;
use std::process::Command;

use vigil::rule_files::{self, LoadError};

const FIXTURES: &str = "tests/fixtures/rules/invalid";

/// The error kinds the rule language must refuse; each needs its own fixture.
const REQUIRED: [&str; 50] = [
    "v3_priority_final_score",
    "v3_rollout",
    "v3_expressions",
    "v3_aggregates",
    "v3_maps",
    "key_typo",
    "expr_too_deep",
    "integer_past_64_bits",
    "all_at_once",
    "unknown_key",
    "duplicate_id",
    "bad_id",
    "bad_duration",
    "zero_duration",
    "bucket_not_dividing",
    "too_many_buckets",
    "no_default_bucket",
    "missing_field",
    "forbidden_field",
    "bad_action",
    "bad_mode",
    "bad_aggregate",
    "empty_dimensions",
    "too_many_dimensions",
    "negative_limit",
    "toml_syntax",
    "missing_required",
    "wrong_types",
    "bad_match",
    "bad_field_path",
    "duplicate_dimension",
    "unknown_top_level",
    "rule_not_array",
    "several_errors",
    "not_utf8",
    "expr_syntax",
    "expr_chained_comparison",
    "expr_unknown_counter",
    "expr_counter_in_match",
    "expr_unknown_list",
    "expr_unknown_function",
    "expr_bad_regex",
    "expr_bad_cidr",
    "expr_bad_escape",
    "limit_without_window",
    "when_with_window",
    "counter_errors",
    "hold",
    "empty_match",
    "distinct_limit_unreachable",
];

fn expected(path: &str) -> Vec<String> {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.lines().map(str::to_owned).collect()
}

fn library_messages(path: &str) -> Vec<String> {
    match rule_files::load(Path::new(path)) {
        Err(LoadError::Invalid(errors)) => errors.0.iter().map(ToString::to_string).collect(),
        Err(other) => panic!("{path}: expected rule errors, got {other}"),
        Ok(_) => panic!("{path}: expected rule errors, but the rules loaded"),
    }
}

#[test]
fn every_required_error_kind_has_a_fixture() {
    for name in REQUIRED {
        for ext in ["toml", "expected"] {
            let path = format!("{FIXTURES}/{name}.{ext}");
            assert!(Path::new(&path).is_file(), "missing fixture {path}");
        }
    }
}

#[test]
fn each_fixture_reports_exactly_its_expected_messages() {
    let mut checked = 0;
    for entry in fs::read_dir(FIXTURES).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let toml = path.to_str().unwrap().to_owned();
            let want = expected(&toml.replace(".toml", ".expected"));
            assert!(!want.is_empty(), "{toml}: empty .expected");
            assert_eq!(library_messages(&toml), want, "{toml}");
            checked += 1;
        }
    }
    assert!(checked >= REQUIRED.len());
}

#[test]
fn list_errors_point_into_rule_files_and_list_files() {
    let dir = "tests/fixtures/rules/list_errors";
    assert_eq!(library_messages(dir), expected(&format!("{dir}.expected")));
}

#[test]
fn duplicate_ids_are_found_across_files() {
    let dir = "tests/fixtures/rules/duplicate_across_files";
    assert_eq!(library_messages(dir), expected(&format!("{dir}.expected")));
}

fn vigil(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_vigil"))
        .args(args)
        .output()
        .expect("run vigil")
}

#[test]
fn check_prints_every_error_and_exits_1() {
    for name in ["several_errors", "wrong_types", "toml_syntax"] {
        let toml = format!("{FIXTURES}/{name}.toml");
        let out = vigil(&["check", &toml]);
        assert_eq!(out.status.code(), Some(1), "{name}");
        let stderr = String::from_utf8(out.stderr).unwrap();
        let lines: Vec<&str> = stderr.lines().collect();
        let want = expected(&format!("{FIXTURES}/{name}.expected"));
        assert_eq!(&lines[..want.len()], want.as_slice(), "{name}");
        let n = want.len();
        let summary = format!(
            "{n} error{} in rules at {toml}",
            if n == 1 { "" } else { "s" }
        );
        assert_eq!(lines[want.len()..], [summary.as_str()], "{name}");
        assert!(
            out.stdout.is_empty(),
            "{name}: nothing on stdout when rules are refused"
        );
    }
}

#[test]
fn check_lists_each_valid_rule_and_exits_0() {
    let out = vigil(&["check", "rules"]);
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 33, "{stdout}");
    assert_eq!(
        lines[0],
        "ok counter login-fails-user-10m: count of events per user_id over 10m (bucket 10s) where type == 'login' && result in ['fail', 'locked']  [rules/login.toml:9:1]"
    );
    assert_eq!(
        lines[1],
        "ok rule login-brute-force: block/enforce judges events where type == 'login'; fires when $login-fails-user-10m > 5; then holds user_id for 30m  [rules/login.toml:21:1]"
    );
    assert!(
        lines.iter().any(|l| l.starts_with(
            "ok rule login-users-ip-shadow: review/shadow judges events where type is \"login\""
        )),
        "{stdout}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("sum of amount per user_id+geo.country over 1d (bucket 1h)")),
        "{stdout}"
    );
    assert!(
        lines[32]
            .starts_with("20 rules (20 enabled) and 12 counters in 3 files OK (rules version "),
        "{}",
        lines[32]
    );
}

#[test]
fn check_refuses_missing_path_and_empty_directory() {
    let out = vigil(&["check", "tests/fixtures/does-not-exist"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("tests/fixtures/does-not-exist: cannot read")
    );

    let empty = tempfile::tempdir().unwrap();
    let out = vigil(&["check", empty.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no rule files (*.toml) found"));
}

/// What is in a rules directory is what is loaded: a link that does not resolve, a link loop or
/// a directory named `*.toml` is an error naming it, never a file silently left out.
#[test]
fn unreadable_entries_in_a_rules_directory_are_errors_with_their_path() {
    let rule = "[[rule]]\nid = 'r'\naction = 'alert'\n";
    for name in ["dangling.toml", "loop.toml", "folder.toml"] {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("a.toml"), rule).unwrap();
        let path = dir.path().join(name);
        match name {
            "dangling.toml" => {
                std::os::unix::fs::symlink(dir.path().join("nowhere.toml"), &path).unwrap()
            }
            "loop.toml" => std::os::unix::fs::symlink(&path, &path).unwrap(),
            _ => fs::create_dir(&path).unwrap(),
        }
        let out = vigil(&["check", dir.path().to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(1), "{name}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(&path.display().to_string()),
            "{name}: {stderr}"
        );
    }
}

/// An emptied rule file is refused (it would disarm every rule); a leading UTF-8 byte order
/// mark is accepted, and positions after it are counted as an editor shows them.
#[test]
fn empty_rule_sets_are_refused_and_a_byte_order_mark_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("a.toml"), "# nothing here yet\n").unwrap();
    let out = vigil(&["check", dir.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no rules defined"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(matches!(
        rule_files::load(dir.path()),
        Err(LoadError::Empty { .. })
    ));
    assert!(
        rule_files::load_with(dir.path(), true).is_ok(),
        "rules.allow_empty = true accepts it"
    );

    fs::write(
        dir.path().join("a.toml"),
        "\u{feff}[[rule]]\nid = 'r'\naction = 'alert'\n",
    )
    .unwrap();
    let out = vigil(&["check", dir.path().to_str().unwrap()]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    fs::write(
        dir.path().join("a.toml"),
        "\u{feff}[[rule]]\nid = 'R'\naction = 'alert'\n",
    )
    .unwrap();
    let out = vigil(&["check", dir.path().to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("a.toml:2:6: "), "{stderr}");
}

/// A rule file full of 100 000-character values (ids, keys, actions, durations, paths, function,
/// counter and list names, numbers): every error is reported, each quoting a bounded prefix.
#[test]
fn diagnostics_quote_a_bounded_prefix_of_long_values() {
    let long = "x".repeat(100_000);
    let text = format!(
        "[[rule]]\nid = \"{long}\"\naction = \"{long}\"\nmode = \"{long}\"\non_store_error = \"{long}\"\nmatch = \"{long}(a)\"\n\
         when = \"${long} > 1 && @{long} == 1\"\n\n\
         [[rule]]\nid = \"r2\"\naction = \"block\"\nwhen = \"a == 1{long}\"\n\n\
         [[rule]]\nid = \"r3\"\naction = \"block\"\nwhen = \"a in @{long}\"\n\n\
         [[counter]]\nid = \"c1\"\ndimensions = [\"{long}..x\"]\nwindow = \"{long}\"\naggregate = \"{long}\"\n{long} = 1\n\n\
         [[list]]\nid = \"l2\"\nkind = \"{long}\"\nvalues = []\n"
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("long.toml");
    fs::write(&path, text).unwrap();
    let messages = library_messages(path.to_str().unwrap());
    assert!(messages.len() >= 12, "{messages:#?}");
    for message in &messages {
        assert!(
            message.len() < 400,
            "{} bytes: {}",
            message.len(),
            &message[..300]
        );
    }
    assert!(
        messages
            .iter()
            .any(|m| m.contains("invalid action \"xxxx") && m.contains("… (100000 bytes)")),
        "{messages:#?}"
    );
}

/// Writes `text` as `name` in a fresh directory and runs `vigil check` on it, which must accept
/// it: the directory (kept alive), the file's path, and what check wrote to stdout and stderr.
fn check_accepts(name: &str, text: &str) -> (tempfile::TempDir, String, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join(name);
    fs::write(&file, text).unwrap();
    let path = file.to_str().unwrap().to_owned();
    let out = vigil(&["check", &path]);
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    (dir, path, String::from_utf8(out.stdout).unwrap(), stderr)
}

/// A counter whose window is not longer than `max_future_skew` can be blinded by one event
/// stamped ahead, and one not longer than `max_partition_skew` by partitions apart in event
/// time: `check` warns about each, naming the setting, and stays silent with the bound off.
#[test]
fn check_warns_about_windows_a_time_bound_can_blind() {
    let (_dir, path, stdout, stderr) = check_accepts(
        "short.toml",
        "[[counter]]\nid = 'c-1m'\ndimensions = ['ip']\nwindow = '1m'\n\
         [[counter]]\nid = 'c-5s'\ndimensions = ['ip']\nwindow = '5s'\nbucket = '1s'\n\
         [[counter]]\nid = 'c-1h'\ndimensions = ['ip']\nwindow = '1h'\n\
         [[rule]]\nid = 'r'\naction = 'alert'\nwhen = '$c-1m + $c-5s + $c-1h > 9'\n",
    );
    let future = |id: &str, window: &str, line: u32| {
        format!(
            "warning: {path}:{line}:1: counter `{id}`: its window ({window}) is not longer than max_future_skew (5m): \
             one event stamped up to that far ahead moves the key's window past every real event of it, which are \
             then late: take event time from a clock you trust (input.time), or lengthen the window or lower \
             input.max_future_skew"
        )
    };
    let partition = format!(
        "warning: {path}:5:1: counter `c-5s`: its window (5s) is not longer than max_partition_skew (5s): \
         partitions up to that far apart in event time can make each other's events late for it; lengthen the \
         window or lower input.max_partition_skew"
    );
    assert_eq!(
        stderr.lines().collect::<Vec<_>>(),
        vec![
            future("c-1m", "1m", 1).as_str(),
            &future("c-5s", "5s", 5),
            &partition
        ],
    );
    assert!(stdout.ends_with(", 3 warnings\n"));

    let out = vigil(&[
        "check",
        &path,
        "--max-future-skew",
        "off",
        "--max-partition-skew",
        "off",
    ]);
    assert_eq!(
        (out.status.code(), out.stderr.as_slice()),
        (Some(0), &b""[..])
    );
}

/// `check --events` lints the rules against a sample of real events, each silent mistake named
/// with where it is and what the events carry instead; `--strict` turns the warnings into exit 1.
#[test]
fn check_events_names_the_mistakes_a_sample_reveals() {
    let rules = "tests/fixtures/check_events/rules.toml";
    let sample = "tests/fixtures/check_events/sample.jsonl";
    let out = vigil(&[
        "check",
        rules,
        "--events",
        sample,
        "--max-future-skew",
        "off",
    ]);
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let expected = [
        format!("warning: {rules}:7:1: field \"cardd.id\" (counter pay-mcc) never occurs in the 100 sample events; did you mean \"card.id\"?"),
        format!("warning: {rules}:18:1: field \"geo.country\" (rule charity) never occurs in the 100 sample events: \"geo\" is never an object there"),
        format!("warning: {rules}:7:1: counter pay-mcc compares \"mcc\" with 8398 (a number), but the sample's \"mcc\" is a string (e.g. \"8398\"): it can never be equal"),
        "warning: \"ts\" looks like epoch seconds (median 1700000025): vigil reads it as milliseconds, so these events are in January 1970 — multiply by 1000 or send an RFC 3339 string".to_owned(),
        format!("warning: {rules}:18:1: rule charity never fires on the 100 sample events (100 in its scope)"),
        format!("warning: {rules}:7:1: counter pay-mcc counts nothing on the 100 sample events: no sample event is in its scope"),
    ];
    assert_eq!(stderr.lines().collect::<Vec<_>>(), expected);
    assert!(String::from_utf8(out.stdout)
        .unwrap()
        .ends_with(", 6 warnings\n"));
    let strict = vigil(&[
        "check",
        rules,
        "--events",
        sample,
        "--max-future-skew",
        "off",
        "--strict",
    ]);
    assert_eq!(strict.status.code(), Some(1));
    // A sample the rules fit: no warning.
    let dir = tempfile::tempdir().unwrap();
    let fits = dir.path().join("fits.jsonl");
    let lines: Vec<String> = (0..4)
        .map(|i| {
            format!(
                r#"{{"ts":{},"type":"login","result":"fail","user_id":"u1"}}"#,
                1_700_000_000_000i64 + i
            )
        })
        .collect();
    fs::write(&fits, lines.join("\n")).unwrap();
    let brute = dir.path().join("brute.toml");
    fs::write(
        &brute,
        "[[counter]]\nid = 'fails-user'\nmatch = { type = 'login', result = 'fail' }\ndimensions = ['user_id']\nwindow = '15m'\n\
         [[rule]]\nid = 'brute'\naction = 'block'\nwhen = '$fails-user > 2'\n",
    )
    .unwrap();
    let out = vigil(&[
        "check",
        brute.to_str().unwrap(),
        "--events",
        fits.to_str().unwrap(),
        "--strict",
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8(out.stderr).unwrap(), "");
}

/// A rule that needs more distinct values than its counter records (`max_distinct`) can never
/// fire: `check` says so, naming both, for a comparison its `when` cannot be true without (a v1
/// limit that high is an error); a comparison in one branch of an `||` is not such a need.
/// A `final` enforce-mode rule with no `when` and no rollout fires on every event of its scope,
/// so every rule of lower priority with the same scope never fires; check names the
/// highest-priority such rule. Other scopes, higher priorities, shadow and `when`-guarded final
/// rules silence nothing.
#[test]
fn check_warns_about_a_rule_a_final_rule_always_suppresses() {
    let (_dir, path, _, stderr) = check_accepts(
        "final.toml",
        "[[rule]]\nid = 'stop-all'\naction = 'block'\npriority = 10\nfinal = true\n\n\
         [[rule]]\nid = 'stop-more'\naction = 'block'\npriority = 20\nfinal = true\n\n\
         [[rule]]\nid = 'low'\naction = 'review'\n\n\
         [[rule]]\nid = 'above'\naction = 'alert'\npriority = 30\n\n\
         [[rule]]\nid = 'logins'\naction = 'alert'\nmatch = { type = 'login' }\npriority = 30\nfinal = true\n\n\
         [[rule]]\nid = 'login-low'\naction = 'review'\nmatch = { type = 'login' }\n\n\
         [[rule]]\nid = 'payment-low'\naction = 'review'\nmatch = { type = 'payment' }\n\n\
         [[rule]]\nid = 'guarded'\naction = 'block'\nmatch = \"type == 'card'\"\npriority = 40\nfinal = true\nwhen = 'amount > 5'\n\n\
         [[rule]]\nid = 'watching'\naction = 'block'\nmatch = \"type == 'card'\"\npriority = 40\nfinal = true\nmode = 'shadow'\n\n\
         [[rule]]\nid = 'card-low'\naction = 'review'\nmatch = \"type == 'card'\"\n",
    );
    assert_eq!(
        stderr.lines().filter(|l| l.starts_with("warning:")).collect::<Vec<_>>(),
        vec![
            format!("warning: {path}:1:1: rule \"stop-all\" never fires: the final rule \"stop-more\" (priority 20 > 10) fires on every event it judges and suppresses it"),
            format!("warning: {path}:13:1: rule \"low\" never fires: the final rule \"stop-more\" (priority 20 > 0) fires on every event it judges and suppresses it"),
            format!("warning: {path}:29:1: rule \"login-low\" never fires: the final rule \"logins\" (priority 30 > 0) fires on every event it judges and suppresses it"),
        ]
    );
}

#[test]
fn check_warns_about_a_rule_beyond_its_counters_max_distinct() {
    let (_dir, path, _, stderr) = check_accepts(
        "distinct.toml",
        "[[counter]]\nid = 'ips'\naggregate = 'distinct'\nfield = 'ip'\ndimensions = ['user_id']\nwindow = '1h'\nmax_distinct = 10\n\
         [[rule]]\nid = 'more'\naction = 'block'\nwhen = '$ips > 10'\n\
         [[rule]]\nid = 'exactly'\naction = 'alert'\nwhen = \"type == 'login' && $ips == 11\"\n\
         [[rule]]\nid = 'reachable'\naction = 'alert'\nwhen = '$ips >= 10 || $ips > 99'\n",
    );
    assert_eq!(
        stderr.lines().collect::<Vec<_>>(),
        vec![
            format!("warning: {path}:8:1: rule \"more\": its `when` can never be true: it needs more than 10 distinct values in counter \"ips\", which records at most 10 (raise its max_distinct)"),
            format!("warning: {path}:12:1: rule \"exactly\": its `when` can never be true: it needs exactly 11 distinct values in counter \"ips\", which records at most 10 (raise its max_distinct)"),
        ]
    );
}
