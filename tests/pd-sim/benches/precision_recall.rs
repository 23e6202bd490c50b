//! Precision and recall of revenant, end to end: for each router × decode behaviour × witness
//! (× streamed or not, for the real smg routers), a real cluster on loopback (pd-sim's prefill
//! and decode speaking SGLang 0.5.23's Mooncake PD protocol, its router or a real `smg` in
//! front), a real `revenant run` (release build) watching it, open-loop load from `pd-sim load`
//! with a share of over-capacity prompts that prefill refuses. The oracle is the simulator's own
//! per-room records (`/sim/rooms` of prefill and decode), never revenant's output.
//! (A `harness = false` bench binary: its rows and options here; the row runner and the oracle,
//! shared with the soak bench, in `support/mod.rs`.)
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
//! - `--over-capacity-share F`: prompts over prefill's capacity (refused 400; streamed: a 200
//!   whose stream carries the error). `--overload-share F`: prefill refuses that share with 503
//!   ("queue full"), which every router retries on a new room under the same x-request-id
//!   (several attempts, one request, one notification).
//! - `--rows FILTER`: comma-separated `ROUTER[/DECODE[/WITNESS[/ANSWERS]]]`, each part a name
//!   or `*` (e.g. `concurrent-cancel/ignores`, `*/*/ebpf`, `smg-1.13.0/*/*/streamed`).
//!   Routers: `correct`, `concurrent-cancel`, `concurrent-no-cancel`, `handoff-after-reject`
//!   (pd-sim's router modes), `sglang-router-0.3.2` (`PD_SIM_SMG`), `smg-1.13.0`
//!   (`PD_SIM_SMG113`); vLLM: `vllm-correct`, `vllm-handoff-after-reject` (pd-sim's
//!   `--flavour vllm` router modes) and `vllm-router-0.1.17` (`PD_SIM_VLLM_ROUTER_PYTHON`, the
//!   python of its venv; started through `tests/e2e/scripts/vllm_router_traced.py`, traced
//!   when the witness has OTLP): the real routers run in front of `pd-sim cluster --no-router`
//!   and are skipped, with the reason printed, when their variable is unset. Decode: `honours` (the
//!   router's cancel) or `ignores` (`--decode-ignores-cancel`; only for the routers that withdraw
//!   legs: `concurrent-cancel`, `smg-1.13.0` non-streamed). Witness: `ebpf` (`--ebpf on`, the
//!   three pids, no spans), `otlp` (`--ebpf off`, the workers' spans from `--otlp-endpoint`, a
//!   real router's from `--enable-trace`), `both`. Answers: `non-streamed`, or `streamed`
//!   (`pd-sim load --stream-share 1`; the two real smg routers only). Needs root for the eBPF
//!   rows.
//! - `--out DIR` (default `target/precision_recall`): one directory per row (revenant's
//!   `--events-jsonl` file, alerts JSONL, its log, the simulator's log and rooms, the violations);
//!   kept for rows that miss, false-alert or notify other than once per breached request, removed
//!   otherwise unless `--keep`.
//!
//! Decode waits [`support::DECODE_WAITING_TIMEOUT`] (10 s) for KV that never comes
//! (`--disaggregation-waiting-timeout-ms`; SGLang's and pd-sim's default is 300 s), so a leg it
//! keeps for a refused attempt ends in reasonable time, well past `orphaned-leg`'s 6 s.
//!
//! Oracle (docs/advancement.md), from the simulator's records: an attempt prefill refused
//! (status 4xx or 503, or a 200 whose stream carried such an error: `error_code`) whose decode
//! leg reached decode (the room is in decode's `/sim/rooms` with a `received_ns`; for vLLM the
//! request name in decode's `/sim/requests`) is a breach when decode advanced it (KV landed in
//! its pages, tokens generated) or kept its leg past `orphaned-leg`'s window after the refusal
//! (decode's `ended_ns` more than 6 s after prefill's `answered_ns`, or never). As a
//! cross-check the row's router says what to expect (a note when the two differ): none behind
//! `correct`, `concurrent-cancel`, `smg-1.13.0` (non-streamed), `vllm-correct` or
//! `vllm-router-0.1.17` with a decode that honours the cancel; behind `concurrent-no-cancel`,
//! `sglang-router-0.3.2`, `handoff-after-reject`, `vllm-handoff-after-reject`, `smg-1.13.0`
//! streamed (smg reads a streamed refusal's 200 as success and keeps decode's leg), and with
//! any decode that ignores the cancel, every refused attempt that reached decode. A vLLM request
//! is one attempt, named `cmpl-`/`chatcmpl-` + the router's `X-Request-Id`.
//!
//! Isolation rows (`correct+fault:NAME`, each witness): the correct router in front of workers
//! that inject one breach (`--fault NAME --fault-rate 0.05`, `--fault-hold-ms 40000`): the
//! breaches are the rooms the simulator records as injected (`injected-NAME` in prefill's or
//! decode's `/sim/rooms`), each its own request when it has none (an injected unknown room).
//! `stranded-kv`'s row gives revenant a rules file patching `stranded-kv` and
//! `held-decode-slot` to 30 s ([`support::STRANDED_RULES`]: the defaults wait SGLang's 300 s
//! timeouts and 30 s). `concurrent-cancel+fault:stub-intake` is SGLang <= 0.5.20's intake
//! (`--fault stub-intake --fault-rate 0.2` of the refused requests: their one-token stub's KV
//! lands at decode, which answers, before prefill's 400), behind the router that sends both legs
//! at once. A witness that cannot see a fault (OTLP an unknown room, either witness alone a
//! success after an abort; OTLP sees a held leg only because the 40 s hold ends within the
//! allowed lateness after the 30 s window) shows its recall as "cannot see" and is judged on its
//! silence. Their rows wait for the fault's rule window (up to 30 s) past the last leg.
//!
//! Columns: requests sent; rejected attempts (prefill rooms refused, as above); breaches
//! expected; caught (breaches with at least one violation in `/api/violations`); false alerts
//! (first proofs, corroborations left out, about an attempt that is not a breach, or naming no
//! attempt of a breached request); notifications (incident notifications in the alerts JSONL)
//! against the breached requests (one each expected); recall; precision (attempts: caught over
//! caught plus falsely alerted); the row's wall time (cluster start to teardown).
//!
//! Before reading `/api/violations` a row waits until every room left `pending` and then until
//! revenant can have judged the last rejection's deadline rules: `orphaned-leg`'s window (6 s),
//! the clock skew (50 ms), `revenant run`'s allowed lateness (15 s) and its 1 s tick after the
//! last prefill rejection; so a row takes about 22 s more than its load. The lateness is
//! `run`'s default on purpose: a lateness below the OTLP profile's completion grace (5 s) makes
//! an OTLP-reported decode leg that ended in time count as open (README, orphaned-leg).
//!
//! revenant runs with the defaults except `--rate-limit 0` (every incident reaches the file),
//! `--recent-violations 1000000` (the whole run in `/api/violations`), `--spool-no-fsync` and,
//! with eBPF, `--no-sglang-conventions` (only this row's pids are watched).

use std::path::{Path, PathBuf};
use std::time::Duration;

use pd_sim::fault::Fault;
use pd_sim::smg::smg_version;

#[path = "support/mod.rs"]
mod support;
use support::{
    Router, Row, RowResult, RowSetup, Witness, await_judgement, finish_row, judge, start_row,
};

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
    let witnesses = [Witness::Ebpf, Witness::Otlp, Witness::Both];
    let mut rows = Vec::new();
    for router in routers {
        // The real smg routers also with every request streamed (a streamed refusal is a 200
        // whose stream carries the error); the simulator's routers and vLLM's as before.
        let streams: &[bool] = if matches!(router, Router::Smg032 | Router::Smg113) {
            &[false, true]
        } else {
            &[false]
        };
        for &stream in streams {
            for ignores_cancel in [false, true] {
                if ignores_cancel && !router.withdraws(stream) {
                    continue;
                }
                for witness in witnesses {
                    rows.push(Row {
                        router,
                        ignores_cancel,
                        witness,
                        stream,
                        fault: None,
                    });
                }
            }
        }
    }
    // The isolation invariants: the correct router, each breach injected by the simulator.
    for fault in [
        Fault::RoomCollision,
        Fault::UnknownRoom,
        Fault::SuccessAfterAbort,
        Fault::StrandedKv,
        Fault::ForeignRoutePut,
    ] {
        for witness in witnesses {
            rows.push(Row {
                router: Router::Sim("correct"),
                ignores_cancel: false,
                witness,
                stream: false,
                fault: Some(fault),
            });
        }
    }
    // SGLang <= 0.5.20's stub at intake: its refusal is answered only after decode's
    // destinations, so it needs a router that sends both legs at once (smg 1.13.0's model).
    for witness in witnesses {
        rows.push(Row {
            router: Router::Sim("concurrent-cancel"),
            ignores_cancel: false,
            witness,
            stream: false,
            fault: Some(Fault::StubIntake),
        });
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

fn run_row(
    o: &Opts,
    row: Row,
    real: Option<&Path>,
    revenant_bin: &Path,
    pd_sim: &Path,
) -> RowResult {
    let vllm = row.router.vllm();
    let dir = o.out.join(row.name().replace('/', "-"));
    let mut prefill_args = Vec::new();
    if o.overload_share > 0.0 {
        prefill_args.extend(["--overload-share".to_string(), o.overload_share.to_string()]);
    }
    let setup = RowSetup {
        prefill_args,
        decode_args: Vec::new(),
        revenant_args: [
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
        .to_vec(),
        events_jsonl: true,
    };
    let run = start_row(row, real, revenant_bin, pd_sim, dir.clone(), &setup);
    let router_url = &run.router_url;
    let load = test_harness::run_load(
        pd_sim,
        router_url,
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
            "--stream-share".into(),
            if row.stream { "1" } else { "0" }.into(),
            // Behind sglang-router 0.3.2 a refused request waits for decode's timeout
            // (DECODE_WAITING_TIMEOUT) on every attempt it retries.
            "--timeout-secs".into(),
            "180".into(),
        ],
        &dir.join("load.json"),
        true,
        Duration::from_secs(600),
        None,
    )
    .unwrap_or_else(|e| panic!("{}: load: {e:#}", row.name()))
    .expect("not interrupted");
    let mut notes = Vec::new();
    let metrics = await_judgement(&run, &mut notes);
    let rev = &run.rev;
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
    let finished = finish_row(run);
    judge(&finished, &violations, &metrics, &load, notes, o.keep)
}

fn pct(num: usize, den: usize) -> String {
    if den == 0 {
        "–".into()
    } else {
        format!("{:.1} %", num as f64 * 100.0 / den as f64)
    }
}

fn table_line(r: &RowResult) -> String {
    let [router, decode, witness, answers] = r.row.parts();
    format!(
        "| {router} | {answers} | {decode} | {witness} | {} | {} | {} | {} | {} | {} / {} | {} | {} | {:.0} s |",
        r.requests,
        r.rejected,
        r.expected,
        r.caught,
        r.false_alerts,
        r.notifications,
        r.breached_requests,
        if r.row.visible() {
            pct(r.caught, r.expected)
        } else {
            format!("– (cannot see; {})", pct(r.caught, r.expected))
        },
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
        "| router | answers | decode | witness | requests | rejected attempts | breaches expected | caught | false alerts | notifications / breached requests | recall | precision | wall |"
    );
    println!(
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
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
