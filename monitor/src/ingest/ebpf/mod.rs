//! eBPF ground truth: what really crosses the wire between router, prefill, transfer and decode.
//!
//! `loader` talks to the kernel and `source` runs it (ring-buffer drain, rescans, batches into
//! the pipeline), `sock_diag` asks the kernel for listening sockets; everything else is pure and testable without root: `record` decodes
//! ring-buffer records, `procs` finds the serving processes and their roles, `track`
//! reassembles per-connection byte streams and maps what crossed the wire to `LifecycleEvent`s,
//! `http`/`zmtp` parse the streams, `json_ids` pulls the few ids kept out of bodies. `config`
//! holds the flags and the `ebpf` config section, `metrics` the source's counters and its drop
//! publisher.

#[cfg(feature = "runtime")]
pub mod config;
pub mod http;
pub mod json_ids;
#[cfg(feature = "runtime")]
pub mod loader;
#[cfg(feature = "runtime")]
pub mod metrics;
pub mod msgpack;
pub mod procs;
pub mod record;
#[cfg(feature = "runtime")]
pub mod sock_diag;
#[cfg(feature = "runtime")]
pub mod source;
pub mod track;
pub mod zmtp;

#[cfg(feature = "runtime")]
pub use config::{EbpfArgs, EbpfMode, EbpfOptions, EbpfStart};
#[cfg(feature = "runtime")]
pub use loader::{CaptureConfig, LoadError, Probes};
pub use procs::{Discovery, PidRule, Role, WatchRule};
#[cfg(feature = "runtime")]
pub use source::{EbpfConfig, EbpfSource, EbpfStats, HoldWindows};
