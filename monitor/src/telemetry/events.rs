//! Internal events: one struct per thing that happens to revenant itself. `emit()` writes the log
//! line and bumps the metric with the same bounded labels, so logs and `/metrics` never disagree.

use std::time::Duration;

use tracing::{debug, error, info, trace, warn};

use super::metrics::{
    DeliveryLabels, DropLabels, DropPoint, DropReason, Metrics, Outcome, RuleLabel, RuleLabels,
    SinkLabel, SourceLabels, event_labels,
};
use crate::event::{Kind, LifecycleEvent, Source, Stage};

/// A batch of events reached the checker. Hot path: trace-level log only, and each label set
/// looked up once per batch, not per event.
pub struct EventsObserved<'a> {
    pub events: &'a [LifecycleEvent],
    /// Wall clock (unix ns) when the checker received them.
    pub arrival_ns: u64,
}

impl EventsObserved<'_> {
    pub fn emit(&self, m: &Metrics) {
        let mut counts = [[[0u64; Kind::ALL.len()]; Stage::ALL.len()]; Source::ALL.len()];
        for e in self.events {
            trace!(
                source = e.source.as_str(),
                stage = e.stage.as_str(),
                kind = e.kind.as_str(),
                "event observed"
            );
            counts[e.source as usize][e.stage as usize][e.kind as usize] += 1;
        }
        for source in Source::ALL {
            let mut any = false;
            for stage in Stage::ALL {
                for kind in Kind::ALL {
                    let n = counts[source as usize][stage as usize][kind as usize];
                    if n > 0 {
                        any = true;
                        m.events
                            .get_or_create(&event_labels(source, stage, kind))
                            .inc_by(n);
                    }
                }
            }
            if !any {
                continue;
            }
            let src = SourceLabels {
                source: source.as_str(),
            };
            {
                let lag = m.event_lag.get_or_create(&src);
                for e in self.events.iter().filter(|e| e.source == source) {
                    // Events stamped in the future (clock skew) count as zero lag, not as a
                    // negative value.
                    lag.observe(self.arrival_ns.saturating_sub(e.time_ns) as f64 / 1e9);
                }
            }
            m.source_last_event
                .get_or_create(&src)
                .set(self.arrival_ns as f64 / 1e9);
        }
    }
}

/// Something was dropped. Every drop in revenant goes through here.
pub struct ItemsDropped {
    pub point: DropPoint,
    pub reason: DropReason,
    pub count: u64,
}

impl ItemsDropped {
    pub fn emit(&self, m: &Metrics) {
        warn!(
            point = self.point.as_str(),
            reason = self.reason.as_str(),
            count = self.count,
            "items dropped"
        );
        m.dropped
            .get_or_create(&DropLabels {
                point: self.point.as_str(),
                reason: self.reason.as_str(),
            })
            .inc_by(self.count);
    }
}

/// Kernel drop counters are absolute totals read from a per-CPU map; this turns a total into an
/// increment so the exported counter stays monotonic.
#[derive(Debug, Default)]
pub struct AbsoluteDrops {
    last: std::sync::atomic::AtomicU64,
}

impl AbsoluteDrops {
    pub fn observe_total(&self, m: &Metrics, point: DropPoint, reason: DropReason, total: u64) {
        let prev = self.last.swap(total, std::sync::atomic::Ordering::Relaxed);
        if total > prev {
            ItemsDropped {
                point,
                reason,
                count: total - prev,
            }
            .emit(m);
        }
    }
}

pub struct AlertReceived<'a> {
    pub rule: &'a str,
    /// `Severity::as_str()`.
    pub severity: &'static str,
}

impl AlertReceived<'_> {
    pub fn emit(&self, m: &Metrics) {
        debug!(
            rule = self.rule,
            severity = self.severity,
            "violation received"
        );
        m.alerts_received
            .get_or_create(&RuleLabels {
                rule: self.rule.to_string(),
                severity: self.severity,
            })
            .inc();
    }
}

pub struct AlertDeduplicated<'a> {
    pub rule: &'a str,
    pub fingerprint: &'a str,
    pub repeats: u64,
}

impl AlertDeduplicated<'_> {
    pub fn emit(&self, m: &Metrics) {
        debug!(
            rule = self.rule,
            fingerprint = self.fingerprint,
            repeats = self.repeats,
            "violation folded into an open notification"
        );
        m.alerts_deduplicated
            .get_or_create(&RuleLabel {
                rule: self.rule.to_string(),
            })
            .inc();
    }
}

pub struct AlertSentBefore<'a> {
    pub rule: &'a str,
}

impl AlertSentBefore<'_> {
    pub fn emit(&self, m: &Metrics) {
        debug!(
            rule = self.rule,
            "notification sent before by another process: not spooled again"
        );
        m.alerts_sent_before
            .get_or_create(&RuleLabel {
                rule: self.rule.to_string(),
            })
            .inc();
    }
}

pub struct AlertRateLimited<'a> {
    pub rule: &'a str,
}

impl AlertRateLimited<'_> {
    pub fn emit(&self, m: &Metrics) {
        debug!(
            rule = self.rule,
            "violation rate-limited; it will be summarised"
        );
        m.alerts_rate_limited
            .get_or_create(&RuleLabel {
                rule: self.rule.to_string(),
            })
            .inc();
    }
}

/// A second source confirmed an already reported (rule, attempt).
pub struct AlertCorroborated<'a> {
    pub rule: &'a str,
    pub fingerprint: &'a str,
    /// `Corroboration::outcome()`: merged_held | merged_active | late | unmatched.
    pub outcome: &'static str,
}

impl AlertCorroborated<'_> {
    pub fn emit(&self, m: &Metrics) {
        debug!(
            rule = self.rule,
            fingerprint = self.fingerprint,
            outcome = self.outcome,
            "violation corroborated by another source"
        );
        m.alerts_corroborated
            .get_or_create(&super::metrics::CorroborationLabels {
                rule: self.rule.to_string(),
                outcome: self.outcome,
            })
            .inc();
    }
}

/// A finding opened an incident (its notification waits for the group wait).
pub struct IncidentOpened<'a> {
    pub rule: &'a str,
    pub fingerprint: &'a str,
}

impl IncidentOpened<'_> {
    pub fn emit(&self, m: &Metrics) {
        debug!(
            rule = self.rule,
            fingerprint = self.fingerprint,
            "incident opened"
        );
        m.incidents_opened
            .get_or_create(&RuleLabel {
                rule: self.rule.to_string(),
            })
            .inc();
    }
}

/// A finding of another rule joined an open incident.
pub struct FindingMerged<'a> {
    pub rule: &'a str,
    pub fingerprint: &'a str,
    /// `Merge::as_str()`: pending | notified | escalated | repeated.
    pub outcome: &'static str,
}

impl FindingMerged<'_> {
    pub fn emit(&self, m: &Metrics) {
        debug!(
            rule = self.rule,
            fingerprint = self.fingerprint,
            outcome = self.outcome,
            "finding merged into an open incident"
        );
        m.findings_merged
            .get_or_create(&super::metrics::MergeLabels {
                rule: self.rule.to_string(),
                outcome: self.outcome,
            })
            .inc();
    }
}

/// How many incident notifications wait (group wait, corroboration hold).
pub struct AlertsPending {
    pub count: usize,
}

impl AlertsPending {
    pub fn emit(&self, m: &Metrics) {
        m.alerts_pending.set(self.count as i64);
    }
}

/// A first notification waits for the corroboration window.
pub struct AlertHeld<'a> {
    pub rule: &'a str,
    pub fingerprint: &'a str,
}

impl AlertHeld<'_> {
    pub fn emit(&self, m: &Metrics) {
        debug!(
            rule = self.rule,
            fingerprint = self.fingerprint,
            "notification held for corroboration"
        );
        m.alerts_held
            .get_or_create(&RuleLabel {
                rule: self.rule.to_string(),
            })
            .inc();
    }
}

pub struct SuppressionSummarised<'a> {
    pub rule: &'a str,
    pub suppressed: u64,
}

impl SuppressionSummarised<'_> {
    pub fn emit(&self, m: &Metrics) {
        warn!(
            rule = self.rule,
            suppressed = self.suppressed,
            "rule exceeded its alert rate limit; sending a summary"
        );
        m.alerts_notified
            .get_or_create(&RuleLabel {
                rule: self.rule.to_string(),
            })
            .inc();
    }
}

pub struct AlertSpooled<'a> {
    pub rule: &'a str,
    pub entries: usize,
    pub bytes: u64,
}

impl AlertSpooled<'_> {
    pub fn emit(&self, m: &Metrics) {
        debug!(
            rule = self.rule,
            spool_entries = self.entries,
            "notification spooled"
        );
        m.alerts_notified
            .get_or_create(&RuleLabel {
                rule: self.rule.to_string(),
            })
            .inc();
        SpoolSize {
            entries: self.entries,
            bytes: self.bytes,
        }
        .emit(m);
    }
}

pub struct SpoolSize {
    pub entries: usize,
    pub bytes: u64,
}

impl SpoolSize {
    pub fn emit(&self, m: &Metrics) {
        m.spool_entries.set(self.entries as i64);
        m.spool_bytes.set(self.bytes as i64);
    }
}

/// A sink acknowledged a batch.
pub struct AlertsDelivered<'a> {
    pub sink: &'a str,
    pub count: usize,
    pub duration: Duration,
    /// Dispatcher intake → acknowledgement, one per notification.
    pub latencies: &'a [Duration],
}

impl AlertsDelivered<'_> {
    pub fn emit(&self, m: &Metrics) {
        debug!(
            sink = self.sink,
            count = self.count,
            duration_ms = self.duration.as_secs_f64() * 1e3,
            "alerts delivered"
        );
        let sink = SinkLabel {
            sink: self.sink.to_string(),
        };
        m.deliveries
            .get_or_create(&DeliveryLabels {
                sink: self.sink.to_string(),
                outcome: Outcome::Success.as_str(),
            })
            .inc();
        m.delivered_alerts
            .get_or_create(&sink)
            .inc_by(self.count as u64);
        m.delivery_duration
            .get_or_create(&sink)
            .observe(self.duration.as_secs_f64());
        let h = m.alert_latency.get_or_create(&sink);
        for l in self.latencies {
            h.observe(l.as_secs_f64());
        }
    }
}

/// One delivery attempt failed.
pub struct AlertDeliveryFailed<'a> {
    pub sink: &'a str,
    pub permanent: bool,
    pub count: usize,
    pub status: Option<u16>,
    pub error: &'a str,
    pub retry_in: Option<Duration>,
}

impl AlertDeliveryFailed<'_> {
    pub fn emit(&self, m: &Metrics) {
        let outcome = if self.permanent {
            error!(
                sink = self.sink,
                count = self.count,
                status = self.status,
                error = self.error,
                "alert delivery refused for good; not retried"
            );
            ItemsDropped {
                point: DropPoint::Sink,
                reason: DropReason::PermanentError,
                count: self.count as u64,
            }
            .emit(m);
            Outcome::PermanentError
        } else {
            warn!(
                sink = self.sink,
                count = self.count,
                status = self.status,
                error = self.error,
                retry_in_ms = self.retry_in.map(|d| d.as_millis() as u64),
                "alert delivery failed; will retry"
            );
            Outcome::RetryableError
        };
        m.deliveries
            .get_or_create(&DeliveryLabels {
                sink: self.sink.to_string(),
                outcome: outcome.as_str(),
            })
            .inc();
    }
}

/// A startup component reported in (or the whole process became ready).
pub struct ComponentReady<'a> {
    pub component: &'a str,
    pub kind: &'static str,
    pub all_ready: bool,
}

impl ComponentReady<'_> {
    pub fn emit(&self, m: &Metrics) {
        info!(
            component = self.component,
            kind = self.kind,
            all_ready = self.all_ready,
            "component ready"
        );
        m.component_ready
            .get_or_create(&super::metrics::ComponentLabels {
                component: self.component.to_string(),
                kind: self.kind,
            })
            .set(1);
        m.ready.set(self.all_ready as i64);
    }
}
