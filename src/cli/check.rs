//! `vigil check PATH`: what each counter and rule of a rule set does, or every error in it.

use std::io::{self, Write};
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use vigil::rule_files;

use super::load_rules;

/// One line per counter and rule saying what it counts or judges, a warning per likely mistake
/// (on stderr), and exit 0; or every error and exit 1.
pub fn check(
    path: &Path,
    max_partition_skew: Option<Duration>,
    max_future_skew: Option<Duration>,
    events: Option<&Path>,
    strict: bool,
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
    if let Some(sample) = events {
        match sample_warnings(&rules, sample)? {
            Some(warnings) => skew_warnings.extend(warnings),
            None => return Ok(ExitCode::from(1)),
        }
    }
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
    if strict && rules.warnings().len() + skew_warnings.len() > 0 {
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

/// What a sample of events says about the rules: the lint of `rules::lint`, then a backtest of
/// the sample naming the rules that never fire and the counters that count nothing. `None` (said
/// on stderr) when the sample cannot be read.
fn sample_warnings(
    rules: &vigil::rules::RuleSet,
    path: &Path,
) -> anyhow::Result<Option<Vec<String>>> {
    use vigil::pipeline::{read_line_bounded, LineRead, DEFAULT_MAX_EVENT_BYTES};
    // Read twice (the lint, then a backtest): a pipe or stdin would be empty the second time.
    let not_a_file = path.as_os_str() == "-" || std::fs::metadata(path).is_ok_and(|m| !m.is_file());
    if not_a_file {
        eprintln!(
            "--events {}: needs a regular file of JSON lines (it is read twice)",
            path.display()
        );
        return Ok(None);
    }
    let Some(mut reader) = super::open_input(path) else {
        return Ok(None);
    };
    let mut sample = vigil::rules::lint::Sample::new("ts");
    let mut line = Vec::new();
    loop {
        line.clear();
        match read_line_bounded(&mut reader, &mut line, DEFAULT_MAX_EVENT_BYTES)
            .with_context(|| format!("reading {}", path.display()))?
        {
            LineRead::End => break,
            LineRead::Line => {
                sample.add_line(line.trim_ascii());
            }
            LineRead::TooLarge(_) => {}
        }
    }
    if sample.events == 0 {
        eprintln!(
            "{}: no event in the sample (one JSON object per line)",
            path.display()
        );
        return Ok(None);
    }
    let mut warnings = vigil::rules::lint::lint(rules, &sample);
    // A historical sample is fine: no bound against the wall clock.
    let limits = super::InputBounds {
        bounds: vigil::event::TimeBounds {
            max_future_skew_ms: None,
            ..vigil::event::TimeBounds::default()
        },
        ..super::InputBounds::default()
    };
    let mut engine = limits.engine(rules.clone(), limits.store_setup().memory_store());
    let Some(reader) = super::open_input(path) else {
        return Ok(None);
    };
    let options = vigil::pipeline::backtest::BacktestOptions::default();
    let report = vigil::pipeline::backtest::backtest(&mut engine, reader, options, |_| {})
        .context("backtest of the sample failed")?;
    for warning in vigil::pipeline::backtest::watermark_warnings(&report) {
        warnings.push(warning);
    }
    for rule in &report.rules {
        if rule.hits == 0 {
            let origin = rules
                .rules()
                .iter()
                .find(|r| r.id == rule.rule_id)
                .map(|r| format!("{}: ", r.origin))
                .unwrap_or_default();
            warnings.push(format!(
                "{origin}rule {} never fires on the {} sample events ({} in its scope)",
                rule.rule_id, report.events, rule.matched
            ));
        }
    }
    for index in rules.active_counters() {
        let counter = rules.counter(index);
        let counts = report.counters.iter().find(|c| c.counter_id == counter.id);
        if counts.is_some_and(|c| c.counted > 0) {
            continue;
        }
        let why = match counts {
            Some(c) if !c.skipped.is_empty() || c.late > 0 => {
                let mut reasons: Vec<String> = c
                    .skipped
                    .iter()
                    .map(|(reason, n)| format!("{n} {reason}"))
                    .collect();
                if c.late > 0 {
                    reasons.push(format!("{} late", c.late));
                }
                format!(
                    "every event in its scope was skipped ({})",
                    reasons.join(", ")
                )
            }
            _ => "no sample event is in its scope".to_owned(),
        };
        warnings.push(format!(
            "{}: counter {} counts nothing on the {} sample events: {why}",
            counter.origin, counter.id, report.events
        ));
    }
    Ok(Some(warnings))
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
