//! `vigil check PATH`: what each counter and rule of a rule set does, or every error in it.

use std::io::{self, Write};
use std::path::Path;
use std::process::ExitCode;

use vigil::rule_files;

use super::load_rules;

/// One line per counter and rule saying what it counts or judges, a warning per likely mistake
/// (on stderr), and exit 0; or every error and exit 1.
pub fn check(path: &Path) -> anyhow::Result<ExitCode> {
    let Some(rules) = load_rules(path) else { return Ok(ExitCode::from(1)) };
    let mut out = io::stdout().lock();
    for line in vigil::rules::describe::summaries(&rules) {
        writeln!(out, "ok {line}")?;
    }
    for warning in rules.warnings() {
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
        match rules.warnings().len() {
            0 => String::new(),
            n => format!(", {n} warning{}", if n == 1 { "" } else { "s" }),
        }
    )?;
    Ok(ExitCode::SUCCESS)
}
