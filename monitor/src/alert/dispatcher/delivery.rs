//! One delivery worker per sink: queue (the spool) → retry (backoff, Retry-After) → timeout (the
//! sink's HTTP client); an acknowledgement is recorded in the spool.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::DispatchConfig;
use crate::alert::events::{AlertDeliveryFailed, AlertsDelivered, SpoolSize};
use crate::alert::notification::{Notification, now_unix_ns};
use crate::alert::sink::{Backoff, Sink, SinkError};
use crate::alert::spool::Spool;
use crate::telemetry::metrics::Metrics;

pub(super) struct SinkQueue {
    pub(super) sink: Arc<dyn Sink>,
    pub(super) queue: std::sync::Mutex<VecDeque<u64>>,
    pub(super) notify: Notify,
    /// Enqueued and not yet acknowledged.
    pub(super) outstanding: AtomicUsize,
}

impl SinkQueue {
    pub(super) fn push(&self, seq: u64) {
        self.outstanding.fetch_add(1, Ordering::SeqCst);
        self.queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(seq);
        self.notify.notify_one();
    }
}

pub(super) async fn sink_worker(
    q: Arc<SinkQueue>,
    spool: Spool,
    metrics: Arc<Metrics>,
    cfg: DispatchConfig,
) {
    let name = q.sink.name().to_string();
    let max_batch = q.sink.max_batch().max(1);
    let mut backoff = Backoff::new(cfg.retry_initial, cfg.retry_max);
    loop {
        let seqs: Vec<u64> = {
            let mut g = q.queue.lock().unwrap_or_else(|p| p.into_inner());
            let n = g.len().min(max_batch);
            g.drain(..n).collect()
        };
        if seqs.is_empty() {
            q.notify.notified().await;
            continue;
        }
        // Entries acknowledged meanwhile are skipped, not resent (only this worker acknowledges
        // its sink's entries, so none are expected).
        let batch: Vec<(u64, Arc<Notification>)> = seqs
            .iter()
            .filter_map(|s| spool.get(*s).map(|n| (*s, n)))
            .collect();
        let skipped = seqs.len() - batch.len();
        if skipped > 0 {
            q.outstanding.fetch_sub(skipped, Ordering::SeqCst);
        }
        deliver_with_retry(&q, &name, &batch, &spool, &metrics, &cfg, &mut backoff).await;
    }
}

async fn deliver_with_retry(
    q: &SinkQueue,
    name: &str,
    batch: &[(u64, Arc<Notification>)],
    spool: &Spool,
    metrics: &Metrics,
    cfg: &DispatchConfig,
    backoff: &mut Backoff,
) {
    if batch.is_empty() {
        return;
    }
    let notes: Vec<Arc<Notification>> = batch.iter().map(|(_, n)| n.clone()).collect();
    loop {
        let started = Instant::now();
        let span = tracing::info_span!("alert.deliver", sink = name, notifications = notes.len());
        match tracing::Instrument::instrument(q.sink.deliver(&notes), span).await {
            Ok(()) => {
                backoff.reset();
                let now = now_unix_ns();
                let latencies: Vec<Duration> = notes
                    .iter()
                    .map(|n| Duration::from_nanos(now.saturating_sub(n.received_at_ns())))
                    .collect();
                AlertsDelivered {
                    sink: name,
                    count: notes.len(),
                    duration: started.elapsed(),
                    latencies: &latencies,
                }
                .emit(metrics);
                ack_all(q, name, batch, spool, metrics);
                return;
            }
            Err(SinkError::Permanent { reason, status }) => {
                if batch.len() > 1 {
                    // One bad notification must not take its batch-mates down with it.
                    tracing::warn!(
                        sink = name,
                        status,
                        "batch refused; retrying its notifications one by one"
                    );
                    for item in batch {
                        Box::pin(deliver_with_retry(
                            q,
                            name,
                            std::slice::from_ref(item),
                            spool,
                            metrics,
                            cfg,
                            backoff,
                        ))
                        .await;
                    }
                    return;
                }
                AlertDeliveryFailed {
                    sink: name,
                    permanent: true,
                    count: 1,
                    status,
                    error: &reason,
                    retry_in: None,
                }
                .emit(metrics);
                ack_all(q, name, batch, spool, metrics);
                return;
            }
            Err(SinkError::Retryable {
                reason,
                status,
                retry_after,
            }) => {
                let delay = match retry_after {
                    Some(d) => d.min(cfg.max_retry_after),
                    None => backoff.next_delay(),
                };
                AlertDeliveryFailed {
                    sink: name,
                    permanent: false,
                    count: notes.len(),
                    status,
                    error: &reason,
                    retry_in: Some(delay),
                }
                .emit(metrics);
                tokio::time::sleep(delay).await;
            }
        }
    }
}

fn ack_all(
    q: &SinkQueue,
    name: &str,
    batch: &[(u64, Arc<Notification>)],
    spool: &Spool,
    metrics: &Metrics,
) {
    for (seq, _) in batch {
        if let Err(e) = spool.ack(*seq, q.sink.identity()) {
            // The entry stays on disk and is redelivered after a restart: duplicates, not loss.
            tracing::error!(sink = name, error = %e, "cannot record acknowledgement in the spool");
        }
    }
    q.outstanding.fetch_sub(batch.len(), Ordering::SeqCst);
    let (entries, bytes) = spool.size();
    SpoolSize { entries, bytes }.emit(metrics);
}
