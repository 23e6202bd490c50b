//! The KV-transfer control channel: persistent ZMTP PUSH connections to peers (one writer
//! task per endpoint, as pyzmq keeps one socket per peer) and a PULL listener.
//!
//! Messages (every part is ASCII unless noted; rooms are decimal, as SGLang encodes them
//! with `str(room).encode("ascii")`):
//!
//! | direction        | frames                                        |
//! |------------------|-----------------------------------------------|
//! | decode → prefill | `BOOTSTRAP`, room, decode ip, decode kv port  |
//! | decode → prefill | `ABORT`, room                                 |
//! | prefill → decode | `KV`, room, chunk index, payload (binary)     |
//! | prefill → decode | `KV_DONE`, room, transferred token count      |

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use std::sync::Mutex;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

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
        // Coalesce whatever is already queued into one write: at high rates this is the
        // difference between one syscall per message and one per batch.
        while out.len() < 256 * 1024 {
            match rx.try_recv() {
                Ok((m, k)) => {
                    out.extend_from_slice(&m);
                    n += k;
                }
                Err(_) => break,
            }
        }
        if let Err(e) = stream.write_all(&out).await {
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
            let mut reader = tokio::io::BufReader::with_capacity(64 * 1024, sock);
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
