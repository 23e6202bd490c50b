//! Compact per-attempt memory of the events rules care about.
//!
//! A rule never needs an attempt's full history: it needs "the earliest trigger" or "the latest
//! forbidden event". Each such need is a [`SlotSpec`]; the engine keeps one 12-byte [`Slot`] per
//! spec per attempt, in one flat arena, so tracking an attempt costs no allocation.

use crate::event::{Kind, LifecycleEvent, Source, Stage};

use super::matcher::{Matcher, any_matches};

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

/// Folds `new` into the slot(s) of spec `k`: one slot for `Earliest`/`Latest`, the pair `k, k+1`
/// for the per-node keeps. With a third node the pair keeps the two most extreme events.
pub fn fold_into(slots: &mut [Slot], k: usize, keep: Keep, new: Slot) -> bool {
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
            let (a, b) = (slots[k].time(), slots[k + 1].time());
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

/// The slots a spec occupies (one, or the pair of a per-node keep).
pub fn spec_slots(slots: &[Slot], k: usize, keep: Keep) -> impl Iterator<Item = Slot> + '_ {
    let n = if keep.is_pair() { 2 } else { 1 };
    slots[k..k + n].iter().copied()
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
    pub fn of(slots: &[Slot], k: usize, keep: Keep) -> Cands {
        let mut c = Cands::default();
        for s in spec_slots(slots, k, keep) {
            c.push(s);
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

/// One remembered event, 12 bytes: time plus what evidence needs to say about it.
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

    /// Folds `other` into `self` keeping the earliest or latest.
    pub fn fold(&mut self, other: Slot, keep: Keep) -> bool {
        if !other.is_set() {
            return false;
        }
        let replace = !self.is_set()
            || match keep {
                Keep::Earliest | Keep::EarliestPerNode => other.time() < self.time(),
                Keep::Latest | Keep::LatestPerNode => other.time() > self.time(),
                Keep::PairTail => false,
            };
        if replace {
            *self = other;
        }
        replace
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
        let set = crate::checker::RuleSet::embedded_defaults();
        let (mut a, mut r) = (SlotLayout::default(), SlotLayout::default());
        crate::checker::rules::compile(&set, &mut a, &mut r);
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
