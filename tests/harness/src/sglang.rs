//! The SGLang truth source (`tests/sglang-harness`): prefill and decode worker processes that
//! run SGLang 0.5.23's own HTTP server, tokenizer manager, bootstrap server and Mooncake KV
//! managers, senders and receivers, with the model and scheduler played by the harness. Each
//! worker writes a JSON Lines ground truth per room (what SGLang's code did: senders and
//! receivers created, statuses polled, ZMQ frames sent and received, KV bytes landed, answers).
//!
//! Also here: the real `smg` router in front of such workers, and the harness's OTLP/HTTP span
//! sink. The Python interpreter is the one of `target/sglang-venv` (`SGLANG_HARNESS_PYTHON`,
//! set by `cargo xtask test`, which creates the venv).

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::binaries::workspace_root;
use crate::files::{read_jsonl_so_far, tail};
use crate::http::{free_port, http_get};
use crate::proc::Proc;

/// The harness package (`python -m sglang_harness`).
pub fn harness_dir() -> PathBuf {
    workspace_root().join("tests/sglang-harness")
}

/// The venv interpreter from `SGLANG_HARNESS_PYTHON`; panics, saying how to get it, when unset.
#[track_caller]
pub fn harness_python() -> PathBuf {
    crate::router_from_env(
        "SGLANG_HARNESS_PYTHON",
        "the python of target/sglang-venv (sglang 0.5.23, torch, mooncake-transfer-engine-non-cuda)",
    )
}

fn harness_command(python: &Path) -> Command {
    let mut cmd = Command::new(python);
    cmd.current_dir(harness_dir())
        .env("PYTHONPATH", harness_dir())
        .args(["-m", "sglang_harness"])
        .stdin(Stdio::null());
    cmd
}

/// Writes the tiny model directory the workers load and `smg --model-path` reads (one token per
/// whitespace-separated word).
pub fn write_model_dir(python: &Path, dir: &Path) -> Result<()> {
    let out = harness_command(python)
        .arg("model-dir")
        .arg(dir)
        .output()
        .context("python -m sglang_harness model-dir")?;
    if !out.status.success() {
        bail!(
            "sglang_harness model-dir failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// A worker's command line (`python -m sglang_harness worker --help` has them all).
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    pub role: Role,
    /// Its loopback address (HTTP, bootstrap server, ZMQ, Mooncake), e.g. 127.0.0.2.
    pub host: String,
    pub context_length: u32,
    /// KV pool size in pages (page size 1): prefill's capacity bounds what its scheduler admits
    /// (`max_req_input_len` = min(context, capacity) - 6).
    pub kv_pages: u32,
    /// `early` (SGLang's default) or `prefill_complete`.
    pub decode_allocation_policy: &'static str,
    /// Prefill: `fixed` (0.5.21+) or `stub` (<= 0.5.20).
    pub intake_reject: &'static str,
    /// `SGLANG_DISAGGREGATION_WAITING_TIMEOUT` (SGLang: 300 s).
    pub waiting_timeout_s: Option<u32>,
    /// `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT` (SGLang: 300 s).
    pub bootstrap_timeout_s: Option<u32>,
    /// OTLP/HTTP traces endpoint (`--enable-trace`), e.g. the [`OtlpSink`]'s.
    pub otlp_http: Option<String>,
    /// SGLang's startup warmup (`/generate` with bootstrap_host 2.2.2.2); on by default.
    pub warmup: bool,
    pub extra: Vec<String>,
}

impl WorkerOptions {
    pub fn new(role: Role, host: &str, context_length: u32, kv_pages: u32) -> WorkerOptions {
        WorkerOptions {
            role,
            host: host.into(),
            context_length,
            kv_pages,
            decode_allocation_policy: "early",
            intake_reject: "fixed",
            waiting_timeout_s: None,
            bootstrap_timeout_s: None,
            otlp_http: None,
            warmup: true,
            extra: Vec::new(),
        }
    }
}

/// A running worker; dropping it kills its process group (HTTP server, scheduler, detokenizer)
/// at once: the tests own these servers and do not test their shutdown.
pub struct SglangWorker {
    pub proc: Proc,
    pub role: Role,
    pub host: String,
    pub port: u16,
    /// `http://host:port`
    pub url: String,
    /// Prefill's bootstrap server port (what the router passes as `bootstrap_port`).
    pub bootstrap_port: u16,
    /// The ground truth (JSON Lines).
    pub truth: PathBuf,
    /// stdout and stderr.
    pub log: PathBuf,
}

impl SglangWorker {
    /// Starts the worker (not yet ready: [`SglangWorker::wait_ready`]); its files go to `dir`.
    pub fn spawn(
        python: &Path,
        opts: &WorkerOptions,
        model_dir: &Path,
        dir: &Path,
    ) -> Result<SglangWorker> {
        let role = opts.role.as_str();
        let port = free_port()?;
        let bootstrap_port = free_port()?;
        let truth = dir.join(format!("{role}.truth.jsonl"));
        let log = dir.join(format!("{role}.log"));
        let mut cmd = harness_command(python);
        cmd.arg("worker")
            .args(["--role", role, "--host", &opts.host])
            .args(["--port", &port.to_string()])
            .args(["--bootstrap-port", &bootstrap_port.to_string()])
            .args(["--context-length", &opts.context_length.to_string()])
            .args(["--kv-pages", &opts.kv_pages.to_string()])
            .args([
                "--decode-allocation-policy",
                opts.decode_allocation_policy,
                "--intake-reject",
                opts.intake_reject,
            ])
            .arg("--truth-log")
            .arg(&truth)
            .arg("--model-dir")
            .arg(model_dir);
        if let Some(s) = opts.waiting_timeout_s {
            cmd.args(["--waiting-timeout", &s.to_string()]);
        }
        if let Some(s) = opts.bootstrap_timeout_s {
            cmd.args(["--bootstrap-timeout", &s.to_string()]);
        }
        if let Some(ep) = &opts.otlp_http {
            cmd.args(["--enable-trace", "--otlp-protocol", "http/protobuf"])
                .args(["--otlp-endpoint", ep]);
        }
        if !opts.warmup {
            cmd.arg("--no-warmup");
        }
        cmd.args(&opts.extra);
        let out = File::create(&log).with_context(|| log.display().to_string())?;
        cmd.stdout(out.try_clone()?).stderr(out);
        let proc = Proc::spawn(&format!("sglang {role}"), &mut cmd)?.with_grace(Duration::ZERO);
        Ok(SglangWorker {
            proc,
            role: opts.role,
            host: opts.host.clone(),
            port,
            url: format!("http://{}:{port}", opts.host),
            bootstrap_port,
            truth,
            log,
        })
    }

    /// Waits until SGLang's `/health` answers 200 (a health-check generate went through the
    /// played scheduler, after SGLang's warmup), or fails when the process exits or `deadline`
    /// passes.
    pub fn wait_ready(&mut self, deadline: Instant) -> Result<()> {
        loop {
            if let Some(status) = self.proc.exited() {
                bail!(
                    "sglang {} exited ({status}) before it was ready; its log:\n{}",
                    self.role.as_str(),
                    tail(&self.log, 40)
                );
            }
            if let Ok((200, _)) = http_get(&format!("{}/health", self.url)) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "sglang {} not healthy in time; its log:\n{}",
                    self.role.as_str(),
                    tail(&self.log, 40)
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Every complete ground-truth record so far.
    pub fn truth(&self) -> Vec<Value> {
        read_jsonl_so_far(&self.truth)
    }

    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }
}

/// Starts a prefill and a decode worker side by side (their start-ups overlap) and waits for
/// both, at most `timeout`.
pub fn start_workers(
    python: &Path,
    opts: &[WorkerOptions],
    model_dir: &Path,
    dir: &Path,
    timeout: Duration,
) -> Result<Vec<SglangWorker>> {
    let deadline = Instant::now() + timeout;
    let mut workers = Vec::new();
    for (i, o) in opts.iter().enumerate() {
        let sub = dir.join(format!("{}-{i}", o.role.as_str()));
        std::fs::create_dir_all(&sub)?;
        workers.push(SglangWorker::spawn(python, o, model_dir, &sub)?);
    }
    for w in &mut workers {
        w.wait_ready(deadline)?;
    }
    Ok(workers)
}

/// The harness's OTLP span sink: SGLang's exporters post to [`OtlpSink::endpoint`] (OTLP/HTTP),
/// a router's gRPC exporter sends to [`OtlpSink::grpc`]; one JSON object per span lands in
/// [`OtlpSink::out`].
pub struct OtlpSink {
    pub proc: Proc,
    pub endpoint: String,
    /// `host:port` of its OTLP/gRPC listener (smg's `--otlp-traces-endpoint`).
    pub grpc: String,
    pub out: PathBuf,
}

impl OtlpSink {
    pub fn start(python: &Path, dir: &Path) -> Result<OtlpSink> {
        OtlpSink::start_forwarding(python, dir, None)
    }

    /// [`OtlpSink::start`] that also posts every export to `forward` (an OTLP/HTTP traces URL:
    /// revenant's), answering SGLang's exporters with that receiver's status.
    pub fn start_forwarding(python: &Path, dir: &Path, forward: Option<&str>) -> Result<OtlpSink> {
        OtlpSink::start_forwarding_to(python, dir, forward.as_slice())
    }

    /// [`OtlpSink::start`] that posts every export to each of `forward` (several revenants),
    /// answering SGLang's exporters with the first refusal among them, if any.
    pub fn start_forwarding_to(python: &Path, dir: &Path, forward: &[&str]) -> Result<OtlpSink> {
        let port = free_port()?;
        let grpc_port = free_port()?;
        let out = dir.join("spans.jsonl");
        let log = dir.join("otlp-sink.log");
        let mut cmd = harness_command(python);
        cmd.args([
            "otlp-sink",
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--grpc-port",
            &grpc_port.to_string(),
        ])
        .arg("--out")
        .arg(&out)
        .args(forward.iter().flat_map(|f| ["--forward", f]))
        .stdout(Stdio::piped())
        .stderr(File::create(&log)?);
        let mut proc = Proc::spawn("otlp-sink", &mut cmd)?.with_grace(Duration::ZERO);
        let stdout = proc.child_mut().stdout.take().context("otlp-sink stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        if !line.starts_with("READY") {
            bail!("otlp-sink did not start: {line}{}", tail(&log, 20));
        }
        Ok(OtlpSink {
            proc,
            endpoint: format!("http://127.0.0.1:{port}/v1/traces"),
            grpc: format!("127.0.0.1:{grpc_port}"),
            out,
        })
    }

    pub fn spans(&self) -> Vec<Value> {
        read_jsonl_so_far(&self.out)
    }
}

/// The real `smg` router (`smg launch --pd-disaggregation`) in front of given workers.
pub struct Smg {
    pub proc: Proc,
    pub url: String,
    pub log: PathBuf,
}

impl Smg {
    /// `smg` is the router binary (`PD_SIM_SMG113` for smg 1.13.0); waits for its `/health`.
    pub fn start(
        smg: &Path,
        prefill: &SglangWorker,
        decode: &SglangWorker,
        model_dir: &Path,
        log: &Path,
        extra: &[&str],
    ) -> Result<Smg> {
        let port = free_port()?;
        let out = File::create(log).with_context(|| log.display().to_string())?;
        let mut cmd = Command::new(smg);
        cmd.args(["launch", "--pd-disaggregation", "--prefill", &prefill.url])
            .arg(prefill.bootstrap_port.to_string())
            .args(["--decode", &decode.url])
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--prometheus-host", "127.0.0.1"])
            .args(["--prometheus-port", &free_port()?.to_string()])
            .arg("--model-path")
            .arg(model_dir)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        let proc = Proc::spawn("smg", &mut cmd)?.with_grace(Duration::ZERO);
        let url = format!("http://127.0.0.1:{port}");
        crate::http::wait_healthy(&url, Duration::from_secs(30))
            .with_context(|| format!("smg not healthy; its log:\n{}", tail(log, 20)))?;
        wait_smg_workers(&url, Duration::from_secs(30))
            .with_context(|| format!("its log:\n{}", tail(log, 20)))?;
        Ok(Smg {
            proc,
            url,
            log: log.to_path_buf(),
        })
    }
}

/// Waits until the `smg` router at `url` lists a healthy prefill and decode worker. smg answers
/// `/health` before its worker registration (which asks each worker's `/server_info` and
/// `/model_info`) is done, and until then answers requests 503 "no_available_workers". A router
/// without `/workers` (sglang-router 0.3.2) is taken as registered once healthy.
pub fn wait_smg_workers(url: &str, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        match http_get(&format!("{url}/workers")) {
            Ok((200, body)) => {
                let has = |t: &str| body.contains(&format!("\"worker_type\":\"{t}\""));
                if has("prefill") && has("decode") && !body.contains("\"is_healthy\":false") {
                    return Ok(());
                }
            }
            Ok((404, _)) => return Ok(()),
            _ => {}
        }
        if Instant::now() > deadline {
            bail!("smg at {url} registered no healthy prefill and decode within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
