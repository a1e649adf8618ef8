//! The worker's `/v1` endpoints, served on its HTTP port beside the metrics: read-only lookups of
//! one key as this worker's engine sees it (`GET /v1/counters/{id}`, `GET /v1/rules/{id}`, also as
//! `/v1/rules/{id}/hold`), and ending a hold (`DELETE /v1/rules/{id}/hold`, only with the admin
//! token). The key is given in the query string, typed as in rule files (`?user_id=17` the
//! number, `?user_id='17'` the string). Each request takes the engine between two batches for
//! the reads of one key (at most a rule's counters), and at most [`CONCURRENT_LOOKUPS`] run at
//! once: the rest are answered 429. Nothing of the key reaches logs or metrics (the release log
//! names the rule; the audit record on the decisions topic carries the key and the reason).

use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tokio::sync::Semaphore;

use super::shared::Worker;
use crate::pipeline::inspect::{InspectError, KeyFields};

/// Lookups served at once; more are answered 429 (each holds the engine for a moment).
pub const CONCURRENT_LOOKUPS: usize = 2;

/// Longest request body (a release's reason), in bytes.
const MAX_BODY: usize = 4096;

/// The `/v1` endpoints' handle on the worker, made before the worker starts (the HTTP port
/// serves probes from the start) and bound to it once it runs: until then lookups answer 503.
#[derive(Clone)]
pub struct Lookups {
    worker: Arc<OnceLock<Weak<Worker>>>,
    permits: Arc<Semaphore>,
}

impl Default for Lookups {
    fn default() -> Lookups {
        Lookups::new()
    }
}

impl Lookups {
    pub fn new() -> Lookups {
        Lookups {
            worker: Arc::default(),
            permits: Arc::new(Semaphore::new(CONCURRENT_LOOKUPS)),
        }
    }

    pub(super) fn bind(&self, worker: &Arc<Worker>) {
        let _ = self.worker.set(Arc::downgrade(worker));
    }

    fn worker(&self) -> Option<Arc<Worker>> {
        self.worker.get().and_then(Weak::upgrade)
    }

    /// The `/v1` routes.
    pub fn router(self) -> Router {
        Router::new()
            .route("/v1/counters/{id}", get(get_counter))
            .route("/v1/rules/{id}", get(get_rule))
            .route("/v1/rules/{id}/hold", get(get_rule).delete(delete_hold))
            // Read whole before the token is checked: bounded to a reason's size.
            .layer(DefaultBodyLimit::max(MAX_BODY))
            .with_state(self)
    }
}

/// A JSON error body: `{"error": code, "message": …}`.
fn error(status: StatusCode, code: &str, message: impl std::fmt::Display) -> Response {
    let body = serde_json::json!({ "error": code, "message": message.to_string() });
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn json(body: String) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}

fn status_of(e: &InspectError) -> StatusCode {
    match e {
        InspectError::BadField(_) | InspectError::KeyNotFormed { .. } => StatusCode::BAD_REQUEST,
        InspectError::UnknownId { .. } | InspectError::NoHold(_) => StatusCode::NOT_FOUND,
        InspectError::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// The query's fields (`None` query: none).
fn fields(query: Option<String>) -> Result<KeyFields, InspectError> {
    let query = query.unwrap_or_default();
    let mut fields = KeyFields::default();
    for (field, value) in form_urlencoded::parse(query.as_bytes()) {
        fields.push(&field, &value)?;
    }
    Ok(fields)
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Runs `lookup` on the worker off the async runtime, within the concurrency bound.
async fn with_worker(
    lookups: &Lookups,
    endpoint: &'static str,
    lookup: impl FnOnce(&Worker) -> Response + Send + 'static,
) -> Response {
    let Some(worker) = lookups.worker() else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "starting",
            "the worker is not running yet",
        );
    };
    // Owned and moved into the blocking task: a client that hangs up does not free its slot
    // while its lookup still waits for the engine.
    let Ok(permit) = Arc::clone(&lookups.permits).try_acquire_owned() else {
        worker.metrics.lookup(endpoint, 429);
        return error(
            StatusCode::TOO_MANY_REQUESTS,
            "busy",
            format!("{CONCURRENT_LOOKUPS} lookups are running; try again"),
        );
    };
    let response = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let response = lookup(&worker);
        worker.metrics.lookup(endpoint, response.status().as_u16());
        response
    })
    .await;
    response.unwrap_or_else(|e| error(StatusCode::INTERNAL_SERVER_ERROR, "internal", e))
}

async fn get_counter(
    State(lookups): State<Lookups>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    lookup(lookups, "counter", id, query).await
}

async fn get_rule(
    State(lookups): State<Lookups>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    lookup(lookups, "rule", id, query).await
}

/// A counter's window (`endpoint` "counter") or a rule's hold and counters ("rule") for the key
/// the query gives.
async fn lookup(
    lookups: Lookups,
    endpoint: &'static str,
    id: String,
    query: Option<String>,
) -> Response {
    with_worker(&lookups, endpoint, move |worker| {
        let fields = match fields(query) {
            Ok(fields) => fields,
            Err(e) => return error(status_of(&e), e.code(), e),
        };
        let mut engine = worker.lock_engine();
        let found = engine.inspect(&id, &fields, now_ms());
        drop(engine);
        match (found, endpoint) {
            (Ok(Ok(view)), "counter") => json(serde_json::to_string(&view).unwrap_or_default()),
            (Ok(Err(view)), "rule") => json(serde_json::to_string(&view).unwrap_or_default()),
            (Ok(Ok(_)), _) => error(
                StatusCode::NOT_FOUND,
                "not_a_rule",
                format!("{id:?} is a counter: GET /v1/counters/{id}"),
            ),
            (Ok(Err(_)), _) => error(
                StatusCode::NOT_FOUND,
                "not_a_counter",
                format!("{id:?} is a rule: GET /v1/rules/{id}"),
            ),
            (Err(e), _) => error(status_of(&e), e.code(), e),
        }
    })
    .await
}

/// Whether the request carries `Authorization: Bearer <token>` for a configured token (compared
/// in constant time).
fn authorized(headers: &HeaderMap, token: &str) -> bool {
    if token.is_empty() {
        return false;
    }
    let Some(given) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    else {
        return false;
    };
    let (a, b) = (given.trim().as_bytes(), token.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ReleaseBody {
    reason: String,
}

async fn delete_hold(
    State(lookups): State<Lookups>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Some(worker) = lookups.worker() else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "starting",
            "the worker is not running yet",
        );
    };
    if worker.config.http.admin_token.is_empty() {
        worker.metrics.lookup("release", 403);
        return error(
            StatusCode::FORBIDDEN,
            "no_admin_token",
            "write endpoints are off: no http.admin_token is configured",
        );
    }
    if !authorized(&headers, &worker.config.http.admin_token) {
        worker.metrics.lookup("release", 403);
        return error(
            StatusCode::FORBIDDEN,
            "forbidden",
            "a release needs Authorization: Bearer <http.admin_token>",
        );
    }
    drop(worker);
    let reason = match serde_json::from_slice::<ReleaseBody>(&body) {
        Ok(body) if !body.reason.trim().is_empty() => body.reason,
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "no_reason",
                r#"a release needs a JSON body {"reason": "…"} (a ticket, who asked)"#,
            )
        }
    };
    with_worker(&lookups, "release", move |worker| {
        let fields = match fields(query) {
            Ok(fields) => fields,
            Err(e) => return error(status_of(&e), e.code(), e),
        };
        let release = {
            let mut engine = worker.lock_engine();
            match engine.release_hold(&id, &fields, &reason, now_ms()) {
                Ok(release) => release,
                Err(e) => return error(status_of(&e), e.code(), e),
            }
        };
        tracing::warn!(
            rule = %release.rule,
            released_until = release.released_until,
            "hold released by an operator (key and reason in the audit record on the decisions topic)"
        );
        let record = release.record();
        match crate::sink::audit::write_audit_record(
            &worker.config.kafka,
            release.key.get().as_bytes(),
            record.as_bytes(),
            Duration::from_secs(30),
        ) {
            Ok(()) => json(record),
            Err(e) => {
                tracing::error!(rule = %release.rule, error = %e, "the hold is released but its audit record was not written");
                error(
                    StatusCode::BAD_GATEWAY,
                    "audit_not_written",
                    format!("the hold is released, but its audit record could not be written: {e}. The record: {record}"),
                )
            }
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_configured_bearer_token_authorizes() {
        let mut headers = HeaderMap::new();
        assert!(!authorized(&headers, "s3cret"));
        headers.insert(header::AUTHORIZATION, "Bearer s3cret".parse().unwrap());
        assert!(authorized(&headers, "s3cret"));
        assert!(!authorized(&headers, ""));
        assert!(!authorized(&headers, "s3cre"));
        headers.insert(header::AUTHORIZATION, "Basic s3cret".parse().unwrap());
        assert!(!authorized(&headers, "s3cret"));
    }

    #[test]
    fn query_fields_are_typed_as_in_rule_files() {
        let fields = fields(Some("user_id=17&card.country=%27FR%27".into())).unwrap();
        let expected = KeyFields::parse(["user_id=17", "card.country='FR'"]).unwrap();
        assert_eq!(fields, expected);
    }
}
