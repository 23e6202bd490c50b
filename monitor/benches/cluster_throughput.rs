//! Cluster mode end to end: events/s from one `revenant agent` through NATS JetStream to one
//! `revenant checker`, CPU seconds per million events of the agent, the checker and the NATS
//! servers, and the peak RSS of agent and checker, on a plain
//! `nats-server -js` (R1, file storage) or a three-node cluster (R3).
//!
//! Run: `cargo bench -p revenant --bench cluster_throughput -- [--events 1000000]
//!       [--batch-events 512] [--partitions 4] [--replicas 1|3] [--catch-up] [--receipts]`
//! (`REVENANT_BIN=path` runs another build of `revenant` under the same driver.)
//!
//! The events are the synthetic PD stream of `engine::workload` (ten events per attempt, one
//! attempt in 100 rejected), written to a file in the replay format before the clock starts and
//! replayed by the agent (`--replay`: it parses the file as it publishes, within the clock). The
//! clock runs from the agent's start until the checker's engine has observed every event
//! (`revenant_events_total`); the agent publishes and the checker consumes at the same time.
//! Also printed: when the agent had published everything, and when the checker had taken every
//! event off the bus (handed to its engine's channel, which holds up to 1024 batches).
//!
//! `--receipts`: every attempt also has the router's receipt of its request (request-level, so
//! sent to every partition): what broadcasting costs the bus at this partition count.
//!
//! `--catch-up`: the checker starts only once the agent has published everything, as after an
//! outage of the checker tier; the clock runs from the checker's start until its engine has
//! observed every event: how fast a checker works off a backlog.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use revenant::engine::workload::{self, Mix};
use test_harness::{Nats, Proc, ScratchDir, http_get, metric_sum, parse_metrics};

/// The `revenant` under test: `REVENANT_BIN`, else the one built with this bench.
fn bin() -> String {
    std::env::var("REVENANT_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_revenant").into())
}

struct Args {
    events: u64,
    batch_events: usize,
    partitions: u32,
    replicas: usize,
    catch_up: bool,
    receipts: bool,
}

fn args() -> Args {
    let mut a = Args {
        events: 1_000_000,
        batch_events: 512,
        partitions: 4,
        replicas: 1,
        catch_up: false,
        receipts: false,
    };
    let v: Vec<String> = std::env::args().collect();
    let mut i = 1;
    while i < v.len() {
        let next = v.get(i + 1).cloned().unwrap_or_default();
        match v[i].as_str() {
            "--events" => a.events = next.parse().expect("--events N"),
            "--batch-events" => a.batch_events = next.parse().expect("--batch-events N"),
            "--partitions" => a.partitions = next.parse().expect("--partitions N"),
            "--replicas" => a.replicas = next.parse().expect("--replicas 1|3"),
            "--catch-up" => {
                a.catch_up = true;
                i += 1;
                continue;
            }
            "--receipts" => {
                a.receipts = true;
                i += 1;
                continue;
            }
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    a
}

fn metric(admin: &str, name: &str) -> f64 {
    match http_get(&format!("http://{admin}/metrics")) {
        Ok((200, body)) => metric_sum(&parse_metrics(&body), name, &[]),
        _ => -1.0,
    }
}

fn start(name: &str, dir: &Path, mut c: Command) -> (Proc, String) {
    std::fs::create_dir_all(dir).unwrap();
    c.arg("--ready-file")
        .arg(dir.join("ready"))
        .arg("--spool-dir")
        .arg(dir.join("spool"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("stderr")).unwrap());
    let mut p = Proc::spawn(name, &mut c).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(t) = std::fs::read_to_string(dir.join("ready"))
            && let Ok(v) = serde_json::from_str::<serde_json::Value>(&t)
        {
            return (p, v["admin"].as_str().unwrap().to_owned());
        }
        assert!(p.exited().is_none(), "{name} exited");
        assert!(Instant::now() < deadline, "{name} not ready");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// utime + stime in seconds and peak RSS in MiB of a pid.
fn cpu_rss(pid: u32) -> (f64, f64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, r)| r.split_whitespace().collect())
        .unwrap_or_default();
    // SAFETY: sysconf has no preconditions.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let cpu = (ticks(11) + ticks(12)) / tick;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let hwm = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap_or(0.0);
    (cpu, hwm / 1024.0)
}

fn main() {
    let a = args();
    let nats = if a.replicas >= 3 {
        Nats::cluster3().unwrap()
    } else {
        Nats::single().unwrap()
    };
    let dir = ScratchDir::new("cluster-throughput").unwrap();
    let attempts = a.events / 10;
    let events = workload::stream(&Mix {
        attempts,
        receipts: a.receipts,
        spacing_ns: 10_000,
        ..Mix::default()
    });
    let n = events.len() as u64;
    let file = dir.path().join("events.jsonl");
    {
        use std::io::Write;
        let mut f = std::io::BufWriter::new(std::fs::File::create(&file).unwrap());
        for e in &events {
            serde_json::to_writer(
                &mut f,
                &revenant::ingest::replay::ReplayRecord::from_event(e),
            )
            .unwrap();
            f.write_all(b"\n").unwrap();
        }
    }
    drop(events);
    let common = |c: &mut Command| {
        c.args(["--nats", &nats.urls(), "--stream", "BENCH"])
            .args(["--partitions", &a.partitions.to_string()])
            .args(["--replicas", &a.replicas.to_string()])
            .args(["--batch-events", &a.batch_events.to_string()])
            .args(["--admin", "127.0.0.1:0", "--log-format", "json"]);
    };
    let checker_command = || {
        let mut c = Command::new(bin());
        c.arg("checker");
        common(&mut c);
        // Pinned to every partition: the throughput of one checker, with no lease to wait for.
        let all: Vec<String> = (0..a.partitions).map(|k| k.to_string()).collect();
        c.args(["--owned-partitions", &all.join(",")])
            .args(["--watermark-clock", "event", "--allowed-lateness", "1s"])
            .arg("--alerts-jsonl")
            .arg(dir.path().join("alerts.jsonl"));
        c
    };
    let mut early_checker =
        (!a.catch_up).then(|| start("checker", &dir.path().join("checker"), checker_command()));

    let mut c = Command::new(bin());
    c.arg("agent");
    common(&mut c);
    c.args([
        "--node",
        "bench",
        "--otlp-grpc",
        "off",
        "--otlp-http",
        "off",
    ])
    .args(["--ebpf", "off", "--replay"])
    .arg(&file);
    let nats_cpu = |nats: &Nats| -> f64 {
        nats.nodes
            .iter()
            .filter_map(|n| n.pid())
            .map(|pid| cpu_rss(pid).0)
            .sum()
    };
    let nats_cpu0 = nats_cpu(&nats);
    let mut t0 = Instant::now();
    let (mut agent, aadmin) = start("agent", &dir.path().join("agent"), c);
    let (mut checker, cadmin) = match early_checker.take() {
        Some(c) => c,
        None => {
            // The backlog: everything published before the checker starts.
            let deadline = t0 + Duration::from_secs(600);
            while metric(&aadmin, "revenant_agent_events_total") < n as f64
                || metric(&aadmin, "revenant_agent_outbox_batches") != 0.0
            {
                assert!(
                    Instant::now() < deadline,
                    "the agent did not publish everything"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            eprintln!(
                "cluster_throughput: {n} events published in {:.2} s; starting the checker",
                t0.elapsed().as_secs_f64()
            );
            t0 = Instant::now();
            start("checker", &dir.path().join("checker"), checker_command())
        }
    };
    let deadline = t0 + Duration::from_secs(600);
    let mut published_at = None;
    let mut taken_at = None;
    loop {
        let (taken, observed) = match http_get(&format!("http://{cadmin}/metrics")) {
            Ok((200, body)) => {
                let m = parse_metrics(&body);
                (
                    metric_sum(&m, "revenant_checker_bus_events_total", &[]),
                    metric_sum(&m, "revenant_events_total", &[]),
                )
            }
            _ => (-1.0, -1.0),
        };
        if published_at.is_none() && metric(&aadmin, "revenant_agent_events_total") >= n as f64 {
            let left = metric(&aadmin, "revenant_agent_outbox_batches");
            if left == 0.0 {
                published_at = Some(t0.elapsed());
            }
        }
        if taken_at.is_none() && taken >= n as f64 {
            taken_at = Some(t0.elapsed());
        }
        if observed >= n as f64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "checker took {taken} and observed {observed} of {n}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let observed = t0.elapsed();
    let (cpu_a, rss_a) = cpu_rss(agent.pid());
    let (cpu_c, rss_c) = cpu_rss(checker.pid());
    let cpu_n = nats_cpu(&nats) - nats_cpu0;
    // Request- and worker-level events go to every partition: what the stream carries over
    // what the agent routed is the broadcast's cost.
    let on_bus = metric(&aadmin, "revenant_agent_events_published_total");
    agent.stop(libc::SIGTERM, Duration::from_secs(30));
    checker.stop(libc::SIGTERM, Duration::from_secs(30));
    let published = published_at.unwrap_or(observed);
    let taken = taken_at.unwrap_or(observed);
    println!(
        "cluster_throughput: {n} events, R{} ({} partitions, {} events per batch){}",
        a.replicas,
        a.partitions,
        a.batch_events,
        if a.catch_up { ", catch-up" } else { "" }
    );
    println!(
        "  {} the checker's engine observed every event): {:.2} s, {:.0} events/s",
        if a.catch_up {
            "catch-up (checker start with every event waiting →"
        } else {
            "end to end (agent start →"
        },
        observed.as_secs_f64(),
        n as f64 / observed.as_secs_f64()
    );
    println!(
        "  checker took every event off the bus after {:.2} s ({:.0} events/s)",
        taken.as_secs_f64(),
        n as f64 / taken.as_secs_f64()
    );
    if !a.catch_up {
        println!(
            "  agent published everything after {:.2} s ({:.0} events/s)",
            published.as_secs_f64(),
            n as f64 / published.as_secs_f64()
        );
    }
    println!(
        "  events on the bus: {on_bus:.0} for {n} routed ({:.3}× with the broadcast copies)",
        on_bus / n as f64
    );
    println!(
        "  agent: {:.2} CPU s per million events, peak RSS {:.0} MiB",
        cpu_a / (n as f64 / 1e6),
        rss_a
    );
    println!(
        "  checker: {:.2} CPU s per million events, peak RSS {:.0} MiB",
        cpu_c / (n as f64 / 1e6),
        rss_c
    );
    println!(
        "  nats-server ({} of them): {:.2} CPU s per million events",
        nats.nodes.len(),
        cpu_n / (n as f64 / 1e6)
    );
}
