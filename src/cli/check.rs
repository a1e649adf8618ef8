//! `vigil check PATH`: what each counter and rule of a rule set does, or every error in it.

use std::io::{self, Write};
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use vigil::rule_files;

use super::load_rules;

/// One line per counter and rule saying what it counts or judges, a warning per likely mistake
/// (on stderr), and exit 0; or every error and exit 1.
pub fn check(path: &Path, max_partition_skew: Option<Duration>) -> anyhow::Result<ExitCode> {
    let Some(rules) = load_rules(path) else {
        return Ok(ExitCode::from(1));
    };
    let mut out = io::stdout().lock();
    for line in vigil::rules::describe::summaries(&rules) {
        writeln!(out, "ok {line}")?;
    }
    for warning in rules.warnings() {
        eprintln!("warning: {warning}");
    }
    let skew_warnings = short_windows(&rules, max_partition_skew);
    for warning in &skew_warnings {
        eprintln!("warning: {warning}");
    }
    let files = rule_files::rule_files(path).map(|f| f.len()).unwrap_or(1);
    let counters = rules.counters().iter().filter(|c| !c.from_rule).count();
    writeln!(
        out,
        "{} rules ({} enabled) and {counters} counter{} in {files} file{} OK (rules version {}){}",
        rules.rules().len(),
        rules.active().len(),
        if counters == 1 { "" } else { "s" },
        if files == 1 { "" } else { "s" },
        rules.version(),
        match rules.warnings().len() + skew_warnings.len() {
            0 => String::new(),
            n => format!(", {n} warning{}", if n == 1 { "" } else { "s" }),
        }
    )?;
    Ok(ExitCode::SUCCESS)
}

/// A warning per counter whose window is not longer than `max_partition_skew`: partitions of a
/// group may be that far apart in event time, so one partition's event can be late for a key
/// another partition moved on (see the worker's `input.max_partition_skew`).
fn short_windows(
    rules: &vigil::rules::RuleSet,
    max_partition_skew: Option<Duration>,
) -> Vec<String> {
    let Some(skew) = max_partition_skew else {
        return Vec::new();
    };
    let skew_ms = i64::try_from(skew.as_millis()).unwrap_or(i64::MAX);
    rules
        .counters()
        .iter()
        .filter(|counter| counter.window.window_ms() <= skew_ms)
        .map(|counter| {
            format!(
                "{}: counter `{}`: its window ({}) is not longer than max_partition_skew ({}): partitions up to that far \
                 apart in event time can make each other's events late for it; lengthen the window or lower \
                 input.max_partition_skew",
                counter.origin,
                counter.id,
                humantime::format_duration(Duration::from_millis(counter.window.window_ms().max(0) as u64)),
                humantime::format_duration(skew)
            )
        })
        .collect()
}
