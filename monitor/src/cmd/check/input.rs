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

/// One input, read into events as the merge asks for them.
pub struct EventReader {
    /// As given on the command line (`-` for standard input).
    pub path: PathBuf,
    input: Box<dyn BufRead>,
    max_line: usize,
    line_no: u64,
    buf: Vec<u8>,
    /// Events read.
    pub events: u64,
    /// Lines that were not events.
    pub bad: u64,
    /// Set once the end (or an error that ends it) was reached.
    done: bool,
}

impl EventReader {
    /// Wraps `raw` (a file or standard input), recognising gzip and binary data from its first
    /// bytes.
    pub fn new(path: &Path, raw: Box<dyn Read>, max_line: usize) -> Result<Self, ReadError> {
        let mut input: Box<dyn BufRead> = Box::new(BufReader::with_capacity(1 << 20, raw));
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
            input,
            max_line,
            line_no: 0,
            buf: Vec::with_capacity(4096),
            events: 0,
            bad: 0,
            done: false,
        })
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

    /// The next event; each line that is not one goes to `on_bad` (and is counted) and is
    /// skipped. `Ok(None)` at the end.
    pub fn next_event(
        &mut self,
        on_bad: &mut dyn FnMut(&Path, BadLine),
    ) -> Result<Option<LifecycleEvent>, ReadError> {
        while !self.done {
            let chunk = self.input.fill_buf().inspect_err(|_| self.done = true)?;
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
                    let Some(fits) = self.next_line().inspect_err(|_| self.done = true)? else {
                        self.done = true;
                        break;
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
                Ok(Some(e)) => {
                    self.events += 1;
                    return Ok(Some(e));
                }
                Ok(None) => {}
                Err(message) => {
                    self.bad += 1;
                    let line = self.line_no;
                    on_bad(&self.path, BadLine { line, message });
                }
            }
        }
        Ok(None)
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
