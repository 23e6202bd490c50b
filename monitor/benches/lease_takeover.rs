//! Partition leases (`bus::lease`): how long a killed checker's partitions go unjudged, whether
//! any breach is missed or notified twice across the kills, and what the leases cost NATS.
//!
//! Run: `cargo bench -p revenant --bench lease_takeover -- [--kills 10] [--ttl 15s]
//!       [--partitions 6] [--checkers 3]`
//! (`REVENANT_BIN=path` runs another build of `revenant` under the same driver.)
//!
//! A plain `nats-server -js` on loopback and `--checkers` checkers sharing `--partitions`
//! through leases. The synthetic PD stream of `engine::workload` (one attempt in 5 rejected, so
//! breaches) is cut into `--kills` slices by event time. For each slice: an agent publishes it,
//! the checkers settle (nothing moving for a second: no notification between a sink and its
//! claim), one checker is killed with SIGKILL, and the clock runs until the live checkers own
//! every partition again (polled every 10 ms: the figure is the takeover time to within that);
//! then a replacement starts and the partitions spread again. At the end the checkers stop,
//! and every incident notified across all of them is compared with `revenant check` on the
//! whole stream: missed (expected, never notified) and twice (notified by two checkers or
//! lives). The lease cost is each checker's `revenant_checker_lease_requests_total` over its
//! life, per second.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use revenant::engine::workload::{self, Mix};
use revenant::{LifecycleEvent, Violation};
use test_harness::{Nats, Proc, ScratchDir, http_get, metric_sum, parse_metrics};

fn bin() -> String {
    std::env::var("REVENANT_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_revenant").into())
}

struct Args {
    kills: usize,
    ttl: Duration,
    partitions: u32,
    checkers: usize,
}

fn args() -> Args {
    let mut a = Args {
        kills: 10,
        ttl: Duration::from_secs(15),
        partitions: 6,
        checkers: 3,
    };
    let v: Vec<String> = std::env::args().collect();
    let mut i = 1;
    while i < v.len() {
        let next = v.get(i + 1).cloned().unwrap_or_default();
        match v[i].as_str() {
            "--kills" => a.kills = next.parse().expect("--kills N"),
            "--ttl" => a.ttl = humantime::parse_duration(&next).expect("--ttl DURATION"),
            "--partitions" => a.partitions = next.parse().expect("--partitions N"),
            "--checkers" => a.checkers = next.parse().expect("--checkers N"),
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

struct Member {
    proc: Proc,
    admin: String,
    dir: PathBuf,
    started: Instant,
}

fn start(name: &str, dir: &Path, mut c: Command) -> Member {
    std::fs::create_dir_all(dir).unwrap();
    c.arg("--ready-file")
        .arg(dir.join("ready"))
        .arg("--spool-dir")
        .arg(dir.join("spool"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("stderr")).unwrap());
    let started = Instant::now();
    let mut p = Proc::spawn(name, &mut c).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(t) = std::fs::read_to_string(dir.join("ready"))
            && let Ok(v) = serde_json::from_str::<serde_json::Value>(&t)
        {
            return Member {
                proc: p,
                admin: v["admin"].as_str().unwrap().to_owned(),
                dir: dir.into(),
                started,
            };
        }
        assert!(p.exited().is_none(), "{name} exited");
        assert!(Instant::now() < deadline, "{name} not ready");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn write(path: &Path, events: &[LifecycleEvent]) {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    for e in events {
        serde_json::to_writer(
            &mut f,
            &revenant::ingest::replay::ReplayRecord::from_event(e),
        )
        .unwrap();
        f.write_all(b"\n").unwrap();
    }
    f.flush().unwrap();
}

fn settled(m: &Member) {
    let names = [
        "revenant_events_total",
        "revenant_alerts_received_total",
        "revenant_checker_notification_claims_total",
        "revenant_alert_delivered_notifications_total",
        "revenant_spool_entries",
    ];
    let read = || {
        names
            .iter()
            .map(|n| metric(&m.admin, n))
            .collect::<Vec<f64>>()
    };
    let mut last = read();
    let mut since = Instant::now();
    wait_for("a checker to settle", Duration::from_secs(120), || {
        let now = read();
        if now != last {
            last = now;
            since = Instant::now();
        }
        since.elapsed() >= Duration::from_secs(1)
    });
}

fn pct(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    // `cargo test --all-targets` runs bench binaries without `--bench`: no measurement there
    // (the takeover guarantees themselves are tested in tests/cluster_leases.rs).
    if !std::env::args().any(|a| a == "--bench") {
        println!("lease_takeover: run with `cargo bench -p revenant --bench lease_takeover`");
        return;
    }
    let a = args();
    let nats = Nats::single().expect("nats-server -js (cargo xtask setup)");
    let dir = ScratchDir::new("bench-lease-takeover").unwrap();
    let mut events = workload::stream(&Mix {
        attempts: 400 * a.kills as u64,
        reject_every: 5,
        spacing_ns: 300_000,
        ..Mix::default()
    });
    events.sort_by_key(|e| e.time_ns);
    let ttl = format!("{}ms", a.ttl.as_millis());
    let bus = |c: &mut Command| {
        c.args(["--nats", &nats.urls(), "--stream", "LEASEBENCH"])
            .args(["--partitions", &a.partitions.to_string()])
            .args(["--admin", "127.0.0.1:0", "--log-format", "json"]);
    };
    let mut lives = 0usize;
    let mut checker = || {
        lives += 1;
        let d = dir.path().join(format!("checker-{lives}"));
        let mut c = Command::new(bin());
        c.arg("checker");
        bus(&mut c);
        c.args(["--watermark-clock", "event", "--allowed-lateness", "1h"])
            .args([
                "--lease-ttl",
                &ttl,
                "--group-wait",
                "0s",
                "--rate-limit",
                "0",
            ])
            .arg("--alerts-jsonl")
            .arg(d.join("alerts.jsonl"));
        start(&format!("checker {lives}"), &d, c)
    };
    let owned_by = |live: &[Member]| -> Vec<f64> {
        live.iter()
            .map(|m| metric(&m.admin, "revenant_checker_owned_partitions"))
            .collect()
    };
    let spread = |live: &[Member]| {
        let o = owned_by(live);
        let (lo, hi) = (
            o.iter().copied().fold(f64::MAX, f64::min),
            o.iter().copied().fold(0.0, f64::max),
        );
        o.iter().sum::<f64>() == f64::from(a.partitions) && hi - lo <= 1.0
    };
    let mut live: Vec<Member> = (0..a.checkers).map(|_| checker()).collect();
    wait_for("the first spread", a.ttl * 4, || spread(&live));
    let mut alert_files: Vec<PathBuf> = live.iter().map(|m| m.dir.join("alerts.jsonl")).collect();
    let n = events.len();
    let mut takeovers = Vec::new();
    let mut lease_rates = Vec::new();
    for i in 0..a.kills {
        let slice: Vec<LifecycleEvent> = events[i * n / a.kills..(i + 1) * n / a.kills].to_vec();
        let file = dir.path().join(format!("slice-{i}.jsonl"));
        write(&file, &slice);
        let d = dir.path().join(format!("agent-{i}"));
        let mut c = Command::new(bin());
        c.arg("agent");
        bus(&mut c);
        c.args(["--node", &format!("node-{i}")])
            .args(["--otlp-grpc", "off", "--otlp-http", "off", "--ebpf", "off"])
            .arg("--replay")
            .arg(&file);
        let mut agent = start(&format!("agent {i}"), &d, c);
        wait_for(
            "the agent routing its slice",
            Duration::from_secs(60),
            || metric(&agent.admin, "revenant_agent_events_total") >= slice.len() as f64,
        );
        agent.proc.stop(libc::SIGTERM, Duration::from_secs(30));
        for m in &live {
            settled(m);
        }
        let victim = live.remove(i % live.len());
        let life = victim.started.elapsed().as_secs_f64();
        lease_rates.push(metric(&victim.admin, "revenant_checker_lease_requests_total") / life);
        let mut victim = victim;
        let killed = Instant::now();
        victim.proc.stop(libc::SIGKILL, Duration::ZERO);
        wait_for("the takeover", a.ttl * 3, || {
            owned_by(&live).iter().sum::<f64>() == f64::from(a.partitions)
        });
        let took = killed.elapsed().as_secs_f64();
        takeovers.push(took);
        eprintln!("kill {}: partitions taken after {took:.2} s", i + 1);
        let fresh = checker();
        alert_files.push(fresh.dir.join("alerts.jsonl"));
        live.push(fresh);
        wait_for("the spread after the replacement", a.ttl * 4, || {
            spread(&live)
        });
    }
    for m in &live {
        let life = m.started.elapsed().as_secs_f64();
        lease_rates.push(metric(&m.admin, "revenant_checker_lease_requests_total") / life);
    }
    for m in &live {
        // SAFETY: a signal to a child this bench started and has not reaped.
        unsafe { libc::kill(m.proc.pid() as i32, libc::SIGTERM) };
    }
    for m in &mut live {
        wait_for("a checker's exit", Duration::from_secs(60), || {
            m.proc.exited().is_some()
        });
    }

    let merged = dir.path().join("merged.jsonl");
    write(&merged, &events);
    let out = Command::new(bin())
        .args(["check", "--allowed-lateness", "1h"])
        .arg(&merged)
        .output()
        .unwrap();
    let expected: BTreeSet<(String, String)> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str::<Violation>(l).unwrap())
        .filter(|v| !v.corroborates)
        .map(|v| {
            let key = revenant::alert::notification::incident_alias(&v);
            (v.rule, key)
        })
        .collect();
    let mut counts: BTreeMap<(String, String), usize> = BTreeMap::new();
    for f in &alert_files {
        for l in std::fs::read_to_string(f).unwrap_or_default().lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(l) else {
                continue;
            };
            if v["type"] == "incident" {
                let k = (
                    v["rule"].as_str().unwrap_or_default().to_owned(),
                    v["incident_key"].as_str().unwrap_or_default().to_owned(),
                );
                *counts.entry(k).or_default() += 1;
            }
        }
    }
    let missed = expected.iter().filter(|k| !counts.contains_key(*k)).count();
    let twice = counts.values().filter(|c| **c > 1).count();
    let extra = counts.keys().filter(|k| !expected.contains(*k)).count();
    println!(
        "lease_takeover: {} kills, TTL {:?}, {} partitions over {} checkers",
        a.kills, a.ttl, a.partitions, a.checkers
    );
    println!(
        "  takeover after SIGKILL: p50 {:.2} s, max {:.2} s (min {:.2} s)",
        pct(&takeovers, 0.5),
        pct(&takeovers, 1.0),
        pct(&takeovers, 0.0)
    );
    println!(
        "  breaches: {} expected, {missed} missed, {twice} notified twice, {extra} not expected",
        expected.len()
    );
    println!(
        "  lease requests per second per checker: p50 {:.2}, max {:.2}",
        pct(&lease_rates, 0.5),
        pct(&lease_rates, 1.0)
    );
}
