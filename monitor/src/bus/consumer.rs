//! The checker's side: one durable pull consumer per owned partition, each message decoded,
//! recognised again if it was taken before (redelivery, a publish retried past the duplicate
//! window, a batch read again by [`recover`]), and its events handed to the engine task through
//! the same bounded channel `run`'s sources use (the consumer waits on it: JetStream holds what
//! the checker has not taken yet). How far each agent's stream came ([`Streams`]) is recorded
//! once the batch's events are in that channel, so the engine's watermark never runs ahead of
//! what it has been given.
//!
//! Events that went to every partition (request- and worker-level, see `partition`) are observed
//! from the lowest partition this checker owns only, so each reaches its engine once.

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::event::now_unix_ns;

use futures_util::StreamExt;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use super::progress::{Streams, Taken};
use super::wire::decode;
use crate::pipeline::EventSender;
use crate::pipeline::engine_task::Upstream;
use crate::telemetry::events::ItemsDropped;
use crate::telemetry::metrics::{DropPoint, DropReason, Metrics, counter, gauge};

#[derive(Debug, Default)]
pub struct CheckerStats {
    pub messages: AtomicU64,
    pub events: AtomicU64,
    pub duplicates: AtomicU64,
    pub undecodable: AtomicU64,
    pub broadcast_skipped: AtomicU64,
    pub late_batches: AtomicU64,
    pub streams_silent: AtomicU64,
    pub batches_missing: AtomicU64,
    pub recovered_messages: AtomicU64,
    pub recovering: AtomicU64,
}

/// The agents' streams, shared by the partition loops, the engine task (the watermark's bound)
/// and the scrape.
#[derive(Debug, Clone)]
pub struct SharedStreams(Arc<Mutex<Streams>>);

impl SharedStreams {
    pub fn new(streams: Streams) -> SharedStreams {
        SharedStreams(Arc::new(Mutex::new(streams)))
    }

    pub fn lock(&self) -> MutexGuard<'_, Streams> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Upstream for SharedStreams {
    fn bound(&self, now_ns: u64) -> Option<u64> {
        self.lock().bound(now_ns)
    }

    fn newest(&self) -> u64 {
        self.lock().newest()
    }
}

struct CheckerCollector {
    stats: Arc<CheckerStats>,
    streams: SharedStreams,
}

impl std::fmt::Debug for CheckerCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CheckerCollector")
    }
}

impl Collector for CheckerCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let s = &self.stats;
        for (name, help, v) in [
            (
                "revenant_checker_messages",
                "Bus messages (batches) received",
                &s.messages,
            ),
            (
                "revenant_checker_bus_events",
                "Events taken off the bus and handed to the engine (batches taken before not counted)",
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
            (
                "revenant_checker_late_batches",
                "Batches of agent streams given up on as silent: their events may have been judged late",
                &s.late_batches,
            ),
            (
                "revenant_checker_silent_streams",
                "Agent streams given up on: nothing heard for --agent-silence while caught up",
                &s.streams_silent,
            ),
            (
                "revenant_checker_missing_batches",
                "Batches never received (dropped by their agent) and skipped over after --agent-silence",
                &s.batches_missing,
            ),
            (
                "revenant_checker_recovered_messages",
                "Messages read again at start to rebuild the engine's state (--recovery-window)",
                &s.recovered_messages,
            ),
        ] {
            counter(&mut enc, name, help, v.load(Relaxed))?;
        }
        gauge(
            &mut enc,
            "revenant_checker_recovering_partitions",
            "Partitions still being read again at start",
            s.recovering.load(Relaxed) as i64,
        )?;
        let (live, behind, lag) = {
            let st = self.streams.lock();
            let now = now_unix_ns();
            let lag = st
                .bound(now)
                .map_or(f64::NAN, |b| now.saturating_sub(b) as f64 / 1e9);
            (st.live(), st.behind(), lag)
        };
        gauge(
            &mut enc,
            "revenant_checker_partitions_behind",
            "Partitions this checker judges whose consumer is not known to be caught up (messages pending at its last look, not read yet, or NATS away)",
            behind as i64,
        )?;
        gauge(
            &mut enc,
            "revenant_checker_agent_streams",
            "Agent streams (agent life × partition) that bound the watermark",
            live as i64,
        )?;
        gauge(
            &mut enc,
            "revenant_checker_input_lag_seconds",
            "How far behind the wall clock the input provably came (NaN: held, nothing known yet)",
            lag,
        )
    }
}

/// Renders the checker's counters at every scrape; declares its drop series.
pub fn register(metrics: &Metrics, stats: Arc<CheckerStats>, streams: SharedStreams) {
    metrics.declare_drop(DropPoint::BusMessage);
    metrics.register_collector(CheckerCollector { stats, streams });
}

/// How long a partition waits before trying NATS again after a failed request.
const RETRY: Duration = Duration::from_secs(1);

/// What one partition's loop shares with the others.
#[derive(Clone)]
pub struct PartitionCtx {
    pub streams: SharedStreams,
    pub stats: Arc<CheckerStats>,
    pub metrics: Arc<Metrics>,
    /// The lowest partition this checker owns: the one broadcast events are taken from.
    pub first_owned: u32,
    /// Whether this checker still holds the leases of its partitions (`lease`): once it does
    /// not, it acknowledges nothing and pulls nothing more.
    pub fence: super::lease::Fence,
}

/// Hands one message's batch to the engine: decoded, skipped if taken before, broadcast copies
/// left to the lowest owned partition; then records how far its stream came. False once the
/// engine's channel is closed (draining).
async fn feed(payload: &[u8], k: u32, tx: &EventSender, ctx: &PartitionCtx) -> bool {
    ctx.stats.messages.fetch_add(1, Relaxed);
    let batch = match decode(payload) {
        Ok(b) => b,
        Err(e) => {
            ctx.stats.undecodable.fetch_add(1, Relaxed);
            tracing::warn!(partition = k, error = %e, "undecodable bus message skipped");
            ItemsDropped {
                point: DropPoint::BusMessage,
                reason: DropReason::Undecodable,
                count: 1,
            }
            .emit(&ctx.metrics);
            return true;
        }
    };
    if !ctx.streams.lock().is_new(&batch.header) {
        ctx.stats.duplicates.fetch_add(1, Relaxed);
        return true;
    }
    let header = batch.header;
    let total = batch.events.len();
    let events: Vec<_> = if k == ctx.first_owned || header.broadcast.is_empty() {
        batch.events
    } else {
        batch
            .events
            .into_iter()
            .enumerate()
            .filter(|(i, _)| header.broadcast.binary_search(&(*i as u32)).is_err())
            .map(|(_, e)| e)
            .collect()
    };
    ctx.stats
        .broadcast_skipped
        .fetch_add((total - events.len()) as u64, Relaxed);
    ctx.stats.events.fetch_add(events.len() as u64, Relaxed);
    if !events.is_empty() && tx.send(events).await.is_err() {
        return false;
    }
    if let Taken::First { late: true } = ctx.streams.lock().take(&header, now_unix_ns()) {
        ctx.stats.late_batches.fetch_add(1, Relaxed);
        tracing::warn!(
            node = %header.node, partition = k,
            "a batch from an agent stream given up on as silent: its events may be judged late"
        );
    }
    true
}

/// After a pause of [`RETRY`], partition `k`'s durable consumer looked up again (created
/// again if it was deleted); `None` while NATS does not answer.
pub async fn reopen(
    stream: &async_nats::jetstream::stream::Stream,
    bus: &super::BusConfig,
    k: u32,
    fence: &super::lease::Fence,
) -> Option<async_nats::jetstream::consumer::PullConsumer> {
    tokio::time::sleep(RETRY).await;
    if !fence.holds() {
        // Not created again by a checker that lost the partition: its next owner deleted it
        // to create it afresh, and must find its own.
        return None;
    }
    match tokio::time::timeout(
        Duration::from_secs(5),
        super::ensure_consumer(stream, bus, k),
    )
    .await
    {
        Ok(Ok(c)) => Some(c),
        Ok(Err(e)) => {
            tracing::warn!(partition = k, error = %e, "consumer not opened again");
            None
        }
        Err(_) => None,
    }
}

/// Consumes partition `k` until `stop` resolves or the engine's channel closes; never gives up
/// on NATS (a consumer that cannot be pulled from is looked up again, created again if it was
/// deleted). Whether the consumer is caught up (nothing pending) is read from each message and,
/// while idle, from the consumer's info once a second.
pub async fn run_partition(
    stream: async_nats::jetstream::stream::Stream,
    bus: super::BusConfig,
    mut consumer: async_nats::jetstream::consumer::PullConsumer,
    k: u32,
    tx: EventSender,
    ctx: PartitionCtx,
    stop: impl std::future::Future<Output = ()>,
) {
    let mut stop = std::pin::pin!(stop);
    // The pull is opened again whenever it cannot be opened or ends (NATS away, the consumer
    // being moved in a cluster): a checker outlives any outage of the bus.
    let mut messages = None;
    let mut poll = tokio::time::interval(Duration::from_secs(1));
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut idle = true;
    loop {
        if !ctx.fence.holds() {
            // The partition is another checker's now (or about to be): what was pulled and
            // not acknowledged is redelivered to it.
            return;
        }
        let pull = match &mut messages {
            Some(s) => s,
            None => {
                let opened = tokio::select! {
                    () = &mut stop => return,
                    r = consumer
                        .stream()
                        .max_messages_per_batch(256)
                        .heartbeat(Duration::from_secs(5))
                        .expires(Duration::from_secs(30))
                        .messages() => r,
                };
                match opened {
                    Ok(s) => messages.insert(s),
                    Err(e) => {
                        tracing::warn!(partition = k, error = %e, "consumer not reachable; retrying");
                        tokio::select! {
                            () = &mut stop => return,
                            c = reopen(&stream, &bus, k, &ctx.fence) => if let Some(c) = c { consumer = c },
                        }
                        continue;
                    }
                }
            }
        };
        let msg = tokio::select! {
            () = &mut stop => return,
            _ = poll.tick() => {
                if idle && let Ok(info) = consumer.get_info().await {
                    ctx.streams.lock().set_caught_up(k, info.num_pending == 0, now_unix_ns());
                }
                idle = true;
                continue;
            }
            m = pull.next() => match m {
                None => {
                    // Ended by the client (the consumer deleted, a pull refused for good): the
                    // consumer is looked up again, created again if it is gone.
                    tracing::warn!(partition = k, "the consumer's message stream ended; opening it again");
                    messages = None;
                    tokio::select! {
                        () = &mut stop => return,
                        c = reopen(&stream, &bus, k, &ctx.fence) => if let Some(c) = c { consumer = c },
                    }
                    continue;
                }
                Some(Err(e)) => {
                    // Heartbeats missed while the server is away: the stream recovers by itself.
                    tracing::warn!(partition = k, error = %e, "consumer");
                    continue;
                }
                Some(Ok(m)) => m,
            },
        };
        idle = false;
        let pending = msg.info().map(|i| i.pending).ok();
        if !feed(&msg.payload, k, &tx, &ctx).await {
            // The engine is draining: leave the message unacknowledged for the next checker.
            return;
        }
        if let Some(p) = pending {
            ctx.streams.lock().set_caught_up(k, p == 0, now_unix_ns());
        }
        if !ctx.fence.holds() {
            return;
        }
        if let Err(e) = msg.ack().await {
            tracing::warn!(partition = k, error = %e, "ack failed (the batch will be redelivered and recognised)");
        }
    }
}

/// Reads partition `k` again from `window` before where its durable consumer had come (by
/// publish time), up to the last message it had delivered, so that a checker that starts on a
/// partition another life of it (or another replica) was consuming rebuilds the engine state
/// that the verdicts still to come depend on. Violations this brings up again were notified
/// before: the notification claims (`claims`) keep them from being sent twice. Returns the
/// messages read; nothing when the consumer had delivered nothing yet.
pub async fn recover(
    stream: &async_nats::jetstream::stream::Stream,
    resume: super::Resume,
    subject: String,
    k: u32,
    window: Duration,
    tx: &EventSender,
    ctx: &PartitionCtx,
) -> Result<u64, String> {
    use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
    let err = |what: &str, e: &dyn std::fmt::Display| format!("partition {k}: {what}: {e}");
    let upto = resume.delivered;
    if upto == 0 {
        return Ok(0);
    }
    let anchor = match resume.ack_floor {
        0 => upto,
        a => a,
    };
    // Retention may have removed the anchor: then everything the stream still holds.
    let deliver_policy = match stream.get_raw_message(anchor).await {
        Ok(m) => DeliverPolicy::ByStartTime {
            start_time: m.time - window,
        },
        Err(_) => DeliverPolicy::All,
    };
    let replay = stream
        .create_consumer(pull::Config {
            filter_subject: subject,
            deliver_policy,
            ack_policy: AckPolicy::None,
            inactive_threshold: Duration::from_secs(60),
            ..Default::default()
        })
        .await
        .map_err(|e| err("replay consumer", &e))?;
    let name = replay.cached_info().name.clone();
    if replay.cached_info().num_pending == 0 {
        let _ = stream.delete_consumer(&name).await;
        return Ok(0);
    }
    let mut messages = replay
        .stream()
        .max_messages_per_batch(256)
        .messages()
        .await
        .map_err(|e| err("replay consumer", &e))?;
    let mut read = 0u64;
    loop {
        let next = tokio::time::timeout(Duration::from_secs(10), messages.next()).await;
        let msg = match next {
            Ok(Some(Ok(m))) => m,
            Ok(Some(Err(e))) => return Err(err("replay", &e)),
            Ok(None) => return Err(err("replay", &"the message stream ended")),
            // Nothing within the time: done if nothing is left (retention removed the rest),
            // else NATS is away and the caller reads the partition again once it is back.
            Err(_) => match replay.get_info().await {
                Ok(info) if info.num_pending == 0 => break,
                Ok(info) => {
                    let _ = stream.delete_consumer(&name).await;
                    return Err(err(
                        "replay",
                        &format!("stalled with {} messages pending", info.num_pending),
                    ));
                }
                Err(e) => return Err(err("replay consumer info", &e)),
            },
        };
        read += 1;
        ctx.stats.recovered_messages.fetch_add(1, Relaxed);
        let (seq, pending) = msg
            .info()
            .map(|i| (i.stream_sequence, i.pending))
            .unwrap_or((upto, 0));
        if !feed(&msg.payload, k, tx, ctx).await {
            break;
        }
        if seq >= upto || pending == 0 {
            break;
        }
    }
    drop(messages);
    if let Err(e) = stream.delete_consumer(&name).await {
        tracing::debug!(partition = k, error = %e, "replay consumer not deleted (it expires)");
    }
    Ok(read)
}
