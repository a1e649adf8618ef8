//! The `vigil` command line. Thin: parses arguments and hands over to `cli`, one file per
//! command. Defaults shared with `vigil run` come from its embedded defaults
//! (`vigil::config`), the workload's from `WorkloadSpec::default()`.

mod cli;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use vigil::config::{InputConfig, MemoryConfig, RedisConfig, RulesConfig, WorkerConfig};
#[cfg(feature = "harness")]
use vigil::harness::workload::WorkloadSpec;
use vigil::pipeline::ReplayOptions;

/// mimalloc rather than glibc's allocator: with Redis, a replay spent a sixth of its time in
/// glibc's free lists (`unlink_chunk`, `malloc_consolidate`) as clean views came and went.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay` (the bindings name no constant for it).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// How long freed memory stays with the process before mimalloc gives it back to the kernel.
/// The write-behind frees its lists and script buffers at every flush and fills new ones until
/// the next (up to a second later, while a worker writes its keys alone); with mimalloc's 1 s
/// default, those pages went back in between and each cycle took them again, zeroed — with huge
/// pages, a fifth of a hot replay's time. Ten seconds covers any flush cycle and still returns
/// memory soon after a burst. `MIMALLOC_PURGE_DELAY` in the environment wins.
const PURGE_DELAY_MS: std::ffi::c_long = 10_000;

/// mimalloc's `mi_option_allow_thp`.
const MI_OPTION_ALLOW_THP: libmimalloc_sys::mi_option_t = 43;

/// Transparent huge pages off for the process, unless `MIMALLOC_ALLOW_THP` in the environment
/// says otherwise (mimalloc reads it at start: `0` turns them off itself, `1` keeps them).
///
/// A huge page the kernel hands out fresh is zeroed whole, and in a VM whose host takes freed
/// memory back (a balloon's free page reporting, as on the machine the benchmarks ran on), a
/// fresh huge page is also one the host must back first: touched for the first time, memory went
/// at 215-354 MB/s with huge pages against ~2.5 GB/s with small ones. A worker's state grows from
/// nothing, so that cost falls on its whole footprint (a cold in-process replay spent a fifth of
/// its samples zeroing pages). Small pages cost more TLB misses (measured: a few percent more user
/// time), far less than that.
fn small_pages_unless_asked() {
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_some() {
        return;
    }
    // SAFETY: sets an option's value; mimalloc reads it when it next maps memory.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_ALLOW_THP, 0) };
    // The memory mimalloc mapped before `main` was already advised for huge pages, and so are the
    // key table's large slot arrays: the process-wide switch covers them too.
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_THP_DISABLE takes no pointers; it sets a flag of this process.
    unsafe {
        libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
    }
}

fn keep_freed_memory_a_while() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets an option's value; mimalloc reads it when it next purges.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS) };
    }
}

#[derive(Parser)]
#[command(
    name = "vigil",
    version,
    about = "Risk-control stream processor: exact sliding-window rules over events"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Validate rule files: one line per rule, or every error as file:line:col and exit 1.
    Check {
        /// A rule file or a directory of *.toml rule files.
        path: PathBuf,
        /// The workers' `input.max_partition_skew`: a counter whose window is not longer is
        /// warned about (partitions that far apart can make each other's events late for it).
        #[arg(long, value_name = "DURATION|off", default_value_t = Bound(InputConfig::default().max_partition_skew), value_parser = parse_bound)]
        max_partition_skew: Bound,
        /// The workers' `input.max_future_skew`: a counter whose window is not longer is warned
        /// about (one event stamped that far ahead blinds it); "off" when event time comes from a
        /// clock you trust.
        #[arg(long, value_name = "DURATION|off", default_value_t = Bound(InputConfig::default().max_future_skew), value_parser = parse_bound)]
        max_future_skew: Bound,
        /// A JSON-lines sample of real events to lint the rules against: field paths that never
        /// occur (with "did you mean"), literals of a type the events never carry there
        /// (`mcc = 8398` against "8398"), `ts` in seconds or microseconds, rules that never fire
        /// and counters that count nothing on the sample.
        #[arg(long, value_name = "SAMPLE.jsonl")]
        events: Option<PathBuf>,
        /// Exit 1 when there are warnings (for CI).
        #[arg(long)]
        strict: bool,
    },
    /// Run rules over JSON-lines events (no Kafka; in-process counters unless --redis): decisions to stdout.
    Replay {
        /// A rule file or a directory of *.toml rule files.
        #[arg(long, default_value_os_t = RulesConfig::default().path)]
        rules: PathBuf,
        /// JSON-lines events file, or - for stdin.
        #[arg(long)]
        input: PathBuf,
        /// Also print a record (action "allow", no hits) for events that hit nothing.
        #[arg(long)]
        emit_allow: bool,
        /// Count in Redis instead of in process: redis://[user:pass@]host:port[/db], rediss://
        /// (TLS), any node of a Redis Cluster, or
        /// redis+sentinel://[user:pass@]host[:port][,host[:port]...]/master-name[/db].
        #[arg(long, value_name = "URL")]
        redis: Option<String>,
        /// CA certificate (PEM) that signed a rediss:// server's certificate.
        #[arg(long, value_name = "FILE", requires = "redis")]
        redis_ca: Option<PathBuf>,
        /// With --redis: the name under which this input's lines are recorded as counted, so
        /// replaying the same input again never counts a line twice. Default: the file's content
        /// digest; for stdin, a fresh name per run.
        #[arg(long, value_name = "NAME", requires = "redis")]
        input_id: Option<String>,
        /// With --redis: at the end, how long to wait for an unavailable Redis to take what was
        /// counted locally meanwhile (exit 1 if it does not).
        #[arg(long, value_name = "DURATION", default_value = "1m", value_parser = humantime::parse_duration, requires = "redis")]
        redis_wait: std::time::Duration,
        /// With --redis: how long each flush waits for a replica to confirm its writes (kept
        /// until then, and written again if a failover promotes a replica that lacks them); off:
        /// not confirmed (the worker's `redis.replica_ack_timeout`).
        #[arg(long, value_name = "DURATION|off", default_value_t = Bound(RedisConfig::default().replica_ack_timeout), value_parser = parse_nonzero_bound, requires = "redis")]
        replica_ack_timeout: Bound,
        /// With --redis: how often the counts are written to Redis. A replay is its keys' only
        /// writer, so by default as seldom as a worker alone in its group (the worker's
        /// `redis.exclusive_flush_interval`): anything else reading those keys meanwhile (a
        /// worker, `vigil inspect`) sees them up to that late.
        #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = parse_flush_interval, requires = "redis")]
        redis_flush_interval: std::time::Duration,
        /// With --redis: count in a Redis whose maxmemory-policy may evict keys (refused
        /// otherwise: an evicted key loses its count silently; the worker's
        /// `redis.allow_eviction`).
        #[arg(long, requires = "redis")]
        redis_allow_eviction: bool,
        /// With --redis: replay an input this Redis already holds (refused otherwise). Nothing is
        /// counted twice, but every event is judged against the counts as they stand now, which
        /// hold the whole input (a first failure is judged on the whole run's count).
        #[arg(long, requires = "redis")]
        rejudge: bool,
        /// Longer input lines are bad lines (`too_large`), skipped without being held in memory
        /// (the worker's `worker.max_event_bytes`).
        #[arg(long, value_name = "BYTES", default_value_t = WorkerConfig::default().max_event_bytes, value_parser = parse_event_bytes)]
        max_event_bytes: usize,
        /// Exit 1 when more than this share of the non-blank input lines are bad (not JSON, no
        /// usable ts, …; each is reported on stderr). Whatever it is, a replay of which no line
        /// decodes exits 1.
        #[arg(long, value_name = "RATIO", default_value_t = 1.0, value_parser = cli::parse_ratio)]
        max_bad_ratio: f64,
        #[command(flatten)]
        bounds: BoundArgs,
    },
    /// Show one key as the engine sees it: a counter's live window (value, head, buckets with
    /// their time ranges, distinct values, recorded offsets, TTL in Redis), or a rule's hold on
    /// the key and every counter its condition reads.
    #[command(after_long_help = INSPECT_HELP)]
    Inspect {
        /// A rule file or a directory of *.toml rule files (the ones the workers run).
        #[arg(long, default_value_os_t = RulesConfig::default().path)]
        rules: PathBuf,
        /// Look in the Redis the workers count in (their redis.url).
        #[arg(
            long,
            value_name = "URL",
            required_unless_present = "input",
            conflicts_with = "input"
        )]
        redis: Option<String>,
        /// CA certificate (PEM) that signed a rediss:// server's certificate.
        #[arg(long, value_name = "FILE", requires = "redis")]
        redis_ca: Option<PathBuf>,
        /// Instead of Redis: replay this JSON-lines file in process up to --at, then look.
        #[arg(long, value_name = "FILE")]
        input: Option<PathBuf>,
        /// A counter id or a rule id.
        id: String,
        /// The key, as FIELD=VALUE for each field it is formed from (dotted paths for nested
        /// fields). Typed as in rule files: user_id=17 is the number, user_id='17' the string;
        /// anything that is not a number, true, false or null is a string as written.
        #[arg(value_name = "FIELD=VALUE", required = true)]
        fields: Vec<String>,
        /// The time to look at, as an event at that time would see the key: RFC 3339 or epoch
        /// milliseconds. Default: now; with --input, the newest event's time.
        #[arg(long, value_name = "TIME", value_parser = cli::parse_at)]
        at: Option<i64>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        bounds: BoundArgs,
    },
    /// Holds (a rule's penalty box on a key).
    Hold {
        #[command(subcommand)]
        command: HoldCommand,
    },
    /// Run the Kafka worker: consume events, count, decide, produce decisions (until SIGTERM/SIGINT).
    Run {
        /// Configuration file (TOML; VIGIL_<SECTION>_<KEY> environment variables override it).
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
    },
    /// Synthetic events (zipf-skewed users and IPs, nested fields, injected fraud bursts) as JSON
    /// lines to stdout, or produced to a Kafka topic keyed by user.
    #[cfg(feature = "harness")]
    #[command(after_long_help = GEN_SCHEMA)]
    Gen {
        #[command(flatten)]
        workload: WorkloadArgs,
        /// Events per second of event time (how fast `ts` advances).
        #[arg(long, default_value_t = WorkloadSpec::default().rate_per_sec, value_parser = clap::value_parser!(u64).range(1..))]
        rate: u64,
        /// Generate this much event time instead of --events, written as in rule files or the
        /// config (500ms, 90s, 15m, 1h, 1d, 1w).
        #[arg(long, value_parser = humantime::parse_duration)]
        duration: Option<std::time::Duration>,
        /// Distinct shared IPs (zipf-skewed).
        #[arg(long, default_value_t = WorkloadSpec::default().ips, value_parser = clap::value_parser!(u64).range(1..))]
        ips: u64,
        /// Share of events in injected fraud bursts (credential stuffing from one IP, card testing,
        /// account takeover), each tagged "fraud":"<pattern>"; 0 to 1.
        #[arg(long, default_value_t = 0.02, value_parser = cli::parse_ratio)]
        fraud: f64,
        /// Produce to Kafka at these brokers instead of writing to stdout.
        #[arg(long, value_name = "BROKERS")]
        kafka: Option<String>,
        /// Topic for --kafka.
        #[arg(long, default_value = "events", requires = "kafka")]
        topic: String,
    },
    /// Replay plus a per-rule report for rule authors: matched, hits, keys hit, first/last hit,
    /// share of events hit, and injected fraud caught (for `vigil gen` input).
    Backtest {
        /// A rule file or a directory of *.toml rule files.
        #[arg(long, default_value_os_t = RulesConfig::default().path)]
        rules: PathBuf,
        /// JSON-lines events file, or - for stdin.
        #[arg(long)]
        input: PathBuf,
        /// The report as JSON on stdout instead of a table.
        #[arg(long)]
        json: bool,
        /// Exit 1 when more than this share of the non-blank input lines are bad. Whatever it
        /// is, a backtest of which no line decodes exits 1.
        #[arg(long, value_name = "RATIO", default_value_t = 1.0, value_parser = cli::parse_ratio)]
        max_bad_ratio: f64,
        /// The event field that labels an event: true (or a non-empty string, a fraud pattern)
        /// for fraud, false (or "") for legitimate; events without it are unlabelled. Gives each
        /// rule's precision and recall.
        #[arg(long, value_name = "FIELD", default_value = "fraud", value_parser = parse_label)]
        label: vigil::event::FieldPath,
        /// Re-judge a rule at each of these limits in the same pass: hits, keys, labelled hits,
        /// precision and recall per limit. The rule is in the v1 form (window + limit: the limit
        /// is replaced) or its whole `when` compares a counter with a number ("$c > N" or
        /// "$c >= N": N is replaced). Holds, `final` and rollouts are not applied. Repeat for
        /// several rules.
        #[arg(long, value_name = "RULE=L1,L2,…", value_parser = vigil::pipeline::tuning::parse_sweep)]
        sweep: Vec<(String, Vec<vigil::decimal::Decimal>)>,
        /// Another rule set to judge the same events with: every event whose decision differs
        /// (action, or which rules hit), with both records.
        #[arg(long, value_name = "OTHER_RULES")]
        compare: Option<PathBuf>,
        #[command(flatten)]
        bounds: BoundArgs,
    },
    /// Measure single-threaded replay throughput and peak memory on a generated workload.
    #[cfg(feature = "harness")]
    Bench {
        /// A rule file or a directory of *.toml rule files.
        #[arg(long, default_value_os_t = RulesConfig::default().path)]
        rules: PathBuf,
        /// Replay this JSON-lines file instead of generating one (with --kafka: produce its lines
        /// as the backlog; the latency phases still produce generated events).
        #[arg(long)]
        input: Option<PathBuf>,
        /// Also replay the same input with these rules, alternating with --rules over
        /// --rounds rounds, and print both rates and their ratio (e.g. examples/rules-v1).
        #[arg(long, value_name = "PATH", conflicts_with_all = ["redis", "kafka"])]
        compare_rules: Option<PathBuf>,
        /// Rounds of the --compare-rules comparison.
        #[arg(long, default_value_t = 5, requires = "compare_rules")]
        rounds: u32,
        /// Benchmark the Redis store against per-event scripts on this (empty) Redis database;
        /// with --kafka, count in this Redis.
        #[arg(long, value_name = "URL")]
        redis: Option<String>,
        /// Benchmark one worker (or --workers) end to end on this Kafka cluster (creates fresh
        /// bench-* topics): saturation throughput, then at half that load (or --latency-rate) side
        /// by side: event produced → decision consumed, vigil's own share
        /// (vigil_processing_latency_seconds) and the broker's own one hop; then how the
        /// decisions of both phases differ from a single-order run of their events.
        #[arg(long, value_name = "BROKERS")]
        kafka: Option<String>,
        /// Partitions of the --kafka events topic.
        #[arg(long, default_value_t = 4, requires = "kafka")]
        partitions: i32,
        /// Seconds of the --kafka half-load latency phase.
        #[arg(long, default_value_t = 20, requires = "kafka")]
        latency_seconds: u64,
        /// Events/s of the --kafka latency phases instead of half the measured saturation
        /// (latency at a lighter or heavier load).
        #[arg(long, value_name = "EVENTS_PER_SEC", requires = "kafka")]
        latency_rate: Option<u64>,
        /// Workers of the --kafka benchmark, in one consumer group (above 1 needs --redis).
        #[arg(long, default_value_t = 1, requires = "kafka", value_parser = clap::value_parser!(u16).range(1..=64))]
        workers: u16,
        /// Share of the --kafka benchmark's events in injected fraud bursts (credential stuffing
        /// from one IP over many accounts, card testing, account takeover), 0..1.
        #[arg(long, default_value_t = 0.0, requires = "kafka")]
        fraud: f64,
        #[command(flatten)]
        workload: WorkloadArgs,
    },
}

#[derive(Subcommand)]
enum HoldCommand {
    /// End a rule's hold on one key (a wrongly blocked customer need not wait for it to
    /// expire): the next event of that key is judged as if the hold had never been set. Writes
    /// an audit record ("kind":"hold_release", rule, key, reason, time) to the decisions topic
    /// and prints it.
    #[command(after_long_help = INSPECT_HELP)]
    Release {
        /// A rule file or a directory of *.toml rule files (the ones the workers run).
        #[arg(long, default_value_os_t = RulesConfig::default().path)]
        rules: PathBuf,
        /// The Redis the workers count in (default: redis.url of --config).
        #[arg(long, value_name = "URL")]
        redis: Option<String>,
        /// CA certificate (PEM) that signed a rediss:// server's certificate.
        #[arg(long, value_name = "FILE", requires = "redis")]
        redis_ca: Option<PathBuf>,
        /// The workers' configuration file: its Kafka section says where the audit record goes
        /// (brokers, decisions topic, SASL/TLS properties), its redis.url where the hold is.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Write the audit record at these brokers instead of --config's (default: --config's,
        /// else VIGIL_KAFKA_BROKERS; with none, the record is printed only).
        #[arg(long, value_name = "BROKERS")]
        brokers: Option<String>,
        /// The decisions topic, with --brokers.
        #[arg(long, default_value = "decisions", requires = "brokers")]
        topic: String,
        /// Why: kept in the audit record (a ticket number, who asked).
        #[arg(long, required = true)]
        reason: String,
        /// The rule whose hold ends.
        rule: String,
        /// The hold key, as FIELD=VALUE (typed as with inspect).
        #[arg(value_name = "FIELD=VALUE", required = true)]
        fields: Vec<String>,
    },
}

const INSPECT_HELP: &str = "\
Examples:
  vigil inspect --redis redis://127.0.0.1:6379 login-fails-user-10m user_id=u-7
  vigil inspect --input examples/events.jsonl login-brute-force user_id=u-7 --json
  vigil inspect --redis redis://127.0.0.1:6379 pay-amount-card-1h card.bin='411111' --at 2026-11-26T10:00:00Z
  vigil hold release --config vigil.toml login-brute-force user_id=u-7 --reason 'ticket 4711: customer verified'

Field values are typed as in rule files: user_id=17 is the number 17 and user_id='17' the string
\"17\" (a key made from one never matches the other); u-17 is the string \"u-17\".";

/// Bounds on event time.
#[derive(clap::Args)]
struct BoundArgs {
    /// Events more than this far ahead of the wall clock are bad lines (future_ts); "off" disables.
    #[arg(long, value_name = "DURATION|off", default_value_t = Bound(InputConfig::default().max_future_skew), value_parser = parse_nonzero_bound)]
    max_future_skew: Bound,
    /// Events older than the newest event so far minus this are late for every counter; "off"
    /// disables (and keeps every key's state for the whole run).
    #[arg(long, value_name = "DURATION|off", default_value_t = Bound(InputConfig::default().max_lateness), value_parser = parse_nonzero_bound)]
    max_lateness: Bound,
    /// Most estimated bytes of in-process state ("1GiB", "512MiB", bytes); beyond, the keys with
    /// the fewest events are evicted (reported in the summary), and values over them are lower
    /// bounds that each rule judges by its on_store_error.
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = parse_state_bytes)]
    max_state_bytes: usize,
    /// Most (counter, key) windows, and most holds, kept in process whatever their bytes;
    /// evicted alike.
    #[arg(long, value_name = "N", default_value_t = MemoryConfig::default().max_keys, value_parser = parse_max_keys)]
    max_keys: usize,
    /// Where event time comes from: the event's ts field, or another field of the event read
    /// the same way (epoch ms or RFC 3339), e.g. the Kafka record time an export kept beside the
    /// event. Whoever stamps it decides what is late: use a time the producing service set.
    #[arg(long, value_name = "ts|FIELD", default_value = "ts", value_parser = parse_time_source)]
    time: vigil::event::TimeSource,
}

/// `--time`: `ts`, or a field path.
fn parse_time_source(text: &str) -> Result<vigil::event::TimeSource, String> {
    use vigil::event::{FieldPath, TimeSource};
    match text {
        "ts" => Ok(TimeSource::Ts),
        "kafka" => Err("a replay reads no Kafka record: name the field of the event that holds the record timestamp (e.g. --time kafka_ts)".into()),
        _ => FieldPath::parse(text)
            .map(TimeSource::Field)
            .ok_or_else(|| format!("{text:?} is not a field path (e.g. ts or meta.received_at)")),
    }
}

/// A zipf exponent: a finite number, 0 or more.
#[cfg(feature = "harness")]
fn parse_skew(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(skew) if skew.is_finite() && skew >= 0.0 => Ok(skew),
        _ => Err(format!(
            "{text:?} is not a zipf exponent (a number, 0 or more, e.g. 0.8)"
        )),
    }
}

/// What `vigil gen` writes (its long help).
#[cfg(feature = "harness")]
const GEN_SCHEMA: &str = "\
Events (one JSON object per line; ts advances by 1000/--rate ms per event, from 2023-11-14T22:13:20Z):
  every event   event_id \"e-N\", ts (epoch ms), user_id \"u-N\", ip \"10.x.y.z\",
                device {id \"d-N\", os}, geo {country, city_id}, type
  login  (50 %) result: \"ok\" | \"fail\" | \"locked\"
  payment (40 %) result: \"approved\" | \"declined\", merchant_id \"m-N\", card {id \"c-N\", bin},
                amount (a decimal, 1.00 to 499.99)
  signup (10 %) email_domain
  Users mostly log in from their own address, one event in ten from a shared one (--ips of them);
  2 % of events are sent out of order (up to 5 s back) and 0.1 % two days late.
Injected bursts (--fraud; each event also carries \"fraud\": the pattern, and event_id \"f-N\"):
  credential_stuffing  30 failed logins from one IP (172.16.x.y) against as many accounts
  card_testing         12 small payments on one card, mostly declined
  account_takeover     8 successful logins to one account from 8 new devices
With --kafka, each event is produced keyed by its user_id.";

/// A duration, or none for `off`.
#[derive(Clone, Copy)]
struct Bound(Option<std::time::Duration>);

fn parse_bound(text: &str) -> Result<Bound, String> {
    vigil::config::parse_bound(text).map(Bound)
}

/// A bound that may be off but not zero (zero would refuse or pause everything, as in the config).
fn parse_nonzero_bound(text: &str) -> Result<Bound, String> {
    match parse_bound(text)? {
        Bound(Some(d)) if d.is_zero() => Err(vigil::config::ZERO_BOUND.into()),
        bound => Ok(bound),
    }
}

/// At least `min`, as the config's check of the same setting.
fn at_least(text: &str, min: usize, what: &str) -> Result<usize, String> {
    let value: usize = text.parse().map_err(|e| format!("{e}"))?;
    vigil::config::check_at_least(value as u64, min as u64, what)?;
    Ok(value)
}

/// A write-behind interval, within the config's range for it.
fn parse_flush_interval(text: &str) -> Result<std::time::Duration, String> {
    let interval = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    let (shortest, longest) = vigil::config::FLUSH_INTERVALS;
    vigil::config::check_within(interval, shortest, longest)?;
    Ok(interval)
}

fn parse_event_bytes(text: &str) -> Result<usize, String> {
    at_least(text, vigil::config::MIN_EVENT_BYTES, "bytes")
}

fn parse_state_bytes(text: &str) -> Result<usize, String> {
    let bytes = vigil::config::parse_byte_size(text)?;
    vigil::config::check_at_least(bytes as u64, vigil::config::MIN_STATE_BYTES as u64, "bytes")?;
    Ok(bytes)
}

fn parse_max_keys(text: &str) -> Result<usize, String> {
    at_least(text, 1, "windows")
}

/// As the config writes it (the help's default; read back by [`parse_bound`]).
impl std::fmt::Display for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(duration) => write!(f, "{}", humantime::format_duration(duration)),
            None => f.write_str("off"),
        }
    }
}

impl BoundArgs {
    /// Refuses a lateness bound one future event defeats (as `vigil run` refuses it).
    fn check(&self) -> Result<(), ExitCode> {
        if let (Some(lateness), Some(skew)) = (self.max_lateness.0, self.max_future_skew.0) {
            if lateness <= skew {
                eprintln!(
                    "error: --max-lateness {} must be longer than --max-future-skew {}: {}",
                    humantime::format_duration(lateness),
                    humantime::format_duration(skew),
                    vigil::config::LATENESS_WITHIN_SKEW
                );
                return Err(ExitCode::from(2));
            }
        }
        Ok(())
    }

    fn input_bounds(&self) -> cli::InputBounds {
        cli::InputBounds {
            bounds: self.time_bounds(),
            time: self.time.clone(),
            max_keys: self.max_keys,
            max_state_bytes: self.max_state_bytes,
        }
    }

    fn time_bounds(&self) -> vigil::event::TimeBounds {
        vigil::config::InputConfig {
            max_future_skew: self.max_future_skew.0,
            max_lateness: self.max_lateness.0,
            ..Default::default()
        }
        .time_bounds()
    }
}

/// The shape of a generated workload.
#[cfg(feature = "harness")]
#[derive(clap::Args)]
struct WorkloadArgs {
    /// Number of events.
    #[arg(long, default_value_t = WorkloadSpec::default().events, value_parser = clap::value_parser!(u64).range(1..))]
    events: u64,
    /// Number of distinct users (zipf-skewed).
    #[arg(long, default_value_t = WorkloadSpec::default().users, value_parser = clap::value_parser!(u64).range(1..))]
    users: u64,
    /// Zipf exponent of user and IP popularity (0: uniform).
    #[arg(long, default_value_t = WorkloadSpec::default().skew, value_parser = parse_skew)]
    skew: f64,
    /// Generator seed: the same seed gives the same events.
    #[arg(long, default_value_t = WorkloadSpec::default().seed)]
    seed: u64,
}

#[cfg(feature = "harness")]
impl WorkloadArgs {
    fn spec(&self) -> WorkloadSpec {
        WorkloadSpec {
            events: self.events,
            users: self.users.max(1),
            skew: self.skew,
            seed: self.seed,
            ..WorkloadSpec::default()
        }
    }
}

fn main() -> ExitCode {
    keep_freed_memory_a_while();
    small_pages_unless_asked();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Check {
            path,
            max_partition_skew,
            max_future_skew,
            events,
            strict,
        } => cli::check(
            &path,
            max_partition_skew.0,
            max_future_skew.0,
            events.as_deref(),
            strict,
        ),
        Command::Replay {
            rules,
            input,
            emit_allow,
            redis,
            redis_ca,
            input_id,
            redis_wait,
            replica_ack_timeout,
            redis_flush_interval,
            redis_allow_eviction,
            rejudge,
            max_event_bytes,
            max_bad_ratio,
            bounds,
        } => {
            if let Err(code) = bounds.check() {
                return code;
            }
            let redis = redis.map(|url| cli::ReplayRedis {
                url,
                tls_ca_file: redis_ca,
                input_id,
                replica_ack_timeout: replica_ack_timeout.0,
                flush_interval: redis_flush_interval,
                allow_eviction: redis_allow_eviction,
                rejudge,
            });
            let options = ReplayOptions {
                max_event_bytes,
                emit_allow,
                lane: 0,
                store_wait: redis_wait,
                ..ReplayOptions::default()
            };
            cli::replay(
                &rules,
                &input,
                redis,
                options,
                bounds.input_bounds(),
                max_bad_ratio,
            )
        }
        Command::Inspect {
            rules,
            redis,
            redis_ca,
            input,
            id,
            fields,
            at,
            json,
            bounds,
        } => {
            if let Err(code) = bounds.check() {
                return code;
            }
            let from = match (redis, input) {
                (Some(url), _) => cli::InspectFrom::Redis { url, ca: redis_ca },
                (None, Some(input)) => cli::InspectFrom::Input(input),
                (None, None) => unreachable!("clap requires --redis or --input"),
            };
            cli::inspect(&rules, from, &id, &fields, at, json, bounds.input_bounds())
        }
        Command::Hold {
            command:
                HoldCommand::Release {
                    rules,
                    redis,
                    redis_ca,
                    config,
                    brokers,
                    topic,
                    reason,
                    rule,
                    fields,
                },
        } => cli::hold_release(
            &rules,
            redis.map(|url| (url, redis_ca)),
            config.as_deref(),
            brokers.map(|b| (b, topic)),
            &rule,
            &fields,
            &reason,
        ),
        Command::Run { config } => cli::run(&config),
        #[cfg(feature = "harness")]
        Command::Gen {
            workload,
            rate,
            duration,
            ips,
            fraud,
            kafka,
            topic,
        } => {
            let events =
                duration.map_or(workload.events, |d| (d.as_secs_f64() * rate as f64) as u64);
            if events == 0 {
                eprintln!(
                    "error: --duration {} at --rate {rate} events/s gives no event",
                    humantime::format_duration(duration.unwrap_or_default())
                );
                return ExitCode::from(2);
            }
            let spec = WorkloadSpec {
                rate_per_sec: rate,
                events,
                ips,
                fraud,
                ..workload.spec()
            };
            cli::gen(spec, kafka.map(|brokers| (brokers, topic)))
        }
        Command::Backtest {
            rules,
            input,
            json,
            max_bad_ratio,
            label,
            sweep,
            compare,
            bounds,
        } => {
            if let Err(code) = bounds.check() {
                return code;
            }
            cli::backtest(
                &rules,
                &input,
                json,
                bounds.input_bounds(),
                max_bad_ratio,
                cli::Tuning {
                    label,
                    sweeps: &sweep,
                    compare: compare.as_deref(),
                },
            )
        }
        #[cfg(feature = "harness")]
        Command::Bench {
            rules,
            input,
            redis,
            kafka: Some(brokers),
            partitions,
            latency_seconds,
            latency_rate,
            workers,
            fraud,
            workload,
            ..
        } => cli::bench_kafka(vigil::harness::kafka_bench::KafkaBenchArgs {
            brokers,
            redis,
            rules_path: rules,
            input,
            workload: WorkloadSpec {
                fraud: fraud.clamp(0.0, 1.0),
                ..workload.spec()
            },
            partitions,
            latency_seconds,
            latency_rate,
            workers: usize::from(workers),
        }),
        #[cfg(feature = "harness")]
        Command::Bench {
            rules,
            input,
            redis,
            kafka: None,
            workload,
            compare_rules,
            rounds,
            ..
        } => cli::bench(cli::BenchArgs {
            rules,
            input,
            redis,
            workload: workload.spec(),
            compare_rules,
            rounds,
        }),
    };
    match result {
        Ok(code) => code,
        // A reader that stopped reading (`vigil … | head`) is a normal way to end.
        Err(e) if broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// Whether `error` comes from writing to a closed pipe.
fn broken_pipe(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
            || cause
                .downcast_ref::<serde_json::Error>()
                .is_some_and(|e| e.io_error_kind() == Some(std::io::ErrorKind::BrokenPipe))
    })
}

/// `--label FIELD`: a field path.
fn parse_label(text: &str) -> Result<vigil::event::FieldPath, String> {
    vigil::event::FieldPath::parse(text).ok_or_else(|| format!("{text:?} is not a field path"))
}

#[cfg(test)]
mod tests {
    use super::{MI_OPTION_ALLOW_THP, MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS};

    /// The option number is mimalloc's THP switch (on by default), and the process ends with
    /// transparent huge pages off.
    #[test]
    fn huge_pages_are_turned_off_for_the_process() {
        if std::env::var_os("MIMALLOC_ALLOW_THP").is_some() {
            return;
        }
        // SAFETY: reads and sets an option's value; PR_GET_THP_DISABLE reads a flag.
        unsafe {
            assert_eq!(libmimalloc_sys::mi_option_get(MI_OPTION_ALLOW_THP), 1);
            super::small_pages_unless_asked();
            assert_eq!(libmimalloc_sys::mi_option_get(MI_OPTION_ALLOW_THP), 0);
            #[cfg(target_os = "linux")]
            assert_eq!(libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0), 1);
        }
    }

    /// The option number is the purge delay's: its documented default until set, then ours.
    #[test]
    fn the_purge_delay_option_is_the_one_set() {
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
            return;
        }
        // SAFETY: reads and sets an option's value.
        unsafe {
            assert_eq!(libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY), 1000);
            super::keep_freed_memory_a_while();
            assert_eq!(
                libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY),
                PURGE_DELAY_MS
            );
        }
    }
}
