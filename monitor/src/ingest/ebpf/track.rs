//! Per-connection reassembly and the mapping from what crossed the wire to lifecycle events.
//!
//! [`Tracker`] is pure: it is fed decoded kernel records (plus what discovery learned about
//! processes and worker addresses) and appends [`LifecycleEvent`]s. Memory is bounded: a fixed
//! number of connections (least recently used evicted, counted), a fixed number of in-flight
//! requests per connection, and bounded body windows.
//!
//! Lifecycle mapping (issue 4):
//! - router → worker `/generate` (or OpenAI endpoints): router `dispatched` (to = the worker's
//!   stage); worker inbound: `received`;
//! - worker response status >= 400: `rejected` with status and a truncated reason; 2xx end:
//!   `completed`; decode response bytes: decode `work`;
//! - decode → prefill bootstrap server `GET /route`: transfer `work`;
//! - ZMTP `[BOOTSTRAP, room, ..]`: transfer `work` for the room, `[ABORT, room]`: transfer
//!   `cancelled`;
//! - a connection closed with a request not yet answered: `cancelled` at the worker's stage.
//!
//! When both ends of a connection are watched on this node, each event is emitted once, by the
//! end that owns it (requests/responses at the worker, dispatch at the router, transfer control
//! at decode).

use std::collections::VecDeque;

use foldhash::{HashMap, HashMapExt};
use std::net::SocketAddr;

use super::http::{HttpEvent, HttpStream, RequestHead, Side, detect};
use super::json_ids::RequestIds;
use super::procs::Role;
use super::record::{Conn, DataPiece, Record};
use super::zmtp::{self, Control, ZmtpStream};
use crate::event::{Kind, LifecycleEvent, Source, Stage, truncate_reason};

/// Limits that bound the tracker's memory.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_conns: usize,
    pub max_pending: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_conns: 16_384,
            max_pending: 64,
        }
    }
}

/// What the tracker counts; bounded, no request ids.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TrackStats {
    pub conns_evicted: u64,
    pub pending_dropped: u64,
    pub http_desyncs: u64,
    pub gap_bytes: u64,
    pub events: u64,
}

/// Translates kernel CLOCK_MONOTONIC stamps to Unix time.
#[derive(Debug, Clone, Copy, Default)]
pub struct Clock {
    pub unix_minus_mono_ns: i128,
}

impl Clock {
    pub fn now() -> Clock {
        let mono = read_clock(libc::CLOCK_MONOTONIC);
        let real = read_clock(libc::CLOCK_REALTIME);
        Clock {
            unix_minus_mono_ns: real - mono,
        }
    }
    pub fn unix(&self, mono_ns: u64) -> u64 {
        (mono_ns as i128 + self.unix_minus_mono_ns).max(0) as u64
    }
}

fn read_clock(id: libc::clockid_t) -> i128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a local timespec.
    unsafe { libc::clock_gettime(id, &mut ts) };
    ts.tv_sec as i128 * 1_000_000_000 + ts.tv_nsec as i128
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PathKind {
    Generate,
    Route,
    Other,
}

fn path_kind(path: &str) -> PathKind {
    match path {
        "/generate"
        | "/v1/completions"
        | "/v1/chat/completions"
        | "/v1/generate"
        | "/v1/responses" => PathKind::Generate,
        p if p.starts_with("/route") => PathKind::Route,
        _ => PathKind::Other,
    }
}

#[derive(Debug)]
enum Proto {
    Unknown,
    Http(HttpStream),
    Zmtp(ZmtpStream),
}

#[derive(Debug)]
struct Stream {
    /// Stream offset where the current syscall's bytes start, and that syscall's key.
    base: u64,
    cur: Option<(u64, u32, u64)>,
    /// Next stream offset we expect bytes for.
    expect: u64,
    proto: Proto,
}

impl Default for Stream {
    fn default() -> Self {
        Stream {
            base: 0,
            cur: None,
            expect: 0,
            proto: Proto::Unknown,
        }
    }
}

#[derive(Debug)]
struct Pending {
    head: RequestHead,
    start_ns: u64,
    ended: bool,
    ids: RequestIds,
    /// Response status once its head arrived, and when.
    status: Option<(u16, u64)>,
    /// The response ended (possibly before the request body did).
    done: bool,
    work_emitted: bool,
    /// Response events that waited for the request body (and its ids) to end.
    deferred: Vec<(Kind, u64, Option<u16>, Option<String>)>,
}

#[derive(Debug, Default)]
struct Connection {
    peer: Option<SocketAddr>,
    last_ns: u64,
    /// [ingress, egress]
    streams: [Stream; 2],
    pending: VecDeque<Pending>,
}

#[derive(Debug, Clone, Copy)]
struct Worker {
    role: Role,
    /// A watched process on this node listens there: it reports its own events.
    local: bool,
}

pub struct Tracker {
    node: Option<Box<str>>,
    clock: Clock,
    limits: Limits,
    roles: HashMap<u32, Role>,
    workers: HashMap<SocketAddr, Worker>,
    local_ports: HashMap<u16, Worker>,
    conns: HashMap<(u32, u32), Connection>,
    pub stats: TrackStats,
}

impl Tracker {
    pub fn new(node: Option<String>, clock: Clock, limits: Limits) -> Self {
        Tracker {
            node: node.map(Into::into),
            clock,
            limits,
            roles: HashMap::new(),
            workers: HashMap::new(),
            local_ports: HashMap::new(),
            conns: HashMap::new(),
            stats: TrackStats::default(),
        }
    }

    pub fn set_role(&mut self, tgid: u32, role: Role) {
        self.roles.insert(tgid, role);
    }

    pub fn role(&self, tgid: u32) -> Option<Role> {
        self.roles.get(&tgid).copied()
    }

    pub fn has_role(&self, role: Role) -> bool {
        self.roles.values().any(|r| *r == role)
    }

    /// A worker address named by a router (`--prefill URL`), possibly on another node.
    pub fn add_worker(&mut self, addr: SocketAddr, role: Role) {
        let local = self.workers.get(&addr).is_some_and(|w| w.local);
        self.workers.insert(addr, Worker { role, local });
    }

    /// A watched process of `role` listens on `port` of this node.
    pub fn add_local_listener(&mut self, port: u16, role: Role) {
        self.local_ports.insert(port, Worker { role, local: true });
    }

    /// A socket that existed before we watched its process (found in /proc).
    pub fn add_existing_socket(&mut self, tgid: u32, fd: u32, peer: Option<SocketAddr>) {
        self.conn_mut(tgid, fd, 0).peer = peer;
    }

    pub fn remove_process(&mut self, tgid: u32, now_mono: u64, out: &mut Vec<LifecycleEvent>) {
        let fds: Vec<u32> = self
            .conns
            .keys()
            .filter(|(t, _)| *t == tgid)
            .map(|(_, fd)| *fd)
            .collect();
        for fd in fds {
            self.close(tgid, fd, now_mono, out);
        }
        self.roles.remove(&tgid);
    }

    pub fn conn_count(&self) -> usize {
        self.conns.len()
    }

    fn conn_mut(&mut self, tgid: u32, fd: u32, now: u64) -> &mut Connection {
        if !self.conns.contains_key(&(tgid, fd)) && self.conns.len() >= self.limits.max_conns {
            // Evict the least recently active connection: bounded memory beats completeness,
            // and the count says how often it happens.
            if let Some(old) = self
                .conns
                .iter()
                .min_by_key(|(_, c)| c.last_ns)
                .map(|(k, _)| *k)
            {
                self.conns.remove(&old);
                self.stats.conns_evicted += 1;
            }
        }
        let c = self.conns.entry((tgid, fd)).or_default();
        c.last_ns = c.last_ns.max(now);
        c
    }

    pub fn on_record(&mut self, rec: &Record<'_>, out: &mut Vec<LifecycleEvent>) {
        let before = out.len();
        match rec {
            Record::Connect(c) | Record::Accept(c) => self.on_conn(c),
            Record::Close { hdr, fd } => self.close(hdr.tgid, *fd, hdr.ts_ns, out),
            Record::Data(d) => self.on_data(d, out),
            Record::Exec { .. } | Record::Exit { .. } | Record::Fork { .. } => {}
        }
        self.stats.events += (out.len() - before) as u64;
    }

    fn on_conn(&mut self, c: &Conn) {
        // A reused fd number is a new connection.
        self.conns.remove(&(c.hdr.tgid, c.fd));
        self.conn_mut(c.hdr.tgid, c.fd, c.hdr.ts_ns).peer = c.peer;
    }

    fn on_data(&mut self, d: &DataPiece<'_>, out: &mut Vec<LifecycleEvent>) {
        let tgid = d.hdr.tgid;
        let Some(role) = self.role(tgid) else { return };
        let dir = if d.is_ingress() { 0 } else { 1 };
        let key = (d.hdr.ts_ns, d.hdr.tid);
        let mut http_events = Vec::new();
        let mut zmtp_msgs = Vec::new();
        let gap_bytes;
        let mut desyncs = 0;
        {
            let conn = self.conn_mut(tgid, d.fd, d.hdr.ts_ns);
            let s = &mut conn.streams[dir];
            match s.cur {
                Some((ts, tid, total)) if (ts, tid) == key && total == d.total => {}
                Some((_, _, total)) => {
                    s.base += total;
                    s.cur = Some((key.0, key.1, d.total));
                }
                None => s.cur = Some((key.0, key.1, d.total)),
            }
            let at = s.base + d.off as u64;
            let start = d.off == 0;
            if at < s.expect {
                // Overlap or reordering across CPUs: drop what we already have.
                return;
            }
            let gap = at - s.expect;
            gap_bytes = gap;
            s.expect = at + d.bytes.len() as u64;
            if matches!(s.proto, Proto::Unknown) && start {
                if zmtp::is_greeting(d.bytes) {
                    s.proto = Proto::Zmtp(ZmtpStream::from_greeting());
                } else if detect(d.bytes) != Side::Unknown {
                    s.proto = Proto::Http(HttpStream::default());
                }
            }
            match &mut s.proto {
                Proto::Unknown => {}
                Proto::Http(h) => {
                    h.gap(gap, &mut http_events);
                    h.feed(d.bytes, start, &mut http_events);
                }
                Proto::Zmtp(z) => {
                    if gap > 0 {
                        z.gap(gap);
                    }
                    z.feed(d.bytes, start, &mut zmtp_msgs);
                }
            }
            for e in &http_events {
                if matches!(e, HttpEvent::Desync) {
                    desyncs += 1;
                }
            }
        }
        self.stats.gap_bytes += gap_bytes;
        self.stats.http_desyncs += desyncs;
        let ts = d.hdr.ts_ns;
        for ev in http_events {
            self.on_http(tgid, d.fd, role, dir, ts, ev, out);
        }
        for m in zmtp_msgs {
            self.on_zmtp(tgid, role, dir, ts, &m, out);
        }
    }

    fn event(&self, mono_ns: u64, stage: Stage, kind: Kind, tgid: u32) -> LifecycleEvent {
        let mut e = LifecycleEvent::new(self.clock.unix(mono_ns), stage, kind, Source::Ebpf);
        e.node = self.node.clone();
        e.pid = Some(tgid);
        e
    }

    fn worker_of(&self, peer: Option<SocketAddr>) -> Option<Worker> {
        let peer = peer?;
        if let Some(w) = self.workers.get(&peer) {
            let local =
                w.local || (peer.ip().is_loopback() && self.local_ports.contains_key(&peer.port()));
            return Some(Worker {
                role: w.role,
                local,
            });
        }
        if peer.ip().is_loopback() || peer.ip().is_unspecified() {
            return self.local_ports.get(&peer.port()).copied();
        }
        None
    }

    #[allow(clippy::too_many_arguments)]
    fn on_http(
        &mut self,
        tgid: u32,
        fd: u32,
        role: Role,
        dir: usize,
        ts: u64,
        ev: HttpEvent,
        out: &mut Vec<LifecycleEvent>,
    ) {
        let max_pending = self.limits.max_pending;
        let Some(conn) = self.conns.get_mut(&(tgid, fd)) else {
            return;
        };
        let peer = conn.peer;
        // Requests we receive (ingress) make us the server; requests we send make us the client.
        let client = dir == 1;
        match &ev {
            HttpEvent::RequestHead(head) => {
                if conn.pending.len() >= max_pending {
                    conn.pending.pop_front();
                    self.stats.pending_dropped += 1;
                }
                conn.pending.push_back(Pending {
                    head: head.clone(),
                    start_ns: ts,
                    ended: false,
                    ids: RequestIds::default(),
                    status: None,
                    done: false,
                    work_emitted: false,
                    deferred: Vec::new(),
                });
            }
            HttpEvent::ResponseHead(h) => {
                if let Some(p) = conn.pending.iter_mut().find(|p| p.status.is_none()) {
                    p.status = Some((h.status, ts));
                }
            }
            HttpEvent::BodyStarted | HttpEvent::End { .. } | HttpEvent::Desync => {}
        }
        let stream_side = match &conn.streams[dir].proto {
            Proto::Http(h) => h.side,
            _ => Side::Unknown,
        };
        let is_request_stream = stream_side == Side::Requests;
        match ev {
            HttpEvent::End { body } if is_request_stream => {
                let Some(i) = conn.pending.iter().position(|p| !p.ended) else {
                    return;
                };
                let p = &mut conn.pending[i];
                p.ended = true;
                p.ids = body.request_ids();
                let (head, ids, start, deferred) = (
                    p.head.clone(),
                    p.ids.clone(),
                    p.start_ns,
                    std::mem::take(&mut p.deferred),
                );
                if p.done {
                    conn.pending.remove(i);
                }
                let client = dir == 1;
                self.request_event(tgid, role, client, peer, &head, &ids, start, body.len, out);
                for (kind, ts, status, reason) in deferred {
                    self.response_event(
                        tgid,
                        role,
                        client,
                        peer,
                        &head,
                        &ids,
                        kind,
                        ts,
                        status,
                        reason.as_deref(),
                        None,
                        out,
                    );
                }
            }
            HttpEvent::BodyStarted if !is_request_stream => {
                let Some(p) = conn
                    .pending
                    .iter_mut()
                    .find(|p| p.status.is_some() && !p.work_emitted)
                else {
                    return;
                };
                p.work_emitted = true;
                let status = p.status.map(|s| s.0);
                if status.is_some_and(|s| s < 400) {
                    self.response_or_defer(
                        tgid,
                        fd,
                        role,
                        !client,
                        peer,
                        Kind::Work,
                        ts,
                        status,
                        None,
                        None,
                        out,
                    );
                }
            }
            HttpEvent::End { body } => {
                // A response ended: it answers the oldest request still waiting for one.
                let Some(i) = conn
                    .pending
                    .iter()
                    .position(|p| p.status.is_some() && !p.done)
                else {
                    return;
                };
                let p = &mut conn.pending[i];
                p.done = true;
                let ended = p.ended;
                let Some((status, head_ts)) = p.status else {
                    return;
                };
                let info = body.response_info();
                if status >= 400 {
                    let reason = info
                        .message
                        .map(|m| truncate_reason(&m).to_owned())
                        .unwrap_or_else(|| format!("HTTP {status}"));
                    self.response_or_defer(
                        tgid,
                        fd,
                        role,
                        !client,
                        peer,
                        Kind::Rejected,
                        head_ts,
                        Some(status),
                        Some(reason),
                        None,
                        out,
                    );
                } else {
                    self.response_or_defer(
                        tgid,
                        fd,
                        role,
                        !client,
                        peer,
                        Kind::Completed,
                        ts,
                        Some(status),
                        None,
                        info.prompt_tokens,
                        out,
                    );
                }
                if ended && let Some(conn) = self.conns.get_mut(&(tgid, fd)) {
                    conn.pending.remove(i);
                }
            }
            _ => {}
        }
    }

    /// Emits a response event for the oldest request, or parks it until the request's body
    /// (and so its ids) has been seen.
    #[allow(clippy::too_many_arguments)]
    fn response_or_defer(
        &mut self,
        tgid: u32,
        fd: u32,
        role: Role,
        client: bool,
        peer: Option<SocketAddr>,
        kind: Kind,
        ts: u64,
        status: Option<u16>,
        reason: Option<String>,
        tokens: Option<u64>,
        out: &mut Vec<LifecycleEvent>,
    ) {
        let Some(conn) = self.conns.get_mut(&(tgid, fd)) else {
            return;
        };
        let Some(p) = conn.pending.iter_mut().find(|p| p.status.is_some()) else {
            return;
        };
        if !p.ended {
            p.deferred.push((kind, ts, status, reason));
            return;
        }
        let (head, ids) = (p.head.clone(), p.ids.clone());
        self.response_event(
            tgid,
            role,
            client,
            peer,
            &head,
            &ids,
            kind,
            ts,
            status,
            reason.as_deref(),
            tokens,
            out,
        );
    }

    fn with_ids(
        &self,
        mut e: LifecycleEvent,
        head: &RequestHead,
        ids: &RequestIds,
    ) -> LifecycleEvent {
        if let Some(r) = &head.request_id {
            e = e.with_request_id(r.as_str());
        }
        if let Some(t) = head.traceparent.as_deref().and_then(trace_id_of) {
            e = e.with_trace_id(t);
        }
        if let Some(r) = &ids.rid {
            e = e.with_rid(r.as_str());
        }
        if let Some(r) = ids.bootstrap_room {
            e = e.with_room(r);
        }
        e
    }

    #[allow(clippy::too_many_arguments)]
    fn request_event(
        &self,
        tgid: u32,
        role: Role,
        client: bool,
        peer: Option<SocketAddr>,
        head: &RequestHead,
        ids: &RequestIds,
        start: u64,
        body_len: u64,
        out: &mut Vec<LifecycleEvent>,
    ) {
        let kind = path_kind(&head.path);
        let detail = format!("{} {} body_bytes={body_len}", head.method, head.path);
        let e = match (role, client, kind) {
            (Role::Router, true, PathKind::Generate) => {
                let mut e = self.event(start, Stage::Router, Kind::Dispatched, tgid);
                if let Some(w) = self.worker_of(peer) {
                    e = e.with_to(w.role.stage());
                }
                e
            }
            (Role::Prefill | Role::Decode, false, PathKind::Generate) => {
                self.event(start, role.stage(), Kind::Received, tgid)
            }
            (Role::Decode, true, PathKind::Route) => {
                self.event(start, Stage::Transfer, Kind::Work, tgid)
            }
            (Role::Prefill, false, PathKind::Route) if !self.has_role(Role::Decode) => {
                self.event(start, Stage::Transfer, Kind::Work, tgid)
            }
            _ => return,
        };
        let mut e = self.with_ids(e, head, ids);
        e.detail = Some(truncate_reason(&detail).into());
        if let Some(p) = peer {
            e = e.with_worker(p.to_string());
        }
        out.push(e);
    }

    #[allow(clippy::too_many_arguments)]
    fn response_event(
        &self,
        tgid: u32,
        role: Role,
        client: bool,
        peer: Option<SocketAddr>,
        head: &RequestHead,
        ids: &RequestIds,
        kind: Kind,
        ts: u64,
        status: Option<u16>,
        reason: Option<&str>,
        tokens: Option<u64>,
        out: &mut Vec<LifecycleEvent>,
    ) {
        if path_kind(&head.path) != PathKind::Generate {
            return;
        }
        let stage = match (role, client) {
            (Role::Prefill | Role::Decode, false) => role.stage(),
            // The router's view of a worker's answer, only when that worker is not watched here.
            (Role::Router, true) => match self.worker_of(peer) {
                Some(w) if !w.local => w.role.stage(),
                _ => return,
            },
            _ => return,
        };
        if kind == Kind::Work && stage != Stage::Decode {
            return;
        }
        let mut e = self.with_ids(self.event(ts, stage, kind, tgid), head, ids);
        e.status = status;
        if let Some(r) = reason {
            e = e.with_reason(r);
        }
        if let Some(t) = tokens {
            e = e.with_input_tokens(t);
        }
        e.detail = Some(truncate_reason(&format!("{} {}", head.method, head.path)).into());
        out.push(e);
    }

    fn on_zmtp(
        &mut self,
        tgid: u32,
        role: Role,
        dir: usize,
        ts: u64,
        msg: &zmtp::Message,
        out: &mut Vec<LifecycleEvent>,
    ) {
        let Some(ctl) = zmtp::control(msg) else {
            return;
        };
        // Decode sends the control messages; prefill reports them only if decode is not watched here.
        let owner = (role == Role::Decode && dir == 1)
            || (role == Role::Prefill && dir == 0 && !self.has_role(Role::Decode));
        if !owner {
            return;
        }
        let (kind, room, what) = match ctl {
            Control::Bootstrap { room } => (Kind::Work, room, "zmtp BOOTSTRAP"),
            Control::Abort { room } => (Kind::Cancelled, room, "zmtp ABORT"),
        };
        let mut e = self.event(ts, Stage::Transfer, kind, tgid).with_room(room);
        e.detail = Some(what.into());
        out.push(e);
    }

    fn close(&mut self, tgid: u32, fd: u32, ts: u64, out: &mut Vec<LifecycleEvent>) {
        let Some(mut conn) = self.conns.remove(&(tgid, fd)) else {
            return;
        };
        let Some(role) = self.role(tgid) else { return };
        let mut sink = Vec::new();
        for s in conn.streams.iter_mut() {
            if let Proto::Http(h) = &mut s.proto {
                h.close(&mut sink);
            }
        }
        let client = matches!(&conn.streams[1].proto, Proto::Http(h) if h.side == Side::Requests);
        for p in conn.pending.drain(..) {
            if p.status.is_some() || path_kind(&p.head.path) != PathKind::Generate {
                continue;
            }
            let stage = match (role, client) {
                (Role::Router, true) => match self.worker_of(conn.peer) {
                    Some(w) => w.role.stage(),
                    None => continue,
                },
                (Role::Prefill | Role::Decode, false) => role.stage(),
                _ => continue,
            };
            let mut e = self.with_ids(
                self.event(ts, stage, Kind::Cancelled, tgid),
                &p.head,
                &p.ids,
            );
            e = e.with_reason("connection closed before a response");
            if let Some(peer) = conn.peer {
                e = e.with_worker(peer.to_string());
            }
            out.push(e);
        }
    }
}

/// The trace id of a W3C `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`).
pub fn trace_id_of(tp: &str) -> Option<&str> {
    let mut it = tp.split('-');
    let _version = it.next()?;
    let id = it.next()?;
    (id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())).then_some(id)
}

#[cfg(test)]
mod tests;
