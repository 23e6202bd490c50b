//! The checker's telemetry: its plain `u64` counters and state size, taken as a
//! [`CheckerSnapshot`] by the task that drives it and rendered from the last one at scrape time.
//! The engine itself stays sans-IO: it never touches the registry, the driver publishes.

use prometheus_client::encoding::DescriptorEncoder;

use super::{Checker, CheckerStats};
use crate::telemetry::metrics::{Snapshot, counter, counters, gauge};
use crate::violation::Severity;

/// What became of the rid-only events a split engine's router held until an event linked their
/// rid to a room ([`crate::engine::shard`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShardWaits {
    /// Released to the room's shard when an event linked their rid to it.
    pub linked: u64,
    /// Released to the rid's own shard when the wait ran out.
    pub unlinked: u64,
    /// Released to the rid's own shard early, the waiting room being full.
    pub evicted: u64,
    /// Waiting now.
    pub waiting: u64,
}

/// What the checker reported at its last publication.
#[derive(Debug, Clone, Default)]
pub struct CheckerSnapshot {
    pub stats: CheckerStats,
    /// (rule, severity, violations so far) for each enabled rule.
    pub per_rule: Vec<(String, Severity, u64)>,
    pub state_bytes: u64,
    /// Of `state_bytes`, the tombstone tables'.
    pub tombstone_bytes: u64,
    /// Checkers summed into this snapshot (the engine's shards).
    pub shards: u64,
    /// What became of the rid-only events that waited for their room (a split engine only).
    pub waits: ShardWaits,
    /// Wall clock (unix ns) at publication: the watermark delay is measured against it.
    pub published_at_ns: u64,
}

impl CheckerSnapshot {
    /// The checker's counters now; `now_ns` is the driver's wall clock (unix ns).
    pub fn of(checker: &Checker, now_ns: u64) -> CheckerSnapshot {
        let per_rule = checker
            .rules()
            .zip(checker.violations_per_rule())
            .map(|(r, n)| (r.name.clone(), r.severity, *n))
            .collect();
        CheckerSnapshot {
            stats: checker.stats(),
            per_rule,
            state_bytes: checker.state_bytes() as u64,
            tombstone_bytes: checker.tombstone_bytes() as u64,
            shards: 1,
            waits: ShardWaits::default(),
            published_at_ns: now_ns,
        }
    }

    /// Adds another shard's snapshot (of a checker with the same rules) to this one.
    pub fn absorb(&mut self, o: &CheckerSnapshot) {
        self.stats.absorb(&o.stats);
        for (mine, theirs) in self.per_rule.iter_mut().zip(&o.per_rule) {
            mine.2 += theirs.2;
        }
        self.state_bytes += o.state_bytes;
        self.tombstone_bytes += o.tombstone_bytes;
        self.shards += o.shards;
        self.published_at_ns = self.published_at_ns.max(o.published_at_ns);
    }
}

impl Snapshot for CheckerSnapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let s = self;
        let st = &s.stats;
        let c = &st.correlate;
        counters(
            &mut enc,
            "revenant_checker_events",
            "Events the checker processed, by how they were attributed",
            [
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
        counters(
            &mut enc,
            "revenant_checker_evictions",
            "State evicted from the checker, by what and why",
            [
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
                (
                    [("what", "request"), ("reason", "capacity")],
                    c.requests_evicted_cap,
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
            "revenant_checker_shards",
            "Checkers judging side by side (engine.shards), each on a thread of its own",
            s.shards as f64,
        )?;
        if s.shards > 1 {
            let w = &s.waits;
            counters(
                &mut enc,
                "revenant_checker_shard_waits",
                "Events naming only a rid whose room was not known yet, held by the split engine's router, by how their wait ended (unlinked and evicted ones were judged on the rid's own shard: if their room comes later, one checker would have merged what two shards judge apart)",
                [
                    ([("outcome", "linked")], w.linked),
                    ([("outcome", "unlinked")], w.unlinked),
                    ([("outcome", "evicted")], w.evicted),
                ],
            )?;
            gauge(
                &mut enc,
                "revenant_checker_shard_waiting_events",
                "Events the split engine's router holds until their rid's room is known",
                w.waiting as f64,
            )?;
        }
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
        counters(
            &mut enc,
            "revenant_checker_violations",
            "Violations the checker emitted, by rule and severity (one per rule and attempt; corroborating follow-ups are counted apart)",
            per_rule,
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::metrics::Metrics;

    #[test]
    fn renders_the_last_snapshot() {
        let m = Metrics::new();
        assert!(!m.render().contains("revenant_checker_"));
        let mut snap = CheckerSnapshot::default();
        snap.stats.live_attempts = 7;
        snap.stats.correlate.evicted_cap = 3;
        snap.per_rule = vec![("activity-after-rejection".into(), Severity::Critical, 2)];
        m.publish(snap);
        let text = m.render();
        for needle in [
            "revenant_checker_live_attempts 7",
            "revenant_checker_evictions_total{what=\"attempt\",reason=\"capacity\"} 3",
            "revenant_checker_violations_total{rule=\"activity-after-rejection\",severity=\"critical\"} 2",
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
    }
}
