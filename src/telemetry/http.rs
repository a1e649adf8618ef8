//! The internal HTTP port: `/metrics` (Prometheus text), `/healthz` (liveness: the consumer loop
//! is turning) and `/readyz` (readiness: rules loaded, store connected, consumer subscribed, a
//! broker reachable, not shutting down); the worker merges its `/v1` routes in.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use super::Metrics;

/// A consumer loop that has not turned for this long is reported dead on `/healthz`.
const STALL_LIMIT: Duration = Duration::from_secs(60);

/// What the probes report, updated by the worker.
#[derive(Debug, Default)]
pub struct Health {
    ready: AtomicBool,
    /// Set when librdkafka reports every broker down; cleared when one is up again.
    brokers_down: AtomicBool,
    /// Wall-clock milliseconds of the consumer loop's last turn; 0 before it starts.
    heartbeat_ms: AtomicU64,
}

impl Health {
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Release);
    }

    /// Ready: subscribed, not shutting down, and some broker reachable.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire) && !self.brokers_down.load(Ordering::Acquire)
    }

    pub fn set_brokers_down(&self, down: bool) {
        self.brokers_down.store(down, Ordering::Release);
    }

    pub fn beat(&self) {
        self.heartbeat_ms.store(now_ms(), Ordering::Release);
    }

    /// Alive unless the loop started and then stalled.
    pub fn is_alive(&self) -> bool {
        let last = self.heartbeat_ms.load(Ordering::Acquire);
        last == 0 || now_ms().saturating_sub(last) < STALL_LIMIT.as_millis() as u64
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[derive(Clone)]
struct AppState {
    metrics: Arc<Metrics>,
    health: Arc<Health>,
}

/// The probes and metrics, with `extra` routes merged in (the worker's `/v1` lookups).
pub fn router(metrics: Arc<Metrics>, health: Arc<Health>, extra: Router) -> Router {
    Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(AppState { metrics, health })
        .merge(extra)
}

/// Binds `listen` (so a taken port fails at startup, not later) and serves until `shutdown`.
pub async fn serve(
    listen: SocketAddr,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    extra: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<impl std::future::Future<Output = std::io::Result<()>>> {
    let listener = tokio::net::TcpListener::bind(listen).await?;
    let app = router(metrics, health, extra);
    Ok(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
    })
}

async fn metrics_text(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
}

async fn healthz(State(state): State<AppState>) -> impl IntoResponse {
    if state.health.is_alive() {
        (StatusCode::OK, "ok\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "consumer loop stalled\n")
    }
}

async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    if state.health.is_ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}
