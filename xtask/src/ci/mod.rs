//! `cargo xtask test`: every test the project has, as CI runs it (`.ci/run`); `docs/testing.md`
//! says what each stage runs and how long it takes.
//!
//! ```text
//! setup ─► build (one: cargo test --release --no-run, every target) ─┬─ product: chart ─► privileges ─► image
//!                                                                     ├─ tests ×2: the test executables, longest first
//!                                                                     ├─ venvs ─► (the real-component tests join the queue)
//!                                                                     └─ fuzz (lowest priority): build ─► replay ─► fixed-seed runs
//! ```
//!
//! After the one build the stages run side by side. Each gets a range of loopback ports of its
//! own ([`test_harness::PORTS_ENV`], below the kernel's ephemeral range), so no two stages ever
//! race for a port. Test executables run as cargo would run them (`exec`), each with its output
//! in `target/ci/logs/`; at most one of those that load the machine ([`PROFILE`]: the
//! end-to-end runs under eBPF, the real SGLang) runs at a time, so their timing stays what a
//! quiet machine gives. Builds that only fill idle time (the fuzz targets, the build without
//! eBPF) run at the lowest CPU priority. The timings are printed at the end and written to
//! `target/ci/timings.json`; the wall time each executable took is kept in
//! `target/ci/durations.json` to order the next run's queue.

pub mod build;
mod exec;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};

use build::{Built, TestExe};
use exec::{Invocation, Ran};

/// Loopback port ranges, one per stage that runs side by side (`REVENANT_TEST_PORTS`), all
/// below `test_harness::DEFAULT_PORTS` and the kernel's ephemeral range.
const PORTS: &[(&str, u16, u16)] = &[
    ("xtask", 10000, 11999),
    ("tests-1", 12000, 13999),
    ("tests-2", 14000, 15999),
    ("fuzz", 16000, 17999),
];

/// Test executables that take long or load the machine: expected wall seconds on 2 cores (the
/// queue runs the longest first; `target/ci/durations.json` replaces these once measured), and
/// whether it is heavy (at most one heavy executable runs at a time). Unlisted ones are light
/// and short.
const PROFILE: &[(&str, u32, bool)] = &[
    ("e2e/pd_sim_revenant", 400, true),
    ("e2e/cluster_pd", 250, true),
    ("e2e/vllm_pd", 300, true),
    ("e2e/sglang_harness --ignored", 300, true),
    ("pd-sim/modes", 120, true),
    ("pd-sim/smg_1_13 --ignored", 120, true),
    ("pd-sim/real_router --ignored", 90, true),
    ("pd-sim/e2e_real_router --ignored", 90, true),
    ("pd-sim/e2e_capacity --ignored", 90, true),
    ("pd-sim/vllm_real_router --ignored", 60, true),
    ("pd-sim/interop --ignored", 30, false),
    ("pd-sim/sglang_interop --ignored", 30, false),
    ("pd-sim/vllm_interop --ignored", 30, false),
    ("revenant/ebpf_real_router --ignored", 90, true),
    ("revenant/build_without_ebpf", 300, false),
    ("revenant/cluster_faults", 200, false),
    // Four checkers, three NATS servers and agents, with a 3 s lease TTL: kept off a loaded
    // machine so that its takeovers are what the leases give.
    ("revenant/cluster_leases", 60, true),
    ("revenant/cluster_equivalence", 150, true),
    ("revenant/ebpf_sim", 120, true),
    ("revenant/run_ebpf", 90, true),
    ("revenant/ebpf_probe", 90, true),
    ("revenant/otlp_e2e", 90, false),
    ("revenant/alert_delivery", 90, false),
    ("revenant/prometheus_e2e", 90, false),
    ("revenant/alertmanager_e2e", 60, false),
    // Headless Chromium loads the pages six times (a browser start each).
    ("revenant/pages_browser", 30, false),
    ("revenant/order_property", 60, true),
    ("revenant/cancel_property", 60, true),
    ("revenant/lib", 60, false),
];

/// Executables whose ignored tests need the real components' venvs (`--ignored`): pd-sim's
/// real-router tests, revenant's `ebpf_real_router`, the end-to-end `vllm_pd` and SGLang.
const REAL_COMPONENTS: &[&str] = &[
    "pd-sim/real_router",
    "pd-sim/interop",
    "pd-sim/e2e_real_router",
    "pd-sim/e2e_capacity",
    "pd-sim/smg_1_13",
    "revenant/ebpf_real_router",
    "e2e/vllm_pd",
    "pd-sim/vllm_real_router",
    "e2e/sglang_harness",
    "pd-sim/sglang_interop",
    "pd-sim/vllm_interop",
];

/// Executables whose own work is a build: they run at the lowest CPU priority.
const NICE: &[&str] = &["revenant/build_without_ebpf"];

/// The most any one executable may take.
const LIMIT: Duration = Duration::from_secs(30 * 60);

/// A stage's start and end, for the timings table.
#[derive(Debug, Clone)]
struct Row {
    lane: String,
    stage: String,
    start: Duration,
    end: Duration,
    cpu: Option<f64>,
    ok: bool,
    note: String,
}

struct Timings {
    t0: Instant,
    rows: Mutex<Vec<Row>>,
}

impl Timings {
    fn step<T>(&self, lane: &str, stage: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let start = self.t0.elapsed();
        eprintln!("xtask: [{lane}] {stage} …");
        let r = f();
        let end = self.t0.elapsed();
        eprintln!(
            "xtask: [{lane}] {stage} {} ({:.0} s)",
            if r.is_ok() { "done" } else { "FAILED" },
            (end - start).as_secs_f64()
        );
        self.push(Row {
            lane: lane.into(),
            stage: stage.into(),
            start,
            end,
            cpu: None,
            ok: r.is_ok(),
            note: r
                .as_ref()
                .err()
                .map(|e| format!("{e:#}"))
                .unwrap_or_default(),
        });
        r
    }

    fn push(&self, row: Row) {
        self.rows
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(row);
    }
}

/// One test executable to run.
#[derive(Debug, Clone)]
struct Job {
    exe: TestExe,
    args: Vec<String>,
    /// Needs the real components' venvs (waits for them).
    real: bool,
    heavy: bool,
    nice: bool,
    expected: u32,
    label: String,
}

/// The queue the test lanes take jobs from, longest first.
struct Queue {
    state: Mutex<QueueState>,
    changed: Condvar,
}

struct QueueState {
    pending: Vec<Job>,
    /// The real components' environment once their venvs are ready (or why they are not).
    venvs: Option<std::result::Result<Vec<(String, PathBuf)>, String>>,
    heavy_running: bool,
    results: Vec<Ran>,
}

impl Queue {
    /// The next job this lane may run now, waiting until there is one; `None` when all are taken.
    fn take(&self) -> Option<(Job, Vec<(String, PathBuf)>)> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if s.pending.is_empty() {
                return None;
            }
            let venvs_ready = s.venvs.is_some();
            let pick = s
                .pending
                .iter()
                .position(|j| (!j.real || venvs_ready) && (!j.heavy || !s.heavy_running));
            if let Some(i) = pick {
                let job = s.pending.remove(i);
                if job.heavy {
                    s.heavy_running = true;
                }
                let env = match (&s.venvs, job.real) {
                    (Some(Ok(env)), true) => env.clone(),
                    _ => Vec::new(),
                };
                return Some((job, env));
            }
            s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn done(&self, job: &Job, ran: Ran) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if job.heavy {
            s.heavy_running = false;
        }
        s.results.push(ran);
        self.changed.notify_all();
    }

    fn venvs(&self, v: std::result::Result<Vec<(String, PathBuf)>, String>) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.venvs = Some(v);
        self.changed.notify_all();
    }

    /// Whether the venvs failed (their jobs cannot run).
    fn venv_error(&self) -> Option<String> {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match &s.venvs {
            Some(Err(e)) => Some(e.clone()),
            _ => None,
        }
    }
}

fn ci_dir() -> PathBuf {
    test_harness::workspace_root().join("target/ci")
}

fn ports(lane: &str) -> String {
    let (_, lo, hi) = PORTS
        .iter()
        .find(|(l, _, _)| *l == lane)
        .expect("a lane with ports");
    format!("{lo}-{hi}")
}

/// Wall seconds each executable took last time, where a run measured them.
fn measured() -> BTreeMap<String, u32> {
    std::fs::read_to_string(ci_dir().join("durations.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default()
}

fn jobs(built: &Built) -> Vec<Job> {
    let measured = measured();
    let mut jobs = Vec::new();
    for exe in &built.tests {
        let mut add = |args: Vec<String>, real: bool| {
            let label = if args.is_empty() {
                exe.name.clone()
            } else {
                format!("{} {}", exe.name, args.join(" "))
            };
            let profile = PROFILE.iter().find(|(n, _, _)| *n == label);
            jobs.push(Job {
                exe: exe.clone(),
                expected: measured
                    .get(&label)
                    .copied()
                    .or(profile.map(|p| p.1))
                    .unwrap_or(10),
                heavy: profile.is_some_and(|p| p.2),
                nice: NICE.contains(&exe.name.as_str()),
                args,
                real,
                label,
            });
        };
        add(Vec::new(), false);
        if exe.kind == "test" && REAL_COMPONENTS.contains(&exe.name.as_str()) {
            add(vec!["--ignored".into()], true);
        }
    }
    jobs.sort_by(|a, b| b.expected.cmp(&a.expected).then(a.label.cmp(&b.label)));
    jobs
}

/// The whole suite: what `.ci/run` runs.
pub fn run() -> Result<()> {
    let t = Timings {
        t0: Instant::now(),
        rows: Mutex::new(Vec::new()),
    };
    // This process's own servers (the chart's runs, NATS) take ports from a range of their own.
    // SAFETY: no other thread exists yet.
    unsafe { std::env::set_var(test_harness::PORTS_ENV, ports("xtask")) };
    t.step("main", "setup", crate::setup::run)?;
    let built = t.step("main", "build", build::build)?;
    eprintln!(
        "xtask: {} test executables; revenant {}, pd-sim {}",
        built.tests.len(),
        built.revenant.display(),
        built.pd_sim.display()
    );
    // The OpenTelemetry venv a test and the image stage use: cached, ready before they start.
    let otlp_python = t.step("main", "otlp venv", crate::venv::otlp_python)?;
    let common: Vec<(String, PathBuf)> = vec![
        ("REVENANT_BIN".into(), built.revenant.clone()),
        ("PD_SIM_BIN".into(), built.pd_sim.clone()),
    ];
    let queue = Queue {
        state: Mutex::new(QueueState {
            pending: jobs(&built),
            venvs: None,
            heavy_running: false,
            results: Vec::new(),
        }),
        changed: Condvar::new(),
    };
    let logs = ci_dir().join("logs");
    let _ = std::fs::remove_dir_all(&logs);
    let mut lane_errors = Vec::new();
    std::thread::scope(|s| {
        let product = s.spawn(|| {
            t.step("product", "chart", || crate::chart::run(&built.revenant))?;
            t.step("product", "privileges", || {
                crate::chart::privileges(&built.revenant)
            })?;
            t.step("product", "image", || {
                let built = crate::image::build(&built.revenant)?;
                crate::image::test(&built, &otlp_python)?;
                eprintln!("xtask: image {} ({}) tested", built.reference, built.id);
                Ok(())
            })
        });
        let venvs = s.spawn(|| {
            let r = t.step("venvs", "real-component venvs", || {
                crate::venv::real_components()
                    .map(|v| v.into_iter().map(|(k, p)| (k.to_owned(), p)).collect())
            });
            queue.venvs(r.map_err(|e| format!("{e:#}")));
        });
        let fuzz = s.spawn(|| {
            t.step("fuzz", "fuzz targets", || {
                crate::setup::fuzz_tools()?;
                crate::fuzz::ci(crate::fuzz::CI_RUNS).map(|_| ())
            })
        });
        let lanes: Vec<_> = ["tests-1", "tests-2"]
            .into_iter()
            .map(|lane| {
                let (queue, common, logs, t) = (&queue, &common, &logs, &t);
                s.spawn(move || test_lane(lane, queue, common, logs, t))
            })
            .collect();
        for (name, h) in [("product", product), ("fuzz", fuzz)] {
            if let Err(e) = h.join().unwrap_or_else(|_| Err(anyhow!("panicked"))) {
                lane_errors.push(format!("{name}: {e:#}"));
            }
        }
        let _ = venvs.join();
        for h in lanes {
            let _ = h.join();
        }
    });
    let state = queue.state.into_inner().unwrap_or_else(|p| p.into_inner());
    let results = state.results;
    save_durations(&results);
    let rows = t.rows.into_inner().unwrap_or_else(|p| p.into_inner());
    report(&rows, &results, t.t0.elapsed())?;
    let failed: Vec<&Ran> = results.iter().filter(|r| !r.ok).collect();
    for r in &failed {
        eprintln!(
            "\nxtask: {} FAILED ({}); the end of {}:\n{}",
            r.label,
            r.result,
            r.log.display(),
            exec::tail(&r.log, 60)
        );
    }
    if !failed.is_empty() || !lane_errors.is_empty() || !state.pending.is_empty() {
        bail!(
            "{} test executables failed{}{}",
            failed.len(),
            if lane_errors.is_empty() {
                String::new()
            } else {
                format!("; {}", lane_errors.join("; "))
            },
            if state.pending.is_empty() {
                String::new()
            } else {
                format!("; {} never ran", state.pending.len())
            }
        );
    }
    Ok(())
}

/// One lane of test executables: takes jobs until none is left.
fn test_lane(lane: &str, queue: &Queue, common: &[(String, PathBuf)], logs: &Path, t: &Timings) {
    let ports = ports(lane);
    while let Some((job, venv_env)) = queue.take() {
        let mut env = common.to_vec();
        env.push((test_harness::PORTS_ENV.into(), PathBuf::from(&ports)));
        env.extend(venv_env);
        let start = t.t0.elapsed();
        let ran = match (job.real, queue.venv_error()) {
            (true, Some(e)) => Ran {
                label: job.label.clone(),
                ok: false,
                wall: Duration::ZERO,
                cpu: 0.0,
                log: PathBuf::new(),
                result: format!("its venvs could not be made: {e}"),
            },
            _ => {
                let inv = Invocation {
                    exe: &job.exe,
                    args: &job.args,
                    env: &env,
                    nice: job.nice,
                    limit: LIMIT,
                    label: job.label.clone(),
                };
                exec::run(&inv, logs).unwrap_or_else(|e| Ran {
                    label: job.label.clone(),
                    ok: false,
                    wall: Duration::ZERO,
                    cpu: 0.0,
                    log: PathBuf::new(),
                    result: format!("{e:#}"),
                })
            }
        };
        eprintln!(
            "xtask: [{lane}] {} {} ({:.0} s, {:.0} s CPU)",
            job.label,
            if ran.ok { "ok" } else { "FAILED" },
            ran.wall.as_secs_f64(),
            ran.cpu
        );
        t.push(Row {
            lane: lane.into(),
            stage: job.label.clone(),
            start,
            end: t.t0.elapsed(),
            cpu: Some(ran.cpu),
            ok: ran.ok,
            note: ran.result.clone(),
        });
        queue.done(&job, ran);
    }
}

fn save_durations(results: &[Ran]) {
    let mut d = measured();
    for r in results.iter().filter(|r| r.ok) {
        d.insert(r.label.clone(), r.wall.as_secs().max(1) as u32);
    }
    if let Ok(text) = serde_json::to_string_pretty(&d) {
        let _ = std::fs::create_dir_all(ci_dir());
        let _ = std::fs::write(ci_dir().join("durations.json"), text);
    }
}

/// The timings table: every stage with its lane, start, end and duration, then the total.
fn report(rows: &[Row], results: &[Ran], total: Duration) -> Result<()> {
    let mut rows = rows.to_vec();
    rows.sort_by_key(|r| r.start);
    println!(
        "\n{:<9} {:<44} {:>7} {:>7} {:>7} {:>7}  result",
        "lane", "stage", "start", "end", "wall", "cpu"
    );
    for r in &rows {
        println!(
            "{:<9} {:<44} {:>6.0}s {:>6.0}s {:>6.0}s {:>7}  {}",
            r.lane,
            r.stage,
            r.start.as_secs_f64(),
            r.end.as_secs_f64(),
            (r.end - r.start).as_secs_f64(),
            r.cpu.map(|c| format!("{c:.0}s")).unwrap_or_default(),
            if r.ok { "ok" } else { "FAILED" }
        );
    }
    let tests_wall: f64 = results.iter().map(|r| r.wall.as_secs_f64()).sum();
    println!(
        "total {:.0} s (test executables: {} run, {:.0} s of wall time between them)",
        total.as_secs_f64(),
        results.len(),
        tests_wall
    );
    let json: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            serde_json::json!({
                "lane": r.lane, "stage": r.stage, "start_s": r.start.as_secs_f64(),
                "end_s": r.end.as_secs_f64(), "cpu_s": r.cpu, "ok": r.ok, "note": r.note,
            })
        })
        .collect();
    std::fs::create_dir_all(ci_dir())?;
    std::fs::write(
        ci_dir().join("timings.json"),
        serde_json::to_string_pretty(&serde_json::json!({
            "total_s": total.as_secs_f64(), "stages": json,
        }))?,
    )?;
    Ok(())
}

/// `cargo xtask test ARGS…`: the one build, then `cargo test` over the same selection with
/// those arguments (a filter, `-- --ignored`, …), the binaries handed over as in a full run.
pub fn filtered(args: &[String]) -> Result<()> {
    crate::setup::run()?;
    let built = build::build()?;
    let status = crate::cargo::command()
        .arg("test")
        .args(build::SELECTION)
        .args(args)
        .env("REVENANT_BIN", &built.revenant)
        .env("PD_SIM_BIN", &built.pd_sim)
        .status()?;
    if !status.success() {
        bail!("tests failed ({status})");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(label: &str, heavy: bool, real: bool, expected: u32) -> Job {
        Job {
            exe: TestExe {
                name: label.into(),
                package: "p".into(),
                target: label.into(),
                kind: "test".into(),
                exe: PathBuf::from("/bin/true"),
                manifest_dir: PathBuf::from("/"),
            },
            args: Vec::new(),
            real,
            heavy,
            nice: false,
            expected,
            label: label.into(),
        }
    }

    fn queue(jobs: Vec<Job>) -> Queue {
        Queue {
            state: Mutex::new(QueueState {
                pending: jobs,
                venvs: None,
                heavy_running: false,
                results: Vec::new(),
            }),
            changed: Condvar::new(),
        }
    }

    fn ran(label: &str) -> Ran {
        Ran {
            label: label.into(),
            ok: true,
            wall: Duration::ZERO,
            cpu: 0.0,
            log: PathBuf::new(),
            result: String::new(),
        }
    }

    #[test]
    fn one_heavy_job_at_a_time_and_real_ones_wait_for_their_venvs() {
        let q = queue(vec![
            job("heavy-a", true, false, 300),
            job("heavy-b", true, false, 200),
            job("real", false, true, 100),
            job("light", false, false, 10),
        ]);
        let (a, _) = q.take().unwrap();
        assert_eq!(a.label, "heavy-a");
        // heavy-b must wait for heavy-a, the real one for its venvs: the light one is next.
        let (b, _) = q.take().unwrap();
        assert_eq!(b.label, "light");
        std::thread::scope(|s| {
            let waiter = s.spawn(|| q.take().map(|(j, env)| (j.label, env)));
            std::thread::sleep(Duration::from_millis(50));
            q.venvs(Ok(vec![("PD_SIM_SMG".into(), PathBuf::from("/x/smg"))]));
            let (label, env) = waiter.join().unwrap().unwrap();
            assert_eq!(label, "real");
            assert_eq!(
                env,
                vec![("PD_SIM_SMG".to_owned(), PathBuf::from("/x/smg"))]
            );
        });
        std::thread::scope(|s| {
            let waiter = s.spawn(|| q.take().map(|(j, _)| j.label));
            std::thread::sleep(Duration::from_millis(50));
            q.done(&a, ran("heavy-a"));
            assert_eq!(waiter.join().unwrap().as_deref(), Some("heavy-b"));
        });
        assert!(q.take().is_none());
    }

    #[test]
    fn failed_venvs_are_reported_to_the_jobs_that_need_them() {
        let q = queue(vec![job("real", false, true, 100)]);
        q.venvs(Err("pip failed".into()));
        let (j, env) = q.take().unwrap();
        assert_eq!(j.label, "real");
        assert!(env.is_empty());
        assert_eq!(q.venv_error().as_deref(), Some("pip failed"));
    }

    #[test]
    fn every_stage_has_a_port_range_of_its_own_below_the_defaults() {
        for (i, (_, lo, hi)) in PORTS.iter().enumerate() {
            assert!(lo <= hi);
            assert!(*hi < test_harness::DEFAULT_PORTS.0);
            for (_, lo2, hi2) in &PORTS[i + 1..] {
                assert!(hi < lo2 || hi2 < lo, "ranges overlap");
            }
        }
    }
}
