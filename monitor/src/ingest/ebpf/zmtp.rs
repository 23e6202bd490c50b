//! ZMTP 3.x (ZeroMQ over TCP, as libzmq/pyzmq send it), one direction of a connection.
//!
//! The KV-transfer control channel between decode and prefill is ZeroMQ: decode pushes
//! multipart messages such as `[b"BOOTSTRAP", room, ip, port]` or `[b"ABORT", room]`. We decode
//! frames and keep only the first few bytes of the first few parts of each message: enough for
//! the verb and the room, never payloads.

/// Parts of a message we keep, and bytes of each.
pub const KEEP_PARTS: usize = 4;
/// Enough for a vLLM request name (`cmpl-` + vllm-router's ~100-byte id), cut where revenant
/// cuts ids anyway.
pub const KEEP_BYTES: usize = crate::normalize::attrs::MAX_ID_BYTES;
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
}

#[derive(Debug)]
enum State {
    Greeting(usize),
    FrameHead(Vec<u8>),
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
        }
    }

    /// A stream picked up mid-way (the connection predates us); waits for a syscall that starts
    /// with a plausible frame.
    pub fn mid_stream() -> Self {
        ZmtpStream {
            state: State::Desync,
            msg: Message::default(),
        }
    }

    pub fn feed(&mut self, mut data: &[u8], syscall_start: bool, out: &mut Vec<Message>) {
        if matches!(self.state, State::Desync) {
            if !syscall_start || data.is_empty() || data[0] & !0x07 != 0 {
                return;
            }
            self.state = State::FrameHead(Vec::new());
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
                        self.state = State::FrameHead(Vec::new());
                    }
                }
                State::FrameHead(h) => {
                    let need = if h.is_empty() {
                        2
                    } else if h[0] & 0x02 != 0 {
                        9
                    } else {
                        2
                    };
                    let n = (need - h.len()).min(data.len());
                    h.extend_from_slice(&data[..n]);
                    data = &data[n..];
                    if h[0] & !0x07 != 0 {
                        self.state = State::Desync;
                        return;
                    }
                    let need = if h[0] & 0x02 != 0 { 9 } else { 2 };
                    if h.len() < need {
                        continue;
                    }
                    let flags = h[0];
                    let size = if flags & 0x02 != 0 {
                        u64::from_be_bytes(h[1..9].try_into().expect("8 bytes"))
                    } else {
                        h[1] as u64
                    };
                    if size > MAX_FRAME {
                        self.state = State::Desync;
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
                        let k = (KEEP_BYTES - p.len().min(KEEP_BYTES)).min(n);
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

    pub fn gap(&mut self, n: u64) {
        if let State::FrameBody {
            remaining, command, ..
        } = self.state
            && n <= remaining
            && !command
        {
            self.mark_damaged();
        }
        match &mut self.state {
            State::FrameBody { remaining, .. } if n < *remaining => *remaining -= n,
            State::FrameBody { remaining, .. } if n == *remaining => {
                *remaining = 0;
                let mut sink = Vec::new();
                self.end_frame(&mut sink);
                // A message completed across a gap may have lost its verb; drop it.
            }
            State::Greeting(rem) if (n as usize) < *rem => *rem -= n as usize,
            _ => self.state = State::Desync,
        }
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
        self.state = State::FrameHead(Vec::new());
        if command {
            return;
        }
        if !more {
            out.push(std::mem::take(&mut self.msg));
        }
    }
}

/// The transfer a control message is about: an SGLang `bootstrap_room`, or the vLLM request
/// whose KV moves (`kv_transfer_params.remote_request_id`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferKey {
    Room(u64),
    Request(String),
}

/// What a decoded message means for the request lifecycle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Control {
    /// Decode registered for (and so asked for the KV of) this transfer: the handshake.
    Bootstrap { key: TransferKey },
    /// Decode withdrew before the KV arrived.
    Abort { key: TransferKey },
    /// A chunk of the KV cache, sent by prefill (`chunk` counts from 0).
    Kv { key: TransferKey, chunk: u64 },
    /// Prefill sent the last KV chunk.
    KvDone { key: TransferKey },
}

/// Reads the verb and key of a KV-transfer control message.
///
/// SGLang, decode to prefill: `[b"BOOTSTRAP", room, ..]`, `[b"ABORT", room]`, and SGLang's
/// transfer-info message whose first part is the room itself (`[str(room), ip, port, ..]`);
/// prefill to decode: `[b"KV", room, chunk, payload]` and `[b"KV_DONE", room, tokens]`.
/// The vLLM side channel (pd-sim's model of NIXL's, keyed by the request name): decode to
/// prefill `[b"NIXL_READ", name, ..]`, `[b"NIXL_ABORT", name]`; prefill to decode
/// `[b"NIXL_KV", name, chunk, payload]`, `[b"NIXL_DONE", name, tokens]`. Only the verb, the key
/// and the chunk index are read, never the payload.
pub fn control(msg: &Message) -> Option<Control> {
    // A part with a hole is not read: its bytes may spell another verb, room or name.
    let part = |i: usize| msg.parts.get(i).filter(|_| msg.damaged & (1 << i) == 0);
    let first = part(0)?;
    let room = |i: usize| parse_room(part(i)?).map(TransferKey::Room);
    let name = |i: usize| parse_name(part(i)?).map(TransferKey::Request);
    let chunk = || -> Option<u64> { std::str::from_utf8(part(2)?).ok()?.parse().ok() };
    match first.as_slice() {
        b"BOOTSTRAP" => room(1).map(|key| Control::Bootstrap { key }),
        b"ABORT" => room(1).map(|key| Control::Abort { key }),
        b"KV" => Some(Control::Kv {
            key: room(1)?,
            chunk: chunk()?,
        }),
        b"KV_DONE" => room(1).map(|key| Control::KvDone { key }),
        b"NIXL_READ" => name(1).map(|key| Control::Bootstrap { key }),
        b"NIXL_ABORT" => name(1).map(|key| Control::Abort { key }),
        b"NIXL_KV" => Some(Control::Kv {
            key: name(1)?,
            chunk: chunk()?,
        }),
        b"NIXL_DONE" => name(1).map(|key| Control::KvDone { key }),
        other if msg.part_count >= 2 => parse_room_text(other).map(|room| Control::Bootstrap {
            key: TransferKey::Room(room),
        }),
        _ => None,
    }
}

/// A request name as an id: printable ASCII, not empty.
fn parse_name(b: &[u8]) -> Option<String> {
    (!b.is_empty() && b.iter().all(|c| c.is_ascii_graphic()))
        .then(|| String::from_utf8_lossy(b).into_owned())
}

fn parse_room_text(b: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(b).ok()?;
    if s.is_empty() || s.len() > 20 {
        return None;
    }
    s.parse::<crate::event::BootstrapRoom>().ok().map(|r| r.0)
}

fn parse_room(b: &[u8]) -> Option<u64> {
    parse_room_text(b).or_else(|| {
        // A room sent as a raw 8-byte integer.
        (b.len() == 8).then(|| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    })
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

    #[test]
    fn bootstrap_and_abort_messages() {
        let mut wire = greeting_and_ready();
        wire.extend(frame(b"BOOTSTRAP", true));
        wire.extend(frame(b"9066467638188682269", true));
        wire.extend(frame(b"127.0.0.1", true));
        wire.extend(frame(b"17001", false));
        wire.extend(frame(b"ABORT", true));
        wire.extend(frame(&[7u8; 300], true));
        wire.extend(frame(b"42", false));
        for split in [1, 10, 63, 64, 70, 90, wire.len() - 1] {
            assert!(is_greeting(&wire));
            let mut s = ZmtpStream::from_greeting();
            let mut out = Vec::new();
            s.feed(&wire[..split], true, &mut out);
            s.feed(&wire[split..], false, &mut out);
            assert_eq!(out.len(), 2, "split {split}");
            assert_eq!(
                control(&out[0]),
                Some(Control::Bootstrap {
                    key: TransferKey::Room(9066467638188682269)
                })
            );
            assert_eq!(out[1].part_count, 3);
            assert_eq!(out[1].parts[1].len(), KEEP_BYTES);
            assert_eq!(control(&out[1]), None, "300-byte room is not a room");
        }
        let mut s = ZmtpStream::mid_stream();
        let mut out = Vec::new();
        s.feed(
            &[frame(b"ABORT", true), frame(b"42", false)].concat(),
            true,
            &mut out,
        );
        assert_eq!(
            control(&out[0]),
            Some(Control::Abort {
                key: TransferKey::Room(42)
            })
        );
    }

    /// Bytes lost inside a room (the capture missed part of a syscall) never yield a room: a
    /// 19-digit room cut to its first digits is another room. A hole in the payload alone
    /// keeps the message.
    #[test]
    fn a_capture_gap_inside_a_kept_part_voids_it() {
        let mut wire = greeting_and_ready();
        let head = wire.len();
        wire.extend(frame(b"KV_DONE", true));
        let room_at = wire.len() + 2;
        wire.extend(frame(b"9066467638188682269", true));
        wire.extend(frame(b"64", false));
        // The room's last 14 digits fall into a gap (n == what the frame had left), or its middle
        // digits do (n < remaining).
        for (cut, lost) in [(5usize, 14u64), (5, 6)] {
            let mut s = ZmtpStream::from_greeting();
            let mut out = Vec::new();
            s.feed(&wire[..room_at + cut], true, &mut out);
            s.gap(lost);
            s.feed(&wire[room_at + cut + lost as usize..], false, &mut out);
            assert_eq!(out.len(), 1, "cut {cut} lost {lost}");
            assert_eq!(control(&out[0]), None, "{:?}", out[0]);
        }
        let mut kv = wire[..head].to_vec();
        kv.extend(frame(b"KV", true));
        kv.extend(frame(b"42", true));
        kv.extend(frame(b"0", true));
        let payload_at = kv.len() + 9;
        kv.extend(frame(&[7u8; 4096], false));
        let mut s = ZmtpStream::from_greeting();
        let mut out = Vec::new();
        s.feed(&kv[..payload_at + 100], true, &mut out);
        s.gap(4096 - 200);
        s.feed(&kv[payload_at + 4096 - 100..], false, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(
            control(&out[0]),
            Some(Control::Kv {
                key: TransferKey::Room(42),
                chunk: 0
            })
        );
    }

    #[test]
    fn sglang_transfer_info_names_the_room_first() {
        let msg = Message {
            parts: vec![b"123".to_vec(), b"10.0.0.1".to_vec()],
            part_count: 6,
            damaged: 0,
        };
        assert_eq!(
            control(&msg),
            Some(Control::Bootstrap {
                key: TransferKey::Room(123)
            })
        );
        let msg = Message {
            parts: vec![b"hello".to_vec(), b"x".to_vec()],
            part_count: 2,
            damaged: 0,
        };
        assert_eq!(control(&msg), None);
    }

    #[test]
    fn vllm_side_channel_names_the_request() {
        let name = "cmpl-___prefill_addr_127.0.0.1:8100___decode_addr_127.0.0.1:8200_0123456789abcdef0123456789abcdef";
        let msg = |parts: &[&[u8]]| Message {
            parts: parts.iter().map(|p| p.to_vec()).collect(),
            part_count: parts.len() as u32,
            damaged: 0,
        };
        let key = TransferKey::Request(name.to_owned());
        assert_eq!(
            control(&msg(&[
                b"NIXL_READ",
                name.as_bytes(),
                b"127.0.0.1",
                b"7001"
            ])),
            Some(Control::Bootstrap { key: key.clone() })
        );
        assert_eq!(
            control(&msg(&[b"NIXL_KV", name.as_bytes(), b"0", b"\x00\x01"])),
            Some(Control::Kv {
                key: key.clone(),
                chunk: 0
            })
        );
        assert_eq!(
            control(&msg(&[b"NIXL_DONE", name.as_bytes(), b"12"])),
            Some(Control::KvDone { key: key.clone() })
        );
        assert_eq!(
            control(&msg(&[b"NIXL_ABORT", name.as_bytes()])),
            Some(Control::Abort { key })
        );
        // Binary or empty names are not names.
        assert_eq!(control(&msg(&[b"NIXL_READ", b"\x00\xff"])), None);
        assert_eq!(control(&msg(&[b"NIXL_READ", b""])), None);
        // The whole name survives the stream decoder's per-part cut.
        let mut wire = Vec::new();
        wire.extend(frame(b"NIXL_READ", true));
        wire.extend(frame(name.as_bytes(), false));
        let mut s = ZmtpStream::mid_stream();
        let mut out = Vec::new();
        s.feed(&wire, true, &mut out);
        assert_eq!(
            control(&out[0]),
            Some(Control::Bootstrap {
                key: TransferKey::Request(name.to_owned())
            })
        );
    }

    proptest! {
        #[test]
        fn never_panics(chunks in proptest::collection::vec((proptest::collection::vec(any::<u8>(), 0..200), any::<bool>(), 0u64..50), 0..8), greet in any::<bool>()) {
            let mut s = if greet { ZmtpStream::from_greeting() } else { ZmtpStream::mid_stream() };
            let mut out = Vec::new();
            for (c, start, gap) in &chunks {
                s.feed(c, *start, &mut out);
                s.gap(*gap);
            }
            for m in &out {
                prop_assert!(m.parts.len() <= KEEP_PARTS);
                prop_assert!(m.parts.iter().all(|p| p.len() <= KEEP_BYTES));
                let _ = control(m);
            }
        }
    }
}
