//! The alert path's internal events: one struct per thing that happens to a violation on its way
//! to the sinks (received, deduplicated, merged into an incident, held, rate-limited, spooled,
//! delivered, refused). `emit()` writes the log line and bumps the metric of the shared registry
//! with the same bounded labels (`telemetry::events` holds the ones every component shares).

use std::time::Duration;

use tracing::{debug, error, warn};

use crate::telemetry::events::ItemsDropped;
use crate::telemetry::metrics::{
    DeliveryLabels, DropPoint, DropReason, Metrics, Outcome, RuleLabel, RuleLabels, SinkLabel,
};

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
            .get_or_create(&crate::telemetry::metrics::CorroborationLabels {
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
            .get_or_create(&crate::telemetry::metrics::MergeLabels {
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
