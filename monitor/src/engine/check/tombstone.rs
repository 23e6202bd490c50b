//! Late events on a compacted attempt: only never-after rules still apply. A tombstone keeps
//! the slots of attempt-scope never-after rules and their fired bits; request-scope ones are
//! judged on the request, if it is still known.

use crate::engine::identity::Owner;
use crate::engine::rules::{Scope, Shape};
use crate::engine::state::{NodeId, Slot, fold_into};
use crate::event::{Kind, LifecycleEvent};
use crate::violation::Violation;

use super::Checker;
use super::never_after::Current;
use super::report::{Finding, event_aliases};

impl Checker {
    #[inline]
    pub(super) fn observe_tombstone(
        &mut self,
        seq: u64,
        request: Option<u32>,
        e: &LifecycleEvent,
        hit: u64,
        node: NodeId,
        out: &mut Vec<Violation>,
    ) {
        let Some(ti) = self.store.tomb_index(seq) else {
            return;
        };
        let slot = Slot::from_event(e, node);
        let map = self.store.tomb_slot_map().to_vec();
        let mut kept = self.store.tomb_slots_of(ti);
        for (k, &spec) in map.iter().enumerate() {
            if hit & (1 << spec) != 0 {
                fold_into(&mut kept, k, self.attempt_specs[spec].keep, slot);
            }
        }
        self.store.set_tomb_slots(ti, &kept);
        let attempt = event_aliases(e);
        for ri in 0..self.rules.len() {
            let bit = 1u64 << ri;
            let slots = self.rules[ri].slots;
            match (&self.rules[ri].rule.shape, self.rules[ri].rule.scope) {
                (Shape::NeverAfter(rule), Scope::Attempt) => {
                    if hit & ((1 << slots.trigger) | (1 << slots.other)) == 0 {
                        continue;
                    }
                    let pos = |s: usize| {
                        map.iter()
                            .position(|&m| m == s)
                            .expect("never-after slots are kept in tombstones")
                    };
                    let at = (pos(slots.trigger), pos(slots.other));
                    let (triggers, forbidden) =
                        self.never_after_candidates(&kept, at, slots, hit, slot);
                    if let Some((trigger, offender)) =
                        rule.breaching_pair(&triggers, &forbidden, self.skew_ns)
                    {
                        let current = Current::on_attempt(slot, e.source, hit, slots);
                        let owner = Owner::Tomb(seq);
                        let fired = self.store.tomb_fired(ti) & bit != 0;
                        let Some(follow_up) =
                            self.follow_up(fired, ri, owner, current, &triggers, &forbidden)
                        else {
                            continue;
                        };
                        self.store.add_tomb_fired(ti, bit);
                        let f = Finding::never_after(
                            ri,
                            request,
                            attempt.clone(),
                            trigger,
                            offender,
                            (e.kind == Kind::Rejected)
                                .then(|| e.reason.as_deref().map(str::to_owned))
                                .flatten(),
                            None,
                        );
                        let reason = e.reason.as_deref().map(str::to_owned);
                        out.push(self.report(owner, f, follow_up, current, reason));
                    }
                }
                (Shape::NeverAfter(rule), Scope::Request) => {
                    let Some(r) = request else { continue };
                    let mut changed = false;
                    let as_forbidden = rule.forbidden.iter().any(|m| m.matches(e));
                    let as_trigger = rule.trigger.iter().any(|m| m.matches(e));
                    if as_forbidden {
                        changed |= self.store.fold_request_slots(r, 1 << slots.other, slot) != 0;
                    }
                    if as_trigger {
                        changed |= self.store.fold_request_slots(r, 1 << slots.trigger, slot) != 0;
                    }
                    let cur = Current {
                        slot,
                        source: e.source,
                        as_trigger,
                        as_forbidden,
                    };
                    if changed || self.may_corroborate_request(ri, r, cur) {
                        self.check_request_rule(ri, r, None, Some(e), cur, out);
                    }
                }
                _ => {}
            }
        }
    }
}
