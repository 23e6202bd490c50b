//! Sources: everything that produces [`crate::pipeline::EventBatch`]es.

pub mod ebpf;
pub mod otlp;
pub mod replay;
