//! The admin HTTP server (axum): /metrics, /healthz, /readyz, /api/violations, /api/requests/{id},
//! and the pages /requests/{alias} and /incidents.
//!
//! `/api/*` and the pages show request ids and timings: with a bearer token configured they
//! answer 401 without it. `/metrics`, `/healthz` and `/readyz` stay open (scrapers and probes carry no
//! token); with `--metrics-addr` they move to a port of their own, plain HTTP, and the admin
//! port keeps `/` and `/api/*` (over TLS when configured).

use std::future::Future;
use std::net::SocketAddr;

use axum::Json;
use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use super::state::{AdminState, error};
use super::{pages, violations};
use crate::access::{Access, Alpn, Incoming, Server};
use crate::telemetry::exposition::Format;

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("cannot bind the admin server to {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot bind the metrics server to {addr}: {source}")]
    BindMetrics {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("admin server failed: {0}")]
    Serve(std::io::Error),
}

/// The endpoints, for `/` and the answer to an unknown path.
const ENDPOINTS: &[(&str, &str)] = &[
    (
        "/metrics",
        "revenant's own metrics (Prometheus text format, or OpenMetrics when asked)",
    ),
    ("/healthz", "200 while the process serves"),
    (
        "/readyz",
        "200 once every startup component reported in, else 503 (JSON)",
    ),
    (
        "/api/violations?limit=&rule=&fingerprint=",
        "the most recent violations, newest first (JSON)",
    ),
    (
        "/api/requests/{alias}",
        "the correlated timeline of a request: x-request-id, trace id, rid or bootstrap room (JSON)",
    ),
    (
        "/requests/{alias}",
        "the same request as a page: swimlanes of every attempt, its refusal and breaches (HTML)",
    ),
    (
        "/incidents?rule=&severity=&limit=",
        "recent violations, newest first, each linking to its request's page (HTML)",
    ),
];

fn index() -> serde_json::Value {
    let endpoints: serde_json::Map<String, serde_json::Value> = ENDPOINTS
        .iter()
        .map(|(path, what)| ((*path).to_owned(), (*what).into()))
        .collect();
    serde_json::json!({ "endpoints": endpoints })
}

/// `/metrics`, `/healthz`, `/readyz`: open to scrapers and probes.
fn ops_routes() -> Router<AdminState> {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
}

async fn not_found(uri: axum::http::Uri) -> Response {
    let mut body = index();
    body["error"] = format!("no such endpoint: {}", uri.path()).into();
    (StatusCode::NOT_FOUND, Json(body)).into_response()
}

/// Every endpoint on one port.
pub fn router(state: AdminState) -> Router {
    api_router(state.clone()).merge(ops_routes().with_state(state))
}

/// `/` and `/api/*` (the admin port when `/metrics` has a port of its own).
pub fn api_router(state: AdminState) -> Router {
    let api = Router::new()
        .route("/api/violations", get(violations::violations))
        .route("/api/requests/{id}", get(request_timeline))
        .route("/requests/{id}", get(pages::request_page))
        .route("/incidents", get(pages::incidents_page))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_token,
        ));
    Router::new()
        .route("/", get(|| async { Json(index()) }))
        .merge(api)
        .fallback(not_found)
        .with_state(state)
}

/// The metrics port: `/metrics`, `/healthz`, `/readyz`.
pub fn ops_router(state: AdminState) -> Router {
    ops_routes().fallback(not_found).with_state(state)
}

/// 401 without the bearer token, when one is configured.
async fn require_token(
    State(s): State<AdminState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if let Some(token) = &s.access.token
        && !token.admits(
            req.headers()
                .get(header::AUTHORIZATION)
                .map(|v| v.as_bytes()),
        )
    {
        s.access.stats.unauthenticated(Server::Admin);
        let mut resp = error(
            StatusCode::UNAUTHORIZED,
            "missing or wrong bearer token (authorization: Bearer <token>)",
        );
        resp.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            axum::http::HeaderValue::from_static("Bearer"),
        );
        return resp;
    }
    next.run(req).await
}

/// A bound admin server (and metrics server); binding is separate from serving so that `run`
/// can fail fast (exit 2) on a taken port before starting anything else.
pub struct AdminServer {
    incoming: Incoming,
    local: SocketAddr,
    metrics: Option<(tokio::net::TcpListener, SocketAddr)>,
}

impl AdminServer {
    /// Binds `addr` (TLS when `access` has it) and, if given, `metrics_addr` (plain HTTP).
    pub async fn bind(
        addr: SocketAddr,
        metrics_addr: Option<SocketAddr>,
        access: &Access,
    ) -> Result<AdminServer, AdminError> {
        let bind_err = |source| AdminError::Bind { addr, source };
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(bind_err)?;
        let local = listener.local_addr().map_err(bind_err)?;
        let incoming = access
            .incoming(listener, Alpn::Http1, Server::Admin)
            .map_err(bind_err)?;
        let metrics = match metrics_addr {
            None => None,
            Some(addr) => {
                let bind_err = |source| AdminError::BindMetrics { addr, source };
                let l = tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(bind_err)?;
                let local = l.local_addr().map_err(bind_err)?;
                Some((l, local))
            }
        };
        Ok(AdminServer {
            incoming,
            local,
            metrics,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The metrics server's address, when `/metrics` has a port of its own.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(|(_, a)| *a)
    }

    /// Serves until `shutdown` completes.
    pub async fn serve(
        self,
        state: AdminState,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), AdminError> {
        tracing::info!(addr = %self.local, tls = state.access.tls.is_some(), "admin server listening");
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let stopped = move || {
            let mut rx = stop_rx.clone();
            async move {
                let _ = rx.wait_for(|&s| s).await;
            }
        };
        tokio::spawn(async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        });
        let ops = match self.metrics {
            None => None,
            Some((l, addr)) => {
                tracing::info!(%addr, "metrics server listening");
                let app = ops_router(state.clone());
                Some(tokio::spawn(
                    axum::serve(l, app)
                        .with_graceful_shutdown(stopped())
                        .into_future(),
                ))
            }
        };
        let app = match ops {
            None => router(state),
            Some(_) => api_router(state),
        };
        let served = match self.incoming {
            Incoming::Plain(l) => axum::serve(l, app).with_graceful_shutdown(stopped()).await,
            Incoming::Tls(l) => axum::serve(l, app).with_graceful_shutdown(stopped()).await,
        };
        if let Some(ops) = ops {
            match ops.await {
                Ok(r) => r.map_err(AdminError::Serve)?,
                Err(e) => return Err(AdminError::Serve(std::io::Error::other(e))),
            }
        }
        served.map_err(AdminError::Serve)
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
        return error(StatusCode::BAD_REQUEST, "alias must be 1..=256 bytes");
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt as _;

    use super::*;
    use crate::admin::{RecentEvents, RecentEventsLimits};
    use crate::event::{Kind, LifecycleEvent, Source, Stage};
    use crate::telemetry::metrics::Metrics;
    use crate::telemetry::ready::Readiness;
    use crate::telemetry::recent::RecentViolations;

    fn state() -> AdminState {
        let metrics = Arc::new(Metrics::new());
        let timeline = Arc::new(RecentEvents::new(RecentEventsLimits::default()));
        timeline.record(&vec![
            LifecycleEvent::new(1, Stage::Router, Kind::Received, Source::Otlp)
                .with_trace_id("9b7363a4c0ffee000000000000000001"),
        ]);
        AdminState {
            readiness: Readiness::new(metrics.clone(), Duration::from_secs(60)),
            metrics,
            violations: Arc::new(RecentViolations::new(10)),
            timeline,
            access: Access::open(),
            windows: Default::default(),
        }
    }

    async fn get(path: &str) -> (StatusCode, String, serde_json::Value) {
        let resp = router(state())
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        let ct = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        let json = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
        (status, ct, json)
    }

    /// The pages sit behind the same token as `/api`: without it, 401 and no page.
    #[tokio::test]
    async fn pages_need_the_token_as_the_api_does() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "s3cret-token-of-some-length\n").unwrap();
        let mut s = state();
        s.access.token = Some(Arc::new(crate::access::BearerToken::load(path).unwrap()));
        for page in ["/requests/never-seen", "/incidents", "/api/violations"] {
            let call = |auth: Option<&str>| {
                let mut req = Request::get(page);
                if let Some(a) = auth {
                    req = req.header(header::AUTHORIZATION, a);
                }
                router(s.clone()).oneshot(req.body(Body::empty()).unwrap())
            };
            let open = call(None).await.unwrap();
            assert_eq!(open.status(), StatusCode::UNAUTHORIZED, "{page}");
            let body = axum::body::to_bytes(open.into_body(), 1 << 20)
                .await
                .unwrap();
            assert!(!String::from_utf8_lossy(&body).contains("<svg"), "{page}");
            let wrong = call(Some("Bearer nope")).await.unwrap();
            assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED, "{page}");
            let right = call(Some("Bearer s3cret-token-of-some-length"))
                .await
                .unwrap();
            assert_ne!(right.status(), StatusCode::UNAUTHORIZED, "{page}");
        }
    }

    /// Every error is JSON `{"error": …}`; `/` and unknown paths list the endpoints.
    #[tokio::test]
    async fn errors_are_json_and_unknown_paths_list_the_endpoints() {
        for (path, status) in [
            ("/api/violations?limit=abc", StatusCode::BAD_REQUEST),
            ("/api/violations?limit=-1", StatusCode::BAD_REQUEST),
            ("/api/requests/", StatusCode::NOT_FOUND),
            ("/nope", StatusCode::NOT_FOUND),
            ("/api/requests/never-seen", StatusCode::NOT_FOUND),
        ] {
            let (got, ct, body) = get(path).await;
            assert_eq!(got, status, "{path}");
            assert_eq!(ct, "application/json", "{path}");
            assert!(body["error"].is_string(), "{path}: {body}");
        }
        let (_, _, body) = get("/api/violations?limit=abc").await;
        assert!(body["error"].as_str().unwrap().contains("limit"), "{body}");
        let (_, _, body) = get("/nope").await;
        assert!(body["endpoints"]["/readyz"].is_string(), "{body}");
        let (status, _, body) = get("/").await;
        assert_eq!(status, StatusCode::OK);
        assert!(body["endpoints"]["/metrics"].is_string(), "{body}");
    }

    #[tokio::test]
    async fn trace_ids_are_found_in_either_case() {
        let (status, _, _) = get("/api/requests/9b7363a4c0ffee000000000000000001").await;
        assert_eq!(status, StatusCode::OK);
        let (status, _, body) = get("/api/requests/9B7363A4C0FFEE000000000000000001").await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }
}
