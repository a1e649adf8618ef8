//! Audit records (a hold released by support): one record written to the decisions topic and
//! waited for until the brokers acknowledged it, on a producer of its own. Releases are rare, so
//! a producer per record costs nothing that matters, and the caller learns whether the record is
//! durable before it answers the person who asked.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::error::KafkaError;
use rdkafka::message::DeliveryResult;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer, ProducerContext};
use rdkafka::ClientContext;

use crate::config::KafkaConfig;

#[derive(Default)]
struct AuditContext {
    delivered: Mutex<Option<Result<(), KafkaError>>>,
}

impl ClientContext for AuditContext {}

impl ProducerContext for AuditContext {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        *self.delivered.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(result.as_ref().map(|_| ()).map_err(|(e, _)| e.clone()));
    }
}

/// Writes `payload` (keyed by `key`) to the decisions topic of `kafka`, and waits up to `timeout`
/// for the brokers to acknowledge it.
pub fn write_audit_record(
    kafka: &KafkaConfig,
    key: &[u8],
    payload: &[u8],
    timeout: Duration,
) -> Result<(), KafkaError> {
    let mut config = super::producer_config(kafka);
    config.set("client.id", "vigil-audit").set(
        "message.timeout.ms",
        timeout
            .as_millis()
            .clamp(1_000, i32::MAX as u128)
            .to_string(),
    );
    let producer: BaseProducer<AuditContext> =
        config.create_with_context(AuditContext::default())?;
    producer
        .send(
            BaseRecord::to(&kafka.decisions_topic)
                .key(key)
                .payload(payload),
        )
        .map_err(|(e, _)| e)?;
    let started = Instant::now();
    loop {
        producer.poll(Duration::from_millis(50));
        if let Some(result) = producer
            .context()
            .delivered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            return result;
        }
        if started.elapsed() > timeout + Duration::from_secs(1) {
            return Err(KafkaError::MessageProduction(
                rdkafka::types::RDKafkaErrorCode::MessageTimedOut,
            ));
        }
    }
}
