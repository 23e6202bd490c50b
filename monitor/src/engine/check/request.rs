//! Request-scope never-after rules: a request's slots gather its attempts' events (an attempt
//! linked to its request brings what it has), and request-level events, which name only the
//! request, may trigger. Such events are no attempt's activity.

use crate::engine::identity::Owner;
use crate::engine::rules::{RuleSlots, Scope, Shape};
use crate::engine::state::{Candidates, NodeId, Slot, SlotRead};
use crate::event::LifecycleEvent;
use crate::violation::{AttemptAliases, Violation};

use super::Checker;
use super::attempt::OnAttempt;
use super::never_after::{Current, source_bit};
use super::report::{Finding, event_aliases};

impl Checker {
    /// Events naming only the request: they may trigger request-scope rules, never count as an
    /// attempt's activity.
    #[inline]
    pub(super) fn observe_request_level(
        &mut self,
        r: u32,
        e: &LifecycleEvent,
        request_hit: u64,
        node: NodeId,
        out: &mut Vec<Violation>,
    ) {
        let hit = request_hit & self.request_trigger_mask;
        if hit != 0 {
            let slot = Slot::from_event(e, node);
            self.store.fold_request_slots(r, hit, slot);
            for ri in 0..self.rules.len() {
                let rule = &self.rules[ri];
                if matches!(rule.rule.shape, Shape::NeverAfter(_))
                    && rule.rule.scope == Scope::Request
                    && hit & (1 << rule.slots.trigger) != 0
                {
                    // Request-level events only ever trigger: they are no attempt's activity.
                    let cur = Current {
                        slot,
                        source: e.source,
                        as_trigger: true,
                        as_forbidden: false,
                    };
                    self.check_request_rule(ri, r, None, Some(e), cur, out);
                }
            }
        }
        self.check_worker_predicates(e, out);
    }

    /// A request-scope never-after rule `ri` (slots `slots`) on an attempt's event: the
    /// request takes what the attempt brings, then is judged if that changed anything.
    #[inline(always)]
    pub(super) fn request_rule_on_attempt(
        &mut self,
        ri: usize,
        slots: RuleSlots,
        on: &mut OnAttempt,
        out: &mut Vec<Violation>,
    ) {
        let (a, e, hit, slot) = (on.a, on.e, on.hit, on.slot);
        let as_trigger = on.request_hit & (1 << slots.trigger) != 0;
        let (r, linked) = match on.request {
            Some(r) => (r, on.linked),
            // A solo request (no record) holds its attempt's history already, and cannot
            // breach without a trigger: only a trigger needs its record (an attempt with no
            // request yet gets one, which its ids join when they come).
            None if as_trigger => {
                let r = self.store.trigger_record(a, e.time_ns);
                on.request = Some(r);
                (r, true)
            }
            None => return,
        };
        let as_forbidden = hit & (1 << slots.other_latest) != 0;
        let mut changed = linked || as_forbidden;
        // The request already holds what the attempt had before this event: a newly linked
        // attempt brings all it has; otherwise only this event is new, and only if the attempt
        // kept it.
        if linked {
            let keep_own = self.attempt_specs[slots.other_latest].keep;
            let own = Candidates::of(&self.store.attempt_slots(a), slots.other_latest, keep_own);
            for &o in own.iter() {
                self.store.fold_request_slots(r, 1 << slots.other, o);
            }
        } else if on.changed_specs & (1 << slots.other_latest) != 0 {
            self.store.fold_request_slots(r, 1 << slots.other, slot);
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
            self.check_request_rule(ri, r, Some(a), Some(e), cur, out);
        }
    }

    /// Judges request-scope never-after rule `ri` on request `r`; `a` is the attempt and `e`
    /// the event that brought the change, when there are.
    pub(super) fn check_request_rule(
        &mut self,
        ri: usize,
        r: u32,
        a: Option<u32>,
        e: Option<&LifecycleEvent>,
        cur: Current,
        out: &mut Vec<Violation>,
    ) {
        let Shape::NeverAfter(rule) = &self.rules[ri].rule.shape else {
            return;
        };
        let slots = self.rules[ri].slots;
        let s = self.store.request_slots(r);
        let keep = self.request_specs[slots.trigger].keep;
        if !s.any_set(slots.trigger, keep) {
            return;
        }
        let triggers = Candidates::of(&s, slots.trigger, keep);
        let forbidden = Candidates::of(&s, slots.other, self.request_specs[slots.other].keep);
        let Some((trigger, offender)) = rule.breaching_pair(&triggers, &forbidden, self.skew_ns)
        else {
            return;
        };
        let bit = 1u64 << ri;
        let owner = Owner::Request(r);
        let fired = self.store.request(r).fired & bit != 0;
        let Some(follow_up) = self.follow_up(fired, ri, owner, cur, &triggers, &forbidden) else {
            return;
        };
        self.store.mark_request_fired(r, bit);
        let attempt = match (a, e) {
            (Some(a), _) => self.attempt_aliases(a),
            (None, Some(e)) if e.ids.names_attempt() => event_aliases(e),
            _ => AttemptAliases::default(),
        };
        let f = Finding::never_after(ri, Some(r), attempt, trigger, offender, None, None);
        let reason = e.and_then(|e| e.reason.as_deref()).map(str::to_owned);
        out.push(self.report(owner, f, follow_up, cur, reason));
    }

    /// A request-scope rule that fired may hear of its breach from a new source, even when the
    /// event changes none of the request's slots (the same rejection, reported again by OTLP).
    #[inline]
    pub(super) fn may_corroborate_request(&self, ri: usize, r: u32, cur: Current) -> bool {
        (cur.as_trigger || cur.as_forbidden)
            && self.store.request(r).fired & (1 << ri) != 0
            && self.store.reported(Owner::Request(r), ri) & source_bit(cur.source) == 0
    }
}
