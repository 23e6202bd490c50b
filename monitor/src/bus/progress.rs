//! What a checker knows of every agent's stream: which batches it has taken (a redelivered or
//! republished batch is recognised and skipped) and how far each stream has come, which bounds
//! the engine's watermark.
//!
//! A stream is one agent life's batches of one partition (`node`, `boot`, `partition`), numbered
//! from 0 (`seq`). Its **progress** is what the batch at the end of its contiguous prefix says:
//! the agent's wall clock when it sealed the batch (`sent_ns`: everything that agent took before
//! that instant for that partition is in this batch or an earlier one) and the newest event time
//! it had routed (`newest`). A checker may only judge a deadline once every stream it reads has
//! come past it, or an event still on its way (in an agent's outbox while NATS is away, in a
//! backlog this checker has not consumed yet, in a batch published out of order after a retry)
//! would arrive after the verdict. So the watermark's bound is the least progress over the live
//! streams, and never the wall clock alone while a partition has not been caught up with.
//!
//! Agents send an empty batch to a partition that had nothing for a while (`heartbeat`), so an
//! idle stream moves too; a stopping agent's last batch per partition says so (`last`), which
//! ends its streams. A stream heard nothing from for `silence` while this checker is connected
//! and caught up on its partition (an agent that was killed, a node that is gone; the silence
//! counts from when this checker last reconnected at the earliest, so an outage of NATS that
//! kept every agent's batches in its outbox is not taken for agents gone) stops holding
//! the watermark back, and so does a gap in a stream's sequence (a batch the agent dropped,
//! counted there) after the same time; both are counted, and what such an agent sends later is
//! counted as late.

use std::collections::{BTreeMap, HashMap};

use super::wire::BatchHeader;

/// How a stream's progress is read: the agents' wall clocks (live traffic) or their newest
/// event times (recorded events replayed through the cluster).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgressClock {
    Wall,
    Event,
}

/// How far one stream has come.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Mark {
    sent_ns: u64,
    newest: u64,
    last: bool,
}

impl Mark {
    fn of(h: &BatchHeader) -> Mark {
        Mark {
            sent_ns: h.sent_ns,
            newest: h.newest,
            last: h.last,
        }
    }

    fn at(&self, clock: ProgressClock) -> u64 {
        match clock {
            ProgressClock::Wall => self.sent_ns,
            ProgressClock::Event => self.newest,
        }
    }
}

type StreamKey = (Box<str>, u64, u32);

#[derive(Debug)]
struct Stream {
    /// Every batch below `floor` was taken; the ones above it are in `above`.
    floor: u64,
    above: BTreeMap<u64, Mark>,
    /// The mark of batch `floor - 1`.
    progress: Mark,
    /// Checker wall time of the last batch taken from it.
    heard_ns: u64,
    /// Checker wall time since which `floor` has been missing while later batches were taken.
    gap_since_ns: Option<u64>,
    /// Stopped holding the watermark: ended (its last batch taken) or given up on (silent).
    done: bool,
}

impl Stream {
    fn fold(&mut self) {
        while let Some(e) = self.above.first_entry() {
            if *e.key() != self.floor {
                break;
            }
            let m = e.remove();
            self.progress = m;
            self.floor += 1;
        }
        if self.progress.last {
            self.done = true;
        }
        if self.above.is_empty() {
            self.gap_since_ns = None;
        }
    }
}

/// What a batch was to this checker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Taken {
    /// Seen for the first time.
    First {
        /// Its stream had been given up on (silent): the watermark may have passed its events.
        late: bool,
    },
    /// Taken before (redelivered, or republished after the duplicate window).
    Again,
}

/// What [`Streams::expire`] gave up on.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Expired {
    /// Agent nodes whose streams went silent.
    pub silent: Vec<String>,
    /// Batches never received, skipped over.
    pub gaps_skipped: u64,
}

/// Every stream this checker reads, and the partitions it owns.
#[derive(Debug)]
pub struct Streams {
    clock: ProgressClock,
    streams: HashMap<StreamKey, Stream>,
    /// Per owned partition: caught up with (nothing pending on its consumer).
    caught_up: BTreeMap<u32, bool>,
    /// Per owned partition: since when (checker wall time) it has been read without a break in
    /// the connection; silence is counted from then at the earliest.
    reading_since: BTreeMap<u32, u64>,
    connected: bool,
    /// The newest event time any batch reported.
    newest: u64,
}

impl Streams {
    pub fn new(clock: ProgressClock, owned: &[u32]) -> Streams {
        Streams {
            clock,
            streams: HashMap::new(),
            caught_up: owned.iter().map(|k| (*k, false)).collect(),
            reading_since: BTreeMap::new(),
            connected: false,
            newest: 0,
        }
    }

    /// Whether the batch was not taken before.
    pub fn is_new(&self, h: &BatchHeader) -> bool {
        let key: StreamKey = (h.node.as_str().into(), h.boot, h.partition);
        self.streams
            .get(&key)
            .is_none_or(|s| h.seq >= s.floor && !s.above.contains_key(&h.seq))
    }

    /// Records a batch taken at checker wall time `now_ns` (once its events are with the
    /// engine: from then on its progress bounds the watermark).
    pub fn take(&mut self, h: &BatchHeader, now_ns: u64) -> Taken {
        self.newest = self.newest.max(h.newest);
        let key: StreamKey = (h.node.as_str().into(), h.boot, h.partition);
        let s = self.streams.entry(key).or_insert_with(|| Stream {
            floor: 0,
            above: BTreeMap::new(),
            progress: Mark::default(),
            heard_ns: now_ns,
            gap_since_ns: None,
            done: false,
        });
        if h.seq < s.floor || s.above.contains_key(&h.seq) {
            return Taken::Again;
        }
        // A stream given up on speaks again: it holds the watermark once more.
        let late = s.done && !s.progress.last;
        s.done &= !late;
        s.heard_ns = now_ns;
        s.above.insert(h.seq, Mark::of(h));
        s.fold();
        if !s.above.is_empty() && s.gap_since_ns.is_none() {
            s.gap_since_ns = Some(now_ns);
        }
        Taken::First { late }
    }

    /// Whether partition `k`'s consumer has nothing pending, as read at checker wall time
    /// `now_ns` (the partition is being read from then on, until the connection breaks).
    pub fn set_caught_up(&mut self, k: u32, caught_up: bool, now_ns: u64) {
        if let Some(c) = self.caught_up.get_mut(&k) {
            *c = caught_up;
            self.reading_since.entry(k).or_insert(now_ns);
        }
    }

    /// Whether this checker is connected to NATS; while it is not, nothing counts as caught up.
    pub fn set_connected(&mut self, connected: bool) {
        self.connected = connected;
        if !connected {
            self.caught_up.values_mut().for_each(|c| *c = false);
            self.reading_since.clear();
        }
    }

    /// Owned partitions not known to be caught up with (their consumer had messages pending
    /// at its last look, has not looked yet, or NATS is away).
    pub fn behind(&self) -> usize {
        self.caught_up.values().filter(|c| !**c).count()
    }

    /// The streams that hold the watermark back.
    pub fn live(&self) -> usize {
        self.streams.values().filter(|s| !s.done).count()
    }

    /// How far the watermark may go at checker wall time `now_ns`: the least progress of the
    /// live streams (capped by the wall clock when reading the agents' clocks). Every owned
    /// partition must have a say: one that is not caught up with and has no live stream yet (a
    /// backlog at start, a replay that has not reached its first batch) holds everything
    /// (`None`), or its events would be judged against the other partitions' progress.
    pub fn bound(&self, now_ns: u64) -> Option<u64> {
        let mut least: Option<u64> = None;
        for (&k, &caught_up) in &self.caught_up {
            let here = self
                .streams
                .iter()
                .filter(|((_, _, p), s)| *p == k && !s.done)
                .map(|(_, s)| s.progress.at(self.clock))
                .min();
            match here {
                Some(l) => least = Some(least.map_or(l, |m| m.min(l))),
                None if caught_up && self.connected => {}
                None => return None,
            }
        }
        match (self.clock, least) {
            (ProgressClock::Wall, l) => Some(l.map_or(now_ns, |l| l.min(now_ns))),
            (ProgressClock::Event, Some(l)) => Some(l),
            // Every stream ended: the input is whole.
            (ProgressClock::Event, None) => (self.newest > 0).then_some(self.newest),
        }
    }

    /// The newest event time any batch reported.
    pub fn newest(&self) -> u64 {
        self.newest
    }

    /// Gives up on streams silent for `silence_ns` and skips gaps open that long, both only
    /// on partitions this checker is caught up with while connected (otherwise what is missing
    /// may still be on its way).
    pub fn expire(&mut self, now_ns: u64, silence_ns: u64) -> Expired {
        let mut out = Expired::default();
        if !self.connected {
            return out;
        }
        for ((node, _, k), s) in &mut self.streams {
            if s.done || !self.caught_up.get(k).copied().unwrap_or(false) {
                continue;
            }
            let Some(&reading) = self.reading_since.get(k) else {
                continue;
            };
            if let Some(since) = s.gap_since_ns
                && now_ns.saturating_sub(since.max(reading)) >= silence_ns
                && let Some((&next, _)) = s.above.first_key_value()
            {
                out.gaps_skipped += next - s.floor;
                s.floor = next;
                s.fold();
                s.gap_since_ns = (!s.above.is_empty()).then_some(now_ns);
            }
            if !s.done && now_ns.saturating_sub(s.heard_ns.max(reading)) >= silence_ns {
                s.done = true;
                out.silent.push(node.to_string());
            }
        }
        out.silent.sort_unstable();
        out.silent.dedup();
        out
    }

    /// Forgets streams that ended or went silent more than `keep_ns` ago (their batches can
    /// no longer be redelivered: the stream's retention is over).
    pub fn forget(&mut self, now_ns: u64, keep_ns: u64) {
        self.streams
            .retain(|_, s| !s.done || now_ns.saturating_sub(s.heard_ns) < keep_ns);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bus::wire::WIRE_VERSION;

    fn h(node: &str, partition: u32, seq: u64, sent_ns: u64) -> BatchHeader {
        BatchHeader {
            v: WIRE_VERSION,
            node: node.into(),
            boot: 1,
            partition,
            seq,
            first_event: 0,
            offsets: vec![],
            broadcast: vec![],
            newest: sent_ns / 2,
            sent_ns,
            last: false,
        }
    }

    const NOW: u64 = 1_000_000;

    #[test]
    fn batches_count_once_in_any_order() {
        let mut s = Streams::new(ProgressClock::Wall, &[0, 1]);
        let first = Taken::First { late: false };
        assert_eq!(s.take(&h("a", 0, 1, 10), NOW), first);
        assert_eq!(s.take(&h("a", 0, 0, 5), NOW), first);
        assert_eq!(s.take(&h("a", 0, 0, 5), NOW), Taken::Again);
        assert_eq!(s.take(&h("a", 0, 1, 10), NOW), Taken::Again);
        assert_eq!(s.take(&h("a", 1, 0, 5), NOW), first, "another partition");
        assert_eq!(s.take(&h("b", 0, 0, 5), NOW), first, "another agent");
        assert_eq!(s.take(&h("a", 0, 5, 50), NOW), first);
        assert_eq!(s.take(&h("a", 0, 5, 50), NOW), Taken::Again);
        let st = &s.streams[&("a".into(), 1, 0)];
        assert_eq!(
            (st.floor, st.above.len()),
            (2, 1),
            "contiguous prefix folded"
        );
    }

    #[test]
    fn the_bound_is_the_least_contiguous_progress_and_holds_until_caught_up() {
        let mut s = Streams::new(ProgressClock::Wall, &[0, 1]);
        s.set_connected(true);
        assert_eq!(s.bound(NOW), None, "nothing known, nothing caught up: hold");
        s.take(&h("a", 0, 0, 100), NOW);
        s.take(&h("a", 1, 0, 300), NOW);
        s.take(&h("b", 0, 0, 200), NOW);
        assert_eq!(s.bound(NOW), Some(100));
        let mut alone = Streams::new(ProgressClock::Wall, &[0, 1]);
        alone.set_connected(true);
        alone.take(&h("a", 0, 0, 100), NOW);
        assert_eq!(
            alone.bound(NOW),
            None,
            "partition 1 neither caught up nor heard from"
        );
        alone.set_caught_up(1, true, 0);
        assert_eq!(alone.bound(NOW), Some(100));
        // Batch 2 before batch 1 (a retried publish): progress waits for 1.
        s.take(&h("a", 0, 2, 500), NOW);
        assert_eq!(s.bound(NOW), Some(100));
        s.take(&h("a", 0, 1, 400), NOW);
        assert_eq!(s.bound(NOW), Some(200), "a's partition 0 at 500, b at 200");
        // Capped by the checker's own clock (an agent whose clock runs ahead).
        assert_eq!(s.bound(150), Some(150));
        // A stopping agent's last batches end its streams.
        let mut last = h("b", 0, 1, 600);
        last.last = true;
        s.take(&last, NOW);
        assert_eq!(s.bound(NOW), Some(300));
        assert_eq!(s.live(), 2);
    }

    #[test]
    fn with_no_stream_the_wall_clock_bounds_only_once_every_partition_is_caught_up() {
        let mut s = Streams::new(ProgressClock::Wall, &[0, 1]);
        s.set_connected(true);
        assert_eq!(s.behind(), 2);
        s.set_caught_up(0, true, 0);
        assert_eq!(s.bound(NOW), None);
        assert_eq!(s.behind(), 1);
        s.set_caught_up(1, true, 0);
        assert_eq!(s.bound(NOW), Some(NOW));
        assert_eq!(s.behind(), 0);
        s.set_connected(false);
        assert_eq!(s.bound(NOW), None, "disconnected: nothing is caught up");
        assert_eq!(s.behind(), 2);
    }

    #[test]
    fn silent_streams_and_old_gaps_stop_holding_only_when_caught_up_and_connected() {
        let silence = 1_000;
        let mut s = Streams::new(ProgressClock::Wall, &[0]);
        s.take(&h("a", 0, 0, 100), 0);
        s.take(&h("b", 0, 0, 900), 0);
        s.take(&h("b", 0, 2, 950), 10);
        // Not connected, then not caught up: nothing is given up on.
        assert_eq!(s.expire(5_000, silence), Expired::default());
        s.set_connected(true);
        assert_eq!(s.expire(5_000, silence), Expired::default());
        s.set_caught_up(0, true, 0);
        let e = s.expire(5_000, silence);
        assert_eq!(e.gaps_skipped, 1, "b's batch 1 never came");
        assert_eq!(e.silent, vec!["a".to_string(), "b".to_string()]);
        assert_eq!(s.live(), 0);
        assert_eq!(s.bound(6_000), Some(6_000));
        // a speaks again: its batch is late (the bound passed its progress), and it holds again.
        assert_eq!(
            s.take(&h("a", 0, 1, 200), 6_000),
            Taken::First { late: true }
        );
        assert_eq!(s.bound(6_000), Some(200));
        s.forget(100_000, silence);
        assert_eq!(s.streams.len(), 1, "b forgotten, a live again");
    }

    #[test]
    fn silence_counts_from_the_reconnection_not_from_before_an_outage() {
        let silence = 1_000;
        let mut s = Streams::new(ProgressClock::Wall, &[0]);
        s.set_connected(true);
        s.set_caught_up(0, true, 0);
        s.take(&h("a", 0, 0, 100), 100);
        // NATS away from 200 to 5 000: a's outbox holds its batches meanwhile.
        s.set_connected(false);
        assert_eq!(s.expire(3_000, silence), Expired::default());
        s.set_connected(true);
        s.set_caught_up(0, true, 5_000);
        assert_eq!(
            s.expire(5_500, silence),
            Expired::default(),
            "silent since 100, but read again only since 5 000"
        );
        assert_eq!(s.live(), 1);
        assert_eq!(s.expire(6_000, silence).silent, vec!["a".to_string()]);
    }

    #[test]
    fn event_clock_reads_newest_and_ends_at_the_newest_once_every_stream_ended() {
        let mut s = Streams::new(ProgressClock::Event, &[0]);
        assert_eq!(s.bound(NOW), None);
        let mut a = h("a", 0, 0, 100);
        a.newest = 40;
        s.take(&a, NOW);
        let mut b = h("b", 0, 0, 100);
        b.newest = 70;
        s.take(&b, NOW);
        assert_eq!(s.bound(NOW), Some(40));
        a.seq = 1;
        a.newest = 90;
        a.last = true;
        b.seq = 1;
        b.last = true;
        s.take(&a, NOW);
        s.take(&b, NOW);
        assert_eq!(
            s.bound(NOW),
            None,
            "ended, but the partition not caught up with yet"
        );
        s.set_connected(true);
        s.set_caught_up(0, true, 0);
        assert_eq!(s.bound(NOW), Some(90));
        assert_eq!(s.newest(), 90);
    }
}
