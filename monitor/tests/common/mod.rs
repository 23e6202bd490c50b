//! Shared helpers for the end-to-end alerting/admin tests: Debian packages installed on demand,
//! loopback ports, bounded waits, violations and a recording webhook receiver (`alerts`, which
//! the alert_delivery bench shares).
#![allow(dead_code)]

pub mod alerts;
pub mod process;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Installs a Debian package if `binary` is not on PATH; panics loudly if that fails.
pub fn ensure_debian_package(binary: &str, package: &str) -> String {
    let which = |b: &str| {
        Command::new("which")
            .arg(b)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    if let Some(p) = which(binary) {
        return p;
    }
    // One installer at a time: tests run in parallel and dpkg takes a lock.
    static LOCK: Mutex<()> = Mutex::new(());
    let _g = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(p) = which(binary) {
        return p;
    }
    eprintln!("installing Debian package {package} for {binary}");
    let ok = |c: &mut Command| c.status().map(|s| s.success()).unwrap_or(false);
    let _ = ok(Command::new("apt-get").args(["update", "-qq"]));
    let installed = ok(Command::new("apt-get")
        .args(["install", "-y", "-qq", package])
        .env("DEBIAN_FRONTEND", "noninteractive"));
    assert!(
        installed,
        "apt-get install -y {package} failed: cannot run this test without {binary}"
    );
    which(binary).unwrap_or_else(|| panic!("{package} installed but {binary} is not on PATH"))
}

/// Polls `f` every 50 ms until it returns `Some`, or panics after `timeout` with `what`.
pub async fn wait_for<T>(
    timeout: Duration,
    what: &str,
    mut f: impl AsyncFnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A Prometheus-family server (`prometheus`, `alertmanager`) on a free loopback port: its
/// `--config.file`, `{storage_flag}=DIR/{name}-data`, log in DIR/{name}.log, `extra` flags.
/// Returns the child and its base URL once `/-/ready` answers 200 (at most 60 s).
pub async fn start_prometheus_server(
    bin: &str,
    name: &str,
    dir: &Path,
    config: &Path,
    storage_flag: &str,
    extra: &[&str],
    http: &reqwest::Client,
) -> (ChildGuard, String) {
    let port = test_harness::free_port().unwrap();
    let child = spawn(
        Command::new(bin)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "{storage_flag}={}",
                dir.join(format!("{name}-data")).display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join(format!("{name}.log"))).unwrap()),
    );
    let base = format!("http://127.0.0.1:{port}");
    wait_for(
        Duration::from_secs(60),
        &format!("{name} ready"),
        async || match http.get(format!("{base}/-/ready")).send().await {
            Ok(r) if r.status() == 200 => Some(()),
            _ => None,
        },
    )
    .await;
    (child, base)
}

/// A child process killed (SIGKILL) and reaped when dropped.
pub struct ChildGuard(pub Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn spawn(cmd: &mut Command) -> ChildGuard {
    ChildGuard(
        cmd.stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}")),
    )
}
