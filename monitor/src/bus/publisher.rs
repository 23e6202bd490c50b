//! The agent's two tasks between the sources and JetStream.
//!
//! - [`run_batcher`] takes the sources' batches off the bounded event channel, routes and
//!   batches them, and writes each sealed batch to the outbox (a local file write: it never
//!   waits on the network, so the channel keeps draining and the eBPF reader, which only ever
//!   `try_send`s, is never held up; a full outbox is a counted drop).
//! - [`run_publisher`] publishes the outbox in order with the batch id as `Nats-Msg-Id`, up to
//!   [`MAX_IN_FLIGHT`] acknowledgements outstanding (far below async-nats' own 5000-permit
//!   limit, each awaited in its own task, so the permits always come back), removes what
//!   JetStream acknowledged and retries the rest. While NATS cannot be reached, or the stream
//!   not be created, readiness is down with the reason.

use std::collections::HashSet;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use tokio::sync::Notify;
use tokio::task::JoinSet;

use super::batcher::{Batcher, Sealed};
use super::spool::Outbox;
use super::{BusConfig, BusError};
use crate::pipeline::EventReceiver;
use crate::telemetry::events::ItemsDropped;
use crate::telemetry::memory::MemoryAccount;
use crate::telemetry::metrics::{DropPoint, DropReason, Metrics, counter, gauge};
use crate::telemetry::{ComponentKind, Readiness};

/// Publishes awaiting their acknowledgement at once.
pub const MAX_IN_FLIGHT: usize = 256;

/// The agent's counters, rendered at scrape time.
#[derive(Debug, Default)]
pub struct AgentStats {
    pub events_in: AtomicU64,
    pub batches_sealed: AtomicU64,
    pub batches_published: AtomicU64,
    pub events_published: AtomicU64,
    pub publish_failures: AtomicU64,
    pub events_dropped: AtomicU64,
    pub outbox_batches: AtomicU64,
    pub outbox_bytes: AtomicU64,
    pub connected: AtomicU64,
    pub links_forgotten: AtomicU64,
}

struct AgentCollector(Arc<AgentStats>);

impl std::fmt::Debug for AgentCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AgentCollector")
    }
}

impl Collector for AgentCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let s = &self.0;
        for (name, help, v) in [
            (
                "revenant_agent_events",
                "Normalized events the agent routed to the bus",
                &s.events_in,
            ),
            (
                "revenant_agent_batches_sealed",
                "Batches sealed (one message each, per partition)",
                &s.batches_sealed,
            ),
            (
                "revenant_agent_batches_published",
                "Batches JetStream acknowledged",
                &s.batches_published,
            ),
            (
                "revenant_agent_events_published",
                "Events in acknowledged batches (request-level events count once per partition)",
                &s.events_published,
            ),
            (
                "revenant_agent_publish_failures",
                "Publishes that failed or were not acknowledged in time (retried)",
                &s.publish_failures,
            ),
            (
                "revenant_agent_events_dropped",
                "Events dropped because the outbox was full or could not be written",
                &s.events_dropped,
            ),
            (
                "revenant_agent_rid_links_forgotten",
                "rid → room links dropped from the partitioner's bounded map",
                &s.links_forgotten,
            ),
        ] {
            counter(&mut enc, name, help, v.load(Relaxed))?;
        }
        gauge(
            &mut enc,
            "revenant_agent_outbox_batches",
            "Batches waiting in the outbox",
            s.outbox_batches.load(Relaxed) as i64,
        )?;
        gauge(
            &mut enc,
            "revenant_agent_outbox_bytes",
            "Bytes waiting in the outbox",
            s.outbox_bytes.load(Relaxed) as i64,
        )?;
        gauge(
            &mut enc,
            "revenant_agent_nats_connected",
            "1 while the agent is connected to NATS",
            s.connected.load(Relaxed) as i64,
        )
    }
}

/// Renders the agent's counters at every scrape; declares its drop series.
pub fn register(metrics: &Metrics, stats: Arc<AgentStats>) {
    metrics.declare_drop(DropPoint::BusOutbox);
    metrics.register_collector(AgentCollector(stats));
}

/// The shared outbox and the signal that it has something new.
#[derive(Clone)]
pub struct Shared {
    pub outbox: Arc<Mutex<Outbox>>,
    pub wake: Arc<Notify>,
    pub stats: Arc<AgentStats>,
    pub metrics: Arc<Metrics>,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Outbox> {
        self.outbox.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn store(&self, sealed: &mut Vec<Sealed>) {
        if sealed.is_empty() {
            return;
        }
        let mut dropped = (0u64, 0u64);
        {
            let mut o = self.lock();
            for s in sealed.drain(..) {
                self.stats.batches_sealed.fetch_add(1, Relaxed);
                match o.push(&s) {
                    Ok(true) => {}
                    Ok(false) => dropped.0 += u64::from(s.events),
                    Err(e) => {
                        tracing::error!(error = %e, "outbox write failed: batch dropped");
                        dropped.1 += u64::from(s.events);
                    }
                }
            }
            self.stats.outbox_batches.store(o.len() as u64, Relaxed);
            self.stats.outbox_bytes.store(o.bytes(), Relaxed);
        }
        for (count, reason) in [
            (dropped.0, DropReason::Full),
            (dropped.1, DropReason::WriteError),
        ] {
            if count > 0 {
                self.stats.events_dropped.fetch_add(count, Relaxed);
                ItemsDropped {
                    point: DropPoint::BusOutbox,
                    reason,
                    count,
                }
                .emit(&self.metrics);
            }
        }
        self.wake.notify_one();
    }
}

/// Wall time in ns.
fn wall_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// What the agent does to its live sources' events.
pub struct Live {
    /// Given to events that name no node (OTLP's).
    pub node: Box<str>,
    /// Added to their times (testing aid: a node clock ahead of the others).
    pub shift_ns: u64,
    /// Credited back for each batch taken off the channel, as the engine task does in `run`:
    /// the OTLP receivers refuse exports while the channel's share is spent.
    pub memory: Arc<MemoryAccount>,
}

/// Drains the live sources' channel (`events`, see [`Live`]) and the replay channel (`replay`:
/// recorded events, kept as recorded) into the outbox until both close, then seals what is open.
pub async fn run_batcher(
    mut events: EventReceiver,
    mut replay: Option<EventReceiver>,
    mut batcher: Batcher,
    shared: Shared,
    linger: Duration,
    live: Live,
) {
    let mut sealed = Vec::new();
    let mut tick = tokio::time::interval(linger.max(Duration::from_millis(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut live_open = true;
    loop {
        let (batch, stamp) = tokio::select! {
            b = events.recv(), if live_open => match b {
                Some(b) => (b, true),
                None => {
                    live_open = false;
                    if replay.is_none() { break }
                    continue;
                }
            },
            b = async { replay.as_mut().expect("guarded").recv().await }, if replay.is_some() => match b {
                Some(b) => (b, false),
                None => {
                    replay = None;
                    if !live_open { break }
                    continue;
                }
            },
            _ = tick.tick() => {
                batcher.flush(wall_ns(), &mut sealed);
                shared.store(&mut sealed);
                shared.stats.links_forgotten.store(batcher.links_forgotten(), Relaxed);
                continue;
            }
        };
        if stamp {
            live.memory.taken_from_channel(&batch);
        }
        let now = wall_ns();
        shared
            .stats
            .events_in
            .fetch_add(batch.len() as u64, Relaxed);
        for mut e in batch {
            if stamp {
                if e.node.is_none() {
                    e.node = Some(live.node.clone());
                }
                e.time_ns = e.time_ns.saturating_add(live.shift_ns);
            }
            batcher.push(e, now, &mut sealed);
        }
        shared.store(&mut sealed);
    }
    batcher.finish(wall_ns(), &mut sealed);
    shared.store(&mut sealed);
}

/// How [`run_publisher`] ended.
#[derive(Debug, Default, Clone, Copy)]
pub struct PublishReport {
    pub batches: u64,
    /// Left in the outbox for the next start.
    pub left: u64,
}

/// Publishes the outbox until `done` is notified and the outbox is empty, or `deadline` passes
/// after `done` (what is left stays on disk).
pub async fn run_publisher(
    client: async_nats::Client,
    cfg: BusConfig,
    shared: Shared,
    readiness: Readiness,
    done: Arc<Notify>,
    drain_budget: Duration,
) -> PublishReport {
    let js = async_nats::jetstream::new(client.clone());
    let handle = readiness.register("nats", ComponentKind::Sink);
    handle.ready();
    let url = cfg.nats.clone().unwrap_or_default();
    let mut stream_ok = false;
    let mut stream_err = String::from("not looked up yet");
    let mut inflight: HashSet<u64> = HashSet::new();
    let mut acks: JoinSet<(u64, u32, bool)> = JoinSet::new();
    let mut report = PublishReport::default();
    let mut draining: Option<tokio::time::Instant> = None;
    let mut backoff = Duration::from_millis(100);
    // After a failed publish, nothing is sent again before this (a new leader takes seconds to
    // be elected: retrying at once would only fail again).
    let mut retry_after = tokio::time::Instant::now();
    let mut last_state: Option<String> = Some(String::new());
    let mut done_wait = std::pin::pin!(done.notified());
    loop {
        // Readiness follows the connection and the stream.
        let connected = client.connection_state() == async_nats::connection::State::Connected;
        shared.stats.connected.store(u64::from(connected), Relaxed);
        let why = if !connected {
            let o = shared.lock();
            Some(format!(
                "NATS {url} unreachable: {} batches ({} bytes) wait in the outbox",
                o.len(),
                o.bytes()
            ))
        } else if !stream_ok {
            Some(format!("stream {} not available: {stream_err}", cfg.stream))
        } else {
            None
        };
        if why.as_ref().map(|_| ()) != last_state.as_ref().map(|_| ()) {
            match &why {
                Some(w) => tracing::warn!(reason = %w, "not ready"),
                None => tracing::info!(stream = %cfg.stream, "publishing to JetStream"),
            }
        }
        readiness.set_down("nats", why.clone());
        last_state = why;
        if connected && !stream_ok {
            match tokio::time::timeout(Duration::from_secs(5), super::ensure_stream(&js, &cfg))
                .await
            {
                Ok(Ok(_)) => stream_ok = true,
                Ok(Err(e @ BusError::Partitions { .. })) => {
                    let text = e.to_string();
                    if text != stream_err {
                        tracing::error!(error = %e, "cannot publish");
                    }
                    stream_err = text;
                }
                Ok(Err(e)) => {
                    let text = e.to_string();
                    if text != stream_err {
                        tracing::warn!(error = %e, "stream not ready");
                    }
                    stream_err = text;
                }
                Err(_) => {
                    tracing::warn!("stream lookup timed out");
                    stream_err = "lookup timed out".into();
                }
            }
        }
        // Send what is not in flight yet.
        if connected && stream_ok && tokio::time::Instant::now() >= retry_after {
            let todo: Vec<super::spool::Entry> = {
                let o = shared.lock();
                o.peek(0, MAX_IN_FLIGHT * 2)
                    .filter(|e| !inflight.contains(&e.seq))
                    .take(MAX_IN_FLIGHT.saturating_sub(inflight.len()))
                    .cloned()
                    .collect()
            };
            for e in todo {
                let payload = match shared.lock().payload(&e) {
                    Ok(p) => p,
                    Err(err) => {
                        tracing::error!(error = %err, "outbox entry unreadable: dropped");
                        shared.lock().remove(e.seq);
                        continue;
                    }
                };
                let events = e.events;
                let publish = async_nats::jetstream::message::PublishMessage::build()
                    .payload(payload)
                    .message_id(e.msg_id.as_str());
                match js.send_publish(e.subject.clone(), publish).await {
                    Ok(ack) => {
                        inflight.insert(e.seq);
                        acks.spawn(async move { (e.seq, events, ack.await.is_ok()) });
                    }
                    Err(err) => {
                        shared.stats.publish_failures.fetch_add(1, Relaxed);
                        tracing::debug!(error = %err, "publish failed; retrying");
                        retry_after = tokio::time::Instant::now() + backoff;
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                        break;
                    }
                }
            }
        }
        {
            let o = shared.lock();
            shared.stats.outbox_batches.store(o.len() as u64, Relaxed);
            shared.stats.outbox_bytes.store(o.bytes(), Relaxed);
            if draining.is_some() && o.is_empty() && acks.is_empty() {
                break;
            }
        }
        if let Some(d) = draining
            && tokio::time::Instant::now() >= d
        {
            break;
        }
        let wait = if stream_ok && connected {
            Duration::from_millis(250)
        } else {
            // Not connected or no stream yet: look again less and less often, up to 2 s.
            backoff = (backoff * 2).min(Duration::from_secs(2));
            backoff
        };
        tokio::select! {
            Some(r) = acks.join_next(), if !acks.is_empty() => {
                if let Ok((seq, events, ok)) = r {
                    inflight.remove(&seq);
                    if ok {
                        shared.lock().remove(seq);
                        report.batches += 1;
                        shared.stats.batches_published.fetch_add(1, Relaxed);
                        shared.stats.events_published.fetch_add(u64::from(events), Relaxed);
                        backoff = Duration::from_millis(100);
                    } else {
                        shared.stats.publish_failures.fetch_add(1, Relaxed);
                        if tokio::time::Instant::now() >= retry_after {
                            retry_after = tokio::time::Instant::now() + backoff;
                            backoff = (backoff * 2).min(Duration::from_secs(2));
                        }
                    }
                }
            }
            () = shared.wake.notified() => {}
            () = &mut done_wait, if draining.is_none() => {
                draining = Some(tokio::time::Instant::now() + drain_budget);
            }
            () = tokio::time::sleep(wait) => {}
        }
    }
    acks.abort_all();
    report.left = shared.lock().len() as u64;
    report
}
