//! What the end-to-end test files share: the binaries, one run at a time, the witnesses a run
//! uses, and the figures read off revenant's metrics.

use std::sync::{Mutex, OnceLock};

use test_harness::{Binaries, Sample, metric_sum};

pub fn bins() -> &'static Binaries {
    static B: OnceLock<Binaries> = OnceLock::new();
    B.get_or_init(|| {
        Binaries::locate().unwrap_or_else(|e| {
            panic!("cannot find or build the revenant and pd-sim binaries: {e:#}")
        })
    })
}

/// One end-to-end run at a time: each pushes thousands of requests through four processes on a
/// 2-core machine.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static M: Mutex<()> = Mutex::new(());
    M.lock().unwrap_or_else(|p| p.into_inner())
}

/// Which witnesses revenant hears in a run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sources {
    Otlp,
    Ebpf,
    Both,
}

impl Sources {
    pub fn otlp(self) -> bool {
        self != Sources::Ebpf
    }
    pub fn ebpf(self) -> bool {
        self != Sources::Otlp
    }
}

/// `revenant_events_total` of one source, stage and kind.
pub fn events(metrics: &[Sample], source: &str, stage: &str, kind: &str) -> u64 {
    metric_sum(
        metrics,
        "revenant_events_total",
        &[("source", source), ("stage", stage), ("kind", kind)],
    ) as u64
}

/// Every non-zero `revenant_dropped_items_total` series: a clean result must not come from
/// dropped evidence.
pub fn drops(metrics: &[Sample]) -> Vec<String> {
    metrics
        .iter()
        .filter(|s| s.name == "revenant_dropped_items_total" && s.value > 0.0)
        .map(|s| format!("{:?} {}", s.labels, s.value))
        .collect()
}

/// Spans a pd-sim process's exporter lost (`/sim/stats` `otlp`).
pub fn sim_span_losses(stats: &serde_json::Value) -> u64 {
    stats["otlp"]["spans_dropped_queue_full"]
        .as_u64()
        .unwrap_or(0)
        + stats["otlp"]["spans_failed"].as_u64().unwrap_or(0)
}

/// One run's figures on one line of stderr (`--nocapture` shows them).
pub fn report(
    name: &str,
    elapsed: std::time::Duration,
    load: &serde_json::Value,
    metrics: &[Sample],
    notifications: usize,
) {
    let by_rule: std::collections::BTreeMap<String, u64> = metrics
        .iter()
        .filter(|s| s.name == "revenant_checker_violations_total" && s.value > 0.0)
        .map(|s| (s.labels["rule"].clone(), s.value as u64))
        .collect();
    eprintln!(
        "{name}: {elapsed:.1?} total; load sent {} ok {} rejected {:?} at {:.0}/s; events otlp {} ebpf {}; violations {by_rule:?}; notifications {notifications}",
        load["sent"],
        load["ok"],
        load["rejected_by_status"],
        load["achieved_rate"].as_f64().unwrap_or(0.0),
        metric_sum(metrics, "revenant_events_total", &[("source", "otlp")]),
        metric_sum(metrics, "revenant_events_total", &[("source", "ebpf")]),
    );
    // What the eBPF source says of its own coverage (kernel map and ring-buffer counters,
    // desyncs, gaps, evicted connections): a run that saw too few events says here whether it
    // knew it was blind. Printed, not judged: `assert_no_loss` judges the drops.
    let ebpf: Vec<String> = metrics
        .iter()
        .filter(|s| s.name.starts_with("revenant_ebpf_") && s.value > 0.0)
        .map(|s| {
            let labels: Vec<String> = s.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            format!("{}{{{}}} {}", s.name, labels.join(","), s.value)
        })
        .collect();
    if !ebpf.is_empty() {
        eprintln!("{name}: eBPF source: {}", ebpf.join("; "));
    }
}

/// How many `activity-after-rejection` findings carry each combination of evidence sources
/// (`ebpf`, `otlp`, `ebpf+otlp`).
pub fn sources_of(
    notifications: &[serde_json::Value],
) -> std::collections::BTreeMap<String, usize> {
    sources_of_rule(notifications, "activity-after-rejection")
}

/// How many findings of `rule` carry each combination of evidence sources.
pub fn sources_of_rule(
    notifications: &[serde_json::Value],
    rule: &str,
) -> std::collections::BTreeMap<String, usize> {
    let mut m = std::collections::BTreeMap::new();
    for f in notifications
        .iter()
        .filter_map(|n| test_harness::notifications::finding(n, rule))
    {
        *m.entry(test_harness::notifications::evidence_sources(f).join("+"))
            .or_default() += 1;
    }
    m
}
