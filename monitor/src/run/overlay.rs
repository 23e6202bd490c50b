//! The flags of `revenant run` applied over the config file: a flag given on the command line (or
//! through its environment variable) wins over the file; list flags (`--webhook`, `--watch`, ...)
//! add to the file's lists. `--alert-config FILE` replaces the `alert` section.

use std::net::SocketAddr;

use super::args::{Given, RunArgs, RunConfigError};
use crate::admin::AdminArgs;
use crate::config::RunConfig;
use crate::ingest::ebpf::EbpfArgs;

fn parse_addr(flag: &'static str, v: &str) -> Result<Option<SocketAddr>, RunConfigError> {
    if v.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    crate::addr::parse(v)
        .map(Some)
        .map_err(|message| RunConfigError::Addr { flag, message })
}

/// Applies every flag of `args` over `cfg`. Validation is the caller's.
pub fn apply(cfg: &mut RunConfig, args: &RunArgs) -> Result<(), RunConfigError> {
    if let Some(v) = &args.otlp_grpc {
        cfg.otlp.grpc = parse_addr("otlp-grpc", v)?;
    }
    if let Some(v) = &args.otlp_http {
        cfg.otlp.http = parse_addr("otlp-http", v)?;
    }
    if let Some(v) = args.max_message_bytes {
        cfg.otlp.max_message_bytes = v;
        cfg.otlp.max_decompressed_bytes = cfg.otlp.max_decompressed_bytes.max(v);
    }
    if let Some(v) = args.channel_capacity {
        cfg.channel_capacity = Some(v);
    }
    if let Some(v) = args.drain_timeout {
        cfg.drain_timeout = Some(v);
    }
    if args.events_jsonl.is_some() {
        cfg.events_jsonl = args.events_jsonl.clone();
    }
    if let Some(v) = args.clock_skew {
        cfg.engine.clock_skew = Some(v);
    }
    if let Some(v) = args.allowed_lateness {
        cfg.engine.allowed_lateness = Some(v);
    }
    if let Some(v) = args.memory_budget {
        cfg.engine.memory_budget = Some(v);
    }
    if let Some(v) = args.engine_shards {
        cfg.engine.shards = Some(v);
    }
    if args.rules.is_some() {
        cfg.engine.rules = args.rules.clone();
    }
    ebpf(cfg, &args.ebpf, &args.given);
    admin(cfg, &args.admin, &args.given);
    args.access.apply(&mut cfg.access)?;
    alert(cfg, args)
}

fn ebpf(cfg: &mut RunConfig, a: &EbpfArgs, given: &Given) {
    let d = crate::ingest::ebpf::EbpfOptions::default();
    let o = &mut cfg.ebpf;
    if given.has("ebpf", &a.ebpf, &d.mode) {
        o.mode = a.ebpf;
    }
    o.watch.extend(a.watch.iter().cloned());
    o.pid.extend(a.pid.iter().copied());
    if a.no_sglang_conventions {
        o.sglang_conventions = false;
    }
    given.set(
        "capture_head_bytes",
        &mut o.capture_head_bytes,
        &a.capture_head_bytes,
        &d.capture_head_bytes,
    );
    given.set(
        "capture_tail_bytes",
        &mut o.capture_tail_bytes,
        &a.capture_tail_bytes,
        &d.capture_tail_bytes,
    );
    given.set(
        "ring_bytes",
        &mut o.ring_bytes,
        &a.ring_bytes,
        &d.ring_bytes,
    );
}

fn admin(cfg: &mut RunConfig, a: &AdminArgs, given: &Given) {
    let d = AdminArgs::default();
    let c = &mut cfg.admin;
    if given.has("admin", &a.admin, &d.admin) {
        c.addr = Some(a.admin);
    }
    if a.no_admin {
        c.addr = None;
    }
    if a.metrics_addr.is_some() {
        c.metrics_addr = a.metrics_addr;
    }
    given.set(
        "recent_violations",
        &mut c.recent_violations,
        &a.recent_violations,
        &d.recent_violations,
    );
    given.set(
        "timeline_events",
        &mut c.timeline_events,
        &a.timeline_events,
        &d.timeline_events,
    );
    given.set(
        "source_live_window",
        &mut c.source_live_window,
        &a.source_live_window,
        &d.source_live_window,
    );
}

/// The alert section with the alert flags, and the node identity settled: `--node`/`--cluster`,
/// else the `node` section, else what the alert configuration names.
fn alert(cfg: &mut RunConfig, args: &RunArgs) -> Result<(), RunConfigError> {
    if let Some(file) = args.alert.load_file()? {
        cfg.alert = file;
    }
    // Links in alerts default to the admin server's bound address, known only after binding
    // (`--admin 127.0.0.1:0`): filled in by `run`.
    args.alert.apply(&mut cfg.alert, None);
    let node = &mut cfg.node;
    if args.alert.node.is_some() || node.name.is_none() {
        node.name = cfg.alert.node.clone();
    }
    if args.alert.cluster.is_some() || node.cluster.is_none() {
        node.cluster = Some(cfg.alert.cluster.clone());
    }
    cfg.alert.node = node.name.clone();
    if let Some(c) = &node.cluster {
        cfg.alert.cluster = c.clone();
    }
    Ok(())
}

impl RunConfig {
    /// The admin server's settings in the shape the server takes.
    pub fn admin_args(&self) -> AdminArgs {
        let d = AdminArgs::default();
        AdminArgs {
            admin: self.admin.addr.unwrap_or(d.admin),
            no_admin: self.admin.addr.is_none(),
            metrics_addr: self.admin.metrics_addr,
            recent_violations: self.admin.recent_violations,
            timeline_events: self.admin.timeline_events,
            source_live_window: self.admin.source_live_window,
        }
    }
}
