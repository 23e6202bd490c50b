//! A rule set compiled for the engine: each enabled rule with the slots it reads, identical slots
//! shared between rules.

use super::{Rule, RuleSet, Shape};
use crate::engine::state::SlotLayout;

/// Slot indices a compiled rule reads; filled by [`compile`].
#[derive(Debug, Clone, Copy, Default)]
pub struct RuleSlots {
    /// never_after: earliest trigger; must_follow: latest trigger; requires_before: earliest event.
    pub trigger: usize,
    /// never_after: latest forbidden; must_follow: earliest expected; requires_before: earliest required.
    pub other: usize,
    /// must_follow: latest expected.
    pub other_latest: usize,
    /// must_follow: earliest `given` event, when the rule has a `given`.
    pub given: Option<u8>,
    /// predicate: the earliest matching event per stage (capacity is per stage). Slot indices
    /// are below [`SlotLayout::MAX`]; bytes keep this struct small, as it is copied per rule
    /// per event.
    pub per_stage: [Option<u8>; 4],
}

impl RuleSlots {
    /// Bit set of the per-stage slots.
    pub fn stage_mask(&self) -> u64 {
        self.per_stage
            .iter()
            .flatten()
            .fold(0, |m, &k| m | (1u64 << k))
    }
}

/// A rule ready for the engine.
#[derive(Debug, Clone)]
pub struct CompiledRule {
    pub index: usize,
    pub rule: Rule,
    pub slots: RuleSlots,
}

/// Compiles the enabled rules, sharing identical slots.
///
/// Attempt-level slots live in `attempt`; request-scope never-after rules keep their trigger and
/// forbidden slots in `request` too, because their trigger may be request-level only.
pub fn compile(
    set: &RuleSet,
    attempt: &mut SlotLayout,
    request: &mut SlotLayout,
) -> Vec<CompiledRule> {
    let mut out = Vec::new();
    for (index, rule) in set.enabled().enumerate() {
        let slots = match &rule.shape {
            Shape::NeverAfter(s) => s.slots(rule.scope, attempt, request),
            Shape::MustFollow(s) => s.slots(attempt),
            Shape::RequiresBefore(s) => s.slots(attempt),
            // The earliest matching event per stage is judged again at the watermark, so facts
            // that arrive later (the input length, a capacity report) still count.
            Shape::Predicate(p) => p.slots(attempt),
            // Judged on the ids as the correlator resolves them (distinct), or on the event
            // alone as it is observed (never): no slots.
            Shape::Distinct(_) | Shape::Never(_) => RuleSlots::default(),
        };
        out.push(CompiledRule {
            index,
            rule: rule.clone(),
            slots,
        });
    }
    out
}
