//! The eBPF tracker as a whole (`ingest::ebpf::track`): an input is a sequence of kernel records
//! (connects, accepts, closes, process exits, and data pieces in both directions with arbitrary
//! offsets, totals and timestamps) for a router, a prefill, a decode, a process whose role is not
//! known yet and one that is not watched, over a handful of fds each. The format:
//!
//! `op` byte (`op & 7` the record, `op >> 3` the milliseconds that pass before it), a selector
//! byte (process `s % 5`, fd `3 + (s / 5) % 6`), then for connect/accept a peer selector byte and
//! for data a length `u16` (little endian), a second `u16` (a start piece's extra `total`, a tail
//! piece's distance from the end, or an arbitrary offset), and the bytes themselves (a `0x01`
//! byte stands for a `"prompt":"<canary>",` member, see below). Records: 0 connect, 1 accept,
//! 2 close, 3 process exit, 4 ingress piece at a syscall's start, 5 egress piece at a
//! syscall's start, 6 tail piece of the last syscall, 7 a piece of the last syscall at any
//! offset.
//!
//! The whole sequence is played four times (timestamps keep rising), against small limits (16
//! connections, 4 in-flight requests each), so eviction and reuse happen.
//!
//! Holds: no panic; the connection table stays within its limit; the tracker's heap stays
//! below 32 MiB (counted by the allocator); every reason is within its 160-byte bound and
//! none carries the prompt planted in bodies.
#![no_main]

use std::alloc::{GlobalAlloc, Layout, System};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};

use libfuzzer_sys::fuzz_target;
use monitor_common::{Header, kind, syscall};
use revenant::ingest::ebpf::Role;
use revenant::ingest::ebpf::record::{Conn, DataPiece, Record};
use revenant::ingest::ebpf::track::{Clock, Tracker, TrackerLimits};
use revenant_fuzz::{CANARY, has_canary};

/// Counts the bytes the Rust heap holds.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(new_size, Ordering::Relaxed);
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const ROUTER: u32 = 100;
const PREFILL: u32 = 200;
const DECODE: u32 = 300;
const UNKNOWN: u32 = 400;
const UNWATCHED: u32 = 500;
const PROCS: [u32; 5] = [ROUTER, PREFILL, DECODE, UNKNOWN, UNWATCHED];
const LIMITS: TrackerLimits = TrackerLimits {
    max_conns: 16,
    max_pending: 4,
};
const HEAP_BOUND: usize = 32 << 20;
const MAX_REASON: usize = 160;
const PEERS: [&str; 6] = [
    "10.0.0.2:30001",  // prefill, named by the router
    "10.0.0.3:30002",  // decode, named by the router
    "127.0.0.1:31001", // a watched prefill on this node
    "127.0.0.1:31002", // a watched decode on this node
    "127.0.0.1:40000", // a client
    "[::1]:8998",      // bootstrap / side channel
];

struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn u8(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes([self.u8()?, self.u8()?]))
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let (b, rest) = self.0.split_at(n.min(self.0.len()));
        self.0 = rest;
        let mut out = Vec::with_capacity(b.len());
        for &c in b {
            if c == 1 {
                out.extend_from_slice(b"\"prompt\":\"");
                out.extend_from_slice(CANARY.as_bytes());
                out.extend_from_slice(b"\",");
            } else {
                out.push(c);
            }
        }
        out
    }
}

fn tracker() -> Tracker {
    let mut t = Tracker::new(Some("node-a".into()), Clock::default(), LIMITS);
    t.set_role(ROUTER, Role::Router);
    t.set_role(PREFILL, Role::Prefill);
    t.set_role(DECODE, Role::Decode);
    t.set_role(UNKNOWN, Role::Unknown);
    t.add_worker(PEERS[0].parse().unwrap(), Role::Prefill);
    t.add_worker(PEERS[1].parse().unwrap(), Role::Decode);
    t.add_local_listener(31001, Role::Prefill);
    t.add_local_listener(31002, Role::Decode);
    t
}

/// The last syscall's piece per process: its header, fd, syscall and total.
#[derive(Clone, Copy)]
struct Last {
    hdr: Header,
    fd: u32,
    syscall: u32,
    total: u64,
}

fuzz_target!(|data: &[u8]| {
    if has_canary(data) {
        return;
    }
    let base = LIVE.load(Ordering::Relaxed);
    let mut t = tracker();
    let mut out = Vec::new();
    let mut now = 1_000_000u64;
    let mut last: [Option<Last>; 5] = [None; 5];
    for _round in 0..4 {
        let mut input = Input(data);
        while let Some(op) = input.u8() {
            let Some(sel) = input.u8() else { break };
            now += 1 + u64::from(op >> 3) * 1_000_000;
            let p = (sel % 5) as usize;
            let tgid = PROCS[p];
            let fd = 3 + u32::from(sel / 5) % 6;
            let hdr = |k: u32| Header {
                kind: k,
                tgid,
                tid: tgid,
                _pad: 0,
                ts_ns: now,
            };
            match op & 7 {
                0 | 1 => {
                    let peer = input.u8().and_then(|b| PEERS.get(b as usize % 7));
                    let accept = op & 7 == 1;
                    // An accept's listener address, as the source finds it (or not).
                    let local = input
                        .u8()
                        .filter(|_| accept)
                        .and_then(|b| PEERS.get(b as usize % 9));
                    let conn = Conn {
                        hdr: hdr(if accept { kind::ACCEPT } else { kind::CONNECT }),
                        fd,
                        peer: peer.map(|s| s.parse::<SocketAddr>().unwrap()),
                        listener_fd: accept.then_some(fd + 10),
                        local: local.map(|s| s.parse::<SocketAddr>().unwrap()),
                    };
                    let rec = if accept {
                        Record::Accept(conn)
                    } else {
                        Record::Connect(conn)
                    };
                    t.on_record(&rec, &mut out);
                }
                2 => t.on_record(
                    &Record::Close {
                        hdr: hdr(kind::CLOSE),
                        fd,
                    },
                    &mut out,
                ),
                3 => {
                    t.on_record(
                        &Record::Exit {
                            hdr: hdr(kind::EXIT),
                        },
                        &mut out,
                    );
                    t.remove_process(tgid, now, &mut out);
                    // Discovery finds it again, as a rescan would.
                    match tgid {
                        ROUTER => t.set_role(tgid, Role::Router),
                        PREFILL => t.set_role(tgid, Role::Prefill),
                        DECODE => t.set_role(tgid, Role::Decode),
                        UNKNOWN => t.set_role(tgid, Role::Unknown),
                        _ => {}
                    }
                }
                k => {
                    let (Some(len), Some(extra)) = (input.u16(), input.u16()) else {
                        break;
                    };
                    let bytes = input.bytes(len as usize);
                    let piece = match (k, last[p]) {
                        (4 | 5, _) | (_, None) => {
                            let l = Last {
                                hdr: hdr(kind::DATA),
                                fd,
                                syscall: if k == 5 {
                                    syscall::WRITEV
                                } else {
                                    syscall::RECVFROM
                                },
                                total: bytes.len() as u64 + u64::from(extra),
                            };
                            last[p] = Some(l);
                            (l, 0u32)
                        }
                        (6, Some(l)) => {
                            let off = l
                                .total
                                .saturating_sub(bytes.len() as u64 + u64::from(extra));
                            (l, off as u32)
                        }
                        (_, Some(l)) => (l, u32::from(extra)),
                    };
                    let (l, off) = piece;
                    let rec = Record::Data(DataPiece {
                        hdr: l.hdr,
                        fd: l.fd,
                        syscall: l.syscall,
                        total: l.total,
                        off,
                        bytes: &bytes,
                    });
                    t.on_record(&rec, &mut out);
                }
            }
            let _ = t.take_learned();
            assert!(
                t.conn_count() <= LIMITS.max_conns,
                "{} connections",
                t.conn_count()
            );
            let heap = LIVE.load(Ordering::Relaxed).saturating_sub(base);
            assert!(heap <= HEAP_BOUND, "tracker heap {heap} bytes");
            for e in out.drain(..) {
                if let Some(r) = &e.reason {
                    assert!(r.len() <= MAX_REASON, "reason of {} bytes", r.len());
                    assert!(!r.contains(CANARY), "prompt text in a reason: {e:?}");
                }
            }
        }
    }
});
