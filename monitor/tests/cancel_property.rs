//! Property: under the concurrent-cancel protocol (smg 1.13.0: prefill and decode legs sent at
//! once, the decode leg withdrawn within milliseconds of a prefill error, 503s retried with a new
//! room), the default rules fire exactly when something advanced or a leg outlived the
//! cancellation window, whatever the timings and the arrival order.
//!
//! Generated per request: the verdict arrives before or after decode receives its leg (and
//! starts its bootstrap handshake); the router's withdrawal and decode's own end come after a
//! random delay; decode and the transfer engine sit on another node whose clock is off by up to
//! half the skew. On top, optional breaches: one advancing event after the verdict (decode
//! admission, work or success, KV moving or arriving), a decode leg that outlives the window, a
//! late handoff. The oracle says which rules must fire; nothing else may.

use std::collections::BTreeSet;
use std::time::Duration;

use proptest::prelude::*;
use revenant::engine::check::{Checker, CheckerConfig, RuleSet};
use revenant::{Kind, LifecycleEvent, Source, Stage};

const SKEW: Duration = Duration::from_millis(50);
const US: u64 = 1_000;
const MS: u64 = 1_000_000;
const T0: u64 = 1_795_986_920_000_000_000;
/// The default window of decode's own end of its leg (orphaned-leg's `within`: SGLang's 4 s
/// connection check and 2 s); the router's is handoff-after-rejection's `grace`, 500 ms.
const DECODE_WINDOW_MS: u64 = 6_000;

#[derive(Debug, Clone, Copy)]
enum Advance {
    DecodeAdmitted,
    DecodeWork,
    DecodeSucceeded,
    KvMoved,
    KvArrived,
}

#[derive(Debug, Clone)]
struct Plan {
    /// Prefill's verdict after the dispatch (µs).
    verdict_us: u64,
    /// 400 or 503 (a 503 is retried with a new room, which succeeds).
    status: u16,
    /// Decode receives its leg this long after the dispatch (µs): before or after the verdict.
    decode_rx_us: u64,
    /// Decode's bootstrap handshake, after it received the leg (µs), if it gets that far.
    bootstrap_us: Option<u64>,
    /// The router withdraws the decode leg after the verdict (µs).
    withdraw_us: u64,
    /// Decode's own end after the withdrawal (µs); None with `orphan`.
    end_after_withdraw_us: u64,
    /// Decode ignores the withdrawal: its leg ends this long after the verdict (ms, beyond the
    /// window and the skew) or never.
    orphan: Option<Option<u64>>,
    /// An advancing event this long after the verdict (ms, beyond the skew).
    advance: Option<(Advance, u64)>,
    /// The router hands the attempt on again this long after the verdict (ms, beyond the window).
    late_handoff_ms: Option<u64>,
    /// Decode's clock offset (µs, within half the skew either way).
    decode_clock_us: i64,
}

fn arb_plan() -> impl Strategy<Value = Plan> {
    let advance = prop_oneof![
        Just(Advance::DecodeAdmitted),
        Just(Advance::DecodeWork),
        Just(Advance::DecodeSucceeded),
        Just(Advance::KvMoved),
        Just(Advance::KvArrived),
    ];
    (
        (100..20_000u64, prop_oneof![Just(400u16), Just(503)]),
        (0..30_000u64, prop::option::of(0..5_000u64)),
        (300..60_000u64, 0..10_000u64),
        prop::option::weighted(0.15, prop::option::of(6_100..9_000u64)),
        prop::option::weighted(0.15, (advance, 80..3_000u64)),
        prop::option::weighted(0.1, 600..2_000u64),
        -25_000..=25_000i64,
    )
        .prop_map(
            |(
                (verdict_us, status),
                (decode_rx_us, bootstrap_us),
                (withdraw_us, end_after_withdraw_us),
                orphan,
                advance,
                late_handoff_ms,
                decode_clock_us,
            )| Plan {
                verdict_us,
                status,
                decode_rx_us,
                bootstrap_us,
                withdraw_us,
                end_after_withdraw_us,
                orphan,
                advance,
                late_handoff_ms,
                decode_clock_us,
            },
        )
}

/// The events of request `i` following `plan`, and the (rule, room) pairs that must fire.
fn request(i: u64, plan: &Plan) -> (Vec<LifecycleEvent>, BTreeSet<(String, u64)>) {
    let t0 = T0 + i * 20_000 * MS;
    let room = 1_000 + i * 2;
    let rid = format!("req-{i}");
    let mut out = Vec::new();
    let router = |t: u64, kind: Kind| {
        let mut e = LifecycleEvent::new(t, Stage::Router, kind, Source::Ebpf);
        e.node = Some("node-a".into());
        e.with_request_id(rid.as_str())
    };
    let prefill = |t: u64, kind: Kind, room: u64| {
        let mut e = LifecycleEvent::new(t, Stage::Prefill, kind, Source::Ebpf).with_room(room);
        e.node = Some("node-a".into());
        e
    };
    // Decode's node reads its own clock: true time plus its offset.
    let decode = |t: u64, stage: Stage, kind: Kind, room: u64| {
        let t = t.saturating_add_signed(plan.decode_clock_us * US as i64);
        let mut e = LifecycleEvent::new(t, stage, kind, Source::Ebpf).with_room(room);
        e.node = Some("node-b".into());
        e
    };
    let dispatch =
        |t: u64, to: Stage, room: u64| router(t, Kind::Dispatched).with_room(room).with_to(to);

    out.push(router(t0, Kind::Received));
    out.push(dispatch(t0 + 50 * US, Stage::Prefill, room));
    out.push(dispatch(t0 + 60 * US, Stage::Decode, room));
    out.push(prefill(t0 + 80 * US, Kind::Received, room));
    let verdict = t0 + plan.verdict_us * US;
    out.push(prefill(verdict, Kind::Rejected, room).with_status(plan.status));
    let rx = t0 + plan.decode_rx_us * US;
    out.push(decode(rx, Stage::Decode, Kind::Received, room));
    if let Some(b) = plan.bootstrap_us {
        out.push(decode(rx + b * US, Stage::Transfer, Kind::Received, room));
    }
    let withdraw = verdict + plan.withdraw_us * US;
    let mut cancel = router(withdraw, Kind::Cancelled).with_room(room);
    cancel.to = Some(Stage::Decode);
    out.push(cancel);
    // Decode's own end: in time after the withdrawal (it cannot end before it got the leg),
    // or, ignoring it, late or never.
    let in_time_end = withdraw.max(rx) + plan.end_after_withdraw_us * US;
    let mut expected = BTreeSet::new();
    match plan.orphan {
        None => out.push(decode(in_time_end, Stage::Decode, Kind::Cancelled, room)),
        Some(late) => {
            if let Some(ms) = late {
                let mut e = decode(verdict + ms * MS, Stage::Decode, Kind::Rejected, room);
                e.status = Some(500);
                out.push(e);
            }
            expected.insert(("orphaned-leg".to_string(), room));
        }
    }
    let retried = plan.status == 503;
    if let Some((adv, ms)) = plan.advance {
        let t = verdict + ms * MS;
        let e = match adv {
            Advance::DecodeAdmitted => decode(t, Stage::Decode, Kind::Admitted, room),
            Advance::DecodeWork => decode(t, Stage::Decode, Kind::Work, room),
            Advance::DecodeSucceeded => {
                decode(t, Stage::Decode, Kind::Completed, room).with_status(200)
            }
            Advance::KvMoved => decode(t, Stage::Transfer, Kind::Work, room),
            Advance::KvArrived => decode(t, Stage::Transfer, Kind::Completed, room),
        };
        out.push(e);
        expected.insert(("activity-after-rejection".to_string(), room));
        if !retried {
            expected.insert(("activity-after-request-failed".to_string(), room));
        }
        // A decode success ends the leg: it may be what ends it within the window, which
        // counts decode's clock (another node's) up to the skew past the deadline.
        let reported_us = (ms * 1_000) as i64 + plan.decode_clock_us;
        let deadline_us = ((DECODE_WINDOW_MS * MS + SKEW.as_nanos() as u64) / US) as i64;
        if matches!(adv, Advance::DecodeSucceeded) && reported_us <= deadline_us {
            expected.remove(&("orphaned-leg".to_string(), room));
        }
    }
    if let Some(ms) = plan.late_handoff_ms {
        out.push(dispatch(verdict + ms * MS, Stage::Decode, room));
        expected.insert(("handoff-after-rejection".to_string(), room));
    }
    let answered = verdict + 200 * US;
    if retried {
        // The retry: a new room, the whole way through, on the same request.
        let r2 = room + 1;
        let t = verdict + 50 * MS;
        out.push(dispatch(t, Stage::Prefill, r2));
        out.push(dispatch(t, Stage::Decode, r2));
        out.push(prefill(t + 100 * US, Kind::Received, r2));
        out.push(decode(t + 200 * US, Stage::Decode, Kind::Received, r2));
        out.push(decode(t + 400 * US, Stage::Transfer, Kind::Received, r2));
        out.push(prefill(t + 2 * MS, Kind::Admitted, r2));
        out.push(prefill(t + 5 * MS, Kind::Work, r2));
        out.push(decode(t + 6 * MS, Stage::Transfer, Kind::Work, r2));
        out.push(decode(t + 8 * MS, Stage::Transfer, Kind::Completed, r2));
        out.push(prefill(t + 8 * MS, Kind::Completed, r2).with_status(200));
        out.push(decode(t + 9 * MS, Stage::Decode, Kind::Admitted, r2));
        out.push(decode(t + 10 * MS, Stage::Decode, Kind::Work, r2));
        out.push(decode(t + 40 * MS, Stage::Decode, Kind::Completed, r2).with_status(200));
        out.push(router(t + 41 * MS, Kind::Completed).with_status(200));
    } else {
        out.push(router(answered, Kind::Completed).with_status(plan.status));
    }
    (out, expected)
}

fn verdicts(events: &[LifecycleEvent]) -> BTreeSet<(String, u64)> {
    let cfg = CheckerConfig {
        clock_skew: SKEW,
        allowed_lateness: SKEW,
        ..CheckerConfig::default()
    };
    let mut c = Checker::new(RuleSet::embedded_defaults(), cfg);
    let mut out = Vec::new();
    for e in events {
        out.extend(c.observe(e));
    }
    // Far enough for every cancellation window to be judged (not stuck-attempt's 330 s).
    let end = c.stats().max_event_ns + 10_000 * MS;
    out.extend(c.tick(end));
    out.into_iter()
        .map(|v| {
            let room = v
                .attempt
                .bootstrap_room
                .unwrap_or_else(|| panic!("a violation without its room: {v:?}"));
            (v.rule, room)
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn only_advancement_or_an_outlived_window_alerts(
        plans in prop::collection::vec(arb_plan(), 1..12),
        jitter in prop::collection::vec(0..=SKEW.as_nanos() as u64, 64),
    ) {
        let mut events = Vec::new();
        let mut expected = BTreeSet::new();
        for (i, p) in plans.iter().enumerate() {
            let (e, x) = request(i as u64, p);
            events.extend(e);
            expected.extend(x);
        }
        // Exporters deliver a little late and out of order: arrival = time + up to the skew.
        let mut arrivals: Vec<(u64, usize)> = events
            .iter()
            .enumerate()
            .map(|(i, e)| (e.time_ns + jitter[i % jitter.len()], i))
            .collect();
        arrivals.sort();
        let arrived: Vec<LifecycleEvent> =
            arrivals.into_iter().map(|(_, i)| events[i].clone()).collect();
        prop_assert_eq!(verdicts(&arrived), expected, "{:#?}", plans);
    }
}
