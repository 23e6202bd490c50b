//! The real smg 1.13.0 in front of the SGLang truth source (`tests/sglang-harness`): prefill and
//! decode workers that run SGLang 0.5.23's own HTTP server, tokenizer manager, bootstrap server,
//! Mooncake KV managers, senders, receivers and tracing module (the model and the scheduler
//! loop played), KV moved by Mooncake's TCP transport over loopback. The oracle is what SGLang's
//! code did, as the workers' ground truth records it per room (senders and receivers, polled
//! statuses, every ZMQ frame sent and received, the KV bytes that landed) and as its spans say.
//!
//! One decode worker serves two prefill workers, each behind its own smg: prefill `fixed`
//! (0.5.23: a request refused at intake is retired before any sender exists) and prefill `stub`
//! (<= 0.5.20: the refused request bootstraps and transfers a one-token stub first). Prefill's
//! context is 128 tokens and its KV pool 96 pages, so its scheduler admits at most 90 tokens:
//! a prompt of >= 128 words is refused by SGLang's tokenizer manager, one of 90..127 words by its
//! scheduler (`validate_input_length`). Decode has a 4096-token context: it accepts them all,
//! as a decode sized for longer prompts would.
//!
//! Ignored by default: it needs target/sglang-venv (`SGLANG_HARNESS_PYTHON`) and smg 1.13.0
//! (`PD_SIM_SMG113`); `cargo xtask test` creates both and runs it. By hand:
//!   SGLANG_HARNESS_PYTHON=target/sglang-venv/bin/python \
//!   PD_SIM_SMG113=target/xtask-venv-smg113/bin/smg \
//!     cargo test -p e2e --test sglang_harness -- --ignored --nocapture

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use test_harness::sglang::{
    OtlpSink, Role, SglangWorker, Smg, WorkerOptions, harness_python, start_workers,
    write_model_dir,
};
use test_harness::{HttpResponse, Revenant, ScratchDir, http_post_json};

const PREFILL_CONTEXT: u32 = 128;
const PREFILL_KV_PAGES: u32 = 96;
/// min(context - 1, capacity - 1) - 5 (TpModelWorker.get_worker_info)
const PREFILL_MAX_INPUT: u64 = 90;
/// Decode's SGLANG_DISAGGREGATION_WAITING_TIMEOUT here (SGLang's default: 300 s): well past
/// revenant's 6 s window for a decode leg, so the leg smg keeps is one it holds too long.
const DECODE_WAITING_TIMEOUT_S: u32 = 12;
/// SGLANG_REQUEST_STATE_WAIT_TIMEOUT: how often a non-streamed request's tokenizer-manager
/// task looks for a gone client.
const STATE_WAIT_S: f64 = 4.0;

fn prompt(words: u64) -> String {
    vec!["hello"; words as usize].join(" ")
}

/// A request body for one of SGLang's APIs; `words` is also its prompt length in tokens, which
/// is how the test finds it in the ground truth (every request of a run has its own length).
/// `model` is the served model name (the model directory): smg routes OpenAI requests by it.
fn body(model: &str, path: &str, words: u64, stream: bool) -> Value {
    match path {
        "/generate" => json!({"text": prompt(words),
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "stream": stream}),
        "/v1/completions" => json!({"model": model, "prompt": prompt(words),
            "max_tokens": 4, "stream": stream}),
        "/v1/chat/completions" => json!({"model": model,
            "messages": [{"role": "user", "content": prompt(words)}],
            "max_tokens": 4, "stream": stream}),
        other => panic!("no body for {other}"),
    }
}

fn post(url: &str, body: &Value) -> (HttpResponse, Duration) {
    let started = Instant::now();
    let r = http_post_json(url, body.to_string().as_bytes(), Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("POST {url}: {e:#}"));
    (r, started.elapsed())
}

/// Polls `f` every 100 ms until it returns Some, at most `timeout`.
fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn events<'a>(truth: &'a [Value], event: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    truth.iter().filter(move |r| r["event"] == event)
}

/// Rooms of the requests (other than warmups) with this prompt length a worker received.
fn rooms_of(truth: &[Value], tokens: u64) -> BTreeSet<u64> {
    events(truth, "request_received")
        .filter(|r| r["input_tokens"] == tokens && r["bootstrap_host"] != "2.2.2.2")
        .filter_map(|r| r["room"].as_u64())
        .collect()
}

fn of_room<'a>(truth: &'a [Value], event: &'a str, room: u64) -> Vec<&'a Value> {
    events(truth, event).filter(|r| r["room"] == room).collect()
}

/// ZMQ messages (send or recv) whose frames name the room, as their frame lists.
fn frames(truth: &[Value], event: &str, room: u64) -> Vec<(u64, Vec<Value>)> {
    let room = room.to_string();
    events(truth, event)
        .filter_map(|r| {
            let f = r["frames"].as_array()?;
            let names_room = f.first() == Some(&Value::from(room.as_str()))
                || f.get(1) == Some(&Value::from(room.as_str()));
            names_room.then(|| (r["ts_ns"].as_u64().unwrap_or(0), f.clone()))
        })
        .collect()
}

/// When the room's Success status was sent or read (`event`): prefill's Mooncake status message
/// `[room, status, rank]` with `KVPoll.Success` = `"4"` (SGLang 0.5.23
/// `disaggregation/common/conn.py` `_encode_kv_status_message`, line 739).
fn success_status(truth: &[Value], event: &str, room: u64) -> Option<u64> {
    frames(truth, event, room)
        .into_iter()
        .find(|(_, f)| f.len() == 3 && f[1] == "4")
        .map(|(t, _)| t)
}

fn ts(r: &Value) -> u64 {
    r["ts_ns"].as_u64().unwrap_or(0)
}

fn ms(a: u64, b: u64) -> f64 {
    (b as f64 - a as f64) / 1e6
}

fn one<'a>(v: Vec<&'a Value>, what: &str) -> &'a Value {
    assert_eq!(v.len(), 1, "expected exactly one {what}, got {v:#?}");
    v[0]
}

/// Decode's side of a room prefill never opened: a receiver, destinations published (the
/// 10-frame metadata message to prefill's rank port), then the end of the wait.
struct Stranded {
    published_ns: u64,
    abort_ns: u64,
    abort_frames: Vec<Value>,
}

fn stranded(decode: &[Value], room: u64) -> Option<Stranded> {
    one(of_room(decode, "receiver_created", room), "receiver");
    let published = of_room(decode, "metadata_published", room);
    let published_ns = ts(published.first()?);
    let meta = frames(decode, "zmq_send", room);
    let (_, metadata) = meta.iter().find(|(_, f)| f.len() == 10)?;
    assert_eq!(metadata[7], "1", "required_dst_info_num: {metadata:?}");
    let (abort_ns, abort_frames) = meta.into_iter().find(|(_, f)| f[0] == "ABORT")?;
    Some(Stranded {
        published_ns,
        abort_ns,
        abort_frames,
    })
}

struct Setup {
    /// The served model name.
    model: String,
    // Field order is drop order: routers, then workers.
    smg_fixed: Smg,
    smg_stub: Smg,
    prefill_fixed: SglangWorker,
    prefill_stub: SglangWorker,
    decode: SglangWorker,
    sink: OtlpSink,
    /// `revenant run` watching it all (eBPF and OTLP), started before anything else so that it
    /// follows each worker's scheduler processes from their fork.
    revenant: Revenant,
    scratch: ScratchDir,
}

/// `revenant run` (release build, `REVENANT_BIN`) with both witnesses: eBPF on the harness
/// workers of this test (their command lines name this test's scratch directory) and on smg
/// (retitled `smg::router`), OTLP/HTTP for the spans the sink forwards. Every event is recorded
/// (`events.jsonl`) so that each witness alone can be judged again by `revenant check`.
fn start_revenant(dir: &std::path::Path) -> Revenant {
    assert!(
        test_harness::is_root(),
        "revenant's eBPF witness needs root (cargo xtask test runs as root, as CI does)"
    );
    let bin = test_harness::workspace_bin("revenant", "REVENANT_BIN").unwrap();
    let here = regex_escape(&dir.display().to_string());
    let watch = |role: &str| format!("{role}=sglang_harness worker --role {role} .*{here}");
    let args: Vec<String> = [
        "--ebpf",
        "on",
        "--no-sglang-conventions",
        "--watch",
        &watch("prefill"),
        "--watch",
        &watch("decode"),
        "--watch",
        "router=^smg::router",
        "--otlp-grpc",
        "off",
        "--otlp-http",
        "127.0.0.1:0",
        // Every violation and notification is kept and written.
        "--rate-limit",
        "0",
        "--recent-violations",
        "100000",
        "--corroboration-window",
        "3s",
        "--spool-no-fsync",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let rv_dir = dir.join("revenant");
    std::fs::create_dir_all(&rv_dir).unwrap();
    Revenant::start_recording(&bin, &rv_dir, &args, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e:#}"))
}

fn regex_escape(s: &str) -> String {
    s.chars()
        .flat_map(|c| {
            let special = "\\.+*?()|[]{}^$".contains(c);
            special.then_some('\\').into_iter().chain([c])
        })
        .collect()
}

fn setup() -> Setup {
    let python = harness_python();
    let smg_bin = test_harness::router_from_env("PD_SIM_SMG113", "smg 1.13.0");
    let scratch = ScratchDir::new("sglang-harness").unwrap();
    let revenant = start_revenant(scratch.path());
    let model = scratch.path().join("model");
    write_model_dir(&python, &model).unwrap();
    let forward = format!("http://{}/v1/traces", revenant.otlp_http);
    let sink = OtlpSink::start_forwarding(&python, scratch.path(), Some(&forward)).unwrap();
    let traced = |mut o: WorkerOptions| {
        o.otlp_http = Some(sink.endpoint.clone());
        o
    };
    let prefill = |host: &str, intake: &'static str| {
        let mut o = WorkerOptions::new(Role::Prefill, host, PREFILL_CONTEXT, PREFILL_KV_PAGES);
        o.intake_reject = intake;
        traced(o)
    };
    let mut decode = WorkerOptions::new(Role::Decode, "127.0.0.3", 4096, 4096);
    decode.waiting_timeout_s = Some(DECODE_WAITING_TIMEOUT_S);
    let started = Instant::now();
    let mut workers = start_workers(
        &python,
        &[
            prefill("127.0.0.2", "fixed"),
            prefill("127.0.0.4", "stub"),
            traced(decode),
        ],
        &model,
        scratch.path(),
        // ~45 s on a quiet 2-core box (each worker's three processes import SGLang, ~9 s of
        // CPU each); well over 100 s while other builds share the cores.
        Duration::from_secs(300),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!(
        "three SGLang workers ready in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let decode = workers.pop().unwrap();
    let prefill_stub = workers.pop().unwrap();
    let prefill_fixed = workers.pop().unwrap();
    let smg = |p: &SglangWorker, name: &str| {
        Smg::start(
            &smg_bin,
            p,
            &decode,
            &model,
            &scratch.path().join(format!("smg-{name}.log")),
            &[],
        )
        .unwrap_or_else(|e| panic!("smg: {e:#}"))
    };
    let smg_fixed = smg(&prefill_fixed, "fixed");
    let smg_stub = smg(&prefill_stub, "stub");
    Setup {
        model: model.display().to_string(),
        smg_fixed,
        smg_stub,
        prefill_fixed,
        prefill_stub,
        decode,
        sink,
        revenant,
        scratch,
    }
}

#[test]
#[ignore = "needs target/sglang-venv (SGLANG_HARNESS_PYTHON) and smg 1.13.0 (PD_SIM_SMG113); cargo xtask test runs it"]
fn smg_1_13_in_front_of_sglang_0_5_23() {
    let s = setup();
    let run_started = Instant::now();

    // SGLang's own startup warmup (http_server._execute_server_warmup): /generate with
    // bootstrap_host 2.2.2.2 and room 0 through the fake transfer backend, on every worker.
    for w in [&s.prefill_fixed, &s.prefill_stub, &s.decode] {
        let t = w.truth();
        assert!(
            events(&t, "request_received")
                .any(|r| r["bootstrap_host"] == "2.2.2.2" && r["room"] == 0),
            "{:?} saw no warmup",
            w.role
        );
        assert!(
            events(&t, "zmq_send")
                .chain(events(&t, "zmq_recv"))
                .all(|r| r["frames"][0] != "0"),
            "the warmup (room 0, fake backend) must produce no ZMQ traffic"
        );
    }

    // ---- admitted requests: every API, streamed and not ----
    let admitted: Vec<(&str, u64, bool)> = vec![
        ("/generate", 10, false),
        ("/generate", 11, true),
        ("/v1/completions", 12, false),
        ("/v1/completions", 13, true),
        ("/v1/chat/completions", 14, false),
        ("/v1/chat/completions", 15, true),
    ];
    let mut admitted_latency = Vec::new();
    for &(path, words, stream) in &admitted {
        let (r, took) = post(
            &format!("{}{path}", s.smg_fixed.url),
            &body(&s.model, path, words, stream),
        );
        assert_eq!(r.status, 200, "{path} {words} words: {}", r.body);
        admitted_latency.push(took.as_secs_f64() * 1000.0);
        if stream {
            assert!(
                r.body.starts_with("data: ") || r.body.contains("\ndata: "),
                "{}",
                r.body
            );
            if path != "/generate" {
                assert!(r.body.trim_end().ends_with("data: [DONE]"), "{}", r.body);
            }
        } else {
            let v: Value = serde_json::from_str(&r.body).unwrap();
            let done = match path {
                "/generate" => v["meta_info"]["finish_reason"]["type"] == "length",
                _ => v["choices"][0]["finish_reason"] == "length",
            };
            assert!(done, "{path}: {v}");
        }
    }

    // The stub prefill serves a request before its refusal, as a prefill in service has: its
    // status socket to decode is then connected (SGLang keeps one per decode endpoint,
    // `CommonKVManager._connect`), so the stub's Success does not wait on a TCP and ZMTP
    // handshake. A correct request through the <= 0.5.20 prefill: no alert.
    let (r, _) = post(
        &format!("{}/generate", s.smg_stub.url),
        &body(&s.model, "/generate", 17, false),
    );
    assert_eq!(r.status, 200, "stub prefill, 17 words: {}", r.body);

    // ---- refused requests, in parallel (decode holds their rooms for seconds) ----
    let fixed = s.smg_fixed.url.clone();
    let stub = s.smg_stub.url.clone();
    let refused: Vec<(&'static str, String, &'static str, u64, bool)> = vec![
        // (what, router, path, words, stream)
        (
            "tokenizer, non-streamed",
            fixed.clone(),
            "/generate",
            200,
            false,
        ),
        (
            "tokenizer, chat, non-streamed",
            fixed.clone(),
            "/v1/chat/completions",
            201,
            false,
        ),
        ("tokenizer, streamed", fixed.clone(), "/generate", 202, true),
        (
            "scheduler, non-streamed",
            fixed.clone(),
            "/generate",
            100,
            false,
        ),
        (
            "scheduler, stub, non-streamed",
            stub.clone(),
            "/generate",
            101,
            false,
        ),
        ("scheduler, streamed", fixed.clone(), "/generate", 102, true),
    ];
    let handles: Vec<_> = refused
        .iter()
        .cloned()
        .map(|(what, router, path, words, stream)| {
            let model = s.model.clone();
            std::thread::spawn(move || {
                let (r, took) = post(
                    &format!("{router}{path}"),
                    &body(&model, path, words, stream),
                );
                (what, words, stream, r, took)
            })
        })
        .collect();
    // n = 2 meanwhile, admitted length.
    let n2 = json!({"text": prompt(16), "sampling_params": {"max_new_tokens": 3, "n": 2}});
    let (n2_answer, n2_took) = post(&format!("{fixed}/generate"), &n2);
    let answers: BTreeMap<u64, (&str, bool, HttpResponse, Duration)> = handles
        .into_iter()
        .map(|h| {
            let (what, words, stream, r, took) = h.join().unwrap();
            (words, (what, stream, r, took))
        })
        .collect();

    // The same streamed refusal sent to prefill directly: what SGLang's prefill answers
    // (http_server.serve_generate_request): 200, an SSE error event, [DONE].
    let mut direct = body(&s.model, "/generate", 203, true);
    direct["bootstrap_host"] = json!(s.prefill_fixed.host);
    direct["bootstrap_port"] = json!(s.prefill_fixed.bootstrap_port);
    direct["bootstrap_room"] = json!(42);
    let (sse, _) = post(&format!("{}/generate", s.prefill_fixed.url), &direct);
    assert_eq!(sse.status, 200, "{}", sse.body);
    assert!(
        sse.header("content-type")
            .is_some_and(|c| c.starts_with("text/event-stream")),
        "{:?}",
        sse.headers
    );
    let events_sse: Vec<&str> = sse.body.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events_sse.len(), 2, "{}", sse.body);
    let err: Value = serde_json::from_str(events_sse[0].trim_start_matches("data: ")).unwrap();
    assert_eq!(
        err,
        json!({"error": {"message": "The input (203 tokens) is longer than the model's context length (128 tokens).",
            "type": "invalid_request_error", "code": 400, "retryable": false}})
    );
    assert_eq!(events_sse[1], "data: [DONE]");

    // ---- what the client got ----
    let context_msg = |n: u64| {
        format!("The input ({n} tokens) is longer than the model's context length (128 tokens).")
    };
    let sched_msg = |n: u64| {
        format!(
            "Input length ({n} tokens) exceeds the maximum allowed length ({PREFILL_MAX_INPUT} tokens). \
             Use a shorter input or enable --allow-auto-truncate."
        )
    };
    for (words, (what, stream, r, took)) in &answers {
        eprintln!(
            "refused {what} ({words} words): client got {} in {:.0} ms, x-smg-error-code {:?}",
            r.status,
            took.as_secs_f64() * 1000.0,
            r.header("x-smg-error-code")
        );
        if *stream {
            continue;
        }
        assert_eq!(r.status, 400, "{what}: {}", r.body);
        assert_eq!(r.header("x-smg-error-code"), Some("prefill_bad_request"));
        let v: Value = serde_json::from_str(&r.body).unwrap();
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        let inner = if *words >= 128 {
            context_msg(*words)
        } else {
            sched_msg(*words)
        };
        // smg quotes prefill's body inside its own error.
        assert!(msg.contains(&inner), "{what}: {msg}");
    }
    // The streamed refusal: prefill answered 200 + an SSE error event, so smg 1.13.0 kept the
    // decode leg and streamed decode's answer: an abort once decode's wait for the KV timed out.
    let (_, _, streamed, streamed_took) = &answers[&202];
    assert_eq!(streamed.status, 200, "{}", streamed.body);
    assert!(
        streamed.body.contains("\"type\":\"abort\"")
            && streamed.body.contains("in KVPoll.WaitingForInput"),
        "streamed refusal, client body: {}",
        streamed.body
    );
    assert!(
        !streamed.body.contains("context length"),
        "prefill's SSE error reached the client: {}",
        streamed.body
    );
    assert!(
        streamed_took.as_secs_f64() >= DECODE_WAITING_TIMEOUT_S as f64,
        "{streamed_took:?}"
    );
    // The scheduler refuses inside the stream too (a chunk whose finish_reason is an abort
    // with status_code 400): smg keeps decode's leg the same way.
    let (_, _, sched_streamed, _) = &answers[&102];
    assert_eq!(sched_streamed.status, 200, "{}", sched_streamed.body);
    assert!(
        sched_streamed.body.contains("in KVPoll.WaitingForInput"),
        "{}",
        sched_streamed.body
    );

    // ---- ground truth ----
    let settle = Duration::from_secs(20);
    let pf = || s.prefill_fixed.truth();
    let ps = || s.prefill_stub.truth();
    let dt = || s.decode.truth();

    // Admitted: prefill's sender and decode's receiver met over the real wire, the KV that
    // prefill's forward wrote landed at decode byte for byte, both answered.
    let (p, d) = wait_for("admitted answers", settle, || {
        let (p, d) = (pf(), dt());
        admitted
            .iter()
            .all(|&(_, w, _)| {
                rooms_of(&p, w).iter().all(|&room| {
                    !of_room(&p, "answered", room).is_empty()
                        && !of_room(&d, "answered", room).is_empty()
                })
            })
            .then_some((p, d))
    });
    let mut registrations = 0;
    for &(path, words, _) in &admitted {
        let rooms = rooms_of(&p, words);
        assert_eq!(rooms.len(), 1, "{path} {words}: rooms {rooms:?}");
        let room = *rooms.iter().next().unwrap();
        assert_eq!(
            rooms_of(&d, words),
            rooms,
            "{path}: decode saw another room"
        );
        one(of_room(&p, "sender_created", room), "sender");
        let sent = one(of_room(&p, "kv_sent", room), "kv_sent");
        let landed = one(of_room(&d, "kv_landed", room), "kv_landed");
        assert_eq!(landed["landed_tokens"], words, "{path}: {landed}");
        assert_eq!(sent["tokens"], words);
        assert_eq!(
            landed["kv_digest"], sent["kv_digest"],
            "{path}: KV bytes differ"
        );
        assert_eq!(landed["metadata_room"], room);
        let p_ans = one(of_room(&p, "answered", room), "prefill answer");
        assert_eq!(
            p_ans["finish_reason"],
            json!({"type": "length", "length": 0})
        );
        let d_ans = one(of_room(&d, "answered", room), "decode answer");
        assert_eq!(
            d_ans["finish_reason"],
            json!({"type": "length", "length": 4})
        );
        // The wire: decode's 10-frame destinations, prefill's 3-frame Success.
        let dsend = frames(&d, "zmq_send", room);
        assert_eq!(dsend.len(), 1, "{dsend:?}");
        assert_eq!(dsend[0].1.len(), 10);
        assert_eq!(dsend[0].1[1], Value::from(s.decode.host.as_str()));
        assert_eq!(
            dsend[0].1[4],
            json!({"len": 4 * words}),
            "int32 page indices"
        );
        let psend = frames(&p, "zmq_send", room);
        assert_eq!(
            psend.iter().map(|(_, f)| f.clone()).collect::<Vec<_>>(),
            vec![vec![json!(room.to_string()), json!("4"), json!("0")]]
        );
    }
    for r in events(&d, "zmq_send") {
        if r["frames"][0] == "None" {
            registrations += 1;
            assert_eq!(r["frames"].as_array().unwrap().len(), 20, "{r}");
        }
    }
    assert!(
        registrations >= 1,
        "decode registered its KV args with no prefill"
    );

    // n = 2: SGLang's tokenizer manager sends a prefix request (max_new_tokens 0) and then
    // the n samples, all with the prompt's one bootstrap_room (obj[i] takes room[i] for prompt
    // i; the normalized room+i list is never used), on both workers.
    let n2_rooms = rooms_of(&p, 16);
    assert!(!n2_rooms.is_empty());
    for &room in &n2_rooms {
        for (role, t) in [("prefill", &p), ("decode", &d)] {
            let reqs = of_room(t, "request_received", room);
            let budgets: Vec<u64> = reqs
                .iter()
                .filter_map(|r| r["max_new_tokens"].as_u64())
                .collect();
            assert_eq!(reqs.len(), 3, "{role} room {room}: {reqs:#?}");
            assert_eq!(budgets[0], 0, "{role}: the prefix request comes first");
            let rids: BTreeSet<&str> = reqs.iter().filter_map(|r| r["rid"].as_str()).collect();
            assert_eq!(rids.len(), 3, "each sub-request has its own rid");
        }
    }
    let n2_sender_failures = n2_rooms
        .iter()
        .map(|&room| of_room(&p, "transfer_failed", room).len())
        .sum::<usize>();

    // Tokenizer-path refusals never reach prefill's scheduler: no sender, nothing on the wire
    // from prefill for the room. Decode created a receiver and published destinations for a
    // room prefill never opened, and held it until the router's close was noticed (every
    // STATE_WAIT_S, non-streamed) or its waiting timeout (streamed).
    let d = wait_for("decode's ABORTs for the refused rooms", settle, || {
        let d = dt();
        [200u64, 201, 202, 100, 102]
            .iter()
            .all(|&w| {
                rooms_of(&d, w)
                    .iter()
                    .all(|&room| stranded(&d, room).is_some())
            })
            .then_some(d)
    });
    let p = pf();
    let mut held = Vec::new();
    for words in [200u64, 201, 202] {
        assert!(
            rooms_of(&p, words).is_empty(),
            "prefill's scheduler saw {words}"
        );
        let rooms = rooms_of(&d, words);
        assert_eq!(rooms.len(), 1, "{words}: decode rooms {rooms:?}");
        let room = *rooms.iter().next().unwrap();
        assert!(
            frames(&p, "zmq_send", room)
                .iter()
                .all(|(_, f)| f[0] == "ABORT_ACK")
        );
        let st = stranded(&d, room).unwrap();
        held.push((words, ms(st.published_ns, st.abort_ns)));
        assert_eq!(st.abort_frames.len(), 5, "{:?}", st.abort_frames);
        assert_eq!(st.abort_frames[2], Value::from(s.decode.host.as_str()));
        // Prefill's bootstrap thread got the destinations and the ABORT for a room with no
        // sender, and acknowledged the ABORT (deferred KV release).
        let precv = frames(&p, "zmq_recv", room);
        assert!(precv.iter().any(|(_, f)| f.len() == 10), "{precv:?}");
        assert!(precv.iter().any(|(_, f)| f[0] == "ABORT"), "{precv:?}");
        let ack = frames(&p, "zmq_send", room);
        assert!(
            ack.iter()
                .any(|(_, f)| f[0] == "ABORT_ACK" && f[1] == room.to_string().as_str()),
            "{ack:?}"
        );
        let hold = ms(st.published_ns, st.abort_ns) / 1000.0;
        if words == 202 {
            assert!(
                hold >= DECODE_WAITING_TIMEOUT_S as f64 - 0.5,
                "streamed: decode held {hold:.1} s"
            );
            assert!(of_room(&d, "abort_req", room).is_empty());
        } else {
            assert!(
                (STATE_WAIT_S - 0.5..STATE_WAIT_S * 2.0 + 1.0).contains(&hold),
                "non-streamed: decode held {hold:.1} s"
            );
        }
    }

    // Scheduler-path refusal, fixed: retired before any sender exists.
    let room_sched = *rooms_of(&p, 100)
        .iter()
        .next()
        .expect("prefill saw the 100-word request");
    one(of_room(&p, "retired_unadmitted", room_sched), "retirement");
    assert!(of_room(&p, "sender_created", room_sched).is_empty());
    let ans = one(of_room(&p, "answered", room_sched), "prefill answer");
    assert_eq!(ans["finish_reason"]["type"], "abort");
    assert_eq!(ans["finish_reason"]["status_code"], 400);
    assert!(
        frames(&p, "zmq_send", room_sched)
            .iter()
            .all(|(_, f)| f[0] == "ABORT_ACK")
    );
    let st = stranded(&d, room_sched).unwrap();
    held.push((100, ms(st.published_ns, st.abort_ns)));
    // The same refusal streamed: retired the same way; decode holds the room until its
    // waiting timeout, as smg keeps its leg.
    let room_sched_streamed = *rooms_of(&p, 102)
        .iter()
        .next()
        .expect("prefill saw the 102-word request");
    one(
        of_room(&p, "retired_unadmitted", room_sched_streamed),
        "retirement",
    );
    assert!(of_room(&p, "sender_created", room_sched_streamed).is_empty());
    let st = stranded(&d, room_sched_streamed).unwrap();
    let hold = ms(st.published_ns, st.abort_ns);
    assert!(
        hold / 1000.0 >= DECODE_WAITING_TIMEOUT_S as f64 - 0.5,
        "streamed: decode held {hold:.0} ms"
    );
    held.push((102, hold));

    // Scheduler-path refusal, stub (<= 0.5.20): a one-token sender bootstrapped with decode,
    // the stub's KV landed at decode (Success on the wire) before prefill answered 400.
    let sp = ps();
    let room_stub = *rooms_of(&sp, 101)
        .iter()
        .next()
        .expect("stub prefill saw 101 words");
    one(of_room(&sp, "stub_admitted", room_stub), "stub");
    let sender = one(of_room(&sp, "sender_created", room_stub), "stub sender");
    assert_eq!(sender["input_tokens"], 1);
    let sent = one(of_room(&sp, "kv_sent", room_stub), "stub kv_sent");
    let landed = one(of_room(&d, "kv_landed", room_stub), "stub KV at decode");
    assert_eq!(landed["landed_tokens"], 1);
    assert_eq!(landed["kv_digest"], sent["kv_digest"]);
    let success_ns = success_status(&sp, "zmq_send", room_stub).unwrap_or_else(|| {
        panic!(
            "stub prefill sent no Success: {:?}",
            frames(&sp, "zmq_send", room_stub)
        )
    });
    let stub_answer = one(of_room(&sp, "answered", room_stub), "stub answer");
    assert_eq!(stub_answer["finish_reason"]["status_code"], 400);
    // Mooncake writes the pages before the status frame goes out, so the stub's KV was in
    // decode's memory before prefill answered.
    assert!(success_ns < ts(stub_answer), "Success after the 400");
    let stub_decode_answer = of_room(&d, "answered", room_stub);
    // Which crossed the wire first, the Success or the 400? The truth stamps the Success
    // after decode read it and the 400's head before SGLang's HTTP server had it: when the
    // first is earlier, the Success was on the wire first. Otherwise the truth cannot say
    // (both stamps come milliseconds off the wire, on a busy machine either order).
    let success_read =
        success_status(&d, "zmq_recv", room_stub).expect("decode read no Success for the stub");
    let stub_head = events(&sp, "http_answered")
        .find(|r| {
            r["status"] == 400
                && r["rooms"]
                    .as_array()
                    .is_some_and(|a| a.contains(&json!(room_stub)))
        })
        .and_then(|r| r["head_ns"].as_u64())
        .expect("the stub prefill's 400 head");
    let stub_order = if success_read < stub_head {
        StubOrder::SuccessFirst
    } else {
        StubOrder::Unpinned
    };

    // ---- OTLP, as SGLang's tracing module exported it ----
    std::thread::sleep(Duration::from_millis(1500));
    let spans = s.sink.spans();
    let by_room = |role: &str, room: u64| -> Vec<&Value> {
        let hex = format!("{room:#x}");
        spans
            .iter()
            .filter(|sp| {
                sp["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with(&format!("{role} Req ")))
                    && sp["attributes"]["bootstrap_room"] == hex.as_str()
            })
            .collect()
    };
    let trace_names = |root: &Value| -> BTreeSet<String> {
        spans
            .iter()
            .filter(|sp| sp["trace_id"] == root["trace_id"])
            .filter_map(|sp| sp["name"].as_str().map(String::from))
            .collect()
    };
    let room_ok = *rooms_of(&p, 10).iter().next().unwrap();
    let proot = one(by_room("prefill", room_ok), "prefill root span");
    let names = trace_names(proot);
    for slice in [
        "tokenize",
        "prefill_bootstrap",
        "prefill_forward",
        "prefill_transfer_kv_cache",
    ] {
        assert!(
            names.contains(slice),
            "prefill trace lacks {slice}: {names:?}"
        );
    }
    let droot = one(by_room("decode", room_ok), "decode root span");
    let names = trace_names(droot);
    for slice in ["decode_bootstrap", "decode_transferred", "decode_loop"] {
        assert!(
            names.contains(slice),
            "decode trace lacks {slice}: {names:?}"
        );
    }
    // A tokenizer-path refusal: the request's root span is never ended (never exported); its
    // thread span is closed by the garbage collector, status ERROR, "have unclosed span, auto
    // closed".
    let auto_closed = spans
        .iter()
        .filter(|sp| {
            sp["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("PrefillTokenizer"))
                && sp["attributes"]["reason"] == "have unclosed span, auto closed"
                && sp["status"] == 2
        })
        .count();
    assert!(
        auto_closed >= 3,
        "auto-closed PrefillTokenizer spans: {auto_closed}"
    );
    // The scheduler-path refusal: root ended, the scheduler's thread span carries the reason.
    let sroot = one(by_room("prefill", room_sched), "refused root span");
    let thread = spans
        .iter()
        .find(|sp| {
            sp["trace_id"] == sroot["trace_id"]
                && sp["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("Prefill Scheduler"))
        })
        .expect("refused request's scheduler thread span");
    assert_eq!(thread["status"], 2);
    assert_eq!(thread["attributes"]["reason"], sched_msg(100).as_str());

    // ---- revenant's verdicts ----
    let verdicts = judge(&s, &p, &sp, &d, stub_order);
    eprintln!("{verdicts}");

    // ---- what was measured ----
    let admitted_ms = {
        let mut v = admitted_latency.clone();
        v.sort_by(f64::total_cmp);
        v
    };
    eprintln!(
        "admitted: {} requests through smg, latency {:.0}-{:.0} ms, KV bytes compared per room",
        admitted.len(),
        admitted_ms[0],
        admitted_ms[admitted_ms.len() - 1]
    );
    eprintln!(
        "n=2: client got {} in {:.0} ms; {} attempt room(s), each 3 requests per worker on one room; \
         {} prefill sender(s) failed",
        n2_answer.status,
        n2_took.as_secs_f64() * 1000.0,
        n2_rooms.len(),
        n2_sender_failures
    );
    for (words, hold_ms) in &held {
        eprintln!(
            "refused {words} words: decode held the room {hold_ms:.0} ms from publishing destinations to ABORT"
        );
    }
    eprintln!(
        "stub: Success sent {:.1} ms before prefill's scheduler answered, read by decode {:.1} ms before the 400's head ({stub_order:?}); decode answered {:?}",
        ms(success_ns, ts(stub_answer)),
        ms(success_read, stub_head),
        stub_decode_answer
            .first()
            .map(|a| a["finish_reason"].clone())
    );
    eprintln!(
        "spans: {} exported, {auto_closed} auto-closed PrefillTokenizer thread spans",
        spans.len()
    );
    eprintln!(
        "run (after start-up) {:.1} s; scratch {}",
        run_started.elapsed().as_secs_f64(),
        s.scratch.path().display()
    );
}

/// The order in which the refused stub's Success and prefill's 400 crossed the wire, as far as
/// the ground truth can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StubOrder {
    /// Decode read the Success before the 400's head left prefill's HTTP server.
    SuccessFirst,
    /// Within the stamps' reach of the wire: either order.
    Unpinned,
}

/// What revenant said about the run, against SGLang's ground truth: live with both witnesses
/// (its violations and incident notifications), then each witness alone (`revenant check` on the
/// recorded events of that source). Returns a summary to print.
fn judge(
    s: &Setup,
    prefill: &[Value],
    stub: &[Value],
    decode: &[Value],
    stub_order: StubOrder,
) -> String {
    let room = |t: &[Value], words: u64| {
        *rooms_of(t, words)
            .iter()
            .next()
            .unwrap_or_else(|| panic!("no room with {words} words"))
    };
    // The breaches and the rules that may report each (the first one must).
    let tokenizer_streamed = room(decode, 202);
    let scheduler_streamed = room(prefill, 102);
    let stub_room = room(stub, 101);
    // Judged once revenant's watermark passed the slowest deadline: decode's abort at its
    // waiting timeout, exported then, plus the window and run's 15 s allowed lateness.
    let rv = &s.revenant;
    let deadline = Instant::now() + Duration::from_secs(60);
    let target = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
        + 1.0;
    loop {
        let m = rv.metrics().unwrap();
        let wm = test_harness::metric_sum(&m, "revenant_checker_watermark_timestamp_seconds", &[]);
        if wm >= target {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "watermark {wm} never passed {target}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    rv.wait_quiet(Duration::from_secs(2), Duration::from_secs(60), None)
        .unwrap_or_else(|e| panic!("{e:#}\n{}", rv.log_tail(30)));
    // <= 0.5.20: the refused request's stub KV landed at decode. Its Success (the wire's
    // evidence of that, seen once by eBPF) crossed the wire before prefill's 400
    // (`advanced-before-rejection`) or, when the 400 won the race, after it
    // (`activity-after-rejection`); the order eBPF saw must agree with the truth's where the
    // truth can tell. Decode's work on the stub after the 400 is activity after it too.
    let events = rv.events();
    let ebpf_at = |stage: &str, kind: &str| -> Vec<u64> {
        events
            .iter()
            .filter(|e| {
                e["source"] == "ebpf"
                    && e["stage"] == stage
                    && e["kind"] == kind
                    && e["ids"]["bootstrap_room"] == stub_room.to_string().as_str()
            })
            .filter_map(|e| e["time_unix_nano"].as_u64())
            .collect()
    };
    let (success, refusal) = (
        ebpf_at("transfer", "completed"),
        ebpf_at("prefill", "rejected"),
    );
    assert!(
        success.len() == 1 && refusal.len() == 1,
        "eBPF on the stub's room: Success at {success:?}, 400 at {refusal:?}"
    );
    let success_first = success[0] < refusal[0];
    assert!(
        success_first || stub_order == StubOrder::Unpinned,
        "eBPF saw the 400 {:.1} ms before a Success decode read before the 400's head",
        ms(refusal[0], success[0])
    );
    let stub_rule = if success_first {
        "advanced-before-rejection"
    } else {
        "activity-after-rejection"
    };
    let must: BTreeMap<u64, (&str, Vec<&str>)> = [
        // smg keeps decode's leg of a refusal streamed inside a 200: decode reserved KV for
        // the room and held its leg until its waiting timeout.
        (tokenizer_streamed, ("orphaned-leg", vec![])),
        (scheduler_streamed, ("orphaned-leg", vec![])),
        // Either rule is true of the stub whichever its trigger: the pages landed before the
        // Success went out (Mooncake writes first), and decode worked on it after the 400.
        (
            stub_room,
            (
                stub_rule,
                vec![
                    "advanced-before-rejection",
                    "activity-after-rejection",
                    "orphaned-leg",
                ],
            ),
        ),
    ]
    .into_iter()
    .collect();
    let (_, list) = rv.admin_json("/api/violations?limit=100000").unwrap();
    let live = by_room(list["violations"].as_array().unwrap());
    let mut summary = format!("revenant live (eBPF + OTLP): {live:?}\n");
    check_verdicts("live", &live, &must, &[]);
    // One notification per breached request.
    let alerts = rv.alerts();
    for (room, (rule, _)) in &must {
        let n = alerts
            .iter()
            .filter(|a| {
                a.to_string()
                    .contains(&format!("\"bootstrap_room\":\"{room}\""))
            })
            .count();
        assert_eq!(n, 1, "room {room} ({rule}): {n} notifications: {alerts:#?}");
    }
    // Each witness alone: the same events, one source at a time, through `revenant check`.
    for (source, cannot_see) in [
        ("ebpf", vec![]),
        // SGLang never ends (so never exports) the root span of a request its tokenizer
        // refused: only an auto-closed thread span without ids reaches OTLP. Up to 0.5.20 a
        // refused request's stub runs to its end as any request, its refusal only a finish
        // reason "abort" on its root (read as an abort, not a refusal).
        ("otlp", vec![tokenizer_streamed, stub_room]),
    ] {
        let path = rv.dir.join(format!("events-{source}.jsonl"));
        let lines: Vec<String> = events
            .iter()
            .filter(|e| e["source"] == source)
            .map(|e| e.to_string())
            .collect();
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        let bin = test_harness::workspace_bin("revenant", "REVENANT_BIN").unwrap();
        // The same allowed lateness as the live run: a root span is exported when its request
        // ends, seconds after its first event.
        let out = std::process::Command::new(bin)
            .args(["check", "--allowed-lateness", "15s", "--events"])
            .arg(&path)
            .output()
            .unwrap();
        let found: Vec<Value> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        let got = by_room(&found);
        summary.push_str(&format!(
            "revenant check, {source} alone ({} events): {got:?}\n",
            lines.len()
        ));
        check_verdicts(source, &got, &must, &cannot_see);
    }
    summary
}

/// Violations by room: the rules that fired for it.
fn by_room(violations: &[Value]) -> BTreeMap<u64, BTreeSet<String>> {
    let mut m: BTreeMap<u64, BTreeSet<String>> = BTreeMap::new();
    for v in violations {
        let room = v["attempt"]["bootstrap_room"]
            .as_str()
            .and_then(|r| r.parse().ok())
            .unwrap_or(0);
        m.entry(room)
            .or_default()
            .insert(v["rule"].as_str().unwrap_or_default().to_owned());
    }
    m
}

/// Every breach caught by its rule (unless the witness cannot see it), and nothing else: no
/// rule fired for any other room, and none but the allowed ones for a breached room.
fn check_verdicts(
    witness: &str,
    got: &BTreeMap<u64, BTreeSet<String>>,
    must: &BTreeMap<u64, (&str, Vec<&str>)>,
    cannot_see: &[u64],
) {
    for (room, (rule, also)) in must {
        let rules = got.get(room).cloned().unwrap_or_default();
        if cannot_see.contains(room) {
            assert!(
                rules.is_empty(),
                "{witness}: room {room} cannot be seen, yet {rules:?}"
            );
            continue;
        }
        assert!(
            rules.contains(*rule),
            "{witness}: room {room} missed {rule}: {got:?}"
        );
        let extra: Vec<_> = rules
            .iter()
            .filter(|r| r.as_str() != *rule && !also.contains(&r.as_str()))
            .collect();
        assert!(extra.is_empty(), "{witness}: room {room} also {extra:?}");
    }
    let false_alerts: Vec<_> = got.iter().filter(|(r, _)| !must.contains_key(r)).collect();
    assert!(
        false_alerts.is_empty(),
        "{witness}: false alerts on a correct deployment's rooms: {false_alerts:?}"
    );
}
