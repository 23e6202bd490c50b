//! The HTTP/1.1 stream parser (`ingest::ebpf::http`) fed an input in arbitrary chunks, with gaps
//! and closes between them (see `revenant_fuzz::stream_ops`), then the id scanner
//! (`json_ids`) on every body window it hands out.
//!
//! Holds: no panic; kept request fields stay within their 256-byte bound; a body window's Debug
//! form (what a log line would show) carries lengths only, never body bytes, and it keeps at
//! most a head and a tail window; ids and reasons pulled from a body stay within their bound.
#![no_main]

use libfuzzer_sys::fuzz_target;
use revenant::ingest::ebpf::http::{HttpEvent, HttpStream, detect};
use revenant::ingest::ebpf::json_ids::WINDOW;
use revenant_fuzz::{Op, stream_ops};

const MAX_FIELD: usize = 256;
const MAX_VALUE: usize = 256;

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
                for v in [&ids.rid, &ids.bootstrap_host, &ids.remote_request_id].into_iter().flatten() {
                    assert!(v.chars().count() <= MAX_VALUE, "id of {} chars", v.chars().count());
                }
                let info = body.response_info();
                if let Some(m) = &info.message {
                    assert!(m.chars().count() <= MAX_VALUE, "message of {} chars", m.chars().count());
                }
                let _ = body.vllm_cache_config();
            }
            HttpEvent::ResponseHead(_) | HttpEvent::BodyStarted | HttpEvent::Desync => {}
        }
    }
});
