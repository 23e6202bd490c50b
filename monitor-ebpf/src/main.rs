//! Kernel side of revenant: syscall capture for watched processes only.
//!
//! Only tracepoints are used (kprobes are not compiled into the target kernels and fentry/fexit
//! fail with EPERM there). Filtering happens here, in the kernel: a syscall of a process whose tgid
//! is not in `WATCHED`, or on an fd that is not a tracked socket in `SOCKS`, costs two hash lookups
//! and nothing else. Everything that reaches user space goes through the `EVENTS` ring buffer, and
//! every record that does not fit is counted in the per-CPU `COUNTERS` (nothing vanishes).
#![no_std]
#![no_main]

use core::ffi::c_void;
use core::mem::size_of;

use aya_ebpf::{
    EbpfContext, Global,
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns, generated::bpf_probe_read_user},
    macros::{map, tracepoint},
    maps::{HashMap, PerCpuArray, RingBuf},
    programs::TracePointContext,
};
use monitor_common::{
    ActiveCall, CloseEvent, ConnEvent, DataHeader, Header, LocalEvent, MAX_CAPTURE, MAX_IOVECS,
    MAX_STREAM_PIECES, NO_FD, ProcEvent, capture, counter, inet_sock_set_state as sk, kind,
    sock_key, syscall, watch,
};

/// Leading payload bytes captured per syscall; set by the loader, at most [`MAX_CAPTURE`].
#[unsafe(no_mangle)]
static HEAD_BYTES: Global<u32> = Global::new(monitor_common::DEFAULT_HEAD_BYTES);
/// Trailing payload bytes captured per syscall that moved more than `HEAD_BYTES`.
#[unsafe(no_mangle)]
static TAIL_BYTES: Global<u32> = Global::new(monitor_common::DEFAULT_TAIL_BYTES);
/// Offset of `child_pid` in `sched_process_fork`'s record: it moved between kernel versions, so
/// the loader reads it from tracefs.
#[unsafe(no_mangle)]
static FORK_CHILD_PID_OFFSET: Global<u32> = Global::new(20);
/// Offset of `group_dead` in `sched_process_exit`'s record (kernel 6.16 and later), set by the
/// loader from tracefs; 0 on kernels without the field.
#[unsafe(no_mangle)]
static EXIT_GROUP_DEAD_OFFSET: Global<u32> = Global::new(0);

/// Ring-buffer bytes pending before the consumer is woken; 0 wakes it for every record.
///
/// Waking user space costs the traced thread an irq_work and a wakeup per record when the
/// consumer keeps up; batching wakeups moves that cost off the monitored service. User space
/// also polls on a short timer, so records below the threshold are still read promptly.
#[unsafe(no_mangle)]
static WAKEUP_BYTES: Global<u32> = Global::new(0);

const BPF_RB_NO_WAKEUP: u64 = 1;
const BPF_RB_FORCE_WAKEUP: u64 = 2;
const BPF_RB_AVAIL_DATA: u64 = 0;

#[map]
static WATCHED: HashMap<u32, u32> = HashMap::with_max_entries(8192, 0);
#[map]
static SOCKS: HashMap<u64, u32> = HashMap::with_max_entries(65536, 0);
#[map]
static ACTIVE: HashMap<u64, ActiveCall> = HashMap::with_max_entries(16384, 0);
/// TCP sockets a watched process is connecting (`struct sock` address → its tgid), between
/// `SYN_SENT` and the next state: the local port is only known once the handshake is done.
#[map]
static CONNECTING: HashMap<u64, u32> = HashMap::with_max_entries(16384, 0);
/// A syscall's head window (entry [`HEAD`]) and tail window (entry [`TAIL`]), each gathered
/// across the syscall's iovecs into one record: a response written as headers + body, or
/// hyper's 13-iovec streamed answer, costs at most two records instead of one per iovec.
#[map]
static GATHER: PerCpuArray<Gather> = PerCpuArray::with_max_entries(2, 0);
const HEAD: u32 = 0;
const TAIL: u32 = 1;

#[repr(C)]
struct Gather {
    /// `len` counts the bytes gathered so far; `off` is the window's start in the syscall.
    h: DataHeader,
    /// Twice the largest window, so that the verifier bounds `filled + n` by two independent
    /// checks (`filled < MAX_CAPTURE`, `n <= MAX_CAPTURE`); at most `MAX_CAPTURE` are used.
    data: [u8; 2 * MAX_CAPTURE],
    /// A read failed: later pieces would land at the wrong offsets, so the window stops there.
    broken: u32,
}
#[map]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(counter::COUNT, 0);
#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(16 << 20, 0);

const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;
const EINPROGRESS: i64 = 115;
const IPPROTO_TCP: u16 = 6;
const TCP_ESTABLISHED: i32 = 1;
const TCP_SYN_SENT: i32 = 2;

#[inline(always)]
fn count(idx: u32, n: u64) {
    if let Some(p) = COUNTERS.get_ptr_mut(idx) {
        // Per-CPU slot: no other CPU writes it.
        unsafe { *p += n };
    }
}

/// Puts a map value in its own stack slot, for a helper that copies it from there. Given a
/// constant's address instead, LLVM may point at any equal bytes of read-only data: `&0u32`
/// became the address of `EXIT_GROUP_DEAD_OFFSET`, a global the loader sets (32 on kernel 6.18),
/// and `&2u32` a `.rodata.cst4` constant, so map entries held what the loader wrote there. A
/// volatile store keeps the value in the slot the helper reads.
#[inline(always)]
fn store(slot: &mut u32, value: u32) {
    // SAFETY: `slot` is a valid, exclusive reference.
    unsafe { core::ptr::write_volatile(slot, value) };
}

/// Syscall tracepoint records keep every argument in an 8-byte slot starting at offset 16.
#[inline(always)]
fn arg(ctx: &TracePointContext, slot: usize) -> u64 {
    unsafe { core::ptr::read(ctx.as_ptr().cast::<u8>().add(16 + 8 * slot).cast::<u64>()) }
}

#[inline(always)]
fn header(kind: u32, pid_tgid: u64) -> Header {
    Header {
        kind,
        tgid: (pid_tgid >> 32) as u32,
        tid: pid_tgid as u32,
        _pad: 0,
        ts_ns: unsafe { bpf_ktime_get_ns() },
    }
}

#[inline(always)]
fn wakeup_flags() -> u64 {
    let threshold = WAKEUP_BYTES.load() as u64;
    if threshold == 0 {
        return 0;
    }
    if EVENTS.query(BPF_RB_AVAIL_DATA) >= threshold {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    }
}

/// Process records are rare and user space must act on them quickly (start watching).
#[inline(always)]
fn send_now<T>(rec: &T) {
    match EVENTS.output::<T>(rec, BPF_RB_FORCE_WAKEUP) {
        Ok(()) => count(counter::SENT, 1),
        Err(_) => count(counter::RINGBUF_DROPS, 1),
    }
}

#[inline(always)]
fn send<T>(rec: &T) {
    match EVENTS.output::<T>(rec, wakeup_flags()) {
        Ok(()) => count(counter::SENT, 1),
        Err(_) => count(counter::RINGBUF_DROPS, 1),
    }
}

#[inline(always)]
fn watched(tgid: u32) -> bool {
    unsafe { WATCHED.get(&tgid) }.is_some()
}

// ---------------------------------------------------------------------------------------------
// Payload syscalls: remember the arguments at enter, capture at exit (the bytes are there then).

#[inline(always)]
fn data_enter(ctx: &TracePointContext, sc: u32) -> Result<u32, u32> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if !watched(tgid) {
        return Ok(0);
    }
    let fd = arg(ctx, 0) as u32;
    if unsafe { SOCKS.get(&sock_key(tgid, fd)) }.is_none() {
        return Ok(0);
    }
    let call = ActiveCall {
        ptr: arg(ctx, 1),
        len: arg(ctx, 2),
        fd,
        syscall: sc,
    };
    if ACTIVE.insert(&pid_tgid, &call, 0).is_err() {
        count(counter::ACTIVE_FULL, 1);
    }
    Ok(0)
}

/// What every piece of one syscall shares.
#[derive(Clone, Copy)]
#[repr(C)]
struct Capture {
    pid_tgid: u64,
    ts_ns: u64,
    fd: u32,
    syscall: u32,
    total: u64,
    head: u64,
    /// Start of the tail window; `total` when there is no tail.
    tail_start: u64,
}

#[inline(always)]
fn data_exit(ctx: &TracePointContext) -> Result<u32, u32> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let call = match unsafe { ACTIVE.get(&pid_tgid) } {
        Some(c) => *c,
        None => return Ok(0),
    };
    let _ = ACTIVE.remove(&pid_tgid);
    count(counter::SEEN, 1);
    let ret = arg(ctx, 0) as i64;
    if ret <= 0 {
        return Ok(0);
    }
    let total = ret as u64;
    let tgid = (pid_tgid >> 32) as u32;
    let mode = match unsafe { SOCKS.get(&sock_key(tgid, call.fd)) } {
        Some(m) => *m,
        None => capture::EDGES,
    };
    let vectored = matches!(
        call.syscall,
        syscall::READV | syscall::WRITEV | syscall::RECVMSG | syscall::SENDMSG
    );
    if mode == capture::STREAM && !vectored {
        capture_stream(pid_tgid, &call, total);
        return Ok(0);
    }
    let whole = mode == capture::WHOLE || mode == capture::STREAM;
    let (head, tail) = if whole {
        (MAX_CAPTURE as u64, MAX_CAPTURE as u64)
    } else {
        (HEAD_BYTES.load() as u64, TAIL_BYTES.load() as u64)
    };
    let tail_start = if total > head {
        let t = total.saturating_sub(tail);
        if t > head { t } else { head }
    } else {
        total
    };
    let cap = Capture {
        pid_tgid,
        ts_ns: unsafe { bpf_ktime_get_ns() },
        fd: call.fd,
        syscall: call.syscall,
        total,
        head,
        tail_start,
    };
    begin(HEAD, &cap, 0);
    let has_tail = cap.tail_start < cap.total;
    if has_tail {
        begin(TAIL, &cap, cap.tail_start);
    }
    match call.syscall {
        syscall::READV | syscall::WRITEV => capture_iov(&cap, call.ptr, call.len),
        syscall::RECVMSG | syscall::SENDMSG => {
            // struct user_msghdr { void *name; int namelen; struct iovec *iov; size_t iovlen; ... }
            let msg = call.ptr as *const u64;
            let iov = unsafe { aya_ebpf::helpers::bpf_probe_read_user(msg.add(2)) };
            let n = unsafe { aya_ebpf::helpers::bpf_probe_read_user(msg.add(3)) };
            match (iov, n) {
                (Ok(iov), Ok(n)) => capture_iov(&cap, iov, n),
                // Still say that the syscall moved `total` bytes: user space marks a gap.
                _ => count(counter::READ_FAILURES, 1),
            }
        }
        _ => capture_piece(&cap, call.ptr, 0, total),
    }
    if mode == capture::EDGES {
        mark_metrics_request(tgid, call.fd);
        mark_zmtp_greeting(tgid, call.fd);
    }
    flush(HEAD);
    if has_tail {
        flush(TAIL);
    }
    Ok(0)
}

/// A `/metrics` request starts the syscall just gathered (read by the server, or written by
/// the client): the connection's answers are long pages read for one line anywhere in them
/// (vLLM's `vllm:cache_config_info`), so its later syscalls are captured whole. Done here
/// rather than by user space, which would mark it only after this request's answer went by.
#[inline(always)]
fn mark_metrics_request(tgid: u32, fd: u32) {
    const REQUEST: [u8; 12] = *b"GET /metrics";
    let Some(g) = GATHER.get_ptr(HEAD) else {
        return;
    };
    // SAFETY: as in `begin`.
    let g = unsafe { &*g };
    if (g.h.len as usize) <= REQUEST.len() {
        return;
    }
    let mut i = 0;
    while i < REQUEST.len() {
        if g.data[i] != REQUEST[i] {
            return;
        }
        i += 1;
    }
    if !matches!(g.data[REQUEST.len()], b' ' | b'?') {
        return;
    }
    /// `BPF_EXIST`: update the socket's entry, never create one.
    const BPF_EXIST: u64 = 2;
    let mut mode = 0;
    store(&mut mode, capture::STREAM);
    if SOCKS.insert(&sock_key(tgid, fd), &mode, BPF_EXIST).is_ok() {
        count(counter::METRICS_MARKED, 1);
    }
}

/// A ZMTP greeting starts the syscall just gathered (the signature: `FF`, eight bytes, `7F`):
/// the connection is a ZeroMQ control channel, where every message counts, so its later
/// syscalls are captured whole ([`capture::WHOLE`]). User space marks it too once the tracker
/// reads the greeting, but only a ring buffer's latency later: the first batch a peer writes
/// right behind its greeting would go by in the head and tail windows, and the stream would be
/// out of sync from its first message.
#[inline(always)]
fn mark_zmtp_greeting(tgid: u32, fd: u32) {
    let Some(g) = GATHER.get_ptr(HEAD) else {
        return;
    };
    // SAFETY: as in `begin`.
    let g = unsafe { &*g };
    if (g.h.len as usize) < 10 || g.data[0] != 0xFF || g.data[9] != 0x7F {
        return;
    }
    /// `BPF_EXIST`: update the socket's entry, never create one.
    const BPF_EXIST: u64 = 2;
    let mut mode = 0;
    store(&mut mode, capture::WHOLE);
    let _ = SOCKS.insert(&sock_key(tgid, fd), &mode, BPF_EXIST);
}

/// One syscall of a [`capture::STREAM`] socket, shared with [`stream_step`].
#[repr(C)]
struct StreamWalk {
    cap: Capture,
    ptr: u64,
}

/// Sends bytes `[i·MAX_CAPTURE, (i+1)·MAX_CAPTURE)` of the syscall as one record (a
/// `bpf_loop` callback). Returns 1 past the end.
#[inline(never)]
extern "C" fn stream_step(i: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `ctx` is the `StreamWalk` on `capture_stream`'s stack, alive for the whole loop.
    let w = unsafe { &*ctx.cast::<StreamWalk>() };
    let off = i * MAX_CAPTURE as u64;
    if off >= w.cap.total {
        return 1;
    }
    let rest = w.cap.total - off;
    let len = if rest < MAX_CAPTURE as u64 {
        rest
    } else {
        MAX_CAPTURE as u64
    };
    begin(HEAD, &w.cap, off);
    append(HEAD, w.ptr + off, len);
    flush(HEAD);
    0
}

/// Sends a non-vectored syscall's bytes whole, in order, as up to [`MAX_STREAM_PIECES`]
/// records; what lies past them is counted and user space marks it a gap.
#[inline(always)]
fn capture_stream(pid_tgid: u64, call: &ActiveCall, total: u64) {
    let mut w = StreamWalk {
        cap: Capture {
            pid_tgid,
            ts_ns: unsafe { bpf_ktime_get_ns() },
            fd: call.fd,
            syscall: call.syscall,
            total,
            head: total,
            tail_start: total,
        },
        ptr: call.ptr,
    };
    let walk: *mut StreamWalk = &mut w;
    // SAFETY: bpf_loop calls `stream_step` with `walk` at most MAX_STREAM_PIECES times,
    // synchronously.
    unsafe {
        aya_ebpf::helpers::generated::bpf_loop(
            MAX_STREAM_PIECES,
            stream_step as *const () as *mut c_void,
            walk.cast::<c_void>(),
            0,
        );
    }
    if total > MAX_STREAM_PIECES as u64 * MAX_CAPTURE as u64 {
        count(counter::STREAM_TRUNCATED, 1);
    }
}

/// State of one walk over the iovecs of a vectored syscall, shared with [`iov_step`].
#[repr(C)]
struct IovWalk {
    cap: Capture,
    iov: u64,
    iovcnt: u64,
    /// Syscall offset where the next iovec's bytes start.
    off: u64,
}

/// One iovec of a walk (a `bpf_loop` callback, verified once rather than once per iteration:
/// an unrolled walk of [`MAX_IOVECS`] exceeds the verifier's budget). Returns 1 to stop.
#[inline(never)]
extern "C" fn iov_step(i: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `ctx` is the `IovWalk` on `capture_iov`'s stack, alive for the whole loop.
    let w = unsafe { &mut *ctx.cast::<IovWalk>() };
    if i >= w.iovcnt || w.off >= w.cap.total {
        return 1;
    }
    let entry = (w.iov + 16 * i) as *const [u64; 2];
    let [base, len] = match unsafe { aya_ebpf::helpers::bpf_probe_read_user(entry) } {
        Ok(v) => v,
        Err(_) => {
            count(counter::READ_FAILURES, 1);
            return 1;
        }
    };
    let remaining = w.cap.total - w.off;
    let len = if len < remaining { len } else { remaining };
    capture_piece(&w.cap, base, w.off, len);
    w.off += len;
    0
}

/// Walks up to [`MAX_IOVECS`] iovecs in order; only their parts in the head or tail window are
/// sent. hyper writes a streamed answer's last chunks and its terminating `0\r\n\r\n` as the
/// 13th iovec of one `writev`: the tail window must reach the last iovecs.
#[inline(always)]
fn capture_iov(cap: &Capture, iov: u64, iovcnt: u64) {
    let mut w = IovWalk {
        cap: Capture { ..*cap },
        iov,
        iovcnt,
        off: 0,
    };
    let walk: *mut IovWalk = &mut w;
    // SAFETY: bpf_loop calls `iov_step` with `walk` at most MAX_IOVECS times, synchronously.
    unsafe {
        aya_ebpf::helpers::generated::bpf_loop(
            MAX_IOVECS,
            iov_step as *const () as *mut c_void,
            walk.cast::<c_void>(),
            0,
        );
    }
    if w.off < cap.total && w.iovcnt > MAX_IOVECS as u64 {
        count(counter::IOV_TRUNCATED, 1);
    }
}

/// A contiguous user buffer holding syscall bytes `[off, off + len)`: add the parts of it that
/// fall in the head window `[0, head)` or the tail window `[tail_start, total)` to their records.
/// Pieces arrive in syscall order, so each window fills contiguously.
#[inline(always)]
fn capture_piece(cap: &Capture, base: u64, off: u64, len: u64) {
    let end = off + len;
    if off < cap.head {
        let h_end = if end < cap.head { end } else { cap.head };
        append(HEAD, base, h_end - off);
    }
    if end > cap.tail_start {
        let t_off = if off > cap.tail_start {
            off
        } else {
            cap.tail_start
        };
        append(TAIL, base + (t_off - off), end - t_off);
    }
}

/// Starts window `slot` of the syscall in `cap` at syscall offset `off`.
#[inline(always)]
fn begin(slot: u32, cap: &Capture, off: u64) {
    let Some(g) = GATHER.get_ptr_mut(slot) else {
        return;
    };
    // SAFETY: per-CPU entry; programs do not nest on one CPU while they use it.
    let g = unsafe { &mut *g };
    g.h = DataHeader {
        hdr: Header {
            kind: kind::DATA,
            tgid: (cap.pid_tgid >> 32) as u32,
            tid: cap.pid_tgid as u32,
            _pad: 0,
            ts_ns: cap.ts_ns,
        },
        fd: cap.fd,
        syscall: cap.syscall,
        total: cap.total,
        off: off as u32,
        len: 0,
    };
    g.broken = 0;
}

/// Copies up to `len` user bytes from `src` onto the end of window `slot`.
#[inline(always)]
fn append(slot: u32, src: u64, len: u64) {
    let Some(g) = GATHER.get_ptr_mut(slot) else {
        return;
    };
    // SAFETY: as in `begin`.
    let g = unsafe { &mut *g };
    let filled = g.h.len as u64;
    if g.broken != 0 || filled >= MAX_CAPTURE as u64 {
        return;
    }
    let room = MAX_CAPTURE as u64 - filled;
    let mut n = if len < room { len } else { room };
    if n > MAX_CAPTURE as u64 {
        n = MAX_CAPTURE as u64;
    }
    if n == 0 {
        return;
    }
    let rc = unsafe {
        bpf_probe_read_user(
            g.data.as_mut_ptr().add(filled as usize).cast::<c_void>(),
            n as u32,
            src as *const c_void,
        )
    };
    if rc != 0 {
        count(counter::READ_FAILURES, 1);
        g.broken = 1;
        return;
    }
    g.h.len = (filled + n) as u32;
}

/// Sends window `slot` as one record: its header and the bytes gathered (none if the first
/// read failed: user space still learns the syscall's size and marks a gap).
#[inline(always)]
fn flush(slot: u32) {
    let Some(g) = GATHER.get_ptr_mut(slot) else {
        return;
    };
    // SAFETY: as in `begin`.
    let g = unsafe { &*g };
    let mut n = g.h.len as usize;
    if n > MAX_CAPTURE {
        n = MAX_CAPTURE;
    }
    let size = size_of::<DataHeader>() + n;
    let bytes = unsafe { core::slice::from_raw_parts((g as *const Gather).cast::<u8>(), size) };
    match EVENTS.output::<[u8]>(bytes, wakeup_flags()) {
        Ok(()) => {
            count(counter::SENT, 1);
            count(counter::BYTES_CAPTURED, n as u64);
        }
        Err(_) => count(counter::RINGBUF_DROPS, 1),
    }
}

macro_rules! data_probes {
    ($($enter:ident, $try_enter:ident, $exit:ident, $sc:expr;)*) => {$(
        #[tracepoint]
        pub fn $enter(ctx: TracePointContext) -> u32 {
            match $try_enter(&ctx) { Ok(r) | Err(r) => r }
        }
        #[inline(always)]
        fn $try_enter(ctx: &TracePointContext) -> Result<u32, u32> { data_enter(ctx, $sc) }
        #[tracepoint]
        pub fn $exit(ctx: TracePointContext) -> u32 {
            match data_exit(&ctx) { Ok(r) | Err(r) => r }
        }
    )*};
}

data_probes! {
    sys_enter_read, try_sys_enter_read, sys_exit_read, syscall::READ;
    sys_enter_write, try_sys_enter_write, sys_exit_write, syscall::WRITE;
    sys_enter_readv, try_sys_enter_readv, sys_exit_readv, syscall::READV;
    sys_enter_writev, try_sys_enter_writev, sys_exit_writev, syscall::WRITEV;
    sys_enter_recvfrom, try_sys_enter_recvfrom, sys_exit_recvfrom, syscall::RECVFROM;
    sys_enter_sendto, try_sys_enter_sendto, sys_exit_sendto, syscall::SENDTO;
    sys_enter_recvmsg, try_sys_enter_recvmsg, sys_exit_recvmsg, syscall::RECVMSG;
    sys_enter_sendmsg, try_sys_enter_sendmsg, sys_exit_sendmsg, syscall::SENDMSG;
}

// ---------------------------------------------------------------------------------------------
// Sockets: connect and accept start tracking an fd, close ends it.

#[inline(always)]
fn sock_enter(ctx: &TracePointContext, sc: u32) -> Result<u32, u32> {
    let pid_tgid = bpf_get_current_pid_tgid();
    if !watched((pid_tgid >> 32) as u32) {
        return Ok(0);
    }
    let call = ActiveCall {
        ptr: arg(ctx, 1),
        len: 0,
        fd: arg(ctx, 0) as u32,
        syscall: sc,
    };
    if ACTIVE.insert(&pid_tgid, &call, 0).is_err() {
        count(counter::ACTIVE_FULL, 1);
    }
    Ok(0)
}

#[inline(always)]
fn sock_exit(ctx: &TracePointContext) -> Result<u32, u32> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let call = match unsafe { ACTIVE.get(&pid_tgid) } {
        Some(c) => *c,
        None => return Ok(0),
    };
    let _ = ACTIVE.remove(&pid_tgid);
    let ret = arg(ctx, 0) as i64;
    let tgid = (pid_tgid >> 32) as u32;
    let (k, fd) = if call.syscall == syscall::CONNECT {
        if ret != 0 && ret != -EINPROGRESS {
            return Ok(0);
        }
        (kind::CONNECT, call.fd)
    } else {
        if ret < 0 {
            return Ok(0);
        }
        (kind::ACCEPT, ret as u32)
    };
    let mut ev = ConnEvent {
        hdr: header(k, pid_tgid),
        fd,
        ret: ret as i32,
        // `accept`'s first argument is the listening socket.
        listener_fd: if k == kind::ACCEPT { call.fd } else { NO_FD },
        ..Default::default()
    };
    if call.ptr != 0 {
        // sockaddr_in: family u16, port be16, addr[4]; sockaddr_in6: family, port, flowinfo u32, addr[16].
        let raw: [u8; 24] =
            unsafe { aya_ebpf::helpers::bpf_probe_read_user(call.ptr as *const [u8; 24]) }
                .unwrap_or([0; 24]);
        let family = u16::from_ne_bytes([raw[0], raw[1]]);
        ev.port = u16::from_be_bytes([raw[2], raw[3]]);
        ev.family = family;
        if family == AF_INET {
            ev.addr[..4].copy_from_slice(&raw[4..8]);
        } else if family == AF_INET6 {
            ev.addr.copy_from_slice(&raw[8..24]);
        } else if k == kind::CONNECT {
            // Unix-domain and other sockets are not the serving traffic we follow.
            return Ok(0);
        } else {
            ev.family = 0;
            ev.port = 0;
        }
    }
    let mut mode = 0;
    store(&mut mode, capture::EDGES);
    if SOCKS.insert(&sock_key(tgid, fd), &mode, 0).is_err() {
        count(counter::SOCKS_FULL, 1);
    }
    send(&ev);
    Ok(0)
}

#[tracepoint]
pub fn sys_enter_connect(ctx: TracePointContext) -> u32 {
    match sock_enter(&ctx, syscall::CONNECT) {
        Ok(r) | Err(r) => r,
    }
}
#[tracepoint]
pub fn sys_exit_connect(ctx: TracePointContext) -> u32 {
    match sock_exit(&ctx) {
        Ok(r) | Err(r) => r,
    }
}
#[tracepoint]
pub fn sys_enter_accept(ctx: TracePointContext) -> u32 {
    match sock_enter(&ctx, syscall::ACCEPT) {
        Ok(r) | Err(r) => r,
    }
}
#[tracepoint]
pub fn sys_exit_accept(ctx: TracePointContext) -> u32 {
    match sock_exit(&ctx) {
        Ok(r) | Err(r) => r,
    }
}
#[tracepoint]
pub fn sys_enter_accept4(ctx: TracePointContext) -> u32 {
    match sock_enter(&ctx, syscall::ACCEPT) {
        Ok(r) | Err(r) => r,
    }
}
#[tracepoint]
pub fn sys_exit_accept4(ctx: TracePointContext) -> u32 {
    match sock_exit(&ctx) {
        Ok(r) | Err(r) => r,
    }
}

#[tracepoint]
pub fn sys_enter_close(ctx: TracePointContext) -> u32 {
    match try_sys_enter_close(&ctx) {
        Ok(r) | Err(r) => r,
    }
}

fn try_sys_enter_close(ctx: &TracePointContext) -> Result<u32, u32> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if !watched(tgid) {
        return Ok(0);
    }
    let fd = arg(ctx, 0) as u32;
    if SOCKS.remove(&sock_key(tgid, fd)).is_ok() {
        send(&CloseEvent {
            hdr: header(kind::CLOSE, pid_tgid),
            fd,
            _pad: 0,
        });
    }
    Ok(0)
}

// ---------------------------------------------------------------------------------------------
// Connections: the local address of every TCP connection a watched process opens, so that the
// accepting end on this node can tell who connected. `SYN_SENT` is set in the connecting task
// (before the port is chosen); `ESTABLISHED` follows, in whatever task handles the SYN-ACK, and
// before the final ACK leaves: the record precedes the peer's `accept` in the ring buffer.

#[tracepoint]
pub fn inet_sock_set_state(ctx: TracePointContext) -> u32 {
    match try_inet_sock_set_state(&ctx) {
        Ok(r) | Err(r) => r,
    }
}

fn try_inet_sock_set_state(ctx: &TracePointContext) -> Result<u32, u32> {
    let protocol: u16 = unsafe { ctx.read_at(sk::PROTOCOL) }.map_err(|_| 0u32)?;
    if protocol != IPPROTO_TCP {
        return Ok(0);
    }
    let skaddr: u64 = unsafe { ctx.read_at(sk::SKADDR) }.map_err(|_| 0u32)?;
    let old: i32 = unsafe { ctx.read_at(sk::OLDSTATE) }.map_err(|_| 0u32)?;
    let new: i32 = unsafe { ctx.read_at(sk::NEWSTATE) }.map_err(|_| 0u32)?;
    if new == TCP_SYN_SENT {
        let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
        if watched(tgid) && CONNECTING.insert(&skaddr, &tgid, 0).is_err() {
            count(counter::CONNECTING_FULL, 1);
        }
        return Ok(0);
    }
    if old != TCP_SYN_SENT {
        return Ok(0);
    }
    let Some(&tgid) = (unsafe { CONNECTING.get(&skaddr) }) else {
        return Ok(0);
    };
    let _ = CONNECTING.remove(&skaddr);
    if new != TCP_ESTABLISHED {
        return Ok(0);
    }
    let family: u16 = unsafe { ctx.read_at(sk::FAMILY) }.map_err(|_| 0u32)?;
    let mut ev = LocalEvent {
        hdr: Header {
            kind: kind::LOCAL,
            tgid,
            tid: 0,
            _pad: 0,
            ts_ns: unsafe { bpf_ktime_get_ns() },
        },
        family,
        local_port: unsafe { ctx.read_at(sk::SPORT) }.map_err(|_| 0u32)?,
        remote_port: unsafe { ctx.read_at(sk::DPORT) }.map_err(|_| 0u32)?,
        ..Default::default()
    };
    if family == AF_INET {
        let l: [u8; 4] = unsafe { ctx.read_at(sk::SADDR) }.map_err(|_| 0u32)?;
        let r: [u8; 4] = unsafe { ctx.read_at(sk::DADDR) }.map_err(|_| 0u32)?;
        ev.local[..4].copy_from_slice(&l);
        ev.remote[..4].copy_from_slice(&r);
    } else if family == AF_INET6 {
        ev.local = unsafe { ctx.read_at(sk::SADDR_V6) }.map_err(|_| 0u32)?;
        ev.remote = unsafe { ctx.read_at(sk::DADDR_V6) }.map_err(|_| 0u32)?;
    } else {
        return Ok(0);
    }
    send(&ev);
    Ok(0)
}

// ---------------------------------------------------------------------------------------------
// Processes: follow children of watched processes, tell user space about every exec.

#[tracepoint]
pub fn sched_process_fork(ctx: TracePointContext) -> u32 {
    match try_sched_process_fork(&ctx) {
        Ok(r) | Err(r) => r,
    }
}

fn try_sched_process_fork(ctx: &TracePointContext) -> Result<u32, u32> {
    let pid_tgid = bpf_get_current_pid_tgid();
    if !watched((pid_tgid >> 32) as u32) {
        return Ok(0);
    }
    let off = FORK_CHILD_PID_OFFSET.load() as usize;
    let child: u32 = unsafe { ctx.read_at(off) }.map_err(|_| 0u32)?;
    // The child may be a thread (its tgid is the parent's); user space tells them apart.
    let mut how = 0;
    store(&mut how, watch::INHERITED);
    let _ = WATCHED.insert(&child, &how, 0);
    send_now(&ProcEvent {
        hdr: header(kind::FORK, pid_tgid),
        child,
        _pad: 0,
    });
    Ok(0)
}

#[tracepoint]
pub fn sched_process_exec(ctx: TracePointContext) -> u32 {
    match try_sched_process_exec(&ctx) {
        Ok(r) | Err(r) => r,
    }
}

fn try_sched_process_exec(_ctx: &TracePointContext) -> Result<u32, u32> {
    // Every exec on the node: user space matches the new command line against its watch rules.
    send_now(&ProcEvent {
        hdr: header(kind::EXEC, bpf_get_current_pid_tgid()),
        child: 0,
        _pad: 0,
    });
    Ok(0)
}

#[tracepoint]
pub fn sched_process_exit(ctx: TracePointContext) -> u32 {
    match try_sched_process_exit(&ctx) {
        Ok(r) | Err(r) => r,
    }
}

fn try_sched_process_exit(ctx: &TracePointContext) -> Result<u32, u32> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    let tid = pid_tgid as u32;
    if tid != tgid {
        // A thread of a watched process inherited an entry at clone time.
        let _ = WATCHED.remove(&tid);
    }
    // The process is gone when its last thread exits, which need not be its leader: a leader
    // that leaves with `pthread_exit` exits first while its threads go on serving. Kernels
    // without `group_dead` can only tell the leader.
    let off = EXIT_GROUP_DEAD_OFFSET.load() as usize;
    let group_dead = if off == 0 {
        tid == tgid
    } else {
        unsafe { ctx.read_at::<u8>(off) }.map_err(|_| 0u32)? != 0
    };
    if group_dead && WATCHED.remove(&tgid).is_ok() {
        send_now(&ProcEvent {
            hdr: header(kind::EXIT, pid_tgid),
            child: 0,
            _pad: 0,
        });
    }
    Ok(0)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
