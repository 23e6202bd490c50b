//! The admin HTTP server (axum): /metrics, /healthz, /readyz, /api/violations, /api/requests/{id}.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use super::timeline::TimelineProvider;
use super::violations;
use crate::telemetry::exposition::Format;
use crate::telemetry::metrics::Metrics;
use crate::telemetry::ready::Readiness;
use crate::telemetry::recent::RecentViolations;

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("cannot bind the admin server to {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("admin server failed: {0}")]
    Serve(std::io::Error),
}

/// What the handlers read. Cheap to clone.
#[derive(Clone)]
pub struct AdminState {
    pub metrics: Arc<Metrics>,
    pub readiness: Readiness,
    pub violations: Arc<RecentViolations>,
    pub timeline: Arc<dyn TimelineProvider>,
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/api/violations", get(violations::violations))
        .route("/api/requests/{id}", get(request_timeline))
        .with_state(state)
}

/// A bound admin server; binding is separate from serving so that `run` can fail fast (exit 2)
/// on a taken port before starting anything else.
pub struct AdminServer {
    listener: tokio::net::TcpListener,
}

impl AdminServer {
    pub async fn bind(addr: SocketAddr) -> Result<AdminServer, AdminError> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| AdminError::Bind { addr, source })?;
        Ok(AdminServer { listener })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound TCP listener has an address")
    }

    /// Serves until `shutdown` completes.
    pub async fn serve(
        self,
        state: AdminState,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), AdminError> {
        tracing::info!(addr = %self.local_addr(), "admin server listening");
        axum::serve(self.listener, router(state))
            .with_graceful_shutdown(shutdown)
            .await
            .map_err(AdminError::Serve)
    }
}

/// OpenMetrics when the scraper asks for it, the Prometheus text format 0.0.4 otherwise.
async fn metrics(State(s): State<AdminState>, headers: HeaderMap) -> Response {
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    let format = Format::negotiate(accept);
    (
        [
            (header::CONTENT_TYPE, format.content_type()),
            (header::VARY, "accept"),
        ],
        s.metrics.render_as(format),
    )
        .into_response()
}

async fn readyz(State(s): State<AdminState>) -> Response {
    let rep = s.readiness.report();
    let code = if rep.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(rep)).into_response()
}

async fn request_timeline(State(s): State<AdminState>, Path(id): Path<String>) -> Response {
    if id.is_empty() || id.len() > 256 {
        return (StatusCode::BAD_REQUEST, "alias must be 1..=256 bytes\n").into_response();
    }
    match s.timeline.timeline(&id) {
        Some(t) => Json(t).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(serde_json::json!({
                "error": "unknown alias (never seen, or evicted from the recent-events index)",
                "query": id,
            })),
        )
            .into_response(),
    }
}
