//! The real sglang-router 0.3.2 (`smg`) in front of the simulator's prefill and decode workers,
//! seen by the eBPF source alone (no OTLP), with the default rules in-process.
//!
//! Ignored by default: it needs the wheel. `cargo xtask test` creates target/xtask-venv and runs
//! it as root with `PD_SIM_SMG` set; by hand:
//!   PD_SIM_SMG=target/xtask-venv/bin/smg cargo test -p revenant --test ebpf_real_router -- --ignored
//! Without `PD_SIM_SMG` it fails, loudly.
//!
//! Discovery is what a node agent without configuration would have: the router by a `--watch`
//! rule on its command line; the workers by pid with their role unknown (400 test), or not at
//! all (503 test). smg asks every worker for `/server_info` when it registers it: the answers
//! give the workers their roles, seen from the worker's side or from the router's.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use revenant::ingest::ebpf::{Discovery, EbpfConfig, EbpfSource, Role};
use revenant::{Kind, LifecycleEvent, Stage};
use support::ebpf::*;
use test_harness::{Cluster, http_get, wait_healthy};

const CANARY: &str = "CANARYsmgebpf51d7";

struct Setup {
    // Drop order: smg before the workers it talks to.
    _smg: test_harness::Proc,
    cluster: Cluster,
    _model: tempfile::TempDir,
    router: String,
    src: EbpfSource,
    logs: LogCapture,
}

fn smg_bin() -> String {
    test_harness::router_from_env("PD_SIM_SMG", "sglang-router 0.3.2")
        .display()
        .to_string()
}

/// How the source first hears of the workers.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Workers {
    /// `--pid PID`: watched, role unknown; their own `/server_info` answers name it.
    ByPidRoleUnknown,
    /// Not at all: the router's traffic names them (smg reads their `/server_info`), and the
    /// source finds the local processes listening on those ports and starts watching them.
    FromRouterTraffic,
}

/// Workers (`pd-sim cluster --no-router`), the source (smg by a --watch rule, the workers as
/// `workers` says), then smg; returns once smg is healthy and the workers' roles were learned
/// from the `/server_info` answers smg asked for.
fn setup(workers: Workers, prefill_args: &str, decode_args: &str, smg_args: &[&str]) -> Setup {
    let smg = smg_bin();
    let cluster = Cluster::start(
        &pd_sim_bin(),
        &[
            "--no-router",
            "--prefill-args",
            prefill_args,
            "--decode-args",
            decode_args,
        ],
        None,
    )
    .expect("pd-sim workers");
    let pid = |k: &str| cluster.ready["pids"][k].as_u64().expect("pid") as u32;
    let (prefill, decode) = (pid("prefill"), pid("decode"));
    let port = test_harness::free_port().unwrap();
    let logs = LogCapture::global();
    let cfg = EbpfConfig {
        discovery: Discovery {
            // Only this test's smg (its port is in its command line).
            watch: vec![
                format!("router=smg launch .*--port {port}( |$)")
                    .parse()
                    .expect("watch rule"),
            ],
            pids: match workers {
                Workers::ByPidRoleUnknown => vec![
                    prefill.to_string().parse().expect("pid rule"),
                    decode.to_string().parse().expect("pid rule"),
                ],
                Workers::FromRouterTraffic => vec![],
            },
            conventions: false,
        },
        node: Some("smg-node".into()),
        rescan_every: Duration::from_millis(200),
        ..Default::default()
    };
    let mut src = start_source(cfg);
    let mut early = Vec::new();
    match workers {
        Workers::ByPidRoleUnknown => wait_roles(
            &mut src,
            &[(prefill, Role::Unknown), (decode, Role::Unknown)],
            &mut early,
        ),
        Workers::FromRouterTraffic => assert!(src.watched().is_empty()),
    }
    let model = tokenizer_dir();
    let router = format!("http://127.0.0.1:{port}");
    let bootstrap = cluster.ready["bootstrap_port"].to_string();
    let smg = support::spawn(
        "smg",
        Command::new(smg)
            .args(["launch", "--pd-disaggregation"])
            .args(["--prefill", &cluster.prefill, &bootstrap])
            .args(["--decode", &cluster.decode])
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args([
                "--prometheus-port",
                &test_harness::free_port().unwrap().to_string(),
            ])
            .arg("--model-path")
            .arg(model.path())
            .args(smg_args)
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    let smg_pid = smg.pid();
    // smg is healthy once it registered both workers; keep draining meanwhile so the source
    // sees its exec and the workers' /server_info answers as they happen.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        src.rescan();
        src.drain(&mut early);
        if src.watched().get(&prefill) == Some(&Role::Prefill)
            && src.watched().get(&decode) == Some(&Role::Decode)
            && src.watched().contains_key(&smg_pid)
            && wait_healthy(&router, Duration::from_millis(200)).is_ok()
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "smg not healthy, or roles not learned from /server_info within 60 s; watched: {:?} (smg pid {smg_pid})",
            src.watched()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(src.watched().get(&smg_pid), Some(&Role::Router));
    assert!(
        early.iter().all(|e| e.kind != Kind::Dispatched),
        "no request yet: {early:?}"
    );
    Setup {
        _smg: smg,
        cluster,
        _model: model,
        router,
        src,
        logs,
    }
}

fn of_request<'a>(events: &'a [LifecycleEvent], rid: &str) -> Vec<&'a LifecycleEvent> {
    events
        .iter()
        .filter(|e| e.ids.request_id.as_deref() == Some(rid))
        .collect()
}

fn rooms(events: &[&LifecycleEvent], stage: Stage, kind: Kind) -> BTreeSet<u64> {
    events
        .iter()
        .filter(|e| e.stage == stage && e.kind == kind)
        .filter_map(|e| e.ids.bootstrap_room.map(|r| r.0))
        .collect()
}

/// Every decode leg of `rid` ended (its KV never came: 500 after the KV timeout).
fn decode_legs_ended(obs: &Observed, rid: &str) -> bool {
    let ev = of_request(&obs.events, rid);
    let received = rooms(&ev, Stage::Decode, Kind::Received);
    let ended: BTreeSet<u64> = [Kind::Rejected, Kind::Completed, Kind::Cancelled]
        .into_iter()
        .flat_map(|k| rooms(&ev, Stage::Decode, k))
        .collect();
    !received.is_empty()
        && !rooms(&ev, Stage::Prefill, Kind::Rejected).is_empty()
        && received.is_subset(&ended)
}

fn sim_rooms_of(url: &str, rid: &str) -> Vec<serde_json::Value> {
    let (_, body) = http_get(&format!("{url}/sim/rooms")).expect("/sim/rooms");
    let all: Vec<serde_json::Value> = serde_json::from_str(&body).expect("rooms json");
    all.into_iter().filter(|r| r["request_id"] == rid).collect()
}

fn show(events: &[&LifecycleEvent]) -> String {
    events
        .iter()
        .map(|e| {
            format!(
                "{}/{} room={:?} status={:?} pid={:?} {:?}",
                e.stage, e.kind, e.ids.bootstrap_room, e.status, e.pid, e.detail
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The disclosed behaviour of smg 0.3.2: prefill answers 400 (over capacity) while the decode
/// leg, sent at the same time, is never withdrawn and stays alive waiting for KV that never
/// comes. eBPF alone must flag it. The prompt carries a canary that must reach no event, violation or log line.
#[test]
#[ignore = "needs PD_SIM_SMG (sglang-router 0.3.2); `cargo xtask test` runs it as root"]
fn real_smg_prefill_400_with_live_decode_leg_is_flagged_from_ebpf_alone() {
    let t0 = Instant::now();
    // Decode waits 7 s for KV: far past the 500 ms cancellation window, and a second past
    // orphaned-leg's 6 s (a leg ending at 6 s raced the rule's deadline, which comes the few
    // milliseconds prefill takes to refuse after decode took the leg). One attempt: smg retries
    // a decode 5xx with a new room, which would only repeat the same story.
    let s = setup(
        Workers::ByPidRoleUnknown,
        "",
        "--kv-timeout-ms 7000",
        &[
            "--retry-max-retries",
            "1",
            "--retry-initial-backoff-ms",
            "10",
        ],
    );
    let rid = format!("smg-ebpf-400-{}", std::process::id());
    let mut words = vec!["a"; 5000];
    words[2500] = CANARY;
    let body =
        serde_json::json!({"text": words.join(" "), "sampling_params": {"max_new_tokens": 4}})
            .to_string();
    let (router, rid2) = (s.router.clone(), rid.clone());
    let Setup {
        src,
        logs,
        cluster,
        _smg,
        _model,
        ..
    } = s;
    let (obs, status, stats) = run_live(
        src,
        move || http_post_json(&router, "/generate", &rid2, &body).0,
        |obs, _| decode_legs_ended(obs, &rid),
    );
    let ev = of_request(&obs.events, &rid);
    let found: Vec<_> = obs
        .violations
        .iter()
        .filter(|v| v.request.request_id.as_deref() == Some(rid.as_str()))
        .collect();
    let per_rule = found.iter().fold(BTreeMap::new(), |mut m, v| {
        *m.entry(v.rule.as_str()).or_insert(0) += 1;
        m
    });
    eprintln!(
        "smg 400: {:.1}s; client got {status}; {} eBPF events ({} for the request); violations {per_rule:?}; losses {}\n{}",
        t0.elapsed().as_secs_f64(),
        obs.events.len(),
        ev.len(),
        stats.losses(),
        show(&ev)
    );
    assert_ne!(status, 200);
    let p_rooms = sim_rooms_of(&cluster.prefill, &rid);
    assert!(
        !p_rooms.is_empty() && p_rooms.iter().all(|r| r["status"] == 400),
        "{p_rooms:?}"
    );
    assert_eq!(
        rooms(&ev, Stage::Prefill, Kind::Rejected),
        p_rooms
            .iter()
            .map(|r| r["room"].as_u64().unwrap())
            .collect(),
        "eBPF saw every prefill rejection, room for room\n{}",
        show(&ev)
    );
    // Nothing advanced (no KV moved, no output): the breach is the leg left open.
    assert!(
        !found.is_empty() && found.iter().all(|v| v.rule == "orphaned-leg"),
        "a prefill 400 with a live decode leg must be flagged as an orphaned leg; got {:?}\n{}",
        obs.per_rule(),
        show(&ev)
    );
    for v in &found {
        assert!(
            v.evidence
                .iter()
                .all(|e| e.source == revenant::Source::Ebpf)
        );
    }
    assert_canary_absent(CANARY, &obs, &logs);
}

/// smg retries a prefill 503, each time with a new `bootstrap_room`, under one
/// `x-request-id` (it waits for each attempt's decode leg first: 7 s here, a second past
/// orphaned-leg's window so that every attempt's leg is judged open, so ~22 s in all). From the kernel's view that must be one request with several attempts:
/// one rejection per room, every violation naming the same request and sharing one
/// fingerprint per rule (so the storm notifies once).
#[test]
#[ignore = "needs PD_SIM_SMG (sglang-router 0.3.2); `cargo xtask test` runs it as root"]
fn real_smg_503_retry_storm_is_one_request_with_several_attempts() {
    let t0 = Instant::now();
    let s = setup(
        Workers::FromRouterTraffic,
        "--overload-share 1.0",
        "--kv-timeout-ms 7000",
        &[
            "--retry-max-retries",
            "3",
            "--retry-initial-backoff-ms",
            "10",
        ],
    );
    let rid = format!("smg-ebpf-503-{}", std::process::id());
    let body =
        serde_json::json!({"text": "a b c", "sampling_params": {"max_new_tokens": 4}}).to_string();
    let (router, rid2) = (s.router.clone(), rid.clone());
    let Setup {
        src,
        cluster,
        _smg,
        _model,
        ..
    } = s;
    let (obs, status, _) = run_live(
        src,
        move || http_post_json(&router, "/generate", &rid2, &body).0,
        |obs, _| decode_legs_ended(obs, &rid),
    );
    let ev = of_request(&obs.events, &rid);
    let rejected: Vec<_> = ev
        .iter()
        .filter(|e| e.stage == Stage::Prefill && e.kind == Kind::Rejected)
        .collect();
    let attempt_rooms = rooms(&ev, Stage::Prefill, Kind::Rejected);
    let found: Vec<_> = obs
        .violations
        .iter()
        .filter(|v| v.request.request_id.as_deref() == Some(rid.as_str()))
        .collect();
    eprintln!(
        "smg 503 storm: {:.1}s; client got {status}; {} attempts seen by eBPF; violations {:?}\n{}",
        t0.elapsed().as_secs_f64(),
        attempt_rooms.len(),
        obs.per_rule(),
        show(&ev)
    );
    // smg joins both legs: the decode leg's 500 (its KV never came) is what the client gets.
    assert_ne!(status, 200);
    let p_rooms = sim_rooms_of(&cluster.prefill, &rid);
    assert!(p_rooms.len() >= 2, "smg retried: {p_rooms:?}");
    assert!(rejected.iter().all(|e| e.status == Some(503)));
    assert_eq!(
        attempt_rooms,
        p_rooms
            .iter()
            .map(|r| r["room"].as_u64().unwrap())
            .collect(),
        "one rejected attempt per room the simulator saw"
    );
    assert_eq!(
        rejected.len(),
        attempt_rooms.len(),
        "a new room per attempt"
    );
    // One request: every attempt's violation names it, one fingerprint per rule.
    let violated_rooms: BTreeSet<u64> = found
        .iter()
        .filter_map(|v| v.attempt.bootstrap_room)
        .collect();
    assert!(
        violated_rooms.len() >= 2,
        "several attempts of the request are flagged: {:?}",
        obs.per_rule()
    );
    assert!(violated_rooms.is_subset(&attempt_rooms));
    let mut fingerprints: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for v in &found {
        fingerprints
            .entry(v.rule.as_str())
            .or_default()
            .insert(v.fingerprint.as_str());
    }
    assert!(
        fingerprints.values().all(|f| f.len() == 1),
        "attempts of one request share a fingerprint: {fingerprints:?}"
    );
}
