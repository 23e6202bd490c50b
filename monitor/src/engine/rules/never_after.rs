//! `never_after`: once a trigger happened, none of the forbidden events may follow.
//!
//! This is the rule shape behind `activity-after-rejection`: a rejection is terminal, so any later
//! dispatch, admission or work of the same attempt (or, with request scope, of any attempt of the
//! request) is a breach. "Later" is decided by event time, never by arrival order: the engine
//! keeps the earliest trigger and the latest forbidden event, so whichever arrives second finds
//! the other.

use serde::{Deserialize, Serialize};

use super::{HumanDuration, RuleError, RuleSlots, Scope};
use crate::engine::matcher::Matcher;
use crate::engine::state::{Keep, Slot, SlotLayout};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NeverAfter {
    pub trigger: Vec<Matcher>,
    pub forbidden: Vec<Matcher>,
    /// Forbidden events within this time after the trigger are tolerated (in-flight work).
    #[serde(default)]
    pub grace: HumanDuration,
}

impl NeverAfter {
    pub fn validate(&self) -> Result<(), RuleError> {
        if self.trigger.is_empty() || self.forbidden.is_empty() {
            return Err(RuleError::NeverAfterMatchers {
                trigger: self.trigger.len(),
                forbidden: self.forbidden.len(),
            });
        }
        Ok(())
    }

    pub fn slots(
        &self,
        scope: Scope,
        attempt: &mut SlotLayout,
        request: &mut SlotLayout,
    ) -> RuleSlots {
        match scope {
            Scope::Attempt => RuleSlots {
                trigger: attempt.slot(&self.trigger, Keep::EarliestPerNode),
                other: attempt.slot(&self.forbidden, Keep::LatestPerNode),
                ..Default::default()
            },
            // The request keeps both sides; the attempt keeps its own latest forbidden event so
            // that an attempt linked to its request only later still brings its history along.
            Scope::Request => RuleSlots {
                trigger: request.slot(&self.trigger, Keep::EarliestPerNode),
                other: request.slot(&self.forbidden, Keep::LatestPerNode),
                other_latest: attempt.slot(&self.forbidden, Keep::LatestPerNode),
                ..Default::default()
            },
        }
    }

    /// The first (trigger, forbidden) pair among the candidates that breaches the rule.
    pub fn breaching_pair(
        &self,
        triggers: &[Slot],
        forbidden: &[Slot],
        skew_ns: u64,
    ) -> Option<(Slot, Slot)> {
        triggers
            .iter()
            .flat_map(|t| forbidden.iter().map(move |f| (*t, *f)))
            .find(|(t, f)| self.breached(*t, *f, skew_ns))
    }

    /// True when `forbidden` is later than `trigger` by more than the grace, counting the clock
    /// skew tolerance when the two events come from different nodes.
    pub fn breached(&self, trigger: Slot, forbidden: Slot, skew_ns: u64) -> bool {
        if !trigger.is_set() || !forbidden.is_set() {
            return false;
        }
        let tolerance = self.grace.ns()
            + if trigger.node() == forbidden.node() {
                0
            } else {
                skew_ns
            };
        forbidden.time() > trigger.time().saturating_add(tolerance)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Kind, LifecycleEvent, Source, Stage};
    use std::time::Duration;

    fn slot(t: u64, node: u16) -> Slot {
        Slot::from_event(
            &LifecycleEvent::new(t, Stage::Decode, Kind::Work, Source::Ebpf),
            node,
        )
    }

    fn rule(grace_ns: u64) -> NeverAfter {
        NeverAfter {
            trigger: vec![Matcher::default()],
            forbidden: vec![Matcher::default()],
            grace: HumanDuration(Duration::from_nanos(grace_ns)),
        }
    }

    #[test]
    fn same_node_is_strict_event_time() {
        assert!(rule(0).breached(slot(100, 1), slot(101, 1), 50));
        assert!(!rule(0).breached(slot(100, 1), slot(100, 1), 50));
        assert!(!rule(0).breached(slot(100, 1), slot(99, 1), 50));
    }

    #[test]
    fn cross_node_needs_more_than_the_skew() {
        assert!(!rule(0).breached(slot(100, 1), slot(150, 2), 50));
        assert!(rule(0).breached(slot(100, 1), slot(151, 2), 50));
    }

    #[test]
    fn grace_tolerates_in_flight_events() {
        assert!(!rule(10).breached(slot(100, 1), slot(110, 1), 0));
        assert!(rule(10).breached(slot(100, 1), slot(111, 1), 0));
    }

    #[test]
    fn missing_side_is_no_breach() {
        assert!(!rule(0).breached(Slot::EMPTY, slot(1, 0), 0));
        assert!(!rule(0).breached(slot(1, 0), Slot::EMPTY, 0));
    }
}
