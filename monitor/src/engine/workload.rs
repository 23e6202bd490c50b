//! A synthetic but realistic PD event stream, shared by the benchmarks and the event generator.
//!
//! Each attempt: the router dispatches to prefill and decode, both receive, prefill admits and
//! computes, KV moves, decode admits, streams and completes: ten events. A share of attempts is
//! rejected by prefill (the decode leg is then cancelled). Attempt `i` starts `spacing_ns * i`
//! after the epoch and lasts ~100 ms, so `100 ms / spacing` attempts are live at once.

use crate::event::{Kind, LifecycleEvent, Source, Stage};

#[derive(Debug, Clone, Copy)]
pub struct Mix {
    pub attempts: u64,
    /// One attempt in `reject_every` is rejected by prefill.
    pub reject_every: u64,
    pub spacing_ns: u64,
    pub epoch_ns: u64,
    /// Each attempt also has the router's receipt of its request, which names the request only
    /// (request-level: in cluster mode it goes to every partition).
    pub receipts: bool,
}

impl Default for Mix {
    fn default() -> Self {
        Mix {
            attempts: 100_000,
            reject_every: 100,
            spacing_ns: 1_000,
            epoch_ns: 1_795_986_920_000_000_000,
            receipts: false,
        }
    }
}

fn room(i: u64) -> u64 {
    // splitmix64: rooms look random, as SGLang's are.
    let mut z = i.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The events of attempt `i`, in event-time order.
pub fn attempt_events(mix: &Mix, i: u64) -> Vec<LifecycleEvent> {
    const MS: u64 = 1_000_000;
    let t0 = mix.epoch_ns + i * mix.spacing_ns;
    let room = room(i);
    let request_id = format!("req-{i:012}");
    let prefill_rid = format!("{:016x}{:016x}", room, i);
    let decode_rid = format!("{:016x}{:016x}", i, room);
    let ev = |dt: u64, stage, kind, source| {
        LifecycleEvent::new(t0 + dt, stage, kind, source).with_room(room)
    };
    let mut v = vec![
        ev(0, Stage::Router, Kind::Dispatched, Source::Ebpf)
            .with_request_id(request_id.as_str())
            .with_to(Stage::Prefill)
            .with_input_tokens(900),
        ev(0, Stage::Router, Kind::Dispatched, Source::Ebpf)
            .with_request_id(request_id.as_str())
            .with_to(Stage::Decode),
        ev(MS, Stage::Prefill, Kind::Received, Source::Ebpf),
        ev(MS, Stage::Decode, Kind::Received, Source::Ebpf),
    ];
    if mix.receipts {
        v.insert(
            0,
            LifecycleEvent::new(t0, Stage::Router, Kind::Received, Source::Otlp)
                .with_request_id(request_id.as_str()),
        );
    }
    if mix.reject_every > 0 && i.is_multiple_of(mix.reject_every) {
        v.push(
            ev(2 * MS, Stage::Prefill, Kind::Rejected, Source::Otlp)
                .with_rid(prefill_rid.as_str())
                .with_status(400)
                .with_reason("exceeds the maximum number of tokens"),
        );
        if i.is_multiple_of(mix.reject_every * 10) {
            // One rejected attempt in ten is still handed off: the disclosed failure.
            v.extend([
                ev(20 * MS, Stage::Transfer, Kind::Work, Source::Ebpf),
                ev(50 * MS, Stage::Decode, Kind::Work, Source::Ebpf),
                ev(100 * MS, Stage::Decode, Kind::Completed, Source::Ebpf).with_status(200),
            ]);
        } else {
            v.push(ev(3 * MS, Stage::Decode, Kind::Cancelled, Source::Ebpf));
        }
        return v;
    }
    v.extend([
        ev(2 * MS, Stage::Prefill, Kind::Admitted, Source::Otlp).with_rid(prefill_rid.as_str()),
        ev(20 * MS, Stage::Transfer, Kind::Work, Source::Ebpf),
        ev(25 * MS, Stage::Prefill, Kind::Completed, Source::Otlp)
            .with_rid(prefill_rid.as_str())
            .with_status(200),
        ev(26 * MS, Stage::Decode, Kind::Admitted, Source::Otlp).with_rid(decode_rid.as_str()),
        ev(50 * MS, Stage::Decode, Kind::Work, Source::Ebpf),
        ev(100 * MS, Stage::Decode, Kind::Completed, Source::Ebpf).with_status(200),
    ]);
    v
}

/// The whole stream, interleaved by event time as a node would see it.
pub fn stream(mix: &Mix) -> Vec<LifecycleEvent> {
    let mut all: Vec<LifecycleEvent> = (0..mix.attempts)
        .flat_map(|i| attempt_events(mix, i))
        .collect();
    all.sort_by_key(|e| e.time_ns);
    all
}
