//! Minimal ZMTP 3.x (ZeroMQ wire protocol) for the KV-transfer control channel (the messages:
//! `crate::kvlink`).
//!
//! SGLang's Mooncake path talks over pyzmq PUSH/PULL sockets, so the bytes on the wire are
//! ZMTP: a 64-byte greeting, a NULL-mechanism READY command from each side, then frames.
//! revenant's eBPF side parses these frames off the socket, so the simulator must put the
//! exact same bytes on the wire as libzmq does (greeting version 3.1, short frames for
//! bodies ≤255 bytes, long frames with a 64-bit big-endian size above that).
//!
//! Only what the simulator needs is implemented: NULL security, PUSH/PULL (SGLang), REQ,
//! DEALER and ROUTER (vLLM's NIXL and Mooncake side channels), no heartbeats.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

pub const GREETING_LEN: usize = 64;
const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;
/// A frame bigger than this is garbage, not a KV chunk: refuse it instead of allocating.
pub const MAX_FRAME: u64 = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("bad greeting signature")]
    BadSignature,
    #[error("unsupported ZMTP major version {0}")]
    BadVersion(u8),
    #[error("unsupported security mechanism {0:?} (only NULL)")]
    BadMechanism(String),
    #[error("expected READY command, got {0:?}")]
    ExpectedReady(String),
    #[error("malformed command frame")]
    BadCommand,
    #[error("frame of {0} bytes exceeds the limit")]
    FrameTooLarge(u64),
    #[error("peer socket type {0:?} cannot talk to {1:?}")]
    IncompatibleSocket(String, &'static str),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SocketType {
    Push,
    Pull,
    Req,
    Dealer,
    Router,
}

impl SocketType {
    pub fn as_str(self) -> &'static str {
        match self {
            SocketType::Push => "PUSH",
            SocketType::Pull => "PULL",
            SocketType::Req => "REQ",
            SocketType::Dealer => "DEALER",
            SocketType::Router => "ROUTER",
        }
    }
    /// The peer socket types libzmq accepts for this one (`socket_base.cpp` `is_compatible`).
    fn peers(self) -> &'static [&'static str] {
        match self {
            SocketType::Push => &["PULL"],
            SocketType::Pull => &["PUSH"],
            SocketType::Req => &["REP", "ROUTER"],
            SocketType::Dealer => &["REP", "DEALER", "ROUTER"],
            SocketType::Router => &["REQ", "DEALER", "ROUTER"],
        }
    }
    /// libzmq adds an `Identity` property (empty unless a routing id was set) to the READY
    /// of the socket types that route (`mechanism.cpp` `make_command_with_basic_properties`).
    fn sends_identity(self) -> bool {
        matches!(
            self,
            SocketType::Req | SocketType::Dealer | SocketType::Router
        )
    }
}

/// The greeting exactly as libzmq 4.3 writes it: signature, version 3.1, "NULL" mechanism
/// padded to 20 bytes, as-server = 0 (NULL has no server role), 31 bytes of filler.
pub fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 1;
    g[12..16].copy_from_slice(b"NULL");
    g
}

fn check_greeting(g: &[u8; GREETING_LEN]) -> Result<(), ZmtpError> {
    if g[0] != 0xFF || g[9] != 0x7F {
        return Err(ZmtpError::BadSignature);
    }
    if g[10] != 3 {
        return Err(ZmtpError::BadVersion(g[10]));
    }
    let mech = &g[12..32];
    let end = mech.iter().position(|&b| b == 0).unwrap_or(mech.len());
    if &mech[..end] != b"NULL" {
        return Err(ZmtpError::BadMechanism(
            String::from_utf8_lossy(&mech[..end]).into_owned(),
        ));
    }
    Ok(())
}

/// READY command body: name length, "READY", then properties (1-byte name length, name,
/// 4-byte big-endian value length, value).
pub fn ready_command(socket: SocketType) -> Bytes {
    let mut body = BytesMut::new();
    body.put_u8(5);
    body.put_slice(b"READY");
    let name = b"Socket-Type";
    body.put_u8(name.len() as u8);
    body.put_slice(name);
    body.put_u32(socket.as_str().len() as u32);
    body.put_slice(socket.as_str().as_bytes());
    if socket.sends_identity() {
        let name = b"Identity";
        body.put_u8(name.len() as u8);
        body.put_slice(name);
        body.put_u32(0);
    }
    let mut out = BytesMut::new();
    put_frame(&mut out, FLAG_COMMAND, &body);
    out.freeze()
}

fn put_frame(out: &mut BytesMut, flags: u8, body: &[u8]) {
    if body.len() <= 255 {
        out.put_u8(flags);
        out.put_u8(body.len() as u8);
    } else {
        out.put_u8(flags | FLAG_LONG);
        out.put_u64(body.len() as u64);
    }
    out.put_slice(body);
}

/// Encode one multipart message: every frame but the last carries the MORE flag.
pub fn encode_message<B: AsRef<[u8]>>(out: &mut BytesMut, parts: &[B]) {
    for (i, p) in parts.iter().enumerate() {
        let more = if i + 1 < parts.len() { FLAG_MORE } else { 0 };
        put_frame(out, more, p.as_ref());
    }
}

#[derive(Debug)]
struct RawFrame {
    flags: u8,
    body: Bytes,
}

async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<RawFrame>, ZmtpError> {
    let flags = match r.read_u8().await {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let len = if flags & FLAG_LONG != 0 {
        r.read_u64().await?
    } else {
        r.read_u8().await? as u64
    };
    if len > MAX_FRAME {
        return Err(ZmtpError::FrameTooLarge(len));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).await?;
    Ok(Some(RawFrame {
        flags,
        body: body.into(),
    }))
}

fn parse_ready(body: &[u8]) -> Result<Option<String>, ZmtpError> {
    let mut b = body;
    if b.is_empty() {
        return Err(ZmtpError::BadCommand);
    }
    let n = b.get_u8() as usize;
    if b.len() < n {
        return Err(ZmtpError::BadCommand);
    }
    let name = &b[..n];
    if name != b"READY" {
        return Err(ZmtpError::ExpectedReady(
            String::from_utf8_lossy(name).into_owned(),
        ));
    }
    b.advance(n);
    let mut socket_type = None;
    while !b.is_empty() {
        let nl = b.get_u8() as usize;
        if b.len() < nl + 4 {
            return Err(ZmtpError::BadCommand);
        }
        let pname = b[..nl].to_vec();
        b.advance(nl);
        let vl = b.get_u32() as usize;
        if b.len() < vl {
            return Err(ZmtpError::BadCommand);
        }
        let val = &b[..vl];
        if pname.eq_ignore_ascii_case(b"Socket-Type") {
            socket_type = Some(String::from_utf8_lossy(val).into_owned());
        }
        b.advance(vl);
    }
    Ok(socket_type)
}

/// Greeting + READY exchange on a fresh connection. Both sides send first, then read, which
/// is what libzmq does too (it does not wait for the peer's greeting before sending its own).
pub async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    me: SocketType,
) -> Result<(), ZmtpError> {
    let mut hello = BytesMut::with_capacity(GREETING_LEN + 32);
    hello.put_slice(&greeting());
    hello.put_slice(&ready_command(me));
    s.write_all(&hello).await?;
    s.flush().await?;
    let mut g = [0u8; GREETING_LEN];
    s.read_exact(&mut g).await?;
    check_greeting(&g)?;
    let frame = read_frame(s).await?.ok_or(ZmtpError::BadCommand)?;
    if frame.flags & FLAG_COMMAND == 0 {
        return Err(ZmtpError::BadCommand);
    }
    if let Some(peer) = parse_ready(&frame.body)?
        && !me.peers().contains(&peer.as_str())
    {
        return Err(ZmtpError::IncompatibleSocket(peer, me.as_str()));
    }
    Ok(())
}

/// Read the next complete multipart message; `None` at a clean end of stream. Command frames
/// (PING and friends) between messages are skipped.
pub async fn read_message<R: AsyncRead + Unpin>(
    r: &mut R,
) -> Result<Option<Vec<Bytes>>, ZmtpError> {
    let mut parts = Vec::new();
    loop {
        let Some(f) = read_frame(r).await? else {
            return Ok(None);
        };
        if f.flags & FLAG_COMMAND != 0 {
            continue;
        }
        let more = f.flags & FLAG_MORE != 0;
        parts.push(f.body);
        if !more {
            return Ok(Some(parts));
        }
    }
}

/// Pure, incremental decoder of the post-handshake frame stream, for taps and tests that see
/// the raw bytes (e.g. a proxy between decode and prefill). Feed bytes, pop messages.
#[derive(Default)]
pub struct StreamDecoder {
    buf: BytesMut,
    greeting_done: bool,
    parts: Vec<Bytes>,
}

impl StreamDecoder {
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// Next complete data message, skipping the greeting and command frames.
    pub fn next_message(&mut self) -> Result<Option<Vec<Bytes>>, ZmtpError> {
        if !self.greeting_done {
            if self.buf.len() < GREETING_LEN {
                return Ok(None);
            }
            let g: [u8; GREETING_LEN] =
                self.buf[..GREETING_LEN].try_into().expect("length checked");
            check_greeting(&g)?;
            self.buf.advance(GREETING_LEN);
            self.greeting_done = true;
        }
        loop {
            if self.buf.len() < 2 {
                return Ok(None);
            }
            let flags = self.buf[0];
            let (hdr, len) = if flags & FLAG_LONG != 0 {
                if self.buf.len() < 9 {
                    return Ok(None);
                }
                (
                    9usize,
                    u64::from_be_bytes(self.buf[1..9].try_into().expect("8 bytes")),
                )
            } else {
                (2usize, self.buf[1] as u64)
            };
            if len > MAX_FRAME {
                return Err(ZmtpError::FrameTooLarge(len));
            }
            if self.buf.len() < hdr + len as usize {
                return Ok(None);
            }
            self.buf.advance(hdr);
            let body = self.buf.split_to(len as usize).freeze();
            if flags & FLAG_COMMAND != 0 {
                continue;
            }
            self.parts.push(body);
            if flags & FLAG_MORE == 0 {
                return Ok(Some(std::mem::take(&mut self.parts)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greeting_matches_libzmq_layout() {
        let g = greeting();
        assert_eq!(&g[..10], &[0xFF, 0, 0, 0, 0, 0, 0, 0, 0, 0x7F]);
        assert_eq!(&g[10..12], &[3, 1]);
        assert_eq!(&g[12..16], b"NULL");
        assert!(g[16..].iter().all(|&b| b == 0));
    }

    #[test]
    fn short_and_long_frames_round_trip_through_the_stream_decoder() {
        let big = vec![7u8; 300];
        let mut wire = BytesMut::new();
        wire.put_slice(&greeting());
        wire.put_slice(&ready_command(SocketType::Push));
        encode_message(
            &mut wire,
            &[&b"BOOTSTRAP"[..], b"123", b"127.0.0.1", b"4000"],
        );
        // Destinations for 75 pages: their int32 indices are a long frame (flag 0x02, 8-byte size).
        encode_message(
            &mut wire,
            &[
                &b"123"[..],
                b"127.0.0.1",
                b"4000",
                b"127.0.0.1:4001",
                &big[..],
                b"3",
                b"",
                b"1",
                b"0",
                b"",
            ],
        );
        let mut d = StreamDecoder::default();
        // Feed byte by byte: the decoder must cope with any split.
        let mut got = Vec::new();
        for b in wire.iter() {
            d.push(&[*b]);
            while let Some(m) = d.next_message().unwrap() {
                got.push(m);
            }
        }
        assert_eq!(got.len(), 2);
        assert_eq!(
            got[0],
            vec![
                Bytes::from_static(b"BOOTSTRAP"),
                "123".into(),
                "127.0.0.1".into(),
                "4000".into()
            ]
        );
        assert_eq!(got[1].len(), 10);
        assert_eq!(got[1][4].len(), 300);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let mut d = StreamDecoder::default();
        d.push(&[0u8; 64]);
        assert!(matches!(d.next_message(), Err(ZmtpError::BadSignature)));
        let mut d = StreamDecoder::default();
        let mut wire = BytesMut::new();
        wire.put_slice(&greeting());
        wire.put_u8(FLAG_LONG);
        wire.put_u64(u64::MAX);
        d.push(&wire);
        assert!(matches!(d.next_message(), Err(ZmtpError::FrameTooLarge(_))));
    }

    #[tokio::test]
    async fn handshake_and_message_over_a_socket_pair() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        let t = tokio::spawn(async move {
            handshake(&mut b, SocketType::Pull).await.unwrap();
            read_message(&mut b).await.unwrap().unwrap()
        });
        handshake(&mut a, SocketType::Push).await.unwrap();
        let mut out = BytesMut::new();
        encode_message(&mut out, &[&b"ABORT"[..], b"42"]);
        a.write_all(&out).await.unwrap();
        let msg = t.await.unwrap();
        assert_eq!(
            msg,
            vec![Bytes::from_static(b"ABORT"), Bytes::from_static(b"42")]
        );
    }

    #[tokio::test]
    async fn push_to_push_is_refused() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        let t = tokio::spawn(async move { handshake(&mut b, SocketType::Push).await });
        let r = handshake(&mut a, SocketType::Push).await;
        assert!(matches!(r, Err(ZmtpError::IncompatibleSocket(..))));
        let _ = t.await;
    }
}
