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
            | (((node.min(0x7f)) as u16) << 8)
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
                Keep::Earliest => other.time() < self.time(),
                Keep::Latest => other.time() > self.time(),
            };
        if replace {
            *self = other;
        }
        replace
    }
}

/// Returns the bit set of specs whose matchers match `e`.
pub fn matching_specs(specs: &[SlotSpec], e: &LifecycleEvent) -> u64 {
    let mut hit = 0u64;
    for (i, s) in specs.iter().enumerate() {
        if any_matches(&s.matchers, e) {
            hit |= 1 << i;
        }
    }
    hit
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
