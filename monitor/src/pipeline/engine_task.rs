//! The async loop around the sans-IO engine: batches in, taps, `observe`, violations out; a
//! `tick` once a second on wall time so deadline rules fire without traffic; on close, the drain.
//! The engine is one checker on this task, or shards on threads of their own ([`super::shards`]).

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::event::now_unix_ns;

use crate::engine::check::Checker;
use crate::engine::check::metrics::CheckerSnapshot;

use super::shards::{Engine, ShardPool};
use super::{EventReceiver, EventTap, ViolationSender};

/// Counts of the engine task, reported at shutdown.
#[derive(Debug, Default, Clone, Copy)]
pub struct EngineTotals {
    pub batches: u64,
    pub events: u64,
    pub violations: u64,
}

/// What drives the engine's watermark besides the events themselves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum WatermarkClock {
    /// Wall time: deadlines are judged once the clock passes them, with or without traffic
    /// (live sources).
    #[default]
    Wall,
    /// Event time only: the newest event's time (recorded events replayed through the
    /// cluster judge as `revenant check` does).
    Event,
}

/// Everything the loop owns.
pub struct EngineTask {
    pub engine: Engine,
    pub events: EventReceiver,
    pub violations: ViolationSender,
    pub taps: Vec<Box<dyn EventTap>>,
    /// How far past the last event time the final tick judges deadlines.
    pub lateness: Duration,
    /// Testing aid: no batch is taken while this file exists (saturates the pipeline on purpose).
    pub pause_file: Option<PathBuf>,
    pub clock: WatermarkClock,
    /// What bounds the watermark upstream (cluster mode: how far the agents' streams came).
    pub upstream: Option<Arc<dyn Upstream>>,
}

/// How far the input provably came, when the engine's own events and clock cannot tell (cluster
/// mode: events cross a log, and an agent's may still be on their way).
pub trait Upstream: Send + Sync {
    /// Where the watermark may be moved at wall time `now_ns` (on the task's clock: agents' wall
    /// clocks, or event times), before the allowed lateness is taken off; `None`: hold.
    ///
    /// Everything this bound covers must already be in the event channel: the task takes what
    /// is queued before it asks.
    fn bound(&self, now_ns: u64) -> Option<u64>;
    /// The newest event time known upstream.
    fn newest(&self) -> u64;
}

/// How often a driver with an upstream bound (cluster mode) moves the watermark.
const UPSTREAM_TICK: Duration = Duration::from_millis(250);

impl EngineTask {
    /// Runs until `close` resolves and the channel is drained (or every sender is gone). After
    /// `close` new batches are refused (senders see "closed" and answer UNAVAILABLE) while what is
    /// queued is still checked. Dropping `self` at the end closes the dispatcher's input.
    pub async fn run(self, close: impl Future<Output = ()>) -> std::io::Result<EngineTotals> {
        let EngineTask {
            mut engine,
            events,
            violations,
            taps,
            lateness,
            pause_file,
            clock,
            upstream,
        } = self;
        // Input from several agent streams (cluster mode): an event's time says nothing of
        // what other streams still have on the way, so only the upstream bound, at each tick,
        // moves the watermark; ticks come more often for it.
        if upstream.is_some() {
            engine.watermark_from_ticks_only();
        }
        let judge = match engine {
            Engine::One(c) => Judge::One(c),
            Engine::Shards(cs) => Judge::Shards(Box::new(ShardPool::start(
                cs,
                violations.clone(),
                (lateness / 4).min(Duration::from_secs(2)),
            )?)),
        };
        let mut task = Running {
            judge,
            events,
            violations,
            taps,
            totals: EngineTotals::default(),
        };
        task.serve(close, lateness, pause_file, clock, upstream)
            .await?;
        let mut totals = task.totals;
        if let Judge::Shards(pool) = &task.judge {
            totals.violations += pool.delivered();
        }
        Ok(totals)
    }
}

/// The checker, or the shards.
enum Judge {
    One(Box<Checker>),
    Shards(Box<ShardPool>),
}

/// The task once started.
struct Running {
    judge: Judge,
    events: EventReceiver,
    violations: ViolationSender,
    taps: Vec<Box<dyn EventTap>>,
    totals: EngineTotals,
}

impl Running {
    async fn serve(
        &mut self,
        close: impl Future<Output = ()>,
        lateness: Duration,
        pause_file: Option<PathBuf>,
        clock: WatermarkClock,
        upstream: Option<Arc<dyn Upstream>>,
    ) -> std::io::Result<()> {
        let every = if upstream.is_some() {
            UPSTREAM_TICK
        } else {
            Duration::from_secs(1)
        };
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut close = std::pin::pin!(close);
        let mut closed = false;
        loop {
            if let Some(p) = &pause_file
                && p.exists()
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            let batch = tokio::select! {
                () = &mut close, if !closed => {
                    closed = true;
                    self.events.close();
                    continue;
                }
                b = self.events.recv() => match b {
                    Some(b) => b,
                    None => break,
                },
                _ = tick.tick() => {
                    let now = now_unix_ns();
                    let watermark = match (&upstream, clock) {
                        (Some(u), _) => {
                            // What the bound covers was in the queue when it was read (a batch
                            // is queued before its progress counts): observe the queue after
                            // reading it, so the bound never runs ahead of what the engine saw.
                            let bound = u.bound(now);
                            while let Ok(b) = self.events.try_recv() {
                                self.observe(b).await?;
                            }
                            bound
                        }
                        (None, WatermarkClock::Wall) => Some(now),
                        (None, WatermarkClock::Event) => Some(self.newest_event_ns()),
                    };
                    self.tick(watermark, now, false).await?;
                    continue;
                }
            };
            self.observe(batch).await?;
        }
        // Nothing more will arrive. `run` (and a checker replaying recorded events): move the
        // watermark past the lateness window so that every deadline the received events can
        // still prove is judged. A live checker judges only as far as its input provably came:
        // the rest is its successor's, which reads the log again from before that point.
        let now = now_unix_ns();
        let lateness = lateness.as_nanos() as u64;
        let max_event = self.newest_event_ns();
        let end = match (&upstream, clock) {
            (Some(u), WatermarkClock::Wall) => u.bound(now),
            (Some(u), WatermarkClock::Event) => {
                Some(max_event.max(u.newest()).saturating_add(lateness))
            }
            (None, WatermarkClock::Wall) => Some(max_event.max(now).saturating_add(lateness)),
            (None, WatermarkClock::Event) => Some(max_event.saturating_add(lateness)),
        };
        self.tick(end, now, true).await
    }

    /// The newest event time the engine was given.
    fn newest_event_ns(&self) -> u64 {
        match &self.judge {
            Judge::One(c) => c.stats().max_event_ns,
            Judge::Shards(pool) => pool.newest_ns(),
        }
    }

    async fn observe(&mut self, batch: crate::event::EventBatch) -> std::io::Result<()> {
        let totals = &mut self.totals;
        totals.batches += 1;
        totals.events += batch.len() as u64;
        let arrival_ns = now_unix_ns();
        let span = tracing::info_span!("checker.batch", events = batch.len());
        for t in &mut self.taps {
            span.in_scope(|| t.batch(&batch, arrival_ns))?;
        }
        match &mut self.judge {
            Judge::One(engine) => {
                let _entered = span.enter();
                for e in &batch {
                    for v in engine.observe(e) {
                        totals.violations += 1;
                        self.violations.offer(v);
                    }
                }
            }
            Judge::Shards(pool) => pool.observe(batch).await?,
        }
        Ok(())
    }

    /// Judges deadlines up to `watermark` (`None`: holds it), then lets the taps publish and
    /// flush; `last`: nothing more will come.
    async fn tick(&mut self, watermark: Option<u64>, now: u64, last: bool) -> std::io::Result<()> {
        let snapshot = match &mut self.judge {
            Judge::One(engine) => {
                for v in watermark.map(|w| engine.tick(w)).unwrap_or_default() {
                    self.totals.violations += 1;
                    self.violations.offer(v);
                }
                CheckerSnapshot::of(engine, now)
            }
            Judge::Shards(pool) => pool.tick(watermark, now, last).await?,
        };
        for t in &mut self.taps {
            t.tick(&snapshot, now)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::engine::check::{CheckerConfig, RuleSet};
    use crate::event::{Kind, LifecycleEvent, Source, Stage};
    use crate::pipeline::{EventBatch, event_channel};
    use crate::telemetry::Metrics;

    /// Counts what a tap sees.
    #[derive(Clone, Default)]
    struct Seen(Arc<Mutex<(u64, u64)>>);

    impl EventTap for Seen {
        fn batch(&mut self, batch: &EventBatch, _: u64) -> std::io::Result<()> {
            self.0.lock().unwrap().0 += batch.len() as u64;
            Ok(())
        }
        fn tick(&mut self, _: &CheckerSnapshot, _: u64) -> std::io::Result<()> {
            self.0.lock().unwrap().1 += 1;
            Ok(())
        }
    }

    #[tokio::test]
    async fn queued_batches_pass_the_taps_and_are_drained_after_close() {
        let (tx, rx) = event_channel(4);
        let (vtx, _vrx) = tokio::sync::mpsc::channel(16);
        let seen = Seen::default();
        let task = EngineTask {
            engine: Engine::One(Box::new(Checker::new(
                RuleSet::embedded_defaults(),
                CheckerConfig::default(),
            ))),
            events: rx,
            violations: ViolationSender::new(vtx, Arc::new(Metrics::new())),
            taps: vec![Box::new(seen.clone())],
            lateness: Duration::from_millis(10),
            pause_file: None,
            clock: WatermarkClock::Wall,
            upstream: None,
        };
        let e = |kind| {
            LifecycleEvent::new(1_000, Stage::Prefill, kind, Source::Replay).with_request_id("r1")
        };
        tx.send(vec![e(Kind::Received), e(Kind::Completed)])
            .await
            .unwrap();
        tx.send(vec![e(Kind::Work)]).await.unwrap();
        // Closed at once: what is already queued is still checked, then the final tick runs.
        let totals = task.run(async {}).await.unwrap();
        assert_eq!((totals.batches, totals.events), (2, 3));
        let (events, ticks) = *seen.0.lock().unwrap();
        assert_eq!(events, 3);
        assert!(ticks >= 1, "the drain ends with a tick");
        assert!(tx.send(vec![]).await.is_err(), "closed to new batches");
    }

    /// An upstream whose streams have come only as far as `bound`.
    struct Held(Mutex<Option<u64>>);

    impl Upstream for Held {
        fn bound(&self, _now_ns: u64) -> Option<u64> {
            *self.0.lock().unwrap()
        }
        fn newest(&self) -> u64 {
            0
        }
    }

    /// One agent's backlog may come before another's: an event far later than a deadline does
    /// not judge it while upstream's bound has not passed it (the other agent's events for it
    /// may be on their way); once the bound passes, it is judged.
    #[tokio::test]
    async fn with_an_upstream_only_its_bound_moves_the_watermark() {
        const S: u64 = 1_000_000_000;
        let (tx, rx) = event_channel(4);
        let (vtx, mut vrx) = tokio::sync::mpsc::channel(16);
        let upstream = Arc::new(Held(Mutex::new(Some(S))));
        let task = EngineTask {
            engine: Engine::One(Box::new(Checker::new(
                RuleSet::embedded_defaults(),
                CheckerConfig::default(),
            ))),
            events: rx,
            violations: ViolationSender::new(vtx, Arc::new(Metrics::new())),
            taps: vec![],
            lateness: Duration::from_secs(2),
            pause_file: None,
            clock: WatermarkClock::Wall,
            upstream: Some(upstream.clone()),
        };
        let (close_tx, close_rx) = tokio::sync::oneshot::channel::<()>();
        let handle = tokio::spawn(task.run(async {
            let _ = close_rx.await;
        }));
        // A transfer for room 7 that no router dispatched (yet), then, from another agent's
        // backlog, an event 100 s later.
        tx.send(vec![
            LifecycleEvent::new(10 * S, Stage::Transfer, Kind::Received, Source::Ebpf).with_room(7),
            LifecycleEvent::new(110 * S, Stage::Router, Kind::Dispatched, Source::Ebpf)
                .with_room(8),
        ])
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert!(
            vrx.try_recv().is_err(),
            "judged before upstream's bound passed the deadline"
        );
        *upstream.0.lock().unwrap() = Some(60 * S);
        let v = tokio::time::timeout(Duration::from_secs(5), vrx.recv())
            .await
            .expect("judged once the bound passed")
            .unwrap();
        assert_eq!(v.rule, "unknown-room");
        drop(close_tx);
        drop(tx);
        handle.await.unwrap().unwrap();
    }
}
