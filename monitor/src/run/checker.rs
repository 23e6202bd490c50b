//! `revenant checker`: cluster mode's checking tier. Consumes the partitions it holds the
//! leases of (`bus::lease`; or those it is pinned to with `--owned-partitions`) from JetStream
//! (one durable pull consumer each), feeds the same engine task `run` drives (the engine is
//! unchanged: it sees `EventBatch`es), and sends what it finds through the same alert
//! dispatcher, sinks and spool. No source of its own: OTLP and eBPF stay off.
//!
//! prepare → claim (alert spool, files) → bind (admin) → start outputs → connect, stream,
//! notification claims, lease bucket → ready → for each partition set the leases give (a
//! generation): consumers, a fresh engine, each partition read again from `recovery_window`
//! before where its consumer had come, then live; verdicts pass only while the generation's
//! fence holds → wait → drain (consumers stop and leave what they did not take unacknowledged
//! for the next checker, the engine judges only as far as every agent's stream provably came,
//! then the dispatcher, then the leases are released).
//!
//! A new set means a new engine: the engine has one watermark and no notion of partitions, so
//! a partition taken mid-run (whose events are older than that watermark) or one given up
//! (whose attempts it still holds) cannot be added to or taken out of it; reading every
//! partition of the new set again is what a restart does, and the notification claims keep
//! what the earlier generation sent from being sent again.
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

use super::RunArgs;
use super::bind::{bind, claim};
use super::bus_args::BusArgs;
use super::kit::{self, RunError, announce_ready, force_exit_on_signal};
use super::report::report_totals;
use super::shutdown::{self, Drain, Phase, Shutdown};
use super::start::{announce_rules, start_outputs};
use crate::alert::AlertPipeline;
use crate::bus::claims::Claims;
use crate::bus::consumer::{self, CheckerStats, PartitionCtx, SharedStreams};
use crate::bus::lease::{self, Fence, LeaseStats, Leases, Ownership};
use crate::bus::progress::{ProgressClock, Streams};
use crate::bus::{BusConfig, BusConfigError};
use crate::engine::check::{CheckerConfig, RuleSet};
use crate::ingest::ebpf::HoldWindows;

use crate::pipeline::{EngineTask, EventTap, ViolationSender, WatermarkClock, event_channel};
use crate::telemetry::ComponentKind;
use crate::violation::Violation;

#[derive(Debug, clap::Args)]
pub struct CheckerArgs {
    #[command(flatten, next_help_heading = "Cluster mode (NATS JetStream)")]
    pub bus: BusArgs,
    /// Pins this checker to these partitions, comma-separated (`0,2`), with no lease: the
    /// operator owns the split [default: the partitions are shared with the stream's other
    /// checkers through leases].
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub owned_partitions: Option<Vec<u32>>,
    /// How long a partition lease lasts unrenewed: a partition whose checker stopped is taken
    /// by another about this long after the last renewal. The same on every checker of a
    /// stream [default: 15s].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub lease_ttl: Option<Duration>,
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
    if let Some(v) = args.lease_ttl {
        bus.lease_ttl = v;
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

    // The bus: connect, the stream, the notification claims and (unless pinned) the lease
    // bucket, each retried until NATS answers (readiness says why meanwhile).
    let nats = shared.readiness.register("nats", ComponentKind::Source);
    let client = crate::bus::connect(&bus, "revenant-checker")
        .await
        .map_err(|e| RunError::Receiver(e.to_string()))?;
    let js = async_nats::jetstream::new(client.clone());
    let url = bus.nats.clone().unwrap_or_default();
    let lease_stats = lease::register(&shared.metrics);
    lease_stats
        .partitions
        .store(u64::from(bus.partitions), Relaxed);
    let pinned = bus.owned.is_some();
    let mut setup = None;
    let mut stop_wait = std::pin::pin!(shutdown::signal());
    'setup: loop {
        let attempt = async {
            let stream = crate::bus::ensure_stream(&js, &bus).await?;
            claims
                .open(&client, &js, &bus, bus.retention.max(recovery_window * 2))
                .await?;
            let leases = if pinned {
                None
            } else {
                Some(Leases::open(&js, &bus, &cfg.node_name(), lease_stats.clone()).await?)
            };
            Ok::<_, crate::bus::BusError>((stream, leases))
        };
        tokio::select! {
            r = tokio::time::timeout(Duration::from_secs(5), attempt) => match r {
                Ok(Ok(done)) => { setup = Some(done); break 'setup; }
                Ok(Err(e @ (crate::bus::BusError::Partitions { .. } | crate::bus::BusError::LeaseTtl { .. }))) => {
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
    let Some((stream, leases)) = setup else {
        // Stopped before NATS ever answered.
        return Ok(());
    };
    shared.readiness.set_down("nats", None);
    nats.ready();
    bound.insert("nats".into(), url.clone().into());
    bound.insert("stream".into(), bus.stream.clone().into());
    // Which partitions this checker judges: a pin (fixed, the operator's split), or the leases
    // it holds, which change as checkers come and go.
    let (ownership, _pin, lease_loop) = match leases {
        None => {
            bound.insert(
                "partitions".into(),
                serde_json::Value::from(owned.iter().map(|k| u64::from(*k)).collect::<Vec<_>>()),
            );
            lease_stats.owned.store(owned.len() as u64, Relaxed);
            let (tx, rx) = tokio::sync::watch::channel(Ownership {
                epoch: 1,
                partitions: owned.clone(),
                fence: Fence::always(),
            });
            (rx, Some(tx), None)
        }
        Some((leases, rx)) => {
            bound.insert("partitions".into(), "leased".into());
            bound.insert("lease_ttl".into(), format!("{:?}", bus.lease_ttl).into());
            tracing::info!(token = leases.token(), ttl = ?bus.lease_ttl, "sharing the partitions through leases");
            let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
            let task = tokio::spawn(leases.run(async move {
                let _ = stop_rx.await;
            }));
            (rx, None, Some((stop_tx, task)))
        }
    };

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
    let recovery = shared.readiness.register("recovery", ComponentKind::Source);
    let env = GenerationEnv {
        stream,
        bus: bus.clone(),
        clock,
        streams: streams.clone(),
        stats: stats.clone(),
        lease_stats: lease_stats.clone(),
        shared: EngineShared {
            metrics: shared.metrics.clone(),
            readiness: shared.readiness.clone(),
            recent: shared.recent.clone(),
            timeline: shared.timeline.clone(),
            memory: shared.memory.clone(),
        },
        rules: rules.clone(),
        engine_config: engine_config.clone(),
        shards: cfg.engine.shards(),
        lateness: cfg.engine.allowed_lateness(),
        channel_capacity: cfg.channel_capacity(),
        pause_file: pause_file.clone(),
        recovery_window,
        recovery: Arc::new(Mutex::new(Some(recovery))),
        events_jsonl: claimed
            .events_jsonl
            .map(|w| SharedTap(Arc::new(Mutex::new(Box::new(w))))),
        violations: vtx,
        pinned,
    };
    let mut ownership = ownership;
    let mut current: Option<Generation> = None;
    announce_ready(&bound, ready_file.as_ref())?;
    // Each change of the partition set: the running generation (consumers, engine) is dropped
    // without judging more (its fence was revoked with the change), and a new one reads its
    // partitions again from the recovery window.
    let mut signal = std::pin::pin!(shutdown::signal());
    // Closed when nothing can change the set any more (a pin's sender is kept for the life).
    let mut changes_open = true;
    let failure = loop {
        let own = ownership.borrow_and_update().clone();
        if current.as_ref().is_none_or(|g| g.epoch != own.epoch) && own.epoch > 0 {
            if let Some(old) = current.take() {
                old.abandon().await;
            }
            current = Some(env.start(&own, &shutdown));
        }
        let partitions_failed = async {
            match current.as_mut() {
                Some(g) => shutdown::first_failure(&mut g.partitions).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = &mut signal => {
                tracing::info!("shutting down: draining (a second signal exits at once)");
                break None;
            }
            e = partitions_failed => break Some(e),
            r = ownership.changed(), if changes_open => if r.is_err() {
                // The lease loop ended before any signal: nothing renews the leases, so this
                // checker would soon judge nothing; a failure (exit 1, restarted).
                changes_open = false;
                if !pinned {
                    break Some("the partition lease loop stopped".into());
                }
            },
        }
    };
    drop(env);
    tokio::spawn(force_exit_on_signal());

    let drain = Drain::start(cfg.drain_timeout());
    shutdown.advance(Phase::StopSources);
    let (engine, filter) = match current {
        Some(mut g) => {
            shutdown::join_within(
                &mut g.partitions,
                drain.source_grace(),
                "shutdown: a partition consumer did not stop in time",
            )
            .await;
            (Some(g.engine), Some(g.filter))
        }
        None => (None, None),
    };
    let _ = watch.await;
    // The leases are kept (renewed) while the engine judges what it has, then released.
    shutdown.advance(Phase::CloseEngine);
    let remaining = drain.remaining().max(Duration::from_millis(100));
    let totals = match engine {
        None => Default::default(),
        Some(engine) => match tokio::time::timeout(remaining, engine).await {
            Err(_) => return Err(RunError::DrainTimeout(drain.budget())),
            Ok(Err(e)) => return Err(RunError::Receiver(format!("checker task: {e}"))),
            Ok(Ok(r)) => r.map_err(RunError::Output)?,
        },
    };
    if let Some(f) = filter {
        let _ = f.await;
    }
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
    // The leases were renewed while the engine judged and the dispatcher delivered (and
    // recorded its claims); released now, the next owners need not wait for the TTL.
    if let Some((stop, task)) = lease_loop {
        let _ = stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
    }
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

/// An event tap shared by the engines of successive generations (`--events-jsonl`).
#[derive(Clone)]
struct SharedTap(Arc<Mutex<Box<dyn EventTap>>>);

impl EventTap for SharedTap {
    fn batch(&mut self, batch: &crate::event::EventBatch, arrival_ns: u64) -> std::io::Result<()> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .batch(batch, arrival_ns)
    }

    fn tick(
        &mut self,
        engine: &crate::engine::check::metrics::CheckerSnapshot,
        now_ns: u64,
    ) -> std::io::Result<()> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .tick(engine, now_ns)
    }
}

/// What each generation's engine reports through (the process's, shared by all).
struct EngineShared {
    metrics: Arc<crate::telemetry::Metrics>,
    readiness: crate::telemetry::Readiness,
    recent: Arc<crate::telemetry::RecentViolations>,
    timeline: Arc<crate::admin::RecentEvents>,
    memory: Arc<crate::telemetry::MemoryAccount>,
}

/// What every generation is built from.
struct GenerationEnv {
    stream: async_nats::jetstream::stream::Stream,
    bus: BusConfig,
    clock: WatermarkClock,
    streams: SharedStreams,
    stats: Arc<CheckerStats>,
    lease_stats: Arc<LeaseStats>,
    shared: EngineShared,
    rules: RuleSet,
    engine_config: CheckerConfig,
    /// Checkers each generation's engine is split over.
    shards: usize,
    lateness: Duration,
    channel_capacity: usize,
    pause_file: Option<PathBuf>,
    recovery_window: Duration,
    /// The readiness of the first generation's reading again (later ones are counted only).
    recovery: Arc<Mutex<Option<crate::telemetry::ReadyHandle>>>,
    events_jsonl: Option<SharedTap>,
    /// Into the violation output (JSON lines, then the dispatcher).
    violations: tokio::sync::mpsc::Sender<Violation>,
    pinned: bool,
}

/// One partition set's consumers and engine, judging under one fence.
struct Generation {
    epoch: u64,
    partitions: JoinSet<Result<(), String>>,
    engine: tokio::task::JoinHandle<std::io::Result<crate::pipeline::EngineTotals>>,
    filter: tokio::task::JoinHandle<()>,
    fence: Fence,
}

impl Generation {
    /// Stops it without judging anything more: what it held is judged by whoever holds each
    /// partition next (this checker's next generation included), from the recovery window.
    async fn abandon(mut self) {
        self.fence.revoke();
        self.partitions.abort_all();
        while self.partitions.join_next().await.is_some() {}
        self.engine.abort();
        let _ = self.engine.await;
        self.filter.abort();
        let _ = self.filter.await;
    }
}

impl GenerationEnv {
    /// A fresh engine for `own`'s partitions, each read again from the recovery window before
    /// where its consumer had come, then live; its verdicts pass only while `own.fence` holds.
    fn start(&self, own: &Ownership, shutdown: &Shutdown) -> Generation {
        let parts = own.partitions.clone();
        self.lease_stats.owned.store(parts.len() as u64, Relaxed);
        *self.streams.lock() = Streams::new(
            match self.clock {
                WatermarkClock::Wall => ProgressClock::Wall,
                WatermarkClock::Event => ProgressClock::Event,
            },
            &parts,
        );
        tracing::info!(partitions = ?parts, epoch = own.epoch, "judging partitions");
        let (tx, rx) = event_channel(self.channel_capacity);
        let ctx = PartitionCtx {
            streams: self.streams.clone(),
            stats: self.stats.clone(),
            metrics: self.shared.metrics.clone(),
            first_owned: parts.first().copied().unwrap_or(0),
            fence: own.fence.clone(),
        };
        let recovering = Arc::new(std::sync::atomic::AtomicUsize::new(parts.len()));
        self.stats.recovering.store(parts.len() as u64, Relaxed);
        let ready = |recovery: &Arc<Mutex<Option<crate::telemetry::ReadyHandle>>>| {
            if let Some(h) = recovery.lock().unwrap_or_else(|p| p.into_inner()).take() {
                h.ready();
            }
        };
        if parts.is_empty() {
            ready(&self.recovery);
        }
        let mut partitions: JoinSet<Result<(), String>> = JoinSet::new();
        for k in parts {
            let (stream, tx, ctx, bus) = (
                self.stream.clone(),
                tx.clone(),
                ctx.clone(),
                self.bus.clone(),
            );
            let (recovering, recovery) = (recovering.clone(), self.recovery.clone());
            let subject = crate::bus::batcher::subject(&bus.stream, k);
            let stop = shutdown.at(Phase::StopSources);
            let (window, pinned) = (self.recovery_window, self.pinned);
            partitions.spawn(async move {
                let mut stop = std::pin::pin!(stop);
                let started = std::time::Instant::now();
                // The consumer: a pinned checker goes on from where its consumer had come; a
                // checker that has just taken the lease deletes and creates it again (the
                // previous owner's pulls end with it). NATS may be away: tried until it answers.
                let (mut c, mut resume) = loop {
                    if !ctx.fence.holds() {
                        std::future::pending::<()>().await;
                    }
                    let r = if pinned {
                        match crate::bus::ensure_consumer(&stream, &bus, k).await {
                            Ok(c) => Ok((c, None)),
                            Err(e) => Err(e),
                        }
                    } else {
                        crate::bus::take_over_consumer(&stream, &bus, k)
                            .await
                            .map(|(c, r)| (c, Some(r)))
                    };
                    match r {
                        Ok(done) => break done,
                        Err(e) => tracing::warn!(partition = k, error = %e, "consumer not opened; retrying"),
                    }
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_secs(1)) => {}
                        () = &mut stop => return Ok(()),
                    }
                };
                // Read again from before where the consumer had come (what was already fed is
                // recognised and skipped when tried again), the checker running meanwhile.
                let read = loop {
                    let attempt = async {
                        let r = match resume {
                            Some(r) => r,
                            None => crate::bus::resume_of(&c).await.map_err(|e| e.to_string())?,
                        };
                        resume = Some(r);
                        consumer::recover(&stream, r, subject.clone(), k, window, &tx, &ctx).await
                    };
                    tokio::select! {
                        r = attempt => match r {
                            Ok(read) => break read,
                            Err(e) => tracing::warn!(
                                partition = k, error = %e,
                                "reading the partition again failed; retrying"
                            ),
                        },
                        () = &mut stop => return Ok(()),
                    }
                    tokio::select! {
                        r = consumer::reopen(&stream, &bus, k, &ctx.fence) => if let Some(fresh) = r { c = fresh },
                        () = &mut stop => return Ok(()),
                    }
                };
                if read > 0 {
                    tracing::info!(
                        partition = k, messages = read, took = ?started.elapsed(),
                        "partition read again from {window:?} before where its consumer had come"
                    );
                }
                ctx.stats.recovering.fetch_sub(1, Relaxed);
                if recovering.fetch_sub(1, Relaxed) == 1 {
                    ready(&recovery);
                }
                let fence = ctx.fence.clone();
                consumer::run_partition(stream, bus, c, k, tx, ctx, &mut stop).await;
                if !fence.holds() {
                    // Lost: the ownership change that follows ends this generation.
                    std::future::pending::<()>().await;
                }
                Ok(())
            });
        }
        drop(tx);
        // Verdicts leave only while the fence holds: checked here, for each one, just before it
        // reaches the output.
        let (gtx, mut grx) = tokio::sync::mpsc::channel::<Violation>(self.channel_capacity.max(16));
        let filter = {
            let (fence, out, stats) = (
                own.fence.clone(),
                self.violations.clone(),
                self.lease_stats.clone(),
            );
            tokio::spawn(async move {
                while let Some(v) = grx.recv().await {
                    if !fence.holds() {
                        stats.fenced_verdicts.fetch_add(1, Relaxed);
                        continue;
                    }
                    if out.send(v).await.is_err() {
                        break;
                    }
                }
            })
        };
        let shared = &self.shared;
        let mut taps = super::kit::engine_taps(
            &shared.metrics,
            &shared.readiness,
            &shared.recent,
            &shared.timeline,
            &shared.memory,
        );
        if let Some(w) = &self.events_jsonl {
            taps.push(Box::new(w.clone()));
        }
        let engine = tokio::spawn(
            EngineTask {
                engine: crate::pipeline::Engine::new(&self.rules, &self.engine_config, self.shards),
                events: rx,
                violations: ViolationSender::new(gtx, shared.metrics.clone()),
                taps,
                lateness: self.lateness,
                pause_file: self.pause_file.clone(),
                clock: self.clock,
                upstream: Some(Arc::new(self.streams.clone())),
            }
            .run(shutdown.at(Phase::CloseEngine)),
        );
        Generation {
            epoch: own.epoch,
            partitions,
            engine,
            filter,
            fence: own.fence.clone(),
        }
    }
}
