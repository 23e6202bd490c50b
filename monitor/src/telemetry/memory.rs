//! The memory budget's account: per structure that grows with traffic, its cap (its share of
//! `--memory-budget`), its estimated use and how many entries it evicted at that cap. The owners
//! write their figures (atomics, no lock); [`MemoryWatch`] turns new evictions into a
//! rate-limited WARN and a "degraded" note in `/readyz`; the collector renders
//! `revenant_memory_budget_bytes`, `revenant_memory_cap_bytes{structure}`,
//! `revenant_memory_estimated_bytes{structure}` and `revenant_memory_evictions_total{structure}`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::gauge::ConstGauge;

use super::metrics::{Metrics, counters, gauge};
use super::ready::Readiness;
use crate::event::{EventBatch, LifecycleEvent, Source};

/// A structure with a share of the budget: the `structure` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Structure {
    /// The checker's live attempts (and their requests, aliases and deadlines).
    Attempts = 0,
    /// The checker's tombstones of ended attempts.
    Tombstones = 1,
    /// The SGLang span tree: resolved spans, orphans waiting for their root, completions in
    /// their grace period.
    SpanTree = 2,
    /// Events queued between the sources and the checker.
    EventChannel = 3,
    /// The `/api/requests/{id}` history.
    Timeline = 4,
    /// The `/api/violations` ring.
    RecentViolations = 5,
}

impl Structure {
    pub const ALL: [Structure; 6] = [
        Structure::Attempts,
        Structure::Tombstones,
        Structure::SpanTree,
        Structure::EventChannel,
        Structure::Timeline,
        Structure::RecentViolations,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Structure::Attempts => "attempts",
            Structure::Tombstones => "tombstones",
            Structure::SpanTree => "span_tree",
            Structure::EventChannel => "event_channel",
            Structure::Timeline => "timeline",
            Structure::RecentViolations => "recent_violations",
        }
    }

    /// Whether an eviction here can cost a verdict (an attempt judged on part of its events, a
    /// late event no longer tied to its attempt). The admin rings evict their oldest entry as
    /// their normal way of working; the channel refuses (the client retries) instead of evicting.
    pub fn eviction_loses_verdicts(self) -> bool {
        matches!(
            self,
            Structure::Attempts | Structure::Tombstones | Structure::SpanTree
        )
    }
}

const N: usize = Structure::ALL.len();

/// Heap an event holds besides its struct (rid, trace id, node, detail), for the estimates.
pub const EVENT_HEAP_BYTES: usize = 128;

/// Bytes one queued batch holds: its vector's capacity and its events' strings. The sender
/// charges it to [`Structure::EventChannel`] and the engine task credits it back on receipt.
pub fn batch_bytes(batch: &EventBatch) -> u64 {
    (batch.capacity() * std::mem::size_of::<LifecycleEvent>() + batch.len() * EVENT_HEAP_BYTES)
        as u64
}

/// The budget, each structure's cap and what its owner last reported.
#[derive(Debug)]
pub struct MemoryAccount {
    budget: u64,
    caps: [u64; N],
    used: [AtomicU64; N],
    evictions: [AtomicU64; N],
}

impl MemoryAccount {
    /// `caps`: bytes per structure; a structure not listed has no share (cap 0).
    pub fn new(budget: u64, caps: &[(Structure, u64)]) -> MemoryAccount {
        let mut c = [0; N];
        for (s, b) in caps {
            c[*s as usize] = *b;
        }
        MemoryAccount {
            budget,
            caps: c,
            used: Default::default(),
            evictions: Default::default(),
        }
    }

    /// No cap anywhere: for a pipeline built without a budget (tests, tools).
    pub fn unlimited() -> MemoryAccount {
        MemoryAccount::new(u64::MAX, &Structure::ALL.map(|s| (s, u64::MAX)))
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    pub fn cap(&self, s: Structure) -> u64 {
        self.caps[s as usize]
    }

    pub fn used(&self, s: Structure) -> u64 {
        self.used[s as usize].load(Relaxed)
    }

    /// The owner's estimate of what `s` holds now.
    pub fn set_used(&self, s: Structure, bytes: u64) {
        self.used[s as usize].store(bytes, Relaxed);
    }

    /// For a structure several writers fill and one drains (the event channel).
    pub fn add_used(&self, s: Structure, bytes: u64) {
        self.used[s as usize].fetch_add(bytes, Relaxed);
    }

    pub fn sub_used(&self, s: Structure, bytes: u64) {
        let _ =
            self.used[s as usize].fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(bytes)));
    }

    /// Credits back what the OTLP receivers charged the event channel for `batch`, once the
    /// channel's consumer (the engine task, or an agent's batcher) has taken it. Only they charge
    /// it: a source's batches are all its own, and the eBPF source's are bounded by its batch size
    /// and answered by counted drops.
    pub fn taken_from_channel(&self, batch: &EventBatch) {
        if batch.first().is_some_and(|e| e.source == Source::Otlp) {
            self.sub_used(Structure::EventChannel, batch_bytes(batch));
        }
    }

    /// Whether `s` has reached its cap.
    pub fn full(&self, s: Structure) -> bool {
        self.used(s) >= self.cap(s)
    }

    pub fn evictions(&self, s: Structure) -> u64 {
        self.evictions[s as usize].load(Relaxed)
    }

    /// The owner's running total of entries evicted at the cap (it keeps its own counter).
    pub fn set_evictions(&self, s: Structure, total: u64) {
        self.evictions[s as usize].store(total, Relaxed);
    }

    /// Estimated use of every structure together.
    pub fn total_used(&self) -> u64 {
        Structure::ALL.iter().map(|s| self.used(*s)).sum()
    }
}

/// Renders the account at every scrape from now on.
pub fn register(metrics: &Metrics, account: Arc<MemoryAccount>) {
    metrics.register_collector(AccountCollector(account));
}

#[derive(Debug)]
struct AccountCollector(Arc<MemoryAccount>);

/// A gauge family: one series per `structure`.
fn per_structure(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: impl Fn(Structure) -> u64,
) -> std::fmt::Result {
    use prometheus_client::encoding::EncodeMetric;
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for s in Structure::ALL {
        let labels = [("structure", s.as_str())];
        let fam = m.encode_family(&labels)?;
        ConstGauge::new(value(s) as i64).encode(fam)?;
    }
    Ok(())
}

impl Collector for AccountCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let a = &self.0;
        gauge(
            &mut enc,
            "revenant_memory_budget_bytes",
            "The memory budget (--memory-budget) the structures below share",
            a.budget as i64,
        )?;
        per_structure(
            &mut enc,
            "revenant_memory_cap_bytes",
            "Each structure's share of the memory budget",
            |s| a.cap(s),
        )?;
        per_structure(
            &mut enc,
            "revenant_memory_estimated_bytes",
            "Estimated bytes each structure holds now",
            |s| a.used(s),
        )?;
        counters(
            &mut enc,
            "revenant_memory_evictions",
            "Entries a structure evicted because it reached its share of the memory budget (attempts and tombstones: revenant_checker_evictions_total{reason=\"capacity\"}; the admin rings evict their oldest as they turn over)",
            Structure::ALL.map(|s| ([("structure", s.as_str())], a.evictions(s))),
        )?;
        Ok(())
    }
}

/// How often one structure may log its eviction WARN.
pub const PRESSURE_LOG_INTERVAL: Duration = Duration::from_secs(60);
/// A structure is under pressure until it has evicted nothing for this long.
pub const PRESSURE_CLEAR_AFTER: Duration = Duration::from_secs(120);

/// One WARN line: `count` entries evicted from `structure` since its previous line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PressureWarning {
    pub structure: Structure,
    pub count: u64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Watched {
    seen: u64,
    /// Evictions not yet reported in a WARN line.
    unreported: u64,
    last_warn: Option<Instant>,
    last_eviction: Option<Instant>,
}

/// Turns the account's eviction totals into pressure: sans-IO (`observe(account, now)`), driven
/// once a second by the engine task.
#[derive(Debug, Default)]
pub struct MemoryWatch {
    watched: [Watched; N],
}

impl MemoryWatch {
    /// The WARN lines due now, and the structures under pressure (verdict-losing evictions within
    /// [`PRESSURE_CLEAR_AFTER`]).
    pub fn observe(
        &mut self,
        a: &MemoryAccount,
        now: Instant,
    ) -> (Vec<PressureWarning>, Vec<Structure>) {
        let mut warnings = Vec::new();
        let mut pressure = Vec::new();
        for s in Structure::ALL {
            if !s.eviction_loses_verdicts() {
                continue;
            }
            let w = &mut self.watched[s as usize];
            let total = a.evictions(s);
            let new = total.saturating_sub(w.seen);
            w.seen = total;
            if new > 0 {
                w.unreported += new;
                w.last_eviction = Some(now);
            }
            let due = w
                .last_warn
                .is_none_or(|t| now.saturating_duration_since(t) >= PRESSURE_LOG_INTERVAL);
            if w.unreported > 0 && due {
                warnings.push(PressureWarning {
                    structure: s,
                    count: std::mem::take(&mut w.unreported),
                });
                w.last_warn = Some(now);
            }
            if w.last_eviction
                .is_some_and(|t| now.saturating_duration_since(t) < PRESSURE_CLEAR_AFTER)
            {
                pressure.push(s);
            }
        }
        (warnings, pressure)
    }

    /// [`Self::observe`], then the WARN lines and the `memory` entry of `/readyz`'s `degraded`.
    pub fn report(&mut self, a: &MemoryAccount, readiness: Option<&Readiness>, now: Instant) {
        let (warnings, pressure) = self.observe(a, now);
        for w in warnings {
            tracing::warn!(
                structure = w.structure.as_str(),
                evicted = w.count,
                cap_bytes = a.cap(w.structure),
                budget_bytes = a.budget(),
                "memory budget under pressure: {} evicted {} entries at its share of the budget \
                 since the last line; verdicts may miss activity (raise --memory-budget, \
                 config memory_budget)",
                w.structure.as_str(),
                w.count
            );
        }
        if let Some(r) = readiness {
            r.set_degraded("memory", degraded_note(&pressure));
        }
    }
}

/// The `/readyz` note for the structures under pressure, `None` when there are none.
pub fn degraded_note(pressure: &[Structure]) -> Option<String> {
    if pressure.is_empty() {
        return None;
    }
    let names: Vec<&str> = pressure.iter().map(|s| s.as_str()).collect();
    Some(format!(
        "memory budget under pressure: {} evicting at their share (raise --memory-budget)",
        names.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn account() -> MemoryAccount {
        MemoryAccount::new(
            1000,
            &[
                (Structure::Attempts, 400),
                (Structure::SpanTree, 300),
                (Structure::Timeline, 100),
            ],
        )
    }

    #[test]
    fn renders_budget_caps_use_and_evictions_per_structure() {
        let m = Metrics::new();
        let a = Arc::new(account());
        register(&m, a.clone());
        a.set_used(Structure::SpanTree, 250);
        a.add_used(Structure::EventChannel, 70);
        a.sub_used(Structure::EventChannel, 100);
        a.set_evictions(Structure::SpanTree, 9);
        let text = m.render();
        for needle in [
            "revenant_memory_budget_bytes 1000",
            "revenant_memory_cap_bytes{structure=\"attempts\"} 400",
            "revenant_memory_cap_bytes{structure=\"tombstones\"} 0",
            "revenant_memory_estimated_bytes{structure=\"span_tree\"} 250",
            "revenant_memory_estimated_bytes{structure=\"event_channel\"} 0",
            "revenant_memory_evictions_total{structure=\"span_tree\"} 9",
            "revenant_memory_evictions_total{structure=\"recent_violations\"} 0",
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
        assert!(!a.full(Structure::SpanTree));
        a.set_used(Structure::SpanTree, 300);
        assert!(a.full(Structure::SpanTree));
    }

    #[test]
    fn evictions_warn_once_per_interval_and_pressure_clears_when_they_stop() {
        let a = account();
        let mut w = MemoryWatch::default();
        let t0 = Instant::now();
        assert_eq!(w.observe(&a, t0), (vec![], vec![]));
        a.set_evictions(Structure::SpanTree, 5);
        let (warn, pressure) = w.observe(&a, t0 + Duration::from_secs(1));
        assert_eq!(
            warn,
            vec![PressureWarning {
                structure: Structure::SpanTree,
                count: 5
            }]
        );
        assert_eq!(pressure, vec![Structure::SpanTree]);
        // More evictions within the interval: counted, not logged yet.
        a.set_evictions(Structure::SpanTree, 12);
        let (warn, _) = w.observe(&a, t0 + Duration::from_secs(30));
        assert!(warn.is_empty());
        let (warn, _) = w.observe(&a, t0 + Duration::from_secs(61));
        assert_eq!(warn[0].count, 7, "the evictions since the previous line");
        // Still within the clear window of the last eviction (at 30 s).
        let (_, pressure) = w.observe(&a, t0 + Duration::from_secs(100));
        assert_eq!(pressure, vec![Structure::SpanTree]);
        let (warn, pressure) = w.observe(&a, t0 + Duration::from_secs(151));
        assert!(warn.is_empty() && pressure.is_empty());
        assert_eq!(degraded_note(&pressure), None);
    }

    #[test]
    fn ring_turnover_is_not_pressure() {
        let a = account();
        let mut w = MemoryWatch::default();
        a.set_evictions(Structure::Timeline, 1_000_000);
        a.set_evictions(Structure::RecentViolations, 10);
        let (warn, pressure) = w.observe(&a, Instant::now());
        assert!(warn.is_empty() && pressure.is_empty());
    }

    #[test]
    fn the_readyz_note_names_the_structures_and_the_flag() {
        let m = Arc::new(Metrics::new());
        let r = Readiness::new(m, Duration::from_secs(60));
        let a = account();
        a.set_evictions(Structure::Attempts, 3);
        let mut w = MemoryWatch::default();
        w.report(&a, Some(&r), Instant::now());
        let note = &r.report().degraded["memory"];
        assert!(note.contains("attempts"), "{note}");
        assert!(note.contains("--memory-budget"), "{note}");
    }
}
