//! Compact per-attempt memory of the events rules care about.
//!
//! A rule never needs an attempt's full history: it needs "the earliest trigger" or "the latest
//! forbidden event". Each such need is a [`SlotSpec`]; the engine keeps one [`Slot`] per
//! spec per attempt, in one flat arena, so tracking an attempt costs no allocation.

use crate::event::{Kind, LifecycleEvent, Source, Stage};

use crate::engine::matcher::{Matcher, any_matches};

/// Which event of a role a slot remembers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    Earliest,
    Latest,
    /// The earliest event of each of up to two nodes (clock domains), in this slot and the next.
    /// "Later" is exact within a node and skew-tolerant across nodes, so one extreme is not
    /// enough: the earliest trigger of one node may not breach while another node's does.
    EarliestPerNode,
    /// The latest event of each of up to two nodes, in this slot and the next.
    LatestPerNode,
    /// The second slot of a per-node pair; never matched on its own.
    PairTail,
}

impl Keep {
    pub fn is_pair(self) -> bool {
        matches!(self, Keep::EarliestPerNode | Keep::LatestPerNode)
    }
}

/// What folding needs of a remembered event: whether it is set, its time (or anything ordered
/// the same way within one row) and its node. Implemented by [`Slot`] and by packed words,
/// whose offsets from their row's base order like times.
pub trait Cell: Copy {
    fn is_set(&self) -> bool;
    fn order(&self) -> u64;
    fn node(&self) -> NodeId;

    /// Folds `other` into `self` keeping the earliest or latest.
    #[inline]
    fn fold(&mut self, other: Self, keep: Keep) -> bool {
        if !other.is_set() {
            return false;
        }
        let replace = !self.is_set()
            || match keep {
                Keep::Earliest | Keep::EarliestPerNode => other.order() < self.order(),
                Keep::Latest | Keep::LatestPerNode => other.order() > self.order(),
                Keep::PairTail => false,
            };
        if replace {
            *self = other;
        }
        replace
    }
}

impl Cell for Slot {
    #[inline]
    fn is_set(&self) -> bool {
        Slot::is_set(self)
    }
    #[inline]
    fn order(&self) -> u64 {
        self.time()
    }
    #[inline]
    fn node(&self) -> NodeId {
        Slot::node(self)
    }
}

/// Folds `new` into the slot(s) of spec `k`: one slot for `Earliest`/`Latest`, the pair `k, k+1`
/// for the per-node keeps. With a third node the pair keeps the two most extreme events.
#[inline]
pub fn fold_into<C: Cell>(slots: &mut [C], k: usize, keep: Keep, new: C) -> bool {
    match keep {
        Keep::Earliest | Keep::Latest => slots[k].fold(new, keep),
        Keep::PairTail => false,
        Keep::EarliestPerNode | Keep::LatestPerNode => {
            if !new.is_set() {
                return false;
            }
            let single = if keep == Keep::EarliestPerNode {
                Keep::Earliest
            } else {
                Keep::Latest
            };
            for i in [k, k + 1] {
                if slots[i].is_set() && slots[i].node() == new.node() {
                    return slots[i].fold(new, single);
                }
            }
            for i in [k, k + 1] {
                if !slots[i].is_set() {
                    slots[i] = new;
                    return true;
                }
            }
            // A third node: replace the less extreme of the two if the new one is more extreme.
            let (a, b) = (slots[k].order(), slots[k + 1].order());
            let weaker = match keep {
                Keep::EarliestPerNode => {
                    if a >= b {
                        k
                    } else {
                        k + 1
                    }
                }
                _ => {
                    if a <= b {
                        k
                    } else {
                        k + 1
                    }
                }
            };
            slots[weaker].fold(new, single)
        }
    }
}

/// [`fold_into`] for every spec whose bit is set in `specs` (`keep` gives each spec's keep);
/// returns the specs whose slots changed.
#[inline]
pub fn fold_each<C: Cell>(
    cells: &mut [C],
    specs: u64,
    keep: impl Fn(usize) -> Keep,
    new: C,
) -> u64 {
    let (mut bits, mut changed) = (specs, 0u64);
    while bits != 0 {
        let k = bits.trailing_zeros() as usize;
        bits &= bits - 1;
        if fold_into(cells, k, keep(k), new) {
            changed |= 1 << k;
        }
    }
    changed
}

/// [`fold_each`] on full slots, `keeps` indexed by spec.
pub fn fold_specs_full(slots: &mut [Slot], keeps: &[Keep], specs: u64, slot: Slot) -> u64 {
    fold_each(slots, specs, |k| keeps[k], slot)
}

/// Read access to one owner's slots, whichever way they are stored.
pub trait SlotRead {
    fn slot(&self, k: usize) -> Slot;

    /// Whether spec `k` (a pair for per-node keeps) remembers any event.
    fn any_set(&self, k: usize, keep: Keep) -> bool {
        self.slot(k).is_set() || (keep.is_pair() && self.slot(k + 1).is_set())
    }
}

impl SlotRead for [Slot] {
    fn slot(&self, k: usize) -> Slot {
        self[k]
    }
}

impl SlotRead for Vec<Slot> {
    fn slot(&self, k: usize) -> Slot {
        self[k]
    }
}

/// Up to three candidate slots (a per-node pair plus the current event), without allocating:
/// never-after checks build these on nearly every event.
#[derive(Debug, Clone, Copy, Default)]
pub struct Cands {
    slots: [Slot; 3],
    n: u8,
}

impl Cands {
    /// The slots of spec `k` (one, or a per-node pair).
    pub fn of(slots: &(impl SlotRead + ?Sized), k: usize, keep: Keep) -> Cands {
        let mut c = Cands::default();
        c.push(slots.slot(k));
        if keep.is_pair() {
            c.push(slots.slot(k + 1));
        }
        c
    }

    pub fn push(&mut self, s: Slot) {
        self.slots[self.n as usize] = s;
        self.n += 1;
    }
}

impl std::ops::Deref for Cands {
    type Target = [Slot];
    fn deref(&self) -> &[Slot] {
        &self.slots[..self.n as usize]
    }
}

/// What one slot tracks: the events matching `matchers`, keeping the earliest or the latest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotSpec {
    pub matchers: Vec<Matcher>,
    pub keep: Keep,
}

/// Small interned node id; events of one node share a clock.
pub type NodeId = u16;
/// The id of "node unknown": events without a node are taken to share the local clock.
pub const NODE_LOCAL: NodeId = 0;

/// One remembered event, 12 bytes: time plus what evidence needs to say about it. Stored
/// packed in 8 bytes (see [`packed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C)]
pub struct Slot {
    time_lo: u32,
    time_hi: u32,
    /// bits 0..2 stage, 2..6 kind, 6..8 source; bit 15 set = occupied.
    tag: u16,
    /// HTTP-style status, 0 = none.
    status: u16,
}

/// Slot plus the node it came from, which only the never-after check needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotEvent {
    pub time_ns: u64,
    pub stage: Stage,
    pub kind: Kind,
    pub source: Source,
    pub status: Option<u16>,
}

const OCCUPIED: u16 = 1 << 15;

impl Slot {
    pub const EMPTY: Slot = Slot {
        time_lo: 0,
        time_hi: 0,
        tag: 0,
        status: 0,
    };

    pub fn from_event(e: &LifecycleEvent, node: NodeId) -> Slot {
        let tag = (e.stage as u16)
            | ((e.kind as u16) << 2)
            | ((e.source as u16) << 6)
            | (node.min(0x7f) << 8)
            | OCCUPIED;
        Slot {
            time_lo: e.time_ns as u32,
            time_hi: (e.time_ns >> 32) as u32,
            tag,
            status: e.status.unwrap_or(0),
        }
    }

    pub fn is_set(&self) -> bool {
        self.tag & OCCUPIED != 0
    }

    pub fn time(&self) -> u64 {
        ((self.time_hi as u64) << 32) | self.time_lo as u64
    }

    /// Node ids above 126 share one bucket: they still compare as "another node" to node 0.
    pub fn node(&self) -> NodeId {
        (self.tag >> 8) & 0x7f
    }

    pub fn get(&self) -> Option<SlotEvent> {
        self.is_set().then(|| SlotEvent {
            time_ns: self.time(),
            stage: Stage::from_index((self.tag & 3) as u8),
            kind: Kind::from_index(((self.tag >> 2) & 0xf) as u8),
            source: Source::from_index(((self.tag >> 6) & 3) as u8),
            status: (self.status != 0).then_some(self.status),
        })
    }
}

/// Slots as stored: 8 bytes each, the time relative to a base shared by one owner's row.
///
/// A row is `1 + n` words: the base (ns), then the packed slots. A packed slot holds the
/// time's offset from the base in 39 bits (9 min 9 s), the slot's tag (stage, kind + 1, source,
/// node: 15 bits, so a set slot is never 0) and the status in 10 bits. An owner's events span
/// far less than the window, so one base serves; when an event does not fit, the row is
/// re-based around its slots, and a row that cannot be (an attempt spanning more than the
/// window, a status above 1023) is [`packed::WIDE`]: its owner keeps full slots elsewhere.
/// 12-byte slots held the whole time: 13 of them per attempt were a third of its memory.
pub mod packed {
    use super::{Cell, Keep, NodeId, OCCUPIED, Slot, fold_each};

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
        let mut packed = [0u64; super::SlotLayout::MAX];
        for (k, s) in slots.iter().enumerate() {
            packed[k] = pack(*s, base).ok_or(Unpackable)?;
        }
        row[0] = base;
        row[1..].copy_from_slice(&packed[..slots.len()]);
        Ok(())
    }

    /// [`super::fold_each`] on a packed row for every spec whose bit is set in `specs` (`keep` gives
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
        Ok(fold_each(cells, specs, keep, Word(w)))
    }

    /// [`fold_specs`] for the one spec `k`: true if its slot(s) changed (the tests' handle).
    #[cfg(test)]
    pub fn fold(row: &mut [u64], k: usize, keep: Keep, new: Slot) -> Result<bool, Unpackable> {
        if keep == Keep::PairTail {
            return Ok(false);
        }
        fold_specs(row, 1 << k, |_| keep, new).map(|changed| changed != 0)
    }
}

/// Sparse packed rows, for tombstones: they are written once and rarely change, and most of
/// their kept slots are empty (a rejection's trigger pair, a second node), so only the set ones
/// are stored. A row is a header word, the base (a multiple of 2^23 ns) with a bit per slot in
/// its low [`SPARSE_MAX`] bits, then one packed word per set slot in order. Rows of more slots
/// than that are stored whole, after a plain base word.
pub mod sparse {
    use super::Slot;
    use super::packed::{Unpackable, WIDE, base_for, pack, unpack};

    pub const SPARSE_MAX: usize = 23;
    const MASK: u64 = (1 << SPARSE_MAX) - 1;

    /// Words in the row whose header is `header` (not [`WIDE`]), for rows of `n` slots.
    pub fn len(header: u64, n: usize) -> usize {
        debug_assert_ne!(header, WIDE);
        if n > SPARSE_MAX {
            1 + n
        } else {
            1 + (header & MASK).count_ones() as usize
        }
    }

    /// Encodes `slots` into `out`; returns the number of words used.
    pub fn encode(slots: &[Slot], out: &mut [u64]) -> Result<usize, Unpackable> {
        let whole = slots.len() > SPARSE_MAX;
        let base = base_for(slots, if whole { 0 } else { SPARSE_MAX as u32 })?.unwrap_or(0);
        let mut n = 1;
        let mut bits = 0u64;
        for (k, s) in slots.iter().enumerate() {
            if whole || s.is_set() {
                out[n] = pack(*s, base).ok_or(Unpackable)?;
                n += 1;
                bits |= 1 << k;
            }
        }
        out[0] = if whole { base } else { base | bits };
        Ok(n)
    }

    /// The `n` slots of the row `words` (not [`WIDE`]).
    pub fn decode(words: &[u64], n: usize) -> Vec<Slot> {
        let header = words[0];
        if n > SPARSE_MAX {
            return (0..n).map(|k| unpack(words[1 + k], header)).collect();
        }
        let base = header & !MASK;
        let mut next = 1;
        (0..n)
            .map(|k| {
                if header & (1 << k) == 0 {
                    return Slot::EMPTY;
                }
                next += 1;
                unpack(words[next - 1], base)
            })
            .collect()
    }
}

/// Mapped packed rows, for live attempts: only the distinct events an attempt's slots remember
/// are stored. Most slots stay empty (the rules an attempt's events never reach), and rules
/// overlap: one admission is the earliest of one spec and the latest of another, a lone
/// completion both the earliest and the latest. A row is the base word, a map word with a
/// 4-bit word index per slot (0: empty) and the number of words in its top nibble, then the
/// packed words (index `i` at `row[1 + i]`). Rows of more than [`MAPPED_MAX`] slots are dense.
///
/// Folding appends a word, or overwrites one no other slot refers to; a word no slot refers to
/// any more stays until the row is full, when [`compact`] drops it.
pub mod mapped {
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
}

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
            Slots::Mapped { row, .. } => mapped::get(row, k),
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
    fn slot(&self, k: usize) -> Slot {
        self.get(k)
    }

    /// On a packed row, without unpacking: an empty slot is a zero word.
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

/// Returns the bit set of specs whose matchers match `e` (reference implementation; the engine
/// uses [`SpecIndex`], which must agree with it).
pub fn matching_specs(specs: &[SlotSpec], e: &LifecycleEvent) -> u64 {
    let mut hit = 0u64;
    for (i, s) in specs.iter().enumerate() {
        if any_matches(&s.matchers, e) {
            hit |= 1 << i;
        }
    }
    hit
}

const STAGE_KINDS: usize = Stage::ALL.len() * Kind::ALL.len();

fn stage_kind(stage: Stage, kind: Kind) -> usize {
    stage as usize * Kind::ALL.len() + kind as usize
}

/// Spec matching as table look-ups: per (stage, kind), the specs that match outright and those
/// that still need their source/status/target conditions checked. Every event pays this, so it is
/// one array index instead of walking each spec's matcher lists.
#[derive(Debug, Clone)]
pub struct SpecIndex {
    outright: [u64; STAGE_KINDS],
    conditional: [u64; STAGE_KINDS],
    specs: Vec<SlotSpec>,
}

impl SpecIndex {
    pub fn new(specs: &[SlotSpec]) -> SpecIndex {
        let mut outright = [0u64; STAGE_KINDS];
        let mut conditional = [0u64; STAGE_KINDS];
        for (i, spec) in specs.iter().enumerate() {
            for m in &spec.matchers {
                let plain = m.source.is_empty()
                    && m.to.is_empty()
                    && m.status_below.is_none()
                    && m.status_at_least.is_none();
                for stage in Stage::ALL {
                    for kind in Kind::ALL {
                        if (m.stage.is_empty() || m.stage.contains(&stage))
                            && (m.kind.is_empty() || m.kind.contains(&kind))
                        {
                            let table = if plain {
                                &mut outright
                            } else {
                                &mut conditional
                            };
                            table[stage_kind(stage, kind)] |= 1 << i;
                        }
                    }
                }
            }
        }
        SpecIndex {
            outright,
            conditional,
            specs: specs.to_vec(),
        }
    }

    pub fn matching(&self, e: &LifecycleEvent) -> u64 {
        let k = stage_kind(e.stage, e.kind);
        let mut hit = self.outright[k];
        let mut rest = self.conditional[k] & !hit;
        while rest != 0 {
            let i = rest.trailing_zeros() as usize;
            rest &= rest - 1;
            if any_matches(&self.specs[i].matchers, e) {
                hit |= 1 << i;
            }
        }
        hit
    }
}

/// Deduplicating registry of slot specs, filled while compiling rules.
#[derive(Debug, Default, Clone)]
pub struct SlotLayout {
    pub specs: Vec<SlotSpec>,
}

impl SlotLayout {
    pub const MAX: usize = 64;

    /// The index of a slot tracking `matchers` with `keep`, shared with any identical one.
    pub fn slot(&mut self, matchers: &[Matcher], keep: Keep) -> usize {
        if let Some(i) = self
            .specs
            .iter()
            .position(|s| s.keep == keep && s.matchers == matchers)
        {
            return i;
        }
        self.specs.push(SlotSpec {
            matchers: matchers.to_vec(),
            keep,
        });
        if keep.is_pair() {
            self.specs.push(SlotSpec {
                matchers: Vec::new(),
                keep: Keep::PairTail,
            });
            return self.specs.len() - 2;
        }
        self.specs.len() - 1
    }

    pub fn len(&self) -> usize {
        self.specs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.specs.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_round_trips_event_facts() {
        let e = LifecycleEvent::new(
            0x1_2345_6789_abcd,
            Stage::Decode,
            Kind::Completed,
            Source::Ebpf,
        )
        .with_status(503);
        let s = Slot::from_event(&e, 5);
        let got = s.get().unwrap();
        assert_eq!(got.time_ns, e.time_ns);
        assert_eq!(
            (got.stage, got.kind, got.source, got.status),
            (Stage::Decode, Kind::Completed, Source::Ebpf, Some(503))
        );
        assert_eq!(s.node(), 5);
        assert_eq!(std::mem::size_of::<Slot>(), 12);
    }

    #[test]
    fn spec_index_agrees_with_the_matchers() {
        let set = crate::engine::check::RuleSet::embedded_defaults();
        let (mut a, mut r) = (SlotLayout::default(), SlotLayout::default());
        crate::engine::rules::compile(&set, &mut a, &mut r);
        let index = SpecIndex::new(&a.specs);
        for stage in Stage::ALL {
            for kind in Kind::ALL {
                for source in Source::ALL {
                    for status in [None, Some(200), Some(400), Some(503)] {
                        for to in [None, Some(Stage::Decode)] {
                            let mut e = LifecycleEvent::new(1, stage, kind, source);
                            e.status = status;
                            e.to = to;
                            assert_eq!(index.matching(&e), matching_specs(&a.specs, &e), "{e:?}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn per_node_pairs_keep_each_nodes_extreme() {
        let at = |t, node| {
            Slot::from_event(
                &LifecycleEvent::new(t, Stage::Decode, Kind::Work, Source::Ebpf),
                node,
            )
        };
        let mut s = [Slot::EMPTY; 2];
        for (t, n) in [(10, 1), (40, 2), (20, 1), (30, 2)] {
            fold_into(&mut s, 0, Keep::LatestPerNode, at(t, n));
        }
        assert_eq!(
            (s[0].time(), s[0].node(), s[1].time(), s[1].node()),
            (20, 1, 40, 2)
        );
        // A third node replaces the less extreme only when it is more extreme.
        fold_into(&mut s, 0, Keep::LatestPerNode, at(15, 3));
        assert_eq!((s[0].time(), s[1].time()), (20, 40));
        fold_into(&mut s, 0, Keep::LatestPerNode, at(50, 3));
        assert_eq!((s[0].time(), s[0].node(), s[1].time()), (50, 3, 40));
    }

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
        assert_eq!(packed::fold(&mut row, 0, Keep::Earliest, first), Ok(true));
        assert_eq!(packed::get(&row, 0), first);
        assert!(packed::get(&row, 0).is_set() && !packed::get(&row, 1).is_set());
        // Out of order, a minute earlier: fits the margin; keeps the earliest.
        let early = at(t0 - 60 * S, Kind::Work, Some(503), 7);
        assert_eq!(packed::fold(&mut row, 0, Keep::Earliest, early), Ok(true));
        assert_eq!(packed::get(&row, 0), early);
        // Eight minutes later: re-based, nothing lost.
        let late = at(t0 + 8 * 60 * S, Kind::Completed, Some(200), 3);
        assert_eq!(packed::fold(&mut row, 1, Keep::Latest, late), Ok(true));
        assert_eq!((packed::get(&row, 0), packed::get(&row, 1)), (early, late));
        // Per-node pairs through the packed form.
        let a = at(t0 + S, Kind::Work, None, 1);
        let b = at(t0 + 2 * S, Kind::Work, None, 2);
        packed::fold(&mut row, 2, Keep::LatestPerNode, a).unwrap();
        packed::fold(&mut row, 2, Keep::LatestPerNode, b).unwrap();
        assert_eq!((packed::get(&row, 2), packed::get(&row, 3)), (a, b));
        // A span past the window, or a status past 10 bits, leaves the row as it was.
        let before = row;
        let far = at(t0 + 20 * 60 * S, Kind::Work, None, 0);
        assert_eq!(
            packed::fold(&mut row, 1, Keep::Latest, far),
            Err(packed::Unpackable)
        );
        let odd = at(t0 + 8 * 60 * S + 1, Kind::Completed, Some(1024), 0);
        assert_eq!(
            packed::fold(&mut row, 1, Keep::Latest, odd),
            Err(packed::Unpackable)
        );
        assert_eq!(row, before);
        // ... unless it would not be kept anyway.
        let older = at(t0, Kind::Completed, Some(1024), 0);
        assert_eq!(packed::fold(&mut row, 1, Keep::Latest, older), Ok(false));
        let slots = packed::unpack_row(&row);
        assert_eq!(slots, vec![early, late, a, b]);
        assert_eq!(Slots::Packed(&row).to_vec(), slots);
    }

    #[test]
    fn sparse_rows_keep_only_set_slots() {
        const S: u64 = 1_000_000_000;
        let t0 = 1_795_986_920 * S + 123_456_789;
        let at = |t: u64, status| {
            let mut e = LifecycleEvent::new(t, Stage::Decode, Kind::Work, Source::Otlp);
            e.status = status;
            Slot::from_event(&e, 2)
        };
        let mut out = [0u64; 1 + SlotLayout::MAX];
        let slots = [
            Slot::EMPTY,
            at(t0, Some(400)),
            Slot::EMPTY,
            at(t0 - 30 * S, None),
        ];
        let n = sparse::encode(&slots, &mut out).unwrap();
        assert_eq!(n, 3, "header and the two set slots");
        assert_eq!(sparse::len(out[0], 4), 3);
        assert_eq!(sparse::decode(&out[..n], 4), slots.to_vec());
        let none = [Slot::EMPTY; 4];
        let n = sparse::encode(&none, &mut out).unwrap();
        assert_eq!((n, sparse::len(out[0], 4)), (1, 1));
        assert_eq!(sparse::decode(&out[..n], 4), none.to_vec());
        // More slots than the header has bits: stored whole.
        let mut many = vec![Slot::EMPTY; 30];
        many[29] = at(t0, None);
        let n = sparse::encode(&many, &mut out).unwrap();
        assert_eq!((n, sparse::len(out[0], 30)), (31, 31));
        assert_eq!(sparse::decode(&out[..n], 30), many);
        // Spans past the window do not encode.
        let far = [at(t0, None), at(t0 + 600 * S, None)];
        assert_eq!(sparse::encode(&far, &mut out), Err(packed::Unpackable));
    }

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
        let mut row = [0u64; mapped::max_len(7)];
        let n = mapped::encode(&slots, &mut row).unwrap();
        assert_eq!(
            (n, mapped::len(row[1])),
            (4, 4),
            "base, map and the two events"
        );
        assert_eq!(mapped::decode(&row, 7), slots.to_vec());
        let view = Slots::Mapped { row: &row, n: 7 };
        assert!(!view.any_set(0, Keep::Earliest) && view.any_set(0, Keep::EarliestPerNode));
        assert!(!mapped::has_garbage(row[1]));
        // A later event for slot 6: `a` is shared, so it gets a word of its own.
        let c = at(t0 + S, None);
        let keep = |_| Keep::Latest;
        assert_eq!(
            mapped::fold_specs(&mut row[..n + 1], 1 << 6, keep, c),
            Ok(1 << 6)
        );
        assert_eq!(mapped::len(row[1]), 5);
        // Slot 5's `b` is shared too, but the row is full: stop before changing it.
        let d = at(t0 + 2 * S, None);
        assert_eq!(
            mapped::fold_specs(&mut row[..n + 1], 1 << 5 | 1 << 6, keep, d),
            Err(mapped::Stop::Full { changed: 0 })
        );
        assert_eq!(mapped::get(&row, 5), b);
        // With room: slot 5 takes a new word, slot 6 the same one, leaving `c` unreferenced.
        assert_eq!(
            mapped::fold_specs(&mut row, 1 << 5 | 1 << 6, keep, d),
            Ok(1 << 5 | 1 << 6)
        );
        assert!(mapped::has_garbage(row[1]));
        assert_eq!(mapped::compact(&mut row, 7), 5);
        assert!(!mapped::has_garbage(row[1]));
        let want = [Slot::EMPTY, a, b, a, Slot::EMPTY, d, d];
        assert_eq!(mapped::decode(&row, 7), want.to_vec());
        // An event the base cannot hold stops the fold, row unchanged.
        let before = row;
        let far = at(t0 + 600 * S, None);
        assert_eq!(
            mapped::fold_specs(&mut row, 1 << 6, keep, far),
            Err(mapped::Stop::Rebase)
        );
        assert_eq!(row, before);
    }

    #[test]
    fn fold_keeps_extremes() {
        let at = |t| {
            Slot::from_event(
                &LifecycleEvent::new(t, Stage::Prefill, Kind::Work, Source::Otlp),
                0,
            )
        };
        let mut early = Slot::EMPTY;
        let mut late = Slot::EMPTY;
        for t in [5, 3, 9, 4] {
            early.fold(at(t), Keep::Earliest);
            late.fold(at(t), Keep::Latest);
        }
        assert_eq!((early.time(), late.time()), (3, 9));
    }
}
