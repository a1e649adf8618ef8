//! The consumer's rdkafka context: librdkafka's logs, errors and statistics (lag, broker
//! reachability), and the rebalance and commit callbacks, which run on the polling thread.

use std::sync::Arc;
use std::time::Instant;

use rdkafka::consumer::{BaseConsumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::statistics::Statistics;
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::ClientContext;

use super::shared::{PartitionKey, Worker};
use crate::broker::Fatal;
use crate::store::CounterStore;
use crate::telemetry::http::Health;
use crate::telemetry::{LogLimiter, PartitionLabels};

pub(super) struct WorkerContext {
    pub(super) worker: Arc<Worker>,
    pub(super) health: Arc<Health>,
    pub(super) logs: LogLimiter,
    pub(super) fatal: Fatal,
}

impl ClientContext for WorkerContext {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, facility: &str, message: &str) {
        self.logs.log(level, facility, message);
    }

    /// Every broker down: not ready until one answers again (seen in the statistics). A failure
    /// retrying cannot fix (credentials, certificate) stops the worker, which reports it.
    fn error(&self, error: KafkaError, reason: &str) {
        if self.fatal.report(&error, reason) {
            return;
        }
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
                    let labels = PartitionLabels {
                        topic: topic.clone(),
                        partition,
                    };
                    self.worker
                        .metrics
                        .consumer_lag
                        .get_or_create(&labels)
                        .set(p.consumer_lag);
                }
            }
        }
    }
}

impl ConsumerContext for WorkerContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(list) = rebalance {
            let revoked: Vec<PartitionKey> = list
                .elements()
                .iter()
                .map(|e| (e.topic().to_owned(), e.partition()))
                .collect();
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
                let assigned: Vec<PartitionKey> = list
                    .elements()
                    .iter()
                    .map(|e| (e.topic().to_owned(), e.partition()))
                    .collect();
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
                        let labels = PartitionLabels {
                            topic: element.topic().to_owned(),
                            partition: element.partition(),
                        };
                        self.worker
                            .metrics
                            .committed_offset
                            .get_or_create(&labels)
                            .set(next);
                        // Nobody reads the events before `next` again: their journal entries go.
                        let lane = self.worker.lane(element.topic(), element.partition());
                        self.worker.with_journal(|journal| journal.trim(lane, next));
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "offset commit failed; it is retried with the next commit")
            }
        }
    }
}
