//! `revenant run`: the all-in-one pipeline on one node.
//!
//! It reads in a fixed order (linkerd2-proxy style), one call per step:
//! [`prepare`] (load and validate every config; no port bound, no probe loaded) → [`claim`] (the
//! files it owns: the spool, locked, the sinks' files, `--events-jsonl`, the ready file's
//! directory; still no port) → [`bind`] (the admin server and the OTLP receivers; then the eBPF
//! probes, per `--ebpf`) → [`start_outputs`] (the admin server and the alert dispatcher, resuming
//! its spool) → [`start_sources`] → [`start_engine`] → announce
//! readiness → [`wait`] for Ctrl-C / SIGTERM or a failed receiver → [`drain`] (stop the sources,
//! drain the channel through the engine, drain the dispatcher, each within the drain budget).
//! Exit codes: 0 clean, 1 runtime failure, 2 usage/config error.
//!
//! ```text
//! OTLP gRPC ─┐
//! OTLP HTTP ─┼─► normalize ─► bounded mpsc<EventBatch> ─► engine task ─► alert dispatcher
//! eBPF ──────┘                                              │   (observe/tick)   (dedup, spool,
//!                                                           │                     webhook, Alertmanager,
//!                                                           │                     JSONL)
//!                                                           └─► taps: /api/requests timeline, /metrics,
//!                                                               /readyz activity, events JSONL (replay format)
//! ```

pub mod agent;
pub mod checker;
pub mod coverage;
pub mod flags;
pub mod memory;
pub mod overlay;
mod prepare;
pub mod shutdown;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};

use crate::access::{Access, Alpn, Incoming, Server};
use crate::admin::timeline::TimelineTap;
use crate::admin::{AdminArgs, AdminServer, AdminState, RecentEvents, RecentEventsLimits};
use crate::alert::{AlertConfig, AlertPipeline, DispatchReport, OpenedAlerts};
use crate::config::RunConfig;
use crate::event::Source;
use crate::ingest::ebpf::{EbpfStart, HoldWindows};
use crate::ingest::otlp::{self, Ingest, OtlpStats};
use crate::ingest::replay::{RunHeader, rules_fingerprint};
use crate::normalize::Normalizer;
use crate::pipeline::taps::{EngineMetrics, Observed, ReplayWriter, SourceActivity};
use crate::pipeline::{
    EngineTask, EngineTotals, EventSender, EventTap, ViolationSender, event_channel,
};
use crate::telemetry::console::LogFormat;
use crate::telemetry::logging::LogArgs;
use crate::telemetry::{
    ComponentKind, MemoryAccount, MemoryWatch, Metrics, Readiness, ReadyHandle, RecentViolations,
    Structure, console,
};

pub use prepare::{Prepared, Role, RunArgs, RunConfigError, load_config, prepare, prepare_for};
pub use shutdown::{Drain, Phase, Shutdown};

pub fn run(args: RunArgs) -> ExitCode {
    let log = args.log.clone();
    logged(&log, || run_logged(args))
}

/// Runs `body` with logging (and revenant's own traces, if asked for) set up from `log`, and
/// flushes those traces once it returns: the frame of `run`, `agent` and `checker`.
fn logged(log: &LogArgs, body: impl FnOnce() -> ExitCode) -> ExitCode {
    let self_traces = match log.init() {
        Ok(g) => g,
        Err(e) => {
            console::error(&e);
            return ExitCode::from(2);
        }
    };
    let code = body();
    if let Some(t) = self_traces {
        t.shutdown();
    }
    code
}

/// The runtime every long-running command runs on (two workers: the machine's sources, the
/// engine and the outputs share them), or the exit code after saying why there is none.
fn runtime() -> Result<tokio::runtime::Runtime, ExitCode> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| {
            console::error(&format!("cannot start the runtime: {e}"));
            ExitCode::from(1)
        })
}

/// Serves the admin API on `server` until the shutdown reaches it, registered (and ready) in
/// the readiness report.
fn serve_admin(
    server: AdminServer,
    shared: &Shared,
    shutdown: &Shutdown,
) -> JoinHandle<Result<(), crate::admin::AdminError>> {
    let state = AdminState {
        metrics: shared.metrics.clone(),
        readiness: shared.readiness.clone(),
        violations: shared.recent.clone(),
        timeline: shared.timeline.clone(),
        access: shared.access.clone(),
    };
    let handle = shared.readiness.register("admin", ComponentKind::Server);
    let task = tokio::spawn(server.serve(state, shutdown.at(Phase::StopAdmin)));
    handle.ready();
    task
}

/// The windows the enabled rules give a held leg, for the eBPF source to compare with each SGLang
/// worker's own timeouts.
fn hold_windows<'a>(rules: impl Iterator<Item = &'a crate::engine::rules::Rule>) -> HoldWindows {
    let mut hold = HoldWindows::default();
    for rule in rules.filter(|r| r.enabled) {
        let crate::engine::rules::Shape::MustFollow(m) = &rule.shape else {
            continue;
        };
        match rule.name.as_str() {
            "held-decode-slot" => hold.decode_waits_for_kv = Some(m.within.0),
            "stranded-kv" => hold.prefill_waits_for_decode = Some(m.within.0),
            _ => {}
        }
    }
    hold
}

/// Declares every rule's series on `/metrics` (so a rule that never fired still reads 0) and
/// returns the header the outputs' first line carries.
fn announce_rules(
    shared: &Shared,
    checker: &crate::engine::check::Checker,
    cfg: &RunConfig,
) -> RunHeader {
    for rule in checker.rules() {
        shared
            .metrics
            .declare_rule(&rule.name, rule.severity.as_str());
    }
    shared
        .recent
        .set_rules(checker.rules().map(|r| r.name.clone()).collect());
    RunHeader {
        version: env!("CARGO_PKG_VERSION").into(),
        allowed_lateness_ns: cfg.engine.allowed_lateness().as_nanos() as u64,
        clock_skew_ns: cfg.engine.clock_skew().as_nanos() as u64,
        rules: cfg.engine.rules.as_ref().map(|p| p.display().to_string()),
        rules_fingerprint: rules_fingerprint(checker.rules()),
    }
}

fn run_logged(args: RunArgs) -> ExitCode {
    let prepared = match prepare(&args) {
        Ok(p) => p,
        Err(e) => {
            console::error(&e);
            return ExitCode::from(2);
        }
    };
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    let result = rt.block_on(run_async(prepared));
    // The drain has already delivered or spooled everything. A task still inside synchronous
    // code (a source that missed its stop budget, a blocking spool write) must not keep the
    // process alive: dropping the runtime would wait for it without limit.
    rt.shutdown_timeout(RUNTIME_EXIT_GRACE);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            console::error(&e);
            match e {
                // A required source or sink that cannot start is a configuration problem.
                RunError::Ebpf(_)
                | RunError::Alert(_)
                | RunError::Bind { .. }
                | RunError::Open { .. }
                | RunError::ReadyFile { .. } => ExitCode::from(2),
                _ => ExitCode::from(1),
            }
        }
    }
}

/// How long the runtime waits, after the drain, for tasks that did not stop before exiting.
const RUNTIME_EXIT_GRACE: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("binding {what} on {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("--events-jsonl {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--ready-file {path}: cannot create it: {source}")]
    ReadyFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("writing the readiness file {path}: {source}")]
    Ready {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("checker output failed: {0}")]
    Output(std::io::Error),
    #[error("drain did not finish within {0:?}; queued events were not checked")]
    DrainTimeout(Duration),
    #[error("a receiver failed: {0}")]
    Receiver(String),
    #[error("eBPF source (--ebpf on): {0}")]
    Ebpf(crate::ingest::ebpf::LoadError),
    #[error("alerting: {0}")]
    Alert(crate::alert::AlertError),
    /// Cluster mode: the stream cannot be used with this configuration.
    #[error("{0}")]
    Bus(crate::bus::BusError),
}

/// How the eBPF source ended up, for the log, /readyz and the ready file.
fn ebpf_state(start: &EbpfStart, not_built: bool) -> &'static str {
    match start {
        EbpfStart::Live(_) => "live",
        EbpfStart::Off if not_built => "unavailable",
        EbpfStart::Off => "off",
        EbpfStart::Unavailable(_) => "unavailable",
    }
}

/// Why a build without the `ebpf` feature has no eBPF source (the log and /readyz).
const NO_EBPF_IN_BUILD: &str =
    "this revenant was built without the eBPF source (the `ebpf` cargo feature)";

/// Starts the eBPF source as `--ebpf` (or the config file's `ebpf.mode`) says, unless `wanted`
/// is false (the checker has no sources). Returns it and, when it is off, why, naming the flag
/// or the config key that turned it off.
fn start_ebpf(
    cfg: &RunConfig,
    given: &overlay::Given,
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

/// What every component reports to and the admin server shows.
struct Shared {
    metrics: Arc<Metrics>,
    readiness: Readiness,
    recent: Arc<RecentViolations>,
    timeline: Arc<RecentEvents>,
    memory: Arc<MemoryAccount>,
    /// TLS and token of every server.
    access: Access,
    /// `--source-live-window`: how long a source's silence (or a coverage problem) counts.
    readiness_window: Duration,
}

impl Shared {
    fn new(admin: &AdminArgs, plan: &memory::MemoryPlan, access: Access) -> Shared {
        let metrics = Arc::new(Metrics::new());
        let account = Arc::new(plan.account());
        crate::telemetry::memory::register(&metrics, account.clone());
        access.register(&metrics);
        Shared {
            access,
            readiness_window: admin.source_live_window,
            memory: account,
            readiness: Readiness::new(metrics.clone(), admin.source_live_window),
            recent: Arc::new(RecentViolations::new(admin.recent_violations)),
            timeline: Arc::new(RecentEvents::new(RecentEventsLimits {
                max_events: admin.timeline_events,
                ..Default::default()
            })),
            metrics,
        }
    }
}

/// The listeners, bound, and the eBPF source, loaded.
struct Bound {
    admin: Option<AdminServer>,
    grpc: Option<(Incoming, SocketAddr)>,
    http: Option<(Incoming, SocketAddr)>,
    ebpf: EbpfStart,
    /// Why the eBPF source is not running, when it is off (or not in this build).
    ebpf_why: Option<String>,
    /// Why OTLP is off, naming the flags or config keys that turned it off.
    otlp_why: String,
}

/// The files `run` owns, opened before any port is bound: the spool (locked) and the sinks,
/// the events recording, and the ready file's place checked.
struct Claimed {
    alerts: OpenedAlerts,
    events_jsonl: Option<ReplayWriter>,
}

/// Opens what `run` writes to, so that a spool held by another instance, a `--spool-dir` that
/// is a file, an `--events-jsonl` or `--ready-file` in a missing directory fail (exit 2) before
/// anything listens.
fn claim(
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

/// Binds every port and loads the probes; a failure here is a configuration problem (exit 2).
/// From here on the TLS and token files are re-read when they change, until the admin stops.
async fn bind(
    cfg: &RunConfig,
    given: &overlay::Given,
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

/// The running sources, and what the ready line and file report.
struct Sources {
    /// The OTLP receivers: they end early only on failure.
    receivers: JoinSet<Result<(), String>>,
    /// The eBPF source and its drop publisher.
    ebpf: JoinSet<Result<(), String>>,
    /// The OTLP acceptor's 1 s housekeeping tick.
    ticker: JoinHandle<()>,
    ingest: Arc<Ingest>,
    otlp_stats: Arc<OtlpStats>,
    otlp_ready: Option<ReadyHandle>,
    ebpf_ready: Option<ReadyHandle>,
    bound: serde_json::Map<String, serde_json::Value>,
    /// Why no source is running at all (OTLP off, eBPF off or unavailable), if so: the caller
    /// decides whether something else feeds it (`agent --replay`) or it is blind.
    blind: Option<String>,
}

/// The admin server and the alert dispatcher: they outlive the sources and the engine.
struct Outputs {
    admin: Option<JoinHandle<Result<(), crate::admin::AdminError>>>,
    alerts: AlertPipeline,
}

/// Starts the admin server and the alert dispatcher (resuming its spool).
fn start_outputs(
    alert: &mut AlertConfig,
    opened: OpenedAlerts,
    admin: Option<AdminServer>,
    shared: &Shared,
    shutdown: &Shutdown,
    bound: &mut serde_json::Map<String, serde_json::Value>,
) -> Outputs {
    let admin = admin.map(|server| {
        bound.insert("admin".into(), server.local_addr().to_string().into());
        if let Some(m) = server.metrics_addr() {
            bound.insert("metrics".into(), m.to_string().into());
        }
        if alert.external_url.is_none() {
            alert.external_url = Some(format!(
                "{}://{}",
                shared.access.scheme(),
                server.local_addr()
            ));
        }
        serve_admin(server, shared, shutdown)
    });
    let alerts = opened.start(
        alert,
        shared.metrics.clone(),
        Some(&shared.readiness),
        Some(shared.recent.clone()),
    );
    tracing::info!(spool = %alerts.spool_dir.display(), "alert dispatcher started");
    Outputs { admin, alerts }
}

/// Spawns the eBPF source and the OTLP receivers, each sending into `tx`; they stop at
/// [`Phase::StopSources`].
fn start_sources(
    cfg: &RunConfig,
    normalizer: Normalizer,
    b: Bound,
    tx: EventSender,
    shared: &Shared,
    shutdown: &Shutdown,
    mut bound: serde_json::Map<String, serde_json::Value>,
) -> Sources {
    let (metrics, readiness) = (&shared.metrics, &shared.readiness);
    let otlp_stats = Arc::new(OtlpStats::default());
    otlp::metrics::register(metrics, otlp_stats.clone());
    let otlp_on = b.grpc.is_some() || b.http.is_some();
    let otlp_ready = otlp_on.then(|| {
        metrics.declare_source(Source::Otlp);
        readiness.register("otlp", ComponentKind::Source)
    });
    let ingest = Arc::new(Ingest::new(
        tx.clone(),
        normalizer,
        otlp_stats.clone(),
        cfg.otlp.max_items_per_request,
        shared.memory.clone(),
    ));

    let ebpf_state = ebpf_state(&b.ebpf, !crate::telemetry::build::has_ebpf());
    bound.insert("ebpf".into(), ebpf_state.into());
    let mut ebpf = JoinSet::new();
    let ebpf_ready = match b.ebpf {
        EbpfStart::Live(src) => {
            metrics.declare_source(Source::Ebpf);
            crate::ingest::ebpf::metrics::register(metrics, src.stats());
            let handle = readiness.register("ebpf", ComponentKind::Source);
            let publish = crate::ingest::ebpf::metrics::publish_drops(
                src.stats(),
                metrics.clone(),
                readiness.clone(),
                shutdown.at(Phase::StopSources),
            );
            ebpf.spawn(async move {
                publish.await;
                Ok(())
            });
            let (txe, stop) = (tx.clone(), shutdown.at(Phase::StopSources));
            ebpf.spawn(async move {
                if let Err(e) = src.run(txe, stop).await {
                    tracing::error!(error = %e, "eBPF source stopped: kernel capture is BLIND from now on");
                }
                Ok(())
            });
            handle.ready();
            Some(handle)
        }
        EbpfStart::Off => {
            let why = b.ebpf_why.clone().unwrap_or_else(|| "off".into());
            readiness.disabled("ebpf", &why);
            None
        }
        EbpfStart::Unavailable(e) => {
            readiness.disabled("ebpf", &format!("unavailable: {e}"));
            None
        }
    };
    if !otlp_on {
        readiness.disabled("otlp", &b.otlp_why);
    }
    // Only the sources hold senders now: the channel closes once they all stopped.
    drop(tx);

    let mut receivers = JoinSet::new();
    if let Some((l, addr)) = b.grpc {
        bound.insert("otlp_grpc".into(), addr.to_string().into());
        let (ing, max, access, stop) = (
            ingest.clone(),
            cfg.otlp.max_message_bytes,
            shared.access.clone(),
            shutdown.at(Phase::StopSources),
        );
        receivers.spawn(async move {
            otlp::grpc::serve(l, ing, max, access, stop)
                .await
                .map_err(|e| e.to_string())
        });
        tracing::info!(%addr, "otlp/grpc listening");
    }
    if let Some((l, addr)) = b.http {
        bound.insert("otlp_http".into(), addr.to_string().into());
        let (ing, max, maxd, access, stop) = (
            ingest.clone(),
            cfg.otlp.max_message_bytes,
            cfg.otlp.max_decompressed_bytes,
            shared.access.clone(),
            shutdown.at(Phase::StopSources),
        );
        receivers.spawn(async move {
            otlp::http::serve(l, ing, max, maxd, access, stop)
                .await
                .map_err(|e| e.to_string())
        });
        tracing::info!(%addr, "otlp/http listening");
    }
    if let Some(h) = &otlp_ready {
        h.ready();
        let (stats, readiness, stop) = (
            otlp_stats.clone(),
            readiness.clone(),
            shutdown.at(Phase::StopSources),
        );
        tokio::spawn(coverage::watch_no_profile(
            stats,
            readiness,
            shared.readiness_window,
            stop,
        ));
    }
    let ticker = {
        let ing = ingest.clone();
        let mut stop = Box::pin(shutdown.at(Phase::StopSources));
        tokio::spawn(async move {
            let mut iv = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    _ = iv.tick() => ing.tick().await,
                    () = &mut stop => break,
                }
            }
        })
    };
    // "started", not "live": /readyz calls a source live once it delivered an event.
    tracing::info!(
        otlp = if otlp_on { "started" } else { "off" },
        ebpf = if ebpf_state == "live" {
            "started"
        } else {
            ebpf_state
        },
        "sources"
    );
    let blind = (!otlp_on && ebpf_state != "live").then(|| {
        format!(
            "OTLP is {} and eBPF is {}",
            b.otlp_why,
            readiness
                .report()
                .disabled
                .get("ebpf")
                .cloned()
                .unwrap_or_else(|| ebpf_state.into())
        )
    });
    Sources {
        blind,
        receivers,
        ebpf,
        ticker,
        ingest,
        otlp_stats,
        otlp_ready,
        ebpf_ready,
        bound,
    }
}

/// The engine task's side effects, in the order they see each batch.
fn engine_taps(
    shared: &Shared,
    sources: &Sources,
    replay: Option<ReplayWriter>,
) -> Vec<Box<dyn EventTap>> {
    let mut taps: Vec<Box<dyn EventTap>> = vec![
        Box::new(TimelineTap(shared.timeline.clone())),
        Box::new(SourceActivity {
            otlp: sources.otlp_ready.clone(),
            ebpf: sources.ebpf_ready.clone(),
        }),
        Box::new(Observed(shared.metrics.clone())),
        Box::new(EngineMetrics(shared.metrics.clone())),
        Box::new(memory::MemoryTap {
            account: shared.memory.clone(),
            timeline: shared.timeline.clone(),
            violations: shared.recent.clone(),
            readiness: Some(shared.readiness.clone()),
            watch: MemoryWatch::default(),
        }),
    ];
    if let Some(w) = replay {
        taps.push(Box::new(w));
    }
    taps
}

/// Spawns the engine task; it drains at [`Phase::CloseEngine`].
fn start_engine(
    task: EngineTask,
    shutdown: &Shutdown,
) -> JoinHandle<std::io::Result<EngineTotals>> {
    tokio::spawn(task.run(shutdown.at(Phase::CloseEngine)))
}

/// Prints the bound addresses on standard error and writes them to `--ready-file`.
fn announce_ready(
    bound: &serde_json::Map<String, serde_json::Value>,
    ready_file: Option<&PathBuf>,
) -> Result<(), RunError> {
    let ready = serde_json::Value::Object(bound.clone());
    console::say(
        console::Level::Info,
        &format!("ready {ready}"),
        "ready",
        bound.clone(),
    );
    if let Some(path) = ready_file {
        // Write then rename: a reader never sees a half-written file.
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, ready.to_string())
            .and_then(|_| std::fs::rename(&tmp, path))
            .map_err(|source| RunError::Ready {
                path: path.clone(),
                source,
            })?;
    }
    Ok(())
}

/// Runs until a signal, or until a receiver dies (its error is returned). From then on a
/// (second) signal ends the process at once: see [`force_exit_on_signal`].
async fn wait(sources: &mut Sources) -> Option<String> {
    let failure = tokio::select! {
        _ = shutdown::signal() => {
            tracing::info!("shutting down: draining (a second signal exits at once)");
            None
        }
        e = shutdown::first_failure(&mut sources.receivers) => Some(e),
    };
    tokio::spawn(force_exit_on_signal());
    failure
}

/// A signal during the drain: the operator does not want to wait for it (an unreachable
/// webhook holds it for the dispatcher's drain timeout). Exits with 1 at once; what the spool
/// holds stays there for the next start, queued events are not checked.
async fn force_exit_on_signal() {
    shutdown::signal().await;
    console::say(
        console::Level::Warn,
        "second signal: exiting without finishing the drain; undelivered alerts stay in the spool",
        "second signal: exiting without finishing the drain",
        serde_json::Map::new(),
    );
    std::process::exit(1);
}

/// Stops the sources, drains the engine and the dispatcher within the drain budget, and stops
/// the admin server last.
async fn drain(
    mut sources: Sources,
    engine: JoinHandle<std::io::Result<EngineTotals>>,
    outputs: Outputs,
    shutdown: Shutdown,
    budget: Duration,
    mut failure: Option<String>,
) -> Result<(), RunError> {
    let drain = Drain::start(budget);
    shutdown.advance(Phase::StopSources);
    let grace = drain.source_grace();
    if let Some(e) = shutdown::join_within(
        &mut sources.receivers,
        grace,
        "shutdown: a receiver still had open connections; closing them",
    )
    .await
    {
        failure.get_or_insert(e);
    }
    // The eBPF source sends what its ring still holds before it returns.
    shutdown::join_within(
        &mut sources.ebpf,
        grace,
        "shutdown: the eBPF source did not stop in time",
    )
    .await;
    let _ = sources.ticker.await;
    // The receivers are closed, so no abort can arrive any more: the completions still waiting
    // out their grace period are now believed.
    match tokio::time::timeout(drain.remaining(), sources.ingest.flush()).await {
        Ok(0) => {}
        Ok(n) => tracing::info!(count = n, "shutdown: released deferred SGLang completions"),
        Err(_) => return Err(RunError::DrainTimeout(drain.budget())),
    }
    drop(sources.ingest);
    shutdown.advance(Phase::CloseEngine);
    let remaining = drain.remaining().max(Duration::from_millis(100));
    let totals = match tokio::time::timeout(remaining, engine).await {
        Err(_) => return Err(RunError::DrainTimeout(drain.budget())),
        Ok(Err(e)) => return Err(RunError::Receiver(format!("checker task: {e}"))),
        Ok(Ok(r)) => r.map_err(RunError::Output)?,
    };
    // The engine task dropped its violation sender: the dispatcher delivers what is queued
    // (bounded by its own drain timeout) and leaves the rest in the spool for the next start.
    let AlertPipeline { sender, handle, .. } = outputs.alerts;
    drop(sender);
    let report = match handle.await {
        Ok(r) => r,
        Err(e) => return Err(RunError::Receiver(format!("alert dispatcher: {e}"))),
    };
    shutdown.advance(Phase::StopAdmin);
    if let Some(t) = outputs.admin {
        let _ = tokio::time::timeout(Duration::from_secs(2), t).await;
    }
    report_totals(&drain, &totals, &report);
    report_counters(&sources.otlp_stats.render());
    match failure {
        Some(e) => Err(RunError::Receiver(e)),
        None => Ok(()),
    }
}

/// The budget's split, once at start: what each structure may hold before it evicts or refuses.
fn log_memory_plan(plan: &memory::MemoryPlan, cfg: &RunConfig, admin: &AdminArgs) {
    // MiB to one decimal: `149.6`, not `149.63198471069336`.
    let tenths = |bytes: u64| (bytes as f64 / (1 << 20) as f64 * 10.0).round() / 10.0;
    let mib = |s: Structure| tenths(plan.cap(s));
    let t = &cfg.normalize.sglang;
    tracing::info!(
        budget_mib = tenths(plan.budget),
        reserve_mib = (memory::RESERVE >> 20),
        attempts = plan.engine.max_attempts,
        request_records = plan.engine.max_requests,
        attempts_mib = mib(Structure::Attempts),
        tombstones = plan.engine.max_tombstones,
        tombstones_mib = mib(Structure::Tombstones),
        span_tree_known = t.max_known,
        span_tree_orphans = t.max_orphans,
        span_tree_completions = t.max_completions,
        span_tree_mib = mib(Structure::SpanTree),
        event_channel_mib = mib(Structure::EventChannel),
        timeline_events = admin.timeline_events,
        timeline_mib = mib(Structure::Timeline),
        recent_violations = admin.recent_violations,
        "memory budget split"
    );
}

/// The shutdown summary: one line (in JSON, its figures as fields).
fn report_totals(drain: &Drain, totals: &EngineTotals, report: &DispatchReport) {
    let n = |count: u64, one: &str, many: &str| {
        format!("{count} {}", if count == 1 { one } else { many })
    };
    let human = format!(
        "stopped after draining in {:?}: {}, {} checked, {}; \
         alerts: {}, {} merged, {}, {} spooled for delivery, {} rate-limited, \
         {} delivered to every sink, {} pending in the spool, {} dropped by the spool{}{}",
        drain.elapsed(),
        n(totals.batches, "batch", "batches"),
        n(totals.events, "event", "events"),
        n(totals.violations, "violation", "violations"),
        n(report.incidents, "incident", "incidents"),
        n(report.merged, "finding", "findings"),
        n(report.deduplicated, "repeat", "repeats"),
        n(report.notified, "notification", "notifications"),
        n(report.rate_limited, "finding", "findings"),
        report.delivered,
        report.undelivered_at_exit,
        report.spool_dropped,
        if report.spool_discarded > 0 {
            format!(
                ", {} discarded from the spool at your request",
                report.spool_discarded
            )
        } else {
            String::new()
        },
        if report.sent_before > 0 {
            format!(
                ", {} not sent again (another checker life or replica had sent them)",
                report.sent_before
            )
        } else {
            String::new()
        },
    );
    let fields = serde_json::json!({
        "drain_seconds": drain.elapsed().as_secs_f64(),
        "batches": totals.batches,
        "events_checked": totals.events,
        "violations": totals.violations,
        "incidents": report.incidents,
        "findings_merged": report.merged,
        "repeats": report.deduplicated,
        "notifications_spooled": report.notified,
        "findings_rate_limited": report.rate_limited,
        "notifications_sent_before": report.sent_before,
        "spool_dropped": report.spool_dropped,
        "spool_left": report.undelivered_at_exit,
        "delivered": report.delivered,
        "spool_discarded": report.spool_discarded,
    });
    let serde_json::Value::Object(fields) = fields else {
        return;
    };
    console::say(console::Level::Info, &human, "stopped", fields);
}

/// The OTLP counters that moved (`name{labels} value` lines): as they are in the human format,
/// one record with a `counters` object (sample → value) in JSON.
fn report_counters(rendered: &str) {
    let mut counters = serde_json::Map::new();
    for line in rendered.lines().filter(|l| !l.is_empty()) {
        if let Some((sample, value)) = line.rsplit_once(' ') {
            let value = value
                .parse::<u64>()
                .map_or_else(|_| value.into(), serde_json::Value::from);
            counters.insert(sample.to_owned(), value);
        }
    }
    if counters.is_empty() {
        return;
    }
    match console::format() {
        LogFormat::Human => {
            for line in rendered.lines().filter(|l| !l.is_empty()) {
                console::write_line(line);
            }
        }
        LogFormat::Json => {
            let mut fields = serde_json::Map::new();
            fields.insert("counters".into(), counters.into());
            console::say(console::Level::Info, "", "otlp counters", fields);
        }
    }
}

/// `revenant run` once prepared: bind → start → wait → drain.
pub async fn run_async(p: Prepared) -> Result<(), RunError> {
    let Prepared {
        cfg,
        memory,
        normalizer,
        checker,
        mut alert,
        admin,
        access,
        ready_file,
        pause_file,
        given,
    } = p;
    let shutdown = Shutdown::new();
    let shared = Shared::new(&admin, &memory, access);
    log_memory_plan(&memory, &cfg, &admin);
    let header = announce_rules(&shared, &checker, &cfg);
    let claimed = claim(&cfg, &alert, ready_file.as_ref(), &header.line())?;
    let hold = hold_windows(checker.rules());
    let mut b = bind(&cfg, &given, Role::Run, &admin, &shared, &shutdown, hold).await?;
    let mut bound = serde_json::Map::new();
    let outputs = start_outputs(
        &mut alert,
        claimed.alerts,
        b.admin.take(),
        &shared,
        &shutdown,
        &mut bound,
    );
    let replay = claimed.events_jsonl;
    let (tx, rx) = event_channel(cfg.channel_capacity());
    let mut sources = start_sources(&cfg, normalizer, b, tx, &shared, &shutdown, bound);
    if let Some(why) = sources.blind.take() {
        coverage::no_source(&shared.readiness, why);
    }
    let engine = start_engine(
        EngineTask {
            engine: checker,
            events: rx,
            violations: ViolationSender::new(outputs.alerts.sender.clone(), shared.metrics.clone()),
            taps: engine_taps(&shared, &sources, replay),
            lateness: cfg.engine.allowed_lateness(),
            pause_file,
            clock: crate::pipeline::WatermarkClock::Wall,
            upstream: None,
        },
        &shutdown,
    );
    announce_ready(&sources.bound, ready_file.as_ref())?;
    let failure = wait(&mut sources).await;
    drain(
        sources,
        engine,
        outputs,
        shutdown,
        cfg.drain_timeout(),
        failure,
    )
    .await
}
