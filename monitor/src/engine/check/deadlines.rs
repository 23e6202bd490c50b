//! Deadline rules (must_follow, requires_before) and predicates waiting for late facts: an
//! attempt queues its earliest due judgement; when the watermark passes it, every due rule of
//! the attempt is judged and the next deadline is queued.

use crate::engine::rules::Shape;
use crate::engine::rules::predicate::Known;
use crate::event::LifecycleEvent;
use crate::violation::Violation;

use super::Checker;
use super::report::Finding;

/// The deadline queue is purged of dead entries only beyond this many (and twice the live attempts).
pub(super) const MIN_TIMER_PURGE: usize = 4096;

impl Checker {
    pub(super) fn schedule(&mut self, a: u32, due: u64) {
        if let Some(generation) = self.store.arm_deadline(a, due) {
            self.timers.push((due, a, generation));
            if self.timers.len() > 2 * self.store.live_attempts() + MIN_TIMER_PURGE {
                self.purge_timers();
            }
        }
    }

    /// Predicate rule `ri` of attempt `a` is judged again once the watermark passes `at`,
    /// unless it fired already.
    #[inline]
    pub(super) fn rejudge_at(&mut self, a: u32, ri: usize, at: u64) {
        if self.store.attempt(a).fired & (1u64 << ri) == 0 {
            self.store.set_rejudge(a, true);
            self.schedule(a, at);
        }
    }

    /// Drops queued deadlines that can no longer fire: the attempt is gone, or an earlier
    /// deadline or settling superseded them (`due_ns` moved). A settled attempt's far deadline
    /// (stuck-attempt: admitted + 330 s) would otherwise stay queued until it passed, so the
    /// queue would hold every attempt of the last 330 s, not the live ones. At most one entry
    /// per live attempt is valid, so purging when the queue exceeds twice that is amortised O(1).
    fn purge_timers(&mut self) {
        let store = &self.store;
        self.timers
            .retain(|&(due, a, generation)| store.timer_valid(due, a, generation));
    }

    /// After a terminal event: if every pending deadline rule is already satisfied, nothing can
    /// breach it any more, so the attempt need not stay live until the deadline.
    #[inline]
    pub(super) fn settle(&mut self, a: u32) {
        let wm = self.stats.watermark_ns;
        let due = self.store.attempt(a).due_ns;
        // Nothing queued, a judgement already due at the next watermark step, or a predicate
        // waiting to be judged again: leave it.
        if due == 0 || due <= wm || self.store.attempt(a).rejudge() {
            return;
        }
        let s = self.store.attempt_slots(a);
        let fired = self.store.attempt(a).fired;
        let pending = bits(self.deadline_rules & !fired).any(|ri| {
            let r = &self.rules[ri];
            let k = r.slots;
            match &r.rule.shape {
                Shape::MustFollow(m) => !m.satisfied(
                    s.get(k.trigger),
                    s.get(k.other),
                    s.get(k.other_latest),
                    self.skew_ns,
                ),
                Shape::RequiresBefore(m) => {
                    m.breached(s.get(k.trigger), s.get(k.other), self.skew_ns)
                }
                // Not judged yet (the watermark has not passed it): a capacity report may still come.
                Shape::Predicate(_) => k
                    .per_stage
                    .iter()
                    .flatten()
                    .any(|&i| s.get(i as usize).is_set() && s.get(i as usize).time() > wm),
                _ => false,
            }
        });
        if !pending {
            // The queued entry no longer matches `due_ns` and is skipped when popped.
            self.store.set_due(a, 0);
        }
    }

    /// Judges the deadline rules of attempt `a` that are due; re-arms the next one.
    #[inline]
    pub(super) fn judge_deadlines(&mut self, a: u32, out: &mut Vec<Violation>) {
        let wm = self.stats.watermark_ns;
        let mut next: Option<u64> = None;
        // One look-up of the attempt's row for all its rules (again after a violation, which
        // needs the store mutably, though it changes no slot).
        let mut s = self.store.attempt_slots(a);
        // Only the rules judged at a deadline, not fired yet (a violation marks its own bit).
        for ri in bits(self.deadline_rules & !self.store.attempt(a).fired) {
            let bit = 1u64 << ri;
            let slots = self.rules[ri].slots;
            let finding = match &self.rules[ri].rule.shape {
                Shape::MustFollow(rule) => {
                    let trigger = s.get(slots.trigger);
                    let Some(due) = rule.due(trigger, self.skew_ns) else {
                        continue;
                    };
                    let (early, late) = (s.get(slots.other), s.get(slots.other_latest));
                    if due > wm {
                        // Already satisfied: nothing can breach it, no need to wake up for it.
                        if !rule.satisfied(trigger, early, late, self.skew_ns) {
                            next = Some(next.map_or(due, |n| n.min(due)));
                        }
                        continue;
                    }
                    let given = slots.given.map(|g| s.get(g as usize));
                    if !rule.breached(trigger, early, late, given, self.skew_ns) {
                        continue;
                    }
                    Finding {
                        trigger: trigger.get(),
                        trigger_reason: self.store.reason(a).map(str::to_owned),
                        // The first expected event past the deadline, if one came.
                        expected: [early, late]
                            .into_iter()
                            .filter_map(|s| s.get())
                            .filter(|l| l.time_ns > due)
                            .min_by_key(|l| l.time_ns),
                        context: given.and_then(|g| g.get()),
                        ..Finding::new(ri, due)
                    }
                }
                Shape::RequiresBefore(rule) => {
                    let ev = s.get(slots.trigger);
                    let Some(due) = rule.due(ev) else { continue };
                    let req = s.get(slots.other);
                    let breached = rule.breached(ev, req, self.skew_ns);
                    if due > wm {
                        // Already satisfied: as `settle` would, no need to wake up for it (the
                        // pending deadline keeps the attempt live).
                        if breached {
                            next = Some(next.map_or(due, |n| n.min(due)));
                        }
                        continue;
                    }
                    if !breached {
                        continue;
                    }
                    Finding {
                        offender: ev.get(),
                        expected: req.get(),
                        ..Finding::new(ri, due)
                    }
                }
                Shape::Predicate(p) => {
                    let at = self.store.attempt(a);
                    let mut found = None;
                    for k in slots.per_stage.iter().flatten() {
                        let Some(ev) = s.get(*k as usize).get() else {
                            continue;
                        };
                        if ev.time_ns > wm {
                            next = Some(next.map_or(ev.time_ns, |n| n.min(ev.time_ns)));
                            continue;
                        }
                        let mut probe =
                            LifecycleEvent::new(ev.time_ns, ev.stage, ev.kind, ev.source);
                        probe.status = ev.status;
                        let known = Known {
                            input_tokens: Some(at.input_tokens as u64).filter(|&n| n > 0),
                            capacity: match at.worker_keys[ev.stage as usize] {
                                0 => None,
                                w => self
                                    .capacity
                                    .get(&(self.worker_hashes[w as usize], ev.stage))
                                    .copied(),
                            },
                        };
                        if let Some(b) = p.evaluate(&probe, known) {
                            found = Some((ev, b));
                            break;
                        }
                    }
                    let Some((ev, breach)) = found else { continue };
                    Finding {
                        offender: Some(ev),
                        breach: Some(breach),
                        ..Finding::new(ri, wm.max(ev.time_ns))
                    }
                }
                _ => continue,
            };
            self.store.mark_fired(a, bit);
            let request = self.store.request_record(a);
            let f = Finding {
                request,
                attempt: self.attempt_aliases(a),
                ..finding
            };
            out.push(self.violation(f));
            s = self.store.attempt_slots(a);
        }
        if let Some(due) = next {
            self.schedule(a, due);
        }
    }
}

/// The indices of the bits set in `mask`, lowest first.
#[inline(always)]
fn bits(mut mask: u64) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        (mask != 0).then(|| {
            let i = mask.trailing_zeros() as usize;
            mask &= mask - 1;
            i
        })
    })
}
