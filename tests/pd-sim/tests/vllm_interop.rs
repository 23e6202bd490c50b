//! pd-sim's vLLM wire against vLLM 0.34.0's own code (`interop/vllm_interop.py`): vLLM's
//! msgspec decoders read prefill's NIXL handshake reply, its connector metadata reads the
//! `kv_transfer_params`, `InputProcessor.assign_request_id` agrees on the internal ids, its
//! `TokenizeParams` + `create_error_response` + Starlette render the same error bytes, and
//! `CacheConfig.metrics_info()` names the `vllm:cache_config_info` labels.
//!
//! Needs `PD_SIM_VLLM_PYTHON`: a Python with `vllm==0.34.0` importable (`cargo xtask test`
//! builds `target/vllm-venv`: the wheel with `--no-deps` over the SGLang venv's torch), e.g.
//!   PD_SIM_VLLM_PYTHON=$PWD/target/vllm-venv/bin/python cargo test -p pd-sim --release --test vllm_interop
//! Without it the test says so loudly and passes.

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_code_accepts_pd_sims_wire() {
    let Ok(python) = std::env::var("PD_SIM_VLLM_PYTHON") else {
        eprintln!(
            "\n*** vllm_interop SKIPPED: PD_SIM_VLLM_PYTHON is unset; pd-sim's vLLM wire was NOT \
             checked against vLLM's code (cargo xtask test sets it) ***\n"
        );
        return;
    };
    let c = Cluster::start("correct", &["--flavour", "vllm", "--no-router"]).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/interop/vllm_interop.py");
    let mut child = Command::new(&python)
        .arg(script)
        .arg(&c.prefill)
        .arg(c.ready["side_channel_port"].to_string())
        .arg(c.ready["prefill_max_model_len"].to_string())
        .env_remove("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("run python");
    // vLLM's imports (torch among them) take ~20 s on a busy 2-core box.
    let deadline = Instant::now() + Duration::from_secs(240);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("vllm_interop.py did not finish within 240 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let mut out = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut out).unwrap();
    let last = out.lines().last().unwrap_or("");
    assert!(status.success(), "vllm_interop.py: {status}: {out}");
    let v: serde_json::Value = serde_json::from_str(last).expect("a JSON verdict");
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(
        v["checked"],
        serde_json::json!([
            "kv_transfer_params",
            "request_ids",
            "nixl_handshake",
            "error_bodies",
            "cache_config_info"
        ])
    );
}
