//! What is left of a finished attempt ([`Tombstone`]): a queue of small records with sparse slot
//! rows beside them, compaction of a live attempt into one, and expiry.

use super::keys::{INDEX_MASK, TAG_TOMB, key_room, tag};
use super::{Owner, RequestLink, Store};
use crate::engine::mem::NO_INDEX;
use crate::engine::mem::bits::{compress_bits, expand_bits};
use crate::engine::state::{Slot, SlotLayout, packed, sparse};

/// What is left of a finished attempt: enough to catch late activity on a rejected attempt.
#[derive(Debug, Clone, Copy)]
pub struct Tombstone {
    pub request: u32,
    /// Whole seconds of event time after which the tombstone is dropped.
    pub expires_s: u32,
    /// The attempt's fired bits of the rules judged on tombstones, compacted (see
    /// [`Store::tomb_fired`]), so late repeats do not fire again.
    pub(super) fired: crate::engine::state::TombstoneFired,
    /// Where its sparse slot row starts in the word queue (an absolute word index, wrapping).
    pub(super) row_at: u32,
    /// The low half of its primary alias's key (the alias table's fingerprint is the high
    /// half): how an alias entry naming this tombstone is verified.
    pub(super) key_lo: u32,
}

/// Whether tombstone alias value `v` names a tombstone still queued (`base`: the low bits of the
/// first one's sequence number; `len`: how many are queued).
pub(super) fn tomb_alive(v: u32, base: u32, len: usize) -> bool {
    (((v & INDEX_MASK).wrapping_sub(base) & INDEX_MASK) as usize) < len
}

impl Store {
    /// Index into the tombstone queue of tombstone `seq`, if it still exists.
    pub fn tomb_index(&self, seq: u64) -> Option<usize> {
        let i = seq.checked_sub(self.tomb_base)? as usize;
        (i < self.tombs.len()).then_some(i)
    }
    pub fn tomb(&self, i: usize) -> &Tombstone {
        &self.tombs.item(i)[0]
    }
    pub fn tomb_mut(&mut self, i: usize) -> &mut Tombstone {
        &mut self.tombs.item_mut(i)[0]
    }
    /// Fired bits (as in [`super::Attempt::fired`]) of tombstone `i`, for the rules judged on it.
    pub fn tomb_fired(&self, i: usize) -> u64 {
        expand_bits(self.tomb_rule_mask, self.tomb(i).fired)
    }
    pub fn add_tomb_fired(&mut self, i: usize, bits: u64) {
        let add = compress_bits(self.tomb_rule_mask, bits);
        self.tomb_mut(i).fired |= add;
    }

    /// Queue position of tombstone `i`'s row header.
    fn tomb_row(&self, i: usize) -> usize {
        self.tomb(i)
            .row_at
            .wrapping_sub(self.tomb_words_base as u32) as usize
    }

    /// A copy of tombstone `i`'s kept slots, in `tomb_slot_map` order.
    pub fn tomb_slots_of(&self, i: usize) -> Vec<Slot> {
        let at = self.tomb_row(i);
        let header = self.tomb_slots.item(at)[0];
        if header == packed::WIDE {
            let seq = self.tomb_base + i as u64;
            return self
                .wide_tombs
                .get(&seq)
                .expect("a wide row keeps its slots")
                .to_vec();
        }
        let n = self.tomb_slot_map.len();
        let words: Vec<u64> = (at..at + sparse::len(header, n))
            .map(|j| self.tomb_slots.item(j)[0])
            .collect();
        sparse::decode(&words, n)
    }

    /// Replaces tombstone `i`'s kept slots. In place when the same slots are set (and fit);
    /// otherwise (a late event set an empty one) the row moves to the wide side table.
    pub fn set_tomb_slots(&mut self, i: usize, slots: &[Slot]) {
        let seq = self.tomb_base + i as u64;
        let n = self.tomb_slot_map.len();
        let at = self.tomb_row(i);
        let header = self.tomb_slots.item(at)[0];
        if header != packed::WIDE {
            let mut buf = [0u64; 1 + SlotLayout::MAX];
            if let Ok(len) = sparse::encode(&slots[..n], &mut buf)
                && len == sparse::len(header, n)
            {
                for (j, w) in buf[..len].iter().enumerate() {
                    self.tomb_slots.item_mut(at + j)[0] = *w;
                }
                return;
            }
            self.tomb_slots.item_mut(at)[0] = packed::WIDE;
        }
        self.wide_tombs.insert(seq, slots[..n].into());
    }
    pub fn tomb_slot_map(&self) -> &[usize] {
        &self.tomb_slot_map
    }

    /// Shrinks live attempt `i` to a tombstone indexed by its primary alias (room, else rid).
    pub fn compact(&mut self, i: u32, watermark_ns: u64) {
        if self.tombs.len() >= self.limits.max_tombstones {
            self.pop_tomb();
            self.stats.tombstones_evicted_cap += 1;
        }
        if self.attempts[i as usize].request.is_solo() {
            // The tombstone keeps the request for late activity: it needs a record.
            self.materialize(i);
        }
        let at = &self.attempts[i as usize];
        let key = at
            .room()
            .map(key_room)
            .or_else(|| self.verifier().first_rid_key(i));
        // Saturating: a watermark near the end of time (a clock gone wrong) must not overflow.
        let expires_s = ((watermark_ns.saturating_add(self.limits.retention_ns)) / 1_000_000_000)
            .min(u32::MAX as u64) as u32;
        let expires_s = expires_s.saturating_add(1);
        let fired = at.fired;
        let tomb = Tombstone {
            request: at.request.index(),
            expires_s,
            fired: compress_bits(self.tomb_rule_mask, fired),
            row_at: (self.tomb_words_base + self.tomb_slots.len() as u64) as u32,
            key_lo: key.unwrap_or(0) as u32,
        };
        let kept = self.attempt_slots(i);
        let mut buf = [Slot::EMPTY; SlotLayout::MAX];
        for (j, &k) in self.tomb_slot_map.iter().enumerate() {
            buf[j] = kept.get(k);
        }
        let n = self.tomb_slot_map.len();
        let seq = self.tomb_base + self.tombs.len() as u64;
        let mut row = [0u64; 1 + SlotLayout::MAX];
        let len = match sparse::encode(&buf[..n], &mut row) {
            Ok(len) => len,
            Err(packed::Unpackable) => {
                self.wide_tombs.insert(seq, buf[..n].into());
                row[0] = packed::WIDE;
                1
            }
        };
        for w in &row[..len] {
            self.tomb_slots.push_back(std::slice::from_ref(w));
        }
        self.tombs.push_back(&[tomb]);
        if fired != 0 {
            self.move_reported(Owner::Attempt(i), Owner::Tomb(seq), fired);
        }
        // The tombstone inherits the request reference: take it away before freeing.
        self.note_request_activity(i);
        self.attempts[i as usize].request = RequestLink::NONE;
        self.free_attempt(i);
        if let Some(key) = key {
            let val = TAG_TOMB | (seq as u32 & INDEX_MASK);
            if self
                .alias_insert(key, val)
                .is_some_and(|old| tag(old) == TAG_TOMB)
            {
                self.tomb_alias_stale = self.tomb_alias_stale.saturating_sub(1);
            }
        }
    }

    pub(super) fn pop_tomb(&mut self) {
        if self.tombs.is_empty() {
            return;
        }
        let t = *self.tomb(0);
        let words = if self.tombs.len() > 1 {
            self.tomb(1).row_at.wrapping_sub(t.row_at) as usize
        } else {
            self.tomb_slots.len()
        };
        if self.tomb_slots.item(0)[0] == packed::WIDE {
            self.wide_tombs.remove(&self.tomb_base);
        }
        self.tombs.pop_front();
        for _ in 0..words {
            self.tomb_slots.pop_front();
        }
        self.tomb_words_base += words as u64;
        if t.request != NO_INDEX {
            self.requests[t.request as usize].refs -= 1;
        }
        if t.fired != 0 {
            let fired = expand_bits(self.tomb_rule_mask, t.fired);
            self.drop_reported(Owner::Tomb(self.tomb_base), fired);
        }
        self.tomb_base += 1;
        self.tomb_alias_stale += 1;
        if self.tomb_alias_stale > 1024 && self.tomb_alias_stale > self.tombs.len() {
            let (base, len) = (self.tomb_base as u32, self.tombs.len());
            self.aliases
                .retain(|v| tag(v) != TAG_TOMB || tomb_alive(v, base, len));
            self.tomb_alias_stale = 0;
        }
    }

    /// Heap bytes held by the tombstone tables (capacity-based: what is really reserved).
    pub fn tombstone_bytes(&self) -> usize {
        // The alias table is shared: tombstones are charged their share of its entries.
        let alias_share = if self.aliases.is_empty() {
            0
        } else {
            self.aliases.capacity_bytes() * self.tombs.len().min(self.aliases.len())
                / self.aliases.len()
        };
        self.tombs.capacity_bytes() + self.tomb_slots.capacity_bytes() + alias_share
    }
}
