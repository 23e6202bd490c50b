//! The KV side channel, shaped like NIXL's handshake: decode asks prefill for request N's KV
//! at prefill's `remote_host:remote_port`, prefill sends it back to decode's own side port.
//! ZMTP PUSH/PULL connections as in `kvlink` (one persistent connection per peer and
//! direction). All parts ASCII except the payload:
//!
//! | direction        | frames                                          |
//! |------------------|-------------------------------------------------|
//! | decode → prefill | `NIXL_READ`, N, decode host, decode side port   |
//! | prefill → decode | `NIXL_KV`, N, chunk index, payload (binary)     |
//! | prefill → decode | `NIXL_DONE`, N, token count                     |
//! | decode → prefill | `NIXL_ABORT`, N                                 |

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;

use super::worker::Worker;
use crate::ids::now_ns;
use crate::kvlink::parse_u64;

pub const READ: &[u8] = b"NIXL_READ";
pub const KV: &[u8] = b"NIXL_KV";
pub const DONE: &[u8] = b"NIXL_DONE";
pub const ABORT: &[u8] = b"NIXL_ABORT";

fn text(b: &Bytes) -> Option<&str> {
    std::str::from_utf8(b).ok().filter(|s| !s.is_empty())
}

impl Worker {
    /// One message off the side channel (either role: a worker holds KV it computed for a
    /// remote decode, and pulls KV for requests that came with a remote prefill's params).
    pub(super) fn on_side_message(self: &Arc<Self>, parts: Vec<Bytes>) {
        let verb = parts.first().map(|b| &b[..]).unwrap_or(b"");
        let n = parts.get(1).and_then(text);
        let bump = |c: &std::sync::atomic::AtomicU64| {
            c.fetch_add(1, Ordering::Relaxed);
        };
        match (verb, n) {
            (READ, Some(n)) if parts.len() >= 4 => {
                let to = match (
                    parts.get(2).and_then(text).map(str::parse::<IpAddr>),
                    parts.get(3).and_then(|p| parse_u64(p)),
                ) {
                    (Some(Ok(ip)), Some(port)) if port <= u16::MAX as u64 => {
                        SocketAddr::new(ip, port as u16)
                    }
                    _ => return bump(&self.stats.unknown_frames),
                };
                bump(&self.stats.nixl_read_frames);
                let now = now_ns();
                self.record(n, |r| {
                    r.read_frames += 1;
                    if r.read_ns == 0 {
                        r.read_ns = now;
                    }
                });
                let hold = self.holds.lock().ok().and_then(|mut h| h.remove(n));
                match hold {
                    Some(h) => self.spawn_transfer(n.to_owned(), h.tokens, to),
                    None => bump(&self.stats.reads_unmatched),
                }
            }
            (ABORT, Some(n)) => {
                bump(&self.stats.nixl_abort_frames);
                let held = self
                    .holds
                    .lock()
                    .ok()
                    .and_then(|mut h| h.remove(n))
                    .is_some();
                let now = now_ns();
                self.record(n, |r| {
                    r.abort_frames += 1;
                    if held {
                        r.outcome = "aborted";
                        r.kv_done_ns = now;
                    }
                });
            }
            (KV, Some(n)) if parts.len() >= 4 => {
                let own = self
                    .waiters
                    .lock()
                    .ok()
                    .and_then(|w| w.get(n).map(|w| w.own.clone()));
                match own {
                    Some(own) => {
                        bump(&self.stats.nixl_kv_frames);
                        self.record(&own, |r| r.kv_chunks += 1);
                    }
                    None => bump(&self.stats.kv_chunks_unmatched),
                }
            }
            (DONE, Some(n)) if parts.len() >= 3 => {
                bump(&self.stats.nixl_done_frames);
                let tokens = parts.get(2).and_then(|t| parse_u64(t)).unwrap_or(0);
                let waiter = self.waiters.lock().ok().and_then(|mut w| w.remove(n));
                if let Some(wt) = waiter {
                    let now = now_ns();
                    self.record(&wt.own, |r| {
                        r.kv_done = true;
                        r.kv_done_ns = now;
                    });
                    let _ = wt.done.send(tokens);
                }
            }
            _ => bump(&self.stats.unknown_frames),
        }
    }

    /// Send N's KV (`tokens × --kv-bytes-per-token` bytes in ≤64 KiB `NIXL_KV` chunks, then
    /// `NIXL_DONE`) to the decode that asked for it.
    pub(super) fn spawn_transfer(self: &Arc<Self>, n: String, tokens: u64, to: SocketAddr) {
        let w = self.clone();
        tokio::spawn(async move {
            const CHUNK: usize = 64 * 1024;
            static ZEROS: [u8; CHUNK] = [0u8; CHUNK];
            let total = (tokens.max(1) * w.a.kv_bytes_per_token) as usize;
            let mut buf = bytes::BytesMut::with_capacity(total + 64);
            let (mut sent, mut idx) = (0usize, 0u32);
            while sent < total || idx == 0 {
                let len = (total - sent).min(CHUNK);
                let idx_s = idx.to_string();
                crate::zmtp::encode_message(
                    &mut buf,
                    &[KV, n.as_bytes(), idx_s.as_bytes(), &ZEROS[..len]],
                );
                sent += len;
                idx += 1;
            }
            let tok_s = tokens.to_string();
            crate::zmtp::encode_message(&mut buf, &[DONE, n.as_bytes(), tok_s.as_bytes()]);
            w.pushers
                .send_encoded(to, buf.freeze(), idx as u64 + 1)
                .await;
            w.stats.kv_transfers.fetch_add(1, Ordering::Relaxed);
            w.stats
                .nixl_kv_frames
                .fetch_add(idx as u64, Ordering::Relaxed);
            w.stats.nixl_done_frames.fetch_add(1, Ordering::Relaxed);
            let now = now_ns();
            w.record(&n, |r| {
                r.kv_chunks += idx;
                r.kv_done = true;
                r.kv_done_ns = now;
                r.outcome = "transferred";
            });
        });
    }
}
