//! HTTP/1.1 serving that sees the client close its connection while a request is in flight,
//! and lets the server decide what that means (decode's `--decode-ignores-cancel`).
//!
//! hyper (and so `axum::serve`) ends a connection on a read EOF in the middle of a request and
//! drops the handler, possibly before it ever ran: a request followed at once by the client's
//! FIN would vanish unseen. Here the connection's reads go through [`Watched`], which notes an
//! EOF (or a reset) that comes while a request is in flight, records when
//! ([`ClientConn::gone_ns`]) and hides it from hyper, so the handler has run by then. Then:
//!
//! - [`OnClientGone::Cancel`] (SGLang's decode): the connection is dropped at once, which drops
//!   the in-flight handler (its guards run) and closes the socket.
//! - [`OnClientGone::Notify`] (SGLang's decode): the handler decides. A request whose answer is
//!   already streaming is dropped at once (SGLang's generator is cancelled with the stream); a
//!   request still being worked on goes on until its handler gives up
//!   ([`ClientConn::close_now`], after SGLang's tokenizer noticed on its next poll), and then the
//!   socket is closed without an answer.
//! - [`OnClientGone::Ignore`]: the handler runs on as if the client were there; its answer gets
//!   `connection: close`, is written on the socket, and the socket is closed after it.
//!
//! An EOF while no request is in flight is an ordinary close.
//!
//! Also a role's start and end as a server: the READY line once its ports are bound, and the
//! signal that starts a graceful shutdown.

use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::{HeaderValue, Request, header};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

use crate::ids::now_ns;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnClientGone {
    /// Drop the in-flight request and close the connection.
    Cancel,
    /// Tell the handler; close once it gives up (at once for an answer already streaming).
    Notify,
    /// Serve the request to its end and write the answer, then close.
    Ignore,
}

/// One client connection, as the handlers of its requests see it (a request extension).
#[derive(Default)]
pub struct ConnState {
    /// Requests received whose answer (status line and headers) is not produced yet.
    active: AtomicU32,
    /// Requests whose status line and headers went out and whose body has not ended.
    heads: AtomicU32,
    /// When the client closed the connection with a request in flight (0: it did not).
    gone_ns: AtomicU64,
    gone: Notify,
    /// A handler gave its request up ([`ClientConn::close_now`]).
    close: Notify,
}

/// The request extension handlers take (`Option<Extension<ClientConn>>`).
#[derive(Clone)]
pub struct ClientConn(pub Arc<ConnState>);

impl ClientConn {
    /// When the client went away while a request was in flight on this connection.
    pub fn gone_ns(&self) -> Option<u64> {
        match self.0.gone_ns.load(Ordering::Acquire) {
            0 => None,
            t => Some(t),
        }
    }

    /// The handler gave its request up after its client left: close the connection now,
    /// without an answer ([`OnClientGone::Notify`]).
    pub fn close_now(&self) {
        self.0.close.notify_one();
    }
}

/// The accepted socket, with reads watched for the client going away mid-request.
struct Watched {
    tcp: TcpStream,
    state: Arc<ConnState>,
    eof: bool,
}

impl Watched {
    fn saw_eof(&mut self) -> Poll<io::Result<()>> {
        self.eof = true;
        if self.state.active.load(Ordering::Acquire) == 0 {
            return Poll::Ready(Ok(()));
        }
        if self.state.gone_ns.load(Ordering::Acquire) == 0 {
            self.state.gone_ns.store(now_ns().max(1), Ordering::Release);
            self.state.gone.notify_one();
        }
        // Nothing more will come from the client. hyper is woken by the handler's progress
        // (same task); an answer carries `connection: close`, so it does not read again.
        Poll::Pending
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.eof {
            return this.saw_eof();
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.tcp).poll_read(cx, buf) {
            Poll::Ready(Ok(())) if buf.filled().len() == before && buf.remaining() > 0 => {
                this.saw_eof()
            }
            Poll::Ready(Err(e))
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionReset
                        | io::ErrorKind::ConnectionAborted
                        | io::ErrorKind::BrokenPipe
                ) && this.state.active.load(Ordering::Acquire) > 0 =>
            {
                this.saw_eof()
            }
            other => other,
        }
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}

/// Decrements the in-flight count when a request's answer has been produced to its end (or
/// the handler or the body is dropped), and the count of answers streaming.
struct Active(Arc<ConnState>, bool);
impl Drop for Active {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::AcqRel);
        if self.1 {
            self.0.heads.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// A response body that holds its request's [`Active`] until its last frame.
struct Tail {
    inner: axum::body::Body,
    active: Option<Active>,
}

impl hyper::body::Body for Tail {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(None) = r {
            this.active = None;
        }
        r
    }
    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// Serve `app` on `listener` until SIGINT/SIGTERM (TCP_NODELAY on every accepted socket).
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    on_gone: OnClientGone,
) -> io::Result<()> {
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    loop {
        let tcp = tokio::select! {
            r = listener.accept() => match r {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // EMFILE and friends: back off rather than spin or stop serving.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => return Ok(()),
        };
        let _ = tcp.set_nodelay(true);
        tokio::spawn(serve_conn(tcp, app.clone(), on_gone));
    }
}

async fn serve_conn(tcp: TcpStream, app: axum::Router, on_gone: OnClientGone) {
    let state = Arc::new(ConnState::default());
    let io = TokioIo::new(Watched {
        tcp,
        state: state.clone(),
        eof: false,
    });
    let st = state.clone();
    let svc = hyper::service::service_fn(move |mut req: Request<Incoming>| {
        let (st, mut app) = (st.clone(), app.clone());
        st.active.fetch_add(1, Ordering::AcqRel);
        let mut active = Active(st.clone(), false);
        req.extensions_mut().insert(ClientConn(st.clone()));
        async move {
            let mut resp = match tower_service::Service::call(&mut app, req).await {
                Ok(r) => r,
                Err(never) => match never {},
            };
            if st.gone_ns.load(Ordering::Acquire) != 0 {
                resp.headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            // In flight until the body's end: a client leaving mid-stream is seen, too.
            st.heads.fetch_add(1, Ordering::AcqRel);
            active.1 = true;
            Ok::<_, Infallible>(resp.map(|inner| {
                axum::body::Body::new(Tail {
                    inner,
                    active: Some(active),
                })
            }))
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .header_read_timeout(None)
        .serve_connection(io, svc);
    match on_gone {
        OnClientGone::Ignore => {
            let _ = conn.await;
        }
        OnClientGone::Notify => {
            tokio::pin!(conn);
            loop {
                tokio::select! {
                    biased;
                    _ = &mut conn => break,
                    _ = state.close.notified() => break,
                    _ = state.gone.notified() => {
                        if state.heads.load(Ordering::Acquire) > 0 {
                            break;
                        }
                    }
                }
            }
        }
        OnClientGone::Cancel => {
            // Polled first, so a request that came with the client's FIN has been handed to
            // its handler (and run to its first wait) before it is dropped.
            tokio::select! {
                biased;
                _ = conn => {}
                _ = state.gone.notified() => {}
            }
        }
    }
}

/// The single machine-readable line a role prints on stdout once every port is bound; the
/// cluster and the tests read it to learn ephemeral ports.
pub fn print_ready(v: serde_json::Value) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "READY {v}");
    let _ = out.flush();
}

/// SIGINT/SIGTERM seen by the process, once handlers are installed (`None` if they could not be).
static SHUTDOWN: std::sync::OnceLock<Option<tokio::sync::watch::Sender<bool>>> =
    std::sync::OnceLock::new();

/// Install the SIGINT/SIGTERM handlers now (inside a runtime). A server calls this before it
/// prints READY: a signal sent right after READY, before anything awaits [`shutdown_signal`],
/// must still stop it gracefully rather than kill it with the default disposition.
pub fn install_shutdown_signals() {
    SHUTDOWN.get_or_init(|| {
        use tokio::signal::unix::{SignalKind, signal};
        let (mut term, mut int) = match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(t), Ok(i)) => (t, i),
            _ => return None,
        };
        let (tx, _) = tokio::sync::watch::channel(false);
        let notify = tx.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            notify.send_replace(true);
        });
        Some(tx)
    });
}

/// Wait for SIGINT or SIGTERM (any signal since [`install_shutdown_signals`] counts).
pub async fn shutdown_signal() {
    install_shutdown_signals();
    match SHUTDOWN.get().and_then(Option::as_ref) {
        Some(tx) => {
            let mut rx = tx.subscribe();
            let _ = rx.wait_for(|&stop| stop).await;
        }
        None => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
