//! Pulls the few ids revenant keeps out of JSON bodies it only partly sees.
//!
//! A body is seen through [`BodyWindow`]: its first and last few KB, with gaps (bytes the kernel
//! did not capture) marked by a NUL byte, which valid JSON never contains raw. The scanner looks
//! for keys only in structural positions (after `{` or `,`), so a prompt that *mentions*
//! `"bootstrap_room"` (escaped inside a string) cannot forge an id. Everything else in the body,
//! prompt and completion text included, is dropped with the window.

use std::sync::LazyLock;

use memchr::memmem::Finder;
use smallvec::SmallVec;

use crate::event::BootstrapRoom;

/// Bytes of a body kept at each end.
pub const WINDOW: usize = 4096;
const GAP: u8 = 0;
/// Longest string value we accept for an id or reason.
const MAX_VALUE: usize = 256;

/// The first and last [`WINDOW`] bytes of a body, gaps marked.
#[derive(Default, Clone)]
pub struct BodyWindow {
    head: Vec<u8>,
    /// The last bytes, once the body outgrew the head ([`Self::tail_split`]); until then the
    /// tail is the head, and is not copied.
    tail: Vec<u8>,
    tail_split: bool,
    /// Body bytes seen or skipped so far.
    pub len: u64,
    /// Some bytes were not captured.
    pub gaps: bool,
    /// Times the bytes `"n"` occur in the body, the middle the windows drop included: a
    /// sample count ([`RequestIds::samples`]) is trusted only when every one was read.
    n_keys: u32,
    /// The body's last bytes before the current push (a `"n"` may straddle two pushes).
    carry: [u8; 2],
    carry_len: u8,
    /// vLLM's `vllm:cache_config_info` sample, looked for in every byte that goes by.
    cache_line: CacheLine,
    /// What this body can hold (every body's bytes pass here: a scan a body cannot need is
    /// skipped).
    reads: Reads,
}

/// What a [`BodyWindow`] looks for beyond its ends.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Reads {
    /// Both below: a body whose side is unknown.
    #[default]
    Everything,
    /// A request's `"n"` keys (its sample count).
    Requests,
    /// An answer's `vllm:cache_config_info` sample (`/metrics`).
    Answers,
}

/// The `vllm:cache_config_info` sample of a Prometheus answer, found wherever it lies: the
/// windows keep only a body's ends, and in vLLM's `/metrics` (tens of KB) the sample may be
/// anywhere. Every captured byte passes through [`CacheLine::push`] once.
#[derive(Default, Clone)]
struct CacheLine {
    /// The body's last bytes before the current push (the sample's name may straddle pushes);
    /// a newline stands for the body's start. Kept in place: every body's every push goes by
    /// here, and an allocation per push would cost the busiest path.
    carry: [u8; SAMPLE_EDGE],
    carry_len: u8,
    /// The sample line collected so far, from its name, until its newline.
    line: Option<Vec<u8>>,
    found: Option<CacheConfig>,
}

/// A sample's name at the start of a line.
const CACHE_SAMPLE: &[u8] = b"\nvllm:cache_config_info{";
/// Bytes of a sample's name that can lie before a push.
const SAMPLE_EDGE: usize = CACHE_SAMPLE.len() - 1;
/// Longest sample line read (every CacheConfig field is a label: about 1 KB in vLLM 0.34).
const MAX_CACHE_LINE: usize = 8192;

impl CacheLine {
    fn push(&mut self, mut data: &[u8], body_start: bool) {
        if self.found.is_some() {
            return;
        }
        if body_start {
            self.carry[0] = b'\n';
            self.carry_len = 1;
        }
        loop {
            if let Some(line) = &mut self.line {
                match memchr::memchr(b'\n', data) {
                    Some(end) => {
                        line.extend_from_slice(&data[..end]);
                        self.found = cache_config_in(line);
                        self.line = None;
                        if self.found.is_some() {
                            return;
                        }
                        data = &data[end..];
                    }
                    None => {
                        line.extend_from_slice(data);
                        if line.len() > MAX_CACHE_LINE {
                            self.line = None;
                        }
                        self.carry_len = 0;
                        return;
                    }
                }
            }
            // A name that starts in the carry and ends in `data`.
            let carried = usize::from(self.carry_len);
            let edge_len = data.len().min(SAMPLE_EDGE);
            let mut joined = [0u8; 2 * SAMPLE_EDGE];
            joined[..carried].copy_from_slice(&self.carry[..carried]);
            joined[carried..carried + edge_len].copy_from_slice(&data[..edge_len]);
            let edge = &joined[..carried + edge_len];
            self.carry_len = 0;
            let start = match CACHE_SAMPLE_FINDER.find(edge) {
                Some(q) if q < carried => Some(q + CACHE_SAMPLE.len() - carried),
                _ => CACHE_SAMPLE_FINDER
                    .find(data)
                    .map(|p| p + CACHE_SAMPLE.len()),
            };
            let Some(after) = start else {
                // The last bytes of carry and `data` together (all of `edge` when `data` is
                // shorter than a name).
                let tail = if data.len() >= SAMPLE_EDGE {
                    &data[data.len() - SAMPLE_EDGE..]
                } else {
                    &edge[edge.len() - SAMPLE_EDGE.min(edge.len())..]
                };
                self.carry[..tail.len()].copy_from_slice(tail);
                self.carry_len = tail.len() as u8;
                return;
            };
            self.line = Some(CACHE_SAMPLE[1..].to_vec());
            data = &data[after..];
        }
    }

    /// Bytes went by uncaptured: a line with a hole is not read.
    fn gap(&mut self) {
        self.carry_len = 0;
        self.line = None;
    }
}

/// Lengths only: body bytes (prompts, completions) must never reach a log line.
impl std::fmt::Debug for BodyWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BodyWindow")
            .field("len", &self.len)
            .field("gaps", &self.gaps)
            .field("kept_bytes", &(self.head.len() + self.tail.len()))
            .finish()
    }
}

impl BodyWindow {
    /// A window for a request's body: read for ids and sample counts.
    pub fn for_request() -> BodyWindow {
        BodyWindow {
            reads: Reads::Requests,
            ..BodyWindow::default()
        }
    }

    /// A window for an answer's body: read for outcomes and capacity.
    pub fn for_answer() -> BodyWindow {
        BodyWindow {
            reads: Reads::Answers,
            ..BodyWindow::default()
        }
    }

    pub fn push(&mut self, data: &[u8]) {
        if self.reads != Reads::Requests {
            self.cache_line.push(data, self.len == 0);
        }
        if self.reads != Reads::Answers {
            self.count_n_keys(data);
        }
        self.len += data.len() as u64;
        let room = WINDOW - self.head.len().min(WINDOW);
        if !self.tail_split && data.len() <= room {
            // Most bodies: the head holds all of it, and so is the tail too.
            self.head.extend_from_slice(data);
            return;
        }
        self.split_tail();
        let n = room.min(data.len());
        self.head.extend_from_slice(&data[..n]);
        let keep = data.len().min(WINDOW);
        self.tail.extend_from_slice(&data[data.len() - keep..]);
        if self.tail.len() > 2 * WINDOW {
            let cut = self.tail.len() - WINDOW;
            self.tail.drain(..cut);
        }
    }

    /// `n` body bytes went by uncaptured.
    pub fn skip(&mut self, n: u64) {
        if n == 0 {
            return;
        }
        self.len += n;
        self.gaps = true;
        self.carry_len = 0;
        self.cache_line.gap();
        if !self.tail_split && self.head.len() < WINDOW {
            self.head.push(GAP);
            return;
        }
        self.split_tail();
        if self.head.len() < WINDOW {
            self.head.push(GAP);
        }
        self.tail.push(GAP);
    }

    /// The body outgrows the head: the tail becomes its own copy, from the head's bytes.
    fn split_tail(&mut self) {
        if !self.tail_split {
            self.tail_split = true;
            self.tail = self.head.clone();
        }
    }

    /// Counts the `"n"` of `data`, those that start in the previous push's last bytes too.
    fn count_n_keys(&mut self, data: &[u8]) {
        let c = self.carry_len as usize;
        let d = data.len().min(2);
        let mut edge = [0u8; 4];
        edge[..c].copy_from_slice(&self.carry[..c]);
        edge[c..c + d].copy_from_slice(&data[..d]);
        let edge = &edge[..c + d];
        let straddling = (0..c).filter(|&s| edge[s..].starts_with(b"\"n\"")).count();
        let inside = N_KEY.find_iter(data).count();
        self.n_keys = self
            .n_keys
            .saturating_add((straddling + inside).min(u32::MAX as usize) as u32);
        let last = if data.len() >= 2 {
            &data[data.len() - 2..]
        } else {
            &edge[edge.len().saturating_sub(2)..]
        };
        self.carry[..last.len()].copy_from_slice(last);
        self.carry_len = last.len() as u8;
    }

    /// The sample count `n` a request body asks for (`n` at top level or in `sampling_params`
    /// for SGLang's `/generate`, `n` for the OpenAI endpoints; the largest when several are
    /// given, as a batch's per-prompt `sampling_params` may): 1 when the body names none.
    /// `None` when that cannot be told: bytes were not captured, or a `"n"` of the body was
    /// not read as a key with a count (it fell in the middle the windows drop, its value is an
    /// object or was cut, or it is a string value). `parts` are [`Self::parts`]' keys.
    fn samples(&self, parts: &[Keys<'_>]) -> Option<u32> {
        if self.gaps || self.reads == Reads::Answers {
            return None;
        }
        let tail_base = self.len - self.tail().len() as u64;
        let mut read: Vec<u64> = Vec::new();
        let mut n = 1u32;
        for (i, keys) in parts.iter().enumerate() {
            let base = if i == 0 { 0 } else { tail_base };
            for at in keys.values(N) {
                let off = base + at as u64;
                if read.contains(&off) {
                    continue;
                }
                let (Value::Str(v) | Value::Scalar(v)) = parse_value(&keys.buf[at..])?;
                n = n.max(sample_count(&v)?);
                read.push(off);
                if read.len() > self.n_keys as usize {
                    return None;
                }
            }
        }
        (read.len() == self.n_keys as usize).then_some(n)
    }

    fn tail(&self) -> &[u8] {
        let tail = if self.tail_split {
            &self.tail
        } else {
            &self.head
        };
        &tail[tail.len().saturating_sub(WINDOW)..]
    }

    /// Head, then tail; a body that fits in the head whole is scanned once.
    fn parts(&self) -> impl Iterator<Item = &[u8]> {
        let whole_in_head = !self.gaps && self.len == self.head.len() as u64;
        std::iter::once(self.head.as_slice()).chain((!whole_in_head).then(|| self.tail()))
    }

    /// The keys of each of [`Self::parts`], found once for every lookup of the body.
    fn keyed_parts(&self) -> Vec<Keys<'_>> {
        self.parts().map(Keys::of).collect()
    }

    /// Ids of a request body (`rid`, `bootstrap_*`).
    pub fn request_ids(&self) -> RequestIds {
        let mut ids = RequestIds::default();
        let parts = self.keyed_parts();
        for part in &parts {
            if ids.rid.is_none() {
                ids.rid = part.find_string(RID);
            }
            // The router appends these last: the tail's occurrence wins.
            if let Some(v) = part
                .find_value(BOOTSTRAP_ROOM)
                .and_then(|v| v.parse::<BootstrapRoom>().ok())
            {
                ids.bootstrap_room = Some(v.0);
            }
            if let Some(v) = part.find_string(BOOTSTRAP_HOST) {
                ids.bootstrap_host = Some(v);
            }
            if let Some(v) = part.find_value(BOOTSTRAP_PORT).and_then(|v| v.parse().ok()) {
                ids.bootstrap_port = Some(v);
            }
            if ids.remote_request_id.is_none() {
                ids.remote_request_id = part.find_string(REMOTE_REQUEST_ID);
            }
            if ids.transfer_id.is_none() {
                ids.transfer_id = part.find_string(TRANSFER_ID);
            }
            if ids.kv_leg.is_none() {
                ids.kv_leg = kv_leg(part);
            }
            if let Some(rooms) = room_list(part) {
                ids.room_list = Some(rooms);
            }
            if ids.batch.is_none() {
                ids.batch = batch_size(part);
            }
        }
        ids.samples = self.samples(&parts);
        ids
    }

    /// What a response body tells: token counts and, for errors, a short message.
    pub fn response_info(&self) -> ResponseInfo {
        let mut info = ResponseInfo::default();
        for part in &self.keyed_parts() {
            if info.prompt_tokens.is_none() {
                info.prompt_tokens = part.find_value(PROMPT_TOKENS).and_then(|v| v.parse().ok());
            }
            if info.disaggregation_mode.is_none() {
                info.disaggregation_mode = part.find_string(DISAGGREGATION_MODE);
            }
            if info.remote_request_id.is_none() {
                info.remote_request_id = part.find_string(REMOTE_REQUEST_ID);
            }
            if info.max_model_len.is_none() {
                info.max_model_len = part.find_value(MAX_MODEL_LEN).and_then(|v| v.parse().ok());
            }
            // The last finish reason in the body is the answer's: a stream's earlier chunks
            // carry `null`, its final one the reason.
            if let Some(f) = finish_reason(part) {
                info.finish = Some(f);
            }
            if let Some(code) = error_status(part) {
                info.stream_error = Some(code);
            }
            if info.message.is_none() {
                info.message = part
                    .find_string(MESSAGE)
                    .or_else(|| part.find_string(DETAIL))
                    .or_else(|| part.find_string(ERROR));
            }
        }
        info
    }

    /// vLLM's KV cache size from a Prometheus text answer (`/metrics`): the labels
    /// `num_gpu_blocks` and `block_size` of the `vllm:cache_config_info` sample, read wherever
    /// the captured bytes held it (a connection that carried a scrape is captured whole), else
    /// as far as a window kept it.
    pub fn vllm_cache_config(&self) -> Option<CacheConfig> {
        if self.reads == Reads::Requests {
            return None;
        }
        self.cache_line
            .found
            .or_else(|| self.parts().find_map(cache_config_in))
    }
}

/// The first bytes of an answer's body end the request without output: an error event (or a
/// body that is an error object), or a `finish_reason` that is an abort.
pub fn first_event_ends(first: &[u8]) -> bool {
    let keys = Keys::of(first);
    error_status(&keys).is_some() || matches!(finish_reason(&keys), Some(Finish::Abort { .. }))
}

/// The status of an error `part` reports: its last error event, else the part itself being an
/// error object.
fn error_status(part: &Keys<'_>) -> Option<u16> {
    stream_error(part).or_else(|| flat_error(part))
}

/// What vLLM's `vllm:cache_config_info` says about its KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfig {
    pub num_gpu_blocks: u64,
    pub block_size: u64,
}

impl CacheConfig {
    /// Tokens the KV cache holds.
    pub fn tokens(&self) -> u64 {
        self.num_gpu_blocks.saturating_mul(self.block_size)
    }
}

/// The sample's labels are read up to its `}` or wherever the window cuts the line: the line is
/// long (every CacheConfig field is a label) and a syscall's captured head often ends inside it.
/// Only a value whose closing quote was seen counts.
fn cache_config_in(part: &[u8]) -> Option<CacheConfig> {
    let at = CACHE_CONFIG_INFO.find_iter(part).find(|&p| {
        // The sample line (a `# HELP` / `# TYPE` line names the family without a `{`).
        (p == 0 || part[p - 1] == b'\n')
            && part.get(p + CACHE_CONFIG_INFO.needle().len()) == Some(&b'{')
    })?;
    let mut rest = &part[at + CACHE_CONFIG_INFO.needle().len() + 1..];
    let (mut blocks, mut block_size) = (None, None);
    loop {
        let eq = rest.iter().position(|&b| b == b'=')?;
        let name = &rest[..eq];
        if name.iter().any(|&b| matches!(b, b'}' | b'\n' | GAP)) || rest.get(eq + 1) != Some(&b'"')
        {
            break;
        }
        let value_at = eq + 2;
        let close = rest[value_at..].iter().position(|&b| b == b'"')?;
        let value = &rest[value_at..value_at + close];
        if value.iter().any(|&b| matches!(b, b'\n' | GAP | b'\\')) {
            break;
        }
        let number = || std::str::from_utf8(value).ok()?.parse::<u64>().ok();
        match name {
            b"num_gpu_blocks" => blocks = number(),
            b"block_size" => block_size = number(),
            _ => {}
        }
        if let (Some(num_gpu_blocks), Some(block_size)) = (blocks, block_size) {
            return Some(CacheConfig {
                num_gpu_blocks,
                block_size,
            });
        }
        rest = &rest[value_at + close + 1..];
        match rest.first() {
            Some(b',') => rest = &rest[1..],
            _ => break,
        }
    }
    None
}

/// Which leg of a vLLM PD pair a request body is, from its `kv_transfer_params`: the router
/// asks prefill to keep the KV for a remote decode, and decode to fetch it from a remote prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvLeg {
    Prefill,
    Decode,
}

fn kv_leg(part: &Keys<'_>) -> Option<KvLeg> {
    let is_true = |k: Key| part.find_value(k).is_some_and(|v| v == "true");
    if is_true(DO_REMOTE_DECODE) {
        Some(KvLeg::Prefill)
    } else if is_true(DO_REMOTE_PREFILL) {
        Some(KvLeg::Decode)
    } else {
        None
    }
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RequestIds {
    pub rid: Option<String>,
    pub bootstrap_room: Option<u64>,
    pub bootstrap_host: Option<String>,
    pub bootstrap_port: Option<u16>,
    /// vLLM decode leg: the prefill request whose KV it fetches (`kv_transfer_params`).
    pub remote_request_id: Option<String>,
    /// vLLM MooncakeConnector legs: the router's name of the transfer, the same on both legs
    /// (`kv_transfer_params.transfer_id`), which decode's per-request pull names.
    pub transfer_id: Option<String>,
    pub kv_leg: Option<KvLeg>,
    /// The number of prompts of a batch body (`text` a list of strings, `input_ids` a list of
    /// lists, `prompt` a list), when the whole list was captured.
    pub batch: Option<u32>,
    /// `bootstrap_room` given as a list (one room per prompt of a batch); one more than
    /// [`MAX_SUB_REQUESTS`] when the list is longer.
    pub room_list: Option<Vec<u64>>,
    /// The parallel samples each prompt asks for (`n`), when the body tells it for sure (see
    /// `BodyWindow::samples`).
    pub samples: Option<u32>,
}

/// Most sub-requests one body is read as.
pub const MAX_SUB_REQUESTS: usize = 64;

/// SGLang's fake bootstrap host: warmup requests name it, and no transfer ever happens for them
/// (`disaggregation/utils.py` `FAKE_BOOTSTRAP_HOST`, `http_server.py` warmup).
pub const FAKE_BOOTSTRAP_HOST: &str = "2.2.2.2";

impl RequestIds {
    /// The rooms and rids of the requests SGLang makes of one body (`io_struct.py`
    /// `_normalize_bootstrap_params`, `_normalize_rid`; `tokenizer_manager.py`
    /// `_handle_batch_request`): a batch of `k` prompts is `k` requests, rooms `room + i` for a
    /// scalar room (the list's rooms for a list), rids `rid_i` for a string rid. Parallel
    /// samples (`n > 1`) stay on their prompt's room: the tokenizer sends the prompt once to
    /// cache its prefix, then every sample, each under a fresh rid, all on that room.
    pub fn sub_requests(&self) -> Vec<(Option<u64>, Option<String>)> {
        if let Some(rooms) = &self.room_list {
            let k = rooms.len();
            return rooms
                .iter()
                .take(MAX_SUB_REQUESTS)
                .enumerate()
                .map(|(i, r)| (Some(*r), self.sub_rid(i, k)))
                .collect();
        }
        let k = self
            .batch
            .map_or(1, |b| (b as usize).clamp(1, MAX_SUB_REQUESTS));
        (0..k)
            .map(|i| {
                (
                    self.bootstrap_room.map(|r| r.wrapping_add(i as u64)),
                    self.sub_rid(i, k),
                )
            })
            .collect()
    }

    /// How many requests SGLang runs on each room this body names, when the body tells it
    /// for sure (else none): a prompt with `n > 1` is `n + 1` requests on its room (the prefix
    /// request that caches it, then each sample: `tokenizer_manager.py`
    /// `_handle_batch_request`), a room listed several times is that many prompts' requests.
    /// Rooms of a batch beyond [`MAX_SUB_REQUESTS`] are left out; a room list longer than that
    /// gives none (a room may repeat in the part left out).
    pub fn room_requests(&self) -> Vec<(u64, u32)> {
        let Some(n) = self.samples else {
            return Vec::new();
        };
        if self
            .room_list
            .as_ref()
            .is_some_and(|r| r.len() > MAX_SUB_REQUESTS)
        {
            return Vec::new();
        }
        let per_prompt = if n > 1 { n.saturating_add(1) } else { 1 };
        let mut out: Vec<(u64, u32)> = Vec::new();
        for room in self.sub_requests().into_iter().filter_map(|(room, _)| room) {
            match out.iter_mut().find(|(r, _)| *r == room) {
                Some((_, k)) => *k = k.saturating_add(per_prompt),
                None => out.push((room, per_prompt)),
            }
        }
        out
    }

    fn sub_rid(&self, i: usize, k: usize) -> Option<String> {
        match (&self.rid, k) {
            (rid, 1) => rid.clone(),
            (Some(rid), _) => Some(format!("{rid}_{i}")),
            (None, _) => None,
        }
    }

    /// The body is several requests (a batch of prompts).
    pub fn is_batch(&self) -> bool {
        self.room_list.as_ref().is_some_and(|r| r.len() > 1) || self.batch.is_some_and(|b| b > 1)
    }

    /// A warmup request (fake bootstrap host): it never enters the disaggregated path.
    pub fn is_warmup(&self) -> bool {
        self.bootstrap_host.as_deref() == Some(FAKE_BOOTSTRAP_HOST)
    }
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ResponseInfo {
    pub prompt_tokens: Option<u64>,
    /// Error message of an error response (the caller truncates it to a reason).
    pub message: Option<String>,
    /// What a `/server_info` answer says the server is: `prefill`, `decode` or `null`.
    pub disaggregation_mode: Option<String>,
    /// vLLM prefill's answer: the name decode fetches the KV under (`kv_transfer_params`).
    pub remote_request_id: Option<String>,
    /// vLLM `/v1/models`: the context length it serves.
    pub max_model_len: Option<u64>,
    /// How a successful generation answer says it finished (`finish_reason`, the final one).
    pub finish: Option<Finish>,
    /// The status of an error event inside a successful (streamed) answer: the request was
    /// refused or failed after the 200 went out.
    pub stream_error: Option<u16>,
}

/// A generation answer's `finish_reason`: SGLang writes `{"type": "abort", "message": ..,
/// "status_code": 400}` in `meta_info` (or `"abort"` in its OpenAI answers), vLLM `"abort"`.
/// An aborted request answered 200 ended, it did not complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// `status` is the `status_code` SGLang gives an abort it reports as an error (400 a refused
    /// input, 503 a refusal, 500 a failure; `tokenizer_manager.py` answers it as that status
    /// when not streaming). A graceful abort (the client or the router withdrew) has none.
    Abort { status: Option<u16> },
    /// `stop`, `length` and the like: the request ran to its end.
    Normal,
}

/// The last non-null `finish_reason` of `part`: a string, or the `type` (and `status_code`) of
/// an object.
fn finish_reason(part: &Keys<'_>) -> Option<Finish> {
    let mut found = None;
    for at in part.values(FINISH_REASON) {
        let v = &part.buf[at..];
        let (name, status) = match v.first() {
            Some(b'{') => {
                let obj = Keys::of(object_prefix(v));
                (obj.find_string(TYPE), find_status(&obj, STATUS_CODE))
            }
            _ => match parse_value(v) {
                Some(Value::Str(s)) => (Some(s), None),
                _ => (None, None),
            },
        };
        if let Some(name) = name {
            found = Some(if name.eq_ignore_ascii_case("abort") {
                Finish::Abort { status }
            } else {
                Finish::Normal
            });
        }
    }
    found
}

/// The status of the last error event in `part`: SGLang streams a refusal inside its HTTP 200
/// as `data: {"error": {"message": .., "code": 400, ..}}` (`http_server.py`, and the OpenAI
/// endpoints' `create_streaming_error_response`), vLLM its later errors the same way.
fn stream_error(part: &Keys<'_>) -> Option<u16> {
    part.values(ERROR)
        .rev()
        // A key at the very end of the window has no value yet: `get`, not an index.
        .filter(|&at| part.buf.get(at) == Some(&b'{'))
        .find_map(|at| find_status(&Keys::of(object_prefix(&part.buf[at..])), CODE))
}

/// How one request of a batch answer ended, as its own part of the body says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubOutcome {
    pub finish: Option<Finish>,
    pub stream_error: Option<u16>,
}

impl BodyWindow {
    /// The outcome of each request of a batch answer, by its index: a stream's events name
    /// theirs (`"index": i`, SGLang's `_stream_batch_responses`, the OpenAI choices), a whole
    /// answer lists them in order. A request whose part the capture lost is absent. The last
    /// outcome seen for an index wins (a stream's final event).
    pub fn sub_outcomes(&self) -> Vec<(usize, SubOutcome)> {
        let mut found: Vec<(usize, SubOutcome)> = Vec::new();
        let mut note = |i: usize, o: SubOutcome| {
            if o.finish.is_none() && o.stream_error.is_none() {
                return;
            }
            if let Some(at) = found.iter().position(|(j, _)| *j == i) {
                found[at].1 = o;
            } else if found.len() < MAX_SUB_REQUESTS {
                found.push((i, o));
            }
        };
        let outcome = |part: &[u8]| {
            let keys = Keys::of(part);
            SubOutcome {
                finish: finish_reason(&keys),
                stream_error: stream_error(&keys),
            }
        };
        for part in self.parts() {
            let start = part.iter().position(|b| !b.is_ascii_whitespace());
            if start.is_some_and(|s| part[s] == b'[') {
                // A whole answer: the list's elements, in order.
                for (i, elem) in top_level_spans(&part[start.unwrap_or(0)..])
                    .into_iter()
                    .enumerate()
                {
                    note(i, outcome(elem));
                }
                continue;
            }
            for event in part
                .split(|b| *b == b'\n')
                .filter(|l| l.starts_with(b"data: "))
            {
                if let Some(i) = Keys::of(event)
                    .find_value(INDEX)
                    .and_then(|v| v.parse().ok())
                {
                    note(i, outcome(event));
                }
            }
        }
        found
    }
}

/// The byte spans of the top-level elements of the list `v` starts, when it was captured whole.
fn top_level_spans(v: &[u8]) -> Vec<&[u8]> {
    let Some(end) = list_end(v) else {
        return Vec::new();
    };
    let inner = &v[1..end];
    let mut spans = Vec::new();
    let mut from = 0;
    for_each_top_level_comma(inner, |i| {
        spans.push(&inner[from..i]);
        from = i + 1;
    });
    if inner[from..].iter().any(|b| !b.is_ascii_whitespace()) {
        spans.push(&inner[from..]);
    }
    spans
}

/// `bootstrap_room` as a list of rooms (a batch whose prompts each name theirs).
fn room_list(part: &Keys<'_>) -> Option<Vec<u64>> {
    let at = part.values(BOOTSTRAP_ROOM).next_back()?;
    let v = &part.buf[at..];
    if v.first() != Some(&b'[') {
        return None;
    }
    let end = list_end(v)?;
    let rooms: Option<Vec<u64>> = v[1..end]
        .split(|b| *b == b',')
        .map(|r| std::str::from_utf8(r).ok()?.trim().parse::<u64>().ok())
        .take(MAX_SUB_REQUESTS + 1)
        .collect();
    rooms.filter(|r| !r.is_empty())
}

/// The prompts of a batch body: `text` or `prompt` a list (of strings), `input_ids` a list of
/// lists; `None` for a single prompt, or a list not captured whole.
fn batch_size(part: &Keys<'_>) -> Option<u32> {
    for (key, nested) in [(TEXT, false), (PROMPT, false), (INPUT_IDS, true)] {
        for at in part.values(key) {
            let v = &part.buf[at..];
            if v.first() != Some(&b'[') {
                continue;
            }
            let first = v[1..].iter().find(|b| !b.is_ascii_whitespace());
            // A list of token ids is one prompt; a list of lists is a batch.
            if nested && first != Some(&b'[') {
                continue;
            }
            return top_level_elements(v);
        }
    }
    None
}

/// The index of the `]` closing the list `v` starts, strings skipped; `None` when it is not
/// closed within the captured bytes (a gap, or the window's end).
fn list_end(v: &[u8]) -> Option<usize> {
    let mut depth = 0usize;
    let mut in_str = false;
    let mut escaped = false;
    for (i, &b) in v.iter().enumerate() {
        if b == GAP {
            return None;
        }
        if in_str {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_str = true,
            b'[' | b'{' => depth += 1,
            b']' | b'}' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

/// How many elements the list `v` starts holds at its top level, when captured whole.
fn top_level_elements(v: &[u8]) -> Option<u32> {
    let end = list_end(v)?;
    let inner = &v[1..end];
    if inner.iter().all(u8::is_ascii_whitespace) {
        return None;
    }
    let mut n = 1u32;
    for_each_top_level_comma(inner, |_| n += 1);
    Some(n)
}

/// Calls `f` with the index of each comma of `inner` (a list's bytes between its brackets)
/// that separates its top-level elements: outside strings and nested lists or objects.
fn for_each_top_level_comma(inner: &[u8], mut f: impl FnMut(usize)) {
    let (mut depth, mut in_str, mut escaped) = (0usize, false, false);
    for (i, &b) in inner.iter().enumerate() {
        if in_str {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_str = true,
            b'[' | b'{' => depth += 1,
            b']' | b'}' => depth = depth.saturating_sub(1),
            b',' if depth == 0 => f(i),
            _ => {}
        }
    }
}

/// The status of a body that is itself an error object, the OpenAI shape
/// (`{"object": "error", "message": …, "code": 500}`, SGLang's `create_error_response`, vLLM's
/// older answers): an error whatever status line carried it.
fn flat_error(part: &Keys<'_>) -> Option<u16> {
    (part.find_string(OBJECT).as_deref() == Some("error"))
        .then(|| find_status(part, CODE))
        .flatten()
}

/// An HTTP status as an error object names it (a number from 100 to 599).
fn find_status(obj: &Keys<'_>, key: Key) -> Option<u16> {
    match obj.find(key)? {
        Value::Scalar(s) => s.parse().ok().filter(|c| (100..600).contains(c)),
        Value::Str(_) => None,
    }
}

/// The bytes of the small object `v` starts (`{`…`}`), strings skipped so a brace in a message
/// does not end it; at most [`MAX_OBJECT`] bytes, and never past a gap.
fn object_prefix(v: &[u8]) -> &[u8] {
    let mut depth = 0usize;
    let mut in_str = false;
    let mut escaped = false;
    for (i, &b) in v.iter().enumerate().take(MAX_OBJECT) {
        if b == GAP {
            return &v[..i];
        }
        if in_str {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_str = true,
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return &v[..=i];
                }
            }
            _ => {}
        }
    }
    &v[..v.len().min(MAX_OBJECT)]
}

/// Longest error or finish-reason object read.
const MAX_OBJECT: usize = 2048;

/// Searchers for the byte strings looked for outside keys, built once: building one per search
/// cost more than the search itself on the short bodies of a busy server.
static CACHE_CONFIG_INFO: LazyLock<Finder<'static>> =
    LazyLock::new(|| Finder::new(b"vllm:cache_config_info"));
static CACHE_SAMPLE_FINDER: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(CACHE_SAMPLE));
static N_KEY: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"n\""));

/// A key revenant reads out of a body ([`key_named`] names them all).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Key(u8);

const RID: Key = Key(0);
const BOOTSTRAP_ROOM: Key = Key(1);
const BOOTSTRAP_HOST: Key = Key(2);
const BOOTSTRAP_PORT: Key = Key(3);
const PROMPT_TOKENS: Key = Key(4);
const DISAGGREGATION_MODE: Key = Key(5);
const MESSAGE: Key = Key(6);
const DETAIL: Key = Key(7);
const ERROR: Key = Key(8);
const REMOTE_REQUEST_ID: Key = Key(9);
const TRANSFER_ID: Key = Key(10);
const DO_REMOTE_DECODE: Key = Key(11);
const DO_REMOTE_PREFILL: Key = Key(12);
const MAX_MODEL_LEN: Key = Key(13);
const FINISH_REASON: Key = Key(14);
const TYPE: Key = Key(15);
const STATUS_CODE: Key = Key(16);
const TEXT: Key = Key(17);
const OBJECT: Key = Key(18);
const INDEX: Key = Key(19);
const INPUT_IDS: Key = Key(20);
const PROMPT: Key = Key(21);
const CODE: Key = Key(22);
const N: Key = Key(23);

/// The longest key [`key_named`] knows.
const MAX_KEY_NAME: usize = 19;

/// Calls `f` with the index of every `"` of `buf`, in order. Word by word: a byte equal to `"`
/// is a zero byte of `word ^ QUOTES`, found exactly (no carry crosses bytes, as in the
/// classic `haszero` test that also flags a byte above a zero).
fn for_each_quote(buf: &[u8], mut f: impl FnMut(usize)) {
    const QUOTES: u64 = u64::from_ne_bytes([b'"'; 8]);
    const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
    let mut chunks = buf.chunks_exact(8);
    let mut base = 0;
    for chunk in &mut chunks {
        let x = u64::from_le_bytes(chunk.try_into().expect("chunks of eight"));
        let x = x ^ QUOTES;
        let mut zeros = !(((x & LOW7) + LOW7) | x | LOW7);
        while zeros != 0 {
            f(base + (zeros.trailing_zeros() / 8) as usize);
            zeros &= zeros - 1;
        }
        base += 8;
    }
    for (i, &b) in chunks.remainder().iter().enumerate() {
        if b == b'"' {
            f(base + i);
        }
    }
}

/// The [`Key`] named `name`, if revenant reads it: a match the compiler turns into a switch
/// on the length, then a few compares (most keys a body holds are not read).
fn key_named(name: &[u8]) -> Option<Key> {
    Some(match name {
        b"rid" => RID,
        b"bootstrap_room" => BOOTSTRAP_ROOM,
        b"bootstrap_host" => BOOTSTRAP_HOST,
        b"bootstrap_port" => BOOTSTRAP_PORT,
        b"prompt_tokens" => PROMPT_TOKENS,
        b"disaggregation_mode" => DISAGGREGATION_MODE,
        b"message" => MESSAGE,
        b"detail" => DETAIL,
        b"error" => ERROR,
        b"remote_request_id" => REMOTE_REQUEST_ID,
        b"transfer_id" => TRANSFER_ID,
        b"do_remote_decode" => DO_REMOTE_DECODE,
        b"do_remote_prefill" => DO_REMOTE_PREFILL,
        b"max_model_len" => MAX_MODEL_LEN,
        b"finish_reason" => FINISH_REASON,
        b"type" => TYPE,
        b"status_code" => STATUS_CODE,
        b"text" => TEXT,
        b"object" => OBJECT,
        b"index" => INDEX,
        b"input_ids" => INPUT_IDS,
        b"prompt" => PROMPT,
        b"code" => CODE,
        b"n" => N,
        _ => return None,
    })
}

/// A sample count as JSON gives it: an integer (or an integral float, which SGLang's and the
/// OpenAI servers' validation accept), a string of one, or `null` (the default, 1).
fn sample_count(v: &str) -> Option<u32> {
    if v == "null" {
        return Some(1);
    }
    let n = v.parse::<u32>().ok().or_else(|| {
        let f = v.parse::<f64>().ok()?;
        (f.fract() == 0.0 && (0.0..=f64::from(u32::MAX)).contains(&f)).then_some(f as u32)
    })?;
    Some(n.max(1))
}

enum Value {
    Str(String),
    Scalar(String),
}

/// The keys [`key_named`] knows that stand in structural positions in one captured part
/// (`"key":` after `{`, `,` or a gap, its opening quote unescaped), found in one pass.
struct Keys<'a> {
    buf: &'a [u8],
    /// Each key found and where its value starts, in the order of the part (inline: a part
    /// holds a few of the keys read, and this is built for every part of every body).
    at: SmallVec<[(Key, u32); 16]>,
}

impl<'a> Keys<'a> {
    /// One pass over the part's quotes, eight bytes at a time: the parts read are a few
    /// hundred bytes on a busy server's short requests and answers, where a search's setup
    /// costs more than the search.
    fn of(buf: &'a [u8]) -> Keys<'a> {
        let mut at = SmallVec::new();
        for_each_quote(buf, |q| {
            let before = buf[..q].iter().rev().find(|b| !b.is_ascii_whitespace());
            // An escaped quote follows its backslash, never `{` or `,`. After a gap the context
            // is unknown; a quote inside a string would be escaped anyway.
            if matches!(before, Some(b'{' | b',' | &GAP))
                && let Some(found) = Self::key_at(buf, q)
            {
                at.push(found);
            }
        });
        Keys { buf, at }
    }

    /// The key whose opening quote is at `q`, with where its value starts, when a `:` follows.
    fn key_at(buf: &[u8], q: usize) -> Option<(Key, u32)> {
        let name = &buf[q + 1..];
        let len = name[..name.len().min(MAX_KEY_NAME + 1)]
            .iter()
            .position(|&b| b == b'"')?;
        let key = key_named(&name[..len])?;
        let mut j = q + len + 2;
        j += ws(&buf[j..]);
        if buf.get(j) != Some(&b':') {
            return None;
        }
        j += 1;
        j += ws(&buf[j..]);
        // A part is at most a window (or an object cut from one): offsets fit in 32 bits.
        Some((key, j as u32))
    }

    /// Where each value of `key` starts, in the order of the part.
    fn values(&self, key: Key) -> impl DoubleEndedIterator<Item = usize> + '_ {
        self.at
            .iter()
            .filter_map(move |&(k, v)| (k == key).then_some(v as usize))
    }

    /// The last value of `key` that reads as a value.
    fn find(&self, key: Key) -> Option<Value> {
        self.values(key)
            .rev()
            .find_map(|j| parse_value(&self.buf[j..]))
    }

    /// The last string value of `key`.
    fn find_string(&self, key: Key) -> Option<String> {
        match self.find(key)? {
            Value::Str(s) => Some(s),
            Value::Scalar(_) => None,
        }
    }

    /// The last value of `key` as text, string or number alike.
    fn find_value(&self, key: Key) -> Option<String> {
        match self.find(key)? {
            Value::Str(s) | Value::Scalar(s) => Some(s),
        }
    }
}

fn ws(b: &[u8]) -> usize {
    b.iter().take_while(|c| c.is_ascii_whitespace()).count()
}

fn parse_value(b: &[u8]) -> Option<Value> {
    match b.first()? {
        b'"' => {
            let mut out = Vec::new();
            let mut k = 1;
            while k < b.len() && out.len() <= MAX_VALUE {
                match b[k] {
                    b'"' => return Some(Value::Str(String::from_utf8_lossy(&out).into_owned())),
                    b'\\' => {
                        let c = *b.get(k + 1)?;
                        out.push(match c {
                            b'n' => b'\n',
                            b't' => b'\t',
                            b'u' => b'?',
                            other => other,
                        });
                        k += if c == b'u' { 6 } else { 2 };
                    }
                    GAP => return None,
                    c => {
                        out.push(c);
                        k += 1;
                    }
                }
            }
            None
        }
        c if c.is_ascii_digit() || *c == b'-' => {
            let n = b
                .iter()
                .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'+'))
                .count();
            // A number cut by the window or a gap is not a number we trust.
            match b.get(n) {
                Some(b',') | Some(b'}') | Some(b']') => {}
                Some(c) if c.is_ascii_whitespace() => {}
                _ => return None,
            }
            Some(Value::Scalar(String::from_utf8_lossy(&b[..n]).into_owned()))
        }
        b't' | b'f' | b'n' => {
            let word = ["true", "false", "null"]
                .into_iter()
                .find(|w| b.starts_with(w.as_bytes()))?;
            // A literal cut by the window or a gap is not trusted either.
            match b.get(word.len()) {
                Some(b',') | Some(b'}') | Some(b']') => Some(Value::Scalar(word.to_owned())),
                Some(c) if c.is_ascii_whitespace() => Some(Value::Scalar(word.to_owned())),
                _ => None,
            }
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const FIXTURE: &[u8] = br#"{"text": "Hello", "model": null, "sampling_params": {"max_new_tokens": 4}, "return_text_in_logprobs": false, "stream": false, "log_metrics": true, "return_hidden_states": false, "background": false, "no_logs": false, "return_bytes": false, "return_entropy": false, "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 9066467638188682269}"#;

    /// An `"error":` key that ends the captured window has no value to read: no status, no
    /// panic (found by the http_stream fuzz target).
    #[test]
    fn an_error_key_at_the_end_of_the_window_has_no_status() {
        assert_eq!(stream_error(&Keys::of(br#"data: {"error":"#)), None);
        assert_eq!(stream_error(&Keys::of(br#"data: {"error": "#)), None);
        assert_eq!(
            stream_error(&Keys::of(
                br#"data: {"error": {"message": "x", "code": 400}}"#
            )),
            Some(400)
        );
    }

    fn window(parts: &[&[u8]]) -> BodyWindow {
        let mut w = BodyWindow::default();
        for p in parts {
            w.push(p);
        }
        w
    }

    /// A Prometheus page like vLLM 0.34's `/metrics`: tens of KB, the `vllm:cache_config_info`
    /// sample (one label per CacheConfig field) in the middle, far from both windows.
    fn metrics_page(blocks: u64) -> Vec<u8> {
        let mut page = String::new();
        for i in 0..400 {
            page.push_str(&format!(
                "# HELP vllm:m{i} a metric\n# TYPE vllm:m{i} histogram\nvllm:m{i}_bucket{{engine=\"0\",le=\"0.5\",model_name=\"m\"}} 3.0\n"
            ));
            if i == 200 {
                page.push_str(&format!(
                    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"16\",cache_dtype=\"auto\",calculate_kv_scales=\"False\",cpu_offload_gb=\"0\",enable_prefix_caching=\"True\",engine=\"0\",gpu_memory_utilization=\"0.9\",is_attention_free=\"False\",kv_cache_size_tokens=\"{t}\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{blocks}\",num_gpu_blocks_override=\"None\",prefix_caching_hash_algo=\"sha256\",sliding_window=\"None\",swap_space=\"4\",swap_space_bytes=\"4294967296\"}} 1.0\n",
                    t = blocks * 16
                ));
            }
        }
        assert!(page.len() > 40_000);
        page.into_bytes()
    }

    #[test]
    fn the_cache_config_sample_is_found_anywhere_in_a_long_page() {
        let page = metrics_page(2731);
        let want = Some(CacheConfig {
            num_gpu_blocks: 2731,
            block_size: 16,
        });
        // Whatever the pushes' sizes, the sample's name and line straddling them.
        for chunk in [1usize, 7, 23, 24, 25, 511, 4096, page.len()] {
            let mut w = BodyWindow::default();
            for c in page.chunks(chunk) {
                w.push(c);
            }
            assert_eq!(w.vllm_cache_config(), want, "chunks of {chunk}");
        }
        let at = page
            .windows(CACHE_SAMPLE.len())
            .position(|w| w == CACHE_SAMPLE)
            .unwrap();
        for split in at..at + CACHE_SAMPLE.len() + 2 {
            let w = window(&[&page[..split], &page[split..]]);
            assert_eq!(w.vllm_cache_config(), want, "split at {split}");
        }
        // A hole in the line: not read (a cut number is another number).
        let mut w = BodyWindow::default();
        w.push(&page[..at + 300]);
        w.skip(10);
        w.push(&page[at + 310..]);
        assert_eq!(w.vllm_cache_config(), None);
        // A name mentioned elsewhere than at a line's start is not the sample.
        let w = window(&[
            b"# HELP x see vllm:cache_config_info{num_gpu_blocks=\"9\",block_size=\"1\"}\n",
        ]);
        assert_eq!(w.vllm_cache_config(), None);
        // The page's first line.
        let w = window(&[b"vllm:cache_config_info{block_size=\"8\",num_gpu_blocks=\"4\"} 1.0\n"]);
        assert_eq!(w.vllm_cache_config().map(|c| c.tokens()), Some(32));
    }

    #[test]
    fn samples_are_told_only_when_every_n_of_the_body_was_read() {
        let samples = |chunks: &[&[u8]]| {
            let mut w = BodyWindow::default();
            for c in chunks {
                w.push(c);
            }
            w.request_ids().samples
        };
        assert_eq!(
            samples(&[br#"{"text": "a", "bootstrap_room": 1}"#]),
            Some(1)
        );
        assert_eq!(samples(&[br#"{"text": "a", "n": 3}"#]), Some(3));
        assert_eq!(
            samples(&[br#"{"sampling_params": {"n": 2.0}, "n": null}"#]),
            Some(2)
        );
        // A `"n"` split across two reads is still counted, and read.
        assert_eq!(samples(&[br#"{"text": "a", ""#, br#"n": 4}"#]), Some(4));
        // A `"n"` not read as a count: a string value, an object, text the windows dropped.
        assert_eq!(samples(&[br#"{"text": "a", "stop": ["n"]}"#]), None);
        assert_eq!(
            samples(&[br#"{"tools": {"n": {"type": "integer"}}}"#]),
            None
        );
        let filler = vec![b'x'; 3 * WINDOW];
        assert_eq!(
            samples(&[
                br#"{"text": ""#,
                &filler,
                br#"", "n": 5, "input": ""#,
                &filler,
                br#""}"#
            ]),
            None
        );
        // Escaped quotes inside a prompt are not a key.
        assert_eq!(samples(&[br#"{"text": "say \"n\"", "n": 2}"#]), Some(2));
        let mut gap = BodyWindow::default();
        gap.push(br#"{"text": "a"#);
        gap.skip(10);
        gap.push(br#"", "bootstrap_room": 1}"#);
        assert_eq!(gap.request_ids().samples, None);
        // Requests per room: n > 1 adds the prefix request; a listed room repeats.
        let ids = |b: &[u8]| {
            let mut w = BodyWindow::default();
            w.push(b);
            w.request_ids().room_requests()
        };
        assert_eq!(ids(br#"{"n": 3, "bootstrap_room": 9}"#), vec![(9, 4)]);
        assert_eq!(
            ids(br#"{"text": ["a", "b", "c"], "bootstrap_room": [9, 7, 9]}"#),
            vec![(9, 2), (7, 1)]
        );
        assert_eq!(
            ids(br#"{"text": ["a", "b"], "bootstrap_room": 9}"#),
            vec![(9, 1), (10, 1)]
        );
        assert_eq!(
            ids(br#"{"text": "a", "stop": ["n"], "bootstrap_room": 9}"#),
            vec![]
        );
    }

    #[test]
    fn finish_reason_of_sglang_vllm_and_stream_answers() {
        let info = |parts: &[&[u8]]| window(parts).response_info().finish;
        // SGLang `/generate`: an object in meta_info.
        assert_eq!(
            info(&[br#"{"text":"","meta_info":{"id":"r1","finish_reason":{"type":"abort","message":"Request r1 aborted"},"prompt_tokens":5}}"#]),
            Some(Finish::Abort { status: None })
        );
        assert_eq!(
            info(&[br#"{"text":" the","meta_info":{"id":"r1","finish_reason":{"type":"length","length":1},"prompt_tokens":5}}"#]),
            Some(Finish::Normal)
        );
        // OpenAI shapes (SGLang and vLLM): a string.
        assert_eq!(
            info(&[
                br#"{"id":"cmpl-1","choices":[{"index":0,"text":"","finish_reason":"abort"}]}"#
            ]),
            Some(Finish::Abort { status: None })
        );
        // A stream: every chunk but the last says null; the last one counts.
        let mid: &[u8] =
            br#"data: {"choices":[{"index":0,"delta":{"content":" x"},"finish_reason":null}]}

"#;
        let mut chunks = vec![mid; 200];
        chunks.push(
            br#"data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}

data: [DONE]

"#,
        );
        assert_eq!(info(&chunks), Some(Finish::Normal));
        // No reason, or a completion text that merely contains the words, says nothing.
        assert_eq!(
            info(&[br#"{"text":"finish_reason: abort","meta_info":{}}"#]),
            None
        );
        assert_eq!(info(&[br#"{"error":{"message":"bad"}}"#]), None);
    }

    /// SGLang 0.5.23 answers a streamed request 200 before it validates it: the refusal is an
    /// event inside the stream (`http_server.py` `stream_results`, `serving_base.py`
    /// `create_streaming_error_response`), or a scheduler abort with its status.
    #[test]
    fn refusals_inside_a_stream() {
        let info = |parts: &[&[u8]]| window(parts).response_info();
        let generate = info(&[
            b"data: {\"error\": {\"message\": \"The input (9000 tokens) is longer than the model's context length (8192 tokens).\", \"type\": \"invalid_request_error\", \"code\": 400, \"retryable\": false}}\n\n",
            b"data: [DONE]\n\n",
        ]);
        assert_eq!(generate.stream_error, Some(400));
        assert!(generate.message.unwrap().contains("context length"));
        let openai = info(&[
            br#"data: {"error": {"object": "error", "message": "a } brace {", "type": "BadRequestError", "param": null, "code": 503}}"#,
            b"\n\ndata: [DONE]\n\n",
        ]);
        assert_eq!(openai.stream_error, Some(503));
        let scheduler = info(&[
            br#"data: {"text": "", "meta_info": {"id": "r", "finish_reason": {"type": "abort", "message": "Request r exceeds the maximum number of tokens: 9000 > 8192", "status_code": 400}, "prompt_tokens": 9000}}"#,
            b"\n\ndata: [DONE]\n\n",
        ]);
        assert_eq!(scheduler.finish, Some(Finish::Abort { status: Some(400) }));
        assert_eq!(scheduler.stream_error, None);
        // An error split across reads and a prompt that mentions one are both read right.
        let split = info(&[b"data: {\"err", b"or\": {\"code\"", b": 400}}\n\n"]);
        assert_eq!(split.stream_error, Some(400));
        let quoted = info(&[br#"{"text": "say \"error\": {\"code\": 400}", "meta_info": {"finish_reason": {"type": "stop"}}}"#]);
        assert_eq!(quoted.stream_error, None);
        assert_eq!(quoted.finish, Some(Finish::Normal));
        // A body that is an error object (OpenAI's shape), whatever status line carried it.
        let flat = info(&[br#"{"object": "error", "message": "Prefill transfer failed", "type": "500", "param": null, "code": 500}"#]);
        assert_eq!(flat.stream_error, Some(500));
        // A code that is no HTTP status is not one.
        assert_eq!(info(&[br#"{"error": {"code": "E42"}}"#]).stream_error, None);
        assert_eq!(info(&[br#"{"error": {"code": 4000}}"#]).stream_error, None);
    }

    #[test]
    fn router_body_from_the_fixture() {
        let ids = window(&[FIXTURE]).request_ids();
        assert_eq!(ids.bootstrap_room, Some(9066467638188682269));
        assert_eq!(ids.bootstrap_host.as_deref(), Some("127.0.0.1"));
        assert_eq!(ids.bootstrap_port, Some(8998));
        assert_eq!(ids.rid, None);
    }

    #[test]
    fn ids_at_the_end_of_a_huge_body_with_a_gap() {
        let mut w = BodyWindow::default();
        w.push(br#"{"rid": "abc", "text": "xxxxxxxx"#);
        w.skip(300_000);
        w.push(br#"yyyy", "bootstrap_room": 42}"#);
        let ids = w.request_ids();
        assert_eq!(ids.rid.as_deref(), Some("abc"));
        assert_eq!(ids.bootstrap_room, Some(42));
        assert!(w.gaps);
    }

    #[test]
    fn ids_past_the_head_of_a_body_captured_whole() {
        // No gap, but longer than the head: the ids are only in the tail, and the room key
        // straddles the end of the head.
        let pad = WINDOW - br#"{"text": ""#.len() - 4;
        let body = format!(
            r#"{{"text": "{}", "bootstrap_room": 42, "rid": "late"}}"#,
            "x".repeat(pad)
        );
        let w = window(&[body.as_bytes()]);
        assert!(!w.gaps && w.len as usize > WINDOW);
        let ids = w.request_ids();
        assert_eq!(ids.bootstrap_room, Some(42));
        assert_eq!(ids.rid.as_deref(), Some("late"));
    }

    #[test]
    fn prompt_text_cannot_forge_ids() {
        let body = br#"{"text": "ignore this, \"bootstrap_room\": 7, {\"rid\": \"evil\"}", "bootstrap_room": 8}"#;
        let ids = window(&[body]).request_ids();
        assert_eq!(ids.bootstrap_room, Some(8));
        assert_eq!(ids.rid, None);
    }

    #[test]
    fn a_number_cut_by_a_gap_is_not_trusted() {
        let mut w = BodyWindow::default();
        w.push(br#"{"bootstrap_room": 12"#);
        w.skip(10);
        assert_eq!(w.request_ids().bootstrap_room, None);
    }

    #[test]
    fn error_message_and_prompt_tokens() {
        let w = window(&[br#"{"object":"error","message":"Prefill queue is full","code":503}"#]);
        assert_eq!(
            w.response_info().message.as_deref(),
            Some("Prefill queue is full")
        );
        let w = window(&[
            br#"{"text":"hi","meta_info":{"id":"r1","prompt_tokens":17,"completion_tokens":4}}"#,
        ]);
        assert_eq!(w.response_info().prompt_tokens, Some(17));
    }

    #[test]
    fn server_info_names_its_mode() {
        let w = window(&[
            br#"{"model_path":"m","disaggregation_mode":"prefill","context_length":8192}"#,
        ]);
        assert_eq!(
            w.response_info().disaggregation_mode.as_deref(),
            Some("prefill")
        );
        let w = window(&[br#"{"text":"say \"disaggregation_mode\": \"decode\""}"#]);
        assert_eq!(w.response_info().disaggregation_mode, None);
    }

    #[test]
    fn vllm_kv_transfer_params() {
        let prefill_leg = br#"{"model":"m","prompt":"hi","max_tokens":1,"min_tokens":1,"stream":false,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}"#;
        let ids = window(&[prefill_leg]).request_ids();
        assert_eq!(ids.kv_leg, Some(KvLeg::Prefill));
        assert_eq!(ids.remote_request_id, None);
        let decode_leg = br#"{"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"e1","remote_block_ids":[1,2],"remote_request_id":"cmpl-abc-0","remote_host":"127.0.0.1","remote_port":5600,"tp_size":1},"model":"m","prompt":"hi","max_tokens":8}"#;
        let ids = window(&[decode_leg]).request_ids();
        assert_eq!(ids.kv_leg, Some(KvLeg::Decode));
        assert_eq!(ids.remote_request_id.as_deref(), Some("cmpl-abc-0"));
        // A prompt that spells the flags is text, not a leg.
        let forged = br#"{"prompt":""do_remote_decode": true","max_tokens":8}"#;
        assert_eq!(window(&[forged]).request_ids().kv_leg, None);
        let answer = br#"{"id":"cmpl-abc","object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":"length"}],"usage":{"prompt_tokens":12,"total_tokens":13,"completion_tokens":1},"kv_transfer_params":{"do_remote_prefill":true,"remote_request_id":"cmpl-abc","remote_port":5600}}"#;
        let info = window(&[answer]).response_info();
        assert_eq!(info.remote_request_id.as_deref(), Some("cmpl-abc"));
        assert_eq!(info.prompt_tokens, Some(12));
    }

    #[test]
    fn vllm_models_and_cache_config() {
        let models = br#"{"object":"list","data":[{"id":"m","object":"model","created":1,"owned_by":"vllm","root":"m","parent":null,"max_model_len":4096,"permission":[]}]}"#;
        assert_eq!(window(&[models]).response_info().max_model_len, Some(4096));
        let metrics = b"# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",num_cpu_blocks=\"0\",num_gpu_blocks=\"2048\"} 1.0\nvllm:num_requests_running{model_name=\"m\"} 0.0\n";
        let c = window(&[metrics]).vllm_cache_config().unwrap();
        assert_eq!(
            (c.num_gpu_blocks, c.block_size, c.tokens()),
            (2048, 16, 32768)
        );
        // A label cut by a gap is not trusted.
        let mut w = BodyWindow::default();
        w.push(b"vllm:cache_config_info{block_size=\"16\",num_gpu");
        w.skip(100);
        w.push(b"_blocks=\"5\"} 1.0\n");
        assert_eq!(w.vllm_cache_config(), None);
        let mut w = BodyWindow::default();
        w.push(b"vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"12");
        w.skip(100);
        assert_eq!(w.vllm_cache_config(), None);
        // A line the window cuts after the labels it needs still gives them.
        let cut = b"vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",num_gpu_blocks=\"128\",calculate_kv_scales=\"Fal";
        assert_eq!(
            window(&[cut]).vllm_cache_config().map(|c| c.tokens()),
            Some(2048)
        );
        assert_eq!(
            window(&[b"# TYPE vllm:cache_config_info gauge\n"]).vllm_cache_config(),
            None
        );
    }

    #[test]
    fn debug_output_never_shows_body_bytes() {
        let w = window(&[br#"{"text": "SECRET-PROMPT"}"#]);
        assert!(!format!("{w:?}").contains("SECRET"));
    }

    #[test]
    fn window_keeps_bounded_memory() {
        let mut w = BodyWindow::default();
        for _ in 0..1000 {
            w.push(&[b'a'; 1000]);
        }
        assert!(w.head.len() <= WINDOW && w.tail.len() <= 2 * WINDOW + 1000);
        assert_eq!(w.len, 1_000_000);
    }

    proptest! {
        #[test]
        fn never_panics(parts in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 0..6), gap in 0u64..5) {
            let mut w = BodyWindow::default();
            for (i, p) in parts.iter().enumerate() {
                if i as u64 == gap { w.skip(3); }
                w.push(p);
            }
            let _ = w.request_ids();
            let _ = w.response_info();
            let _ = w.vllm_cache_config();
        }

        /// The one-pass key index finds exactly the values a search per key finds: every
        /// `"key":` whose opening quote is unescaped and follows `{`, `,` or a gap.
        #[test]
        fn keys_are_found_where_a_search_per_key_finds_them(
            pieces in proptest::collection::vec(
                prop_oneof![
                    Just(&b"{"[..]), Just(&b","[..]), Just(&b":"[..]), Just(&b" "[..]),
                    Just(&b"\""[..]), Just(&b"\\"[..]), Just(&b"\0"[..]), Just(&b"rid"[..]),
                    Just(&b"n"[..]), Just(&b"code"[..]), Just(&b"bootstrap_room"[..]),
                    Just(&b"12"[..]), Just(&b"x"[..]), Just(&b"\n"[..]),
                    Just(&br#"{"rid":"#[..]), Just(&br#","n" : "#[..]), Just(&br#"\"code":"#[..]),
                    Just(&br#", "bootstrap_room": "#[..]), Just(&br#""text""#[..]),
                    Just(&br#"{"finish_reason":{"type":"#[..]),
                ],
                0..80,
            )
        ) {
            let buf: Vec<u8> = pieces.concat();
            let keys = Keys::of(&buf);
            for (key, name) in NAMED {
                let found: Vec<usize> = keys.values(key).collect();
                prop_assert_eq!(found, search_per_key(&buf, name.as_bytes()), "{}", name);
            }
        }

        /// The head is the body's first [`WINDOW`] bytes and the tail its last, a gap a
        /// single [`GAP`] byte, however the body arrived.
        #[test]
        fn the_ends_are_the_first_and_last_bytes(
            pushes in proptest::collection::vec(
                (proptest::collection::vec(1u8..=255, 0..6000), 0u64..3),
                0..8,
            )
        ) {
            let mut w = BodyWindow::default();
            let mut stream = Vec::new();
            for (bytes, gap) in &pushes {
                w.push(bytes);
                stream.extend_from_slice(bytes);
                w.skip(*gap);
                if *gap > 0 {
                    stream.push(GAP);
                }
            }
            prop_assert_eq!(&w.head[..], &stream[..stream.len().min(WINDOW)]);
            prop_assert_eq!(w.tail(), &stream[stream.len().saturating_sub(WINDOW)..]);
        }

        #[test]
        fn every_quote_is_found_in_order(buf in proptest::collection::vec(
            prop_oneof![Just(b'"'), Just(b'a'), Just(0u8), Just(0xa2u8), Just(0x22u8 ^ 0x80)],
            0..70,
        )) {
            let mut found = Vec::new();
            for_each_quote(&buf, |q| found.push(q));
            let expected: Vec<usize> = (0..buf.len()).filter(|&i| buf[i] == b'"').collect();
            prop_assert_eq!(found, expected);
        }
    }

    /// The definition [`Keys::of`] is held to: each occurrence of the key's bytes between two
    /// quotes, the opening one unescaped and after `{`, `,` or a gap (whitespace aside), then
    /// `:`.
    fn search_per_key(buf: &[u8], key: &[u8]) -> Vec<usize> {
        let mut out = Vec::new();
        for pos in memchr::memmem::find_iter(buf, key) {
            if pos == 0 || buf[pos - 1] != b'"' || buf.get(pos + key.len()) != Some(&b'"') {
                continue;
            }
            let q = pos - 1;
            if q > 0 && buf[q - 1] == b'\\' {
                continue;
            }
            let before = buf[..q].iter().rev().find(|b| !b.is_ascii_whitespace());
            if !matches!(before, Some(b'{') | Some(b',') | Some(&GAP)) {
                continue;
            }
            let mut j = pos + key.len() + 1;
            j += ws(&buf[j..]);
            if buf.get(j) != Some(&b':') {
                continue;
            }
            j += 1;
            out.push(j + ws(&buf[j..]));
        }
        out
    }

    /// Every key [`key_named`] knows, with its name.
    const NAMED: [(Key, &str); 24] = [
        (RID, "rid"),
        (BOOTSTRAP_ROOM, "bootstrap_room"),
        (BOOTSTRAP_HOST, "bootstrap_host"),
        (BOOTSTRAP_PORT, "bootstrap_port"),
        (PROMPT_TOKENS, "prompt_tokens"),
        (DISAGGREGATION_MODE, "disaggregation_mode"),
        (MESSAGE, "message"),
        (DETAIL, "detail"),
        (ERROR, "error"),
        (REMOTE_REQUEST_ID, "remote_request_id"),
        (TRANSFER_ID, "transfer_id"),
        (DO_REMOTE_DECODE, "do_remote_decode"),
        (DO_REMOTE_PREFILL, "do_remote_prefill"),
        (MAX_MODEL_LEN, "max_model_len"),
        (FINISH_REASON, "finish_reason"),
        (TYPE, "type"),
        (STATUS_CODE, "status_code"),
        (TEXT, "text"),
        (OBJECT, "object"),
        (INDEX, "index"),
        (INPUT_IDS, "input_ids"),
        (PROMPT, "prompt"),
        (CODE, "code"),
        (N, "n"),
    ];

    #[test]
    fn every_key_is_named_as_its_constant_says() {
        for (i, (key, name)) in NAMED.iter().enumerate() {
            assert_eq!(key.0 as usize, i, "{name}");
            assert_eq!(key_named(name.as_bytes()), Some(*key));
        }
        assert_eq!(key_named(b"rids"), None);
        assert_eq!(key_named(b""), None);
        assert_eq!(NAMED.iter().map(|(_, k)| k.len()).max(), Some(MAX_KEY_NAME));
    }
}
