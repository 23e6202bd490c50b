//! Sources: everything that produces [`crate::event::EventBatch`]es.

pub mod ebpf;
pub mod otlp;
pub mod replay;
