//! revenant: a runtime invariant monitor for disaggregated (prefill/decode) LLM serving.
//!
//! Data flows one way: sources ([`ingest`]) → [`normalize`] → the sans-IO [`engine`] (identity,
//! then check) → sinks ([`alert`]), wired together by [`pipeline`] and [`run`]. [`event`] and
//! [`violation`] are the vocabulary every layer shares; [`telemetry`] is the bottom layer every
//! component reports through; [`admin`] is the HTTP surface on top. [`config`] is `revenant run`'s
//! configuration file and flags, [`cmd`] the offline subcommands, [`exit`] the exit codes of all.

pub mod access;
pub mod addr;
pub mod admin;
pub mod alert;
pub mod bus;
pub mod cmd;
pub mod config;
pub mod duration;
pub mod engine;
pub mod event;
pub mod exit;
pub mod ingest;
pub mod node;
pub mod normalize;
pub mod pipeline;
pub mod report;
pub mod run;
pub mod telemetry;
pub mod violation;

pub use engine::check::{Checker, CheckerConfig, RuleSet};
pub use event::{BootstrapRoom, Ids, Kind, LifecycleEvent, Peer, Source, Stage, UnixNanos};
pub use violation::Violation;
