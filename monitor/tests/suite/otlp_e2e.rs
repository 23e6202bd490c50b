//! End to end with real OTLP clients: the OpenTelemetry Python SDK (from PyPI, in a venv this
//! test creates under `target/otlp-venv`) sends SGLang- and smg-shaped traces over gRPC,
//! HTTP/protobuf and HTTP/JSON into a running `revenant run` on loopback ports.
//!
//! Everything is bounded: readiness is a file revenant writes once it listens, every wait has a
//! deadline, and the child is stopped with SIGTERM (then killed) whatever happens.

use crate::support;

use std::process::Command;
use std::time::{Duration, Instant};

use support::{Revenant, admin_get, assert_rejected_then_decoded};
use test_harness::notifications::{room_of, unsafe_numbers};

#[test]
fn rejected_then_decoded_raises_activity_after_rejection_over_every_transport() {
    let mut rv = Revenant::start("reject", &[]);
    let mut sent = Vec::new();
    for (i, transport) in ["grpc", "http-protobuf", "http-json"].iter().enumerate() {
        let tag = format!("{:04x}", 0xa0 + i);
        let (ok, out, err) = rv.emit(&[
            "--transport",
            transport,
            "--scenario",
            "reject-then-decode",
            "--tag",
            &tag,
        ]);
        assert!(ok, "{transport}: {out} {err}");
        sent.push((transport.to_string(), out));
    }
    // While running: every alert reaches the JSONL sink promptly (never-after rules fire on the
    // offending event, not at shutdown), and the admin API tells the same story.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let alerts = rv.lines("alerts.jsonl");
        let all = sent.iter().all(|(_, out)| {
            let rid = out["rid"].as_str().unwrap();
            alerts
                .iter()
                .any(|a| lists(a, "activity-after-rejection") && a.to_string().contains(rid))
        });
        if all {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "alerts not delivered while running: {alerts:#?}\n{}",
            rv.stderr()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (code, ready) = admin_get(&rv.admin, "/readyz");
    assert_eq!(code, 200, "{ready}");
    let ready: serde_json::Value = serde_json::from_str(&ready).unwrap();
    assert_eq!(
        ready["live_sources"],
        serde_json::json!(["otlp"]),
        "{ready}"
    );
    assert!(
        ready["disabled"]["ebpf"].as_str().unwrap().contains("off"),
        "{ready}"
    );
    let (code, metrics) = admin_get(&rv.admin, "/metrics");
    assert_eq!(code, 200);
    for needle in [
        "revenant_events_total{source=\"otlp\",stage=\"prefill\",kind=\"rejected\"} 3",
        "revenant_alert_delivered_notifications_total{sink=\"jsonl\"}",
        "revenant_ready 1",
        "revenant_dropped_items_total{point=\"event_channel\",reason=\"full\"} 0",
    ] {
        assert!(metrics.contains(needle), "{needle} not in:\n{metrics}");
    }
    assert!(
        !metrics.contains(sent[0].1["rid"].as_str().unwrap()),
        "request ids never become metric labels"
    );
    let (code, list) = admin_get(&rv.admin, "/api/violations?rule=activity-after-rejection");
    assert_eq!(code, 200, "{list}");
    let list: serde_json::Value = serde_json::from_str(&list).unwrap();
    assert!(list["violations"].as_array().unwrap().len() >= 3, "{list}");
    // Any alias finds the timeline: the attempt by its rid (both legs), the request by its id.
    let rid = sent[0].1["rid"].as_str().unwrap();
    let (code, timeline) = admin_get(&rv.admin, &format!("/api/requests/{rid}"));
    assert_eq!(code, 200, "{timeline}");
    let timeline: serde_json::Value = serde_json::from_str(&timeline).unwrap();
    assert_rejected_then_decoded(&timeline);
    let request_id = sent[0].1["request_id"].as_str().unwrap();
    let (code, timeline) = admin_get(&rv.admin, &format!("/api/requests/{request_id}"));
    assert_eq!(code, 200, "{timeline}");
    assert!(timeline.contains("\"status\":400"), "{timeline}");
    let (code, _) = admin_get(&rv.admin, "/api/requests/never-seen-alias");
    assert_eq!(code, 404);
    let st = rv.stop();
    assert!(st.success(), "{}", rv.stderr());
    let events = rv.lines("events.jsonl");
    let alerts = rv.lines("alerts.jsonl");
    for (transport, out) in &sent {
        let rid = out["rid"].as_str().unwrap();
        let room = out["room"].as_u64().unwrap();
        let mine: Vec<_> = events.iter().filter(|e| e["ids"]["rid"] == rid).collect();
        let has = |stage: &str, kind: &str| {
            mine.iter().any(|e| {
                e["stage"] == stage
                    && e["kind"] == kind
                    && room_of(&e["ids"]) == Some(room)
                    && e["source"] == "otlp"
            })
        };
        assert!(
            has("prefill", "received") && has("prefill", "rejected"),
            "{transport}: {mine:#?}"
        );
        assert!(
            has("decode", "received") && has("decode", "work") && has("transfer", "completed"),
            "{transport}: {mine:#?}"
        );
        let rej = mine.iter().find(|e| e["kind"] == "rejected").unwrap();
        assert_eq!(rej["input_tokens"], 9000);
        assert_eq!(rej["max_input_tokens"], 8192);
        // The prefill root must not claim success after its scheduler aborted it.
        assert!(
            !mine
                .iter()
                .any(|e| e["stage"] == "prefill" && e["kind"] == "completed"),
            "{transport}: {mine:#?}"
        );
        let request_id = out["request_id"].as_str().unwrap();
        let router: Vec<_> = events
            .iter()
            .filter(|e| e["ids"]["request_id"] == request_id)
            .collect();
        assert!(
            router.iter().any(|e| e["stage"] == "router"
                && e["kind"] == "dispatched"
                && e["to"] == "decode"),
            "{transport}: {router:#?}"
        );
        assert!(
            router
                .iter()
                .any(|e| e["kind"] == "completed" && e["status"] == 400),
            "{transport}: {router:#?}"
        );
        let alert = alerts
            .iter()
            .find(|a| lists(a, "activity-after-rejection") && a.to_string().contains(rid))
            .unwrap_or_else(|| {
                panic!("{transport}: no activity-after-rejection for {rid}: {alerts:#?}")
            });
        assert!(alert.to_string().contains("otlp"));
        // The decode leg did end (its root completed); its completion, deferred for an abort
        // that never came, is released at shutdown — so no orphaned-leg false alarm.
        assert!(has("decode", "completed"), "{transport}: {mine:#?}");
        assert!(
            !alerts
                .iter()
                .any(|a| lists(a, "orphaned-leg") && a.to_string().contains(rid)),
            "{transport}: {alerts:#?}"
        );
    }
    let stderr = rv.stderr();
    assert!(
        stderr.contains("revenant_otlp_requests_accepted_total{transport=\"grpc\"}"),
        "{stderr}"
    );
    assert!(
        stderr.contains("revenant_otlp_requests_accepted_total{transport=\"http\"}"),
        "{stderr}"
    );
}

fn backpressure(transport: &str) {
    let name = format!("bp-{transport}");
    let dir = std::env::temp_dir().join(format!(
        "revenant-otlp-e2e-pause-{transport}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let pause = dir.join("pause");
    std::fs::write(&pause, "").unwrap();
    let marker = dir.join("transient");
    let _ = std::fs::remove_file(&marker);
    let mut rv = Revenant::start(
        &name,
        &[
            "--channel-capacity",
            "1",
            "--pause-file",
            pause.to_str().unwrap(),
        ],
    );
    let count = 12;
    // Un-pause once the SDK has reported its first retryable error (bounded wait).
    let unpause = {
        let (pause, marker) = (pause.clone(), marker.clone());
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(60);
            while !marker.exists() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = std::fs::remove_file(&pause);
            marker.exists()
        })
    };
    let (ok, out, err) = rv.emit(&[
        "--transport",
        transport,
        "--scenario",
        "backpressure",
        "--count",
        &count.to_string(),
        "--transient-marker",
        marker.to_str().unwrap(),
    ]);
    let saw_transient = unpause.join().unwrap();
    assert!(
        saw_transient,
        "the SDK never saw a retryable error: {out} {err}"
    );
    assert!(
        ok,
        "every export must succeed once the pipeline drains: {out} {err}"
    );
    assert!(out["transient_errors"].as_u64().unwrap() >= 1, "{out}");
    if transport == "grpc" {
        // The exporter logs our status message: the refusal reached it as UNAVAILABLE + text.
        let log = out["exporter_log"].to_string();
        assert!(
            log.contains("StatusCode.UNAVAILABLE") && log.contains("pipeline full, retry later"),
            "{log}"
        );
    }
    let st = rv.stop();
    assert!(st.success(), "{}", rv.stderr());
    let events = rv.lines("events.jsonl");
    for id in out["request_ids"].as_array().unwrap() {
        let n = events
            .iter()
            .filter(|e| e["ids"]["request_id"] == *id)
            .count();
        assert_eq!(
            n, 2,
            "request {id}: received + completed, nothing lost or duplicated"
        );
    }
    let stderr = rv.stderr();
    let wire = if transport == "grpc" { "grpc" } else { "http" };
    let needle = format!(
        "revenant_otlp_requests_rejected_total{{transport=\"{wire}\",reason=\"pipeline_full\"}}"
    );
    assert!(
        stderr.contains(&needle),
        "refusals must be counted: {stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn saturated_pipeline_makes_grpc_sdk_retry_and_loses_nothing() {
    backpressure("grpc");
}

#[test]
fn saturated_pipeline_makes_http_sdk_retry_and_loses_nothing() {
    backpressure("http-protobuf");
}

/// The real OpenTelemetry SDK exporter sends an export over `--max-message-bytes` once: the
/// refusal is permanent (HTTP 413 / gRPC INVALID_ARGUMENT), so it gives up without retrying, and
/// it logs the refusal (gRPC: our status message; the HTTP exporter logs only the status line).
fn oversized_export_is_not_retried(transport: &str) {
    let mut rv = Revenant::start(
        &format!("oversized-{transport}"),
        &["--max-message-bytes", "2000"],
    );
    let (ok, out, err) = rv.emit(&["--transport", transport, "--scenario", "oversized"]);
    assert!(!ok, "the export must fail: {out} {err}");
    assert_eq!(
        out["results"],
        serde_json::json!(["FAILURE"]),
        "{out} {err}"
    );
    let log = out["exporter_log"].to_string();
    assert!(
        !log.to_lowercase().contains("retrying"),
        "no retry for a permanent error: {log}"
    );
    let needle = if transport == "grpc" {
        "INVALID_ARGUMENT, error details: Error, decoded message length too large"
    } else {
        "code: 413"
    };
    assert!(
        log.contains(needle),
        "the exporter must log the refusal's message: {log}"
    );
    assert!(rv.stop().success());
    let stderr = rv.stderr();
    let wire = if transport == "grpc" { "grpc" } else { "http" };
    // Exactly one request arrived: the exporter did not resend it.
    let counted = format!(
        "revenant_otlp_requests_rejected_total{{transport=\"{wire}\",reason=\"too_large\"}} 1\n"
    );
    assert!(stderr.contains(&counted), "{counted}: {stderr}");
}

#[test]
fn oversized_export_is_not_retried_by_the_grpc_sdk() {
    oversized_export_is_not_retried("grpc");
}

#[test]
fn oversized_export_is_not_retried_by_the_http_sdk() {
    oversized_export_is_not_retried("http-protobuf");
}

/// Sends `msg` (any prost message) as the request of the OTLP trace Export method.
async fn raw_export<M: prost::Message + Default + Send + Sync + 'static>(
    addr: &str,
    msg: M,
) -> Result<(), tonic::Status> {
    raw_export_with(addr, msg, false).await
}

async fn raw_export_with<M: prost::Message + Default + Send + Sync + 'static>(
    addr: &str,
    msg: M,
    gzip: bool,
) -> Result<(), tonic::Status> {
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceResponse;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    if gzip {
        grpc = grpc.send_compressed(tonic::codec::CompressionEncoding::Gzip);
    }
    grpc.ready().await.unwrap();
    let codec = tonic_prost::ProstCodec::<M, ExportTraceServiceResponse>::default();
    let path = http::uri::PathAndQuery::from_static(
        "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
    );
    grpc.unary(tonic::Request::new(msg), path, codec)
        .await
        .map(|_| ())
}

#[test]
fn malformed_and_oversized_grpc_get_error_codes_and_are_counted() {
    use opentelemetry_proto::tonic::collector::trace::v1::{
        ExportTracePartialSuccess, ExportTraceServiceRequest,
    };
    use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span};
    let mut rv = Revenant::start("grpc-bad", &["--max-message-bytes", "2000"]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // Field 1 of ExportTraceServiceRequest is a message; here it arrives as a varint.
        let bad = raw_export(
            &rv.otlp_grpc,
            ExportTracePartialSuccess {
                rejected_spans: 7,
                error_message: String::new(),
            },
        )
        .await;
        // Undecodable: INVALID_ARGUMENT (non-retryable), not tonic's INTERNAL (retryable).
        assert_eq!(bad.unwrap_err().code(), tonic::Code::InvalidArgument);
        let big = ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                scope_spans: vec![ScopeSpans {
                    spans: vec![Span {
                        name: "x".repeat(5000),
                        ..Default::default()
                    }],
                    ..Default::default()
                }],
                ..Default::default()
            }],
        };
        // A small gzip frame that inflates past the limit: decompression stops at the limit.
        let bomb = raw_export_with(&rv.otlp_grpc, big.clone(), true).await;
        assert_eq!(bomb.unwrap_err().code(), tonic::Code::InvalidArgument);
        let too_big = raw_export(&rv.otlp_grpc, big).await;
        // Over the limit: INVALID_ARGUMENT, permanent (tonic's own OUT_OF_RANGE is retryable).
        assert_eq!(too_big.unwrap_err().code(), tonic::Code::InvalidArgument);
        // The receiver still serves well-formed exports afterwards.
        let ok = raw_export(&rv.otlp_grpc, ExportTraceServiceRequest::default()).await;
        assert!(ok.is_ok(), "{ok:?}");
    });
    assert!(rv.stop().success());
    let stderr = rv.stderr();
    assert!(
        stderr.contains("revenant_otlp_grpc_error_responses_total{code=\"3\"} 3"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("revenant_otlp_grpc_error_responses_total{code=\"13\"}")
            && !stderr.contains("revenant_otlp_grpc_error_responses_total{code=\"11\"}")
            && !stderr.contains("revenant_otlp_grpc_error_responses_total{code=\"8\"}"),
        "{stderr}"
    );
    // tonic's refusals are counted as rejected exports (of one item each).
    for (reason, n) in [("malformed", 1), ("too_large", 2)] {
        let needle = format!(
            "revenant_otlp_requests_rejected_total{{transport=\"grpc\",reason=\"{reason}\"}} {n}"
        );
        assert!(stderr.contains(&needle), "{needle}: {stderr}");
    }
    assert!(
        stderr.contains("revenant_otlp_requests_accepted_total{transport=\"grpc\"} 1"),
        "{stderr}"
    );
}

#[test]
fn broken_config_exits_2_without_binding() {
    let dir = std::env::temp_dir().join(format!("revenant-otlp-badcfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("bad.yaml");
    std::fs::write(&cfg, "otlp:\n  grpc: 127.0.0.1:0\n  bogus: 1\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_revenant"))
        .args(["run", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bogus"), "{err}");
    assert!(!err.contains("ready"), "no port may be bound: {err}");
    let out = Command::new(env!("CARGO_BIN_EXE_revenant"))
        .args(["run", "--otlp-http", "not-an-addr"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    // Broken alerting: unknown key in the alert config, an unusable webhook URL, a missing secret.
    let alert_cfg = dir.join("alerts.yaml");
    std::fs::write(
        &alert_cfg,
        "webhooks:\n  - url: http://127.0.0.1:1/x\n    retires: 3\n",
    )
    .unwrap();
    let missing = dir.join("no-such-secret");
    let bad_rules = dir.join("rules.yaml");
    std::fs::write(&bad_rules, "rules:\n  - name: x\n    unknwn_field: 1\n").unwrap();
    for (args, needle) in [
        (
            vec![
                "--alert-config".to_string(),
                alert_cfg.display().to_string(),
            ],
            "retires",
        ),
        (vec!["--webhook".into(), "gopher://x".into()], "gopher"),
        (
            vec![
                "--webhook".into(),
                "http://127.0.0.1:1/x".into(),
                "--webhook-secret-file".into(),
                missing.display().to_string(),
            ],
            "no-such-secret",
        ),
        (vec!["--log-level".into(), "info,[[[".into()], "log-level"),
        (
            vec!["--rules".to_string(), bad_rules.display().to_string()],
            "unknwn_field",
        ),
        (
            vec!["--channel-capacity".into(), "0".into()],
            "channel_capacity",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_revenant"))
            .args([
                "run",
                "--otlp-grpc",
                "127.0.0.1:0",
                "--otlp-http",
                "off",
                "--admin",
                "127.0.0.1:0",
                "--ebpf",
                "off",
            ])
            .args(&args)
            .arg("--spool-dir")
            .arg(dir.join("spool"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("ready"), "no port may be bound: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--self-traces-otlp`: revenant's own spans (checker batches, alert deliveries) reach a real
/// OTLP/gRPC receiver — here a second revenant, whose counters show what arrived.
#[test]
fn own_spans_are_exported_over_otlp() {
    let collector = Revenant::start("selftrace-collector", &[]);
    let endpoint = format!("http://{}", collector.otlp_grpc);
    let mut rv = Revenant::start(
        "selftrace-source",
        &[
            "--self-traces-otlp",
            &endpoint,
            "--self-traces-sample-ratio",
            "1",
        ],
    );
    let (ok, out, err) = rv.emit(&[
        "--transport",
        "grpc",
        "--scenario",
        "reject-then-decode",
        "--tag",
        "00b7",
    ]);
    assert!(ok, "{out} {err}");
    // Shutdown flushes the batch processor: every span ended so far is exported.
    assert!(rv.stop().success(), "{}", rv.stderr());
    let received = |metrics: &str| -> u64 {
        metrics
            .lines()
            .filter(|l| l.starts_with("revenant_otlp_spans_received_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, metrics) = admin_get(&collector.admin, "/metrics");
        if received(&metrics) > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no self-trace span reached the collector:\n{metrics}\nsource stderr:\n{}",
            rv.stderr()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!rv.stderr().contains("export failed"), "{}", rv.stderr());
}

/// One breach proving two rules (prefill rejected the attempt, the router failed the request, the
/// decode leg kept working, all in one trace): two violations, per rule in `/api/violations` and
/// the metrics, and one incident notification listing both.
#[test]
fn failed_request_decoded_anyway_is_one_incident_notification() {
    let mut rv = Revenant::start("incident", &[]);
    let (ok, out, err) = rv.emit(&[
        "--transport",
        "grpc",
        "--scenario",
        "failed-then-decode",
        "--tag",
        "0fd1",
    ]);
    assert!(ok, "{out} {err}");
    let request_id = out["request_id"].as_str().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(30);
    while rv.lines("alerts.jsonl").is_empty() {
        assert!(
            Instant::now() < deadline,
            "no notification:\n{}",
            rv.stderr()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (_, body) = admin_get(&rv.admin, "/api/violations?limit=10");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let mut rules: Vec<&str> = v["violations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["rule"].as_str().unwrap())
        .collect();
    rules.sort();
    assert_eq!(
        rules,
        ["activity-after-rejection", "activity-after-request-failed"],
        "{body}"
    );
    let (_, metrics) = admin_get(&rv.admin, "/metrics");
    assert!(
        metrics.contains("revenant_alerts_incidents_opened_total{rule=")
            && metrics.contains("revenant_alerts_findings_merged_total{rule="),
        "{metrics}"
    );
    assert!(rv.stop().success(), "{}", rv.stderr());
    // After the drain: everything the sink got, the first notification included.
    let alerts = rv.lines("alerts.jsonl");
    assert_eq!(alerts.len(), 1, "one breach, one notification: {alerts:#?}");
    let a = &alerts[0];
    assert_eq!(a["type"], "incident");
    assert_eq!(a["incident_key"], format!("request_id:{request_id}"), "{a}");
    assert!(
        lists(a, "activity-after-rejection") && lists(a, "activity-after-request-failed"),
        "{a}"
    );
    assert_eq!(a["findings"].as_array().unwrap().len(), 2, "{a}");
    // The room (above 2^53) keeps every digit: a decimal string, no JSON number a double rounds.
    assert_eq!(unsafe_numbers(a), Vec::<String>::new(), "{a}");
    for f in a["findings"].as_array().unwrap() {
        assert_eq!(room_of(&f["attempt"]), out["room"].as_u64(), "{f}");
        assert_eq!(
            f["attempt"]["bootstrap_room"],
            out["room"].as_u64().unwrap().to_string(),
            "{f}"
        );
        assert!(!f["evidence"].as_array().unwrap().is_empty(), "{f}");
    }
}

/// Whether an incident notification lists a finding of `rule`.
fn lists(a: &serde_json::Value, rule: &str) -> bool {
    a["rules"]
        .as_array()
        .is_some_and(|r| r.iter().any(|x| x == rule))
}

/// A retry storm (one trace and x-request-id, a new room and rid per attempt, every attempt
/// rejected by prefill while its decode leg works) is one request: every attempt is a violation,
/// all share one fingerprint, and the sink gets one notification (the rest are deduplicated).
#[test]
fn retry_storm_is_one_request_and_one_notification() {
    let mut rv = Revenant::start("storm", &[]);
    let (ok, out, err) = rv.emit(&[
        "--transport",
        "grpc",
        "--scenario",
        "retry-storm",
        "--count",
        "4",
        "--tag",
        "00c1",
    ]);
    assert!(ok, "{out} {err}");
    let request_id = out["request_id"].as_str().unwrap().to_string();
    let rooms: Vec<u64> = out["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["room"].as_u64().unwrap())
        .collect();
    assert_eq!(rooms.len(), 4);
    // Every attempt's violation reaches the dispatcher ...
    let deadline = Instant::now() + Duration::from_secs(30);
    let violations = loop {
        let (_, body) = admin_get(
            &rv.admin,
            "/api/violations?rule=activity-after-rejection&limit=100",
        );
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let list = v["violations"].as_array().unwrap().clone();
        if list.len() >= 4 {
            break list;
        }
        assert!(Instant::now() < deadline, "{body}\n{}", rv.stderr());
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(violations.len(), 4, "{violations:#?}");
    let fingerprints: std::collections::BTreeSet<&str> = violations
        .iter()
        .map(|v| v["fingerprint"].as_str().unwrap())
        .collect();
    assert_eq!(
        fingerprints.len(),
        1,
        "one request, one fingerprint: {violations:#?}"
    );
    let mut seen_rooms: Vec<u64> = violations
        .iter()
        .map(|v| room_of(&v["attempt"]).unwrap())
        .collect();
    assert_eq!(
        unsafe_numbers(&serde_json::Value::Array(violations.clone())),
        Vec::<String>::new()
    );
    seen_rooms.sort();
    assert_eq!(seen_rooms, rooms);
    // ... and the timeline of the x-request-id holds all four attempts.
    let (code, timeline) = admin_get(&rv.admin, &format!("/api/requests/{request_id}"));
    assert_eq!(code, 200, "{timeline}");
    let t: serde_json::Value = serde_json::from_str(&timeline).unwrap();
    let mut timeline_rooms: Vec<u64> = t["aliases"]["bootstrap_rooms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| room_of(r).unwrap())
        .collect();
    timeline_rooms.sort();
    assert_eq!(timeline_rooms, rooms, "{t}");
    assert_eq!(unsafe_numbers(&t), Vec::<String>::new(), "{t}");
    let (_, metrics) = admin_get(&rv.admin, "/metrics");
    assert!(
        metrics.contains("revenant_alerts_deduplicated_total{rule=\"activity-after-rejection\"} 3"),
        "{metrics}"
    );
    assert!(rv.stop().success(), "{}", rv.stderr());
    let notified: Vec<_> = rv
        .lines("alerts.jsonl")
        .into_iter()
        .filter(|a| lists(a, "activity-after-rejection"))
        .collect();
    assert_eq!(notified.len(), 1, "{notified:#?}");
    let finding = notified[0]["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["rule"] == "activity-after-rejection")
        .unwrap();
    assert_eq!(
        finding["fingerprint"].as_str().unwrap(),
        *fingerprints.iter().next().unwrap()
    );
    assert_eq!(
        finding["occurrences"], 4,
        "every attempt folded in: {finding}"
    );
}
