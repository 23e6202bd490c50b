//! Cluster mode's processes for the tests: `revenant agent`s and `revenant checker`s on a
//! loopback NATS (`test_harness::Nats`), each with its own directory (ready file, spool,
//! stderr as JSON lines, the checker's violations), and what their outputs are compared by.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use revenant::engine::rules::Scope;
use revenant::ingest::replay::ReplayRecord;
use revenant::{LifecycleEvent, RuleSet};
use test_harness::{Proc, http_get, metric_sum, parse_metrics, tail};

pub const BIN: &str = env!("CARGO_BIN_EXE_revenant");
/// Lateness for recorded events (checker and `check` alike): covers any arrival order.
pub const LATENESS: &str = "1h";
pub const WAIT: Duration = Duration::from_secs(60);

/// A violation's identity: rule and what broke it (attempt scope: room, else rid, and worker;
/// request scope: the request id), as in `scenarios.rs`.
pub type Key = (String, Option<u64>, Option<String>, Option<String>);

pub fn write(path: &Path, events: &[LifecycleEvent]) {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    for e in events {
        serde_json::to_writer(&mut f, &ReplayRecord::from_event(e)).unwrap();
        f.write_all(b"\n").unwrap();
    }
    f.flush().unwrap();
}

pub fn key(rules: &RuleSet, v: &serde_json::Value) -> Key {
    let rule = v["rule"].as_str().unwrap().to_string();
    let scope = rules
        .rules
        .iter()
        .find(|r| r.name == rule)
        .unwrap_or_else(|| panic!("unknown rule {rule}"))
        .scope;
    let s = |x: &serde_json::Value| x.as_str().map(str::to_owned);
    match scope {
        Scope::Attempt => {
            let room = s(&v["attempt"]["bootstrap_room"]).map(|r| r.parse::<u64>().unwrap());
            let rid = if room.is_some() {
                None
            } else {
                s(&v["attempt"]["rid"])
            };
            (rule, room, rid, s(&v["worker"]))
        }
        Scope::Request => (rule, None, None, s(&v["request"]["request_id"])),
    }
}

/// The identities of the violations in JSON lines, corroborating follow-ups left out, in order.
pub fn key_list(rules: &RuleSet, lines: &str) -> Vec<Key> {
    lines
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["corroborates"].as_bool() != Some(true))
        .map(|v| key(rules, &v))
        .collect()
}

pub fn keys(rules: &RuleSet, lines: &str) -> BTreeSet<Key> {
    key_list(rules, lines).into_iter().collect()
}

/// `revenant check --allowed-lateness 1h FILE`'s output.
pub fn check(file: &Path) -> String {
    let out = Command::new(BIN)
        .args(["check", "--allowed-lateness", LATENESS])
        .arg(file)
        .output()
        .unwrap();
    assert!(
        out.status.code().is_some_and(|c| c <= 1),
        "check {}: {}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Where the processes of one test meet.
#[derive(Clone)]
pub struct Bus {
    pub nats: String,
    pub stream: String,
    pub partitions: u32,
}

impl Bus {
    fn args(&self, c: &mut Command) {
        c.args(["--nats", &self.nats, "--stream", &self.stream])
            .args(["--partitions", &self.partitions.to_string()])
            .args(["--admin", "127.0.0.1:0", "--log-format", "json"]);
    }
}

/// One agent or checker.
pub struct Member {
    pub proc: Proc,
    pub admin: String,
    pub dir: PathBuf,
}

impl Member {
    fn start(name: &str, dir: &Path, mut c: Command) -> Member {
        std::fs::create_dir_all(dir).unwrap();
        let _ = std::fs::remove_file(dir.join("ready"));
        c.arg("--ready-file")
            .arg(dir.join("ready"))
            .arg("--spool-dir")
            .arg(dir.join("spool"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(dir.join("stderr"))
                    .unwrap(),
            );
        let mut proc = Proc::spawn(name, &mut c).unwrap();
        let deadline = Instant::now() + WAIT;
        let admin = loop {
            if let Ok(text) = std::fs::read_to_string(dir.join("ready"))
                && let Ok(v) = serde_json::from_str::<serde_json::Value>(&text)
            {
                break v["admin"].as_str().unwrap().to_owned();
            }
            if let Some(s) = proc.exited() {
                panic!(
                    "{name} exited ({s}) before ready:\n{}",
                    tail(&dir.join("stderr"), 30)
                );
            }
            assert!(Instant::now() < deadline, "{name} not ready");
            std::thread::sleep(Duration::from_millis(20));
        };
        Member {
            proc,
            admin,
            dir: dir.into(),
        }
    }

    /// `revenant checker` owning `owned`, judging on event time, violations to
    /// `violations.jsonl`, alerts to `alerts.jsonl`.
    pub fn checker(bus: &Bus, dir: &Path, owned: &[u32], extra: &[&str]) -> Member {
        let list: Vec<String> = owned.iter().map(u32::to_string).collect();
        let mut c = Command::new(BIN);
        c.arg("checker");
        bus.args(&mut c);
        c.args(["--owned-partitions", &list.join(",")])
            .args(["--watermark-clock", "event", "--allowed-lateness", LATENESS])
            .arg("--violations-jsonl")
            .arg(dir.join("violations.jsonl"))
            .arg("--alerts-jsonl")
            .arg(dir.join("alerts.jsonl"))
            .args(extra);
        Member::start(&format!("checker {}", dir.display()), dir, c)
    }

    /// `revenant checker` with no pin: it shares the stream's partitions with the other
    /// checkers through leases; judging on event time, violations to `violations.jsonl`,
    /// alerts to `alerts.jsonl`.
    pub fn checker_shared(bus: &Bus, dir: &Path, extra: &[&str]) -> Member {
        let mut c = Command::new(BIN);
        c.arg("checker");
        bus.args(&mut c);
        c.args(["--watermark-clock", "event", "--allowed-lateness", LATENESS])
            .arg("--violations-jsonl")
            .arg(dir.join("violations.jsonl"))
            .arg("--alerts-jsonl")
            .arg(dir.join("alerts.jsonl"))
            .args(extra);
        Member::start(&format!("checker {}", dir.display()), dir, c)
    }

    /// `revenant agent --node NODE` with no live source, publishing `replay` if given.
    pub fn agent(bus: &Bus, dir: &Path, node: &str, replay: Option<&Path>) -> Member {
        let mut c = Command::new(BIN);
        c.arg("agent");
        bus.args(&mut c);
        c.args(["--node", node])
            .args(["--otlp-grpc", "off", "--otlp-http", "off", "--ebpf", "off"])
            .args(["--batch-events", "16"]);
        if let Some(r) = replay {
            c.arg("--replay").arg(r);
        }
        Member::start(&format!("agent {}", dir.display()), dir, c)
    }

    /// An agent that publishes the `events` events of `file` and stops (its stop summary says
    /// how many batches it published).
    pub fn publish_file(bus: &Bus, dir: &Path, node: &str, file: &Path, events: usize) -> Member {
        let mut agent = Member::agent(bus, dir, node, Some(file));
        wait_metric(
            &format!("agent {node} routing {}", file.display()),
            &[&agent.admin],
            "revenant_agent_events_total",
            events as f64,
        );
        agent.stop();
        agent
    }

    /// `revenant agent --node NODE` taking OTLP/HTTP on an ephemeral port (no eBPF), with
    /// `extra` flags; returns it and the OTLP/HTTP address.
    pub fn agent_otlp(bus: &Bus, dir: &Path, node: &str, extra: &[&str]) -> (Member, String) {
        let mut c = Command::new(BIN);
        c.arg("agent");
        bus.args(&mut c);
        c.args(["--node", node])
            .args([
                "--otlp-grpc",
                "off",
                "--otlp-http",
                "127.0.0.1:0",
                "--ebpf",
                "off",
            ])
            .args(extra);
        let m = Member::start(&format!("agent {}", dir.display()), dir, c);
        let ready: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("ready")).unwrap()).unwrap();
        let otlp = ready["otlp_http"].as_str().unwrap().to_owned();
        (m, otlp)
    }

    pub fn metric(&self, name: &str) -> f64 {
        metric(&self.admin, name)
    }

    /// Panics, with the end of its log, if the process has exited.
    pub fn assert_alive(&mut self) {
        if let Some(s) = self.proc.exited() {
            panic!(
                "{} exited ({s}):\n{}",
                self.proc.name,
                tail(&self.dir.join("stderr"), 30)
            );
        }
    }

    /// SIGTERM, and the exit must be clean.
    pub fn stop(&mut self) {
        let status = self.proc.stop(libc::SIGTERM, WAIT);
        assert!(
            status.is_some_and(|s| s.success()),
            "{}: {status:?}\n{}",
            self.proc.name,
            tail(&self.dir.join("stderr"), 20)
        );
    }

    /// The stop summary's `batches_published` (an agent's, once stopped).
    pub fn published(&self) -> u64 {
        self.stopped_field("batches_published") as u64
    }

    /// A figure of the stop summary (once stopped).
    pub fn stopped_field(&self, name: &str) -> f64 {
        std::fs::read_to_string(self.dir.join("stderr"))
            .unwrap()
            .lines()
            .rev()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find_map(|v| v["fields"][name].as_f64())
            .unwrap_or_else(|| panic!("no {name} in the stop summary in {}", self.dir.display()))
    }

    /// What a checker wrote to `violations.jsonl`.
    pub fn violations(&self) -> String {
        std::fs::read_to_string(self.dir.join("violations.jsonl")).unwrap_or_default()
    }
}

pub fn metric(admin: &str, name: &str) -> f64 {
    match http_get(&format!("http://{admin}/metrics")) {
        Ok((200, body)) => metric_sum(&parse_metrics(&body), name, &[]),
        _ => -1.0,
    }
}

/// Waits until the checkers of `admins` have taken `batches` distinct batches between them:
/// messages received less those skipped as taken before. A batch redelivered after a broker
/// failover (its ack lost with the leader) counts once, so a count of messages alone can reach
/// the published number while a batch is still on its way.
pub fn wait_batches_taken(what: &str, admins: &[&str], batches: f64) {
    let deadline = Instant::now() + WAIT;
    loop {
        let taken: f64 = admins
            .iter()
            .map(|a| {
                metric(a, "revenant_checker_messages_total")
                    - metric(a, "revenant_checker_duplicate_batches_total")
            })
            .sum();
        if taken >= batches {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {taken} distinct batches taken, waited for {batches}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until `name` summed over `admins` reaches `at_least`.
pub fn wait_metric(what: &str, admins: &[&str], name: &str, at_least: f64) {
    let deadline = Instant::now() + WAIT;
    loop {
        let sum: f64 = admins.iter().map(|a| metric(a, name)).sum();
        if sum >= at_least {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {name} = {sum}, waited for {at_least}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The incidents notified in a checker's `alerts.jsonl` so far: (rule, incident key).
pub fn notified(path: &Path) -> Vec<(String, String)> {
    test_harness::read_jsonl_so_far(path)
        .into_iter()
        .filter(|n| n["type"] == "incident")
        .map(|n| {
            (
                n["rule"].as_str().unwrap().to_owned(),
                n["incident_key"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}
