//! What this crate's integration tests share: everything of `test_harness` (processes on
//! loopback, bounded waits, metrics), this crate's `revenant run` under a fresh directory, and
//! one module per kind of test: `alerts` (violations and a recording webhook receiver, shared
//! with the alert_delivery bench), `prometheus` (Prometheus and Alertmanager servers), `ebpf`
//! (the live eBPF source and checker in-process), `inputs` (the scenario files and a generated
//! request-level stream) and `otlp_venv` (real OTLP exports from the
//! Python SDK). System programs come from `cargo xtask setup`: a test installs nothing.
#![allow(dead_code)]

pub mod alerts;
pub mod cluster;
pub mod ebpf;
pub mod inputs;
pub mod otlp_venv;
pub mod prometheus;

pub use test_harness::*;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// `cmd` (stdin from /dev/null) as a child that is killed at once when dropped, and dies with
/// the test (see [`Proc`]); panics when it cannot start.
pub fn spawn(name: &str, cmd: &mut Command) -> Proc {
    Proc::spawn(name, cmd.stdin(Stdio::null()))
        .unwrap_or_else(|e| panic!("{e:#}"))
        .with_grace(Duration::ZERO)
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

/// Minimal HTTP/1.1 GET against the admin server at `addr`.
pub fn admin_get(addr: &str, path: &str) -> (u16, String) {
    http_get(&format!("http://{addr}{path}")).expect("GET from the admin server")
}

impl Revenant {
    /// Ready within 20 s or panics; `extra` overrides the harness's defaults flag by flag.
    pub fn start(name: &str, extra: &[&str]) -> Revenant {
        let dir =
            std::env::temp_dir().join(format!("revenant-otlp-e2e-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let r = test_harness::Revenant::start_recording(
            Path::new(env!("CARGO_BIN_EXE_revenant")),
            &dir,
            extra,
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
        read_jsonl(&self.dir.join(file)).unwrap_or_else(|e| panic!("{e:#}"))
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
