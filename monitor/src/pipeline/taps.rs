//! What the engine task does with each batch besides checking it: taps. Each tap sees every
//! batch before the engine does, and a tick once a second and at the end of the drain.
//!
//! - the per-request event history behind `/api/requests/{id}` is admin's tap
//!   (`admin::timeline::TimelineTap`): the HTTP surface sits above the pipeline.
//! - [`SourceActivity`]: a source that delivers counts as live in `/readyz`.
//! - [`Observed`]: the `EventsObserved` internal event (ingest lag, events per source).
//! - [`EngineMetrics`]: the engine's gauges and counters, published on each tick.
//! - [`ReplayWriter`]: every event in the replay format `revenant check` reads (`--events-jsonl`).

use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use crate::engine::check::metrics::CheckerSnapshot;
use crate::event::Source;
use crate::ingest::replay::ReplayRecord;
use crate::telemetry::events::EventsObserved;
use crate::telemetry::{Metrics, ReadyHandle};

use super::EventBatch;

/// A side effect of the engine task. An error stops the task (an output that cannot be written
/// is a runtime failure, not something to skip quietly).
pub trait EventTap: Send {
    /// One batch, before the engine observes it; `arrival_ns` is its wall-clock arrival.
    fn batch(&mut self, batch: &EventBatch, arrival_ns: u64) -> std::io::Result<()>;

    /// Once a second, after the engine's tick, and once at the end of the drain, with the
    /// engine's counters (the shards' summed).
    fn tick(&mut self, _engine: &CheckerSnapshot, _now_ns: u64) -> std::io::Result<()> {
        Ok(())
    }
}

/// Marks the sources whose events arrive as active for the readiness latch.
pub struct SourceActivity {
    pub otlp: Option<ReadyHandle>,
    pub ebpf: Option<ReadyHandle>,
}

impl EventTap for SourceActivity {
    fn batch(&mut self, batch: &EventBatch, _: u64) -> std::io::Result<()> {
        let (mut otlp, mut ebpf) = (false, false);
        for e in batch {
            match e.source {
                Source::Otlp => otlp = true,
                Source::Ebpf => ebpf = true,
                Source::Replay => {}
            }
        }
        if otlp && let Some(h) = &self.otlp {
            h.activity();
        }
        if ebpf && let Some(h) = &self.ebpf {
            h.activity();
        }
        Ok(())
    }
}

/// Emits `EventsObserved` for every batch.
pub struct Observed(pub Arc<Metrics>);

impl EventTap for Observed {
    fn batch(&mut self, batch: &EventBatch, arrival_ns: u64) -> std::io::Result<()> {
        EventsObserved {
            events: batch,
            arrival_ns,
        }
        .emit(&self.0);
        Ok(())
    }
}

/// Publishes the engine's metrics on each tick.
pub struct EngineMetrics(pub Arc<Metrics>);

impl EventTap for EngineMetrics {
    fn batch(&mut self, _: &EventBatch, _: u64) -> std::io::Result<()> {
        Ok(())
    }

    fn tick(&mut self, engine: &CheckerSnapshot, _: u64) -> std::io::Result<()> {
        self.0.publish(engine.clone());
        Ok(())
    }
}

/// Appends every event, as a replay record, to a file; flushed on each tick.
pub struct ReplayWriter {
    out: Box<dyn Write + Send>,
    line: Vec<u8>,
}

impl ReplayWriter {
    /// Opens `path` for appending (created if missing).
    pub fn open(path: &Path) -> std::io::Result<ReplayWriter> {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(ReplayWriter {
            out: Box::new(std::io::BufWriter::with_capacity(1 << 16, f)),
            line: Vec::with_capacity(512),
        })
    }

    /// [`ReplayWriter::open`], then writes `header` (a `#` line: see
    /// [`crate::ingest::replay::RunHeader`]) at once.
    pub fn open_with_header(path: &Path, header: &str) -> std::io::Result<ReplayWriter> {
        let mut w = ReplayWriter::open(path)?;
        w.out.write_all(header.as_bytes())?;
        w.out.flush()?;
        Ok(w)
    }
}

impl EventTap for ReplayWriter {
    fn batch(&mut self, batch: &EventBatch, _: u64) -> std::io::Result<()> {
        for e in batch {
            self.line.clear();
            serde_json::to_writer(&mut self.line, &ReplayRecord::from_event(e))?;
            self.line.push(b'\n');
            self.out.write_all(&self.line)?;
        }
        Ok(())
    }

    fn tick(&mut self, _: &CheckerSnapshot, _: u64) -> std::io::Result<()> {
        self.out.flush()
    }
}
