//! Cluster mode on real processes: the simulator's router, prefill and decode as three "nodes",
//! each bound to its own loopback address (127.0.3.1, 127.0.1.1, 127.0.2.1), one
//! `revenant agent --ebpf on` per node watching only that node's process (the prefill node's
//! clock 20 ms ahead, inside the 50 ms skew bound), a three-node NATS cluster holding an R3
//! stream, and two `revenant checker`s sharing four partitions. From eBPF alone, a router that
//! hands rejected requests to decode is caught once per request; a correct router and one that
//! cancels the decode leg concurrently (smg 1.13.0) stay silent. The same hold under faults in
//! the middle of the load: a checker killed (SIGKILL) and a new one started on its partitions,
//! and the whole NATS cluster down for ten seconds (the agents keep what they could not publish,
//! the checkers wait for it).
//!
//! Root only (the agents load eBPF probes), release builds (`REVENANT_BIN`/`PD_SIM_BIN`, as
//! `cargo xtask test` passes them).

// Shared with the other end-to-end files; this one uses only the binaries and the serial lock.
#[allow(dead_code)]
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use test_harness::{
    Cluster, Nats, Proc, http_get, metric_sum, notifications, parse_metrics, read_jsonl_so_far,
    tail,
};

use common::{bins, serial};

const WAIT: Duration = Duration::from_secs(60);

struct Member {
    proc: Proc,
    admin: String,
    dir: PathBuf,
}

/// A member started, not yet ready.
struct Starting {
    name: String,
    proc: Proc,
    dir: PathBuf,
}

/// Starts a member (on the calling thread: a member dies with the thread that forked it).
fn spawn(name: &str, dir: &Path, mut c: Command) -> Starting {
    std::fs::create_dir_all(dir).unwrap();
    c.arg("--ready-file")
        .arg(dir.join("ready"))
        .arg("--spool-dir")
        .arg(dir.join("spool"))
        .args(["--admin", "127.0.0.1:0", "--log-format", "json"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("stderr")).unwrap());
    Starting {
        name: name.into(),
        proc: Proc::spawn(name, &mut c).unwrap(),
        dir: dir.into(),
    }
}

/// Waits until a started member has written its ready file.
fn ready(s: Starting) -> Member {
    let Starting {
        name,
        mut proc,
        dir,
    } = s;
    let deadline = Instant::now() + WAIT;
    loop {
        if let Ok(t) = std::fs::read_to_string(dir.join("ready"))
            && let Ok(v) = serde_json::from_str::<Value>(&t)
        {
            return Member {
                proc,
                admin: v["admin"].as_str().unwrap().to_owned(),
                dir,
            };
        }
        if let Some(s) = proc.exited() {
            panic!("{name} exited ({s}):\n{}", tail(&dir.join("stderr"), 30));
        }
        assert!(Instant::now() < deadline, "{name} not ready");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn metric(admin: &str, name: &str) -> f64 {
    match http_get(&format!("http://{admin}/metrics")) {
        Ok((200, body)) => metric_sum(&parse_metrics(&body), name, &[]),
        _ => -1.0,
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

fn stop(m: &mut Member) {
    let status = m.proc.stop(libc::SIGTERM, WAIT);
    assert!(
        status.is_some_and(|s| s.success()),
        "{}: {status:?}\n{}",
        m.proc.name,
        tail(&m.dir.join("stderr"), 20)
    );
}

/// What goes wrong while the load runs (from 4 s into it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    /// Checker 0 is killed; 2 s later its replacement starts on the killed one's directory and
    /// takes its partitions: the chart's checkers are a StatefulSet, whose replacement pod gets
    /// its replica's volume back, spool included (what the killed life had spooled and not yet
    /// delivered is delivered by the next one; the notification claims keep everyone else from
    /// sending it).
    KillChecker,
    /// Every NATS server is killed, and started again 10 s later.
    NatsOutage,
}

struct Outcome {
    notifications: Vec<Value>,
    rooms: Vec<Value>,
    load: Value,
    routed: f64,
}

fn run(mode: &str, load_args: &[&str], fault: Fault) -> Outcome {
    assert!(
        test_harness::is_root(),
        "this test loads eBPF probes and must run as root (cargo xtask test does, as CI)"
    );
    let b = bins();
    let dir = tempfile::Builder::new()
        .prefix("revenant-cluster-pd-")
        .tempdir()
        .unwrap();
    let mut nats = Nats::cluster3().unwrap();
    let cluster = Cluster::start(
        &b.pd_sim,
        &[
            "--mode",
            mode,
            "--router-host",
            "127.0.3.1",
            "--prefill-host",
            "127.0.1.1",
            "--decode-host",
            "127.0.2.1",
        ],
        Some(&dir.path().join("pd-sim.log")),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    assert!(cluster.prefill.contains("127.0.1.1"), "{}", cluster.ready);
    let bus = |c: &mut Command| {
        c.args(["--nats", &nats.urls(), "--stream", "PD"]).args([
            "--partitions",
            "4",
            "--replicas",
            "3",
        ]);
    };
    let owned = [[0u32, 2], [1, 3]];
    let start_checker = |i: usize| {
        let d = dir.path().join(format!("checker{i}"));
        let mut c = Command::new(&b.revenant);
        c.arg("checker");
        bus(&mut c);
        c.args([
            "--owned-partitions",
            &format!("{},{}", owned[i][0], owned[i][1]),
        ])
        .args(["--allowed-lateness", "2s", "--rate-limit", "0"])
        .arg("--alerts-jsonl")
        .arg(d.join("alerts.jsonl"));
        spawn(&format!("checker {i}"), &d, c)
    };
    // The members of a kind start together, then each is waited for: an agent's start is mostly
    // the kernel verifying its probes.
    let starting: Vec<Starting> = (0..owned.len()).map(start_checker).collect();
    let mut checkers: Vec<Member> = starting.into_iter().map(ready).collect();
    // Each checker's alerts file, which its every life appends to.
    let alert_files: Vec<PathBuf> = checkers
        .iter()
        .map(|c| c.dir.join("alerts.jsonl"))
        .collect();
    let start_agent = |role: &str, pid: u32| {
        let d = dir.path().join(format!("agent-{role}"));
        let mut c = Command::new(&b.revenant);
        c.arg("agent");
        bus(&mut c);
        c.args(["--node", &format!("{role}-node"), "--ebpf", "on"])
            .arg("--no-sglang-conventions")
            .args(["--pid", &format!("{role}={pid}")])
            .args(["--otlp-grpc", "off", "--otlp-http", "off"]);
        if role == "prefill" {
            c.args(["--clock-offset", "20ms"]);
        }
        spawn(&format!("agent {role}"), &d, c)
    };
    let starting: Vec<Starting> = cluster
        .pids
        .iter()
        .map(|(role, pid)| start_agent(role, *pid))
        .collect();
    let mut agents: Vec<Member> = starting.into_iter().map(ready).collect();
    let load = {
        let (pd_sim, router) = (b.pd_sim.clone(), cluster.router.clone());
        let args: Vec<String> = load_args.iter().map(|s| s.to_string()).collect();
        let summary = dir.path().join("load.json");
        std::thread::spawn(move || {
            test_harness::run_load(
                &pd_sim,
                &router,
                &args,
                &summary,
                true,
                Duration::from_secs(300),
                None,
            )
        })
    };
    match fault {
        Fault::None => {}
        Fault::KillChecker => {
            std::thread::sleep(Duration::from_secs(4));
            checkers[0].proc.stop(libc::SIGKILL, Duration::ZERO);
            std::thread::sleep(Duration::from_secs(2));
            // The next life writes a ready file of its own; the killed one's log is kept.
            let d = &checkers[0].dir;
            std::fs::remove_file(d.join("ready")).unwrap();
            std::fs::rename(d.join("stderr"), d.join("stderr.killed")).unwrap();
            checkers[0] = ready(start_checker(0));
        }
        Fault::NatsOutage => {
            std::thread::sleep(Duration::from_secs(4));
            for n in &mut nats.nodes {
                n.kill();
            }
            std::thread::sleep(Duration::from_secs(10));
            for n in &mut nats.nodes {
                n.start().unwrap();
            }
            nats.wait_ready().unwrap();
        }
    }
    let load = load
        .join()
        .unwrap()
        .unwrap_or_else(|e| panic!("{e:#}"))
        .expect("not interrupted");
    let load_end = unix_now();
    // The agents are quiet once nothing more arrives for 2 s: the decode legs a router cancels
    // end after its answer, and an agent stopped before a leg's end leaves that leg open for
    // the checkers (orphaned-leg, 6 s later).
    let mut last = -1.0;
    let mut since = Instant::now();
    let deadline = Instant::now() + WAIT;
    loop {
        let routed: f64 = agents
            .iter()
            .map(|a| metric(&a.admin, "revenant_agent_events_total"))
            .sum();
        if routed != last {
            (last, since) = (routed, Instant::now());
        } else if since.elapsed() >= Duration::from_secs(2) {
            break;
        }
        assert!(Instant::now() < deadline, "agents never quiet");
        std::thread::sleep(Duration::from_millis(250));
    }
    let rooms = cluster.prefill_rooms().unwrap();
    let mut published = 0.0;
    for a in &mut agents {
        stop(a);
        published += std::fs::read_to_string(a.dir.join("stderr"))
            .unwrap()
            .lines()
            .rev()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find_map(|v| v["fields"]["batches_published"].as_f64())
            .unwrap_or(0.0);
    }
    // Each checker has taken every agent stream's last batch (the input is whole), then every
    // deadline is judged within a few seconds.
    let deadline = Instant::now() + WAIT;
    while checkers.iter().any(|c| {
        metric(&c.admin, "revenant_checker_agent_streams") != 0.0
            || metric(&c.admin, "revenant_checker_recovering_partitions") != 0.0
            || metric(&c.admin, "revenant_checker_partitions_behind") != 0.0
    }) || checkers
        .iter()
        .map(|c| metric(&c.admin, "revenant_checker_messages_total"))
        .sum::<f64>()
        < published
    {
        assert!(
            Instant::now() < deadline,
            "checkers did not take every batch"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Then every checker's watermark passes every deadline a run could still miss: the load's
    // end plus the longest default window short of the 330 s ones (orphaned-leg's 6 s), so a
    // silent result covers the whole load.
    let judged = load_end + 7.0;
    let deadline = Instant::now() + WAIT;
    while checkers
        .iter()
        .any(|c| metric(&c.admin, "revenant_checker_watermark_timestamp_seconds") < judged)
    {
        assert!(
            Instant::now() < deadline,
            "the checkers' watermarks did not pass {judged} within {WAIT:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    for c in &mut checkers {
        stop(c);
    }
    // Delivery is at least once: a life killed between a sink's write and the spool's record
    // of it has its next life deliver it again, under the same id (receivers recognise it).
    let mut ids = BTreeSet::new();
    let notifications = alert_files
        .iter()
        .flat_map(|f| read_jsonl_so_far(f))
        .filter(|n: &Value| ids.insert(n["id"].as_str().expect("a notification id").to_owned()))
        .collect();
    drop(cluster);
    Outcome {
        notifications,
        rooms,
        load,
        routed: last,
    }
}

/// Every handed-off room caught once, from eBPF alone, in one notification per request.
fn assert_caught_once_per_request(o: &Outcome) {
    assert_eq!(o.load["errors"], 0, "{}", o.load);
    let expected: BTreeSet<u64> = o
        .rooms
        .iter()
        .filter(|r| r["outcome"] == "rejected-transferred")
        .map(|r| r["room"].as_u64().unwrap())
        .collect();
    assert!(expected.len() > 20, "too few handed off: {}", o.load);
    let mut per_room: BTreeMap<u64, usize> = BTreeMap::new();
    let mut per_incident: BTreeMap<String, usize> = BTreeMap::new();
    for n in &o.notifications {
        assert!(notifications::is_incident(n), "{n}");
        *per_incident
            .entry(n["incident_key"].as_str().unwrap_or("").to_string())
            .or_default() += 1;
        if let Some(f) = notifications::finding(n, "activity-after-rejection") {
            assert_eq!(
                notifications::evidence_sources(f),
                ["ebpf"],
                "eBPF is the only witness: {n}"
            );
            let room = notifications::room_of(&f["attempt"]).expect("a room");
            *per_room.entry(room).or_default() += 1;
        }
    }
    let twice: Vec<_> = per_incident.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "notified more than once: {twice:?}");
    let got: BTreeSet<u64> = per_room.keys().copied().collect();
    assert_eq!(
        got,
        expected,
        "{} routed; missed {:?}, unexpected {:?}",
        o.routed,
        expected.difference(&got).take(10).collect::<Vec<_>>(),
        got.difference(&expected).take(10).collect::<Vec<_>>()
    );
    assert!(per_room.values().all(|n| *n == 1), "{per_room:?}");
}

/// No notification at all, from agents that saw the traffic.
fn assert_silent(what: &str, o: &Outcome) {
    assert_eq!(o.load["errors"], 0, "{what}: {}", o.load);
    assert!(
        o.routed > 1000.0,
        "{what}: the agents saw too little: {}",
        o.routed
    );
    assert!(
        o.notifications.is_empty(),
        "{what}: {} notifications, first: {:#?}",
        o.notifications.len(),
        &o.notifications[..o.notifications.len().min(3)]
    );
}

/// Long enough for a fault 4 s in and 10 s long.
const LOAD_THROUGH_A_FAULT: &[&str] = &[
    "--rate",
    "100",
    "--requests",
    "1600",
    "--over-capacity-share",
    "0.1",
];

#[test]
fn three_nodes_handoff_after_reject_is_caught_once_per_request_from_ebpf_alone() {
    let _g = serial();
    let o = run(
        "handoff-after-reject",
        &[
            "--rate",
            "200",
            "--requests",
            "600",
            "--over-capacity-share",
            "0.1",
        ],
        Fault::None,
    );
    assert_caught_once_per_request(&o);
}

#[test]
fn three_nodes_correct_and_concurrent_cancel_routers_stay_silent() {
    let _g = serial();
    for mode in ["correct", "concurrent-cancel"] {
        let o = run(
            mode,
            &[
                "--rate",
                "50",
                "--requests",
                "300",
                "--over-capacity-share",
                "0.1",
            ],
            Fault::None,
        );
        assert_silent(mode, &o);
    }
}

#[test]
fn a_checker_killed_midway_and_replaced_still_catches_each_handoff_once() {
    let _g = serial();
    let o = run(
        "handoff-after-reject",
        LOAD_THROUGH_A_FAULT,
        Fault::KillChecker,
    );
    assert_caught_once_per_request(&o);
}

#[test]
fn correct_routers_stay_silent_through_a_checker_kill_and_a_nats_outage() {
    let _g = serial();
    let o = run(
        "concurrent-cancel",
        LOAD_THROUGH_A_FAULT,
        Fault::KillChecker,
    );
    assert_silent("concurrent-cancel, a checker killed", &o);
    let o = run("correct", LOAD_THROUGH_A_FAULT, Fault::NatsOutage);
    assert_silent("correct, NATS down for 10 s", &o);
}

#[test]
fn handoffs_during_a_nats_outage_are_caught_once_each_after_it() {
    let _g = serial();
    let o = run(
        "handoff-after-reject",
        LOAD_THROUGH_A_FAULT,
        Fault::NatsOutage,
    );
    assert_caught_once_per_request(&o);
}
