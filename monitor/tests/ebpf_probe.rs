//! Real probe tests: load the kernel programs and watch real processes on loopback.
//!
//! They need root (or CAP_BPF + CAP_PERFMON) and what `cargo xtask setup` installs. They fail,
//! loudly, when the probes cannot load: a node where the probes silently do nothing is the bug
//! this suite is here to catch. Run: `cargo test -p revenant --test ebpf_probe`.

use revenant::ingest::ebpf::loader::{CaptureConfig, Probes};

#[test]
fn probes_load_and_attach() {
    let mut probes = Probes::load(&CaptureConfig::default())
        .unwrap_or_else(|e| panic!("eBPF probes must load on this machine (run as root after `cargo xtask setup`): {e}"));
    let c = probes.counters().expect("counters readable");
    assert_eq!(c.get(monitor_common::counter::RINGBUF_DROPS), 0);
    probes.watch(std::process::id()).expect("watch self");
    assert!(probes.watched_ids().contains(&std::process::id()));
}
