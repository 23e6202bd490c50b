//! revenant: a runtime invariant monitor for disaggregated (prefill/decode) LLM serving.
//!
//! Data flows one way: sources ([`ingest`]) → [`normalize`] → the sans-IO [`engine`] (identity,
//! then check) → sinks ([`alert`]), wired together by [`pipeline`] and [`run`]. [`event`] and
//! [`violation`] are the vocabulary every layer shares; [`telemetry`] is the bottom layer every
//! component reports through; [`admin`] is the HTTP surface on top. [`config`] is `revenant run`'s
//! configuration file and flags, [`cmd`] the offline subcommands, [`exit`] the exit codes of all.

#[cfg(feature = "runtime")]
pub mod access;
pub mod addr;
#[cfg(feature = "runtime")]
pub mod admin;
#[cfg(feature = "runtime")]
pub mod alert;
#[cfg(feature = "runtime")]
pub mod bus;
/// Without the runtime, the bus is its wire format alone (what the fuzz targets decode).
#[cfg(not(feature = "runtime"))]
pub mod bus {
    pub mod wire;
}
#[cfg(feature = "runtime")]
pub mod cmd;
#[cfg(feature = "runtime")]
pub mod config;
pub mod duration;
pub mod engine;
pub mod event;
#[cfg(feature = "runtime")]
pub mod exit;
pub mod ingest;
#[cfg(feature = "runtime")]
pub mod node;
pub mod normalize;
#[cfg(feature = "runtime")]
pub mod pipeline;
#[cfg(feature = "runtime")]
pub mod report;
#[cfg(feature = "runtime")]
pub mod run;
pub mod telemetry;
pub mod violation;

pub use engine::check::{Checker, CheckerConfig, RuleSet};
pub use event::{BootstrapRoom, Ids, Kind, LifecycleEvent, Peer, Source, Stage, UnixNanos};
pub use violation::Violation;
