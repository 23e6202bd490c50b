//! One input of `revenant check`: a file (or standard input) read line by line into events, in
//! the replay format (`ingest::replay::parse_raw_line`), with the bounds an offline tool given any
//! file needs:
//! - a gzip stream (by its magic bytes, whatever the name) is decompressed as it is read;
//! - binary data (a NUL byte or invalid UTF-8 in the first bytes, another compression format) is
//!   not read at all: one error says the file is not JSON Lines;
//! - a line longer than the bound (`--max-line-bytes`) is skipped without being held in memory,
//!   and reported;
//! - a line that is a violation (`revenant check`'s own output) says so.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use crate::event::LifecycleEvent;
use crate::ingest::replay;

/// What the first bytes of an input say it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sniffed {
    Text,
    Gzip,
    /// Another format that is not JSON Lines, named for the message.
    Binary(&'static str),
}

/// Reads the first bytes (without consuming them) and says what they are.
pub fn sniff(head: &[u8]) -> Sniffed {
    const MAGIC: &[(&[u8], &str)] = &[
        (
            b"\x28\xb5\x2f\xfd",
            "zstd-compressed data (decompress it first: zstd -d)",
        ),
        (
            b"\xfd7zXZ\x00",
            "xz-compressed data (decompress it first: xz -d)",
        ),
        (
            b"BZh",
            "bzip2-compressed data (decompress it first: bzip2 -d)",
        ),
        (b"PK\x03\x04", "a zip archive (extract it first)"),
        (b"\x7fELF", "an executable (ELF)"),
    ];
    if head.starts_with(b"\x1f\x8b") {
        return Sniffed::Gzip;
    }
    for (magic, what) in MAGIC {
        if head.starts_with(magic) {
            return Sniffed::Binary(what);
        }
    }
    if head.contains(&0) {
        return Sniffed::Binary("binary data (a NUL byte in its first bytes)");
    }
    match std::str::from_utf8(head) {
        Ok(_) => Sniffed::Text,
        // A character cut by the end of the window is fine; anything else is not text.
        Err(e) if e.error_len().is_none() => Sniffed::Text,
        Err(_) => Sniffed::Binary("binary data (invalid UTF-8 in its first bytes)"),
    }
}

/// Why a line was not an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadLine {
    pub line: u64,
    pub message: String,
}

/// Why an input could not be read any further.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error(
        "not a JSON Lines file: it holds {0}; `revenant check` reads events in the replay format, one JSON object per line (plain or gzip)"
    )]
    NotJsonLines(&'static str),
    #[error("reading it: {0}")]
    Io(#[from] std::io::Error),
}

/// What one line (or the input's end) gave.
enum Item {
    Event(LifecycleEvent),
    Bad(BadLine),
    /// The input cannot be read any further: the last item.
    Failed(ReadError),
}

/// Items decoded per chunk sent from the decoding thread: enough that the hand-over costs
/// nothing per event, few enough that a file waiting in the merge holds little.
const CHUNK_ITEMS: usize = 1024;
/// Chunks decoded ahead of the merge, per input.
const CHUNKS_AHEAD: usize = 2;

/// Decoded chunks, in the order of the input's lines.
type Chunks = std::sync::mpsc::Receiver<Vec<Item>>;

/// One input, read into events as the merge asks for them.
///
/// Reading and decoding happen on a thread of the input's own, a few chunks ahead of the merge:
/// decoding costs about twice what checking an event does, so the checker's thread no longer
/// waits for it, and several inputs decode on several cores. The thread starts at the first
/// read and ends at the input's end, at its first read error, or when the reader is dropped
/// (its next chunk has nowhere to go).
pub struct EventReader {
    /// As given on the command line (`-` for standard input).
    pub path: PathBuf,
    state: State,
    /// Events read.
    pub events: u64,
    /// Lines that were not events.
    pub bad: u64,
}

enum State {
    /// Opened, not read yet.
    Idle(Box<Lines>),
    Reading {
        chunks: Chunks,
        chunk: std::vec::IntoIter<Item>,
        /// Never joined: a thread blocked reading standard input would hold the process; it
        /// ends by itself once `chunks` is dropped.
        _thread: Option<std::thread::JoinHandle<()>>,
    },
    Done,
}

impl EventReader {
    /// Wraps `raw` (a file or standard input), recognising gzip and binary data from its first
    /// bytes.
    pub fn new(path: &Path, raw: Box<dyn Read + Send>, max_line: usize) -> Result<Self, ReadError> {
        let mut input: Box<dyn BufRead + Send> = Box::new(BufReader::with_capacity(1 << 20, raw));
        match sniff(input.fill_buf()?) {
            Sniffed::Text => {}
            Sniffed::Gzip => {
                let decoder = flate2::bufread::MultiGzDecoder::new(input);
                input = Box::new(BufReader::with_capacity(1 << 20, decoder));
                match sniff(input.fill_buf()?) {
                    Sniffed::Text => {}
                    Sniffed::Gzip => {
                        return Err(ReadError::NotJsonLines("gzip inside gzip"));
                    }
                    Sniffed::Binary(what) => return Err(ReadError::NotJsonLines(what)),
                }
            }
            Sniffed::Binary(what) => return Err(ReadError::NotJsonLines(what)),
        }
        Ok(EventReader {
            path: path.to_path_buf(),
            state: State::Idle(Box::new(Lines {
                input,
                max_line,
                line_no: 0,
                buf: Vec::with_capacity(4096),
                done: false,
            })),
            events: 0,
            bad: 0,
        })
    }

    /// The next event; each line that is not one goes to `on_bad` (and is counted) and is
    /// skipped. `Ok(None)` at the end.
    pub fn next_event(
        &mut self,
        on_bad: &mut dyn FnMut(&Path, BadLine),
    ) -> Result<Option<LifecycleEvent>, ReadError> {
        loop {
            let item = match &mut self.state {
                State::Done => return Ok(None),
                State::Idle(_) => {
                    let State::Idle(lines) = std::mem::replace(&mut self.state, State::Done) else {
                        unreachable!("matched above")
                    };
                    let (chunks, thread) = lines.spawn();
                    self.state = State::Reading {
                        chunks,
                        chunk: Vec::new().into_iter(),
                        _thread: thread,
                    };
                    continue;
                }
                State::Reading { chunks, chunk, .. } => match chunk.next() {
                    Some(item) => item,
                    None => match chunks.recv() {
                        Ok(next) => {
                            *chunk = next.into_iter();
                            continue;
                        }
                        // The thread ended after its last chunk.
                        Err(_) => {
                            self.state = State::Done;
                            return Ok(None);
                        }
                    },
                },
            };
            match item {
                Item::Event(e) => {
                    self.events += 1;
                    return Ok(Some(e));
                }
                Item::Bad(bad) => {
                    self.bad += 1;
                    on_bad(&self.path, bad);
                }
                Item::Failed(e) => {
                    self.state = State::Done;
                    return Err(e);
                }
            }
        }
    }
}

/// The reading and decoding half of an input, which runs on its own thread.
struct Lines {
    input: Box<dyn BufRead + Send>,
    max_line: usize,
    line_no: u64,
    buf: Vec<u8>,
    /// Set once the end (or an error that ends it) was reached.
    done: bool,
}

impl Lines {
    /// Decodes on a new thread, [`CHUNKS_AHEAD`] chunks ahead of the receiver.
    fn spawn(mut self: Box<Self>) -> (Chunks, Option<std::thread::JoinHandle<()>>) {
        let (tx, rx) = std::sync::mpsc::sync_channel(CHUNKS_AHEAD);
        let spawned = std::thread::Builder::new()
            .name("check-input".into())
            .spawn(move || {
                loop {
                    let mut chunk = Vec::with_capacity(CHUNK_ITEMS);
                    chunk.extend(std::iter::from_fn(|| self.next_item()).take(CHUNK_ITEMS));
                    let last = chunk.len() < CHUNK_ITEMS;
                    // A receiver that is gone wants no more.
                    if (!chunk.is_empty() && tx.send(chunk).is_err()) || last {
                        return;
                    }
                }
            });
        match spawned {
            Ok(thread) => (rx, Some(thread)),
            Err(e) => {
                // No thread to read on: the input ends with the reason.
                let (tx, rx) = std::sync::mpsc::sync_channel(1);
                let _ = tx.send(vec![Item::Failed(ReadError::Io(e))]);
                (rx, None)
            }
        }
    }

    /// The next line into `buf` (newline excluded), or `None` at the end. A line longer than the
    /// bound is consumed without being kept: `Some(false)`.
    fn next_line(&mut self) -> std::io::Result<Option<bool>> {
        self.buf.clear();
        let (mut any, mut fits) = (false, true);
        loop {
            let chunk = self.input.fill_buf()?;
            if chunk.is_empty() {
                return Ok(any.then_some(fits));
            }
            any = true;
            let (take, end) = match memchr::memchr(b'\n', chunk) {
                Some(i) => (i + 1, true),
                None => (chunk.len(), false),
            };
            let content = if end { take - 1 } else { take };
            if fits {
                if self.buf.len() + content > self.max_line {
                    fits = false;
                    self.buf.clear();
                } else {
                    self.buf.extend_from_slice(&chunk[..content]);
                }
            }
            self.input.consume(take);
            if end {
                return Ok(Some(fits));
            }
        }
    }

    /// The next event or bad line, the error that ends the input, or `None` at its end.
    fn next_item(&mut self) -> Option<Item> {
        while !self.done {
            let chunk = match self.input.fill_buf() {
                Ok(chunk) => chunk,
                Err(e) => {
                    self.done = true;
                    return Some(Item::Failed(e.into()));
                }
            };
            let parsed = match memchr::memchr(b'\n', chunk) {
                // A line that lies whole in the buffer is decoded there, not copied out first;
                // one cut by the buffer's end, or too long, goes through `next_line`.
                Some(i) if i <= self.max_line => {
                    self.line_no += 1;
                    let parsed = decode(&chunk[..i], self.line_no);
                    self.input.consume(i + 1);
                    parsed
                }
                _ => {
                    let fits = match self.next_line() {
                        Ok(Some(fits)) => fits,
                        Ok(None) => {
                            self.done = true;
                            break;
                        }
                        Err(e) => {
                            self.done = true;
                            return Some(Item::Failed(e.into()));
                        }
                    };
                    self.line_no += 1;
                    if fits {
                        decode(&self.buf, self.line_no)
                    } else {
                        Err(format!(
                            "longer than {} bytes (--max-line-bytes): skipped, not an event",
                            self.max_line
                        ))
                    }
                }
            };
            match parsed {
                Ok(Some(e)) => return Some(Item::Event(e)),
                Ok(None) => {}
                Err(message) => {
                    let line = self.line_no;
                    return Some(Item::Bad(BadLine { line, message }));
                }
            }
        }
        None
    }
}

/// Line `line`'s event, or why it is none; a line that is a violation says so.
fn decode(raw: &[u8], line: u64) -> Result<Option<LifecycleEvent>, String> {
    replay::parse_raw_line(raw, line).map_err(|message| {
        let text = std::str::from_utf8(raw).unwrap_or_default();
        // As the parser read it: a byte order mark is part of any line but the first.
        let text = match text.strip_prefix('\u{feff}') {
            Some(rest) if line == 1 => rest,
            _ => text,
        };
        match looks_like_a_violation(text) {
            true => format!(
                "this is a violation (what `revenant check` prints) or an expected verdict, not \
                 an event ({message})"
            ),
            false => message,
        }
    })
}

/// Whether `line` is a JSON object shaped like a violation or an expected verdict: a `rule`,
/// no `stage`.
fn looks_like_a_violation(line: &str) -> bool {
    serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(line)
        .is_ok_and(|m| m.contains_key("rule") && !m.contains_key("stage"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reader(bytes: &'static [u8], max_line: usize) -> Result<EventReader, ReadError> {
        EventReader::new(Path::new("t.jsonl"), Box::new(bytes), max_line)
    }

    fn drain(r: &mut EventReader) -> (Vec<LifecycleEvent>, Vec<BadLine>) {
        let (mut events, mut bad) = (Vec::new(), Vec::new());
        while let Some(e) = r.next_event(&mut |_, b| bad.push(b)).unwrap() {
            events.push(e);
        }
        (events, bad)
    }

    #[test]
    fn sniffs_text_gzip_and_binary() {
        assert_eq!(sniff(b"{\"time_unix_nano\":1}"), Sniffed::Text);
        assert_eq!(sniff(b""), Sniffed::Text);
        assert_eq!(sniff(b"\x1f\x8b\x08"), Sniffed::Gzip);
        assert!(matches!(sniff(b"\x28\xb5\x2f\xfd.."), Sniffed::Binary(w) if w.contains("zstd")));
        assert!(matches!(sniff(b"ab\0cd"), Sniffed::Binary(w) if w.contains("NUL")));
        assert!(matches!(sniff(b"\xff\xfe{"), Sniffed::Binary(w) if w.contains("UTF-8")));
        // A multi-byte character cut at the end of the window is still text.
        assert_eq!(
            sniff("{\"reason\":\"é".as_bytes().split_last().unwrap().1),
            Sniffed::Text
        );
    }

    #[test]
    fn long_lines_are_skipped_and_reported_and_the_next_line_is_read() {
        let mut r = reader(
            b"{\"time_unix_nano\":1,\"stage\":\"router\",\"kind\":\"received\",\"ids\":{\"rid\":\"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\"}}\n{\"time_unix_nano\":2,\"stage\":\"router\",\"kind\":\"received\"}",
            64,
        )
        .unwrap();
        let (events, bad) = drain(&mut r);
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].time_ns, 2);
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].line, 1);
        assert!(bad[0].message.contains("longer than 64 bytes"), "{bad:?}");
    }

    #[test]
    fn a_violation_line_says_what_it_is() {
        let mut r = reader(
            b"{\"rule\":\"orphaned-leg\",\"severity\":\"warning\",\"evidence\":[]}\n",
            1 << 20,
        )
        .unwrap();
        let (_, bad) = drain(&mut r);
        assert!(bad[0].message.starts_with("this is a violation"), "{bad:?}");
    }

    #[test]
    fn events_and_bad_lines_keep_their_order_across_chunks() {
        // Several chunks' worth, a bad line every 97th: the decoding thread's hand-over must
        // neither reorder, lose nor repeat anything.
        let lines = 5 * CHUNK_ITEMS + 3;
        let text: String = (1..=lines)
            .map(|n| match n % 97 {
                0 => "{\"stage\":\"router\"}\n".to_owned(),
                _ => format!(
                    "{{\"time_unix_nano\":{n},\"stage\":\"router\",\"kind\":\"received\"}}\n"
                ),
            })
            .collect();
        let mut r = reader(Box::leak(text.into_bytes().into_boxed_slice()), 1 << 20).unwrap();
        let (events, bad) = drain(&mut r);
        let times: Vec<u64> = events.iter().map(|e| e.time_ns).collect();
        let expected: Vec<u64> = (1..=lines as u64).filter(|n| n % 97 != 0).collect();
        assert_eq!(times, expected);
        let bad_lines: Vec<u64> = bad.iter().map(|b| b.line).collect();
        assert_eq!(
            bad_lines,
            (1..=lines as u64)
                .filter(|n| n % 97 == 0)
                .collect::<Vec<_>>()
        );
        assert_eq!(
            (r.events, r.bad),
            (expected.len() as u64, bad_lines.len() as u64)
        );
        assert!(
            r.next_event(&mut |_, b| panic!("{b:?}")).unwrap().is_none(),
            "ended stays ended"
        );
    }

    /// Reads `lines` good lines, then fails.
    struct FailsAfter {
        lines: Vec<u8>,
        at: usize,
    }

    impl Read for FailsAfter {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.at == self.lines.len() {
                return Err(std::io::Error::other("disk on fire"));
            }
            let n = buf.len().min(self.lines.len() - self.at);
            buf[..n].copy_from_slice(&self.lines[self.at..self.at + n]);
            self.at += n;
            Ok(n)
        }
    }

    #[test]
    fn a_read_error_comes_after_the_events_before_it_and_ends_the_input() {
        let lines: Vec<u8> = (1..=3000u64)
            .flat_map(|n| {
                format!("{{\"time_unix_nano\":{n},\"stage\":\"router\",\"kind\":\"received\"}}\n")
                    .into_bytes()
            })
            .collect();
        let mut r = EventReader::new(
            Path::new("t.jsonl"),
            Box::new(FailsAfter { lines, at: 0 }),
            1 << 20,
        )
        .unwrap();
        let mut n = 0;
        let err = loop {
            match r.next_event(&mut |_, b| panic!("{b:?}")) {
                Ok(Some(e)) => {
                    n += 1;
                    assert_eq!(e.time_ns, n);
                }
                Ok(None) => panic!("ended without the error"),
                Err(e) => break e,
            }
        };
        assert_eq!(n, 3000);
        assert!(err.to_string().contains("disk on fire"), "{err}");
        assert!(r.next_event(&mut |_, _| {}).unwrap().is_none());
    }

    #[test]
    fn a_reader_dropped_half_way_lets_its_thread_go() {
        let text: String = (1..=20 * CHUNK_ITEMS)
            .map(|n| {
                format!("{{\"time_unix_nano\":{n},\"stage\":\"router\",\"kind\":\"received\"}}\n")
            })
            .collect();
        let mut r = reader(Box::leak(text.into_bytes().into_boxed_slice()), 1 << 20).unwrap();
        assert!(r.next_event(&mut |_, _| {}).unwrap().is_some());
        let State::Reading {
            chunks,
            _thread: Some(thread),
            ..
        } = std::mem::replace(&mut r.state, State::Done)
        else {
            panic!("reading on a thread after the first event")
        };
        // The thread is blocked on a full channel (20 chunks, 2 ahead) until the receiver goes;
        // then its send fails and it returns.
        drop(chunks);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(thread.join().is_ok()).unwrap());
        assert_eq!(
            rx.recv_timeout(std::time::Duration::from_secs(10)),
            Ok(true),
            "the decoding thread did not end"
        );
    }

    #[test]
    fn gzip_is_read_and_binary_is_refused() {
        use std::io::Write as _;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(b"{\"time_unix_nano\":1,\"stage\":\"router\",\"kind\":\"received\"}\n")
            .unwrap();
        let bytes: &'static [u8] = Box::leak(gz.finish().unwrap().into_boxed_slice());
        let mut r = reader(bytes, 1 << 20).unwrap();
        let (events, bad) = drain(&mut r);
        assert_eq!((events.len(), bad.len()), (1, 0));
        let e = reader(b"\x00\x01\x02garbage", 1 << 20).err().unwrap();
        assert!(e.to_string().starts_with("not a JSON Lines file"), "{e}");
    }
}
