//! The vLLM flavour's isolation faults, each leaving records that say which requests were hit
//! and whose KV their decode read: `stale-kv-params` and `forged-kv-params` at prefill (they
//! work behind any router), `reuse-kv-params` in pd-sim's router.

use crate::support;

use std::collections::HashMap;
use std::time::Duration;

use pd_sim::http::{HttpClient, http_client};
use serde_json::{Value, json};
use support::*;

async fn records(client: &HttpClient, base: &str) -> Vec<Value> {
    get_json(client, &format!("{base}/sim/requests"))
        .await
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// `n` requests one after the other through the router; the X of each (from `cmpl-X`).
async fn send(client: &HttpClient, c: &Cluster, n: usize) -> Vec<String> {
    let mut xs = Vec::new();
    for i in 0..n {
        let (s, body) = post(
            client,
            &format!("{}/v1/completions", c.router),
            &format!("client-{i}"),
            json!({"prompt": words(5 + i), "max_tokens": 2}),
        )
        .await;
        assert_eq!(s, 200, "{}", String::from_utf8_lossy(&body));
        let v: Value = serde_json::from_slice(&body).unwrap();
        xs.push(
            v["id"]
                .as_str()
                .unwrap()
                .strip_prefix("cmpl-")
                .unwrap()
                .to_owned(),
        );
    }
    xs
}

fn by(recs: &[Value], field: &str) -> HashMap<String, Value> {
    recs.iter()
        .map(|r| (r[field].as_str().unwrap_or("").to_owned(), r.clone()))
        .collect()
}

fn count(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_kv_params_hand_decode_the_previous_requests_kv() {
    let c = Cluster::start(
        "correct",
        &[
            "--flavour",
            "vllm",
            "--fault",
            "stale-kv-params",
            "--fault-rate",
            "1",
        ],
    )
    .await;
    let client = http_client(8);
    let xs = send(&client, &c, 3).await;
    let p = by(&records(&client, &c.prefill).await, "id");
    let d = by(&records(&client, &c.decode).await, "id");
    let key = |x: &str| format!("cmpl-{x}-0");
    // The first request has no predecessor: clean.
    let first = &p[&key(&xs[0])];
    assert!(first["fault"].is_null(), "{first}");
    assert_eq!(d[&key(&xs[0])]["remote_request_id"], first["internal_id"]);
    for i in 1..3 {
        let pr = &p[&key(&xs[i])];
        assert_eq!(pr["fault"], "injected-stale-kv-params", "{pr}");
        let of = key(&xs[i - 1]);
        assert_eq!(pr["params_of"], of.as_str(), "{pr}");
        let theirs = &p[&of]["internal_id"];
        assert_eq!(pr["answered_remote_request_id"], *theirs, "{pr}");
        // Decode read the earlier request's KV.
        assert_eq!(d[&key(&xs[i])]["remote_request_id"], *theirs);
    }
    // The second request's decode read blocks the first one's decode had freed: prefill
    // does not recognize that notification. The third read the second's blocks, which were
    // still held (their own decode never came): those look like a normal transfer.
    let s = eventually(
        "notifications counted",
        Duration::from_secs(10),
        async || {
            let s = get_json(&client, &format!("{}/sim/stats", c.prefill)).await;
            (count(&s["worker"]["notifications_received"]) == 3).then_some(s)
        },
    )
    .await;
    assert_eq!(count(&s["worker"]["notifications_after_expiry"]), 1, "{s}");
    assert_eq!(
        s["unrecognized_notifications"],
        json!([p[&key(&xs[0])]["internal_id"]])
    );
    assert_eq!(count(&s["worker"]["faults_injected"]), 2, "{s}");
    // The last request's own blocks were never read: still held, for the lease.
    assert_eq!(count(&s["kv_holds"]), 1, "{s}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_kv_params_name_an_id_prefill_never_issued() {
    let c = Cluster::start(
        "correct",
        &[
            "--flavour",
            "vllm",
            "--fault",
            "forged-kv-params",
            "--fault-rate",
            "1",
        ],
    )
    .await;
    let client = http_client(8);
    let xs = send(&client, &c, 2).await;
    let p = by(&records(&client, &c.prefill).await, "id");
    let d = by(&records(&client, &c.decode).await, "id");
    let issued: Vec<&Value> = p.values().map(|r| &r["internal_id"]).collect();
    for x in &xs {
        let k = format!("cmpl-{x}-0");
        assert_eq!(p[&k]["fault"], "injected-forged-kv-params");
        let forged = d[&k]["remote_request_id"].as_str().unwrap();
        assert!(forged.starts_with("cmpl-forged-"), "{forged}");
        assert_eq!(p[&k]["answered_remote_request_id"], forged);
        assert!(!issued.contains(&&json!(forged)));
    }
    eventually(
        "notifications counted",
        Duration::from_secs(10),
        async || {
            let s = get_json(&client, &format!("{}/sim/stats", c.prefill)).await;
            (count(&s["worker"]["notifications_after_expiry"]) == 2).then_some(())
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reuse_kv_params_router_sends_the_previous_params_every_nth_request() {
    let c = Cluster::start(
        "reuse-kv-params",
        &[
            "--flavour",
            "vllm",
            "--router-args",
            "--reuse-kv-params-every 3",
        ],
    )
    .await;
    let client = http_client(8);
    let xs = send(&client, &c, 6).await;
    let r = get_json(&client, &format!("{}/sim/stats", c.router)).await;
    let reused = r["reused_kv_params"].as_array().unwrap().clone();
    assert_eq!(reused.len(), 2, "{r}");
    let p = by(&records(&client, &c.prefill).await, "id");
    let d = by(&records(&client, &c.decode).await, "id");
    for (n, (hit, of)) in [(2usize, 1usize), (5, 4)].into_iter().enumerate() {
        let e = &reused[n];
        assert_eq!(e["request_id"], xs[hit].as_str(), "{e}");
        assert_eq!(e["params_of"], xs[of].as_str(), "{e}");
        let theirs = &p[&format!("cmpl-{}-0", xs[of])]["internal_id"];
        assert_eq!(e["remote_request_id"], *theirs);
        assert_eq!(
            d[&format!("cmpl-{}-0", xs[hit])]["remote_request_id"],
            *theirs
        );
        // Prefill itself answered correctly: the fault is the router's.
        assert!(p[&format!("cmpl-{}-0", xs[hit])]["fault"].is_null());
    }
    assert_eq!(
        count(&r["router"]["decode_legs_with_reused_kv_params"]),
        2,
        "{r}"
    );
}
