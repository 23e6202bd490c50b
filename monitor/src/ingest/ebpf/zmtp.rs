//! ZMTP 3.x (ZeroMQ over TCP, as libzmq/pyzmq send it), one direction of a connection.
//!
//! The KV-transfer control channel between decode and prefill is ZeroMQ. SGLang's is PUSH to
//! PULL, one connection per direction and peer: decode pushes where prefill must write a room's
//! KV, prefill pushes the room's status back (see [`control`] for every message SGLang sends).
//! vLLM's connectors use REQ or DEALER to ROUTER with msgspec MessagePack (see
//! [`vllm_control`]). We decode frames and keep only the first few bytes of the first few parts
//! of each message (more of a MessagePack map, whose ids follow an address): enough for the
//! verb, the room or request ids, a status and an address, never payloads.

use super::msgpack::{Reader, Value};

/// Parts of a message we keep, and bytes of each: up to the count of decode sessions a room's
/// destinations name (`required_dst_info_num`, part 7 for Mooncake and NIXL, 8 for Mori).
pub const KEEP_PARTS: usize = 9;
/// Enough for an SGLang verb, room, address or session name, cut where revenant cuts ids anyway.
pub const KEEP_BYTES: usize = crate::normalize::attrs::MAX_ID_BYTES;
/// Bytes kept of a message's first part when it is a MessagePack map (vLLM's KV connectors
/// send one msgspec struct per message, and the ids of a MooncakeConnector pull follow its
/// address and ranks).
pub const KEEP_MSGPACK_BYTES: usize = 2048;
/// Longest frame we accept: 1 GiB; anything larger is garbage.
const MAX_FRAME: u64 = 1 << 30;
const GREETING: usize = 64;

/// One complete multipart message (commands are not reported).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Message {
    /// Up to [`KEEP_PARTS`] parts, each cut to [`KEEP_BYTES`].
    pub parts: Vec<Vec<u8>>,
    pub part_count: u32,
    /// Bit `i` set: bytes of kept part `i` were lost to a capture gap, so what was kept of it has
    /// a hole or lacks its end (a room cut to its first digits is another room).
    pub damaged: u32,
    /// A capture gap ran from inside the message past its end: the parts before the gap are
    /// whole (or marked damaged), the rest and its true part count are unknown.
    pub truncated: bool,
}

/// A frame's head as its bytes arrive: the flags, then a size of 1 or 8 bytes. Kept in place:
/// every frame of every message has one.
#[derive(Debug, Default)]
struct FrameHead {
    bytes: [u8; 9],
    len: u8,
}

impl FrameHead {
    fn len(&self) -> usize {
        usize::from(self.len)
    }

    /// Appends `data` (at most what the head still lacks).
    fn extend(&mut self, data: &[u8]) {
        let at = self.len();
        self.bytes[at..at + data.len()].copy_from_slice(data);
        self.len += data.len() as u8;
    }
}

#[derive(Debug)]
enum State {
    Greeting(usize),
    FrameHead(FrameHead),
    FrameBody {
        remaining: u64,
        command: bool,
        more: bool,
    },
    Desync,
}

#[derive(Debug)]
pub struct ZmtpStream {
    state: State,
    msg: Message,
    /// Times a capture gap (or bytes that are no frame) cost the stream its framing: the
    /// messages after it are lost until a syscall starts with a frame again.
    pub desyncs: u64,
}

/// True when `data` starts a ZMTP 3.x greeting: signature `FF <8 bytes> 7F`.
pub fn is_greeting(data: &[u8]) -> bool {
    data.len() >= 10 && data[0] == 0xFF && data[9] == 0x7F
}

impl ZmtpStream {
    /// A stream whose greeting starts now.
    pub fn from_greeting() -> Self {
        ZmtpStream {
            state: State::Greeting(GREETING),
            msg: Message::default(),
            desyncs: 0,
        }
    }

    /// A stream picked up mid-way (the connection predates us); waits for a syscall that starts
    /// with a plausible frame.
    pub fn mid_stream() -> Self {
        ZmtpStream {
            state: State::Desync,
            msg: Message::default(),
            desyncs: 0,
        }
    }

    pub fn feed(&mut self, mut data: &[u8], syscall_start: bool, out: &mut Vec<Message>) {
        if matches!(self.state, State::Desync) {
            if !syscall_start || data.is_empty() || data[0] & !0x07 != 0 {
                return;
            }
            self.state = State::FrameHead(FrameHead::default());
            self.msg = Message::default();
        }
        while !data.is_empty() {
            match &mut self.state {
                State::Desync => return,
                State::Greeting(rem) => {
                    let n = (*rem).min(data.len());
                    *rem -= n;
                    data = &data[n..];
                    if *rem == 0 {
                        self.state = State::FrameHead(FrameHead::default());
                    }
                }
                State::FrameHead(h) => {
                    let need = if h.len() == 0 {
                        2
                    } else if h.bytes[0] & 0x02 != 0 {
                        9
                    } else {
                        2
                    };
                    let n = (need - h.len()).min(data.len());
                    h.extend(&data[..n]);
                    data = &data[n..];
                    if h.bytes[0] & !0x07 != 0 {
                        self.lose_sync();
                        return;
                    }
                    let need = if h.bytes[0] & 0x02 != 0 { 9 } else { 2 };
                    if h.len() < need {
                        continue;
                    }
                    let flags = h.bytes[0];
                    let size = if flags & 0x02 != 0 {
                        u64::from_be_bytes(h.bytes[1..9].try_into().expect("8 bytes"))
                    } else {
                        u64::from(h.bytes[1])
                    };
                    if size > MAX_FRAME {
                        self.lose_sync();
                        return;
                    }
                    let command = flags & 0x04 != 0;
                    let more = flags & 0x01 != 0;
                    if !command {
                        self.msg.part_count += 1;
                        if self.msg.parts.len() < KEEP_PARTS {
                            self.msg.parts.push(Vec::new());
                        }
                    }
                    self.state = State::FrameBody {
                        remaining: size,
                        command,
                        more,
                    };
                    if size == 0 {
                        self.end_frame(out);
                    }
                }
                State::FrameBody {
                    remaining, command, ..
                } => {
                    let n = (*remaining).min(data.len() as u64) as usize;
                    *remaining -= n as u64;
                    if !*command
                        && self.msg.parts.len() <= KEEP_PARTS
                        && self.msg.part_count as usize <= KEEP_PARTS
                        && let Some(p) = self.msg.parts.last_mut()
                    {
                        let first = self.msg.part_count == 1;
                        let keep = match p.first().or(data.first()) {
                            Some(&b) if first && is_msgpack_map(b) => KEEP_MSGPACK_BYTES,
                            _ => KEEP_BYTES,
                        };
                        let k = (keep - p.len().min(keep)).min(n);
                        p.extend_from_slice(&data[..k]);
                    }
                    data = &data[n..];
                    if *remaining == 0 {
                        self.end_frame(out);
                    }
                }
            }
        }
    }

    /// `n` bytes of the stream went by uncaptured.
    pub fn gap(&mut self, n: u64, out: &mut Vec<Message>) {
        match &mut self.state {
            State::FrameBody {
                remaining, command, ..
            } if n <= *remaining => {
                let command = *command;
                *remaining -= n;
                let ended = *remaining == 0;
                if !command {
                    self.mark_damaged();
                }
                // A message that ends across the gap is read as any other: a part the gap cut
                // into is marked damaged and not read.
                if ended {
                    self.end_frame(out);
                }
            }
            State::FrameBody { command, .. } => {
                // The gap runs past this frame: where the next one starts is unknown. What was
                // kept of this message before the gap is still read (a parts it cut into is
                // marked damaged), as a message whose end is unknown.
                if !*command && !self.msg.parts.is_empty() {
                    self.mark_damaged();
                    let mut msg = std::mem::take(&mut self.msg);
                    msg.truncated = true;
                    out.push(msg);
                }
                self.lose_sync();
            }
            State::Greeting(rem) if (n as usize) < *rem => *rem -= n as usize,
            _ => self.lose_sync(),
        }
    }

    fn lose_sync(&mut self) {
        if !matches!(self.state, State::Desync) {
            self.desyncs += 1;
        }
        self.state = State::Desync;
        self.msg = Message::default();
    }

    /// The part being read lost bytes it would have kept.
    fn mark_damaged(&mut self) {
        let kept = self.msg.part_count as usize <= KEEP_PARTS;
        if let Some(p) = self.msg.parts.last()
            && kept
            && p.len() < KEEP_BYTES
        {
            self.msg.damaged |= 1 << (self.msg.parts.len() - 1);
        }
    }

    fn end_frame(&mut self, out: &mut Vec<Message>) {
        let State::FrameBody { command, more, .. } = self.state else {
            return;
        };
        self.state = State::FrameHead(FrameHead::default());
        if command {
            return;
        }
        if !more {
            out.push(std::mem::take(&mut self.msg));
        }
    }
}

/// Which side of a prefill/decode pair wrote a control message. Several SGLang messages share
/// their first frame across directions (a decimal room first: decode's destinations or prefill's
/// status; `MoriMsgGuard` first: Mori's destinations or its status), so a message is read by
/// who sent it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sender {
    Prefill,
    Decode,
}

/// SGLang's `KVPoll` as prefill's status message carries it (`disaggregation/base/conn.py`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvPoll {
    Failed,
    Bootstrapping,
    /// Under `prefill_complete`: prefill prefilled the room and waits for decode's destinations
    /// (the readiness message, `[room, "2", rank]`).
    WaitingForInput,
    Transferring,
    /// The room's KV landed in decode's pages.
    Success,
}

impl KvPoll {
    fn from_ascii(b: &[u8]) -> Option<KvPoll> {
        Some(match b {
            b"0" => KvPoll::Failed,
            b"1" => KvPoll::Bootstrapping,
            b"2" => KvPoll::WaitingForInput,
            b"3" => KvPoll::Transferring,
            b"4" => KvPoll::Success,
            _ => return None,
        })
    }
}

/// SGLang's transfer backends, as their control messages name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Mooncake (and Ascend): untagged frames, the room first.
    Mooncake,
    /// NIXL: `NixlMsgGuard` on decode's messages, `KV_STATUS` on prefill's status.
    Nixl,
    /// Mori: `MoriMsgGuard` on both.
    Mori,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Mooncake => "mooncake",
            Backend::Nixl => "nixl",
            Backend::Mori => "mori",
        }
    }
}

/// What a decoded message means for the request lifecycle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Control {
    /// Decode asked for this transfer before reserving anything: SGLang's `[BOOTSTRAP, room,
    /// ip, port]` (policy `prefill_complete`).
    Bootstrap { room: u64 },
    /// Decode reserved KV pages for the room and told prefill where to write them (policy
    /// `early`, or after readiness under `prefill_complete`). `endpoint` is decode's rank
    /// address from the message (`ip:port`), when it was kept whole; `session` the decode
    /// transfer session prefill files them under (Mooncake's session id, NIXL's agent name,
    /// Mori's engine key); `required` how many distinct sessions complete the room
    /// (`required_dst_info_num`), when the capture kept that part.
    Destinations {
        room: u64,
        backend: Backend,
        endpoint: Option<String>,
        session: Option<String>,
        required: Option<u32>,
    },
    /// Prefill's status for the room, sent to decode.
    Status {
        room: u64,
        status: KvPoll,
        backend: Backend,
    },
    /// Decode withdrew: SGLang's `[ABORT, room, ip, port(, generation)]`.
    Abort { room: u64 },
    /// Prefill's acknowledgement that its writes for an aborted room drained.
    AbortAck { room: u64 },
    /// Bytes of the room's KV moved or a chunk of it landed, as told over the control channel:
    /// `AUX_DATA` (aux data over TCP), `CHUNK_READY` (a staging chunk written).
    KvMoved { room: u64, what: &'static str },
    /// Prefill asked decode for staging space before its forward (`STAGING_REQ`): prefill holds
    /// a sender for the room and is computing its KV.
    StagingRequest { room: u64 },
    /// vLLM NixlConnector: decode asked a prefill engine for its NIXL agent metadata
    /// (`get_meta_msg`), once per engine pair: the engines paired. It names no request.
    NixlHandshake,
    /// vLLM MooncakeConnector: decode pulls the KV of these requests, each as (decode's
    /// request id, the router's `transfer_id`).
    MooncakePull { reqs: Vec<(String, String)> },
    /// vLLM MooncakeConnector: prefill's answer to a pull: decode request ids whose KV landed
    /// (`ok_reqs`) and whose pull failed (`err_reqs`).
    MooncakeStatus { ok: Vec<String>, err: Vec<String> },
}

/// Reads the verb and key of a KV-transfer control message written by `sender`.
///
/// SGLang 0.5.23 (`disaggregation/common/conn.py`, `mooncake/conn.py`, `nixl/conn.py`,
/// `mori/conn.py`; the table in docs/ebpf.md cites each line):
/// - decode → prefill: `[room, ip, port, session, kv_indices, …]` (Mooncake destinations, 10
///   frames), `[NixlMsgGuard|MoriMsgGuard, room, ip, port, …]` (NIXL/Mori destinations),
///   `[BOOTSTRAP, room, ip, port]`, `[ABORT, room, ip, port, generation]`; registrations name
///   the room `None` and are skipped, as are `WATERMARK` and `STAGING_RSP`;
/// - prefill → decode: `[room, status, rank]` (Mooncake status), `[KV_STATUS, room, status,
///   rank, reason]` (NIXL), `[MoriMsgGuard, room, status, rank, reason]` (Mori),
///   `[ABORT_ACK, room(, rank, generation)]`, `[AUX_DATA, room, …]`, `[CHUNK_READY, room, …]`,
///   `[STAGING_REQ, room, …]`.
///
/// KV pages themselves never cross the control channel (the transfer engine writes them), so a
/// room's KV is known to have landed only from prefill's Success status. vLLM's messages (see
/// [`vllm_control`]) say who sent them; one read for the other direction is not theirs. Only
/// verbs, keys, statuses and addresses are read, never a payload.
pub fn control(msg: &Message, sender: Sender) -> Option<Control> {
    if let Some((by, ctl)) = vllm_control(msg) {
        return (by == sender).then_some(ctl);
    }
    // A part with a hole is not read: its bytes may spell another verb, room or name.
    let part = |i: usize| msg.parts.get(i).filter(|_| msg.damaged & (1 << i) == 0);
    let first = part(0)?;
    let room_at = |i: usize| part(i).and_then(|b| parse_room(b));
    let endpoint = |ip: usize, port: usize| -> Option<String> {
        let ip = std::str::from_utf8(part(ip)?).ok()?;
        let port: u16 = std::str::from_utf8(part(port)?).ok()?.parse().ok()?;
        (!ip.is_empty() && ip.len() <= 64 && ip.bytes().all(|c| c.is_ascii_graphic()))
            .then(|| format!("{ip}:{port}"))
    };
    let status = |room: usize, status: usize, backend| {
        Some(Control::Status {
            room: room_at(room)?,
            status: KvPoll::from_ascii(part(status)?)?,
            backend,
        })
    };
    let required = |i: usize| -> Option<u32> {
        let b = part(i)?;
        (!b.is_empty() && b.len() <= 9 && b.iter().all(u8::is_ascii_digit))
            .then(|| std::str::from_utf8(b).ok()?.parse().ok())
            .flatten()
            .filter(|n| *n > 0)
    };
    // Frames by backend (`build_receiver_metadata_message`): Mooncake `[room, ip, port,
    // session, kv, aux, state, required, ..]`; NIXL `[guard, room, ip, port, agent, kv, aux,
    // required, ..]`; Mori `[guard, room, ip, port, engine key, kv, aux, state, required, ..]`.
    let destinations = |backend, room: usize, ip: usize, session: usize, req: usize| {
        Some(Control::Destinations {
            room: room_at(room)?,
            backend,
            endpoint: endpoint(ip, ip + 1),
            session: part(session).and_then(|b| parse_name(b)),
            required: required(req),
        })
    };
    use Sender::{Decode, Prefill};
    match (sender, first.as_slice()) {
        (Decode, b"BOOTSTRAP") => room_at(1).map(|room| Control::Bootstrap { room }),
        (Decode, b"ABORT") => room_at(1).map(|room| Control::Abort { room }),
        (Decode, b"NixlMsgGuard") => destinations(Backend::Nixl, 1, 2, 4, 7),
        (Decode, b"MoriMsgGuard") => destinations(Backend::Mori, 1, 2, 4, 8),
        (Prefill, b"KV_STATUS") => status(1, 2, Backend::Nixl),
        (Prefill, b"MoriMsgGuard") => status(1, 2, Backend::Mori),
        (Prefill, b"ABORT_ACK") => room_at(1).map(|room| Control::AbortAck { room }),
        (Prefill, b"AUX_DATA") => room_at(1).map(|room| Control::KvMoved {
            room,
            what: "AUX_DATA",
        }),
        (Prefill, b"CHUNK_READY") => room_at(1).map(|room| Control::KvMoved {
            room,
            what: "CHUNK_READY",
        }),
        (Prefill, b"STAGING_REQ") => room_at(1).map(|room| Control::StagingRequest { room }),
        // Mooncake's untagged messages start with the room in decimal: decode's destinations
        // are ten frames (`build_receiver_metadata_message`), prefill's status three
        // (`_encode_kv_status_message`, four where a backend adds the reason). A message a
        // capture gap cut short is destinations once it had five frames: no status has.
        (Decode, _)
            if (msg.part_count >= 8 || (msg.truncated && msg.part_count >= 5))
                && parse_room(first).is_some() =>
        {
            destinations(Backend::Mooncake, 0, 1, 3, 7)
        }
        (Prefill, _)
            if (3..=4).contains(&msg.part_count)
                && !msg.truncated
                && parse_room(first).is_some() =>
        {
            status(0, 1, Backend::Mooncake)
        }
        _ => None,
    }
}

fn is_msgpack_map(b: u8) -> bool {
    matches!(b, 0x80..=0x8f | 0xde | 0xdf)
}

/// vLLM 0.34's KV-connector messages on ZeroMQ, msgspec MessagePack, with who sent them (each
/// kind goes one way only, so the content says it where a process's role does not: vLLM's
/// connectors run in its engine-core process, which serves no HTTP):
/// - NixlConnector (`nixl/base_worker.py` `_nixl_handshake`, `nixl/metadata.py`): decode's REQ
///   sends `["", msgpack ("get_meta_msg", pp_rank, tp_rank)]` to prefill's ROUTER once per
///   remote engine; the answer (the agent metadata) is not read. No request id travels here: KV
///   moves by NIXL/UCX reads and per-request notifications, not over ZeroMQ.
/// - MooncakeConnector (`mooncake/mooncake_connector.py` `MooncakeXferMetadata`,
///   `MooncakeXferResponse`): decode's DEALER sends one map per pull whose `req_blocks` maps
///   decode's request id to `(transfer_id, blocks)`; prefill's ROUTER answers maps with
///   `status` and `ok_reqs` / `err_reqs` (decode request ids). Lease heartbeats
///   (`lease_transfer_ids` only) are not read.
pub fn vllm_control(msg: &Message) -> Option<(Sender, Control)> {
    if msg.damaged & 0b11 != 0 {
        return None;
    }
    match msg.parts.as_slice() {
        [empty, body] if empty.is_empty() && msg.part_count == 2 => {
            let mut r = Reader::new(body);
            (r.array()? == 3 && r.bytes()? == b"get_meta_msg")
                .then_some((Sender::Decode, Control::NixlHandshake))
        }
        [body] if msg.part_count == 1 && body.first().copied().is_some_and(is_msgpack_map) => {
            mooncake_message(body)
        }
        _ => None,
    }
}

/// Most requests one MooncakeConnector message is read for.
const MAX_PULL_REQS: usize = 64;

/// A MooncakeConnector pull or answer: the keys are read in order up to the ones that matter,
/// and what a capture cut short is read as far as it is whole.
fn mooncake_message(body: &[u8]) -> Option<(Sender, Control)> {
    let mut r = Reader::new(body);
    let fields = r.map()?;
    let (mut reqs, mut ok, mut err, mut status) = (None, Vec::new(), Vec::new(), None);
    let id = |b: &[u8]| parse_name(b);
    for _ in 0..fields {
        let Some(key) = r.bytes() else { break };
        let read = match key {
            b"req_blocks" => (|| {
                let mut found = Vec::new();
                let n = r.map()?;
                for _ in 0..n {
                    let d_req = r.bytes()?;
                    let tuple = r.array()?;
                    if tuple == 0 {
                        return None;
                    }
                    let transfer = r.bytes()?;
                    for _ in 1..tuple {
                        r.skip()?;
                    }
                    if let (Some(d), Some(t)) = (id(d_req), id(transfer))
                        && found.len() < MAX_PULL_REQS
                    {
                        found.push((d, t));
                    }
                }
                reqs = Some(found);
                Some(())
            })(),
            b"status" => r.int().map(|s| status = Some(s)),
            b"ok_reqs" | b"err_reqs" => (|| {
                let into = if key == b"ok_reqs" { &mut ok } else { &mut err };
                match r.value()? {
                    Value::Nil => {}
                    Value::Array(n) => {
                        for _ in 0..n {
                            let d = r.bytes()?;
                            if let Some(d) = id(d)
                                && into.len() < MAX_PULL_REQS
                            {
                                into.push(d);
                            }
                        }
                    }
                    _ => return None,
                }
                Some(())
            })(),
            _ => r.skip(),
        };
        if read.is_none() {
            break;
        }
    }
    if let Some(reqs) = reqs.filter(|r| !r.is_empty()) {
        return Some((Sender::Decode, Control::MooncakePull { reqs }));
    }
    // `status` is the answer's first field: a message without it is not one.
    status?;
    (!ok.is_empty() || !err.is_empty())
        .then_some((Sender::Prefill, Control::MooncakeStatus { ok, err }))
}

/// A request name as an id: printable ASCII, not empty.
fn parse_name(b: &[u8]) -> Option<String> {
    (!b.is_empty() && b.iter().all(|c| c.is_ascii_graphic()))
        .then(|| String::from_utf8_lossy(b).into_owned())
}

/// A room as SGLang writes it on the control channel: `str(room).encode("ascii")`, decimal
/// digits only (Python's `int()` on the reading side takes nothing else SGLang sends).
fn parse_room(b: &[u8]) -> Option<u64> {
    if b.is_empty() || b.len() > 20 || !b.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(b).ok()?.parse().ok()
}

/// Bytes vLLM 0.34's own msgspec encoder wrote (`MooncakeXferMetadata` for decode request
/// `cmpl-req-7-0-1a2b3c4d` and transfer `5f0c7e1a-…`, `MooncakeXferResponse` FINISH and ERROR
/// for it, `MooncakeLeaseHeartbeat`, NIXL's `(GET_META_MSG, 0, 0)`), for the tests here and the
/// tracker's.
#[cfg(test)]
pub(crate) mod vllm_bytes {
    pub(crate) fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    pub(crate) const PULL: &str = "88af72656d6f74655f686f73746e616d65a93132372e302e302e31ab72656d6f74655f706f7274cd4269ae72656d6f74655f74705f73697a6501ae72656d6f74655f74705f72616e6b00aa7265715f626c6f636b7381b5636d706c2d7265712d372d302d316132623363346492d92435663063376531612d396437622d346133362d386634622d3266366439613063316531319193010203b36b765f6361636865735f626173655f6164647291cf0000002098a67800aa626c6f636b5f6c656e7391ce00010000ad6b765f626c6f636b5f6c656e7391ce00010000";
    pub(crate) const FINISH: &str =
        "82a673746174757300a76f6b5f7265717391b5636d706c2d7265712d372d302d3161326233633464";
    pub(crate) const ERROR: &str = "83a673746174757302a86572725f7265717391b5636d706c2d7265712d372d302d3161326233633464a76572725f6d7367a4626f6f6d";
    pub(crate) const HEARTBEAT: &str = "81b26c656173655f7472616e736665725f69647391a27431";
    pub(crate) const GET_META: &str = "93c40c6765745f6d6574615f6d73670000";
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn frame(body: &[u8], more: bool) -> Vec<u8> {
        let mut f = vec![if more { 1 } else { 0 }];
        if body.len() > 255 {
            f[0] |= 2;
            f.extend_from_slice(&(body.len() as u64).to_be_bytes());
        } else {
            f.push(body.len() as u8);
        }
        f.extend_from_slice(body);
        f
    }

    fn greeting_and_ready() -> Vec<u8> {
        let mut g = vec![0xFF, 0, 0, 0, 0, 0, 0, 0, 1, 0x7F, 3, 1];
        g.extend_from_slice(b"NULL");
        g.resize(64, 0);
        // READY command with Socket-Type PUSH.
        let body = b"\x05READY\x0bSocket-Type\x00\x00\x00\x04PUSH";
        g.push(0x04);
        g.push(body.len() as u8);
        g.extend_from_slice(body);
        g
    }

    fn msg(parts: &[&[u8]]) -> Message {
        Message {
            parts: parts.iter().take(KEEP_PARTS).map(|p| p.to_vec()).collect(),
            part_count: parts.len() as u32,
            damaged: 0,
            truncated: false,
        }
    }

    /// Decode's Mooncake destinations as `build_receiver_metadata_message` builds them (10
    /// frames; `mooncake/conn.py`).
    fn mooncake_destinations(room: &[u8]) -> Vec<Vec<u8>> {
        vec![
            room.to_vec(),
            b"127.0.0.1".to_vec(),
            b"17001".to_vec(),
            b"127.0.0.1:15001".to_vec(),
            [1i32, 2, 3].iter().flat_map(|i| i.to_le_bytes()).collect(),
            b"0".to_vec(),
            b"".to_vec(),
            b"1".to_vec(),
            b"0".to_vec(),
            b"".to_vec(),
        ]
    }

    fn refs(v: &[Vec<u8>]) -> Vec<&[u8]> {
        v.iter().map(|p| p.as_slice()).collect()
    }

    #[test]
    fn mooncake_messages_by_direction() {
        const ROOM: &[u8] = b"9066467638188682269";
        let room = 9066467638188682269;
        let dst = mooncake_destinations(ROOM);
        assert_eq!(
            control(&msg(&refs(&dst)), Sender::Decode),
            Some(Control::Destinations {
                room,
                backend: Backend::Mooncake,
                endpoint: Some("127.0.0.1:17001".into()),
                session: Some("127.0.0.1:15001".into()),
                required: Some(1),
            })
        );
        // The same frames from prefill are no status, and a status from decode no destinations.
        assert_eq!(control(&msg(&refs(&dst)), Sender::Prefill), None);
        for (status, poll) in [
            (&b"4"[..], KvPoll::Success),
            (b"0", KvPoll::Failed),
            (b"2", KvPoll::WaitingForInput),
        ] {
            let m = msg(&[ROOM, status, b"0"]);
            assert_eq!(
                control(&m, Sender::Prefill),
                Some(Control::Status {
                    room,
                    status: poll,
                    backend: Backend::Mooncake
                })
            );
            assert_eq!(control(&m, Sender::Decode), None);
        }
        assert_eq!(control(&msg(&[ROOM, b"9", b"0"]), Sender::Prefill), None);
        // The receiver registration names the room `None`.
        let mut reg: Vec<&[u8]> = vec![b"None", b"127.0.0.1", b"17001", b"127.0.0.1:15001"];
        reg.resize(20, b"");
        assert_eq!(control(&msg(&reg), Sender::Decode), None);
        assert_eq!(
            control(
                &msg(&[b"ABORT", ROOM, b"127.0.0.1", b"17001", b"3"]),
                Sender::Decode
            ),
            Some(Control::Abort { room })
        );
        assert_eq!(
            control(&msg(&[b"ABORT_ACK", ROOM, b"0", b"3"]), Sender::Prefill),
            Some(Control::AbortAck { room })
        );
        assert_eq!(
            control(&msg(&[b"AUX_DATA", ROOM, b"x", b"0"]), Sender::Prefill),
            Some(Control::KvMoved {
                room,
                what: "AUX_DATA"
            })
        );
        assert_eq!(
            control(
                &msg(&[b"BOOTSTRAP", ROOM, b"127.0.0.1", b"17001"]),
                Sender::Decode
            ),
            Some(Control::Bootstrap { room })
        );
        assert_eq!(
            control(&msg(&[b"WATERMARK", b"1", b"2", b"s"]), Sender::Decode),
            None
        );
        // Hex and signs are not how SGLang writes a room.
        assert_eq!(control(&msg(&[b"0x10", b"4", b"0"]), Sender::Prefill), None);
        assert_eq!(control(&msg(&[b"-1", b"4", b"0"]), Sender::Prefill), None);
    }

    #[test]
    fn nixl_and_mori_messages() {
        let guard_nixl: Vec<&[u8]> = vec![
            b"NixlMsgGuard",
            b"42",
            b"10.0.0.2",
            b"17001",
            b"agent",
            b"",
            b"0",
            b"1",
            b"",
            b"0",
            b"0",
        ];
        assert_eq!(
            control(&msg(&guard_nixl), Sender::Decode),
            Some(Control::Destinations {
                room: 42,
                backend: Backend::Nixl,
                endpoint: Some("10.0.0.2:17001".into()),
                session: Some("agent".into()),
                required: Some(1),
            })
        );
        let reg: Vec<&[u8]> = vec![b"NixlMsgGuard", b"None", b"10.0.0.2", b"17001"];
        assert_eq!(control(&msg(&reg), Sender::Decode), None);
        assert_eq!(
            control(
                &msg(&[b"KV_STATUS", b"42", b"0", b"0", b"transfer failed"]),
                Sender::Prefill
            ),
            Some(Control::Status {
                room: 42,
                status: KvPoll::Failed,
                backend: Backend::Nixl
            })
        );
        let mori_dst: Vec<&[u8]> = vec![
            b"MoriMsgGuard",
            b"42",
            b"10.0.0.2",
            b"17001",
            b"engine-k",
            b"",
            b"",
            b"",
            b"2",
            b"",
        ];
        assert_eq!(
            control(&msg(&mori_dst), Sender::Decode),
            Some(Control::Destinations {
                room: 42,
                backend: Backend::Mori,
                endpoint: Some("10.0.0.2:17001".into()),
                session: Some("engine-k".into()),
                required: Some(2),
            })
        );
        // Cut short before its session count, it is still destinations.
        assert_eq!(
            control(&msg(&mori_dst[..5]), Sender::Decode),
            Some(Control::Destinations {
                room: 42,
                backend: Backend::Mori,
                endpoint: Some("10.0.0.2:17001".into()),
                session: Some("engine-k".into()),
                required: None,
            })
        );
        assert_eq!(
            control(
                &msg(&[b"MoriMsgGuard", b"42", b"4", b"0", b""]),
                Sender::Prefill
            ),
            Some(Control::Status {
                room: 42,
                status: KvPoll::Success,
                backend: Backend::Mori
            })
        );
    }

    #[test]
    fn messages_through_the_stream_decoder() {
        let mut wire = greeting_and_ready();
        for p in mooncake_destinations(b"123").iter().enumerate() {
            wire.extend(frame(p.1, p.0 < 9));
        }
        wire.extend(frame(b"ABORT", true));
        wire.extend(frame(&[7u8; 300], true));
        wire.extend(frame(b"42", false));
        for split in [1, 10, 63, 64, 70, 90, wire.len() - 1] {
            let mut s = ZmtpStream::from_greeting();
            let mut out = Vec::new();
            s.feed(&wire[..split], true, &mut out);
            s.feed(&wire[split..], false, &mut out);
            assert_eq!(out.len(), 2, "split {split}");
            assert_eq!(out[0].part_count, 10);
            assert!(matches!(
                control(&out[0], Sender::Decode),
                Some(Control::Destinations { room: 123, .. })
            ));
            assert_eq!(out[1].part_count, 3);
            assert_eq!(out[1].parts[1].len(), KEEP_BYTES);
            assert_eq!(
                control(&out[1], Sender::Decode),
                None,
                "300-byte room is not a room"
            );
        }
        let mut s = ZmtpStream::mid_stream();
        let mut out = Vec::new();
        s.feed(
            &[frame(b"ABORT", true), frame(b"42", false)].concat(),
            true,
            &mut out,
        );
        assert_eq!(
            control(&out[0], Sender::Decode),
            Some(Control::Abort { room: 42 })
        );
    }

    /// Bytes lost inside a room (the capture missed part of a syscall) never yield a room: a
    /// 19-digit room cut to its first digits is another room. A hole in a payload alone keeps
    /// the message.
    #[test]
    fn a_capture_gap_inside_a_kept_part_voids_it() {
        let mut wire = greeting_and_ready();
        let head = wire.len();
        let room_at = wire.len() + 2;
        wire.extend(frame(b"9066467638188682269", true));
        wire.extend(frame(b"4", true));
        wire.extend(frame(b"0", false));
        // The room's last 14 digits fall into a gap (n == what the frame had left), or its middle
        // digits do (n < remaining).
        for (cut, lost) in [(5usize, 14u64), (5, 6)] {
            let mut s = ZmtpStream::from_greeting();
            let mut out = Vec::new();
            s.feed(&wire[..room_at + cut], true, &mut out);
            s.gap(lost, &mut out);
            s.feed(&wire[room_at + cut + lost as usize..], false, &mut out);
            assert_eq!(out.len(), 1, "cut {cut} lost {lost}");
            assert_eq!(control(&out[0], Sender::Prefill), None, "{:?}", out[0]);
        }
        let mut aux = wire[..head].to_vec();
        aux.extend(frame(b"AUX_DATA", true));
        aux.extend(frame(b"42", true));
        aux.extend(frame(b"0", true));
        let payload_at = aux.len() + 9;
        aux.extend(frame(&[7u8; 4096], false));
        let mut s = ZmtpStream::from_greeting();
        let mut out = Vec::new();
        s.feed(&aux[..payload_at + 100], true, &mut out);
        s.gap(4096 - 200, &mut out);
        s.feed(&aux[payload_at + 4096 - 100..], false, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(
            control(&out[0], Sender::Prefill),
            Some(Control::KvMoved {
                room: 42,
                what: "AUX_DATA"
            })
        );
    }

    /// ZeroMQ batches several messages into one write; the capture keeps its head and tail.
    /// A gap that starts inside the first message's page indices (not kept) and runs into the
    /// next messages still yields the first message, as destinations (five frames seen, and no
    /// status has five); the stream is counted out of sync until a syscall starts a frame.
    #[test]
    fn a_gap_past_a_message_keeps_what_came_before_it() {
        let mut wire = greeting_and_ready();
        let dst = mooncake_destinations(b"77");
        for (i, p) in dst.iter().enumerate() {
            if i == 4 {
                wire.extend(frame(&[9u8; 800], true));
            } else {
                wire.extend(frame(p, i < 9));
            }
        }
        // The gap starts 100 bytes into the page indices and runs past the message.
        let cut = wire.iter().rposition(|_| true).unwrap();
        let indices_at = wire.len() - (dst[5..].iter().map(|p| p.len() + 2).sum::<usize>()) - 800;
        let mut s = ZmtpStream::from_greeting();
        let mut out = Vec::new();
        s.feed(&wire[..indices_at + 100], true, &mut out);
        assert!(out.is_empty());
        s.gap((cut - indices_at) as u64 + 5000, &mut out);
        assert_eq!(out.len(), 1);
        assert!(out[0].truncated);
        assert_eq!(
            control(&out[0], Sender::Decode),
            Some(Control::Destinations {
                room: 77,
                backend: Backend::Mooncake,
                endpoint: Some("127.0.0.1:17001".into()),
                session: Some("127.0.0.1:15001".into()),
                // The session count lies past the gap.
                required: None,
            })
        );
        // Cut short, it is no status either.
        assert_eq!(control(&out[0], Sender::Prefill), None);
        assert_eq!(s.desyncs, 1);
        // Back in sync at the next syscall that starts a frame.
        s.feed(
            &[frame(b"ABORT", true), frame(b"77", false)].concat(),
            true,
            &mut out,
        );
        assert_eq!(
            control(&out[1], Sender::Decode),
            Some(Control::Abort { room: 77 })
        );
        assert_eq!(s.desyncs, 1);
    }

    use super::vllm_bytes::*;

    #[test]
    fn vllm_connector_messages_say_who_sent_them() {
        let d_req = "cmpl-req-7-0-1a2b3c4d".to_owned();
        let transfer = "5f0c7e1a-9d7b-4a36-8f4b-2f6d9a0c1e11".to_owned();
        let pull = msg(&[&hex(PULL)]);
        let want = Control::MooncakePull {
            reqs: vec![(d_req.clone(), transfer)],
        };
        assert_eq!(vllm_control(&pull), Some((Sender::Decode, want.clone())));
        assert_eq!(control(&pull, Sender::Decode), Some(want));
        // A message read for the other direction is not that direction's.
        assert_eq!(control(&pull, Sender::Prefill), None);
        assert_eq!(
            vllm_control(&msg(&[&hex(FINISH)])),
            Some((
                Sender::Prefill,
                Control::MooncakeStatus {
                    ok: vec![d_req.clone()],
                    err: vec![]
                }
            ))
        );
        assert_eq!(
            vllm_control(&msg(&[&hex(ERROR)])),
            Some((
                Sender::Prefill,
                Control::MooncakeStatus {
                    ok: vec![],
                    err: vec![d_req]
                }
            ))
        );
        assert_eq!(vllm_control(&msg(&[&hex(HEARTBEAT)])), None);
        assert_eq!(
            vllm_control(&msg(&[b"", &hex(GET_META)])),
            Some((Sender::Decode, Control::NixlHandshake))
        );
        // NIXL's answer (`["", payload, time]`) and SGLang's frames are not vLLM's.
        assert_eq!(vllm_control(&msg(&[b"", b"\x92\x01\x02", b"\xcb"])), None);
        assert_eq!(vllm_control(&msg(&[b"123", b"127.0.0.1", b"7001"])), None);
    }

    #[test]
    fn a_pull_survives_the_stream_decoder_and_a_cut_one_reads_what_is_whole() {
        let body = hex(PULL);
        let mut s = ZmtpStream::mid_stream();
        let mut out = Vec::new();
        s.feed(&frame(&body, false), true, &mut out);
        assert_eq!(
            out[0].parts[0], body,
            "a MessagePack part is kept past KEEP_BYTES"
        );
        assert!(matches!(
            control(&out[0], Sender::Decode),
            Some(Control::MooncakePull { .. })
        ));
        // Cut inside the transfer id: nothing is read (a cut id is another id).
        let at = body.len() - 80;
        assert_eq!(vllm_control(&msg(&[&body[..at]])), None);
    }

    proptest! {
        #[test]
        fn never_panics(chunks in proptest::collection::vec((proptest::collection::vec(any::<u8>(), 0..200), any::<bool>(), 0u64..50), 0..8), greet in any::<bool>()) {
            let mut s = if greet { ZmtpStream::from_greeting() } else { ZmtpStream::mid_stream() };
            let mut out = Vec::new();
            for (c, start, gap) in &chunks {
                s.feed(c, *start, &mut out);
                s.gap(*gap, &mut out);
            }
            for m in &out {
                prop_assert!(m.parts.len() <= KEEP_PARTS);
                // A first part that starts a MessagePack map keeps more (vLLM's msgspec
                // messages); every other part at most KEEP_BYTES.
                let bound = |i: usize| if i == 0 { KEEP_MSGPACK_BYTES.max(KEEP_BYTES) } else { KEEP_BYTES };
                let within = m.parts.iter().enumerate().all(|(i, p)| p.len() <= bound(i));
                prop_assert!(within);
                let _ = control(m, Sender::Prefill);
                let _ = control(m, Sender::Decode);
            }
        }
    }
}
