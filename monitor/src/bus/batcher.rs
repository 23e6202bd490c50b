//! The agent's batcher: events in (each given its id and routed), sealed batches out, one open
//! batch per partition, sealed when it holds `batch_events` events or its oldest event waited
//! `linger`; a partition that sealed nothing for [`HEARTBEAT`] gets an empty batch, so checkers
//! know how far this agent's stream came (`bus::progress`). Pure and synchronous: the agent's
//! task drives it and hands what it seals to the spool. An event is written into its batch's
//! columns as it is routed (`wire::EventWriter`), so nothing is kept of it, and an event that
//! goes to every partition is not copied.

use std::time::Duration;

use bytes::Bytes;

use super::partition::{Partitioner, Route};
use super::wire::{BatchHeader, EventWriter, WIRE_VERSION, encode};
use crate::event::LifecycleEvent;

/// How long a partition may go without a batch from this agent: then an empty one says how far
/// the agent came. A checker's watermark waits for the slowest stream it reads, so this is the
/// most an idle partition adds to the time a deadline takes to be judged.
pub const HEARTBEAT: Duration = Duration::from_millis(500);

/// A sealed batch: its subject, its `Nats-Msg-Id` and the encoded message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed {
    pub subject: String,
    pub msg_id: String,
    pub payload: Bytes,
    pub events: u32,
}

struct Open {
    events: EventWriter,
    offsets: Vec<u32>,
    broadcast: Vec<u32>,
    first_event: u64,
    /// Wall time (ns) the first event was added.
    opened_ns: u64,
}

pub struct Batcher {
    node: String,
    boot: u64,
    stream_subject: String,
    batch_events: usize,
    linger_ns: u64,
    partitioner: Partitioner,
    open: Vec<Option<Open>>,
    seqs: Vec<u64>,
    /// Wall time (ns) each partition's last batch was sealed.
    sealed_ns: Vec<u64>,
    next_event: u64,
    /// The newest event time routed so far.
    newest: u64,
}

/// Subject of partition `k`: `<subject prefix>.p<k>`.
pub fn subject(prefix: &str, k: u32) -> String {
    format!("{prefix}.p{k}")
}

impl Batcher {
    pub fn new(
        node: String,
        boot: u64,
        subject_prefix: String,
        partitions: u32,
        batch_events: usize,
        linger: Duration,
    ) -> Batcher {
        let p = partitions.max(1);
        Batcher {
            node,
            boot,
            stream_subject: subject_prefix,
            batch_events: batch_events.max(1),
            linger_ns: linger.as_nanos() as u64,
            partitioner: Partitioner::new(p, 1 << 16),
            open: (0..p).map(|_| None).collect(),
            seqs: vec![0; p as usize],
            sealed_ns: vec![0; p as usize],
            next_event: 0,
            newest: 0,
        }
    }

    /// Links forgotten by the partitioner's bounded rid → room map.
    pub fn links_forgotten(&self) -> u64 {
        self.partitioner.links_forgotten
    }

    fn add_to(&mut self, k: usize, e: &LifecycleEvent, id: u64, broadcast: bool, now_ns: u64) {
        let batch_events = self.batch_events;
        let open = self.open[k].get_or_insert_with(|| Open {
            events: EventWriter::with_capacity(batch_events),
            offsets: Vec::with_capacity(batch_events),
            broadcast: Vec::new(),
            first_event: id,
            opened_ns: now_ns,
        });
        if broadcast {
            open.broadcast.push(open.events.len() as u32);
        }
        // Offsets fit: a batch is sealed long before 2^32 events pass.
        open.offsets.push((id - open.first_event) as u32);
        open.events.push(e);
    }

    /// Routes one event; returns the batches it filled up.
    pub fn push(&mut self, e: LifecycleEvent, now_ns: u64, sealed: &mut Vec<Sealed>) {
        let id = self.next_event;
        self.next_event += 1;
        self.newest = self.newest.max(e.time_ns);
        match self.partitioner.route(&e) {
            Route::One(k) => {
                self.add_to(k as usize, &e, id, false, now_ns);
                self.seal_if_full(k as usize, now_ns, sealed);
            }
            Route::All => {
                for k in 0..self.open.len() {
                    self.add_to(k, &e, id, true, now_ns);
                    self.seal_if_full(k, now_ns, sealed);
                }
            }
        }
    }

    fn seal_if_full(&mut self, k: usize, now_ns: u64, sealed: &mut Vec<Sealed>) {
        if self.open[k]
            .as_ref()
            .is_some_and(|o| o.events.len() >= self.batch_events)
        {
            sealed.push(self.seal(k, now_ns, false));
        }
    }

    /// Seals partition `k`'s open batch (an empty one if none is open) at wall time `now_ns`.
    fn seal(&mut self, k: usize, now_ns: u64, last: bool) -> Sealed {
        let open = self.open[k].take().unwrap_or(Open {
            events: EventWriter::default(),
            offsets: Vec::new(),
            broadcast: Vec::new(),
            first_event: self.next_event,
            opened_ns: 0,
        });
        let header = BatchHeader {
            v: WIRE_VERSION,
            node: self.node.clone(),
            boot: self.boot,
            partition: k as u32,
            seq: self.seqs[k],
            first_event: open.first_event,
            offsets: open.offsets,
            broadcast: open.broadcast,
            newest: self.newest,
            sent_ns: now_ns,
            last,
        };
        self.seqs[k] += 1;
        self.sealed_ns[k] = now_ns;
        let msg_id = header.batch_id();
        let events = open.events.len() as u32;
        Sealed {
            subject: subject(&self.stream_subject, k as u32),
            msg_id,
            payload: encode(header, open.events.into_columns()).into(),
            events,
        }
    }

    /// Seals every batch whose first event waited `linger`, and an empty one for every
    /// partition that had no batch for [`HEARTBEAT`].
    pub fn flush(&mut self, now_ns: u64, sealed: &mut Vec<Sealed>) {
        let heartbeat = HEARTBEAT.as_nanos() as u64;
        for k in 0..self.open.len() {
            let due = match &self.open[k] {
                Some(o) => now_ns.saturating_sub(o.opened_ns) >= self.linger_ns,
                None => now_ns.saturating_sub(self.sealed_ns[k]) >= heartbeat,
            };
            if due {
                sealed.push(self.seal(k, now_ns, false));
            }
        }
    }

    /// The last batch of every partition, empty where nothing is open: each carries how far
    /// this agent's stream came and says that nothing follows ([`BatchHeader::last`]).
    pub fn finish(&mut self, now_ns: u64, sealed: &mut Vec<Sealed>) {
        for k in 0..self.open.len() {
            sealed.push(self.seal(k, now_ns, true));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bus::partition::room_partition;
    use crate::bus::wire::decode;
    use crate::event::{Kind, Source, Stage};

    #[test]
    fn full_batches_seal_and_broadcast_copies_share_their_id() {
        let mut b = Batcher::new("n".into(), 1, "S".into(), 2, 2, Duration::from_millis(5));
        let mut out = Vec::new();
        let room = |r| LifecycleEvent::new(1, Stage::Decode, Kind::Work, Source::Ebpf).with_room(r);
        let k = room_partition(7, 2);
        b.push(room(7), 0, &mut out);
        b.push(
            LifecycleEvent::new(2, Stage::Router, Kind::Received, Source::Otlp)
                .with_request_id("q"),
            0,
            &mut out,
        );
        // Partition k now holds two events (sealed); the other holds the broadcast copy.
        assert_eq!(out.len(), 1);
        let full = decode(&out[0].payload).unwrap();
        assert_eq!(out[0].subject, format!("S.p{k}"));
        assert_eq!(full.header.partition, k);
        assert_eq!((full.event_id(0), full.event_id(1)), (0, 1));
        assert!(full.is_broadcast(1));
        b.flush(1_000_000, &mut out);
        assert_eq!(out.len(), 1, "not lingered yet");
        b.flush(10_000_000, &mut out);
        assert_eq!(out.len(), 2);
        let other = decode(&out[1].payload).unwrap();
        assert_eq!(other.event_id(0), 1, "the copy keeps the event's id");
        assert_eq!(out[1].msg_id, format!("n/1/{}/0", 1 - k));
        b.push(room(7), 0, &mut out);
        b.finish(20_000_000, &mut out);
        // The open batch, and an empty one for the other partition, both saying how far the
        // stream came and that nothing follows.
        assert_eq!(out.len(), 4);
        let last: Vec<_> = out[2..]
            .iter()
            .map(|s| decode(&s.payload).unwrap())
            .collect();
        assert_eq!(last[0].header.seq, 1);
        assert!(last[1].events.is_empty());
        assert!(last.iter().all(|b| b.header.newest == 2));
        assert!(
            last.iter()
                .all(|b| b.header.last && b.header.sent_ns == 20_000_000)
        );
    }

    #[test]
    fn an_idle_partition_gets_an_empty_batch_every_heartbeat() {
        let hb = HEARTBEAT.as_nanos() as u64;
        let mut b = Batcher::new("n".into(), 1, "S".into(), 2, 100, Duration::from_millis(5));
        let mut out = Vec::new();
        b.flush(hb, &mut out);
        assert_eq!(out.len(), 2, "the first flush announces every partition");
        out.clear();
        let k = room_partition(7, 2) as usize;
        b.push(
            LifecycleEvent::new(1, Stage::Decode, Kind::Work, Source::Ebpf).with_room(7),
            hb + 1,
            &mut out,
        );
        b.flush(hb + hb / 2, &mut out);
        assert_eq!(
            out.len(),
            1,
            "the open batch lingered; the idle one is not due yet"
        );
        assert_eq!(decode(&out[0].payload).unwrap().header.partition, k as u32);
        out.clear();
        b.flush(2 * hb, &mut out);
        assert_eq!(out.len(), 1);
        let beat = decode(&out[0].payload).unwrap();
        assert_eq!(beat.header.partition, 1 - k as u32);
        assert!(beat.events.is_empty());
        assert_eq!((beat.header.seq, beat.header.sent_ns), (1, 2 * hb));
        assert!(!beat.header.last);
    }
}
