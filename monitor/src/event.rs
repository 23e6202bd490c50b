//! The normalized lifecycle event every source produces and every later stage consumes.
//!
//! Sources (eBPF, OTLP, replay) turn what they see into [`LifecycleEvent`]s; nothing downstream
//! knows where an event came from except through [`Source`]. Events carry identities, timings,
//! status codes, lengths and token counts only: prompt and completion text never reach this type.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Nanoseconds since the Unix epoch, in the clock of the node that produced the event.
pub type UnixNanos = u64;

/// Where in the disaggregated pipeline an event happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[repr(u8)]
pub enum Stage {
    Router = 0,
    Prefill = 1,
    Transfer = 2,
    Decode = 3,
}

impl Stage {
    pub const ALL: [Stage; 4] = [
        Stage::Router,
        Stage::Prefill,
        Stage::Transfer,
        Stage::Decode,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Router => "router",
            Stage::Prefill => "prefill",
            Stage::Transfer => "transfer",
            Stage::Decode => "decode",
        }
    }

    pub(crate) fn from_index(i: u8) -> Stage {
        Stage::ALL[(i & 3) as usize]
    }
}

/// What happened to the request at that stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[repr(u8)]
pub enum Kind {
    /// The stage accepted the bytes of the request (HTTP request arrived, span started).
    Received = 0,
    /// The stage handed the request on to another stage (`to` names which).
    Dispatched = 1,
    /// The stage decided it can process the request (scheduled, bootstrapped).
    Admitted = 2,
    /// The stage refused the request (capacity, validation); terminal for the attempt.
    Rejected = 3,
    /// The stage did work on the request: forward passes, KV transfer, streamed tokens.
    Work = 4,
    /// The stage finished the request; `status` tells whether successfully.
    Completed = 5,
    /// The stage gave up on the request after admitting it.
    Aborted = 6,
    /// Someone else withdrew the request (client disconnect, router cancel, `ABORT` frame).
    Cancelled = 7,
    /// Not a request event: the stage reports what it can process (`context_tokens`, limits).
    Capacity = 8,
}

impl Kind {
    pub const ALL: [Kind; 9] = [
        Kind::Received,
        Kind::Dispatched,
        Kind::Admitted,
        Kind::Rejected,
        Kind::Work,
        Kind::Completed,
        Kind::Aborted,
        Kind::Cancelled,
        Kind::Capacity,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Received => "received",
            Kind::Dispatched => "dispatched",
            Kind::Admitted => "admitted",
            Kind::Rejected => "rejected",
            Kind::Work => "work",
            Kind::Completed => "completed",
            Kind::Aborted => "aborted",
            Kind::Cancelled => "cancelled",
            Kind::Capacity => "capacity",
        }
    }

    pub(crate) fn from_index(i: u8) -> Kind {
        Kind::ALL[(i as usize).min(Kind::ALL.len() - 1)]
    }

    /// What a stage's failed answer with HTTP status `status` was: a refusal (`rejected`: the
    /// request was not taken on; any 4xx, and 503 "unavailable") or a failure after it was
    /// (`aborted`: a 500 such as SGLang's "Prefill bootstrap failed" or a failed KV transfer,
    /// any other 5xx). SGLang's own split: its refusals are 400 and 503, its failures 500.
    pub fn of_failure(status: u16) -> Kind {
        if status < 500 || status == 503 {
            Kind::Rejected
        } else {
            Kind::Aborted
        }
    }

    /// Ends the leg of the stage that reports it.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Kind::Rejected | Kind::Completed | Kind::Aborted | Kind::Cancelled
        )
    }
}

/// Which witness reported the event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[repr(u8)]
pub enum Source {
    /// Observed from the kernel: what really crossed the wire.
    Ebpf = 0,
    /// Reported by the application over OpenTelemetry.
    Otlp = 1,
    /// Read back from a recorded events file.
    Replay = 2,
}

impl Source {
    pub const ALL: [Source; 3] = [Source::Ebpf, Source::Otlp, Source::Replay];

    pub fn as_str(self) -> &'static str {
        match self {
            Source::Ebpf => "ebpf",
            Source::Otlp => "otlp",
            Source::Replay => "replay",
        }
    }

    pub(crate) fn from_index(i: u8) -> Source {
        Source::ALL[(i as usize).min(Source::ALL.len() - 1)]
    }
}

macro_rules! impl_from_str_display {
    ($t:ty, $what:literal) => {
        impl FromStr for $t {
            type Err = UnknownName;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::ALL
                    .iter()
                    .copied()
                    .find(|v| v.as_str().eq_ignore_ascii_case(s))
                    .ok_or_else(|| UnknownName {
                        what: $what,
                        got: s.to_owned(),
                        expected: Self::ALL
                            .iter()
                            .map(|v| v.as_str())
                            .collect::<Vec<_>>()
                            .join(", "),
                    })
            }
        }
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}
/// Who wrote a request to a worker, as the receiving end's witness can attribute its peer. Only
/// events about writes that a deployment's own processes alone should make carry it (eBPF: a
/// mutating request to a prefill's bootstrap server); no OTLP span says who called.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[repr(u8)]
pub enum Peer {
    /// One of the deployment's processes: a watched worker or router on this node (its socket is
    /// known), or, across nodes, an address whose host is a known worker's.
    Member = 0,
    /// On this node, and no watched process holds the connecting socket.
    Foreign = 1,
    /// Neither can be said: another node's address that names no known worker, or a connection
    /// whose peer address the kernel did not report.
    Unattributed = 2,
}

impl Peer {
    pub const ALL: [Peer; 3] = [Peer::Member, Peer::Foreign, Peer::Unattributed];

    pub fn as_str(self) -> &'static str {
        match self {
            Peer::Member => "member",
            Peer::Foreign => "foreign",
            Peer::Unattributed => "unattributed",
        }
    }
}

impl_from_str_display!(Stage, "stage");
impl_from_str_display!(Kind, "kind");
impl_from_str_display!(Source, "source");
impl_from_str_display!(Peer, "peer");
impl_from_str_display!(ProtocolBreach, "protocol_breach");

/// A control message that breaks its room's KV-transfer protocol, as the end that sees the
/// room's whole exchange judges it (eBPF: the ZMTP channel between SGLang's decode and prefill).
/// Only the event about that message carries it; the rest of the room's events are ordinary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[repr(u8)]
pub enum ProtocolBreach {
    /// Destinations for a live room from one decode session more than the room asked for
    /// (`required_dst_info_num` distinct sessions): prefill adds it and writes the room's KV to
    /// a decode that does not own it.
    SurplusDecodeOwner = 0,
    /// Prefill announced the room ready (`prefill_complete`) a second time before the room
    /// concluded.
    RepeatedReadiness = 1,
    /// Under `prefill_complete` (the room began with `BOOTSTRAP`), decode published its
    /// destinations before prefill announced the room ready.
    DestinationsBeforeReadiness = 2,
    /// A vLLM decode leg's `kv_transfer_params` name KV (`remote_request_id`) that prefill's
    /// answer issued to another request: decode reads that request's KV cache.
    ForeignKvHandoff = 3,
    /// A vLLM decode leg's `kv_transfer_params` name KV no prefill answer issued, while prefill's
    /// answer to this request issued other KV: a stale or forged handoff.
    UnissuedKvHandoff = 4,
}

impl ProtocolBreach {
    pub const ALL: [ProtocolBreach; 5] = [
        ProtocolBreach::SurplusDecodeOwner,
        ProtocolBreach::RepeatedReadiness,
        ProtocolBreach::DestinationsBeforeReadiness,
        ProtocolBreach::ForeignKvHandoff,
        ProtocolBreach::UnissuedKvHandoff,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ProtocolBreach::SurplusDecodeOwner => "surplus-decode-owner",
            ProtocolBreach::RepeatedReadiness => "repeated-readiness",
            ProtocolBreach::DestinationsBeforeReadiness => "destinations-before-readiness",
            ProtocolBreach::ForeignKvHandoff => "foreign-kv-handoff",
            ProtocolBreach::UnissuedKvHandoff => "unissued-kv-handoff",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {got:?} (expected one of: {expected})")]
pub struct UnknownName {
    pub what: &'static str,
    pub got: String,
    pub expected: String,
}

/// SGLang's `bootstrap_room`: a u64 that spans carry as a hex string (`"0x314783f6bef71155"`) and
/// HTTP bodies as a decimal number. Both spellings parse to the same key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BootstrapRoom(pub u64);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid bootstrap_room {0:?}: expected a u64 as decimal or 0x-prefixed hex")]
pub struct InvalidRoom(pub String);

impl FromStr for BootstrapRoom {
    type Err = InvalidRoom;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        let parsed = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
            Some(hex) => u64::from_str_radix(hex, 16),
            None => t.parse::<u64>(),
        };
        parsed
            .map(BootstrapRoom)
            .map_err(|_| InvalidRoom(s.to_owned()))
    }
}

impl fmt::Display for BootstrapRoom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl BootstrapRoom {
    /// The `0x` hex spelling (lower case, no padding), as spans write it.
    pub fn hex(self) -> String {
        format!("{:#x}", self.0)
    }
}

/// Written as a decimal string: JSON readers that hold numbers as doubles (JavaScript, jq) round a
/// u64 above 2^53, and SGLang draws rooms from the whole u64 range.
impl Serialize for BootstrapRoom {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for BootstrapRoom {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = BootstrapRoom;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a u64, as a number, a decimal string or a 0x-prefixed hex string")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<BootstrapRoom, E> {
                Ok(BootstrapRoom(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<BootstrapRoom, E> {
                u64::try_from(v)
                    .map(BootstrapRoom)
                    .map_err(|_| E::custom(format!("bootstrap_room {v} is negative")))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<BootstrapRoom, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// A room in its `0x` hex spelling, written next to the decimal [`BootstrapRoom`] in every output
/// (spans and SGLang's logs show rooms in hex). Reads any spelling [`BootstrapRoom`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoomHex(pub u64);

impl Serialize for RoomHex {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&format_args!("{:#x}", self.0))
    }
}

impl<'de> Deserialize<'de> for RoomHex {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        BootstrapRoom::deserialize(d).map(|r| RoomHex(r.0))
    }
}

/// How every output names a room: `"bootstrap_room": "<decimal>"` (a string, see
/// [`BootstrapRoom`]'s `Serialize`) and `"bootstrap_room_hex": "0x<hex>"` next to it. Flattened
/// into the object that names the room, or one object per room in a list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RoomFieldsWire")]
pub struct RoomFields {
    pub bootstrap_room: BootstrapRoom,
    pub bootstrap_room_hex: RoomHex,
}

impl RoomFields {
    pub fn new(room: u64) -> RoomFields {
        RoomFields {
            bootstrap_room: BootstrapRoom(room),
            bootstrap_room_hex: RoomHex(room),
        }
    }

    pub fn room(self) -> u64 {
        self.bootstrap_room.0
    }
}

#[derive(Deserialize)]
struct RoomFieldsWire {
    #[serde(default)]
    bootstrap_room: Option<BootstrapRoom>,
    #[serde(default)]
    bootstrap_room_hex: Option<RoomHex>,
}

impl TryFrom<RoomFieldsWire> for RoomFields {
    type Error = RoomFieldsError;
    fn try_from(w: RoomFieldsWire) -> Result<Self, Self::Error> {
        room_from_fields(w.bootstrap_room, w.bootstrap_room_hex)?
            .map(RoomFields::new)
            .ok_or(RoomFieldsError::Missing)
    }
}

/// A room given in both spellings that disagree, or in neither where one is required.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RoomFieldsError {
    #[error("bootstrap_room {decimal} and bootstrap_room_hex {hex:#x} name different rooms")]
    Mismatch { decimal: u64, hex: u64 },
    #[error("missing bootstrap_room (or bootstrap_room_hex)")]
    Missing,
}

/// The room named by the two fields of [`RoomFields`] as read: either alone is enough (files
/// written before the hex field existed hold only `bootstrap_room`), both must agree.
pub fn room_from_fields(
    decimal: Option<BootstrapRoom>,
    hex: Option<RoomHex>,
) -> Result<Option<u64>, RoomFieldsError> {
    match (decimal, hex) {
        (Some(d), Some(h)) if d.0 != h.0 => Err(RoomFieldsError::Mismatch {
            decimal: d.0,
            hex: h.0,
        }),
        (Some(d), _) => Ok(Some(d.0)),
        (None, Some(h)) => Ok(Some(h.0)),
        (None, None) => Ok(None),
    }
}

/// The identities an event carries. Any subset may be present.
///
/// `request_id` (the client's `x-request-id`) and `trace_id` name the whole client request;
/// `rid` and `bootstrap_room` name one attempt of it (the router retries with a new room).
/// Written with the room as [`RoomFields`]; read with the room in any spelling, either field of
/// the pair alone, and no other field (a typo never silently drops a fact).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(try_from = "IdsWire")]
pub struct Ids {
    pub request_id: Option<Box<str>>,
    pub trace_id: Option<Box<str>>,
    pub rid: Option<Box<str>>,
    pub bootstrap_room: Option<BootstrapRoom>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct IdsWire {
    #[serde(default)]
    request_id: Option<Box<str>>,
    #[serde(default)]
    trace_id: Option<Box<str>>,
    #[serde(default)]
    rid: Option<Box<str>>,
    #[serde(default)]
    bootstrap_room: Option<BootstrapRoom>,
    #[serde(default)]
    bootstrap_room_hex: Option<RoomHex>,
}

impl TryFrom<IdsWire> for Ids {
    type Error = RoomFieldsError;
    fn try_from(w: IdsWire) -> Result<Self, Self::Error> {
        Ok(Ids {
            request_id: w.request_id,
            trace_id: w.trace_id,
            rid: w.rid,
            bootstrap_room: room_from_fields(w.bootstrap_room, w.bootstrap_room_hex)?
                .map(BootstrapRoom),
        })
    }
}

#[derive(Serialize)]
struct IdsOut<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    request_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    trace_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rid: Option<&'a str>,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    room: Option<RoomFields>,
}

impl Serialize for Ids {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        IdsOut {
            request_id: self.request_id.as_deref(),
            trace_id: self.trace_id.as_deref(),
            rid: self.rid.as_deref(),
            room: self.bootstrap_room.map(|r| RoomFields::new(r.0)),
        }
        .serialize(s)
    }
}

impl Ids {
    pub fn is_empty(&self) -> bool {
        self.request_id.is_none()
            && self.trace_id.is_none()
            && self.rid.is_none()
            && self.bootstrap_room.is_none()
    }

    /// True when the event names an attempt, not only the whole request.
    pub fn names_attempt(&self) -> bool {
        self.rid.is_some() || self.bootstrap_room.is_some()
    }
}

/// One thing that happened to one request (or, for [`Kind::Capacity`], to one worker).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LifecycleEvent {
    pub time_ns: UnixNanos,
    pub stage: Stage,
    pub kind: Kind,
    pub ids: Ids,
    pub source: Source,
    /// The host that observed the event; events from one node share a clock.
    pub node: Option<Box<str>>,
    pub pid: Option<u32>,
    /// The worker (URL or address) the event is about; keys capacity reports.
    pub worker: Option<Box<str>>,
    /// HTTP status code or equivalent.
    pub status: Option<u16>,
    /// Short machine-made reason (truncated error message, abort reason). Never prompt text.
    pub reason: Option<Box<str>>,
    /// Free-form short detail (endpoint, frame type).
    pub detail: Option<Box<str>>,
    /// For `dispatched`: the stage the request was sent to; for a router's `cancelled`: the
    /// stage whose leg the router withdrew.
    pub to: Option<Stage>,
    /// Who wrote the request the event is about, when the event is about a write only the
    /// deployment's own processes should make (see [`Peer`]).
    pub peer: Option<Peer>,
    /// The control message this event is about breaks its room's protocol (see [`ProtocolBreach`]).
    pub protocol_breach: Option<ProtocolBreach>,
    pub input_tokens: Option<u64>,
    pub context_tokens: Option<u64>,
    pub max_input_tokens: Option<u64>,
    pub max_total_tokens: Option<u64>,
}

impl LifecycleEvent {
    /// A bare event; fill the optional fields with struct update syntax or the setters below.
    pub fn new(time_ns: UnixNanos, stage: Stage, kind: Kind, source: Source) -> Self {
        LifecycleEvent {
            time_ns,
            stage,
            kind,
            ids: Ids::default(),
            source,
            node: None,
            pid: None,
            worker: None,
            status: None,
            reason: None,
            detail: None,
            to: None,
            peer: None,
            protocol_breach: None,
            input_tokens: None,
            context_tokens: None,
            max_input_tokens: None,
            max_total_tokens: None,
        }
    }

    pub fn with_request_id(mut self, v: impl Into<Box<str>>) -> Self {
        self.ids.request_id = Some(v.into());
        self
    }
    pub fn with_trace_id(mut self, v: impl Into<Box<str>>) -> Self {
        self.ids.trace_id = Some(v.into());
        self
    }
    pub fn with_rid(mut self, v: impl Into<Box<str>>) -> Self {
        self.ids.rid = Some(v.into());
        self
    }
    pub fn with_room(mut self, room: u64) -> Self {
        self.ids.bootstrap_room = Some(BootstrapRoom(room));
        self
    }
    pub fn with_status(mut self, status: u16) -> Self {
        self.status = Some(status);
        self
    }
    pub fn with_node(mut self, node: impl Into<Box<str>>) -> Self {
        self.node = Some(node.into());
        self
    }
    pub fn with_worker(mut self, worker: impl Into<Box<str>>) -> Self {
        self.worker = Some(worker.into());
        self
    }
    pub fn with_reason(mut self, reason: &str) -> Self {
        self.reason = Some(truncate_reason(reason).into());
        self
    }
    pub fn with_to(mut self, to: Stage) -> Self {
        self.to = Some(to);
        self
    }
    pub fn with_peer(mut self, peer: Peer) -> Self {
        self.peer = Some(peer);
        self
    }
    pub fn with_protocol_breach(mut self, breach: ProtocolBreach) -> Self {
        self.protocol_breach = Some(breach);
        self
    }
    pub fn with_input_tokens(mut self, n: u64) -> Self {
        self.input_tokens = Some(n);
        self
    }
}

/// Reasons are short diagnostics, not payloads: cap them so no stage can smuggle large text.
pub const MAX_REASON_BYTES: usize = 160;

/// Cuts `s` to at most [`MAX_REASON_BYTES`] on a char boundary.
pub fn truncate_reason(s: &str) -> &str {
    if s.len() <= MAX_REASON_BYTES {
        return s;
    }
    let mut end = MAX_REASON_BYTES;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Events decoded together from one unit of input (one OTLP export, one ring-buffer drain):
/// what sources hand to the pipeline, so the channel costs one synchronisation per batch.
pub type EventBatch = Vec<LifecycleEvent>;

/// The wall clock in nanoseconds since the Unix epoch (0 before it).
pub fn now_unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn room_hex_and_decimal_are_the_same_key() {
        let hex: BootstrapRoom = "0x314783f6bef71155".parse().unwrap();
        let dec: BootstrapRoom = "3550951926993981781".parse().unwrap();
        assert_eq!(hex, dec);
        let from_json: BootstrapRoom = serde_json::from_str("3550951926993981781").unwrap();
        assert_eq!(from_json, hex);
        let from_json_hex: BootstrapRoom = serde_json::from_str("\"0x314783F6BEF71155\"").unwrap();
        assert_eq!(from_json_hex, hex);
    }

    /// A room SGLang drew above 2^53: a double (JavaScript, jq) cannot hold it.
    const BIG_ROOM: u64 = 9_066_467_638_188_682_269;

    #[test]
    fn ids_write_the_room_as_decimal_string_and_hex() {
        let ids = Ids {
            rid: Some("r-1".into()),
            bootstrap_room: Some(BootstrapRoom(BIG_ROOM)),
            ..Ids::default()
        };
        let json = serde_json::to_value(&ids).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "rid": "r-1",
                "bootstrap_room": "9066467638188682269",
                "bootstrap_room_hex": "0x7dd29047ddcfac1d",
            })
        );
        let back: Ids = serde_json::from_value(json).unwrap();
        assert_eq!(back, ids);
    }

    #[test]
    fn ids_read_the_room_in_any_spelling_and_either_field() {
        let room = Some(BootstrapRoom(BIG_ROOM));
        for text in [
            r#"{"bootstrap_room": 9066467638188682269}"#,
            r#"{"bootstrap_room": "9066467638188682269"}"#,
            r#"{"bootstrap_room": "0x7dd29047ddcfac1d"}"#,
            r#"{"bootstrap_room_hex": "0x7dd29047ddcfac1d"}"#,
            r#"{"bootstrap_room": "9066467638188682269", "bootstrap_room_hex": "0x7DD29047DDCFAC1D"}"#,
        ] {
            let ids: Ids = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(ids.bootstrap_room, room, "{text}");
        }
        let err = serde_json::from_str::<Ids>(
            r#"{"bootstrap_room": "9066467638188682269", "bootstrap_room_hex": "0x1"}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("different rooms"), "{err}");
        let err = serde_json::from_str::<Ids>(r#"{"bootstrap_rom": 1}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field"), "{err}");
    }

    #[test]
    fn room_fields_need_a_room() {
        let f: RoomFields = serde_json::from_str(r#"{"bootstrap_room": 12}"#).unwrap();
        assert_eq!(f, RoomFields::new(12));
        assert_eq!(
            serde_json::to_string(&f).unwrap(),
            r#"{"bootstrap_room":"12","bootstrap_room_hex":"0xc"}"#
        );
        let err = serde_json::from_str::<RoomFields>("{}").unwrap_err();
        assert!(err.to_string().contains("missing bootstrap_room"), "{err}");
    }

    #[test]
    fn room_rejects_garbage() {
        assert!("0xzz".parse::<BootstrapRoom>().is_err());
        assert!("-1".parse::<BootstrapRoom>().is_err());
        assert!("18446744073709551616".parse::<BootstrapRoom>().is_err());
        assert!(serde_json::from_str::<BootstrapRoom>("-3").is_err());
    }

    #[test]
    fn names_round_trip() {
        for s in Stage::ALL {
            assert_eq!(s.as_str().parse::<Stage>().unwrap(), s);
            assert_eq!(Stage::from_index(s as u8), s);
        }
        for k in Kind::ALL {
            assert_eq!(k.as_str().parse::<Kind>().unwrap(), k);
            assert_eq!(Kind::from_index(k as u8), k);
        }
        for p in Peer::ALL {
            assert_eq!(p.as_str().parse::<Peer>().unwrap(), p);
            let json = serde_json::to_string(&p).unwrap();
            assert_eq!(json, format!("\"{}\"", p.as_str()));
        }
        for b in ProtocolBreach::ALL {
            assert_eq!(b.as_str().parse::<ProtocolBreach>().unwrap(), b);
            let json = serde_json::to_string(&b).unwrap();
            assert_eq!(json, format!("\"{}\"", b.as_str()));
        }
        let err = "preffill".parse::<Stage>().unwrap_err();
        assert!(
            err.to_string()
                .contains("router, prefill, transfer, decode"),
            "{err}"
        );
    }

    #[test]
    fn reasons_are_truncated_on_char_boundaries() {
        let long = "é".repeat(200);
        let t = truncate_reason(&long);
        assert!(t.len() <= MAX_REASON_BYTES);
        assert!(t.chars().all(|c| c == 'é'));
    }
}
