//! A Prometheus-family server (`prometheus`, `prometheus-alertmanager`, from `cargo xtask
//! setup`) on a free loopback port, for the tests that check revenant against the real ones.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use super::{Proc, eventually, free_port, spawn};

/// `bin` with its `--config.file`, `{storage_flag}=DIR/{name}-data`, log in DIR/{name}.log and
/// `extra` flags. Returns the child and its base URL once `/-/ready` answers 200 (at most 60 s).
pub async fn start_prometheus_server(
    bin: &Path,
    name: &str,
    dir: &Path,
    config: &Path,
    storage_flag: &str,
    extra: &[&str],
    http: &reqwest::Client,
) -> (Proc, String) {
    let port = free_port().unwrap();
    let child = spawn(
        name,
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
    eventually(
        &format!("{name} ready"),
        Duration::from_secs(60),
        async || match http.get(format!("{base}/-/ready")).send().await {
            Ok(r) if r.status() == 200 => Some(()),
            _ => None,
        },
    )
    .await;
    (child, base)
}
