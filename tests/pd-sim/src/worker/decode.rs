//! Decode: the receiver of each room (lookup, allocation, destinations, the wait for prefill's
//! status), generation, and what a client going away does (`ABORT`).
//!
//! State per room mirrors SGLang's decode KV manager: `request_status` (created Bootstrapping,
//! `disaggregation/common/conn.py:2510`; a status for a room it does not hold is dropped,
//! `:934`), the room's KV pages and metadata slot (so that bytes the transfer engine writes can
//! be told apart by address, as RDMA writes land in the room's pages).

use std::collections::BTreeMap;

use super::api::{Ctx, Parsed, Sub};
use super::prefill::AUX_ITEM_LEN;
use super::render::{self, DONE, Refusal, SubAnswer, WORDS};
use super::trace::ReqTrace;
use super::*;
use crate::fault::{Fault, Holder};
use crate::kvlink::{AtDecode, Destinations, abort_frames, bootstrap_frames, parse_at_decode};
use crate::te::Block;
use tokio::sync::{Notify, watch};

/// Fake addresses of decode's two KV buffers (K and V of its one layer) and its metadata
/// buffer, as its registration announces them.
const KV_BASES: [u64; 2] = [0x7f00_0000_0000, 0x7f40_0000_0000];
const AUX_BASE: u64 = 0x7f80_0000_0000;
/// Metadata slots (`req_to_metadata_buffer_idx_allocator`).
const AUX_SLOTS: u64 = 4096;
/// How long an ended room's pages stay its own.
const PAGE_GRACE: Duration = Duration::from_secs(5);
/// Pages decode hands out (page size 1). More than a real pool, so that pd-sim, which never
/// makes a request wait for KV space, does not have to hand out pages still in use: the
/// destinations' indices stay apart, and the bytes landing in them are the room's.
const PAGES: u64 = 1 << 24;

pub(super) struct DecodeRoom {
    status: KvPoll,
    wake: Arc<Notify>,
    failure: Option<String>,
}

pub(super) struct DecodeTable {
    rooms: HashMap<u64, DecodeRoom>,
    pub(super) kv_ptrs: [u64; 2],
    pub(super) aux_ptr: u64,
    /// Pages it hands out ([`PAGES`], or more).
    pool: u64,
    cursor: u64,
    /// First page → (pages, room).
    pages: BTreeMap<u64, (u64, u64)>,
    /// When rooms that ended did (their pages stay theirs for a while: see `allocate`).
    ended: HashMap<u64, Instant>,
    allocations: u64,
    aux_next: u64,
    aux_owner: HashMap<u64, u64>,
    /// Bytes per token of one KV buffer, once known.
    item_len: u64,
}

impl DecodeTable {
    pub(super) fn new(pool: u64) -> Self {
        DecodeTable {
            rooms: HashMap::new(),
            kv_ptrs: KV_BASES,
            aux_ptr: AUX_BASE,
            pool: pool.max(PAGES),
            cursor: 0,
            pages: BTreeMap::new(),
            ended: HashMap::new(),
            allocations: 0,
            aux_next: 0,
            aux_owner: HashMap::new(),
            item_len: 0,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.rooms.len()
    }

    /// Bytes per token of each of the two KV buffers.
    pub(super) fn kv_item_len(&mut self, kv_bytes_per_token: u64) -> u64 {
        self.item_len = (kv_bytes_per_token / 2).max(1);
        self.item_len
    }

    /// Contiguous pages for `n` tokens and a metadata slot, owned by `room`. Pages of a room
    /// still receiving, or that ended less than [`PAGE_GRACE`] ago, are not handed out again
    /// (unless every page is: pd-sim never refuses, it overlaps then). The grace is for bytes
    /// the transfer engine delivers after the status (another socket, no ordering between
    /// them): they still count as the room's.
    fn allocate(&mut self, room: u64, n: u64) -> (u64, u64) {
        let n = n.clamp(1, self.pool);
        let mut walked = 0u64;
        let start = loop {
            if self.cursor + n > self.pool {
                walked += self.pool - self.cursor;
                self.cursor = 0;
            }
            let start = self.cursor;
            // Ranges never overlap: the ones this one covers start inside it, or just before.
            let mut covered: Vec<u64> = self
                .pages
                .range(start..start + n)
                .map(|(s, _)| *s)
                .collect();
            if let Some((s, (len, _))) = self.pages.range(..start).next_back()
                && s + len > start
            {
                covered.push(*s);
            }
            let now = Instant::now();
            let busy = covered
                .iter()
                .filter(|s| {
                    let r = self.pages[s].1;
                    self.rooms.contains_key(&r)
                        || self
                            .ended
                            .get(&r)
                            .is_some_and(|t| now.duration_since(*t) < PAGE_GRACE)
                })
                .map(|s| s + self.pages[s].0)
                .max();
            match busy {
                Some(end) if walked < self.pool => {
                    walked += end - self.cursor;
                    self.cursor = end;
                }
                _ => {
                    for s in covered {
                        if let Some((_, r)) = self.pages.remove(&s) {
                            self.ended.remove(&r);
                        }
                    }
                    break start;
                }
            }
        };
        self.cursor = start + n;
        self.pages.insert(start, (n, room));
        self.allocations += 1;
        if self.allocations.is_multiple_of(4096) {
            // Forget rooms long over, so the tables stay as small as what is in use.
            let now = Instant::now();
            let (rooms, ended) = (&self.rooms, &mut self.ended);
            ended.retain(|_, t| now.duration_since(*t) < 2 * PAGE_GRACE);
            self.pages
                .retain(|_, (_, r)| rooms.contains_key(r) || ended.contains_key(r));
        }
        let aux = self.aux_next % AUX_SLOTS;
        self.aux_next += 1;
        self.aux_owner.insert(aux, room);
        (start, aux)
    }

    /// The room whose pages (or metadata slot) `addr` falls in.
    fn owner_of(&self, addr: u64) -> Option<u64> {
        let item = self.item_len.max(1);
        for base in self.kv_ptrs {
            if addr >= base && addr < base + self.pool * item {
                let page = (addr - base) / item;
                let (start, (len, room)) = self.pages.range(..=page).next_back()?;
                return (page < start + len).then_some(*room);
            }
        }
        if addr >= self.aux_ptr && addr < self.aux_ptr + AUX_SLOTS * AUX_ITEM_LEN {
            return self
                .aux_owner
                .get(&((addr - self.aux_ptr) / AUX_ITEM_LEN))
                .copied();
        }
        None
    }
}

/// How far a receiver got, for the ABORT it owes if its request goes away.
#[derive(Default)]
struct Progress {
    /// Prefill's rank port, once the lookup succeeded (SGLang's `bootstrap_infos`).
    peer: Option<SocketAddr>,
    /// Destinations published, or readiness observed (`init_time` set).
    armed: bool,
    abort_sent: bool,
    t_dests: u64,
}

enum Received {
    Success {
        t_kv: u64,
    },
    /// The KV never came: `handshake` before destinations (SGLang's "Decode handshake failed"),
    /// otherwise "Decode transfer failed".
    Failed {
        handshake: bool,
        reason: String,
        timed_out: bool,
    },
}

impl Worker {
    /// `update_status` on decode's side (same rules as prefill's).
    fn d_update(&self, room: u64, s: KvPoll) {
        let mut t = self.decode.lock().expect("decode lock");
        if let Some(e) = t.rooms.get_mut(&room) {
            e.status = match (e.status, s) {
                (KvPoll::Failed, _) => KvPoll::Failed,
                (_, KvPoll::Failed) => KvPoll::Failed,
                (cur, s) => cur.max(s),
            };
            e.wake.notify_waiters();
        }
    }

    /// What decode's rank port receives (`mooncake/conn.py:3043`).
    pub(super) fn on_decode_message(self: &Arc<Self>, parts: Vec<Bytes>) {
        let now = now_ns();
        match parse_at_decode(&parts) {
            AtDecode::Status { room, status, .. } => {
                self.stats.statuses.fetch_add(1, Ordering::Relaxed);
                self.record(room, |r| {
                    r.statuses_received.push(status.clamp(0, 255) as u8);
                    if status == KvPoll::Success as i64 && r.success_ns == 0 {
                        r.success_ns = now;
                    }
                });
                // `apply_prefill_status` (`common/conn.py:921`).
                let mut t = self.decode.lock().expect("decode lock");
                let Some(e) = t.rooms.get_mut(&room) else {
                    self.stats
                        .statuses_unmatched
                        .fetch_add(1, Ordering::Relaxed);
                    return;
                };
                let next = match KvPoll::from_i64(status) {
                    Some(KvPoll::WaitingForInput)
                        if self.policy == AllocationPolicy::PrefillComplete =>
                    {
                        Some(KvPoll::WaitingForInput)
                    }
                    Some(KvPoll::Success) => Some(KvPoll::Success),
                    Some(KvPoll::Failed) => {
                        e.failure.get_or_insert_with(|| {
                            "Failed to get kvcache from prefill instance, it might be dead".into()
                        });
                        Some(KvPoll::Failed)
                    }
                    _ => None,
                };
                if let Some(s) = next {
                    e.status = match (e.status, s) {
                        (KvPoll::Failed, _) | (_, KvPoll::Failed) => KvPoll::Failed,
                        (cur, s) => cur.max(s),
                    };
                    e.wake.notify_waiters();
                }
            }
            AtDecode::AbortAck { room, .. } => {
                self.stats.abort_acks.fetch_add(1, Ordering::Relaxed);
                self.record(room, |r| r.abort_acks_received += 1);
            }
            AtDecode::Other(kind) => {
                tracing::debug!(kind, "control message pd-sim does not use");
                self.stats.unexpected_frames.fetch_add(1, Ordering::Relaxed);
            }
            AtDecode::Malformed(why) => {
                tracing::debug!(why, "malformed control message");
                self.stats.malformed_frames.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// A transfer engine block landed: whose pages it went to.
    pub(super) fn on_te_block(&self, b: Block) {
        let owner = self.decode.lock().expect("decode lock").owner_of(b.addr);
        match owner {
            Some(room) => {
                self.stats.kv_bytes.fetch_add(b.len, Ordering::Relaxed);
                self.record(room, |r| r.kv_bytes_received += b.len);
            }
            None => {
                self.stats
                    .kv_bytes_unattributed
                    .fetch_add(b.len, Ordering::Relaxed);
            }
        }
    }

    fn d_poll(&self, room: u64, done: &[KvPoll]) -> Result<KvPoll, Arc<Notify>> {
        let t = self.decode.lock().expect("decode lock");
        match t.rooms.get(&room) {
            None => Ok(KvPoll::Failed),
            Some(e) if done.contains(&e.status) || e.status == KvPoll::Failed => Ok(e.status),
            Some(e) => Err(e.wake.clone()),
        }
    }

    async fn d_wait(
        &self,
        room: u64,
        done: &[KvPoll],
        until: tokio::time::Instant,
    ) -> Option<KvPoll> {
        loop {
            let wake = match self.d_poll(room, done) {
                Ok(s) => return Some(s),
                Err(w) => w,
            };
            let notified = wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Ok(s) = self.d_poll(room, done) {
                return Some(s);
            }
            if tokio::time::timeout_at(until, notified).await.is_err() {
                return None;
            }
        }
    }

    fn d_failure(&self, room: u64) -> Option<String> {
        self.decode
            .lock()
            .expect("decode lock")
            .rooms
            .get(&room)
            .and_then(|e| e.failure.clone())
    }

    /// `_send_abort_notification` (`common/conn.py:2977`): once per receiver, to prefill's rank,
    /// with a generation only when armed (destinations published or readiness seen).
    async fn send_abort(&self, room: u64, prog: &Mutex<Progress>, force_arm: bool) {
        let (peer, armed) = {
            let mut p = prog.lock().expect("progress lock");
            if p.abort_sent {
                return;
            }
            let Some(peer) = p.peer else {
                return;
            };
            p.abort_sent = true;
            (peer, p.armed || force_arm)
        };
        let generation = armed.then(|| self.abort_generation.fetch_add(1, Ordering::Relaxed) + 1);
        let ip = self.kv_addr.ip().to_string();
        self.pushers
            .send(
                peer,
                &abort_frames(room, &ip, self.advertised_rank().port(), generation),
            )
            .await;
        self.stats.abort_frames.fetch_add(1, Ordering::Relaxed);
        self.record(room, |r| {
            r.aborts_sent += 1;
            r.abort_generation = generation;
        });
    }

    /// `--fault unknown-room`: destinations for a room no router created, sent straight to
    /// prefill's rank port (as a client talking to it directly would). Recorded as
    /// `injected-unknown-room`.
    async fn inject_unknown_room(&self, peer: SocketAddr) {
        let room = crate::ids::new_room();
        let (start, aux) = self.decode.lock().expect("decode lock").allocate(room, 1);
        let d = Destinations {
            room,
            ip: self.kv_addr.ip().to_string(),
            port: self.advertised_rank().port(),
            session_id: self.session_id(),
            kv_indices: vec![start as i32],
            aux_index: Some(aux),
            required_dst_info_num: 1,
            decode_prefix_len: 0,
        };
        self.pushers.send(peer, &d.frames()).await;
        self.stats.destinations.fetch_add(1, Ordering::Relaxed);
        let now = now_ns();
        self.record(room, |r| {
            r.destinations_sent += 1;
            r.bootstrap_ns = now;
            r.destinations_ns = now;
        });
        self.injected(room, Fault::UnknownRoom);
    }

    /// One receiver's life on `room` (`CommonKVReceiver`, `common/conn.py:2471`) up to the
    /// KV's arrival or failure. `prog` tells the caller what an abort owes.
    async fn receive(
        &self,
        sub: &Sub,
        room: u64,
        prefill: &(String, u16),
        prog: &Mutex<Progress>,
        hold: Option<Duration>,
    ) -> Received {
        let failed = |reason: String, handshake: bool| Received::Failed {
            handshake,
            reason,
            timed_out: false,
        };
        {
            let mut t = self.decode.lock().expect("decode lock");
            if self.policy == AllocationPolicy::PrefillComplete && t.rooms.contains_key(&room) {
                return failed("Duplicate decode bootstrap room".into(), true);
            }
            t.rooms.insert(
                room,
                DecodeRoom {
                    status: KvPoll::Bootstrapping,
                    wake: Arc::new(Notify::new()),
                    failure: None,
                },
            );
        }
        let peer = match self.prefill_peer(&prefill.0, prefill.1).await {
            Ok(p) => p,
            Err(e) => {
                return failed(
                    format!(
                        "Could not fetch prefill parallel info from bootstrap_addr: {}:{}: {e}",
                        prefill.0, prefill.1
                    ),
                    true,
                );
            }
        };
        if peer.policy != self.policy.as_str() {
            return failed(
                format!(
                    "Disaggregation decode allocation policy mismatch: prefill={}, decode={}. Set --disaggregation-decode-allocation-policy identically on both roles.",
                    peer.policy,
                    self.policy.as_str()
                ),
                true,
            );
        }
        prog.lock().expect("progress lock").peer = Some(peer.rank);
        let waiting = hold.unwrap_or_else(|| self.args.waiting_timeout());
        if self.policy == AllocationPolicy::PrefillComplete {
            let ip = self.kv_addr.ip().to_string();
            self.pushers
                .send(
                    peer.rank,
                    &bootstrap_frames(room, &ip, self.advertised_rank().port()),
                )
                .await;
            self.stats.bootstrap_frames.fetch_add(1, Ordering::Relaxed);
            let now = now_ns();
            self.record(room, |r| {
                r.bootstrap_sent += 1;
                if r.bootstrap_ns == 0 {
                    r.bootstrap_ns = now;
                }
            });
            let until = tokio::time::Instant::now() + waiting;
            match self.d_wait(room, &[KvPoll::WaitingForInput], until).await {
                Some(KvPoll::WaitingForInput) => {
                    prog.lock().expect("progress lock").armed = true;
                }
                Some(_) => {
                    let reason = self.d_failure(room).unwrap_or_else(|| {
                        "Failed to get kvcache from prefill instance, it might be dead".into()
                    });
                    return failed(reason, true);
                }
                None => {
                    // `_poll` (`common/conn.py:2596`): abort, then the reason.
                    self.stats.waiting_timeouts.fetch_add(1, Ordering::Relaxed);
                    self.d_update(room, KvPoll::Failed);
                    self.send_abort(room, prog, false).await;
                    return Received::Failed {
                        handshake: true,
                        reason: "Timed out waiting for prefill completion".into(),
                        timed_out: true,
                    };
                }
            }
        } else {
            self.d_update(room, KvPoll::WaitingForInput);
        }
        if self.args.bootstrap_delay_us > 0 {
            tokio::time::sleep(Duration::from_micros(self.args.bootstrap_delay_us)).await;
        }
        // Allocate, then publish the destinations (`decode.py:1844`).
        let (start, aux) = {
            let mut t = self.decode.lock().expect("decode lock");
            t.kv_item_len(self.args.kv_bytes_per_token);
            t.allocate(room, sub.input_tokens)
        };
        let n = sub
            .input_tokens
            .clamp(1, self.args.max_total_num_tokens.max(1));
        let d = Destinations {
            room,
            ip: self.kv_addr.ip().to_string(),
            port: self.advertised_rank().port(),
            session_id: self.session_id(),
            kv_indices: (start..start + n).map(|i| i as i32).collect(),
            aux_index: Some(aux),
            required_dst_info_num: 1,
            decode_prefix_len: 0,
        };
        self.pushers.send(peer.rank, &d.frames()).await;
        self.stats.destinations.fetch_add(1, Ordering::Relaxed);
        let t_dests = now_ns();
        {
            let mut p = prog.lock().expect("progress lock");
            p.armed = true;
            p.t_dests = t_dests;
        }
        self.record(room, |r| {
            r.destinations_sent += 1;
            if r.bootstrap_ns == 0 {
                r.bootstrap_ns = t_dests;
            }
            r.destinations_ns = t_dests;
        });
        if self.args.faults.hits(Fault::UnknownRoom) {
            self.inject_unknown_room(peer.rank).await;
        }
        let init = tokio::time::Instant::now();
        match self.d_wait(room, &[KvPoll::Success], init + waiting).await {
            Some(KvPoll::Success) => Received::Success { t_kv: now_ns() },
            Some(_) => {
                // A Failed status: decode aborts back to prefill to drain the room's writes
                // (`decode.py:2899`, deferred KV release).
                self.send_abort(room, prog, true).await;
                let reason = self.d_failure(room).unwrap_or_else(|| {
                    "Failed to get kvcache from prefill instance, it might be dead".into()
                });
                failed(reason, false)
            }
            None => {
                // `_check_waiting_timeout` (`common/conn.py:2888`).
                self.stats.waiting_timeouts.fetch_add(1, Ordering::Relaxed);
                self.d_update(room, KvPoll::Failed);
                self.send_abort(room, prog, false).await;
                Received::Failed {
                    handshake: false,
                    reason: format!(
                        "Request {room} timed out after {:.1}s in KVPoll.WaitingForInput",
                        init.elapsed().as_secs_f64()
                    ),
                    timed_out: true,
                }
            }
        }
    }

    /// The receiver is done with `room`: it leaves `request_status`.
    fn d_clear(&self, room: u64) {
        let mut t = self.decode.lock().expect("decode lock");
        t.rooms.remove(&room);
        t.ended.insert(room, Instant::now());
    }

    /// Record how a decode sub-request ended: `outcome`, or `cancel-ignored` (with `outcome` as
    /// `final_outcome`) when its client had gone and it went on (`--decode-ignores-cancel`).
    fn end_decode(
        &self,
        room: u64,
        conn: Option<&ClientConn>,
        outcome: &'static str,
        f: impl FnOnce(&mut RoomRecord),
    ) {
        let now = now_ns();
        let gone = conn.and_then(ClientConn::gone_ns);
        let ignored = gone.is_some() && self.args.decode_ignores_cancel;
        if ignored {
            self.stats.cancels_ignored.fetch_add(1, Ordering::Relaxed);
        }
        self.record(room, |r| {
            f(r);
            r.ended_ns = now;
            if r.answered_ns == 0 {
                r.answered_ns = now;
            }
            if let Some(g) = gone {
                r.client_gone_ns = g;
            }
            if ignored {
                r.outcome = "cancel-ignored";
                r.final_outcome = Some(outcome);
            } else if !r.outcome.starts_with("injected-") {
                r.outcome = outcome;
            }
        });
    }
}

/// What one sub-request's answer and spans need once its KV question is settled.
struct SubRun {
    answer: SubAnswer,
    outcome: &'static str,
    err: Option<String>,
    t_sched: u64,
    t_dests: u64,
    t_kv: u64,
}

impl Worker {
    /// Settle sub-request `sub`'s KV (or its refusal); `cancel` resolving aborts it (the
    /// client went away). `None`: cancelled.
    async fn decode_sub(
        self: &Arc<Self>,
        sub: &Sub,
        fake: bool,
        prefill: Option<&(String, u16)>,
        mut cancel: watch::Receiver<bool>,
    ) -> Option<SubRun> {
        let t_sched = now_ns();
        let answer = |abort: Option<Refusal>| SubAnswer {
            index: sub.index,
            rid: sub.rid.clone(),
            input_tokens: sub.input_tokens,
            completion_tokens: 0,
            abort,
            length: sub.max_new_tokens,
        };
        let run = |answer: SubAnswer, outcome, err, t_dests, t_kv| SubRun {
            answer,
            outcome,
            err,
            t_sched,
            t_dests,
            t_kv,
        };
        if let Some(refusal) = self.scheduler_check(sub.input_tokens, &sub.rid) {
            self.stats.rejected_400.fetch_add(1, Ordering::Relaxed);
            let msg = refusal.message.clone();
            return Some(run(
                answer(Some(refusal)),
                "rejected",
                Some(msg),
                t_sched,
                t_sched,
            ));
        }
        self.stats.admitted.fetch_add(1, Ordering::Relaxed);
        let (Some(room), false) = (sub.room, fake) else {
            // SGLang's fake transfer (or no PD at all): the KV is there at once.
            return Some(run(answer(None), "generated", None, t_sched, t_sched));
        };
        let faults = &self.args.faults;
        let stranded = faults.stranded_holder(Some(room));
        if stranded == Some(Holder::Prefill) {
            // `--fault stranded-kv`, prefill holds: decode drops the request before it
            // publishes anything (as a decode that lost it would); prefill keeps the room.
            let msg = format!(
                "Request {} aborted: decode dropped bootstrap_room={room} before bootstrap",
                sub.rid
            );
            return Some(run(
                answer(Some(Refusal::graceful(msg.clone()))),
                "aborted",
                Some(msg),
                t_sched,
                t_sched,
            ));
        }
        let Some(prefill) = prefill else {
            let msg = format!(
                "Decode handshake failed for request rank=0 decode_req.req.rid='{}' decode_req.req.bootstrap_room={room} with exception KVTransferError(bootstrap_room={room}): request has bootstrap_room but no bootstrap_host/bootstrap_port",
                sub.rid
            );
            return Some(run(
                answer(Some(Refusal::abort(500, msg.clone()))),
                "failed",
                Some(msg),
                t_sched,
                t_sched,
            ));
        };
        let hold =
            (stranded == Some(Holder::Decode)).then(|| Duration::from_millis(faults.fault_hold_ms));
        let prog = Mutex::new(Progress::default());
        let received = {
            let recv = self.receive(sub, room, prefill, &prog, hold);
            tokio::pin!(recv);
            tokio::select! {
                r = &mut recv => Some(r),
                _ = cancel.wait_for(|c| *c) => None,
            }
        };
        let t_dests = prog.lock().expect("progress lock").t_dests.max(t_sched);
        let Some(received) = received else {
            // `abort()` (`common/conn.py:2955`): the room fails and prefill is told.
            self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
            self.d_update(room, KvPoll::Failed);
            self.send_abort(room, &prog, false).await;
            self.d_clear(room);
            return None;
        };
        self.d_clear(room);
        match received {
            Received::Success { t_kv } => Some(run(answer(None), "generated", None, t_dests, t_kv)),
            Received::Failed {
                handshake,
                reason,
                timed_out,
            } => {
                let what = if handshake { "handshake" } else { "transfer" };
                let msg = format!(
                    "Decode {what} failed for request rank=0 decode_req.req.rid='{}' decode_req.req.bootstrap_room={room} with exception KVTransferError(bootstrap_room={room}): {reason}",
                    sub.rid
                );
                let outcome = if timed_out && stranded == Some(Holder::Decode) {
                    self.injected(room, Fault::StrandedKv);
                    Fault::StrandedKv.outcome()
                } else if handshake {
                    "failed"
                } else {
                    "kv-failed"
                };
                Some(run(
                    answer(Some(Refusal::abort(500, msg.clone()))),
                    outcome,
                    Some(msg),
                    t_dests,
                    now_ns(),
                ))
            }
        }
    }

    fn decode_spans(&self, sub: &Sub, r: &SubRun, tp: Option<TraceParent>, t0: u64, t_tok: u64) {
        let t_end = now_ns();
        let mut trace = ReqTrace::new(self.spans.enabled(), tp);
        trace.input_tokens = sub.input_tokens;
        let th = trace.thread(self, false, t0, t_tok, None);
        trace.stage(th, "tokenize", t0, t_tok);
        trace.stage(th, "api_server_dispatch", t_tok, t_tok);
        let th = trace.thread(self, true, r.t_sched, t_end, r.err.as_deref());
        if sub.room.is_some() {
            trace.stage(th, "decode_bootstrap", r.t_sched, r.t_dests);
        }
        // The transfer and the forward happened only if the KV came.
        if r.answer.abort.is_none() {
            if sub.room.is_some() {
                trace.stage(th, "decode_transferred", r.t_dests, r.t_kv);
            }
            trace.stage(th, "decode_forward", r.t_kv, t_end);
        }
        trace.finish(self, &sub.rid, sub.room, t0, t_end);
    }
}

/// Resolves when SGLang's tokenizer would notice that a non-streamed request's client is gone:
/// at its next poll, every `period` from `start` (`tokenizer_manager.py:1960`).
async fn client_gone_at_poll(
    conn: Option<ClientConn>,
    start: tokio::time::Instant,
    period: Duration,
) {
    let Some(conn) = conn else {
        return std::future::pending().await;
    };
    let mut tick = tokio::time::interval_at(start + period, period);
    loop {
        tick.tick().await;
        if conn.gone_ns().is_some() {
            return;
        }
    }
}

/// Decode's `/generate` and OpenAI routes.
pub(super) async fn serve(w: Shared, p: Parsed, ctx: Ctx) -> Response {
    let t_tok = now_ns();
    if let Some(msg) = p
        .subs
        .iter()
        .find_map(|s| w.tokenizer_check(s.input_tokens))
    {
        w.stats.rejected_400.fetch_add(1, Ordering::Relaxed);
        let resp = render::tokenizer_refusal(&p, &msg);
        let t_end = now_ns();
        let status = resp.status().as_u16();
        for sub in &p.subs {
            let mut trace = ReqTrace::new(w.spans.enabled(), ctx.tp);
            trace.input_tokens = sub.input_tokens;
            let th = trace.thread(&w, false, ctx.t0, t_end, Some(&msg));
            trace.stage(th, "tokenize", ctx.t0, t_tok);
            trace.finish(&w, &sub.rid, sub.room, ctx.t0, t_end);
            if let Some(room) = sub.room {
                w.record(room, |r| r.received_ns = ctx.t0);
                w.end_decode(room, ctx.conn.as_ref(), "rejected", |r| {
                    r.rid = sub.rid.clone();
                    r.request_id = ctx.request_id.clone();
                    r.status = status;
                    r.error_code = if status == 200 { 400 } else { 0 };
                    r.input_tokens = sub.input_tokens;
                });
            }
        }
        return resp;
    }
    for sub in &p.subs {
        if let Some(room) = sub.room {
            w.record(room, |r| {
                r.rid = sub.rid.clone();
                r.request_id = ctx.request_id.clone();
                r.input_tokens = sub.input_tokens;
                r.received_ns = ctx.t0;
            });
        }
    }
    w.inflight.fetch_add(1, Ordering::Relaxed);
    let fake = p.fake_transfer();
    let p = Arc::new(p);
    let (cancel_tx, cancel_rx) = watch::channel(false);
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    let stream = p.stream;
    let conn = ctx.conn.clone();
    let (t0, tp) = (ctx.t0, ctx.tp);
    // Every prompt's group runs at once, the sub-requests of a group one after the other;
    // each generates its tokens once its KV is there, streaming them when asked to.
    let driver = {
        let (w, p, conn) = (w.clone(), p.clone(), conn.clone());
        async move {
            let _inflight = InflightGuard(&w.inflight);
            let model = w.args.model_path.clone();
            let runs = p.groups().into_iter().map(|g| {
                let (w, p, tx, conn, cancel, model) = (
                    w.clone(),
                    p.clone(),
                    tx.clone(),
                    conn.clone(),
                    cancel_rx.clone(),
                    model.clone(),
                );
                async move {
                    let mut answers = Vec::new();
                    for sub in g {
                        let Some(run) = w
                            .decode_sub(&sub, fake, p.bootstrap.as_ref(), cancel.clone())
                            .await
                        else {
                            if let Some(room) = sub.room {
                                let now = now_ns();
                                let gone = conn.as_ref().and_then(ClientConn::gone_ns);
                                w.record(room, |r| {
                                    r.outcome = "cancelled";
                                    r.ended_ns = now;
                                    r.client_gone_ns = gone.unwrap_or(0);
                                });
                            }
                            return answers;
                        };
                        let a = w
                            .generate(
                                &sub,
                                run,
                                &Out {
                                    p: &p,
                                    model: &model,
                                    stream,
                                    tx: &tx,
                                    cancel: &cancel,
                                    conn: conn.as_ref(),
                                    times: (t0, t_tok, tp),
                                },
                            )
                            .await;
                        let refused_prefix =
                            sub.prefix && a.abort.as_ref().is_some_and(|r| r.status >= 400);
                        if !sub.prefix || refused_prefix {
                            answers.push(a);
                        }
                        if refused_prefix {
                            break;
                        }
                    }
                    answers
                }
            });
            let mut all: Vec<SubAnswer> = futures_util::future::join_all(runs)
                .await
                .into_iter()
                .flatten()
                .collect();
            all.sort_by_key(|a| a.index);
            w.stats.completed.fetch_add(1, Ordering::Relaxed);
            all
        }
    };
    let ignore = w.args.decode_ignores_cancel;
    let model = w.args.model_path.clone();
    if stream {
        // SGLang's StreamingResponse answers 200 at once; a client leaving cancels the
        // generator, which aborts the request at once (`tokenizer_manager.py:958`).
        let (btx, brx) = mpsc::channel::<Result<Bytes, Infallible>>(16);
        let now = now_ns();
        for room in p.subs.iter().filter_map(|s| s.room) {
            w.record(room, |r| r.answered_ns = now);
        }
        let p2 = p.clone();
        tokio::spawn(async move {
            let (mut rx, drive) = (rx, driver);
            tokio::pin!(drive);
            let mut cancelled = false;
            let answers = loop {
                tokio::select! {
                    all = &mut drive => break all,
                    c = rx.recv() => {
                        if let Some(c) = c
                            && !cancelled
                            && btx.send(Ok(c)).await.is_err()
                            && !ignore
                        {
                            cancelled = true;
                            cancel_tx.send_replace(true);
                        }
                    }
                    _ = btx.closed(), if !cancelled && !ignore => {
                        cancelled = true;
                        cancel_tx.send_replace(true);
                    }
                }
            };
            while let Some(c) = rx.recv().await {
                let _ = btx.send(Ok(c)).await;
            }
            if let Some(a) = answers.iter().find(|a| a.index == usize::MAX) {
                let msg = a.abort.as_ref().map(|r| r.message.as_str()).unwrap_or("");
                let _ = btx.send(Ok(render::stream_error(&p2, msg))).await;
            }
            let _ = btx.send(Ok(Bytes::from_static(DONE))).await;
        });
        let body =
            futures_util::stream::unfold(
                brx,
                |mut rx| async move { rx.recv().await.map(|x| (x, rx)) },
            );
        return Response::builder()
            .status(200)
            .header("content-type", "text/event-stream")
            .header("cache-control", "no-cache")
            .body(Body::from_stream(body))
            .expect("static response parts");
    }
    drop(rx);
    let answers = if ignore {
        driver.await
    } else {
        let gone = client_gone_at_poll(
            conn.clone(),
            tokio::time::Instant::now(),
            Duration::from_millis(w.args.request_state_wait_timeout_ms),
        );
        tokio::pin!(driver);
        tokio::select! {
            a = &mut driver => a,
            _ = gone => {
                // "Request is disconnected from the client side": abort, then nothing is
                // answered; the connection is closed.
                cancel_tx.send_replace(true);
                let _ = driver.await;
                if let Some(c) = &conn {
                    c.close_now();
                }
                return std::future::pending().await;
            }
        }
    };
    if let Some(a) = answers.iter().find(|a| a.index == usize::MAX) {
        let msg = a
            .abort
            .as_ref()
            .map(|r| r.message.clone())
            .unwrap_or_default();
        return render::tokenizer_refusal(&p, &msg);
    }
    render::final_answer(&p, &model, &answers, (now_ns() - t0) as f64 / 1e9)
}

/// Where a request's tokens go: its answer's shape, the stream (if any), and what ends it.
struct Out<'a> {
    p: &'a Parsed,
    model: &'a str,
    stream: bool,
    tx: &'a mpsc::Sender<Bytes>,
    /// Set when the client went away (and decode honours it).
    cancel: &'a watch::Receiver<bool>,
    conn: Option<&'a ClientConn>,
    /// The request's start, end of tokenization, and trace context.
    times: (u64, u64, Option<TraceParent>),
}

impl Worker {
    /// Generate a settled sub-request's tokens (streaming them when asked to) and record how it
    /// ended; its answer.
    async fn generate(&self, sub: &Sub, run: SubRun, out: &Out<'_>) -> SubAnswer {
        let Out {
            p,
            model,
            stream,
            tx,
            cancel,
            conn,
            times: (t0, t_tok, tp),
        } = *out;
        let mut a = run.answer.clone();
        let delay = Duration::from_micros(self.args.decode_token_delay_us);
        let mut outcome = run.outcome;
        if a.abort.is_none() && !sub.prefix {
            let n = sub.max_new_tokens.max(1);
            let mut text = String::new();
            let mut sent = 0;
            for i in 0..n {
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                if *cancel.borrow() {
                    // Aborted while running: the KV had come, so no ABORT goes to prefill.
                    outcome = "client-gone";
                    break;
                }
                let word = WORDS[(i as usize) % WORDS.len()];
                text.push_str(word);
                sent = i + 1;
                if stream {
                    let last = i + 1 == n;
                    let chunk_a = SubAnswer {
                        completion_tokens: sent,
                        ..a.clone()
                    };
                    let c = render::chunk(p, model, &chunk_a, &text, word, last);
                    if tx.send(c).await.is_err() && !self.args.decode_ignores_cancel {
                        outcome = "client-gone";
                        break;
                    }
                }
            }
            a.completion_tokens = sent;
            a.length = sent;
        } else if stream && !sub.prefix {
            let _ = tx.send(render::chunk(p, model, &a, "", "", true)).await;
        }
        self.decode_spans(sub, &run, tp, t0, t_tok);
        if let Some(room) = sub.room {
            let err = a.abort.as_ref().map(|r| r.status).unwrap_or(0);
            let generated = a.completion_tokens;
            self.end_decode(room, conn, outcome, |r| {
                (r.status, r.error_code) = match (stream, err) {
                    (true, e) => (200, e),
                    (false, 0) => (200, 0),
                    (false, e) => (e, 0),
                };
                r.generated_tokens = generated;
            });
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(t: &mut DecodeTable, room: u64) {
        t.rooms.insert(
            room,
            DecodeRoom {
                status: KvPoll::WaitingForInput,
                wake: Arc::new(Notify::new()),
                failure: None,
            },
        );
    }

    #[test]
    fn pages_of_a_live_room_are_not_handed_out_again_and_addresses_find_their_room() {
        let mut t = DecodeTable::new(10);
        t.pool = 10;
        t.kv_item_len(8);
        live(&mut t, 1);
        let (a, _) = t.allocate(1, 6);
        assert_eq!(a, 0);
        live(&mut t, 2);
        // 6 + 6 > 10: wraps, but pages 0..6 are room 1's: room 2 goes after them.
        let (b, aux) = t.allocate(2, 4);
        assert_eq!(b, 6);
        assert_eq!(t.owner_of(KV_BASES[1] + 7 * 4), Some(2));
        assert_eq!(t.owner_of(KV_BASES[0] + 5 * 4), Some(1));
        assert_eq!(t.owner_of(AUX_BASE + aux * AUX_ITEM_LEN), Some(2));
        assert_eq!(t.owner_of(12), None);
        // Room 1 ended long ago: its pages go to the next room, which then owns them.
        t.rooms.remove(&1);
        t.ended.insert(1, Instant::now() - PAGE_GRACE);
        live(&mut t, 3);
        let (c, _) = t.allocate(3, 5);
        assert_eq!(c, 0);
        assert_eq!(t.owner_of(KV_BASES[0]), Some(3));
        // Every page busy: pd-sim overlaps rather than refuse.
        live(&mut t, 4);
        let (d, _) = t.allocate(4, 10);
        assert_eq!(d, 0);
    }
}
