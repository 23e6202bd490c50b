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

impl CheckerStats {
    /// Adds another shard's counters to these (the engine split over several checkers): counts
    /// and sizes add up; the watermark is the one every shard has passed, the newest event the
    /// newest any has seen. Requests whose request-level events went to every shard count once
    /// per shard in `live_requests` and `request_records`.
    pub fn absorb(&mut self, o: &CheckerStats) {
        let CheckerStats {
            events,
            events_attempt,
            events_request_only,
            events_unattributed,
            capacity_reports,
            events_on_tombstones,
            events_late,
            violations,
            repeats,
            corroborations,
            timers_fired,
            worker_dedup_full,
            workers_untracked,
            correlate,
            live_attempts,
            live_requests,
            request_records,
            tombstones,
            wide_slot_rows,
            watermark_ns,
            max_event_ns,
        } = o;
        self.events += events;
        self.events_attempt += events_attempt;
        self.events_request_only += events_request_only;
        self.events_unattributed += events_unattributed;
        self.capacity_reports += capacity_reports;
        self.events_on_tombstones += events_on_tombstones;
        self.events_late += events_late;
        self.violations += violations;
        self.repeats += repeats;
        self.corroborations += corroborations;
        self.timers_fired += timers_fired;
        self.worker_dedup_full += worker_dedup_full;
        self.workers_untracked += workers_untracked;
        self.correlate.absorb(correlate);
        self.live_attempts += live_attempts;
        self.live_requests += live_requests;
        self.request_records += request_records;
        self.tombstones += tombstones;
        self.wide_slot_rows += wide_slot_rows;
        self.watermark_ns = self.watermark_ns.min(*watermark_ns);
        self.max_event_ns = self.max_event_ns.max(*max_event_ns);
    }
}

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
