//! Small pieces shared by the roles: ids, clocks, tokenization, the SGLang error envelope,
//! the readiness line and the HTTP client.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rand::RngExt;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn http_client(max_idle_per_host: usize) -> HttpClient {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(max_idle_per_host)
        .pool_idle_timeout(std::time::Duration::from_secs(30))
        .build(conn)
}

pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// SGLang request ids are uuid4 hex (32 lowercase hex chars).
pub fn new_rid() -> String {
    format!("{:032x}", rand::rng().random::<u128>())
}

/// Rooms are random non-negative i64 values, as the router draws them (fits Python ints and
/// JSON numbers that some clients parse as i64).
pub fn new_room() -> u64 {
    rand::rng().random::<u64>() & (i64::MAX as u64)
}

/// How SGLang prints a room in spans: Python's `hex(room)` — lowercase, `0x`, no padding.
pub fn room_hex(room: u64) -> String {
    format!("{room:#x}")
}

/// Token count used everywhere in the simulator: whitespace-separated words. Real servers use
/// a model tokenizer; a word count keeps the load generator, the limits and the tests in
/// exact agreement without shipping a tokenizer.
pub fn count_tokens(text: &str) -> u64 {
    text.split_whitespace().count() as u64
}

/// SGLang's error body, e.g. `{"object":"error","message":"...","type":"BadRequestError",
/// "param":null,"code":400}`, used by both `/generate` and the OpenAI routes.
pub fn error_response(status: StatusCode, message: &str) -> Response {
    let kind = match status {
        StatusCode::BAD_REQUEST => "BadRequestError",
        StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
        StatusCode::NOT_FOUND => "NotFoundError",
        _ => "InternalServerError",
    };
    let body = serde_json::json!({
        "object": "error",
        "message": message,
        "type": kind,
        "param": null,
        "code": status.as_u16(),
    });
    json_response(status, body.to_string())
}

pub fn json_response(status: StatusCode, body: String) -> Response {
    let mut r = (status, body).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// The single machine-readable line a role prints on stdout once every port is bound; the
/// cluster and the tests read it to learn ephemeral ports.
pub fn print_ready(v: serde_json::Value) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "READY {v}");
    let _ = out.flush();
}

/// Wait for SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// W3C trace context: `00-<trace id>-<parent span id>-<flags>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
}

impl TraceParent {
    pub fn parse(s: &str) -> Option<Self> {
        let mut it = s.trim().split('-');
        let version = it.next()?;
        let trace = it.next()?;
        let span = it.next()?;
        let _flags = it.next()?;
        if version.len() != 2 || trace.len() != 32 || span.len() != 16 {
            return None;
        }
        let mut trace_id = [0u8; 16];
        let mut span_id = [0u8; 8];
        hex_decode(trace, &mut trace_id)?;
        hex_decode(span, &mut span_id)?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceParent { trace_id, span_id })
    }

    pub fn header_value(&self) -> String {
        format!("00-{}-{}-01", hex(&self.trace_id), hex(&self.span_id))
    }
}

pub fn hex(b: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        s.push(DIGITS[(x >> 4) as usize] as char);
        s.push(DIGITS[(x & 0xf) as usize] as char);
    }
    s
}

fn hex_decode(s: &str, out: &mut [u8]) -> Option<()> {
    let b = s.as_bytes();
    for (i, o) in out.iter_mut().enumerate() {
        let hi = *b.get(2 * i)?;
        let lo = *b.get(2 * i + 1)?;
        *o = (nib(hi)? << 4) | nib(lo)?;
    }
    Some(())
}

fn nib(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

pub fn random_trace_id() -> [u8; 16] {
    loop {
        let v: [u8; 16] = rand::rng().random();
        if v != [0; 16] {
            return v;
        }
    }
}

pub fn random_span_id() -> [u8; 8] {
    loop {
        let v: [u8; 8] = rand::rng().random();
        if v != [0; 8] {
            return v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_round_trip_and_rejects_garbage() {
        let tp = TraceParent {
            trace_id: random_trace_id(),
            span_id: random_span_id(),
        };
        assert_eq!(TraceParent::parse(&tp.header_value()), Some(tp));
        assert_eq!(TraceParent::parse("00-zz-11-01"), None);
        assert_eq!(
            TraceParent::parse("00-00000000000000000000000000000000-0000000000000001-01"),
            None
        );
        assert_eq!(TraceParent::parse(""), None);
    }

    #[test]
    fn hex_is_lowercase_and_padded() {
        assert_eq!(hex(&[0x00, 0x0f, 0xab, 0xff]), "000fabff");
    }

    #[test]
    fn tokens_are_whitespace_words() {
        assert_eq!(count_tokens("  a b\tc\nd  "), 4);
        assert_eq!(count_tokens(""), 0);
    }

    #[test]
    fn room_hex_is_python_hex() {
        assert_eq!(room_hex(0x314783f6bef71155), "0x314783f6bef71155");
        assert_eq!(room_hex(5), "0x5");
    }
}
