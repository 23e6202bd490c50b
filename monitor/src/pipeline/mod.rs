//! The narrow interface between sources and the checker: a bounded channel of event batches.
//!
//! Sources batch what they decode (one OTLP export, one ring-buffer drain) so the channel costs one
//! synchronisation per batch, not per event. The channel is bounded: a full pipeline makes OTLP
//! answer "unavailable" and makes the kernel side count drops; nothing is lost without a count.

use crate::event::LifecycleEvent;

/// Events decoded together from one unit of input.
pub type EventBatch = Vec<LifecycleEvent>;
