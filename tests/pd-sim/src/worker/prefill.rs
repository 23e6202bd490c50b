//! Prefill: admission, then the KV transfer once both the admission and decode's BOOTSTRAP
//! for a room are there (in whichever order they arrive), and the sweeper that expires rooms
//! whose partner never came.

use super::api::Parsed;
use super::render::{final_content_type, render_final};
use super::trace::ReqTrace;
use super::*;
use crate::fault::{Fault, Holder};

pub(super) struct XferDone {
    pub(super) start_ns: u64,
    pub(super) end_ns: u64,
}

/// Late spans for a rejected room that is transferred anyway.
pub(super) struct LateTrace {
    pub(super) trace_id: [u8; 16],
    pub(super) root: [u8; 8],
}

pub(super) enum Pending {
    Request {
        tokens: u64,
        done: Option<oneshot::Sender<XferDone>>,
        late: Option<LateTrace>,
        since: Instant,
        /// How long the room waits for decode's BOOTSTRAP.
        hold: Duration,
        /// `--fault success-after-abort`: the transfer stops before `KV_DONE`.
        abort_midway: bool,
    },
    Bootstrap {
        endpoint: SocketAddr,
        since: Instant,
    },
}

impl Worker {
    pub(super) fn meet_request(self: &Arc<Self>, room: u64, req: RoomRequest) {
        let endpoint = {
            let mut p = self.pending.lock().expect("pending lock");
            match p.remove(&room) {
                Some(Pending::Bootstrap { endpoint, .. }) => endpoint,
                _ => {
                    p.insert(
                        room,
                        Pending::Request {
                            tokens: req.tokens,
                            done: req.done,
                            late: req.late,
                            since: Instant::now(),
                            hold: req.hold,
                            abort_midway: req.abort_midway,
                        },
                    );
                    return;
                }
            }
        };
        self.spawn_transfer(
            room,
            req.tokens,
            endpoint,
            req.done,
            req.late,
            req.abort_midway,
        );
    }

    pub(super) fn meet_bootstrap(self: &Arc<Self>, room: u64, endpoint: SocketAddr) {
        let (tokens, done, late, abort_midway) = {
            let mut p = self.pending.lock().expect("pending lock");
            match p.remove(&room) {
                Some(Pending::Request {
                    tokens,
                    done,
                    late,
                    abort_midway,
                    ..
                }) => (tokens, done, late, abort_midway),
                _ => {
                    p.insert(
                        room,
                        Pending::Bootstrap {
                            endpoint,
                            since: Instant::now(),
                        },
                    );
                    return;
                }
            }
        };
        self.spawn_transfer(room, tokens, endpoint, done, late, abort_midway);
    }

    pub(super) fn spawn_transfer(
        self: &Arc<Self>,
        room: u64,
        tokens: u64,
        to: SocketAddr,
        done: Option<oneshot::Sender<XferDone>>,
        late: Option<LateTrace>,
        abort_midway: bool,
    ) {
        let w = self.clone();
        tokio::spawn(async move {
            let start_ns = now_ns();
            let total = (tokens.max(1) * w.args.kv_bytes_per_token) as usize;
            const CHUNK: usize = 64 * 1024;
            static ZEROS: [u8; CHUNK] = [0u8; CHUNK];
            let room_s = room.to_string();
            // The whole transfer is encoded up front and queued as one unit (one write on the
            // socket for small transfers); frames are still separate ZMTP messages.
            let mut buf = bytes::BytesMut::with_capacity(total + 64);
            let mut sent = 0usize;
            let mut idx = 0u32;
            while sent < total || idx == 0 {
                let n = (total - sent).min(CHUNK);
                let idx_s = idx.to_string();
                crate::zmtp::encode_message(
                    &mut buf,
                    &[&b"KV"[..], room_s.as_bytes(), idx_s.as_bytes(), &ZEROS[..n]],
                );
                sent += n;
                idx += 1;
            }
            let tok_s = tokens.to_string();
            if !abort_midway {
                crate::zmtp::encode_message(
                    &mut buf,
                    &[&b"KV_DONE"[..], room_s.as_bytes(), tok_s.as_bytes()],
                );
            }
            w.pushers
                .send_encoded(to, buf.freeze(), idx as u64 + u64::from(!abort_midway))
                .await;
            let end_ns = now_ns();
            w.stats.kv_transfers.fetch_add(1, Ordering::Relaxed);
            w.stats.kv_chunks.fetch_add(idx as u64, Ordering::Relaxed);
            let after_reject = late.is_some();
            w.record(room, |r| {
                r.kv_chunks += idx;
                r.kv_done = !abort_midway;
                if after_reject {
                    r.outcome = "rejected-transferred";
                }
            });
            if let Some(late) = late {
                w.stats
                    .kv_transfers_after_reject
                    .fetch_add(1, Ordering::Relaxed);
                // The rejected request's root span has ended; the transfer still shows up as
                // scheduler work under it, which is exactly the evidence a monitor needs.
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
            if let Some(d) = done {
                let _ = d.send(XferDone { start_ns, end_ns });
            }
        });
    }

    pub(super) fn on_prefill_message(self: &Arc<Self>, parts: Vec<Bytes>) {
        let verb = parts.first().map(|b| &b[..]).unwrap_or(b"");
        match verb {
            b"BOOTSTRAP" if parts.len() >= 4 => {
                let (Some(room), Ok(ip), Some(port)) = (
                    parse_u64(&parts[1]),
                    std::str::from_utf8(&parts[2]).map(|s| s.parse::<IpAddr>()),
                    parse_u64(&parts[3]),
                ) else {
                    self.stats.unknown_frames.fetch_add(1, Ordering::Relaxed);
                    return;
                };
                let Ok(ip) = ip else {
                    self.stats.unknown_frames.fetch_add(1, Ordering::Relaxed);
                    return;
                };
                self.stats.bootstrap_frames.fetch_add(1, Ordering::Relaxed);
                let now = now_ns();
                self.record(room, |r| {
                    r.bootstrap_frames += 1;
                    if r.bootstrap_ns == 0 {
                        r.bootstrap_ns = now;
                    }
                });
                self.meet_bootstrap(room, SocketAddr::new(ip, port as u16));
            }
            b"ABORT" if parts.len() >= 2 => {
                let Some(room) = parse_u64(&parts[1]) else {
                    self.stats.unknown_frames.fetch_add(1, Ordering::Relaxed);
                    return;
                };
                self.stats.abort_frames.fetch_add(1, Ordering::Relaxed);
                self.record(room, |r| r.abort_frames += 1);
                // Dropping the pending entry drops its completion sender: the waiting HTTP
                // request sees the abort.
                self.pending.lock().expect("pending lock").remove(&room);
            }
            _ => {
                self.stats.unknown_frames.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// A prefill request's side of a room, waiting for (or meeting) decode's BOOTSTRAP.
pub(super) struct RoomRequest {
    pub(super) tokens: u64,
    pub(super) done: Option<oneshot::Sender<XferDone>>,
    pub(super) late: Option<LateTrace>,
    pub(super) hold: Duration,
    pub(super) abort_midway: bool,
}

impl RoomRequest {
    pub(super) fn new(w: &Worker, tokens: u64, done: Option<oneshot::Sender<XferDone>>) -> Self {
        RoomRequest {
            tokens,
            done,
            late: None,
            hold: Duration::from_millis(w.args.bootstrap_timeout_ms),
            abort_midway: false,
        }
    }
}

pub(super) async fn sweeper(w: Shared) {
    let timeout = Duration::from_millis(w.args.bootstrap_timeout_ms);
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tick.tick().await;
        let mut expired_bootstraps = 0u64;
        {
            let mut p = w.pending.lock().expect("pending lock");
            p.retain(|_, v| match v {
                Pending::Request { since, hold, .. } => since.elapsed() < *hold,
                Pending::Bootstrap { since, .. } => {
                    let keep = since.elapsed() < timeout;
                    if !keep {
                        expired_bootstraps += 1;
                    }
                    keep
                }
            });
        }
        w.stats
            .bootstraps_unmatched
            .fetch_add(expired_bootstraps, Ordering::Relaxed);
    }
}

pub(super) async fn prefill(
    w: Shared,
    p: Parsed,
    rid: String,
    request_id: Option<String>,
    mut trace: ReqTrace,
    t0: u64,
) -> Response {
    let t_tok = now_ns();
    if let Some((status, msg, scheduler_stage)) = w.check(&p, &rid) {
        let t_end = now_ns();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            w.stats.rejected_503.fetch_add(1, Ordering::Relaxed);
        } else {
            w.stats.rejected_400.fetch_add(1, Ordering::Relaxed);
        }
        if scheduler_stage {
            let th = trace.thread(&w, false, t0, t_tok, None);
            trace.stage(th, "tokenize", t0, t_tok);
            trace.stage(th, "api_server_dispatch", t_tok, t_tok);
            let th = trace.thread(&w, true, t_tok, t_end, Some(&msg));
            trace.stage(th, "prefill_prepare", t_tok, t_end);
        } else {
            let th = trace.thread(&w, false, t0, t_end, Some(&msg));
            trace.stage(th, "tokenize", t0, t_tok);
        }
        let late = (w.args.transfer_after_reject && p.room.is_some()).then_some(LateTrace {
            trace_id: trace.trace_id,
            root: trace.root,
        });
        trace.finish(&w, &rid, p.room, t0, t_end);
        if let Some(room) = p.room {
            w.record(room, |r| {
                r.rid = rid.clone();
                r.request_id = request_id.clone();
                r.status = status.as_u16();
                r.input_tokens = p.input_tokens;
                r.outcome = "rejected";
                r.received_ns = t0;
                r.answered_ns = t_end;
                r.ended_ns = t_end;
            });
            if let Some(late) = late {
                w.meet_request(
                    room,
                    RoomRequest {
                        late: Some(late),
                        ..RoomRequest::new(&w, p.input_tokens, None)
                    },
                );
            }
        }
        return error_response(status, &msg);
    }
    w.stats.admitted.fetch_add(1, Ordering::Relaxed);
    w.inflight.fetch_add(1, Ordering::Relaxed);
    let t_admit = now_ns();
    if let Some(room) = p.room {
        w.record(room, |r| {
            r.rid = rid.clone();
            r.request_id = request_id.clone();
            r.status = 200;
            r.input_tokens = p.input_tokens;
            r.received_ns = t0;
            r.answered_ns = t_admit;
        });
    }
    // Status line now, body when the transfer is over (see the `worker` module docs).
    let stream = p.stream;
    let w2 = w.clone();
    let fut = async move {
        let w = w2;
        let _inflight = InflightGuard(&w.inflight);
        let mut guard = PendingGuard {
            w: &w,
            room: p.room,
            armed: true,
        };
        if w.args.prefill_delay_us > 0 {
            tokio::time::sleep(Duration::from_micros(w.args.prefill_delay_us)).await;
        }
        let t_fwd = now_ns();
        let mut err: Option<String> = None;
        // What the answer says: the abort, unless `--fault success-after-abort` hides it.
        let mut answer_abort = true;
        let mut xfer = None;
        let faults = &w.args.faults;
        if let Some(room) = p.room
            && faults.hits(Fault::ForeignRoutePut)
        {
            w.foreign_route_put(room);
        }
        let stranded = faults.stranded_holder(p.room);
        if let (Some(room), Some(Holder::Decode)) = (p.room, stranded) {
            // `--fault stranded-kv`, decode holds: prefill gives up on the room at once and
            // says so; decode, told nothing, keeps waiting for the KV.
            err = Some(format!(
                "Request {rid} aborted: KV sender failed for bootstrap_room={room}"
            ));
            w.record(room, |r| r.outcome = "aborted");
        } else if let Some(room) = p.room {
            let (tx, rx) = oneshot::channel();
            let mut req = RoomRequest::new(&w, p.input_tokens, Some(tx));
            if stranded == Some(Holder::Prefill) {
                req.hold = Duration::from_millis(faults.fault_hold_ms);
            }
            req.abort_midway = stranded.is_none() && faults.hits(Fault::SuccessAfterAbort);
            let (hold, abort_midway) = (req.hold, req.abort_midway);
            w.meet_request(room, req);
            match tokio::time::timeout(hold, rx).await {
                Ok(Ok(x)) if abort_midway => {
                    // The transfer stopped short of `KV_DONE`: prefill's spans report the
                    // abort, its answer a normal finish (the breach).
                    err = Some(format!(
                        "Request {rid} aborted during KV transfer for bootstrap_room={room}: KVTransferError"
                    ));
                    answer_abort = false;
                    xfer = Some(x);
                    w.injected(room, Fault::SuccessAfterAbort);
                }
                Ok(Ok(x)) => xfer = Some(x),
                // A held room's request is dropped by the sweeper once its hold is over, which
                // may come a tick before the timeout: the hold ran out either way.
                Ok(Err(_)) if stranded == Some(Holder::Prefill) => {
                    w.stats.bootstrap_timeouts.fetch_add(1, Ordering::Relaxed);
                    err = Some(format!(
                        "Request {rid} timed out waiting for decode bootstrap (bootstrap_room={room}, {} ms)",
                        hold.as_millis()
                    ));
                    w.injected(room, Fault::StrandedKv);
                }
                Ok(Err(_)) => {
                    w.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                    err = Some(format!(
                        "Request {rid} aborted: decode aborted the transfer for bootstrap_room={room}"
                    ));
                    w.record(room, |r| r.outcome = "aborted");
                }
                Err(_) => {
                    w.stats.bootstrap_timeouts.fetch_add(1, Ordering::Relaxed);
                    err = Some(format!(
                        "Request {rid} timed out waiting for decode bootstrap (bootstrap_room={room}, {} ms)",
                        hold.as_millis()
                    ));
                    if stranded == Some(Holder::Prefill) {
                        w.injected(room, Fault::StrandedKv);
                    } else {
                        w.record(room, |r| r.outcome = "bootstrap-timeout");
                    }
                }
            }
            if xfer.is_some() && !abort_midway {
                w.record(room, |r| r.outcome = "transferred");
            }
        }
        guard.armed = false;
        let t_end = now_ns();
        if let Some(room) = p.room {
            w.record(room, |r| r.ended_ns = t_end);
        }
        let th = trace.thread(&w, false, t0, t_tok, None);
        trace.stage(th, "tokenize", t0, t_tok);
        trace.stage(th, "api_server_dispatch", t_tok, t_tok);
        let th = trace.thread(&w, true, t_tok, t_end, err.as_deref());
        trace.stage(th, "prefill_prepare", t_tok, t_admit);
        trace.stage(th, "prefill_forward", t_admit, t_fwd);
        if let Some(x) = &xfer {
            trace.stage(th, "prefill_transfer_kv_cache", x.start_ns, x.end_ns);
        }
        trace.finish(&w, &rid, p.room, t0, t_end);
        w.stats.completed.fetch_add(1, Ordering::Relaxed);
        let secs = (t_end - t0) as f64 / 1e9;
        Ok::<Bytes, Infallible>(render_final(
            &p,
            &rid,
            &w.args.model_path,
            "",
            1,
            err.as_deref().filter(|_| answer_abort),
            secs,
        ))
    };
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", final_content_type(stream))
        .body(Body::from_stream(futures_util::stream::once(fut)))
        .expect("static response parts")
}

/// Removes a room's pending entry if the request goes away before its transfer finished
/// (router cancelled the prefill leg).
pub(super) struct PendingGuard<'a> {
    pub(super) w: &'a Worker,
    pub(super) room: Option<u64>,
    pub(super) armed: bool,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        if self.armed
            && let Some(room) = self.room
        {
            self.w.stats.cancelled.fetch_add(1, Ordering::Relaxed);
            if let Ok(mut p) = self.w.pending.lock() {
                p.remove(&room);
            }
            let now = now_ns();
            self.w.record(room, |r| {
                r.outcome = "cancelled";
                r.ended_ns = now;
            });
        }
    }
}
