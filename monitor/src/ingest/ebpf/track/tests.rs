use super::*;
use crate::event::{BootstrapRoom, ProtocolBreach, Source, Stage};
use crate::ingest::ebpf::record::{Conn, DataPiece, Record};
use crate::ingest::ebpf::zmtp::vllm_bytes;
use monitor_common::{Header, kind, syscall};
use proptest::prelude::*;

const ROUTER: u32 = 100;
const PREFILL: u32 = 200;
const DECODE: u32 = 300;

/// Plays syscalls through the tracker exactly as the kernel side captures them: the head and
/// the tail of every syscall, nothing in between.
struct Sim {
    t: Tracker,
    now: u64,
    head: usize,
    tail: usize,
    out: Vec<LifecycleEvent>,
}

impl Sim {
    fn new() -> Sim {
        let mut t = Tracker::new(
            Some("node-a".into()),
            Clock::default(),
            TrackerLimits::default(),
        );
        t.set_role(ROUTER, Role::Router);
        t.set_role(PREFILL, Role::Prefill);
        t.set_role(DECODE, Role::Decode);
        t.add_local_listener(31001, Role::Prefill);
        t.add_local_listener(31002, Role::Decode);
        Sim {
            t,
            now: 1_000,
            head: 512,
            tail: 512,
            out: Vec::new(),
        }
    }

    fn hdr(&mut self, kind: u32, tgid: u32) -> Header {
        self.now += 10;
        Header {
            kind,
            tgid,
            tid: tgid,
            _pad: 0,
            ts_ns: self.now,
        }
    }

    fn connect(&mut self, tgid: u32, fd: u32, peer: &str) {
        let hdr = self.hdr(kind::CONNECT, tgid);
        self.t.on_record(
            &Record::Connect(Conn {
                hdr,
                fd,
                peer: Some(peer.parse().unwrap()),
                listener_fd: None,
                local: None,
            }),
            &mut self.out,
        );
    }

    fn accept(&mut self, tgid: u32, fd: u32) {
        let hdr = self.hdr(kind::ACCEPT, tgid);
        self.t.on_record(
            &Record::Accept(Conn {
                hdr,
                fd,
                peer: Some("127.0.0.1:40000".parse().unwrap()),
                listener_fd: Some(3),
                local: None,
            }),
            &mut self.out,
        );
    }

    fn close(&mut self, tgid: u32, fd: u32) {
        let hdr = self.hdr(kind::CLOSE, tgid);
        self.t.on_record(&Record::Close { hdr, fd }, &mut self.out);
    }

    /// One syscall moving `bytes`, split into `chunk`-sized syscalls.
    fn io(&mut self, tgid: u32, fd: u32, sc: u32, bytes: &[u8], chunk: usize) {
        for part in bytes.chunks(chunk.max(1)) {
            let hdr = self.hdr(kind::DATA, tgid);
            let total = part.len();
            let mut pieces = vec![(0, total.min(self.head))];
            if total > self.head {
                let start = total.saturating_sub(self.tail).max(self.head);
                pieces.push((start, total));
            }
            for (a, b) in pieces {
                let d = DataPiece {
                    hdr,
                    fd,
                    syscall: sc,
                    total: total as u64,
                    off: a as u32,
                    bytes: &part[a..b],
                };
                self.t.on_record(&Record::Data(d), &mut self.out);
            }
        }
    }

    /// One syscall as the kernel sends it for a `capture::STREAM` socket: every byte, in
    /// records of `MAX_CAPTURE`.
    fn io_streamed(&mut self, tgid: u32, fd: u32, sc: u32, bytes: &[u8]) {
        let hdr = self.hdr(kind::DATA, tgid);
        for (i, piece) in bytes.chunks(monitor_common::MAX_CAPTURE).enumerate() {
            let d = DataPiece {
                hdr,
                fd,
                syscall: sc,
                total: bytes.len() as u64,
                off: (i * monitor_common::MAX_CAPTURE) as u32,
                bytes: piece,
            };
            self.t.on_record(&Record::Data(d), &mut self.out);
        }
    }

    fn kinds(&self) -> Vec<(Stage, Kind, Option<u64>)> {
        self.out
            .iter()
            .map(|e| (e.stage, e.kind, e.ids.bootstrap_room.map(|r| r.0)))
            .collect()
    }
}

fn generate_request(prompt_len: usize, room: u64, canary: &str) -> Vec<u8> {
    let mut prompt = canary.to_string();
    while prompt.len() < prompt_len {
        prompt.push_str(" lorem ipsum");
    }
    let body = format!(
        r#"{{"text": "{prompt}", "sampling_params": {{"max_new_tokens": 4}}, "stream": false, "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": {room}}}"#
    );
    format!(
        "POST /generate HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\nx-request-id: req-7\r\ntraceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// SGLang answers an aborted request 200 with `finish_reason` `{"type": "abort"}`: that answer
/// ends the leg as `aborted`; one with a normal finish is `completed`.
#[test]
fn answer_200_with_an_abort_finish_is_aborted() {
    let ok_with = |body: &[u8]| {
        let mut r = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        r.extend_from_slice(body);
        r
    };
    let mut s = Sim::new();
    s.accept(PREFILL, 7);
    s.accept(PREFILL, 9);
    s.io(
        PREFILL,
        7,
        syscall::RECVFROM,
        &generate_request(10, 77, "CANARY-a"),
        65536,
    );
    let aborted = ok_with(br#"{"text":"","meta_info":{"id":"r-77","finish_reason":{"type":"abort","message":"Request r-77 aborted: decode aborted the transfer"},"prompt_tokens":10}}"#);
    s.io(PREFILL, 7, syscall::SENDTO, &aborted, 4096);
    s.io(
        PREFILL,
        9,
        syscall::RECVFROM,
        &generate_request(10, 78, "CANARY-b"),
        65536,
    );
    let done = ok_with(br#"{"text":"","meta_info":{"id":"r-78","finish_reason":{"type":"length","length":1},"prompt_tokens":10}}"#);
    s.io(PREFILL, 9, syscall::SENDTO, &done, 4096);
    assert_eq!(
        s.kinds(),
        vec![
            (Stage::Prefill, Kind::Received, Some(77)),
            (Stage::Prefill, Kind::Aborted, Some(77)),
            (Stage::Prefill, Kind::Received, Some(78)),
            (Stage::Prefill, Kind::Completed, Some(78)),
        ]
    );
    assert_eq!(s.out[1].status, Some(200));
    assert_eq!(
        s.out[1].reason.as_deref(),
        Some("Request r-77 aborted: decode aborted the transfer")
    );
}

#[test]
fn prefill_rejects_while_decode_works_big_prompt() {
    let mut s = Sim::new();
    let req = generate_request(300_000, 9066467638188682269, "CANARY-7f3a");
    s.connect(ROUTER, 5, "127.0.0.1:31001");
    s.connect(ROUTER, 6, "127.0.0.1:31002");
    s.accept(PREFILL, 7);
    s.accept(DECODE, 8);
    // hyper writes in 64 KiB slices, the servers read 65536 at a time.
    s.io(ROUTER, 5, syscall::WRITEV, &req, 65536);
    s.io(ROUTER, 6, syscall::WRITEV, &req, 65536);
    s.io(PREFILL, 7, syscall::RECVFROM, &req, 65536);
    s.io(DECODE, 8, syscall::RECVFROM, &req, 40000);
    let rej = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 52\r\n\r\n{\"object\":\"error\",\"message\":\"Prefill is full\",\"x\":1}";
    s.io(PREFILL, 7, syscall::SENDTO, rej, 4096);
    s.io(ROUTER, 5, syscall::RECVFROM, rej, 4096);
    let ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 61\r\n\r\n{\"text\":\"CANARY-7f3a out\",\"meta_info\":{\"prompt_tokens\":1234}}";
    s.io(DECODE, 8, syscall::SENDTO, ok, 4096);
    s.io(ROUTER, 6, syscall::RECVFROM, ok, 4096);
    let room = Some(9066467638188682269);
    assert_eq!(
        s.kinds(),
        vec![
            (Stage::Router, Kind::Dispatched, room),
            (Stage::Router, Kind::Dispatched, room),
            (Stage::Prefill, Kind::Received, room),
            (Stage::Decode, Kind::Received, room),
            (Stage::Prefill, Kind::Rejected, room),
            (Stage::Decode, Kind::Work, room),
            (Stage::Decode, Kind::Completed, room),
        ]
    );
    assert_eq!(s.out[0].to, Some(Stage::Prefill));
    assert_eq!(s.out[1].to, Some(Stage::Decode));
    let rejected = &s.out[4];
    assert_eq!(rejected.status, Some(400));
    assert_eq!(rejected.reason.as_deref(), Some("Prefill is full"));
    assert_eq!(s.out[6].input_tokens, Some(1234));
    for e in &s.out {
        assert_eq!(e.ids.request_id.as_deref(), Some("req-7"));
        assert_eq!(
            e.ids.trace_id.as_deref(),
            Some("0af7651916cd43dd8448eb211c80319c")
        );
        assert_eq!(e.source, Source::Ebpf);
        assert!(
            !format!("{e:?}").contains("CANARY"),
            "prompt text leaked: {e:?}"
        );
    }
}

/// SGLang answers a streamed request 200 before it validates it: its refusal is an SSE event
/// (chunked, split across writes). It is a rejection all the same, at the time the event went
/// out; decode's 500 (a failed transfer) is an abort, not a rejection.
#[test]
fn a_refusal_inside_a_stream_is_a_rejection() {
    let mut s = Sim::new();
    let req = generate_request(2_000, 42, "");
    s.accept(PREFILL, 7);
    s.io(PREFILL, 7, syscall::RECVFROM, &req, 65536);
    let event = b"data: {\"error\": {\"message\": \"The input (9000 tokens) is longer than the model's context length (8192 tokens).\", \"type\": \"invalid_request_error\", \"code\": 400, \"retryable\": false}}\n\n";
    let mut answer =
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            .to_vec();
    answer.extend(format!("{:x}\r\n", event.len()).as_bytes());
    answer.extend_from_slice(event);
    answer.extend(b"\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n");
    s.io(PREFILL, 7, syscall::SENDTO, &answer, 61);
    s.accept(DECODE, 8);
    s.io(DECODE, 8, syscall::RECVFROM, &req, 65536);
    let failed = http_answer(
        "500 Internal Server Error",
        r#"{"detail":"KV transfer failed for room"}"#,
    );
    s.io(DECODE, 8, syscall::SENDTO, &failed, 4096);
    assert_eq!(
        s.kinds(),
        vec![
            (Stage::Prefill, Kind::Received, Some(42)),
            (Stage::Prefill, Kind::Rejected, Some(42)),
            (Stage::Decode, Kind::Received, Some(42)),
            (Stage::Decode, Kind::Aborted, Some(42)),
        ]
    );
    let rejected = &s.out[1];
    assert_eq!(rejected.status, Some(400));
    assert!(
        rejected
            .reason
            .as_deref()
            .is_some_and(|r| r.contains("context length")),
        "{rejected:?}"
    );
    assert_eq!(s.out[3].status, Some(500));
}

/// A batch of prompts is one SGLang request per prompt: rooms `room + i`, rids `rid_i`
/// (`io_struct.py`); parallel samples (`n > 1`) stay on their prompt's room (the tokenizer
/// sends the prefix and every sample there). A warmup request (fake bootstrap host 2.2.2.2) is
/// none.
#[test]
fn batches_are_sub_requests_samples_are_not_and_warmups_are_nothing() {
    let mut s = Sim::new();
    let body = r#"{"text": ["hi", "a \"quoted\", prompt", "x"], "rid": "abc", "sampling_params": {"max_new_tokens": 4, "n": 2}, "stream": false, "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 100}"#;
    s.accept(PREFILL, 7);
    s.io(
        PREFILL,
        7,
        syscall::RECVFROM,
        &http_post("/generate", body),
        4096,
    );
    let got: Vec<_> = s
        .out
        .iter()
        .map(|e| (e.kind, e.ids.bootstrap_room.map(|r| r.0), e.ids.rid.clone()))
        .collect();
    assert_eq!(
        got,
        vec![
            (Kind::Received, Some(100), Some("abc_0".into())),
            (Kind::Received, Some(101), Some("abc_1".into())),
            (Kind::Received, Some(102), Some("abc_2".into())),
        ]
    );
    s.out.clear();
    let samples = r#"{"text": "hi", "sampling_params": {"n": 3}, "input_ids": [1, 2, 3], "bootstrap_host": "127.0.0.1", "bootstrap_room": 200}"#;
    s.accept(PREFILL, 9);
    s.io(
        PREFILL,
        9,
        syscall::RECVFROM,
        &http_post("/generate", samples),
        4096,
    );
    let rooms: Vec<_> = s
        .out
        .iter()
        .map(|e| e.ids.bootstrap_room.map(|r| r.0))
        .collect();
    assert_eq!(rooms, vec![Some(200)]);
    s.out.clear();
    let listed =
        r#"{"input_ids": [[1, 2], [3]], "bootstrap_room": [7, 9], "bootstrap_host": "127.0.0.1"}"#;
    s.accept(PREFILL, 10);
    s.io(
        PREFILL,
        10,
        syscall::RECVFROM,
        &http_post("/generate", listed),
        4096,
    );
    let rooms: Vec<_> = s
        .out
        .iter()
        .map(|e| e.ids.bootstrap_room.map(|r| r.0))
        .collect();
    assert_eq!(rooms, vec![Some(7), Some(9)]);
    s.out.clear();
    let warmup = r#"{"text": "The capital city of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 8}, "bootstrap_host": "2.2.2.2", "bootstrap_room": 0}"#;
    s.accept(DECODE, 8);
    s.io(
        DECODE,
        8,
        syscall::RECVFROM,
        &http_post("/generate", warmup),
        4096,
    );
    s.io(
        DECODE,
        8,
        syscall::SENDTO,
        &http_answer("200 OK", r#"{"text": " Paris", "meta_info": {"finish_reason": {"type": "length", "length": 8}}}"#),
        4096,
    );
    assert!(s.out.is_empty(), "{:?}", s.out);
}

/// One answer to a batch tells how each of its requests ended: by its index in a stream, by its
/// place in a whole answer. Each sub-room gets its own end; a batch's stream starting is no
/// output of any one of them.
#[test]
fn a_batch_answer_ends_each_request_by_its_own_part() {
    let body = r#"{"text": ["a", "b"], "stream": true, "bootstrap_host": "127.0.0.1", "bootstrap_room": 300}"#;
    let mut s = Sim::new();
    s.accept(DECODE, 8);
    s.io(
        DECODE,
        8,
        syscall::RECVFROM,
        &http_post("/generate", body),
        4096,
    );
    let events = [
        r#"{"text": " x", "index": 0, "meta_info": {"finish_reason": null}}"#,
        r#"{"text": "", "index": 1, "meta_info": {"finish_reason": {"type": "abort", "message": "Input length (9 tokens) exceeds", "status_code": 400}}}"#,
        r#"{"text": " x y", "index": 0, "meta_info": {"finish_reason": {"type": "length", "length": 2}}}"#,
    ];
    let sse: String = events
        .iter()
        .map(|e| format!("data: {e}\n\n"))
        .collect::<String>()
        + "data: [DONE]\n\n";
    s.io(
        DECODE,
        8,
        syscall::SENDTO,
        format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\n\r\n{sse}",
            sse.len()
        )
        .as_bytes(),
        4096,
    );
    let got: Vec<_> = s
        .out
        .iter()
        .map(|e| (e.kind, e.ids.bootstrap_room.map(|r| r.0), e.status))
        .collect();
    assert_eq!(
        got,
        vec![
            (Kind::Received, Some(300), None),
            (Kind::Received, Some(301), None),
            (Kind::Completed, Some(300), Some(200)),
            (Kind::Rejected, Some(301), Some(400)),
        ]
    );
    // A whole answer lists them in order.
    s.out.clear();
    let body = r#"{"text": ["a", "b"], "bootstrap_host": "127.0.0.1", "bootstrap_room": 400}"#;
    s.accept(PREFILL, 9);
    s.io(
        PREFILL,
        9,
        syscall::RECVFROM,
        &http_post("/generate", body),
        4096,
    );
    let answer = r#"[{"text": "", "meta_info": {"finish_reason": {"type": "abort", "message": "Prefill transfer failed, a } brace", "status_code": 500}}}, {"text": "", "meta_info": {"finish_reason": {"type": "length", "length": 0}}}]"#;
    s.io(
        PREFILL,
        9,
        syscall::SENDTO,
        &http_answer("200 OK", answer),
        4096,
    );
    let got: Vec<_> = s
        .out
        .iter()
        .filter(|e| e.kind != Kind::Received)
        .map(|e| (e.kind, e.ids.bootstrap_room.map(|r| r.0)))
        .collect();
    assert_eq!(
        got,
        vec![(Kind::Aborted, Some(400)), (Kind::Completed, Some(401))]
    );
}

#[test]
fn early_rejection_before_the_body_is_read_waits_for_the_ids() {
    let mut s = Sim::new();
    let req = generate_request(10_000, 77, "");
    s.accept(PREFILL, 7);
    s.io(PREFILL, 7, syscall::READ, &req[..2000], 4096);
    s.io(
        PREFILL,
        7,
        syscall::WRITE,
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n",
        4096,
    );
    assert!(s.out.is_empty());
    s.io(PREFILL, 7, syscall::READ, &req[2000..], 4096);
    assert_eq!(
        s.kinds(),
        vec![
            (Stage::Prefill, Kind::Received, Some(77)),
            (Stage::Prefill, Kind::Rejected, Some(77))
        ]
    );
    assert_eq!(s.out[1].reason.as_deref(), Some("HTTP 503"));
}

#[test]
fn router_cancel_and_remote_worker_answers() {
    let mut s = Sim::new();
    s.t.add_worker("10.1.2.3:30000".parse().unwrap(), Role::Decode);
    let req = generate_request(100, 5, "");
    s.connect(ROUTER, 5, "10.1.2.3:30000");
    s.io(ROUTER, 5, syscall::WRITE, &req, 65536);
    s.io(ROUTER, 5, syscall::READ, b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n7\r\ndata: 1\r\n", 4096);
    s.connect(ROUTER, 6, "10.1.2.3:30000");
    s.io(
        ROUTER,
        6,
        syscall::WRITE,
        &generate_request(100, 6, ""),
        65536,
    );
    s.close(ROUTER, 6);
    assert_eq!(
        s.kinds(),
        vec![
            (Stage::Router, Kind::Dispatched, Some(5)),
            (Stage::Decode, Kind::Work, Some(5)),
            (Stage::Router, Kind::Dispatched, Some(6)),
            (Stage::Router, Kind::Cancelled, Some(6)),
        ]
    );
    // The router withdrew its decode leg: the event says which leg, not that decode ended it.
    assert_eq!(s.out[3].to, Some(Stage::Decode));
}

/// Prefill's messages to decode (SGLang 0.5.23, Mooncake): the aux data moved over TCP, then
/// the room's Success status; a Failed status for another room, and readiness under
/// `prefill_complete`.
#[test]
fn prefill_status_says_the_kv_landed_or_failed() {
    let mut s = Sim::new();
    s.connect(PREFILL, 9, "127.0.0.1:17002");
    let mut wire = zmtp_wire(&[
        b"AUX_DATA",
        b"42",
        b"\x00\x01",
        b"0",
        b"\x00\x00\x00\x02",
        b"xy",
    ]);
    for m in [
        &[&b"42"[..], b"4", b"0"][..],
        &[b"43", b"0", b"0"],
        &[b"44", b"2", b"0"],
        &[b"ABORT_ACK", b"45", b"0", b"7"],
    ] {
        wire.extend(&zmtp_wire(m)[64..]);
    }
    s.io(PREFILL, 9, syscall::SENDTO, &wire, 4096);
    // Decode's reads of the same frames are not reported again while prefill is watched.
    assert_eq!(
        s.kinds(),
        vec![
            (Stage::Transfer, Kind::Work, Some(42)),
            (Stage::Transfer, Kind::Completed, Some(42)),
            (Stage::Transfer, Kind::Aborted, Some(43)),
            (Stage::Prefill, Kind::Work, Some(44)),
            (Stage::Prefill, Kind::Cancelled, Some(45)),
        ]
    );
    assert_eq!(s.out[1].detail.as_deref(), Some("zmtp status Success"));
}

/// Decode's messages to prefill: its destinations for a room (it reserved KV pages), the
/// `prefill_complete` handshake, its withdrawal; the receiver registration names no room.
#[test]
fn zmtp_control_from_decode() {
    let mut s = Sim::new();
    s.connect(DECODE, 9, "127.0.0.1:17000");
    let mut registration: Vec<&[u8]> = vec![b"None", b"127.0.0.1", b"17001", b"127.0.0.1:15001"];
    registration.resize(20, b"\x00");
    let mut wire = zmtp_wire(&registration);
    let indices: Vec<u8> = [4i32, 5].iter().flat_map(|i| i.to_le_bytes()).collect();
    for m in [
        &[
            &b"42"[..],
            b"127.0.0.1",
            b"17001",
            b"127.0.0.1:15001",
            &indices,
            b"3",
            b"",
            b"1",
            b"0",
            b"",
        ][..],
        &[b"BOOTSTRAP", b"43", b"127.0.0.1", b"17001"],
        &[b"ABORT", b"42", b"127.0.0.1", b"17001", b"1"],
    ] {
        wire.extend(&zmtp_wire(m)[64..]);
    }
    s.io(DECODE, 9, syscall::SENDTO, &wire[..10], 4096);
    s.io(DECODE, 9, syscall::SENDTO, &wire[10..], 4096);
    assert_eq!(
        s.kinds(),
        vec![
            (Stage::Transfer, Kind::Admitted, Some(42)),
            (Stage::Transfer, Kind::Received, Some(43)),
            (Stage::Transfer, Kind::Cancelled, Some(42))
        ]
    );
    assert_eq!(s.out[0].worker.as_deref(), Some("127.0.0.1:17001"));
    assert_eq!(
        s.out[0].detail.as_deref(),
        Some("zmtp destinations (mooncake)")
    );
    // The connection carries ZMTP: the source has the kernel capture it whole from now on.
    assert_eq!(s.t.take_zmtp_opened(), vec![(DECODE, 9)]);
    assert!(s.t.take_zmtp_opened().is_empty());
}

/// With only one end watched, the receiver reports what the other sent, read as that end's
/// message: a status read by decode, destinations read by prefill.
#[test]
fn the_receiver_reports_when_the_sender_is_not_watched() {
    let mut s = Sim::new();
    s.t = Tracker::new(None, Clock::default(), TrackerLimits::default());
    s.t.set_role(DECODE, Role::Decode);
    s.connect(DECODE, 9, "127.0.0.1:17000");
    s.io(
        DECODE,
        9,
        syscall::RECVFROM,
        &zmtp_wire(&[b"42", b"4", b"0"]),
        4096,
    );
    assert_eq!(
        s.kinds(),
        vec![(Stage::Transfer, Kind::Completed, Some(42))]
    );
}

#[test]
fn bootstrap_route_query_is_the_transfer_handshake() {
    let mut s = Sim::new();
    s.connect(DECODE, 9, "127.0.0.1:8998");
    s.io(
        DECODE,
        9,
        syscall::WRITE,
        b"GET /route?engine_rank=0&target_dp_group=0 HTTP/1.1\r\nhost: x\r\n\r\n",
        4096,
    );
    assert_eq!(s.kinds(), vec![(Stage::Transfer, Kind::Received, None)]);
}

#[test]
fn connections_are_bounded() {
    let mut t = Tracker::new(
        None,
        Clock::default(),
        TrackerLimits {
            max_conns: 4,
            max_pending: 2,
        },
    );
    t.set_role(1, Role::Prefill);
    let mut out = Vec::new();
    for fd in 0..10 {
        let hdr = Header {
            kind: kind::ACCEPT,
            tgid: 1,
            tid: 1,
            _pad: 0,
            ts_ns: fd as u64,
        };
        t.on_record(
            &Record::Accept(Conn {
                hdr,
                fd,
                peer: None,
                listener_fd: Some(3),
                local: None,
            }),
            &mut out,
        );
    }
    assert_eq!(t.conn_count(), 4);
    assert_eq!(t.stats.conns_evicted, 6);
}

/// A full table sheds a sixteenth of itself at once, the least recently active first.
#[test]
fn a_full_connection_table_evicts_the_oldest_in_batches() {
    let mut t = Tracker::new(
        None,
        Clock::default(),
        TrackerLimits {
            max_conns: 64,
            max_pending: 2,
        },
    );
    t.set_role(1, Role::Prefill);
    let mut out = Vec::new();
    let accept = |t: &mut Tracker, fd: u32, ts: u64, out: &mut Vec<LifecycleEvent>| {
        let hdr = Header {
            kind: kind::ACCEPT,
            tgid: 1,
            tid: 1,
            _pad: 0,
            ts_ns: ts,
        };
        t.on_record(
            &Record::Accept(Conn {
                hdr,
                fd,
                peer: None,
                listener_fd: Some(3),
                local: None,
            }),
            out,
        );
    };
    for fd in 0..64 {
        accept(&mut t, fd, 1000 + fd as u64, &mut out);
    }
    assert_eq!(t.conn_count(), 64);
    accept(&mut t, 100, 5000, &mut out);
    assert_eq!(t.stats.conns_evicted, 4);
    assert_eq!(t.conn_count(), 61);
    // The four oldest went; the newest and the rest stayed.
    for fd in 0..4 {
        assert!(!t.conns.contains_key(&(1, fd)), "fd {fd} should be evicted");
    }
    for fd in (4..64).chain([100]) {
        assert!(t.conns.contains_key(&(1, fd)), "fd {fd} should be kept");
    }
}

proptest! {
    #[test]
    fn arbitrary_bytes_on_any_connection_never_panic(
        chunks in proptest::collection::vec((0u32..3, 0u32..2, any::<bool>(), proptest::collection::vec(any::<u8>(), 0..300)), 0..20)
    ) {
        let mut s = Sim::new();
        s.connect(ROUTER, 0, "127.0.0.1:31001");
        s.accept(PREFILL, 1);
        for (who, fd, ingress, bytes) in chunks {
            let tgid = [ROUTER, PREFILL, DECODE][who as usize];
            let sc = if ingress { syscall::RECVFROM } else { syscall::SENDTO };
            s.io(tgid, fd, sc, &bytes, 97);
        }
        s.close(ROUTER, 0);
    }
}

fn server_info_exchange(mode: &str) -> (Vec<u8>, Vec<u8>) {
    let req = b"GET /server_info HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n".to_vec();
    let body = format!(
        r#"{{"model_path":"m","port":31003,"disaggregation_mode":"{mode}","context_length":8192,"internal_states":[{{"max_total_num_tokens":8192}}]}}"#
    );
    let resp = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes();
    (req, resp)
}

const UNKNOWN: u32 = 400;

#[test]
fn server_info_answer_gives_an_unknown_process_its_role() {
    let mut s = Sim::new();
    s.t.set_role(UNKNOWN, Role::Unknown);
    s.accept(UNKNOWN, 3);
    // Before its role is known, its traffic yields nothing.
    s.io(
        UNKNOWN,
        3,
        syscall::READ,
        &generate_request(100, 11, ""),
        4096,
    );
    s.io(
        UNKNOWN,
        3,
        syscall::WRITE,
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}",
        4096,
    );
    assert!(s.out.is_empty(), "{:?}", s.kinds());
    let (req, resp) = server_info_exchange("prefill");
    s.io(UNKNOWN, 3, syscall::READ, &req, 4096);
    s.io(UNKNOWN, 3, syscall::WRITE, &resp, 4096);
    assert_eq!(s.t.role(UNKNOWN), Some(Role::Prefill));
    assert_eq!(
        s.t.take_learned(),
        vec![(Learned::Process(UNKNOWN), Some(Role::Prefill))]
    );
    assert!(s.t.take_learned().is_empty());
    s.io(
        UNKNOWN,
        3,
        syscall::READ,
        &generate_request(100, 12, ""),
        4096,
    );
    assert_eq!(s.kinds(), vec![(Stage::Prefill, Kind::Received, Some(12))]);
    // Learned once: a later answer changes nothing, and a known role is never overridden.
    let (req, resp) = server_info_exchange("decode");
    s.io(UNKNOWN, 3, syscall::READ, &req, 4096);
    s.io(UNKNOWN, 3, syscall::WRITE, &resp, 4096);
    assert_eq!(s.t.role(UNKNOWN), Some(Role::Prefill));
    s.accept(DECODE, 4);
    s.io(DECODE, 4, syscall::READ, &req, 4096);
    s.io(
        DECODE,
        4,
        syscall::WRITE,
        &server_info_exchange("prefill").1,
        4096,
    );
    assert_eq!(s.t.role(DECODE), Some(Role::Decode));
    assert!(s.t.take_learned().is_empty());
}

#[test]
fn server_info_null_mode_leaves_the_role_unknown() {
    let mut s = Sim::new();
    s.t.set_role(UNKNOWN, Role::Unknown);
    s.accept(UNKNOWN, 3);
    let (req, resp) = server_info_exchange("null");
    s.io(UNKNOWN, 3, syscall::READ, &req, 4096);
    s.io(UNKNOWN, 3, syscall::WRITE, &resp, 4096);
    assert_eq!(s.t.role(UNKNOWN), Some(Role::Unknown));
    assert_eq!(s.t.take_learned(), vec![(Learned::Process(UNKNOWN), None)]);
}

#[test]
fn server_info_read_by_the_router_names_a_remote_worker() {
    let mut s = Sim::new();
    s.connect(ROUTER, 5, "10.9.9.9:30000");
    let (req, resp) = server_info_exchange("decode");
    s.io(ROUTER, 5, syscall::WRITE, &req, 4096);
    s.io(ROUTER, 5, syscall::READ, &resp, 4096);
    assert_eq!(
        s.t.take_learned(),
        vec![(
            Learned::Address("10.9.9.9:30000".parse().unwrap()),
            Some(Role::Decode)
        )]
    );
    // The router's view of that worker now says decode.
    s.io(
        ROUTER,
        5,
        syscall::WRITE,
        &generate_request(100, 21, ""),
        65536,
    );
    s.io(
        ROUTER,
        5,
        syscall::READ,
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n",
        4096,
    );
    assert_eq!(
        s.kinds(),
        vec![
            (Stage::Router, Kind::Dispatched, Some(21)),
            (Stage::Decode, Kind::Rejected, Some(21))
        ]
    );
    assert_eq!(s.out[0].to, Some(Stage::Decode));
    // A worker the router's command line already names keeps its role, and the answer is
    // still reported (the source may find its process unwatched on this node).
    s.connect(ROUTER, 6, "127.0.0.1:31001");
    let (req, resp) = server_info_exchange("decode");
    s.io(ROUTER, 6, syscall::WRITE, &req, 4096);
    s.io(ROUTER, 6, syscall::READ, &resp, 4096);
    assert_eq!(
        s.t.take_learned(),
        vec![(
            Learned::Address("127.0.0.1:31001".parse().unwrap()),
            Some(Role::Prefill)
        )]
    );
}

#[test]
fn an_answer_before_the_request_body_ended_keeps_its_token_count() {
    let mut s = Sim::new();
    let req = generate_request(10_000, 31, "");
    s.accept(DECODE, 7);
    s.io(DECODE, 7, syscall::READ, &req[..2000], 4096);
    s.io(
        DECODE,
        7,
        syscall::WRITE,
        b"HTTP/1.1 200 OK\r\ncontent-length: 33\r\n\r\n{\"meta_info\":{\"prompt_tokens\":9}}",
        4096,
    );
    assert!(s.out.is_empty());
    s.io(DECODE, 7, syscall::READ, &req[2000..], 4096);
    assert_eq!(
        s.kinds(),
        vec![
            (Stage::Decode, Kind::Received, Some(31)),
            (Stage::Decode, Kind::Work, Some(31)),
            (Stage::Decode, Kind::Completed, Some(31))
        ]
    );
    assert_eq!(s.out[2].input_tokens, Some(9));
}

const VLLM_X: &str = "___prefill_addr_127.0.0.1:31001___decode_addr_127.0.0.1:31002_0123456789abcdef0123456789abcdef";

fn http_post(path: &str, body: &str) -> Vec<u8> {
    http_post_as(VLLM_X, path, body)
}

fn http_post_as(x: &str, path: &str, body: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\nx-request-id: {x}\r\ntraceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn http_answer(status: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn zmtp_wire(parts: &[&[u8]]) -> Vec<u8> {
    let mut wire = vec![0xFF, 0, 0, 0, 0, 0, 0, 0, 1, 0x7F, 3, 1];
    wire.resize(64, 0);
    for (i, p) in parts.iter().enumerate() {
        let more = (i + 1 < parts.len()) as u8;
        if p.len() > 255 {
            wire.push(more | 2);
            wire.extend_from_slice(&(p.len() as u64).to_be_bytes());
        } else {
            wire.push(more);
            wire.push(p.len() as u8);
        }
        wire.extend_from_slice(p);
    }
    wire
}

fn vllm_prefill_leg(prompt: &str) -> Vec<u8> {
    vllm_prefill_leg_as(VLLM_X, prompt)
}

/// The router's prefill leg, as vllm-router 0.1.17 writes it.
fn vllm_prefill_leg_as(x: &str, prompt: &str) -> Vec<u8> {
    http_post_as(
        x,
        "/v1/completions",
        &format!(
            r#"{{"kv_transfer_params":{{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}},"max_tokens":1,"min_tokens":1,"model":"m","prompt":"{prompt}","stream":false}}"#
        ),
    )
}

/// `kv_transfer_params` as vLLM 0.34's NIXL `request_finished` returns them
/// (`nixl/pull_scheduler.py`), naming prefill's internal id `name`.
fn vllm_params(name: &str) -> String {
    format!(
        r#""kv_transfer_params":{{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2]],"remote_engine_id":"6a1e0c2d-prefill","remote_request_id":"{name}","remote_host":"127.0.0.1","remote_port":5600,"tp_size":1,"dcp_size":1,"pp_size":1,"remote_num_tokens":3,"remote_blocks_expiry_time":1765000000.5,"remote_registration_generation":0,"transfer_mode":"pull"}}"#
    )
}

fn vllm_decode_leg(prompt: &str, params: Option<&str>) -> Vec<u8> {
    vllm_decode_leg_as(VLLM_X, prompt, params)
}

fn vllm_decode_leg_as(x: &str, prompt: &str, params: Option<&str>) -> Vec<u8> {
    let params = params.map_or(String::new(), |name| format!("{},", vllm_params(name)));
    http_post_as(
        x,
        "/v1/completions",
        &format!(r#"{{{params}"max_tokens":8,"model":"m","prompt":"{prompt}","stream":false}}"#),
    )
}

/// A 200 answer to request `x`; prefill's names the KV it holds (`issued`).
fn vllm_ok_as(x: &str, issued: Option<&str>) -> Vec<u8> {
    let kv = issued.map_or(String::new(), |name| format!(",{}", vllm_params(name)));
    http_answer(
        "200 OK",
        &format!(
            r#"{{"id":"cmpl-{x}","object":"text_completion","created":1,"model":"m","choices":[{{"index":0,"text":"CANARY-out","logprobs":null,"finish_reason":"length","stop_reason":null}}],"usage":{{"prompt_tokens":3,"total_tokens":4,"completion_tokens":1}}{kv}}}"#
        ),
    )
}

fn vllm_ok(issued: Option<&str>) -> Vec<u8> {
    vllm_ok_as(VLLM_X, issued)
}

fn rid_kinds(s: &Sim) -> Vec<(Stage, Kind, Option<String>)> {
    s.out
        .iter()
        .map(|e| (e.stage, e.kind, e.ids.rid.as_deref().map(str::to_owned)))
        .collect()
}

#[test]
fn vllm_pair_is_one_attempt_named_as_vllm_names_it() {
    let mut s = Sim::new();
    // The engine's id for `/v1/completions`, and prefill's internal one.
    let rid = format!("cmpl-{VLLM_X}-0");
    let internal = format!("{rid}-1a2b3c4d");
    let n = Some(rid.clone());
    s.connect(ROUTER, 5, "127.0.0.1:31001");
    s.accept(PREFILL, 7);
    let leg = vllm_prefill_leg("CANARY-7f3a lorem ipsum");
    s.io(ROUTER, 5, syscall::WRITEV, &leg, 65536);
    s.io(PREFILL, 7, syscall::RECVFROM, &leg, 65536);
    let ok = vllm_ok(Some(&internal));
    s.io(PREFILL, 7, syscall::SENDTO, &ok, 4096);
    s.io(ROUTER, 5, syscall::RECVFROM, &ok, 4096);
    // Sequential: decode's leg after prefill answered, with prefill's params.
    s.connect(ROUTER, 6, "127.0.0.1:31002");
    s.accept(DECODE, 8);
    let leg = vllm_decode_leg("CANARY-7f3a lorem ipsum", Some(&internal));
    s.io(ROUTER, 6, syscall::WRITEV, &leg, 65536);
    s.io(DECODE, 8, syscall::RECVFROM, &leg, 65536);
    // NIXL pairs the engines once (no request id); the KV then moves by UCX reads.
    s.connect(DECODE, 9, "127.0.0.1:5600");
    s.io(
        DECODE,
        9,
        syscall::SENDTO,
        // An empty delimiter, then msgspec's `(b"get_meta_msg", pp_rank, tp_rank)`.
        &zmtp_wire(&[b"", &vllm_bytes::hex(vllm_bytes::GET_META)]),
        4096,
    );
    let ok = vllm_ok(None);
    s.io(DECODE, 8, syscall::SENDTO, &ok, 4096);
    s.io(ROUTER, 6, syscall::RECVFROM, &ok, 4096);
    assert_eq!(
        rid_kinds(&s),
        vec![
            (Stage::Router, Kind::Dispatched, n.clone()),
            (Stage::Prefill, Kind::Received, n.clone()),
            (Stage::Prefill, Kind::Completed, n.clone()),
            (Stage::Router, Kind::Dispatched, n.clone()),
            (Stage::Decode, Kind::Received, n.clone()),
            (Stage::Decode, Kind::Work, n.clone()),
            (Stage::Decode, Kind::Completed, n.clone()),
        ]
    );
    assert_eq!(s.t.stats.vllm_nixl_handshakes, 1);
    assert_eq!(s.out[0].to, Some(Stage::Prefill));
    assert_eq!(s.out[3].to, Some(Stage::Decode));
    for e in &s.out {
        assert!(e.ids.bootstrap_room.is_none());
        assert_eq!(e.protocol_breach, None, "{e:?}");
        assert_eq!(e.ids.request_id.as_deref(), Some(VLLM_X));
        assert_eq!(
            e.ids.trace_id.as_deref(),
            Some("0af7651916cd43dd8448eb211c80319c")
        );
        assert!(!format!("{e:?}").contains("CANARY"), "text leaked: {e:?}");
    }
    // Chat requests keep vLLM's `chatcmpl-` name whole.
    assert_eq!(
        vllm::request_name("/v1/chat/completions", "x").as_deref(),
        Some("chatcmpl-x")
    );
    assert_eq!(
        vllm::request_name("/v1/completions", "x").as_deref(),
        Some("cmpl-x-0")
    );
    assert_eq!(vllm::request_name("/generate", "x"), None);
}

#[test]
fn vllm_handoff_after_a_prefill_rejection_is_the_same_attempt() {
    let mut s = Sim::new();
    let n = Some(format!("cmpl-{VLLM_X}-0"));
    s.accept(PREFILL, 7);
    s.io(
        PREFILL,
        7,
        syscall::RECVFROM,
        &vllm_prefill_leg("long"),
        65536,
    );
    // vLLM 0.34's refusal (`serve/exception_handling/error_response.py`).
    let rej = http_answer(
        "400 Bad Request",
        r#"{"error":{"message":"This model's maximum context length is 4096 tokens. However, your prompt contains 4999 input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt.","type":"BadRequestError","param":"input_tokens","code":400}}"#,
    );
    s.io(PREFILL, 7, syscall::SENDTO, &rej, 4096);
    // The buggy router goes on to decode without params: decode computes it all itself.
    s.accept(DECODE, 8);
    s.io(
        DECODE,
        8,
        syscall::RECVFROM,
        &vllm_decode_leg("long", None),
        65536,
    );
    s.io(DECODE, 8, syscall::SENDTO, &vllm_ok(None), 4096);
    assert_eq!(
        rid_kinds(&s),
        vec![
            (Stage::Prefill, Kind::Received, n.clone()),
            (Stage::Prefill, Kind::Rejected, n.clone()),
            (Stage::Decode, Kind::Received, n.clone()),
            (Stage::Decode, Kind::Work, n.clone()),
            (Stage::Decode, Kind::Completed, n.clone()),
        ]
    );
    assert_eq!(s.out[1].status, Some(400));
    assert!(
        s.out[1]
            .reason
            .as_deref()
            .is_some_and(|r| r.starts_with("This model's maximum context length is 4096"))
    );
    // Before vLLM 0.10.1 the refusal was a flat error object: the same rejection.
    let mut s = Sim::new();
    s.accept(PREFILL, 7);
    s.io(PREFILL, 7, syscall::RECVFROM, &vllm_prefill_leg("l"), 65536);
    let old = http_answer(
        "400 Bad Request",
        r#"{"object":"error","message":"This model's maximum context length is 4096 tokens. However, you requested 5000 tokens (4999 in the messages, 1 in the completion). Please reduce the length of the messages or completion.","type":"BadRequestError","param":null,"code":400}"#,
    );
    s.io(PREFILL, 7, syscall::SENDTO, &old, 4096);
    assert_eq!(rid_kinds(&s)[1], (Stage::Prefill, Kind::Rejected, n));
}

/// Request `x` through the router: prefill answers issuing `issued` (when it does), then decode
/// gets a leg naming `named`. Returns the router's dispatch of the decode leg.
fn vllm_round(s: &mut Sim, fd: u32, x: &str, issued: Option<&str>, named: &str) -> LifecycleEvent {
    s.connect(ROUTER, fd, "127.0.0.1:31001");
    s.io(
        ROUTER,
        fd,
        syscall::WRITEV,
        &vllm_prefill_leg_as(x, "p"),
        65536,
    );
    s.io(ROUTER, fd, syscall::RECVFROM, &vllm_ok_as(x, issued), 4096);
    s.connect(ROUTER, fd + 1, "127.0.0.1:31002");
    let leg = vllm_decode_leg_as(x, "p", Some(named));
    s.io(ROUTER, fd + 1, syscall::WRITEV, &leg, 65536);
    s.out
        .iter()
        .rev()
        .find(|e| e.stage == Stage::Router && e.to == Some(Stage::Decode))
        .cloned()
        .unwrap()
}

#[test]
fn a_decode_leg_naming_kv_prefill_did_not_issue_to_it_is_a_breach() {
    let mut s = Sim::new();
    let a = vllm_round(
        &mut s,
        10,
        "a",
        Some("cmpl-a-0-11111111"),
        "cmpl-a-0-11111111",
    );
    assert_eq!(a.protocol_breach, None);
    // The router hands b's decode the KV issued to a: decode reads a's KV cache.
    let b = vllm_round(
        &mut s,
        20,
        "b",
        Some("cmpl-b-0-22222222"),
        "cmpl-a-0-11111111",
    );
    assert_eq!(b.ids.rid.as_deref(), Some("cmpl-b-0"));
    assert_eq!(b.protocol_breach, Some(ProtocolBreach::ForeignKvHandoff));
    assert_eq!(
        b.reason.as_deref(),
        Some("decode leg reads the KV prefill issued to cmpl-a-0")
    );
    // KV nobody issued, while prefill's answer to c issued other KV: stale or forged.
    let c = vllm_round(
        &mut s,
        30,
        "c",
        Some("cmpl-c-0-33333333"),
        "cmpl-z-0-99999999",
    );
    assert_eq!(c.protocol_breach, Some(ProtocolBreach::UnissuedKvHandoff));
    // Randomization off: the internal id is the engine id, still issued to its own request.
    let d = vllm_round(&mut s, 40, "d", Some("cmpl-d-0"), "cmpl-d-0");
    assert_eq!(d.protocol_breach, None);
    // Prefill's answer to e was not seen (no params, or before the capture): not judged.
    let e = vllm_round(&mut s, 50, "e", None, "cmpl-q-0-55555555");
    assert_eq!(e.protocol_breach, None);
    // A client reusing c's id: this answer's KV name was not read, so c's earlier one does not
    // stand for it.
    let c2 = vllm_round(&mut s, 60, "c", None, "cmpl-q-0-66666666");
    assert_eq!(c2.protocol_breach, None);
    // Only the router's dispatch carries it when the router is watched here.
    let marked = s.out.iter().filter(|e| e.protocol_breach.is_some()).count();
    assert_eq!(marked, 2);
    // Prefill answered g with the KV it issued to f before f's own answer left: both were
    // handed the same KV, and each one's decode leg names the other.
    let g = vllm_round(
        &mut s,
        70,
        "g",
        Some("cmpl-f-0-77777777"),
        "cmpl-f-0-77777777",
    );
    assert_eq!(g.protocol_breach, None, "nobody else holds it yet");
    let f = vllm_round(
        &mut s,
        80,
        "f",
        Some("cmpl-f-0-77777777"),
        "cmpl-f-0-77777777",
    );
    assert_eq!(f.protocol_breach, Some(ProtocolBreach::ForeignKvHandoff));
    assert_eq!(
        f.reason.as_deref(),
        Some("decode leg reads the KV prefill issued to cmpl-g-0")
    );

    // Without the router on this node, decode's receipt carries it, judged from what prefill
    // answered here.
    let mut s = Sim::new();
    s.t.set_role(ROUTER, Role::Unknown);
    s.accept(PREFILL, 7);
    s.io(
        PREFILL,
        7,
        syscall::RECVFROM,
        &vllm_prefill_leg_as("a", "p"),
        65536,
    );
    s.io(
        PREFILL,
        7,
        syscall::SENDTO,
        &vllm_ok_as("a", Some("cmpl-a-0-1")),
        4096,
    );
    s.io(
        PREFILL,
        7,
        syscall::RECVFROM,
        &vllm_prefill_leg_as("b", "p"),
        65536,
    );
    s.io(
        PREFILL,
        7,
        syscall::SENDTO,
        &vllm_ok_as("b", Some("cmpl-b-0-2")),
        4096,
    );
    s.accept(DECODE, 8);
    let leg = vllm_decode_leg_as("b", "p", Some("cmpl-a-0-1"));
    s.io(DECODE, 8, syscall::RECVFROM, &leg, 65536);
    let got = s.out.last().unwrap();
    assert_eq!((got.stage, got.kind), (Stage::Decode, Kind::Received));
    assert_eq!(got.protocol_breach, Some(ProtocolBreach::ForeignKvHandoff));
}

#[test]
fn mooncake_connector_pulls_and_answers_are_the_transfer() {
    let mut s = Sim::new();
    let transfer = "5f0c7e1a-9d7b-4a36-8f4b-2f6d9a0c1e11";
    let rid = "cmpl-req-7-0".to_owned();
    // The router names the transfer on both legs (MooncakeConnector's `transfer_id`).
    s.accept(PREFILL, 7);
    let leg = http_post_as(
        "req-7",
        "/v1/completions",
        &format!(
            r#"{{"kv_transfer_params":{{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":"{transfer}"}},"max_tokens":1,"model":"m","prompt":"p"}}"#
        ),
    );
    s.io(PREFILL, 7, syscall::RECVFROM, &leg, 65536);
    // vLLM's engine core serves no HTTP: its role is unknown, its messages say who sent them.
    // This node's engine core is decode's; the prefill it pulls from is on another node (no
    // prefill process watched here, so decode's end reports prefill's answer).
    s.t.set_role(PREFILL, Role::Unknown);
    s.t.set_role(UNKNOWN, Role::Unknown);
    s.connect(UNKNOWN, 9, "10.0.0.9:17001");
    let pull = vllm_bytes::hex(vllm_bytes::PULL);
    s.io(UNKNOWN, 9, syscall::SENDTO, &zmtp_wire(&[&pull]), 4096);
    let finish = vllm_bytes::hex(vllm_bytes::FINISH);
    let mut wire = vec![0xFF, 0, 0, 0, 0, 0, 0, 0, 1, 0x7F, 3, 1];
    wire.resize(64, 0);
    s.io(UNKNOWN, 9, syscall::RECVFROM, &wire, 4096);
    s.io(
        UNKNOWN,
        9,
        syscall::RECVFROM,
        &zmtp_wire(&[&finish])[64..],
        4096,
    );
    let transfer_events: Vec<_> = s
        .out
        .iter()
        .filter(|e| e.stage == Stage::Transfer)
        .map(|e| (e.kind, e.ids.rid.clone().map(String::from)))
        .collect();
    assert_eq!(
        transfer_events,
        vec![
            (Kind::Admitted, Some(rid.clone())),
            (Kind::Completed, Some(rid.clone())),
        ]
    );
    // A pull for a transfer no leg here named: counted, not reported.
    let mut s2 = Sim::new();
    s2.t.set_role(UNKNOWN, Role::Unknown);
    s2.connect(UNKNOWN, 9, "10.0.0.9:17001");
    s2.io(UNKNOWN, 9, syscall::SENDTO, &zmtp_wire(&[&pull]), 4096);
    assert!(s2.out.is_empty());
    assert_eq!(s2.t.stats.vllm_transfers_unattributed, 1);
}

#[test]
fn vllm_leg_params_give_unknown_workers_their_roles() {
    let mut s = Sim::new();
    s.t.set_role(UNKNOWN, Role::Unknown);
    s.accept(UNKNOWN, 7);
    s.io(UNKNOWN, 7, syscall::RECVFROM, &vllm_prefill_leg("p"), 65536);
    assert_eq!(s.t.role(UNKNOWN), Some(Role::Prefill));
    assert_eq!(
        rid_kinds(&s),
        vec![(
            Stage::Prefill,
            Kind::Received,
            Some(format!("cmpl-{VLLM_X}-0"))
        )]
    );
    // The router's side: a worker address nobody named becomes a decode.
    s.connect(ROUTER, 5, "127.0.0.1:39999");
    s.io(
        ROUTER,
        5,
        syscall::WRITEV,
        &vllm_decode_leg("p", Some("cmpl-x-0-1")),
        65536,
    );
    assert_eq!(
        s.t.worker_of(Some("127.0.0.1:39999".parse().unwrap()))
            .map(|w| w.role),
        Some(Role::Decode)
    );
    assert_eq!(s.out.last().unwrap().to, Some(Stage::Decode));
}

#[test]
fn vllm_models_and_metrics_answers_are_capacity_reports() {
    let mut s = Sim::new();
    s.connect(ROUTER, 5, "127.0.0.1:31001");
    let get = |path: &str| format!("GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n").into_bytes();
    let models = http_answer(
        "200 OK",
        r#"{"object":"list","data":[{"id":"m","object":"model","created":1,"owned_by":"vllm","root":"m","parent":null,"max_model_len":4096,"permission":[]}]}"#,
    );
    let metrics = |blocks: u64| {
        format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: 999\r\n\r\n# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"16\",cache_dtype=\"auto\",num_gpu_blocks=\"{blocks}\"}} 1.0\n"
        )
        .into_bytes()
    };
    s.io(ROUTER, 5, syscall::WRITEV, &get("/v1/models"), 4096);
    s.io(ROUTER, 5, syscall::RECVFROM, &models, 4096);
    let poll = |s: &mut Sim, blocks| {
        s.io(ROUTER, 5, syscall::WRITEV, &get("/metrics"), 4096);
        let mut m = metrics(blocks);
        // content-length covers exactly the body.
        let body_len = m.len() - m.windows(4).position(|w| w == b"\r\n\r\n").unwrap() - 4;
        m = String::from_utf8(m)
            .unwrap()
            .replace("999", &body_len.to_string())
            .into_bytes();
        s.io(ROUTER, 5, syscall::RECVFROM, &m, 4096);
    };
    poll(&mut s, 512);
    poll(&mut s, 512);
    poll(&mut s, 128);
    let caps: Vec<_> = s
        .out
        .iter()
        .map(|e| {
            assert_eq!((e.stage, e.kind), (Stage::Prefill, Kind::Capacity));
            assert_eq!(e.worker.as_deref(), Some("127.0.0.1:31001"));
            (e.context_tokens, e.max_total_tokens)
        })
        .collect();
    // A repeated poll says nothing new: no report.
    assert_eq!(
        caps,
        vec![
            (Some(4096), None),
            (Some(4096), Some(8192)),
            (Some(4096), Some(2048)),
        ]
    );
}

#[test]
fn a_long_metrics_page_is_read_whole_once_its_connection_is_streamed() {
    let mut s = Sim::new();
    s.connect(ROUTER, 5, "127.0.0.1:31001");
    let get = b"GET /metrics HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n";
    // A vLLM-sized page: the sample in the middle of 50 KB, written in one syscall.
    let mut body = String::new();
    for i in 0..300 {
        body.push_str(&format!(
            "# HELP vllm:m{i} a metric\n# TYPE vllm:m{i} counter\nvllm:m{i}_total{{engine=\"0\",model_name=\"m\"}} 1.0\n"
        ));
        if i == 150 {
            body.push_str("# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",engine=\"0\",num_gpu_blocks=\"2731\"} 1.0\n");
        }
    }
    let answer = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes();
    s.io(ROUTER, 5, syscall::WRITEV, get, 4096);
    // The first scrape is read through the edge windows: the sample is not among them, and
    // the connection is marked for whole capture.
    s.io(ROUTER, 5, syscall::RECVFROM, &answer, answer.len());
    assert!(s.out.is_empty());
    assert_eq!(s.t.take_metrics_conns(), vec![(ROUTER, 5)]);
    assert!(s.t.take_metrics_conns().is_empty());
    // The next scrape on it comes whole.
    s.io(ROUTER, 5, syscall::WRITEV, get, 4096);
    s.io_streamed(ROUTER, 5, syscall::RECVFROM, &answer);
    let caps: Vec<_> = s
        .out
        .iter()
        .map(|e| (e.stage, e.kind, e.max_total_tokens))
        .collect();
    assert_eq!(
        caps,
        vec![(Stage::Prefill, Kind::Capacity, Some(2731 * 16))]
    );
    // Marked once per connection.
    assert!(s.t.take_metrics_conns().is_empty());
}

// Writers to prefill's bootstrap server: who the accepting end can tell its peer is.

/// What a write event says: stage, kind, who wrote it, from where, the detail.
type Write<'a> = (Stage, Kind, Option<Peer>, Option<&'a str>, Option<&'a str>);

impl Sim {
    /// A connection accepted on a listener the source did not find.
    fn accept_from(&mut self, tgid: u32, fd: u32, peer: &str) {
        self.accept_at(tgid, fd, peer, None);
    }

    /// A connection accepted on the listener at `local`, when the source found it.
    fn accept_at(&mut self, tgid: u32, fd: u32, peer: &str, local: Option<&str>) {
        let hdr = self.hdr(kind::ACCEPT, tgid);
        self.t.on_record(
            &Record::Accept(Conn {
                hdr,
                fd,
                peer: Some(peer.parse().unwrap()),
                listener_fd: Some(3),
                local: local.map(|l| l.parse().unwrap()),
            }),
            &mut self.out,
        );
    }

    /// The kernel's report that a connection `tgid` opened is established, from `local`.
    fn established(&mut self, tgid: u32, local: &str, remote: &str) {
        let hdr = Header {
            tid: 0,
            ..self.hdr(kind::LOCAL, tgid)
        };
        self.t.on_record(
            &Record::Local {
                hdr,
                local: local.parse().unwrap(),
                remote: remote.parse().unwrap(),
            },
            &mut self.out,
        );
    }

    fn writes(&self) -> Vec<Write<'_>> {
        self.out
            .iter()
            .map(|e| {
                (
                    e.stage,
                    e.kind,
                    e.peer,
                    e.worker.as_deref(),
                    e.detail.as_deref(),
                )
            })
            .collect()
    }
}

use crate::event::Peer;

const REGISTER: &str =
    r#"{"role": "Prefill", "rank_ip": "127.0.0.1", "rank_port": 31003, "engine_rank": 0}"#;

fn route_put() -> Vec<u8> {
    format!(
        "PUT /route HTTP/1.1\r\nhost: 127.0.0.1:8998\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{REGISTER}",
        REGISTER.len()
    )
    .into_bytes()
}

fn put_detail() -> String {
    format!("PUT /route body_bytes={}", REGISTER.len())
}

/// Prefill with local attribution on (the kernel reports every watched connection).
fn attributing() -> Sim {
    let mut s = Sim::new();
    s.t.set_local_attribution(true);
    s
}

/// A prefill's scheduler child registers its rank with the bootstrap server of its parent: both
/// ends are watched, the accepting end knows the connecting socket, nothing is foreign. The
/// child's own (client) side reports nothing.
#[test]
fn a_prefill_child_registering_its_rank_is_a_member() {
    let mut s = attributing();
    let child = PREFILL + 1;
    s.t.set_role(child, Role::Prefill);
    s.connect(child, 5, "127.0.0.1:8998");
    s.established(child, "127.0.0.1:45000", "127.0.0.1:8998");
    s.accept_from(PREFILL, 20, "127.0.0.1:45000");
    s.io(child, 5, syscall::WRITE, &route_put(), 4096);
    s.io(PREFILL, 20, syscall::READ, &route_put(), 4096);
    let detail = put_detail();
    assert_eq!(
        s.writes(),
        vec![(
            Stage::Transfer,
            Kind::Received,
            Some(Peer::Member),
            Some("127.0.0.1:45000"),
            Some(detail.as_str())
        )]
    );
    // No body bytes in the event: the detail names method, path and length only.
    assert!(!format!("{:?}", s.out).contains("rank_ip"));
}

/// The prefill process registering with its own bootstrap server, through a dual-stack listener
/// (the peer as `::ffff:a.b.c.d`), and a connection it held before it was watched (found in
/// /proc): members both.
#[test]
fn a_prefill_registering_itself_is_a_member_in_every_spelling() {
    let mut s = attributing();
    s.established(PREFILL, "127.0.0.1:45001", "127.0.0.1:8998");
    s.accept_from(PREFILL, 21, "[::ffff:127.0.0.1]:45001");
    s.io(PREFILL, 21, syscall::READ, &route_put(), 4096);
    s.t.add_own_socket(
        PREFILL,
        "127.0.0.1:45002".parse().unwrap(),
        "127.0.0.1:8998".parse().unwrap(),
    );
    s.accept_from(PREFILL, 22, "127.0.0.1:45002");
    s.io(PREFILL, 22, syscall::READ, &route_put(), 4096);
    let peers: Vec<_> = s.out.iter().map(|e| e.peer).collect();
    assert_eq!(peers, vec![Some(Peer::Member), Some(Peer::Member)]);
}

/// Decode's `GET /route` is the transfer handshake, reported by decode; prefill's end reports
/// no write. A router's health check of the bootstrap server is no event at all.
#[test]
fn decode_reading_the_route_and_a_router_health_check_are_no_writes() {
    let mut s = attributing();
    let get = b"GET /route?engine_rank=0&target_dp_group=0 HTTP/1.1\r\nhost: x\r\n\r\n";
    s.connect(DECODE, 9, "127.0.0.1:8998");
    s.established(DECODE, "127.0.0.1:45010", "127.0.0.1:8998");
    s.accept_from(PREFILL, 30, "127.0.0.1:45010");
    s.io(DECODE, 9, syscall::WRITE, get, 4096);
    s.io(PREFILL, 30, syscall::READ, get, 4096);
    let health = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n";
    s.connect(ROUTER, 9, "127.0.0.1:8998");
    s.established(ROUTER, "127.0.0.1:45011", "127.0.0.1:8998");
    s.accept_from(PREFILL, 31, "127.0.0.1:45011");
    s.io(ROUTER, 9, syscall::WRITE, health, 4096);
    s.io(PREFILL, 31, syscall::READ, health, 4096);
    assert_eq!(s.kinds(), vec![(Stage::Transfer, Kind::Received, None)]);
    assert!(s.out.iter().all(|e| e.peer.is_none()), "{:?}", s.out);
}

/// A `PUT /route` from a process on this node that revenant does not watch: no watched
/// connection uses that address, so the writer is foreign. Any write method counts.
#[test]
fn a_write_from_an_unwatched_process_on_this_node_is_foreign() {
    let mut s = attributing();
    s.established(DECODE, "127.0.0.1:45020", "127.0.0.1:8998");
    s.accept_from(PREFILL, 40, "127.0.0.1:47000");
    s.io(PREFILL, 40, syscall::READ, &route_put(), 4096);
    let post = b"POST /route HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}";
    s.accept_from(PREFILL, 41, "127.0.0.1:47001");
    s.io(PREFILL, 41, syscall::READ, post, 4096);
    // `/register_dp_rank` re-points a room's DP rank: a write; `/query_dp_ranks` only reads.
    let pin = br#"{"bootstrap_room": 42, "dp_rank": 1}"#;
    let mut register = format!(
        "POST /register_dp_rank HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
        pin.len()
    )
    .into_bytes();
    register.extend_from_slice(pin);
    s.accept_from(PREFILL, 42, "127.0.0.1:47002");
    s.io(PREFILL, 42, syscall::READ, &register, 4096);
    let query = b"POST /query_dp_ranks HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n[]";
    s.accept_from(PREFILL, 43, "127.0.0.1:47003");
    s.io(PREFILL, 43, syscall::READ, query, 4096);
    assert_eq!(
        s.out.last().and_then(|e| e.ids.bootstrap_room),
        Some(BootstrapRoom(42))
    );
    let detail = put_detail();
    assert_eq!(
        s.writes(),
        vec![
            (
                Stage::Transfer,
                Kind::Received,
                Some(Peer::Foreign),
                Some("127.0.0.1:47000"),
                Some(detail.as_str())
            ),
            (
                Stage::Transfer,
                Kind::Received,
                Some(Peer::Foreign),
                Some("127.0.0.1:47001"),
                Some("POST /route body_bytes=2")
            ),
            (
                Stage::Transfer,
                Kind::Received,
                Some(Peer::Foreign),
                Some("127.0.0.1:47002"),
                Some("POST /register_dp_rank body_bytes=36")
            )
        ]
    );
}

/// A port is shared by connections to different destinations: a process revenant does not
/// watch may write to the bootstrap server from the port of a watched connection to elsewhere,
/// even one still open. Where the source knows the listener the write came in on, only a watched
/// connection to that listener (a wildcard one: to its port) makes the writer a member; where it
/// does not, the address alone does (a missed alert, never a false one).
#[test]
fn a_writer_sharing_the_port_of_a_watched_connection_to_elsewhere_is_foreign() {
    let mut s = attributing();
    // Decode's connection to the transfer engine, and the router's to the bootstrap server, from
    // one port; the prefill's own registration from another.
    s.established(DECODE, "127.0.0.1:45030", "127.0.0.1:17000");
    s.established(ROUTER, "127.0.0.1:45031", "127.0.0.1:17000");
    s.established(PREFILL, "127.0.0.1:45031", "127.0.0.1:8998");
    for (fd, peer, local) in [
        (60, "127.0.0.1:45030", Some("127.0.0.1:8998")),
        (61, "127.0.0.1:45031", Some("127.0.0.1:8998")),
        (62, "127.0.0.1:45031", Some("0.0.0.0:8998")),
        (63, "127.0.0.1:45030", Some("[::]:8998")),
        (64, "127.0.0.1:45030", Some("127.0.0.1:17000")),
        (65, "127.0.0.1:45030", None),
    ] {
        s.accept_at(PREFILL, fd, peer, local);
        s.io(PREFILL, fd, syscall::READ, &route_put(), 4096);
    }
    let peers: Vec<_> = s.out.iter().map(|e| e.peer).collect();
    assert_eq!(
        peers,
        vec![
            Some(Peer::Foreign),
            Some(Peer::Member),
            Some(Peer::Member),
            Some(Peer::Foreign),
            Some(Peer::Member),
            Some(Peer::Member)
        ]
    );
}

/// Without the kernel's report of watched connections, a writer on this node cannot be told
/// apart from a watched one: unattributed, never foreign.
#[test]
fn without_local_addresses_a_local_writer_is_unattributed() {
    let mut s = Sim::new();
    s.accept_from(PREFILL, 40, "127.0.0.1:47000");
    s.io(PREFILL, 40, syscall::READ, &route_put(), 4096);
    assert_eq!(s.out.len(), 1);
    assert_eq!(s.out[0].peer, Some(Peer::Unattributed));
}

/// Across nodes only an address attributes a writer: the host of a known worker is a member,
/// any other host unattributed. An address of this node (learnt from a watched connection's
/// local address) that no watched connection uses is foreign.
#[test]
fn writers_on_other_nodes_are_attributed_by_address_only() {
    let mut s = attributing();
    s.t.add_worker("10.0.0.9:31001".parse().unwrap(), Role::Prefill);
    s.established(PREFILL, "10.0.0.5:40000", "10.0.0.9:31001");
    for (fd, peer) in [
        (50, "10.0.0.9:52000"),
        (51, "10.0.0.7:52000"),
        (52, "10.0.0.5:41000"),
        (53, "10.0.0.5:40000"),
    ] {
        s.accept_from(PREFILL, fd, peer);
        s.io(PREFILL, fd, syscall::READ, &route_put(), 4096);
    }
    let peers: Vec<_> = s.out.iter().map(|e| e.peer).collect();
    assert_eq!(
        peers,
        vec![
            Some(Peer::Member),
            Some(Peer::Unattributed),
            Some(Peer::Foreign),
            Some(Peer::Member)
        ]
    );
}

/// Decode's Mooncake destinations for `room` as `build_receiver_metadata_message` writes them
/// (`mooncake/conn.py`): decode's rank address, its transfer session, page indices, and how many
/// distinct sessions complete the room.
fn mooncake_destinations(room: &str, port: &str, session: &str, required: &str) -> Vec<u8> {
    mooncake_destinations_from("127.0.0.1", room, port, session, required)
}

/// [`mooncake_destinations`] from a decode rank at `ip`.
fn mooncake_destinations_from(
    ip: &str,
    room: &str,
    port: &str,
    session: &str,
    required: &str,
) -> Vec<u8> {
    let indices: Vec<u8> = [4i32, 5, 6].iter().flat_map(|i| i.to_le_bytes()).collect();
    zmtp_wire(&[
        room.as_bytes(),
        ip.as_bytes(),
        port.as_bytes(),
        session.as_bytes(),
        &indices,
        b"3",
        b"",
        required.as_bytes(),
        b"0",
        b"",
    ])
}

fn breaches(s: &Sim) -> Vec<(ProtocolBreach, Stage, Kind, Option<u64>)> {
    s.out
        .iter()
        .filter_map(|e| {
            e.protocol_breach
                .map(|b| (b, e.stage, e.kind, e.ids.bootstrap_room.map(|r| r.0)))
        })
        .collect()
}

const ROOM: &str = "9066467638188682269";
const ROOM_N: u64 = 9066467638188682269;

/// Prefill's end sees every session a room's destinations come from: sessions up to the count
/// the room asks for are its owners (one, or one per decode rank when decode's attention TP is
/// a multiple of prefill's); one more is a second decode owner, reported once per room.
#[test]
fn a_decode_session_beyond_the_rooms_count_is_a_second_owner() {
    let mut s = Sim::new();
    // Prefill's HTTP server received the room's request: one request on it.
    prefill_receives(
        &mut s,
        30,
        &format!(r#"{{"text": "hi", "bootstrap_room": {ROOM}}}"#),
    );
    // One decode, one session: silent.
    s.accept(PREFILL, 5);
    s.io(
        PREFILL,
        5,
        syscall::RECVFROM,
        &mooncake_destinations("41", "17001", "127.0.0.1:15001", "1"),
        4096,
    );
    // Decode attn-TP 2 over prefill attn-TP 1: two ranks, two sessions, two asked for.
    s.accept(PREFILL, 6);
    s.accept(PREFILL, 7);
    for (fd, session) in [(6, "127.0.0.1:15001"), (7, "127.0.0.1:15002")] {
        s.io(
            PREFILL,
            fd,
            syscall::RECVFROM,
            &mooncake_destinations(ROOM, "17001", session, "2"),
            4096,
        );
    }
    // Re-sent by a session the room already has: the same owner.
    s.io(
        PREFILL,
        6,
        syscall::RECVFROM,
        &zmtp_wire(&[b"ABORT", b"1", b"127.0.0.1", b"17001"])[64..],
        4096,
    );
    assert_eq!(breaches(&s), vec![]);
    // One from a decode on another host: a second owner. Another is the same breach of the
    // same room.
    s.accept(PREFILL, 8);
    s.io(
        PREFILL,
        8,
        syscall::RECVFROM,
        &mooncake_destinations_from("10.0.0.9", ROOM, "17009", "10.0.0.9:15009", "2"),
        4096,
    );
    s.accept(PREFILL, 9);
    s.io(
        PREFILL,
        9,
        syscall::RECVFROM,
        &mooncake_destinations_from("10.0.0.9", ROOM, "17010", "10.0.0.9:15010", "2"),
        4096,
    );
    assert_eq!(
        breaches(&s),
        vec![(
            ProtocolBreach::SurplusDecodeOwner,
            Stage::Transfer,
            Kind::Admitted,
            Some(ROOM_N)
        )]
    );
    let e = s.out.iter().find(|e| e.protocol_breach.is_some()).unwrap();
    assert_eq!(e.worker.as_deref(), Some("10.0.0.9:17009"));
    // The room concluded (prefill's Success): decode may reuse it, a new lifetime.
    s.connect(PREFILL, 20, "127.0.0.1:17001");
    s.io(
        PREFILL,
        20,
        syscall::SENDTO,
        &zmtp_wire(&[ROOM.as_bytes(), b"4", b"0"]),
        4096,
    );
    s.accept(PREFILL, 10);
    s.io(
        PREFILL,
        10,
        syscall::RECVFROM,
        &mooncake_destinations(ROOM, "17009", "127.0.0.1:15009", "1"),
        4096,
    );
    assert_eq!(breaches(&s).len(), 1);
    // Decode's own end never judges owners, even of a room prefill's server received: it
    // sees only its own sessions.
    prefill_receives(&mut s, 31, r#"{"text": "hi", "bootstrap_room": 77}"#);
    s.connect(DECODE, 11, "127.0.0.1:31001");
    s.io(
        DECODE,
        11,
        syscall::SENDTO,
        &mooncake_destinations("77", "17001", "127.0.0.1:15001", "1"),
        4096,
    );
    s.io(
        DECODE,
        11,
        syscall::SENDTO,
        &mooncake_destinations_from("10.0.0.9", "77", "17001", "10.0.0.9:15002", "1")[64..],
        4096,
    );
    assert_eq!(breaches(&s).len(), 1);
}

/// Prefill's HTTP server (tgid `PREFILL`) reads a `/generate` request with `body` on `fd`.
fn prefill_receives(s: &mut Sim, fd: u32, body: &str) {
    s.accept(PREFILL, fd);
    s.io(
        PREFILL,
        fd,
        syscall::RECVFROM,
        &http_post("/generate", body),
        4096,
    );
}

/// Decode sessions on `hosts` send destinations for `room` to prefill's scheduler (another
/// process than its HTTP server), each on its own connection from `fd` on.
fn destinations_from_hosts(s: &mut Sim, fd: u32, room: &str, hosts: &[&str], required: &str) {
    for (i, host) in hosts.iter().enumerate() {
        let fd = fd + i as u32;
        s.accept(PREFILL_SCHEDULER, fd);
        s.io(
            PREFILL_SCHEDULER,
            fd,
            syscall::RECVFROM,
            &mooncake_destinations_from(host, room, "17001", &format!("{host}:15001"), required),
            4096,
        );
    }
}

const PREFILL_SCHEDULER: u32 = 201;

/// Parallel samples of one prompt (`n > 1`) and a batch listing a room more than once are
/// several requests on one room, which decode's round-robin DP may put on different nodes:
/// their owners are the count times those requests, as the body prefill's HTTP server read
/// says. A room whose body was not seen is not judged.
#[test]
fn a_rooms_owners_are_its_count_times_the_requests_its_body_names() {
    let mut s = Sim::new();
    s.t.set_role(PREFILL_SCHEDULER, Role::Prefill);
    let hosts = ["10.0.0.2", "10.0.0.3", "10.0.0.4"];
    // n = 3 (top level, or in sampling_params) on decode DP ranks of three nodes: silent.
    prefill_receives(
        &mut s,
        30,
        r#"{"text": "hi", "n": 3, "bootstrap_room": 50}"#,
    );
    destinations_from_hosts(&mut s, 100, "50", &hosts, "1");
    prefill_receives(
        &mut s,
        31,
        r#"{"text": "hi", "sampling_params": {"n": 3, "temperature": 1.0}, "bootstrap_room": 51}"#,
    );
    destinations_from_hosts(&mut s, 110, "51", &hosts, "1");
    assert_eq!(breaches(&s), vec![]);
    // n = 1 (not named): a session from a second host is a second owner, reported once.
    prefill_receives(&mut s, 32, r#"{"text": "hi", "bootstrap_room": 52}"#);
    destinations_from_hosts(&mut s, 120, "52", &hosts, "1");
    assert_eq!(
        breaches(&s),
        vec![(
            ProtocolBreach::SurplusDecodeOwner,
            Stage::Transfer,
            Kind::Admitted,
            Some(52)
        )]
    );
    // A batch listing room 53 twice: twice the count is silent, one more is a second owner.
    prefill_receives(
        &mut s,
        33,
        r#"{"text": ["a", "b", "c"], "bootstrap_room": [53, 54, 53]}"#,
    );
    destinations_from_hosts(&mut s, 130, "53", &hosts[..2], "1");
    assert_eq!(breaches(&s).len(), 1);
    destinations_from_hosts(&mut s, 140, "53", &hosts[2..], "1");
    assert_eq!(breaches(&s).len(), 2);
    assert_eq!(breaches(&s)[1].3, Some(53));
    // No body seen for room 55 (a capture gap, or a request from before the capture): not
    // judged.
    destinations_from_hosts(&mut s, 150, "55", &hosts, "1");
    assert_eq!(breaches(&s).len(), 2);
    // A body the capture cut in the middle may hide its `n`: not judged either.
    let long = format!(
        r#"{{"text": "{}", "bootstrap_room": 56}}"#,
        "lorem ipsum ".repeat(2000)
    );
    s.accept(PREFILL, 34);
    s.io(
        PREFILL,
        34,
        syscall::RECVFROM,
        &http_post("/generate", &long),
        1 << 20,
    );
    destinations_from_hosts(&mut s, 160, "56", &hosts, "1");
    assert_eq!(breaches(&s).len(), 2);
}

/// Under `prefill_complete` prefill announces a room ready once per lifetime (`[room, "2",
/// rank]`); decode's end, which a forged one also reaches, judges a second.
#[test]
fn readiness_twice_for_one_room_is_a_breach() {
    let mut s = Sim::new();
    s.accept(DECODE, 5);
    let ready = zmtp_wire(&[ROOM.as_bytes(), b"2", b"0"]);
    s.io(DECODE, 5, syscall::RECVFROM, &ready, 4096);
    assert_eq!(breaches(&s), vec![]);
    // Success ends the lifetime; a recompute of the retracted request may reuse the room.
    for m in [
        &[ROOM.as_bytes(), b"4", b"0"][..],
        &[ROOM.as_bytes(), b"2", b"0"],
    ] {
        s.io(DECODE, 5, syscall::RECVFROM, &zmtp_wire(m)[64..], 4096);
    }
    assert_eq!(breaches(&s), vec![]);
    s.io(DECODE, 5, syscall::RECVFROM, &ready[64..], 4096);
    s.io(DECODE, 5, syscall::RECVFROM, &ready[64..], 4096);
    assert_eq!(
        breaches(&s),
        vec![(
            ProtocolBreach::RepeatedReadiness,
            Stage::Prefill,
            Kind::Work,
            Some(ROOM_N)
        )]
    );
}

/// Under `prefill_complete` (the room began with `BOOTSTRAP`), destinations before prefill's
/// readiness are a breach, judged at prefill's end, and only where its readiness could not
/// have left unseen: on a connection to that decode endpoint read from its start.
#[test]
fn destinations_before_readiness_under_prefill_complete() {
    let mut s = Sim::new();
    s.accept(PREFILL, 5);
    let bootstrap = |room: &str| {
        zmtp_wire(&[b"BOOTSTRAP", room.as_bytes(), b"127.0.0.1", b"17001"])[64..].to_vec()
    };
    s.io(
        PREFILL,
        5,
        syscall::RECVFROM,
        &zmtp_wire(&[b"x"])[..64],
        4096,
    );
    // No connection from prefill to that decode yet: its readiness may have gone unseen.
    s.io(PREFILL, 5, syscall::RECVFROM, &bootstrap("50"), 4096);
    s.io(
        PREFILL,
        5,
        syscall::RECVFROM,
        &mooncake_destinations("50", "17001", "127.0.0.1:15001", "1")[64..],
        4096,
    );
    assert_eq!(breaches(&s), vec![]);
    // Prefill's connection to decode, read from its greeting: the correct order is silent.
    s.connect(PREFILL, 9, "127.0.0.1:17001");
    s.io(
        PREFILL,
        9,
        syscall::SENDTO,
        &zmtp_wire(&[b"50", b"4", b"0"]),
        4096,
    );
    s.io(PREFILL, 5, syscall::RECVFROM, &bootstrap(ROOM), 4096);
    s.io(
        PREFILL,
        9,
        syscall::SENDTO,
        &zmtp_wire(&[ROOM.as_bytes(), b"2", b"0"])[64..],
        4096,
    );
    s.io(
        PREFILL,
        5,
        syscall::RECVFROM,
        &mooncake_destinations(ROOM, "17001", "127.0.0.1:15001", "1")[64..],
        4096,
    );
    // Early policy: destinations with no BOOTSTRAP are the room's first message.
    s.io(
        PREFILL,
        5,
        syscall::RECVFROM,
        &mooncake_destinations("52", "17001", "127.0.0.1:15001", "1")[64..],
        4096,
    );
    assert_eq!(breaches(&s), vec![]);
    s.io(PREFILL, 5, syscall::RECVFROM, &bootstrap("51"), 4096);
    s.io(
        PREFILL,
        5,
        syscall::RECVFROM,
        &mooncake_destinations("51", "17001", "127.0.0.1:15001", "1")[64..],
        4096,
    );
    assert_eq!(
        breaches(&s),
        vec![(
            ProtocolBreach::DestinationsBeforeReadiness,
            Stage::Transfer,
            Kind::Admitted,
            Some(51)
        )]
    );
    // The kernel lost records since the room began (its readiness may be one): not judged.
    s.io(PREFILL, 5, syscall::RECVFROM, &bootstrap("53"), 4096);
    s.t.set_kernel_losses(1);
    s.io(
        PREFILL,
        5,
        syscall::RECVFROM,
        &mooncake_destinations("53", "17001", "127.0.0.1:15001", "1")[64..],
        4096,
    );
    assert_eq!(breaches(&s).len(), 1);
}

/// On one keep-alive connection prefill reads request A; the kernel loses A's 200 (the ring
/// was full) and says so; prefill reads request B and answers it 400. The 400 is B's: paired
/// with the oldest request waiting, A would be "rejected" after being served. A is left
/// unanswered and counted. Without a reported loss the same bytes pair in order, as HTTP/1.1
/// without pipelining does.
#[test]
fn after_a_loss_an_answer_goes_to_the_newest_request_waiting_on_its_connection() {
    let bad = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
    let play = |losses_after_a: u64| {
        let mut s = Sim::new();
        s.accept(PREFILL, 7);
        s.io(
            PREFILL,
            7,
            syscall::RECVFROM,
            &generate_request(10, 41, "CANARY-a"),
            65536,
        );
        // A's answer is among the lost records.
        s.t.set_kernel_losses(losses_after_a);
        s.io(
            PREFILL,
            7,
            syscall::RECVFROM,
            &generate_request(10, 42, "CANARY-b"),
            65536,
        );
        s.io(PREFILL, 7, syscall::SENDTO, bad, 4096);
        s
    };
    let s = play(3);
    assert_eq!(
        s.kinds(),
        vec![
            (Stage::Prefill, Kind::Received, Some(41)),
            (Stage::Prefill, Kind::Received, Some(42)),
            (Stage::Prefill, Kind::Rejected, Some(42)),
        ]
    );
    assert_eq!(s.t.stats.answers_lost, 1);
    // No loss reported: two requests waiting is not read as a loss.
    let s = play(0);
    assert_eq!(s.kinds()[2], (Stage::Prefill, Kind::Rejected, Some(41)));
    assert_eq!(s.t.stats.answers_lost, 0);
}
