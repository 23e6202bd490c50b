//! Precision and recall of revenant against SGLang's own PD code: one SGLang 0.5.23 prefill and
//! one decode worker of the harness (`tests/sglang-harness`: SGLang's HTTP server, tokenizer
//! manager, bootstrap server and Mooncake KV managers; the model and scheduler loop played),
//! smg 1.13.0 and sglang-router 0.3.2 both in front of them, a second prefill playing SGLang
//! <= 0.5.20's intake (a refused request's one-token stub bootstraps and transfers) behind
//! another smg 1.13.0 with the same decode, open-loop load through each router (`/generate`,
//! `/v1/completions`, `/v1/chat/completions`; streamed and not; a share over prefill's capacity
//! on both of SGLang's refusal paths), and three `revenant run`
//! (release build) watching it all at once: eBPF alone, OTLP alone, both. The oracle is SGLang's
//! own doing, per room, from the workers' ground truth (the scheduler's records and the HTTP
//! process's: each request's `x-request-id`, room and answer), never revenant's output.
//! (A `harness = false` bench binary.)
//!
//! ```text
//! SGLANG_HARNESS_PYTHON=target/sglang-venv/bin/python \
//! PD_SIM_SMG113=target/xtask-venv-smg113/bin/smg PD_SIM_SMG=target/xtask-venv/bin/smg \
//!   cargo bench -p e2e --bench sglang_precision_recall -- [--requests 500] [--rate 10]
//!     [--over-capacity-share 0.3] [--waiting-timeout 10] [--seed 1] [--out DIR] [--keep]
//! ```
//!
//! Needs root (eBPF). Binaries: `REVENANT_BIN` and `PD_SIM_BIN` (the load generator), else
//! release builds made now. A router whose variable is unset is left out, with the reason
//! printed; `SGLANG_HARNESS_PYTHON` is required.
//!
//! - The workers: prefill's context 128 tokens and KV pool 96 pages, so SGLang's tokenizer
//!   manager refuses a prompt of >= 128 tokens (context length) and its scheduler one of
//!   90..127 (`validate_input_length`); decode has a 4096-token context and 16384 pages (it
//!   takes them all), 256 metadata slots, and waits `--waiting-timeout` seconds for KV that
//!   never comes (`SGLANG_DISAGGREGATION_WAITING_TIMEOUT`; SGLang's default 300 s).
//! - The routers: smg 1.13.0 with its defaults; sglang-router 0.3.2 with
//!   `--disable-circuit-breaker` (its breaker opens for 60 s after 10 failures: every request
//!   would then be answered 503 by the router without reaching a worker).
//! - The load: five groups (smg 1.13.0 and sglang-router 0.3.2, each streamed and not; smg
//!   1.13.0 in front of the <= 0.5.20 prefill, not streamed), each `--requests`/5 requests at
//!   `--rate`/5 (`pd-sim load --api mixed --chat-share 0.33`, prompts 8..80 words, a share
//!   `--over-capacity-share` of 92..126 or 130..200 words), each request with an
//!   `x-request-id` naming its group.
//! - revenant: `run`'s defaults (`--allowed-lateness 15s`, `--group-wait 2s`, the embedded
//!   rules) but `--rate-limit 0`, `--recent-violations 1000000`, `--spool-no-fsync`, and for
//!   eBPF `--no-sglang-conventions` with `--watch` rules on this run's workers and routers.
//!   The workers export their spans (`--enable-trace`, OTLP/HTTP) and the routers theirs
//!   (`--enable-trace`, OTLP/gRPC) to the harness's sink, which forwards each export to the
//!   two revenants with OTLP.
//!
//! Oracle, per attempt (room): refused = prefill answered 4xx or 503, or a 200 whose stream
//! carries such an error; a breach = a refused attempt whose decode leg reached decode and that
//! decode advanced (its KV landed, it produced output) or kept past `orphaned-leg`'s window
//! (decode's end of the leg, its first of: ABORT sent, abort processed, transfer failed,
//! answered, more than 6 s after prefill's refusal, or never). OTLP alone cannot see a refusal
//! by SGLang's tokenizer (SGLang never exports that request's root span): those breaches are
//! shown as "cannot see" for that witness. A stub's refusal is only its root's finish reason in
//! the workers' spans; OTLP sees it through the traced router's span (the request answered 400
//! while decode worked on it: `activity-after-request-failed`).
//!
//! Columns per row (router × prefill × answers × witness): requests sent; refused attempts; breaches
//! expected; caught (breaches with at least one violation of that witness's revenant); false
//! alerts (first proofs about an attempt of the row that is not a breach); notifications
//! (incident notifications about the row's requests) against the breached requests the witness
//! can see; recall; precision (caught over caught plus falsely alerted attempts). Violations
//! naming no attempt of the run are listed under the table.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use test_harness::notifications::{is_incident, room_of};
use test_harness::sglang::{
    OtlpSink, Role, SglangWorker, Smg, WorkerOptions, harness_python, start_workers,
    write_model_dir,
};
use test_harness::{Revenant, metric_sum, read_jsonl_so_far};

const PREFILL_CONTEXT: u32 = 128;
const PREFILL_KV_PAGES: u32 = 96;
const DECODE_CONTEXT: u32 = 4096;
const DECODE_KV_PAGES: u32 = 16384;
const DECODE_METADATA_SLOTS: u32 = 256;
/// Prompt lengths in words (one token each): admitted, refused by the scheduler, refused by
/// the tokenizer manager.
const PROMPT_LEN: &str = "8..80";
const OVER_CAPACITY_LEN: &str = "92..126,130..200";
/// revenant's defaults: `orphaned-leg`'s window for decode's end of a refused attempt's leg,
/// `--clock-skew`, `run --allowed-lateness`, its checker's tick.
const ORPHANED_LEG_WINDOW: Duration = Duration::from_secs(6);
const SKEW: Duration = Duration::from_millis(50);
const LATENESS: Duration = Duration::from_secs(15);
const TICK: Duration = Duration::from_secs(1);
/// SGLang's warmup and health checks go through the fake transfer backend to this host.
const FAKE_BOOTSTRAP_HOST: &str = "2.2.2.2";

struct Opts {
    requests: u64,
    rate: f64,
    over_capacity_share: f64,
    waiting_timeout_s: u32,
    seed: u64,
    out: PathBuf,
    keep: bool,
}

fn opts() -> Opts {
    let mut o = Opts {
        requests: 500,
        rate: 10.0,
        over_capacity_share: 0.3,
        waiting_timeout_s: 10,
        seed: 1,
        out: test_harness::workspace_root().join("target/sglang_precision_recall"),
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
            "--waiting-timeout" => {
                o.waiting_timeout_s = val().parse().expect("--waiting-timeout SECONDS")
            }
            "--seed" => o.seed = val().parse().expect("--seed S"),
            "--out" => o.out = val().into(),
            "--keep" => o.keep = true,
            // `cargo bench` passes `--bench`; ignore it and anything else libtest-like.
            _ => {}
        }
    }
    assert!(
        o.waiting_timeout_s as u64 > ORPHANED_LEG_WINDOW.as_secs() + 1,
        "--waiting-timeout must exceed orphaned-leg's 6 s window: a leg decode keeps must end \
         after it"
    );
    o
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum RouterKind {
    Smg113,
    Smg032,
}

impl RouterKind {
    fn name(self) -> &'static str {
        match self {
            RouterKind::Smg113 => "smg-1.13.0",
            RouterKind::Smg032 => "sglang-router-0.3.2",
        }
    }
    /// The variable naming its binary, and what `smg --version` must end with.
    fn var(self) -> (&'static str, &'static str) {
        match self {
            RouterKind::Smg113 => ("PD_SIM_SMG113", "smg 1.13.0"),
            RouterKind::Smg032 => ("PD_SIM_SMG", "0.3.2"),
        }
    }
    /// Its binary, or why its rows are left out.
    fn binary(self) -> Result<PathBuf, String> {
        let (var, want) = self.var();
        let Some(p) = std::env::var_os(var) else {
            return Err(format!("{var} is not set (the `smg` binary of {want})"));
        };
        let p = PathBuf::from(p);
        let out = std::process::Command::new(&p)
            .arg("--version")
            .output()
            .map_err(|e| format!("{var}={}: {e}", p.display()))?;
        let v = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if v.ends_with(want) {
            Ok(p)
        } else {
            Err(format!("{var}={} is {v:?}, not {want}", p.display()))
        }
    }
    /// Flags beyond the harness's launcher's: its spans to `otlp_grpc` (the sink's gRPC
    /// listener); 0.3.2 without its circuit breaker.
    fn extra(self, otlp_grpc: &str) -> Vec<String> {
        let mut v: Vec<String> = ["--enable-trace", "--otlp-traces-endpoint", otlp_grpc]
            .map(String::from)
            .to_vec();
        if self == RouterKind::Smg032 {
            v.push("--disable-circuit-breaker".into());
        }
        v
    }
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Witness {
    Ebpf,
    Otlp,
    Both,
}

impl Witness {
    const ALL: [Witness; 3] = [Witness::Ebpf, Witness::Otlp, Witness::Both];
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

/// The requests one router got, streamed or not, and which prefill is behind it: the load's
/// `x-request-id` prefix says which.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
struct Group {
    router: RouterKind,
    /// The prefill behind it plays SGLang <= 0.5.20's intake (`--intake-reject stub`).
    stub: bool,
    stream: bool,
}

impl Group {
    fn prefill(self) -> &'static str {
        if self.stub {
            "<= 0.5.20 (stub)"
        } else {
            "0.5.23"
        }
    }
    fn answers(self) -> &'static str {
        if self.stream {
            "streamed"
        } else {
            "non-streamed"
        }
    }
    fn prefix(self) -> String {
        let stub = if self.stub { "-stub" } else { "" };
        format!("{}{stub}-{}", self.router.name(), self.answers())
    }
}

/// A refusal status: 4xx, or 503 (a 500 is an abort: the request had been taken on).
fn is_refusal(code: u64) -> bool {
    (400..500).contains(&code) || code == 503
}

/// One attempt (a room) as SGLang's code saw it on both workers.
#[derive(Default, Debug)]
struct Attempt {
    room: u64,
    request_id: Option<String>,
    path: String,
    stream: bool,
    /// Prefill: its HTTP process received the leg; its scheduler did (a tokenizer refusal
    /// never reaches it); its answer (status, the code of an error inside a 200 stream, when
    /// the answer ended).
    p_received: bool,
    p_scheduler: bool,
    /// Prefill (<= 0.5.20) kept a refused request's one-token stub and ran it.
    p_stub: bool,
    p_status: u64,
    p_error_code: u64,
    p_answered_ns: u64,
    /// Decode: when it got its leg; its first end of the leg (0: never); whether its KV
    /// landed or decode produced output.
    d_received_ns: u64,
    d_end_ns: u64,
    d_advanced: bool,
}

impl Attempt {
    fn refused(&self) -> bool {
        is_refusal(self.p_status) || is_refusal(self.p_error_code)
    }
    /// SGLang's tokenizer manager refused it: its scheduler never saw it.
    fn tokenizer_path(&self) -> bool {
        self.refused() && !self.p_scheduler
    }
    fn breach(&self) -> bool {
        let kept = self.d_end_ns == 0
            || self.d_end_ns > self.p_answered_ns + ORPHANED_LEG_WINDOW.as_nanos() as u64;
        self.refused() && self.d_received_ns > 0 && (self.d_advanced || kept)
    }
}

/// The ground truth of a run: attempts by room, and each rid's room.
struct Truth {
    attempts: BTreeMap<u64, Attempt>,
    rid_room: HashMap<String, u64>,
}

fn rooms_of(r: &Value) -> Vec<u64> {
    r["rooms"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_u64)
        .collect()
}

fn ts(r: &Value) -> u64 {
    r["ts_ns"].as_u64().unwrap_or(0)
}

/// Attempts from the workers' truth logs: every room an HTTP process received (warmups and
/// health checks left out), then what each worker did with it.
fn truth(prefill: &[Value], decode: &[Value]) -> Truth {
    let mut attempts: BTreeMap<u64, Attempt> = BTreeMap::new();
    let mut rid_room = HashMap::new();
    for (role, records) in [(Role::Prefill, prefill), (Role::Decode, decode)] {
        for r in records.iter().filter(|r| r["event"] == "http_received") {
            if r["bootstrap_host"] == FAKE_BOOTSTRAP_HOST {
                continue;
            }
            for room in rooms_of(r) {
                let a = attempts.entry(room).or_insert_with(|| Attempt {
                    room,
                    ..Default::default()
                });
                a.request_id = a
                    .request_id
                    .take()
                    .or_else(|| r["request_id"].as_str().map(str::to_string));
                a.path = r["path"].as_str().unwrap_or_default().to_string();
                a.stream = r["stream"] == true;
                match role {
                    Role::Prefill => a.p_received = true,
                    Role::Decode => {
                        if a.d_received_ns == 0 {
                            a.d_received_ns = ts(r);
                        }
                    }
                }
            }
        }
    }
    let end = |a: &mut Attempt, t: u64| {
        if a.d_end_ns == 0 || t < a.d_end_ns {
            a.d_end_ns = t;
        }
    };
    for r in prefill {
        let room = r["room"].as_u64();
        match r["event"].as_str().unwrap_or_default() {
            "http_answered" => {
                for room in rooms_of(r) {
                    if let Some(a) = attempts.get_mut(&room)
                        && a.p_answered_ns == 0
                    {
                        a.p_status = r["status"].as_u64().unwrap_or(0);
                        a.p_error_code = r["error_code"].as_u64().unwrap_or(0);
                        a.p_answered_ns = ts(r);
                    }
                }
            }
            "request_received" => {
                if let (Some(room), Some(rid)) = (room, r["rid"].as_str()) {
                    rid_room.insert(rid.to_string(), room);
                    if let Some(a) = attempts.get_mut(&room) {
                        a.p_scheduler = true;
                    }
                }
            }
            "stub_admitted" => {
                if let Some(a) = room.and_then(|r| attempts.get_mut(&r)) {
                    a.p_stub = true;
                }
            }
            _ => {}
        }
    }
    for r in decode {
        let event = r["event"].as_str().unwrap_or_default();
        if event == "http_answered" {
            for room in rooms_of(r) {
                if let Some(a) = attempts.get_mut(&room) {
                    end(a, ts(r));
                }
            }
            continue;
        }
        if event == "zmq_send" {
            // Decode's ABORT for the room: [ABORT, room, ip, port(, generation)].
            let f = &r["frames"];
            if f[0] == "ABORT"
                && let Some(room) = f[1].as_str().and_then(|s| s.parse::<u64>().ok())
                && let Some(a) = attempts.get_mut(&room)
            {
                end(a, ts(r));
            }
            continue;
        }
        let Some(room) = r["room"].as_u64() else {
            continue;
        };
        if event == "request_received"
            && let Some(rid) = r["rid"].as_str()
        {
            rid_room.insert(rid.to_string(), room);
        }
        let Some(a) = attempts.get_mut(&room) else {
            continue;
        };
        match event {
            "answered" => {
                end(a, ts(r));
                if r["output_tokens"].as_u64().unwrap_or(0) > 0 {
                    a.d_advanced = true;
                }
            }
            "aborted" | "transfer_failed" | "handshake_failed" => end(a, ts(r)),
            "kv_landed" => a.d_advanced = true,
            _ => {}
        }
    }
    Truth { attempts, rid_room }
}

/// One row's figures.
struct RowResult {
    group: Group,
    witness: Witness,
    requests: usize,
    refused: usize,
    expected: usize,
    /// Breaches the witness cannot see (OTLP: tokenizer-path refusals), and of those caught.
    hidden: usize,
    hidden_caught: usize,
    caught: usize,
    false_alerts: usize,
    false_attempts: usize,
    notifications: usize,
    breached_requests: usize,
    notes: Vec<String>,
    clean: bool,
}

fn pct(num: usize, den: usize) -> String {
    if den == 0 {
        "–".into()
    } else {
        format!("{:.1} %", num as f64 * 100.0 / den as f64)
    }
}

fn table_line(r: &RowResult) -> String {
    let visible = r.expected - r.hidden;
    let recall = if r.hidden == 0 {
        pct(r.caught, r.expected)
    } else {
        format!(
            "{} of what it sees; cannot see {} ({}; {} caught)",
            pct(r.caught - r.hidden_caught, visible),
            r.hidden,
            "tokenizer path",
            r.hidden_caught
        )
    };
    format!(
        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} / {} | {} | {} |",
        r.group.router.name(),
        r.group.prefill(),
        r.group.answers(),
        r.witness.name(),
        r.requests,
        r.refused,
        r.expected,
        r.caught,
        r.false_alerts,
        r.notifications,
        r.breached_requests,
        recall,
        pct(r.caught, r.caught + r.false_attempts),
    )
}

/// What one revenant said.
struct Verdicts {
    violations: Vec<Value>,
    alerts: Vec<Value>,
    metrics: Vec<test_harness::Sample>,
}

/// The rows of one witness from its verdicts.
fn score(
    witness: Witness,
    groups: &[Group],
    t: &Truth,
    load: &BTreeMap<Group, Vec<Value>>,
    v: &Verdicts,
) -> (Vec<RowResult>, Vec<String>) {
    let group_of = |request_id: Option<&str>| -> Option<Group> {
        let id = request_id?;
        groups
            .iter()
            .copied()
            .find(|g| id.starts_with(&format!("{}-", g.prefix())))
    };
    let attempt_of = |x: &Value| -> Option<u64> {
        room_of(&x["attempt"]).or_else(|| {
            x["attempt"]["rid"]
                .as_str()
                .and_then(|rid| t.rid_room.get(rid).copied())
        })
    };
    // OTLP alone cannot see a tokenizer refusal (its root span is never exported). A stub's
    // refusal is only its root's finish reason in the workers' spans, but the traced router's
    // span says it answered the request 400 while decode worked on it: that it sees.
    let hidden = |a: &Attempt| witness == Witness::Otlp && a.tokenizer_path();
    let mut unattributed: Vec<String> = Vec::new();
    // Violations by attempt (first proofs), and the rules.
    let mut violated: BTreeMap<u64, BTreeSet<String>> = BTreeMap::new();
    for x in &v.violations {
        if x["corroborates"] == true {
            continue;
        }
        let rule = x["rule"].as_str().unwrap_or("?").to_string();
        if let Some(room) = attempt_of(x).filter(|r| t.attempts.contains_key(r)) {
            violated.entry(room).or_default().insert(rule);
            continue;
        }
        // A request-scope finding (the router failed the request, then one of its attempts
        // advanced) names the request, not an attempt: it is about the request's breached
        // attempts, or, where none is, a false alert on each of them.
        let of_request: Vec<&Attempt> = x["request"]["request_id"]
            .as_str()
            .map(|id| {
                t.attempts
                    .values()
                    .filter(|a| a.request_id.as_deref() == Some(id))
                    .collect()
            })
            .unwrap_or_default();
        if of_request.is_empty() {
            unattributed.push(format!("{rule}: {}", x["summary"]));
            continue;
        }
        let breached: Vec<&&Attempt> = of_request.iter().filter(|a| a.breach()).collect();
        let about: Vec<u64> = if breached.is_empty() {
            of_request.iter().map(|a| a.room).collect()
        } else {
            breached.iter().map(|a| a.room).collect()
        };
        for room in about {
            violated.entry(room).or_default().insert(rule.clone());
        }
    }
    // Notifications by request.
    let mut per_request: BTreeMap<String, usize> = BTreeMap::new();
    for n in v.alerts.iter().filter(|n| is_incident(n)) {
        let mut about: BTreeSet<String> = n["findings"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(attempt_of)
            .filter_map(|room| t.attempts.get(&room)?.request_id.clone())
            .collect();
        if let Some(id) = n["request"]["request_id"].as_str() {
            about.insert(id.to_string());
        }
        if about.is_empty() {
            unattributed.push(format!("notification {}", n["incident_key"]));
        }
        for id in about {
            *per_request.entry(id).or_default() += 1;
        }
    }
    let mut rows = Vec::new();
    for &g in groups {
        let of_group: Vec<&Attempt> = t
            .attempts
            .values()
            .filter(|a| group_of(a.request_id.as_deref()) == Some(g))
            .collect();
        let breaches: Vec<&Attempt> = of_group.iter().copied().filter(|a| a.breach()).collect();
        let caught: Vec<&&Attempt> = breaches
            .iter()
            .filter(|a| violated.contains_key(&a.room))
            .collect();
        let mut caught_by: BTreeMap<String, usize> = BTreeMap::new();
        for a in &caught {
            for rule in &violated[&a.room] {
                *caught_by.entry(rule.clone()).or_default() += 1;
            }
        }
        let falsely: Vec<&Attempt> = of_group
            .iter()
            .copied()
            .filter(|a| !a.breach() && violated.contains_key(&a.room))
            .collect();
        let false_alerts: usize = falsely.iter().map(|a| violated[&a.room].len()).sum();
        let breached_requests: BTreeSet<&str> = breaches
            .iter()
            .filter(|a| !hidden(a))
            .filter_map(|a| a.request_id.as_deref())
            .collect();
        let breached_any: BTreeSet<&str> = breaches
            .iter()
            .filter_map(|a| a.request_id.as_deref())
            .collect();
        let of_group_requests = |id: &String| group_of(Some(id)) == Some(g);
        let notified: BTreeMap<&String, usize> = per_request
            .iter()
            .filter(|(id, _)| of_group_requests(id))
            .map(|(id, n)| (id, *n))
            .collect();
        let notifications: usize = notified.values().sum();
        let repeated: Vec<&&String> = notified
            .iter()
            .filter(|(_, n)| **n > 1)
            .map(|(id, _)| id)
            .collect();
        let unnotified: Vec<&&str> = breached_requests
            .iter()
            .filter(|id| !per_request.contains_key(**id))
            .collect();
        // A notification about a request with no breach (a breach it cannot see is no false
        // one).
        let foreign: Vec<&&String> = notified
            .keys()
            .filter(|id| !breached_any.contains(id.as_str()))
            .collect();
        let hidden_breaches: Vec<&&Attempt> = breaches.iter().filter(|a| hidden(a)).collect();
        let hidden_caught = hidden_breaches
            .iter()
            .filter(|a| violated.contains_key(&a.room))
            .count();
        let missed: Vec<&&Attempt> = breaches
            .iter()
            .filter(|a| !hidden(a) && !violated.contains_key(&a.room))
            .collect();
        let results = &load[&g];
        let mut notes = Vec::new();
        let mut client: BTreeMap<String, usize> = BTreeMap::new();
        for r in results {
            let k = match (
                r["error"].as_str(),
                r["status"].as_u64(),
                r["error_code"].as_u64(),
            ) {
                (Some(e), _, _) => format!("error {e}"),
                (None, Some(s), Some(c)) if c > 0 => format!("{s} (in stream {c})"),
                (None, Some(s), _) => s.to_string(),
                _ => "?".into(),
            };
            *client.entry(k).or_default() += 1;
        }
        let refused: Vec<&&Attempt> = of_group.iter().filter(|a| a.refused()).collect();
        let tokenizer = refused.iter().filter(|a| a.tokenizer_path()).count();
        // How long decode kept a refused attempt's leg after the refusal, breach or not.
        let held = |breach: bool| {
            let mut s: Vec<f64> = refused
                .iter()
                .filter(|a| a.d_received_ns > 0 && a.d_end_ns > 0 && a.breach() == breach)
                .map(|a| (a.d_end_ns as f64 - a.p_answered_ns as f64) / 1e9)
                .collect();
            s.sort_by(f64::total_cmp);
            match (s.first(), s.last()) {
                (Some(lo), Some(hi)) => format!("{lo:.2}-{hi:.2} s ({})", s.len()),
                _ => "none".into(),
            }
        };
        notes.push(format!(
            "client got {client:?}; attempts {} ({} refused: {tokenizer} by the tokenizer, {} by the scheduler; {} run as stubs); breaches {} ({} by the tokenizer path); caught by {caught_by:?}",
            of_group.len(),
            refused.len(),
            refused.len() - tokenizer,
            refused.iter().filter(|a| a.p_stub).count(),
            breaches.len(),
            breaches.iter().filter(|a| a.tokenizer_path()).count(),
        ));
        notes.push(format!(
            "decode ended a refused attempt's leg after the refusal: breaches {}, others {}",
            held(true),
            held(false)
        ));
        for a in missed.iter().take(3) {
            notes.push(format!("missed {a:?}"));
        }
        for a in falsely.iter().take(3) {
            notes.push(format!("false alert on {a:?}: {:?}", violated[&a.room]));
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
            && falsely.is_empty()
            && repeated.is_empty()
            && unnotified.is_empty()
            && foreign.is_empty();
        rows.push(RowResult {
            group: g,
            witness,
            requests: results.len(),
            refused: refused.len(),
            expected: breaches.len(),
            hidden: hidden_breaches.len(),
            hidden_caught,
            caught: caught.len(),
            false_alerts,
            false_attempts: falsely.len(),
            notifications,
            breached_requests: breached_requests.len(),
            notes,
            clean,
        });
    }
    let mut notes = Vec::new();
    let sum = |name: &str| metric_sum(&v.metrics, name, &[]) as u64;
    let mut losses = Vec::new();
    for name in [
        "revenant_dropped_items_total",
        "revenant_ebpf_batches_dropped_total",
        "revenant_ebpf_http_desyncs_total",
        "revenant_ebpf_zmtp_desyncs_total",
        "revenant_ebpf_decode_errors_total",
        "revenant_ebpf_connections_evicted_total",
    ] {
        let n = sum(name);
        if n > 0 {
            losses.push(format!("{name} {n}"));
        }
    }
    notes.push(format!(
        "{}: events ebpf {} otlp {}; violations {} ({} naming no attempt of the run){}",
        witness.name(),
        metric_sum(&v.metrics, "revenant_events_total", &[("source", "ebpf")]),
        metric_sum(&v.metrics, "revenant_events_total", &[("source", "otlp")]),
        v.violations.len(),
        unattributed.len(),
        if losses.is_empty() {
            String::new()
        } else {
            format!("; losses: {}", losses.join(", "))
        }
    ));
    for u in unattributed.iter().take(5) {
        notes.push(format!("  naming no attempt of the run: {u}"));
    }
    if !unattributed.is_empty() {
        for r in &mut rows {
            r.clean = false;
        }
    }
    (rows, notes)
}

fn regex_escape(s: &str) -> String {
    s.chars()
        .flat_map(|c| {
            let special = "\\.+*?()|[]{}^$".contains(c);
            special.then_some('\\').into_iter().chain([c])
        })
        .collect()
}

/// `revenant run` for one witness, its files in `dir`: eBPF on this run's workers (their
/// command lines name `here`) and routers (smg 1.13.0 retitles itself `smg::router`; 0.3.2's
/// command line names the model directory under `here`), OTLP/HTTP for the sink's forwards.
fn start_revenant(bin: &Path, dir: &Path, here: &Path, witness: Witness) -> Revenant {
    std::fs::create_dir_all(dir).unwrap();
    let here = regex_escape(&here.display().to_string());
    let mut args: Vec<String> = [
        "--admin",
        "127.0.0.1:0",
        "--otlp-grpc",
        "off",
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
    if witness.ebpf() {
        args.extend(["--ebpf", "on", "--no-sglang-conventions"].map(String::from));
        for role in ["prefill", "decode"] {
            args.push("--watch".into());
            args.push(format!(
                "{role}=sglang_harness worker --role {role} .*{here}"
            ));
        }
        args.push("--watch".into());
        args.push("router=^smg::router".into());
        args.push("--watch".into());
        args.push(format!("router=bin/smg launch .*{here}"));
    } else {
        args.extend(["--ebpf", "off"].map(String::from));
    }
    args.push("--otlp-http".into());
    args.push(if witness.otlp() { "127.0.0.1:0" } else { "off" }.into());
    let rev = Revenant::start_recording(bin, dir, &args, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("revenant ({}): {e:#}", witness.name()));
    let want = if witness.ebpf() { "live" } else { "off" };
    assert_eq!(rev.ready["ebpf"], want, "{}: {}", witness.name(), rev.ready);
    rev
}

fn now_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

fn main() {
    // `cargo test --all-targets` runs bench binaries without `--bench`: no run of minutes there.
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "sglang_precision_recall: run with `cargo bench -p e2e --bench sglang_precision_recall`"
        );
        return;
    }
    let o = opts();
    assert!(
        test_harness::is_root(),
        "the eBPF witness needs root (the probes are loaded into the kernel)"
    );
    let python = harness_python();
    let bins = test_harness::Binaries::locate()
        .unwrap_or_else(|e| panic!("release builds of revenant and pd-sim: {e:#}"));
    let mut skipped = Vec::new();
    let routers: Vec<(RouterKind, PathBuf)> = [RouterKind::Smg113, RouterKind::Smg032]
        .into_iter()
        .filter_map(|r| match r.binary() {
            Ok(p) => Some((r, p)),
            Err(why) => {
                skipped.push(format!("{}: {why}", r.name()));
                None
            }
        })
        .collect();
    assert!(!routers.is_empty(), "no router to run: {skipped:?}");
    let groups: Vec<Group> = routers
        .iter()
        .flat_map(|(r, _)| {
            [false, true].map(|stream| Group {
                router: *r,
                stub: false,
                stream,
            })
        })
        // SGLang <= 0.5.20's prefill behind smg 1.13.0 (the router that withdraws refused
        // non-streamed legs): its stubs are the breaches there.
        .chain(
            routers
                .iter()
                .any(|(r, _)| *r == RouterKind::Smg113)
                .then_some(Group {
                    router: RouterKind::Smg113,
                    stub: true,
                    stream: false,
                }),
        )
        .collect();
    let t0 = Instant::now();
    let _ = std::fs::remove_dir_all(&o.out);
    std::fs::create_dir_all(&o.out).unwrap();
    let here = o.out.canonicalize().unwrap();
    eprintln!(
        "sglang_precision_recall: revenant {}, pd-sim {}; {} requests at {}/s ({} over capacity), routers {:?}, decode waiting timeout {} s; files in {}",
        bins.revenant.display(),
        bins.pd_sim.display(),
        o.requests,
        o.rate,
        o.over_capacity_share,
        routers.iter().map(|(r, _)| r.name()).collect::<Vec<_>>(),
        o.waiting_timeout_s,
        here.display()
    );

    // revenant first: its eBPF witness follows each worker's processes from their fork.
    let mut revenants: Vec<(Witness, Revenant)> = Witness::ALL
        .iter()
        .map(|&w| {
            (
                w,
                start_revenant(&bins.revenant, &here.join(w.name()), &here, w),
            )
        })
        .collect();
    let model = here.join("model");
    write_model_dir(&python, &model).unwrap();
    let forwards: Vec<String> = revenants
        .iter()
        .filter(|(w, _)| w.otlp())
        .map(|(_, r)| format!("http://{}/v1/traces", r.otlp_http))
        .collect();
    let forward_refs: Vec<&str> = forwards.iter().map(String::as_str).collect();
    let sink = OtlpSink::start_forwarding_to(&python, &here, &forward_refs).unwrap();
    let traced = |mut w: WorkerOptions| {
        w.otlp_http = Some(sink.endpoint.clone());
        w
    };
    let mut decode = WorkerOptions::new(Role::Decode, "127.0.0.3", DECODE_CONTEXT, DECODE_KV_PAGES);
    decode.waiting_timeout_s = Some(o.waiting_timeout_s);
    decode.extra = vec!["--metadata-slots".into(), DECODE_METADATA_SLOTS.to_string()];
    let started = Instant::now();
    let prefill = |host: &str, intake: &'static str| {
        let mut w = WorkerOptions::new(Role::Prefill, host, PREFILL_CONTEXT, PREFILL_KV_PAGES);
        w.intake_reject = intake;
        traced(w)
    };
    let stub = groups.iter().any(|g| g.stub);
    let mut opts = vec![prefill("127.0.0.2", "fixed"), traced(decode)];
    if stub {
        opts.push(prefill("127.0.0.4", "stub"));
    }
    let mut workers = start_workers(&python, &opts, &model, &here, Duration::from_secs(300))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let prefill_stub: Option<SglangWorker> = stub.then(|| workers.pop().unwrap());
    let decode_w: SglangWorker = workers.pop().unwrap();
    let prefill_w: SglangWorker = workers.pop().unwrap();
    eprintln!("workers ready in {:.0} s", started.elapsed().as_secs_f64());
    // One router per group but the streamed one (it shares its router with the non-streamed).
    let smgs: Vec<((RouterKind, bool), Smg)> = groups
        .iter()
        .filter(|g| !g.stream)
        .map(|g| {
            let bin = &routers.iter().find(|(r, _)| *r == g.router).unwrap().1;
            let extra = g.router.extra(&sink.grpc);
            let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
            let behind = if g.stub {
                prefill_stub.as_ref().unwrap()
            } else {
                &prefill_w
            };
            let name = format!("{}{}", g.router.name(), if g.stub { "-stub" } else { "" });
            let smg = Smg::start(
                bin,
                behind,
                &decode_w,
                &model,
                &here.join(format!("{name}.log")),
                &extra,
            )
            .unwrap_or_else(|e| panic!("{name}: {e:#}"));
            ((g.router, g.stub), smg)
        })
        .collect();

    // The load: one open-loop generator per router and streamed/non-streamed, at once.
    let per_group = o.requests / groups.len() as u64;
    let rate = o.rate / groups.len() as f64;
    let load_started = Instant::now();
    let handles: Vec<_> = groups
        .iter()
        .enumerate()
        .map(|(i, &g)| {
            let url = smgs
                .iter()
                .find(|(k, _)| *k == (g.router, g.stub))
                .map(|(_, s)| s.url.clone())
                .unwrap();
            let pd_sim = bins.pd_sim.clone();
            let results = here.join(format!("load-{}.jsonl", g.prefix()));
            let summary = here.join(format!("load-{}.json", g.prefix()));
            let args: Vec<String> = vec![
                "--api".into(),
                "mixed".into(),
                "--chat-share".into(),
                "0.33".into(),
                "--model".into(),
                model.display().to_string(),
                "--requests".into(),
                per_group.to_string(),
                "--rate".into(),
                rate.to_string(),
                "--prompt-len".into(),
                PROMPT_LEN.into(),
                "--over-capacity-share".into(),
                o.over_capacity_share.to_string(),
                "--over-capacity-len".into(),
                OVER_CAPACITY_LEN.into(),
                "--max-new-tokens".into(),
                "4".into(),
                "--stream-share".into(),
                if g.stream { "1" } else { "0" }.into(),
                "--seed".into(),
                (o.seed + i as u64).to_string(),
                "--request-id-prefix".into(),
                g.prefix(),
                "--results-jsonl".into(),
                results.display().to_string(),
                // Behind sglang-router 0.3.2 every retry of a refused request waits for
                // decode's waiting timeout.
                "--timeout-secs".into(),
                "300".into(),
            ];
            std::thread::spawn(move || {
                test_harness::run_load(
                    &pd_sim,
                    &url,
                    &args,
                    &summary,
                    true,
                    Duration::from_secs(900),
                    None,
                )
                .unwrap_or_else(|e| panic!("{}: load: {e:#}", g.prefix()))
                .expect("not interrupted");
                (g, test_harness::read_jsonl(&results).unwrap())
            })
        })
        .collect();
    let load: BTreeMap<Group, Vec<Value>> =
        handles.into_iter().map(|h| h.join().unwrap()).collect();
    eprintln!("load done in {:.0} s", load_started.elapsed().as_secs_f64());

    // Every leg over: each refused attempt's decode leg ended (at the latest its waiting
    // timeout after it arrived).
    let settle = Duration::from_secs(o.waiting_timeout_s as u64 + 60);
    let deadline = Instant::now() + settle;
    // Both prefills' records (rooms are the routers' own, never shared).
    let prefill_truth = || {
        let mut v = prefill_w.truth();
        v.extend(prefill_stub.iter().flat_map(SglangWorker::truth));
        v
    };
    let mut t = truth(&prefill_truth(), &decode_w.truth());
    loop {
        let open = t
            .attempts
            .values()
            .filter(|a| {
                (a.d_received_ns > 0 && a.d_end_ns == 0) || (a.p_received && a.p_answered_ns == 0)
            })
            .count();
        if open == 0 {
            break;
        }
        if Instant::now() > deadline {
            eprintln!("{open} attempts still open after {settle:?}");
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
        t = truth(&prefill_truth(), &decode_w.truth());
    }
    // Every deadline judged: orphaned-leg's window after the last refusal, and the last leg's
    // end, behind each revenant's watermark (its clock minus the allowed lateness), then quiet.
    let last = t
        .attempts
        .values()
        .map(|a| {
            let refusal = if a.refused() {
                a.p_answered_ns + ORPHANED_LEG_WINDOW.as_nanos() as u64
            } else {
                0
            };
            refusal.max(a.d_end_ns)
        })
        .max()
        .unwrap_or(0);
    let target = last as f64 / 1e9 + (SKEW + TICK).as_secs_f64();
    let wait = Instant::now()
        + LATENESS
        + Duration::from_secs(60)
        + Duration::from_secs_f64((target - now_s()).max(0.0));
    for (w, rev) in &revenants {
        loop {
            let m = rev.metrics().unwrap();
            if metric_sum(&m, "revenant_checker_watermark_timestamp_seconds", &[]) >= target {
                break;
            }
            assert!(
                Instant::now() < wait,
                "{}: watermark never passed {target}",
                w.name()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }
    let mut verdicts: BTreeMap<Witness, Verdicts> = BTreeMap::new();
    for (w, rev) in &mut revenants {
        let metrics = rev
            .wait_quiet(Duration::from_secs(3), Duration::from_secs(120), None)
            .unwrap_or_else(|e| panic!("{}: {e:#}\n{}", w.name(), rev.log_tail(30)));
        let (status, vj) = rev
            .admin_json("/api/violations?limit=1000000")
            .unwrap_or_else(|e| panic!("{}: /api/violations: {e:#}", w.name()));
        assert_eq!(status, 200, "{vj}");
        let violations = vj["violations"].as_array().cloned().unwrap_or_default();
        let stopped = rev.stop().unwrap_or_else(|e| panic!("{}: {e:#}", w.name()));
        assert!(stopped.success(), "{}: {}", w.name(), rev.log_tail(30));
        std::fs::write(
            rev.dir.join("violations.json"),
            serde_json::to_string_pretty(&violations).unwrap(),
        )
        .unwrap();
        verdicts.insert(
            *w,
            Verdicts {
                violations,
                alerts: read_jsonl_so_far(&rev.alerts),
                metrics,
            },
        );
    }
    let t = truth(&prefill_truth(), &decode_w.truth());
    let spans = sink.spans().len();
    drop(smgs);
    drop(prefill_w);
    drop(prefill_stub);
    drop(decode_w);
    drop(sink);
    drop(revenants);
    let wall = t0.elapsed().as_secs_f64();

    let mut results = Vec::new();
    let mut notes = Vec::new();
    for w in Witness::ALL {
        let (rows, n) = score(w, &groups, &t, &load, &verdicts[&w]);
        results.extend(rows);
        notes.extend(n);
    }
    results.sort_by_key(|r| (r.group, r.witness));
    println!();
    println!(
        "| router | prefill | answers | witness | requests | refused attempts | breaches expected | caught | false alerts | notifications / breached requests | recall | precision |"
    );
    println!("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in &results {
        println!("{}", table_line(r));
    }
    println!();
    let clean = results.iter().all(|r| r.clean);
    for r in &results {
        println!(
            "{} / {} / {} / {}{}",
            r.group.router.name(),
            r.group.prefill(),
            r.group.answers(),
            r.witness.name(),
            if r.clean { "" } else { "  ← not clean" }
        );
        for n in &r.notes {
            println!("  {n}");
        }
    }
    for n in &notes {
        println!("{n}");
    }
    println!(
        "{} attempts, {spans} spans exported; wall {wall:.0} s",
        t.attempts.len()
    );
    for s in &skipped {
        println!("skipped {s}");
    }
    if clean && !o.keep {
        let _ = std::fs::remove_dir_all(&o.out);
    } else {
        println!("files kept in {}", here.display());
    }
}
