//! Real processes on loopback, shared by `cargo xtask demo` and the end-to-end tests: the
//! `revenant` and `pd-sim` binaries, each child in its own process group (killed as a group on
//! drop, `PR_SET_PDEATHSIG` if we die first), readiness from the processes themselves (revenant's
//! ready file, pd-sim's READY line and `/health`), never sleeps, every wait bounded.
//!
//! Std only on purpose (plus serde_json and libc): xtask links this, and `cargo xtask` must stay
//! quick to build.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;

/// Where the binaries are: `REVENANT_BIN` / `PD_SIM_BIN` (set by `cargo xtask test`), or built
/// now with cargo (release: the runs push thousands of requests through them).
#[derive(Debug, Clone)]
pub struct Binaries {
    pub revenant: PathBuf,
    pub pd_sim: PathBuf,
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

impl Binaries {
    /// From the environment, if both variables are set; a set variable naming a missing file is
    /// an error, not a fallback.
    pub fn from_env() -> Result<Option<Binaries>> {
        match (
            std::env::var_os("REVENANT_BIN"),
            std::env::var_os("PD_SIM_BIN"),
        ) {
            (Some(r), Some(p)) => {
                let b = Binaries {
                    revenant: r.into(),
                    pd_sim: p.into(),
                };
                for f in [&b.revenant, &b.pd_sim] {
                    if !f.is_file() {
                        bail!(
                            "{} (from REVENANT_BIN/PD_SIM_BIN) does not exist",
                            f.display()
                        );
                    }
                }
                Ok(Some(b))
            }
            (None, None) => Ok(None),
            _ => bail!("set both REVENANT_BIN and PD_SIM_BIN, or neither"),
        }
    }

    /// `cargo build [--release] -p revenant -p pd-sim --bins`, paths taken from cargo's own
    /// artifact messages (so a custom CARGO_TARGET_DIR is honoured).
    pub fn build(release: bool) -> Result<Binaries> {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(&cargo);
        cmd.current_dir(workspace_root())
            .args(["build", "-p", "revenant", "-p", "pd-sim", "--bins"])
            .args(["--message-format", "json-render-diagnostics"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if release {
            cmd.arg("--release");
        }
        let out = cmd
            .output()
            .with_context(|| format!("running {cargo} build"))?;
        if !out.status.success() {
            bail!("cargo build -p revenant -p pd-sim failed ({})", out.status);
        }
        let (mut revenant, mut pd_sim) = (None, None);
        for line in out.stdout.split(|b| *b == b'\n') {
            let Ok(v) = serde_json::from_slice::<Value>(line) else {
                continue;
            };
            if v["reason"] != "compiler-artifact" {
                continue;
            }
            let Some(exe) = v["executable"].as_str() else {
                continue;
            };
            match v["target"]["name"].as_str() {
                Some("revenant") => revenant = Some(PathBuf::from(exe)),
                Some("pd-sim") => pd_sim = Some(PathBuf::from(exe)),
                _ => {}
            }
        }
        Ok(Binaries {
            revenant: revenant.ok_or_else(|| anyhow!("cargo built no revenant binary"))?,
            pd_sim: pd_sim.ok_or_else(|| anyhow!("cargo built no pd-sim binary"))?,
        })
    }

    /// The environment's binaries, else a release build.
    pub fn locate() -> Result<Binaries> {
        match Binaries::from_env()? {
            Some(b) => Ok(b),
            None => Binaries::build(true),
        }
    }
}

/// A child in its own process group. Dropping it stops the whole group: SIGTERM, then SIGKILL
/// after the grace period.
pub struct Proc {
    pub name: String,
    child: Child,
    status: Option<ExitStatus>,
    /// Grace between SIGTERM and SIGKILL on drop.
    pub grace: Duration,
}

impl Proc {
    pub fn spawn(name: &str, cmd: &mut Command) -> Result<Proc> {
        use std::os::unix::process::CommandExt;
        cmd.process_group(0);
        // SAFETY: prctl only, in the forked child before exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {name} ({cmd:?})"))?;
        Ok(Proc {
            name: name.into(),
            child,
            status: None,
            grace: Duration::from_secs(10),
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn child_mut(&mut self) -> &mut Child {
        &mut self.child
    }

    /// The exit status if it has exited (reaped once, remembered).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }

    fn signal_group(&self, sig: i32) {
        // SAFETY: kill(2) on the process group we created (pgid = the child's pid).
        unsafe {
            libc::kill(-(self.child.id() as i32), sig);
        }
    }

    /// Sends `sig` to the group and waits up to `grace` for the leader; then SIGKILLs the group
    /// (strays included) and reaps the leader.
    pub fn stop(&mut self, sig: i32, grace: Duration) -> Option<ExitStatus> {
        if self.exited().is_none() {
            self.signal_group(sig);
            let deadline = Instant::now() + grace;
            while self.exited().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        self.signal_group(libc::SIGKILL);
        if self.status.is_none() {
            self.status = self.child.wait().ok();
        }
        self.status
    }

    /// Waits for the child to exit by itself; `Ok(None)` if `interrupted` was raised first.
    pub fn wait_until(
        &mut self,
        timeout: Duration,
        interrupted: Option<&AtomicBool>,
    ) -> Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.exited() {
                return Ok(Some(s));
            }
            if interrupted.is_some_and(|f| f.load(Ordering::Relaxed)) {
                return Ok(None);
            }
            if Instant::now() > deadline {
                bail!("{} still running after {timeout:?}", self.name);
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let grace = self.grace;
        self.stop(libc::SIGTERM, grace);
    }
}

/// Minimal blocking HTTP/1.1 GET on loopback: status and body.
pub fn http_get(url: &str) -> Result<(u16, String)> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| anyhow!("not an http URL: {url}"))?;
    let (host, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let mut s = TcpStream::connect(host).with_context(|| format!("GET {url}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow!("GET {url}: no header end"))?;
    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("GET {url}: bad status line"))?;
    let mut body = buf[end + 4..].to_vec();
    if head.contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(i) = b.windows(2).position(|w| w == b"\r\n") {
        let n = usize::from_str_radix(String::from_utf8_lossy(&b[..i]).trim(), 16).unwrap_or(0);
        if n == 0 || b.len() < i + 2 + n {
            break;
        }
        out.extend_from_slice(&b[i + 2..i + 2 + n]);
        b = &b[(i + 4 + n).min(b.len())..];
    }
    out
}

pub fn http_json(url: &str) -> Result<Value> {
    let (status, body) = http_get(url)?;
    if status != 200 {
        bail!(
            "GET {url}: {status}: {}",
            body.chars().take(200).collect::<String>()
        );
    }
    serde_json::from_str(&body).with_context(|| format!("GET {url}: not JSON"))
}

/// An ephemeral loopback port, free when asked (another process may take it before we bind it:
/// only for addresses that must be known before the listener exists).
pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// One Prometheus/OpenMetrics sample.
#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Parses the text exposition format (enough of it for revenant's own /metrics).
pub fn parse_metrics(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let (series, value) = match line.rsplit_once(' ') {
            Some(x) => x,
            None => continue,
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        let (name, labels) = match series.split_once('{') {
            Some((n, rest)) => (n, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        let mut map = BTreeMap::new();
        for kv in split_labels(labels) {
            if let Some((k, v)) = kv.split_once('=') {
                map.insert(k.to_string(), v.trim_matches('"').to_string());
            }
        }
        out.push(Sample {
            name: name.to_string(),
            labels: map,
            value,
        });
    }
    out
}

fn split_labels(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut start, mut quoted) = (0, false);
    for (i, c) in s.char_indices() {
        match c {
            '"' => quoted = !quoted,
            ',' if !quoted => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if start < s.len() {
        parts.push(&s[start..]);
    }
    parts
}

/// Sum of `name`'s samples whose labels include every `(key, value)` of `filter`.
pub fn metric_sum(samples: &[Sample], name: &str, filter: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            filter
                .iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
        // Not `.sum()`: an empty f64 sum is -0.0.
        .fold(0.0, |a, b| a + b)
}

/// A running `revenant run`.
pub struct Revenant {
    pub proc: Proc,
    /// The ready file's object: `admin`, `otlp_grpc`, `otlp_http`, `ebpf`.
    pub ready: Value,
    pub alerts: PathBuf,
    pub log: PathBuf,
}

impl Revenant {
    /// `revenant run {args} --ready-file DIR/ready.json --alerts-jsonl DIR/alerts.jsonl
    /// --spool-dir DIR/spool`, stderr to DIR/revenant.log; returns once the ready file exists.
    pub fn start(bin: &Path, dir: &Path, args: &[String]) -> Result<Revenant> {
        let ready = dir.join("revenant-ready.json");
        let alerts = dir.join("alerts.jsonl");
        let log = dir.join("revenant.log");
        let _ = std::fs::remove_file(&ready);
        let mut cmd = Command::new(bin);
        cmd.arg("run")
            .args(args)
            .arg("--ready-file")
            .arg(&ready)
            .arg("--alerts-jsonl")
            .arg(&alerts)
            .arg("--spool-dir")
            .arg(dir.join("spool"))
            .arg("--spool-no-fsync")
            .stdin(Stdio::null())
            .stdout(File::create(dir.join("revenant.out"))?)
            .stderr(File::create(&log)?);
        let mut proc = Proc::spawn("revenant", &mut cmd)?;
        proc.grace = Duration::from_secs(20);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(text) = std::fs::read_to_string(&ready)
                && let Ok(v) = serde_json::from_str::<Value>(&text)
            {
                return Ok(Revenant {
                    proc,
                    ready: v,
                    alerts,
                    log,
                });
            }
            if let Some(s) = proc.exited() {
                bail!(
                    "revenant exited before it was ready ({s}); its log:\n{}",
                    tail(&log, 20)
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "revenant not ready within 60s; its log:\n{}",
                    tail(&log, 20)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn admin_url(&self) -> String {
        format!("http://{}", self.ready["admin"].as_str().unwrap_or(""))
    }

    pub fn metrics(&self) -> Result<Vec<Sample>> {
        let (status, text) = http_get(&format!("{}/metrics", self.admin_url()))?;
        if status != 200 {
            bail!("/metrics answered {status}");
        }
        Ok(parse_metrics(&text))
    }

    /// Waits until revenant has taken in everything the simulator sent: the ingest and checker
    /// counters stay unchanged for `quiet` (exporters batch every 200 ms, so a second is
    /// plenty), at most `timeout`. Returns the last samples.
    pub fn wait_quiet(
        &self,
        quiet: Duration,
        timeout: Duration,
        interrupted: Option<&AtomicBool>,
    ) -> Result<Vec<Sample>> {
        let key = |m: &[Sample]| {
            [
                "revenant_events_total",
                "revenant_otlp_spans_received_total",
                "revenant_checker_violations_total",
                "revenant_alerts_received_total",
                "revenant_alert_delivered_notifications_total",
            ]
            .map(|n| metric_sum(m, n, &[]) as u64)
        };
        let deadline = Instant::now() + timeout;
        let mut last = self.metrics()?;
        let mut since = Instant::now();
        loop {
            if interrupted.is_some_and(|f| f.load(Ordering::Relaxed)) {
                return Ok(last);
            }
            std::thread::sleep(Duration::from_millis(200));
            let now = self.metrics()?;
            if key(&now) != key(&last) {
                since = Instant::now();
            } else if since.elapsed() >= quiet {
                return Ok(now);
            }
            last = now;
            if Instant::now() > deadline {
                bail!("revenant still busy after {timeout:?}");
            }
        }
    }

    /// SIGTERM and wait for the drain (alerts held or queued are delivered to the JSONL file).
    pub fn stop(&mut self) -> Result<ExitStatus> {
        self.proc
            .stop(libc::SIGTERM, Duration::from_secs(30))
            .ok_or_else(|| anyhow!("revenant could not be reaped"))
    }

    /// Every notification in the JSON Lines file.
    pub fn notifications(&self) -> Result<Vec<Value>> {
        read_jsonl(&self.alerts)
    }
}

pub fn read_jsonl(path: &Path) -> Result<Vec<Value>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| path.display().to_string()),
    };
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).with_context(|| format!("{}: {l}", path.display())))
        .collect()
}

/// The last `n` lines of a log file (for error messages).
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A running `pd-sim cluster --ephemeral`.
pub struct Cluster {
    pub proc: Proc,
    pub ready: Value,
    pub router: String,
    pub prefill: String,
    pub decode: String,
    /// (role, pid) of router, prefill, decode.
    pub pids: Vec<(String, u32)>,
}

impl Cluster {
    /// `pd-sim cluster --ephemeral {args}`, stderr to `log`; returns once the READY line came
    /// and every process answers `/health`.
    pub fn start(bin: &Path, args: &[String], log: &Path) -> Result<Cluster> {
        let mut cmd = Command::new(bin);
        cmd.args(["cluster", "--ephemeral"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(File::create(log)?);
        if std::env::var_os("PD_SIM_LOG").is_none() {
            cmd.env("PD_SIM_LOG", "warn");
        }
        let mut proc = Proc::spawn("pd-sim cluster", &mut cmd)?;
        let stdout = proc.child_mut().stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
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
                "pd-sim cluster printed no READY line within 60s; its log:\n{}",
                tail(log, 20)
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
            wait_healthy(url, Duration::from_secs(30))?;
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
        match http_json(&format!("{}/sim/rooms", self.prefill))? {
            Value::Array(a) => Ok(a),
            other => bail!("/sim/rooms: not an array: {other}"),
        }
    }
}

pub fn wait_healthy(base: &str, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok((200, _)) = http_get(&format!("{base}/health")) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{base}/health not 200 within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `pd-sim load --router URL {args} --summary-json PATH` to completion; `Ok(None)` if
/// interrupted (the load generator is stopped). Progress goes to our stderr unless `quiet`.
pub fn run_load(
    bin: &Path,
    router: &str,
    args: &[String],
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

/// Follows a JSON Lines file as it grows, yielding complete lines only.
pub struct JsonlTail {
    path: PathBuf,
    pos: u64,
    partial: String,
}

impl JsonlTail {
    pub fn new(path: &Path) -> JsonlTail {
        JsonlTail {
            path: path.to_path_buf(),
            pos: 0,
            partial: String::new(),
        }
    }

    pub fn poll(&mut self) -> Vec<Value> {
        let Ok(mut f) = File::open(&self.path) else {
            return Vec::new();
        };
        if f.seek(SeekFrom::Start(self.pos)).is_err() {
            return Vec::new();
        }
        let mut buf = String::new();
        let n = f.read_to_string(&mut buf).unwrap_or(0);
        self.pos += n as u64;
        self.partial.push_str(&buf);
        let mut out = Vec::new();
        while let Some(i) = self.partial.find('\n') {
            let line: String = self.partial.drain(..=i).collect();
            if let Ok(v) = serde_json::from_str(line.trim()) {
                out.push(v);
            }
        }
        out
    }
}

/// The distinct sources in a notification's evidence, sorted ("ebpf", "otlp").
pub fn evidence_sources(n: &Value) -> Vec<String> {
    let mut s: Vec<String> = n["evidence"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|e| e["source"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    s.sort();
    s.dedup();
    s
}

/// One readable line for a notification: rule, request, attempt, stages, evidence sources.
pub fn one_liner(n: &Value) -> String {
    if n["type"] == "suppressed" {
        return format!(
            "[suppressed] {}: {} more violations over the rate limit of {} (sample: {})",
            n["rule"].as_str().unwrap_or("?"),
            n["suppressed"],
            n["limit"],
            n["fingerprints_sample"]
                .as_array()
                .map(|a| a
                    .iter()
                    .filter_map(|f| f.as_str())
                    .collect::<Vec<_>>()
                    .join(","))
                .unwrap_or_default()
        );
    }
    let request = n["request"]["request_id"]
        .as_str()
        .map(str::to_string)
        .or_else(|| {
            n["request"]["trace_id"]
                .as_str()
                .map(|t| format!("trace {}", &t[..t.len().min(16)]))
        })
        .unwrap_or_else(|| "-".into());
    let room = n["attempt"]["bootstrap_room"]
        .as_u64()
        .map(|r| format!(" room {r:#x}"))
        .unwrap_or_default();
    let stages: Vec<String> = n["evidence"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|e| {
                    let mut s = format!(
                        "{} {}",
                        e["stage"].as_str().unwrap_or("?"),
                        e["kind"].as_str().unwrap_or("?")
                    );
                    if let Some(st) = e["status"].as_u64() {
                        s.push_str(&format!(" {st}"));
                    }
                    s
                })
                .collect()
        })
        .unwrap_or_default();
    let mut line = format!(
        "[{}] {} request {}{}: {} (evidence: {})",
        n["severity"].as_str().unwrap_or("?"),
        n["rule"].as_str().unwrap_or("?"),
        request,
        room,
        stages.join(" -> "),
        evidence_sources(n).join("+"),
    );
    if n["occurrences"].as_u64().unwrap_or(1) > 1 {
        line.push_str(&format!(" x{}", n["occurrences"]));
    }
    line
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_metrics_with_quoted_commas() {
        let m = parse_metrics(
            "# HELP x\nrevenant_events_total{source=\"otlp\",stage=\"a,b\"} 3\nrevenant_ready 1\n",
        );
        assert_eq!(
            metric_sum(&m, "revenant_events_total", &[("stage", "a,b")]),
            3.0
        );
        assert_eq!(metric_sum(&m, "revenant_ready", &[]), 1.0);
    }

    #[test]
    fn one_liner_names_rule_request_stages_and_sources() {
        let n: Value = serde_json::json!({
            "type": "violation", "severity": "critical", "rule": "activity-after-rejection",
            "request": {"request_id": "load-7"}, "attempt": {"bootstrap_room": 255},
            "occurrences": 1,
            "evidence": [
                {"stage": "prefill", "kind": "rejected", "status": 400, "source": "otlp"},
                {"stage": "transfer", "kind": "work", "source": "ebpf"}
            ]
        });
        assert_eq!(
            one_liner(&n),
            "[critical] activity-after-rejection request load-7 room 0xff: prefill rejected 400 -> transfer work (evidence: ebpf+otlp)"
        );
    }

    #[test]
    fn tail_yields_complete_lines_only() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.jsonl");
        let mut t = JsonlTail::new(&p);
        assert!(t.poll().is_empty());
        std::fs::write(&p, "{\"a\":1}\n{\"b\"").unwrap();
        assert_eq!(t.poll().len(), 1);
        std::fs::write(&p, "{\"a\":1}\n{\"b\":2}\n").unwrap();
        assert_eq!(t.poll(), vec![serde_json::json!({"b": 2})]);
    }
}
