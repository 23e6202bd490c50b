//! `revenant run` for this crate's end-to-end tests (the process itself is
//! `test_harness::Revenant`), plus the OpenTelemetry Python SDK venv and `tests/otlp/emit.py`
//! to feed it real OTLP exports.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Creates (once) the venv with the OpenTelemetry SDK and exporters; idempotent.
pub fn venv_python() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"));
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

/// This crate's `revenant run` (see [`test_harness::Revenant`]) with its files under a fresh
/// directory named after the test, the normalized events in `events.jsonl` too.
pub struct Revenant(test_harness::Revenant);

impl std::ops::Deref for Revenant {
    type Target = test_harness::Revenant;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for Revenant {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

/// Minimal HTTP/1.1 GET against the admin server.
pub fn http_get(addr: &str, path: &str) -> (u16, String) {
    test_harness::http_get(&format!("http://{addr}{path}")).expect("GET from the admin server")
}

impl Revenant {
    /// Ready within 20 s or panics; `extra` overrides the harness's defaults flag by flag.
    pub fn start(name: &str, extra: &[&str]) -> Revenant {
        let dir =
            std::env::temp_dir().join(format!("revenant-otlp-e2e-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let events = dir.join("events.jsonl").display().to_string();
        let mut args = extra.to_vec();
        if !extra.contains(&"--events-jsonl") {
            args.extend(["--events-jsonl", &events]);
        }
        let r = test_harness::Revenant::start_within(
            Path::new(env!("CARGO_BIN_EXE_revenant")),
            &dir,
            &args,
            Duration::from_secs(20),
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
        if !extra.contains(&"--ebpf") {
            assert_eq!(r.ready["ebpf"], "off", "{}", r.ready);
        }
        Revenant(r)
    }

    pub fn stderr(&self) -> String {
        self.log_text()
    }

    /// SIGTERM, then wait (at most 20 s) for the drain to finish.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        self.0
            .stop_within(Duration::from_secs(20))
            .unwrap_or_else(|e| panic!("{e:#}"))
    }

    /// Every line of one of its JSON Lines files (`alerts.jsonl`, `events.jsonl`).
    pub fn lines(&self, file: &str) -> Vec<serde_json::Value> {
        test_harness::read_jsonl(&self.dir.join(file)).unwrap_or_else(|e| panic!("{e:#}"))
    }

    pub fn emit(&self, args: &[&str]) -> (bool, serde_json::Value, String) {
        let py = venv_python();
        let mut child = Command::new(py)
            .arg(repo_root().join("tests/otlp/emit.py"))
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

/// A `/api/requests/{alias}` timeline shows the disclosed shape: prefill rejected, decode worked.
pub fn assert_rejected_then_decoded(timeline: &serde_json::Value) {
    let kinds: Vec<String> = timeline["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            format!(
                "{}/{}",
                e["stage"].as_str().unwrap(),
                e["kind"].as_str().unwrap()
            )
        })
        .collect();
    assert!(
        kinds.iter().any(|k| k == "prefill/rejected") && kinds.iter().any(|k| k == "decode/work"),
        "{timeline}"
    );
}
