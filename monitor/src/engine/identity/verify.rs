//! Alias verification: the alias table keeps only a fingerprint of each key, so every match is
//! confirmed by the owner its value names (does it really have this room, rid or id?).

use std::collections::HashMap;

use foldhash::fast::FixedState;

use super::attempt::{HAS_ROOM, LIVE, MORE_RIDS, RID_HEX, RID_TEXT};
use super::keys::{
    Alias, AliasKind, INDEX_MASK, Name, TAG_ATTEMPT, TAG_REQUEST, TAG_SOLO, TAG_TOMB, key_room,
    key_str, tag,
};
use super::{Attempt, Request, Rid, Store, Tombstone};
use crate::engine::mem::alias_table;
use crate::engine::mem::chunked::{Chunked, ChunkedQueue};

/// The common verification hits, inline: a live attempt by its room, or by its second rid (a
/// decode leg's). Every event pays this once or twice; false sends the caller to
/// [`Verifier::owns_slow`], which decides.
#[inline(always)]
fn owns_fast(attempts: &Chunked<Attempt>, v: u32, a: &Alias) -> bool {
    if tag(v) != TAG_ATTEMPT {
        return false;
    }
    let at = &attempts[v as usize];
    match a.name {
        Name::Room(r) => at.flags & (LIVE | HAS_ROOM) == LIVE | HAS_ROOM && at.room == r,
        Name::Rid(_) => at.flags & LIVE != 0 && at.rid2_key == a.key,
        _ => false,
    }
}

/// The records alias verification reads, borrowed apart from the alias table so that the table
/// can be probed mutably while owners are asked (see [`Store::aliases_and_verifier`]).
pub(super) struct Verifier<'a> {
    attempts: &'a Chunked<Attempt>,
    rid_texts: &'a HashMap<u32, Box<str>, FixedState>,
    more_rids: &'a HashMap<u32, Vec<u64>, FixedState>,
    requests: &'a Chunked<Request>,
    tombs: &'a ChunkedQueue<Tombstone>,
    tomb_base: u64,
}

impl Verifier<'_> {
    /// Whether the owner named by alias value `v` has alias `a`: the verification every
    /// fingerprint match goes through. A value of a tag with no arm in [`Self::owns_slow`] is
    /// never confirmed.
    #[inline(always)]
    pub(super) fn owns(&self, v: u32, a: &Alias) -> bool {
        owns_fast(self.attempts, v, a) || self.owns_slow(v, a)
    }

    #[inline(never)]
    fn owns_slow(&self, v: u32, a: &Alias) -> bool {
        match tag(v) {
            TAG_ATTEMPT => self.attempt_owns(v, a),
            TAG_TOMB => self
                .tomb_index(v)
                .is_some_and(|i| self.tombs.item(i)[0].key_lo == a.key as u32),
            TAG_REQUEST => self.request_owns(v & INDEX_MASK, a),
            TAG_SOLO => self.solo_owns(v & INDEX_MASK, a),
            _ => false,
        }
    }

    /// Index into the tombstone queue of the tombstone an alias value names, if it still
    /// exists. Values keep 30 bits of its sequence number; tombstones are capped well below
    /// 2^30 and stale entries are purged every `tombs.len()` drops, so the window decides
    /// unambiguously (and verification checks the key besides).
    pub(super) fn tomb_index(&self, v: u32) -> Option<usize> {
        let d = (v & INDEX_MASK).wrapping_sub(self.tomb_base as u32) & INDEX_MASK;
        ((d as usize) < self.tombs.len()).then_some(d as usize)
    }

    fn attempt_owns(&self, i: u32, a: &Alias) -> bool {
        let at = &self.attempts[i as usize];
        if !at.is_live() {
            return false;
        }
        // The common case first: the alias the lookup names is the attempt's room or first rid
        // (no hashing); keys recorded by hash are compared by hash.
        let named = match a.name {
            Name::Room(r) => at.room() == Some(r),
            Name::Rid(s) => at.rid2_key == a.key || self.rid_is_first(i, s),
            Name::RequestId(_) | Name::TraceId(_) => return false,
            Name::Key => {
                at.rid2_key == a.key
                    || at.room().map(key_room) == Some(a.key)
                    || self.first_rid_key(i) == Some(a.key)
            }
        };
        named
            || (at.flags & MORE_RIDS != 0
                && self.more_rids.get(&i).is_some_and(|m| m.contains(&a.key)))
    }

    /// Whether `rid` is the first rid of attempt `a` (without hashing it, for the hex form).
    pub(super) fn rid_is_first(&self, a: u32, rid: &str) -> bool {
        let at = &self.attempts[a as usize];
        if at.flags & RID_HEX != 0 {
            Rid::hex_is(rid, at.rid_hex)
        } else if at.flags & RID_TEXT != 0 {
            self.rid_texts.get(&a).is_some_and(|t| **t == *rid)
        } else {
            false
        }
    }

    /// The alias key of attempt `a`'s first rid (no allocation).
    pub(super) fn first_rid_key(&self, a: u32) -> Option<u64> {
        let at = &self.attempts[a as usize];
        if at.flags & RID_HEX != 0 {
            Rid::Hex(at.rid_hex).key()
        } else if at.flags & RID_TEXT != 0 {
            self.rid_texts.get(&a).map(|t| key_str(AliasKind::Rid, t))
        } else {
            None
        }
    }

    /// Whether live attempt `i` keeps a solo request named `a`.
    fn solo_owns(&self, i: u32, a: &Alias) -> bool {
        let at = &self.attempts[i as usize];
        match at.request.solo_ids().filter(|_| at.is_live()) {
            Some(ids) => ids_named(ids.request_id(), ids.trace_id(), a),
            None => false,
        }
    }

    fn request_owns(&self, r: u32, a: &Alias) -> bool {
        let req = &self.requests[r as usize];
        req.is_live() && ids_named(req.request_id(), req.trace_id(), a)
    }
}

/// Whether a request with these ids is named by alias `a` (texts compared, or keys by hash).
fn ids_named(request_id: Option<&str>, trace_id: Option<&str>, a: &Alias) -> bool {
    match a.name {
        Name::RequestId(s) => request_id == Some(s),
        Name::TraceId(s) => trace_id == Some(s),
        Name::Room(_) | Name::Rid(_) => false,
        Name::Key => {
            request_id.map(|s| key_str(AliasKind::RequestId, s)) == Some(a.key)
                || trace_id.map(|s| key_str(AliasKind::TraceId, s)) == Some(a.key)
        }
    }
}

/// [`Verifier`] borrowed from a [`Store`] field by field (a method borrowing the whole store
/// could not be used while the alias table is borrowed mutably).
macro_rules! verifier {
    ($store:expr) => {
        Verifier {
            attempts: &$store.attempts,
            rid_texts: &$store.rid_texts,
            more_rids: &$store.more_rids,
            requests: &$store.requests,
            tombs: &$store.tombs,
            tomb_base: $store.tomb_base,
        }
    };
}

impl Store {
    /// The records alias verification reads.
    pub(super) fn verifier(&self) -> Verifier<'_> {
        verifier!(self)
    }

    /// The alias table and, borrowed apart from it, the records its verification reads.
    fn aliases_and_verifier(&mut self) -> (&mut alias_table::Table, Verifier<'_>) {
        (&mut self.aliases, verifier!(self))
    }

    /// [`Verifier::owns`] for lookups, which borrow the store whole: the common hits without
    /// building a [`Verifier`] first.
    #[inline(always)]
    pub(super) fn owns(&self, v: u32, a: &Alias) -> bool {
        owns_fast(&self.attempts, v, a) || self.verifier().owns_slow(v, a)
    }

    /// The value of alias `a`, confirmed by the owner it names.
    #[inline]
    pub(super) fn alias_get(&self, a: &Alias) -> Option<u32> {
        self.aliases.find(a.key, |v| self.owns(v, a))
    }

    /// Points alias `key` at `val`; returns the value it had (the entry an owner confirmed).
    /// Only fingerprint matches are verified, rarely more than one bucket, so the key alone is
    /// enough here (owners compare it by hash).
    pub(super) fn alias_insert(&mut self, key: u64, val: u32) -> Option<u32> {
        let (table, verifier) = self.aliases_and_verifier();
        let a = Alias::key(key);
        table.insert(key, val, |v| verifier.owns(v, &a))
    }
}
