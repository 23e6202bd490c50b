//! End-to-end, vLLM prefill/decode: `pd-sim cluster --flavour vllm` (workers speaking vLLM
//! 0.34's wire: OpenAI API and its error bodies, `kv_transfer_params` as NixlConnector returns
//! them, the NIXL handshake once per engine pair, `llm_request` spans), a router in front (pd-sim's vllm-router-shaped one, or the real `vllm-router` 0.1.17), `revenant run`
//! watching with eBPF (the three pids), OTLP (the workers' spans over HTTP, the router's over
//! HTTP for pd-sim's or gRPC for the real one, traced through its Python API), or both, and
//! `pd-sim load --api openai`. The oracle is the simulator's own per-request records
//! (`/sim/requests` of prefill and decode), never revenant's output.
//!
//! - A correct router (the real vllm-router 0.1.17, and pd-sim's `correct`): a quarter of the
//!   prompts over prefill's `max_model_len`, rejected 400 and never sent to decode: nothing is
//!   reported, and revenant saw every rejection (silence is a verdict, not blindness).
//! - pd-sim's `handoff-after-reject` (the older vllm-router bug: a prefill 400 with a JSON body
//!   still went to decode): every handed-off request is caught exactly once, from eBPF alone,
//!   from OTLP alone and from both.
//! - Decode legs naming KV prefill did not issue to them: pd-sim's router handing one decode leg
//!   in nine the previous request's params, or params naming KV nobody issued, and a prefill
//!   answering a tenth of the requests with the params it issued to the request before, behind
//!   the real vllm-router: each such request is caught once by `kv-handoff-mismatch`, naming the
//!   request whose KV it read, and nothing else is said.
//!
//! The real-router test is ignored by default: `cargo xtask test` installs vllm-router 0.1.17 in
//! target/xtask-venv-vllm-router and runs it with `PD_SIM_VLLM_ROUTER_PYTHON` set. The eBPF
//! variants need root (CI runs as root) and fail, not skip, without it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde_json::Value;
use test_harness::{
    Cluster, Revenant, Sample, VllmRouter, free_port, http_json, metric_sum, notifications,
};

mod common;

use common::{Sources, bins, drops, serial, sim_span_losses};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Router {
    /// pd-sim's vllm-router-shaped router in this mode.
    Sim(&'static str),
    /// The real vllm-router 0.1.17.
    Real,
}

struct Outcome {
    load: Value,
    /// The workers ran MooncakeConnector (else NIXL).
    mooncake: bool,
    /// pd-sim's router's `/sim/stats` (its own router only).
    router_stats: Option<Value>,
    /// Per-request records (`/sim/requests`), by request name N.
    prefill: BTreeMap<String, Value>,
    decode: BTreeMap<String, Value>,
    prefill_stats: Value,
    decode_stats: Value,
    metrics: Vec<Sample>,
    notifications: Vec<Value>,
    elapsed: Duration,
}

fn records(url: &str) -> BTreeMap<String, Value> {
    match http_json(&format!("{url}/sim/requests")).unwrap() {
        Value::Array(a) => a
            .into_iter()
            .map(|r| (r["id"].as_str().unwrap_or("").to_string(), r))
            .collect(),
        other => panic!("{url}/sim/requests: not an array: {other}"),
    }
}

fn run(router: Router, sources: Sources, load_args: &[&str]) -> Outcome {
    run_cluster(router, sources, &[], load_args)
}

/// [`run`], with more arguments for `pd-sim cluster` (a worker fault).
fn run_cluster(
    router: Router,
    sources: Sources,
    cluster_extra: &[&str],
    load_args: &[&str],
) -> Outcome {
    let t0 = Instant::now();
    if sources.ebpf() {
        assert!(
            test_harness::is_root(),
            "this test loads eBPF probes and must run as root (cargo xtask test does, as CI)"
        );
    }
    let b = bins();
    let dir = tempfile::Builder::new()
        .prefix("revenant-vllm-")
        .tempdir()
        .unwrap();
    // revenant needs the pids, so it starts last, on ports chosen now; the exporters connect
    // once there are spans.
    let otlp_http = format!("127.0.0.1:{}", free_port().unwrap());
    let otlp_grpc = format!("127.0.0.1:{}", free_port().unwrap());
    let mut cluster_args: Vec<String> = vec!["--flavour".into(), "vllm".into()];
    match router {
        Router::Sim(mode) => cluster_args.extend(["--mode".into(), mode.into()]),
        Router::Real => cluster_args.push("--no-router".into()),
    }
    cluster_args.extend(cluster_extra.iter().map(|s| s.to_string()));
    let mooncake = cluster_extra
        .windows(2)
        .any(|w| w == ["--kv-connector", "mooncake"]);
    if sources.otlp() {
        cluster_args.extend(["--otlp-endpoint".into(), format!("http://{otlp_http}")]);
    }
    let cluster = Cluster::start(
        &b.pd_sim,
        &cluster_args,
        Some(&dir.path().join("pd-sim.log")),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    let mut real = None;
    let router_url = match router {
        Router::Sim(_) => cluster.router.clone(),
        Router::Real => {
            let python =
                test_harness::router_from_env("PD_SIM_VLLM_ROUTER_PYTHON", "vllm-router 0.1.17");
            let trace = sources.otlp().then_some(otlp_grpc.as_str());
            let bootstrap = mooncake.then(|| {
                cluster.ready["bootstrap_port"]
                    .as_u64()
                    .and_then(|p| u16::try_from(p).ok())
                    .expect("pd-sim names prefill's bootstrap port")
            });
            let r = VllmRouter::start(
                &python,
                (&cluster.prefill, &cluster.decode),
                bootstrap,
                trace,
                &dir.path().join("router.log"),
            )
            .unwrap_or_else(|e| panic!("{e:#}"));
            let url = r.url.clone();
            real = Some(r);
            url
        }
    };
    let mut args: Vec<String> = vec![
        "--admin".into(),
        "127.0.0.1:0".into(),
        "--rate-limit".into(),
        "0".into(),
        "--spool-no-fsync".into(),
        "--no-sglang-conventions".into(),
    ];
    if sources.otlp() {
        args.extend(["--otlp-http".into(), otlp_http.clone()]);
        args.extend(["--otlp-grpc".into(), otlp_grpc.clone()]);
    } else {
        args.extend([
            "--otlp-http".into(),
            "off".into(),
            "--otlp-grpc".into(),
            "off".into(),
        ]);
    }
    if sources.ebpf() {
        args.extend(["--ebpf".into(), "on".into()]);
        for (role, pid) in &cluster.pids {
            if role != "router" {
                args.extend(["--pid".into(), format!("{role}={pid}")]);
            }
        }
        let router_pid = match &real {
            Some(p) => Some(p.pid()),
            None => cluster
                .pids
                .iter()
                .find(|(r, _)| r == "router")
                .map(|(_, p)| *p),
        };
        if let Some(p) = router_pid {
            args.extend(["--pid".into(), format!("router={p}")]);
        }
    } else {
        args.extend(["--ebpf".into(), "off".into()]);
    }
    if sources == Sources::Both {
        // Hold each first notification for the other witness (merged into one notification).
        args.extend(["--corroboration-window".into(), "3s".into()]);
    }
    let mut revenant =
        Revenant::start_recording(&b.revenant, dir.path(), &args, Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        revenant.ready["ebpf"],
        if sources.ebpf() { "live" } else { "off" },
        "{}",
        revenant.ready
    );
    // A client asking the model list through the router: eBPF reads prefill's `max_model_len`.
    let _ = http_json(&format!("{router_url}/v1/models"));
    let mut load: Vec<String> = vec!["--api".into(), "openai".into()];
    load.extend(load_args.iter().map(|s| s.to_string()));
    let load = test_harness::run_load(
        &b.pd_sim,
        &router_url,
        &load,
        &dir.path().join("load.json"),
        true,
        Duration::from_secs(300),
        None,
    )
    .unwrap_or_else(|e| panic!("{e:#}"))
    .expect("not interrupted");
    // The real vllm-router exports through OpenTelemetry's batch span processor, which holds
    // spans for up to 5 s (its default schedule delay): quiet means no change for longer than
    // that, or its last batch (the router's view of the last rejections) is not in yet.
    let quiet = if router == Router::Real && sources.otlp() {
        Duration::from_secs(7)
    } else {
        Duration::from_secs(2)
    };
    let metrics = revenant
        .wait_quiet(quiet, Duration::from_secs(60), None)
        .unwrap_or_else(|e| panic!("{e:#}\n{}", test_harness::tail(&revenant.log, 30)));
    let prefill = records(&cluster.prefill);
    let decode = records(&cluster.decode);
    let router_stats = match router {
        Router::Sim(_) => Some(http_json(&format!("{}/sim/stats", cluster.router)).unwrap()),
        Router::Real => None,
    };
    let prefill_stats = http_json(&format!("{}/sim/stats", cluster.prefill)).unwrap();
    let decode_stats = http_json(&format!("{}/sim/stats", cluster.decode)).unwrap();
    let status = revenant.stop().unwrap();
    assert!(
        status.success(),
        "revenant exited with {status}:\n{}",
        test_harness::tail(&revenant.log, 30)
    );
    let notifications = revenant.notifications().unwrap();
    drop(real);
    drop(cluster);
    let o = Outcome {
        load,
        mooncake,
        router_stats,
        prefill,
        decode,
        prefill_stats,
        decode_stats,
        metrics,
        notifications,
        elapsed: t0.elapsed(),
    };
    report(&format!("{router:?}/{sources:?}"), &o);
    o
}

fn events(o: &Outcome, source: &str, stage: &str, kind: &str) -> u64 {
    common::events(&o.metrics, source, stage, kind)
}

fn report(name: &str, o: &Outcome) {
    common::report(name, o.elapsed, &o.load, &o.metrics, o.notifications.len());
}

/// Nothing was lost on the way in: a clean result must not come from dropped evidence.
fn assert_no_loss(o: &Outcome) {
    let drops = drops(&o.metrics);
    assert!(drops.is_empty(), "revenant dropped data: {drops:?}");
    for stats in [&o.prefill_stats, &o.decode_stats] {
        assert_eq!(
            sim_span_losses(stats),
            0,
            "a worker's span exporter lost spans: {}",
            stats["otlp"]
        );
    }
}

fn rejected_400(load: &Value) -> u64 {
    load["rejected_by_status"]["400"].as_u64().unwrap_or(0)
}

/// Requests prefill rejected that decode still got (the breach), by request name.
fn handed_off(o: &Outcome) -> BTreeSet<String> {
    o.prefill
        .iter()
        .filter(|(n, r)| {
            r["status"].as_u64().is_some_and(|s| s >= 400) && o.decode.contains_key(*n)
        })
        .map(|(n, _)| n.clone())
        .collect()
}

/// A correct router: over-capacity prompts are rejected by prefill and never reach decode;
/// revenant sees every rejection and reports nothing.
fn assert_silent_and_seeing(o: &Outcome, sources: Sources, requests: u64) {
    assert_eq!(o.load["sent"], requests, "{}", o.load);
    assert_eq!(o.load["errors"], 0, "{}", o.load);
    let rejected = rejected_400(&o.load);
    let over = o.load["over_capacity_sent"].as_u64().unwrap();
    assert!(
        over * 5 >= requests,
        "at least a fifth over capacity: {}",
        o.load
    );
    assert_eq!(rejected, over, "{}", o.load);
    assert!(
        handed_off(o).is_empty(),
        "a correct router handed rejected requests to decode"
    );
    let prefill_rejections = o
        .prefill
        .values()
        .filter(|r| r["status"].as_u64().is_some_and(|s| s >= 400))
        .count() as u64;
    assert_eq!(prefill_rejections, rejected);
    if sources.ebpf() && o.mooncake {
        assert_eq!(events(o, "ebpf", "prefill", "rejected"), prefill_rejections);
        // MooncakeConnector: decode pulls each request's KV with one message over ZeroMQ and
        // prefill answers it: the transfer, per request, as eBPF saw it.
        let ok = o.load["ok"].as_u64().unwrap();
        assert_eq!(events(o, "ebpf", "transfer", "admitted"), ok);
        assert_eq!(events(o, "ebpf", "transfer", "completed"), ok);
        assert_eq!(
            metric_sum(
                &o.metrics,
                "revenant_ebpf_vllm_transfers_unattributed_total",
                &[]
            ),
            0.0
        );
    } else if sources.ebpf() {
        assert_eq!(events(o, "ebpf", "prefill", "rejected"), prefill_rejections);
        // NIXL moves KV by one-sided reads: no per-request message crosses a socket, and the
        // engines' one handshake over ZeroMQ names no request.
        for kind in ["received", "admitted", "completed"] {
            assert_eq!(events(o, "ebpf", "transfer", kind), 0, "transfer {kind}");
        }
        assert!(
            metric_sum(&o.metrics, "revenant_ebpf_vllm_nixl_handshakes_total", &[]) >= 1.0,
            "the NIXL handshake between the engines was seen"
        );
    }
    if sources.ebpf() {
        // Both legs of every answered request, on the router and at the workers.
        assert_eq!(
            events(o, "ebpf", "decode", "completed"),
            o.load["ok"].as_u64().unwrap()
        );
    }
    if sources.otlp() {
        // vLLM says nothing about a request it rejects before its engine: the router's spans do.
        assert!(events(o, "otlp", "prefill", "rejected") >= prefill_rejections);
        assert!(events(o, "otlp", "decode", "completed") > 0);
        assert!(events(o, "otlp", "router", "received") > 0);
    }
    assert_no_loss(o);
    assert_eq!(
        metric_sum(&o.metrics, "revenant_checker_violations_total", &[]),
        0.0,
        "false positives: {:#?}",
        o.notifications.iter().take(5).collect::<Vec<_>>()
    );
    assert!(
        o.notifications.is_empty(),
        "{:#?}",
        &o.notifications[..o.notifications.len().min(5)]
    );
}

const CORRECT_LOAD: &[&str] = &[
    "--rate",
    "200",
    "--requests",
    "1200",
    "--over-capacity-share",
    "0.25",
    "--chat-share",
    "0.3",
    "--stream-share",
    "0.3",
];

/// The real vllm-router 0.1.17 in front of the simulator's vLLM workers, eBPF and OTLP.
#[test]
#[ignore = "needs vllm-router 0.1.17 (PD_SIM_VLLM_ROUTER_PYTHON) and root; cargo xtask test runs it"]
fn real_vllm_router_1200_requests_quarter_over_capacity_zero_alerts() {
    let _g = serial();
    let o = run(Router::Real, Sources::Both, CORRECT_LOAD);
    assert_silent_and_seeing(&o, Sources::Both, 1200);
    // vllm-router's own spans were read by its profile, not dropped as unknown.
    assert!(events(&o, "otlp", "router", "dispatched") > 0);
}

/// pd-sim's vllm-router-shaped router, correct mode: the same verdict.
#[test]
fn sim_vllm_router_correct_zero_alerts() {
    let _g = serial();
    let sources = if test_harness::is_root() {
        Sources::Both
    } else {
        Sources::Otlp
    };
    let o = run(Router::Sim("correct"), sources, CORRECT_LOAD);
    assert_silent_and_seeing(&o, sources, 1200);
}

/// Every handed-off request yields exactly one notification naming its attempt (the vLLM
/// request name) in an `activity-after-rejection` finding; no request is notified twice and
/// nothing else is.
fn handoff(sources: Sources) -> Outcome {
    handoff_with(sources, &[], "activity-after-rejection")
}

/// [`handoff`], each handed-off request caught by `rule`.
fn handoff_with(sources: Sources, cluster_extra: &[&str], rule: &str) -> Outcome {
    let _g = serial();
    let o = run_cluster(
        Router::Sim("handoff-after-reject"),
        sources,
        cluster_extra,
        &[
            "--rate",
            "500",
            "--requests",
            "2000",
            "--over-capacity-share",
            "0.1",
            "--chat-share",
            "0.3",
            "--stream-share",
            "0.3",
        ],
    );
    assert_eq!(o.load["errors"], 0, "{}", o.load);
    let expected = handed_off(&o);
    assert!(
        expected.len() > 100,
        "the mix must hand off many rejected requests: {}",
        o.load
    );
    assert_eq!(
        expected.len() as u64,
        o.load["over_capacity_sent"].as_u64().unwrap(),
        "every over-capacity request was rejected and handed off"
    );
    assert_no_loss(&o);
    let mut per_attempt: BTreeMap<String, usize> = BTreeMap::new();
    let mut per_incident: BTreeMap<String, usize> = BTreeMap::new();
    for n in &o.notifications {
        assert!(notifications::is_incident(n), "{n}");
        *per_incident
            .entry(n["incident_key"].as_str().unwrap_or("").to_string())
            .or_default() += 1;
        let f = notifications::finding(n, rule)
            .unwrap_or_else(|| panic!("a notification without {rule}: {n}"));
        let rid = f["attempt"]["rid"]
            .as_str()
            .unwrap_or_else(|| panic!("finding names no attempt: {n}"));
        *per_attempt.entry(rid.to_string()).or_default() += 1;
        assert_eq!(f["occurrences"], 1, "{n}");
    }
    for (key, count) in &per_incident {
        assert_eq!(*count, 1, "incident {key} notified {count} times");
    }
    let got: BTreeSet<String> = per_attempt.keys().cloned().collect();
    let missed: Vec<_> = expected.difference(&got).take(5).collect();
    let extra: Vec<_> = got.difference(&expected).take(5).collect();
    assert!(
        missed.is_empty() && extra.is_empty(),
        "{} expected, {} notified; missed (first 5) {missed:?}; unexpected {extra:?}",
        expected.len(),
        got.len()
    );
    for (rid, count) in &per_attempt {
        assert_eq!(*count, 1, "{rid} notified {count} times");
    }
    o
}

fn sources_of(o: &Outcome) -> BTreeMap<String, usize> {
    common::sources_of(&o.notifications)
}

#[test]
fn vllm_handoff_after_reject_caught_once_per_request_with_ebpf_alone() {
    let o = handoff(Sources::Ebpf);
    assert_eq!(sources_of(&o).keys().collect::<Vec<_>>(), ["ebpf"]);
    assert_eq!(
        metric_sum(&o.metrics, "revenant_events_total", &[("source", "otlp")]),
        0.0
    );
}

#[test]
fn vllm_handoff_after_reject_caught_once_per_request_with_otlp_alone() {
    let o = handoff(Sources::Otlp);
    assert_eq!(sources_of(&o).keys().collect::<Vec<_>>(), ["otlp"]);
}

#[test]
fn vllm_handoff_after_reject_caught_once_per_request_with_both_sources_merged() {
    let o = handoff(Sources::Both);
    let by = sources_of(&o);
    // Each finding carries the evidence of both witnesses once both have spoken.
    assert!(
        by.keys().all(|k| k == "ebpf+otlp"),
        "findings not corroborated by both witnesses: {by:?}"
    );
}

/// Requests whose decode leg named KV prefill did not issue to them, by rid, with the request
/// whose KV it named (`None`: KV nobody issued).
type Handoffs = BTreeMap<String, Option<String>>;

/// Every request in `expected` is notified exactly once, by `kv-handoff-mismatch` alone, its
/// summary naming the request whose KV it read; nothing else is notified.
fn assert_handoffs_caught(o: &Outcome, expected: &Handoffs) {
    assert!(
        expected.len() >= 20,
        "the fault must hit many requests: {} ({})",
        expected.len(),
        o.load
    );
    assert_no_loss(o);
    assert_eq!(
        metric_sum(
            &o.metrics,
            "revenant_checker_violations_total",
            &[("rule", "kv-handoff-mismatch")]
        ),
        expected.len() as f64,
        "{} notifications",
        o.notifications.len()
    );
    let mut per_attempt: BTreeMap<String, usize> = BTreeMap::new();
    for n in &o.notifications {
        assert!(notifications::is_incident(n), "{n}");
        assert_eq!(
            notifications::rules(n),
            ["kv-handoff-mismatch"],
            "only the handoff is a breach: {}",
            notifications::one_liner(n)
        );
        let f = notifications::finding(n, "kv-handoff-mismatch").unwrap();
        let rid = f["attempt"]["rid"]
            .as_str()
            .unwrap_or_else(|| panic!("finding names no attempt: {n}"))
            .to_string();
        let summary = f["summary"].as_str().unwrap_or_default();
        match expected.get(&rid) {
            Some(Some(owner)) => assert!(
                summary.contains(&format!("issued to {owner}")),
                "{rid} read {owner}'s KV: {summary}"
            ),
            Some(None) => assert!(summary.contains("no prefill answer issued"), "{summary}"),
            None => panic!("{rid} was not faulted: {summary}"),
        }
        *per_attempt.entry(rid).or_default() += 1;
    }
    let missed: Vec<_> = expected
        .keys()
        .filter(|r| !per_attempt.contains_key(*r))
        .take(5)
        .collect();
    assert!(
        missed.is_empty(),
        "{} faulted, {} notified; missed (first 5) {missed:?}",
        expected.len(),
        per_attempt.len()
    );
    for (rid, count) in &per_attempt {
        assert_eq!(*count, 1, "{rid} notified {count} times");
    }
}

const HANDOFF_FAULT_LOAD: &[&str] = &[
    "--rate",
    "300",
    "--requests",
    "900",
    "--over-capacity-share",
    "0.1",
    "--chat-share",
    "0.3",
    "--stream-share",
    "0.3",
];

/// The requests pd-sim's router sent to decode with params it swapped, from its `/sim/stats`
/// (`request_id` is X; the rid is the engine's id, by the path the request took).
fn router_swapped(o: &Outcome) -> Handoffs {
    let stats = o.router_stats.as_ref().unwrap();
    let engine_id = |x: &str| {
        [format!("cmpl-{x}-0"), format!("chatcmpl-{x}")]
            .into_iter()
            .find(|k| o.prefill.contains_key(k))
            .unwrap_or_else(|| panic!("no prefill record for {x}"))
    };
    stats["reused_kv_params"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let of = r["params_of"].as_str().unwrap();
            (
                engine_id(r["request_id"].as_str().unwrap()),
                (of != "forged").then(|| engine_id(of)),
            )
        })
        .collect()
}

/// pd-sim's router in `mode` swaps one decode leg's params in nine; each such request is
/// caught once (naming whose KV it read when `foreign`).
fn swapped_params_caught(mode: &'static str, sources: Sources, foreign: bool) {
    let _g = serial();
    let o = run(Router::Sim(mode), sources, HANDOFF_FAULT_LOAD);
    let expected = router_swapped(&o);
    assert!(expected.values().all(|owner| owner.is_some() == foreign));
    assert_handoffs_caught(&o, &expected);
}

/// A router that hands one decode leg in nine the previous request's `kv_transfer_params`:
/// decode reads another request's KV cache. Each such request is caught once, from eBPF (no
/// span carries the params), naming the request whose KV it read.
#[test]
fn vllm_decode_legs_given_another_requests_kv_caught_once_each() {
    swapped_params_caught("reuse-kv-params", Sources::Ebpf, true);
}

/// A router that hands one decode leg in nine KV prefill never issued (stale or forged
/// params): each such request is caught once, and with both witnesses nothing else is said.
#[test]
fn vllm_decode_legs_given_unissued_kv_caught_once_each() {
    swapped_params_caught("forge-kv-params", Sources::Both, false);
}

/// The real vllm-router 0.1.17 forwards what prefill answers: a prefill that answers a request
/// with the params it issued to the request before (a tenth of them) hands two requests the
/// same KV. Which of them prefill computed it for is not on the wire (the two answers may leave
/// in either order), so the breach is the KV shared: every such group of requests is caught,
/// each alert from one member naming another, each request at most once, nothing else said.
#[test]
#[ignore = "needs vllm-router 0.1.17 (PD_SIM_VLLM_ROUTER_PYTHON) and root; cargo xtask test runs it"]
fn real_vllm_router_forwarding_another_requests_kv_caught_once_each() {
    let _g = serial();
    let o = run_cluster(
        Router::Real,
        Sources::Both,
        &["--fault", "stale-kv-params", "--fault-rate", "0.1"],
        HANDOFF_FAULT_LOAD,
    );
    assert_no_loss(&o);
    // The requests each KV name was issued to, from prefill's own records.
    let mut sharing: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (rid, r) in &o.prefill {
        let issued = r["answered_remote_request_id"]
            .as_str()
            .or(r["internal_id"].as_str().filter(|_| r["status"] == 200));
        if let Some(name) = issued {
            sharing
                .entry(name.to_string())
                .or_default()
                .insert(rid.clone());
        }
    }
    sharing.retain(|_, rids| rids.len() > 1);
    let faulted = o
        .prefill
        .values()
        .filter(|r| r["fault"] == "injected-stale-kv-params")
        .count();
    assert!(faulted >= 20, "the fault must hit many requests: {faulted}");
    assert!(!sharing.is_empty());
    let group_of = |rid: &str| sharing.values().find(|g| g.contains(rid));
    let mut alerted: BTreeMap<String, usize> = BTreeMap::new();
    for n in &o.notifications {
        assert_eq!(notifications::rules(n), ["kv-handoff-mismatch"], "{n}");
        let f = notifications::finding(n, "kv-handoff-mismatch").unwrap();
        let rid = f["attempt"]["rid"].as_str().unwrap().to_string();
        let summary = f["summary"].as_str().unwrap_or_default();
        let group = group_of(&rid).unwrap_or_else(|| panic!("{rid} shares no KV: {summary}"));
        assert!(
            group
                .iter()
                .any(|other| *other != rid && summary.contains(&format!("issued to {other}"))),
            "{rid}'s alert names a request it shares KV with: {summary} ({group:?})"
        );
        *alerted.entry(rid).or_default() += 1;
    }
    for (rid, count) in &alerted {
        assert_eq!(*count, 1, "{rid} notified {count} times");
    }
    let missed: Vec<_> = sharing
        .values()
        .filter(|g| !g.iter().any(|r| alerted.contains_key(r)))
        .take(5)
        .collect();
    assert!(
        missed.is_empty(),
        "{} groups sharing KV, none of these alerted: {missed:?}",
        sharing.len()
    );
    assert_eq!(
        metric_sum(
            &o.metrics,
            "revenant_checker_violations_total",
            &[("rule", "kv-handoff-mismatch")]
        ),
        alerted.len() as f64
    );
}

/// The workers on vLLM's MooncakeConnector (decode pulls each request's KV over ZeroMQ with the
/// router's `transfer_id`), the real vllm-router 0.1.17 with `--kv-connector mooncake` in
/// front: nothing is reported, and every request's pull and its answer were read.
#[test]
#[ignore = "needs vllm-router 0.1.17 (PD_SIM_VLLM_ROUTER_PYTHON) and root; cargo xtask test runs it"]
fn real_vllm_router_mooncake_zero_alerts_and_every_pull_read() {
    let _g = serial();
    let o = run_cluster(
        Router::Real,
        Sources::Both,
        &["--kv-connector", "mooncake"],
        CORRECT_LOAD,
    );
    assert_silent_and_seeing(&o, Sources::Both, 1200);
}

/// MooncakeConnector behind the older router bug: decode gets the refused request's leg and
/// pulls KV prefill never computed; prefill holds the pull until its abort timeout (480 s in
/// vLLM, 8 s here), so decode holds the leg of a refused request past the 6 s it may take.
/// Each such request is caught once, from eBPF.
#[test]
fn vllm_mooncake_handoff_after_reject_caught_once_per_request() {
    let o = handoff_with(
        Sources::Ebpf,
        &[
            "--kv-connector",
            "mooncake",
            "--mooncake-abort-request-timeout-secs",
            "8",
        ],
        "orphaned-leg",
    );
    assert_eq!(
        common::sources_of_rule(&o.notifications, "orphaned-leg")
            .keys()
            .collect::<Vec<_>>(),
        ["ebpf"]
    );
    // Decode pulled the refused transfers: eBPF read those pulls too.
    assert!(events(&o, "ebpf", "transfer", "admitted") >= o.load["ok"].as_u64().unwrap());
}

/// The capacity check for vLLM, from the wire: a prefill whose KV cache holds fewer tokens than
/// its `max_model_len` (what `/v1/models` says against what `/metrics` says) is reported once,
/// as that worker; decode, whose cache holds its context, is not.
#[test]
fn vllm_worker_whose_kv_cache_is_smaller_than_its_context_is_reported() {
    let _g = serial();
    assert!(
        test_harness::is_root(),
        "this test loads eBPF probes and must run as root (cargo xtask test does, as CI)"
    );
    let b = bins();
    let dir = tempfile::Builder::new()
        .prefix("revenant-vllm-capacity-")
        .tempdir()
        .unwrap();
    // 128 blocks of 16 tokens: 2048 tokens of KV for a context of 4096.
    let cluster = Cluster::start(
        &b.pd_sim,
        &[
            "--flavour",
            "vllm",
            "--mode",
            "correct",
            "--prefill-args",
            "--num-gpu-blocks 128",
            "--router-args",
            "--metrics-poll-interval-secs 1",
        ],
        Some(&dir.path().join("pd-sim.log")),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    let mut args: Vec<String> = [
        "--admin",
        "127.0.0.1:0",
        "--otlp-http",
        "off",
        "--otlp-grpc",
        "off",
        "--rate-limit",
        "0",
        "--spool-no-fsync",
        "--no-sglang-conventions",
        "--ebpf",
        "on",
    ]
    .map(String::from)
    .to_vec();
    args.extend(cluster.pid_args());
    let mut revenant =
        Revenant::start_recording(&b.revenant, dir.path(), &args, Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("{e:#}"));
    // A client asks the model list (the router answers prefill's); the router reads /metrics
    // every second.
    let models = http_json(&format!("{}/v1/models", cluster.router)).unwrap();
    assert_eq!(models["data"][0]["max_model_len"], 4096, "{models}");
    let prefill_addr = cluster.prefill.trim_start_matches("http://").to_string();
    let deadline = Instant::now() + Duration::from_secs(30);
    let violations = loop {
        let (status, v) = revenant.admin_json("/api/violations").unwrap();
        assert_eq!(status, 200, "{v}");
        let found: Vec<Value> = v["violations"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter(|v| v["rule"] == "context-exceeds-capacity")
            .collect();
        if !found.is_empty() || Instant::now() > deadline {
            break found;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    // A few more polls: a repeated report must not repeat the alert.
    std::thread::sleep(Duration::from_secs(3));
    let metrics = revenant
        .wait_quiet(Duration::from_secs(1), Duration::from_secs(30), None)
        .unwrap();
    let router_stats = http_json(&format!("{}/sim/stats", cluster.router)).unwrap();
    assert!(
        router_stats["router"]["metrics_polls"]
            .as_u64()
            .unwrap_or(0)
            >= 4,
        "{router_stats}"
    );
    let status = revenant.stop().unwrap();
    assert!(
        status.success(),
        "{}",
        test_harness::tail(&revenant.log, 30)
    );
    assert_eq!(violations.len(), 1, "{violations:#?}");
    let v = &violations[0];
    assert_eq!(v["worker"], prefill_addr.as_str(), "{v}");
    assert!(
        v["summary"].as_str().unwrap_or("").contains("4096"),
        "the alert says the context it found: {v}"
    );
    assert_eq!(
        metric_sum(
            &metrics,
            "revenant_checker_violations_total",
            &[("rule", "context-exceeds-capacity")]
        ),
        1.0
    );
    // Both workers' KV sizes were read off the wire; only prefill's context was asked.
    assert!(
        metric_sum(
            &metrics,
            "revenant_events_total",
            &[
                ("source", "ebpf"),
                ("kind", "capacity"),
                ("stage", "decode")
            ]
        ) >= 1.0
    );
}
