//! The metric registry every component shares (`Arc<Metrics>`), rendered at `/metrics`.
//!
//! Names follow `revenant_<noun>_<unit>_total` (prometheus-client appends `_total` to counters).
//! Every label value comes from a small closed set (stage, kind, source, drop point, sink name from
//! the config, rule name from the rule set): never a request id, trace id or room.

use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::engine::check::{Checker, CheckerStats, Severity};
use crate::event::{Kind, Source, Stage};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabels {
    pub source: &'static str,
    pub stage: &'static str,
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabels {
    pub source: &'static str,
}

/// Where in the pipeline something was dropped. (Refused OTLP exports are counted by the
/// receivers themselves: `revenant_otlp_requests_rejected_total`.)
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum DropPoint {
    /// The kernel ring buffer was full (counted by the probes).
    KernelRingbuf,
    /// A source found the bounded event channel full.
    EventChannel,
    /// The violation channel into the alert dispatcher was full.
    ViolationChannel,
    /// The alert spool was full or held an unreadable entry.
    Spool,
    /// The eBPF source's user-space side: undecodable records, connections evicted from its
    /// bounded tracking table.
    EbpfTracker,
    /// A sink refused an alert for good (4xx other than 408/429).
    Sink,
}

impl DropPoint {
    pub const ALL: [DropPoint; 6] = [
        DropPoint::KernelRingbuf,
        DropPoint::EventChannel,
        DropPoint::ViolationChannel,
        DropPoint::Spool,
        DropPoint::Sink,
        DropPoint::EbpfTracker,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DropPoint::KernelRingbuf => "kernel_ringbuf",
            DropPoint::EventChannel => "event_channel",
            DropPoint::ViolationChannel => "violation_channel",
            DropPoint::Spool => "spool",
            DropPoint::Sink => "sink",
            DropPoint::EbpfTracker => "ebpf_tracker",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DropLabels {
    pub point: &'static str,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CorroborationLabels {
    pub rule: String,
    /// merged_held | merged_active | late | unmatched
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MergeLabels {
    pub rule: String,
    /// pending | notified | escalated | repeated
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RuleLabels {
    pub rule: String,
    pub severity: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RuleLabel {
    pub rule: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SinkLabel {
    pub sink: String,
}

/// How one delivery attempt ended.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Outcome {
    Success,
    RetryableError,
    PermanentError,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Success => "success",
            Outcome::RetryableError => "retryable_error",
            Outcome::PermanentError => "permanent_error",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeliveryLabels {
    pub sink: String,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ComponentLabels {
    pub component: String,
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: &'static str,
}

type HistFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn seconds_histogram() -> Histogram {
    // 100µs .. ~105s: covers a loopback webhook and a retry storm alike.
    Histogram::new(exponential_buckets(0.0001, 2.0, 21))
}

fn lag_histogram() -> Histogram {
    // 1ms .. ~262s: arrival minus event time, dominated by exporter batching.
    Histogram::new(exponential_buckets(0.001, 2.0, 19))
}

/// All of revenant's own metrics. Components take an `Arc<Metrics>` and bump them through the
/// internal events in [`super::events`]; only the admin server reads the registry.
pub struct Metrics {
    registry: Registry,
    pub events: Family<EventLabels, Counter>,
    pub event_lag: Family<SourceLabels, Histogram, fn() -> Histogram>,
    pub source_last_event: Family<SourceLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub dropped: Family<DropLabels, Counter>,
    pub alerts_received: Family<RuleLabels, Counter>,
    pub alerts_deduplicated: Family<RuleLabel, Counter>,
    pub alerts_rate_limited: Family<RuleLabel, Counter>,
    pub alerts_notified: Family<RuleLabel, Counter>,
    pub alerts_corroborated: Family<CorroborationLabels, Counter>,
    pub alerts_held: Family<RuleLabel, Counter>,
    pub incidents_opened: Family<RuleLabel, Counter>,
    pub findings_merged: Family<MergeLabels, Counter>,
    pub alerts_pending: Gauge,
    pub deliveries: Family<DeliveryLabels, Counter>,
    pub delivered_alerts: Family<SinkLabel, Counter>,
    pub delivery_duration: HistFamily<SinkLabel>,
    pub alert_latency: HistFamily<SinkLabel>,
    pub spool_entries: Gauge,
    pub spool_bytes: Gauge,
    pub component_ready: Family<ComponentLabels, Gauge>,
    pub ready: Gauge,
    checker: Arc<CheckerCollector>,
    otlp: Arc<crate::admin::otlp::OtlpCollector>,
    ebpf: Arc<crate::admin::ebpf::EbpfCollector>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut r = Registry::default();
        let events = Family::<EventLabels, Counter>::default();
        r.register(
            "revenant_events",
            "Lifecycle events received from sources, by source, stage and kind",
            events.clone(),
        );
        let event_lag: HistFamily<SourceLabels> = Family::new_with_constructor(lag_histogram);
        r.register(
            "revenant_checker_lag_seconds",
            "Arrival time at the checker minus event time, per source",
            event_lag.clone(),
        );
        let source_last_event = Family::default();
        r.register(
            "revenant_source_last_event_timestamp_seconds",
            "Wall-clock time at which each source last delivered an event",
            source_last_event.clone(),
        );
        let dropped = Family::<DropLabels, Counter>::default();
        r.register(
            "revenant_dropped_items",
            "Items dropped (events, violations, alerts) by pipeline point and reason",
            dropped.clone(),
        );
        let alerts_received = Family::default();
        r.register(
            "revenant_alerts_received",
            "Violations that reached the alert dispatcher, by rule and severity",
            alerts_received.clone(),
        );
        let alerts_deduplicated = Family::default();
        r.register(
            "revenant_alerts_deduplicated",
            "Repeats: findings of a rule an open incident already lists (another attempt of the request), folded into that finding's occurrences",
            alerts_deduplicated.clone(),
        );
        let alerts_rate_limited = Family::default();
        r.register(
            "revenant_alerts_rate_limited",
            "Findings not notified because their incident's lead rule exceeded its rate limit (summarised instead)",
            alerts_rate_limited.clone(),
        );
        let alerts_notified = Family::default();
        r.register(
            "revenant_alerts_notified",
            "Notifications (incidents, their updates, rate-limit summaries) written to the spool for delivery, by lead rule",
            alerts_notified.clone(),
        );
        let alerts_corroborated = Family::default();
        r.register(
            "revenant_alerts_corroborated",
            "Follow-up violations confirming an earlier one from another source (not repeats), by rule and what became of them",
            alerts_corroborated.clone(),
        );
        let alerts_held = Family::default();
        r.register(
            "revenant_alerts_held",
            "Incident notifications held for the corroboration window before sending",
            alerts_held.clone(),
        );
        let incidents_opened = Family::default();
        r.register(
            "revenant_alerts_incidents_opened",
            "Incidents opened (one notification each, unless rate-limited), by the rule of the finding that opened it",
            incidents_opened.clone(),
        );
        let findings_merged = Family::default();
        r.register(
            "revenant_alerts_findings_merged",
            "Findings of another rule merged into an open incident, by rule and where they went (pending: into the notification not sent yet; notified: into the record of one already sent; escalated: raised its severity, one update; repeated: past the dedup window, notified again)",
            findings_merged.clone(),
        );
        let alerts_pending = Gauge::default();
        r.register(
            "revenant_alerts_pending",
            "Incident notifications waiting for their group wait or corroboration before being spooled",
            alerts_pending.clone(),
        );
        let deliveries = Family::default();
        r.register(
            "revenant_alert_deliveries",
            "Delivery attempts by sink and outcome (success, retryable_error, permanent_error)",
            deliveries.clone(),
        );
        let delivered_alerts = Family::default();
        r.register(
            "revenant_alert_delivered_notifications",
            "Notifications acknowledged by each sink",
            delivered_alerts.clone(),
        );
        let delivery_duration: HistFamily<SinkLabel> =
            Family::new_with_constructor(seconds_histogram);
        r.register(
            "revenant_alert_delivery_duration_seconds",
            "Duration of one delivery attempt (one batch), by sink",
            delivery_duration.clone(),
        );
        let alert_latency: HistFamily<SinkLabel> = Family::new_with_constructor(seconds_histogram);
        r.register(
            "revenant_alert_latency_seconds",
            "Time from the first finding of a notification reaching the dispatcher (group wait included) to its acknowledgement by a sink",
            alert_latency.clone(),
        );
        let spool_entries = Gauge::default();
        r.register(
            "revenant_spool_entries",
            "Notifications in the on-disk spool awaiting acknowledgement",
            spool_entries.clone(),
        );
        let spool_bytes = Gauge::default();
        r.register(
            "revenant_spool_bytes",
            "Bytes of notifications in the on-disk spool",
            spool_bytes.clone(),
        );
        let component_ready = Family::default();
        r.register(
            "revenant_component_ready",
            "1 once a startup component (source, sink, server) reported in",
            component_ready.clone(),
        );
        let ready = Gauge::default();
        r.register(
            "revenant_ready",
            "1 when every registered startup component reported in",
            ready.clone(),
        );
        let build = Family::<BuildLabels, Gauge>::default();
        build
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        r.register("revenant_build_info", "Build information", build);
        let checker = Arc::new(CheckerCollector::default());
        r.register_collector(Box::new(checker.clone()));
        let otlp = Arc::new(crate::admin::otlp::OtlpCollector::default());
        r.register_collector(Box::new(otlp.clone()));
        let ebpf = Arc::new(crate::admin::ebpf::EbpfCollector::default());
        r.register_collector(Box::new(ebpf.clone()));
        // Drop counters exist from the start at 0, so that `increase()` sees the first drop.
        for p in DropPoint::ALL {
            let _ = dropped.get_or_create(&DropLabels {
                point: p.as_str(),
                reason: default_reason(p),
            });
        }
        Metrics {
            registry: r,
            events,
            event_lag,
            source_last_event,
            dropped,
            alerts_received,
            alerts_deduplicated,
            alerts_rate_limited,
            alerts_notified,
            alerts_corroborated,
            alerts_held,
            incidents_opened,
            findings_merged,
            alerts_pending,
            deliveries,
            delivered_alerts,
            delivery_duration,
            alert_latency,
            spool_entries,
            spool_bytes,
            component_ready,
            ready,
            checker,
            otlp,
            ebpf,
        }
    }

    /// Prometheus/OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(16 * 1024);
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// Sinks and sources known at start get their series at 0 so dashboards show them before
    /// the first delivery or event.
    pub fn declare_sink(&self, sink: &str) {
        for o in [
            Outcome::Success,
            Outcome::RetryableError,
            Outcome::PermanentError,
        ] {
            let _ = self.deliveries.get_or_create(&DeliveryLabels {
                sink: sink.to_string(),
                outcome: o.as_str(),
            });
        }
        let _ = self.delivered_alerts.get_or_create(&SinkLabel {
            sink: sink.to_string(),
        });
    }

    pub fn declare_source(&self, source: Source) {
        let _ = self.source_last_event.get_or_create(&SourceLabels {
            source: source.as_str(),
        });
    }

    /// Publishes the checker's own counters and state size; the run loop calls this on each tick
    /// (or at least once per scrape interval). Rendering reads the last snapshot.
    pub fn publish_checker(&self, checker: &Checker, now_ns: u64) {
        let per_rule = checker
            .rules()
            .zip(checker.violations_per_rule())
            .map(|(r, n)| (r.name.clone(), r.severity, *n))
            .collect();
        self.publish_checker_stats(CheckerSnapshot {
            stats: checker.stats(),
            per_rule,
            state_bytes: checker.state_bytes() as u64,
            published_at_ns: now_ns,
        });
    }

    /// Renders the OTLP receivers' counters at every scrape from now on.
    pub fn attach_otlp(&self, stats: Arc<crate::ingest::otlp::OtlpStats>) {
        *self.otlp.stats.lock().unwrap_or_else(|p| p.into_inner()) = Some(stats);
    }

    /// Renders the eBPF source's counters at every scrape from now on.
    pub fn attach_ebpf(&self, stats: Arc<crate::ingest::ebpf::EbpfStats>) {
        *self.ebpf.stats.lock().unwrap_or_else(|p| p.into_inner()) = Some(stats);
    }

    pub fn publish_checker_stats(&self, snap: CheckerSnapshot) {
        *self.checker.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(snap);
    }
}

fn default_reason(p: DropPoint) -> &'static str {
    match p {
        DropPoint::KernelRingbuf => "full",
        DropPoint::EventChannel => "full",
        DropPoint::ViolationChannel => "full",
        DropPoint::Spool => "full",
        DropPoint::Sink => "permanent_error",
        DropPoint::EbpfTracker => "connection_evicted",
    }
}

/// What the checker reported at its last publication.
#[derive(Debug, Clone, Default)]
pub struct CheckerSnapshot {
    pub stats: CheckerStats,
    /// (rule, severity, violations so far) for each enabled rule.
    pub per_rule: Vec<(String, Severity, u64)>,
    pub state_bytes: u64,
    /// Wall clock (unix ns) at publication: the watermark delay is measured against it.
    pub published_at_ns: u64,
}

/// Renders the last [`CheckerSnapshot`] at scrape time: the checker keeps plain `u64` counters
/// (it is sans-IO and single-threaded), so they are exported as const metrics, not re-counted.
#[derive(Debug, Default)]
struct CheckerCollector {
    last: Mutex<Option<CheckerSnapshot>>,
}

pub(crate) fn counter(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    v: u64,
) -> std::fmt::Result {
    let c = ConstCounter::new(v);
    let m = enc.encode_descriptor(name, help, None, c.metric_type())?;
    c.encode(m)
}

pub(crate) fn gauge(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    v: f64,
) -> std::fmt::Result {
    let g = ConstGauge::new(v);
    let m = enc.encode_descriptor(name, help, None, g.metric_type())?;
    g.encode(m)
}

fn labelled_counters<L: EncodeLabelSet>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    values: &[(L, u64)],
) -> std::fmt::Result {
    let mut m = enc.encode_descriptor(
        name,
        help,
        None,
        prometheus_client::metrics::MetricType::Counter,
    )?;
    for (labels, v) in values {
        let fam = m.encode_family(labels)?;
        ConstCounter::new(*v).encode(fam)?;
    }
    Ok(())
}

impl Collector for CheckerCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let guard = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let Some(s) = guard.as_ref() else {
            return Ok(());
        };
        let st = &s.stats;
        let c = &st.correlate;
        labelled_counters(
            &mut enc,
            "revenant_checker_events",
            "Events the checker processed, by how they were attributed",
            &[
                ([("attribution", "attempt")], st.events_attempt),
                ([("attribution", "request_only")], st.events_request_only),
                ([("attribution", "unattributed")], st.events_unattributed),
                ([("attribution", "capacity")], st.capacity_reports),
            ],
        )?;
        counter(
            &mut enc,
            "revenant_checker_late_events",
            "Events older than the watermark (beyond the allowed lateness) when they arrived",
            st.events_late,
        )?;
        counter(
            &mut enc,
            "revenant_checker_tombstone_events",
            "Events for attempts already compacted to a tombstone",
            st.events_on_tombstones,
        )?;
        counter(
            &mut enc,
            "revenant_checker_corroborations",
            "Follow-ups emitted because a second source proved an already reported breach (not counted as violations)",
            st.corroborations,
        )?;
        counter(
            &mut enc,
            "revenant_checker_repeat_breaches",
            "Breaches of a rule that already fired for the same attempt (not re-emitted)",
            st.repeats,
        )?;
        counter(
            &mut enc,
            "revenant_checker_alias_conflicts",
            "Events whose room and rid named different attempts",
            c.alias_conflicts,
        )?;
        labelled_counters(
            &mut enc,
            "revenant_checker_evictions",
            "State evicted from the checker, by what and why",
            &[
                ([("what", "attempt"), ("reason", "ttl")], c.evicted_ttl),
                ([("what", "attempt"), ("reason", "capacity")], c.evicted_cap),
                (
                    [("what", "tombstone"), ("reason", "expired")],
                    c.tombstones_expired,
                ),
                (
                    [("what", "tombstone"), ("reason", "capacity")],
                    c.tombstones_evicted_cap,
                ),
                (
                    [("what", "request"), ("reason", "expired")],
                    c.requests_expired,
                ),
            ],
        )?;
        gauge(
            &mut enc,
            "revenant_checker_live_attempts",
            "Attempts tracked with full state",
            st.live_attempts as f64,
        )?;
        gauge(
            &mut enc,
            "revenant_checker_live_requests",
            "Client requests tracked",
            st.live_requests as f64,
        )?;
        gauge(
            &mut enc,
            "revenant_checker_request_records",
            "Client requests tracked with a record of their own (the others live in their only attempt)",
            st.request_records as f64,
        )?;
        gauge(
            &mut enc,
            "revenant_checker_tombstones",
            "Compact tombstones of ended attempts kept to catch late activity",
            st.tombstones as f64,
        )?;
        gauge(
            &mut enc,
            "revenant_checker_state_bytes",
            "Bytes reserved by the checker's state tables",
            s.state_bytes as f64,
        )?;
        gauge(
            &mut enc,
            "revenant_checker_watermark_timestamp_seconds",
            "Event-time watermark (unix seconds): events older than this are late",
            st.watermark_ns as f64 / 1e9,
        )?;
        let delay = if st.watermark_ns == 0 {
            0.0
        } else {
            s.published_at_ns.saturating_sub(st.watermark_ns) as f64 / 1e9
        };
        gauge(
            &mut enc,
            "revenant_checker_watermark_delay_seconds",
            "Wall clock minus the event-time watermark at the last checker publication",
            delay,
        )?;
        let per_rule: Vec<_> = s
            .per_rule
            .iter()
            .map(|(rule, sev, n)| ([("rule", rule.as_str()), ("severity", sev.as_str())], *n))
            .collect();
        labelled_counters(
            &mut enc,
            "revenant_checker_violations",
            "Violations the checker emitted, by rule and severity (one per rule and attempt; corroborating follow-ups are counted apart)",
            &per_rule,
        )?;
        Ok(())
    }
}

/// Label helpers for the hot path.
pub fn event_labels(source: Source, stage: Stage, kind: Kind) -> EventLabels {
    EventLabels {
        source: source.as_str(),
        stage: stage.as_str(),
        kind: kind.as_str(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_names_and_checker_snapshot() {
        let m = Metrics::new();
        m.events
            .get_or_create(&event_labels(Source::Otlp, Stage::Prefill, Kind::Rejected))
            .inc();
        m.declare_sink("webhook-0");
        let mut snap = CheckerSnapshot::default();
        snap.stats.live_attempts = 7;
        snap.stats.correlate.evicted_cap = 3;
        snap.per_rule = vec![("activity-after-rejection".into(), Severity::Critical, 2)];
        m.publish_checker_stats(snap);
        let otlp = Arc::new(crate::ingest::otlp::OtlpStats::default());
        otlp.rejected(
            crate::ingest::otlp::Transport::Grpc,
            crate::ingest::otlp::RejectReason::PipelineFull,
            10,
        );
        m.attach_otlp(otlp);
        let text = m.render();
        for needle in [
            "revenant_events_total{source=\"otlp\",stage=\"prefill\",kind=\"rejected\"} 1",
            "revenant_dropped_items_total{point=\"spool\",reason=\"full\"} 0",
            "revenant_alert_deliveries_total{sink=\"webhook-0\",outcome=\"success\"} 0",
            "revenant_checker_live_attempts 7",
            "revenant_checker_evictions_total{what=\"attempt\",reason=\"capacity\"} 3",
            "revenant_checker_violations_total{rule=\"activity-after-rejection\",severity=\"critical\"} 2",
            "revenant_build_info{version=",
            "revenant_otlp_requests_rejected_total{transport=\"grpc\",reason=\"pipeline_full\"} 1",
            "revenant_otlp_rejected_items_total{transport=\"grpc\",reason=\"pipeline_full\"} 10",
            "revenant_otlp_requests_rejected_total{transport=\"http\",reason=\"malformed\"} 0",
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
    }
}
