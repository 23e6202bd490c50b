//! The per-room protocol of SGLang's KV-transfer control channel, as one process's end of it
//! sees it, and the breaches only that view can tell (see [`ProtocolBreach`]):
//! - prefill files each destinations message under `transfer_infos[room][session]` and treats
//!   the room as complete at `required_dst_info_num` distinct sessions (`mooncake/conn.py`
//!   `bootstrap_thread`, `nixl/conn.py`, `mori/conn.py`). Under the `early` policy a session
//!   beyond that count is added all the same, and prefill then writes the room's KV to it too:
//!   a decode that does not own the room. A correct deployment sends exactly that many (one per
//!   decode rank that maps to the prefill rank: 1, or decode attn-TP / prefill attn-TP, or decode
//!   attn-TP under MLA KV sharding), each from its own session, and re-sends only from the same
//!   session.
//!
//!   A room may carry several requests, though: parallel samples (`n > 1`) of one prompt share
//!   its room (`tokenizer_manager.py`: a prefix request, then each sample), as do the prompts
//!   of a batch that lists one room several times, and decode's data-parallel controller
//!   spreads them round-robin over its DP ranks, each a process with its own session, on one
//!   node or several. So a room's owners are `required_dst_info_num` times the requests SGLang
//!   runs on it, which the request body prefill's HTTP server received tells (see
//!   [`RoomProtocols::expect`]); a room whose body was not seen is not judged on owners.
//! - under `prefill_complete` (`common/bootstrap.py` `DeferredBootstrap`), decode opens a room
//!   with `[BOOTSTRAP, room, ip, port]`, prefill announces it ready (`[room, "2", rank]`) once
//!   per room lifetime (`ready_notified`), and decode publishes destinations only after that.
//!   A room's lifetime ends with its Success or Failed status; only then may decode reuse the
//!   room (retraction recompute), and a new lifetime starts.
//!
//! State is kept per (process, room), bounded: a room is forgotten when it concludes or decode
//! withdraws it (`ABORT`), and the oldest room goes first once the table is full. A room quiet
//! for longer than SGLang lets a room wait (see [`QUIET_NS`]) goes uncounted; a livelier one is
//! counted as lost. Forgetting a room only loses evidence: what follows reads as a new room.

use std::collections::VecDeque;
use std::hash::{Hash, Hasher};

use foldhash::{HashMap, HashMapExt};

use crate::event::ProtocolBreach;

/// Rooms remembered per tracker (each about a hundred bytes plus 8 per session: at most
/// about 6 MiB with every room at its session cap).
pub(super) const MAX_ROOMS: usize = 16_384;
/// Rooms whose request count is remembered, per tracker (each about 50 bytes: 3 MiB at most).
const MAX_EXPECTED: usize = 4 * MAX_ROOMS;
/// Distinct sessions remembered per room: more than the decode ranks a room's prefill rank
/// serves in any layout SGLang supports (a room asking for more is never found in surplus).
const MAX_SESSIONS: usize = 32;
/// How long a room may stay quiet before forgetting it is no loss: SGLang's prefill keeps a
/// `prefill_complete` room 600 s (`DeferredBootstrap`: waiting plus bootstrap timeout, 300 s
/// each by default), and both sides give up on a room after 300 s.
pub(super) const QUIET_NS: u64 = 600 * 1_000_000_000;

/// What one control message of a room tells its protocol.
#[derive(Debug, Clone, Copy)]
pub(super) enum RoomMessage<'a> {
    /// `[BOOTSTRAP, room, ..]`: the room runs under `prefill_complete`.
    Bootstrap,
    /// Prefill's `[room, "2", rank]`.
    Readiness,
    /// Decode's destinations from `session`, naming `required` sessions for the room.
    Destinations {
        session: Option<&'a str>,
        required: Option<u32>,
    },
    /// The room's Success or Failed status, or decode withdrew it: its lifetime ended.
    Concluded,
}

/// Which breaches this end of the channel may judge (see `Tracker::on_zmtp` for why).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Judge {
    pub owners: bool,
    pub readiness: bool,
    pub order: bool,
}

/// Where and when a room's message was seen.
#[derive(Debug, Clone, Copy)]
pub(super) struct RoomAt {
    /// The watched process at whose end the message crossed.
    pub tgid: u32,
    pub room: u64,
    /// Kernel clock.
    pub now_ns: u64,
    /// The tracker's count of control messages lost so far.
    pub loss: u64,
}

#[derive(Debug)]
struct RoomState {
    /// Which insertion of this key the eviction queue's entry is.
    seq: u64,
    /// The tracker's loss count when this room's state began: a room that lost a control
    /// message since is not judged on order or repetition (the missing one may be the readiness
    /// or the conclusion that makes the rest correct).
    loss_at_start: u64,
    /// Each distinct session.
    sessions: Vec<u64>,
    bootstrap: bool,
    readiness: u32,
    /// When a message of this room was last seen (kernel clock).
    last_ns: u64,
    /// Breaches already reported for this room (bit per [`ProtocolBreach`]): once per room.
    reported: u8,
}

/// How many requests SGLang runs on a room, as the request body prefill received says.
#[derive(Debug)]
struct Expected {
    /// Which insertion of this room the eviction queue's entry is.
    seq: u64,
    requests: u32,
    /// When a body naming the room was last seen (kernel clock).
    at_ns: u64,
}

#[derive(Debug, Default)]
pub(super) struct RoomProtocols {
    rooms: HashMap<(u32, u64), RoomState>,
    order: VecDeque<((u32, u64), u64)>,
    next_seq: u64,
    /// Per room, not per process: prefill's HTTP server (the tokenizer) and the scheduler
    /// ranks that receive the room's destinations are different processes of this node.
    expected: HashMap<u64, Expected>,
    expected_order: VecDeque<(u64, u64)>,
    /// Rooms forgotten because a table was full while they were still active.
    pub evicted: u64,
}

/// A session name as a fixed-size key (a collision merges two: a missed alert only).
fn text_key(s: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    s.hash(&mut h);
    h.finish()
}

impl RoomProtocols {
    pub(super) fn new() -> Self {
        RoomProtocols {
            rooms: HashMap::new(),
            expected: HashMap::new(),
            ..Default::default()
        }
    }

    /// A request body prefill's HTTP server received names `room` for `requests` requests
    /// (see `RequestIds::room_requests`). Bodies naming the same room while it is live add
    /// up: each request on it may bring its own decode sessions.
    pub(super) fn expect(&mut self, room: u64, requests: u32, now_ns: u64) {
        if let Some(e) = self.expected.get_mut(&room) {
            let live = now_ns.saturating_sub(e.at_ns) < QUIET_NS;
            e.requests = if live {
                e.requests.saturating_add(requests)
            } else {
                requests
            };
            e.at_ns = e.at_ns.max(now_ns);
            return;
        }
        while self.expected.len() >= MAX_EXPECTED {
            let Some((old, seq)) = self.expected_order.pop_front() else {
                break;
            };
            if let Some(e) = self.expected.get(&old).filter(|e| e.seq == seq) {
                if now_ns.saturating_sub(e.at_ns) < QUIET_NS {
                    self.evicted += 1;
                }
                self.expected.remove(&old);
            }
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        if self.expected_order.len() >= 2 * MAX_EXPECTED {
            self.expected_order
                .retain(|(r, s)| self.expected.get(r).is_some_and(|e| e.seq == *s));
        }
        self.expected_order.push_back((room, seq));
        self.expected.insert(
            room,
            Expected {
                seq,
                requests,
                at_ns: now_ns,
            },
        );
    }

    /// The requests SGLang runs on `room`, if a body naming it was seen and is not stale.
    fn requests_on(&self, room: u64, now_ns: u64) -> Option<u32> {
        self.expected
            .get(&room)
            .filter(|e| now_ns.saturating_sub(e.at_ns) < QUIET_NS)
            .map(|e| e.requests)
    }

    /// Notes `msg` as [`RoomAt`] places it, and returns the breach it makes, if `judge` lets
    /// this end report it and the room has not reported it yet; `visible` says whether the messages
    /// that make an early destinations message correct could have been seen at this end, and is
    /// asked only when one would be reported.
    pub(super) fn note(
        &mut self,
        at: RoomAt,
        msg: RoomMessage<'_>,
        judge: Judge,
        visible: impl FnOnce() -> bool,
    ) -> Option<ProtocolBreach> {
        let RoomAt {
            tgid,
            room,
            now_ns,
            loss,
        } = at;
        let key = (tgid, room);
        if let RoomMessage::Concluded = msg {
            self.rooms.remove(&key);
            // A room of one request is done with; one of several keeps its count until it
            // goes quiet (its other requests may not have started).
            if self.expected.get(&room).is_some_and(|e| e.requests <= 1) {
                self.expected.remove(&room);
            }
            return None;
        }
        let requests = self.requests_on(room, now_ns);
        let st = self.state(key, loss, now_ns);
        st.last_ns = st.last_ns.max(now_ns);
        let unbroken = st.loss_at_start == loss;
        let breach = match msg {
            RoomMessage::Bootstrap => {
                st.bootstrap = true;
                None
            }
            RoomMessage::Readiness => {
                st.readiness = st.readiness.saturating_add(1);
                (judge.readiness && unbroken && st.readiness > 1)
                    .then_some(ProtocolBreach::RepeatedReadiness)
            }
            RoomMessage::Destinations { session, required } => {
                let mut added = false;
                if let Some(s) = session.map(text_key)
                    && !st.sessions.contains(&s)
                    && st.sessions.len() < MAX_SESSIONS
                {
                    st.sessions.push(s);
                    added = true;
                }
                // Judged by the count this message names, as prefill judges it, times the
                // requests on the room; a message whose count the capture lost is not judged
                // (each decode rank names the same count, but another decode instance may name
                // another), nor a room whose request body was not seen.
                let surplus = judge.owners
                    && added
                    && required.zip(requests).is_some_and(|(r, k)| {
                        st.sessions.len() > (r as usize).saturating_mul(k as usize)
                    });
                let early = judge.order && unbroken && st.bootstrap && st.readiness == 0;
                if surplus {
                    Some(ProtocolBreach::SurplusDecodeOwner)
                } else if early {
                    Some(ProtocolBreach::DestinationsBeforeReadiness)
                } else {
                    None
                }
            }
            RoomMessage::Concluded => None,
        }?;
        let bit = 1u8 << breach as u8;
        if st.reported & bit != 0 {
            return None;
        }
        if breach == ProtocolBreach::DestinationsBeforeReadiness && !visible() {
            return None;
        }
        st.reported |= bit;
        Some(breach)
    }

    fn state(&mut self, key: (u32, u64), loss: u64, now_ns: u64) -> &mut RoomState {
        if !self.rooms.contains_key(&key) {
            while self.rooms.len() >= MAX_ROOMS {
                let Some((old, seq)) = self.order.pop_front() else {
                    break;
                };
                if let Some(st) = self.rooms.get(&old).filter(|s| s.seq == seq) {
                    if now_ns.saturating_sub(st.last_ns) < QUIET_NS {
                        self.evicted += 1;
                    }
                    self.rooms.remove(&old);
                }
            }
            let seq = self.next_seq;
            self.next_seq += 1;
            // Entries of concluded rooms stay queued until their turn: keep the queue bounded.
            if self.order.len() >= 2 * MAX_ROOMS {
                self.order
                    .retain(|(k, s)| self.rooms.get(k).is_some_and(|st| st.seq == *s));
            }
            self.order.push_back((key, seq));
            self.rooms.insert(
                key,
                RoomState {
                    seq,
                    loss_at_start: loss,
                    sessions: Vec::new(),
                    bootstrap: false,
                    readiness: 0,
                    last_ns: now_ns,
                    reported: 0,
                },
            );
        }
        self.rooms.get_mut(&key).expect("inserted above")
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.rooms.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(tgid: u32, room: u64, now_ns: u64, loss: u64) -> RoomAt {
        RoomAt {
            tgid,
            room,
            now_ns,
            loss,
        }
    }

    const ALL: Judge = Judge {
        owners: true,
        readiness: true,
        order: true,
    };

    /// Destinations from `session` (`host:port`, as Mooncake names it).
    fn dst(session: &str, required: u32) -> RoomMessage<'_> {
        RoomMessage::Destinations {
            session: Some(session),
            required: Some(required),
        }
    }

    #[test]
    fn a_surplus_session_is_reported_once_per_room() {
        let mut r = RoomProtocols::new();
        let yes = || true;
        r.expect(7, 1, 0);
        // Decode attn-TP 2 over prefill attn-TP 1: two sessions complete the room.
        assert_eq!(
            r.note(at(1, 7, 0, 0), dst("10.0.0.2:15001", 2), ALL, yes),
            None
        );
        assert_eq!(
            r.note(at(1, 7, 0, 0), dst("10.0.0.2:15002", 2), ALL, yes),
            None
        );
        // A session re-sending is the same session.
        assert_eq!(
            r.note(at(1, 7, 0, 0), dst("10.0.0.2:15001", 2), ALL, yes),
            None
        );
        assert_eq!(
            r.note(at(1, 7, 0, 0), dst("10.0.0.9:15001", 2), ALL, yes),
            Some(ProtocolBreach::SurplusDecodeOwner)
        );
        assert_eq!(
            r.note(at(1, 7, 0, 0), dst("10.0.0.9:15002", 2), ALL, yes),
            None
        );
        // Another prefill process keeps its own sessions; a concluded room starts over.
        assert_eq!(
            r.note(at(2, 7, 0, 0), dst("10.0.0.9:15001", 2), ALL, yes),
            None
        );
        r.note(at(1, 7, 0, 0), RoomMessage::Concluded, ALL, yes);
        assert_eq!(
            r.note(at(1, 7, 0, 0), dst("10.0.0.9:15001", 2), ALL, yes),
            None
        );
        // A count the capture lost is not judged; an end that does not judge owners neither.
        let lost = RoomMessage::Destinations {
            session: Some("10.0.0.3:1"),
            required: None,
        };
        r.expect(8, 1, 0);
        assert_eq!(r.note(at(1, 8, 0, 0), dst("a", 1), ALL, yes), None);
        assert_eq!(r.note(at(1, 8, 0, 0), lost, ALL, yes), None);
        let no_owners = Judge {
            owners: false,
            ..ALL
        };
        r.expect(9, 1, 0);
        assert_eq!(r.note(at(1, 9, 0, 0), dst("a", 1), no_owners, yes), None);
        assert_eq!(r.note(at(1, 9, 0, 0), dst("b", 1), no_owners, yes), None);
    }

    /// A room's owners are the count its destinations name times the requests SGLang runs on
    /// it, as the body prefill received says.
    #[test]
    fn a_rooms_owners_are_its_count_times_its_requests() {
        let mut r = RoomProtocols::new();
        let yes = || true;
        let sessions = |r: &mut RoomProtocols, room: u64, hosts: &[&str], required: u32| {
            hosts
                .iter()
                .filter_map(|h| r.note(at(1, room, 0, 0), dst(h, required), ALL, yes))
                .collect::<Vec<_>>()
        };
        // n = 3 (a prefix request and three samples) spread over three decode nodes.
        r.expect(20, 4, 0);
        assert_eq!(
            sessions(&mut r, 20, &["10.0.0.2:1", "10.0.0.3:1", "10.0.0.4:1"], 1),
            vec![]
        );
        // n = 1: a session from a second host is a second owner, once.
        r.expect(21, 1, 0);
        assert_eq!(
            sessions(&mut r, 21, &["10.0.0.2:1", "10.0.0.3:1", "10.0.0.4:1"], 1),
            vec![ProtocolBreach::SurplusDecodeOwner]
        );
        // A room listed twice in a batch: twice its count, and one more is a second owner.
        r.expect(22, 2, 0);
        assert_eq!(
            sessions(&mut r, 22, &["10.0.0.2:1", "10.0.0.2:2", "10.0.0.3:1"], 2),
            vec![]
        );
        assert_eq!(
            sessions(&mut r, 22, &["10.0.0.3:2", "10.0.0.5:1"], 2),
            vec![ProtocolBreach::SurplusDecodeOwner]
        );
        // No body seen for the room (a capture gap, or it predates the capture), or only one
        // gone stale: not judged.
        assert_eq!(
            sessions(&mut r, 23, &["10.0.0.2:1", "10.0.0.3:1"], 1),
            vec![]
        );
        r.expect(24, 1, 0);
        r.note(at(1, 24, QUIET_NS, 0), dst("10.0.0.2:1", 1), ALL, yes);
        assert_eq!(
            r.note(at(1, 24, QUIET_NS, 0), dst("10.0.0.3:1", 1), ALL, yes),
            None
        );
        // A room of one request forgets its count when it concludes (decode reusing it after a
        // retraction is not judged); a room of several keeps it for its other requests.
        r.note(at(1, 21, 0, 0), RoomMessage::Concluded, ALL, yes);
        assert_eq!(
            sessions(&mut r, 21, &["10.0.0.2:1", "10.0.0.3:1"], 1),
            vec![]
        );
        r.note(at(1, 20, 0, 0), RoomMessage::Concluded, ALL, yes);
        assert_eq!(r.requests_on(20, 0), Some(4));
        // Two bodies naming one live room add up.
        r.expect(20, 4, 1);
        assert_eq!(r.requests_on(20, 1), Some(8));
    }

    #[test]
    fn readiness_is_once_per_room_lifetime_and_before_destinations() {
        let mut r = RoomProtocols::new();
        let yes = || true;
        r.note(at(1, 5, 0, 0), RoomMessage::Bootstrap, ALL, yes);
        assert_eq!(
            r.note(at(1, 5, 0, 0), RoomMessage::Readiness, ALL, yes),
            None
        );
        assert_eq!(r.note(at(1, 5, 0, 0), dst("s", 1), ALL, yes), None);
        assert_eq!(
            r.note(at(1, 5, 0, 0), RoomMessage::Readiness, ALL, yes),
            Some(ProtocolBreach::RepeatedReadiness)
        );
        assert_eq!(
            r.note(at(1, 5, 0, 0), RoomMessage::Readiness, ALL, yes),
            None
        );
        // Success ends the lifetime: decode may reuse the room (retraction recompute).
        r.note(at(1, 5, 0, 0), RoomMessage::Concluded, ALL, yes);
        r.note(at(1, 5, 0, 0), RoomMessage::Bootstrap, ALL, yes);
        assert_eq!(
            r.note(at(1, 5, 0, 0), RoomMessage::Readiness, ALL, yes),
            None
        );
        // Destinations before readiness, under prefill_complete only.
        r.note(at(1, 6, 0, 0), RoomMessage::Bootstrap, ALL, yes);
        assert_eq!(
            r.note(at(1, 6, 0, 0), dst("s", 1), ALL, yes),
            Some(ProtocolBreach::DestinationsBeforeReadiness)
        );
        assert_eq!(
            r.note(at(1, 10, 0, 0), dst("s", 1), ALL, yes),
            None,
            "early policy"
        );
        // Not where the readiness could have gone unseen, nor after a loss.
        r.note(at(1, 11, 0, 0), RoomMessage::Bootstrap, ALL, yes);
        assert_eq!(r.note(at(1, 11, 0, 0), dst("s", 1), ALL, || false), None);
        r.note(at(1, 12, 0, 0), RoomMessage::Bootstrap, ALL, yes);
        assert_eq!(r.note(at(1, 12, 0, 1), dst("s", 1), ALL, yes), None);
        r.note(at(1, 13, 0, 0), RoomMessage::Readiness, ALL, yes);
        assert_eq!(
            r.note(at(1, 13, 0, 2), RoomMessage::Readiness, ALL, yes),
            None
        );
    }

    #[test]
    fn the_table_is_bounded_and_counts_what_it_forgets() {
        let mut r = RoomProtocols::new();
        for room in 0..(MAX_ROOMS as u64 + 10) {
            r.note(at(1, room, 0, 0), RoomMessage::Bootstrap, ALL, || true);
            if room % 2 == 0 {
                r.note(at(1, room, 0, 0), RoomMessage::Concluded, ALL, || true);
            }
        }
        assert!(r.len() <= MAX_ROOMS);
        assert!(r.order.len() <= 2 * MAX_ROOMS);
        for room in 0..(3 * MAX_ROOMS as u64) {
            r.note(at(2, room, 0, 0), RoomMessage::Readiness, ALL, || true);
        }
        assert_eq!(r.len(), MAX_ROOMS);
        let lost = r.evicted;
        assert!(lost > 0);
        assert!(r.order.len() <= 2 * MAX_ROOMS);
        // Rooms quiet for longer than SGLang keeps a room go without counting as lost.
        for room in 0..10u64 {
            r.note(
                at(3, room, QUIET_NS, 0),
                RoomMessage::Bootstrap,
                ALL,
                || true,
            );
        }
        assert_eq!(r.evicted, lost);
        assert_eq!(r.len(), MAX_ROOMS);
        // Request counts too.
        for room in 0..(MAX_EXPECTED as u64 + 10) {
            r.expect(room, 2, 0);
        }
        assert_eq!(r.expected.len(), MAX_EXPECTED);
        assert_eq!(r.evicted, lost + 10);
        assert!(r.expected_order.len() <= 2 * MAX_EXPECTED);
        for room in 0..10u64 {
            r.expect(u64::MAX - room, 2, QUIET_NS);
        }
        assert_eq!(r.evicted, lost + 10);
    }
}
