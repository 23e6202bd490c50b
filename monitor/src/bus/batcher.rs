//! The agent's batcher: events in (each given its id and routed), sealed batches out, one open
//! batch per partition, sealed when it holds `batch_events` events or its oldest event waited
//! `linger`. Pure and synchronous: the agent's task drives it and hands what it seals to the
//! spool.

use std::time::Duration;

use super::partition::{Partitioner, Route};
use super::wire::{BatchHeader, WIRE_VERSION, encode};
use crate::event::LifecycleEvent;

/// A sealed batch: its subject, its `Nats-Msg-Id` and the encoded message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed {
    pub subject: String,
    pub msg_id: String,
    pub payload: Vec<u8>,
    pub events: u32,
}

struct Open {
    events: Vec<LifecycleEvent>,
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
    next_event: u64,
    /// The newest event time routed so far.
    newest: u64,
    buf: Vec<u8>,
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
            next_event: 0,
            newest: 0,
            buf: Vec::with_capacity(1 << 16),
        }
    }

    /// Links forgotten by the partitioner's bounded rid → room map.
    pub fn links_forgotten(&self) -> u64 {
        self.partitioner.links_forgotten
    }

    fn add_to(&mut self, k: usize, e: LifecycleEvent, id: u64, broadcast: bool, now_ns: u64) {
        let open = self.open[k].get_or_insert_with(|| Open {
            events: Vec::new(),
            offsets: Vec::new(),
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
                self.add_to(k as usize, e, id, false, now_ns);
                self.seal_if_full(k as usize, sealed);
            }
            Route::All => {
                let last = self.open.len() - 1;
                for k in 0..last {
                    self.add_to(k, e.clone(), id, true, now_ns);
                    self.seal_if_full(k, sealed);
                }
                self.add_to(last, e, id, true, now_ns);
                self.seal_if_full(last, sealed);
            }
        }
    }

    fn seal_if_full(&mut self, k: usize, sealed: &mut Vec<Sealed>) {
        if self.open[k]
            .as_ref()
            .is_some_and(|o| o.events.len() >= self.batch_events)
        {
            sealed.push(self.seal(k));
        }
    }

    fn seal(&mut self, k: usize) -> Sealed {
        let open = self.open[k].take().unwrap_or(Open {
            events: Vec::new(),
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
        };
        self.seqs[k] += 1;
        encode(&header, &open.events, &mut self.buf);
        Sealed {
            subject: subject(&self.stream_subject, k as u32),
            msg_id: header.batch_id(),
            payload: self.buf.clone(),
            events: open.events.len() as u32,
        }
    }

    /// Seals every batch whose first event waited `linger`.
    pub fn flush(&mut self, now_ns: u64, sealed: &mut Vec<Sealed>) {
        for k in 0..self.open.len() {
            let due = self.open[k]
                .as_ref()
                .is_some_and(|o| now_ns.saturating_sub(o.opened_ns) >= self.linger_ns);
            if due {
                sealed.push(self.seal(k));
            }
        }
    }

    /// The last batch of every partition, empty where nothing is open: each carries how far
    /// this agent's stream came ([`BatchHeader::newest`]).
    pub fn finish(&mut self, sealed: &mut Vec<Sealed>) {
        if self.next_event == 0 {
            return;
        }
        for k in 0..self.open.len() {
            sealed.push(self.seal(k));
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
        b.finish(&mut out);
        // The open batch, and an empty one for the other partition, both saying how far the
        // stream came.
        assert_eq!(out.len(), 4);
        let last: Vec<_> = out[2..]
            .iter()
            .map(|s| decode(&s.payload).unwrap())
            .collect();
        assert_eq!(last[0].header.seq, 1);
        assert!(last[1].events.is_empty());
        assert!(last.iter().all(|b| b.header.newest == 2));
    }
}
