//! The polling thread (the caller's): polls the consumer, which also runs the rebalance
//! callbacks, gathers the messages per partition and hands them to the partition loops.

use std::collections::{HashMap, HashSet};
use std::sync::mpsc::TrySendError;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::TopicPartitionList;

use super::shared::{PartitionKey, Worker};
use crate::shutdown::Shutdown;
use crate::telemetry::http::Health;

/// Messages the consumer loop gathers before handing them to the partition loops (it hands them
/// over earlier as soon as the consumer has nothing more ready).
const GATHER: usize = 2048;

/// A partition whose loop does not take its messages (its queue is full: it waits for slower
/// partitions, or for Redis) is paused in the consumer once this many are held for it, and
/// resumed once they are handed over. The consumer then fetches for the partitions that can go
/// on, and no partition's backlog waits behind another's.
const PAUSE_AT: usize = 4 * GATHER;

/// How long the poll thread waits for the leader's answer that wakes its fetcher (a broker answers
/// in a millisecond or two; past this the partition still resumes, only later).
const WAKE_TIMEOUT: Duration = Duration::from_millis(50);

impl Worker {
    /// Polls until `shutdown` fires. Messages are gathered while the consumer has more ready,
    /// then handed over per partition: under load a partition loop takes whole batches per
    /// engine lock; when idle each message goes on at once.
    pub(super) fn poll_until<C: ConsumerContext>(
        &self,
        consumer: &BaseConsumer<C>,
        health: &Health,
        shutdown: &Shutdown,
    ) {
        let mut gathered = 0;
        let mut paused: HashSet<PartitionKey> = HashSet::new();
        // While the brokers are away every poll reports the same errors: log each once per 30 s.
        let mut logged: HashMap<String, Instant> = HashMap::new();
        while !shutdown.is_triggered() {
            health.beat();
            let timeout = if gathered == 0 {
                Duration::from_millis(100)
            } else {
                Duration::ZERO
            };
            match consumer.poll(timeout) {
                Some(Ok(message)) => {
                    // vigil's own latency starts here, when the consumer hands the event over.
                    let polled_at = Instant::now();
                    health.set_brokers_down(false);
                    if self.gather(message.detach(), polled_at) {
                        gathered += 1;
                    }
                    if gathered >= GATHER {
                        self.hand_over();
                        gathered = 0;
                        self.pause_or_resume(consumer, &mut paused);
                    }
                }
                None => {
                    // Also when nothing came: messages a full loop did not take go as soon as
                    // it has room (at the end of a backlog nothing else would hand them over).
                    self.hand_over();
                    gathered = 0;
                    self.pause_or_resume(consumer, &mut paused);
                }
                Some(Err(e)) => {
                    let text = e.to_string();
                    if logged
                        .get(&text)
                        .is_none_or(|at| at.elapsed() >= Duration::from_secs(30))
                    {
                        tracing::warn!(error = %text, "consumer error (repeats of it are logged every 30 s)");
                        logged.insert(text, Instant::now());
                    }
                }
            }
        }
    }

    /// Keeps a polled message for its partition's loop; false if the partition is not (or no
    /// longer) ours: then it is not committed and its next owner reads it.
    fn gather(&self, message: OwnedMessage, polled_at: Instant) -> bool {
        let key = (message.topic().to_owned(), message.partition());
        match self.lock_partitions().get_mut(&key) {
            Some(state) => {
                state.gathered.push(message, polled_at);
                true
            }
            None => false,
        }
    }

    /// Hands every gathered message to its partition's loop; a loop whose queue is full keeps
    /// them gathered (never waited for: it may be waiting for another partition, whose messages
    /// this thread must go on fetching).
    fn hand_over(&self) {
        let mut partitions = self.lock_partitions();
        for state in partitions.values_mut() {
            if state.gathered.is_empty() {
                continue;
            }
            let Some(sender) = &state.sender else {
                continue;
            };
            match sender.try_send(std::mem::take(&mut state.gathered)) {
                Ok(()) | Err(TrySendError::Disconnected(_)) => {}
                Err(TrySendError::Full(back)) => state.gathered = back,
            }
        }
    }

    /// Pauses in the consumer the partitions holding `PAUSE_AT` messages their loops did not
    /// take, and resumes those whose messages all went. A paused partition is fetched again from
    /// the message after the last one polled.
    fn pause_or_resume<C: ConsumerContext>(
        &self,
        consumer: &BaseConsumer<C>,
        paused: &mut HashSet<PartitionKey>,
    ) {
        let (mut pause, mut resume) = (TopicPartitionList::new(), TopicPartitionList::new());
        let paused_ours = {
            let partitions = self.lock_partitions();
            // A revoked partition stays in `paused`: librdkafka keeps its pause across the
            // rebalance, so if it comes back it is resumed here (nothing held for it yet)
            // instead of never being fetched again.
            for (key, state) in partitions.iter() {
                let held = state.gathered.len();
                if held >= PAUSE_AT && paused.insert(key.clone()) {
                    pause.add_partition(&key.0, key.1);
                } else if held == 0 && paused.remove(key) {
                    resume.add_partition(&key.0, key.1);
                }
            }
            paused
                .iter()
                .filter(|key| partitions.contains_key(*key))
                .count()
        };
        if pause.count() > 0 {
            if let Err(e) = consumer.pause(&pause) {
                tracing::warn!(error = %e, "cannot pause partitions whose loops are full");
            }
        }
        if resume.count() > 0 {
            if let Err(e) = consumer.resume(&resume) {
                tracing::warn!(error = %e, "cannot resume partitions");
            }
            wake_fetchers(consumer, &resume);
        }
        self.metrics.paused_partitions.set(paused_ours as i64);
    }
}

/// Has the leaders of the `resumed` partitions wake their fetchers now. librdkafka takes a resume
/// in its main thread and does not wake the fetcher of the partition's broker, which notices it at
/// its next periodic wake-up: up to a second later when it had nothing else to fetch (every
/// partition it serves for this worker paused, as with a worker of one partition). Measured: the
/// first message came 750–890 ms after each resume, and a one-partition backlog drained at a fifth
/// of the loop's speed. A watermark query is a request on that broker's connection, served by that
/// fetcher, which then fetches the resumed partition at once (2–9 ms). The first query left
/// unanswered ends the round (a broker away would make each of many partitions wait its timeout):
/// the partitions not woken resume at their fetchers' next wake-up, as without this.
fn wake_fetchers<C: ConsumerContext>(consumer: &BaseConsumer<C>, resumed: &TopicPartitionList) {
    for element in resumed.elements() {
        if let Err(e) =
            consumer.fetch_watermarks(element.topic(), element.partition(), WAKE_TIMEOUT)
        {
            tracing::debug!(error = %e, partition = element.partition(), "no answer waking the fetcher of a resumed partition: the resumed partitions go on at their fetchers' next wake-up");
            break;
        }
    }
}
