//! HTTP/1.1 over one direction of a connection, as the kernel lets us see it: with gaps.
//!
//! [`HttpStream`] follows keep-alive and pipelined messages, `Content-Length` and chunked bodies
//! and SSE streams. Bodies go into a bounded [`BodyWindow`]; a gap inside a length-framed body is
//! skipped exactly, a gap anywhere else loses the framing, and the stream resynchronizes at the
//! next syscall that starts with a request or status line.

use super::json_ids::BodyWindow;

/// Longest header block we buffer; longer ones desynchronize the stream.
const MAX_HEAD: usize = 64 * 1024;
const MAX_HEADERS: usize = 64;
/// Longest kept path, header value.
const MAX_FIELD: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Unknown,
    Requests,
    Responses,
}

/// Bytes of a body's first write handed out with [`HttpEvent::BodyStarted`].
pub const FIRST_BODY_BYTES: usize = 1024;

#[derive(Debug)]
pub enum HttpEvent {
    RequestHead(RequestHead),
    ResponseHead(ResponseHead),
    /// First body bytes of the current answer (for a streamed response: tokens are flowing),
    /// and up to [`FIRST_BODY_BYTES`] of them: whether they are output or an abort that ends the
    /// stream at once is in its first event.
    BodyStarted {
        first: Vec<u8>,
    },
    /// The current message ended; its body window holds what we saw of the body.
    End {
        body: BodyWindow,
    },
    /// Framing lost: whatever message was in flight is abandoned.
    Desync,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestHead {
    pub method: String,
    /// Path without the query string.
    pub path: String,
    pub request_id: Option<String>,
    pub traceparent: Option<String>,
    pub content_length: Option<u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResponseHead {
    pub status: u16,
    pub sse: bool,
}

#[derive(Debug)]
enum State {
    /// Waiting for (or inside) a start line and headers.
    Head,
    Body(Body),
    /// Lost framing; wait for a syscall that starts a message.
    Desync,
}

#[derive(Debug)]
enum Body {
    Length(u64),
    Chunked(Chunk),
    UntilClose,
}

#[derive(Debug)]
enum Chunk {
    Size(Vec<u8>),
    Data(u64),
    DataEnd(u8),
    Trailer(Vec<u8>),
    /// A gap broke the chunk framing: the message ends at the next `\r\n0\r\n\r\n` seen (the
    /// terminating chunk, which the kernel's tail window captures at the end of a write), or
    /// when the next message starts a syscall. Holds the last bytes seen, for a terminator
    /// split across pieces.
    Lost(Vec<u8>),
}

/// The end of a chunked body: the CRLF after the last data chunk, then the zero-size chunk and
/// an empty trailer. JSON and SSE payloads carry no raw CR, so it does not occur inside one.
const CHUNKED_END: &[u8] = b"\r\n0\r\n\r\n";

#[derive(Debug)]
pub struct HttpStream {
    pub side: Side,
    state: State,
    head: Vec<u8>,
    body: BodyWindow,
    body_started: bool,
}

impl Default for HttpStream {
    fn default() -> Self {
        HttpStream {
            side: Side::Unknown,
            state: State::Desync,
            head: Vec::new(),
            body: BodyWindow::default(),
            body_started: false,
        }
    }
}

/// What a buffer starting a message looks like.
pub fn detect(data: &[u8]) -> Side {
    // A syscall shorter than the token still starts it (a message written byte by byte).
    let starts = |sig: &[u8]| !data.is_empty() && (data.starts_with(sig) || sig.starts_with(data));
    if starts(b"HTTP/1.") {
        return Side::Responses;
    }
    const METHODS: [&[u8]; 9] = [
        b"GET ",
        b"POST ",
        b"PUT ",
        b"DELETE ",
        b"HEAD ",
        b"OPTIONS ",
        b"PATCH ",
        b"CONNECT ",
        b"TRACE ",
    ];
    if METHODS.iter().any(|m| starts(m)) {
        return Side::Requests;
    }
    Side::Unknown
}

impl HttpStream {
    /// Feeds captured bytes. `syscall_start` says they begin a syscall's payload: the only
    /// place a lost stream can safely pick up again.
    pub fn feed(&mut self, mut data: &[u8], syscall_start: bool, out: &mut Vec<HttpEvent>) {
        if matches!(self.state, State::Desync) {
            if !syscall_start {
                return;
            }
            let side = detect(data);
            if side == Side::Unknown || (self.side != Side::Unknown && side != self.side) {
                return;
            }
            self.side = side;
            self.state = State::Head;
            self.head.clear();
        }
        // A syscall starting the next message ends one whose framing was lost.
        if syscall_start
            && matches!(self.state, State::Body(Body::Chunked(Chunk::Lost(_))))
            && detect(data) == self.side
        {
            self.finish(out);
        }
        while !data.is_empty() {
            let used = match &mut self.state {
                State::Desync => return,
                State::Head => self.feed_head(data, out),
                State::Body(_) => self.feed_body(data, out),
            };
            data = &data[used..];
        }
    }

    /// `n` bytes went by uncaptured.
    pub fn gap(&mut self, n: u64, out: &mut Vec<HttpEvent>) {
        if n == 0 {
            return;
        }
        match &mut self.state {
            State::Body(Body::Length(rem)) if n <= *rem => {
                *rem -= n;
                self.body.skip(n);
                if *rem == 0 {
                    self.finish(out);
                }
            }
            State::Body(Body::Chunked(Chunk::Data(rem))) if n <= *rem => {
                *rem -= n;
                self.body.skip(n);
                if *rem == 0 {
                    self.state = State::Body(Body::Chunked(Chunk::DataEnd(0)));
                }
            }
            State::Body(Body::UntilClose) => self.body.skip(n),
            State::Body(Body::Chunked(c)) => {
                self.body.skip(n);
                *c = Chunk::Lost(Vec::new());
            }
            State::Desync => {}
            _ => self.desync(out),
        }
    }

    /// The connection closed: a body delimited by the close ends here.
    pub fn close(&mut self, out: &mut Vec<HttpEvent>) {
        if matches!(self.state, State::Body(Body::UntilClose)) {
            self.finish(out);
        }
        self.state = State::Desync;
    }

    fn desync(&mut self, out: &mut Vec<HttpEvent>) {
        self.state = State::Desync;
        self.head.clear();
        self.body = BodyWindow::default();
        self.body_started = false;
        out.push(HttpEvent::Desync);
    }

    fn finish(&mut self, out: &mut Vec<HttpEvent>) {
        let body = std::mem::take(&mut self.body);
        self.body_started = false;
        self.state = State::Head;
        out.push(HttpEvent::End { body });
    }

    fn feed_head(&mut self, data: &[u8], out: &mut Vec<HttpEvent>) -> usize {
        let prev = self.head.len();
        let take = data.len().min((MAX_HEAD + 4).saturating_sub(prev)).max(1);
        // A head that arrives whole (the usual case) is read where it lies: only one split
        // across syscalls is gathered, so a message's bytes are not copied once more.
        if prev > 0 {
            self.head.extend_from_slice(&data[..take]);
        }
        let bytes = if prev == 0 { &data[..take] } else { &self.head };
        match parse_head(self.side, bytes) {
            HeadRead::Broken => {
                self.desync(out);
                data.len()
            }
            HeadRead::Partial => {
                if prev == 0 {
                    self.head.extend_from_slice(&data[..take]);
                }
                if self.head.len() > MAX_HEAD {
                    self.desync(out);
                }
                take
            }
            HeadRead::Complete(n, ev, framing) => {
                out.push(ev);
                self.head.clear();
                self.body = match self.side {
                    Side::Responses => BodyWindow::for_answer(),
                    Side::Requests => BodyWindow::for_request(),
                    Side::Unknown => BodyWindow::default(),
                };
                self.body_started = false;
                match framing {
                    None | Some(Body::Length(0)) => self.finish(out),
                    Some(b) => self.state = State::Body(b),
                }
                // Bytes of this buffer past the head belong to the body or the next message.
                n.saturating_sub(prev).max(1)
            }
        }
    }

    fn feed_body(&mut self, data: &[u8], out: &mut Vec<HttpEvent>) -> usize {
        let State::Body(body) = &mut self.state else {
            return data.len();
        };
        match body {
            Body::Length(rem) => {
                let n = (*rem).min(data.len() as u64) as usize;
                *rem -= n as u64;
                let done = *rem == 0;
                self.body_bytes(&data[..n], out);
                if done {
                    self.finish(out);
                }
                n
            }
            Body::UntilClose => {
                self.body_bytes(data, out);
                data.len()
            }
            Body::Chunked(chunk) => match chunk {
                Chunk::Size(line) => {
                    let Some(nl) = data.iter().position(|&b| b == b'\n') else {
                        line.extend_from_slice(data);
                        if line.len() > 1024 {
                            self.desync(out);
                        }
                        return data.len();
                    };
                    line.extend_from_slice(&data[..nl]);
                    let text = String::from_utf8_lossy(line);
                    let size = text
                        .trim()
                        .split(';')
                        .next()
                        .and_then(|s| u64::from_str_radix(s.trim(), 16).ok());
                    match size {
                        Some(0) => *chunk = Chunk::Trailer(Vec::new()),
                        Some(s) => *chunk = Chunk::Data(s),
                        None => {
                            self.desync(out);
                            return data.len();
                        }
                    }
                    nl + 1
                }
                Chunk::Data(rem) => {
                    let n = (*rem).min(data.len() as u64) as usize;
                    *rem -= n as u64;
                    if *rem == 0 {
                        *chunk = Chunk::DataEnd(0);
                    }
                    self.body_bytes(&data[..n], out);
                    n
                }
                Chunk::DataEnd(seen) => {
                    // The CRLF after chunk data.
                    let mut used = 0;
                    while used < data.len() && *seen < 2 {
                        if data[used] == b'\n' {
                            *seen = 2;
                        } else if data[used] == b'\r' {
                            *seen = 1;
                        } else {
                            self.desync(out);
                            return data.len();
                        }
                        used += 1;
                    }
                    if *seen >= 2 {
                        *chunk = Chunk::Size(Vec::new());
                    }
                    used
                }
                Chunk::Lost(carry) => {
                    let keep = CHUNKED_END.len() - 1;
                    let mut window = std::mem::take(carry);
                    let from = window.len();
                    window.extend_from_slice(&data[..data.len().min(CHUNKED_END.len())]);
                    // The terminator straddling the previous piece, else inside this one.
                    let end = memchr::memmem::find(&window, CHUNKED_END)
                        .map(|p| p + CHUNKED_END.len() - from)
                        .or_else(|| {
                            memchr::memmem::find(data, CHUNKED_END).map(|p| p + CHUNKED_END.len())
                        });
                    match end {
                        Some(n) => {
                            self.body_bytes(&data[..n], out);
                            self.finish(out);
                            n
                        }
                        None => {
                            let tail = if data.len() >= keep {
                                data[data.len() - keep..].to_vec()
                            } else {
                                let mut w = window[..from].to_vec();
                                w.extend_from_slice(data);
                                w[w.len().saturating_sub(keep)..].to_vec()
                            };
                            if let State::Body(Body::Chunked(Chunk::Lost(c))) = &mut self.state {
                                *c = tail;
                            }
                            self.body_bytes(data, out);
                            data.len()
                        }
                    }
                }
                Chunk::Trailer(line) => {
                    let Some(nl) = data.iter().position(|&b| b == b'\n') else {
                        line.extend_from_slice(data);
                        if line.len() > MAX_HEAD {
                            self.desync(out);
                        }
                        return data.len();
                    };
                    line.extend_from_slice(&data[..nl]);
                    if line.iter().all(|&b| b == b'\r') {
                        self.finish(out);
                    } else {
                        line.clear();
                    }
                    nl + 1
                }
            },
        }
    }

    fn body_bytes(&mut self, data: &[u8], out: &mut Vec<HttpEvent>) {
        if data.is_empty() {
            return;
        }
        // Only an answer's first bytes tell anything (output flowing, or an abort).
        if !self.body_started && self.side == Side::Responses {
            self.body_started = true;
            out.push(HttpEvent::BodyStarted {
                first: data[..data.len().min(FIRST_BODY_BYTES)].to_vec(),
            });
        }
        self.body.push(data);
    }
}

/// What the bytes gathered for a message's head read as.
enum HeadRead {
    /// The head ends `n` bytes in.
    Complete(usize, HttpEvent, Option<Body>),
    Partial,
    Broken,
}

fn parse_head(side: Side, bytes: &[u8]) -> HeadRead {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    match side {
        Side::Requests | Side::Unknown => {
            let mut req = httparse::Request::new(&mut headers);
            match req.parse(bytes) {
                Ok(httparse::Status::Complete(n)) => {
                    let known = Headers::of(req.headers);
                    let head = request_head(&req, &known);
                    let framing = body_framing(&known, false, false);
                    HeadRead::Complete(n, HttpEvent::RequestHead(head), framing)
                }
                Ok(httparse::Status::Partial) => HeadRead::Partial,
                Err(_) => HeadRead::Broken,
            }
        }
        Side::Responses => {
            let mut resp = httparse::Response::new(&mut headers);
            match resp.parse(bytes) {
                Ok(httparse::Status::Complete(n)) => {
                    let status = resp.code.unwrap_or(0);
                    let known = Headers::of(resp.headers);
                    let sse = text(known.content_type).is_some_and(|v| {
                        v.as_bytes()
                            .get(..17)
                            .is_some_and(|p| p.eq_ignore_ascii_case(b"text/event-stream"))
                    });
                    let no_body = status < 200 || status == 204 || status == 304;
                    let framing = body_framing(&known, true, no_body);
                    HeadRead::Complete(
                        n,
                        HttpEvent::ResponseHead(ResponseHead { status, sse }),
                        framing,
                    )
                }
                Ok(httparse::Status::Partial) => HeadRead::Partial,
                Err(_) => HeadRead::Broken,
            }
        }
    }
}

/// The headers revenant reads, the first of each name, found in one pass over the head.
#[derive(Default)]
struct Headers<'a> {
    request_id: Option<&'a [u8]>,
    traceparent: Option<&'a [u8]>,
    content_length: Option<&'a [u8]>,
    content_type: Option<&'a [u8]>,
    transfer_encoding: Option<&'a [u8]>,
}

impl<'a> Headers<'a> {
    fn of(headers: &[httparse::Header<'a>]) -> Headers<'a> {
        let mut known = Headers::default();
        for h in headers {
            let slot = match h.name.len() {
                12 if h.name.eq_ignore_ascii_case("x-request-id") => &mut known.request_id,
                11 if h.name.eq_ignore_ascii_case("traceparent") => &mut known.traceparent,
                14 if h.name.eq_ignore_ascii_case("content-length") => &mut known.content_length,
                12 if h.name.eq_ignore_ascii_case("content-type") => &mut known.content_type,
                17 if h.name.eq_ignore_ascii_case("transfer-encoding") => {
                    &mut known.transfer_encoding
                }
                _ => continue,
            };
            slot.get_or_insert(h.value);
        }
        known
    }
}

/// A header's value as text, trimmed; none when it is not UTF-8.
fn text(value: Option<&[u8]>) -> Option<&str> {
    value
        .and_then(|v| std::str::from_utf8(v).ok())
        .map(str::trim)
}

fn bounded(s: &str) -> String {
    let mut end = s.len().min(MAX_FIELD);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

fn request_head(req: &httparse::Request<'_, '_>, known: &Headers<'_>) -> RequestHead {
    let path = req.path.unwrap_or("");
    let path = path.split('?').next().unwrap_or("");
    RequestHead {
        method: bounded(req.method.unwrap_or("")),
        path: bounded(path),
        request_id: text(known.request_id).map(bounded),
        traceparent: text(known.traceparent).map(bounded),
        content_length: text(known.content_length).and_then(|v| v.parse().ok()),
    }
}

/// How the body of a message is delimited (RFC 9112 §6.3), `None` for no body.
fn body_framing(known: &Headers<'_>, response: bool, no_body: bool) -> Option<Body> {
    if no_body {
        return None;
    }
    if text(known.transfer_encoding).is_some_and(|v| {
        v.as_bytes()
            .windows(7)
            .any(|w| w.eq_ignore_ascii_case(b"chunked"))
    }) {
        return Some(Body::Chunked(Chunk::Size(Vec::new())));
    }
    if let Some(len) = text(known.content_length) {
        return len.parse().ok().map(Body::Length).or(Some(Body::Length(0)));
    }
    if response {
        Some(Body::UntilClose)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn run(side_bytes: &[&[u8]]) -> (HttpStream, Vec<HttpEvent>) {
        let mut s = HttpStream::default();
        let mut out = Vec::new();
        for b in side_bytes {
            s.feed(b, true, &mut out);
        }
        (s, out)
    }

    /// Header names in any case, the first of a repeated one, `chunked` anywhere in the
    /// transfer codings, an event stream's media type with parameters.
    #[test]
    fn headers_are_read_in_any_case_and_the_first_wins() {
        let req = b"POST /generate HTTP/1.1\r\nx-REQUEST-id: first\r\nX-Request-Id: second\r\nTRACEPARENT: 00-abc\r\nContent-Length: 2\r\n\r\n{}";
        let (_, out) = run(&[req]);
        let Some(HttpEvent::RequestHead(h)) = out.first() else {
            panic!("{out:?}");
        };
        assert_eq!(h.request_id.as_deref(), Some("first"));
        assert_eq!(h.traceparent.as_deref(), Some("00-abc"));
        assert_eq!(h.content_length, Some(2));
        assert!(matches!(out.last(), Some(HttpEvent::End { .. })));

        let mut s = HttpStream::default();
        let mut out = Vec::new();
        s.feed(b"HTTP/1.1 200 OK\r\nContent-Type: Text/Event-Stream; charset=utf-8\r\nTransfer-Encoding: gzip, Chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", true, &mut out);
        let Some(HttpEvent::ResponseHead(h)) = out.first() else {
            panic!("{out:?}");
        };
        assert!(h.sse);
        assert!(
            out.iter()
                .any(|e| matches!(e, HttpEvent::End { body } if body.len == 5)),
            "{out:?}"
        );
    }

    #[test]
    fn keep_alive_pipelined_requests() {
        let a = b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Request-Id: req-1\r\ncontent-length: 31\r\n\r\n{\"rid\":\"r1\",\"bootstrap_room\":5}";
        let two = [
            &a[..],
            b"GET /health HTTP/1.1\r\n\r\nGET /route?engine_rank=0 HTTP/1.1\r\n\r\n",
        ]
        .concat();
        let (_, out) = run(&[&two]);
        let heads: Vec<_> = out
            .iter()
            .filter_map(|e| match e {
                HttpEvent::RequestHead(h) => Some(h.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(heads.len(), 3);
        assert_eq!(heads[0].request_id.as_deref(), Some("req-1"));
        assert_eq!(heads[2].path, "/route");
        let ends: Vec<_> = out
            .iter()
            .filter_map(|e| match e {
                HttpEvent::End { body } => Some(body.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(ends.len(), 3);
        assert_eq!(ends[0].request_ids().rid.as_deref(), Some("r1"));
    }

    #[test]
    fn chunked_sse_response_split_anywhere() {
        let resp = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n10\r\ndata: {\"a\":12}\n\n\r\n0\r\n\r\nHTTP/1.1 400 Bad Request\r\ncontent-length: 23\r\n\r\n{\"message\":\"too long\"}";
        for split in 1..resp.len() {
            let mut s = HttpStream::default();
            let mut out = Vec::new();
            s.feed(&resp[..split], true, &mut out);
            s.feed(&resp[split..], false, &mut out);
            let statuses: Vec<u16> = out
                .iter()
                .filter_map(|e| match e {
                    HttpEvent::ResponseHead(h) => Some(h.status),
                    _ => None,
                })
                .collect();
            assert_eq!(statuses, vec![200, 400], "split at {split}");
            assert!(matches!(
                out[0],
                HttpEvent::ResponseHead(ResponseHead { sse: true, .. })
            ));
            let ends = out
                .iter()
                .filter(|e| matches!(e, HttpEvent::End { .. }))
                .count();
            assert_eq!(ends, 1, "the 400 body lacks one byte; split at {split}");
        }
    }

    /// hyper writes many SSE chunks in one `writev`; the kernel sends its head and the end of its
    /// last iovecs, so a gap cuts the chunk framing and the terminator is all that is left.
    #[test]
    fn chunked_end_is_found_after_a_gap_broke_the_framing() {
        let head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
        let tail = b"\r\nE\r\ndata: [DONE]\n\n\r\n0\r\n\r\n";
        for split in 0..=tail.len() {
            let mut s = HttpStream::default();
            let mut out = Vec::new();
            s.feed(head, true, &mut out);
            s.feed(b"A6\r\ndata: {\"x", false, &mut out);
            s.gap(300, &mut out);
            s.feed(&tail[..split], false, &mut out);
            s.feed(&tail[split..], false, &mut out);
            let ends = out
                .iter()
                .filter(|e| matches!(e, HttpEvent::End { .. }))
                .count();
            assert_eq!(ends, 1, "split at {split}: {out:?}");
            assert!(!out.iter().any(|e| matches!(e, HttpEvent::Desync)));
            // The next response parses normally.
            s.feed(b"HTTP/1.1 204 No Content\r\n\r\n", true, &mut out);
            assert!(matches!(out.last(), Some(HttpEvent::End { .. })), "{out:?}");
        }
        // Without its terminator, the next message starting a syscall ends it.
        let mut s = HttpStream::default();
        let mut out = Vec::new();
        s.feed(head, true, &mut out);
        s.feed(b"A6\r\ndata: {\"x", false, &mut out);
        s.gap(300, &mut out);
        s.feed(
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n",
            true,
            &mut out,
        );
        let kinds: Vec<&str> = out
            .iter()
            .map(|e| match e {
                HttpEvent::ResponseHead(_) => "head",
                HttpEvent::BodyStarted { .. } => "body",
                HttpEvent::End { .. } => "end",
                HttpEvent::RequestHead(_) => "req",
                HttpEvent::Desync => "desync",
            })
            .collect();
        assert_eq!(kinds, ["head", "body", "end", "head", "end"]);
    }

    #[test]
    fn gap_inside_a_length_body_is_skipped_exactly() {
        let mut s = HttpStream::default();
        let mut out = Vec::new();
        s.feed(
            b"POST /generate HTTP/1.1\r\ncontent-length: 1010\r\n\r\n{\"rid\":\"x\",",
            true,
            &mut out,
        );
        s.gap(1010 - 11 - 20, &mut out);
        s.feed(b"\"bootstrap_room\":77}", false, &mut out);
        let Some(HttpEvent::End { body }) = out.last() else {
            panic!("{out:?}")
        };
        assert_eq!(body.request_ids().bootstrap_room, Some(77));
        // The next request is framed correctly.
        s.feed(b"GET /x HTTP/1.1\r\n\r\n", true, &mut out);
        assert!(matches!(out.last(), Some(HttpEvent::End { .. })));
    }

    #[test]
    fn resyncs_after_garbage() {
        let mut s = HttpStream::default();
        let mut out = Vec::new();
        s.feed(b"\x00\x01garbage", true, &mut out);
        s.feed(b"more garbage", false, &mut out);
        assert!(out.is_empty());
        s.feed(
            b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n",
            true,
            &mut out,
        );
        assert!(matches!(
            out[0],
            HttpEvent::ResponseHead(ResponseHead { status: 503, .. })
        ));
    }

    #[test]
    fn response_until_close() {
        let mut s = HttpStream::default();
        let mut out = Vec::new();
        s.feed(b"HTTP/1.1 200 OK\r\n\r\nhello", true, &mut out);
        s.close(&mut out);
        assert!(matches!(out.last(), Some(HttpEvent::End { .. })));
    }

    proptest! {
        #[test]
        fn never_panics(chunks in proptest::collection::vec((proptest::collection::vec(any::<u8>(), 0..200), any::<bool>(), 0u64..100), 0..10)) {
            let mut s = HttpStream::default();
            let mut out = Vec::new();
            for (c, start, gap) in &chunks {
                s.feed(c, *start, &mut out);
                s.gap(*gap, &mut out);
            }
            s.close(&mut out);
        }

        #[test]
        fn never_panics_after_a_valid_prefix(tail in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut s = HttpStream::default();
            let mut out = Vec::new();
            s.feed(b"POST /generate HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n", true, &mut out);
            s.feed(&tail, false, &mut out);
        }
    }
}
