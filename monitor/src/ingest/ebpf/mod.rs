//! eBPF ground truth: what really crosses the wire between router, prefill, transfer and decode.
//!
//! `loader` talks to the kernel; everything else here is pure and testable without root:
//! `record` decodes ring-buffer records, `procs` finds the serving processes and their roles,
//! `conn` reassembles per-connection byte streams, `http`/`zmtp` parse them, `json_ids` pulls the
//! few ids we keep out of bodies, and `normalize` turns parsed messages into `LifecycleEvent`s.

pub mod config;
pub mod http;
pub mod json_ids;
pub mod loader;
pub mod metrics;
pub mod procs;
pub mod record;
pub mod source;
pub mod track;
pub mod zmtp;

pub use config::{EbpfArgs, EbpfMode, EbpfOptions, EbpfStart};
pub use loader::{CaptureConfig, LoadError, Probes};
pub use procs::{Discovery, PidRule, Role, WatchRule};
pub use source::{EbpfConfig, EbpfSource, EbpfStats};
