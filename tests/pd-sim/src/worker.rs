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
use http_body_util::{BodyExt, Full};
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    fn as_str(self) -> &'static str {
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

struct XferDone {
    start_ns: u64,
    end_ns: u64,
}

/// Late spans for a rejected room that is transferred anyway.
struct LateTrace {
    trace_id: [u8; 16],
    root: [u8; 8],
}

enum Pending {
    Request {
        tokens: u64,
        done: Option<oneshot::Sender<XferDone>>,
        late: Option<LateTrace>,
        since: Instant,
    },
    Bootstrap {
        endpoint: SocketAddr,
        since: Instant,
    },
}

struct DecodeWaiter {
    done: oneshot::Sender<()>,
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
    client: HttpClient,
}

#[derive(Deserialize)]
struct SamplingParams {
    max_new_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct GenerateBody {
    text: Option<serde_json::Value>,
    input_ids: Option<Vec<serde::de::IgnoredAny>>,
    sampling_params: Option<SamplingParams>,
    stream: Option<bool>,
    rid: Option<String>,
    bootstrap_room: Option<u64>,
    bootstrap_host: Option<String>,
    bootstrap_port: Option<u16>,
}

#[derive(Deserialize)]
struct ChatMessage {
    content: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct ChatBody {
    messages: Vec<ChatMessage>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    stream: Option<bool>,
    rid: Option<String>,
    bootstrap_room: Option<u64>,
    bootstrap_host: Option<String>,
    bootstrap_port: Option<u16>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Api {
    Generate,
    Chat,
}

struct Parsed {
    api: Api,
    input_tokens: u64,
    max_new_tokens: Option<u64>,
    stream: bool,
    rid: Option<String>,
    room: Option<u64>,
    bootstrap: Option<(String, u16)>,
}

fn text_tokens(v: &serde_json::Value) -> u64 {
    match v {
        serde_json::Value::String(s) => count_tokens(s),
        serde_json::Value::Array(a) => a.iter().map(text_tokens).sum(),
        serde_json::Value::Object(o) => o.get("text").map(text_tokens).unwrap_or(0),
        _ => 0,
    }
}

/// serde_json's messages can quote the offending value (i.e. prompt text): say only where
/// and what kind of error it was.
fn body_error(e: serde_json::Error) -> String {
    let kind = match e.classify() {
        serde_json::error::Category::Io => "io",
        serde_json::error::Category::Syntax => "syntax",
        serde_json::error::Category::Data => "data",
        serde_json::error::Category::Eof => "eof",
    };
    format!(
        "invalid request body: {kind} error at line {} column {}",
        e.line(),
        e.column()
    )
}

fn parse_body(api: Api, body: &[u8]) -> Result<Parsed, String> {
    match api {
        Api::Generate => {
            let b: GenerateBody = serde_json::from_slice(body).map_err(body_error)?;
            let input_tokens = match (&b.text, &b.input_ids) {
                (Some(t), _) => text_tokens(t),
                (None, Some(ids)) => ids.len() as u64,
                (None, None) => return Err("Either text or input_ids should be provided.".into()),
            };
            Ok(Parsed {
                api,
                input_tokens,
                max_new_tokens: b.sampling_params.and_then(|s| s.max_new_tokens),
                stream: b.stream.unwrap_or(false),
                rid: b.rid,
                room: b.bootstrap_room,
                bootstrap: b.bootstrap_host.zip(b.bootstrap_port),
            })
        }
        Api::Chat => {
            let b: ChatBody = serde_json::from_slice(body).map_err(body_error)?;
            let input_tokens = b
                .messages
                .iter()
                .filter_map(|m| m.content.as_ref())
                .map(text_tokens)
                .sum();
            Ok(Parsed {
                api,
                input_tokens,
                max_new_tokens: b.max_completion_tokens.or(b.max_tokens),
                stream: b.stream.unwrap_or(false),
                rid: b.rid,
                room: b.bootstrap_room,
                bootstrap: b.bootstrap_host.zip(b.bootstrap_port),
            })
        }
    }
}

/// Spans of one request, collected while serving and emitted as one group at the end.
/// SGLang's layout: root "{role} Req {rid8}" → thread spans ("{Role}Tokenizer(...)",
/// "{Role} Scheduler [TP 0] (...)") → stage spans.
struct ReqTrace {
    on: bool,
    trace_id: [u8; 16],
    parent: Option<[u8; 8]>,
    root: [u8; 8],
    spans: Vec<opentelemetry_proto::tonic::trace::v1::Span>,
    /// Put on the root as `gen_ai.usage.input_tokens` (the GenAI semantic convention revenant's
    /// sglang profile reads). SGLang 0.5.2x does not export it; the simulator does so that
    /// `over-capacity-admitted` has a token count on the OTLP path.
    input_tokens: u64,
}

impl ReqTrace {
    fn new(on: bool, tp: Option<TraceParent>) -> Self {
        ReqTrace {
            on,
            trace_id: tp.map(|t| t.trace_id).unwrap_or_else(random_trace_id),
            parent: tp.map(|t| t.span_id),
            root: random_span_id(),
            spans: Vec::new(),
            input_tokens: 0,
        }
    }

    fn thread(
        &mut self,
        w: &Worker,
        scheduler: bool,
        start: u64,
        end: u64,
        err: Option<&str>,
    ) -> [u8; 8] {
        let id = random_span_id();
        if !self.on {
            return id;
        }
        let host8 = &w.host_id[..8];
        let (name, label) = if scheduler {
            (
                format!(
                    "{} Scheduler [TP 0] (host:{host8} | pid:{})",
                    w.role.title(),
                    w.pid
                ),
                format!("{} Scheduler", w.role.title()),
            )
        } else {
            (
                format!("{}Tokenizer(host:{host8} | pid:{})", w.role.title(), w.pid),
                format!("{}Tokenizer", w.role.title()),
            )
        };
        let mut attributes = Vec::with_capacity(5);
        if scheduler {
            attributes.push(kv_int("tp_rank", 0));
        }
        attributes.push(kv_str("host_id", w.host_id.clone()));
        attributes.push(kv_int("pid", w.pid as i64));
        attributes.push(kv_str("thread_label", label));
        self.spans.push(
            SpanSpec {
                trace_id: self.trace_id,
                span_id: id,
                parent: Some(self.root),
                name,
                start_ns: start,
                end_ns: end,
                attributes,
                events: Vec::new(),
                error: err,
            }
            .build(),
        );
        id
    }

    fn stage(&mut self, parent: [u8; 8], name: &str, start: u64, end: u64) {
        if !self.on {
            return;
        }
        self.spans.push(
            SpanSpec {
                trace_id: self.trace_id,
                span_id: random_span_id(),
                parent: Some(parent),
                name: name.into(),
                start_ns: start,
                end_ns: end,
                attributes: Vec::new(),
                events: Vec::new(),
                error: None,
            }
            .build(),
        );
    }

    fn finish(mut self, w: &Worker, rid: &str, room: Option<u64>, start: u64, end: u64) {
        if !self.on {
            return;
        }
        let mut attributes = vec![kv_str("rid", rid), kv_str("module", "sglang::request")];
        if let Some(r) = room {
            attributes.push(kv_str("bootstrap_room", room_hex(r)));
        }
        attributes.push(kv_str("gen_ai.request.id", rid));
        attributes.push(kv_int(
            "gen_ai.usage.input_tokens",
            self.input_tokens as i64,
        ));
        // Children precede the root, as SGLang's exporter emits them.
        self.spans.push(
            SpanSpec {
                trace_id: self.trace_id,
                span_id: self.root,
                parent: self.parent,
                name: format!("{} Req {}", w.role.as_str(), &rid[..rid.len().min(8)]),
                start_ns: start,
                end_ns: end,
                attributes,
                events: Vec::new(),
                error: None,
            }
            .build(),
        );
        w.spans.emit(self.spans);
    }
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

    // ---- prefill: meeting the admission and decode's BOOTSTRAP --------------------------------

    fn meet_request(
        self: &Arc<Self>,
        room: u64,
        tokens: u64,
        done: Option<oneshot::Sender<XferDone>>,
        late: Option<LateTrace>,
    ) {
        let endpoint = {
            let mut p = self.pending.lock().expect("pending lock");
            match p.remove(&room) {
                Some(Pending::Bootstrap { endpoint, .. }) => endpoint,
                _ => {
                    p.insert(
                        room,
                        Pending::Request {
                            tokens,
                            done,
                            late,
                            since: Instant::now(),
                        },
                    );
                    return;
                }
            }
        };
        self.spawn_transfer(room, tokens, endpoint, done, late);
    }

    fn meet_bootstrap(self: &Arc<Self>, room: u64, endpoint: SocketAddr) {
        let (tokens, done, late) = {
            let mut p = self.pending.lock().expect("pending lock");
            match p.remove(&room) {
                Some(Pending::Request {
                    tokens, done, late, ..
                }) => (tokens, done, late),
                _ => {
                    p.insert(
                        room,
                        Pending::Bootstrap {
                            endpoint,
                            since: Instant::now(),
                        },
                    );
                    return;
                }
            }
        };
        self.spawn_transfer(room, tokens, endpoint, done, late);
    }

    fn spawn_transfer(
        self: &Arc<Self>,
        room: u64,
        tokens: u64,
        to: SocketAddr,
        done: Option<oneshot::Sender<XferDone>>,
        late: Option<LateTrace>,
    ) {
        let w = self.clone();
        tokio::spawn(async move {
            let start_ns = now_ns();
            let total = (tokens.max(1) * w.args.kv_bytes_per_token) as usize;
            const CHUNK: usize = 64 * 1024;
            static ZEROS: [u8; CHUNK] = [0u8; CHUNK];
            let room_s = room.to_string();
            // The whole transfer is encoded up front and queued as one unit (one write on the
            // socket for small transfers); frames are still separate ZMTP messages.
            let mut buf = bytes::BytesMut::with_capacity(total + 64);
            let mut sent = 0usize;
            let mut idx = 0u32;
            while sent < total || idx == 0 {
                let n = (total - sent).min(CHUNK);
                let idx_s = idx.to_string();
                crate::zmtp::encode_message(
                    &mut buf,
                    &[&b"KV"[..], room_s.as_bytes(), idx_s.as_bytes(), &ZEROS[..n]],
                );
                sent += n;
                idx += 1;
            }
            let tok_s = tokens.to_string();
            crate::zmtp::encode_message(
                &mut buf,
                &[&b"KV_DONE"[..], room_s.as_bytes(), tok_s.as_bytes()],
            );
            w.pushers
                .send_encoded(to, buf.freeze(), idx as u64 + 1)
                .await;
            let end_ns = now_ns();
            w.stats.kv_transfers.fetch_add(1, Ordering::Relaxed);
            w.stats.kv_chunks.fetch_add(idx as u64, Ordering::Relaxed);
            let after_reject = late.is_some();
            w.record(room, |r| {
                r.kv_chunks += idx;
                r.kv_done = true;
                if after_reject {
                    r.outcome = "rejected-transferred";
                }
            });
            if let Some(late) = late {
                w.stats
                    .kv_transfers_after_reject
                    .fetch_add(1, Ordering::Relaxed);
                // The rejected request's root span has ended; the transfer still shows up as
                // scheduler work under it, which is exactly the evidence a monitor needs.
                let mut t = ReqTrace {
                    on: w.spans.enabled(),
                    trace_id: late.trace_id,
                    parent: None,
                    root: late.root,
                    spans: Vec::new(),
                    input_tokens: 0,
                };
                let th = t.thread(&w, true, start_ns, end_ns, None);
                t.stage(th, "prefill_transfer_kv_cache", start_ns, end_ns);
                w.spans.emit(t.spans);
            }
            if let Some(d) = done {
                let _ = d.send(XferDone { start_ns, end_ns });
            }
        });
    }

    fn on_prefill_message(self: &Arc<Self>, parts: Vec<Bytes>) {
        let verb = parts.first().map(|b| &b[..]).unwrap_or(b"");
        match verb {
            b"BOOTSTRAP" if parts.len() >= 4 => {
                let (Some(room), Ok(ip), Some(port)) = (
                    parse_u64(&parts[1]),
                    std::str::from_utf8(&parts[2]).map(|s| s.parse::<IpAddr>()),
                    parse_u64(&parts[3]),
                ) else {
                    self.stats.unknown_frames.fetch_add(1, Ordering::Relaxed);
                    return;
                };
                let Ok(ip) = ip else {
                    self.stats.unknown_frames.fetch_add(1, Ordering::Relaxed);
                    return;
                };
                self.stats.bootstrap_frames.fetch_add(1, Ordering::Relaxed);
                let now = now_ns();
                self.record(room, |r| {
                    r.bootstrap_frames += 1;
                    if r.bootstrap_ns == 0 {
                        r.bootstrap_ns = now;
                    }
                });
                self.meet_bootstrap(room, SocketAddr::new(ip, port as u16));
            }
            b"ABORT" if parts.len() >= 2 => {
                let Some(room) = parse_u64(&parts[1]) else {
                    self.stats.unknown_frames.fetch_add(1, Ordering::Relaxed);
                    return;
                };
                self.stats.abort_frames.fetch_add(1, Ordering::Relaxed);
                self.record(room, |r| r.abort_frames += 1);
                // Dropping the pending entry drops its completion sender: the waiting HTTP
                // request sees the abort.
                self.pending.lock().expect("pending lock").remove(&room);
            }
            _ => {
                self.stats.unknown_frames.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn on_decode_message(self: &Arc<Self>, parts: Vec<Bytes>) {
        let verb = parts.first().map(|b| &b[..]).unwrap_or(b"");
        let room = parts.get(1).and_then(|r| parse_u64(r));
        match (verb, room) {
            (b"KV", Some(room)) => {
                let known = self
                    .waiters
                    .lock()
                    .expect("waiters lock")
                    .contains_key(&room);
                if known {
                    self.stats.kv_chunks.fetch_add(1, Ordering::Relaxed);
                } else {
                    self.stats
                        .kv_chunks_unmatched
                        .fetch_add(1, Ordering::Relaxed);
                }
                self.record(room, |r| r.kv_chunks += 1);
            }
            (b"KV_DONE", Some(room)) => {
                self.record(room, |r| r.kv_done = true);
                if let Some(wt) = self.waiters.lock().expect("waiters lock").remove(&room) {
                    let _ = wt.done.send(());
                }
            }
            _ => {
                self.stats.unknown_frames.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Prefill's KV endpoint for a bootstrap server, looked up once and cached (SGLang caches
    /// the bootstrap info per prefill address, too).
    async fn prefill_endpoint(&self, host: &str, port: u16) -> Result<SocketAddr, String> {
        let key = format!("{host}:{port}");
        if let Some(a) = self.routes.lock().expect("routes lock").get(&key) {
            return Ok(*a);
        }
        self.stats.route_lookups.fetch_add(1, Ordering::Relaxed);
        let uri = format!("http://{key}/route?engine_rank=0&target_dp_group=0");
        let req = hyper::Request::get(uri)
            .body(Full::new(Bytes::new()))
            .map_err(|e| e.to_string())?;
        let resp = tokio::time::timeout(Duration::from_secs(5), self.client.request(req))
            .await
            .map_err(|_| "bootstrap server timed out".to_string())?
            .map_err(|e| e.to_string())?;
        if !resp.status().is_success() {
            return Err(format!("bootstrap server answered {}", resp.status()));
        }
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        #[derive(Deserialize)]
        struct Info {
            rank_ip: String,
            rank_port: u16,
        }
        let info: Info = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
        let ip: IpAddr = info
            .rank_ip
            .parse()
            .map_err(|e| format!("bad rank_ip: {e}"))?;
        let addr = SocketAddr::new(ip, info.rank_port);
        self.routes.lock().expect("routes lock").insert(key, addr);
        Ok(addr)
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
        let app = Router::new()
            .route("/route", get(route_get).put(route_put))
            .route("/health", get(|| async { "OK" }))
            .with_state(Arc::new(Mutex::new(advertised)));
        tokio::spawn(async move {
            if let Err(e) = axum::serve(boot, app).await {
                tracing::error!(error = %e, "bootstrap server failed");
            }
        });
    }

    let app = Router::new()
        .route("/generate", post(generate))
        .route("/v1/chat/completions", post(chat))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/health_generate", get(|| async { StatusCode::OK }))
        .route("/server_info", get(server_info))
        .route("/get_server_info", get(server_info))
        .route("/model_info", get(model_info))
        .route("/get_model_info", get(model_info))
        .route("/v1/models", get(models))
        .route("/sim/stats", get(sim_stats))
        .route("/sim/rooms", get(sim_rooms))
        .layer(axum::Extension(Arc::new(BootstrapPort(
            boot_port,
            http_addr.port(),
        ))))
        // Last, so it covers every route above.
        .layer(axum::extract::DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(w.clone());

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

async fn sweeper(w: Shared) {
    let timeout = Duration::from_millis(w.args.bootstrap_timeout_ms);
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tick.tick().await;
        let mut expired_bootstraps = 0u64;
        {
            let mut p = w.pending.lock().expect("pending lock");
            p.retain(|_, v| match v {
                Pending::Request { since, .. } => since.elapsed() < timeout,
                Pending::Bootstrap { since, .. } => {
                    let keep = since.elapsed() < timeout;
                    if !keep {
                        expired_bootstraps += 1;
                    }
                    keep
                }
            });
        }
        w.stats
            .bootstraps_unmatched
            .fetch_add(expired_bootstraps, Ordering::Relaxed);
    }
}

#[derive(Deserialize)]
struct RouteQuery {
    engine_rank: Option<String>,
    target_dp_group: Option<String>,
}

/// SGLang's bootstrap `GET /route`: `engine_rank=-1&target_dp_group=-1` → parallel info;
/// otherwise the rank's `{rank_ip, rank_port}`.
async fn route_get(
    State(addr): State<Arc<Mutex<SocketAddr>>>,
    Query(q): Query<RouteQuery>,
) -> Response {
    let (Some(rank), Some(group)) = (q.engine_rank, q.target_dp_group) else {
        return (
            StatusCode::BAD_REQUEST,
            "Missing inputs for bootstrap server.",
        )
            .into_response();
    };
    let (Ok(rank), Ok(group)) = (rank.parse::<i64>(), group.parse::<i64>()) else {
        return (
            StatusCode::BAD_REQUEST,
            "Missing inputs for bootstrap server.",
        )
            .into_response();
    };
    if rank == -1 && group == -1 {
        return axum::Json(serde_json::json!({"prefill_tp_size": 1, "prefill_dp_size": 1}))
            .into_response();
    }
    if rank != 0 || group != 0 {
        return (StatusCode::NOT_FOUND, "Bootstrap info not Found").into_response();
    }
    let a = *addr.lock().expect("route lock");
    axum::Json(serde_json::json!({"rank_ip": a.ip().to_string(), "rank_port": a.port()}))
        .into_response()
}

/// Registration of a prefill rank (`PUT /route`). The simulator has one rank, registered at
/// start; a PUT replaces its address, which is how SGLang ranks announce themselves.
async fn route_put(State(addr): State<Arc<Mutex<SocketAddr>>>, body: Bytes) -> Response {
    #[derive(Deserialize)]
    struct Put {
        role: String,
        rank_ip: String,
        rank_port: u16,
    }
    match serde_json::from_slice::<Put>(&body) {
        Ok(p) if p.role == "Prefill" => match p.rank_ip.parse::<IpAddr>() {
            Ok(ip) => {
                *addr.lock().expect("route lock") = SocketAddr::new(ip, p.rank_port);
                (StatusCode::OK, "OK").into_response()
            }
            Err(_) => (StatusCode::BAD_REQUEST, "bad rank_ip").into_response(),
        },
        Ok(_) => (StatusCode::OK, "OK").into_response(),
        Err(e) => (StatusCode::BAD_REQUEST, format!("bad registration: {e}")).into_response(),
    }
}

async fn server_info(
    State(w): State<Shared>,
    axum::Extension(bp): axum::Extension<Arc<BootstrapPort>>,
) -> Response {
    let mut v = w.server_info(bp.0);
    v["port"] = bp.1.into();
    axum::Json(v).into_response()
}

async fn model_info(State(w): State<Shared>) -> Response {
    axum::Json(serde_json::json!({
        "model_path": w.args.model_path,
        "tokenizer_path": w.args.model_path,
        "is_generation": true,
        "preferred_sampling_params": null,
        "weight_version": "default",
        "has_image_understanding": false,
        "has_audio_understanding": false,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
    }))
    .into_response()
}

async fn models(State(w): State<Shared>) -> Response {
    axum::Json(serde_json::json!({
        "object": "list",
        "data": [{"id": w.args.model_path, "object": "model", "owned_by": "sglang", "root": w.args.model_path,
                  "max_model_len": w.args.context_length}],
    }))
    .into_response()
}

async fn sim_stats(State(w): State<Shared>) -> Response {
    let l = &w.link_stats;
    axum::Json(serde_json::json!({
        "role": w.role.as_str(),
        "worker": &w.stats,
        "inflight": w.inflight.load(Ordering::Relaxed),
        "pending_rooms": w.pending.lock().map(|p| p.len()).unwrap_or(0),
        "kv_link": {
            "messages_sent": l.messages_sent.load(Ordering::Relaxed),
            "messages_lost": l.messages_lost.load(Ordering::Relaxed),
            "connect_failures": l.connect_failures.load(Ordering::Relaxed),
            "messages_received": l.messages_received.load(Ordering::Relaxed),
            "bad_connections": l.bad_connections.load(Ordering::Relaxed),
        },
        "otlp": &*w.spans.stats,
    }))
    .into_response()
}

#[derive(Deserialize)]
struct RoomsQuery {
    room: Option<u64>,
}

async fn sim_rooms(State(w): State<Shared>, Query(q): Query<RoomsQuery>) -> Response {
    let log = w.rooms.lock().expect("rooms lock");
    let recs: Vec<&RoomRecord> = match q.room {
        Some(r) => log.map.get(&r).into_iter().collect(),
        None => log.order.iter().filter_map(|r| log.map.get(r)).collect(),
    };
    axum::Json(recs).into_response()
}

async fn generate(
    State(w): State<Shared>,
    conn: Option<axum::Extension<ClientConn>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    serve(w, Api::Generate, conn.map(|c| c.0), headers, body).await
}

async fn chat(
    State(w): State<Shared>,
    conn: Option<axum::Extension<ClientConn>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    serve(w, Api::Chat, conn.map(|c| c.0), headers, body).await
}

async fn serve(
    w: Shared,
    api: Api,
    conn: Option<ClientConn>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let t0 = now_ns();
    w.stats.requests.fetch_add(1, Ordering::Relaxed);
    let p = match parse_body(api, &body) {
        Ok(p) => p,
        Err(msg) => {
            w.stats.bad_requests.fetch_add(1, Ordering::Relaxed);
            return error_response(StatusCode::BAD_REQUEST, &msg);
        }
    };
    drop(body);
    let rid = p.rid.clone().unwrap_or_else(new_rid);
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let tp = headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(TraceParent::parse);
    let mut trace = ReqTrace::new(w.spans.enabled(), tp);
    trace.input_tokens = p.input_tokens;
    match w.role {
        Role::Prefill => prefill(w, p, rid, request_id, trace, t0).await,
        Role::Decode => decode(w, p, rid, request_id, conn, trace, t0).await,
    }
}

async fn prefill(
    w: Shared,
    p: Parsed,
    rid: String,
    request_id: Option<String>,
    mut trace: ReqTrace,
    t0: u64,
) -> Response {
    let t_tok = now_ns();
    if let Some((status, msg, scheduler_stage)) = w.check(&p, &rid) {
        let t_end = now_ns();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            w.stats.rejected_503.fetch_add(1, Ordering::Relaxed);
        } else {
            w.stats.rejected_400.fetch_add(1, Ordering::Relaxed);
        }
        if scheduler_stage {
            let th = trace.thread(&w, false, t0, t_tok, None);
            trace.stage(th, "tokenize", t0, t_tok);
            trace.stage(th, "api_server_dispatch", t_tok, t_tok);
            let th = trace.thread(&w, true, t_tok, t_end, Some(&msg));
            trace.stage(th, "prefill_prepare", t_tok, t_end);
        } else {
            let th = trace.thread(&w, false, t0, t_end, Some(&msg));
            trace.stage(th, "tokenize", t0, t_tok);
        }
        let late = (w.args.transfer_after_reject && p.room.is_some()).then_some(LateTrace {
            trace_id: trace.trace_id,
            root: trace.root,
        });
        trace.finish(&w, &rid, p.room, t0, t_end);
        if let Some(room) = p.room {
            w.record(room, |r| {
                r.rid = rid.clone();
                r.request_id = request_id.clone();
                r.status = status.as_u16();
                r.input_tokens = p.input_tokens;
                r.outcome = "rejected";
                r.received_ns = t0;
                r.answered_ns = t_end;
                r.ended_ns = t_end;
            });
            if let Some(late) = late {
                w.meet_request(room, p.input_tokens, None, Some(late));
            }
        }
        return error_response(status, &msg);
    }
    w.stats.admitted.fetch_add(1, Ordering::Relaxed);
    w.inflight.fetch_add(1, Ordering::Relaxed);
    let t_admit = now_ns();
    if let Some(room) = p.room {
        w.record(room, |r| {
            r.rid = rid.clone();
            r.request_id = request_id.clone();
            r.status = 200;
            r.input_tokens = p.input_tokens;
            r.received_ns = t0;
            r.answered_ns = t_admit;
        });
    }
    // Status line now, body when the transfer is over (see module docs).
    let stream = p.stream;
    let w2 = w.clone();
    let fut = async move {
        let w = w2;
        let _inflight = InflightGuard(&w.inflight);
        let mut guard = PendingGuard {
            w: &w,
            room: p.room,
            armed: true,
        };
        if w.args.prefill_delay_us > 0 {
            tokio::time::sleep(Duration::from_micros(w.args.prefill_delay_us)).await;
        }
        let t_fwd = now_ns();
        let mut err: Option<String> = None;
        let mut xfer = None;
        if let Some(room) = p.room {
            let (tx, rx) = oneshot::channel();
            w.meet_request(room, p.input_tokens, Some(tx), None);
            match tokio::time::timeout(Duration::from_millis(w.args.bootstrap_timeout_ms), rx).await
            {
                Ok(Ok(x)) => xfer = Some(x),
                Ok(Err(_)) => {
                    w.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                    err = Some(format!(
                        "Request {rid} aborted: decode aborted the transfer for bootstrap_room={room}"
                    ));
                    w.record(room, |r| r.outcome = "aborted");
                }
                Err(_) => {
                    w.stats.bootstrap_timeouts.fetch_add(1, Ordering::Relaxed);
                    err = Some(format!(
                        "Request {rid} timed out waiting for decode bootstrap (bootstrap_room={room}, {} ms)",
                        w.args.bootstrap_timeout_ms
                    ));
                    w.record(room, |r| r.outcome = "bootstrap-timeout");
                }
            }
            if xfer.is_some() {
                w.record(room, |r| r.outcome = "transferred");
            }
        }
        guard.armed = false;
        let t_end = now_ns();
        if let Some(room) = p.room {
            w.record(room, |r| r.ended_ns = t_end);
        }
        let th = trace.thread(&w, false, t0, t_tok, None);
        trace.stage(th, "tokenize", t0, t_tok);
        trace.stage(th, "api_server_dispatch", t_tok, t_tok);
        let th = trace.thread(&w, true, t_tok, t_end, err.as_deref());
        trace.stage(th, "prefill_prepare", t_tok, t_admit);
        trace.stage(th, "prefill_forward", t_admit, t_fwd);
        if let Some(x) = &xfer {
            trace.stage(th, "prefill_transfer_kv_cache", x.start_ns, x.end_ns);
        }
        trace.finish(&w, &rid, p.room, t0, t_end);
        w.stats.completed.fetch_add(1, Ordering::Relaxed);
        let secs = (t_end - t0) as f64 / 1e9;
        Ok::<Bytes, Infallible>(render_final(
            &p,
            &rid,
            &w.args.model_path,
            "",
            1,
            err.as_deref(),
            secs,
        ))
    };
    let ct = if stream {
        "text/event-stream"
    } else {
        "application/json"
    };
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", ct)
        .body(Body::from_stream(futures_util::stream::once(fut)))
        .expect("static response parts")
}

/// Removes a room's pending entry if the request goes away before its transfer finished
/// (router cancelled the prefill leg).
struct PendingGuard<'a> {
    w: &'a Worker,
    room: Option<u64>,
    armed: bool,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        if self.armed
            && let Some(room) = self.room
        {
            self.w.stats.cancelled.fetch_add(1, Ordering::Relaxed);
            if let Ok(mut p) = self.w.pending.lock() {
                p.remove(&room);
            }
            let now = now_ns();
            self.w.record(room, |r| {
                r.outcome = "cancelled";
                r.ended_ns = now;
            });
        }
    }
}

/// Sends `ABORT room` to prefill if the decode request goes away before its KV arrived, as
/// SGLang's decode does when a request is aborted during bootstrap.
struct DecodeGuard {
    w: Shared,
    room: u64,
    prefill: Option<SocketAddr>,
    conn: Option<ClientConn>,
    armed: bool,
}

impl Drop for DecodeGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.w
            .waiters
            .lock()
            .expect("waiters lock")
            .remove(&self.room);
        self.w.stats.cancelled.fetch_add(1, Ordering::Relaxed);
        let now = now_ns();
        let gone = self.conn.as_ref().and_then(ClientConn::gone_ns);
        self.w.record(self.room, |r| {
            r.outcome = "cancelled";
            r.ended_ns = now;
            r.client_gone_ns = gone.unwrap_or(0);
        });
        if let Some(to) = self.prefill {
            let w = self.w.clone();
            let room = self.room;
            tokio::spawn(async move {
                let room_s = room.to_string();
                w.pushers
                    .send(to, &[&b"ABORT"[..], room_s.as_bytes()])
                    .await;
            });
        }
    }
}

impl Worker {
    /// Record how a decode request ended: `outcome`, or `cancel-ignored` (with `outcome` as
    /// `final_outcome`) when its client had gone and it went on (`--decode-ignores-cancel`).
    fn end_decode(
        &self,
        room: u64,
        conn: Option<&ClientConn>,
        outcome: &'static str,
        f: impl FnOnce(&mut RoomRecord),
    ) {
        let now = now_ns();
        let gone = conn.and_then(ClientConn::gone_ns);
        let ignored = gone.is_some() && self.args.decode_ignores_cancel;
        if ignored {
            self.stats.cancels_ignored.fetch_add(1, Ordering::Relaxed);
        }
        self.record(room, |r| {
            f(r);
            r.ended_ns = now;
            if r.answered_ns == 0 {
                r.answered_ns = now;
            }
            if let Some(g) = gone {
                r.client_gone_ns = g;
            }
            if ignored {
                r.outcome = "cancel-ignored";
                r.final_outcome = Some(outcome);
            } else {
                r.outcome = outcome;
            }
        });
    }
}

async fn decode(
    w: Shared,
    p: Parsed,
    rid: String,
    request_id: Option<String>,
    conn: Option<ClientConn>,
    mut trace: ReqTrace,
    t0: u64,
) -> Response {
    let t_tok = now_ns();
    if let Some((status, msg, _)) = w.check(&p, &rid) {
        let t_end = now_ns();
        w.stats.rejected_400.fetch_add(1, Ordering::Relaxed);
        let th = trace.thread(&w, false, t0, t_end, Some(&msg));
        trace.stage(th, "tokenize", t0, t_tok);
        trace.finish(&w, &rid, p.room, t0, t_end);
        if let Some(room) = p.room {
            w.record(room, |r| r.received_ns = t0);
            w.end_decode(room, conn.as_ref(), "rejected", |r| {
                r.rid = rid.clone();
                r.request_id = request_id.clone();
                r.status = status.as_u16();
                r.input_tokens = p.input_tokens;
            });
        }
        return error_response(status, &msg);
    }
    w.stats.admitted.fetch_add(1, Ordering::Relaxed);
    let _inflight = {
        w.inflight.fetch_add(1, Ordering::Relaxed);
        InflightGuard(&w.inflight)
    };
    let t_sched = now_ns();
    let mut t_boot = t_sched;
    let mut t_kv = t_sched;
    let mut err: Option<(StatusCode, String)> = None;
    let mut guard = None;
    if let Some(room) = p.room {
        w.record(room, |r| {
            r.rid = rid.clone();
            r.request_id = request_id.clone();
            r.input_tokens = p.input_tokens;
            r.received_ns = t0;
        });
        let (tx, rx) = oneshot::channel();
        w.waiters
            .lock()
            .expect("waiters lock")
            .insert(room, DecodeWaiter { done: tx });
        let mut g = DecodeGuard {
            w: w.clone(),
            room,
            prefill: None,
            conn: conn.clone(),
            armed: true,
        };
        if w.args.bootstrap_delay_us > 0 {
            tokio::time::sleep(Duration::from_micros(w.args.bootstrap_delay_us)).await;
        }
        let endpoint = match &p.bootstrap {
            Some((host, port)) => w.prefill_endpoint(host, *port).await,
            None => Err("request has bootstrap_room but no bootstrap_host/bootstrap_port".into()),
        };
        match endpoint {
            Err(e) => {
                w.stats.route_failures.fetch_add(1, Ordering::Relaxed);
                g.armed = false;
                w.waiters.lock().expect("waiters lock").remove(&room);
                err = Some((
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!(
                        "Failed to get bootstrap info for request rid={rid} bootstrap_room={room}: {e}"
                    ),
                ));
            }
            Ok(to) => {
                g.prefill = Some(to);
                let kv = w.kv_addr.lock().expect("kv addr").expect("bound at start");
                let (room_s, ip_s, port_s) =
                    (room.to_string(), kv.ip().to_string(), kv.port().to_string());
                w.pushers
                    .send(
                        to,
                        &[
                            &b"BOOTSTRAP"[..],
                            room_s.as_bytes(),
                            ip_s.as_bytes(),
                            port_s.as_bytes(),
                        ],
                    )
                    .await;
                let now = now_ns();
                w.record(room, |r| {
                    r.bootstrap_frames += 1;
                    if r.bootstrap_ns == 0 {
                        r.bootstrap_ns = now;
                    }
                });
                t_boot = now_ns();
                match tokio::time::timeout(Duration::from_millis(w.args.kv_timeout_ms), rx).await {
                    Ok(Ok(())) => {
                        g.armed = false;
                        t_kv = now_ns();
                    }
                    _ => {
                        w.stats.kv_timeouts.fetch_add(1, Ordering::Relaxed);
                        err = Some((
                            StatusCode::INTERNAL_SERVER_ERROR,
                            format!(
                                "Decode transfer failed for request rank=0 rid={rid} bootstrap_room={room} with exception KVTransferError: timed out waiting for KV cache after {} ms",
                                w.args.kv_timeout_ms
                            ),
                        ));
                    }
                }
            }
        }
        guard = Some(g);
    }
    if let Some((status, msg)) = err {
        // A KV timeout is a local failure, not a cancel: like SGLang's decode, no ABORT goes
        // to prefill (its pending entry for the room expires on its own).
        if let Some(mut g) = guard.take()
            && g.armed
        {
            g.armed = false;
            w.waiters.lock().expect("waiters lock").remove(&g.room);
        }
        let t_end = now_ns();
        let th = trace.thread(&w, false, t0, t_tok, None);
        trace.stage(th, "tokenize", t0, t_tok);
        trace.stage(th, "api_server_dispatch", t_tok, t_tok);
        let th = trace.thread(&w, true, t_sched, t_end, Some(&msg));
        trace.stage(th, "decode_bootstrap", t_sched, t_boot);
        trace.finish(&w, &rid, p.room, t0, t_end);
        if let Some(room) = p.room {
            let outcome = if status == StatusCode::INTERNAL_SERVER_ERROR {
                "kv-failed"
            } else {
                "failed"
            };
            w.end_decode(room, conn.as_ref(), outcome, |r| r.status = status.as_u16());
        }
        return error_response(status, &msg);
    }
    drop(guard);
    let n = p
        .max_new_tokens
        .unwrap_or(w.args.default_max_new_tokens)
        .max(1);
    let delay = Duration::from_micros(w.args.decode_token_delay_us);
    let room = p.room;
    if !p.stream {
        if !delay.is_zero() {
            tokio::time::sleep(delay * n as u32).await;
        }
        let t_end = now_ns();
        finish_decode_spans(
            &w, trace, &rid, room, t0, t_tok, t_sched, t_boot, t_kv, t_end,
        );
        if let Some(room) = room {
            w.end_decode(room, conn.as_ref(), "generated", |r| {
                r.status = 200;
                r.generated_tokens = n;
            });
        }
        w.stats.completed.fetch_add(1, Ordering::Relaxed);
        let text = gen_text(n);
        let body = render_final(
            &p,
            &rid,
            &w.args.model_path,
            &text,
            n,
            None,
            (t_end - t0) as f64 / 1e9,
        );
        let ct = if p.api == Api::Generate || !p.stream {
            "application/json"
        } else {
            "text/event-stream"
        };
        return Response::builder()
            .status(200)
            .header("content-type", ct)
            .body(Body::from(body))
            .expect("static");
    }
    // Streaming: one SSE event per token, produced by a task that stops when the client goes
    // (or, with --decode-ignores-cancel, generates every token all the same).
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(16);
    if let Some(room) = room {
        let now = now_ns();
        w.record(room, |r| {
            r.status = 200;
            r.answered_ns = now;
        });
    }
    let w2 = w.clone();
    tokio::spawn(async move {
        let w = w2;
        let ignore = w.args.decode_ignores_cancel;
        let mut text = String::new();
        let mut sent = 0;
        for i in 0..n {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            text.push_str(WORDS[(i as usize) % WORDS.len()]);
            let last = i + 1 == n;
            let ev = render_chunk(
                &p,
                &rid,
                &w.args.model_path,
                &text,
                WORDS[(i as usize) % WORDS.len()],
                i + 1,
                last,
            );
            if tx.send(Ok(ev)).await.is_err() && !ignore {
                break;
            }
            sent = i + 1;
        }
        let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
        let t_end = now_ns();
        finish_decode_spans(
            &w, trace, &rid, room, t0, t_tok, t_sched, t_boot, t_kv, t_end,
        );
        if let Some(room) = room {
            let outcome = if sent == n {
                "generated"
            } else {
                "client-gone"
            };
            w.end_decode(room, conn.as_ref(), outcome, |r| r.generated_tokens = sent);
        }
        w.stats.completed.fetch_add(1, Ordering::Relaxed);
    });
    let stream =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) });
    Response::builder()
        .status(200)
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(Body::from_stream(stream))
        .expect("static response parts")
}

#[allow(clippy::too_many_arguments)]
fn finish_decode_spans(
    w: &Worker,
    mut trace: ReqTrace,
    rid: &str,
    room: Option<u64>,
    t0: u64,
    t_tok: u64,
    t_sched: u64,
    t_boot: u64,
    t_kv: u64,
    t_end: u64,
) {
    let th = trace.thread(w, false, t0, t_tok, None);
    trace.stage(th, "tokenize", t0, t_tok);
    trace.stage(th, "api_server_dispatch", t_tok, t_tok);
    let th = trace.thread(w, true, t_sched, t_end, None);
    if room.is_some() {
        trace.stage(th, "decode_bootstrap", t_sched, t_boot);
        trace.stage(th, "decode_transferred", t_boot, t_kv);
    }
    trace.stage(th, "decode_forward", t_kv, t_end);
    trace.finish(w, rid, room, t0, t_end);
}

/// Completion text is fixed filler: the simulator never echoes the prompt anywhere.
const WORDS: [&str; 8] = [
    " the", " quick", " brown", " fox", " jumps", " over", " lazy", " dogs",
];

fn gen_text(n: u64) -> String {
    (0..n as usize).map(|i| WORDS[i % WORDS.len()]).collect()
}

fn render_final(
    p: &Parsed,
    rid: &str,
    model: &str,
    text: &str,
    completion: u64,
    abort: Option<&str>,
    secs: f64,
) -> Bytes {
    let finish = match abort {
        Some(m) => serde_json::json!({"type": "abort", "message": m}),
        None => serde_json::json!({"type": "length", "length": completion}),
    };
    let v = match p.api {
        Api::Generate => serde_json::json!({
            "text": text,
            "meta_info": {
                "id": rid,
                "finish_reason": finish,
                "prompt_tokens": p.input_tokens,
                "completion_tokens": completion,
                "cached_tokens": 0,
                "e2e_latency": secs,
            },
        }),
        Api::Chat => serde_json::json!({
            "id": rid,
            "object": "chat.completion",
            "created": now_ns() / 1_000_000_000,
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": if abort.is_some() { "abort" } else { "length" }}],
            "usage": {"prompt_tokens": p.input_tokens, "completion_tokens": completion,
                      "total_tokens": p.input_tokens + completion},
        }),
    };
    if p.stream {
        Bytes::from(format!("data: {v}\n\ndata: [DONE]\n\n"))
    } else {
        Bytes::from(v.to_string())
    }
}

fn render_chunk(
    p: &Parsed,
    rid: &str,
    model: &str,
    text: &str,
    delta: &str,
    done: u64,
    last: bool,
) -> Bytes {
    let v = match p.api {
        Api::Generate => serde_json::json!({
            "text": text,
            "meta_info": {
                "id": rid,
                "finish_reason": if last { serde_json::json!({"type": "length", "length": done}) } else { serde_json::Value::Null },
                "prompt_tokens": p.input_tokens,
                "completion_tokens": done,
                "cached_tokens": 0,
            },
            "index": 0,
        }),
        Api::Chat => serde_json::json!({
            "id": rid,
            "object": "chat.completion.chunk",
            "created": now_ns() / 1_000_000_000,
            "model": model,
            "choices": [{"index": 0, "delta": {"content": delta},
                         "finish_reason": if last { serde_json::json!("length") } else { serde_json::Value::Null }}],
        }),
    };
    Bytes::from(format!("data: {v}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_generate_text_and_bootstrap_fields() {
        let b = br#"{"text":"a b c","sampling_params":{"max_new_tokens":4},"stream":false,"bootstrap_host":"127.0.0.1","bootstrap_port":8998,"bootstrap_room":9066467638188682269}"#;
        let p = parse_body(Api::Generate, b).unwrap();
        assert_eq!(p.input_tokens, 3);
        assert_eq!(p.max_new_tokens, Some(4));
        assert_eq!(p.room, Some(9066467638188682269));
        assert_eq!(p.bootstrap, Some(("127.0.0.1".into(), 8998)));
    }

    #[test]
    fn parses_chat_messages() {
        let b = br#"{"model":"m","messages":[{"role":"user","content":"one two"},{"role":"user","content":[{"type":"text","text":"three"}]}],"max_tokens":2}"#;
        let p = parse_body(Api::Chat, b).unwrap();
        assert_eq!(p.input_tokens, 3);
        assert_eq!(p.max_new_tokens, Some(2));
    }

    #[test]
    fn garbage_body_is_an_error_that_does_not_quote_the_prompt() {
        assert!(parse_body(Api::Generate, b"\x00\xff").is_err());
        let Err(msg) = parse_body(
            Api::Generate,
            br#"{"text": "secret words", "stream": "CANARY"}"#,
        ) else {
            panic!("a string stream flag is invalid")
        };
        assert!(!msg.contains("CANARY") && !msg.contains("secret"), "{msg}");
        assert!(parse_body(Api::Generate, b"{}").is_err());
    }
}
