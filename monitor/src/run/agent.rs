//! `revenant agent`: cluster mode's per-node process. `run`'s sources (eBPF, OTLP, both through
//! the normalize layer) and, for recorded events, `--replay FILE`; instead of the engine, the
//! bus: events batched per partition into the outbox on disk and published to JetStream
//! (`bus::publisher`). Its own admin server: `/metrics` (the agent's counters, drops included),
//! `/readyz` (not ready while NATS or the stream cannot be reached, saying why).
//!
//! Same order as `run`: prepare (every setting validated, nothing bound) → outbox (locked) →
//! bind → start admin, sources, batcher, publisher → ready → wait → drain (sources stop, what
//! they queued is batched, the outbox is published within the drain budget, the rest stays on
//! disk for the next start).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use super::bind::{Bound, bind};
use super::bus_args::BusArgs;
use super::kit::{self, RunError, announce_ready, force_exit_on_signal, serve_admin};
use super::shutdown::{self, Drain, Phase};
use super::start::start_sources;
use super::{RunArgs, coverage};
use crate::ingest::ebpf::HoldWindows;

use crate::bus::batcher::Batcher;
use crate::bus::publisher::{self, AgentStats};
use crate::bus::spool::Outbox;
use crate::bus::{BusConfig, BusConfigError};
use crate::ingest::replay;
use crate::pipeline::{EventSender, event_channel};
use crate::telemetry::{ComponentKind, console};

#[derive(Debug, clap::Args)]
pub struct AgentArgs {
    #[command(flatten, next_help_heading = "Cluster mode (NATS JetStream)")]
    pub bus: BusArgs,
    /// The agent's outbox bound: batches NATS has not acknowledged yet wait on disk up to this
    /// size, then new ones are dropped (counted) [default: 1GiB].
    #[arg(long, value_name = "SIZE", value_parser = crate::config::parse_size)]
    pub outbox_bytes: Option<u64>,
    /// Also publish the events of these recorded files (the replay format `revenant check`
    /// reads), in order, then keep running. Their `node` fields are kept as recorded.
    #[arg(long, value_name = "FILE")]
    pub replay: Vec<PathBuf>,
    /// Testing aid: live events' times are shifted this much later (a node clock that runs
    /// ahead, inside the skew bound).
    #[arg(long, hide = true, value_parser = humantime::parse_duration)]
    pub clock_offset: Option<Duration>,
    #[command(flatten)]
    pub run: RunArgs,
}

/// Why `agent` cannot start (exit 2).
#[derive(Debug, thiserror::Error)]
pub enum AgentConfigError {
    #[error(transparent)]
    Run(#[from] super::RunConfigError),
    #[error(transparent)]
    Bus(#[from] BusConfigError),
    #[error("--replay {path}: {source}")]
    Replay {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Outbox(#[from] crate::bus::spool::OutboxError),
}

pub fn run(args: AgentArgs) -> ExitCode {
    let log = args.run.log.clone();
    kit::serve(
        &log,
        || prepare(args),
        |a| agent_async(a.prepared, a.bus, a.outbox, a.replay, a.clock_offset),
    )
}

/// What `agent` starts from: every setting read and checked, the outbox locked, nothing bound.
struct AgentStart {
    prepared: super::Prepared,
    bus: BusConfig,
    outbox: Outbox,
    replay: Vec<PathBuf>,
    clock_offset: Duration,
}

fn prepare(args: AgentArgs) -> Result<AgentStart, AgentConfigError> {
    let prepared = super::prepare_for(&args.run, super::Role::Agent)?;
    let mut bus = prepared.cfg.bus.clone();
    args.bus.apply(&mut bus);
    if let Some(v) = args.outbox_bytes {
        bus.outbox_bytes = v;
    }
    bus.validate()?;
    for p in &args.replay {
        std::fs::File::open(p).map_err(|source| AgentConfigError::Replay {
            path: p.clone(),
            source,
        })?;
    }
    let outbox_dir = prepared.alert.spool.resolved_dir().join("bus-outbox");
    let (outbox, resumed) = Outbox::open(&outbox_dir, bus.outbox_bytes)?;
    if resumed.batches > 0 || resumed.corrupt > 0 {
        tracing::info!(
            batches = resumed.batches,
            corrupt = resumed.corrupt,
            dir = %outbox_dir.display(),
            "outbox resumed: publishing what the last run left"
        );
    }
    Ok(AgentStart {
        prepared,
        bus,
        outbox,
        replay: args.replay,
        clock_offset: args.clock_offset.unwrap_or_default(),
    })
}

/// Events per batch sent from a replayed file.
const REPLAY_BATCH: usize = 512;
/// Batches a replayed file may have queued for the batcher.
const REPLAY_QUEUE: usize = 8;

/// A reader that ends (reads as end of file) once `stop` is set.
struct Stoppable<'a, R> {
    inner: R,
    stop: &'a AtomicBool,
}

impl<R: std::io::Read> std::io::Read for Stoppable<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.stop.load(Relaxed) {
            return Ok(0);
        }
        self.inner.read(buf)
    }
}

impl<R: std::io::BufRead> std::io::BufRead for Stoppable<'_, R> {
    fn fill_buf(&mut self) -> std::io::Result<&[u8]> {
        if self.stop.load(Relaxed) {
            return Ok(&[]);
        }
        self.inner.fill_buf()
    }
    fn consume(&mut self, n: usize) {
        self.inner.consume(n);
    }
}

/// Reads the recorded files and sends their events into the pipeline in batches as they are
/// read (waiting on it: a file can wait), until `stop` is set. Blocking: run off the runtime.
fn replay_files(paths: Vec<PathBuf>, tx: EventSender, stop: &AtomicBool) -> Result<(), String> {
    for p in paths {
        let f = std::fs::File::open(&p).map_err(|e| format!("--replay {}: {e}", p.display()))?;
        let input = Stoppable {
            inner: std::io::BufReader::with_capacity(1 << 16, f),
            stop,
        };
        let (mut events, mut bad, mut closed) = (0u64, 0u64, false);
        let mut batch = Vec::with_capacity(REPLAY_BATCH);
        replay::read_events(
            input,
            |e| {
                if closed {
                    return;
                }
                events += 1;
                batch.push(e);
                if batch.len() == REPLAY_BATCH {
                    let full = std::mem::replace(&mut batch, Vec::with_capacity(REPLAY_BATCH));
                    closed = tx.blocking_send(full).is_err();
                }
            },
            |_| bad += 1,
        )
        .map_err(|e| format!("--replay {}: {e}", p.display()))?;
        if !batch.is_empty() && !closed {
            closed = tx.blocking_send(batch).is_err();
        }
        if bad > 0 {
            tracing::warn!(file = %p.display(), bad_lines = bad, "replay: bad lines skipped");
        }
        if closed || stop.load(Relaxed) {
            return Ok(());
        }
        tracing::info!(file = %p.display(), events, "replay: file sent");
    }
    Ok(())
}

async fn agent_async(
    p: super::Prepared,
    bus: BusConfig,
    outbox: Outbox,
    replay_paths: Vec<PathBuf>,
    clock_offset: Duration,
) -> Result<(), RunError> {
    let super::Prepared {
        cfg,
        memory,
        normalizer,
        admin,
        access,
        ready_file,
        given,
        ..
    } = p;
    let (shutdown, shared) = kit::begin(&admin, &memory, access);
    let stats = Arc::new(AgentStats::default());
    publisher::register(&shared.metrics, stats.clone());
    if let Some(path) = &ready_file {
        let tmp = path.with_extension("tmp");
        std::fs::File::create(&tmp)
            .and_then(|_| std::fs::remove_file(&tmp))
            .map_err(|source| RunError::ReadyFile {
                path: path.clone(),
                source,
            })?;
    }
    let mut b: Bound = bind(
        &cfg,
        &given,
        super::Role::Agent,
        &admin,
        &shared,
        &shutdown,
        HoldWindows::default(),
    )
    .await?;
    let mut bound = serde_json::Map::new();
    let admin_task = b.admin.take().map(|server| {
        bound.insert("admin".into(), server.local_addr().to_string().into());
        if let Some(m) = server.metrics_addr() {
            bound.insert("metrics".into(), m.to_string().into());
        }
        serve_admin(server, &shared, &shutdown)
    });
    let client = crate::bus::connect(&bus, &format!("revenant-agent {}", cfg.node_name()))
        .await
        .map_err(|e| RunError::Receiver(e.to_string()))?;
    bound.insert("nats".into(), bus.nats.clone().unwrap_or_default().into());
    bound.insert("stream".into(), bus.stream.clone().into());
    bound.insert("partitions".into(), bus.partitions.into());

    let (tx, rx) = event_channel(cfg.channel_capacity());
    // A file can wait: a short queue keeps the reader's batches few (and their memory reused).
    let (replay_tx, replay_rx) = event_channel(REPLAY_QUEUE);
    let mut sources = start_sources(&cfg, normalizer, b, tx, &shared, &shutdown, bound);
    if let Some(why) = sources.blind.take()
        && replay_paths.is_empty()
    {
        coverage::no_source(&shared.readiness, why);
    }
    let mut replay_task = None;
    if !replay_paths.is_empty() {
        let h = shared.readiness.register("replay", ComponentKind::Source);
        h.ready();
        let stop = shutdown.at(Phase::StopSources);
        replay_task = Some(tokio::spawn(async move {
            let stopped = Arc::new(AtomicBool::new(false));
            let reader = tokio::task::spawn_blocking({
                let stopped = stopped.clone();
                move || replay_files(replay_paths, replay_tx, &stopped)
            });
            tokio::select! {
                r = reader => r.map_err(|e| e.to_string())?,
                () = stop => {
                    // The reader sees it within one read and drops its sender.
                    stopped.store(true, Relaxed);
                    Ok(())
                }
            }
        }));
    }
    let replay_rx = replay_task.is_some().then_some(replay_rx);
    let boot = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let node = cfg.node_name();
    let batcher = Batcher::new(
        node.clone(),
        boot,
        bus.stream.clone(),
        bus.partitions,
        bus.batch_events,
        bus.batch_linger,
    );
    let pubshared = publisher::Shared {
        outbox: Arc::new(Mutex::new(outbox)),
        wake: Arc::new(Notify::new()),
        stats: stats.clone(),
        metrics: shared.metrics.clone(),
    };
    let batch_task = tokio::spawn(publisher::run_batcher(
        rx,
        replay_rx,
        batcher,
        pubshared.clone(),
        bus.batch_linger,
        publisher::Live {
            node: node.as_str().into(),
            shift_ns: clock_offset.as_nanos() as u64,
            memory: shared.memory.clone(),
        },
    ));
    let done = Arc::new(Notify::new());
    let publish_task = tokio::spawn(publisher::run_publisher(
        client,
        bus.clone(),
        pubshared,
        shared.readiness.clone(),
        done.clone(),
        cfg.drain_timeout(),
    ));
    announce_ready(&sources.bound, ready_file.as_ref())?;
    let failure = tokio::select! {
        _ = shutdown::signal() => {
            tracing::info!("shutting down: publishing what is queued (a second signal exits at once)");
            None
        }
        e = shutdown::first_failure(&mut sources.receivers) => Some(e),
    };
    tokio::spawn(force_exit_on_signal());

    let drain = Drain::start(cfg.drain_timeout());
    shutdown.advance(Phase::StopSources);
    let grace = drain.source_grace();
    shutdown::join_within(
        &mut sources.receivers,
        grace,
        "shutdown: a receiver still had open connections; closing them",
    )
    .await;
    shutdown::join_within(
        &mut sources.ebpf,
        grace,
        "shutdown: the eBPF source did not stop in time",
    )
    .await;
    let _ = sources.ticker.await;
    if let Some(t) = replay_task {
        let _ = t.await;
    }
    let _ = tokio::time::timeout(drain.remaining(), sources.ingest.flush()).await;
    drop(sources.ingest);
    // Every sender is gone: the batcher seals what is open and ends.
    let _ = tokio::time::timeout(drain.remaining(), batch_task).await;
    done.notify_one();
    let report = publish_task.await.unwrap_or_default();
    shutdown.advance(Phase::StopAdmin);
    if let Some(t) = admin_task {
        let _ = tokio::time::timeout(Duration::from_secs(2), t).await;
    }
    let s = &stats;
    let human = format!(
        "stopped after {:?}: {} events routed, {} batches published, {} events dropped, {} batches left in the outbox",
        drain.elapsed(),
        s.events_in.load(Relaxed),
        s.batches_published.load(Relaxed),
        s.events_dropped.load(Relaxed),
        report.left,
    );
    let mut fields = serde_json::Map::new();
    fields.insert("events_routed".into(), s.events_in.load(Relaxed).into());
    fields.insert(
        "batches_published".into(),
        s.batches_published.load(Relaxed).into(),
    );
    fields.insert(
        "events_dropped".into(),
        s.events_dropped.load(Relaxed).into(),
    );
    fields.insert("outbox_left".into(), report.left.into());
    console::say(console::Level::Info, &human, "stopped", fields);
    match failure {
        Some(e) => Err(RunError::Receiver(e)),
        None => Ok(()),
    }
}
