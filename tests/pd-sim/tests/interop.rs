//! ZMTP interop with real libzmq through pyzmq. Needs a Python with pyzmq, so it is ignored
//! by default; run it with:
//!   python3 -m venv /tmp/zmqvenv && /tmp/zmqvenv/bin/pip install pyzmq
//!   PD_SIM_PYTHON=/tmp/zmqvenv/bin/python cargo test -p pd-sim --test interop -- --ignored

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

#[test]
#[ignore = "needs PD_SIM_PYTHON pointing at a Python with pyzmq"]
fn pyzmq_interop() {
    let python =
        std::env::var("PD_SIM_PYTHON").expect("set PD_SIM_PYTHON to a Python with pyzmq installed");
    let mut prefill = Command::new(env!("CARGO_BIN_EXE_pd-sim"))
        .args([
            "prefill",
            "--port",
            "0",
            "--disaggregation-bootstrap-port",
            "0",
            "--kv-port",
            "0",
        ])
        .args([
            "--transfer-after-reject",
            "--max-req-input-len",
            "100",
            "--kv-bytes-per-token",
            "64",
        ])
        .env("PD_SIM_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn prefill");
    let mut line = String::new();
    BufReader::new(prefill.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let ready: serde_json::Value =
        serde_json::from_str(line.trim().strip_prefix("READY ").expect("READY")).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/interop/zmq_interop.py");
    let mut py = Command::new(python)
        .arg(script)
        .arg(ready["http"].as_str().unwrap())
        .arg(ready["kv_port"].to_string())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run python");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = py.try_wait().unwrap() {
            break Some(s);
        }
        if std::time::Instant::now() > deadline {
            let _ = py.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = prefill.kill();
    let _ = prefill.wait();
    let status = status.expect("python interop timed out");
    let mut out = String::new();
    std::io::Read::read_to_string(&mut py.stdout.take().unwrap(), &mut out).unwrap();
    assert!(status.success(), "interop script failed: {out}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    // 5000 tokens * 64 bytes = 320000 bytes = 5 chunks of at most 64 KiB.
    assert_eq!(v["kv_chunks"], 5);
}
