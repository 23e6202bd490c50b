//! revenant's own telemetry, the bottom layer every component reports through: the metric
//! registry, internal events, the readiness latch, the memory budget's account, the
//! recent-violations ring and logging.
//! It imports only the shared vocabulary (`event`, `violation`).

pub mod build;
#[cfg(feature = "runtime")]
pub mod console;
pub mod events;
pub mod exposition;
#[cfg(feature = "runtime")]
pub mod logging;
pub mod memory;
pub mod metrics;
pub mod process;
pub mod ready;
pub mod recent;

pub use memory::{MemoryAccount, MemoryWatch, Structure};
pub use metrics::{DropPoint, DropReason, Metrics, Snapshot};
pub use ready::{ComponentKind, Readiness, ReadyHandle};
pub use recent::RecentViolations;
