//! `cargo xtask demo`: the simulated PD cluster with the buggy router, revenant watching it, live
//! alerts as one-liners, then a summary and where to look next.
//!
//! Every child runs in its own process group (so the terminal's Ctrl-C reaches only us) with
//! `PR_SET_PDEATHSIG`; Ctrl-C raises a flag that every wait checks, and teardown stops revenant
//! (it drains its alerts) and the cluster by process group, with bounded waits.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::Value;
use test_harness::{
    Binaries, Cluster, JsonlTail, Revenant, Sample, fault_verdict_window, metric_sum, notifications,
};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Requests to send.
    #[arg(long, default_value_t = 2000)]
    requests: u64,
    /// Requests per second (open loop).
    #[arg(long, default_value_t = 500)]
    rate: u64,
    /// Router behaviour: handoff-after-reject (the disclosed bug), concurrent-no-cancel
    /// (sglang-router 0.3.2), concurrent-cancel (smg 1.13.0, withdraws the decode leg of a
    /// rejected request), correct (no alert expected).
    #[arg(long, default_value = "handoff-after-reject")]
    mode: String,
    /// Serving stack the simulator speaks: sglang (concurrent legs, bootstrap rooms) or vllm
    /// (vllm-router's sequential legs, `kv_transfer_params`, a NIXL-style side channel; modes
    /// handoff-after-reject and correct).
    #[arg(long, default_value = "sglang")]
    flavour: String,
    /// Share of requests longer than prefill can take (rejected with 400).
    #[arg(long, default_value_t = 0.01)]
    over_capacity_share: f64,
    /// Keep the cluster and revenant running after the traffic, until Ctrl-C.
    #[arg(long)]
    keep_running: bool,
    /// revenant's admin server address.
    #[arg(long, default_value = "127.0.0.1:9464")]
    admin: String,
    /// Use debug builds (quicker to build, several times slower to run).
    #[arg(long)]
    debug: bool,
    /// Kernel capture: on (needs root), off, auto (on when root).
    #[arg(long, default_value = "auto")]
    ebpf: String,
    /// Isolation breach the simulator injects (repeatable): room-collision, unknown-room,
    /// success-after-abort, stranded-kv, foreign-route-put (see tests/pd-sim/README.md,
    /// "Faults"). None by default.
    #[arg(long = "fault")]
    faults: Vec<String>,
    /// Share of requests each `--fault` hits.
    #[arg(long, default_value_t = 0.02)]
    fault_rate: f64,
}

fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

pub fn run(args: DemoArgs) -> Result<()> {
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    if ![
        "handoff-after-reject",
        "concurrent-no-cancel",
        "concurrent-cancel",
        "correct",
    ]
    .contains(&args.mode.as_str())
    {
        bail!(
            "--mode must be handoff-after-reject, concurrent-no-cancel, concurrent-cancel or correct"
        );
    }
    for f in &args.faults {
        if fault_verdict_window(f).is_none() {
            bail!(
                "--fault {f:?}: expected room-collision, unknown-room, success-after-abort, \
                 stranded-kv or foreign-route-put"
            );
        }
    }
    if !(0.0..=1.0).contains(&args.fault_rate) {
        bail!("--fault-rate must be within 0..=1, not {}", args.fault_rate);
    }
    if !args.faults.is_empty() && args.flavour != "sglang" {
        bail!("--fault needs --flavour sglang (the faults live on the bootstrap/KV path)");
    }
    match args.flavour.as_str() {
        "sglang" => {}
        "vllm" if ["handoff-after-reject", "correct"].contains(&args.mode.as_str()) => {}
        "vllm" => bail!("--flavour vllm has the modes handoff-after-reject and correct"),
        other => bail!("--flavour must be sglang or vllm, not {other:?}"),
    }
    let root = test_harness::is_root();
    let ebpf = match args.ebpf.as_str() {
        "on" if !root => bail!("--ebpf on needs root (the probes are loaded into the kernel)"),
        "on" => true,
        "off" => false,
        "auto" => root,
        other => bail!("--ebpf {other}: expected on, off or auto"),
    };

    // Build (the toolchain pieces only if something is missing: building revenant builds the
    // kernel programs it embeds).
    if !crate::setup::build_prereqs_present() {
        println!("demo: installing the eBPF build toolchain first (cargo xtask setup)");
        crate::setup::build_prereqs().context(
            "installing the build prerequisites (run `sudo cargo xtask setup` once if not root)",
        )?;
    }
    let t_build = Instant::now();
    println!(
        "demo: building revenant and pd-sim ({}; the first build takes a few minutes)",
        if args.debug { "debug" } else { "release" }
    );
    let bins = Binaries::build(!args.debug)?;
    println!("demo: built in {:.0?}", t_build.elapsed());
    if interrupted() {
        bail!("interrupted");
    }
    if ebpf {
        crate::setup::mount_tracefs()?;
    }

    let t0 = Instant::now();
    let dir = std::env::temp_dir().join(format!("revenant-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = run_demo(&args, &bins, &dir, ebpf);
    println!(
        "\ndemo: files (alerts, logs, load summary) kept in {}",
        dir.display()
    );
    if let Err(e) = &result {
        eprintln!("demo: failed after {:.1?}: {e:#}", t0.elapsed());
    }
    result
}

fn run_demo(args: &DemoArgs, bins: &Binaries, dir: &std::path::Path, ebpf: bool) -> Result<()> {
    let t0 = Instant::now();
    // The simulator must know revenant's OTLP address and, with eBPF, revenant must know the
    // simulator's pids: the cluster starts first, exporting to a port revenant binds next.
    // (Its exporters only connect once there are spans, i.e. once traffic starts.)
    let otlp_port = test_harness::free_port()?;
    let otlp = format!("127.0.0.1:{otlp_port}");
    let mut cluster_args = vec![
        "--flavour".into(),
        args.flavour.clone(),
        "--mode".into(),
        args.mode.clone(),
        "--otlp-endpoint".into(),
        format!("http://{otlp}"),
    ];
    for f in &args.faults {
        cluster_args.extend(["--fault".into(), f.clone()]);
    }
    if !args.faults.is_empty() {
        // A held leg lets go 5 s after its rule's window, so the demo ends in about a minute.
        cluster_args.extend([
            "--fault-rate".into(),
            args.fault_rate.to_string(),
            "--fault-hold-ms".into(),
            "35000".into(),
        ]);
    }
    let cluster = Cluster::start(&bins.pd_sim, &cluster_args, Some(&dir.join("pd-sim.log")))?;
    let mut rev_args: Vec<String> = vec![
        "--otlp-http".into(),
        otlp.clone(),
        "--otlp-grpc".into(),
        "off".into(),
        "--admin".into(),
        args.admin.clone(),
        "--spool-no-fsync".into(),
    ];
    if ebpf {
        rev_args.extend(["--ebpf".into(), "on".into()]);
        rev_args.extend(cluster.pid_args());
        // Both witnesses live: wait briefly for the second one so each alert shows both.
        rev_args.extend(["--corroboration-window".into(), "3s".into()]);
    } else {
        rev_args.extend(["--ebpf".into(), "off".into()]);
    }
    let mut revenant = Revenant::start(&bins.revenant, dir, &rev_args)?;
    let admin = revenant.admin_url();
    println!();
    println!(
        "demo: pd-sim cluster, router mode {} (router {}, prefill {}, decode {})",
        args.mode, cluster.router, cluster.prefill, cluster.decode
    );
    println!(
        "demo: revenant run: OTLP/HTTP on {otlp}, admin {admin}, eBPF {}",
        revenant.ready["ebpf"].as_str().unwrap_or("?")
    );
    if !ebpf {
        let how = if test_harness::is_root() {
            "--ebpf off was given; without it"
        } else {
            "not root; as root (sudo -E cargo xtask demo)"
        };
        println!(
            "demo: eBPF is OFF: revenant sees only what the processes report over OTLP ({how} \
             revenant also loads kernel probes on the simulator's processes)"
        );
    }
    println!("demo: ready in {:.1?}", t0.elapsed());

    // Alerts as they fire.
    let seen: Arc<Mutex<Vec<Value>>> = Arc::default();
    let stop_printer = Arc::new(AtomicBool::new(false));
    let printed = Arc::new(AtomicUsize::new(0));
    let printer = {
        let (seen, stop, printed) = (seen.clone(), stop_printer.clone(), printed.clone());
        let mut tail = JsonlTail::new(&revenant.alerts);
        // SAFETY: isatty has no preconditions.
        let tty = unsafe { libc::isatty(2) == 1 };
        std::thread::spawn(move || {
            loop {
                let last = stop.load(Ordering::Relaxed);
                for n in tail.poll() {
                    let i = printed.fetch_add(1, Ordering::Relaxed) + 1;
                    // On a terminal, clear the load generator's progress line first.
                    let clear = if tty { "\r\x1b[K" } else { "" };
                    eprintln!("{clear}  alert #{i:<4} {}", notifications::one_liner(&n));
                    seen.lock().unwrap_or_else(|p| p.into_inner()).push(n);
                }
                if last {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };

    println!(
        "\ndemo: sending {} requests at {}/s, {:.0}% longer than prefill accepts\n",
        args.requests,
        args.rate,
        args.over_capacity_share * 100.0
    );
    let t_load = Instant::now();
    let load = test_harness::run_load(
        &bins.pd_sim,
        &cluster.router,
        &[
            "--api".into(),
            if args.flavour == "vllm" {
                "openai"
            } else {
                "sglang"
            }
            .into(),
            "--rate".into(),
            args.rate.to_string(),
            "--requests".into(),
            args.requests.to_string(),
            "--over-capacity-share".into(),
            args.over_capacity_share.to_string(),
        ],
        &dir.join("load-summary.json"),
        false,
        Duration::from_secs(args.requests / args.rate.max(1) * 4 + 120),
        Some(&INTERRUPTED),
    )?;
    let load_time = t_load.elapsed();
    let observed = match load {
        Some(load) => {
            wait_for_fault_verdicts(args, &revenant)?;
            // Let revenant finish what the exporters still hold (they batch every 200 ms).
            let metrics = revenant.wait_quiet(
                Duration::from_millis(1500),
                Duration::from_secs(30),
                Some(&INTERRUPTED),
            )?;
            Some(Observed::gather(&cluster, Some((load, load_time)), metrics))
        }
        // Ctrl-C during the traffic: what revenant saw until then, without waiting for quiet.
        None if interrupted() => revenant
            .metrics()
            .ok()
            .map(|metrics| Observed::gather(&cluster, None, metrics)),
        None => None,
    };
    if let Some(observed) = &observed {
        // The printer catches up with the file before the table.
        std::thread::sleep(Duration::from_millis(250));
        let notes = seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if observed.load.is_none() {
            println!(
                "\ndemo: interrupted after {load_time:.1?} of traffic: what revenant saw until then"
            );
        }
        print_summary(args, observed, &notes);
        print_next(&admin, &notes, dir);
    }
    if args.keep_running && !interrupted() {
        println!("\ndemo: still running (--keep-running); Ctrl-C stops everything");
        while !interrupted() {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    if interrupted() {
        println!("\ndemo: interrupted; stopping");
    }
    println!("demo: stopping revenant (it delivers held alerts first) and the cluster");
    let status = revenant.stop()?;
    stop_printer.store(true, Ordering::Relaxed);
    let _ = printer.join();
    drop(cluster);
    println!("demo: revenant exited ({status}); cluster stopped; no process left behind");
    Ok(())
}

/// With faults injected, waits (printing why) until revenant's watermark passed the end of the
/// traffic plus the longest window of their rules: their verdicts are due then.
fn wait_for_fault_verdicts(args: &DemoArgs, revenant: &Revenant) -> Result<()> {
    let Some(window) = args
        .faults
        .iter()
        .filter_map(|f| fault_verdict_window(f))
        .max()
    else {
        return Ok(());
    };
    let window = window.as_secs();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs_f64();
    let target = now + window as f64 + 1.0;
    println!(
        "\ndemo: waiting for the fault rules' verdicts ({window} s window + revenant's allowed \
         lateness; Ctrl-C to stop early)"
    );
    let deadline = Instant::now() + Duration::from_secs(window + 120);
    while !interrupted() && Instant::now() < deadline {
        let m = revenant.metrics()?;
        if metric_sum(&m, "revenant_checker_watermark_timestamp_seconds", &[]) >= target {
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    Ok(())
}

fn get(v: &Value, path: &[&str]) -> u64 {
    let mut cur = v;
    for p in path {
        cur = &cur[*p];
    }
    cur.as_u64().unwrap_or(0)
}

/// What the demo gathered for its summary: the load generator's totals (absent when the traffic
/// was interrupted), revenant's metrics and the simulator's own counters.
struct Observed {
    load: Option<(Value, Duration)>,
    metrics: Vec<Sample>,
    prefill: Option<Value>,
    decode: Option<Value>,
    router: Option<Value>,
}

impl Observed {
    fn gather(cluster: &Cluster, load: Option<(Value, Duration)>, metrics: Vec<Sample>) -> Self {
        let stats = |base: &str| test_harness::http_json(&format!("{base}/sim/stats")).ok();
        Observed {
            load,
            metrics,
            prefill: stats(&cluster.prefill),
            decode: stats(&cluster.decode),
            router: stats(&cluster.router),
        }
    }
}

fn print_summary(args: &DemoArgs, observed: &Observed, notes: &[Value]) {
    let m = &observed.metrics[..];
    let (prefill, decode, router) = (
        observed.prefill.as_ref(),
        observed.decode.as_ref(),
        observed.router.as_ref(),
    );
    let rows: &mut Vec<(String, String)> = &mut Vec::new();
    let mut row = |k: &str, v: String| rows.push((k.to_string(), v));
    match &observed.load {
        Some((load, load_time)) => {
            row(
                "requests",
                format!(
                    "{} sent in {:.1?} ({:.0}/s), {} ok, {} errors",
                    get(load, &["sent"]),
                    load_time,
                    load["achieved_rate"].as_f64().unwrap_or(0.0),
                    get(load, &["ok"]),
                    get(load, &["errors"])
                ),
            );
            let rejected: Vec<String> = load["rejected_by_status"]
                .as_object()
                .map(|o| o.iter().map(|(k, v)| format!("{v} x {k}")).collect())
                .unwrap_or_default();
            row("rejections (client saw)", list_or_none(rejected));
        }
        None => row(
            "requests",
            "interrupted: the load generator's totals are not available".into(),
        ),
    }
    if let Some(p) = prefill {
        let handed_on = if args.flavour == "vllm" {
            format!(
                "{} of them still sent to decode by the router",
                router.map_or(0, |r| get(
                    r,
                    &["router", "decode_legs_after_prefill_rejection"]
                ))
            )
        } else {
            format!(
                "{} rejected rooms still transferred to decode",
                get(p, &["worker", "kv_transfers_after_reject"])
            )
        };
        row(
            "prefill (simulator)",
            format!(
                "{} rejected with 400, {handed_on}",
                get(p, &["worker", "rejected_400"]),
            ),
        );
    }
    let events: Vec<String> = ["otlp", "ebpf"]
        .iter()
        .map(|s| {
            format!(
                "{s} {}",
                metric_sum(m, "revenant_events_total", &[("source", s)]) as u64
            )
        })
        .collect();
    row("events checked by source", events.join(", "));
    let mut by_rule: BTreeMap<String, u64> = BTreeMap::new();
    for s in m
        .iter()
        .filter(|s| s.name == "revenant_checker_violations_total" && s.value > 0.0)
    {
        by_rule.insert(
            s.labels.get("rule").cloned().unwrap_or_default(),
            s.value as u64,
        );
    }
    row("violations by rule", counts_or_none(&by_rule));
    // One notification per incident (one client request); updates and summaries apart.
    let mut by_source: BTreeMap<String, u64> = BTreeMap::new();
    let mut by_rules: BTreeMap<String, u64> = BTreeMap::new();
    let mut incidents = std::collections::BTreeSet::new();
    let (mut notifications, mut updates, mut findings, mut suppressed) = (0u64, 0u64, 0u64, 0u64);
    for n in notes {
        if n["type"] == "suppressed" {
            suppressed += n["suppressed"].as_u64().unwrap_or(0);
            continue;
        }
        if !notifications::is_incident(n) {
            continue;
        }
        notifications += 1;
        incidents.insert(n["incident"].as_str().unwrap_or("").to_string());
        if n.get("update").is_some() {
            updates += 1;
            continue;
        }
        findings += notifications::findings(n).len() as u64;
        *by_rules
            .entry(notifications::rules(n).join("+"))
            .or_default() += 1;
        *by_source
            .entry(notifications::evidence_sources(n).join("+"))
            .or_default() += 1;
    }
    row(
        "incidents notified",
        if notifications == 0 {
            "none".into()
        } else {
            format!(
                "{} incidents in {notifications} notifications ({updates} updates), {findings} findings: {}",
                incidents.len(),
                counts_or_none(&by_rules)
            )
        },
    );
    row(
        "notifications by evidence source",
        counts_or_none(&by_source),
    );
    row(
        "alert flood control",
        format!(
            "{} findings merged into an incident, {} repeats (same rule, same request), {} rate-limited ({} notifications in summaries), {} corroborated by a 2nd source",
            metric_sum(m, "revenant_alerts_findings_merged_total", &[]) as u64,
            metric_sum(m, "revenant_alerts_deduplicated_total", &[]) as u64,
            metric_sum(m, "revenant_alerts_rate_limited_total", &[]) as u64,
            suppressed,
            metric_sum(m, "revenant_alerts_corroborated_total", &[]) as u64,
        ),
    );
    let drops: Vec<String> = m
        .iter()
        .filter(|s| s.name == "revenant_dropped_items_total" && s.value > 0.0)
        .map(|s| {
            format!(
                "{}/{} {}",
                s.labels.get("point").map(String::as_str).unwrap_or("?"),
                s.labels.get("reason").map(String::as_str).unwrap_or("?"),
                s.value as u64
            )
        })
        .collect();
    row("revenant drops (/metrics)", list_or_none(drops));
    let sim_drops: u64 = [prefill, decode]
        .iter()
        .flatten()
        .map(|s| get(s, &["otlp", "spans_dropped_queue_full"]) + get(s, &["otlp", "spans_failed"]))
        .sum();
    row(
        "simulator span export losses",
        format!("{sim_drops} (prefill + decode exporters)"),
    );
    let w = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    println!("\n== summary: mode {} ==", args.mode);
    for (k, v) in rows.iter() {
        println!("  {k:<w$}  {v}");
    }
    if args.mode == "correct" && !by_rule.is_empty() {
        println!("  !! the correct router should produce no violation: this is a false positive");
    }
}

fn print_next(admin: &str, notes: &[Value], dir: &std::path::Path) {
    let example = notes.iter().find_map(|n| {
        n["request"]["request_id"]
            .as_str()
            .or_else(|| n["request"]["trace_id"].as_str())
            .map(str::to_string)
    });
    let dashboards: PathBuf = test_harness::workspace_root().join("dashboards");
    println!("\n== where to look next ==");
    println!("  admin server        {admin}/readyz   {admin}/metrics");
    println!("  recent violations   curl -s {admin}/api/violations?limit=5");
    match example {
        Some(id) => println!("  one request's story curl -s {admin}/api/requests/{id}"),
        None => println!("  one request's story curl -s {admin}/api/requests/<x-request-id>"),
    }
    println!(
        "  dashboards          {}/revenant-overview.json (Grafana), revenant-alerts.yaml (Prometheus rules)",
        std::fs::canonicalize(&dashboards)
            .unwrap_or(dashboards)
            .display()
    );
    println!(
        "  alerts as sent      {}",
        dir.join("alerts.jsonl").display()
    );
    println!("  (the admin URLs answer while the demo runs: use --keep-running)");
}

/// A summary cell: the items joined, or "none".
fn list_or_none(items: Vec<String>) -> String {
    if items.is_empty() {
        "none".into()
    } else {
        items.join(", ")
    }
}

/// A summary cell of counts by key: "key n, key n", or "none".
fn counts_or_none(counts: &BTreeMap<String, u64>) -> String {
    list_or_none(counts.iter().map(|(k, v)| format!("{k} {v}")).collect())
}
