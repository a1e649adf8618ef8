//! Why the worker stopped with an error, and the code each reason is reported under.

use rdkafka::error::KafkaError;

use crate::broker::BrokerError;
use crate::store::StoreError;

/// Why the worker stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("kafka: {0}")]
    Kafka(KafkaError),
    /// A property librdkafka refused when a client was created. Without its value: rdkafka's own
    /// message ends with it, and it may be a secret (a mistyped `sasl.pasword`, a Java
    /// `sasl.jaas.config` with its password). librdkafka's description quotes a value only when
    /// it is invalid for the property (a number, a choice), which free-text secrets never are.
    #[error("kafka.properties: `{key}`: {description}")]
    Property { key: String, description: String },
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

impl From<KafkaError> for WorkerError {
    fn from(error: KafkaError) -> Self {
        match error {
            KafkaError::ClientConfig(_, description, key, _value) => {
                WorkerError::Property { key, description }
            }
            other => WorkerError::Kafka(other),
        }
    }
}

impl WorkerError {
    pub fn code(&self) -> &'static str {
        match self {
            WorkerError::Kafka(_) => "kafka",
            WorkerError::Property { .. } => "kafka_property",
            WorkerError::Broker(e) => e.code(),
            WorkerError::Store(e) => e.code(),
            WorkerError::ShutdownIncomplete(_) => "shutdown_incomplete",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::types::{RDKafkaConfRes, RDKafkaErrorCode};

    #[test]
    fn a_refused_property_is_reported_without_its_value() {
        let refused = KafkaError::ClientConfig(
            RDKafkaConfRes::RD_KAFKA_CONF_INVALID,
            "Java JAAS configuration is not supported".into(),
            "sasl.jaas.config".into(),
            "ScramLoginModule required username=\"u\" password=\"hunter2\";".into(),
        );
        assert!(
            refused.to_string().contains("hunter2"),
            "rdkafka's own message shows the value"
        );
        let error = WorkerError::from(refused);
        assert_eq!(
            error.to_string(),
            "kafka.properties: `sasl.jaas.config`: Java JAAS configuration is not supported"
        );
        assert_eq!(error.code(), "kafka_property");
        let other = WorkerError::from(KafkaError::ClientCreation("ssl.ca.location failed".into()));
        assert_eq!(
            (other.code(), other.to_string().as_str()),
            (
                "kafka",
                "kafka: Client creation error: ssl.ca.location failed"
            )
        );
    }

    #[test]
    fn broker_failures_keep_their_code() {
        let reason = "sasl_ssl://k:9093/bootstrap: SASL authentication error: invalid credentials";
        let failure = BrokerError::classify(
            &KafkaError::Global(RDKafkaErrorCode::Authentication),
            reason,
            "k:9093",
        )
        .unwrap();
        let error = WorkerError::from(failure);
        assert_eq!(error.code(), "authentication");
        assert_eq!(error.to_string(), "kafka: broker k:9093: authentication failed: SASL authentication error: invalid credentials");
    }
}
