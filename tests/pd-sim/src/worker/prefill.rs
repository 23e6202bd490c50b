//! Prefill: intake, the sender of each admitted room (bootstrap, forward, transfer, status),
//! what it reads on its rank port, and the sweeper of rooms nobody owns.
//!
//! State per room mirrors SGLang's prefill KV manager: `request_status` (`update_status`,
//! `disaggregation/common/conn.py:653`: only Bootstrapping or WaitingForInput may create a room,
//! Failed is terminal, otherwise the status only grows), `transfer_infos` (decode's destinations,
//! stored by the bootstrap thread whether or not a sender exists, `mooncake/conn.py:3020`), and
//! under `prefill_complete` the `DeferredBootstrap` table (`common/bootstrap.py`).

use super::api::{Ctx, Parsed, Sub};
use super::render::{self, DONE, Refusal, SubAnswer};
use super::trace::ReqTrace;
use super::*;
use crate::fault::{Fault, Holder};
use crate::kvlink::{AtPrefill, Destinations, Registration, parse_at_prefill};
use crate::te::{Block, MAX_BLOCK};
use tokio::sync::Notify;

/// Bytes of one metadata (aux) slot, written after a room's KV (`send_aux`,
/// `mooncake/conn.py:1780`).
pub(super) const AUX_ITEM_LEN: u64 = 64;

/// One room as prefill's KV manager holds it.
pub(super) struct PrefillRoom {
    /// `request_status[room]` (`None`: absent, as after `clear()`).
    status: Option<KvPoll>,
    /// `transfer_infos[room]`: decode's destinations (one decode rank: required 1).
    dest: Option<Destinations>,
    /// The sender that owns the room, if any.
    owner: Option<u64>,
    wake: Arc<Notify>,
    /// `failure_records[room]`.
    failure: Option<String>,
    /// `DeferredBootstrap` (`prefill_complete`): decode's endpoint, readiness.
    endpoint: Option<SocketAddr>,
    ready: bool,
    ready_notified: bool,
    failed: bool,
    /// When an unowned entry (orphan destinations, a tombstone) may go.
    expires: Instant,
    /// ABORTs whose acknowledgement waits for the room's transfer to drain.
    ack_targets: Vec<(SocketAddr, u64)>,
    /// Transfers of the room in flight (`_staging_outstanding`).
    outstanding: u32,
    orphan_counted: bool,
}

impl PrefillRoom {
    fn new(ttl: Duration) -> Self {
        PrefillRoom {
            status: None,
            dest: None,
            owner: None,
            wake: Arc::new(Notify::new()),
            failure: None,
            endpoint: None,
            ready: false,
            ready_notified: false,
            failed: false,
            expires: Instant::now() + ttl,
            ack_targets: Vec::new(),
            outstanding: 0,
            orphan_counted: false,
        }
    }

    /// `DeferredBootstrap._notification` (`common/bootstrap.py:48`): `Some((endpoint, failed))`.
    fn notification(&mut self) -> Option<(SocketAddr, bool)> {
        let ep = self.endpoint?;
        if self.failed {
            return Some((ep, true));
        }
        if self.ready && !self.ready_notified {
            // One readiness message per transfer.
            self.ready_notified = true;
            return Some((ep, false));
        }
        None
    }
}

#[derive(Default)]
pub(super) struct PrefillTable {
    rooms: HashMap<u64, PrefillRoom>,
    /// Decode registrations by Mooncake session id (`decode_kv_args_table`).
    sessions: HashMap<String, Registration>,
}

impl PrefillTable {
    pub(super) fn len(&self) -> usize {
        self.rooms.len()
    }
}

/// A control message to send once the table's lock is released.
enum Note {
    Status(SocketAddr, u64, KvPoll),
    AbortAck(SocketAddr, u64, u64),
}

/// Where a sender failed: SGLang names it in the abort message.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Stage {
    /// Before the transfer was finalized (`handle_bootstrap_failure`, `prefill.py:1352`).
    Bootstrap,
    /// During or after it (`handle_inflight_transfer_failure`, `prefill.py:1282`).
    Transfer,
}

enum Sent {
    Transferred {
        start_ns: u64,
        end_ns: u64,
    },
    Failed {
        stage: Stage,
        reason: String,
        timed_out: bool,
    },
    /// `--fault success-after-abort`: part of the KV went, then the room failed.
    BrokeMidway {
        start_ns: u64,
        end_ns: u64,
        reason: String,
    },
}

/// How one sender behaves (faults, stubs).
#[derive(Clone, Copy, Default)]
struct SenderOpts {
    /// Tokens whose KV it sends (a stub sends one).
    tokens: u64,
    /// Overrides the bootstrap timeout (`stranded-kv`, prefill holds).
    hold: Option<Duration>,
    /// `success-after-abort`.
    abort_midway: bool,
}

impl Worker {
    fn orphan_ttl(&self) -> Duration {
        // SGLang's DeferredBootstrap keeps unowned entries for the waiting plus the bootstrap
        // timeout (`common/conn.py:427`); early-policy orphans it never frees.
        self.args.waiting_timeout() + self.args.bootstrap_timeout()
    }

    /// `update_status` (`common/conn.py:653`), with its `prefill_complete` notification.
    fn p_update(&self, t: &mut PrefillTable, room: u64, s: KvPoll, notes: &mut Vec<Note>) {
        let ttl = self.orphan_ttl();
        let policy = self.policy;
        let e = match t.rooms.get_mut(&room) {
            Some(e) => e,
            None if matches!(s, KvPoll::Bootstrapping | KvPoll::WaitingForInput) => {
                t.rooms.entry(room).or_insert_with(|| PrefillRoom::new(ttl))
            }
            None => return,
        };
        match e.status {
            None => {
                if matches!(s, KvPoll::Bootstrapping | KvPoll::WaitingForInput) {
                    e.status = Some(s);
                }
            }
            Some(_) if s == KvPoll::Failed => {
                e.status = Some(KvPoll::Failed);
                if policy == AllocationPolicy::PrefillComplete && !e.failed {
                    e.failed = true;
                    if let Some((ep, failed)) = e.notification() {
                        notes.push(Note::Status(
                            ep,
                            room,
                            if failed {
                                KvPoll::Failed
                            } else {
                                KvPoll::WaitingForInput
                            },
                        ));
                    }
                }
            }
            Some(KvPoll::Failed) => {}
            Some(cur) => e.status = Some(cur.max(s)),
        }
        e.wake.notify_waiters();
    }

    /// Send what the lock's holder decided.
    async fn p_send(&self, notes: Vec<Note>) {
        for n in notes {
            match n {
                Note::Status(to, room, s) => {
                    self.pushers
                        .send(
                            to,
                            &crate::kvlink::status_frames(room, s, crate::kvlink::PREFILL_RANK),
                        )
                        .await;
                    self.stats.statuses.fetch_add(1, Ordering::Relaxed);
                    let now = now_ns();
                    self.record(room, |r| {
                        r.statuses_sent.push(s as u8);
                        if s == KvPoll::Success {
                            r.success_ns = now;
                        }
                    });
                }
                Note::AbortAck(to, room, g) => {
                    self.pushers
                        .send(
                            to,
                            &crate::kvlink::abort_ack_frames(room, crate::kvlink::PREFILL_RANK, g),
                        )
                        .await;
                    self.stats.abort_acks.fetch_add(1, Ordering::Relaxed);
                    self.record(room, |r| r.abort_acks_sent += 1);
                }
            }
        }
    }

    /// `_maybe_ack_drained_abort` (`common/conn.py:1044`): once nothing of the room is in
    /// flight, acknowledge every ABORT waiting for it.
    fn p_maybe_ack(t: &mut PrefillTable, room: u64, notes: &mut Vec<Note>) {
        if let Some(e) = t.rooms.get_mut(&room)
            && e.outstanding == 0
        {
            for (to, g) in e.ack_targets.drain(..) {
                notes.push(Note::AbortAck(to, room, g));
            }
        }
    }

    /// What prefill's rank port receives (`mooncake/conn.py:2960`).
    pub(super) fn on_prefill_message(self: &Arc<Self>, parts: Vec<Bytes>) {
        let msg = parse_at_prefill(&parts);
        let now = now_ns();
        let mut notes = Vec::new();
        match msg {
            AtPrefill::Registration(r) => {
                self.stats.registrations.fetch_add(1, Ordering::Relaxed);
                let mut t = self.prefill.lock().expect("prefill lock");
                t.sessions.insert(r.session_id.clone(), r);
            }
            AtPrefill::Destinations(d) => {
                self.stats.destinations.fetch_add(1, Ordering::Relaxed);
                let room = d.room;
                self.record(room, |r| {
                    r.destinations_received += 1;
                    if r.bootstrap_ns == 0 {
                        r.bootstrap_ns = now;
                    }
                    if r.destinations_ns == 0 {
                        r.destinations_ns = now;
                    }
                });
                let ttl = self.orphan_ttl();
                let mut t = self.prefill.lock().expect("prefill lock");
                let required = d.required_dst_info_num;
                let e = t.rooms.entry(room).or_insert_with(|| PrefillRoom::new(ttl));
                e.dest = Some(d);
                if e.owner.is_none() && !e.orphan_counted {
                    e.orphan_counted = true;
                    self.stats
                        .orphan_destinations
                        .fetch_add(1, Ordering::Relaxed);
                }
                // One destination per room here: `len(transfer_infos[room]) == required`.
                if required <= 1 {
                    self.p_update(&mut t, room, KvPoll::WaitingForInput, &mut notes);
                }
            }
            AtPrefill::Bootstrap { room, ip, port } => {
                self.stats.bootstrap_frames.fetch_add(1, Ordering::Relaxed);
                self.record(room, |r| {
                    r.bootstrap_received += 1;
                    if r.bootstrap_ns == 0 {
                        r.bootstrap_ns = now;
                    }
                });
                let Ok(ip) = ip.parse::<IpAddr>() else {
                    self.stats.malformed_frames.fetch_add(1, Ordering::Relaxed);
                    return;
                };
                if self.policy != AllocationPolicy::PrefillComplete {
                    // Only `_handle_bootstrap_message` takes BOOTSTRAP; an `early` prefill's
                    // bootstrap thread would index frame 7 of it and fail.
                    self.stats.unexpected_frames.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                let ep = SocketAddr::new(ip, port);
                let ttl = self.orphan_ttl();
                let mut t = self.prefill.lock().expect("prefill lock");
                let e = t.rooms.entry(room).or_insert_with(|| PrefillRoom::new(ttl));
                // `DeferredBootstrap.register` (`common/bootstrap.py:68`).
                match e.endpoint {
                    Some(cur) if cur != ep => {
                        // A room is one request: a second endpoint is refused, the first kept.
                        notes.push(Note::Status(ep, room, KvPoll::Failed));
                    }
                    _ => {
                        e.endpoint = Some(ep);
                        if let Some((to, failed)) = e.notification() {
                            notes.push(Note::Status(
                                to,
                                room,
                                if failed {
                                    KvPoll::Failed
                                } else {
                                    KvPoll::WaitingForInput
                                },
                            ));
                        }
                    }
                }
                e.wake.notify_waiters();
            }
            AtPrefill::Abort {
                room,
                endpoint,
                generation,
            } => {
                self.stats.abort_frames.fetch_add(1, Ordering::Relaxed);
                self.record(room, |r| {
                    r.aborts_received += 1;
                    r.abort_generation = generation;
                });
                let target = endpoint.and_then(|(ip, port)| {
                    ip.parse::<IpAddr>()
                        .ok()
                        .map(|ip| SocketAddr::new(ip, port))
                });
                let ttl = self.orphan_ttl();
                let mut t = self.prefill.lock().expect("prefill lock");
                if self.policy == AllocationPolicy::PrefillComplete {
                    // `_handle_bootstrap_message` (`common/conn.py:695`): the cancellation is
                    // kept even when it beats the sender (a tombstone).
                    let e = t.rooms.entry(room).or_insert_with(|| PrefillRoom::new(ttl));
                    if !e.failed {
                        e.failed = true;
                        if let Some((to, _)) = e.notification() {
                            notes.push(Note::Status(to, room, KvPoll::Failed));
                        }
                    }
                }
                // `_handle_deferred_abort_notification` (`mooncake/conn.py:2903`).
                let active = t
                    .rooms
                    .get(&room)
                    .and_then(|e| e.status)
                    .is_some_and(|s| s != KvPoll::Success);
                if active {
                    self.p_update(&mut t, room, KvPoll::Failed, &mut notes);
                }
                if let (Some(to), Some(g)) = (target, generation) {
                    match t.rooms.get_mut(&room) {
                        Some(e) => {
                            e.ack_targets.retain(|(a, _)| *a != to);
                            e.ack_targets.push((to, g));
                            Self::p_maybe_ack(&mut t, room, &mut notes);
                        }
                        // Nothing of the room in flight: acknowledge at once.
                        None => notes.push(Note::AbortAck(to, room, g)),
                    }
                }
            }
            AtPrefill::Malformed(why) => {
                tracing::debug!(why, "malformed control message");
                self.stats.malformed_frames.fetch_add(1, Ordering::Relaxed);
            }
        }
        if !notes.is_empty() {
            let w = self.clone();
            tokio::spawn(async move { w.p_send(notes).await });
        }
    }

    /// `request_status[room]` as a waiting sender sees it: terminal or WaitingForInput stops
    /// the wait; an absent room is Failed (`common/conn.py:2353`).
    fn p_poll(&self, room: u64) -> Result<KvPoll, Arc<Notify>> {
        let t = self.prefill.lock().expect("prefill lock");
        match t.rooms.get(&room) {
            None => Ok(KvPoll::Failed),
            Some(e) => match e.status {
                None => Ok(KvPoll::Failed),
                Some(s @ (KvPoll::WaitingForInput | KvPoll::Failed | KvPoll::Success)) => Ok(s),
                Some(_) => Err(e.wake.clone()),
            },
        }
    }

    /// Wait for decode's destinations (WaitingForInput), a failure, or `until`.
    async fn p_wait(&self, room: u64, until: tokio::time::Instant) -> Option<KvPoll> {
        loop {
            let wake = match self.p_poll(room) {
                Ok(s) => return Some(s),
                Err(w) => w,
            };
            let notified = wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Ok(s) = self.p_poll(room) {
                return Some(s);
            }
            if tokio::time::timeout_at(until, notified).await.is_err() {
                return None;
            }
        }
    }

    fn p_fail(&self, room: u64, reason: String) -> Vec<Note> {
        let mut notes = Vec::new();
        let mut t = self.prefill.lock().expect("prefill lock");
        if let Some(e) = t.rooms.get_mut(&room) {
            e.failure.get_or_insert(reason);
        }
        self.p_update(&mut t, room, KvPoll::Failed, &mut notes);
        notes
    }

    /// `clear()` (`common/conn.py:2409`): the room leaves `request_status` and
    /// `transfer_infos`; under `prefill_complete` a Success goes out now, and a failed room
    /// stays as a tombstone.
    fn p_clear(&self, room: u64, id: u64) -> Vec<Note> {
        let mut notes = Vec::new();
        let ttl = self.orphan_ttl();
        let mut t = self.prefill.lock().expect("prefill lock");
        let Some(e) = t.rooms.get_mut(&room) else {
            return notes;
        };
        if e.owner != Some(id) {
            // Another sender took the room over (`early`); leave it be.
            return notes;
        }
        let success = e.status == Some(KvPoll::Success);
        if self.policy == AllocationPolicy::PrefillComplete {
            if success && !e.failed {
                if let Some(ep) = e.endpoint {
                    notes.push(Note::Status(ep, room, KvPoll::Success));
                }
                t.rooms.remove(&room);
                return notes;
            }
            let already = e.failed;
            e.failed = true;
            if !already && let Some((to, _)) = e.notification() {
                notes.push(Note::Status(to, room, KvPoll::Failed));
            }
            e.owner = None;
            e.status = None;
            e.dest = None;
            e.expires = Instant::now() + ttl;
            e.wake.notify_waiters();
            Self::p_maybe_ack(&mut t, room, &mut notes);
            return notes;
        }
        Self::p_maybe_ack(&mut t, room, &mut notes);
        let e = t.rooms.remove(&room).expect("present");
        e.wake.notify_waiters();
        notes
    }

    /// The transfer blocks of a room: its KV pages (per KV buffer, contiguous runs, at most
    /// Mooncake's block size each) then its metadata slot.
    fn blocks(reg: &Registration, d: &Destinations, tokens: u64) -> Vec<Block> {
        let mut out = Vec::new();
        let item = reg.kv_item_len.max(1);
        let pages: Vec<u64> = d
            .kv_indices
            .iter()
            .take(tokens as usize)
            .map(|&i| i.max(0) as u64)
            .collect();
        for &ptr in &reg.kv_ptrs {
            let mut i = 0;
            while i < pages.len() {
                let start = pages[i];
                let mut run = 1;
                while i + run < pages.len() && pages[i + run] == start + run as u64 {
                    run += 1;
                }
                let mut addr = ptr + start * item;
                let mut left = run as u64 * item;
                while left > 0 {
                    let len = left.min(MAX_BLOCK);
                    out.push(Block { addr, len });
                    addr += len;
                    left -= len;
                }
                i += run;
            }
        }
        if let (Some(&aux), Some(idx)) = (reg.aux_ptrs.first(), d.aux_index) {
            out.push(Block {
                addr: aux + AUX_ITEM_LEN * idx,
                len: AUX_ITEM_LEN,
            });
        }
        out
    }

    /// Write the room's KV to decode's transfer engine and conclude (`transfer_worker`,
    /// `mooncake/conn.py:2488`): the status goes to decode (`early`), or waits for `clear()`
    /// (`prefill_complete`, Success only).
    async fn p_transfer(&self, room: u64, opts: SenderOpts) -> Sent {
        let start_ns = now_ns();
        let mut notes = Vec::new();
        let taken = {
            let mut t = self.prefill.lock().expect("prefill lock");
            match t.rooms.get_mut(&room) {
                None => Err("Failed due to an unknown reason from another rank".to_string()),
                Some(e) if e.status == Some(KvPoll::Failed) || e.dest.is_none() => {
                    // A room that already failed skips its chunks (no status).
                    let reason = e.failure.clone().unwrap_or_else(|| {
                        "Failed due to an unknown reason from another rank".into()
                    });
                    Self::p_maybe_ack(&mut t, room, &mut notes);
                    Err(reason)
                }
                Some(e) => {
                    e.outstanding += 1;
                    let dest = e.dest.clone().expect("checked");
                    let reg = t.sessions.get(&dest.session_id).cloned();
                    Ok((dest, reg))
                }
            }
        };
        let (dest, reg) = match taken {
            Ok(x) => x,
            Err(reason) => {
                self.p_send(notes).await;
                return Sent::Failed {
                    stage: Stage::Transfer,
                    reason,
                    timed_out: false,
                };
            }
        };
        let to_decode = dest
            .ip
            .parse::<IpAddr>()
            .ok()
            .map(|ip| SocketAddr::new(ip, dest.port));
        let (ok, bytes, reason) = match (&reg, dest.session_id.parse::<SocketAddr>()) {
            (Some(reg), Ok(te)) => {
                let mut blocks = Self::blocks(reg, &dest, opts.tokens.max(1));
                if opts.abort_midway {
                    blocks.truncate(blocks.len().div_ceil(2).max(1));
                }
                let bytes: u64 = blocks.iter().map(|b| b.len).sum();
                let ok = self.te.write(te, &blocks).await;
                (
                    ok && !opts.abort_midway,
                    if ok { bytes } else { 0 },
                    if opts.abort_midway {
                        format!("Request {room} aborted during KV transfer: KVTransferError")
                    } else {
                        format!(
                            "Failed to send kv chunk of {room} to {}:{}",
                            dest.ip, dest.port
                        )
                    },
                )
            }
            _ => (
                false,
                0,
                format!(
                    "Decode instance could be dead, remote mooncake session {} is not alive",
                    dest.session_id
                ),
            ),
        };
        let end_ns = now_ns();
        self.stats.kv_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.record(room, |r| r.kv_bytes_sent += bytes);
        let result = {
            let mut t = self.prefill.lock().expect("prefill lock");
            if let Some(e) = t.rooms.get_mut(&room) {
                e.outstanding = e.outstanding.saturating_sub(1);
            }
            let (status, failure) = match t.rooms.get_mut(&room) {
                // `conclude_transfer` on a cleared room emits nothing.
                None => (None, None),
                Some(e) if !ok => {
                    let f = e.failure.get_or_insert(reason.clone()).clone();
                    (Some(KvPoll::Failed), Some(f))
                }
                Some(e) if e.status == Some(KvPoll::Failed) || e.failure.is_some() => {
                    let f = e
                        .failure
                        .get_or_insert_with(|| {
                            "Room marked Failed before the transfer ended".into()
                        })
                        .clone();
                    (Some(KvPoll::Failed), Some(f))
                }
                Some(_) => (Some(KvPoll::Success), None),
            };
            if let Some(s) = status {
                self.p_update(&mut t, room, s, &mut notes);
                let to_status = s == KvPoll::Failed || self.policy == AllocationPolicy::Early;
                if to_status && let Some(to) = to_decode {
                    notes.push(Note::Status(to, room, s));
                }
            }
            Self::p_maybe_ack(&mut t, room, &mut notes);
            match (status, failure) {
                (Some(KvPoll::Success), _) => Sent::Transferred { start_ns, end_ns },
                (_, f) if opts.abort_midway => Sent::BrokeMidway {
                    start_ns,
                    end_ns,
                    reason: f.unwrap_or(reason),
                },
                (_, f) => Sent::Failed {
                    stage: Stage::Transfer,
                    reason: f.unwrap_or(reason),
                    timed_out: false,
                },
            }
        };
        if matches!(result, Sent::Transferred { .. }) {
            self.stats.kv_transfers.fetch_add(1, Ordering::Relaxed);
        } else {
            self.stats
                .kv_transfers_failed
                .fetch_add(1, Ordering::Relaxed);
        }
        self.p_send(notes).await;
        result
    }

    /// One sender's life on `room` (`CommonKVSender`, `common/conn.py:2109`) up to its
    /// transfer's conclusion; the caller clears it. `guard` owns the room meanwhile.
    async fn run_sender(&self, room: u64, id: u64, opts: SenderOpts) -> Sent {
        let opened = tokio::time::Instant::now();
        let timeout = opts.hold.unwrap_or_else(|| self.args.bootstrap_timeout());
        // Open: the room becomes Bootstrapping (or keeps what decode already published).
        let mut notes = Vec::new();
        let refused = {
            let mut t = self.prefill.lock().expect("prefill lock");
            let ttl = self.orphan_ttl();
            let e = t.rooms.entry(room).or_insert_with(|| PrefillRoom::new(ttl));
            let refused =
                self.policy == AllocationPolicy::PrefillComplete && (e.owner.is_some() || e.failed);
            if refused {
                // `DeferredBootstrap.open` refused it (`common/conn.py:2144`).
                e.failure
                    .get_or_insert_with(|| "Duplicate or cancelled bootstrap room".into());
            } else {
                e.owner = Some(id);
                e.expires = Instant::now() + Duration::from_secs(365 * 24 * 3600);
            }
            self.p_update(&mut t, room, KvPoll::Bootstrapping, &mut notes);
            if refused {
                self.p_update(&mut t, room, KvPoll::Failed, &mut notes);
            }
            refused
        };
        self.p_send(notes).await;
        if refused {
            return Sent::Failed {
                stage: Stage::Bootstrap,
                reason: "Duplicate or cancelled bootstrap room".into(),
                timed_out: false,
            };
        }
        let forward = Duration::from_micros(self.args.prefill_delay_us);
        let until = match self.policy {
            AllocationPolicy::Early => opened + timeout,
            AllocationPolicy::PrefillComplete => {
                // Prefill runs its forward before bootstrap completes, then tells decode it is
                // ready (`mark_prefill_complete`, `common/conn.py:2208`).
                if !forward.is_zero() {
                    tokio::time::sleep(forward).await;
                }
                let mut notes = Vec::new();
                {
                    let mut t = self.prefill.lock().expect("prefill lock");
                    if let Some(e) = t.rooms.get_mut(&room)
                        && e.owner == Some(id)
                        && !e.failed
                    {
                        e.ready = true;
                        if let Some((to, failed)) = e.notification() {
                            notes.push(Note::Status(
                                to,
                                room,
                                if failed {
                                    KvPoll::Failed
                                } else {
                                    KvPoll::WaitingForInput
                                },
                            ));
                        }
                    }
                }
                self.p_send(notes).await;
                tokio::time::Instant::now() + timeout
            }
        };
        match self.p_wait(room, until).await {
            Some(KvPoll::WaitingForInput) => {}
            Some(KvPoll::Success) => {}
            Some(_) => {
                let reason = self
                    .prefill
                    .lock()
                    .expect("prefill lock")
                    .rooms
                    .get(&room)
                    .and_then(|e| e.failure.clone())
                    .unwrap_or_else(|| "Failed due to an unknown reason from another rank".into());
                return Sent::Failed {
                    stage: Stage::Bootstrap,
                    reason,
                    timed_out: false,
                };
            }
            None => {
                // `_check_bootstrap_timeout` (`common/conn.py:2385`).
                self.stats
                    .bootstrap_timeouts
                    .fetch_add(1, Ordering::Relaxed);
                let elapsed = opened.elapsed().as_secs_f64();
                let reason =
                    format!("Request {room} timed out after {elapsed:.1}s in KVPoll.Bootstrapping");
                let notes = self.p_fail(room, reason.clone());
                self.p_send(notes).await;
                return Sent::Failed {
                    stage: Stage::Bootstrap,
                    reason,
                    timed_out: true,
                };
            }
        }
        if self.policy == AllocationPolicy::Early && !forward.is_zero() {
            tokio::time::sleep(forward).await;
        }
        self.p_transfer(room, opts).await
    }

    /// `sender.abort()` (`common/conn.py:2458`): the room fails; decode hears of it only under
    /// `prefill_complete`.
    async fn abort_sender(&self, room: u64, reason: &str) {
        let notes = self.p_fail(room, reason.to_string());
        self.p_send(notes).await;
    }
}

/// Clears a sender's room however its request ends (an HTTP leg dropped mid-way included:
/// then the room is aborted first, as SGLang's AbortReq does).
struct SenderGuard {
    w: Shared,
    room: u64,
    id: u64,
    /// The request went away before its sender concluded.
    armed: bool,
}

impl SenderGuard {
    fn new(w: &Shared, room: u64, id: u64) -> Self {
        SenderGuard {
            w: w.clone(),
            room,
            id,
            armed: true,
        }
    }
}

impl Drop for SenderGuard {
    fn drop(&mut self) {
        let (w, room, id, armed) = (self.w.clone(), self.room, self.id, self.armed);
        if armed {
            w.stats.cancelled.fetch_add(1, Ordering::Relaxed);
            let now = now_ns();
            w.record(room, |r| {
                r.outcome = "cancelled";
                r.ended_ns = now;
            });
        }
        let mut notes = if armed {
            w.p_fail(room, "Aborted by AbortReq.".into())
        } else {
            Vec::new()
        };
        notes.extend(w.p_clear(room, id));
        if !notes.is_empty() {
            tokio::spawn(async move { w.p_send(notes).await });
        }
    }
}

/// Late spans for a refused room that is transferred anyway.
struct LateTrace {
    trace_id: [u8; 16],
    root: [u8; 8],
}

pub(super) async fn sweeper(w: Shared) {
    let mut tick = tokio::time::interval(Duration::from_millis(1000));
    loop {
        tick.tick().await;
        let now = Instant::now();
        let mut t = w.prefill.lock().expect("prefill lock");
        t.rooms
            .retain(|_, e| e.owner.is_some() || e.outstanding > 0 || e.expires > now);
    }
}

/// How a sub-request of an admitted body ends, with what its spans need.
struct SubEnd {
    answer: SubAnswer,
    outcome: &'static str,
    /// The error its scheduler span reports.
    err: Option<String>,
    xfer: Option<(u64, u64)>,
    t_sched: u64,
    t_boot: u64,
    trace: ReqTrace,
}

impl Worker {
    /// One sub-request after the request passed the tokenizer and queue checks.
    async fn prefill_sub(self: &Arc<Self>, sub: &Sub, fake: bool, trace: ReqTrace) -> SubEnd {
        let t_sched = now_ns();
        let end = |answer: SubAnswer,
                   outcome: &'static str,
                   err: Option<String>,
                   xfer: Option<(u64, u64)>,
                   trace: ReqTrace| SubEnd {
            answer,
            outcome,
            err,
            xfer,
            t_sched,
            t_boot: now_ns(),
            trace,
        };
        let answer = |abort: Option<Refusal>, completion: u64| SubAnswer {
            index: sub.index,
            rid: sub.rid.clone(),
            input_tokens: sub.input_tokens,
            completion_tokens: completion,
            abort,
            length: 0,
        };
        let faults = &self.args.faults;
        let room = sub.room.filter(|_| !fake);
        if let Some(refusal) = self.scheduler_check(sub.input_tokens, &sub.rid) {
            self.stats.rejected_400.fetch_add(1, Ordering::Relaxed);
            let err = Some(refusal.message.clone());
            let Some(room) = room else {
                return end(answer(Some(refusal), 0), "rejected", err, None, trace);
            };
            if faults.hits(Fault::StubIntake) {
                // SGLang ≤ 0.5.20: the refused request keeps a one-token stub and goes through
                // bootstrap, forward and transfer before its abort is answered.
                let id = self.next_id();
                let mut guard = SenderGuard::new(self, room, id);
                let opts = SenderOpts {
                    tokens: 1,
                    ..Default::default()
                };
                let sent = self.run_sender(room, id, opts).await;
                guard.armed = false;
                drop(guard);
                self.injected(room, Fault::StubIntake);
                let xfer = match sent {
                    Sent::Transferred { start_ns, end_ns } => Some((start_ns, end_ns)),
                    _ => None,
                };
                return end(
                    answer(Some(refusal), 0),
                    Fault::StubIntake.outcome(),
                    err,
                    xfer,
                    trace,
                );
            }
            if self.args.transfer_after_reject {
                self.transfer_after_reject(
                    room,
                    sub.input_tokens,
                    LateTrace {
                        trace_id: trace.trace_id,
                        root: trace.root,
                    },
                );
            }
            return end(answer(Some(refusal), 0), "rejected", err, None, trace);
        }
        self.stats.admitted.fetch_add(1, Ordering::Relaxed);
        let Some(room) = room else {
            // No room, or SGLang's fake transfer: prefill finishes without decode.
            if self.args.prefill_delay_us > 0 {
                tokio::time::sleep(Duration::from_micros(self.args.prefill_delay_us)).await;
            }
            return end(answer(None, 1), "transferred", None, None, trace);
        };
        if faults.hits(Fault::ForeignRoutePut) {
            self.foreign_route_put(room);
        }
        let stranded = faults.stranded_holder(Some(room));
        let id = self.next_id();
        let mut guard = SenderGuard::new(self, room, id);
        if stranded == Some(Holder::Decode) {
            // `--fault stranded-kv`, decode holds: prefill aborts the room at once and says so;
            // under `early` decode is told nothing and keeps waiting for the KV.
            self.open_sender(room, id).await;
            self.abort_sender(room, "Aborted by AbortReq.").await;
            guard.armed = false;
            drop(guard);
            let msg = format!(
                "Request {} aborted: KV sender failed for bootstrap_room={room}",
                sub.rid
            );
            return end(
                answer(Some(Refusal::graceful(msg.clone())), 0),
                "aborted",
                Some(msg),
                None,
                trace,
            );
        }
        let opts = SenderOpts {
            tokens: sub.input_tokens,
            hold: (stranded == Some(Holder::Prefill))
                .then(|| Duration::from_millis(faults.fault_hold_ms)),
            abort_midway: stranded.is_none() && faults.hits(Fault::SuccessAfterAbort),
        };
        let sent = self.run_sender(room, id, opts).await;
        guard.armed = false;
        drop(guard);
        match sent {
            Sent::Transferred { start_ns, end_ns } => end(
                answer(None, 1),
                "transferred",
                None,
                Some((start_ns, end_ns)),
                trace,
            ),
            Sent::BrokeMidway {
                start_ns,
                end_ns,
                reason,
            } => {
                // The breach: prefill's spans report the abort, its answer a normal finish.
                self.injected(room, Fault::SuccessAfterAbort);
                let err = format!(
                    "Request {} aborted during KV transfer for bootstrap_room={room}: {reason}",
                    sub.rid
                );
                end(
                    answer(None, 1),
                    Fault::SuccessAfterAbort.outcome(),
                    Some(err),
                    Some((start_ns, end_ns)),
                    trace,
                )
            }
            Sent::Failed {
                stage,
                reason,
                timed_out,
            } => {
                let what = match stage {
                    Stage::Bootstrap => "bootstrap",
                    Stage::Transfer => "transfer",
                };
                let msg = format!(
                    "Prefill {what} failed for request rank=0 req.rid='{}' req.bootstrap_room={room} with exception KVTransferError(bootstrap_room={room}): {reason}",
                    sub.rid
                );
                let outcome = if timed_out && stranded == Some(Holder::Prefill) {
                    self.injected(room, Fault::StrandedKv);
                    Fault::StrandedKv.outcome()
                } else if timed_out {
                    "bootstrap-timeout"
                } else {
                    "aborted"
                };
                end(
                    answer(Some(Refusal::abort(500, msg.clone())), 0),
                    outcome,
                    Some(msg),
                    None,
                    trace,
                )
            }
        }
    }

    /// Open a sender on `room` and nothing else (a sender about to be aborted).
    async fn open_sender(&self, room: u64, id: u64) {
        let mut notes = Vec::new();
        {
            let mut t = self.prefill.lock().expect("prefill lock");
            let ttl = self.orphan_ttl();
            let e = t.rooms.entry(room).or_insert_with(|| PrefillRoom::new(ttl));
            if e.owner.is_none() && !e.failed {
                e.owner = Some(id);
            }
            self.p_update(&mut t, room, KvPoll::Bootstrapping, &mut notes);
        }
        self.p_send(notes).await;
    }

    /// `--transfer-after-reject`: a refused room's sender is kept all the same; it waits for
    /// decode's destinations, moves the KV and sends Success. Its spans come late, under the
    /// refused request's (already ended) root.
    fn transfer_after_reject(self: &Arc<Self>, room: u64, tokens: u64, late: LateTrace) {
        let w = self.clone();
        tokio::spawn(async move {
            let id = w.next_id();
            let mut guard = SenderGuard::new(&w, room, id);
            let opts = SenderOpts {
                tokens,
                ..Default::default()
            };
            let sent = w.run_sender(room, id, opts).await;
            guard.armed = false;
            drop(guard);
            if let Sent::Transferred { start_ns, end_ns } = sent {
                w.stats
                    .kv_transfers_after_reject
                    .fetch_add(1, Ordering::Relaxed);
                w.record(room, |r| r.outcome = "rejected-transferred");
                let mut t = ReqTrace {
                    on: w.spans.enabled(),
                    trace_id: late.trace_id,
                    parent: None,
                    root: late.root,
                    spans: Vec::new(),
                    input_tokens: 0,
                };
                let th = t.thread(&w, true, start_ns, end_ns, None);
                t.stage(th, "prefill_transfer_kv_cache", start_ns, end_ns);
                w.spans.emit(t.spans);
            }
        });
    }

    /// A prefill sub-request ended: its room record and spans. `in_band`: its answer's status
    /// line already went out (a stream, or pd-sim's admission signal), errors ride in the body.
    fn finish_prefill_sub(&self, sub: &Sub, end: SubEnd, in_band: bool, t0: u64, t_tok: u64) {
        let t_end = now_ns();
        if let Some(room) = sub.room {
            let err = end.answer.abort.as_ref().map(|r| r.status).unwrap_or(0);
            let outcome = end.outcome;
            self.record(room, |r| {
                (r.status, r.error_code) = match (in_band, err) {
                    (true, e) => (200, e),
                    (false, 0) => (200, 0),
                    (false, e) => (e, 0),
                };
                if r.answered_ns == 0 {
                    r.answered_ns = if err >= 400 && !in_band {
                        t_end
                    } else {
                        end.t_sched
                    };
                }
                r.ended_ns = t_end;
                // An outcome a fault or a late transfer set wins over the request's own.
                if !r.outcome.starts_with("injected-") && r.outcome != "rejected-transferred" {
                    r.outcome = outcome;
                }
            });
        }
        let mut trace = end.trace;
        let th = trace.thread(self, false, t0, t_tok, None);
        trace.stage(th, "tokenize", t0, t_tok);
        trace.stage(th, "api_server_dispatch", t_tok, t_tok);
        let th = trace.thread(self, true, end.t_sched, t_end, end.err.as_deref());
        trace.stage(th, "prefill_prepare", end.t_sched, end.t_sched);
        trace.stage(th, "prefill_bootstrap", end.t_sched, end.t_boot);
        if let Some((s, e)) = end.xfer {
            trace.stage(th, "prefill_forward", end.t_sched, s);
            trace.stage(th, "prefill_transfer_kv_cache", s, e);
        }
        trace.finish(self, &sub.rid, sub.room, t0, t_end);
    }
}

const ADMISSION_HEADER: &str = "x-pd-sim-admission";

fn with_admission(mut r: Response, admitted: bool, on: bool) -> Response {
    if on {
        r.headers_mut().insert(
            ADMISSION_HEADER,
            axum::http::HeaderValue::from_static(if admitted { "admitted" } else { "refused" }),
        );
    }
    r
}

/// Prefill's `/generate` and OpenAI routes.
pub(super) async fn serve(w: Shared, p: Parsed, ctx: Ctx) -> Response {
    let t_tok = now_ns();
    let early = w.args.status_at_admission;
    let fake = p.fake_transfer();
    // The tokenizer refuses the whole body; then pd-sim's queue check.
    let refusal = p
        .subs
        .iter()
        .find_map(|s| w.tokenizer_check(s.input_tokens))
        .map(|m| (m, true))
        .or_else(|| w.queue_check().map(|m| (m, false)));
    if let Some((msg, tokenizer)) = refusal {
        let resp = if tokenizer {
            w.stats.rejected_400.fetch_add(1, Ordering::Relaxed);
            render::tokenizer_refusal(&p, &msg)
        } else {
            w.stats.rejected_503.fetch_add(1, Ordering::Relaxed);
            render::error_answer(p.api, &Refusal::abort(503, msg.clone()))
        };
        let t_end = now_ns();
        let status = resp.status().as_u16();
        for sub in p.subs.iter() {
            let mut trace = ReqTrace::new(w.spans.enabled(), ctx.tp);
            trace.input_tokens = sub.input_tokens;
            let th = trace.thread(&w, false, ctx.t0, t_end, Some(&msg));
            trace.stage(th, "tokenize", ctx.t0, t_tok);
            let late = LateTrace {
                trace_id: trace.trace_id,
                root: trace.root,
            };
            trace.finish(&w, &sub.rid, sub.room, ctx.t0, t_end);
            if let Some(room) = sub.room {
                w.record(room, |r| {
                    r.rid = sub.rid.clone();
                    r.request_id = ctx.request_id.clone();
                    r.status = status;
                    r.error_code = if status == 200 { 400 } else { 0 };
                    r.input_tokens = sub.input_tokens;
                    r.outcome = "rejected";
                    r.received_ns = ctx.t0;
                    r.answered_ns = t_end;
                    r.ended_ns = t_end;
                });
                if w.args.transfer_after_reject && !fake {
                    w.transfer_after_reject(room, sub.input_tokens, late);
                }
            }
        }
        return with_admission(resp, false, early);
    }
    for sub in p.subs.iter() {
        if let Some(room) = sub.room {
            w.record(room, |r| {
                r.rid = sub.rid.clone();
                r.request_id = ctx.request_id.clone();
                r.input_tokens = sub.input_tokens;
                r.received_ns = ctx.t0;
            });
        }
    }
    // The verdict a sequential router waits for: the first sub-request's scheduler check.
    let first_refused = p
        .subs
        .first()
        .and_then(|s| w.scheduler_check(s.input_tokens, &s.rid))
        .is_some();
    let in_band = p.stream || (early && !first_refused);
    w.inflight.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = mpsc::channel::<SubAnswer>(p.subs.len().max(1));
    let p = Arc::new(p);
    let (t0, tp) = (ctx.t0, ctx.tp);
    // Every prompt's group of sub-requests runs at once; the sub-requests of one prompt's
    // parallel sampling one after the other (SGLang runs the samples concurrently on their one
    // room, see README).
    let driver = {
        let (w, p) = (w.clone(), p.clone());
        async move {
            let _inflight = InflightGuard(&w.inflight);
            let runs = p.groups().into_iter().map(|g| {
                let (w, tx) = (w.clone(), tx.clone());
                async move {
                    for sub in g {
                        let mut trace = ReqTrace::new(w.spans.enabled(), tp);
                        trace.input_tokens = sub.input_tokens;
                        let end = w.prefill_sub(&sub, fake, trace).await;
                        let answer = end.answer.clone();
                        w.finish_prefill_sub(&sub, end, in_band, t0, t_tok);
                        // A refused prefix request fails the whole request (it raises before
                        // any sample is sent, `tokenizer_manager.py:2151`).
                        let refused_prefix =
                            sub.prefix && answer.abort.as_ref().is_some_and(|r| r.status >= 400);
                        if !sub.prefix || refused_prefix {
                            let _ = tx.send(answer).await;
                        }
                        if refused_prefix {
                            break;
                        }
                    }
                }
            });
            futures_util::future::join_all(runs).await;
        }
    };
    let model = w.args.model_path.clone();
    if p.stream {
        // SGLang's StreamingResponse answers 200 at once; each sub-request's one chunk comes
        // when its transfer is over.
        let (btx, brx) = mpsc::channel::<Result<Bytes, Infallible>>(16);
        let w3 = w.clone();
        tokio::spawn(async move {
            let (mut rx, drive) = (rx, driver);
            tokio::pin!(drive);
            let mut driving = true;
            loop {
                tokio::select! {
                    _ = &mut drive, if driving => driving = false,
                    a = rx.recv() => match a {
                        Some(a) if a.index == usize::MAX => {
                            let msg = a.abort.map(|r| r.message).unwrap_or_default();
                            let _ = btx.send(Ok(render::stream_error(&p, &msg))).await;
                            break;
                        }
                        Some(a) => {
                            if btx.send(Ok(render::chunk(&p, &model, &a, "", "", true))).await.is_err() {
                                return;
                            }
                        }
                        None => break,
                    },
                }
            }
            let _ = btx.send(Ok(Bytes::from_static(DONE))).await;
            w3.stats.completed.fetch_add(1, Ordering::Relaxed);
        });
        let body =
            futures_util::stream::unfold(
                brx,
                |mut rx| async move { rx.recv().await.map(|x| (x, rx)) },
            );
        let resp = Response::builder()
            .status(200)
            .header("content-type", "text/event-stream")
            .header("cache-control", "no-cache")
            .body(Body::from_stream(body))
            .expect("static response parts");
        return with_admission(resp, !first_refused, early);
    }
    let collect = {
        let (p, w) = (p.clone(), w.clone());
        async move {
            let (_, mut answers) = tokio::join!(driver, async move {
                let mut rx = rx;
                let mut v = Vec::new();
                while let Some(a) = rx.recv().await {
                    v.push(a);
                }
                v
            });
            answers.sort_by_key(|a| a.index);
            w.stats.completed.fetch_add(1, Ordering::Relaxed);
            let secs = (now_ns() - t0) as f64 / 1e9;
            if let Some(a) = answers.iter().find(|a| a.index == usize::MAX) {
                let msg = a
                    .abort
                    .as_ref()
                    .map(|r| r.message.clone())
                    .unwrap_or_default();
                return render::tokenizer_refusal(&p, &msg);
            }
            render::final_answer(&p, &model, &answers, secs)
        }
    };
    if early && !first_refused {
        // pd-sim's admission signal: the status line now, the body when the transfer is over.
        let body = futures_util::stream::once(async move {
            let r = collect.await;
            Ok::<Bytes, Infallible>(
                http_body_util::BodyExt::collect(r.into_body())
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default(),
            )
        });
        let resp = Response::builder()
            .status(200)
            .header("content-type", "application/json")
            .body(Body::from_stream(body))
            .expect("static response parts");
        return with_admission(resp, true, true);
    }
    with_admission(collect.await, !first_refused, early)
}
