//! Identity correlation: which (request, attempt) does an event belong to?
//!
//! `request_id` (x-request-id) and `trace_id` name a client request; `bootstrap_room` and `rid`
//! name one attempt of it. Aliases are merged incrementally: an attempt holds at most one room (the
//! router mints a new room per retry, so two rooms are two attempts, never one), while requests
//! merge (union-find) by their aliases, except that a trace id never joins two request ids: the
//! x-request-id is a client request's identity, and one OpenTelemetry trace may carry several
//! client requests (a join through a room of two request ids is a collision, and is kept). Memory is bounded: live attempts are compacted into tombstones once
//! ended or idle past a TTL, tombstones expire after a retention window, and hard caps evict with
//! a counter. This module is sans-IO; the checker owns the per-attempt rule slots stored here.
//!
//! [`Store`] holds it all. Aliases: `keys` (keys and alias table values), `verify` (owners
//! confirm fingerprint matches), `rid`. Records: `attempt`, `request` (union-find),
//! `request_link` (an attempt's request in one word), `tombstones`. Verbs: `resolve`
//! (an event's ids to its attempt and request), `evict` (the bounded sweep), `reported` (the
//! checker's dedup state per owner).

use std::collections::HashMap;

use foldhash::fast::FixedState;

use crate::engine::mem::alias_table;
use crate::engine::mem::chunked::{Chunked, ChunkedQueue};
use crate::engine::mem::stable_hash::stable_hasher;
use crate::engine::state::rows::SlotRows;
use crate::engine::state::{Keep, Slot};

mod attempt;
mod evict;
mod keys;
mod reported;
mod request;
mod request_link;
mod resolve;
mod rid;
#[cfg(test)]
mod tests;
mod tombstones;
mod verify;

pub use attempt::Attempt;
pub use request::Request;
pub use request_link::{PackedIds, RequestLink};
pub use rid::Rid;
pub use tombstones::Tombstone;

/// Whose never-after verdict a set of reported evidence sources belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Owner {
    Attempt(u32),
    Tomb(u64),
    Request(u32),
}

/// Where an event's attempt lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptAt {
    Live(u32),
    Tomb(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resolved {
    pub attempt: Option<AttemptAt>,
    /// The request's record (its union-find root); `None` for a solo request, or an event whose
    /// only name is a trace two requests share and whose attempt has no request.
    pub request: Option<u32>,
    /// The attempt was (re)linked to a request by this event: request-scope state must be folded.
    pub linked: bool,
    /// This event showed two attempts to be one: the merged history must be judged again, even
    /// by rules the event itself does not match.
    pub merged: bool,
    /// The event's request has no record: its only attempt keeps it (see [`RequestLink`]).
    pub solo: bool,
    /// The attempt (live or a tombstone) of the room the event names, when the event shows a
    /// second client request on it: it names the room with a request id other than the one the
    /// room's request has ([`Store::room_request_id`]), or joins the room's request (through
    /// the room, or a rid of the room's attempt) with a request that has another request id. They are still joined through the room: whose KV a
    /// collided room moves cannot be told, so its activity counts for each request on it (and
    /// the verdicts stay independent of which request arrived first).
    pub collision: Option<AttemptAt>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CorrelateStats {
    pub attempts_created: u64,
    pub attempts_merged: u64,
    /// An event named a room and a rid that belong to different attempts with different rooms.
    pub alias_conflicts: u64,
    pub compacted_ended: u64,
    pub evicted_ttl: u64,
    pub evicted_cap: u64,
    pub tombstones_expired: u64,
    pub tombstones_evicted_cap: u64,
    pub requests_created: u64,
    pub requests_merged: u64,
    pub requests_expired: u64,
    /// Request records nothing pointed to, freed before their retention at `max_requests`.
    pub requests_evicted_cap: u64,
    /// Requests given a record after living in their only attempt (see [`RequestLink`]).
    pub requests_materialized: u64,
    /// Records of requests taken over by their first attempt (made by a request-level event).
    pub requests_adopted: u64,
}

impl CorrelateStats {
    /// Adds another shard's counters to these.
    pub fn absorb(&mut self, o: &CorrelateStats) {
        let CorrelateStats {
            attempts_created,
            attempts_merged,
            alias_conflicts,
            compacted_ended,
            evicted_ttl,
            evicted_cap,
            tombstones_expired,
            tombstones_evicted_cap,
            requests_created,
            requests_merged,
            requests_expired,
            requests_evicted_cap,
            requests_materialized,
            requests_adopted,
        } = o;
        self.attempts_created += attempts_created;
        self.attempts_merged += attempts_merged;
        self.alias_conflicts += alias_conflicts;
        self.compacted_ended += compacted_ended;
        self.evicted_ttl += evicted_ttl;
        self.evicted_cap += evicted_cap;
        self.tombstones_expired += tombstones_expired;
        self.tombstones_evicted_cap += tombstones_evicted_cap;
        self.requests_created += requests_created;
        self.requests_merged += requests_merged;
        self.requests_expired += requests_expired;
        self.requests_evicted_cap += requests_evicted_cap;
        self.requests_materialized += requests_materialized;
        self.requests_adopted += requests_adopted;
    }
}

#[derive(Debug, Clone, Copy)]
pub struct StoreLimits {
    pub max_attempts: usize,
    pub max_tombstones: usize,
    /// Request records (requests not living in their only attempt); beyond it the
    /// oldest-visited one nothing points to is freed (counted).
    pub max_requests: usize,
    /// Idle live attempts are compacted after this (ns).
    pub attempt_ttl_ns: u64,
    /// Ended attempts are compacted once quiet for this long (ns).
    pub linger_ns: u64,
    /// Tombstones, and requests nothing points to, are kept this long (ns).
    pub retention_ns: u64,
}

/// The request ids of a room collision: the room's first request's, then the other's.
pub type CollidedWith = (Option<Box<str>>, Option<Box<str>>);

/// The correlation store.
pub struct Store {
    limits: StoreLimits,
    attempts: Chunked<Attempt>,
    /// Per attempt, its rule slots as a sparse row in a size class (see
    /// [`crate::engine::state::rows`]).
    attempt_rows: SlotRows,
    free_attempts: Vec<u32>,
    live_attempts: usize,
    /// Every alias: rooms and rids (live attempts, tombstones), request ids and trace ids.
    aliases: alias_table::Table,
    /// First rejection reason of attempts that have one (about 1% of them).
    reasons: HashMap<u32, Box<str>, FixedState>,
    /// The first rid of attempts whose rid is not SGLang-shaped hex (`RID_TEXT`).
    rid_texts: HashMap<u32, Box<str>, FixedState>,
    /// Alias keys of attempts seen with more than two rids, beyond `Attempt::rid2_key`.
    more_rids: HashMap<u32, Vec<u64>, FixedState>,
    /// Per (owner, rule) that fired: a bit per `Source` seen in its reported evidence, so a source
    /// that saw the breach later corroborates it once. Only owners with fired bits have entries.
    reported: HashMap<(Owner, u8), u8, FixedState>,
    /// The alias each request's first violation was fingerprinted with, for requests that fired
    /// only. Aliases arrive in any order (smg's span, the only one with the x-request-id, comes
    /// when the request is over), so later violations reuse it: one request, one fingerprint.
    pinned_alias: HashMap<u32, Box<str>, FixedState>,

    requests: Chunked<Request>,
    request_slots: Chunked<u64>,
    wide_requests: HashMap<u32, Box<[Slot]>, FixedState>,
    request_keeps: Vec<Keep>,
    /// (attempt spec, request spec) pairs: what an attempt linked to a request brings to it (its
    /// own latest forbidden events, for request-scope never-after rules).
    request_links: Vec<(usize, usize)>,
    free_requests: Vec<u32>,
    live_requests: usize,

    tombs: ChunkedQueue<Tombstone>,
    /// The tombstones' sparse slot rows (of `tomb_slot_map.len()` slots; see
    /// [`crate::engine::state::sparse`]), one after another in the order of `tombs`: a word queue.
    tomb_slots: ChunkedQueue<u64>,
    /// Absolute index of the queue's first word.
    tomb_words_base: u64,
    /// The rules whose fired bits tombstones keep (attempt-scope never-after).
    tomb_rule_mask: u64,
    /// Slots of tombstones whose row is wide, by tombstone sequence number.
    wide_tombs: HashMap<u64, Box<[Slot]>, FixedState>,
    /// Which attempt slots a tombstone keeps (those of attempt-scope never-after rules).
    tomb_slot_map: Vec<usize>,
    tomb_base: u64,
    /// Alias entries that may still point to dropped tombstones (purged in bulk).
    tomb_alias_stale: usize,

    attempt_hand: usize,
    request_hand: usize,
    /// Bumped by every request union (starts at 1; see [`RequestLink`]).
    union_epoch: u32,
    /// A room keeps one request id (a `distinct` rule is on): an event naming a room with
    /// another one is a collision.
    room_request_ids_distinct: bool,
    /// Traces seen naming two client requests (two request ids), by alias key, with when last
    /// seen: they join no records (see `resolve_request`).
    shared_traces: HashMap<u64, u64, FixedState>,
    /// The request ids of the collision being resolved, the room's first (for its report).
    collided_with: Option<CollidedWith>,
    /// See [`Self::set_clock`].
    watermark_ns: u64,
    event_ns: u64,
    stats: CorrelateStats,
}

impl Store {
    pub fn new(
        limits: StoreLimits,
        attempt_keeps: Vec<Keep>,
        request_keeps: Vec<Keep>,
        request_links: Vec<(usize, usize)>,
        tomb_slot_map: Vec<usize>,
        tomb_rule_mask: u64,
    ) -> Store {
        assert!(
            tomb_rule_mask.count_ones() as usize <= crate::engine::state::MAX_TOMBSTONE_RULES,
            "tombstones keep at most 32 rules' fired bits"
        );
        // Alias values hold 30-bit indices; the tombstone window must stay far below that.
        let limits = StoreLimits {
            max_attempts: limits.max_attempts.min(1 << 29),
            max_tombstones: limits.max_tombstones.min(1 << 28),
            ..limits
        };
        Store {
            limits,
            attempts: Chunked::new(1),
            attempt_rows: SlotRows::new(attempt_keeps),
            free_attempts: Vec::new(),
            live_attempts: 0,
            aliases: alias_table::Table::default(),
            reasons: HashMap::with_hasher(stable_hasher()),
            rid_texts: HashMap::with_hasher(stable_hasher()),
            more_rids: HashMap::with_hasher(stable_hasher()),
            reported: HashMap::with_hasher(stable_hasher()),
            pinned_alias: HashMap::with_hasher(stable_hasher()),
            requests: Chunked::new(1),
            request_slots: Chunked::new(1 + request_keeps.len()),
            wide_requests: HashMap::with_hasher(stable_hasher()),
            request_keeps,
            request_links,
            free_requests: Vec::new(),
            live_requests: 0,
            tombs: ChunkedQueue::new(1),
            tomb_slots: ChunkedQueue::new(1),
            tomb_words_base: 0,
            tomb_rule_mask,
            wide_tombs: HashMap::with_hasher(stable_hasher()),
            tomb_slot_map,
            tomb_base: 0,
            tomb_alias_stale: 0,
            attempt_hand: 0,
            request_hand: 0,
            union_epoch: 1,
            room_request_ids_distinct: false,
            shared_traces: HashMap::with_hasher(stable_hasher()),
            collided_with: None,
            watermark_ns: 0,
            event_ns: 0,
            stats: CorrelateStats::default(),
        }
    }

    /// Live attempt `a`'s record.
    #[inline]
    pub fn attempt(&self, a: u32) -> &Attempt {
        &self.attempts[a as usize]
    }
    /// Live attempt `a`'s record, for the facts the checker folds into it.
    #[inline]
    pub fn attempt_mut(&mut self, a: u32) -> &mut Attempt {
        &mut self.attempts[a as usize]
    }
    /// Request record `r`.
    #[inline]
    pub fn request(&self, r: u32) -> &Request {
        &self.requests[r as usize]
    }
    /// Rule bits `bits` of attempt `a` produced a violation.
    #[inline]
    pub fn mark_fired(&mut self, a: u32, bits: u64) {
        self.attempts[a as usize].fired |= bits;
    }
    /// Rule bits `bits` of request `r` produced a violation.
    #[inline]
    pub fn mark_request_fired(&mut self, r: u32, bits: u64) {
        self.requests[r as usize].fired |= bits;
    }
    /// Makes `due` attempt `a`'s pending deadline if it has none or a later one; if so, the
    /// generation to queue the deadline under.
    #[inline]
    pub fn arm_deadline(&mut self, a: u32, due: u64) -> Option<u32> {
        let at = &mut self.attempts[a as usize];
        (at.due_ns == 0 || due < at.due_ns).then(|| {
            at.due_ns = due;
            at.generation
        })
    }
    /// Attempt `a`'s pending deadline (0 = none; compaction waits for it).
    #[inline]
    pub fn set_due(&mut self, a: u32, due_ns: u64) {
        self.attempts[a as usize].due_ns = due_ns;
    }
    /// Attempt `a`'s pending deadline `due_ns` is being judged: none is pending any more, and
    /// the judgement counts as the attempt's activity at that time, so its linger runs from it.
    /// An event less than the linger after the deadline then finds the attempt live whether
    /// the watermark passed the deadline before the event arrived or only with it (see
    /// [`Self::compact_if_stale`]).
    #[inline]
    pub fn deadline_judged(&mut self, a: u32, due_ns: u64) {
        let at = &mut self.attempts[a as usize];
        at.due_ns = 0;
        at.last_ns = at.last_ns.max(due_ns);
    }
    /// Attempt `a` waits (or no longer waits) for a predicate to be judged again.
    #[inline]
    pub fn set_rejudge(&mut self, a: u32, on: bool) {
        self.attempts[a as usize].set_rejudge(on);
    }
    /// Whether the timer entry (`due`, `a`, `generation`) still stands: the attempt is the same
    /// one, live, and no earlier deadline or settling superseded the entry.
    #[inline]
    pub fn timer_valid(&self, due: u64, a: u32, generation: u32) -> bool {
        let at = &self.attempts[a as usize];
        at.generation == generation && at.is_live() && at.due_ns == due
    }
    /// Rooms keep one request id from now on (see [`Resolved::collision`]).
    pub fn guard_room_request_ids(&mut self) {
        self.room_request_ids_distinct = true;
    }
    pub fn stats(&self) -> CorrelateStats {
        self.stats
    }

    pub fn live_attempts(&self) -> usize {
        self.live_attempts
    }
    pub fn live_requests(&self) -> usize {
        self.live_requests
    }
    /// Live requests with a record (forwarding stubs of merged ones included).
    pub fn request_records(&self) -> usize {
        self.requests.len() - self.free_requests.len()
    }
    pub fn tombstones(&self) -> usize {
        self.tombs.len()
    }
    pub fn alias_entries(&self) -> usize {
        self.aliases.len()
    }

    /// Attempts, requests and tombstones whose slots did not fit a packed or mapped row, for the
    /// stats.
    pub fn wide_rows(&self) -> usize {
        self.attempt_rows.wide_len() + self.wide_requests.len() + self.wide_tombs.len()
    }

    /// [`Self::table_bytes`] per table, for the memory benchmark's breakdown.
    pub fn table_breakdown(&self) -> Vec<(&'static str, usize)> {
        vec![
            ("attempts", self.attempts.capacity_bytes()),
            ("attempt slots", self.attempt_rows.capacity_bytes()),
            ("alias table", self.aliases.capacity_bytes()),
            ("requests", self.requests.capacity_bytes()),
            ("request slots", self.request_slots.capacity_bytes()),
            ("tombstones", self.tombs.capacity_bytes()),
            ("tombstone slots", self.tomb_slots.capacity_bytes()),
        ]
    }

    /// Heap bytes held by the store's tables (capacity, not length), for memory accounting.
    pub fn table_bytes(&self) -> usize {
        self.attempts.capacity_bytes()
            + self.attempt_rows.capacity_bytes()
            + self.aliases.capacity_bytes()
            + self.requests.capacity_bytes()
            + self.request_slots.capacity_bytes()
            + self.tombs.capacity_bytes()
            + self.tomb_slots.capacity_bytes()
    }
}
