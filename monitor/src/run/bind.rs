//! What a long-running command takes before it serves, in order: the files it owns ([`claim`]:
//! the spool, locked, the sinks' files, `--events-jsonl`, the ready file's directory), then the
//! ports and probes ([`bind`]: the admin server, the OTLP listeners, the eBPF source as `--ebpf`
//! says). A failure of either is a configuration problem (exit 2), found before anything serves.

use std::net::SocketAddr;
use std::path::PathBuf;

use tokio::net::TcpListener;

use super::Given;
use super::kit::{RunError, Shared};
use super::prepare;
use super::prepare::Role;
use super::shutdown::{Phase, Shutdown};
use crate::access::{Alpn, Incoming, Server};
use crate::admin::{AdminArgs, AdminServer};
use crate::alert::{AlertConfig, OpenedAlerts};
use crate::config::RunConfig;
use crate::ingest::ebpf::{EbpfStart, HoldWindows};
use crate::pipeline::taps::ReplayWriter;

/// The files `run` owns, opened before any port is bound: the spool (locked) and the sinks,
/// the events recording, and the ready file's place checked.
pub(super) struct Claimed {
    pub(super) alerts: OpenedAlerts,
    pub(super) events_jsonl: Option<ReplayWriter>,
}

/// Opens what `run` writes to, so that a spool held by another instance, a `--spool-dir` that
/// is a file, an `--events-jsonl` or `--ready-file` in a missing directory fail (exit 2) before
/// anything listens.
pub(super) fn claim(
    cfg: &RunConfig,
    alert: &AlertConfig,
    ready_file: Option<&PathBuf>,
    events_header: &str,
) -> Result<Claimed, RunError> {
    // The spool first: its lock says whether another instance owns this node's files.
    let alerts = OpenedAlerts::open(alert).map_err(RunError::Alert)?;
    let events_jsonl = match &cfg.events_jsonl {
        Some(path) => Some(ReplayWriter::open_with_header(path, events_header).map_err(
            |source| RunError::Open {
                path: path.clone(),
                source,
            },
        )?),
        None => None,
    };
    if let Some(path) = ready_file {
        // The file is written (then renamed into place) once ready: its directory must take it.
        let tmp = path.with_extension("tmp");
        std::fs::File::create(&tmp)
            .and_then(|_| std::fs::remove_file(&tmp))
            .map_err(|source| RunError::ReadyFile {
                path: path.clone(),
                source,
            })?;
    }
    Ok(Claimed {
        alerts,
        events_jsonl,
    })
}

/// The listeners, bound, and the eBPF source, loaded.
pub(super) struct Bound {
    pub(super) admin: Option<AdminServer>,
    pub(super) grpc: Option<(Incoming, SocketAddr)>,
    pub(super) http: Option<(Incoming, SocketAddr)>,
    pub(super) ebpf: EbpfStart,
    /// Why the eBPF source is not running, when it is off (or not in this build).
    pub(super) ebpf_why: Option<String>,
    /// Why OTLP is off, naming the flags or config keys that turned it off.
    pub(super) otlp_why: String,
}

/// Binds every port and loads the probes; a failure here is a configuration problem (exit 2).
/// From here on the TLS and token files are re-read when they change, until the admin stops.
pub(super) async fn bind(
    cfg: &RunConfig,
    given: &Given,
    role: Role,
    admin: &AdminArgs,
    shared: &Shared,
    shutdown: &Shutdown,
    hold: HoldWindows,
) -> Result<Bound, RunError> {
    let access = &shared.access;
    let admin = match admin.no_admin {
        true => None,
        false => Some(
            AdminServer::bind(admin.admin, admin.metrics_addr, access)
                .await
                .map_err(|e| match e {
                    crate::admin::AdminError::Bind { addr, source } => RunError::Bind {
                        what: "admin",
                        addr,
                        source,
                    },
                    crate::admin::AdminError::BindMetrics { addr, source } => RunError::Bind {
                        what: "metrics",
                        addr,
                        source,
                    },
                    other => RunError::Receiver(other.to_string()),
                })?,
        ),
    };
    let listen = |what: &'static str, addr: Option<SocketAddr>, alpn, server| async move {
        let Some(addr) = addr else { return Ok(None) };
        let bind_err = |source| RunError::Bind { what, addr, source };
        let l = TcpListener::bind(addr).await.map_err(bind_err)?;
        let local = l.local_addr().map_err(bind_err)?;
        let incoming = access.incoming(l, alpn, server).map_err(bind_err)?;
        Ok::<_, RunError>(Some((incoming, local)))
    };
    let grpc = listen("otlp-grpc", cfg.otlp.grpc, Alpn::H2, Server::OtlpGrpc).await?;
    let http = listen("otlp-http", cfg.otlp.http, Alpn::Http1, Server::OtlpHttp).await?;
    tokio::spawn(access.clone().watch(shutdown.at(Phase::StopAdmin)));
    let (ebpf, ebpf_why) = start_ebpf(cfg, given, role != Role::Checker, hold)?;
    let origin = |id: &str, flag: &str, key: &str| {
        if given.contains(id) {
            format!("{flag} off")
        } else {
            format!("{key}: null in --config")
        }
    };
    let otlp_why = format!(
        "off ({} {})",
        origin("otlp_grpc", "--otlp-grpc", "otlp.grpc"),
        origin("otlp_http", "--otlp-http", "otlp.http")
    );
    Ok(Bound {
        admin,
        grpc,
        http,
        ebpf,
        ebpf_why,
        otlp_why,
    })
}

/// How the eBPF source ended up, for the log, /readyz and the ready file.
pub(super) fn ebpf_state(start: &EbpfStart, not_built: bool) -> &'static str {
    match start {
        EbpfStart::Live(_) => "live",
        EbpfStart::Off if not_built => "unavailable",
        EbpfStart::Off => "off",
        EbpfStart::Unavailable(_) => "unavailable",
    }
}

/// Why a build without the `ebpf` feature has no eBPF source (the log and /readyz).
pub(super) const NO_EBPF_IN_BUILD: &str =
    "this revenant was built without the eBPF source (the `ebpf` cargo feature)";

/// Starts the eBPF source as `--ebpf` (or the config file's `ebpf.mode`) says, unless `wanted`
/// is false (the checker has no sources). Returns it and, when it is off, why, naming the flag
/// or the config key that turned it off.
pub(super) fn start_ebpf(
    cfg: &RunConfig,
    given: &Given,
    wanted: bool,
    hold: HoldWindows,
) -> Result<(EbpfStart, Option<String>), RunError> {
    use crate::ingest::ebpf::EbpfMode;
    if !wanted {
        return Ok((EbpfStart::Off, None));
    }
    if cfg.ebpf.mode == EbpfMode::Off {
        let why = format!("off ({})", prepare::ebpf_mode_origin(given, "off"));
        tracing::info!("eBPF source: {why}");
        return Ok((EbpfStart::Off, Some(why)));
    }
    if !crate::telemetry::build::has_ebpf() {
        // `--ebpf on` was refused by `prepare`: this is `auto`.
        let why = format!("unavailable: {NO_EBPF_IN_BUILD}");
        tracing::warn!("eBPF source: NOT live (--ebpf auto): {NO_EBPF_IN_BUILD}");
        return Ok((EbpfStart::Off, Some(why)));
    }
    let start = cfg
        .ebpf
        .start(Some(cfg.node_name()), hold)
        .map_err(RunError::Ebpf)?;
    Ok((start, None))
}
