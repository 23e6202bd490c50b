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
//!
//! `agent` and `checker` follow the same order with other middles, from the same kit: `kit`
//! (the frame each runs in: logging, prepare, the runtime, and the one mapping from how it ended
//! to an exit code, [`RunError::exit`]; what every component reports to), `bind` (files, then
//! ports and probes), `start` (outputs, sources, engine), `report` (what they say at start and
//! end), `shutdown` (the phases and the drain budget). `prepare` and `overlay` read the settings
//! (the config file, the flags over it), `memory` splits the memory budget, `coverage` says when
//! a source sees nothing it can use, `flags` says which flags each subcommand takes.
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
mod args;
mod bind;
pub mod bus_args;
pub mod checker;
pub mod coverage;
pub mod flags;
mod kit;
pub mod memory;
pub mod overlay;
mod prepare;
mod report;
pub mod shutdown;
mod start;

use std::process::ExitCode;
use std::time::Duration;

use tokio::task::JoinHandle;

use crate::alert::AlertPipeline;
use crate::pipeline::{Engine, EngineTask, EngineTotals, ViolationSender, event_channel};

use bind::{bind, claim};
use kit::{announce_ready, force_exit_on_signal};
use report::{log_memory_plan, report_counters, report_totals};
use start::{
    Outputs, Sources, announce_rules, engine_taps, hold_windows, start_engine, start_outputs,
    start_sources,
};

pub use args::{Given, RunArgs, RunConfigError};
pub use kit::RunError;
pub use prepare::{Prepared, Role, load_config, prepare, prepare_for};
pub use shutdown::{Drain, Phase, Shutdown};

pub fn run(args: RunArgs) -> ExitCode {
    let log = args.log.clone();
    kit::serve(&log, || prepare(&args), run_async)
}

/// `revenant run` once prepared: bind → start → wait → drain.
pub async fn run_async(p: Prepared) -> Result<(), RunError> {
    let Prepared {
        cfg,
        memory,
        normalizer,
        checker,
        rules,
        engine_config,
        mut alert,
        admin,
        access,
        ready_file,
        pause_file,
        given,
        ..
    } = p;
    let (shutdown, shared) = kit::begin(&admin, &memory, access);
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
    let engine = match cfg.engine.shards() {
        1 => Engine::One(Box::new(checker)),
        n => Engine::new(&rules, &engine_config, n),
    };
    tracing::info!(
        shards = engine.shards(),
        "engine: {} checker(s), each on a thread of its own with its share of the memory budget",
        engine.shards()
    );
    let engine = start_engine(
        EngineTask {
            engine,
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
