//! OTLP/HTTP JSON traffic for a real `revenant run`: prefill rejects an attempt, decode decodes
//! it anyway (one `activity-after-rejection` violation per call, `i` makes each request distinct).
// Each test crate uses some of these.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

const MS: u128 = 1_000_000;

fn b64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn span(
    trace: u128,
    id: u64,
    parent: u64,
    name: &str,
    start: u128,
    end: u128,
    attrs: Value,
) -> Value {
    let attrs: Vec<Value> = attrs
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| match v {
            Value::Number(n) => json!({"key": k, "value": {"intValue": n.to_string()}}),
            other => json!({"key": k, "value": {"stringValue": other.as_str().unwrap()}}),
        })
        .collect();
    let mut s = json!({
        "traceId": b64(&trace.to_be_bytes()),
        "spanId": b64(&id.to_be_bytes()),
        "name": name,
        "kind": "SPAN_KIND_INTERNAL",
        "startTimeUnixNano": start.to_string(),
        "endTimeUnixNano": end.to_string(),
        "attributes": attrs,
        "status": {},
    });
    if parent != 0 {
        s["parentSpanId"] = json!(b64(&parent.to_be_bytes()));
    }
    s
}

fn export(http: &str, host: &str, spans: Vec<Value>) {
    let doc = json!({"resourceSpans": [{
        "resource": {"attributes": [
            {"key": "service.name", "value": {"stringValue": "sglang"}},
            {"key": "host.name", "value": {"stringValue": host}},
        ]},
        "scopeSpans": [{"scope": {"name": "sglang server"}, "spans": spans}],
    }]})
    .to_string();
    let mut s = TcpStream::connect(http).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST /v1/traces HTTP/1.1\r\nHost: {http}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{doc}",
        doc.len()
    )
    .unwrap();
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

/// Prefill's export first, then decode's, each in event-time order.
pub fn reject_then_decode(http: &str, i: u64) {
    send(http, i, false)
}

/// Decode's export reaches revenant before prefill's: prefill's events arrive ~200 ms late in
/// event time.
pub fn decode_reported_first(http: &str, i: u64) {
    send(http, i, true)
}

/// The room of request `i`'s attempt (spans carry it in hex). Above 2^53, as SGLang's are.
pub fn room(i: u64) -> u64 {
    0x314783F6BEF70000 + i
}

fn send(http: &str, i: u64, decode_first: bool) {
    let t0 = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let rid = format!("8f3c2b1a9d7e4f60a1b2c3d4e5f6{i:04x}");
    let room = format!("{:#x}", room(i));
    let reason = format!("Request {rid} exceeds the maximum number of tokens: 9000 > 8192");
    let (tp, td) = (
        (0x11u128 << 64) | (2 * i as u128 + 1),
        (0x22u128 << 64) | (2 * i as u128 + 2),
    );
    let mut sched = span(
        tp,
        2,
        1,
        "Prefill Scheduler [TP 0] (host:prefill- | pid:4242)",
        t0 + MS,
        t0 + 4 * MS,
        json!({"thread_label": "Prefill Scheduler", "pid": 4242, "reason": reason}),
    );
    sched["status"] = json!({"code": "STATUS_CODE_ERROR"});
    let prefill = vec![
        span(
            tp,
            3,
            2,
            "prefill_prepare",
            t0 + 2 * MS,
            t0 + 3 * MS,
            json!({}),
        ),
        sched,
        span(
            tp,
            1,
            99,
            "prefill Req",
            t0,
            t0 + 5 * MS,
            json!({"rid": rid, "bootstrap_room": room}),
        ),
    ];
    let dt = t0 + 204 * MS;
    let decode = vec![
        span(td, 3, 2, "decode_transferred", dt, dt + 5 * MS, json!({})),
        span(
            td,
            4,
            2,
            "decode_loop",
            dt + 5 * MS,
            dt + 20 * MS,
            json!({}),
        ),
        span(
            td,
            2,
            1,
            "Decode Scheduler [TP 0] (host:decode-n | pid:4243)",
            t0 + MS,
            dt + 21 * MS,
            json!({"thread_label": "Decode Scheduler", "pid": 4243}),
        ),
        span(
            td,
            1,
            0,
            "decode Req",
            t0,
            dt + 22 * MS,
            json!({"rid": rid, "bootstrap_room": room}),
        ),
    ];
    if decode_first {
        export(http, "decode-node", decode);
        export(http, "prefill-node", prefill);
    } else {
        export(http, "prefill-node", prefill);
        export(http, "decode-node", decode);
    }
}
