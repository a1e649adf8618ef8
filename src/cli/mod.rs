//! Command wiring, one file per command: each turns its arguments into calls on the library and
//! its errors into messages and exit codes. With `main.rs`, the only users of `anyhow`. What the
//! commands share (loading rules, opening the input) is here.

mod backtest;
#[cfg(feature = "harness")]
mod bench;
mod check;
#[cfg(feature = "harness")]
mod gen;
mod inspect;
mod replay;
mod run;

use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::path::Path;
use std::process::ExitCode;

use vigil::rule_files::{self, LoadError};
use vigil::rules::RuleSet;

pub use backtest::backtest;
pub use backtest::Tuning;
#[cfg(feature = "harness")]
pub use bench::{bench, bench_kafka, BenchArgs};
pub use check::check;
#[cfg(feature = "harness")]
pub use gen::gen;
pub use inspect::{hold_release, inspect, parse_at, InspectFrom};
pub use replay::{replay, ReplayRedis};
pub use run::run;

/// How `replay` and `backtest` treat event time and bound their state.
pub struct InputBounds {
    pub bounds: vigil::event::TimeBounds,
    /// Where event time comes from (`--time`).
    pub time: vigil::event::TimeSource,
    /// `--max-keys`.
    pub max_keys: usize,
    /// `--max-state-bytes`.
    pub max_state_bytes: usize,
}

/// The defaults a config file would give: the input section's time bounds, `ts` as event time,
/// the memory section's bounds.
impl Default for InputBounds {
    fn default() -> Self {
        let memory = vigil::config::MemoryConfig::default();
        InputBounds {
            bounds: vigil::event::TimeBounds::default(),
            time: vigil::event::TimeSource::default(),
            max_keys: memory.max_keys,
            max_state_bytes: memory.max_state_bytes,
        }
    }
}

impl InputBounds {
    /// Where to count: in process within these bounds (`redis.url` unset), keys kept in Redis
    /// for the lateness bound.
    fn store_setup(&self) -> vigil::config::StoreSetup {
        vigil::config::StoreSetup {
            max_keys: self.max_keys,
            max_state_bytes: self.max_state_bytes,
            max_lateness_ms: self.bounds.max_lateness_ms,
            ..vigil::config::StoreSetup::default()
        }
    }

    /// An engine over `store` taking event time as told, bounded by the wall clock.
    fn engine<S: vigil::store::CounterStore>(
        &self,
        rules: RuleSet,
        store: S,
    ) -> vigil::pipeline::Engine<S> {
        vigil::pipeline::Engine::new(rules, store)
            .with_time(self.bounds, std::sync::Arc::new(vigil::clock::SystemClock))
            .with_time_source(self.time.clone())
    }
}

/// Loads rules, printing every error to stderr; `None` means the caller exits 1.
fn load_rules(path: &Path) -> Option<RuleSet> {
    load_rules_with(path, false)
}

/// [`load_rules`], accepting a set without rules when `allow_empty`.
fn load_rules_with(path: &Path, allow_empty: bool) -> Option<RuleSet> {
    match rule_files::load_with(path, allow_empty) {
        Ok(rules) => Some(rules),
        Err(LoadError::Invalid(errors)) => {
            for d in &errors.0 {
                eprintln!("{d}");
            }
            let n = errors.0.len();
            eprintln!(
                "{n} error{} in rules at {}",
                if n == 1 { "" } else { "s" },
                path.display()
            );
            None
        }
        Err(other) => {
            eprintln!("error: {other}");
            None
        }
    }
}

/// Whether an input was usable: `events` decoded and `bad` refused among its non-blank lines.
/// Exit 1 (after saying why on stderr) when lines were given and none decoded, or when more than
/// `max_bad_ratio` of them were bad; `None`: fine.
fn refuse_bad_input(command: &str, events: u64, bad: u64, max_bad_ratio: f64) -> Option<ExitCode> {
    let lines = events + bad;
    if lines == 0 {
        return None;
    }
    let ratio = bad as f64 / lines as f64;
    if events == 0 {
        eprintln!(
            "{command}: no input line could be decoded ({bad} bad lines; the reasons are above)"
        );
    } else if ratio > max_bad_ratio {
        eprintln!(
            "{command}: {bad} of {lines} lines were bad ({:.1} %), more than --max-bad-ratio {max_bad_ratio}",
            ratio * 100.0
        );
    } else {
        return None;
    }
    Some(ExitCode::from(1))
}

/// A share of bad lines, 0 to 1 (`--max-bad-ratio`).
pub fn parse_ratio(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(ratio) if (0.0..=1.0).contains(&ratio) => Ok(ratio),
        _ => Err(format!(
            "{text:?} is not a share between 0 and 1 (e.g. 0.01)"
        )),
    }
}

/// The events to read: a file, or stdin for `-`. `None` (after saying why on stderr) means the
/// caller exits 1.
fn open_input(input: &Path) -> Option<Box<dyn BufRead>> {
    if input == Path::new("-") {
        return Some(Box::new(io::stdin().lock()));
    }
    // A directory opens on Linux and fails only on the first read, far from its name.
    if input.is_dir() {
        eprintln!("error: {}: cannot open input: it is a directory (give a JSON-lines file, or - for stdin)", input.display());
        return None;
    }
    match File::open(input) {
        Ok(f) => Some(Box::new(BufReader::with_capacity(1 << 16, f))),
        Err(e) => {
            eprintln!("error: {}: cannot open input: {e}", input.display());
            None
        }
    }
}
