//! vLLM PD behind vllm-router: the real router capture (`testdata/vllm-router-0.1.17-spans.jsonl`),
//! vLLM worker spans in the shapes of contract-14, the trace join and what the checker makes of
//! the three flows (correct, handoff after a prefill rejection, success).

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{InstrumentationScope, KeyValue, any_value::Value};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span};

use super::tests::{export, fixture_export, kv, lines, normalizer, run, s, span};
use super::vllm_router::{JoinConfig, JoinOutcome};
use super::*;
use crate::engine::check::{Checker, CheckerConfig, RuleSet};
use crate::event::{Kind, LifecycleEvent, Stage};
use crate::violation::Violation;

const ROUTER: &str = include_str!("testdata/vllm-router-0.1.17-spans.jsonl");

const OK_TRACE: &str = "42bb2aef790dab69974eccded0244562";
const REJ_TRACE: &str = "91ff8459ef70bf83a7dec6dd7f30f862";
const PREFILL: &str = "127.0.0.1:44099";
const DECODE: &str = "127.0.0.1:44491";
/// N of each request: `cmpl-` + the X-Request-Id the router sent both legs (record.json).
const OK_N: &str = "cmpl-___prefill_addr_127.0.0.1:44099___decode_addr_127.0.0.1:44491_92943ea991f84dd492cfdab00e719b30";
const REJ_N: &str = "cmpl-___prefill_addr_127.0.0.1:44099___decode_addr_127.0.0.1:44491_b6550f42e0e54665855e235bec83aa80";

const MS: u64 = 1_000_000;
const S: u64 = 1_000_000_000;

fn trace_bytes(hex: &str) -> Vec<u8> {
    (0..16)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

/// The fixture's spans of one trace.
fn router_spans(trace: &str) -> ExportTraceServiceRequest {
    let req = fixture_export(&lines(ROUTER));
    let want = trace_bytes(trace);
    let mut req = req;
    for rs in &mut req.resource_spans {
        for ss in &mut rs.scope_spans {
            ss.spans.retain(|sp| sp.trace_id == want);
        }
    }
    req.resource_spans
        .retain(|rs| rs.scope_spans.iter().any(|ss| !ss.spans.is_empty()));
    req
}

fn d(k: &str, v: f64) -> KeyValue {
    kv(k, Value::DoubleValue(v))
}
fn i(k: &str, v: i64) -> KeyValue {
    kv(k, Value::IntValue(v))
}

/// vLLM's `llm_request` span as contract-14 gives it (times in ns, from `start`).
fn llm_request(trace: &str, n: &str, start: u64, max_tokens: i64, completion: i64) -> Span {
    let mut sp = span(
        0,
        0x77 + completion as u64,
        0x55,
        vllm::SPAN_NAME,
        start,
        start + 20 * MS,
        vec![
            s("gen_ai.request.id", n),
            i("gen_ai.usage.prompt_tokens", 4),
            i("gen_ai.usage.completion_tokens", completion),
            i("gen_ai.request.max_tokens", max_tokens),
            d("gen_ai.latency.time_in_queue", 0.001),
            d("gen_ai.latency.time_to_first_token", 0.005),
            d("gen_ai.latency.e2e", 0.020),
            d("gen_ai.latency.time_in_model_prefill", 0.004),
            d("gen_ai.latency.time_in_model_decode", 0.014),
        ],
    );
    sp.trace_id = trace_bytes(trace);
    sp
}

fn vllm_export(stage: Option<&str>, spans: Vec<Span>) -> ExportTraceServiceRequest {
    let mut attrs = vec![s("service.name", "vllm")];
    if let Some(st) = stage {
        attrs.push(s("revenant.stage", st));
    }
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(Resource {
                attributes: attrs,
                ..Default::default()
            }),
            scope_spans: vec![ScopeSpans {
                scope: Some(InstrumentationScope {
                    name: "vllm.llm_engine".into(),
                    ..Default::default()
                }),
                spans,
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        }],
    }
}

fn of(ev: &[LifecycleEvent], trace: &str) -> Vec<LifecycleEvent> {
    ev.iter()
        .filter(|e| e.ids.trace_id.as_deref() == Some(trace))
        .cloned()
        .collect()
}

fn rejections(ev: &[LifecycleEvent]) -> Vec<&LifecycleEvent> {
    ev.iter()
        .filter(|e| e.stage == Stage::Prefill && e.kind == Kind::Rejected)
        .collect()
}

#[test]
fn vllm_router_fixture_maps_the_real_spans() {
    let mut n = normalizer();
    let (ev, tally) = run(&mut n, &fixture_export(&lines(ROUTER)), 1);
    assert_eq!(tally.spans[ProfileLabel::VllmRouter as usize], 5);
    assert_eq!(tally.total_unmapped(), 0, "{tally:?}");

    let ok = of(&ev, OK_TRACE);
    let got: Vec<_> = ok
        .iter()
        .map(|e| {
            (
                e.stage,
                e.kind,
                e.to,
                e.worker.as_deref(),
                e.status,
                e.time_ns,
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![
            (
                Stage::Router,
                Kind::Received,
                None,
                None,
                None,
                1796191090548831213
            ),
            (
                Stage::Router,
                Kind::Completed,
                None,
                None,
                Some(200),
                1796191090550651501
            ),
            (
                Stage::Router,
                Kind::Dispatched,
                Some(Stage::Prefill),
                Some(PREFILL),
                None,
                1796191090549090071
            ),
            (
                Stage::Router,
                Kind::Dispatched,
                Some(Stage::Decode),
                Some(DECODE),
                None,
                1796191090550223239
            ),
        ],
        "{ok:#?}"
    );
    assert_eq!(ok[0].ids.request_id.as_deref(), Some("client-ok-1"));
    assert_eq!(ok[0].detail.as_deref(), Some("/v1/completions"));
    assert!(
        ev.iter().all(|e| !e.ids.names_attempt()),
        "no router span names N"
    );

    let rej = of(&ev, REJ_TRACE);
    let got: Vec<_> = rej
        .iter()
        .map(|e| (e.stage, e.kind, e.to, e.status, e.time_ns))
        .collect();
    assert_eq!(
        got,
        vec![
            (
                Stage::Router,
                Kind::Received,
                None,
                None,
                1796191090551276977
            ),
            (
                Stage::Router,
                Kind::Completed,
                None,
                Some(400),
                1796191090594120930
            ),
            (
                Stage::Router,
                Kind::Dispatched,
                Some(Stage::Prefill),
                None,
                1796191090551386964
            ),
            (
                Stage::Prefill,
                Kind::Rejected,
                None,
                Some(400),
                1796191090594968246
            ),
        ],
        "{rej:#?}"
    );
    assert_eq!(rej[0].ids.request_id.as_deref(), Some("client-rej-1"));
    assert_eq!(rej[3].worker.as_deref(), Some(PREFILL));
    // The rejection waits for the rid the worker spans of its trace may name.
    assert_eq!(n.join_pending(), 1);
}

#[test]
fn vllm_router_chosen_by_service_name_or_scope_and_by_config_name() {
    let res = [s("service.name", "vllm-router")];
    assert_eq!(
        builtin_profile(&SpanCtx::new(&res, "whatever")),
        Some(ProfileId::VllmRouter)
    );
    let res = [s("service.name", "x")];
    assert_eq!(
        builtin_profile(&SpanCtx::new(&res, "vllm-router")),
        Some(ProfileId::VllmRouter)
    );
    let res = [s("service.name", "vllm")];
    assert_eq!(
        builtin_profile(&SpanCtx::new(&res, "vllm.llm_engine")),
        Some(ProfileId::Vllm)
    );
    let cfg: NormalizeConfig =
        serde_saphyr::from_str("by_service_name: { my-router: vllm-router }").unwrap();
    assert!(Normalizer::new(&cfg).is_ok());
}

/// Router spans first, vLLM's decode span (naming N) later: the pending rejection is emitted
/// again with rid N when N turns up.
#[test]
fn join_router_first() {
    let mut n = normalizer();
    let (ev, _) = run(&mut n, &router_spans(REJ_TRACE), 1);
    let r = rejections(&ev);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].ids.rid, None, "request-level until N is known");
    let start = 1796191090595000000;
    let (ev2, tally) = run(
        &mut n,
        &vllm_export(None, vec![llm_request(REJ_TRACE, REJ_N, start, 8, 8)]),
        2,
    );
    let r = rejections(&ev2);
    assert_eq!(r.len(), 1, "{ev2:#?}");
    assert_eq!(r[0].ids.rid.as_deref(), Some(REJ_N));
    assert_eq!(r[0].ids.trace_id.as_deref(), Some(REJ_TRACE));
    assert_eq!(
        (r[0].status, r[0].time_ns),
        (Some(400), 1796191090594968246)
    );
    assert_eq!(tally.join_count(JoinOutcome::Resolved), 1);
    assert_eq!(n.join_pending(), 0);
    // The decode span itself: decode events with rid N in the same trace.
    assert!(
        ev2.iter()
            .filter(|e| e.kind != Kind::Rejected)
            .all(|e| e.stage == Stage::Decode && e.ids.rid.as_deref() == Some(REJ_N))
    );
}

/// vLLM's span first: the rejection arrives knowing N and is emitted with and without it.
#[test]
fn join_worker_first() {
    let mut n = normalizer();
    let start = 1796191090595000000;
    let (ev, _) = run(
        &mut n,
        &vllm_export(None, vec![llm_request(REJ_TRACE, REJ_N, start, 8, 8)]),
        1,
    );
    assert!(rejections(&ev).is_empty());
    let (ev2, tally) = run(&mut n, &router_spans(REJ_TRACE), 2);
    let r = rejections(&ev2);
    assert_eq!(r.len(), 2, "{ev2:#?}");
    assert_eq!(r[0].ids.rid, None);
    assert_eq!(r[1].ids.rid.as_deref(), Some(REJ_N));
    assert_eq!(tally.join_count(JoinOutcome::Resolved), 1);
    assert_eq!(n.join_pending(), 0);
}

fn rejected_span(trace: u8, start: u64) -> Span {
    let mut sp = span(
        trace,
        2,
        1,
        "POST /v1/completions",
        start,
        start + MS,
        vec![
            s(vllm_router::PHASE, "prefill"),
            s("server.address", "127.0.0.1"),
            s("server.port", "8100"),
            s("http.response.status_code", "400"),
        ],
    );
    sp.kind = opentelemetry_proto::tonic::trace::v1::span::SpanKind::Client as i32;
    sp
}

#[test]
fn join_is_bounded_and_counts_what_it_drops() {
    let cfg = NormalizeConfig {
        trace_join: JoinConfig {
            max_pending: 2,
            max_traces: 1,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut n = Normalizer::new(&cfg).unwrap();
    let spans = (1..=3).map(|t| rejected_span(t, t as u64 * S)).collect();
    let (ev, tally) = run(&mut n, &export("vllm-router", "vllm-router", spans), 10);
    assert_eq!(
        rejections(&ev).len(),
        3,
        "each emitted request-level at once"
    );
    assert_eq!(tally.join_count(JoinOutcome::EvictedPending), 1);
    assert_eq!(n.join_pending(), 2);
    // The oldest (trace 1) was given up: its N arriving later resolves nothing.
    let mut w1 = llm_request(OK_TRACE, "cmpl-1", 5 * S, 8, 8);
    w1.trace_id = vec![1; 16];
    let (ev, t1) = run(&mut n, &vllm_export(None, vec![w1]), 11);
    assert!(rejections(&ev).is_empty());
    assert_eq!(t1.join_count(JoinOutcome::Resolved), 0);
    // Trace 2's N resolves its rejection; remembering it pushes trace 1's rid out (max_traces 1).
    let mut w2 = llm_request(OK_TRACE, "cmpl-2", 5 * S, 8, 8);
    w2.trace_id = vec![2; 16];
    let (ev, t2) = run(&mut n, &vllm_export(None, vec![w2]), 12);
    assert_eq!(rejections(&ev)[0].ids.rid.as_deref(), Some("cmpl-2"));
    assert_eq!(t2.join_count(JoinOutcome::Resolved), 1);
    assert_eq!(t2.join_count(JoinOutcome::EvictedTrace), 1);
    assert_eq!(n.join_pending(), 1);
    // Trace 3's rejection expires after the TTL (60 s of arrival time), counted.
    let mut t = Tally::default();
    n.tick(10 + 59 * S, &mut Vec::new(), &mut t);
    assert_eq!(n.join_pending(), 1, "not before the TTL");
    n.tick(10 + 60 * S, &mut Vec::new(), &mut t);
    assert_eq!(n.join_pending(), 0);
    assert_eq!(t.join_count(JoinOutcome::Expired), 1);
    assert!(
        Normalizer::new(&NormalizeConfig {
            trace_join: JoinConfig {
                max_pending: 0,
                ..Default::default()
            },
            ..Default::default()
        })
        .is_err()
    );
}

#[test]
fn vllm_stage_from_resource_else_inferred() {
    let stages = |stage: Option<&str>, max_tokens: i64, completion: i64| {
        let (ev, _) = run(
            &mut normalizer(),
            &vllm_export(
                stage,
                vec![llm_request(OK_TRACE, OK_N, S, max_tokens, completion)],
            ),
            1,
        );
        assert!(ev.iter().all(|e| e.ids.rid.as_deref() == Some(OK_N)
            && e.ids.trace_id.as_deref() == Some(OK_TRACE)
            && e.input_tokens == Some(4)));
        let mut st: Vec<_> = ev.iter().map(|e| e.stage).collect();
        st.dedup();
        st
    };
    assert_eq!(stages(None, 1, 1), vec![Stage::Prefill]);
    assert_eq!(stages(None, 8, 8), vec![Stage::Decode]);
    assert_eq!(stages(None, 1, 0), vec![Stage::Prefill]);
    // max_tokens 1 but more generated: not the router's prefill leg.
    assert_eq!(stages(None, 1, 2), vec![Stage::Decode]);
    assert_eq!(stages(Some("decode"), 1, 1), vec![Stage::Decode]);
    assert_eq!(stages(Some("prefill"), 8, 8), vec![Stage::Prefill]);
    assert_eq!(vllm::infer_stage(None, None), Stage::Decode);
}

// ---- what the checker makes of it ----

fn judge(exports: &[ExportTraceServiceRequest]) -> Vec<Violation> {
    let mut n = normalizer();
    let mut c = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
    let mut v = Vec::new();
    for (k, req) in exports.iter().enumerate() {
        let (ev, _) = run(&mut n, req, k as u64 + 1);
        for e in &ev {
            v.extend(c.observe(e));
        }
    }
    // Past every deadline of the default rules (stuck-attempt's 330 s is the longest).
    v.extend(c.tick(1796191090 * S + 3600 * S));
    v
}

fn count(v: &[Violation], rule: &str) -> usize {
    v.iter().filter(|v| v.rule == rule).count()
}

/// The older bug: prefill answered 400, yet the router sent the request to decode, which
/// generated. Router spans as the real ones, with the decode leg the fix removed.
#[test]
fn handoff_after_prefill_rejection_is_one_violation_either_order() {
    let mut router = router_spans(REJ_TRACE);
    let prefill_end = 1796191090594968246;
    let mut decode_leg = router
        .resource_spans
        .iter()
        .flat_map(|rs| &rs.scope_spans)
        .flat_map(|ss| &ss.spans)
        .find(|sp| attrs::str(&sp.attributes, vllm_router::PHASE) == Some("prefill"))
        .unwrap()
        .clone();
    decode_leg.span_id = vec![0x0d; 8];
    decode_leg.start_time_unix_nano = prefill_end + MS;
    decode_leg.end_time_unix_nano = prefill_end + 30 * MS;
    for a in &mut decode_leg.attributes {
        match a.key.as_str() {
            "vllm.request_phase" => *a = s("vllm.request_phase", "decode"),
            "http.response.status_code" => *a = s("http.response.status_code", "200"),
            "server.port" => *a = s("server.port", "44491"),
            _ => {}
        }
    }
    // The client got decode's answer: the SERVER span ends with it.
    for sp in router
        .resource_spans
        .iter_mut()
        .flat_map(|rs| &mut rs.scope_spans)
        .flat_map(|ss| &mut ss.spans)
        .filter(|sp| attrs::has(&sp.attributes, "request_id"))
    {
        sp.end_time_unix_nano = prefill_end + 31 * MS;
        for a in &mut sp.attributes {
            if a.key == "http.response.status_code" {
                *a = s("http.response.status_code", "200");
            }
        }
    }
    let mut leg = router.resource_spans[0].clone();
    leg.scope_spans[0].spans = vec![decode_leg];
    router.resource_spans.push(leg);
    let decode = vllm_export(
        None,
        vec![llm_request(REJ_TRACE, REJ_N, prefill_end + 2 * MS, 8, 8)],
    );

    for order in [
        [router.clone(), decode.clone()],
        [decode.clone(), router.clone()],
    ] {
        let v = judge(&order);
        assert_eq!(count(&v, "activity-after-rejection"), 1, "{v:#?}");
        assert_eq!(count(&v, "activity-after-request-failed"), 0, "{v:#?}");
        let aar = v
            .iter()
            .find(|v| v.rule == "activity-after-rejection")
            .unwrap();
        assert_eq!(aar.attempt.rid.as_deref(), Some(REJ_N), "{aar:#?}");
    }
}

/// vllm-router 0.1.17: prefill 400 answered to the client, decode never contacted.
#[test]
fn correct_flow_prefill_rejection_alone_is_no_violation() {
    let v = judge(&[router_spans(REJ_TRACE)]);
    assert!(v.is_empty(), "{v:#?}");
}

/// Both legs succeed: prefill's `llm_request` (max_tokens 1) and decode's, N on both.
#[test]
fn successful_flow_is_no_violation() {
    let pre = vllm_export(
        None,
        vec![llm_request(OK_TRACE, OK_N, 1796191090549100000, 1, 1)],
    );
    let dec = vllm_export(
        None,
        vec![llm_request(OK_TRACE, OK_N, 1796191090550300000, 8, 8)],
    );
    for order in [
        [router_spans(OK_TRACE), pre.clone(), dec.clone()],
        [dec.clone(), pre.clone(), router_spans(OK_TRACE)],
    ] {
        let v = judge(&order);
        assert!(v.is_empty(), "{v:#?}");
    }
}

/// A decode leg's end (even a 5xx) is the router's view only: dispatched, nothing about decode.
#[test]
fn decode_leg_end_claims_nothing_about_decode() {
    let mut sp = rejected_span(9, S);
    for a in &mut sp.attributes {
        if a.key == vllm_router::PHASE {
            *a = s(vllm_router::PHASE, "decode");
        }
        if a.key == "http.response.status_code" {
            *a = s("http.response.status_code", "503");
        }
    }
    let mut n = normalizer();
    let (ev, tally) = run(&mut n, &export("vllm-router", "vllm-router", vec![sp]), 1);
    let got: Vec<_> = ev.iter().map(|e| (e.stage, e.kind, e.to)).collect();
    assert_eq!(
        got,
        vec![(Stage::Router, Kind::Dispatched, Some(Stage::Decode))]
    );
    assert_eq!(tally.total_unmapped(), 0);
    assert_eq!(n.join_pending(), 0);
}
