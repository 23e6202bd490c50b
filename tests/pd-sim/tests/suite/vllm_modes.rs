//! The vLLM flavour end to end (`cluster --flavour vllm` on ephemeral loopback ports):
//! router modes and faults, the kv_transfer_params exchange, the NIXL handshake (once per
//! engine pair) and notifications, the length rules and error bodies, the HTTP shapes,
//! cancellation at decode, and the OTLP spans.

use crate::support;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use pd_sim::http::{HttpClient, http_client};
use serde_json::{Value, json};
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SLOW_OK: &str = "--kv-timeout-ms 60000 --bootstrap-timeout-ms 60000";

async fn vllm_cluster(mode: &str, extra: &[&str]) -> Cluster {
    let mut args = vec!["--flavour", "vllm"];
    args.extend_from_slice(extra);
    Cluster::start(mode, &args).await
}

async fn stats(client: &HttpClient, base: &str) -> Value {
    get_json(client, &format!("{base}/sim/stats")).await
}

async fn requests(client: &HttpClient, base: &str) -> Vec<Value> {
    get_json(client, &format!("{base}/sim/requests"))
        .await
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

async fn post_full(
    client: &HttpClient,
    url: &str,
    request_id: Option<&str>,
    body: Value,
) -> (u16, hyper::HeaderMap, String) {
    use http_body_util::{BodyExt, Full};
    let mut req = hyper::Request::post(url).header("content-type", "application/json");
    if let Some(id) = request_id {
        req = req.header("x-request-id", id);
    }
    let req = req
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_correct_mode_never_contacts_decode_after_a_prefill_400() {
    let c = vllm_cluster(
        "correct",
        &["--prefill-args", SLOW_OK, "--decode-args", SLOW_OK],
    )
    .await;
    let client = http_client(8);
    let s = run_load(
        &c.router,
        &[
            "--api",
            "openai",
            "--rate",
            "300",
            "--requests",
            "200",
            "--over-capacity-share",
            "0.3",
            "--stream-share",
            "0.3",
            "--chat-share",
            "0.3",
            "--seed",
            "3",
        ],
    );
    let ok = n(&s["ok"]);
    let rejected = n(&s["rejected_by_status"]["400"]);
    assert_eq!(s["errors"], 0, "{s}");
    assert_eq!(ok + rejected, 200, "{s}");
    assert!(rejected > 20, "{s}");
    assert_eq!(rejected, n(&s["over_capacity_sent"]), "{s}");

    let r = stats(&client, &c.router).await;
    assert_eq!(n(&r["router"]["decode_legs"]), ok, "{r}");
    assert_eq!(n(&r["router"]["decode_legs_after_prefill_rejection"]), 0);
    assert_eq!(n(&r["router"]["prefill_4xx"]), rejected);
    let p = stats(&client, &c.prefill).await;
    let d = stats(&client, &c.decode).await;
    // Decode saw exactly the admitted requests, each with prefill's params, each pulled.
    assert_eq!(n(&d["worker"]["requests"]), ok, "{d}");
    assert_eq!(n(&d["worker"]["remote_prefills"]), ok, "{d}");
    assert_eq!(n(&d["worker"]["local_prefills"]), 0, "{d}");
    assert_eq!(n(&p["worker"]["rejected_400"]), rejected, "{p}");
    assert_eq!(n(&p["worker"]["kv_params_issued"]), ok, "{p}");
    // One handshake for the engine pair, one notification per request.
    assert_eq!(n(&p["worker"]["handshakes_served"]), 1, "{p}");
    assert_eq!(n(&d["worker"]["handshakes_done"]), 1, "{d}");
    assert_eq!(d["remote_engines"], json!([p["engine_id"]]), "{d}");
    assert_eq!(n(&d["worker"]["notifications_sent"]), ok, "{d}");
    assert_eq!(n(&p["worker"]["kv_transfers"]), ok, "{p}");
    assert_eq!(n(&p["worker"]["notifications_after_expiry"]), 0, "{p}");
    assert_eq!(n(&p["kv_holds"]), 0, "{p}");

    let preqs = requests(&client, &c.prefill).await;
    let dreqs = requests(&client, &c.decode).await;
    let rejected_ids: HashSet<&str> = preqs
        .iter()
        .filter(|r| r["status"] == 400)
        .map(|r| r["id"].as_str().unwrap())
        .collect();
    assert_eq!(rejected_ids.len() as u64, rejected);
    assert!(
        preqs
            .iter()
            .filter(|r| r["status"] == 400)
            .all(|r| r["notifications"] == 0
                && r["outcome"] == "rejected"
                && r["kv_params_issued"] == false)
    );
    let pulled: HashSet<&str> = dreqs
        .iter()
        .map(|r| {
            r["remote_request_id"]
                .as_str()
                .expect("params on every decode leg")
        })
        .collect();
    assert!(
        rejected_ids.is_disjoint(&pulled),
        "decode pulled a rejected request"
    );
    let rejected_internal: HashSet<&str> = preqs
        .iter()
        .filter(|r| r["status"] == 400)
        .map(|r| r["internal_id"].as_str().unwrap())
        .collect();
    assert!(rejected_internal.is_disjoint(&pulled));
    for r in &dreqs {
        assert_eq!(r["outcome"], "generated", "{r}");
        assert_eq!(r["kv_read"], true, "{r}");
        // The engine id is cmpl-X-0 / chatcmpl-X with the router's X; decode read prefill's
        // internal id of the same request: the engine id and 8 hex digits.
        let x = r["request_id"].as_str().unwrap();
        assert!(x.starts_with("___prefill_addr_127.0.0.1:"), "{x}");
        let id = r["id"].as_str().unwrap();
        assert!(
            id == format!("cmpl-{x}-0") || id == format!("chatcmpl-{x}"),
            "{r}"
        );
        let rid = r["remote_request_id"].as_str().unwrap();
        let tail = rid
            .strip_prefix(&format!("{id}-"))
            .unwrap_or_else(|| panic!("{r}"));
        assert!(
            tail.len() == 8 && tail.bytes().all(|b| b.is_ascii_hexdigit()),
            "{r}"
        );
    }
    let by_internal: HashMap<&str, &Value> = preqs
        .iter()
        .map(|r| (r["internal_id"].as_str().unwrap(), r))
        .collect();
    for id in &pulled {
        let pr = by_internal[id];
        assert_eq!(pr["outcome"], "transferred", "{pr}");
        assert_eq!(pr["notifications"], 1, "{pr}");
        assert_eq!(pr["answered_remote_request_id"], *id, "{pr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_handoff_after_reject_sends_rejected_requests_to_decode() {
    let c = vllm_cluster(
        "handoff-after-reject",
        &["--prefill-args", SLOW_OK, "--decode-args", SLOW_OK],
    )
    .await;
    let client = http_client(8);
    let s = run_load(
        &c.router,
        &[
            "--api",
            "openai",
            "--rate",
            "300",
            "--requests",
            "100",
            "--over-capacity-share",
            "0.3",
            "--chat-share",
            "0.2",
            "--seed",
            "9",
        ],
    );
    let over = n(&s["over_capacity_sent"]);
    assert!(over > 10, "{s}");
    // Decode (max_model_len 32768) admits what prefill (4096) rejected: the client sees 200.
    assert_eq!(n(&s["ok"]), 100, "{s}");
    let r = stats(&client, &c.router).await;
    assert_eq!(n(&r["router"]["prefill_4xx"]), over, "{r}");
    assert_eq!(
        n(&r["router"]["decode_legs_after_prefill_rejection"]),
        over,
        "{r}"
    );
    assert_eq!(n(&r["router"]["decode_legs"]), 100, "{r}");
    let d = stats(&client, &c.decode).await;
    assert_eq!(n(&d["worker"]["local_prefills"]), over, "{d}");
    assert_eq!(n(&d["worker"]["remote_prefills"]), 100 - over, "{d}");
    let preqs = requests(&client, &c.prefill).await;
    let dreqs = requests(&client, &c.decode).await;
    let rejected: HashSet<&str> = preqs
        .iter()
        .filter(|r| r["status"] == 400)
        .map(|r| r["id"].as_str().unwrap())
        .collect();
    assert_eq!(rejected.len() as u64, over);
    let local: HashSet<&str> = dreqs
        .iter()
        .filter(|r| r["remote_request_id"].is_null())
        .map(|r| r["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        local, rejected,
        "every rejected request was generated by decode alone"
    );
    assert!(dreqs.iter().all(|r| r["outcome"] == "generated"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_http_shapes_models_metrics_stream_and_chat() {
    let c = vllm_cluster("correct", &[]).await;
    let client = http_client(8);
    assert_eq!(c.ready["flavour"], "vllm");
    assert!(n(&c.ready["side_channel_port"]) > 0, "{}", c.ready);
    assert_eq!(
        c.ready["side_channel_port"],
        c.ready["prefill_side_channel_port"]
    );
    for (base, len) in [(&c.prefill, 4096u64), (&c.decode, 32768)] {
        let (s, body) = get(&client, &format!("{base}/health")).await.unwrap();
        assert_eq!((s, body.len()), (200, 0));
        let m = get_json(&client, &format!("{base}/v1/models")).await;
        assert_eq!(m["object"], "list");
        let d = &m["data"][0];
        assert_eq!(d["object"], "model");
        assert_eq!(d["owned_by"], "vllm");
        assert_eq!(d["root"], d["id"]);
        assert!(d["parent"].is_null());
        assert_eq!(d["max_model_len"], len);
        assert_eq!(d["permission"], json!([]));
        let (s, text) = get(&client, &format!("{base}/metrics")).await.unwrap();
        assert_eq!(s, 200);
        let text = String::from_utf8_lossy(&text);
        // A realistic page: tens of KB, the info line somewhere inside.
        assert!(text.len() > 20_000, "{}", text.len());
        assert!(text.starts_with("# HELP python_gc_objects_collected_total"));
        let info = text
            .lines()
            .find(|l| l.starts_with("vllm:cache_config_info{"))
            .unwrap();
        assert!(
            info.starts_with(
                "vllm:cache_config_info{block_size=\"16\",user_specified_block_size=\"False\","
            ),
            "{info}"
        );
        assert!(info.ends_with(",engine=\"0\"} 1.0"), "{info}");
        let blocks: u64 = info
            .split(",num_gpu_blocks=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .and_then(|b| b.parse().ok())
            .unwrap();
        assert!(
            blocks * 16 >= len,
            "KV capacity below max_model_len: {info}"
        );
        assert!(
            text.contains(
                "vllm:num_requests_running{model_name=\"pd-sim/tiny-model\",engine=\"0\"}"
            ),
            "{text}"
        );
    }
    // Over-long at prefill, directly: vLLM 0.34's message and envelope. Text is tokenized
    // up to max_model_len + 1, so the message says "at least 4097"; token ids keep their count.
    let (s, _, body) = post_full(
        &client,
        &format!("{}/v1/completions", c.prefill),
        Some("direct"),
        json!({"model": "m", "prompt": words(5000), "max_tokens": 1}),
    )
    .await;
    assert_eq!(s, 400);
    assert_eq!(
        body,
        r#"{"error":{"message":"This model's maximum context length is 4096 tokens. However, your prompt contains at least 4097 input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value=4097)","type":"BadRequestError","param":"input_tokens","code":400}}"#
    );
    let ids: Vec<u64> = (0..5000).collect();
    let (s, _, body) = post_full(
        &client,
        &format!("{}/v1/completions", c.prefill),
        Some("direct-ids"),
        json!({"prompt": ids, "max_tokens": 1}),
    )
    .await;
    assert_eq!(s, 400);
    assert!(
        body.contains("your prompt contains 5000 input tokens"),
        "{body}"
    );
    // max_tokens above max_model_len is refused before the prompt is looked at; at the edge
    // of u64 it is a 400, not an overflow.
    let (s, _, body) = post_full(
        &client,
        &format!("{}/v1/completions", c.prefill),
        Some("huge"),
        json!({"prompt": "a", "max_tokens": u64::MAX}),
    )
    .await;
    assert_eq!(s, 400, "{body}");
    assert_eq!(
        body,
        format!(
            r#"{{"error":{{"message":"max_tokens={m} cannot be greater than max_model_len=4096. Please request fewer output tokens. (parameter=max_tokens, value={m})","type":"BadRequestError","param":"max_tokens","code":400}}}}"#,
            m = u64::MAX
        )
    );
    // A prompt that fits with a max_tokens that does not: clamped to what is left, 200.
    let (s, _, body) = post_full(
        &client,
        &format!("{}/v1/completions", c.prefill),
        Some("clamp"),
        json!({"prompt": words(4000), "max_tokens": 200}),
    )
    .await;
    assert_eq!(s, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["id"], "cmpl-clamp");
    assert_eq!(v["usage"]["completion_tokens"], 96);
    let r = &get_json(
        &client,
        &format!("{}/sim/requests?id=cmpl-clamp-0", c.prefill),
    )
    .await[0];
    assert_eq!(
        (
            r["clamped"].clone(),
            r["max_tokens"].clone(),
            r["max_tokens_requested"].clone()
        ),
        (json!(true), json!(96), json!(200)),
        "{r}"
    );
    // Streamed and over-long: still a JSON 400, before any stream.
    let (s, h, _) = post_full(
        &client,
        &format!("{}/v1/completions", c.prefill),
        Some("direct-stream"),
        json!({"prompt": words(5000), "max_tokens": 1, "stream": true}),
    )
    .await;
    assert_eq!(s, 400);
    assert_eq!(h["content-type"], "application/json");
    // Through the router: X on the legs, the client's id echoed back.
    let (s, h, body) = post_full(
        &client,
        &format!("{}/v1/completions", c.router),
        Some("client-7"),
        json!({"model": "m", "prompt": words(12), "max_tokens": 3}),
    )
    .await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(h["x-request-id"], "client-7");
    let v: Value = serde_json::from_str(&body).unwrap();
    let id = v["id"].as_str().unwrap();
    assert!(id.starts_with("cmpl-___prefill_addr_127.0.0.1:"), "{id}");
    let hex = id.rsplit('_').next().unwrap();
    assert_eq!(hex.len(), 32);
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert!(v["choices"][0]["logprobs"].is_null() && v["choices"][0]["stop_reason"].is_null());
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 12, "total_tokens": 15, "completion_tokens": 3, "prompt_tokens_details": null})
    );
    assert!(v["kv_transfer_params"].is_null());
    // The prefill leg answered params naming N and prefill's side channel.
    let (s, _, pbody) = post_full(
        &client,
        &format!("{}/v1/completions", c.prefill),
        Some("direct-ok"),
        json!({"prompt": "a b c", "max_tokens": 1, "min_tokens": 1, "stream": false,
               "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
               "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}}),
    )
    .await;
    assert_eq!(s, 200);
    let pv: Value = serde_json::from_str(&pbody).unwrap();
    let kv = &pv["kv_transfer_params"];
    assert_eq!(kv["do_remote_prefill"], true);
    assert_eq!(kv["do_remote_decode"], false);
    assert_eq!(pv["id"], "cmpl-direct-ok");
    let rid = kv["remote_request_id"].as_str().unwrap();
    assert!(
        rid.starts_with("cmpl-direct-ok-0-") && rid.len() == "cmpl-direct-ok-0-".len() + 8,
        "{rid}"
    );
    assert_eq!(kv["remote_host"], "127.0.0.1");
    assert_eq!(kv["remote_port"], c.ready["side_channel_port"]);
    assert!(kv["remote_engine_id"].as_str().unwrap().len() == 36);
    // Every field request_finished sets, in its order.
    let keys = [
        "do_remote_prefill",
        "do_remote_decode",
        "remote_block_ids",
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
        "tp_size",
        "dcp_size",
        "pp_size",
        "remote_num_tokens",
        "remote_blocks_expiry_time",
        "remote_registration_generation",
        "transfer_mode",
    ];
    let at: Vec<usize> = keys
        .iter()
        .map(|k| {
            pbody
                .find(&format!("\"{k}\":"))
                .unwrap_or_else(|| panic!("{k}: {pbody}"))
        })
        .collect();
    assert!(at.windows(2).all(|w| w[0] < w[1]), "{pbody}");
    assert_eq!(kv["remote_block_ids"], json!([[1]]));
    assert_eq!(
        (
            kv["tp_size"].clone(),
            kv["dcp_size"].clone(),
            kv["pp_size"].clone()
        ),
        (json!(1), json!(1), json!(1))
    );
    assert_eq!(kv["remote_num_tokens"], 3);
    assert!(kv["remote_blocks_expiry_time"].is_null());
    assert_eq!(kv["remote_registration_generation"], 0);
    assert_eq!(kv["transfer_mode"], "pull");
    // Streaming completions: chunks carry N, the last before [DONE] the usage.
    let (s, h, body) = post_full(
        &client,
        &format!("{}/v1/completions", c.router),
        None,
        json!({"prompt": words(5), "max_tokens": 4, "stream": true}),
    )
    .await;
    assert_eq!(s, 200);
    assert!(h["x-request-id"].to_str().unwrap().starts_with("cmpl-"));
    assert!(
        h["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let events: Vec<&str> = body
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").expect("SSE data line"))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks.len(), 5, "{body}");
    let sid = chunks[0]["id"].as_str().unwrap();
    assert!(sid.starts_with("cmpl-___prefill_addr_"));
    assert!(chunks.iter().all(|c| c["id"] == sid));
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[4]["usage"]["completion_tokens"], 4);
    assert_eq!(chunks[4]["usage"]["prompt_tokens"], 5);
    // Chat, whole and streamed.
    let (s, _, body) = post_full(
        &client,
        &format!("{}/v1/chat/completions", c.router),
        Some("chat-1"),
        json!({"model": "m", "messages": [{"role": "user", "content": words(7)}], "max_tokens": 2}),
    )
    .await;
    assert_eq!(s, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(
        v["id"]
            .as_str()
            .unwrap()
            .starts_with("chatcmpl-___prefill_addr_")
    );
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["usage"]["prompt_tokens"], 7);
    let (s, _, body) = post_full(
        &client,
        &format!("{}/v1/chat/completions", c.router),
        Some("chat-2"),
        json!({"messages": [{"role": "user", "content": words(7)}], "max_tokens": 2, "stream": true}),
    )
    .await;
    assert_eq!(s, 200);
    assert!(body.ends_with("data: [DONE]\n\n"));
    assert!(body.contains("\"object\":\"chat.completion.chunk\""));
    assert!(body.contains("\"delta\":{\"role\":\"assistant\",\"content\":\"\"}"));
    // The prompt is never echoed.
    assert!(!body.contains("word"));
    // A body that is not JSON: 400 at the router, no leg.
    let before = n(&stats(&client, &c.router).await["router"]["prefill_legs"]);
    let (s, _, _) = post_full(
        &client,
        &format!("{}/v1/completions", c.router),
        None,
        json!([1]),
    )
    .await;
    assert_eq!(s, 400);
    assert_eq!(
        n(&stats(&client, &c.router).await["router"]["prefill_legs"]),
        before
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_prefill_503_becomes_500_and_decode_is_not_contacted() {
    let c = vllm_cluster("correct", &["--prefill-args", "--overload-share 1.0"]).await;
    let client = http_client(8);
    let (s, h, body) = post_full(
        &client,
        &format!("{}/v1/completions", c.router),
        Some("busy"),
        json!({"prompt": "a b", "max_tokens": 2}),
    )
    .await;
    assert_eq!(s, 500, "{body}");
    assert!(
        h["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    assert!(
        body.starts_with("Transparent proxy request failed: Network error: Prefill server "),
        "{body}"
    );
    assert!(
        body.contains("returned 503 Service Unavailable: {\"error\":{\"message\":"),
        "{body}"
    );
    assert!(
        body.contains("\"type\":\"ServiceUnavailableError\""),
        "{body}"
    );
    let d = stats(&client, &c.decode).await;
    assert_eq!(n(&d["worker"]["requests"]), 0, "{d}");
    let r = stats(&client, &c.router).await;
    assert_eq!(n(&r["router"]["prefill_5xx"]), 1);
    assert_eq!(n(&r["router"]["decode_legs"]), 0);
    // handoff-after-reject hands a 503 with a JSON body to decode as well.
    let c = vllm_cluster(
        "handoff-after-reject",
        &["--prefill-args", "--overload-share 1.0"],
    )
    .await;
    let (s, _, body) = post_full(
        &client,
        &format!("{}/v1/completions", c.router),
        Some("busy-2"),
        json!({"prompt": "a b", "max_tokens": 2}),
    )
    .await;
    assert_eq!(s, 200, "{body}");
    let d = stats(&client, &c.decode).await;
    assert_eq!(n(&d["worker"]["local_prefills"]), 1, "{d}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_handshake_is_once_per_engine_and_a_stale_id_is_counted_at_prefill() {
    let c = vllm_cluster("correct", &["--no-router"]).await;
    let client = http_client(8);
    let engine = stats(&client, &c.prefill).await["engine_id"]
        .as_str()
        .unwrap()
        .to_owned();
    // A tap between decode and prefill's side channel: the frames as they are on the wire.
    let tap = ZmtpTap::start().await;
    tap.set_upstream(([127, 0, 0, 1], n(&c.ready["side_channel_port"]) as u16).into());
    // Params naming ids prefill never issued: decode handshakes once, reads, notifies.
    for i in 0..3 {
        let (s, _, body) = post_full(
            &client,
            &format!("{}/v1/completions", c.decode),
            Some(&format!("stale-{i}")),
            json!({"prompt": "a b c", "max_tokens": 2, "kv_transfer_params": {
                "do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": engine,
                "remote_block_ids": [[1]], "remote_request_id": format!("cmpl-never-held-{i}"),
                "remote_host": "127.0.0.1", "remote_port": tap.port, "tp_size": 1}}),
        )
        .await;
        assert_eq!(s, 200, "{body}");
    }
    let msgs = tap.messages.lock().unwrap().clone();
    assert_eq!(msgs.len(), 1, "one handshake for the engine pair: {msgs:?}");
    assert_eq!(msgs[0].len(), 2);
    assert!(msgs[0][0].is_empty());
    assert_eq!(&msgs[0][1][..], b"\x93\xc4\x0cget_meta_msg\x00\x00");
    let p = eventually(
        "prefill counted the notifications",
        Duration::from_secs(10),
        async || {
            let s = stats(&client, &c.prefill).await;
            (n(&s["worker"]["notifications_after_expiry"]) == 3).then_some(s)
        },
    )
    .await;
    assert_eq!(
        p["unrecognized_notifications"],
        json!([
            "cmpl-never-held-0",
            "cmpl-never-held-1",
            "cmpl-never-held-2"
        ])
    );
    assert_eq!(n(&p["worker"]["handshakes_served"]), 1, "{p}");
    let (_, text) = get(&client, &format!("{}/metrics", c.prefill))
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&text).contains(
        "vllm:nixl_num_notifications_after_expiry_total{model_name=\"pd-sim/tiny-model\",engine=\"0\"} 3.0\n"
    ));
    let d = requests(&client, &c.decode).await;
    assert_eq!(d.len(), 3);
    assert!(
        d.iter()
            .all(|r| r["kv_read"] == true && r["remote_engine_id"] == engine.as_str())
    );
    let made: Vec<bool> = d.iter().map(|r| r["handshake"] == true).collect();
    assert_eq!(made, [true, false, false]);
    // Params without the fields decode needs: computed here, no handshake, no error.
    let (s, _, _) = post_full(
        &client,
        &format!("{}/v1/completions", c.decode),
        Some("invalid"),
        json!({"prompt": "a b", "max_tokens": 1, "kv_transfer_params": {"do_remote_prefill": true}}),
    )
    .await;
    assert_eq!(s, 200);
    let r = &get_json(
        &client,
        &format!("{}/sim/requests?id=cmpl-invalid-0", c.decode),
    )
    .await[0];
    assert_eq!(r["invalid_kv_params"], true, "{r}");
    assert_eq!(
        n(&stats(&client, &c.decode).await["worker"]["local_prefills"]),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_unread_kv_expires_with_its_lease() {
    let c = vllm_cluster(
        "correct",
        &["--no-router", "--prefill-args", "--kv-lease-ms 300"],
    )
    .await;
    let client = http_client(8);
    let (s, _, body) = post_full(
        &client,
        &format!("{}/v1/completions", c.prefill),
        Some("unread"),
        json!({"prompt": "a b c", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}),
    )
    .await;
    assert_eq!(s, 200, "{body}");
    let r = eventually("the lease expired", Duration::from_secs(10), async || {
        let r = get_json(
            &client,
            &format!("{}/sim/requests?id=cmpl-unread-0", c.prefill),
        )
        .await;
        (r[0]["outcome"] == "lease-expired").then(|| r[0].clone())
    })
    .await;
    assert_eq!(r["notifications"], 0, "{r}");
    let p = stats(&client, &c.prefill).await;
    assert_eq!(n(&p["worker"]["kv_expired_reqs"]), 1, "{p}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_spans_share_the_routers_trace() {
    use opentelemetry_proto::tonic::common::v1::any_value::Value as AV;
    use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
    let otlp = OtlpReceiver::start().await;
    let c = vllm_cluster("correct", &["--otlp-endpoint", &otlp.url]).await;
    let client = http_client(8);
    let (s, _, _) = post_full(
        &client,
        &format!("{}/v1/completions", c.router),
        Some("span-ok"),
        json!({"prompt": words(9), "max_tokens": 3}),
    )
    .await;
    assert_eq!(s, 200);
    let (s, _, _) = post_full(
        &client,
        &format!("{}/v1/completions", c.router),
        Some("span-rej"),
        json!({"prompt": words(5000), "max_tokens": 3}),
    )
    .await;
    assert_eq!(s, 400);
    let spans = eventually("spans exported", Duration::from_secs(20), async || {
        let g = otlp.spans.lock().unwrap().clone();
        let servers = g
            .iter()
            .filter(|(svc, s)| svc == "vllm-router" && s.kind == SpanKind::Server as i32)
            .count();
        let engine = g.iter().filter(|(svc, _)| svc == "vllm").count();
        (servers == 2 && engine == 2).then_some(g)
    })
    .await;
    let int = |s: &opentelemetry_proto::tonic::trace::v1::Span, k: &str| {
        s.attributes.iter().find(|kv| kv.key == k).and_then(|kv| {
            match kv.value.as_ref()?.value.as_ref()? {
                AV::IntValue(i) => Some(*i),
                _ => None,
            }
        })
    };
    let dbl = |s: &opentelemetry_proto::tonic::trace::v1::Span, k: &str| {
        s.attributes.iter().find(|kv| kv.key == k).and_then(|kv| {
            match kv.value.as_ref()?.value.as_ref()? {
                AV::DoubleValue(d) => Some(*d),
                _ => None,
            }
        })
    };
    let router: Vec<_> = spans
        .iter()
        .filter(|(svc, _)| svc == "vllm-router")
        .map(|(_, s)| s)
        .collect();
    let server = |id: &str| {
        *router
            .iter()
            .find(|s| s.kind == SpanKind::Server as i32 && attr(s, "request_id") == Some(id))
            .unwrap_or_else(|| panic!("server span {id}"))
    };
    let ok = server("span-ok");
    assert_eq!(ok.name, "POST /v1/completions");
    assert_eq!(attr(ok, "http.request.method"), Some("POST"));
    assert_eq!(attr(ok, "http.route"), Some("/v1/completions"));
    assert_eq!(attr(ok, "http.response.status_code"), Some("200"));
    assert!(dbl(ok, "latency_ms").is_some());
    let children = |p: &opentelemetry_proto::tonic::trace::v1::Span| -> Vec<_> {
        router
            .iter()
            .filter(|s| s.parent_span_id == p.span_id && s.trace_id == p.trace_id)
            .copied()
            .collect()
    };
    let legs = children(ok);
    assert_eq!(legs.len(), 2);
    for l in &legs {
        assert_eq!(l.kind, SpanKind::Client as i32);
        assert_eq!(attr(l, "server.address"), Some("127.0.0.1"));
        assert!(attr(l, "server.port").is_some_and(|p| p.parse::<u16>().is_ok()));
        assert_eq!(attr(l, "http.response.status_code"), Some("200"));
    }
    let phase: HashSet<_> = legs
        .iter()
        .filter_map(|l| attr(l, "vllm.request_phase"))
        .collect();
    assert_eq!(phase, HashSet::from(["prefill", "decode"]));
    let rej = server("span-rej");
    assert_eq!(attr(rej, "http.response.status_code"), Some("400"));
    let rlegs = children(rej);
    assert_eq!(rlegs.len(), 1, "no decode leg after a prefill 400");
    assert_eq!(attr(rlegs[0], "vllm.request_phase"), Some("prefill"));
    assert_eq!(attr(rlegs[0], "http.response.status_code"), Some("400"));
    // Each leg's llm_request is the child of that leg's CLIENT span; none for the 400.
    let engine: Vec<_> = spans
        .iter()
        .filter(|(svc, _)| svc == "vllm")
        .map(|(_, s)| s)
        .collect();
    for l in &legs {
        let e = engine
            .iter()
            .find(|e| e.parent_span_id == l.span_id)
            .unwrap_or_else(|| panic!("llm_request under {:?}", attr(l, "vllm.request_phase")));
        assert_eq!(e.name, "llm_request");
        assert_eq!(e.kind, SpanKind::Server as i32);
        assert_eq!(e.trace_id, ok.trace_id);
        let id = attr(e, "gen_ai.request.id").unwrap();
        assert!(
            id.starts_with("cmpl-___prefill_addr_") && id.ends_with("-0"),
            "{id}"
        );
        assert_eq!(e.status, None, "vLLM leaves the status unset");
        assert_eq!(int(e, "gen_ai.usage.prompt_tokens"), Some(9));
        let prefill = attr(l, "vllm.request_phase") == Some("prefill");
        assert_eq!(
            int(e, "gen_ai.request.max_tokens"),
            Some(if prefill { 1 } else { 3 })
        );
        assert_eq!(
            int(e, "gen_ai.usage.completion_tokens"),
            Some(if prefill { 1 } else { 3 })
        );
        for k in [
            "gen_ai.latency.time_in_queue",
            "gen_ai.latency.time_to_first_token",
            "gen_ai.latency.e2e",
            "gen_ai.latency.time_in_model_prefill",
            "gen_ai.latency.time_in_model_decode",
        ] {
            assert!(dbl(e, k).is_some_and(|v| v >= 0.0), "{k}");
        }
    }
    assert!(engine.iter().all(|e| e.trace_id == ok.trace_id));
    // No prompt text anywhere in the spans.
    for (_, s) in spans.iter() {
        for kv in &s.attributes {
            if let Some(AV::StringValue(v)) = kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                assert!(!v.contains("word"), "{}={v}", kv.key);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_garbage_on_the_side_channel_is_counted_not_fatal() {
    let c = vllm_cluster("correct", &[]).await;
    let client = http_client(8);
    let port = n(&c.ready["side_channel_port"]) as u16;
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    s.write_all(&[0x42; 200]).await.unwrap();
    let mut buf = [0u8; 256];
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await;
    eventually(
        "bad connection counted",
        Duration::from_secs(10),
        async || {
            let st = stats(&client, &c.prefill).await;
            (n(&st["side_channel"]["bad_connections"]) >= 1).then_some(())
        },
    )
    .await;
    let (status, _, _) = post_full(
        &client,
        &format!("{}/v1/completions", c.router),
        None,
        json!({"prompt": "a b", "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_decode_ignoring_cancel_sends_no_abort() {
    let c = vllm_cluster(
        "correct",
        &[
            "--no-router",
            "--decode-args",
            "--kv-timeout-ms 500 --decode-ignores-cancel",
        ],
    )
    .await;
    let client = http_client(8);
    // A side channel that accepts and never answers: the handshake fails after
    // --kv-timeout-ms, long after decode saw its client go (a refused connect could fail
    // before that, and the request would end as plain kv-failed).
    let hole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed = hole.local_addr().unwrap().port();
    let body = json!({"prompt": "a b c", "max_tokens": 2, "kv_transfer_params": {
        "do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "e",
        "remote_block_ids": [[1]], "remote_request_id": "cmpl-not-held",
        "remote_host": "127.0.0.1", "remote_port": closed, "tp_size": 1}})
    .to_string();
    let port = c.decode.rsplit(':').next().unwrap();
    let mut sock = tokio::net::TcpStream::connect(format!("127.0.0.1:{port}"))
        .await
        .unwrap();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\nx-request-id: stays\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    sock.write_all(req.as_bytes()).await.unwrap();
    sock.shutdown().await.unwrap();
    let d = eventually(
        "decode ended the request",
        Duration::from_secs(10),
        async || {
            let r = requests(&client, &c.decode).await;
            r.into_iter()
                .find(|r| r["id"] == "cmpl-stays-0" && r["outcome"] != "pending")
        },
    )
    .await;
    assert_eq!(d["outcome"], "cancel-ignored", "{d}");
    assert_eq!(d["final_outcome"], "kv-failed", "{d}");
    let st = stats(&client, &c.decode).await;
    assert_eq!(n(&st["worker"]["handshake_failures"]), 1, "{st}");
    // The answer (500) was still written on the socket.
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), sock.read_to_end(&mut buf)).await;
    assert!(
        String::from_utf8_lossy(&buf).starts_with("HTTP/1.1 500"),
        "{}",
        String::from_utf8_lossy(&buf)
    );
}
