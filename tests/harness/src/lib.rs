//! Real processes on loopback for the end-to-end tests, the benches and `cargo xtask demo`:
//! `revenant run`, `pd-sim cluster` and `pd-sim load`, each child in its own process group
//! (stopped as a group on drop, `PR_SET_PDEATHSIG` if we die first), readiness from the
//! processes themselves (revenant's ready file, pd-sim's READY line and `/health`), never
//! sleeps, every wait bounded. Blocking, no async runtime needed; [`eventually`], the tests'
//! bounded poll, works under any. Also what the runs make of revenant's notifications
//! ([`notifications`]).

mod binaries;
mod cluster;
mod eventually;
mod files;
mod http;
mod metrics;
mod nats;
pub mod notifications;
mod pki;
mod proc;
mod revenant;
pub mod sglang;
mod vllm_router;

pub use binaries::{
    Binaries, BuildProfile, SYSTEM_TOOLS, on_path, pd_sim_bin, router_from_env, system_bin,
    workspace_bin, workspace_root,
};
pub use cluster::{Cluster, FAULT_VERDICT_WINDOWS, fault_verdict_window, run_load, run_load_quiet};
pub use eventually::eventually;
pub use files::{JsonlTail, ScratchDir, read_jsonl, read_jsonl_so_far, tail};
pub use http::{
    DEFAULT_PORTS, HttpResponse, PORTS_ENV, free_port, http_get, http_json, http_post,
    http_post_json, wait_healthy,
};
pub use metrics::{Sample, metric_sum, parse_metrics};
pub use nats::{Nats, NatsNode};
pub use pki::Pki;
pub use proc::Proc;
pub use revenant::Revenant;
pub use vllm_router::VllmRouter;

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}
