//! `docs/howto.md` is runnable: every `$ ` line of its `console` blocks is run, in order, with
//! `vigil` on the PATH, against a scratch `redis-server` and Apache Kafka broker started here
//! (their addresses replace the page's `redis://127.0.0.1:6379` and `127.0.0.1:9092`, a temporary
//! directory replaces `/tmp/vigil-howto`), and must exit 0 and print every output line shown
//! below it (a line ending in `…` is a prefix).

mod support;

use std::path::Path;
use std::process::Command;

use support::kafka::Broker;
use support::RedisServer;

struct Step {
    command: String,
    expected: Vec<String>,
}

fn steps(page: &str) -> Vec<Step> {
    let mut steps: Vec<Step> = Vec::new();
    let mut in_console = false;
    for line in page.lines() {
        if line.starts_with("```") {
            in_console = line == "```console";
            continue;
        }
        if !in_console {
            continue;
        }
        match line.strip_prefix("$ ") {
            Some(command) => steps.push(Step {
                command: command.to_owned(),
                expected: Vec::new(),
            }),
            None => steps
                .last_mut()
                .expect("output before any command")
                .expected
                .push(line.to_owned()),
        }
    }
    steps
}

#[test]
fn every_command_of_the_how_to_page_runs_and_prints_what_the_page_shows() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let page = std::fs::read_to_string(root.join("docs/howto.md")).unwrap();
    let steps = steps(&page);
    assert!(steps.len() >= 15, "{} commands found", steps.len());
    let scratch = tempfile::tempdir().unwrap();
    let redis = RedisServer::start();
    let broker = Broker::shared();
    let topics = broker.topics("howto", 1);
    let bin = Path::new(env!("CARGO_BIN_EXE_vigil")).parent().unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let local = |text: &str| {
        text.replace("redis://127.0.0.1:6379", &redis.url())
            .replace("/tmp/vigil-howto", &scratch.path().display().to_string())
    };
    for step in &steps {
        let mut command = local(&step.command);
        if command.contains("--brokers 127.0.0.1:9092") {
            command = command.replace(
                "--brokers 127.0.0.1:9092",
                &format!(
                    "--brokers {} --topic {}",
                    broker.bootstrap(),
                    topics.decisions
                ),
            );
        }
        let out = Command::new("sh")
            .args(["-c", &command])
            .current_dir(root)
            .env("PATH", &path)
            .output()
            .unwrap();
        let printed = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success(),
            "`{}` exited {:?}:\n{printed}",
            step.command,
            out.status.code()
        );
        for expected in &step.expected {
            let expected = local(expected);
            let found = match expected.strip_suffix('…') {
                Some(prefix) => printed.lines().any(|l| l.starts_with(prefix)),
                None => printed.lines().any(|l| l == expected),
            };
            assert!(
                found,
                "`{}` did not print\n{expected}\nit printed:\n{printed}",
                step.command
            );
        }
    }
    // The release's audit record reached the decisions topic.
    let records = broker.read(
        &topics.decisions,
        1,
        |r| !r.is_empty(),
        std::time::Duration::from_millis(200),
        std::time::Duration::from_secs(60),
    );
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].json()["kind"], "hold_release");
}
