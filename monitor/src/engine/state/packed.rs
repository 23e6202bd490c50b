//! Slots as stored: 8 bytes each, the time relative to a base shared by one owner's row.
//!
//! A row is `1 + n` words: the base (ns), then the packed slots. A packed slot holds the
//! time's offset from the base in 39 bits (9 min 9 s), the slot's tag (stage, kind + 1, source,
//! node: 15 bits, so a set slot is never 0) and the status in 10 bits. An owner's events span
//! far less than the window, so one base serves; when an event does not fit, the row is
//! re-based around its slots, and a row that cannot be (an attempt spanning more than the
//! window, a status above 1023) is [`WIDE`]: its owner keeps full slots elsewhere.
//! Full 12-byte slots, 13 per attempt, would be a third of an attempt's memory.

use super::slot::{KeepMasks, OCCUPIED, fold_each_split};
use super::{Cell, Keep, NodeId, Slot, SlotLayout, fold_each};

/// The base word of a row whose slots are kept unpacked by its owner.
pub const WIDE: u64 = u64::MAX;
const OFFSET_BITS: u32 = 39;
const WINDOW: u64 = 1 << OFFSET_BITS;
const OFFSET_MASK: u64 = WINDOW - 1;
/// A new base sits this far before the earliest slot, so that events arriving out of order
/// (up to about a minute earlier) still fit without re-basing.
const MARGIN: u64 = 1 << 36;
const KIND_ONE: u16 = 1 << 2;
const STATUS_MAX: u16 = (1 << 10) - 1;

/// The row is full-width slots elsewhere: the event could not be packed against any base.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unpackable;

const NODE_SHIFT: u32 = OFFSET_BITS + 8;

/// A packed slot as a foldable cell: offsets from one base order like times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub(super) struct Word(pub(super) u64);

impl Cell for Word {
    #[inline]
    fn is_set(&self) -> bool {
        self.0 != 0
    }
    #[inline]
    fn order(&self) -> u64 {
        self.0 & OFFSET_MASK
    }
    #[inline]
    fn node(&self) -> NodeId {
        ((self.0 >> NODE_SHIFT) & 0x7f) as NodeId
    }
}

#[inline]
pub(super) fn pack(s: Slot, base: u64) -> Option<u64> {
    if !s.is_set() {
        return Some(0);
    }
    let t = s.time();
    if t < base || t - base >= WINDOW || s.status > STATUS_MAX {
        return None;
    }
    // Kind + 1: a set slot at offset 0 of stage, kind, source and node 0 is not word 0.
    let tag = (s.tag & !OCCUPIED) + KIND_ONE;
    Some((t - base) | (tag as u64) << OFFSET_BITS | (s.status as u64) << 54)
}

pub(super) fn unpack(w: u64, base: u64) -> Slot {
    if w == 0 {
        return Slot::EMPTY;
    }
    let t = base + (w & OFFSET_MASK);
    let tag = ((w >> OFFSET_BITS) as u16 & 0x7fff) - KIND_ONE;
    Slot {
        time_lo: t as u32,
        time_hi: (t >> 32) as u32,
        tag: tag | OCCUPIED,
        status: (w >> 54) as u16,
    }
}

/// Slot `k` of a packed row (not [`WIDE`]).
#[inline]
pub fn get(row: &[u64], k: usize) -> Slot {
    unpack(row[1 + k], row[0])
}

/// Every slot of a packed row, unpacked.
pub fn unpack_row(row: &[u64]) -> Vec<Slot> {
    (0..row.len() - 1).map(|k| get(row, k)).collect()
}

/// A base that fits every set slot of `slots`, a multiple of `1 << align_bits` ns (`None`:
/// no slot is set, any base does).
pub(super) fn base_for(slots: &[Slot], align_bits: u32) -> Result<Option<u64>, Unpackable> {
    let set = slots.iter().filter(|s| s.is_set());
    let (lo, hi) = set.fold((u64::MAX, 0), |(lo, hi), s| {
        (lo.min(s.time()), hi.max(s.time()))
    });
    if lo > hi {
        return Ok(None);
    }
    let align = (1u64 << align_bits) - 1;
    if hi - lo + align >= WINDOW {
        return Err(Unpackable);
    }
    // As much margin before the earliest slot as the span (and the rounding) leaves.
    let margin = MARGIN.min(WINDOW - 1 - (hi - lo) - align).min(lo);
    Ok(Some((lo - margin) & !align))
}

/// Stores `slots` into `row` under a base that fits them all; `Unpackable` (row unchanged)
/// when none does.
pub fn store_row(row: &mut [u64], slots: &[Slot]) -> Result<(), Unpackable> {
    let base = base_for(slots, 0)?.unwrap_or(row[0]);
    let mut packed = [0u64; SlotLayout::MAX];
    for (k, s) in slots.iter().enumerate() {
        packed[k] = pack(*s, base).ok_or(Unpackable)?;
    }
    row[0] = base;
    row[1..].copy_from_slice(&packed[..slots.len()]);
    Ok(())
}

/// [`fold_each`] on a packed row for every spec whose bit is set in `specs` (`keep` gives
/// each spec's keep): the row is looked at, and `new` packed, once. Re-bases the row when
/// `new` does not fit its base; `Unpackable` (row unchanged) when no base fits. Returns the
/// specs whose slots changed.
#[inline]
pub fn fold_specs(
    row: &mut [u64],
    specs: u64,
    keep: impl Fn(usize) -> Keep,
    new: Slot,
) -> Result<u64, Unpackable> {
    fold_specs_split(row, specs, KeepMasks::NONE, keep, new)
}

/// [`fold_specs`], folding the single-slot specs of `masks` (those of `keep`) without
/// dispatching on their keep ([`fold_each_split`]).
#[inline]
pub fn fold_specs_split(
    row: &mut [u64],
    specs: u64,
    masks: KeepMasks,
    keep: impl Fn(usize) -> Keep,
    new: Slot,
) -> Result<u64, Unpackable> {
    if !new.is_set() || specs == 0 {
        return Ok(0);
    }
    let w = match pack(new, row[0]) {
        Some(w) => w,
        // A fresh row (its first event): no slot to move, only the base to set.
        None if row.iter().all(|&w| w == 0) => {
            row[0] = base_for(std::slice::from_ref(&new), 0)?.expect("`new` is set");
            pack(new, row[0]).expect("fits its own base")
        }
        None => {
            let mut all = unpack_row(row);
            let changed = fold_each(&mut all, specs, keep, new);
            store_row(row, &all)?;
            return Ok(changed);
        }
    };
    // SAFETY: `Word` is `repr(transparent)` over `u64`.
    let cells = unsafe { &mut *(&mut row[1..] as *mut [u64] as *mut [Word]) };
    Ok(fold_each_split(cells, specs, masks, keep, Word(w)))
}

/// [`fold_specs`] for the one spec `k`: true if its slot(s) changed (the tests' handle).
#[cfg(test)]
pub fn fold(row: &mut [u64], k: usize, keep: Keep, new: Slot) -> Result<bool, Unpackable> {
    if keep == Keep::PairTail {
        return Ok(false);
    }
    fold_specs(row, 1 << k, |_| keep, new).map(|changed| changed != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::state::Slots;
    use crate::event::{Kind, LifecycleEvent, Source, Stage};

    #[test]
    fn packed_rows_round_trip_rebase_and_refuse_what_does_not_fit() {
        const S: u64 = 1_000_000_000;
        let t0 = 1_795_986_920 * S;
        let at = |t: u64, kind, status: Option<u16>, node| {
            let mut e = LifecycleEvent::new(t, Stage::Decode, kind, Source::Ebpf);
            e.status = status;
            Slot::from_event(&e, node)
        };
        let mut row = [0u64; 5];
        // A fresh row (base 0) takes any time by re-basing; stage/kind/source/node 0 at the base
        // itself is still a set slot.
        let first = Slot::from_event(
            &LifecycleEvent::new(t0, Stage::Router, Kind::ALL[0], Source::ALL[0]),
            0,
        );
        assert_eq!(fold(&mut row, 0, Keep::Earliest, first), Ok(true));
        assert_eq!(get(&row, 0), first);
        assert!(get(&row, 0).is_set() && !get(&row, 1).is_set());
        // Out of order, a minute earlier: fits the margin; keeps the earliest.
        let early = at(t0 - 60 * S, Kind::Work, Some(503), 7);
        assert_eq!(fold(&mut row, 0, Keep::Earliest, early), Ok(true));
        assert_eq!(get(&row, 0), early);
        // Eight minutes later: re-based, nothing lost.
        let late = at(t0 + 8 * 60 * S, Kind::Completed, Some(200), 3);
        assert_eq!(fold(&mut row, 1, Keep::Latest, late), Ok(true));
        assert_eq!((get(&row, 0), get(&row, 1)), (early, late));
        // Per-node pairs through the packed form.
        let a = at(t0 + S, Kind::Work, None, 1);
        let b = at(t0 + 2 * S, Kind::Work, None, 2);
        fold(&mut row, 2, Keep::LatestPerNode, a).unwrap();
        fold(&mut row, 2, Keep::LatestPerNode, b).unwrap();
        assert_eq!((get(&row, 2), get(&row, 3)), (a, b));
        // A span past the window, or a status past 10 bits, leaves the row as it was.
        let before = row;
        let far = at(t0 + 20 * 60 * S, Kind::Work, None, 0);
        assert_eq!(fold(&mut row, 1, Keep::Latest, far), Err(Unpackable));
        let odd = at(t0 + 8 * 60 * S + 1, Kind::Completed, Some(1024), 0);
        assert_eq!(fold(&mut row, 1, Keep::Latest, odd), Err(Unpackable));
        assert_eq!(row, before);
        // ... unless it would not be kept anyway.
        let older = at(t0, Kind::Completed, Some(1024), 0);
        assert_eq!(fold(&mut row, 1, Keep::Latest, older), Ok(false));
        let slots = unpack_row(&row);
        assert_eq!(slots, vec![early, late, a, b]);
        assert_eq!(Slots::Packed(&row).to_vec(), slots);
    }
}
