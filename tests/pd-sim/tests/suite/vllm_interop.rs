//! pd-sim's vLLM wire against vLLM 0.34.0's own code (`interop/vllm_interop.py`): vLLM's
//! msgspec decoders read prefill's NIXL handshake reply, its connector metadata reads the
//! `kv_transfer_params`, `InputProcessor.assign_request_id` agrees on the internal ids, its
//! `TokenizeParams` + `create_error_response` + Starlette render the same error bytes, and
//! `CacheConfig.metrics_info()` names the `vllm:cache_config_info` labels; with
//! `--kv-connector mooncake`, vLLM's msgspec decoders read the pull and answer frames captured
//! off a tap in front of prefill's sender ROUTER (and its encoder writes the same bytes), its
//! connector metadata takes both legs' params, and its bootstrap models read `/query`.
//!
//! Needs `PD_SIM_VLLM_PYTHON`: a Python with `vllm==0.34.0` importable (`cargo xtask test`
//! builds `target/vllm-venv`: the wheel with `--no-deps` over the SGLang venv's torch), e.g.
//!   PD_SIM_VLLM_PYTHON=$PWD/target/vllm-venv/bin/python cargo test -p pd-sim --release --test suite -- --ignored vllm_interop::
//! Without it the test says so loudly and passes.

use crate::support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PD_SIM_VLLM_PYTHON pointing at a Python with vllm==0.34.0; cargo xtask test runs it"]
async fn vllm_code_accepts_pd_sims_wire() {
    let python = std::env::var("PD_SIM_VLLM_PYTHON").expect(
        "set PD_SIM_VLLM_PYTHON to a Python with vllm==0.34.0 importable (cargo xtask test \
         builds target/vllm-venv and sets it)",
    );
    let c = Cluster::start("correct", &["--flavour", "vllm", "--no-router"]).await;
    let scratch = test_harness::ScratchDir::new("vllm-interop").unwrap();
    let mooncake_json = scratch.path().join("mooncake.json");
    let (_tap, _mc) = capture_mooncake(&mooncake_json).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/interop/vllm_interop.py");
    let mut child = Command::new(&python)
        .arg(script)
        .arg(&c.prefill)
        .arg(c.ready["side_channel_port"].to_string())
        .arg(c.ready["prefill_max_model_len"].to_string())
        .arg(&mooncake_json)
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
            "cache_config_info",
            "mooncake"
        ])
    );
}

/// Two requests through a mooncake cluster (the first pull carries decode's layout, the second
/// only its id); writes what vllm_interop.py reads: the frames each way (hex), decode's ids and
/// transfer ids in pull order, both legs' params as pd-sim's router builds them, and the
/// bootstrap server's URL. The cluster stays up for the script's `/register` and `/query`.
async fn capture_mooncake(path: &std::path::Path) -> (DuplexTap, Cluster) {
    let (tap, c) = DuplexTap::mooncake_cluster("correct", "", &[]).await;
    let client = pd_sim::http::http_client(4);
    for i in 0..2 {
        let (s, _) = post(
            &client,
            &format!("{}/v1/completions", c.router),
            &format!("interop-{i}"),
            serde_json::json!({"prompt": format!("interop {i}"), "max_tokens": 2}),
        )
        .await;
        assert_eq!(s, 200);
    }
    let recs = get_json(&client, &format!("{}/sim/requests", c.decode)).await;
    let recs = recs.as_array().unwrap();
    let hex = |m: &Vec<Vec<bytes::Bytes>>| -> Vec<String> {
        m.iter()
            .map(|f| f[0].iter().map(|b| format!("{b:02x}")).collect())
            .collect()
    };
    let bootstrap = format!(
        "http://127.0.0.1:{}",
        c.ready["bootstrap_port"].as_u64().unwrap()
    );
    let first = &recs[0];
    let capture = serde_json::json!({
        "pulls": hex(&tap.up.lock().unwrap()),
        "answers": hex(&tap.down.lock().unwrap()),
        "decode_request_ids": recs.iter().map(|r| r["internal_id"].clone()).collect::<Vec<_>>(),
        "transfer_ids": recs.iter().map(|r| r["transfer_id"].clone()).collect::<Vec<_>>(),
        "bootstrap": bootstrap,
        "prefill_params": {"do_remote_decode": true, "do_remote_prefill": false,
                           "transfer_id": first["transfer_id"]},
        "decode_params": {"do_remote_decode": false, "do_remote_prefill": true,
                          "transfer_id": first["transfer_id"],
                          "remote_bootstrap_addr": bootstrap,
                          "remote_engine_id": first["remote_engine_id"]},
    });
    eprintln!(
        "mooncake pull: {}\nmooncake answer: {}",
        capture["pulls"][0], capture["answers"][0]
    );
    std::fs::write(path, capture.to_string()).unwrap();
    (tap, c)
}
