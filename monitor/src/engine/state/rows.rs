//! Live attempts' slot rows, stored sparsely in size classes.
//!
//! An attempt sets only some of its slots (a normal one 19 of the default rules' 29, a rejected
//! one fewer), and several of those remember the same event (the normal one's 19 hold 9), so a
//! dense row of one word per slot is mostly zeros and repeats. Here a row is a [`mapped`] row, the base, its map words
//! (one, or two past 15 slots) and one word per distinct remembered event, kept in the smallest
//! class of rows that holds it.
//! Every class carves its rows out of its own 64 KiB chunks of one slab (so a row is found
//! from its word offset alone, with no per-class table on the read path) and threads a free
//! list through its free rows (no side vector to account for). A row that needs a word past
//! its width drops the words no slot refers to any more, or else moves to the next class; a
//! fresh attempt has no row until its first slot is set.
//!
//! Layouts of more slots than two map words index ([`MAPPED_MAX`]) keep one class of dense
//! [`packed`] rows. Rows that cannot be packed at all (events spanning more than the packed
//! window, a status above 1023) or that remember more distinct events than a mapped row's word
//! indices name ([`mapped::WORDS_MAX`]) are wide: full slots in a side map.

use std::collections::HashMap;

use foldhash::fast::FixedState;

use super::mapped::{self, MAPPED_MAX, Stop};
use super::slot::KeepMasks;
use super::{Keep, Slot, SlotLayout, Slots, fold_specs_full, packed};
use crate::engine::mem::NO_INDEX;
use crate::engine::mem::stable_hash::stable_hasher;

/// Where an owner's row is: a class and an index in it. Stored by the owner as its two fields
/// (a `u8` and a `u32` fit an attempt record's tail padding; this struct would not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowRef {
    /// [`NO_ROW`], [`WIDE_ROW`], or 1 + the class.
    pub class: u8,
    /// The row's first word in the slab (chunk << [`CHUNK_BITS`] | offset in the chunk).
    pub index: u32,
}

/// No slot set: no row.
pub const NO_ROW: u8 = 0;
/// The slots are full-width, in the side map.
pub const WIDE_ROW: u8 = u8::MAX;

impl RowRef {
    pub const NONE: RowRef = RowRef {
        class: NO_ROW,
        index: NO_INDEX,
    };
}

/// What an absent row reads as: every slot empty (a mapped row of no word, or a dense row of
/// zero words).
static ZERO_ROW: [u64; ZERO_LEN] = [0; ZERO_LEN];
/// The longest of a full mapped row and a dense row of the most slots.
const ZERO_LEN: usize = {
    let (mapped, dense) = (mapped::max_len(MAPPED_MAX), 1 + SlotLayout::MAX);
    if mapped > dense { mapped } else { dense }
};

/// Words per slab chunk (64 KiB): a chunk holds rows of one class.
const CHUNK_BITS: u32 = 13;
const CHUNK_WORDS: usize = 1 << CHUNK_BITS;

struct Class {
    width: usize,
    /// First free row (`NO_INDEX`: none); a free row's first word is the next one's index.
    free: u32,
    /// Where the next never-used row starts, and where its chunk ends (equal: no room).
    next: u32,
    end: u32,
}

/// The slot rows of every live attempt.
pub struct SlotRows {
    /// Slots per row (the attempt layout's specs).
    n: usize,
    /// More slots than a mapped row indexes: one class of dense packed rows.
    dense: bool,
    /// Every class's chunks.
    slab: Vec<Box<[u64]>>,
    classes: Vec<Class>,
    keeps: Vec<Keep>,
    /// `keeps`' single-slot specs, folded without a look at their keep.
    masks: KeepMasks,
    /// Full slots of wide rows, by owner.
    wide: HashMap<u32, Box<[Slot]>, FixedState>,
}

/// Row widths in words (base and map words included) for rows of `n` slots. Two words per step
/// from five (room for three events with one map word, two with two): an attempt adds events a
/// few at a time over its first events, and a step of one word (or a first class of one) would
/// move a growing row at nearly every event.
fn class_widths(n: usize) -> Vec<usize> {
    let mut widths = Vec::new();
    let mut w = 5;
    while w < mapped::max_len(n) {
        widths.push(w);
        w += 2;
    }
    widths.push(mapped::max_len(n));
    widths
}

impl SlotRows {
    pub fn new(keeps: Vec<Keep>) -> SlotRows {
        let n = keeps.len();
        let dense = n > MAPPED_MAX;
        let widths = if dense { vec![1 + n] } else { class_widths(n) };
        SlotRows {
            n,
            dense,
            slab: Vec::new(),
            classes: widths
                .into_iter()
                .map(|width| Class {
                    width,
                    free: NO_INDEX,
                    next: 0,
                    end: 0,
                })
                .collect(),
            masks: KeepMasks::of(&keeps),
            keeps,
            wide: HashMap::with_hasher(stable_hasher()),
        }
    }

    pub fn keeps(&self) -> &[Keep] {
        &self.keeps
    }

    /// Rows whose slots did not fit a packed or mapped row.
    pub fn wide_len(&self) -> usize {
        self.wide.len()
    }

    /// Heap bytes reserved by every chunk (free and never-used rows included).
    pub fn capacity_bytes(&self) -> usize {
        self.slab.len() * CHUNK_WORDS * 8
            + self.slab.capacity() * std::mem::size_of::<Box<[u64]>>()
            + self.classes.capacity() * std::mem::size_of::<Class>()
    }

    /// The words from row `index` to the end of its chunk (the row and whatever follows it).
    #[inline(always)]
    fn tail(&self, index: u32) -> &[u64] {
        &self.slab[(index >> CHUNK_BITS) as usize][index as usize & (CHUNK_WORDS - 1)..]
    }

    #[inline]
    fn row(&self, r: RowRef) -> &[u64] {
        &self.tail(r.index)[..self.classes[r.class as usize - 1].width]
    }

    #[inline]
    fn row_mut(&mut self, r: RowRef) -> &mut [u64] {
        let width = self.classes[r.class as usize - 1].width;
        let chunk = &mut self.slab[(r.index >> CHUNK_BITS) as usize];
        let at = r.index as usize & (CHUNK_WORDS - 1);
        &mut chunk[at..at + width]
    }

    /// The slots of the owner `id` whose row is `r`.
    #[inline(always)]
    pub fn view(&self, r: RowRef, id: u32) -> Slots<'_> {
        let row = match r.class {
            NO_ROW => &ZERO_ROW,
            WIDE_ROW => {
                return Slots::Wide(self.wide.get(&id).expect("a wide row keeps its slots"));
            }
            // A mapped row finds its words through its map: the chunk's tail serves as the row.
            _ => self.tail(r.index),
        };
        if self.dense {
            Slots::Packed(&row[..1 + self.n])
        } else {
            Slots::Mapped {
                row,
                n: self.n as u8,
            }
        }
    }

    /// A free row of class `c` (0-based), its words unspecified.
    fn alloc(&mut self, c: usize) -> RowRef {
        let class = &mut self.classes[c];
        let index = match class.free {
            NO_INDEX => {
                let width = class.width as u32;
                if class.end - class.next < width {
                    assert!(
                        self.slab.len() < (u32::MAX >> CHUNK_BITS) as usize,
                        "row offsets fit 32 bits"
                    );
                    class.next = (self.slab.len() << CHUNK_BITS) as u32;
                    class.end = class.next + CHUNK_WORDS as u32;
                    self.slab.push(vec![0; CHUNK_WORDS].into_boxed_slice());
                }
                class.next += width;
                class.next - width
            }
            i => {
                let chunk = &self.slab[(i >> CHUNK_BITS) as usize];
                class.free = chunk[i as usize & (CHUNK_WORDS - 1)] as u32;
                i
            }
        };
        RowRef {
            class: c as u8 + 1,
            index,
        }
    }

    /// Returns row `r` (a real one) to its class's free list.
    fn release(&mut self, r: RowRef) {
        let free = self.classes[r.class as usize - 1].free;
        self.row_mut(r)[0] = free as u64;
        self.classes[r.class as usize - 1].free = r.index;
    }

    /// The smallest class whose rows hold `words` words.
    fn class_for(&self, words: usize) -> usize {
        self.classes
            .iter()
            .position(|c| c.width >= words)
            .expect("the last class holds a full row")
    }

    /// Moves the first `words` words of `from` into a row of the larger class `c`; returns the
    /// new row.
    fn relocate(&mut self, from: RowRef, c: usize, words: usize) -> RowRef {
        let mut buf = [0u64; mapped::max_len(MAPPED_MAX)];
        buf[..words].copy_from_slice(&self.row(from)[..words]);
        let to = self.alloc(c);
        self.row_mut(to)[..words].copy_from_slice(&buf[..words]);
        self.release(from);
        to
    }

    /// Writes an encoded row (`words`, header first) for the owner, in the smallest class that
    /// holds it (in place when its class is that one).
    fn place(&mut self, r: &mut RowRef, words: &[u64]) {
        let c = self.class_for(words.len());
        match r.class {
            NO_ROW => *r = self.alloc(c),
            WIDE_ROW => unreachable!("wide rows are placed by the caller"),
            k if k as usize - 1 != c => {
                self.release(*r);
                *r = self.alloc(c);
            }
            _ => {}
        }
        self.row_mut(*r)[..words.len()].copy_from_slice(words);
    }

    /// Folds `slot` into every spec of the owner's row whose bit is set in `specs`; a row that
    /// can no longer be packed, or would need more distinct words than a mapped row names,
    /// becomes wide. Returns the specs whose slots changed.
    #[inline]
    pub fn fold(&mut self, r: &mut RowRef, id: u32, specs: u64, slot: Slot) -> u64 {
        if specs == 0 || !slot.is_set() {
            return 0;
        }
        if r.class == WIDE_ROW {
            return self.fold_wide(id, specs, slot);
        }
        if self.dense {
            return self.fold_dense_row(r, id, specs, slot);
        }
        if r.class == NO_ROW {
            match mapped::fresh(slot) {
                Ok(header) => {
                    let words = 1 + mapped::maps(self.n);
                    *r = self.alloc(0);
                    self.row_mut(*r)[..words].copy_from_slice(&header[..words]);
                }
                Err(packed::Unpackable) => {
                    let slots = vec![Slot::EMPTY; self.n].into_boxed_slice();
                    self.wide.insert(id, slots);
                    r.class = WIDE_ROW;
                    return self.fold_wide(id, specs, slot);
                }
            }
        }
        let mut changed = 0;
        loop {
            let c = r.class as usize - 1;
            let width = self.classes[c].width;
            let chunk = &mut self.slab[(r.index >> CHUNK_BITS) as usize];
            let at = r.index as usize & (CHUNK_WORDS - 1);
            let row = &mut chunk[at..at + width];
            let keeps = &self.keeps;
            match mapped::fold_specs(row, self.n, specs, |k| keeps[k], slot) {
                Ok(more) => return changed | more,
                Err(Stop::Full { changed: more }) => {
                    changed |= more;
                    let len = mapped::len(row, self.n);
                    if !mapped::has_garbage(row, self.n) || mapped::compact(row, self.n) == len {
                        *r = self.relocate(*r, c + 1, len);
                    }
                }
                // Encoding the folded slots again merges equal words and drops unreferenced
                // ones; slots that still need more than the row's word indices name go wide.
                Err(Stop::Words { changed: more }) => {
                    return changed | more | self.fold_reencoded(r, id, specs, slot);
                }
                Err(Stop::Rebase) => return changed | self.fold_reencoded(r, id, specs, slot),
            }
        }
    }

    /// Layouts too wide for mapped rows: one class of dense packed rows.
    fn fold_dense_row(&mut self, r: &mut RowRef, id: u32, specs: u64, slot: Slot) -> u64 {
        if r.class == NO_ROW {
            *r = self.alloc(0);
            self.row_mut(*r).fill(0);
        }
        let width = self.classes[0].width;
        let chunk = &mut self.slab[(r.index >> CHUNK_BITS) as usize];
        let at = r.index as usize & (CHUNK_WORDS - 1);
        let row = &mut chunk[at..at + width];
        let keeps = &self.keeps;
        match packed::fold_specs_split(row, specs, self.masks, |k| keeps[k], slot) {
            Ok(changed) => changed,
            Err(packed::Unpackable) => {
                self.wide.insert(id, packed::unpack_row(row).into());
                self.release(*r);
                r.class = WIDE_ROW;
                self.fold_wide(id, specs, slot)
            }
        }
    }

    /// `slot` does not fit the row's base, or needs a word index the row has not got: fold on
    /// full slots and encode them again (under a new base, equal words once; wide when no base
    /// fits or they remember more distinct events than a mapped row holds).
    #[cold]
    fn fold_reencoded(&mut self, r: &mut RowRef, id: u32, specs: u64, slot: Slot) -> u64 {
        let mut all = mapped::decode(self.row(*r), self.n);
        let changed = fold_specs_full(&mut all, &self.keeps, specs, slot);
        self.store(r, id, &all);
        changed
    }

    fn fold_wide(&mut self, id: u32, specs: u64, slot: Slot) -> u64 {
        let slots = self.wide.get_mut(&id).expect("a wide row keeps its slots");
        fold_specs_full(slots, &self.keeps, specs, slot)
    }

    /// Replaces the owner's slots with `slots` (mapped or dense when they pack, else wide; no
    /// row when none is set).
    pub fn store(&mut self, r: &mut RowRef, id: u32, slots: &[Slot]) {
        debug_assert_eq!(slots.len(), self.n);
        if r.class == WIDE_ROW {
            self.wide.remove(&id);
            r.class = NO_ROW;
        }
        if !slots.iter().any(Slot::is_set) {
            self.clear(r, id);
            return;
        }
        let mut buf = [0u64; 1 + SlotLayout::MAX];
        let encoded = if self.dense {
            packed::store_row(&mut buf[..1 + self.n], slots)
                .map(|()| 1 + self.n)
                .map_err(mapped::Unfit::from)
        } else {
            mapped::encode(slots, &mut buf)
        };
        match encoded {
            Ok(len) => self.place(r, &buf[..len]),
            Err(mapped::Unfit::Unpackable | mapped::Unfit::Words) => {
                if r.class != NO_ROW {
                    self.release(*r);
                }
                self.wide.insert(id, slots.into());
                r.class = WIDE_ROW;
            }
        }
    }

    /// Frees the owner's row (a freed owner), wide slots included.
    pub fn clear(&mut self, r: &mut RowRef, id: u32) {
        match r.class {
            NO_ROW => {}
            WIDE_ROW => {
                self.wide.remove(&id);
            }
            _ => self.release(*r),
        }
        *r = RowRef::NONE;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Kind, LifecycleEvent, Source, Stage};

    const S: u64 = 1_000_000_000;
    const T0: u64 = 1_795_986_920 * S;

    fn keeps(n: usize) -> Vec<Keep> {
        let mut k = Vec::new();
        while k.len() < n {
            match k.len() % 5 {
                0 => k.push(Keep::Earliest),
                1 => k.push(Keep::Latest),
                2 if k.len() + 2 <= n => k.extend([Keep::EarliestPerNode, Keep::PairTail]),
                3 if k.len() + 2 <= n => k.extend([Keep::LatestPerNode, Keep::PairTail]),
                _ => k.push(Keep::Earliest),
            }
        }
        k
    }

    fn at(t: u64, kind: Kind, status: Option<u16>, node: u16) -> Slot {
        let mut e = LifecycleEvent::new(t, Stage::Decode, kind, Source::Ebpf);
        e.status = status;
        Slot::from_event(&e, node)
    }

    /// Specs an event may hit: any but pair tails.
    fn specs_mask(keeps: &[Keep], bits: u64) -> u64 {
        let mut m = 0;
        for (k, keep) in keeps.iter().enumerate() {
            if *keep != Keep::PairTail && bits & (1 << k) != 0 {
                m |= 1 << k;
            }
        }
        m
    }

    struct Owners {
        rows: SlotRows,
        refs: Vec<RowRef>,
        truth: Vec<Vec<Slot>>,
    }

    impl Owners {
        fn new(n_slots: usize, owners: usize) -> Owners {
            Owners::with_keeps(keeps(n_slots), owners)
        }

        fn with_keeps(keeps: Vec<Keep>, owners: usize) -> Owners {
            let n_slots = keeps.len();
            Owners {
                rows: SlotRows::new(keeps),
                refs: vec![RowRef::NONE; owners],
                truth: vec![vec![Slot::EMPTY; n_slots]; owners],
            }
        }

        fn len(&self, o: usize) -> usize {
            mapped::len(self.rows.row(self.refs[o]), self.rows.n)
        }

        fn fold(&mut self, o: usize, specs: u64, slot: Slot) -> u64 {
            let keeps = self.rows.keeps().to_vec();
            let was_wide = self.refs[o].class == WIDE_ROW;
            let want = fold_specs_full(&mut self.truth[o], &keeps, specs, slot);
            let got = self.rows.fold(&mut self.refs[o], o as u32, specs, slot);
            assert_eq!(got, want, "changed specs of owner {o}");
            if !was_wide && self.refs[o].class == WIDE_ROW && !self.rows.dense {
                // Only slots that fit no mapped row go wide.
                let mut buf = [0u64; mapped::max_len(MAPPED_MAX)];
                assert!(
                    mapped::encode(&self.truth[o], &mut buf).is_err(),
                    "owner {o}"
                );
            }
            self.check(o);
            got
        }

        fn check(&self, o: usize) {
            let view = self.rows.view(self.refs[o], o as u32);
            assert_eq!(view.to_vec(), self.truth[o], "owner {o}");
            for (k, s) in self.truth[o].iter().enumerate() {
                assert_eq!(view.get(k), *s, "owner {o} slot {k}");
            }
        }

        fn clear(&mut self, o: usize) {
            self.rows.clear(&mut self.refs[o], o as u32);
            self.truth[o].fill(Slot::EMPTY);
            self.check(o);
        }
    }

    fn xorshift(rng: &mut u64) -> u64 {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        *rng
    }

    /// Random folds into many owners, against full slots folded the plain way: rows grow
    /// through the classes, drop words no slot refers to, move, and are freed and reused.
    fn random_round_trip(n_slots: usize, spread: u64) {
        let mut o = Owners::new(n_slots, 40);
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for step in 0..20_000 {
            let owner = (xorshift(&mut rng) % 40) as usize;
            if xorshift(&mut rng).is_multiple_of(50) {
                o.clear(owner);
                continue;
            }
            let r = xorshift(&mut rng);
            let t = T0 + r % spread;
            let kind = Kind::ALL[(r >> 40) as usize % Kind::ALL.len()];
            let status = [None, Some(200), Some(400), Some(503)][(r >> 50) as usize % 4];
            let node = ((r >> 56) % 3) as u16;
            let specs = specs_mask(o.rows.keeps(), xorshift(&mut rng) & xorshift(&mut rng));
            o.fold(owner, specs, at(t, kind, status, node));
            if step % 1000 == 0 {
                for i in 0..40 {
                    o.check(i);
                }
            }
        }
        if n_slots <= mapped::WORDS_MAX {
            assert_eq!(o.rows.wide_len(), 0, "everything here packs");
        }
    }

    #[test]
    fn mapped_rows_round_trip_through_classes() {
        random_round_trip(13, 100 * S);
        random_round_trip(15, 5 * S);
        random_round_trip(3, 1_000);
        random_round_trip(16, 20 * S);
        random_round_trip(27, 100 * S);
        random_round_trip(31, 5 * S);
    }

    #[test]
    fn dense_rows_for_wide_layouts_round_trip() {
        let o = Owners::new(MAPPED_MAX + 1, 1);
        assert!(o.rows.dense);
        random_round_trip(40, 100 * S);
    }

    #[test]
    fn layouts_of_up_to_31_slots_keep_mapped_rows() {
        for (n, widths) in [
            (13, vec![5, 7, 9, 11, 13, 15]),
            (15, vec![5, 7, 9, 11, 13, 15, 17]),
            (16, vec![5, 7, 9, 11, 13, 15, 17, 18]),
            (27, vec![5, 7, 9, 11, 13, 15, 17, 18]),
            (31, vec![5, 7, 9, 11, 13, 15, 17, 18]),
        ] {
            let rows = SlotRows::new(keeps(n));
            assert!(!rows.dense, "{n} slots");
            let got: Vec<usize> = rows.classes.iter().map(|c| c.width).collect();
            assert_eq!(got, widths, "{n} slots");
            // An absent row reads as every slot empty, in both map words.
            assert_eq!(rows.view(RowRef::NONE, 0).to_vec(), vec![Slot::EMPTY; n]);
        }
        assert!(SlotRows::new(keeps(MAPPED_MAX + 1)).dense);
    }

    fn work(t: u64) -> Slot {
        at(t, Kind::Work, None, 0)
    }

    #[test]
    fn two_map_word_rows_grow_share_and_compact() {
        let mut o = Owners::with_keeps(vec![Keep::Latest; 27], 1);
        // One event for slots of both map words: one word.
        assert_eq!(
            o.fold(0, 1 << 1 | 1 << 16 | 1 << 26, work(T0)),
            1 << 1 | 1 << 16 | 1 << 26
        );
        assert_eq!((o.refs[0].class, o.len(0)), (1, 1 + 2 + 1));
        assert_eq!(o.rows.row(o.refs[0]).len(), 5, "room for two words");
        // A later event for 16: `a` is shared, so it takes a word of its own, filling the row.
        o.fold(0, 1 << 16, work(T0 + S));
        assert_eq!((o.refs[0].class, o.len(0)), (1, 1 + 2 + 2));
        // One for 26 (`a` still shared with slot 1): the full row moves to the next class.
        o.fold(0, 1 << 26, work(T0 + 2 * S));
        assert_eq!((o.refs[0].class, o.len(0)), (2, 1 + 2 + 3));
        // Slot 16's word is its own now: overwritten in place, and slot 21 takes it too.
        o.fold(0, 1 << 16 | 1 << 21, work(T0 + 3 * S));
        assert_eq!(o.len(0), 1 + 2 + 3);
        // One event for 16 and 21, which share a word: a new word for both, the old one (that
        // only second-map-word slots referred to) garbage.
        assert!(!mapped::has_garbage(o.rows.row(o.refs[0]), 27));
        o.fold(0, 1 << 16 | 1 << 21, work(T0 + 4 * S));
        assert!(mapped::has_garbage(o.rows.row(o.refs[0]), 27));
        assert_eq!(o.len(0), 1 + 2 + 4);
        assert_eq!(o.len(0), o.rows.row(o.refs[0]).len(), "full");
        // The next word drops it instead of moving the row.
        o.fold(0, 1 << 5, work(T0 + 5 * S));
        assert_eq!((o.refs[0].class, o.len(0)), (2, 1 + 2 + 4));
        assert!(!mapped::has_garbage(o.rows.row(o.refs[0]), 27));
        // A per-node pair across the map boundary (14, 15): a second node's event goes to 15.
        let mut keeps = vec![Keep::Latest; 27];
        (keeps[14], keeps[15]) = (Keep::EarliestPerNode, Keep::PairTail);
        let mut o = Owners::with_keeps(keeps, 1);
        o.fold(0, 1 << 14 | 1 << 3, at(T0, Kind::Work, None, 0));
        o.fold(0, 1 << 14 | 1 << 20, at(T0 + S, Kind::Work, None, 1));
        assert_eq!(o.truth[0][15], at(T0 + S, Kind::Work, None, 1));
        assert_eq!(o.len(0), 1 + 2 + 2);
    }

    /// Fifteen distinct events (word indices 1 to 15, the last in the second map word), the
    /// first also in slot 10.
    fn fifteen_words(o: &mut Owners, owner: usize) {
        let slots = [0usize, 1, 2, 3, 4, 5, 6, 7, 15, 16, 17, 18, 19, 20, 26];
        for (i, &k) in slots.iter().enumerate() {
            let specs = if i == 0 { 1 | 1 << 10 } else { 1 << k };
            o.fold(owner, specs, work(T0 + i as u64 * S));
        }
        assert_eq!(o.len(owner), mapped::max_len(27));
    }

    #[test]
    fn a_row_needing_a_sixteenth_word_goes_wide() {
        let mut o = Owners::with_keeps(vec![Keep::Latest; 27], 3);
        for owner in 0..3 {
            fifteen_words(&mut o, owner);
        }
        // Owner 0: a sixteenth distinct event (slot 10's word is shared with slot 0): wide,
        // every slot intact (`fold` checks them), counted with the other wide rows.
        o.fold(0, 1 << 10, work(T0 + 20 * S));
        assert_eq!(o.refs[0].class, WIDE_ROW);
        assert_eq!(o.rows.wide_len(), 1);
        // Owner 1: an event the row already holds, in an empty slot: the fold stops for a
        // sixteenth word, but encoding again stores it once.
        o.fold(1, 1 << 12, work(T0 + 3 * S));
        assert_ne!(o.refs[1].class, WIDE_ROW);
        assert_eq!(o.len(1), mapped::max_len(27));
        // Owner 2: one event replacing both slots of a shared word: fifteen words again.
        o.fold(2, 1 | 1 << 10, work(T0 + 20 * S));
        assert_ne!(o.refs[2].class, WIDE_ROW);
        assert_eq!(o.rows.wide_len(), 1);
        // The wide row keeps folding; storing fifteen distinct events packs it again,
        // sixteen stay wide.
        o.fold(0, 1 << 22, work(T0 + 21 * S));
        let mut slots = o.truth[0].clone();
        slots[22] = Slot::EMPTY;
        o.rows.store(&mut o.refs[0], 0, &slots);
        assert_eq!((o.refs[0].class, o.rows.wide_len()), (WIDE_ROW, 1));
        slots[10] = Slot::EMPTY;
        o.rows.store(&mut o.refs[0], 0, &slots);
        o.truth[0] = slots;
        assert_ne!(o.refs[0].class, WIDE_ROW);
        assert_eq!(o.rows.wide_len(), 0);
        for owner in 0..3 {
            o.check(owner);
        }
    }

    #[test]
    fn a_full_row_with_garbage_takes_a_new_word_without_going_wide() {
        let mut o = Owners::with_keeps(vec![Keep::Latest; 31], 1);
        // Fourteen distinct events, the first in slots 0 and 20.
        for i in 0..14 {
            let specs = if i == 0 { 1 | 1 << 20 } else { 1 << i };
            o.fold(0, specs, work(T0 + i as u64 * S));
        }
        // A later one for 0 and 20: a fifteenth word, the first garbage.
        o.fold(0, 1 | 1 << 20, work(T0 + 20 * S));
        assert_eq!(o.len(0), mapped::max_len(31));
        assert!(mapped::has_garbage(o.rows.row(o.refs[0]), 31));
        // A sixteenth word fits once the garbage is dropped.
        o.fold(0, 1 << 30, work(T0 + 21 * S));
        assert_ne!(o.refs[0].class, WIDE_ROW);
        assert_eq!(o.len(0), mapped::max_len(31));
        assert!(!mapped::has_garbage(o.rows.row(o.refs[0]), 31));
    }

    proptest::proptest! {
        /// Random folds, merges (`store`) and frees over a few owners of mapped rows of 7 to 31
        /// slots read back as the same folds into plain slots (`Owners::fold` also checks that
        /// a row goes wide only when its slots fit no mapped row).
        #[test]
        fn random_folds_into_rows_match_plain_slots(
            n in proptest::sample::select(vec![7usize, 15, 16, 27, 31]),
            ops in proptest::collection::vec(
                (0usize..3, proptest::num::u64::ANY, 0u64..30, 0u32..4, 0u16..3, 0u32..40),
                1..200,
            ),
        ) {
            let mut o = Owners::new(n, 3);
            for (owner, bits, t, few, node, what) in ops {
                match what {
                    0 => o.clear(owner),
                    1 => {
                        let slots = o.truth[owner].clone();
                        o.rows.store(&mut o.refs[owner], owner as u32, &slots);
                        o.check(owner);
                    }
                    _ => {
                        // Few specs per event, most of the time: more distinct events per row.
                        let specs = specs_mask(o.rows.keeps(), bits >> (few * 16) & ((1 << n) - 1));
                        let kind = [Kind::Work, Kind::Admitted, Kind::Completed][what as usize % 3];
                        o.fold(owner, specs, at(T0 + t * 3 * S, kind, None, node));
                    }
                }
            }
            if n <= mapped::WORDS_MAX {
                proptest::prop_assert_eq!(o.rows.wide_len(), 0);
            }
        }
    }

    #[test]
    fn rows_start_small_grow_and_rebase() {
        let mut o = Owners::new(13, 2);
        // No row before the first slot.
        assert_eq!(o.refs[0].class, NO_ROW);
        o.check(0);
        assert_eq!(o.fold(0, 0b1, at(T0, Kind::Work, None, 0)), 0b1);
        assert_eq!(o.refs[0].class, 1, "a fresh row takes the smallest class");
        // One event kept by three specs is one word.
        assert_eq!(o.fold(0, 0b110, at(T0 + S, Kind::Admitted, None, 0)), 0b110);
        let len = |o: &Owners, i: usize| mapped::len(o.rows.row(o.refs[i]), 13);
        assert_eq!(len(&o, 0), 4, "base, map, two distinct words");
        // Distinct events grow the row through the classes.
        for (i, k) in [6usize, 7, 10, 11, 12].into_iter().enumerate() {
            o.fold(0, 1 << k, at(T0 + (2 + i as u64) * S, Kind::Work, None, 0));
        }
        assert_eq!(len(&o, 0), 2 + 7);
        assert_eq!(o.rows.row(o.refs[0]).len(), 9);
        // An event 8.5 minutes later re-bases the row.
        let base = o.rows.row(o.refs[0])[0];
        o.fold(0, 1 << 1, at(T0 + 510 * S, Kind::Completed, Some(200), 1));
        assert_ne!(o.rows.row(o.refs[0])[0], base);
        // One event moving two slots: the second takes the first's word, its own is garbage...
        assert!(!mapped::has_garbage(o.rows.row(o.refs[0]), 13));
        o.fold(0, 1 << 10 | 1 << 12, at(T0 + S / 2, Kind::Work, None, 0));
        assert!(mapped::has_garbage(o.rows.row(o.refs[0]), 13));
        // ... until the row is full: then it is dropped instead of the row moving.
        let (class, used) = (o.refs[0].class, len(&o, 0));
        for k in 0..=o.rows.row(o.refs[0]).len() - used {
            o.fold(
                0,
                1 << [4, 5, 9][k],
                at(T0 + 500 * S + k as u64, Kind::Work, None, 0),
            );
        }
        assert_eq!(o.refs[0].class, class);
        assert!(!mapped::has_garbage(o.rows.row(o.refs[0]), 13));
    }

    #[test]
    fn unpackable_rows_go_wide_and_come_back() {
        let mut o = Owners::new(13, 3);
        // A status above 10 bits, on a fresh row and on an existing one.
        o.fold(0, 0b1, at(T0, Kind::Completed, Some(1024), 0));
        assert_eq!(o.refs[0].class, WIDE_ROW);
        o.fold(1, 0b1, at(T0, Kind::Work, None, 0));
        o.fold(1, 0b10, at(T0 + S, Kind::Completed, Some(1024), 0));
        assert_eq!(o.refs[1].class, WIDE_ROW);
        // A span past the packed window.
        o.fold(2, 0b1, at(T0, Kind::Work, None, 0));
        o.fold(2, 0b10, at(T0 + 1200 * S, Kind::Work, None, 0));
        assert_eq!(o.refs[2].class, WIDE_ROW);
        assert_eq!(o.rows.wide_len(), 3);
        // Wide rows keep folding, and storing packable slots (a merge) packs them again.
        o.fold(2, 0b100, at(T0 + 5 * S, Kind::Work, None, 1));
        let mut slots = o.truth[2].clone();
        slots[1] = Slot::EMPTY;
        o.rows.store(&mut o.refs[2], 2, &slots);
        o.truth[2] = slots;
        assert_ne!(o.refs[2].class, WIDE_ROW);
        o.check(2);
        // Storing no set slot leaves no row; clearing drops the wide slots.
        o.rows.store(&mut o.refs[2], 2, &[Slot::EMPTY; 13]);
        assert_eq!(o.refs[2].class, NO_ROW);
        o.clear(0);
        o.clear(1);
        assert_eq!(o.rows.wide_len(), 0);
    }

    #[test]
    fn freed_rows_are_reused() {
        let mut o = Owners::new(13, 3000);
        let fill = |o: &mut Owners| {
            for i in 0..3000 {
                for k in [0usize, 1, 6, 7, 10] {
                    o.fold(i, 1 << k, at(T0 + (i * 16 + k) as u64, Kind::Work, None, 0));
                }
            }
        };
        fill(&mut o);
        let bytes = o.rows.capacity_bytes();
        for i in 0..3000 {
            o.clear(i);
        }
        fill(&mut o);
        assert_eq!(
            o.rows.capacity_bytes(),
            bytes,
            "the second round fits the freed rows"
        );
        for i in 0..3000 {
            o.check(i);
        }
    }
}
