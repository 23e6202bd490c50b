//! The rule set compiled into the engine's slot layout: the slots attempts and requests keep,
//! the ones tombstones keep, and which events each rule reacts to. [`super::Checker::new`]
//! builds the store from it.

use std::time::Duration;

use crate::engine::rules::{self, CompiledRule, RuleSet, Scope, Shape};
use crate::engine::state::{Hits, SlotLayout, SlotSpec, SpecIndex};

/// Which events of an attempt a compiled rule has anything to do with.
#[derive(Debug, Clone, Copy)]
pub(super) struct Reactions {
    /// Events matching one of these attempt specs.
    pub specs: u64,
    /// A predicate: also a new fact (input length) about an earlier event.
    pub predicate: bool,
    /// Every event (request-scope rules: linking and request-level triggers matter).
    pub always: bool,
    /// What the rule does with an event it reacts to.
    pub step: Step,
}

/// What a rule does with an attempt's event it reacts to, by its shape and scope: one byte
/// read per rule visited, where matching on the rule's shape reads the rule's record (the
/// shape's payload is read only by the step taken).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    /// Attempt-scope never-after: look for a breaching pair.
    AttemptNeverAfter,
    /// Request-scope never-after: bring the event into the request.
    RequestNeverAfter,
    /// Must-follow or requires-before: arm the deadline on a trigger.
    Deadline,
    /// Judge the event, or judge earlier ones again on a new fact.
    Predicate,
    /// Judged elsewhere (distinct: from resolving; never: on the event alone).
    None,
}

/// The rules an attempt's event may concern, as bit sets over rule indices: one read of its
/// spec-index row's rules (and rarely an OR per spec matched on a condition) instead of a test
/// per rule.
#[derive(Debug, Clone)]
pub(super) struct ReactingRules {
    /// Per attempt spec, the rules whose [`Reactions::specs`] name it.
    by_spec: [u64; SlotLayout::MAX],
    /// Per spec-index row, the rules of the specs it matches outright (`by_spec` ORed over them
    /// once, when the rules are compiled).
    by_row: Box<[u64]>,
    /// Rules that react to every event ([`Reactions::always`]).
    always: u64,
    /// Rules that react to a new fact ([`Reactions::predicate`]).
    predicate: u64,
    /// Attempt-scope never-after rules: a merge brings events this one did not match, and
    /// their pairs may span the two attempts.
    remerge: u64,
}

impl ReactingRules {
    fn of(rules: &[CompiledRule], reacts: &[Reactions], index: &SpecIndex) -> ReactingRules {
        let mut m = ReactingRules {
            by_spec: [0; SlotLayout::MAX],
            by_row: Box::default(),
            always: 0,
            predicate: 0,
            remerge: 0,
        };
        for (ri, (rule, r)) in rules.iter().zip(reacts).enumerate() {
            let bit = 1u64 << ri;
            let mut specs = r.specs;
            while specs != 0 {
                m.by_spec[specs.trailing_zeros() as usize] |= bit;
                specs &= specs - 1;
            }
            if r.always {
                m.always |= bit;
            }
            if r.predicate {
                m.predicate |= bit;
            }
            if never_after_of(rule, Scope::Attempt) {
                m.remerge |= bit;
            }
        }
        m.by_row = index
            .attempt_rows()
            .map(|specs| m.of_specs(specs))
            .collect();
        m
    }

    /// The attempt-scope never-after rules.
    #[inline(always)]
    pub fn attempt_never_after(&self) -> u64 {
        self.remerge
    }

    /// The rules whose reactions name one of `specs`.
    #[inline(always)]
    fn of_specs(&self, mut specs: u64) -> u64 {
        let mut rules = 0;
        while specs != 0 {
            rules |= self.by_spec[specs.trailing_zeros() as usize];
            specs &= specs - 1;
        }
        rules
    }

    /// The rules that have anything to do with an event matching attempt specs `hits`, which
    /// raised a fact (`facts_changed`) or merged two attempts (`merged`).
    #[inline(always)]
    pub fn of_event(&self, hits: Hits, facts_changed: bool, merged: bool) -> u64 {
        let mut rules = self.always | self.by_row[hits.row];
        if facts_changed {
            rules |= self.predicate;
        }
        if merged {
            rules |= self.remerge;
        }
        rules | self.of_specs(hits.attempt_conditional)
    }
}

/// Everything the checker and its store are assembled from.
pub(super) struct Layout {
    pub rules: Vec<CompiledRule>,
    pub attempt_specs: Vec<SlotSpec>,
    pub request_specs: Vec<SlotSpec>,
    /// The specs of both an event matches.
    pub index: SpecIndex,
    /// Request slots that hold triggers (request-level events only update those).
    pub request_trigger_mask: u64,
    pub rule_reacts: Vec<Reactions>,
    pub reacting: ReactingRules,
    /// Rules judged when a deadline passes (must-follow, requires-before, predicates).
    pub deadline_rules: u64,
    /// (attempt slot, request slot) pairs: what a linked attempt brings into its request.
    pub request_links: Vec<(usize, usize)>,
    /// The attempt slots a tombstone keeps, in its order.
    pub tomb_slot_map: Vec<usize>,
    /// Rules judged on tombstones (attempt-scope never-after ones).
    pub tomb_rule_mask: u64,
    /// The longest time after its trigger a rule may still need an attempt's live state.
    pub horizon: Duration,
}

impl Layout {
    /// Compiles the enabled rules of `set`.
    pub fn compile(set: &RuleSet) -> Layout {
        let mut attempt = SlotLayout::default();
        let mut request = SlotLayout::default();
        let rules = rules::compile(set, &mut attempt, &mut request);
        assert!(attempt.len() <= SlotLayout::MAX && request.len() <= SlotLayout::MAX);
        let mut request_trigger_mask = 0u64;
        let mut request_links = Vec::new();
        for r in rules.iter().filter(|r| never_after_of(r, Scope::Request)) {
            request_trigger_mask |= 1 << r.slots.trigger;
            let link = (r.slots.other_latest, r.slots.other);
            if !request_links.contains(&link) {
                request_links.push(link);
            }
        }
        let (tomb_slot_map, tomb_rule_mask) = tombstone_slots(&rules, &attempt);
        let horizon = rules
            .iter()
            .map(|r| r.rule.horizon())
            .fold(Duration::ZERO, Duration::max);
        let rule_reacts: Vec<Reactions> = rules.iter().map(reacts).collect();
        let index = SpecIndex::new(&attempt.specs, &request.specs);
        let reacting = ReactingRules::of(&rules, &rule_reacts, &index);
        let deadline_rules = rules
            .iter()
            .enumerate()
            .filter(|(_, r)| {
                matches!(
                    r.rule.shape,
                    Shape::MustFollow(_) | Shape::RequiresBefore(_) | Shape::Predicate(_)
                )
            })
            .fold(0u64, |m, (ri, _)| m | 1 << ri);
        Layout {
            index,
            attempt_specs: attempt.specs,
            request_specs: request.specs,
            request_trigger_mask,
            rule_reacts,
            reacting,
            deadline_rules,
            request_links,
            tomb_slot_map,
            tomb_rule_mask,
            horizon,
            rules,
        }
    }
}

fn never_after_of(r: &CompiledRule, scope: Scope) -> bool {
    matches!(r.rule.shape, Shape::NeverAfter(_)) && r.rule.scope == scope
}

/// The attempt slots tombstones keep (those of attempt-scope never-after rules, the only ones
/// judged on their slots) and the mask of the rules judged on tombstones (those and the
/// distinct rules).
fn tombstone_slots(rules: &[CompiledRule], attempt: &SlotLayout) -> (Vec<usize>, u64) {
    let mut map = Vec::new();
    let mut mask = 0u64;
    for (ri, r) in rules.iter().enumerate() {
        // A distinct rule keeps only its fired bit: a room that collided once reports it once.
        if matches!(r.rule.shape, Shape::Distinct(_)) {
            mask |= 1 << ri;
            continue;
        }
        if !never_after_of(r, Scope::Attempt) {
            continue;
        }
        mask |= 1 << ri;
        // Pairs stay adjacent so tombstones fold them like live attempts do.
        for k in [r.slots.trigger, r.slots.other] {
            let width = if attempt.specs[k].keep.is_pair() {
                2
            } else {
                1
            };
            for j in k..k + width {
                if !map.contains(&j) {
                    map.push(j);
                }
            }
        }
    }
    (map, mask)
}

fn reacts(r: &CompiledRule) -> Reactions {
    let k = r.slots;
    let specs = |specs, step| Reactions {
        specs,
        predicate: false,
        always: false,
        step,
    };
    match (&r.rule.shape, r.rule.scope) {
        (Shape::NeverAfter(_), Scope::Attempt) => {
            specs((1 << k.trigger) | (1 << k.other), Step::AttemptNeverAfter)
        }
        // Linking an attempt to its request, or a request-level trigger, matters too.
        (Shape::NeverAfter(_), Scope::Request) => Reactions {
            always: true,
            ..specs(0, Step::RequestNeverAfter)
        },
        (Shape::MustFollow(_) | Shape::RequiresBefore(_), _) => {
            specs(1 << k.trigger, Step::Deadline)
        }
        // Judged from what resolving the event found (see `Resolved::collision`).
        (Shape::Distinct(_), _) => specs(0, Step::None),
        (Shape::Predicate(_), _) => Reactions {
            predicate: true,
            ..specs(k.stage_mask(), Step::Predicate)
        },
        // Judged on every event apart from the attempt's rules (`never.rs`): no slot.
        (Shape::Never(_), _) => specs(0, Step::None),
    }
}
