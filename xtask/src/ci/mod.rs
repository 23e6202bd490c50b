//! `cargo xtask test`: every test the project has, as CI runs it (`.ci/run`); `docs/testing.md`
//! says what each stage runs and how long it takes.
//!
//! ```text
//! setup ─► build (one: cargo test --profile ci --no-run, every target, below the tests' priority)
//!            ├─ tests ×2: each test executable joins the queue as the build makes it (with both
//!            │            binaries); the lanes take the heavy ones first, then the longest
//!            ├─ timed: the executables that judge timers of seconds with little CPU, one at a time
//!            ├─ builds: the test executables whose work is a build (lowest priority)
//!            ├─ venvs ─► (the real-component tests join the queue)
//!            ├─ (both binaries made) ─► fuzz (lowest priority): build ─► replay ─► fixed-seed runs
//!            └─ (built) ─► product: chart ─► privileges ─► image
//! ```
//!
//! The stages run side by side, and the tests start before the build ends: the long end-to-end
//! runs mostly wait, and the compilers take what they leave. Each stage gets a range of loopback
//! ports of its own ([`test_harness::PORTS_ENV`], below the kernel's ephemeral range), so no two
//! stages ever race for a port. Test executables run as cargo would run them (`exec`), each with
//! its output in `target/ci/logs/`; at most one of those that load the machine ([`PROFILE`]: the
//! end-to-end runs under eBPF, the real SGLang) runs at a time, so their timing stays what a
//! quiet machine gives; those that judge timers with a fraction of a core run beside it, in a
//! lane of their own. Builds that only fill idle time (the rest of the main build once tests
//! run, the fuzz targets, the build without eBPF) run below the tests' priority. The timings are
//! printed at the end and written to `target/ci/timings.json`; the wall time each executable took
//! is kept in `target/ci/durations.json` to order the next run's queue.

pub mod build;
mod exec;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};

use build::TestExe;
use exec::{Invocation, Ran};

/// Loopback port ranges, one per stage that runs side by side (`REVENANT_TEST_PORTS`), all
/// below `test_harness::DEFAULT_PORTS` and the kernel's ephemeral range.
const PORTS: &[(&str, u16, u16)] = &[
    ("xtask", 10000, 11999),
    ("tests-1", 12000, 13999),
    ("tests-2", 14000, 15999),
    ("fuzz", 16000, 17999),
    ("builds", 18000, 19999),
    ("timed", 20000, 21999),
];

/// How a test executable loads the machine, which decides what may run beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Load {
    /// Short, or mostly waiting on little work: runs beside anything.
    Light,
    /// Pushes load through several processes, or judges timing that load would skew: at most
    /// one heavy job at a time, in a test lane, with light ones beside it and no timed one.
    Heavy,
    /// Heavy, at rates that leave room for a timed job beside it.
    HeavyWithRoom,
    /// Judges timers of seconds (a real router's retries and timeouts, a checker's leases) with
    /// a fraction of a core: one at a time in a lane of their own, beside light jobs or a
    /// [`Load::HeavyWithRoom`] one, so that they leave the heavy chain (the tests' critical
    /// path).
    Timed,
}

use Load::{Heavy, HeavyWithRoom, Light, Timed};

impl Load {
    fn heavy(self) -> bool {
        matches!(self, Heavy | HeavyWithRoom)
    }
}

/// Test executables that take long or load the machine: expected wall seconds on 2 cores (the
/// queue runs the longest first; `target/ci/durations.json` replaces these once measured), and
/// their [`Load`]. Heavy ones never run side by side. Not even the two longest, which mostly
/// wait on their windows: they kept every verdict side by side on one VM of this kind, but on
/// another that needed 1.36 times the CPU time for the whole run, `pd_sim_revenant`'s revenant
/// fell behind beside `cluster_pd` (its kernel ring buffer full at 137 requests/s, and eBPF's
/// lead on room collisions lost). Nor a timed one beside a heavy one at hundreds of requests a
/// second: beside the timed ones, `pd_sim_revenant`'s revenant lost 71 000 of its 84 000 kernel
/// records at 1 000 requests/s (ring buffer full), while `cluster_pd` (50–200 requests/s) kept
/// every verdict beside them, and they theirs. The light ones may run beside any: the long ones
/// among them mostly wait (real routers' timeouts, revenant's windows) and use a few seconds of
/// CPU in a minute; every eBPF test watches its own processes by pid, so none sees another's
/// traffic. Unlisted ones are light and short.
const PROFILE: &[(&str, u32, Load)] = &[
    ("e2e/pd_sim_revenant", 240, Heavy),
    ("e2e/cluster_pd", 210, HeavyWithRoom),
    ("e2e/vllm_pd", 100, Heavy),
    // The real vllm-router at up to 500 requests/s: load, as its simulated twin is.
    ("e2e/vllm_pd --ignored", 70, Heavy),
    ("e2e/sglang_harness --ignored", 115, Heavy),
    // smg's retries, its cancelled decode legs and revenant's 6 s windows: 31 CPU s in 97 s.
    ("pd-sim/smg_1_13 --ignored", 100, Timed),
    ("pd-sim/modes", 15, Timed),
    ("pd-sim/sglang_router --ignored", 90, Light),
    ("pd-sim/e2e_real_router --ignored", 90, Light),
    ("pd-sim/e2e_capacity --ignored", 90, Light),
    ("pd-sim/vllm_real_router --ignored", 60, Light),
    ("pd-sim/zmq_interop --ignored", 30, Light),
    // SGLang's and vLLM's own Python modules: most of a core for their 15 s (12–13 CPU s).
    // Beside them, `e2e/vllm_pd`'s revenant fell behind its ring at 500 requests/s (9 509
    // records dropped).
    ("pd-sim/sglang_interop --ignored", 15, Heavy),
    ("pd-sim/vllm_interop --ignored", 15, Heavy),
    // The real router's retries and a decode leg held 7 s against a 6 s window: its verdicts
    // hang on the simulator's and smg's timers (13 CPU s in 55 s).
    ("revenant/ebpf_real_router --ignored", 60, Timed),
    ("revenant/build_without_ebpf", 300, Light),
    ("revenant/cluster_faults", 200, Light),
    // Four checkers, three NATS servers and agents, with a 3 s lease TTL: its takeovers must
    // be what the leases give (6 CPU s in 31 s).
    ("revenant/cluster_leases", 35, Timed),
    ("revenant/cluster_equivalence", 30, Heavy),
    ("revenant/ebpf_sim", 10, Heavy),
    ("revenant/run_ebpf", 14, Heavy),
    ("revenant/ebpf_probe", 20, Heavy),
    ("revenant/otlp_e2e", 90, Light),
    ("revenant/alert_delivery", 90, Light),
    ("revenant/prometheus_e2e", 90, Light),
    ("revenant/alertmanager_e2e", 60, Light),
    // Headless Chromium loads the pages seven times (a browser start each).
    ("revenant/pages_browser", 30, Light),
    ("revenant/order_property", 60, Heavy),
    ("revenant/cancel_property", 60, Heavy),
    ("revenant/lib", 60, Light),
];

/// Executables whose ignored tests need the real components' venvs (`--ignored`): pd-sim's
/// real-router tests, revenant's `ebpf_real_router`, the end-to-end `vllm_pd` and SGLang.
const REAL_COMPONENTS: &[&str] = &[
    "pd-sim/sglang_router",
    "pd-sim/zmq_interop",
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
    load: Load,
    nice: bool,
    expected: u32,
    label: String,
}

/// What a lane runs: heavy and light test executables; the timed ones ([`Load::Timed`]); or
/// the executables whose own work is a build ([`NICE`]), which run below the tests' priority in
/// a lane of their own so that their minutes of compiling never hold a test lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LaneKind {
    Tests,
    Timed,
    Builds,
}

impl LaneKind {
    fn runs(self, job: &Job) -> bool {
        match self {
            LaneKind::Builds => job.nice,
            LaneKind::Timed => !job.nice && job.load == Timed,
            LaneKind::Tests => !job.nice && job.load != Timed,
        }
    }
}

/// The queue the test lanes take jobs from, longest first.
struct Queue {
    state: Mutex<QueueState>,
    changed: Condvar,
}

struct QueueState {
    pending: Vec<Job>,
    /// The build is still running: more jobs may come.
    building: bool,
    /// The real components' environment once their venvs are ready (or why they are not).
    venvs: Option<std::result::Result<Vec<(String, PathBuf)>, String>>,
    /// What every test executable is given: the binaries (`REVENANT_BIN`, `PD_SIM_BIN`).
    common: Vec<(String, PathBuf)>,
    /// The heavy job running, if one is.
    heavy_running: Option<Load>,
    /// A timed job is running.
    timed_running: bool,
    results: Vec<Ran>,
}

impl Queue {
    /// The next job a lane of `kind` may run now, waiting until there is one; `None` when all
    /// of its kind are taken and the build will bring no more.
    ///
    /// A heavy job goes first whenever none runs: the heavy ones run one after another, so
    /// their chain is the tests' critical path, and the light ones fill the other lane beside
    /// it (taken longest first, a long light job would hold the chain up for its whole run).
    /// A timed job waits while a heavy one without room runs or could start, and such a heavy
    /// one while a timed one runs; with timed jobs waiting, a heavy one with room goes first
    /// ([`Load`]).
    fn take(&self, kind: LaneKind) -> Option<(Job, Vec<(String, PathBuf)>)> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let mine = |j: &Job| kind.runs(j);
            if !s.pending.iter().any(mine) && !s.building {
                return None;
            }
            let venvs_ready = s.venvs.is_some();
            let ready = |j: &Job| !j.real || venvs_ready;
            // The heavy chain goes first: with none running, a timed job waits for a heavy one
            // that could start (that one may need the machine to itself).
            let heavy_waiting =
                s.heavy_running.is_none() && s.pending.iter().any(|j| j.load.heavy() && ready(j));
            let timed_waiting = s.pending.iter().any(|j| j.load == Timed && ready(j));
            let may = |j: &Job| {
                mine(j)
                    && ready(j)
                    && match j.load {
                        Light => true,
                        Heavy => s.heavy_running.is_none() && !s.timed_running,
                        HeavyWithRoom => s.heavy_running.is_none(),
                        Timed => match s.heavy_running {
                            Some(load) => load == HeavyWithRoom,
                            None => !heavy_waiting,
                        },
                    }
            };
            // With timed jobs waiting, a heavy one with room goes first: they run beside it.
            let heavy = timed_waiting
                .then(|| {
                    s.pending
                        .iter()
                        .position(|j| may(j) && j.load == HeavyWithRoom)
                })
                .flatten()
                .or_else(|| s.pending.iter().position(|j| may(j) && j.load.heavy()));
            let pick = heavy.or_else(|| s.pending.iter().position(|j| may(j) && !j.load.heavy()));
            if let Some(i) = pick {
                let job = s.pending.remove(i);
                if job.load.heavy() {
                    s.heavy_running = Some(job.load);
                }
                if job.load == Timed {
                    s.timed_running = true;
                }
                let mut env = s.common.clone();
                if let (Some(Ok(venv)), true) = (&s.venvs, job.real) {
                    env.extend(venv.iter().cloned());
                }
                return Some((job, env));
            }
            s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Jobs the build has just made, queued longest first among those waiting.
    fn add(&self, jobs: Vec<Job>) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.pending.extend(jobs);
        s.pending
            .sort_by(|a, b| b.expected.cmp(&a.expected).then(a.label.cmp(&b.label)));
        self.changed.notify_all();
    }

    /// The build ended (made everything, or failed): no more jobs will come.
    fn built(&self) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.building = false;
        self.changed.notify_all();
    }

    fn done(&self, job: &Job, ran: Ran) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if job.load.heavy() {
            s.heavy_running = None;
        }
        if job.load == Timed {
            s.timed_running = false;
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

/// Test executables that hold several test files as modules (`monitor/tests/suite`,
/// `tests/pd-sim/tests/suite`: compiled and linked once instead of once per file). Each module is
/// a job of its own, labelled as its own executable would be (`revenant/binary`), so the queue
/// orders, times and profiles it as one.
const SUITES: &[&str] = &["revenant/suite", "pd-sim/suite"];

/// The jobs of one test executable: its tests, and its ignored ones where they need the real
/// components; a suite's, one pair per module.
fn jobs(exe: &TestExe, measured: &BTreeMap<String, u32>) -> Vec<Job> {
    if !SUITES.contains(&exe.name.as_str()) {
        return module_jobs(exe, &exe.name, Vec::new(), measured);
    }
    match suite_modules(exe) {
        Ok(modules) => modules
            .into_iter()
            .flat_map(|(module, names)| {
                let label = match module {
                    Some(m) => format!("{}/{m}", exe.package),
                    None => exe.name.clone(),
                };
                let mut filter = vec!["--exact".to_owned()];
                filter.extend(names);
                module_jobs(exe, &label, filter, measured)
            })
            .collect(),
        Err(e) => {
            // Every test still runs, in one job: only the queue's order is lost.
            eprintln!(
                "xtask: listing {}'s tests failed ({e:#}); it runs as one job",
                exe.name
            );
            module_jobs(exe, &exe.name, Vec::new(), measured)
        }
    }
}

/// A suite's tests by module (the first segment of each test's path; `None` for tests at the
/// crate's root), from the executable's own `--list`.
fn suite_modules(exe: &TestExe) -> Result<BTreeMap<Option<String>, Vec<String>>> {
    let out = std::process::Command::new(&exe.exe)
        .args(["--list", "--format", "terse"])
        .current_dir(&exe.manifest_dir)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| anyhow!("running {} --list: {e}", exe.exe.display()))?;
    if !out.status.success() {
        bail!("{} --list exited with {}", exe.exe.display(), out.status);
    }
    let listed = String::from_utf8_lossy(&out.stdout);
    let modules = modules_of(&listed);
    if modules.is_empty() {
        bail!("{} --list named no test", exe.exe.display());
    }
    Ok(modules)
}

/// Test names grouped by module, from libtest's `--list --format terse` (`cli::name: test`).
fn modules_of(listed: &str) -> BTreeMap<Option<String>, Vec<String>> {
    let mut modules: BTreeMap<Option<String>, Vec<String>> = BTreeMap::new();
    for name in listed.lines().filter_map(|l| l.strip_suffix(": test")) {
        let module = name.split_once("::").map(|(m, _)| m.to_owned());
        modules.entry(module).or_default().push(name.to_owned());
    }
    modules
}

/// The jobs of one executable's tests (`filter`: the arguments that select them, empty for all)
/// under `label`: the tests, and the ignored ones where they need the real components.
fn module_jobs(
    exe: &TestExe,
    label: &str,
    filter: Vec<String>,
    measured: &BTreeMap<String, u32>,
) -> Vec<Job> {
    let mut jobs = Vec::new();
    // Its ignored tests too: they are the same build's work.
    let nice = NICE.contains(&label);
    let mut add = |label: String, args: Vec<String>, real: bool| {
        let profile = PROFILE.iter().find(|(n, _, _)| *n == label);
        jobs.push(Job {
            exe: exe.clone(),
            expected: measured
                .get(&label)
                .copied()
                .or(profile.map(|p| p.1))
                .unwrap_or(10),
            load: profile.map_or(Light, |p| p.2),
            nice,
            args,
            real,
            label,
        });
    };
    add(label.to_owned(), filter.clone(), false);
    if exe.kind == "test" && REAL_COMPONENTS.contains(&label) {
        let mut args = vec!["--ignored".to_owned()];
        args.extend(filter);
        add(format!("{label} --ignored"), args, true);
    }
    jobs
}

/// The packages whose binaries the tests run (`REVENANT_BIN`, `PD_SIM_BIN`). `cargo test`
/// builds a package's binaries as binaries (not as their own unit tests) only for its integration
/// tests (`CARGO_BIN_EXE_*`), so the first wave holds one heavy test target of each.
const BINARY_PACKAGES: &[&str] = &["revenant", "pd-sim"];

/// The test targets of the heavy and timed executables (`PROFILE`), in the waves the build
/// makes them before everything else: first the one the queue runs first (a heavy one with room,
/// which the timed ones run beside, then the longest expected, `measured` where a run measured
/// it) with the two binaries (and so with the first such target of each of their packages), so
/// that the heavy chain, the tests' critical path, starts as early as the binaries allow; then
/// the rest of them, ready before the first has run (minutes), ahead of the rest of the build.
fn heavy_targets(measured: &BTreeMap<String, u32>) -> Vec<Vec<&'static str>> {
    let mut heavy: Vec<(&str, &str, u32, Load)> = PROFILE
        .iter()
        .filter(|(_, _, load)| *load != Light)
        .filter_map(|(label, expected, load)| {
            let (package, target) = label.split_whitespace().next()?.split_once('/')?;
            let expected = measured.get(*label).copied().unwrap_or(*expected);
            Some((package, target, expected, *load))
        })
        .filter(|(_, t, _, _)| *t != "lib" && is_test_target(t))
        .collect();
    heavy.sort_by(|a, b| {
        (a.3 != HeavyWithRoom)
            .cmp(&(b.3 != HeavyWithRoom))
            .then(b.2.cmp(&a.2))
            .then(a.1.cmp(b.1))
    });
    let mut chain: Vec<(&str, &str)> = Vec::new();
    for (package, target, _, _) in heavy {
        if !chain.iter().any(|(_, t)| *t == target) {
            chain.push((package, target));
        }
    }
    let Some(&(_, first)) = chain.first() else {
        return Vec::new();
    };
    let mut wave: Vec<&str> = vec![first];
    for package in BINARY_PACKAGES {
        if let Some(&(_, t)) = chain.iter().find(|(p, _)| p == package)
            && !wave.contains(&t)
        {
            wave.push(t);
        }
    }
    let rest: Vec<&str> = chain
        .iter()
        .map(|(_, t)| *t)
        .filter(|t| !wave.contains(t))
        .collect();
    if rest.is_empty() {
        vec![wave]
    } else {
        vec![wave, rest]
    }
}

/// Whether `name` is an integration test target of its own (`cargo test --test NAME`), not a
/// module of a package's `suite` (whose label reads the same, `pd-sim/vllm_interop`).
fn is_test_target(name: &str) -> bool {
    let root = test_harness::workspace_root();
    TEST_DIRS
        .iter()
        .any(|d| root.join(d).join(format!("{name}.rs")).is_file())
}

/// Where the workspace's integration test targets are, one file each.
const TEST_DIRS: &[&str] = &["monitor/tests", "tests/pd-sim/tests", "tests/e2e/tests"];

/// Hands the build's executables to the queue as they land: the test executables once both
/// binaries they may start (`REVENANT_BIN`, `PD_SIM_BIN`) exist.
struct Feeder<'a> {
    queue: &'a Queue,
    /// Told once both binaries exist (the heavy tests can start): the fuzz stage's cue.
    binaries_made: Option<std::sync::mpsc::Sender<()>>,
    measured: BTreeMap<String, u32>,
    revenant: Option<PathBuf>,
    pd_sim: Option<PathBuf>,
    waiting: Vec<TestExe>,
}

impl Feeder<'_> {
    fn take(&mut self, a: build::Artifact) {
        match a {
            build::Artifact::Revenant(p) => self.revenant = Some(p),
            build::Artifact::PdSim(p) => self.pd_sim = Some(p),
            build::Artifact::Test(t) => self.waiting.push(t),
        }
        let (Some(revenant), Some(pd_sim)) = (&self.revenant, &self.pd_sim) else {
            return;
        };
        if let Some(cue) = self.binaries_made.take() {
            let _ = cue.send(());
        }
        if self.waiting.is_empty() {
            return;
        }
        {
            let mut s = self.queue.state.lock().unwrap_or_else(|p| p.into_inner());
            if s.common.is_empty() {
                s.common = vec![
                    ("REVENANT_BIN".into(), revenant.clone()),
                    ("PD_SIM_BIN".into(), pd_sim.clone()),
                ];
            }
        }
        let jobs = std::mem::take(&mut self.waiting)
            .iter()
            .flat_map(|t| jobs(t, &self.measured))
            .collect();
        self.queue.add(jobs);
    }
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
    // The OpenTelemetry venv a test and the image stage use: cached, ready before they start.
    let otlp_python = t.step("main", "otlp venv", crate::venv::otlp_python)?;
    let queue = Queue {
        state: Mutex::new(QueueState {
            pending: Vec::new(),
            building: true,
            venvs: None,
            common: Vec::new(),
            heavy_running: None,
            timed_running: false,
            results: Vec::new(),
        }),
        changed: Condvar::new(),
    };
    let logs = ci_dir().join("logs");
    let _ = std::fs::remove_dir_all(&logs);
    let mut lane_errors = Vec::new();
    std::thread::scope(|s| {
        // The lanes start each test executable as soon as the build has made it (and the two
        // binaries): the long end-to-end runs mostly wait, and overlap the rest of the build,
        // which runs below their priority.
        let lanes: Vec<_> = [
            ("tests-1", LaneKind::Tests),
            ("tests-2", LaneKind::Tests),
            ("timed", LaneKind::Timed),
            ("builds", LaneKind::Builds),
        ]
        .into_iter()
        .map(|(lane, kind)| {
            let (queue, logs, t) = (&queue, &logs, &t);
            s.spawn(move || test_lane(lane, kind, queue, logs, t))
        })
        .collect();
        let venvs = s.spawn(|| {
            let r = t.step("venvs", "real-component venvs", || {
                crate::venv::real_components()
                    .map(|v| v.into_iter().map(|(k, p)| (k.to_owned(), p)).collect())
            });
            queue.venvs(r.map_err(|e| format!("{e:#}")));
        });
        // The fuzz targets' build (another toolchain, its own target directory) starts once the
        // main build has made what the heavy tests need, and shares the rest of it at the same
        // lowest priority: left to the end, it was the run's last minutes.
        let (cue, binaries_made) = std::sync::mpsc::channel();
        let tf = &t;
        let fuzz = s.spawn(move || {
            let _ = binaries_made.recv();
            tf.step("fuzz", "fuzz targets", || {
                crate::setup::fuzz_tools()?;
                crate::fuzz::ci(crate::fuzz::CI_RUNS).map(|_| ())
            })
        });
        let mut feeder = Feeder {
            queue: &queue,
            binaries_made: Some(cue),
            measured: measured(),
            revenant: None,
            pd_sim: None,
            waiting: Vec::new(),
        };
        let waves = heavy_targets(&feeder.measured);
        let built = t.step("main", "build", || {
            build::build_reporting(true, &waves, |a| feeder.take(a))
        });
        queue.built();
        let built = match built {
            Ok(b) => b,
            Err(e) => {
                lane_errors.push(format!("build: {e:#}"));
                let _ = venvs.join();
                for h in lanes {
                    let _ = h.join();
                }
                return;
            }
        };
        eprintln!(
            "xtask: {} test executables; revenant {}, pd-sim {}",
            built.tests.len(),
            built.revenant.display(),
            built.pd_sim.display()
        );
        let (revenant, t, otlp_python) = (built.revenant, &t, &otlp_python);
        let product = s.spawn(move || {
            t.step("product", "chart", || crate::chart::run(&revenant))?;
            t.step("product", "privileges", || {
                crate::chart::privileges(&revenant)
            })?;
            t.step("product", "image", || {
                let built = crate::image::build(&revenant)?;
                crate::image::test(&built, otlp_python)?;
                eprintln!("xtask: image {} ({}) tested", built.reference, built.id);
                Ok(())
            })
        });
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
fn test_lane(lane: &str, kind: LaneKind, queue: &Queue, logs: &Path, t: &Timings) {
    let ports = ports(lane);
    while let Some((job, given)) = queue.take(kind) {
        let mut env = given;
        env.push((test_harness::PORTS_ENV.into(), PathBuf::from(&ports)));
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

    fn job(label: &str, load: Load, real: bool, expected: u32) -> Job {
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
            load,
            nice: false,
            expected,
            label: label.into(),
        }
    }

    fn queue(jobs: Vec<Job>) -> Queue {
        Queue {
            state: Mutex::new(QueueState {
                pending: jobs,
                building: false,
                venvs: None,
                common: Vec::new(),
                heavy_running: None,
                timed_running: false,
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
            job("heavy-a", Heavy, false, 300),
            job("heavy-b", Heavy, false, 200),
            job("real", Light, true, 100),
            job("light", Light, false, 10),
        ]);
        let (a, _) = q.take(LaneKind::Tests).unwrap();
        assert_eq!(a.label, "heavy-a");
        // heavy-b must wait for heavy-a, the real one for its venvs: the light one is next.
        let (b, _) = q.take(LaneKind::Tests).unwrap();
        assert_eq!(b.label, "light");
        std::thread::scope(|s| {
            let waiter = s.spawn(|| q.take(LaneKind::Tests).map(|(j, env)| (j.label, env)));
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
            let waiter = s.spawn(|| q.take(LaneKind::Tests).map(|(j, _)| j.label));
            std::thread::sleep(Duration::from_millis(50));
            q.done(&a, ran("heavy-a"));
            assert_eq!(waiter.join().unwrap().as_deref(), Some("heavy-b"));
        });
        assert!(q.take(LaneKind::Tests).is_none());
    }

    #[test]
    fn a_heavy_job_goes_before_longer_light_ones_whenever_none_runs() {
        let q = queue(vec![
            job("light-long", Light, false, 500),
            job("heavy-a", Heavy, false, 200),
            job("heavy-b", Heavy, false, 100),
            job("light-short", Light, false, 10),
        ]);
        let (a, _) = q.take(LaneKind::Tests).unwrap();
        assert_eq!(a.label, "heavy-a", "the heavy chain starts at once");
        let (b, _) = q.take(LaneKind::Tests).unwrap();
        assert_eq!(
            b.label, "light-long",
            "beside a heavy one: the longest light one"
        );
        q.done(&a, ran("heavy-a"));
        let (c, _) = q.take(LaneKind::Tests).unwrap();
        assert_eq!(c.label, "heavy-b");
    }

    #[test]
    fn timed_jobs_run_one_at_a_time_in_their_own_lane_beside_a_heavy_one_with_room() {
        let q = queue(vec![
            job("heavy", Heavy, false, 300),
            job("roomy", HeavyWithRoom, false, 200),
            job("timed-a", Timed, false, 100),
            job("timed-b", Timed, false, 50),
            job("light", Light, false, 10),
        ]);
        let (roomy, _) = q.take(LaneKind::Tests).unwrap();
        assert_eq!(
            roomy.label, "roomy",
            "with timed jobs waiting, the heavy one with room goes first"
        );
        let (timed, _) = q.take(LaneKind::Timed).unwrap();
        assert_eq!(timed.label, "timed-a", "beside it, the longest timed one");
        let (light, _) = q.take(LaneKind::Tests).unwrap();
        assert_eq!(
            light.label, "light",
            "one heavy job at a time; no timed one in a test lane"
        );
        q.done(&roomy, ran("roomy"));
        std::thread::scope(|s| {
            let heavy = s.spawn(|| q.take(LaneKind::Tests).map(|(j, _)| j));
            std::thread::sleep(Duration::from_millis(50));
            assert!(
                !heavy.is_finished(),
                "a heavy job without room waits for the timed one"
            );
            q.done(&timed, ran("timed-a"));
            let heavy = heavy.join().unwrap().unwrap();
            assert_eq!(heavy.label, "heavy");
            let timed = s.spawn(|| q.take(LaneKind::Timed).map(|(j, _)| j.label));
            std::thread::sleep(Duration::from_millis(50));
            assert!(
                !timed.is_finished(),
                "nothing timed beside a heavy job without room"
            );
            q.done(&heavy, ran("heavy"));
            assert_eq!(timed.join().unwrap().as_deref(), Some("timed-b"));
        });
        assert!(q.take(LaneKind::Tests).is_none());
    }

    #[test]
    fn a_timed_job_waits_for_a_heavy_one_that_could_start() {
        let q = queue(vec![
            job("heavy", Heavy, false, 300),
            job("timed", Timed, false, 100),
        ]);
        std::thread::scope(|s| {
            let timed = s.spawn(|| q.take(LaneKind::Timed).map(|(j, _)| j.label));
            std::thread::sleep(Duration::from_millis(50));
            assert!(!timed.is_finished(), "the heavy chain goes first");
            let (heavy, _) = q.take(LaneKind::Tests).unwrap();
            assert_eq!(heavy.label, "heavy");
            std::thread::sleep(Duration::from_millis(50));
            assert!(
                !timed.is_finished(),
                "and runs without a timed job beside it"
            );
            q.done(&heavy, ran("heavy"));
            assert_eq!(timed.join().unwrap().as_deref(), Some("timed"));
        });
    }

    #[test]
    fn build_jobs_have_a_lane_of_their_own() {
        let mut build = job("revenant/build_without_ebpf", Light, false, 600);
        build.nice = true;
        let q = queue(vec![build, job("light", Light, false, 10)]);
        let (j, _) = q.take(LaneKind::Tests).unwrap();
        assert_eq!(j.label, "light", "a test lane never takes a build");
        assert!(
            q.take(LaneKind::Tests).is_none(),
            "nothing left for a test lane once the build has ended"
        );
        let (j, _) = q.take(LaneKind::Builds).unwrap();
        assert_eq!(j.label, "revenant/build_without_ebpf");
        assert!(q.take(LaneKind::Builds).is_none());
    }

    fn exe(name: &str) -> TestExe {
        job(name, Light, false, 10).exe
    }

    #[test]
    fn lanes_wait_for_the_build_and_its_binaries_and_stop_when_it_ends() {
        let q = queue(Vec::new());
        q.state.lock().unwrap().building = true;
        let (cue, binaries_made) = std::sync::mpsc::channel();
        let mut feeder = Feeder {
            queue: &q,
            binaries_made: Some(cue),
            measured: BTreeMap::from([("e2e/slow".to_owned(), 300)]),
            revenant: None,
            pd_sim: None,
            waiting: Vec::new(),
        };
        std::thread::scope(|s| {
            let lane = s.spawn(|| {
                let mut taken = Vec::new();
                while let Some((j, env)) = q.take(LaneKind::Tests) {
                    taken.push((j.label, env.len()));
                }
                taken
            });
            // A test executable before the binaries waits for them; none is handed out yet.
            feeder.take(build::Artifact::Test(exe("e2e/slow")));
            std::thread::sleep(Duration::from_millis(50));
            assert_eq!(q.state.lock().unwrap().pending.len(), 0);
            feeder.take(build::Artifact::Revenant(PathBuf::from("/t/revenant")));
            assert!(binaries_made.try_recv().is_err(), "one binary is not both");
            feeder.take(build::Artifact::PdSim(PathBuf::from("/t/pd-sim")));
            assert!(binaries_made.try_recv().is_ok(), "the fuzz stage's cue");
            feeder.take(build::Artifact::Test(exe("revenant/cli")));
            std::thread::sleep(Duration::from_millis(50));
            q.built();
            let taken = lane.join().unwrap();
            // Both, each given the two binaries; the lane ended only once the build did.
            let labels: Vec<&str> = taken.iter().map(|(l, _)| l.as_str()).collect();
            assert_eq!(labels, ["e2e/slow", "revenant/cli"]);
            assert!(taken.iter().all(|(_, env)| *env == 2), "{taken:?}");
        });
        let common = q.state.lock().unwrap().common.clone();
        assert_eq!(
            common,
            vec![
                ("REVENANT_BIN".to_owned(), PathBuf::from("/t/revenant")),
                ("PD_SIM_BIN".to_owned(), PathBuf::from("/t/pd-sim")),
            ]
        );
    }

    #[test]
    fn the_heavy_targets_built_first_are_test_targets_of_the_workspace() {
        let waves = heavy_targets(&BTreeMap::new());
        // The heavy one with room first (the timed ones run beside it), with one heavy or
        // timed target of each package whose binary the tests run (so that cargo builds those
        // binaries in the first wave).
        assert_eq!(waves[0][0], "cluster_pd", "{waves:?}");
        for package in BINARY_PACKAGES {
            let of_package = |t: &&str| {
                PROFILE.iter().any(|(l, _, _)| {
                    l.split_whitespace().next() == Some(format!("{package}/{t}").as_str())
                })
            };
            assert!(
                waves[0].iter().any(of_package),
                "no {package} target in the first wave: {waves:?}"
            );
        }
        // Measured durations reorder the rest.
        assert_eq!(waves[1][0], "pd_sim_revenant", "{waves:?}");
        let measured = BTreeMap::from([("e2e/vllm_pd".to_owned(), 900)]);
        assert_eq!(heavy_targets(&measured)[1][0], "vllm_pd");
        let names: Vec<&str> = waves.concat();
        let mut unique = names.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(
            unique.len(),
            names.len(),
            "a target in two waves: {waves:?}"
        );
        for name in names {
            // `cargo test --test NAME` fails the whole build when no package has NAME.
            assert!(
                is_test_target(name),
                "PROFILE names {name}, which is no test target"
            );
        }
    }

    #[test]
    fn a_suites_tests_are_grouped_by_module_as_libtest_lists_them() {
        let listed = "cli::a: test\ncli::nested::b: test\nrun_cli::a: test\nat_root: test\n\
                      cli::bench_like: benchmark\n";
        let modules = modules_of(listed);
        assert_eq!(
            modules,
            BTreeMap::from([
                (None, vec!["at_root".to_owned()]),
                (
                    Some("cli".to_owned()),
                    vec!["cli::a".to_owned(), "cli::nested::b".to_owned()]
                ),
                (Some("run_cli".to_owned()), vec!["run_cli::a".to_owned()]),
            ])
        );
    }

    /// Each suite's folder (`SUITES`): where its `main.rs` and modules are.
    const SUITE_DIRS: &[&str] = &["monitor/tests/suite", "tests/pd-sim/tests/suite"];

    #[test]
    fn every_file_of_a_suite_is_one_of_its_modules_and_no_name_ends_another() {
        assert_eq!(SUITE_DIRS.len(), SUITES.len());
        for dir in SUITE_DIRS {
            let dir = test_harness::workspace_root().join(dir);
            let main = std::fs::read_to_string(dir.join("main.rs")).unwrap();
            let declared: Vec<&str> = main
                .lines()
                .filter_map(|l| l.strip_prefix("mod ")?.strip_suffix(';'))
                .collect();
            let mut files: Vec<String> = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p.file_name().is_some_and(|n| n != "main.rs"))
                .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
                .collect();
            files.sort();
            // A file without its `mod` line would never be compiled, its tests never run.
            for f in &files {
                assert!(
                    declared.contains(&f.as_str()),
                    "{} is not a module of {}",
                    f,
                    dir.display()
                );
            }
            // `-- NAME::` (by hand) must select one module: no name may end another.
            for a in &files {
                for b in files.iter().filter(|b| *b != a) {
                    assert!(
                        !b.ends_with(a.as_str()),
                        "`{a}::` also selects `{b}::` in {}",
                        dir.display()
                    );
                }
            }
        }
    }

    #[test]
    fn a_suite_that_cannot_be_listed_still_runs_whole() {
        let mut suite = exe(SUITES[0]);
        suite.exe = PathBuf::from("/nonexistent/suite");
        let jobs = jobs(&suite, &BTreeMap::new());
        assert_eq!(jobs.len(), 1);
        assert_eq!(jobs[0].label, SUITES[0]);
        assert!(jobs[0].args.is_empty());
    }

    #[test]
    fn failed_venvs_are_reported_to_the_jobs_that_need_them() {
        let q = queue(vec![job("real", Light, true, 100)]);
        q.venvs(Err("pip failed".into()));
        let (j, env) = q.take(LaneKind::Tests).unwrap();
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
