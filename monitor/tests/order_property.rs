//! Property: shuffling arrival order within the clock-skew bound never changes the verdicts.
//!
//! Arrival order is event time plus a random delay of at most the skew (and the allowed lateness
//! equals the skew), as when nodes' exporters deliver a little late and out of order.
//!
//! Events of one attempt come from at most two clock domains here (no node, and one named node):
//! the engine keeps per-node extremes for two nodes per attempt, which is exact up to two; with a
//! third node in the skew window an out-of-order trigger can miss a same-node offender (README).

use std::collections::BTreeSet;
use std::time::Duration;

use proptest::prelude::*;
use revenant::engine::check::{Checker, CheckerConfig, RuleSet};
use revenant::{Kind, LifecycleEvent, Source, Stage, Violation};

const SKEW: Duration = Duration::from_millis(50);
const MS: u64 = 1_000_000;
const T0: u64 = 1_795_986_920_000_000_000;

fn arb_event(room: u64, start: u64) -> impl Strategy<Value = LifecycleEvent> {
    let stages = prop_oneof![
        Just(Stage::Router),
        Just(Stage::Prefill),
        Just(Stage::Transfer),
        Just(Stage::Decode)
    ];
    let kinds = prop_oneof![
        Just(Kind::Received),
        Just(Kind::Dispatched),
        Just(Kind::Admitted),
        Just(Kind::Rejected),
        Just(Kind::Work),
        Just(Kind::Completed),
        Just(Kind::Aborted),
        Just(Kind::Cancelled),
    ];
    (
        stages,
        kinds,
        0..800u64,
        prop::option::of(prop_oneof![Just(200u16), Just(400), Just(503)]),
        0..2u8,
        any::<bool>(),
        prop::option::of(8000..10_000u64),
        // The request id on the event: none, the attempt's own, or now and then a second
        // client request's on the same room (room-collision).
        prop_oneof![6 => Just(None), 6 => Just(Some(0u8)), 1 => Just(Some(1u8))],
    )
        .prop_map(
            move |(stage, kind, dt, status, node, with_rid, tokens, request)| {
                let mut e = LifecycleEvent::new(T0 + start + dt * MS, stage, kind, Source::Ebpf)
                    .with_room(room);
                e.status = status;
                if node > 0 {
                    e.node = Some(format!("node-{node}").into());
                }
                if with_rid {
                    e.ids.rid = Some(format!("rid-{room}").into());
                }
                if kind == Kind::Dispatched {
                    e.to = Some(Stage::Decode);
                }
                if let Some(n) = request {
                    e.ids.request_id = Some(format!("req-{room}-{n}").into());
                }
                e.input_tokens = tokens;
                e.worker = Some("w".into());
                e
            },
        )
}

fn arb_stream() -> impl Strategy<Value = Vec<LifecycleEvent>> {
    prop::collection::vec((0..5_000u64, 1..10usize), 1..25).prop_flat_map(|attempts| {
        let per: Vec<_> = attempts
            .into_iter()
            .enumerate()
            .map(|(i, (start_ms, n))| {
                prop::collection::vec(arb_event(i as u64 + 1, start_ms * MS), n)
            })
            .collect();
        per.prop_map(|v| {
            let mut all: Vec<LifecycleEvent> = v.into_iter().flatten().collect();
            let mut cap = LifecycleEvent::new(T0, Stage::Prefill, Kind::Capacity, Source::Otlp)
                .with_worker("w");
            cap.max_total_tokens = Some(9000);
            all.push(cap);
            all
        })
    })
}

fn verdicts(events: &[LifecycleEvent]) -> BTreeSet<(String, Option<u64>, Option<String>)> {
    let cfg = CheckerConfig {
        clock_skew: SKEW,
        allowed_lateness: SKEW,
        ..CheckerConfig::default()
    };
    let mut c = Checker::new(RuleSet::embedded_defaults(), cfg);
    let mut out: Vec<Violation> = Vec::new();
    for e in events {
        out.extend(c.observe(e));
    }
    // Past the longest deadline the stream can hold short of stuck-attempt's (the 30 s windows
    // of stranded-kv and held-decode-slot), so those verdicts are part of what must not depend
    // on arrival order.
    let end = c.stats().max_event_ns + (SKEW + Duration::from_secs(31)).as_nanos() as u64;
    out.extend(c.tick(end));
    out.into_iter()
        .map(|v| (v.rule, v.attempt.bootstrap_room, v.worker))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn verdicts_survive_arrival_jitter_within_the_skew(
        events in arb_stream(),
        jitter in prop::collection::vec(0..=SKEW.as_nanos() as u64, 250),
    ) {
        let mut in_time_order = events.clone();
        in_time_order.sort_by_key(|e| e.time_ns);
        let mut arrivals: Vec<(u64, usize)> = events.iter().enumerate().map(|(i, e)| (e.time_ns + jitter[i % jitter.len()], i)).collect();
        arrivals.sort();
        let jittered: Vec<LifecycleEvent> = arrivals.into_iter().map(|(_, i)| events[i].clone()).collect();
        prop_assert_eq!(verdicts(&in_time_order), verdicts(&jittered));
    }
}
