//! The Kafka side that writes: one idempotent producer for decision records and dead letters.
//! Each record carries a [`Ticket`] back to its partition's [`Progress`], so the input offset is
//! committed only after the broker acknowledged the record. A record the producer gives up on
//! (e.g. `message.timeout.ms` passed while the brokers were away) is produced again, never dropped.

pub mod audit;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{DeliveryResult, Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{BaseRecord, Producer, ProducerContext, ThreadedProducer};
use rdkafka::ClientContext;

use crate::broker::Fatal;
use crate::config::KafkaConfig;
use crate::source::Progress;
use crate::telemetry::{CodeLabels, Metrics};

/// What a record is, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Decision,
    DeadLetter,
}

/// Travels with a record through the producer and comes back on delivery.
pub struct Ticket {
    pub progress: Arc<Progress>,
    /// Offset of the input event the record is about.
    pub offset: i64,
    /// The input event's Kafka timestamp (ms), for the decision latency.
    pub event_time_ms: Option<i64>,
    /// When the consumer's poll returned the input event, for vigil's own latency.
    pub polled_at: Instant,
    pub kind: Kind,
}

/// A record the producer gave up on, kept to be produced again.
struct Failed {
    topic: String,
    key: Option<Vec<u8>>,
    payload: Vec<u8>,
    headers: Option<OwnedHeaders>,
    ticket: Box<Ticket>,
}

pub struct SinkContext {
    metrics: Arc<Metrics>,
    failed: Mutex<Vec<Failed>>,
    logs: crate::telemetry::LogLimiter,
    fatal: Fatal,
}

impl ClientContext for SinkContext {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, facility: &str, message: &str) {
        self.logs.log(level, facility, message);
    }

    /// A failure retrying cannot fix stops the worker, which reports it; the rest is logged.
    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        if self.fatal.report(&error, reason) {
            return;
        }
        if let Some(held) = self.logs.allow("ERROR", reason) {
            tracing::error!(error = %error, held_back = held, "librdkafka producer: {reason}");
        }
    }
}

impl ProducerContext for SinkContext {
    type DeliveryOpaque = Box<Ticket>;

    fn delivery(&self, result: &DeliveryResult<'_>, ticket: Box<Ticket>) {
        match result {
            Ok(_) => {
                if ticket.kind == Kind::Decision {
                    self.metrics
                        .processing_acknowledged
                        .observe(ticket.polled_at.elapsed().as_secs_f64());
                    if let Some(event_ms) = ticket.event_time_ms {
                        let latency_ms = now_ms().saturating_sub(event_ms).max(0);
                        self.metrics
                            .decision_latency
                            .observe(latency_ms as f64 / 1000.0);
                    }
                }
                ticket.progress.delivered(ticket.offset);
            }
            Err((error, message)) => {
                self.metrics
                    .delivery_errors
                    .get_or_create(&CodeLabels {
                        code: error_code(error),
                    })
                    .inc();
                tracing::warn!(error = %error, offset = ticket.offset, "record not delivered; producing it again");
                let failed = Failed {
                    topic: message.topic().to_owned(),
                    key: message.key().map(<[u8]>::to_vec),
                    payload: message.payload().map(<[u8]>::to_vec).unwrap_or_default(),
                    headers: message.headers().map(|h| h.detach()),
                    ticket,
                };
                self.failed
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(failed);
            }
        }
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Low-cardinality code of a Kafka error.
pub fn error_code(error: &KafkaError) -> &'static str {
    match error.rdkafka_error_code() {
        Some(RDKafkaErrorCode::MessageTimedOut) => "timed_out",
        Some(RDKafkaErrorCode::QueueFull) => "queue_full",
        Some(RDKafkaErrorCode::MessageSizeTooLarge) => "too_large",
        Some(RDKafkaErrorCode::UnknownTopicOrPartition) | Some(RDKafkaErrorCode::UnknownTopic) => {
            "unknown_topic"
        }
        Some(RDKafkaErrorCode::TopicAuthorizationFailed) => "not_authorized",
        Some(_) => "broker",
        None => "client",
    }
}

/// The decisions and dead-letter producer.
pub struct Sink {
    producer: ThreadedProducer<SinkContext>,
    pub decisions_topic: String,
    pub dead_letter_topic: String,
}

/// Producer settings: idempotent (acks=all, no duplicates or reordering on retries) with low
/// linger, since decisions are latency-sensitive. `kafka.properties` come last and win.
pub fn producer_config(kafka: &KafkaConfig) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &kafka.brokers)
        .set("client.id", "vigil")
        .set("enable.idempotence", "true")
        .set("linger.ms", "2");
    for (key, value) in &kafka.properties {
        if !is_consumer_only(key) {
            config.set(key, value);
        }
    }
    config
}

impl Sink {
    /// The producer of [`producer_config`]. A broker failure retrying cannot fix is reported to
    /// `fatal`.
    pub fn new(
        kafka: &KafkaConfig,
        metrics: Arc<Metrics>,
        fatal: Fatal,
    ) -> Result<Sink, KafkaError> {
        let producer = producer_config(kafka).create_with_context(SinkContext {
            metrics,
            failed: Mutex::new(Vec::new()),
            logs: crate::telemetry::LogLimiter::new(std::time::Duration::from_secs(30)),
            fatal,
        })?;
        Ok(Sink {
            producer,
            decisions_topic: kafka.decisions_topic.clone(),
            dead_letter_topic: kafka.dead_letter_topic.clone(),
        })
    }

    /// Hands a record to the producer, waiting while its queue is full. The ticket's offset must
    /// have been registered with `Progress::expect_delivery`.
    pub fn send(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        payload: &[u8],
        headers: Option<OwnedHeaders>,
        ticket: Box<Ticket>,
    ) {
        let mut record = BaseRecord::with_opaque_to(topic, ticket).payload(payload);
        if let Some(key) = key {
            record = record.key(key);
        }
        if let Some(headers) = headers {
            record = record.headers(headers);
        }
        loop {
            match self.producer.send(record) {
                Ok(()) => return,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    record = back;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err((error, back)) => {
                    // Refused before queueing (e.g. too large): report it as a failed delivery.
                    self.producer
                        .context()
                        .metrics
                        .delivery_errors
                        .get_or_create(&CodeLabels {
                            code: error_code(&error),
                        })
                        .inc();
                    tracing::error!(error = %error, topic, "record refused by the producer; retrying later");
                    let failed = Failed {
                        topic: topic.to_owned(),
                        key: key.map(<[u8]>::to_vec),
                        payload: payload.to_vec(),
                        headers: back.headers,
                        ticket: back.delivery_opaque,
                    };
                    self.producer
                        .context()
                        .failed
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(failed);
                    return;
                }
            }
        }
    }

    /// Produces again every record the producer gave up on.
    pub fn resend_failed(&self) {
        let failed = std::mem::take(
            &mut *self
                .producer
                .context()
                .failed
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        for f in failed {
            self.send(&f.topic, f.key.as_deref(), &f.payload, f.headers, f.ticket);
        }
    }

    /// Records given up on and waiting to be produced again.
    pub fn failed(&self) -> usize {
        self.producer
            .context()
            .failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    /// Waits up to `timeout` for every queued record to be acknowledged.
    pub fn flush(&self, timeout: Duration) -> Result<(), KafkaError> {
        self.producer.flush(timeout)
    }
}

/// The dead-letter headers: the original ones, then `vigil.reason` (code), `vigil.error`
/// (message), `vigil.source.topic`, `vigil.source.partition`, `vigil.source.offset`.
pub fn dead_letter_headers(
    original: Option<&OwnedHeaders>,
    reason: &str,
    error: &str,
    topic: &str,
    partition: i32,
    offset: i64,
) -> OwnedHeaders {
    let mut headers = OwnedHeaders::new();
    if let Some(original) = original {
        for header in original.iter() {
            headers = headers.insert(Header {
                key: header.key,
                value: header.value,
            });
        }
    }
    let partition = partition.to_string();
    let offset = offset.to_string();
    for (key, value) in [
        ("vigil.reason", reason),
        ("vigil.error", error),
        ("vigil.source.topic", topic),
        ("vigil.source.partition", partition.as_str()),
        ("vigil.source.offset", offset.as_str()),
    ] {
        headers = headers.insert(Header {
            key,
            value: Some(value),
        });
    }
    headers
}

/// librdkafka consumer properties the producer would only warn about.
fn is_consumer_only(property: &str) -> bool {
    property.starts_with("group.")
        || property.starts_with("session.")
        || property.starts_with("heartbeat.")
        || property.starts_with("fetch.")
        || property.starts_with("auto.")
        || property.starts_with("enable.auto")
        || property.starts_with("max.poll")
        || property.starts_with("partition.assignment")
        || property == "isolation.level"
}
