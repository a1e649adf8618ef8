//! `vigil run`: a member of a Kafka consumer group that decodes, counts, decides and produces,
//! at least once by construction.
//!
//! Threads:
//! - the caller's thread polls the consumer (which also runs the rebalance callbacks) and routes
//!   each message to its partition's loop;
//! - one ordered loop per assigned partition: decode → plan → count → decide a batch under the
//!   engine lock, then hand records to the producer with a ticket back to the partition's
//!   [`Progress`];
//! - a committer: lets the store write behind while idle, stores the offsets that are decided,
//!   delivered and durable, produces failed records again, and exports store metrics;
//! - a rule watcher: validates changed rule files and swaps them in atomically.
//!
//! On revocation and on shutdown: stop the partition loops, flush the store, wait for deliveries,
//! commit — within `worker.shutdown_timeout`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::statistics::Statistics;
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::ClientContext;

use super::Engine;
use crate::config::Config;
use crate::rule_files::{self, LoadError};
use crate::rules::{decide, Action, Mode, RuleSet, SkipReason, Source};
use crate::shutdown::Shutdown;
use crate::sink::{dead_letter_headers, Kind, Sink, Ticket};
use crate::source::{self, Progress};
use crate::store::journal::JournalBatch;
use crate::store::{AnyStore, CounterStore, Journal, JournalError, JournalWriter, Origin, RedisStats, StateStats, StoreError};
use crate::telemetry::http::Health;
use crate::telemetry::{
    ActionLabels, CodeLabels, CounterLabels, KindLabels, LogLimiter, Metrics, PartitionLabels, ReasonLabels, ResultLabels, RuleHitLabels,
    RuleLabels, SkipLabels,
};

/// Messages a partition loop takes per engine lock.
const MAX_BATCH: usize = 1024;
/// Messages the consumer loop gathers before handing them to the partition loops (it hands them
/// over earlier as soon as the consumer has nothing more ready).
const GATHER: usize = 2048;
/// Batches waiting per partition loop; the consumer loop waits when it is full.
const QUEUE_DEPTH: usize = 8;

/// Why the worker stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("kafka: {0}")]
    Kafka(#[from] KafkaError),
    #[error("counter store: {0}")]
    Store(#[from] StoreError),
    /// Shutdown ran out of time or could not make everything durable; what was durable and
    /// delivered was committed, the rest will be processed again by the partition's next owner.
    #[error("shutdown incomplete: {0}")]
    ShutdownIncomplete(String),
}

impl WorkerError {
    pub fn code(&self) -> &'static str {
        match self {
            WorkerError::Kafka(_) => "kafka",
            WorkerError::Store(e) => e.code(),
            WorkerError::ShutdownIncomplete(_) => "shutdown_incomplete",
        }
    }
}

/// Why a partition loop stopped processing a batch.
enum Failure {
    /// The counter store failed; the rest of the batch is tried again.
    Store(StoreError),
    /// Another worker owns the partition now: the loop stops.
    Fenced,
}

/// A running partition loop.
struct PartitionLoop {
    sender: Option<SyncSender<Vec<OwnedMessage>>>,
    /// Messages polled and not yet handed over; they go with the loop when it is revoked.
    gathered: Vec<OwnedMessage>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    progress: Arc<Progress>,
}

type PartitionKey = (String, i32);

/// What every thread of the worker shares.
struct Worker {
    config: Config,
    engine: Mutex<Engine<AnyStore>>,
    sink: Sink,
    metrics: Arc<Metrics>,
    shutdown: Shutdown,
    partitions: Mutex<HashMap<PartitionKey, PartitionLoop>>,
    /// Store statistics already exported.
    exported: Mutex<RedisStats>,
    /// State statistics already exported, and when evictions were last logged.
    exported_state: Mutex<(StateStats, Option<Instant>)>,
    /// The decision journal (with Redis; none with the in-process store, which a restart loses
    /// anyway).
    journal: Option<Mutex<JournalWriter>>,
}

struct WorkerContext {
    worker: Arc<Worker>,
    health: Arc<Health>,
    logs: LogLimiter,
}

impl ClientContext for WorkerContext {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, facility: &str, message: &str) {
        self.logs.log(level, facility, message);
    }

    /// Every broker down: not ready until one answers again (seen in the statistics).
    fn error(&self, error: KafkaError, reason: &str) {
        if error.rdkafka_error_code() == Some(rdkafka::types::RDKafkaErrorCode::AllBrokersDown) {
            self.health.set_brokers_down(true);
        }
        if let Some(held) = self.logs.allow("ERROR", reason) {
            tracing::error!(error = %error, held_back = held, "librdkafka: {reason}");
        }
    }

    /// Consumer lag per assigned partition; broker reachability.
    fn stats(&self, statistics: Statistics) {
        if statistics.brokers.values().any(|b| b.state == "UP") {
            self.health.set_brokers_down(false);
        }
        let partitions = self.worker.lock_partitions();
        for (topic, stats) in &statistics.topics {
            for (&partition, p) in &stats.partitions {
                if partitions.contains_key(&(topic.clone(), partition)) && p.consumer_lag >= 0 {
                    let labels = PartitionLabels { topic: topic.clone(), partition };
                    self.worker.metrics.consumer_lag.get_or_create(&labels).set(p.consumer_lag);
                }
            }
        }
    }
}

impl ConsumerContext for WorkerContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(list) = rebalance {
            let revoked: Vec<PartitionKey> =
                list.elements().iter().map(|e| (e.topic().to_owned(), e.partition())).collect();
            tracing::info!(partitions = ?revoked, "partitions revoked: flushing and committing");
            let deadline = Instant::now() + self.worker.config.worker.shutdown_timeout;
            if let Err(e) = self.worker.finish(consumer, &revoked, deadline) {
                tracing::error!(error = %e, "revocation: not everything was committed; the next owner reprocesses the rest");
            }
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(list) => {
                let assigned: Vec<PartitionKey> =
                    list.elements().iter().map(|e| (e.topic().to_owned(), e.partition())).collect();
                tracing::info!(partitions = ?assigned, "partitions assigned");
                // While other workers owned partitions, they counted keys this one may hold
                // views of: read them again.
                self.worker.lock_engine().store_mut().forget_cached();
                for key in assigned {
                    self.worker.start_partition(key);
                }
            }
            Rebalance::Revoke(_) => {}
            Rebalance::Error(e) => tracing::error!(error = %e, "rebalance failed"),
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        match result {
            Ok(()) => {
                for element in offsets.elements() {
                    if let Offset::Offset(next) = element.offset() {
                        let labels = PartitionLabels { topic: element.topic().to_owned(), partition: element.partition() };
                        self.worker.metrics.committed_offset.get_or_create(&labels).set(next);
                        // Nobody reads the events before `next` again: their journal entries go.
                        let lane = self.worker.lane(element.topic(), element.partition());
                        self.worker.with_journal(|journal| journal.trim(lane, next));
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "offset commit failed; it is retried with the next commit"),
        }
    }
}

/// Runs the worker until `shutdown` fires, then stops within `worker.shutdown_timeout`.
pub fn run(
    config: Config,
    rules: RuleSet,
    store: AnyStore,
    journal: Option<JournalWriter>,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    shutdown: Shutdown,
) -> Result<(), WorkerError> {
    metrics.rules_active.set(rules.active().len() as i64);
    metrics.rules_loaded(&rules);
    let sink = Sink::new(&config.kafka, Arc::clone(&metrics))?;
    let worker = Arc::new(Worker {
        engine: Mutex::new(Engine::new(rules, store).with_time(config.input.time_bounds(), Arc::new(crate::clock::SystemClock))),
        sink,
        metrics: Arc::clone(&metrics),
        shutdown: shutdown.clone(),
        partitions: Mutex::new(HashMap::new()),
        exported: Mutex::new(RedisStats::default()),
        exported_state: Mutex::new((StateStats::default(), None)),
        journal: journal.map(Mutex::new),
        config,
    });
    let consumer: BaseConsumer<WorkerContext> = source::consumer_config(&worker.config.kafka, &worker.config.worker)
        .create_with_context(WorkerContext {
            worker: Arc::clone(&worker),
            health: Arc::clone(&health),
            logs: LogLimiter::new(Duration::from_secs(30)),
        })?;
    let consumer = Arc::new(consumer);
    let topics: Vec<&str> = worker.config.kafka.input_topics.iter().map(String::as_str).collect();
    consumer.subscribe(&topics)?;
    tracing::info!(topics = ?topics, group = %worker.config.kafka.group_id, "subscribed");

    // The helper threads stop on `helpers_done`, after the final commit.
    let helpers_done = Shutdown::new();
    let committer = {
        let (worker, consumer, done) = (Arc::clone(&worker), Arc::clone(&consumer), helpers_done.clone());
        std::thread::Builder::new().name("vigil-commit".into()).spawn(move || worker.commit_loop(&consumer, &done))
    }
    .map_err(|e| WorkerError::ShutdownIncomplete(format!("cannot start the committer: {e}")))?;
    let watcher = {
        let (worker, done) = (Arc::clone(&worker), helpers_done.clone());
        let path = worker.config.rules.path.clone();
        std::thread::Builder::new().name("vigil-rules".into()).spawn(move || worker.watch_rules(&path, &done))
    }
    .map_err(|e| WorkerError::ShutdownIncomplete(format!("cannot start the rule watcher: {e}")))?;

    health.set_ready(true);
    // Messages are gathered while the consumer has more ready, then handed over per partition:
    // under load a partition loop takes whole batches per engine lock; when idle each message
    // goes on at once.
    let mut gathered = 0;
    // While the brokers are away every poll reports the same errors: log each once per 30 s.
    let mut logged: HashMap<String, Instant> = HashMap::new();
    while !shutdown.is_triggered() {
        health.beat();
        let timeout = if gathered == 0 { Duration::from_millis(100) } else { Duration::ZERO };
        match consumer.poll(timeout) {
            Some(Ok(message)) => {
                health.set_brokers_down(false);
                if worker.gather(message.detach()) {
                    gathered += 1;
                }
                if gathered >= GATHER {
                    worker.hand_over();
                    gathered = 0;
                }
            }
            None => {
                if gathered > 0 {
                    worker.hand_over();
                    gathered = 0;
                }
            }
            Some(Err(e)) => {
                let text = e.to_string();
                if logged.get(&text).is_none_or(|at| at.elapsed() >= Duration::from_secs(30)) {
                    tracing::warn!(error = %text, "consumer error (repeats of it are logged every 30 s)");
                    logged.insert(text, Instant::now());
                }
            }
        }
    }
    health.set_ready(false);

    tracing::info!("shutting down: stopping partition loops, flushing, delivering, committing");
    let started = shutdown.since().unwrap_or_else(Instant::now);
    let deadline = started + worker.config.worker.shutdown_timeout;
    let all: Vec<PartitionKey> = worker.lock_partitions().keys().cloned().collect();
    let result = worker.finish(&consumer, &all, deadline);
    helpers_done.trigger();
    let _ = committer.join();
    let _ = watcher.join();
    // Leaving the group: the revocation callback finds nothing left to do.
    drop(consumer);
    match &result {
        Ok(()) => tracing::info!(elapsed_ms = started.elapsed().as_millis() as u64, "stopped: everything flushed, delivered and committed"),
        Err(e) => tracing::error!(error = %e, "stopped with work left to the next owner"),
    }
    result
}

impl Worker {
    fn lock_partitions(&self) -> MutexGuard<'_, HashMap<PartitionKey, PartitionLoop>> {
        self.partitions.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_engine(&self) -> MutexGuard<'_, Engine<AnyStore>> {
        self.engine.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn with_journal<T>(&self, f: impl FnOnce(&mut JournalWriter) -> T) -> Option<T> {
        self.journal.as_ref().map(|journal| f(&mut journal.lock().unwrap_or_else(|p| p.into_inner())))
    }

    fn start_partition(self: &Arc<Self>, key: PartitionKey) {
        let (sender, receiver) = mpsc::sync_channel(QUEUE_DEPTH);
        let stop = Arc::new(AtomicBool::new(false));
        let progress = Arc::new(Progress::new());
        let thread = {
            let (worker, stop, progress, key) = (Arc::clone(self), Arc::clone(&stop), Arc::clone(&progress), key.clone());
            std::thread::Builder::new()
                .name(format!("vigil-p{}", key.1))
                .spawn(move || worker.partition_loop(&key, &receiver, &stop, &progress))
        };
        let thread = match thread {
            Ok(thread) => thread,
            Err(e) => {
                tracing::error!(error = %e, "cannot start a partition loop");
                return;
            }
        };
        self.metrics.assigned_partitions.inc();
        let previous = self
            .lock_partitions()
            .insert(key, PartitionLoop { sender: Some(sender), gathered: Vec::new(), stop, thread: Some(thread), progress });
        if let Some(previous) = previous {
            stop_loops(vec![previous]);
        }
    }

    /// Keeps a polled message for its partition's loop; false if the partition is not (or no
    /// longer) ours: then it is not committed and its next owner reads it.
    fn gather(&self, message: OwnedMessage) -> bool {
        let key = (message.topic().to_owned(), message.partition());
        match self.lock_partitions().get_mut(&key) {
            Some(state) => {
                state.gathered.push(message);
                true
            }
            None => false,
        }
    }

    /// Hands every gathered message to its partition's loop, waiting while a loop's queue is full.
    fn hand_over(&self) {
        let batches: Vec<(SyncSender<Vec<OwnedMessage>>, Vec<OwnedMessage>)> = self
            .lock_partitions()
            .values_mut()
            .filter(|state| !state.gathered.is_empty())
            .filter_map(|state| Some((state.sender.clone()?, std::mem::take(&mut state.gathered))))
            .collect();
        for (sender, batch) in batches {
            let mut batch = batch;
            loop {
                match sender.try_send(batch) {
                    Ok(()) | Err(TrySendError::Disconnected(_)) => break,
                    Err(TrySendError::Full(back)) => {
                        if self.shutdown.wait(Duration::from_millis(1)) {
                            return;
                        }
                        batch = back;
                    }
                }
            }
        }
    }

    fn partition_loop(&self, key: &PartitionKey, receiver: &mpsc::Receiver<Vec<OwnedMessage>>, stop: &AtomicBool, progress: &Arc<Progress>) {
        // What a previous owner produced for the events this one may read again.
        let lane = self.lane(&key.0, key.1);
        let loaded = self.with_journal(|journal| journal.claim(lane)).unwrap_or_else(|| Ok(Journal::default()));
        let journal = loaded.unwrap_or_else(|e| {
            tracing::warn!(error = %e, partition = key.1, "cannot read the decision journal: events re-read after a crash are judged again");
            Journal::default()
        });
        if let Some(covered) = journal.covered {
            tracing::info!(partition = key.1, covered, records = journal.records.len(), "decision journal loaded");
        }
        let mut resumed = false;
        loop {
            if stop.load(Ordering::Acquire) || self.shutdown.is_triggered() {
                return;
            }
            let mut batch = match receiver.recv_timeout(Duration::from_millis(50)) {
                Ok(batch) => batch,
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return,
            };
            while batch.len() < MAX_BATCH {
                match receiver.try_recv() {
                    Ok(more) => batch.extend(more),
                    Err(_) => break,
                }
            }
            if !resumed {
                // The watermark continues where it was just before the first offset read.
                resumed = true;
                let first = batch.first().map_or(0, Message::offset);
                match journal.newest_before(first) {
                    Some(newest) => self.lock_engine().resume_lane(lane, newest),
                    None if journal.covered.is_some() => {
                        tracing::warn!(partition = key.1, first, "no watermark recorded before the first offset read: it starts afresh")
                    }
                    None => {}
                }
            }
            self.process(key, &batch, stop, progress, &journal);
        }
    }

    /// Processes a batch in order; a store failure is retried with backoff from the first event
    /// not processed, until it succeeds or the loop is stopped (its offsets then stay uncommitted).
    fn process(&self, key: &PartitionKey, batch: &[OwnedMessage], stop: &AtomicBool, progress: &Arc<Progress>, journal: &Journal) {
        if !self.wait_while_saturated(stop) {
            return;
        }
        let mut start = 0;
        let mut backoff = Duration::from_millis(50);
        while start < batch.len() {
            match self.process_some(key, &batch[start..], progress, journal) {
                Ok(()) => return,
                Err((_, Failure::Fenced)) => {
                    stop.store(true, Ordering::Release);
                    return;
                }
                Err((done, Failure::Store(error))) => {
                    start += done;
                    self.metrics.redis_errors.get_or_create(&CodeLabels { code: "read_failed" }).inc();
                    tracing::warn!(error = %error, partition = key.1, "counter store unavailable; retrying the batch");
                    if self.shutdown.wait(backoff) || stop.load(Ordering::Acquire) {
                        return;
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    /// While the local counts waiting for Redis are at their bound (a long outage), the partition
    /// waits: its events stay in Kafka. False if the loop was stopped meanwhile.
    fn wait_while_saturated(&self, stop: &AtomicBool) -> bool {
        let mut logged = None::<Instant>;
        loop {
            {
                let mut engine = self.lock_engine();
                if !engine.store().saturated() {
                    self.metrics.store_saturated.set(0);
                    return true;
                }
                let _ = engine.store_mut().tick();
            }
            self.metrics.store_saturated.set(1);
            if logged.is_none_or(|at| at.elapsed() >= Duration::from_secs(30)) {
                tracing::warn!("local counter state is full while Redis is unavailable (redis.max_local_keys): partitions wait");
                logged = Some(Instant::now());
            }
            if self.shutdown.wait(Duration::from_millis(50)) || stop.load(Ordering::Acquire) {
                return false;
            }
        }
    }

    /// The lane the store records applied offsets under (`o:<partition>`): the
    /// partition, made unique per input topic when there are several (by the topic's position
    /// in `kafka.input_topics`).
    fn lane(&self, topic: &str, partition: i32) -> u64 {
        let topics = &self.config.kafka.input_topics;
        let partition = u64::try_from(partition).unwrap_or(0);
        match topics.iter().position(|t| t == topic) {
            Some(index) if topics.len() > 1 => index as u64 * 1_000_000 + partition,
            _ => partition,
        }
    }

    /// Decodes, counts and decides `messages` under the engine lock, then hands their records to
    /// the producer. On a store failure, returns how many messages were processed.
    fn process_some(
        &self,
        (topic, partition): &PartitionKey,
        messages: &[OwnedMessage],
        progress: &Arc<Progress>,
        journal: &Journal,
    ) -> Result<(), (usize, Failure)> {
        struct Output<'m> {
            offset: i64,
            key: Option<&'m [u8]>,
            payload: Vec<u8>,
            dead_letter: Option<rdkafka::message::OwnedHeaders>,
            event_time_ms: Option<i64>,
        }
        let emit_allow = self.config.worker.emit_allow;
        let mut outputs: Vec<Output<'_>> = Vec::new();
        let mut processed: usize = 0;
        let mut failure = None;
        let (mut decided, mut allowed, mut dead, mut redelivered) = (0, 0, 0, 0);
        let mut journaled = JournalBatch::default();
        let mark = {
            let mut engine = self.lock_engine();
            let limit = self.config.worker.max_event_bytes;
            let events: Vec<_> = messages
                .iter()
                .map(|m| {
                    let event = source::decode_message(m.payload(), limit, engine.rules().projection())?;
                    engine.admit(&event)?;
                    Ok::<_, source::Rejection>(event)
                })
                .collect();
            if engine.store().prefetches() {
                let mut touched = Vec::new();
                for event in events.iter().flatten() {
                    engine.touched_keys(event, &mut touched);
                }
                if let Err(e) = engine.store_mut().prefetch(&touched) {
                    return Err((0, Failure::Store(e)));
                }
                let mut touched_holds = Vec::new();
                for event in events.iter().flatten() {
                    engine.touched_holds(event, &mut touched_holds);
                }
                if let Err(e) = engine.store_mut().prefetch_holds(&touched_holds) {
                    return Err((0, Failure::Store(e)));
                }
            }
            let lane = self.lane(topic, *partition);
            let mut record = Vec::with_capacity(512);
            // Nothing the batch counts is sent before its records are journaled (below).
            engine.store_mut().begin_batch();
            for (message, event) in messages.iter().zip(&events) {
                let offset = message.offset();
                match event {
                    Err(rejection) => {
                        dead += 1;
                        self.metrics.dead_letters.get_or_create(&ReasonLabels { reason: rejection.code() }).inc();
                        let headers = dead_letter_headers(
                            message.headers(),
                            rejection.code(),
                            &rejection.to_string(),
                            topic,
                            *partition,
                            offset,
                        );
                        outputs.push(Output {
                            offset,
                            key: message.key(),
                            payload: message.payload().unwrap_or_default().to_vec(),
                            dead_letter: Some(headers),
                            event_time_ms: None,
                        });
                    }
                    Ok(event) => {
                        let origin = Origin { lane, offset };
                        let decision = match engine.evaluate(event, origin) {
                            Ok(decision) => decision,
                            Err(e) => {
                                failure = Some(e);
                                break;
                            }
                        };
                        if decision.is_empty() {
                            allowed += 1;
                        } else {
                            decided += 1;
                        }
                        let event_time_ms = message.timestamp().to_millis();
                        if let Some(earlier) = journal.produced(offset) {
                            // Read again after a crash: deliver what the first run produced, byte
                            // for byte (this run counted only what the first had not flushed).
                            redelivered += 1;
                            if let Some(payload) = earlier {
                                outputs.push(Output { offset, key: message.key(), payload: payload.to_vec(), dead_letter: None, event_time_ms });
                            }
                        } else if !decision.is_empty() || emit_allow {
                            record.clear();
                            let source = Source::Kafka { topic, partition: *partition, offset };
                            decide::write_record(&mut record, engine.rules(), event, &decision, source);
                            let action = decision.action(engine.rules()).map_or("allow", Action::as_str);
                            self.metrics.decisions.get_or_create(&ActionLabels { action }).inc();
                            journaled.records.push((offset, record.clone()));
                            outputs.push(Output { offset, key: message.key(), payload: record.clone(), dead_letter: None, event_time_ms });
                        }
                        for hit in decision.hits.iter().filter(|h| h.degraded) {
                            let rule = engine.rules().rule(hit.rule).id.clone();
                            self.metrics.degraded_hits.get_or_create(&RuleLabels { rule }).inc();
                        }
                    }
                }
                processed += 1;
            }
            // Offsets are committed at batch ends: a next owner resumes after one, with the
            // watermark recorded there.
            if let Some(last) = processed.checked_sub(1).map(|i| messages[i].offset()) {
                journaled.covered = Some(last);
                journaled.mark = engine.newest(lane).map(|newest| (last, newest));
            }
            let counts: Vec<_> = engine.take_rule_counts().collect();
            for (index, counts) in counts {
                let rule = engine.rules().rule(index);
                if counts.hits > 0 {
                    let mode = match rule.mode {
                        Mode::Enforce => "enforce",
                        Mode::Shadow => "shadow",
                    };
                    let labels = RuleHitLabels { rule: rule.id.clone(), mode, action: rule.action.as_str() };
                    self.metrics.rule_hits.get_or_create(&labels).inc_by(counts.hits);
                }
            }
            let counts: Vec<_> = engine.take_counter_counts().collect();
            for (index, counts) in counts {
                let counter = engine.rules().counter(index);
                if counts.late > 0 {
                    self.metrics.late_events.get_or_create(&CounterLabels { counter: counter.id.clone() }).inc_by(counts.late);
                }
                if counts.capped > 0 {
                    let labels = CounterLabels { counter: counter.id.clone() };
                    self.metrics.distinct_capped.get_or_create(&labels).inc_by(counts.capped);
                }
                for (reason, n) in SkipReason::ALL.iter().zip(counts.skipped) {
                    if n > 0 {
                        let labels = SkipLabels { counter: counter.id.clone(), reason: reason.code() };
                        self.metrics.skipped_events.get_or_create(&labels).inc_by(n);
                    }
                }
            }
            // The batch's records are journaled before they go out and before anything it
            // counted can be sent (the engine stays locked, and the store sends nothing while a
            // batch runs): a next owner re-reading these events delivers the same records, and
            // a batch fenced here leaves no trace in Redis.
            if processed > 0 {
                match self.with_journal(|journal| journal.write(lane, &journaled)) {
                    None | Some(Ok(())) => {
                        self.metrics.journaled_decisions.inc_by(journaled.records.len() as u64);
                    }
                    Some(Err(JournalError::Fenced)) => {
                        // Another worker owns the partition now (the broker moved it while this
                        // one still ran): it counts and judges these events itself.
                        tracing::warn!(topic = %topic, partition = *partition, "partition taken over by another worker: dropping this batch and stopping");
                        self.metrics.journal_errors.get_or_create(&CodeLabels { code: "fenced" }).inc();
                        if let Err(e) = engine.store_mut().discard_batch(lane, messages[0].offset()) {
                            tracing::warn!(error = %e, "the counts kept besides the fenced batch are not all in Redis yet; they are sent again");
                        }
                        return Err((processed, Failure::Fenced));
                    }
                    Some(Err(e)) => {
                        self.metrics.journal_errors.get_or_create(&CodeLabels { code: e.code() }).inc();
                    }
                }
            }
            engine.store_mut().end_batch();
            if let Err(e) = engine.store_mut().tick() {
                failure.get_or_insert(e);
            }
            engine.store().counted_mark()
        };
        self.metrics.inc_events("decided", decided);
        self.metrics.inc_events("allowed", allowed);
        self.metrics.inc_events("dead_lettered", dead);
        self.metrics.redelivered_decisions.inc_by(redelivered);
        // Outside the lock: records go to the producer, each with a ticket back to `progress`.
        for output in outputs {
            progress.expect_delivery(output.offset);
            let (topic, kind) = match output.dead_letter {
                Some(_) => (&self.sink.dead_letter_topic, Kind::DeadLetter),
                None => (&self.sink.decisions_topic, Kind::Decision),
            };
            let ticket =
                Box::new(Ticket { progress: Arc::clone(progress), offset: output.offset, event_time_ms: output.event_time_ms, kind });
            self.sink.send(topic, output.key, &output.payload, output.dead_letter, ticket);
        }
        if processed > 0 {
            progress.processed(messages[processed - 1].offset(), mark);
        }
        match failure {
            None => Ok(()),
            Some(e) => Err((processed, Failure::Store(e))),
        }
    }

    /// Every `flush_interval` (at most 100 ms): let the store write behind, export its metrics,
    /// produce failed records again, and store the offsets that became committable.
    fn commit_loop(&self, consumer: &BaseConsumer<WorkerContext>, done: &Shutdown) {
        let tick = self.config.redis.flush_interval.clamp(Duration::from_millis(5), Duration::from_millis(100));
        while !done.wait(tick) {
            let durable = self.tick_store();
            self.sink.resend_failed();
            let partitions = self.lock_partitions();
            let mut list = TopicPartitionList::new();
            for ((topic, partition), state) in partitions.iter() {
                if let Some(next) = state.progress.advance(durable) {
                    let _ = list.add_partition_offset(topic, *partition, Offset::Offset(next));
                }
            }
            drop(partitions);
            if list.count() > 0 {
                if let Err(e) = consumer.store_offsets(&list) {
                    tracing::debug!(error = %e, "offsets not stored (partition revoked meanwhile?)");
                }
            }
        }
    }

    /// Exports the in-process store's size and evictions; logs evictions at most every 30 s.
    fn export_state(&self, state: StateStats) {
        let mut exported = self.exported_state.lock().unwrap_or_else(|p| p.into_inner());
        let (known, logged) = &mut *exported;
        let windows = state.evicted_keys.saturating_sub(known.evicted_keys);
        let holds = state.evicted_holds.saturating_sub(known.evicted_holds);
        if windows > 0 {
            self.metrics.evicted_keys.get_or_create(&KindLabels { kind: "window" }).inc_by(windows);
        }
        if holds > 0 {
            self.metrics.evicted_keys.get_or_create(&KindLabels { kind: "hold" }).inc_by(holds);
        }
        if (windows > 0 || holds > 0) && logged.is_none_or(|at| at.elapsed() >= Duration::from_secs(30)) {
            tracing::warn!(
                evicted_windows = state.evicted_keys,
                evicted_holds = state.evicted_holds,
                "in-process counter state at memory.max_keys: evicting the keys whose newest event is oldest \
                 (their counts restart from nothing)"
            );
            *logged = Some(Instant::now());
        }
        *known = state;
        self.metrics.state_bytes.set(i64::try_from(state.bytes).unwrap_or(i64::MAX));
    }

    /// Lets the store take in finished flushes and start due ones; exports its metrics; returns
    /// its durable mark.
    fn tick_store(&self) -> u64 {
        let mut engine = self.lock_engine();
        if let Err(e) = engine.store_mut().tick() {
            tracing::error!(error = %e, "counter store failed");
        }
        self.metrics.live_keys.set(engine.store().live_keys() as i64);
        self.export_state(engine.store().state_stats());
        if let AnyStore::Redis(redis) = engine.store_mut() {
            for sample in redis.take_flush_samples() {
                self.metrics.flush_keys.observe(sample.keys as f64);
                self.metrics.flush_seconds.observe(sample.elapsed.as_secs_f64());
            }
            if let Some(e) = redis.take_flush_error() {
                tracing::warn!(error = %e, "write-behind flush failed; its deltas are kept and sent again");
            }
            let stats = redis.stats();
            let mut exported = self.exported.lock().unwrap_or_else(|p| p.into_inner());
            let retries = stats.retries.saturating_sub(exported.retries);
            let failed = stats.failed_flushes.saturating_sub(exported.failed_flushes);
            if retries > 0 {
                self.metrics.redis_errors.get_or_create(&CodeLabels { code: "retry" }).inc_by(retries);
            }
            if failed > 0 {
                self.metrics.redis_errors.get_or_create(&CodeLabels { code: "flush_failed" }).inc_by(failed);
            }
            self.metrics.replayed_observations.inc_by(stats.skipped_applied.saturating_sub(exported.skipped_applied));
            self.metrics.stale_writes.inc_by(stats.stale_writes.saturating_sub(exported.stale_writes));
            self.metrics.redis_outages.inc_by(stats.outages.saturating_sub(exported.outages));
            self.metrics.degraded_observations.inc_by(stats.degraded_observations.saturating_sub(exported.degraded_observations));
            self.metrics.redis_data_losses.inc_by(stats.data_losses.saturating_sub(exported.data_losses));
            self.metrics.reseeded_keys.inc_by(stats.reseeded_keys.saturating_sub(exported.reseeded_keys));
            self.metrics.lost_keys.inc_by(stats.lost_keys.saturating_sub(exported.lost_keys));
            self.metrics.redis_available.set(i64::from(redis.available()));
            *exported = stats;
        }
        engine.store().durable_mark()
    }

    /// Stops the loops of `partitions`, makes their work durable and delivered by `deadline`, and
    /// commits what is. Runs on revocation and at shutdown.
    fn finish(&self, consumer: &BaseConsumer<WorkerContext>, partitions: &[PartitionKey], deadline: Instant) -> Result<(), WorkerError> {
        let loops: Vec<(PartitionKey, PartitionLoop)> = {
            let mut all = self.lock_partitions();
            partitions.iter().filter_map(|key| all.remove_entry(key)).collect()
        };
        let progress: Vec<(PartitionKey, Arc<Progress>)> =
            loops.iter().map(|(key, state)| (key.clone(), Arc::clone(&state.progress))).collect();
        stop_loops(loops.into_iter().map(|(_, state)| state).collect());
        for (key, _) in &progress {
            let lane = self.lane(&key.0, key.1);
            self.lock_engine().close_lane(lane);
            self.with_journal(|journal| journal.release(lane));
            self.metrics.assigned_partitions.dec();
            self.metrics.consumer_lag.remove(&PartitionLabels { topic: key.0.clone(), partition: key.1 });
        }

        let mut problems = Vec::new();
        // Deltas: flush, retrying until the deadline.
        loop {
            let result = self.lock_engine().store_mut().flush();
            match result {
                Ok(()) => break,
                Err(e) if Instant::now() + Duration::from_millis(200) < deadline => {
                    tracing::warn!(error = %e, "flush failed; retrying");
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => {
                    problems.push(format!("deltas not flushed: {e}"));
                    break;
                }
            }
        }
        // Records: wait for every acknowledgement, producing failed ones again.
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let flushed = self.sink.flush(remaining.min(Duration::from_secs(1)));
            self.sink.resend_failed();
            if flushed.is_ok() && self.sink.failed() == 0 {
                break;
            }
            if Instant::now() >= deadline {
                problems.push("records not acknowledged in time".to_owned());
                break;
            }
        }
        let durable = self.tick_store();
        let mut list = TopicPartitionList::new();
        for ((topic, partition), progress) in &progress {
            if let Some(next) = progress.committable(durable) {
                let _ = list.add_partition_offset(topic, *partition, Offset::Offset(next));
            }
            if progress.undelivered() > 0 {
                problems.push(format!("{topic}/{partition}: {} records unacknowledged", progress.undelivered()));
            }
        }
        if list.count() > 0 {
            // Stored as well as committed, so the consumer's close cannot commit an older stored one.
            consumer.store_offsets(&list)?;
            consumer.commit(&list, CommitMode::Sync)?;
            for element in list.elements() {
                if let Offset::Offset(next) = element.offset() {
                    let labels = PartitionLabels { topic: element.topic().to_owned(), partition: element.partition() };
                    self.metrics.committed_offset.get_or_create(&labels).set(next);
                }
            }
            tracing::info!(offsets = ?list.elements().iter().map(|e| (e.topic().to_owned(), e.partition(), e.offset())).collect::<Vec<_>>(), "committed");
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(WorkerError::ShutdownIncomplete(problems.join("; ")))
        }
    }

    /// Polls the rule files every `rules.reload_interval`; a change is validated and swapped in
    /// between two batches; a bad edit is logged with `file:line:col` and the old rules stay.
    /// Polling contents (not file events) also sees Kubernetes ConfigMap symlink swaps.
    fn watch_rules(&self, path: &Path, done: &Shutdown) {
        let mut list_files: Vec<String> = self.lock_engine().rules().list_file_names().to_vec();
        let mut seen = fingerprint(path, &list_files);
        while !done.wait(self.config.rules.reload_interval) {
            let now = fingerprint(path, &list_files);
            if now == seen {
                continue;
            }
            seen = now;
            match rule_files::load_with(path, self.config.rules.allow_empty) {
                Ok(rules) => {
                    let active = rules.active().len();
                    // A list file is watched from the load that names it.
                    list_files = rules.list_file_names().to_vec();
                    seen = fingerprint(path, &list_files);
                    let version = rules.version().to_owned();
                    let lists: Vec<String> = rules.lists().map(|(id, set)| format!("{id} ({} {})", set.len(), set.kind().as_str())).collect();
                    self.metrics.rules_loaded(&rules);
                    let (_, changes) = self.lock_engine().reload_rules(rules);
                    self.metrics.rules_active.set(active as i64);
                    self.metrics.rule_reloads.get_or_create(&ResultLabels { result: "ok" }).inc();
                    tracing::info!(
                        path = %path.display(),
                        active,
                        version,
                        fresh = ?changes.fresh,
                        kept = ?changes.kept,
                        lists = ?lists,
                        "rules reloaded: counters in `fresh` start from nothing, those in `kept` keep their state"
                    );
                    if !changes.redefined.is_empty() {
                        tracing::warn!(
                            counters = ?changes.redefined,
                            "counters keep the state counted under their previous match or allow_negative; rename a counter to start it afresh"
                        );
                    }
                }
                Err(error) => {
                    self.metrics.rule_reloads.get_or_create(&ResultLabels { result: "error" }).inc();
                    match &error {
                        LoadError::Invalid(errors) => {
                            for diagnostic in &errors.0 {
                                tracing::error!(target: "vigil::rules", "{diagnostic}");
                            }
                        }
                        other => tracing::error!(target: "vigil::rules", "{other}"),
                    }
                    tracing::warn!(path = %path.display(), code = error.code(), "rule reload refused; the previous rules stay in force");
                }
            }
        }
    }
}

/// Stops partition loops and waits for them (each finishes the batch it is on).
fn stop_loops(loops: Vec<PartitionLoop>) {
    let mut threads = Vec::new();
    for mut state in loops {
        state.stop.store(true, Ordering::Release);
        state.sender = None;
        threads.extend(state.thread.take());
    }
    for thread in threads {
        let _ = thread.join();
    }
}

/// A digest of the rule files' names and contents, and of the list files' sizes and times (a
/// million-line list is not re-read every interval); `None` if they cannot be read.
fn fingerprint(path: &Path, list_files: &[String]) -> Option<blake3::Hash> {
    let files: Vec<PathBuf> = rule_files::rule_files(path).ok()?;
    let mut hasher = blake3::Hasher::new();
    for file in files {
        hasher.update(file.to_string_lossy().as_bytes());
        hasher.update(&[0]);
        hasher.update(&std::fs::read(&file).ok()?);
        hasher.update(&[0]);
    }
    for file in list_files {
        hasher.update(file.as_bytes());
        match std::fs::metadata(file) {
            Ok(meta) => {
                hasher.update(&meta.len().to_le_bytes());
                let modified = meta.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
                hasher.update(&modified.map_or(0, |d| d.as_nanos()).to_le_bytes());
            }
            Err(_) => {
                hasher.update(b"missing");
            }
        }
    }
    Some(hasher.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reload_fingerprint_follows_rule_files_and_the_list_files_they_name() {
        let dir = tempfile::tempdir().unwrap();
        let rules = dir.path().join("rules");
        std::fs::create_dir_all(rules.join("lists")).unwrap();
        std::fs::write(rules.join("r.toml"), "[[list]]\nid='cards'\nfile='lists/cards.txt'\n[[rule]]\nid='r'\naction='block'\nwhen=\"card in @cards\"\n").unwrap();
        let list = rules.join("lists/cards.txt");
        std::fs::write(&list, "c-1\n").unwrap();
        let loaded = rule_files::load(&rules).unwrap();
        let lists = loaded.list_file_names().to_vec();
        assert_eq!(lists, [list.display().to_string()]);
        let before = fingerprint(&rules, &lists);
        assert_eq!(fingerprint(&rules, &lists), before, "nothing changed");
        // A list file replaced whole (a new size) is a change, though no rule file changed.
        std::fs::write(&list, "c-1\nc-2\n").unwrap();
        let after = fingerprint(&rules, &lists);
        assert_ne!(after, before);
        assert!(rule_files::load(&rules).unwrap().rules().len() == 1);
        // A rule file edit is a change too.
        std::fs::write(rules.join("r.toml"), "[[rule]]\nid='r'\naction='alert'\n").unwrap();
        assert_ne!(fingerprint(&rules, &lists), after);
    }
}
