//! The rule-language conformance scenarios (`tests/conformance/`): every scenario's decisions
//! must equal its `expected.jsonl` exactly, as `tests/conformance/run.sh` checks them.

use std::collections::BTreeMap;
use std::process::Command;

#[test]
fn every_conformance_scenario_gives_exactly_the_expected_decisions() {
    let out = Command::new("bash")
        .arg("tests/conformance/run.sh")
        .arg(env!("CARGO_BIN_EXE_vigil"))
        .output()
        .expect("bash runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let results: BTreeMap<&str, &str> = stdout.lines().filter_map(|l| l.split_once(": ")).collect();
    let scenarios = std::fs::read_dir("tests/conformance")
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().is_dir())
        .count();
    assert_eq!(
        results.len(),
        scenarios,
        "every scenario reports\n{stdout}\n{stderr}"
    );
    for (name, result) in &results {
        assert_eq!(*result, "ok", "{name}\n{stderr}");
    }
    assert!(
        stdout.contains(&format!("{scenarios} passed, 0 failed")),
        "{stdout}"
    );
}
