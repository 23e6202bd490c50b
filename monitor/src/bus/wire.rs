//! One bus message: a batch of normalized events of one partition, from one agent, in protobuf
//! (hand-written `prost` messages; this file is the schema).
//!
//! ```text
//! message Batch {
//!   BatchHeader header = 1;  // ids, partition, progress; its field 1 is the wire version
//!   Columns events = 2;      // the events, one column per field
//! }
//! ```
//!
//! The [`BatchHeader`] says where the batch comes from: an event's id is `(node, boot,
//! first_event + offsets[i])`: `boot` names one life of the agent (its start time), the sequence
//! counts every event it routed, so two copies of one request-level event (one per partition,
//! see `partition`) share their id. The batch id `node/boot/partition/seq` is the message's
//! `Nats-Msg-Id`: a publish retried after a lost acknowledgement is stored once, and a checker
//! that receives a batch again (redelivery) recognises it. Adding a header field is one line
//! with a new tag; readers of the same version skip fields they do not know.
//!
//! [`Columns`] carries exactly what the replay format (`ingest::replay`, what `revenant check`
//! reads) carries of a [`LifecycleEvent`]: ids, times, codes, counts and short reasons, never
//! prompt or completion text (the type has none). Per event a time delta and a `shape` (stage,
//! kind, source, `to`, `peer`, `protocol_breach` and which optional fields it has, see
//! [`shape`]); the optional
//! values follow in their own columns, in event order, for the events that have them. Request
//! ids, trace ids and rids are concatenated in one string; node, worker, reason and detail
//! values, which repeat, are written once per batch in `names` and referred to by index. Rooms
//! are `fixed64`: SGLang draws them from the whole u64 range.
//!
//! A message of another version (v1 was a JSON Lines batch) is a [`WireError::Version`]; a
//! malformed one another [`WireError`]: the checker counts and skips it.
//!
//! `protocol_breach` (shape bits 27 to 29) came after the first v2 readers, and its third bit
//! (the vLLM KV-handoff breaches) after the second: an older reader takes a batch with an event
//! it cannot read for malformed and skips it, so upgrade checkers before agents.

use std::collections::HashMap;

use foldhash::fast::RandomState;
use prost::Message;

use crate::event::{
    BootstrapRoom, Kind, LifecycleEvent, Peer, ProtocolBreach, Source, Stage, truncate_reason,
};

/// The wire version this build writes and reads.
pub const WIRE_VERSION: u32 = 2;

/// Events one batch may hold (`--batch-events` at most): a message claiming more is refused
/// before anything is built for it.
pub const MAX_EVENTS: usize = 65536;

/// Where a batch comes from and how far its agent has come. One line per field.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct BatchHeader {
    /// [`WIRE_VERSION`]; read before anything else.
    #[prost(uint32, tag = "1")]
    pub v: u32,
    /// The agent's `--node`.
    #[prost(string, tag = "2")]
    pub node: String,
    /// The agent's start time (ns since the epoch): one life of the agent.
    #[prost(uint64, tag = "3")]
    pub boot: u64,
    #[prost(uint32, tag = "4")]
    pub partition: u32,
    /// Batches of this partition from this agent life, counted from 0.
    #[prost(uint64, tag = "5")]
    pub seq: u64,
    /// The id of the first event; the others follow with gaps (ids are shared by partitions).
    #[prost(uint64, tag = "6")]
    pub first_event: u64,
    /// Per event, its id minus `first_event`.
    #[prost(uint32, repeated, tag = "7")]
    pub offsets: Vec<u32>,
    /// Indices of the events that went to every partition (request- and worker-level).
    #[prost(uint32, repeated, tag = "8")]
    pub broadcast: Vec<u32>,
    /// The newest event time (ns) the agent had routed when it sealed the batch, in any
    /// partition: how far the agent's stream has come. An agent that stops sends every partition
    /// a batch (empty if need be) with its last value, so that a checker judging on event time
    /// knows where the whole input ends even for partitions it does not own.
    #[prost(uint64, tag = "9")]
    pub newest: u64,
    /// The agent's wall clock (ns) when it sealed the batch: everything the agent took for this
    /// partition before then is in this batch or an earlier one. Agents send an empty batch to a
    /// partition that had nothing for a while, so a checker knows how far an idle stream came.
    #[prost(uint64, tag = "10")]
    pub sent_ns: u64,
    /// The agent life's last batch of this partition (it stopped; nothing follows).
    #[prost(bool, tag = "11")]
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

/// The events of a batch, column by column. Every column but `time` and `shape` holds values
/// only for the events whose shape says they have one, in event order.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Columns {
    /// Per event: its time (ns) minus the previous event's (the first: minus 0), wrapping.
    #[prost(sint64, repeated, tag = "1")]
    pub time: Vec<i64>,
    /// Per event: see [`shape`].
    #[prost(uint32, repeated, tag = "2")]
    pub shape: Vec<u32>,
    #[prost(fixed64, repeated, tag = "3")]
    pub room: Vec<u64>,
    #[prost(uint32, repeated, tag = "4")]
    pub pid: Vec<u32>,
    #[prost(uint32, repeated, tag = "5")]
    pub status: Vec<u32>,
    /// Input, context, max input and max total tokens, those present, per event in that order.
    #[prost(uint64, repeated, tag = "6")]
    pub tokens: Vec<u64>,
    /// Request id, trace id and rid, those present, per event in that order: their lengths in
    /// bytes, and the strings concatenated.
    #[prost(uint32, repeated, tag = "7")]
    pub id_len: Vec<u32>,
    #[prost(string, tag = "8")]
    pub ids: String,
    /// The distinct node, worker, reason and detail values of the batch.
    #[prost(string, repeated, tag = "9")]
    pub names: Vec<String>,
    /// Node, worker, reason and detail, those present, per event in that order: the index of
    /// the value in `names`.
    #[prost(uint32, repeated, tag = "10")]
    pub name_ref: Vec<u32>,
}

/// A whole message.
#[derive(Clone, PartialEq, prost::Message)]
struct WireBatch {
    #[prost(message, optional, tag = "1")]
    header: Option<BatchHeader>,
    #[prost(message, optional, tag = "2")]
    events: Option<Columns>,
}

/// What is read before the rest: field 1 of the header, whatever else a message of another
/// version holds.
#[derive(Clone, PartialEq, prost::Message)]
struct VersionOnly {
    #[prost(message, optional, tag = "1")]
    header: Option<VersionField>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct VersionField {
    #[prost(uint32, tag = "1")]
    v: u32,
}

/// The bits of [`Columns::shape`]: stage (2 bits), kind (4), source (2), then one bit per
/// optional field, `to` and `peer` as their value + 1 (0: none). The common fields come first,
/// so a typical event's shape is a two-byte varint.
pub mod shape {
    pub const STAGE: u32 = 0;
    pub const KIND: u32 = 2;
    pub const SOURCE: u32 = 6;
    pub const ROOM: u32 = 1 << 8;
    pub const RID: u32 = 1 << 9;
    pub const REQUEST_ID: u32 = 1 << 10;
    pub const TRACE_ID: u32 = 1 << 11;
    pub const NODE: u32 = 1 << 12;
    pub const STATUS: u32 = 1 << 13;
    /// 3 bits: 0 none, else the stage + 1.
    pub const TO: u32 = 14;
    /// 2 bits: 0 none, else the peer + 1.
    pub const PEER: u32 = 17;
    pub const PID: u32 = 1 << 19;
    pub const WORKER: u32 = 1 << 20;
    pub const REASON: u32 = 1 << 21;
    pub const DETAIL: u32 = 1 << 22;
    pub const INPUT_TOKENS: u32 = 1 << 23;
    pub const CONTEXT_TOKENS: u32 = 1 << 24;
    pub const MAX_INPUT_TOKENS: u32 = 1 << 25;
    pub const MAX_TOTAL_TOKENS: u32 = 1 << 26;
    /// 3 bits: 0 none, else the protocol breach + 1.
    pub const BREACH: u32 = 27;
    /// Bits above these are not defined.
    pub const ALL: u32 = (1 << 30) - 1;
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
    #[error("not a batch: {0}")]
    Malformed(String),
    #[error("batch header: {0}")]
    Header(String),
    #[error("wire version {0} (this build reads {WIRE_VERSION})")]
    Version(u32),
    #[error("event {index}: {message}")]
    Event { index: usize, message: String },
    #[error("{events} events but {offsets} offsets")]
    Count { events: usize, offsets: usize },
}

/// An open batch's events, written into their columns as they come: the event itself is not
/// kept (a request-level event written to every partition is not copied).
#[derive(Debug, Default)]
pub struct EventWriter {
    cols: Columns,
    last_time: u64,
    /// Index in `cols.names` of each value.
    names: HashMap<Box<str>, u32, RandomState>,
    /// The index last used for node, worker, reason and detail, + 1 (0: none yet): an agent's
    /// events mostly repeat them, so most lookups are one comparison.
    recent: [u32; 4],
}

impl EventWriter {
    /// A writer for about `events` events.
    pub fn with_capacity(events: usize) -> EventWriter {
        let mut w = EventWriter::default();
        w.cols.time.reserve(events);
        w.cols.shape.reserve(events);
        w
    }

    pub fn len(&self) -> usize {
        self.cols.time.len()
    }

    pub fn is_empty(&self) -> bool {
        self.cols.time.is_empty()
    }

    fn name(&mut self, slot: usize, value: &str) {
        let recent = self.recent[slot];
        let idx = if recent > 0 && self.cols.names[recent as usize - 1] == value {
            recent - 1
        } else if let Some(i) = self.names.get(value) {
            *i
        } else {
            let i = self.cols.names.len() as u32;
            self.cols.names.push(value.to_owned());
            self.names.insert(value.into(), i);
            i
        };
        self.recent[slot] = idx + 1;
        self.cols.name_ref.push(idx);
    }

    fn id(&mut self, value: &str) {
        self.cols.id_len.push(value.len() as u32);
        self.cols.ids.push_str(value);
    }

    /// Appends one event.
    pub fn push(&mut self, e: &LifecycleEvent) {
        let mut s = (e.stage as u32) << shape::STAGE
            | (e.kind as u32) << shape::KIND
            | (e.source as u32) << shape::SOURCE;
        self.cols
            .time
            .push(e.time_ns.wrapping_sub(self.last_time) as i64);
        self.last_time = e.time_ns;
        if let Some(r) = e.ids.bootstrap_room {
            s |= shape::ROOM;
            self.cols.room.push(r.0);
        }
        if let Some(v) = &e.ids.request_id {
            s |= shape::REQUEST_ID;
            self.id(v);
        }
        if let Some(v) = &e.ids.trace_id {
            s |= shape::TRACE_ID;
            self.id(v);
        }
        if let Some(v) = &e.ids.rid {
            s |= shape::RID;
            self.id(v);
        }
        if let Some(v) = &e.node {
            s |= shape::NODE;
            self.name(0, v);
        }
        if let Some(v) = &e.worker {
            s |= shape::WORKER;
            self.name(1, v);
        }
        if let Some(v) = &e.reason {
            s |= shape::REASON;
            self.name(2, truncate_reason(v));
        }
        if let Some(v) = &e.detail {
            s |= shape::DETAIL;
            self.name(3, truncate_reason(v));
        }
        if let Some(v) = e.status {
            s |= shape::STATUS;
            self.cols.status.push(u32::from(v));
        }
        if let Some(v) = e.pid {
            s |= shape::PID;
            self.cols.pid.push(v);
        }
        if let Some(to) = e.to {
            s |= (to as u32 + 1) << shape::TO;
        }
        if let Some(p) = e.peer {
            s |= (p as u32 + 1) << shape::PEER;
        }
        if let Some(b) = e.protocol_breach {
            s |= (b as u32 + 1) << shape::BREACH;
        }
        for (bit, v) in [
            (shape::INPUT_TOKENS, e.input_tokens),
            (shape::CONTEXT_TOKENS, e.context_tokens),
            (shape::MAX_INPUT_TOKENS, e.max_input_tokens),
            (shape::MAX_TOTAL_TOKENS, e.max_total_tokens),
        ] {
            if let Some(v) = v {
                s |= bit;
                self.cols.tokens.push(v);
            }
        }
        self.cols.shape.push(s);
    }

    /// The columns written so far.
    pub fn into_columns(self) -> Columns {
        self.cols
    }
}

/// The columns of `events` (tests, fuzzing and tools; the agent writes them as events come).
pub fn columns(events: &[LifecycleEvent]) -> Columns {
    let mut w = EventWriter::with_capacity(events.len());
    for e in events {
        w.push(e);
    }
    w.into_columns()
}

/// Encodes a header and its events.
pub fn encode(header: BatchHeader, events: Columns) -> Vec<u8> {
    WireBatch {
        header: Some(header),
        events: Some(events),
    }
    .encode_to_vec()
}

/// The version of a v1 message (a JSON Lines batch: `{"v":1,…}` first).
fn json_version(payload: &[u8]) -> Result<u32, WireError> {
    #[derive(serde::Deserialize)]
    struct V {
        v: u32,
    }
    let first = payload.split(|b| *b == b'\n').next().unwrap_or_default();
    serde_json::from_slice::<V>(first)
        .map(|h| h.v)
        .map_err(|e| WireError::Header(e.to_string()))
}

/// Decodes a message written by [`encode`].
pub fn decode(payload: &[u8]) -> Result<Batch, WireError> {
    if payload.is_empty() {
        return Err(WireError::Empty);
    }
    let v = if payload[0] == b'{' {
        json_version(payload)?
    } else {
        VersionOnly::decode(payload)
            .map_err(|e| WireError::Malformed(e.to_string()))?
            .header
            .ok_or_else(|| WireError::Header("missing".into()))?
            .v
    };
    if v != WIRE_VERSION {
        return Err(WireError::Version(v));
    }
    let m = WireBatch::decode(payload).map_err(|e| WireError::Malformed(e.to_string()))?;
    let header = m
        .header
        .ok_or_else(|| WireError::Header("missing".into()))?;
    let events = read_events(m.events.unwrap_or_default())?;
    if events.len() != header.offsets.len() {
        return Err(WireError::Count {
            events: events.len(),
            offsets: header.offsets.len(),
        });
    }
    Ok(Batch { header, events })
}

/// The next value of a column, or what is missing.
fn next<T: Copy>(
    it: &mut std::slice::Iter<'_, T>,
    index: usize,
    what: &str,
) -> Result<T, WireError> {
    it.next().copied().ok_or_else(|| WireError::Event {
        index,
        message: format!("the {what} column ends early"),
    })
}

fn read_events(cols: Columns) -> Result<Vec<LifecycleEvent>, WireError> {
    let n = cols.time.len();
    if n > MAX_EVENTS {
        return Err(WireError::Malformed(format!(
            "{n} events (a batch holds at most {MAX_EVENTS})"
        )));
    }
    if cols.shape.len() != n {
        return Err(WireError::Malformed(format!(
            "{n} times but {} shapes",
            cols.shape.len()
        )));
    }
    let mut rooms = cols.room.iter();
    let mut pids = cols.pid.iter();
    let mut statuses = cols.status.iter();
    let mut tokens = cols.tokens.iter();
    let mut id_lens = cols.id_len.iter();
    let mut name_refs = cols.name_ref.iter();
    let mut at = 0usize;
    let mut time = 0u64;
    let mut out = Vec::with_capacity(n);
    for (index, (&dt, &s)) in cols.time.iter().zip(&cols.shape).enumerate() {
        let bad = |message: String| WireError::Event { index, message };
        if s & !shape::ALL != 0 {
            return Err(bad(format!("undefined shape bits {:#x}", s & !shape::ALL)));
        }
        time = time.wrapping_add(dt as u64);
        let stage = Stage::ALL[((s >> shape::STAGE) & 3) as usize];
        let kind = *Kind::ALL
            .get(((s >> shape::KIND) & 15) as usize)
            .ok_or_else(|| bad("undefined kind".into()))?;
        let source = *Source::ALL
            .get(((s >> shape::SOURCE) & 3) as usize)
            .ok_or_else(|| bad("undefined source".into()))?;
        let mut e = LifecycleEvent::new(time, stage, kind, source);
        if s & shape::ROOM != 0 {
            e.ids.bootstrap_room = Some(BootstrapRoom(next(&mut rooms, index, "room")?));
        }
        let mut id = |bit: u32| -> Result<Option<Box<str>>, WireError> {
            if s & bit == 0 {
                return Ok(None);
            }
            let len = next(&mut id_lens, index, "id length")? as usize;
            let v = at
                .checked_add(len)
                .and_then(|end| cols.ids.get(at..end))
                .ok_or_else(|| bad("an id outside the id text".into()))?;
            at += len;
            Ok(Some(v.into()))
        };
        e.ids.request_id = id(shape::REQUEST_ID)?;
        e.ids.trace_id = id(shape::TRACE_ID)?;
        e.ids.rid = id(shape::RID)?;
        let mut name = |bit: u32, cap: bool| -> Result<Option<Box<str>>, WireError> {
            if s & bit == 0 {
                return Ok(None);
            }
            let i = next(&mut name_refs, index, "name")? as usize;
            let v = cols
                .names
                .get(i)
                .ok_or_else(|| bad(format!("name {i} of {}", cols.names.len())))?;
            Ok(Some(if cap { truncate_reason(v) } else { v }.into()))
        };
        e.node = name(shape::NODE, false)?;
        e.worker = name(shape::WORKER, false)?;
        e.reason = name(shape::REASON, true)?;
        e.detail = name(shape::DETAIL, true)?;
        if s & shape::STATUS != 0 {
            let v = next(&mut statuses, index, "status")?;
            e.status = Some(u16::try_from(v).map_err(|_| bad(format!("status {v}")))?);
        }
        if s & shape::PID != 0 {
            e.pid = Some(next(&mut pids, index, "pid")?);
        }
        let to = (s >> shape::TO) & 7;
        if to > 0 {
            let to = *Stage::ALL
                .get(to as usize - 1)
                .ok_or_else(|| bad("undefined `to` stage".into()))?;
            // As the replay format reads it.
            if !matches!(kind, Kind::Dispatched | Kind::Cancelled) {
                return Err(bad(
                    "`to` is only meaningful on `dispatched` and `cancelled` events".into(),
                ));
            }
            e.to = Some(to);
        }
        let peer = (s >> shape::PEER) & 3;
        if peer > 0 {
            e.peer = Some(Peer::ALL[peer as usize - 1]);
        }
        let breach = (s >> shape::BREACH) & 7;
        if breach > 0 {
            e.protocol_breach = Some(
                *ProtocolBreach::ALL
                    .get(breach as usize - 1)
                    .ok_or_else(|| bad("undefined protocol breach".into()))?,
            );
        }
        for (bit, field) in [
            (shape::INPUT_TOKENS, &mut e.input_tokens),
            (shape::CONTEXT_TOKENS, &mut e.context_tokens),
            (shape::MAX_INPUT_TOKENS, &mut e.max_input_tokens),
            (shape::MAX_TOTAL_TOKENS, &mut e.max_total_tokens),
        ] {
            if s & bit != 0 {
                *field = Some(next(&mut tokens, index, "tokens")?);
            }
        }
        out.push(e);
    }
    let left = rooms.len()
        + pids.len()
        + statuses.len()
        + tokens.len()
        + id_lens.len()
        + name_refs.len()
        + (cols.ids.len() - at);
    if left > 0 {
        return Err(WireError::Malformed(format!(
            "{left} values no event's shape accounts for"
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::MAX_REASON_BYTES;

    /// A room SGLang drew above 2^53: a double cannot hold it.
    const BIG_ROOM: u64 = 9_066_467_638_188_682_269;

    /// Breaks one column of a good batch.
    type Damage = fn(&mut Columns);

    fn header(offsets: Vec<u32>, broadcast: Vec<u32>) -> BatchHeader {
        BatchHeader {
            v: WIRE_VERSION,
            node: "a".into(),
            boot: 9,
            partition: 2,
            seq: 3,
            first_event: 100,
            offsets,
            broadcast,
            newest: 6,
            sent_ns: 11,
            last: true,
        }
    }

    /// Every field set, every value of every enum, times that go backwards and wrap.
    fn every_field() -> Vec<LifecycleEvent> {
        let mut v = Vec::new();
        let mut t = 1_795_986_920_376_000_000u64;
        for (i, kind) in Kind::ALL.into_iter().enumerate() {
            for stage in Stage::ALL {
                for source in Source::ALL {
                    t = t.wrapping_add(1_000).wrapping_sub((i as u64 % 3) * 2_500);
                    v.push(LifecycleEvent::new(t, stage, kind, source));
                }
            }
        }
        let full = LifecycleEvent {
            time_ns: u64::MAX,
            stage: Stage::Decode,
            kind: Kind::Dispatched,
            ids: crate::event::Ids {
                request_id: Some("req-é-1".into()),
                trace_id: Some("4bf92f3577b34da6a3ce929d0e0e4736".into()),
                rid: Some("8f3c2b1a".into()),
                bootstrap_room: Some(BootstrapRoom(BIG_ROOM)),
            },
            source: Source::Ebpf,
            node: Some("gpu-7".into()),
            pid: Some(u32::MAX),
            worker: Some("http://10.0.0.5:30001".into()),
            status: Some(u16::MAX),
            reason: Some("exceeds the maximum number of tokens".into()),
            detail: Some("/generate".into()),
            to: Some(Stage::Transfer),
            peer: Some(Peer::Unattributed),
            protocol_breach: Some(ProtocolBreach::DestinationsBeforeReadiness),
            input_tokens: Some(u64::MAX),
            context_tokens: Some(0),
            max_input_tokens: Some(1 << 53),
            max_total_tokens: Some((1 << 53) + 1),
        };
        v.push(full.clone());
        for to in Stage::ALL {
            v.push(LifecycleEvent {
                time_ns: 0,
                kind: Kind::Cancelled,
                to: Some(to),
                ..full.clone()
            });
        }
        for peer in Peer::ALL {
            v.push(LifecycleEvent {
                peer: Some(peer),
                node: Some("gpu-8".into()),
                reason: None,
                ..full.clone()
            });
        }
        for breach in ProtocolBreach::ALL {
            v.push(LifecycleEvent {
                protocol_breach: Some(breach),
                detail: None,
                ..full.clone()
            });
        }
        v.push(
            LifecycleEvent::new(5, Stage::Prefill, Kind::Rejected, Source::Otlp)
                .with_room(u64::MAX)
                .with_rid(""),
        );
        v.push(LifecycleEvent::new(6, Stage::Router, Kind::Received, Source::Otlp).with_room(0));
        v
    }

    #[test]
    fn round_trip_keeps_every_field_and_the_ids() {
        let events = every_field();
        let n = events.len() as u32;
        let h = header((0..n).map(|i| i * 3).collect(), vec![1, n - 1]);
        let buf = encode(h.clone(), columns(&events));
        let b = decode(&buf).unwrap();
        assert_eq!(b.header, h);
        assert_eq!(b.events, events);
        assert_eq!((b.event_id(0), b.event_id(1)), (100, 103));
        assert!(!b.is_broadcast(0) && b.is_broadcast(1));
        assert_eq!(b.header.batch_id(), "a/9/2/3");
        // The replay format carries the same: what `revenant check` reads of these events.
        for e in &events {
            let line =
                serde_json::to_string(&crate::ingest::replay::ReplayRecord::from_event(e)).unwrap();
            let back = crate::ingest::replay::parse_line(&line).unwrap().unwrap();
            assert_eq!(&back, e, "{line}");
        }
    }

    #[test]
    fn repeated_names_are_written_once_and_reasons_are_capped() {
        let long = "x".repeat(MAX_REASON_BYTES + 40);
        let events: Vec<_> = (0..50)
            .map(|i| {
                let mut e = LifecycleEvent::new(i, Stage::Prefill, Kind::Rejected, Source::Ebpf)
                    .with_node(if i % 2 == 0 { "a" } else { "b" })
                    .with_worker("w");
                e.reason = Some(long.as_str().into());
                e
            })
            .collect();
        let cols = columns(&events);
        assert_eq!(cols.names.len(), 4, "{:?}", cols.names);
        let b = decode(&encode(header((0..50).collect(), vec![]), cols)).unwrap();
        assert!(
            b.events
                .iter()
                .all(|e| e.reason.as_deref() == Some(&long[..MAX_REASON_BYTES]))
        );
        assert_eq!(b.events[1].node.as_deref(), Some("b"));
    }

    /// `fuzz/make_corpus.py` writes its batches field by field: they must stay batches of
    /// this version.
    #[test]
    fn the_fuzz_seeds_are_batches_of_this_version() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/bus_wire");
        let read = |name: &str| {
            decode(&std::fs::read(dir.join(name)).unwrap()).map_err(|e| format!("{name}: {e}"))
        };
        let a = read("attempt").unwrap();
        assert_eq!(
            (a.header.partition, a.header.seq, a.events.len()),
            (2, 41, 6)
        );
        assert_eq!(
            a.events[4].ids.bootstrap_room,
            Some(BootstrapRoom(BIG_ROOM))
        );
        assert_eq!(a.events[4].status, Some(400));
        assert_eq!(a.events[5].to, Some(Stage::Decode));
        let every = read("every-field").unwrap();
        let full = &every.events[36];
        assert_eq!(full.peer, Some(Peer::Foreign));
        assert_eq!(full.max_total_tokens, Some(u64::MAX));
        let breaches: Vec<_> = every.events[40..]
            .iter()
            .map(|e| e.protocol_breach)
            .collect();
        assert_eq!(breaches, ProtocolBreach::ALL.map(Some));
        assert_eq!(
            full.ids.trace_id.as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        assert_eq!(full.worker.as_deref(), Some("http://10.0.0.5:30001"));
        let r = read("request-level").unwrap();
        assert!((0..3).all(|i| r.is_broadcast(i)));
        assert_eq!(r.event_id(2), 106);
        let last = read("final-empty").unwrap();
        assert!(last.events.is_empty() && last.header.last);
        assert_eq!(last.header.sent_ns, last.header.newest + 20_000_000);
        assert!(read("v1-json").unwrap_err().contains("wire version 1"));
    }

    #[test]
    fn other_versions_and_bad_messages_are_errors() {
        assert_eq!(decode(b""), Err(WireError::Empty));
        // A v1 (JSON Lines) batch.
        let v1 = r#"{"v":1,"node":"a","boot":1,"partition":0,"seq":0,"first_event":0,"offsets":[0]}
{"time_unix_nano":1,"stage":"router","kind":"received"}"#;
        assert_eq!(decode(v1.as_bytes()), Err(WireError::Version(1)));
        assert!(matches!(decode(b"{}"), Err(WireError::Header(_))));
        let mut h = header(vec![], vec![]);
        h.v = 3;
        assert_eq!(
            decode(&encode(h, Columns::default())),
            Err(WireError::Version(3))
        );
        let headless = WireBatch {
            header: None,
            events: Some(Columns::default()),
        }
        .encode_to_vec();
        assert_eq!(decode(&headless), Err(WireError::Header("missing".into())));
        assert!(matches!(decode(&[0xff; 8]), Err(WireError::Malformed(_))));
        let one = columns(&every_field()[..1]);
        assert_eq!(
            decode(&encode(header(vec![], vec![]), one.clone())),
            Err(WireError::Count {
                events: 1,
                offsets: 0
            })
        );
        let bad = |f: Damage| {
            let mut c = columns(&every_field()[60..]);
            f(&mut c);
            let n = c.time.len() as u32;
            decode(&encode(header((0..n).collect(), vec![]), c))
        };
        assert!(bad(|_| ()).is_ok());
        let many = Columns {
            time: vec![0; MAX_EVENTS + 1],
            shape: vec![0; MAX_EVENTS + 1],
            ..Columns::default()
        };
        let offsets = vec![0; MAX_EVENTS + 1];
        assert!(matches!(
            decode(&encode(header(offsets, vec![]), many)),
            Err(WireError::Malformed(m)) if m.contains("at most")
        ));
        let cases: [(&str, Damage); 10] = [
            ("kind", |c| c.shape[0] |= 15 << shape::KIND),
            ("source", |c| c.shape[0] |= 3 << shape::SOURCE),
            ("bits", |c| c.shape[0] |= 1 << 30),
            ("to", |c| c.shape[0] |= 7 << shape::TO),
            ("room", |c| c.room.clear()),
            ("ids", |c| c.id_len[0] = 1000),
            ("names", |c| c.name_ref[0] = 99),
            ("status", |c| c.status[0] = 70_000),
            ("left", |c| c.pid.push(1)),
            ("shapes", |c| {
                c.shape.pop();
            }),
        ];
        for (what, f) in cases {
            assert!(bad(f).is_err(), "{what}");
        }
        // `to` on a kind that has none, as the replay format refuses it.
        let e =
            LifecycleEvent::new(1, Stage::Router, Kind::Work, Source::Ebpf).with_to(Stage::Decode);
        assert!(matches!(
            decode(&encode(header(vec![0], vec![]), columns(&[e]))),
            Err(WireError::Event { index: 0, .. })
        ));
        // An id cut inside a character.
        let e = LifecycleEvent::new(1, Stage::Router, Kind::Work, Source::Ebpf)
            .with_rid("é")
            .with_request_id("x");
        let mut c = columns(&[e]);
        c.id_len = vec![2, 1];
        assert!(decode(&encode(header(vec![0], vec![]), c)).is_err());
    }
}
