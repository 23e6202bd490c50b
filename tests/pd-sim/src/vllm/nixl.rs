//! The NIXL connector's side channel, as vLLM 0.34 uses it (`nixl/base_scheduler.py:343-383`,
//! `nixl/base_worker.py:1215-1310`): every worker binds a ZMQ ROUTER on its side-channel port;
//! a decode that meets a `remote_engine_id` for the first time connects a REQ there, sends
//! msgspec-msgpack `(b"get_meta_msg", pp_rank, tp_rank)` and gets back the engine's
//! `NixlHandshakePayload` and its `perf_counter()` as a float; it caches the agent and closes
//! the socket. Once per engine pair: no request id ever crosses this socket.
//!
//! | direction | frames (after the ZMTP greeting, REQ ↔ ROUTER) |
//! |---|---|
//! | decode → prefill | `""`, `93 c4 0c "get_meta_msg" 00 00` |
//! | prefill → decode | `""`, msgpack `{compatibility_hash: str, agent_metadata_bytes: bin}` (the bytes: msgpack `NixlAgentMetadata`, every field), msgpack float64 |
//!
//! The KV itself moves by UCX one-sided reads (shared memory on one host: nothing on a socket),
//! which pd-sim plays as a delay. Decode's per-request notification `"<remote_request_id>:<n>"`
//! is a UCX active message; pd-sim sends it as a Unix datagram to
//! `<notify dir>/<engine id>.sock`, which no inet probe mistakes for vLLM's wire.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream, UnixDatagram};

use super::worker::Worker;
use crate::msgpack::{self, Value};
use crate::zmtp::{self, SocketType};

/// `nixl/metadata.py:21`.
pub const GET_META_MSG: &[u8] = b"get_meta_msg";
/// `nixl/metadata.py` `NIXL_CONNECTOR_VERSION`, part of the compatibility hash.
pub const NIXL_CONNECTOR_VERSION: i64 = 16;
/// Model layers of pd-sim's tiny model: one KV region each.
const LAYERS: u64 = 2;

/// Why a handshake failed (decode side) or a request on the side channel was not one.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("connecting to the NIXL side channel {0}: {1}")]
    Connect(String, std::io::Error),
    #[error("ZMTP: {0}")]
    Zmtp(#[from] zmtp::ZmtpError),
    #[error("the side channel closed before answering")]
    Closed,
    #[error("expected 3 reply frames (empty delimiter, payload, timestamp), got {0}")]
    Frames(usize),
    #[error("msgpack: {0}")]
    Msgpack(#[from] msgpack::DecodeError),
    #[error("the handshake payload lacks {0}")]
    Missing(&'static str),
    #[error("Remote NIXL agent engine ID mismatch. Expected {expected}, received {got}.")]
    EngineMismatch { expected: String, got: String },
    #[error("no answer within {0} ms")]
    Timeout(u64),
}

/// `msgspec.msgpack.encode((GET_META_MSG, pp_rank, tp_rank))`.
pub fn get_meta_msg(pp_rank: i64, tp_rank: i64) -> Vec<u8> {
    Value::Array(vec![
        Value::Bin(GET_META_MSG.to_vec()),
        Value::Int(pp_rank),
        Value::Int(tp_rank),
    ])
    .encode()
}

/// `(pp_rank, tp_rank)` of a metadata request, or `None` for anything else.
pub fn parse_get_meta_msg(b: &[u8]) -> Option<(i64, i64)> {
    let v = msgpack::decode(b).ok()?;
    match v.as_array()? {
        [msg, pp, tp] if msg.as_bytes() == Some(GET_META_MSG) => Some((pp.as_int()?, tp.as_int()?)),
        _ => None,
    }
}

/// What a prefill engine advertises about its KV cache.
#[derive(Clone, Debug)]
pub struct AgentFacts<'a> {
    pub engine_id: &'a str,
    pub num_blocks: u64,
    pub block_size: u64,
}

/// The compatibility hash both sides compute from their versions and model config
/// (`compute_nixl_compatibility_hash`, a sha256 hex digest): here from the connector version
/// and the block size, so two pd-sim workers agree.
pub fn compat_hash(block_size: u64) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut out = String::with_capacity(64);
    for round in 0..4u64 {
        for b in format!("{NIXL_CONNECTOR_VERSION}/pull/{block_size}/{round}").bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        out.push_str(&format!("{h:016x}"));
    }
    out
}

/// msgpack `NixlAgentMetadata` (`nixl/metadata.py:60-88`): every field, in order, as msgspec
/// encodes a dataclass. The NIXL agent blob stands in for UCX's worker address.
pub fn agent_metadata(f: &AgentFacts<'_>) -> Vec<u8> {
    // bf16 K and V, 2 KV heads of 64: bytes per block and layer.
    let block_len = (f.block_size * 2 * 64 * 2 * 2) as i64;
    let mut blob = b"NIXL-UCX-pd-sim:".to_vec();
    blob.extend_from_slice(f.engine_id.as_bytes());
    blob.resize(256, 0);
    Value::map([
        ("engine_id", Value::str(f.engine_id)),
        ("agent_metadata", Value::Bin(blob)),
        (
            "kv_caches_base_addr",
            Value::ints((0..LAYERS as i64).map(|l| 0x7f00_0000_0000 + l * 0x1000_0000)),
        ),
        ("device_id", Value::Int(0)),
        ("num_blocks", Value::Int(f.num_blocks as i64)),
        ("block_lens", Value::ints((0..LAYERS).map(|_| block_len))),
        ("block_strides", Value::ints((0..LAYERS).map(|_| block_len))),
        ("kv_cache_layout", Value::str("HND")),
        ("block_size", Value::Int(f.block_size as i64)),
        ("ssm_sizes", Value::ints([0, 0])),
        ("attn_backend_name", Value::str("FLASH_ATTN")),
        ("physical_blocks_per_logical_kv_block", Value::Int(1)),
        ("region_num_blocks", Value::Nil),
        ("region_group_ids", Value::Nil),
        ("region_names", Value::Nil),
        ("region_mem_types", Value::Nil),
        ("dcp_size", Value::Int(1)),
        ("pcp_size", Value::Int(1)),
        ("ple_block_len", Value::Nil),
        ("region_members", Value::Array(vec![])),
        ("layer_group_ids", Value::Map(vec![])),
        ("packed_member_layouts", Value::Map(vec![])),
    ])
    .encode()
}

/// msgpack `NixlHandshakePayload` (`nixl/metadata.py:90-104`).
pub fn handshake_payload(f: &AgentFacts<'_>) -> Vec<u8> {
    Value::map([
        ("compatibility_hash", Value::str(compat_hash(f.block_size))),
        ("agent_metadata_bytes", Value::Bin(agent_metadata(f))),
    ])
    .encode()
}

/// `msgspec.msgpack.encode(time.perf_counter())`: seconds since this process started.
pub fn perf_counter_frame(since: std::time::Instant) -> Vec<u8> {
    Value::Float(since.elapsed().as_secs_f64()).encode()
}

/// A remote engine as decode caches it after the handshake.
#[derive(Clone, Debug)]
pub struct RemoteAgent {
    pub engine_id: String,
    pub num_blocks: u64,
    pub compatibility_hash: String,
}

/// Read a handshake reply as vLLM's decode does: payload, then the agent metadata inside it;
/// the engine must be the one the params named (`base_worker.py:1253-1312`).
pub fn parse_reply(parts: &[Bytes], expected_engine: &str) -> Result<RemoteAgent, HandshakeError> {
    let [delim, payload, ts] = parts else {
        return Err(HandshakeError::Frames(parts.len()));
    };
    if !delim.is_empty() {
        return Err(HandshakeError::Frames(parts.len()));
    }
    msgpack::decode(ts)?;
    let p = msgpack::decode(payload)?;
    let hash = p
        .get("compatibility_hash")
        .and_then(Value::as_str)
        .ok_or(HandshakeError::Missing("compatibility_hash"))?;
    let meta = msgpack::decode(
        p.get("agent_metadata_bytes")
            .and_then(Value::as_bytes)
            .ok_or(HandshakeError::Missing("agent_metadata_bytes"))?,
    )?;
    let engine = meta
        .get("engine_id")
        .and_then(Value::as_str)
        .ok_or(HandshakeError::Missing("engine_id"))?;
    if engine != expected_engine {
        return Err(HandshakeError::EngineMismatch {
            expected: expected_engine.to_owned(),
            got: engine.to_owned(),
        });
    }
    Ok(RemoteAgent {
        engine_id: engine.to_owned(),
        num_blocks: meta
            .get("num_blocks")
            .and_then(Value::as_int)
            .ok_or(HandshakeError::Missing("num_blocks"))? as u64,
        compatibility_hash: hash.to_owned(),
    })
}

/// Decode's side: one REQ connection, one query (pp rank 0, tp rank 0), one reply, closed.
pub async fn handshake(
    host: &str,
    port: u16,
    expected_engine: &str,
    timeout_ms: u64,
) -> Result<RemoteAgent, HandshakeError> {
    let work = async {
        let mut s = TcpStream::connect((host, port))
            .await
            .map_err(|e| HandshakeError::Connect(format!("{host}:{port}"), e))?;
        let _ = s.set_nodelay(true);
        zmtp::handshake(&mut s, SocketType::Req).await?;
        let mut out = BytesMut::new();
        zmtp::encode_message(&mut out, &[&b""[..], &get_meta_msg(0, 0)]);
        s.write_all(&out).await.map_err(zmtp::ZmtpError::from)?;
        let parts = zmtp::read_message(&mut s)
            .await?
            .ok_or(HandshakeError::Closed)?;
        parse_reply(&parts, expected_engine)
    };
    tokio::time::timeout(Duration::from_millis(timeout_ms), work)
        .await
        .unwrap_or(Err(HandshakeError::Timeout(timeout_ms)))
}

/// Prefill's (every worker's) ROUTER: answers each metadata request with the payload and a
/// timestamp. Anything else on a connection is counted and the connection dropped.
pub async fn serve(listener: TcpListener, w: Arc<Worker>, payload: Bytes) {
    loop {
        let Ok((mut s, _)) = listener.accept().await else {
            continue;
        };
        let _ = s.set_nodelay(true);
        let (w, payload) = (w.clone(), payload.clone());
        tokio::spawn(async move {
            let bad = |w: &Worker| {
                w.link_stats.bad_connections.fetch_add(1, Ordering::Relaxed);
            };
            let handshake = tokio::time::timeout(
                Duration::from_secs(5),
                zmtp::handshake(&mut s, SocketType::Router),
            )
            .await;
            if !matches!(handshake, Ok(Ok(()))) {
                return bad(&w);
            }
            loop {
                let parts = match zmtp::read_message(&mut s).await {
                    Ok(Some(p)) => p,
                    Ok(None) => return,
                    Err(_) => return bad(&w),
                };
                w.link_stats
                    .messages_received
                    .fetch_add(1, Ordering::Relaxed);
                // From a REQ: the empty delimiter, then the query.
                let query = match &parts[..] {
                    [d, q] if d.is_empty() => parse_get_meta_msg(q),
                    _ => None,
                };
                let Some((pp, tp)) = query else {
                    tracing::warn!(
                        frames = parts.len(),
                        "Connection listener got unexpected message"
                    );
                    return bad(&w);
                };
                tracing::debug!(pp, tp, "NIXL handshake served");
                let ts = perf_counter_frame(w.started);
                let mut out = BytesMut::new();
                zmtp::encode_message(&mut out, &[&b""[..], &payload[..], &ts[..]]);
                if s.write_all(&out).await.is_err() {
                    return;
                }
                w.stats.handshakes_served.fetch_add(1, Ordering::Relaxed);
                w.link_stats.messages_sent.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
}

/// Where an engine's notifications go.
pub fn notify_path(dir: &Path, engine_id: &str) -> PathBuf {
    // Engine ids are uuids; anything else is reduced to a safe file name.
    let safe: String = engine_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    dir.join(format!("{safe}.sock"))
}

/// Bind this engine's notification endpoint (a stale file from an earlier run is replaced).
pub fn bind_notifications(dir: &Path, engine_id: &str) -> std::io::Result<UnixDatagram> {
    std::fs::create_dir_all(dir)?;
    let path = notify_path(dir, engine_id);
    let _ = std::fs::remove_file(&path);
    UnixDatagram::bind(path)
}

/// `"<remote_request_id>:<n_consumers>"` (`nixl/pull_worker.py:529-537`).
pub fn notification(remote_request_id: &str, consumers: u32) -> String {
    format!("{remote_request_id}:{consumers}")
}

/// A notification's request id, or `None` for a heartbeat (`HB:…`) or garbage.
pub fn parse_notification(msg: &str) -> Option<&str> {
    if msg.starts_with("HB:") {
        return None;
    }
    msg.rsplit_once(':')
        .filter(|(_, n)| n.parse::<u32>().is_ok())
        .map(|(id, _)| id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_vllms() {
        assert_eq!(
            get_meta_msg(0, 0),
            b"\x93\xc4\x0cget_meta_msg\x00\x00".to_vec()
        );
        assert_eq!(parse_get_meta_msg(&get_meta_msg(0, 3)), Some((0, 3)));
        assert_eq!(parse_get_meta_msg(b"\x93\xa3abc\x00\x00"), None);
        let f = AgentFacts {
            engine_id: "e-1",
            num_blocks: 256,
            block_size: 16,
        };
        let payload = Bytes::from(handshake_payload(&f));
        assert!(payload.starts_with(b"\x82\xb2compatibility_hash\xd9\x40"));
        let parts = [
            Bytes::new(),
            payload,
            Bytes::from(perf_counter_frame(std::time::Instant::now())),
        ];
        let agent = parse_reply(&parts, "e-1").unwrap();
        assert_eq!((agent.engine_id.as_str(), agent.num_blocks), ("e-1", 256));
        assert_eq!(agent.compatibility_hash.len(), 64);
        assert!(matches!(
            parse_reply(&parts, "other"),
            Err(HandshakeError::EngineMismatch { .. })
        ));
        assert_eq!(
            parse_notification("cmpl-a-0-1234abcd:1"),
            Some("cmpl-a-0-1234abcd")
        );
        assert_eq!(parse_notification("HB:a,b"), None);
        assert_eq!(parse_notification("nocount"), None);
    }
}
