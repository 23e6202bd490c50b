//! The `revenant run` binary's contract: what it validates before it binds a port, its exit codes,
//! its standard error (human and JSON), its signals. Run: `cargo test -p revenant --test run_cli`.

mod support;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use support::*;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_revenant"))
}

/// A fresh directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("revenant-run-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Loopback ports this test holds open: a `run` that binds them before it fails its
/// validation reports "Address already in use" instead of the validation error.
struct HeldPorts(Vec<TcpListener>);

impl HeldPorts {
    fn new() -> HeldPorts {
        HeldPorts(
            (0..3)
                .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
                .collect(),
        )
    }

    fn addr(&self, i: usize) -> String {
        self.0[i].local_addr().unwrap().to_string()
    }

    /// `--admin`, `--otlp-grpc`, `--otlp-http` on the held ports.
    fn flags(&self) -> Vec<String> {
        vec![
            "--admin".into(),
            self.addr(0),
            "--otlp-grpc".into(),
            self.addr(1),
            "--otlp-http".into(),
            self.addr(2),
        ]
    }
}

/// `revenant run --ebpf off` with `args` on the held ports; its output once it exited by itself.
fn run_on_held_ports(dir: &Path, args: &[&str]) -> (Option<i32>, String) {
    let held = HeldPorts::new();
    let out: Output = bin()
        .arg("run")
        .args(["--ebpf", "off", "--alerts-jsonl"])
        .arg(dir.join("alerts.jsonl"))
        .args(held.flags())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !err.contains("already in use") && !err.contains("listening"),
        "it bound a port before failing:\n{err}"
    );
    assert!(
        !err.contains("revenant: ready"),
        "it said ready before failing:\n{err}"
    );
    (out.status.code(), err)
}

#[test]
fn a_second_instance_on_the_same_spool_fails_before_binding() {
    let dir = scratch("spool-in-use");
    let spool = dir.join("spool");
    let spool_arg = spool.to_str().unwrap();
    let mut first = Revenant::start("spool-in-use-first", &["--spool-dir", spool_arg]);
    let (code, err) = run_on_held_ports(&dir, &["--spool-dir", spool_arg]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(&format!("spool directory {spool_arg} is in use")),
        "{err}"
    );
    assert!(first.stop().success());
}

#[test]
fn a_spool_dir_that_is_a_file_fails_before_binding_naming_it() {
    let dir = scratch("spool-file");
    let file = dir.join("empty.jsonl");
    std::fs::write(&file, "").unwrap();
    let (code, err) = run_on_held_ports(&dir, &["--spool-dir", file.to_str().unwrap()]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(&format!("{} is not a directory", file.display())),
        "{err}"
    );
}

#[test]
fn a_ready_file_in_a_missing_directory_fails_before_binding_naming_it() {
    let dir = scratch("ready-missing");
    let ready = dir.join("no/such/dir/ready.json");
    let spool = dir.join("spool");
    let (code, err) = run_on_held_ports(
        &dir,
        &[
            "--spool-dir",
            spool.to_str().unwrap(),
            "--ready-file",
            ready.to_str().unwrap(),
        ],
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(&format!("--ready-file {}", ready.display())),
        "{err}"
    );
}

#[test]
fn events_jsonl_in_a_missing_directory_is_a_config_error_before_binding() {
    let dir = scratch("events-missing");
    let events = dir.join("no/such/dir/a.jsonl");
    let spool = dir.join("spool");
    let (code, err) = run_on_held_ports(
        &dir,
        &[
            "--spool-dir",
            spool.to_str().unwrap(),
            "--events-jsonl",
            events.to_str().unwrap(),
        ],
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(&format!("--events-jsonl {}", events.display())),
        "{err}"
    );
}
