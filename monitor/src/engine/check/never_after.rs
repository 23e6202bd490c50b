//! What never-after rules share on attempts, tombstones and requests: the candidate pairs, the
//! observed event's part in a breach, and whether a breach is a first report, a corroborating
//! follow-up from a new source, or a repeat.

use crate::engine::identity::Owner;
use crate::engine::rules::{self, RuleSlots, Shape};
use crate::engine::state::{Candidates, Slot, SlotRead};
use crate::event::Source;
use crate::violation::EvidenceRole;

use super::Checker;

/// Bit of `source` in the reported-sources sets.
pub(super) fn source_bit(source: Source) -> u8 {
    1 << (source as u8)
}

/// The event being observed, as a never-after rule sees it.
#[derive(Clone, Copy)]
pub(super) struct Current {
    pub slot: Slot,
    pub source: Source,
    pub as_trigger: bool,
    pub as_forbidden: bool,
}

impl Current {
    /// An attempt's event that matched the specs `hit`, for an attempt-scope rule.
    #[inline]
    pub fn on_attempt(slot: Slot, source: Source, hit: u64, slots: RuleSlots) -> Current {
        Current {
            slot,
            source,
            as_trigger: hit & (1 << slots.trigger) != 0,
            as_forbidden: hit & (1 << slots.other) != 0,
        }
    }

    /// The candidate it breaches with, if it takes part in a breach of `rule` (as a trigger
    /// before some forbidden event, or as a forbidden event after some trigger).
    fn partner(
        &self,
        rule: &rules::NeverAfter,
        triggers: &[Slot],
        forbidden: &[Slot],
        skew_ns: u64,
    ) -> Option<(EvidenceRole, Slot)> {
        let as_trigger = self
            .as_trigger
            .then(|| {
                forbidden
                    .iter()
                    .find(|f| rule.breached(self.slot, **f, skew_ns))
            })
            .flatten()
            .map(|f| (EvidenceRole::Trigger, *f));
        as_trigger.or_else(|| {
            self.as_forbidden
                .then(|| {
                    triggers
                        .iter()
                        .find(|t| rule.breached(**t, self.slot, skew_ns))
                })
                .flatten()
                .map(|t| (EvidenceRole::Offender, *t))
        })
    }
}

impl Checker {
    /// A never-after rule's candidate triggers and offenders: the kept slots (one, or a per-node
    /// pair each) at positions `at` of `kept`, plus the current event, which a third node may
    /// have kept out of a pair.
    pub(super) fn never_after_candidates(
        &self,
        kept: &(impl SlotRead + ?Sized),
        at: (usize, usize),
        slots: RuleSlots,
        hit: u64,
        current: Slot,
    ) -> (Candidates, Candidates) {
        let keep = self.attempt_specs[slots.trigger].keep;
        let as_trigger = hit & (1 << slots.trigger) != 0;
        // Nearly every attempt never sees a trigger (a rejection): nothing can breach.
        if !as_trigger && !kept.any_set(at.0, keep) {
            return (Candidates::default(), Candidates::default());
        }
        let mut triggers = Candidates::of(kept, at.0, keep);
        if as_trigger {
            triggers.push(current);
        }
        let mut forbidden = Candidates::of(kept, at.1, self.attempt_specs[slots.other].keep);
        if hit & (1 << slots.other) != 0 {
            forbidden.push(current);
        }
        (triggers, forbidden)
    }

    /// What a breach of rule `ri` by `owner` becomes: `Some(None)` a first report,
    /// `Some(Some(c))` a corroborating follow-up of one already made (the current event's part
    /// in the breach, when its source is in none of the evidence reported so far: at most one
    /// follow-up per source), `None` a plain repeat (counted, not reported).
    pub(super) fn follow_up(
        &mut self,
        fired: bool,
        ri: usize,
        owner: Owner,
        cur: Current,
        triggers: &[Slot],
        forbidden: &[Slot],
    ) -> Option<Option<(EvidenceRole, Slot)>> {
        if !fired {
            return Some(None);
        }
        let c = self.corroboration(ri, owner, cur, triggers, forbidden);
        if c.is_none() {
            self.stats.repeats += 1;
        }
        c.map(Some)
    }

    fn corroboration(
        &self,
        ri: usize,
        owner: Owner,
        cur: Current,
        triggers: &[Slot],
        forbidden: &[Slot],
    ) -> Option<(EvidenceRole, Slot)> {
        let Shape::NeverAfter(rule) = &self.rules[ri].rule.shape else {
            return None;
        };
        if self.store.reported(owner, ri) & source_bit(cur.source) != 0 {
            return None;
        }
        cur.partner(rule, triggers, forbidden, self.skew_ns)
    }
}
