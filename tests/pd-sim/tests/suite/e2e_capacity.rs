//! End-to-end test 4 of the flagship issue: over-capacity, on the OTLP path.
//!
//! A prefill worker misconfigured the way the rule is about: `context_length` 16384 but a KV pool
//! (`max_total_num_tokens`) of 8192, with the total-tokens check skipped, so it admits inputs it
//! cannot hold. It reports its limits as a `server_info` span (`--capacity-report-interval-s`;
//! SGLang itself exports no such span) that a generic mapping in revenant's config turns into a
//! capacity report; request roots carry `gen_ai.usage.input_tokens`. Expected:
//! `context-exceeds-capacity` for that worker, and one `over-capacity-admitted` per admitted
//! attempt whose input exceeds 8192 tokens — counted from the simulator's own room records.
//!
//! Needs the revenant binary next to this test (`cargo build -p revenant`), so it is ignored by
//! default; `cargo xtask test` runs it.

use crate::support;

use std::collections::BTreeSet;
use std::time::Duration;

use pd_sim::http::http_client;
use serde_json::Value;
use support::*;
use test_harness::notifications::room_of;
use test_harness::{Revenant, ScratchDir};

const MAPPING: &str = r#"
normalize:
  generic:
    - name: pd-sim-server-info
      select: { scope_name: "pd-sim server_info" }
      ids: { trace_id: false }
      tokens:
        context_tokens: [context_length]
        max_total_tokens: [max_total_num_tokens]
        max_input_tokens: [max_req_input_len]
      rules:
        - { name: server_info, attributes: { disaggregation_mode: prefill }, stage: prefill, kind: capacity }
        - { name: server_info, attributes: { disaggregation_mode: decode }, stage: decode, kind: capacity }
"#;

/// The misconfigured prefill: processable = min(max_req_input_len, max_total_num_tokens) = 8192.
const PREFILL: &str = "--context-length 16384 --max-total-num-tokens 8192 --max-req-input-len 16000 \
                       --skip-total-tokens-check --capacity-report-interval-s 1";
const PROCESSABLE: u64 = 8192;
/// Decode is sound. Its max_req_input_len is set to its context length: SGLang's default
/// (context − 1) would trip `context-exceeds-capacity` on every stock worker (see the report).
const DECODE: &str = "--max-req-input-len 32768 --capacity-report-interval-s 1";

fn violations(r: &Revenant) -> Vec<Value> {
    let (status, v) = r
        .admin_json("/api/violations?limit=10000")
        .unwrap_or_else(|e| panic!("admin: {e}"));
    assert_eq!(status, 200, "{v}");
    v["violations"].as_array().cloned().unwrap_or_default()
}

fn of_rule<'a>(v: &'a [Value], rule: &str) -> Vec<&'a Value> {
    v.iter().filter(|v| v["rule"] == rule).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the revenant binary (cargo build -p revenant); run by cargo xtask test"]
async fn over_capacity_worker_and_admitted_over_capacity_requests_via_otlp() {
    let scratch = ScratchDir::new("e2e-capacity").unwrap();
    let cfg = scratch.path().join("revenant.yaml");
    std::fs::write(&cfg, MAPPING).unwrap();
    let rev = start_revenant(scratch.path(), &["--config", &cfg.display().to_string()]);
    let otlp = format!("http://{}", rev.otlp_http);
    let c = Cluster::start(
        "correct",
        &[
            "--otlp-endpoint",
            &otlp,
            "--prefill-args",
            PREFILL,
            "--decode-args",
            DECODE,
        ],
    )
    .await;
    let ctx = |rev: &Revenant| {
        format!(
            "revenant stderr:\n{}\n(scratch {}; PD_SIM_KEEP_SCRATCH=1 keeps it)",
            rev.log_tail(40),
            scratch.path().display()
        )
    };

    // The worker's own report, before any request: its context exceeds its KV pool.
    let cec = eventually(
        "context-exceeds-capacity for the prefill worker",
        Duration::from_secs(20),
        || {
            let v = violations(&rev);
            async move {
                let c: Vec<Value> = of_rule(&v, "context-exceeds-capacity")
                    .into_iter()
                    .cloned()
                    .collect();
                (!c.is_empty()).then_some(c)
            }
        },
    )
    .await;
    let server_info = get_json(&http_client(2), &format!("{}/server_info", c.prefill)).await;
    assert!(
        server_info["context_length"].as_u64() > server_info["max_total_num_tokens"].as_u64(),
        "{server_info}"
    );
    for v in &cec {
        let ev = &v["evidence"][0];
        assert_eq!(ev["stage"], "prefill", "{v}");
        assert_eq!(ev["kind"], "capacity", "{v}");
        assert_eq!(ev["source"], "otlp", "{v}");
    }

    // Load: a quarter of the requests between 9000 and 12000 words — over the 8192 tokens prefill
    // can hold, under its 16000-token input limit, so it admits them.
    let router = c.router.clone();
    let load = tokio::task::block_in_place(move || {
        run_load(
            &router,
            &[
                "--rate",
                "100",
                "--requests",
                "120",
                "--prompt-len",
                "8..64",
                "--over-capacity-share",
                "0.25",
                "--over-capacity-len",
                "9000..12000",
                "--request-id-prefix",
                "cap",
            ],
        )
    });
    assert_eq!(load["errors"], 0, "{load}");

    // The simulator's accounting: every prefill attempt admitted with more input than it holds.
    let rooms = rooms(&http_client(2), &c.prefill).await;
    let over: BTreeSet<u64> = rooms
        .iter()
        .filter(|r| r["status"] == 200 && r["input_tokens"].as_u64() > Some(PROCESSABLE))
        .map(|r| r["room"].as_u64().unwrap())
        .collect();
    let sent_over = load["over_capacity_sent"].as_u64().unwrap();
    assert!(sent_over > 0, "{load}");
    assert_eq!(
        over.len() as u64,
        sent_over,
        "every over-capacity request was admitted"
    );

    let found = eventually(
        "one over-capacity-admitted per over-capacity attempt",
        Duration::from_secs(30),
        || {
            let v = violations(&rev);
            let over = over.clone();
            async move {
                let seen: BTreeSet<u64> = of_rule(&v, "over-capacity-admitted")
                    .iter()
                    .filter_map(|v| room_of(&v["attempt"]))
                    .collect();
                over.is_subset(&seen).then_some(v)
            }
        },
    )
    .await;
    let oca = of_rule(&found, "over-capacity-admitted");
    let ctx = ctx(&rev);
    assert_eq!(
        oca.len(),
        over.len(),
        "exactly one per over-capacity attempt, none for the others: {ctx}"
    );
    for v in &oca {
        let off = v["evidence"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["role"] == "offender")
            .unwrap_or_else(|| panic!("{v}"));
        assert_eq!(off["stage"], "prefill", "{v}");
        assert_eq!(off["source"], "otlp", "{v}");
    }
    // Nothing else fired: the router is correct, every other request fits.
    let others: Vec<&Value> = found
        .iter()
        .filter(|v| {
            v["rule"] != "over-capacity-admitted" && v["rule"] != "context-exceeds-capacity"
        })
        .collect();
    assert!(others.is_empty(), "{others:?}\n{ctx}");
    let cec_now = of_rule(&found, "context-exceeds-capacity");
    assert!(
        cec_now
            .iter()
            .all(|v| v["evidence"][0]["stage"] == "prefill"),
        "only the prefill worker is misconfigured: {cec_now:?}"
    );
    eprintln!(
        "{} over-capacity attempts admitted, {} over-capacity-admitted, {} context-exceeds-capacity",
        over.len(),
        oca.len(),
        cec_now.len()
    );
}
