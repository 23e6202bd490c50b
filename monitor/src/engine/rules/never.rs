//! `never`: an event that is a breach by itself, whatever came before or after it.
//!
//! E.g. a write to a prefill's bootstrap server by a process that is none of the deployment's
//! (`peer: [foreign]`). Nothing is kept per attempt: the event alone proves the breach, so the
//! verdict is the same in any arrival order. An event that names an attempt fires once per
//! (rule, attempt); one that names none (a worker-level fact) fires once per event.

use serde::{Deserialize, Serialize};

use super::RuleError;
use crate::engine::matcher::{Matcher, any_matches};
use crate::event::LifecycleEvent;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Never {
    /// The forbidden events.
    pub event: Vec<Matcher>,
}

impl Never {
    pub fn validate(&self) -> Result<(), RuleError> {
        if self.event.is_empty() {
            return Err(RuleError::NeverMatchers);
        }
        Ok(())
    }

    pub fn forbids(&self, e: &LifecycleEvent) -> bool {
        any_matches(&self.event, e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Kind, Peer, Source, Stage};

    #[test]
    fn any_listed_event_is_forbidden() {
        let n = Never {
            event: vec![Matcher {
                stage: vec![Stage::Transfer],
                peer: vec![Peer::Foreign],
                ..Default::default()
            }],
        };
        let write = LifecycleEvent::new(1, Stage::Transfer, Kind::Received, Source::Ebpf);
        assert!(n.forbids(&write.clone().with_peer(Peer::Foreign)));
        assert!(!n.forbids(&write.clone().with_peer(Peer::Member)));
        assert!(!n.forbids(&write));
        assert_eq!(
            Never { event: vec![] }.validate(),
            Err(RuleError::NeverMatchers)
        );
    }
}
