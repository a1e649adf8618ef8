//! Why the worker stopped with an error, and the code each reason is reported under.

use rdkafka::error::KafkaError;

use crate::broker::BrokerError;
use crate::store::StoreError;

/// Why the worker stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("kafka: {0}")]
    Kafka(#[from] KafkaError),
    /// A broker refused the credentials or the TLS handshake failed: retrying cannot fix it.
    #[error("kafka: {0}")]
    Broker(#[from] BrokerError),
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
            WorkerError::Broker(e) => e.code(),
            WorkerError::Store(e) => e.code(),
            WorkerError::ShutdownIncomplete(_) => "shutdown_incomplete",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::types::RDKafkaErrorCode;

    #[test]
    fn broker_failures_keep_their_code() {
        let reason = "sasl_ssl://k:9093/bootstrap: SASL authentication error: invalid credentials";
        let failure = BrokerError::classify(&KafkaError::Global(RDKafkaErrorCode::Authentication), reason, "k:9093").unwrap();
        let error = WorkerError::from(failure);
        assert_eq!(error.code(), "authentication");
        assert_eq!(error.to_string(), "kafka: broker k:9093: authentication failed: SASL authentication error: invalid credentials");
    }
}
