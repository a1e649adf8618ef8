//! `vigil replay`: decisions to stdout, bad lines and the summary to stderr; counting in process,
//! or in Redis (`--redis`) with each input line counted once however often it is replayed.

use std::fs::File;
use std::io::{self, BufRead, BufWriter};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;

use vigil::config::redact_url;
use vigil::pipeline::{self, Engine, ReplayOptions};
use vigil::store::replay_lane::ReplayClaim;
use vigil::store::{AnyStore, CounterStore, RedisStore};

use super::{load_rules, open_input, InputBounds};

/// Where `vigil replay --redis` counts.
pub struct ReplayRedis {
    pub url: String,
    pub tls_ca_file: Option<PathBuf>,
    /// The input's identity for exactly-once counting (`--input-id`).
    pub input_id: Option<String>,
    /// `--replica-ack-timeout` (`None`: off).
    pub replica_ack_timeout: Option<std::time::Duration>,
    /// `--redis-flush-interval`.
    pub flush_interval: std::time::Duration,
    /// `--redis-allow-eviction`.
    pub allow_eviction: bool,
    /// `--rejudge`: replay an input this Redis already holds.
    pub rejudge: bool,
}

/// Replays `input` through the rules at `rules_path`, counting in Redis if `redis` is given.
pub fn replay(
    rules_path: &Path,
    input: &Path,
    redis: Option<ReplayRedis>,
    mut options: ReplayOptions,
    limits: InputBounds,
    max_bad_ratio: f64,
) -> anyhow::Result<ExitCode> {
    let Some(rules) = load_rules(rules_path) else {
        return Ok(ExitCode::from(1));
    };
    let Some(reader) = open_input(input) else {
        return Ok(ExitCode::from(1));
    };
    // A pipe is a live stream: each record goes out as soon as its line is judged.
    options.live =
        input == Path::new("-") && !std::fs::metadata("/dev/stdin").is_ok_and(|m| m.is_file());
    let mut setup = limits.store_setup();
    let mut rejudge = false;
    if let Some(ReplayRedis {
        url,
        tls_ca_file,
        input_id,
        replica_ack_timeout,
        flush_interval,
        allow_eviction,
        rejudge: allow_rejudge,
    }) = redis
    {
        rejudge = allow_rejudge;
        setup.redis.replica_ack_timeout = replica_ack_timeout;
        // A replay counts alone: it writes behind at the exclusive interval, which is never
        // shorter than `flush_interval` (which also says how long a hold read stays fresh: the
        // worker's, unless the one asked for is shorter).
        setup.redis.exclusive_flush_interval = flush_interval;
        setup.redis.flush_interval = setup.redis.flush_interval.min(flush_interval);
        setup.redis.allow_eviction = allow_eviction;
        options.lane = pipeline::input_lane(&input_identity(input, input_id.as_deref())?);
        setup.redis.url = Some(url);
        setup.redis.tls_ca_file = tls_ca_file;
    }
    let store = match setup.open() {
        Ok((store, _no_journal)) => store,
        Err(e) => {
            eprintln!(
                "error: {}: {e}",
                redact_url(setup.redis.url.as_deref().unwrap_or_default())
            );
            return Ok(ExitCode::from(1));
        }
    };
    // One replay of an input at a time, and none of an input already applied unless asked.
    let claim = match &setup.redis.url {
        Some(url) => match claim_input(url, &setup, options.lane, rejudge) {
            Ok(claim) => Some(claim),
            Err(message) => {
                eprintln!("error: {}: {message}", redact_url(url));
                return Ok(ExitCode::from(1));
            }
        },
        None => None,
    };
    // Each store its own monomorphised engine: no dispatch on the counting path.
    let (code, lines) = match store {
        AnyStore::Memory(store) => run_replay(
            limits.engine(rules, store),
            reader,
            options,
            max_bad_ratio,
            |_| {},
        ),
        AnyStore::Redis(store) => run_replay(
            limits.engine(rules, *store),
            reader,
            options,
            max_bad_ratio,
            report_redis,
        ),
    }?;
    if let (Some(claim), Some(lines)) = (claim, lines) {
        if let Err(e) = claim.finish(lines) {
            eprintln!("replay: could not record that this input was applied: {e}");
        }
    }
    Ok(code)
}

/// Claims the replay's input lane in Redis: refused while another replay of it runs, and when
/// a finished one applied it already unless `rejudge` (then said on stderr).
fn claim_input(
    url: &str,
    setup: &vigil::config::StoreSetup,
    lane: u64,
    rejudge: bool,
) -> Result<ReplayClaim, String> {
    let config = setup.redis.store_config(setup.max_lateness_ms);
    let claim = ReplayClaim::acquire(url, &config, lane).map_err(|e| e.to_string())?;
    let Some(previous) = claim.previous else {
        return Ok(claim);
    };
    let when = previous.finished();
    if rejudge {
        eprintln!(
            "replay: re-judging an input this Redis already holds ({} lines, replayed {when}): nothing is counted \
             twice; every event is judged against the counts as they stand now",
            previous.lines
        );
        return Ok(claim);
    }
    Err(format!(
        "this input was already replayed into this Redis ({} lines, finished {when}). Replaying it again counts \
         none of its events twice but judges every one against the counts as they stand now, which hold the whole \
         input (a first failure would be judged on the whole run's count): pass --rejudge to do that anyway, or \
         give another --input-id to count it as a new input",
        previous.lines
    ))
}

/// The identity of a replay input: `--input-id`, else a regular file's content digest (the same
/// bytes are the same input), else a fresh random name (stdin cannot be read twice).
fn input_identity(input: &Path, input_id: Option<&str>) -> anyhow::Result<Vec<u8>> {
    if let Some(id) = input_id {
        return Ok([b"id:", id.as_bytes()].concat());
    }
    if input != Path::new("-") && std::fs::metadata(input).is_ok_and(|m| m.is_file()) {
        let mut hasher = blake3::Hasher::new();
        let file =
            File::open(input).with_context(|| format!("{}: cannot open input", input.display()))?;
        hasher
            .update_reader(file)
            .with_context(|| format!("{}: cannot read input", input.display()))?;
        return Ok([b"content:", hasher.finalize().as_bytes().as_slice()].concat());
    }
    eprintln!(
        "replay: reading {} into Redis without --input-id: its events count as a new input; \
         replaying them again would count them again (give the same --input-id to count them once)",
        if input == Path::new("-") {
            "stdin"
        } else {
            "a stream"
        }
    );
    let random: [u8; 16] = rand::random();
    Ok([b"run:", random.as_slice()].concat())
}

fn run_replay<S: CounterStore>(
    mut engine: Engine<S>,
    reader: Box<dyn BufRead>,
    options: ReplayOptions,
    max_bad_ratio: f64,
    report_store: impl Fn(&S),
) -> anyhow::Result<(ExitCode, Option<u64>)> {
    let stdout = BufWriter::with_capacity(1 << 16, io::stdout().lock());
    let stderr = io::stderr().lock();
    match pipeline::replay(&mut engine, reader, stdout, stderr, options) {
        Ok(summary) => {
            eprintln!("{summary}");
            report_store(engine.store());
            let code = super::refuse_bad_input(
                "replay",
                summary.counts.events,
                summary.bad_lines,
                max_bad_ratio,
            )
            .unwrap_or(ExitCode::SUCCESS);
            Ok((code, Some(summary.lines)))
        }
        // A closed stdout (`vigil replay ... | head`) is a normal way to stop reading.
        Err(pipeline::ReplayError::Io(e)) if e.kind() == io::ErrorKind::BrokenPipe => {
            Ok((ExitCode::SUCCESS, None))
        }
        Err(e) => Err(e).context("replay failed"),
    }
}

/// After the summary: what the Redis store did, and why it was ever taken as unavailable.
fn report_redis(store: &RedisStore) {
    let s = store.stats();
    eprintln!(
        "redis: {} script calls ({} flushes, {} hash loads), {} retries, {} refused late",
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
    if s.failovers > 0 {
        eprintln!(
            "redis: followed {} failovers to a promoted replica; {} observations no replica had confirmed were written \
             again to the new master (each counted once)",
            s.failovers, s.rewritten_unconfirmed
        );
    }
    if s.unconfirmed_dropped > 0 {
        eprintln!(
            "redis: {} observations were not kept for a failover because no replica confirmed them for too long",
            s.unconfirmed_dropped
        );
    }
    if let Some(reason) = store.first_outage() {
        eprintln!("redis: first taken as unavailable because: {reason}");
    }
}
