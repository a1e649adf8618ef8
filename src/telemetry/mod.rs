//! Telemetry: every metric of the worker in one struct ([`Metrics`]), served as Prometheus text
//! by [`http`], and log setup. Labels are low-cardinality: rule ids, actions, modes, reason and
//! error codes, topics and partitions — never event data.

pub mod http;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::config::{LogConfig, LogFormat};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// `decided` (a record with hits), `allowed` (no hit), `dead_lettered`.
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabels {
    pub action: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RuleHitLabels {
    pub rule: String,
    pub mode: &'static str,
    pub action: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RuleLabels {
    pub rule: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabels {
    pub code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PartitionLabels {
    pub topic: String,
    pub partition: i32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

/// Every metric `vigil run` exports.
pub struct Metrics {
    registry: Registry,
    /// Events read, by outcome.
    pub events: Family<OutcomeLabels, Counter>,
    /// Decision records produced, by action (`allow` for shadow-only hits and `emit_allow`).
    pub decisions: Family<ActionLabels, Counter>,
    /// Rule hits, by rule, mode and action.
    pub rule_hits: Family<RuleHitLabels, Counter>,
    /// Events whose bucket had slid out of the key's window, by rule (DESIGN §3.1).
    pub late_events: Family<RuleLabels, Counter>,
    /// Events not counted for a rule because a dimension or the aggregated field was unusable.
    pub skipped_events: Family<RuleLabels, Counter>,
    /// Events sent to the dead-letter topic, by reason.
    pub dead_letters: Family<ReasonLabels, Counter>,
    /// Keys per acknowledged write-behind flush.
    pub flush_keys: Histogram,
    /// Time from sending a flush to Redis acknowledging it.
    pub flush_seconds: Histogram,
    /// Redis failures, by code (`retry`: an attempt that was retried; `flush_failed`: a flush that
    /// failed every attempt and is sent again; `read_failed`: a window load that failed).
    pub redis_errors: Family<CodeLabels, Counter>,
    /// Observations judged but not counted again: their key had recorded their offset (input
    /// replayed after a crash or a rebalance; DESIGN §6).
    pub replayed_observations: Counter,
    /// Keys whose write-behind writes met a version another worker had moved on; their deltas
    /// were merged by the next flush.
    pub stale_writes: Counter,
    /// Kafka produce failures, by code; the record is produced again.
    pub delivery_errors: Family<CodeLabels, Counter>,
    /// Consumer lag per assigned partition, from librdkafka statistics.
    pub consumer_lag: Family<PartitionLabels, Gauge>,
    /// Offset committed last per partition (the next offset to read).
    pub committed_offset: Family<PartitionLabels, Gauge>,
    /// From the event's Kafka timestamp to its decision being acknowledged by the broker.
    pub decision_latency: Histogram,
    /// Rule reloads, by result (`ok`, `error`).
    pub rule_reloads: Family<ResultLabels, Counter>,
    /// Enabled rules in force.
    pub rules_active: Gauge,
    /// (rule, key) windows held in this process.
    pub live_keys: Gauge,
    /// Partitions this worker owns.
    pub assigned_partitions: Gauge,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("vigil");
        let metrics = Metrics {
            events: Family::default(),
            decisions: Family::default(),
            rule_hits: Family::default(),
            late_events: Family::default(),
            skipped_events: Family::default(),
            dead_letters: Family::default(),
            flush_keys: Histogram::new(exponential_buckets(1.0, 2.0, 14)),
            flush_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 16)),
            redis_errors: Family::default(),
            replayed_observations: Counter::default(),
            stale_writes: Counter::default(),
            delivery_errors: Family::default(),
            consumer_lag: Family::default(),
            committed_offset: Family::default(),
            decision_latency: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            rule_reloads: Family::default(),
            rules_active: Gauge::default(),
            live_keys: Gauge::default(),
            assigned_partitions: Gauge::default(),
            registry: Registry::default(),
        };
        registry.register("events", "Events read, by outcome", metrics.events.clone());
        registry.register("decisions", "Decision records produced, by action", metrics.decisions.clone());
        registry.register("rule_hits", "Rule hits, by rule, mode and action", metrics.rule_hits.clone());
        registry.register("late_events", "Events too late for the key's window, by rule", metrics.late_events.clone());
        registry.register(
            "skipped_events",
            "Events not counted for a rule: unusable dimension or field, by rule",
            metrics.skipped_events.clone(),
        );
        registry.register("dead_letters", "Events sent to the dead-letter topic, by reason", metrics.dead_letters.clone());
        registry.register("flush_batch_keys", "Keys per write-behind flush", metrics.flush_keys.clone());
        registry.register("flush_duration_seconds", "Write-behind flush latency", metrics.flush_seconds.clone());
        registry.register("redis_errors", "Redis failures, by code", metrics.redis_errors.clone());
        registry.register(
            "replayed_observations",
            "Observations judged but not counted again (offset already applied to the key)",
            metrics.replayed_observations.clone(),
        );
        registry.register(
            "stale_writes",
            "Write-behind writes refused because another worker had changed the key",
            metrics.stale_writes.clone(),
        );
        registry.register("kafka_delivery_errors", "Kafka produce failures, by code", metrics.delivery_errors.clone());
        registry.register("consumer_lag", "Consumer lag per partition (messages)", metrics.consumer_lag.clone());
        registry.register(
            "committed_offset",
            "Last committed offset per partition (next to read)",
            metrics.committed_offset.clone(),
        );
        registry.register(
            "decision_latency_seconds",
            "Event Kafka timestamp to decision acknowledged by the broker",
            metrics.decision_latency.clone(),
        );
        registry.register("rule_reloads", "Rule reloads, by result", metrics.rule_reloads.clone());
        registry.register("rules_active", "Enabled rules in force", metrics.rules_active.clone());
        registry.register("store_live_keys", "(rule, key) windows held in this process", metrics.live_keys.clone());
        registry.register("assigned_partitions", "Partitions owned by this worker", metrics.assigned_partitions.clone());
        Metrics { registry, ..metrics }
    }

    /// The registry in Prometheus/OpenMetrics text.
    pub fn encode(&self) -> String {
        let mut out = String::with_capacity(16 * 1024);
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }

    pub fn inc_events(&self, outcome: &'static str, n: u64) {
        if n > 0 {
            self.events.get_or_create(&OutcomeLabels { outcome }).inc_by(n);
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// Installs the global tracing subscriber: `RUST_LOG` if set, else `config.level`.
pub fn init_logging(config: &LogConfig) -> Result<(), String> {
    use tracing_subscriber::EnvFilter;
    let filter = match std::env::var("RUST_LOG") {
        Ok(directives) if !directives.is_empty() => EnvFilter::try_new(directives),
        _ => EnvFilter::try_new(&config.level),
    }
    .map_err(|e| format!("log.level: {e}"))?;
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let result = match config.format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    result.map_err(|e| format!("cannot install the logger: {e}"))
}
