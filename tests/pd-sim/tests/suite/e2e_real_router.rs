//! End-to-end test 3 of the flagship issue: the real sglang-router 0.3.2 (`smg`, with
//! `--enable-trace` exporting to revenant) in front of the simulator's prefill and decode (also
//! exporting SGLang-shaped spans to revenant), and `revenant run --ebpf off`: OTLP alone.
//!
//! Needs the wheel and the revenant binary, so it is ignored by default; `cargo xtask test` runs
//! it with PD_SIM_SMG set (and builds revenant first). By hand:
//!   cargo build -p revenant && PD_SIM_SMG=target/xtask-venv/bin/smg \
//!     cargo test -p pd-sim --test suite -- --ignored e2e_real_router::
//!
//! What the real router does (observed, and asserted through the simulator's own accounting):
//! it sends the same `/generate` to prefill and decode at once with a fresh `bootstrap_room`;
//! when prefill refuses (400 capacity, 503 queue full) the decode leg is not cancelled: decode
//! bootstraps the refused room with prefill, waits for KV that never comes, answers 500, and the
//! router retries the whole request with a new room (same `x-request-id`, same trace id: smg
//! propagates its trace context to both workers).
//!
//! On SGLang 0.5.23's wire protocol "bootstraps the refused room" means: decode looks prefill
//! up (cached), allocates the room's KV and publishes its destinations (the 10-frame message);
//! at its waiting timeout it sends ABORT, which prefill acknowledges. What revenant must make of
//! those frames is its own parsing (these tests assert its verdicts).

use crate::support;

use std::collections::{BTreeSet, HashSet};
use std::path::PathBuf;
use std::time::Duration;

use pd_sim::http::http_client;
use pd_sim::smg::{SmgProcess, write_tiny_model};
use serde_json::{Value, json};
use support::*;
use test_harness::notifications::room_of;
use test_harness::{Revenant, ScratchDir};

fn smg_bin() -> PathBuf {
    test_harness::router_from_env("PD_SIM_SMG", "sglang-router 0.3.2")
}

/// revenant + simulator workers exporting to it + the real smg exporting to it.
struct Setup {
    // Field order is drop order: router first, then workers, then the monitor.
    smg: SmgProcess,
    cluster: Cluster,
    revenant: Revenant,
    scratch: ScratchDir,
}

async fn setup(tag: &str, prefill_args: &str, decode_args: &str) -> Setup {
    let smg = smg_bin();
    let scratch = ScratchDir::new(tag).unwrap();
    let revenant = start_revenant(scratch.path(), &[]);
    let otlp = format!("http://{}", revenant.otlp_http);
    let cluster = Cluster::start(
        "correct",
        &[
            "--no-router",
            "--otlp-endpoint",
            &otlp,
            "--prefill-args",
            prefill_args,
            "--decode-args",
            decode_args,
        ],
    )
    .await;
    let model = scratch.path().join("model");
    write_tiny_model(&model).unwrap();
    let log = scratch.path().join("smg.log");
    let grpc = revenant.otlp_grpc.clone();
    let inner: &test_harness::Cluster = &cluster;
    // smg's startup (worker discovery, tokenizer) takes about a second; wait on its /health.
    let smg = tokio::task::block_in_place(|| {
        SmgProcess::start(
            &smg,
            inner,
            &model,
            Some(&grpc),
            &log,
            &["--retry-initial-backoff-ms", "10"],
        )
    })
    .unwrap_or_else(|e| panic!("smg: {e}"));
    Setup {
        smg,
        cluster,
        revenant,
        scratch,
    }
}

impl Setup {
    /// Every violation the checker found (admin `/api/violations`: not deduplicated).
    fn violations(&self) -> Vec<Value> {
        let (status, v) = self
            .revenant
            .admin_json("/api/violations?limit=10000")
            .unwrap_or_else(|e| panic!("admin: {e}"));
        assert_eq!(status, 200, "{v}");
        v["violations"].as_array().cloned().unwrap_or_default()
    }

    /// The admin server's Prometheus text.
    fn metrics(&self) -> String {
        let (_, b) = test_harness::http_get(&format!("{}/metrics", self.revenant.admin_url()))
            .unwrap_or_else(|e| panic!("admin /metrics: {e}"));
        b
    }

    /// What the sinks delivered: the alerts JSONL lines (notifications).
    fn notifications(&self) -> Vec<Value> {
        self.revenant.alerts()
    }

    fn context(&self) -> String {
        format!(
            "revenant stderr:\n{}\nviolations:\n{}\nnotifications:\n{}\n(scratch dir {}; set PD_SIM_KEEP_SCRATCH=1 to keep it)",
            self.revenant.log_tail(40),
            self.violations()
                .iter()
                .map(Value::to_string)
                .collect::<Vec<_>>()
                .join("\n"),
            self.notifications()
                .iter()
                .map(Value::to_string)
                .collect::<Vec<_>>()
                .join("\n"),
            self.scratch.path().display()
        )
    }
}

/// The simulator's accounting of one client request at one worker: its rooms, by x-request-id.
async fn attempts_at(base: &str, request_id: &str) -> Vec<Value> {
    let client = http_client(2);
    rooms(&client, base)
        .await
        .into_iter()
        .filter(|r| r["request_id"] == request_id)
        .collect()
}

fn room_set(rs: &[Value]) -> BTreeSet<u64> {
    rs.iter().map(|r| r["room"].as_u64().unwrap()).collect()
}

/// Sum of a metric's samples over all its label sets (0 when absent).
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with(' ') || r.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The trace id revenant saw on the router's span for this x-request-id.
fn router_trace(events: &[Value], request_id: &str) -> Option<String> {
    events
        .iter()
        .map(|e| e.get("event").unwrap_or(e))
        .find(|e| e["stage"] == "router" && e["ids"]["request_id"] == request_id)
        .and_then(|e| e["ids"]["trace_id"].as_str().map(str::to_owned))
}

/// Drive one request through smg and wait until the simulator says every attempt is over
/// (prefill refused it, decode's leg ended); returns the prefill rooms.
async fn refused_request(
    s: &Setup,
    request_id: &str,
    body: Value,
    prefill_status: u64,
) -> Vec<Value> {
    let client = http_client(2);
    let (status, resp) = post(
        &client,
        &format!("{}/generate", s.smg.url),
        request_id,
        body,
    )
    .await;
    assert_ne!(status, 200, "{}", String::from_utf8_lossy(&resp));
    let prefill = attempts_at(&s.cluster.prefill, request_id).await;
    assert!(!prefill.is_empty(), "prefill never saw {request_id}");
    assert!(
        prefill.iter().all(|r| r["status"] == prefill_status),
        "{prefill:?}"
    );
    assert_eq!(
        room_set(&prefill).len(),
        prefill.len(),
        "a new bootstrap_room per attempt: {prefill:?}"
    );
    // The decode leg was never cancelled: it published destinations for every refused room.
    assert!(
        prefill.iter().all(|r| r["destinations_received"] == 1),
        "{prefill:?}"
    );
    let n = prefill.len();
    // Decode holds a refused room until its waiting timeout (8 s here, past revenant's 6 s
    // window for a decode leg; SGLang's default is 300 s).
    let decode = eventually("decode legs end", Duration::from_secs(60), || {
        let (url, id) = (s.cluster.decode.clone(), request_id.to_string());
        async move {
            let d = attempts_at(&url, &id).await;
            (d.len() == n && d.iter().all(|r| r["outcome"] == "kv-failed")).then_some(d)
        }
    })
    .await;
    assert_eq!(room_set(&decode), room_set(&prefill));
    prefill
}

/// Every attempt of `request_id` yields exactly one orphaned-leg: prefill's refusal as trigger,
/// decode's in-flight leg as context, all under the router's trace; nothing else fires (nothing
/// advanced: no KV moved, no output). Returns the violations.
async fn expect_one_violation_per_attempt(
    s: &Setup,
    request_id: &str,
    rooms: &BTreeSet<u64>,
) -> Vec<Value> {
    let trace = eventually(
        "the router's span reaches revenant",
        Duration::from_secs(30),
        || {
            let ev = s.revenant.events();
            async move { router_trace(&ev, request_id) }
        },
    )
    .await;
    // Judged once revenant's watermark (15 s of lateness behind) passes the window.
    let found = eventually(
        "a violation for every refused attempt",
        Duration::from_secs(45),
        || {
            let v = s.violations();
            let rooms = rooms.clone();
            async move {
                let seen: BTreeSet<u64> = v.iter().filter_map(|v| room_of(&v["attempt"])).collect();
                rooms.is_subset(&seen).then_some(v)
            }
        },
    )
    .await;
    let ctx = s.context();
    let mine: Vec<Value> = found
        .iter()
        .filter(|v| v["request"]["trace_id"] == trace.as_str())
        .cloned()
        .collect();
    assert_eq!(
        mine.len(),
        found.len(),
        "violations outside the request: {ctx}"
    );
    for v in &mine {
        assert_eq!(v["rule"], "orphaned-leg", "{ctx}");
        let ev = v["evidence"].as_array().unwrap();
        let trigger = ev.iter().find(|e| e["role"] == "trigger").unwrap();
        let leg = ev.iter().find(|e| e["role"] == "context").unwrap();
        assert_eq!(
            (&trigger["stage"], &trigger["kind"], &trigger["source"]),
            (&json!("prefill"), &json!("rejected"), &json!("otlp")),
            "{ctx}"
        );
        assert_eq!(
            (&leg["stage"], &leg["kind"]),
            (&json!("decode"), &json!("received")),
            "{ctx}"
        );
    }
    let per_room: Vec<u64> = mine.iter().filter_map(|v| room_of(&v["attempt"])).collect();
    assert_eq!(
        per_room.len(),
        rooms.len(),
        "exactly one violation per attempt: {ctx}"
    );
    assert_eq!(&per_room.iter().copied().collect::<BTreeSet<_>>(), rooms);
    // Notified once: one incident for the request. The violations themselves may carry two
    // fingerprints (keyed by the trace id before smg's span brings the x-request-id, by the
    // x-request-id after); the alert layer puts every violation sharing a request alias with an
    // incident into it.
    let fingerprints: HashSet<&str> = mine
        .iter()
        .map(|v| v["fingerprint"].as_str().unwrap())
        .collect();
    if fingerprints.len() > 1 {
        eprintln!(
            "note: {request_id}: violations carry {} fingerprints",
            fingerprints.len()
        );
    }
    // Wait until the dispatcher has judged every violation and the JSONL sink has written what
    // it notified, so a second notification could not still be on its way.
    let n = mine.len() as f64;
    eventually("the dispatcher settles", Duration::from_secs(15), || {
        let m = s.metrics();
        async move {
            // Every finding opened an incident, merged into one, or repeated a rule it lists.
            let judged = metric(&m, "revenant_alerts_incidents_opened_total")
                + metric(&m, "revenant_alerts_findings_merged_total")
                + metric(&m, "revenant_alerts_deduplicated_total");
            let written = metric(&m, "revenant_alert_delivered_notifications_total");
            (metric(&m, "revenant_alerts_received_total") >= n && judged >= n && written >= 1.0)
                .then_some(())
        }
    })
    .await;
    let notified: Vec<Value> = s
        .notifications()
        .into_iter()
        .filter(|n| n["type"] == "incident")
        .collect();
    assert_eq!(notified.len(), 1, "notified once: {ctx}");
    let rules = notified[0]["rules"].as_array().unwrap();
    assert_eq!(rules, &vec![json!("orphaned-leg")], "{ctx}");
    assert_eq!(notified[0]["request"]["trace_id"], trace.as_str(), "{ctx}");
    // The admin timeline, looked up by the client's x-request-id, holds every attempt.
    let (status, t) = s
        .revenant
        .admin_json(&format!("/api/requests/{request_id}"))
        .unwrap();
    assert_eq!(status, 200, "{t}");
    assert_eq!(t["aliases"]["request_ids"], json!([request_id]), "{t}");
    assert_eq!(t["aliases"]["trace_ids"], json!([trace]), "{t}");
    let timeline_rooms: BTreeSet<u64> = t["aliases"]["bootstrap_rooms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| room_of(r).unwrap_or_else(|| panic!("a timeline room without its pair: {r}")))
        .collect();
    assert_eq!(
        &timeline_rooms, rooms,
        "every attempt in the request's timeline: {t}"
    );
    mine
}

/// (a) A prefill capacity rejection (400, input over `max_req_input_len`) whose decode leg
/// continues: sglang-router 0.3.2 never withdraws it, decode bootstraps the refused room and
/// holds the leg until its KV timeout (8 s here, past revenant's 6 s window for a decode leg). Whether decode
/// got its leg before or after the refusal, the leg outlived the window: orphaned-leg for every
/// attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PD_SIM_SMG (sglang-router 0.3.2 `smg`) and the revenant binary"]
async fn smg_capacity_rejection_with_live_decode_leg_is_an_orphaned_leg() {
    let s = setup("e2e-smg-400", "", "--kv-timeout-ms 8000").await;
    // A request that fits: served, no violation.
    let client = http_client(2);
    let (status, body) = post(
        &client,
        &format!("{}/generate", s.smg.url),
        "e2e-ok",
        json!({"text": words(8)}),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));

    let prefill = refused_request(&s, "e2e-rej", json!({"text": words(5000)}), 400).await;
    let rooms = room_set(&prefill);
    let v = expect_one_violation_per_attempt(&s, "e2e-rej", &rooms).await;
    for v in &v {
        let evidence = v["evidence"].as_array().unwrap();
        let trigger = evidence.iter().find(|e| e["role"] == "trigger").unwrap();
        assert!(
            trigger["reason"]
                .as_str()
                .is_some_and(|r| r.contains("exceeds the maximum allowed length")),
            "{v}"
        );
    }
    eprintln!(
        "smg made {} attempts for e2e-rej; {} violations",
        rooms.len(),
        v.len()
    );
}

/// (b) The 503 retry storm: prefill answers every attempt "queue full" (`--overload-share 1`);
/// smg retries with a new bootstrap_room each time under one x-request-id. revenant correlates
/// the attempts as one request (one trace, one fingerprint) and flags each refused attempt whose
/// decode leg outlived its 6 s window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PD_SIM_SMG (sglang-router 0.3.2 `smg`) and the revenant binary"]
async fn smg_503_retry_storm_is_one_request_with_several_attempts() {
    let s = setup("e2e-smg-503", "--overload-share 1", "--kv-timeout-ms 8000").await;
    let prefill = refused_request(&s, "e2e-storm", json!({"text": words(8)}), 503).await;
    let rooms = room_set(&prefill);
    assert!(rooms.len() >= 2, "smg retried: {prefill:?}");
    let v = expect_one_violation_per_attempt(&s, "e2e-storm", &rooms).await;
    eprintln!(
        "smg made {} attempts for e2e-storm; {} violations",
        rooms.len(),
        v.len()
    );
}
