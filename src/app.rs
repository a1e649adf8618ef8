//! Command wiring: `check`, `replay`, `run`, `gen`, `bench`. Errors become messages and exit codes here.

use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;

use std::sync::Arc;

use vigil::clock::SystemClock;
use vigil::config::{redact_url, Config};
use vigil::event::{decode, TimeBounds};
use vigil::pipeline::{self, Engine, ReplayOptions};
use vigil::rule_files::{self, LoadError};
use vigil::rules::RuleSet;
use vigil::store::{CounterStore, MemoryStore, RedisStore, RedisStoreConfig};
use vigil::workload::{self, WorkloadSpec};

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

/// `vigil check PATH`: one line per counter and rule saying what it counts or judges, a warning
/// per likely mistake (on stderr), and exit 0; or every error and exit 1.
pub fn check(path: &Path) -> anyhow::Result<ExitCode> {
    let Some(rules) = load_rules(path) else { return Ok(ExitCode::from(1)) };
    let mut out = io::stdout().lock();
    for line in rules.summaries() {
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

/// Where `vigil replay --redis` counts.
pub struct ReplayRedis {
    pub url: String,
    pub tls_ca_file: Option<PathBuf>,
    /// The input's identity for exactly-once counting (`--input-id`).
    pub input_id: Option<String>,
}

/// The identity of a replay input: `--input-id`, else a regular file's content digest (the same
/// bytes are the same input), else a fresh random name (stdin cannot be read twice).
fn input_identity(input: &Path, input_id: Option<&str>) -> anyhow::Result<Vec<u8>> {
    if let Some(id) = input_id {
        return Ok([b"id:", id.as_bytes()].concat());
    }
    if input != Path::new("-") && std::fs::metadata(input).is_ok_and(|m| m.is_file()) {
        let mut hasher = blake3::Hasher::new();
        let file = File::open(input).with_context(|| format!("{}: cannot open input", input.display()))?;
        hasher.update_reader(file).with_context(|| format!("{}: cannot read input", input.display()))?;
        return Ok([b"content:", hasher.finalize().as_bytes().as_slice()].concat());
    }
    eprintln!(
        "replay: reading {} into Redis without --input-id: its events count as a new input; \
         replaying them again would count them again (give the same --input-id to count them once)",
        if input == Path::new("-") { "stdin" } else { "a stream" }
    );
    let random: [u8; 16] = rand::random();
    Ok([b"run:", random.as_slice()].concat())
}

/// `vigil replay`: decisions to stdout, bad lines and the summary to stderr.
pub fn replay(
    rules_path: &Path,
    input: &Path,
    redis: Option<ReplayRedis>,
    mut options: ReplayOptions,
    bounds: TimeBounds,
    max_keys: usize,
) -> anyhow::Result<ExitCode> {
    let Some(rules) = load_rules(rules_path) else { return Ok(ExitCode::from(1)) };
    let Some(reader) = open_input(input) else { return Ok(ExitCode::from(1)) };
    let clock = Arc::new(SystemClock);
    match redis {
        None => {
            let store = MemoryStore::new().with_max_keys(max_keys);
            run_replay(Engine::new(rules, store).with_time(bounds, clock), reader, options, |_| {})
        }
        Some(ReplayRedis { url, tls_ca_file, input_id }) => {
            options.lane = pipeline::input_lane(&input_identity(input, input_id.as_deref())?);
            let config = RedisStoreConfig { tls_ca_file, max_lateness: bounds.max_lateness_ms, ..RedisStoreConfig::default() };
            let store = match RedisStore::connect(&url, config) {
                Ok(store) => store,
                Err(e) => {
                    eprintln!("error: {}: {e}", redact_url(&url));
                    return Ok(ExitCode::from(1));
                }
            };
            run_replay(Engine::new(rules, store).with_time(bounds, clock), reader, options, |store: &RedisStore| {
                let s = store.stats();
                eprintln!(
                    "redis: {} script calls ({} flushes, {} key loads), {} retries, {} refused late",
                    s.script_calls, s.flushes, s.loads, s.retries, s.refused_late
                );
                if s.skipped_applied > 0 {
                    eprintln!(
                        "redis: {} observations were already counted in Redis (by an earlier run of this input — the same \
                         --input-id or file content — or by a flush whose reply was lost): judged against the counters as they \
                         stand, not counted again",
                        s.skipped_applied
                    );
                }
                if s.outages > 0 || s.data_losses > 0 || s.lost_keys > 0 {
                    eprintln!(
                        "redis: unavailable {} times ({} observations counted locally meanwhile and merged when it answered); \
                         lost its data {} times, {} keys written again from local views, {} keys found gone",
                        s.outages, s.degraded_observations, s.data_losses, s.reseeded_keys, s.lost_keys
                    );
                }
                if let Some(reason) = store.first_outage() {
                    eprintln!("redis: first taken as unavailable because: {reason}");
                }
            })
        }
    }
}

fn run_replay<S: CounterStore>(
    mut engine: Engine<S>,
    reader: Box<dyn BufRead>,
    options: ReplayOptions,
    report_store: impl Fn(&S),
) -> anyhow::Result<ExitCode> {
    let stdout = BufWriter::with_capacity(1 << 16, io::stdout().lock());
    let stderr = io::stderr().lock();
    match pipeline::replay(&mut engine, reader, stdout, stderr, options) {
        Ok(summary) => {
            eprintln!("{summary}");
            report_store(engine.store());
            Ok(ExitCode::SUCCESS)
        }
        // A closed stdout (`vigil replay ... | head`) is a normal way to stop reading.
        Err(pipeline::ReplayError::Io(e)) if e.kind() == io::ErrorKind::BrokenPipe => Ok(ExitCode::SUCCESS),
        Err(e) => Err(e).context("replay failed"),
    }
}

/// `vigil gen`: synthetic events to stdout, or to a Kafka topic.
pub fn gen(spec: WorkloadSpec, kafka: Option<(String, String)>) -> anyhow::Result<ExitCode> {
    if let Some((brokers, topic)) = kafka {
        let produced = vigil::kafka_bench::produce_generated(&brokers, &topic, &spec).map_err(anyhow::Error::msg)?;
        eprintln!("gen: produced {produced} events to {topic}");
        return Ok(ExitCode::SUCCESS);
    }
    let mut out = BufWriter::with_capacity(1 << 16, io::stdout().lock());
    match workload::generate(&spec, &mut out).and_then(|()| out.flush()) {
        Err(e) if e.kind() != io::ErrorKind::BrokenPipe => Err(e).context("writing events"),
        _ => Ok(ExitCode::SUCCESS),
    }
}

/// Arguments of `vigil bench`.
pub struct BenchArgs {
    pub rules: PathBuf,
    pub redis: Option<String>,
    pub workload: WorkloadSpec,
    pub input: Option<PathBuf>,
    /// A second rule set replayed on the same input, alternating, for a side-by-side ratio.
    pub compare_rules: Option<PathBuf>,
    pub rounds: u32,
}

/// `vigil bench`: generates a workload to a file, then replays it single-threaded with the
/// in-process store, reporting events/s and peak RSS, plus a decode-only pass to show where the
/// time goes.
pub fn bench(args: BenchArgs) -> anyhow::Result<ExitCode> {
    let Some(rules) = load_rules(&args.rules) else { return Ok(ExitCode::from(1)) };
    let rss_before = peak_rss_kib();
    let generated;
    let input = match &args.input {
        Some(path) => path.clone(),
        None => {
            generated = std::env::temp_dir().join(format!("vigil-bench-{}.jsonl", std::process::id()));
            let started = Instant::now();
            let mut out = BufWriter::new(File::create(&generated).context("creating workload file")?);
            workload::generate(&args.workload, &mut out).context("writing workload")?;
            out.flush()?;
            eprintln!(
                "bench: generated {} events ({} users, zipf {}) in {:.1}s",
                args.workload.events,
                args.workload.users,
                args.workload.skew,
                started.elapsed().as_secs_f64()
            );
            generated.clone()
        }
    };
    let bytes = std::fs::metadata(&input).map(|m| m.len()).unwrap_or(0);
    if let Some(url) = &args.redis {
        let result = vigil::redis_bench::run(url, &rules, &input, &mut io::stdout().lock());
        if args.input.is_none() {
            let _ = std::fs::remove_file(&input);
        }
        result.with_context(|| format!("redis benchmark on {}", redact_url(url)))?;
        return Ok(ExitCode::SUCCESS);
    }

    // Decode-only pass: the floor set by JSON parsing alone (also warms the page cache).
    let started = Instant::now();
    let mut decoded = 0u64;
    let mut reader = BufReader::with_capacity(1 << 16, File::open(&input)?);
    let mut line = Vec::new();
    while reader.read_until(b'\n', &mut line)? > 0 {
        if decode(line.strip_suffix(b"\n").unwrap_or(&line), rules.projection()).is_ok() {
            decoded += 1;
        }
        line.clear();
    }
    let decode_secs = started.elapsed().as_secs_f64();

    let active = rules.active().len();
    let mut engine = Engine::new(rules, MemoryStore::new());
    let reader = BufReader::with_capacity(1 << 16, File::open(&input)?);
    let summary = pipeline::replay(&mut engine, reader, io::sink(), io::sink(), ReplayOptions::default())?;
    let secs = summary.elapsed.as_secs_f64();
    let eps = summary.events_per_second();
    let rss = peak_rss_kib();

    println!("vigil bench (replay, in-process store, 1 thread)");
    println!("  input            {} events, {:.1} MiB, {active} active rules", summary.counts.events, bytes as f64 / 1048576.0);
    println!("  decisions        {} ({} late, {} skipped, {} bad lines)", summary.counts.decisions, summary.counts.late, summary.counts.skipped(), summary.bad_lines);
    println!("  decode only      {:.0} events/s ({:.0} ns/event)", decoded as f64 / decode_secs, decode_secs * 1e9 / decoded.max(1) as f64);
    println!("  full pipeline    {eps:.0} events/s ({:.0} ns/event), {secs:.2}s", secs * 1e9 / summary.counts.events.max(1) as f64);
    println!("  vs target        {:.2}x of 1 000 000 events/s", eps / 1e6);
    println!("  live keys        {}", engine.store().live_keys());
    match (rss_before, rss) {
        (Some(before), Some(after)) => println!("  peak RSS         {:.1} MiB (at start {:.1} MiB)", after as f64 / 1024.0, before as f64 / 1024.0),
        _ => println!("  peak RSS         n/a (no /proc/self/status)"),
    }
    if let Some(other) = &args.compare_rules {
        let Some(other_rules) = load_rules(other) else { return Ok(ExitCode::from(1)) };
        compare_rule_sets(&input, engine.rules().clone(), other_rules, &args.rules, other, args.rounds)?;
    }
    if args.input.is_none() {
        let _ = std::fs::remove_file(&input);
    }
    Ok(ExitCode::SUCCESS)
}

/// Replays `input` with two rule sets, alternating A, B for `rounds` rounds (so drift in machine
/// load hits both alike), and prints each set's median rate, the spread and the ratio per round.
fn compare_rule_sets(input: &Path, a: RuleSet, b: RuleSet, a_path: &Path, b_path: &Path, rounds: u32) -> anyhow::Result<()> {
    let rate = |rules: &RuleSet| -> anyhow::Result<f64> {
        let mut engine = Engine::new(rules.clone(), MemoryStore::new());
        let reader = BufReader::with_capacity(1 << 16, File::open(input)?);
        Ok(pipeline::replay(&mut engine, reader, io::sink(), io::sink(), ReplayOptions::default())?.events_per_second())
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
    println!("compare ({} rounds, alternating, same input)", ratios.len());
    println!("  {:<28} {ma:.0} events/s median ({:.0}..{:.0})", a_path.display(), spread(&ra).0, spread(&ra).1);
    println!("  {:<28} {mb:.0} events/s median ({:.0}..{:.0})", b_path.display(), spread(&rb).0, spread(&rb).1);
    println!("  ratio                        {mr:.3} median ({:.3}..{:.3})", spread(&ratios).0, spread(&ratios).1);
    Ok(())
}

/// Peak resident set size (VmHWM) of this process, in KiB.
fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// `vigil run --config FILE`: the Kafka worker until SIGTERM/SIGINT. Exit 0 after a clean stop
/// (everything flushed, delivered, committed), 1 otherwise, 2 for a bad config.
pub fn run(config_path: &Path) -> anyhow::Result<ExitCode> {
    use std::sync::Arc;
    use vigil::pipeline::worker;
    use vigil::shutdown::Shutdown;
    use vigil::store::AnyStore;
    use vigil::telemetry::{self, http::Health, Metrics};

    let config = match Config::load(config_path) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("error: {e}");
            return Ok(ExitCode::from(2));
        }
    };
    if let Err(e) = telemetry::init_logging(&config.log) {
        eprintln!("error: {}: {e}", config_path.display());
        return Ok(ExitCode::from(2));
    }
    tracing::info!(version = env!("CARGO_PKG_VERSION"), config = ?config, "starting vigil run");
    let Some(rules) = load_rules_with(&config.rules.path, config.rules.allow_empty) else { return Ok(ExitCode::from(1)) };
    let (store, journal) = match &config.redis.url {
        None => {
            tracing::warn!("no redis.url: counting in process, exact only while this is the only worker");
            (AnyStore::Memory(MemoryStore::new().with_max_keys(config.memory.max_keys)), None)
        }
        Some(url) => {
            let store = RedisStore::connect(url, config.redis_store())
                .with_context(|| format!("connecting to Redis at {}", redact_url(url)))?;
            let journal = vigil::store::JournalWriter::connect(url, &config.redis_store(), &config.kafka.group_id)
                .with_context(|| format!("connecting to Redis at {}", redact_url(url)))?;
            (AnyStore::Redis(Box::new(store)), Some(journal))
        }
    };
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::default());
    let shutdown = Shutdown::new();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("vigil-http")
        .enable_all()
        .build()
        .context("starting the HTTP runtime")?;
    let listen = config.http.listen;
    let server = runtime
        .block_on(telemetry::http::serve(listen, Arc::clone(&metrics), Arc::clone(&health), std::future::pending()))
        .with_context(|| format!("http.listen: cannot listen on {listen}"))?;
    runtime.spawn(async move {
        if let Err(e) = server.await {
            tracing::error!(error = %e, "HTTP server stopped");
        }
    });
    tracing::info!(%listen, "serving /metrics /healthz /readyz");
    runtime.spawn(on_signals(shutdown.clone(), config.worker.shutdown_timeout));
    let result = worker::run(config, rules, store, journal, metrics, health, shutdown.clone());
    shutdown.trigger();
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(e) => {
            eprintln!("error: {e}");
            Ok(ExitCode::from(1))
        }
    }
}

/// SIGTERM or SIGINT starts the shutdown; a second one, or the shutdown outlasting its bound by
/// five seconds, ends the process at once with exit code 1.
async fn on_signals(shutdown: vigil::shutdown::Shutdown, bound: std::time::Duration) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        tracing::error!("cannot install signal handlers");
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
    shutdown.trigger();
    tokio::select! {
        _ = term.recv() => tracing::error!("second signal: exiting now"),
        _ = int.recv() => tracing::error!("second signal: exiting now"),
        _ = tokio::time::sleep(bound + std::time::Duration::from_secs(5)) => {
            tracing::error!(bound_s = bound.as_secs(), "shutdown took too long: exiting now")
        }
    }
    std::process::exit(1);
}

/// `vigil bench --kafka BROKERS`: one worker end to end (see `vigil::kafka_bench`).
pub fn bench_kafka(args: vigil::kafka_bench::KafkaBenchArgs) -> anyhow::Result<ExitCode> {
    let Some(rules) = load_rules(&args.rules_path) else { return Ok(ExitCode::from(1)) };
    vigil::kafka_bench::run(&args, rules, &mut io::stdout().lock()).map_err(anyhow::Error::msg).context("kafka benchmark")?;
    Ok(ExitCode::SUCCESS)
}

/// `vigil backtest`: replay plus the per-rule report, as a table or `--json`.
pub fn backtest(rules_path: &Path, input: &Path, json: bool, bounds: TimeBounds, max_keys: usize) -> anyhow::Result<ExitCode> {
    use std::io::IsTerminal;
    let Some(rules) = load_rules(rules_path) else { return Ok(ExitCode::from(1)) };
    let Some(reader) = open_input(input) else { return Ok(ExitCode::from(1)) };
    let total = std::fs::metadata(input).ok().filter(|m| m.is_file()).map(|m| m.len());
    let started = Instant::now();
    let show_progress = io::stderr().is_terminal();
    let store = MemoryStore::new().with_max_keys(max_keys);
    let mut engine = Engine::new(rules, store).with_time(bounds, Arc::new(SystemClock));
    let report = pipeline::backtest::backtest(&mut engine, reader, |lines| {
        if show_progress {
            let rate = lines as f64 / started.elapsed().as_secs_f64().max(1e-9);
            match total {
                Some(bytes) => eprint!("\rbacktest: {lines} lines ({:.1} MiB input), {rate:.0} lines/s", bytes as f64 / 1048576.0),
                None => eprint!("\rbacktest: {lines} lines, {rate:.0} lines/s"),
            }
        }
    })
    .context("backtest failed")?;
    if show_progress {
        eprintln!();
    }
    let mut out = io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
    } else {
        pipeline::backtest::write_table(&report, &mut out)?;
    }
    Ok(ExitCode::SUCCESS)
}
