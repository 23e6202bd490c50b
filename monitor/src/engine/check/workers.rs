//! Nodes and workers: interning their names, capacity reports per worker and stage, and
//! predicate rules on events that belong to no attempt (one violation per rule, worker and
//! stage).

use crate::engine::rules::Shape;
use crate::engine::rules::predicate::{Capacity, Known};
use crate::engine::state::{NODE_LOCAL, NodeId};
use crate::event::LifecycleEvent;
use crate::violation::{self, Violation};

use super::Checker;
use super::report::{Finding, slot_event};

const MAX_NODES: usize = 126;
const MAX_CAPACITY_ENTRIES: usize = 65_536;
const MAX_WORKER_DEDUP: usize = 100_000;

impl Checker {
    #[inline]
    pub(super) fn node_id(&mut self, node: Option<&str>) -> NodeId {
        let Some(n) = node else { return NODE_LOCAL };
        if let Some(&id) = self.nodes.get(n) {
            return id;
        }
        let id = (self.nodes.len() + 1).min(MAX_NODES + 1) as NodeId;
        if self.nodes.len() < MAX_NODES {
            self.nodes.insert(n.into(), id);
        }
        id
    }

    /// Capacity is per worker (or, without a worker, per node) and stage.
    #[inline]
    pub(super) fn worker_key(e: &LifecycleEvent) -> Option<u32> {
        e.worker
            .as_deref()
            .or(e.node.as_deref())
            .map(|w| violation::fnv1a(&[w.as_bytes()]) as u32)
    }

    /// The interned id of worker key `w` (0 once 65 535 distinct workers were seen; counted).
    #[inline]
    pub(super) fn worker_id(&mut self, w: u32) -> u16 {
        if let Some(&id) = self.workers.get(&w) {
            return id;
        }
        if self.worker_hashes.len() > u16::MAX as usize {
            self.stats.workers_untracked += 1;
            return 0;
        }
        let id = self.worker_hashes.len() as u16;
        self.worker_hashes.push(w);
        self.workers.insert(w, id);
        id
    }

    #[inline]
    pub(super) fn record_capacity(&mut self, e: &LifecycleEvent) {
        let Some(key) = Self::worker_key(e).map(|w| (w, e.stage)) else {
            return;
        };
        let report = Capacity::from_event(e);
        if report.is_empty() {
            return;
        }
        if !self.capacity.contains_key(&key) && self.capacity.len() >= MAX_CAPACITY_ENTRIES {
            return;
        }
        self.capacity.entry(key).or_default().update(report);
    }

    pub(super) fn capacity_for(&self, e: &LifecycleEvent) -> Option<Capacity> {
        self.capacity.get(&(Self::worker_key(e)?, e.stage)).copied()
    }

    /// Predicate rules on events that belong to no attempt (capacity reports, bare events):
    /// one violation per (rule, worker, stage).
    pub(super) fn check_worker_predicates(&mut self, e: &LifecycleEvent, out: &mut Vec<Violation>) {
        for ri in 0..self.rules.len() {
            let Shape::Predicate(p) = &self.rules[ri].rule.shape else {
                continue;
            };
            if !p.on.iter().any(|m| m.matches(e)) {
                continue;
            }
            let known = Known {
                input_tokens: None,
                capacity: self.capacity_for(e),
            };
            let Some(breach) = p.evaluate(e, known) else {
                continue;
            };
            let who = e.worker.as_deref().or(e.node.as_deref()).unwrap_or("");
            let key = violation::fnv1a(&[
                self.rules[ri].rule.name.as_bytes(),
                who.as_bytes(),
                e.stage.as_str().as_bytes(),
            ]);
            if self.worker_fired.contains(&key) {
                self.stats.repeats += 1;
                continue;
            }
            if self.worker_fired.len() < MAX_WORKER_DEDUP {
                self.worker_fired.insert(key);
            } else {
                self.stats.worker_dedup_full += 1;
            }
            let f = Finding {
                worker: Some(who),
                offender: Some(slot_event(e)),
                breach: Some(breach),
                ..Finding::new(ri, e.time_ns)
            };
            out.push(self.violation(f));
        }
    }
}
