//! Prefill and decode workers of SGLang 0.5.23 with the Mooncake backend, as seen on the wire:
//! SGLang's HTTP API and answers, its capacity checks and messages, the prefill bootstrap
//! server, the ZMTP control channel ([`crate::kvlink`]), the transfer engine's TCP transport
//! ([`crate::te`]) and SGLang-shaped spans. Paths below are inside the wheel's `sglang/srt/`.
//!
//! Start: prefill binds its HTTP port, its bootstrap server and its rank port (ZMTP PULL), and
//! registers its rank with `PUT /route` (`disaggregation/common/conn.py:1562`); decode binds its
//! HTTP port, its rank port and its transfer engine port.
//!
//! One PD attempt on room R, policy `early` (the default, `--decode-allocation-policy early`):
//! - prefill `/generate`: the tokenizer check (context length), pd-sim's queue check (503), the
//!   scheduler checks (max_req_input_len, KV capacity). A refusal is answered at once and opens
//!   no sender (`disaggregation/prefill.py:452`). An admitted request opens a sender (R is
//!   Bootstrapping), waits for decode's destinations for R (up to `--bootstrap-timeout-ms`),
//!   runs its forward (`--prefill-delay-us`), writes the KV to decode's transfer engine, sends
//!   the status `[R, "4", "0"]` to decode's rank port, and only then answers 200 with its one
//!   token (`prefill.py:1151`).
//! - decode `/generate`: the same tokenizer check, then the scheduler's (`decode.py:962`); looks
//!   prefill up once per bootstrap address (two `GET /route`, then its registration over ZMTP,
//!   cached); allocates R's KV pages (after `--bootstrap-delay-us`, its prealloc queue) and sends
//!   its destinations to prefill (`decode.py:1844`); waits for `[R, "4", rank]`, then
//!   generates. A Failed status, `--kv-timeout-ms` (SGLang's
//!   `SGLANG_DISAGGREGATION_WAITING_TIMEOUT`, 300 s) or its client going away ends the room:
//!   decode sends `ABORT` (with a generation once destinations were published) and prefill
//!   acknowledges it with `ABORT_ACK` once its transfer drained (`mooncake/conn.py:2903`).
//! - decode's client leaving: a streamed request is aborted at once (the generator is cancelled,
//!   `managers/tokenizer_manager.py:958`); a non-streamed one when SGLang's tokenizer next polls
//!   the connection, every `--request-state-wait-timeout-ms` (`SGLANG_REQUEST_STATE_WAIT_TIMEOUT`,
//!   4 s) from the start (`tokenizer_manager.py:1960`). `--decode-ignores-cancel` never aborts.
//!
//! Policy `prefill_complete`: decode sends `[BOOTSTRAP, R, ip, port]` after the lookup; prefill
//! runs its forward at once, then sends readiness `[R, "2", "0"]` once it knows decode's
//! endpoint; decode then allocates and sends its destinations; prefill's Success goes out when
//! its sender is cleared (`common/conn.py:2409`).
//!
//! Here: the flags, counters, room log and `run` (bind, register, announce READY, serve).
//! `api` has the HTTP routes and bodies, `prefill` and `decode` each role's side of a room,
//! `bootstrap` the bootstrap server and decode's lookup, `trace` the spans, `render` the answers.

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
use tokio::sync::mpsc;

use crate::http::{HttpClient, http_client};
use crate::ids::{count_tokens, new_rid, now_ns, room_hex};
use crate::kvlink::{KvPoll, LinkStats, Pushers, serve_pull};
use crate::serve::{ClientConn, OnClientGone};
use crate::spans::{Exporter, ExporterConfig, SpanSink, SpanSpec, kv_int, kv_str};
use crate::te::{TeClient, TeStats};
use crate::trace_ctx::{TraceParent, random_span_id, random_trace_id};

mod api;
mod bootstrap;
mod decode;
mod prefill;
mod render;
mod trace;

pub use bootstrap::registration_body;

/// SGLang's fake bootstrap host (`disaggregation/utils.py:53`): a request naming it moves no KV
/// and sends no ZMTP frame (warmup, health checks).
pub const FAKE_BOOTSTRAP_HOST: &str = "2.2.2.2";

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

/// SGLang's `--disaggregation-decode-allocation-policy`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AllocationPolicy {
    /// Decode allocates its KV and publishes destinations as soon as it has the request.
    #[default]
    Early,
    /// Decode sends `BOOTSTRAP` first and allocates only after prefill's readiness.
    #[value(name = "prefill_complete", alias = "prefill-complete")]
    PrefillComplete,
}

impl AllocationPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            AllocationPolicy::Early => "early",
            AllocationPolicy::PrefillComplete => "prefill_complete",
        }
    }
}

/// SGLang's defaults for the two disaggregation timeouts (`environ.py:759`, `:763`).
pub const SGLANG_BOOTSTRAP_TIMEOUT_MS: u64 = 300_000;
pub const SGLANG_WAITING_TIMEOUT_MS: u64 = 300_000;

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
    /// KV pool size in tokens (scheduler check; decode: its page pool).
    #[arg(long, default_value_t = 8192)]
    pub max_total_num_tokens: u64,
    /// Longest admitted input (scheduler check). Default: min(context, total) - 1.
    #[arg(long)]
    pub max_req_input_len: Option<u64>,
    /// Prefill answers 503 "The request queue is full." when more requests are in flight
    /// (pd-sim's own: SGLang's PD prefill has no such check).
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
    /// Prefill: a room it refused is still sent to decode once decode publishes destinations
    /// for it (the refusal is answered at once; `handoff-after-reject`).
    #[arg(long)]
    pub transfer_after_reject: bool,
    /// Prefill bootstrap server port (SGLang's --disaggregation-bootstrap-port).
    #[arg(long, default_value_t = 8998)]
    pub disaggregation_bootstrap_port: u16,
    /// ZMTP PULL port of the KV control channel, SGLang's `rank_port` (0 = ephemeral).
    #[arg(long, default_value_t = 0)]
    pub kv_port: u16,
    /// The rank port this worker announces (prefill: in its registration; decode: in its
    /// registration, destinations, BOOTSTRAP and ABORT frames), to put a tap in front of it.
    #[arg(long)]
    pub advertise_kv_port: Option<u16>,
    /// Decode: port of its transfer engine (Mooncake TE's TCP transport; 0 = ephemeral). Its
    /// session id, `host:port`, names it.
    #[arg(long, default_value_t = 0)]
    pub te_port: u16,
    /// SGLang's --disaggregation-decode-allocation-policy; both roles must agree.
    #[arg(
        long = "decode-allocation-policy",
        visible_alias = "disaggregation-decode-allocation-policy",
        value_enum,
        default_value_t = AllocationPolicy::Early
    )]
    pub decode_allocation_policy: AllocationPolicy,
    /// Simulated prefill forward time per request, microseconds.
    #[arg(long, default_value_t = 500)]
    pub prefill_delay_us: u64,
    /// Decode: time a request queues before it allocates its KV and publishes destinations
    /// (SGLang's prealloc queue), microseconds.
    #[arg(long, default_value_t = 0)]
    pub bootstrap_delay_us: u64,
    /// Simulated decode time per generated token, microseconds.
    #[arg(long, default_value_t = 0)]
    pub decode_token_delay_us: u64,
    /// Prefill: how long an admitted room waits for decode's destinations
    /// (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT) [default: 300000; vLLM flavour 5000].
    #[arg(long)]
    pub bootstrap_timeout_ms: Option<u64>,
    /// Decode: how long a room waits for its KV after publishing destinations (under
    /// prefill_complete also for prefill's readiness): SGLANG_DISAGGREGATION_WAITING_TIMEOUT
    /// [default: 300000; vLLM flavour 2000].
    #[arg(long, visible_alias = "disaggregation-waiting-timeout-ms")]
    pub kv_timeout_ms: Option<u64>,
    /// Decode: how often SGLang's tokenizer polls a non-streamed request's connection
    /// (SGLANG_REQUEST_STATE_WAIT_TIMEOUT); a client gone is aborted at the next poll.
    #[arg(long, default_value_t = 4000)]
    pub request_state_wait_timeout_ms: u64,
    /// Decode: when a request's client connection goes away, carry on as if it were there (no
    /// ABORT to prefill; wait for the KV, answer on the socket, then close it).
    /// Default: abort the request, send ABORT, close (SGLang's decode).
    #[arg(long)]
    pub decode_ignores_cancel: bool,
    /// Prefill: send the status line and headers as soon as the request is admitted or refused,
    /// with `x-pd-sim-admission: admitted|refused` (the signal pd-sim's sequential router modes
    /// wait for; `cluster` sets it for `correct` and `handoff-after-reject`). SGLang answers a
    /// non-streamed request whole, at its end.
    #[arg(long)]
    pub status_at_admission: bool,
    /// Post SGLang's disaggregation warmup to itself before READY (`bootstrap_host` 2.2.2.2,
    /// room 0: no ZMTP traffic; `entrypoints/http_server.py:2318`).
    #[arg(long)]
    pub warmup: bool,
    /// Bytes of simulated KV per input token (written through the transfer engine).
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
    fn bootstrap_timeout(&self) -> Duration {
        Duration::from_millis(
            self.bootstrap_timeout_ms
                .unwrap_or(SGLANG_BOOTSTRAP_TIMEOUT_MS),
        )
    }
    fn waiting_timeout(&self) -> Duration {
        Duration::from_millis(self.kv_timeout_ms.unwrap_or(SGLANG_WAITING_TIMEOUT_MS))
    }
}

#[derive(Default, Serialize)]
pub struct WorkerStats {
    pub requests: AtomicU64,
    pub sub_requests: AtomicU64,
    pub admitted: AtomicU64,
    pub rejected_400: AtomicU64,
    pub rejected_503: AtomicU64,
    pub bad_requests: AtomicU64,
    pub completed: AtomicU64,
    pub warmups: AtomicU64,
    /// ZMTP messages, by kind (prefill counts what it received, decode what it sent, and the
    /// other way round for statuses and ABORT_ACKs).
    pub registrations: AtomicU64,
    pub destinations: AtomicU64,
    pub bootstrap_frames: AtomicU64,
    pub statuses: AtomicU64,
    pub abort_frames: AtomicU64,
    pub abort_acks: AtomicU64,
    /// Messages SGLang would drop or choke on (see `kvlink::parse_at_*`).
    pub malformed_frames: AtomicU64,
    /// Valid SGLang messages this role does not expect (e.g. BOOTSTRAP under `early`).
    pub unexpected_frames: AtomicU64,
    /// Prefill: destinations for a room with no sender (SGLang keeps them; pd-sim expires them).
    pub orphan_destinations: AtomicU64,
    /// Decode: statuses for a room it does not hold (dropped, as SGLang does).
    pub statuses_unmatched: AtomicU64,
    pub kv_transfers: AtomicU64,
    pub kv_transfers_after_reject: AtomicU64,
    pub kv_transfers_failed: AtomicU64,
    pub kv_bytes: AtomicU64,
    /// Decode: bytes that arrived at addresses no live room owns.
    pub kv_bytes_unattributed: AtomicU64,
    pub bootstrap_timeouts: AtomicU64,
    pub waiting_timeouts: AtomicU64,
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

/// What a worker remembers about one room, for tests and demos (`GET /sim/rooms`): the ground
/// truth of what happened on the wire for it. Counters are per direction: a prefill's record
/// counts what decode sent it (`*_received`) and what it sent (`*_sent`), and so does decode's.
#[derive(Clone, Default, Serialize, Debug)]
pub struct RoomRecord {
    pub room: u64,
    pub rid: String,
    pub request_id: Option<String>,
    /// HTTP status answered for this room's request (0: no HTTP request seen). A streamed
    /// answer is 200 even when it carries an error; `error_code` then says which.
    pub status: u16,
    /// The status code of an error or abort carried inside a 200 (streamed) answer.
    pub error_code: u16,
    pub input_tokens: u64,
    /// `BOOTSTRAP` frames (prefill_complete).
    pub bootstrap_sent: u32,
    pub bootstrap_received: u32,
    /// The 10-frame destinations message.
    pub destinations_sent: u32,
    pub destinations_received: u32,
    /// Status values in the order they went out / came in (`2` readiness, `4` Success,
    /// `0` Failed).
    pub statuses_sent: Vec<u8>,
    pub statuses_received: Vec<u8>,
    /// KV bytes written through the transfer engine (prefill: sent; decode: landed in pages
    /// the room owned).
    pub kv_bytes_sent: u64,
    pub kv_bytes_received: u64,
    pub aborts_sent: u32,
    pub aborts_received: u32,
    /// The generation of the last ABORT sent or received, if it carried one.
    pub abort_generation: Option<u64>,
    pub abort_acks_sent: u32,
    pub abort_acks_received: u32,
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
    /// The first per-room control frame: decode sent it (BOOTSTRAP or destinations), prefill
    /// received it.
    pub bootstrap_ns: u64,
    /// Decode: destinations sent; prefill: received.
    pub destinations_ns: u64,
    /// Prefill: Success sent; decode: received.
    pub success_ns: u64,
    /// The HTTP status was decided (prefill: its verdict, admission or refusal).
    pub answered_ns: u64,
    /// Decode: the client closed the connection while the request was in flight.
    pub client_gone_ns: u64,
    /// The request ended (answered to its end, refused, cancelled).
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
    policy: AllocationPolicy,
    max_req_input_len: u64,
    pub stats: WorkerStats,
    link_stats: Arc<LinkStats>,
    te_stats: Arc<TeStats>,
    rooms: Mutex<RoomLog>,
    spans: SpanSink,
    host_id: String,
    pid: u32,
    inflight: AtomicU64,
    /// Prefill: request_status, transfer_infos and the deferred bootstrap table, per room.
    prefill: Mutex<prefill::PrefillTable>,
    /// Decode: request_status per room and its KV page and metadata-slot allocations.
    decode: Mutex<decode::DecodeTable>,
    /// Decode: what it knows of each prefill, by bootstrap address (looked up once).
    peers: Mutex<HashMap<String, Arc<tokio::sync::OnceCell<bootstrap::PrefillPeer>>>>,
    pushers: Pushers,
    te: TeClient,
    /// This worker's rank port (ZMTP PULL).
    kv_addr: SocketAddr,
    /// Decode: its transfer engine (port 0: none).
    te_addr: SocketAddr,
    /// Prefill: its bootstrap server's address (0 port: none).
    boot_addr: SocketAddr,
    http_port: u16,
    /// Decode: the generation of the last armed ABORT (`common/conn.py:979`).
    abort_generation: AtomicU64,
    next_id: AtomicU64,
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

    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The tokenizer check (context length, `managers/tokenizer_manager.py:1338`): a refusal
    /// there never reaches the scheduler.
    fn tokenizer_check(&self, input_tokens: u64) -> Option<String> {
        let a = &self.args;
        (input_tokens >= a.context_length).then(|| {
            format!(
                "The input ({input_tokens} tokens) is longer than the model's context length ({} tokens).",
                a.context_length
            )
        })
    }

    /// pd-sim's queue check (prefill): 503 `The request queue is full.`.
    fn queue_check(&self) -> Option<String> {
        if self.role != Role::Prefill {
            return None;
        }
        let a = &self.args;
        let queued = self.inflight.load(Ordering::Relaxed);
        let overloaded = a.max_queued_requests.is_some_and(|m| queued >= m)
            || (a.overload_share > 0.0 && rand::rng().random::<f64>() < a.overload_share);
        overloaded.then(|| "The request queue is full.".to_string())
    }

    /// The scheduler's intake checks, in SGLang's order: max_req_input_len (an input of that
    /// many tokens is refused already, `managers/utils.py:272`; `err_type` BadRequestError),
    /// then the KV capacity (`disaggregation/prefill.py:468`, `decode.py:962`, no `err_type`).
    /// `None` = admitted.
    fn scheduler_check(&self, input_tokens: u64, rid: &str) -> Option<render::Refusal> {
        let a = &self.args;
        if input_tokens >= self.max_req_input_len {
            return Some(render::Refusal {
                status: 400,
                message: format!(
                    "Input length ({input_tokens} tokens) exceeds the maximum allowed length ({} tokens). Use a shorter input or enable --allow-auto-truncate.",
                    self.max_req_input_len
                ),
                err_type: Some("BadRequestError"),
            });
        }
        if !a.skip_total_tokens_check && input_tokens > a.max_total_num_tokens {
            return Some(render::Refusal {
                status: 400,
                message: format!(
                    "Request {rid} exceeds the maximum number of tokens: {input_tokens} > {}",
                    a.max_total_num_tokens
                ),
                err_type: None,
            });
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
            "disaggregation_decode_allocation_policy": self.policy.as_str(),
            "context_length": a.context_length,
            "max_total_num_tokens": a.max_total_num_tokens,
            "max_req_input_len": self.max_req_input_len,
            "max_queued_requests": a.max_queued_requests,
            "tp_size": 1,
            "dp_size": 1,
            "page_size": 1,
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
    if args.request_state_wait_timeout_ms == 0 {
        anyhow::bail!("--request-state-wait-timeout-ms must be positive");
    }
    // Bind everything before announcing readiness.
    let http = TcpListener::bind((args.host.as_str(), args.port)).await?;
    let kv = TcpListener::bind((args.host.as_str(), args.kv_port)).await?;
    let boot = if role == Role::Prefill {
        Some(TcpListener::bind((args.host.as_str(), args.disaggregation_bootstrap_port)).await?)
    } else {
        None
    };
    let te = if role == Role::Decode {
        Some(TcpListener::bind((args.host.as_str(), args.te_port)).await?)
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
    let te_addr = match &te {
        Some(l) => l.local_addr()?,
        None => SocketAddr::new(kv_addr.ip(), 0),
    };

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
    let te_stats = Arc::new(TeStats::default());
    let w: Shared = Arc::new(Worker {
        role,
        policy: args.decode_allocation_policy,
        max_req_input_len: args.max_req_input_len(),
        stats: WorkerStats::default(),
        link_stats: link_stats.clone(),
        te_stats: te_stats.clone(),
        rooms: Mutex::new(RoomLog {
            cap: args.room_log.max(1),
            map: HashMap::new(),
            order: VecDeque::new(),
        }),
        spans: exporter.sink.clone(),
        host_id: format!("{:032x}", rand::rng().random::<u128>()),
        pid: std::process::id(),
        inflight: AtomicU64::new(0),
        prefill: Mutex::new(prefill::PrefillTable::default()),
        decode: Mutex::new(decode::DecodeTable::new(args.max_total_num_tokens)),
        peers: Mutex::new(HashMap::new()),
        pushers: Pushers::new(link_stats.clone()),
        te: TeClient::new(te_stats.clone()),
        kv_addr,
        te_addr,
        boot_addr: SocketAddr::new(kv_addr.ip(), boot_port),
        http_port: http_addr.port(),
        abort_generation: AtomicU64::new(0),
        next_id: AtomicU64::new(0),
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
    if let Some(te) = te {
        let w2 = w.clone();
        tokio::spawn(crate::te::serve(te, te_stats, move |b| w2.on_te_block(b)));
    }
    if role == Role::Prefill {
        tokio::spawn(prefill::sweeper(w.clone()));
    }
    if let Some(boot) = boot {
        bootstrap::spawn_server(boot, w.clone());
        // Each prefill rank registers itself (`common/conn.py:1562`) before decode can look
        // it up; SGLang's server answers 503 until then.
        w.register_own_rank().await?;
    }

    let app = api::routes(&w, boot_port, http_addr.port());
    let (http_tx, http_rx) = tokio::sync::oneshot::channel::<anyhow::Result<()>>();
    {
        let w = w.clone();
        tokio::spawn(async move {
            let r = serve_http(&w, http, app).await;
            let _ = http_tx.send(r);
        });
    }
    if w.args.warmup {
        w.warmup(http_addr).await?;
    }

    let mut ready = serde_json::json!({
        "role": role.as_str(),
        "http": format!("http://{http_addr}"),
        "port": http_addr.port(),
        "kv_port": kv_addr.port(),
        "bootstrap_port": boot_port,
        "decode_allocation_policy": w.policy.as_str(),
        "pid": std::process::id(),
    });
    if role == Role::Decode {
        ready["te_port"] = te_addr.port().into();
    }
    crate::serve::print_ready(ready);
    tracing::info!(role = role.as_str(), %http_addr, kv = %kv_addr, bootstrap = boot_port, te = te_addr.port(), "worker ready");
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
    let served = http_rx
        .await
        .unwrap_or_else(|_| Err(anyhow::anyhow!("HTTP server task ended")));
    exporter.shutdown(Duration::from_secs(3)).await;
    if let Some(cap) = capacity_exporter {
        cap.shutdown(Duration::from_secs(1)).await;
    }
    served
}

async fn serve_http(w: &Shared, http: TcpListener, app: Router) -> anyhow::Result<()> {
    match w.role {
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
            // Decode sees its client leave mid-request and decides what it means; see serve.rs.
            let on_gone = if w.args.decode_ignores_cancel {
                OnClientGone::Ignore
            } else {
                OnClientGone::Notify
            };
            crate::serve::serve(http, app, on_gone).await?;
        }
    }
    Ok(())
}

impl Worker {
    /// SGLang's disaggregation warmup (`entrypoints/http_server.py:2318`): one `/generate` per
    /// DP rank to itself, `bootstrap_host` 2.2.2.2 (a fake transfer), room = the DP rank.
    async fn warmup(&self, http: SocketAddr) -> anyhow::Result<()> {
        #[derive(Serialize)]
        struct Sampling {
            temperature: f64,
            max_new_tokens: u64,
            ignore_eos: bool,
        }
        #[derive(Serialize)]
        struct Warmup {
            sampling_params: Sampling,
            bootstrap_host: &'static str,
            bootstrap_room: u64,
            input_ids: [u64; 4],
            routed_dp_rank: u64,
        }
        // aiohttp's `json=`: Python's `json.dumps`, the dict's key order.
        let body = crate::http::py_json(&Warmup {
            sampling_params: Sampling {
                temperature: 0.0,
                max_new_tokens: 8,
                ignore_eos: true,
            },
            bootstrap_host: FAKE_BOOTSTRAP_HOST,
            bootstrap_room: 0,
            input_ids: [10, 11, 12, 13],
            routed_dp_rank: 0,
        });
        let req = hyper::Request::post(format!("http://{http}/generate"))
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(Bytes::from(body)))?;
        let resp = tokio::time::timeout(Duration::from_secs(30), self.client.request(req))
            .await
            .map_err(|_| anyhow::anyhow!("warmup timed out"))??;
        let status = resp.status();
        let _ = http_body_util::BodyExt::collect(resp.into_body()).await;
        if !status.is_success() {
            anyhow::bail!("warmup answered {status}");
        }
        self.stats.warmups.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}
