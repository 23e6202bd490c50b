//! End to end with real OTLP clients: the OpenTelemetry Python SDK (from PyPI, in a venv this
//! test creates under `target/otlp-venv`) sends SGLang- and smg-shaped traces over gRPC,
//! HTTP/protobuf and HTTP/JSON into a running `revenant run` on loopback ports.
//!
//! Everything is bounded: readiness is a file revenant writes once it listens, every wait has a
//! deadline, and the child is stopped with SIGTERM (then killed) whatever happens.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Creates (once) the venv with the OpenTelemetry SDK and exporters; idempotent.
fn venv_python() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"));
    let venv = target.join("otlp-venv");
    let py = venv.join("bin/python");
    let probe = |py: &Path| {
        Command::new(py)
            .args([
                "-c",
                "import opentelemetry.sdk, opentelemetry.exporter.otlp.proto.grpc.trace_exporter, opentelemetry.exporter.otlp.proto.http.trace_exporter",
            ])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if py.exists() && probe(&py) {
        return py;
    }
    // Tests run in parallel; a lock directory serializes creating the venv.
    let _ = std::fs::create_dir_all(&target);
    let lock = target.join("otlp-venv.lock");
    let deadline = Instant::now() + Duration::from_secs(600);
    while std::fs::create_dir(&lock).is_err() {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for another test to build the venv"
        );
        std::thread::sleep(Duration::from_millis(200));
        if py.exists() && probe(&py) {
            return py;
        }
    }
    let ok = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .status()
        .is_ok_and(|s| s.success())
        && Command::new(venv.join("bin/pip"))
            .args([
                "install",
                "-q",
                "opentelemetry-sdk==1.45.2",
                "opentelemetry-exporter-otlp-proto-grpc==1.45.2",
                "opentelemetry-exporter-otlp-proto-http==1.45.2",
            ])
            .status()
            .is_ok_and(|s| s.success());
    let _ = std::fs::remove_dir(&lock);
    assert!(
        ok && probe(&py),
        "could not create the OpenTelemetry test venv at {}",
        venv.display()
    );
    py
}

struct Revenant {
    child: Child,
    dir: PathBuf,
    grpc: String,
    http: String,
    admin: String,
}

/// Minimal HTTP/1.1 GET (Connection: close) against the admin server; std only.
fn http_get(addr: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect admin");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).unwrap();
    let status = buf
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = buf.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    (status, body.to_string())
}

impl Revenant {
    fn start(name: &str, extra: &[&str]) -> Revenant {
        let dir =
            std::env::temp_dir().join(format!("revenant-otlp-e2e-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let ready = dir.join("ready.json");
        let child = Command::new(env!("CARGO_BIN_EXE_revenant"))
            .args([
                "run",
                "--otlp-grpc",
                "127.0.0.1:0",
                "--otlp-http",
                "127.0.0.1:0",
            ])
            .arg("--ready-file")
            .arg(&ready)
            .arg("--events-jsonl")
            .arg(dir.join("events.jsonl"))
            .arg("--alerts-jsonl")
            .arg(dir.join("alerts.jsonl"))
            .arg("--spool-dir")
            .arg(dir.join("spool"))
            .args(["--admin", "127.0.0.1:0", "--ebpf", "off"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("stderr.log")).unwrap())
            .spawn()
            .expect("spawn revenant");
        let mut r = Revenant {
            child,
            dir,
            grpc: String::new(),
            http: String::new(),
            admin: String::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        let doc = loop {
            if let Ok(t) = std::fs::read_to_string(&ready) {
                break t;
            }
            if let Ok(Some(st)) = r.child.try_wait() {
                panic!("revenant exited early ({st}): {}", r.stderr());
            }
            assert!(
                Instant::now() < deadline,
                "revenant not ready in time: {}",
                r.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let v: serde_json::Value = serde_json::from_str(&doc).unwrap();
        r.grpc = v["otlp_grpc"].as_str().unwrap().to_owned();
        r.http = v["otlp_http"].as_str().unwrap().to_owned();
        r.admin = v["admin"].as_str().unwrap().to_owned();
        assert_eq!(v["ebpf"], "off", "{v}");
        r
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.join("stderr.log")).unwrap_or_default()
    }

    /// SIGTERM, then wait (bounded) for the drain to finish.
    fn stop(&mut self) -> std::process::ExitStatus {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("revenant did not stop after SIGTERM: {}", self.stderr());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn lines(&self, file: &str) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.dir.join(file))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    fn emit(&self, args: &[&str]) -> (bool, serde_json::Value, String) {
        let py = venv_python();
        let mut child = Command::new(py)
            .arg(repo_root().join("tests/otlp/emit.py"))
            .args(["--grpc", &self.grpc, "--http", &self.http])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(120);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("emit.py timed out");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        let v = stdout
            .lines()
            .last()
            .and_then(|l| serde_json::from_str(l).ok())
            .unwrap_or(serde_json::Value::Null);
        (out.status.success(), v, stderr)
    }
}

impl Drop for Revenant {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

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
                .any(|a| a["rule"] == "activity-after-rejection" && a.to_string().contains(rid))
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
    let (code, ready) = http_get(&rv.admin, "/readyz");
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
    let (code, metrics) = http_get(&rv.admin, "/metrics");
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
    let (code, list) = http_get(&rv.admin, "/api/violations?rule=activity-after-rejection");
    assert_eq!(code, 200, "{list}");
    let list: serde_json::Value = serde_json::from_str(&list).unwrap();
    assert!(list["violations"].as_array().unwrap().len() >= 3, "{list}");
    // Any alias finds the timeline: the attempt by its rid (both legs), the request by its id.
    let rid = sent[0].1["rid"].as_str().unwrap();
    let (code, timeline) = http_get(&rv.admin, &format!("/api/requests/{rid}"));
    assert_eq!(code, 200, "{timeline}");
    let timeline: serde_json::Value = serde_json::from_str(&timeline).unwrap();
    let kinds: Vec<String> = timeline["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            format!(
                "{}/{}",
                e["stage"].as_str().unwrap(),
                e["kind"].as_str().unwrap()
            )
        })
        .collect();
    assert!(
        kinds.contains(&"prefill/rejected".to_string())
            && kinds.contains(&"decode/work".to_string()),
        "{kinds:?}"
    );
    let request_id = sent[0].1["request_id"].as_str().unwrap();
    let (code, timeline) = http_get(&rv.admin, &format!("/api/requests/{request_id}"));
    assert_eq!(code, 200, "{timeline}");
    assert!(timeline.contains("\"status\":400"), "{timeline}");
    let (code, _) = http_get(&rv.admin, "/api/requests/never-seen-alias");
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
                    && e["ids"]["bootstrap_room"] == room
                    && e["source"] == "otlp"
            })
        };
        assert!(
            has("prefill", "received") && has("prefill", "rejected"),
            "{transport}: {mine:#?}"
        );
        assert!(
            has("decode", "received") && has("decode", "work") && has("transfer", "work"),
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
            .find(|a| a["rule"] == "activity-after-rejection" && a.to_string().contains(rid))
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
                .any(|a| a["rule"] == "orphaned-leg" && a.to_string().contains(rid)),
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
            &rv.grpc,
            ExportTracePartialSuccess {
                rejected_spans: 7,
                error_message: String::new(),
            },
        )
        .await;
        assert_eq!(bad.unwrap_err().code(), tonic::Code::Internal);
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
        let bomb = raw_export_with(&rv.grpc, big.clone(), true).await;
        assert_eq!(bomb.unwrap_err().code(), tonic::Code::ResourceExhausted);
        let too_big = raw_export(&rv.grpc, big).await;
        // tonic answers an over-limit message with OUT_OF_RANGE (not retryable: resending cannot help).
        assert_eq!(too_big.unwrap_err().code(), tonic::Code::OutOfRange);
        // The receiver still serves well-formed exports afterwards.
        let ok = raw_export(&rv.grpc, ExportTraceServiceRequest::default()).await;
        assert!(ok.is_ok(), "{ok:?}");
    });
    assert!(rv.stop().success());
    let stderr = rv.stderr();
    assert!(
        stderr.contains("revenant_otlp_grpc_error_responses_total{code=\"13\"} 1"),
        "{stderr}"
    );
    assert!(
        stderr.contains("revenant_otlp_grpc_error_responses_total{code=\"11\"} 1"),
        "{stderr}"
    );
    assert!(
        stderr.contains("revenant_otlp_grpc_error_responses_total{code=\"8\"} 1"),
        "{stderr}"
    );
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
    let endpoint = format!("http://{}", collector.grpc);
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
        let (_, metrics) = http_get(&collector.admin, "/metrics");
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
