//! The streaming checker: a sans-IO, deterministic engine.
//!
//! `observe(event)` and `tick(now)` are the only entry points; no clocks, channels or I/O live
//! here, so the same events give the same verdicts whoever drives it (`revenant check`, `run`,
//! tests, benchmarks). Event time decides "later"; a watermark (latest event time minus the
//! allowed lateness, or the driver's clock minus it) decides when a deadline has passed.
//!
//! An observed event takes one of four paths, by what it names: a live attempt (`attempt.rs`),
//! a compacted one (`tombstone.rs`), only its request (`request.rs`), or nothing but a worker
//! (`workers.rs`). Deadline rules are judged when the watermark passes them (`deadlines.rs`, on
//! the queue in [`timers`]); `report.rs` turns a finding into a [`Violation`].

mod attempt;
mod deadlines;
mod layout;
pub mod metrics;
mod never;
mod never_after;
mod report;
mod request;
mod stats;
pub mod timers;
mod tombstone;
mod workers;

#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use foldhash::fast::FixedState;

use crate::engine::identity::{AttemptAt, Store, StoreLimits};
use crate::engine::rules::predicate::Capacity;
use crate::engine::rules::{self, CompiledRule};
use crate::engine::state::{Keep, NodeId, SlotSpec, SpecIndex};
use crate::event::{Kind, LifecycleEvent, Stage};
use crate::violation::Violation;

pub use crate::engine::rules::{RuleSet, RulesError};
pub use stats::{CheckerStats, RuleCounts};

use layout::{Layout, Reactions};

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
    /// Hard cap on request records; beyond it one nothing points to is freed (counted).
    pub max_requests: usize,
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
            max_requests: 2_000_000,
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
        if self.max_attempts == 0 || self.max_tombstones == 0 || self.max_requests == 0 {
            return Err(ConfigError::Invalid(
                "max_attempts, max_tombstones and max_requests must be at least 1".into(),
            ));
        }
        if self.retention.is_zero() {
            return Err(ConfigError::Invalid("retention must be positive".into()));
        }
        Ok(())
    }

    /// The store's limits for rules that need an attempt's live state up to `horizon` after
    /// their trigger.
    fn limits(&self, horizon: Duration) -> StoreLimits {
        let lateness_ns = ns(self.allowed_lateness);
        StoreLimits {
            max_attempts: self.max_attempts.max(1),
            max_tombstones: self.max_tombstones.max(1),
            max_requests: self.max_requests.max(1),
            // An attempt must outlive its longest deadline, or the deadline could never be judged.
            attempt_ttl_ns: ns(self.attempt_ttl)
                .max(ns(horizon) + ns(self.clock_skew) + lateness_ns + ns(self.linger)),
            linger_ns: ns(self.linger).max(lateness_ns),
            retention_ns: ns(self.retention),
        }
    }
}

/// Bytes the engine charges per live attempt, its request included: the state_size bench measures
/// 254 B at a table's fill; hash tables double when they grow, so the worst case is twice that.
pub const BYTES_PER_ATTEMPT: u64 = 512;
/// Bytes per tombstone: 56 B measured (queue, kept slot, alias index), doubled for table growth.
pub const BYTES_PER_TOMBSTONE: u64 = 128;
/// Bytes per request record (a request not living in its only attempt, e.g. a router's request
/// no attempt named): about 90 B in the `otlp_load` bench's tables, doubled for table growth.
pub const BYTES_PER_REQUEST: u64 = 192;
/// What a budget charges per live attempt: the attempt and as many request records.
pub const BYTES_PER_ATTEMPT_AND_REQUEST: u64 = BYTES_PER_ATTEMPT + BYTES_PER_REQUEST;

/// The engine's caps for its shares of a memory budget (`revenant run`'s memory plan splits the
/// budget; these are the engine's part of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetCaps {
    pub max_attempts: usize,
    pub max_tombstones: usize,
    /// As many request records as live attempts, charged to the attempts' share.
    pub max_requests: usize,
}

impl BudgetCaps {
    /// The caps that keep live attempts and as many request records within `attempt_bytes`,
    /// and tombstones within `tombstone_bytes`, at least one of each.
    pub fn from_shares(attempt_bytes: u64, tombstone_bytes: u64) -> BudgetCaps {
        let attempts = (attempt_bytes / BYTES_PER_ATTEMPT_AND_REQUEST).max(1) as usize;
        BudgetCaps {
            max_attempts: attempts,
            max_tombstones: (tombstone_bytes / BYTES_PER_TOMBSTONE).max(1) as usize,
            max_requests: attempts,
        }
    }

    /// The bytes charged at these counts: what the caps keep within the shares.
    pub fn estimate(live_attempts: u64, request_records: u64, tombstones: u64) -> u64 {
        live_attempts * BYTES_PER_ATTEMPT
            + request_records * BYTES_PER_REQUEST
            + tombstones * BYTES_PER_TOMBSTONE
    }
}

/// A duration in nanoseconds, saturated at `u64::MAX`.
fn ns(d: Duration) -> u64 {
    d.as_nanos().min(u64::MAX as u128) as u64
}

type FixedMap<K, V> = HashMap<K, V, FixedState>;

const SEED: u64 = 0x636865636b6572; // "checker"
/// Attempt-naming findings of `never` rules remembered (with the worker-level ones).
const MAX_NEVER_DEDUP: usize = 100_000;
/// Attempts examined by housekeeping per observed event (amortised O(1)).
const SWEEP_PER_EVENT: usize = 2;
/// Attempts examined by housekeeping per tick.
const SWEEP_PER_TICK: usize = 4096;

/// The engine: the compiled rules, the identity store with their slots, the deadline queue and
/// what it knows of nodes and workers.
pub struct Checker {
    rules: Vec<CompiledRule>,
    attempt_specs: Vec<SlotSpec>,
    request_specs: Vec<SlotSpec>,
    /// The attempt and request specs an event matches, looked up once per event.
    index: SpecIndex,
    /// Request slots that hold triggers (request-level events only update those).
    request_trigger_mask: u64,
    /// Per rule, which attempt events it has anything to do.
    rule_reacts: Vec<Reactions>,
    reacting: layout::ReactingRules,
    /// Rules judged when a deadline passes.
    deadline_rules: u64,
    store: Store,
    timers: timers::TimerQueue,
    nodes: FixedMap<Box<str>, NodeId>,
    capacity: FixedMap<(u32, Stage), Capacity>,
    /// Worker keys interned to 16-bit ids (attempts keep four of them); index 0 is "none".
    workers: FixedMap<u32, u16>,
    worker_hashes: Vec<u32>,
    worker_fired: HashSet<u64, FixedState>,
    /// Indices of the `never` rules, judged on every event that passes `never_gate`.
    never_rules: Vec<usize>,
    never_gate: never::NeverGate,
    skew_ns: u64,
    lateness_ns: u64,
    /// Whether a newer event moves the watermark (to its time minus the lateness); off when the
    /// driver knows better how far the input came (cluster mode: only `tick` moves it).
    events_move_watermark: bool,
    stats: CheckerStats,
    per_rule: RuleCounts,
}

impl Checker {
    /// Assembles an engine for the enabled `rules`: their slot layout (`layout.rs`),
    /// the store sized by `cfg`, empty queues and tables.
    pub fn new(rules: RuleSet, cfg: CheckerConfig) -> Checker {
        let Layout {
            rules,
            attempt_specs,
            request_specs,
            index,
            request_trigger_mask,
            rule_reacts,
            reacting,
            deadline_rules,
            request_links,
            tomb_slot_map,
            tomb_rule_mask,
            horizon,
        } = Layout::compile(&rules);
        let keeps = |specs: &[SlotSpec]| specs.iter().map(|s| s.keep).collect::<Vec<Keep>>();
        let mut store = Store::new(
            cfg.limits(horizon),
            keeps(&attempt_specs),
            keeps(&request_specs),
            request_links,
            tomb_slot_map,
            tomb_rule_mask,
        );
        if rules
            .iter()
            .any(|r| matches!(r.rule.shape, rules::Shape::Distinct(_)))
        {
            store.guard_room_request_ids();
        }
        let n = rules.len();
        let never_rules: Vec<usize> = (0..n)
            .filter(|&ri| matches!(rules[ri].rule.shape, rules::Shape::Never(_)))
            .collect();
        let never_gate = never::NeverGate::of(rules.iter().flat_map(|r| match &r.rule.shape {
            rules::Shape::Never(n) => n.event.as_slice(),
            _ => &[],
        }));
        Checker {
            rules,
            attempt_specs,
            request_specs,
            index,
            request_trigger_mask,
            rule_reacts,
            reacting,
            deadline_rules,
            store,
            timers: timers::TimerQueue::default(),
            nodes: FixedMap::with_hasher(FixedState::with_seed(SEED)),
            capacity: FixedMap::with_hasher(FixedState::with_seed(SEED)),
            workers: FixedMap::with_hasher(FixedState::with_seed(SEED)),
            worker_hashes: vec![0],
            worker_fired: HashSet::with_hasher(FixedState::with_seed(SEED)),
            never_rules,
            never_gate,
            skew_ns: ns(cfg.clock_skew),
            lateness_ns: ns(cfg.allowed_lateness),
            events_move_watermark: true,
            stats: CheckerStats::default(),
            per_rule: vec![0; n],
        }
    }

    pub fn rules(&self) -> impl Iterator<Item = &rules::Rule> {
        self.rules.iter().map(|r| &r.rule)
    }

    pub fn watermark_ns(&self) -> u64 {
        self.stats.watermark_ns
    }

    /// Moves the watermark only on `tick`, not on newer events: for a driver whose input comes
    /// from several streams that may be far apart (cluster mode: one agent's backlog before
    /// another's), where an event's time says nothing of what is still on its way and the
    /// driver ticks with how far every stream provably came.
    pub fn watermark_from_ticks_only(&mut self) {
        self.events_move_watermark = false;
    }

    /// Moves the watermark as an event at `newest_ns` would have (nothing if it is not newer than
    /// every event seen): a shard of a split engine follows the newest event of the whole input
    /// before each of its own, so that its watermark, its deadlines and its late events are those
    /// of one checker fed everything ([`super::shard`]).
    pub fn follow(&mut self, newest_ns: u64) -> Vec<Violation> {
        let mut out = Vec::new();
        if newest_ns > self.stats.max_event_ns {
            self.stats.max_event_ns = newest_ns;
            if self.events_move_watermark {
                self.advance(newest_ns.saturating_sub(self.lateness_ns), &mut out);
            }
        }
        out
    }

    /// Feeds one event; returns the violations it proves (each (rule, attempt) at most once).
    pub fn observe(&mut self, e: &LifecycleEvent) -> Vec<Violation> {
        let mut out = Vec::new();
        self.stats.events += 1;
        if e.time_ns < self.stats.watermark_ns {
            self.stats.events_late += 1;
        }
        let node = self.node_id(e.node.as_deref());
        // The watermark moves to the event's own before the event is judged: deadlines it
        // passes are judged on the events before it (it is more than the lateness later, so it
        // cannot count for them), and the attempt it names is compacted or not by the same
        // deadlines whatever arrived first (the store's `compact_if_stale`).
        if e.time_ns > self.stats.max_event_ns {
            self.stats.max_event_ns = e.time_ns;
            if self.events_move_watermark {
                self.advance(e.time_ns.saturating_sub(self.lateness_ns), &mut out);
            }
        }

        if e.kind == Kind::Capacity {
            self.stats.capacity_reports += 1;
            self.record_capacity(e);
            self.check_worker_predicates(e, &mut out);
            if self.never_gate.may_match(e) {
                self.check_never(e, None, &mut out);
            }
        } else {
            let hits = self.index.matching(e);
            // A request-level event that may trigger a request-scope rule needs the request's
            // record; other ones leave a request solo in its attempt.
            let request_trigger =
                !e.ids.names_attempt() && hits.request & self.request_trigger_mask != 0;
            self.store.set_clock(self.stats.watermark_ns, e.time_ns);
            let resolved = self.store.resolve(&e.ids, e.time_ns, request_trigger);
            let request = resolved.request;
            match resolved.attempt {
                Some(AttemptAt::Live(a)) => {
                    self.stats.events_attempt += 1;
                    self.observe_attempt(a, resolved, e, hits, node, &mut out);
                }
                Some(AttemptAt::Tomb(seq)) => {
                    self.stats.events_attempt += 1;
                    self.stats.events_on_tombstones += 1;
                    self.observe_tombstone(seq, resolved.request, e, hits.attempt, node, &mut out);
                    if let Some(room_owner) = resolved.collision {
                        self.report_collision(room_owner, e, &mut out);
                    }
                }
                None => match resolved.request {
                    Some(r) => {
                        self.stats.events_request_only += 1;
                        self.observe_request_level(r, e, hits.request, node, &mut out);
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
            if self.never_gate.may_match(e) {
                self.check_never(e, request, &mut out);
            }
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
            if !self.store.timer_valid(due, a, generation) {
                continue; // attempt gone, or superseded by an earlier deadline
            }
            self.stats.timers_fired += 1;
            self.store.deadline_judged(a, due);
            self.store.set_rejudge(a, false);
            self.judge_deadlines(a, out);
        }
    }
}
