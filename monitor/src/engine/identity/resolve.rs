//! From an event's ids to its attempt and request: lookups through the alias table, new
//! attempts and requests, merges, and the cached union-find root that spares most events a read
//! of the request record.

use super::keys::{Alias, INDEX_MASK, TAG_ATTEMPT, TAG_REQUEST, TAG_SOLO, TAG_TOMB, key_room, tag};
use super::request::RequestAt;
use super::tombstones::tomb_alive;
use super::{AttemptAt, CollidedWith, PackedIds, RequestLink, Resolved, Rid, Store};
use crate::engine::mem::NO_INDEX;
use crate::event::Ids;

impl Store {
    /// Finds or creates the request and attempt named by `ids`, merging aliases.
    /// `request_trigger`: the event may trigger a request-scope rule, so a request it names
    /// without naming an attempt needs a record.
    pub fn resolve(&mut self, ids: &Ids, time_ns: u64, request_trigger: bool) -> Resolved {
        let (attempt, merged, mut collision) = self.resolve_attempt(ids);
        let names = [
            ids.request_id.as_deref().map(Alias::request_id),
            ids.trace_id.as_deref().map(Alias::trace_id),
        ];
        // A join of the attempt's request with another one is judged when the attempt is a
        // room's and no collision was found yet.
        let guard = match attempt {
            Some(at) if collision.is_none() && self.room_request_ids_distinct => match at {
                AttemptAt::Live(i) => self.attempts[i as usize].room().is_some(),
                AttemptAt::Tomb(_) => ids.bootstrap_room.is_some(),
            },
            _ => false,
        };
        let (request, linked) = if names.iter().all(Option::is_none) {
            (self.request_at(attempt, time_ns), false)
        } else {
            let (r, linked, collided) =
                self.resolve_request(ids, names, attempt, time_ns, request_trigger, guard);
            if collided {
                collision = attempt;
            }
            (r, linked)
        };
        Resolved {
            attempt,
            request: match request {
                Some(RequestAt::Record(r)) => Some(r),
                _ => None,
            },
            solo: matches!(request, Some(RequestAt::Solo(_))),
            linked: merged || linked,
            merged,
            collision,
        }
    }

    /// `at`, the attempt (live or a tombstone) the event's room names, when the event names it
    /// with a request id other than the one the room's request has (and rooms are to keep one:
    /// [`Self::guard_room_request_ids`]). Judged before the event merges anything: a merge
    /// (the second request's attempt, first seen by its rid, found again through the room)
    /// would join the two requests and hide the collision.
    ///
    /// Inline: every event asks, and most name no request id (nothing to compare).
    #[inline]
    fn room_collision(&mut self, ids: &Ids, at: Option<AttemptAt>) -> Option<AttemptAt> {
        if !self.room_request_ids_distinct {
            return None;
        }
        let (Some(_), Some(theirs), Some(at)) = (ids.bootstrap_room, ids.request_id.as_deref(), at)
        else {
            return None;
        };
        self.room_request_id_differs(theirs, at)
    }

    /// [`Self::room_collision`] for an event naming room `at` with request id `theirs`.
    fn room_request_id_differs(&mut self, theirs: &str, at: AttemptAt) -> Option<AttemptAt> {
        if !self.with_room_request_id(at, |ours| ours.is_some_and(|ours| ours != theirs)) {
            return None;
        }
        // Kept for the report: the merge that may follow joins the two requests.
        self.collided_with = Some((self.room_request_id(at), Some(theirs.into())));
        Some(at)
    }

    /// Whether the request ids of two requests the event is about to make one differ (both
    /// known): the event shows two client requests where it found one room. If so, they are kept
    /// for the report, the room's first. Judged before the join, which keeps one of the ids.
    ///
    /// The event names no request id of its own here, or the one the room's request has: a
    /// worker's span names the room (or the attempt's rid) and a trace id only, and the trace
    /// id may name the second request already (its router's span) while the wire's legs naming
    /// the room with its x-request-id are still on their way. Joined silently, the room's
    /// request would have one of the two ids after it, and those legs would find nothing amiss.
    fn requests_collide(&mut self, room: RequestAt, other: RequestAt) -> bool {
        let (Some(ours), Some(theirs)) = (self.request_id_at(room), self.request_id_at(other))
        else {
            return false;
        };
        if ours == theirs {
            return false;
        }
        self.collided_with = Some((Some(ours), Some(theirs)));
        true
    }

    /// The request id of a request (kept solo in its attempt, or its record's root's).
    fn request_id_at(&mut self, at: RequestAt) -> Option<Box<str>> {
        match at {
            RequestAt::Solo(i) => self.attempts[i as usize]
                .request
                .solo_ids()
                .and_then(|ids| ids.request_id().map(Box::from)),
            RequestAt::Record(r) => {
                let root = self.find(r);
                self.requests[root as usize].request_id().map(Box::from)
            }
        }
    }

    /// The request of a live attempt or tombstone, if it has one.
    fn request_of(&mut self, at: AttemptAt) -> Option<RequestAt> {
        if let AttemptAt::Live(i) = at
            && self.attempts[i as usize].request.is_solo()
        {
            return Some(RequestAt::Solo(i));
        }
        self.room_record(at).map(RequestAt::Record)
    }

    /// The request ids of the last collision found ([`Self::room_collision`],
    /// [`Self::requests_collide`]): the room's first, then the other request's.
    pub fn take_collided_with(&mut self) -> CollidedWith {
        self.collided_with.take().unwrap_or_default()
    }

    /// The request id of an attempt's request: the one it keeps solo, or its record's (the
    /// union-find root's).
    pub fn room_request_id(&mut self, at: AttemptAt) -> Option<Box<str>> {
        self.with_room_request_id(at, |id| id.map(Box::from))
    }

    /// `f` of the request id of an attempt's request, read in place (most events repeat the id
    /// their solo request has: no copy on the hot path).
    fn with_room_request_id<R>(&mut self, at: AttemptAt, f: impl FnOnce(Option<&str>) -> R) -> R {
        if let AttemptAt::Live(i) = at
            && let Some(solo) = self.attempts[i as usize].request.solo_ids()
        {
            return f(solo.request_id());
        }
        let r = self.room_record(at);
        f(r.and_then(|r| self.requests[r as usize].request_id()))
    }

    /// The root of the request record an attempt (live or a tombstone) is linked to.
    fn room_record(&mut self, at: AttemptAt) -> Option<u32> {
        let r = match at {
            AttemptAt::Live(i) => self.attempts[i as usize].request.index(),
            AttemptAt::Tomb(seq) => self.tomb_index(seq).map(|t| self.tomb(t).request)?,
        };
        (r != NO_INDEX).then(|| self.find(r))
    }

    /// The live attempt or tombstone an event's room and rid name, created if new; whether two
    /// attempts turned out to be one (the merged history must reach the request); and the
    /// room's attempt when the event collides with it ([`Self::room_collision`]).
    fn resolve_attempt(&mut self, ids: &Ids) -> (Option<AttemptAt>, bool, Option<AttemptAt>) {
        let room_alias = ids.bootstrap_room.map(|r| Alias::room(r.0));
        let room_key = room_alias.map(|a| a.key);
        if room_key.is_none() && ids.rid.is_none() {
            return (None, false, None);
        }
        let mut by_room = room_alias.and_then(|a| self.lookup_attempt(&a));
        if let Some(AttemptAt::Live(i)) = by_room
            && self.compact_if_stale(i)
        {
            by_room = room_alias.and_then(|a| self.lookup_attempt(&a));
        }
        let collision = self.room_collision(ids, by_room);
        // Most events repeat the rid the attempt already has: skip the second table probe.
        let rid_known = match (by_room, ids.rid.as_deref()) {
            (Some(AttemptAt::Live(i)), Some(rid)) => self.verifier().rid_is_first(i, rid),
            _ => false,
        };
        // Hashing the rid (32 bytes) is only needed when it is not the attempt's known one.
        let rid_alias = if rid_known {
            None
        } else {
            ids.rid.as_deref().map(Alias::rid)
        };
        let rid_key = rid_alias.map(|a| a.key);
        let by_rid = if rid_known {
            by_room
        } else {
            let found = rid_alias.and_then(|a| self.lookup_attempt(&a));
            match found {
                Some(AttemptAt::Live(i))
                    if Some(AttemptAt::Live(i)) != by_room && self.compact_if_stale(i) =>
                {
                    rid_alias.and_then(|a| self.lookup_attempt(&a))
                }
                _ => found,
            }
        };
        // A merge brings the other attempt's history: request-scope state must be folded again.
        let merged = matches!((by_room, by_rid), (Some(a), Some(b)) if a != b);
        // The attempt the rid names, without a room, has another client request than the room's
        // attempt it is about to become one with (the merge keeps the room's request only).
        let collision = match (collision, by_room, by_rid) {
            (None, Some(a), Some(b @ AttemptAt::Live(j)))
                if merged
                    && self.room_request_ids_distinct
                    && self.attempts[j as usize].room().is_none() =>
            {
                match (self.request_of(a), self.request_of(b)) {
                    (Some(ra), Some(rb)) if ra != rb && self.requests_collide(ra, rb) => Some(a),
                    _ => None,
                }
            }
            (c, ..) => c,
        };
        let attempt = match (by_room, by_rid) {
            (Some(a), Some(b)) if a == b => a,
            (Some(a), Some(b)) => self.merge_attempts(a, b),
            (Some(a), None) => {
                if let (Some(k), AttemptAt::Live(i)) = (rid_key, a) {
                    self.alias_insert(k, i);
                    if !self.attempts[i as usize].has_rid()
                        && let Some(rid) = ids.rid.as_deref()
                    {
                        self.set_first_rid(i, Rid::new(rid));
                    } else {
                        // Not the first rid: `rid_is_first` said so before the probe.
                        self.own_alias(i, k, false);
                    }
                }
                a
            }
            (None, Some(b)) => match (ids.bootstrap_room, b) {
                (Some(room), AttemptAt::Live(i)) => match self.attempts[i as usize].room() {
                    None => {
                        self.attempts[i as usize].set_room(room.0);
                        self.alias_insert(key_room(room.0), i);
                        b
                    }
                    Some(other) if other == room.0 => b,
                    Some(_) => {
                        // A rid reused across attempts (client-chosen rid, router retry): the room
                        // decides; the rid stays with the attempt that had it first.
                        self.stats.alias_conflicts += 1;
                        AttemptAt::Live(self.new_attempt(Some(room.0), Rid::None, room_key, None))
                    }
                },
                _ => b,
            },
            (None, None) => AttemptAt::Live(self.new_attempt(
                ids.bootstrap_room.map(|r| r.0),
                ids.rid.as_deref().map_or(Rid::None, Rid::new),
                room_key,
                rid_key,
            )),
        };

        // A room new to the store becomes the attempt's its rid found: the event collides with
        // that attempt's request, if it has another one.
        let collision = match by_room {
            Some(_) => collision,
            None => self.room_collision(ids, Some(attempt)),
        };
        (Some(attempt), merged, collision)
    }

    /// The request of an event's attempt, for an event naming no request.
    #[inline]
    fn request_at(&mut self, attempt: Option<AttemptAt>, time_ns: u64) -> Option<RequestAt> {
        match attempt {
            Some(AttemptAt::Live(i)) if self.attempts[i as usize].request.is_solo() => {
                Some(RequestAt::Solo(i))
            }
            _ => self
                .current_request(attempt, time_ns)
                .map(RequestAt::Record),
        }
    }

    /// The request record of an event's attempt, for an event naming no request: its union-find
    /// root, or `None` when the attempt has no request or keeps it solo.
    fn current_request(&mut self, attempt: Option<AttemptAt>, time_ns: u64) -> Option<u32> {
        let root = match attempt? {
            AttemptAt::Live(i) => {
                let at = &self.attempts[i as usize];
                let cur = at.request.index();
                if cur == NO_INDEX {
                    return None;
                }
                // Events of a live attempt whose request is a known root skip the request
                // record: its idle time is brought up to date when the attempt leaves
                // (`note_request_activity`).
                if at.request.epoch() == self.union_epoch {
                    return Some(cur);
                }
                let root = self.find(cur);
                if root != cur {
                    // Point the attempt at the root; its reference follows.
                    self.requests[cur as usize].refs -= 1;
                    self.requests[root as usize].refs += 1;
                }
                self.attempts[i as usize].request = RequestLink::record(root, self.union_epoch);
                root
            }
            AttemptAt::Tomb(seq) => {
                let cur = self
                    .tomb_index(seq)
                    .map_or(NO_INDEX, |t| self.tomb(t).request);
                if cur == NO_INDEX {
                    return None;
                }
                self.find(cur)
            }
        };
        let req = &mut self.requests[root as usize];
        req.last_ns = req.last_ns.max(time_ns);
        Some(root)
    }

    /// The request an event's request id / trace id (`names`) name, with the event's attempt:
    /// found, linked to the attempt, merged with the attempt's own when they differ, or created
    /// (kept solo in the attempt when there is a live one). Returns the request (`None`: the
    /// event names only a trace two client requests share, and no attempt of its own decides),
    /// whether an attempt was newly linked to a record, and whether (`guard`: the attempt is a
    /// room's) the join showed two client requests on the room ([`Self::requests_collide`]).
    ///
    /// The request id is a client request's identity; a trace id only joins what it does not
    /// give two request ids. An OpenTelemetry client sends several requests under one trace:
    /// an event whose trace names a request with another request id than its own marks the
    /// trace shared (`shared_traces`) and keeps to its own request, and a shared trace
    /// joins nothing from then on (its events find their request through their attempt).
    fn resolve_request(
        &mut self,
        ids: &Ids,
        names: [Option<Alias>; 2],
        attempt: Option<AttemptAt>,
        time_ns: u64,
        request_trigger: bool,
        guard: bool,
    ) -> (Option<RequestAt>, bool, bool) {
        let mut by_name: [Option<RequestAt>; 2] = [None, None];
        let mut known = [false; 2];
        // Each alias is looked up once.
        for (n, name) in names.iter().enumerate() {
            let Some(mut v) = name.and_then(|a| self.alias_get(&a)) else {
                continue;
            };
            // A solo request lives in its attempt: an event naming it (the router's answer, by
            // the x-request-id alone) is that attempt's activity, and finds it live or compacted
            // as an event naming its room would. Compacted, the request has a record.
            if tag(v) == TAG_SOLO
                && self.compact_if_stale(v & INDEX_MASK)
                && let Some(moved) = name.and_then(|a| self.alias_get(&a))
            {
                v = moved;
            }
            known[n] = true;
            by_name[n] = match tag(v) {
                TAG_REQUEST => Some(RequestAt::Record(self.find(v & INDEX_MASK))),
                TAG_SOLO => Some(RequestAt::Solo(v & INDEX_MASK)),
                _ => None,
            };
        }
        // The trace's request, unless it has another request id than the event's: then the
        // trace is shared by two client requests, and the event keeps to its own.
        let trace_key = names[1].map(|a| a.key);
        let mut shared = trace_key.is_some_and(|k| self.shared_traces.contains_key(&k));
        if !shared
            && let (Some(mine), Some(t)) = (ids.request_id.as_deref(), by_name[1])
            && self.request_id_at(t).is_some_and(|theirs| &*theirs != mine)
        {
            shared = true;
        }
        if shared && let Some(k) = trace_key {
            self.mark_shared_trace(k, time_ns);
            // Not re-pointed, not given to the event's request: the trace stays the first's.
            known[1] = true;
            by_name[1] = None;
        }
        let found = match by_name {
            [Some(r), Some(t)] => Some(self.join(t, r)),
            [r, t] => r.or(t),
        };
        // After the lookups: joining what the names found may have given the attempt's solo
        // request a record.
        let cur = self.request_at(attempt, time_ns);
        // A shared trace alone decides nothing: the attempt's own request, else none.
        if shared && ids.request_id.is_none() {
            if let Some(RequestAt::Record(r)) = cur {
                let req = &mut self.requests[r as usize];
                req.last_ns = req.last_ns.max(time_ns);
            }
            return (cur, false, false);
        }
        let mut linked = false;
        let mut collided = false;
        let mut target = match (cur, found) {
            (Some(c), Some(f)) if c == f => c,
            (Some(c), Some(f)) => {
                linked = true;
                collided = guard && self.requests_collide(c, f);
                // Joined into the room's request, a collided room keeps its first request id:
                // the other request's legs, when they come (from a witness behind the one that
                // found the join), show the collision again and corroborate it.
                if collided {
                    self.join(f, c)
                } else {
                    self.join(c, f)
                }
            }
            (Some(c), None) => c,
            (None, Some(f)) => match (attempt, f) {
                // The router's own events about a solo request (its answer to the client): the
                // request is no less alive, and nothing else needs a record.
                (None, RequestAt::Solo(i)) if !request_trigger => {
                    let at = &mut self.attempts[i as usize];
                    at.last_ns = at.last_ns.max(time_ns);
                    f
                }
                // The router dispatching a request it received (a request-level event, which
                // made a record): its first attempt takes the request over, solo.
                (Some(AttemptAt::Live(i)), RequestAt::Record(r)) if self.bare(r) => {
                    self.adopt(i, r);
                    RequestAt::Solo(i)
                }
                _ => {
                    let r = self.record(f);
                    linked = self.link(attempt, r);
                    RequestAt::Record(r)
                }
            },
            (None, None) => {
                self.stats.requests_created += 1;
                self.live_requests += 1;
                match attempt {
                    Some(AttemptAt::Live(i)) => {
                        // The usual first sight of a request: its router dispatch, naming the
                        // attempt's room. It stays in the attempt until something needs more.
                        let request_id = ids.request_id.as_deref().filter(|_| !known[0]);
                        let trace_id = ids.trace_id.as_deref().filter(|_| !known[1]);
                        let solo = PackedIds::new(request_id, trace_id);
                        let keys = solo.keys();
                        self.attempts[i as usize].request = RequestLink::solo(solo);
                        for key in keys {
                            self.alias_insert(key, TAG_SOLO | i);
                        }
                        known = [true; 2];
                        RequestAt::Solo(i)
                    }
                    _ => {
                        let r = self.new_request_record();
                        linked = self.link(attempt, r);
                        RequestAt::Record(r)
                    }
                }
            }
        };
        for (n, name) in names.iter().enumerate() {
            let Some(key) = name.map(|a| a.key) else {
                continue;
            };
            if known[n] {
                continue;
            }
            let text = if n == 0 {
                &ids.request_id
            } else {
                &ids.trace_id
            };
            target = self.add_id(target, n == 1, key, text.as_deref().unwrap_or(""), time_ns);
        }
        if let RequestAt::Record(r) = target {
            let req = &mut self.requests[r as usize];
            req.last_ns = req.last_ns.max(time_ns);
        }
        (Some(target), linked, collided)
    }

    /// Trace `key` names two client requests (two request ids): remembered for the retention,
    /// at most `max_requests` traces (beyond it, those past the retention go, and the staler
    /// half of the rest if more than half the cap remains: a sweep is O(cap) once per cap/2
    /// traces marked at least).
    pub(super) fn mark_shared_trace(&mut self, key: u64, time_ns: u64) {
        let seen = self.shared_traces.entry(key).or_insert(time_ns);
        *seen = (*seen).max(time_ns);
        let cap = self.limits.max_requests.max(1);
        if self.shared_traces.len() <= cap {
            return;
        }
        let horizon = time_ns.saturating_sub(self.limits.retention_ns);
        self.shared_traces.retain(|_, t| *t >= horizon);
        if self.shared_traces.len() > cap / 2 {
            let mut times: Vec<u64> = self.shared_traces.values().copied().collect();
            let mid = times.len() / 2;
            let cutoff = *times.select_nth_unstable(mid).1;
            self.shared_traces.retain(|_, t| *t > cutoff);
        }
    }

    /// The live attempt or tombstone alias `a` names. Entries of dropped tombstones met on the
    /// way (they fail verification) are removed.
    fn lookup_attempt(&mut self, a: &Alias) -> Option<AttemptAt> {
        let mut stale = false;
        let found = self.aliases.find(a.key, |v| {
            self.owns(v, a) || {
                stale |= tag(v) == TAG_TOMB && self.verifier().tomb_index(v).is_none();
                false
            }
        });
        match found {
            Some(v) if tag(v) == TAG_ATTEMPT => Some(AttemptAt::Live(v)),
            Some(v) if tag(v) == TAG_TOMB => {
                let i = self.verifier().tomb_index(v).expect("verified");
                Some(AttemptAt::Tomb(self.tomb_base + i as u64))
            }
            Some(_) => None,
            None => {
                if stale {
                    let (base, len) = (self.tomb_base as u32, self.tombs.len());
                    while self
                        .aliases
                        .remove(a.key, |v| tag(v) == TAG_TOMB && !tomb_alive(v, base, len))
                        .is_some()
                    {
                        self.tomb_alias_stale = self.tomb_alias_stale.saturating_sub(1);
                    }
                }
                None
            }
        }
    }
}

#[cfg(test)]
impl Store {
    /// Resolves as for an event that triggers no request-scope rule.
    pub(super) fn resolve_t(&mut self, ids: &Ids, time_ns: u64) -> Resolved {
        self.resolve(ids, time_ns, false)
    }
}
