//! `vigil check PATH`: what each counter and rule of a rule set does, or every error in it.

use std::io::{self, Write};
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use vigil::rule_files;

use super::load_rules;

/// One line per counter and rule saying what it counts or judges, a warning per likely mistake
/// (on stderr), and exit 0; or every error and exit 1.
pub fn check(
    path: &Path,
    max_partition_skew: Option<Duration>,
    max_future_skew: Option<Duration>,
) -> anyhow::Result<ExitCode> {
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
    let mut skew_warnings = short_windows(&rules, max_future_skew, FUTURE_SKEW);
    skew_warnings.extend(short_windows(&rules, max_partition_skew, PARTITION_SKEW));
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

/// A bound on event time that a counter's window should be longer than: its setting, and what
/// goes wrong when the window is not.
struct SkewBound {
    setting: &'static str,
    risk: &'static str,
}

const FUTURE_SKEW: SkewBound = SkewBound {
    setting: "max_future_skew",
    risk: "one event stamped up to that far ahead moves the key's window past every real event of it, \
           which are then late: take event time from a clock you trust (input.time), or lengthen the window \
           or lower input.max_future_skew",
};

const PARTITION_SKEW: SkewBound = SkewBound {
    setting: "max_partition_skew",
    risk:
        "partitions up to that far apart in event time can make each other's events late for it; \
           lengthen the window or lower input.max_partition_skew",
};

/// A warning per counter whose window is not longer than `bound` (see [`SkewBound`]).
fn short_windows(
    rules: &vigil::rules::RuleSet,
    skew: Option<Duration>,
    bound: SkewBound,
) -> Vec<String> {
    let Some(skew) = skew else {
        return Vec::new();
    };
    let skew_ms = i64::try_from(skew.as_millis()).unwrap_or(i64::MAX);
    rules
        .counters()
        .iter()
        .filter(|counter| counter.window.window_ms() <= skew_ms)
        .map(|counter| {
            format!(
                "{}: counter `{}`: its window ({}) is not longer than {} ({}): {}",
                counter.origin,
                counter.id,
                humantime::format_duration(Duration::from_millis(
                    counter.window.window_ms().max(0) as u64
                )),
                bound.setting,
                humantime::format_duration(skew),
                bound.risk,
            )
        })
        .collect()
}
