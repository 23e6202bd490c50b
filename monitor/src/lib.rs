//! revenant: a runtime invariant monitor for disaggregated (prefill/decode) LLM serving.
//!
//! Data flows one way: sources → normalize → correlate → check → sinks.

pub mod event;
pub mod pipeline;

pub use event::{BootstrapRoom, Ids, Kind, LifecycleEvent, Source, Stage, UnixNanos};
pub mod normalize;
pub mod ingest;
