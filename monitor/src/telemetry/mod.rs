//! revenant's own telemetry, the bottom layer every component reports through: the metric
//! registry, internal events and the readiness latch.

pub mod events;
pub mod metrics;
pub mod ready;

pub use metrics::{DropPoint, Metrics};
pub use ready::{ComponentKind, Readiness, ReadyHandle};
