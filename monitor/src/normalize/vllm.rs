//! vLLM (`--otlp-traces-endpoint`): one `llm_request` span, kind SERVER, per finished request
//! (`v1/engine/output_processor.py`), with start time = arrival time. The instrumentation scope
//! is `vllm.tracing.otel` in vLLM 0.34 (`tracing/otel.py`; older builds: `vllm.llm_engine`);
//! any `vllm*` scope or service selects this profile.
//!
//! Attributes (vllm/tracing.py `SpanAttributes`): `gen_ai.request.id`,
//! `gen_ai.usage.prompt_tokens`, `gen_ai.usage.completion_tokens`, `gen_ai.request.max_tokens`,
//! latencies in seconds (`gen_ai.latency.time_in_queue`, `…time_to_first_token`, `…e2e`,
//! `…time_in_model_prefill`, `…time_in_model_decode`). Newer builds add "journey" span events
//! with `event.type` ∈ QUEUED / SCHEDULED / FIRST_TOKEN / PREEMPTED / FINISHED and
//! `finish.status`.
//!
//! Coverage: received, admitted (scheduled), prefill work (first token), decode work, completed /
//! aborted, prompt tokens. Not covered: vLLM emits nothing for requests rejected before the
//! engine (validation errors answer 400 without a span) and nothing from its KV connectors
//! (NIXL/LMCache/Mooncake) — PD transfer in vLLM is only visible to the eBPF side. A vLLM
//! process does not say whether it is a prefill or decode instance: the resource attribute
//! `revenant.stage=prefill|decode` (OTEL_RESOURCE_ATTRIBUTES) says so when set; otherwise the
//! span is a prefill leg when `gen_ai.request.max_tokens` is 1 and at most one token was
//! generated (the router's prefill body: `max_tokens: 1`), else decode.
//!
//! `gen_ai.request.id` is the engine's external id: `cmpl-X-0` on `/v1/completions` (the
//! prompt's index appended), `chatcmpl-X` on chat, X the router's per-request id sent on both
//! legs (never the internal `…-<8 chars>` id): it names the request's one attempt, so it is the
//! event's `rid`, the same rid the eBPF side gives both legs; the trace id (the
//! inbound `traceparent`, the router's CLIENT span) is `trace_id`. Every span with both teaches
//! the [`TraceJoin`] the trace's rid, which gives the router's prefill rejections their attempt.

use opentelemetry_proto::tonic::trace::v1::Span;

use super::vllm_router::TraceJoin;
use super::{ProfileLabel, SpanCtx, Tally, Unmapped, apply_token_attrs, attrs, otlp_event};
use crate::event::{Kind, LifecycleEvent, Stage};

const P: ProfileLabel = ProfileLabel::Vllm;

pub const SPAN_NAME: &str = "llm_request";

fn secs_to_ns(s: f64) -> Option<u64> {
    (0.0..1e9).contains(&s).then_some((s * 1e9) as u64)
}

fn latency(span: &Span, key: &str) -> Option<u64> {
    match attrs::get(&span.attributes, key)? {
        opentelemetry_proto::tonic::common::v1::any_value::Value::DoubleValue(d) => secs_to_ns(*d),
        opentelemetry_proto::tonic::common::v1::any_value::Value::IntValue(i) => {
            secs_to_ns(*i as f64)
        }
        _ => None,
    }
}

/// Which leg a span is, when the resource does not say: the router sends prefill `max_tokens: 1`.
pub fn infer_stage(max_tokens: Option<u64>, completion_tokens: Option<u64>) -> Stage {
    if max_tokens == Some(1) && completion_tokens.is_none_or(|c| c <= 1) {
        Stage::Prefill
    } else {
        Stage::Decode
    }
}

pub fn map_span(
    ctx: &SpanCtx<'_>,
    span: &Span,
    now_ns: u64,
    join: &mut TraceJoin,
    out: &mut Vec<LifecycleEvent>,
    tally: &mut Tally,
) {
    if span.name != SPAN_NAME {
        tally.unmapped(P, Unmapped::UnknownSpan);
        return;
    }
    let a = &span.attributes;
    let rid = attrs::id(a, "gen_ai.request.id");
    if rid.is_none() && attrs::trace_id_hex(&span.trace_id).is_none() {
        tally.unmapped(P, Unmapped::MissingIds);
        return;
    }
    let completion = attrs::first_u64(
        a,
        &[
            "gen_ai.usage.completion_tokens",
            "gen_ai.usage.output_tokens",
        ],
    );
    let stage = ctx
        .stage_hint
        .unwrap_or_else(|| infer_stage(attrs::u64(a, "gen_ai.request.max_tokens"), completion));
    let ev = |time: u64, stage: Stage, kind: Kind| {
        let mut e = otlp_event(ctx, span, time, stage, kind);
        e.ids.rid = rid.clone();
        apply_token_attrs(&mut e, a);
        e
    };
    let start = span.start_time_unix_nano;
    out.push(ev(start, stage, Kind::Received));

    let journey: Vec<_> = span
        .events
        .iter()
        .filter_map(|e| attrs::str(&e.attributes, "event.type").map(|t| (e, t)))
        .collect();
    let mut finish_status: Option<&str> = None;
    if journey.is_empty() {
        // Older builds: reconstruct the steps from the latency attributes.
        if let Some(q) = latency(span, "gen_ai.latency.time_in_queue") {
            out.push(ev(start.saturating_add(q), stage, Kind::Admitted));
        }
        if let Some(t) = latency(span, "gen_ai.latency.time_to_first_token") {
            let mut e = ev(start.saturating_add(t), stage, Kind::Work);
            e.detail = Some("first_token".into());
            out.push(e);
        }
    } else {
        for (e, t) in journey {
            let time = if e.time_unix_nano == 0 {
                start
            } else {
                e.time_unix_nano
            };
            let (kind, detail) = match t {
                "SCHEDULED" => (Kind::Admitted, "scheduled"),
                "FIRST_TOKEN" => (Kind::Work, "first_token"),
                "PREEMPTED" => (Kind::Work, "preempted"),
                "FINISHED" => {
                    finish_status = attrs::str(&e.attributes, "finish.status");
                    continue;
                }
                _ => continue,
            };
            let mut ev = ev(time, stage, kind);
            ev.detail = Some(detail.into());
            out.push(ev);
        }
    }
    if stage == Stage::Decode && completion.is_some_and(|c| c > 1) {
        let mut e = ev(span.end_time_unix_nano, Stage::Decode, Kind::Work);
        e.detail = Some("decode".into());
        out.push(e);
    }
    let aborted = super::span_is_error(span)
        || finish_status.is_some_and(|s| {
            s.eq_ignore_ascii_case("abort")
                || s.eq_ignore_ascii_case("aborted")
                || s.eq_ignore_ascii_case("error")
        });
    let mut end = ev(
        span.end_time_unix_nano,
        stage,
        if aborted {
            Kind::Aborted
        } else {
            Kind::Completed
        },
    );
    if let Some(s) = finish_status {
        end.reason = Some(crate::event::truncate_reason(s).into());
    }
    out.push(end);
    if let Some(rid) = &rid {
        join.learn(attrs::trace_key(&span.trace_id), rid, now_ns, out, tally);
    }
}
