//! The PD router, with the three behaviours the monitor must tell apart.
//!
//! - `correct`: prefill first; decode is dispatched only once prefill admitted the request
//!   (prefill answers its status line at admission). A rejection never reaches decode.
//! - `concurrent-no-cancel`: sglang-router 0.3.2. Both legs at once with the same body plus
//!   `bootstrap_host`/`bootstrap_port`/`bootstrap_room` appended at the end of the JSON; when
//!   prefill fails the decode leg is left running; a 503 is retried with a new room under the
//!   same `x-request-id`.
//! - `handoff-after-reject`: the disclosed bug. Prefill first; when prefill rejects, the
//!   request is still handed to decode (and the cluster runs prefill with
//!   `--transfer-after-reject`, so the rejected room's KV is transferred and decode generates).
//!
//! Every mode retries 503 with a fresh room. The client sees prefill's error when prefill
//! fails, decode's answer otherwise.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use serde::Serialize;
use tokio::net::TcpListener;

use crate::common::{
    HttpClient, TraceParent, error_response, http_client, json_response, new_room, now_ns,
    random_span_id, random_trace_id,
};
use crate::spans::{Exporter, ExporterConfig, SpanSink, SpanSpec, event, kv_str};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    Correct,
    ConcurrentNoCancel,
    HandoffAfterReject,
}

#[derive(clap::Args, Clone, Debug)]
pub struct RouterArgs {
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    #[arg(long, value_enum, default_value_t = Mode::Correct)]
    pub mode: Mode,
    /// Prefill worker URL, e.g. http://127.0.0.1:30001
    #[arg(long)]
    pub prefill: String,
    /// Prefill's bootstrap port, sent to both legs as `bootstrap_port`.
    #[arg(long, default_value_t = 8998)]
    pub bootstrap_port: u16,
    /// Decode worker URL, e.g. http://127.0.0.1:30002
    #[arg(long)]
    pub decode: String,
    /// Total attempts for a request that prefill answers 503 (smg's --retry-max-retries).
    #[arg(long, default_value_t = 5)]
    pub retry_max_retries: u32,
    #[arg(long, default_value_t = 50)]
    pub retry_initial_backoff_ms: u64,
    #[arg(long)]
    pub otlp_endpoint: Option<String>,
    /// Per-leg timeout, seconds.
    #[arg(long, default_value_t = 60)]
    pub request_timeout_secs: u64,
}

#[derive(Default, Serialize)]
pub struct RouterStats {
    pub requests: AtomicU64,
    pub attempts: AtomicU64,
    /// Attempts after the first (prefill 503, or decode 5xx in concurrent-no-cancel).
    pub retries: AtomicU64,
    pub prefill_rejections: AtomicU64,
    pub decode_legs: AtomicU64,
    /// Decode legs left running after prefill failed (concurrent-no-cancel, handoff).
    pub decode_legs_after_prefill_failure: AtomicU64,
    pub upstream_errors: AtomicU64,
    pub responses_2xx: AtomicU64,
    pub responses_4xx: AtomicU64,
    pub responses_5xx: AtomicU64,
}

struct Rt {
    args: RouterArgs,
    prefill: String,
    decode: String,
    bootstrap_host: String,
    client: HttpClient,
    stats: RouterStats,
    spans: SpanSink,
}

type Shared = Arc<Rt>;

pub async fn run(args: RouterArgs) -> anyhow::Result<()> {
    let prefill = args.prefill.trim_end_matches('/').to_string();
    let decode = args.decode.trim_end_matches('/').to_string();
    let prefill_uri: hyper::Uri = prefill.parse()?;
    let bootstrap_host = prefill_uri.host().unwrap_or("127.0.0.1").to_string();
    decode.parse::<hyper::Uri>()?;
    let listener = TcpListener::bind((args.host.as_str(), args.port)).await?;
    let addr = listener.local_addr()?;
    let exporter = Exporter::start(ExporterConfig {
        endpoint: args.otlp_endpoint.clone(),
        service_name: "smg",
        scope_name: "smg",
        resource_attrs: vec![crate::spans::kv_str("host.name", crate::spans::host_name())],
    });
    let rt: Shared = Arc::new(Rt {
        prefill,
        decode,
        bootstrap_host,
        client: http_client(1024),
        stats: RouterStats::default(),
        spans: exporter.sink.clone(),
        args,
    });
    let app = Router::new()
        .route("/generate", post(generate))
        .route("/v1/chat/completions", post(chat))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/readiness", get(|| async { StatusCode::OK }))
        .route("/server_info", get(server_info))
        .route("/get_server_info", get(server_info))
        .route("/model_info", get(model_info))
        .route("/get_model_info", get(model_info))
        .route("/v1/models", get(models))
        .route("/sim/stats", get(sim_stats))
        // Last, so it covers every route above.
        .layer(axum::extract::DefaultBodyLimit::max(
            crate::worker::BODY_LIMIT,
        ))
        .with_state(rt.clone());
    crate::common::print_ready(serde_json::json!({
        "role": "router",
        "http": format!("http://{addr}"),
        "port": addr.port(),
        "mode": rt.args.mode,
        "pid": std::process::id(),
    }));
    tracing::info!(%addr, mode = ?rt.args.mode, "router ready");
    // Without TCP_NODELAY a streamed answer's second chunk waits for the client's delayed ACK
    // (~40 ms): that was the p99 of the load generator.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(crate::common::shutdown_signal())
        .await?;
    exporter.shutdown(Duration::from_secs(3)).await;
    Ok(())
}

async fn sim_stats(State(rt): State<Shared>) -> Response {
    axum::Json(serde_json::json!({"role": "router", "mode": rt.args.mode, "router": &rt.stats, "otlp": &*rt.spans.stats}))
        .into_response()
}

async fn proxy_get(rt: &Rt, path: &str) -> Response {
    let req = hyper::Request::get(format!("{}{path}", rt.prefill))
        .body(Full::new(Bytes::new()))
        .expect("static");
    match rt.client.request(req).await {
        Ok(resp) => {
            let status = resp.status();
            match resp.into_body().collect().await {
                Ok(b) => json_response(status, String::from_utf8_lossy(&b.to_bytes()).into_owned()),
                Err(e) => error_response(StatusCode::BAD_GATEWAY, &format!("prefill body: {e}")),
            }
        }
        Err(e) => error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &format!("prefill unreachable: {e}"),
        ),
    }
}

async fn server_info(State(rt): State<Shared>) -> Response {
    proxy_get(&rt, "/server_info").await
}

async fn model_info(State(rt): State<Shared>) -> Response {
    proxy_get(&rt, "/model_info").await
}

async fn models(State(rt): State<Shared>) -> Response {
    proxy_get(&rt, "/v1/models").await
}

async fn generate(State(rt): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    route(rt, "/generate", headers, body).await
}

async fn chat(State(rt): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    route(rt, "/v1/chat/completions", headers, body).await
}

/// smg names requests without an `x-request-id` `req-` + 24 alphanumerics (seen in its logs).
fn new_request_id() -> String {
    use rand::RngExt;
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    let tail: String = (0..24)
        .map(|_| A[rng.random_range(0..A.len())] as char)
        .collect();
    format!("req-{tail}")
}

/// Append the bootstrap fields at the end of the JSON object, byte for byte, the way the
/// real router's requests look (see fixtures/logs_prefill.jsonl). `None` if not an object.
pub fn with_bootstrap(body: &[u8], host: &str, port: u16, room: u64) -> Option<Vec<u8>> {
    let end = body.iter().rposition(|b| !b.is_ascii_whitespace())?;
    if body[end] != b'}' {
        return None;
    }
    let start = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body[start] != b'{' {
        return None;
    }
    let empty = body[start + 1..end].iter().all(|b| b.is_ascii_whitespace());
    let mut out = Vec::with_capacity(body.len() + 96);
    out.extend_from_slice(&body[..end]);
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(
        format!(
            "\"bootstrap_host\":{},\"bootstrap_port\":{port},\"bootstrap_room\":{room}}}",
            serde_json::Value::from(host)
        )
        .as_bytes(),
    );
    Some(out)
}

enum Leg {
    Resp(hyper::Response<Incoming>),
    Failed(String),
}

async fn send(
    rt: &Rt,
    base: &str,
    path: &str,
    body: Bytes,
    request_id: &str,
    tp: &TraceParent,
) -> Leg {
    let req = hyper::Request::post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .header("x-request-id", request_id)
        .header("traceparent", tp.header_value())
        .body(Full::new(body))
        .expect("valid request parts");
    match tokio::time::timeout(
        Duration::from_secs(rt.args.request_timeout_secs),
        rt.client.request(req),
    )
    .await
    {
        Ok(Ok(r)) => Leg::Resp(r),
        Ok(Err(e)) => Leg::Failed(e.to_string()),
        Err(_) => Leg::Failed("timed out".into()),
    }
}

/// Read a leg to its end in the background; the result is discarded (nobody cancels it).
fn drain(leg: impl std::future::Future<Output = Leg> + Send + 'static) {
    tokio::spawn(async move {
        if let Leg::Resp(r) = leg.await {
            let _ = r.into_body().collect().await;
        }
    });
}

fn pass_through(r: hyper::Response<Incoming>) -> Response {
    let (parts, body) = r.into_parts();
    let mut resp = Response::new(Body::new(body));
    *resp.status_mut() = parts.status;
    for k in ["content-type", "cache-control"] {
        if let Some(v) = parts.headers.get(k) {
            resp.headers_mut().insert(k, v.clone());
        }
    }
    resp
}

async fn buffered(r: hyper::Response<Incoming>) -> Response {
    let (parts, body) = r.into_parts();
    let bytes = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let mut resp = Response::new(Body::from(bytes));
    *resp.status_mut() = parts.status;
    if let Some(v) = parts.headers.get("content-type") {
        resp.headers_mut().insert("content-type", v.clone());
    }
    resp
}

struct RouterSpan {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    parent: Option<[u8; 8]>,
    start: u64,
    events: Vec<opentelemetry_proto::tonic::trace::v1::span::Event>,
}

async fn route(rt: Shared, path: &'static str, headers: HeaderMap, body: Bytes) -> Response {
    rt.stats.requests.fetch_add(1, Ordering::Relaxed);
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .unwrap_or_else(new_request_id);
    let incoming = headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(TraceParent::parse);
    let mut span = RouterSpan {
        trace_id: incoming.map(|t| t.trace_id).unwrap_or_else(random_trace_id),
        span_id: random_span_id(),
        parent: incoming.map(|t| t.span_id),
        start: now_ns(),
        events: Vec::new(),
    };
    let tp = TraceParent {
        trace_id: span.trace_id,
        span_id: span.span_id,
    };
    let resp = route_inner(&rt, path, &request_id, &tp, &body, &mut span).await;
    let status = resp.status();
    match status.as_u16() {
        200..=299 => rt.stats.responses_2xx.fetch_add(1, Ordering::Relaxed),
        400..=499 => rt.stats.responses_4xx.fetch_add(1, Ordering::Relaxed),
        _ => rt.stats.responses_5xx.fetch_add(1, Ordering::Relaxed),
    };
    if rt.spans.enabled() {
        let end = now_ns();
        let s = SpanSpec {
            trace_id: span.trace_id,
            span_id: span.span_id,
            parent: span.parent,
            name: "http_request".into(),
            start_ns: span.start,
            end_ns: end,
            attributes: vec![
                kv_str("code.namespace", "smg::middleware"),
                kv_str("method", "POST"),
                kv_str("uri", path),
                kv_str("version", "HTTP/1.1"),
                kv_str("module", "smg"),
                kv_str("request_id", request_id.clone()),
                kv_str("status_code", status.as_u16().to_string()),
                kv_str("latency", ((end - span.start) / 1000).to_string()),
            ],
            events: std::mem::take(&mut span.events),
            error: None,
        }
        .build();
        rt.spans.emit(vec![s]);
    }
    resp
}

fn ev(name: &str, attrs: Vec<(&str, &str)>) -> opentelemetry_proto::tonic::trace::v1::span::Event {
    let mut a = vec![
        kv_str("level", "INFO"),
        kv_str("target", "smg::observability::events"),
    ];
    for (k, v) in attrs {
        a.push(kv_str(k, v));
    }
    event(name, now_ns(), a)
}

async fn route_inner(
    rt: &Shared,
    path: &'static str,
    request_id: &str,
    tp: &TraceParent,
    body: &Bytes,
    span: &mut RouterSpan,
) -> Response {
    // Validate once; the body is forwarded byte for byte plus the bootstrap fields.
    if serde_json::from_slice::<serde::de::IgnoredAny>(body).is_err() {
        return error_response(StatusCode::BAD_REQUEST, "invalid JSON body");
    }
    let mode = rt.args.mode;
    let attempts = rt.args.retry_max_retries.max(1);
    let mut backoff = Duration::from_millis(rt.args.retry_initial_backoff_ms);
    let mut last: Option<Response> = None;
    for attempt in 0..attempts {
        if attempt > 0 {
            rt.stats.retries.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
        rt.stats.attempts.fetch_add(1, Ordering::Relaxed);
        let room = new_room();
        let Some(leg_body) = with_bootstrap(body, &rt.bootstrap_host, rt.args.bootstrap_port, room)
        else {
            return error_response(
                StatusCode::BAD_REQUEST,
                "request body must be a JSON object",
            );
        };
        let leg_body = Bytes::from(leg_body);
        let prefill_leg;
        let mut decode_leg = None;
        match mode {
            Mode::ConcurrentNoCancel => {
                span.events.push(ev(
                    "Sending concurrent requests",
                    vec![("prefill_url", &rt.prefill), ("decode_url", &rt.decode)],
                ));
                rt.stats.decode_legs.fetch_add(1, Ordering::Relaxed);
                let (rt2, b2, rid2, tp2) =
                    (rt.clone(), leg_body.clone(), request_id.to_owned(), *tp);
                // The decode leg is its own task: nothing cancels it once sent.
                decode_leg = Some(tokio::spawn(async move {
                    send(&rt2, &rt2.decode, path, b2, &rid2, &tp2).await
                }));
                prefill_leg = send(rt, &rt.prefill, path, leg_body.clone(), request_id, tp).await;
            }
            Mode::Correct | Mode::HandoffAfterReject => {
                span.events.push(ev(
                    "Sending prefill request",
                    vec![("prefill_url", &rt.prefill)],
                ));
                prefill_leg = send(rt, &rt.prefill, path, leg_body.clone(), request_id, tp).await;
            }
        }
        let prefill_resp = match prefill_leg {
            Leg::Resp(r) => r,
            Leg::Failed(e) => {
                rt.stats.upstream_errors.fetch_add(1, Ordering::Relaxed);
                if let Some(d) = decode_leg {
                    rt.stats
                        .decode_legs_after_prefill_failure
                        .fetch_add(1, Ordering::Relaxed);
                    drain(async move { d.await.unwrap_or(Leg::Failed("join".into())) });
                }
                return error_response(
                    StatusCode::BAD_GATEWAY,
                    &format!("prefill request failed: {e}"),
                );
            }
        };
        let pstatus = prefill_resp.status();
        if !pstatus.is_success() {
            rt.stats.prefill_rejections.fetch_add(1, Ordering::Relaxed);
            match (mode, decode_leg) {
                (Mode::ConcurrentNoCancel, Some(d)) => {
                    rt.stats
                        .decode_legs_after_prefill_failure
                        .fetch_add(1, Ordering::Relaxed);
                    if pstatus != StatusCode::SERVICE_UNAVAILABLE {
                        // smg 0.3.2 joins both legs: a decode 5xx (its KV never came) wins
                        // over prefill's 4xx and is retried with a new room, as observed with
                        // the real router in front of this simulator (tests/real_router.rs).
                        let prefill_err = buffered(prefill_resp).await;
                        let decoded = d.await.unwrap_or(Leg::Failed("decode task failed".into()));
                        span.events.push(ev("Received concurrent requests", vec![]));
                        match decoded {
                            Leg::Resp(r) if r.status().is_server_error() => {
                                let resp = buffered(r).await;
                                if attempt + 1 < attempts {
                                    last = Some(resp);
                                    continue;
                                }
                                return resp;
                            }
                            other => {
                                drain(async move { other });
                                return prefill_err;
                            }
                        }
                    }
                    span.events.push(ev("Received concurrent requests", vec![]));
                    drain(async move { d.await.unwrap_or(Leg::Failed("join".into())) });
                }
                (Mode::HandoffAfterReject, _) => {
                    // The bug: the rejected attempt is handed to decode all the same.
                    span.events.push(ev(
                        "Sending decode request",
                        vec![("decode_url", &rt.decode)],
                    ));
                    rt.stats.decode_legs.fetch_add(1, Ordering::Relaxed);
                    rt.stats
                        .decode_legs_after_prefill_failure
                        .fetch_add(1, Ordering::Relaxed);
                    let (rt2, b2, rid2, tp2) =
                        (rt.clone(), leg_body.clone(), request_id.to_owned(), *tp);
                    drain(async move { send(&rt2, &rt2.decode, path, b2, &rid2, &tp2).await });
                }
                _ => {}
            }
            let resp = buffered(prefill_resp).await;
            if pstatus == StatusCode::SERVICE_UNAVAILABLE && attempt + 1 < attempts {
                last = Some(resp);
                continue;
            }
            return resp;
        }
        // Prefill admitted: its body finishes when the KV transfer is done; read it aside.
        drain(async move { Leg::Resp(prefill_resp) });
        let decode_resp = match decode_leg {
            Some(d) => {
                let r = d.await.unwrap_or(Leg::Failed("decode task failed".into()));
                span.events.push(ev("Received concurrent requests", vec![]));
                r
            }
            None => {
                span.events.push(ev(
                    "Sending decode request",
                    vec![("decode_url", &rt.decode)],
                ));
                rt.stats.decode_legs.fetch_add(1, Ordering::Relaxed);
                send(rt, &rt.decode, path, leg_body, request_id, tp).await
            }
        };
        return match decode_resp {
            Leg::Resp(r) => pass_through(r),
            Leg::Failed(e) => {
                rt.stats.upstream_errors.fetch_add(1, Ordering::Relaxed);
                error_response(
                    StatusCode::BAD_GATEWAY,
                    &format!("decode request failed: {e}"),
                )
            }
        };
    }
    last.unwrap_or_else(|| {
        error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "The request queue is full.",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bootstrap_fields_are_appended_at_the_end() {
        let b = br#"{"text":"Hello","stream":false}"#;
        let out = with_bootstrap(b, "127.0.0.1", 8998, 42).unwrap();
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{"text":"Hello","stream":false,"bootstrap_host":"127.0.0.1","bootstrap_port":8998,"bootstrap_room":42}"#
        );
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["bootstrap_room"], 42);
        assert_eq!(
            std::str::from_utf8(&with_bootstrap(b" { } ", "h", 1, 2).unwrap()).unwrap(),
            r#" { "bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":2}"#
        );
        assert!(with_bootstrap(b"[1]", "h", 1, 2).is_none());
    }
}
