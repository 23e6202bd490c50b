//! Sources: everything that produces [`crate::event::EventBatch`]es.

pub mod ebpf;
#[cfg(feature = "runtime")]
pub mod otlp;
/// Without the runtime, OTLP is its JSON decoding alone (the receivers need the async stack).
#[cfg(not(feature = "runtime"))]
pub mod otlp {
    pub mod json;
}
pub mod replay;
