//! revenant's own telemetry and HTTP surface: the metric registry and internal events, the
//! readiness latch, recent violations and the request timeline index, and the axum server that
//! exposes them.

pub mod config;
pub(crate) mod ebpf;
pub(crate) mod otlp;
pub mod self_traces;
pub mod server;
pub mod timeline;
pub mod violations;

pub use crate::telemetry::{ComponentKind, DropPoint, Metrics, Readiness, ReadyHandle};
pub use config::{AdminArgs, LogArgs, LogFormat};
pub use server::{AdminError, AdminServer, AdminState};
pub use timeline::{RecentEvents, RecentEventsLimits, Timeline, TimelineProvider};
pub use violations::RecentViolations;
