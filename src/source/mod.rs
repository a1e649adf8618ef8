//! The Kafka side that reads events: consumer settings, message → event decoding with the
//! dead-letter reason of a rejected message, and per-partition offset progress ([`offsets`]).

pub mod offsets;

pub use offsets::Progress;

use rdkafka::config::ClientConfig;

use crate::config::{KafkaConfig, WorkerConfig};
use crate::event::{decode_at, BadEvent, Event, Projection};

/// Why a message cannot be judged; it goes to the dead-letter topic with this reason.
#[derive(Debug, thiserror::Error)]
pub enum Rejection {
    #[error("event of {size} bytes is larger than worker.max_event_bytes ({limit})")]
    TooLarge { size: usize, limit: usize },
    #[error("{0}")]
    Bad(#[from] BadEvent),
}

impl Rejection {
    /// Low-cardinality reason: the metric label and the `vigil.reason` header.
    pub fn code(&self) -> &'static str {
        match self {
            Rejection::TooLarge { .. } => "too_large",
            Rejection::Bad(bad) => bad.code(),
        }
    }
}

/// Decodes a message payload (an absent payload is an empty one); `record_time` is the record's
/// timestamp (epoch ms), the event's time when the projection takes time from the record.
pub fn decode_message<'a>(
    payload: Option<&'a [u8]>,
    record_time: Option<i64>,
    limit: usize,
    projection: &Projection,
) -> Result<Event<'a>, Rejection> {
    let payload = payload.unwrap_or_default();
    if payload.len() > limit {
        return Err(Rejection::TooLarge {
            size: payload.len(),
            limit,
        });
    }
    Ok(decode_at(payload, projection, record_time)?)
}

/// Consumer settings: at-least-once by construction. Offsets are stored only by the worker, once
/// an event's decision is delivered and its deltas are durable, and committed from that store;
/// a new group starts at the earliest offset, so no event produced before the first worker
/// started is skipped. `kafka.properties` come last and win.
pub fn consumer_config(kafka: &KafkaConfig, worker: &WorkerConfig) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &kafka.brokers)
        .set("group.id", &kafka.group_id)
        .set("client.id", "vigil")
        .set("enable.auto.commit", "true")
        .set(
            "auto.commit.interval.ms",
            worker.commit_interval.as_millis().max(1).to_string(),
        )
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("enable.partition.eof", "false")
        .set(
            "statistics.interval.ms",
            kafka.statistics_interval.as_millis().to_string(),
        );
    for (key, value) in &kafka.properties {
        config.set(key, value);
    }
    config
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejections_carry_reason_codes() {
        let projection = Projection::new();
        let code = |payload: Option<&[u8]>, limit| {
            decode_message(payload, Some(5), limit, &projection)
                .err()
                .map(|r| r.code())
        };
        assert_eq!(code(Some(br#"{"ts":1}"#), 100), None);
        assert_eq!(code(Some(br#"{"ts":1}"#), 3), Some("too_large"));
        assert_eq!(code(None, 100), Some("invalid_json"));
        assert_eq!(code(Some(b"[1]"), 100), Some("not_an_object"));
        assert_eq!(code(Some(b"{}"), 100), Some("missing_ts"));
    }
}
