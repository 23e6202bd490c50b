//! The real sglang-router 0.3.2 (`smg`) in front of the simulator's prefill and decode.
//! Needs the wheel, so it is ignored by default; run it with:
//!   python3 -m venv /tmp/smgvenv && /tmp/smgvenv/bin/pip install sglang-router==0.3.2
//!   PD_SIM_SMG=/tmp/smgvenv/bin/smg cargo test -p pd-sim --test suite -- --ignored sglang_router::

use crate::support;

use std::collections::HashSet;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use pd_sim::http::http_client;
use serde_json::json;
use support::*;

struct Smg(Child);
impl Drop for Smg {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs PD_SIM_SMG pointing at the sglang-router 0.3.2 `smg` binary"]
async fn real_smg_keeps_the_decode_leg_of_a_rejected_request_and_retries_with_new_rooms() {
    let smg = test_harness::router_from_env("PD_SIM_SMG", "sglang-router 0.3.2");
    let c = Cluster::start(
        "correct",
        &["--no-router", "--decode-args", "--kv-timeout-ms 300"],
    )
    .await;
    let port = free_port();
    let router = format!("http://127.0.0.1:{port}");
    let _smg = Smg(Command::new(smg)
        .args([
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--pd-disaggregation",
        ])
        .args([
            "--prefill",
            &c.prefill,
            &c.ready["bootstrap_port"].to_string(),
            "--decode",
            &c.decode,
        ])
        .args([
            "--prometheus-port",
            &free_port().to_string(),
            "--retry-initial-backoff-ms",
            "10",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn smg"));
    let client = http_client(8);
    wait_healthy(&client, &router).await;
    let (status, _) = post(
        &client,
        &format!("{router}/generate"),
        "smg-ok",
        json!({"text": "a b c"}),
    )
    .await;
    assert_eq!(status, 200);
    let (status, body) = post(
        &client,
        &format!("{router}/generate"),
        "smg-rej",
        json!({"text": words(5000)}),
    )
    .await;
    assert_ne!(status, 200, "{}", String::from_utf8_lossy(&body));
    let prefill = rooms(&client, &c.prefill).await;
    let attempts: Vec<_> = prefill
        .iter()
        .filter(|r| r["request_id"] == "smg-rej")
        .collect();
    assert!(!attempts.is_empty());
    assert!(attempts.iter().all(|r| r["status"] == 400), "{attempts:?}");
    // The decode leg was never cancelled: decode published its destinations to prefill for
    // every rejected room (and prefill, which opened no sender, moved no KV).
    assert!(
        attempts
            .iter()
            .all(|r| r["destinations_received"] == 1 && r["kv_bytes_sent"] == 0),
        "{attempts:?}"
    );
    let rooms_p: HashSet<u64> = attempts
        .iter()
        .map(|r| r["room"].as_u64().unwrap())
        .collect();
    assert_eq!(
        rooms_p.len(),
        attempts.len(),
        "a new bootstrap_room per attempt"
    );
    let decode = eventually("decode legs settle", Duration::from_secs(10), || {
        let (client, url) = (client.clone(), c.decode.clone());
        async move {
            let d: Vec<_> = rooms(&client, &url)
                .await
                .into_iter()
                .filter(|r| r["request_id"] == "smg-rej")
                .collect();
            d.iter().all(|r| r["outcome"] == "kv-failed").then_some(d)
        }
    })
    .await;
    let rooms_d: HashSet<u64> = decode.iter().map(|r| r["room"].as_u64().unwrap()).collect();
    assert_eq!(rooms_d, rooms_p);
    eprintln!(
        "smg made {} attempts for the rejected request; client got {status}",
        attempts.len()
    );
}
