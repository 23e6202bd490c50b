//! Detection latency, end to end: a pd-sim cluster whose router hands rejected requests to
//! decode anyway (`handoff-after-reject`), exporting SGLang-shaped spans to a real
//! `revenant run` (release build, OTLP only), under open-loop load from `pd-sim load`.
//!
//! Latency of one alert = the time this bench's webhook receiver got the POST carrying the
//! notification − the offending event's own time (`evidence[role=offender].time_ns`: the end
//! of the decode span that shows activity after the rejection). Both clocks are this machine's
//! CLOCK_REALTIME. The spans' export delay (pd-sim's batch linger) is part of the figure and is
//! set with `--otlp-linger-ms` (exported to the workers as `PD_SIM_OTLP_LINGER_MS`).
//!
//! A second run per rate with the `correct` router and the same load counts false positives
//! (every violation revenant reports there is one). revenant's CPU time comes from
//! /proc/PID/stat (utime+stime), its peak RSS from VmHWM in /proc/PID/status.
//!
//! `--deploy cluster` puts cluster mode in `run`'s place: a `nats-server -js` (R1), one
//! `revenant agent` taking the spans (or watching the processes) and one `revenant checker`
//! owning every partition and posting to the webhook; CPU and peak RSS are reported per process
//! (agent, checker, nats-server). `--deploy both` runs `run` then the cluster at each rate, so
//! the two are compared in one sitting.
//!
//! ```text
//! cargo build --release -p revenant -p pd-sim
//! cargo bench -p pd-sim --bench detection_latency -- [--rates 1000,10000] [--seconds 10]
//!     [--otlp-linger-ms 20] [--over-capacity-share 0.02] [--skip-clean] [--source otlp|ebpf]
//!     [--flavour sglang|vllm] [--deploy run|cluster|both]
//! ```
//!
//! `--flavour vllm`: the simulator's vLLM workers behind its vllm-router-shaped router
//! (sequential legs; in `handoff-after-reject` a prefill 400 still goes to decode, which computes
//! it itself), `pd-sim load --api openai`; the offending event is decode's work on the rejected
//! request.
//!
//! ```text
//! ```

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pd_sim::ids::now_ns;
use serde_json::Value;
use test_harness::{Cluster, Revenant, ScratchDir};

struct Opts {
    rates: Vec<u64>,
    seconds: u64,
    linger_ms: u64,
    over_capacity_share: f64,
    skip_clean: bool,
    /// `otlp`: spans from every pd-sim process, revenant `--ebpf off`; `ebpf`: no spans,
    /// revenant `--ebpf on --pid ROLE=PID` for the three processes (needs root).
    source: String,
    /// `sglang` or `vllm` (`pd-sim cluster --flavour vllm`, `load --api openai`).
    flavour: String,
    /// Which deployments to measure, in order.
    deploys: Vec<Deploy>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Deploy {
    /// `revenant run`.
    Run,
    /// `nats-server -js`, `revenant agent`, `revenant checker`.
    Cluster,
}

fn opts() -> Opts {
    let mut o = Opts {
        rates: vec![1000, 10000],
        seconds: 10,
        linger_ms: 20,
        over_capacity_share: 0.02,
        skip_clean: false,
        source: "otlp".into(),
        flavour: "sglang".into(),
        deploys: vec![Deploy::Run],
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--rates" => {
                o.rates = val()
                    .split(',')
                    .map(|r| r.parse().expect("--rates: numbers"))
                    .collect()
            }
            "--seconds" => o.seconds = val().parse().expect("--seconds"),
            "--otlp-linger-ms" => o.linger_ms = val().parse().expect("--otlp-linger-ms"),
            "--over-capacity-share" => {
                o.over_capacity_share = val().parse().expect("--over-capacity-share")
            }
            "--skip-clean" => o.skip_clean = true,
            "--source" => o.source = val(),
            "--flavour" => o.flavour = val(),
            "--deploy" => {
                o.deploys = match val().as_str() {
                    "run" => vec![Deploy::Run],
                    "cluster" => vec![Deploy::Cluster],
                    "both" => vec![Deploy::Run, Deploy::Cluster],
                    other => panic!("--deploy run|cluster|both, not {other}"),
                }
            }
            // `cargo bench` passes `--bench`; ignore it and anything else libtest-like.
            _ => {}
        }
    }
    o
}

/// Webhook POSTs as they arrive: (receive time, body).
type Received = Arc<Mutex<Vec<(u64, Value)>>>;

fn start_webhook(rt: &tokio::runtime::Runtime) -> (String, Received) {
    let got: Received = Arc::default();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind webhook receiver");
    let addr = listener.local_addr().unwrap();
    let g = got.clone();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |body: axum::body::Bytes| {
            let t = now_ns();
            let g = g.clone();
            async move {
                if let Ok(v) = serde_json::from_slice::<Value>(&body) {
                    g.lock().unwrap().push((t, v));
                }
                "ok"
            }
        }),
    );
    rt.spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (format!("http://{addr}/hook"), got)
}

fn proc_cpu_s(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the parenthesised comm: state is field 3, utime 14, stime 15.
    let rest = s.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (ticks(11) + ticks(12)) / hz
}

fn proc_hwm_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// CPU seconds and peak RSS of one process over a run.
#[derive(Default)]
struct Cost {
    cpu_s: f64,
    hwm_mib: f64,
}

/// The processes of one deployment: the one whose admin API holds the violations and posts the
/// webhook (`run`, or the checker), the one the telemetry reaches (`run` again, or the agent),
/// and what else runs (the cluster's NATS, the agent).
struct Deployed {
    judge: Revenant,
    agent: Option<Revenant>,
    nats: Option<test_harness::Nats>,
}

impl Deployed {
    fn start(
        deploy: Deploy,
        bin: &Path,
        dir: &Path,
        common: &[String],
        ingest: &[String],
    ) -> Deployed {
        let within = Duration::from_secs(60);
        match deploy {
            Deploy::Run => {
                let all: Vec<String> = [common, ingest].concat();
                Deployed {
                    judge: Revenant::start(bin, dir, &all)
                        .unwrap_or_else(|e| panic!("revenant: {e}")),
                    agent: None,
                    nats: None,
                }
            }
            Deploy::Cluster => {
                let nats = test_harness::Nats::single().unwrap_or_else(|e| panic!("nats: {e}"));
                let bus = [
                    "--nats".to_string(),
                    nats.urls(),
                    "--stream".into(),
                    "DL".into(),
                ];
                let (checker_dir, agent_dir) = (dir.join("checker"), dir.join("agent"));
                for d in [&checker_dir, &agent_dir] {
                    std::fs::create_dir_all(d).unwrap();
                }
                let judge = Revenant::start_subcommand(
                    bin,
                    "checker",
                    &checker_dir,
                    &[common, &bus].concat(),
                    within,
                )
                .unwrap_or_else(|e| panic!("revenant checker: {e}"));
                let node = ["--node".to_string(), "bench-node".into()];
                let agent = Revenant::start_subcommand(
                    bin,
                    "agent",
                    &agent_dir,
                    &[&bus[..], &node, ingest].concat(),
                    within,
                )
                .unwrap_or_else(|e| panic!("revenant agent: {e}"));
                Deployed {
                    judge,
                    agent: Some(agent),
                    nats: Some(nats),
                }
            }
        }
    }

    /// Where the telemetry goes.
    fn receiver(&self) -> &Revenant {
        self.agent.as_ref().unwrap_or(&self.judge)
    }

    fn pids(&self) -> [Option<u32>; 3] {
        [
            Some(self.judge.pid()),
            self.agent.as_ref().map(Revenant::pid),
            self.nats.as_ref().and_then(|n| n.nodes[0].pid()),
        ]
    }
}

struct RunResult {
    deploy: Deploy,
    mode: &'static str,
    target_rate: u64,
    load: Value,
    expected: u64,
    violations_seen: u64,
    notifications: usize,
    latencies_ms: Vec<f64>,
    internal_ms: Vec<f64>,
    /// `run` or the checker; the agent; nats-server.
    costs: [Option<Cost>; 3],
    wall_s: f64,
    rules: std::collections::BTreeMap<String, u64>,
    otlp_dropped: u64,
    /// `revenant_dropped_items_total`, every reason.
    revenant_dropped: u64,
}

fn stat(url: &str) -> Value {
    let (_, b) = test_harness::http_get(&format!("{url}/sim/stats")).expect("/sim/stats");
    serde_json::from_str(&b).expect("stats json")
}

fn one_run(
    o: &Opts,
    deploy: Deploy,
    mode: &'static str,
    rate: u64,
    revenant_bin: &Path,
    pd_sim: &Path,
    rt: &tokio::runtime::Runtime,
) -> RunResult {
    let scratch = ScratchDir::new("detect-bench").unwrap();
    let (hook, got) = start_webhook(rt);
    let common: Vec<String> = [
        "--admin",
        "127.0.0.1:0",
        "--rate-limit",
        "0",
        // Detection latency, not the group wait's (which adds up to its length to each first
        // notification): one notification per rule and request, sent at once.
        "--group-wait",
        "0",
        "--spool-no-fsync",
        "--webhook",
        &hook,
        "--log-format",
        "json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    // SAFETY: the bench is single-threaded apart from the webhook runtime, which reads no env.
    unsafe { std::env::set_var("PD_SIM_OTLP_LINGER_MS", o.linger_ms.to_string()) };
    let (deployed, cluster) = if o.source == "ebpf" {
        // The kernel side watches the processes, so they start first (no span export).
        let cluster = Cluster::start(pd_sim, &["--flavour", &o.flavour, "--mode", mode], None)
            .unwrap_or_else(|e| panic!("cluster: {e}"));
        let mut ingest = vec!["--ebpf".to_string(), "on".to_string()];
        for role in ["router", "prefill", "decode"] {
            let pid = cluster.ready["pids"][role].as_u64().expect("pid");
            ingest.extend(["--pid".to_string(), format!("{role}={pid}")]);
        }
        let d = Deployed::start(deploy, revenant_bin, scratch.path(), &common, &ingest);
        assert_eq!(
            d.receiver().ready["ebpf"],
            "live",
            "eBPF source not live: {}",
            d.receiver().ready
        );
        (d, cluster)
    } else {
        let ingest = ["--ebpf".to_string(), "off".to_string()];
        let d = Deployed::start(deploy, revenant_bin, scratch.path(), &common, &ingest);
        let otlp = format!("http://{}", d.receiver().otlp_http);
        let cluster = Cluster::start(
            pd_sim,
            &[
                "--flavour",
                &o.flavour,
                "--mode",
                mode,
                "--otlp-endpoint",
                &otlp,
            ],
            None,
        )
        .unwrap_or_else(|e| panic!("cluster: {e}"));
        (d, cluster)
    };
    let rev = &deployed.judge;
    let pids = deployed.pids();
    let cpu0 = pids.map(|p| p.map(proc_cpu_s));
    let t0 = Instant::now();
    let n = (rate * o.seconds).to_string();
    let load = test_harness::run_load_quiet(
        pd_sim,
        &cluster.router,
        &[
            "--api",
            if o.flavour == "vllm" {
                "openai"
            } else {
                "sglang"
            },
            "--rate",
            &rate.to_string(),
            "--requests",
            &n,
            "--prompt-len",
            "16..128",
            "--over-capacity-share",
            &o.over_capacity_share.to_string(),
            "--max-inflight",
            "8192",
            "--request-id-prefix",
            &format!("bench-{mode}-{rate}"),
        ],
        Duration::from_secs(o.seconds + 600),
    )
    .unwrap_or_else(|e| panic!("load: {e}"));
    let prefill = stat(&cluster.prefill);
    // The breaches the simulator says happened: rejected rooms transferred (SGLang), rejected
    // requests the router still sent to decode (vLLM).
    let expected = if o.flavour == "vllm" {
        stat(&cluster.router)["router"]["decode_legs_after_prefill_rejection"].as_u64()
    } else {
        prefill["worker"]["kv_transfers_after_reject"].as_u64()
    }
    .unwrap_or(0);
    // Drain: wait for the alerts the simulator says are due (or, in the clean run, for the
    // pipeline to go quiet), bounded.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = (0u64, Instant::now());
    loop {
        let seen = rev
            .admin_json("/api/violations?limit=1")
            .map(|(_, v)| v["total_seen"].as_u64().unwrap_or(0))
            .unwrap_or(0);
        let delivered: usize = got
            .lock()
            .unwrap()
            .iter()
            .map(|(_, b)| b["alerts"].as_array().map_or(0, Vec::len))
            .sum();
        if seen != last.0 {
            last = (seen, Instant::now());
        }
        let quiet = last.1.elapsed() > Duration::from_secs(if mode == "correct" { 8 } else { 5 });
        if (seen >= expected && delivered as u64 >= seen && quiet) || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let wall_s = t0.elapsed().as_secs_f64();
    let costs = [0, 1, 2].map(|i| {
        pids[i].map(|p| Cost {
            cpu_s: proc_cpu_s(p) - cpu0[i].unwrap_or(0.0),
            hwm_mib: proc_hwm_mib(p),
        })
    });
    // What revenant lost on the way (ring buffer, channels, budgets): its verdicts are only
    // as good as what reached them.
    let revenant_dropped = rev
        .metrics()
        .map(|m| test_harness::metric_sum(&m, "revenant_dropped_items_total", &[]) as u64)
        .unwrap_or(0);
    let violations_seen = rev
        .admin_json("/api/violations?limit=1")
        .map(|(_, v)| v["total_seen"].as_u64().unwrap_or(0))
        .unwrap_or(0);
    let mut latencies_ms = Vec::new();
    let mut internal_ms = Vec::new();
    let mut rules = std::collections::BTreeMap::new();
    let mut notifications = 0;
    for (t, body) in got.lock().unwrap().iter() {
        for a in body["alerts"].as_array().into_iter().flatten() {
            if a["type"] != "incident" {
                continue;
            }
            notifications += 1;
            let findings = a["findings"].as_array().cloned().unwrap_or_default();
            for f in &findings {
                *rules
                    .entry(f["rule"].as_str().unwrap_or("?").to_string())
                    .or_insert(0) += 1;
            }
            let Some(f) = findings
                .iter()
                .find(|f| f["rule"] == "activity-after-rejection")
            else {
                continue;
            };
            let offender = f["evidence"]
                .as_array()
                .and_then(|e| e.iter().find(|e| e["role"] == "offender"))
                .and_then(|e| e["time_ns"].as_u64());
            if let Some(off) = offender {
                latencies_ms.push((*t as f64 - off as f64) / 1e6);
                if let Some(r) = a["received_at_ns"].as_u64() {
                    internal_ms.push((r as f64 - off as f64) / 1e6);
                }
            }
        }
    }
    latencies_ms.sort_by(f64::total_cmp);
    internal_ms.sort_by(f64::total_cmp);
    let otlp_dropped = [&cluster.prefill, &cluster.decode]
        .iter()
        .map(|u| {
            let s = stat(u);
            s["otlp"]["spans_dropped_queue_full"].as_u64().unwrap_or(0)
                + s["otlp"]["spans_failed"].as_u64().unwrap_or(0)
        })
        .sum::<u64>();
    drop(cluster);
    let Deployed {
        mut judge, agent, ..
    } = deployed;
    if let Some(mut a) = agent {
        let _ = a.stop_log();
    }
    let summary = judge.stop_log().unwrap_or_else(|e| e.to_string());
    if std::env::var_os("BENCH_VERBOSE").is_some() {
        eprintln!("{summary}");
    }
    RunResult {
        deploy,
        mode,
        target_rate: rate,
        load,
        expected,
        violations_seen,
        notifications,
        latencies_ms,
        internal_ms,
        costs,
        wall_s,
        rules,
        otlp_dropped,
        revenant_dropped,
    }
}

fn report(r: &RunResult) {
    let l = &r.load;
    let sent = l["sent"].as_f64().unwrap_or(1.0).max(1.0);
    let names: [&str; 3] = match r.deploy {
        Deploy::Run => ["revenant run", "", ""],
        Deploy::Cluster => ["checker", "agent", "nats-server"],
    };
    let costs: Vec<String> = r
        .costs
        .iter()
        .zip(names)
        .filter_map(|(c, name)| {
            c.as_ref().map(|c| {
                format!(
                    "{name} CPU {:.2} s ({:.1} µs/request), peak RSS {:.0} MiB",
                    c.cpu_s,
                    c.cpu_s * 1e6 / sent,
                    c.hwm_mib
                )
            })
        })
        .collect();
    println!(
        "{deploy:<7} {mode:<21} target {rate:>6}/s achieved {ach:>7.0}/s sent {sent} ok {ok} errors {err} | due {due} violations {v} notified {n} {rules:?} | \
         latency p50 {p50:.1} ms p99 {p99:.1} ms max {max:.1} ms (dispatcher accept p50 {i50:.1} p99 {i99:.1}) | \
         {costs} in {wall:.1} s | spans dropped/failed at pd-sim {drop} | dropped by revenant {lost}",
        deploy = format!("{:?}", r.deploy).to_lowercase(),
        mode = r.mode,
        rate = r.target_rate,
        ach = l["achieved_rate"].as_f64().unwrap_or(0.0),
        sent = l["sent"],
        ok = l["ok"],
        err = l["errors"],
        due = r.expected,
        v = r.violations_seen,
        n = r.notifications,
        rules = r.rules,
        p50 = pct(&r.latencies_ms, 0.5),
        p99 = pct(&r.latencies_ms, 0.99),
        max = r.latencies_ms.last().copied().unwrap_or(f64::NAN),
        i50 = pct(&r.internal_ms, 0.5),
        i99 = pct(&r.internal_ms, 0.99),
        costs = costs.join(", "),
        wall = r.wall_s,
        drop = r.otlp_dropped,
        lost = r.revenant_dropped,
    );
}

fn main() {
    // `cargo test --all-targets` runs bench binaries without `--bench`: it must not start a
    // minutes-long measurement there.
    if !std::env::args().any(|a| a == "--bench") {
        println!("detection_latency: run with `cargo bench -p pd-sim --bench detection_latency`");
        return;
    }
    let o = opts();
    let revenant =
        test_harness::workspace_bin("revenant", "REVENANT_BIN").unwrap_or_else(|e| panic!("{e}"));
    let pd_sim: PathBuf =
        test_harness::workspace_bin("pd-sim", "PD_SIM_BIN").unwrap_or_else(|e| panic!("{e}"));
    eprintln!(
        "detection_latency: revenant {} , pd-sim {}, source {}, OTLP linger {} ms, {} s per rate, {:?}",
        revenant.display(),
        pd_sim.display(),
        o.source,
        o.linger_ms,
        o.seconds,
        o.deploys
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    for &rate in &o.rates {
        for &deploy in &o.deploys {
            let r = one_run(
                &o,
                deploy,
                "handoff-after-reject",
                rate,
                &revenant,
                &pd_sim,
                &rt,
            );
            report(&r);
            if !o.skip_clean {
                let c = one_run(&o, deploy, "correct", rate, &revenant, &pd_sim, &rt);
                report(&c);
            }
        }
    }
}
