//! The start-up kit `run`, `agent` and `checker` share: the frame every one of them runs in
//! ([`serve`]: logging, prepare, the runtime, the exit code), the one mapping from how it ended to
//! an exit code ([`RunError::exit`]), what every component reports to ([`Shared`]), the admin
//! server, the ready line, and the second signal that cuts a drain short.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use super::shutdown::{Phase, Shutdown};
use super::{memory, shutdown};
use crate::access::Access;
use crate::admin::timeline::TimelineTap;
use crate::admin::{AdminArgs, AdminServer, AdminState, RecentEvents, RecentEventsLimits};
use crate::exit::Exit;
use crate::pipeline::EventTap;
use crate::pipeline::taps::{EngineMetrics, Observed};
use crate::telemetry::logging::LogArgs;
use crate::telemetry::{
    ComponentKind, MemoryAccount, MemoryWatch, Metrics, Readiness, RecentViolations, console,
};

/// The taps every engine has, in `run` and in a checker's every generation: the request
/// timeline, the event and engine metrics, and the memory bookkeeping (which reports pressure
/// through readiness).
pub(super) fn engine_taps(
    metrics: &Arc<Metrics>,
    readiness: &Readiness,
    recent: &Arc<RecentViolations>,
    timeline: &Arc<RecentEvents>,
    memory: &Arc<MemoryAccount>,
) -> Vec<Box<dyn EventTap>> {
    vec![
        Box::new(TimelineTap(timeline.clone())),
        Box::new(Observed(metrics.clone())),
        Box::new(EngineMetrics(metrics.clone())),
        Box::new(memory::MemoryTap {
            account: memory.clone(),
            timeline: timeline.clone(),
            violations: recent.clone(),
            readiness: Some(readiness.clone()),
            watch: MemoryWatch::default(),
        }),
    ]
}

/// The frame of every long-running command: logging (and revenant's own traces, if asked for)
/// set up from `log`; `prepare`, which reads and checks every setting and binds nothing (its
/// error is a usage or configuration error); the runtime; `serve` on it; the traces flushed;
/// and the exit code of how it ended ([`RunError::exit`]).
pub(super) fn serve<P, E, F>(
    log: &LogArgs,
    prepare: impl FnOnce() -> Result<P, E>,
    serve: impl FnOnce(P) -> F,
) -> ExitCode
where
    E: std::fmt::Display,
    F: std::future::Future<Output = Result<(), RunError>>,
{
    let self_traces = match log.init() {
        Ok(g) => g,
        Err(e) => return failed(&e, Exit::Usage).into(),
    };
    let exit = match prepare() {
        Err(e) => failed(&e, Exit::Usage),
        Ok(prepared) => match runtime() {
            Err(e) => failed(&format!("cannot start the runtime: {e}"), Exit::Failure),
            Ok(rt) => {
                let result = rt.block_on(serve(prepared));
                // The drain has already delivered or spooled everything. A task still inside
                // synchronous code (a source that missed its stop budget, a blocking spool
                // write) must not keep the process alive: dropping the runtime would wait for
                // it without limit.
                rt.shutdown_timeout(RUNTIME_EXIT_GRACE);
                match result {
                    Ok(()) => Exit::Success,
                    Err(e) => failed(&e, e.exit()),
                }
            }
        },
    };
    if let Some(t) = self_traces {
        t.shutdown();
    }
    exit.into()
}

/// Says why on standard error (in the log's format) and returns `exit`.
fn failed(why: &dyn std::fmt::Display, exit: Exit) -> Exit {
    console::error(why);
    exit
}

/// The runtime every long-running command runs on (two workers: the machine's sources, the
/// engine and the outputs share them).
fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
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

impl RunError {
    /// The exit code of a command that ended with this error: a required source or sink that
    /// cannot start, a port, file or stream it cannot take is a configuration problem found
    /// before anything was served (2); anything that fails once it serves is a runtime
    /// failure (1).
    pub fn exit(&self) -> Exit {
        match self {
            RunError::Ebpf(_)
            | RunError::Alert(_)
            | RunError::Bus(_)
            | RunError::Bind { .. }
            | RunError::Open { .. }
            | RunError::ReadyFile { .. } => Exit::Usage,
            RunError::Ready { .. }
            | RunError::Output(_)
            | RunError::DrainTimeout(_)
            | RunError::Receiver(_) => Exit::Failure,
        }
    }
}

/// What every component reports to and the admin server shows.
pub(super) struct Shared {
    pub(super) metrics: Arc<Metrics>,
    pub(super) readiness: Readiness,
    pub(super) recent: Arc<RecentViolations>,
    pub(super) timeline: Arc<RecentEvents>,
    pub(super) memory: Arc<MemoryAccount>,
    /// TLS and token of every server.
    pub(super) access: Access,
    /// `--source-live-window`: how long a source's silence (or a coverage problem) counts.
    pub(super) readiness_window: Duration,
    /// The cancellation windows of the rules, for request pages (set once the rules are known).
    pub(super) windows: Arc<std::sync::OnceLock<Vec<crate::report::CancelWindow>>>,
}

impl Shared {
    /// The taps every engine of this process has ([`engine_taps`]).
    pub(super) fn engine_taps(&self) -> Vec<Box<dyn EventTap>> {
        engine_taps(
            &self.metrics,
            &self.readiness,
            &self.recent,
            &self.timeline,
            &self.memory,
        )
    }

    pub(super) fn new(admin: &AdminArgs, plan: &memory::MemoryPlan, access: Access) -> Shared {
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
            windows: Default::default(),
            metrics,
        }
    }
}

/// The first step of every command that serves, inside its runtime: the shutdown its parts
/// follow, with the process's signals listened for from here on (one that comes while it
/// starts is not missed), and what every component reports to.
pub(super) fn begin(
    admin: &AdminArgs,
    plan: &memory::MemoryPlan,
    access: Access,
) -> (Shutdown, Shared) {
    let shutdown = Shutdown::new();
    shutdown::listen();
    (shutdown, Shared::new(admin, plan, access))
}

/// Serves the admin API on `server` until the shutdown reaches it, registered (and ready) in
/// the readiness report.
pub(super) fn serve_admin(
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
        windows: shared.windows.clone(),
    };
    let handle = shared.readiness.register("admin", ComponentKind::Server);
    let task = tokio::spawn(server.serve(state, shutdown.at(Phase::StopAdmin)));
    handle.ready();
    task
}

/// Prints the bound addresses on standard error and writes them to `--ready-file`.
pub(super) fn announce_ready(
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

/// A signal during the drain: the operator does not want to wait for it (an unreachable
/// webhook holds it for the dispatcher's drain timeout). Exits with 1 at once; what the spool
/// holds stays there for the next start, queued events are not checked.
pub(super) async fn force_exit_on_signal() {
    // The next one after those already counted (the drain may have begun on one, or on a
    // failure).
    let seen = *shutdown::listen().borrow();
    shutdown::received(seen + 1).await;
    console::say(
        console::Level::Warn,
        "second signal: exiting without finishing the drain; undelivered alerts stay in the spool",
        "second signal: exiting without finishing the drain",
        serde_json::Map::new(),
    );
    std::process::exit(Exit::Failure.code().into());
}
