//! vLLM-flavoured prefill and decode workers: flags, counters, the per-request log, the HTTP
//! handlers and the `llm_request` span. See the module docs in `vllm/mod.rs`.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::{Bytes, BytesMut};
use rand::RngExt;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream, UnixDatagram};
use tokio::sync::{OnceCell, mpsc};

use super::api::{self, Api, IssuedParams, Refusal, Usage};
use super::mooncake::{self, Status, XferMetadata, XferResponse};
use super::{KvConnector, VllmArgs};
use super::{ids, metrics, nixl};
use crate::fault::Fault;
use crate::http::{HttpClient, http_client};
use crate::ids::now_ns;
use crate::kvlink::LinkStats;
use crate::serve::{ClientConn, OnClientGone};
use crate::spans::{Exporter, ExporterConfig, SpanSink, SpanSpec, kv_f64, kv_int, kv_str};
use crate::trace_ctx::{TraceParent, random_span_id, random_trace_id};
use crate::worker::{BODY_LIMIT, Role, WorkerArgs};
use crate::zmtp::{self, SocketType};

/// This flavour's default of `--kv-timeout-ms`: how long decode waits for a handshake.
const VLLM_KV_TIMEOUT_MS: u64 = 5000;
/// How many unrecognized notifications `/sim/stats` lists.
const UNRECOGNIZED_KEPT: usize = 1000;

/// Completion text is fixed filler: the simulator never echoes the prompt anywhere.
const WORDS: [&str; 8] = [
    " the", " quick", " brown", " fox", " jumps", " over", " lazy", " dogs",
];

#[derive(Default, Serialize)]
pub struct Stats {
    pub requests: AtomicU64,
    pub admitted: AtomicU64,
    pub rejected_400: AtomicU64,
    pub rejected_503: AtomicU64,
    /// Bodies that do not parse (400 before the engine).
    pub bad_requests: AtomicU64,
    pub completed: AtomicU64,
    /// Requests whose max_tokens was lowered to fit next to the prompt.
    pub clamped: AtomicU64,
    /// Answers carrying `kv_transfer_params` for a remote decode (a KV hold each).
    pub kv_params_issued: AtomicU64,
    /// Requests that came with a remote prefill's valid `kv_transfer_params` (KV read).
    pub remote_prefills: AtomicU64,
    /// Requests whose prompt was computed here.
    pub local_prefills: AtomicU64,
    /// `do_remote_prefill` params missing a field decode needs ("Got invalid
    /// KVTransferParams"): computed here.
    pub invalid_kv_params: AtomicU64,
    /// Side channel: metadata requests answered (prefill) / handshakes done (decode).
    pub handshakes_served: AtomicU64,
    pub handshakes_done: AtomicU64,
    pub handshake_failures: AtomicU64,
    /// Decode: notifications sent; prefill: received.
    pub notifications_sent: AtomicU64,
    pub notifications_received: AtomicU64,
    /// Decode: a notification could not be delivered (`vllm:nixl_num_failed_notifications`).
    pub notifications_failed: AtomicU64,
    /// Prefill: a notification for an id it does not hold.
    pub notifications_after_expiry: AtomicU64,
    /// Prefill: holds freed by a notification.
    pub kv_transfers: AtomicU64,
    pub kv_bytes: AtomicU64,
    /// Prefill: holds dropped at the end of their lease.
    pub kv_expired_reqs: AtomicU64,
    pub kv_failures: AtomicU64,
    pub cancelled: AtomicU64,
    pub cancels_ignored: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub prompt_tokens_local: AtomicU64,
    pub prompt_tokens_external: AtomicU64,
    pub generation_tokens: AtomicU64,
    /// Answers a `--fault` changed.
    pub faults_injected: AtomicU64,
    /// Mooncake decode: `GET /query`s of a bootstrap server, and those that failed.
    pub bootstrap_queries: AtomicU64,
    pub bootstrap_query_failures: AtomicU64,
    /// Mooncake: pull messages received (prefill) / sent (decode), a layout resend included.
    pub pulls: AtomicU64,
    /// Mooncake prefill: answer frames sent.
    pub pull_answers: AtomicU64,
    /// Mooncake: requests a pull did not move (prefill: named in `err_reqs` or an ERROR;
    /// decode: failed loads).
    pub pull_errors: AtomicU64,
    /// Mooncake prefill: LAYOUT_MISS answers.
    pub layout_misses: AtomicU64,
    /// Mooncake prefill: lease heartbeats received.
    pub lease_heartbeats: AtomicU64,
}

/// What a worker remembers about one request (`GET /sim/requests`), keyed by its first
/// engine request id (`cmpl-X-0` / `chatcmpl-X`): stable and the `gen_ai.request.id` of its
/// span. `?id=` also finds a record by its response id or internal id.
#[derive(Clone, Default, Serialize, Debug)]
pub struct RequestRecord {
    /// The (first) engine request id: `cmpl-X-0` / `chatcmpl-X`.
    pub id: String,
    /// The response body's `id`: `cmpl-X` / `chatcmpl-X`.
    pub response_id: String,
    /// Every engine request of a batch (`cmpl-X-i`), when there is more than one.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub engine_ids: Vec<String>,
    /// The internal id of the first engine request (what prefill's params name).
    pub internal_id: String,
    /// X: the `x-request-id` header.
    pub request_id: Option<String>,
    pub api: Option<Api>,
    pub status: u16,
    pub prompt_tokens: u64,
    /// The max_tokens the engine ran with (after clamping).
    pub max_tokens: u64,
    /// The request's own max_tokens, when it named one.
    pub max_tokens_requested: Option<u64>,
    pub clamped: bool,
    /// Prefill: the answer carried `kv_transfer_params` (a hold for a remote decode).
    pub kv_params_issued: bool,
    /// Prefill: the `remote_request_id` its answer named (its own internal id unless a fault
    /// changed it).
    pub answered_remote_request_id: Option<String>,
    /// Prefill, `stale-kv-params`: the engine request whose params this answer carried.
    pub params_of: Option<String>,
    /// The fault that changed this request, as the fault's outcome name.
    pub fault: Option<&'static str>,
    /// Prefill: decode notifications received for this request's internal id.
    pub notifications: u32,
    /// Decode: the params' `remote_engine_id` / `remote_request_id` (whose KV it read).
    pub remote_engine_id: Option<String>,
    pub remote_request_id: Option<String>,
    /// Decode: `do_remote_prefill` params lacking a field: computed locally.
    pub invalid_kv_params: bool,
    /// Decode: this request made the (first) handshake with its remote engine.
    pub handshake: bool,
    /// Decode: the remote blocks were read and prefill notified.
    pub kv_read: bool,
    /// Mooncake: the router's transfer id (in both legs' params).
    pub transfer_id: Option<String>,
    /// Mooncake prefill: the decode request id (decode's internal id) a pull named for it.
    pub pull_request_id: Option<String>,
    /// Mooncake: the `status` of the answer that settled this request's pull (FINISH,
    /// CONTINUE, ERROR, LAYOUT_MISS).
    pub pull_status: Option<&'static str>,
    /// Mooncake: the pull moved the KV (the answer's `ok_reqs` named it).
    pub pull_ok: Option<bool>,
    /// Mooncake: why the pull failed (the answer's `err_msg`, or decode's own reason).
    pub pull_err_msg: Option<String>,
    /// Mooncake: pull messages for this request (a LAYOUT_MISS resend counts).
    pub pulls: u32,
    pub generated_tokens: u64,
    /// pending / rejected / held / transferred / lease-expired (prefill's KV) / generated /
    /// kv-failed / cancelled / client-gone / cancel-ignored.
    pub outcome: &'static str,
    pub final_outcome: Option<&'static str>,
    /// Unix ns, 0 = did not happen. `received_ns`: the HTTP request arrived.
    pub received_ns: u64,
    /// Decode: the read began; prefill: the first notification arrived.
    pub read_ns: u64,
    /// Decode: the read ended (notification sent); prefill: the hold ended.
    pub kv_done_ns: u64,
    pub answered_ns: u64,
    pub client_gone_ns: u64,
    pub ended_ns: u64,
}

pub(super) struct ReqLog {
    cap: usize,
    map: HashMap<String, RequestRecord>,
    order: VecDeque<String>,
}

/// Blocks held for a remote decode, by internal id (NIXL) or transfer id (mooncake).
struct Hold {
    /// The record it belongs to.
    key: String,
    tokens: u64,
    expires: Instant,
    /// Mooncake: pulls moving it now (it does not expire meanwhile).
    sending: u32,
}

/// Mooncake prefill's `_peer_layout_key` (`mooncake_connector.py:3183-3191`).
type LayoutKey = (String, i64, i64, i64, i64, i64);

/// The Mooncake bootstrap server's registry (`mooncake_utils.py:35-45`): by dp rank, the
/// engine and its workers by tp and pp rank.
#[derive(Default)]
struct Registry {
    workers: BTreeMap<i64, (String, WorkerAddrs)>,
}

/// `{tp_rank: {pp_rank: worker_addr}}` (`EngineEntry.worker_addr`).
type WorkerAddrs = BTreeMap<i64, BTreeMap<i64, String>>;

/// How a decode's Mooncake pull ended.
#[derive(Default)]
struct PullResult {
    ok: bool,
    status: Option<Status>,
    err: Option<String>,
    /// This pull made the bootstrap query.
    queried: bool,
    pulls: u32,
}

pub struct Worker {
    pub(super) role: Role,
    pub(super) a: WorkerArgs,
    pub(super) v: VllmArgs,
    blocks: u64,
    engine_id: String,
    /// The side channel (NIXL) or the Mooncake sender's ROUTER (prefill only).
    side_addr: Option<SocketAddr>,
    pub(super) stats: Stats,
    pub(super) link_stats: Arc<LinkStats>,
    pub(super) started: Instant,
    log: Mutex<ReqLog>,
    holds: Mutex<HashMap<String, Hold>>,
    /// Decode: remote engines met so far, handshaken once each.
    remote_agents: Mutex<HashMap<String, Arc<OnceCell<nixl::RemoteAgent>>>>,
    /// Prefill: the last params answered (`stale-kv-params` hands them to the next request).
    last_issued: Mutex<Option<(String, IssuedParams)>>,
    unrecognized: Mutex<VecDeque<String>>,
    notifier: UnixDatagram,
    /// Mooncake prefill: every transfer id a prefill leg named, to its record.
    transfers: Mutex<HashMap<String, String>>,
    /// Mooncake prefill: transfer ids whose lease ran out, and when (`_expired_transfer_ids`).
    expired: Mutex<HashMap<String, Instant>>,
    /// Mooncake prefill: the decode layouts it holds.
    layouts: Mutex<HashSet<LayoutKey>>,
    /// Mooncake decode: remote engines' sender addresses, from their bootstrap servers.
    mc_agents: Mutex<HashMap<String, String>>,
    mc_query: tokio::sync::Mutex<()>,
    /// Mooncake decode: sender addresses that echoed this worker's `layout_id`.
    acked_peers: Mutex<HashSet<String>>,
    /// Mooncake decode: odd, random per start (`secrets.randbits(63) | 1`).
    layout_id: i64,
    /// Mooncake decode: its transfer engine's RPC port, named in its pulls. Nothing listens
    /// there: the transfer engine is played as a delay on prefill.
    te_port: u16,
    block_cursor: AtomicU64,
    http: HttpClient,
    spans: SpanSink,
    inflight: AtomicU64,
    created: u64,
}

type Shared = Arc<Worker>;

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Worker {
    pub(super) fn record(&self, id: &str, f: impl FnOnce(&mut RequestRecord)) {
        let Ok(mut log) = self.log.lock() else { return };
        if !log.map.contains_key(id) {
            if log.order.len() >= log.cap
                && let Some(old) = log.order.pop_front()
                && let Some(t) = log.map.remove(&old).and_then(|r| r.transfer_id)
                && let Ok(mut tr) = self.transfers.lock()
            {
                tr.remove(&t);
            }
            log.order.push_back(id.to_owned());
            log.map.insert(
                id.to_owned(),
                RequestRecord {
                    id: id.to_owned(),
                    outcome: "pending",
                    ..Default::default()
                },
            );
        }
        if let Some(r) = log.map.get_mut(id) {
            f(r);
        }
    }

    /// The params prefill answers with (`nixl/pull_scheduler.py:281-296`).
    fn issued_params(&self, internal_id: &str, prompt_tokens: u64) -> IssuedParams {
        let blocks = prompt_tokens.div_ceil(self.v.block_size.max(1)).max(1);
        IssuedParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            remote_block_ids: vec![(1..=blocks).collect()],
            remote_engine_id: self.engine_id.clone(),
            remote_request_id: internal_id.to_owned(),
            remote_host: self.a.host.clone(),
            remote_port: self.side_addr.map_or(0, |a| a.port()),
            tp_size: 1,
            dcp_size: 1,
            pp_size: 1,
            remote_num_tokens: prompt_tokens,
            remote_blocks_expiry_time: None,
            remote_registration_generation: 0,
            transfer_mode: "pull",
        }
    }

    /// A decode notification (`nixl/pull_worker.py:728-760`): frees the blocks it names, or is
    /// counted when prefill does not hold them.
    fn on_notification(&self, msg: &str) {
        bump(&self.stats.notifications_received);
        let Some(id) = nixl::parse_notification(msg) else {
            return;
        };
        let hold = self.holds.lock().ok().and_then(|mut h| h.remove(id));
        let now = now_ns();
        match hold {
            Some(h) => {
                bump(&self.stats.kv_transfers);
                self.stats
                    .kv_bytes
                    .fetch_add(h.tokens * self.a.kv_bytes_per_token, Ordering::Relaxed);
                self.record(&h.key, |r| {
                    r.notifications += 1;
                    if r.read_ns == 0 {
                        r.read_ns = now;
                    }
                    r.kv_done_ns = now;
                    r.outcome = "transferred";
                });
            }
            None => {
                bump(&self.stats.notifications_after_expiry);
                tracing::error!(
                    "Potentially invalid KV blocks for unrecognized request {id} were retrieved by a decode worker. They may have expired."
                );
                if let Ok(mut u) = self.unrecognized.lock() {
                    if u.len() >= UNRECOGNIZED_KEPT {
                        u.pop_front();
                    }
                    u.push_back(id.to_owned());
                }
            }
        }
    }

    /// Decode: the remote engine's agent, handshaken on first use (failures are not cached,
    /// as vLLM retries the handshake with the next request). `Ok(true)` when this call made
    /// the handshake.
    async fn remote_agent(
        &self,
        engine: &str,
        host: &str,
        port: u16,
    ) -> Result<bool, nixl::HandshakeError> {
        let cell = {
            let mut m = self.remote_agents.lock().expect("agents lock");
            m.entry(engine.to_owned()).or_default().clone()
        };
        let mut made = false;
        let timeout = self.a.kv_timeout_ms.unwrap_or(VLLM_KV_TIMEOUT_MS);
        cell.get_or_try_init(|| async {
            made = true;
            let r = nixl::handshake(host, port, engine, timeout).await;
            match &r {
                Ok(_) => bump(&self.stats.handshakes_done),
                Err(_) => bump(&self.stats.handshake_failures),
            }
            r
        })
        .await?;
        Ok(made)
    }

    /// Decode → prefill: `"<id>:1"` to the engine's notification endpoint. NIXL delivers its
    /// notifications; the endpoint's datagram queue holds only a few (`net.unix.max_dgram_qlen`),
    /// so a full one is waited on (up to the KV timeout), not counted as lost.
    async fn notify(&self, engine: &str, remote_request_id: &str) -> bool {
        let path = nixl::notify_path(&self.v.notify_dir(), engine);
        let msg = nixl::notification(remote_request_id, 1);
        let timeout = Duration::from_millis(self.a.kv_timeout_ms.unwrap_or(VLLM_KV_TIMEOUT_MS));
        match tokio::time::timeout(timeout, self.notifier.send_to(msg.as_bytes(), &path)).await {
            Ok(Ok(_)) => {
                bump(&self.stats.notifications_sent);
                true
            }
            Ok(Err(e)) => {
                bump(&self.stats.notifications_failed);
                tracing::warn!(error = %e, engine, "NIXL notification failed");
                false
            }
            Err(_) => {
                bump(&self.stats.notifications_failed);
                tracing::warn!(
                    engine,
                    "NIXL notification timed out: the endpoint's queue stayed full"
                );
                false
            }
        }
    }
}

/// A request between admission and its end. Dropped before [`Live::finish`] (the client went
/// away and the handler or the stream was dropped): outcome `cancelled`; a decode still
/// waiting for remote blocks notifies prefill so it frees them (an aborted `do_remote_prefill`
/// request queues an empty read: `nixl/pull_scheduler.py:222-233`).
struct Live {
    w: Shared,
    id: String,
    conn: Option<ClientConn>,
    /// The remote engine and the id of the blocks, while they are being read.
    pulling: Option<(String, String)>,
    done: bool,
}

impl Live {
    /// Record how the request ended: `outcome`, or `cancel-ignored` (with `outcome` as
    /// `final_outcome`) when its client had gone and it went on (`--decode-ignores-cancel`).
    fn finish(&mut self, outcome: &'static str, f: impl FnOnce(&mut RequestRecord)) {
        self.done = true;
        let now = now_ns();
        let gone = self.conn.as_ref().and_then(ClientConn::gone_ns);
        let ignored = gone.is_some() && self.w.a.decode_ignores_cancel;
        if ignored {
            bump(&self.w.stats.cancels_ignored);
        }
        self.w.record(&self.id, |r| {
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
            } else if !matches!(r.outcome, "held" | "transferred" | "lease-expired") {
                // A prefill's outcome says where its held KV went; it stays.
                r.outcome = outcome;
            }
        });
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        self.w.inflight.fetch_sub(1, Ordering::Relaxed);
        if self.done {
            return;
        }
        bump(&self.w.stats.cancelled);
        let now = now_ns();
        let gone = self.conn.as_ref().and_then(ClientConn::gone_ns);
        if let Some((engine, rid)) = self.pulling.take()
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            // Released blocks are notified as a read would be; the send may wait, and a drop
            // cannot, so it goes on without this request.
            let (w, id) = (self.w.clone(), self.id.clone());
            rt.spawn(async move {
                if w.notify(&engine, &rid).await {
                    let now = now_ns();
                    w.record(&id, |r| r.kv_done_ns = now);
                }
            });
        }
        self.w.record(&self.id, |r| {
            r.outcome = "cancelled";
            r.ended_ns = now;
            r.client_gone_ns = gone.unwrap_or(0);
        });
    }
}

/// Times of one request, for its span (Unix ns).
struct Times {
    received: u64,
    scheduled: u64,
    first_token: u64,
    end: u64,
}

/// What a request's span says about it besides its times and completion.
struct SpanFacts {
    tp: Option<TraceParent>,
    /// One per engine request: its id and prompt tokens.
    engine: Vec<(String, u64)>,
    max_tokens: u64,
}

/// vLLM's `llm_request` span (SERVER) per finished engine request, parented on the inbound
/// `traceparent`, attributes as `OutputProcessor.do_tracing` sets them
/// (`v1/engine/output_processor.py:944-1004`): `gen_ai.request.id` is the engine request's
/// external id (`cmpl-X-0`); the sampling defaults top_p and temperature are 1.0.
fn request_spans(w: &Worker, r: &SpanFacts, completion: u64, t: &Times) {
    if !w.spans.enabled() {
        return;
    }
    let s = |a: u64, b: u64| b.saturating_sub(a) as f64 / 1e9;
    let trace_id = r.tp.map(|t| t.trace_id).unwrap_or_else(random_trace_id);
    let spans = r
        .engine
        .iter()
        .map(|(id, prompt)| {
            let mut span = SpanSpec {
                trace_id,
                span_id: random_span_id(),
                parent: r.tp.map(|t| t.span_id),
                name: "llm_request".into(),
                start_ns: t.received,
                end_ns: t.end,
                attributes: vec![
                    kv_f64(
                        "gen_ai.latency.time_to_first_token",
                        s(t.received, t.first_token),
                    ),
                    kv_f64("gen_ai.latency.e2e", s(t.received, t.end)),
                    kv_f64("gen_ai.latency.time_in_queue", s(t.received, t.scheduled)),
                    kv_int("gen_ai.usage.prompt_tokens", *prompt as i64),
                    kv_int("gen_ai.usage.completion_tokens", completion as i64),
                    kv_f64(
                        "gen_ai.latency.time_in_model_prefill",
                        s(t.scheduled, t.first_token),
                    ),
                    kv_f64(
                        "gen_ai.latency.time_in_model_decode",
                        s(t.first_token, t.end),
                    ),
                    kv_f64(
                        "gen_ai.latency.time_in_model_inference",
                        s(t.scheduled, t.end),
                    ),
                    kv_str("gen_ai.request.id", id.clone()),
                    kv_f64("gen_ai.request.top_p", 1.0),
                    kv_int("gen_ai.request.max_tokens", r.max_tokens as i64),
                    kv_f64("gen_ai.request.temperature", 1.0),
                    kv_int("gen_ai.request.n", 1),
                ],
                events: Vec::new(),
                error: None,
            }
            .build();
            span.kind = opentelemetry_proto::tonic::trace::v1::span::SpanKind::Server as i32;
            // vLLM leaves the status unset.
            span.status = None;
            span
        })
        .collect();
    w.spans.emit(spans);
}

/// Which requests a prefill fault hits: decided by X alone, so a rerun hits the same ones.
fn hits(w: &Worker, fault: Fault, x: &str) -> bool {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in x.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    w.a.faults.hits_room(fault, h)
}

/// A remote KV load failed: under `kv_load_failure_policy: fail` (the default) the request
/// ends with an error (a 500, or the error event of a stream).
fn load_failed(w: &Worker, live: &mut Live, stream: bool) -> Response {
    bump(&w.stats.kv_failures);
    live.finish("kv-failed", |r| r.status = if stream { 200 } else { 500 });
    let r = Refusal {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message: api::GENERATION_FAILED.into(),
        param: None,
    };
    if stream {
        let mut body = api::stream_error_event(&r).to_vec();
        body.extend_from_slice(api::DONE);
        return Response::builder()
            .status(200)
            .header("content-type", "text/event-stream; charset=utf-8")
            .body(Body::from(body))
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    }
    api::error(w.v.error_shape, &r)
}

fn json_ok(body: Bytes) -> Response {
    Response::builder()
        .status(200)
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

async fn serve_request(
    w: Shared,
    api: Api,
    conn: Option<ClientConn>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let t0 = now_ns();
    bump(&w.stats.requests);
    let shape = w.v.error_shape;
    let p = match api::parse(api, &body) {
        Ok(p) => p,
        Err(e) => {
            bump(&w.stats.bad_requests);
            return api::error(shape, &Refusal::bad_request(e.to_string(), None));
        }
    };
    drop(body);
    let header_id = headers.get("x-request-id").and_then(|v| v.to_str().ok());
    let names = ids::names(api, header_id, p.prompts.len());
    let request_id = header_id.map(str::to_owned);
    let randomize = !w.v.disable_request_id_randomization;
    let internal: Vec<String> = names
        .engine_ids
        .iter()
        .map(|e| ids::internal_id(e, randomize))
        .collect();
    let key = names.engine_ids[0].clone();
    let tp = headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(TraceParent::parse);
    let checked = api::check_length(&p, w.v.max_model_len, shape, w.a.default_max_new_tokens);
    let max_tokens = checked.as_ref().copied().unwrap_or(0);
    let mooncake = w.v.kv_connector == KvConnector::Mooncake;
    let transfer_id =
        p.kv.as_ref()
            .and_then(|k| k.transfer_id.clone())
            .filter(|_| mooncake);
    let base = |r: &mut RequestRecord| {
        r.transfer_id = transfer_id.clone();
        r.response_id = names.response_id.clone();
        if names.engine_ids.len() > 1 {
            r.engine_ids = names.engine_ids.clone();
        }
        r.internal_id = internal[0].clone();
        r.request_id = request_id.clone();
        r.api = Some(api);
        r.prompt_tokens = p.prompt_tokens;
        r.max_tokens = max_tokens;
        r.max_tokens_requested = p.max_tokens;
        r.received_ns = t0;
    };
    // A pull for this transfer finds its record, even for a request refused below.
    if let Some(t) = &transfer_id
        && p.kv.as_ref().is_some_and(|k| k.do_remote_decode)
    {
        w.record(&key, |r| base(r));
        if let Ok(mut tr) = w.transfers.lock() {
            tr.insert(t.clone(), key.clone());
        }
    }
    // The length rules run in the API server, before the engine: no engine request, no
    // span, no params.
    if let Err(refusal) = checked {
        bump(&w.stats.rejected_400);
        let now = now_ns();
        w.record(&key, |r| {
            base(r);
            r.status = 400;
            r.outcome = "rejected";
            r.answered_ns = now;
            r.ended_ns = now;
        });
        return api::error(shape, &refusal);
    }
    let clamped = p.max_tokens.is_some_and(|m| m > max_tokens);
    if clamped {
        bump(&w.stats.clamped);
    }
    let queued = w.inflight.load(Ordering::Relaxed);
    let a = &w.a;
    if a.max_queued_requests.is_some_and(|m| queued >= m)
        || (a.overload_share > 0.0 && rand::rng().random::<f64>() < a.overload_share)
    {
        bump(&w.stats.rejected_503);
        let now = now_ns();
        w.record(&key, |r| {
            base(r);
            r.status = 503;
            r.outcome = "rejected";
            r.answered_ns = now;
            r.ended_ns = now;
        });
        let r = Refusal {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: api::OVERLOADED.into(),
            param: None,
        };
        return api::error(shape, &r);
    }
    bump(&w.stats.admitted);
    w.inflight.fetch_add(1, Ordering::Relaxed);
    let remote = p.kv.as_ref().filter(|k| k.do_remote_prefill);
    let pull = remote.filter(|_| !mooncake).and_then(|k| k.pull_target());
    let mc_pull = remote
        .filter(|_| mooncake)
        .and_then(|k| k.mooncake_target());
    if remote.is_some() && pull.is_none() && mc_pull.is_none() {
        bump(&w.stats.invalid_kv_params);
        tracing::warn!(
            request = %key,
            "Got invalid KVTransferParams. This request will not utilize KVTransfer"
        );
    }
    w.record(&key, |r| {
        base(r);
        r.clamped = clamped;
        r.invalid_kv_params = remote.is_some() && pull.is_none() && mc_pull.is_none();
        if let Some((e, rid, _, _)) = pull {
            r.remote_engine_id = Some(e.to_owned());
            r.remote_request_id = Some(rid.to_owned());
        }
        if let Some((e, _, _)) = mc_pull {
            r.remote_engine_id = Some(e.to_owned());
        }
    });
    let mut live = Live {
        w: w.clone(),
        id: key.clone(),
        conn: conn.clone(),
        pulling: None,
        done: false,
    };
    let facts = SpanFacts {
        tp,
        engine: names
            .engine_ids
            .iter()
            .cloned()
            .zip(p.prompts.iter().map(|x| x.tokens))
            .collect(),
        max_tokens,
    };
    let t_sched = now_ns();
    w.stats
        .prompt_tokens
        .fetch_add(p.prompt_tokens, Ordering::Relaxed);
    // The prompt's KV: read from the remote prefill, or computed here.
    if let Some((engine, rid, host, port)) = pull {
        bump(&w.stats.remote_prefills);
        let (engine, rid) = (engine.to_owned(), rid.to_owned());
        live.pulling = Some((engine.clone(), rid.clone()));
        match w.remote_agent(&engine, host, port).await {
            Ok(made) => {
                let now = now_ns();
                w.record(&key, |r| {
                    r.handshake = made;
                    r.read_ns = now;
                });
                if w.v.kv_read_delay_us > 0 {
                    tokio::time::sleep(Duration::from_micros(w.v.kv_read_delay_us)).await;
                }
                live.pulling = None;
                let sent = w.notify(&engine, &rid).await;
                w.stats
                    .prompt_tokens_external
                    .fetch_add(p.prompt_tokens, Ordering::Relaxed);
                let now = now_ns();
                w.record(&key, |r| {
                    r.kv_read = sent;
                    r.kv_done_ns = now;
                });
            }
            Err(e) => {
                live.pulling = None;
                tracing::warn!(request = %key, error = %e, "NIXL handshake failed");
                return load_failed(&w, &mut live, p.stream);
            }
        }
    } else if let Some((engine, boot, tid)) = mc_pull {
        bump(&w.stats.remote_prefills);
        let now = now_ns();
        w.record(&key, |r| r.read_ns = now);
        let blocks = p.prompt_tokens.div_ceil(w.v.block_size.max(1)).max(1);
        let res = w
            .mooncake_pull(&internal[0], engine, boot, tid, blocks)
            .await;
        let now = now_ns();
        w.record(&key, |r| {
            r.handshake = res.queried;
            r.pulls += res.pulls;
            r.pull_status = res.status.map(Status::name);
            r.pull_ok = Some(res.ok);
            r.pull_err_msg = res.err.clone();
            r.kv_read = res.ok;
            r.kv_done_ns = now;
        });
        if !res.ok {
            bump(&w.stats.pull_errors);
            tracing::error!(
                "pulling kv_caches for {:?} failed: {}",
                [&internal[0]],
                res.err.as_deref().unwrap_or("")
            );
            return load_failed(&w, &mut live, p.stream);
        }
        w.stats
            .prompt_tokens_external
            .fetch_add(p.prompt_tokens, Ordering::Relaxed);
    } else {
        bump(&w.stats.local_prefills);
        w.stats
            .prompt_tokens_local
            .fetch_add(p.prompt_tokens, Ordering::Relaxed);
        if w.a.prefill_delay_us > 0 {
            tokio::time::sleep(Duration::from_micros(w.a.prefill_delay_us)).await;
        }
    }
    let t_first = now_ns();
    let n_tokens = max_tokens.max(1);
    // A request computed for a remote decode holds its blocks for the decode's read; the
    // answer carries the first engine request's params (`completion/serving.py:767`).
    let for_remote =
        p.kv.as_ref()
            .is_some_and(|k| k.do_remote_decode && !k.do_remote_prefill);
    let lease = Duration::from_millis(w.v.kv_lease_ms);
    if for_remote && mooncake {
        // Mooncake answers no params (`request_finished` returns None, `:1303-1356`); the
        // blocks wait under the transfer id for decode's pull (`record_send_reqs`,
        // `:3002-3028`).
        match &transfer_id {
            Some(t) => {
                if let Ok(mut h) = w.holds.lock() {
                    h.insert(
                        t.clone(),
                        Hold {
                            key: key.clone(),
                            tokens: p.prompt_tokens,
                            expires: Instant::now() + lease,
                            sending: 0,
                        },
                    );
                }
                bump(&w.stats.kv_params_issued);
                w.record(&key, |r| r.outcome = "held");
            }
            None => tracing::warn!("Missing transfer_id in kv_transfer_params from router!"),
        }
    }
    let issued = (for_remote && !mooncake).then(|| {
        let own = w.issued_params(&internal[0], p.prompts[0].tokens);
        if let Ok(mut h) = w.holds.lock() {
            for (int, prompt) in internal.iter().zip(&p.prompts) {
                h.insert(
                    int.clone(),
                    Hold {
                        key: key.clone(),
                        tokens: prompt.tokens,
                        expires: Instant::now() + lease,
                        sending: 0,
                    },
                );
            }
        }
        bump(&w.stats.kv_params_issued);
        let previous = w
            .last_issued
            .lock()
            .ok()
            .and_then(|mut l| l.replace((key.clone(), own.clone())));
        let x = &names.x;
        let (answer, fault, params_of) = match previous {
            Some((of, prev)) if hits(&w, Fault::StaleKvParams, x) => {
                (prev, Some(Fault::StaleKvParams), Some(of))
            }
            _ if hits(&w, Fault::ForgedKvParams, x) => {
                let mut forged = own.clone();
                forged.remote_request_id = format!("cmpl-forged-{}", ids::random_uuid());
                (forged, Some(Fault::ForgedKvParams), None)
            }
            _ => (own, None, None),
        };
        if fault.is_some() {
            bump(&w.stats.faults_injected);
        }
        w.record(&key, |r| {
            r.kv_params_issued = true;
            r.outcome = "held";
            r.answered_remote_request_id = Some(answer.remote_request_id.clone());
            r.fault = fault.map(Fault::outcome);
            r.params_of = params_of;
        });
        answer
    });
    let delay = Duration::from_micros(w.a.decode_token_delay_us);
    if !p.stream {
        if !delay.is_zero() {
            tokio::time::sleep(delay * n_tokens as u32).await;
        }
        let t_end = now_ns();
        let text: String = (0..n_tokens as usize)
            .map(|i| WORDS[i % WORDS.len()])
            .collect();
        live.finish("generated", |r| {
            r.status = 200;
            r.generated_tokens = n_tokens;
        });
        bump(&w.stats.completed);
        w.stats
            .generation_tokens
            .fetch_add(n_tokens, Ordering::Relaxed);
        request_spans(
            &w,
            &facts,
            n_tokens,
            &Times {
                received: t0,
                scheduled: t_sched,
                first_token: t_first,
                end: t_end,
            },
        );
        return json_ok(api::render_final(
            api,
            &names.response_id,
            &w.a.model_path,
            &text,
            Usage::new(p.prompt_tokens, n_tokens),
            issued.as_ref(),
        ));
    }
    // Streaming: one SSE event per token from a task that stops when the client goes (or,
    // with --decode-ignores-cancel, generates every token all the same).
    let now = now_ns();
    w.record(&key, |r| {
        r.status = 200;
        r.answered_ns = now;
    });
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(16);
    let w2 = w.clone();
    let id = names.response_id.clone();
    tokio::spawn(async move {
        let w = w2;
        let mut live = live;
        let ignore = w.a.decode_ignores_cancel;
        let model = w.a.model_path.clone();
        let mut gone = false;
        if api == Api::Chat
            && tx
                .send(Ok(api::render_role_chunk(&id, &model)))
                .await
                .is_err()
        {
            gone = true;
        }
        let mut sent = 0;
        for i in 0..n_tokens {
            if gone && !ignore {
                break;
            }
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let ev = api::render_token_chunk(
                api,
                &id,
                &model,
                WORDS[(i as usize) % WORDS.len()],
                i + 1 == n_tokens,
                issued.as_ref(),
            );
            if tx.send(Ok(ev)).await.is_err() {
                gone = true;
                if !ignore {
                    break;
                }
            }
            sent = i + 1;
        }
        let usage = Usage::new(p.prompt_tokens, sent);
        let _ = tx
            .send(Ok(api::render_usage_chunk(api, &id, &model, usage)))
            .await;
        let _ = tx.send(Ok(Bytes::from_static(api::DONE))).await;
        let t_end = now_ns();
        let outcome = if sent == n_tokens {
            "generated"
        } else {
            "client-gone"
        };
        live.finish(outcome, |r| r.generated_tokens = sent);
        bump(&w.stats.completed);
        w.stats.generation_tokens.fetch_add(sent, Ordering::Relaxed);
        request_spans(
            &w,
            &facts,
            sent,
            &Times {
                received: t0,
                scheduled: t_sched,
                first_token: t_first,
                end: t_end,
            },
        );
    });
    let stream =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) });
    Response::builder()
        .status(200)
        .header("content-type", "text/event-stream; charset=utf-8")
        .header("cache-control", "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// The Mooncake connector: decode's pull, prefill's answers, the bootstrap server
/// (`mooncake.rs` has the frames).
impl Worker {
    /// Record what a pull settled for `transfer_id` on prefill's record of it.
    fn record_pull(&self, transfer_id: &str, d_req_id: &str, answer: &XferResponse, ok: bool) {
        let key = self
            .transfers
            .lock()
            .ok()
            .and_then(|t| t.get(transfer_id).cloned());
        let Some(key) = key else { return };
        let now = now_ns();
        self.record(&key, |r| {
            r.pull_request_id = Some(d_req_id.to_owned());
            r.pulls += 1;
            r.pull_status = Some(answer.status.name());
            r.pull_ok = Some(ok);
            r.pull_err_msg = answer.err_msg.clone();
            if r.read_ns == 0 {
                r.read_ns = now;
            }
            if ok {
                r.kv_done_ns = now;
                r.outcome = "transferred";
            }
        });
    }

    /// Decode: the sender address of `engine`, from its bootstrap server the first time
    /// (`_query_bootstrap`, `mooncake_connector.py:2909-2915`: one query at a time per
    /// address; a failure is not remembered). `true` when this call queried.
    async fn mc_agent(&self, engine: &str, boot: &str) -> Result<(String, bool), String> {
        let known = |w: &Worker| w.mc_agents.lock().ok()?.get(engine).cloned();
        if let Some(a) = known(self) {
            return Ok((a, false));
        }
        let _one = self.mc_query.lock().await;
        if let Some(a) = known(self) {
            return Ok((a, false));
        }
        bump(&self.stats.bootstrap_queries);
        let url = format!("{boot}/query");
        let mut answer = Err(String::new());
        // Three attempts, 0.1 s apart, on a connection error (`:2810-2846`).
        for attempt in 0..3 {
            match crate::http::get(&self.http, &url, Duration::from_secs(30)).await {
                Ok((s, body)) if s.is_success() => {
                    answer = serde_json::from_slice::<serde_json::Value>(&body)
                        .map_err(|e| e.to_string());
                    break;
                }
                Ok((s, _)) => {
                    answer = Err(format!("HTTP {s}"));
                    break;
                }
                Err(e) => answer = Err(e.to_string()),
            }
            if attempt < 2 {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        let q = answer.map_err(|e| {
            bump(&self.stats.bootstrap_query_failures);
            tracing::error!("Failed to connect to bootstrap server {boot}: {e}");
            format!("remote engine_id {engine} not found from bootstrap server {boot}")
        })?;
        if let (Some(m), Ok(mut agents)) = (q.as_object(), self.mc_agents.lock()) {
            for dp in m.values() {
                if let Some(e) = dp.get("engine_id").and_then(|e| e.as_str())
                    && let Some(a) = mooncake::worker_addr(&q, e)
                {
                    agents.insert(e.to_owned(), a);
                }
            }
        }
        known(self).map(|a| (a, true)).ok_or_else(|| {
            format!("remote engine_id {engine} not found from bootstrap server {boot}")
        })
    }

    /// Decode: one request's pull (`receive_kv_from_single_worker`, `:2653-2734`): a DEALER per
    /// pull, one metadata frame, answers until FINISH; a LAYOUT_MISS resends with the layout.
    async fn mooncake_pull(
        &self,
        d_req_id: &str,
        engine: &str,
        boot: &str,
        transfer_id: &str,
        blocks: u64,
    ) -> PullResult {
        let mut res = PullResult::default();
        let addr = match self.mc_agent(engine, boot).await {
            Ok((a, queried)) => {
                res.queried = queried;
                a
            }
            Err(e) => {
                res.err = Some(e);
                return res;
            }
        };
        let Some((host, port)) = mooncake::parse_tcp_addr(&addr) else {
            res.err = Some(format!("transfer failed: bad worker address {addr}"));
            return res;
        };
        // Decode's own blocks for the prompt, where prefill writes.
        let cap = self.blocks.max(1);
        let first = self.block_cursor.fetch_add(blocks, Ordering::Relaxed) % cap;
        let ids: Vec<i64> = (0..blocks)
            .map(|i| ((first + i) % cap + 1) as i64)
            .collect();
        let timeout = Duration::from_secs(self.v.mooncake_abort_request_timeout_secs + 60);
        let mut include = !self
            .acked_peers
            .lock()
            .map(|a| a.contains(&addr))
            .unwrap_or(false);
        loop {
            let meta = XferMetadata {
                remote_hostname: self.a.host.clone(),
                remote_port: i64::from(self.te_port),
                remote_tp_size: 1,
                remote_tp_rank: 0,
                req_blocks: vec![mooncake::ReqBlocks {
                    decode_request_id: d_req_id.to_owned(),
                    transfer_id: transfer_id.to_owned(),
                    block_ids: vec![ids.clone()],
                }],
                layout: include
                    .then(|| mooncake::Layout::tiny(2, self.v.block_size, 0x7e00_0000_0000)),
                remote_pp_size: 1,
                layout_id: self.layout_id,
            };
            res.pulls += 1;
            bump(&self.stats.pulls);
            let once = async {
                let mut s = TcpStream::connect((host.as_str(), port))
                    .await
                    .map_err(|e| format!("transfer failed: {e}"))?;
                let _ = s.set_nodelay(true);
                zmtp::handshake(&mut s, SocketType::Dealer)
                    .await
                    .map_err(|e| format!("transfer failed: {e}"))?;
                let mut out = BytesMut::new();
                zmtp::encode_message(&mut out, &[&meta.encode()[..]]);
                s.write_all(&out)
                    .await
                    .map_err(|e| format!("transfer failed: {e}"))?;
                let mut answers = Vec::new();
                loop {
                    let parts = zmtp::read_message(&mut s)
                        .await
                        .map_err(|e| format!("transfer failed: {e}"))?
                        .ok_or("transfer failed: the peer closed the socket")?;
                    let [frame] = &parts[..] else {
                        return Err(format!("transfer failed: {} frames", parts.len()));
                    };
                    let a =
                        XferResponse::decode(frame).map_err(|e| format!("transfer failed: {e}"))?;
                    let last = !matches!(a.status, Status::Continue);
                    answers.push(a);
                    if last {
                        return Ok::<_, String>(answers);
                    }
                }
            };
            let answers = match tokio::time::timeout(timeout, once).await {
                Ok(Ok(a)) => a,
                Ok(Err(e)) => {
                    res.err = Some(e);
                    return res;
                }
                Err(_) => {
                    res.err = Some("transfer failed: Resource temporarily unavailable".into());
                    return res;
                }
            };
            for a in answers {
                res.status = Some(a.status);
                match a.status {
                    Status::LayoutMiss => {
                        if let Ok(mut p) = self.acked_peers.lock() {
                            p.remove(&addr);
                        }
                        if !include {
                            tracing::info!(
                                "Mooncake prefill {addr} lost the KV layout; resending it."
                            );
                            include = true;
                            break;
                        }
                        res.err = Some(a.err_msg.unwrap_or_else(|| "transfer error".into()));
                        return res;
                    }
                    Status::Error => {
                        res.err = Some(a.err_msg.unwrap_or_else(|| "transfer error".into()));
                        return res;
                    }
                    Status::Finish | Status::Continue => {}
                }
                if self.layout_id != 0
                    && a.layout_id == self.layout_id
                    && let Ok(mut p) = self.acked_peers.lock()
                {
                    p.insert(addr.clone());
                }
                let named = |l: &Option<Vec<String>>| {
                    l.as_ref().is_some_and(|l| l.iter().any(|x| x == d_req_id))
                };
                if named(&a.err_reqs) {
                    res.err = Some(a.err_msg.unwrap_or_else(|| "unknown error".into()));
                    return res;
                }
                if named(&a.ok_reqs) {
                    res.ok = true;
                    return res;
                }
                if a.status == Status::Finish {
                    res.err = Some(mooncake::UNREPORTED.into());
                    return res;
                }
            }
            if res.status != Some(Status::LayoutMiss) {
                res.err = Some(mooncake::UNREPORTED.into());
                return res;
            }
        }
    }

    /// Prefill: one message on the sender's ROUTER (`_mooncake_sender_listener` and
    /// `send_kv_to_decode`, `:1664-1990`); every answer goes to `out`.
    async fn on_mooncake_message(self: Arc<Self>, msg: Bytes, out: mpsc::UnboundedSender<Vec<u8>>) {
        let send = |a: &XferResponse| {
            bump(&self.stats.pull_answers);
            let _ = out.send(a.encode());
        };
        if let Some(ids) = mooncake::parse_heartbeat(&msg) {
            // `_renew_kv_leases` (`:1718-1731`): a renewal never recreates a transfer.
            bump(&self.stats.lease_heartbeats);
            let until = Instant::now() + Duration::from_millis(self.v.kv_lease_ms * 2 / 3);
            if let Ok(mut h) = self.holds.lock() {
                for id in &ids {
                    if let Some(x) = h.get_mut(id) {
                        x.expires = x.expires.max(until);
                    }
                }
            }
            return send(&XferResponse::new(Status::Finish));
        }
        bump(&self.stats.pulls);
        let meta = match XferMetadata::decode(&msg) {
            Ok(m) => m,
            Err(e) => {
                tracing::error!("Error processing Mooncake xfer request: {e}");
                let mut a = XferResponse::new(Status::Error);
                a.err_msg = Some(e);
                return send(&a);
            }
        };
        let fail_all = |a: &XferResponse| {
            for rb in &meta.req_blocks {
                bump(&self.stats.pull_errors);
                self.record_pull(&rb.transfer_id, &rb.decode_request_id, a, false);
            }
            send(a);
        };
        if meta.remote_tp_rank != 0 {
            let mut a = XferResponse::new(Status::Error);
            a.err_msg = Some(format!(
                "This D tp_rank {} is not paired with P tp_rank 0; expected one of [0].",
                meta.remote_tp_rank
            ));
            return fail_all(&a);
        }
        let lkey: LayoutKey = (
            meta.remote_hostname.clone(),
            meta.remote_port,
            meta.remote_tp_rank,
            meta.remote_pp_size,
            meta.remote_tp_size,
            meta.layout_id,
        );
        if meta.layout_id != 0 {
            let mut known = self.layouts.lock().expect("layouts lock");
            if meta.layout.is_some() {
                known.insert(lkey);
            } else if !known.contains(&lkey) {
                drop(known);
                bump(&self.stats.layout_misses);
                let mut a = XferResponse::new(Status::LayoutMiss);
                a.err_msg = Some(format!(
                    "Mooncake KV layout {:#x} from {}:{} is not cached.",
                    meta.layout_id, meta.remote_hostname, meta.remote_port
                ));
                return fail_all(&a);
            }
        }
        let mut pending = Vec::new();
        let mut expired = Vec::new();
        {
            let holds = self.holds.lock().expect("holds lock");
            let gone = self.expired.lock().expect("expired lock");
            for rb in &meta.req_blocks {
                if !holds.contains_key(&rb.transfer_id) && gone.contains_key(&rb.transfer_id) {
                    expired.push(rb);
                } else {
                    pending.push(rb);
                }
            }
        }
        if !expired.is_empty() {
            let a = XferResponse {
                status: if pending.is_empty() {
                    Status::Finish
                } else {
                    Status::Continue
                },
                ok_reqs: None,
                err_reqs: Some(
                    expired
                        .iter()
                        .map(|r| r.decode_request_id.clone())
                        .collect(),
                ),
                err_msg: Some(mooncake::EXPIRED.into()),
                layout_id: meta.layout_id,
            };
            for rb in &expired {
                bump(&self.stats.pull_errors);
                self.record_pull(&rb.transfer_id, &rb.decode_request_id, &a, false);
            }
            send(&a);
        }
        // Wait for each request to be ready (prefilled and finished), at most the abort
        // timeout; answer as each batch is sent.
        let deadline =
            Instant::now() + Duration::from_secs(self.v.mooncake_abort_request_timeout_secs);
        while !pending.is_empty() {
            let ready: Vec<_> = {
                let mut holds = self.holds.lock().expect("holds lock");
                let (ready, rest): (Vec<_>, Vec<_>) = pending
                    .into_iter()
                    .partition(|rb| holds.contains_key(&rb.transfer_id));
                pending = rest;
                for rb in &ready {
                    if let Some(h) = holds.get_mut(&rb.transfer_id) {
                        h.sending += 1;
                    }
                }
                ready
            };
            if ready.is_empty() {
                if Instant::now() >= deadline {
                    tracing::warn!(
                        "Timeout waiting for P side ready: {:?}",
                        pending
                            .iter()
                            .map(|r| &r.decode_request_id)
                            .collect::<Vec<_>>()
                    );
                    let a = XferResponse {
                        status: Status::Finish,
                        ok_reqs: None,
                        err_reqs: Some(
                            pending
                                .iter()
                                .map(|r| r.decode_request_id.clone())
                                .collect(),
                        ),
                        err_msg: Some(mooncake::NOT_READY.into()),
                        layout_id: meta.layout_id,
                    };
                    for rb in &pending {
                        bump(&self.stats.pull_errors);
                        self.record_pull(&rb.transfer_id, &rb.decode_request_id, &a, false);
                    }
                    return send(&a);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
            // The transfer engine writes the batch into decode's blocks.
            if self.v.kv_read_delay_us > 0 {
                tokio::time::sleep(Duration::from_micros(self.v.kv_read_delay_us)).await;
            }
            let failed = ready
                .iter()
                .any(|rb| hits(&self, Fault::MooncakePullError, &rb.transfer_id));
            let mut done = Vec::new();
            if let Ok(mut holds) = self.holds.lock() {
                for rb in &ready {
                    if failed {
                        // The blocks stay until their lease ends (`sent` never reaches
                        // `need_send`).
                        if let Some(h) = holds.get_mut(&rb.transfer_id) {
                            h.sending = h.sending.saturating_sub(1);
                        }
                    } else if let Some(h) = holds.remove(&rb.transfer_id) {
                        done.push(h.tokens);
                    }
                }
            }
            let ids: Vec<String> = ready.iter().map(|r| r.decode_request_id.clone()).collect();
            let a = XferResponse {
                status: if pending.is_empty() {
                    Status::Finish
                } else {
                    Status::Continue
                },
                ok_reqs: (!failed).then(|| ids.clone()),
                err_reqs: failed.then_some(ids),
                err_msg: failed.then(|| mooncake::ENGINE_FAILED.into()),
                layout_id: meta.layout_id,
            };
            if failed {
                bump(&self.stats.faults_injected);
            }
            for rb in &ready {
                if failed {
                    bump(&self.stats.pull_errors);
                } else {
                    bump(&self.stats.kv_transfers);
                }
                self.record_pull(&rb.transfer_id, &rb.decode_request_id, &a, !failed);
                if failed
                    && let Some(key) = self
                        .transfers
                        .lock()
                        .ok()
                        .and_then(|t| t.get(&rb.transfer_id).cloned())
                {
                    self.record(&key, |r| {
                        r.fault = Some(Fault::MooncakePullError.outcome());
                    });
                }
            }
            for tokens in done {
                self.stats
                    .kv_bytes
                    .fetch_add(tokens * self.a.kv_bytes_per_token, Ordering::Relaxed);
            }
            send(&a);
        }
    }
}

/// Prefill's Mooncake sender ROUTER: each DEALER message (one frame) is handled on its own
/// task, as vLLM's sender tasks do; answers go back on the same connection.
async fn mooncake_serve(listener: TcpListener, w: Shared) {
    loop {
        let Ok((s, _)) = listener.accept().await else {
            continue;
        };
        let _ = s.set_nodelay(true);
        let w = w.clone();
        tokio::spawn(async move {
            let mut s = s;
            let bad = |w: &Worker| {
                w.link_stats.bad_connections.fetch_add(1, Ordering::Relaxed);
            };
            let hs = tokio::time::timeout(
                Duration::from_secs(5),
                zmtp::handshake(&mut s, SocketType::Router),
            )
            .await;
            if !matches!(hs, Ok(Ok(()))) {
                return bad(&w);
            }
            let (mut rd, mut wr) = s.into_split();
            let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
            let link = w.link_stats.clone();
            let writer = tokio::spawn(async move {
                while let Some(frame) = rx.recv().await {
                    let mut out = BytesMut::new();
                    zmtp::encode_message(&mut out, &[&frame[..]]);
                    if wr.write_all(&out).await.is_err() {
                        return;
                    }
                    link.messages_sent.fetch_add(1, Ordering::Relaxed);
                }
            });
            loop {
                let parts = match zmtp::read_message(&mut rd).await {
                    Ok(Some(p)) => p,
                    Ok(None) => break,
                    Err(_) => {
                        bad(&w);
                        break;
                    }
                };
                w.link_stats
                    .messages_received
                    .fetch_add(1, Ordering::Relaxed);
                // A DEALER's message is the payload alone; vLLM reads `identity, metadata`.
                let [msg] = &parts[..] else {
                    tracing::error!(frames = parts.len(), "Error in Mooncake sender thread");
                    continue;
                };
                tokio::spawn(w.clone().on_mooncake_message(msg.clone(), tx.clone()));
            }
            drop(tx);
            let _ = writer.await;
        });
    }
}

/// `POST /register` (`mooncake_utils.py:125-172`).
async fn bs_register(State(reg): State<Arc<Mutex<Registry>>>, body: Bytes) -> Response {
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let (Some(engine), Some(dp), Some(tp), Some(pp), Some(addr)) = (
        v.get("engine_id").and_then(|x| x.as_str()),
        v.get("dp_rank").and_then(|x| x.as_i64()),
        v.get("tp_rank").and_then(|x| x.as_i64()),
        v.get("pp_rank").and_then(|x| x.as_i64()),
        v.get("addr").and_then(|x| x.as_str()),
    ) else {
        return crate::http::json_response(
            StatusCode::UNPROCESSABLE_ENTITY,
            serde_json::json!({"detail": [{"type": "missing", "msg": "Field required"}]})
                .to_string(),
        );
    };
    let detail = |m: String| {
        crate::http::json_response(
            StatusCode::BAD_REQUEST,
            serde_json::json!({ "detail": m }).to_string(),
        )
    };
    let Ok(mut reg) = reg.lock() else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    let entry = reg
        .workers
        .entry(dp)
        .or_insert_with(|| (engine.to_owned(), BTreeMap::new()));
    if entry.0 != engine {
        return detail(format!(
            "Engine ID mismatch for dp_rank={dp}: expected {}, got {engine}",
            entry.0
        ));
    }
    let tp_entry = entry.1.entry(tp).or_default();
    match tp_entry.get(&pp) {
        Some(existing) if existing != addr => {
            return detail(format!(
                "Worker with dp_rank={dp}, tp_rank={tp}, pp_rank={pp} is already registered at {existing}, but still want to register at {addr}"
            ));
        }
        _ => {
            tp_entry.insert(pp, addr.to_owned());
        }
    }
    axum::Json(serde_json::json!({"status": "ok"})).into_response()
}

/// `GET /query`: `dict[int, EngineEntry]` as FastAPI renders it (int keys as strings).
async fn bs_query(State(reg): State<Arc<Mutex<Registry>>>) -> Response {
    let Ok(reg) = reg.lock() else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    let mut m = serde_json::Map::new();
    for (dp, (engine, workers)) in &reg.workers {
        let mut wa = serde_json::Map::new();
        for (tp, pps) in workers {
            let pp: serde_json::Map<String, serde_json::Value> = pps
                .iter()
                .map(|(p, a)| (p.to_string(), a.clone().into()))
                .collect();
            wa.insert(tp.to_string(), pp.into());
        }
        m.insert(
            dp.to_string(),
            serde_json::json!({"engine_id": engine, "worker_addr": wa}),
        );
    }
    axum::Json(serde_json::Value::Object(m)).into_response()
}

/// Prefill's worker registers its sender with the bootstrap server it hosts, over HTTP as
/// vLLM does (`register_worker_with_bootstrap`, `:1614-1662`: three attempts).
async fn register_with_bootstrap(w: &Worker, url: &str, addr: &str) -> anyhow::Result<()> {
    let body = mooncake::register_body(&w.engine_id, addr).to_string();
    let mut last = String::new();
    for attempt in 0..3 {
        let req = hyper::Request::post(url)
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(Bytes::from(body.clone())))?;
        match tokio::time::timeout(Duration::from_secs(30), w.http.request(req)).await {
            Ok(Ok(r)) if r.status().is_success() => return Ok(()),
            Ok(Ok(r)) => anyhow::bail!(
                "registering with the bootstrap server {url}: HTTP {}",
                r.status()
            ),
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = "timed out".into(),
        }
        if attempt < 2 {
            tokio::time::sleep(Duration::from_secs(1 << attempt)).await;
        }
    }
    anyhow::bail!(
        "Failed to register with the Mooncake bootstrap server at {url} after 3 attempts: {last}"
    )
}

macro_rules! handler {
    ($name:ident, $api:expr) => {
        async fn $name(
            State(w): State<Shared>,
            conn: Option<axum::Extension<ClientConn>>,
            headers: HeaderMap,
            body: Bytes,
        ) -> Response {
            serve_request(w, $api, conn.map(|c| c.0), headers, body).await
        }
    };
}
handler!(completions, Api::Completions);
handler!(chat, Api::Chat);
handler!(generate, Api::Generate);

async fn models(State(w): State<Shared>) -> Response {
    axum::Json(api::models(&w.a.model_path, w.v.max_model_len, w.created)).into_response()
}

async fn metrics(State(w): State<Shared>) -> Response {
    let held: u64 = w
        .holds
        .lock()
        .map(|h| h.values().map(|x| x.tokens).sum())
        .unwrap_or(0);
    let capacity = (w.blocks * w.v.block_size).max(1);
    let ld = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let s = &w.stats;
    let text = metrics::render(&metrics::MetricsView {
        model: &w.a.model_path,
        max_model_len: w.v.max_model_len,
        block_size: w.v.block_size,
        num_gpu_blocks: w.blocks,
        running: w.inflight.load(Ordering::Relaxed),
        waiting: 0,
        kv_usage: (held as f64 / capacity as f64).min(1.0),
        prompt_tokens: ld(&s.prompt_tokens),
        prompt_local_compute: ld(&s.prompt_tokens_local),
        prompt_external_kv: ld(&s.prompt_tokens_external),
        generation_tokens: ld(&s.generation_tokens),
        success: ld(&s.completed),
        started_s: w.created as f64,
        nixl: metrics::NixlCounters {
            failed_transfers: ld(&s.handshake_failures) + ld(&s.notifications_failed),
            failed_notifications: ld(&s.notifications_failed),
            kv_expired_reqs: ld(&s.kv_expired_reqs),
            notifications_after_expiry: ld(&s.notifications_after_expiry),
            transfers: ld(&s.kv_transfers),
            bytes: ld(&s.kv_bytes),
        },
    });
    let mut r = text.into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    r
}

async fn sim_stats(State(w): State<Shared>) -> Response {
    let l = &w.link_stats;
    axum::Json(serde_json::json!({
        "role": w.role.as_str(),
        "flavour": "vllm",
        "engine_id": w.engine_id,
        "worker": &w.stats,
        "inflight": w.inflight.load(Ordering::Relaxed),
        "kv_holds": w.holds.lock().map(|h| h.len()).unwrap_or(0),
        "max_model_len": w.v.max_model_len,
        "num_gpu_blocks": w.blocks,
        "block_size": w.v.block_size,
        "error_shape": w.v.error_shape,
        "kv_connector": w.v.kv_connector,
        "expired_transfers": w.expired.lock().map(|e| e.len()).unwrap_or(0),
        "request_id_randomization": !w.v.disable_request_id_randomization,
        "remote_engines": w.remote_agents.lock().map(|m| m.iter().filter(|(_, c)| c.initialized()).map(|(k, _)| k.clone()).collect::<Vec<_>>()).unwrap_or_default(),
        "unrecognized_notifications": w.unrecognized.lock().map(|u| u.iter().cloned().collect::<Vec<_>>()).unwrap_or_default(),
        "side_channel": {
            "messages_sent": l.messages_sent.load(Ordering::Relaxed),
            "messages_received": l.messages_received.load(Ordering::Relaxed),
            "bad_connections": l.bad_connections.load(Ordering::Relaxed),
        },
        "otlp": &*w.spans.stats,
    }))
    .into_response()
}

#[derive(Deserialize)]
struct RequestsQuery {
    id: Option<String>,
}

async fn sim_requests(State(w): State<Shared>, Query(q): Query<RequestsQuery>) -> Response {
    let Ok(log) = w.log.lock() else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    let recs: Vec<&RequestRecord> = match &q.id {
        Some(id) => match log.map.get(id) {
            Some(r) => vec![r],
            None => log
                .map
                .values()
                .filter(|r| &r.response_id == id || &r.internal_id == id)
                .collect(),
        },
        None => log.order.iter().filter_map(|r| log.map.get(r)).collect(),
    };
    axum::Json(recs).into_response()
}

/// Releases holds whose lease ran out (NIXL: `base_worker.py:3421-3447`; mooncake:
/// `mooncake_connector.py:2547-2591`, which remembers the transfer id for the abort timeout so
/// that a late pull is told the KV expired).
async fn sweeper(w: Shared) {
    let mooncake = w.v.kv_connector == KvConnector::Mooncake;
    let horizon = Duration::from_secs(w.v.mooncake_abort_request_timeout_secs);
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tick.tick().await;
        let mut expired = Vec::new();
        let at = Instant::now();
        if let Ok(mut h) = w.holds.lock() {
            h.retain(|id, x| {
                let keep = x.expires > at || x.sending > 0;
                if !keep {
                    expired.push((id.clone(), x.key.clone()));
                }
                keep
            });
        }
        if mooncake && let Ok(mut e) = w.expired.lock() {
            for (id, _) in &expired {
                e.insert(id.clone(), at);
            }
            e.retain(|_, t| t.elapsed() < horizon);
        }
        let now = now_ns();
        for (id, key) in expired {
            bump(&w.stats.kv_expired_reqs);
            if mooncake {
                tracing::warn!(
                    "KV lease of request {key} expired before the decoder pulled it. Freeing its blocks on the producer side."
                );
            } else {
                tracing::warn!(
                    "Releasing expired KV blocks for request {id} which were retrieved by 0 remote worker(s) before lease expired."
                );
            }
            w.record(&key, |r| {
                if r.outcome == "held" {
                    r.outcome = "lease-expired";
                    r.kv_done_ns = now;
                }
            });
        }
    }
}

/// Prefill's end of decode's notifications.
async fn notifications(w: Shared, sock: UnixDatagram) {
    let mut buf = vec![0u8; 4096];
    loop {
        match sock.recv(&mut buf).await {
            Ok(n) => w.on_notification(&String::from_utf8_lossy(&buf[..n])),
            Err(e) => {
                tracing::warn!(error = %e, "NIXL notification endpoint failed");
                return;
            }
        }
    }
}

pub async fn run(role: Role, a: WorkerArgs, v: VllmArgs) -> anyhow::Result<()> {
    if !(0.0..=1.0).contains(&a.overload_share) {
        anyhow::bail!("--overload-share must be within 0..=1");
    }
    a.faults.validate()?;
    let mooncake = v.kv_connector == KvConnector::Mooncake;
    if let Some(f) = a.faults.faults.iter().find(|f| {
        !matches!(
            (f, mooncake),
            (Fault::StaleKvParams | Fault::ForgedKvParams, false)
                | (Fault::MooncakePullError, true)
        )
    }) {
        anyhow::bail!(
            "--fault {} is not a fault of vLLM's {} connector",
            f.as_str(),
            v.kv_connector.as_str()
        );
    }
    if role == Role::Decode && !a.faults.faults.is_empty() {
        anyhow::bail!("the vLLM faults are prefill faults");
    }
    if role == Role::Prefill && a.decode_ignores_cancel {
        anyhow::bail!("--decode-ignores-cancel is a decode flag");
    }
    if v.block_size == 0 || v.max_model_len == 0 {
        anyhow::bail!("--block-size and --max-model-len must be > 0");
    }
    let side_port = v.side_channel_port.unwrap_or(match role {
        Role::Prefill => 5600,
        Role::Decode => 5601,
    });
    let u: u128 = rand::rng().random();
    let h = format!("{u:032x}");
    // `kv_transfer_config.engine_id` defaults to a uuid4.
    let engine_id = format!(
        "{}-{}-4{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[13..16],
        &format!("{}{}", ["8", "9", "a", "b"][(u & 3) as usize], &h[17..20]),
        &h[20..]
    );
    // Bind everything before announcing readiness.
    let http = TcpListener::bind((a.host.as_str(), a.port)).await?;
    // Mooncake's decode binds no ZMQ socket; its prefill a ROUTER for pulls and the bootstrap
    // server (hosted by prefill's worker process, `mooncake_connector.py:1504-1508`).
    let side = if mooncake && role == Role::Decode {
        None
    } else {
        Some(TcpListener::bind((a.host.as_str(), side_port)).await?)
    };
    let bootstrap = if mooncake && role == Role::Prefill {
        Some(TcpListener::bind((a.host.as_str(), a.disaggregation_bootstrap_port)).await?)
    } else {
        None
    };
    let notify_dir = v.notify_dir();
    let inbox = if mooncake {
        None
    } else {
        Some(
            nixl::bind_notifications(&notify_dir, &engine_id).map_err(|e| {
                anyhow::anyhow!(
                    "binding the NIXL notification endpoint in {}: {e}",
                    notify_dir.display()
                )
            })?,
        )
    };
    let http_addr = http.local_addr()?;
    let side_addr = side.as_ref().map(|s| s.local_addr()).transpose()?;
    let bootstrap_addr = bootstrap.as_ref().map(|s| s.local_addr()).transpose()?;
    let exporter = Exporter::start(ExporterConfig {
        endpoint: a.otlp_endpoint.clone(),
        service_name: "vllm",
        // `trace.get_tracer(__name__)` in `tracing/otel.py`; the module name that
        // `init_tracer("vllm.llm_engine", …)` was given is a resource attribute.
        scope_name: "vllm.tracing.otel",
        resource_attrs: vec![
            kv_str("vllm.instrumenting_module_name", "vllm.llm_engine"),
            kv_str("vllm.process_id", std::process::id().to_string()),
            kv_str("revenant.stage", role.as_str()),
            kv_str(
                "service.instance.id",
                format!("pd-sim-vllm-{}-{}", role.as_str(), std::process::id()),
            ),
            kv_str("host.name", crate::spans::host_name()),
        ],
    });
    let w: Shared = Arc::new(Worker {
        role,
        blocks: v.num_gpu_blocks(),
        engine_id: engine_id.clone(),
        side_addr,
        stats: Stats::default(),
        link_stats: Arc::new(LinkStats::default()),
        started: Instant::now(),
        log: Mutex::new(ReqLog {
            cap: a.room_log.max(1),
            map: HashMap::new(),
            order: VecDeque::new(),
        }),
        holds: Mutex::new(HashMap::new()),
        remote_agents: Mutex::new(HashMap::new()),
        last_issued: Mutex::new(None),
        unrecognized: Mutex::new(VecDeque::new()),
        notifier: UnixDatagram::unbound()?,
        transfers: Mutex::new(HashMap::new()),
        expired: Mutex::new(HashMap::new()),
        layouts: Mutex::new(HashSet::new()),
        mc_agents: Mutex::new(HashMap::new()),
        mc_query: tokio::sync::Mutex::new(()),
        acked_peers: Mutex::new(HashSet::new()),
        layout_id: (rand::rng().random::<u64>() >> 1) as i64 | 1,
        te_port: rand::rng().random_range(12001..=16000),
        block_cursor: AtomicU64::new(0),
        http: http_client(64),
        spans: exporter.sink.clone(),
        inflight: AtomicU64::new(0),
        created: now_ns() / 1_000_000_000,
        a,
        v,
    });
    let payload = Bytes::from(nixl::handshake_payload(&nixl::AgentFacts {
        engine_id: &engine_id,
        num_blocks: w.blocks,
        block_size: w.v.block_size,
    }));
    if let Some(boot) = bootstrap {
        let app = Router::new()
            .route("/register", post(bs_register))
            .route("/query", get(bs_query))
            .with_state(Arc::new(Mutex::new(Registry::default())));
        tokio::spawn(async move {
            let _ = axum::serve(boot, app).await;
        });
    }
    match (side, mooncake) {
        (Some(side), false) => {
            tokio::spawn(nixl::serve(side, w.clone(), payload));
        }
        (Some(side), true) => {
            tokio::spawn(mooncake_serve(side, w.clone()));
        }
        (None, _) => {}
    }
    if let (Some(b), Some(side)) = (bootstrap_addr, side_addr) {
        let host = if b.ip().is_unspecified() {
            "127.0.0.1".to_string()
        } else {
            b.ip().to_string()
        };
        register_with_bootstrap(
            &w,
            &format!("http://{host}:{}/register", b.port()),
            // `--advertise-kv-port` puts a tap in front of the ROUTER.
            &format!(
                "tcp://{}:{}",
                w.a.host,
                w.a.advertise_kv_port.unwrap_or(side.port())
            ),
        )
        .await?;
    }
    if let Some(inbox) = inbox {
        tokio::spawn(notifications(w.clone(), inbox));
    }
    tokio::spawn(sweeper(w.clone()));
    let app = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/generate", post(generate))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/sim/stats", get(sim_stats))
        .route("/sim/requests", get(sim_requests))
        // Last, so it covers every route above.
        .layer(axum::extract::DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(w.clone());
    crate::serve::print_ready(serde_json::json!({
        "role": role.as_str(),
        "flavour": "vllm",
        "http": format!("http://{http_addr}"),
        "port": http_addr.port(),
        "side_channel_port": side_addr.map(|a| a.port()),
        "kv_connector": w.v.kv_connector,
        "bootstrap_port": bootstrap_addr.map(|a| a.port()),
        "engine_id": engine_id,
        "max_model_len": w.v.max_model_len,
        "num_gpu_blocks": w.blocks,
        "block_size": w.v.block_size,
        "pid": std::process::id(),
    }));
    tracing::info!(role = role.as_str(), %http_addr, side = ?side_addr, "vllm worker ready");
    // Both roles see a client leave mid-request (vLLM aborts such requests); decode can be
    // told to ignore it.
    let on_gone = if w.a.decode_ignores_cancel {
        OnClientGone::Ignore
    } else {
        OnClientGone::Cancel
    };
    crate::serve::serve(http, app, on_gone).await?;
    let _ = std::fs::remove_file(nixl::notify_path(&notify_dir, &engine_id));
    exporter.shutdown(Duration::from_secs(3)).await;
    Ok(())
}
