//! The ZMTP 3.x stream parser (`ingest::ebpf::zmtp`) fed an input in arbitrary chunks with gaps
//! (see `revenant_fuzz::stream_ops`; a close picks the stream up mid-way again), then the
//! control-message reader on every message.
//!
//! Holds: no panic; a message keeps at most `KEEP_PARTS` parts of at most `KEEP_BYTES` each
//! (`KEEP_MSGPACK_BYTES` for a first part that is a MessagePack map; payloads are never kept) and counts at least the parts it keeps. And splitting does not
//! matter: the bytes of all feeds, given as one syscall, give the same messages as the same
//! bytes in the input's chunks continuing that syscall.
#![no_main]

use libfuzzer_sys::fuzz_target;
use revenant::ingest::ebpf::zmtp::{self, KEEP_BYTES, KEEP_MSGPACK_BYTES, KEEP_PARTS, ZmtpStream};
use revenant_fuzz::{Op, stream_ops};

fn stream_for(first: Option<&[u8]>) -> ZmtpStream {
    if first.is_some_and(zmtp::is_greeting) {
        ZmtpStream::from_greeting()
    } else {
        ZmtpStream::mid_stream()
    }
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
    let (mut a, mut b) = (stream_for(Some(&whole)), stream_for(Some(&whole)));
    let (mut ma, mut mb) = (Vec::new(), Vec::new());
    a.feed(&whole, true, &mut ma);
    for (i, c) in chunks.iter().enumerate() {
        b.feed(c, i == 0, &mut mb);
    }
    assert_eq!(ma, mb, "the split changed the messages");
}

fuzz_target!(|data: &[u8]| {
    let ops = stream_ops(data);
    let first = ops.iter().find_map(|op| match op {
        Op::Feed { bytes, .. } => Some(*bytes),
        _ => None,
    });
    let mut stream = stream_for(first);
    let mut out = Vec::new();
    for op in &ops {
        match *op {
            Op::Feed {
                bytes,
                syscall_start,
            } => stream.feed(bytes, syscall_start, &mut out),
            Op::Gap(n) => stream.gap(n, &mut out),
            Op::Close => stream = ZmtpStream::mid_stream(),
        }
    }
    split_invariance(&ops);
    for msg in &out {
        assert!(
            msg.parts.len() <= KEEP_PARTS,
            "{} parts kept",
            msg.parts.len()
        );
        // The first part keeps more when it is a MessagePack map (vLLM's connectors).
        assert!(
            msg.parts
                .iter()
                .enumerate()
                .all(|(i, p)| p.len() <= if i == 0 { KEEP_MSGPACK_BYTES } else { KEEP_BYTES })
        );
        assert!(msg.part_count as usize >= msg.parts.len());
        let _ = zmtp::control(msg, zmtp::Sender::Prefill);
        let _ = zmtp::control(msg, zmtp::Sender::Decode);
        let _ = zmtp::vllm_control(msg);
    }
});
