//! Blocking helpers to drive the simulator from other crates' tests and from xtask: start
//! `pd-sim cluster` on ephemeral loopback ports, wait for readiness (READY line, then
//! `/health`), always stop it (Drop), run `pd-sim load`. No async runtime needed.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error("cannot start {0}: {1}")]
    Spawn(String, std::io::Error),
    #[error("cluster not ready within {0:?}")]
    NotReady(Duration),
    #[error("bad READY line: {0}")]
    BadReady(String),
    #[error("{0} not healthy within {1:?}")]
    Unhealthy(String, Duration),
    #[error("load generator failed: {0}")]
    Load(String),
    #[error("http: {0}")]
    Http(String),
    #[error("{0}")]
    Missing(String),
    #[error("{0}")]
    Exited(String),
}

/// A running `pd-sim cluster`; dropping it stops every process (SIGTERM, then SIGKILL).
pub struct ClusterProcess {
    child: Child,
    /// The cluster's READY object (router/prefill/decode URLs, bootstrap and KV ports, pids).
    pub ready: serde_json::Value,
    pub router: String,
    pub prefill: String,
    pub decode: String,
    pub pids: Vec<u32>,
}

fn pdeathsig(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl only, in the forked child before exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

impl ClusterProcess {
    /// `pd-sim cluster --ephemeral {args}`; e.g. `["--mode", "handoff-after-reject",
    /// "--otlp-endpoint", url]`. Logs of the children go to this process's stderr at `warn`
    /// unless `PD_SIM_LOG` is set.
    pub fn start(bin: &Path, args: &[&str]) -> Result<ClusterProcess, HarnessError> {
        let mut cmd = Command::new(bin);
        cmd.args(["cluster", "--ephemeral"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if std::env::var_os("PD_SIM_LOG").is_none() {
            cmd.env("PD_SIM_LOG", "warn");
        }
        pdeathsig(&mut cmd);
        let mut child = cmd
            .spawn()
            .map_err(|e| HarnessError::Spawn(bin.display().to_string(), e))?;
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut r = BufReader::new(stdout);
            let mut line = String::new();
            loop {
                line.clear();
                match r.read_line(&mut line) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {
                        if let Some(j) = line.trim().strip_prefix("READY ") {
                            let _ = tx.send(j.to_string());
                        }
                    }
                }
            }
        });
        let wait = Duration::from_secs(60);
        let line = match rx.recv_timeout(wait) {
            Ok(l) => l,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(HarnessError::NotReady(wait));
            }
        };
        let mut c = ClusterProcess {
            child,
            ready: serde_json::Value::Null,
            router: String::new(),
            prefill: String::new(),
            decode: String::new(),
            pids: Vec::new(),
        };
        // From here on, Drop cleans up whatever happens.
        c.ready = serde_json::from_str(&line).map_err(|_| HarnessError::BadReady(line.clone()))?;
        let s = |k: &str| c.ready[k].as_str().unwrap_or("").to_string();
        (c.router, c.prefill, c.decode) = (s("router"), s("prefill"), s("decode"));
        c.pids = ["router", "prefill", "decode"]
            .iter()
            .filter_map(|k| c.ready["pids"][k].as_u64())
            .map(|p| p as u32)
            .collect();
        for url in [&c.router, &c.prefill, &c.decode] {
            if !url.is_empty() {
                wait_healthy(url, Duration::from_secs(30))?;
            }
        }
        Ok(c)
    }
}

impl Drop for ClusterProcess {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own, not yet reaped child.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break;
                }
            }
        }
        for pid in &self.pids {
            // SAFETY: signal 0 probes; a stray grandchild gets SIGKILL.
            unsafe {
                if libc::kill(*pid as i32, 0) == 0 {
                    libc::kill(*pid as i32, libc::SIGKILL);
                }
            }
        }
    }
}

/// Minimal blocking HTTP/1.1 GET (loopback only, `Connection: close`): status and body.
pub fn http_get(url: &str) -> Result<(u16, Vec<u8>), HarnessError> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| HarnessError::Http(format!("not an http URL: {url}")))?;
    let (host, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let mut s = TcpStream::connect(host).map_err(|e| HarnessError::Http(e.to_string()))?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| HarnessError::Http(e.to_string()))?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)
        .map_err(|e| HarnessError::Http(e.to_string()))?;
    let head_end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| HarnessError::Http("no header end".into()))?;
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| HarnessError::Http(format!("bad status line: {head}")))?;
    let mut body = buf[head_end + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body);
    }
    Ok((status, body))
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

pub fn wait_healthy(base: &str, timeout: Duration) -> Result<(), HarnessError> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok((200, _)) = http_get(&format!("{base}/health")) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(HarnessError::Unhealthy(base.to_string(), timeout));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Run `pd-sim load --router {router} {args}` to completion and return its summary JSON.
pub fn run_load(
    bin: &Path,
    router: &str,
    args: &[&str],
) -> Result<serde_json::Value, HarnessError> {
    let path: PathBuf = std::env::temp_dir().join(format!(
        "pd-sim-load-{}-{}.json",
        std::process::id(),
        crate::common::now_ns()
    ));
    let mut cmd = Command::new(bin);
    cmd.args(["load", "--router", router, "--quiet", "--summary-json"])
        .arg(&path)
        .args(args);
    pdeathsig(&mut cmd);
    let out = cmd
        .output()
        .map_err(|e| HarnessError::Spawn(bin.display().to_string(), e))?;
    if !out.status.success() {
        return Err(HarnessError::Load(
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ));
    }
    let bytes = std::fs::read(&path).map_err(|e| HarnessError::Load(format!("summary: {e}")))?;
    let _ = std::fs::remove_file(&path);
    serde_json::from_slice(&bytes).map_err(|e| HarnessError::Load(format!("summary json: {e}")))
}

/// A binary of this workspace next to the running test or bench executable
/// (`target/{profile}/deps/x-hash` → `target/{profile}/NAME`), or the path in `env_var`.
/// Cargo only hands `CARGO_BIN_EXE_*` to tests of the binary's own package, so end-to-end tests
/// here find `revenant` this way; a missing binary is an error that says how to build it.
pub fn workspace_bin(name: &str, env_var: &str) -> Result<PathBuf, HarnessError> {
    if let Some(p) = std::env::var_os(env_var) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(HarnessError::Missing(format!(
                "{env_var}={} does not exist",
                p.display()
            )))
        };
    }
    let exe = std::env::current_exe().map_err(|e| HarnessError::Missing(e.to_string()))?;
    let mut dir = exe.parent();
    while let Some(d) = dir {
        let candidate = d.join(name);
        if candidate.is_file() && d.file_name().is_some_and(|n| n != "deps") {
            return Ok(candidate);
        }
        if d.file_name().is_some_and(|n| n == "target") {
            break;
        }
        dir = d.parent();
    }
    Err(HarnessError::Missing(format!(
        "no `{name}` binary next to {} — build it (`cargo build -p {name}` with the same profile) or set {env_var}",
        exe.display()
    )))
}

/// A scratch directory under the system temp dir, removed on Drop.
pub struct ScratchDir(pub PathBuf);

impl ScratchDir {
    pub fn new(tag: &str) -> Result<ScratchDir, HarnessError> {
        let p = std::env::temp_dir().join(format!(
            "pd-sim-{tag}-{}-{}",
            std::process::id(),
            crate::common::now_ns()
        ));
        std::fs::create_dir_all(&p).map_err(|e| HarnessError::Missing(e.to_string()))?;
        Ok(ScratchDir(p))
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if std::env::var_os("PD_SIM_KEEP_SCRATCH").is_none() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn stop_child(child: &mut Child, grace: Duration) -> Option<std::process::ExitStatus> {
    // SAFETY: kill(2) on our own, not yet reaped child.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let deadline = Instant::now() + grace;
    loop {
        match child.try_wait() {
            Ok(Some(s)) => return Some(s),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

/// A running `revenant run` on ephemeral loopback ports (OTLP gRPC and HTTP), writing its
/// alerts and normalized events as JSON Lines into `dir`. Dropping it kills it.
pub struct RevenantProcess {
    child: Option<Child>,
    /// The ready file's object: `otlp_grpc`, `otlp_http` (and `admin`, `ebpf` where present).
    pub ready: serde_json::Value,
    pub otlp_grpc: String,
    pub otlp_http: String,
    /// The admin server's `host:port`, empty with `--no-admin`.
    pub admin: String,
    pub alerts_path: PathBuf,
    pub events_path: PathBuf,
    pub stderr_path: PathBuf,
    pub pid: u32,
}

impl RevenantProcess {
    /// `revenant run --otlp-grpc 127.0.0.1:0 --otlp-http 127.0.0.1:0 --ready-file … --alerts-jsonl …
    /// --events-jsonl … {extra}`; waits (≤ 60 s) for the ready file.
    pub fn start(bin: &Path, dir: &Path, extra: &[&str]) -> Result<RevenantProcess, HarnessError> {
        let ready_path = dir.join("revenant-ready.json");
        let alerts_path = dir.join("alerts.jsonl");
        let events_path = dir.join("events.jsonl");
        let stderr_path = dir.join("revenant.stderr");
        let stderr = std::fs::File::create(&stderr_path)
            .map_err(|e| HarnessError::Spawn(stderr_path.display().to_string(), e))?;
        let mut cmd = Command::new(bin);
        cmd.args([
            "run",
            "--otlp-grpc",
            "127.0.0.1:0",
            "--otlp-http",
            "127.0.0.1:0",
        ])
        .arg("--ready-file")
        .arg(&ready_path)
        .arg("--alerts-jsonl")
        .arg(&alerts_path)
        .arg("--events-jsonl")
        .arg(&events_path)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr);
        pdeathsig(&mut cmd);
        let child = cmd
            .spawn()
            .map_err(|e| HarnessError::Spawn(bin.display().to_string(), e))?;
        let mut r = RevenantProcess {
            pid: child.id(),
            child: Some(child),
            ready: serde_json::Value::Null,
            otlp_grpc: String::new(),
            otlp_http: String::new(),
            admin: String::new(),
            alerts_path,
            events_path,
            stderr_path,
        };
        let wait = Duration::from_secs(60);
        let deadline = Instant::now() + wait;
        loop {
            if let Ok(b) = std::fs::read(&ready_path)
                && let Ok(v) = serde_json::from_slice::<serde_json::Value>(&b)
            {
                r.ready = v;
                break;
            }
            if let Some(Ok(Some(status))) = r.child.as_mut().map(|c| c.try_wait()) {
                return Err(HarnessError::Exited(format!(
                    "revenant exited ({status}): {}",
                    r.stderr_tail()
                )));
            }
            if Instant::now() > deadline {
                return Err(HarnessError::NotReady(wait));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let s = |k: &str| r.ready[k].as_str().unwrap_or("").to_string();
        (r.otlp_grpc, r.otlp_http, r.admin) = (s("otlp_grpc"), s("otlp_http"), s("admin"));
        Ok(r)
    }

    /// Every JSON line of the alerts file so far.
    pub fn alerts(&self) -> Vec<serde_json::Value> {
        read_jsonl(&self.alerts_path)
    }

    /// GET a JSON document from the admin server (`/api/violations`, `/api/requests/ID`).
    pub fn admin_json(&self, path: &str) -> Result<(u16, serde_json::Value), HarnessError> {
        let (status, body) = http_get(&format!("http://{}{path}", self.admin))?;
        let v = serde_json::from_slice(&body)
            .map_err(|e| HarnessError::Http(format!("{path}: not JSON: {e}")))?;
        Ok((status, v))
    }

    /// Every JSON line of the events file so far.
    pub fn events(&self) -> Vec<serde_json::Value> {
        read_jsonl(&self.events_path)
    }

    pub fn stderr_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.stderr_path).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// SIGTERM and wait (≤ 30 s) for the drain; returns its stderr (shutdown summary, counters).
    pub fn stop(&mut self) -> Result<String, HarnessError> {
        let Some(mut child) = self.child.take() else {
            return Ok(self.stderr_tail());
        };
        match stop_child(&mut child, Duration::from_secs(30)) {
            Some(s) if s.success() => {
                Ok(std::fs::read_to_string(&self.stderr_path).unwrap_or_default())
            }
            Some(s) => Err(HarnessError::Exited(format!(
                "revenant exited with {s}: {}",
                self.stderr_tail()
            ))),
            None => Err(HarnessError::Exited(
                "revenant did not stop within 30 s of SIGTERM (killed)".into(),
            )),
        }
    }
}

impl Drop for RevenantProcess {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            stop_child(&mut c, Duration::from_secs(5));
        }
    }
}

/// Every parseable JSON line of a file (a line being written is skipped, read it next time).
pub fn read_jsonl(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// A loopback port that was free a moment ago (for programs that cannot bind port 0 and report it).
pub fn free_port() -> Result<u16, HarnessError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| HarnessError::Missing(format!("no free port: {e}")))
}

/// The smallest model directory the real `smg` accepts for `--model-path`: a HuggingFace
/// `tokenizer.json` with a WordLevel model and a whitespace pre-tokenizer (one token per word,
/// like the simulator's own count), plus `config.json` / `tokenizer_config.json`.
pub fn write_tiny_model(dir: &Path) -> Result<(), HarnessError> {
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 0, "content": "[UNK]", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "word": 1}, "unk_token": "[UNK]"}
    });
    let io = |e: std::io::Error| HarnessError::Missing(format!("model dir: {e}"));
    std::fs::create_dir_all(dir).map_err(io)?;
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).map_err(io)?;
    std::fs::write(
        dir.join("config.json"),
        r#"{"model_type":"llama","architectures":["LlamaForCausalLM"]}"#,
    )
    .map_err(io)?;
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"unk_token":"[UNK]"}"#,
    )
    .map_err(io)?;
    Ok(())
}

/// The real sglang-router (`smg launch --pd-disaggregation`) in front of a simulator's prefill
/// and decode; dropping it stops it. Its output goes to `log`.
pub struct SmgProcess {
    child: Child,
    pub url: String,
}

impl SmgProcess {
    /// `trace` is the OTLP/gRPC `host:port` for `--enable-trace --otlp-traces-endpoint`.
    pub fn start(
        smg: &Path,
        cluster: &ClusterProcess,
        model_dir: &Path,
        trace: Option<&str>,
        log: &Path,
        extra: &[&str],
    ) -> Result<SmgProcess, HarnessError> {
        let port = free_port()?;
        let bootstrap = cluster.ready["bootstrap_port"].to_string();
        let out = std::fs::File::create(log)
            .map_err(|e| HarnessError::Spawn(log.display().to_string(), e))?;
        let err = out
            .try_clone()
            .map_err(|e| HarnessError::Spawn(log.display().to_string(), e))?;
        let mut cmd = Command::new(smg);
        cmd.args(["launch", "--host", "127.0.0.1", "--port", &port.to_string()])
            .args([
                "--pd-disaggregation",
                "--prefill",
                &cluster.prefill,
                &bootstrap,
            ])
            .args(["--decode", &cluster.decode])
            .args(["--prometheus-port", &free_port()?.to_string()])
            .arg("--model-path")
            .arg(model_dir);
        if let Some(t) = trace {
            cmd.args(["--enable-trace", "--otlp-traces-endpoint", t]);
        }
        cmd.args(extra).stdin(Stdio::null()).stdout(out).stderr(err);
        pdeathsig(&mut cmd);
        let child = cmd
            .spawn()
            .map_err(|e| HarnessError::Spawn(smg.display().to_string(), e))?;
        let s = SmgProcess {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        wait_healthy(&s.url, Duration::from_secs(60))?;
        Ok(s)
    }
}

impl Drop for SmgProcess {
    fn drop(&mut self) {
        stop_child(&mut self.child, Duration::from_secs(5));
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn dechunks_chunked_bodies() {
        assert_eq!(
            super::dechunk(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"),
            b"abcde"
        );
    }
}
