//! OTLP receivers: gRPC (tonic, the maintained `opentelemetry-proto` services) and HTTP (axum,
//! protobuf and JSON, gzip), both feeding one [`Ingest`] core.
//!
//! End-to-end acknowledgement: a request is answered OK only after its events were accepted by
//! the pipeline's bounded channel. The channel slot is reserved *before* the span tree is
//! touched, so a refused request (gRPC `UNAVAILABLE`, HTTP 503 + Retry-After) leaves no state
//! behind and the client's retry is processed as if it were the first try.

pub mod config;
pub mod grpc;
pub mod http;
pub mod json;
pub mod metrics;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::event::now_unix_ns;

use opentelemetry_proto::tonic::collector::logs::v1::ExportLogsServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use tokio::sync::mpsc;

pub use config::OtlpConfig;
pub use metrics::{OtlpStats, RejectReason, Transport};

use crate::event::EventBatch;
use crate::normalize::vllm_router::JoinOutcome;
use crate::normalize::{Normalizer, Tally};
use crate::telemetry::memory::{self, MemoryAccount, Structure};

/// Why an export was not accepted; decides the status code the client sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AcceptError {
    /// Retryable: the pipeline is full.
    #[error("pipeline full, retry later")]
    Full,
    /// Retryable from the client's view: we are shutting down.
    #[error("pipeline closed (shutting down)")]
    Closed,
    /// Permanent: the export holds more spans or records than one request may.
    #[error("export holds {got} items, the limit is {limit}")]
    TooManyItems { got: usize, limit: usize },
}

/// The part both transports share: limits, the normalizer, the channel and the counters.
pub struct Ingest {
    tx: mpsc::Sender<EventBatch>,
    normalizer: Mutex<Normalizer>,
    /// The event channel's and the span tree's share of the memory budget: a channel holding
    /// its share of queued events refuses like a full one.
    memory: Arc<MemoryAccount>,
    pub stats: Arc<OtlpStats>,
    pub max_items_per_request: usize,
    /// Rate limit of the refusal WARN lines, shared by both transports.
    pub refusal_log: RefusalLog,
}

impl Ingest {
    pub fn new(
        tx: mpsc::Sender<EventBatch>,
        normalizer: Normalizer,
        stats: Arc<OtlpStats>,
        max_items_per_request: usize,
        memory: Arc<MemoryAccount>,
    ) -> Self {
        Ingest {
            tx,
            normalizer: Mutex::new(normalizer),
            memory,
            stats,
            max_items_per_request,
            refusal_log: RefusalLog::default(),
        }
    }

    fn reserve(
        &self,
        items: usize,
        transport: Transport,
    ) -> Result<mpsc::Permit<'_, EventBatch>, AcceptError> {
        if items > self.max_items_per_request {
            self.stats
                .rejected(transport, RejectReason::TooManyItems, items as u64);
            return Err(AcceptError::TooManyItems {
                got: items,
                limit: self.max_items_per_request,
            });
        }
        if self.memory.full(Structure::EventChannel) {
            self.stats
                .rejected(transport, RejectReason::PipelineFull, items as u64);
            return Err(AcceptError::Full);
        }
        self.tx.try_reserve().map_err(|e| match e {
            mpsc::error::TrySendError::Full(()) => {
                self.stats
                    .rejected(transport, RejectReason::PipelineFull, items as u64);
                AcceptError::Full
            }
            mpsc::error::TrySendError::Closed(()) => {
                self.stats
                    .rejected(transport, RejectReason::PipelineClosed, items as u64);
                AcceptError::Closed
            }
        })
    }

    pub fn accept_traces(
        &self,
        req: &ExportTraceServiceRequest,
        transport: Transport,
    ) -> Result<usize, AcceptError> {
        let spans: usize = req
            .resource_spans
            .iter()
            .flat_map(|r| &r.scope_spans)
            .map(|s| s.spans.len())
            .sum();
        let permit = self.reserve(spans, transport)?;
        let mut out = Vec::with_capacity(spans * 2);
        let mut tally = Tally::default();
        {
            let mut n = self.normalizer.lock().unwrap_or_else(|p| p.into_inner());
            n.traces(req, now_unix_ns(), &mut out, &mut tally);
        }
        self.stats.accepted(transport, &tally);
        let events = out.len();
        if !out.is_empty() {
            self.memory
                .add_used(Structure::EventChannel, memory::batch_bytes(&out));
            permit.send(out);
        }
        Ok(events)
    }

    pub fn accept_logs(
        &self,
        req: &ExportLogsServiceRequest,
        transport: Transport,
    ) -> Result<usize, AcceptError> {
        let records: usize = req
            .resource_logs
            .iter()
            .flat_map(|r| &r.scope_logs)
            .map(|s| s.log_records.len())
            .sum();
        let permit = self.reserve(records, transport)?;
        let mut out = Vec::new();
        let mut tally = Tally::default();
        {
            let mut n = self.normalizer.lock().unwrap_or_else(|p| p.into_inner());
            n.logs(req, &mut out, &mut tally);
        }
        self.stats.accepted_logs(transport, &tally);
        let events = out.len();
        if !out.is_empty() {
            self.memory
                .add_used(Structure::EventChannel, memory::batch_bytes(&out));
            permit.send(out);
        }
        Ok(events)
    }

    /// Gives up on orphans past their deadline and releases deferred completions; the run loop
    /// calls it about once a second. Waits for channel room (it is the only sender that may).
    pub async fn tick(&self) {
        let mut tally = Tally::default();
        let mut out = Vec::new();
        let (waiting, join_pending) = {
            let mut n = self.normalizer.lock().unwrap_or_else(|p| p.into_inner());
            n.tick(now_unix_ns(), &mut out, &mut tally);
            self.memory
                .set_used(Structure::SpanTree, n.tree_bytes() as u64);
            self.memory
                .set_evictions(Structure::SpanTree, n.tree_evictions().total());
            (n.orphans_waiting(), n.join_pending())
        };
        self.stats.add_tally(&tally);
        self.stats
            .orphans_waiting
            .store(waiting as u64, std::sync::atomic::Ordering::Relaxed);
        self.stats
            .trace_join_pending
            .store(join_pending as u64, std::sync::atomic::Ordering::Relaxed);
        let evicted = tally.join_count(JoinOutcome::EvictedPending)
            + tally.join_count(JoinOutcome::EvictedTrace);
        if evicted > 0 {
            tracing::warn!(
                count = evicted,
                "otlp: trace join full, dropped router rejections or trace rids (normalize.trace_join)"
            );
        }
        let given_up = tally.total_unmapped();
        if given_up > 0 {
            tracing::warn!(
                count = given_up,
                "otlp: gave up on orphan spans whose attempt root never arrived"
            );
        }
        if !out.is_empty() {
            let bytes = memory::batch_bytes(&out);
            self.memory.add_used(Structure::EventChannel, bytes);
            if self.tx.send(out).await.is_err() {
                self.memory.sub_used(Structure::EventChannel, bytes);
                tracing::warn!("otlp: pipeline closed, deferred completions not delivered");
            }
        }
    }
}

impl Ingest {
    /// SGLang root completions still inside their grace period (not yet believed).
    pub fn pending_completions(&self) -> usize {
        self.normalizer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pending_completions()
    }

    /// Shutdown, after the receivers stopped: sends the deferred completions (no abort can
    /// arrive any more). Returns how many events were sent.
    pub async fn flush(&self) -> usize {
        let mut out = Vec::new();
        self.normalizer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .flush(&mut out);
        let n = out.len();
        self.stats
            .events_emitted
            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        let bytes = memory::batch_bytes(&out);
        self.memory.add_used(Structure::EventChannel, bytes);
        if n > 0 && self.tx.send(out).await.is_err() {
            self.memory.sub_used(Structure::EventChannel, bytes);
            tracing::warn!(
                count = n,
                "shutdown: pipeline closed, deferred completions not delivered"
            );
            return 0;
        }
        n
    }
}

/// Retry-After sent with 503: long enough for the checker to drain a full channel.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);

/// How often one refusal reason may log a WARN line; the metrics count every refusal.
pub const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Rate-limits the per-export refusal WARN: at most one line per reason per
/// [`REFUSAL_LOG_INTERVAL`], carrying how many refusals were not logged since the last line. A
/// misbehaving client sending thousands of bad exports a second must not flood the log.
#[derive(Debug, Default)]
pub struct RefusalLog {
    slots: Mutex<[(Option<std::time::Instant>, u64); RejectReason::ALL.len()]>,
}

impl RefusalLog {
    /// `Some(suppressed)` when this refusal should be logged (with the count of refusals of the
    /// same reason not logged since the previous line), `None` when it is suppressed.
    pub fn admit(&self, reason: RejectReason, now: std::time::Instant) -> Option<u64> {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let (last, suppressed) = &mut slots[reason as usize];
        match last {
            Some(t) if now.saturating_duration_since(*t) < REFUSAL_LOG_INTERVAL => {
                *suppressed += 1;
                None
            }
            _ => {
                *last = Some(now);
                Some(std::mem::take(suppressed))
            }
        }
    }
}

#[cfg(test)]
mod refusal_log_tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn one_line_per_reason_per_interval_with_suppressed_count() {
        let log = RefusalLog::default();
        let t0 = Instant::now();
        assert_eq!(log.admit(RejectReason::Malformed, t0), Some(0));
        assert_eq!(log.admit(RejectReason::Malformed, t0), None);
        assert_eq!(
            log.admit(RejectReason::Malformed, t0 + Duration::from_secs(9)),
            None
        );
        // Another reason has its own budget.
        assert_eq!(log.admit(RejectReason::TooLarge, t0), Some(0));
        assert_eq!(
            log.admit(RejectReason::Malformed, t0 + REFUSAL_LOG_INTERVAL),
            Some(2)
        );
        assert_eq!(
            log.admit(RejectReason::Malformed, t0 + REFUSAL_LOG_INTERVAL),
            None
        );
    }
}

impl Ingest {
    /// Logs a refused export at WARN, at most once per reason per [`REFUSAL_LOG_INTERVAL`].
    pub fn log_refusal(&self, transport: Transport, reason: RejectReason, code: u16, msg: &str) {
        if let Some(suppressed) = self.refusal_log.admit(reason, std::time::Instant::now()) {
            tracing::warn!(
                transport = transport.as_str(),
                reason = reason.as_str(),
                code,
                suppressed,
                error = %crate::event::truncate_reason(msg),
                "otlp: export refused (suppressed = same-reason refusals not logged in the last 10s; every one is counted in revenant_otlp_requests_rejected_total)"
            );
        }
    }
}

/// `google.rpc.Status`, the body of every OTLP/HTTP error response (the OTLP spec requires it,
/// encoded like the request). `details` (field 3) is never sent.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RpcStatus {
    #[prost(int32, tag = "1")]
    pub code: i32,
    #[prost(string, tag = "2")]
    pub message: String,
}
