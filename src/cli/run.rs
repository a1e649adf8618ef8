//! `vigil run --config FILE`: the Kafka worker until SIGTERM/SIGINT, with `/metrics`, `/healthz`,
//! `/readyz` and the `/v1` lookups served on a small runtime of its own.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;

use vigil::config::{redact_url, Config};
use vigil::shutdown::Shutdown;
use vigil::telemetry::{self, http::Health, Metrics};
use vigil::worker;

use super::load_rules_with;

/// Exit 0 after a clean stop (everything flushed, delivered, committed), 1 otherwise, 2 for a bad
/// config.
pub fn run(config_path: &Path) -> anyhow::Result<ExitCode> {
    let config = match Config::load(config_path) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("error: {e}");
            return Ok(ExitCode::from(2));
        }
    };
    if let Err(e) = telemetry::init_logging(&config.log) {
        eprintln!("error: {}: {e}", config_path.display());
        return Ok(ExitCode::from(2));
    }
    tracing::info!(version = env!("CARGO_PKG_VERSION"), config = ?config, "starting vigil run");
    let Some(rules) = load_rules_with(&config.rules.path, config.rules.allow_empty) else {
        return Ok(ExitCode::from(1));
    };
    if config.redis.url.is_none() {
        tracing::warn!(
            "no redis.url: counting in process, exact only while this is the only worker"
        );
    }
    let (store, journal) = config.store_setup().open().with_context(|| {
        format!(
            "connecting to Redis at {}",
            redact_url(config.redis.url.as_deref().unwrap_or_default())
        )
    })?;
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::default());
    let shutdown = Shutdown::new();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("vigil-http")
        .enable_all()
        .build()
        .context("starting the HTTP runtime")?;
    let listen = config.http.listen;
    let lookups = worker::Lookups::new();
    let server = runtime
        .block_on(telemetry::http::serve(
            listen,
            Arc::clone(&metrics),
            Arc::clone(&health),
            lookups.clone().router(),
            std::future::pending(),
        ))
        .with_context(|| format!("http.listen: cannot listen on {listen}"))?;
    runtime.spawn(async move {
        if let Err(e) = server.await {
            tracing::error!(error = %e, "HTTP server stopped");
        }
    });
    tracing::info!(%listen, "serving /metrics /healthz /readyz and the /v1 lookups");
    runtime.spawn(on_signals(shutdown.clone(), config.worker.shutdown_timeout));
    let result = worker::run(
        config,
        rules,
        store,
        journal,
        metrics,
        health,
        &lookups,
        shutdown.clone(),
    );
    shutdown.trigger();
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(e) => {
            eprintln!("error: {e}");
            Ok(ExitCode::from(1))
        }
    }
}

/// SIGTERM or SIGINT starts the shutdown; a second one, or the shutdown outlasting its bound by
/// five seconds, ends the process at once with exit code 1.
async fn on_signals(shutdown: Shutdown, bound: std::time::Duration) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers");
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
    shutdown.trigger();
    tokio::select! {
        _ = term.recv() => tracing::error!("second signal: exiting now"),
        _ = int.recv() => tracing::error!("second signal: exiting now"),
        _ = tokio::time::sleep(bound + std::time::Duration::from_secs(5)) => {
            tracing::error!(bound_s = bound.as_secs(), "shutdown took too long: exiting now")
        }
    }
    std::process::exit(1);
}
