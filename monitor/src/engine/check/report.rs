//! From a finding to a [`Violation`]: its evidence, fingerprint and summary, and for
//! never-after and distinct rules the sources already reported (so each new source corroborates
//! once).

use std::fmt;

use crate::engine::identity::{AttemptAt, Owner};
use crate::engine::rules::Shape;
use crate::engine::rules::distinct::Collision;
use crate::engine::rules::predicate::Breach;
use crate::engine::state::{Slot, SlotEvent};
use crate::event::LifecycleEvent;
use crate::violation::{
    self, AttemptAliases, Evidence, EvidenceRole, RequestAliases, TemplateContext, TemplateEvent,
    Violation,
};

use super::Checker;
use super::never_after::{Current, source_bit};

/// Everything a violation is assembled from.
pub(super) struct Finding<'a> {
    pub rule: usize,
    pub request: Option<u32>,
    pub attempt: AttemptAliases,
    pub worker: Option<&'a str>,
    pub trigger: Option<SlotEvent>,
    pub trigger_reason: Option<String>,
    pub offender: Option<SlotEvent>,
    pub offender_reason: Option<String>,
    pub expected: Option<SlotEvent>,
    pub context: Option<SlotEvent>,
    pub breach: Option<Breach>,
    /// A `distinct` rule's finding: the two values on one key.
    pub collision: Option<Collision>,
    pub detected_at_ns: u64,
    /// For a finding that is one event and names no attempt (`never`): that event's time, part
    /// of the fingerprint, so each such event is an incident of its own.
    pub instance: Option<u64>,
    /// Set on a follow-up that corroborates an emitted violation (never-after, distinct).
    pub corroboration: Option<Corroboration>,
}

/// A new source's event that proves an already reported breach again, and the event it
/// breaches with (a never-after breach is a pair; a distinct rule's collision is the one event
/// that shows the second value, and has no partner).
pub(super) struct Corroboration {
    role: EvidenceRole,
    event: SlotEvent,
    reason: Option<String>,
    partner: Option<SlotEvent>,
}

impl<'a> Finding<'a> {
    /// A finding of rule `rule`, provable at `detected_at_ns`, naming nothing yet.
    pub fn new(rule: usize, detected_at_ns: u64) -> Finding<'a> {
        Finding {
            rule,
            request: None,
            attempt: AttemptAliases::default(),
            worker: None,
            trigger: None,
            trigger_reason: None,
            offender: None,
            offender_reason: None,
            expected: None,
            context: None,
            breach: None,
            collision: None,
            detected_at_ns,
            instance: None,
            corroboration: None,
        }
    }
}

impl Finding<'static> {
    /// A never-after breach: the trigger and the offender prove it, once both are known.
    pub fn never_after(
        rule: usize,
        request: Option<u32>,
        attempt: AttemptAliases,
        trigger: Slot,
        offender: Slot,
        trigger_reason: Option<String>,
        offender_reason: Option<String>,
    ) -> Finding<'static> {
        Finding {
            request,
            attempt,
            trigger: trigger.get(),
            trigger_reason,
            offender: offender.get(),
            offender_reason,
            ..Finding::new(rule, trigger.time().max(offender.time()))
        }
    }

    /// Turns a never-after finding into a corroborating follow-up that adds `current`.
    fn corroborated(
        mut self,
        current: Current,
        role: EvidenceRole,
        partner: Slot,
        reason: Option<String>,
    ) -> Finding<'static> {
        let (Some(event), Some(partner)) = (current.slot.get(), partner.get()) else {
            return self;
        };
        self.detected_at_ns = self.detected_at_ns.max(event.time_ns).max(partner.time_ns);
        self.corroboration = Some(Corroboration {
            role,
            event,
            reason,
            partner: Some(partner),
        });
        self
    }
}

/// The attempt aliases an event names (for attempts known only as a tombstone or not at all).
pub(super) fn event_aliases(e: &LifecycleEvent) -> AttemptAliases {
    AttemptAliases {
        bootstrap_room: e.ids.bootstrap_room.map(|r| r.0),
        rid: e.ids.rid.as_deref().map(str::to_owned),
    }
}

pub(super) fn slot_event(e: &LifecycleEvent) -> SlotEvent {
    SlotEvent {
        time_ns: e.time_ns,
        stage: e.stage,
        kind: e.kind,
        source: e.source,
        status: e.status,
    }
}

fn template_event(ev: SlotEvent) -> TemplateEvent {
    TemplateEvent {
        time_ns: ev.time_ns,
        stage: ev.stage,
        kind: ev.kind,
        source: ev.source,
        status: ev.status,
    }
}

impl Checker {
    /// The event showed a second request on the room of attempt `at` (live or a tombstone; see
    /// `Resolved::collision`): every `distinct` rule reports it, once per attempt, and once more
    /// per source that sees it later (a corroborating follow-up: the notification held for a
    /// second witness gets it, whichever witness was first, an eBPF reader behind a loaded
    /// node's spans included). No request: the two are the finding, and the room names it (its
    /// fingerprint), whichever request came first.
    #[cold]
    pub(super) fn report_collision(
        &mut self,
        at: AttemptAt,
        e: &LifecycleEvent,
        out: &mut Vec<Violation>,
    ) {
        let (first, second) = self.store.take_collided_with();
        let source = source_bit(e.source);
        for ri in 0..self.rules.len() {
            let Shape::Distinct(rule) = &self.rules[ri].rule.shape else {
                continue;
            };
            let alias = rule.alias;
            let bit = 1u64 << ri;
            // The owner's fired bits, marked here once: a live attempt, or a tombstone still kept.
            let (owner, fired, attempt) = match at {
                AttemptAt::Live(a) => (
                    Owner::Attempt(a),
                    self.store.attempt(a).fired & bit != 0,
                    self.attempt_aliases(a),
                ),
                AttemptAt::Tomb(seq) => {
                    let Some(ti) = self.store.tomb_index(seq) else {
                        continue;
                    };
                    (
                        Owner::Tomb(seq),
                        self.store.tomb_fired(ti) & bit != 0,
                        event_aliases(e),
                    )
                }
            };
            if fired && self.store.reported(owner, ri) & source != 0 {
                self.stats.repeats += 1;
                continue;
            }
            match at {
                AttemptAt::Live(a) => self.store.mark_fired(a, bit),
                AttemptAt::Tomb(seq) => {
                    if let Some(ti) = self.store.tomb_index(seq) {
                        self.store.add_tomb_fired(ti, bit);
                    }
                }
            }
            self.store.add_reported(owner, ri, source);
            let offender = slot_event(e);
            let offender_reason = e.reason.as_deref().map(str::to_owned);
            let corroboration = fired.then(|| {
                self.stats.corroborations += 1;
                Corroboration {
                    role: EvidenceRole::Offender,
                    event: offender,
                    reason: offender_reason.clone(),
                    partner: None,
                }
            });
            let f = Finding {
                attempt,
                offender: Some(offender),
                offender_reason,
                collision: Some(Collision {
                    alias,
                    first: first.as_deref().map(String::from).unwrap_or_default(),
                    second: second.as_deref().map(String::from).unwrap_or_default(),
                }),
                corroboration,
                ..Finding::new(ri, e.time_ns)
            };
            out.push(self.violation(f));
        }
    }

    /// Emits a never-after finding (first or corroborating) and remembers its evidence sources.
    pub(super) fn report(
        &mut self,
        owner: Owner,
        f: Finding<'static>,
        follow_up: Option<(EvidenceRole, Slot)>,
        cur: Current,
        reason: Option<String>,
    ) -> Violation {
        let ri = f.rule;
        let mut sources = [f.trigger, f.offender]
            .into_iter()
            .flatten()
            .fold(0, |m, ev| m | source_bit(ev.source));
        let f = match follow_up {
            Some((role, partner)) => {
                sources |= source_bit(cur.source);
                if let Some(p) = partner.get() {
                    sources |= source_bit(p.source);
                }
                self.stats.corroborations += 1;
                f.corroborated(cur, role, partner, reason)
            }
            None => f,
        };
        self.store.add_reported(owner, ri, sources);
        self.violation(f)
    }

    pub(super) fn attempt_aliases(&self, a: u32) -> AttemptAliases {
        AttemptAliases {
            bootstrap_room: self.store.attempt(a).room(),
            rid: self.store.attempt_rid(a).to_string_opt(),
        }
    }

    /// The violation `f` proves; counts it for its rule unless it corroborates one.
    pub(super) fn violation(&mut self, f: Finding<'_>) -> Violation {
        let compiled = &self.rules[f.rule];
        let rule = &compiled.rule;
        let request = f
            .request
            .map(|r| {
                let r = self.store.request(r);
                RequestAliases {
                    request_id: r.request_id().map(str::to_owned),
                    trace_id: r.trace_id().map(str::to_owned),
                }
            })
            .unwrap_or_default();
        let mut primary = request
            .request_id
            .as_ref()
            .map(|s| format!("request_id:{s}"))
            .or_else(|| request.trace_id.as_ref().map(|s| format!("trace_id:{s}")))
            .or_else(|| f.attempt.bootstrap_room.map(|r| format!("room:{r}")))
            .or_else(|| f.attempt.rid.as_ref().map(|s| format!("rid:{s}")))
            .or_else(|| f.worker.map(|w| format!("worker:{w}")))
            .unwrap_or_default();
        if let Some(t) = f.instance {
            primary = format!("{primary}@{t}");
        }
        // The first violation of a request pins its fingerprint alias: an alias learnt later
        // (the x-request-id on the router's span at the very end) must not split one request's
        // retry storm into two notifications.
        if let Some(r) = f.request {
            let r = self.store.find(r);
            match self.store.pinned_alias(r) {
                Some(pinned) => primary = pinned.to_string(),
                None if !primary.is_empty() => self.store.pin_alias(r, &primary),
                None => {}
            }
        }
        let fingerprint = format!(
            "{:016x}",
            violation::fnv1a(&[rule.name.as_bytes(), primary.as_bytes()])
        );

        let mut evidence = Vec::new();
        let mut push = |role, ev: Option<SlotEvent>, reason: Option<String>| {
            if let Some(ev) = ev {
                evidence.push(Evidence {
                    role,
                    time_ns: ev.time_ns,
                    stage: ev.stage,
                    kind: ev.kind,
                    source: ev.source,
                    status: ev.status,
                    reason,
                });
            }
        };
        push(EvidenceRole::Trigger, f.trigger, f.trigger_reason.clone());
        push(EvidenceRole::Context, f.context, None);
        push(
            EvidenceRole::Offender,
            f.offender,
            f.offender_reason.clone(),
        );
        push(EvidenceRole::Expected, f.expected, None);
        if let Some(c) = &f.corroboration {
            let partner_role = match c.role {
                EvidenceRole::Trigger => EvidenceRole::Offender,
                _ => EvidenceRole::Trigger,
            };
            push(c.role, Some(c.event), c.reason.clone());
            push(partner_role, c.partner, None);
        }
        // The same event may be both in the original pair and the corroborating one.
        evidence.sort_by_key(|e| e.time_ns);
        evidence.dedup_by(|a, b| {
            (a.role, a.time_ns, a.stage, a.kind, a.source, a.status)
                == (b.role, b.time_ns, b.stage, b.kind, b.source, b.status)
        });

        let summary = TemplateContext {
            rule: &rule.name,
            severity: rule.severity,
            request: &request,
            attempt: &f.attempt,
            worker: f.worker,
            within: match &rule.shape {
                Shape::MustFollow(m) => Some(m.within.0),
                _ => None,
            },
            breach: f
                .breach
                .as_ref()
                .map(|b| b as &dyn fmt::Display)
                .or(f.collision.as_ref().map(|c| c as &dyn fmt::Display)),
            trigger: f.trigger.map(template_event),
            trigger_reason: f.trigger_reason.as_deref(),
            event: f.offender.map(template_event),
            event_reason: f.offender_reason.as_deref(),
        }
        .render(&rule.output);
        // A follow-up proves the same breach again: it is counted (in `corroborations`, where
        // it is created) but is not a new violation.
        if f.corroboration.is_none() {
            self.per_rule[f.rule] += 1;
        }
        Violation {
            rule: rule.name.clone(),
            severity: rule.severity,
            summary,
            request,
            attempt: f.attempt,
            worker: f.worker.map(str::to_owned),
            detected_at_ns: f.detected_at_ns,
            fingerprint,
            evidence,
            corroborates: f.corroboration.is_some(),
        }
    }
}
