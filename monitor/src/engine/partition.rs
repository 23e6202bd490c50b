//! Which partition an event goes to: pure, deterministic, the same on every agent.
//!
//! Every event of one attempt must reach the one checker that judges the attempt, and every
//! request-level fact the attempt's rules need must reach it too. An agent sees one node only,
//! so it cannot resolve the alias graph; what it can say from the event (and from the events of
//! its own node) decides:
//!
//! - an event that names a `bootstrap_room` goes to the room's partition;
//! - one that names only a `rid` goes to the partition of the room this agent last saw that rid
//!   with (SGLang's spans name the room on the leg's root span and the rid on every span, all
//!   from the worker's own node), else to the rid's partition (vLLM: no rooms, one rid per
//!   request, the same value on every leg);
//! - one that names no attempt (request-level: the router's receipt or failure of the whole
//!   request, trace-only spans; worker-level: capacity reports, bootstrap writes that name no
//!   room) goes to **every** partition: request-scope rules and capacity predicates then find
//!   it next to each of the request's (or worker's) attempts wherever they are. A checker that
//!   owns several partitions observes such an event once (from the lowest partition it owns).
//!
//! The hash is 64-bit FNV-1a over a tagged key, so a partition number does not depend on the
//! revenant version or the machine.

use std::collections::HashMap;

use foldhash::fast::RandomState;

use crate::event::LifecycleEvent;

/// Where one event goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// One partition, `0..partitions`.
    One(u32),
    /// Every partition.
    All,
}

fn fnv1a(tag: u8, bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in std::iter::once(&tag).chain(bytes) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The partition of a room.
pub fn room_partition(room: u64, partitions: u32) -> u32 {
    (fnv1a(b'b', &room.to_le_bytes()) % u64::from(partitions.max(1))) as u32
}

/// The partition of a rid that names no room this agent knows of.
pub fn rid_partition(rid: &str, partitions: u32) -> u32 {
    (fnv1a(b'r', rid.as_bytes()) % u64::from(partitions.max(1))) as u32
}

/// A rid's key in the link tables: its 64-bit hash, the same in every process.
fn rid_key(rid: &str) -> u64 {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::with_seed(0x7265_7665_6e61_6e74).hash_one(rid)
}

/// The agent's router: the partition count and the rid → room links its node's events gave,
/// bounded (two generations of at most `max_links` each; the older one is dropped whole when the
/// newer fills, and a lookup that hits the older one moves the link forward).
pub struct Partitioner {
    partitions: u32,
    max_links: usize,
    /// Keyed by the rid's 64-bit hash ([`rid_key`]): no copy of the rid is kept, and a
    /// lookup compares one word (a collision among the links kept, about 2^-28 at 2^18
    /// links, would route one rid-only event by another rid's room).
    young: HashMap<u64, u64, RandomState>,
    old: HashMap<u64, u64, RandomState>,
    /// Links forgotten when a generation was dropped.
    pub links_forgotten: u64,
}

impl Partitioner {
    pub fn new(partitions: u32, max_links: usize) -> Partitioner {
        Partitioner {
            partitions: partitions.max(1),
            max_links: max_links.max(1),
            young: HashMap::default(),
            old: HashMap::default(),
            links_forgotten: 0,
        }
    }

    pub fn partitions(&self) -> u32 {
        self.partitions
    }

    fn remember(&mut self, rid: u64, room: u64) {
        if let Some(r) = self.young.get_mut(&rid) {
            *r = room;
            return;
        }
        if self.young.len() >= self.max_links {
            self.links_forgotten += self.old.len() as u64;
            // The dropped generation's table holds the new one: no regrowth from empty.
            let mut table = std::mem::take(&mut self.old);
            table.clear();
            self.old = std::mem::replace(&mut self.young, table);
        }
        self.young.insert(rid, room);
    }

    /// The room this rid was last seen with, if that link is still remembered.
    pub fn room_of(&mut self, rid: &str) -> Option<u64> {
        let rid = rid_key(rid);
        if let Some(r) = self.young.get(&rid) {
            return Some(*r);
        }
        let r = self.old.remove(&rid)?;
        self.remember(rid, r);
        Some(r)
    }

    /// Where `e` goes; learns the rid → room link it carries.
    pub fn route(&mut self, e: &LifecycleEvent) -> Route {
        let ids = &e.ids;
        match (ids.bootstrap_room, ids.rid.as_deref()) {
            (Some(room), rid) => {
                if let Some(rid) = rid {
                    self.remember(rid_key(rid), room.0);
                }
                Route::One(room_partition(room.0, self.partitions))
            }
            (None, Some(rid)) => match self.room_of(rid) {
                Some(room) => Route::One(room_partition(room, self.partitions)),
                None => Route::One(rid_partition(rid, self.partitions)),
            },
            (None, None) => Route::All,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Kind, Source, Stage};

    fn ev() -> LifecycleEvent {
        LifecycleEvent::new(1, Stage::Prefill, Kind::Work, Source::Otlp)
    }

    #[test]
    fn rooms_rids_and_request_level_events() {
        let mut p = Partitioner::new(4, 16);
        let room = ev().with_room(7);
        let Route::One(k) = p.route(&room) else {
            panic!("a room goes to one partition")
        };
        assert_eq!(k, room_partition(7, 4));
        assert_eq!(p.route(&ev().with_request_id("q")), Route::All);
        assert_eq!(p.route(&ev()), Route::All);
        // A rid seen with its room follows the room; an unknown rid has its own partition.
        assert_eq!(p.route(&ev().with_rid("a").with_room(7)), Route::One(k));
        assert_eq!(p.route(&ev().with_rid("a")), Route::One(k));
        assert_eq!(
            p.route(&ev().with_rid("zz")),
            Route::One(rid_partition("zz", 4))
        );
    }

    #[test]
    fn the_hash_is_fixed() {
        // Agents of different versions must agree: the numbers are part of the wire contract.
        assert_eq!(fnv1a(b'r', b""), 0xaf63_ef4c_8602_0cd5);
        let rooms: Vec<u32> = [0, 1, 2, 3, 3_550_951_926_993_981_781]
            .iter()
            .map(|r| room_partition(*r, 4))
            .collect();
        assert_eq!(rooms, [1, 0, 3, 2, 1]);
        assert_eq!(rid_partition("aaaa", 4), 1);
        let spread: std::collections::BTreeSet<u32> =
            (0..64u64).map(|r| room_partition(r, 4)).collect();
        assert_eq!(spread.len(), 4, "rooms spread over every partition");
        assert_eq!(room_partition(123, 1), 0);
    }

    #[test]
    fn links_are_bounded_and_recent_ones_kept() {
        let mut p = Partitioner::new(8, 2);
        for (i, rid) in ["a", "b", "c", "d", "e", "f"].iter().enumerate() {
            p.route(&ev().with_rid(*rid).with_room(100 + i as u64));
        }
        assert!(p.young.len() + p.old.len() <= 4);
        assert_eq!(p.links_forgotten, 2, "a and b");
        assert_eq!(
            p.route(&ev().with_rid("f")),
            Route::One(room_partition(105, 8))
        );
        assert_eq!(
            p.route(&ev().with_rid("a")),
            Route::One(rid_partition("a", 8)),
            "forgotten: the rid's own partition"
        );
    }
}
