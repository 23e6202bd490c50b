//! Listening TCP sockets from the kernel's socket-diagnostics netlink interface
//! (`NETLINK_SOCK_DIAG`, `SOCK_DIAG_BY_FAMILY` with only `TCP_LISTEN` in the state filter), as
//! `ss -ltn` asks for them. With that filter the kernel walks its listening hash alone
//! (`inet_diag_dump_icsk`); `/proc/net/tcp` walks every bucket of the established hash as well,
//! and restarts the walk at each read: on a node holding a few thousand connections one read
//! of it costs about 10 ms of kernel time.
//!
//! A netlink socket answers for the network namespace it was created in: the namespace of
//! another process is asked from a short-lived thread that enters it first (`setns`, which
//! needs `CAP_SYS_ADMIN`); the caller falls back to `/proc/PID/net/tcp` when that is refused.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// `linux/sock_diag.h` and `netinet/tcp.h` values libc does not carry.
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const TCP_LISTEN: u32 = 10;
const NLMSG_ERROR: u16 = libc::NLMSG_ERROR as u16;
const NLMSG_DONE: u16 = libc::NLMSG_DONE as u16;
const NLMSG_HDR: usize = 16;
/// `struct inet_diag_req_v2`: family, protocol, ext, pad, states, then a 48-byte socket id.
const REQ_LEN: usize = 56;
/// `struct inet_diag_msg` up to and with its inode.
const MSG_LEN: usize = 72;
/// Messages per dump, at most: a namespace with more listening sockets is cut short (and
/// said to be, with an error) rather than read without end.
const MAX_MESSAGES: usize = 1 << 16;
/// How long one answer may take: the kernel answers a dump at once.
const RECV_TIMEOUT: Duration = Duration::from_secs(2);

/// Listening TCP sockets (socket inode, local address) of the calling thread's network
/// namespace, IPv4 and IPv6.
pub fn listening() -> io::Result<Vec<(u64, SocketAddr)>> {
    let sock = open()?;
    let mut out = Vec::new();
    for (seq, family) in [(1, libc::AF_INET), (2, libc::AF_INET6)] {
        dump(&sock, seq, family as u8, &mut out)?;
    }
    Ok(out)
}

/// The same for the network namespace process (or thread) `pid` is in: asked from a thread
/// that enters it, unless it is this thread's.
pub fn listening_in(pid: u32) -> io::Result<Vec<(u64, SocketAddr)>> {
    use std::os::unix::fs::MetadataExt;
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
    let own = std::fs::metadata("/proc/thread-self/ns/net")?;
    let theirs = ns.metadata()?;
    if (own.dev(), own.ino()) == (theirs.dev(), theirs.ino()) {
        return listening();
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: `ns` is an open namespace file; `setns` changes this thread's namespace
            // only, and the thread ends with this closure.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            listening()
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("sock_diag thread panicked")))
    })
}

fn open() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the descriptor is owned at once.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket(2) and nothing else owns it.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let tv = libc::timeval {
        tv_sec: RECV_TIMEOUT.as_secs() as libc::time_t,
        tv_usec: 0,
    };
    // SAFETY: `tv` outlives the call and its size is passed.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(sock)
}

/// The dump request for one address family: every listening TCP socket.
fn request(seq: u32, family: u8) -> [u8; NLMSG_HDR + REQ_LEN] {
    let mut req = [0u8; NLMSG_HDR + REQ_LEN];
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    req[0..4].copy_from_slice(&((NLMSG_HDR + REQ_LEN) as u32).to_ne_bytes());
    req[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    req[6..8].copy_from_slice(&flags.to_ne_bytes());
    req[8..12].copy_from_slice(&seq.to_ne_bytes());
    req[NLMSG_HDR] = family;
    req[NLMSG_HDR + 1] = libc::IPPROTO_TCP as u8;
    req[NLMSG_HDR + 4..NLMSG_HDR + 8].copy_from_slice(&(1u32 << TCP_LISTEN).to_ne_bytes());
    req
}

fn dump(sock: &OwnedFd, seq: u32, family: u8, out: &mut Vec<(u64, SocketAddr)>) -> io::Result<()> {
    let req = request(seq, family);
    // SAFETY: an all-zero sockaddr_nl is the kernel's address with its family set below.
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: `req` and `kernel` outlive the call; their sizes are passed.
    let sent = unsafe {
        libc::sendto(
            sock.as_raw_fd(),
            req.as_ptr().cast(),
            req.len(),
            0,
            (&kernel as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut buf = vec![0u8; 64 << 10];
    let mut messages = 0usize;
    loop {
        // SAFETY: `buf` is writable for its length.
        let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        match parse(&buf[..n as usize], seq, out)? {
            Parsed::Done => return Ok(()),
            Parsed::More(m) => messages += m,
        }
        if messages > MAX_MESSAGES {
            return Err(io::Error::other(format!(
                "more than {MAX_MESSAGES} listening sockets in one namespace"
            )));
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Parsed {
    /// The dump ended (`NLMSG_DONE`).
    Done,
    /// This many sockets were read; more datagrams follow.
    More(usize),
}

/// One datagram of the dump's answer: its sockets go to `out`.
fn parse(mut b: &[u8], seq: u32, out: &mut Vec<(u64, SocketAddr)>) -> io::Result<Parsed> {
    let mut n = 0;
    let u16_at = |b: &[u8], i: usize| u16::from_ne_bytes([b[i], b[i + 1]]);
    let u32_at = |b: &[u8], i: usize| u32::from_ne_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    while b.len() >= NLMSG_HDR {
        let len = u32_at(b, 0) as usize;
        if len < NLMSG_HDR || len > b.len() {
            return Err(io::Error::other(format!(
                "sock_diag: a message of {len} bytes in {} left",
                b.len()
            )));
        }
        let (kind, msg_seq) = (u16_at(b, 4), u32_at(b, 8));
        let body = &b[NLMSG_HDR..len];
        b = &b[len.next_multiple_of(4).min(b.len())..];
        if msg_seq != seq {
            continue;
        }
        match kind {
            NLMSG_DONE => return Ok(Parsed::Done),
            NLMSG_ERROR => {
                let errno = if body.len() >= 4 {
                    i32::from_ne_bytes([body[0], body[1], body[2], body[3]])
                } else {
                    0
                };
                return Err(if errno < 0 {
                    io::Error::from_raw_os_error(-errno)
                } else {
                    io::Error::other("sock_diag: an error message without an error")
                });
            }
            SOCK_DIAG_BY_FAMILY if body.len() >= MSG_LEN => {
                if let Some(entry) = listener(body) {
                    out.push(entry);
                }
                n += 1;
            }
            _ => {}
        }
    }
    Ok(Parsed::More(n))
}

/// One `struct inet_diag_msg`: (inode, local address).
fn listener(m: &[u8]) -> Option<(u64, SocketAddr)> {
    let port = u16::from_be_bytes([m[4], m[5]]);
    let src = &m[8..24];
    let ip = match m[0] as libc::c_int {
        libc::AF_INET => IpAddr::V4(Ipv4Addr::new(src[0], src[1], src[2], src[3])),
        libc::AF_INET6 => {
            let v6 = Ipv6Addr::from(<[u8; 16]>::try_from(src).ok()?);
            v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
        }
        _ => return None,
    };
    let inode = u32::from_ne_bytes([m[68], m[69], m[70], m[71]]);
    Some((u64::from(inode), SocketAddr::new(ip, port)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A datagram as the kernel writes it: one message per (kind, seq, body).
    fn datagram(msgs: &[(u16, u32, Vec<u8>)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (kind, seq, body) in msgs {
            let len = NLMSG_HDR + body.len();
            out.extend_from_slice(&(len as u32).to_ne_bytes());
            out.extend_from_slice(&kind.to_ne_bytes());
            out.extend_from_slice(&0u16.to_ne_bytes());
            out.extend_from_slice(&seq.to_ne_bytes());
            out.extend_from_slice(&0u32.to_ne_bytes());
            out.extend_from_slice(body);
            out.resize(out.len().next_multiple_of(4), 0);
        }
        out
    }

    fn diag_msg(family: u8, ip: &[u8], port: u16, inode: u32) -> Vec<u8> {
        let mut m = vec![0u8; MSG_LEN + 8];
        m[0] = family;
        m[1] = TCP_LISTEN as u8;
        m[4..6].copy_from_slice(&port.to_be_bytes());
        m[8..8 + ip.len()].copy_from_slice(ip);
        m[68..72].copy_from_slice(&inode.to_ne_bytes());
        m
    }

    #[test]
    fn sockets_of_both_families_then_the_end_of_the_dump() {
        let mut mapped = [0u8; 16];
        mapped[10..12].copy_from_slice(&[0xff, 0xff]);
        mapped[12..].copy_from_slice(&[127, 0, 0, 2]);
        let d = datagram(&[
            (
                SOCK_DIAG_BY_FAMILY,
                7,
                diag_msg(libc::AF_INET as u8, &[127, 0, 0, 1], 30000, 41),
            ),
            (
                SOCK_DIAG_BY_FAMILY,
                7,
                diag_msg(libc::AF_INET6 as u8, &mapped, 8998, 42),
            ),
            // Another request's answer on the same socket is not ours.
            (
                SOCK_DIAG_BY_FAMILY,
                8,
                diag_msg(libc::AF_INET as u8, &[10, 0, 0, 1], 1, 43),
            ),
        ]);
        let mut out = Vec::new();
        assert_eq!(parse(&d, 7, &mut out).unwrap(), Parsed::More(2));
        assert_eq!(
            out,
            vec![
                (41, "127.0.0.1:30000".parse().unwrap()),
                (42, "127.0.0.2:8998".parse().unwrap()),
            ]
        );
        let done = datagram(&[(NLMSG_DONE, 7, vec![0; 4])]);
        assert_eq!(parse(&done, 7, &mut out).unwrap(), Parsed::Done);
    }

    #[test]
    fn an_error_message_is_an_error_and_a_cut_message_too() {
        let e = datagram(&[(NLMSG_ERROR, 1, (-libc::EPERM).to_ne_bytes().to_vec())]);
        let err = parse(&e, 1, &mut Vec::new()).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EPERM));
        let mut cut = datagram(&[(SOCK_DIAG_BY_FAMILY, 1, vec![0; MSG_LEN])]);
        cut[0..4].copy_from_slice(&1000u32.to_ne_bytes());
        assert!(parse(&cut, 1, &mut Vec::new()).is_err());
    }

    /// The kernel's own answer: a socket this test listens on is among the listeners, with its
    /// inode as /proc names it.
    #[test]
    fn the_kernel_lists_a_socket_this_test_listens_on() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let fd = l.as_raw_fd();
        let inode: u64 = std::fs::read_link(format!("/proc/self/fd/{fd}"))
            .unwrap()
            .to_str()
            .unwrap()
            .trim_start_matches("socket:[")
            .trim_end_matches(']')
            .parse()
            .unwrap();
        let all = listening().expect("sock_diag answers in this namespace");
        assert!(
            all.contains(&(inode, addr)),
            "{addr} ({inode}) not in {all:?}"
        );
        let same = listening_in(std::process::id()).expect("our own namespace");
        assert!(same.contains(&(inode, addr)));
    }

    /// Another namespace's listeners are asked from inside it: a thread of this test in a
    /// namespace of its own listens; the dump through its id lists that socket and ours does
    /// not. Without CAP_SYS_ADMIN no namespace can be made, nor entered.
    #[test]
    fn another_namespace_is_asked_from_inside_it() {
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            // SAFETY: unshare(2) on this thread only; it ends when the test is done with it.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                tx.send(Err(io::Error::last_os_error())).unwrap();
                return;
            }
            let l = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
            // SAFETY: gettid(2) has no preconditions.
            let tid = unsafe { libc::gettid() } as u32;
            tx.send(Ok((tid, l.local_addr().unwrap().port()))).unwrap();
            let _ = stop_rx.recv();
        });
        match rx.recv().unwrap() {
            Err(e) => {
                assert_ne!(unsafe { libc::geteuid() }, 0, "root cannot unshare: {e}");
                assert_eq!(e.raw_os_error(), Some(libc::EPERM));
            }
            Ok((tid, port)) => {
                let theirs = listening_in(tid).expect("entering the thread's namespace");
                assert!(
                    theirs.iter().any(|(_, a)| a.port() == port),
                    "port {port} not in {theirs:?}"
                );
                let ours = listening().unwrap();
                assert!(
                    ours.iter()
                        .all(|(i, _)| !theirs.iter().any(|(j, _)| i == j))
                );
            }
        }
        drop(stop_tx);
        t.join().unwrap();
    }
}
