//! One remembered event ([`Slot`], 12 bytes), which event of a role it keeps ([`Keep`]), and
//! folding: how a new event replaces the earliest or latest one, per node for per-node pairs.

use crate::event::{Kind, LifecycleEvent, Source, Stage};

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
        Keep::EarliestPerNode => fold_pair(slots, k, Keep::Earliest, new),
        Keep::LatestPerNode => fold_pair(slots, k, Keep::Latest, new),
    }
}

/// [`fold_into`] for a per-node pair `k, k + 1` keeping the `single` (earliest or latest) of
/// each node.
#[inline(always)]
fn fold_pair<C: Cell>(slots: &mut [C], k: usize, single: Keep, new: C) -> bool {
    if !new.is_set() {
        return false;
    }
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
    let weaker = match single {
        Keep::Earliest => {
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

/// The specs of each keep but [`Keep::PairTail`], as bit sets: [`fold_each_split`] folds them
/// in one tight loop per keep, where [`fold_each`] looks up and dispatches on every spec's
/// keep.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeepMasks {
    earliest: u64,
    latest: u64,
    earliest_pairs: u64,
    latest_pairs: u64,
}

impl KeepMasks {
    /// No spec split off: everything goes through [`fold_each`].
    pub const NONE: KeepMasks = KeepMasks {
        earliest: 0,
        latest: 0,
        earliest_pairs: 0,
        latest_pairs: 0,
    };

    /// The masks of `keeps`, indexed by spec.
    pub fn of(keeps: &[Keep]) -> KeepMasks {
        let mut m = KeepMasks::NONE;
        for (k, keep) in keeps.iter().enumerate().take(u64::BITS as usize) {
            match keep {
                Keep::Earliest => m.earliest |= 1 << k,
                Keep::Latest => m.latest |= 1 << k,
                Keep::EarliestPerNode => m.earliest_pairs |= 1 << k,
                Keep::LatestPerNode => m.latest_pairs |= 1 << k,
                Keep::PairTail => {}
            }
        }
        m
    }
}

/// [`fold_each`] with the specs of `masks` folded without looking up their keep: the same
/// slots change (a single spec touches only its own slot, a pair only itself and its tail, so
/// the order specs are folded in does not matter).
#[inline(always)]
pub fn fold_each_split<C: Cell>(
    cells: &mut [C],
    specs: u64,
    masks: KeepMasks,
    keep: impl Fn(usize) -> Keep,
    new: C,
) -> u64 {
    if !new.is_set() {
        return 0;
    }
    let (order, mut changed) = (new.order(), 0u64);
    let mut bits = specs & masks.earliest;
    while bits != 0 {
        let k = bits.trailing_zeros() as usize;
        bits &= bits - 1;
        let c = &mut cells[k];
        if !c.is_set() || order < c.order() {
            *c = new;
            changed |= 1 << k;
        }
    }
    let mut bits = specs & masks.latest;
    while bits != 0 {
        let k = bits.trailing_zeros() as usize;
        bits &= bits - 1;
        let c = &mut cells[k];
        if !c.is_set() || order > c.order() {
            *c = new;
            changed |= 1 << k;
        }
    }
    let mut bits = specs & masks.earliest_pairs;
    while bits != 0 {
        let k = bits.trailing_zeros() as usize;
        bits &= bits - 1;
        if fold_pair(cells, k, Keep::Earliest, new) {
            changed |= 1 << k;
        }
    }
    let mut bits = specs & masks.latest_pairs;
    while bits != 0 {
        let k = bits.trailing_zeros() as usize;
        bits &= bits - 1;
        if fold_pair(cells, k, Keep::Latest, new) {
            changed |= 1 << k;
        }
    }
    // Pair tails (never matched on their own) and specs past the masks.
    let rest = specs & !(masks.earliest | masks.latest | masks.earliest_pairs | masks.latest_pairs);
    if rest == 0 {
        return changed;
    }
    changed | fold_each(cells, rest, keep, new)
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
pub struct Candidates {
    slots: [Slot; 3],
    n: u8,
}

impl Candidates {
    /// The slots of spec `k` (one, or a per-node pair).
    pub fn of(slots: &(impl SlotRead + ?Sized), k: usize, keep: Keep) -> Candidates {
        let mut c = Candidates::default();
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

impl std::ops::Deref for Candidates {
    type Target = [Slot];
    fn deref(&self) -> &[Slot] {
        &self.slots[..self.n as usize]
    }
}

/// Small interned node id; events of one node share a clock.
pub type NodeId = u16;
/// The id of "node unknown": events without a node are taken to share the local clock.
pub const NODE_LOCAL: NodeId = 0;

/// One remembered event, 12 bytes: time plus what evidence needs to say about it. Stored
/// packed in 8 bytes (see [`super::packed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C)]
pub struct Slot {
    pub(super) time_lo: u32,
    pub(super) time_hi: u32,
    /// bits 0..2 stage, 2..6 kind, 6..8 source; bit 15 set = occupied.
    pub(super) tag: u16,
    /// HTTP-style status, 0 = none.
    pub(super) status: u16,
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

pub(super) const OCCUPIED: u16 = 1 << 15;

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

/// Folds every slot of `src` into `dst`, spec by spec (pairs as pairs).
pub fn fold_all(dst: &mut [Slot], src: &[Slot], keeps: &[Keep]) {
    for (k, &keep) in keeps.iter().enumerate() {
        match keep {
            Keep::PairTail => {}
            _ if keep.is_pair() => {
                fold_into(dst, k, keep, src[k]);
                fold_into(dst, k, keep, src[k + 1]);
            }
            _ => {
                fold_into(dst, k, keep, src[k]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Kind, LifecycleEvent, Source, Stage};

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
