//! The dispatcher task: violations in (bounded mpsc), incidents and flood control, spool, then
//! one delivery worker per sink. Layering per sink is queue (the spool) → retry (backoff, Retry-After) →
//! timeout (the sink's HTTP client), as in OpenTelemetry exporters.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;

use super::flood::{ActiveAlert, Admission, Corroboration, FloodConfig, FloodControl, Release};
use super::notification::{LinkBase, Notification, now_unix_ns};
use super::sink::{Backoff, Sink, SinkError};
use super::spool::{Spool, SpoolError};
use crate::telemetry::events::{
    AlertCorroborated, AlertDeduplicated, AlertDeliveryFailed, AlertHeld, AlertRateLimited,
    AlertReceived, AlertSpooled, AlertsDelivered, AlertsPending, FindingMerged, IncidentOpened,
    ItemsDropped, SpoolSize, SuppressionSummarised,
};
use crate::telemetry::metrics::{DropPoint, DropReason, Metrics};
use crate::telemetry::{Readiness, RecentViolations};
use crate::violation::Violation;

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
    /// Follow-ups from a second source (merged, never counted as repeats).
    pub corroborated: u64,
    pub spool_dropped: u64,
    /// Notifications still awaiting a sink when the dispatcher stopped (kept in the spool).
    pub undelivered_at_exit: usize,
}

/// Violations taken from the channel per spool group commit.
const INTAKE_BATCH: usize = 512;

struct SinkQueue {
    sink: Arc<dyn Sink>,
    queue: std::sync::Mutex<VecDeque<u64>>,
    notify: Notify,
    /// Enqueued and not yet acknowledged.
    outstanding: AtomicUsize,
}

impl SinkQueue {
    fn push(&self, seq: u64) {
        self.outstanding.fetch_add(1, Ordering::SeqCst);
        self.queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(seq);
        self.notify.notify_one();
    }
}

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
            readiness: None,
        }
    }

    /// Hold first notifications for the corroboration window only while at least two sources
    /// are live (or just started); without readiness, whenever a window is configured.
    pub fn with_readiness(mut self, readiness: Readiness) -> Dispatcher {
        self.readiness = Some(readiness);
        self
    }

    fn may_hold(&self) -> bool {
        self.readiness
            .as_ref()
            .is_none_or(|r| r.presumed_live_source_count() >= 2)
    }

    /// Also record every received violation for `/api/violations`.
    pub fn with_recent(mut self, recent: Arc<RecentViolations>) -> Dispatcher {
        self.recent = Some(recent);
        self
    }

    pub fn sink_names(&self) -> Vec<String> {
        self.sinks.iter().map(|s| s.name().to_string()).collect()
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
                for seq in self.spool.pending_for(s.name()) {
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
        let mut report = DispatchReport::default();
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
                count: self.flood.pending(),
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
        AlertsPending { count: 0 }.emit(&self.metrics);
        self.spool_and_enqueue(held, &names, &queues, &mut report)
            .await;
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
        if report.undelivered_at_exit > 0 {
            tracing::warn!(
                entries = report.undelivered_at_exit,
                dir = %self.spool.dir().display(),
                "alerts left in the spool; delivery resumes at next start"
            );
        }
        report
    }

    async fn spool_and_enqueue(
        &self,
        notes: Vec<Notification>,
        names: &[String],
        queues: &[Arc<SinkQueue>],
        report: &mut DispatchReport,
    ) {
        if notes.is_empty() {
            return;
        }
        let rules: Vec<String> = notes.iter().map(|n| n.rule().to_string()).collect();
        let spool = self.spool.clone();
        let names_owned = names.to_vec();
        let n = notes.len();
        // File writes and the sync can take milliseconds: keep them off the async workers.
        let results = tokio::task::spawn_blocking(move || spool.put_many(notes, &names_owned))
            .await
            .unwrap_or_else(|e| {
                (0..n)
                    .map(|_| {
                        Err(SpoolError::Write {
                            path: Default::default(),
                            source: std::io::Error::other(e.to_string()),
                        })
                    })
                    .collect()
            });
        for (res, rule) in results.into_iter().zip(&rules) {
            match res {
                Ok(seq) => {
                    report.notified += 1;
                    let (entries, bytes) = self.spool.size();
                    AlertSpooled {
                        rule,
                        entries,
                        bytes,
                    }
                    .emit(&self.metrics);
                    for q in queues {
                        q.push(seq);
                    }
                }
                Err(e) => {
                    report.spool_dropped += 1;
                    let reason = match e {
                        SpoolError::Full { .. } => DropReason::Full,
                        _ => DropReason::WriteError,
                    };
                    tracing::error!(error = %e, rule, "cannot spool alert; dropped");
                    ItemsDropped {
                        point: DropPoint::Spool,
                        reason,
                        count: 1,
                    }
                    .emit(&self.metrics);
                }
            }
        }
    }
}

/// The notifications among `released`; rate-limited ones are counted per finding.
fn released(
    released: Vec<Release>,
    metrics: &Metrics,
    report: &mut DispatchReport,
) -> Vec<Notification> {
    let mut notes = Vec::with_capacity(released.len());
    for r in released {
        match r {
            Release::Notify(a) => notes.push(Notification::Incident(a)),
            Release::RateLimited { lead_rule, rules } => {
                tracing::debug!(rule = %lead_rule, findings = rules.len(), "incident notification rate-limited");
                for rule in &rules {
                    report.rate_limited += 1;
                    AlertRateLimited { rule }.emit(metrics);
                }
            }
        }
    }
    notes
}

async fn sink_worker(q: Arc<SinkQueue>, spool: Spool, metrics: Arc<Metrics>, cfg: DispatchConfig) {
    let name = q.sink.name().to_string();
    let max_batch = q.sink.max_batch().max(1);
    let mut backoff = Backoff::new(cfg.retry_initial, cfg.retry_max);
    loop {
        let seqs: Vec<u64> = {
            let mut g = q.queue.lock().unwrap_or_else(|p| p.into_inner());
            let n = g.len().min(max_batch);
            g.drain(..n).collect()
        };
        if seqs.is_empty() {
            q.notify.notified().await;
            continue;
        }
        // Entries acknowledged meanwhile (cannot happen today) are skipped, not resent.
        let batch: Vec<(u64, Arc<Notification>)> = seqs
            .iter()
            .filter_map(|s| spool.get(*s).map(|n| (*s, n)))
            .collect();
        let skipped = seqs.len() - batch.len();
        if skipped > 0 {
            q.outstanding.fetch_sub(skipped, Ordering::SeqCst);
        }
        deliver_with_retry(&q, &name, &batch, &spool, &metrics, &cfg, &mut backoff).await;
    }
}

async fn deliver_with_retry(
    q: &SinkQueue,
    name: &str,
    batch: &[(u64, Arc<Notification>)],
    spool: &Spool,
    metrics: &Metrics,
    cfg: &DispatchConfig,
    backoff: &mut Backoff,
) {
    if batch.is_empty() {
        return;
    }
    let notes: Vec<Arc<Notification>> = batch.iter().map(|(_, n)| n.clone()).collect();
    loop {
        let started = Instant::now();
        let span = tracing::info_span!("alert.deliver", sink = name, notifications = notes.len());
        match tracing::Instrument::instrument(q.sink.deliver(&notes), span).await {
            Ok(()) => {
                backoff.reset();
                let now = now_unix_ns();
                let latencies: Vec<Duration> = notes
                    .iter()
                    .map(|n| Duration::from_nanos(now.saturating_sub(n.received_at_ns())))
                    .collect();
                AlertsDelivered {
                    sink: name,
                    count: notes.len(),
                    duration: started.elapsed(),
                    latencies: &latencies,
                }
                .emit(metrics);
                ack_all(q, name, batch, spool, metrics);
                return;
            }
            Err(SinkError::Permanent { reason, status }) => {
                if batch.len() > 1 {
                    // One bad notification must not take its batch-mates down with it.
                    tracing::warn!(
                        sink = name,
                        status,
                        "batch refused; retrying its notifications one by one"
                    );
                    for item in batch {
                        Box::pin(deliver_with_retry(
                            q,
                            name,
                            std::slice::from_ref(item),
                            spool,
                            metrics,
                            cfg,
                            backoff,
                        ))
                        .await;
                    }
                    return;
                }
                AlertDeliveryFailed {
                    sink: name,
                    permanent: true,
                    count: 1,
                    status,
                    error: &reason,
                    retry_in: None,
                }
                .emit(metrics);
                ack_all(q, name, batch, spool, metrics);
                return;
            }
            Err(SinkError::Retryable {
                reason,
                status,
                retry_after,
            }) => {
                let delay = match retry_after {
                    Some(d) => d.min(cfg.max_retry_after),
                    None => backoff.next_delay(),
                };
                AlertDeliveryFailed {
                    sink: name,
                    permanent: false,
                    count: notes.len(),
                    status,
                    error: &reason,
                    retry_in: Some(delay),
                }
                .emit(metrics);
                tokio::time::sleep(delay).await;
            }
        }
    }
}

fn ack_all(
    q: &SinkQueue,
    name: &str,
    batch: &[(u64, Arc<Notification>)],
    spool: &Spool,
    metrics: &Metrics,
) {
    for (seq, _) in batch {
        if let Err(e) = spool.ack(*seq, name) {
            // The entry stays on disk and is redelivered after a restart: duplicates, not loss.
            tracing::error!(sink = name, error = %e, "cannot record acknowledgement in the spool");
        }
    }
    q.outstanding.fetch_sub(batch.len(), Ordering::SeqCst);
    let (entries, bytes) = spool.size();
    SpoolSize { entries, bytes }.emit(metrics);
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::alert::notification::IncidentAlert;
    use crate::alert::spool::SpoolConfig;
    use crate::violation::Severity;
    use crate::event::{Kind, Source, Stage};
    use crate::violation::{AttemptAliases, Evidence, EvidenceRole, RequestAliases};

    /// Records deliveries and refreshes, like an Alertmanager that re-posts active alerts.
    #[derive(Default)]
    struct Recorder {
        delivered: Mutex<Vec<Notification>>,
        refreshed: Mutex<Vec<Vec<ActiveAlert>>>,
    }

    struct RecordingSink(Arc<Recorder>);

    impl Sink for RecordingSink {
        fn name(&self) -> &str {
            "recorder"
        }
        fn deliver<'a>(
            &'a self,
            batch: &'a [Arc<Notification>],
        ) -> super::super::sink::BoxFuture<'a, Result<(), SinkError>> {
            let r = self.0.clone();
            Box::pin(async move {
                let mut g = r.delivered.lock().unwrap();
                g.extend(batch.iter().map(|n| (**n).clone()));
                Ok(())
            })
        }
        fn refresh_interval(&self) -> Option<Duration> {
            // Only a forced refresh can happen within the test.
            Some(Duration::from_secs(3600))
        }
        fn refresh<'a>(
            &'a self,
            active: &'a [ActiveAlert],
            _resolved: &'a [ActiveAlert],
        ) -> super::super::sink::BoxFuture<'a, Result<(), SinkError>> {
            let r = self.0.clone();
            let active = active.to_vec();
            Box::pin(async move {
                r.refreshed.lock().unwrap().push(active);
                Ok(())
            })
        }
    }

    fn evidence(source: Source, t: u64, stage: Stage, kind: Kind) -> Evidence {
        Evidence {
            role: EvidenceRole::Offender,
            time_ns: t,
            stage,
            kind,
            source,
            status: None,
            reason: None,
        }
    }

    async fn until(what: &str, mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn finding(rule: &str, req: &str, severity: Severity) -> Violation {
        Violation {
            rule: rule.into(),
            severity,
            summary: format!("{rule} on {req}"),
            request: RequestAliases {
                request_id: Some(req.into()),
                trace_id: None,
            },
            attempt: AttemptAliases {
                bootstrap_room: Some(42),
                rid: None,
            },
            worker: None,
            detected_at_ns: 2,
            fingerprint: format!("{rule}/{req}"),
            evidence: vec![evidence(Source::Otlp, 1, Stage::Decode, Kind::Work)],
            corroborates: false,
        }
    }

    /// The group wait is timer-driven: two rules about one request become one notification,
    /// another request its own; an escalation after delivery is exactly one update.
    #[tokio::test]
    async fn findings_of_one_request_are_one_notification_and_escalate_once() {
        let dir = tempfile::tempdir().unwrap();
        let spool_cfg = SpoolConfig {
            dir: Some(dir.path().to_path_buf()),
            fsync: false,
            ..SpoolConfig::default()
        };
        let (spool, _) = Spool::open(&spool_cfg, &["recorder".to_string()]).unwrap();
        let rec = Arc::new(Recorder::default());
        let metrics = Arc::new(Metrics::new());
        let wait = Duration::from_millis(300);
        let d = Dispatcher::new(
            DispatchConfig {
                tick: Duration::from_millis(20),
                ..DispatchConfig::default()
            },
            FloodConfig {
                group_wait: wait,
                ..FloodConfig::default()
            },
            LinkBase::default(),
            spool,
            vec![Arc::new(RecordingSink(rec.clone()))],
            metrics.clone(),
        );
        let (tx, rx) = mpsc::channel(16);
        let handle = tokio::spawn(d.run(rx));
        let t0 = Instant::now();
        tx.send(finding("orphaned-leg", "req-1", Severity::Warning))
            .await
            .unwrap();
        tx.send(finding("stuck-attempt", "req-1", Severity::Warning))
            .await
            .unwrap();
        tx.send(finding("orphaned-leg", "req-2", Severity::Warning))
            .await
            .unwrap();
        until("two notifications", || {
            rec.delivered.lock().unwrap().len() == 2
        })
        .await;
        assert!(t0.elapsed() >= wait, "sent before the group wait ended");
        tokio::time::sleep(wait * 2).await;
        let incidents = |n: &Notification| match n {
            Notification::Incident(a) => a.clone(),
            other => panic!("{other:?}"),
        };
        let got: Vec<IncidentAlert> = rec
            .delivered
            .lock()
            .unwrap()
            .iter()
            .map(incidents)
            .collect();
        assert_eq!(got.len(), 2, "{got:#?}");
        let one = got
            .iter()
            .find(|a| a.incident_key == "request_id:req-1")
            .unwrap();
        assert_eq!(one.rules, ["orphaned-leg", "stuck-attempt"]);
        assert_eq!(one.violation.severity, Severity::Warning);
        // Critical findings for req-1 after its notification: one escalation.
        tx.send(finding(
            "activity-after-rejection",
            "req-1",
            Severity::Critical,
        ))
        .await
        .unwrap();
        tx.send(finding(
            "activity-after-request-failed",
            "req-1",
            Severity::Critical,
        ))
        .await
        .unwrap();
        until("the update", || rec.delivered.lock().unwrap().len() == 3).await;
        tokio::time::sleep(wait * 2).await;
        drop(tx);
        let report = handle.await.unwrap();
        let got: Vec<IncidentAlert> = rec
            .delivered
            .lock()
            .unwrap()
            .iter()
            .map(incidents)
            .collect();
        assert_eq!(got.len(), 3, "{got:#?}");
        let u = &got[2];
        assert_eq!(u.incident, one.incident);
        assert_eq!(
            u.update,
            Some(crate::alert::notification::Update::Escalated)
        );
        assert_eq!(u.sequence, 2);
        assert_eq!(u.violation.rule, "activity-after-rejection");
        assert_eq!(u.findings.len(), 4);
        assert_eq!(
            (
                report.received,
                report.incidents,
                report.merged,
                report.notified
            ),
            (5, 2, 3, 3)
        );
        let text = metrics.render();
        for line in [
            "revenant_alerts_incidents_opened_total{rule=\"orphaned-leg\"} 2",
            "revenant_alerts_findings_merged_total{rule=\"stuck-attempt\",outcome=\"pending\"} 1",
            "revenant_alerts_findings_merged_total{rule=\"activity-after-rejection\",outcome=\"escalated\"} 1",
            "revenant_alerts_findings_merged_total{rule=\"activity-after-request-failed\",outcome=\"pending\"} 1",
        ] {
            assert!(text.contains(line), "{line} not in\n{text}");
        }
    }

    /// Without a corroboration window the notification goes out at once; the second source's
    /// confirmation then sends nothing new but is re-posted at once as the one active alert
    /// (what Alertmanager receives), with both sources in its evidence.
    #[tokio::test]
    async fn late_corroboration_is_reposted_merged_not_notified_again() {
        let dir = tempfile::tempdir().unwrap();
        let spool_cfg = SpoolConfig {
            dir: Some(dir.path().to_path_buf()),
            fsync: false,
            ..SpoolConfig::default()
        };
        let (spool, _) = Spool::open(&spool_cfg, &["recorder".to_string()]).unwrap();
        let rec = Arc::new(Recorder::default());
        let d = Dispatcher::new(
            DispatchConfig {
                tick: Duration::from_millis(20),
                ..DispatchConfig::default()
            },
            FloodConfig::default(),
            LinkBase::default(),
            spool,
            vec![Arc::new(RecordingSink(rec.clone()))],
            Arc::new(Metrics::new()),
        );
        let (tx, rx) = mpsc::channel(16);
        let handle = tokio::spawn(d.run(rx));
        let v = Violation {
            rule: "activity-after-rejection".into(),
            severity: Severity::Critical,
            summary: "s".into(),
            request: RequestAliases {
                request_id: Some("req-1".into()),
                trace_id: None,
            },
            attempt: AttemptAliases {
                bootstrap_room: Some(42),
                rid: None,
            },
            worker: None,
            detected_at_ns: 2,
            fingerprint: "fp".into(),
            evidence: vec![
                evidence(Source::Otlp, 1, Stage::Prefill, Kind::Rejected),
                evidence(Source::Otlp, 2, Stage::Transfer, Kind::Work),
            ],
            corroborates: false,
        };
        tx.send(v.clone()).await.unwrap();
        until("the first notification", || {
            rec.delivered.lock().unwrap().len() == 1
        })
        .await;
        assert!(rec.refreshed.lock().unwrap().is_empty());
        let mut c = v.clone();
        c.corroborates = true;
        c.evidence
            .push(evidence(Source::Ebpf, 3, Stage::Transfer, Kind::Work));
        tx.send(c).await.unwrap();
        until("a re-post of the active alert", || {
            !rec.refreshed.lock().unwrap().is_empty()
        })
        .await;
        let active = rec.refreshed.lock().unwrap()[0].clone();
        assert_eq!(active.len(), 1, "one alert");
        assert_eq!(active[0].alert.occurrences, 1);
        let sources: Vec<Source> = active[0]
            .alert
            .violation
            .evidence
            .iter()
            .map(|e| e.source)
            .collect();
        assert_eq!(sources, [Source::Otlp, Source::Otlp, Source::Ebpf]);
        drop(tx);
        let report = handle.await.unwrap();
        assert_eq!(rec.delivered.lock().unwrap().len(), 1, "not notified again");
        assert_eq!(report.corroborated, 1);
        assert_eq!(report.deduplicated, 0);
    }
}
