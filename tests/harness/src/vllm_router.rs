//! The real vllm-router in front of pd-sim's vLLM workers, started through
//! `tests/e2e/scripts/vllm_router_traced.py` so that its OTLP tracing (no CLI flag; its Python
//! API) can be on.

use std::fs::File;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};

use crate::binaries::workspace_root;
use crate::files::tail;
use crate::http::{free_port, wait_healthy};
use crate::proc::Proc;

/// A running vllm-router; dropping it stops it.
pub struct VllmRouter {
    pub proc: Proc,
    /// Its base URL.
    pub url: String,
}

impl VllmRouter {
    /// `python` is the interpreter of a venv with vllm-router (`PD_SIM_VLLM_ROUTER_PYTHON`);
    /// `trace` the OTLP/gRPC endpoint (`host:port`) its spans go to, none for no tracing;
    /// `mooncake` prefill's bootstrap port when the workers run MooncakeConnector
    /// (`--kv-connector mooncake`, `--prefill URL PORT`), none for NIXL. Its stdout goes to
    /// `log`, stderr to `log` with the extension `err`. Returns once its `/health` answers 200
    /// (at most 60 s).
    pub fn start(
        python: &Path,
        (prefill, decode): (&str, &str),
        mooncake: Option<u16>,
        trace: Option<&str>,
        log: &Path,
    ) -> Result<VllmRouter> {
        let script = workspace_root().join("tests/e2e/scripts/vllm_router_traced.py");
        let port = free_port()?;
        let prom = free_port()?;
        let err_log = log.with_extension("err");
        let mut cmd = Command::new(python);
        cmd.arg(script)
            .arg(trace.unwrap_or("off"))
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args([
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                &prom.to_string(),
            ])
            .args(["--vllm-pd-disaggregation", "--policy", "round_robin"])
            .args(["--prefill", prefill]);
        if let Some(port) = mooncake {
            cmd.arg(port.to_string())
                .args(["--kv-connector", "mooncake"]);
        }
        cmd.args(["--decode", decode])
            .stdin(Stdio::null())
            .stdout(File::create(log)?)
            .stderr(File::create(&err_log)?);
        let proc = Proc::spawn("vllm-router", &mut cmd)?;
        let url = format!("http://127.0.0.1:{port}");
        wait_healthy(&url, Duration::from_secs(60)).with_context(|| {
            format!("vllm-router not healthy; its log:\n{}", tail(&err_log, 20))
        })?;
        Ok(VllmRouter { proc, url })
    }

    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }
}
