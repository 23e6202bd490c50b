use std::ffi::OsStr;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;

use crate::files::{ScratchDir, tail};
use crate::http::{http_json, wait_healthy};
use crate::proc::Proc;

/// A running `pd-sim cluster --ephemeral`; dropping it stops every process of it.
pub struct Cluster {
    pub proc: Proc,
    /// The READY object (router/prefill/decode URLs, bootstrap and KV ports, pids).
    pub ready: Value,
    /// Base URLs; `router` is empty with `--no-router`.
    pub router: String,
    pub prefill: String,
    pub decode: String,
    /// (role, pid) of router, prefill, decode.
    pub pids: Vec<(String, u32)>,
}

impl Cluster {
    /// `pd-sim cluster --ephemeral {args}` (e.g. `["--mode", "handoff-after-reject",
    /// "--otlp-endpoint", url]`), stderr to `log` (else to ours); returns once the READY line
    /// came and every process answers `/health`. The children log at `warn` unless `PD_SIM_LOG`
    /// is set.
    pub fn start<S: AsRef<OsStr>>(bin: &Path, args: &[S], log: Option<&Path>) -> Result<Cluster> {
        let mut cmd = Command::new(bin);
        cmd.args(["cluster", "--ephemeral"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(match log {
                Some(l) => File::create(l)?.into(),
                None => Stdio::inherit(),
            });
        if std::env::var_os("PD_SIM_LOG").is_none() {
            cmd.env("PD_SIM_LOG", "warn");
        }
        let mut proc = Proc::spawn("pd-sim cluster", &mut cmd)?;
        let stdout = proc.child_mut().stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        // Keeps draining stdout after READY, so the cluster never blocks on a full pipe.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if let Some(j) = line.trim().strip_prefix("READY ") {
                    let _ = tx.send(j.to_string());
                }
            }
        });
        let line = rx.recv_timeout(Duration::from_secs(60)).map_err(|_| {
            anyhow!(
                "pd-sim cluster printed no READY line within 60s{}",
                log.map(|l| format!("; its log:\n{}", tail(l, 20)))
                    .unwrap_or_default()
            )
        })?;
        let ready: Value = serde_json::from_str(&line).context("pd-sim READY line")?;
        let s = |k: &str| ready[k].as_str().unwrap_or("").to_string();
        let pids = ["router", "prefill", "decode"]
            .iter()
            .filter_map(|k| ready["pids"][k].as_u64().map(|p| (k.to_string(), p as u32)))
            .collect();
        let c = Cluster {
            router: s("router"),
            prefill: s("prefill"),
            decode: s("decode"),
            pids,
            ready,
            proc,
        };
        for url in [&c.router, &c.prefill, &c.decode] {
            if !url.is_empty() {
                wait_healthy(url, Duration::from_secs(30))?;
            }
        }
        Ok(c)
    }

    /// `--pid ROLE=PID` arguments for `revenant run`.
    pub fn pid_args(&self) -> Vec<String> {
        self.pids
            .iter()
            .flat_map(|(role, pid)| ["--pid".to_string(), format!("{role}={pid}")])
            .collect()
    }

    /// The prefill's per-room records (`/sim/rooms`).
    pub fn prefill_rooms(&self) -> Result<Vec<Value>> {
        sim_rooms(&self.prefill)
    }

    /// The decode's per-room records (`/sim/rooms`).
    pub fn decode_rooms(&self) -> Result<Vec<Value>> {
        sim_rooms(&self.decode)
    }
}

fn sim_rooms(worker: &str) -> Result<Vec<Value>> {
    match http_json(&format!("{worker}/sim/rooms"))? {
        Value::Array(a) => Ok(a),
        other => bail!("{worker}/sim/rooms: not an array: {other}"),
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let grace = self.proc.grace;
        self.proc.stop(libc::SIGTERM, grace);
        // The cluster's children run in process groups of their own (so that a terminal Ctrl-C
        // reaches only the cluster): one the cluster could not stop gets SIGKILL here.
        for (_, pid) in &self.pids {
            // SAFETY: signal 0 probes; a stray child gets SIGKILL.
            unsafe {
                if libc::kill(*pid as i32, 0) == 0 {
                    libc::kill(*pid as i32, libc::SIGKILL);
                }
            }
        }
    }
}

/// `pd-sim load --router URL {args} --summary-json PATH` to completion, at most `timeout`;
/// `Ok(None)` if interrupted (the load generator is stopped). Progress goes to our stderr
/// unless `quiet`.
pub fn run_load<S: AsRef<OsStr>>(
    bin: &Path,
    router: &str,
    args: &[S],
    summary: &Path,
    quiet: bool,
    timeout: Duration,
    interrupted: Option<&AtomicBool>,
) -> Result<Option<Value>> {
    let mut cmd = Command::new(bin);
    cmd.args(["load", "--router", router, "--summary-json"])
        .arg(summary)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    if quiet {
        cmd.arg("--quiet").stderr(Stdio::null());
    }
    let mut p = Proc::spawn("pd-sim load", &mut cmd)?;
    let Some(status) = p.wait_until(timeout, interrupted)? else {
        p.stop(libc::SIGINT, Duration::from_secs(2));
        return Ok(None);
    };
    if !status.success() {
        bail!("pd-sim load failed ({status})");
    }
    let text = std::fs::read_to_string(summary).context("load summary")?;
    Ok(Some(
        serde_json::from_str(&text).context("load summary JSON")?,
    ))
}

/// [`run_load`] as tests and benches use it: quiet, its summary in a scratch file, at most
/// `timeout`.
pub fn run_load_quiet<S: AsRef<OsStr>>(
    bin: &Path,
    router: &str,
    args: &[S],
    timeout: Duration,
) -> Result<Value> {
    let scratch = ScratchDir::new("load")?;
    let summary = scratch.path().join("summary.json");
    run_load(bin, router, args, &summary, true, timeout, None)?
        .ok_or_else(|| anyhow!("pd-sim load interrupted"))
}

/// The faults `pd-sim` injects (`--fault NAME`) and how long after a hit room's leg arrived
/// revenant's default rule for it can have a verdict: the rule's grace or window
/// (`unknown-room` 5 s; `stranded-kv` and `held-decode-slot` 330 s, SGLang's 300 s timeouts and
/// 30 s, so a run that holds for less patches them, docs/advancement.md "Windows";
/// `room-collision`, `success-after-abort`, `foreign-route-put` and `stub-intake`
/// (`advanced-before-rejection`), judged on their events alone, none).
pub const FAULT_VERDICT_WINDOWS: [(&str, Duration); 6] = [
    ("room-collision", Duration::ZERO),
    ("unknown-room", Duration::from_secs(5)),
    ("success-after-abort", Duration::ZERO),
    ("stranded-kv", Duration::from_secs(330)),
    ("foreign-route-put", Duration::ZERO),
    ("stub-intake", Duration::ZERO),
];

/// The verdict window of the fault `name` (see [`FAULT_VERDICT_WINDOWS`]); `None` for a name
/// pd-sim does not know.
pub fn fault_verdict_window(name: &str) -> Option<Duration> {
    FAULT_VERDICT_WINDOWS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, w)| *w)
}
