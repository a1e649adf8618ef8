//! Why the worker stopped with an error, and the code each reason is reported under.

use rdkafka::error::KafkaError;

use crate::store::StoreError;

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
