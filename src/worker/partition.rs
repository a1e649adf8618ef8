//! The partition loops: one ordered loop per assigned partition. A batch is decoded under the
//! engine lock; with Redis, the windows and holds it lacks are read with the engine free (other
//! partitions count meanwhile); then it is counted and decided under the lock, journaled before
//! anything it counted can reach the store, and its records go to the producer with a ticket
//! back to the partition's [`Progress`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::message::{Message, OwnedHeaders, OwnedMessage};

use super::shared::{stop_loops, PartitionKey, PartitionLoop, Polled, Worker};
use crate::event::{Event, Projection};
use crate::pipeline::{Engine, Touched};
use crate::rules::{record, Action, EventSource, SkipReason};
use crate::sink::{dead_letter_headers, Kind, Ticket};
use crate::source::{self, Progress, Rejection};
use crate::store::journal::JournalBatch;
use crate::store::{
    AnyStore, CounterStore, Deferred, EarlyHoldReads, EarlyReader, EarlyReads, EarlyReplies,
    HoldSpace, InputPosition, Journal, JournalError, PendingRead, StoreError,
};
use crate::telemetry::{
    ActionLabels, CodeLabels, CounterLabels, DirectionLabels, Metrics, ReasonLabels, RuleHitLabels,
    RuleLabels, SkipLabels, Stages,
};

/// Messages a partition loop takes per engine lock.
const MAX_BATCH: usize = 1024;
/// Messages judged per step while other workers count into the same keys: a step's
/// observations on shared keys are counted ahead, in Redis before the step is journaled, so a
/// worker stalled and fenced mid-step leaves at most this many events counted ahead for the
/// partition's next owner to judge against (RELIABILITY.md, "keys counted ahead").
const MAX_SHARED_STEP: usize = 64;
/// Batches waiting per partition loop; the consumer loop waits when it is full.
const QUEUE_DEPTH: usize = 8;

/// Why a partition loop stopped processing a batch.
enum Failure {
    /// The counter store failed; the rest of the batch is tried again.
    Store(StoreError),
    /// The next event (at this event time) is too far ahead of the slowest partition: the rest
    /// of the batch waits for it.
    Ahead(i64),
    /// Another worker owns the partition now: the loop stops.
    Fenced,
}

/// Where a batch comes from, and what its records need.
struct PartitionBatch<'a> {
    topic: &'a str,
    partition: i32,
    /// The partition's lane in the store and the journal.
    lane: u64,
    /// What a previous owner produced for the events this one may read again.
    journal: &'a Journal,
    emit_allow: bool,
}

/// A record or dead letter for the producer, sent once the engine lock is released.
struct Output<'m> {
    offset: i64,
    key: Option<&'m [u8]>,
    payload: Vec<u8>,
    dead_letter: Option<OwnedHeaders>,
    event_time_ms: Option<i64>,
    /// When the consumer's poll returned the event.
    polled_at: Instant,
}

/// What judging a batch produced under the engine lock.
#[derive(Default)]
struct Judged<'m> {
    outputs: Vec<Output<'m>>,
    /// Messages processed, from the batch's first.
    processed: usize,
    /// The store failure that stopped the batch, if one did.
    failure: Option<StoreError>,
    /// The event time of the event the batch stopped at because it is too far ahead of the
    /// slowest partition (`input.max_partition_skew`).
    ahead: Option<i64>,
    /// The records to journal, with the batch's end and watermark.
    journaled: JournalBatch,
    decided: u64,
    allowed: u64,
    dead: u64,
    redelivered: u64,
    /// Decisions made on a window that already held the event's own observation, counted ahead
    /// by a previous owner that stopped before delivering them (see `judged_as_held`).
    judged_as_held: u64,
    /// The record being written, its buffer reused across the batch.
    record: Vec<u8>,
    /// What the store left for after the handover (see `seal_batch_deferring`).
    settle: Deferred,
}

type Events<'m> = Vec<Result<Event<'m>, Rejection>>;

impl Worker {
    pub(super) fn start_partition(self: &Arc<Self>, key: PartitionKey) {
        let (sender, receiver) = mpsc::sync_channel(QUEUE_DEPTH);
        let stop = Arc::new(AtomicBool::new(false));
        let progress = Arc::new(Progress::new());
        let thread = {
            let (worker, stop, progress, key) = (
                Arc::clone(self),
                Arc::clone(&stop),
                Arc::clone(&progress),
                key.clone(),
            );
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
        self.alignment
            .assign(self.lane(&key.0, key.1), Instant::now());
        let previous = self.lock_partitions().insert(
            key,
            PartitionLoop {
                sender: Some(sender),
                gathered: Polled::default(),
                stop,
                thread: Some(thread),
                progress,
            },
        );
        if let Some(previous) = previous {
            stop_loops(vec![previous]);
        }
    }

    fn partition_loop(
        &self,
        key: &PartitionKey,
        receiver: &mpsc::Receiver<Polled>,
        stop: &AtomicBool,
        progress: &Arc<Progress>,
    ) {
        // What a previous owner produced for the events this one may read again.
        let lane = self.lane(&key.0, key.1);
        let loaded = self
            .with_journal(|journal| journal.claim(lane))
            .unwrap_or_else(|| Ok(Journal::default()));
        // Not claimed (Redis did not answer): batches go out unjournaled, and each new batch
        // tries the claim again, so the lane is fenced against a zombie once Redis answers.
        let mut claimed = loaded.is_ok();
        let mut journal = loaded.unwrap_or_else(|e| {
            tracing::warn!(error = %e, partition = key.1, "cannot read the decision journal: events re-read after a crash are judged again, and batches go out unjournaled until Redis answers");
            Journal::default()
        });
        if let Some(covered) = journal.covered {
            tracing::info!(
                partition = key.1,
                covered,
                records = journal.records.len(),
                "decision journal loaded"
            );
        }
        let mut resumed = false;
        // What the last batch left over: the next one begins with it.
        let mut carried = None::<Polled>;
        loop {
            if stop.load(Ordering::Acquire) || self.shutdown.is_triggered() {
                return;
            }
            let mut batch = match carried.take() {
                Some(batch) => batch,
                None => match receiver.recv_timeout(Duration::from_millis(50)) {
                    Ok(batch) => batch,
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => return,
                },
            };
            while batch.len() < MAX_BATCH {
                match receiver.try_recv() {
                    Ok(more) => batch.append(more),
                    Err(_) => break,
                }
            }
            // The poll thread hands over all a partition gathered while its queue was full
            // (thousands of messages in a backlog): one batch takes MAX_BATCH of them, so that
            // the engine lock and the decoded events' memory stay bounded per batch.
            carried = batch.split_off(MAX_BATCH);
            if !claimed {
                if let Some(Ok(loaded)) = self.with_journal(|journal| journal.claim(lane)) {
                    tracing::info!(
                        partition = key.1,
                        covered = ?loaded.covered,
                        "decision journal claimed"
                    );
                    journal = loaded;
                    claimed = true;
                }
            }
            if !resumed {
                // The watermark continues where it was just before the first offset read.
                resumed = true;
                let first = batch.messages.first().map_or(0, Message::offset);
                match journal.newest_before(first) {
                    Some(newest) => self.lock_engine().resume_lane(lane, newest),
                    None if journal.covered.is_some() => {
                        tracing::warn!(
                            partition = key.1,
                            first,
                            "no watermark recorded before the first offset read: it starts afresh"
                        )
                    }
                    None => {}
                }
            }
            self.process(key, &batch, stop, progress, &journal);
        }
    }

    /// Processes a batch in order; a store failure is retried with backoff from the first event
    /// not processed, until it succeeds or the loop is stopped (its offsets then stay uncommitted).
    fn process(
        &self,
        key: &PartitionKey,
        batch: &Polled,
        stop: &AtomicBool,
        progress: &Arc<Progress>,
        journal: &Journal,
    ) {
        let entered = Instant::now();
        if let Some(first) = batch.polled_at.first() {
            self.metrics
                .stages
                .queued
                .observe(entered.saturating_duration_since(*first).as_secs_f64());
        }
        self.metrics.batch_messages.observe(batch.len() as f64);
        // Time in `process_some` is timed by its stages; the rest of this call is `paused`.
        let mut working = Duration::ZERO;
        self.process_retrying(key, batch, stop, progress, journal, &mut working);
        self.metrics
            .stages
            .paused
            .observe(entered.elapsed().saturating_sub(working).as_secs_f64());
    }

    fn process_retrying(
        &self,
        key: &PartitionKey,
        batch: &Polled,
        stop: &AtomicBool,
        progress: &Arc<Progress>,
        journal: &Journal,
        working: &mut Duration,
    ) {
        if !self.wait_while_saturated(stop) {
            return;
        }
        let mut start = 0;
        let mut backoff = Duration::from_millis(50);
        while start < batch.len() {
            let began = Instant::now();
            let shared = self
                .alignment
                .others_active(Instant::now(), super::alignment::wall_ms());
            let end = if shared {
                (start + MAX_SHARED_STEP).min(batch.len())
            } else {
                batch.len()
            };
            let outcome = self.process_some(
                key,
                &batch.messages[start..end],
                &batch.polled_at[start..end],
                progress,
                journal,
            );
            *working += began.elapsed();
            match outcome {
                Ok(()) => {
                    start = end;
                    backoff = Duration::from_millis(50);
                }
                Err((_, Failure::Fenced)) => {
                    stop.store(true, Ordering::Release);
                    return;
                }
                Err((done, Failure::Ahead(event_ms))) => {
                    start += done;
                    if !self.wait_for_slower_partitions(key, event_ms, stop) {
                        return;
                    }
                }
                Err((done, Failure::Store(error))) => {
                    start += done;
                    self.metrics
                        .redis_errors
                        .get_or_create(&CodeLabels {
                            code: "read_failed",
                        })
                        .inc();
                    tracing::warn!(error = %error, partition = key.1, "counter store unavailable; retrying the batch");
                    if self.shutdown.wait(backoff) || stop.load(Ordering::Acquire) {
                        return;
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    /// Waits until the slowest other partition of the group is within `max_partition_skew` of
    /// `event_ms` (the next event's time), or goes idle. False if the loop was stopped meanwhile.
    fn wait_for_slower_partitions(
        &self,
        key: &PartitionKey,
        event_ms: i64,
        stop: &AtomicBool,
    ) -> bool {
        let lane = self.lane(&key.0, key.1);
        let started = Instant::now();
        // Its position is the event it waits for: a slower partition waiting for it cannot be.
        self.alignment.advance(lane, event_ms, started);
        let mut waited = started;
        let allowed = loop {
            let now = Instant::now();
            self.metrics
                .partition_wait_seconds
                .inc_by(now.duration_since(waited).as_secs_f64());
            waited = now;
            if self
                .alignment
                .limit(lane, now, super::alignment::wall_ms())
                .is_none_or(|limit| event_ms <= limit)
            {
                break true;
            }
            if self.shutdown.wait(Duration::from_millis(5)) || stop.load(Ordering::Acquire) {
                break false;
            }
        };
        let waited_ms = started.elapsed().as_millis() as u64;
        if waited_ms >= 1_000 {
            tracing::debug!(partition = key.1, waited_ms, "waited for slower partitions");
        }
        allowed
    }

    /// While the local counts waiting for Redis are at their bound (a long outage), the partition
    /// waits: its events stay in Kafka. False if the loop was stopped meanwhile.
    fn wait_while_saturated(&self, stop: &AtomicBool) -> bool {
        // Without taking the engine: every tick under it records whether the store is full.
        if !self.saturated.load(Ordering::Acquire) {
            return true;
        }
        let mut logged = None::<Instant>;
        loop {
            {
                let mut engine = self.lock_engine();
                self.note_saturation(&engine);
                if !engine.store().saturated() {
                    self.metrics.store_saturated.set(0);
                    return true;
                }
                let _ = engine.store_mut().tick();
                self.note_saturation(&engine);
            }
            self.metrics.store_saturated.set(1);
            if logged.is_none_or(|at| at.elapsed() >= Duration::from_secs(30)) {
                tracing::warn!("local counter state is full while Redis is unavailable (redis.max_local_keys or half of memory.max_state_bytes): partitions wait");
                logged = Some(Instant::now());
            }
            if self.shutdown.wait(Duration::from_millis(50)) || stop.load(Ordering::Acquire) {
                return false;
            }
        }
    }

    /// Decodes, counts and decides `messages` (polled at `polled_at`) under the engine lock, then
    /// hands their records to the producer. On a store failure, returns how many messages were
    /// processed.
    fn process_some(
        &self,
        key: &PartitionKey,
        messages: &[OwnedMessage],
        polled_at: &[Instant],
        progress: &Arc<Progress>,
        journal: &Journal,
    ) -> Result<(), (usize, Failure)> {
        let mut stopwatch = Stopwatch::start();
        let judged = self.judge_and_journal(key, messages, polled_at, journal, &mut stopwatch);
        let (judged, mark) = match judged {
            Ok(judged) => judged,
            Err(stopped) => {
                stopwatch.observe(&self.metrics.stages);
                return Err(stopped);
            }
        };
        self.metrics.inc_events("decided", judged.decided);
        self.metrics.inc_events("allowed", judged.allowed);
        self.metrics.inc_events("dead_lettered", judged.dead);
        self.metrics
            .redelivered_decisions
            .inc_by(judged.redelivered);
        self.metrics
            .decisions_judged_as_held
            .inc_by(judged.judged_as_held);
        // Outside the lock: records go to the producer, each with a ticket back to `progress`.
        self.send_outputs(judged.outputs, progress);
        stopwatch.lap(Stage::Handover);
        stopwatch.observe(&self.metrics.stages);
        judged.settle.run();
        if judged.processed > 0 {
            progress.processed(messages[judged.processed - 1].offset(), mark);
        }
        match (judged.failure, judged.ahead) {
            (Some(e), _) => Err((judged.processed, Failure::Store(e))),
            (None, Some(event_ms)) => Err((judged.processed, Failure::Ahead(event_ms))),
            (None, None) => Ok(()),
        }
    }

    /// What decoding uses to count events whose time strays from their record timestamp.
    fn skew_meter(&self) -> SkewMeter<'_> {
        SkewMeter {
            metrics: &self.metrics,
            skew_ms: self.config.input.record_time_skew_ms(),
        }
    }

    /// Decodes the batch and lists what it touches under the engine lock, reads the windows and
    /// holds it lacks with the lock released, then under the lock again: prefetches the rest,
    /// counts and judges it, exports its per-rule and per-counter counts and journals its
    /// records. Returns what it produced and the store's counted mark after it.
    fn judge_and_journal<'m>(
        &self,
        (topic, partition): &PartitionKey,
        messages: &'m [OwnedMessage],
        polled_at: &[Instant],
        journal: &Journal,
        stopwatch: &mut Stopwatch,
    ) -> Result<(Judged<'m>, u64), (usize, Failure)> {
        let max_bytes = self.config.worker.max_event_bytes;
        // Decoded before taking the engine (other partitions judge meanwhile), for the rule set
        // last seen in force: checked under the engine.
        let decoded = self.decoding().map(|(generation, projection)| {
            (
                generation,
                decode_messages(&projection, messages, max_bytes),
            )
        });
        stopwatch.lap(Stage::Decode);
        // With Redis, the windows and holds the batch lacks are read before it takes the engine
        // for good: other partitions judge meanwhile.
        let (mut events, generation, mut touched, mut touched_holds, early, early_holds) = {
            let mut engine = self.lock_engine();
            stopwatch.lap(Stage::Lock);
            let skew = self.skew_meter();
            let events = match decoded {
                Some((generation, events)) if generation == engine.rules_generation() => {
                    admit_batch(&engine, messages, events, Some(&skew))
                }
                _ => {
                    self.note_decoding(&engine);
                    decode_batch(&engine, messages, max_bytes, Some(&skew))
                }
            };
            stopwatch.lap(Stage::Decode);
            let shared = self
                .alignment
                .others_active(Instant::now(), super::alignment::wall_ms());
            engine.store_mut().set_shared(shared);
            let (mut touched, mut touched_holds) = (Touched::default(), Vec::new());
            let (early, early_holds) =
                plan_early_reads(&mut engine, &events, &mut touched, &mut touched_holds);
            let generation = engine.rules_generation();
            (
                events,
                generation,
                touched,
                touched_holds,
                early,
                early_holds,
            )
        };
        // The holds go first, on their own connection: both reads are out at once.
        let early_holds =
            early_holds.map(|(mut reads, reader)| (reader.start_holds(&mut reads), reads));
        let early = early.map(|(mut reads, reader)| {
            // Decoded here: the engine then only takes the windows in.
            let replies = reader.read(&mut reads);
            let replies = reads.decode(replies);
            (reads, replies)
        });
        let early_holds =
            early_holds.map(|(pending, reads)| (reads, pending.and_then(PendingRead::wait)));
        stopwatch.lap(Stage::Load);
        let mut engine = self.lock_engine();
        stopwatch.lap(Stage::Lock);
        if engine.rules_generation() != generation {
            // Other rules were put in force meanwhile: the events are decoded for them.
            events = decode_batch(&engine, messages, max_bytes, None);
            touched.clear();
            touched_holds.clear();
            stopwatch.lap(Stage::Decode);
        }
        if let AnyStore::Redis(store) = engine.store_mut() {
            if let Some((reads, replies)) = early {
                store.take_early_reads(reads, replies);
            }
            if let Some((reads, replies)) = early_holds {
                store.take_early_hold_reads(reads, replies);
            }
        }
        let shared = self
            .alignment
            .others_active(Instant::now(), super::alignment::wall_ms());
        engine.store_mut().set_shared(shared);
        if engine.store().prefetches() {
            prefetch(&mut engine, &events, touched, touched_holds)
                .map_err(|e| (0, Failure::Store(e)))?;
        }
        let batch = PartitionBatch {
            topic,
            partition: *partition,
            lane: self.lane(topic, *partition),
            journal,
            emit_allow: self.config.worker.emit_allow,
        };
        let limit = self
            .alignment
            .limit(batch.lane, Instant::now(), super::alignment::wall_ms());
        if shared {
            // Keys other workers count too are counted ahead: in Redis first, so that the
            // batch sees everything they counted before it.
            count_ahead(&mut engine, batch.lane, messages, &events, limit)
                .map_err(|e| (0, Failure::Store(e)))?;
        }
        stopwatch.lap(Stage::Load);
        // Nothing else the batch counts is sent before its records are journaled (below).
        let first_offset = messages[0].offset();
        engine.store_mut().begin_batch(batch.lane, first_offset);
        let mut judged = self.judge_batch(&mut engine, &batch, messages, polled_at, &events, limit);
        if let Some(newest) = engine.newest(batch.lane) {
            self.alignment.advance(batch.lane, newest, Instant::now());
        }
        // Offsets are committed at batch ends: a next owner resumes after one, with the
        // watermark recorded there.
        if let Some(last) = judged
            .processed
            .checked_sub(1)
            .map(|i| messages[i].offset())
        {
            judged.journaled.covered = Some(last);
            judged.journaled.mark = engine.newest(batch.lane).map(|newest| (last, newest));
        }
        self.export_rule_counts(&mut engine);
        self.export_counter_counts(&mut engine);
        // The journal is written without the engine: other partitions count meanwhile, and
        // flushes hold back what this batch counted until the seal says it is journaled.
        // Caching the windows the batch read waits until the records are handed over.
        let seal;
        (seal, judged.settle) = engine.store_mut().seal_batch_deferring();
        if let Err(e) = engine.store_mut().tick() {
            judged.failure.get_or_insert(e);
        }
        self.note_saturation(&engine);
        let mark = engine.store().counted_mark();
        drop(engine);
        stopwatch.lap(Stage::Judge);
        if judged.processed > 0 {
            self.journal_batch(&batch, first_offset, &judged.journaled)
                .map_err(|failure| (judged.processed, failure))?;
        }
        seal.journaled();
        stopwatch.lap(Stage::Journal);
        Ok((judged, mark))
    }

    /// Counts and judges the batch's events in order, dead-lettering those that did not decode;
    /// stops at the first store failure, or at the first event later than `limit` (more than
    /// `max_partition_skew` ahead of the slowest partition).
    fn judge_batch<'m>(
        &self,
        engine: &mut Engine<AnyStore>,
        batch: &PartitionBatch<'_>,
        messages: &'m [OwnedMessage],
        polled_at: &[Instant],
        events: &Events<'_>,
        limit: Option<i64>,
    ) -> Judged<'m> {
        let mut judged = Judged {
            record: Vec::with_capacity(512),
            ..Judged::default()
        };
        for ((message, event), &polled_at) in messages.iter().zip(events).zip(polled_at) {
            match event {
                Err(rejection) => {
                    self.dead_letter(batch, message, polled_at, rejection, &mut judged)
                }
                Ok(event) if limit.is_some_and(|limit| event.ts > limit) => {
                    // Too far ahead of the slowest partition: it and the rest wait.
                    judged.ahead = Some(event.ts);
                    break;
                }
                Ok(event) => {
                    if let Err(e) =
                        self.judge_one(engine, batch, message, polled_at, event, &mut judged)
                    {
                        judged.failure = Some(e);
                        break;
                    }
                }
            }
            judged.processed += 1;
        }
        judged
    }

    /// A message that did not decode (or was refused): it goes to the dead-letter topic as it
    /// came, with the reason in its headers.
    #[inline]
    fn dead_letter<'m>(
        &self,
        batch: &PartitionBatch<'_>,
        message: &'m OwnedMessage,
        polled_at: Instant,
        rejection: &Rejection,
        judged: &mut Judged<'m>,
    ) {
        let offset = message.offset();
        judged.dead += 1;
        self.metrics
            .dead_letters
            .get_or_create(&ReasonLabels {
                reason: rejection.code(),
            })
            .inc();
        let headers = dead_letter_headers(
            message.headers(),
            rejection.code(),
            &rejection.to_string(),
            batch.topic,
            batch.partition,
            offset,
        );
        judged.outputs.push(Output {
            offset,
            key: message.key(),
            payload: message.payload().unwrap_or_default().to_vec(),
            dead_letter: Some(headers),
            event_time_ms: None,
            polled_at,
        });
    }

    /// Counts and judges one event; its record is journaled and sent unless a previous owner
    /// already produced one for it, which is sent again instead.
    #[inline]
    fn judge_one<'m>(
        &self,
        engine: &mut Engine<AnyStore>,
        batch: &PartitionBatch<'_>,
        message: &'m OwnedMessage,
        polled_at: Instant,
        event: &Event<'_>,
        judged: &mut Judged<'m>,
    ) -> Result<(), StoreError> {
        let offset = message.offset();
        let origin = InputPosition {
            lane: batch.lane,
            offset,
        };
        let held_before = engine.store().judged_as_held();
        let decision = engine.evaluate(event, origin)?;
        // Delivered from the journal, a decision made again does not count.
        judged.judged_as_held += u64::from(
            engine.store().judged_as_held() > held_before
                && batch.journal.produced(offset).is_none(),
        );
        if decision.is_empty() {
            judged.allowed += 1;
        } else {
            judged.decided += 1;
        }
        let event_time_ms = message.timestamp().to_millis();
        if let Some(earlier) = batch.journal.produced(offset) {
            // Read again after a crash: deliver what the first run produced, byte
            // for byte (this run counted only what the first had not flushed).
            judged.redelivered += 1;
            if let Some(payload) = earlier {
                let payload = payload.to_vec();
                judged.outputs.push(Output {
                    offset,
                    key: message.key(),
                    payload,
                    dead_letter: None,
                    event_time_ms,
                    polled_at,
                });
            }
        } else if !decision.is_empty() || batch.emit_allow {
            judged.record.clear();
            let source = EventSource::Kafka {
                topic: batch.topic,
                partition: batch.partition,
                offset,
            };
            record::write_record(&mut judged.record, engine.rules(), event, &decision, source);
            let action = decision
                .action(engine.rules())
                .map_or("allow", Action::as_str);
            self.metrics
                .decisions
                .get_or_create(&ActionLabels { action })
                .inc();
            judged
                .journaled
                .records
                .push((offset, judged.record.clone()));
            let payload = judged.record.clone();
            judged.outputs.push(Output {
                offset,
                key: message.key(),
                payload,
                dead_letter: None,
                event_time_ms,
                polled_at,
            });
        }
        for hit in decision.hits.iter().filter(|h| h.degraded) {
            let rule = engine.rules().rule(hit.rule).id.clone();
            self.metrics
                .degraded_hits
                .get_or_create(&RuleLabels { rule })
                .inc();
        }
        Ok(())
    }

    /// Exports the hits of each rule since the last batch.
    fn export_rule_counts(&self, engine: &mut Engine<AnyStore>) {
        let counts: Vec<_> = engine.take_rule_counts().collect();
        for (index, counts) in counts {
            let rule = engine.rules().rule(index);
            if counts.on_dropped_state > 0 {
                self.metrics
                    .state_dropped_judgements
                    .get_or_create(&RuleLabels {
                        rule: rule.id.clone(),
                    })
                    .inc_by(counts.on_dropped_state);
            }
            // By the mode each hit fired in (a rule outside its rollout fires in shadow mode).
            for (mode, hits) in [
                ("enforce", counts.hits - counts.shadow_hits),
                ("shadow", counts.shadow_hits),
            ] {
                if hits == 0 {
                    continue;
                }
                let labels = RuleHitLabels {
                    rule: rule.id.clone(),
                    mode,
                    action: rule.action.as_str(),
                };
                self.metrics.rule_hits.get_or_create(&labels).inc_by(hits);
            }
        }
    }

    /// Exports each counter's late, capped and skipped observations since the last batch.
    fn export_counter_counts(&self, engine: &mut Engine<AnyStore>) {
        let counts: Vec<_> = engine.take_counter_counts().collect();
        for (index, counts) in counts {
            let counter = engine.rules().counter(index);
            if counts.late > 0 {
                self.metrics
                    .late_events
                    .get_or_create(&CounterLabels {
                        counter: counter.id.clone(),
                    })
                    .inc_by(counts.late);
            }
            if counts.capped > 0 {
                let labels = CounterLabels {
                    counter: counter.id.clone(),
                };
                self.metrics
                    .distinct_capped
                    .get_or_create(&labels)
                    .inc_by(counts.capped);
            }
            for (reason, n) in SkipReason::ALL.iter().zip(counts.skipped) {
                if n > 0 {
                    let labels = SkipLabels {
                        counter: counter.id.clone(),
                        reason: reason.code(),
                    };
                    self.metrics.skipped_events.get_or_create(&labels).inc_by(n);
                }
            }
        }
    }

    /// Journals the batch's records, without the engine. They are journaled before they go out
    /// and before anything the batch counted can be sent (the store holds it back until the
    /// batch's seal says so): a next owner re-reading these events delivers the same records,
    /// and a batch fenced here leaves no trace in Redis. `Fenced` if another worker owns the
    /// partition.
    fn journal_batch(
        &self,
        batch: &PartitionBatch<'_>,
        first_offset: i64,
        journaled: &JournalBatch,
    ) -> Result<(), Failure> {
        // The writer only to hand the write over and to take its reply in: other partitions'
        // writes go with this one, in one round trip.
        let written = self
            .with_journal(|journal| journal.begin_write(batch.lane, journaled))
            .map(|write| {
                let write = write?;
                let reply = write.wait();
                self.with_journal(|journal| journal.finish_write(write, reply))
                    .expect("a journal began the write")
            });
        match written {
            None | Some(Ok(())) => {
                self.metrics
                    .journaled_decisions
                    .inc_by(journaled.records.len() as u64);
            }
            Some(Err(JournalError::Fenced)) => {
                // Another worker owns the partition now (the broker moved it while this
                // one still ran): it counts and judges these events itself.
                tracing::warn!(topic = %batch.topic, partition = batch.partition, "partition taken over by another worker: dropping this batch and stopping");
                self.metrics
                    .journal_errors
                    .get_or_create(&CodeLabels { code: "fenced" })
                    .inc();
                let mut engine = self.lock_engine();
                if let Err(e) = engine.store_mut().discard_batch(batch.lane, first_offset) {
                    tracing::warn!(error = %e, "the counts kept besides the fenced batch are not all in Redis yet; they are sent again");
                }
                return Err(Failure::Fenced);
            }
            Some(Err(e)) => {
                tracing::warn!(error = %e, partition = batch.partition, "cannot journal the batch's decisions: they go out unjournaled");
                self.metrics
                    .journal_errors
                    .get_or_create(&CodeLabels { code: e.code() })
                    .inc();
            }
        }
        Ok(())
    }

    /// Hands the batch's records and dead letters to the producer, each with a ticket back to
    /// `progress`; a decision's time from poll to here is vigil's own latency (`until=produced`).
    fn send_outputs(&self, outputs: Vec<Output<'_>>, progress: &Arc<Progress>) {
        for output in outputs {
            progress.expect_delivery(output.offset);
            let (topic, kind) = match output.dead_letter {
                Some(_) => (&self.sink.dead_letter_topic, Kind::DeadLetter),
                None => (&self.sink.decisions_topic, Kind::Decision),
            };
            let ticket = Box::new(Ticket {
                progress: Arc::clone(progress),
                offset: output.offset,
                event_time_ms: output.event_time_ms,
                polled_at: output.polled_at,
                kind,
            });
            self.sink.send(
                topic,
                output.key,
                &output.payload,
                output.dead_letter,
                ticket,
            );
            if kind == Kind::Decision {
                self.metrics
                    .processing_produced
                    .observe(output.polled_at.elapsed().as_secs_f64());
            }
        }
    }
}

/// The stages of a batch a [`Stopwatch`] times (`vigil_processing_stage_seconds`).
#[derive(Clone, Copy)]
enum Stage {
    Lock,
    Decode,
    Load,
    Judge,
    Journal,
    Handover,
}

/// Times a batch's consecutive stages; a stage met twice (the engine is taken twice with
/// Redis) adds up, and each is observed once per batch.
struct Stopwatch {
    lap: Instant,
    spent: [Duration; 6],
}

impl Stopwatch {
    fn start() -> Stopwatch {
        Stopwatch {
            lap: Instant::now(),
            spent: [Duration::ZERO; 6],
        }
    }

    /// Adds the time since the previous lap to `stage`.
    fn lap(&mut self, stage: Stage) {
        let now = Instant::now();
        self.spent[stage as usize] += now.duration_since(self.lap);
        self.lap = now;
    }

    fn observe(&self, stages: &Stages) {
        let series = [
            &stages.lock,
            &stages.decode,
            &stages.load,
            &stages.judge,
            &stages.journal,
            &stages.handover,
        ];
        for (histogram, spent) in series.into_iter().zip(self.spent) {
            histogram.observe(spent.as_secs_f64());
        }
    }
}

/// Counts events whose `ts` strays from their record timestamp (`input.record_time_skew`).
struct SkewMeter<'a> {
    metrics: &'a Metrics,
    skew_ms: Option<i64>,
}

impl SkewMeter<'_> {
    fn observe(&self, event: &Event<'_>, record_time: Option<i64>) {
        let (Some(skew_ms), Some(record), Some(stamped)) =
            (self.skew_ms, record_time, event.stamped_ts())
        else {
            return;
        };
        let direction = match stamped.saturating_sub(record) {
            d if d > skew_ms => "ahead",
            d if d < -skew_ms => "behind",
            _ => return,
        };
        self.metrics
            .event_time_skew
            .get_or_create(&DirectionLabels { direction })
            .inc();
    }
}

/// Decodes each message (its time from the record timestamp if so configured), meters its `ts`
/// against the record timestamp (`skew`: once per batch) and refuses events too far in the
/// future.
fn decode_batch<'m>(
    engine: &Engine<AnyStore>,
    messages: &'m [OwnedMessage],
    limit: usize,
    skew: Option<&SkewMeter<'_>>,
) -> Events<'m> {
    let events = decode_messages(engine.rules().projection(), messages, limit);
    admit_batch(engine, messages, events, skew)
}

/// Decodes each message (its time from the record timestamp if so configured) for the rule set
/// whose projection this is.
fn decode_messages<'m>(
    projection: &Projection,
    messages: &'m [OwnedMessage],
    limit: usize,
) -> Events<'m> {
    messages
        .iter()
        .map(|m| source::decode_message(m.payload(), m.timestamp().to_millis(), limit, projection))
        .collect()
}

/// Meters the decoded events' `ts` against their record timestamps (`skew`: once per batch) and
/// refuses those too far in the future.
fn admit_batch<'m>(
    engine: &Engine<AnyStore>,
    messages: &[OwnedMessage],
    mut events: Events<'m>,
    skew: Option<&SkewMeter<'_>>,
) -> Events<'m> {
    for (message, decoded) in messages.iter().zip(&mut events) {
        let Ok(event) = decoded else {
            continue;
        };
        if let Some(skew) = skew {
            skew.observe(event, message.timestamp().to_millis());
        }
        if let Err(bad) = engine.admit(event) {
            *decoded = Err(bad.into());
        }
    }
    events
}

/// Hands the store what the batch will count (the events `judge_batch` evaluates: those that
/// decoded, up to the first past `limit`), to count ahead where others count too.
fn count_ahead(
    engine: &mut Engine<AnyStore>,
    lane: u64,
    messages: &[OwnedMessage],
    events: &Events<'_>,
    limit: Option<i64>,
) -> Result<(), StoreError> {
    let evaluated = messages
        .iter()
        .zip(events)
        .filter_map(|(message, event)| {
            event
                .as_ref()
                .ok()
                .map(|event| (event, message.offset(), message.key()))
        })
        .take_while(|(event, _, _)| limit.is_none_or(|limit| event.ts <= limit));
    let mut planned = Vec::new();
    engine.plan_counts(lane, evaluated, &mut planned);
    engine.store_mut().count_ahead(&planned)
}

/// Window reads to make before a batch takes the engine for good, and the reader for them.
type EarlyWindows = (EarlyReads, EarlyReader);
/// The same for holds.
type EarlyHolds = (EarlyHoldReads, EarlyReader);

/// With Redis, the windows and holds the batch's events touch (into `touched` and
/// `touched_holds`), and those of them to read before the batch takes the engine for good, each
/// with the reader to read them on.
fn plan_early_reads(
    engine: &mut Engine<AnyStore>,
    events: &Events<'_>,
    touched: &mut Touched,
    touched_holds: &mut Vec<(HoldSpace, Vec<u8>)>,
) -> (Option<EarlyWindows>, Option<EarlyHolds>) {
    if !matches!(engine.store(), AnyStore::Redis(_)) || !engine.store().prefetches() {
        return (None, None);
    }
    for event in events.iter().flatten() {
        engine.touched_keys(event, touched);
        engine.touched_holds(event, touched_holds);
    }
    let AnyStore::Redis(store) = engine.store_mut() else {
        return (None, None);
    };
    let windows = store.plan_early_reads(touched.keys()).and_then(|reads| {
        let Some(reader) = store.early_reader() else {
            // Nothing to read them with: given back, the prefetch reads them.
            store.take_early_reads(
                reads,
                EarlyReplies::failed(StoreError::Unavailable("no early reader".into())),
            );
            return None;
        };
        Some((reads, reader))
    });
    (windows, store.plan_early_hold_reads(touched_holds))
}

/// Loads the windows and holds the batch's events touch (`touched` and `touched_holds`, if not
/// empty: listed already), in one round trip each.
fn prefetch(
    engine: &mut Engine<AnyStore>,
    events: &Events<'_>,
    mut touched: Touched,
    mut touched_holds: Vec<(HoldSpace, Vec<u8>)>,
) -> Result<(), StoreError> {
    if touched.is_empty() {
        for event in events.iter().flatten() {
            engine.touched_keys(event, &mut touched);
        }
    }
    engine.store_mut().prefetch(touched.keys())?;
    if touched_holds.is_empty() {
        for event in events.iter().flatten() {
            engine.touched_holds(event, &mut touched_holds);
        }
    }
    engine.store_mut().prefetch_holds(&touched_holds)
}
