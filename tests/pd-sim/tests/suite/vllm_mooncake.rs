//! `--flavour vllm --kv-connector mooncake`: vLLM 0.34's MooncakeConnector wire behind pd-sim's
//! router (and, ignored unless `PD_SIM_VLLM_ROUTER` is set, the real vllm-router 0.1.17 with
//! `--kv-connector mooncake`). Frames are read off a tap in front of prefill's sender ROUTER,
//! so what is checked is what a monitor would see.

use crate::support;

use std::time::{Duration, Instant};

use pd_sim::http::{HttpClient, http_client};
use pd_sim::vllm::mooncake::{self, Status, XferMetadata, XferResponse};
use serde_json::{Value, json};
use support::*;

async fn post(client: &HttpClient, url: &str, body: Value) -> (u16, String) {
    use http_body_util::{BodyExt, Full};
    let req = hyper::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(bytes::Bytes::from(body.to_string())))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(30), client.request(req))
        .await
        .expect("answer within 30 s")
        .expect("POST");
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

async fn records(client: &HttpClient, base: &str) -> Vec<Value> {
    get_json(client, &format!("{base}/sim/requests"))
        .await
        .as_array()
        .unwrap()
        .clone()
}

/// The records of prefill and decode, once every request has ended on both.
async fn settled(client: &HttpClient, c: &Cluster, n: usize) -> (Vec<Value>, Vec<Value>) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (p, d) = (
            records(client, &c.prefill).await,
            records(client, &c.decode).await,
        );
        let ended = |v: &Vec<Value>| v.iter().all(|r| r["ended_ns"].as_u64() != Some(0));
        if (p.len() >= n && ended(&p) && ended(&d)) || Instant::now() > deadline {
            return (p, d);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn by_transfer<'a>(v: &'a [Value], t: &str) -> &'a Value {
    v.iter()
        .find(|r| r["transfer_id"] == t)
        .unwrap_or_else(|| panic!("no record of {t}: {v:?}"))
}

fn long_prompt(words: usize) -> String {
    vec!["w"; words].join(" ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mooncake_pulls_once_per_request_with_vllms_frames() {
    let (tap, c) = DuplexTap::mooncake_cluster("correct", "", &[]).await;
    let client = http_client(8);
    let url = format!("{}/v1/completions", c.router);
    for i in 0..3 {
        let (s, b) = post(
            &client,
            &url,
            json!({"model": "m", "prompt": format!("hello number {i}"), "max_tokens": 3, "stream": i == 2}),
        )
        .await;
        assert_eq!(s, 200, "{b}");
    }
    let (s, b) = post(
        &client,
        &format!("{}/v1/chat/completions", c.router),
        json!({"model": "m", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2}),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    let (p, d) = settled(&client, &c, 4).await;
    assert_eq!(d.len(), 4, "{d:?}");
    for dr in &d {
        let t = dr["transfer_id"]
            .as_str()
            .expect("decode knows the transfer");
        assert!(t.starts_with("xfer-") && t.len() == 41, "{t}");
        let pr = by_transfer(&p, t);
        // One request, one transfer id on both legs; prefill was pulled by decode's internal id.
        assert_eq!(pr["request_id"], dr["request_id"]);
        assert_eq!(pr["pull_request_id"], dr["internal_id"], "{pr}");
        assert_eq!(pr["remote_engine_id"], Value::Null);
        assert_eq!(dr["remote_engine_id"].as_str().map(str::len), Some(36));
        for r in [pr, dr] {
            assert_eq!(r["pull_status"], "FINISH", "{r}");
            assert_eq!(r["pull_ok"], true, "{r}");
            assert_eq!(r["pulls"], 1, "{r}");
        }
        assert_eq!(pr["outcome"], "transferred");
        assert_eq!(dr["kv_read"], true);
        assert_eq!(dr["outcome"], "generated");
    }
    // Only the first request queried the bootstrap server.
    assert_eq!(d.iter().filter(|r| r["handshake"] == true).count(), 1);
    // The wire: one frame per pull, one answer per pull, vLLM's Structs.
    let up = tap.up.lock().unwrap().clone();
    let down = tap.down.lock().unwrap().clone();
    assert_eq!((up.len(), down.len()), (4, 4), "{up:?} {down:?}");
    for (i, (m, a)) in up.iter().zip(&down).enumerate() {
        assert_eq!(
            (m.len(), a.len()),
            (1, 1),
            "one frame each way, no delimiter"
        );
        let meta = XferMetadata::decode(&m[0]).unwrap();
        assert_eq!(meta.req_blocks.len(), 1);
        let rb = &meta.req_blocks[0];
        let dr = d
            .iter()
            .find(|r| r["internal_id"] == rb.decode_request_id.as_str())
            .expect("the pull names decode's internal id");
        assert_eq!(dr["transfer_id"], rb.transfer_id.as_str());
        // The layout goes with the first pull only; prefill echoed its id.
        assert_eq!(meta.layout.is_some(), i == 0, "pull {i}");
        assert_ne!(meta.layout_id % 2, 0);
        let ans = XferResponse::decode(&a[0]).unwrap();
        assert_eq!(ans.status, Status::Finish);
        assert_eq!(ans.ok_reqs, Some(vec![rb.decode_request_id.clone()]));
        assert_eq!(
            (ans.err_reqs.as_ref(), ans.layout_id),
            (None, meta.layout_id)
        );
    }
    let ps = get_json(&client, &format!("{}/sim/stats", c.prefill)).await;
    assert_eq!(ps["worker"]["kv_transfers"], 4, "{ps}");
    assert_eq!(ps["kv_holds"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mooncake_correct_router_never_sends_decode_a_refused_transfer() {
    let (tap, c) = DuplexTap::mooncake_cluster("correct", "", &[]).await;
    let client = http_client(8);
    let (s, b) = post(
        &client,
        &format!("{}/v1/completions", c.router),
        json!({"model": "m", "prompt": long_prompt(5000), "max_tokens": 3}),
    )
    .await;
    assert_eq!(s, 400, "{b}");
    let (p, d) = settled(&client, &c, 1).await;
    assert!(d.is_empty(), "decode got a leg: {d:?}");
    assert_eq!(p[0]["status"], 400);
    assert!(p[0]["transfer_id"].as_str().unwrap().starts_with("xfer-"));
    assert_eq!(p[0]["pull_status"], Value::Null);
    assert!(tap.up.lock().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mooncake_handoff_after_reject_pulls_the_refused_transfer() {
    let (tap, c) = DuplexTap::mooncake_cluster(
        "handoff-after-reject",
        "",
        &["--mooncake-abort-request-timeout-secs", "1"],
    )
    .await;
    let client = http_client(8);
    let (s, b) = post(
        &client,
        &format!("{}/v1/completions", c.router),
        json!({"model": "m", "prompt": long_prompt(5000), "max_tokens": 3}),
    )
    .await;
    // Decode's answer: its pull failed, so the request fails (kv_load_failure_policy fail).
    assert_eq!(s, 500, "{b}");
    let (p, d) = settled(&client, &c, 1).await;
    let pr = &p[0];
    let dr = &d[0];
    assert_eq!(pr["status"], 400);
    assert_eq!(pr["transfer_id"], dr["transfer_id"]);
    assert_eq!(pr["pull_request_id"], dr["internal_id"]);
    for r in [pr, dr] {
        assert_eq!(r["pull_status"], "FINISH", "{r}");
        assert_eq!(r["pull_ok"], false);
        assert_eq!(r["pull_err_msg"], mooncake::NOT_READY);
    }
    assert_eq!(dr["outcome"], "kv-failed");
    let down = tap.down.lock().unwrap().clone();
    let ans = XferResponse::decode(&down[0][0]).unwrap();
    assert_eq!(ans.status, Status::Finish);
    assert_eq!(
        ans.err_reqs,
        Some(vec![dr["internal_id"].as_str().unwrap().to_owned()])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mooncake_pull_error_fails_decode_and_the_blocks_expire() {
    let (tap, c) = DuplexTap::mooncake_cluster(
        "correct",
        "--kv-lease-ms 300",
        &["--fault", "mooncake-pull-error", "--fault-rate", "1"],
    )
    .await;
    let client = http_client(8);
    let (s, b) = post(
        &client,
        &format!("{}/v1/completions", c.router),
        json!({"model": "m", "prompt": "a b c", "max_tokens": 3}),
    )
    .await;
    assert_eq!(s, 500, "{b}");
    tokio::time::sleep(Duration::from_millis(600)).await;
    let (p, d) = settled(&client, &c, 1).await;
    let (pr, dr) = (&p[0], &d[0]);
    assert_eq!(pr["fault"], "injected-mooncake-pull-error");
    assert_eq!(pr["outcome"], "lease-expired", "{pr}");
    for r in [pr, dr] {
        assert_eq!(r["pull_ok"], false, "{r}");
        assert_eq!(r["pull_err_msg"], mooncake::ENGINE_FAILED);
    }
    assert_eq!(dr["outcome"], "kv-failed");
    let ans = XferResponse::decode(&tap.down.lock().unwrap()[0][0]).unwrap();
    assert_eq!(
        ans.err_reqs,
        Some(vec![dr["internal_id"].as_str().unwrap().to_owned()])
    );
    assert_eq!(ans.ok_reqs, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mooncake_cluster_serves_openai_load() {
    let c = Cluster::start(
        "correct",
        &["--flavour", "vllm", "--kv-connector", "mooncake"],
    )
    .await;
    let s = tokio::task::block_in_place(|| {
        run_load(
            &c.router,
            &[
                "--api",
                "openai",
                "--rate",
                "200",
                "--requests",
                "150",
                "--stream-share",
                "0.3",
                "--chat-share",
                "0.2",
                "--seed",
                "5",
            ],
        )
    });
    assert_eq!(s["errors"], 0, "{s}");
    assert_eq!(s["ok"], 150, "{s}");
    let client = http_client(8);
    let ps = get_json(&client, &format!("{}/sim/stats", c.prefill)).await;
    assert_eq!(ps["worker"]["kv_transfers"], 150, "{ps}");
    assert_eq!(ps["worker"]["pull_errors"], 0, "{ps}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs vllm-router 0.1.17 (PD_SIM_VLLM_ROUTER); cargo xtask test runs it"]
async fn real_vllm_router_drives_mooncake_pulls() {
    let bin = vllm_router();
    let (tap, c) = DuplexTap::mooncake_cluster("correct", "", &["--no-router"]).await;
    let scratch = test_harness::ScratchDir::new("vllm-router-mooncake").unwrap();
    let log = scratch.path().join("vllm-router.log");
    let (_router, url) = start_vllm_router(
        &bin,
        &c,
        Some(c.ready["bootstrap_port"].as_u64().unwrap()),
        &log,
    );
    let client = http_client(8);
    let deadline = Instant::now() + Duration::from_secs(60);
    while get(&client, &format!("{url}/health")).await.map(|r| r.0) != Ok(200) {
        assert!(
            Instant::now() < deadline,
            "vllm-router not healthy: {}",
            test_harness::tail(&log, 20)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for i in 0..2 {
        let (s, b) = post(
            &client,
            &format!("{url}/v1/completions"),
            json!({"model": "m", "prompt": format!("real router {i}"), "max_tokens": 3}),
        )
        .await;
        assert_eq!(s, 200, "{b}");
    }
    // A refusal is passed through; decode never gets that leg.
    let (s, b) = post(
        &client,
        &format!("{url}/v1/completions"),
        json!({"model": "m", "prompt": long_prompt(5000), "max_tokens": 3}),
    )
    .await;
    assert_eq!(s, 400, "{b}");
    let (p, d) = settled(&client, &c, 3).await;
    assert_eq!(d.len(), 2, "{d:?}");
    for dr in &d {
        let pr = by_transfer(&p, dr["transfer_id"].as_str().unwrap());
        assert!(pr["transfer_id"].as_str().unwrap().starts_with("xfer-"));
        assert_eq!(pr["pull_request_id"], dr["internal_id"]);
        assert_eq!(
            (&pr["pull_ok"], &dr["pull_ok"]),
            (&json!(true), &json!(true))
        );
    }
    assert_eq!(tap.up.lock().unwrap().len(), 2);
    let refused = p.iter().find(|r| r["status"] == 400).expect("the refusal");
    assert!(
        refused["transfer_id"]
            .as_str()
            .unwrap()
            .starts_with("xfer-")
    );
    assert_eq!(refused["pull_status"], Value::Null);
}
