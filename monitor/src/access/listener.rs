//! A TCP listener that hands out connections once their TLS handshake completed, for the axum
//! servers (`axum::serve::Listener`) and tonic (`incoming`). Handshakes run concurrently in
//! their own tasks, bounded in number and time, so a slow or silent client holds up nobody.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use super::{AccessStats, Alpn, Server, ServerTls};

/// A client that has not finished its handshake by then is dropped (counted).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress at once; beyond, new connections are closed at once (counted).
const MAX_HANDSHAKES: usize = 256;
/// Established connections waiting for the server to take them.
const ESTABLISHED_QUEUE: usize = 64;
/// At most one handshake-failure line per this interval (the metric counts every one).
const FAILURE_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// One established TLS connection.
pub struct TlsConn(TlsStream<TcpStream>);

impl AsyncRead for TlsConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
}

impl tonic::transport::server::Connected for TlsConn {
    type ConnectInfo = Option<SocketAddr>;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.0.get_ref().0.peer_addr().ok()
    }
}

/// Ends the accept loop when the listener is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A bound server socket: plain TCP, or TLS in front of it.
pub enum Incoming {
    Plain(TcpListener),
    Tls(TlsListener),
}

impl Incoming {
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        match self {
            Incoming::Plain(l) => l.local_addr(),
            Incoming::Tls(l) => Ok(l.local),
        }
    }
}

pub struct TlsListener {
    established: mpsc::Receiver<(TlsConn, SocketAddr)>,
    local: SocketAddr,
    _accept: AbortOnDrop,
}

impl TlsListener {
    /// Starts accepting on `tcp` (needs a runtime).
    pub fn new(
        tcp: TcpListener,
        tls: Arc<ServerTls>,
        alpn: Alpn,
        server: Server,
        stats: Arc<AccessStats>,
    ) -> io::Result<TlsListener> {
        let local = tcp.local_addr()?;
        let (tx, rx) = mpsc::channel(ESTABLISHED_QUEUE);
        let task = tokio::spawn(accept_loop(tcp, tls, alpn, server, stats, tx));
        Ok(TlsListener {
            established: rx,
            local,
            _accept: AbortOnDrop(task),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The established connections, for tonic's `serve_with_incoming_shutdown`.
    pub fn incoming(self) -> impl futures_util::Stream<Item = io::Result<TlsConn>> + Send {
        futures_util::stream::unfold(self, |mut l| async move {
            let (conn, _) = l.established.recv().await?;
            Some((Ok(conn), l))
        })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsConn;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (TlsConn, SocketAddr) {
        match self.established.recv().await {
            Some(c) => c,
            // The accept loop only ends with the listener.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }
}

/// Says why handshakes fail, at most once per [`FAILURE_LOG_INTERVAL`].
struct FailureLog {
    start: Instant,
    last_ms: AtomicU64,
    suppressed: AtomicU64,
}

impl FailureLog {
    fn note(&self, server: Server, peer: SocketAddr, error: &dyn std::fmt::Display) {
        let now = self.start.elapsed().as_millis() as u64 + FAILURE_LOG_INTERVAL.as_millis() as u64;
        let last = self.last_ms.load(Relaxed);
        if now.saturating_sub(last) < FAILURE_LOG_INTERVAL.as_millis() as u64
            || self
                .last_ms
                .compare_exchange(last, now, Relaxed, Relaxed)
                .is_err()
        {
            self.suppressed.fetch_add(1, Relaxed);
            return;
        }
        let suppressed = self.suppressed.swap(0, Relaxed);
        tracing::warn!(
            server = server.as_str(),
            %peer,
            error = %error,
            suppressed,
            "TLS handshake failed (revenant_tls_handshake_failures_total counts each)"
        );
    }
}

async fn accept_loop(
    tcp: TcpListener,
    tls: Arc<ServerTls>,
    alpn: Alpn,
    server: Server,
    stats: Arc<AccessStats>,
    tx: mpsc::Sender<(TlsConn, SocketAddr)>,
) {
    let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    let log = Arc::new(FailureLog {
        start: Instant::now(),
        last_ms: AtomicU64::new(0),
        suppressed: AtomicU64::new(0),
    });
    loop {
        let (conn, peer) = tokio::select! {
            r = tcp.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // EMFILE and friends: back off rather than spin or stop serving.
                    tracing::warn!(server = server.as_str(), error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = tx.closed() => return,
        };
        // Exports are latency-sensitive acknowledgements: no Nagle delay.
        let _ = conn.set_nodelay(true);
        let Ok(permit) = handshakes.clone().try_acquire_owned() else {
            stats.handshake_failed(server);
            log.note(server, peer, &"too many handshakes in progress");
            continue;
        };
        let acceptor = TlsAcceptor::from(tls.config(alpn));
        let (tx, stats, log) = (tx.clone(), stats.clone(), log.clone());
        tokio::spawn(async move {
            let _permit = permit;
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(conn)).await {
                Ok(Ok(s)) => {
                    let _ = tx.send((TlsConn(s), peer)).await;
                }
                Ok(Err(e)) => {
                    stats.handshake_failed(server);
                    log.note(server, peer, &e);
                }
                Err(_) => {
                    stats.handshake_failed(server);
                    log.note(server, peer, &"no handshake within 10 s");
                }
            }
        });
    }
}
