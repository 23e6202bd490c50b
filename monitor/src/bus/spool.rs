//! The agent's outbox on disk: every sealed batch is written here before it is published, and
//! removed once JetStream acknowledged it. NATS slow or unreachable only makes the outbox grow;
//! at its byte bound a new batch is dropped, counted by events. A restarted agent publishes
//! what the outbox still holds, in order (the message ids make a batch already stored count
//! once).
//!
//! One file per batch, `<seq:020>.batch`: the subject, a newline, the message id, a newline, the
//! message. Written to a temporary name and renamed, so a crash never leaves half a batch under
//! a batch's name. Not fsynced: the outbox survives the agent's crash, not the node's.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use super::batcher::Sealed;

#[derive(Debug, thiserror::Error)]
pub enum OutboxError {
    #[error("outbox {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("outbox {path} is used by another revenant agent (give each its own --spool-dir)")]
    InUse { path: PathBuf },
}

/// A batch waiting in the outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub seq: u64,
    pub subject: String,
    pub msg_id: String,
    /// Events in the batch.
    pub events: u32,
    /// Bytes of the file (head and message).
    pub bytes: u64,
    /// Bytes of the head before the message.
    head: usize,
}

pub struct Outbox {
    dir: PathBuf,
    max_bytes: u64,
    bytes: u64,
    next_seq: u64,
    queue: VecDeque<Entry>,
    /// Held for the outbox's life: one agent per directory.
    _lock: File,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> OutboxError + '_ {
    move |source| OutboxError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What resuming found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Resumed {
    pub batches: u64,
    /// Unreadable files, removed.
    pub corrupt: u64,
}

impl Outbox {
    /// Opens (creating) `dir`, locks it, and queues what a previous life left.
    pub fn open(dir: &Path, max_bytes: u64) -> Result<(Outbox, Resumed), OutboxError> {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let lock_path = dir.join("lock");
        let lock = File::create(&lock_path).map_err(io(&lock_path))?;
        // SAFETY: flock on a file descriptor we own; no memory is involved.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(OutboxError::InUse { path: dir.into() });
        }
        let mut found = Vec::new();
        let mut resumed = Resumed::default();
        for ent in std::fs::read_dir(dir).map_err(io(dir))? {
            let ent = ent.map_err(io(dir))?;
            let name = ent.file_name();
            let name = name.to_string_lossy();
            if name.ends_with(".tmp") {
                let _ = std::fs::remove_file(ent.path());
                continue;
            }
            let Some(seq) = name
                .strip_suffix(".batch")
                .and_then(|s| s.parse::<u64>().ok())
            else {
                continue;
            };
            match read_head(&ent.path()) {
                Some((subject, msg_id, events, bytes, head)) => found.push(Entry {
                    seq,
                    subject,
                    msg_id,
                    events,
                    bytes,
                    head,
                }),
                None => {
                    resumed.corrupt += 1;
                    let _ = std::fs::remove_file(ent.path());
                }
            }
        }
        found.sort_by_key(|e| e.seq);
        resumed.batches = found.len() as u64;
        let bytes = found.iter().map(|e| e.bytes).sum();
        let next_seq = found.last().map_or(0, |e| e.seq + 1);
        Ok((
            Outbox {
                dir: dir.into(),
                max_bytes,
                bytes,
                next_seq,
                queue: found.into(),
                _lock: lock,
            },
            resumed,
        ))
    }

    fn path(&self, seq: u64) -> PathBuf {
        self.dir.join(format!("{seq:020}.batch"))
    }

    /// Writes a sealed batch. `Ok(false)`: the outbox is at its bound, the batch is not kept
    /// (the caller counts its events as dropped).
    pub fn push(&mut self, s: &Sealed) -> Result<bool, OutboxError> {
        let head = format!("{}\n{}\n{}\n", s.subject, s.msg_id, s.events);
        let bytes = (head.len() + s.payload.len()) as u64;
        if self.bytes + bytes > self.max_bytes {
            return Ok(false);
        }
        let seq = self.next_seq;
        let path = self.path(seq);
        let tmp = path.with_extension("tmp");
        let write = || -> std::io::Result<()> {
            let mut f = File::create(&tmp)?;
            f.write_all(head.as_bytes())?;
            f.write_all(&s.payload)?;
            std::fs::rename(&tmp, &path)
        };
        write().map_err(io(&path))?;
        self.next_seq += 1;
        self.bytes += bytes;
        self.queue.push_back(Entry {
            seq,
            subject: s.subject.clone(),
            msg_id: s.msg_id.clone(),
            events: s.events,
            bytes,
            head: head.len(),
        });
        Ok(true)
    }

    /// The oldest `n` entries not yet published (in order).
    pub fn peek(&self, skip: usize, n: usize) -> impl Iterator<Item = &Entry> {
        self.queue.iter().skip(skip).take(n)
    }

    pub fn len(&self) -> usize {
        self.queue.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The message of an entry.
    pub fn payload(&self, e: &Entry) -> Result<Vec<u8>, OutboxError> {
        let path = self.path(e.seq);
        let mut buf = Vec::with_capacity(e.bytes as usize);
        File::open(&path)
            .and_then(|mut f| f.read_to_end(&mut buf))
            .map_err(io(&path))?;
        Ok(buf.get(e.head..).unwrap_or_default().to_vec())
    }

    /// Removes an acknowledged entry (any position: acknowledgements come back out of order).
    pub fn remove(&mut self, seq: u64) {
        if let Some(i) = self.queue.iter().position(|e| e.seq == seq) {
            let e = self.queue.remove(i).expect("position is in range");
            self.bytes -= e.bytes;
            let _ = std::fs::remove_file(self.path(seq));
        }
    }
}

/// Subject, message id, event count, size and head size of a batch file; `None` if it is not
/// one.
fn read_head(path: &Path) -> Option<(String, String, u32, u64, usize)> {
    let mut buf = Vec::new();
    File::open(path).ok()?.read_to_end(&mut buf).ok()?;
    let mut parts = buf.splitn(4, |b| *b == b'\n');
    let subject = std::str::from_utf8(parts.next()?).ok()?.to_owned();
    let msg_id = std::str::from_utf8(parts.next()?).ok()?.to_owned();
    let events: u32 = std::str::from_utf8(parts.next()?).ok()?.parse().ok()?;
    let payload = parts.next()?;
    if subject.is_empty() || msg_id.is_empty() || payload.is_empty() {
        return None;
    }
    let head = buf.len() - payload.len();
    Some((subject, msg_id, events, buf.len() as u64, head))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sealed(i: u32) -> Sealed {
        Sealed {
            subject: "S.p0".into(),
            msg_id: format!("n/1/0/{i}"),
            payload: vec![b'x'; 10].into(),
            events: 1,
        }
    }

    #[test]
    fn bounded_resumed_in_order_and_locked() {
        let dir = tempfile::tempdir().unwrap();
        let (mut o, r) = Outbox::open(dir.path(), 60).unwrap();
        // Each entry: "S.p0\nn/1/0/i\n1\n" (15 bytes) and 10 bytes of message.
        assert_eq!(r, Resumed::default());
        assert!(o.push(&sealed(0)).unwrap());
        assert!(o.push(&sealed(1)).unwrap());
        assert!(!o.push(&sealed(2)).unwrap(), "over the bound");
        assert!(matches!(
            Outbox::open(dir.path(), 60),
            Err(OutboxError::InUse { .. })
        ));
        let first = o.peek(0, 1).next().unwrap().clone();
        assert_eq!(o.payload(&first).unwrap(), vec![b'x'; 10]);
        o.remove(first.seq);
        drop(o);
        std::fs::write(dir.path().join("00000000000000000007.batch"), b"junk").unwrap();
        let (o, r) = Outbox::open(dir.path(), 60).unwrap();
        assert_eq!(
            r,
            Resumed {
                batches: 1,
                corrupt: 1
            }
        );
        assert_eq!(o.peek(0, 9).next().unwrap().msg_id, "n/1/0/1");
        assert_eq!(o.next_seq, 2);
    }
}
