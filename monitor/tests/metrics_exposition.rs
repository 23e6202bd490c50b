//! `/metrics` of a running `revenant run` that saw traffic and a violation: the format follows the
//! scraper's `Accept` header, the text format has HELP and TYPE for every family and passes
//! `promtool check metrics` (from `cargo xtask setup`; the test fails when it is missing).
//! Run: `cargo test -p revenant --test metrics_exposition`.

mod support;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};
use support::*;

const MS: u128 = 1_000_000;

/// One blocking HTTP/1.1 exchange: status, lower-cased head, body.
fn exchange(addr: &str, request: &str, body: &[u8]) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).unwrap();
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(
        !head.contains("transfer-encoding: chunked"),
        "the test reads plain bodies only: {head}"
    );
    let body = String::from_utf8_lossy(&buf[end + 4..]).into_owned();
    (status, head, body)
}

fn scrape(admin: &str, accept: Option<&str>) -> (String, String) {
    let accept = accept.map_or(String::new(), |a| format!("Accept: {a}\r\n"));
    let (status, head, body) = exchange(
        admin,
        &format!("GET /metrics HTTP/1.1\r\nHost: {admin}\r\n{accept}Connection: close\r\n\r\n"),
        b"",
    );
    assert_eq!(status, 200, "{head}");
    let ct = head
        .lines()
        .find_map(|l| l.strip_prefix("content-type: "))
        .unwrap()
        .to_owned();
    (ct, body)
}

fn b64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn span(
    trace: u128,
    id: u64,
    parent: u64,
    name: &str,
    start: u128,
    end: u128,
    attrs: Value,
) -> Value {
    let attrs: Vec<Value> = attrs
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| match v {
            Value::Number(n) => json!({"key": k, "value": {"intValue": n.to_string()}}),
            other => json!({"key": k, "value": {"stringValue": other.as_str().unwrap()}}),
        })
        .collect();
    let mut s = json!({
        "traceId": b64(&trace.to_be_bytes()),
        "spanId": b64(&id.to_be_bytes()),
        "name": name,
        "kind": "SPAN_KIND_INTERNAL",
        "startTimeUnixNano": start.to_string(),
        "endTimeUnixNano": end.to_string(),
        "attributes": attrs,
        "status": {},
    });
    if parent != 0 {
        s["parentSpanId"] = json!(b64(&parent.to_be_bytes()));
    }
    s
}

fn export(http: &str, service: &str, host: &str, scope: &str, spans: Vec<Value>) {
    let doc = json!({"resourceSpans": [{
        "resource": {"attributes": [
            {"key": "service.name", "value": {"stringValue": service}},
            {"key": "host.name", "value": {"stringValue": host}},
        ]},
        "scopeSpans": [{"scope": {"name": scope}, "spans": spans}],
    }]})
    .to_string();
    let (status, head, body) = exchange(
        http,
        &format!(
            "POST /v1/traces HTTP/1.1\r\nHost: {http}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            doc.len()
        ),
        doc.as_bytes(),
    );
    assert_eq!(status, 200, "{head}\n{body}");
}

/// SGLang's prefill rejects an attempt and its decode leg decodes anyway (the disclosed bug),
/// over OTLP/HTTP JSON.
fn reject_then_decode(http: &str) {
    let t0 = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let rid = "8f3c2b1a9d7e4f60a1b2c3d4e5f6a001";
    let room = format!("{:#x}", 0x314783F6BEF7A001u64);
    let reason = format!("Request {rid} exceeds the maximum number of tokens: 9000 > 8192");
    let (tp, td) = (0x11u128 << 64 | 1, 0x22u128 << 64 | 2);
    let mut prefill_sched = span(
        tp,
        2,
        1,
        "Prefill Scheduler [TP 0] (host:prefill- | pid:4242)",
        t0 + MS,
        t0 + 4 * MS,
        json!({"thread_label": "Prefill Scheduler", "pid": 4242, "reason": reason}),
    );
    prefill_sched["status"] = json!({"code": "STATUS_CODE_ERROR"});
    let prefill = vec![
        span(
            tp,
            3,
            2,
            "prefill_prepare",
            t0 + 2 * MS,
            t0 + 3 * MS,
            json!({}),
        ),
        prefill_sched,
        span(
            tp,
            1,
            99,
            "prefill Req 8f3c2b1a",
            t0,
            t0 + 5 * MS,
            json!({"rid": rid, "bootstrap_room": room}),
        ),
    ];
    let dt = t0 + 204 * MS;
    let decode = vec![
        span(td, 3, 2, "decode_transferred", dt, dt + 5 * MS, json!({})),
        span(
            td,
            4,
            2,
            "decode_loop",
            dt + 5 * MS,
            dt + 20 * MS,
            json!({}),
        ),
        span(
            td,
            2,
            1,
            "Decode Scheduler [TP 0] (host:decode-n | pid:4243)",
            t0 + MS,
            dt + 21 * MS,
            json!({"thread_label": "Decode Scheduler", "pid": 4243}),
        ),
        span(
            td,
            1,
            0,
            "decode Req 8f3c2b1a",
            t0,
            dt + 22 * MS,
            json!({"rid": rid, "bootstrap_room": room}),
        ),
    ];
    export(http, "sglang", "prefill-node", "sglang server", prefill);
    export(http, "sglang", "decode-node", "sglang server", decode);
}

/// The metric names a text exposition's samples use, and the names its HELP and TYPE lines give.
fn names(text: &str) -> (BTreeSet<String>, BTreeSet<String>, BTreeSet<String>) {
    let (mut samples, mut help, mut types) = (BTreeSet::new(), BTreeSet::new(), BTreeSet::new());
    for line in text.lines() {
        let mut words = line.split_whitespace();
        match (words.next(), words.next(), words.next()) {
            (Some("#"), Some("HELP"), Some(name)) => {
                help.insert(name.to_owned());
            }
            (Some("#"), Some("TYPE"), Some(name)) => {
                types.insert(name.to_owned());
            }
            (Some(w), _, _) if !w.starts_with('#') => {
                let name = w.split('{').next().unwrap();
                samples.insert(name.to_owned());
            }
            _ => {}
        }
    }
    (samples, help, types)
}

#[test]
fn metrics_negotiate_the_format_and_the_text_format_passes_promtool() {
    let promtool = system_bin("promtool");
    let rv = Revenant::start("metrics-exposition", &[]);
    reject_then_decode(&rv.otlp_http);
    let admin = rv.admin.clone();
    futures_block_on(eventually(
        "a violation in /api/violations",
        Duration::from_secs(30),
        async || {
            let (_, body) = admin_get(&admin, "/api/violations");
            let v: Value = serde_json::from_str(&body).ok()?;
            (!v["violations"].as_array()?.is_empty()).then_some(())
        },
    ));

    // No Accept, curl's */*, and what promtool and most agents ask for: the text format.
    for accept in [None, Some("*/*"), Some("text/plain;version=0.0.4")] {
        let (ct, body) = scrape(&admin, accept);
        assert_eq!(ct, "text/plain; version=0.0.4; charset=utf-8", "{accept:?}");
        assert!(!body.contains("# EOF"), "{accept:?}");
    }
    // Prometheus' default Accept header prefers OpenMetrics.
    let (ct, om) = scrape(
        &admin,
        Some(
            "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;\
             version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
        ),
    );
    assert_eq!(
        ct,
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    assert!(om.trim_end().ends_with("# EOF"), "{om}");

    let (_, text) = scrape(&admin, None);
    let (samples, help, types) = names(&text);
    assert!(
        samples.contains("revenant_checker_violations_total"),
        "{text}"
    );
    assert!(
        samples.contains("revenant_checker_lag_seconds_bucket"),
        "{text}"
    );
    // Every sample belongs to a family with HELP and TYPE under the name the text format uses.
    for s in &samples {
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| {
                let base = s.strip_suffix(suffix)?;
                types.contains(base).then_some(base)
            })
            .unwrap_or(s);
        assert!(help.contains(family), "no HELP for {s}:\n{text}");
        assert!(types.contains(family), "no TYPE for {s}:\n{text}");
    }

    let mut child = Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && report.trim().is_empty(),
        "promtool check metrics ({}):\n{report}\non:\n{text}",
        out.status
    );
}

/// Drives a future to completion on this thread (`eventually` needs no particular runtime).
fn futures_block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(f)
}

/// Before any traffic, every documented family a dashboard reads is there at 0 (not absent):
/// the events and lag of each declared source, the delivery histograms of each sink, the
/// alerting counters of each rule.
#[test]
fn documented_families_are_there_at_start_up() {
    let rv = Revenant::start("metrics-at-start", &[]);
    let (_, text) = scrape(&rv.admin, None);
    for series in [
        "revenant_events_total{source=\"otlp\",stage=\"decode\",kind=\"work\"} 0",
        "revenant_checker_lag_seconds_count{source=\"otlp\"} 0",
        "revenant_alert_latency_seconds_count{sink=\"jsonl\"} 0",
        "revenant_alert_delivery_duration_seconds_count{sink=\"jsonl\"} 0",
        "revenant_alerts_received_total{rule=\"activity-after-rejection\",severity=\"critical\"} 0",
        "revenant_alerts_incidents_opened_total{rule=\"orphaned-leg\"} 0",
        "revenant_alerts_notified_total{rule=\"stuck-attempt\"} 0",
    ] {
        assert!(text.contains(series), "no {series} in\n{text}");
    }
}
