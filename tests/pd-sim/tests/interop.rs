//! pd-sim's wire protocol against real libzmq (pyzmq) and SGLang 0.5.23's own code: a standalone
//! prefill and decode, and `interop/zmq_interop.py` playing their peers (see its docstring).
//! Ignored by default: they need a Python.
//!
//! With pyzmq alone (`cargo xtask test` sets PD_SIM_PYTHON to such a venv):
//!   python3 -m venv /tmp/zmqvenv && /tmp/zmqvenv/bin/pip install pyzmq
//!   PD_SIM_PYTHON=/tmp/zmqvenv/bin/python cargo test -p pd-sim --test interop -- --ignored
//! With SGLang's builders, parsers and prefill bootstrap thread (a venv with `sglang==0.5.23`,
//! which brings pyzmq, numpy, msgspec, torch):
//!   PD_SIM_SGLANG_PYTHON=/path/to/sglang-venv/bin/python \
//!     cargo test -p pd-sim --test interop -- --ignored sglang

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

struct Proc(Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A standalone worker on ephemeral ports and its READY object.
fn worker(role: &str, extra: &[&str]) -> (Proc, serde_json::Value) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_pd-sim"))
        .args([role, "--port", "0", "--kv-port", "0"])
        .args(extra)
        .env("PD_SIM_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn worker");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let ready = serde_json::from_str(line.trim().strip_prefix("READY ").expect("READY")).unwrap();
    (Proc(child), ready)
}

fn run(python: &str, extra: &[&str]) -> serde_json::Value {
    let (_prefill, p) = worker(
        "prefill",
        &[
            "--disaggregation-bootstrap-port",
            "0",
            "--max-req-input-len",
            "100",
        ],
    );
    let (_decode, d) = worker("decode", &["--te-port", "0"]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/interop/zmq_interop.py");
    let mut py = Proc(
        Command::new(python)
            .arg(script)
            .arg(p["http"].as_str().unwrap())
            .arg(p["bootstrap_port"].to_string())
            .arg(d["http"].as_str().unwrap())
            .args(extra)
            .stdout(Stdio::piped())
            .spawn()
            .expect("run python"),
    );
    // SGLang's import alone takes ~15 s on this box.
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(s) = py.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "python interop timed out"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut out = String::new();
    py.0.stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert!(status.success(), "interop script failed: {out}");
    serde_json::from_str(out.trim().lines().last().unwrap_or("")).unwrap()
}

#[test]
#[ignore = "needs PD_SIM_PYTHON pointing at a Python with pyzmq"]
fn pyzmq_interop() {
    let python =
        std::env::var("PD_SIM_PYTHON").expect("set PD_SIM_PYTHON to a Python with pyzmq installed");
    let v = run(&python, &[]);
    assert_eq!(v["prefill"], "ok");
    assert_eq!(v["decode"], "ok");
    // Two KV buffers and the metadata slot.
    assert_eq!(v["kv_blocks"], 3);
}

#[test]
#[ignore = "needs PD_SIM_SGLANG_PYTHON pointing at a Python with sglang==0.5.23"]
fn sglang_builders_parsers_and_bootstrap_thread_interop() {
    let python = std::env::var("PD_SIM_SGLANG_PYTHON")
        .expect("set PD_SIM_SGLANG_PYTHON to a Python with sglang==0.5.23 installed");
    let v = run(&python, &["--require-sglang"]);
    assert_eq!(v["sglang"], true);
    assert_eq!(v["prefill"], "ok");
    assert_eq!(v["decode"], "ok");
}
