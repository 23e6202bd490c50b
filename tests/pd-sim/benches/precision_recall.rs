//! Precision and recall of revenant, end to end: for each router × decode behaviour × witness,
//! a real cluster on loopback (pd-sim's prefill and decode, its router or a real `smg` in front),
//! a real `revenant run` (release build) watching it, open-loop load from `pd-sim load` with a
//! share of over-capacity prompts that prefill refuses. The oracle is the simulator's own
//! per-room records (`/sim/rooms` of prefill and decode), never revenant's output.
//! (One file, ~850 lines: a `harness = false` bench binary whose rows, oracle and runner read
//! top to bottom.)
//!
//! ```text
//! [PD_SIM_SMG=target/xtask-venv/bin/smg] [PD_SIM_SMG113=target/xtask-venv-smg113/bin/smg] \
//! cargo bench -p pd-sim --bench precision_recall -- [--requests 1000] [--rate 200]
//!     [--over-capacity-share 0.25] [--overload-share 0] [--seed 1] [--rows FILTER] [--out DIR]
//!     [--keep]
//! ```
//!
//! Binaries: `REVENANT_BIN` and `PD_SIM_BIN`, else release builds the bench makes itself (`cargo
//! build --release -p revenant -p pd-sim`, a no-op when up to date).
//!
//! - `--over-capacity-share F`: prompts over prefill's capacity (refused 400). `--overload-share
//!   F`: prefill refuses that share with 503 ("queue full"), which every router retries on a new
//!   room under the same x-request-id (several attempts, one request, one notification).
//! - `--rows FILTER`: comma-separated `ROUTER[/DECODE[/WITNESS]]`, each part a name or `*`
//!   (e.g. `concurrent-cancel/ignores`, `*/*/ebpf`, `correct,handoff-after-reject/*/otlp`).
//!   Routers: `correct`, `concurrent-cancel`, `concurrent-no-cancel`, `handoff-after-reject`
//!   (pd-sim's router modes), `sglang-router-0.3.2` (`PD_SIM_SMG`), `smg-1.13.0`
//!   (`PD_SIM_SMG113`); vLLM: `vllm-correct`, `vllm-handoff-after-reject` (pd-sim's
//!   `--flavour vllm` router modes) and `vllm-router-0.1.17` (`PD_SIM_VLLM_ROUTER_PYTHON`, the
//!   python of its venv; started through `tests/e2e/scripts/vllm_router_traced.py`, traced
//!   when the witness has OTLP): the real routers run in front of `pd-sim cluster --no-router`
//!   and are skipped, with the reason printed, when their variable is unset. Decode: `honours` (the
//!   router's cancel) or `ignores` (`--decode-ignores-cancel`; only for the routers that withdraw
//!   legs: `concurrent-cancel`, `smg-1.13.0`). Witness: `ebpf` (`--ebpf on`, the three pids, no
//!   spans), `otlp` (`--ebpf off`, the workers' spans from `--otlp-endpoint`, a real router's
//!   from `--enable-trace`), `both`. Needs root for the eBPF rows.
//! - `--out DIR` (default `target/precision_recall`): one directory per row (revenant's
//!   `--events-jsonl` file, alerts JSONL, its log, the simulator's log and rooms, the violations);
//!   kept for rows that miss, false-alert or notify other than once per breached request, removed
//!   otherwise unless `--keep`.
//!
//! Oracle (README, "What is advancement"): no attempt is a breach behind `correct`,
//! `concurrent-cancel`, `smg-1.13.0`, `vllm-correct` or `vllm-router-0.1.17` with a decode that
//! honours the cancel; behind `concurrent-no-cancel`, `sglang-router-0.3.2`,
//! `handoff-after-reject`, `vllm-handoff-after-reject`, and with any decode that ignores the
//! cancel, every attempt prefill refused (status ≥ 400) whose decode leg reached decode (the room
//! is in decode's `/sim/rooms`; for vLLM the request name in decode's `/sim/requests`) is a
//! breach. A vLLM request is one attempt, named `cmpl-`/`chatcmpl-` + the router's `X-Request-Id`.
//!
//! Columns: requests sent; rejected attempts (prefill rooms with status ≥ 400); breaches
//! expected; caught (breaches with at least one violation in `/api/violations`); false alerts
//! (first proofs, corroborations left out, about an attempt that is not a breach, or naming no
//! attempt of a breached request); notifications (incident notifications in the alerts JSONL)
//! against the breached requests (one each expected); recall; precision (attempts: caught over
//! caught plus falsely alerted); the row's wall time (cluster start to teardown).
//!
//! Before reading `/api/violations` a row waits until every room left `pending` and then until
//! revenant can have judged the last rejection's deadline rules: the cancellation window
//! (500 ms) + clock skew (50 ms) + `revenant run`'s allowed lateness (15 s) + its 1 s tick after
//! the last prefill rejection; so a row takes about 17 s more than its load. The lateness is
//! `run`'s default on purpose: a lateness below the OTLP profile's completion grace (5 s) makes
//! an OTLP-reported decode leg that ended in time count as open (README, orphaned-leg).
//!
//! revenant runs with the defaults except `--rate-limit 0` (every incident reaches the file),
//! `--recent-violations 1000000` (the whole run in `/api/violations`), `--spool-no-fsync` and,
//! with eBPF, `--no-sglang-conventions` (only this row's pids are watched).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pd_sim::smg::{SmgProcess, smg_version, write_tiny_model};
use serde_json::Value;
use test_harness::notifications::room_of;
use test_harness::{Cluster, Revenant, free_port, http_json, metric_sum};

/// revenant's defaults that bound when a deadline rule is judged: the cancellation window of
/// `orphaned-leg`, `--clock-skew`, `revenant run --allowed-lateness`, the checker's tick.
const WINDOW: Duration = Duration::from_millis(500);
const SKEW: Duration = Duration::from_millis(50);
const LATENESS: Duration = Duration::from_secs(15);
const TICK: Duration = Duration::from_secs(1);

struct Opts {
    requests: u64,
    rate: f64,
    over_capacity_share: f64,
    /// prefill `--overload-share`: refused 503 ("queue full"), retried by every router on a new
    /// room under the same x-request-id.
    overload_share: f64,
    seed: u64,
    rows: Vec<Vec<String>>,
    out: PathBuf,
    keep: bool,
}

fn opts() -> Opts {
    let mut o = Opts {
        requests: 1000,
        rate: 200.0,
        over_capacity_share: 0.25,
        overload_share: 0.0,
        seed: 1,
        rows: Vec::new(),
        out: test_harness::workspace_root().join("target/precision_recall"),
        keep: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--requests" => o.requests = val().parse().expect("--requests N"),
            "--rate" => o.rate = val().parse().expect("--rate R"),
            "--over-capacity-share" => {
                o.over_capacity_share = val().parse().expect("--over-capacity-share F")
            }
            "--overload-share" => o.overload_share = val().parse().expect("--overload-share F"),
            "--seed" => o.seed = val().parse().expect("--seed S"),
            "--rows" => {
                o.rows = val()
                    .split(',')
                    .filter(|p| !p.is_empty())
                    .map(|p| p.split('/').map(str::to_string).collect())
                    .collect()
            }
            "--out" => o.out = val().into(),
            "--keep" => o.keep = true,
            // `cargo bench` passes `--bench`; ignore it and anything else libtest-like.
            _ => {}
        }
    }
    o
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Router {
    /// A `pd-sim router --mode`.
    Sim(&'static str),
    Smg032,
    Smg113,
    /// A `pd-sim router --flavour vllm --mode` in front of the simulator's vLLM workers.
    VllmSim(&'static str),
    /// The real vllm-router 0.1.17 in front of them.
    Vllm0117,
}

impl Router {
    fn name(self) -> &'static str {
        match self {
            Router::Sim(m) => m,
            Router::Smg032 => "sglang-router-0.3.2",
            Router::Smg113 => "smg-1.13.0",
            Router::VllmSim("correct") => "vllm-correct",
            Router::VllmSim("handoff-after-reject") => "vllm-handoff-after-reject",
            Router::VllmSim(m) => m,
            Router::Vllm0117 => "vllm-router-0.1.17",
        }
    }
    /// The simulator speaks vLLM (one attempt per request, named by vLLM's request name).
    fn vllm(self) -> bool {
        matches!(self, Router::VllmSim(_) | Router::Vllm0117)
    }
    /// It withdraws the decode leg of a refused attempt (so a decode ignoring that is a row).
    fn withdraws(self) -> bool {
        matches!(self, Router::Sim("concurrent-cancel") | Router::Smg113)
    }
    /// Hands refused attempts on by itself: every refused attempt that reached decode is a breach.
    fn breaches(self) -> bool {
        matches!(
            self,
            Router::Sim("concurrent-no-cancel")
                | Router::Sim("handoff-after-reject")
                | Router::Smg032
                | Router::VllmSim("handoff-after-reject")
        )
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Witness {
    Ebpf,
    Otlp,
    Both,
}

impl Witness {
    fn name(self) -> &'static str {
        match self {
            Witness::Ebpf => "ebpf",
            Witness::Otlp => "otlp",
            Witness::Both => "both",
        }
    }
    fn ebpf(self) -> bool {
        self != Witness::Otlp
    }
    fn otlp(self) -> bool {
        self != Witness::Ebpf
    }
}

#[derive(Clone, Copy, Debug)]
struct Row {
    router: Router,
    ignores_cancel: bool,
    witness: Witness,
}

impl Row {
    fn parts(&self) -> [&'static str; 3] {
        [
            self.router.name(),
            if self.ignores_cancel {
                "ignores"
            } else {
                "honours"
            },
            self.witness.name(),
        ]
    }
    fn name(&self) -> String {
        self.parts().join("/")
    }
    fn breach_row(&self) -> bool {
        self.router.breaches() || self.ignores_cancel
    }
    fn selected(&self, filter: &[Vec<String>]) -> bool {
        let parts = self.parts();
        filter.is_empty()
            || filter.iter().any(|pat| {
                pat.iter()
                    .zip(parts)
                    .all(|(p, v)| p == "*" || p.is_empty() || p == v)
            })
    }
}

fn all_rows() -> Vec<Row> {
    let routers = [
        Router::Sim("correct"),
        Router::Sim("concurrent-cancel"),
        Router::Sim("concurrent-no-cancel"),
        Router::Sim("handoff-after-reject"),
        Router::Smg032,
        Router::Smg113,
        Router::VllmSim("correct"),
        Router::VllmSim("handoff-after-reject"),
        Router::Vllm0117,
    ];
    let mut rows = Vec::new();
    for router in routers {
        for ignores_cancel in [false, true] {
            if ignores_cancel && !router.withdraws() {
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
    rows
}

/// The real router binary a row needs, or why the row is skipped.
fn real_router(router: Router) -> Result<Option<PathBuf>, String> {
    let (var, want) = match router {
        Router::Sim(_) | Router::VllmSim(_) => return Ok(None),
        Router::Smg032 => ("PD_SIM_SMG", "0.3.2"),
        Router::Smg113 => ("PD_SIM_SMG113", "smg 1.13.0"),
        Router::Vllm0117 => return vllm_router_python(),
    };
    let Some(p) = std::env::var_os(var) else {
        return Err(format!("{var} is not set (the `smg` binary of {want})"));
    };
    let p = PathBuf::from(p);
    match smg_version(&p) {
        Ok(v) if v.ends_with(want) => Ok(Some(p)),
        Ok(v) => Err(format!("{var}={} is {v}, not {want}", p.display())),
        Err(e) => Err(format!("{var}={}: {e:#}", p.display())),
    }
}

/// The Python of the vllm-router 0.1.17 venv (`PD_SIM_VLLM_ROUTER_PYTHON`): the router is
/// started through its Python API, which can turn its tracing on.
fn vllm_router_python() -> Result<Option<PathBuf>, String> {
    let var = "PD_SIM_VLLM_ROUTER_PYTHON";
    let Some(p) = std::env::var_os(var) else {
        return Err(format!(
            "{var} is not set (the python of a venv with vllm-router==0.1.17)"
        ));
    };
    let p = PathBuf::from(p);
    let out = std::process::Command::new(&p)
        .args([
            "-c",
            "import importlib.metadata as m; print(m.version('vllm-router'))",
        ])
        .output()
        .map_err(|e| format!("{var}={}: {e}", p.display()))?;
    let v = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if v == "0.1.17" {
        Ok(Some(p))
    } else {
        Err(format!(
            "{var}={} has vllm-router {v:?}, not 0.1.17",
            p.display()
        ))
    }
}

/// A real router in front of the simulator's workers; stopped when dropped.
enum RealRouter {
    Smg(SmgProcess),
    Vllm(test_harness::VllmRouter),
}

impl RealRouter {
    fn url(&self) -> &str {
        match self {
            RealRouter::Smg(s) => &s.url,
            RealRouter::Vllm(r) => &r.url,
        }
    }
    fn pid(&self) -> u32 {
        match self {
            RealRouter::Smg(s) => s.pid(),
            RealRouter::Vllm(r) => r.pid(),
        }
    }
}

struct RowResult {
    row: Row,
    requests: u64,
    rejected: usize,
    expected: usize,
    caught: usize,
    false_alerts: usize,
    false_attempts: usize,
    notifications: usize,
    breached_requests: usize,
    wall_s: f64,
    /// Per-row details printed under the table.
    notes: Vec<String>,
    clean: bool,
}

/// The simulator's per-attempt records: SGLang's per room (`/sim/rooms`), vLLM's per request
/// (`/sim/requests`, one attempt each).
fn rooms(url: &str, vllm: bool) -> Vec<Value> {
    let path = if vllm { "/sim/requests" } else { "/sim/rooms" };
    match http_json(&format!("{url}{path}")) {
        Ok(Value::Array(a)) => a,
        other => panic!("{url}{path}: {other:?}"),
    }
}

/// The attempt a record is about: the room (SGLang), the request name (vLLM).
fn key_of(r: &Value, vllm: bool) -> Option<String> {
    if vllm {
        r["id"].as_str().map(str::to_string)
    } else {
        r["room"].as_u64().map(|r| r.to_string())
    }
}

fn wait_rooms_settled(cluster: &Cluster, vllm: bool, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        // vLLM's prefill holds the KV of an admitted request until decode has read it.
        let pending = [&cluster.prefill, &cluster.decode]
            .iter()
            .flat_map(|u| rooms(u, vllm))
            .any(|r| r["outcome"] == "pending" || r["outcome"] == "held");
        if !pending {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn run_row(
    o: &Opts,
    row: Row,
    real: Option<&Path>,
    revenant_bin: &Path,
    pd_sim: &Path,
) -> RowResult {
    let vllm = row.router.vllm();
    let t0 = Instant::now();
    let dir = o.out.join(row.name().replace('/', "-"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let grpc = format!("127.0.0.1:{}", free_port().unwrap());
    let http = format!("127.0.0.1:{}", free_port().unwrap());

    // The cluster first: eBPF needs its pids; span exporters connect once there are spans.
    let mut cluster_args: Vec<String> = Vec::new();
    if vllm {
        cluster_args.extend(["--flavour".into(), "vllm".into()]);
    }
    match row.router {
        Router::Sim(mode) | Router::VllmSim(mode) => {
            cluster_args.extend(["--mode".into(), mode.into()])
        }
        _ => cluster_args.push("--no-router".into()),
    }
    if row.witness.otlp() {
        cluster_args.extend(["--otlp-endpoint".into(), format!("http://{http}")]);
    }
    if row.ignores_cancel {
        cluster_args.extend(["--decode-args".into(), "--decode-ignores-cancel".into()]);
    }
    if o.overload_share > 0.0 {
        cluster_args.extend([
            "--prefill-args".into(),
            format!("--overload-share {}", o.overload_share),
        ]);
    }
    let cluster = Cluster::start(pd_sim, &cluster_args, Some(&dir.join("pd-sim.log")))
        .unwrap_or_else(|e| panic!("{}: pd-sim cluster: {e:#}", row.name()));
    let real_router = real.map(|bin| {
        if vllm {
            let trace = row.witness.otlp().then_some(grpc.as_str());
            return RealRouter::Vllm(
                test_harness::VllmRouter::start(
                    bin,
                    &cluster.prefill,
                    &cluster.decode,
                    trace,
                    &dir.join("vllm-router.log"),
                )
                .unwrap_or_else(|e| panic!("{}: vllm-router: {e:#}", row.name())),
            );
        }
        let model = dir.join("model");
        write_tiny_model(&model).unwrap();
        let trace = row.witness.otlp().then_some(grpc.as_str());
        RealRouter::Smg(
            SmgProcess::start(bin, &cluster, &model, trace, &dir.join("smg.log"), &[])
                .unwrap_or_else(|e| panic!("{}: smg: {e:#}", row.name())),
        )
    });
    let router_url = real_router
        .as_ref()
        .map_or(cluster.router.clone(), |s| s.url().to_string());

    let events_path = dir.join("events.jsonl");
    let mut args: Vec<String> = [
        "--admin",
        "127.0.0.1:0",
        "--rate-limit",
        "0",
        "--recent-violations",
        "1000000",
        "--spool-no-fsync",
        "--log-format",
        "json",
    ]
    .map(String::from)
    .to_vec();
    args.extend(["--events-jsonl".into(), events_path.display().to_string()]);
    if row.witness.otlp() {
        args.extend(["--otlp-http".into(), http.clone()]);
        args.extend(["--otlp-grpc".into(), grpc.clone()]);
    } else {
        args.extend(["--otlp-http".into(), "off".into()]);
        args.extend(["--otlp-grpc".into(), "off".into()]);
    }
    if row.witness.ebpf() {
        args.extend([
            "--ebpf".into(),
            "on".into(),
            "--no-sglang-conventions".into(),
        ]);
        args.extend(cluster.pid_args());
        if let Some(s) = &real_router {
            args.extend(["--pid".into(), format!("router={}", s.pid())]);
        }
    } else {
        args.extend(["--ebpf".into(), "off".into()]);
    }
    let mut rev = Revenant::start(revenant_bin, &dir, &args)
        .unwrap_or_else(|e| panic!("{}: revenant: {e:#}", row.name()));
    let want_ebpf = if row.witness.ebpf() { "live" } else { "off" };
    assert_eq!(
        rev.ready["ebpf"],
        want_ebpf,
        "{}: {}",
        row.name(),
        rev.ready
    );

    let load = test_harness::run_load(
        pd_sim,
        &router_url,
        &[
            "--api".to_string(),
            if vllm { "openai" } else { "sglang" }.to_string(),
            "--requests".to_string(),
            o.requests.to_string(),
            "--rate".into(),
            o.rate.to_string(),
            "--over-capacity-share".into(),
            o.over_capacity_share.to_string(),
            "--seed".into(),
            o.seed.to_string(),
            "--request-id-prefix".into(),
            format!("pr-{}", row.name().replace('/', "-")),
        ],
        &dir.join("load.json"),
        true,
        Duration::from_secs(600),
        None,
    )
    .unwrap_or_else(|e| panic!("{}: load: {e:#}", row.name()))
    .expect("not interrupted");
    let mut notes = Vec::new();
    // Every leg over (a decode waiting for KV times out after 2 s); then the deadline rules
    // (orphaned-leg) of the last rejection must have been judged: `revenant run` judges a
    // deadline once its watermark (wall clock minus the allowed lateness) passes it, checked on
    // a 1 s tick; then revenant quiet (no alert pending in its group wait).
    if !wait_rooms_settled(&cluster, vllm, Duration::from_secs(120)) {
        notes.push("rooms still pending after 120 s".into());
    }
    let last_rejection = rooms(&cluster.prefill, vllm)
        .iter()
        .filter(|r| r["status"].as_u64().unwrap_or(0) >= 400)
        .filter_map(|r| r["answered_ns"].as_u64())
        .max()
        .unwrap_or(0);
    let judged_by = last_rejection + (WINDOW + SKEW + LATENESS + TICK).as_nanos() as u64;
    let now = pd_sim::ids::now_ns();
    if judged_by > now {
        std::thread::sleep(Duration::from_nanos(judged_by - now) + Duration::from_millis(500));
    }
    let metrics = rev
        .wait_quiet(Duration::from_secs(3), Duration::from_secs(120), None)
        .unwrap_or_else(|e| panic!("{}: {e:#}\n{}", row.name(), rev.log_tail(30)));
    let (status, vj) = rev
        .admin_json("/api/violations?limit=1000000")
        .unwrap_or_else(|e| panic!("{}: /api/violations: {e:#}", row.name()));
    assert_eq!(status, 200, "{vj}");
    let violations = vj["violations"].as_array().cloned().unwrap_or_default();
    let total_seen = vj["total_seen"].as_u64().unwrap_or(0);
    if total_seen != violations.len() as u64 {
        notes.push(format!(
            "/api/violations listed {} of {total_seen}",
            violations.len()
        ));
    }
    let prefill = rooms(&cluster.prefill, vllm);
    let decode = rooms(&cluster.decode, vllm);
    let sim_losses: u64 = [&cluster.prefill, &cluster.decode]
        .iter()
        .map(|u| {
            let s = http_json(&format!("{u}/sim/stats")).unwrap_or(Value::Null);
            s["otlp"]["spans_dropped_queue_full"].as_u64().unwrap_or(0)
                + s["otlp"]["spans_failed"].as_u64().unwrap_or(0)
        })
        .sum();
    let stopped = rev
        .stop()
        .unwrap_or_else(|e| panic!("{}: revenant stop: {e:#}", row.name()));
    assert!(stopped.success(), "{}: {}", row.name(), rev.log_tail(30));
    let alerts = rev.notifications().unwrap_or_default();
    drop(real_router);
    drop(cluster);
    let wall_s = t0.elapsed().as_secs_f64();

    // The oracle, from the simulator's records: an attempt is a room (SGLang) or a request
    // name (vLLM).
    let decode_rooms: HashMap<String, &Value> = decode
        .iter()
        .filter_map(|r| Some((key_of(r, vllm)?, r)))
        .collect();
    let prefill_rooms: HashMap<String, &Value> = prefill
        .iter()
        .filter_map(|r| Some((key_of(r, vllm)?, r)))
        .collect();
    let mut rid_room: HashMap<String, String> = HashMap::new();
    for r in prefill.iter().chain(&decode) {
        if let (Some(rid), Some(room)) = (r["rid"].as_str(), key_of(r, vllm)) {
            rid_room.insert(rid.to_string(), room);
        }
    }
    let rejected: BTreeSet<String> = prefill
        .iter()
        .filter(|r| r["status"].as_u64().unwrap_or(0) >= 400)
        .filter_map(|r| key_of(r, vllm))
        .collect();
    let breaches: BTreeSet<String> = if row.breach_row() {
        rejected
            .iter()
            // Reached decode: decode read the leg's HTTP request.
            .filter(|r| {
                decode_rooms
                    .get(*r)
                    .is_some_and(|d| d["received_ns"].as_u64().unwrap_or(0) > 0)
            })
            .cloned()
            .collect()
    } else {
        BTreeSet::new()
    };
    // vLLM: one attempt per request, so the request is its attempt (the notification names
    // it by the client's id or the router's X-Request-Id, depending on the witness).
    let request_of = |room: &String| {
        if vllm {
            return room.clone();
        }
        prefill_rooms
            .get(room)
            .and_then(|r| r["request_id"].as_str())
            .unwrap_or("")
            .to_string()
    };
    let breached_requests: BTreeSet<String> = breaches.iter().map(request_of).collect();

    // revenant's verdicts.
    let attempt_of = |v: &Value| -> Option<String> {
        if vllm {
            return v["attempt"]["rid"].as_str().map(str::to_string);
        }
        room_of(&v["attempt"]).map(|r| r.to_string()).or_else(|| {
            v["attempt"]["rid"]
                .as_str()
                .and_then(|rid| rid_room.get(rid).cloned())
        })
    };
    let mut violated: BTreeSet<String> = BTreeSet::new();
    let mut false_rooms: BTreeSet<String> = BTreeSet::new();
    let mut false_alerts = 0usize;
    let mut caught_rules: BTreeMap<String, usize> = BTreeMap::new();
    let mut false_rules: BTreeMap<String, usize> = BTreeMap::new();
    let mut false_examples: Vec<&Value> = Vec::new();
    for v in &violations {
        let rule = v["rule"].as_str().unwrap_or("?").to_string();
        let first = v["corroborates"] != true;
        let room = attempt_of(v);
        let on_breach = match &room {
            Some(r) => breaches.contains(r),
            None => v["request"]["request_id"]
                .as_str()
                .is_some_and(|id| breached_requests.contains(id)),
        };
        if let Some(r) = &room {
            violated.insert(r.clone());
        }
        if on_breach {
            if first {
                *caught_rules.entry(rule).or_default() += 1;
            }
        } else if first {
            false_alerts += 1;
            if let Some(r) = room {
                false_rooms.insert(r);
            }
            *false_rules.entry(rule).or_default() += 1;
            if false_examples.len() < 5 {
                false_examples.push(v);
            }
        }
    }
    let caught = breaches.intersection(&violated).count();
    let missed: Vec<String> = breaches.difference(&violated).cloned().collect();

    // Notifications: incident notifications (and rate-limit summaries, which must not occur).
    let incidents: Vec<&Value> = alerts.iter().filter(|n| n["type"] == "incident").collect();
    let suppressed = alerts.iter().filter(|n| n["type"] == "suppressed").count();
    // A notification is about the requests of its findings' attempts (the simulator's rooms
    // name their x-request-id), and the one it names itself. It may name the request by its
    // trace id alone, when no source told revenant the x-request-id of the request (behind a
    // real router the workers' spans carry none: it comes with the router's span).
    let mut per_request: BTreeMap<String, usize> = BTreeMap::new();
    let mut without_request_id = 0usize;
    for n in &incidents {
        let mut about: BTreeSet<String> = n["findings"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(&attempt_of)
            .map(|room| request_of(&room))
            .filter(|id| !id.is_empty())
            .collect();
        match n["request"]["request_id"].as_str() {
            Some(_) if vllm => {}
            Some(id) => {
                about.insert(id.to_string());
            }
            None => without_request_id += 1,
        }
        if about.is_empty() {
            about.insert(n["incident_key"].as_str().unwrap_or("?").to_string());
        }
        for key in about {
            *per_request.entry(key).or_default() += 1;
        }
    }
    let repeated: Vec<(&String, &usize)> = per_request.iter().filter(|(_, n)| **n > 1).collect();
    let unnotified: Vec<&String> = breached_requests
        .iter()
        .filter(|r| !per_request.contains_key(*r))
        .collect();
    let foreign: Vec<&String> = per_request
        .keys()
        .filter(|k| !breached_requests.contains(*k))
        .collect();

    let requests = load["sent"].as_u64().unwrap_or(0);
    if load["errors"].as_u64().unwrap_or(0) > 0 {
        notes.push(format!(
            "load errors {} {}",
            load["errors"], load["errors_by_kind"]
        ));
    }
    let sum = |name: &str| metric_sum(&metrics, name, &[]) as u64;
    // Every loss is folded into revenant_dropped_items_total; the others are the eBPF stream
    // tracker's own trouble (gap bytes are payload deliberately not captured: not a loss).
    let mut losses: Vec<String> = Vec::new();
    for name in [
        "revenant_dropped_items_total",
        "revenant_ebpf_batches_dropped_total",
        "revenant_ebpf_http_desyncs_total",
        "revenant_ebpf_decode_errors_total",
        "revenant_ebpf_connections_evicted_total",
    ] {
        let n = sum(name);
        if n > 0 {
            losses.push(format!("{name} {n}"));
        }
    }
    if sim_losses > 0 {
        losses.push(format!("pd-sim spans dropped/failed {sim_losses}"));
    }
    if !losses.is_empty() {
        notes.push(format!("losses: {}", losses.join(", ")));
    }
    notes.push(format!(
        "load {} ok {} rejected {} at {:.0}/s; prefill rooms {}, decode rooms {}; events ebpf {} otlp {} (router received: {} from spans); caught by {:?}",
        load["sent"],
        load["ok"],
        load["rejected_by_status"],
        load["achieved_rate"].as_f64().unwrap_or(0.0),
        prefill.len(),
        decode.len(),
        metric_sum(&metrics, "revenant_events_total", &[("source", "ebpf")]),
        metric_sum(&metrics, "revenant_events_total", &[("source", "otlp")]),
        metric_sum(
            &metrics,
            "revenant_events_total",
            &[("source", "otlp"), ("stage", "router"), ("kind", "received")]
        ),
        caught_rules,
    ));
    if !false_rules.is_empty() {
        notes.push(format!("false alerts by rule {false_rules:?}"));
    }
    if without_request_id > 0 {
        notes.push(format!(
            "{without_request_id} notifications name their request by trace id only (no x-request-id known to revenant)"
        ));
    }
    if suppressed > 0 {
        notes.push(format!("{suppressed} rate-limit summaries"));
    }
    if !repeated.is_empty() {
        notes.push(format!(
            "{} requests notified more than once, e.g. {:?}",
            repeated.len(),
            &repeated[..repeated.len().min(3)]
        ));
    }
    if !unnotified.is_empty() {
        notes.push(format!(
            "{} breached requests not notified, e.g. {:?}",
            unnotified.len(),
            &unnotified[..unnotified.len().min(3)]
        ));
    }
    if !foreign.is_empty() {
        notes.push(format!(
            "{} notifications about requests without a breach, e.g. {:?}",
            foreign.len(),
            &foreign[..foreign.len().min(3)]
        ));
    }
    let clean = missed.is_empty()
        && false_alerts == 0
        && repeated.is_empty()
        && unnotified.is_empty()
        && foreign.is_empty()
        && suppressed == 0;
    if !clean {
        // Enough to start digging: the rooms' records and revenant's events of them.
        let mut look: Vec<String> = missed.iter().take(3).cloned().collect();
        look.extend(false_rooms.iter().take(3).cloned());
        let events = test_harness::read_jsonl(&events_path).unwrap_or_default();
        for room in look {
            let kind = if breaches.contains(&room) {
                "missed"
            } else {
                "false alert on"
            };
            notes.push(format!(
                "{kind} room {room} ({}): prefill {} | decode {}",
                request_of(&room),
                prefill_rooms
                    .get(&room)
                    .map_or("-".into(), |r| r.to_string()),
                decode_rooms
                    .get(&room)
                    .map_or("-".into(), |r| r.to_string()),
            ));
            let of_room = |e: &&Value| {
                if vllm {
                    e["ids"]["rid"].as_str() == Some(room.as_str())
                } else {
                    room_of(&e["ids"]).map(|r| r.to_string()) == Some(room.clone())
                }
            };
            for e in events.iter().filter(of_room) {
                notes.push(format!("    {e}"));
            }
            for v in violations
                .iter()
                .filter(|v| attempt_of(v).as_ref() == Some(&room))
            {
                notes.push(format!("    violation: {}", v["summary"]));
            }
        }
        for v in false_examples.iter().filter(|v| attempt_of(v).is_none()) {
            notes.push(format!("false alert naming no attempt: {}", v["summary"]));
        }
        std::fs::write(
            dir.join("violations.json"),
            serde_json::to_string_pretty(&violations).unwrap(),
        )
        .unwrap();
        std::fs::write(
            dir.join("prefill-rooms.json"),
            Value::from(prefill.clone()).to_string(),
        )
        .unwrap();
        std::fs::write(
            dir.join("decode-rooms.json"),
            Value::from(decode.clone()).to_string(),
        )
        .unwrap();
        notes.push(format!("files kept in {}", dir.display()));
    } else if !o.keep {
        let _ = std::fs::remove_dir_all(&dir);
    }
    RowResult {
        row,
        requests,
        rejected: rejected.len(),
        expected: breaches.len(),
        caught,
        false_alerts,
        false_attempts: false_rooms.len(),
        notifications: incidents.len(),
        breached_requests: breached_requests.len(),
        wall_s,
        notes,
        clean,
    }
}

fn pct(num: usize, den: usize) -> String {
    if den == 0 {
        "–".into()
    } else {
        format!("{:.1} %", num as f64 * 100.0 / den as f64)
    }
}

fn table_line(r: &RowResult) -> String {
    let [router, decode, witness] = r.row.parts();
    format!(
        "| {router} | {decode} | {witness} | {} | {} | {} | {} | {} | {} / {} | {} | {} | {:.0} s |",
        r.requests,
        r.rejected,
        r.expected,
        r.caught,
        r.false_alerts,
        r.notifications,
        r.breached_requests,
        pct(r.caught, r.expected),
        pct(r.caught, r.caught + r.false_attempts),
        r.wall_s,
    )
}

fn main() {
    // `cargo test --all-targets` runs bench binaries without `--bench`: it must not start a
    // run of many minutes there.
    if !std::env::args().any(|a| a == "--bench") {
        println!("precision_recall: run with `cargo bench -p pd-sim --bench precision_recall`");
        return;
    }
    let o = opts();
    // REVENANT_BIN and PD_SIM_BIN, else release builds made now (a no-op when up to date).
    let bins = test_harness::Binaries::locate()
        .unwrap_or_else(|e| panic!("release builds of revenant and pd-sim: {e:#}"));
    let (revenant, pd_sim) = (bins.revenant, bins.pd_sim);
    let rows: Vec<Row> = all_rows()
        .into_iter()
        .filter(|r| r.selected(&o.rows))
        .collect();
    assert!(!rows.is_empty(), "--rows matches no row");
    eprintln!(
        "precision_recall: revenant {}, pd-sim {}; {} requests per row at {}/s, {} over capacity, {} overloaded (503); {} rows",
        revenant.display(),
        pd_sim.display(),
        o.requests,
        o.rate,
        o.over_capacity_share,
        o.overload_share,
        rows.len()
    );
    let mut results = Vec::new();
    let mut skipped: Vec<String> = Vec::new();
    for row in rows {
        if row.witness.ebpf() && !test_harness::is_root() {
            skipped.push(format!("{}: eBPF needs root", row.name()));
            eprintln!("skip {}", skipped.last().unwrap());
            continue;
        }
        let real = match real_router(row.router) {
            Ok(s) => s,
            Err(why) => {
                skipped.push(format!("{}: {why}", row.name()));
                eprintln!("skip {}", skipped.last().unwrap());
                continue;
            }
        };
        eprintln!("row {} …", row.name());
        let r = run_row(&o, row, real.as_deref(), &revenant, &pd_sim);
        eprintln!("{}", table_line(&r));
        results.push(r);
    }
    println!();
    println!(
        "| router | decode | witness | requests | rejected attempts | breaches expected | caught | false alerts | notifications / breached requests | recall | precision | wall |"
    );
    println!("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in &results {
        println!("{}", table_line(r));
    }
    println!();
    for r in &results {
        println!(
            "{}{}",
            r.row.name(),
            if r.clean { "" } else { "  ← not clean" }
        );
        for n in &r.notes {
            println!("  {n}");
        }
    }
    for s in &skipped {
        println!("skipped {s}");
    }
}
