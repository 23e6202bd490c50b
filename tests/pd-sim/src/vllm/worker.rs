//! vLLM-flavoured prefill and decode workers: flags, counters, the per-request log, the HTTP
//! handlers and the `llm_request` span. See the module docs in `vllm/mod.rs`.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use rand::RngExt;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

use super::VllmArgs;
use super::api::{self, Api, KvTransferParams, Usage};
use super::side;
use crate::ids::{new_rid, now_ns};
use crate::kvlink::{LinkStats, Pushers, serve_pull};
use crate::serve::{ClientConn, OnClientGone};
use crate::spans::{Exporter, ExporterConfig, SpanSink, SpanSpec, kv_f64, kv_int, kv_str};
use crate::trace_ctx::{TraceParent, random_span_id, random_trace_id};
use crate::worker::{BODY_LIMIT, Role, WorkerArgs};

/// This flavour's defaults of `--kv-timeout-ms` and `--bootstrap-timeout-ms`.
const VLLM_KV_TIMEOUT_MS: u64 = 2000;
const VLLM_BOOTSTRAP_TIMEOUT_MS: u64 = 5000;

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
    /// Answers carrying `kv_transfer_params` for a remote decode (a KV hold each).
    pub kv_params_issued: AtomicU64,
    /// Requests that came with a remote prefill's `kv_transfer_params` (KV pulled).
    pub remote_prefills: AtomicU64,
    /// Requests whose prompt was computed here (no `do_remote_prefill` params).
    pub local_prefills: AtomicU64,
    /// Side-channel frames (prefill: received READ/ABORT, sent KV/DONE; decode: the reverse).
    pub nixl_read_frames: AtomicU64,
    pub nixl_kv_frames: AtomicU64,
    pub nixl_done_frames: AtomicU64,
    pub nixl_abort_frames: AtomicU64,
    /// `NIXL_READ` for an N with no KV held (unknown, expired, aborted).
    pub reads_unmatched: AtomicU64,
    pub kv_chunks_unmatched: AtomicU64,
    pub unknown_frames: AtomicU64,
    pub kv_transfers: AtomicU64,
    /// KV holds dropped after `--bootstrap-timeout-ms` without a `NIXL_READ`.
    pub holds_expired: AtomicU64,
    pub kv_timeouts: AtomicU64,
    pub cancelled: AtomicU64,
    pub cancels_ignored: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
}

/// What a worker remembers about one request N (`GET /sim/requests`).
#[derive(Clone, Default, Serialize, Debug)]
pub struct RequestRecord {
    /// N: `cmpl-X` / `chatcmpl-X`.
    pub id: String,
    /// X: the `x-request-id` header.
    pub request_id: Option<String>,
    pub api: Option<Api>,
    pub status: u16,
    pub prompt_tokens: u64,
    pub max_tokens: u64,
    /// Prefill: the answer carried `kv_transfer_params` (a hold for a remote decode).
    pub kv_params_issued: bool,
    /// Decode: the N named by the request's `kv_transfer_params.remote_request_id`.
    pub remote_request_id: Option<String>,
    /// Prefill: `NIXL_READ` frames received for N; decode: sent.
    pub read_frames: u32,
    /// Prefill: `NIXL_ABORT` frames received for N; decode: sent.
    pub abort_frames: u32,
    pub kv_chunks: u32,
    pub kv_done: bool,
    pub generated_tokens: u64,
    /// pending / rejected / held / transferred / hold-expired / aborted (prefill's KV) /
    /// generated / kv-failed / cancelled / client-gone / cancel-ignored.
    pub outcome: &'static str,
    pub final_outcome: Option<&'static str>,
    /// Unix ns, 0 = did not happen. `received_ns`: the HTTP request arrived.
    pub received_ns: u64,
    /// Prefill: the first `NIXL_READ` arrived; decode: its `NIXL_READ` was sent.
    pub read_ns: u64,
    /// Prefill: `NIXL_DONE` sent (or the hold ended); decode: `NIXL_DONE` received.
    pub kv_done_ns: u64,
    /// The HTTP status was decided.
    pub answered_ns: u64,
    pub client_gone_ns: u64,
    /// The HTTP request ended (answered to its end, rejected, cancelled).
    pub ended_ns: u64,
}

pub(super) struct ReqLog {
    cap: usize,
    map: HashMap<String, RequestRecord>,
    order: VecDeque<String>,
}

pub(super) struct Hold {
    pub(super) tokens: u64,
    since: Instant,
}

pub(super) struct Waiter {
    pub(super) own: String,
    pub(super) done: oneshot::Sender<u64>,
}

pub struct Worker {
    pub(super) role: Role,
    pub(super) a: WorkerArgs,
    pub(super) v: VllmArgs,
    blocks: u64,
    engine_id: String,
    side_addr: SocketAddr,
    pub(super) stats: Stats,
    link_stats: Arc<LinkStats>,
    pub(super) pushers: Pushers,
    log: Mutex<ReqLog>,
    pub(super) holds: Mutex<HashMap<String, Hold>>,
    pub(super) waiters: Mutex<HashMap<String, Waiter>>,
    spans: SpanSink,
    inflight: AtomicU64,
    created: u64,
}

type Shared = Arc<Worker>;

impl Worker {
    pub(super) fn record(&self, id: &str, f: impl FnOnce(&mut RequestRecord)) {
        let Ok(mut log) = self.log.lock() else { return };
        if !log.map.contains_key(id) {
            if log.order.len() >= log.cap
                && let Some(old) = log.order.pop_front()
            {
                log.map.remove(&old);
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

    /// The params a prefill answers with: where decode pulls N's KV from.
    fn issued_params(&self, id: &str, prompt_tokens: u64) -> KvTransferParams {
        let blocks = prompt_tokens.div_ceil(self.v.block_size.max(1)).max(1);
        KvTransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            remote_engine_id: Some(self.engine_id.clone()),
            remote_block_ids: Some((0..blocks).collect()),
            remote_request_id: Some(id.to_owned()),
            remote_host: Some(self.side_addr.ip().to_string()),
            remote_port: Some(self.side_addr.port()),
            tp_size: Some(1),
        }
    }
}

/// A request between admission and its end. Dropped before [`Live::finish`] (the client went
/// away and the handler or the stream was dropped): outcome `cancelled`, and `NIXL_ABORT` to
/// the remote prefill if the KV had not come yet.
struct Live {
    w: Shared,
    id: String,
    conn: Option<ClientConn>,
    /// The remote prefill and the N it knows, while the KV is awaited.
    pulling: Option<(String, SocketAddr)>,
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
            self.w.stats.cancels_ignored.fetch_add(1, Ordering::Relaxed);
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
            } else if !matches!(
                r.outcome,
                "held" | "transferred" | "aborted" | "hold-expired"
            ) {
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
        self.w.stats.cancelled.fetch_add(1, Ordering::Relaxed);
        let now = now_ns();
        let gone = self.conn.as_ref().and_then(ClientConn::gone_ns);
        let abort = self.pulling.take();
        if let Some((n, _)) = &abort
            && let Ok(mut ws) = self.w.waiters.lock()
        {
            ws.remove(n);
        }
        self.w.record(&self.id, |r| {
            r.outcome = "cancelled";
            r.ended_ns = now;
            r.client_gone_ns = gone.unwrap_or(0);
            if abort.is_some() {
                r.abort_frames += 1;
            }
        });
        if let Some((n, to)) = abort {
            self.w
                .stats
                .nixl_abort_frames
                .fetch_add(1, Ordering::Relaxed);
            let w = self.w.clone();
            tokio::spawn(async move {
                w.pushers.send(to, &[side::ABORT, n.as_bytes()]).await;
            });
        }
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
    id: String,
    prompt_tokens: u64,
    max_tokens: u64,
}

/// vLLM's `llm_request` span (SERVER), parented on the inbound `traceparent`.
fn request_span(w: &Worker, r: &SpanFacts, completion: u64, t: &Times, err: Option<&str>) {
    if !w.spans.enabled() {
        return;
    }
    let s = |a: u64, b: u64| b.saturating_sub(a) as f64 / 1e9;
    let mut span = SpanSpec {
        trace_id: r.tp.map(|t| t.trace_id).unwrap_or_else(random_trace_id),
        span_id: random_span_id(),
        parent: r.tp.map(|t| t.span_id),
        name: "llm_request".into(),
        start_ns: t.received,
        end_ns: t.end,
        attributes: vec![
            kv_str("gen_ai.response.model", w.a.model_path.clone()),
            kv_str("gen_ai.request.id", r.id.clone()),
            kv_int("gen_ai.request.max_tokens", r.max_tokens as i64),
            kv_int("gen_ai.request.n", 1),
            kv_int("gen_ai.usage.prompt_tokens", r.prompt_tokens as i64),
            kv_int("gen_ai.usage.completion_tokens", completion as i64),
            kv_f64("gen_ai.latency.time_in_queue", s(t.received, t.scheduled)),
            kv_f64(
                "gen_ai.latency.time_to_first_token",
                s(t.received, t.first_token),
            ),
            kv_f64("gen_ai.latency.e2e", s(t.received, t.end)),
            kv_f64(
                "gen_ai.latency.time_in_model_prefill",
                s(t.scheduled, t.first_token),
            ),
            kv_f64(
                "gen_ai.latency.time_in_model_decode",
                s(t.first_token, t.end),
            ),
        ],
        events: Vec::new(),
        error: err,
    }
    .build();
    span.kind = opentelemetry_proto::tonic::trace::v1::span::SpanKind::Server as i32;
    w.spans.emit(vec![span]);
}

async fn serve_request(
    w: Shared,
    api: Api,
    conn: Option<ClientConn>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let t0 = now_ns();
    w.stats.requests.fetch_add(1, Ordering::Relaxed);
    let p = match api::parse(api, &body) {
        Ok(p) => p,
        Err(e) => {
            w.stats.bad_requests.fetch_add(1, Ordering::Relaxed);
            return api::error(StatusCode::BAD_REQUEST, &e.to_string());
        }
    };
    drop(body);
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let id = format!(
        "{}{}",
        api.prefix(),
        request_id.clone().unwrap_or_else(new_rid)
    );
    let tp = headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(TraceParent::parse);
    let max_tokens = p.max_tokens.unwrap_or(w.a.default_max_new_tokens);
    let remote = p.kv.as_ref().filter(|k| k.do_remote_prefill);
    let pull = match remote {
        None => None,
        Some(k) => match (&k.remote_request_id, &k.remote_host, k.remote_port) {
            (Some(n), Some(h), Some(port)) => Some((n.clone(), h.clone(), port)),
            _ => {
                w.stats.bad_requests.fetch_add(1, Ordering::Relaxed);
                return api::error(
                    StatusCode::BAD_REQUEST,
                    "kv_transfer_params with do_remote_prefill needs remote_request_id, remote_host and remote_port",
                );
            }
        },
    };
    let base = |r: &mut RequestRecord| {
        r.request_id = request_id.clone();
        r.api = Some(api);
        r.prompt_tokens = p.prompt_tokens;
        r.max_tokens = max_tokens;
        r.received_ns = t0;
        r.remote_request_id = pull.as_ref().map(|(n, _, _)| n.clone());
    };
    // vLLM's input processing: the whole request must fit the context (before the engine).
    if p.prompt_tokens.saturating_add(max_tokens) > w.v.max_model_len {
        w.stats.rejected_400.fetch_add(1, Ordering::Relaxed);
        let now = now_ns();
        w.record(&id, |r| {
            base(r);
            r.status = 400;
            r.outcome = "rejected";
            r.answered_ns = now;
            r.ended_ns = now;
        });
        let msg = api::too_long_message(w.v.max_model_len, p.prompt_tokens, max_tokens);
        return api::error(StatusCode::BAD_REQUEST, &msg);
    }
    let queued = w.inflight.load(Ordering::Relaxed);
    let a = &w.a;
    if a.max_queued_requests.is_some_and(|m| queued >= m)
        || (a.overload_share > 0.0 && rand::rng().random::<f64>() < a.overload_share)
    {
        w.stats.rejected_503.fetch_add(1, Ordering::Relaxed);
        let now = now_ns();
        w.record(&id, |r| {
            base(r);
            r.status = 503;
            r.outcome = "rejected";
            r.answered_ns = now;
            r.ended_ns = now;
        });
        return api::error(StatusCode::SERVICE_UNAVAILABLE, api::OVERLOADED);
    }
    w.stats.admitted.fetch_add(1, Ordering::Relaxed);
    w.inflight.fetch_add(1, Ordering::Relaxed);
    w.record(&id, base);
    let mut live = Live {
        w: w.clone(),
        id: id.clone(),
        conn: conn.clone(),
        pulling: None,
        done: false,
    };
    let facts = SpanFacts {
        tp,
        id: id.clone(),
        prompt_tokens: p.prompt_tokens,
        max_tokens,
    };
    let t_sched = now_ns();
    // The prompt's KV: pulled from the remote prefill, or computed here.
    if let Some((n, host, port)) = pull {
        w.stats.remote_prefills.fetch_add(1, Ordering::Relaxed);
        let to = match host.parse::<IpAddr>() {
            Ok(ip) => Some(SocketAddr::new(ip, port)),
            Err(_) => tokio::net::lookup_host((host.as_str(), port))
                .await
                .ok()
                .and_then(|mut a| a.next()),
        };
        let err = match to {
            None => Some(format!(
                "KV transfer of request {n}: cannot resolve remote_host"
            )),
            Some(to) => {
                let (tx, rx) = oneshot::channel();
                if let Ok(mut ws) = w.waiters.lock() {
                    ws.insert(
                        n.clone(),
                        Waiter {
                            own: id.clone(),
                            done: tx,
                        },
                    );
                }
                live.pulling = Some((n.clone(), to));
                let (ip_s, port_s) = (w.side_addr.ip().to_string(), w.side_addr.port().to_string());
                w.pushers
                    .send(
                        to,
                        &[side::READ, n.as_bytes(), ip_s.as_bytes(), port_s.as_bytes()],
                    )
                    .await;
                w.stats.nixl_read_frames.fetch_add(1, Ordering::Relaxed);
                let now = now_ns();
                w.record(&id, |r| {
                    r.read_frames += 1;
                    r.read_ns = now;
                });
                let timeout =
                    Duration::from_millis(w.a.kv_timeout_ms.unwrap_or(VLLM_KV_TIMEOUT_MS));
                match tokio::time::timeout(timeout, rx).await {
                    Ok(Ok(_tokens)) => {
                        live.pulling = None;
                        None
                    }
                    _ => {
                        // A local failure, not a withdrawal: no NIXL_ABORT.
                        live.pulling = None;
                        if let Ok(mut ws) = w.waiters.lock() {
                            ws.remove(&n);
                        }
                        w.stats.kv_timeouts.fetch_add(1, Ordering::Relaxed);
                        Some(format!(
                            "KV transfer of request {n} from {to} did not complete within {} ms",
                            w.a.kv_timeout_ms.unwrap_or(VLLM_KV_TIMEOUT_MS)
                        ))
                    }
                }
            }
        };
        if let Some(msg) = err {
            let t_end = now_ns();
            live.finish("kv-failed", |r| r.status = 500);
            request_span(
                &w,
                &facts,
                0,
                &Times {
                    received: t0,
                    scheduled: t_sched,
                    first_token: t_end,
                    end: t_end,
                },
                Some(&msg),
            );
            return api::error(StatusCode::INTERNAL_SERVER_ERROR, &msg);
        }
    } else {
        w.stats.local_prefills.fetch_add(1, Ordering::Relaxed);
        if w.a.prefill_delay_us > 0 {
            tokio::time::sleep(Duration::from_micros(w.a.prefill_delay_us)).await;
        }
    }
    let t_first = now_ns();
    let n_tokens = max_tokens.max(1);
    w.stats
        .prompt_tokens
        .fetch_add(p.prompt_tokens, Ordering::Relaxed);
    // A request computed for a remote decode leaves its KV held for decode's NIXL_READ.
    let issued =
        p.kv.as_ref()
            .is_some_and(|k| k.do_remote_decode && !k.do_remote_prefill)
            .then(|| w.issued_params(&id, p.prompt_tokens));
    if issued.is_some() {
        if let Ok(mut h) = w.holds.lock() {
            h.insert(
                id.clone(),
                Hold {
                    tokens: p.prompt_tokens,
                    since: Instant::now(),
                },
            );
        }
        w.stats.kv_params_issued.fetch_add(1, Ordering::Relaxed);
        w.record(&id, |r| {
            r.kv_params_issued = true;
            r.outcome = "held";
        });
    }
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
        w.stats.completed.fetch_add(1, Ordering::Relaxed);
        w.stats
            .generation_tokens
            .fetch_add(n_tokens, Ordering::Relaxed);
        request_span(
            &w,
            &facts,
            n_tokens,
            &Times {
                received: t0,
                scheduled: t_sched,
                first_token: t_first,
                end: t_end,
            },
            None,
        );
        let body = api::render_final(
            api,
            &id,
            &w.a.model_path,
            &text,
            Usage::new(p.prompt_tokens, n_tokens),
            issued.as_ref(),
        );
        return Response::builder()
            .status(200)
            .header("content-type", "application/json")
            .body(Body::from(body))
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    }
    // Streaming: one SSE event per token from a task that stops when the client goes (or,
    // with --decode-ignores-cancel, generates every token all the same).
    let now = now_ns();
    w.record(&id, |r| {
        r.status = 200;
        r.answered_ns = now;
    });
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(16);
    let w2 = w.clone();
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
        w.stats.completed.fetch_add(1, Ordering::Relaxed);
        w.stats.generation_tokens.fetch_add(sent, Ordering::Relaxed);
        request_span(
            &w,
            &facts,
            sent,
            &Times {
                received: t0,
                scheduled: t_sched,
                first_token: t_first,
                end: t_end,
            },
            None,
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
    let text = api::metrics(&api::MetricsView {
        model: &w.a.model_path,
        block_size: w.v.block_size,
        num_gpu_blocks: w.blocks,
        running: w.inflight.load(Ordering::Relaxed),
        waiting: 0,
        kv_usage: (held as f64 / capacity as f64).min(1.0),
        prompt_tokens: w.stats.prompt_tokens.load(Ordering::Relaxed),
        generation_tokens: w.stats.generation_tokens.load(Ordering::Relaxed),
        success: w.stats.completed.load(Ordering::Relaxed),
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
        "worker": &w.stats,
        "inflight": w.inflight.load(Ordering::Relaxed),
        "kv_holds": w.holds.lock().map(|h| h.len()).unwrap_or(0),
        "max_model_len": w.v.max_model_len,
        "num_gpu_blocks": w.blocks,
        "block_size": w.v.block_size,
        "side_channel": {
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
struct RequestsQuery {
    id: Option<String>,
}

async fn sim_requests(State(w): State<Shared>, Query(q): Query<RequestsQuery>) -> Response {
    let Ok(log) = w.log.lock() else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    let recs: Vec<&RequestRecord> = match &q.id {
        Some(id) => log.map.get(id).into_iter().collect(),
        None => log.order.iter().filter_map(|r| log.map.get(r)).collect(),
    };
    axum::Json(recs).into_response()
}

/// Drops KV holds whose decode never asked for them.
async fn sweeper(w: Shared) {
    let timeout = Duration::from_millis(
        w.a.bootstrap_timeout_ms
            .unwrap_or(VLLM_BOOTSTRAP_TIMEOUT_MS),
    );
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tick.tick().await;
        let mut expired = Vec::new();
        if let Ok(mut h) = w.holds.lock() {
            h.retain(|n, x| {
                let keep = x.since.elapsed() < timeout;
                if !keep {
                    expired.push(n.clone());
                }
                keep
            });
        }
        let now = now_ns();
        for n in expired {
            w.stats.holds_expired.fetch_add(1, Ordering::Relaxed);
            w.record(&n, |r| {
                r.outcome = "hold-expired";
                r.kv_done_ns = now;
            });
        }
    }
}

pub async fn run(role: Role, a: WorkerArgs, v: VllmArgs) -> anyhow::Result<()> {
    if !(0.0..=1.0).contains(&a.overload_share) {
        anyhow::bail!("--overload-share must be within 0..=1");
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
    // Bind everything before announcing readiness.
    let http = TcpListener::bind((a.host.as_str(), a.port)).await?;
    let side = TcpListener::bind((a.host.as_str(), side_port)).await?;
    let http_addr = http.local_addr()?;
    let side_addr = side.local_addr()?;
    let exporter = Exporter::start(ExporterConfig {
        endpoint: a.otlp_endpoint.clone(),
        service_name: "vllm",
        scope_name: "vllm.llm_engine",
        resource_attrs: vec![
            kv_str("revenant.stage", role.as_str()),
            kv_str(
                "service.instance.id",
                format!("pd-sim-vllm-{}-{}", role.as_str(), std::process::id()),
            ),
            kv_str("host.name", crate::spans::host_name()),
        ],
    });
    let link_stats = Arc::new(LinkStats::default());
    let u: u128 = rand::rng().random();
    let h = format!("{u:032x}");
    let engine_id = format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    );
    let w: Shared = Arc::new(Worker {
        role,
        blocks: v.num_gpu_blocks(),
        engine_id,
        side_addr,
        stats: Stats::default(),
        link_stats: link_stats.clone(),
        pushers: Pushers::new(link_stats.clone()),
        log: Mutex::new(ReqLog {
            cap: a.room_log.max(1),
            map: HashMap::new(),
            order: VecDeque::new(),
        }),
        holds: Mutex::new(HashMap::new()),
        waiters: Mutex::new(HashMap::new()),
        spans: exporter.sink.clone(),
        inflight: AtomicU64::new(0),
        created: now_ns() / 1_000_000_000,
        a,
        v,
    });
    {
        let w2 = w.clone();
        tokio::spawn(serve_pull(side, link_stats, move |parts| {
            w2.on_side_message(parts)
        }));
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
        "side_channel_port": side_addr.port(),
        "max_model_len": w.v.max_model_len,
        "num_gpu_blocks": w.blocks,
        "block_size": w.v.block_size,
        "pid": std::process::id(),
    }));
    tracing::info!(role = role.as_str(), %http_addr, side = %side_addr, "vllm worker ready");
    // Both roles see a client leave mid-request (vLLM aborts such requests); decode can be
    // told to ignore it.
    let on_gone = if w.a.decode_ignores_cancel {
        OnClientGone::Ignore
    } else {
        OnClientGone::Cancel
    };
    crate::serve::serve(http, app, on_gone).await?;
    exporter.shutdown(Duration::from_secs(3)).await;
    Ok(())
}
