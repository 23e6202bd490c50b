//! The dispatcher task: violations in (bounded mpsc), incidents and flood control, spool, then
//! one delivery worker per sink. Layering per sink is queue (the spool) → retry (backoff, Retry-After) →
//! timeout (the sink's HTTP client), as in OpenTelemetry exporters.
//!
//! Layout: the task loop here; `intake` spools what the flood releases; `delivery` runs
//! the per-sink workers.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;

use super::claims::NotificationClaims;
use super::events::{
    AlertCorroborated, AlertDeduplicated, AlertDeliveryFailed, AlertHeld, AlertReceived,
    AlertsPending, FindingMerged, IncidentOpened, SpoolSize, SuppressionSummarised,
};
use super::flood::{ActiveAlert, Admission, Corroboration, FloodConfig, FloodControl};
use super::notification::{LinkBase, Notification, now_unix_ns};
use super::sink::Sink;
use super::spool::Spool;
use crate::telemetry::metrics::Metrics;
use crate::telemetry::{Readiness, RecentViolations};
use crate::violation::Violation;

use delivery::{SinkQueue, sink_worker};
use intake::released;

mod delivery;
mod intake;
#[cfg(test)]
mod tests;

#[derive(Debug, Clone)]
pub struct DispatchConfig {
    pub retry_initial: Duration,
    pub retry_max: Duration,
    /// Longest Retry-After honoured; a receiver asking for more gets this.
    pub max_retry_after: Duration,
    /// On shutdown, how long to keep delivering what is queued; the rest stays in the spool.
    pub drain_timeout: Duration,
    /// How often rate windows and incident expiry are checked.
    pub tick: Duration,
}

impl Default for DispatchConfig {
    fn default() -> Self {
        DispatchConfig {
            retry_initial: Duration::from_millis(500),
            retry_max: Duration::from_secs(30),
            max_retry_after: Duration::from_secs(300),
            drain_timeout: Duration::from_secs(5),
            tick: Duration::from_secs(1),
        }
    }
}

/// Counts from one dispatcher run (also in the metrics).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DispatchReport {
    /// Violations received (findings and follow-ups).
    pub received: u64,
    /// Notifications spooled for delivery (incident notifications, updates, summaries).
    pub notified: u64,
    /// Findings that opened an incident.
    pub incidents: u64,
    /// Findings of another rule merged into an open incident.
    pub merged: u64,
    /// Repeats: findings of a rule the incident already listed (another attempt).
    pub deduplicated: u64,
    /// Findings whose notification the rate limit suppressed.
    pub rate_limited: u64,
    /// Notifications not spooled: another process had sent them (`with_claims`).
    pub sent_before: u64,
    /// Follow-ups from a second source (merged, never counted as repeats).
    pub corroborated: u64,
    pub spool_dropped: u64,
    /// Notifications every sink they were routed to took (delivered, or refused for good).
    pub delivered: u64,
    /// Spool entries for removed sinks dropped at start (`--spool-discard-removed-sinks`).
    pub spool_discarded: u64,
    /// Notifications still awaiting a sink when the dispatcher stopped (kept in the spool).
    pub undelivered_at_exit: usize,
}

/// How long a stopping dispatcher asks again about claims not settled yet (another checker
/// between its claim and its spool; the claims' store briefly away) before it decides them.
const SETTLE_AT_STOP: Duration = Duration::from_secs(2);

/// Violations taken from the channel per spool group commit.
const INTAKE_BATCH: usize = 512;

pub struct Dispatcher {
    cfg: DispatchConfig,
    flood: FloodControl,
    links: LinkBase,
    spool: Spool,
    sinks: Vec<Arc<dyn Sink>>,
    metrics: Arc<Metrics>,
    recent: Option<Arc<RecentViolations>>,
    /// Tells how many sources are live (holding for corroboration only makes sense with two).
    readiness: Option<Readiness>,
    spool_discarded: u64,
    /// Notifications another process may have sent already (cluster mode's checkers).
    claims: Option<Arc<dyn NotificationClaims>>,
    /// Released notifications whose claims could not be looked up yet, with when they were
    /// released: asked about again every tick.
    unconfirmed: Vec<(Notification, Instant)>,
}

impl Dispatcher {
    pub fn new(
        cfg: DispatchConfig,
        flood: FloodConfig,
        links: LinkBase,
        spool: Spool,
        sinks: Vec<Arc<dyn Sink>>,
        metrics: Arc<Metrics>,
    ) -> Dispatcher {
        for s in &sinks {
            metrics.declare_sink(s.name());
        }
        Dispatcher {
            cfg,
            flood: FloodControl::new(flood, now_unix_ns()),
            links,
            spool,
            sinks,
            metrics,
            recent: None,
            spool_discarded: 0,
            readiness: None,
            claims: None,
            unconfirmed: Vec::new(),
        }
    }

    /// Hold first notifications for the corroboration window only while at least two sources
    /// are live (or just started); without readiness, whenever a window is configured.
    pub fn with_readiness(mut self, readiness: Readiness) -> Dispatcher {
        self.readiness = Some(readiness);
        self
    }

    /// Spools no notification the claims say was sent before; records the ones it spools.
    pub fn with_claims(mut self, claims: Arc<dyn NotificationClaims>) -> Dispatcher {
        self.claims = Some(claims);
        self
    }

    fn may_hold(&self) -> bool {
        self.readiness
            .as_ref()
            .is_none_or(|r| r.presumed_live_source_count() >= 2)
    }

    /// Entries the spool discarded at open, reported in the summary.
    pub fn with_spool_discarded(mut self, n: u64) -> Dispatcher {
        self.spool_discarded = n;
        self
    }

    /// Also record every received violation for `/api/violations`.
    pub fn with_recent(mut self, recent: Arc<RecentViolations>) -> Dispatcher {
        self.recent = Some(recent);
        self
    }

    /// The spool identities of the sinks (what entries are pending for).
    pub fn sink_names(&self) -> Vec<String> {
        self.sinks
            .iter()
            .map(|s| s.identity().to_string())
            .collect()
    }

    /// Runs until `rx` is closed (every sender dropped), then drains for `drain_timeout`.
    pub async fn run(mut self, mut rx: mpsc::Receiver<Violation>) -> DispatchReport {
        let names = self.sink_names();
        let queues: Vec<Arc<SinkQueue>> = self
            .sinks
            .iter()
            .map(|s| {
                let q = Arc::new(SinkQueue {
                    sink: s.clone(),
                    queue: Default::default(),
                    notify: Notify::new(),
                    outstanding: AtomicUsize::new(0),
                });
                // Resume what a previous run left in the spool.
                for seq in self.spool.pending_for(s.identity()) {
                    q.push(seq);
                }
                q
            })
            .collect();
        let (entries, bytes) = self.spool.size();
        SpoolSize { entries, bytes }.emit(&self.metrics);
        let workers: Vec<JoinHandle<()>> = queues
            .iter()
            .map(|q| {
                tokio::spawn(sink_worker(
                    q.clone(),
                    self.spool.clone(),
                    self.metrics.clone(),
                    self.cfg.clone(),
                ))
            })
            .collect();
        let mut report = DispatchReport {
            spool_discarded: self.spool_discarded,
            ..DispatchReport::default()
        };
        let mut tick = tokio::time::interval(self.cfg.tick);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let start = Instant::now();
        let mut last_refresh: Vec<Instant> = self.sinks.iter().map(|_| start).collect();
        let mut resolved_pending: Vec<Vec<ActiveAlert>> =
            self.sinks.iter().map(|_| Vec::new()).collect();
        // A late corroboration changed an active alert's evidence: re-post it without waiting
        // for the resend interval.
        let mut refresh_now = false;
        loop {
            AlertsPending {
                count: self.flood.pending() + self.unconfirmed.len(),
            }
            .emit(&self.metrics);
            let next_release = self.flood.next_release_ns().map(|due| {
                tokio::time::Instant::now()
                    + Duration::from_nanos(due.saturating_sub(now_unix_ns()))
            });
            tokio::select! {
                _ = tokio::time::sleep_until(next_release.unwrap_or_else(tokio::time::Instant::now)),
                    if next_release.is_some() => {
                    let notes = released(self.flood.release_due(now_unix_ns()), &self.metrics, &mut report);
                    self.spool_and_enqueue(notes, &names, &queues, &mut report).await;
                }
                v = rx.recv() => {
                    let Some(v) = v else { break };
                    // Take what is already queued too: one spool group commit for the lot.
                    let mut batch = vec![v];
                    while batch.len() < INTAKE_BATCH {
                        match rx.try_recv() {
                            Ok(v) => batch.push(v),
                            Err(_) => break,
                        }
                    }
                    let now = now_unix_ns();
                    let hold = self.may_hold();
                    for v in batch {
                        report.received += 1;
                        AlertReceived { rule: &v.rule, severity: v.severity.as_str() }.emit(&self.metrics);
                        if let Some(r) = &self.recent {
                            r.push(&v, now);
                        }
                        let links = self.links.links(&v);
                        match self.flood.admit(&v, links, now, hold) {
                            Admission::Opened { held } => {
                                report.incidents += 1;
                                IncidentOpened { rule: &v.rule, fingerprint: &v.fingerprint }.emit(&self.metrics);
                                if held {
                                    AlertHeld { rule: &v.rule, fingerprint: &v.fingerprint }.emit(&self.metrics);
                                }
                            }
                            Admission::Merged(m) => {
                                report.merged += 1;
                                FindingMerged { rule: &v.rule, fingerprint: &v.fingerprint, outcome: m.as_str() }.emit(&self.metrics);
                            }
                            Admission::Corroborated(c) => {
                                report.corroborated += 1;
                                AlertCorroborated { rule: &v.rule, fingerprint: &v.fingerprint, outcome: c.outcome() }.emit(&self.metrics);
                                if c == (Corroboration::Late { merged: true }) {
                                    refresh_now = true;
                                }
                            }
                            Admission::Duplicate { occurrences } => {
                                report.deduplicated += 1;
                                AlertDeduplicated { rule: &v.rule, fingerprint: &v.fingerprint, repeats: occurrences - 1 }.emit(&self.metrics);
                            }
                        }
                    }
                    // Without a group wait, or once corroborated, notifications are due at once.
                    let notes = released(self.flood.release_due(now_unix_ns()), &self.metrics, &mut report);
                    self.spool_and_enqueue(notes, &names, &queues, &mut report).await;
                }
                _ = tick.tick() => {
                    self.retry_unconfirmed(false, &names, &queues, &mut report).await;
                    let (summaries, resolved) = self.flood.tick(now_unix_ns());
                    for s in &summaries {
                        SuppressionSummarised { rule: &s.rule, suppressed: s.suppressed }.emit(&self.metrics);
                    }
                    let notes = summaries.into_iter().map(Notification::Suppressed).collect();
                    self.spool_and_enqueue(notes, &names, &queues, &mut report).await;
                    for (i, sink) in self.sinks.iter().enumerate() {
                        let Some(every) = sink.refresh_interval() else { continue };
                        resolved_pending[i].extend(resolved.iter().cloned());
                        if last_refresh[i].elapsed() < every && resolved_pending[i].is_empty() && !refresh_now {
                            continue;
                        }
                        last_refresh[i] = Instant::now();
                        let active = self.flood.active();
                        let gone = std::mem::take(&mut resolved_pending[i]);
                        let sink = sink.clone();
                        let metrics = self.metrics.clone();
                        // Refreshes are idempotent re-posts: run them off the intake path, and a
                        // failed one is simply superseded by the next.
                        tokio::spawn(async move {
                            if let Err(e) = sink.refresh(&active, &gone).await {
                                AlertDeliveryFailed {
                                    sink: sink.name(), permanent: false, count: active.len() + gone.len(),
                                    status: e.status(), error: &e.to_string(), retry_in: None,
                                }.emit(&metrics);
                            }
                        });
                    }
                    refresh_now = false;
                }
            }
        }
        // Input closed: send what is pending (group wait, corroboration), summarise what open rate
        // windows suppressed, then drain.
        let held = released(
            self.flood.release_all(now_unix_ns()),
            &self.metrics,
            &mut report,
        );
        self.spool_and_enqueue(held, &names, &queues, &mut report)
            .await;
        // Claims another checker holds settle within its spool write: give them a moment.
        let settle = Instant::now() + SETTLE_AT_STOP;
        while !self.unconfirmed.is_empty() && Instant::now() < settle {
            tokio::time::sleep(Duration::from_millis(50)).await;
            self.retry_unconfirmed(false, &names, &queues, &mut report)
                .await;
        }
        self.retry_unconfirmed(true, &names, &queues, &mut report)
            .await;
        AlertsPending { count: 0 }.emit(&self.metrics);
        let summaries = self.flood.flush_summaries(now_unix_ns());
        for s in &summaries {
            SuppressionSummarised {
                rule: &s.rule,
                suppressed: s.suppressed,
            }
            .emit(&self.metrics);
        }
        let notes = summaries
            .into_iter()
            .map(Notification::Suppressed)
            .collect();
        self.spool_and_enqueue(notes, &names, &queues, &mut report)
            .await;
        let deadline = Instant::now() + self.cfg.drain_timeout;
        while Instant::now() < deadline
            && queues
                .iter()
                .any(|q| q.outstanding.load(Ordering::SeqCst) > 0)
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for w in &workers {
            w.abort();
        }
        report.undelivered_at_exit = self.spool.size().0;
        report.delivered = self.spool.completed();
        if report.undelivered_at_exit > 0 {
            tracing::warn!(
                entries = report.undelivered_at_exit,
                dir = %self.spool.dir().display(),
                "alerts left in the spool; delivery resumes at next start"
            );
        }
        report
    }
}
