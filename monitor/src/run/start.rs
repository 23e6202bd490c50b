//! Starting what was bound: the outputs (admin server, alert dispatcher) first, then the sources
//! (eBPF, OTLP receivers) into the event channel, then the engine task with its taps.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::{JoinHandle, JoinSet};

use super::bind::{Bound, ebpf_state};
use super::coverage;
use super::kit::{Shared, serve_admin};
use super::shutdown::{Phase, Shutdown};
use crate::admin::AdminServer;
use crate::alert::{AlertConfig, AlertPipeline, OpenedAlerts};
use crate::config::RunConfig;
use crate::event::Source;
use crate::ingest::ebpf::{EbpfStart, HoldWindows};
use crate::ingest::otlp::{self, Ingest, OtlpStats};
use crate::ingest::replay::{RunHeader, rules_fingerprint};
use crate::normalize::Normalizer;
use crate::pipeline::taps::{ReplayWriter, SourceActivity};
use crate::pipeline::{EngineTask, EngineTotals, EventSender, EventTap};
use crate::telemetry::{ComponentKind, ReadyHandle};

/// The windows the enabled rules give a held leg, for the eBPF source to compare with each SGLang
/// worker's own timeouts.
pub(super) fn hold_windows<'a>(
    rules: impl Iterator<Item = &'a crate::engine::rules::Rule>,
) -> HoldWindows {
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
pub(super) fn announce_rules(
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
    let _ = shared
        .windows
        .set(crate::report::CancelWindow::of_rules(checker.rules()));
    RunHeader {
        version: env!("CARGO_PKG_VERSION").into(),
        allowed_lateness_ns: cfg.engine.allowed_lateness().as_nanos() as u64,
        clock_skew_ns: cfg.engine.clock_skew().as_nanos() as u64,
        rules: cfg.engine.rules.as_ref().map(|p| p.display().to_string()),
        rules_fingerprint: rules_fingerprint(checker.rules()),
    }
}

/// The admin server and the alert dispatcher: they outlive the sources and the engine.
pub(super) struct Outputs {
    pub(super) admin: Option<JoinHandle<Result<(), crate::admin::AdminError>>>,
    pub(super) alerts: AlertPipeline,
}

/// Starts the admin server and the alert dispatcher (resuming its spool).
pub(super) fn start_outputs(
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

/// The running sources, and what the ready line and file report.
pub(super) struct Sources {
    /// The OTLP receivers: they end early only on failure.
    pub(super) receivers: JoinSet<Result<(), String>>,
    /// The eBPF source and its drop publisher.
    pub(super) ebpf: JoinSet<Result<(), String>>,
    /// The OTLP acceptor's 1 s housekeeping tick.
    pub(super) ticker: JoinHandle<()>,
    pub(super) ingest: Arc<Ingest>,
    pub(super) otlp_stats: Arc<OtlpStats>,
    pub(super) otlp_ready: Option<ReadyHandle>,
    pub(super) ebpf_ready: Option<ReadyHandle>,
    pub(super) bound: serde_json::Map<String, serde_json::Value>,
    /// Why no source is running at all (OTLP off, eBPF off or unavailable), if so: the caller
    /// decides whether something else feeds it (`agent --replay`) or it is blind.
    pub(super) blind: Option<String>,
}

/// Spawns the eBPF source and the OTLP receivers, each sending into `tx`; they stop at
/// [`Phase::StopSources`].
pub(super) fn start_sources(
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
pub(super) fn engine_taps(
    shared: &Shared,
    sources: &Sources,
    replay: Option<ReplayWriter>,
) -> Vec<Box<dyn EventTap>> {
    let mut taps = shared.engine_taps();
    // Which sources are live: only `run` has sources of its own.
    taps.insert(
        1,
        Box::new(SourceActivity {
            otlp: sources.otlp_ready.clone(),
            ebpf: sources.ebpf_ready.clone(),
        }),
    );
    if let Some(w) = replay {
        taps.push(Box::new(w));
    }
    taps
}

/// Spawns the engine task; it drains at [`Phase::CloseEngine`].
pub(super) fn start_engine(
    task: EngineTask,
    shutdown: &Shutdown,
) -> JoinHandle<std::io::Result<EngineTotals>> {
    tokio::spawn(task.run(shutdown.at(Phase::CloseEngine)))
}
