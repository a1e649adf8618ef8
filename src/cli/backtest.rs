//! `vigil backtest`: a replay with the in-process store plus the per-rule report, as a table or
//! `--json`, with progress on a terminal's stderr.

use std::io::{self, Write};
use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;

use vigil::pipeline;

use super::{load_rules, open_input, InputBounds};

/// Replay plus the per-rule report.
pub fn backtest(
    rules_path: &Path,
    input: &Path,
    json: bool,
    limits: InputBounds,
    max_bad_ratio: f64,
    label: vigil::event::FieldPath,
    sweeps: &[(String, Vec<vigil::decimal::Decimal>)],
) -> anyhow::Result<ExitCode> {
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
    let Some(reader) = open_input(input) else {
        return Ok(ExitCode::from(1));
    };
    let total = std::fs::metadata(input)
        .ok()
        .filter(|m| m.is_file())
        .map(|m| m.len());
    let started = Instant::now();
    let show_progress = io::stderr().is_terminal();
    let mut engine = limits.engine(rules, limits.store_setup().memory_store());
    let options = pipeline::backtest::BacktestOptions { label, sweeps };
    let report = pipeline::backtest::backtest(&mut engine, reader, options, |lines| {
        if show_progress {
            let rate = lines as f64 / started.elapsed().as_secs_f64().max(1e-9);
            match total {
                Some(bytes) => eprint!(
                    "\rbacktest: {lines} lines ({:.1} MiB input), {rate:.0} lines/s",
                    bytes as f64 / 1048576.0
                ),
                None => eprint!("\rbacktest: {lines} lines, {rate:.0} lines/s"),
            }
        }
    })
    .context("backtest failed")?;
    if show_progress {
        eprintln!();
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
