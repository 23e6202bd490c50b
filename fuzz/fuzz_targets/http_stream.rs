//! The HTTP/1.1 stream parser (`ingest::ebpf::http`) fed an input in arbitrary chunks, with gaps
//! and closes between them (see `revenant_fuzz::stream_ops`), then the id scanner
//! (`json_ids`) on every body window it hands out.
//!
//! Holds: no panic; kept request fields stay within their 256-byte bound; a body window's Debug
//! form (what a log line would show) carries lengths only, never body bytes, and it keeps at
//! most a head and a tail window; ids and reasons pulled from a body stay within their bound.
//! And splitting does not matter: the bytes of all feeds, given as one syscall, parse to the
//! same messages (heads, body lengths, ids, answers; desyncs aside) as the same bytes in the
//! input's chunks continuing that syscall, when its first chunk is detected as the whole is.
#![no_main]

use libfuzzer_sys::fuzz_target;
use revenant::ingest::ebpf::http::{HttpEvent, HttpStream, RequestHead, ResponseHead, detect};
use revenant::ingest::ebpf::json_ids::{RequestIds, ResponseInfo, WINDOW};
use revenant_fuzz::{Op, stream_ops};

const MAX_FIELD: usize = 256;
const MAX_VALUE: usize = 256;

/// What a message parse says, comparable across splittings.
#[derive(Debug, PartialEq)]
enum Seen {
    Request(RequestHead),
    Response(ResponseHead),
    BodyStarted,
    End(u64, bool, RequestIds, ResponseInfo),
    Desync,
}

fn seen(events: Vec<HttpEvent>) -> Vec<Seen> {
    events
        .into_iter()
        .map(|e| match e {
            HttpEvent::RequestHead(h) => Seen::Request(h),
            HttpEvent::ResponseHead(h) => Seen::Response(h),
            HttpEvent::BodyStarted { .. } => Seen::BodyStarted,
            HttpEvent::End { body } => Seen::End(
                body.len,
                body.gaps,
                body.request_ids(),
                body.response_info(),
            ),
            HttpEvent::Desync => Seen::Desync,
        })
        .collect()
}

/// The feeds' bytes as one syscall, and in their chunks continuing it.
fn split_invariance(ops: &[Op<'_>]) {
    let chunks: Vec<&[u8]> = ops
        .iter()
        .filter_map(|op| match op {
            Op::Feed { bytes, .. } => Some(*bytes),
            _ => None,
        })
        .collect();
    let whole = chunks.concat();
    // A first syscall shorter than a method ("T") may start a request that the whole buffer
    // ("T /x …", no known method) does not: compare splits that start the same way.
    if chunks.first().is_none_or(|c| detect(c) != detect(&whole)) {
        return;
    }
    let (mut a, mut b) = (HttpStream::default(), HttpStream::default());
    let (mut ea, mut eb) = (Vec::new(), Vec::new());
    a.feed(&whole, true, &mut ea);
    for (i, c) in chunks.iter().enumerate() {
        b.feed(c, i == 0, &mut eb);
    }
    // Desync only counts lost framing: a syscall of one byte that could start a request
    // ("T") is taken for one until the next bytes say otherwise, which the whole buffer never
    // was. The messages must be the same.
    let messages = |e: Vec<HttpEvent>| {
        let mut s = seen(e);
        s.retain(|x| *x != Seen::Desync);
        s
    };
    assert_eq!(
        messages(ea),
        messages(eb),
        "the split changed what was parsed"
    );
}

fuzz_target!(|data: &[u8]| {
    let ops = stream_ops(data);
    let mut stream = HttpStream::default();
    let mut out = Vec::new();
    for op in &ops {
        match *op {
            Op::Feed {
                bytes,
                syscall_start,
            } => {
                let _ = detect(bytes);
                stream.feed(bytes, syscall_start, &mut out);
            }
            Op::Gap(n) => stream.gap(n, &mut out),
            Op::Close => stream.close(&mut out),
        }
    }
    stream.close(&mut out);
    split_invariance(&ops);
    for ev in &out {
        match ev {
            HttpEvent::RequestHead(h) => {
                assert!(h.method.len() <= MAX_FIELD && h.path.len() <= MAX_FIELD);
                assert!(h.request_id.as_ref().is_none_or(|v| v.len() <= MAX_FIELD));
                assert!(h.traceparent.as_ref().is_none_or(|v| v.len() <= MAX_FIELD));
            }
            HttpEvent::End { body } => {
                let shown = format!("{body:?}");
                let kept = shown
                    .strip_prefix("BodyWindow { len: ")
                    .and_then(|s| s.split(", kept_bytes: ").nth(1))
                    .and_then(|s| s.strip_suffix(" }"))
                    .and_then(|s| s.parse::<usize>().ok());
                let Some(kept) = kept else {
                    panic!("a body window shows more than its lengths: {shown}");
                };
                // Head and tail windows, plus one gap marker per operation at most.
                assert!(kept <= 3 * WINDOW + ops.len() + 1, "{shown}");
                let ids = body.request_ids();
                for v in [&ids.rid, &ids.bootstrap_host, &ids.remote_request_id]
                    .into_iter()
                    .flatten()
                {
                    assert!(
                        v.chars().count() <= MAX_VALUE,
                        "id of {} chars",
                        v.chars().count()
                    );
                }
                let info = body.response_info();
                if let Some(m) = &info.message {
                    assert!(
                        m.chars().count() <= MAX_VALUE,
                        "message of {} chars",
                        m.chars().count()
                    );
                }
                let _ = body.vllm_cache_config();
            }
            HttpEvent::ResponseHead(_) | HttpEvent::BodyStarted { .. } | HttpEvent::Desync => {}
        }
    }
});
