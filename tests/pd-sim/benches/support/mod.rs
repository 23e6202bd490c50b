//! What the end-to-end benches share: a row (router × decode behaviour × witness) started as
//! real processes on loopback (`pd-sim cluster`, a real router if the row names one, `revenant
//! run` release build), the wait until revenant can have judged everything the load caused, and
//! the oracle that scores revenant's verdicts against the simulator's own per-room records
//! (`/sim/rooms`, `/sim/requests`), never against revenant's output. See `precision_recall.rs`
//! for the oracle's definition and `soak.rs` for the long run.

// Each bench binary includes this module and uses a part of it.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pd_sim::fault::Fault;
use pd_sim::smg::{SmgProcess, write_tiny_model};
use serde_json::Value;
use test_harness::notifications::room_of;
use test_harness::{Cluster, Revenant, Sample, free_port, http_json, metric_sum};

/// revenant's defaults that bound when a deadline rule is judged: `orphaned-leg`'s window for
/// decode's end of a refused attempt's leg (SGLang's 4 s connection check and 2 s),
/// `--clock-skew`, `revenant run --allowed-lateness`, the checker's tick.
pub const ORPHANED_LEG_WINDOW: Duration = Duration::from_secs(6);
pub const SKEW: Duration = Duration::from_millis(50);
pub const LATENESS: Duration = Duration::from_secs(15);
pub const TICK: Duration = Duration::from_secs(1);

/// How long the simulator's SGLang decode waits for KV that never comes
/// (`--disaggregation-waiting-timeout-ms`; SGLang's default, and pd-sim's, is 300 s): a leg
/// decode keeps for a refused attempt ends then, well past [`ORPHANED_LEG_WINDOW`], and a row
/// ends in reasonable time.
pub const DECODE_WAITING_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Router {
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
    pub fn name(self) -> &'static str {
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
    pub fn vllm(self) -> bool {
        matches!(self, Router::VllmSim(_) | Router::Vllm0117)
    }
    /// A real router, started in front of `pd-sim cluster --no-router`.
    pub fn real(self) -> bool {
        matches!(self, Router::Smg032 | Router::Smg113 | Router::Vllm0117)
    }
    /// It withdraws the decode leg of a refused attempt (so a decode ignoring that is a row).
    /// smg 1.13.0 (and the simulator's model of it) looks at the status only: a streamed
    /// refusal is a 200, and its decode leg is kept.
    pub fn withdraws(self, stream: bool) -> bool {
        !stream && matches!(self, Router::Sim("concurrent-cancel") | Router::Smg113)
    }
    /// Hands refused attempts on by itself: every refused attempt that reached decode is a
    /// breach (the oracle's cross-check; the oracle itself reads the simulator's records).
    pub fn breaches(self, stream: bool) -> bool {
        matches!(
            self,
            Router::Sim("concurrent-no-cancel")
                | Router::Sim("handoff-after-reject")
                | Router::Smg032
                | Router::VllmSim("handoff-after-reject")
        ) || (stream && matches!(self, Router::Sim("concurrent-cancel") | Router::Smg113))
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Witness {
    Ebpf,
    Otlp,
    Both,
}

impl Witness {
    pub fn name(self) -> &'static str {
        match self {
            Witness::Ebpf => "ebpf",
            Witness::Otlp => "otlp",
            Witness::Both => "both",
        }
    }
    pub fn ebpf(self) -> bool {
        self != Witness::Otlp
    }
    pub fn otlp(self) -> bool {
        self != Witness::Ebpf
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Row {
    pub router: Router,
    pub ignores_cancel: bool,
    pub witness: Witness,
    /// Every request streamed (`pd-sim load --stream-share 1`): SGLang answers a streamed
    /// refusal 200, the error inside the stream.
    pub stream: bool,
    /// An isolation breach the simulator injects (`--fault`, at [`fault_rate`]): the breaches
    /// are then the rooms it records as injected, not refused attempts.
    pub fault: Option<Fault>,
}

/// Share of requests a fault row's `--fault` hits: `stub-intake` hits only refused requests
/// (a quarter of them by default), so a larger share of those.
pub fn fault_rate(f: Fault) -> f64 {
    match f {
        Fault::StubIntake => 0.2,
        _ => 0.05,
    }
}
/// `stranded-kv`: how long the holding side keeps the request, past the 30 s window of the
/// rules file the row gives revenant ([`STRANDED_RULES`]).
pub const FAULT_HOLD: Duration = Duration::from_secs(40);
/// The `stranded-kv` row's windows for `stranded-kv` and `held-decode-slot`. The default rules
/// wait SGLang's 300 s timeouts and 30 s more (330 s); the row's workers hold for
/// [`FAULT_HOLD`], so it patches both rules (docs/advancement.md, "Windows").
pub const STRANDED_WINDOW: Duration = Duration::from_secs(30);
pub const STRANDED_RULES: &str = "rules:
  - name: stranded-kv
    must_follow:
      trigger: [{stage: [decode], kind: [aborted, cancelled, rejected]}, {stage: [transfer], kind: [cancelled]}]
      given: [{stage: [prefill], kind: [received, admitted, work]}]
      expect: [{stage: [prefill], kind: [completed, aborted, cancelled, rejected]}, {stage: [transfer], kind: [completed]}]
      within: 30s
  - name: held-decode-slot
    must_follow:
      trigger: [{stage: [prefill], kind: [aborted]}]
      given: [{stage: [decode], kind: [received, admitted, work]}]
      expect: [{stage: [decode], kind: [work, completed, aborted, cancelled, rejected]}, {stage: [transfer], kind: [completed]}]
      within: 30s
";

/// How long after an injected room's leg arrived its rule can have a verdict: the default
/// rules' (`test_harness::fault_verdict_window`), but `stranded-kv`'s patched window.
pub fn fault_window(f: Fault) -> Duration {
    if f == Fault::StrandedKv {
        return STRANDED_WINDOW;
    }
    test_harness::fault_verdict_window(f.as_str())
        .unwrap_or_else(|| panic!("no verdict window for --fault {}", f.as_str()))
}

/// Whether the witness can see the fault at all: two requests on one room need an event that
/// names both (the wire's legs; SGLang-shaped spans name no request id); an injected handshake has no spans (OTLP
/// cannot see an unknown room); a success after an abort needs the spans (the abort) and the
/// wire (the answer). A held leg is on the wire at once, in its spans only once it lets go:
/// OTLP sees it because [`FAULT_HOLD`] ends within the allowed lateness after the 30 s window
/// (a leg held longer reaches revenant too late to count).
pub fn fault_visible(f: Fault, w: Witness) -> bool {
    match f {
        // The legs name room and request id together; SGLang-shaped spans name no request id.
        Fault::RoomCollision => w.ebpf(),
        Fault::UnknownRoom => w.ebpf(),
        Fault::StrandedKv => true,
        Fault::SuccessAfterAbort => w == Witness::Both,
        // No span says who called the bootstrap server.
        Fault::ForeignRoutePut => w.ebpf(),
        // The refused room's stub moves on the wire and in the simulator's spans alike.
        Fault::StubIntake => true,
        // vLLM's handoff faults: no span carries `kv_transfer_params`.
        Fault::StaleKvParams | Fault::ForgedKvParams => w.ebpf(),
        // A failed transfer breaks no invariant.
        Fault::MooncakePullError => false,
    }
}

/// What a row's answers are: streamed or not.
pub fn answers_name(stream: bool) -> &'static str {
    if stream { "streamed" } else { "non-streamed" }
}

impl Row {
    /// Router (`ROUTER+fault:NAME` for an injected fault), decode, witness, answers: what
    /// `--rows` filters on, in that order.
    pub fn parts(&self) -> [String; 4] {
        [
            match self.fault {
                None => self.router.name().to_string(),
                Some(f) => format!("{}+fault:{}", self.router.name(), f.as_str()),
            },
            if self.ignores_cancel {
                "ignores"
            } else {
                "honours"
            }
            .to_string(),
            self.witness.name().to_string(),
            answers_name(self.stream).to_string(),
        ]
    }
    pub fn name(&self) -> String {
        self.parts().join("/")
    }
    /// The router (or a decode that ignores its cancel) hands refused attempts on: the
    /// oracle's cross-check.
    pub fn breach_row(&self) -> bool {
        self.router.breaches(self.stream) || self.ignores_cancel
    }
    /// The witness can see this row's breaches (every row without a fault: both witnesses see
    /// a refused attempt advance).
    pub fn visible(&self) -> bool {
        self.fault.is_none_or(|f| fault_visible(f, self.witness))
    }
    pub fn selected(&self, filter: &[Vec<String>]) -> bool {
        let parts = self.parts();
        filter.is_empty()
            || filter.iter().any(|pat| {
                pat.iter()
                    .zip(&parts)
                    .all(|(p, v)| p == "*" || p.is_empty() || p == v)
            })
    }
}

/// A real router in front of the simulator's workers; stopped when dropped.
pub enum RealRouter {
    Smg(SmgProcess),
    Vllm(test_harness::VllmRouter),
}

impl RealRouter {
    pub fn url(&self) -> &str {
        match self {
            RealRouter::Smg(s) => &s.url,
            RealRouter::Vllm(r) => &r.url,
        }
    }
    pub fn pid(&self) -> u32 {
        match self {
            RealRouter::Smg(s) => s.pid(),
            RealRouter::Vllm(r) => r.pid(),
        }
    }
}

pub struct RowResult {
    pub row: Row,
    pub requests: u64,
    pub rejected: usize,
    pub expected: usize,
    pub caught: usize,
    pub false_alerts: usize,
    pub false_attempts: usize,
    pub notifications: usize,
    pub breached_requests: usize,
    /// Breached requests notified more than once, not at all; requests notified without a
    /// breach; rate-limit summaries.
    pub repeated: usize,
    pub unnotified: usize,
    pub foreign: usize,
    pub suppressed: usize,
    pub wall_s: f64,
    /// Per-row details printed under the table.
    pub notes: Vec<String>,
    pub clean: bool,
}

/// [`judge`] for `foreign-route-put` rows, whose breaches are writes to prefill's bootstrap
/// server that name no attempt: each intruder's write (prefill counts them per room that caused
/// one) must be one `foreign-bootstrap-writer` violation naming its writer, and nothing else may
/// fire.
fn judge_writes(
    f: &Finished,
    violations: &[Value],
    load: &Value,
    mut notes: Vec<String>,
    keep: bool,
) -> RowResult {
    const RULE: &str = "foreign-bootstrap-writer";
    let expected: u64 = f
        .prefill
        .iter()
        .filter_map(|r| r["foreign_route_puts"].as_u64())
        .sum();
    let firsts = violations.iter().filter(|v| v["corroborates"] != true);
    let mut writers: BTreeMap<String, usize> = BTreeMap::new();
    let mut others: Vec<&Value> = Vec::new();
    for v in firsts {
        match (v["rule"].as_str(), v["worker"].as_str()) {
            (Some(RULE), Some(w)) => *writers.entry(w.to_string()).or_default() += 1,
            _ => others.push(v),
        }
    }
    let repeated = writers.values().filter(|n| **n > 1).count();
    let caught = writers.len().min(expected as usize);
    let false_alerts = others.len() + writers.len().saturating_sub(expected as usize);
    let incidents = f.alerts.iter().filter(|n| n["type"] == "incident").count();
    let suppressed = f
        .alerts
        .iter()
        .filter(|n| n["type"] == "suppressed")
        .count();
    let visible = f.row.visible();
    let unnotified = if visible {
        (expected as usize).saturating_sub(caught)
    } else {
        0
    };
    let clean = false_alerts == 0
        && repeated == 0
        && unnotified == 0
        && suppressed == 0
        && (visible || writers.is_empty());
    for v in others.iter().take(3) {
        notes.push(format!("false alert: {}", v["summary"]));
    }
    if !clean {
        std::fs::write(
            f.dir.join("violations.json"),
            serde_json::to_string_pretty(&violations).unwrap(),
        )
        .unwrap();
        notes.push(format!("files kept in {}", f.dir.display()));
    } else if !keep {
        let _ = std::fs::remove_dir_all(&f.dir);
    }
    RowResult {
        row: f.row,
        requests: load["sent"].as_u64().unwrap_or(0),
        rejected: f.prefill.iter().filter(|r| refused(r)).count(),
        expected: expected as usize,
        caught,
        false_alerts,
        false_attempts: 0,
        notifications: incidents,
        breached_requests: expected as usize,
        repeated,
        unnotified,
        foreign: 0,
        suppressed,
        wall_s: f.wall_s,
        notes,
        clean,
    }
}

/// The simulator's per-attempt records: SGLang's per room (`/sim/rooms`), vLLM's per request
/// (`/sim/requests`, one attempt each).
pub fn rooms(url: &str, vllm: bool) -> Vec<Value> {
    let path = if vllm { "/sim/requests" } else { "/sim/rooms" };
    match http_json(&format!("{url}{path}")) {
        Ok(Value::Array(a)) => a,
        other => panic!("{url}{path}: {other:?}"),
    }
}

/// Whether a prefill record is a refusal: a 4xx or 503 answer, or (a streamed answer is a 200)
/// such an error inside the stream. A 500 is an abort: the request had been taken on.
pub fn refused(r: &Value) -> bool {
    let refusal = |k: &str| {
        let c = r[k].as_u64().unwrap_or(0);
        (400..500).contains(&c) || c == 503
    };
    refusal("status") || refusal("error_code")
}

/// Whether decode's record of an attempt shows it advanced there: KV landed in its pages
/// (SGLang's Success status, bytes through the transfer engine; vLLM's KV chunks) or decode
/// generated tokens for it.
pub fn decode_advanced(d: &Value) -> bool {
    let n = |k: &str| d[k].as_u64().unwrap_or(0);
    n("generated_tokens") > 0
        || n("kv_bytes_received") > 0
        || n("kv_chunks") > 0
        || d["kv_done"] == true
        || d["statuses_received"]
            .as_array()
            .is_some_and(|s| s.iter().any(|v| v == 4))
}

/// The attempt a record is about: the room (SGLang), the request name (vLLM).
pub fn key_of(r: &Value, vllm: bool) -> Option<String> {
    if vllm {
        r["id"].as_str().map(str::to_string)
    } else {
        r["room"].as_u64().map(|r| r.to_string())
    }
}

pub fn wait_rooms_settled(cluster: &Cluster, vllm: bool, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        // vLLM's prefill holds the KV of an admitted request until decode has read it. A room
        // no request came for (an injected unknown room: only its handshake) never settles.
        let pending = [&cluster.prefill, &cluster.decode]
            .iter()
            .flat_map(|u| rooms(u, vllm))
            .filter(|r| vllm || r["received_ns"].as_u64().unwrap_or(0) > 0)
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

/// What a row's processes get beyond the row itself.
pub struct RowSetup {
    /// Extra arguments of the prefill worker and of the decode worker.
    pub prefill_args: Vec<String>,
    pub decode_args: Vec<String>,
    /// `revenant run`'s flags; the row adds its witness's (listeners, eBPF and pids).
    pub revenant_args: Vec<String>,
    /// Record the normalized events (`--events-jsonl DIR/events.jsonl`): shown for the rooms of
    /// a row that is not clean.
    pub events_jsonl: bool,
}

/// A row's running processes.
pub struct RowRun {
    pub row: Row,
    pub vllm: bool,
    /// When the row started (its wall time runs to the teardown).
    pub t0: Instant,
    pub dir: PathBuf,
    pub cluster: Cluster,
    pub real_router: Option<RealRouter>,
    /// Where the load goes: the real router, else pd-sim's.
    pub router_url: String,
    pub rev: Revenant,
    pub events_path: PathBuf,
}

/// Starts a row in `dir` (emptied first): the cluster, the real router (`real`, when the row
/// names one), then revenant watching them.
pub fn start_row(
    row: Row,
    real: Option<&Path>,
    revenant_bin: &Path,
    pd_sim: &Path,
    dir: PathBuf,
    setup: &RowSetup,
) -> RowRun {
    let vllm = row.router.vllm();
    let t0 = Instant::now();
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
    let mut decode_args: Vec<String> = Vec::new();
    if !vllm {
        decode_args.extend([
            "--disaggregation-waiting-timeout-ms".into(),
            DECODE_WAITING_TIMEOUT.as_millis().to_string(),
        ]);
    }
    if row.ignores_cancel {
        decode_args.push("--decode-ignores-cancel".into());
    }
    decode_args.extend(setup.decode_args.iter().cloned());
    if !decode_args.is_empty() {
        cluster_args.extend(["--decode-args".into(), decode_args.join(" ")]);
    }
    if !setup.prefill_args.is_empty() {
        cluster_args.extend(["--prefill-args".into(), setup.prefill_args.join(" ")]);
    }
    if let Some(f) = row.fault {
        cluster_args.extend([
            "--fault".into(),
            f.as_str().into(),
            "--fault-rate".into(),
            fault_rate(f).to_string(),
            "--fault-hold-ms".into(),
            FAULT_HOLD.as_millis().to_string(),
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
                    (&cluster.prefill, &cluster.decode),
                    None,
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
    let mut args: Vec<String> = setup.revenant_args.clone();
    if setup.events_jsonl {
        args.extend(["--events-jsonl".into(), events_path.display().to_string()]);
    }
    if row.fault == Some(Fault::StrandedKv) {
        let rules = dir.join("rules.yaml");
        std::fs::write(&rules, STRANDED_RULES).unwrap();
        args.extend(["--rules".into(), rules.display().to_string()]);
    }
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
    let rev = Revenant::start(revenant_bin, &dir, &args)
        .unwrap_or_else(|e| panic!("{}: revenant: {e:#}", row.name()));
    let want_ebpf = if row.witness.ebpf() { "live" } else { "off" };
    assert_eq!(
        rev.ready["ebpf"],
        want_ebpf,
        "{}: {}",
        row.name(),
        rev.ready
    );
    RowRun {
        row,
        vllm,
        t0,
        dir,
        cluster,
        real_router,
        router_url,
        rev,
        events_path,
    }
}

/// Waits until revenant can have judged everything the finished load caused; returns its
/// metrics then.
pub fn await_judgement(run: &RowRun, notes: &mut Vec<String>) -> Vec<Sample> {
    let (row, vllm, cluster, rev) = (run.row, run.vllm, &run.cluster, &run.rev);
    // Every leg over (a decode waiting for KV times out after [`DECODE_WAITING_TIMEOUT`]);
    // then the deadline rules (orphaned-leg) of the last rejection must have been judged:
    // `revenant run` judges a deadline once its watermark (wall clock minus the allowed
    // lateness) passes it, checked on a 1 s tick; then revenant quiet (no alert pending in its
    // group wait).
    if !wait_rooms_settled(cluster, vllm, Duration::from_secs(120)) {
        notes.push("rooms still pending after 120 s".into());
    }
    let last_rejection = rooms(&cluster.prefill, vllm)
        .iter()
        .filter(|r| refused(r))
        .filter_map(|r| r["answered_ns"].as_u64())
        .max()
        .unwrap_or(0);
    let mut judged_by =
        last_rejection + (ORPHANED_LEG_WINDOW + SKEW + LATENESS + TICK).as_nanos() as u64;
    if let Some(f) = row.fault {
        // An injected room's verdict is due its rule's window after its leg arrived.
        let last_leg = rooms(&cluster.prefill, vllm)
            .iter()
            .chain(&rooms(&cluster.decode, vllm))
            .map(|r| {
                let at = |k: &str| r[k].as_u64().unwrap_or(0);
                at("received_ns").max(at("bootstrap_ns"))
            })
            .max()
            .unwrap_or(0);
        judged_by =
            judged_by.max(last_leg + (fault_window(f) + SKEW + LATENESS + TICK).as_nanos() as u64);
    }
    let now = pd_sim::ids::now_ns();
    if judged_by > now {
        std::thread::sleep(Duration::from_nanos(judged_by - now) + Duration::from_millis(500));
    }

    rev.wait_quiet(Duration::from_secs(3), Duration::from_secs(120), None)
        .unwrap_or_else(|e| panic!("{}: {e:#}\n{}", row.name(), rev.log_tail(30)))
}

/// What a finished row leaves for the oracle: the simulator's records, revenant's notifications.
pub struct Finished {
    pub row: Row,
    pub vllm: bool,
    pub dir: PathBuf,
    pub events_path: PathBuf,
    pub prefill: Vec<Value>,
    pub decode: Vec<Value>,
    /// The rooms the simulator's router reused (`--fault room-collision`).
    pub collided: Vec<Value>,
    /// Spans the simulator's exporters dropped or failed to send.
    pub sim_losses: u64,
    pub alerts: Vec<Value>,
    pub wall_s: f64,
}

/// Reads the simulator's records, stops revenant (its drain delivers what it holds) and tears
/// the row down.
pub fn finish_row(run: RowRun) -> Finished {
    let RowRun {
        row,
        vllm,
        t0,
        dir,
        cluster,
        real_router,
        mut rev,
        events_path,
        ..
    } = run;
    let prefill = rooms(&cluster.prefill, vllm);
    let decode = rooms(&cluster.decode, vllm);
    let collided = http_json(&format!("{}/sim/stats", cluster.router))
        .map(|s| s["collided_rooms"].as_array().cloned().unwrap_or_default())
        .unwrap_or_default();
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
    Finished {
        row,
        vllm,
        dir,
        events_path,
        prefill,
        decode,
        collided,
        sim_losses,
        alerts,
        wall_s,
    }
}

/// The oracle against revenant's verdicts (`violations`: every one of the row, `metrics`: its
/// counters at the end, `load`: `pd-sim load`'s summary); `notes` so far go first. The row's
/// files are kept when it is not clean, else removed unless `keep`.
pub fn judge(
    f: &Finished,
    violations: &[Value],
    metrics: &[Sample],
    load: &Value,
    mut notes: Vec<String>,
    keep: bool,
) -> RowResult {
    let Finished {
        row,
        vllm,
        dir,
        events_path,
        prefill,
        decode,
        collided,
        sim_losses,
        alerts,
        wall_s,
    } = f;
    let (row, vllm, sim_losses, wall_s) = (*row, *vllm, *sim_losses, *wall_s);
    if row.fault == Some(Fault::ForeignRoutePut) {
        return judge_writes(f, violations, load, notes, keep);
    }
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
    for r in prefill.iter().chain(decode.iter()) {
        if let (Some(rid), Some(room)) = (r["rid"].as_str(), key_of(r, vllm)) {
            rid_room.insert(rid.to_string(), room);
        }
    }
    let rejected: BTreeSet<String> = prefill
        .iter()
        .filter(|r| refused(r))
        .filter_map(|r| key_of(r, vllm))
        .collect();
    // A refused attempt whose decode leg reached decode (decode read its HTTP request).
    let reached_decode = |room: &String| {
        decode_rooms
            .get(room)
            .is_some_and(|d| d["received_ns"].as_u64().unwrap_or(0) > 0)
    };
    // ... and advanced there, or whose leg decode kept past orphaned-leg's window after the
    // refusal (or never ended).
    let window = ORPHANED_LEG_WINDOW.as_nanos() as u64;
    let kept_or_advanced = |room: &String| {
        let (Some(p), Some(d)) = (prefill_rooms.get(room), decode_rooms.get(room)) else {
            return false;
        };
        let refused_at = p["answered_ns"].as_u64().unwrap_or(0);
        let ended = d["ended_ns"].as_u64().unwrap_or(0);
        decode_advanced(d) || ended == 0 || ended > refused_at + window
    };
    let breaches: BTreeSet<String> = if row.fault == Some(Fault::RoomCollision) {
        // The router's record: the rooms it reused.
        collided
            .iter()
            .filter_map(|r| r.as_u64().map(|r| r.to_string()))
            .collect()
    } else if let Some(f) = row.fault {
        // What the simulator injected (the holding side records a stranded room).
        prefill
            .iter()
            .chain(decode.iter())
            .filter(|r| r["outcome"] == f.outcome())
            .filter_map(|r| key_of(r, vllm))
            .collect()
    } else {
        // What the simulator's records say happened to each refused attempt at decode.
        let by_records: BTreeSet<String> = rejected
            .iter()
            .filter(|r| reached_decode(r) && kept_or_advanced(r))
            .cloned()
            .collect();
        // The cross-check: what the row's router (and decode) are known to do.
        let by_router: BTreeSet<String> = if row.breach_row() {
            rejected
                .iter()
                .filter(|r| reached_decode(r))
                .cloned()
                .collect()
        } else {
            BTreeSet::new()
        };
        if by_records != by_router {
            let only_records: Vec<&String> = by_records.difference(&by_router).take(3).collect();
            let only_router: Vec<&String> = by_router.difference(&by_records).take(3).collect();
            notes.push(format!(
                "oracle: {} breaches by the records, {} by what the router is known to do \
                 (only by the records, e.g. {only_records:?}; only by the router, e.g. \
                 {only_router:?})",
                by_records.len(),
                by_router.len()
            ));
        }
        by_records
    };
    // vLLM: one attempt per request, so the request is its attempt (the notification names
    // it by the client's id or the router's X-Request-Id, depending on the witness).
    let request_of = |room: &String| {
        if vllm {
            return room.clone();
        }
        // An injected room belongs to no request: it is its own.
        prefill_rooms
            .get(room)
            .or_else(|| decode_rooms.get(room))
            .and_then(|r| r["request_id"].as_str())
            .map_or_else(|| format!("room {room}"), str::to_string)
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
    for v in violations {
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
    let sum = |name: &str| metric_sum(metrics, name, &[]) as u64;
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
        "load {} ok {} rejected {} in stream {} at {:.0}/s; prefill rooms {}, decode rooms {}; events ebpf {} otlp {} (router received: {} from spans); caught by {:?}",
        load["sent"],
        load["ok"],
        load["rejected_by_status"],
        load["failed_in_stream"],
        load["achieved_rate"].as_f64().unwrap_or(0.0),
        prefill.len(),
        decode.len(),
        metric_sum(metrics, "revenant_events_total", &[("source", "ebpf")]),
        metric_sum(metrics, "revenant_events_total", &[("source", "otlp")]),
        metric_sum(
            metrics,
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
    // A witness that cannot see the row's breaches is judged on its silence alone.
    let visible = row.visible();
    let clean = (missed.is_empty() || !visible)
        && false_alerts == 0
        && repeated.is_empty()
        && (unnotified.is_empty() || !visible)
        && foreign.is_empty()
        && suppressed == 0;
    if !clean {
        // Enough to start digging: the rooms' records and revenant's events of them.
        let mut look: Vec<String> = missed.iter().take(3).cloned().collect();
        look.extend(false_rooms.iter().take(3).cloned());
        let events = test_harness::read_jsonl(events_path).unwrap_or_default();
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
    } else if !keep {
        let _ = std::fs::remove_dir_all(dir);
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
        repeated: repeated.len(),
        unnotified: unnotified.len(),
        foreign: foreign.len(),
        suppressed,
        wall_s,
        notes,
        clean,
    }
}
