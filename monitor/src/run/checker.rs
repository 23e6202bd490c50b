//! `revenant checker`: cluster mode's checking tier. Consumes the partitions it owns from
//! JetStream (one durable pull consumer each, created when missing, like the stream), feeds the
//! same engine task `run` drives (the engine is unchanged: it sees `EventBatch`es), and sends
//! what it finds through the same alert dispatcher, sinks and spool. No source of its own: OTLP
//! and eBPF stay off.
//!
//! prepare → claim (alert spool, files) → bind (admin) → start outputs → connect, stream,
//! consumers, notification claims → engine → each partition read again from `recovery_window`
//! before where its consumer had come, then live → ready → wait → drain (consumers stop and
//! leave what they did not take unacknowledged for the next checker, the engine judges only as
//! far as every agent's stream provably came, then the dispatcher).
//!
//! The engine's watermark waits for the slowest agent stream it reads (`bus::progress`): a
//! backlog, an agent's outbox held back while NATS was away, a restart's replay are judged as
//! they would have been live.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::JoinSet;

use super::bind::{bind, claim};
use super::bus_args::BusArgs;
use super::kit::{self, RunError, Shared, announce_ready, force_exit_on_signal};
use super::report::report_totals;
use super::shutdown::{self, Drain, Phase, Shutdown};
use super::start::{announce_rules, start_outputs};
use super::{RunArgs, memory};
use crate::admin::timeline::TimelineTap;
use crate::alert::AlertPipeline;
use crate::bus::claims::Claims;
use crate::bus::consumer::{self, CheckerStats, PartitionCtx, SharedStreams};
use crate::bus::progress::{ProgressClock, Streams};
use crate::bus::{BusConfig, BusConfigError};
use crate::engine::check::CheckerConfig;
use crate::ingest::ebpf::HoldWindows;

use crate::pipeline::taps::{EngineMetrics, Observed};
use crate::pipeline::{EngineTask, EventTap, ViolationSender, WatermarkClock, event_channel};
use crate::telemetry::{ComponentKind, MemoryWatch};
use crate::violation::Violation;

#[derive(Debug, clap::Args)]
pub struct CheckerArgs {
    #[command(flatten, next_help_heading = "Cluster mode (NATS JetStream)")]
    pub bus: BusArgs,
    /// The partitions this checker consumes, comma-separated (`0,2`); the others belong to
    /// other checker replicas [default: all].
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub owned_partitions: Option<Vec<u32>>,
    /// What moves the engine's watermark besides the events: `wall` (live traffic: deadlines
    /// are judged as the clock passes them) or `event` (recorded events replayed through the
    /// cluster: judged on event time only, as `revenant check` does) [default: wall].
    #[arg(long, value_name = "CLOCK", value_enum, default_value_t = WatermarkClock::Wall)]
    pub watermark_clock: WatermarkClock,
    /// How far back a starting checker reads its partitions again, before where their
    /// consumers had come, to rebuild the engine's state [default: the engine's retention of
    /// ended attempts (10 min) plus --allowed-lateness].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub recovery_window: Option<Duration>,
    /// How long an agent stream may stay silent (while this checker is connected and caught up)
    /// before verdicts stop waiting for it [default: 30s].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub agent_silence: Option<Duration>,
    /// Also write every violation, one JSON object per line (the `revenant check` output).
    #[arg(long, value_name = "PATH")]
    pub violations_jsonl: Option<PathBuf>,
    #[command(flatten)]
    pub run: RunArgs,
}

/// Why `checker` cannot start (exit 2).
#[derive(Debug, thiserror::Error)]
pub enum CheckerConfigError {
    #[error(transparent)]
    Run(#[from] super::RunConfigError),
    #[error(transparent)]
    Bus(#[from] BusConfigError),
    #[error("--violations-jsonl {path}: {source}")]
    Violations {
        path: PathBuf,
        source: std::io::Error,
    },
}

pub fn run(args: CheckerArgs) -> ExitCode {
    let log = args.run.log.clone();
    let clock = args.watermark_clock;
    kit::serve(
        &log,
        || prepare(args),
        |(prepared, bus, violations_out)| checker_async(prepared, bus, clock, violations_out),
    )
}

/// Every setting read and checked, `--violations-jsonl` opened, nothing bound. The checker
/// listens for no telemetry: its events come from the bus.
fn prepare(
    args: CheckerArgs,
) -> Result<(super::Prepared, BusConfig, Option<std::fs::File>), CheckerConfigError> {
    let prepared = super::prepare_for(&args.run, super::Role::Checker)?;
    let mut bus = prepared.cfg.bus.clone();
    args.bus.apply(&mut bus);
    if args.owned_partitions.is_some() {
        bus.owned.clone_from(&args.owned_partitions);
    }
    if args.recovery_window.is_some() {
        bus.recovery_window = args.recovery_window;
    }
    if let Some(v) = args.agent_silence {
        bus.agent_silence = v;
    }
    bus.validate()?;
    let violations_out = match &args.violations_jsonl {
        None => None,
        Some(p) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .map_err(|source| CheckerConfigError::Violations {
                    path: p.clone(),
                    source,
                })?,
        ),
    };
    Ok((prepared, bus, violations_out))
}

/// Writes every violation as a JSON line, then hands it to the dispatcher.
async fn forward_violations(
    mut rx: tokio::sync::mpsc::Receiver<Violation>,
    out: ViolationSender,
    file: Option<std::fs::File>,
) -> std::io::Result<()> {
    let mut file = file.map(|f| std::io::BufWriter::with_capacity(1 << 16, f));
    let mut line = Vec::with_capacity(1024);
    while let Some(v) = rx.recv().await {
        if let Some(f) = &mut file {
            line.clear();
            serde_json::to_writer(&mut line, &v)?;
            line.push(b'\n');
            f.write_all(&line)?;
            if rx.is_empty() {
                f.flush()?;
            }
        }
        out.offer(v);
    }
    if let Some(f) = &mut file {
        f.flush()?;
    }
    Ok(())
}

async fn checker_async(
    p: super::Prepared,
    bus: BusConfig,
    clock: WatermarkClock,
    violations_out: Option<std::fs::File>,
) -> Result<(), RunError> {
    let super::Prepared {
        cfg,
        memory,
        checker,
        mut alert,
        admin,
        access,
        ready_file,
        pause_file,
        given,
        ..
    } = p;
    let shutdown = Shutdown::new();
    let shared = Shared::new(&admin, &memory, access);
    let header = announce_rules(&shared, &checker, &cfg);
    let stats = Arc::new(CheckerStats::default());
    let owned = bus.owned_partitions();
    let streams = SharedStreams::new(Streams::new(
        match clock {
            WatermarkClock::Wall => ProgressClock::Wall,
            WatermarkClock::Event => ProgressClock::Event,
        },
        &owned,
    ));
    consumer::register(&shared.metrics, stats.clone(), streams.clone());
    // What the engine keeps of ended attempts, and how late events may come: a restart reads
    // that much again, and claims outlast it.
    let recovery_window = bus
        .recovery_window
        .unwrap_or(CheckerConfig::default().retention + cfg.engine.allowed_lateness());
    let claimed = claim(&cfg, &alert, ready_file.as_ref(), &header.line())?;
    // Notifications an earlier life of this checker (or another replica) sent are not sent
    // again; the bucket opens once NATS answers.
    let claims = Claims::new(&shared.metrics);
    let mut b = bind(
        &cfg,
        &given,
        super::Role::Checker,
        &admin,
        &shared,
        &shutdown,
        HoldWindows::default(),
    )
    .await?;
    let mut bound = serde_json::Map::new();
    let outputs = start_outputs(
        &mut alert,
        claimed.alerts.with_claims(claims.clone()),
        b.admin.take(),
        &shared,
        &shutdown,
        &mut bound,
    );

    // The bus: connect, the stream and one consumer per owned partition, each retried until
    // NATS answers (readiness says why meanwhile).
    let nats = shared.readiness.register("nats", ComponentKind::Source);
    let client = crate::bus::connect(&bus, "revenant-checker")
        .await
        .map_err(|e| RunError::Receiver(e.to_string()))?;
    let js = async_nats::jetstream::new(client.clone());
    let url = bus.nats.clone().unwrap_or_default();
    let mut setup = None;
    let mut stop_wait = std::pin::pin!(shutdown::signal());
    'setup: loop {
        let attempt = async {
            let stream = crate::bus::ensure_stream(&js, &bus).await?;
            let mut cs = Vec::new();
            for k in &owned {
                cs.push((*k, crate::bus::ensure_consumer(&stream, &bus, *k).await?));
            }
            claims
                .open(&client, &js, &bus, bus.retention.max(recovery_window * 2))
                .await?;
            Ok::<_, crate::bus::BusError>((stream, cs))
        };
        tokio::select! {
            r = tokio::time::timeout(Duration::from_secs(5), attempt) => match r {
                Ok(Ok(done)) => { setup = Some(done); break 'setup; }
                Ok(Err(e @ crate::bus::BusError::Partitions { .. })) => {
                    return Err(RunError::Bus(e));
                }
                Ok(Err(e)) => {
                    shared.readiness.set_down("nats", Some(e.to_string()));
                    tracing::warn!(error = %e, "bus not ready; retrying");
                }
                Err(_) => {
                    shared.readiness.set_down("nats", Some(format!("NATS {url} unreachable")));
                    tracing::warn!(nats = %url, "NATS unreachable; retrying");
                }
            },
            _ = &mut stop_wait => break 'setup,
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let Some((stream, consumers)) = setup else {
        // Stopped before NATS ever answered.
        return Ok(());
    };
    shared.readiness.set_down("nats", None);
    nats.ready();
    bound.insert("nats".into(), url.clone().into());
    bound.insert("stream".into(), bus.stream.clone().into());
    bound.insert(
        "partitions".into(),
        serde_json::Value::from(owned.iter().map(|k| u64::from(*k)).collect::<Vec<_>>()),
    );

    let (tx, rx) = event_channel(cfg.channel_capacity());
    let ctx = PartitionCtx {
        streams: streams.clone(),
        stats: stats.clone(),
        metrics: shared.metrics.clone(),
        first_owned: owned.first().copied().unwrap_or(0),
    };
    // Each partition: read again from before where its consumer had come (readiness waits for
    // every one), then live.
    let recovery = shared.readiness.register("recovery", ComponentKind::Source);
    let recovering = Arc::new(std::sync::atomic::AtomicUsize::new(consumers.len()));
    stats.recovering.store(consumers.len() as u64, Relaxed);
    if consumers.is_empty() {
        recovery.ready();
    }
    let recovery = Arc::new(Mutex::new(Some(recovery)));
    let mut partitions: JoinSet<Result<(), String>> = JoinSet::new();
    for (k, mut c) in consumers {
        let (stream, tx, ctx, bus) = (stream.clone(), tx.clone(), ctx.clone(), bus.clone());
        let (recovering, recovery) = (recovering.clone(), recovery.clone());
        let subject = crate::bus::batcher::subject(&bus.stream, k);
        let stop = shutdown.at(Phase::StopSources);
        partitions.spawn(async move {
            let mut stop = std::pin::pin!(stop);
            let started = std::time::Instant::now();
            // NATS may go away while a partition is read again: try again once it answers (what
            // was already fed is recognised and skipped), the checker keeps running meanwhile.
            let read = loop {
                tokio::select! {
                    r = consumer::recover(&stream, &c, subject.clone(), k, recovery_window, &tx, &ctx) => match r {
                        Ok(read) => break read,
                        Err(e) => tracing::warn!(
                            partition = k, error = %e,
                            "reading the partition again failed; retrying"
                        ),
                    },
                    () = &mut stop => return Ok(()),
                }
                tokio::select! {
                    r = consumer::reopen(&stream, &bus, k) => if let Some(fresh) = r { c = fresh },
                    () = &mut stop => return Ok(()),
                }
            };
            if read > 0 {
                tracing::info!(
                    partition = k, messages = read, took = ?started.elapsed(),
                    "partition read again from {recovery_window:?} before where its consumer had come"
                );
            }
            ctx.stats.recovering.fetch_sub(1, Relaxed);
            if recovering.fetch_sub(1, Relaxed) == 1
                && let Some(h) = recovery.lock().unwrap_or_else(|p| p.into_inner()).take()
            {
                h.ready();
            }
            consumer::run_partition(stream, bus, c, k, tx, ctx, stop).await;
            Ok(())
        });
    }
    drop(tx);
    // Readiness and the streams' view follow the connection; silent agent streams are given
    // up on.
    let watch = {
        let (readiness, client, url) = (shared.readiness.clone(), client.clone(), url.clone());
        let (streams, stats) = (streams.clone(), stats.clone());
        let silence = bus.agent_silence.as_nanos() as u64;
        let keep = bus.retention.as_nanos() as u64;
        let mut stop = Box::pin(shutdown.at(Phase::StopSources));
        tokio::spawn(async move {
            let mut iv = tokio::time::interval(Duration::from_millis(500));
            loop {
                tokio::select! {
                    _ = iv.tick() => {
                        let up = client.connection_state() == async_nats::connection::State::Connected;
                        readiness.set_down("nats", (!up).then(|| format!("NATS {url} unreachable")));
                        let now = crate::event::now_unix_ns();
                        let expired = {
                            let mut st = streams.lock();
                            st.set_connected(up);
                            let e = st.expire(now, silence);
                            st.forget(now, keep);
                            e
                        };
                        if !expired.silent.is_empty() {
                            stats.streams_silent.fetch_add(expired.silent.len() as u64, Relaxed);
                            tracing::warn!(
                                agents = ?expired.silent, silence = ?Duration::from_nanos(silence),
                                "agent streams silent while caught up: verdicts no longer wait for them"
                            );
                        }
                        if expired.gaps_skipped > 0 {
                            stats.batches_missing.fetch_add(expired.gaps_skipped, Relaxed);
                            tracing::warn!(
                                batches = expired.gaps_skipped,
                                "batches never received (dropped by their agent): skipped over"
                            );
                        }
                    }
                    () = &mut stop => break,
                }
            }
        })
    };

    let (vtx, vrx) = tokio::sync::mpsc::channel(alert.channel_capacity.max(16));
    let forward = tokio::spawn(forward_violations(
        vrx,
        ViolationSender::new(outputs.alerts.sender.clone(), shared.metrics.clone()),
        violations_out,
    ));
    let mut taps: Vec<Box<dyn EventTap>> = vec![
        Box::new(TimelineTap(shared.timeline.clone())),
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
    if let Some(w) = claimed.events_jsonl {
        taps.push(Box::new(w));
    }
    let engine = tokio::spawn(
        EngineTask {
            engine: checker,
            events: rx,
            violations: ViolationSender::new(vtx, shared.metrics.clone()),
            taps,
            lateness: cfg.engine.allowed_lateness(),
            pause_file,
            clock,
            upstream: Some(Arc::new(streams.clone())),
        }
        .run(shutdown.at(Phase::CloseEngine)),
    );
    announce_ready(&bound, ready_file.as_ref())?;
    let failure = tokio::select! {
        _ = shutdown::signal() => {
            tracing::info!("shutting down: draining (a second signal exits at once)");
            None
        }
        e = shutdown::first_failure(&mut partitions) => Some(e),
    };
    tokio::spawn(force_exit_on_signal());

    let drain = Drain::start(cfg.drain_timeout());
    shutdown.advance(Phase::StopSources);
    shutdown::join_within(
        &mut partitions,
        drain.source_grace(),
        "shutdown: a partition consumer did not stop in time",
    )
    .await;
    let _ = watch.await;
    shutdown.advance(Phase::CloseEngine);
    let remaining = drain.remaining().max(Duration::from_millis(100));
    let totals = match tokio::time::timeout(remaining, engine).await {
        Err(_) => return Err(RunError::DrainTimeout(drain.budget())),
        Ok(Err(e)) => return Err(RunError::Receiver(format!("checker task: {e}"))),
        Ok(Ok(r)) => r.map_err(RunError::Output)?,
    };
    match forward.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(RunError::Output(e)),
        Err(e) => return Err(RunError::Receiver(format!("violation output: {e}"))),
    }
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
    match failure {
        Some(e) => Err(RunError::Receiver(e)),
        None => Ok(()),
    }
}
