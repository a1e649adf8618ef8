//! Every kind of configuration error has a fixture under `tests/fixtures/config/`: `vigil run`
//! must refuse it with exactly the message in its `.expected` file (where, which key, why), and
//! an environment override that is wrong names its variable instead.

use std::fs;
use std::path::Path;

use vigil::config::Config;

const FIXTURES: &str = "tests/fixtures/config";

/// The error kinds a config must be refused for; each needs its own fixture.
const REQUIRED: [&str; 15] = [
    "unknown_key",
    "bad_duration",
    "missing_brokers",
    "zero_flush_interval",
    "zero_timeout",
    "zero_commit_interval",
    "no_attempts",
    "no_keys",
    "zero_bound",
    "absurd_duration",
    "tiny_events",
    "lateness_within_future_skew",
    "unknown_time_source",
    "tiny_state",
    "bad_size",
];

fn refusal(path: &Path, env: &[(&str, &str)]) -> String {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
    match Config::parse(&path.display().to_string(), &text, env) {
        Ok(_) => panic!("{}: accepted", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn every_fixture_is_refused_with_its_expected_message() {
    let mut seen = Vec::new();
    for entry in fs::read_dir(FIXTURES).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let expected_path = path.with_extension("expected");
        let expected = fs::read_to_string(&expected_path)
            .unwrap_or_else(|e| panic!("{}: {e}", expected_path.display()));
        assert_eq!(
            refusal(&path, &[]),
            expected.trim_end(),
            "{}",
            path.display()
        );
        seen.push(path.file_stem().unwrap().to_string_lossy().into_owned());
    }
    for kind in REQUIRED {
        assert!(seen.iter().any(|s| s == kind), "no fixture for {kind}");
    }
}

#[test]
fn an_override_that_disarms_the_worker_names_its_variable() {
    let path = Path::new(FIXTURES).join("../../../deploy/config/vigil.toml");
    assert_eq!(
        refusal(&path, &[("VIGIL_REDIS_FLUSH_INTERVAL", "0ms")]),
        "VIGIL_REDIS_FLUSH_INTERVAL: `redis.flush_interval`: 0s is out of range: must be from 1ms to 1m"
    );
    assert_eq!(
        refusal(&path, &[("VIGIL_INPUT_MAX_LATENESS", "1m")]),
        "VIGIL_INPUT_MAX_LATENESS: `input.max_lateness`: 1m must be longer than input.max_future_skew \
         (5m): one event stamped that far ahead would make every event on time late"
    );
}

#[test]
fn the_shipped_config_passes_the_checks() {
    let path = "deploy/config/vigil.toml";
    let text = fs::read_to_string(path).unwrap();
    if let Err(e) = Config::parse(path, &text, std::iter::empty()) {
        panic!("{path}: {e}");
    }
}
