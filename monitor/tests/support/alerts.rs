//! Violations as the checker emits them, and a webhook receiver on loopback that records what
//! it gets: shared by the alert tests and the alert_delivery bench.
#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;

use revenant::event::{Kind, Source, Stage};
use revenant::violation::Severity;
use revenant::violation::{AttemptAliases, Evidence, EvidenceRole, RequestAliases, Violation};

/// The room of violation 0 (violation `i` has `ROOM + i`): above 2^53, as SGLang's rooms are,
/// so every alert test sees whether outputs keep all its digits.
pub const ROOM: u64 = 9_066_467_638_188_682_269;

pub fn violation(i: usize) -> Violation {
    violation_rule("activity-after-rejection", i)
}

pub fn violation_rule(rule: &str, i: usize) -> Violation {
    let t = 1_767_000_000_000_000_000u64 + i as u64 * 1_000_000;
    Violation {
        rule: rule.into(),
        severity: Severity::Critical,
        summary: format!("request req-{i} rejected by prefill (400) but decode kept working"),
        request: RequestAliases {
            request_id: Some(format!("req-{i}")),
            trace_id: None,
        },
        attempt: AttemptAliases {
            bootstrap_room: Some(ROOM + i as u64),
            rid: None,
        },
        worker: None,
        detected_at_ns: t + 5_000_000,
        fingerprint: format!(
            "{:016x}",
            revenant::violation::fnv1a(&[rule.as_bytes(), format!("req-{i}").as_bytes()])
        ),
        evidence: vec![
            Evidence {
                role: EvidenceRole::Trigger,
                time_ns: t,
                stage: Stage::Prefill,
                kind: Kind::Rejected,
                source: Source::Otlp,
                status: Some(400),
                reason: Some("capacity".into()),
            },
            Evidence {
                role: EvidenceRole::Offender,
                time_ns: t + 5_000_000,
                stage: Stage::Decode,
                kind: Kind::Work,
                source: Source::Ebpf,
                status: None,
                reason: None,
            },
        ],
        corroborates: false,
    }
}

/// How the receiver answers.
pub const MODE_OK: u16 = 200;

/// A webhook receiver on loopback that records every alert object it gets.
#[derive(Clone, Default)]
pub struct Receiver {
    pub alerts: Arc<Mutex<Vec<serde_json::Value>>>,
    /// When each fingerprint first arrived (the handler's first instant, before any parsing).
    pub first_seen: Arc<Mutex<HashMap<String, Instant>>>,
    pub requests: Arc<Mutex<u64>>,
    pub bad_signatures: Arc<Mutex<u64>>,
    /// Status to answer with (200 by default); 429 comes with `Retry-After: 1`.
    pub mode: Arc<AtomicU16>,
    pub secret: Option<Vec<u8>>,
    /// Delay before answering (to kill a sender mid-delivery).
    pub delay: Duration,
}

impl Receiver {
    pub fn new(secret: Option<&str>, delay: Duration) -> Receiver {
        Receiver {
            secret: secret.map(|s| s.as_bytes().to_vec()),
            delay,
            mode: Arc::new(AtomicU16::new(MODE_OK)),
            ..Default::default()
        }
    }

    /// Serves on an ephemeral loopback port (no race with other processes for the port).
    pub async fn serve_any(&self) -> (SocketAddr, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind receiver");
        let addr = listener.local_addr().unwrap();
        (addr, self.serve_on(listener))
    }

    pub async fn serve(&self, addr: SocketAddr) -> tokio::task::JoinHandle<()> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .expect("bind receiver");
        self.serve_on(listener)
    }

    fn serve_on(&self, listener: tokio::net::TcpListener) -> tokio::task::JoinHandle<()> {
        let app = Router::new()
            .route("/{*path}", post(receive))
            .with_state(self.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        })
    }

    pub fn alerts(&self) -> Vec<serde_json::Value> {
        self.alerts.lock().unwrap().clone()
    }

    /// Count of received alert objects per `key` field (e.g. `fingerprint` or `id`).
    pub fn counts_by(&self, key: &str) -> HashMap<String, usize> {
        let mut m = HashMap::new();
        for a in self.alerts() {
            let k = a
                .get(key)
                .and_then(|v| v.as_str())
                .unwrap_or("")
                .to_string();
            *m.entry(k).or_insert(0) += 1;
        }
        m
    }
}

async fn receive(State(r): State<Receiver>, headers: HeaderMap, body: Bytes) -> impl IntoResponse {
    let now = Instant::now();
    *r.requests.lock().unwrap() += 1;
    let mode = r.mode.load(Ordering::SeqCst);
    if mode == 429 {
        return (
            StatusCode::TOO_MANY_REQUESTS,
            [("retry-after", "1")],
            "slow down",
        )
            .into_response();
    }
    if mode != MODE_OK {
        return (StatusCode::from_u16(mode).unwrap(), "refused").into_response();
    }
    if let Some(secret) = &r.secret {
        let ts = headers
            .get("x-revenant-timestamp")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let sig = headers
            .get("x-revenant-signature")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let want = format!(
            "sha256={}",
            revenant::alert::webhook::sign(secret, ts, &body)
        );
        if ts.is_empty() || sig != want {
            *r.bad_signatures.lock().unwrap() += 1;
            return (StatusCode::UNAUTHORIZED, "bad signature").into_response();
        }
    }
    let v: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(_) => return (StatusCode::BAD_REQUEST, "not json").into_response(),
    };
    let items: Vec<serde_json::Value> = match &v {
        serde_json::Value::Object(o) if o.contains_key("alerts") => {
            o["alerts"].as_array().cloned().unwrap_or_default()
        }
        other => vec![other.clone()],
    };
    // Record on arrival, answer after the delay: a sender killed meanwhile never sees the OK.
    {
        let mut first = r.first_seen.lock().unwrap();
        for a in &items {
            if let Some(fp) = a["fingerprint"].as_str() {
                first.entry(fp.to_string()).or_insert(now);
            }
        }
    }
    r.alerts.lock().unwrap().extend(items);
    if !r.delay.is_zero() {
        tokio::time::sleep(r.delay).await;
    }
    (StatusCode::OK, "ok").into_response()
}
