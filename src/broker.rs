//! Kafka client failures that retrying cannot fix, told apart from the transient ones.
//!
//! librdkafka retries every broker connection forever, a refused password or an untrusted
//! certificate included: left alone the worker would sit not-ready, logging, until someone
//! looks. [`BrokerError::classify`] picks out those failures from the clients' error callbacks,
//! and [`Fatal`] is where the consumer and the producer report them, so the worker stops and
//! exits with one clear error instead.

use std::sync::{Arc, Mutex};

use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;

use crate::shutdown::Shutdown;

/// A broker connection that cannot succeed as configured.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BrokerError {
    /// SASL refused: wrong username or password, a mechanism the broker does not enable, no
    /// OAUTHBEARER token.
    #[error("broker {broker}: authentication failed: {detail}")]
    Authentication { broker: String, detail: String },
    /// The TLS handshake failed: the broker's certificate does not verify against
    /// `ssl.ca.location` or does not name the broker, or the broker speaks no TLS there.
    #[error("broker {broker}: TLS handshake failed: {detail}")]
    Tls { broker: String, detail: String },
    /// The group coordinator refused the consumer's `session.timeout.ms`: outside the broker's
    /// `group.min.session.timeout.ms` ..= `group.max.session.timeout.ms` (6 s ..= 30 min by
    /// default), so the worker would never join its group.
    #[error(
        "broker {broker}: the consumer group refused `session.timeout.ms` (it must lie within the broker's \
         group.min.session.timeout.ms and group.max.session.timeout.ms): {detail}"
    )]
    SessionTimeout { broker: String, detail: String },
}

impl BrokerError {
    /// Low-cardinality reason, for logs and metrics.
    pub fn code(&self) -> &'static str {
        match self {
            BrokerError::Authentication { .. } => "authentication",
            BrokerError::Tls { .. } => "tls",
            BrokerError::SessionTimeout { .. } => "session_timeout",
        }
    }

    /// The failure reported to a client's `error` callback, if retrying cannot fix it. A broker
    /// restarting, unreachable or timing out is not one of them: those are retried.
    /// `bootstrap` (the configured `kafka.brokers`) names the broker when `reason` does not.
    pub fn classify(error: &KafkaError, reason: &str, bootstrap: &str) -> Option<BrokerError> {
        let make: fn(String, String) -> BrokerError = match error.rdkafka_error_code()? {
            // librdkafka reports the broker's SASL_AUTHENTICATION_FAILED as the local code; both
            // are matched in case a version does not translate it.
            RDKafkaErrorCode::Authentication | RDKafkaErrorCode::SaslAuthenticationFailed => {
                |broker, detail| BrokerError::Authentication { broker, detail }
            }
            // Only the handshake and certificate verification report this code; a connection
            // lost later is a transport failure.
            RDKafkaErrorCode::SSL => |broker, detail| BrokerError::Tls { broker, detail },
            // Every JoinGroup is refused the same way until the configuration changes.
            RDKafkaErrorCode::InvalidSessionTimeout => {
                |broker, detail| BrokerError::SessionTimeout { broker, detail }
            }
            _ => return None,
        };
        let (broker, detail) = match split_broker(reason) {
            Some((broker, detail)) => (broker.to_owned(), detail.to_owned()),
            None => (bootstrap.to_owned(), reason.to_owned()),
        };
        Some(make(broker, detail))
    }
}

/// Splits librdkafka's `sasl_ssl://host:port/node: detail` into the broker's address and the
/// detail. `None` when the reason names no broker (e.g. the logical `GroupCoordinator`, or an
/// OAUTHBEARER token that could not be fetched).
fn split_broker(reason: &str) -> Option<(&str, &str)> {
    let (protocol, rest) = reason.split_once("://")?;
    if protocol.is_empty()
        || !protocol
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_')
    {
        return None;
    }
    // The node is `bootstrap` or the broker's id; the address itself has no `/`.
    let (address, rest) = rest.split_once('/')?;
    let (node, detail) = rest.split_once(": ")?;
    if address.is_empty() || node.is_empty() || node.contains(char::is_whitespace) {
        return None;
    }
    Some((address, detail))
}

/// Where the consumer's and the producer's contexts report a [`BrokerError`]. The first one is
/// kept and triggers the shutdown the worker runs under, so the worker stops (within
/// `worker.shutdown_timeout`) and returns it; later ones are only logged by their callers.
#[derive(Clone)]
pub struct Fatal {
    first: Arc<Mutex<Option<BrokerError>>>,
    bootstrap: Arc<str>,
    shutdown: Shutdown,
}

impl Fatal {
    /// `bootstrap` names the broker when librdkafka's reason does not.
    pub fn new(bootstrap: &str, shutdown: Shutdown) -> Fatal {
        Fatal {
            first: Arc::default(),
            bootstrap: bootstrap.into(),
            shutdown,
        }
    }

    /// Reports an error from a client's `error` callback; true if it is the first fatal one
    /// (then the shutdown has been triggered and the worker will return it).
    pub fn report(&self, error: &KafkaError, reason: &str) -> bool {
        let Some(failure) = BrokerError::classify(error, reason, &self.bootstrap) else {
            return false;
        };
        let mut first = self.first.lock().unwrap_or_else(|p| p.into_inner());
        if first.is_some() {
            return false;
        }
        tracing::error!(code = failure.code(), error = %failure, "stopping: retrying cannot fix this");
        *first = Some(failure);
        self.shutdown.trigger();
        true
    }

    /// The first fatal failure reported, if any.
    pub fn first(&self) -> Option<BrokerError> {
        self.first.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AUTH: &str = "sasl_ssl://127.0.0.1:39092/bootstrap: SASL authentication error: Authentication failed during \
                        authentication due to invalid credentials with SASL mechanism SCRAM-SHA-256 (after 312ms in state AUTH_REQ)";
    const TLS: &str = "sasl_ssl://127.0.0.1:39092/bootstrap: SSL handshake failed: error:0A000086:SSL routines::certificate \
                       verify failed: broker certificate could not be verified (after 47ms in state SSL_HANDSHAKE)";

    fn classify(code: RDKafkaErrorCode, reason: &str) -> Option<BrokerError> {
        BrokerError::classify(&KafkaError::Global(code), reason, "k1:9093,k2:9093")
    }

    #[test]
    fn refused_credentials_and_untrusted_certificates_are_fatal_and_name_the_broker() {
        let auth = classify(RDKafkaErrorCode::Authentication, AUTH).unwrap();
        assert_eq!(auth.code(), "authentication");
        assert_eq!(
            auth.to_string(),
            "broker 127.0.0.1:39092: authentication failed: SASL authentication error: Authentication failed during \
             authentication due to invalid credentials with SASL mechanism SCRAM-SHA-256 (after 312ms in state AUTH_REQ)"
        );
        assert_eq!(
            classify(RDKafkaErrorCode::SaslAuthenticationFailed, AUTH),
            Some(auth)
        );
        let tls = classify(RDKafkaErrorCode::SSL, TLS).unwrap();
        assert_eq!(tls.code(), "tls");
        assert!(
            tls.to_string().starts_with(
                "broker 127.0.0.1:39092: TLS handshake failed: SSL handshake failed: "
            ),
            "{tls}"
        );
    }

    #[test]
    fn a_refused_session_timeout_is_fatal() {
        let refused = classify(
            RDKafkaErrorCode::InvalidSessionTimeout,
            "JoinGroup failed: Broker: Invalid session timeout",
        )
        .unwrap();
        assert_eq!(refused.code(), "session_timeout");
        assert_eq!(
            refused.to_string(),
            "broker k1:9093,k2:9093: the consumer group refused `session.timeout.ms` (it must lie within the broker's \
             group.min.session.timeout.ms and group.max.session.timeout.ms): JoinGroup failed: Broker: Invalid session timeout"
        );
    }

    #[test]
    fn transient_failures_are_not_fatal() {
        for code in [
            RDKafkaErrorCode::AllBrokersDown,
            RDKafkaErrorCode::BrokerTransportFailure,
            RDKafkaErrorCode::Resolve,
            RDKafkaErrorCode::MessageTimedOut,
            RDKafkaErrorCode::TopicAuthorizationFailed,
        ] {
            assert_eq!(classify(code, AUTH), None, "{code:?}");
        }
        // Not a librdkafka code at all.
        assert_eq!(
            BrokerError::classify(&KafkaError::Canceled, AUTH, "k"),
            None
        );
    }

    #[test]
    fn the_broker_is_read_from_the_reason_or_else_the_bootstrap_list() {
        assert_eq!(
            split_broker("ssl://[::1]:9093/2: failed"),
            Some(("[::1]:9093", "failed"))
        );
        assert_eq!(
            split_broker("sasl_plaintext://kafka-0.kafka:9092/0: x: y"),
            Some(("kafka-0.kafka:9092", "x: y"))
        );
        for reason in [
            "Failed to acquire SASL OAUTHBEARER token: https://idp/token: 401",
            "GroupCoordinator: SASL authentication error",
            "no broker here",
            "ssl://host:1: no node",
        ] {
            assert_eq!(split_broker(reason), None, "{reason}");
        }
        let token = classify(
            RDKafkaErrorCode::Authentication,
            "Failed to acquire SASL OAUTHBEARER token: 401",
        )
        .unwrap();
        assert_eq!(token.to_string(), "broker k1:9093,k2:9093: authentication failed: Failed to acquire SASL OAUTHBEARER token: 401");
    }

    #[test]
    fn the_first_fatal_failure_is_kept_and_stops_the_worker() {
        let shutdown = Shutdown::new();
        let fatal = Fatal::new("k:9093", shutdown.clone());
        assert!(!fatal.report(
            &KafkaError::Global(RDKafkaErrorCode::AllBrokersDown),
            "1/1 brokers are down"
        ));
        assert!(!shutdown.is_triggered());
        assert_eq!(fatal.first(), None);
        assert!(fatal.report(&KafkaError::Global(RDKafkaErrorCode::SSL), TLS));
        assert!(shutdown.is_triggered());
        // The producer's report of the same failure, or any later one, does not replace it.
        assert!(!fatal
            .clone()
            .report(&KafkaError::Global(RDKafkaErrorCode::Authentication), AUTH));
        assert_eq!(fatal.first().map(|e| e.code()), Some("tls"));
    }
}
