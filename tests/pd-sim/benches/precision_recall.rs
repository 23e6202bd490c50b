//! Precision and recall of the default rules, end to end: routers × decode behaviour × witness.
//!
//! Each row runs a fresh `pd-sim` cluster (its own router mode, or the real `smg` of
//! sglang-router 0.3.2 / smg 1.13.0 in front of `pd-sim cluster --no-router`) and a fresh
//! `revenant run` (release builds) seeing it through eBPF alone, OTLP alone, or both, under
//! `pd-sim load` with a quarter of the prompts over prefill's capacity.
//!
//! The oracle is the README's advancement model, per row:
//! - `correct`, `concurrent-cancel` and smg 1.13.0 with decode honouring the cancel: no
//!   attempt is a breach;
//! - `concurrent-no-cancel`, sglang-router 0.3.2 (the decode leg is never withdrawn),
//!   `handoff-after-reject` (the rejected room is transferred and decoded), and every row whose
//!   decode ignores the cancel: every prefill-refused attempt whose decode leg reached decode.
//!
//! Counted from the simulator's own records (`/sim/rooms` of prefill and decode) and revenant's
//! `/api/violations` (every violation, not deduplicated) and alerts file (incident
//! notifications). A false alert is a violation on an attempt that is not a breach.
//!
//! ```text
//! cargo build --release -p revenant -p pd-sim
//! [PD_SIM_SMG=target/xtask-venv/bin/smg PD_SIM_SMG113=target/xtask-venv-smg113/bin/smg] \
//!   cargo bench -p pd-sim --bench precision_recall -- [--requests 1000] [--rate 200] [--rows FILTER]
//! ```
//! eBPF rows need root; without it they are skipped with a line saying so. revenant runs with
//! `--allowed-lateness 2s` (one node) so that deadline verdicts are read seconds after the load.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pd_sim::harness::{SmgProcess, write_tiny_model};
use serde_json::Value;
use test_harness::{Binaries, Cluster, Revenant, ScratchDir, http_json};

struct Opts {
    requests: u64,
    rate: u64,
    rows: Option<String>,
}

fn opts() -> Opts {
    let mut o = Opts {
        requests: 1000,
        rate: 200,
        rows: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--requests" => o.requests = val().parse().expect("--requests: a number"),
            "--rate" => o.rate = val().parse().expect("--rate: a number"),
            "--rows" => o.rows = Some(val()),
            // `cargo bench` passes `--bench`; ignore it and anything else libtest-like.
            _ => {}
        }
    }
    o
}

#[derive(Clone, Copy, PartialEq)]
enum Router {
    Sim(&'static str),
    /// The real `smg` binary named by this environment variable.
    Real(&'static str, &'static str),
}

#[derive(Clone, Copy, PartialEq)]
enum Witness {
    Ebpf,
    Otlp,
    Both,
}

impl Witness {
    fn name(self) -> &'static str {
        match self {
            Witness::Ebpf => "eBPF",
            Witness::Otlp => "OTLP",
            Witness::Both => "both",
        }
    }
}

struct Row {
    router: Router,
    ignores_cancel: bool,
    witness: Witness,
}

impl Row {
    fn router_name(&self) -> String {
        match self.router {
            Router::Sim(m) => format!("pd-sim {m}"),
            Router::Real(_, what) => what.to_string(),
        }
    }

    fn label(&self) -> String {
        format!(
            "{} / decode {} / {}",
            self.router_name(),
            if self.ignores_cancel {
                "ignores cancel"
            } else {
                "honours cancel"
            },
            self.witness.name()
        )
    }

    /// Whether a prefill-refused attempt that reached decode is a breach here.
    fn refusals_are_breaches(&self) -> bool {
        self.ignores_cancel
            || matches!(
                self.router,
                Router::Sim("concurrent-no-cancel" | "handoff-after-reject")
                    | Router::Real("PD_SIM_SMG", _)
            )
    }
}

struct Counts {
    requests: u64,
    refused: usize,
    breaches: usize,
    caught: usize,
    false_alerts: usize,
    notifications: usize,
    per_rule: BTreeMap<String, u64>,
    wall_s: f64,
}

fn rooms(url: &str) -> Vec<Value> {
    match http_json(&format!("{url}/sim/rooms")).expect("/sim/rooms") {
        Value::Array(a) => a,
        other => panic!("/sim/rooms: {other}"),
    }
}

fn run_row(o: &Opts, row: &Row, bins: &Binaries) -> Result<Counts, String> {
    let t0 = Instant::now();
    let smg = match row.router {
        Router::Real(var, what) => match std::env::var_os(var) {
            Some(p) => Some(PathBuf::from(p)),
            None => return Err(format!("{var} not set (the `smg` of {what})")),
        },
        Router::Sim(_) => None,
    };
    let ebpf = row.witness != Witness::Otlp;
    if ebpf && !test_harness::is_root() {
        return Err("eBPF needs root".into());
    }
    let scratch = ScratchDir::new("precision").map_err(|e| e.to_string())?;
    let mut args: Vec<String> = [
        "--admin",
        "127.0.0.1:0",
        "--rate-limit",
        "0",
        "--spool-no-fsync",
        // Every violation of the run stays readable on /api/violations.
        "--recent-violations",
        "100000",
        // One node: events arrive within milliseconds. With `run`'s default of 15 s, deadline
        // verdicts (orphaned-leg) come that much later, and are the same.
        "--allowed-lateness",
        "2s",
        "--ebpf",
        if ebpf { "on" } else { "off" },
    ]
    .map(String::from)
    .to_vec();
    let otlp = row.witness != Witness::Ebpf;
    // OTLP rows need revenant's address before the cluster starts; eBPF needs the pids after.
    let mut cluster_args: Vec<String> = Vec::new();
    match row.router {
        Router::Sim(mode) => cluster_args.extend(["--mode".into(), mode.into()]),
        Router::Real(..) => cluster_args.push("--no-router".into()),
    }
    if row.ignores_cancel {
        cluster_args.extend(["--decode-args".into(), "--decode-ignores-cancel".into()]);
    }
    let start_cluster = |extra: &[String]| {
        let mut a = cluster_args.clone();
        a.extend_from_slice(extra);
        Cluster::start(&bins.pd_sim, &a, None).map_err(|e| format!("cluster: {e:#}"))
    };
    // Spans first need revenant's receiver; probes first need the processes' pids.
    let (mut rev, cluster, smg_proc);
    let model = scratch.path().join("model");
    if otlp {
        let mut a = args.clone();
        if !ebpf {
            rev = Revenant::start(&bins.revenant, scratch.path(), &a)
                .map_err(|e| format!("revenant: {e:#}"))?;
            let endpoint = format!("http://{}", rev.otlp_http);
            cluster = start_cluster(&["--otlp-endpoint".into(), endpoint])?;
            smg_proc = match &smg {
                Some(bin) => Some(start_smg(
                    bin,
                    &cluster,
                    &model,
                    Some(&rev.otlp_grpc),
                    scratch.path(),
                )?),
                None => None,
            };
        } else {
            // Both: the workers export to fixed ports revenant then binds.
            let port = || test_harness::free_port().map_err(|e| format!("{e:#}"));
            let grpc = format!("127.0.0.1:{}", port()?);
            let http = format!("127.0.0.1:{}", port()?);
            cluster = start_cluster(&["--otlp-endpoint".into(), format!("http://{http}")])?;
            smg_proc = match &smg {
                Some(bin) => Some(start_smg(
                    bin,
                    &cluster,
                    &model,
                    Some(&grpc),
                    scratch.path(),
                )?),
                None => None,
            };
            a.extend(["--otlp-grpc".into(), grpc, "--otlp-http".into(), http]);
            a.extend(pid_args(&cluster, smg_proc.as_ref()));
            rev = Revenant::start(&bins.revenant, scratch.path(), &a)
                .map_err(|e| format!("revenant: {e:#}"))?;
        }
    } else {
        cluster = start_cluster(&[])?;
        smg_proc = match &smg {
            Some(bin) => Some(start_smg(bin, &cluster, &model, None, scratch.path())?),
            None => None,
        };
        args.extend(pid_args(&cluster, smg_proc.as_ref()));
        rev = Revenant::start(&bins.revenant, scratch.path(), &args)
            .map_err(|e| format!("revenant: {e:#}"))?;
    }
    if ebpf && rev.ready["ebpf"] != "live" {
        return Err(format!("eBPF source not live: {}", rev.ready));
    }
    let router_url = smg_proc
        .as_ref()
        .map_or(cluster.router.clone(), |s| s.url.clone());
    let load = test_harness::run_load_quiet(
        &bins.pd_sim,
        &router_url,
        &[
            "--rate",
            &o.rate.to_string(),
            "--requests",
            &o.requests.to_string(),
            "--over-capacity-share",
            "0.25",
            "--request-id-prefix",
            "pr",
        ],
        Duration::from_secs(600),
    )
    .map_err(|e| format!("load: {e:#}"))?;
    // Every leg ends (a decode ignoring the cancel waits its KV timeout), then every window
    // and group wait passes.
    rev.wait_quiet(Duration::from_secs(4), Duration::from_secs(120), None)
        .map_err(|e| format!("{e:#}"))?;
    let prefill = rooms(&cluster.prefill);
    let decode: BTreeSet<u64> = rooms(&cluster.decode)
        .iter()
        .filter(|r| r["received_ns"].as_u64().unwrap_or(0) > 0)
        .filter_map(|r| r["room"].as_u64())
        .collect();
    let refused: BTreeSet<u64> = prefill
        .iter()
        .filter(|r| r["status"].as_u64().unwrap_or(0) >= 400)
        .filter_map(|r| r["room"].as_u64())
        .collect();
    let breaches: BTreeSet<u64> = if row.refusals_are_breaches() {
        refused.intersection(&decode).copied().collect()
    } else {
        BTreeSet::new()
    };
    // A request-scope violation may name its request only: it is about a breach when that
    // request holds one.
    let breached_requests: BTreeSet<&str> = prefill
        .iter()
        .filter(|r| r["room"].as_u64().is_some_and(|x| breaches.contains(&x)))
        .filter_map(|r| r["request_id"].as_str())
        .collect();
    let (_, v) = rev
        .admin_json("/api/violations?limit=10000")
        .map_err(|e| format!("{e:#}"))?;
    let violations = v["violations"].as_array().cloned().unwrap_or_default();
    let mut per_rule = BTreeMap::new();
    let mut flagged = BTreeSet::new();
    let mut false_alerts = 0;
    for x in &violations {
        *per_rule
            .entry(x["rule"].as_str().unwrap_or("?").to_string())
            .or_insert(0) += 1;
        // Rooms are decimal strings or numbers, depending on the output schema.
        let room = match &x["attempt"]["bootstrap_room"] {
            Value::String(s) => s.parse::<u64>().ok(),
            v => v.as_u64(),
        };
        let request = x["request"]["request_id"].as_str();
        match room {
            Some(r) if breaches.contains(&r) => {
                flagged.insert(r);
            }
            None if request.is_some_and(|q| breached_requests.contains(q)) => {}
            _ => false_alerts += 1,
        }
    }
    rev.stop_log().map_err(|e| format!("{e:#}"))?;
    let notifications = rev
        .notifications()
        .map_err(|e| format!("{e:#}"))?
        .iter()
        .filter(|n| n["type"] == "incident")
        .count();
    drop(smg_proc);
    Ok(Counts {
        requests: load["sent"].as_u64().unwrap_or(0),
        refused: refused.len(),
        breaches: breaches.len(),
        caught: flagged.len(),
        false_alerts,
        notifications,
        per_rule,
        wall_s: t0.elapsed().as_secs_f64(),
    })
}

fn pid_args(cluster: &Cluster, smg: Option<&SmgProcess>) -> Vec<String> {
    match smg {
        // The real router replaces the simulator's: watch it and the two workers.
        Some(s) => cluster
            .pid_args()
            .chunks(2)
            .filter(|p| !p[1].starts_with("router="))
            .flatten()
            .cloned()
            .chain(["--pid".to_string(), format!("router={}", s.pid())])
            .collect(),
        None => cluster.pid_args(),
    }
}

fn start_smg(
    bin: &Path,
    cluster: &Cluster,
    model: &Path,
    otlp_grpc: Option<&str>,
    dir: &Path,
) -> Result<SmgProcess, String> {
    if !model.exists() {
        write_tiny_model(model).map_err(|e| format!("model: {e:#}"))?;
    }
    SmgProcess::start(
        bin,
        cluster,
        model,
        otlp_grpc,
        &dir.join("smg.log"),
        &["--retry-initial-backoff-ms", "10"],
    )
    .map_err(|e| format!("smg: {e:#}"))
}

fn main() {
    // `cargo test --all-targets` runs bench binaries without `--bench`: it must not start a
    // minutes-long measurement there.
    if !std::env::args().any(|a| a == "--bench") {
        println!("precision_recall: run with `cargo bench -p pd-sim --bench precision_recall`");
        return;
    }
    let o = opts();
    let bins = Binaries::build(true).expect("release builds of revenant and pd-sim");
    let mut rows = Vec::new();
    let routers = [
        Router::Sim("correct"),
        Router::Sim("concurrent-cancel"),
        Router::Sim("concurrent-no-cancel"),
        Router::Sim("handoff-after-reject"),
        Router::Real("PD_SIM_SMG113", "smg 1.13.0"),
        Router::Real("PD_SIM_SMG", "sglang-router 0.3.2"),
    ];
    for router in routers {
        let withdraws = matches!(
            router,
            Router::Sim("concurrent-cancel") | Router::Real("PD_SIM_SMG113", _)
        );
        for ignores_cancel in [false, true] {
            if ignores_cancel && !withdraws {
                continue;
            }
            for witness in [Witness::Ebpf, Witness::Otlp, Witness::Both] {
                rows.push(Row {
                    router,
                    ignores_cancel,
                    witness,
                });
            }
        }
    }
    println!(
        "| router | decode | witness | requests | refused attempts | breaches | caught | false alerts | notifications | recall | rules | wall |"
    );
    println!("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |");
    for row in &rows {
        if o.rows
            .as_ref()
            .is_some_and(|f| !row.label().contains(f.as_str()))
        {
            continue;
        }
        match run_row(&o, row, &bins) {
            Ok(c) => {
                let recall = if c.breaches == 0 {
                    "—".to_string()
                } else {
                    format!("{:.1} %", 100.0 * c.caught as f64 / c.breaches as f64)
                };
                println!(
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:?} | {:.0} s |",
                    row.router_name(),
                    if row.ignores_cancel {
                        "ignores cancel"
                    } else {
                        "honours cancel"
                    },
                    row.witness.name(),
                    c.requests,
                    c.refused,
                    c.breaches,
                    c.caught,
                    c.false_alerts,
                    c.notifications,
                    recall,
                    c.per_rule,
                    c.wall_s
                );
            }
            Err(e) => println!("| {} | skipped: {e} |", row.label()),
        }
    }
}
