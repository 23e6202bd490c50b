//! The PD simulator seen by the real eBPF source alone (no OTLP): kernel probes on the
//! simulator's router, prefill and decode processes, the default rules in-process.
//!
//! Root and what `cargo xtask setup` installs are needed; the probes failing to load fails the
//! test. The `pd-sim` binary is built on demand (see `test_harness::pd_sim_bin`).
//! Run: `cargo test -p revenant --test ebpf_sim -- --nocapture`.

mod support;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use revenant::ingest::ebpf::{Discovery, EbpfConfig, EbpfSource, EbpfStats, PidRule, Role};
use revenant::{Kind, LifecycleEvent, Stage};
use support::ebpf::*;
use test_harness::{Cluster, http_get, run_load_quiet};

const CANARY: &str = "CANARYebpfsim9c41";

struct Sim {
    cluster: Cluster,
    router: u32,
    prefill: u32,
    decode: u32,
}

fn start(mode: &str) -> Sim {
    let cluster = Cluster::start(&pd_sim_bin(), &["--mode", mode], None)
        .unwrap_or_else(|e| panic!("pd-sim cluster --mode {mode}: {e}"));
    let pid = |k: &str| {
        cluster.ready["pids"][k]
            .as_u64()
            .unwrap_or_else(|| panic!("no {k} pid in {}", cluster.ready)) as u32
    };
    let (router, prefill, decode) = (pid("router"), pid("prefill"), pid("decode"));
    Sim {
        cluster,
        router,
        prefill,
        decode,
    }
}

impl Sim {
    /// The real source on the simulator's processes by the `pids` rules; returns once it
    /// watches router, prefill and decode with `roles`, with what it saw meanwhile.
    fn watch(
        &self,
        pids: Vec<PidRule>,
        node: Option<&str>,
        roles: [Role; 3],
    ) -> (EbpfSource, Vec<LifecycleEvent>) {
        let mut cfg = EbpfConfig {
            discovery: Discovery {
                pids,
                watch: vec![],
                conventions: false,
            },
            ..Default::default()
        };
        if let Some(n) = node {
            cfg.node = Some(n.into());
        }
        let mut src = start_source(cfg);
        let mut early = Vec::new();
        let [router, prefill, decode] = roles;
        wait_roles(
            &mut src,
            &[
                (self.router, router),
                (self.prefill, prefill),
                (self.decode, decode),
            ],
            &mut early,
        );
        (src, early)
    }

    /// 120 requests of [`load`] through the source and the checker, until
    /// `settled(observed, prefill /sim/stats, decode /sim/stats)`.
    fn run_load_live(
        &self,
        src: EbpfSource,
        settled: impl Fn(&Observed, &serde_json::Value, &serde_json::Value) -> bool,
    ) -> (Observed, serde_json::Value, Arc<EbpfStats>) {
        let prefill_url = self.cluster.prefill.clone();
        let decode_url = self.cluster.decode.clone();
        run_live(src, load(self, 120), move |obs, _| {
            settled(obs, &sim_stats(&prefill_url), &sim_stats(&decode_url))
        })
    }
}

fn sim_stats(url: &str) -> serde_json::Value {
    let (status, body) = http_get(&format!("{url}/sim/stats")).expect("/sim/stats");
    assert_eq!(status, 200);
    serde_json::from_str(&body).expect("stats json")
}

fn load(sim: &Sim, requests: u32) -> impl FnOnce() -> serde_json::Value + Send + 'static {
    let (bin, router) = (pd_sim_bin(), sim.cluster.router.clone());
    let requests = requests.to_string();
    move || {
        run_load_quiet(
            &bin,
            &router,
            &[
                "--rate",
                "40",
                "--requests",
                &requests,
                "--over-capacity-share",
                "0.25",
                // hyper writes a streamed answer's last chunks and its end as one writev of
                // many iovecs: the end must still be seen (decode `completed` counted exactly).
                "--stream-share",
                "0.25",
                "--seed",
                "11",
                "--canary",
                CANARY,
            ],
            Duration::from_secs(600),
        )
        .expect("pd-sim load")
    }
}

/// The disclosed bug from the kernel's view. The workers' command lines follow no SGLang
/// convention and they are watched by pid alone: their roles come from their `/server_info`
/// answers. Every attempt that prefill rejected and the router handed to decode anyway must be
/// exactly one `activity-after-rejection`, matching the simulator's own accounting room for room;
/// a canary in every prompt reaches no event, violation or log line.
#[test]
fn handoff_after_reject_one_violation_per_handed_off_rejection() {
    let t0 = Instant::now();
    let sim = start("handoff-after-reject");
    let logs = LogCapture::global();
    let (mut src, mut early) = sim.watch(
        vec![
            PidRule {
                role: Role::Router,
                pid: sim.router,
            },
            format!("{}", sim.prefill).parse().expect("bare pid rule"),
            format!("unknown={}", sim.decode)
                .parse()
                .expect("unknown rule"),
        ],
        Some("sim-node"),
        [Role::Router, Role::Unknown, Role::Unknown],
    );
    // Anyone asking is enough: the answer is what the worker writes.
    for url in [&sim.cluster.prefill, &sim.cluster.decode] {
        let (status, _) = http_get(&format!("{url}/server_info")).expect("/server_info");
        assert_eq!(status, 200);
    }
    wait_roles(
        &mut src,
        &[(sim.prefill, Role::Prefill), (sim.decode, Role::Decode)],
        &mut early,
    );
    assert!(
        early.is_empty(),
        "no lifecycle events before the load: {early:?}"
    );
    assert!(
        logs.text()
            .contains("process role learned from /server_info"),
        "the learned role is logged"
    );

    let (obs, summary, stats) = sim.run_load_live(src, |obs, p, d| {
        let rejected =
            json_u64(p, &["worker", "rejected_400"]) + json_u64(p, &["worker", "rejected_503"]);
        obs.count(Stage::Prefill, Kind::Rejected) as u64 >= rejected
            && obs.of_rule("activity-after-rejection").len() as u64 >= rejected
            && obs.count(Stage::Decode, Kind::Completed) as u64
                >= json_u64(d, &["worker", "completed"])
    });

    let router = sim_stats(&sim.cluster.router);
    let prefill = sim_stats(&sim.cluster.prefill);
    let handed_off = json_u64(&router, &["router", "decode_legs_after_prefill_failure"]);
    let rejected = json_u64(&prefill, &["worker", "rejected_400"])
        + json_u64(&prefill, &["worker", "rejected_503"]);
    // A streamed request's refusal reaches the client inside a 200 (SGLang validates after the
    // stream started): the load counts those apart.
    let sum = |key: &str| -> u64 {
        summary[key]
            .as_object()
            .map(|m| m.values().filter_map(|v| v.as_u64()).sum())
            .unwrap_or(0)
    };
    let client_rejected = sum("rejected_by_status") + sum("failed_in_stream");
    eprintln!(
        "handoff: {:.1}s; load {summary}; prefill rejected {rejected}, handed off {handed_off}; \
         {} eBPF events (prefill rejected {}, decode received {}, transfer work {}); violations {:?}; \
         kernel sent {} ringbuf drops {} losses {}",
        t0.elapsed().as_secs_f64(),
        obs.events.len(),
        obs.count(Stage::Prefill, Kind::Rejected),
        obs.count(Stage::Decode, Kind::Received),
        obs.count(Stage::Transfer, Kind::Work),
        obs.per_rule(),
        stats.kernel(monitor_common::counter::SENT),
        stats.kernel(monitor_common::counter::RINGBUF_DROPS),
        stats.losses(),
    );
    assert_eq!(stats.losses(), 0, "nothing may be lost in this test");
    assert!(
        rejected >= 10,
        "the load must produce rejections: {summary}"
    );
    assert_eq!(
        handed_off, rejected,
        "handoff mode hands every rejection to decode"
    );
    assert_eq!(
        client_rejected, rejected,
        "without 503s each rejected request is one rejected attempt: {summary}"
    );
    // The simulator's rooms that were rejected and still transferred.
    let (_, body) = http_get(&format!("{}/sim/rooms", sim.cluster.prefill)).expect("rooms");
    let rooms: Vec<serde_json::Value> = serde_json::from_str(&body).expect("rooms json");
    let sim_rooms: BTreeSet<u64> = rooms
        .iter()
        // Refused: an error status, or (streamed) an error inside the 200.
        .filter(|r| {
            r["status"].as_u64().is_some_and(|s| s >= 400)
                || r["error_code"].as_u64().is_some_and(|c| c >= 400)
        })
        .map(|r| r["room"].as_u64().expect("room"))
        .collect();
    assert_eq!(sim_rooms.len() as u64, rejected);
    let found = obs.of_rule("activity-after-rejection");
    let found_rooms: BTreeSet<u64> = found
        .iter()
        .map(|v| v.attempt.bootstrap_room.expect("violation names its room"))
        .collect();
    assert_eq!(
        found.len(),
        found_rooms.len(),
        "exactly one violation per attempt"
    );
    assert_eq!(
        found_rooms, sim_rooms,
        "one activity-after-rejection per rejected, handed-off attempt"
    );
    for v in &found {
        assert!(
            v.evidence
                .iter()
                .all(|e| e.source == revenant::Source::Ebpf),
            "{v:?}"
        );
        assert!(v.request.request_id.is_some(), "{v:?}");
    }
    // Decode completes every handed-off leg: nothing is orphaned, nothing else fires.
    assert_eq!(
        obs.violations.len(),
        found.len(),
        "{:?}\n{}",
        obs.per_rule(),
        requests_missing(&obs, Stage::Decode, Kind::Received, Kind::Completed)
    );
    assert_canary_absent(CANARY, &obs, &logs);
}

/// The correct router never lets a rejection reach decode: the same load, seen the same way,
/// gives rejections (so the test is not vacuous) and not one violation.
#[test]
fn correct_mode_gives_no_violation() {
    let t0 = Instant::now();
    let sim = start("correct");
    let logs = LogCapture::global();
    let rule = |role: Role, pid: u32| PidRule { role, pid };
    let (src, _early) = sim.watch(
        vec![
            rule(Role::Router, sim.router),
            rule(Role::Prefill, sim.prefill),
            rule(Role::Decode, sim.decode),
        ],
        None,
        [Role::Router, Role::Prefill, Role::Decode],
    );
    let (obs, summary, stats) = sim.run_load_live(src, |obs, p, d| {
        obs.count(Stage::Prefill, Kind::Rejected) as u64 >= json_u64(p, &["worker", "rejected_400"])
            && obs.count(Stage::Decode, Kind::Completed) as u64
                >= json_u64(d, &["worker", "completed"])
    });
    let prefill = sim_stats(&sim.cluster.prefill);
    let decode = sim_stats(&sim.cluster.decode);
    let rejected = json_u64(&prefill, &["worker", "rejected_400"]);
    eprintln!(
        "correct: {:.1}s; load {summary}; prefill rejected {rejected}, decode completed {}; \
         {} eBPF events (prefill rejected {}, decode completed {}); violations {:?}",
        t0.elapsed().as_secs_f64(),
        json_u64(&decode, &["worker", "completed"]),
        obs.events.len(),
        obs.count(Stage::Prefill, Kind::Rejected),
        obs.count(Stage::Decode, Kind::Completed),
        obs.per_rule(),
    );
    assert_eq!(stats.losses(), 0);
    assert!(
        rejected >= 10,
        "the load must produce rejections: {summary}"
    );
    assert_eq!(obs.count(Stage::Prefill, Kind::Rejected) as u64, rejected);
    assert_eq!(
        obs.count(Stage::Decode, Kind::Completed) as u64,
        json_u64(&decode, &["worker", "completed"]),
        "{}",
        requests_missing(&obs, Stage::Decode, Kind::Received, Kind::Completed)
    );
    assert!(
        obs.violations.is_empty(),
        "correct mode must give no violation: {:#?}",
        obs.violations
    );
    assert_canary_absent(CANARY, &obs, &logs);
}
