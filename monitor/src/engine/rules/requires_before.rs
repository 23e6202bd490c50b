//! `requires_before`: an event is only legitimate if another one happened earlier.
//!
//! E.g. decode work requires a prefill admission of the same attempt. Judged when the watermark
//! passes the event (plus the grace), so a required event that arrives late (within the allowed
//! lateness) counts. A `grace` lets the required event come that long *after* the event too:
//! legs a router sends at once reach their workers in either order, so "prefill received the
//! room" may follow "decode contacted prefill about it" by the network's jitter.

use serde::{Deserialize, Serialize};

use super::{HumanDuration, RuleError, RuleSlots};
use crate::engine::matcher::Matcher;
use crate::engine::state::{Keep, Slot, SlotLayout};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequiresBefore {
    pub event: Vec<Matcher>,
    pub requires: Vec<Matcher>,
    /// A required event up to this long after the event still counts (concurrent legs).
    #[serde(default, skip_serializing_if = "HumanDuration::is_zero")]
    pub grace: HumanDuration,
}

impl RequiresBefore {
    pub fn validate(&self) -> Result<(), RuleError> {
        if self.event.is_empty() || self.requires.is_empty() {
            return Err(RuleError::RequiresBeforeMatchers {
                event: self.event.len(),
                requires: self.requires.len(),
            });
        }
        Ok(())
    }

    pub fn slots(&self, attempt: &mut SlotLayout) -> RuleSlots {
        RuleSlots {
            trigger: attempt.slot(&self.event, Keep::Earliest),
            other: attempt.slot(&self.requires, Keep::Earliest),
            ..Default::default()
        }
    }

    /// When the check can be judged: once nothing earlier than the event's grace can still
    /// arrive.
    pub fn due(&self, event: Slot) -> Option<u64> {
        event
            .is_set()
            .then(|| event.time().saturating_add(self.grace.ns()))
    }

    pub fn breached(&self, event: Slot, required: Slot, skew_ns: u64) -> bool {
        if !event.is_set() {
            return false;
        }
        if !required.is_set() {
            return true;
        }
        let tolerance = if event.node() == required.node() {
            0
        } else {
            skew_ns
        };
        required.time() > event.time().saturating_add(self.grace.ns() + tolerance)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Kind, LifecycleEvent, Source, Stage};

    fn at(t: u64, node: u16) -> Slot {
        Slot::from_event(
            &LifecycleEvent::new(t, Stage::Prefill, Kind::Admitted, Source::Otlp),
            node,
        )
    }

    #[test]
    fn required_event_must_come_first() {
        let r = RequiresBefore {
            event: vec![Matcher::default()],
            requires: vec![Matcher::default()],
            grace: HumanDuration::default(),
        };
        assert!(!r.breached(at(100, 0), at(90, 0), 0));
        assert!(!r.breached(at(100, 0), at(100, 0), 0));
        assert!(r.breached(at(100, 0), at(101, 0), 0));
        assert!(r.breached(at(100, 0), Slot::EMPTY, 0));
        assert!(!r.breached(at(100, 0), at(120, 1), 50));
    }

    #[test]
    fn grace_admits_a_required_event_that_follows_closely() {
        let r = RequiresBefore {
            event: vec![Matcher::default()],
            requires: vec![Matcher::default()],
            grace: HumanDuration(std::time::Duration::from_nanos(30)),
        };
        assert_eq!(r.due(at(100, 0)), Some(130));
        assert!(!r.breached(at(100, 0), at(130, 0), 0));
        assert!(r.breached(at(100, 0), at(131, 0), 0));
        assert!(!r.breached(at(100, 0), at(180, 1), 50));
        assert!(r.breached(at(100, 0), at(181, 1), 50));
        assert!(r.breached(at(100, 0), Slot::EMPTY, 0));
    }
}
