//! Compact per-attempt memory of the events rules care about.
//!
//! A rule never needs an attempt's full history: it needs "the earliest trigger" or "the latest
//! forbidden event". Each such need is a [`SlotSpec`]; the engine keeps one [`Slot`] per
//! spec per attempt, in one flat arena, so tracking an attempt costs no allocation.
//!
//! [`slot`] is one remembered event and how slots fold; [`spec`] what each slot tracks. A row of
//! slots is stored in one of three encodings against a shared time base: [`packed`] (dense),
//! [`sparse`] (tombstones: set slots only) and [`mapped`] (live attempts: distinct events once).
//! [`rows`] keeps live attempts' mapped rows in size classes, [`owner_row`] the dense rows of
//! records in a chunked table; [`Slots`] reads any of them.

pub mod mapped;
pub mod owner_row;
pub mod packed;
pub mod rows;
pub mod slot;
pub mod sparse;
pub mod spec;

pub use slot::{
    Candidates, Cell, Keep, NODE_LOCAL, NodeId, Slot, SlotEvent, SlotRead, fold_all, fold_each,
    fold_into, fold_specs_full,
};
pub use spec::{Hits, SlotLayout, SlotSpec, SpecIndex, matching_specs};

/// The fired bits a tombstone keeps: one per rule judged on tombstones (attempt-scope
/// `never_after` and `distinct` rules), compacted into one word.
pub type TombstoneFired = u32;

/// Tombstones keep the fired bits of the rules judged on them in one [`TombstoneFired`].
pub const MAX_TOMBSTONE_RULES: usize = TombstoneFired::BITS as usize;

/// One owner's slots as the checker reads them: a packed row, a mapped row of `n` slots, or
/// full slots for a wide one.
#[derive(Debug, Clone, Copy)]
pub enum Slots<'a> {
    Packed(&'a [u64]),
    Mapped { row: &'a [u64], n: u8 },
    Wide(&'a [Slot]),
}

impl Slots<'_> {
    #[inline(always)]
    pub fn get(&self, k: usize) -> Slot {
        match self {
            Slots::Packed(row) => packed::get(row, k),
            Slots::Mapped { row, n } => mapped::get(row, *n as usize, k),
            Slots::Wide(s) => s[k],
        }
    }

    pub fn to_vec(&self) -> Vec<Slot> {
        match self {
            Slots::Packed(row) => packed::unpack_row(row),
            Slots::Mapped { row, n } => mapped::decode(row, *n as usize),
            Slots::Wide(s) => s.to_vec(),
        }
    }
}

impl SlotRead for Slots<'_> {
    #[inline]
    fn slot(&self, k: usize) -> Slot {
        self.get(k)
    }

    /// On a packed row, without unpacking: an empty slot is a zero word.
    #[inline]
    fn any_set(&self, k: usize, keep: Keep) -> bool {
        match self {
            Slots::Packed(row) => row[1 + k] != 0 || (keep.is_pair() && row[2 + k] != 0),
            Slots::Mapped { row, .. } => {
                mapped::has(row, k) || (keep.is_pair() && mapped::has(row, k + 1))
            }
            Slots::Wide(s) => s.any_set(k, keep),
        }
    }
}
