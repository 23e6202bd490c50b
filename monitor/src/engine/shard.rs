//! The engine split over several checkers, each on a core of its own (`revenant run
//! --engine-shards`), by cluster mode's split ([`super::partition`]): an event that names an attempt goes to the
//! shard of its room (or rid), one that names none to every shard, so that each attempt is
//! judged whole by one checker and each request-level fact is next to every attempt it concerns.
//!
//! Three things keep the shards' verdicts those of one checker fed everything:
//!
//! - **One attempt, one shard.** SGLang's events name an attempt by its room, its rid or both;
//!   one checker merges what it saw under each as soon as an event names both. A shard cannot
//!   merge with another shard's part, so an event that names only a rid whose room is not known
//!   yet waits in the router (while rooms are in use at all: vLLM has none) until an event links
//!   the rid to its room, and then goes to the room's shard; after [`ShardRouter::new`]'s `hold`
//!   (less than the allowed lateness, within which the engine's verdicts do not depend on
//!   arrival order) it goes to the rid's own shard, counted as unlinked. Events naming only a
//!   room go to the room's shard at once: a room is the key SGLang's own wire carries.
//! - **One watermark.** A checker's watermark follows the newest event it has seen. A shard sees
//!   only its part, so each event it is given comes with the newest event time of the whole
//!   input before it ([`ShardRouter::route`]); the shard calls [`Checker::follow`] with it
//!   before observing the event. Its deadlines pass, and its events count as late, exactly where
//!   one checker's would.
//! - **One fingerprint alias per request.** One checker pins the alias a request's fingerprints
//!   are made of at its first finding, whatever the rule; shards would pin their own. The merge
//!   pins it at the first finding of the request it passes (under each of the request's ids)
//!   and makes every later finding's fingerprint of it.
//! - **One finding per identity.** What no attempt owns can be found on several shards: a
//!   `never` rule on an event sent to every shard, a capacity predicate on a request-level event,
//!   a request-scope rule whose request has attempts on two shards. [`ShardMerge`] lets each
//!   identity through from the first shard that reports it and drops it from the others
//!   (counted per rule, so the per-rule violation counts stay those of one checker). Attempt-scope
//!   findings name their attempt, which lives on one shard.
//!
//! Sans-IO like the rest of the engine: the threads that run the shards are the pipeline's.

use std::collections::HashMap;

use foldhash::fast::RandomState;

use super::check::metrics::ShardWaits;
use super::partition::Partitioner;
pub use super::partition::Route;
use super::rules::{Rule, Scope};
use crate::event::LifecycleEvent;
use crate::violation::{Violation, fnv1a};

/// Links from rid to room the router remembers (two generations of this many each).
const ROUTER_LINKS: usize = 1 << 18;

/// Identities the merge remembers (two generations of this many each): far more than the
/// findings a few minutes bring, the time within which shards report one identity.
const MERGE_IDENTITIES: usize = 1 << 16;

/// How long after the last event that named a room rooms count as in use (and rid-only events
/// wait for their room).
const ROOMS_IN_USE_NS: u64 = 60_000_000_000;

/// Most events waiting for their rid's room at once; beyond it the oldest rid's go on (counted).
const MAX_WAITING: usize = 1 << 16;

/// An event the router sends on: one of the batch's, by its index, or one that waited.
#[derive(Debug, Clone, Copy)]
pub enum Sent<'a> {
    Batch(usize, &'a LifecycleEvent),
    Waited(&'a LifecycleEvent),
}

impl<'a> Sent<'a> {
    pub fn event(self) -> &'a LifecycleEvent {
        match self {
            Sent::Batch(_, e) | Sent::Waited(e) => e,
        }
    }
}

/// Splits batches over the shards.
pub struct ShardRouter {
    partitioner: Partitioner,
    newest_ns: u64,
    /// The newest event time that named a room.
    room_seen_ns: u64,
    hold_ns: u64,
    /// Rid-only events waiting for their room, by rid, and the rids in the order they began to
    /// wait (with the event time they began at; a rid released by a link stays in the queue
    /// until its turn, and is skipped).
    waiting: HashMap<Box<str>, Vec<LifecycleEvent>, RandomState>,
    queue: std::collections::VecDeque<(u64, Box<str>)>,
    waiting_events: usize,
    stats: ShardWaits,
}

impl ShardRouter {
    /// A router over `shards`; a rid-only event waits at most `hold_ns` of event time for its
    /// room.
    pub fn new(shards: usize, hold_ns: u64) -> ShardRouter {
        ShardRouter {
            partitioner: Partitioner::new(shards.max(1) as u32, ROUTER_LINKS),
            newest_ns: 0,
            room_seen_ns: 0,
            hold_ns,
            waiting: HashMap::default(),
            queue: std::collections::VecDeque::new(),
            waiting_events: 0,
            stats: ShardWaits::default(),
        }
    }

    /// What became of the events that waited, and how many wait now.
    pub fn waits(&self) -> ShardWaits {
        ShardWaits {
            waiting: self.waiting_events as u64,
            ..self.stats
        }
    }

    /// The newest event time routed so far.
    pub fn newest_ns(&self) -> u64 {
        self.newest_ns
    }

    /// Routes each event of `batch`: `deliver(route, newest_before_ns, event)`, where
    /// `newest_before_ns` is the newest event time of the whole input before it. Rid-only events
    /// may wait (see the module documentation); those whose wait ran out by the newest event
    /// time go on.
    pub fn route(
        &mut self,
        batch: &[LifecycleEvent],
        mut deliver: impl FnMut(Route, u64, Sent<'_>),
    ) {
        for (index, event) in batch.iter().enumerate() {
            let newest_before_ns = self.newest_ns;
            self.newest_ns = self.newest_ns.max(event.time_ns);
            let ids = &event.ids;
            if ids.bootstrap_room.is_some() {
                self.room_seen_ns = self.room_seen_ns.max(event.time_ns);
            } else if let Some(rid) = ids.rid.as_deref()
                && self.rooms_in_use()
                && self.partitioner.room_of(rid).is_none()
            {
                self.wait(event, &mut deliver);
                continue;
            }
            let linked = match (&ids.bootstrap_room, ids.rid.as_deref()) {
                (Some(_), Some(rid)) => self.waiting.remove(rid),
                _ => None,
            };
            let route = self.partitioner.route(event);
            deliver(route, newest_before_ns, Sent::Batch(index, event));
            if let Some(events) = linked {
                self.stats.linked += events.len() as u64;
                self.waiting_events -= events.len();
                for e in &events {
                    deliver(route, self.newest_ns, Sent::Waited(e));
                }
            }
        }
        self.release(self.newest_ns, deliver);
    }

    /// Sends on what waited for its room longer than the hold by `now_ns` (event time, or the
    /// driver's clock when no event comes).
    pub fn release(&mut self, now_ns: u64, mut deliver: impl FnMut(Route, u64, Sent<'_>)) {
        while let Some((since, _)) = self.queue.front()
            && since.saturating_add(self.hold_ns) <= now_ns
        {
            let (_, rid) = self.queue.pop_front().expect("a front");
            if let Some(events) = self.waiting.remove(&rid) {
                self.stats.unlinked += events.len() as u64;
                self.send_on(events, &mut deliver);
            }
        }
    }

    /// Sends on everything that waits (the end of the input).
    pub fn release_all(&mut self, mut deliver: impl FnMut(Route, u64, Sent<'_>)) {
        while let Some((_, rid)) = self.queue.pop_front() {
            if let Some(events) = self.waiting.remove(&rid) {
                self.stats.unlinked += events.len() as u64;
                self.send_on(events, &mut deliver);
            }
        }
    }

    fn rooms_in_use(&self) -> bool {
        self.room_seen_ns > 0 && self.room_seen_ns.saturating_add(ROOMS_IN_USE_NS) >= self.newest_ns
    }

    fn wait(&mut self, event: &LifecycleEvent, deliver: &mut impl FnMut(Route, u64, Sent<'_>)) {
        let rid: &str = event.ids.rid.as_deref().expect("a rid-only event");
        match self.waiting.get_mut(rid) {
            Some(list) => list.push(event.clone()),
            None => {
                self.queue.push_back((event.time_ns, rid.into()));
                self.waiting.insert(rid.into(), vec![event.clone()]);
            }
        }
        self.waiting_events += 1;
        while self.waiting_events > MAX_WAITING
            && let Some((_, rid)) = self.queue.pop_front()
        {
            if let Some(events) = self.waiting.remove(&rid) {
                self.stats.evicted += events.len() as u64;
                self.send_on(events, deliver);
            }
        }
    }

    /// Routes events that waited (their rid may be linked by now) with the newest time so far.
    fn send_on(
        &mut self,
        events: Vec<LifecycleEvent>,
        deliver: &mut impl FnMut(Route, u64, Sent<'_>),
    ) {
        self.waiting_events -= events.len();
        for e in &events {
            let route = self.partitioner.route(e);
            deliver(route, self.newest_ns, Sent::Waited(e));
        }
    }
}

/// Lets each finding's identity through once across shards.
pub struct ShardMerge {
    /// Rule name → (index, scope).
    rules: HashMap<String, (usize, Scope), RandomState>,
    /// Identity → the shard that reported it first.
    identities: Generations<u16>,
    /// Request alias → the alias the request's fingerprints are made of.
    pins: Generations<String>,
    /// Findings dropped as another shard's, per rule (in the rules' order).
    dropped: Vec<u64>,
}

impl ShardMerge {
    pub fn new<'a>(rules: impl Iterator<Item = &'a Rule>) -> ShardMerge {
        let rules: HashMap<_, _, _> = rules
            .enumerate()
            .map(|(i, r)| (r.name.clone(), (i, r.scope)))
            .collect();
        let n = rules.len();
        ShardMerge {
            rules,
            identities: Generations::default(),
            pins: Generations::default(),
            dropped: vec![0; n],
        }
    }

    /// Whether `v`, found by `shard`, goes on: no other shard reported its identity. A shard's
    /// own findings always go on (one checker's repeats are its own business). Its fingerprint
    /// is made of the alias pinned at its request's first finding.
    pub fn admit(&mut self, shard: u16, v: &mut Violation) -> bool {
        self.pin_fingerprint(v);
        let (index, scope) = self
            .rules
            .get(v.rule.as_str())
            .copied()
            .unwrap_or((usize::MAX, Scope::Attempt));
        let key = identity(v, scope);
        let first = *self.identities.get_or_insert(key, shard);
        if first == shard {
            return true;
        }
        if let Some(d) = self.dropped.get_mut(index) {
            *d += 1;
        }
        false
    }

    /// As one checker pins a request's fingerprint alias at its first finding (whatever the
    /// rule), the merge pins it at the first finding it passes and makes the fingerprint of
    /// every later finding of the request from it.
    fn pin_fingerprint(&mut self, v: &mut Violation) {
        let keys: Vec<u64> = [
            v.request
                .request_id
                .as_deref()
                .map(|a| (&b"request_id"[..], a)),
            v.request.trace_id.as_deref().map(|a| (&b"trace_id"[..], a)),
        ]
        .into_iter()
        .flatten()
        .map(|(kind, alias)| fnv1a(&[kind, b"\0", alias.as_bytes()]))
        .collect();
        if keys.is_empty() {
            return;
        }
        let pinned = keys
            .iter()
            .find_map(|k| self.pins.get(*k).cloned())
            .unwrap_or_else(|| primary_alias(v));
        for k in keys {
            self.pins.get_or_insert(k, pinned.clone());
        }
        v.fingerprint = format!("{:016x}", fnv1a(&[v.rule.as_bytes(), pinned.as_bytes()]));
    }

    /// Findings dropped as another shard's, per rule (in the rules' order).
    pub fn dropped_per_rule(&self) -> &[u64] {
        &self.dropped
    }
}

/// A bounded map: two generations of at most [`MERGE_IDENTITIES`] entries, the older dropped
/// whole when the newer fills; an entry found in the older moves to the newer.
struct Generations<V> {
    young: HashMap<u64, V, RandomState>,
    old: HashMap<u64, V, RandomState>,
}

impl<V> Default for Generations<V> {
    fn default() -> Self {
        Generations {
            young: HashMap::default(),
            old: HashMap::default(),
        }
    }
}

impl<V> Generations<V> {
    fn get(&mut self, key: u64) -> Option<&V> {
        if !self.young.contains_key(&key)
            && let Some(v) = self.old.remove(&key)
        {
            self.insert(key, v);
        }
        self.young.get(&key)
    }

    /// The value under `key`, `value` inserted if there was none.
    fn get_or_insert(&mut self, key: u64, value: V) -> &V {
        if self.get(key).is_none() {
            self.insert(key, value);
        }
        &self.young[&key]
    }

    fn insert(&mut self, key: u64, value: V) {
        if self.young.len() >= MERGE_IDENTITIES {
            let mut table = std::mem::take(&mut self.old);
            table.clear();
            self.old = std::mem::replace(&mut self.young, table);
        }
        self.young.insert(key, value);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.young.len() + self.old.len()
    }
}

/// The alias a checker makes a finding's fingerprint of when its request has none pinned (the
/// order of `engine::check::report`).
fn primary_alias(v: &Violation) -> String {
    let r = &v.request;
    let a = &v.attempt;
    r.request_id
        .as_ref()
        .map(|s| format!("request_id:{s}"))
        .or_else(|| r.trace_id.as_ref().map(|s| format!("trace_id:{s}")))
        .or_else(|| a.bootstrap_room.map(|r| format!("room:{r}")))
        .or_else(|| a.rid.as_ref().map(|s| format!("rid:{s}")))
        .or_else(|| v.worker.as_ref().map(|w| format!("worker:{w}")))
        .unwrap_or_default()
}

/// What makes two findings one: the rule, the fingerprint (the request, or the one event for a
/// finding of a single event), whether it is a corroboration and, for attempt-scope rules, the
/// attempt and the worker. A request-scope rule fires once per request, whichever attempt.
fn identity(v: &Violation, scope: Scope) -> u64 {
    let room = v.attempt.bootstrap_room.map(u64::to_le_bytes);
    let corroborates = [u8::from(v.corroborates)];
    let mut parts: Vec<&[u8]> = vec![v.rule.as_bytes(), v.fingerprint.as_bytes(), &corroborates];
    if scope == Scope::Attempt {
        parts.push(room.as_ref().map_or(&[][..], |r| &r[..]));
        parts.push(b"\0");
        parts.push(v.attempt.rid.as_deref().unwrap_or("").as_bytes());
        parts.push(b"\0");
        parts.push(v.worker.as_deref().unwrap_or("").as_bytes());
    }
    fnv1a(&parts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::check::RuleSet;
    use crate::engine::partition::Route;
    use crate::event::{Kind, Source, Stage};

    fn ev(t: u64) -> LifecycleEvent {
        LifecycleEvent::new(t, Stage::Prefill, Kind::Work, Source::Otlp)
    }

    /// One event for one shard, with the newest event time of the whole input before it.
    #[derive(Debug, Clone)]
    struct Routed {
        newest_before_ns: u64,
        event: LifecycleEvent,
    }

    fn collect(out: &mut [Vec<Routed>]) -> impl FnMut(Route, u64, Sent<'_>) + '_ {
        move |route, newest_before_ns, e| {
            let routed = || Routed {
                newest_before_ns,
                event: e.event().clone(),
            };
            match route {
                Route::One(k) => out[k as usize].push(routed()),
                Route::All => out.iter_mut().for_each(|l| l.push(routed())),
            }
        }
    }

    impl ShardRouter {
        fn split(&mut self, batch: Vec<LifecycleEvent>, out: &mut [Vec<Routed>]) {
            self.route(&batch, collect(out));
        }
    }

    #[test]
    fn attempts_go_to_one_shard_request_level_events_to_all_with_the_newest_time_before_them() {
        let mut r = ShardRouter::new(3, 1_000);
        let mut out = vec![Vec::new(); 3];
        r.split(
            vec![
                ev(50).with_room(7),
                ev(40).with_request_id("q"),
                ev(60).with_rid("a").with_room(7),
                ev(55).with_rid("a"),
            ],
            &mut out,
        );
        let k = crate::engine::partition::room_partition(7, 3) as usize;
        let on_k: Vec<(u64, u64)> = out[k]
            .iter()
            .map(|r| (r.newest_before_ns, r.event.time_ns))
            .collect();
        assert_eq!(on_k, [(0, 50), (50, 40), (50, 60), (60, 55)]);
        for (i, list) in out.iter().enumerate().filter(|(i, _)| *i != k) {
            assert_eq!(list.len(), 1, "shard {i}: only the request-level event");
            assert_eq!(list[0].newest_before_ns, 50);
        }
        assert_eq!(r.newest_ns(), 60);
    }

    fn shard_of(out: &[Vec<Routed>], time_ns: u64) -> Vec<usize> {
        (0..out.len())
            .filter(|&k| out[k].iter().any(|r| r.event.time_ns == time_ns))
            .collect()
    }

    #[test]
    fn a_rid_only_event_waits_for_its_room_while_rooms_are_in_use() {
        let room_shard = crate::engine::partition::room_partition(7, 4) as usize;
        // A rid whose own shard is not its room's.
        let rid = (0..)
            .map(|i| format!("rid-{i}"))
            .find(|r| crate::engine::partition::rid_partition(r, 4) as usize != room_shard)
            .unwrap();
        let mut r = ShardRouter::new(4, 1_000);
        let mut out = vec![Vec::new(); 4];
        // A room-only event first (eBPF), then the rid-only one (a span), then the link.
        r.split(vec![ev(100).with_room(7)], &mut out);
        r.split(vec![ev(101).with_rid(rid.as_str())], &mut out);
        assert_eq!(shard_of(&out, 101), Vec::<usize>::new(), "it waits");
        assert_eq!(r.waits().waiting, 1);
        r.split(vec![ev(102).with_rid(rid.as_str()).with_room(7)], &mut out);
        assert_eq!(shard_of(&out, 101), [room_shard], "on its room's shard");
        assert_eq!(shard_of(&out, 102), [room_shard]);
        let w = r.waits();
        assert_eq!((w.linked, w.unlinked, w.waiting), (1, 0, 0));

        // No link within the hold: the rid's own shard, counted.
        r.split(vec![ev(200).with_rid("lonely")], &mut out);
        assert!(shard_of(&out, 200).is_empty());
        r.split(vec![ev(1_300).with_room(9)], &mut out);
        let own = crate::engine::partition::rid_partition("lonely", 4) as usize;
        assert_eq!(shard_of(&out, 200), [own]);
        assert_eq!(r.waits().unlinked, 1);
        // A driver's tick releases too, and the end of the input releases everything.
        r.split(
            vec![ev(1_400).with_rid("ticked"), ev(1_401).with_rid("last")],
            &mut out,
        );
        r.release(2_401, collect(&mut out));
        assert_eq!(shard_of(&out, 1_400).len(), 1);
        assert_eq!(shard_of(&out, 1_401).len(), 1);
        r.split(vec![ev(2_500).with_rid("end")], &mut out);
        r.release_all(collect(&mut out));
        assert_eq!(shard_of(&out, 2_500).len(), 1);
        assert_eq!(r.waits().waiting, 0);
    }

    #[test]
    fn without_rooms_rid_only_events_go_at_once() {
        // vLLM names its attempts by rid alone.
        let mut r = ShardRouter::new(4, 1_000);
        let mut out = vec![Vec::new(); 4];
        r.split(vec![ev(1).with_rid("a"), ev(2).with_rid("b")], &mut out);
        assert_eq!(shard_of(&out, 1).len(), 1);
        assert_eq!(shard_of(&out, 2).len(), 1);
        assert_eq!(r.waits(), ShardWaits::default());
    }

    #[test]
    fn the_waiting_room_is_bounded() {
        let mut r = ShardRouter::new(2, u64::MAX / 2);
        let mut out = vec![Vec::new(); 2];
        r.split(vec![ev(1).with_room(1)], &mut out);
        let batch: Vec<_> = (0..MAX_WAITING as u64 + 10)
            .map(|i| ev(2 + i).with_rid(format!("r{i}").as_str()))
            .collect();
        r.split(batch, &mut out);
        let w = r.waits();
        assert_eq!(w.waiting, MAX_WAITING as u64);
        assert_eq!(w.evicted, 10);
        assert_eq!(out.iter().map(Vec::len).sum::<usize>(), 11);
    }

    fn finding(rule: &str, fingerprint: &str, room: Option<u64>) -> Violation {
        Violation {
            rule: rule.into(),
            severity: crate::violation::Severity::Critical,
            summary: String::new(),
            request: Default::default(),
            attempt: crate::violation::AttemptAliases {
                bootstrap_room: room,
                rid: None,
            },
            worker: None,
            detected_at_ns: 0,
            fingerprint: fingerprint.into(),
            evidence: Vec::new(),
            corroborates: false,
        }
    }

    #[test]
    fn an_identity_passes_from_the_first_shard_only() {
        let rules = RuleSet::embedded_defaults();
        let mut m = ShardMerge::new(rules.rules.iter());
        let request_scope = rules
            .rules
            .iter()
            .position(|r| r.scope == Scope::Request)
            .expect("a request-scope default rule");
        let name = rules.rules[request_scope].name.clone();
        // A request-scope rule found on two attempts of one request, on two shards: once.
        assert!(m.admit(1, &mut finding(&name, "f1", Some(7))));
        assert!(!m.admit(0, &mut finding(&name, "f1", Some(8))));
        // The first shard's own repeat is its own.
        assert!(m.admit(1, &mut finding(&name, "f1", Some(9))));
        // An attempt-scope rule: another attempt is another identity.
        assert!(m.admit(0, &mut finding("activity-after-rejection", "f2", Some(7))));
        assert!(m.admit(1, &mut finding("activity-after-rejection", "f2", Some(8))));
        assert!(!m.admit(0, &mut finding("activity-after-rejection", "f2", Some(8))));
        // A request's findings take the fingerprint of its first one's alias, whichever alias
        // they share with it.
        let with = |request_id: Option<&str>, trace_id: Option<&str>| {
            let mut v = finding("activity-after-rejection", "shard's own", Some(11));
            v.request.request_id = request_id.map(str::to_owned);
            v.request.trace_id = trace_id.map(str::to_owned);
            v
        };
        let by_trace = |rule: &str| {
            format!(
                "{:016x}",
                fnv1a(&[rule.as_bytes(), b"trace_id:t1".as_slice()])
            )
        };
        let mut first = with(None, Some("t1"));
        assert!(m.admit(0, &mut first));
        assert_eq!(first.fingerprint, by_trace("activity-after-rejection"));
        let mut later = with(Some("q1"), Some("t1"));
        assert!(m.admit(0, &mut later));
        assert_eq!(later.fingerprint, first.fingerprint);
        let mut by_request_id = with(Some("q1"), None);
        by_request_id.rule = "orphaned-leg".into();
        assert!(m.admit(0, &mut by_request_id));
        assert_eq!(by_request_id.fingerprint, by_trace("orphaned-leg"));
        let dropped = m.dropped_per_rule();
        assert_eq!(dropped[request_scope], 1);
        assert_eq!(dropped.iter().sum::<u64>(), 2);
    }

    #[test]
    fn the_merge_forgets_whole_generations() {
        let mut m = ShardMerge::new(RuleSet::embedded_defaults().rules.iter());
        for i in 0..(2 * MERGE_IDENTITIES + 1) {
            assert!(m.admit(0, &mut finding("x", &i.to_string(), None)));
        }
        assert!(m.identities.len() <= 2 * MERGE_IDENTITIES);
        // The newest are still known; the oldest were forgotten.
        assert!(!m.admit(
            1,
            &mut finding("x", &(2 * MERGE_IDENTITIES).to_string(), None)
        ));
        assert!(m.admit(1, &mut finding("x", "0", None)));
    }
}
