//! The polling thread (the caller's): polls the consumer, which also runs the rebalance
//! callbacks, gathers the messages per partition and hands them to the partition loops.

use std::collections::HashMap;
use std::sync::mpsc::{SyncSender, TrySendError};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, ConsumerContext};
use rdkafka::message::{Message, OwnedMessage};

use super::shared::{Polled, Worker};
use crate::shutdown::Shutdown;
use crate::telemetry::http::Health;

/// Messages the consumer loop gathers before handing them to the partition loops (it hands them
/// over earlier as soon as the consumer has nothing more ready).
const GATHER: usize = 2048;

impl Worker {
    /// Polls until `shutdown` fires. Messages are gathered while the consumer has more ready,
    /// then handed over per partition: under load a partition loop takes whole batches per
    /// engine lock; when idle each message goes on at once.
    pub(super) fn poll_until<C: ConsumerContext>(&self, consumer: &BaseConsumer<C>, health: &Health, shutdown: &Shutdown) {
        let mut gathered = 0;
        // While the brokers are away every poll reports the same errors: log each once per 30 s.
        let mut logged: HashMap<String, Instant> = HashMap::new();
        while !shutdown.is_triggered() {
            health.beat();
            let timeout = if gathered == 0 { Duration::from_millis(100) } else { Duration::ZERO };
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
                    }
                }
                None => {
                    if gathered > 0 {
                        self.hand_over();
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

    /// Hands every gathered message to its partition's loop, waiting while a loop's queue is full.
    fn hand_over(&self) {
        let batches: Vec<(SyncSender<Polled>, Polled)> = self
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
}
