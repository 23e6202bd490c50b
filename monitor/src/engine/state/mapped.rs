//! Mapped packed rows, for live attempts: only the distinct events an attempt's slots remember
//! are stored. Most slots stay empty (the rules an attempt's events never reach), and rules
//! overlap: one admission is the earliest of one spec and the latest of another, a lone
//! completion both the earliest and the latest. A row is the base word, a map word with a
//! 4-bit word index per slot (0: empty) and the number of words in its top nibble, then the
//! packed words (index `i` at `row[1 + i]`). Rows of more than [`MAPPED_MAX`] slots are dense.
//!
//! Folding appends a word, or overwrites one no other slot refers to; a word no slot refers to
//! any more stays until the row is full, when [`compact`] drops it.

use super::packed::{Unpackable, Word, base_for, pack, unpack};
use super::{Cell, Keep, Slot, fold_into};

/// Slots a map word indexes (its top nibble is the word count).
pub const MAPPED_MAX: usize = 15;
/// Words a row of `n` slots may need: base, map, one per slot.
pub const fn max_len(n: usize) -> usize {
    2 + n
}
const ONES: u64 = 0x1111_1111_1111_1111;
const COUNT_SHIFT: u32 = 60;

#[inline]
fn index(map: u64, k: usize) -> usize {
    (map >> (4 * k) & 0xf) as usize
}

#[inline]
fn with_index(map: u64, k: usize, i: usize) -> u64 {
    map & !(0xf << (4 * k)) | (i as u64) << (4 * k)
}

/// Words the row with map `map` uses (base and map included).
#[inline]
pub fn len(map: u64) -> usize {
    2 + (map >> COUNT_SHIFT) as usize
}

/// Whether a slot other than `k` refers to word `i` (a SWAR search for its nibble).
#[inline]
fn shared(map: u64, k: usize, i: usize) -> bool {
    let x = (map ^ (i as u64).wrapping_mul(ONES)) | 0xf << (4 * k) | 0xf << COUNT_SHIFT;
    // A zero nibble is another slot pointing at `i`; the classic has-zero test is exact
    // about whether there is one.
    x.wrapping_sub(ONES) & !x & (ONES << 3) != 0
}

/// Whether slot `k` remembers an event.
#[inline]
pub fn has(row: &[u64], k: usize) -> bool {
    index(row[1], k) != 0
}

/// Slot `k` of a mapped row.
#[inline]
pub fn get(row: &[u64], k: usize) -> Slot {
    match index(row[1], k) {
        0 => Slot::EMPTY,
        i => unpack(row[1 + i], row[0]),
    }
}

/// The `n` slots of a mapped row.
pub fn decode(row: &[u64], n: usize) -> Vec<Slot> {
    (0..n).map(|k| get(row, k)).collect()
}

/// Encodes `slots` (at most [`MAPPED_MAX`]) into `out`, equal words once; returns the
/// number of words used.
pub fn encode(slots: &[Slot], out: &mut [u64]) -> Result<usize, Unpackable> {
    encode_at(slots, base_for(slots, 0)?.unwrap_or(0), out)
}

/// [`encode`] under the base `base`.
fn encode_at(slots: &[Slot], base: u64, out: &mut [u64]) -> Result<usize, Unpackable> {
    debug_assert!(slots.len() <= MAPPED_MAX);
    let mut map = 0u64;
    let mut count = 0;
    for (k, s) in slots.iter().enumerate() {
        if !s.is_set() {
            continue;
        }
        let w = pack(*s, base).ok_or(Unpackable)?;
        let i = match out[2..2 + count].iter().position(|&x| x == w) {
            Some(j) => j + 1,
            None => {
                out[2 + count] = w;
                count += 1;
                count
            }
        };
        map = with_index(map, k, i);
    }
    out[0] = base;
    out[1] = map | (count as u64) << COUNT_SHIFT;
    Ok(2 + count)
}

/// The header of a fresh row (no slot set) whose first slot will be `new` (set).
pub fn fresh(new: Slot) -> Result<[u64; 2], Unpackable> {
    let base = base_for(std::slice::from_ref(&new), 0)?.expect("`new` is set");
    Ok([base, 0])
}

/// Whether some word of the row with map `map` is referred to by no slot.
#[inline]
pub fn has_garbage(map: u64) -> bool {
    let count = (map >> COUNT_SHIFT) as u32;
    let (mut m, mut refs) = (map & !(0xf << COUNT_SHIFT), 0u32);
    while m != 0 {
        refs |= 1 << (m & 0xf);
        m >>= 4;
    }
    refs | 1 != (1 << (count + 1)) - 1
}

/// Drops the words no slot of the `n` refers to and merges equal ones, in place; returns
/// the row's new length.
pub fn compact(row: &mut [u64], n: usize) -> usize {
    let mut words = [0u64; MAPPED_MAX];
    let (old, mut map, mut count) = (row[1], 0u64, 0);
    for k in 0..n {
        let w = match index(old, k) {
            0 => continue,
            i => row[1 + i],
        };
        let i = match words[..count].iter().position(|&x| x == w) {
            Some(j) => j + 1,
            None => {
                words[count] = w;
                count += 1;
                count
            }
        };
        map = with_index(map, k, i);
    }
    row[1] = map | (count as u64) << COUNT_SHIFT;
    row[2..2 + count].copy_from_slice(&words[..count]);
    2 + count
}

/// Why [`fold_specs`] stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// A word must be added and the row has no room: the specs before are folded (those in
    /// `changed` changed). Folding the same slot again once there is room finishes the job
    /// (folding is idempotent).
    Full { changed: u64 },
    /// `new` does not fit the row's base (row unchanged): re-encode the row.
    Rebase,
}

/// [`super::packed::fold_specs`] on a mapped row (`row` is its storage, used words first):
/// folds `new` into the slots of every spec in `specs`. Returns the specs whose slots
/// changed.
#[inline]
pub fn fold_specs(
    row: &mut [u64],
    specs: u64,
    keep: impl Fn(usize) -> Keep,
    new: Slot,
) -> Result<u64, Stop> {
    if !new.is_set() || specs == 0 {
        return Ok(0);
    }
    let w = match pack(new, row[0]) {
        Some(w) => w,
        None => return Err(Stop::Rebase),
    };
    let mut map = row[1];
    // Where `new` already is in the row (0: not yet).
    let mut at = 0;
    let mut changed = 0u64;
    let mut bits = specs;
    while bits != 0 {
        let k = bits.trailing_zeros() as usize;
        bits &= bits - 1;
        let keep = keep(k);
        let cell = |map: u64, j: usize| match index(map, j) {
            0 => Word(0),
            i => Word(row[1 + i]),
        };
        // The slot that takes `new`, if any.
        let target = match keep {
            Keep::PairTail => None,
            Keep::Earliest | Keep::Latest => {
                let mut c = cell(map, k);
                c.fold(Word(w), keep).then_some(k)
            }
            Keep::EarliestPerNode | Keep::LatestPerNode => {
                let old = [cell(map, k), cell(map, k + 1)];
                let mut cells = old;
                // A pair fold changes one cell, to `new`.
                fold_into(&mut cells, 0, keep, Word(w))
                    .then(|| if cells[0] != old[0] { k } else { k + 1 })
            }
        };
        let Some(j) = target else { continue };
        changed |= 1 << k;
        if at != 0 {
            map = with_index(map, j, at);
            continue;
        }
        let old = index(map, j);
        if old != 0 && !shared(map, j, old) {
            row[1 + old] = w;
            at = old;
            continue;
        }
        let len = len(map);
        if len == row.len() {
            row[1] = map;
            return Err(Stop::Full {
                changed: changed & !(1 << k),
            });
        }
        row[len] = w;
        at = len - 1;
        map = with_index(map, j, at) + (1 << COUNT_SHIFT);
    }
    row[1] = map;
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::state::SlotRead;
    use crate::engine::state::Slots;
    use crate::event::{Kind, LifecycleEvent, Source, Stage};

    #[test]
    fn mapped_rows_store_equal_events_once() {
        const S: u64 = 1_000_000_000;
        let t0 = 1_795_986_920 * S + 123_456_789;
        let at = |t: u64, status| {
            let mut e = LifecycleEvent::new(t, Stage::Decode, Kind::Work, Source::Otlp);
            e.status = status;
            Slot::from_event(&e, 2)
        };
        let (a, b) = (at(t0, Some(400)), at(t0 - 30 * S, None));
        let slots = [Slot::EMPTY, a, b, a, Slot::EMPTY, b, a];
        let mut row = [0u64; max_len(7)];
        let n = encode(&slots, &mut row).unwrap();
        assert_eq!((n, len(row[1])), (4, 4), "base, map and the two events");
        assert_eq!(decode(&row, 7), slots.to_vec());
        let view = Slots::Mapped { row: &row, n: 7 };
        assert!(!view.any_set(0, Keep::Earliest) && view.any_set(0, Keep::EarliestPerNode));
        assert!(!has_garbage(row[1]));
        // A later event for slot 6: `a` is shared, so it gets a word of its own.
        let c = at(t0 + S, None);
        let keep = |_| Keep::Latest;
        assert_eq!(fold_specs(&mut row[..n + 1], 1 << 6, keep, c), Ok(1 << 6));
        assert_eq!(len(row[1]), 5);
        // Slot 5's `b` is shared too, but the row is full: stop before changing it.
        let d = at(t0 + 2 * S, None);
        assert_eq!(
            fold_specs(&mut row[..n + 1], 1 << 5 | 1 << 6, keep, d),
            Err(Stop::Full { changed: 0 })
        );
        assert_eq!(get(&row, 5), b);
        // With room: slot 5 takes a new word, slot 6 the same one, leaving `c` unreferenced.
        assert_eq!(
            fold_specs(&mut row, 1 << 5 | 1 << 6, keep, d),
            Ok(1 << 5 | 1 << 6)
        );
        assert!(has_garbage(row[1]));
        assert_eq!(compact(&mut row, 7), 5);
        assert!(!has_garbage(row[1]));
        let want = [Slot::EMPTY, a, b, a, Slot::EMPTY, d, d];
        assert_eq!(decode(&row, 7), want.to_vec());
        // An event the base cannot hold stops the fold, row unchanged.
        let before = row;
        let far = at(t0 + 600 * S, None);
        assert_eq!(fold_specs(&mut row, 1 << 6, keep, far), Err(Stop::Rebase));
        assert_eq!(row, before);
    }
}
