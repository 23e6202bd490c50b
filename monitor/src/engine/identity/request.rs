//! Request records ([`Request`]) and their union-find: finding roots, joining two requests,
//! giving a solo request (kept by its only attempt) a record, adopting a bare record, freeing.

use super::keys::{AliasKind, TAG_REQUEST, TAG_SOLO, key_str};
use super::request_link::EPOCH_LIMIT;
use super::{AttemptAt, Owner, PackedIds, RequestLink, Store};
use crate::engine::mem::NO_INDEX;
use crate::engine::state::owner_row::{row_clear, row_fold, row_store, row_view};
use crate::engine::state::{Candidates, Slot, Slots, fold_all};

/// A request record (40 bytes): its ids; its request-scope rule slots are in
/// [`Store::request_slots`]. It owns at most one request id and one trace id alias, so freeing
/// it removes every alias pointing at it; a second one of either kind gets a stub request merged
/// into this one. A request with a single attempt has no record until something needs one
/// (see [`RequestLink`]).
#[derive(Debug, Clone)]
pub struct Request {
    pub generation: u32,
    /// Union-find parent; `NO_INDEX` for a root.
    pub parent: u32,
    /// Attempts and tombstones that point here.
    pub refs: u32,
    pub(super) live: bool,
    pub last_ns: u64,
    pub fired: u64,
    pub(super) ids: Option<PackedIds>,
}

impl Request {
    pub fn is_live(&self) -> bool {
        self.live
    }
    pub fn request_id(&self) -> Option<&str> {
        self.ids.as_ref()?.request_id()
    }
    pub fn trace_id(&self) -> Option<&str> {
        self.ids.as_ref()?.trace_id()
    }
    /// Sets the request id (`trace` false) or trace id if it has none; false if it had one.
    fn set_id(&mut self, trace: bool, v: &str) -> bool {
        let next = match &self.ids {
            None if trace => PackedIds::new(None, Some(v)),
            None => PackedIds::new(Some(v), None),
            Some(ids) => match ids.with(trace, v) {
                Some(next) => next,
                None => return false,
            },
        };
        self.ids = Some(next);
        true
    }
}

/// Where a request's state is: its record (a union-find root), or its only attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RequestAt {
    Record(u32),
    Solo(u32),
}

impl Store {
    pub fn request_slots(&self, r: u32) -> Slots<'_> {
        row_view(self.request_slots.item(r as usize), &self.wide_requests, r)
    }
    /// Folds `slot` into every spec of request `r` whose bit is set in `specs`; returns the
    /// specs whose slots changed.
    pub fn fold_request_slots(&mut self, r: u32, specs: u64, slot: Slot) -> u64 {
        let row = self.request_slots.item_mut(r as usize);
        row_fold(
            row,
            &mut self.wide_requests,
            r,
            specs,
            &self.request_keeps,
            slot,
        )
    }

    /// The union-find root of request `r` (path halving keeps chains short).
    pub fn find(&mut self, mut r: u32) -> u32 {
        loop {
            let p = self.requests[r as usize].parent;
            if p == NO_INDEX {
                return r;
            }
            let gp = self.requests[p as usize].parent;
            if gp != NO_INDEX {
                // Re-point r from p to gp; reference counts follow the pointer.
                self.requests[r as usize].parent = gp;
                self.requests[p as usize].refs -= 1;
                self.requests[gp as usize].refs += 1;
            }
            r = p;
        }
    }

    /// Whether record `r` holds nothing a solo request could not: no attempt or tombstone, no
    /// merged request, no slots, nothing fired or pinned. A request-level event made it.
    pub(super) fn bare(&self, r: u32) -> bool {
        let q = &self.requests[r as usize];
        q.refs == 0
            && q.parent == NO_INDEX
            && q.fired == 0
            && self.request_slots.item(r as usize).iter().all(|&w| w == 0)
            && !self.pinned_alias.contains_key(&r)
    }

    /// Live attempt `i` (without a request) takes bare record `r` over as its solo request.
    pub(super) fn adopt(&mut self, i: u32, r: u32) {
        // Re-pointed while the record still has the ids: an overwrite asks the old owner.
        let keys = self.requests[r as usize].ids.as_ref().map(PackedIds::keys);
        for key in keys.into_iter().flatten() {
            self.alias_insert(key, TAG_SOLO | i);
        }
        let req = &mut self.requests[r as usize];
        let ids = req.ids.take().unwrap_or_else(|| PackedIds::new(None, None));
        let last = req.last_ns;
        // Still the same live request: only its record goes.
        self.free_request(r);
        self.live_requests += 1;
        let at = &mut self.attempts[i as usize];
        at.request = RequestLink::solo(ids);
        at.last_ns = at.last_ns.max(last);
        self.stats.requests_adopted += 1;
    }

    /// Gives request `to` an id it was not known by (alias `key`). A second id of one kind (e.g.
    /// a new trace under one x-request-id) gets a stub record owning its alias, merged into it.
    pub(super) fn add_id(
        &mut self,
        to: RequestAt,
        trace: bool,
        key: u64,
        text: &str,
        time_ns: u64,
    ) -> RequestAt {
        let r = match to {
            RequestAt::Solo(i) => {
                let solo = self.attempts[i as usize].request.solo_ids().expect("solo");
                match solo.with(trace, text) {
                    Some(next) => {
                        self.attempts[i as usize].request = RequestLink::solo(next);
                        self.alias_insert(key, TAG_SOLO | i);
                        return to;
                    }
                    None => self.materialize(i),
                }
            }
            RequestAt::Record(r) => r,
        };
        if self.requests[r as usize].set_id(trace, text) {
            self.alias_insert(key, TAG_REQUEST | r);
        } else {
            let stub = self.new_request();
            self.requests[stub as usize].set_id(trace, text);
            self.requests[stub as usize].last_ns = time_ns;
            self.alias_insert(key, TAG_REQUEST | stub);
            self.union_requests(stub, r);
        }
        RequestAt::Record(r)
    }

    /// One request from two (the event names both): their records, merged.
    pub(super) fn join(&mut self, from: RequestAt, into: RequestAt) -> RequestAt {
        if from == into {
            return into;
        }
        let (from, into) = (self.record(from), self.record(into));
        RequestAt::Record(self.union_requests(from, into))
    }

    /// The record of a request (its union-find root), created for a solo one.
    pub(super) fn record(&mut self, at: RequestAt) -> u32 {
        match at {
            RequestAt::Solo(i) => self.materialize(i),
            RequestAt::Record(r) => self.find(r),
        }
    }

    /// Points an attempt without a request at record `r`; true if there was one to point.
    pub(super) fn link(&mut self, attempt: Option<AttemptAt>, r: u32) -> bool {
        match attempt {
            Some(AttemptAt::Live(i)) => {
                let at = &mut self.attempts[i as usize];
                at.request = RequestLink::record(r, self.union_epoch);
            }
            Some(AttemptAt::Tomb(seq)) => match self.tomb_index(seq) {
                Some(t) => self.tomb_mut(t).request = r,
                None => return false,
            },
            None => return false,
        }
        self.requests[r as usize].refs += 1;
        true
    }

    /// The record of attempt `a`'s request (its root), created if the request is solo; `None`
    /// when the attempt has no request. For what needs a record: a violation naming the request.
    pub fn request_record(&mut self, a: u32) -> Option<u32> {
        let at = &self.attempts[a as usize];
        if at.request.is_solo() {
            return Some(self.materialize(a));
        }
        match at.request.index() {
            NO_INDEX => None,
            r => Some(self.find(r)),
        }
    }

    /// [`Self::request_record`], and for an attempt no request id or trace id named yet, a
    /// record of its own: a request-scope trigger on it (a router failure that names only the
    /// room) must be kept for the request the attempt turns out to belong to.
    pub fn trigger_record(&mut self, a: u32, time_ns: u64) -> u32 {
        if let Some(r) = self.request_record(a) {
            return r;
        }
        self.stats.requests_created += 1;
        self.live_requests += 1;
        let r = self.new_request_record();
        self.requests[r as usize].last_ns = time_ns;
        self.link(Some(AttemptAt::Live(a)), r);
        r
    }

    /// Takes attempt `i`'s solo request ids, its aliases pointed at `to` first: an overwrite asks
    /// the old owner, so they move while the attempt still has the ids.
    pub(super) fn take_solo(&mut self, i: u32, to: u32) -> PackedIds {
        let keys = self.attempts[i as usize]
            .request
            .solo_ids()
            .expect("a solo request")
            .keys();
        for key in keys {
            self.alias_insert(key, to);
        }
        self.attempts[i as usize]
            .request
            .take_solo()
            .expect("a solo request")
    }

    /// Gives attempt `i`'s solo request a record: its aliases move there, and the attempt's
    /// history is folded into the record's request-scope slots, as linking the attempt would.
    pub(super) fn materialize(&mut self, i: u32) -> u32 {
        let r = self.new_request_record();
        let ids = self.take_solo(i, TAG_REQUEST | r);
        let at = &mut self.attempts[i as usize];
        at.request = RequestLink::record(r, self.union_epoch);
        let last = at.last_ns;
        let req = &mut self.requests[r as usize];
        req.ids = Some(ids);
        req.refs = 1;
        req.last_ns = last;
        for n in 0..self.request_links.len() {
            let (from, to) = self.request_links[n];
            let own = Candidates::of(
                &self.attempt_slots(i),
                from,
                self.attempt_rows.keeps()[from],
            );
            for &slot in own.iter() {
                self.fold_request_slots(r, 1 << to, slot);
            }
        }
        self.stats.requests_materialized += 1;
        r
    }

    /// A new request with a record from the start (request-level events, stubs).
    fn new_request(&mut self) -> u32 {
        self.live_requests += 1;
        self.stats.requests_created += 1;
        self.new_request_record()
    }

    /// A record for a request already counted (created solo, or just now by `new_request`).
    pub(super) fn new_request_record(&mut self) -> u32 {
        let fresh = Request {
            generation: 0,
            parent: NO_INDEX,
            refs: 0,
            live: true,
            last_ns: 0,
            fired: 0,
            ids: None,
        };
        match self.free_requests.pop() {
            Some(i) => {
                let generation = self.requests[i as usize].generation;
                self.requests[i as usize] = Request {
                    generation,
                    ..fresh
                };
                // Its slot row was cleared when it was freed.
                i
            }
            None => {
                self.request_slots.push(0);
                self.requests.push(fresh) as u32
            }
        }
    }

    /// Merges root `from` into root `into`: `from` becomes a forwarding stub.
    fn union_requests(&mut self, from: u32, into: u32) -> u32 {
        if from == into {
            return into;
        }
        // Cached roots may now be stubs.
        self.union_epoch += 1;
        if self.union_epoch == EPOCH_LIMIT {
            for a in self.attempts.iter_mut() {
                if a.request.index() != NO_INDEX {
                    a.request = RequestLink::record(a.request.index(), 0);
                }
            }
            self.union_epoch = 1;
        }
        let src = self.request_slots(from).to_vec();
        let mut dst = self.request_slots(into).to_vec();
        fold_all(&mut dst, &src, &self.request_keeps);
        let row = self.request_slots.item_mut(into as usize);
        row_store(row, &mut self.wide_requests, into, &dst);
        let (f, t) = (from as usize, into as usize);
        self.requests[f].parent = into;
        self.requests[t].refs += 1;
        self.requests[t].fired |= self.requests[f].fired;
        let fired = self.requests[f].fired;
        if fired != 0 {
            self.move_reported(Owner::Request(from), Owner::Request(into), fired);
        }
        // The merged request keeps the older pin when both have one (its alerts went out first).
        if let Some(p) = self.pinned_alias.remove(&from) {
            self.pinned_alias.entry(into).or_insert(p);
        }
        self.requests[t].last_ns = self.requests[t].last_ns.max(self.requests[f].last_ns);
        // The merged request shows the ids it lacks (the stub keeps owning their aliases).
        for trace in [false, true] {
            let from = &self.requests[f];
            let v = if trace {
                from.trace_id()
            } else {
                from.request_id()
            };
            if let Some(v) = v.map(str::to_owned) {
                self.requests[t].set_id(trace, &v);
            }
        }
        self.stats.requests_merged += 1;
        into
    }

    /// The request of attempt `i` was not touched by its events (cached root): bring its idle
    /// time up to date before the attempt stops holding it.
    pub(super) fn note_request_activity(&mut self, i: u32) {
        let at = &self.attempts[i as usize];
        if at.request.index() != NO_INDEX {
            let last = at.last_ns;
            let root = self.find(at.request.index());
            let req = &mut self.requests[root as usize];
            req.last_ns = req.last_ns.max(last);
        }
    }

    pub(super) fn free_request(&mut self, i: u32) {
        let r = &self.requests[i as usize];
        let keys = [
            r.request_id().map(|s| key_str(AliasKind::RequestId, s)),
            r.trace_id().map(|s| key_str(AliasKind::TraceId, s)),
        ];
        for k in keys.into_iter().flatten() {
            self.aliases.remove_if(k, TAG_REQUEST | i);
        }
        let parent = r.parent;
        let fired = r.fired;
        if parent != NO_INDEX {
            self.requests[parent as usize].refs -= 1;
        }
        if fired != 0 {
            self.drop_reported(Owner::Request(i), fired);
        }
        self.pinned_alias.remove(&i);
        let row = self.request_slots.item_mut(i as usize);
        row_clear(row, &mut self.wide_requests, i);
        let r = &mut self.requests[i as usize];
        r.live = false;
        r.parent = NO_INDEX;
        r.ids = None;
        r.generation = r.generation.wrapping_add(1);
        self.free_requests.push(i);
        self.live_requests -= 1;
    }
}
