//! Decoding of ring-buffer records (the layouts in `monitor-common`) into typed values.
//!
//! Pure and total: any byte string decodes to a record or a [`RecordError`], never a panic, so a
//! kernel/user version mismatch shows up as counted decode errors rather than a crash.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use monitor_common::{
    CloseEvent, ConnEvent, DataHeader, Header, LocalEvent, NO_FD, ProcEvent, kind,
};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record<'a> {
    Data(DataPiece<'a>),
    Connect(Conn),
    Accept(Conn),
    Close {
        hdr: Header,
        fd: u32,
    },
    Exec {
        hdr: Header,
    },
    Exit {
        hdr: Header,
    },
    Fork {
        hdr: Header,
        child: u32,
    },
    /// A connection `hdr.tgid` opened is established: its local and remote addresses.
    Local {
        hdr: Header,
        local: SocketAddr,
        remote: SocketAddr,
    },
}

/// One captured piece of one syscall's payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataPiece<'a> {
    pub hdr: Header,
    pub fd: u32,
    pub syscall: u32,
    /// Bytes the syscall moved.
    pub total: u64,
    /// Offset of `bytes` within them.
    pub off: u32,
    pub bytes: &'a [u8],
}

impl DataPiece<'_> {
    pub fn is_ingress(&self) -> bool {
        monitor_common::syscall::is_ingress(self.syscall)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conn {
    pub hdr: Header,
    pub fd: u32,
    /// Peer address when the kernel saw one.
    pub peer: Option<SocketAddr>,
    /// An accepted connection: the fd of the listening socket it came in on.
    pub listener_fd: Option<u32>,
    /// An accepted connection: the address it came in on (its listener's, which may be a
    /// wildcard), when the source knows that listener; the kernel's record does not say.
    pub local: Option<SocketAddr>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("record of {got} bytes is shorter than its {need}-byte header")]
    Short { got: usize, need: usize },
    #[error("unknown record kind {0}")]
    UnknownKind(u32),
    #[error("connection record of unknown address family {0}")]
    Family(u16),
    #[error("data record says {claimed} payload bytes but carries {got}")]
    LengthMismatch { claimed: u32, got: usize },
}

impl RecordError {
    /// Bounded label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            RecordError::Short { .. } => "short",
            RecordError::UnknownKind(_) => "unknown_kind",
            RecordError::Family(_) => "unknown_family",
            RecordError::LengthMismatch { .. } => "length_mismatch",
        }
    }
}

fn read<T: Copy>(buf: &[u8]) -> Result<T, RecordError> {
    let need = size_of::<T>();
    if buf.len() < need {
        return Err(RecordError::Short {
            got: buf.len(),
            need,
        });
    }
    // SAFETY: length checked; T is a repr(C) struct of integers (every bit pattern is valid);
    // read_unaligned copes with the ring buffer's 8-byte alignment being lost in slicing.
    Ok(unsafe { std::ptr::read_unaligned(buf.as_ptr().cast::<T>()) })
}

pub fn decode(buf: &[u8]) -> Result<Record<'_>, RecordError> {
    let hdr: Header = read(buf)?;
    match hdr.kind {
        kind::DATA => {
            let h: DataHeader = read(buf)?;
            let payload = &buf[size_of::<DataHeader>()..];
            let len = h.len as usize;
            if payload.len() < len {
                return Err(RecordError::LengthMismatch {
                    claimed: h.len,
                    got: payload.len(),
                });
            }
            Ok(Record::Data(DataPiece {
                hdr: h.hdr,
                fd: h.fd,
                syscall: h.syscall,
                total: h.total,
                off: h.off,
                bytes: &payload[..len],
            }))
        }
        kind::CONNECT | kind::ACCEPT => {
            let c: ConnEvent = read(buf)?;
            let conn = Conn {
                hdr: c.hdr,
                fd: c.fd,
                peer: socket_addr(c.family, &c.addr, c.port),
                listener_fd: (hdr.kind == kind::ACCEPT && c.listener_fd != NO_FD)
                    .then_some(c.listener_fd),
                local: None,
            };
            Ok(if hdr.kind == kind::CONNECT {
                Record::Connect(conn)
            } else {
                Record::Accept(conn)
            })
        }
        kind::CLOSE => {
            let c: CloseEvent = read(buf)?;
            Ok(Record::Close {
                hdr: c.hdr,
                fd: c.fd,
            })
        }
        kind::EXEC | kind::EXIT | kind::FORK => {
            let p: ProcEvent = read(buf)?;
            Ok(match hdr.kind {
                kind::EXEC => Record::Exec { hdr: p.hdr },
                kind::EXIT => Record::Exit { hdr: p.hdr },
                _ => Record::Fork {
                    hdr: p.hdr,
                    child: p.child,
                },
            })
        }
        kind::LOCAL => {
            let l: LocalEvent = read(buf)?;
            match (
                socket_addr(l.family, &l.local, l.local_port),
                socket_addr(l.family, &l.remote, l.remote_port),
            ) {
                (Some(local), Some(remote)) => Ok(Record::Local {
                    hdr: l.hdr,
                    local,
                    remote,
                }),
                _ => Err(RecordError::Family(l.family)),
            }
        }
        other => Err(RecordError::UnknownKind(other)),
    }
}

/// A kernel record's address: AF_INET (2) in the first 4 bytes of `addr`, or AF_INET6 (10);
/// `None` for any other family.
fn socket_addr(family: u16, addr: &[u8; 16], port: u16) -> Option<SocketAddr> {
    let ip = match family {
        2 => IpAddr::V4(Ipv4Addr::new(addr[0], addr[1], addr[2], addr[3])),
        10 => IpAddr::V6(Ipv6Addr::from(*addr)),
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bytes_of<T>(v: &T) -> Vec<u8> {
        // SAFETY: test-only view of a repr(C) integer struct.
        unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), size_of::<T>()) }.to_vec()
    }

    #[test]
    fn decodes_data_with_payload() {
        let h = DataHeader {
            hdr: Header {
                kind: kind::DATA,
                tgid: 7,
                tid: 8,
                _pad: 0,
                ts_ns: 99,
            },
            fd: 3,
            syscall: monitor_common::syscall::RECVFROM,
            total: 1000,
            off: 488,
            len: 5,
        };
        let mut buf = bytes_of(&h);
        buf.extend_from_slice(b"hello-extra");
        let Record::Data(d) = decode(&buf).unwrap() else {
            panic!()
        };
        assert_eq!(d.bytes, b"hello");
        assert!(d.is_ingress());
        assert_eq!((d.fd, d.total, d.off), (3, 1000, 488));
    }

    #[test]
    fn decodes_connect_v4() {
        let mut c = ConnEvent {
            hdr: Header {
                kind: kind::CONNECT,
                ..Default::default()
            },
            fd: 9,
            family: 2,
            port: 8998,
            ..Default::default()
        };
        c.addr[..4].copy_from_slice(&[127, 0, 0, 1]);
        let Record::Connect(conn) = decode(&bytes_of(&c)).unwrap() else {
            panic!()
        };
        assert_eq!(conn.peer, Some("127.0.0.1:8998".parse().unwrap()));
        assert_eq!(conn.listener_fd, None, "a connect has no listener");
        c.hdr.kind = kind::ACCEPT;
        c.listener_fd = 4;
        let Record::Accept(conn) = decode(&bytes_of(&c)).unwrap() else {
            panic!()
        };
        assert_eq!((conn.fd, conn.listener_fd, conn.local), (9, Some(4), None));
    }

    #[test]
    fn decodes_local_addresses() {
        let mut l = LocalEvent {
            hdr: Header {
                kind: kind::LOCAL,
                tgid: 42,
                ..Default::default()
            },
            family: 2,
            local_port: 51234,
            remote_port: 8998,
            ..Default::default()
        };
        l.local[..4].copy_from_slice(&[127, 0, 0, 1]);
        l.remote[..4].copy_from_slice(&[127, 0, 0, 1]);
        let Record::Local { hdr, local, remote } = decode(&bytes_of(&l)).unwrap() else {
            panic!()
        };
        assert_eq!(hdr.tgid, 42);
        assert_eq!(local, "127.0.0.1:51234".parse().unwrap());
        assert_eq!(remote, "127.0.0.1:8998".parse().unwrap());
        l.family = 1;
        assert_eq!(decode(&bytes_of(&l)), Err(RecordError::Family(1)));
    }

    #[test]
    fn rejects_truncated_and_unknown() {
        assert!(matches!(decode(&[1, 0, 0]), Err(RecordError::Short { .. })));
        let h = Header {
            kind: 77,
            ..Default::default()
        };
        assert_eq!(decode(&bytes_of(&h)), Err(RecordError::UnknownKind(77)));
        let d = DataHeader {
            hdr: Header {
                kind: kind::DATA,
                ..Default::default()
            },
            len: 10,
            ..Default::default()
        };
        assert!(matches!(
            decode(&bytes_of(&d)),
            Err(RecordError::LengthMismatch { .. })
        ));
    }

    proptest! {
        #[test]
        fn never_panics(buf in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode(&buf);
        }
    }
}
