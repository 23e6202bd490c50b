//! Event matchers: the vocabulary rules use to name the events they care about.

use serde::{Deserialize, Serialize};

use crate::event::{Kind, LifecycleEvent, Peer, ProtocolBreach, Source, Stage};

/// Matches one event. Every listed condition must hold; an absent list means "any".
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Matcher {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stage: Vec<Stage>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kind: Vec<Kind>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub source: Vec<Source>,
    /// For `dispatched` events: the target stage.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub to: Vec<Stage>,
    /// Who wrote the request the event is about (`member`, `foreign`, `unattributed`); an event
    /// that attributes no writer never matches a `peer` condition.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub peer: Vec<Peer>,
    /// How the control message the event is about breaks its room's protocol (see
    /// [`ProtocolBreach`]); an event that judges no breach never matches a `protocol_breach` condition.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub protocol_breach: Vec<ProtocolBreach>,
    /// Matches when the status is absent or below this value (a success).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_below: Option<u16>,
    /// Matches only when a status is present and at least this value (a failure).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_at_least: Option<u16>,
}

impl Matcher {
    pub fn matches(&self, e: &LifecycleEvent) -> bool {
        (self.stage.is_empty() || self.stage.contains(&e.stage))
            && (self.kind.is_empty() || self.kind.contains(&e.kind))
            && (self.source.is_empty() || self.source.contains(&e.source))
            && (self.to.is_empty() || e.to.is_some_and(|t| self.to.contains(&t)))
            && (self.peer.is_empty() || e.peer.is_some_and(|p| self.peer.contains(&p)))
            && (self.protocol_breach.is_empty()
                || e.protocol_breach
                    .is_some_and(|b| self.protocol_breach.contains(&b)))
            && self
                .status_below
                .is_none_or(|b| e.status.is_none_or(|s| s < b))
            && self
                .status_at_least
                .is_none_or(|a| e.status.is_some_and(|s| s >= a))
    }
}

/// Any of several matchers; how rules list the events of one role.
pub fn any_matches(ms: &[Matcher], e: &LifecycleEvent) -> bool {
    ms.iter().any(|m| m.matches(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(stage: Stage, kind: Kind) -> LifecycleEvent {
        LifecycleEvent::new(1, stage, kind, Source::Replay)
    }

    #[test]
    fn empty_matcher_matches_everything() {
        assert!(Matcher::default().matches(&ev(Stage::Decode, Kind::Work)));
    }

    #[test]
    fn status_conditions() {
        let ok = Matcher {
            kind: vec![Kind::Completed],
            status_below: Some(400),
            ..Default::default()
        };
        assert!(ok.matches(&ev(Stage::Decode, Kind::Completed)));
        assert!(ok.matches(&ev(Stage::Decode, Kind::Completed).with_status(200)));
        assert!(!ok.matches(&ev(Stage::Decode, Kind::Completed).with_status(500)));
        let failed = Matcher {
            status_at_least: Some(400),
            ..Default::default()
        };
        assert!(!failed.matches(&ev(Stage::Router, Kind::Completed)));
        assert!(failed.matches(&ev(Stage::Router, Kind::Completed).with_status(503)));
    }

    #[test]
    fn dispatch_target() {
        let m = Matcher {
            kind: vec![Kind::Dispatched],
            to: vec![Stage::Decode],
            ..Default::default()
        };
        assert!(m.matches(&ev(Stage::Router, Kind::Dispatched).with_to(Stage::Decode)));
        assert!(!m.matches(&ev(Stage::Router, Kind::Dispatched).with_to(Stage::Prefill)));
        assert!(!m.matches(&ev(Stage::Router, Kind::Dispatched)));
    }

    #[test]
    fn peer_condition() {
        let m = Matcher {
            peer: vec![Peer::Foreign],
            ..Default::default()
        };
        let write = ev(Stage::Transfer, Kind::Received);
        assert!(m.matches(&write.clone().with_peer(Peer::Foreign)));
        assert!(!m.matches(&write.clone().with_peer(Peer::Member)));
        assert!(!m.matches(&write.clone().with_peer(Peer::Unattributed)));
        // An event that attributes no writer (a handshake, a span) is no peer's.
        assert!(!m.matches(&write));
    }

    #[test]
    fn protocol_breach_condition() {
        let m = Matcher {
            protocol_breach: vec![ProtocolBreach::SurplusDecodeOwner],
            ..Default::default()
        };
        let dst = ev(Stage::Transfer, Kind::Admitted);
        assert!(
            m.matches(
                &dst.clone()
                    .with_protocol_breach(ProtocolBreach::SurplusDecodeOwner)
            )
        );
        assert!(
            !m.matches(
                &dst.clone()
                    .with_protocol_breach(ProtocolBreach::DestinationsBeforeReadiness)
            )
        );
        // The room's ordinary events break nothing.
        assert!(!m.matches(&dst));
    }
}
