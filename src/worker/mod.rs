//! `vigil run`: a member of a Kafka consumer group that decodes, counts, decides and produces,
//! at least once by construction.
//!
//! Threads, one file each:
//! - the caller's thread polls the consumer (which also runs the rebalance callbacks of
//!   `context.rs`) and routes each message to its partition's loop (`poll.rs`);
//! - one ordered loop per assigned partition: decode → plan → count → decide a batch under the
//!   engine lock (while other workers count too, keys spanning partitions are counted ahead
//!   first, in Redis), then hand records to the producer with a ticket back to the partition's
//!   [`Progress`](crate::source::Progress) (`partition.rs`);
//! - a committer: lets the store write behind while idle, stores the offsets that are decided,
//!   delivered and durable, produces failed records again, and exports store metrics
//!   (`committer.rs`);
//! - a rule watcher: validates changed rule files and swaps them in atomically (`watcher.rs`);
//! - an aligner: keeps the group's partitions in step in event time, sharing where this worker's
//!   partitions stand through Redis, which also tells whether other workers count (`alignment.rs`);
//! - on the HTTP runtime, the `/v1` lookups and hold releases, which take the engine between two
//!   batches (`lookups.rs`).
//!
//! What they share is in `shared.rs`. On revocation and on shutdown: stop the partition loops,
//! flush the store, wait for deliveries, commit — within `worker.shutdown_timeout`. A broker
//! failure retrying cannot fix (`crate::broker`) shuts it down the same way, then is its error.

mod alignment;
mod committer;
mod context;
mod error;
mod lookups;
mod partition;
mod poll;
mod shared;
mod watcher;

pub use error::WorkerError;
pub use lookups::Lookups;

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};

use crate::broker::Fatal;
use crate::config::Config;
use crate::rules::RuleSet;
use crate::shutdown::Shutdown;
use crate::sink::Sink;
use crate::source;
use crate::store::{AnyStore, JournalWriter};
use crate::telemetry::http::Health;
use crate::telemetry::{LogLimiter, Metrics};
use context::WorkerContext;
use shared::{PartitionKey, Worker};

/// Runs the worker until `shutdown` fires, then stops within `worker.shutdown_timeout`.
// Each argument is a separate thing the caller made (the HTTP side serves two of them before the
// worker runs): a struct to hold them would only be taken apart here.
#[allow(clippy::too_many_arguments)]
pub fn run(
    config: Config,
    rules: RuleSet,
    store: AnyStore,
    journal: Option<JournalWriter>,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    lookups: &Lookups,
    shutdown: Shutdown,
) -> Result<(), WorkerError> {
    metrics.rules_active.set(rules.active().len() as i64);
    metrics.rules_loaded(&rules);
    // A refused credential or an untrusted certificate triggers `shutdown`: the worker stops as on
    // SIGTERM and returns that failure, instead of retrying it forever.
    let fatal = Fatal::new(&config.kafka.brokers, shutdown.clone());
    let sink = Sink::new(&config.kafka, Arc::clone(&metrics), fatal.clone())?;
    let worker = Arc::new(Worker::new(
        config,
        rules,
        store,
        journal,
        sink,
        Arc::clone(&metrics),
        shutdown.clone(),
    ));
    lookups.bind(&worker);
    let consumer = Arc::new(subscribe(&worker, &health, &fatal)?);

    // The helper threads stop on `helpers_done`, after the final commit.
    let helpers_done = Shutdown::new();
    let committer = worker.spawn_committer(&consumer, &helpers_done)?;
    let watcher = worker.spawn_watcher(&helpers_done)?;
    let aligner = worker.spawn_aligner(&helpers_done)?;

    health.set_ready(true);
    worker.poll_until(&consumer, &health, &shutdown);
    health.set_ready(false);

    tracing::info!("shutting down: stopping partition loops, flushing, delivering, committing");
    let started = shutdown.since().unwrap_or_else(Instant::now);
    let deadline = started + worker.config.worker.shutdown_timeout;
    let all: Vec<PartitionKey> = worker.lock_partitions().keys().cloned().collect();
    let result = worker.finish(&consumer, &all, deadline);
    helpers_done.trigger();
    let _ = committer.join();
    let _ = watcher.join();
    let _ = aligner.join();
    // Leaving the group: the revocation callback finds nothing left to do.
    drop(consumer);
    let failure = fatal.first();
    match (&result, &failure) {
        (Err(e), _) => tracing::error!(error = %e, "stopped with work left to the next owner"),
        (Ok(()), None) => {
            tracing::info!(
                elapsed_ms = started.elapsed().as_millis() as u64,
                "stopped: everything flushed, delivered and committed"
            )
        }
        (Ok(()), Some(_)) => {}
    }
    // The broker failure is why it stopped, whatever the shutdown managed.
    match failure {
        Some(failure) => Err(failure.into()),
        None => result,
    }
}

/// Creates the consumer with the worker's context and subscribes it to the input topics.
fn subscribe(
    worker: &Arc<Worker>,
    health: &Arc<Health>,
    fatal: &Fatal,
) -> Result<BaseConsumer<WorkerContext>, WorkerError> {
    let consumer: BaseConsumer<WorkerContext> =
        source::consumer_config(&worker.config.kafka, &worker.config.worker).create_with_context(
            WorkerContext {
                worker: Arc::clone(worker),
                health: Arc::clone(health),
                logs: LogLimiter::new(Duration::from_secs(30)),
                fatal: fatal.clone(),
            },
        )?;
    let topics: Vec<&str> = worker
        .config
        .kafka
        .input_topics
        .iter()
        .map(String::as_str)
        .collect();
    consumer.subscribe(&topics)?;
    tracing::info!(topics = ?topics, group = %worker.config.kafka.group_id, "subscribed");
    Ok(consumer)
}
