//! `vigil bench` in process: the events a benchmark reads (a given file, or a generated one that
//! is removed afterwards), single-threaded replay with the in-process store — events/s, a
//! decode-only pass (the floor set by JSON parsing), live keys, peak RSS — and `--compare-rules`,
//! two rule sets replayed alternately on the same input.

use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::workload::{self, WorkloadSpec};
use crate::event::decode;
use crate::pipeline::{self, Engine, ReplayError, ReplayOptions};
use crate::rules::RuleSet;
use crate::store::{CounterStore, MemoryStore};

/// Why an in-process benchmark stopped. The messages are the command's.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("creating workload file: {0}")]
    CreateWorkload(io::Error),
    #[error("writing workload: {0}")]
    WriteWorkload(io::Error),
    #[error(transparent)]
    Io(#[from] io::Error),
    #[error(transparent)]
    Replay(#[from] ReplayError),
}

/// The events a benchmark reads: a given file, or generated ones in a temporary file that is
/// removed when this is dropped.
pub struct BenchInput {
    path: PathBuf,
    generated: bool,
}

impl BenchInput {
    /// `input` if given; else `spec`'s events written to a temporary file (saying so on stderr).
    pub fn prepare(input: Option<&Path>, spec: &WorkloadSpec) -> Result<BenchInput, BenchError> {
        if let Some(path) = input {
            return Ok(BenchInput {
                path: path.to_path_buf(),
                generated: false,
            });
        }
        let path = std::env::temp_dir().join(format!("vigil-bench-{}.jsonl", std::process::id()));
        let started = Instant::now();
        let mut out = BufWriter::new(File::create(&path).map_err(BenchError::CreateWorkload)?);
        // From here on the file exists: dropping the guard removes it, whatever happens next.
        let input = BenchInput {
            path,
            generated: true,
        };
        workload::generate(spec, &mut out).map_err(BenchError::WriteWorkload)?;
        out.flush()?;
        eprintln!(
            "bench: generated {} events ({} users, zipf {}) in {:.1}s",
            spec.events,
            spec.users,
            spec.skew,
            started.elapsed().as_secs_f64()
        );
        Ok(input)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for BenchInput {
    fn drop(&mut self) {
        if self.generated {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Replays `input` single-threaded with the in-process store and writes the report to `out`;
/// `rss_before` is the peak RSS measured before the input was prepared. Returns the rules, for a
/// comparison.
pub fn run(
    rules: RuleSet,
    input: &Path,
    rss_before: Option<u64>,
    out: &mut impl Write,
) -> Result<RuleSet, BenchError> {
    let bytes = std::fs::metadata(input).map(|m| m.len()).unwrap_or(0);
    let (decoded, decode_secs) = decode_only(&rules, input)?;
    let active = rules.active().len();
    let mut engine = Engine::new(rules, MemoryStore::new());
    let reader = BufReader::with_capacity(1 << 16, File::open(input)?);
    let summary = pipeline::replay(
        &mut engine,
        reader,
        io::sink(),
        io::sink(),
        ReplayOptions::default(),
    )?;
    let secs = summary.elapsed.as_secs_f64();
    let eps = summary.events_per_second();
    let rss = peak_rss_kib();

    writeln!(out, "vigil bench (replay, in-process store, 1 thread)")?;
    writeln!(
        out,
        "  input            {} events, {:.1} MiB, {active} active rules",
        summary.counts.events,
        bytes as f64 / 1048576.0
    )?;
    writeln!(
        out,
        "  decisions        {} ({} late, {} skipped, {} bad lines)",
        summary.counts.decisions,
        summary.counts.late,
        summary.counts.skipped(),
        summary.bad_lines
    )?;
    writeln!(
        out,
        "  decode only      {:.0} events/s ({:.0} ns/event)",
        decoded as f64 / decode_secs,
        decode_secs * 1e9 / decoded.max(1) as f64
    )?;
    writeln!(
        out,
        "  full pipeline    {eps:.0} events/s ({:.0} ns/event), {secs:.2}s",
        secs * 1e9 / summary.counts.events.max(1) as f64
    )?;
    writeln!(
        out,
        "  vs target        {:.2}x of 1 000 000 events/s",
        eps / 1e6
    )?;
    writeln!(out, "  live keys        {}", engine.store().live_keys())?;
    match (rss_before, rss) {
        (Some(before), Some(after)) => writeln!(
            out,
            "  peak RSS         {:.1} MiB (at start {:.1} MiB)",
            after as f64 / 1024.0,
            before as f64 / 1024.0
        )?,
        _ => writeln!(out, "  peak RSS         n/a (no /proc/self/status)")?,
    }
    Ok(engine.rules().clone())
}

/// Decode-only pass: how many lines decode, and the seconds it took (also warms the page cache).
fn decode_only(rules: &RuleSet, input: &Path) -> io::Result<(u64, f64)> {
    let started = Instant::now();
    let mut decoded = 0u64;
    let mut reader = BufReader::with_capacity(1 << 16, File::open(input)?);
    let mut line = Vec::new();
    while reader.read_until(b'\n', &mut line)? > 0 {
        if decode(
            line.strip_suffix(b"\n").unwrap_or(&line),
            rules.projection(),
        )
        .is_ok()
        {
            decoded += 1;
        }
        line.clear();
    }
    Ok((decoded, started.elapsed().as_secs_f64()))
}

/// Replays `input` with two rule sets, alternating A, B for `rounds` rounds (so drift in machine
/// load hits both alike), and writes each set's median rate, the spread and the ratio per round.
pub fn compare_rule_sets(
    input: &Path,
    a: RuleSet,
    b: RuleSet,
    a_path: &Path,
    b_path: &Path,
    rounds: u32,
    out: &mut impl Write,
) -> Result<(), BenchError> {
    let rate = |rules: &RuleSet| -> Result<f64, BenchError> {
        let mut engine = Engine::new(rules.clone(), MemoryStore::new());
        let reader = BufReader::with_capacity(1 << 16, File::open(input)?);
        Ok(pipeline::replay(
            &mut engine,
            reader,
            io::sink(),
            io::sink(),
            ReplayOptions::default(),
        )?
        .events_per_second())
    };
    let (mut ra, mut rb, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds.max(1) {
        let (x, y) = (rate(&a)?, rate(&b)?);
        ra.push(x);
        rb.push(y);
        ratios.push(x / y);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let spread = |v: &[f64]| (v[0], v[v.len() - 1]);
    let (ma, mb, mr) = (median(&mut ra), median(&mut rb), median(&mut ratios));
    writeln!(
        out,
        "compare ({} rounds, alternating, same input)",
        ratios.len()
    )?;
    writeln!(
        out,
        "  {:<28} {ma:.0} events/s median ({:.0}..{:.0})",
        a_path.display(),
        spread(&ra).0,
        spread(&ra).1
    )?;
    writeln!(
        out,
        "  {:<28} {mb:.0} events/s median ({:.0}..{:.0})",
        b_path.display(),
        spread(&rb).0,
        spread(&rb).1
    )?;
    writeln!(
        out,
        "  ratio                        {mr:.3} median ({:.3}..{:.3})",
        spread(&ratios).0,
        spread(&ratios).1
    )?;
    Ok(())
}

/// Peak resident set size (VmHWM) of this process, in KiB.
pub fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_input_is_removed_when_dropped_and_a_given_one_kept() {
        let spec = WorkloadSpec {
            events: 10,
            ..WorkloadSpec::default()
        };
        let generated = BenchInput::prepare(None, &spec).unwrap();
        let path = generated.path().to_path_buf();
        assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 10);
        drop(generated);
        assert!(!path.exists());
        let given = BenchInput::prepare(Some(Path::new("Cargo.toml")), &spec).unwrap();
        assert_eq!(given.path(), Path::new("Cargo.toml"));
        drop(given);
        assert!(Path::new("Cargo.toml").exists());
    }
}
