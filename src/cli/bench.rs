//! `vigil bench`: picks the benchmark (in process, `--redis`, `--kafka`) and hands it the rules
//! and the input; the measuring is the harness's.

use std::io;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

use vigil::config::redact_url;
use vigil::harness::replay_bench::{self, BenchInput};
use vigil::harness::workload::WorkloadSpec;
use vigil::harness::{kafka_bench, redis_bench};

use super::load_rules;

/// Arguments of `vigil bench` (without `--kafka`).
pub struct BenchArgs {
    pub rules: PathBuf,
    pub redis: Option<String>,
    pub workload: WorkloadSpec,
    pub input: Option<PathBuf>,
    /// A second rule set replayed on the same input, alternating, for a side-by-side ratio.
    pub compare_rules: Option<PathBuf>,
    pub rounds: u32,
}

/// Replays a workload (`--input`, else generated to a temporary file) single-threaded with the
/// in-process store, or with `--redis` against the per-event scripts.
pub fn bench(args: BenchArgs) -> anyhow::Result<ExitCode> {
    let Some(rules) = load_rules(&args.rules) else {
        return Ok(ExitCode::from(1));
    };
    let rss_before = replay_bench::peak_rss_kib();
    let input = BenchInput::prepare(args.input.as_deref(), &args.workload)?;
    if let Some(url) = &args.redis {
        redis_bench::run(url, &rules, input.path(), &mut io::stdout().lock())
            .with_context(|| format!("redis benchmark on {}", redact_url(url)))?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut out = io::stdout().lock();
    let rules = replay_bench::run(rules, input.path(), rss_before, &mut out)?;
    if let Some(other) = &args.compare_rules {
        let Some(other_rules) = load_rules(other) else {
            return Ok(ExitCode::from(1));
        };
        replay_bench::compare_rule_sets(
            input.path(),
            rules,
            other_rules,
            &args.rules,
            other,
            args.rounds,
            &mut out,
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `vigil bench --kafka BROKERS`: one worker end to end (see `vigil::harness::kafka_bench`).
pub fn bench_kafka(args: kafka_bench::KafkaBenchArgs) -> anyhow::Result<ExitCode> {
    let Some(rules) = load_rules(&args.rules_path) else {
        return Ok(ExitCode::from(1));
    };
    kafka_bench::run(&args, rules, &mut io::stdout().lock())
        .map_err(anyhow::Error::msg)
        .context("kafka benchmark")?;
    Ok(ExitCode::SUCCESS)
}
