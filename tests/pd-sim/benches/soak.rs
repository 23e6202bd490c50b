//! The soak: a long steady load through a real `revenant run` with both witnesses, sampled as it
//! goes. One row of the precision/recall bench (`support/mod.rs`: a real `pd-sim cluster` on
//! loopback, revenant with `--ebpf on` and OTLP, the oracle from the simulator's own records)
//! stretched to `--minutes`, with a router that injects breaches (by default
//! `handoff-after-reject`: every refused attempt is handed on to decode).
//!
//! ```text
//! cargo bench -p pd-sim --bench soak -- [--minutes 30] [--rate 150] [--sample-secs 30]
//!     [--router handoff-after-reject] [--decode honours] [--witness both]
//!     [--over-capacity-share 0.1] [--seed 1] [--out DIR] [--keep]
//! ```
//!
//! Binaries: `REVENANT_BIN` and `PD_SIM_BIN`, else release builds the bench makes itself. Needs
//! root for the eBPF witness.
//!
//! Every `--sample-secs` it reads revenant's RSS (`VmRSS` of `/proc/PID/status`), its CPU
//! (`utime + stime` of `/proc/PID/stat` over the interval, as % of one core), and from
//! `/metrics` the events checked, live attempts, tombstones and every drop or loss counter
//! (summed; the series are listed at the start), and prints a line; the curve is printed again
//! at the end. It also collects `/api/violations` as it goes: revenant keeps the newest 10 000
//! (`--recent-violations`, the most one read returns), so each read takes those that came since
//! the last (by `total_seen`); a read that finds more new ones than the ring holds fails the run.
//!
//! The oracle covers the whole run: pd-sim keeps a bounded per-room log (`--room-log`, 200 000
//! by default), so the bench raises it above the run's request count and checks at the end that
//! no record was pushed out.
//!
//! Verdict (exit status 1 if any check fails or cannot be judged, each named):
//! - zero drops: every drop or loss counter is 0 at the end (the simulator's span exporters
//!   included);
//! - zero false alerts; every breach the oracle names caught; one notification per breached
//!   request (none repeated, none missing, none about a request without a breach);
//! - RSS flat and CPU flat: revenant keeps an ended attempt's tombstone for 10 minutes
//!   (`retention` of its checker, `revenant run`'s default), so its state only plateaus after
//!   that warm-up (plus twice the allowed lateness: an attempt becomes a tombstone about 30 s
//!   after its last event). The last third of the run must start after it (a run of 17 minutes
//!   at least); over the last third's samples a least-squares line's rise must stay within a
//!   bound: RSS within 2 % of its mean, CPU within 10 % of its mean, or either within twice the
//!   residual standard deviation when that is larger (other builds share the cores: that is the
//!   noise). The slope per hour is printed beside it.

#[path = "support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;
use support::{Router, Row, RowSetup, Witness, await_judgement, finish_row, judge, start_row};
use test_harness::{Sample, http_get, http_json, metric_sum, parse_metrics};

/// How long `revenant run` keeps a tombstone (its checker's `retention`, which run leaves at
/// the default): the engine's state grows until the first tombstones expire.
const TOMBSTONE_RETENTION: Duration = Duration::from_secs(600);

/// The most violations one `/api/violations` read returns, and the ring the soak asks for.
const VIOLATIONS_RING: usize = 10_000;

struct Opts {
    minutes: f64,
    rate: f64,
    sample_secs: u64,
    row: Row,
    over_capacity_share: f64,
    seed: u64,
    out: PathBuf,
    keep: bool,
}

fn router(name: &str) -> Router {
    match name {
        "correct" => Router::Sim("correct"),
        "concurrent-cancel" => Router::Sim("concurrent-cancel"),
        "concurrent-no-cancel" => Router::Sim("concurrent-no-cancel"),
        "handoff-after-reject" => Router::Sim("handoff-after-reject"),
        other => panic!(
            "--router {other}: one of correct, concurrent-cancel, concurrent-no-cancel, handoff-after-reject"
        ),
    }
}

fn opts() -> Opts {
    let mut o = Opts {
        minutes: 30.0,
        rate: 150.0,
        sample_secs: 30,
        row: Row {
            router: Router::Sim("handoff-after-reject"),
            ignores_cancel: false,
            witness: Witness::Both,
            stream: false,
            fault: None,
        },
        over_capacity_share: 0.1,
        seed: 1,
        out: test_harness::workspace_root().join("target/soak"),
        keep: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--minutes" => o.minutes = val().parse().expect("--minutes M"),
            "--rate" => o.rate = val().parse().expect("--rate R"),
            "--sample-secs" => o.sample_secs = val().parse().expect("--sample-secs S"),
            "--router" => o.row.router = router(&val()),
            "--decode" => {
                o.row.ignores_cancel = match val().as_str() {
                    "honours" => false,
                    "ignores" => true,
                    other => panic!("--decode {other}: honours or ignores"),
                }
            }
            "--witness" => {
                o.row.witness = match val().as_str() {
                    "ebpf" => Witness::Ebpf,
                    "otlp" => Witness::Otlp,
                    "both" => Witness::Both,
                    other => panic!("--witness {other}: ebpf, otlp or both"),
                }
            }
            "--over-capacity-share" => {
                o.over_capacity_share = val().parse().expect("--over-capacity-share F")
            }
            "--seed" => o.seed = val().parse().expect("--seed S"),
            "--out" => o.out = val().into(),
            "--keep" => o.keep = true,
            // `cargo bench` passes `--bench`; ignore it and anything else libtest-like.
            _ => {}
        }
    }
    assert!(o.sample_secs > 0, "--sample-secs must be positive");
    o
}

/// One point of the curve.
#[derive(Clone, Debug)]
struct Point {
    /// Seconds since the load started.
    t_s: f64,
    rss_kib: u64,
    /// Of the RSS, what sits in transparent huge pages (`AnonHugePages` of
    /// `/proc/PID/smaps_rollup`), KiB: a 2 MiB page faulted in for a small object counts whole.
    huge_kib: u64,
    /// CPU over the interval before it, % of one core.
    cpu_pct: f64,
    events: u64,
    events_per_s: f64,
    live_attempts: u64,
    tombstones: u64,
    violations: u64,
    drops: u64,
    /// The box's 1-minute load average: what else competes for the cores.
    loadavg: f64,
    /// revenant's own estimate of each bounded structure (`revenant_memory_estimated_bytes`),
    /// bytes: beside RSS, it says whether a rise is one of them filling or something outside.
    estimated: BTreeMap<String, u64>,
}

/// `VmRSS` of a process, KiB.
fn rss_kib(pid: u32) -> Result<u64> {
    proc_kib(pid, "status", "VmRSS:")
}

/// `AnonHugePages` of a process, KiB (0 where the kernel does not report it).
fn huge_kib(pid: u32) -> u64 {
    proc_kib(pid, "smaps_rollup", "AnonHugePages:").unwrap_or(0)
}

/// The `key` line's figure (kB) of `/proc/PID/file`.
fn proc_kib(pid: u32, file: &str, key: &str) -> Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/{file}"))?;
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| anyhow!("/proc/{pid}/{file} has no {key}"))
}

/// `utime + stime` of a process, seconds.
fn cpu_s(pid: u32) -> Result<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (field 2) may hold spaces: count from its closing parenthesis; what
    // follows starts at field 3 (state), so utime (14) and stime (15) are the 12th and 13th.
    let rest = &text[text.rfind(')').context("/proc/PID/stat")? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok(ticks as f64 / hz)
}

fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

fn series_name(s: &Sample) -> String {
    if s.labels.is_empty() {
        return s.name.clone();
    }
    let labels: Vec<String> = s.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("{}{{{}}}", s.name, labels.join(","))
}

/// revenant's drop and loss counters: whatever it counts as dropped, lost, evicted, rejected
/// or failed, ring-buffer and stream-tracker trouble, rate-limited alerts, and checker state
/// evicted before its time (an attempt at the cap or idle past its TTL, a tombstone at the cap;
/// tombstones and requests that expire are the normal end of state), events too late to count.
fn drop_series(metrics: &[Sample]) -> Vec<(String, f64)> {
    const WORDS: [&str; 8] = [
        "dropped",
        "lost",
        "evicted",
        "rejected",
        "failed",
        "desync",
        "decode_errors",
        "rate_limited",
    ];
    metrics
        .iter()
        .filter(|s| {
            // Events too late for the deadline rules they would have settled.
            if s.name == "revenant_checker_late_events_total" {
                return true;
            }
            if s.name == "revenant_checker_evictions_total" {
                return s.labels.get("reason").map(String::as_str) != Some("expired");
            }
            s.name.starts_with("revenant_") && WORDS.iter().any(|w| s.name.contains(w))
        })
        .map(|s| (series_name(s), s.value))
        .collect()
}

fn drops(metrics: &[Sample]) -> u64 {
    drop_series(metrics).iter().map(|(_, v)| *v).sum::<f64>() as u64
}

fn metrics_of(admin: &str) -> Result<Vec<Sample>> {
    let (status, text) = http_get(&format!("{admin}/metrics"))?;
    if status != 200 {
        bail!("/metrics answered {status}");
    }
    Ok(parse_metrics(&text))
}

/// Every violation revenant reported, read from its bounded ring as the run goes.
#[derive(Default)]
struct ViolationLog {
    /// `total_seen` at the last read.
    seen: u64,
    /// Oldest first.
    items: Vec<Value>,
    /// Violations that left the ring before a read could take them.
    missed: u64,
}

impl ViolationLog {
    fn read(admin: &str, limit: usize) -> Result<(Vec<Value>, u64)> {
        let v = http_json(&format!("{admin}/api/violations?limit={limit}"))?;
        let items = v["violations"].as_array().cloned().unwrap_or_default();
        let total = v["total_seen"]
            .as_u64()
            .ok_or_else(|| anyhow!("/api/violations without total_seen: {v}"))?;
        Ok((items, total))
    }

    /// Takes the violations that came since the last read: a count first (cheap), then that
    /// many and a margin for those arriving meanwhile, newest first.
    fn poll(&mut self, admin: &str) -> Result<()> {
        let (_, total) = Self::read(admin, 0)?;
        let mut limit = ((total - self.seen) as usize + 1000).min(VIOLATIONS_RING);
        loop {
            let (items, total) = Self::read(admin, limit)?;
            let new = (total - self.seen) as usize;
            if new <= items.len() || limit == VIOLATIONS_RING {
                let take = new.min(items.len());
                self.missed += (new - take) as u64;
                self.items.extend(items.into_iter().take(take).rev());
                self.seen = total;
                return Ok(());
            }
            limit = (new + 1000).min(VIOLATIONS_RING);
        }
    }
}

/// Samples revenant every `every` until `stop`; the violations are collected on the way.
fn sample_loop(
    admin: &str,
    pid: u32,
    every: Duration,
    stop: &AtomicBool,
    log: &mut ViolationLog,
) -> Vec<Point> {
    let start = Instant::now();
    let mut points = Vec::new();
    let (mut last_t, mut last_cpu, mut last_events) = (0.0, cpu_s(pid).unwrap_or(0.0), 0u64);
    let mut k = 1u32;
    eprintln!("{}", header());
    'run: loop {
        let due = start + every * k;
        while Instant::now() < due {
            if stop.load(Ordering::Relaxed) {
                break 'run;
            }
            std::thread::sleep(Duration::from_millis(200).min(due - Instant::now()));
        }
        k += 1;
        let t_s = start.elapsed().as_secs_f64();
        let (Ok(rss), Ok(cpu), Ok(m)) = (rss_kib(pid), cpu_s(pid), metrics_of(admin)) else {
            eprintln!("soak: revenant (pid {pid}) could not be sampled at {t_s:.0} s");
            continue;
        };
        let events = metric_sum(&m, "revenant_checker_events_total", &[]) as u64;
        let dt = t_s - last_t;
        if let Err(e) = log.poll(admin) {
            eprintln!("soak: /api/violations at {t_s:.0} s: {e:#}");
        }
        let p = Point {
            t_s,
            rss_kib: rss,
            huge_kib: huge_kib(pid),
            cpu_pct: (cpu - last_cpu) / dt * 100.0,
            events,
            events_per_s: (events - last_events.min(events)) as f64 / dt,
            live_attempts: metric_sum(&m, "revenant_checker_live_attempts", &[]) as u64,
            tombstones: metric_sum(&m, "revenant_checker_tombstones", &[]) as u64,
            violations: log.seen,
            drops: drops(&m),
            loadavg: loadavg(),
            estimated: estimated(&m),
        };
        eprintln!("{}", line(&p));
        (last_t, last_cpu, last_events) = (t_s, cpu, events);
        points.push(p);
    }
    points
}

/// `revenant_memory_estimated_bytes` by structure.
fn estimated(m: &[Sample]) -> BTreeMap<String, u64> {
    m.iter()
        .filter(|s| s.name == "revenant_memory_estimated_bytes")
        .filter_map(|s| Some((s.labels.get("structure")?.clone(), s.value as u64)))
        .collect()
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn header() -> String {
    "| t (min) | RSS (MiB) | huge pages (MiB) | estimated (MiB) | CPU (% of a core) | events checked | events/s | live attempts | tombstones | violations | drops | load avg (1 min) |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |".into()
}

fn line(p: &Point) -> String {
    format!(
        "| {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {:.0} | {} | {} | {} | {} | {:.2} |",
        p.t_s / 60.0,
        p.rss_kib as f64 / 1024.0,
        p.huge_kib as f64 / 1024.0,
        mib(p.estimated.values().sum()),
        p.cpu_pct,
        p.events,
        p.events_per_s,
        p.live_attempts,
        p.tombstones,
        p.violations,
        p.drops,
        p.loadavg
    )
}

/// Least-squares line through (x, y): slope, and the residuals' standard deviation.
fn fit(xy: &[(f64, f64)]) -> (f64, f64) {
    let n = xy.len() as f64;
    let (mx, my) = (
        xy.iter().map(|p| p.0).sum::<f64>() / n,
        xy.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let sxx: f64 = xy.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = xy.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let slope = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    let ss: f64 = xy
        .iter()
        .map(|p| (p.1 - my - slope * (p.0 - mx)).powi(2))
        .sum();
    (slope, (ss / (n - 2.0).max(1.0)).sqrt())
}

/// A check's outcome: passed, failed, or not judged (the run cannot say).
enum Outcome {
    Pass,
    Fail,
    NotJudged,
}

struct Check {
    name: &'static str,
    outcome: Outcome,
    detail: String,
}

fn check(name: &'static str, pass: bool, detail: String) -> Check {
    Check {
        name,
        outcome: if pass { Outcome::Pass } else { Outcome::Fail },
        detail,
    }
}

/// Flatness of one quantity over the last third of the run; `bound(mean, residual_sd)` is the
/// largest rise allowed across it.
fn flat(
    name: &'static str,
    unit: &str,
    points: &[Point],
    (duration_s, warm_up_s): (f64, f64),
    value: impl Fn(&Point) -> f64,
    bound: impl Fn(f64, f64) -> f64,
    bound_text: &str,
) -> Check {
    let from = duration_s * 2.0 / 3.0;
    let last: Vec<(f64, f64)> = points
        .iter()
        .filter(|p| p.t_s >= from)
        .map(|p| (p.t_s / 60.0, value(p)))
        .collect();
    if from < warm_up_s || last.len() < 3 {
        return Check {
            name,
            outcome: Outcome::NotJudged,
            detail: format!(
                "the last third starts at {:.1} min, before the warm-up of {:.1} min (tombstone retention + twice the allowed lateness + a sample), or has fewer than 3 samples ({}): run at least {:.0} min",
                from / 60.0,
                warm_up_s / 60.0,
                last.len(),
                (warm_up_s * 1.5 / 60.0).ceil()
            ),
        };
    }
    let mean = last.iter().map(|p| p.1).sum::<f64>() / last.len() as f64;
    let (slope, sd) = fit(&last);
    let span = last.last().unwrap().0 - last[0].0;
    let rise = slope * span;
    let allowed = bound(mean, sd);
    check(
        name,
        rise <= allowed,
        format!(
            "last third ({:.1}–{:.1} min, {} samples): mean {mean:.1} {unit}, slope {slope:+.3} {unit}/min, fitted rise {rise:+.2} {unit} ({:+.1} {unit}/h) (allowed {allowed:.2} {unit}: {bound_text}), residual sd {sd:.2} {unit}",
            last[0].0,
            last.last().unwrap().0,
            last.len(),
            slope * 60.0
        ),
    )
}

fn main() {
    // `cargo test --all-targets` runs bench binaries without `--bench`: it must not start a
    // run of many minutes there.
    if !std::env::args().any(|a| a == "--bench") {
        println!("soak: run with `cargo bench -p pd-sim --bench soak`");
        return;
    }
    let o = opts();
    let row = o.row;
    if row.witness.ebpf() && !test_harness::is_root() {
        eprintln!("soak: the {} witness needs root (eBPF)", row.witness.name());
        std::process::exit(2);
    }
    let bins = test_harness::Binaries::locate()
        .unwrap_or_else(|e| panic!("release builds of revenant and pd-sim: {e:#}"));
    let requests = (o.rate * o.minutes * 60.0).round() as u64;
    // Room for every attempt of the run in the simulator's room log (one room per request
    // here; a margin for stray rooms).
    let room_log = requests + requests / 10 + 10_000;
    eprintln!(
        "soak: revenant {}, pd-sim {}; row {}; {} requests at {}/s ({} min), {} over capacity; a sample every {} s",
        bins.revenant.display(),
        bins.pd_sim.display(),
        row.name(),
        requests,
        o.rate,
        o.minutes,
        o.over_capacity_share,
        o.sample_secs
    );
    let room_log_args = vec!["--room-log".to_string(), room_log.to_string()];
    let setup = RowSetup {
        prefill_args: room_log_args.clone(),
        decode_args: room_log_args,
        // `run`'s defaults but for: every incident reaches the alerts file (no rate limit),
        // and the violations ring as large as one read returns.
        revenant_args: vec![
            "--admin".into(),
            "127.0.0.1:0".into(),
            "--rate-limit".into(),
            "0".into(),
            "--recent-violations".into(),
            VIOLATIONS_RING.to_string(),
            "--log-format".into(),
            "json".into(),
        ],
        events_jsonl: false,
    };
    let dir = o.out.join(row.name().replace('/', "-"));
    let run = start_row(row, None, &bins.revenant, &bins.pd_sim, dir.clone(), &setup);
    let admin = run.rev.admin_url();
    let pid = run.rev.pid();
    match metrics_of(&admin) {
        Ok(m) => {
            let mut names: BTreeMap<String, usize> = BTreeMap::new();
            for (series, _) in drop_series(&m) {
                let name = series.split('{').next().unwrap_or_default().to_string();
                *names.entry(name).or_default() += 1;
            }
            let names: Vec<String> = names
                .iter()
                .map(|(n, k)| format!("{n} ({k} series)"))
                .collect();
            eprintln!("soak: drop and loss counters summed: {}", names.join(", "));
        }
        Err(e) => panic!("revenant /metrics: {e:#}"),
    }

    let stop = AtomicBool::new(false);
    let mut vlog = ViolationLog::default();
    let t_load = Instant::now();
    let (load, points) = std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            sample_loop(
                &admin,
                pid,
                Duration::from_secs(o.sample_secs),
                &stop,
                &mut vlog,
            )
        });
        let load = test_harness::run_load(
            &bins.pd_sim,
            &run.router_url,
            &[
                "--api".to_string(),
                "sglang".to_string(),
                "--requests".to_string(),
                requests.to_string(),
                "--rate".into(),
                o.rate.to_string(),
                "--over-capacity-share".into(),
                o.over_capacity_share.to_string(),
                "--seed".into(),
                o.seed.to_string(),
                "--request-id-prefix".into(),
                "soak".into(),
            ],
            &dir.join("load.json"),
            true,
            Duration::from_secs_f64(o.minutes * 60.0 + 600.0),
            None,
        );
        stop.store(true, Ordering::Relaxed);
        let points = sampler.join().expect("sampler");
        (load, points)
    });
    let load = load
        .unwrap_or_else(|e| panic!("load: {e:#}"))
        .expect("not interrupted");
    let load_s = t_load.elapsed().as_secs_f64();

    let mut notes = Vec::new();
    let metrics = await_judgement(&run, &mut notes);
    if let Err(e) = vlog.poll(&admin) {
        panic!("/api/violations: {e:#}");
    }
    let final_rss = rss_kib(pid).unwrap_or(0);
    let finished = finish_row(run);
    let kept = finished.prefill.len().max(finished.decode.len());
    let result = judge(&finished, &vlog.items, &metrics, &load, notes, o.keep);

    println!();
    println!("{}", header());
    for p in &points {
        println!("{}", line(p));
    }
    // The curve at about a dozen points, for BENCHMARKS.md.
    let stride = points.len().div_ceil(15).max(1);
    println!();
    println!("compact curve (every {stride}th sample and the last):");
    println!(
        "| t (min) | RSS (MiB) | CPU (% of a core) | events/s | live attempts | tombstones | drops |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (i, p) in points.iter().enumerate() {
        if (i + 1) % stride == 0 || i + 1 == points.len() {
            println!(
                "| {:.1} | {:.1} | {:.1} | {:.0} | {} | {} | {} |",
                p.t_s / 60.0,
                p.rss_kib as f64 / 1024.0,
                p.cpu_pct,
                p.events_per_s,
                p.live_attempts,
                p.tombstones,
                p.drops
            );
        }
    }

    // Where memory went over the last third: RSS beside revenant's estimate of each bounded
    // structure, so that a rise is either one of them filling or something none of them counts.
    if let (Some(first), Some(last)) = (points.get(points.len() * 2 / 3), points.last()) {
        println!();
        println!(
            "memory over the last third ({:.1}–{:.1} min), MiB:",
            first.t_s / 60.0,
            last.t_s / 60.0
        );
        println!("| what | at its start | at the end | change |");
        println!("| --- | ---: | ---: | ---: |");
        let row = |what: &str, a: f64, b: f64| {
            println!("| {what} | {a:.1} | {b:.1} | {:+.1} |", b - a);
        };
        row(
            "RSS",
            first.rss_kib as f64 / 1024.0,
            last.rss_kib as f64 / 1024.0,
        );
        row(
            "of it in huge pages",
            first.huge_kib as f64 / 1024.0,
            last.huge_kib as f64 / 1024.0,
        );
        let structures: std::collections::BTreeSet<&String> = first
            .estimated
            .keys()
            .chain(last.estimated.keys())
            .collect();
        for k in structures {
            let at = |p: &Point| mib(p.estimated.get(k).copied().unwrap_or(0));
            row(&format!("estimated: {k}"), at(first), at(last));
        }
    }

    // An ended attempt is compacted to a tombstone once the watermark (the allowed lateness
    // behind the clock) is a linger (at least the lateness) past its last event.
    let warm_up_s =
        (TOMBSTONE_RETENTION + 2 * support::LATENESS).as_secs_f64() + o.sample_secs as f64;
    let final_drops: Vec<(String, f64)> = drop_series(&metrics)
        .into_iter()
        .filter(|(_, v)| *v > 0.0)
        .collect();
    let checks = [
        check(
            "zero drops",
            final_drops.is_empty() && finished.sim_losses == 0 && vlog.missed == 0,
            format!(
                "revenant {:?}; simulator spans dropped/failed {}; violations that left the ring unread {}",
                final_drops, finished.sim_losses, vlog.missed
            ),
        ),
        check(
            "oracle covers the run",
            (kept as u64) < room_log && result.expected > 0,
            format!(
                "the simulator kept {kept} room records (log of {room_log}: none pushed out); {} breaches injected",
                result.expected
            ),
        ),
        check(
            "zero false alerts",
            result.false_alerts == 0 && result.foreign == 0,
            format!(
                "{} false alerts ({} attempts); {} notifications about requests without a breach",
                result.false_alerts, result.false_attempts, result.foreign
            ),
        ),
        check(
            "every breach caught",
            result.caught == result.expected,
            format!("{} of {}", result.caught, result.expected),
        ),
        check(
            "one notification per breached request",
            result.repeated == 0 && result.unnotified == 0 && result.suppressed == 0,
            format!(
                "{} incident notifications for {} breached requests; {} notified more than once, {} not notified, {} rate-limit summaries",
                result.notifications,
                result.breached_requests,
                result.repeated,
                result.unnotified,
                result.suppressed
            ),
        ),
        flat(
            "RSS flat",
            "MiB",
            &points,
            (load_s, warm_up_s),
            |p| p.rss_kib as f64 / 1024.0,
            |mean, sd| (mean * 0.02).max(2.0 * sd),
            "2 % of the mean or twice the residual sd",
        ),
        flat(
            "CPU flat",
            "% of a core",
            &points,
            (load_s, warm_up_s),
            |p| p.cpu_pct,
            |mean, sd| (mean * 0.10).max(2.0 * sd),
            "10 % of the mean or twice the residual sd",
        ),
    ];

    println!();
    println!(
        "load: {} sent, {} ok, {} errors, rejected by status {}, {:.1}/s achieved over {:.1} min; revenant RSS at the end {:.1} MiB; wall {:.0} s",
        load["sent"],
        load["ok"],
        load["errors"],
        load["rejected_by_status"],
        load["achieved_rate"].as_f64().unwrap_or(0.0),
        load_s / 60.0,
        final_rss as f64 / 1024.0,
        result.wall_s
    );
    for n in &result.notes {
        println!("  {n}");
    }
    println!();
    let mut failed = Vec::new();
    for c in &checks {
        let word = match c.outcome {
            Outcome::Pass => "PASS",
            Outcome::Fail => "FAIL",
            Outcome::NotJudged => "NOT JUDGED",
        };
        println!("{word:>10}  {}: {}", c.name, c.detail);
        if !matches!(c.outcome, Outcome::Pass) {
            failed.push(c.name);
        }
    }
    if failed.is_empty() {
        println!("soak: every check passed");
    } else {
        println!("soak: not passed: {}", failed.join(", "));
        std::process::exit(1);
    }
}
