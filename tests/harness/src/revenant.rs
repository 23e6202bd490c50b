use std::ffi::OsStr;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};
use serde_json::Value;

use crate::files::{read_jsonl, read_jsonl_so_far, tail};
use crate::http::http_get;
use crate::metrics::{Sample, metric_sum, parse_metrics};
use crate::proc::Proc;

/// A running `revenant run`, its files under one directory.
pub struct Revenant {
    pub proc: Proc,
    pub dir: PathBuf,
    /// The ready file's object: `admin`, `otlp_grpc`, `otlp_http`, `ebpf`.
    pub ready: Value,
    /// `host:port` from the ready file; empty when that listener is off.
    pub otlp_grpc: String,
    pub otlp_http: String,
    pub admin: String,
    /// The alerts JSON Lines file (`--alerts-jsonl`).
    pub alerts: PathBuf,
    /// The normalized events file, if the caller passed `--events-jsonl` (else DIR/events.jsonl,
    /// which stays absent).
    pub events: PathBuf,
    /// revenant's stderr.
    pub log: PathBuf,
}

impl Revenant {
    /// `revenant run {args} --ready-file DIR/revenant-ready.json`, stderr to DIR/revenant.log;
    /// returns once the ready file is there (at most 60 s). Defaults for whatever `args` does not
    /// set: listeners and admin on ephemeral loopback ports, `--ebpf off` (as root, `auto`
    /// would watch any SGLang-looking process), `--alerts-jsonl DIR/alerts.jsonl`,
    /// `--spool-dir DIR/spool`.
    pub fn start<S: AsRef<OsStr>>(bin: &Path, dir: &Path, args: &[S]) -> Result<Revenant> {
        Revenant::start_within(bin, dir, args, Duration::from_secs(60))
    }

    /// [`Revenant::start`] with another bound on the wait for readiness.
    pub fn start_within<S: AsRef<OsStr>>(
        bin: &Path,
        dir: &Path,
        args: &[S],
        ready_timeout: Duration,
    ) -> Result<Revenant> {
        Revenant::start_subcommand(bin, "run", dir, args, ready_timeout)
    }

    /// [`Revenant::start_within`] for another subcommand that takes `run`'s flags (`agent`,
    /// `checker`); the defaults it does not use are left out.
    pub fn start_subcommand<S: AsRef<OsStr>>(
        bin: &Path,
        subcommand: &str,
        dir: &Path,
        args: &[S],
        ready_timeout: Duration,
    ) -> Result<Revenant> {
        let value_of = |flag: &str| {
            args.iter()
                .position(|a| a.as_ref() == flag)
                .and_then(|i| args.get(i + 1))
                .map(|v| PathBuf::from(v.as_ref()))
        };
        let ready_path = dir.join("revenant-ready.json");
        let alerts = value_of("--alerts-jsonl").unwrap_or_else(|| dir.join("alerts.jsonl"));
        let events = value_of("--events-jsonl").unwrap_or_else(|| dir.join("events.jsonl"));
        let log = dir.join("revenant.log");
        let _ = std::fs::remove_file(&ready_path);
        let defaults: [(&str, &OsStr); 6] = [
            ("--otlp-grpc", "127.0.0.1:0".as_ref()),
            ("--otlp-http", "127.0.0.1:0".as_ref()),
            ("--admin", "127.0.0.1:0".as_ref()),
            ("--ebpf", "off".as_ref()),
            ("--alerts-jsonl", alerts.as_os_str()),
            ("--spool-dir", &dir.join("spool").into_os_string()),
        ];
        // What a subcommand does not use it refuses: an agent sends no alerts, a checker has no
        // sources.
        let applies = |flag: &str| match subcommand {
            "agent" => flag != "--alerts-jsonl",
            "checker" => !matches!(flag, "--otlp-grpc" | "--otlp-http" | "--ebpf"),
            _ => true,
        };
        let mut cmd = Command::new(bin);
        cmd.arg(subcommand);
        for (flag, value) in defaults {
            if applies(flag) && !args.iter().any(|a| a.as_ref() == flag) {
                cmd.arg(flag).arg(value);
            }
        }
        cmd.args(args)
            .arg("--ready-file")
            .arg(&ready_path)
            .stdin(Stdio::null())
            .stdout(File::create(dir.join("revenant.out"))?)
            .stderr(File::create(&log)?);
        let mut proc = Proc::spawn("revenant", &mut cmd)?;
        proc.grace = Duration::from_secs(20);
        let deadline = Instant::now() + ready_timeout;
        let ready = loop {
            if let Ok(text) = std::fs::read_to_string(&ready_path)
                && let Ok(v) = serde_json::from_str::<Value>(&text)
            {
                break v;
            }
            if let Some(s) = proc.exited() {
                bail!(
                    "revenant exited before it was ready ({s}); its log:\n{}",
                    tail(&log, 40)
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "revenant not ready within {ready_timeout:?}; its log:\n{}",
                    tail(&log, 40)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let field = |k: &str| ready[k].as_str().unwrap_or_default().to_owned();
        Ok(Revenant {
            otlp_grpc: field("otlp_grpc"),
            otlp_http: field("otlp_http"),
            admin: field("admin"),
            proc,
            dir: dir.to_path_buf(),
            ready,
            alerts,
            events,
            log,
        })
    }

    /// [`Revenant::start_within`] as the end-to-end tests run it: the normalized events in
    /// DIR/events.jsonl too, unless `args` names another `--events-jsonl`.
    pub fn start_recording<S: AsRef<OsStr>>(
        bin: &Path,
        dir: &Path,
        args: &[S],
        ready_timeout: Duration,
    ) -> Result<Revenant> {
        let mut all: Vec<&OsStr> = args.iter().map(AsRef::as_ref).collect();
        let events = dir.join("events.jsonl");
        if !all.iter().any(|a| *a == "--events-jsonl") {
            all.extend(["--events-jsonl".as_ref(), events.as_os_str()]);
        }
        Revenant::start_within(bin, dir, &all, ready_timeout)
    }

    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    pub fn admin_url(&self) -> String {
        format!("http://{}", self.admin)
    }

    /// GET a JSON document from the admin server (`/api/violations`, `/api/requests/ID`).
    pub fn admin_json(&self, path: &str) -> Result<(u16, Value)> {
        let (status, body) = http_get(&format!("{}{path}", self.admin_url()))?;
        let v = serde_json::from_str(&body).map_err(|e| anyhow!("{path}: not JSON: {e}"))?;
        Ok((status, v))
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
    /// plenty) and no incident notification is still waiting (group wait, corroboration), at
    /// most `timeout`. Returns the last samples.
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
            let pending = metric_sum(&now, "revenant_alerts_pending", &[]) > 0.0;
            if key(&now) != key(&last) || pending {
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

    /// SIGTERM and wait (at most 30 s) for the drain: alerts held or queued are delivered.
    pub fn stop(&mut self) -> Result<ExitStatus> {
        self.stop_within(Duration::from_secs(30))
    }

    /// SIGTERM and wait at most `grace` for the drain; not stopping by then is an error (it is
    /// killed).
    pub fn stop_within(&mut self, grace: Duration) -> Result<ExitStatus> {
        match self.proc.stop_in_time(libc::SIGTERM, grace) {
            (Some(s), true) => Ok(s),
            (_, false) => Err(anyhow!(
                "revenant did not stop within {grace:?} of SIGTERM (killed): {}",
                self.log_tail(40)
            )),
            (None, true) => Err(anyhow!("revenant could not be reaped")),
        }
    }

    /// [`Revenant::stop`] that must exit successfully; returns its whole stderr (shutdown
    /// summary, counters).
    pub fn stop_log(&mut self) -> Result<String> {
        match self.stop()? {
            s if s.success() => Ok(self.log_text()),
            s => Err(anyhow!("revenant exited with {s}: {}", self.log_tail(40))),
        }
    }

    /// Every notification of the (finished) alerts file; a line that is not JSON is an error.
    pub fn notifications(&self) -> Result<Vec<Value>> {
        read_jsonl(&self.alerts)
    }

    /// The alerts file while revenant runs (a line being written is left for next time).
    pub fn alerts(&self) -> Vec<Value> {
        read_jsonl_so_far(&self.alerts)
    }

    /// The events file while revenant runs (a line being written is left for next time).
    pub fn events(&self) -> Vec<Value> {
        read_jsonl_so_far(&self.events)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn log_tail(&self, n: usize) -> String {
        tail(&self.log, n)
    }
}
