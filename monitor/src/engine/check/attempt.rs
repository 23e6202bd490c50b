//! Events on a live attempt. The event is folded into the attempt's slots and facts; then each
//! rule that reacts to it takes its step: a never-after rule looks for a breaching pair, a
//! request-scope one brings the event into the request ([`super::request`]), a deadline rule
//! arms its deadline, a predicate judges the event or, on a new fact, judges earlier ones again.
//!
//! This is the per-event hot path: the steps are `#[inline(always)]`, each called from one
//! place, so the path compiles to one body.

use crate::engine::identity::{Owner, Resolved};
use crate::engine::rules::predicate::{Breach, Known};
use crate::engine::rules::{RuleSlots, Shape};
use crate::engine::state::{Candidates, Hits, NodeId, Slot, SlotRead};
use crate::event::{Kind, LifecycleEvent, Stage};
use crate::violation::Violation;

use super::Checker;
use super::layout::Step;
use super::never_after::Current;
use super::report::{Finding, slot_event};

/// The observed event, as the rules of its attempt see it.
pub(super) struct OnAttempt<'e> {
    pub a: u32,
    pub e: &'e LifecycleEvent,
    /// Attempt specs the event matches.
    pub hit: u64,
    /// Request specs the event matches.
    pub request_hit: u64,
    pub slot: Slot,
    /// Attempt specs whose kept slots the event changed.
    pub changed_specs: u64,
    /// The event raised the attempt's input length, a fact predicates judge with.
    pub facts_changed: bool,
    /// The attempt's request record, once known (a solo request gets one when a rule needs it).
    pub request: Option<u32>,
    /// Resolving linked the attempt to its request just now.
    pub linked: bool,
}

impl Checker {
    pub(super) fn observe_attempt(
        &mut self,
        a: u32,
        resolved: Resolved,
        e: &LifecycleEvent,
        hits: Hits,
        node: NodeId,
        out: &mut Vec<Violation>,
    ) {
        let hit = hits.attempt;
        let slot = Slot::from_event(e, node);
        let changed_specs = self.store.fold_attempt_slots(a, hit, slot);
        let facts_changed = self.note_activity(a, e);
        let mut on = OnAttempt {
            a,
            e,
            hit,
            request_hit: hits.request,
            slot,
            changed_specs,
            facts_changed,
            request: resolved.request,
            linked: resolved.linked,
        };
        // Most rules have nothing to do with most events: only those that do are visited, in
        // rule order.
        let mut reacting = self.reacting.of_event(hits, facts_changed, resolved.merged);
        let open = self.never_after_open(a, reacting, hit);
        while reacting != 0 {
            let ri = reacting.trailing_zeros() as usize;
            reacting &= reacting - 1;
            // The step is the shape's (`layout::reacts`): the `else` arms below never run.
            match self.rule_reacts[ri].step {
                Step::AttemptNeverAfter if open & (1 << ri) != 0 => {
                    let Shape::NeverAfter(rule) = &self.rules[ri].rule.shape else {
                        continue;
                    };
                    let slots = self.rules[ri].slots;
                    let s = self.store.attempt_slots(a);
                    let cands = self.never_after_candidates(
                        &s,
                        (slots.trigger, slots.other),
                        slots,
                        hit,
                        slot,
                    );
                    if let Some(pair) = rule.breaching_pair(&cands.0, &cands.1, self.skew_ns) {
                        let current = Current::on_attempt(slot, e.source, hit, slots);
                        self.report_never_after(ri, &mut on, current, pair, &cands, out);
                    }
                }
                // No trigger, kept or current: nothing to pair (`never_after_open`).
                Step::AttemptNeverAfter => {}
                Step::RequestNeverAfter => {
                    let slots = self.rules[ri].slots;
                    self.request_rule_on_attempt(ri, slots, &mut on, out)
                }
                Step::Deadline => {
                    let trigger = self.rules[ri].slots.trigger;
                    if hit & (1 << trigger) == 0 {
                        continue;
                    }
                    let ev = self.store.attempt_slots(a).get(trigger);
                    let due = match &self.rules[ri].rule.shape {
                        Shape::MustFollow(rule) => rule.due(ev, self.skew_ns),
                        Shape::RequiresBefore(rule) => rule.due(ev),
                        _ => None,
                    };
                    if let Some(due) = due {
                        self.schedule(a, due);
                    }
                }
                Step::Predicate if hit & self.rule_reacts[ri].specs != 0 => {
                    let Shape::Predicate(p) = &self.rules[ri].rule.shape else {
                        continue;
                    };
                    let known = Known {
                        input_tokens: Some(self.store.attempt(a).input_tokens as u64)
                            .filter(|&n| n > 0),
                        capacity: self.capacity_for(e),
                    };
                    match p.evaluate(e, known) {
                        Some(breach) => self.report_predicate(ri, &mut on, breach, out),
                        // Not (yet) a breach: judge again once everything up to this event arrived.
                        None => self.rejudge_at(a, ri, e.time_ns),
                    }
                }
                // A new fact (the input length) may make an earlier admission a breach.
                Step::Predicate => {
                    let slots = self.rules[ri].slots;
                    self.rejudge_earliest(ri, slots, &on)
                }
                // Reacts to no slot: distinct rules are judged below, from what resolving
                // found; never rules on the event alone, whatever it names (`never.rs`).
                Step::None => {}
            }
        }
        if let Some(room_owner) = resolved.collision {
            self.report_collision(room_owner, e, out);
        }
        // Once every leg ended, any event may be the one that satisfies the last pending
        // deadline (a required event that arrives after the terminal one): whether a deadline
        // still holds the attempt live must not depend on which came last.
        if e.kind.is_terminal() || self.store.attempt(a).ended() {
            self.settle(a);
        }
    }

    /// Of the attempt-scope never-after rules among `reacting`, those that may pair anything on
    /// this event: the event is a trigger, or the attempt kept one. Nearly every attempt never
    /// sees a trigger (a rejection), and most events are some rule's forbidden event: one read
    /// of the attempt's slots answers for every rule, where each rule's own look would read
    /// them again (`never_after_candidates` makes the same test and finds nothing).
    #[inline(always)]
    fn never_after_open(&self, a: u32, reacting: u64, hit: u64) -> u64 {
        let mut rules = reacting & self.reacting.attempt_never_after();
        if rules == 0 {
            return 0;
        }
        let s = self.store.attempt_slots(a);
        let mut open = 0;
        while rules != 0 {
            let ri = rules.trailing_zeros() as usize;
            rules &= rules - 1;
            let k = self.rules[ri].slots.trigger;
            if hit & (1 << k) != 0 || s.any_set(k, self.attempt_specs[k].keep) {
                open |= 1 << ri;
            }
        }
        open
    }

    /// Folds the event's facts into attempt `a` (activity time, input length, worker, open and
    /// closed legs, rejection reason); whether the input length grew.
    #[inline(always)]
    fn note_activity(&mut self, a: u32, e: &LifecycleEvent) -> bool {
        let worker = Self::worker_key(e).map(|w| self.worker_id(w));
        let at = self.store.attempt_mut(a);
        at.last_ns = at.last_ns.max(e.time_ns);
        let mut facts_changed = false;
        if let Some(n) = e.input_tokens {
            let n = n.min(u32::MAX as u64) as u32;
            facts_changed = n > at.input_tokens;
            at.input_tokens = at.input_tokens.max(n);
        }
        if let Some(w) = worker {
            at.worker_keys[e.stage as usize] = w;
        }
        let stage_bit = 1u8 << (e.stage as u8);
        // Transfer is activity between the legs, not a leg that must end on its own.
        match e.kind {
            Kind::Received | Kind::Admitted | Kind::Work if e.stage != Stage::Transfer => {
                at.legs_open |= stage_bit
            }
            k if k.is_terminal() => at.legs_closed |= stage_bit,
            _ => {}
        }
        if e.kind == Kind::Rejected
            && let Some(r) = &e.reason
        {
            self.store.set_reason_once(a, r);
        }
        facts_changed
    }

    /// An attempt-scope never-after rule found the breaching `pair` among `cands`: reports it,
    /// first or as a follow-up from a new source, unless it is a repeat.
    #[inline(always)]
    fn report_never_after(
        &mut self,
        ri: usize,
        on: &mut OnAttempt,
        current: Current,
        (trigger, offender): (Slot, Slot),
        (triggers, forbidden): &(Candidates, Candidates),
        out: &mut Vec<Violation>,
    ) {
        let (a, e) = (on.a, on.e);
        let bit = 1u64 << ri;
        let owner = Owner::Attempt(a);
        let fired = self.store.attempt(a).fired & bit != 0;
        let Some(follow_up) = self.follow_up(fired, ri, owner, current, triggers, forbidden) else {
            return;
        };
        self.store.mark_fired(a, bit);
        let offender_is_current = offender.time() == e.time_ns && current.as_forbidden;
        // The violation names the request: a solo one gets its record.
        on.request = on.request.or_else(|| self.store.request_record(a));
        let f = Finding::never_after(
            ri,
            on.request,
            self.attempt_aliases(a),
            trigger,
            offender,
            self.store.reason(a).map(str::to_owned),
            offender_is_current
                .then(|| e.reason.as_deref().map(str::to_owned))
                .flatten(),
        );
        let reason = e.reason.as_deref().map(str::to_owned);
        out.push(self.report(owner, f, follow_up, current, reason));
    }

    /// A predicate holds for the event: reports it once per attempt.
    #[inline(always)]
    fn report_predicate(
        &mut self,
        ri: usize,
        on: &mut OnAttempt,
        breach: Breach,
        out: &mut Vec<Violation>,
    ) {
        let (a, e) = (on.a, on.e);
        let bit = 1u64 << ri;
        if self.store.attempt(a).fired & bit != 0 {
            self.stats.repeats += 1;
            return;
        }
        self.store.mark_fired(a, bit);
        on.request = on.request.or_else(|| self.store.request_record(a));
        let f = Finding {
            request: on.request,
            attempt: self.attempt_aliases(a),
            offender: Some(slot_event(e)),
            offender_reason: e.reason.as_deref().map(str::to_owned),
            breach: Some(breach),
            ..Finding::new(ri, e.time_ns)
        };
        out.push(self.violation(f));
    }

    /// The input length grew: predicate `ri` is judged again from the attempt's earliest
    /// matching event on.
    #[inline(always)]
    fn rejudge_earliest(&mut self, ri: usize, slots: RuleSlots, on: &OnAttempt) {
        let s = self.store.attempt_slots(on.a);
        let first = slots
            .per_stage
            .iter()
            .flatten()
            .map(|&k| s.get(k as usize))
            .filter(|s| s.is_set())
            .map(|s| s.time())
            .min();
        if let Some(first) = first
            && on.facts_changed
        {
            self.rejudge_at(on.a, ri, first);
        }
    }
}
