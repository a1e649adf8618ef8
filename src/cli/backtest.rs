//! `vigil backtest`: a replay with the in-process store plus the per-rule report, as a table or
//! `--json`, with progress on a terminal's stderr.

use std::io::{self, Write};
use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;

use vigil::pipeline;

use super::{load_rules, open_input, InputBounds};

/// What `backtest` measures beyond hits (`--label`, `--sweep`, `--compare`).
pub struct Tuning<'a> {
    pub label: vigil::event::FieldPath,
    pub sweeps: &'a [(String, Vec<vigil::decimal::Decimal>)],
    pub compare: Option<&'a Path>,
}

/// Replay plus the per-rule report.
pub fn backtest(
    rules_path: &Path,
    input: &Path,
    json: bool,
    limits: InputBounds,
    max_bad_ratio: f64,
    tuning: Tuning<'_>,
) -> anyhow::Result<ExitCode> {
    let Tuning {
        label,
        sweeps,
        compare,
    } = tuning;
    use std::io::IsTerminal;
    let Some(rules) = load_rules(rules_path) else {
        return Ok(ExitCode::from(1));
    };
    let sweeps = match pipeline::backtest::plan_sweeps(&rules, sweeps) {
        Ok(sweeps) => sweeps,
        Err(message) => {
            eprintln!("{message}");
            return Ok(ExitCode::from(1));
        }
    };
    let compare = match compare {
        Some(path) => match load_rules(path) {
            Some(other) => Some(limits.engine(other, limits.store_setup().memory_store())),
            None => return Ok(ExitCode::from(1)),
        },
        None => None,
    };
    let Some(reader) = open_input(input) else {
        return Ok(ExitCode::from(1));
    };
    // A progress bar on a terminal's stderr only: bytes of a file read so far, or lines of stdin.
    let bar = io::stderr().is_terminal().then(|| {
        let size = std::fs::metadata(input)
            .ok()
            .filter(|m| m.is_file())
            .map(|m| m.len());
        match size {
            Some(bytes) => indicatif::ProgressBar::new(bytes).with_style(
                indicatif::ProgressStyle::with_template(
                    "backtest {bar:30} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            ),
            None => indicatif::ProgressBar::new_spinner().with_style(
                indicatif::ProgressStyle::with_template("backtest {spinner} {pos} lines {per_sec}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
            ),
        }
    });
    let by_bytes = bar.as_ref().is_some_and(|b| b.length().is_some());
    let reader: Box<dyn io::BufRead> = match (&bar, by_bytes) {
        (Some(bar), true) => Box::new(io::BufReader::new(bar.wrap_read(reader))),
        _ => reader,
    };
    let mut engine = limits.engine(rules, limits.store_setup().memory_store());
    let options = pipeline::backtest::BacktestOptions {
        label,
        sweeps,
        compare,
    };
    let report = pipeline::backtest::backtest(&mut engine, reader, options, |lines| {
        if let (Some(bar), false) = (&bar, by_bytes) {
            bar.set_position(lines);
        }
    })
    .context("backtest failed")?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    if json {
        for warning in pipeline::backtest::watermark_warnings(&report) {
            eprintln!("warning: {warning}");
        }
    }
    let mut out = io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
    } else {
        pipeline::backtest::write_table(&report, &mut out)?;
    }
    Ok(
        super::refuse_bad_input("backtest", report.events, report.bad_lines, max_bad_ratio)
            .unwrap_or(ExitCode::SUCCESS),
    )
}
