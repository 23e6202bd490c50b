//! The memory budget, split in one place: `--memory-budget` (config `memory_budget`) less a fixed
//! reserve is shared among every structure that grows with traffic, each capped at its share;
//! the caps are what the engine, the span tree, the event channel and the admin rings are built
//! with. [`MemoryTap`] keeps the account (`telemetry::memory`) current once a second and raises
//! the pressure WARN and `/readyz` note when a structure evicts at its cap.

use std::sync::Arc;
use std::time::Instant;

use crate::admin::RecentEvents;
use crate::admin::timeline::TIMELINE_EVENT_BYTES;
use crate::engine::check::metrics::CheckerSnapshot;
use crate::engine::check::{BYTES_PER_ATTEMPT_AND_REQUEST, BudgetCaps};
use crate::normalize::sglang::{TreeConfig, cost};
use crate::pipeline::{EventBatch, EventTap};
use crate::telemetry::memory::{MemoryAccount, MemoryWatch, Structure};
use crate::telemetry::recent::VIOLATION_BYTES;
use crate::telemetry::{Readiness, RecentViolations};

/// What the budget keeps for everything not split below: the runtime and the binary, thread
/// stacks, OTLP request bodies being decoded, the eBPF ring buffers and connection table, the
/// vllm-router trace join, and the allocator's own slack.
pub const RESERVE: u64 = 64 << 20;

/// Each structure's share of the budget after [`RESERVE`], in thousandths. The engine's tables
/// get half (two thirds of it for live attempts, one third for tombstones, as [`BudgetCaps`]
/// splits it); the span tree a quarter: it holds every attempt of the last retention window.
pub const SHARES: [(Structure, u64); 6] = [
    (Structure::Attempts, 334),
    (Structure::Tombstones, 166),
    (Structure::SpanTree, 250),
    (Structure::EventChannel, 80),
    (Structure::Timeline, 120),
    (Structure::RecentViolations, 50),
];

/// Of the span tree's share, in thousandths: resolved spans, orphans, completions in their grace.
const TREE_KNOWN: u64 = 600;
const TREE_ORPHANS: u64 = 200;
const TREE_COMPLETIONS: u64 = 200;

/// Fewest live attempts a budget must leave room for; below it eviction would judge nothing.
pub const MIN_ATTEMPTS: u64 = 4096;

/// A budget too small to run with.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "memory budget {budget} B is too small to run: at least {min} B ({} MiB) is needed for \
     {RESERVE} B of runtime and buffers and {MIN_ATTEMPTS} live attempts",
    .min.div_ceil(1 << 20)
)]
pub struct BudgetTooSmall {
    pub budget: u64,
    pub min: u64,
}

/// The caps one budget gives every structure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryPlan {
    pub budget: u64,
    /// Bytes per structure (its share).
    pub caps: [(Structure, u64); 6],
    pub engine: BudgetCaps,
    /// Span tree: resolved spans per generation, orphans, completions in their grace.
    pub max_known: usize,
    pub max_orphans: usize,
    pub max_completions: usize,
    /// Timeline events and recent violations the admin rings may hold.
    pub timeline_events: usize,
    pub recent_violations: usize,
}

fn share(budget: u64, s: Structure) -> u64 {
    let per_mille = SHARES.iter().find(|(x, _)| *x == s).map_or(0, |(_, p)| *p);
    (budget - RESERVE) / 1000 * per_mille
}

fn count(bytes: u64, per: usize) -> usize {
    (bytes / per as u64).max(1) as usize
}

impl MemoryPlan {
    /// The smallest budget accepted.
    pub fn min_budget() -> u64 {
        let attempts = SHARES[0].1;
        // Shares are whole thousandths of what the reserve leaves: round up to one.
        RESERVE + (MIN_ATTEMPTS * BYTES_PER_ATTEMPT_AND_REQUEST).div_ceil(attempts) * 1000
    }

    pub fn new(budget: u64) -> Result<MemoryPlan, BudgetTooSmall> {
        let min = Self::min_budget();
        if budget < min {
            return Err(BudgetTooSmall { budget, min });
        }
        let caps = SHARES.map(|(s, _)| (s, share(budget, s)));
        let tree = share(budget, Structure::SpanTree) / 1000;
        Ok(MemoryPlan {
            budget,
            caps,
            engine: BudgetCaps::from_shares(
                share(budget, Structure::Attempts),
                share(budget, Structure::Tombstones),
            ),
            max_known: count(tree * TREE_KNOWN, cost::KNOWN),
            max_orphans: count(tree * TREE_ORPHANS, cost::ORPHAN),
            max_completions: count(tree * TREE_COMPLETIONS, cost::COMPLETION),
            timeline_events: count(share(budget, Structure::Timeline), TIMELINE_EVENT_BYTES),
            recent_violations: count(share(budget, Structure::RecentViolations), VIOLATION_BYTES),
        })
    }

    pub fn cap(&self, s: Structure) -> u64 {
        self.caps
            .iter()
            .find(|(x, _)| *x == s)
            .map_or(0, |(_, b)| *b)
    }

    /// Lowers the span tree's configured bounds to the plan's (a bound configured smaller stays).
    pub fn bound_tree(&self, t: &mut TreeConfig) {
        t.max_known = t.max_known.min(self.max_known);
        t.max_orphans = t.max_orphans.min(self.max_orphans);
        t.max_completions = t.max_completions.min(self.max_completions);
    }

    /// The account the structures report into, with this plan's caps.
    pub fn account(&self) -> MemoryAccount {
        MemoryAccount::new(self.budget, &self.caps)
    }
}

/// The engine task's memory bookkeeping: credits each OTLP batch back to the event channel's
/// account as it is taken off the channel, and once a second records the engine's tables and the
/// admin rings, then reports pressure (WARN, `/readyz`).
pub struct MemoryTap {
    pub account: Arc<MemoryAccount>,
    pub timeline: Arc<RecentEvents>,
    pub violations: Arc<RecentViolations>,
    pub readiness: Option<Readiness>,
    pub watch: MemoryWatch,
}

impl EventTap for MemoryTap {
    fn batch(&mut self, batch: &EventBatch, _: u64) -> std::io::Result<()> {
        self.account.taken_from_channel(batch);
        Ok(())
    }

    fn tick(&mut self, engine: &CheckerSnapshot, _: u64) -> std::io::Result<()> {
        let a = &self.account;
        let stats = &engine.stats;
        let tombs = engine.tombstone_bytes;
        a.set_used(
            Structure::Attempts,
            engine.state_bytes.saturating_sub(tombs),
        );
        a.set_used(Structure::Tombstones, tombs);
        // Request records are charged to the attempts' share, so their evictions count there.
        a.set_evictions(
            Structure::Attempts,
            stats.correlate.evicted_cap + stats.correlate.requests_evicted_cap,
        );
        a.set_evictions(
            Structure::Tombstones,
            stats.correlate.tombstones_evicted_cap,
        );
        a.set_used(Structure::Timeline, self.timeline.estimated_bytes() as u64);
        a.set_evictions(Structure::Timeline, self.timeline.evicted());
        a.set_used(
            Structure::RecentViolations,
            self.violations.estimated_bytes() as u64,
        );
        a.set_evictions(Structure::RecentViolations, self.violations.evicted());
        self.watch
            .report(a, self.readiness.as_ref(), Instant::now());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::check::BYTES_PER_TOMBSTONE;

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_shares_split_the_whole_budget_after_the_reserve() {
        assert_eq!(SHARES.iter().map(|(_, p)| p).sum::<u64>(), 1000);
        assert_eq!(TREE_KNOWN + TREE_ORPHANS + TREE_COMPLETIONS, 1000);
        for budget in [MemoryPlan::min_budget(), 256 * MIB, 512 * MIB, 4096 * MIB] {
            let p = MemoryPlan::new(budget).unwrap();
            let caps: u64 = p.caps.iter().map(|(_, b)| b).sum();
            assert!(caps + RESERVE <= budget, "{budget}: {caps} B of caps");
            assert!(
                caps + RESERVE > budget - 1000,
                "{budget}: {caps} B left unused"
            );
            // Every count times its per-entry charge stays within its structure's share.
            let within = |n: usize, per: u64, s: Structure, part: u64| {
                // As the plan splits the span tree's share: in whole thousandths.
                let limit = match part {
                    1000 => p.cap(s),
                    _ => p.cap(s) / 1000 * part,
                };
                assert!(
                    n as u64 * per <= limit,
                    "{budget}: {s:?} {n} × {per} B over its share"
                )
            };
            within(
                p.engine.max_attempts,
                BYTES_PER_ATTEMPT_AND_REQUEST,
                Structure::Attempts,
                1000,
            );
            assert_eq!(p.engine.max_requests, p.engine.max_attempts);
            within(
                p.engine.max_tombstones,
                BYTES_PER_TOMBSTONE,
                Structure::Tombstones,
                1000,
            );
            within(
                p.max_known,
                cost::KNOWN as u64,
                Structure::SpanTree,
                TREE_KNOWN,
            );
            within(
                p.max_orphans,
                cost::ORPHAN as u64,
                Structure::SpanTree,
                TREE_ORPHANS,
            );
            within(
                p.max_completions,
                cost::COMPLETION as u64,
                Structure::SpanTree,
                TREE_COMPLETIONS,
            );
            within(
                p.timeline_events,
                TIMELINE_EVENT_BYTES as u64,
                Structure::Timeline,
                1000,
            );
            within(
                p.recent_violations,
                VIOLATION_BYTES as u64,
                Structure::RecentViolations,
                1000,
            );
            assert!(p.engine.max_attempts as u64 >= MIN_ATTEMPTS);
        }
    }

    #[test]
    fn caps_grow_with_the_budget() {
        let small = MemoryPlan::new(256 * MIB).unwrap();
        let big = MemoryPlan::new(512 * MIB).unwrap();
        assert!(big.engine.max_attempts > 2 * small.engine.max_attempts);
        assert!(big.max_known > 2 * small.max_known);
        assert!(big.timeline_events > 2 * small.timeline_events);
        assert!(big.cap(Structure::EventChannel) > 2 * small.cap(Structure::EventChannel));
    }

    #[test]
    fn a_budget_below_the_minimum_is_refused_and_says_what_it_needs() {
        let min = MemoryPlan::min_budget();
        assert!(MemoryPlan::new(min).is_ok());
        let err = MemoryPlan::new(min - 1).unwrap_err();
        assert_eq!(
            err,
            BudgetTooSmall {
                budget: min - 1,
                min
            }
        );
        assert!(err.to_string().contains("MiB"), "{err}");
        assert!(MemoryPlan::new(0).is_err());
    }

    #[test]
    fn configured_bounds_only_go_down() {
        let p = MemoryPlan::new(256 * MIB).unwrap();
        let mut t = TreeConfig::default();
        p.bound_tree(&mut t);
        assert_eq!(
            (t.max_known, t.max_orphans, t.max_completions),
            (p.max_known, p.max_orphans, p.max_completions)
        );
        let mut small = TreeConfig {
            max_known: 10,
            ..TreeConfig::default()
        };
        p.bound_tree(&mut small);
        assert_eq!(small.max_known, 10);
    }
}
