//! Property tests: no input reaching the OTLP decoders, the HTTP receiver or the profiles makes
//! revenant panic, the span tree stays within its bounds, and SGLang verdict inputs do not depend
//! on the order in which the spans of one attempt arrive.

use std::sync::Arc;

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{
    AnyValue, InstrumentationScope, KeyValue, any_value::Value,
};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span, Status, span::Event};
use proptest::prelude::*;
use prost::Message;
use revenant::ingest::otlp::{Ingest, OtlpStats, json};
use revenant::ingest::replay::ReplayRecord;
use revenant::normalize::{
    NormalizeConfig, Normalizer, ProfileLabel, Tally, Unmapped, sglang::TreeConfig,
};

fn kv(k: &str, v: Value) -> KeyValue {
    KeyValue {
        key: k.into(),
        value: Some(AnyValue { value: Some(v) }),
        key_strindex: 0,
    }
}

const NAMES: &[&str] = &[
    "prefill Req abcd1234",
    "decode Req abcd1234",
    " Req 0x2a",
    "Bootstrap Room 0x2a",
    "Prefill Scheduler [TP 0] (host:1 | pid:2)",
    "prefill_forward",
    "decode_loop",
    "mooncake_send",
    "tokenize",
    "http_request",
    "llm_request",
    "",
    "é\u{0}",
];

const KEYS: &[&str] = &[
    "rid",
    "bootstrap_room",
    "thread_label",
    "pid",
    "reason",
    "request_id",
    "status_code",
    "gen_ai.request.id",
    "gen_ai.usage.prompt_tokens",
    "gen_ai.latency.time_in_queue",
    "event.type",
    "prefill_url",
];

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        "[0-9a-fx]{0,20}".prop_map(Value::StringValue),
        ".{0,300}".prop_map(Value::StringValue),
        any::<i64>().prop_map(Value::IntValue),
        any::<f64>().prop_map(Value::DoubleValue),
        any::<bool>().prop_map(Value::BoolValue),
        prop::collection::vec(any::<u8>(), 0..8).prop_map(Value::BytesValue),
    ]
}

fn attrs() -> impl Strategy<Value = Vec<KeyValue>> {
    prop::collection::vec(
        (prop::sample::select(KEYS), value()).prop_map(|(k, v)| kv(k, v)),
        0..6,
    )
}

fn span() -> impl Strategy<Value = Span> {
    (
        prop::sample::select(NAMES),
        0u8..3,
        0u64..12,
        0u64..12,
        any::<u64>(),
        0u64..1_000_000,
        attrs(),
        0i32..4,
        prop::collection::vec((prop::sample::select(NAMES), any::<u64>(), attrs()), 0..3),
    )
        .prop_map(
            |(name, trace, id, parent, start, dur, attributes, code, events)| Span {
                trace_id: if trace == 0 { vec![] } else { vec![trace; 16] },
                span_id: id.to_be_bytes().to_vec(),
                parent_span_id: if parent == 0 {
                    vec![]
                } else {
                    parent.to_be_bytes().to_vec()
                },
                name: name.into(),
                start_time_unix_nano: start,
                end_time_unix_nano: start.saturating_add(dur),
                attributes,
                events: events
                    .into_iter()
                    .map(|(n, t, a)| Event {
                        time_unix_nano: t,
                        name: n.into(),
                        attributes: a,
                        dropped_attributes_count: 0,
                    })
                    .collect(),
                status: Some(Status {
                    message: "x".repeat(code as usize * 100),
                    code: code % 3,
                }),
                ..Default::default()
            },
        )
}

fn export(service: &str, scope: &str, spans: Vec<Span>) -> ExportTraceServiceRequest {
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(Resource {
                attributes: vec![kv("service.name", Value::StringValue(service.into()))],
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

fn small_tree() -> NormalizeConfig {
    NormalizeConfig {
        sglang: TreeConfig {
            max_orphans: 8,
            max_known: 16,
            ..Default::default()
        },
        ..Default::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic_the_decoders(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
        if let Ok(req) = ExportTraceServiceRequest::decode(bytes.as_slice()) {
            let mut n = Normalizer::new(&small_tree()).unwrap();
            n.traces(&req, 1, &mut Vec::new(), &mut Tally::default());
        }
        let _ = json::decode_traces(&bytes);
        let _ = json::decode_logs(&bytes);
    }

    #[test]
    fn arbitrary_json_shapes_never_panic(doc in json_doc()) {
        let text = doc.to_string();
        if let Ok(req) = json::decode_traces(text.as_bytes()) {
            let mut n = Normalizer::new(&small_tree()).unwrap();
            n.traces(&req, 1, &mut Vec::new(), &mut Tally::default());
        }
    }

    #[test]
    fn arbitrary_spans_through_every_profile(
        spans in prop::collection::vec(span(), 0..40),
        profile in prop::sample::select(&[("sglang", "sglang server"), ("smg", "smg"), ("vllm", "vllm.llm_engine"), ("x", "y")][..]),
        ticks in prop::collection::vec(any::<u64>(), 0..3),
    ) {
        let mut n = Normalizer::new(&small_tree()).unwrap();
        let mut out = Vec::new();
        let mut tally = Tally::default();
        let req = export(profile.0, profile.1, spans.clone());
        n.traces(&req, 1_000, &mut out, &mut tally);
        prop_assert!(n.orphans_waiting() <= 8);
        for t in ticks {
            n.tick(t, &mut out, &mut tally);
            prop_assert!(n.orphans_waiting() <= 8);
        }
        let seen: u64 = tally.spans.iter().sum();
        prop_assert_eq!(seen, spans.len() as u64);
        for e in &out {
            // Short, bounded fields only: nothing here can carry a prompt.
            prop_assert!(e.reason.as_deref().is_none_or(|r| r.len() <= revenant::event::MAX_REASON_BYTES));
            prop_assert!(e.ids.rid.as_deref().is_none_or(|r| r.len() <= 128));
            prop_assert!(e.ids.request_id.as_deref().is_none_or(|r| r.len() <= 128));
            // Every event serializes into the replay format and reads back.
            let line = serde_json::to_string(&ReplayRecord::from_event(e)).unwrap();
            prop_assert!(revenant::ingest::replay::parse_line(&line).is_ok(), "{}", line);
        }
    }

    /// One SGLang attempt: root + thread (maybe aborting) + slices. Whatever order the spans
    /// arrive in, one per export, the events (after the completion grace) are the same.
    #[test]
    fn sglang_events_do_not_depend_on_arrival_order(
        abort in any::<bool>(),
        slices in prop::collection::vec(prop::sample::select(&["prefill_forward", "chunked_prefill", "prefill_transfer_kv_cache", "tokenize"][..]), 0..5),
        perm_seed in any::<u64>(),
    ) {
        let s = |k: &str, v: &str| kv(k, Value::StringValue(v.into()));
        let mut spans = vec![
            Span { trace_id: vec![9; 16], span_id: 1u64.to_be_bytes().to_vec(), parent_span_id: 77u64.to_be_bytes().to_vec(), name: "prefill Req beef".into(), start_time_unix_nano: 10, end_time_unix_nano: 100, attributes: vec![s("rid", "beef"), s("bootstrap_room", "0x7")], ..Default::default() },
            Span { trace_id: vec![9; 16], span_id: 2u64.to_be_bytes().to_vec(), parent_span_id: 1u64.to_be_bytes().to_vec(), name: "Prefill Scheduler [TP 0] (host:a | pid:1)".into(), start_time_unix_nano: 11, end_time_unix_nano: 90, attributes: if abort { vec![s("thread_label", "Prefill Scheduler"), s("reason", "exceeds the maximum number of tokens: 9 > 8")] } else { vec![s("thread_label", "Prefill Scheduler")] }, status: abort.then(|| Status { message: String::new(), code: 2 }), ..Default::default() },
        ];
        for (i, name) in slices.iter().enumerate() {
            let id = 3 + i as u64;
            spans.push(Span { trace_id: vec![9; 16], span_id: id.to_be_bytes().to_vec(), parent_span_id: 2u64.to_be_bytes().to_vec(), name: (*name).into(), start_time_unix_nano: 12 + id, end_time_unix_nano: 20 + id, ..Default::default() });
        }
        let canon = |order: &[usize]| {
            let mut n = Normalizer::new(&NormalizeConfig::default()).unwrap();
            let mut out = Vec::new();
            for (t, i) in order.iter().enumerate() {
                n.traces(&export("sglang", "sglang server", vec![spans[*i].clone()]), t as u64 + 1, &mut out, &mut Tally::default());
            }
            n.tick(u64::MAX / 2, &mut out, &mut Tally::default());
            let mut lines: Vec<String> = out.iter().map(|e| serde_json::to_string(&ReplayRecord::from_event(e)).unwrap()).collect();
            lines.sort();
            lines
        };
        let forward: Vec<usize> = (0..spans.len()).collect();
        let mut shuffled = forward.clone();
        // A deterministic shuffle from the seed (Fisher-Yates with an LCG).
        let mut x = perm_seed | 1;
        for i in (1..shuffled.len()).rev() {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            shuffled.swap(i, (x >> 33) as usize % (i + 1));
        }
        let reversed: Vec<usize> = forward.iter().rev().copied().collect();
        let a = canon(&forward);
        prop_assert_eq!(&a, &canon(&shuffled));
        prop_assert_eq!(&a, &canon(&reversed));
        prop_assert_eq!(a.iter().any(|l| l.contains("\"rejected\"")), abort);
        prop_assert_eq!(a.iter().any(|l| l.contains("\"completed\"")), !abort);
    }

    #[test]
    fn http_receiver_answers_every_body_with_a_status(
        body in prop::collection::vec(any::<u8>(), 0..512),
        ctype in prop::sample::select(&["application/x-protobuf", "application/json", "text/plain", ""][..]),
        gzip in any::<bool>(),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let (tx, mut rx) = tokio::sync::mpsc::channel(4);
            let ingest = Arc::new(Ingest::new(tx, Normalizer::new(&small_tree()).unwrap(), Arc::new(OtlpStats::default()), 1000, Arc::new(revenant::telemetry::MemoryAccount::unlimited())));
            let app = revenant::ingest::otlp::http::router(
                ingest.clone(),
                4096,
                8192,
                revenant::access::Access::open(),
            );
            let mut req = http::Request::post("/v1/traces").header("content-type", ctype);
            if gzip {
                req = req.header("content-encoding", "gzip");
            }
            let resp = tower::ServiceExt::oneshot(app, req.body(axum::body::Body::from(body)).unwrap()).await.unwrap();
            let code = resp.status().as_u16();
            assert!([200, 400, 413, 415].contains(&code), "{code}");
            let rejected: u64 = revenant::ingest::otlp::RejectReason::ALL.iter().map(|r| ingest.stats.get_rejected(revenant::ingest::otlp::Transport::Http, *r)).sum();
            // Every refusal is counted; an accepted body is never counted as refused.
            assert_eq!(rejected, u64::from(code != 200));
            let items: u64 = revenant::ingest::otlp::RejectReason::ALL.iter().map(|r| ingest.stats.items_rejected[revenant::ingest::otlp::Transport::Http as usize][*r as usize].load(std::sync::atomic::Ordering::Relaxed)).sum();
            // A refused export counts at least one rejected item, so the refusing-data alert fires.
            assert_eq!(items >= 1, code != 200);
            if code != 200 {
                // The OTLP spec: the error body is a google.rpc.Status, encoded like the request.
                let resp_ctype = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
                let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20).await.unwrap();
                let status = if ctype == "application/json" && code != 415 {
                    assert_eq!(resp_ctype, "application/json");
                    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
                    revenant::ingest::otlp::RpcStatus {
                        code: v["code"].as_i64().unwrap() as i32,
                        message: v["message"].as_str().unwrap().to_string(),
                    }
                } else {
                    assert_eq!(resp_ctype, "application/x-protobuf");
                    <revenant::ingest::otlp::RpcStatus as prost::Message>::decode(bytes.as_ref()).unwrap()
                };
                assert!(!status.message.is_empty(), "{status:?}");
                assert_eq!(status.code, if code == 413 { 8 } else { 3 }, "{status:?}");
            }
            rx.close();
        });
    }
}

fn json_doc() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::Bool),
        any::<i64>().prop_map(|i| serde_json::json!(i)),
        "[a-zA-Z0-9+/=_]{0,40}".prop_map(serde_json::Value::String),
    ];
    let keys = prop::sample::select(vec![
        "resourceSpans",
        "scopeSpans",
        "spans",
        "resource",
        "attributes",
        "key",
        "value",
        "stringValue",
        "intValue",
        "traceId",
        "spanId",
        "parentSpanId",
        "name",
        "kind",
        "startTimeUnixNano",
        "endTimeUnixNano",
        "status",
        "code",
        "events",
        "timeUnixNano",
        "scope",
        "arrayValue",
        "kvlistValue",
        "values",
        "doubleValue",
    ]);
    let inner = leaf.prop_recursive(5, 64, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::Array),
            prop::collection::vec((keys.clone(), inner), 0..5).prop_map(|kvs| {
                serde_json::Value::Object(
                    kvs.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
                )
            }),
        ]
    });
    prop::collection::vec(inner, 0..2).prop_map(|v| serde_json::json!({ "resourceSpans": v }))
}

#[test]
fn unmapped_reasons_have_stable_labels() {
    // Labels are part of the metrics contract: bounded and snake_case.
    for p in ProfileLabel::ALL {
        assert!(
            p.as_str()
                .chars()
                .all(|c| c.is_ascii_lowercase() || c == '_')
        );
    }
    for u in Unmapped::ALL {
        assert!(
            u.as_str()
                .chars()
                .all(|c| c.is_ascii_lowercase() || c == '_')
        );
    }
}
