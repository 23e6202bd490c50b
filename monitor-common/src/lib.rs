//! Records shared between the kernel programs (`monitor-ebpf`) and the daemon (`monitor`).
//!
//! Everything here is `#[repr(C)]` with explicit padding so both sides agree byte for byte.
//! Every ring-buffer record starts with a [`Header`] whose `kind` says which record follows.
#![no_std]

/// Most payload bytes one data record can carry; the per-CPU scratch buffer is this large.
pub const MAX_CAPTURE: usize = 4096;
/// Default number of leading bytes captured per syscall (overridable at load time).
pub const DEFAULT_HEAD_BYTES: u32 = 512;
/// Default number of trailing bytes captured per syscall when it moved more than the head.
///
/// The router appends `bootstrap_host/port/room` at the very end of a JSON body that can be
/// hundreds of KB; capturing the tail of every large read/write (as well as its head) keeps the
/// last bytes of every body, and the bytes on both sides of every syscall boundary.
pub const DEFAULT_TAIL_BYTES: u32 = 512;
/// How many iovecs of a readv/writev/sendmsg/recvmsg the kernel side walks (with `bpf_loop`).
/// hyper (the simulator, smg) writes up to 64 at once, and the end of a streamed answer is in
/// the last of them.
pub const MAX_IOVECS: u32 = 64;

/// `Header::kind` values.
pub mod kind {
    pub const DATA: u32 = 1;
    pub const CONNECT: u32 = 2;
    pub const ACCEPT: u32 = 3;
    pub const CLOSE: u32 = 4;
    pub const EXEC: u32 = 5;
    pub const EXIT: u32 = 6;
    pub const FORK: u32 = 7;
    pub const LOCAL: u32 = 8;
}

/// `DataHeader::syscall` values.
pub mod syscall {
    pub const READ: u32 = 0;
    pub const WRITE: u32 = 1;
    pub const READV: u32 = 2;
    pub const WRITEV: u32 = 3;
    pub const RECVFROM: u32 = 4;
    pub const SENDTO: u32 = 5;
    pub const RECVMSG: u32 = 6;
    pub const SENDMSG: u32 = 7;
    pub const CONNECT: u32 = 8;
    pub const ACCEPT: u32 = 9;

    /// Names indexed by the values above, for logs and metrics labels.
    pub const NAMES: [&str; 10] = [
        "read", "write", "readv", "writev", "recvfrom", "sendto", "recvmsg", "sendmsg", "connect",
        "accept",
    ];

    /// True for the syscalls that move bytes into the process.
    pub const fn is_ingress(s: u32) -> bool {
        matches!(s, READ | READV | RECVFROM | RECVMSG)
    }
}

/// Indexes of the per-CPU `COUNTERS` array.
pub mod counter {
    /// Syscalls of watched processes on tracked sockets that the probes looked at.
    pub const SEEN: u32 = 0;
    /// Records written to the ring buffer.
    pub const SENT: u32 = 1;
    /// Records lost because the ring buffer was full (reserve/output failed).
    pub const RINGBUF_DROPS: u32 = 2;
    /// Payload copies that failed (`bpf_probe_read_user` error): record sent without bytes.
    pub const READ_FAILURES: u32 = 3;
    /// In-flight syscalls not tracked because the `ACTIVE` map was full.
    pub const ACTIVE_FULL: u32 = 4;
    /// Sockets not tracked because the `SOCKS` map was full.
    pub const SOCKS_FULL: u32 = 5;
    /// Syscalls with more iovecs than [`crate::MAX_IOVECS`]: the bytes past them are not captured.
    pub const IOV_TRUNCATED: u32 = 6;
    /// Payload bytes copied to the ring buffer.
    pub const BYTES_CAPTURED: u32 = 7;
    /// Connections of watched processes whose local address went unreported because the
    /// `CONNECTING` map was full.
    pub const CONNECTING_FULL: u32 = 8;
    /// Syscalls of [`crate::capture::STREAM`] sockets longer than
    /// [`crate::MAX_STREAM_PIECES`] records: the bytes past them are not captured.
    pub const STREAM_TRUNCATED: u32 = 9;
    /// Sockets switched to [`crate::capture::STREAM`] by the kernel on a syscall that starts
    /// with a `GET /metrics` request.
    pub const METRICS_MARKED: u32 = 10;
    pub const COUNT: u32 = 11;

    pub const NAMES: [&str; COUNT as usize] = [
        "seen",
        "sent",
        "ringbuf_drops",
        "read_failures",
        "active_full",
        "socks_full",
        "iov_truncated",
        "bytes_captured",
        "connecting_full",
        "stream_truncated",
        "metrics_marked",
    ];
}

/// `WATCHED` map values.
pub mod watch {
    /// Put there by user space (command line matched, `--pid`).
    pub const EXPLICIT: u32 = 1;
    /// Inherited by the kernel on fork from a watched parent (may be a thread id).
    pub const INHERITED: u32 = 2;
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    pub kind: u32,
    pub tgid: u32,
    pub tid: u32,
    pub _pad: u32,
    /// `bpf_ktime_get_ns()`: CLOCK_MONOTONIC.
    pub ts_ns: u64,
}

/// One captured piece of one syscall's payload; `len` bytes follow this header.
///
/// A syscall that moved `total` bytes yields a piece at offset 0 (the head) and, when `total`
/// exceeds the head, a piece ending at `total` (the tail); the kernel gathers each of the two
/// across a vectored syscall's iovecs, so there are never more. All pieces of one syscall share
/// `hdr.ts_ns` and `hdr.tid`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DataHeader {
    pub hdr: Header,
    pub fd: u32,
    pub syscall: u32,
    /// Bytes the syscall moved (its return value).
    pub total: u64,
    /// Offset of this piece within those bytes.
    pub off: u32,
    pub len: u32,
}

/// A socket the kernel side started tracking: `connect` (outbound) or `accept` (inbound).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnEvent {
    pub hdr: Header,
    pub fd: u32,
    /// `connect` return value (0 or -EINPROGRESS); 0 for accept.
    pub ret: i32,
    /// AF_INET (2) or AF_INET6 (10); 0 when the peer address was not given (accept with NULL).
    pub family: u16,
    /// Peer port, host byte order.
    pub port: u16,
    /// `accept`: the listening socket's fd, so that user space can tell which of the process's
    /// listeners (which local address) the connection came in on; [`NO_FD`] for `connect`.
    pub listener_fd: u32,
    /// Peer address: IPv4 in the first 4 bytes, or IPv6.
    pub addr: [u8; 16],
}

/// [`ConnEvent::listener_fd`] of a `connect`.
pub const NO_FD: u32 = u32::MAX;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CloseEvent {
    pub hdr: Header,
    pub fd: u32,
    pub _pad: u32,
}

/// exec / exit / fork of a process; `child` is the new task id for fork, 0 otherwise.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcEvent {
    pub hdr: Header,
    pub child: u32,
    pub _pad: u32,
}

/// A TCP connection a watched process opened reached `ESTABLISHED`: its local address, so that
/// the accepting end on this node can tell the connecting process was watched. `hdr.tgid` is the
/// process that called `connect` (the state change itself may run in another task's softirq).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LocalEvent {
    pub hdr: Header,
    /// AF_INET (2) or AF_INET6 (10).
    pub family: u16,
    /// Local port, host byte order.
    pub local_port: u16,
    /// Remote port, host byte order.
    pub remote_port: u16,
    pub _pad: u16,
    /// Local address: IPv4 in the first 4 bytes, or IPv6.
    pub local: [u8; 16],
    pub remote: [u8; 16],
}

/// Offsets in `sock/inet_sock_set_state`'s record (kernels since 4.20; the loader checks them
/// against tracefs before attaching).
pub mod inet_sock_set_state {
    pub const SKADDR: usize = 8;
    pub const OLDSTATE: usize = 16;
    pub const NEWSTATE: usize = 20;
    pub const SPORT: usize = 24;
    pub const DPORT: usize = 26;
    pub const FAMILY: usize = 28;
    pub const PROTOCOL: usize = 30;
    pub const SADDR: usize = 32;
    pub const DADDR: usize = 36;
    pub const SADDR_V6: usize = 40;
    pub const DADDR_V6: usize = 56;
    /// Every field the program reads, as tracefs names it, with its offset.
    pub const FIELDS: [(&str, usize); 11] = [
        ("skaddr", SKADDR),
        ("oldstate", OLDSTATE),
        ("newstate", NEWSTATE),
        ("sport", SPORT),
        ("dport", DPORT),
        ("family", FAMILY),
        ("protocol", PROTOCOL),
        ("saddr", SADDR),
        ("daddr", DADDR),
        ("saddr_v6", SADDR_V6),
        ("daddr_v6", DADDR_V6),
    ];
}

/// A syscall between its enter and exit tracepoints.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ActiveCall {
    /// Buffer, iovec array, msghdr or sockaddr pointer.
    pub ptr: u64,
    /// Buffer length or iovec count.
    pub len: u64,
    pub fd: u32,
    pub syscall: u32,
}

/// How much of each syscall on a socket is captured: the value of its `SOCKS` entry, read when
/// the syscall returns (a receive that was already waiting when user space changed it is
/// captured in the new mode).
pub mod capture {
    /// The configured head and tail windows (HTTP: headers, ids, and the end of a body).
    pub const EDGES: u32 = 0;
    /// Up to [`super::MAX_CAPTURE`] bytes at each end: a control channel whose writes batch
    /// many small messages (ZeroMQ writes up to 8 KiB of them at once), every one of which
    /// counts. The kernel sets it on a syscall that starts with a ZMTP greeting, user space
    /// once the tracker has read one.
    pub const WHOLE: u32 = 1;
    /// Every byte of each non-vectored syscall, up to [`super::MAX_STREAM_PIECES`] records of
    /// [`super::MAX_CAPTURE`] bytes in order (vectored ones as [`WHOLE`]): an HTTP connection
    /// whose answers are read for a line anywhere in a long body (vLLM's `/metrics`). User space
    /// sets it once it has seen such a request on the connection; the kernel sets it on a
    /// syscall that starts with `GET /metrics ` (or `?`), so the answer that follows is whole.
    pub const STREAM: u32 = 2;
}

/// Records one syscall of a [`capture::STREAM`] socket is sent as, at most: 128 KiB.
pub const MAX_STREAM_PIECES: u32 = 32;

/// Key of the `SOCKS` map: a socket fd of a watched process.
#[inline(always)]
pub const fn sock_key(tgid: u32, fd: u32) -> u64 {
    ((tgid as u64) << 32) | fd as u64
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all these are repr(C), Copy, made only of integers, with explicit padding.
    unsafe impl aya::Pod for super::ActiveCall {}
    unsafe impl aya::Pod for super::Header {}
}

// Layout guards: the kernel and user sides must agree on these sizes.
const _: () = assert!(core::mem::size_of::<Header>() == 24);
const _: () = assert!(core::mem::size_of::<DataHeader>() == 48);
const _: () = assert!(core::mem::size_of::<ConnEvent>() == 56);
const _: () = assert!(core::mem::size_of::<CloseEvent>() == 32);
const _: () = assert!(core::mem::size_of::<ProcEvent>() == 32);
const _: () = assert!(core::mem::size_of::<ActiveCall>() == 24);
const _: () = assert!(core::mem::size_of::<LocalEvent>() == 64);
