//! sglang-router / smg (`--enable-trace`): one `http_request` span per client request.
//!
//! Real shapes, both scope and `service.name` `smg`:
//! - sglang-router 0.3.2 (`shared/fixtures/sglang-router-0.3.2/spans.jsonl`, here
//!   `testdata/smg-0.3.2-spans.jsonl`): attributes `request_id` (the client's `x-request-id`),
//!   `status_code` as a *string*, `uri`, `method`.
//! - smg 1.13.0 (`testdata/smg-1.13.0-spans.jsonl`: a prefill 400, and a 503 retried five times):
//!   the same, with the path in `path` instead of `uri`, plus `trace_id` (hex, the span's own),
//!   `target` `smg::otel-trace`, `version`, `latency`; `code.file.path`-style code attributes.
//!   The span continues the client's `traceparent` when there is one (its parent is the client's
//!   span) and smg passes its own context on to both workers.
//!
//! Both: span events "Sending concurrent requests" {prefill_url, decode_url} once per attempt
//! (each retry sends both legs again) and "Received concurrent requests" once the attempt's legs
//! are joined. Nothing says which leg failed or that the decode leg was withdrawn (1.13.0 closes
//! it within a few ms of a prefill error): the end of a decode leg comes from decode's own
//! telemetry or from eBPF. No `bootstrap_room` anywhere: router events are request-level; the
//! trace id names the request (the router keeps it across retries), never one attempt.

use opentelemetry_proto::tonic::trace::v1::Span;

use super::{ProfileLabel, SpanCtx, Tally, Unmapped, attrs, otlp_event};
use crate::event::{Kind, LifecycleEvent, Stage};

const P: ProfileLabel = ProfileLabel::Smg;

pub const SPAN_NAME: &str = "http_request";
pub const EVENT_DISPATCH: &str = "Sending concurrent requests";

pub fn map_span(ctx: &SpanCtx<'_>, span: &Span, out: &mut Vec<LifecycleEvent>, tally: &mut Tally) {
    if span.name != SPAN_NAME {
        tally.unmapped(P, Unmapped::UnknownSpan);
        return;
    }
    let a = &span.attributes;
    let request_id = attrs::id(a, "request_id").or_else(|| attrs::id(a, "x-request-id"));
    if request_id.is_none() && attrs::trace_id_hex(&span.trace_id).is_none() {
        tally.unmapped(P, Unmapped::MissingIds);
        return;
    }
    // The path only: a query string could carry user text.
    let path = attrs::str(a, "uri")
        .or_else(|| attrs::str(a, "path"))
        .map(|u| attrs::clip_id(u.split('?').next().unwrap_or("")));
    let ev = |time: u64, kind: Kind| {
        let mut e = otlp_event(ctx, span, time, Stage::Router, kind);
        e.ids.request_id = request_id.clone();
        e.detail = path.map(Into::into);
        e
    };
    out.push(ev(span.start_time_unix_nano, Kind::Received));
    let mut dispatched = false;
    for event in &span.events {
        if event.name != EVENT_DISPATCH {
            continue;
        }
        let t = if event.time_unix_nano == 0 {
            span.start_time_unix_nano
        } else {
            event.time_unix_nano
        };
        for (key, to) in [
            ("prefill_url", Stage::Prefill),
            ("decode_url", Stage::Decode),
        ] {
            if let Some(url) = attrs::str(&event.attributes, key) {
                let mut e = ev(t, Kind::Dispatched)
                    .with_to(to)
                    .with_worker(attrs::clip_id(url));
                e.detail = None;
                out.push(e);
                dispatched = true;
            }
        }
    }
    let status = attrs::u64(a, "status_code")
        .or_else(|| attrs::u64(a, "http.response.status_code"))
        .and_then(|s| u16::try_from(s).ok())
        .filter(|s| (100..600).contains(s));
    // A failure before anything was sent is the router refusing the request itself.
    let kind = match status {
        Some(s) if s >= 400 && !dispatched => Kind::Rejected,
        _ => Kind::Completed,
    };
    let mut end = ev(span.end_time_unix_nano, kind);
    end.status = status;
    if status.is_none() && super::span_is_error(span) {
        end.reason = span
            .status
            .as_ref()
            .map(|s| crate::event::truncate_reason(&s.message).into());
    }
    out.push(end);
}
