//! The real vllm-router 0.1.17 in front of `cluster --flavour vllm --no-router`.
//! Ignored by default: `cargo xtask test` creates target/xtask-venv-vllm-router and runs them
//! with `PD_SIM_VLLM_ROUTER` set (they fail, never skip, without it); by hand:
//!   python3 -m venv target/xtask-venv-vllm-router && target/xtask-venv-vllm-router/bin/pip install vllm-router==0.1.17
//!   PD_SIM_VLLM_ROUTER=target/xtask-venv-vllm-router/bin/vllm-router cargo test -p pd-sim --test suite -- --ignored vllm_real_router::

use crate::support;

use std::time::Duration;

use pd_sim::http::{HttpClient, http_client};
use serde_json::{Value, json};
use support::*;

async fn post(
    client: &HttpClient,
    url: &str,
    id: &str,
    body: Value,
) -> (u16, hyper::HeaderMap, String) {
    use http_body_util::{BodyExt, Full};
    let req = hyper::Request::post(url)
        .header("content-type", "application/json")
        .header("x-request-id", id)
        .body(Full::new(bytes::Bytes::from(body.to_string())))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(30), client.request(req))
        .await
        .expect("answer within 30 s")
        .expect("POST");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, headers, String::from_utf8_lossy(&body).into_owned())
}

async fn stats(client: &HttpClient, base: &str) -> Value {
    get_json(client, &format!("{base}/sim/stats")).await
}

fn authority(url: &str) -> &str {
    url.trim_start_matches("http://")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs vllm-router 0.1.17 (PD_SIM_VLLM_ROUTER); cargo xtask test runs it"]
async fn real_vllm_router_passes_a_400_through_and_hands_kv_params_to_decode() {
    let bin = vllm_router();
    let c = Cluster::start("correct", &["--flavour", "vllm", "--no-router"]).await;
    let scratch = test_harness::ScratchDir::new("vllm-router").unwrap();
    let log = scratch.path().join("vllm-router.log");
    let (_router, url) = start_vllm_router(&bin, &c, None, &log);
    let client = http_client(8);
    eventually("vllm-router healthy", Duration::from_secs(60), async || {
        matches!(get(&client, &format!("{url}/health")).await, Ok((200, _))).then_some(())
    })
    .await;

    let (s, h, body) = post(
        &client,
        &format!("{url}/v1/completions"),
        "real-ok",
        json!({"model": "pd-sim/tiny-model", "prompt": words(20), "max_tokens": 4}),
    )
    .await;
    assert_eq!(s, 200, "{body}\n{}", test_harness::tail(&log, 20));
    assert_eq!(h["x-request-id"], "real-ok");
    let v: Value = serde_json::from_str(&body).unwrap();
    let id = v["id"].as_str().unwrap();
    let prefix = format!(
        "cmpl-___prefill_addr_{}___decode_addr_{}_",
        authority(&c.prefill),
        authority(&c.decode)
    );
    let hex = id.strip_prefix(&prefix).unwrap_or_else(|| panic!("{id}"));
    assert_eq!(hex.len(), 32, "{id}");
    assert_eq!(v["usage"]["completion_tokens"], 4);

    // Prefill issued params for its internal id, decode read that KV (handshake once).
    let engine_id = format!("{id}-0");
    let preq = get_json(
        &client,
        &format!("{}/sim/requests?id={engine_id}", c.prefill),
    )
    .await;
    let preq = &preq[0];
    assert_eq!(preq["kv_params_issued"], true, "{preq}");
    assert_eq!(preq["max_tokens"], 1, "{preq}");
    eventually("prefill notified", Duration::from_secs(10), async || {
        let r = get_json(
            &client,
            &format!("{}/sim/requests?id={engine_id}", c.prefill),
        )
        .await;
        (r[0]["outcome"] == "transferred").then_some(())
    })
    .await;
    let dreq = get_json(
        &client,
        &format!("{}/sim/requests?id={engine_id}", c.decode),
    )
    .await;
    let dreq = &dreq[0];
    assert_eq!(dreq["remote_request_id"], preq["internal_id"], "{dreq}");
    assert_eq!(dreq["kv_read"], true, "{dreq}");
    assert_eq!(dreq["handshake"], true, "{dreq}");
    assert_eq!(dreq["outcome"], "generated", "{dreq}");
    assert_eq!(dreq["request_id"], &id[5..], "X on the decode leg: {dreq}");

    // Over-long: prefill's 400 passed through; decode never contacted.
    let before = stats(&client, &c.decode).await["worker"]["requests"]
        .as_u64()
        .unwrap();
    let (s, h, body) = post(
        &client,
        &format!("{url}/v1/completions"),
        "real-rej",
        json!({"model": "pd-sim/tiny-model", "prompt": words(5000), "max_tokens": 4}),
    )
    .await;
    assert_eq!(s, 400, "{body}");
    assert_eq!(h["x-request-id"], "real-rej");
    let e: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(e["error"]["type"], "BadRequestError", "{body}");
    assert_eq!(e["error"]["param"], "input_tokens", "{body}");
    assert!(e["error"]["message"].as_str().unwrap().starts_with("This model's maximum context length is 4096 tokens. However, your prompt contains at least 4097 input tokens"), "{body}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = stats(&client, &c.decode).await["worker"]["requests"]
        .as_u64()
        .unwrap();
    assert_eq!(after, before, "decode was contacted after a prefill 400");

    // Streamed chat end to end.
    let (s, _, body) = post(
        &client,
        &format!("{url}/v1/chat/completions"),
        "real-chat",
        json!({"model": "pd-sim/tiny-model", "messages": [{"role": "user", "content": words(8)}],
               "max_tokens": 3, "stream": true}),
    )
    .await;
    assert_eq!(s, 200, "{body}");
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    assert!(
        body.contains("\"id\":\"chatcmpl-___prefill_addr_"),
        "{body}"
    );
    let d = stats(&client, &c.decode).await;
    assert_eq!(d["worker"]["remote_prefills"], 2, "{d}");
    assert_eq!(d["worker"]["local_prefills"], 0, "{d}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs vllm-router 0.1.17 (PD_SIM_VLLM_ROUTER); cargo xtask test runs it"]
async fn real_vllm_router_turns_a_prefill_503_into_500() {
    let bin = vllm_router();
    let c = Cluster::start(
        "correct",
        &[
            "--flavour",
            "vllm",
            "--no-router",
            "--prefill-args",
            "--overload-share 1.0",
        ],
    )
    .await;
    let scratch = test_harness::ScratchDir::new("vllm-router-503").unwrap();
    let log = scratch.path().join("vllm-router.log");
    let (_router, url) = start_vllm_router(&bin, &c, None, &log);
    let client = http_client(8);
    eventually("vllm-router healthy", Duration::from_secs(60), async || {
        matches!(get(&client, &format!("{url}/health")).await, Ok((200, _))).then_some(())
    })
    .await;
    let (s, _, body) = post(
        &client,
        &format!("{url}/v1/completions"),
        "real-busy",
        json!({"model": "pd-sim/tiny-model", "prompt": "a b", "max_tokens": 2}),
    )
    .await;
    assert_eq!(s, 500, "{body}");
    assert!(body.contains("returned 503 Service Unavailable"), "{body}");
    let d = stats(&client, &c.decode).await;
    assert_eq!(d["worker"]["requests"], 0, "{d}");
    let p = stats(&client, &c.prefill).await;
    assert_eq!(p["worker"]["rejected_503"], 1, "one attempt, no retry: {p}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs vllm-router 0.1.17 (PD_SIM_VLLM_ROUTER); cargo xtask test runs it"]
async fn real_vllm_router_forwards_stale_kv_params_from_prefill() {
    let bin = vllm_router();
    let c = Cluster::start(
        "correct",
        &[
            "--flavour",
            "vllm",
            "--no-router",
            "--fault",
            "stale-kv-params",
            "--fault-rate",
            "1",
        ],
    )
    .await;
    let scratch = test_harness::ScratchDir::new("vllm-router-stale").unwrap();
    let log = scratch.path().join("vllm-router.log");
    let (_router, url) = start_vllm_router(&bin, &c, None, &log);
    let client = http_client(8);
    eventually("vllm-router healthy", Duration::from_secs(60), async || {
        matches!(get(&client, &format!("{url}/health")).await, Ok((200, _))).then_some(())
    })
    .await;
    let mut ids = Vec::new();
    for i in 0..2 {
        let (s, _, body) = post(
            &client,
            &format!("{url}/v1/completions"),
            &format!("stale-{i}"),
            json!({"model": "pd-sim/tiny-model", "prompt": words(6), "max_tokens": 2}),
        )
        .await;
        assert_eq!(s, 200, "{body}\n{}", test_harness::tail(&log, 20));
        let v: Value = serde_json::from_str(&body).unwrap();
        ids.push(format!("{}-0", v["id"].as_str().unwrap()));
    }
    let first = &get_json(
        &client,
        &format!("{}/sim/requests?id={}", c.prefill, ids[0]),
    )
    .await[0];
    let second = &get_json(
        &client,
        &format!("{}/sim/requests?id={}", c.prefill, ids[1]),
    )
    .await[0];
    assert!(first["fault"].is_null(), "{first}");
    assert_eq!(second["fault"], "injected-stale-kv-params", "{second}");
    assert_eq!(second["params_of"], ids[0].as_str(), "{second}");
    // The real router forwarded them: the second request's decode read the first one's KV.
    let d = &get_json(&client, &format!("{}/sim/requests?id={}", c.decode, ids[1])).await[0];
    assert_eq!(d["remote_request_id"], first["internal_id"], "{d}");
    eventually(
        "prefill counted the stale read",
        Duration::from_secs(10),
        async || {
            let s = stats(&client, &c.prefill).await;
            (s["worker"]["notifications_after_expiry"] == 1).then_some(())
        },
    )
    .await;
}
