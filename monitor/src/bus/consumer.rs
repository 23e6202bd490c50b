//! The checker's side: one durable pull consumer per owned partition, each message decoded,
//! recognised again if it was seen before (redelivery, a publish retried past the duplicate
//! window), and its events handed to the engine task through the same bounded channel `run`'s
//! sources use (the consumer waits on it: JetStream holds what the checker has not taken yet).
//!
//! Events that went to every partition (request- and worker-level, see `partition`) are observed
//! from the lowest partition this checker owns only, so each reaches its engine once.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use super::wire::{BatchHeader, decode};
use crate::pipeline::EventSender;
use crate::telemetry::events::ItemsDropped;
use crate::telemetry::metrics::{DropPoint, DropReason, Metrics, counter};

/// Which batches were seen, per (agent node, agent life, partition): every sequence number
/// below `floor`, and those in `above`. Bounded by the batches out of order at once.
#[derive(Debug, Default)]
pub struct Dedup {
    seen: HashMap<(Box<str>, u64, u32), Seen>,
}

#[derive(Debug, Default)]
struct Seen {
    floor: u64,
    above: BTreeSet<u64>,
}

impl Dedup {
    /// Records the batch; false when it was seen before.
    pub fn first_time(&mut self, h: &BatchHeader) -> bool {
        let s = self
            .seen
            .entry((h.node.as_str().into(), h.boot, h.partition))
            .or_default();
        if h.seq < s.floor || !s.above.insert(h.seq) {
            return false;
        }
        while s.above.first() == Some(&s.floor) {
            s.above.pop_first();
            s.floor += 1;
        }
        true
    }
}

#[derive(Debug, Default)]
pub struct CheckerStats {
    pub messages: AtomicU64,
    pub events: AtomicU64,
    pub duplicates: AtomicU64,
    pub undecodable: AtomicU64,
    pub broadcast_skipped: AtomicU64,
}

struct CheckerCollector(Arc<CheckerStats>);

impl std::fmt::Debug for CheckerCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CheckerCollector")
    }
}

impl Collector for CheckerCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let s = &self.0;
        for (name, help, v) in [
            (
                "revenant_checker_messages",
                "Bus messages (batches) received",
                &s.messages,
            ),
            (
                "revenant_checker_events",
                "Events handed to the engine",
                &s.events,
            ),
            (
                "revenant_checker_duplicate_batches",
                "Batches received again (redelivered or republished) and skipped",
                &s.duplicates,
            ),
            (
                "revenant_checker_broadcast_copies_skipped",
                "Copies of request-level events skipped (observed from the lowest owned partition)",
                &s.broadcast_skipped,
            ),
        ] {
            counter(&mut enc, name, help, v.load(Relaxed))?;
        }
        Ok(())
    }
}

/// Renders the checker's counters at every scrape; declares its drop series.
pub fn register(metrics: &Metrics, stats: Arc<CheckerStats>) {
    metrics.declare_drop(DropPoint::BusMessage);
    metrics.register_collector(CheckerCollector(stats));
}

/// What one partition's loop shares with the others.
#[derive(Clone)]
pub struct PartitionCtx {
    pub dedup: Arc<Mutex<Dedup>>,
    pub stats: Arc<CheckerStats>,
    pub metrics: Arc<Metrics>,
    /// The lowest partition this checker owns: the one broadcast events are taken from.
    pub first_owned: u32,
    /// The newest event time any agent reported (batch headers): where the input has come to,
    /// for the engine's event-time watermark.
    pub newest: Arc<AtomicU64>,
}

/// Consumes partition `k` until `stop` resolves or the engine's channel closes.
pub async fn run_partition(
    consumer: async_nats::jetstream::consumer::PullConsumer,
    k: u32,
    tx: EventSender,
    ctx: PartitionCtx,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), String> {
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(256)
        .heartbeat(Duration::from_secs(5))
        .expires(Duration::from_secs(30))
        .messages()
        .await
        .map_err(|e| format!("partition {k}: {e}"))?;
    let mut stop = std::pin::pin!(stop);
    loop {
        let msg = tokio::select! {
            () = &mut stop => return Ok(()),
            m = messages.next() => match m {
                None => return Err(format!("partition {k}: the consumer's message stream ended")),
                Some(Err(e)) => {
                    // Heartbeats missed while the server is away: the stream recovers by itself.
                    tracing::warn!(partition = k, error = %e, "consumer");
                    continue;
                }
                Some(Ok(m)) => m,
            },
        };
        ctx.stats.messages.fetch_add(1, Relaxed);
        match decode(&msg.payload) {
            Err(e) => {
                ctx.stats.undecodable.fetch_add(1, Relaxed);
                tracing::warn!(partition = k, error = %e, "undecodable bus message skipped");
                ItemsDropped {
                    point: DropPoint::BusMessage,
                    reason: DropReason::Undecodable,
                    count: 1,
                }
                .emit(&ctx.metrics);
            }
            Ok(batch) => {
                ctx.newest.fetch_max(batch.header.newest, Relaxed);
                let first = ctx
                    .dedup
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .first_time(&batch.header);
                if first {
                    let take_broadcast = k == ctx.first_owned;
                    let total = batch.events.len();
                    let events: Vec<_> = if take_broadcast || batch.header.broadcast.is_empty() {
                        batch.events
                    } else {
                        let broadcast = &batch.header.broadcast;
                        batch
                            .events
                            .into_iter()
                            .enumerate()
                            .filter(|(i, _)| broadcast.binary_search(&(*i as u32)).is_err())
                            .map(|(_, e)| e)
                            .collect()
                    };
                    let skipped = (total - events.len()) as u64;
                    ctx.stats.broadcast_skipped.fetch_add(skipped, Relaxed);
                    ctx.stats.events.fetch_add(events.len() as u64, Relaxed);
                    if !events.is_empty() && tx.send(events).await.is_err() {
                        // The engine is draining: leave the message unacknowledged for the
                        // next checker.
                        return Ok(());
                    }
                } else {
                    ctx.stats.duplicates.fetch_add(1, Relaxed);
                }
            }
        }
        if let Err(e) = msg.ack().await {
            tracing::warn!(partition = k, error = %e, "ack failed (the batch will be redelivered and recognised)");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bus::wire::WIRE_VERSION;

    fn h(node: &str, partition: u32, seq: u64) -> BatchHeader {
        BatchHeader {
            v: WIRE_VERSION,
            node: node.into(),
            boot: 1,
            partition,
            seq,
            first_event: 0,
            offsets: vec![],
            broadcast: vec![],
            newest: 0,
        }
    }

    #[test]
    fn batches_count_once_in_any_order() {
        let mut d = Dedup::default();
        assert!(d.first_time(&h("a", 0, 1)));
        assert!(d.first_time(&h("a", 0, 0)));
        assert!(!d.first_time(&h("a", 0, 0)));
        assert!(!d.first_time(&h("a", 0, 1)));
        assert!(d.first_time(&h("a", 1, 0)), "another partition");
        assert!(d.first_time(&h("b", 0, 0)), "another agent");
        assert!(d.first_time(&h("a", 0, 5)));
        assert!(!d.first_time(&h("a", 0, 5)));
        let s = &d.seen[&("a".into(), 1, 0)];
        assert_eq!((s.floor, s.above.len()), (2, 1), "contiguous prefix folded");
    }
}
