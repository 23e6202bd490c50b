//! revenant: a runtime invariant monitor for disaggregated (prefill/decode) LLM serving.
//!
//! Data flows one way: sources → normalize → correlate → check → sinks. This crate holds the
//! event model ([`event`]), identity correlation ([`correlate`]), the sans-IO streaming checker
//! ([`checker`]), its verdicts ([`violation`]) and the replay source ([`replay`]).

pub mod admin;
pub mod alert;
pub mod checker;
pub mod correlate;
pub mod event;
pub mod pipeline;
pub mod replay;
pub mod violation;
pub mod workload;

pub use checker::{Checker, CheckerConfig, RuleSet};
pub use event::{BootstrapRoom, Ids, Kind, LifecycleEvent, Source, Stage, UnixNanos};
pub use violation::Violation;

pub mod ingest;
pub mod normalize;
pub mod run;
