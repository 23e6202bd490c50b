//! The agent's outbox on disk: every sealed batch is appended here before it is published, and
//! counted out once JetStream acknowledged it. NATS slow or unreachable only makes the outbox
//! grow; at its byte bound a new batch is dropped, counted by events. A restarted agent publishes
//! what the outbox still holds, in order (the message ids make a batch already stored count
//! once).
//!
//! A log of segment files, `<first seq:020>.seg`, each a run of records appended with one write:
//!
//! ```text
//! [body length: u32 LE][CRC-32 of body: u32 LE][body]
//! body = [subject length: u16 LE][subject][message id length: u16 LE][message id][events: u32 LE][message]
//! ```
//!
//! Record `i` of a segment is batch `first seq + i`. A life of the agent starts a new segment,
//! and a new one follows once the open one holds [`SEGMENT_BYTES`]. `acked` holds the floor:
//! every batch below it was acknowledged (`[floor: u64 LE][floor ^ FLOOR_CHECK: u64 LE]`,
//! rewritten in place); a segment is removed once the floor passed its last batch. On start the
//! segments are read in order: a record that runs past the end of its segment (the tail a
//! crash cut off) is cut away, one that fails its checksum skipped, both counted; batches below
//! the floor are skipped and the rest queued. Batches acknowledged out of order above the floor are published again after a
//! restart, as a batch acknowledged just before a crash always was: JetStream stores them once
//! within its duplicate window and checkers recognise them.
//!
//! The batches of this life are also kept in memory, up to [`MEMORY_BYTES`]: publishing reads
//! the disk only for the others (a backlog, or what a previous life left). Not fsynced: the
//! outbox survives the agent's crash, not the node's.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{IoSlice, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use bytes::Bytes;

use super::batcher::Sealed;

/// A segment takes no more records once it holds this much.
pub const SEGMENT_BYTES: u64 = 16 << 20;
/// Messages of this life kept in memory for publishing, at most.
pub const MEMORY_BYTES: u64 = 64 << 20;
/// Checks the floor in `acked`.
const FLOOR_CHECK: u64 = 0x7265_7661_6e61_6e74; // "revenant"
/// Length and checksum before each record.
const RECORD_HEAD: usize = 8;

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
    /// Bytes of its record on disk.
    pub bytes: u64,
    /// The first seq of its segment, and where the message is in it.
    segment: u64,
    offset: u64,
    len: u32,
    /// The message, when this life keeps it in memory.
    payload: Option<Bytes>,
}

struct Segment {
    first: u64,
    file: File,
    len: u64,
}

pub struct Outbox {
    dir: PathBuf,
    max_bytes: u64,
    /// Bytes of the records not acknowledged yet.
    bytes: u64,
    /// Bytes of messages held in memory.
    memory: u64,
    next_seq: u64,
    queue: VecDeque<Entry>,
    /// Oldest first; records are appended to the last one, if `open`.
    segments: VecDeque<Segment>,
    open: bool,
    floor: u64,
    floor_file: File,
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
    /// Unreadable records (cut away) and files, removed.
    pub corrupt: u64,
}

fn segment_name(first: u64) -> String {
    format!("{first:020}.seg")
}

/// The body's head: subject, message id, events.
fn body_head(subject: &str, msg_id: &str, events: u32) -> Option<Vec<u8>> {
    let (s, m) = (subject.as_bytes(), msg_id.as_bytes());
    let mut h = Vec::with_capacity(8 + s.len() + m.len());
    h.extend_from_slice(&u16::try_from(s.len()).ok()?.to_le_bytes());
    h.extend_from_slice(s);
    h.extend_from_slice(&u16::try_from(m.len()).ok()?.to_le_bytes());
    h.extend_from_slice(m);
    h.extend_from_slice(&events.to_le_bytes());
    Some(h)
}

/// Subject, message id, events and the message's offset in `body`; `None` if it is not a body.
fn parse_body(body: &[u8]) -> Option<(String, String, u32, usize)> {
    let take = |at: &mut usize, n: usize| -> Option<&[u8]> {
        let v = body.get(*at..at.checked_add(n)?)?;
        *at += n;
        Some(v)
    };
    let mut at = 0;
    let n = u16::from_le_bytes(take(&mut at, 2)?.try_into().ok()?) as usize;
    let subject = std::str::from_utf8(take(&mut at, n)?).ok()?.to_owned();
    let n = u16::from_le_bytes(take(&mut at, 2)?.try_into().ok()?) as usize;
    let msg_id = std::str::from_utf8(take(&mut at, n)?).ok()?.to_owned();
    let events = u32::from_le_bytes(take(&mut at, 4)?.try_into().ok()?);
    if subject.is_empty() || msg_id.is_empty() || at == body.len() {
        return None;
    }
    Some((subject, msg_id, events, at))
}

/// Writes all of `parts` at the end of `f`.
fn write_all(f: &mut File, parts: &mut [IoSlice<'_>]) -> std::io::Result<()> {
    let mut parts = parts;
    while !parts.is_empty() {
        match f.write_vectored(parts) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut parts, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
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
        let floor_path = dir.join("acked");
        let mut floor_file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&floor_path)
            .map_err(io(&floor_path))?;
        let mut raw = Vec::new();
        floor_file.read_to_end(&mut raw).map_err(io(&floor_path))?;
        // Unreadable: nothing is taken as acknowledged (everything left is published again).
        let floor = match raw.get(..16) {
            Some(b) => {
                let f = u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
                let c = u64::from_le_bytes(b[8..].try_into().expect("8 bytes"));
                if f ^ FLOOR_CHECK == c { f } else { 0 }
            }
            None => 0,
        };
        let mut resumed = Resumed::default();
        let mut firsts = Vec::new();
        let mut legacy = Vec::new();
        for ent in std::fs::read_dir(dir).map_err(io(dir))? {
            let ent = ent.map_err(io(dir))?;
            let name = ent.file_name();
            let name = name.to_string_lossy();
            if name.ends_with(".tmp") {
                let _ = std::fs::remove_file(ent.path());
            } else if let Some(first) = name
                .strip_suffix(".seg")
                .and_then(|s| s.parse::<u64>().ok())
            {
                firsts.push(first);
            } else if let Some(seq) = name
                .strip_suffix(".batch")
                .and_then(|s| s.parse::<u64>().ok())
            {
                legacy.push((seq, ent.path()));
            }
        }
        firsts.sort_unstable();
        legacy.sort_unstable();
        let mut o = Outbox {
            dir: dir.into(),
            max_bytes,
            bytes: 0,
            memory: 0,
            next_seq: floor,
            queue: VecDeque::new(),
            segments: VecDeque::new(),
            open: false,
            floor,
            floor_file,
            _lock: lock,
        };
        for first in firsts {
            o.resume_segment(first, &mut resumed)?;
        }
        // An outbox of the one-file-per-batch layout: its batches join the log, in order.
        for (_, path) in legacy {
            match read_legacy(&path) {
                Some((subject, msg_id, events, payload)) => {
                    let s = Sealed {
                        subject,
                        msg_id,
                        payload: payload.into(),
                        events,
                    };
                    if o.push_unbounded(&s)? {
                        let _ = std::fs::remove_file(&path);
                    }
                }
                None => {
                    resumed.corrupt += 1;
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        resumed.batches = o.queue.len() as u64;
        o.collect();
        Ok((o, resumed))
    }

    /// Queues the records of segment `first` at or above the floor; cuts a torn tail.
    fn resume_segment(&mut self, first: u64, resumed: &mut Resumed) -> Result<(), OutboxError> {
        let path = self.dir.join(segment_name(first));
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .open(&path)
            .map_err(io(&path))?;
        let mut buf = Vec::new();
        file.read_to_end(&mut buf).map_err(io(&path))?;
        let mut at = 0usize;
        let mut seq = first;
        while at < buf.len() {
            let head = buf.get(at..at + RECORD_HEAD);
            let len = head.map_or(0, |h| {
                u32::from_le_bytes(h[..4].try_into().expect("4 bytes")) as usize
            });
            let Some(body) = head.and_then(|_| buf.get(at + RECORD_HEAD..at + RECORD_HEAD + len))
            else {
                // The tail a crash cut off.
                resumed.corrupt += 1;
                file.set_len(at as u64).map_err(io(&path))?;
                buf.truncate(at);
                break;
            };
            let crc = u32::from_le_bytes(buf[at + 4..at + 8].try_into().expect("4 bytes"));
            let parsed = (crc32fast::hash(body) == crc)
                .then(|| parse_body(body))
                .flatten();
            match parsed {
                None => resumed.corrupt += 1,
                Some((subject, msg_id, events, off)) if seq >= self.floor => {
                    let bytes = (RECORD_HEAD + len) as u64;
                    self.bytes += bytes;
                    self.queue.push_back(Entry {
                        seq,
                        subject,
                        msg_id,
                        events,
                        bytes,
                        segment: first,
                        offset: (at + RECORD_HEAD + off) as u64,
                        len: (len - off) as u32,
                        payload: None,
                    });
                }
                Some(_) => {}
            }
            at += RECORD_HEAD + len;
            seq += 1;
        }
        self.next_seq = self.next_seq.max(seq);
        if buf.is_empty() {
            // Nothing in it (a life that stopped right after creating it): its name may be
            // the next segment's.
            drop(file);
            let _ = std::fs::remove_file(&path);
            return Ok(());
        }
        self.segments.push_back(Segment {
            first,
            file,
            len: buf.len() as u64,
        });
        Ok(())
    }

    /// Appends a sealed batch. `Ok(false)`: the outbox is at its bound, the batch is not kept
    /// (the caller counts its events as dropped).
    pub fn push(&mut self, s: &Sealed) -> Result<bool, OutboxError> {
        let bytes = (RECORD_HEAD + 8 + s.subject.len() + s.msg_id.len() + s.payload.len()) as u64;
        if self.bytes + bytes > self.max_bytes {
            return Ok(false);
        }
        self.push_unbounded(s)
    }

    fn push_unbounded(&mut self, s: &Sealed) -> Result<bool, OutboxError> {
        let Some(head) = body_head(&s.subject, &s.msg_id, s.events) else {
            // A subject or message id of 64 KiB: not a batch this agent made.
            return Ok(false);
        };
        let body_len = head.len() + s.payload.len();
        let Ok(body_len32) = u32::try_from(body_len) else {
            return Ok(false);
        };
        let mut crc = crc32fast::Hasher::new();
        crc.update(&head);
        crc.update(&s.payload);
        let mut record_head = [0u8; RECORD_HEAD];
        record_head[..4].copy_from_slice(&body_len32.to_le_bytes());
        record_head[4..].copy_from_slice(&crc.finalize().to_le_bytes());
        let rotate = !self.open
            || self
                .segments
                .back()
                .is_none_or(|seg| seg.len >= SEGMENT_BYTES);
        if rotate {
            let path = self.dir.join(segment_name(self.next_seq));
            let file = OpenOptions::new()
                .read(true)
                .append(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(io(&path))?;
            self.segments.push_back(Segment {
                first: self.next_seq,
                file,
                len: 0,
            });
            self.open = true;
        }
        let seg = self.segments.back_mut().expect("a segment is open");
        let at = seg.len;
        let written = write_all(
            &mut seg.file,
            &mut [
                IoSlice::new(&record_head),
                IoSlice::new(&head),
                IoSlice::new(&s.payload),
            ],
        );
        if let Err(e) = written {
            // What was written of the record is cut away, so the segment stays a run of records.
            let _ = seg.file.set_len(at);
            return Err(OutboxError::Io {
                path: self.dir.join(segment_name(seg.first)),
                source: e,
            });
        }
        let bytes = (RECORD_HEAD + body_len) as u64;
        seg.len += bytes;
        let keep = self.memory + s.payload.len() as u64 <= MEMORY_BYTES;
        if keep {
            self.memory += s.payload.len() as u64;
        }
        self.queue.push_back(Entry {
            seq: self.next_seq,
            subject: s.subject.clone(),
            msg_id: s.msg_id.clone(),
            events: s.events,
            bytes,
            segment: seg.first,
            offset: at + (RECORD_HEAD + head.len()) as u64,
            len: s.payload.len() as u32,
            payload: keep.then(|| s.payload.clone()),
        });
        self.next_seq += 1;
        self.bytes += bytes;
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

    /// The message of an entry: from memory, else read from its segment.
    pub fn payload(&self, e: &Entry) -> Result<Bytes, OutboxError> {
        if let Some(p) = &e.payload {
            return Ok(p.clone());
        }
        let path = self.dir.join(segment_name(e.segment));
        let seg = self
            .segments
            .iter()
            .find(|s| s.first == e.segment)
            .ok_or_else(|| OutboxError::Io {
                path: path.clone(),
                source: std::io::ErrorKind::NotFound.into(),
            })?;
        let mut buf = vec![0; e.len as usize];
        seg.file
            .read_exact_at(&mut buf, e.offset)
            .map_err(io(&path))?;
        Ok(buf.into())
    }

    /// Counts out an acknowledged entry (any position: acknowledgements come back out of
    /// order); moves the floor and removes the segments it passed.
    pub fn remove(&mut self, seq: u64) {
        let Some(i) = self.queue.iter().position(|e| e.seq == seq) else {
            return;
        };
        let e = self.queue.remove(i).expect("position is in range");
        self.bytes -= e.bytes;
        if let Some(p) = &e.payload {
            self.memory -= p.len() as u64;
        }
        let floor = self.queue.front().map_or(self.next_seq, |e| e.seq);
        if floor != self.floor {
            self.floor = floor;
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&floor.to_le_bytes());
            b[8..].copy_from_slice(&(floor ^ FLOOR_CHECK).to_le_bytes());
            if let Err(e) = self.floor_file.write_all_at(&b, 0) {
                // Only costs publishing acknowledged batches again after a restart.
                tracing::warn!(error = %e, "outbox: acknowledged floor not written");
            }
            self.collect();
        }
    }

    /// Removes the segments whose batches are all below the floor (the open one stays).
    fn collect(&mut self) {
        while self.segments.len() > usize::from(self.open) {
            let end = self.segments.get(1).map_or(self.next_seq, |s| s.first);
            if end > self.floor {
                break;
            }
            let seg = self.segments.pop_front().expect("checked");
            let _ = std::fs::remove_file(self.dir.join(segment_name(seg.first)));
        }
    }
}

/// A batch file of the one-file-per-batch layout: the subject, a newline, the message id, a
/// newline, the event count, a newline, the message.
fn read_legacy(path: &Path) -> Option<(String, String, u32, Vec<u8>)> {
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
    Some((subject, msg_id, events, payload.to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sealed(i: u32) -> Sealed {
        Sealed {
            subject: "S.p0".into(),
            msg_id: format!("n/1/0/{i}"),
            payload: Bytes::from(vec![b'x'; 10]),
            events: 1,
        }
    }

    /// Each record: 8 bytes of length and checksum, 2 + 4 bytes of subject, 2 + 7 of message
    /// id, 4 of events and 10 of message.
    const RECORD: u64 = 37;

    fn segments(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".seg"))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn bounded_resumed_in_order_and_locked() {
        let dir = tempfile::tempdir().unwrap();
        let (mut o, r) = Outbox::open(dir.path(), 2 * RECORD + 5).unwrap();
        assert_eq!(r, Resumed::default());
        assert!(o.push(&sealed(0)).unwrap());
        assert!(o.push(&sealed(1)).unwrap());
        assert_eq!(o.bytes(), 2 * RECORD);
        assert!(!o.push(&sealed(2)).unwrap(), "over the bound");
        assert!(matches!(
            Outbox::open(dir.path(), 60),
            Err(OutboxError::InUse { .. })
        ));
        let first = o.peek(0, 1).next().unwrap().clone();
        assert_eq!(&o.payload(&first).unwrap()[..], &[b'x'; 10]);
        o.remove(first.seq);
        drop(o);
        let (mut o, r) = Outbox::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(
            r,
            Resumed {
                batches: 1,
                corrupt: 0
            }
        );
        let e = o.peek(0, 9).next().unwrap().clone();
        assert_eq!((e.seq, e.msg_id.as_str()), (1, "n/1/0/1"));
        assert_eq!(&o.payload(&e).unwrap()[..], &[b'x'; 10], "read from disk");
        // A new life writes a new segment and counts on from where the last one stopped.
        assert!(o.push(&sealed(3)).unwrap());
        assert_eq!(o.peek(1, 1).next().unwrap().seq, 2);
        assert_eq!(
            segments(dir.path()),
            ["00000000000000000000.seg", "00000000000000000002.seg"]
        );
        // Acknowledged out of order: the floor waits for the oldest, then both segments go
        // (the open one stays).
        o.remove(2);
        assert_eq!(segments(dir.path()).len(), 2);
        o.remove(1);
        assert_eq!(segments(dir.path()), ["00000000000000000002.seg"]);
        assert!(o.is_empty() && o.bytes() == 0);
        drop(o);
        let (o, r) = Outbox::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(r, Resumed::default());
        assert_eq!(o.next_seq, 3, "sequence numbers never go back");
        assert!(
            segments(dir.path()).is_empty(),
            "an acknowledged segment goes"
        );
    }

    #[test]
    fn a_torn_tail_is_cut_and_what_precedes_it_kept() {
        let dir = tempfile::tempdir().unwrap();
        let (mut o, _) = Outbox::open(dir.path(), 1 << 20).unwrap();
        for i in 0..3 {
            assert!(o.push(&sealed(i)).unwrap());
        }
        drop(o);
        let seg = dir.path().join(segment_name(0));
        let f = OpenOptions::new().write(true).open(&seg).unwrap();
        // The third record's message cut short, as a crash in its write would leave it.
        f.set_len(3 * RECORD - 4).unwrap();
        drop(f);
        std::fs::write(dir.path().join("junk.seg"), b"ignored").unwrap();
        let (mut o, r) = Outbox::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(
            r,
            Resumed {
                batches: 2,
                corrupt: 1
            }
        );
        assert_eq!(std::fs::metadata(&seg).unwrap().len(), 2 * RECORD);
        assert!(o.push(&sealed(9)).unwrap());
        let ids: Vec<_> = o.peek(0, 9).map(|e| (e.seq, e.msg_id.clone())).collect();
        assert_eq!(
            ids,
            [
                (0, "n/1/0/0".to_string()),
                (1, "n/1/0/1".to_string()),
                (2, "n/1/0/9".to_string())
            ]
        );
        // A flipped bit in a message fails its checksum: that batch is skipped.
        drop(o);
        let mut bytes = std::fs::read(&seg).unwrap();
        bytes[RECORD as usize - 1] ^= 1;
        std::fs::write(&seg, bytes).unwrap();
        let (o, r) = Outbox::open(dir.path(), 1 << 20).unwrap();
        assert_eq!((r.batches, r.corrupt), (2, 1));
        let seqs: Vec<u64> = o.peek(0, 9).map(|e| e.seq).collect();
        assert_eq!(seqs, [1, 2]);
    }

    #[test]
    fn batches_of_the_one_file_layout_join_the_log() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("00000000000000000007.batch"),
            b"S.p1\nn/1/1/4\n3\n{\"v\":1}",
        )
        .unwrap();
        std::fs::write(dir.path().join("00000000000000000008.batch"), b"junk").unwrap();
        let (o, r) = Outbox::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(
            r,
            Resumed {
                batches: 1,
                corrupt: 1
            }
        );
        let e = o.peek(0, 1).next().unwrap();
        assert_eq!(
            (e.subject.as_str(), e.msg_id.as_str(), e.events),
            ("S.p1", "n/1/1/4", 3)
        );
        assert_eq!(&o.payload(e).unwrap()[..], b"{\"v\":1}");
        assert!(
            std::fs::read_dir(dir.path()).unwrap().all(|e| !e
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".batch"))
        );
    }
}
