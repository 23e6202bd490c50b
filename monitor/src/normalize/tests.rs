//! Profile tests against the real captures in `testdata/` (copied from shared/fixtures) and
//! against synthetic spans for shapes the captures do not show.

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{
    AnyValue, InstrumentationScope, KeyValue, any_value::Value,
};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{
    ResourceSpans, ScopeSpans, Span, Status, span::Event, status::StatusCode,
};

use super::*;
use crate::event::{BootstrapRoom, Kind, LifecycleEvent, Stage};
use crate::ingest::otlp::json;

const SMG: &str = include_str!("testdata/smg-0.3.2-spans.jsonl");
const SMG_1_13: &str = include_str!("testdata/smg-1.13.0-spans.jsonl");
const SGLANG: &str = include_str!("testdata/sglang-0.5.23-trace-spans.jsonl");

/// A fixture line is one span plus `_resource` (flat map) and `_scope` (name): wrap it in a
/// real OTLP/JSON export and decode it with the receiver's decoder.
pub(super) fn fixture_export(lines: &[&str]) -> ExportTraceServiceRequest {
    let mut rs = Vec::new();
    for line in lines {
        let mut span: serde_json::Value = serde_json::from_str(line).unwrap();
        let obj = span.as_object_mut().unwrap();
        let resource = obj.remove("_resource").unwrap();
        let scope = obj.remove("_scope").unwrap();
        let attrs: Vec<_> = resource
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| serde_json::json!({"key": k, "value": {"stringValue": v}}))
            .collect();
        rs.push(serde_json::json!({
            "resource": {"attributes": attrs},
            "scopeSpans": [{"scope": {"name": scope}, "spans": [span]}]
        }));
    }
    let doc = serde_json::json!({ "resourceSpans": rs });
    json::decode_traces(doc.to_string().as_bytes()).unwrap()
}

pub(super) fn lines(s: &str) -> Vec<&str> {
    s.lines().filter(|l| !l.trim().is_empty()).collect()
}

pub(super) fn run(
    n: &mut Normalizer,
    req: &ExportTraceServiceRequest,
    now: u64,
) -> (Vec<LifecycleEvent>, Tally) {
    let mut out = Vec::new();
    let mut tally = Tally::default();
    n.traces(req, now, &mut out, &mut tally);
    (out, tally)
}

pub(super) fn normalizer() -> Normalizer {
    Normalizer::new(&NormalizeConfig::default()).unwrap()
}

fn kinds(ev: &[LifecycleEvent]) -> Vec<(Stage, Kind)> {
    let mut v: Vec<_> = ev.iter().map(|e| (e.stage, e.kind)).collect();
    v.sort();
    v
}

#[test]
fn smg_fixture_rejected_request() {
    let (ev, tally) = run(&mut normalizer(), &fixture_export(&lines(SMG)), 1);
    assert_eq!(tally.spans[ProfileLabel::Smg as usize], 1);
    assert_eq!(ev.len(), 4, "{ev:#?}");
    for e in &ev {
        assert_eq!(e.stage, Stage::Router);
        assert_eq!(e.ids.request_id.as_deref(), Some("traced-rej2"));
        assert_eq!(
            e.ids.trace_id.as_deref(),
            Some("fa084eb02ad3bbf06c3f398bd391a50a")
        );
        assert!(!e.ids.names_attempt(), "router events are request-level");
    }
    assert_eq!(
        (ev[0].kind, ev[0].time_ns),
        (Kind::Received, 1795986795535483043)
    );
    assert_eq!(ev[0].detail.as_deref(), Some("/generate"));
    assert_eq!(
        (ev[1].kind, ev[1].to, ev[1].worker.as_deref()),
        (
            Kind::Dispatched,
            Some(Stage::Prefill),
            Some("http://127.0.0.1:31001")
        )
    );
    assert_eq!(
        (ev[2].kind, ev[2].to, ev[2].worker.as_deref()),
        (
            Kind::Dispatched,
            Some(Stage::Decode),
            Some("http://127.0.0.1:31002")
        )
    );
    assert_eq!(ev[1].time_ns, 1795986795535695349);
    assert_eq!(
        (ev[3].kind, ev[3].status, ev[3].time_ns),
        (Kind::Completed, Some(400), 1795986795536964845)
    );
}

/// smg 1.13.0: a prefill 400 (one attempt, the client's traceparent continued) and a prefill 503
/// retried with five attempts in one span; the path now comes in `path`.
#[test]
fn smg_1_13_fixture_rejection_and_retried_503() {
    let (ev, tally) = run(&mut normalizer(), &fixture_export(&lines(SMG_1_13)), 1);
    assert_eq!(tally.spans[ProfileLabel::Smg as usize], 2);
    for e in &ev {
        assert_eq!(e.stage, Stage::Router);
        assert!(!e.ids.names_attempt(), "router events are request-level");
    }
    let of = |rid: &str| -> Vec<&LifecycleEvent> {
        ev.iter()
            .filter(|e| e.ids.request_id.as_deref() == Some(rid))
            .collect()
    };
    let rej = of("rej-1");
    assert_eq!(rej.len(), 4, "{rej:#?}");
    assert!(
        rej.iter()
            .all(|e| e.ids.trace_id.as_deref() == Some("0af7651916cd43dd8448eb211c80319c"))
    );
    assert_eq!(
        (rej[0].kind, rej[0].time_ns, rej[0].detail.as_deref()),
        (Kind::Received, 1796163520066952148, Some("/generate"))
    );
    assert_eq!(
        rej[1..3]
            .iter()
            .map(|e| (e.kind, e.to, e.time_ns))
            .collect::<Vec<_>>(),
        vec![
            (Kind::Dispatched, Some(Stage::Prefill), 1796163520067596328),
            (Kind::Dispatched, Some(Stage::Decode), 1796163520067596328),
        ]
    );
    assert_eq!(
        (rej[3].kind, rej[3].status, rej[3].time_ns),
        (Kind::Completed, Some(400), 1796163520068332412)
    );
    let storm = of("storm-1");
    assert_eq!(
        storm.len(),
        12,
        "received, 5 x 2 dispatches, completed: {storm:#?}"
    );
    let dispatched: Vec<_> = storm
        .iter()
        .filter(|e| e.kind == Kind::Dispatched)
        .map(|e| e.to)
        .collect();
    assert_eq!(
        dispatched,
        [Some(Stage::Prefill), Some(Stage::Decode)].repeat(5)
    );
    let last = storm.last().unwrap();
    assert_eq!((last.kind, last.status), (Kind::Completed, Some(503)));
}

fn check_sglang_rejection(ev: &[LifecycleEvent]) {
    assert_eq!(
        kinds(ev),
        vec![
            (Stage::Prefill, Kind::Received),
            (Stage::Prefill, Kind::Rejected)
        ],
        "{ev:#?}"
    );
    let room: BootstrapRoom = "0x314783f6bef71155".parse().unwrap();
    for e in ev {
        assert_eq!(
            e.ids.rid.as_deref(),
            Some("8f3c2b1a9d7e4f60a1b2c3d4e5f60718")
        );
        assert_eq!(e.ids.bootstrap_room, Some(room));
        assert_eq!(
            e.ids.trace_id.as_deref(),
            Some("91f2d42643e31dfc9c047a63ebd93b66")
        );
    }
    let rej = ev.iter().find(|e| e.kind == Kind::Rejected).unwrap();
    // The abort sits on the scheduler thread span: its end time, its pid.
    assert_eq!(rej.time_ns, 1795986865115326061);
    assert_eq!(rej.pid, Some(14231));
    assert!(
        rej.reason
            .as_deref()
            .unwrap()
            .contains("exceeds the maximum number of tokens")
    );
    assert_eq!(
        (rej.input_tokens, rej.max_input_tokens),
        (Some(9000), Some(8192))
    );
    let rec = ev.iter().find(|e| e.kind == Kind::Received).unwrap();
    assert_eq!(rec.time_ns, 1795986865114562929);
    // One process is one clock: the thread span's `host_id` must not give the rejection a node
    // its root's events lack, or the checker would apply the cross-node skew between them and
    // miss a handoff a few ms after the rejection.
    assert!(ev.iter().all(|e| e.node == rec.node), "{ev:#?}");
}

#[test]
fn sglang_fixture_children_before_root_in_one_export() {
    let mut n = normalizer();
    let (ev, tally) = run(&mut n, &fixture_export(&lines(SGLANG)), 1);
    check_sglang_rejection(&ev);
    assert_eq!(tally.spans[ProfileLabel::Sglang as usize], 6);
    assert_eq!(n.orphans_waiting(), 0);
    // tokenize, api_server_dispatch, prefill_prepare, the tokenizer thread span: structure only.
    assert_eq!(
        tally.unmapped_count(ProfileLabel::Sglang, Unmapped::UnknownSpan),
        4
    );
}

#[test]
fn sglang_fixture_one_span_per_export_any_order() {
    let all = lines(SGLANG);
    let orders: Vec<Vec<usize>> = vec![
        (0..6).collect(),
        (0..6).rev().collect(),
        vec![3, 0, 5, 1, 4, 2],
    ];
    for order in orders {
        let mut n = normalizer();
        let mut ev = Vec::new();
        for (t, i) in order.iter().enumerate() {
            ev.extend(run(&mut n, &fixture_export(&[all[*i]]), t as u64 + 1).0);
        }
        // Even when the root came first, the abort below it cancels its completion.
        n.tick(u64::MAX / 2, &mut ev, &mut Tally::default());
        check_sglang_rejection(&ev);
        assert_eq!(n.orphans_waiting(), 0, "order {order:?}");
    }
}

#[test]
fn sglang_orphans_expire_and_are_counted() {
    let all = lines(SGLANG);
    let mut n = normalizer();
    // Everything but the root: 5 spans wait for an attempt that never comes.
    let (ev, tally) = run(&mut n, &fixture_export(&all[..5]), 1_000);
    assert!(ev.is_empty());
    assert_eq!(tally.orphans_buffered, 5);
    assert_eq!(n.orphans_waiting(), 5);
    let mut t = Tally::default();
    let mut none = Vec::new();
    n.tick(1_000 + 29_000_000_000, &mut none, &mut t);
    assert_eq!(n.orphans_waiting(), 5, "not before the TTL");
    n.tick(1_000 + 30_000_000_000, &mut none, &mut t);
    assert!(none.is_empty());
    assert_eq!(n.orphans_waiting(), 0);
    assert_eq!(
        t.unmapped_count(ProfileLabel::Sglang, Unmapped::OrphanExpired),
        5
    );
    // The root arriving late still yields its own events, but the given-up children are gone.
    let (mut ev, _) = run(&mut n, &fixture_export(&all[5..]), 40_000_000_000);
    assert_eq!(kinds(&ev), vec![(Stage::Prefill, Kind::Received)]);
    // Its completion is believed only after the grace period without an abort from below.
    n.tick(44_000_000_000, &mut ev, &mut t);
    assert_eq!(ev.len(), 1);
    n.tick(45_000_000_000, &mut ev, &mut t);
    assert_eq!(
        kinds(&ev),
        vec![
            (Stage::Prefill, Kind::Received),
            (Stage::Prefill, Kind::Completed)
        ]
    );
}

#[test]
fn sglang_orphans_bounded_in_count() {
    let cfg = NormalizeConfig {
        sglang: sglang::TreeConfig {
            max_orphans: 2,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut n = Normalizer::new(&cfg).unwrap();
    let all = lines(SGLANG);
    let (_, tally) = run(&mut n, &fixture_export(&all[..5]), 1);
    assert!(n.orphans_waiting() <= 2);
    let evicted = tally.unmapped_count(ProfileLabel::Sglang, Unmapped::OrphanEvicted);
    assert_eq!(
        evicted as usize + n.orphans_waiting(),
        5,
        "every orphan is either waiting or counted"
    );
}

// ---- synthetic spans ----

/// One SGLang attempt: its scheduler thread span (an abort when `abort`) and its request root,
/// the two spans the tree remembers. Span ids are unique across traces.
fn sglang_attempt(i: u64, abort: bool) -> Vec<Span> {
    let trace = (i % 200) as u8 + 1;
    let rid = format!("rid-{i}");
    let mut thread = span(
        trace,
        i << 8 | 2,
        i << 8 | 1,
        "Prefill Scheduler [TP 0] (host:a | pid:1)",
        12,
        18,
        vec![s("thread_label", "Prefill Scheduler")],
    );
    if abort {
        thread.attributes.push(s("reason", "client disconnected"));
        thread.status = Some(Status {
            message: String::new(),
            code: StatusCode::Error as i32,
        });
    }
    let root = span(
        trace,
        i << 8 | 1,
        0,
        &format!("prefill Req {rid}"),
        10,
        20,
        vec![s("rid", &rid)],
    );
    vec![thread, root]
}

fn sglang_attempts(range: std::ops::Range<u64>) -> ExportTraceServiceRequest {
    export(
        "sglang",
        "sglang server",
        range.flat_map(|i| sglang_attempt(i, false)).collect(),
    )
}

fn completed_rids(ev: &[LifecycleEvent]) -> Vec<String> {
    ev.iter()
        .filter(|e| e.kind == Kind::Completed)
        .filter_map(|e| e.ids.rid.as_deref().map(str::to_string))
        .collect()
}

fn bounded_tree(max_known: usize, max_completions: usize) -> Normalizer {
    Normalizer::new(&NormalizeConfig {
        sglang: sglang::TreeConfig {
            max_known,
            max_orphans: 10,
            max_completions,
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap()
}

#[test]
fn sglang_tree_stops_growing_at_its_caps_and_counts_what_it_evicts() {
    let (max_known, max_completions) = (100, 50);
    let mut n = bounded_tree(max_known, max_completions);
    let (ev, _) = run(&mut n, &sglang_attempts(0..1000), 1);
    let ev_completed = completed_rids(&ev).len() as u64;
    let bytes = n.tree_bytes();
    let e = n.tree_evictions();
    assert_eq!(n.pending_completions(), max_completions);
    assert_eq!(e.completions, 1000 - max_completions as u64);
    assert_eq!(ev_completed, e.completions, "released early, not dropped");
    // 2000 spans to remember, at most two generations of `max_known` kept.
    assert!(e.known >= 2000 - 2 * (max_known as u64 + 1), "{e:?}");
    assert_eq!(e.total(), e.known + e.orphans + e.completions);
    let bound = max_known * sglang::cost::KNOWN
        + max_completions * sglang::cost::COMPLETION
        + 10 * sglang::cost::ORPHAN;
    assert!(bytes <= bound, "{bytes} B estimated, bound {bound} B");
    // Ten times the traffic: the tree holds no more than before.
    let _ = run(&mut n, &sglang_attempts(1000..11_000), 2);
    assert!(
        n.tree_bytes() <= bound,
        "{} B after 10k more",
        n.tree_bytes()
    );
    assert_eq!(n.pending_completions(), max_completions);
}

#[test]
fn sglang_a_completion_is_believed_once_its_attempt_is_forgotten_never_after_an_abort() {
    let mut n = bounded_tree(8, 1_000);
    let grace = sglang::TreeConfig::default().completion_grace.as_nanos() as u64;
    // rid-0 completes; then an abort arrives for rid-1 after its root (a later export).
    let (ev, _) = run(&mut n, &sglang_attempts(0..1), 1);
    assert!(completed_rids(&ev).is_empty(), "waits out its grace");
    let root_1 = sglang_attempt(1, true).pop().unwrap();
    let _ = run(&mut n, &export("sglang", "sglang server", vec![root_1]), 2);
    let thread_1 = sglang_attempt(1, true).remove(0);
    let (ev, _) = run(
        &mut n,
        &export("sglang", "sglang server", vec![thread_1]),
        3,
    );
    assert!(ev.iter().any(|e| e.kind == Kind::Aborted), "{ev:#?}");
    // Enough other attempts to push both out of the bounded tree.
    let _ = run(&mut n, &sglang_attempts(2..100), 4);
    assert!(n.tree_evictions().known > 0);
    let mut out = Vec::new();
    n.tick(5 + grace, &mut out, &mut Tally::default());
    let done = completed_rids(&out);
    assert!(done.contains(&"rid-0".to_string()), "{done:?}");
    assert!(
        !done.contains(&"rid-1".to_string()),
        "an aborted attempt's completion: {done:?}"
    );
}

#[test]
fn sglang_completions_released_early_at_the_cap_keep_an_abort() {
    let mut n = bounded_tree(100_000, 2);
    // rid-0's root, then its abort from below, then two more completions push it out early.
    let root_0 = sglang_attempt(0, true).pop().unwrap();
    let _ = run(&mut n, &export("sglang", "sglang server", vec![root_0]), 1);
    let thread_0 = sglang_attempt(0, true).remove(0);
    let _ = run(
        &mut n,
        &export("sglang", "sglang server", vec![thread_0]),
        2,
    );
    let (ev, _) = run(&mut n, &sglang_attempts(1..4), 3);
    assert_eq!(n.tree_evictions().completions, 2);
    let done = completed_rids(&ev);
    assert_eq!(
        done,
        vec!["rid-1".to_string()],
        "rid-0 aborted: never completed"
    );
}

pub(super) fn kv(k: &str, v: Value) -> KeyValue {
    KeyValue {
        key: k.into(),
        value: Some(AnyValue { value: Some(v) }),
        key_strindex: 0,
    }
}
pub(super) fn s(k: &str, v: &str) -> KeyValue {
    kv(k, Value::StringValue(v.into()))
}

pub(super) fn span(
    trace: u8,
    id: u64,
    parent: u64,
    name: &str,
    start: u64,
    end: u64,
    attrs: Vec<KeyValue>,
) -> Span {
    Span {
        trace_id: vec![trace; 16],
        span_id: id.to_be_bytes().to_vec(),
        parent_span_id: if parent == 0 {
            vec![]
        } else {
            parent.to_be_bytes().to_vec()
        },
        name: name.into(),
        start_time_unix_nano: start,
        end_time_unix_nano: end,
        attributes: attrs,
        ..Default::default()
    }
}

pub(super) fn export(service: &str, scope: &str, spans: Vec<Span>) -> ExportTraceServiceRequest {
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(Resource {
                attributes: vec![s("service.name", service)],
                ..Default::default()
            }),
            scope_spans: vec![ScopeSpans {
                scope: Some(InstrumentationScope {
                    name: scope.into(),
                    ..Default::default()
                }),
                spans,
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        }],
    }
}

#[test]
fn sglang_retries_share_a_trace_but_never_an_attempt() {
    // Two attempts of one client request in one router trace (same trace id), each with its
    // own rid and room: the events must keep the attempts apart.
    let spans = vec![
        span(
            7,
            11,
            0,
            "prefill Req aaaa",
            10,
            20,
            vec![s("rid", "aaaa"), s("bootstrap_room", "0x1")],
        ),
        span(7, 12, 11, "prefill_forward", 12, 15, vec![]),
        span(
            7,
            21,
            0,
            "prefill Req bbbb",
            30,
            40,
            vec![s("rid", "bbbb"), s("bootstrap_room", "0x2")],
        ),
        span(7, 22, 21, "prefill_forward", 32, 35, vec![]),
    ];
    let (ev, _) = run(
        &mut normalizer(),
        &export("sglang", "sglang server", spans),
        1,
    );
    let work: Vec<_> = ev.iter().filter(|e| e.kind == Kind::Work).collect();
    assert_eq!(work.len(), 2);
    assert_eq!(work[0].ids.trace_id, work[1].ids.trace_id);
    let rooms: Vec<_> = work
        .iter()
        .map(|e| {
            (
                e.ids.rid.as_deref().unwrap(),
                e.ids.bootstrap_room.unwrap().0,
            )
        })
        .collect();
    assert!(
        rooms.contains(&("aaaa", 1)) && rooms.contains(&("bbbb", 2)),
        "{rooms:?}"
    );
}

/// SGLang 0.5.23's aborts name the status they are answered with (`trace_ctx.abort(abort_info=
/// finished_reason)`): 400 is a refusal whatever its words, 500 a failure. A sub-request of a
/// body with `n > 1` is rid `X_i`: the root's `rid` is cut at the last `_`, `gen_ai.request.id`
/// is whole. `decode_bootstrap` ends once decode reserved the room's KV: transfer admitted.
#[test]
fn sglang_abort_status_and_sub_request_rids() {
    let error = Status {
        code: StatusCode::Error as i32,
        ..Default::default()
    };
    let thread = |id: u64, parent: u64, attrs: Vec<KeyValue>| {
        let mut t = span(
            1,
            id,
            parent,
            "Prefill Scheduler [TP 0] (host:ab | pid:9)",
            10,
            20,
            [vec![s("thread_label", "Prefill Scheduler")], attrs].concat(),
        );
        t.status = Some(error.clone());
        t
    };
    let root = |id: u64, rid: &str, room: &str| {
        span(
            1,
            id,
            0,
            "prefill Req 1",
            5,
            21,
            vec![
                s("rid", rid.rsplit('_').next().unwrap()),
                s("bootstrap_room", room),
                s("gen_ai.request.id", rid),
            ],
        )
    };
    let spans = vec![
        thread(
            2,
            1,
            vec![
                s("type", "abort"),
                s("message", "Prefill refused it"),
                kv("status_code", Value::IntValue(400)),
            ],
        ),
        root(1, "abc_0", "0x10"),
        thread(
            4,
            3,
            vec![
                s("type", "abort"),
                s(
                    "message",
                    "Input length (9000 tokens) exceeds the maximum allowed length (8191 tokens)",
                ),
                kv("status_code", Value::IntValue(500)),
            ],
        ),
        root(3, "abc_1", "0x11"),
        span(1, 6, 5, "decode_bootstrap", 30, 40, vec![]),
        span(
            1,
            5,
            0,
            "decode Req 2",
            25,
            50,
            vec![
                s("rid", "2"),
                s("bootstrap_room", "0x12"),
                s("gen_ai.request.id", "abc_2"),
            ],
        ),
    ];
    let mut n = normalizer();
    let (mut ev, _) = run(&mut n, &export("sglang", "sglang server", spans), 1);
    n.tick(10_000_000_000, &mut ev, &mut Tally::default());
    let got: Vec<_> = ev
        .iter()
        .filter(|e| e.kind != Kind::Received && e.kind != Kind::Completed)
        .map(|e| (e.stage, e.kind, e.ids.rid.as_deref(), e.ids.bootstrap_room))
        .collect();
    assert_eq!(
        got,
        vec![
            (
                Stage::Prefill,
                Kind::Rejected,
                Some("abc_0"),
                Some(BootstrapRoom(0x10))
            ),
            (
                Stage::Prefill,
                Kind::Aborted,
                Some("abc_1"),
                Some(BootstrapRoom(0x11))
            ),
            (
                Stage::Transfer,
                Kind::Admitted,
                Some("abc_2"),
                Some(BootstrapRoom(0x12))
            ),
        ],
        "{ev:#?}"
    );
}

/// A root that says it finished with an abort (`gen_ai.response.finish_reasons`), with no span
/// below it reporting one (SGLang up to 0.5.20 ran a refused request's one-token stub to its end
/// this way), ended without completing.
#[test]
fn sglang_root_finished_by_abort_is_no_completion() {
    let spans = vec![span(
        1,
        1,
        0,
        "prefill Req 5f2e",
        25,
        50,
        vec![
            s("rid", "5f2e"),
            s("bootstrap_room", "0x99"),
            s("module", "sglang::request"),
            s("gen_ai.response.finish_reasons", "[\"abort\"]"),
        ],
    )];
    let mut n = normalizer();
    let (mut ev, mut tally) = run(&mut n, &export("sglang", "sglang server", spans), 1);
    n.tick(10_000_000_000, &mut ev, &mut tally);
    assert_eq!(
        kinds(&ev),
        vec![
            (Stage::Prefill, Kind::Received),
            (Stage::Prefill, Kind::Aborted)
        ],
        "{ev:#?}"
    );
}

/// SGLang's health checks (`HEALTH_CHECK_…` rids) and its warmup (room 0, left out of the root)
/// run on the fake transfer backend: their spans, `decode_bootstrap` included, are no events.
#[test]
fn sglang_fake_transfer_requests_are_no_events() {
    let spans = vec![
        span(1, 2, 1, "decode_bootstrap", 30, 40, vec![]),
        span(
            1,
            1,
            0,
            "decode Req HEALTH_C",
            25,
            50,
            vec![
                s("rid", "HEALTH_CHECK_ab12"),
                s("module", "sglang::request"),
            ],
        ),
        span(2, 4, 3, "prefill_forward", 30, 40, vec![]),
        span(
            2,
            3,
            0,
            "prefill Req 5f2e",
            25,
            50,
            vec![s("rid", "5f2e"), s("module", "sglang::request")],
        ),
    ];
    let mut n = normalizer();
    let (mut ev, mut tally) = run(&mut n, &export("sglang", "sglang server", spans), 1);
    n.tick(10_000_000_000, &mut ev, &mut tally);
    assert!(ev.is_empty(), "{ev:#?}");
    assert_eq!(
        tally.unmapped_count(ProfileLabel::Sglang, Unmapped::FakeTransfer),
        4,
        "{tally:?}"
    );
}

#[test]
fn sglang_decode_leg_and_kv_transfer_root() {
    let spans = vec![
        // Decode thread + slices exported before the root.
        span(1, 3, 2, "decode_loop", 50, 60, vec![]),
        span(1, 4, 2, "decode_transferred", 40, 45, vec![]),
        span(
            1,
            2,
            1,
            "Decode Scheduler [TP 0] (host:ab | pid:9)",
            35,
            60,
            vec![
                s("thread_label", "Decode Scheduler"),
                kv("pid", Value::IntValue(9)),
            ],
        ),
        span(
            1,
            1,
            0,
            "decode Req cafe",
            30,
            61,
            vec![s("rid", "cafe"), s("bootstrap_room", "0x2a")],
        ),
        // KV transfer under its own root whose rid is the hex room.
        span(2, 7, 6, "mooncake_send", 41, 44, vec![]),
        span(2, 6, 0, " Req 0x2a", 40, 45, vec![s("rid", "0x2a")]),
    ];
    let mut n = normalizer();
    let (mut ev, tally) = run(&mut n, &export("sglang-decode", "sglang server", spans), 1);
    n.tick(10_000_000_000, &mut ev, &mut Tally::default());
    assert_eq!(
        kinds(&ev),
        vec![
            (Stage::Transfer, Kind::Work),
            (Stage::Transfer, Kind::Completed),
            (Stage::Decode, Kind::Received),
            (Stage::Decode, Kind::Work),
            (Stage::Decode, Kind::Completed),
        ],
        "{ev:#?}"
    );
    let mc = ev
        .iter()
        .find(|e| e.detail.as_deref() == Some("mooncake_send"))
        .unwrap();
    assert_eq!(
        (mc.ids.rid.as_deref(), mc.ids.bootstrap_room),
        (None, Some(BootstrapRoom(42)))
    );
    assert_eq!(mc.time_ns, 44);
    let dl = ev
        .iter()
        .find(|e| e.detail.as_deref() == Some("decode_loop"))
        .unwrap();
    assert_eq!(
        (dl.ids.rid.as_deref(), dl.ids.bootstrap_room),
        (Some("cafe"), Some(BootstrapRoom(42)))
    );
    assert_eq!(tally.orphans_buffered, 4);
}

#[test]
fn sglang_old_bootstrap_room_parent_gives_the_room() {
    // ≤ 0.5.9: the room sits on a "Bootstrap Room" parent; the root has only the rid.
    let spans = vec![
        span(
            3,
            1,
            0,
            "Bootstrap Room 0x5",
            1,
            100,
            vec![s("bootstrap_room", "0x5")],
        ),
        span(3, 2, 1, "prefill Req beef", 1, 99, vec![s("rid", "beef")]),
        span(
            3,
            3,
            2,
            "Scheduler (host:1 | pid:2)",
            2,
            98,
            vec![s("thread_label", "Scheduler")],
        ),
        span(3, 4, 3, "prefill_forward", 3, 10, vec![]),
    ];
    let mut n = normalizer();
    let (mut ev, _) = run(&mut n, &export("sglang", "sglang server", spans), 1);
    n.tick(10_000_000_000, &mut ev, &mut Tally::default());
    assert_eq!(
        kinds(&ev),
        vec![
            (Stage::Prefill, Kind::Received),
            (Stage::Prefill, Kind::Work),
            (Stage::Prefill, Kind::Completed)
        ]
    );
    assert!(
        ev.iter()
            .all(|e| e.ids.bootstrap_room == Some(BootstrapRoom(5))
                && e.ids.rid.as_deref() == Some("beef"))
    );
}

#[test]
fn smg_router_refusal_is_rejected_and_success_completed() {
    let refused = span(
        1,
        1,
        0,
        "http_request",
        1,
        2,
        vec![s("request_id", "r1"), s("status_code", "503")],
    );
    let mut ok = span(
        1,
        2,
        0,
        "http_request",
        1,
        9,
        vec![s("request_id", "r2"), s("status_code", "200")],
    );
    ok.events.push(Event {
        time_unix_nano: 3,
        name: smg::EVENT_DISPATCH.into(),
        attributes: vec![s("prefill_url", "http://p"), s("decode_url", "http://d")],
        dropped_attributes_count: 0,
    });
    let other = span(1, 3, 0, "some_internal_span", 1, 2, vec![]);
    let (ev, tally) = run(
        &mut normalizer(),
        &export("smg", "smg", vec![refused, ok, other]),
        1,
    );
    let ends: Vec<_> = ev
        .iter()
        .filter(|e| e.kind.is_terminal())
        .map(|e| (e.ids.request_id.as_deref().unwrap(), e.kind, e.status))
        .collect();
    assert_eq!(
        ends,
        vec![
            ("r1", Kind::Rejected, Some(503)),
            ("r2", Kind::Completed, Some(200))
        ]
    );
    assert_eq!(
        tally.unmapped_count(ProfileLabel::Smg, Unmapped::UnknownSpan),
        1
    );
}

#[test]
fn vllm_request_span() {
    let mut sp = span(
        4,
        1,
        0,
        "llm_request",
        1_000_000_000,
        3_000_000_000,
        vec![
            s("gen_ai.request.id", "cmpl-1"),
            kv("gen_ai.usage.prompt_tokens", Value::IntValue(120)),
            kv("gen_ai.usage.completion_tokens", Value::IntValue(16)),
            kv("gen_ai.latency.time_in_queue", Value::DoubleValue(0.25)),
            kv(
                "gen_ai.latency.time_to_first_token",
                Value::DoubleValue(0.5),
            ),
        ],
    );
    let (ev, _) = run(
        &mut normalizer(),
        &export("vllm", "vllm.llm_engine", vec![sp.clone()]),
        1,
    );
    let got: Vec<_> = ev.iter().map(|e| (e.kind, e.time_ns)).collect();
    assert_eq!(
        got,
        vec![
            (Kind::Received, 1_000_000_000),
            (Kind::Admitted, 1_250_000_000),
            (Kind::Work, 1_500_000_000),
            (Kind::Work, 3_000_000_000),
            (Kind::Completed, 3_000_000_000)
        ]
    );
    assert!(ev.iter().all(|e| e.ids.rid.as_deref() == Some("cmpl-1")
        && e.input_tokens == Some(120)
        && e.stage == Stage::Decode));
    // A prefill instance says so through its resource; an ERROR status is an abort.
    sp.status = Some(Status {
        message: String::new(),
        code: StatusCode::Error as i32,
    });
    let mut req = export("vllm", "vllm.llm_engine", vec![sp]);
    req.resource_spans[0]
        .resource
        .as_mut()
        .unwrap()
        .attributes
        .push(s("revenant.stage", "prefill"));
    let (ev, _) = run(&mut normalizer(), &req, 1);
    assert!(ev.iter().all(|e| e.stage == Stage::Prefill));
    assert_eq!(ev.last().unwrap().kind, Kind::Aborted);
}

const GENERIC: &str = r#"
generic:
  - name: mystack
    select: { service_name: my-prefill }
    ids: { request_id: [x-request-id], rid: [req.id], bootstrap_room: [room] }
    tokens: { input_tokens: [gen_ai.usage.input_tokens], max_input_tokens: [limit] }
    status: [http.response.status_code]
    rules:
      - { name: handle, stage: prefill, kind: received, at: start }
      - { name: handle, error: true, stage: prefill, kind: rejected }
      - { name: handle, error: false, stage: prefill, kind: completed }
      - { name_prefix: "fwd", stage: prefill, kind: work }
"#;

#[test]
fn generic_yaml_mapping() {
    let cfg: NormalizeConfig = serde_saphyr::from_str(GENERIC).unwrap();
    let mut n = Normalizer::new(&cfg).unwrap();
    let mut h = span(
        5,
        1,
        0,
        "handle",
        10,
        20,
        vec![
            s("x-request-id", "q"),
            s("req.id", "a1"),
            s("room", "77"),
            kv("gen_ai.usage.input_tokens", Value::IntValue(9000)),
            kv("limit", Value::IntValue(8192)),
            kv("http.response.status_code", Value::IntValue(400)),
        ],
    );
    h.status = Some(Status {
        message: "too long".into(),
        code: StatusCode::Error as i32,
    });
    let f = span(5, 2, 1, "fwd_pass", 12, 14, vec![s("req.id", "a1")]);
    let noids = span(5, 3, 1, "fwd_pass", 12, 14, vec![]);
    let (ev, tally) = run(&mut n, &export("my-prefill", "x", vec![h, f, noids]), 1);
    let got: Vec<_> = ev.iter().map(|e| (e.kind, e.time_ns)).collect();
    // The trace id is still present on the id-less span: it is kept (request-level).
    assert_eq!(
        got,
        vec![
            (Kind::Received, 10),
            (Kind::Rejected, 20),
            (Kind::Work, 14),
            (Kind::Work, 14)
        ]
    );
    assert_eq!(ev[1].status, Some(400));
    assert_eq!(
        (ev[1].input_tokens, ev[1].max_input_tokens),
        (Some(9000), Some(8192))
    );
    assert_eq!(ev[1].ids.bootstrap_room, Some(BootstrapRoom(77)));
    assert_eq!(tally.spans[ProfileLabel::Generic as usize], 3);
}

/// A capacity report names a worker, not a request: it needs no request id, but it needs the
/// worker or node the checker keys capacity by (here the resource's `host.name`).
#[test]
fn generic_capacity_reports_need_a_node_not_a_request_id() {
    let yaml = r#"
generic:
  - name: server-info
    select: { scope_name: "pd-sim server_info" }
    ids: { trace_id: false }
    tokens: { context_tokens: [context_length], max_total_tokens: [max_total_num_tokens] }
    rules:
      - { name: server_info, attributes: { disaggregation_mode: prefill }, stage: prefill, kind: capacity }
"#;
    let cfg: NormalizeConfig = serde_saphyr::from_str(yaml).unwrap();
    let mut n = Normalizer::new(&cfg).unwrap();
    let info = || {
        span(
            9,
            1,
            0,
            "server_info",
            10,
            10,
            vec![
                s("disaggregation_mode", "prefill"),
                kv("context_length", Value::IntValue(16384)),
                kv("max_total_num_tokens", Value::IntValue(8192)),
            ],
        )
    };
    let mut with_host = export("pd-sim", "pd-sim server_info", vec![info()]);
    with_host.resource_spans[0]
        .resource
        .as_mut()
        .unwrap()
        .attributes
        .push(s("host.name", "node-a"));
    let (ev, _) = run(&mut n, &with_host, 1);
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].kind, Kind::Capacity);
    assert_eq!(ev[0].node.as_deref(), Some("node-a"));
    assert_eq!(
        (ev[0].context_tokens, ev[0].max_total_tokens),
        (Some(16384), Some(8192))
    );
    assert!(ev[0].ids.is_empty());
    // Without a node or worker the checker could not attribute it: counted, not emitted.
    let (ev, tally) = run(
        &mut n,
        &export("pd-sim", "pd-sim server_info", vec![info()]),
        1,
    );
    assert!(ev.is_empty());
    assert_eq!(tally.spans[ProfileLabel::Generic as usize], 1);
}

#[test]
fn generic_yaml_rejects_unknown_fields_and_bad_rules() {
    let typo = GENERIC.replace("name_prefix", "name_prefx");
    assert!(serde_saphyr::from_str::<NormalizeConfig>(&typo).is_err());
    let bad_stage = GENERIC.replace("stage: prefill, kind: work", "stage: prefil, kind: work");
    assert!(serde_saphyr::from_str::<NormalizeConfig>(&bad_stage).is_err());
    let catch_all = "generic:\n  - name: x\n    rules:\n      - { stage: prefill, kind: work }\n";
    let cfg: NormalizeConfig = serde_saphyr::from_str(catch_all).unwrap();
    assert!(matches!(
        Normalizer::new(&cfg),
        Err(ConfigError::Generic { .. })
    ));
}

#[test]
fn profile_choice_can_be_overridden() {
    let sp = span(
        6,
        1,
        0,
        "http_request",
        1,
        2,
        vec![s("request_id", "z"), s("status_code", "200")],
    );
    // Unknown service: nobody claims it, counted.
    let (ev, tally) = run(
        &mut normalizer(),
        &export("my-router", "whatever", vec![sp.clone()]),
        1,
    );
    assert!(ev.is_empty());
    assert_eq!(
        tally.unmapped_count(ProfileLabel::None, Unmapped::NoProfile),
        1
    );
    let mut cfg = NormalizeConfig::default();
    cfg.by_service_name.insert("my-router".into(), "smg".into());
    let (ev, _) = run(
        &mut Normalizer::new(&cfg).unwrap(),
        &export("my-router", "whatever", vec![sp]),
        1,
    );
    assert_eq!(ev.len(), 2);
    cfg.by_scope_name.insert("x".into(), "nope".into());
    assert!(matches!(
        Normalizer::new(&cfg),
        Err(ConfigError::UnknownProfile(_))
    ));
}

#[test]
fn bad_times_are_counted_not_mapped() {
    let sp = span(6, 1, 0, "http_request", 5, 2, vec![s("request_id", "z")]);
    let (ev, tally) = run(&mut normalizer(), &export("smg", "smg", vec![sp]), 1);
    assert!(ev.is_empty());
    assert_eq!(
        tally.unmapped_count(ProfileLabel::Smg, Unmapped::BadTime),
        1
    );
}

#[test]
fn logs_map_through_generic_mappings_only_and_bodies_are_dropped() {
    let cfg: NormalizeConfig = serde_saphyr::from_str(
        "generic:\n  - name: logs\n    select: { service_name: my-decode }\n    ids: { rid: [rid] }\n    rules:\n      - { name: kv_received, stage: transfer, kind: work }\n      - { name: abort, stage: decode, kind: aborted }\n",
    )
    .unwrap();
    let mut n = Normalizer::new(&cfg).unwrap();
    let doc = r#"{"resourceLogs":[{"resource":{"attributes":[{"key":"service.name","value":{"stringValue":"my-decode"}}]},
      "scopeLogs":[{"scope":{"name":"x"},"logRecords":[
        {"timeUnixNano":"100","eventName":"kv_received","body":{"stringValue":"PROMPT TEXT"},"attributes":[{"key":"rid","value":{"stringValue":"r1"}}]},
        {"timeUnixNano":"200","severityNumber":"SEVERITY_NUMBER_ERROR","attributes":[{"key":"event.name","value":{"stringValue":"abort"}},{"key":"rid","value":{"stringValue":"r1"}}]},
        {"timeUnixNano":"300","eventName":"chatter","attributes":[{"key":"rid","value":{"stringValue":"r1"}}]}]}]},
      {"resource":{"attributes":[{"key":"service.name","value":{"stringValue":"sglang"}}]},"scopeLogs":[{"logRecords":[{"timeUnixNano":"1"}]}]}]}"#;
    let req = json::decode_logs(doc.as_bytes()).unwrap();
    assert!(
        req.resource_logs[0].scope_logs[0].log_records[0]
            .body
            .is_none(),
        "the JSON decoder drops bodies"
    );
    let mut out = Vec::new();
    let mut tally = Tally::default();
    n.logs(&req, &mut out, &mut tally);
    let got: Vec<_> = out
        .iter()
        .map(|e| (e.stage, e.kind, e.time_ns, e.ids.rid.as_deref()))
        .collect();
    assert_eq!(
        got,
        vec![
            (Stage::Transfer, Kind::Work, 100, Some("r1")),
            (Stage::Decode, Kind::Aborted, 200, Some("r1"))
        ]
    );
    assert_eq!(
        tally.unmapped_count(ProfileLabel::Generic, Unmapped::UnknownSpan),
        1
    );
    assert_eq!(
        tally.unmapped_count(ProfileLabel::Sglang, Unmapped::LogNotMapped),
        1
    );
}

#[test]
fn vllm_journey_events_take_precedence_over_latencies() {
    let ev = |t: u64, ty: &str, extra: Vec<KeyValue>| {
        let mut attributes = vec![s("event.type", ty)];
        attributes.extend(extra);
        Event {
            time_unix_nano: t,
            name: format!("journey.{ty}"),
            attributes,
            dropped_attributes_count: 0,
        }
    };
    let mut sp = span(
        4,
        1,
        0,
        "llm_request",
        100,
        900,
        vec![
            s("gen_ai.request.id", "r"),
            kv("gen_ai.latency.time_in_queue", Value::DoubleValue(9.0)),
        ],
    );
    sp.events = vec![
        ev(110, "QUEUED", vec![]),
        ev(200, "SCHEDULED", vec![s("schedule.kind", "FIRST")]),
        ev(300, "FIRST_TOKEN", vec![]),
        ev(400, "PREEMPTED", vec![]),
        ev(890, "FINISHED", vec![s("finish.status", "aborted")]),
    ];
    let (out, _) = run(
        &mut normalizer(),
        &export("vllm", "vllm.llm_engine", vec![sp]),
        1,
    );
    let got: Vec<_> = out
        .iter()
        .map(|e| (e.kind, e.time_ns, e.detail.as_deref()))
        .collect();
    assert_eq!(
        got,
        vec![
            (Kind::Received, 100, None),
            (Kind::Admitted, 200, Some("scheduled")),
            (Kind::Work, 300, Some("first_token")),
            (Kind::Work, 400, Some("preempted")),
            (Kind::Aborted, 900, None),
        ]
    );
    assert_eq!(out.last().unwrap().reason.as_deref(), Some("aborted"));
}
