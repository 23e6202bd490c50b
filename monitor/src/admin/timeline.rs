//! `/api/requests/{id}`: the correlated timeline of a request or attempt, looked up by any alias
//! (x-request-id, trace id, rid, bootstrap room in hex or decimal).
//!
//! The admin server only knows the [`TimelineProvider`] trait. [`RecentEvents`] implements it: a
//! bounded ring of recent events plus an alias index, fed by the run loop with every event it
//! hands to the checker. Linking follows shared aliases (request → its rooms → their rids), so a
//! request id finds the decode leg that only carried the room.

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{BuildHasher, Hasher};

use foldhash::fast::FixedState;
use std::sync::{Arc, Mutex};

use crate::event::{BootstrapRoom, LifecycleEvent, RoomFields};
pub use crate::report::{Aliases, Timeline, TimelineEvent};

/// What the run loop offers the admin server.
pub trait TimelineProvider: Send + Sync + 'static {
    /// The events linked to `alias`, ordered by event time; `None` if the alias is unknown.
    fn timeline(&self, alias: &str) -> Option<Timeline>;
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Alias {
    Request(Box<str>),
    Trace(Box<str>),
    Rid(Box<str>),
    Room(u64),
}

/// The aliases an event carries, owned (read path only).
fn aliases_of(e: &LifecycleEvent) -> impl Iterator<Item = Alias> + '_ {
    let ids = &e.ids;
    ids.request_id
        .iter()
        .map(|s| Alias::Request(s.clone()))
        .chain(ids.trace_id.iter().map(|s| Alias::Trace(s.clone())))
        .chain(ids.rid.iter().map(|s| Alias::Rid(s.clone())))
        .chain(ids.bootstrap_room.iter().map(|r| Alias::Room(r.0)))
}

fn has_alias(e: &LifecycleEvent, a: &Alias) -> bool {
    let ids = &e.ids;
    match a {
        Alias::Request(s) => ids.request_id.as_deref() == Some(&**s),
        Alias::Trace(s) => ids.trace_id.as_deref() == Some(&**s),
        Alias::Rid(s) => ids.rid.as_deref() == Some(&**s),
        Alias::Room(r) => ids.bootstrap_room.map(|b| b.0) == Some(*r),
    }
}

const HASH: FixedState = FixedState::with_seed(0x7469_6d65_6c69_6e65); // "timeline"

/// 64-bit key of an alias. The write path hashes borrowed ids (no allocation); a collision only
/// costs a skipped event on read, where every candidate is checked against the real alias.
fn key_str(tag: u8, s: &str) -> u64 {
    let mut h = HASH.build_hasher();
    h.write_u8(tag);
    h.write(s.as_bytes());
    h.finish()
}

fn key_room(r: u64) -> u64 {
    let mut h = HASH.build_hasher();
    h.write_u8(3);
    h.write_u64(r);
    h.finish()
}

fn key(a: &Alias) -> u64 {
    match a {
        Alias::Request(s) => key_str(0, s),
        Alias::Trace(s) => key_str(1, s),
        Alias::Rid(s) => key_str(2, s),
        Alias::Room(r) => key_room(*r),
    }
}

#[derive(Debug, Clone, Copy)]
pub struct RecentEventsLimits {
    /// Events kept in total (oldest evicted first); 0 disables the index.
    pub max_events: usize,
    /// Events followed per alias on lookup (a hot alias cannot make one lookup unbounded).
    pub max_per_alias: usize,
    /// Events returned by one lookup.
    pub max_response_events: usize,
}

impl Default for RecentEventsLimits {
    fn default() -> Self {
        RecentEventsLimits {
            max_events: 100_000,
            max_per_alias: 512,
            max_response_events: 2_000,
        }
    }
}

/// The end of an alias chain: no earlier event names this alias.
const NO_EARLIER_EVENT: u64 = u64::MAX;

/// One indexed event: its alias keys and, per key, the previous event with the same key (a
/// linked list threaded through the ring, so no per-alias allocation).
struct Stored {
    event: LifecycleEvent,
    keys: [u64; 4],
    prev: [u64; 4],
    n: u8,
}

/// What the memory budget charges per indexed event: the ring's slot (reserved up front, so it
/// never doubles), the event's strings, and two alias keys in a table that doubles as it grows.
pub const TIMELINE_EVENT_BYTES: usize = std::mem::size_of::<Stored>()
    + crate::telemetry::memory::EVENT_HEAP_BYTES
    + 2 * 2 * LAST_SLOT_BYTES;

/// One slot of the alias → newest event table: the entry, its control byte, 1/8 kept free.
const LAST_SLOT_BYTES: usize = (std::mem::size_of::<(u64, u64)>() + 1) * 8 / 7;

struct Inner {
    /// `seq` of `events[0]`; sequence numbers are dense.
    base: u64,
    events: VecDeque<Stored>,
    /// Alias key → newest event carrying it.
    last: HashMap<u64, u64, FixedState>,
    evicted: u64,
}

/// Bounded recent-events index keyed by every alias.
pub struct RecentEvents {
    limits: RecentEventsLimits,
    inner: Mutex<Inner>,
}

impl RecentEvents {
    pub fn new(limits: RecentEventsLimits) -> RecentEvents {
        RecentEvents {
            limits,
            inner: Mutex::new(Inner {
                base: 0,
                // The whole ring at once: growing by doubling would hold up to twice the bound
                // (and both buffers while it copies); untouched pages cost no memory. One more
                // than the bound: an event is pushed before the oldest is evicted.
                events: VecDeque::with_capacity(limits.max_events + 1),
                last: HashMap::with_hasher(FixedState::with_seed(0x6c617374)),
                evicted: 0,
            }),
        }
    }

    /// Events pushed out by the bound since start.
    pub fn evicted(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).evicted
    }

    /// Estimated heap bytes held now (for the memory budget's account).
    pub fn estimated_bytes(&self) -> usize {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.events.len()
            * (std::mem::size_of::<Stored>() + crate::telemetry::memory::EVENT_HEAP_BYTES)
            + g.last.capacity() * LAST_SLOT_BYTES
    }

    pub fn len(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .events
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records events the run loop handed to the checker (call once per batch).
    pub fn record<'a>(&self, batch: impl IntoIterator<Item = &'a LifecycleEvent>) {
        // `--timeline-events 0` turns the index (and its per-event cost) off.
        if self.limits.max_events == 0 {
            return;
        }
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        for e in batch {
            let mut keys = [0u64; 4];
            let mut n = 0usize;
            let ids = &e.ids;
            for (tag, v) in [(0u8, &ids.request_id), (1, &ids.trace_id), (2, &ids.rid)] {
                if let Some(v) = v {
                    keys[n] = key_str(tag, v);
                    n += 1;
                }
            }
            if let Some(r) = ids.bootstrap_room {
                keys[n] = key_room(r.0);
                n += 1;
            }
            if n == 0 {
                // Nothing could ever look it up.
                continue;
            }
            let seq = g.base + g.events.len() as u64;
            let mut prev = [NO_EARLIER_EVENT; 4];
            for i in 0..n {
                prev[i] = g.last.insert(keys[i], seq).unwrap_or(NO_EARLIER_EVENT);
            }
            g.events.push_back(Stored {
                event: e.clone(),
                keys,
                prev,
                n: n as u8,
            });
            while g.events.len() > self.limits.max_events {
                let old = g.events.pop_front().expect("non-empty");
                let old_seq = g.base;
                g.base += 1;
                g.evicted += 1;
                for k in &old.keys[..old.n as usize] {
                    if g.last.get(k) == Some(&old_seq) {
                        g.last.remove(k);
                    }
                }
            }
        }
    }
}

fn to_timeline_event(e: &LifecycleEvent) -> TimelineEvent {
    let s = |v: &Option<Box<str>>| v.as_deref().map(str::to_string);
    TimelineEvent {
        time_ns: e.time_ns,
        stage: e.stage,
        kind: e.kind,
        source: e.source,
        request_id: s(&e.ids.request_id),
        trace_id: s(&e.ids.trace_id),
        rid: s(&e.ids.rid),
        room: e.ids.bootstrap_room.map(|r| RoomFields::new(r.0)),
        node: s(&e.node),
        worker: s(&e.worker),
        status: e.status,
        reason: s(&e.reason),
        to: e.to,
    }
}

/// Alias hops followed from the queried id: request → rooms → rids covers router, prefill and
/// decode legs; more hops would start joining unrelated requests through shared workers.
const MAX_HOPS: usize = 3;

impl RecentEvents {
    /// Events carrying `a`, newest first, at most `max_per_alias`.
    fn walk(&self, g: &Inner, a: &Alias, out: &mut Vec<u64>) {
        let k = key(a);
        let Some(&mut_seq) = g.last.get(&k) else {
            return;
        };
        let mut seq = mut_seq;
        let mut steps = 0;
        while seq != NO_EARLIER_EVENT && seq >= g.base && steps < self.limits.max_per_alias {
            let st = &g.events[(seq - g.base) as usize];
            let Some(i) = st.keys[..st.n as usize].iter().position(|x| *x == k) else {
                break;
            };
            if has_alias(&st.event, a) {
                out.push(seq);
            }
            seq = st.prev[i];
            steps += 1;
        }
    }
}

impl TimelineProvider for RecentEvents {
    fn timeline(&self, query: &str) -> Option<Timeline> {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let q: Box<str> = query.into();
        let mut frontier: Vec<Alias> = [
            Alias::Request(q.clone()),
            Alias::Trace(q.clone()),
            Alias::Rid(q.clone()),
        ]
        .into_iter()
        .chain(
            query
                .parse::<BootstrapRoom>()
                .ok()
                .map(|r| Alias::Room(r.0)),
        )
        // Trace ids are hex, kept lower-case: an upper-case spelling names the same trace.
        .chain(
            (query.len() == 32
                && query.bytes().all(|b| b.is_ascii_hexdigit())
                && query.bytes().any(|b| b.is_ascii_uppercase()))
            .then(|| Alias::Trace(query.to_ascii_lowercase().into())),
        )
        .collect();
        let mut seen_alias: HashSet<Alias> = HashSet::new();
        let mut seqs: HashSet<u64> = HashSet::new();
        for _ in 0..MAX_HOPS {
            let mut next = Vec::new();
            for a in &frontier {
                let mut found = Vec::new();
                self.walk(&g, a, &mut found);
                if !found.is_empty() {
                    seen_alias.insert(a.clone());
                }
                for seq in found {
                    if !seqs.insert(seq) {
                        continue;
                    }
                    let st = &g.events[(seq - g.base) as usize];
                    for b in aliases_of(&st.event) {
                        if !seen_alias.contains(&b) && !next.contains(&b) && !frontier.contains(&b)
                        {
                            next.push(b);
                        }
                    }
                }
            }
            if next.is_empty() {
                break;
            }
            frontier = next;
        }
        if seqs.is_empty() {
            return None;
        }
        let mut seqs: Vec<u64> = seqs.into_iter().collect();
        seqs.sort_unstable();
        let truncated = seqs.len() > self.limits.max_response_events;
        if truncated {
            seqs.drain(..seqs.len() - self.limits.max_response_events);
        }
        let mut events: Vec<TimelineEvent> = seqs
            .iter()
            .map(|s| to_timeline_event(&g.events[(s - g.base) as usize].event))
            .collect();
        events.sort_by_key(|e| e.time_ns);
        let mut aliases = Aliases::default();
        let mut sorted: Vec<&Alias> = seen_alias.iter().collect();
        sorted.sort_by_key(|a| format!("{a:?}"));
        for a in sorted {
            match a {
                Alias::Request(s) => aliases.request_ids.push(s.to_string()),
                Alias::Trace(s) => aliases.trace_ids.push(s.to_string()),
                Alias::Rid(s) => aliases.rids.push(s.to_string()),
                Alias::Room(r) => aliases.bootstrap_rooms.push(RoomFields::new(*r)),
            }
        }
        Some(Timeline {
            query: query.to_string(),
            aliases,
            events,
            truncated,
        })
    }
}

/// Feeds the `/api/requests/{id}` timeline from the engine task: a pipeline tap.
pub struct TimelineTap(pub Arc<RecentEvents>);

impl crate::pipeline::EventTap for TimelineTap {
    fn batch(&mut self, batch: &crate::pipeline::EventBatch, _: u64) -> std::io::Result<()> {
        self.0.record(batch);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Kind, Source, Stage};

    fn ev(t: u64, stage: Stage, kind: Kind) -> LifecycleEvent {
        LifecycleEvent::new(t, stage, kind, Source::Otlp)
    }

    #[test]
    fn request_id_reaches_decode_leg_through_room() {
        let idx = RecentEvents::new(RecentEventsLimits::default());
        let batch = vec![
            ev(1, Stage::Router, Kind::Received).with_request_id("req-1"),
            ev(2, Stage::Router, Kind::Dispatched)
                .with_request_id("req-1")
                .with_room(0xabc),
            ev(3, Stage::Prefill, Kind::Rejected)
                .with_rid("p-1")
                .with_room(0xabc)
                .with_status(400),
            ev(4, Stage::Decode, Kind::Work)
                .with_rid("d-1")
                .with_room(0xabc),
            ev(5, Stage::Decode, Kind::Work).with_rid("d-1"),
            ev(6, Stage::Router, Kind::Received).with_request_id("other"),
        ];
        idx.record(&batch);
        let t = idx.timeline("req-1").expect("known");
        assert_eq!(
            t.events.iter().map(|e| e.time_ns).collect::<Vec<_>>(),
            vec![1, 2, 3, 4, 5]
        );
        assert_eq!(t.aliases.bootstrap_rooms, vec![RoomFields::new(0xabc)]);
        // Any alias works, the room in hex or decimal too.
        assert_eq!(idx.timeline("d-1").unwrap().events.len(), 5);
        assert_eq!(idx.timeline("2748").unwrap().events.len(), 5);
        assert!(idx.timeline("nope").is_none());
    }

    /// Rooms above 2^53 keep every digit: decimal strings with the hex next to them, in the
    /// events and in the aliases, found by either spelling.
    #[test]
    fn rooms_are_written_as_decimal_strings_with_hex() {
        let room = 9_066_467_638_188_682_269;
        let idx = RecentEvents::new(RecentEventsLimits::default());
        idx.record(&[
            ev(1, Stage::Prefill, Kind::Rejected).with_room(room),
            ev(2, Stage::Decode, Kind::Work).with_room(room),
        ]);
        let pair = serde_json::json!({
            "bootstrap_room": "9066467638188682269",
            "bootstrap_room_hex": "0x7dd29047ddcfac1d",
        });
        for query in ["9066467638188682269", "0x7dd29047ddcfac1d"] {
            let t = serde_json::to_value(idx.timeline(query).expect("known")).unwrap();
            assert_eq!(
                t["aliases"]["bootstrap_rooms"],
                serde_json::json!([pair]),
                "{t}"
            );
            for e in t["events"].as_array().unwrap() {
                assert_eq!(e["bootstrap_room"], pair["bootstrap_room"], "{e}");
                assert_eq!(e["bootstrap_room_hex"], pair["bootstrap_room_hex"], "{e}");
            }
        }
    }

    #[test]
    fn bounded_and_evicts_oldest() {
        let idx = RecentEvents::new(RecentEventsLimits {
            max_events: 10,
            max_per_alias: 4,
            max_response_events: 3,
        });
        let batch: Vec<_> = (0..25)
            .map(|i| ev(i, Stage::Decode, Kind::Work).with_rid(format!("r{}", i % 2)))
            .collect();
        let capacity = |idx: &RecentEvents| idx.inner.lock().unwrap().events.capacity();
        let ring = capacity(&idx);
        idx.record(&batch);
        assert_eq!(idx.len(), 10);
        assert_eq!(idx.evicted(), 15);
        assert_eq!(capacity(&idx), ring, "the ring never grows");
        let t = idx.timeline("r0").unwrap();
        assert!(t.truncated);
        assert_eq!(
            t.events.iter().map(|e| e.time_ns).collect::<Vec<_>>(),
            vec![20, 22, 24]
        );
    }
}
