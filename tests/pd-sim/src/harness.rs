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
