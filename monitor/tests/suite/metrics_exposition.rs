//! `/metrics` of a running `revenant run` that saw traffic and a violation: the format follows the
//! scraper's `Accept` header, the text format has HELP and TYPE for every family and passes
//! `promtool check metrics` (from `cargo xtask setup`; the test fails when it is missing).
//! Run: `cargo test -p revenant --test metrics_exposition`.

use crate::support;
use crate::traffic;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use support::*;

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
    traffic::reject_then_decode(&rv.otlp_http, 1);
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
        // The memory budget (the default 512MiB) and its split, evictions at 0.
        "revenant_memory_budget_bytes 536870912",
        "revenant_memory_evictions_total{structure=\"attempts\"} 0",
        "revenant_memory_evictions_total{structure=\"span_tree\"} 0",
        "revenant_memory_evictions_total{structure=\"timeline\"} 0",
    ] {
        assert!(text.contains(series), "no {series} in\n{text}");
    }
    for structure in [
        "attempts",
        "tombstones",
        "span_tree",
        "event_channel",
        "timeline",
        "recent_violations",
    ] {
        for family in [
            "revenant_memory_cap_bytes",
            "revenant_memory_estimated_bytes",
        ] {
            let series = format!("{family}{{structure=\"{structure}\"}} ");
            assert!(text.contains(&series), "no {series} in\n{text}");
        }
        let cap = format!("revenant_memory_cap_bytes{{structure=\"{structure}\"}} 0\n");
        assert!(
            !text.contains(&cap),
            "{structure} has no share of the budget"
        );
    }
}
