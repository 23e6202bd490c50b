//! The metric registry every component shares (`Arc<Metrics>`), rendered at `/metrics`.
//!
//! The families every component bumps through [`super::events`] are fields here. A component
//! with counters of its own adds them in one of two ways, both ending in the registry's
//! collectors: live atomics through [`Metrics::register_collector`], or a [`Snapshot`] of plain
//! counters through [`Metrics::publish`] (rendered from its last publication).
//!
//! Names follow `revenant_<noun>_<unit>_total` (prometheus-client appends `_total` to counters).
//! Every label value comes from a small closed set (stage, kind, source, drop point, sink name from
//! the config, rule name from the rule set): never a request id, trace id or room.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeGaugeValue, EncodeLabelSet, EncodeMetric,
};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

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
    /// Cluster mode: the agent's outbox on disk was full (or could not be written); counted in
    /// events. Declared by `revenant agent` only.
    BusOutbox,
    /// Cluster mode: a message on the stream the checker could not decode; counted in
    /// messages. Declared by `revenant checker` only.
    BusMessage,
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
            DropPoint::BusOutbox => "bus_outbox",
            DropPoint::BusMessage => "bus_message",
        }
    }
}

/// Why something was dropped: the `reason` label of `revenant_dropped_items_total`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum DropReason {
    /// A bounded buffer (ring buffer, channel, spool) had no room.
    Full,
    /// The violation channel was closed (shutting down).
    Closed,
    /// A spool entry could not be read back.
    Corrupt,
    /// A spooled notification's sink is no longer configured.
    SinkRemoved,
    /// The spool could not write the notification.
    WriteError,
    /// A sink refused an alert for good.
    PermanentError,
    /// The kernel's in-flight syscall table was full.
    SyscallTableFull,
    /// The kernel's socket table was full.
    SocketTableFull,
    /// A ring-buffer record could not be decoded.
    Undecodable,
    /// A tracked connection was evicted from the bounded connection table.
    ConnectionEvicted,
}

impl DropReason {
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::Full => "full",
            DropReason::Closed => "closed",
            DropReason::Corrupt => "corrupt",
            DropReason::SinkRemoved => "sink_removed",
            DropReason::WriteError => "write_error",
            DropReason::PermanentError => "permanent_error",
            DropReason::SyscallTableFull => "syscall_table_full",
            DropReason::SocketTableFull => "socket_table_full",
            DropReason::Undecodable => "undecodable",
            DropReason::ConnectionEvicted => "connection_evicted",
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
    /// The git commit (`telemetry::build`).
    pub revision: &'static str,
    pub build_date: &'static str,
    pub rustc: &'static str,
    /// SHA-256 of the embedded eBPF object, or `none` in a build without it.
    pub ebpf_sha256: &'static str,
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

/// A component's counters as they stood at its last publication, rendered at every scrape until
/// the next one (see [`Metrics::publish`]). For components that keep plain `u64`s rather than
/// atomics (the sans-IO checker), so they are exported as const metrics, not re-counted.
pub trait Snapshot: std::fmt::Debug + Send + Sync + 'static {
    fn encode(&self, enc: DescriptorEncoder) -> std::fmt::Result;
}

/// The registered collector of one [`Snapshot`] type.
#[derive(Debug)]
struct Latest<S>(Mutex<S>);

impl<S: Snapshot> Collector for Latest<S> {
    fn encode(&self, enc: DescriptorEncoder) -> std::fmt::Result {
        lock(&self.0).encode(enc)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// All of revenant's own metrics. Components take an `Arc<Metrics>` and bump them through the
/// internal events in [`super::events`]; only the admin server reads the registry.
pub struct Metrics {
    registry: Mutex<Registry>,
    /// One [`Latest`] per published [`Snapshot`] type, keyed by that type.
    published: Mutex<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>,
    pub events: Family<EventLabels, Counter>,
    pub event_lag: Family<SourceLabels, Histogram, fn() -> Histogram>,
    pub source_last_event: Family<SourceLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub dropped: Family<DropLabels, Counter>,
    pub alerts_received: Family<RuleLabels, Counter>,
    pub alerts_deduplicated: Family<RuleLabel, Counter>,
    pub alerts_sent_before: Family<RuleLabel, Counter>,
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
        let alerts_sent_before = Family::default();
        r.register(
            "revenant_alerts_sent_before",
            "Notifications not spooled because another process had sent them (cluster mode: an earlier life of this checker, or another replica, found the same breach)",
            alerts_sent_before.clone(),
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
            "Incident notifications waiting before being spooled: for their group wait, corroboration, or (cluster mode) the lookup of whether another checker sent them",
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
                version: super::build::VERSION,
                revision: super::build::COMMIT,
                build_date: super::build::BUILD_DATE,
                rustc: super::build::RUSTC,
                ebpf_sha256: super::build::ebpf_label(),
            })
            .set(1);
        r.register(
            "revenant_build_info",
            "Build information: version, git revision, build date, compiler, embedded eBPF object",
            build,
        );
        r.register_collector(Box::new(super::process::ProcessCollector));
        // Drop counters exist from the start at 0, so that `increase()` sees the first drop.
        for p in DropPoint::ALL {
            let _ = dropped.get_or_create(&DropLabels {
                point: p.as_str(),
                reason: default_reason(p).as_str(),
            });
        }
        Metrics {
            registry: Mutex::new(r),
            published: Mutex::default(),
            events,
            event_lag,
            source_last_event,
            dropped,
            alerts_received,
            alerts_deduplicated,
            alerts_sent_before,
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
        }
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(16 * 1024);
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &lock(&self.registry));
        out
    }

    /// The exposition in `format` (what `/metrics` answers after negotiating on `Accept`).
    pub fn render_as(&self, format: super::exposition::Format) -> String {
        match format {
            super::exposition::Format::OpenMetrics => self.render(),
            super::exposition::Format::Text => super::exposition::to_text_004(&self.render()),
        }
    }

    /// Renders `collector` at every scrape from now on, after the families and the collectors
    /// registered before it.
    pub fn register_collector(&self, collector: impl Collector) {
        lock(&self.registry).register_collector(Box::new(collector));
    }

    /// Replaces the last published snapshot of this type; the first publication registers its
    /// collector. Nothing of the type is rendered before it.
    pub fn publish<S: Snapshot>(&self, snap: S) {
        let slot = {
            let mut published = lock(&self.published);
            match published.get(&TypeId::of::<S>()) {
                Some(slot) => slot.clone(),
                None => {
                    let slot = Arc::new(Latest(Mutex::new(snap)));
                    published.insert(TypeId::of::<S>(), slot.clone());
                    self.register_collector(slot);
                    return;
                }
            }
        };
        if let Ok(slot) = slot.downcast::<Latest<S>>() {
            *lock(&slot.0) = snap;
        }
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
        let label = SinkLabel {
            sink: sink.to_string(),
        };
        let _ = self.delivered_alerts.get_or_create(&label);
        let _ = self.delivery_duration.get_or_create(&label);
        let _ = self.alert_latency.get_or_create(&label);
    }

    /// A source known at start: its series at 0 (every stage and kind of
    /// `revenant_events_total`, its lag histogram) and its last-event time at 0, which the
    /// shipped `RevenantSourceSilent` alert reads as "never delivered".
    /// A drop point outside [`DropPoint::ALL`] (cluster mode's), its series at 0 from the start.
    pub fn declare_drop(&self, point: DropPoint) {
        let _ = self.dropped.get_or_create(&DropLabels {
            point: point.as_str(),
            reason: default_reason(point).as_str(),
        });
    }

    pub fn declare_source(&self, source: Source) {
        let labels = SourceLabels {
            source: source.as_str(),
        };
        let _ = self.source_last_event.get_or_create(&labels);
        let _ = self.event_lag.get_or_create(&labels);
        for stage in crate::event::Stage::ALL {
            for kind in crate::event::Kind::ALL {
                let _ = self
                    .events
                    .get_or_create(&event_labels(source, stage, kind));
            }
        }
    }

    /// A rule known at start: its alerting series at 0 (received, incidents opened, notified,
    /// deduplicated, rate-limited, held, merged by outcome), so the first finding shows in
    /// `rate()` and the dashboard's panels have data before it.
    pub fn declare_rule(&self, rule: &str, severity: &'static str) {
        let _ = self.alerts_received.get_or_create(&RuleLabels {
            rule: rule.to_owned(),
            severity,
        });
        let label = RuleLabel {
            rule: rule.to_owned(),
        };
        for family in [
            &self.incidents_opened,
            &self.alerts_notified,
            &self.alerts_deduplicated,
            &self.alerts_sent_before,
            &self.alerts_rate_limited,
            &self.alerts_held,
        ] {
            let _ = family.get_or_create(&label);
        }
        for outcome in ["pending", "notified", "escalated", "repeated"] {
            let _ = self.findings_merged.get_or_create(&MergeLabels {
                rule: rule.to_owned(),
                outcome,
            });
        }
    }
}

/// The reason each point's series is declared with at start.
pub(crate) fn default_reason(p: DropPoint) -> DropReason {
    match p {
        DropPoint::KernelRingbuf => DropReason::Full,
        DropPoint::EventChannel => DropReason::Full,
        DropPoint::ViolationChannel => DropReason::Full,
        DropPoint::Spool => DropReason::Full,
        DropPoint::Sink => DropReason::PermanentError,
        DropPoint::EbpfTracker => DropReason::ConnectionEvicted,
        DropPoint::BusOutbox => DropReason::Full,
        DropPoint::BusMessage => DropReason::Undecodable,
    }
}

// Const-metric encoders for collectors and snapshots.

/// One unlabelled counter.
pub fn counter(enc: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> std::fmt::Result {
    let c = ConstCounter::new(v);
    let m = enc.encode_descriptor(name, help, None, c.metric_type())?;
    c.encode(m)
}

/// One unlabelled gauge (`f64` or `i64`: they render differently, `3.0` and `3`).
pub fn gauge<N: EncodeGaugeValue>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    v: N,
) -> std::fmt::Result {
    let g = ConstGauge::new(v);
    let m = enc.encode_descriptor(name, help, None, g.metric_type())?;
    g.encode(m)
}

/// A counter family: one series per `(labels, value)` row, in the rows' order.
pub fn counters<L: EncodeLabelSet>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = (L, u64)>,
) -> std::fmt::Result {
    let mut m = enc.encode_descriptor(
        name,
        help,
        None,
        prometheus_client::metrics::MetricType::Counter,
    )?;
    for (labels, v) in rows {
        let fam = m.encode_family(&labels)?;
        ConstCounter::new(v).encode(fam)?;
    }
    Ok(())
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
    fn renders_families_with_declared_zeros() {
        let m = Metrics::new();
        m.events
            .get_or_create(&event_labels(Source::Otlp, Stage::Prefill, Kind::Rejected))
            .inc();
        m.declare_sink("webhook-0");
        let text = m.render();
        for needle in [
            "revenant_events_total{source=\"otlp\",stage=\"prefill\",kind=\"rejected\"} 1",
            "revenant_dropped_items_total{point=\"spool\",reason=\"full\"} 0",
            "revenant_alert_deliveries_total{sink=\"webhook-0\",outcome=\"success\"} 0",
            "revenant_build_info{version=",
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
    }

    #[derive(Debug)]
    struct Answer(u64);

    impl Snapshot for Answer {
        fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
            counter(&mut enc, "revenant_test_answer", "Test snapshot", self.0)
        }
    }

    #[test]
    fn publish_renders_the_last_snapshot_once() {
        let m = Metrics::new();
        assert!(!m.render().contains("revenant_test_answer"));
        m.publish(Answer(41));
        m.publish(Answer(42));
        let text = m.render();
        assert_eq!(
            text.matches("revenant_test_answer_total ").count(),
            1,
            "{text}"
        );
        assert!(text.contains("revenant_test_answer_total 42"), "{text}");
    }
}
