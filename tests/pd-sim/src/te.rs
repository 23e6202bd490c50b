//! Mooncake transfer engine's TCP transport, the way the KV moves in pd-sim: prefill writes the
//! room's KV into decode's memory over a TCP connection of its own, never over ZMTP.
//!
//! SGLang hands the transfer to Mooncake TE (`disaggregation/mooncake/conn.py:817`
//! `_transfer_data`, `:1346` `send_kvcache`, `:1780` `send_aux`), which on RDMA hardware writes
//! straight into decode's registered pointers. With `MC_FORCE_TCP=1` (or without RDMA) Mooncake
//! installs its TCP transport (`mooncake-transfer-engine/src/transport/tcp_transport/
//! tcp_transport.cpp`): pooled persistent connections to the peer's data port, and per transfer
//! block a 24-byte header (`struct SessionHeader { uint64_t size; uint64_t addr; uint8_t opcode; }`,
//! little-endian, 7 bytes of padding, opcode 1 = WRITE) followed by `size` bytes that the peer
//! stores at `addr`. No room is named anywhere: decode learns that a room's KV arrived only from
//! prefill's ZMTP status `[room, "4", rank]` (see [`crate::kvlink`]).
//!
//! Simplification: real Mooncake does an RPC handshake on the session id's port (`host:rpc_port`)
//! and then moves data to the peer's separate `tcp_data_port`; pd-sim's decode serves both on
//! one port, the one its session id names.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{BufMut, BytesMut};
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};

pub const HEADER_LEN: usize = 24;
/// `TransferRequest::WRITE`.
pub const OP_WRITE: u8 = 1;
/// Mooncake's `kDefaultBufferSize`: the largest block pd-sim writes in one header.
pub const MAX_BLOCK: u64 = 64 * 1024;
/// A block bigger than this is garbage, not KV.
const BLOCK_LIMIT: u64 = 64 << 20;

/// One transfer block: `len` bytes written at decode's address `addr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    pub addr: u64,
    pub len: u64,
}

#[derive(Default, Serialize)]
pub struct TeStats {
    pub blocks_sent: AtomicU64,
    pub bytes_sent: AtomicU64,
    pub connect_failures: AtomicU64,
    pub write_failures: AtomicU64,
    pub blocks_received: AtomicU64,
    pub bytes_received: AtomicU64,
    pub bad_connections: AtomicU64,
}

/// The header as Mooncake writes it (`ClientSession::initiate`): size and addr little-endian.
pub fn header(b: Block) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..8].copy_from_slice(&b.len.to_le_bytes());
    h[8..16].copy_from_slice(&b.addr.to_le_bytes());
    h[16] = OP_WRITE;
    h
}

/// Encode `blocks` (headers and zero payloads) for one write.
pub fn encode(blocks: &[Block]) -> BytesMut {
    let total: u64 = blocks.iter().map(|b| HEADER_LEN as u64 + b.len).sum();
    let mut out = BytesMut::with_capacity(total as usize);
    for b in blocks {
        out.put_slice(&header(*b));
        out.put_bytes(0, b.len as usize);
    }
    out
}

type Job = (BytesMut, u64, u64, oneshot::Sender<bool>);

/// Prefill's side: one persistent connection per decode transfer engine, written by one task
/// (Mooncake pools its connections; one per peer is enough on loopback).
#[derive(Clone)]
pub struct TeClient {
    peers: Arc<Mutex<HashMap<SocketAddr, mpsc::Sender<Job>>>>,
    pub stats: Arc<TeStats>,
}

impl TeClient {
    pub fn new(stats: Arc<TeStats>) -> Self {
        TeClient {
            peers: Arc::default(),
            stats,
        }
    }

    /// Write `blocks` to the transfer engine at `to`; `true` once every byte is on the socket.
    pub async fn write(&self, to: SocketAddr, blocks: &[Block]) -> bool {
        let n = blocks.len() as u64;
        let bytes: u64 = blocks.iter().map(|b| b.len).sum();
        let buf = encode(blocks);
        let tx = {
            let mut map = self.peers.lock().expect("te peers lock");
            match map.get(&to) {
                Some(tx) if !tx.is_closed() => tx.clone(),
                _ => {
                    let (tx, rx) = mpsc::channel(1024);
                    tokio::spawn(writer(to, rx, self.stats.clone()));
                    map.insert(to, tx.clone());
                    tx
                }
            }
        };
        let (done_tx, done_rx) = oneshot::channel();
        if tx.send((buf, n, bytes, done_tx)).await.is_err() {
            return false;
        }
        done_rx.await.unwrap_or(false)
    }
}

async fn writer(to: SocketAddr, mut rx: mpsc::Receiver<Job>, stats: Arc<TeStats>) {
    let mut stream = None;
    for delay in [20u64, 40, 80, 160, 0] {
        match TcpStream::connect(to).await {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(_) if delay > 0 => tokio::time::sleep(Duration::from_millis(delay)).await,
            Err(e) => tracing::warn!(%to, error = %e, "transfer engine connect failed"),
        }
    }
    let Some(mut stream) = stream else {
        stats.connect_failures.fetch_add(1, Ordering::Relaxed);
        rx.close();
        while let Some((_, _, _, done)) = rx.recv().await {
            let _ = done.send(false);
        }
        return;
    };
    let _ = stream.set_nodelay(true);
    while let Some((buf, n, bytes, done)) = rx.recv().await {
        if let Err(e) = stream.write_all(&buf).await {
            tracing::warn!(%to, error = %e, "transfer engine write failed");
            stats.write_failures.fetch_add(1, Ordering::Relaxed);
            let _ = done.send(false);
            rx.close();
            while let Some((_, _, _, done)) = rx.recv().await {
                let _ = done.send(false);
            }
            return;
        }
        stats.blocks_sent.fetch_add(n, Ordering::Relaxed);
        stats.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
        let _ = done.send(true);
    }
}

/// Decode's side: accept persistent connections and read blocks until each closes; every block
/// is handed to `on_block` (which attributes its address to a room). Garbage closes the
/// connection and is counted.
pub async fn serve<F>(listener: TcpListener, stats: Arc<TeStats>, on_block: F)
where
    F: Fn(Block) + Send + Sync + Clone + 'static,
{
    loop {
        let (sock, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "transfer engine accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = sock.set_nodelay(true);
        let (stats, on_block) = (stats.clone(), on_block.clone());
        tokio::spawn(async move {
            let mut r = tokio::io::BufReader::with_capacity(64 * 1024, sock);
            let mut h = [0u8; HEADER_LEN];
            let mut sink = vec![0u8; 64 * 1024];
            loop {
                match r.read_exact(&mut h).await {
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return,
                    Err(_) => {
                        stats.bad_connections.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                }
                let len = u64::from_le_bytes(h[..8].try_into().expect("8 bytes"));
                let addr = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
                if h[16] != OP_WRITE || len > BLOCK_LIMIT {
                    tracing::warn!(%peer, opcode = h[16], len, "transfer engine: not a write block; closing");
                    stats.bad_connections.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                let mut left = len as usize;
                while left > 0 {
                    let n = left.min(sink.len());
                    if r.read_exact(&mut sink[..n]).await.is_err() {
                        stats.bad_connections.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    left -= n;
                }
                stats.blocks_received.fetch_add(1, Ordering::Relaxed);
                stats.bytes_received.fetch_add(len, Ordering::Relaxed);
                on_block(Block { addr, len });
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_is_mooncakes_session_header() {
        let h = header(Block {
            addr: 0x7f00_0000_1000,
            len: 300,
        });
        assert_eq!(&h[..8], &300u64.to_le_bytes());
        assert_eq!(&h[8..16], &0x7f00_0000_1000u64.to_le_bytes());
        assert_eq!(h[16], 1);
        assert!(h[17..].iter().all(|&b| b == 0));
        assert_eq!(
            encode(&[Block { addr: 1, len: 3 }, Block { addr: 9, len: 0 }]).len(),
            24 + 3 + 24
        );
    }

    #[tokio::test]
    async fn blocks_arrive_with_their_addresses() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let stats = Arc::new(TeStats::default());
        let got: Arc<Mutex<Vec<Block>>> = Arc::default();
        let g = got.clone();
        tokio::spawn(serve(l, stats.clone(), move |b| g.lock().unwrap().push(b)));
        let c = TeClient::new(Arc::new(TeStats::default()));
        let blocks = [
            Block {
                addr: 4096,
                len: 70_000,
            },
            Block { addr: 8192, len: 8 },
        ];
        assert!(c.write(addr, &blocks).await);
        for _ in 0..200 {
            if got.lock().unwrap().len() == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(&got.lock().unwrap()[..], &blocks);
        assert_eq!(stats.bytes_received.load(Ordering::Relaxed), 70_008);
    }
}
