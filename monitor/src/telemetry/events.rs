//! Internal events: one struct per thing that happens to revenant itself. `emit()` writes the log
//! line and bumps the metric with the same bounded labels, so logs and `/metrics` never disagree.
//! Here are the ones every component shares (events observed, items dropped, a component ready);
//! a component's own events live with it (`alert::events`).

use tracing::{info, trace, warn};

use super::metrics::{DropLabels, DropPoint, DropReason, Metrics, SourceLabels, event_labels};
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
