//! The mapping from what crossed the wire to lifecycle events:
//! - router → worker `/generate` (or OpenAI endpoints): router `dispatched` (to = the worker's
//!   stage); worker inbound: `received`;
//! - worker response status >= 400: `rejected` with status and a truncated reason; 2xx end:
//!   `completed`, or `aborted` when the answer's final `finish_reason` is an abort (SGLang
//!   answers an aborted request 200); decode response bytes: decode `work`;
//! - decode → prefill bootstrap server `GET /route`: transfer `received` (the handshake);
//! - any other method on the bootstrap server's `/route` (`PUT /route`: a rank registering):
//!   transfer `received` reported by prefill with `peer` (member, foreign, unattributed: see
//!   [`Tracker::peer_of`]) and the writer's address as `worker`;
//! - ZMTP, SGLang's control channel (see [`transfer_step`]): `[BOOTSTRAP, room, ..]` transfer
//!   `received`, destinations transfer `admitted`, Success/Failed status transfer
//!   `completed`/`aborted`, `[ABORT, room]` transfer `cancelled`; vLLM's MooncakeConnector pull
//!   and answer the same for the request the legs' `transfer_id` names, its NIXL handshake only
//!   counted (see [`Tracker::vllm_transfer`]). The sender of a control message reports it; the
//!   receiver only when the sender's role is not watched on this node;
//! - vLLM legs (OpenAI paths whose body names no rid and no room): rid = vLLM's name of the
//!   engine's id of the request, `cmpl-<X-Request-Id>-0` (`chatcmpl-<X-Request-Id>` on chat), so
//!   both legs are one attempt; a body's `kv_transfer_params` (`do_remote_decode` /
//!   `do_remote_prefill`) gives the server its role when discovery left it unknown; a decode leg
//!   naming KV prefill did not issue to its request is marked (see [`super::vllm`]);
//! - vLLM `/v1/models` (`max_model_len`) and `/metrics` (`vllm:cache_config_info`) answers:
//!   a `capacity` report of that worker (context vs KV cache tokens), when a value changed;
//! - a connection closed with a request not yet answered: `router cancelled` (to = the leg's
//!   stage) when the router is the closing side watched here, else `cancelled` at the worker's
//!   stage;
//! - a `/server_info` (or `/get_server_info`) answer naming `disaggregation_mode` gives the
//!   server a role when discovery left it unknown (see [`Tracker::take_learned`]).
//!
//! When both ends of a connection are watched on this node, each event is emitted once, by the
//! end that owns it (requests/responses at the worker, dispatch at the router, transfer control
//! at decode).

use std::net::SocketAddr;

use super::rooms::{Judge, RoomAt, RoomMessage};
use super::{Answer, Endpoint, HandoffBreach, Proto, Tracker, Worker, canonical};
use crate::event::{
    BootstrapRoom, Kind, LifecycleEvent, Peer, ProtocolBreach, Source, Stage, truncate_reason,
};
use crate::ingest::ebpf::http::{RequestHead, Side};
use crate::ingest::ebpf::json_ids::{Finish, RequestIds, SubOutcome};
use crate::ingest::ebpf::procs::Role;
use crate::ingest::ebpf::zmtp::{self, Control, KvPoll, Sender};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PathKind {
    Generate,
    Route,
    ServerInfo,
    /// vLLM's model list (`max_model_len`).
    Models,
    /// Prometheus metrics (vLLM's `vllm:cache_config_info`).
    Metrics,
    Other,
}

pub(super) fn path_kind(path: &str) -> PathKind {
    match path {
        "/generate"
        | "/v1/completions"
        | "/v1/chat/completions"
        | "/v1/generate"
        | "/v1/responses" => PathKind::Generate,
        // SGLang's bootstrap server (`disaggregation/common/conn.py`): `/route` (`PUT` a rank
        // registering, `GET` decode's lookup) and `/register_dp_rank` (`POST`: a sender pins a
        // room's DP rank). `/query_dp_ranks` is a `POST` that only reads.
        p if p.starts_with("/route") || p == "/register_dp_rank" => PathKind::Route,
        "/server_info" | "/get_server_info" => PathKind::ServerInfo,
        "/v1/models" => PathKind::Models,
        "/metrics" => PathKind::Metrics,
        _ => PathKind::Other,
    }
}

/// Who a `/server_info` answer described.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Learned {
    /// A watched process answered it: that process.
    Process(u32),
    /// A watched process asked it: the server at that address (possibly on another node).
    Address(SocketAddr),
}

/// Role findings kept until the source takes them.
const MAX_LEARNED: usize = 1024;

impl Tracker {
    pub(super) fn event(
        &self,
        mono_ns: u64,
        stage: Stage,
        kind: Kind,
        tgid: u32,
    ) -> LifecycleEvent {
        let mut e = LifecycleEvent::new(self.clock.unix(mono_ns), stage, kind, Source::Ebpf);
        e.node = self.node.clone();
        e.pid = Some(tgid);
        e
    }

    pub(super) fn worker_of(&self, peer: Option<SocketAddr>) -> Option<Worker> {
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

    /// Who the peer of a connection this node accepted (on `local`, when known) is (see
    /// [`Peer`]): a watched process on this node when its socket is one of theirs and went to
    /// this end (a port is shared by connections to different destinations: another process's
    /// connection may use the port of a watched one's at the same time); foreign when it is on
    /// this node (loopback, or an address this node's watched sockets use) and none of theirs,
    /// which only the kernel's report of every watched connection can tell; across nodes, only
    /// an address that names the host of a known worker attributes it.
    pub(super) fn peer_of(&self, peer: Option<SocketAddr>, local: Option<SocketAddr>) -> Peer {
        let Some(p) = peer.map(canonical) else {
            return Peer::Unattributed;
        };
        if let Some(conns) = self.own.by_addr.get(&p)
            && local.is_none_or(|l| conns.iter().any(|(r, _)| super::arrived_at(*r, l)))
        {
            return Peer::Member;
        }
        let ip = p.ip();
        if ip.is_unspecified() {
            return Peer::Unattributed;
        }
        if ip.is_loopback() || self.own.local_ips.contains(&ip) {
            return if self.own.complete {
                Peer::Foreign
            } else {
                Peer::Unattributed
            };
        }
        if self.workers.keys().any(|w| canonical(*w).ip() == ip) {
            return Peer::Member;
        }
        Peer::Unattributed
    }

    /// A `/server_info` answer named the server's `disaggregation_mode`. The server is the
    /// process at this end (when it answered) or the peer (when this end asked). Only a role
    /// discovery left unknown is assigned: command lines and explicit rules win. An answer read
    /// from an address is always reported (with the role that holds for it), so that the source
    /// can find and watch a local server nobody named.
    pub(super) fn learn(&mut self, at: &Endpoint, mode: Option<&str>) {
        let Some(role) = mode.and_then(Role::from_disaggregation_mode) else {
            return;
        };
        let finding = if at.client {
            let Some(peer) = at.peer else { return };
            let known = self
                .worker_of(Some(peer))
                .map(|w| w.role)
                .filter(|r| *r != Role::Unknown);
            if known.is_none()
                && let Some(r) = role
            {
                self.add_worker(peer, r);
            }
            (Learned::Address(peer), known.or(role))
        } else {
            if self.role(at.tgid) != Some(Role::Unknown) {
                return;
            }
            if let Some(r) = role {
                self.set_role(at.tgid, r);
            }
            (Learned::Process(at.tgid), role)
        };
        // Bounded: the source takes these after every drain.
        if self.learned.len() < MAX_LEARNED {
            self.learned.push(finding);
        }
    }

    /// Pushes `e` once for each sub-request the request names (see
    /// [`RequestIds::sub_requests`]), with the request's ids; nothing for a warmup request,
    /// which never enters the disaggregated path.
    fn push_for_ids(
        &self,
        e: LifecycleEvent,
        head: &RequestHead,
        ids: &RequestIds,
        out: &mut Vec<LifecycleEvent>,
    ) {
        self.push_for_subs(e, head, ids, out, |_, _| true);
    }

    /// [`Self::push_for_ids`], each sub-request's copy first given to `adjust` with its index
    /// (skipped when it says false).
    fn push_for_subs(
        &self,
        mut e: LifecycleEvent,
        head: &RequestHead,
        ids: &RequestIds,
        out: &mut Vec<LifecycleEvent>,
        adjust: impl Fn(usize, &mut LifecycleEvent) -> bool,
    ) {
        if ids.is_warmup() {
            return;
        }
        if let Some(r) = &head.request_id {
            e = e.with_request_id(r.as_str());
        }
        if let Some(t) = head.traceparent.as_deref().and_then(trace_id_of) {
            e = e.with_trace_id(t);
        }
        for (i, (room, rid)) in ids.sub_requests().into_iter().enumerate() {
            let mut sub = e.clone();
            sub.ids.rid = rid.map(Into::into);
            sub.ids.bootstrap_room = room.map(BootstrapRoom);
            if adjust(i, &mut sub) {
                out.push(sub);
            }
        }
    }

    pub(super) fn request_event(
        &self,
        at: &Endpoint,
        head: &RequestHead,
        ids: &RequestIds,
        (start, body_len): (u64, u64),
        handoff: Option<&HandoffBreach>,
        out: &mut Vec<LifecycleEvent>,
    ) {
        let kind = path_kind(&head.path);
        let detail = format!("{} {} body_bytes={body_len}", head.method, head.path);
        let e = match (at.role, at.client, kind) {
            (Role::Router, true, PathKind::Generate) => {
                let mut e = self.event(start, Stage::Router, Kind::Dispatched, at.tgid);
                if let Some(s) = self.worker_of(at.peer).and_then(|w| w.role.stage()) {
                    e = e.with_to(s);
                }
                e
            }
            (Role::Prefill, false, PathKind::Generate) => {
                self.event(start, Stage::Prefill, Kind::Received, at.tgid)
            }
            (Role::Decode, false, PathKind::Generate) => {
                self.event(start, Stage::Decode, Kind::Received, at.tgid)
            }
            // A write to prefill's bootstrap server (`PUT /route`: a rank registering, or anyone
            // who reaches the port re-pointing where decode fetches KV): reported with who wrote
            // it; only the accepting end knows the connection came from outside.
            (Role::Prefill, false, PathKind::Route) if is_write(&head.method) => self
                .event(start, Stage::Transfer, Kind::Received, at.tgid)
                .with_peer(self.peer_of(at.peer, at.local)),
            // Decode asking prefill's bootstrap server where to fetch KV: the handshake.
            (Role::Decode, true, PathKind::Route) => {
                self.event(start, Stage::Transfer, Kind::Received, at.tgid)
            }
            (Role::Prefill, false, PathKind::Route) if !self.has_role(Role::Decode) => {
                self.event(start, Stage::Transfer, Kind::Received, at.tgid)
            }
            _ => return,
        };
        let mut e = e;
        e.detail = Some(truncate_reason(&detail).into());
        if let Some(p) = at.peer {
            e = e.with_worker(p.to_string());
        }
        // A decode leg that names KV prefill did not issue to it: marked once per node, on the
        // router's dispatch when the router is watched here, else on decode's receipt.
        if let Some(h) = handoff {
            let marks = match (at.role, at.client) {
                (Role::Router, true) => e.to == Some(Stage::Decode),
                (Role::Decode, false) => !self.has_role(Role::Router),
                _ => false,
            };
            if marks {
                e = e.with_protocol_breach(h.breach).with_reason(&h.reason);
            }
        }
        self.push_for_ids(e, head, ids, out);
    }

    /// The worker stage whose answers this end reports: a worker its own; the router those of
    /// workers it knows, but (`remote_only`) only of workers not watched on this node, which
    /// report themselves.
    pub(super) fn answering_stage(&self, at: &Endpoint, remote_only: bool) -> Option<Stage> {
        match (at.role, at.client) {
            (Role::Prefill | Role::Decode, false) => at.role.stage(),
            (Role::Router, true) => self
                .worker_of(at.peer)
                .filter(|w| !(remote_only && w.local))
                .and_then(|w| w.role.stage()),
            _ => None,
        }
    }

    pub(super) fn response_event(
        &self,
        at: &Endpoint,
        head: &RequestHead,
        ids: &RequestIds,
        a: Answer,
        out: &mut Vec<LifecycleEvent>,
    ) {
        if path_kind(&head.path) != PathKind::Generate {
            return;
        }
        let Some(stage) = self.answering_stage(at, true) else {
            return;
        };
        if a.kind == Kind::Work && stage != Stage::Decode {
            return;
        }
        let mut e = self.event(a.ts, stage, a.kind, at.tgid);
        e.status = a.status;
        if let Some(r) = &a.reason {
            e = e.with_reason(r);
        }
        if let Some(t) = a.tokens {
            e = e.with_input_tokens(t);
        }
        e.detail = Some(truncate_reason(&format!("{} {}", head.method, head.path)).into());
        if ids.is_batch() {
            // One answer for several requests: a stream starting says nothing of which of them
            // produced output, and each one's end is its own part of the body.
            if a.kind == Kind::Work {
                return;
            }
            if let Some(subs) = &a.subs {
                self.push_for_subs(e, head, ids, out, |i, sub| {
                    let Some((_, o)) = subs.iter().find(|(j, _)| *j == i) else {
                        return false;
                    };
                    let (kind, status) = sub_outcome(o, a.status);
                    sub.kind = kind;
                    sub.status = status;
                    true
                });
                return;
            }
        }
        self.push_for_ids(e, head, ids, out);
    }

    pub(super) fn on_zmtp(
        &mut self,
        (tgid, peer, local): (u32, Option<SocketAddr>, Option<SocketAddr>),
        role: Role,
        dir: usize,
        ts: u64,
        msg: &zmtp::Message,
        out: &mut Vec<LifecycleEvent>,
    ) {
        // The control channel joins a prefill and a decode: whoever wrote a message is this end
        // when it sent it, else the other kind of worker. vLLM's connector messages say who
        // sent them (its engine-core process serves no HTTP, so its role is often unknown).
        let by_role = match (role, dir) {
            (Role::Prefill, 1) | (Role::Decode, 0) => Some(Sender::Prefill),
            (Role::Decode, 1) | (Role::Prefill, 0) => Some(Sender::Decode),
            _ => None,
        };
        let read = match by_role {
            Some(sender) => zmtp::control(msg, sender).map(|c| (sender, c)),
            None => zmtp::vllm_control(msg),
        };
        let Some((sender, ctl)) = read else {
            if msg.damaged != 0 {
                self.stats.zmtp_damaged += 1;
            }
            return;
        };
        let sender_role = match sender {
            Sender::Prefill => Role::Prefill,
            Sender::Decode => Role::Decode,
        };
        if matches!(
            ctl,
            Control::NixlHandshake | Control::MooncakePull { .. } | Control::MooncakeStatus { .. }
        ) {
            // Reported by its sender; by its receiver only when neither the sending socket nor a
            // process of the sender's kind is watched on this node (vLLM's engine core, which
            // sends it, is a child of the watched API server).
            let report = dir == 1
                || (self.peer_of(peer, local) != Peer::Member && !self.has_role(sender_role));
            self.vllm_transfer(tgid, ts, ctl, report, out);
            return;
        }
        let breach = self.judge_room(tgid, role, dir, ts, &ctl);
        // Each message is reported once, by its sender; by its receiver only when the sender's
        // role is not watched here. A message that breaks its room's protocol is reported by
        // the end that judged it, even where the other end reports the message itself.
        if dir != 1 && self.has_role(sender_role) && breach.is_none() {
            return;
        }
        let Some(step) = transfer_step(ctl) else {
            return;
        };
        let mut e = self
            .event(ts, step.stage, step.kind, tgid)
            .with_room(step.room);
        e.detail = Some(format!("zmtp {}", step.what).into());
        if let Some(w) = step.worker {
            e = e.with_worker(w);
        }
        if let Some(b) = breach {
            e = e.with_protocol_breach(b);
        }
        out.push(e);
    }

    /// Notes a control message in its room's protocol at this end (see [`super::rooms`]) and returns
    /// the breach it makes, judged where the evidence is whole and reported once per node:
    /// - a surplus decode session: at prefill's receiving end, the only one that sees every
    ///   session a room's destinations come from;
    /// - destinations before readiness: at prefill's receiving end too, which sees the room's
    ///   `BOOTSTRAP`, its own readiness and the destinations, and only when it holds a connection
    ///   to the destinations' decode endpoint it read from its start (else its readiness may
    ///   have left on a connection that predates the capture);
    /// - repeated readiness: at decode's receiving end (a forged one reaches only decode), and
    ///   at prefill's sending end when no decode is watched on this node.
    fn judge_room(
        &mut self,
        tgid: u32,
        role: Role,
        dir: usize,
        ts: u64,
        ctl: &Control,
    ) -> Option<ProtocolBreach> {
        let (room, msg, endpoint) = match ctl {
            Control::Bootstrap { room } => (*room, RoomMessage::Bootstrap, None),
            Control::Destinations {
                room,
                session,
                required,
                endpoint,
                ..
            } => (
                *room,
                RoomMessage::Destinations {
                    session: session.as_deref(),
                    required: *required,
                },
                endpoint.as_deref(),
            ),
            Control::Status { room, status, .. } => match status {
                KvPoll::WaitingForInput => (*room, RoomMessage::Readiness, None),
                KvPoll::Success | KvPoll::Failed => (*room, RoomMessage::Concluded, None),
                KvPoll::Bootstrapping | KvPoll::Transferring => return None,
            },
            // Decode withdrew: SGLang fails the room at prefill and sends nothing more for it.
            Control::Abort { room } => (*room, RoomMessage::Concluded, None),
            _ => return None,
        };
        let receiving = dir == 0;
        let judge = match role {
            Role::Prefill => Judge {
                owners: receiving,
                order: receiving,
                readiness: !receiving && !self.has_role(Role::Decode),
            },
            Role::Decode => Judge {
                readiness: receiving,
                ..Judge::default()
            },
            _ => return None,
        };
        let loss = self.stats.zmtp_desyncs
            + self.stats.zmtp_damaged
            + self.stats.conns_evicted
            + self.kernel_losses;
        let conns = &self.conns;
        let visible = || {
            let Some(to) = endpoint.and_then(|e| e.parse::<SocketAddr>().ok()) else {
                return false;
            };
            let to = canonical(to);
            conns.iter().any(|((t, _), c)| {
                *t == tgid
                    && c.peer.map(canonical) == Some(to)
                    && matches!(c.streams[1].proto, Proto::Zmtp(_))
            })
        };
        let at = RoomAt {
            tgid,
            room,
            now_ns: ts,
            loss,
        };
        let breach = self.rooms.note(at, msg, judge, visible);
        self.stats.room_states_evicted = self.rooms.evicted;
        breach
    }

    pub(super) fn close(&mut self, tgid: u32, fd: u32, ts: u64, out: &mut Vec<LifecycleEvent>) {
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
        let at = Endpoint {
            tgid,
            fd,
            role,
            client: matches!(&conn.streams[1].proto, Proto::Http(h) if h.side == Side::Requests),
            peer: conn.peer,
            local: conn.local,
        };
        for p in conn.pending.drain(..) {
            if p.status.is_some() || path_kind(&p.head.path) != PathKind::Generate {
                continue;
            }
            // The router giving up is its own evidence, even towards a worker watched here. It
            // is the router's act (`router cancelled`, to the leg's stage), not the leg's end:
            // a worker that ignores it keeps the leg open, and says so itself.
            let Some(stage) = self.answering_stage(&at, false) else {
                continue;
            };
            let e = if role == Role::Router {
                self.event(ts, Stage::Router, Kind::Cancelled, tgid)
                    .with_to(stage)
            } else {
                self.event(ts, stage, Kind::Cancelled, tgid)
            };
            let mut e = e.with_reason("connection closed before a response");
            if let Some(peer) = conn.peer {
                e = e.with_worker(peer.to_string());
            }
            self.push_for_ids(e, &p.head, &p.ids, out);
        }
    }
}

/// A request that may change what the server holds: any method but `GET` and `HEAD`.
fn is_write(method: &str) -> bool {
    !["GET", "HEAD"]
        .iter()
        .any(|m| m.eq_ignore_ascii_case(method))
}

/// The trace id of a W3C `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`).
pub fn trace_id_of(tp: &str) -> Option<&str> {
    let mut it = tp.split('-');
    let _version = it.next()?;
    let id = it.next()?;
    (id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())).then_some(id)
}

/// What one control message means for its attempt.
struct TransferStep {
    stage: Stage,
    kind: Kind,
    room: u64,
    what: std::borrow::Cow<'static, str>,
    /// The decode rank address a destinations message names.
    worker: Option<String>,
}

/// The lifecycle meaning of each control message (docs/ebpf.md has the table, with SGLang's
/// source for each row):
/// - `BOOTSTRAP` (decode asks before it reserves anything): the transfer leg arriving, in
///   flight;
/// - destinations (decode reserved KV pages for the room and says where to write them):
///   transfer `admitted`;
/// - prefill's Success status (the room's KV landed in decode's pages): transfer `completed`;
///   Failed: transfer `aborted`; readiness (`prefill_complete`: prefill prefilled the room):
///   prefill `work`;
/// - `ABORT` (decode withdrew): transfer `cancelled`; `ABORT_ACK` (prefill's writes for it
///   drained): prefill `cancelled`;
/// - `AUX_DATA`, `CHUNK_READY` (bytes of the room's KV moved): transfer `work`; `STAGING_REQ`
///   (prefill holds a sender and computes the room): prefill `admitted`.
///
/// vLLM's connector messages are read in [`Tracker::vllm_transfer`].
fn transfer_step(ctl: Control) -> Option<TransferStep> {
    let step = |stage, kind, room, what: &'static str| TransferStep {
        stage,
        kind,
        room,
        what: what.into(),
        worker: None,
    };
    Some(match ctl {
        Control::Bootstrap { room } => step(Stage::Transfer, Kind::Received, room, "BOOTSTRAP"),
        Control::Destinations {
            room,
            backend,
            endpoint,
            ..
        } => TransferStep {
            stage: Stage::Transfer,
            kind: Kind::Admitted,
            room,
            what: format!("destinations ({})", backend.as_str()).into(),
            worker: endpoint,
        },
        Control::Status { room, status, .. } => {
            let key = room;
            match status {
                KvPoll::Success => step(Stage::Transfer, Kind::Completed, key, "status Success"),
                KvPoll::Failed => step(Stage::Transfer, Kind::Aborted, key, "status Failed"),
                KvPoll::WaitingForInput => step(Stage::Prefill, Kind::Work, key, "readiness"),
                KvPoll::Bootstrapping | KvPoll::Transferring => return None,
            }
        }
        Control::Abort { room } => step(Stage::Transfer, Kind::Cancelled, room, "ABORT"),
        Control::AbortAck { room } => step(Stage::Prefill, Kind::Cancelled, room, "ABORT_ACK"),
        Control::KvMoved { room, what } => step(Stage::Transfer, Kind::Work, room, what),
        Control::StagingRequest { room } => {
            step(Stage::Prefill, Kind::Admitted, room, "STAGING_REQ")
        }
        Control::NixlHandshake | Control::MooncakePull { .. } | Control::MooncakeStatus { .. } => {
            return None;
        }
    })
}

/// How one request of a batch ended, from its own part of a successful answer.
fn sub_outcome(o: &SubOutcome, status: Option<u16>) -> (Kind, Option<u16>) {
    match (o.stream_error, o.finish) {
        (Some(code), _) | (_, Some(Finish::Abort { status: Some(code) })) if code >= 400 => {
            (Kind::of_failure(code), Some(code))
        }
        (_, Some(Finish::Abort { .. })) => (Kind::Aborted, status),
        _ => (Kind::Completed, status),
    }
}
