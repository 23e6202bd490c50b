//! What the engine reports about itself: counters, gauges and the size of its tables.

use super::Checker;
use crate::engine::identity::CorrelateStats;

/// Counters the engine keeps about itself (all monotonic except the gauges at the end).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckerStats {
    pub events: u64,
    /// Events naming an attempt (room or rid).
    pub events_attempt: u64,
    /// Events naming only the request (request_id / trace_id).
    pub events_request_only: u64,
    /// Events naming nothing and not capacity reports: only predicate rules see them.
    pub events_unattributed: u64,
    pub capacity_reports: u64,
    /// Events for attempts already compacted to a tombstone.
    pub events_on_tombstones: u64,
    /// Events older than the watermark when they arrived (later than the allowed lateness).
    pub events_late: u64,
    /// Violations emitted (the sum of [`Checker::violations_per_rule`]).
    pub violations: u64,
    /// Breaches of a rule that already fired for the same attempt (not re-emitted).
    pub repeats: u64,
    /// Follow-ups emitted because a new source saw an already reported never-after breach.
    pub corroborations: u64,
    pub timers_fired: u64,
    /// Worker-level dedup memory was full; the violation was emitted but may repeat.
    pub worker_dedup_full: u64,
    /// Events naming a worker beyond the first 65 535 distinct ones: their attempts do not
    /// remember that worker, so a predicate judged again later cannot use its capacity.
    pub workers_untracked: u64,
    pub correlate: CorrelateStats,
    pub live_attempts: u64,
    pub live_requests: u64,
    /// Live requests that have a record (the others are kept by their only attempt).
    pub request_records: u64,
    pub tombstones: u64,
    /// Attempts, requests and tombstones whose rule slots did not fit a packed row (events more
    /// than 9 minutes apart, statuses above 1023, a live attempt's slots holding more than 15
    /// distinct events) and are kept at full width.
    pub wide_slot_rows: u64,
    pub watermark_ns: u64,
    pub max_event_ns: u64,
}

/// Per-rule violation counts, index-aligned with [`Checker::rules`].
pub type RuleCounts = Vec<u64>;

impl Checker {
    pub fn stats(&self) -> CheckerStats {
        let mut s = self.stats.clone();
        s.correlate = self.store.stats();
        s.live_attempts = self.store.live_attempts() as u64;
        s.live_requests = self.store.live_requests() as u64;
        s.request_records = self.store.request_records() as u64;
        s.tombstones = self.store.tombstones() as u64;
        s.wide_slot_rows = self.store.wide_rows() as u64;
        s.violations = self.per_rule.iter().sum();
        s
    }

    /// Violations emitted so far, per enabled rule (same order as [`Self::rules`]); corroborating
    /// follow-ups are not counted (see [`CheckerStats::corroborations`]).
    pub fn violations_per_rule(&self) -> &[u64] {
        &self.per_rule
    }

    /// Per rule (in [`Checker::rules`] order): deadlines still open at the watermark, i.e.
    /// attempts whose `must_follow` or `requires_before` deadline has not passed and that nothing
    /// has settled yet. What a `check` of a file ending mid-flight cannot judge.
    pub fn open_deadlines_per_rule(&self) -> Vec<u64> {
        use crate::engine::rules::Shape;
        let wm = self.stats.watermark_ns;
        let mut open = vec![0u64; self.rules.len()];
        let mut seen = std::collections::HashSet::new();
        self.timers.for_each(|&(due, a, generation)| {
            if !self.store.timer_valid(due, a, generation) || !seen.insert(a) {
                return;
            }
            let s = self.store.attempt_slots(a);
            let fired = self.store.attempt(a).fired;
            for (ri, r) in self.rules.iter().enumerate() {
                if fired & (1 << ri) != 0 {
                    continue;
                }
                let k = r.slots;
                let pending = match &r.rule.shape {
                    Shape::MustFollow(m) => {
                        m.due(s.get(k.trigger), self.skew_ns).is_some_and(|d| {
                            d > wm
                                && !m.satisfied(
                                    s.get(k.trigger),
                                    s.get(k.other),
                                    s.get(k.other_latest),
                                    self.skew_ns,
                                )
                        })
                    }
                    Shape::RequiresBefore(m) => m.due(s.get(k.trigger)).is_some_and(|d| {
                        d > wm && m.breached(s.get(k.trigger), s.get(k.other), self.skew_ns)
                    }),
                    _ => false,
                };
                if pending {
                    open[ri] += 1;
                }
            }
        });
        open
    }

    /// Bytes held by the engine's state tables (capacity-based; for memory benchmarks).
    pub fn state_bytes(&self) -> usize {
        self.store.table_bytes() + self.timers.capacity_bytes()
    }

    /// [`Self::state_bytes`] per table (capacity-based), for the memory benchmark's breakdown.
    pub fn state_breakdown(&self) -> Vec<(&'static str, usize)> {
        let mut v = self.store.table_breakdown();
        v.push(("deadline queue", self.timers.capacity_bytes()));
        v
    }

    /// Bytes reserved by the tombstone tables alone.
    pub fn tombstone_bytes(&self) -> usize {
        self.store.tombstone_bytes()
    }

    /// Entries in the deadline queue, valid or not yet purged.
    pub fn deadline_entries(&self) -> usize {
        self.timers.len()
    }

    /// Entries in the alias table (rooms, rids, request ids, trace ids), live or not yet purged.
    pub fn alias_entries(&self) -> usize {
        self.store.alias_entries()
    }
}
