//! What every thread of the worker shares: the engine, the sink, the table of running partition
//! loops, the journal, and the locks over them (a poisoned lock is taken over: its data stays
//! consistent between two batches).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use rdkafka::message::OwnedMessage;

use super::alignment::Alignment;
use crate::clock::SystemClock;
use crate::config::Config;
use crate::event::Projection;
use crate::pipeline::Engine;
use crate::rules::RuleSet;
use crate::shutdown::Shutdown;
use crate::sink::Sink;
use crate::source::Progress;
use crate::store::{AnyStore, CounterStore, JournalWriter, RedisStats, StateStats};
use crate::telemetry::Metrics;

/// A partition, as the consumer names it: (topic, partition).
pub(super) type PartitionKey = (String, i32);

/// Polled messages on their way to a partition loop, in offset order, each with the instant the
/// consumer's poll returned it: where vigil's own latency (`vigil_processing_latency_seconds`)
/// starts.
#[derive(Default)]
pub(super) struct Polled {
    pub(super) messages: Vec<OwnedMessage>,
    /// `polled_at[i]`: when `messages[i]` was polled.
    pub(super) polled_at: Vec<Instant>,
}

impl Polled {
    pub(super) fn push(&mut self, message: OwnedMessage, polled_at: Instant) {
        self.messages.push(message);
        self.polled_at.push(polled_at);
    }

    /// Appends a later batch of the same partition.
    pub(super) fn append(&mut self, mut later: Polled) {
        self.messages.append(&mut later.messages);
        self.polled_at.append(&mut later.polled_at);
    }

    pub(super) fn len(&self) -> usize {
        self.messages.len()
    }

    /// Leaves the first `at` messages here and returns the rest, if any.
    pub(super) fn split_off(&mut self, at: usize) -> Option<Polled> {
        (self.messages.len() > at).then(|| Polled {
            messages: self.messages.split_off(at),
            polled_at: self.polled_at.split_off(at),
        })
    }

    pub(super) fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }
}

/// A running partition loop.
pub(super) struct PartitionLoop {
    pub(super) sender: Option<SyncSender<Polled>>,
    /// Messages polled and not yet handed over; they go with the loop when it is revoked.
    pub(super) gathered: Polled,
    pub(super) stop: Arc<AtomicBool>,
    pub(super) thread: Option<JoinHandle<()>>,
    pub(super) progress: Arc<Progress>,
}

/// What every thread of the worker shares.
pub(super) struct Worker {
    pub(super) config: Config,
    pub(super) engine: Mutex<Engine<AnyStore>>,
    pub(super) sink: Sink,
    pub(super) metrics: Arc<Metrics>,
    pub(super) shutdown: Shutdown,
    pub(super) partitions: Mutex<HashMap<PartitionKey, PartitionLoop>>,
    /// Store statistics already exported.
    pub(super) exported: Mutex<RedisStats>,
    /// State statistics already exported, and when evictions were last logged.
    pub(super) exported_state: Mutex<(StateStats, Option<Instant>)>,
    /// The decision journal (with Redis; none with the in-process store, which a restart loses
    /// anyway).
    pub(super) journal: Option<Mutex<JournalWriter>>,
    /// Where the group's partitions stand in event time: keeps them in step.
    pub(super) alignment: Alignment,
    /// Whether the store's local counts were at their bound after its last tick: read by each
    /// batch without taking the engine ([`Worker::note_saturation`]).
    pub(super) saturated: AtomicBool,
    /// The projection of the rule set last seen in force, with its generation: a batch is
    /// decoded with it before taking the engine, and again under the engine if another set is
    /// in force by then.
    pub(super) decoding: Mutex<Option<(u64, Arc<Projection>)>>,
}

impl Worker {
    pub(super) fn new(
        config: Config,
        rules: RuleSet,
        store: AnyStore,
        journal: Option<JournalWriter>,
        sink: Sink,
        metrics: Arc<Metrics>,
        shutdown: Shutdown,
    ) -> Worker {
        Worker {
            engine: Mutex::new(
                Engine::new(rules, store)
                    .with_time(config.input.time_bounds(), Arc::new(SystemClock))
                    .with_time_source(config.input.time_source()),
            ),
            sink,
            metrics,
            shutdown,
            partitions: Mutex::new(HashMap::new()),
            exported: Mutex::new(RedisStats::default()),
            exported_state: Mutex::new((StateStats::default(), None)),
            journal: journal.map(Mutex::new),
            alignment: Alignment::new(
                config.input.max_partition_skew,
                config.input.partition_idle_timeout,
            ),
            saturated: AtomicBool::new(false),
            decoding: Mutex::new(None),
            config,
        }
    }

    /// Records, after a store tick under the engine, whether the local counts are at their
    /// bound.
    pub(super) fn note_saturation(&self, engine: &Engine<AnyStore>) {
        self.saturated
            .store(engine.store().saturated(), Ordering::Release);
    }

    pub(super) fn lock_partitions(&self) -> MutexGuard<'_, HashMap<PartitionKey, PartitionLoop>> {
        self.partitions.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn lock_engine(&self) -> MutexGuard<'_, Engine<AnyStore>> {
        self.engine.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The projection of the rule set last seen in force, and that set's generation.
    pub(super) fn decoding(&self) -> Option<(u64, Arc<Projection>)> {
        self.decoding
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Notes the rule set in force (under the engine), for the next batches to decode with.
    pub(super) fn note_decoding(&self, engine: &Engine<AnyStore>) {
        let mut decoding = self.decoding.lock().unwrap_or_else(|p| p.into_inner());
        if decoding
            .as_ref()
            .is_none_or(|(generation, _)| *generation != engine.rules_generation())
        {
            *decoding = Some((
                engine.rules_generation(),
                engine.rules().shared_projection(),
            ));
        }
    }

    pub(super) fn with_journal<T>(&self, f: impl FnOnce(&mut JournalWriter) -> T) -> Option<T> {
        self.journal
            .as_ref()
            .map(|journal| f(&mut journal.lock().unwrap_or_else(|p| p.into_inner())))
    }

    /// The lane the store records applied offsets under (`o:<partition>`): the
    /// partition, made unique per input topic when there are several (by the topic's position
    /// in `kafka.input_topics`).
    pub(super) fn lane(&self, topic: &str, partition: i32) -> u64 {
        let topics = &self.config.kafka.input_topics;
        let partition = u64::try_from(partition).unwrap_or(0);
        match topics.iter().position(|t| t == topic) {
            Some(index) if topics.len() > 1 => index as u64 * 1_000_000 + partition,
            _ => partition,
        }
    }
}

/// Stops partition loops and waits for them (each finishes the batch it is on).
pub(super) fn stop_loops(loops: Vec<PartitionLoop>) {
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

#[cfg(test)]
mod tests {
    use super::Polled;
    use rdkafka::message::{Message, OwnedMessage, Timestamp};
    use std::time::Instant;

    fn polled(offsets: std::ops::Range<i64>) -> Polled {
        let mut polled = Polled::default();
        for offset in offsets {
            let message = OwnedMessage::new(
                None,
                None,
                "events".into(),
                Timestamp::NotAvailable,
                0,
                offset,
                None,
            );
            polled.push(message, Instant::now());
        }
        polled
    }

    /// A batch over the limit keeps its first messages and hands the rest on, in order, each
    /// with the instant it was polled.
    #[test]
    fn a_polled_batch_splits_in_offset_order() {
        let mut batch = polled(0..5);
        let at = batch.polled_at.clone();
        let rest = batch.split_off(3).expect("two over the limit");
        let offsets = |p: &Polled| p.messages.iter().map(Message::offset).collect::<Vec<_>>();
        assert_eq!(offsets(&batch), [0, 1, 2]);
        assert_eq!(offsets(&rest), [3, 4]);
        assert_eq!(batch.polled_at, at[..3]);
        assert_eq!(rest.polled_at, at[3..]);
        assert!(batch.split_off(3).is_none(), "nothing over the limit");
        assert_eq!(batch.len(), 3);
    }
}
