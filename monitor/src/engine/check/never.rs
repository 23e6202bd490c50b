//! Rules of shape `never`: the event alone is the breach. They are judged on every observed
//! event, next to whichever path it takes (attempt, tombstone, request, worker), and keep nothing
//! per attempt: an event that names an attempt fires once per (rule, room or rid it names),
//! remembered in the bounded set of fired worker-level findings; one that names none fires once
//! per event (its own fingerprint: two foreign writes are two incidents).

use crate::engine::rules::Shape;
use crate::event::LifecycleEvent;
use crate::violation::{self, Violation};

use super::Checker;
use super::MAX_NEVER_DEDUP;
use super::report::{Finding, event_aliases, slot_event};

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
