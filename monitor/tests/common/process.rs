//! `revenant run` as a child process for end-to-end tests: started on ephemeral loopback ports
//! with its own spool and state under a fresh directory, readiness from its ready file, stopped
//! with SIGTERM (killed on drop), plus the OpenTelemetry Python SDK venv and `tests/otlp/emit.py`
//! to feed it real OTLP exports.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
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

pub struct Revenant {
    pub child: Child,
    pub dir: PathBuf,
    pub grpc: String,
    pub http: String,
    pub admin: String,
}

/// Minimal HTTP/1.1 GET (Connection: close) against the admin server; std only.
pub fn http_get(addr: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect admin");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).unwrap();
    let status = buf
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = buf.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    (status, body.to_string())
}

impl Revenant {
    pub fn start(name: &str, extra: &[&str]) -> Revenant {
        let dir =
            std::env::temp_dir().join(format!("revenant-otlp-e2e-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let ready = dir.join("ready.json");
        let events = dir.join("events.jsonl").display().to_string();
        let alerts = dir.join("alerts.jsonl").display().to_string();
        let spool = dir.join("spool").display().to_string();
        let ready_arg = ready.display().to_string();
        // Defaults a test may override by passing the flag itself. Kernel capture stays off
        // unless asked for: as root, `auto` would watch any SGLang-looking process.
        let defaults: [(&str, &str); 8] = [
            ("--otlp-grpc", "127.0.0.1:0"),
            ("--otlp-http", "127.0.0.1:0"),
            ("--admin", "127.0.0.1:0"),
            ("--ebpf", "off"),
            ("--ready-file", &ready_arg),
            ("--events-jsonl", &events),
            ("--alerts-jsonl", &alerts),
            ("--spool-dir", &spool),
        ];
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_revenant"));
        cmd.arg("run");
        for (flag, value) in defaults {
            if !extra.contains(&flag) {
                cmd.args([flag, value]);
            }
        }
        let child = cmd
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("stderr.log")).unwrap())
            .spawn()
            .expect("spawn revenant");
        let mut r = Revenant {
            child,
            dir,
            grpc: String::new(),
            http: String::new(),
            admin: String::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        let doc = loop {
            if let Ok(t) = std::fs::read_to_string(&ready) {
                break t;
            }
            if let Ok(Some(st)) = r.child.try_wait() {
                panic!("revenant exited early ({st}): {}", r.stderr());
            }
            assert!(
                Instant::now() < deadline,
                "revenant not ready in time: {}",
                r.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let v: serde_json::Value = serde_json::from_str(&doc).unwrap();
        let field = |k: &str| v[k].as_str().unwrap_or_default().to_owned();
        r.grpc = field("otlp_grpc");
        r.http = field("otlp_http");
        r.admin = field("admin");
        if !extra.contains(&"--ebpf") {
            assert_eq!(v["ebpf"], "off", "{v}");
        }
        r
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.join("stderr.log")).unwrap_or_default()
    }

    /// SIGTERM, then wait (bounded) for the drain to finish.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("revenant did not stop after SIGTERM: {}", self.stderr());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn lines(&self, file: &str) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.dir.join(file))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    pub fn emit(&self, args: &[&str]) -> (bool, serde_json::Value, String) {
        let py = venv_python();
        let mut child = Command::new(py)
            .arg(repo_root().join("tests/otlp/emit.py"))
            .args(["--grpc", &self.grpc, "--http", &self.http])
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

impl Drop for Revenant {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
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
