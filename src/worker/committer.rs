//! The committer thread and what commits: every tick it lets the store write behind, exports the
//! store's metrics, produces failed records again and stores the offsets that became
//! committable; on revocation and at shutdown, [`Worker::finish`] makes the partitions' work
//! durable and delivered and commits it.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};

use super::error::WorkerError;
use super::shared::{stop_loops, PartitionKey, PartitionLoop, Worker};
use crate::shutdown::Shutdown;
use crate::source::Progress;
use crate::store::{AnyStore, CounterStore, StateStats};
use crate::telemetry::{CodeLabels, KindLabels, PartitionLabels};

impl Worker {
    /// Starts the committer thread; it stops when `done` fires.
    pub(super) fn spawn_committer<C: ConsumerContext + 'static>(
        self: &Arc<Self>,
        consumer: &Arc<BaseConsumer<C>>,
        done: &Shutdown,
    ) -> Result<JoinHandle<()>, WorkerError> {
        let (worker, consumer, done) = (Arc::clone(self), Arc::clone(consumer), done.clone());
        std::thread::Builder::new()
            .name("vigil-commit".into())
            .spawn(move || worker.commit_loop(&consumer, &done))
            .map_err(|e| {
                WorkerError::ShutdownIncomplete(format!("cannot start the committer: {e}"))
            })
    }

    /// Every `flush_interval` (at most 100 ms): let the store write behind, export its metrics,
    /// produce failed records again, and store the offsets that became committable.
    fn commit_loop<C: ConsumerContext>(&self, consumer: &BaseConsumer<C>, done: &Shutdown) {
        let tick = self
            .config
            .redis
            .flush_interval
            .clamp(Duration::from_millis(5), Duration::from_millis(100));
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
        let mut exported = self
            .exported_state
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let (known, logged) = &mut *exported;
        let windows = state.evicted_keys.saturating_sub(known.evicted_keys);
        let holds = state.evicted_holds.saturating_sub(known.evicted_holds);
        if windows > 0 {
            self.metrics
                .evicted_keys
                .get_or_create(&KindLabels { kind: "window" })
                .inc_by(windows);
        }
        if holds > 0 {
            self.metrics
                .evicted_keys
                .get_or_create(&KindLabels { kind: "hold" })
                .inc_by(holds);
        }
        if (windows > 0 || holds > 0)
            && logged.is_none_or(|at| at.elapsed() >= Duration::from_secs(30))
        {
            tracing::warn!(
                evicted_windows = state.evicted_keys,
                evicted_holds = state.evicted_holds,
                "in-process counter state at its bound (memory.max_state_bytes / max_keys): evicting the keys \
                 with the fewest events; values over them are lower bounds, judged by each rule's on_store_error \
                 until their windows pass"
            );
            *logged = Some(Instant::now());
        }
        *known = state;
        self.metrics
            .state_bytes
            .set(i64::try_from(state.bytes).unwrap_or(i64::MAX));
    }

    /// Lets the store take in finished flushes and start due ones; exports its metrics; returns
    /// its durable mark.
    pub(super) fn tick_store(&self) -> u64 {
        let mut engine = self.lock_engine();
        if let Err(e) = engine.store_mut().tick() {
            tracing::error!(error = %e, "counter store failed");
        }
        self.note_saturation(&engine);
        self.metrics
            .live_keys
            .set(engine.store().live_keys() as i64);
        self.export_state(engine.store().state_stats());
        if let AnyStore::Redis(redis) = engine.store_mut() {
            for sample in redis.take_flush_samples() {
                self.metrics.flush_keys.observe(sample.keys as f64);
                self.metrics
                    .flush_seconds
                    .observe(sample.elapsed.as_secs_f64());
            }
            if let Some(e) = redis.take_flush_error() {
                tracing::warn!(error = %e, "write-behind flush failed; its deltas are kept and sent again");
            }
            let stats = redis.stats();
            self.metrics
                .eviction_allowed
                .set(i64::from(stats.eviction_allowed));
            let mut exported = self.exported.lock().unwrap_or_else(|p| p.into_inner());
            let retries = stats.retries.saturating_sub(exported.retries);
            let failed = stats.failed_flushes.saturating_sub(exported.failed_flushes);
            if retries > 0 {
                self.metrics
                    .redis_errors
                    .get_or_create(&CodeLabels { code: "retry" })
                    .inc_by(retries);
            }
            if failed > 0 {
                self.metrics
                    .redis_errors
                    .get_or_create(&CodeLabels {
                        code: "flush_failed",
                    })
                    .inc_by(failed);
            }
            self.metrics.replayed_observations.inc_by(
                stats
                    .skipped_applied
                    .saturating_sub(exported.skipped_applied),
            );
            self.metrics
                .stale_writes
                .inc_by(stats.stale_writes.saturating_sub(exported.stale_writes));
            self.metrics
                .redis_outages
                .inc_by(stats.outages.saturating_sub(exported.outages));
            self.metrics.degraded_observations.inc_by(
                stats
                    .degraded_observations
                    .saturating_sub(exported.degraded_observations),
            );
            self.metrics
                .redis_data_losses
                .inc_by(stats.data_losses.saturating_sub(exported.data_losses));
            self.metrics
                .reseeded_keys
                .inc_by(stats.reseeded_keys.saturating_sub(exported.reseeded_keys));
            self.metrics
                .redis_failovers
                .inc_by(stats.failovers.saturating_sub(exported.failovers));
            self.metrics.rewritten_unconfirmed.inc_by(
                stats
                    .rewritten_unconfirmed
                    .saturating_sub(exported.rewritten_unconfirmed),
            );
            self.metrics
                .lost_keys
                .inc_by(stats.lost_keys.saturating_sub(exported.lost_keys));
            self.metrics
                .counted_ahead
                .inc_by(stats.counted_ahead.saturating_sub(exported.counted_ahead));
            self.metrics
                .taken_back
                .inc_by(stats.taken_back.saturating_sub(exported.taken_back));
            self.metrics
                .redis_available
                .set(i64::from(redis.available()));
            *exported = stats;
        }
        engine.store().durable_mark()
    }

    /// Stops the loops of `partitions`, makes their work durable and delivered by `deadline`, and
    /// commits what is. Runs on revocation and at shutdown.
    pub(super) fn finish<C: ConsumerContext>(
        &self,
        consumer: &BaseConsumer<C>,
        partitions: &[PartitionKey],
        deadline: Instant,
    ) -> Result<(), WorkerError> {
        let progress = self.stop_partitions(partitions);
        let mut problems = Vec::new();
        self.flush_deltas(deadline, &mut problems);
        self.deliver_records(deadline, &mut problems);
        let durable = self.tick_store();
        self.commit_final(consumer, &progress, durable, &mut problems)?;
        if problems.is_empty() {
            Ok(())
        } else {
            Err(WorkerError::ShutdownIncomplete(problems.join("; ")))
        }
    }

    /// Takes `partitions` out of the table, stops their loops and closes their lanes; returns
    /// their progress, for the final commit.
    fn stop_partitions(&self, partitions: &[PartitionKey]) -> Vec<(PartitionKey, Arc<Progress>)> {
        let loops: Vec<(PartitionKey, PartitionLoop)> = {
            let mut all = self.lock_partitions();
            partitions
                .iter()
                .filter_map(|key| all.remove_entry(key))
                .collect()
        };
        let progress: Vec<(PartitionKey, Arc<Progress>)> = loops
            .iter()
            .map(|(key, state)| (key.clone(), Arc::clone(&state.progress)))
            .collect();
        stop_loops(loops.into_iter().map(|(_, state)| state).collect());
        for (key, _) in &progress {
            let lane = self.lane(&key.0, key.1);
            self.lock_engine().close_lane(lane);
            self.alignment.revoke(lane);
            self.with_journal(|journal| journal.release(lane));
            self.metrics.assigned_partitions.dec();
            self.metrics.consumer_lag.remove(&PartitionLabels {
                topic: key.0.clone(),
                partition: key.1,
            });
        }
        progress
    }

    /// Deltas: flush, retrying until the deadline.
    fn flush_deltas(&self, deadline: Instant, problems: &mut Vec<String>) {
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
    }

    /// Records: wait for every acknowledgement, producing failed ones again.
    fn deliver_records(&self, deadline: Instant, problems: &mut Vec<String>) {
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
    }

    /// Stores and commits the offsets of `progress` that are decided, delivered and `durable`.
    fn commit_final<C: ConsumerContext>(
        &self,
        consumer: &BaseConsumer<C>,
        progress: &[(PartitionKey, Arc<Progress>)],
        durable: u64,
        problems: &mut Vec<String>,
    ) -> Result<(), WorkerError> {
        let mut list = TopicPartitionList::new();
        for ((topic, partition), progress) in progress {
            if let Some(next) = progress.committable(durable) {
                let _ = list.add_partition_offset(topic, *partition, Offset::Offset(next));
            }
            if progress.undelivered() > 0 {
                problems.push(format!(
                    "{topic}/{partition}: {} records unacknowledged",
                    progress.undelivered()
                ));
            }
        }
        if list.count() > 0 {
            // Stored as well as committed, so the consumer's close cannot commit an older stored one.
            consumer.store_offsets(&list)?;
            consumer.commit(&list, CommitMode::Sync)?;
            for element in list.elements() {
                if let Offset::Offset(next) = element.offset() {
                    let labels = PartitionLabels {
                        topic: element.topic().to_owned(),
                        partition: element.partition(),
                    };
                    self.metrics
                        .committed_offset
                        .get_or_create(&labels)
                        .set(next);
                }
            }
            tracing::info!(offsets = ?list.elements().iter().map(|e| (e.topic().to_owned(), e.partition(), e.offset())).collect::<Vec<_>>(), "committed");
        }
        Ok(())
    }
}
