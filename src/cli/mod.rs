//! Command wiring, one file per command: each turns its arguments into calls on the library and
//! its errors into messages and exit codes. With `main.rs`, the only users of `anyhow`. What the
//! commands share (loading rules, opening the input) is here.

mod backtest;
#[cfg(feature = "harness")]
mod bench;
mod check;
#[cfg(feature = "harness")]
mod gen;
mod replay;
mod run;

use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::path::Path;

use vigil::rule_files::{self, LoadError};
use vigil::rules::RuleSet;

pub use backtest::backtest;
#[cfg(feature = "harness")]
pub use bench::{bench, bench_kafka, BenchArgs};
pub use check::check;
#[cfg(feature = "harness")]
pub use gen::gen;
pub use replay::{replay, ReplayRedis};
pub use run::run;

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
            eprintln!("{n} error{} in rules at {}", if n == 1 { "" } else { "s" }, path.display());
            None
        }
        Err(other) => {
            eprintln!("error: {other}");
            None
        }
    }
}

/// The events to read: a file, or stdin for `-`. `None` (after saying why on stderr) means the
/// caller exits 1.
fn open_input(input: &Path) -> Option<Box<dyn BufRead>> {
    if input == Path::new("-") {
        return Some(Box::new(io::stdin().lock()));
    }
    match File::open(input) {
        Ok(f) => Some(Box::new(BufReader::with_capacity(1 << 16, f))),
        Err(e) => {
            eprintln!("error: {}: cannot open input: {e}", input.display());
            None
        }
    }
}
