//! Rules of shape `never`: the event alone is the breach. They are judged on every observed
//! event, next to whichever path it takes (attempt, tombstone, request, worker), and keep nothing
//! per attempt: an event that names an attempt fires once per (rule, room or rid it names),
//! remembered in the bounded set of fired worker-level findings; one that names none fires once
//! per event (its own fingerprint: two foreign writes are two incidents).

use crate::engine::matcher::Matcher;
use crate::engine::rules::Shape;
use crate::event::{Kind, LifecycleEvent, Stage};
use crate::violation::{self, Violation};

use super::Checker;
use super::MAX_NEVER_DEDUP;
use super::report::{Finding, event_aliases, slot_event};

/// What any `never` rule's matchers could match at all, checked before the matchers themselves
/// (they run on every event): the (stage, kind) pairs they name, and whether every one of them
/// needs the event to carry a mark few events carry: its writer (`peer`, only writes to a
/// bootstrap server name one) or a protocol breach (`protocol_breach`).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct NeverGate {
    /// Per stage, a bit per kind.
    kinds: [u16; 4],
    needs_mark: bool,
}

impl NeverGate {
    pub(super) fn of<'a>(matchers: impl Iterator<Item = &'a Matcher>) -> NeverGate {
        let mut g = NeverGate {
            kinds: [0; 4],
            needs_mark: true,
        };
        let mut any = false;
        for m in matchers {
            any = true;
            g.needs_mark &= !m.peer.is_empty() || !m.protocol_breach.is_empty();
            for stage in Stage::ALL {
                if !m.stage.is_empty() && !m.stage.contains(&stage) {
                    continue;
                }
                for kind in Kind::ALL {
                    if m.kind.is_empty() || m.kind.contains(&kind) {
                        g.kinds[stage as usize] |= 1 << kind as u16;
                    }
                }
            }
        }
        g.needs_mark &= any;
        g
    }

    /// Whether some `never` rule may forbid `e` (false: none does).
    #[inline(always)]
    pub(super) fn may_match(&self, e: &LifecycleEvent) -> bool {
        self.kinds[e.stage as usize] & (1 << e.kind as u16) != 0
            && (!self.needs_mark || e.peer.is_some() || e.protocol_breach.is_some())
    }
}

impl Checker {
    /// Judges the `never` rules on `e`; `request` is the request record it resolved to, if any.
    pub(super) fn check_never(
        &mut self,
        e: &LifecycleEvent,
        request: Option<u32>,
        out: &mut Vec<Violation>,
    ) {
        for i in 0..self.never_rules.len() {
            let ri = self.never_rules[i];
            let Shape::Never(n) = &self.rules[ri].rule.shape else {
                continue;
            };
            if !n.forbids(e) {
                continue;
            }
            let attempt = event_aliases(e);
            let named = attempt
                .bootstrap_room
                .map(|r| format!("room:{r}"))
                .or_else(|| attempt.rid.as_ref().map(|r| format!("rid:{r}")));
            if let Some(named) = &named {
                let key = violation::fnv1a(&[
                    b"never",
                    self.rules[ri].rule.name.as_bytes(),
                    named.as_bytes(),
                ]);
                if self.worker_fired.contains(&key) {
                    self.stats.repeats += 1;
                    continue;
                }
                if self.worker_fired.len() < MAX_NEVER_DEDUP {
                    self.worker_fired.insert(key);
                } else {
                    self.stats.worker_dedup_full += 1;
                }
            }
            let who = e.worker.as_deref().or(e.node.as_deref());
            let f = Finding {
                request,
                attempt,
                worker: if named.is_none() { who } else { None },
                offender: Some(slot_event(e)),
                offender_reason: offence(e),
                instance: named.is_none().then_some(e.time_ns),
                ..Finding::new(ri, e.time_ns)
            };
            out.push(self.violation(f));
        }
    }
}

/// What the evidence says about the forbidden event: its reason, else its detail, and who wrote
/// it when the event attributes a writer.
fn offence(e: &LifecycleEvent) -> Option<String> {
    let what = e.reason.as_deref().or(e.detail.as_deref());
    match (what, e.peer, e.worker.as_deref()) {
        (Some(w), Some(p), Some(from)) => Some(format!("{w} from {from} (peer {p})")),
        (Some(w), Some(p), None) => Some(format!("{w} (peer {p})")),
        (None, Some(p), Some(from)) => Some(format!("from {from} (peer {p})")),
        (None, Some(p), None) => Some(format!("peer {p}")),
        (w, None, _) => w.map(str::to_owned),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Peer, Source};

    #[test]
    fn the_gate_passes_what_a_matcher_could_match() {
        let writes = Matcher {
            stage: vec![Stage::Transfer],
            peer: vec![Peer::Foreign],
            ..Default::default()
        };
        let g = NeverGate::of([&writes].into_iter());
        let ev = |stage, kind| LifecycleEvent::new(1, stage, kind, Source::Ebpf);
        assert!(g.may_match(&ev(Stage::Transfer, Kind::Received).with_peer(Peer::Member)));
        assert!(
            !g.may_match(&ev(Stage::Transfer, Kind::Received)),
            "no peer"
        );
        assert!(!g.may_match(&ev(Stage::Decode, Kind::Received).with_peer(Peer::Foreign)));
        // A matcher on a protocol breach passes marked events of any (stage, kind) it names.
        let breaches = Matcher {
            protocol_breach: vec![crate::event::ProtocolBreach::RepeatedReadiness],
            ..Default::default()
        };
        let g2 = NeverGate::of([&writes, &breaches].into_iter());
        assert!(
            g2.may_match(
                &ev(Stage::Prefill, Kind::Work)
                    .with_protocol_breach(crate::event::ProtocolBreach::RepeatedReadiness)
            )
        );
        assert!(!g2.may_match(&ev(Stage::Prefill, Kind::Work)), "unmarked");
        // A matcher without `peer` lets peerless events through, on its (stage, kind) only.
        let aborts = Matcher {
            kind: vec![Kind::Aborted],
            ..Default::default()
        };
        let g = NeverGate::of([&writes, &aborts].into_iter());
        assert!(g.may_match(&ev(Stage::Decode, Kind::Aborted)));
        assert!(!g.may_match(&ev(Stage::Decode, Kind::Work)));
        // No never rule: nothing passes.
        assert!(!NeverGate::of(std::iter::empty()).may_match(&ev(Stage::Decode, Kind::Aborted)));
    }
}
