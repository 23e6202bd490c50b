//! Prefill and decode workers: SGLang's HTTP API, capacity checks with SGLang's messages,
//! the prefill bootstrap server, the KV-transfer control channel and SGLang-shaped spans.
//!
//! Lifecycle of one PD attempt (room R):
//! - prefill `/generate` is validated (tokenizer: context length; queue: 503; scheduler:
//!   max_req_input_len, max_total_num_tokens). A rejection answers at once with SGLang's error.
//!   An admission answers the status line and headers at once and the body when the KV
//!   transfer is over: the early status is the admission signal a correct router waits for.
//! - decode `/generate` looks up prefill's KV endpoint on the bootstrap server
//!   (`GET /route`, cached per prefill), sends `BOOTSTRAP R` over ZMTP, waits for `KV`
//!   chunks and `KV_DONE R`, then generates.
//! - prefill transfers once both the admission and decode's BOOTSTRAP for R are there, in
//!   whichever order they arrive. With `--transfer-after-reject` (the disclosed bug) prefill
//!   also transfers rooms it rejected.
//! - decode's client (the router) closing the connection mid-request cancels it: ABORT R to
//!   prefill if its KV had not come, outcome `cancelled`. With `--decode-ignores-cancel` decode
//!   goes on and answers on the socket instead (outcome `cancel-ignored`); see serve.rs.
//!
//! Here: the flags, counters, room log and `run` (bind, announce READY, serve). `api` has the
//! HTTP routes and request bodies, `prefill` and `decode` each role's side of an attempt,
//! `bootstrap` the bootstrap server and its client, `trace` the spans, `render` the answers.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use rand::RngExt;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

use crate::http::{HttpClient, error_response, http_client};
use crate::ids::{count_tokens, new_rid, now_ns, room_hex};
use crate::kvlink::{LinkStats, Pushers, parse_u64, serve_pull};
use crate::serve::{ClientConn, OnClientGone};
use crate::spans::{Exporter, ExporterConfig, SpanSink, SpanSpec, kv_int, kv_str};
use crate::trace_ctx::{TraceParent, random_span_id, random_trace_id};

mod api;
mod bootstrap;
mod decode;
mod prefill;
mod render;
mod trace;

use api::Parsed;
use decode::DecodeWaiter;
use prefill::{Pending, sweeper};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
    fn title(self) -> &'static str {
        match self {
            Role::Prefill => "Prefill",
            Role::Decode => "Decode",
        }
    }
}

#[derive(clap::Args, Clone, Debug)]
pub struct WorkerArgs {
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// HTTP port (0 = ephemeral; the READY line on stdout tells the bound port).
    #[arg(long, default_value_t = 30001)]
    pub port: u16,
    /// Model context length in tokens (tokenizer check, both roles).
    #[arg(long, default_value_t = 8192)]
    pub context_length: u64,
    /// KV pool size in tokens (prefill scheduler check).
    #[arg(long, default_value_t = 8192)]
    pub max_total_num_tokens: u64,
    /// Longest admitted input (prefill scheduler check). Default: min(context, total) - 1.
    #[arg(long)]
    pub max_req_input_len: Option<u64>,
    /// Prefill answers 503 "The request queue is full." when more requests are in flight.
    #[arg(long)]
    pub max_queued_requests: Option<u64>,
    /// Share of prefill requests answered 503 as if the queue were full (drives retry storms).
    #[arg(long, default_value_t = 0.0)]
    pub overload_share: f64,
    /// Misconfiguration: admit inputs over max_total_num_tokens (for over-capacity tests).
    #[arg(long)]
    pub skip_total_tokens_check: bool,
    /// Export a `server_info` span with this worker's limits (context_length,
    /// max_total_num_tokens, max_req_input_len) at start and then every N seconds; 0 = never.
    #[arg(long, default_value_t = 0)]
    pub capacity_report_interval_s: u64,
    /// The disclosed bug on the prefill side: rejected rooms are still transferred to decode.
    #[arg(long)]
    pub transfer_after_reject: bool,
    /// Prefill bootstrap server port (SGLang's --disaggregation-bootstrap-port).
    #[arg(long, default_value_t = 8998)]
    pub disaggregation_bootstrap_port: u16,
    /// ZMTP PULL port for the KV control channel (0 = ephemeral).
    #[arg(long, default_value_t = 0)]
    pub kv_port: u16,
    /// Prefill: KV port announced by `GET /route` (put a tap/proxy in front of the real one).
    #[arg(long)]
    pub advertise_kv_port: Option<u16>,
    /// Simulated prefill forward time per request, microseconds.
    #[arg(long, default_value_t = 500)]
    pub prefill_delay_us: u64,
    /// Decode: time a request queues before it bootstraps (SGLang's prealloc queue),
    /// microseconds. Models a busy decode whose BOOTSTRAP comes well after prefill answered.
    #[arg(long, default_value_t = 0)]
    pub bootstrap_delay_us: u64,
    /// Simulated decode time per generated token, microseconds.
    #[arg(long, default_value_t = 0)]
    pub decode_token_delay_us: u64,
    /// Prefill: how long an admitted room waits for decode's BOOTSTRAP.
    #[arg(long, default_value_t = 5000)]
    pub bootstrap_timeout_ms: u64,
    /// Decode: how long a room waits for its KV cache before aborting.
    #[arg(long, default_value_t = 2000)]
    pub kv_timeout_ms: u64,
    /// Decode: when a request's client connection goes away, carry on as if it were there (no
    /// ABORT to prefill; bootstrap, wait for the KV, answer on the socket, then close it).
    /// Default: abort the request, send ABORT, close (SGLang's decode).
    #[arg(long)]
    pub decode_ignores_cancel: bool,
    /// Bytes of simulated KV per input token (payload of the KV frames).
    #[arg(long, default_value_t = 8)]
    pub kv_bytes_per_token: u64,
    /// max_new_tokens when the request does not say.
    #[arg(long, default_value_t = 16)]
    pub default_max_new_tokens: u64,
    #[arg(long, default_value = "pd-sim/tiny-model")]
    pub model_path: String,
    /// OTLP/HTTP endpoint (e.g. http://127.0.0.1:4318); no spans when absent.
    #[arg(long)]
    pub otlp_endpoint: Option<String>,
    /// How many rooms `/sim/rooms` remembers.
    #[arg(long, default_value_t = 200_000)]
    pub room_log: usize,
    #[command(flatten)]
    pub faults: crate::fault::FaultArgs,
}

impl WorkerArgs {
    fn max_req_input_len(&self) -> u64 {
        self.max_req_input_len.unwrap_or_else(|| {
            self.context_length
                .min(self.max_total_num_tokens)
                .saturating_sub(1)
        })
    }
}

#[derive(Default, Serialize)]
pub struct WorkerStats {
    pub requests: AtomicU64,
    pub admitted: AtomicU64,
    pub rejected_400: AtomicU64,
    pub rejected_503: AtomicU64,
    pub bad_requests: AtomicU64,
    pub completed: AtomicU64,
    pub bootstrap_frames: AtomicU64,
    pub abort_frames: AtomicU64,
    pub unknown_frames: AtomicU64,
    pub kv_transfers: AtomicU64,
    pub kv_transfers_after_reject: AtomicU64,
    pub kv_chunks: AtomicU64,
    pub kv_chunks_unmatched: AtomicU64,
    pub bootstrap_timeouts: AtomicU64,
    pub bootstraps_unmatched: AtomicU64,
    pub kv_timeouts: AtomicU64,
    pub cancelled: AtomicU64,
    /// Decode requests whose client went away and that went on (`--decode-ignores-cancel`).
    pub cancels_ignored: AtomicU64,
    pub route_lookups: AtomicU64,
    pub route_failures: AtomicU64,
    /// Breaches `--fault` injected (each also in the room log, outcome `injected-…`).
    pub faults_injected: AtomicU64,
    /// Prefill: writes its bootstrap server took (`PUT /route`).
    pub route_puts: AtomicU64,
    /// Prefill: of those, the ones `--fault foreign-route-put`'s intruders made.
    pub foreign_route_puts: AtomicU64,
}

/// What a worker remembers about one room, for tests and demos (`GET /sim/rooms`).
#[derive(Clone, Default, Serialize, Debug)]
pub struct RoomRecord {
    pub room: u64,
    pub rid: String,
    pub request_id: Option<String>,
    /// HTTP status answered for this room's request (0: no HTTP request seen).
    pub status: u16,
    pub input_tokens: u64,
    pub bootstrap_frames: u32,
    pub abort_frames: u32,
    pub kv_chunks: u32,
    pub kv_done: bool,
    pub generated_tokens: u64,
    /// Prefill: writes to its bootstrap server by an intruder this room's request caused
    /// (`--fault foreign-route-put`).
    pub foreign_route_puts: u32,
    pub outcome: &'static str,
    /// For outcome `cancel-ignored`: how the request ended after its client had gone
    /// (`kv-failed`, `generated`, …).
    pub final_outcome: Option<&'static str>,
    /// Wall-clock times in Unix nanoseconds (one clock for every process of a host; 0 = not
    /// happened). `received_ns`: the HTTP request arrived.
    pub received_ns: u64,
    /// Decode: its BOOTSTRAP for the room was sent; prefill: the first BOOTSTRAP arrived.
    pub bootstrap_ns: u64,
    /// The HTTP status was decided (prefill: its verdict, admission or rejection).
    pub answered_ns: u64,
    /// Decode: the client closed the connection while the request was in flight.
    pub client_gone_ns: u64,
    /// The request ended (answered to its end, rejected, cancelled).
    pub ended_ns: u64,
}

struct RoomLog {
    cap: usize,
    map: HashMap<u64, RoomRecord>,
    order: VecDeque<u64>,
}

impl RoomLog {
    fn update(&mut self, room: u64, f: impl FnOnce(&mut RoomRecord)) {
        let rec = match self.map.get_mut(&room) {
            Some(r) => r,
            None => {
                if self.order.len() >= self.cap
                    && let Some(old) = self.order.pop_front()
                {
                    self.map.remove(&old);
                }
                self.order.push_back(room);
                self.map.entry(room).or_insert_with(|| RoomRecord {
                    room,
                    outcome: "pending",
                    ..Default::default()
                })
            }
        };
        f(rec);
    }
}

pub struct Worker {
    role: Role,
    args: WorkerArgs,
    max_req_input_len: u64,
    pub stats: WorkerStats,
    link_stats: Arc<LinkStats>,
    rooms: Mutex<RoomLog>,
    spans: SpanSink,
    host_id: String,
    pid: u32,
    inflight: AtomicU64,
    pending: Mutex<HashMap<u64, Pending>>,
    waiters: Mutex<HashMap<u64, DecodeWaiter>>,
    routes: Mutex<HashMap<String, SocketAddr>>,
    pushers: Pushers,
    kv_addr: Mutex<Option<SocketAddr>>,
    /// Prefill: its bootstrap server's address (0 port: none).
    boot_addr: SocketAddr,
    client: HttpClient,
}

struct InflightGuard<'a>(&'a AtomicU64);
impl Drop for InflightGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Worker {
    fn record(&self, room: u64, f: impl FnOnce(&mut RoomRecord)) {
        if let Ok(mut log) = self.rooms.lock() {
            log.update(room, f);
        }
    }

    /// A breach `fault` injected on `room`: counted, and the room's outcome says so.
    fn injected(&self, room: u64, fault: crate::fault::Fault) {
        self.stats.faults_injected.fetch_add(1, Ordering::Relaxed);
        self.record(room, |r| r.outcome = fault.outcome());
    }

    /// The tokenizer-stage and scheduler-stage admission checks, in SGLang's order, with
    /// SGLang's messages. `None` = admitted.
    fn check(&self, p: &Parsed, rid: &str) -> Option<(StatusCode, String, bool)> {
        let a = &self.args;
        if p.input_tokens >= a.context_length {
            return Some((
                StatusCode::BAD_REQUEST,
                format!(
                    "The input ({} tokens) is longer than the model's context length ({} tokens).",
                    p.input_tokens, a.context_length
                ),
                false,
            ));
        }
        if self.role == Role::Decode {
            return None;
        }
        let queued = self.inflight.load(Ordering::Relaxed);
        let overloaded = a.max_queued_requests.is_some_and(|m| queued >= m)
            || (a.overload_share > 0.0 && rand::rng().random::<f64>() < a.overload_share);
        if overloaded {
            return Some((
                StatusCode::SERVICE_UNAVAILABLE,
                "The request queue is full.".into(),
                true,
            ));
        }
        if p.input_tokens > self.max_req_input_len {
            return Some((
                StatusCode::BAD_REQUEST,
                format!(
                    "Input length ({} tokens) exceeds the maximum allowed length ({} tokens). Use a shorter input or enable --allow-auto-truncate.",
                    p.input_tokens, self.max_req_input_len
                ),
                true,
            ));
        }
        if !a.skip_total_tokens_check && p.input_tokens > a.max_total_num_tokens {
            return Some((
                StatusCode::BAD_REQUEST,
                format!(
                    "Request {rid} exceeds the maximum number of tokens: {} > {}",
                    p.input_tokens, a.max_total_num_tokens
                ),
                true,
            ));
        }
        None
    }

    /// The limits `/server_info` reports, as one span (see `capacity_report_interval_s`).
    fn capacity_span(&self) -> opentelemetry_proto::tonic::trace::v1::Span {
        let a = &self.args;
        let now = now_ns();
        SpanSpec {
            trace_id: crate::trace_ctx::random_trace_id(),
            span_id: crate::trace_ctx::random_span_id(),
            parent: None,
            name: "server_info".into(),
            start_ns: now,
            end_ns: now,
            attributes: vec![
                kv_str("disaggregation_mode", self.role.as_str()),
                kv_int("context_length", a.context_length as i64),
                kv_int("max_total_num_tokens", a.max_total_num_tokens as i64),
                kv_int("max_req_input_len", self.max_req_input_len as i64),
                kv_int("pid", self.pid as i64),
            ],
            events: Vec::new(),
            error: None,
        }
        .build()
    }

    fn server_info(&self, bootstrap_port: u16) -> serde_json::Value {
        let a = &self.args;
        serde_json::json!({
            "model_path": a.model_path,
            "tokenizer_path": a.model_path,
            "served_model_name": a.model_path,
            "host": a.host,
            "port": a.port,
            "disaggregation_mode": self.role.as_str(),
            "disaggregation_transfer_backend": "mooncake",
            "disaggregation_bootstrap_port": bootstrap_port,
            "context_length": a.context_length,
            "max_total_num_tokens": a.max_total_num_tokens,
            "max_req_input_len": self.max_req_input_len,
            "max_queued_requests": a.max_queued_requests,
            "tp_size": 1,
            "dp_size": 1,
            "enable_trace": a.otlp_endpoint.is_some(),
            "version": "0.5.23 (pd-sim)",
            "internal_states": [{
                "max_total_num_tokens": a.max_total_num_tokens,
                "max_req_input_len": self.max_req_input_len,
                "context_length": a.context_length,
            }],
        })
    }
}

type Shared = Arc<Worker>;

/// Long prompts are the point of over-capacity tests; axum's 2 MiB default is too small.
pub const BODY_LIMIT: usize = 64 << 20;

struct BootstrapPort(u16, u16);

pub async fn run(role: Role, args: WorkerArgs) -> anyhow::Result<()> {
    if !(0.0..=1.0).contains(&args.overload_share) {
        anyhow::bail!("--overload-share must be within 0..=1");
    }
    args.faults.validate()?;
    if role == Role::Prefill
        && args
            .faults
            .faults
            .contains(&crate::fault::Fault::ForeignRoutePut)
        && args.faults.fault_intruder.is_none()
    {
        anyhow::bail!(
            "--fault foreign-route-put needs the cluster's intruders: run `pd-sim cluster`"
        );
    }
    if role == Role::Prefill && args.decode_ignores_cancel {
        anyhow::bail!("--decode-ignores-cancel is a decode flag");
    }
    // Bind everything before announcing readiness.
    let http = TcpListener::bind((args.host.as_str(), args.port)).await?;
    let kv = TcpListener::bind((args.host.as_str(), args.kv_port)).await?;
    let boot = if role == Role::Prefill {
        Some(TcpListener::bind((args.host.as_str(), args.disaggregation_bootstrap_port)).await?)
    } else {
        None
    };
    let http_addr = http.local_addr()?;
    let kv_addr = kv.local_addr()?;
    let boot_port = boot
        .as_ref()
        .map(|b| b.local_addr().map(|a| a.port()))
        .transpose()?
        .unwrap_or(0);

    let exporter = Exporter::start(ExporterConfig {
        endpoint: args.otlp_endpoint.clone(),
        service_name: "sglang",
        scope_name: "sglang server",
        resource_attrs: vec![
            kv_str(
                "service.instance.id",
                format!("pd-sim-{}-{}", role.as_str(), std::process::id()),
            ),
            // The clock domain: every process of one machine shares it.
            kv_str("host.name", crate::spans::host_name()),
        ],
    });
    // SGLang exports no span with its limits; the simulator reports what `/server_info` says
    // as a `server_info` span under its own scope, so that a generic mapping (not the sglang
    // profile) can turn it into a capacity report (`context-exceeds-capacity`, the limits for
    // `over-capacity-admitted`). Off unless `--capacity-report-interval-s` is set.
    let capacity_exporter = (args.capacity_report_interval_s > 0).then(|| {
        Exporter::start(ExporterConfig {
            endpoint: args.otlp_endpoint.clone(),
            service_name: "pd-sim",
            scope_name: "pd-sim server_info",
            resource_attrs: vec![kv_str("host.name", crate::spans::host_name())],
        })
    });
    let link_stats = Arc::new(LinkStats::default());
    let w: Shared = Arc::new(Worker {
        role,
        max_req_input_len: args.max_req_input_len(),
        stats: WorkerStats::default(),
        link_stats: link_stats.clone(),
        rooms: Mutex::new(RoomLog {
            cap: args.room_log.max(1),
            map: HashMap::new(),
            order: VecDeque::new(),
        }),
        spans: exporter.sink.clone(),
        host_id: format!("{:032x}", rand::rng().random::<u128>()),
        pid: std::process::id(),
        inflight: AtomicU64::new(0),
        pending: Mutex::new(HashMap::new()),
        waiters: Mutex::new(HashMap::new()),
        routes: Mutex::new(HashMap::new()),
        pushers: Pushers::new(link_stats.clone()),
        kv_addr: Mutex::new(Some(kv_addr)),
        boot_addr: SocketAddr::new(kv_addr.ip(), boot_port),
        client: http_client(64),
        args,
    });

    {
        let w2 = w.clone();
        let on_msg = move |parts: Vec<Bytes>| match w2.role {
            Role::Prefill => w2.on_prefill_message(parts),
            Role::Decode => w2.on_decode_message(parts),
        };
        tokio::spawn(serve_pull(kv, link_stats, on_msg));
    }
    if role == Role::Prefill {
        tokio::spawn(sweeper(w.clone()));
    }
    if let Some(boot) = boot {
        let advertised = SocketAddr::new(
            kv_addr.ip(),
            w.args.advertise_kv_port.unwrap_or(kv_addr.port()),
        );
        bootstrap::spawn_server(boot, advertised, w.clone());
    }

    let app = api::routes(&w, boot_port, http_addr.port());

    crate::serve::print_ready(serde_json::json!({
        "role": role.as_str(),
        "http": format!("http://{http_addr}"),
        "port": http_addr.port(),
        "kv_port": kv_addr.port(),
        "bootstrap_port": boot_port,
        "pid": std::process::id(),
    }));
    tracing::info!(role = role.as_str(), %http_addr, kv = %kv_addr, bootstrap = boot_port, "worker ready");
    if let Some(cap) = &capacity_exporter {
        let (sink, w2) = (cap.sink.clone(), w.clone());
        let every = Duration::from_secs(w.args.capacity_report_interval_s);
        tokio::spawn(async move {
            let mut iv = tokio::time::interval(every);
            loop {
                iv.tick().await;
                sink.emit(vec![w2.capacity_span()]);
            }
        });
    }
    match role {
        Role::Prefill => {
            // Without TCP_NODELAY a streamed answer's second chunk waits for the client's
            // delayed ACK (~40 ms): that was the p99 of the load generator.
            let http = axum::serve::ListenerExt::tap_io(http, |tcp| {
                let _ = tcp.set_nodelay(true);
            });
            axum::serve(http, app)
                .with_graceful_shutdown(crate::serve::shutdown_signal())
                .await?;
        }
        Role::Decode => {
            // Decode sees its client leave mid-request (the router withdrawing the leg) and
            // honours or ignores it; see serve.rs.
            let on_gone = if w.args.decode_ignores_cancel {
                OnClientGone::Ignore
            } else {
                OnClientGone::Cancel
            };
            crate::serve::serve(http, app, on_gone).await?;
        }
    }
    exporter.shutdown(Duration::from_secs(3)).await;
    if let Some(cap) = capacity_exporter {
        cap.shutdown(Duration::from_secs(1)).await;
    }
    Ok(())
}
