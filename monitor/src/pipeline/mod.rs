//! The narrow interfaces between the stages: a bounded channel of event batches from the sources
//! to the engine task, and a bounded channel of violations from the engine task to the alert
//! dispatcher.
//!
//! Sources batch what they decode (one OTLP export, one ring-buffer drain) so the channel costs one
//! synchronisation per batch, not per event. Both channels are bounded: a full event channel makes
//! OTLP answer "unavailable" and makes the kernel side count drops; a full violation channel is a
//! counted drop ([`ViolationSender::offer`]); nothing is lost without a count.

pub mod engine_task;
pub mod shards;
pub mod taps;

use std::sync::Arc;

use tokio::sync::mpsc;

use crate::telemetry::Metrics;
use crate::violation::Violation;

pub use engine_task::{EngineTask, EngineTotals, Upstream, WatermarkClock};
pub use shards::Engine;
pub use taps::EventTap;

pub use crate::event::EventBatch;

/// What the sources hold: each source answers a full channel its own way (OTLP: "unavailable",
/// eBPF: a counted drop), so they use the sender directly.
pub type EventSender = mpsc::Sender<EventBatch>;
pub type EventReceiver = mpsc::Receiver<EventBatch>;

/// The bounded channel from the sources to the engine task, `capacity` batches deep.
pub fn event_channel(capacity: usize) -> (EventSender, EventReceiver) {
    mpsc::channel(capacity)
}

/// The engine task's end of the violation channel: never blocks the engine.
#[derive(Clone)]
pub struct ViolationSender {
    tx: mpsc::Sender<Violation>,
    metrics: Arc<Metrics>,
}

impl ViolationSender {
    pub fn new(tx: mpsc::Sender<Violation>, metrics: Arc<Metrics>) -> ViolationSender {
        ViolationSender { tx, metrics }
    }

    /// Hands a violation to the dispatcher; a full or closed channel is a counted drop
    /// (`revenant_dropped_items_total{point="violation_channel"}`).
    pub fn offer(&self, v: Violation) -> bool {
        crate::alert::offer(&self.tx, v, &self.metrics)
    }
}
