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
//!   One exception in stock SGLang: parallel samples (`n > 1`) of one prompt share its room
//!   (`tokenizer_manager.py`: a prefix request, then each sample), and decode's data-parallel
//!   controller spreads them round-robin over its DP ranks, each a process with its own session.
//!   So a surplus session counts only when it comes from a host none of the room's earlier
//!   sessions is on: DP ranks of one decode instance on one node share its address.
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

/// Rooms remembered per tracker (each about a hundred bytes plus 16 per session: at most
/// about 10 MiB with every room at its session cap).
pub(super) const MAX_ROOMS: usize = 16_384;
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
    /// Decode's destinations from `session` on `host` (the decode rank's address), naming
    /// `required` sessions for the room.
    Destinations {
        session: Option<&'a str>,
        host: Option<&'a str>,
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
    /// Each distinct session, with its host.
    sessions: Vec<(u64, Option<u64>)>,
    bootstrap: bool,
    readiness: u32,
    /// When a message of this room was last seen (kernel clock).
    last_ns: u64,
    /// Breaches already reported for this room (bit per [`ProtocolBreach`]): once per room.
    reported: u8,
}

#[derive(Debug, Default)]
pub(super) struct RoomProtocols {
    rooms: HashMap<(u32, u64), RoomState>,
    order: VecDeque<((u32, u64), u64)>,
    next_seq: u64,
    /// Rooms forgotten because the table was full while they were still active.
    pub evicted: u64,
}

/// A session or host name as a fixed-size key (a collision merges two: a missed alert only).
fn text_key(s: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    s.hash(&mut h);
    h.finish()
}

impl RoomProtocols {
    pub(super) fn new() -> Self {
        RoomProtocols {
            rooms: HashMap::new(),
            ..Default::default()
        }
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
            return None;
        }
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
            RoomMessage::Destinations {
                session,
                host,
                required,
            } => {
                let host = host.map(text_key);
                // A new session from a host none of the room's sessions is on.
                let mut from_elsewhere = false;
                if let Some(s) = session.map(text_key)
                    && !st.sessions.iter().any(|(known, _)| *known == s)
                    && st.sessions.len() < MAX_SESSIONS
                {
                    from_elsewhere = host.is_some() && st.sessions.iter().all(|(_, h)| *h != host);
                    st.sessions.push((s, host));
                }
                // Judged by the count this message names, as prefill judges it; a message whose
                // count the capture lost is not judged (each decode rank names the same count,
                // but another decode instance may name another).
                let surplus = judge.owners
                    && from_elsewhere
                    && required.is_some_and(|r| st.sessions.len() > r as usize);
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

    /// Destinations from `session` (`host:port`, as Mooncake names it) on its host.
    fn dst(session: &str, required: u32) -> RoomMessage<'_> {
        RoomMessage::Destinations {
            session: Some(session),
            host: session.rsplit_once(':').map(|(h, _)| h),
            required: Some(required),
        }
    }

    #[test]
    fn a_surplus_session_is_reported_once_per_room() {
        let mut r = RoomProtocols::new();
        let yes = || true;
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
        // Another prefill process keeps its own rooms; a concluded room starts over.
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
            host: Some("10.0.0.3"),
            required: None,
        };
        assert_eq!(r.note(at(1, 8, 0, 0), dst("a", 1), ALL, yes), None);
        assert_eq!(r.note(at(1, 8, 0, 0), lost, ALL, yes), None);
        let no_owners = Judge {
            owners: false,
            ..ALL
        };
        assert_eq!(r.note(at(1, 9, 0, 0), dst("a", 1), no_owners, yes), None);
        assert_eq!(r.note(at(1, 9, 0, 0), dst("b", 1), no_owners, yes), None);
        // Parallel samples of one prompt spread over the DP ranks of one decode node: sessions
        // beyond the count, all on the room's host, are no second owner; one from another
        // host is.
        assert_eq!(
            r.note(at(1, 12, 0, 0), dst("10.0.0.2:15001", 1), ALL, yes),
            None
        );
        assert_eq!(
            r.note(at(1, 12, 0, 0), dst("10.0.0.2:15002", 1), ALL, yes),
            None
        );
        assert_eq!(
            r.note(at(1, 12, 0, 0), dst("10.0.0.2:15003", 1), ALL, yes),
            None
        );
        assert_eq!(
            r.note(at(1, 12, 0, 0), dst("10.0.0.7:15001", 1), ALL, yes),
            Some(ProtocolBreach::SurplusDecodeOwner)
        );
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
    }
}
