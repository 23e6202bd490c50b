//! The real smg 1.13.0 (PyPI `smg`, the successor of `sglang-router`) in front of the
//! simulator's prefill and decode, revenant watching with eBPF (the three pids) and OTLP (smg's
//! `--enable-trace` spans over gRPC, the workers' SGLang-shaped spans over HTTP).
//!
//! Ignored by default: it needs the wheel, the revenant binary and root (eBPF). `cargo xtask
//! test` creates target/xtask-venv-smg113 and runs it with PD_SIM_SMG113 set; by hand:
//!   python3 -m venv target/xtask-venv-smg113 && target/xtask-venv-smg113/bin/pip install smg==1.13.0
//!   cargo build -p revenant && PD_SIM_SMG113=target/xtask-venv-smg113/bin/smg \
//!     cargo test -p pd-sim --test smg_1_13 -- --ignored --nocapture
//!
//! What smg 1.13.0 does (verified against the simulator on loopback, numbers from its
//! `/sim/rooms` timestamps; `docs/routers.md` has the same):
//! - It sends the same `/generate` to prefill and decode at once, with a fresh `bootstrap_room`,
//!   `bootstrap_host`/`bootstrap_port` added: decode's leg arrives a median ~0.01 ms after
//!   prefill's (−5 … +5 ms), usually before prefill has answered, and decode mostly publishes
//!   its destinations for the room to prefill (the 10-frame ZMTP message) before the cancel
//!   reaches it.
//! - When prefill answers an error it closes the decode leg at once and answers the client:
//!   decode saw its connection close 0.3 ms (p50) after prefill's answer, p99 1.9-3.1 ms, max
//!   3.1-4.1 ms (275 and 493 legs, 200 requests/s, release simulator); in this test (debug
//!   simulator, revenant on eBPF, 2 shared cores) p50 1.1-1.3 ms, p99 5.6-6.4 ms, max 6.9-7.6 ms.
//!   Decode then sends `ABORT` for the room (when SGLang's tokenizer next polls the connection
//!   of a non-streamed request, every 4 s; at once for a streamed one). Some decode legs (4-16 %)
//!   are closed before decode has read the request: decode never sees that attempt at all.
//! - It withdraws decode only on an error status: a streamed refusal is a 200 with the error in
//!   the stream (SGLang's `http_server`), so its decode leg stays, publishes destinations and
//!   waits for KV that never comes (`smg_1_13_keeps_the_decode_leg_of_a_streamed_refusal`).
//! - 400 (input over capacity): not retried; the client gets 400 with
//!   `x-smg-error-code: prefill_bad_request` and prefill's message inside smg's error JSON.
//!   503 (queue full): retried up to 5 attempts in all (`--retry-max-retries`, default 5), each
//!   with a new `bootstrap_room`, under one `x-request-id`, backoff ~50 ms growing by 1.5; when
//!   every attempt fails the client gets 503 with `x-smg-error-code: prefill_unavailable`.
//! - It forwards the client's `x-request-id` to both workers (one it made up, `gnt-…`, when the
//!   client sent none) and answers it back; it continues a client `traceparent` (its span's parent
//!   is the client's span), passes its own span's context on to both workers and answers with a
//!   `traceparent` of its own.
//! - Its OTLP span: one `http_request` per client request (scope and `service.name` `smg`):
//!   `method`, `path` (0.3.2 said `uri`), `request_id`, `status_code` (a string), `trace_id`,
//!   `latency`, `target` `smg::otel-trace`; events "Sending concurrent requests" {prefill_url,
//!   decode_url} per attempt and "Received concurrent requests". Nothing in it tells a withdrawn
//!   leg or a bootstrap room (see monitor/src/normalize/smg.rs).
//! - Its process retitles itself `smg::router` (setproctitle): eBPF finds it by pid, not by a
//!   `--watch` rule on `smg launch`.

mod support;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::time::Duration;

use pd_sim::smg::{SmgProcess, write_tiny_model};
use serde_json::Value;
use support::*;
use test_harness::notifications::room_of;
use test_harness::{Revenant, ScratchDir, free_port, http_json, metric_sum};

/// How long after a prefill rejection the decode leg must have ended (the default cancellation
/// window of the rules).
const WINDOW_MS: f64 = 500.0;

fn smg113_bin() -> PathBuf {
    test_harness::router_from_env("PD_SIM_SMG113", "smg 1.13.0")
}

/// Workers exporting to revenant, smg 1.13.0 exporting to revenant, revenant watching all three
/// pids with eBPF.
struct Setup {
    // Field order is drop order: router first, then workers, then the monitor.
    smg: SmgProcess,
    cluster: Cluster,
    revenant: Revenant,
    scratch: ScratchDir,
}

async fn setup(tag: &str, prefill_args: &str, decode_args: &str) -> Setup {
    assert!(
        test_harness::is_root(),
        "this test loads eBPF probes and must run as root (cargo xtask test does, as CI)"
    );
    let bin = smg113_bin();
    let scratch = ScratchDir::new(tag).unwrap();
    // revenant needs the pids, so it starts last; the exporters connect once there are spans.
    let grpc = format!("127.0.0.1:{}", free_port().unwrap());
    let http = format!("127.0.0.1:{}", free_port().unwrap());
    let cluster = Cluster::start(
        "correct",
        &[
            "--no-router",
            "--otlp-endpoint",
            &format!("http://{http}"),
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
    let inner: &test_harness::Cluster = &cluster;
    let smg = tokio::task::block_in_place(|| {
        SmgProcess::start(
            &bin,
            inner,
            &model,
            Some(&grpc),
            &log,
            &["--retry-initial-backoff-ms", "10"],
        )
    })
    .unwrap_or_else(|e| panic!("smg: {e:#}"));
    assert_eq!(smg.version, "smg 1.13.0", "PD_SIM_SMG113={}", bin.display());
    let router_pid = format!("router={}", smg.pid());
    let mut args: Vec<String> = [
        "--otlp-grpc",
        &grpc,
        "--otlp-http",
        &http,
        "--ebpf",
        "on",
        "--no-sglang-conventions",
        "--pid",
        &router_pid,
    ]
    .map(String::from)
    .to_vec();
    args.extend(cluster.pid_args());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let revenant = start_revenant(scratch.path(), &args);
    assert_eq!(revenant.ready["ebpf"], "live", "{}", revenant.ready);
    Setup {
        smg,
        cluster,
        revenant,
        scratch,
    }
}

/// What one run left behind.
struct Outcome {
    load: Value,
    /// Per room: the prefill record and decode's, if decode ever read the request.
    prefill: Vec<Value>,
    decode: HashMap<u64, Value>,
    violations: Vec<Value>,
    notifications: Vec<Value>,
    metrics: Vec<test_harness::Sample>,
}

impl Outcome {
    /// Prefill rooms refused (400 over capacity, 503 queue full), answered with an error
    /// status or, streamed, with the error inside a 200.
    fn rejected(&self) -> Vec<&Value> {
        self.prefill
            .iter()
            .filter(|r| {
                r["status"].as_u64().unwrap_or(0) >= 400
                    || r["error_code"].as_u64().unwrap_or(0) >= 400
            })
            .collect()
    }

    fn events(&self, source: &str, stage: &str, kind: &str) -> u64 {
        metric_sum(
            &self.metrics,
            "revenant_events_total",
            &[("source", source), ("stage", stage), ("kind", kind)],
        ) as u64
    }

    fn per_rule(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for v in &self.violations {
            *m.entry(v["rule"].as_str().unwrap_or("?").to_string())
                .or_insert(0) += 1;
        }
        m
    }

    /// First proofs (corroborations left out) by rule and offending event.
    fn by_offender(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for v in self.violations.iter().filter(|v| v["corroborates"] != true) {
            let off = v["evidence"]
                .as_array()
                .and_then(|e| e.iter().find(|e| e["role"] == "offender"))
                .map(|e| format!("{} {} ({})", e["stage"], e["kind"], e["source"]))
                .unwrap_or_else(|| "-".into());
            *m.entry(format!("{}: {off}", v["rule"].as_str().unwrap_or("?")))
                .or_insert(0) += 1;
        }
        m
    }

    fn show_violations(&self, n: usize) -> String {
        self.violations
            .iter()
            .take(n)
            .map(|v| v["summary"].as_str().unwrap_or("?").to_string())
            .collect::<Vec<_>>()
            .join("\n")
    }
}

fn ms(a: &Value, b: &Value, key_a: &str, key_b: &str) -> Option<f64> {
    let (x, y) = (a[key_a].as_u64()?, b[key_b].as_u64()?);
    (x > 0 && y > 0).then(|| (x as f64 - y as f64) / 1e6)
}

fn quantiles(mut v: Vec<f64>) -> String {
    if v.is_empty() {
        return "none".into();
    }
    v.sort_by(f64::total_cmp);
    let q = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    format!(
        "n={} min={:.3} p50={:.3} p90={:.3} p99={:.3} max={:.3} ms",
        v.len(),
        v[0],
        q(0.5),
        q(0.9),
        q(0.99),
        v[v.len() - 1]
    )
}

/// The load through smg, then everything revenant and the simulator recorded once every decode
/// leg ended and revenant went quiet (revenant is stopped: its alerts drained to the file).
async fn drive(s: &mut Setup, load: &[&str]) -> Outcome {
    let load = tokio::task::block_in_place(|| run_load(&s.smg.url, load));
    let decode_url = s.cluster.decode.clone();
    eventually("every decode leg ended", Duration::from_secs(60), || {
        let url = decode_url.clone();
        async move {
            let client = pd_sim::http::http_client(2);
            let d = rooms(&client, &url).await;
            d.iter().all(|r| r["outcome"] != "pending").then_some(())
        }
    })
    .await;
    // Past the cancellation window, so deadline rules have judged every attempt.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let metrics = tokio::task::block_in_place(|| {
        s.revenant
            .wait_quiet(Duration::from_secs(3), Duration::from_secs(90), None)
    })
    .unwrap_or_else(|e| panic!("{e:#}\n{}", s.revenant.log_tail(30)));
    let (status, v) = s
        .revenant
        .admin_json("/api/violations?limit=100000")
        .unwrap_or_else(|e| panic!("admin: {e:#}"));
    assert_eq!(status, 200, "{v}");
    let violations = v["violations"].as_array().cloned().unwrap_or_default();
    let as_vec = |v: Value| v.as_array().cloned().unwrap_or_default();
    let prefill = as_vec(http_json(&format!("{}/sim/rooms", s.cluster.prefill)).unwrap());
    let decode = as_vec(http_json(&format!("{}/sim/rooms", s.cluster.decode)).unwrap())
        .into_iter()
        .filter_map(|r| Some((r["room"].as_u64()?, r)))
        .collect();
    let stopped =
        tokio::task::block_in_place(|| s.revenant.stop()).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(stopped.success(), "{}", s.revenant.log_tail(30));
    let notifications = s
        .revenant
        .notifications()
        .unwrap()
        .into_iter()
        // Incidents and rate-limit summaries: anything the sinks said is an alert.
        .filter(|n| n["type"] == "incident" || n["type"] == "suppressed")
        .collect();
    Outcome {
        load,
        prefill,
        decode,
        violations,
        notifications,
        metrics,
    }
}

/// Nothing was lost on the way in: a clean result must not come from dropped evidence.
fn assert_no_loss(o: &Outcome, s: &Setup) {
    let drops: Vec<String> = o
        .metrics
        .iter()
        .filter(|m| m.name == "revenant_dropped_items_total" && m.value > 0.0)
        .map(|m| format!("{:?} {}", m.labels, m.value))
        .collect();
    assert!(drops.is_empty(), "revenant dropped data: {drops:?}");
    let stats = http_json(&format!("{}/sim/stats", s.cluster.prefill)).unwrap();
    let lost = stats["otlp"]["spans_dropped_queue_full"]
        .as_u64()
        .unwrap_or(0)
        + stats["otlp"]["spans_failed"].as_u64().unwrap_or(0);
    assert_eq!(lost, 0, "prefill's exporter lost spans: {}", stats["otlp"]);
    // Both sources saw prefill's refusals (the workers' spans; the kernel's view of the answers).
    let rejected = o.rejected().len() as u64;
    assert_eq!(
        o.events("otlp", "prefill", "rejected"),
        rejected,
        "OTLP: one prefill rejection per refused room"
    );
    let ebpf = o.events("ebpf", "prefill", "rejected");
    let ebpf_losses: Vec<String> = o
        .metrics
        .iter()
        .filter(|m| {
            m.name.starts_with("revenant_ebpf_")
                && m.name.ends_with("_total")
                && !m.name.contains("records")
                && !m.name.contains("lifecycle_events")
                && m.value > 0.0
        })
        .map(|m| format!("{} {:?} {}", m.name, m.labels, m.value))
        .collect();
    assert!(
        ebpf * 100 >= rejected * 95,
        "eBPF saw {ebpf} of {rejected} prefill rejections; eBPF counters: {ebpf_losses:?}"
    );
    // smg's own spans came in: one router span per client request (and its health probes).
    let sent = o.load["sent"].as_u64().unwrap();
    assert!(
        o.events("otlp", "router", "received") >= sent,
        "smg's spans reached revenant"
    );
}

/// 1000 requests through smg 1.13.0, a quarter over prefill's capacity (400) and a few refused
/// as "queue full" (503, retried with new rooms), decode honouring smg's cancel: every refused
/// attempt's decode leg is closed within milliseconds, nothing advances after a rejection, and
/// revenant must raise nothing at all, from either source.
///
/// This needs the engine's advancement model (a decode leg that arrived, published its
/// destinations and was withdrawn is in flight, not activity): with an engine that counts any
/// later event as activity it reports decode's destinations (eBPF's ZMTP frames) as
/// `activity-after-rejection` for about half the refused attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PD_SIM_SMG113 (smg 1.13.0), the revenant binary and root (eBPF)"]
async fn smg_1_13_cancelled_decode_legs_raise_nothing() {
    let mut s = setup("smg113-cancel", "--overload-share 0.03", "").await;
    let o = drive(
        &mut s,
        &[
            "--requests",
            "1000",
            "--rate",
            "50",
            "--over-capacity-share",
            "0.25",
            "--request-id-prefix",
            "s113",
        ],
    )
    .await;
    let sent = o.load["sent"].as_u64().unwrap();
    let over = o.load["over_capacity_sent"].as_u64().unwrap();
    assert_eq!(sent, 1000, "{}", o.load);
    assert!(over >= 200, "at least 20% over capacity: {}", o.load);
    assert_eq!(o.load["errors"], 0, "{}", o.load);
    assert_eq!(
        o.load["rejected_by_status"]["400"].as_u64().unwrap_or(0),
        over,
        "every over-capacity request refused with 400, not retried: {}",
        o.load
    );

    // The protocol, from the simulator's accounting: concurrent legs, the decode leg closed
    // within milliseconds of each refusal, a new room per 503 retry.
    let rejected = o.rejected();
    let mut close = Vec::new();
    let mut arrival = Vec::new();
    let (mut unseen, mut before_answer) = (0, 0);
    for p in &rejected {
        let room = p["room"].as_u64().unwrap();
        let Some(d) = o.decode.get(&room) else {
            unseen += 1;
            continue;
        };
        assert_eq!(
            d["outcome"], "cancelled",
            "decode leg of a refused room: {d}"
        );
        // smg closes the leg within milliseconds (decode's `client_gone_ns`); decode, a
        // non-streamed request, aborts it when SGLang's tokenizer next polls the connection
        // (every 4 s), so its `ended_ns` and its ABORT come up to 4 s later.
        let c = ms(d, p, "client_gone_ns", "ended_ns").unwrap();
        assert!(
            c < WINDOW_MS,
            "decode leg closed {c:.1} ms after the refusal: {d}"
        );
        close.push(c);
        arrival.push(ms(d, p, "received_ns", "received_ns").unwrap());
        if d["received_ns"].as_u64() < p["ended_ns"].as_u64() {
            before_answer += 1;
        }
    }
    let mut attempts: HashMap<&str, usize> = HashMap::new();
    for p in &o.prefill {
        *attempts
            .entry(p["request_id"].as_str().unwrap_or(""))
            .or_default() += 1;
    }
    let retried = attempts.values().filter(|n| **n > 1).count();
    eprintln!(
        "smg 1.13.0: {sent} requests ({over} over capacity), {} prefill rooms, {} refused \
         ({unseen} never reached decode, {before_answer} reached decode before prefill answered), \
         {retried} requests retried (max {} attempts)\n  decode closed after the refusal: {}\n  \
         decode leg arrival minus prefill's: {}",
        o.prefill.len(),
        rejected.len(),
        attempts.values().max().unwrap_or(&0),
        quantiles(close.clone()),
        quantiles(arrival),
    );
    assert!(!close.is_empty());
    assert!(retried > 0, "some 503s were retried");
    assert!(attempts.values().all(|n| *n <= 5), "at most 5 attempts");
    let distinct: BTreeSet<u64> = o
        .prefill
        .iter()
        .filter_map(|r| r["room"].as_u64())
        .collect();
    assert_eq!(distinct.len(), o.prefill.len(), "a new room per attempt");

    eprintln!(
        "revenant: violations {:?} ({} of them corroborations; first proofs {:?}), notifications {}\n{}",
        o.per_rule(),
        o.violations
            .iter()
            .filter(|v| v["corroborates"] == true)
            .count(),
        o.by_offender(),
        o.notifications.len(),
        o.show_violations(5)
    );
    assert_no_loss(&o, &s);
    assert!(
        o.violations.is_empty(),
        "{} violations ({:?}), e.g.:\n{}\n(scratch dir {}; PD_SIM_KEEP_SCRATCH=1 keeps it)",
        o.violations.len(),
        o.per_rule(),
        o.show_violations(10),
        s.scratch.path().display()
    );
    assert!(o.notifications.is_empty(), "{:?}", o.notifications.first());
}

/// The same traffic with a decode that ignores smg's cancel (`--decode-ignores-cancel`: the leg
/// goes on after its connection closed, bootstraps the refused room and waits for KV that never
/// comes, here 8 s, past revenant's 6 s window for a decode leg): every refused attempt that
/// reached decode must be caught
/// (`orphaned-leg`: the leg did not end within the window; or `activity-after-rejection` when
/// it advanced), and each request notified once.
///
/// Needs pd-sim's `--decode-ignores-cancel` and the engine's advancement
/// model with one incident notification per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PD_SIM_SMG113 (smg 1.13.0), the revenant binary, root (eBPF) and pd-sim's --decode-ignores-cancel"]
async fn smg_1_13_decode_ignoring_the_cancel_is_caught_once_per_request() {
    let help = std::process::Command::new(BIN)
        .args(["decode", "--help"])
        .output()
        .expect("pd-sim decode --help");
    assert!(
        String::from_utf8_lossy(&help.stdout).contains("--decode-ignores-cancel"),
        "this pd-sim has no `decode --decode-ignores-cancel`"
    );
    let mut s = setup(
        "smg113-ignore",
        "--overload-share 0.03",
        "--decode-ignores-cancel --kv-timeout-ms 8000",
    )
    .await;
    let o = drive(
        &mut s,
        &[
            "--requests",
            "1000",
            "--rate",
            "50",
            "--over-capacity-share",
            "0.25",
            "--request-id-prefix",
            "s113i",
        ],
    )
    .await;
    let over = o.load["over_capacity_sent"].as_u64().unwrap();
    assert!(over >= 200, "{}", o.load);
    assert_no_loss(&o, &s);
    // The refused attempts whose decode leg reached decode (smg closes about one in ten before
    // decode read it: no leg, nothing to catch).
    let rejected = o.rejected();
    let reached: BTreeSet<u64> = rejected
        .iter()
        .filter_map(|p| p["room"].as_u64())
        .filter(|r| o.decode.contains_key(r))
        .collect();
    let caught: BTreeSet<u64> = o
        .violations
        .iter()
        .filter(|v| v["rule"] == "orphaned-leg" || v["rule"] == "activity-after-rejection")
        .filter_map(|v| room_of(&v["attempt"]))
        .collect();
    let missed: Vec<u64> = reached.difference(&caught).copied().collect();
    eprintln!(
        "decode ignoring the cancel: {} refused attempts, {} reached decode, {} caught; \
         violations {:?}; notifications {}",
        rejected.len(),
        reached.len(),
        reached.intersection(&caught).count(),
        o.per_rule(),
        o.notifications.len()
    );
    assert!(!reached.is_empty());
    assert!(
        missed.is_empty(),
        "{} refused attempts with a live decode leg not caught, e.g. rooms {:?}",
        missed.len(),
        &missed[..missed.len().min(5)]
    );
    // One notification per request: the request of every violation, notified exactly once.
    let violated: BTreeSet<&str> = o
        .violations
        .iter()
        .filter_map(|v| v["request"]["request_id"].as_str())
        .collect();
    let mut notified: BTreeMap<&str, usize> = BTreeMap::new();
    for n in &o.notifications {
        *notified
            .entry(n["request"]["request_id"].as_str().unwrap_or("?"))
            .or_default() += 1;
    }
    let repeated: Vec<_> = notified.iter().filter(|(_, n)| **n > 1).collect();
    assert!(repeated.is_empty(), "notified more than once: {repeated:?}");
    assert_eq!(
        notified.keys().copied().collect::<BTreeSet<_>>(),
        violated,
        "every violated request notified"
    );
}

/// The disclosed failure with the real smg 1.13.0 and revenant watching (eBPF and OTLP): half
/// the requests streamed, a quarter over prefill's capacity. A streamed refusal is a 200 with the
/// error in the stream, smg keeps its decode leg, decode reserves KV for the refused room and
/// holds the leg until its waiting timeout (10 s here): each such attempt is caught, once per
/// request (`orphaned-leg`; critical when it advanced). A non-streamed refusal is withdrawn at
/// once and raises nothing; nothing else fires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PD_SIM_SMG113 (smg 1.13.0), the revenant binary and root (eBPF)"]
async fn smg_1_13_streamed_refusals_reaching_decode_are_caught_once_each() {
    let mut s = setup(
        "smg113-streamed",
        "",
        "--disaggregation-waiting-timeout-ms 10000",
    )
    .await;
    let o = drive(
        &mut s,
        &[
            "--requests",
            "400",
            "--rate",
            "40",
            "--over-capacity-share",
            "0.25",
            "--stream-share",
            "0.5",
            "--request-id-prefix",
            "s113s",
        ],
    )
    .await;
    assert_eq!(o.load["errors"], 0, "{}", o.load);
    assert_no_loss(&o, &s);
    // Refused inside a stream: answered 200 with the error code in the stream.
    let streamed: BTreeSet<u64> = o
        .prefill
        .iter()
        .filter(|r| r["status"] == 200 && r["error_code"].as_u64().unwrap_or(0) >= 400)
        .filter_map(|r| r["room"].as_u64())
        .filter(|r| o.decode.contains_key(r))
        .collect();
    let plain: BTreeSet<u64> = o
        .rejected()
        .iter()
        .filter(|r| r["status"].as_u64().unwrap_or(0) >= 400)
        .filter_map(|r| r["room"].as_u64())
        .collect();
    assert!(
        streamed.len() >= 10 && !plain.is_empty(),
        "streamed refusals reaching decode {}, non-streamed refusals {}: {}",
        streamed.len(),
        plain.len(),
        o.load
    );
    let caught: BTreeMap<u64, BTreeSet<String>> =
        o.violations.iter().fold(BTreeMap::new(), |mut m, v| {
            if let Some(r) = room_of(&v["attempt"]) {
                m.entry(r)
                    .or_default()
                    .insert(v["rule"].as_str().unwrap_or("?").to_owned());
            }
            m
        });
    eprintln!(
        "smg 1.13.0, streamed: {} streamed refusals reached decode, {} non-streamed refusals;          violations {:?}; notifications {}",
        streamed.len(),
        plain.len(),
        o.per_rule(),
        o.notifications.len()
    );
    let missed: Vec<_> = streamed
        .iter()
        .filter(|r| {
            !caught.get(r).is_some_and(|rules| {
                rules.contains("orphaned-leg") || rules.contains("activity-after-rejection")
            })
        })
        .collect();
    assert!(
        missed.is_empty(),
        "streamed refusals not caught: {missed:?}"
    );
    let extra: Vec<_> = caught.keys().filter(|r| !streamed.contains(r)).collect();
    assert!(
        extra.is_empty(),
        "violations on rooms that are no breach: {extra:?}\n{}",
        o.show_violations(10)
    );
    let mut notified: BTreeMap<&str, usize> = BTreeMap::new();
    for n in &o.notifications {
        *notified
            .entry(n["request"]["request_id"].as_str().unwrap_or("?"))
            .or_default() += 1;
    }
    assert_eq!(
        notified.len(),
        streamed.len(),
        "one notification per breached request: {notified:?}"
    );
    assert!(notified.values().all(|n| *n == 1), "{notified:?}");
}

/// The disclosed failure with the real smg 1.13.0, from the simulator's accounting alone (no
/// revenant): a streamed request prefill refuses is answered 200 with the error in the stream,
/// which smg does not read as a failure, so it keeps the decode leg; decode allocates the
/// refused room's KV, publishes its destinations to prefill and waits for KV that never comes,
/// until its waiting timeout (here 1.5 s; SGLang's default is 300 s), then withdraws it with an
/// ABORT that prefill acknowledges. The same refusal non-streamed is a 400, and smg closes the
/// decode leg at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PD_SIM_SMG113 (smg 1.13.0)"]
async fn smg_1_13_keeps_the_decode_leg_of_a_streamed_refusal() {
    let bin = smg113_bin();
    let scratch = ScratchDir::new("smg113-stream").unwrap();
    let cluster = Cluster::start(
        "correct",
        &[
            "--no-router",
            "--decode-args",
            "--kv-timeout-ms 1500 --request-state-wait-timeout-ms 100",
        ],
    )
    .await;
    let model = scratch.path().join("model");
    write_tiny_model(&model).unwrap();
    let log = scratch.path().join("smg.log");
    let inner: &test_harness::Cluster = &cluster;
    let smg =
        tokio::task::block_in_place(|| SmgProcess::start(&bin, inner, &model, None, &log, &[]))
            .unwrap_or_else(|e| panic!("smg: {e:#}"));
    assert_eq!(smg.version, "smg 1.13.0", "PD_SIM_SMG113={}", bin.display());
    let client = pd_sim::http::http_client(4);
    let url = format!("{}/generate", smg.url);
    let (status, body) = post(
        &client,
        &url,
        "smg113-stream-rej",
        serde_json::json!({"text": words(5000), "stream": true}),
    )
    .await;
    let text = String::from_utf8_lossy(&body).into_owned();
    eprintln!("smg 1.13.0 answered a streamed refusal with {status}: {text}");
    let attempts: Vec<Value> = rooms(&client, &cluster.prefill)
        .await
        .into_iter()
        .filter(|r| r["request_id"] == "smg113-stream-rej")
        .collect();
    assert_eq!(attempts.len(), 1, "{attempts:?}");
    let p = &attempts[0];
    assert_eq!(
        (p["status"].as_u64(), p["error_code"].as_u64()),
        (Some(200), Some(400)),
        "prefill answered 200 with the refusal in the stream: {p}"
    );
    assert_eq!(p["kv_bytes_sent"], 0, "{p}");
    let room = p["room"].as_u64().unwrap();
    let d = eventually("the kept decode leg ends", Duration::from_secs(15), || {
        let (client, url) = (client.clone(), cluster.decode.clone());
        async move {
            let d = rooms(&client, &url).await;
            d.into_iter()
                .find(|r| r["room"] == room && r["ended_ns"].as_u64().unwrap_or(0) > 0)
        }
    })
    .await;
    // smg kept the leg: decode published destinations, waited out its timeout, withdrew it.
    assert_eq!(d["destinations_sent"], 1, "{d}");
    assert_eq!(d["outcome"], "kv-failed", "{d}");
    assert_eq!(d["client_gone_ns"], 0, "smg never closed the leg: {d}");
    assert!(
        d["ended_ns"].as_u64().unwrap() >= d["destinations_ns"].as_u64().unwrap() + 1_400_000_000,
        "{d}"
    );
    assert_eq!(d["aborts_sent"], 1, "{d}");
    let p = eventually(
        "prefill got the destinations and the ABORT",
        Duration::from_secs(5),
        || {
            let (client, url) = (client.clone(), cluster.prefill.clone());
            async move {
                let p = rooms(&client, &url).await;
                p.into_iter()
                    .find(|r| r["room"] == room && r["abort_acks_sent"] == 1)
            }
        },
    )
    .await;
    assert_eq!(p["destinations_received"], 1, "{p}");

    // Non-streamed, the refusal is a 400: smg closes the decode leg at once.
    let (status, _) = post(
        &client,
        &url,
        "smg113-rej",
        serde_json::json!({"text": words(5000)}),
    )
    .await;
    assert_eq!(status, 400);
    let attempts: Vec<Value> = rooms(&client, &cluster.prefill)
        .await
        .into_iter()
        .filter(|r| r["request_id"] == "smg113-rej")
        .collect();
    let room = attempts[0]["room"].as_u64().unwrap();
    // smg may close the leg before decode has read the request: then decode never sees it.
    let since = std::time::Instant::now();
    let d = eventually(
        "the withdrawn decode leg ends",
        Duration::from_secs(10),
        || {
            let (client, url) = (client.clone(), cluster.decode.clone());
            async move {
                let d = rooms(&client, &url)
                    .await
                    .into_iter()
                    .find(|r| r["room"] == room);
                match d {
                    Some(d) if d["ended_ns"].as_u64().unwrap_or(0) > 0 => Some(Some(d)),
                    None if since.elapsed() > Duration::from_secs(2) => Some(None),
                    _ => None,
                }
            }
        },
    )
    .await;
    if let Some(d) = d {
        assert_eq!(d["outcome"], "cancelled", "{d}");
        assert_eq!(d["kv_bytes_received"], 0, "{d}");
    }
    drop(smg);
}
