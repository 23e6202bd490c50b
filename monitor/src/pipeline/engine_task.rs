//! The async loop around the sans-IO engine: batches in, taps, `observe`, violations out; a
//! `tick` once a second on wall time so deadline rules fire without traffic; on close, the drain.

use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::engine::check::Checker;

use super::{EventReceiver, EventTap, ViolationSender};

/// Counts of the engine task, reported at shutdown.
#[derive(Debug, Default, Clone, Copy)]
pub struct EngineTotals {
    pub batches: u64,
    pub events: u64,
    pub violations: u64,
}

/// Everything the loop owns.
pub struct EngineTask {
    pub engine: Checker,
    pub events: EventReceiver,
    pub violations: ViolationSender,
    pub taps: Vec<Box<dyn EventTap>>,
    /// How far past the last event time the final tick judges deadlines.
    pub lateness: Duration,
    /// Testing aid: no batch is taken while this file exists (saturates the pipeline on purpose).
    pub pause_file: Option<PathBuf>,
}

fn wall_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

impl EngineTask {
    /// Runs until `close` resolves and the channel is drained (or every sender is gone). After
    /// `close` new batches are refused (senders see "closed" and answer UNAVAILABLE) while what is
    /// queued is still checked. Dropping `self` at the end closes the dispatcher's input.
    pub async fn run(mut self, close: impl Future<Output = ()>) -> std::io::Result<EngineTotals> {
        let mut totals = EngineTotals::default();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut close = std::pin::pin!(close);
        let mut closed = false;
        loop {
            if let Some(p) = &self.pause_file
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
                    let now = wall_ns();
                    self.tick(now, now, &mut totals)?;
                    continue;
                }
            };
            totals.batches += 1;
            totals.events += batch.len() as u64;
            let arrival_ns = wall_ns();
            let span = tracing::info_span!("checker.batch", events = batch.len());
            let _entered = span.enter();
            for t in &mut self.taps {
                t.batch(&batch, arrival_ns)?;
            }
            for e in &batch {
                for v in self.engine.observe(e) {
                    totals.violations += 1;
                    self.violations.offer(v);
                }
            }
        }
        // Nothing more will arrive: move the watermark past the lateness window so that every
        // deadline the received events can still prove is judged.
        let now = wall_ns();
        let end = self
            .engine
            .stats()
            .max_event_ns
            .max(now)
            .saturating_add(self.lateness.as_nanos() as u64);
        self.tick(end, now, &mut totals)?;
        Ok(totals)
    }

    /// Judges deadlines up to `watermark`, then lets the taps publish and flush.
    fn tick(&mut self, watermark: u64, now: u64, totals: &mut EngineTotals) -> std::io::Result<()> {
        for v in self.engine.tick(watermark) {
            totals.violations += 1;
            self.violations.offer(v);
        }
        for t in &mut self.taps {
            t.tick(&self.engine, now)?;
        }
        Ok(())
    }
}
