//! Decode: bootstrap with prefill over ZMTP, wait for the KV, generate; a client that goes
//! away mid-request cancels it (ABORT to prefill) unless `--decode-ignores-cancel`.

use super::api::{Api, Parsed};
use super::render::{WORDS, final_content_type, gen_text, render_chunk, render_final};
use super::trace::ReqTrace;
use super::*;
use crate::fault::{Fault, Holder};

pub(super) struct DecodeWaiter {
    pub(super) done: oneshot::Sender<()>,
}

impl Worker {
    pub(super) fn on_decode_message(self: &Arc<Self>, parts: Vec<Bytes>) {
        let verb = parts.first().map(|b| &b[..]).unwrap_or(b"");
        let room = parts.get(1).and_then(|r| parse_u64(r));
        match (verb, room) {
            (b"KV", Some(room)) => {
                let known = self
                    .waiters
                    .lock()
                    .expect("waiters lock")
                    .contains_key(&room);
                if known {
                    self.stats.kv_chunks.fetch_add(1, Ordering::Relaxed);
                } else {
                    self.stats
                        .kv_chunks_unmatched
                        .fetch_add(1, Ordering::Relaxed);
                }
                self.record(room, |r| r.kv_chunks += 1);
            }
            (b"KV_DONE", Some(room)) => {
                self.record(room, |r| r.kv_done = true);
                if let Some(wt) = self.waiters.lock().expect("waiters lock").remove(&room) {
                    let _ = wt.done.send(());
                }
            }
            _ => {
                self.stats.unknown_frames.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Sends `ABORT room` to prefill if the decode request goes away before its KV arrived, as
/// SGLang's decode does when a request is aborted during bootstrap.
pub(super) struct DecodeGuard {
    pub(super) w: Shared,
    pub(super) room: u64,
    pub(super) prefill: Option<SocketAddr>,
    pub(super) conn: Option<ClientConn>,
    pub(super) armed: bool,
}

impl Drop for DecodeGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.w
            .waiters
            .lock()
            .expect("waiters lock")
            .remove(&self.room);
        self.w.stats.cancelled.fetch_add(1, Ordering::Relaxed);
        let now = now_ns();
        let gone = self.conn.as_ref().and_then(ClientConn::gone_ns);
        self.w.record(self.room, |r| {
            r.outcome = "cancelled";
            r.ended_ns = now;
            r.client_gone_ns = gone.unwrap_or(0);
        });
        if let Some(to) = self.prefill {
            let w = self.w.clone();
            let room = self.room;
            tokio::spawn(async move {
                let room_s = room.to_string();
                w.pushers
                    .send(to, &[&b"ABORT"[..], room_s.as_bytes()])
                    .await;
            });
        }
    }
}

impl Worker {
    /// `--fault unknown-room`: a `BOOTSTRAP` for a room no router created and no prefill
    /// received, with this decode's KV endpoint, as a client talking to prefill's KV port
    /// directly would send. Recorded as `injected-unknown-room`.
    async fn inject_unknown_room(&self, prefill: SocketAddr, kv: SocketAddr) {
        let room = rand::rng().random::<u64>();
        self.send_bootstrap(prefill, room, kv).await;
        self.injected(room, Fault::UnknownRoom);
    }

    /// `BOOTSTRAP room ip port` to prefill's KV port, recorded in the room log.
    async fn send_bootstrap(&self, prefill: SocketAddr, room: u64, kv: SocketAddr) {
        let (room_s, ip_s, port_s) = (room.to_string(), kv.ip().to_string(), kv.port().to_string());
        self.pushers
            .send(
                prefill,
                &[
                    &b"BOOTSTRAP"[..],
                    room_s.as_bytes(),
                    ip_s.as_bytes(),
                    port_s.as_bytes(),
                ],
            )
            .await;
        let now = now_ns();
        self.record(room, |r| {
            r.bootstrap_frames += 1;
            if r.bootstrap_ns == 0 {
                r.bootstrap_ns = now;
            }
        });
    }

    /// Record how a decode request ended: `outcome`, or `cancel-ignored` (with `outcome` as
    /// `final_outcome`) when its client had gone and it went on (`--decode-ignores-cancel`).
    pub(super) fn end_decode(
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
            } else {
                r.outcome = outcome;
            }
        });
    }
}

pub(super) async fn decode(
    w: Shared,
    p: Parsed,
    rid: String,
    request_id: Option<String>,
    conn: Option<ClientConn>,
    mut trace: ReqTrace,
    t0: u64,
) -> Response {
    let t_tok = now_ns();
    if let Some((status, msg, _)) = w.check(&p, &rid) {
        let t_end = now_ns();
        w.stats.rejected_400.fetch_add(1, Ordering::Relaxed);
        let th = trace.thread(&w, false, t0, t_end, Some(&msg));
        trace.stage(th, "tokenize", t0, t_tok);
        trace.finish(&w, &rid, p.room, t0, t_end);
        if let Some(room) = p.room {
            w.record(room, |r| r.received_ns = t0);
            w.end_decode(room, conn.as_ref(), "rejected", |r| {
                r.rid = rid.clone();
                r.request_id = request_id.clone();
                r.status = status.as_u16();
                r.input_tokens = p.input_tokens;
            });
        }
        return error_response(status, &msg);
    }
    w.stats.admitted.fetch_add(1, Ordering::Relaxed);
    let _inflight = {
        w.inflight.fetch_add(1, Ordering::Relaxed);
        InflightGuard(&w.inflight)
    };
    let t_sched = now_ns();
    let mut t_boot = t_sched;
    let mut t_kv = t_sched;
    let mut err: Option<(StatusCode, String)> = None;
    let mut guard = None;
    let faults = &w.args.faults;
    let stranded = faults.stranded_holder(p.room);
    if let Some(room) = p.room {
        w.record(room, |r| {
            r.rid = rid.clone();
            r.request_id = request_id.clone();
            r.input_tokens = p.input_tokens;
            r.received_ns = t0;
        });
        if stranded == Some(Holder::Prefill) {
            return give_up_before_bootstrap(&w, &p, &rid, room, conn.as_ref(), trace, t0, t_tok);
        }
        let (tx, rx) = oneshot::channel();
        w.waiters
            .lock()
            .expect("waiters lock")
            .insert(room, DecodeWaiter { done: tx });
        let mut g = DecodeGuard {
            w: w.clone(),
            room,
            prefill: None,
            conn: conn.clone(),
            armed: true,
        };
        if w.args.bootstrap_delay_us > 0 {
            tokio::time::sleep(Duration::from_micros(w.args.bootstrap_delay_us)).await;
        }
        let endpoint = match &p.bootstrap {
            Some((host, port)) => w.prefill_endpoint(host, *port).await,
            None => Err("request has bootstrap_room but no bootstrap_host/bootstrap_port".into()),
        };
        match endpoint {
            Err(e) => {
                w.stats.route_failures.fetch_add(1, Ordering::Relaxed);
                g.armed = false;
                w.waiters.lock().expect("waiters lock").remove(&room);
                err = Some((
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!(
                        "Failed to get bootstrap info for request rid={rid} bootstrap_room={room}: {e}"
                    ),
                ));
            }
            Ok(to) => {
                g.prefill = Some(to);
                let kv = w.kv_addr.lock().expect("kv addr").expect("bound at start");
                w.send_bootstrap(to, room, kv).await;
                t_boot = now_ns();
                if w.args.faults.hits(Fault::UnknownRoom) {
                    w.inject_unknown_room(to, kv).await;
                }
                // `--fault stranded-kv`, decode holds: prefill aborted at once and told nothing,
                // so this room waits the fault's hold instead of the usual KV timeout.
                let kv_wait = Duration::from_millis(if stranded == Some(Holder::Decode) {
                    faults.fault_hold_ms
                } else {
                    w.args.kv_timeout_ms
                });
                match tokio::time::timeout(kv_wait, rx).await {
                    Ok(Ok(())) => {
                        g.armed = false;
                        t_kv = now_ns();
                    }
                    _ => {
                        w.stats.kv_timeouts.fetch_add(1, Ordering::Relaxed);
                        err = Some((
                            StatusCode::INTERNAL_SERVER_ERROR,
                            format!(
                                "Decode transfer failed for request rank=0 rid={rid} bootstrap_room={room} with exception KVTransferError: timed out waiting for KV cache after {} ms",
                                kv_wait.as_millis()
                            ),
                        ));
                    }
                }
            }
        }
        guard = Some(g);
    }
    if let Some((status, msg)) = err {
        // A KV timeout is a local failure, not a cancel: like SGLang's decode, no ABORT goes
        // to prefill (its pending entry for the room expires on its own).
        if let Some(mut g) = guard.take()
            && g.armed
        {
            g.armed = false;
            w.waiters.lock().expect("waiters lock").remove(&g.room);
        }
        let t_end = now_ns();
        let th = trace.thread(&w, false, t0, t_tok, None);
        trace.stage(th, "tokenize", t0, t_tok);
        trace.stage(th, "api_server_dispatch", t_tok, t_tok);
        let th = trace.thread(&w, true, t_sched, t_end, Some(&msg));
        trace.stage(th, "decode_bootstrap", t_sched, t_boot);
        trace.finish(&w, &rid, p.room, t0, t_end);
        if let Some(room) = p.room {
            let outcome = if stranded == Some(Holder::Decode) {
                w.stats.faults_injected.fetch_add(1, Ordering::Relaxed);
                Fault::StrandedKv.outcome()
            } else if status == StatusCode::INTERNAL_SERVER_ERROR {
                "kv-failed"
            } else {
                "failed"
            };
            w.end_decode(room, conn.as_ref(), outcome, |r| r.status = status.as_u16());
        }
        return error_response(status, &msg);
    }
    drop(guard);
    let n = p
        .max_new_tokens
        .unwrap_or(w.args.default_max_new_tokens)
        .max(1);
    let delay = Duration::from_micros(w.args.decode_token_delay_us);
    let room = p.room;
    if !p.stream {
        if !delay.is_zero() {
            tokio::time::sleep(delay * n as u32).await;
        }
        let t_end = now_ns();
        finish_decode_spans(
            &w, trace, &rid, room, t0, t_tok, t_sched, t_boot, t_kv, t_end,
        );
        if let Some(room) = room {
            w.end_decode(room, conn.as_ref(), "generated", |r| {
                r.status = 200;
                r.generated_tokens = n;
            });
        }
        w.stats.completed.fetch_add(1, Ordering::Relaxed);
        let text = gen_text(n);
        let body = render_final(
            &p,
            &rid,
            &w.args.model_path,
            &text,
            n,
            None,
            (t_end - t0) as f64 / 1e9,
        );
        let ct = if p.api == Api::Generate || !p.stream {
            "application/json"
        } else {
            "text/event-stream"
        };
        return Response::builder()
            .status(200)
            .header("content-type", ct)
            .body(Body::from(body))
            .expect("static");
    }
    // Streaming: one SSE event per token, produced by a task that stops when the client goes
    // (or, with --decode-ignores-cancel, generates every token all the same).
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(16);
    if let Some(room) = room {
        let now = now_ns();
        w.record(room, |r| {
            r.status = 200;
            r.answered_ns = now;
        });
    }
    let w2 = w.clone();
    tokio::spawn(async move {
        let w = w2;
        let ignore = w.args.decode_ignores_cancel;
        let mut text = String::new();
        let mut sent = 0;
        for i in 0..n {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            text.push_str(WORDS[(i as usize) % WORDS.len()]);
            let last = i + 1 == n;
            let ev = render_chunk(
                &p,
                &rid,
                &w.args.model_path,
                &text,
                WORDS[(i as usize) % WORDS.len()],
                i + 1,
                last,
            );
            if tx.send(Ok(ev)).await.is_err() && !ignore {
                break;
            }
            sent = i + 1;
        }
        let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
        let t_end = now_ns();
        finish_decode_spans(
            &w, trace, &rid, room, t0, t_tok, t_sched, t_boot, t_kv, t_end,
        );
        if let Some(room) = room {
            let outcome = if sent == n {
                "generated"
            } else {
                "client-gone"
            };
            w.end_decode(room, conn.as_ref(), outcome, |r| r.generated_tokens = sent);
        }
        w.stats.completed.fetch_add(1, Ordering::Relaxed);
    });
    let stream =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) });
    Response::builder()
        .status(200)
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(Body::from_stream(stream))
        .expect("static response parts")
}

/// `--fault stranded-kv`, prefill holds: decode drops the request before it bootstraps (as a
/// decode that lost it would) and answers the abort; prefill, told nothing, keeps the room.
#[allow(clippy::too_many_arguments)]
fn give_up_before_bootstrap(
    w: &Shared,
    p: &Parsed,
    rid: &str,
    room: u64,
    conn: Option<&ClientConn>,
    mut trace: ReqTrace,
    t0: u64,
    t_tok: u64,
) -> Response {
    let msg =
        format!("Request {rid} aborted: decode dropped bootstrap_room={room} before bootstrap");
    let t_end = now_ns();
    let th = trace.thread(w, false, t0, t_tok, None);
    trace.stage(th, "tokenize", t0, t_tok);
    let th = trace.thread(w, true, t_tok, t_end, Some(&msg));
    trace.stage(th, "decode_prepare", t_tok, t_end);
    trace.finish(w, rid, Some(room), t0, t_end);
    w.end_decode(room, conn, "aborted", |r| r.status = 200);
    let body = render_final(
        p,
        rid,
        &w.args.model_path,
        "",
        0,
        Some(&msg),
        (t_end - t0) as f64 / 1e9,
    );
    Response::builder()
        .status(200)
        .header("content-type", final_content_type(p.stream))
        .body(Body::from(body))
        .expect("static")
}

#[allow(clippy::too_many_arguments)]
pub(super) fn finish_decode_spans(
    w: &Worker,
    mut trace: ReqTrace,
    rid: &str,
    room: Option<u64>,
    t0: u64,
    t_tok: u64,
    t_sched: u64,
    t_boot: u64,
    t_kv: u64,
    t_end: u64,
) {
    let th = trace.thread(w, false, t0, t_tok, None);
    trace.stage(th, "tokenize", t0, t_tok);
    trace.stage(th, "api_server_dispatch", t_tok, t_tok);
    let th = trace.thread(w, true, t_sched, t_end, None);
    if room.is_some() {
        trace.stage(th, "decode_bootstrap", t_sched, t_boot);
        trace.stage(th, "decode_transferred", t_boot, t_kv);
    }
    trace.stage(th, "decode_forward", t_kv, t_end);
    trace.finish(w, rid, room, t0, t_end);
}
