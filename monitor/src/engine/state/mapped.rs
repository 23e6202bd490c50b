//! Mapped packed rows, for live attempts: only the distinct events an attempt's slots remember
//! are stored. Most slots stay empty (the rules an attempt's events never reach), and rules
//! overlap: one admission is the earliest of one spec and the latest of another, a lone
//! completion both the earliest and the latest.
//!
//! A row of `n` slots (at most [`MAPPED_MAX`]) is the base word, [`maps`]`(n)` map words, then
//! the packed words: word index `i` (1-based) at `row[maps + i]`. A map word holds a 4-bit word
//! index per slot (0: empty). The first holds slots 0 to 14 and, in its top nibble, the number
//! of words; a row of more than 15 slots has a second map word for slots 15 to 30. Indices are
//! 4 bits, so a row holds at most [`WORDS_MAX`] distinct words: slots that need more do not fit
//! a mapped row ([`Stop::Words`], [`Unfit::Words`]) and their owner keeps them unpacked.
//!
//! Folding appends a word, or overwrites one no other slot refers to; a word no slot refers to
//! any more stays until the row is full, when [`compact`] drops it.

use super::packed::{Unpackable, Word, base_for, pack, unpack};
use super::{Cell, Keep, Slot, fold_into};

/// Slots the first map word indexes (its top nibble is the word count).
const FIRST: usize = 15;
/// Slots a mapped row indexes: 15 in the first map word, 16 in the second.
pub const MAPPED_MAX: usize = FIRST + 16;
/// Distinct words a row holds (a word index is 4 bits, 0 meaning empty).
pub const WORDS_MAX: usize = 15;
const COUNT_SHIFT: u32 = 60;

/// Map words of a row of `n` slots.
#[inline(always)]
pub const fn maps(n: usize) -> usize {
    if n <= FIRST { 1 } else { 2 }
}

/// Words a row of `n` slots may need: base, map words, one per distinct event (at most
/// [`WORDS_MAX`]).
pub const fn max_len(n: usize) -> usize {
    1 + maps(n) + if n < WORDS_MAX { n } else { WORDS_MAX }
}

/// A row's map words as one integer: `u64` for one map word, `u128` for two (the second word's
/// nibbles above the first's count nibble, so slot `k`'s nibble is `k`, or `k + 1` from slot
/// 15 on).
trait Map: Copy {
    /// Map words in the row.
    const WORDS: usize;
    const EMPTY: Self;
    fn load(row: &[u64]) -> Self;
    fn store(self, row: &mut [u64]);
    /// Slot `k`'s word index (0: empty).
    fn index(self, k: usize) -> usize;
    fn with_index(self, k: usize, i: usize) -> Self;
    fn count(self) -> usize;
    fn with_count(self, count: usize) -> Self;
    /// One word more.
    fn add_word(self) -> Self;
    /// Whether a slot other than `k` refers to word `i` (`i` > 0).
    fn shared(self, k: usize, i: usize) -> bool;
    /// Whether some word is referred to by no slot.
    fn has_garbage(self) -> bool;
}

macro_rules! map_impl {
    ($t:ty, $words:expr, |$k:ident| $nibble:expr, |$row:ident| $load:expr, |$m:ident, $out:ident| $store:block) => {
        impl Map for $t {
            const WORDS: usize = $words;
            const EMPTY: Self = 0;
            #[inline(always)]
            fn load($row: &[u64]) -> Self {
                $load
            }
            #[inline(always)]
            fn store(self, $out: &mut [u64]) {
                let $m = self;
                $store
            }
            #[inline(always)]
            fn index(self, $k: usize) -> usize {
                (self >> (4 * ($nibble)) & 0xf) as usize
            }
            #[inline(always)]
            fn with_index(self, $k: usize, i: usize) -> Self {
                let at = 4 * ($nibble);
                self & !(0xf << at) | (i as $t) << at
            }
            #[inline(always)]
            fn count(self) -> usize {
                (self >> COUNT_SHIFT & 0xf) as usize
            }
            #[inline(always)]
            fn with_count(self, count: usize) -> Self {
                self & !(0xf << COUNT_SHIFT) | (count as $t) << COUNT_SHIFT
            }
            #[inline(always)]
            fn add_word(self) -> Self {
                self + (1 << COUNT_SHIFT)
            }
            #[inline(always)]
            fn shared(self, $k: usize, i: usize) -> bool {
                const ONES: $t = <$t>::MAX / 0xf;
                // Slot `k`'s own nibble and the count nibble are set to 0xf, never equal to
                // `i`; unused slots' nibbles are 0, never equal either. A zero nibble is
                // another slot pointing at `i`; the classic has-zero test is exact about
                // whether there is one.
                let x = (self ^ (i as $t).wrapping_mul(ONES))
                    | 0xf << (4 * ($nibble))
                    | 0xf << COUNT_SHIFT;
                x.wrapping_sub(ONES) & !x & (ONES << 3) != 0
            }
            fn has_garbage(self) -> bool {
                const ONES: $t = <$t>::MAX / 0xf;
                // The count nibble cleared: 0 is no word index. Word `i` is referred to when
                // some nibble equals it, a zero nibble of `m ^ i…i` (the has-zero test of
                // `shared`): one test per word instead of a pass over every slot's nibble.
                let m = self & !(0xf << COUNT_SHIFT);
                (1..=self.count()).any(|i| {
                    let x = m ^ (i as $t).wrapping_mul(ONES);
                    x.wrapping_sub(ONES) & !x & (ONES << 3) == 0
                })
            }
        }
    };
}

map_impl!(u64, 1, |k| k, |row| row[1], |m, out| { out[1] = m });
map_impl!(
    u128,
    2,
    |k| k + (k >= FIRST) as usize,
    |row| row[1] as u128 | (row[2] as u128) << 64,
    |m, out| {
        out[1] = m as u64;
        out[2] = (m >> 64) as u64;
    }
);

/// Calls `$f::<M>($args)` with the map type of a row of `$n` slots.
macro_rules! with_map {
    ($n:expr, $f:ident($($arg:expr),*)) => {
        if $n <= FIRST { $f::<u64>($($arg),*) } else { $f::<u128>($($arg),*) }
    };
}

/// Slot `k`'s word index (0: empty), whichever map word holds it.
#[inline(always)]
fn slot_index(row: &[u64], k: usize) -> usize {
    let (map, at) = if k < FIRST {
        (row[1], k)
    } else {
        (row[2], k - FIRST)
    };
    (map >> (4 * at) & 0xf) as usize
}

/// Words the row of `n` slots uses (base and map words included).
#[inline]
pub fn len(row: &[u64], n: usize) -> usize {
    1 + maps(n) + (row[1] >> COUNT_SHIFT) as usize
}

/// Whether slot `k` remembers an event.
#[inline]
pub fn has(row: &[u64], k: usize) -> bool {
    slot_index(row, k) != 0
}

/// Slot `k` of a mapped row of `n` slots.
#[inline]
pub fn get(row: &[u64], n: usize, k: usize) -> Slot {
    match slot_index(row, k) {
        0 => Slot::EMPTY,
        i => unpack(row[maps(n) + i], row[0]),
    }
}

/// The `n` slots of a mapped row.
pub fn decode(row: &[u64], n: usize) -> Vec<Slot> {
    (0..n).map(|k| get(row, n, k)).collect()
}

/// Why slots do not fit a mapped row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unfit {
    /// An event does not pack against any base the row's events share.
    Unpackable,
    /// More than [`WORDS_MAX`] distinct events.
    Words,
}

impl From<Unpackable> for Unfit {
    fn from(_: Unpackable) -> Unfit {
        Unfit::Unpackable
    }
}

/// Encodes `slots` (at most [`MAPPED_MAX`]) into `out` (at least [`max_len`] words), equal
/// words once; returns the number of words used.
pub fn encode(slots: &[Slot], out: &mut [u64]) -> Result<usize, Unfit> {
    debug_assert!(slots.len() <= MAPPED_MAX);
    let base = base_for(slots, 0)?.unwrap_or(0);
    with_map!(slots.len(), encode_with(slots, base, out))
}

fn encode_with<M: Map>(slots: &[Slot], base: u64, out: &mut [u64]) -> Result<usize, Unfit> {
    let words = 1 + M::WORDS;
    let mut map = M::EMPTY;
    let mut count = 0;
    for (k, s) in slots.iter().enumerate() {
        if !s.is_set() {
            continue;
        }
        let w = pack(*s, base).ok_or(Unfit::Unpackable)?;
        let i = match out[words..words + count].iter().position(|&x| x == w) {
            Some(j) => j + 1,
            None if count == WORDS_MAX => return Err(Unfit::Words),
            None => {
                out[words + count] = w;
                count += 1;
                count
            }
        };
        map = map.with_index(k, i);
    }
    out[0] = base;
    map.with_count(count).store(out);
    Ok(words + count)
}

/// The header of a fresh row (no slot set) whose first slot will be `new` (set): the base and
/// empty map words (a row of `n` slots takes the first `1 + maps(n)`).
pub fn fresh(new: Slot) -> Result<[u64; 3], Unpackable> {
    let base = base_for(std::slice::from_ref(&new), 0)?.expect("`new` is set");
    Ok([base, 0, 0])
}

/// Whether some word of the row of `n` slots is referred to by no slot.
#[inline]
pub fn has_garbage(row: &[u64], n: usize) -> bool {
    if n <= FIRST {
        u64::load(row).has_garbage()
    } else {
        u128::load(row).has_garbage()
    }
}

/// Drops the words no slot of the `n` refers to and merges equal ones, in place; returns
/// the row's new length.
pub fn compact(row: &mut [u64], n: usize) -> usize {
    with_map!(n, compact_with(row, n))
}

fn compact_with<M: Map>(row: &mut [u64], n: usize) -> usize {
    let mut words = [0u64; WORDS_MAX];
    let (old, mut map, mut count) = (M::load(row), M::EMPTY, 0);
    for k in 0..n {
        let w = match old.index(k) {
            0 => continue,
            i => row[M::WORDS + i],
        };
        let i = match words[..count].iter().position(|&x| x == w) {
            Some(j) => j + 1,
            None => {
                // At most as many distinct words as the row had.
                words[count] = w;
                count += 1;
                count
            }
        };
        map = map.with_index(k, i);
    }
    map.with_count(count).store(row);
    row[1 + M::WORDS..1 + M::WORDS + count].copy_from_slice(&words[..count]);
    1 + M::WORDS + count
}

/// Why [`fold_specs`] stopped. In both `Full` and `Words` the specs before are folded (those
/// in `changed` changed): folding the same slot again once there is room finishes the job
/// (folding is idempotent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// A word must be added and the row has no room.
    Full { changed: u64 },
    /// A word must be added and the row already has [`WORDS_MAX`]: encode its slots again
    /// (equal words once, none unreferenced), or keep them unpacked when they still need more.
    Words { changed: u64 },
    /// `new` does not fit the row's base (row unchanged): re-encode the row.
    Rebase,
}

/// [`super::packed::fold_specs`] on a mapped row of `n` slots (`row` is its storage, used
/// words first): folds `new` into the slots of every spec in `specs`. Returns the specs whose
/// slots changed.
#[inline]
pub fn fold_specs(
    row: &mut [u64],
    n: usize,
    specs: u64,
    keep: impl Fn(usize) -> Keep,
    new: Slot,
) -> Result<u64, Stop> {
    if !new.is_set() || specs == 0 {
        return Ok(0);
    }
    with_map!(n, fold_with(row, specs, keep, new))
}

#[inline(always)]
fn fold_with<M: Map>(
    row: &mut [u64],
    specs: u64,
    keep: impl Fn(usize) -> Keep,
    new: Slot,
) -> Result<u64, Stop> {
    let w = match pack(new, row[0]) {
        Some(w) => w,
        None => return Err(Stop::Rebase),
    };
    let mut map = M::load(row);
    // Where `new` already is in the row (0: not yet).
    let mut at = 0;
    let mut changed = 0u64;
    let mut bits = specs;
    while bits != 0 {
        let k = bits.trailing_zeros() as usize;
        bits &= bits - 1;
        let keep = keep(k);
        let cell = |map: M, j: usize| match map.index(j) {
            0 => Word(0),
            i => Word(row[M::WORDS + i]),
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
            map = map.with_index(j, at);
            continue;
        }
        let old = map.index(j);
        if old != 0 && !map.shared(j, old) {
            row[M::WORDS + old] = w;
            at = old;
            continue;
        }
        let count = map.count();
        let len = 1 + M::WORDS + count;
        if len == row.len() {
            // No row is wider than `max_len`: a row of WORDS_MAX words is full too.
            map.store(row);
            let changed = changed & !(1 << k);
            return Err(if count == WORDS_MAX {
                Stop::Words { changed }
            } else {
                Stop::Full { changed }
            });
        }
        row[len] = w;
        at = count + 1;
        map = map.with_index(j, at).add_word();
    }
    map.store(row);
    Ok(changed)
}

#[cfg(test)]
mod tests {

    /// The has-zero test agrees with a pass over every nibble, for maps of both widths.
    #[test]
    fn garbage_is_any_word_no_slot_refers_to() {
        fn reference(nibbles: &[usize], count: usize) -> bool {
            (1..=count).any(|i| !nibbles.contains(&i))
        }
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..20_000 {
            let count = (next() % 16) as usize;
            let n = 1 + (next() % MAPPED_MAX as u64) as usize;
            let nibbles: Vec<usize> = (0..n)
                .map(|_| (next() % (count as u64 + 1)) as usize)
                .collect();
            let wide = nibbles
                .iter()
                .enumerate()
                .fold(u128::EMPTY, |m, (k, &i)| m.with_index(k, i))
                .with_count(count);
            assert_eq!(
                wide.has_garbage(),
                reference(&nibbles, count),
                "{nibbles:?} {count}"
            );
            if n <= FIRST {
                let narrow = nibbles
                    .iter()
                    .enumerate()
                    .fold(u64::EMPTY, |m, (k, &i)| m.with_index(k, i))
                    .with_count(count);
                assert_eq!(narrow.has_garbage(), reference(&nibbles, count));
            }
        }
    }
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
        assert_eq!((n, len(&row, 7)), (4, 4), "base, map and the two events");
        assert_eq!(decode(&row, 7), slots.to_vec());
        let view = Slots::Mapped { row: &row, n: 7 };
        assert!(!view.any_set(0, Keep::Earliest) && view.any_set(0, Keep::EarliestPerNode));
        assert!(!has_garbage(&row, 7));
        // A later event for slot 6: `a` is shared, so it gets a word of its own.
        let c = at(t0 + S, None);
        let keep = |_| Keep::Latest;
        assert_eq!(
            fold_specs(&mut row[..n + 1], 7, 1 << 6, keep, c),
            Ok(1 << 6)
        );
        assert_eq!(len(&row, 7), 5);
        // Slot 5's `b` is shared too, but the row is full: stop before changing it.
        let d = at(t0 + 2 * S, None);
        assert_eq!(
            fold_specs(&mut row[..n + 1], 7, 1 << 5 | 1 << 6, keep, d),
            Err(Stop::Full { changed: 0 })
        );
        assert_eq!(get(&row, 7, 5), b);
        // With room: slot 5 takes a new word, slot 6 the same one, leaving `c` unreferenced.
        assert_eq!(
            fold_specs(&mut row, 7, 1 << 5 | 1 << 6, keep, d),
            Ok(1 << 5 | 1 << 6)
        );
        assert!(has_garbage(&row, 7));
        assert_eq!(compact(&mut row, 7), 5);
        assert!(!has_garbage(&row, 7));
        let want = [Slot::EMPTY, a, b, a, Slot::EMPTY, d, d];
        assert_eq!(decode(&row, 7), want.to_vec());
        // An event the base cannot hold stops the fold, row unchanged.
        let before = row;
        let far = at(t0 + 600 * S, None);
        assert_eq!(
            fold_specs(&mut row, 7, 1 << 6, keep, far),
            Err(Stop::Rebase)
        );
        assert_eq!(row, before);
    }

    const S: u64 = 1_000_000_000;
    const T0: u64 = 1_795_986_920 * S;

    fn at(t: u64, kind: Kind, node: u16) -> Slot {
        Slot::from_event(
            &LifecycleEvent::new(t, Stage::Decode, kind, Source::Ebpf),
            node,
        )
    }

    /// Earliest, latest and per-node pairs; from 14 on a pair spans both map words (14, 15).
    fn keeps(n: usize) -> Vec<Keep> {
        let mut k = Vec::new();
        while k.len() < n {
            let fits = k.len() + 2 <= n;
            match k.len() % 6 {
                0 => k.push(Keep::Earliest),
                1 => k.push(Keep::Latest),
                2 if fits => k.extend([Keep::EarliestPerNode, Keep::PairTail]),
                4 if fits => k.extend([Keep::LatestPerNode, Keep::PairTail]),
                _ => k.push(Keep::Latest),
            }
        }
        k
    }

    /// Distinct set slots as a mapped row would store them.
    fn distinct(slots: &[Slot]) -> usize {
        let mut seen: Vec<Slot> = slots.iter().copied().filter(Slot::is_set).collect();
        seen.sort_by_key(|s| (s.time(), s.tag, s.status));
        seen.dedup();
        seen.len()
    }

    #[test]
    fn second_map_word_indexes_slots_15_to_30() {
        assert_eq!((maps(15), maps(16), maps(MAPPED_MAX)), (1, 2, 2));
        assert_eq!(
            (max_len(7), max_len(15), max_len(16), max_len(31)),
            (9, 17, 18, 18)
        );
        // 31 slots over five events, each shared by slots of both map words.
        let ev: Vec<Slot> = (0..5).map(|i| at(T0 + i * S, Kind::Work, 0)).collect();
        let slots: Vec<Slot> = (0..31)
            .map(|k| if k % 7 == 6 { Slot::EMPTY } else { ev[k % 5] })
            .collect();
        let mut row = [0u64; max_len(31)];
        assert_eq!(encode(&slots, &mut row), Ok(1 + 2 + 5));
        assert_eq!(len(&row, 31), 8);
        assert_eq!(decode(&row, 31), slots);
        for (k, s) in slots.iter().enumerate() {
            assert_eq!(
                (get(&row, 31, k), has(&row, k)),
                (*s, s.is_set()),
                "slot {k}"
            );
        }
        // Slot 30 (`ev[0]`, word 1) is the second map word's top nibble, not a count.
        assert_eq!((row[2] >> 60, index_of(&row, 30)), (1, 1));
        assert_eq!(row[1] >> 60, 5, "the count");
        assert!(!has_garbage(&row, 31));
        // A pair across the boundary: slot 14 empty, 15 set.
        let mut gap = slots.clone();
        gap[14] = Slot::EMPTY;
        encode(&gap, &mut row).unwrap();
        let view = Slots::Mapped { row: &row, n: 31 };
        assert!(!view.any_set(14, Keep::Earliest) && view.any_set(14, Keep::EarliestPerNode));
    }

    fn index_of(row: &[u64], k: usize) -> usize {
        u128::load(row).index(k)
    }

    #[test]
    fn shared_and_garbage_never_read_the_count_nibble() {
        // Word 3 referred to by slot 20 alone, with 3 words: the count nibble is 3 as well.
        let m = u128::EMPTY
            .with_index(0, 1)
            .with_index(16, 2)
            .with_index(20, 3);
        let m = m.with_count(3);
        assert!(!m.shared(20, 3), "the count is no slot");
        assert!(!m.shared(0, 1) && !m.shared(16, 2));
        assert!(
            m.with_index(30, 3).shared(20, 3),
            "slot 30 (top nibble) shares it"
        );
        assert!(m.with_index(14, 3).shared(20, 3), "slot 14 shares it");
        assert!(m.with_index(15, 2).shared(16, 2), "across the boundary");
        assert!(!m.has_garbage());
        // Word 3 unreferenced: garbage, though the count nibble reads 3.
        assert!(m.with_index(20, 0).has_garbage());
        // Words referred to only from the second map word are no garbage.
        let m = u128::EMPTY
            .with_index(15, 1)
            .with_index(30, 2)
            .with_count(2);
        assert!(!m.has_garbage() && m.with_count(3).has_garbage());
        // One map word: the same with slot 14 in the top slot nibble.
        let m = 0u64.with_index(14, 2).with_index(3, 1).with_count(2);
        assert!(!m.shared(14, 2) && m.with_index(0, 2).shared(14, 2) && !m.has_garbage());
        assert!(m.with_index(14, 0).has_garbage());
    }

    #[test]
    fn folds_and_compaction_across_both_map_words() {
        let n = 27;
        let keep = |_| Keep::Latest;
        let (a, b) = (at(T0, Kind::Work, 0), at(T0 + S, Kind::Work, 0));
        let mut slots = vec![Slot::EMPTY; n];
        (slots[3], slots[20], slots[26]) = (a, a, b);
        let mut row = [0u64; max_len(27)];
        let used = encode(&slots, &mut row).unwrap();
        assert_eq!(used, 1 + 2 + 2);
        // Slot 26 alone refers to `b` (word 2, and the count is 2): overwritten in place.
        let c = at(T0 + 2 * S, Kind::Work, 0);
        assert_eq!(
            fold_specs(&mut row[..used], n, 1 << 26, keep, c),
            Ok(1 << 26)
        );
        slots[26] = c;
        assert_eq!((len(&row, n), decode(&row, n)), (used, slots.clone()));
        // `a` is shared across the boundary: slot 20 takes a word of its own, but the row is
        // full.
        let d = at(T0 + 3 * S, Kind::Work, 0);
        assert_eq!(
            fold_specs(&mut row[..used], n, 1 << 20, keep, d),
            Err(Stop::Full { changed: 0 })
        );
        assert_eq!(decode(&row, n), slots);
        // With room, slots 3 and 20 both take `d`; `a` is garbage, then compacted away.
        assert_eq!(
            fold_specs(&mut row, n, 1 << 3 | 1 << 20, keep, d),
            Ok(1 << 3 | 1 << 20)
        );
        (slots[3], slots[20]) = (d, d);
        assert!(has_garbage(&row, n));
        assert_eq!(decode(&row, n), slots);
        assert_eq!(compact(&mut row, n), 1 + 2 + 2);
        assert!(!has_garbage(&row, n));
        assert_eq!(decode(&row, n), slots);
        // A pair across the boundary (keeps(27)'s 14 and 15): a second node's event goes to 15.
        let keeps = keeps(n);
        assert_eq!(
            (keeps[14], keeps[15]),
            (Keep::EarliestPerNode, Keep::PairTail)
        );
        let (e0, e1) = (at(T0 + 4 * S, Kind::Work, 0), at(T0 + 5 * S, Kind::Work, 1));
        for e in [e0, e1] {
            let mut model = slots.clone();
            let want = crate::engine::state::fold_specs_full(&mut model, &keeps, 1 << 14, e);
            assert_eq!(fold_specs(&mut row, n, 1 << 14, |k| keeps[k], e), Ok(want));
            slots = model;
            assert_eq!(decode(&row, n), slots);
        }
        assert_eq!((slots[14], slots[15]), (e0, e1));
    }

    #[test]
    fn a_sixteenth_distinct_word_stops_the_fold() {
        let n = 31;
        let ev: Vec<Slot> = (0..16).map(|i| at(T0 + i * S, Kind::Work, 0)).collect();
        // Sixteen distinct events do not encode.
        let mut row = [0u64; max_len(31)];
        let all: Vec<Slot> = (0..n).map(|k| ev[k % 16]).collect();
        assert_eq!(encode(&all, &mut row), Err(Unfit::Words));
        // Fifteen do: slots 0..15 and 16..31 share them.
        let slots: Vec<Slot> = (0..n).map(|k| ev[k % 15]).collect();
        assert_eq!(encode(&slots, &mut row), Ok(max_len(31)));
        assert_eq!(distinct(&slots), WORDS_MAX);
        // A later event for slot 30 alone needs a sixteenth word: the row is left as it was.
        let before = row;
        let keep = |_| Keep::Latest;
        assert_eq!(
            fold_specs(&mut row, n, 1 << 30, keep, ev[15]),
            Err(Stop::Words { changed: 0 })
        );
        assert_eq!(row, before);
        assert_eq!(
            fold_specs(&mut row, n, 1 << 0 | 1 << 30, keep, ev[15]),
            Err(Stop::Words { changed: 0 })
        );
        assert_eq!(decode(&row, n), slots);
        // With `ev[0]` in slot 0 alone it is overwritten in place, and slot 30 (in the second
        // map word) takes the same word: no new index needed.
        let mut own = slots.clone();
        (own[15], own[30]) = (ev[1], ev[1]);
        assert_eq!(encode(&own, &mut row), Ok(max_len(31)));
        assert_eq!(
            fold_specs(&mut row, n, 1 | 1 << 30, keep, ev[15]),
            Ok(1 | 1 << 30)
        );
        (own[0], own[30]) = (ev[15], ev[15]);
        assert_eq!(decode(&row, n), own);
        assert_eq!(len(&row, n), max_len(31));
    }

    /// Folds `new` into the row as rows.rs does: compact when full, encode again when the row
    /// cannot take it; `None` when the slots no longer fit a mapped row.
    fn fold_like_rows(
        row: &mut [u64],
        n: usize,
        keeps: &[Keep],
        specs: u64,
        new: Slot,
    ) -> Option<u64> {
        let mut changed = 0;
        loop {
            match fold_specs(row, n, specs, |k| keeps[k], new) {
                Ok(more) => return Some(changed | more),
                Err(Stop::Full { changed: more }) => {
                    changed |= more;
                    let len = len(row, n);
                    assert!(has_garbage(row, n) || len < row.len());
                    assert!(compact(row, n) < len, "a row of max_len(n) words compacts");
                }
                Err(stop) => {
                    if let Stop::Words { changed: more } = stop {
                        assert_eq!(len(row, n), max_len(n));
                        changed |= more;
                    }
                    let mut all = decode(row, n);
                    changed |= crate::engine::state::fold_specs_full(&mut all, keeps, specs, new);
                    let mut buf = [0u64; max_len(MAPPED_MAX)];
                    return match encode(&all, &mut buf) {
                        Ok(used) => {
                            row[..used].copy_from_slice(&buf[..used]);
                            Some(changed)
                        }
                        Err(Unfit::Words) => {
                            assert!(distinct(&all) > WORDS_MAX);
                            None
                        }
                        Err(Unfit::Unpackable) => unreachable!("events span 100 s"),
                    };
                }
            }
        }
    }

    proptest::proptest! {
        /// Random folds into a mapped row read back as the same folds into plain slots.
        #[test]
        fn random_folds_match_plain_slots(
            n in proptest::sample::select(vec![7usize, 15, 16, 27, 31]),
            ops in proptest::collection::vec(
                (proptest::num::u64::ANY, 0u64..25, 0usize..3, 0u16..3, 0usize..4),
                1..120,
            ),
        ) {
            let keeps = keeps(n);
            let tails = keeps.iter().enumerate().filter(|(_, k)| **k == Keep::PairTail);
            let matchable = ((1u64 << n) - 1) & !tails.fold(0, |m, (k, _)| m | 1 << k);
            let mut model = vec![Slot::EMPTY; n];
            let mut row = vec![0u64; max_len(n)];
            let mut started = false;
            for (bits, t, kind, node, few) in ops {
                // Few specs per event, most of the time: more distinct events per row.
                let specs = bits >> (few * 16) & matchable;
                let new = at(T0 + t * 4 * S, [Kind::Work, Kind::Admitted, Kind::Completed][kind], node);
                if !started {
                    if specs == 0 {
                        continue;
                    }
                    row[..3].copy_from_slice(&fresh(new).unwrap());
                    started = true;
                }
                let want = crate::engine::state::fold_specs_full(&mut model, &keeps, specs, new);
                match fold_like_rows(&mut row, n, &keeps, specs, new) {
                    Some(got) => proptest::prop_assert_eq!(got, want),
                    None => {
                        proptest::prop_assert!(n > WORDS_MAX);
                        return Ok(());
                    }
                }
                proptest::prop_assert_eq!(&decode(&row, n), &model);
                for (k, s) in model.iter().enumerate() {
                    proptest::prop_assert_eq!(has(&row, k), s.is_set());
                }
                proptest::prop_assert!(len(&row, n) <= max_len(n));
            }
        }
    }
}
