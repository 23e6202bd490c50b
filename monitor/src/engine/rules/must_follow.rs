//! `must_follow`: after a trigger, an expected event must come within a deadline (liveness).
//!
//! `orphaned-leg` and `stuck-attempt` have this shape. The check runs when the watermark passes
//! the deadline, so an expected event that arrives late but within the allowed lateness still
//! counts. The latest trigger sets the deadline: re-admission restarts the clock.

use serde::{Deserialize, Serialize};

use super::{HumanDuration, RuleError, RuleSlots};
use crate::engine::matcher::Matcher;
use crate::engine::state::{Keep, Slot, SlotLayout};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MustFollow {
    pub trigger: Vec<Matcher>,
    pub expect: Vec<Matcher>,
    pub within: HumanDuration,
    /// The rule applies only to attempts that also show one of these events (by the deadline).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub given: Vec<Matcher>,
    /// Only expected events at or after the trigger count (otherwise any one by the deadline).
    #[serde(default)]
    pub after_trigger: bool,
}

impl MustFollow {
    pub fn validate(&self) -> Result<(), RuleError> {
        if self.trigger.is_empty() || self.expect.is_empty() {
            return Err(RuleError::MustFollowMatchers {
                trigger: self.trigger.len(),
                expect: self.expect.len(),
            });
        }
        if self.within.0.is_zero() {
            return Err(RuleError::MustFollowZeroWithin);
        }
        Ok(())
    }

    /// `other` and `other_latest` are the two expected events [`Self::satisfied`] weighs:
    /// with `after_trigger`, the earliest and the latest (one at or after the trigger must be
    /// among them); without, the earliest of each of two nodes (a pair), which is exact for the
    /// per-node tolerance and changes on an attempt's first expected event per node only,
    /// where a latest slot would change on every one (a decode's every work event).
    pub fn slots(&self, attempt: &mut SlotLayout) -> RuleSlots {
        let (other, other_latest) = if self.after_trigger {
            (
                attempt.slot(&self.expect, Keep::Earliest),
                attempt.slot(&self.expect, Keep::Latest),
            )
        } else {
            let pair = attempt.slot(&self.expect, Keep::EarliestPerNode);
            (pair, pair + 1)
        };
        RuleSlots {
            trigger: attempt.slot(&self.trigger, Keep::Latest),
            other,
            other_latest,
            given: (!self.given.is_empty())
                .then(|| attempt.slot(&self.given, Keep::Earliest) as u8),
            per_stage: [None; 4],
        }
    }

    pub fn deadline(&self, trigger: Slot) -> Option<u64> {
        trigger
            .is_set()
            .then(|| trigger.time().saturating_add(self.within.ns()))
    }

    /// When the rule can be judged: an expected event from another node than the trigger's
    /// counts up to the clock skew past the deadline, so judging waits for that too.
    pub fn due(&self, trigger: Slot, skew_ns: u64) -> Option<u64> {
        self.deadline(trigger).map(|d| d.saturating_add(skew_ns))
    }

    /// True when an expected event already lies in the window: nothing that arrives later can
    /// make the rule breached (whatever `given` turns out to be). Events of the trigger's node
    /// share its clock and count up to the deadline exactly; another node's count up to the
    /// skew past it ("ended 3 ms late on another node" is no evidence of anything).
    pub fn satisfied(&self, trigger: Slot, earliest: Slot, latest: Slot, skew_ns: u64) -> bool {
        let Some(deadline) = self.deadline(trigger) else {
            return true;
        };
        let counts = |s: Slot| {
            let tolerance = if s.node() == trigger.node() {
                0
            } else {
                skew_ns
            };
            s.is_set()
                && s.time() <= deadline.saturating_add(tolerance)
                && (!self.after_trigger || s.time().saturating_add(skew_ns) >= trigger.time())
        };
        counts(earliest) || counts(latest)
    }

    /// Judged once the watermark is past [`Self::deadline`].
    pub fn breached(
        &self,
        trigger: Slot,
        earliest: Slot,
        latest: Slot,
        given: Option<Slot>,
        skew_ns: u64,
    ) -> bool {
        let Some(deadline) = self.deadline(trigger) else {
            return false;
        };
        if let Some(g) = given
            && (!g.is_set() || g.time() > deadline)
        {
            return false;
        }
        !self.satisfied(trigger, earliest, latest, skew_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Kind, LifecycleEvent, Source, Stage};
    use std::time::Duration;

    fn at(t: u64) -> Slot {
        Slot::from_event(
            &LifecycleEvent::new(t, Stage::Decode, Kind::Completed, Source::Otlp),
            0,
        )
    }

    fn rule(after_trigger: bool, given: bool) -> MustFollow {
        MustFollow {
            trigger: vec![Matcher::default()],
            expect: vec![Matcher::default()],
            within: HumanDuration(Duration::from_nanos(100)),
            given: if given {
                vec![Matcher::default()]
            } else {
                vec![]
            },
            after_trigger,
        }
    }

    #[test]
    fn expected_by_the_deadline_satisfies() {
        let r = rule(false, false);
        assert!(!r.breached(at(1000), at(1050), at(1050), None, 0));
        assert!(!r.breached(at(1000), at(1100), at(1100), None, 0));
        assert!(r.breached(at(1000), at(1101), at(1101), None, 0));
        assert!(r.breached(at(1000), Slot::EMPTY, Slot::EMPTY, None, 0));
    }

    #[test]
    fn after_trigger_ignores_earlier_ends() {
        let r = rule(true, false);
        assert!(r.breached(at(1000), at(900), at(900), None, 0));
        assert!(!r.breached(at(1000), at(900), at(1010), None, 0));
        assert!(!r.breached(at(1000), at(990), at(990), None, 20));
        assert!(!rule(false, false).breached(at(1000), at(900), at(900), None, 0));
    }

    #[test]
    fn another_node_ends_within_the_skew_past_the_deadline() {
        let on = |t: u64, node: u16| {
            Slot::from_event(
                &LifecycleEvent::new(t, Stage::Decode, Kind::Cancelled, Source::Ebpf),
                node,
            )
        };
        let r = rule(false, false);
        // Deadline 1100; skew 30.
        assert!(!r.breached(on(1000, 1), on(1120, 2), on(1120, 2), None, 30));
        assert!(r.breached(on(1000, 1), on(1131, 2), on(1131, 2), None, 30));
        assert!(r.breached(on(1000, 1), on(1120, 1), on(1120, 1), None, 30));
        assert_eq!(r.due(on(1000, 1), 30), Some(1130));
    }

    #[test]
    fn given_limits_the_rule() {
        let r = rule(false, true);
        assert!(!r.breached(at(1000), Slot::EMPTY, Slot::EMPTY, Some(Slot::EMPTY), 0));
        assert!(r.breached(at(1000), Slot::EMPTY, Slot::EMPTY, Some(at(990)), 0));
        assert!(!r.breached(at(1000), Slot::EMPTY, Slot::EMPTY, Some(at(1200)), 0));
    }
}
