//! `revenant run`: the all-in-one pipeline on one node.
//!
//! Fixed order (linkerd2-proxy style): load and validate every config (no port bound, no probe
//! loaded) → bind the admin server and the OTLP receivers → load the eBPF probes (per `--ebpf`) →
//! start the alert dispatcher (resuming its spool) → spawn sources and the checker → announce
//! readiness → wait for Ctrl-C / SIGTERM → stop the sources, drain the channel through the
//! checker, drain the dispatcher, each with a timeout → exit.
//! Exit codes: 0 clean, 1 runtime failure, 2 usage/config error.
//!
//! ```text
//! OTLP gRPC ─┐
//! OTLP HTTP ─┼─► normalize ─► bounded mpsc<EventBatch> ─► checker.observe / tick ─► alert dispatcher
//! eBPF ──────┘                                              │                        (dedup, spool,
//!                                                           │                         webhook, Alertmanager,
//!                                                           │                         JSONL)
//!                                                           ├─► /api/requests timeline, /metrics
//!                                                           └─► optional events JSONL (replay format)
//! ```

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Deserialize;
use tokio::sync::{mpsc, watch};

use crate::telemetry::events::{AbsoluteDrops, EventObserved};
use crate::admin::{
    AdminArgs, AdminServer, AdminState, ComponentKind, DropPoint, LogArgs, Metrics, Readiness,
    ReadyHandle, RecentEvents, RecentEventsLimits, RecentViolations,
};
use crate::alert::{AlertArgs, AlertConfig, AlertPipeline, JsonlConfig};
use crate::engine::check::{Checker, CheckerConfig, RuleSet};
use crate::event::Source;
use crate::ingest::ebpf::{EbpfArgs, EbpfStart, EbpfStats};
use crate::ingest::otlp::{self, Ingest, OtlpConfig, OtlpStats};
use crate::normalize::{NormalizeConfig, Normalizer};
use crate::pipeline::EventBatch;
use crate::ingest::replay::ReplayRecord;

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// YAML config file (see `RunConfig`); flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// OTLP/gRPC listen address (`off` disables) [default: 127.0.0.1:4317].
    #[arg(long, value_name = "ADDR")]
    pub otlp_grpc: Option<String>,
    /// OTLP/HTTP listen address (`off` disables) [default: 127.0.0.1:4318].
    #[arg(long, value_name = "ADDR")]
    pub otlp_http: Option<String>,
    /// Also record every normalized event, in the replay format `revenant check` reads.
    #[arg(long, value_name = "PATH")]
    pub events_jsonl: Option<PathBuf>,
    /// Rules file extending or overriding the embedded defaults.
    #[arg(long)]
    pub rules: Option<PathBuf>,
    /// Bounded channel between sources and checker, in batches.
    #[arg(long)]
    pub channel_capacity: Option<usize>,
    /// Largest OTLP request body in bytes.
    #[arg(long)]
    pub max_message_bytes: Option<usize>,
    /// Events from different nodes count as later only beyond this skew.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub clock_skew: Option<Duration>,
    /// How late (after its event time) an event may arrive and still count for deadline rules.
    /// OTLP exporters batch for seconds, and SGLang root completions wait out their grace.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub allowed_lateness: Option<Duration>,
    /// How long shutdown may take to drain queued events through the checker.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub drain_timeout: Option<Duration>,
    /// Write the bound addresses as JSON here once every receiver listens (readiness latch for
    /// scripts and tests that bind port 0).
    #[arg(long, value_name = "PATH")]
    pub ready_file: Option<PathBuf>,
    /// Testing aid: the checker stops taking batches while this file exists (saturates the
    /// pipeline on purpose to exercise back-pressure).
    #[arg(long, hide = true)]
    pub pause_file: Option<PathBuf>,
    #[command(flatten)]
    pub ebpf: EbpfArgs,
    #[command(flatten)]
    pub admin: AdminArgs,
    #[command(flatten)]
    pub alert: AlertArgs,
    #[command(flatten)]
    pub log: LogArgs,
}

/// The config file. Unknown keys are errors: a typo never silently keeps a default.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    #[serde(default)]
    pub otlp: OtlpConfig,
    #[serde(default)]
    pub normalize: NormalizeConfig,
    #[serde(default = "default_capacity")]
    pub channel_capacity: usize,
    #[serde(default = "default_skew", with = "crate::normalize::serde_duration")]
    pub clock_skew: Duration,
    #[serde(
        default = "default_lateness",
        with = "crate::normalize::serde_duration"
    )]
    pub allowed_lateness: Duration,
    #[serde(default = "default_drain", with = "crate::normalize::serde_duration")]
    pub drain_timeout: Duration,
    #[serde(default)]
    pub rules: Option<PathBuf>,
    #[serde(default)]
    pub events_jsonl: Option<PathBuf>,
}

fn default_capacity() -> usize {
    1024
}
fn default_skew() -> Duration {
    Duration::from_millis(50)
}
fn default_lateness() -> Duration {
    // Python's BatchSpanProcessor flushes every 5 s; SGLang root completions wait 5 s more.
    Duration::from_secs(15)
}
fn default_drain() -> Duration {
    Duration::from_secs(10)
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            otlp: OtlpConfig::default(),
            normalize: NormalizeConfig::default(),
            channel_capacity: default_capacity(),
            clock_skew: default_skew(),
            allowed_lateness: default_lateness(),
            drain_timeout: default_drain(),
            rules: None,
            events_jsonl: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RunConfigError {
    #[error("reading config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config {path}: {msg}")]
    Parse { path: PathBuf, msg: String },
    #[error("--{flag}: {value:?} is not an address (HOST:PORT or `off`)")]
    Addr { flag: &'static str, value: String },
    #[error(transparent)]
    Otlp(#[from] otlp::config::OtlpConfigError),
    #[error("normalize: {0}")]
    Normalize(#[from] crate::normalize::ConfigError),
    #[error("rules: {0}")]
    Rules(#[from] crate::engine::check::RulesError),
    #[error("checker: {0}")]
    Checker(#[from] crate::engine::check::ConfigError),
    #[error("channel_capacity must be > 0")]
    Capacity,
    #[error("alerting: {0}")]
    Alert(#[from] crate::alert::AlertError),
    #[error("admin: {0}")]
    Admin(String),
    #[error("eBPF: {0}")]
    Ebpf(#[from] crate::ingest::ebpf::LoadError),
}

fn parse_addr(flag: &'static str, v: &str) -> Result<Option<SocketAddr>, RunConfigError> {
    if v.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    v.parse().map(Some).map_err(|_| RunConfigError::Addr {
        flag,
        value: v.to_owned(),
    })
}

/// Everything validated and built, no port bound yet.
pub struct Prepared {
    pub cfg: RunConfig,
    pub normalizer: Normalizer,
    pub checker: Checker,
    pub alert: AlertConfig,
    pub admin: AdminArgs,
    pub ebpf: EbpfArgs,
}

pub fn load_config(path: Option<&Path>) -> Result<RunConfig, RunConfigError> {
    let Some(path) = path else {
        return Ok(RunConfig::default());
    };
    let text = std::fs::read_to_string(path).map_err(|source| RunConfigError::Read {
        path: path.into(),
        source,
    })?;
    serde_saphyr::from_str(&text).map_err(|e| RunConfigError::Parse {
        path: path.into(),
        msg: e.to_string(),
    })
}

pub fn prepare(args: &RunArgs) -> Result<Prepared, RunConfigError> {
    let mut cfg = load_config(args.config.as_deref())?;
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
        cfg.channel_capacity = v;
    }
    if let Some(v) = args.clock_skew {
        cfg.clock_skew = v;
    }
    if let Some(v) = args.allowed_lateness {
        cfg.allowed_lateness = v;
    }
    if let Some(v) = args.drain_timeout {
        cfg.drain_timeout = v;
    }
    if args.rules.is_some() {
        cfg.rules = args.rules.clone();
    }
    if args.events_jsonl.is_some() {
        cfg.events_jsonl = args.events_jsonl.clone();
    }
    cfg.otlp.validate()?;
    if cfg.channel_capacity == 0 {
        return Err(RunConfigError::Capacity);
    }
    let normalizer = Normalizer::new(&cfg.normalize)?;
    let rules = match &cfg.rules {
        Some(p) => RuleSet::from_file(p)?,
        None => RuleSet::embedded_defaults(),
    };
    let ccfg = CheckerConfig {
        clock_skew: cfg.clock_skew,
        allowed_lateness: cfg.allowed_lateness,
        ..CheckerConfig::default()
    };
    ccfg.validate()?;
    args.admin.validate().map_err(RunConfigError::Admin)?;
    // Links in alerts default to the admin server's bound address, known only after binding
    // (`--admin 127.0.0.1:0`): filled in by `run_async`.
    let mut alert = args.alert.to_config(None)?;
    if alert.webhooks.is_empty() && alert.alertmanagers.is_empty() && alert.jsonl.is_none() {
        // An alert nobody can see is a silent loss: without any sink, alerts go to stdout.
        alert.jsonl = Some(JsonlConfig { path: "-".into() });
    }
    // Only the sizes are checked here: loading the probes happens once the ports are bound.
    args.ebpf.config(None)?;
    Ok(Prepared {
        checker: Checker::new(rules, ccfg),
        normalizer,
        cfg,
        alert,
        admin: args.admin.clone(),
        ebpf: args.ebpf.clone(),
    })
}

fn wall_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

fn open_append(p: &Path) -> std::io::Result<Box<dyn Write + Send>> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(p)?;
    Ok(Box::new(std::io::BufWriter::with_capacity(1 << 16, f)))
}

/// Counts of the checker task, reported at shutdown.
#[derive(Debug, Default, Clone, Copy)]
pub struct CheckerTotals {
    pub batches: u64,
    pub events: u64,
    pub violations: u64,
}

/// Where the checker loop sends what it produces.
struct CheckerOutputs {
    alerts: mpsc::Sender<crate::violation::Violation>,
    metrics: Arc<Metrics>,
    timeline: Arc<RecentEvents>,
    events: Option<Box<dyn Write + Send>>,
    otlp_ready: Option<ReadyHandle>,
    ebpf_ready: Option<ReadyHandle>,
}

impl CheckerOutputs {
    fn violation(&self, v: crate::violation::Violation, totals: &mut CheckerTotals) {
        totals.violations += 1;
        crate::alert::offer(&self.alerts, v, &self.metrics);
    }

    /// A source that delivers counts as live in /readyz.
    fn activity(&self, batch: &EventBatch) {
        let (mut otlp, mut ebpf) = (false, false);
        for e in batch {
            match e.source {
                Source::Otlp => otlp = true,
                Source::Ebpf => ebpf = true,
                Source::Replay => {}
            }
        }
        if otlp && let Some(h) = &self.otlp_ready {
            h.activity();
        }
        if ebpf && let Some(h) = &self.ebpf_ready {
            h.activity();
        }
    }
}

/// The checker loop: batches in, violations to the alert dispatcher; ticks once a second on wall
/// time so deadline rules fire without traffic. Returns when every sender is gone and the channel
/// is empty; dropping `out` then closes the dispatcher's input.
async fn checker_task(
    mut checker: Checker,
    mut rx: mpsc::Receiver<EventBatch>,
    mut out: CheckerOutputs,
    pause_file: Option<PathBuf>,
    mut close: watch::Receiver<bool>,
    lateness: Duration,
) -> std::io::Result<CheckerTotals> {
    let mut totals = CheckerTotals::default();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut line = Vec::with_capacity(512);
    loop {
        if let Some(p) = &pause_file
            && p.exists()
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        let batch = tokio::select! {
            // Shutdown: refuse new batches (senders see "closed" and answer UNAVAILABLE), keep
            // draining what is already queued until recv returns None.
            r = close.wait_for(|v| *v), if !*close.borrow() => {
                drop(r);
                rx.close();
                continue;
            }
            b = rx.recv() => match b {
                Some(b) => b,
                None => break,
            },
            _ = tick.tick() => {
                let now = wall_ns();
                for v in checker.tick(now) {
                    out.violation(v, &mut totals);
                }
                out.metrics.publish_checker(&checker, now);
                if let Some(w) = out.events.as_mut() { w.flush()?; }
                continue;
            }
        };
        totals.batches += 1;
        let arrival_ns = wall_ns();
        let span = tracing::info_span!("checker.batch", events = batch.len());
        let _entered = span.enter();
        out.timeline.record(&batch);
        out.activity(&batch);
        for e in &batch {
            totals.events += 1;
            EventObserved {
                event: e,
                arrival_ns,
            }
            .emit(&out.metrics);
            if let Some(w) = out.events.as_mut() {
                line.clear();
                serde_json::to_writer(&mut line, &ReplayRecord::from_event(e))?;
                line.push(b'\n');
                w.write_all(&line)?;
            }
            for v in checker.observe(e) {
                out.violation(v, &mut totals);
            }
        }
    }
    // Nothing more will arrive: move the watermark past the lateness window so that every
    // deadline the received events can still prove is judged.
    let now = wall_ns();
    let end = checker
        .stats()
        .max_event_ns
        .max(now)
        .saturating_add(lateness.as_nanos() as u64);
    for v in checker.tick(end) {
        out.violation(v, &mut totals);
    }
    out.metrics.publish_checker(&checker, now);
    if let Some(w) = out.events.as_mut() {
        w.flush()?;
    }
    Ok(totals)
}

/// Turns the eBPF source's absolute loss counters into the shared drop metric, once a second, so
/// that `revenant_dropped_items_total` (and the "blind" alert on it) covers the kernel side too.
async fn publish_ebpf_drops(
    stats: Arc<EbpfStats>,
    metrics: Arc<Metrics>,
    readiness: Readiness,
    mut stop: watch::Receiver<bool>,
) {
    use monitor_common::counter;
    use std::sync::atomic::Ordering::Relaxed;
    let ringbuf = AbsoluteDrops::default();
    let active = AbsoluteDrops::default();
    let socks = AbsoluteDrops::default();
    let channel = AbsoluteDrops::default();
    let undecodable = AbsoluteDrops::default();
    let evicted = AbsoluteDrops::default();
    let mut degraded = false;
    let mut iv = tokio::time::interval(Duration::from_secs(1));
    loop {
        let stopping = tokio::select! {
            _ = iv.tick() => false,
            r = stop.wait_for(|v| *v) => { drop(r); true }
        };
        let m = &metrics;
        ringbuf.observe_total(
            m,
            DropPoint::KernelRingbuf,
            "full",
            stats.kernel(counter::RINGBUF_DROPS),
        );
        active.observe_total(
            m,
            DropPoint::KernelRingbuf,
            "syscall_table_full",
            stats.kernel(counter::ACTIVE_FULL),
        );
        socks.observe_total(
            m,
            DropPoint::KernelRingbuf,
            "socket_table_full",
            stats.kernel(counter::SOCKS_FULL),
        );
        channel.observe_total(
            m,
            DropPoint::EventChannel,
            "full",
            stats.events_dropped.load(Relaxed),
        );
        undecodable.observe_total(
            m,
            DropPoint::EbpfTracker,
            "undecodable",
            stats.decode_errors.load(Relaxed),
        );
        evicted.observe_total(
            m,
            DropPoint::EbpfTracker,
            "connection_evicted",
            stats.conns_evicted.load(Relaxed),
        );
        let now_degraded = stats.coverage_degraded();
        if now_degraded != degraded {
            degraded = now_degraded;
            if degraded {
                let losses = stats.losses();
                tracing::warn!(
                    losses,
                    "eBPF coverage DEGRADED: kernel capture lost data; verdicts may miss activity"
                );
                readiness.set_degraded(
                    "ebpf",
                    Some(format!(
                        "kernel capture lost data ({losses} records/events so far): verdicts may miss activity"
                    )),
                );
            } else {
                tracing::info!("eBPF coverage restored");
                readiness.set_degraded("ebpf", None);
            }
        }
        if stopping {
            break;
        }
    }
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(
            tokio::signal::unix::SignalKind::terminate(),
        ) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops revenant");
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}

pub fn run(args: RunArgs) -> ExitCode {
    let self_traces = match args.log.init() {
        Ok(g) => g,
        Err(e) => {
            eprintln!("revenant: {e}");
            return ExitCode::from(2);
        }
    };
    let code = run_logged(args);
    if let Some(t) = self_traces {
        t.shutdown();
    }
    code
}

fn run_logged(args: RunArgs) -> ExitCode {
    let prepared = match prepare(&args) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("revenant: {e}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("revenant: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(run_async(prepared, args.ready_file, args.pause_file)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("revenant: {e}");
            match e {
                // A required source or sink that cannot start is a configuration problem.
                RunError::Ebpf(_) | RunError::Alert(_) | RunError::Bind { .. } => ExitCode::from(2),
                _ => ExitCode::from(1),
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("binding {what} on {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("opening {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("writing readiness file: {0}")]
    Ready(std::io::Error),
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
}

/// How the eBPF source ended up, for the log, /readyz and the ready file.
fn ebpf_state(start: &EbpfStart) -> &'static str {
    match start {
        EbpfStart::Live(_) => "live",
        EbpfStart::Off => "off",
        EbpfStart::Unavailable(_) => "unavailable",
    }
}

pub async fn run_async(
    p: Prepared,
    ready_file: Option<PathBuf>,
    pause_file: Option<PathBuf>,
) -> Result<(), RunError> {
    let cfg = p.cfg;
    let mut alert_cfg = p.alert;
    let metrics = Arc::new(Metrics::new());
    let readiness = Readiness::new(metrics.clone(), p.admin.source_live_window);
    let recent = Arc::new(RecentViolations::new(p.admin.recent_violations));
    let timeline = Arc::new(RecentEvents::new(RecentEventsLimits {
        max_events: p.admin.timeline_events,
        ..Default::default()
    }));
    let events = match &cfg.events_jsonl {
        Some(path) => Some(open_append(path).map_err(|source| RunError::Open {
            path: path.clone(),
            source,
        })?),
        None => None,
    };
    let bind = |what: &'static str, addr: SocketAddr| async move {
        tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| RunError::Bind { what, addr, source })
    };
    let admin = match p.admin.no_admin {
        true => None,
        false => Some(
            AdminServer::bind(p.admin.admin)
                .await
                .map_err(|e| match e {
                    crate::admin::AdminError::Bind { addr, source } => RunError::Bind {
                        what: "admin",
                        addr,
                        source,
                    },
                    other => RunError::Receiver(other.to_string()),
                })?,
        ),
    };
    let grpc_l = match cfg.otlp.grpc {
        Some(a) => Some(bind("otlp-grpc", a).await?),
        None => None,
    };
    let http_l = match cfg.otlp.http {
        Some(a) => Some(bind("otlp-http", a).await?),
        None => None,
    };
    let ebpf = p
        .ebpf
        .start(Some(alert_cfg.node_name()))
        .map_err(RunError::Ebpf)?;

    let (tx, rx) = mpsc::channel::<EventBatch>(cfg.channel_capacity);
    let stats = Arc::new(OtlpStats::default());
    metrics.attach_otlp(stats.clone());
    let otlp_on = grpc_l.is_some() || http_l.is_some();
    let otlp_ready = otlp_on.then(|| {
        metrics.declare_source(Source::Otlp);
        readiness.register("otlp", ComponentKind::Source)
    });
    let ingest = Arc::new(Ingest::new(
        tx.clone(),
        p.normalizer,
        stats.clone(),
        cfg.otlp.max_items_per_request,
    ));
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|v| *v).await;
    };

    let mut bound = serde_json::Map::new();
    // The admin server outlives the sources: scrapes during the drain still answer.
    let (admin_stop_tx, admin_stop_rx) = watch::channel(false);
    let admin_task = match admin {
        Some(server) => {
            bound.insert("admin".into(), server.local_addr().to_string().into());
            if alert_cfg.external_url.is_none() {
                alert_cfg.external_url = Some(format!("http://{}", server.local_addr()));
            }
            let state = AdminState {
                metrics: metrics.clone(),
                readiness: readiness.clone(),
                violations: recent.clone(),
                timeline: timeline.clone(),
            };
            let handle = readiness.register("admin", ComponentKind::Server);
            let task = tokio::spawn(server.serve(state, stopped(admin_stop_rx)));
            handle.ready();
            Some(task)
        }
        None => None,
    };

    let alerts = AlertPipeline::start(
        &alert_cfg,
        metrics.clone(),
        Some(&readiness),
        Some(recent.clone()),
    )
    .map_err(RunError::Alert)?;
    let alert_handle = alerts.handle;
    tracing::info!(spool = %alerts.spool_dir.display(), "alert dispatcher started");

    let ebpf_state = ebpf_state(&ebpf);
    bound.insert("ebpf".into(), ebpf_state.into());
    let mut ebpf_tasks = Vec::new();
    let ebpf_ready = match ebpf {
        EbpfStart::Live(src) => {
            metrics.declare_source(Source::Ebpf);
            metrics.attach_ebpf(src.stats());
            let handle = readiness.register("ebpf", ComponentKind::Source);
            ebpf_tasks.push(tokio::spawn(publish_ebpf_drops(
                src.stats(),
                metrics.clone(),
                readiness.clone(),
                stop_rx.clone(),
            )));
            let (txe, stop) = (tx.clone(), stopped(stop_rx.clone()));
            ebpf_tasks.push(tokio::spawn(async move {
                if let Err(e) = src.run(txe, stop).await {
                    tracing::error!(error = %e, "eBPF source stopped: kernel capture is BLIND from now on");
                }
            }));
            handle.ready();
            Some(handle)
        }
        EbpfStart::Off => {
            readiness.disabled("ebpf", "off (--ebpf off)");
            None
        }
        EbpfStart::Unavailable(e) => {
            readiness.disabled("ebpf", &format!("unavailable: {e}"));
            None
        }
    };
    if !otlp_on {
        readiness.disabled("otlp", "off (--otlp-grpc off --otlp-http off)");
    }
    // Only the sources hold senders now: the channel closes once they all stopped.
    drop(tx);

    let (close_tx, close_rx) = watch::channel(false);
    let checker = tokio::spawn(checker_task(
        p.checker,
        rx,
        CheckerOutputs {
            alerts: alerts.sender,
            metrics: metrics.clone(),
            timeline: timeline.clone(),
            events,
            otlp_ready: otlp_ready.clone(),
            ebpf_ready,
        },
        pause_file,
        close_rx,
        cfg.allowed_lateness,
    ));

    let mut servers = Vec::new();
    if let Some(l) = grpc_l {
        let addr = l.local_addr().map_err(|source| RunError::Bind {
            what: "otlp-grpc",
            addr: cfg.otlp.grpc.unwrap_or(([0, 0, 0, 0], 0).into()),
            source,
        })?;
        bound.insert("otlp_grpc".into(), addr.to_string().into());
        let (ing, max, stop) = (
            ingest.clone(),
            cfg.otlp.max_message_bytes,
            stopped(stop_rx.clone()),
        );
        servers.push(tokio::spawn(async move {
            otlp::grpc::serve(l, ing, max, stop)
                .await
                .map_err(|e| e.to_string())
        }));
        tracing::info!(%addr, "otlp/grpc listening");
    }
    if let Some(l) = http_l {
        let addr = l.local_addr().map_err(|source| RunError::Bind {
            what: "otlp-http",
            addr: cfg.otlp.http.unwrap_or(([0, 0, 0, 0], 0).into()),
            source,
        })?;
        bound.insert("otlp_http".into(), addr.to_string().into());
        let (ing, max, maxd, stop) = (
            ingest.clone(),
            cfg.otlp.max_message_bytes,
            cfg.otlp.max_decompressed_bytes,
            stopped(stop_rx.clone()),
        );
        servers.push(tokio::spawn(async move {
            otlp::http::serve(l, ing, max, maxd, stop)
                .await
                .map_err(|e| e.to_string())
        }));
        tracing::info!(%addr, "otlp/http listening");
    }
    if let Some(h) = &otlp_ready {
        h.ready();
    }
    let ticker = {
        let ing = ingest.clone();
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            let mut iv = tokio::time::interval(Duration::from_secs(1));
            loop {
                let stopping = tokio::select! {
                    _ = iv.tick() => false,
                    r = stop.wait_for(|v| *v) => { drop(r); true }
                };
                if stopping {
                    break;
                }
                ing.tick().await;
            }
        })
    };
    // Kept only for the shutdown accounting; the receivers hold their own handles.
    let ingest_for_shutdown = ingest;

    tracing::info!(
        otlp = if otlp_on { "live" } else { "off" },
        ebpf = ebpf_state,
        "sources"
    );
    if !otlp_on && ebpf_state != "live" {
        tracing::warn!("no source is live: revenant sees nothing (enable OTLP or eBPF)");
    }
    let ready = serde_json::Value::Object(bound);
    eprintln!("revenant: ready {ready}");
    if let Some(path) = &ready_file {
        // Write then rename: a reader never sees a half-written file.
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, ready.to_string())
            .and_then(|_| std::fs::rename(&tmp, path))
            .map_err(RunError::Ready)?;
    }

    // Run until a signal, or until a receiver dies.
    let mut failure = None;
    tokio::select! {
        _ = shutdown_signal() => tracing::info!("shutting down: draining"),
        r = futures_first(&mut servers) => failure = Some(r),
    }
    let started = Instant::now();
    let _ = stop_tx.send(true);
    // Receivers get half the drain budget to finish in-flight requests; a client that keeps its
    // connection open past that is cut off (its unacknowledged export will be retried by it).
    let server_grace = cfg.drain_timeout / 2;
    for mut s in servers {
        match tokio::time::timeout(server_grace, &mut s).await {
            Ok(Ok(Err(e))) => {
                failure.get_or_insert(e);
            }
            Ok(Err(e)) => {
                failure.get_or_insert(e.to_string());
            }
            Ok(Ok(Ok(()))) => {}
            Err(_) => {
                tracing::warn!(grace = ?server_grace, "shutdown: a receiver still had open connections; closing them");
                s.abort();
            }
        }
    }
    // The eBPF source sends what its ring still holds before it returns.
    for mut t in ebpf_tasks {
        if tokio::time::timeout(server_grace, &mut t).await.is_err() {
            tracing::warn!("shutdown: the eBPF source did not stop in time");
            t.abort();
        }
    }
    let _ = ticker.await;
    // The receivers are closed, so no abort can arrive any more: the completions still waiting
    // out their grace period are now believed.
    let budget = cfg.drain_timeout.saturating_sub(started.elapsed());
    match tokio::time::timeout(budget, ingest_for_shutdown.flush()).await {
        Ok(0) => {}
        Ok(n) => tracing::info!(count = n, "shutdown: released deferred SGLang completions"),
        Err(_) => return Err(RunError::DrainTimeout(cfg.drain_timeout)),
    }
    drop(ingest_for_shutdown);
    let _ = close_tx.send(true);
    let remaining = cfg
        .drain_timeout
        .saturating_sub(started.elapsed())
        .max(Duration::from_millis(100));
    let totals = match tokio::time::timeout(remaining, checker).await {
        Err(_) => return Err(RunError::DrainTimeout(cfg.drain_timeout)),
        Ok(Err(e)) => return Err(RunError::Receiver(format!("checker task: {e}"))),
        Ok(Ok(r)) => r.map_err(RunError::Output)?,
    };
    // The checker dropped the dispatcher's sender: it delivers what is queued (bounded by its
    // own drain timeout) and leaves the rest in the spool for the next start.
    let report = match alert_handle.await {
        Ok(r) => r,
        Err(e) => return Err(RunError::Receiver(format!("alert dispatcher: {e}"))),
    };
    let _ = admin_stop_tx.send(true);
    if let Some(t) = admin_task {
        let _ = tokio::time::timeout(Duration::from_secs(2), t).await;
    }
    eprintln!(
        "revenant: stopped after draining in {:?}: {} batches, {} events checked, {} violations; \
         alerts: {} incidents, {} findings merged, {} repeats, {} notifications, {} findings rate-limited, \
         {} dropped by the spool, {} left in the spool",
        started.elapsed(),
        totals.batches,
        totals.events,
        totals.violations,
        report.incidents,
        report.merged,
        report.deduplicated,
        report.notified,
        report.rate_limited,
        report.spool_dropped,
        report.undelivered_at_exit,
    );
    eprint!("{}", stats.render());
    match failure {
        Some(e) => Err(RunError::Receiver(e)),
        None => Ok(()),
    }
}

/// Resolves with the error of the first server task that ends (a server only ends early on
/// failure); pending forever when there is none.
async fn futures_first(servers: &mut [tokio::task::JoinHandle<Result<(), String>>]) -> String {
    if servers.is_empty() {
        return std::future::pending().await;
    }
    let (res, _, _) = futures_select_all(servers).await;
    match res {
        Ok(Ok(())) => "receiver stopped unexpectedly".into(),
        Ok(Err(e)) => e,
        Err(e) => e.to_string(),
    }
}

async fn futures_select_all(
    servers: &mut [tokio::task::JoinHandle<Result<(), String>>],
) -> (
    Result<Result<(), String>, tokio::task::JoinError>,
    usize,
    (),
) {
    std::future::poll_fn(|cx| {
        for (i, s) in servers.iter_mut().enumerate() {
            if let std::task::Poll::Ready(r) = std::pin::Pin::new(s).poll(cx) {
                return std::task::Poll::Ready((r, i, ()));
            }
        }
        std::task::Poll::Pending
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        run: RunArgs,
    }

    fn args(config: Option<PathBuf>) -> RunArgs {
        use clap::Parser;
        let mut argv = vec!["revenant".to_string()];
        if let Some(c) = config {
            argv.push("--config".into());
            argv.push(c.display().to_string());
        }
        Cli::try_parse_from(argv).unwrap().run
    }

    fn write(name: &str, text: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!(
            "revenant-run-cfg-{}-{name}.yaml",
            std::process::id()
        ));
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn example_config_is_valid() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/otlp/run-config.yaml");
        let prepared = prepare(&args(Some(p))).unwrap();
        assert_eq!(
            prepared.cfg.otlp.grpc,
            Some("127.0.0.1:4317".parse().unwrap())
        );
        assert_eq!(prepared.cfg.normalize.generic.len(), 1);
        assert_eq!(
            prepared.cfg.normalize.sglang.completion_grace,
            Duration::from_secs(5)
        );
    }

    #[test]
    fn defaults_and_flag_overrides() {
        let p = prepare(&args(None)).unwrap();
        assert_eq!(p.cfg.otlp.grpc, Some("127.0.0.1:4317".parse().unwrap()));
        assert_eq!(p.cfg.otlp.http, Some("127.0.0.1:4318".parse().unwrap()));
        assert_eq!(p.cfg.otlp.max_message_bytes, 8 << 20);
        let mut a = args(None);
        a.otlp_grpc = Some("off".into());
        a.otlp_http = Some("127.0.0.1:9999".into());
        a.max_message_bytes = Some(64 << 20);
        let p = prepare(&a).unwrap();
        assert_eq!(p.cfg.otlp.grpc, None);
        assert_eq!(p.cfg.otlp.http, Some("127.0.0.1:9999".parse().unwrap()));
        assert!(p.cfg.otlp.max_decompressed_bytes >= 64 << 20);
    }

    #[test]
    fn bad_configs_are_refused_before_binding() {
        let typo = write("typo", "otlp:\n  grcp: 127.0.0.1:1\n");
        let e = prepare(&args(Some(typo))).err().unwrap().to_string();
        assert!(e.contains("grcp"), "{e}");
        let zero = write("zero", "channel_capacity: 0\n");
        assert!(matches!(
            prepare(&args(Some(zero))),
            Err(RunConfigError::Capacity)
        ));
        let same = write(
            "same",
            "otlp:\n  grpc: 127.0.0.1:7000\n  http: 127.0.0.1:7000\n",
        );
        assert!(matches!(
            prepare(&args(Some(same))),
            Err(RunConfigError::Otlp(_))
        ));
        let profile = write("profile", "normalize:\n  by_service_name: { x: sglangg }\n");
        assert!(matches!(
            prepare(&args(Some(profile))),
            Err(RunConfigError::Normalize(_))
        ));
        let mut a = args(None);
        a.otlp_grpc = Some("localhost".into());
        assert!(matches!(prepare(&a), Err(RunConfigError::Addr { .. })));
        assert!(matches!(
            prepare(&args(Some("/nonexistent/revenant.yaml".into()))),
            Err(RunConfigError::Read { .. })
        ));
    }
}
