//! `vigil bench` as a user runs it (no Redis, no broker): the in-process report and comparison,
//! the generated input cleaned up, `--kafka` taking `--input` as its backlog, and the commands'
//! defaults shown as the configuration's.

use std::process::{Command, Output};

fn vigil(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vigil"))
        .args(args)
        .output()
        .expect("spawn vigil")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn in_process_bench_reports_and_compares_rule_sets_on_a_given_input() {
    let out = vigil(&[
        "bench",
        "--rules",
        "rules",
        "--input",
        "examples/events.jsonl",
        "--compare-rules",
        "examples/rules-v1",
        "--rounds",
        "1",
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        stdout.starts_with(
            "vigil bench (replay, in-process store, 1 thread)\n  input            181 events"
        ),
        "{stdout}"
    );
    for line in [
        "  decode only ",
        "  full pipeline ",
        "  live keys ",
        "  peak RSS ",
        "compare (1 rounds, alternating, same input)",
        "  ratio ",
    ] {
        assert!(stdout.contains(line), "{line:?} missing from:\n{stdout}");
    }
}

#[test]
fn a_generated_input_is_said_and_removed_afterwards() {
    let child = Command::new(env!("CARGO_BIN_EXE_vigil"))
        .args([
            "bench", "--rules", "rules", "--events", "500", "--users", "50",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let file = std::env::temp_dir().join(format!("vigil-bench-{}.jsonl", child.id()));
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).starts_with("bench: generated 500 events (50 users, zipf 0.8) in "),
        "{}",
        text(&out.stderr)
    );
    assert!(
        text(&out.stdout).contains("  input            500 events"),
        "{}",
        text(&out.stdout)
    );
    assert!(!file.exists(), "{} was left behind", file.display());
}

/// `--input` is the Kafka bench's backlog: a file that cannot be read stops it before any broker
/// is contacted (here there is none), instead of being silently ignored.
#[test]
fn kafka_bench_reads_its_input_and_says_when_it_cannot() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.jsonl");
    let out = vigil(&[
        "bench",
        "--rules",
        "rules",
        "--kafka",
        "127.0.0.1:1",
        "--input",
        missing.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    let expected = format!(
        "error: kafka benchmark: {}: cannot read input: ",
        missing.display()
    );
    assert!(stderr.starts_with(&expected), "{stderr}");
}

/// The defaults `replay`, `backtest`, `bench` and `gen` take from the configuration
/// (`src/config_defaults.toml`) and the workload generator show as they always did.
#[test]
fn command_defaults_show_as_the_configuration_writes_them() {
    let help = text(&vigil(&["replay", "--help"]).stdout);
    for default in [
        "[default: rules]",
        "[default: 1048576]",
        "[default: 5m]",
        "[default: 1h]",
        "[default: 4000000]",
        "[default: 1m]",
    ] {
        assert!(help.contains(default), "{default} missing from:\n{help}");
    }
    let help = text(&vigil(&["backtest", "--help"]).stdout);
    for default in [
        "[default: rules]",
        "[default: 5m]",
        "[default: 1h]",
        "[default: 4000000]",
    ] {
        assert!(help.contains(default), "{default} missing from:\n{help}");
    }
    let help = text(&vigil(&["gen", "--help"]).stdout);
    for default in [
        "[default: 1000000]",
        "[default: 100000]",
        "[default: 0.8]",
        "[default: 7]",
        "[default: 2000]",
        "[default: 50000]",
        "[default: 0.02]",
    ] {
        assert!(help.contains(default), "{default} missing from:\n{help}");
    }
    let help = text(&vigil(&["bench", "--help"]).stdout);
    assert!(
        help.contains("[default: rules]") && help.contains("[default: 1000000]"),
        "{help}"
    );
}
