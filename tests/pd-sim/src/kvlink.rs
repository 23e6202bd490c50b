//! The KV-transfer control channel of SGLang 0.5.23's Mooncake backend, as pd-sim plays it:
//! persistent ZMTP PUSH connections to peers (one writer task per endpoint, as SGLang caches one
//! pyzmq PUSH socket per peer: `disaggregation/common/conn.py:1664` prefill→decode,
//! `:2739` decode→prefill), a PULL listener on each worker's rank port (`:400`), and the codec
//! of every multipart message either side sends. The KV bytes themselves never cross ZMTP: they
//! go through the transfer engine ([`crate::te`]).
//!
//! Paths below are inside the wheel's `sglang/srt/`, line numbers from `sglang==0.5.23`. Every
//! scalar frame is ASCII decimal (`str(x).encode("ascii")`); arrays are packed little-endian.
//!
//! | direction | when | frames |
//! |---|---|---|
//! | decode → prefill | once per prefill, after the two `GET /route` (cached per bootstrap address, no room) | registration, 20 frames: `b"None"`, decode ip, decode rank port, session id (`ip:te_port`), KV buffer pointers (u64 LE each), aux buffer pointers, state pointers (`b""`), tp rank `0`, attn tp size `1`, KV item length, `b""` ×4 (state item lens, state dims, KV layer ids, state layer ids), `b""` ×2 (staging base, size), dcp size `1`, dcp rank `0`, `b""` (slot layer ids), KV item lengths (u64 LE each) — `disaggregation/mooncake/conn.py:3215` |
//! | decode → prefill | per room, once decode allocated its KV (`early`: at once; `prefill_complete`: after readiness) | destinations, 10 frames: room, decode ip, decode rank port, session id, destination KV page indices (int32 LE), aux index, state indices (`b""`), required_dst_info_num `1`, decode_prefix_len `0`, device KV indices (`b""`) — `mooncake/conn.py:3281`, sent by `common/conn.py:2839` |
//! | decode → prefill | `prefill_complete` only, per room before it allocates | `[b"BOOTSTRAP", room, decode ip, decode rank port]` — `common/conn.py:2575` |
//! | decode → prefill | decode withdraws a room (client gone, waiting timeout, a failed transfer) | `[b"ABORT", room, decode ip, decode rank port]`, plus a 5th frame, the generation (a per-process counter from 1), once the room's destinations were published (deferred KV release, on by default) — `common/conn.py:182`, `:2977`, `:979` |
//! | prefill → decode | the room's transfer is over | status `[room, b"4", prefill rank]` (Success); `[room, b"0", rank]` (Failed) when prefill fails a transfer it started — 3 frames, no tag, no reason (Mooncake) — `common/conn.py:739`, `:855` |
//! | prefill → decode | `prefill_complete` only, once prefill finished its forward and knows decode's endpoint | readiness `[room, b"2", rank]`, once — `common/bootstrap.py:48`, `common/conn.py:682` |
//! | prefill → decode | an ABORT that carried a generation, once the room's transfer drained | `[b"ABORT_ACK", room, prefill rank, generation]` — `common/conn.py:250`, `:1032`, `mooncake/conn.py:2903` |
//!
//! Prefill's rank is `attn_tp_rank * (pp_size * attn_cp_size) + pp_rank * attn_cp_size +
//! attn_cp_rank` (`common/conn.py:1024`): `0` for the one rank pd-sim has. KVPoll:
//! Failed 0, Bootstrapping 1, WaitingForInput 2, Transferring 3, Success 4
//! (`disaggregation/base/conn.py:123`).
//!
//! How each side dispatches what it reads (the parsers below follow the same order):
//! prefill's bootstrap thread (`mooncake/conn.py:2960`) takes `ABORT` first, then frame 3 as the
//! session id, `None` as a registration, and anything else as destinations (room = frame 0,
//! `required_dst_info_num` = frame 7); under `prefill_complete` `BOOTSTRAP` and `ABORT` pass
//! through `_handle_bootstrap_message` first (`common/conn.py:695`, `:1110`). Decode's thread
//! (`mooncake/conn.py:3043`) takes `AUX_DATA`, `CHUNK_READY`, `STAGING_REQ`, `ABORT_ACK`, then
//! parses a status (`common/conn.py:757`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use std::sync::Mutex;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

use serde::Serialize;
use tokio::sync::mpsc;

use crate::zmtp::{self, SocketType};

#[derive(Default)]
pub struct LinkStats {
    pub messages_sent: AtomicU64,
    pub messages_lost: AtomicU64,
    pub connect_failures: AtomicU64,
    pub messages_received: AtomicU64,
    pub bad_connections: AtomicU64,
}

/// Encoded bytes plus how many ZMTP messages they hold (for the counters).
type Queue = mpsc::Sender<(Bytes, u64)>;

#[derive(Clone)]
pub struct Pushers {
    inner: Arc<Mutex<HashMap<SocketAddr, Queue>>>,
    pub stats: Arc<LinkStats>,
}

impl Pushers {
    pub fn new(stats: Arc<LinkStats>) -> Self {
        Pushers {
            inner: Arc::new(Mutex::new(HashMap::new())),
            stats,
        }
    }

    /// Queue one multipart message for `to`. Waits only when that peer's queue is full
    /// (back-pressure onto the request that produced it), never on the network itself.
    pub async fn send<B: AsRef<[u8]>>(&self, to: SocketAddr, parts: &[B]) {
        let mut buf = BytesMut::new();
        zmtp::encode_message(&mut buf, parts);
        self.send_encoded(to, buf.freeze(), 1).await;
    }

    /// Queue already-encoded messages (`count` of them) as one unit: one wakeup, one write.
    pub async fn send_encoded(&self, to: SocketAddr, msg: Bytes, count: u64) {
        let tx = {
            // Held only for a map lookup, never across an await.
            let mut map = self.inner.lock().expect("pushers lock");
            match map.get(&to) {
                Some(tx) if !tx.is_closed() => tx.clone(),
                _ => {
                    let (tx, rx) = mpsc::channel(64 * 1024);
                    tokio::spawn(writer(to, rx, self.stats.clone()));
                    map.insert(to, tx.clone());
                    tx
                }
            }
        };
        if tx.send((msg, count)).await.is_err() {
            self.stats.messages_lost.fetch_add(count, Ordering::Relaxed);
        }
    }
}

async fn connect(to: SocketAddr) -> std::io::Result<TcpStream> {
    let mut delay = Duration::from_millis(20);
    let mut last = None;
    for _ in 0..5 {
        match TcpStream::connect(to).await {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(delay).await;
        delay *= 2;
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("connect failed")))
}

async fn writer(to: SocketAddr, mut rx: mpsc::Receiver<(Bytes, u64)>, stats: Arc<LinkStats>) {
    let stream = match connect(to).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(%to, error = %e, "KV link connect failed");
            stats.connect_failures.fetch_add(1, Ordering::Relaxed);
            rx.close();
            while let Some((_, n)) = rx.recv().await {
                stats.messages_lost.fetch_add(n, Ordering::Relaxed);
            }
            return;
        }
    };
    let _ = stream.set_nodelay(true);
    let mut stream = stream;
    if let Err(e) = zmtp::handshake(&mut stream, SocketType::Push).await {
        tracing::warn!(%to, error = %e, "KV link handshake failed");
        stats.connect_failures.fetch_add(1, Ordering::Relaxed);
        rx.close();
        while rx.recv().await.is_some() {
            stats.messages_lost.fetch_add(1, Ordering::Relaxed);
        }
        return;
    }
    let mut out = BytesMut::with_capacity(64 * 1024);
    while let Some((first, mut n)) = rx.recv().await {
        out.extend_from_slice(&first);
        // Coalesce whatever is already queued: at high rates this is the difference between one
        // syscall per message and one per batch.
        while out.len() < 64 * 1024 {
            match rx.try_recv() {
                Ok((m, k)) => {
                    out.extend_from_slice(&m);
                    n += k;
                }
                Err(_) => break,
            }
        }
        if let Err(e) = write_batched(&mut stream, &out).await {
            tracing::warn!(%to, error = %e, "KV link write failed");
            stats.messages_lost.fetch_add(n, Ordering::Relaxed);
            rx.close();
            while let Some((_, n)) = rx.recv().await {
                stats.messages_lost.fetch_add(n, Ordering::Relaxed);
            }
            return;
        }
        stats.messages_sent.fetch_add(n, Ordering::Relaxed);
        out.clear();
    }
}

/// libzmq's batch (`ZMQ_OUT_BATCH_SIZE` and `ZMQ_IN_BATCH_SIZE`, 8 KiB by default:
/// `in_batch_size (8192), out_batch_size (8192)` in `options_t`'s constructor, libzmq
/// `src/options.cpp`; pyzmq, which SGLang's and vLLM's sockets use, links it): its stream
/// engine sends the encoded stream in writes of at most this much and reads at most this much at
/// a time (only a message body larger than a batch goes in a syscall of its own, which the peer
/// reads straight into the message). SGLang's and vLLM's ZeroMQ sockets keep the default, so the
/// simulator's syscalls on a ZMTP connection are no larger than theirs.
const ZMQ_BATCH: usize = 8 * 1024;

/// Writes `out` in writes of at most [`ZMQ_BATCH`] (a body larger than a batch too, where
/// libzmq would write it in one syscall: the simulator's messages are far smaller).
async fn write_batched(stream: &mut TcpStream, out: &[u8]) -> std::io::Result<()> {
    for chunk in out.chunks(ZMQ_BATCH) {
        stream.write_all(chunk).await?;
    }
    Ok(())
}

/// Accept PUSH peers and hand each complete message to `on_message`.
pub async fn serve_pull<F>(listener: TcpListener, stats: Arc<LinkStats>, on_message: F)
where
    F: Fn(Vec<Bytes>) + Send + Sync + Clone + 'static,
{
    loop {
        let (mut sock, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "KV listener accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = sock.set_nodelay(true);
        let stats = stats.clone();
        let on_message = on_message.clone();
        tokio::spawn(async move {
            if let Err(e) = zmtp::handshake(&mut sock, SocketType::Pull).await {
                tracing::warn!(%peer, error = %e, "KV peer handshake failed");
                stats.bad_connections.fetch_add(1, Ordering::Relaxed);
                return;
            }
            let mut reader = tokio::io::BufReader::with_capacity(ZMQ_BATCH, sock);
            loop {
                match zmtp::read_message(&mut reader).await {
                    Ok(Some(parts)) => {
                        stats.messages_received.fetch_add(1, Ordering::Relaxed);
                        on_message(parts);
                    }
                    Ok(None) => return,
                    Err(e) => {
                        tracing::warn!(%peer, error = %e, "KV peer sent a malformed stream; closing");
                        stats.bad_connections.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                }
            }
        });
    }
}

pub fn parse_u64(b: &[u8]) -> Option<u64> {
    std::str::from_utf8(b).ok()?.parse().ok()
}

/// Python's `int(b.decode("ascii"))` for the values pd-sim reads: optional sign, decimal.
pub fn parse_i64(b: &[u8]) -> Option<i64> {
    std::str::from_utf8(b).ok()?.trim().parse().ok()
}

/// KVPoll (`disaggregation/base/conn.py:123`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum KvPoll {
    Failed = 0,
    Bootstrapping = 1,
    WaitingForInput = 2,
    Transferring = 3,
    Success = 4,
}

impl KvPoll {
    pub fn from_i64(v: i64) -> Option<KvPoll> {
        Some(match v {
            0 => KvPoll::Failed,
            1 => KvPoll::Bootstrapping,
            2 => KvPoll::WaitingForInput,
            3 => KvPoll::Transferring,
            4 => KvPoll::Success,
            _ => return None,
        })
    }
}

pub const ABORT_TAG: &[u8] = b"ABORT";
pub const ABORT_ACK_TAG: &[u8] = b"ABORT_ACK";
pub const BOOTSTRAP_TAG: &[u8] = b"BOOTSTRAP";
/// Frame 0 of decode's registration (`"None".encode("ascii")`).
pub const REGISTRATION_TAG: &[u8] = b"None";
/// The one prefill rank pd-sim has (`common/conn.py:1024` for TP1/PP1/CP1).
pub const PREFILL_RANK: u64 = 0;

fn ascii(v: impl std::fmt::Display) -> Bytes {
    Bytes::from(v.to_string())
}

fn u64s_le(v: &[u64]) -> Bytes {
    let mut b = BytesMut::with_capacity(v.len() * 8);
    for x in v {
        b.extend_from_slice(&x.to_le_bytes());
    }
    b.freeze()
}

/// What decode registers once per prefill (`KVArgsRegisterInfo`, `mooncake/conn.py:154`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    pub ip: String,
    pub port: u16,
    /// Mooncake session id, `host:port` of decode's transfer engine.
    pub session_id: String,
    pub kv_ptrs: Vec<u64>,
    pub aux_ptrs: Vec<u64>,
    /// Bytes per token of each KV buffer.
    pub kv_item_len: u64,
}

impl Registration {
    /// `build_receiver_registration_message` (`mooncake/conn.py:3215`): 20 frames.
    pub fn frames(&self) -> Vec<Bytes> {
        let item_lens: Vec<u64> = self.kv_ptrs.iter().map(|_| self.kv_item_len).collect();
        vec![
            Bytes::from_static(REGISTRATION_TAG),
            ascii(&self.ip),
            ascii(self.port),
            ascii(&self.session_id),
            u64s_le(&self.kv_ptrs),
            u64s_le(&self.aux_ptrs),
            Bytes::new(), // state data pointers: pack_int_lists([]) == b""
            ascii(0),     // dst_tp_rank (engine rank)
            ascii(1),     // dst_attn_tp_size
            ascii(self.kv_item_len),
            Bytes::new(), // state item lens
            Bytes::new(), // state dim per tensor
            Bytes::new(), // KV layer ids
            Bytes::new(), // state layer ids
            Bytes::new(), // staging base pointer (no staging)
            Bytes::new(), // staging total size
            ascii(1),     // dcp size
            ascii(0),     // dcp rank
            Bytes::new(), // staging slot layer ids
            u64s_le(&item_lens),
        ]
    }
}

/// What decode publishes per room once it allocated its KV (`TransferInfo`,
/// `mooncake/conn.py:104`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Destinations {
    pub room: u64,
    pub ip: String,
    pub port: u16,
    pub session_id: String,
    /// Destination page indices (page size 1: one per prompt token).
    pub kv_indices: Vec<i32>,
    /// `None`: a dummy destination (empty frames 4 and 5).
    pub aux_index: Option<u64>,
    pub required_dst_info_num: u64,
    pub decode_prefix_len: u64,
}

impl Destinations {
    /// `build_receiver_metadata_message` (`mooncake/conn.py:3281`): 10 frames.
    pub fn frames(&self) -> Vec<Bytes> {
        let mut idx = BytesMut::with_capacity(self.kv_indices.len() * 4);
        for i in &self.kv_indices {
            idx.extend_from_slice(&i.to_le_bytes());
        }
        vec![
            ascii(self.room),
            ascii(&self.ip),
            ascii(self.port),
            ascii(&self.session_id),
            idx.freeze(),
            self.aux_index.map(ascii).unwrap_or_default(),
            Bytes::new(), // state indices
            ascii(self.required_dst_info_num),
            ascii(self.decode_prefix_len),
            Bytes::new(), // device KV indices
        ]
    }
}

/// `[b"BOOTSTRAP", room, ip, port]` (`common/conn.py:2575`).
pub fn bootstrap_frames(room: u64, ip: &str, port: u16) -> Vec<Bytes> {
    vec![
        Bytes::from_static(BOOTSTRAP_TAG),
        ascii(room),
        ascii(ip),
        ascii(port),
    ]
}

/// `AbortNotification.to_zmq` (`common/conn.py:223`).
pub fn abort_frames(room: u64, ip: &str, port: u16, generation: Option<u64>) -> Vec<Bytes> {
    let mut v = vec![
        Bytes::from_static(ABORT_TAG),
        ascii(room),
        ascii(ip),
        ascii(port),
    ];
    if let Some(g) = generation {
        v.push(ascii(g));
    }
    v
}

/// `AbortAck.to_zmq` (`common/conn.py:270`), as the deferred release sends it.
pub fn abort_ack_frames(room: u64, rank: u64, generation: u64) -> Vec<Bytes> {
    vec![
        Bytes::from_static(ABORT_ACK_TAG),
        ascii(room),
        ascii(rank),
        ascii(generation),
    ]
}

/// `_encode_kv_status_message` (`common/conn.py:739`): Mooncake has no tag and no reason.
pub fn status_frames(room: u64, status: KvPoll, rank: u64) -> Vec<Bytes> {
    vec![ascii(room), ascii(status as u8), ascii(rank)]
}

/// A message read on prefill's rank port, classified as prefill's bootstrap thread does.
#[derive(Debug, PartialEq, Eq)]
pub enum AtPrefill {
    Registration(Registration),
    Destinations(Destinations),
    Bootstrap {
        room: u64,
        ip: String,
        port: u16,
    },
    /// `AbortNotification.from_zmq`: the return address and generation are optional.
    Abort {
        room: u64,
        endpoint: Option<(String, u16)>,
        generation: Option<u64>,
    },
    /// Anything SGLang would drop, choke on or not expect here.
    Malformed(&'static str),
}

fn str_of(b: &[u8]) -> Option<String> {
    std::str::from_utf8(b)
        .ok()
        .filter(|s| s.is_ascii())
        .map(str::to_owned)
}

fn le_u64s(b: &[u8]) -> Vec<u64> {
    b.chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect()
}

/// Classify a message read on prefill's rank port (`mooncake/conn.py:2960`; `BOOTSTRAP` is read
/// under either policy, though only a `prefill_complete` prefill expects it).
pub fn parse_at_prefill(parts: &[Bytes]) -> AtPrefill {
    let Some(first) = parts.first() else {
        return AtPrefill::Malformed("empty message");
    };
    if &first[..] == BOOTSTRAP_TAG {
        // `_handle_bootstrap_message` (`common/conn.py:695`).
        let (Some(room), Some(ip), Some(port)) = (
            parts.get(1).and_then(|b| parse_u64(b)),
            parts.get(2).and_then(|b| str_of(b)),
            parts.get(3).and_then(|b| parse_u64(b)),
        ) else {
            return AtPrefill::Malformed("malformed BOOTSTRAP");
        };
        return AtPrefill::Bootstrap {
            room,
            ip,
            port: port as u16,
        };
    }
    if &first[..] == ABORT_TAG {
        // `AbortNotification.from_zmq` (`common/conn.py:189`).
        if parts.len() < 2 {
            return AtPrefill::Malformed("ABORT with too few frames");
        }
        let Some(room) = parse_u64(&parts[1]) else {
            return AtPrefill::Malformed("ABORT with an invalid room");
        };
        if parts.len() < 4 {
            return AtPrefill::Abort {
                room,
                endpoint: None,
                generation: None,
            };
        }
        let endpoint = match (str_of(&parts[2]), parse_u64(&parts[3])) {
            (Some(ip), Some(port)) => Some((ip, port as u16)),
            _ => {
                return AtPrefill::Abort {
                    room,
                    endpoint: None,
                    generation: None,
                };
            }
        };
        let generation = parts.get(4).and_then(|g| parse_u64(g));
        return AtPrefill::Abort {
            room,
            endpoint,
            generation,
        };
    }
    // SGLang reads frame 3 as the session id before anything else (an IndexError there ends its
    // bootstrap thread).
    if parts.len() < 8 {
        return AtPrefill::Malformed("fewer than 8 frames");
    }
    let (Some(ip), Some(port), Some(session_id)) =
        (str_of(&parts[1]), parse_u64(&parts[2]), str_of(&parts[3]))
    else {
        return AtPrefill::Malformed("bad endpoint or session id");
    };
    let port = port as u16;
    if &first[..] == REGISTRATION_TAG {
        return AtPrefill::Registration(Registration {
            ip,
            port,
            session_id,
            kv_ptrs: le_u64s(&parts[4]),
            aux_ptrs: le_u64s(&parts[5]),
            kv_item_len: parts.get(9).and_then(|b| parse_u64(b)).unwrap_or(0),
        });
    }
    let (Some(room), Some(required)) = (parse_u64(first), parse_u64(&parts[7])) else {
        return AtPrefill::Malformed("destinations with a bad room or destination count");
    };
    // `TransferInfo.from_zmq` (`mooncake/conn.py:120`): empty frames 4 and 5 are a dummy rank.
    let dummy = parts[4].is_empty() && parts[5].is_empty();
    let aux_index = if dummy {
        None
    } else {
        match parse_u64(&parts[5]) {
            Some(a) => Some(a),
            None => return AtPrefill::Malformed("destinations with a bad aux index"),
        }
    };
    AtPrefill::Destinations(Destinations {
        room,
        ip,
        port,
        session_id,
        kv_indices: parts[4]
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect(),
        aux_index,
        required_dst_info_num: required,
        decode_prefix_len: parts
            .get(8)
            .filter(|b| !b.is_empty())
            .and_then(|b| parse_u64(b))
            .unwrap_or(0),
    })
}

/// A message read on decode's rank port, classified as decode's thread does.
#[derive(Debug, PartialEq, Eq)]
pub enum AtDecode {
    Status {
        room: u64,
        status: i64,
        rank: i64,
    },
    AbortAck {
        room: u64,
        rank: i64,
        generation: Option<u64>,
    },
    /// `AUX_DATA`, `CHUNK_READY`, `STAGING_REQ`: valid SGLang messages pd-sim never sends.
    Other(&'static str),
    Malformed(&'static str),
}

/// Classify a message read on decode's rank port (`mooncake/conn.py:3043`).
pub fn parse_at_decode(parts: &[Bytes]) -> AtDecode {
    let Some(first) = parts.first() else {
        return AtDecode::Malformed("empty message");
    };
    match &first[..] {
        b"AUX_DATA" => return AtDecode::Other("AUX_DATA"),
        b"CHUNK_READY" => return AtDecode::Other("CHUNK_READY"),
        b"STAGING_REQ" => return AtDecode::Other("STAGING_REQ"),
        _ => {}
    }
    if &first[..] == ABORT_ACK_TAG {
        // `AbortAck.from_zmq` (`common/conn.py:256`).
        if parts.len() < 3 {
            return AtDecode::Malformed("incomplete ABORT_ACK");
        }
        let (Some(room), Some(rank)) = (parse_u64(&parts[1]), parse_i64(&parts[2])) else {
            return AtDecode::Malformed("malformed ABORT_ACK");
        };
        let generation = match parts.get(3) {
            Some(g) => match parse_u64(g) {
                Some(g) => Some(g),
                None => return AtDecode::Malformed("malformed ABORT_ACK"),
            },
            None => None,
        };
        return AtDecode::AbortAck {
            room,
            rank,
            generation,
        };
    }
    // `parse_kv_status_message` (`common/conn.py:757`).
    if parts.len() < 3 {
        return AtDecode::Malformed("status with fewer than 3 frames");
    }
    match (
        parse_u64(&parts[0]),
        parse_i64(&parts[1]),
        parse_i64(&parts[2]),
    ) {
        (Some(room), Some(status), Some(rank)) => AtDecode::Status { room, status, rank },
        _ => AtDecode::Malformed("unparsable status"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dests() -> Destinations {
        Destinations {
            room: 9066467638188682269,
            ip: "127.0.0.1".into(),
            port: 40001,
            session_id: "127.0.0.1:40002".into(),
            kv_indices: vec![7, 8, 9],
            aux_index: Some(3),
            required_dst_info_num: 1,
            decode_prefix_len: 0,
        }
    }

    #[test]
    fn destinations_are_ten_frames_with_int32_le_indices() {
        let f = dests().frames();
        assert_eq!(f.len(), 10);
        assert_eq!(&f[0][..], b"9066467638188682269");
        assert_eq!(&f[3][..], b"127.0.0.1:40002");
        assert_eq!(&f[4][..], &[7, 0, 0, 0, 8, 0, 0, 0, 9, 0, 0, 0]);
        assert_eq!(&f[5][..], b"3");
        assert!(f[6].is_empty() && f[9].is_empty());
        assert_eq!((&f[7][..], &f[8][..]), (&b"1"[..], &b"0"[..]));
        assert_eq!(parse_at_prefill(&f), AtPrefill::Destinations(dests()));
    }

    #[test]
    fn registration_is_twenty_frames_and_parses_back() {
        let r = Registration {
            ip: "127.0.0.1".into(),
            port: 40001,
            session_id: "127.0.0.1:40002".into(),
            kv_ptrs: vec![0x7f00_0000_0000, 0x7f10_0000_0000],
            aux_ptrs: vec![0x7f20_0000_0000],
            kv_item_len: 4,
        };
        let f = r.frames();
        assert_eq!(f.len(), 20);
        assert_eq!(&f[0][..], b"None");
        assert_eq!(f[4].len(), 16);
        assert_eq!(&f[4][..8], &0x7f00_0000_0000u64.to_le_bytes());
        assert_eq!(
            &f[19][..],
            &[4, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(parse_at_prefill(&f), AtPrefill::Registration(r));
    }

    #[test]
    fn abort_carries_a_generation_only_when_armed() {
        let f = abort_frames(42, "127.0.0.1", 5000, None);
        assert_eq!(f.len(), 4);
        assert_eq!(
            parse_at_prefill(&f),
            AtPrefill::Abort {
                room: 42,
                endpoint: Some(("127.0.0.1".into(), 5000)),
                generation: None
            }
        );
        let f = abort_frames(42, "127.0.0.1", 5000, Some(7));
        assert_eq!(&f[4][..], b"7");
        // A bare `[ABORT, room]` (older decodes) is still an abort.
        assert_eq!(
            parse_at_prefill(&f[..2]),
            AtPrefill::Abort {
                room: 42,
                endpoint: None,
                generation: None
            }
        );
    }

    #[test]
    fn status_and_abort_ack_parse_as_decode_reads_them() {
        let s = status_frames(12, KvPoll::Success, PREFILL_RANK);
        assert_eq!(
            s,
            vec![
                Bytes::from_static(b"12"),
                Bytes::from_static(b"4"),
                Bytes::from_static(b"0")
            ]
        );
        assert_eq!(
            parse_at_decode(&s),
            AtDecode::Status {
                room: 12,
                status: 4,
                rank: 0
            }
        );
        let a = abort_ack_frames(12, 0, 3);
        assert_eq!(
            parse_at_decode(&a),
            AtDecode::AbortAck {
                room: 12,
                rank: 0,
                generation: Some(3)
            }
        );
        assert!(matches!(
            parse_at_decode(&[Bytes::from_static(b"12")]),
            AtDecode::Malformed(_)
        ));
    }

    #[test]
    fn garbage_is_malformed_not_a_panic() {
        for m in [
            vec![],
            vec![Bytes::from_static(b"\xff\xfe")],
            vec![Bytes::from_static(b"BOOTSTRAP"), Bytes::from_static(b"x")],
            vec![Bytes::from_static(b"1"); 8],
        ] {
            let _ = parse_at_prefill(&m);
            let _ = parse_at_decode(&m);
        }
        assert!(matches!(
            parse_at_prefill(&vec![Bytes::from_static(b"1"); 3]),
            AtPrefill::Malformed(_)
        ));
    }
}
