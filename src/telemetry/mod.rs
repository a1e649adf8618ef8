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
pub struct DirectionLabels {
    /// `ahead` or `behind`.
    pub direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabels {
    /// One of [`Stages::NAMES`].
    pub stage: &'static str,
}

/// Handles on the `vigil_processing_stage_seconds` series, one per stage of a partition batch,
/// in the order a batch goes through them (so observing takes no label lookup).
#[derive(Clone, Debug)]
pub struct Stages {
    /// The batch's oldest event, from the consumer's poll to its partition loop taking the batch
    /// (the loop was busy with earlier batches, or its queue was full).
    pub queued: Histogram,
    /// Waiting for the store to have room (`redis.max_local_keys`) or for slower partitions
    /// (`input.max_partition_skew`), and backing off after a store failure.
    pub paused: Histogram,
    /// Waiting for the engine, which the partition loops share.
    pub lock: Histogram,
    /// Bytes → events, the future bound.
    pub decode: Histogram,
    /// Loading the windows and holds the batch touches that the local view lacks, and counting
    /// ahead on keys other workers count too: Redis round trips before judging.
    pub load: Histogram,
    /// Counting and judging every event, writing the records.
    pub judge: Histogram,
    /// Writing the batch's records to the decision journal (a Redis round trip).
    pub journal: Histogram,
    /// Handing the records to the producer.
    pub handover: Histogram,
}

impl Stages {
    pub const NAMES: [&'static str; 8] = [
        "queued", "paused", "lock", "decode", "load", "judge", "journal", "handover",
    ];

    fn new(family: &Family<StageLabels, Histogram, fn() -> Histogram>) -> Stages {
        let stage = |stage: &'static str| family.get_or_create_owned(&StageLabels { stage });
        Stages {
            queued: stage("queued"),
            paused: stage("paused"),
            lock: stage("lock"),
            decode: stage("decode"),
            load: stage("load"),
            judge: stage("judge"),
            journal: stage("journal"),
            handover: stage("handover"),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ListLabels {
    pub list: String,
}

impl Metrics {
    /// Records what a (re)load put in force: its lists' sizes and the time.
    pub fn rules_loaded(&self, rules: &crate::rules::RuleSet) {
        self.list_entries.clear();
        for (id, set) in rules.lists() {
            self.list_entries
                .get_or_create(&ListLabels {
                    list: id.to_owned(),
                })
                .set(set.len() as i64);
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.rules_loaded_seconds.set(now as i64);
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CounterLabels {
    pub counter: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SkipLabels {
    pub counter: String,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabels {
    pub code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LookupLabels {
    /// `counter`, `rule` or `release`.
    pub endpoint: &'static str,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PartitionLabels {
    pub topic: String,
    pub partition: i32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UntilLabels {
    /// `produced`: the decision record handed to the producer; `acknowledged`: the broker
    /// acknowledged it.
    pub until: &'static str,
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
    /// Events whose bucket had slid out of the key's window (or behind the watermark), by counter.
    pub late_events: Family<CounterLabels, Counter>,
    /// Events whose `ts` is more than `input.record_time_skew` ahead of or behind their Kafka
    /// record timestamp, by direction (`ts` relative to the record).
    pub event_time_skew: Family<DirectionLabels, Counter>,
    /// Events in a counter's scope not counted: unusable dimension or field, or a sum out of
    /// range, by counter and reason.
    pub skipped_events: Family<SkipLabels, Counter>,
    /// Distinct values not recorded because their key's window already held `max_distinct`
    /// values (the counter's value saturates there), by counter.
    pub distinct_capped: Family<CounterLabels, Counter>,
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
    /// replayed after a crash or a rebalance).
    pub replayed_observations: Counter,
    /// Keys whose write-behind writes met a version another worker had moved on; their deltas
    /// were merged by the next flush.
    pub stale_writes: Counter,
    /// Kafka produce failures, by code; the record is produced again.
    pub delivery_errors: Family<CodeLabels, Counter>,
    /// Requests to the `/v1` endpoints, by endpoint and HTTP status.
    pub lookups: Family<LookupLabels, Counter>,
    /// Consumer lag per assigned partition, from librdkafka statistics.
    pub consumer_lag: Family<PartitionLabels, Gauge>,
    /// Offset committed last per partition (the next offset to read).
    pub committed_offset: Family<PartitionLabels, Gauge>,
    /// From the event's Kafka timestamp to its decision being acknowledged by the broker.
    pub decision_latency: Histogram,
    /// vigil's own share of a decision's latency, by `until` (see [`UntilLabels`]): from the
    /// consumer's poll returning the event to the record handed to the producer, or to the
    /// broker acknowledging it. Observed through [`Metrics::processing_produced`] and
    /// [`Metrics::processing_acknowledged`].
    pub processing_latency: Family<UntilLabels, Histogram, fn() -> Histogram>,
    /// The `until="produced"` series: poll returned → `send` returned (decode, count, judge,
    /// journal, queueing between the threads, and waiting while the producer's queue is full).
    pub processing_produced: Histogram,
    /// The `until="acknowledged"` series: poll returned → the delivery report (the above plus
    /// `linger.ms`, the produce request and the broker's append and acks).
    pub processing_acknowledged: Histogram,
    /// Where a partition batch's time goes, per batch, by `stage` ([`Stages::NAMES`]): a
    /// decision's own latency is its batch's stages up to `handover` (its record is handed over
    /// in the batch's order).
    pub processing_stage: Family<StageLabels, Histogram, fn() -> Histogram>,
    /// The series of `processing_stage`.
    pub stages: Stages,
    /// Messages per partition batch (one engine lock).
    pub batch_messages: Histogram,
    /// Rule reloads, by result (`ok`, `error`).
    pub rule_reloads: Family<ResultLabels, Counter>,
    /// Enabled rules in force.
    pub rules_active: Gauge,
    /// Entries of each list in force, by list id.
    pub list_entries: Family<ListLabels, Gauge>,
    /// When the rules and lists in force were loaded (Unix seconds).
    pub rules_loaded_seconds: Gauge,
    /// (rule, key) windows held in this process.
    pub live_keys: Gauge,
    /// Estimated bytes of the local state (`memory.max_state_bytes`): the in-process store's, or
    /// with Redis its views (read cache, unacknowledged windows) and hold views.
    pub state_bytes: Gauge,
    /// In-process state evicted at `memory.max_keys`, by kind (`window`: a (counter, key)
    /// window; `hold`).
    pub evicted_keys: Family<KindLabels, Counter>,
    /// Partitions this worker owns.
    pub assigned_partitions: Gauge,
    /// How far apart in event time the group's active partitions are (newest − slowest), in
    /// seconds, as this worker sees them.
    pub partition_skew_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// Time this worker's partition loops spent waiting for slower partitions, in seconds.
    pub partition_wait_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    /// Partitions paused in the consumer because their loop's queue is full (waiting for slower
    /// partitions, or for Redis).
    pub paused_partitions: Gauge,
    /// 1 while Redis answers, 0 while it is unavailable and the worker counts locally.
    pub redis_available: Gauge,
    /// Times Redis became unavailable (the circuit breaker opened).
    pub redis_outages: Counter,
    /// Observations counted locally while Redis was unavailable (merged when it answered again).
    pub degraded_observations: Counter,
    /// Rule hits made on locally counted values while Redis was unavailable, by rule.
    pub degraded_hits: Family<RuleLabels, Counter>,
    /// Rule judgements on in-process state dropped at its bound (a counter value known only as
    /// a lower bound, or a hold that may have been dropped), by rule.
    pub state_dropped_judgements: Family<RuleLabels, Counter>,
    /// Times Redis was found to have lost its data (epoch key vanished or changed).
    pub redis_data_losses: Counter,
    /// Keys written again from this worker's views after Redis lost data.
    pub reseeded_keys: Counter,
    /// Failovers followed (a Redis Cluster or Sentinel promoted a replica).
    pub redis_failovers: Counter,
    /// Observations written again after a failover because no replica had confirmed them.
    pub rewritten_unconfirmed: Counter,
    /// Observations on keys other workers count too, applied in Redis before their batch was
    /// judged (counted ahead).
    pub counted_ahead: Counter,
    /// Observations a previous owner had counted ahead without delivering their decisions,
    /// taken out of a count or sum window and counted back in order when judged again.
    pub taken_back: Counter,
    /// 1 while the worker runs against a Redis that may evict keys, allowed by
    /// `redis.allow_eviction`.
    pub eviction_allowed: Gauge,
    /// Keys found gone from Redis at a version this worker knew (lost or expired), written again.
    pub lost_keys: Counter,
    /// Decision records written to the decision journal.
    pub journaled_decisions: Counter,
    /// Decisions delivered again from the journal for events re-read after a crash.
    pub redelivered_decisions: Counter,
    /// Decisions made after a takeover on a window that already held the event's own
    /// observation (and maybe later ones), counted ahead by the previous owner.
    pub decisions_judged_as_held: Counter,
    /// Journal writes not made, by code (`fenced`: another worker took the partition over, the
    /// batch was dropped; `unavailable`: Redis did not answer, the records went out unjournaled).
    pub journal_errors: Family<CodeLabels, Counter>,
    /// 1 while the local state waiting for Redis is at `redis.max_local_keys` or at half of
    /// `memory.max_state_bytes` (partitions paused).
    pub store_saturated: Gauge,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("vigil");
        let processing_latency: Family<UntilLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(processing_buckets);
        // Handles on the two series, so observing takes no label lookup; created here, both
        // series are exported from the start.
        let processing_produced =
            processing_latency.get_or_create_owned(&UntilLabels { until: "produced" });
        let processing_acknowledged = processing_latency.get_or_create_owned(&UntilLabels {
            until: "acknowledged",
        });
        let processing_stage: Family<StageLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(stage_buckets);
        let stages = Stages::new(&processing_stage);
        let metrics = Metrics {
            events: Family::default(),
            decisions: Family::default(),
            rule_hits: Family::default(),
            late_events: Family::default(),
            event_time_skew: Family::default(),
            skipped_events: Family::default(),
            distinct_capped: Family::default(),
            dead_letters: Family::default(),
            flush_keys: Histogram::new(exponential_buckets(1.0, 2.0, 14)),
            flush_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 16)),
            redis_errors: Family::default(),
            replayed_observations: Counter::default(),
            stale_writes: Counter::default(),
            delivery_errors: Family::default(),
            lookups: Family::default(),
            consumer_lag: Family::default(),
            committed_offset: Family::default(),
            decision_latency: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            processing_latency,
            processing_produced,
            processing_acknowledged,
            processing_stage,
            stages,
            batch_messages: Histogram::new(exponential_buckets(1.0, 2.0, 14)),
            rule_reloads: Family::default(),
            rules_active: Gauge::default(),
            list_entries: Family::default(),
            rules_loaded_seconds: Gauge::default(),
            live_keys: Gauge::default(),
            state_bytes: Gauge::default(),
            evicted_keys: Family::default(),
            assigned_partitions: Gauge::default(),
            partition_skew_seconds: Gauge::default(),
            partition_wait_seconds: Counter::default(),
            paused_partitions: Gauge::default(),
            redis_available: Gauge::default(),
            redis_outages: Counter::default(),
            degraded_observations: Counter::default(),
            degraded_hits: Family::default(),
            state_dropped_judgements: Family::default(),
            redis_data_losses: Counter::default(),
            reseeded_keys: Counter::default(),
            redis_failovers: Counter::default(),
            rewritten_unconfirmed: Counter::default(),
            counted_ahead: Counter::default(),
            taken_back: Counter::default(),
            eviction_allowed: Gauge::default(),
            lost_keys: Counter::default(),
            journaled_decisions: Counter::default(),
            redelivered_decisions: Counter::default(),
            decisions_judged_as_held: Counter::default(),
            journal_errors: Family::default(),
            store_saturated: Gauge::default(),
            registry: Registry::default(),
        };
        metrics.register_judging(&mut registry);
        metrics.register_store(&mut registry);
        metrics.register_worker(&mut registry);
        Metrics {
            registry,
            ..metrics
        }
    }

    /// Events, decisions, rule hits, counting and the rules in force.
    fn register_judging(&self, registry: &mut Registry) {
        registry.register("events", "Events read, by outcome", self.events.clone());
        registry.register(
            "decisions",
            "Decision records produced, by action",
            self.decisions.clone(),
        );
        registry.register(
            "rule_hits",
            "Rule hits, by rule, mode and action",
            self.rule_hits.clone(),
        );
        registry.register(
            "late_events",
            "Events too late for the key's window, by counter",
            self.late_events.clone(),
        );
        registry.register(
            "event_time_skew",
            "Events whose ts is more than input.record_time_skew ahead of or behind their Kafka record timestamp, by direction",
            self.event_time_skew.clone(),
        );
        registry.register(
            "skipped_events",
            "Events not counted: unusable dimension or field, or a sum out of range, by counter and reason",
            self.skipped_events.clone(),
        );
        registry.register(
            "distinct_capped",
            "Distinct values not recorded because their key's window held max_distinct values, by counter",
            self.distinct_capped.clone(),
        );
        registry.register(
            "dead_letters",
            "Events sent to the dead-letter topic, by reason",
            self.dead_letters.clone(),
        );
        registry.register(
            "rule_reloads",
            "Rule reloads, by result",
            self.rule_reloads.clone(),
        );
        registry.register(
            "rules_active",
            "Enabled rules in force",
            self.rules_active.clone(),
        );
        registry.register(
            "list_entries",
            "Entries of each list in force, by list",
            self.list_entries.clone(),
        );
        registry.register(
            "rules_loaded_timestamp_seconds",
            "When the rules and lists in force were loaded",
            self.rules_loaded_seconds.clone(),
        );
    }

    /// The counter store: write-behind, Redis health, local state.
    fn register_store(&self, registry: &mut Registry) {
        registry.register(
            "flush_batch_keys",
            "Keys per write-behind flush",
            self.flush_keys.clone(),
        );
        registry.register(
            "flush_duration_seconds",
            "Write-behind flush latency",
            self.flush_seconds.clone(),
        );
        registry.register(
            "redis_errors",
            "Redis failures, by code",
            self.redis_errors.clone(),
        );
        registry.register(
            "replayed_observations",
            "Observations judged but not counted again (offset already applied to the key)",
            self.replayed_observations.clone(),
        );
        registry.register(
            "stale_writes",
            "Write-behind writes refused because another worker had changed the key",
            self.stale_writes.clone(),
        );
        registry.register(
            "store_live_keys",
            "(rule, key) windows held in this process",
            self.live_keys.clone(),
        );
        registry.register(
            "store_state_bytes",
            "Estimated bytes of local counter state (in process, or the Redis store's views)",
            self.state_bytes.clone(),
        );
        registry.register(
            "evicted_keys",
            "In-process state evicted at memory.max_keys (oldest newest event first), by kind",
            self.evicted_keys.clone(),
        );
        registry.register(
            "redis_available",
            "1 while Redis answers, 0 while counting locally",
            self.redis_available.clone(),
        );
        registry.register(
            "redis_outages",
            "Times Redis became unavailable",
            self.redis_outages.clone(),
        );
        registry.register(
            "degraded_observations",
            "Observations counted locally while Redis was unavailable",
            self.degraded_observations.clone(),
        );
        registry.register(
            "degraded_hits",
            "Rule hits on locally counted values while Redis was unavailable, by rule",
            self.degraded_hits.clone(),
        );
        registry.register(
            "state_dropped_judgements",
            "Rule judgements on in-process state dropped at memory.max_state_bytes / max_keys (a lower bound or an unknown hold), by rule",
            self.state_dropped_judgements.clone(),
        );
        registry.register(
            "redis_data_losses",
            "Times Redis was found to have lost its data",
            self.redis_data_losses.clone(),
        );
        registry.register(
            "redis_reseeded_keys",
            "Keys written again from local views after a Redis data loss",
            self.reseeded_keys.clone(),
        );
        registry.register(
            "redis_failovers",
            "Redis failovers followed (a promoted replica became the master)",
            self.redis_failovers.clone(),
        );
        registry.register(
            "redis_rewritten_unconfirmed",
            "Observations written again after a Redis failover because no replica had confirmed them",
            self.rewritten_unconfirmed.clone(),
        );
        registry.register(
            "redis_counted_ahead",
            "Observations on keys other workers count too, applied in Redis before their batch was judged",
            self.counted_ahead.clone(),
        );
        registry.register(
            "redis_taken_back",
            "Observations a previous owner counted ahead without delivering their decisions, taken out of a count or sum window and counted back in order when judged again",
            self.taken_back.clone(),
        );
        registry.register(
            "redis_eviction_allowed",
            "1 while Redis' maxmemory-policy may evict counter keys and redis.allow_eviction let the worker start anyway",
            self.eviction_allowed.clone(),
        );
        registry.register(
            "redis_lost_keys",
            "Keys found gone from Redis at a known version, written again",
            self.lost_keys.clone(),
        );
        registry.register(
            "store_saturated",
            "1 while local state waiting for Redis is full",
            self.store_saturated.clone(),
        );
    }

    /// The Kafka worker: deliveries, partitions, offsets, the decision journal.
    fn register_worker(&self, registry: &mut Registry) {
        registry.register(
            "lookups",
            "Requests to the /v1 lookups and hold releases, by endpoint and HTTP status",
            self.lookups.clone(),
        );
        registry.register(
            "kafka_delivery_errors",
            "Kafka produce failures, by code",
            self.delivery_errors.clone(),
        );
        registry.register(
            "consumer_lag",
            "Consumer lag per partition (messages)",
            self.consumer_lag.clone(),
        );
        registry.register(
            "committed_offset",
            "Last committed offset per partition (next to read)",
            self.committed_offset.clone(),
        );
        registry.register(
            "decision_latency_seconds",
            "Event Kafka timestamp to decision acknowledged by the broker",
            self.decision_latency.clone(),
        );
        registry.register(
            "processing_latency_seconds",
            "Poll returned the event to its decision handed to the producer (until=produced) or acknowledged by the broker (until=acknowledged)",
            self.processing_latency.clone(),
        );
        registry.register(
            "processing_stage_seconds",
            "Time a partition batch spent in each stage, per batch, by stage (queued, paused, lock, decode, load, judge, journal, handover)",
            self.processing_stage.clone(),
        );
        registry.register(
            "batch_messages",
            "Messages per partition batch",
            self.batch_messages.clone(),
        );
        registry.register(
            "assigned_partitions",
            "Partitions owned by this worker",
            self.assigned_partitions.clone(),
        );
        registry.register(
            "partition_skew_seconds",
            "Event time between the newest and the slowest active partition of the group",
            self.partition_skew_seconds.clone(),
        );
        registry.register(
            "partition_wait_seconds",
            "Time partition loops waited for slower partitions (input.max_partition_skew)",
            self.partition_wait_seconds.clone(),
        );
        registry.register(
            "paused_partitions",
            "Partitions paused in the consumer while their loop's queue is full",
            self.paused_partitions.clone(),
        );
        registry.register(
            "journaled_decisions",
            "Decision records written to the decision journal",
            self.journaled_decisions.clone(),
        );
        registry.register(
            "redelivered_decisions",
            "Decisions delivered again from the journal for events re-read after a crash",
            self.redelivered_decisions.clone(),
        );
        registry.register(
            "decisions_judged_as_held",
            "Decisions made again, not delivered before, on a window that already held the event's own observation (and maybe later events of its batch): a previous owner counted it ahead and stopped before delivering",
            self.decisions_judged_as_held.clone(),
        );
        registry.register(
            "journal_errors",
            "Decision journal writes not made, by code",
            self.journal_errors.clone(),
        );
    }

    /// The registry in Prometheus/OpenMetrics text.
    pub fn encode(&self) -> String {
        let mut out = String::with_capacity(16 * 1024);
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }

    /// Counts one `/v1` request.
    pub fn lookup(&self, endpoint: &'static str, status: u16) {
        self.lookups
            .get_or_create(&LookupLabels { endpoint, status })
            .inc();
    }

    pub fn inc_events(&self, outcome: &'static str, n: u64) {
        if n > 0 {
            self.events
                .get_or_create(&OutcomeLabels { outcome })
                .inc_by(n);
        }
    }
}

/// Buckets of `vigil_processing_latency_seconds`: 50 µs to 9.6 s by factors of 1.5, so a
/// quantile read from them is within a bucket's width (±25 %) from sub-millisecond judging to
/// a backlog of seconds.
fn processing_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.000_05, 1.5, 31))
}

/// Buckets of `vigil_processing_stage_seconds`: 5 µs to 9.6 s by factors of 1.5 (a stage of
/// a small batch takes microseconds).
fn stage_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.000_005, 1.5, 37))
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// Lets a repeated log line through once per `every`: librdkafka reports the same broken
/// connection on every reconnect attempt while a broker is down.
pub struct LogLimiter {
    every: std::time::Duration,
    seen: std::sync::Mutex<std::collections::HashMap<String, (std::time::Instant, u64)>>,
}

impl LogLimiter {
    pub fn new(every: std::time::Duration) -> LogLimiter {
        LogLimiter {
            every,
            seen: Default::default(),
        }
    }

    /// `Some(n)` when a line of this kind may be logged now, `n` being how many like it were
    /// held back since the last one; `None` when it is held back. Lines are alike when they
    /// match but for digits (ports, counts, durations).
    pub fn allow(&self, facility: &str, message: &str) -> Option<u64> {
        let kind: String = facility
            .chars()
            .chain(message.chars().filter(|c| !c.is_ascii_digit()).take(80))
            .collect();
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.len() > 1024 {
            seen.clear();
        }
        let now = std::time::Instant::now();
        match seen.get_mut(&kind) {
            Some((at, held)) if now.duration_since(*at) < self.every => {
                *held += 1;
                None
            }
            Some((at, held)) => {
                *at = now;
                Some(std::mem::take(held))
            }
            None => {
                seen.insert(kind, (now, 0));
                Some(0)
            }
        }
    }

    /// Routes a librdkafka log line to `tracing`, rate-limited.
    pub fn log(&self, level: rdkafka::config::RDKafkaLogLevel, facility: &str, message: &str) {
        use rdkafka::config::RDKafkaLogLevel as L;
        let Some(held) = self.allow(facility, message) else {
            return;
        };
        match level {
            L::Emerg | L::Alert | L::Critical | L::Error => {
                tracing::error!(target: "librdkafka", facility, held_back = held, "{message}")
            }
            L::Warning => {
                tracing::warn!(target: "librdkafka", facility, held_back = held, "{message}")
            }
            L::Notice | L::Info => {
                tracing::info!(target: "librdkafka", facility, held_back = held, "{message}")
            }
            L::Debug => {
                tracing::debug!(target: "librdkafka", facility, held_back = held, "{message}")
            }
        }
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
    // Colour only for a person at a terminal (and not under NO_COLOR): log files and
    // collectors get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    let result = match config.format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    result.map_err(|e| format!("cannot install the logger: {e}"))
}

#[cfg(test)]
mod tests {
    use super::{LogLimiter, Metrics};

    /// Every exported metric is in the operations guide's table, under the name Prometheus shows.
    #[test]
    fn every_metric_is_documented() {
        let guide = include_str!("../../docs/operations.md");
        let text = Metrics::new().encode();
        let mut missing = Vec::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("# TYPE ") else {
                continue;
            };
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, ""));
            let shown = if kind == "counter" {
                format!("`{name}_total`")
            } else {
                format!("`{name}`")
            };
            if !guide.contains(&shown) {
                missing.push(shown);
            }
        }
        assert!(missing.is_empty(), "not in docs/operations.md: {missing:?}");
    }

    #[test]
    fn repeated_lines_pass_once_per_period() {
        let limiter = LogLimiter::new(std::time::Duration::from_secs(3600));
        assert_eq!(
            limiter.allow("FAIL", "127.0.0.1:9092/1: Connect failed (after 3ms)"),
            Some(0)
        );
        assert_eq!(
            limiter.allow("FAIL", "127.0.0.1:9092/1: Connect failed (after 12ms)"),
            None
        );
        assert_eq!(limiter.allow("FAIL", "other broker unreachable"), Some(0));
        let now = LogLimiter::new(std::time::Duration::ZERO);
        assert_eq!(now.allow("FAIL", "x"), Some(0));
        assert_eq!(now.allow("FAIL", "x"), Some(0));
    }
}
