//! vllm-router in vLLM PD mode (`Router(vllm_pd_disaggregation=True, enable_trace=True,
//! otlp_traces_endpoint=...)`, OTLP/gRPC), and the trace join that gives its prefill rejections
//! their attempt.
//!
//! Real shapes, vllm-router 0.1.17 (`testdata/vllm-router-0.1.17-spans.jsonl`, recorded by
//! `tests/otlp/record_vllm_router.py`: one success, one prefill 400). Resource `service.name`
//! `vllm-router`, `service.version` `0.1.17`; scope `vllm-router` (no version). Per client request,
//! one trace (new per request: the client's `traceparent` is not continued):
//! - SERVER span `POST /v1/completions` (name = method + route), root: `request_id` (the client's
//!   `x-request-id`, echoed back), `http.request.method`, `url.path`, `http.route`,
//!   `http.response.status_code` (a *string*), `latency_ms` (double), tracing-opentelemetry's
//!   `code.*`, `thread.*`, `busy_ns`, `idle_ns`. Status always unset, even for a 400.
//! - one CLIENT child `POST /v1/completions` per leg, sequential (prefill ends before decode
//!   starts): `vllm.request_phase` = `prefill` | `decode`, `server.address`, `server.port` (a
//!   string), `url.full`, `http.route`, `http.request.method`, `http.response.status_code`. The
//!   leg's `traceparent` carries this span's id. A prefill answering ≥ 400 has no decode sibling.
//!   A CLIENT span ends when the router dropped the worker's response, which can be after the
//!   SERVER span ended (≈ 1 ms in the capture).
//!
//! No span event, no attribute carries the id X the router sends the workers
//! (`___prefill_addr_…___decode_addr_…_<hex>`), so no router span names the attempt: vLLM's
//! `llm_request` span of either leg does (`gen_ai.request.id` = N = `cmpl-X-0`, `chatcmpl-X` on chat), in the same trace.
//!
//! Mapping: SERVER → router `received` (start) and router `completed` (end, `status`; a status
//! ≥ 400 fails the request whether the router refused it itself or passed a leg's error through,
//! and the span alone cannot tell which: its legs are separate spans). CLIENT → router
//! `dispatched` at start (`to` = phase, `worker` = `address:port`); a prefill CLIENT ending ≥ 400 →
//! prefill `rejected` at its end (`status`, trace id), request-level, and again with rid N once a
//! span of the trace names N ([`TraceJoin`]). A decode CLIENT's end says nothing about decode's
//! own state: decode's telemetry or eBPF does.

use std::collections::VecDeque;
use std::time::Duration;

use opentelemetry_proto::tonic::trace::v1::{Span, span::SpanKind};
use serde::Deserialize;

use super::{ConfigError, ProfileLabel, SpanCtx, Tally, Unmapped, attrs, otlp_event};
use crate::event::{Kind, LifecycleEvent, Stage};

const P: ProfileLabel = ProfileLabel::VllmRouter;

pub const SERVICE_NAME: &str = "vllm-router";
pub const SCOPE_NAME: &str = "vllm-router";
pub const PHASE: &str = "vllm.request_phase";

fn status(span: &Span) -> Option<u16> {
    attrs::u64(&span.attributes, "http.response.status_code")
        .and_then(|s| u16::try_from(s).ok())
        .filter(|s| (100..600).contains(s))
}

pub fn map_span(
    ctx: &SpanCtx<'_>,
    span: &Span,
    now_ns: u64,
    join: &mut TraceJoin,
    out: &mut Vec<LifecycleEvent>,
    tally: &mut Tally,
) {
    let a = &span.attributes;
    let trace = attrs::trace_key(&span.trace_id);
    let phase = attrs::str(a, PHASE);
    let kind = span.kind;
    if let Some(phase) = phase {
        let to = match phase {
            "prefill" => Stage::Prefill,
            "decode" => Stage::Decode,
            _ => {
                tally.unmapped(P, Unmapped::UnknownSpan);
                return;
            }
        };
        if trace == 0 {
            tally.unmapped(P, Unmapped::MissingIds);
            return;
        }
        let worker = match (
            attrs::str(a, "server.address"),
            attrs::u64(a, "server.port"),
        ) {
            (Some(h), Some(p)) => Some(format!("{h}:{p}")),
            (Some(h), None) => Some(h.to_owned()),
            _ => None,
        };
        let mut d = otlp_event(
            ctx,
            span,
            span.start_time_unix_nano,
            Stage::Router,
            Kind::Dispatched,
        )
        .with_to(to);
        d.worker = worker.as_deref().map(|w| attrs::clip_id(w).into());
        out.push(d);
        let st = status(span);
        if to == Stage::Prefill && st.is_some_and(|s| s >= 400) {
            let mut r = otlp_event(
                ctx,
                span,
                span.end_time_unix_nano,
                Stage::Prefill,
                Kind::Rejected,
            );
            r.status = st;
            r.worker = worker.as_deref().map(|w| attrs::clip_id(w).into());
            join.pending(trace, r, now_ns, out, tally);
        }
        return;
    }
    if kind == SpanKind::Server as i32 || attrs::has(a, "request_id") {
        let request_id = attrs::id(a, "request_id");
        if request_id.is_none() && trace == 0 {
            tally.unmapped(P, Unmapped::MissingIds);
            return;
        }
        let route = attrs::str(a, "http.route")
            .or_else(|| attrs::str(a, "url.path"))
            .map(|u| attrs::clip_id(u.split('?').next().unwrap_or("")));
        let ev = |time: u64, kind: Kind| {
            let mut e = otlp_event(ctx, span, time, Stage::Router, kind);
            e.ids.request_id = request_id.clone();
            e.detail = route.map(Into::into);
            e
        };
        out.push(ev(span.start_time_unix_nano, Kind::Received));
        let mut end = ev(span.end_time_unix_nano, Kind::Completed);
        end.status = status(span);
        out.push(end);
        return;
    }
    tally.unmapped(P, Unmapped::UnknownSpan);
}

/// Bounds of the trace join (`normalize.trace_join`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JoinConfig {
    /// How long a trace's rid, and a rejection waiting for it, are kept after they arrived.
    #[serde(default = "default_ttl", with = "crate::duration")]
    pub ttl: Duration,
    /// Most traces whose rid is remembered; the oldest is forgotten (counted) beyond this.
    #[serde(default = "default_max_traces")]
    pub max_traces: usize,
    /// Most rejections waiting for their trace's rid; the oldest is given up (counted).
    #[serde(default = "default_max_pending")]
    pub max_pending: usize,
}

fn default_ttl() -> Duration {
    // vllm-router and vLLM both batch-export (5 s by default) and a decode leg's span arrives
    // only when decode finishes; a minute covers long generations and slow exporters.
    Duration::from_secs(60)
}
fn default_max_traces() -> usize {
    100_000
}
fn default_max_pending() -> usize {
    100_000
}

impl Default for JoinConfig {
    fn default() -> Self {
        JoinConfig {
            ttl: default_ttl(),
            max_traces: default_max_traces(),
            max_pending: default_max_pending(),
        }
    }
}

/// Bounded label: what became of a trace-join entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum JoinOutcome {
    /// A pending rejection got its rid and was emitted again with it.
    Resolved = 0,
    /// A pending rejection's TTL passed without any span naming the trace's rid. Normal when
    /// the router did the right thing: vLLM exports no span for a request it refused.
    Expired = 1,
    /// A pending rejection pushed out by `max_pending` (a drop: it may have resolved later).
    EvictedPending = 2,
    /// A trace's rid forgotten early because of `max_traces` (a drop).
    EvictedTrace = 3,
}

impl JoinOutcome {
    pub const ALL: [JoinOutcome; 4] = [
        JoinOutcome::Resolved,
        JoinOutcome::Expired,
        JoinOutcome::EvictedPending,
        JoinOutcome::EvictedTrace,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            JoinOutcome::Resolved => "resolved",
            JoinOutcome::Expired => "expired",
            JoinOutcome::EvictedPending => "evicted_pending",
            JoinOutcome::EvictedTrace => "evicted_trace",
        }
    }
}

type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::FixedState>;

/// Trace id → the rid (N) some span of the trace named, and trace id → router events waiting for
/// it. vllm-router PD requests have exactly one attempt, so the rid any span of the trace names
/// is the attempt of every leg event in it. Both tables are insertion-ordered with a deadline
/// (FIFO = LRU here: an entry is written once and never refreshed), bounded by count and TTL;
/// arrival times (`now_ns`) drive them, never event times.
#[derive(Debug)]
pub struct TraceJoin {
    cfg: JoinConfig,
    known: HashMap<u128, (Box<str>, u64)>,
    known_order: VecDeque<(u64, u128)>,
    waiting: HashMap<u128, Vec<(u64, LifecycleEvent)>>,
    waiting_order: VecDeque<(u64, u128)>,
    waiting_len: usize,
}

impl TraceJoin {
    pub fn new(cfg: JoinConfig) -> Result<Self, ConfigError> {
        if cfg.max_traces == 0 || cfg.max_pending == 0 || cfg.ttl.is_zero() {
            return Err(ConfigError::TraceJoin(
                "ttl, max_traces and max_pending must be > 0",
            ));
        }
        Ok(TraceJoin {
            cfg,
            known: HashMap::default(),
            known_order: VecDeque::new(),
            waiting: HashMap::default(),
            waiting_order: VecDeque::new(),
            waiting_len: 0,
        })
    }

    fn deadline(&self, now_ns: u64) -> u64 {
        now_ns.saturating_add(self.cfg.ttl.as_nanos().min(u64::MAX as u128) as u64)
    }

    /// Rejections waiting for their trace's rid.
    pub fn pending_len(&self) -> usize {
        self.waiting_len
    }

    /// Traces whose rid is remembered.
    pub fn known_len(&self) -> usize {
        self.known.len()
    }

    /// A span of trace `trace` names rid `rid`: remember it, and emit every router event that
    /// was waiting for it again, now with the rid.
    pub fn learn(
        &mut self,
        trace: u128,
        rid: &str,
        now_ns: u64,
        out: &mut Vec<LifecycleEvent>,
        tally: &mut Tally,
    ) {
        if trace == 0 || rid.is_empty() {
            return;
        }
        if !self.known.contains_key(&trace) {
            let d = self.deadline(now_ns);
            self.known.insert(trace, (rid.into(), d));
            self.known_order.push_back((d, trace));
            while self.known.len() > self.cfg.max_traces {
                let Some((d, t)) = self.known_order.pop_front() else {
                    break;
                };
                if self.known.get(&t).is_some_and(|(_, kd)| *kd == d) {
                    self.known.remove(&t);
                    tally.join(JoinOutcome::EvictedTrace);
                }
            }
        }
        if let Some(list) = self.waiting.remove(&trace) {
            self.waiting_len -= list.len();
            for (_, mut e) in list {
                e.ids.rid = Some(rid.into());
                out.push(e);
                tally.join(JoinOutcome::Resolved);
            }
        }
    }

    /// A router event without rid for trace `trace`: emitted now (request-level), and again with
    /// the rid at once if it is known, or when it turns up.
    pub fn pending(
        &mut self,
        trace: u128,
        e: LifecycleEvent,
        now_ns: u64,
        out: &mut Vec<LifecycleEvent>,
        tally: &mut Tally,
    ) {
        if let Some((rid, _)) = self.known.get(&trace) {
            let mut with = e.clone();
            with.ids.rid = Some(rid.clone());
            out.push(e);
            out.push(with);
            tally.join(JoinOutcome::Resolved);
            return;
        }
        out.push(e.clone());
        let d = self.deadline(now_ns);
        self.waiting.entry(trace).or_default().push((d, e));
        self.waiting_order.push_back((d, trace));
        self.waiting_len += 1;
        // Resolved entries leave stale queue entries behind; compact before they pile up.
        if self.waiting_order.len() > 2 * self.cfg.max_pending + 16 {
            let waiting = &self.waiting;
            self.waiting_order.retain(|(d, t)| {
                waiting
                    .get(t)
                    .is_some_and(|l| l.iter().any(|(ld, _)| ld == d))
            });
        }
        while self.waiting_len > self.cfg.max_pending {
            if !self.drop_front_pending(u64::MAX, tally, JoinOutcome::EvictedPending) {
                break;
            }
        }
    }

    /// Drops the oldest pending event whose queue entry is still live and whose deadline is at
    /// most `until`. False when there is none.
    fn drop_front_pending(&mut self, until: u64, tally: &mut Tally, why: JoinOutcome) -> bool {
        while let Some((d, t)) = self.waiting_order.front().copied() {
            if d > until {
                return false;
            }
            self.waiting_order.pop_front();
            let Some(list) = self.waiting.get_mut(&t) else {
                continue; // resolved meanwhile
            };
            let Some(pos) = list.iter().position(|(ld, _)| *ld == d) else {
                continue;
            };
            list.remove(pos);
            if list.is_empty() {
                self.waiting.remove(&t);
            }
            self.waiting_len -= 1;
            tally.join(why);
            return true;
        }
        false
    }

    /// Expires pending events and remembered rids past their TTL.
    pub fn tick(&mut self, now_ns: u64, tally: &mut Tally) {
        while self.drop_front_pending(now_ns, tally, JoinOutcome::Expired) {}
        while let Some((d, t)) = self.known_order.front().copied() {
            if d > now_ns {
                break;
            }
            self.known_order.pop_front();
            if self.known.get(&t).is_some_and(|(_, kd)| *kd == d) {
                self.known.remove(&t);
            }
        }
    }
}
