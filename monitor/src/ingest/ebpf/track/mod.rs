//! Per-connection reassembly and the mapping from what crossed the wire to lifecycle events.
//!
//! [`Tracker`] is pure: it is fed decoded kernel records (plus what discovery learned about
//! processes and worker addresses) and appends [`LifecycleEvent`]s. Memory is bounded: a fixed
//! number of connections (least recently used evicted, counted), a fixed number of in-flight
//! requests per connection, and bounded body windows.
//!
//! Layout: reassembly and request/response pairing here; `lifecycle` maps them to events
//! (see there for the mapping); `clock` turns kernel stamps into Unix time.

use std::collections::VecDeque;

use foldhash::{HashMap, HashMapExt};
use std::net::{IpAddr, SocketAddr};

use super::http::{HttpEvent, HttpStream, RequestHead, Side, detect};
use super::json_ids::{self, BodyWindow, Finish, RequestIds, SubOutcome};
use super::procs::Role;
use super::record::{Conn, DataPiece, Record};
use super::zmtp::{self, ZmtpStream};
use crate::event::{Kind, LifecycleEvent, Stage, truncate_reason};

pub use clock::Clock;
pub use lifecycle::{Learned, trace_id_of};
use lifecycle::{PathKind, path_kind};

mod clock;
mod lifecycle;
mod rooms;
#[cfg(test)]
mod tests;
mod vllm;

/// Limits that bound the tracker's memory.
#[derive(Debug, Clone, Copy)]
pub struct TrackerLimits {
    pub max_conns: usize,
    pub max_pending: usize,
}

impl Default for TrackerLimits {
    fn default() -> Self {
        TrackerLimits {
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
    /// ZMTP messages left unread because a capture gap cut into their verb or key.
    pub zmtp_damaged: u64,
    /// vLLM NixlConnector handshakes (`get_meta_msg`): engine pairs that connected.
    pub vllm_nixl_handshakes: u64,
    /// vLLM MooncakeConnector requests a pull or answer named whose legs were not seen here.
    pub vllm_transfers_unattributed: u64,
    /// Times a capture gap cost a ZMTP stream its framing (the messages until the next syscall
    /// that starts a frame are lost).
    pub zmtp_desyncs: u64,
    /// Rooms whose control-channel protocol state was forgotten because the table was full
    /// (their breaches after that go unseen).
    pub room_states_evicted: u64,
    /// Requests left unanswered because the kernel lost their answers: after a loss, a second
    /// request waiting on a connection says the first one's answer was among the lost records.
    pub answers_lost: u64,
    pub events: u64,
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
    /// Answers that waited for the request body (and its ids) to end.
    deferred: Vec<Answer>,
    /// The kernel's lost-record count when the request's head was read.
    losses_at_read: u64,
}

impl Pending {
    fn new(head: RequestHead, start_ns: u64, losses_at_read: u64) -> Pending {
        Pending {
            losses_at_read,
            head,
            start_ns,
            ended: false,
            ids: RequestIds::default(),
            status: None,
            done: false,
            work_emitted: false,
            deferred: Vec::new(),
        }
    }
}

/// An answer's head arrived on a connection. Routers and the servers behind them do not
/// pipeline: a client sends its next request once the previous one is answered (smg and
/// vllm-router send through hyper, which never pipelines HTTP/1: hyperium/hyper#2596), so one
/// connection has at most one request waiting for its answer's head. Two or more after the
/// kernel lost records (`losses` grew since the oldest was read) mean the older ones' answers
/// were lost: pairing this answer with the oldest would give one request another's status (a
/// 400 to a request that was served). The older ones are dropped, unanswered, and counted; the
/// answer is the newest's. Without losses nothing changes.
fn drop_lost_answers(pending: &mut std::collections::VecDeque<Pending>, losses: u64) -> u64 {
    let waiting = || pending.iter().filter(|p| p.status.is_none());
    let Some(oldest) = waiting().next() else {
        return 0;
    };
    if oldest.losses_at_read == losses {
        return 0;
    }
    let lost = waiting().count().saturating_sub(1);
    if lost == 0 {
        return 0;
    }
    let mut left = lost;
    pending.retain(|p| {
        if left > 0 && p.status.is_none() {
            left -= 1;
            false
        } else {
            true
        }
    });
    lost as u64
}

/// What a worker's answer (or the first bytes of it) means for the request it answers.
#[derive(Debug, Clone)]
struct Answer {
    kind: Kind,
    ts: u64,
    status: Option<u16>,
    reason: Option<String>,
    tokens: Option<u64>,
    /// A successful answer to a batch: each request's outcome by its index.
    subs: Option<Vec<(usize, SubOutcome)>>,
}

impl Answer {
    fn new(kind: Kind, ts: u64, status: Option<u16>) -> Answer {
        Answer {
            kind,
            ts,
            status,
            reason: None,
            tokens: None,
            subs: None,
        }
    }
}

/// One end of a connection, as its HTTP traffic is read: who holds it and which side it is.
#[derive(Debug, Clone, Copy)]
struct Endpoint {
    tgid: u32,
    fd: u32,
    role: Role,
    /// This end writes the requests.
    client: bool,
    peer: Option<SocketAddr>,
    /// This end's address, when known (accepted connections whose listener the source knew).
    local: Option<SocketAddr>,
}

#[derive(Debug, Default)]
struct Connection {
    peer: Option<SocketAddr>,
    /// An accepted connection: the address it came in on, when the source knew its listener.
    local: Option<SocketAddr>,
    last_ns: u64,
    /// [ingress, egress]
    streams: [Stream; 2],
    pending: VecDeque<Pending>,
    /// A `/metrics` request went by: the source was asked to capture the connection whole.
    streamed: bool,
}

/// A vLLM decode leg whose `kv_transfer_params` name KV prefill did not issue to its request
/// (judged in [`vllm`], marked on the leg's event in [`lifecycle`]).
#[derive(Debug, Clone, PartialEq, Eq)]
struct HandoffBreach {
    breach: crate::event::ProtocolBreach,
    reason: String,
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
    limits: TrackerLimits,
    roles: HashMap<u32, Role>,
    workers: HashMap<SocketAddr, Worker>,
    local_ports: HashMap<u16, Worker>,
    conns: HashMap<(u32, u32), Connection>,
    /// Roles named by `/server_info` answers since the last [`Tracker::take_learned`]; `None`
    /// for a server that is not disaggregated (`"null"`).
    learned: Vec<(Learned, Option<Role>)>,
    /// Connections found to carry ZMTP since the last [`Tracker::take_zmtp_opened`]: the source
    /// has the kernel capture their syscalls whole.
    zmtp_opened: Vec<(u32, u32)>,
    /// HTTP connections that carried a `/metrics` request since the last
    /// [`Tracker::take_metrics_conns`]: the source has the kernel capture them whole
    /// ([`monitor_common::capture::STREAM`]), so a later scrape's long answer is read whole
    /// (vLLM's `vllm:cache_config_info` line lies anywhere in tens of KB).
    metrics_conns: Vec<(u32, u32)>,
    /// vLLM side-channel names that differ from their leg's rid.
    transfer_names: vllm::TransferNames,
    issued_kv: vllm::IssuedKv,
    /// The last capacity each vLLM worker reported.
    capacity: vllm::CapacityTable,
    /// Who connects from where on this node: see [`OwnSockets`].
    own: OwnSockets,
    /// Each room's control-channel protocol as each watched process sees it.
    rooms: rooms::RoomProtocols,
    /// Records the kernel lost so far (ring buffer or syscall table full), as the source last
    /// read them: any of them may have been a room's control message.
    kernel_losses: u64,
    pub stats: TrackStats,
}

/// The TCP connections watched processes opened (the kernel reports each once established,
/// discovery the ones that existed before), by local address, each with the address it went to,
/// so that the accepting end of a connection on this node can tell whether its peer is a watched
/// process. One local address may carry several connections at once (a port is shared by
/// connections to different destinations), so the accepting end matches its own address too when
/// it knows it. Entries are never removed when a socket closes (a writer may close before its
/// request is read): the oldest go once the table is full, and a connection another process
/// opens later between the same two addresses reads as the watched one's (a missed alert, never
/// a false one).
#[derive(Debug, Default)]
struct OwnSockets {
    /// The kernel reports the local address of every connection a watched process opens. Off,
    /// a peer on this node cannot be told apart from a watched one: it is unattributed.
    complete: bool,
    /// Local address → (the address it connected to, the process).
    by_addr: HashMap<SocketAddr, Vec<(SocketAddr, u32)>>,
    order: VecDeque<(SocketAddr, SocketAddr)>,
    /// The addresses this node's watched sockets use (besides loopback): a peer there is on
    /// this node.
    local_ips: Vec<IpAddr>,
}

/// Connections held for the source between two drains, per kind of capture change (new ZMTP
/// connections, connections that carried a `/metrics` request).
const MAX_CAPTURE_CHANGES: usize = 4096;

/// Own sockets remembered (about 4 MiB at most).
const MAX_OWN_SOCKETS: usize = 65_536;
/// Distinct local addresses of this node remembered.
const MAX_LOCAL_IPS: usize = 64;

/// An IPv4-mapped IPv6 address as the IPv4 one: a dual-stack listener sees `::ffff:a.b.c.d`.
fn canonical(a: SocketAddr) -> SocketAddr {
    match a.ip() {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map_or(a, |v4| SocketAddr::new(IpAddr::V4(v4), a.port())),
        IpAddr::V4(_) => a,
    }
}

/// Whether a connection that went to `remote` is one that came in on `local` (a listener's
/// address: a wildcard one takes any address of the port).
fn arrived_at(remote: SocketAddr, local: SocketAddr) -> bool {
    let (remote, local) = (canonical(remote), canonical(local));
    remote.port() == local.port() && (local.ip().is_unspecified() || remote.ip() == local.ip())
}

impl OwnSockets {
    fn add(&mut self, tgid: u32, local: SocketAddr, remote: SocketAddr) {
        let (local, remote) = (canonical(local), canonical(remote));
        let conns = self.by_addr.entry(local).or_default();
        match conns.iter_mut().find(|(r, _)| *r == remote) {
            Some(c) => c.1 = tgid,
            None => {
                conns.push((remote, tgid));
                if self.order.len() >= MAX_OWN_SOCKETS
                    && let Some((l, r)) = self.order.pop_front()
                    && let Some(old) = self.by_addr.get_mut(&l)
                {
                    old.retain(|(x, _)| *x != r);
                    if old.is_empty() {
                        self.by_addr.remove(&l);
                    }
                }
                self.order.push_back((local, remote));
            }
        }
        let ip = local.ip();
        if !ip.is_loopback()
            && !ip.is_unspecified()
            && !self.local_ips.contains(&ip)
            && self.local_ips.len() < MAX_LOCAL_IPS
        {
            self.local_ips.push(ip);
        }
    }
}

impl Tracker {
    pub fn new(node: Option<String>, clock: Clock, limits: TrackerLimits) -> Self {
        Tracker {
            node: node.map(Into::into),
            clock,
            limits,
            roles: HashMap::new(),
            workers: HashMap::new(),
            local_ports: HashMap::new(),
            conns: HashMap::new(),
            learned: Vec::new(),
            zmtp_opened: Vec::new(),
            metrics_conns: Vec::new(),
            transfer_names: vllm::TransferNames::default(),
            issued_kv: vllm::IssuedKv::default(),
            capacity: vllm::CapacityTable::default(),
            own: OwnSockets::default(),
            rooms: rooms::RoomProtocols::new(),
            kernel_losses: 0,
            stats: TrackStats::default(),
        }
    }

    /// The kernel reports the local address of every connection watched processes open
    /// ([`Record::Local`]), so a peer on this node that is none of them is foreign.
    pub fn set_local_attribution(&mut self, complete: bool) {
        self.own.complete = complete;
    }

    /// A connection watched process `tgid` holds goes from `local` on this node to `remote`
    /// (found in /proc for sockets that existed before it was watched).
    pub fn add_own_socket(&mut self, tgid: u32, local: SocketAddr, remote: SocketAddr) {
        self.own.add(tgid, local, remote);
    }

    /// Records the kernel lost so far (ring buffer or syscall table full): read before each
    /// drain, so that a room whose control message may be among them is not judged on order.
    pub fn set_kernel_losses(&mut self, n: u64) {
        self.kernel_losses = n;
    }

    pub fn set_role(&mut self, tgid: u32, role: Role) {
        self.roles.insert(tgid, role);
    }

    pub fn role(&self, tgid: u32) -> Option<Role> {
        self.roles.get(&tgid).copied()
    }

    /// What `/server_info` answers taught since the last call. The tracker already applied it
    /// (roles of processes it had as unknown, roles of worker addresses); the source logs it,
    /// and watches a local server it did not watch yet.
    pub fn take_learned(&mut self) -> Vec<(Learned, Option<Role>)> {
        std::mem::take(&mut self.learned)
    }

    /// `(tgid, fd)` of the connections found to carry ZMTP since the last call (the source takes
    /// them after every drain).
    pub fn take_zmtp_opened(&mut self) -> Vec<(u32, u32)> {
        std::mem::take(&mut self.zmtp_opened)
    }

    /// `(tgid, fd)` of the connections found to carry `/metrics` requests since the last call
    /// (the source takes them after every drain).
    pub fn take_metrics_conns(&mut self) -> Vec<(u32, u32)> {
        std::mem::take(&mut self.metrics_conns)
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
            self.evict_oldest_conns();
        }
        let c = self.conns.entry((tgid, fd)).or_default();
        c.last_ns = c.last_ns.max(now);
        c
    }

    /// Evicts the least recently active connections: bounded memory beats completeness, and the
    /// count says how often it happens. A sixteenth of the table goes at once, so that a flood of
    /// new connections costs one scan of the table per many of them, not one each.
    fn evict_oldest_conns(&mut self) {
        let n = (self.limits.max_conns / 16).clamp(1, self.conns.len().max(1));
        let mut ages: Vec<(u64, (u32, u32))> =
            self.conns.iter().map(|(k, c)| (c.last_ns, *k)).collect();
        if ages.is_empty() {
            return;
        }
        ages.select_nth_unstable(n - 1);
        for (_, key) in ages.into_iter().take(n) {
            self.conns.remove(&key);
            self.stats.conns_evicted += 1;
        }
    }

    pub fn on_record(&mut self, rec: &Record<'_>, out: &mut Vec<LifecycleEvent>) {
        let before = out.len();
        match rec {
            Record::Connect(c) | Record::Accept(c) => self.on_conn(c),
            Record::Close { hdr, fd } => self.close(hdr.tgid, *fd, hdr.ts_ns, out),
            Record::Data(d) => self.on_data(d, out),
            Record::Local { hdr, local, remote } => self.own.add(hdr.tgid, *local, *remote),
            Record::Exec { .. } | Record::Exit { .. } | Record::Fork { .. } => {}
        }
        self.stats.events += (out.len() - before) as u64;
    }

    fn on_conn(&mut self, c: &Conn) {
        // A reused fd number is a new connection.
        self.conns.remove(&(c.hdr.tgid, c.fd));
        let conn = self.conn_mut(c.hdr.tgid, c.fd, c.hdr.ts_ns);
        conn.peer = c.peer;
        conn.local = c.local;
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
        let mut zmtp_desyncs = 0;
        let mut zmtp_opened = false;
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
                    zmtp_opened = true;
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
                    let before = z.desyncs;
                    if gap > 0 {
                        z.gap(gap, &mut zmtp_msgs);
                    }
                    z.feed(d.bytes, start, &mut zmtp_msgs);
                    zmtp_desyncs = z.desyncs - before;
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
        self.stats.zmtp_desyncs += zmtp_desyncs;
        if zmtp_opened && self.zmtp_opened.len() < MAX_CAPTURE_CHANGES {
            self.zmtp_opened.push((tgid, d.fd));
        }
        let ts = d.hdr.ts_ns;
        for ev in http_events {
            self.on_http((tgid, d.fd), role, dir, ts, ev, out);
        }
        let (peer, local) = self
            .conns
            .get(&(tgid, d.fd))
            .map_or((None, None), |c| (c.peer, c.local));
        for m in zmtp_msgs {
            self.on_zmtp((tgid, peer, local), role, dir, ts, &m, out);
        }
    }

    fn on_http(
        &mut self,
        (tgid, fd): (u32, u32),
        role: Role,
        dir: usize,
        ts: u64,
        ev: HttpEvent,
        out: &mut Vec<LifecycleEvent>,
    ) {
        let max_pending = self.limits.max_pending;
        let losses = self.kernel_losses;
        let Some(conn) = self.conns.get_mut(&(tgid, fd)) else {
            return;
        };
        let requests =
            matches!(&conn.streams[dir].proto, Proto::Http(h) if h.side == Side::Requests);
        // Whoever writes the requests is the client, whoever writes the responses the server.
        let at = Endpoint {
            tgid,
            fd,
            role,
            client: requests == (dir == 1),
            peer: conn.peer,
            local: conn.local,
        };
        match ev {
            HttpEvent::RequestHead(head) => {
                if !conn.streamed && path_kind(&head.path) == PathKind::Metrics {
                    conn.streamed = true;
                    if self.metrics_conns.len() < MAX_CAPTURE_CHANGES {
                        self.metrics_conns.push((tgid, fd));
                    }
                }
                if conn.pending.len() >= max_pending {
                    conn.pending.pop_front();
                    self.stats.pending_dropped += 1;
                }
                conn.pending.push_back(Pending::new(head, ts, losses));
            }
            HttpEvent::ResponseHead(h) => {
                self.stats.answers_lost += drop_lost_answers(&mut conn.pending, losses);
                if let Some(p) = conn.pending.iter_mut().find(|p| p.status.is_none()) {
                    p.status = Some((h.status, ts));
                }
            }
            HttpEvent::End { body } if requests => self.request_ended(&at, &body, out),
            HttpEvent::BodyStarted { first } if !requests => {
                // Tokens are flowing: the oldest answered request whose body has not started.
                let Some(i) = conn
                    .pending
                    .iter()
                    .position(|p| p.status.is_some() && !p.work_emitted)
                else {
                    return;
                };
                conn.pending[i].work_emitted = true;
                let status = conn.pending[i].status.map(|s| s.0);
                let generate = path_kind(&conn.pending[i].head.path) == PathKind::Generate;
                // Only decode's output is reported (`response_event`), and a stage already
                // known stays: an answer that cannot be reported is not read.
                let reported = generate
                    && self
                        .answering_stage(&at, true)
                        .is_none_or(|s| s == Stage::Decode);
                // A body whose first event already ends the request (an abort, an error event:
                // SGLang streams a failed or refused request this way) carries no output.
                if reported
                    && status.is_some_and(|s| s < 400)
                    && !json_ids::first_event_ends(&first)
                {
                    self.answer(&at, i, Answer::new(Kind::Work, ts, status), out);
                }
            }
            HttpEvent::End { body } => self.response_ended(&at, ts, &body, out),
            HttpEvent::BodyStarted { .. } | HttpEvent::Desync => {}
        }
    }

    /// A request's body ended: its ids are known, so it and any answer that waited for them
    /// are emitted.
    fn request_ended(&mut self, at: &Endpoint, body: &BodyWindow, out: &mut Vec<LifecycleEvent>) {
        let Some(conn) = self.conns.get_mut(&(at.tgid, at.fd)) else {
            return;
        };
        let Some(i) = conn.pending.iter().position(|p| !p.ended) else {
            return;
        };
        let p = &mut conn.pending[i];
        p.ended = true;
        let (head, start) = (p.head.clone(), p.start_ns);
        let deferred = std::mem::take(&mut p.deferred);
        let done = p.done;
        let mut at = *at;
        let (ids, handoff) = self.vllm_request(
            &mut at,
            &head.path,
            head.request_id.as_deref(),
            body.request_ids(),
        );
        if let Some(conn) = self.conns.get_mut(&(at.tgid, at.fd)) {
            if done {
                conn.pending.remove(i);
            } else if let Some(p) = conn.pending.get_mut(i) {
                p.ids = ids.clone();
            }
        }
        // The requests prefill runs on each room this body names: a room's owners (see
        // `rooms`), judged where its destinations arrive.
        if at.role == Role::Prefill
            && !at.client
            && path_kind(&head.path) == PathKind::Generate
            && !ids.is_warmup()
        {
            for (room, requests) in ids.room_requests() {
                self.rooms.expect(room, requests, start);
            }
            self.stats.room_states_evicted = self.rooms.evicted;
        }
        let at = &at;
        self.request_event(at, &head, &ids, (start, body.len), handoff.as_ref(), out);
        for a in deferred {
            self.response_event(at, &head, &ids, a, out);
        }
    }

    /// A response ended: it answers the oldest request still waiting for one.
    fn response_ended(
        &mut self,
        at: &Endpoint,
        ts: u64,
        body: &BodyWindow,
        out: &mut Vec<LifecycleEvent>,
    ) {
        let Some(conn) = self.conns.get_mut(&(at.tgid, at.fd)) else {
            return;
        };
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
        // Known once the request's body ended (else the answer waits for it, and is read as
        // a batch's in case it is one).
        let p_batch = p.ids.is_batch();
        let Some((status, head_ts)) = p.status else {
            return;
        };
        let kind = path_kind(&p.head.path);
        let info = body.response_info();
        // What a vLLM answer names beyond the request itself: the transfer's name, capacity.
        let transfer_name = info
            .remote_request_id
            .as_ref()
            .and_then(|_| p.ids.rid.clone());
        let unnamed_answer = (kind == PathKind::Generate && transfer_name.is_none())
            .then(|| p.ids.rid.clone())
            .flatten();
        if kind == PathKind::ServerInfo && status < 400 {
            self.learn(at, info.disaggregation_mode.as_deref());
        }
        if status < 400 {
            if let Some(rid) = &unnamed_answer {
                self.issued_kv.forget_latest(rid);
            }
            self.vllm_answer(at, kind, transfer_name.as_deref(), (body, &info), ts, out);
        }
        // The answer's own message, else `fallback`.
        let reason = |fallback: String| {
            info.message
                .as_deref()
                .map_or(fallback, |m| truncate_reason(m).to_owned())
        };
        // A refusal comes as an error status, or, once a stream's 200 went out (SGLang answers
        // a streamed request before it validates it), as an error event or an abort with a
        // status inside the stream.
        let failed = if status >= 400 {
            Some((status, head_ts, format!("HTTP {status}")))
        } else if let Some(code) = info.stream_error {
            Some((code, ts, format!("stream error {code}")))
        } else if let Some(Finish::Abort { status: Some(code) }) =
            info.finish.filter(|_| status < 400)
            && code >= 400
        {
            Some((code, ts, format!("finish_reason abort {code}")))
        } else {
            None
        };
        let answer = if let Some((code, at_ns, fallback)) = failed {
            Answer {
                reason: Some(reason(fallback)),
                ..Answer::new(Kind::of_failure(code), at_ns, Some(code))
            }
        } else if matches!(info.finish, Some(Finish::Abort { .. })) {
            // Answered 200, but the request was aborted (SGLang answers an abort this way):
            // it ended, it did not complete.
            Answer {
                reason: Some(reason("finish_reason abort".to_owned())),
                tokens: info.prompt_tokens,
                ..Answer::new(Kind::Aborted, ts, Some(status))
            }
        } else {
            Answer {
                tokens: info.prompt_tokens,
                ..Answer::new(Kind::Completed, ts, Some(status))
            }
        };
        let batch = !ended || p_batch;
        let answer = Answer {
            subs: (status < 400 && batch).then(|| body.sub_outcomes()),
            ..answer
        };
        self.answer(at, i, answer, out);
        if ended && let Some(conn) = self.conns.get_mut(&(at.tgid, at.fd)) {
            conn.pending.remove(i);
        }
    }

    /// Emits an answer to pending request `i`, or parks it until that request's body (and so
    /// its ids) has been seen.
    fn answer(&mut self, at: &Endpoint, i: usize, a: Answer, out: &mut Vec<LifecycleEvent>) {
        let key = (at.tgid, at.fd);
        let Some(p) = self.conns.get(&key).and_then(|c| c.pending.get(i)) else {
            return;
        };
        // Read in place: every answer passes here, and its request's head and ids are only read.
        if p.ended {
            self.response_event(at, &p.head, &p.ids, a, out);
        } else if let Some(p) = self.conns.get_mut(&key).and_then(|c| c.pending.get_mut(i)) {
            p.deferred.push(a);
        }
    }
}
