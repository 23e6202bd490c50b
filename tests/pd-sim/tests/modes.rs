//! End-to-end behaviour of the simulator's router modes, observed from outside the processes:
//! HTTP answers, the simulator's per-room records, the ZMTP bytes on the wire, OTLP spans.
//! (One file, ~1,000 lines: the catalogue of modes, one test each, on one set of helpers.)

mod support;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use pd_sim::http::http_client;
use serde_json::json;
use support::*;

const SLOW_OK_PREFILL: &str = "--bootstrap-timeout-ms 60000";
const SLOW_OK_DECODE: &str = "--kv-timeout-ms 60000";

fn room_set(recs: &[serde_json::Value], pred: impl Fn(&serde_json::Value) -> bool) -> HashSet<u64> {
    recs.iter()
        .filter(|r| pred(r))
        .map(|r| r["room"].as_u64().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn correct_mode_never_hands_a_rejected_request_to_decode() {
    // Generous transfer timeouts: on a loaded CI box slowness must show as latency, not as
    // KV-timeout failures that would blur the mode's behaviour.
    let c = Cluster::start(
        "correct",
        &[
            "--prefill-args",
            SLOW_OK_PREFILL,
            "--decode-args",
            SLOW_OK_DECODE,
        ],
    )
    .await;
    let client = http_client(8);
    let s = run_load(
        &c.router,
        &[
            "--rate",
            "400",
            "--requests",
            "300",
            "--over-capacity-share",
            "0.3",
            "--stream-share",
            "0.3",
            "--chat-share",
            "0.2",
            "--seed",
            "11",
        ],
    );
    let ok = s["ok"].as_u64().unwrap();
    let rejected = s["rejected_by_status"]["400"].as_u64().unwrap_or(0);
    assert_eq!(s["errors"], 0, "{s}");
    assert_eq!(ok + rejected, 300, "{s}");
    assert!(
        rejected > 40,
        "over-capacity share should produce rejections: {s}"
    );
    assert_eq!(
        rejected,
        s["over_capacity_sent"].as_u64().unwrap(),
        "exactly the over-capacity prompts are rejected"
    );

    let prefill = rooms(&client, &c.prefill).await;
    let decode = rooms(&client, &c.decode).await;
    let rejected_rooms = room_set(&prefill, |r| r["status"] == 400);
    assert_eq!(rejected_rooms.len() as u64, rejected);
    let decode_rooms = room_set(&decode, |_| true);
    assert!(
        rejected_rooms.is_disjoint(&decode_rooms),
        "decode saw a rejected room"
    );
    assert_eq!(
        decode_rooms.len() as u64,
        ok,
        "one decode leg per successful request"
    );
    assert!(
        decode
            .iter()
            .all(|r| r["outcome"] == "generated" && r["kv_done"] == true),
        "{decode:?}"
    );
    // Prefill never received decode traffic for a rejected room.
    assert!(
        prefill
            .iter()
            .filter(|r| r["status"] == 400)
            .all(|r| r["bootstrap_frames"] == 0 && r["kv_chunks"] == 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoff_after_reject_bootstraps_and_transfers_rejected_rooms() {
    let (tap, c) = ZmtpTap::cluster(
        "handoff-after-reject",
        SLOW_OK_PREFILL,
        &["--decode-args", SLOW_OK_DECODE],
    )
    .await;
    let client = http_client(8);
    let s = run_load(
        &c.router,
        &[
            "--rate",
            "300",
            "--requests",
            "120",
            "--over-capacity-share",
            "0.3",
            "--seed",
            "5",
        ],
    );
    let rejected = s["rejected_by_status"]["400"].as_u64().unwrap_or(0);
    assert!(rejected > 10, "{s}");
    assert_eq!(s["errors"], 0);

    // The client was told 400, yet decode works on the room in the background: wait for it.
    let prefill = rooms(&client, &c.prefill).await;
    let rejected_rooms = room_set(&prefill, |r| r["status"] == 400);
    assert_eq!(rejected_rooms.len() as u64, rejected);
    let decode = eventually(
        "decode generates every rejected room",
        Duration::from_secs(20),
        || {
            let (client, decode_url, rr) =
                (client.clone(), c.decode.clone(), rejected_rooms.clone());
            async move {
                let d = rooms(&client, &decode_url).await;
                let done = room_set(&d, |r| r["outcome"] == "generated");
                rr.is_subset(&done).then_some(d)
            }
        },
    )
    .await;
    let by_room: HashMap<u64, &serde_json::Value> = decode
        .iter()
        .map(|r| (r["room"].as_u64().unwrap(), r))
        .collect();
    for room in &rejected_rooms {
        let d = by_room[room];
        assert!(
            d["kv_chunks"].as_u64().unwrap() >= 1 && d["kv_done"] == true,
            "{d}"
        );
        assert!(d["generated_tokens"].as_u64().unwrap() >= 1);
    }
    // Independent witness: the BOOTSTRAP frames for the rejected rooms crossed the wire.
    let on_wire: HashSet<u64> = tap.rooms_with_verb(b"BOOTSTRAP").into_iter().collect();
    assert!(
        rejected_rooms.is_subset(&on_wire),
        "missing BOOTSTRAP frames on the wire for rejected rooms"
    );
    let prefill_stats = get_json(&client, &format!("{}/sim/stats", c.prefill)).await;
    assert_eq!(
        prefill_stats["worker"]["kv_transfers_after_reject"]
            .as_u64()
            .unwrap(),
        rejected
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_no_cancel_retries_503_with_new_rooms_under_one_request_id() {
    let c = Cluster::start(
        "concurrent-no-cancel",
        &[
            "--prefill-args",
            "--overload-share 1.0",
            "--decode-args",
            "--kv-timeout-ms 300",
            "--router-args",
            "--retry-initial-backoff-ms 5",
        ],
    )
    .await;
    let client = http_client(8);
    let (status, body) = generate(
        &client,
        &c,
        "storm-1",
        json!({"text": "hello there", "sampling_params": {"max_new_tokens": 4}}),
    )
    .await;
    assert_eq!(status, 503, "{}", String::from_utf8_lossy(&body));
    assert!(String::from_utf8_lossy(&body).contains("The request queue is full."));
    let prefill = rooms(&client, &c.prefill).await;
    let storm: Vec<_> = prefill
        .iter()
        .filter(|r| r["request_id"] == "storm-1")
        .collect();
    assert_eq!(storm.len(), 5, "one prefill attempt per retry: {storm:?}");
    assert!(storm.iter().all(|r| r["status"] == 503));
    let storm_rooms: HashSet<u64> = storm.iter().map(|r| r["room"].as_u64().unwrap()).collect();
    assert_eq!(storm_rooms.len(), 5, "a new bootstrap_room per attempt");
    // Every attempt also had a decode leg, never cancelled: it bootstraps and times out.
    let decode = eventually(
        "decode legs of the storm settle",
        Duration::from_secs(10),
        || {
            let (client, url) = (client.clone(), c.decode.clone());
            async move {
                let d = rooms(&client, &url).await;
                let legs: Vec<_> = d
                    .into_iter()
                    .filter(|r| r["request_id"] == "storm-1")
                    .collect();
                (legs.len() == 5 && legs.iter().all(|r| r["outcome"] == "kv-failed"))
                    .then_some(legs)
            }
        },
    )
    .await;
    assert_eq!(
        decode
            .iter()
            .map(|r| r["room"].as_u64().unwrap())
            .collect::<HashSet<_>>(),
        storm_rooms
    );
    assert!(
        decode
            .iter()
            .all(|r| r["bootstrap_frames"] == 1 && r["kv_chunks"] == 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_no_cancel_leaves_the_decode_leg_of_a_rejected_request_running() {
    let c = Cluster::start(
        "concurrent-no-cancel",
        &[
            "--decode-args",
            "--kv-timeout-ms 300",
            "--router-args",
            "--retry-initial-backoff-ms 5",
        ],
    )
    .await;
    let client = http_client(8);
    let (status, body) = generate(
        &client,
        &c,
        "rej-1",
        json!({"text": words(5000), "sampling_params": {"max_new_tokens": 4}}),
    )
    .await;
    // Like smg 0.3.2: the decode leg is joined; its KV never comes, its 500 is retried with a
    // new room each time, and the client finally sees decode's 500.
    assert_eq!(status, 500, "{}", String::from_utf8_lossy(&body));
    assert!(String::from_utf8_lossy(&body).contains("Decode transfer failed"));
    let prefill = rooms(&client, &c.prefill).await;
    let attempts: Vec<_> = prefill
        .iter()
        .filter(|r| r["request_id"] == "rej-1")
        .collect();
    assert_eq!(attempts.len(), 5, "{attempts:?}");
    for a in &attempts {
        assert_eq!(a["status"], 400);
        assert_eq!(
            a["bootstrap_frames"], 1,
            "decode bootstrapped the rejected room: {a}"
        );
        assert_eq!(
            a["kv_chunks"], 0,
            "a correct prefill does not transfer a rejected room"
        );
    }
    let prefill_rooms: HashSet<u64> = attempts
        .iter()
        .map(|r| r["room"].as_u64().unwrap())
        .collect();
    let decode: Vec<_> = rooms(&client, &c.decode)
        .await
        .into_iter()
        .filter(|r| r["request_id"] == "rej-1")
        .collect();
    assert!(
        decode
            .iter()
            .all(|r| r["outcome"] == "kv-failed" && r["bootstrap_frames"] == 1),
        "{decode:?}"
    );
    assert_eq!(
        decode
            .iter()
            .map(|r| r["room"].as_u64().unwrap())
            .collect::<HashSet<_>>(),
        prefill_rooms
    );
    let (s, b) = generate(&client, &c, "ok-1", json!({"text": "a b c"})).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let msg = String::from_utf8_lossy(&b).to_string();
    assert!(msg.contains("meta_info"), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_are_sglang_and_smg_shaped_and_share_the_router_trace() {
    let otlp = OtlpReceiver::start().await;
    let c = Cluster::start("handoff-after-reject", &["--otlp-endpoint", &otlp.url]).await;
    let client = http_client(8);
    let (s1, _) = generate(&client, &c, "span-ok", json!({"text": "a b c"})).await;
    assert_eq!(s1, 200);
    let (s2, _) = generate(&client, &c, "span-rej", json!({"text": words(5000)})).await;
    assert_eq!(s2, 400);
    let spans = eventually(
        "spans of both requests, incl. the late transfer",
        Duration::from_secs(20),
        || {
            let spans = otlp.spans.clone();
            async move {
                let g = spans.lock().unwrap().clone();
                let routers = g.iter().filter(|(_, s)| s.name == "http_request").count();
                let late = g
                    .iter()
                    .filter(|(_, s)| s.name == "prefill_transfer_kv_cache")
                    .count();
                let decode_roots = g
                    .iter()
                    .filter(|(_, s)| s.name.starts_with("decode Req "))
                    .count();
                (routers >= 2 && late >= 2 && decode_roots >= 2).then_some(g)
            }
        },
    )
    .await;
    let router = spans
        .iter()
        .find(|(_, s)| s.name == "http_request" && attr(s, "request_id") == Some("span-rej"))
        .unwrap();
    assert_eq!(router.0, "smg");
    assert_eq!(attr(&router.1, "status_code"), Some("400"));
    assert!(
        attr(&router.1, "bootstrap_room").is_none(),
        "the real router span carries no room"
    );
    let trace = router.1.trace_id.clone();
    let in_trace: Vec<_> = spans.iter().filter(|(_, s)| s.trace_id == trace).collect();
    let prefill_root = in_trace
        .iter()
        .find(|(_, s)| s.name.starts_with("prefill Req "))
        .expect("prefill root in router trace");
    assert_eq!(prefill_root.0, "sglang");
    assert_eq!(
        prefill_root.1.parent_span_id, router.1.span_id,
        "worker root is a child of the router span"
    );
    let rid = attr(&prefill_root.1, "rid").unwrap();
    assert_eq!(prefill_root.1.name, format!("prefill Req {}", &rid[..8]));
    let room_hex = attr(&prefill_root.1, "bootstrap_room").unwrap().to_string();
    assert!(room_hex.starts_with("0x"));
    let sched = in_trace
        .iter()
        .find(|(_, s)| {
            s.name.starts_with("Prefill Scheduler [TP 0]")
                && s.status.as_ref().is_some_and(|st| st.code == 2)
        })
        .expect("ERROR scheduler span");
    assert!(
        attr(&sched.1, "reason")
            .unwrap()
            .contains("exceeds the maximum allowed length")
    );
    assert!(
        in_trace
            .iter()
            .any(|(_, s)| s.name == "prefill_transfer_kv_cache"),
        "late transfer of the rejected room"
    );
    let decode_root = in_trace
        .iter()
        .find(|(_, s)| s.name.starts_with("decode Req "))
        .expect("decode root");
    assert_eq!(
        attr(&decode_root.1, "bootstrap_room"),
        Some(room_hex.as_str())
    );
    for stage in ["decode_bootstrap", "decode_transferred", "decode_forward"] {
        assert!(
            in_trace.iter().any(|(_, s)| s.name == stage),
            "missing {stage}"
        );
    }
    let stats = get_json(&client, &format!("{}/sim/stats", c.prefill)).await;
    assert_eq!(stats["otlp"]["spans_dropped_queue_full"], 0);
    assert_eq!(stats["otlp"]["spans_failed"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_the_kv_port_is_refused_without_harm_and_children_are_cleaned_up() {
    let c = Cluster::start("correct", &[]).await;
    let client = http_client(8);
    let kv = c.ready["prefill_kv_port"].as_u64().unwrap() as u16;
    {
        use tokio::io::AsyncWriteExt;
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", kv))
            .await
            .unwrap();
        let _ = s.write_all(&[0x42; 200]).await;
    }
    let stats = eventually("bad connection counted", Duration::from_secs(5), || {
        let (client, url) = (client.clone(), c.prefill.clone());
        async move {
            let s = get_json(&client, &format!("{url}/sim/stats")).await;
            (s["kv_link"]["bad_connections"].as_u64().unwrap_or(0) >= 1).then_some(s)
        }
    })
    .await;
    assert_eq!(stats["worker"]["bootstrap_frames"], 0);
    let (status, _) = generate(&client, &c, "after-garbage", json!({"text": "a b"})).await;
    assert_eq!(status, 200);
    let info = get_json(&client, &format!("{}/server_info", c.prefill)).await;
    assert_eq!(info["disaggregation_mode"], "prefill");
    for k in [
        "context_length",
        "max_total_num_tokens",
        "max_req_input_len",
    ] {
        assert!(info[k].is_u64(), "{k}");
    }
    let pids = c.pids.clone();
    drop(c);
    for pid in pids {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists() || is_zombie(pid),
            "child {pid} survived"
        );
    }
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.contains(") Z "))
        .unwrap_or(true)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misconfigured_prefill_admits_over_capacity_requests_and_says_so_in_server_info() {
    let c = Cluster::start(
        "correct",
        &["--prefill-args", "--context-length 16384 --max-total-num-tokens 8192 --max-req-input-len 16000 --skip-total-tokens-check"],
    )
    .await;
    let client = http_client(8);
    let info = get_json(&client, &format!("{}/server_info", c.prefill)).await;
    assert_eq!(info["context_length"], 16384);
    assert_eq!(info["max_total_num_tokens"], 8192);
    assert_eq!(info["max_req_input_len"], 16000);
    let (status, _) = generate(&client, &c, "big-1", json!({"text": words(9000)})).await;
    assert_eq!(status, 200, "admitted although 9000 > max_total_num_tokens");
    let p = rooms(&client, &c.prefill).await;
    let rec = p.iter().find(|r| r["request_id"] == "big-1").unwrap();
    assert_eq!(rec["input_tokens"], 9000);
    assert_eq!(rec["status"], 200);
    // Without the misconfiguration the same request is refused with SGLang's message.
    let c2 = Cluster::start(
        "correct",
        &[
            "--prefill-args",
            "--context-length 16384 --max-total-num-tokens 8192 --max-req-input-len 16000",
        ],
    )
    .await;
    let (status, body) = post(
        &client,
        &format!("{}/generate", c2.router),
        "big-2",
        json!({"text": words(9000)}),
    )
    .await;
    assert_eq!(status, 400);
    assert!(
        String::from_utf8_lossy(&body)
            .contains("exceeds the maximum number of tokens: 9000 > 8192")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_otlp_endpoint_never_blocks_serving_and_failures_are_counted() {
    // Port 9 on loopback: nothing listens, connects are refused.
    let c = Cluster::start("correct", &["--otlp-endpoint", "http://127.0.0.1:9"]).await;
    let client = http_client(8);
    for i in 0..5 {
        let (status, _) = generate(
            &client,
            &c,
            &format!("dead-otlp-{i}"),
            json!({"text": "a b"}),
        )
        .await;
        assert_eq!(status, 200);
    }
    for url in [&c.router, &c.prefill, &c.decode] {
        let s = eventually("export failure counted", Duration::from_secs(15), || {
            let (client, url) = (client.clone(), url.clone());
            async move {
                let s = get_json(&client, &format!("{url}/sim/stats")).await;
                (s["otlp"]["batches_failed"].as_u64().unwrap_or(0) >= 1).then_some(s)
            }
        })
        .await;
        assert!(s["otlp"]["spans_failed"].as_u64().unwrap() >= 1, "{s}");
        assert!(s["otlp"]["export_retries"].as_u64().unwrap() >= 1, "{s}");
        assert_eq!(s["otlp"]["batches_exported"], 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_request_cancelled_while_waiting_for_kv_sends_abort_to_prefill() {
    let (tap, c) =
        ZmtpTap::cluster("correct", "", &["--decode-args", "--kv-timeout-ms 10000"]).await;
    let client = http_client(8);
    let room = 4242u64;
    // Straight to decode, for a room prefill never admitted: decode bootstraps and waits.
    let body = json!({"text": "a b", "bootstrap_host": "127.0.0.1", "bootstrap_port": c.ready["bootstrap_port"], "bootstrap_room": room});
    let url = format!("{}/generate", c.decode);
    let req = post(&client, &url, "cancel-1", body);
    // The client gives up: the connection closes and decode drops the request.
    assert!(
        tokio::time::timeout(Duration::from_millis(500), req)
            .await
            .is_err()
    );
    let p = eventually("prefill receives ABORT", Duration::from_secs(10), || {
        let (client, url) = (client.clone(), c.prefill.clone());
        async move {
            let p = get_json(&client, &format!("{url}/sim/rooms?room={room}")).await;
            (p[0]["abort_frames"] == 1).then_some(p)
        }
    })
    .await;
    assert_eq!(p[0]["bootstrap_frames"], 1);
    let d = get_json(&client, &format!("{}/sim/rooms?room={room}", c.decode)).await;
    assert_eq!(d[0]["outcome"], "cancelled");
    assert_eq!(tap.rooms_with_verb(b"BOOTSTRAP"), vec![room]);
    assert_eq!(
        tap.rooms_with_verb(b"ABORT"),
        vec![room],
        "ABORT seen on the wire"
    );
}

fn u(r: &serde_json::Value, k: &str) -> u64 {
    r[k].as_u64()
        .unwrap_or_else(|| panic!("{k} missing in {r}"))
}

fn by_room(recs: &[serde_json::Value]) -> HashMap<u64, serde_json::Value> {
    recs.iter().map(|r| (u(r, "room"), r.clone())).collect()
}

/// POST to the router; status, `x-smg-error-code`, body, and how long the answer took.
async fn post_timed(
    client: &pd_sim::http::HttpClient,
    c: &Cluster,
    request_id: &str,
    body: serde_json::Value,
) -> (u16, Option<String>, String, Duration) {
    use http_body_util::BodyExt;
    let req = hyper::Request::post(format!("{}/generate", c.router))
        .header("content-type", "application/json")
        .header("x-request-id", request_id)
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .unwrap();
    let t = std::time::Instant::now();
    let resp = tokio::time::timeout(Duration::from_secs(30), client.request(req))
        .await
        .expect("timeout")
        .expect("POST");
    let status = resp.status().as_u16();
    let code = resp
        .headers()
        .get("x-smg-error-code")
        .map(|v| v.to_str().unwrap().to_string());
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        code,
        String::from_utf8_lossy(&body).into_owned(),
        t.elapsed(),
    )
}

/// Write one `/generate` request for `room` straight to decode, close the write side at once
/// (the FIN follows the request), and read whatever decode answers until it closes.
async fn request_then_fin(decode: &str, bootstrap_port: u64, room: u64) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = decode.trim_start_matches("http://");
    let body = json!({"text": "a b", "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port, "bootstrap_room": room})
        .to_string();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "POST /generate HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\nx-request-id: fin-{room}\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    s.shutdown().await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .expect("decode closes the connection")
        .unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_cancel_closes_the_decode_leg_of_every_rejected_attempt_at_once() {
    let prefill_args = format!("{SLOW_OK_PREFILL} --overload-share 0.05");
    let (tap, c) = ZmtpTap::cluster(
        "concurrent-cancel",
        &prefill_args,
        &[
            "--decode-args",
            SLOW_OK_DECODE,
            "--router-args",
            "--retry-initial-backoff-ms 20 --leg-jitter-us 6000 --jitter-seed 3",
        ],
    )
    .await;
    let client = http_client(8);
    // Decode looks prefill's KV endpoint up once; after this it bootstraps at once.
    let (s, _, _, _) = post_timed(&client, &c, "warm-up", json!({"text": "a b"})).await;
    assert_eq!(s, 200);

    // The client gets prefill's 400 at once, with smg's error code (decode's KV would only
    // time out after 60 s: the router does not wait for the decode leg).
    for i in 0..5 {
        let (status, code, body, took) = post_timed(
            &client,
            &c,
            &format!("direct-{i}"),
            json!({"text": words(5000)}),
        )
        .await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(code.as_deref(), Some("prefill_bad_request"));
        assert!(
            body.contains("exceeds the maximum allowed length"),
            "{body}"
        );
        assert!(took < Duration::from_secs(2), "400 took {took:?}");
    }

    let total = 400u64;
    let s = run_load(
        &c.router,
        &[
            "--rate",
            "200",
            "--requests",
            &total.to_string(),
            "--over-capacity-share",
            "0.25",
            "--stream-share",
            "0.2",
            "--seed",
            "21",
        ],
    );
    let ok = s["ok"].as_u64().unwrap();
    let rejected = s["rejected_by_status"]["400"].as_u64().unwrap_or(0);
    assert_eq!(s["errors"], 0, "{s}");
    assert_eq!(ok + rejected, total, "{s}");
    assert_eq!(rejected, s["over_capacity_sent"].as_u64().unwrap(), "{s}");
    assert!(rejected > 60, "{s}");

    let prefill = rooms(&client, &c.prefill).await;
    let rejected_rooms = room_set(&prefill, |r| u(r, "status") >= 400);
    let n503 = prefill.iter().filter(|r| r["status"] == 503).count();
    assert!(n503 > 5, "overload share should produce 503s: {n503}");
    // Every withdrawn decode leg has ended (decode's own `cancelled`).
    let decode = eventually(
        "decode legs of rejected rooms end",
        Duration::from_secs(20),
        || {
            let (client, url, rr) = (client.clone(), c.decode.clone(), rejected_rooms.clone());
            async move {
                let d = by_room(&rooms(&client, &url).await);
                rr.iter()
                    .all(|room| d.get(room).is_some_and(|r| u(r, "ended_ns") > 0))
                    .then_some(d)
            }
        },
    )
    .await;
    let p = by_room(&prefill);
    let mut close_ms = Vec::new();
    let (mut boot_before, mut boot_after) = (0, 0);
    for room in &rejected_rooms {
        let (pr, dr) = (&p[room], &decode[room]);
        assert_eq!(dr["outcome"], "cancelled", "{dr}");
        let verdict = u(pr, "answered_ns");
        let gone = u(dr, "client_gone_ns");
        assert!(
            gone > verdict,
            "decode leg closed before prefill's verdict: {pr} {dr}"
        );
        close_ms.push((gone - verdict) as f64 / 1e6);
        assert!(u(dr, "ended_ns") >= gone);
        // Never any KV for a rejected room, on either side.
        assert_eq!(pr["kv_chunks"], 0, "{pr}");
        assert_eq!(dr["kv_chunks"], 0, "{dr}");
        assert_eq!(dr["kv_done"], false, "{dr}");
        match u(pr, "bootstrap_ns") {
            0 => {}
            b if b < verdict => boot_before += 1,
            _ => boot_after += 1,
        }
    }
    close_ms.sort_by(f64::total_cmp);
    let max = *close_ms.last().unwrap();
    let pct = |q: f64| close_ms[((close_ms.len() - 1) as f64 * q).round() as usize];
    let late = close_ms.iter().filter(|&&ms| ms > 50.0).count();
    eprintln!(
        "decode close after prefill's verdict over {} rejected attempts: p50 {:.2} ms, p95 {:.2} ms, max {max:.2} ms, {late} over 50 ms; BOOTSTRAP before the verdict {boot_before}, after {boot_after}",
        close_ms.len(),
        pct(0.5),
        pct(0.95),
    );
    // The router reacts to the verdict (smg 1.13.0: ~1-50 ms): the median close is within 50 ms.
    // A loaded 2-core box deschedules processes for a while, so single legs may take longer, but
    // every one closes inside the 500 ms cancellation window of `orphaned-leg` (a later close is
    // what that rule reports). The measured latencies belong to docs/routers.md, not here.
    assert!(
        pct(0.5) <= 50.0,
        "median decode close {:.1} ms after the verdict ({late} of {} over 50 ms)",
        pct(0.5),
        close_ms.len()
    );
    assert!(
        max < 500.0,
        "a decode leg closed {max:.1} ms after the verdict"
    );
    assert!(
        boot_before > 0 && boot_after > 0,
        "the leg jitter gives both orders: before {boot_before}, after {boot_after}"
    );
    let stats = get_json(&client, &format!("{}/sim/stats", c.prefill)).await;
    assert_eq!(stats["worker"]["kv_transfers_after_reject"], 0);
    let rs = get_json(&client, &format!("{}/sim/stats", c.router)).await;
    assert_eq!(
        u(&rs["router"], "decode_legs_cancelled"),
        rejected_rooms.len() as u64,
        "{rs}"
    );
    eprintln!(
        "decode legs withdrawn while in transit: {}",
        rs["router"]["decode_legs_cancelled_in_transit"]
    );
    // A decode that bootstrapped a rejected room aborts it (SGLang's decode), on the wire too.
    let bootstrapped: HashSet<u64> = rejected_rooms
        .iter()
        .copied()
        .filter(|r| decode[r]["bootstrap_frames"] == 1)
        .collect();
    assert!(!bootstrapped.is_empty());
    eventually(
        "an ABORT for every bootstrapped rejected room",
        Duration::from_secs(10),
        || {
            let aborted: HashSet<u64> = tap.rooms_with_verb(b"ABORT").into_iter().collect();
            let b = bootstrapped.clone();
            async move { b.is_subset(&aborted).then_some(()) }
        },
    )
    .await;
    // Successful requests are untouched: decode generated them.
    for (room, pr) in &p {
        if pr["status"] == 200 && pr["request_id"] != "warm-up" {
            assert_eq!(decode[room]["outcome"], "generated", "{}", decode[room]);
        }
    }
    // 503s were retried with a new room each; the previous decode leg closed first.
    let mut by_request: HashMap<String, Vec<&serde_json::Value>> = HashMap::new();
    for r in &prefill {
        by_request
            .entry(r["request_id"].as_str().unwrap().to_string())
            .or_default()
            .push(r);
    }
    assert_eq!(p.len(), prefill.len(), "rooms are unique");
    let mut retried = 0;
    for attempts in by_request.values_mut() {
        attempts.sort_by_key(|r| u(r, "received_ns"));
        for pair in attempts.windows(2) {
            assert_eq!(pair[0]["status"], 503, "only a 503 is retried: {pair:?}");
            let (prev, next) = (&decode[&u(pair[0], "room")], u(pair[1], "room"));
            let next_received = decode.get(&next).map(|r| u(r, "received_ns"));
            // The router closes the previous leg before it dispatches the next one; decode sees
            // the two on different connections, so on a loaded box it may read the new request
            // a little before it notices the close. The close must not be a reaction to anything
            // later: it is seen within 100 ms of the next leg's arrival.
            if let Some(t) = next_received {
                assert!(
                    u(prev, "client_gone_ns") <= t + 100_000_000,
                    "previous decode leg still open: {prev}"
                );
            }
            retried += 1;
        }
    }
    assert!(retried > 0);

    // A request whose client closes right after sending it is still seen by decode, which
    // bootstraps, then honours the cancel: ABORT, and no answer on the socket.
    let bport = c.ready["bootstrap_port"].as_u64().unwrap();
    let answer = request_then_fin(&c.decode, bport, 777).await;
    assert_eq!(answer, "", "decode answered a withdrawn request");
    let d = get_json(&client, &format!("{}/sim/rooms?room=777", c.decode)).await;
    assert_eq!(d[0]["outcome"], "cancelled", "{d}");
    assert_eq!(d[0]["bootstrap_frames"], 1, "{d}");
    eventually("ABORT 777", Duration::from_secs(5), || {
        let seen = tap.rooms_with_verb(b"ABORT").contains(&777);
        async move { seen.then_some(()) }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_cancel_retries_503_with_new_rooms_closing_each_decode_leg_first() {
    let otlp = OtlpReceiver::start().await;
    let c = Cluster::start(
        "concurrent-cancel",
        &[
            "--otlp-endpoint",
            &otlp.url,
            "--prefill-args",
            "--overload-share 1.0",
            "--router-args",
            // Up to 50 ms in transit: prefill's 503 comes first, mostly, and the decode leg is
            // withdrawn on its way (it arrives, then is closed).
            "--retry-initial-backoff-ms 20 --leg-jitter-us 50000 --jitter-seed 5",
        ],
    )
    .await;
    let client = http_client(8);
    let (status, code, body, _) =
        post_timed(&client, &c, "storm-c", json!({"text": "hello there"})).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(code.as_deref(), Some("prefill_unavailable"));
    assert!(body.contains("The request queue is full."));
    let prefill: Vec<_> = rooms(&client, &c.prefill)
        .await
        .into_iter()
        .filter(|r| r["request_id"] == "storm-c")
        .collect();
    assert_eq!(prefill.len(), 5, "{prefill:?}");
    let storm_rooms = room_set(&prefill, |r| r["status"] == 503);
    assert_eq!(storm_rooms.len(), 5, "a new bootstrap_room per attempt");
    let mut decode = eventually(
        "five decode legs, all ended",
        Duration::from_secs(10),
        || {
            let (client, url) = (client.clone(), c.decode.clone());
            async move {
                let d: Vec<_> = rooms(&client, &url)
                    .await
                    .into_iter()
                    .filter(|r| r["request_id"] == "storm-c")
                    .collect();
                (d.len() == 5 && d.iter().all(|r| u(r, "ended_ns") > 0)).then_some(d)
            }
        },
    )
    .await;
    assert_eq!(
        decode.iter().map(|r| u(r, "room")).collect::<HashSet<_>>(),
        storm_rooms
    );
    decode.sort_by_key(|r| u(r, "received_ns"));
    for r in &decode {
        assert_eq!(r["outcome"], "cancelled", "{r}");
    }
    for pair in decode.windows(2) {
        assert!(
            u(&pair[0], "ended_ns") <= u(&pair[1], "received_ns"),
            "the next attempt's decode leg came before the previous one closed: {pair:?}"
        );
    }
    let rs = get_json(&client, &format!("{}/sim/stats", c.router)).await;
    assert_eq!(u(&rs["router"], "decode_legs_cancelled"), 5, "{rs}");
    assert!(
        u(&rs["router"], "decode_legs_cancelled_in_transit") >= 1,
        "a leg withdrawn in transit is delivered, then closed: {rs}"
    );
    // smg's span: one per client request, both legs sent and settled once per attempt.
    let router = eventually("the router span", Duration::from_secs(10), || {
        let spans = otlp.spans.clone();
        async move {
            let g = spans.lock().unwrap();
            g.iter()
                .find(|(svc, s)| {
                    svc == "smg"
                        && s.name == "http_request"
                        && attr(s, "request_id") == Some("storm-c")
                })
                .map(|(_, s)| s.clone())
        }
    })
    .await;
    assert_eq!(attr(&router, "status_code"), Some("503"));
    let count = |name: &str| router.events.iter().filter(|e| e.name == name).count();
    assert_eq!(count("Sending concurrent requests"), 5);
    assert_eq!(count("Received concurrent requests"), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_that_ignores_cancel_keeps_the_withdrawn_leg_going_and_answers() {
    let (tap, c) = ZmtpTap::cluster(
        "concurrent-cancel",
        "",
        &[
            "--decode-args",
            "--decode-ignores-cancel --kv-timeout-ms 1000",
        ],
    )
    .await;
    let client = http_client(8);
    let (s, _, _, _) = post_timed(&client, &c, "warm-up", json!({"text": "a b"})).await;
    assert_eq!(s, 200);
    let n = 20;
    for i in 0..n {
        let (status, code, _, took) = post_timed(
            &client,
            &c,
            &format!("ign-{i}"),
            json!({"text": words(5000)}),
        )
        .await;
        assert_eq!(status, 400);
        assert_eq!(code.as_deref(), Some("prefill_bad_request"));
        assert!(
            took < Duration::from_millis(900),
            "the router waited for decode: {took:?}"
        );
    }
    let legs = eventually("the ignored legs end", Duration::from_secs(10), || {
        let (client, url) = (client.clone(), c.decode.clone());
        async move {
            let d: Vec<_> = rooms(&client, &url)
                .await
                .into_iter()
                .filter(|r| {
                    r["request_id"]
                        .as_str()
                        .is_some_and(|id| id.starts_with("ign-"))
                })
                .collect();
            (d.len() == n && d.iter().all(|r| u(r, "ended_ns") > 0)).then_some(d)
        }
    })
    .await;
    for r in &legs {
        // The router closed the leg; decode went on: bootstrapped, waited out its KV timeout,
        // answered 500.
        assert_eq!(r["outcome"], "cancel-ignored", "{r}");
        assert_eq!(r["final_outcome"], "kv-failed", "{r}");
        assert_eq!(r["status"], 500, "{r}");
        assert_eq!(r["bootstrap_frames"], 1, "{r}");
        let (gone, ended) = (u(r, "client_gone_ns"), u(r, "ended_ns"));
        assert!(gone > 0);
        assert!(
            ended >= u(r, "bootstrap_ns") + 990_000_000 && ended > gone + 500_000_000,
            "ended before its KV timeout: {r}"
        );
    }
    let ds = get_json(&client, &format!("{}/sim/stats", c.decode)).await;
    assert_eq!(u(&ds["worker"], "cancels_ignored"), n as u64, "{ds}");
    assert_eq!(ds["worker"]["cancelled"], 0, "{ds}");
    // Its answer goes out on the socket, which stays open until then.
    let bport = c.ready["bootstrap_port"].as_u64().unwrap();
    let answer = request_then_fin(&c.decode, bport, 4711).await;
    assert!(answer.starts_with("HTTP/1.1 500"), "{answer}");
    assert!(answer.contains("Decode transfer failed"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("connection: close"),
        "{answer}"
    );
    let d = get_json(&client, &format!("{}/sim/rooms?room=4711", c.decode)).await;
    assert_eq!(d[0]["outcome"], "cancel-ignored", "{d}");
    // No ABORT ever: prefill's count and the wire agree.
    let ps = get_json(&client, &format!("{}/sim/stats", c.prefill)).await;
    assert_eq!(ps["worker"]["abort_frames"], 0, "{ps}");
    assert!(tap.rooms_with_verb(b"ABORT").is_empty());
    assert_eq!(tap.rooms_with_verb(b"BOOTSTRAP").len(), n + 2);
}
