//! The streaming checker: a sans-IO, deterministic engine.
//!
//! `observe(event)` and `tick(now)` are the only entry points; no clocks, channels or I/O live
//! here, so the same events give the same verdicts whoever drives it (`revenant check`, `run`,
//! tests, benchmarks). Event time decides "later"; a watermark (latest event time minus the
//! allowed lateness, or the driver's clock minus it) decides when a deadline has passed.

pub mod metrics;
pub mod timers;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use foldhash::fast::FixedState;

use crate::engine::identity::Owner;
use crate::engine::identity::{AttemptRef, CorrelateStats, Limits, Resolved, Store};
use crate::engine::rules::predicate::{Breach, Capacity, Known};
use crate::engine::rules::{self, CompiledRule, Scope, Shape};
use crate::engine::state::{
    Cands, Keep, NODE_LOCAL, NodeId, Slot, SlotEvent, SlotLayout, SlotRead, SlotSpec, SpecIndex,
    fold_into,
};
use crate::event::{Kind, LifecycleEvent, Source, Stage};
use crate::violation::{self, AttemptRef as AttemptAliases, Evidence, RequestRef, Role, Violation};

pub use crate::engine::rules::{RuleSet, RulesError, Severity};

/// Engine settings. Defaults suit offline checking; `revenant run` raises `allowed_lateness`
/// because OTLP exporters batch spans for seconds.
#[derive(Debug, Clone)]
pub struct CheckerConfig {
    /// Events from different nodes are only "later" when later by more than this.
    pub clock_skew: Duration,
    /// How long after an event's time another event may still arrive and be counted by deadline
    /// rules. The watermark trails the newest event (and the driver's clock) by this much.
    pub allowed_lateness: Duration,
    /// Hard cap on live attempts; beyond it the oldest-visited attempt is compacted (counted).
    pub max_attempts: usize,
    /// Hard cap on tombstones; beyond it the oldest is dropped (counted).
    pub max_tombstones: usize,
    /// Live attempts idle this long are compacted even if not ended.
    pub attempt_ttl: Duration,
    /// Ended attempts are compacted once quiet this long.
    pub linger: Duration,
    /// Tombstones are kept this long so late activity on a rejected attempt is still caught.
    pub retention: Duration,
}

impl Default for CheckerConfig {
    fn default() -> Self {
        CheckerConfig {
            clock_skew: Duration::from_millis(50),
            allowed_lateness: Duration::from_millis(50),
            max_attempts: 1_000_000,
            max_tombstones: 2_000_000,
            attempt_ttl: Duration::from_secs(600),
            linger: Duration::from_secs(1),
            retention: Duration::from_secs(600),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{0}")]
    Invalid(String),
}

impl CheckerConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_attempts == 0 || self.max_tombstones == 0 {
            return Err(ConfigError::Invalid(
                "max_attempts and max_tombstones must be at least 1".into(),
            ));
        }
        if self.retention.is_zero() {
            return Err(ConfigError::Invalid("retention must be positive".into()));
        }
        Ok(())
    }
}

/// Counters the engine keeps about itself (all monotonic except the gauges at the end).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckerStats {
    pub events: u64,
    /// Events naming an attempt (room or rid).
    pub events_attempt: u64,
    /// Events naming only the request (request_id / trace_id).
    pub events_request_only: u64,
    /// Events naming nothing and not capacity reports: only predicate rules see them.
    pub events_unattributed: u64,
    pub capacity_reports: u64,
    /// Events for attempts already compacted to a tombstone.
    pub events_on_tombstones: u64,
    /// Events older than the watermark when they arrived (later than the allowed lateness).
    pub events_late: u64,
    /// Violations emitted (the sum of [`Checker::violations_per_rule`]).
    pub violations: u64,
    /// Breaches of a rule that already fired for the same attempt (not re-emitted).
    pub repeats: u64,
    /// Follow-ups emitted because a new source saw an already reported never-after breach.
    pub corroborations: u64,
    pub timers_fired: u64,
    /// Worker-level dedup memory was full; the violation was emitted but may repeat.
    pub worker_dedup_full: u64,
    /// Events naming a worker beyond the first 65 535 distinct ones: their attempts do not
    /// remember that worker, so a predicate judged again later cannot use its capacity.
    pub workers_untracked: u64,
    pub correlate: CorrelateStats,
    pub live_attempts: u64,
    pub live_requests: u64,
    /// Live requests that have a record (the others are kept by their only attempt).
    pub request_records: u64,
    pub tombstones: u64,
    /// Attempts, requests and tombstones whose rule slots did not fit a packed row (events more
    /// than 9 minutes apart, statuses above 1023) and are kept at full width.
    pub wide_slot_rows: u64,
    pub watermark_ns: u64,
    pub max_event_ns: u64,
}

/// Which events of an attempt a compiled rule has anything to do with.
#[derive(Debug, Clone, Copy)]
struct Reacts {
    /// Events matching one of these attempt specs.
    specs: u64,
    /// A predicate: also a new fact (input length) about an earlier event.
    predicate: bool,
    /// Every event (request-scope rules: linking and request-level triggers matter).
    always: bool,
}

/// Per-rule violation counts, index-aligned with [`Checker::rules`].
pub type RuleCounts = Vec<u64>;

type FixedMap<K, V> = HashMap<K, V, FixedState>;

const SEED: u64 = 0x636865636b6572; // "checker"
const MAX_NODES: usize = 126;
const MAX_CAPACITY_ENTRIES: usize = 65_536;
const MAX_WORKER_DEDUP: usize = 100_000;
/// Attempts examined by housekeeping per observed event (amortised O(1)).
const SWEEP_PER_EVENT: usize = 2;
/// The deadline queue is purged of dead entries only beyond this many (and twice the live attempts).
const MIN_TIMER_PURGE: usize = 4096;
/// Attempts examined by housekeeping per tick.
const SWEEP_PER_TICK: usize = 4096;

pub struct Checker {
    rules: Vec<CompiledRule>,
    attempt_specs: Vec<SlotSpec>,
    attempt_index: SpecIndex,
    request_specs: Vec<SlotSpec>,
    request_index: SpecIndex,
    /// Request slots that hold triggers (request-level events only update those).
    request_trigger_mask: u64,
    /// Per rule, which attempt events it has anything to do.
    rule_reacts: Vec<Reacts>,
    store: Store,
    timers: timers::TimerQueue,
    nodes: FixedMap<Box<str>, NodeId>,
    capacity: FixedMap<(u32, Stage), Capacity>,
    /// Worker keys interned to 16-bit ids (attempts keep four of them); index 0 is "none".
    workers: FixedMap<u32, u16>,
    worker_hashes: Vec<u32>,
    worker_fired: HashSet<u64, FixedState>,
    skew_ns: u64,
    lateness_ns: u64,
    stats: CheckerStats,
    per_rule: RuleCounts,
}

/// Everything a violation is assembled from.
struct Finding<'a> {
    rule: usize,
    request: Option<u32>,
    attempt: AttemptAliases,
    worker: Option<&'a str>,
    trigger: Option<SlotEvent>,
    trigger_reason: Option<String>,
    offender: Option<SlotEvent>,
    offender_reason: Option<String>,
    expected: Option<SlotEvent>,
    context: Option<SlotEvent>,
    breach: Option<Breach>,
    detected_at_ns: u64,
    /// Set on a follow-up that corroborates an emitted never-after violation.
    corroboration: Option<Corroboration>,
}

/// A new source's event that proves an already reported never-after breach again, and the
/// event it breaches with.
struct Corroboration {
    role: Role,
    event: SlotEvent,
    reason: Option<String>,
    partner: SlotEvent,
}

/// Bit of `source` in the reported-sources sets.
fn source_bit(source: Source) -> u8 {
    1 << (source as u8)
}

/// The event being observed, as a never-after rule sees it.
#[derive(Clone, Copy)]
struct Current {
    slot: Slot,
    source: Source,
    as_trigger: bool,
    as_forbidden: bool,
}

impl Current {
    /// The candidate it breaches with, if it takes part in a breach of `rule` (as a trigger
    /// before some forbidden event, or as a forbidden event after some trigger).
    fn partner(
        &self,
        rule: &rules::NeverAfter,
        triggers: &[Slot],
        forbidden: &[Slot],
        skew_ns: u64,
    ) -> Option<(Role, Slot)> {
        let as_trigger = self
            .as_trigger
            .then(|| {
                forbidden
                    .iter()
                    .find(|f| rule.breached(self.slot, **f, skew_ns))
            })
            .flatten()
            .map(|f| (Role::Trigger, *f));
        as_trigger.or_else(|| {
            self.as_forbidden
                .then(|| {
                    triggers
                        .iter()
                        .find(|t| rule.breached(**t, self.slot, skew_ns))
                })
                .flatten()
                .map(|t| (Role::Offender, *t))
        })
    }
}

impl Finding<'static> {
    /// A never-after breach: the trigger and the offender prove it, once both are known.
    fn never_after(
        rule: usize,
        request: Option<u32>,
        attempt: AttemptAliases,
        trig: Slot,
        forb: Slot,
        trigger_reason: Option<String>,
        offender_reason: Option<String>,
    ) -> Finding<'static> {
        Finding {
            rule,
            request,
            attempt,
            worker: None,
            trigger: trig.get(),
            trigger_reason,
            offender: forb.get(),
            offender_reason,
            expected: None,
            context: None,
            breach: None,
            detected_at_ns: trig.time().max(forb.time()),
            corroboration: None,
        }
    }

    /// Turns a never-after finding into a corroborating follow-up that adds `current`.
    fn corroborated(
        mut self,
        current: Current,
        role: Role,
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
            partner,
        });
        self
    }
}

impl Checker {
    pub fn new(rules: RuleSet, cfg: CheckerConfig) -> Checker {
        let mut attempt_layout = SlotLayout::default();
        let mut request_layout = SlotLayout::default();
        let compiled = rules::compile(&rules, &mut attempt_layout, &mut request_layout);
        assert!(attempt_layout.len() <= SlotLayout::MAX && request_layout.len() <= SlotLayout::MAX);
        let mut request_trigger_mask = 0u64;
        let mut request_links = Vec::new();
        let mut tomb_slot_map = Vec::new();
        let mut tomb_rule_mask = 0u64;
        let mut horizon = Duration::ZERO;
        for (ri, r) in compiled.iter().enumerate() {
            horizon = horizon.max(r.rule.horizon());
            if let Shape::NeverAfter(_) = r.rule.shape {
                match r.rule.scope {
                    Scope::Request => {
                        request_trigger_mask |= 1 << r.slots.trigger;
                        let link = (r.slots.other_latest, r.slots.other);
                        if !request_links.contains(&link) {
                            request_links.push(link);
                        }
                    }
                    Scope::Attempt => {
                        tomb_rule_mask |= 1 << ri;
                        // Pairs stay adjacent so tombstones fold them like live attempts do.
                        for k in [r.slots.trigger, r.slots.other] {
                            let width = if attempt_layout.specs[k].keep.is_pair() {
                                2
                            } else {
                                1
                            };
                            for j in k..k + width {
                                if !tomb_slot_map.contains(&j) {
                                    tomb_slot_map.push(j);
                                }
                            }
                        }
                    }
                }
            }
        }
        let rule_reacts = compiled
            .iter()
            .map(|r| {
                let k = r.slots;
                let specs = |specs| Reacts {
                    specs,
                    predicate: false,
                    always: false,
                };
                match (&r.rule.shape, r.rule.scope) {
                    (Shape::NeverAfter(_), Scope::Attempt) => {
                        specs((1 << k.trigger) | (1 << k.other))
                    }
                    // Linking an attempt to its request, or a request-level trigger, matters too.
                    (Shape::NeverAfter(_), Scope::Request) => Reacts {
                        always: true,
                        ..specs(0)
                    },
                    (Shape::MustFollow(_) | Shape::RequiresBefore(_), _) => specs(1 << k.trigger),
                    (Shape::Predicate(_), _) => Reacts {
                        predicate: true,
                        ..specs(k.stage_mask())
                    },
                }
            })
            .collect();
        let ns = |d: Duration| d.as_nanos().min(u64::MAX as u128) as u64;
        let lateness_ns = ns(cfg.allowed_lateness);
        let limits = Limits {
            max_attempts: cfg.max_attempts.max(1),
            max_tombstones: cfg.max_tombstones.max(1),
            // An attempt must outlive its longest deadline, or the deadline could never be judged.
            attempt_ttl_ns: ns(cfg.attempt_ttl)
                .max(ns(horizon) + ns(cfg.clock_skew) + lateness_ns + ns(cfg.linger)),
            linger_ns: ns(cfg.linger).max(lateness_ns),
            retention_ns: ns(cfg.retention),
        };
        let keeps = |l: &SlotLayout| l.specs.iter().map(|s| s.keep).collect::<Vec<Keep>>();
        let store = Store::new(
            limits,
            keeps(&attempt_layout),
            keeps(&request_layout),
            request_links,
            tomb_slot_map,
            tomb_rule_mask,
        );
        let n = compiled.len();
        Checker {
            rules: compiled,
            attempt_index: SpecIndex::new(&attempt_layout.specs),
            attempt_specs: attempt_layout.specs,
            request_index: SpecIndex::new(&request_layout.specs),
            request_specs: request_layout.specs,
            request_trigger_mask,
            rule_reacts,
            store,
            timers: timers::TimerQueue::default(),
            nodes: FixedMap::with_hasher(FixedState::with_seed(SEED)),
            capacity: FixedMap::with_hasher(FixedState::with_seed(SEED)),
            workers: FixedMap::with_hasher(FixedState::with_seed(SEED)),
            worker_hashes: vec![0],
            worker_fired: HashSet::with_hasher(FixedState::with_seed(SEED)),
            skew_ns: ns(cfg.clock_skew),
            lateness_ns,
            stats: CheckerStats::default(),
            per_rule: vec![0; n],
        }
    }

    pub fn rules(&self) -> impl Iterator<Item = &rules::Rule> {
        self.rules.iter().map(|r| &r.rule)
    }

    pub fn stats(&self) -> CheckerStats {
        let mut s = self.stats.clone();
        s.correlate = self.store.stats;
        s.live_attempts = self.store.live_attempts() as u64;
        s.live_requests = self.store.live_requests() as u64;
        s.request_records = self.store.request_records() as u64;
        s.tombstones = self.store.tombstones() as u64;
        s.wide_slot_rows = self.store.wide_rows() as u64;
        s.violations = self.per_rule.iter().sum();
        s
    }

    /// Violations emitted so far, per enabled rule (same order as [`Self::rules`]); corroborating
    /// follow-ups are not counted (see [`CheckerStats::corroborations`]).
    pub fn violations_per_rule(&self) -> &[u64] {
        &self.per_rule
    }

    /// Bytes held by the engine's state tables (capacity-based; for memory benchmarks).
    pub fn state_bytes(&self) -> usize {
        self.store.table_bytes() + self.timers.capacity_bytes()
    }

    /// [`Self::state_bytes`] per table (capacity-based), for the memory benchmark's breakdown.
    pub fn state_breakdown(&self) -> Vec<(&'static str, usize)> {
        let mut v = self.store.table_breakdown();
        v.push(("deadline queue", self.timers.capacity_bytes()));
        v
    }

    /// Bytes reserved by the tombstone tables alone.
    pub fn tombstone_bytes(&self) -> usize {
        self.store.tombstone_bytes()
    }

    /// Entries in the deadline queue, valid or not yet purged.
    pub fn deadline_entries(&self) -> usize {
        self.timers.len()
    }

    /// Entries in the alias table (rooms, rids, request ids, trace ids), live or not yet purged.
    pub fn alias_entries(&self) -> usize {
        self.store.alias_entries()
    }

    pub fn watermark_ns(&self) -> u64 {
        self.stats.watermark_ns
    }

    /// Feeds one event; returns the violations it proves (each (rule, attempt) at most once).
    pub fn observe(&mut self, e: &LifecycleEvent) -> Vec<Violation> {
        let mut out = Vec::new();
        self.stats.events += 1;
        if e.time_ns < self.stats.watermark_ns {
            self.stats.events_late += 1;
        }
        let node = self.node_id(e.node.as_deref());

        if e.kind == Kind::Capacity {
            self.stats.capacity_reports += 1;
            self.record_capacity(e);
            self.check_worker_predicates(e, &mut out);
        } else {
            // A request-level event that may trigger a request-scope rule needs the request's
            // record; other ones leave a request solo in its attempt.
            let request_trigger = !e.ids.names_attempt()
                && self.request_index.matching(e) & self.request_trigger_mask != 0;
            let resolved = self.store.resolve(&e.ids, e.time_ns, request_trigger);
            match resolved.attempt {
                Some(AttemptRef::Live(a)) => {
                    self.stats.events_attempt += 1;
                    self.observe_attempt(a, resolved, e, node, &mut out);
                }
                Some(AttemptRef::Tomb(seq)) => {
                    self.stats.events_attempt += 1;
                    self.stats.events_on_tombstones += 1;
                    self.observe_tombstone(seq, resolved.request, e, node, &mut out);
                }
                None => match resolved.request {
                    Some(r) => {
                        self.stats.events_request_only += 1;
                        self.observe_request_level(r, e, node, &mut out);
                    }
                    // Not a trigger (resolving would have made a record): nothing to judge.
                    None if resolved.solo => {
                        self.stats.events_request_only += 1;
                        self.check_worker_predicates(e, &mut out);
                    }
                    None => {
                        self.stats.events_unattributed += 1;
                        self.check_worker_predicates(e, &mut out);
                    }
                },
            }
        }

        if e.time_ns > self.stats.max_event_ns {
            self.stats.max_event_ns = e.time_ns;
            self.advance(e.time_ns.saturating_sub(self.lateness_ns), &mut out);
        }
        self.store.sweep(self.stats.watermark_ns, SWEEP_PER_EVENT);
        out
    }

    /// Advances the watermark to `now_ns - allowed_lateness` (driver's clock) and judges every
    /// deadline that passed. Call it periodically; offline, call it once with the last event time
    /// plus the lateness to judge what the input can still prove.
    pub fn tick(&mut self, now_ns: u64) -> Vec<Violation> {
        let mut out = Vec::new();
        self.advance(now_ns.saturating_sub(self.lateness_ns), &mut out);
        self.store.sweep(self.stats.watermark_ns, SWEEP_PER_TICK);
        out
    }

    fn advance(&mut self, wm: u64, out: &mut Vec<Violation>) {
        if wm <= self.stats.watermark_ns {
            return;
        }
        self.stats.watermark_ns = wm;
        while self.timers.next_due() <= wm
            && let Some((due, a, generation)) = self.timers.pop()
        {
            let at = &self.store.attempts[a as usize];
            if at.generation != generation || !at.is_live() || at.due_ns != due {
                continue; // attempt gone, or superseded by an earlier deadline
            }
            self.stats.timers_fired += 1;
            self.store.attempts[a as usize].due_ns = 0;
            self.store.attempts[a as usize].set_rejudge(false);
            self.judge_deadlines(a, out);
        }
    }

    fn node_id(&mut self, node: Option<&str>) -> NodeId {
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
    fn worker_key(e: &LifecycleEvent) -> Option<u32> {
        e.worker
            .as_deref()
            .or(e.node.as_deref())
            .map(|w| violation::fnv1a(&[w.as_bytes()]) as u32)
    }

    /// The interned id of worker key `w` (0 once 65 535 distinct workers were seen; counted).
    fn worker_id(&mut self, w: u32) -> u16 {
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

    fn record_capacity(&mut self, e: &LifecycleEvent) {
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

    fn capacity_for(&self, e: &LifecycleEvent) -> Option<Capacity> {
        self.capacity.get(&(Self::worker_key(e)?, e.stage)).copied()
    }

    fn observe_attempt(
        &mut self,
        a: u32,
        resolved: Resolved,
        e: &LifecycleEvent,
        node: NodeId,
        out: &mut Vec<Violation>,
    ) {
        let (mut request, linked) = (resolved.request, resolved.linked);
        let hit = self.attempt_index.matching(e);
        let slot = Slot::from_event(e, node);
        let changed_specs = self.store.fold_attempt_slots(a, hit, slot);
        let worker = Self::worker_key(e).map(|w| self.worker_id(w));
        let at = &mut self.store.attempts[a as usize];
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

        for ri in 0..self.rules.len() {
            // Most rules have nothing to do with most events: skip them before reading anything.
            let Reacts {
                specs: reacts_to,
                predicate,
                always,
            } = self.rule_reacts[ri];
            // A merge brings events this one did not match: never_after pairs may span the two.
            let remerge = resolved.merged
                && matches!(self.rules[ri].rule.shape, Shape::NeverAfter(_))
                && self.rules[ri].rule.scope == Scope::Attempt;
            let reacts = hit & reacts_to != 0 || always || remerge || (predicate && facts_changed);
            if !reacts {
                continue;
            }
            let bit = 1u64 << ri;
            let slots = self.rules[ri].slots;
            match (&self.rules[ri].rule.shape, self.rules[ri].rule.scope) {
                (Shape::NeverAfter(rule), Scope::Attempt) => {
                    let s = self.store.attempt_slots(a);
                    let (triggers, forbidden) = self.never_after_candidates(
                        &s,
                        (slots.trigger, slots.other),
                        slots,
                        hit,
                        slot,
                    );
                    if let Some((trig, forb)) =
                        rule.breaching_pair(&triggers, &forbidden, self.skew_ns)
                    {
                        let current = Current {
                            slot,
                            source: e.source,
                            as_trigger: hit & (1 << slots.trigger) != 0,
                            as_forbidden: hit & (1 << slots.other) != 0,
                        };
                        let owner = Owner::Attempt(a);
                        let fired = self.store.attempts[a as usize].fired & bit != 0;
                        let Some(follow_up) =
                            self.follow_up(fired, ri, owner, current, &triggers, &forbidden)
                        else {
                            continue;
                        };
                        self.store.attempts[a as usize].fired |= bit;
                        let offender_is_current =
                            forb.time() == e.time_ns && hit & (1 << slots.other) != 0;
                        // The violation names the request: a solo one gets its record.
                        request = request.or_else(|| self.store.request_record(a));
                        let f = Finding::never_after(
                            ri,
                            request,
                            self.attempt_aliases(a),
                            trig,
                            forb,
                            self.store.reason(a).map(str::to_owned),
                            offender_is_current
                                .then(|| e.reason.as_deref().map(str::to_owned))
                                .flatten(),
                        );
                        let reason = e.reason.as_deref().map(str::to_owned);
                        out.push(self.report(owner, f, follow_up, current, reason));
                    }
                }
                (Shape::NeverAfter(_), Scope::Request) => {
                    let as_trigger = self.request_index.matching(e) & (1 << slots.trigger) != 0;
                    let (r, linked) = match request {
                        Some(r) => (r, linked),
                        // A solo request (no record) holds its attempt's history already, and
                        // cannot breach without a trigger: only a trigger needs its record.
                        None if as_trigger => match self.store.request_record(a) {
                            Some(r) => {
                                request = Some(r);
                                (r, true)
                            }
                            None => continue,
                        },
                        None => continue,
                    };
                    let as_forbidden = hit & (1 << slots.other_latest) != 0;
                    let mut changed = linked || as_forbidden;
                    // The request already holds what the attempt had before this event: a newly
                    // linked attempt brings all it has; otherwise only this event is new, and
                    // only if the attempt kept it.
                    if linked {
                        let keep_own = self.attempt_specs[slots.other_latest].keep;
                        let own =
                            Cands::of(&self.store.attempt_slots(a), slots.other_latest, keep_own);
                        for &o in own.iter() {
                            self.store.fold_request_slots(r, 1 << slots.other, o);
                        }
                    } else if changed_specs & (1 << slots.other_latest) != 0 {
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
                (Shape::MustFollow(rule), _) => {
                    if hit & (1 << slots.trigger) != 0 {
                        let trig = self.store.attempt_slots(a).get(slots.trigger);
                        if let Some(due) = rule.due(trig, self.skew_ns) {
                            self.schedule(a, due);
                        }
                    }
                }
                (Shape::RequiresBefore(rule), _) => {
                    if hit & (1 << slots.trigger) != 0 {
                        let ev = self.store.attempt_slots(a).get(slots.trigger);
                        if let Some(due) = rule.due(ev) {
                            self.schedule(a, due);
                        }
                    }
                }
                (Shape::Predicate(p), _) => {
                    let matched = hit & reacts_to != 0;
                    if !matched {
                        // A new fact (the input length) may make an earlier admission a breach.
                        let s = self.store.attempt_slots(a);
                        let first = slots
                            .per_stage
                            .iter()
                            .flatten()
                            .map(|&k| s.get(k as usize))
                            .filter(|s| s.is_set())
                            .map(|s| s.time())
                            .min();
                        if let Some(first) = first
                            && facts_changed
                            && self.store.attempts[a as usize].fired & bit == 0
                        {
                            self.store.attempts[a as usize].set_rejudge(true);
                            self.schedule(a, first);
                        }
                        continue;
                    }
                    let known = Known {
                        input_tokens: Some(self.store.attempts[a as usize].input_tokens as u64)
                            .filter(|&n| n > 0),
                        capacity: self.capacity_for(e),
                    };
                    let Some(breach) = p.evaluate(e, known) else {
                        // Not (yet) a breach: judge again once everything up to this event arrived.
                        if self.store.attempts[a as usize].fired & bit == 0 {
                            self.store.attempts[a as usize].set_rejudge(true);
                            self.schedule(a, e.time_ns);
                        }
                        continue;
                    };
                    if self.store.attempts[a as usize].fired & bit != 0 {
                        self.stats.repeats += 1;
                        continue;
                    }
                    self.store.attempts[a as usize].fired |= bit;
                    request = request.or_else(|| self.store.request_record(a));
                    let f = Finding {
                        rule: ri,
                        request,
                        attempt: self.attempt_aliases(a),
                        worker: None,
                        trigger: None,
                        trigger_reason: None,
                        offender: Some(slot_event(e)),
                        offender_reason: e.reason.as_deref().map(str::to_owned),
                        expected: None,
                        context: None,
                        breach: Some(breach),
                        detected_at_ns: e.time_ns,
                        corroboration: None,
                    };
                    out.push(self.violation(f));
                }
            }
        }
        if e.kind.is_terminal() {
            self.settle(a);
        }
    }

    /// After a terminal event: if every pending deadline rule is already satisfied, nothing can
    /// breach it any more, so the attempt need not stay live until the deadline.
    fn settle(&mut self, a: u32) {
        let wm = self.stats.watermark_ns;
        let due = self.store.attempts[a as usize].due_ns;
        // Nothing queued, a judgement already due at the next watermark step, or a predicate
        // waiting to be judged again: leave it.
        if due == 0 || due <= wm || self.store.attempts[a as usize].rejudge() {
            return;
        }
        let s = self.store.attempt_slots(a);
        let fired = self.store.attempts[a as usize].fired;
        let pending = self.rules.iter().enumerate().any(|(ri, r)| {
            if fired & (1 << ri) != 0 {
                return false;
            }
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
            self.store.attempts[a as usize].due_ns = 0;
        }
    }

    /// Late events on a compacted attempt: only never-after rules still apply.
    fn observe_tombstone(
        &mut self,
        seq: u64,
        request: Option<u32>,
        e: &LifecycleEvent,
        node: NodeId,
        out: &mut Vec<Violation>,
    ) {
        let Some(ti) = self.store.tomb_index(seq) else {
            return;
        };
        let hit = self.attempt_index.matching(e);
        let slot = Slot::from_event(e, node);
        let map = self.store.tomb_slot_map().to_vec();
        let mut kept = self.store.tomb_slots_of(ti);
        for (k, &spec) in map.iter().enumerate() {
            if hit & (1 << spec) != 0 {
                fold_into(&mut kept, k, self.attempt_specs[spec].keep, slot);
            }
        }
        self.store.set_tomb_slots(ti, &kept);
        let attempt = AttemptAliases {
            bootstrap_room: e.ids.bootstrap_room.map(|r| r.0),
            rid: e.ids.rid.as_deref().map(str::to_owned),
        };
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
                    if let Some((trig, forb)) =
                        rule.breaching_pair(&triggers, &forbidden, self.skew_ns)
                    {
                        let current = Current {
                            slot,
                            source: e.source,
                            as_trigger: hit & (1 << slots.trigger) != 0,
                            as_forbidden: hit & (1 << slots.other) != 0,
                        };
                        let owner = Owner::Tomb(seq);
                        let follow_up = if self.store.tomb_fired(ti) & bit != 0 {
                            match self.corroboration(ri, owner, current, &triggers, &forbidden) {
                                Some(c) => Some(c),
                                None => {
                                    self.stats.repeats += 1;
                                    continue;
                                }
                            }
                        } else {
                            None
                        };
                        self.store.add_tomb_fired(ti, bit);
                        let f = Finding::never_after(
                            ri,
                            request,
                            attempt.clone(),
                            trig,
                            forb,
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

    /// A never-after rule's candidate triggers and offenders: the kept slots (one, or a per-node
    /// pair each) at positions `at` of `kept`, plus the current event, which a third node may
    /// have kept out of a pair.
    fn never_after_candidates(
        &self,
        kept: &(impl SlotRead + ?Sized),
        at: (usize, usize),
        slots: rules::RuleSlots,
        hit: u64,
        current: Slot,
    ) -> (Cands, Cands) {
        let keep = self.attempt_specs[slots.trigger].keep;
        let as_trigger = hit & (1 << slots.trigger) != 0;
        // Nearly every attempt never sees a trigger (a rejection): nothing can breach.
        if !as_trigger && !kept.any_set(at.0, keep) {
            return (Cands::default(), Cands::default());
        }
        let mut triggers = Cands::of(kept, at.0, keep);
        if as_trigger {
            triggers.push(current);
        }
        let mut forbidden = Cands::of(kept, at.1, self.attempt_specs[slots.other].keep);
        if hit & (1 << slots.other) != 0 {
            forbidden.push(current);
        }
        (triggers, forbidden)
    }

    /// Events naming only the request: they may trigger request-scope rules, never count as an
    /// attempt's activity.
    fn observe_request_level(
        &mut self,
        r: u32,
        e: &LifecycleEvent,
        node: NodeId,
        out: &mut Vec<Violation>,
    ) {
        let hit = self.request_index.matching(e) & self.request_trigger_mask;
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

    fn check_request_rule(
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
        let triggers = Cands::of(&s, slots.trigger, keep);
        let forbidden = Cands::of(&s, slots.other, self.request_specs[slots.other].keep);
        let Some((trig, forb)) = rule.breaching_pair(&triggers, &forbidden, self.skew_ns) else {
            return;
        };
        let bit = 1u64 << ri;
        let owner = Owner::Request(r);
        let fired = self.store.requests[r as usize].fired & bit != 0;
        let Some(follow_up) = self.follow_up(fired, ri, owner, cur, &triggers, &forbidden) else {
            return;
        };
        self.store.requests[r as usize].fired |= bit;
        let attempt = match (a, e) {
            (Some(a), _) => self.attempt_aliases(a),
            (None, Some(e)) if e.ids.names_attempt() => AttemptAliases {
                bootstrap_room: e.ids.bootstrap_room.map(|r| r.0),
                rid: e.ids.rid.as_deref().map(str::to_owned),
            },
            _ => AttemptAliases::default(),
        };
        let f = Finding::never_after(ri, Some(r), attempt, trig, forb, None, None);
        let reason = e.and_then(|e| e.reason.as_deref()).map(str::to_owned);
        out.push(self.report(owner, f, follow_up, cur, reason));
    }

    /// A request-scope rule that fired may hear of its breach from a new source, even when the
    /// event changes none of the request's slots (the same rejection, reported again by OTLP).
    fn may_corroborate_request(&self, ri: usize, r: u32, cur: Current) -> bool {
        (cur.as_trigger || cur.as_forbidden)
            && self.store.requests[r as usize].fired & (1 << ri) != 0
            && self.store.reported(Owner::Request(r), ri) & source_bit(cur.source) == 0
    }

    /// For a (rule, owner) that already fired: the current event's part in a breach, when its
    /// source is in none of the evidence reported so far (at most one follow-up per source).
    /// What a breach of rule `ri` by `owner` becomes: `Some(None)` a first report,
    /// `Some(Some(c))` a corroborating follow-up of one already made, `None` a plain repeat
    /// (counted, not reported).
    fn follow_up(
        &mut self,
        fired: bool,
        ri: usize,
        owner: Owner,
        cur: Current,
        triggers: &[Slot],
        forbidden: &[Slot],
    ) -> Option<Option<(Role, Slot)>> {
        if !fired {
            return Some(None);
        }
        let c = self.corroboration(ri, owner, cur, triggers, forbidden);
        if c.is_none() {
            self.stats.repeats += 1;
        }
        c.map(Some)
    }

    fn corroboration(
        &self,
        ri: usize,
        owner: Owner,
        cur: Current,
        triggers: &[Slot],
        forbidden: &[Slot],
    ) -> Option<(Role, Slot)> {
        let Shape::NeverAfter(rule) = &self.rules[ri].rule.shape else {
            return None;
        };
        if self.store.reported(owner, ri) & source_bit(cur.source) != 0 {
            return None;
        }
        cur.partner(rule, triggers, forbidden, self.skew_ns)
    }

    /// Emits a never-after finding (first or corroborating) and remembers its evidence sources.
    fn report(
        &mut self,
        owner: Owner,
        f: Finding<'static>,
        follow_up: Option<(Role, Slot)>,
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

    /// Predicate rules on events that belong to no attempt (capacity reports, bare events):
    /// one violation per (rule, worker, stage).
    fn check_worker_predicates(&mut self, e: &LifecycleEvent, out: &mut Vec<Violation>) {
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
                rule: ri,
                request: None,
                attempt: AttemptAliases::default(),
                worker: Some(who),
                trigger: None,
                trigger_reason: None,
                offender: Some(slot_event(e)),
                offender_reason: None,
                expected: None,
                context: None,
                breach: Some(breach),
                detected_at_ns: e.time_ns,
                corroboration: None,
            };
            out.push(self.violation(f));
        }
    }

    fn schedule(&mut self, a: u32, due: u64) {
        let at = &mut self.store.attempts[a as usize];
        if at.due_ns == 0 || due < at.due_ns {
            at.due_ns = due;
            self.timers.push((due, a, at.generation));
            if self.timers.len() > 2 * self.store.live_attempts() + MIN_TIMER_PURGE {
                self.purge_timers();
            }
        }
    }

    /// Drops queued deadlines that can no longer fire: the attempt is gone, or an earlier
    /// deadline or settling superseded them (`due_ns` moved). Without this a settled attempt's
    /// far deadline (stuck-attempt: admitted + 330 s) stayed queued until it passed, so the
    /// queue held every attempt of the last 330 s, not the live ones. At most one entry per live
    /// attempt is valid, so purging when the queue exceeds twice that is amortised O(1).
    fn purge_timers(&mut self) {
        let attempts = &self.store.attempts;
        self.timers.retain(|&(due, a, generation)| {
            let at = &attempts[a as usize];
            at.generation == generation && at.is_live() && at.due_ns == due
        });
    }

    /// Judges the deadline rules of attempt `a` that are due; re-arms the next one.
    fn judge_deadlines(&mut self, a: u32, out: &mut Vec<Violation>) {
        let wm = self.stats.watermark_ns;
        let mut next: Option<u64> = None;
        // One look-up of the attempt's row for all its rules (again after a violation, which
        // needs the store mutably, though it changes no slot).
        let mut s = self.store.attempt_slots(a);
        for ri in 0..self.rules.len() {
            let bit = 1u64 << ri;
            if self.store.attempts[a as usize].fired & bit != 0
                || matches!(self.rules[ri].rule.shape, Shape::NeverAfter(_))
            {
                continue;
            }
            let slots = self.rules[ri].slots;
            let finding = match &self.rules[ri].rule.shape {
                Shape::MustFollow(rule) => {
                    let trig = s.get(slots.trigger);
                    let Some(due) = rule.due(trig, self.skew_ns) else {
                        continue;
                    };
                    let (early, late) = (s.get(slots.other), s.get(slots.other_latest));
                    if due > wm {
                        // Already satisfied: nothing can breach it, no need to wake up for it.
                        if !rule.satisfied(trig, early, late, self.skew_ns) {
                            next = Some(next.map_or(due, |n| n.min(due)));
                        }
                        continue;
                    }
                    let given = slots.given.map(|g| s.get(g as usize));
                    if !rule.breached(trig, early, late, given, self.skew_ns) {
                        continue;
                    }
                    Finding {
                        rule: ri,
                        request: None,
                        attempt: AttemptAliases::default(),
                        worker: None,
                        trigger: trig.get(),
                        trigger_reason: self.store.reason(a).map(str::to_owned),
                        offender: None,
                        offender_reason: None,
                        expected: late.get().filter(|l| l.time_ns > due),
                        context: given.and_then(|g| g.get()),
                        breach: None,
                        detected_at_ns: due,
                        corroboration: None,
                    }
                }
                Shape::RequiresBefore(rule) => {
                    let ev = s.get(slots.trigger);
                    let Some(due) = rule.due(ev) else { continue };
                    if due > wm {
                        next = Some(next.map_or(due, |n| n.min(due)));
                        continue;
                    }
                    let req = s.get(slots.other);
                    if !rule.breached(ev, req, self.skew_ns) {
                        continue;
                    }
                    Finding {
                        rule: ri,
                        request: None,
                        attempt: AttemptAliases::default(),
                        worker: None,
                        trigger: None,
                        trigger_reason: None,
                        offender: ev.get(),
                        offender_reason: None,
                        expected: req.get(),
                        context: None,
                        breach: None,
                        detected_at_ns: due,
                        corroboration: None,
                    }
                }
                Shape::Predicate(p) => {
                    let at = &self.store.attempts[a as usize];
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
                        rule: ri,
                        request: None,
                        attempt: AttemptAliases::default(),
                        worker: None,
                        trigger: None,
                        trigger_reason: None,
                        offender: Some(ev),
                        offender_reason: None,
                        expected: None,
                        context: None,
                        breach: Some(breach),
                        detected_at_ns: wm.max(ev.time_ns),
                        corroboration: None,
                    }
                }
                _ => continue,
            };
            self.store.attempts[a as usize].fired |= bit;
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

    fn attempt_aliases(&self, a: u32) -> AttemptAliases {
        AttemptAliases {
            bootstrap_room: self.store.attempts[a as usize].room(),
            rid: self.store.attempt_rid(a).to_string_opt(),
        }
    }

    fn violation(&mut self, f: Finding<'_>) -> Violation {
        let compiled = &self.rules[f.rule];
        let rule = &compiled.rule;
        let request = f
            .request
            .map(|r| {
                let r = &self.store.requests[r as usize];
                RequestRef {
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
        push(Role::Trigger, f.trigger, f.trigger_reason.clone());
        push(Role::Context, f.context, None);
        push(Role::Offender, f.offender, f.offender_reason.clone());
        push(Role::Expected, f.expected, None);
        if let Some(c) = &f.corroboration {
            let partner_role = match c.role {
                Role::Trigger => Role::Offender,
                _ => Role::Trigger,
            };
            push(c.role, Some(c.event), c.reason.clone());
            push(partner_role, Some(c.partner), None);
        }
        // The same event may be both in the original pair and the corroborating one.
        evidence.sort_by_key(|e| e.time_ns);
        evidence.dedup_by(|a, b| {
            (a.role, a.time_ns, a.stage, a.kind, a.source, a.status)
                == (b.role, b.time_ns, b.stage, b.kind, b.source, b.status)
        });

        let within = match &rule.shape {
            Shape::MustFollow(m) => humantime::format_duration(m.within.0).to_string(),
            _ => String::new(),
        };
        let request_text = request
            .request_id
            .clone()
            .or_else(|| request.trace_id.clone())
            .unwrap_or_else(|| "-".into());
        let attempt_text = match (&f.attempt.bootstrap_room, &f.attempt.rid) {
            (Some(room), Some(rid)) => format!("room {room} (rid {rid})"),
            (Some(room), None) => format!("room {room}"),
            (None, Some(rid)) => format!("rid {rid}"),
            (None, None) => "-".into(),
        };
        let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
        let summary = violation::render(&rule.output, |k| match k {
            "rule" => rule.name.clone(),
            "severity" => rule.severity.as_str().into(),
            "request" => request_text.clone(),
            "attempt" => attempt_text.clone(),
            "worker" => opt(f.worker.map(str::to_owned)),
            "within" => within.clone(),
            "delay" => match (f.trigger, f.offender) {
                (Some(t), Some(o)) => violation::format_nanos(o.time_ns.saturating_sub(t.time_ns)),
                _ => "-".into(),
            },
            "breach" => f
                .breach
                .map(|b| {
                    format!(
                        "{} {} {} {}",
                        b.field.as_str(),
                        b.value,
                        op_symbol(b.op),
                        b.limit
                    )
                })
                .unwrap_or_else(|| "-".into()),
            "trigger.stage" => opt(f.trigger.map(|t| t.stage.to_string())),
            "trigger.kind" => opt(f.trigger.map(|t| t.kind.to_string())),
            "trigger.source" => opt(f.trigger.map(|t| t.source.to_string())),
            "trigger.status" => opt(f.trigger.and_then(|t| t.status).map(|s| s.to_string())),
            "trigger.reason" => opt(f.trigger_reason.clone()),
            "event.stage" => opt(f.offender.map(|t| t.stage.to_string())),
            "event.kind" => opt(f.offender.map(|t| t.kind.to_string())),
            "event.source" => opt(f.offender.map(|t| t.source.to_string())),
            "event.status" => opt(f.offender.and_then(|t| t.status).map(|s| s.to_string())),
            _ => String::new(),
        });
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

fn op_symbol(op: &str) -> &'static str {
    match op {
        "gt" => ">",
        "ge" => ">=",
        "lt" => "<",
        "le" => "<=",
        _ => "==",
    }
}

fn slot_event(e: &LifecycleEvent) -> SlotEvent {
    SlotEvent {
        time_ns: e.time_ns,
        stage: e.stage,
        kind: e.kind,
        source: e.source,
        status: e.status,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const S: u64 = 1_000_000_000;

    fn ev(t: u64, stage: Stage, kind: Kind) -> LifecycleEvent {
        LifecycleEvent::new(t, stage, kind, Source::Otlp)
    }

    /// One attempt whose legs carry different rids (prefill's and decode's), ended at `t`.
    fn two_rid_attempt(c: &mut Checker, t: u64, room: u64, n: u64) {
        let (pr, dr) = (format!("p-{n}"), format!("d-{n}"));
        c.observe(
            &ev(t, Stage::Prefill, Kind::Admitted)
                .with_room(room)
                .with_rid(pr.as_str()),
        );
        c.observe(
            &ev(t + MS, Stage::Decode, Kind::Admitted)
                .with_room(room)
                .with_rid(dr.as_str()),
        );
        c.observe(
            &ev(t + 2 * MS, Stage::Prefill, Kind::Completed)
                .with_room(room)
                .with_status(200),
        );
        c.observe(
            &ev(t + 3 * MS, Stage::Decode, Kind::Completed)
                .with_room(room)
                .with_status(200),
        );
    }

    /// A request kept solo in its only attempt (no record) still catches everything a record
    /// would: a router failure that names the attempt's room arrives after the activity it
    /// precedes, and an attempt-scope violation names the request id.
    #[test]
    fn solo_requests_judge_like_recorded_ones() {
        let mut c = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
        let t = 1_795_986_920 * S;
        let mut all = Vec::new();
        all.extend(
            c.observe(
                &ev(t, Stage::Router, Kind::Dispatched)
                    .with_request_id("req-solo")
                    .with_room(7)
                    .with_to(Stage::Decode),
            ),
        );
        all.extend(c.observe(&ev(t + 5 * MS, Stage::Decode, Kind::Work).with_room(7)));
        assert_eq!(c.stats().correlate.requests_materialized, 0, "still solo");
        assert!(all.is_empty());
        // The router failed the request at t + 2 ms; it names the room, and comes late.
        let v = c.observe(
            &ev(t + 2 * MS, Stage::Router, Kind::Rejected)
                .with_room(7)
                .with_status(503),
        );
        let of_rule = |rule: &str| v.iter().filter(|v| v.rule == rule).collect::<Vec<_>>();
        let failed = of_rule("activity-after-request-failed");
        assert_eq!(failed.len(), 1, "{v:?}");
        assert_eq!(failed[0].request.request_id.as_deref(), Some("req-solo"));
        // The attempt's own rejection rule fires too, and names the request.
        let rej = of_rule("activity-after-rejection");
        assert_eq!(rej.len(), 1, "{v:?}");
        assert_eq!(rej[0].request.request_id.as_deref(), Some("req-solo"));
        assert_eq!(c.stats().correlate.requests_materialized, 1);

        // A second solo request: an attempt-scope violation alone gives it a record, with its id.
        c.observe(
            &ev(t, Stage::Router, Kind::Dispatched)
                .with_request_id("req-two")
                .with_room(8)
                .with_to(Stage::Prefill),
        );
        c.observe(
            &ev(t + MS, Stage::Prefill, Kind::Rejected)
                .with_room(8)
                .with_status(400),
        );
        let v = c.observe(&ev(t + 3 * MS, Stage::Decode, Kind::Work).with_room(8));
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(v[0].rule, "activity-after-rejection");
        assert_eq!(v[0].request.request_id.as_deref(), Some("req-two"));
    }

    /// Slots are packed against a per-row base with a 9-minute window: an attempt whose events
    /// span more, or a late event on a tombstone that long after, keeps exact times and verdicts.
    #[test]
    fn slots_past_the_packed_window_keep_exact_times() {
        let mut c = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
        let aar = |v: &[Violation]| {
            v.iter()
                .filter(|v| v.rule == "activity-after-rejection")
                .cloned()
                .collect::<Vec<_>>()
        };
        let t0 = 1_795_986_920 * S;
        // A long attempt: admitted, streaming for ten minutes, then rejected and still worked on.
        for (dt, stage, kind) in [
            (0, Stage::Prefill, Kind::Admitted),
            (4 * 60 * S, Stage::Decode, Kind::Work),
            (8 * 60 * S, Stage::Decode, Kind::Work),
        ] {
            assert!(aar(&c.observe(&ev(t0 + dt, stage, kind).with_room(7))).is_empty());
        }
        let rejected = t0 + 10 * 60 * S;
        let v = c.observe(
            &ev(rejected, Stage::Prefill, Kind::Rejected)
                .with_room(7)
                .with_status(400),
        );
        assert!(aar(&v).is_empty());
        assert!(c.stats().wide_slot_rows >= 1, "{:?}", c.stats());
        let v = aar(&c.observe(&ev(rejected + 1, Stage::Decode, Kind::Work).with_room(7)));
        assert_eq!(v.len(), 1);
        let times: Vec<u64> = v[0].evidence.iter().map(|e| e.time_ns).collect();
        assert_eq!(times, vec![rejected, rejected + 1]);

        // A short rejected attempt, compacted; its decode leg reports work 9.5 minutes later.
        let t1 = t0 + 20 * 60 * S;
        for e in [
            ev(t1, Stage::Decode, Kind::Received).with_room(8),
            ev(t1 + MS, Stage::Prefill, Kind::Rejected)
                .with_room(8)
                .with_status(400),
            ev(t1 + 2 * MS, Stage::Decode, Kind::Cancelled).with_room(8),
        ] {
            assert!(aar(&c.observe(&e)).is_empty());
        }
        c.tick(t1 + 30 * S);
        assert!(c.stats().tombstones >= 1);
        let late = t1 + 570 * S;
        let v = aar(&c.observe(&ev(late, Stage::Decode, Kind::Work).with_room(8)));
        assert_eq!(v.len(), 1, "late activity on the tombstone");
        let times: Vec<u64> = v[0].evidence.iter().map(|e| e.time_ns).collect();
        assert_eq!(times, vec![t1 + MS, late]);
        assert!(aar(&c.observe(&ev(late + S, Stage::Decode, Kind::Work).with_room(8))).is_empty());
    }

    /// A tombstone stores only its set slots; a late event that sets an empty one (here the
    /// rejection, reported after the attempt was compacted) still proves the breach, once.
    #[test]
    fn a_late_trigger_on_a_tombstone_sets_its_empty_slot() {
        let mut c = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
        let aar = |v: Vec<Violation>| {
            v.into_iter()
                .filter(|v| v.rule == "activity-after-rejection")
                .count()
        };
        let t = 1_795_986_920 * S;
        for (dt, stage, kind) in [
            (0, Stage::Decode, Kind::Received),
            (5 * MS, Stage::Decode, Kind::Work),
            (6 * MS, Stage::Decode, Kind::Completed),
        ] {
            assert_eq!(aar(c.observe(&ev(t + dt, stage, kind).with_room(9))), 0);
        }
        c.tick(t + 30 * S);
        assert_eq!((c.stats().live_attempts, c.stats().tombstones), (0, 1));
        let late_rejection = ev(t + MS, Stage::Prefill, Kind::Rejected)
            .with_room(9)
            .with_status(400);
        assert_eq!(
            aar(c.observe(&late_rejection)),
            1,
            "work at +5 ms followed it"
        );
        assert_eq!(c.stats().wide_slot_rows, 1, "the row grew: kept aside");
        assert_eq!(
            aar(c.observe(&ev(t + 7 * MS, Stage::Decode, Kind::Work).with_room(9))),
            0
        );
        // Expiry drops the tombstone and its wide row.
        c.tick(t + 900 * S);
        assert_eq!((c.stats().tombstones, c.stats().wide_slot_rows), (0, 0));
    }

    /// Every rid an attempt was seen with leaves the alias table with it: otherwise the next
    /// attempt reusing its record inherits the rid (a late event of the old attempt is blamed on
    /// the new one) and the table grows by one entry per attempt, forever.
    #[test]
    fn an_attempts_second_rid_leaves_with_it() {
        let mut c = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
        let t0 = 1_000 * S;
        two_rid_attempt(&mut c, t0, 1, 0);
        c.tick(t0 + 10 * S);
        assert_eq!(c.stats().live_attempts, 0, "attempt compacted");
        // A new attempt takes the freed record and is rejected.
        c.observe(
            &ev(t0 + 11 * S, Stage::Prefill, Kind::Rejected)
                .with_room(2)
                .with_rid("p-1")
                .with_status(400),
        );
        // A late report of the first attempt's decode work, named by its rid only.
        let v = c.observe(&ev(t0 + 12 * S, Stage::Decode, Kind::Work).with_rid("d-0"));
        assert!(v.is_empty(), "blamed on the wrong attempt: {v:?}");
    }

    #[test]
    fn settled_deadlines_do_not_pile_up() {
        let mut c = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
        // One attempt every 100 µs, each running 500 ms: when its first deadline is judged
        // (the watermark passes its admission) it has not ended, so stuck-attempt's deadline
        // (admitted + 330 s) is queued; then it ends. Over 5 s only the last ~1.5 s of attempts
        // are live, but without purging every attempt's entry would stay queued for 330 s.
        let t0 = 1_000 * S;
        let mut events = Vec::new();
        for n in 0..50_000u64 {
            let t = t0 + n * 100_000;
            let room = 100 + n;
            events.extend([
                ev(t, Stage::Prefill, Kind::Admitted).with_room(room),
                ev(t + MS, Stage::Decode, Kind::Admitted).with_room(room),
                ev(t + 400 * MS, Stage::Prefill, Kind::Completed).with_room(room),
                ev(t + 500 * MS, Stage::Decode, Kind::Completed).with_room(room),
            ]);
        }
        events.sort_by_key(|e| e.time_ns);
        for e in &events {
            c.observe(e);
        }
        let s = c.stats();
        assert!(
            s.live_attempts < 25_000,
            "attempts are compacted as they end"
        );
        assert!(
            c.deadline_entries() <= 2 * s.live_attempts as usize + MIN_TIMER_PURGE,
            "{} queued deadlines for {} live attempts",
            c.deadline_entries(),
            s.live_attempts
        );
    }

    /// The default rules, with tombstones and idle requests kept 5 s: tests of what is left
    /// once everything expired.
    fn short_retention_checker() -> Checker {
        let cfg = CheckerConfig {
            retention: Duration::from_secs(5),
            ..CheckerConfig::default()
        };
        Checker::new(RuleSet::embedded_defaults(), cfg)
    }

    /// A request seen with two trace ids: both aliases leave when the request is forgotten,
    /// and the request shows its first ids.
    #[test]
    fn a_requests_second_trace_id_leaves_with_it() {
        let mut c = short_retention_checker();
        let t0 = 1_000 * S;
        for n in 0..3_000u64 {
            let t = t0 + n * MS;
            let (id, t1, t2) = (format!("req-{n}"), format!("a-{n}"), format!("b-{n}"));
            c.observe(
                &ev(t, Stage::Router, Kind::Dispatched)
                    .with_room(100 + n)
                    .with_request_id(id.as_str())
                    .with_trace_id(t1.as_str()),
            );
            c.observe(
                &ev(t + 1, Stage::Router, Kind::Completed)
                    .with_room(100 + n)
                    .with_request_id(id.as_str())
                    .with_trace_id(t2.as_str())
                    .with_status(500),
            );
            // The router failed the request; activity afterwards names its second trace only.
            let v = c.observe(&ev(t + 2, Stage::Decode, Kind::Work).with_trace_id(t2.as_str()));
            if n == 0 {
                assert_eq!(v.len(), 0, "request-level work is no attempt's activity");
            }
        }
        let s = c.stats();
        assert_eq!(
            s.correlate.requests_created, 6_000,
            "one stub per second trace id"
        );
        assert_eq!(s.live_requests, 6_000);
        for k in 1..=30 {
            c.tick(t0 + 10 * S + k * S);
        }
        let s = c.stats();
        assert_eq!((s.live_attempts, s.tombstones, s.live_requests), (0, 0, 0));
        assert!(
            c.alias_entries() <= 1024,
            "stale aliases: {}",
            c.alias_entries()
        );
    }

    #[test]
    fn alias_table_is_bounded_by_what_is_live() {
        let mut c = short_retention_checker();
        let t0 = 1_000 * S;
        for n in 0..5_000u64 {
            two_rid_attempt(&mut c, t0 + n * MS, 100 + n, n);
        }
        // Past linger and retention: every attempt compacted, every tombstone expired.
        for k in 1..=20 {
            c.tick(t0 + 10 * S + k * S);
        }
        let s = c.stats();
        assert_eq!((s.live_attempts, s.tombstones), (0, 0));
        // Aliases of dropped tombstones are purged in bulk, once more than 1024 are stale.
        assert!(
            c.alias_entries() <= 1024,
            "stale aliases left behind: {}",
            c.alias_entries()
        );
    }
}
