//! The vLLM-flavoured router, shaped like vllm-router 0.1.17 in PD mode (`--flavour vllm`):
//! sequential, prefill first, one id X per client request on both legs.
//!
//! - X = `___prefill_addr_<host:port>___decode_addr_<host:port>_<32 hex>` (new per request),
//!   sent as `X-Request-Id` on both legs; the client's own `x-request-id` is only echoed back
//!   (absent: `cmpl-`/`chatcmpl-` + 24 alphanumerics, as the real router answers).
//! - Prefill leg: the client body with `max_tokens: 1`, `min_tokens: 1`, `stream: false` and
//!   `kv_transfer_params {do_remote_decode: true, …}`.
//! - Decode leg: the client body plus prefill's answered `kv_transfer_params` (copied as
//!   found: `null` stays `null`, absent stays absent); decode's answer (stream or not) is
//!   passed through.
//! - `correct`: a prefill status ≥ 400 is answered at once (4xx passed through; 5xx → 500
//!   `Transparent proxy request failed: …`, text/plain, as the real router words it); decode
//!   is never contacted.
//! - `handoff-after-reject` (the older bug): prefill's body is parsed for
//!   `kv_transfer_params` whatever its status, so a rejection with a JSON body still goes to
//!   decode (without params) and the client gets decode's answer.
//! - `reuse-kv-params` (a fault): as `correct`, but every `--reuse-kv-params-every`-th request
//!   (counted in prefill answers, 9 by default) goes to decode with the params prefill answered
//!   for the request before it, so decode reads that request's KV. `/sim/stats` lists each in
//!   `reused_kv_params` (`request_id`: the X decode served, `params_of`: the X whose params it
//!   got, `remote_request_id`: the KV it read).
//! - `forge-kv-params` (a fault): as `reuse-kv-params`, but the decode leg keeps its own params
//!   with a `remote_request_id` prefill never issued (`cmpl-forged-<n>-0-<8 hex>`); listed the
//!   same way, with `params_of` `forged`.
//!
//! - `--kv-connector mooncake` (as vllm-router 0.1.17 does it, seen on the wire): at start
//!   `GET http://<prefill host>:<--bootstrap-port>/query` for prefill's engine id (dp rank 0);
//!   per request a `transfer_id` `xfer-<uuid4>`; still sequential, prefill first. Prefill leg:
//!   `kv_transfer_params {do_remote_decode: true, do_remote_prefill: false, transfer_id}`;
//!   decode leg: `{do_remote_decode: false, do_remote_prefill: true, transfer_id,
//!   remote_bootstrap_addr: "http://<prefill host>:<port>", remote_engine_id}`, built by the
//!   router (prefill's answered params are not read). A prefill ≥ 400 ends the request as above;
//!   `handoff-after-reject` still sends decode its leg (and so a pull for the refused transfer),
//!   `reuse-kv-params` the previous request's decode params (its transfer id).
//!
//! Spans (`service.name=vllm-router`, scope `vllm-router`, attributes as vllm-router 0.1.17
//! exports them with tracing enabled): SERVER `POST /v1/completions` with two CLIENT children
//! (`vllm.request_phase` = prefill | decode); each leg's `traceparent` carries its CLIENT span.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use opentelemetry_proto::tonic::trace::v1::{Span, span::SpanKind};
use rand::RngExt;
use serde::Serialize;
use tokio::net::TcpListener;

use super::KvConnector;
use crate::http::{HttpClient, http_client};
use crate::ids::now_ns;
use crate::router::{Mode, RouterArgs};
use crate::spans::{Exporter, ExporterConfig, SpanSink, SpanSpec, kv_str};
use crate::trace_ctx::{TraceParent, random_span_id, random_trace_id};

#[derive(Default, Serialize)]
pub struct Stats {
    pub requests: AtomicU64,
    /// Client bodies that are not a JSON object (400, no leg sent).
    pub bad_requests: AtomicU64,
    pub prefill_legs: AtomicU64,
    /// Prefill answers with status ≥ 400.
    pub prefill_rejections: AtomicU64,
    pub prefill_4xx: AtomicU64,
    pub prefill_5xx: AtomicU64,
    /// Prefill legs that got no answer (connect error, timeout).
    pub prefill_failures: AtomicU64,
    pub decode_legs: AtomicU64,
    /// Decode legs sent after prefill answered ≥ 400 (handoff-after-reject only).
    pub decode_legs_after_prefill_rejection: AtomicU64,
    /// Decode legs whose body carries no (or null) `kv_transfer_params`.
    pub decode_legs_without_kv_params: AtomicU64,
    pub decode_failures: AtomicU64,
    pub responses_2xx: AtomicU64,
    pub responses_4xx: AtomicU64,
    pub responses_5xx: AtomicU64,
    pub health_checks: AtomicU64,
    pub health_failures: AtomicU64,
    /// `/metrics` reads of the workers (answered 2xx).
    pub metrics_polls: AtomicU64,
    /// `reuse-kv-params`: decode legs sent with the previous request's params.
    pub decode_legs_with_reused_kv_params: AtomicU64,
}

/// One decode leg `reuse-kv-params` sent with another request's params.
#[derive(Clone, Serialize)]
struct Reused {
    request_id: String,
    params_of: String,
    remote_request_id: Option<String>,
    /// Mooncake: the transfer id decode pulled.
    transfer_id: Option<String>,
}

struct Endpoint {
    /// `http://host:port`
    base: String,
    /// `host:port`, as it appears in X.
    authority: String,
    host: String,
    port: u16,
    healthy: AtomicBool,
}

impl Endpoint {
    fn parse(url: &str) -> anyhow::Result<Endpoint> {
        let base = url.trim_end_matches('/').to_string();
        let uri: hyper::Uri = base.parse()?;
        let host = uri
            .host()
            .ok_or_else(|| anyhow::anyhow!("{url}: no host"))?
            .to_string();
        let port = uri.port_u16().unwrap_or(80);
        Ok(Endpoint {
            authority: format!("{host}:{port}"),
            base,
            host,
            port,
            healthy: AtomicBool::new(true),
        })
    }
}

struct Rt {
    mode: Mode,
    prefill: Endpoint,
    decode: Endpoint,
    client: HttpClient,
    timeout: Duration,
    stats: Stats,
    spans: SpanSink,
    reuse_every: u64,
    /// Prefill answers with params so far, and the last one's X and params.
    answered: AtomicU64,
    previous: std::sync::Mutex<Option<(String, serde_json::Value)>>,
    reused: std::sync::Mutex<Vec<Reused>>,
    /// Mooncake: prefill's bootstrap server and engine id.
    mooncake: Option<(String, String)>,
}

type Shared = Arc<Rt>;

pub async fn run(args: RouterArgs) -> anyhow::Result<()> {
    if !matches!(
        args.mode,
        Mode::Correct | Mode::HandoffAfterReject | Mode::ReuseKvParams | Mode::ForgeKvParams
    ) {
        anyhow::bail!(
            "--flavour vllm supports --mode correct, handoff-after-reject, reuse-kv-params and \
             forge-kv-params"
        );
    }
    if args.reuse_kv_params_every < 2 {
        anyhow::bail!("--reuse-kv-params-every must be at least 2");
    }
    let prefill = Endpoint::parse(&args.prefill)?;
    let decode = Endpoint::parse(&args.decode)?;
    let client = http_client(1024);
    let mooncake = match args.kv_connector {
        KvConnector::Nixl => None,
        KvConnector::Mooncake => {
            let boot = format!("http://{}:{}", prefill.host, args.bootstrap_port);
            Some((boot.clone(), mooncake_engine(&client, &boot).await?))
        }
    };
    let listener = TcpListener::bind((args.host.as_str(), args.port)).await?;
    let addr = listener.local_addr()?;
    let exporter = Exporter::start(ExporterConfig {
        endpoint: args.otlp_endpoint.clone(),
        service_name: "vllm-router",
        scope_name: "vllm-router",
        resource_attrs: vec![kv_str("host.name", crate::spans::host_name())],
    });
    let rt: Shared = Arc::new(Rt {
        mode: args.mode,
        prefill,
        decode,
        client,
        timeout: Duration::from_secs(args.request_timeout_secs),
        stats: Stats::default(),
        spans: exporter.sink.clone(),
        reuse_every: args.reuse_kv_params_every,
        answered: AtomicU64::new(0),
        previous: std::sync::Mutex::new(None),
        reused: std::sync::Mutex::new(Vec::new()),
        mooncake,
    });
    // As vllm-router does: check the workers and read their metrics at start, then check them
    // every interval (and, when asked, read the metrics every interval of their own).
    poll_health(&rt).await;
    poll_metrics(&rt).await;
    if args.metrics_poll_interval_secs > 0 {
        let rt = rt.clone();
        let every = Duration::from_secs(args.metrics_poll_interval_secs);
        tokio::spawn(async move {
            let mut iv = tokio::time::interval(every);
            iv.tick().await;
            loop {
                iv.tick().await;
                poll_metrics(&rt).await;
            }
        });
    }
    {
        let rt = rt.clone();
        let every = Duration::from_secs(args.health_check_interval_secs.max(1));
        tokio::spawn(async move {
            let mut iv = tokio::time::interval(every);
            iv.tick().await;
            loop {
                iv.tick().await;
                poll_health(&rt).await;
            }
        });
    }
    let app = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/generate", post(generate))
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/sim/stats", get(sim_stats))
        .layer(axum::extract::DefaultBodyLimit::max(
            crate::worker::BODY_LIMIT,
        ))
        .with_state(rt.clone());
    crate::serve::print_ready(serde_json::json!({
        "role": "router",
        "flavour": "vllm",
        "http": format!("http://{addr}"),
        "port": addr.port(),
        "mode": rt.mode,
        "pid": std::process::id(),
    }));
    tracing::info!(%addr, mode = ?rt.mode, "vllm router ready");
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(crate::serve::shutdown_signal())
        .await?;
    exporter.shutdown(Duration::from_secs(3)).await;
    Ok(())
}

/// Prefill's engine id from its Mooncake bootstrap server (dp rank 0), asked until it answers
/// (at most ~30 s: prefill registers its worker after it binds the server).
async fn mooncake_engine(client: &HttpClient, boot: &str) -> anyhow::Result<String> {
    let url = format!("{boot}/query");
    let mut last = String::new();
    for _ in 0..150 {
        match crate::http::get(client, &url, Duration::from_secs(5)).await {
            Ok((s, body)) if s.is_success() => {
                let q: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                if let Some(e) = super::mooncake::engine_of_rank0(&q) {
                    tracing::info!("Got Mooncake engine_ids for {boot}: {{0: {e:?}}}");
                    return Ok(e);
                }
                last = format!("no dp rank 0 in {}", String::from_utf8_lossy(&body));
            }
            Ok((s, _)) => last = format!("HTTP {s}"),
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    anyhow::bail!("Failed to query Mooncake bootstrap for {boot}: {last}")
}

/// `uuid.uuid4()` spelled as Python prints it.
fn uuid4() -> String {
    let h = format!("{:032x}", rand::rng().random::<u128>());
    let variant = ["8", "9", "a", "b"][rand::rng().random_range(0..4)];
    format!(
        "{}-{}-4{}-{variant}{}-{}",
        &h[..8],
        &h[8..12],
        &h[13..16],
        &h[17..20],
        &h[20..]
    )
}

async fn poll_metrics(rt: &Rt) {
    for ep in [&rt.prefill, &rt.decode] {
        let url = format!("{}/metrics", ep.base);
        if matches!(
            crate::http::get(&rt.client, &url, Duration::from_secs(5)).await,
            Ok((s, _)) if s.is_success()
        ) {
            rt.stats.metrics_polls.fetch_add(1, Ordering::Relaxed);
        }
    }
}

async fn poll_health(rt: &Rt) {
    for ep in [&rt.prefill, &rt.decode] {
        rt.stats.health_checks.fetch_add(1, Ordering::Relaxed);
        let url = format!("{}/health", ep.base);
        let ok = matches!(
            crate::http::get(&rt.client, &url, Duration::from_secs(5)).await,
            Ok((s, _)) if s.is_success()
        );
        if !ok {
            rt.stats.health_failures.fetch_add(1, Ordering::Relaxed);
        }
        ep.healthy.store(ok, Ordering::Relaxed);
    }
}

async fn health(State(rt): State<Shared>) -> Response {
    let bad: Vec<&str> = [&rt.prefill, &rt.decode]
        .iter()
        .filter(|e| !e.healthy.load(Ordering::Relaxed))
        .map(|e| e.base.as_str())
        .collect();
    if bad.is_empty() {
        (StatusCode::OK, "All servers healthy").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("Unhealthy servers: {bad:?}"),
        )
            .into_response()
    }
}

async fn models(State(rt): State<Shared>) -> Response {
    let url = format!("{}/v1/models", rt.prefill.base);
    match crate::http::get(&rt.client, &url, Duration::from_secs(10)).await {
        Ok((status, body)) => {
            crate::http::json_response(status, String::from_utf8_lossy(&body).into_owned())
        }
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("prefill: {e}")).into_response(),
    }
}

async fn sim_stats(State(rt): State<Shared>) -> Response {
    axum::Json(serde_json::json!({
        "role": "router",
        "flavour": "vllm",
        "mode": rt.mode,
        "router": &rt.stats,
        "reused_kv_params": rt.reused.lock().map(|r| r.clone()).unwrap_or_default(),
        "kv_connector": if rt.mooncake.is_some() { "mooncake" } else { "nixl" },
        "mooncake_engine_id": rt.mooncake.as_ref().map(|m| m.1.clone()),
        "prefill_healthy": rt.prefill.healthy.load(Ordering::Relaxed),
        "decode_healthy": rt.decode.healthy.load(Ordering::Relaxed),
        "otlp": &*rt.spans.stats,
    }))
    .into_response()
}

async fn completions(State(rt): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    route(rt, "/v1/completions", "cmpl-", headers, body).await
}

async fn chat(State(rt): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    route(rt, "/v1/chat/completions", "chatcmpl-", headers, body).await
}

async fn generate(State(rt): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    route(rt, "/generate", "cmpl-", headers, body).await
}

fn alnum(n: usize) -> String {
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..n)
        .map(|_| A[rng.random_range(0..A.len())] as char)
        .collect()
}

/// X, in vllm-router's spelling.
pub fn pd_request_id(prefill: &str, decode: &str) -> String {
    format!(
        "___prefill_addr_{prefill}___decode_addr_{decode}_{:032x}",
        rand::rng().random::<u128>()
    )
}

/// The prefill leg's body: the client's with `max_tokens`/`min_tokens` 1, no stream, and
/// the request for a remote decode.
pub fn prefill_body(
    client: &serde_json::Map<String, serde_json::Value>,
    transfer_id: Option<&str>,
) -> Vec<u8> {
    let mut b = client.clone();
    b.insert("max_tokens".into(), 1.into());
    if b.contains_key("max_completion_tokens") {
        b.insert("max_completion_tokens".into(), 1.into());
    }
    b.insert("min_tokens".into(), 1.into());
    b.insert("stream".into(), false.into());
    b.remove("stream_options");
    // The real router writes the prefill leg's params in this order (mooncake: the transfer id
    // it made).
    let kv = match transfer_id {
        Some(t) => format!(
            r#"{{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":{}}}"#,
            serde_json::Value::from(t)
        ),
        None => r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#.to_owned(),
    };
    body_with_params_last(&b, Some(&kv))
}

/// A leg's body as vllm-router 0.1.17 writes it: the client's fields, then
/// `kv_transfer_params` last, verbatim (for decode, in the order prefill answered them), so a
/// reader of the body's end finds them there as on a real deployment.
fn body_with_params_last(
    fields: &serde_json::Map<String, serde_json::Value>,
    params: Option<&str>,
) -> Vec<u8> {
    let mut fields = fields.clone();
    fields.remove("kv_transfer_params");
    let mut out = serde_json::to_vec(&fields).unwrap_or_default();
    if let Some(p) = params {
        out.pop();
        if !fields.is_empty() {
            out.push(b',');
        }
        out.extend_from_slice(b"\"kv_transfer_params\":");
        out.extend_from_slice(p.as_bytes());
        out.push(b'}');
    }
    out
}

/// One span of the request (SERVER, or a leg's CLIENT), ended when it is emitted.
struct OpenSpan {
    id: [u8; 8],
    parent: Option<[u8; 8]>,
    name: String,
    kind: SpanKind,
    start: u64,
    end: u64,
    attributes: Vec<opentelemetry_proto::tonic::common::v1::KeyValue>,
    status: u16,
}

impl OpenSpan {
    fn build(self, trace_id: [u8; 16]) -> Span {
        let mut attributes = self.attributes;
        if self.status != 0 {
            // A string, as vllm-router 0.1.17 exports it (its tracing fields are recorded
            // with Display).
            attributes.push(kv_str("http.response.status_code", self.status.to_string()));
        }
        if self.kind == SpanKind::Server {
            let ms = self.end.saturating_sub(self.start) as f64 / 1e6;
            attributes.push(crate::spans::kv_f64("latency_ms", ms));
        }
        // Status left unset whatever the HTTP status, as the real router leaves it.
        let mut s = SpanSpec {
            trace_id,
            span_id: self.id,
            parent: self.parent,
            name: self.name,
            start_ns: self.start,
            end_ns: self.end,
            attributes,
            events: Vec::new(),
            error: None,
        }
        .build();
        s.kind = self.kind as i32;
        s
    }
}

/// The request's spans, emitted once: when the answer's body has been sent (or dropped).
struct Trace {
    sink: SpanSink,
    trace_id: [u8; 16],
    server: Option<OpenSpan>,
    legs: Vec<OpenSpan>,
    /// The decode leg's span ends with the body it passes through.
    open_leg: Option<OpenSpan>,
}

impl Trace {
    fn emit(&mut self, status: u16) {
        let Some(mut server) = self.server.take() else {
            return;
        };
        if !self.sink.enabled() {
            return;
        }
        let now = now_ns();
        let mut spans: Vec<Span> = Vec::with_capacity(3);
        for l in self.legs.drain(..) {
            spans.push(l.build(self.trace_id));
        }
        if let Some(mut l) = self.open_leg.take() {
            l.end = now;
            spans.push(l.build(self.trace_id));
        }
        server.end = now;
        server.status = status;
        spans.push(server.build(self.trace_id));
        self.sink.emit(spans);
    }
}

/// A response body that emits the request's spans at its end.
struct Traced {
    inner: Body,
    trace: Trace,
    status: u16,
}

impl hyper::body::Body for Traced {
    type Data = Bytes;
    type Error = axum::Error;
    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(None) = r {
            let st = this.status;
            this.trace.emit(st);
        }
        r
    }
    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Traced {
    fn drop(&mut self) {
        let st = self.status;
        self.trace.emit(st);
    }
}

enum Leg {
    Resp(hyper::Response<hyper::body::Incoming>),
    Failed(String),
}

impl Rt {
    async fn send(
        &self,
        ep: &Endpoint,
        path: &str,
        body: Vec<u8>,
        x: &str,
        tp: &TraceParent,
    ) -> Leg {
        let req = match hyper::Request::post(format!("{}{path}", ep.base))
            .header("content-type", "application/json")
            .header("x-request-id", x)
            .header("traceparent", tp.header_value())
            .body(Full::new(Bytes::from(body)))
        {
            Ok(r) => r,
            Err(e) => return Leg::Failed(e.to_string()),
        };
        match tokio::time::timeout(self.timeout, self.client.request(req)).await {
            Ok(Ok(r)) => Leg::Resp(r),
            Ok(Err(e)) => Leg::Failed(e.to_string()),
            Err(_) => Leg::Failed("timed out".into()),
        }
    }

    fn leg_span(&self, parent: [u8; 8], route: &str, phase: &str, ep: &Endpoint) -> OpenSpan {
        OpenSpan {
            id: random_span_id(),
            parent: Some(parent),
            name: format!("POST {route}"),
            kind: SpanKind::Client,
            start: now_ns(),
            end: 0,
            attributes: vec![
                kv_str("vllm.request_phase", phase),
                kv_str("http.request.method", "POST"),
                kv_str("url.full", format!("{}{route}", ep.base)),
                kv_str("http.route", route.to_owned()),
                kv_str("server.address", ep.host.clone()),
                kv_str("server.port", ep.port.to_string()),
            ],
            status: 0,
        }
    }
}

fn text_response(status: StatusCode, msg: String) -> Response {
    let mut r = (status, msg).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// The router's own refusals, in vLLM's current envelope.
fn json_error(status: StatusCode, msg: &str) -> Response {
    super::api::error(
        super::api::ErrorShape::Current,
        &super::api::Refusal {
            status,
            message: msg.to_owned(),
            param: None,
        },
    )
}

async fn route(
    rt: Shared,
    route: &'static str,
    echo_prefix: &str,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    rt.stats.requests.fetch_add(1, Ordering::Relaxed);
    let client_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .unwrap_or_else(|| format!("{echo_prefix}{}", alnum(24)));
    let incoming = headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(TraceParent::parse);
    let server_id = random_span_id();
    let mut trace = Trace {
        sink: rt.spans.clone(),
        trace_id: incoming.map(|t| t.trace_id).unwrap_or_else(random_trace_id),
        server: Some(OpenSpan {
            id: server_id,
            parent: incoming.map(|t| t.span_id),
            name: format!("POST {route}"),
            kind: SpanKind::Server,
            start: now_ns(),
            end: 0,
            attributes: vec![
                kv_str("http.request.method", "POST"),
                kv_str("url.path", route),
                kv_str("http.route", route),
                kv_str("request_id", client_id.clone()),
            ],
            status: 0,
        }),
        legs: Vec::new(),
        open_leg: None,
    };
    let resp = route_inner(&rt, route, &body, server_id, &mut trace).await;
    drop(body);
    let status = resp.status();
    match status.as_u16() {
        200..=299 => &rt.stats.responses_2xx,
        400..=499 => &rt.stats.responses_4xx,
        _ => &rt.stats.responses_5xx,
    }
    .fetch_add(1, Ordering::Relaxed);
    let (mut parts, inner) = resp.into_parts();
    if let Ok(v) = HeaderValue::from_str(&client_id) {
        parts.headers.insert("x-request-id", v);
    }
    let traced = Traced {
        inner,
        trace,
        status: status.as_u16(),
    };
    Response::from_parts(parts, Body::new(traced))
}

async fn route_inner(
    rt: &Shared,
    route: &'static str,
    body: &Bytes,
    server_id: [u8; 8],
    trace: &mut Trace,
) -> Response {
    let client: serde_json::Map<String, serde_json::Value> = match serde_json::from_slice(body) {
        Ok(m) => m,
        Err(_) => {
            rt.stats.bad_requests.fetch_add(1, Ordering::Relaxed);
            return json_error(
                StatusCode::BAD_REQUEST,
                "request body must be a JSON object",
            );
        }
    };
    let x = pd_request_id(&rt.prefill.authority, &rt.decode.authority);
    let transfer_id = rt.mooncake.as_ref().map(|_| format!("xfer-{}", uuid4()));
    // Prefill first.
    rt.stats.prefill_legs.fetch_add(1, Ordering::Relaxed);
    let mut span = rt.leg_span(server_id, route, "prefill", &rt.prefill);
    let tp = TraceParent {
        trace_id: trace.trace_id,
        span_id: span.id,
    };
    let leg = rt
        .send(
            &rt.prefill,
            route,
            prefill_body(&client, transfer_id.as_deref()),
            &x,
            &tp,
        )
        .await;
    let (pstatus, pbody) = match leg {
        Leg::Resp(r) => {
            let status = r.status();
            match r.into_body().collect().await {
                Ok(b) => (status, b.to_bytes()),
                Err(e) => {
                    span.end = now_ns();
                    trace.legs.push(span);
                    rt.stats.prefill_failures.fetch_add(1, Ordering::Relaxed);
                    return text_response(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!(
                            "Transparent proxy request failed: Network error: Prefill server {}{route} body: {e}",
                            rt.prefill.base
                        ),
                    );
                }
            }
        }
        Leg::Failed(e) => {
            span.end = now_ns();
            trace.legs.push(span);
            rt.stats.prefill_failures.fetch_add(1, Ordering::Relaxed);
            return text_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!(
                    "Transparent proxy request failed: Network error: Prefill server {}{route} request failed: {e}",
                    rt.prefill.base
                ),
            );
        }
    };
    span.end = now_ns();
    span.status = pstatus.as_u16();
    trace.legs.push(span);
    let rejected = pstatus.as_u16() >= 400;
    if rejected {
        rt.stats.prefill_rejections.fetch_add(1, Ordering::Relaxed);
        if pstatus.is_server_error() {
            rt.stats.prefill_5xx.fetch_add(1, Ordering::Relaxed);
        } else {
            rt.stats.prefill_4xx.fetch_add(1, Ordering::Relaxed);
        }
    }
    let parsed: Option<serde_json::Map<String, serde_json::Value>> =
        serde_json::from_slice(&pbody).ok();
    let hand_off = !rejected || (rt.mode == Mode::HandoffAfterReject && parsed.is_some());
    if !hand_off {
        // vllm-router: a prefill error is the client's answer; decode is never contacted.
        if pstatus.is_client_error() {
            let mut r = Response::new(Body::from(pbody));
            *r.status_mut() = pstatus;
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            return r;
        }
        return text_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!(
                "Transparent proxy request failed: Network error: Prefill server {}{route} returned {pstatus}: {}",
                rt.prefill.base,
                String::from_utf8_lossy(&pbody)
            ),
        );
    }
    // Decode: the client's body plus what prefill said about its KV (copied as found), or
    // with mooncake the params the router builds.
    let mut kv = match (&rt.mooncake, &transfer_id) {
        (Some((boot, engine)), Some(t)) => Some(serde_json::json!({
            "do_remote_decode": false, "do_remote_prefill": true, "transfer_id": t,
            "remote_bootstrap_addr": boot, "remote_engine_id": engine,
        })),
        _ => parsed
            .as_ref()
            .and_then(|m| m.get("kv_transfer_params"))
            .cloned(),
    };
    if matches!(rt.mode, Mode::ReuseKvParams | Mode::ForgeKvParams)
        && let Some(own) = kv.clone().filter(|v| !v.is_null())
    {
        let nth = rt.answered.fetch_add(1, Ordering::Relaxed) + 1;
        let previous = rt
            .previous
            .lock()
            .ok()
            .and_then(|mut p| p.replace((x.clone(), own.clone())));
        let swapped = if rt.mode == Mode::ForgeKvParams {
            let mut forged = own;
            if let Some(m) = forged.as_object_mut() {
                m.insert(
                    "remote_request_id".into(),
                    format!("cmpl-forged-{nth}-0-{:08x}", nth.wrapping_mul(0x9e37_79b9)).into(),
                );
            }
            Some(("forged".to_owned(), forged))
        } else {
            previous
        };
        if nth.is_multiple_of(rt.reuse_every)
            && let Some((of, theirs)) = swapped
        {
            rt.stats
                .decode_legs_with_reused_kv_params
                .fetch_add(1, Ordering::Relaxed);
            if let Ok(mut r) = rt.reused.lock() {
                r.push(Reused {
                    request_id: x.clone(),
                    params_of: of,
                    remote_request_id: theirs
                        .get("remote_request_id")
                        .and_then(|v| v.as_str())
                        .map(str::to_owned),
                    transfer_id: theirs
                        .get("transfer_id")
                        .and_then(|v| v.as_str())
                        .map(str::to_owned),
                });
            }
            kv = Some(theirs);
        }
    }
    if kv.as_ref().is_none_or(|v| v.is_null()) {
        rt.stats
            .decode_legs_without_kv_params
            .fetch_add(1, Ordering::Relaxed);
    }
    // Prefill's params as it wrote them, unless a fault swapped them.
    let answered = serde_json::from_slice::<
        std::collections::HashMap<String, Box<serde_json::value::RawValue>>,
    >(&pbody)
    .ok()
    .and_then(|mut m| m.remove("kv_transfer_params"));
    let raw = match (&kv, &answered) {
        (Some(v), Some(a))
            if serde_json::from_str::<serde_json::Value>(a.get())
                .ok()
                .as_ref()
                == Some(v) =>
        {
            Some(a.get().to_owned())
        }
        (Some(v), _) => Some(v.to_string()),
        (None, _) => None,
    };
    let dbody = body_with_params_last(&client, raw.as_deref());
    if rejected {
        rt.stats
            .decode_legs_after_prefill_rejection
            .fetch_add(1, Ordering::Relaxed);
    }
    rt.stats.decode_legs.fetch_add(1, Ordering::Relaxed);
    let mut span = rt.leg_span(server_id, route, "decode", &rt.decode);
    let tp = TraceParent {
        trace_id: trace.trace_id,
        span_id: span.id,
    };
    let leg = rt.send(&rt.decode, route, dbody, &x, &tp).await;
    match leg {
        Leg::Resp(r) => {
            let (parts, inner) = r.into_parts();
            span.status = parts.status.as_u16();
            trace.open_leg = Some(span);
            let mut resp = Response::new(Body::new(inner));
            *resp.status_mut() = parts.status;
            for k in ["content-type", "cache-control"] {
                if let Some(v) = parts.headers.get(k) {
                    resp.headers_mut().insert(k, v.clone());
                }
            }
            resp
        }
        Leg::Failed(e) => {
            span.end = now_ns();
            trace.legs.push(span);
            rt.stats.decode_failures.fetch_add(1, Ordering::Relaxed);
            text_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!(
                    "Transparent proxy request failed: Network error: Decode server {}{route} request failed: {e}",
                    rt.decode.base
                ),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_id_and_prefill_body_are_vllm_routers() {
        let x = pd_request_id("127.0.0.1:1", "127.0.0.1:2");
        let tail = x
            .strip_prefix("___prefill_addr_127.0.0.1:1___decode_addr_127.0.0.1:2_")
            .unwrap();
        assert_eq!(tail.len(), 32);
        assert!(
            tail.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        );
        let client: serde_json::Map<String, serde_json::Value> = serde_json::from_str(
            r#"{"prompt":"a b","max_tokens":9,"stream":true,"stream_options":{"include_usage":true}}"#,
        )
        .unwrap();
        let b: serde_json::Value = serde_json::from_slice(&prefill_body(&client, None)).unwrap();
        assert_eq!(b["max_tokens"], 1);
        assert_eq!(b["min_tokens"], 1);
        assert_eq!(b["stream"], false);
        assert!(b.get("stream_options").is_none());
        assert_eq!(b["kv_transfer_params"]["do_remote_decode"], true);
        assert!(b["kv_transfer_params"]["remote_host"].is_null());
    }
}
