//! Configuration of `vigil run`: a TOML file over embedded defaults
//! (`src/config_defaults.toml`), then `VIGIL_<SECTION>_<KEY>` environment overrides. Strict:
//! unknown keys are errors, and every error names the key and where it came from
//! (`file:line:col` or the environment variable). Secrets are redacted in `Debug`.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::{Deserializer, Error as _};
use serde::Deserialize;

mod store_setup;

pub use store_setup::StoreSetup;

/// The defaults every config is merged over; also the reference of every key and its default.
pub const DEFAULTS: &str = include_str!("config_defaults.toml");

/// Prefix of environment overrides.
pub const ENV_PREFIX: &str = "VIGIL_";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub kafka: KafkaConfig,
    pub redis: RedisConfig,
    pub memory: MemoryConfig,
    pub rules: RulesConfig,
    pub input: InputConfig,
    pub http: HttpConfig,
    pub worker: WorkerConfig,
    pub log: LogConfig,
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// Bootstrap servers, `host:port[,host:port…]`. The one key without a default.
    pub brokers: String,
    /// Consumer group of the workers; partitions are shared among its members.
    pub group_id: String,
    /// Topics events are read from.
    pub input_topics: Vec<String>,
    /// Topic decision records are produced to, keyed by the event's Kafka key.
    pub decisions_topic: String,
    /// Topic bad events are produced to, with their original bytes and `vigil.*` headers.
    pub dead_letter_topic: String,
    /// How often librdkafka reports statistics (consumer lag per partition).
    #[serde(deserialize_with = "duration")]
    pub statistics_interval: Duration,
    /// Passed to librdkafka as given, for both consumer and producers (SASL, TLS, tuning).
    #[serde(deserialize_with = "properties")]
    pub properties: BTreeMap<String, String>,
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisConfig {
    /// `redis://[user:pass@]host:port[/db]` or `rediss://…`; absent: an in-process store, which
    /// is exact only while one worker owns every key.
    pub url: Option<String>,
    /// PEM file of the CA that signed a `rediss://` server's certificate.
    pub tls_ca_file: Option<PathBuf>,
    /// Pending deltas are written behind at least this often while other workers count into
    /// the same keys.
    #[serde(deserialize_with = "duration")]
    pub flush_interval: Duration,
    /// Pending deltas are written behind at least this often while no other worker counts (never
    /// more often than `flush_interval`): fewer, larger writes.
    #[serde(deserialize_with = "duration")]
    pub exclusive_flush_interval: Duration,
    /// A flush starts as soon as this many observations are pending.
    pub max_pending: usize,
    /// Most clean windows kept in the local read cache.
    pub cache_capacity: u64,
    /// A clean window unused this long leaves the local cache.
    #[serde(deserialize_with = "duration")]
    pub cache_time_to_idle: Duration,
    /// Attempts per write-behind flush before it counts as failed and Redis as unavailable
    /// (deltas are kept and sent again).
    pub retry_attempts: u32,
    /// First retry delay; doubles per attempt.
    #[serde(deserialize_with = "duration")]
    pub retry_backoff: Duration,
    /// The longest a connection attempt to Redis may take.
    #[serde(deserialize_with = "duration")]
    pub connect_timeout: Duration,
    /// The longest a Redis reply may take.
    #[serde(deserialize_with = "duration")]
    pub response_timeout: Duration,
    /// While Redis is unavailable (counting locally), how often it is tried again.
    #[serde(deserialize_with = "duration")]
    pub probe_interval: Duration,
    /// How long each flush waits (Redis `WAIT`) for a replica to confirm it has the flush's
    /// writes, on a master that has replicas. What no replica has confirmed yet is kept locally
    /// and written again if a failover promotes a replica that lacks it. A flush that is not
    /// confirmed in time is not held back: the next confirmation covers it. `"off"`: no
    /// confirmation, and after a failover every local view is written again instead (writes
    /// the old master had alone may then be lost on keys another worker wrote meanwhile).
    #[serde(deserialize_with = "bound")]
    pub replica_ack_timeout: Option<Duration>,
    /// Most keys counted locally and not yet written to Redis; beyond (a long outage) the
    /// partitions pause until Redis takes them.
    pub max_local_keys: usize,
    /// Start against a Redis whose `maxmemory-policy` may evict keys (anything but
    /// `noeviction`). An evicted counter key silently loses its count, so such a Redis is
    /// refused unless this is set; then the worker warns and `vigil_redis_eviction_allowed` is 1.
    pub allow_eviction: bool,
}

/// The in-process store, used when `redis.url` is absent; and the byte bound of a Redis worker's
/// local state.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryConfig {
    /// Most estimated bytes of in-process state (windows, keys, holds): `"1GiB"`, `"512MiB"` or
    /// a number of bytes. Beyond, the keys with the fewest events are evicted first (ties in a
    /// random order), and a value over a key that lost part of its window is a lower bound that
    /// each rule judges by its `on_store_error`. With Redis: half for the read cache, half for
    /// the windows Redis has not acknowledged (beyond, the partitions pause).
    #[serde(deserialize_with = "byte_size")]
    pub max_state_bytes: usize,
    /// Most (counter, key) windows kept, and most holds, whatever their bytes; evicted alike.
    pub max_keys: usize,
}

/// Fewest bytes `memory.max_state_bytes` may bound state to.
pub const MIN_STATE_BYTES: usize = 1 << 20;

/// A byte size: `"1GiB"`, `"512 MiB"`, `"1GB"` or a whole number of bytes.
pub fn parse_byte_size(text: &str) -> Result<usize, String> {
    let size: bytesize::ByteSize = text.trim().parse().map_err(|_| {
        format!("invalid size {text:?} (write e.g. \"1GiB\", \"512MiB\" or a number of bytes)")
    })?;
    Ok(usize::try_from(size.as_u64()).unwrap_or(usize::MAX))
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RulesConfig {
    /// A rule file or a directory of `*.toml` files; watched for changes.
    pub path: PathBuf,
    /// How often the rule files are checked for changes.
    #[serde(deserialize_with = "duration")]
    pub reload_interval: Duration,
    /// Accept a rule set without any `[[rule]]` (it judges nothing). Off by default, so that an
    /// emptied or truncated rule file is refused instead of silently disarming every rule.
    pub allow_empty: bool,
}

/// Bounds on event time (`"off"` disables one).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputConfig {
    /// Where event time comes from: `"ts"`, the event's `ts` field, which the producing service
    /// must stamp (never a client: whoever sets it can hide an event from every counter or blind
    /// a key for up to `max_future_skew`), or `"kafka"`, the record timestamp (set by the
    /// producer, or by the broker when the topic has `message.timestamp.type=LogAppendTime`).
    pub time: TimeConfig,
    /// An event whose `ts` is this much ahead of or behind its Kafka record timestamp is counted
    /// in `vigil_event_time_skew_total` (by direction): a clock to look at. `"off"` disables it.
    #[serde(deserialize_with = "bound")]
    pub record_time_skew: Option<Duration>,
    /// An event more than this far ahead of the wall clock is dead-lettered (`future_ts`): one
    /// event from a wrong clock cannot move a key's window into the future.
    #[serde(deserialize_with = "bound")]
    pub max_future_skew: Option<Duration>,
    /// Each partition's watermark is its newest accepted event time minus this; an older event is
    /// late for every counter. Also how long Redis keeps a key beyond its window.
    #[serde(deserialize_with = "bound")]
    pub max_lateness: Option<Duration>,
    /// No partition is processed more than this far ahead in event time of the slowest active
    /// partition of the consumer group (it waits, and is paused in the consumer): a counter whose
    /// key spans partitions then never sees one partition's events made late by another running
    /// ahead (after a restart, a rebalance or any backlog). `"off"` disables it.
    #[serde(deserialize_with = "bound")]
    pub max_partition_skew: Option<Duration>,
    /// A partition whose event time has not moved for this long (no events) holds nobody back.
    #[serde(deserialize_with = "duration")]
    pub partition_idle_timeout: Duration,
}

/// `input.time`: which clock stamps event time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TimeConfig {
    /// The event's `ts` field.
    Ts,
    /// The Kafka record timestamp.
    Kafka,
}

impl InputConfig {
    /// Where the worker's events take their time from.
    pub fn time_source(&self) -> crate::event::TimeSource {
        match self.time {
            TimeConfig::Ts => crate::event::TimeSource::Ts,
            TimeConfig::Kafka => crate::event::TimeSource::Record,
        }
    }

    /// `record_time_skew` in ms (`None`: off).
    pub fn record_time_skew_ms(&self) -> Option<i64> {
        self.record_time_skew
            .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
    }

    pub fn time_bounds(&self) -> crate::event::TimeBounds {
        let ms = |d: Option<Duration>| d.map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        crate::event::TimeBounds {
            max_future_skew_ms: ms(self.max_future_skew),
            max_lateness_ms: ms(self.max_lateness),
        }
    }
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// Address of `/metrics`, `/healthz`, `/readyz` and the `/v1` lookups.
    pub listen: SocketAddr,
    /// The bearer token of the write endpoints (`DELETE /v1/rules/{id}/hold`); empty: every
    /// write endpoint answers 403. Set it from the environment (`VIGIL_HTTP_ADMIN_TOKEN`) rather
    /// than in the file.
    pub admin_token: String,
}

impl fmt::Debug for HttpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpConfig")
            .field("listen", &self.listen)
            .field(
                "admin_token",
                &if self.admin_token.is_empty() {
                    ""
                } else {
                    "***"
                },
            )
            .finish()
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// Also produce a record (action `allow`) for events without any hit.
    pub emit_allow: bool,
    /// Larger events are dead-lettered (`too_large`) without being parsed.
    pub max_event_bytes: usize,
    /// On SIGTERM/SIGINT: the most time flushing, delivering and committing may take.
    #[serde(deserialize_with = "duration")]
    pub shutdown_timeout: Duration,
    /// How often stored offsets are committed to the group.
    #[serde(deserialize_with = "duration")]
    pub commit_interval: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// `text` for people, `json` for log pipelines.
    pub format: LogFormat,
    /// A tracing filter (`info`, `vigil=debug,rdkafka=warn`); `RUST_LOG` wins when set.
    pub level: String,
}

/// A configuration that cannot be used. Each names the key and where the bad value came from.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    /// Not TOML at all.
    #[error("{location}: {message}")]
    Syntax { location: String, message: String },
    /// A key that is unknown, missing or has a bad value.
    #[error("{location}: `{key}`: {message}")]
    Invalid {
        location: String,
        key: String,
        message: String,
    },
}

impl ConfigError {
    pub fn code(&self) -> &'static str {
        match self {
            ConfigError::Io { .. } => "io",
            ConfigError::Syntax { .. } => "syntax",
            ConfigError::Invalid { .. } => "invalid",
        }
    }
}

impl Config {
    /// Reads `path` and applies the `VIGIL_*` variables of the process environment.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: name.clone(),
            source,
        })?;
        Config::parse(&name, &text, std::env::vars())
    }

    /// Parses `text` (called `name` in errors) over the defaults, then applies `env` overrides.
    pub fn parse(
        name: &str,
        text: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let mut merged: toml::Table =
            toml::from_str(DEFAULTS).expect("the embedded defaults are valid TOML");
        let defaults = merged.clone();
        let file: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Syntax {
            location: e
                .span()
                .map_or_else(|| name.to_owned(), |s| position(name, text, s.start)),
            message: e.message().to_owned(),
        })?;
        merge(&mut merged, file);
        let mut from_env: BTreeMap<String, String> = BTreeMap::new();
        let mut env: Vec<(String, String)> = env
            .into_iter()
            .filter(|(k, _)| k.starts_with(ENV_PREFIX))
            .collect();
        env.sort();
        for (var, raw) in env {
            let key = apply_env(&mut merged, &defaults, &var, &raw)?;
            from_env.insert(key, var);
        }
        let invalid = |key: String, message: String| {
            let location = from_env
                .iter()
                .find(|(k, _)| key == **k || key.starts_with(&format!("{k}.")))
                .map(|(_, var)| var.clone())
                .unwrap_or_else(|| locate(name, text, &key));
            ConfigError::Invalid {
                location,
                key,
                message,
            }
        };
        let config: Config = serde_path_to_error::deserialize(toml::Value::Table(merged))
            .map_err(|e| invalid(e.path().to_string(), e.inner().message().to_owned()))?;
        config
            .check()
            .map_err(|(key, message)| invalid(key.to_owned(), message))?;
        Ok(config)
    }

    /// Refuses values that parse but would disarm the worker or make it misbehave: a zero
    /// interval, timeout or bound, no attempts, a duration no one means (and that would
    /// overflow the clock), a lateness bound one future event defeats. The first such key and
    /// why.
    fn check(&self) -> Result<(), (&'static str, String)> {
        const DAY: Duration = Duration::from_secs(86_400);
        const MAX_WINDOW: Duration = Duration::from_secs(400 * 86_400);
        let within = |key: &'static str, value: Duration, min: Duration, max: Duration| {
            check_within(value, min, max).map_err(|message| (key, message))
        };
        let bounded = |key: &'static str, value: Option<Duration>, max: Duration| match value {
            Some(value) if value.is_zero() => Err((key, ZERO_BOUND.to_owned())),
            Some(value) => within(key, value, Duration::from_millis(1), max),
            None => Ok(()),
        };
        let at_least = |key: &'static str, value: u64, min: u64, what: &str| {
            check_at_least(value, min, what).map_err(|message| (key, message))
        };
        let ms = Duration::from_millis;
        let (redis, input, worker) = (&self.redis, &self.input, &self.worker);
        within(
            "kafka.statistics_interval",
            self.kafka.statistics_interval,
            ms(1),
            DAY,
        )?;
        let (shortest, longest) = FLUSH_INTERVALS;
        within(
            "redis.flush_interval",
            redis.flush_interval,
            shortest,
            longest,
        )?;
        within(
            "redis.exclusive_flush_interval",
            redis.exclusive_flush_interval,
            shortest,
            longest,
        )?;
        at_least(
            "redis.max_pending",
            redis.max_pending as u64,
            1,
            "observations",
        )?;
        at_least("redis.cache_capacity", redis.cache_capacity, 1, "windows")?;
        within(
            "redis.cache_time_to_idle",
            redis.cache_time_to_idle,
            ms(1),
            DAY,
        )?;
        at_least(
            "redis.retry_attempts",
            u64::from(redis.retry_attempts),
            1,
            "attempts",
        )?;
        within(
            "redis.retry_backoff",
            redis.retry_backoff,
            Duration::ZERO,
            Duration::from_secs(60),
        )?;
        within(
            "redis.connect_timeout",
            redis.connect_timeout,
            ms(1),
            Duration::from_secs(600),
        )?;
        within(
            "redis.response_timeout",
            redis.response_timeout,
            ms(1),
            Duration::from_secs(600),
        )?;
        within(
            "redis.probe_interval",
            redis.probe_interval,
            ms(1),
            Duration::from_secs(600),
        )?;
        bounded(
            "redis.replica_ack_timeout",
            redis.replica_ack_timeout,
            Duration::from_secs(60),
        )?;
        at_least(
            "redis.max_local_keys",
            redis.max_local_keys as u64,
            1,
            "keys",
        )?;
        at_least("memory.max_keys", self.memory.max_keys as u64, 1, "windows")?;
        at_least(
            "memory.max_state_bytes",
            self.memory.max_state_bytes as u64,
            MIN_STATE_BYTES as u64,
            "bytes",
        )?;
        within(
            "rules.reload_interval",
            self.rules.reload_interval,
            ms(1),
            DAY,
        )?;
        bounded("input.max_future_skew", input.max_future_skew, MAX_WINDOW)?;
        bounded("input.max_lateness", input.max_lateness, MAX_WINDOW)?;
        bounded("input.max_partition_skew", input.max_partition_skew, DAY)?;
        bounded("input.record_time_skew", input.record_time_skew, MAX_WINDOW)?;
        within(
            "input.partition_idle_timeout",
            input.partition_idle_timeout,
            ms(1),
            DAY,
        )?;
        if let (Some(lateness), Some(skew)) = (input.max_lateness, input.max_future_skew) {
            if lateness <= skew {
                return Err((
                    "input.max_lateness",
                    format!(
                        "{} must be longer than input.max_future_skew ({}): {LATENESS_WITHIN_SKEW}",
                        humantime::format_duration(lateness),
                        humantime::format_duration(skew)
                    ),
                ));
            }
        }
        at_least(
            "worker.max_event_bytes",
            worker.max_event_bytes as u64,
            MIN_EVENT_BYTES as u64,
            "bytes",
        )?;
        within(
            "worker.shutdown_timeout",
            worker.shutdown_timeout,
            ms(1),
            Duration::from_secs(3_600),
        )?;
        within(
            "worker.commit_interval",
            worker.commit_interval,
            ms(1),
            Duration::from_secs(3_600),
        )?;
        Ok(())
    }

    /// The Redis store settings of this config.
    pub fn redis_store(&self) -> crate::store::RedisStoreConfig {
        let mut config = self
            .redis
            .store_config(self.input.time_bounds().max_lateness_ms);
        config.max_state_bytes = self.memory.max_state_bytes;
        config
    }

    /// What `vigil run` opens: this config's store and, with Redis, the journal of its consumer
    /// group.
    pub fn store_setup(&self) -> StoreSetup {
        StoreSetup {
            redis: self.redis.clone(),
            max_keys: self.memory.max_keys,
            max_state_bytes: self.memory.max_state_bytes,
            max_lateness_ms: self.input.time_bounds().max_lateness_ms,
            journal_namespace: Some(self.kafka.group_id.clone()),
        }
    }
}

/// Why a zero bound is refused (here and for the CLI's flags).
pub const ZERO_BOUND: &str =
    "0 would refuse or pause everything: write \"off\" to disable the bound";

/// Why a lateness bound not longer than the future bound is refused (here and for the CLI's).
pub const LATENESS_WITHIN_SKEW: &str =
    "one event stamped that far ahead would make every event on time late";

/// The smallest `worker.max_event_bytes` (and `--max-event-bytes`): below, every event is too large.
pub const MIN_EVENT_BYTES: usize = 64;

/// `value` is at least `min` (of `what`), or why not.
pub fn check_at_least(value: u64, min: u64, what: &str) -> Result<(), String> {
    if value < min {
        return Err(format!(
            "{value} is too small: must be at least {min} ({what})"
        ));
    }
    Ok(())
}

/// The shortest and the longest write-behind interval accepted.
pub const FLUSH_INTERVALS: (Duration, Duration) =
    (Duration::from_millis(1), Duration::from_secs(60));

/// `value` within `min..=max`, or why not (as every duration setting says it).
pub fn check_within(value: Duration, min: Duration, max: Duration) -> Result<(), String> {
    if value < min || value > max {
        return Err(format!(
            "{} is out of range: must be from {} to {}",
            humantime::format_duration(value),
            humantime::format_duration(min),
            humantime::format_duration(max)
        ));
    }
    Ok(())
}

impl RedisConfig {
    /// The Redis store settings of this section; `max_lateness_ms` is the input's lateness bound
    /// (keys live that long past their window).
    pub fn store_config(&self, max_lateness_ms: Option<i64>) -> crate::store::RedisStoreConfig {
        crate::store::RedisStoreConfig {
            flush_interval: self.flush_interval,
            exclusive_flush_interval: self.exclusive_flush_interval,
            max_pending: self.max_pending,
            attempts: self.retry_attempts,
            retry_backoff: self.retry_backoff,
            connect_timeout: self.connect_timeout,
            response_timeout: self.response_timeout,
            probe_interval: self.probe_interval,
            replica_ack_timeout: self.replica_ack_timeout,
            max_local_keys: self.max_local_keys,
            cache_capacity: self.cache_capacity,
            cache_time_to_idle: self.cache_time_to_idle,
            // `memory.max_state_bytes` bounds every command's local state; the callers that read
            // it set it (`Config::redis_store`, `StoreSetup::open`).
            max_state_bytes: MemoryConfig::default().max_state_bytes,
            tls_ca_file: self.tls_ca_file.clone(),
            max_lateness: max_lateness_ms,
            allow_eviction: self.allow_eviction,
            ..crate::store::RedisStoreConfig::default()
        }
    }
}

/// One section of the embedded defaults. The commands that share a setting with `vigil run`
/// (`replay`, `backtest`, `bench`) take their defaults from here, so each default is written once,
/// in `config_defaults.toml`.
fn default_section<T: serde::de::DeserializeOwned>(section: &str) -> T {
    let mut defaults: toml::Table =
        toml::from_str(DEFAULTS).expect("the embedded defaults are valid TOML");
    let table = defaults
        .remove(section)
        .expect("the embedded defaults have every section but kafka's");
    table.try_into().expect("the embedded defaults are valid")
}

impl KafkaConfig {
    /// The embedded defaults with these brokers: for the commands other than `run` that write to
    /// Kafka (`hold release --brokers`).
    pub fn for_brokers(brokers: &str) -> KafkaConfig {
        let mut defaults: toml::Table =
            toml::from_str(DEFAULTS).expect("the embedded defaults are valid TOML");
        let mut table = match defaults.remove("kafka") {
            Some(toml::Value::Table(table)) => table,
            _ => toml::Table::new(),
        };
        table.insert("brokers".into(), toml::Value::String(brokers.to_owned()));
        table.try_into().expect("the embedded defaults are valid")
    }
}

impl Default for RedisConfig {
    fn default() -> Self {
        default_section("redis")
    }
}

impl Default for MemoryConfig {
    fn default() -> Self {
        default_section("memory")
    }
}

impl Default for RulesConfig {
    fn default() -> Self {
        default_section("rules")
    }
}

impl Default for InputConfig {
    fn default() -> Self {
        default_section("input")
    }
}

impl Default for WorkerConfig {
    fn default() -> Self {
        default_section("worker")
    }
}

/// Deep-merges `over` into `base`: tables merge key by key, anything else replaces.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (key, value) in over {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(base)), toml::Value::Table(over)) => merge(base, over),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

/// Applies `VIGIL_<SECTION>_<KEY>=raw`; returns the dotted key it set. `VIGIL_KAFKA_PROPERTIES_X_Y`
/// sets the librdkafka property `x.y`. The value is typed like the key's default: strings stay
/// strings, lists may be comma-separated, anything else is read as a TOML value.
fn apply_env(
    merged: &mut toml::Table,
    defaults: &toml::Table,
    var: &str,
    raw: &str,
) -> Result<String, ConfigError> {
    let rest = var[ENV_PREFIX.len()..].to_ascii_lowercase();
    let invalid = |key: &str, message: String| ConfigError::Invalid {
        location: var.to_owned(),
        key: key.to_owned(),
        message,
    };
    let Some((section, key)) = rest.split_once('_') else {
        return Err(invalid(&rest, "expected VIGIL_<SECTION>_<KEY>".into()));
    };
    let Some(toml::Value::Table(section_defaults)) = defaults.get(section) else {
        let sections: Vec<&str> = defaults.keys().map(String::as_str).collect();
        return Err(invalid(
            section,
            format!("unknown section, expected one of {}", sections.join(", ")),
        ));
    };
    let table = match merged.get_mut(section) {
        Some(toml::Value::Table(table)) => table,
        _ => return Err(invalid(section, "is not a table".into())),
    };
    if section == "kafka" {
        if let Some(property) = key.strip_prefix("properties_") {
            let property = property.replace('_', ".");
            let dotted = format!("kafka.properties.{property}");
            match table
                .entry("properties")
                .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            {
                toml::Value::Table(properties) => {
                    properties.insert(property, toml::Value::String(raw.to_owned()));
                }
                _ => return Err(invalid("kafka.properties", "is not a table".into())),
            }
            return Ok(dotted);
        }
    }
    let value = match section_defaults.get(key) {
        Some(toml::Value::Array(_)) if !raw.trim_start().starts_with('[') => toml::Value::Array(
            raw.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| toml::Value::String(s.to_owned()))
                .collect(),
        ),
        Some(toml::Value::String(_)) | None => toml::Value::String(raw.to_owned()),
        Some(_) => toml::from_str::<toml::Table>(&format!("v = {raw}"))
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or_else(|| toml::Value::String(raw.to_owned())),
    };
    table.insert(key.to_owned(), value);
    Ok(format!("{section}.{key}"))
}

/// `name:line:col` of byte `offset` in `text` (1-based; columns count characters).
fn position(name: &str, text: &str, offset: usize) -> String {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    format!("{name}:{line}:{column}")
}

/// Where `key` (dotted) is written in the file: the key itself, or the deepest table of its
/// path that the file has; just the file name if the file says nothing about it.
fn locate(name: &str, text: &str, key: &str) -> String {
    let Ok(doc) = text.parse::<toml_edit::Document<String>>() else {
        return name.to_owned();
    };
    let mut table: &dyn toml_edit::TableLike = doc.as_table();
    let mut found = None;
    for segment in key.split('.') {
        let Some((k, item)) = table.get_key_value(segment) else {
            break;
        };
        found = k.span().map(|s| s.start).or(found);
        match item.as_table_like() {
            Some(inner) => table = inner,
            None => {
                found = k
                    .span()
                    .map(|s| s.start)
                    .or_else(|| item.span().map(|s| s.start))
                    .or(found);
                break;
            }
        }
    }
    found.map_or_else(|| name.to_owned(), |offset| position(name, text, offset))
}

fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    humantime::parse_duration(&text).map_err(|e| {
        D::Error::custom(format!(
            "invalid duration {text:?}: {e} (write e.g. \"50ms\", \"2s\", \"10m\")"
        ))
    })
}

fn byte_size<'de, D: Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Bytes(u64),
        Text(String),
    }
    match Size::deserialize(d)? {
        Size::Bytes(n) => Ok(usize::try_from(n).unwrap_or(usize::MAX)),
        Size::Text(text) => parse_byte_size(&text).map_err(D::Error::custom),
    }
}

/// A time bound: a duration, or `"off"` for none.
pub fn parse_bound(text: &str) -> Result<Option<Duration>, String> {
    if text == "off" {
        return Ok(None);
    }
    humantime::parse_duration(text).map(Some).map_err(|e| {
        format!("invalid duration {text:?}: {e} (write e.g. \"5m\", \"1h\", or \"off\")")
    })
}

fn bound<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    parse_bound(&String::deserialize(d)?).map_err(D::Error::custom)
}

/// librdkafka properties are strings; TOML numbers and booleans are accepted and written out.
fn properties<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, String>, D::Error> {
    let table = BTreeMap::<String, toml::Value>::deserialize(d)?;
    table
        .into_iter()
        .map(|(k, v)| match v {
            toml::Value::String(s) => Ok((k, s)),
            toml::Value::Integer(i) => Ok((k, i.to_string())),
            toml::Value::Boolean(b) => Ok((k, b.to_string())),
            toml::Value::Float(f) => Ok((k, f.to_string())),
            other => Err(D::Error::custom(format!(
                "property `{k}` must be a string, number or boolean, not {}",
                other.type_str()
            ))),
        })
        .collect()
}

/// Whether a librdkafka property holds a secret, so it is never printed: a name with a secret's
/// word in it, or any `sasl.*` name but the few known to hold none, so that a mistyped secret
/// (`sasl.pasword`) is hidden too.
fn is_secret(property: &str) -> bool {
    const SASL_SHOWN: [&str; 4] = [
        "sasl.mechanism",
        "sasl.mechanisms",
        "sasl.username",
        "sasl.kerberos.service.name",
    ];
    [
        "pass",
        "secret",
        "key",
        "token",
        "cred",
        "jaas",
        "sasl.oauthbearer.config",
    ]
    .iter()
    .any(|s| property.contains(s))
        || (property.starts_with("sasl.") && !SASL_SHOWN.contains(&property))
}

/// `scheme://user:***@host…`: a URL with its password hidden.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{}{user}:***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_owned(),
    }
}

impl fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let properties: BTreeMap<&str, &str> = self
            .properties
            .iter()
            .map(|(k, v)| (k.as_str(), if is_secret(k) { "***" } else { v.as_str() }))
            .collect();
        f.debug_struct("KafkaConfig")
            .field("brokers", &self.brokers)
            .field("group_id", &self.group_id)
            .field("input_topics", &self.input_topics)
            .field("decisions_topic", &self.decisions_topic)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .field("statistics_interval", &self.statistics_interval)
            .field("properties", &properties)
            .finish()
    }
}

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &self.url.as_deref().map(redact_url))
            .field("tls_ca_file", &self.tls_ca_file)
            .field("flush_interval", &self.flush_interval)
            .field("exclusive_flush_interval", &self.exclusive_flush_interval)
            .field("max_pending", &self.max_pending)
            .field("cache_capacity", &self.cache_capacity)
            .field("cache_time_to_idle", &self.cache_time_to_idle)
            .field("retry_attempts", &self.retry_attempts)
            .field("retry_backoff", &self.retry_backoff)
            .field("connect_timeout", &self.connect_timeout)
            .field("response_timeout", &self.response_timeout)
            .field("probe_interval", &self.probe_interval)
            .field("replica_ack_timeout", &self.replica_ack_timeout)
            .field("max_local_keys", &self.max_local_keys)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str, env: &[(&str, &str)]) -> Result<Config, String> {
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
        Config::parse("vigil.toml", text, env).map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_fill_everything_but_brokers() {
        let config = parse("[kafka]\nbrokers = \"k:9092\"\n", &[]).unwrap();
        assert_eq!(config.kafka.group_id, "vigil");
        assert_eq!(config.kafka.input_topics, ["events"]);
        assert_eq!(config.redis.flush_interval, Duration::from_millis(50));
        assert_eq!(
            config.redis.exclusive_flush_interval,
            Duration::from_secs(1)
        );
        assert_eq!(config.redis.max_pending, 200_000);
        assert_eq!(config.redis.url, None);
        assert_eq!(config.http.listen, "127.0.0.1:9464".parse().unwrap());
        assert_eq!(config.worker.max_event_bytes, 1 << 20);
        assert_eq!(
            config.input.time_bounds(),
            crate::event::TimeBounds::default()
        );
        assert_eq!(
            parse("", &[]).unwrap_err(),
            "vigil.toml: `kafka`: missing field `brokers`"
        );
    }

    /// The code's own defaults (for callers without a config: library users, tests) agree with
    /// `config_defaults.toml`, where each default is written: this fails if they drift.
    #[test]
    fn code_defaults_agree_with_the_embedded_defaults() {
        let input = InputConfig::default();
        assert_eq!(input.time_bounds(), crate::event::TimeBounds::default());
        let redis = RedisConfig::default().store_config(input.time_bounds().max_lateness_ms);
        assert_eq!(
            format!("{redis:?}"),
            format!("{:?}", crate::store::RedisStoreConfig::default())
        );
        assert_eq!(
            MemoryConfig::default().max_keys,
            crate::store::DEFAULT_MAX_KEYS
        );
        let max_event_bytes = WorkerConfig::default().max_event_bytes;
        assert_eq!(max_event_bytes, crate::pipeline::DEFAULT_MAX_EVENT_BYTES);
        assert_eq!(
            crate::pipeline::ReplayOptions::default().max_event_bytes,
            max_event_bytes
        );
        // A section's defaults are the config's when the file says nothing about it.
        let config = parse("[kafka]\nbrokers = \"k\"\n", &[]).unwrap();
        assert_eq!(
            format!("{:?}", config.redis),
            format!("{:?}", RedisConfig::default())
        );
        assert_eq!(config.rules.path, RulesConfig::default().path);
    }

    #[test]
    fn errors_name_the_key_and_its_line() {
        let text = "[kafka]\nbrokers = \"k:9092\"\n\n[redis]\nflush_interval = \"fast\"\n";
        assert_eq!(
            parse(text, &[]).unwrap_err(),
            "vigil.toml:5:1: `redis.flush_interval`: invalid duration \"fast\": expected number at 0 \
             (write e.g. \"50ms\", \"2s\", \"10m\")"
        );
        let text = "[kafka]\nbrokers = \"k:9092\"\ngroup = \"x\"\n";
        let error = parse(text, &[]).unwrap_err();
        assert!(
            error.starts_with(
                "vigil.toml:3:1: `kafka.group`: unknown field `group`, expected one of"
            ),
            "{error}"
        );
        let error = parse(
            "[kafka]\nbrokers = \"k\"\n[worker]\nmax_event_bytes = \"big\"\n",
            &[],
        )
        .unwrap_err();
        assert!(
            error.starts_with(
                "vigil.toml:4:1: `worker.max_event_bytes`: invalid type: string \"big\""
            ),
            "{error}"
        );
        assert_eq!(
            parse("[kafka\n", &[]).unwrap_err().split(": ").next(),
            Some("vigil.toml:1:7")
        );
    }

    #[test]
    fn environment_overrides_the_file() {
        let env = [
            ("VIGIL_KAFKA_BROKERS", "a:1,b:2"),
            ("VIGIL_KAFKA_GROUP_ID", "123"),
            ("VIGIL_KAFKA_INPUT_TOPICS", "x, y"),
            ("VIGIL_REDIS_MAX_PENDING", "5"),
            ("VIGIL_WORKER_EMIT_ALLOW", "true"),
            ("VIGIL_KAFKA_PROPERTIES_SASL_PASSWORD", "hunter2"),
            ("OTHER", "ignored"),
        ];
        let config = parse("[kafka]\nbrokers = \"k:9092\"\n", &env).unwrap();
        assert_eq!(config.kafka.brokers, "a:1,b:2");
        assert_eq!(config.kafka.group_id, "123");
        assert_eq!(config.kafka.input_topics, ["x", "y"]);
        assert_eq!(config.redis.max_pending, 5);
        assert!(config.worker.emit_allow);
        assert_eq!(config.kafka.properties["sasl.password"], "hunter2");
        assert!(!format!("{config:?}").contains("hunter2"));
        assert_eq!(
            parse("[kafka]\nbrokers = \"k\"\n", &[("VIGIL_REDIS_MAX_PENDING", "many")]).unwrap_err(),
            "VIGIL_REDIS_MAX_PENDING: `redis.max_pending`: invalid type: string \"many\", expected usize"
        );
        assert!(
            parse("[kafka]\nbrokers = \"k\"\n", &[("VIGIL_QUEUE_SIZE", "1")])
                .unwrap_err()
                .starts_with("VIGIL_QUEUE_SIZE: `queue`: unknown section")
        );
        let error =
            parse("[kafka]\nbrokers = \"k\"\n", &[("VIGIL_REDIS_FLUSH", "1s")]).unwrap_err();
        assert!(
            error.starts_with("VIGIL_REDIS_FLUSH: `redis.flush`: unknown field `flush`"),
            "{error}"
        );
    }

    #[test]
    fn time_bounds_take_durations_or_off() {
        let text = "[kafka]\nbrokers = \"k\"\n[input]\nmax_future_skew = \"off\"\nmax_lateness = \"90s\"\n";
        let bounds = parse(text, &[]).unwrap().input.time_bounds();
        assert_eq!(
            bounds,
            crate::event::TimeBounds {
                max_future_skew_ms: None,
                max_lateness_ms: Some(90_000)
            }
        );
        let bounds = parse(
            "[kafka]\nbrokers = \"k\"\n",
            &[("VIGIL_INPUT_MAX_LATENESS", "off")],
        )
        .unwrap()
        .input
        .time_bounds();
        assert_eq!(bounds.max_lateness_ms, None);
        assert_eq!(
            parse("[kafka]\nbrokers = \"k\"\n[input]\nmax_lateness = \"never\"\n", &[]).unwrap_err(),
            "vigil.toml:4:1: `input.max_lateness`: invalid duration \"never\": expected number at 0 \
             (write e.g. \"5m\", \"1h\", or \"off\")"
        );
    }

    #[test]
    fn secrets_are_redacted() {
        let config = parse(
            "[kafka]\nbrokers = \"k\"\n[kafka.properties]\n\"sasl.password\" = \"pw1\"\n\"ssl.key.password\" = \"pw2\"\n\
             \"linger.ms\" = 5\n\"sasl.pasword\" = \"pw4\"\n\"sasl.mechanism\" = \"SCRAM-SHA-256\"\n\"sasl.username\" = \"app\"\n\
             \"ssl.ca.location\" = \"/ca.pem\"\n[redis]\nurl = \"redis://app:pw3@r:6379/0\"\n",
            &[("VIGIL_KAFKA_PROPERTIES_SASL_OAUTHBEARER_CLIENT_SECRET", "pw5"), ("VIGIL_KAFKA_PROPERTIES_SASL_JAAS_CONFIG", "pw6")],
        )
        .unwrap();
        let shown = format!("{config:?}");
        for secret in ["pw1", "pw2", "pw3", "pw4", "pw5", "pw6"] {
            assert!(!shown.contains(secret), "{shown}");
        }
        assert!(
            shown.contains("redis://app:***@r:6379/0") && shown.contains("\"linger.ms\": \"5\""),
            "{shown}"
        );
        // What tells which account and which CA are used stays readable.
        for shown_value in [
            "\"sasl.mechanism\": \"SCRAM-SHA-256\"",
            "\"sasl.username\": \"app\"",
            "\"ssl.ca.location\": \"/ca.pem\"",
        ] {
            assert!(shown.contains(shown_value), "{shown}");
        }
    }

    /// Every key of every section, as `section.key`: the defaults plus the keys without one.
    fn every_key() -> Vec<String> {
        let defaults: toml::Table = toml::from_str(DEFAULTS).unwrap();
        let mut keys: Vec<String> = ["kafka.brokers", "redis.url", "redis.tls_ca_file"]
            .map(String::from)
            .to_vec();
        for (section, table) in &defaults {
            for key in table.as_table().unwrap().keys() {
                keys.push(format!("{section}.{key}"));
            }
        }
        keys
    }

    #[test]
    fn every_key_is_documented_in_the_configuration_reference() {
        let doc = include_str!("../docs/configuration.md");
        let mut section = "";
        let mut documented = Vec::new();
        for line in doc.lines() {
            if let Some(name) = line
                .strip_prefix("## `[")
                .and_then(|l| l.strip_suffix("]`"))
            {
                section = name;
            } else if let Some(key) = line.strip_prefix("| `").and_then(|l| l.split('`').next()) {
                documented.push(format!("{section}.{key}"));
            }
        }
        for key in every_key() {
            assert!(
                documented.contains(&key),
                "`{key}` is not in docs/configuration.md"
            );
        }
        // And every documented key exists: the config accepts it.
        for key in &documented {
            assert!(
                every_key().contains(key),
                "docs/configuration.md documents `{key}`, which is not a config key"
            );
        }
    }

    #[test]
    fn every_key_without_a_default_is_accepted() {
        let text =
            "[kafka]\nbrokers = \"k\"\n[redis]\nurl = \"redis://r/\"\ntls_ca_file = \"/ca.pem\"\n";
        let config = parse(text, &[]).unwrap();
        assert_eq!(
            config.redis.tls_ca_file.as_deref(),
            Some(Path::new("/ca.pem"))
        );
    }

    #[test]
    fn the_shipped_example_parses() {
        let text = include_str!("../deploy/config/vigil.toml");
        parse(text, &[]).unwrap();
    }
}
