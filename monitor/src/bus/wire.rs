//! One bus message: a batch of normalized events of one partition, from one agent.
//!
//! ```text
//! {"v":1,"node":"gpu-7","boot":1795986920376000000,"partition":2,"seq":41,"first_event":9120,"broadcast":[0,3]}
//! {"time_unix_nano":1795986920376100000,"stage":"router","kind":"dispatched",...}
//! ...
//! ```
//!
//! The first line is the [`BatchHeader`]; each further line one event in the replay format
//! (`ingest::replay`, the format `revenant check` reads: ids, times, codes and counts, never
//! prompt text). An event's id is `(node, boot, first_event + its index)`: `boot` names one
//! life of the agent (its start time), the sequence counts every event it routed, so two copies
//! of one request-level event (one per partition, see `partition`) share their id. The batch id
//! `node/boot/partition/seq` is the message's `Nats-Msg-Id`: a publish retried after a lost
//! acknowledgement is stored once, and a checker that receives a batch again (redelivery)
//! recognises it.

use serde::{Deserialize, Serialize};

use crate::event::LifecycleEvent;
use crate::ingest::replay::ReplayRecord;

/// The wire version this build writes and reads.
pub const WIRE_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchHeader {
    pub v: u32,
    /// The agent's `--node`.
    pub node: String,
    /// The agent's start time (ns since the epoch): one life of the agent.
    pub boot: u64,
    pub partition: u32,
    /// Batches of this partition from this agent life, counted from 0.
    pub seq: u64,
    /// The id of the first event; the others follow with gaps (ids are shared by partitions).
    pub first_event: u64,
    /// Per event, its id minus `first_event`.
    pub offsets: Vec<u32>,
    /// Indices of the events that went to every partition (request- and worker-level).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub broadcast: Vec<u32>,
    /// The newest event time (ns) the agent had routed when it sealed the batch, in any
    /// partition: how far the agent's stream has come. An agent that stops sends every partition
    /// a batch (empty if need be) with its last value, so that a checker judging on event time
    /// knows where the whole input ends even for partitions it does not own.
    #[serde(default)]
    pub newest: u64,
    /// The agent's wall clock (ns) when it sealed the batch: everything the agent took for this
    /// partition before then is in this batch or an earlier one. Agents send an empty batch to a
    /// partition that had nothing for a while, so a checker knows how far an idle stream came.
    #[serde(default)]
    pub sent_ns: u64,
    /// The agent life's last batch of this partition (it stopped; nothing follows).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub last: bool,
}

impl BatchHeader {
    /// `node/boot/partition/seq`: the `Nats-Msg-Id`.
    pub fn batch_id(&self) -> String {
        format!(
            "{}/{}/{}/{}",
            self.node, self.boot, self.partition, self.seq
        )
    }
}

/// A batch as the checker reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub header: BatchHeader,
    pub events: Vec<LifecycleEvent>,
}

impl Batch {
    /// The event id of event `i`.
    pub fn event_id(&self, i: usize) -> u64 {
        self.header.first_event + u64::from(self.header.offsets.get(i).copied().unwrap_or(0))
    }

    pub fn is_broadcast(&self, i: usize) -> bool {
        self.header.broadcast.binary_search(&(i as u32)).is_ok()
    }
}

/// Why a message is not a batch: counted and skipped by the checker, never a panic.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    #[error("empty message")]
    Empty,
    #[error("batch header: {0}")]
    Header(String),
    #[error("wire version {0} (this build reads {WIRE_VERSION})")]
    Version(u32),
    #[error("event line {line}: {message}")]
    Event { line: usize, message: String },
    #[error("{events} events but {offsets} offsets")]
    Count { events: usize, offsets: usize },
}

/// Encodes a header and its events.
pub fn encode(header: &BatchHeader, events: &[LifecycleEvent], out: &mut Vec<u8>) {
    out.clear();
    // Serializing these types cannot fail: no maps with non-string keys, no foreign types.
    let _ = serde_json::to_writer(&mut *out, header);
    for e in events {
        out.push(b'\n');
        let _ = serde_json::to_writer(&mut *out, &ReplayRecord::from_event(e));
    }
}

/// Decodes a message written by [`encode`].
pub fn decode(payload: &[u8]) -> Result<Batch, WireError> {
    let mut lines = payload.split(|b| *b == b'\n');
    let first = lines
        .next()
        .filter(|l| !l.is_empty())
        .ok_or(WireError::Empty)?;
    let header: BatchHeader =
        serde_json::from_slice(first).map_err(|e| WireError::Header(e.to_string()))?;
    if header.v != WIRE_VERSION {
        return Err(WireError::Version(header.v));
    }
    let mut events = Vec::with_capacity(header.offsets.len());
    for (i, l) in lines.enumerate() {
        let rec: ReplayRecord = serde_json::from_slice(l).map_err(|e| WireError::Event {
            line: i + 2,
            message: e.to_string(),
        })?;
        events.push(rec.into_event().map_err(|message| WireError::Event {
            line: i + 2,
            message,
        })?);
    }
    if events.len() != header.offsets.len() {
        return Err(WireError::Count {
            events: events.len(),
            offsets: header.offsets.len(),
        });
    }
    Ok(Batch { header, events })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Kind, Source, Stage};

    #[test]
    fn round_trip_keeps_every_field_and_the_ids() {
        let events = vec![
            LifecycleEvent::new(5, Stage::Prefill, Kind::Rejected, Source::Ebpf)
                .with_room(u64::MAX - 3)
                .with_rid("r1")
                .with_status(400)
                .with_reason("too long")
                .with_node("a"),
            LifecycleEvent::new(6, Stage::Router, Kind::Received, Source::Otlp)
                .with_request_id("q"),
        ];
        let header = BatchHeader {
            v: WIRE_VERSION,
            node: "a".into(),
            boot: 9,
            partition: 2,
            seq: 3,
            first_event: 100,
            offsets: vec![0, 7],
            broadcast: vec![1],
            newest: 6,
            sent_ns: 11,
            last: true,
        };
        let mut buf = Vec::new();
        encode(&header, &events, &mut buf);
        let b = decode(&buf).unwrap();
        assert_eq!(b.header, header);
        assert_eq!(b.events, events);
        assert_eq!((b.event_id(0), b.event_id(1)), (100, 107));
        assert!(!b.is_broadcast(0) && b.is_broadcast(1));
        assert_eq!(b.header.batch_id(), "a/9/2/3");
    }

    #[test]
    fn bad_messages_are_errors() {
        assert_eq!(decode(b""), Err(WireError::Empty));
        assert!(matches!(decode(b"{}"), Err(WireError::Header(_))));
        let h = r#"{"v":2,"node":"a","boot":1,"partition":0,"seq":0,"first_event":0,"offsets":[]}"#;
        assert_eq!(decode(h.as_bytes()), Err(WireError::Version(2)));
        let h =
            r#"{"v":1,"node":"a","boot":1,"partition":0,"seq":0,"first_event":0,"offsets":[0]}"#;
        assert!(matches!(decode(h.as_bytes()), Err(WireError::Count { .. })));
        let bad = format!("{h}\n{{\"stage\":\"nowhere\"}}");
        assert!(matches!(
            decode(bad.as_bytes()),
            Err(WireError::Event { line: 2, .. })
        ));
    }
}
