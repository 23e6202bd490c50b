//! The PD router, with the three behaviours the monitor must tell apart.
//! (One file, ~1,000 lines: `route_inner` is the three modes side by side, and the withdrawable
//! decode leg, `DecodeLeg` over `Wire`, exists only for it.)
//!
//! - `correct`: prefill first; decode is dispatched only once prefill admitted the request
//!   (`cluster` runs prefill with `--status-at-admission`: it answers its status line and
//!   `x-pd-sim-admission` at its verdict, which for a streamed refusal is a 200). A refusal never
//!   reaches decode. This is pd-sim's model of a correct router; with SGLang's own prefill
//!   (status line at the end) a sequential router would wait for a transfer that needs decode.
//! - `concurrent-no-cancel`: sglang-router 0.3.2. Both legs at once with the same body plus
//!   `bootstrap_host`/`bootstrap_port`/`bootstrap_room` appended at the end of the JSON; when
//!   prefill fails the decode leg is left running; a 503 is retried with a new room under the
//!   same `x-request-id`.
//! - `concurrent-cancel`: smg 1.13.0, the fixed router. Both legs at once as in
//!   `concurrent-no-cancel`, each on its way after its own random transit delay
//!   (`--leg-jitter-us`); when prefill answers an error the decode leg is withdrawn (its own
//!   TCP connection closed, never reused) and the client gets prefill's answer at once with
//!   `x-smg-error-code`; a 503 is retried with a new room once the previous decode leg is
//!   closed. Like smg, it looks at the status only: a streamed refusal (200 with an SSE error)
//!   keeps its decode leg, and decode's answer is what the client gets.
//! - `handoff-after-reject`: the disclosed bug. Prefill first; when prefill rejects, the
//!   request is still handed to decode (and the cluster runs prefill with
//!   `--transfer-after-reject`, so the rejected room's KV is transferred and decode generates).
//!
//! Every mode retries 503 with a fresh room. The client sees prefill's error when prefill
//! fails, decode's answer otherwise.

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
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
use hyper_util::rt::TokioIo;
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, oneshot};

use crate::http::{HttpClient, error_response, http_client, json_response};
use crate::ids::{new_room, now_ns};
use crate::spans::{Exporter, ExporterConfig, SpanSink, SpanSpec, event, kv_str};
use crate::trace_ctx::{TraceParent, random_span_id, random_trace_id};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    Correct,
    ConcurrentNoCancel,
    ConcurrentCancel,
    HandoffAfterReject,
    /// vLLM flavour: every `--reuse-kv-params-every`-th request's decode leg gets the
    /// previous request's `kv_transfer_params` (decode reads another request's KV).
    ReuseKvParams,
    /// vLLM flavour: every `--reuse-kv-params-every`-th request's decode leg gets its own
    /// params with a `remote_request_id` prefill never issued (a stale or forged handoff).
    ForgeKvParams,
}

#[derive(clap::Args, Clone, Debug)]
pub struct RouterArgs {
    /// Wire formats: SGLang's router (default) or vllm-router's (`--mode correct` or
    /// `handoff-after-reject`).
    #[arg(long, value_enum, default_value_t = crate::Flavour::Sglang)]
    pub flavour: crate::Flavour,
    /// vLLM flavour: how often the router polls each worker's `/health`.
    #[arg(long, default_value_t = 10)]
    pub health_check_interval_secs: u64,
    /// vLLM flavour: how often the router reads each worker's `/metrics` after the read at
    /// start; 0 (the default, as vllm-router 0.1.17) reads it at start only.
    #[arg(long, default_value_t = 0)]
    pub metrics_poll_interval_secs: u64,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    #[arg(long, value_enum, default_value_t = Mode::Correct)]
    pub mode: Mode,
    /// vLLM flavour, `--mode reuse-kv-params`: which requests get the previous request's
    /// params (every N-th, counted from the first).
    #[arg(long, default_value_t = 9)]
    pub reuse_kv_params_every: u64,
    /// Prefill worker URL, e.g. http://127.0.0.1:30001
    #[arg(long)]
    pub prefill: String,
    /// Prefill's bootstrap port: SGLang flavour, sent to both legs as `bootstrap_port`; vLLM
    /// flavour with `--kv-connector mooncake`, where the router asks prefill's Mooncake
    /// bootstrap server (`GET /query`) for its engine id (vllm-router's `--prefill URL PORT`).
    #[arg(long, default_value_t = 8998)]
    pub bootstrap_port: u16,
    /// vLLM flavour: the workers' KV connector (vllm-router's `--kv-connector`). `mooncake`:
    /// the router asks prefill's bootstrap server for its engine id at start, makes a
    /// `transfer_id` per request and builds both legs' `kv_transfer_params` itself.
    #[arg(long, value_enum, default_value_t = crate::vllm::KvConnector::Nixl)]
    pub kv_connector: crate::vllm::KvConnector,
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
    /// Each leg waits a random 0..=MAX µs (drawn independently per leg) before it is sent: its
    /// transit (network, the worker's accept queue), so that decode gets its leg sometimes
    /// before and sometimes after prefill's verdict. Default: 3000 in concurrent-cancel, 0
    /// in the other modes.
    #[arg(long)]
    pub leg_jitter_us: Option<u64>,
    /// Seed of the leg-jitter draws (default: from the OS).
    #[arg(long)]
    pub jitter_seed: Option<u64>,
    /// `--fault room-collision`: a share of attempts reuse the room of an attempt that just
    /// ended (see `crate::fault`); the other faults are the workers'.
    #[command(flatten)]
    pub faults: crate::fault::FaultArgs,
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
    /// Decode legs withdrawn (their connection closed before the answer ended; a streamed
    /// decode answers its status line at once; concurrent-cancel).
    pub decode_legs_cancelled: AtomicU64,
    /// Of those, legs still in transit when withdrawn: delivered, then closed at once.
    pub decode_legs_cancelled_in_transit: AtomicU64,
    pub upstream_errors: AtomicU64,
    pub responses_2xx: AtomicU64,
    pub responses_4xx: AtomicU64,
    pub responses_5xx: AtomicU64,
    /// `--fault room-collision`: attempts sent on a room another request had (each also in
    /// `collided_rooms` of `/sim/stats`).
    pub faults_injected: AtomicU64,
}

/// Rooms of attempts that ended, for `--fault room-collision` to reuse, and the rooms it
/// reused (the oracle of what a monitor must report).
#[derive(Default)]
struct RoomReuse {
    ended: std::collections::VecDeque<u64>,
    collided: Vec<u64>,
}

/// Ended rooms kept for reuse, and reused rooms listed in `/sim/stats`.
const ENDED_ROOMS_KEPT: usize = 64;
const COLLIDED_ROOMS_LISTED: usize = 10_000;

struct Rt {
    args: RouterArgs,
    prefill: String,
    decode: String,
    /// Decode's `host:port` (the `host` header) and address, for withdrawable legs.
    decode_authority: String,
    decode_addr: SocketAddr,
    bootstrap_host: String,
    client: HttpClient,
    stats: RouterStats,
    spans: SpanSink,
    jitter_max_us: u64,
    jitter: Mutex<SmallRng>,
    idle: Mutex<Vec<IdleConn>>,
    rooms: Mutex<RoomReuse>,
}

impl Rt {
    /// The room of a new attempt: fresh, or with `--fault room-collision` now and then the room
    /// of an attempt of another request that just ended (a router that keeps client-supplied
    /// rooms, two clients that chose the same one). Reusing an ended room keeps the simulated
    /// workers' own state apart (they key transfers by room) while the wire shows two requests
    /// on one room. Whether the room is fresh (only a fresh one may be reused later: one
    /// collision per room).
    fn attempt_room(&self, request_id: &str) -> (u64, bool) {
        if self.args.faults.hits(crate::fault::Fault::RoomCollision) {
            let mut r = self.rooms.lock().expect("rooms lock");
            if let Some(room) = r.ended.pop_front() {
                if r.collided.len() < COLLIDED_ROOMS_LISTED {
                    r.collided.push(room);
                }
                self.stats.faults_injected.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    room,
                    request_id,
                    "fault room-collision: reusing an ended room"
                );
                return (room, false);
            }
        }
        (new_room(), true)
    }

    /// `resp`, whose body's end (or drop) also ends the request's last attempt, on the fresh
    /// room `room`: only then may `--fault room-collision` reuse it (a streamed answer is still
    /// decode's leg). Only rooms of attempts that succeeded are reused: a rejected room that
    /// another request advances on is also activity after that rejection, a second finding about
    /// one injected breach.
    fn retire_room_after(self: &Arc<Self>, resp: Response, room: Option<u64>) -> Response {
        let Some(room) = room else { return resp };
        if !self
            .args
            .faults
            .faults
            .contains(&crate::fault::Fault::RoomCollision)
            || !resp.status().is_success()
        {
            return resp;
        }
        struct Retire(Shared, u64);
        impl Drop for Retire {
            fn drop(&mut self) {
                self.0.room_ended(self.1);
            }
        }
        let retire = Retire(self.clone(), room);
        let (parts, body) = resp.into_parts();
        let body = body.map_frame(move |f| {
            let _ = &retire;
            f
        });
        Response::from_parts(parts, Body::new(body))
    }

    /// The attempt on fresh room `room` ended: the room may be reused (`--fault room-collision`).
    fn room_ended(&self, room: u64) {
        let mut r = self.rooms.lock().expect("rooms lock");
        if r.ended.len() == ENDED_ROOMS_KEPT {
            r.ended.pop_front();
        }
        r.ended.push_back(room);
    }

    /// One leg's transit delay (see `--leg-jitter-us`).
    fn jitter(&self) -> Duration {
        if self.jitter_max_us == 0 {
            return Duration::ZERO;
        }
        let us = self
            .jitter
            .lock()
            .expect("jitter lock")
            .random_range(0..=self.jitter_max_us);
        Duration::from_micros(us)
    }
}

async fn pause(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

type Shared = Arc<Rt>;

pub async fn run(args: RouterArgs) -> anyhow::Result<()> {
    if args.flavour == crate::Flavour::Vllm {
        return crate::vllm::router::run(args).await;
    }
    if matches!(args.mode, Mode::ReuseKvParams | Mode::ForgeKvParams) {
        anyhow::bail!(
            "--mode {:?} is a mode of the vLLM flavour's router",
            args.mode
        );
    }
    let prefill = args.prefill.trim_end_matches('/').to_string();
    let decode = args.decode.trim_end_matches('/').to_string();
    let prefill_uri: hyper::Uri = prefill.parse()?;
    let bootstrap_host = prefill_uri.host().unwrap_or("127.0.0.1").to_string();
    let decode_uri: hyper::Uri = decode.parse()?;
    let decode_authority = match (decode_uri.host(), decode_uri.port_u16()) {
        (Some(h), Some(p)) => format!("{h}:{p}"),
        (Some(h), None) => format!("{h}:80"),
        _ => anyhow::bail!("--decode {decode}: no host"),
    };
    let decode_addr = tokio::net::lookup_host(decode_authority.as_str())
        .await?
        .next()
        .ok_or_else(|| anyhow::anyhow!("--decode {decode}: no address"))?;
    let jitter_max_us = args.leg_jitter_us.unwrap_or(match args.mode {
        Mode::ConcurrentCancel => 3000,
        _ => 0,
    });
    let jitter = Mutex::new(match args.jitter_seed {
        Some(seed) => SmallRng::seed_from_u64(seed),
        None => SmallRng::from_rng(&mut rand::rng()),
    });
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
        decode_authority,
        decode_addr,
        jitter_max_us,
        jitter,
        idle: Mutex::new(Vec::new()),
        rooms: Mutex::new(RoomReuse::default()),
        bootstrap_host,
        client: http_client(1024),
        stats: RouterStats::default(),
        spans: exporter.sink.clone(),
        args,
    });
    let app = Router::new()
        .route("/generate", post(generate))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
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
    crate::serve::print_ready(serde_json::json!({
        "role": "router",
        "http": format!("http://{addr}"),
        "port": addr.port(),
        "mode": rt.args.mode,
        "leg_jitter_us": rt.jitter_max_us,
        "pid": std::process::id(),
    }));
    tracing::info!(%addr, mode = ?rt.args.mode, "router ready");
    // Without TCP_NODELAY a streamed answer's second chunk waits for the client's delayed ACK
    // (~40 ms): that was the p99 of the load generator.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(crate::serve::shutdown_signal())
        .await?;
    exporter.shutdown(Duration::from_secs(3)).await;
    Ok(())
}

async fn sim_stats(State(rt): State<Shared>) -> Response {
    let collided = rt.rooms.lock().expect("rooms lock").collided.clone();
    axum::Json(serde_json::json!({"role": "router", "mode": rt.args.mode, "leg_jitter_us": rt.jitter_max_us,
                                  "router": &rt.stats, "otlp": &*rt.spans.stats,
                                  "collided_rooms": collided}))
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

async fn completions(State(rt): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    route(rt, "/v1/completions", headers, body).await
}

/// Whether prefill refused the attempt: an error status, or (a streamed refusal is a 200)
/// the admission header a prefill run with `--status-at-admission` adds. Only the sequential
/// modes look at the header; smg does not.
fn refused_by_prefill(r: &hyper::Response<Incoming>, sequential: bool) -> bool {
    !r.status().is_success()
        || (sequential
            && r.headers()
                .get("x-pd-sim-admission")
                .is_some_and(|v| v.as_bytes() == b"refused"))
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

/// Whether a withdrawable leg's request is on the wire: its body was handed to hyper and a
/// flush after that completed (every byte of the request written to the socket).
#[derive(Default)]
struct Wire {
    body_taken: AtomicBool,
    on_wire: AtomicBool,
    notify: Notify,
}

impl Wire {
    fn on_wire(&self) -> bool {
        self.on_wire.load(Ordering::Acquire)
    }
    async fn wait(&self) {
        // notify_one keeps a permit for a waiter that comes after it; one left over from the
        // connection's previous request is told apart by the flag.
        while !self.on_wire() {
            self.notify.notified().await;
        }
    }
    /// Before the next request on a kept connection.
    fn reset(&self) {
        self.body_taken.store(false, Ordering::Release);
        self.on_wire.store(false, Ordering::Release);
    }
}

type LegConn = hyper::client::conn::http1::Connection<TokioIo<Tracked>, OnceBody>;

/// An idle connection to decode, kept after an answered leg (a withdrawn leg's connection is
/// closed, never kept). Not polled while idle; the leg that takes it drives it.
struct IdleConn {
    sender: hyper::client::conn::http1::SendRequest<OnceBody>,
    conn: Pin<Box<LegConn>>,
    wire: Arc<Wire>,
}

/// Idle decode connections kept for withdrawable legs, as an HTTP client pool would.
const IDLE_DECODE_CONNS: usize = 1024;

impl Rt {
    fn take_idle(&self) -> Option<IdleConn> {
        use futures_util::FutureExt;
        loop {
            let mut c = self.idle.lock().expect("idle lock").pop()?;
            // A connection decode has closed meanwhile finishes on this poll: discard it.
            if c.sender.is_ready() && (&mut c.conn).now_or_never().is_none() {
                return Some(c);
            }
        }
    }

    fn put_idle(&self, c: IdleConn) {
        let mut idle = self.idle.lock().expect("idle lock");
        if idle.len() < IDLE_DECODE_CONNS {
            idle.push(c);
        }
    }

    async fn connect_decode(&self) -> Result<IdleConn, String> {
        let timeout = Duration::from_secs(self.args.request_timeout_secs);
        let tcp = match tokio::time::timeout(timeout, TcpStream::connect(self.decode_addr)).await {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => return Err(format!("decode connect: {e}")),
            Err(_) => return Err("decode connect timed out".into()),
        };
        let _ = tcp.set_nodelay(true);
        let wire = Arc::new(Wire::default());
        let io = TokioIo::new(Tracked {
            tcp,
            wire: wire.clone(),
        });
        let (sender, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(|e| format!("decode handshake: {e}"))?;
        Ok(IdleConn {
            sender,
            conn: Box::pin(conn),
            wire,
        })
    }
}

/// The leg's socket, telling [`Wire`] when the request has been written.
struct Tracked {
    tcp: TcpStream,
    wire: Arc<Wire>,
}

impl AsyncRead for Tracked {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.tcp).poll_flush(cx);
        // hyper flushes its socket once its write buffer is empty: after the body was taken,
        // that is the whole request written.
        if matches!(r, Poll::Ready(Ok(())))
            && this.wire.body_taken.load(Ordering::Acquire)
            && !this.wire.on_wire.swap(true, Ordering::AcqRel)
        {
            this.wire.notify.notify_one();
        }
        r
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}

/// A one-frame request body that tells [`Wire`] when hyper took it.
struct OnceBody {
    data: Option<Bytes>,
    len: u64,
    wire: Arc<Wire>,
}

impl hyper::body::Body for OnceBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        this.wire.body_taken.store(true, Ordering::Release);
        Poll::Ready(this.data.take().map(|d| Ok(hyper::body::Frame::data(d))))
    }
    fn is_end_stream(&self) -> bool {
        self.data.is_none()
    }
    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::SizeHint::with_exact(self.len)
    }
}

/// A decode leg the router can withdraw (concurrent-cancel). It runs as its own task on a
/// connection of its own (new, or kept idle after an answered leg); withdrawing it closes that
/// connection, which is never used again.
struct DecodeLeg {
    cancel: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Leg>,
}

impl DecodeLeg {
    fn start(
        rt: Shared,
        path: &'static str,
        body: Bytes,
        request_id: String,
        tp: TraceParent,
        transit: Duration,
    ) -> Self {
        let (tx, rx) = oneshot::channel();
        let task = tokio::spawn(withdrawable_decode(
            rt, path, body, request_id, tp, transit, rx,
        ));
        DecodeLeg {
            cancel: Some(tx),
            task,
        }
    }

    /// Withdraw the leg: its connection is closed at once, or, for a leg still in transit,
    /// as soon as its request is on the wire. Dropping the handle does the same.
    fn cancel(&mut self) {
        if let Some(tx) = self.cancel.take() {
            let _ = tx.send(());
        }
    }

    /// A cancelled leg's end: its connection closed, counted as withdrawn also when decode's
    /// answer had already started (a streamed answer's status line comes at once), which is
    /// dropped here. Runs on its own; await it to wait for the close.
    fn withdrawn(self, rt: Shared) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            if let Leg::Resp(r) = self.join().await {
                drop(r);
                rt.stats
                    .decode_legs_cancelled
                    .fetch_add(1, Ordering::Relaxed);
            }
        })
    }

    /// The leg's answer (`Failed` once withdrawn); a withdrawn leg is closed when this returns.
    async fn join(mut self) -> Leg {
        match (&mut self.task).await {
            Ok(l) => l,
            Err(e) => Leg::Failed(format!("decode task: {e}")),
        }
    }
}

async fn withdrawable_decode(
    rt: Shared,
    path: &'static str,
    body: Bytes,
    request_id: String,
    tp: TraceParent,
    transit: Duration,
    mut cancel: oneshot::Receiver<()>,
) -> Leg {
    // Resolves on a cancel and on the handle's drop (the client's request went away): both
    // withdraw the leg. Polled at most until it resolves once.
    let mut withdrawn = false;
    if !transit.is_zero() {
        // In transit: a withdrawal does not recall the leg, it arrives and the close follows.
        let until = tokio::time::Instant::now() + transit;
        tokio::select! {
            _ = tokio::time::sleep_until(until) => {}
            _ = &mut cancel => {
                withdrawn = true;
                tokio::time::sleep_until(until).await;
            }
        }
    }
    let IdleConn {
        mut sender,
        mut conn,
        wire,
    } = match rt.take_idle() {
        Some(c) => c,
        None => match rt.connect_decode().await {
            Ok(c) => c,
            Err(e) => return Leg::Failed(e),
        },
    };
    wire.reset();
    let req = hyper::Request::post(path)
        .header("host", rt.decode_authority.as_str())
        .header("content-type", "application/json")
        .header("x-request-id", request_id.as_str())
        .header("traceparent", tp.header_value())
        .body(OnceBody {
            len: body.len() as u64,
            data: Some(body),
            wire: wire.clone(),
        })
        .expect("valid request parts");
    let mut resp = Box::pin(sender.send_request(req));
    let timeout = Duration::from_secs(rt.args.request_timeout_secs);
    if !withdrawn {
        tokio::select! {
            r = &mut resp => {
                let r = match r {
                    Ok(r) => r,
                    Err(e) => return Leg::Failed(e.to_string()),
                };
                // The body streams on this connection; once it is over the connection is
                // idle again and kept for another leg.
                let rt = rt.clone();
                tokio::spawn(async move {
                    let idle = tokio::select! {
                        r = sender.ready() => r.is_ok(),
                        _ = &mut conn => false,
                    };
                    if idle {
                        rt.put_idle(IdleConn { sender, conn, wire });
                    }
                });
                return Leg::Resp(r);
            }
            r = &mut conn => {
                return Leg::Failed(format!("decode connection ended before an answer: {r:?}"));
            }
            _ = tokio::time::sleep(timeout) => return Leg::Failed("timed out".into()),
            _ = &mut cancel => withdrawn = true,
        }
    }
    debug_assert!(withdrawn);
    let in_transit = !wire.on_wire();
    if in_transit {
        // Drive the connection until the request is written, then close.
        tokio::select! {
            _ = wire.wait() => {}
            _ = &mut conn => {}
            _ = &mut resp => {}
            _ = tokio::time::sleep(timeout) => {}
        }
    }
    // Closing: the socket goes with the connection, now; it is never used again.
    drop(resp);
    drop(sender);
    drop(conn);
    rt.stats
        .decode_legs_cancelled
        .fetch_add(1, Ordering::Relaxed);
    if in_transit {
        rt.stats
            .decode_legs_cancelled_in_transit
            .fetch_add(1, Ordering::Relaxed);
    }
    Leg::Failed("withdrawn".into())
}

/// smg's `x-smg-error-code` for a prefill error the router answers with.
fn prefill_error_code(status: StatusCode) -> &'static str {
    match status.as_u16() {
        503 => "prefill_unavailable",
        400..=499 => "prefill_bad_request",
        _ => "prefill_error",
    }
}

struct RouterSpan {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    parent: Option<[u8; 8]>,
    start: u64,
    events: Vec<opentelemetry_proto::tonic::trace::v1::span::Event>,
    /// The room of its last attempt, when fresh (see [`Rt::attempt_room`]).
    fresh_room: Option<u64>,
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
        fresh_room: None,
    };
    let tp = TraceParent {
        trace_id: span.trace_id,
        span_id: span.span_id,
    };
    let resp = route_inner(&rt, path, &request_id, &tp, &body, &mut span).await;
    let resp = rt.retire_room_after(resp, span.fresh_room);
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
        let (room, fresh) = rt.attempt_room(request_id);
        span.fresh_room = fresh.then_some(room);
        let Some(leg_body) = with_bootstrap(body, &rt.bootstrap_host, rt.args.bootstrap_port, room)
        else {
            return error_response(
                StatusCode::BAD_REQUEST,
                "request body must be a JSON object",
            );
        };
        let leg_body = Bytes::from(leg_body);
        if mode == Mode::ConcurrentCancel {
            span.events.push(ev(
                "Sending concurrent requests",
                vec![("prefill_url", &rt.prefill), ("decode_url", &rt.decode)],
            ));
            rt.stats.decode_legs.fetch_add(1, Ordering::Relaxed);
            let mut leg = DecodeLeg::start(
                rt.clone(),
                path,
                leg_body.clone(),
                request_id.to_owned(),
                *tp,
                rt.jitter(),
            );
            pause(rt.jitter()).await;
            let prefill_resp = match send(rt, &rt.prefill, path, leg_body, request_id, tp).await {
                Leg::Resp(r) => r,
                Leg::Failed(e) => {
                    leg.cancel();
                    rt.stats.upstream_errors.fetch_add(1, Ordering::Relaxed);
                    span.events.push(ev("Received concurrent requests", vec![]));
                    return error_response(
                        StatusCode::BAD_GATEWAY,
                        &format!("prefill request failed: {e}"),
                    );
                }
            };
            let pstatus = prefill_resp.status();
            if !pstatus.is_success() {
                // The fix: prefill's error withdraws the decode leg before anything else.
                leg.cancel();
                let leg = leg.withdrawn(rt.clone());
                rt.stats.prefill_rejections.fetch_add(1, Ordering::Relaxed);
                span.events.push(ev("Received concurrent requests", vec![]));
                let mut resp = buffered(prefill_resp).await;
                resp.headers_mut().insert(
                    "x-smg-error-code",
                    axum::http::HeaderValue::from_static(prefill_error_code(pstatus)),
                );
                if pstatus == StatusCode::SERVICE_UNAVAILABLE && attempt + 1 < attempts {
                    // The next attempt (new room) starts once this one's decode leg is closed.
                    let _ = leg.await;
                    last = Some(resp);
                    continue;
                }
                return resp;
            }
            drain(async move { Leg::Resp(prefill_resp) });
            let decoded = leg.join().await;
            span.events.push(ev("Received concurrent requests", vec![]));
            return match decoded {
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
                let transit = rt.jitter();
                // The decode leg is its own task: nothing cancels it once sent.
                decode_leg = Some(tokio::spawn(async move {
                    pause(transit).await;
                    send(&rt2, &rt2.decode, path, b2, &rid2, &tp2).await
                }));
                pause(rt.jitter()).await;
                prefill_leg = send(rt, &rt.prefill, path, leg_body.clone(), request_id, tp).await;
            }
            Mode::ConcurrentCancel => unreachable!("served above"),
            Mode::ReuseKvParams | Mode::ForgeKvParams => unreachable!("refused at start"),
            Mode::Correct | Mode::HandoffAfterReject => {
                span.events.push(ev(
                    "Sending prefill request",
                    vec![("prefill_url", &rt.prefill)],
                ));
                pause(rt.jitter()).await;
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
        let sequential = matches!(mode, Mode::Correct | Mode::HandoffAfterReject);
        if refused_by_prefill(&prefill_resp, sequential) {
            rt.stats.prefill_rejections.fetch_add(1, Ordering::Relaxed);
            match (mode, decode_leg) {
                (Mode::ConcurrentNoCancel, Some(d)) => {
                    rt.stats
                        .decode_legs_after_prefill_failure
                        .fetch_add(1, Ordering::Relaxed);
                    if pstatus != StatusCode::SERVICE_UNAVAILABLE {
                        // smg 0.3.2 joins both legs: a decode 5xx (its KV never came) wins
                        // over prefill's 4xx and is retried with a new room, as observed with
                        // the real router in front of this simulator (tests/suite/sglang_router.rs).
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
                    let transit = rt.jitter();
                    drain(async move {
                        pause(transit).await;
                        send(&rt2, &rt2.decode, path, b2, &rid2, &tp2).await
                    });
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
                pause(rt.jitter()).await;
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
