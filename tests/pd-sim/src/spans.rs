//! SGLang/smg-shaped OTLP spans, exported over OTLP/HTTP protobuf.
//!
//! Serving must never wait on telemetry: handlers hand finished spans to a bounded channel
//! with `try_send`; a full channel drops the spans and counts them. One exporter task batches
//! and POSTs `ExportTraceServiceRequest`s; failed exports are retried a few times on
//! retryable answers (429/503/connect errors) and then counted as failed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{AnyValue, InstrumentationScope, KeyValue, any_value};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{
    ResourceSpans, ScopeSpans, Span, Status, span, status,
};
use prost::Message;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::http::{HttpClient, http_client};

pub fn kv_str(k: &str, v: impl Into<String>) -> KeyValue {
    KeyValue {
        key: k.into(),
        key_strindex: 0,
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(v.into())),
        }),
    }
}

pub fn kv_int(k: &str, v: i64) -> KeyValue {
    KeyValue {
        key: k.into(),
        key_strindex: 0,
        value: Some(AnyValue {
            value: Some(any_value::Value::IntValue(v)),
        }),
    }
}

pub fn kv_f64(k: &str, v: f64) -> KeyValue {
    KeyValue {
        key: k.into(),
        key_strindex: 0,
        value: Some(AnyValue {
            value: Some(any_value::Value::DoubleValue(v)),
        }),
    }
}

/// A finished span, built by the roles from timestamps they took while serving.
pub struct SpanSpec<'a> {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub parent: Option<[u8; 8]>,
    pub name: String,
    pub start_ns: u64,
    pub end_ns: u64,
    pub attributes: Vec<KeyValue>,
    pub events: Vec<span::Event>,
    /// `Some(reason)` marks the span ERROR; SGLang puts the abort text in a `reason` attribute.
    pub error: Option<&'a str>,
}

impl SpanSpec<'_> {
    pub fn build(self) -> Span {
        let mut attributes = self.attributes;
        let status = match self.error {
            Some(reason) => {
                attributes.push(kv_str("reason", reason));
                Some(Status {
                    message: String::new(),
                    code: status::StatusCode::Error as i32,
                })
            }
            None => Some(Status::default()),
        };
        Span {
            trace_id: self.trace_id.to_vec(),
            span_id: self.span_id.to_vec(),
            trace_state: String::new(),
            parent_span_id: self.parent.map(|p| p.to_vec()).unwrap_or_default(),
            // Sampled + remote-parent bits as the Python SDK sets them (flags 256/768 in the
            // fixtures); the value is informational only.
            flags: 0x100,
            name: self.name,
            kind: span::SpanKind::Internal as i32,
            start_time_unix_nano: self.start_ns,
            end_time_unix_nano: self.end_ns.max(self.start_ns),
            attributes,
            dropped_attributes_count: 0,
            events: self.events,
            dropped_events_count: 0,
            links: Vec::new(),
            dropped_links_count: 0,
            status,
        }
    }
}

pub fn event(name: &str, time_ns: u64, attributes: Vec<KeyValue>) -> span::Event {
    span::Event {
        time_unix_nano: time_ns,
        name: name.into(),
        attributes,
        dropped_attributes_count: 0,
    }
}

#[derive(Default, Debug, Serialize)]
pub struct ExportStats {
    pub spans_emitted: AtomicU64,
    /// Spans dropped because the exporter queue was full (serving never waits on telemetry).
    pub spans_dropped_queue_full: AtomicU64,
    pub batches_exported: AtomicU64,
    pub batches_failed: AtomicU64,
    pub spans_failed: AtomicU64,
    pub export_retries: AtomicU64,
}

#[derive(Clone)]
pub struct SpanSink {
    tx: Option<mpsc::Sender<Vec<Span>>>,
    pub stats: Arc<ExportStats>,
}

pub struct Exporter {
    pub sink: SpanSink,
    task: Option<JoinHandle<()>>,
}

pub struct ExporterConfig {
    pub endpoint: Option<String>,
    pub service_name: &'static str,
    pub scope_name: &'static str,
    pub resource_attrs: Vec<KeyValue>,
}

impl Exporter {
    pub fn start(cfg: ExporterConfig) -> Exporter {
        let stats = Arc::new(ExportStats::default());
        let Some(endpoint) = cfg.endpoint else {
            return Exporter {
                sink: SpanSink { tx: None, stats },
                task: None,
            };
        };
        let url = traces_url(&endpoint);
        // Capacity counted in per-request span groups; at 10k req/s this is ~1.6 s of slack.
        let (tx, rx) = mpsc::channel::<Vec<Span>>(16 * 1024);
        let mut resource_attrs = vec![
            kv_str("service.name", cfg.service_name),
            kv_str("telemetry.sdk.language", "rust"),
            kv_str("telemetry.sdk.name", "pd-sim"),
        ];
        resource_attrs.extend(cfg.resource_attrs);
        let resource = Resource {
            attributes: resource_attrs,
            dropped_attributes_count: 0,
            entity_refs: Vec::new(),
        };
        let scope = InstrumentationScope {
            name: cfg.scope_name.into(),
            ..Default::default()
        };
        let task = tokio::spawn(export_loop(url, rx, resource, scope, stats.clone()));
        Exporter {
            sink: SpanSink {
                tx: Some(tx),
                stats,
            },
            task: Some(task),
        }
    }

    /// Close the queue and give the exporter a bounded time to flush what is left.
    pub async fn shutdown(mut self, timeout: Duration) {
        self.sink.tx = None;
        drop(self.sink);
        if let Some(t) = self.task.take() {
            let _ = tokio::time::timeout(timeout, t).await;
        }
    }
}

/// `http://host:4318` → `http://host:4318/v1/traces`; an explicit path is kept as given.
pub fn traces_url(endpoint: &str) -> String {
    let e = endpoint.trim_end_matches('/');
    let after_scheme = e.split_once("://").map(|(_, r)| r).unwrap_or(e);
    if after_scheme.contains('/') {
        e.to_string()
    } else {
        format!("{e}/v1/traces")
    }
}

impl SpanSink {
    pub fn enabled(&self) -> bool {
        self.tx.is_some()
    }

    pub fn emit(&self, spans: Vec<Span>) {
        let Some(tx) = &self.tx else { return };
        let n = spans.len() as u64;
        match tx.try_send(spans) {
            Ok(()) => {
                self.stats.spans_emitted.fetch_add(n, Ordering::Relaxed);
            }
            Err(_) => {
                self.stats
                    .spans_dropped_queue_full
                    .fetch_add(n, Ordering::Relaxed);
            }
        }
    }
}

const MAX_BATCH_SPANS: usize = 4096;
const BATCH_LINGER: Duration = Duration::from_millis(200);

/// How long a batch waits for more spans: 200 ms, or `PD_SIM_OTLP_LINGER_MS` (inherited by the
/// children of `cluster`; the detection-latency benchmark shortens it, an SDK's
/// `BatchSpanProcessor` default is 5 s).
fn batch_linger() -> Duration {
    std::env::var("PD_SIM_OTLP_LINGER_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map(Duration::from_millis)
        .unwrap_or(BATCH_LINGER)
}

async fn export_loop(
    url: String,
    mut rx: mpsc::Receiver<Vec<Span>>,
    resource: Resource,
    scope: InstrumentationScope,
    stats: Arc<ExportStats>,
) {
    let client = http_client(4);
    let uri: hyper::Uri = match url.parse() {
        Ok(u) => u,
        Err(e) => {
            tracing::error!(%url, error = %e, "invalid OTLP endpoint; spans will be counted as failed");
            while let Some(s) = rx.recv().await {
                stats
                    .spans_failed
                    .fetch_add(s.len() as u64, Ordering::Relaxed);
            }
            return;
        }
    };
    let mut batch: Vec<Span> = Vec::with_capacity(MAX_BATCH_SPANS);
    let linger = batch_linger();
    loop {
        let first = rx.recv().await;
        let Some(first) = first else { break };
        batch.extend(first);
        let deadline = tokio::time::Instant::now() + linger;
        let mut closed = false;
        while batch.len() < MAX_BATCH_SPANS {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(s)) => batch.extend(s),
                Ok(None) => {
                    closed = true;
                    break;
                }
                Err(_) => break,
            }
        }
        let spans = std::mem::take(&mut batch);
        send_batch(&client, &uri, &resource, &scope, spans, &stats).await;
        if closed {
            break;
        }
    }
}

async fn send_batch(
    client: &HttpClient,
    uri: &hyper::Uri,
    resource: &Resource,
    scope: &InstrumentationScope,
    spans: Vec<Span>,
    stats: &ExportStats,
) {
    let n = spans.len() as u64;
    let req = ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(resource.clone()),
            scope_spans: vec![ScopeSpans {
                scope: Some(scope.clone()),
                spans,
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        }],
    };
    let body = Bytes::from(req.encode_to_vec());
    let mut backoff = Duration::from_millis(100);
    for attempt in 0..4 {
        if attempt > 0 {
            stats.export_retries.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(backoff).await;
            backoff *= 2;
        }
        let r = hyper::Request::post(uri.clone())
            .header("content-type", "application/x-protobuf")
            .body(Full::new(body.clone()))
            .expect("static request parts");
        match tokio::time::timeout(Duration::from_secs(5), client.request(r)).await {
            Ok(Ok(resp)) => {
                let status = resp.status();
                let _ = resp.into_body().collect().await;
                if status.is_success() {
                    stats.batches_exported.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                if !(status.as_u16() == 429 || status.as_u16() == 503 || status.as_u16() == 502) {
                    tracing::warn!(
                        status = status.as_u16(),
                        spans = n,
                        "OTLP export rejected (permanent)"
                    );
                    break;
                }
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "OTLP export failed"),
            Err(_) => tracing::debug!("OTLP export timed out"),
        }
    }
    stats.batches_failed.fetch_add(1, Ordering::Relaxed);
    stats.spans_failed.fetch_add(n, Ordering::Relaxed);
    tracing::warn!(spans = n, "OTLP export failed; batch counted as failed");
}

/// This machine's name for the `host.name` resource attribute (revenant's clock domain), from
/// gethostname(2); "localhost" if it cannot be read.
pub fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is writable for its full length; gethostname NUL-terminates on success.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "localhost".into();
    }
    let n = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traces_url_appends_default_path_only_when_missing() {
        assert_eq!(
            traces_url("http://127.0.0.1:4318"),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            traces_url("http://127.0.0.1:4318/"),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            traces_url("http://h:1/custom/traces"),
            "http://h:1/custom/traces"
        );
    }

    #[test]
    fn error_span_carries_reason_and_error_status() {
        let s = SpanSpec {
            trace_id: [1; 16],
            span_id: [2; 8],
            parent: None,
            name: "x".into(),
            start_ns: 10,
            end_ns: 5,
            attributes: vec![],
            events: vec![],
            error: Some("boom"),
        }
        .build();
        assert_eq!(s.status.unwrap().code, status::StatusCode::Error as i32);
        assert_eq!(s.attributes[0].key, "reason");
        assert_eq!(s.end_time_unix_nano, 10, "end never precedes start");
    }
}
