//! Real OTLP exports for this crate's end-to-end tests: the OpenTelemetry Python SDK in a venv
//! under target/ (created on first use, like a build artifact) and `tests/otlp/emit.py`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{Revenant, workspace_root};

/// Creates (once) the venv with the OpenTelemetry SDK and exporters; idempotent.
pub fn venv_python() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"));
    let venv = target.join("otlp-venv");
    let py = venv.join("bin/python");
    let probe = |py: &Path| {
        Command::new(py)
            .args([
                "-c",
                "import opentelemetry.sdk, opentelemetry.exporter.otlp.proto.grpc.trace_exporter, opentelemetry.exporter.otlp.proto.http.trace_exporter",
            ])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if py.exists() && probe(&py) {
        return py;
    }
    // Tests run in parallel; a lock directory serializes creating the venv.
    let _ = std::fs::create_dir_all(&target);
    let lock = target.join("otlp-venv.lock");
    let deadline = Instant::now() + Duration::from_secs(600);
    while std::fs::create_dir(&lock).is_err() {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for another test to build the venv"
        );
        std::thread::sleep(Duration::from_millis(200));
        if py.exists() && probe(&py) {
            return py;
        }
    }
    let ok = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .status()
        .is_ok_and(|s| s.success())
        && Command::new(venv.join("bin/pip"))
            .args([
                "install",
                "-q",
                "opentelemetry-sdk==1.45.2",
                "opentelemetry-exporter-otlp-proto-grpc==1.45.2",
                "opentelemetry-exporter-otlp-proto-http==1.45.2",
            ])
            .status()
            .is_ok_and(|s| s.success());
    let _ = std::fs::remove_dir(&lock);
    assert!(
        ok && probe(&py),
        "could not create the OpenTelemetry test venv at {}",
        venv.display()
    );
    py
}

impl Revenant {
    /// Runs `tests/otlp/emit.py {args}` against its OTLP listeners: success, the last stdout
    /// line as JSON, stderr.
    pub fn emit(&self, args: &[&str]) -> (bool, serde_json::Value, String) {
        self.emit_with_env(args, &[])
    }

    /// [`Revenant::emit`] with `env` set for the exporters (`OTEL_EXPORTER_OTLP_*`).
    pub fn emit_with_env(
        &self,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> (bool, serde_json::Value, String) {
        let py = venv_python();
        let mut cmd = Command::new(py);
        if !env.is_empty() {
            // requests lets these override the exporter's own CA file
            // (OTEL_EXPORTER_OTLP_CERTIFICATE): a machine that sets them would test its bundle.
            cmd.env_remove("REQUESTS_CA_BUNDLE")
                .env_remove("CURL_CA_BUNDLE");
        }
        let mut child = cmd
            .envs(env.iter().copied())
            .arg(workspace_root().join("tests/otlp/emit.py"))
            .args(["--grpc", &self.otlp_grpc, "--http", &self.otlp_http])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(120);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("emit.py timed out");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        let v = stdout
            .lines()
            .last()
            .and_then(|l| serde_json::from_str(l).ok())
            .unwrap_or(serde_json::Value::Null);
        (out.status.success(), v, stderr)
    }
}
