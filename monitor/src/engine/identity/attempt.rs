//! One attempt's live record ([`Attempt`]) and what the store does with attempts: their slots,
//! aliases and first rid, creation, merging two that turned out to be one, and freeing.

use super::keys::{TAG_SOLO, key_room};
use super::{AttemptAt, Owner, RequestLink, Rid, Store};
use crate::engine::mem::NO_INDEX;
use crate::engine::state::rows::RowRef;
use crate::engine::state::{Slot, Slots, fold_all};

/// Live state of one attempt (88 bytes). Rule slots live in [`Store::attempt_rows`], found by
/// `slot_class`/`slot_row`.
///
/// Every alias key that points at the attempt is recorded here (room, first rid, a second rid)
/// or, beyond that, in [`Store::more_rids`], so that freeing the attempt removes all of them: an
/// alias left behind would hand a late event of this attempt to the next one reusing the record.
#[derive(Debug, Clone)]
pub struct Attempt {
    pub generation: u32,
    pub input_tokens: u32,
    /// Its request: a record, known to be a union-find root as of an epoch (while no union
    /// happened since, the record need not be read: one cache miss per event); or the ids of a
    /// request whose only attempt this is and which needed no record yet (no request-level
    /// trigger, no second attempt, no violation): the request's aliases then point here
    /// (`TAG_SOLO`), and its request-scope slots are this attempt's own. Most requests never
    /// need more, and a record with its slots costs ~90 bytes.
    pub(super) request: RequestLink,
    /// The bootstrap room, when `flags` has `HAS_ROOM` (no `Option`: it would cost 8 bytes).
    pub(super) room: u64,
    /// The first rid when it is SGLang-shaped (`RID_HEX`); other rids (`RID_TEXT`) keep their
    /// text in [`Store::rid_texts`].
    pub(super) rid_hex: [u64; 2],
    /// Alias key of a second rid (0 = none), e.g. the decode leg's when it differs from prefill's.
    pub(super) rid2_key: u64,
    pub last_ns: u64,
    /// Earliest pending deadline in the timer queue (0 = none); compaction waits for it.
    pub due_ns: u64,
    /// Bit per compiled rule that already produced a violation for this attempt.
    pub fired: u64,
    /// Per stage, the worker (or node) of the latest event naming one, as the checker's interned
    /// worker id (0 = none): keys capacity look-ups when a predicate is judged again later.
    pub worker_keys: [u16; 4],
    /// Bit per stage: a leg started (received/admitted/work) / ended (terminal kind).
    pub legs_open: u8,
    pub legs_closed: u8,
    pub(super) flags: u8,
    /// Where its slot row is ([`RowRef`] as two fields: they fill the record's tail padding).
    pub(super) slot_class: u8,
    pub(super) slot_row: u32,
}

pub(super) const LIVE: u8 = 1;
/// A predicate asked to be judged again (new facts); keeps the attempt live until it is.
pub(super) const REJUDGE: u8 = 2;
pub(super) const HAS_ROOM: u8 = 4;
pub(super) const RID_HEX: u8 = 8;
pub(super) const RID_TEXT: u8 = 16;
/// More alias keys than `rid2_key` holds: the rest are in `Store::more_rids`.
pub(super) const MORE_RIDS: u8 = 32;

impl Attempt {
    pub fn ended(&self) -> bool {
        self.legs_closed != 0 && self.legs_open & !self.legs_closed == 0
    }
    pub fn is_live(&self) -> bool {
        self.flags & LIVE != 0
    }
    pub fn rejudge(&self) -> bool {
        self.flags & REJUDGE != 0
    }
    pub fn set_rejudge(&mut self, on: bool) {
        if on {
            self.flags |= REJUDGE;
        } else {
            self.flags &= !REJUDGE;
        }
    }
    pub fn room(&self) -> Option<u64> {
        (self.flags & HAS_ROOM != 0).then_some(self.room)
    }
    pub(super) fn set_room(&mut self, room: u64) {
        self.room = room;
        self.flags |= HAS_ROOM;
    }
    pub(super) fn has_rid(&self) -> bool {
        self.flags & (RID_HEX | RID_TEXT) != 0
    }
    #[inline]
    pub(super) fn row(&self) -> RowRef {
        RowRef {
            class: self.slot_class,
            index: self.slot_row,
        }
    }
    #[inline]
    fn set_row(&mut self, r: RowRef) {
        self.slot_class = r.class;
        self.slot_row = r.index;
    }
}

impl Store {
    /// Inline always: the checker reads an attempt's slots several times per event and per
    /// deadline, and the row's class and encoding tests fold into the caller.
    #[inline(always)]
    pub fn attempt_slots(&self, a: u32) -> Slots<'_> {
        self.attempt_rows.view(self.attempts[a as usize].row(), a)
    }
    /// Folds `slot` into every spec of attempt `a` whose bit is set in `specs`; returns the
    /// specs whose slots changed.
    #[inline]
    pub fn fold_attempt_slots(&mut self, a: u32, specs: u64, slot: Slot) -> u64 {
        let at = &mut self.attempts[a as usize];
        let mut r = at.row();
        let changed = self.attempt_rows.fold(&mut r, a, specs, slot);
        at.set_row(r);
        changed
    }

    pub fn reason(&self, a: u32) -> Option<&str> {
        self.reasons.get(&a).map(|r| &**r)
    }
    pub fn set_reason_once(&mut self, a: u32, reason: &str) {
        self.reasons.entry(a).or_insert_with(|| reason.into());
    }

    /// The first rid attempt `a` was seen with.
    pub fn attempt_rid(&self, a: u32) -> Rid {
        let at = &self.attempts[a as usize];
        if at.flags & RID_HEX != 0 {
            Rid::Hex(at.rid_hex)
        } else if at.flags & RID_TEXT != 0 {
            self.rid_texts
                .get(&a)
                .map_or(Rid::None, |t| Rid::Text(t.clone()))
        } else {
            Rid::None
        }
    }

    pub(super) fn set_first_rid(&mut self, a: u32, rid: Rid) {
        let at = &mut self.attempts[a as usize];
        match rid {
            Rid::None => {}
            Rid::Hex(h) => {
                at.rid_hex = h;
                at.flags |= RID_HEX;
            }
            Rid::Text(t) => {
                at.flags |= RID_TEXT;
                self.rid_texts.insert(a, t);
            }
        }
    }

    /// Records that alias `key` (pointing at attempt `a`) belongs to it, unless it is its room's
    /// or first rid's key, which are recorded already. `maybe_first`: `key` may be the first
    /// rid's (false when the caller knows the rid differs: it saves rebuilding that rid's text).
    pub(super) fn own_alias(&mut self, a: u32, key: u64, maybe_first: bool) {
        let at = &self.attempts[a as usize];
        if at.room().map(key_room) == Some(key) || at.rid2_key == key {
            return;
        }
        if maybe_first && self.verifier().first_rid_key(a) == Some(key) {
            return;
        }
        let at = &mut self.attempts[a as usize];
        if at.rid2_key == 0 {
            at.rid2_key = key;
            return;
        }
        at.flags |= MORE_RIDS;
        let more = self.more_rids.entry(a).or_default();
        if !more.contains(&key) {
            more.push(key);
        }
    }

    /// Every alias key attempt `a` owns: room, first rid, second rid (no allocation: this runs
    /// for every attempt freed), then any further ones.
    fn attempt_keys(&self, a: u32) -> impl Iterator<Item = u64> + use<> {
        let at = &self.attempts[a as usize];
        let inline = [
            at.room().map(key_room),
            self.verifier().first_rid_key(a),
            (at.rid2_key != 0).then_some(at.rid2_key),
        ];
        let more = match at.flags & MORE_RIDS {
            0 => None,
            _ => self.more_rids.get(&a).cloned(),
        };
        inline
            .into_iter()
            .flatten()
            .chain(more.into_iter().flatten())
    }

    pub(super) fn new_attempt(
        &mut self,
        room: Option<u64>,
        rid: Rid,
        room_key: Option<u64>,
        rid_key: Option<u64>,
    ) -> u32 {
        if self.live_attempts >= self.limits.max_attempts {
            self.evict_one_attempt();
        }
        let fresh = Attempt {
            generation: 0,
            request: RequestLink::NONE,
            input_tokens: 0,
            room: room.unwrap_or(0),
            rid_hex: [0; 2],
            rid2_key: 0,
            last_ns: 0,
            due_ns: 0,
            fired: 0,
            worker_keys: [0; 4],
            legs_open: 0,
            legs_closed: 0,
            flags: LIVE | if room.is_some() { HAS_ROOM } else { 0 },
            slot_class: RowRef::NONE.class,
            slot_row: RowRef::NONE.index,
        };
        let i = match self.free_attempts.pop() {
            Some(i) => {
                let generation = self.attempts[i as usize].generation;
                self.attempts[i as usize] = Attempt {
                    generation,
                    ..fresh
                };
                // Its slot row was freed with it.
                i
            }
            None => self.attempts.push(fresh) as u32,
        };
        self.set_first_rid(i, rid);
        for k in [room_key, rid_key].into_iter().flatten() {
            self.alias_insert(k, i);
        }
        self.live_attempts += 1;
        self.stats.attempts_created += 1;
        i
    }

    /// Two attempts turned out to be one (a rid first seen alone, then with its room).
    pub(super) fn merge_attempts(&mut self, a: AttemptAt, b: AttemptAt) -> AttemptAt {
        let (AttemptAt::Live(x), AttemptAt::Live(y)) = (a, b) else {
            // A live attempt and a tombstone: keep the live one; the tombstone expires on its own.
            return if matches!(b, AttemptAt::Live(_)) {
                b
            } else {
                a
            };
        };
        let (rx, ry) = (
            self.attempts[x as usize].room(),
            self.attempts[y as usize].room(),
        );
        if rx.is_some() && ry.is_some() && rx != ry {
            self.stats.alias_conflicts += 1;
            return a; // `a` was found by the event's room: the room decides
        }
        if self.attempts[y as usize].request.is_solo() {
            let xa = &self.attempts[x as usize];
            if xa.request.is_none() {
                // `x` takes over `y`'s request, still solo.
                let ids = self.take_solo(y, TAG_SOLO | x);
                self.attempts[x as usize].request = RequestLink::solo(ids);
            } else {
                self.materialize(y);
            }
        }
        let src = self.attempt_slots(y).to_vec();
        let mut dst = self.attempt_slots(x).to_vec();
        fold_all(&mut dst, &src, self.attempt_rows.keeps());
        let at = &mut self.attempts[x as usize];
        let mut r = at.row();
        self.attempt_rows.store(&mut r, x, &dst);
        at.set_row(r);
        let ya = self.attempts[y as usize].clone();
        let y_keys: Vec<u64> = self.attempt_keys(y).collect();
        let y_rid = self.attempt_rid(y);
        if !self.attempts[x as usize].has_rid() {
            self.set_first_rid(x, y_rid);
        }
        let xa = &mut self.attempts[x as usize];
        if let (None, Some(room)) = (xa.room(), ya.room()) {
            xa.set_room(room);
        }
        xa.last_ns = xa.last_ns.max(ya.last_ns);
        xa.input_tokens = xa.input_tokens.max(ya.input_tokens);
        xa.legs_open |= ya.legs_open;
        xa.legs_closed |= ya.legs_closed;
        xa.fired |= ya.fired;
        xa.due_ns = match (xa.due_ns, ya.due_ns) {
            (0, d) | (d, 0) => d,
            (p, q) => p.min(q),
        };
        if xa.request.index() == NO_INDEX && ya.request.index() != NO_INDEX {
            xa.request = RequestLink::record(ya.request.index(), 0);
            self.requests[ya.request.index() as usize].refs += 1;
        }
        if let Some(r) = self.reasons.remove(&y) {
            self.reasons.entry(x).or_insert(r);
        }
        if ya.fired != 0 {
            self.move_reported(Owner::Attempt(y), Owner::Attempt(x), ya.fired);
        }
        self.free_attempt(y);
        for k in y_keys {
            self.alias_insert(k, x);
            self.own_alias(x, k, true);
        }
        self.stats.attempts_merged += 1;
        a
    }

    /// Forgets live attempt `i` entirely (its aliases, its request reference).
    pub(super) fn free_attempt(&mut self, i: u32) {
        if self.attempts[i as usize].request.is_solo() {
            // The request outlives the attempt (retention): it needs a record.
            self.materialize(i);
        }
        self.note_request_activity(i);
        for k in self.attempt_keys(i) {
            self.aliases.remove_if(k, i);
        }
        let at = &self.attempts[i as usize];
        let request = at.request.index();
        let fired = at.fired;
        if request != NO_INDEX {
            self.requests[request as usize].refs -= 1;
        }
        if fired != 0 {
            self.drop_reported(Owner::Attempt(i), fired);
        }
        let at = &mut self.attempts[i as usize];
        if at.flags & RID_TEXT != 0 {
            self.rid_texts.remove(&i);
        }
        if at.flags & MORE_RIDS != 0 {
            self.more_rids.remove(&i);
        }
        at.flags = 0;
        at.rid2_key = 0;
        let mut r = at.row();
        self.attempt_rows.clear(&mut r, i);
        at.set_row(r);
        at.request = RequestLink::NONE;
        at.generation = at.generation.wrapping_add(1);
        self.reasons.remove(&i);
        self.free_attempts.push(i);
        self.live_attempts -= 1;
    }
}
