//! Engine tests that need its internals; scenario files and property tests live in `monitor/tests`.

use std::time::Duration;

use super::deadlines::MIN_TIMER_PURGE;
use super::{Checker, CheckerConfig, RuleSet};
use crate::engine::rules::MAX_TOMBSTONE_RULES;
use crate::event::{Kind, LifecycleEvent, Source, Stage};
use crate::violation::Violation;

const MS: u64 = 1_000_000;
const S: u64 = 1_000_000_000;

fn ev(t: u64, stage: Stage, kind: Kind) -> LifecycleEvent {
    LifecycleEvent::new(t, stage, kind, Source::Otlp)
}

/// As many attempt-scope never-after rules as a rule file may hold fit a tombstone's fired bits.
#[test]
fn the_most_tombstone_rules_a_file_may_hold_build_a_checker() {
    let mut y = String::from("rules:\n");
    // The defaults already hold some attempt-scope never_after rules.
    for i in 0..MAX_TOMBSTONE_RULES - RuleSet::embedded_defaults().tombstone_rules() {
        y.push_str(&format!(
            "  - name: na-{i}\n    description: d\n    severity: info\n    never_after: {{trigger: [{{kind: [rejected]}}], forbidden: [{{kind: [work]}}]}}\n"
        ));
    }
    let mut set = RuleSet::embedded_defaults();
    set.apply_yaml(&y, "ok.yaml").unwrap();
    let _ = Checker::new(set, CheckerConfig::default());
}

/// One attempt whose legs carry different rids (prefill's and decode's), ended at `t`.
fn two_rid_attempt(c: &mut Checker, t: u64, room: u64, n: u64) {
    let (pr, dr) = (format!("p-{n}"), format!("d-{n}"));
    c.observe(
        &ev(t, Stage::Prefill, Kind::Admitted)
            .with_room(room)
            .with_rid(pr.as_str()),
    );
    c.observe(
        &ev(t + MS, Stage::Decode, Kind::Admitted)
            .with_room(room)
            .with_rid(dr.as_str()),
    );
    c.observe(
        &ev(t + 2 * MS, Stage::Prefill, Kind::Completed)
            .with_room(room)
            .with_status(200),
    );
    c.observe(
        &ev(t + 3 * MS, Stage::Decode, Kind::Completed)
            .with_room(room)
            .with_status(200),
    );
}

/// A request kept solo in its only attempt (no record) still catches everything a record
/// would: a router failure that names the attempt's room arrives after the activity it
/// precedes, and an attempt-scope violation names the request id.
#[test]
fn solo_requests_judge_like_recorded_ones() {
    let mut c = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
    let t = 1_795_986_920 * S;
    let mut all = Vec::new();
    all.extend(
        c.observe(
            &ev(t, Stage::Router, Kind::Dispatched)
                .with_request_id("req-solo")
                .with_room(7)
                .with_to(Stage::Decode),
        ),
    );
    all.extend(c.observe(&ev(t + 5 * MS, Stage::Decode, Kind::Work).with_room(7)));
    assert_eq!(c.stats().correlate.requests_materialized, 0, "still solo");
    assert!(all.is_empty());
    // The router failed the request at t + 2 ms; it names the room, and comes late.
    let v = c.observe(
        &ev(t + 2 * MS, Stage::Router, Kind::Rejected)
            .with_room(7)
            .with_status(503),
    );
    let of_rule = |rule: &str| v.iter().filter(|v| v.rule == rule).collect::<Vec<_>>();
    let failed = of_rule("activity-after-request-failed");
    assert_eq!(failed.len(), 1, "{v:?}");
    assert_eq!(failed[0].request.request_id.as_deref(), Some("req-solo"));
    // The attempt's own rejection rule fires too, and names the request.
    let rej = of_rule("activity-after-rejection");
    assert_eq!(rej.len(), 1, "{v:?}");
    assert_eq!(rej[0].request.request_id.as_deref(), Some("req-solo"));
    assert_eq!(c.stats().correlate.requests_materialized, 1);

    // A second solo request: an attempt-scope violation alone gives it a record, with its id.
    c.observe(
        &ev(t, Stage::Router, Kind::Dispatched)
            .with_request_id("req-two")
            .with_room(8)
            .with_to(Stage::Prefill),
    );
    c.observe(
        &ev(t + MS, Stage::Prefill, Kind::Rejected)
            .with_room(8)
            .with_status(400),
    );
    let v = c.observe(&ev(t + 3 * MS, Stage::Decode, Kind::Work).with_room(8));
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].rule, "activity-after-rejection");
    assert_eq!(v[0].request.request_id.as_deref(), Some("req-two"));
}

/// Slots are packed against a per-row base with a 9-minute window: an attempt whose events
/// span more, or a late event on a tombstone that long after, keeps exact times and verdicts.
#[test]
fn slots_past_the_packed_window_keep_exact_times() {
    let mut c = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
    let aar = |v: &[Violation]| {
        v.iter()
            .filter(|v| v.rule == "activity-after-rejection")
            .cloned()
            .collect::<Vec<_>>()
    };
    let t0 = 1_795_986_920 * S;
    // A long attempt: admitted, streaming for ten minutes, then rejected and still worked on.
    for (dt, stage, kind) in [
        (0, Stage::Prefill, Kind::Admitted),
        (4 * 60 * S, Stage::Decode, Kind::Work),
        (8 * 60 * S, Stage::Decode, Kind::Work),
    ] {
        assert!(aar(&c.observe(&ev(t0 + dt, stage, kind).with_room(7))).is_empty());
    }
    let rejected = t0 + 10 * 60 * S;
    let v = c.observe(
        &ev(rejected, Stage::Prefill, Kind::Rejected)
            .with_room(7)
            .with_status(400),
    );
    assert!(aar(&v).is_empty());
    assert!(c.stats().wide_slot_rows >= 1, "{:?}", c.stats());
    let v = aar(&c.observe(&ev(rejected + 1, Stage::Decode, Kind::Work).with_room(7)));
    assert_eq!(v.len(), 1);
    let times: Vec<u64> = v[0].evidence.iter().map(|e| e.time_ns).collect();
    assert_eq!(times, vec![rejected, rejected + 1]);

    // A short rejected attempt, compacted; its decode leg reports work 9.5 minutes later.
    let t1 = t0 + 20 * 60 * S;
    for e in [
        ev(t1, Stage::Decode, Kind::Received).with_room(8),
        ev(t1 + MS, Stage::Prefill, Kind::Rejected)
            .with_room(8)
            .with_status(400),
        ev(t1 + 2 * MS, Stage::Decode, Kind::Cancelled).with_room(8),
    ] {
        assert!(aar(&c.observe(&e)).is_empty());
    }
    c.tick(t1 + 30 * S);
    assert!(c.stats().tombstones >= 1);
    let late = t1 + 570 * S;
    let v = aar(&c.observe(&ev(late, Stage::Decode, Kind::Work).with_room(8)));
    assert_eq!(v.len(), 1, "late activity on the tombstone");
    let times: Vec<u64> = v[0].evidence.iter().map(|e| e.time_ns).collect();
    assert_eq!(times, vec![t1 + MS, late]);
    assert!(aar(&c.observe(&ev(late + S, Stage::Decode, Kind::Work).with_room(8))).is_empty());
}

/// A tombstone stores only its set slots; a late event that sets an empty one (here the
/// rejection, reported after the attempt was compacted) still proves the breach, once.
#[test]
fn a_late_trigger_on_a_tombstone_sets_its_empty_slot() {
    let mut c = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
    let aar = |v: Vec<Violation>| {
        v.into_iter()
            .filter(|v| v.rule == "activity-after-rejection")
            .count()
    };
    let t = 1_795_986_920 * S;
    for (dt, stage, kind) in [
        (0, Stage::Decode, Kind::Received),
        (5 * MS, Stage::Decode, Kind::Work),
        (6 * MS, Stage::Decode, Kind::Completed),
    ] {
        assert_eq!(aar(c.observe(&ev(t + dt, stage, kind).with_room(9))), 0);
    }
    c.tick(t + 30 * S);
    assert_eq!((c.stats().live_attempts, c.stats().tombstones), (0, 1));
    let late_rejection = ev(t + MS, Stage::Prefill, Kind::Rejected)
        .with_room(9)
        .with_status(400);
    assert_eq!(
        aar(c.observe(&late_rejection)),
        1,
        "work at +5 ms followed it"
    );
    assert_eq!(c.stats().wide_slot_rows, 1, "the row grew: kept aside");
    assert_eq!(
        aar(c.observe(&ev(t + 7 * MS, Stage::Decode, Kind::Work).with_room(9))),
        0
    );
    // Expiry drops the tombstone and its wide row.
    c.tick(t + 900 * S);
    assert_eq!((c.stats().tombstones, c.stats().wide_slot_rows), (0, 0));
}

/// Every rid an attempt was seen with leaves the alias table with it: otherwise the next
/// attempt reusing its record inherits the rid (a late event of the old attempt is blamed on
/// the new one) and the table grows by one entry per attempt, forever.
#[test]
fn an_attempts_second_rid_leaves_with_it() {
    let mut c = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
    let t0 = 1_000 * S;
    two_rid_attempt(&mut c, t0, 1, 0);
    c.tick(t0 + 10 * S);
    assert_eq!(c.stats().live_attempts, 0, "attempt compacted");
    // A new attempt takes the freed record and is rejected.
    c.observe(
        &ev(t0 + 11 * S, Stage::Prefill, Kind::Rejected)
            .with_room(2)
            .with_rid("p-1")
            .with_status(400),
    );
    // A late report of the first attempt's decode work, named by its rid only.
    let v = c.observe(&ev(t0 + 12 * S, Stage::Decode, Kind::Work).with_rid("d-0"));
    assert!(v.is_empty(), "blamed on the wrong attempt: {v:?}");
}

#[test]
fn settled_deadlines_do_not_pile_up() {
    let mut c = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
    // One attempt every 100 µs, each running 500 ms: when its first deadline is judged
    // (the watermark passes its admission) it has not ended, so stuck-attempt's deadline
    // (admitted + 330 s) is queued; then it ends. Over 5 s only the last ~1.5 s of attempts
    // are live, but without purging every attempt's entry would stay queued for 330 s.
    let t0 = 1_000 * S;
    let mut events = Vec::new();
    for n in 0..50_000u64 {
        let t = t0 + n * 100_000;
        let room = 100 + n;
        events.extend([
            ev(t, Stage::Prefill, Kind::Admitted).with_room(room),
            ev(t + MS, Stage::Decode, Kind::Admitted).with_room(room),
            ev(t + 400 * MS, Stage::Prefill, Kind::Completed).with_room(room),
            ev(t + 500 * MS, Stage::Decode, Kind::Completed).with_room(room),
        ]);
    }
    events.sort_by_key(|e| e.time_ns);
    for e in &events {
        c.observe(e);
    }
    let s = c.stats();
    assert!(
        s.live_attempts < 25_000,
        "attempts are compacted as they end"
    );
    assert!(
        c.deadline_entries() <= 2 * s.live_attempts as usize + MIN_TIMER_PURGE,
        "{} queued deadlines for {} live attempts",
        c.deadline_entries(),
        s.live_attempts
    );
}

/// The default rules, with tombstones and idle requests kept 5 s: tests of what is left
/// once everything expired.
fn short_retention_checker() -> Checker {
    let cfg = CheckerConfig {
        retention: Duration::from_secs(5),
        ..CheckerConfig::default()
    };
    Checker::new(RuleSet::embedded_defaults(), cfg)
}

/// A request seen with two trace ids: both aliases leave when the request is forgotten,
/// and the request shows its first ids.
#[test]
fn a_requests_second_trace_id_leaves_with_it() {
    let mut c = short_retention_checker();
    let t0 = 1_000 * S;
    for n in 0..3_000u64 {
        let t = t0 + n * MS;
        let (id, t1, t2) = (format!("req-{n}"), format!("a-{n}"), format!("b-{n}"));
        c.observe(
            &ev(t, Stage::Router, Kind::Dispatched)
                .with_room(100 + n)
                .with_request_id(id.as_str())
                .with_trace_id(t1.as_str()),
        );
        c.observe(
            &ev(t + 1, Stage::Router, Kind::Completed)
                .with_room(100 + n)
                .with_request_id(id.as_str())
                .with_trace_id(t2.as_str())
                .with_status(500),
        );
        // The router failed the request; activity afterwards names its second trace only.
        let v = c.observe(&ev(t + 2, Stage::Decode, Kind::Work).with_trace_id(t2.as_str()));
        if n == 0 {
            assert_eq!(v.len(), 0, "request-level work is no attempt's activity");
        }
    }
    let s = c.stats();
    assert_eq!(
        s.correlate.requests_created, 6_000,
        "one stub per second trace id"
    );
    assert_eq!(s.live_requests, 6_000);
    for k in 1..=30 {
        c.tick(t0 + 10 * S + k * S);
    }
    let s = c.stats();
    assert_eq!((s.live_attempts, s.tombstones, s.live_requests), (0, 0, 0));
    assert!(
        c.alias_entries() <= 1024,
        "stale aliases: {}",
        c.alias_entries()
    );
}

#[test]
fn alias_table_is_bounded_by_what_is_live() {
    let mut c = short_retention_checker();
    let t0 = 1_000 * S;
    for n in 0..5_000u64 {
        two_rid_attempt(&mut c, t0 + n * MS, 100 + n, n);
    }
    // Past linger and retention: every attempt compacted, every tombstone expired.
    for k in 1..=20 {
        c.tick(t0 + 10 * S + k * S);
    }
    let s = c.stats();
    assert_eq!((s.live_attempts, s.tombstones), (0, 0));
    // Aliases of dropped tombstones are purged in bulk, once more than 1024 are stale.
    assert!(
        c.alias_entries() <= 1024,
        "stale aliases left behind: {}",
        c.alias_entries()
    );
}

/// A tick at the end of time (a clock gone wrong) retires attempts without overflowing.
#[test]
fn a_tick_near_the_end_of_time_does_not_overflow() {
    let mut c = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
    c.observe(&ev(S, Stage::Prefill, Kind::Rejected).with_rid("r-1"));
    c.observe(&ev(S + MS, Stage::Decode, Kind::Completed).with_rid("r-1"));
    let _ = c.tick(u64::MAX / 2);
    let _ = c.tick(u64::MAX);
}

/// Attempts that never end, past the cap a budget derives: the live count stays at the cap and
/// every attempt beyond it is an eviction counted as such.
#[test]
fn never_ending_attempts_past_the_budget_cap_are_evicted_and_counted() {
    use super::BudgetCaps;
    let (attempt_bytes, tomb_bytes) = (4 << 20, 2 << 20);
    let caps = BudgetCaps::from_shares(attempt_bytes, tomb_bytes);
    // Each live attempt is charged with as many request records.
    assert_eq!(
        caps.max_attempts as u64,
        attempt_bytes / super::BYTES_PER_ATTEMPT_AND_REQUEST
    );
    assert_eq!(caps.max_requests, caps.max_attempts);
    let full = BudgetCaps::estimate(caps.max_attempts as u64, caps.max_requests as u64, 0);
    assert!(full <= attempt_bytes);
    assert!(BudgetCaps::estimate(0, 0, caps.max_tombstones as u64) <= tomb_bytes);
    let cfg = CheckerConfig {
        max_attempts: caps.max_attempts,
        max_tombstones: caps.max_tombstones,
        ..CheckerConfig::default()
    };
    let mut c = Checker::new(RuleSet::embedded_defaults(), cfg);
    let n = caps.max_attempts as u64 + 1000;
    let t0 = 1_000 * S;
    for i in 0..n {
        // Admitted and never completed, 10 µs apart: far inside the idle TTL.
        c.observe(&ev(t0 + i * 10_000, Stage::Prefill, Kind::Admitted).with_room(1 + i));
    }
    let s = c.stats();
    assert_eq!(s.live_attempts as usize, caps.max_attempts);
    assert_eq!(s.correlate.evicted_cap, 1000);
    // An evicted attempt's deadline is not judged: a later tick past `stuck-attempt`'s 330 s
    // proves nothing about attempts the cap pushed out, only about the ones still tracked.
    let stuck = c.tick(t0 + 400 * S);
    assert!(stuck.iter().all(|v| v.rule == "stuck-attempt"), "{stuck:?}");
    assert_eq!(
        stuck.len(),
        caps.max_attempts,
        "one finding per tracked attempt, none for the evicted"
    );
}

/// Router-level events for requests no attempt ever names: each gets a request record, and past
/// `max_requests` the records nothing holds are freed (counted) while held ones stay.
#[test]
fn request_records_past_their_cap_are_freed_and_counted() {
    let cfg = CheckerConfig {
        max_requests: 500,
        ..CheckerConfig::default()
    };
    let mut c = Checker::new(RuleSet::embedded_defaults(), cfg);
    let t0 = 1_000 * S;
    // One request with an attempt: its record is held and must survive the cap.
    c.observe(&ev(t0, Stage::Router, Kind::Received).with_request_id("held"));
    c.observe(
        &ev(t0 + MS, Stage::Router, Kind::Dispatched)
            .with_request_id("held")
            .with_room(7),
    );
    c.observe(
        &ev(t0 + 2 * MS, Stage::Router, Kind::Dispatched)
            .with_request_id("held")
            .with_room(8),
    );
    for i in 0..2_000u64 {
        c.observe(
            &ev(t0 + 3 * MS + i * 10_000, Stage::Router, Kind::Received)
                .with_request_id(format!("bare-{i}")),
        );
    }
    let s = c.stats();
    assert!(s.request_records <= 500, "{} records", s.request_records);
    assert!(
        s.correlate.requests_evicted_cap >= 1_500,
        "{} evicted",
        s.correlate.requests_evicted_cap
    );
    // The held request still fails as one: its router rejection reaches both attempts.
    c.observe(&ev(t0 + 3 * S, Stage::Router, Kind::Rejected).with_request_id("held"));
    let v = c.observe(&ev(t0 + 4 * S, Stage::Decode, Kind::Admitted).with_room(8));
    assert!(
        v.iter().any(|v| v.rule == "activity-after-request-failed"),
        "{v:?}"
    );
}

#[test]
fn zero_shares_still_give_one_of_each() {
    use super::BudgetCaps;
    assert_eq!(
        BudgetCaps::from_shares(0, 0),
        BudgetCaps {
            max_attempts: 1,
            max_tombstones: 1,
            max_requests: 1,
        }
    );
}

/// Two client requests on one room: caught once, whichever arrives first, with both ids in the
/// summary and one fingerprint. One request on two rooms (a retry) and one request on both legs
/// of a room stay silent; without a distinct rule nothing is judged.
#[test]
fn room_collisions_are_caught_once_whichever_request_arrives_first() {
    let t = 1_795_986_920 * S;
    let leg = |dt: u64, stage: Stage, kind: Kind, req: &str, room: u64| {
        LifecycleEvent::new(t + dt, stage, kind, Source::Ebpf)
            .with_request_id(req)
            .with_room(room)
    };
    let colliding = vec![
        leg(0, Stage::Router, Kind::Dispatched, "req-a", 9).with_to(Stage::Prefill),
        leg(MS, Stage::Prefill, Kind::Received, "req-a", 9),
        leg(2 * MS, Stage::Router, Kind::Dispatched, "req-b", 9).with_to(Stage::Prefill),
        leg(3 * MS, Stage::Prefill, Kind::Received, "req-b", 9),
        leg(4 * MS, Stage::Decode, Kind::Received, "req-b", 9),
        leg(6 * MS, Stage::Decode, Kind::Work, "req-a", 9),
        leg(7 * MS, Stage::Decode, Kind::Completed, "req-a", 9).with_status(200),
    ];
    let run = |events: &[LifecycleEvent]| {
        let mut c = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
        let mut out: Vec<Violation> = events.iter().flat_map(|e| c.observe(e)).collect();
        out.extend(c.tick(t + 60 * S));
        out
    };
    let v = run(&colliding);
    assert_eq!(v.len(), 1, "{v:#?}");
    assert_eq!(v[0].rule, "room-collision");
    assert_eq!(v[0].attempt.bootstrap_room, Some(9));
    assert!(
        v[0].summary.contains("request_id req-a and req-b"),
        "{}",
        v[0].summary
    );
    // The other arrival order: the same finding, the same fingerprint.
    let mut reversed = colliding.clone();
    reversed.swap(0, 2);
    reversed.swap(1, 3);
    let w = run(&reversed);
    assert_eq!(w.len(), 1, "{w:#?}");
    assert_eq!(
        (&w[0].rule, &w[0].fingerprint, &w[0].summary),
        (&v[0].rule, &v[0].fingerprint, &v[0].summary)
    );

    // One request retried on a new room, both legs of each room under its id: silent.
    let clean = vec![
        leg(0, Stage::Router, Kind::Dispatched, "req-c", 10).with_to(Stage::Prefill),
        leg(MS, Stage::Prefill, Kind::Rejected, "req-c", 10).with_status(503),
        leg(2 * MS, Stage::Decode, Kind::Cancelled, "req-c", 10),
        leg(3 * MS, Stage::Router, Kind::Dispatched, "req-c", 11).with_to(Stage::Prefill),
        leg(4 * MS, Stage::Prefill, Kind::Admitted, "req-c", 11),
        leg(5 * MS, Stage::Decode, Kind::Work, "req-c", 11),
        leg(6 * MS, Stage::Prefill, Kind::Completed, "req-c", 11).with_status(200),
        leg(7 * MS, Stage::Decode, Kind::Completed, "req-c", 11).with_status(200),
    ];
    let v = run(&clean);
    assert!(v.is_empty(), "{v:#?}");

    // A room reused after its attempt was compacted: its tombstone names the first request.
    let mut c = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
    let first = [
        leg(0, Stage::Prefill, Kind::Admitted, "req-d", 12),
        leg(MS, Stage::Prefill, Kind::Completed, "req-d", 12).with_status(200),
    ];
    let mut v: Vec<Violation> = first.iter().flat_map(|e| c.observe(e)).collect();
    v.extend(c.tick(t + 20 * S));
    assert_eq!(c.store.tombstones(), 1, "compacted");
    for dt in [21 * S, 22 * S] {
        v.extend(c.observe(&leg(dt, Stage::Prefill, Kind::Received, "req-e", 12)));
    }
    assert_eq!(v.len(), 1, "{v:#?}");
    assert!(
        v[0].summary.contains("request_id req-d and req-e"),
        "{}",
        v[0].summary
    );

    // The second request's attempt first seen by its rid alone (a worker's span), then named
    // with the room: the event merges the two attempts, and the collision is still one finding,
    // whether the room's attempt is live or compacted.
    for compacted in [false, true] {
        let mut c = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
        let mut v: Vec<Violation> = Vec::new();
        v.extend(c.observe(&leg(0, Stage::Prefill, Kind::Admitted, "req-f", 13)));
        let mut later = 2 * MS;
        if compacted {
            v.extend(c.observe(&leg(MS, Stage::Prefill, Kind::Completed, "req-f", 13)));
            v.extend(c.tick(t + 20 * S));
            assert_eq!(c.store.tombstones(), 1, "compacted");
            later = 21 * S;
        }
        let mut by_rid =
            LifecycleEvent::new(t + later, Stage::Prefill, Kind::Received, Source::Otlp)
                .with_request_id("req-g");
        by_rid.ids.rid = Some("rid-g".into());
        v.extend(c.observe(&by_rid));
        let mut both = leg(later + MS, Stage::Prefill, Kind::Admitted, "req-g", 13);
        both.ids.rid = Some("rid-g".into());
        v.extend(c.observe(&both));
        // Each of the second request's events names its rid too (a leg's body carries both).
        let mut decode = leg(later + 2 * MS, Stage::Decode, Kind::Received, "req-g", 13);
        decode.ids.rid = Some("rid-g".into());
        v.extend(c.observe(&decode));
        let collisions: Vec<_> = v.iter().filter(|v| v.rule == "room-collision").collect();
        assert_eq!(collisions.len(), 1, "compacted {compacted}: {v:#?}");
        assert!(
            collisions[0].summary.contains("request_id req-f and req-g"),
            "{}",
            collisions[0].summary
        );
    }

    // Without a distinct rule, no collision is judged.
    let mut set = RuleSet::embedded_defaults();
    set.apply_yaml(
        "rules:\n  - name: room-collision\n    enabled: false\n",
        "off.yaml",
    )
    .unwrap();
    let mut c = Checker::new(set, CheckerConfig::default());
    let v: Vec<Violation> = colliding.iter().flat_map(|e| c.observe(e)).collect();
    assert!(v.iter().all(|v| v.rule != "room-collision"), "{v:#?}");
}

/// A room reused by a second request whose own ids reach the engine before any event naming
/// its room with its x-request-id: the router's span (x-request-id and trace id, no room), then
/// a worker's span (its rid, the room and the trace id, no x-request-id), and only then the
/// wire's legs (the eBPF reader behind on a loaded node, well within the allowed lateness). The
/// worker's span joins the two requests through the room: that join is the collision, caught
/// once, with the same summary as when the wire comes first, and the wire's legs corroborate
/// it once; a leg of the same request on its own room, named the same ways, stays silent.
#[test]
fn a_room_collision_revealed_by_a_join_through_the_room_is_caught_once() {
    let t = 1_795_986_925 * S;
    let cfg = CheckerConfig {
        allowed_lateness: Duration::from_secs(15),
        ..CheckerConfig::default()
    };
    let wire = |dt: u64, stage: Stage, kind: Kind, req: &str, tr: &str, room: u64| {
        LifecycleEvent::new(t + dt, stage, kind, Source::Ebpf)
            .with_request_id(req)
            .with_trace_id(tr)
            .with_room(room)
    };
    let router_span = |dt: u64, kind: Kind, req: &str, tr: &str| {
        ev(t + dt, Stage::Router, kind)
            .with_request_id(req)
            .with_trace_id(tr)
    };
    let worker_span = |dt: u64, stage: Stage, kind: Kind, rid: &str, tr: &str, room: u64| {
        ev(t + dt, stage, kind)
            .with_rid(rid)
            .with_trace_id(tr)
            .with_room(room)
    };
    let (ta, tb) = (
        "0af7651916cd43dd8448eb211c80319c",
        "4bf92f3577b34da6a3ce929d0e0e4736",
    );
    let first = |room: u64| {
        vec![
            wire(0, Stage::Router, Kind::Dispatched, "req-a", ta, room).with_to(Stage::Prefill),
            wire(100_000, Stage::Prefill, Kind::Received, "req-a", ta, room),
            wire(MS, Stage::Prefill, Kind::Completed, "req-a", ta, room).with_status(200),
            wire(MS, Stage::Router, Kind::Dispatched, "req-a", ta, room).with_to(Stage::Decode),
            wire(MS, Stage::Decode, Kind::Received, "req-a", ta, room),
            wire(
                3 * MS / 2,
                Stage::Decode,
                Kind::Completed,
                "req-a",
                ta,
                room,
            )
            .with_status(200),
        ]
    };
    let second = |room: u64| {
        let b = 132 * MS;
        vec![
            router_span(b, Kind::Received, "req-b", tb),
            router_span(b, Kind::Dispatched, "req-b", tb).with_to(Stage::Prefill),
            worker_span(b, Stage::Prefill, Kind::Received, "b-p", tb, room),
            worker_span(b + MS, Stage::Prefill, Kind::Completed, "b-p", tb, room),
            wire(b, Stage::Router, Kind::Dispatched, "req-b", tb, room).with_to(Stage::Prefill),
            wire(b, Stage::Prefill, Kind::Received, "req-b", tb, room),
            wire(b + MS, Stage::Prefill, Kind::Completed, "req-b", tb, room).with_status(200),
            wire(b + MS, Stage::Decode, Kind::Received, "req-b", tb, room),
            wire(
                b + 2 * MS,
                Stage::Decode,
                Kind::Completed,
                "req-b",
                tb,
                room,
            )
            .with_status(200),
        ]
    };
    let run = |events: &[LifecycleEvent]| {
        let mut c = Checker::new(RuleSet::embedded_defaults(), cfg.clone());
        let mut out: Vec<Violation> = events.iter().flat_map(|e| c.observe(e)).collect();
        out.extend(c.tick(t + 60 * S));
        out
    };
    let mut late_wire = first(21);
    late_wire.extend(second(21));
    let v = run(&late_wire);
    let (collisions, follow_ups): (Vec<_>, Vec<_>) = v
        .iter()
        .filter(|v| v.rule == "room-collision")
        .partition(|v| !v.corroborates);
    assert_eq!(collisions.len(), 1, "{v:#?}");
    assert_eq!(collisions[0].evidence[0].source, Source::Otlp);
    // The wire's legs of the second request come later and show it again: one follow-up, from
    // the witness that had not reported it (the one a notification held for corroboration waits
    // for).
    assert_eq!(follow_ups.len(), 1, "{v:#?}");
    assert_eq!(
        follow_ups[0]
            .evidence
            .iter()
            .map(|e| e.source)
            .collect::<Vec<_>>(),
        [Source::Ebpf]
    );
    assert_eq!(follow_ups[0].attempt, collisions[0].attempt);
    assert_eq!(collisions[0].attempt.bootstrap_room, Some(21));
    assert!(
        collisions[0].summary.contains("request_id req-a and req-b"),
        "{}",
        collisions[0].summary
    );
    // The wire first, as usual: the same finding (seen by the wire, not the span).
    let mut wire_first = first(21);
    let mut b = second(21);
    b.rotate_left(4);
    wire_first.extend(b);
    let w = run(&wire_first);
    let same: Vec<_> = w.iter().filter(|v| v.rule == "room-collision").collect();
    assert_eq!(same.len(), 1, "{w:#?}");
    assert_eq!(same[0].fingerprint, collisions[0].fingerprint);
    assert!(
        same[0].summary.contains("request_id req-a and req-b"),
        "{}",
        same[0].summary
    );
    // The second request on a room of its own: nothing.
    let mut apart = first(21);
    apart.extend(second(22));
    let v = run(&apart);
    assert!(v.iter().all(|v| v.rule != "room-collision"), "{v:#?}");
}

/// An OpenTelemetry-instrumented client sends two LLM requests under one trace: the router
/// continues its traceparent to the workers, so both requests' legs and spans carry the same
/// trace id, each with its own x-request-id and room. Two requests sharing a trace are not one
/// request, and not a room collision: the default rules stay silent.
#[test]
fn two_requests_sharing_one_trace_raise_nothing() {
    let t = 1_795_986_960 * S;
    let cfg = CheckerConfig {
        allowed_lateness: Duration::from_secs(15),
        ..CheckerConfig::default()
    };
    let trace = "0af7651916cd43dd8448eb211c80319c";
    let wire = |dt: u64, stage: Stage, kind: Kind, req: &str, room: u64| {
        LifecycleEvent::new(t + dt, stage, kind, Source::Ebpf)
            .with_request_id(req)
            .with_trace_id(trace)
            .with_room(room)
    };
    let worker_span = |dt: u64, stage: Stage, kind: Kind, rid: &str, room: u64| {
        ev(t + dt, stage, kind)
            .with_rid(rid)
            .with_trace_id(trace)
            .with_room(room)
    };
    let request = |b: u64, req: &str, rid: &str, room: u64| {
        vec![
            wire(b, Stage::Router, Kind::Dispatched, req, room).with_to(Stage::Prefill),
            wire(b + 100_000, Stage::Prefill, Kind::Received, req, room),
            wire(b + MS, Stage::Prefill, Kind::Completed, req, room).with_status(200),
            wire(b + MS, Stage::Router, Kind::Dispatched, req, room).with_to(Stage::Decode),
            wire(b + MS, Stage::Decode, Kind::Received, req, room),
            wire(b + 3 * MS / 2, Stage::Decode, Kind::Completed, req, room).with_status(200),
            worker_span(b + 100_000, Stage::Prefill, Kind::Received, rid, room),
            worker_span(b + MS, Stage::Prefill, Kind::Completed, rid, room),
        ]
    };
    let run = |events: &[LifecycleEvent]| {
        let mut c = Checker::new(RuleSet::embedded_defaults(), cfg.clone());
        let mut out: Vec<Violation> = events.iter().flat_map(|e| c.observe(e)).collect();
        out.extend(c.tick(t + 60 * S));
        out
    };
    // One after the other, then interleaved.
    let mut apart = request(0, "req-a", "a-p", 31);
    apart.extend(request(5 * MS, "req-b", "b-p", 32));
    let v = run(&apart);
    assert!(v.is_empty(), "{v:#?}");
    let (a, b) = (
        request(0, "req-a", "a-p", 31),
        request(MS / 2, "req-b", "b-p", 32),
    );
    let mut mixed: Vec<LifecycleEvent> = a.into_iter().zip(b).flat_map(|(x, y)| [x, y]).collect();
    mixed.sort_by_key(|e| e.time_ns);
    let v = run(&mixed);
    assert!(v.is_empty(), "{v:#?}");
}

/// A request known by its x-request-id alone (the router received it), then an attempt known by
/// its trace id alone (a worker's span), then an event naming all three: joining what the names
/// found gives the attempt's solo request a record, and the attempt is linked to it once (no
/// second materialization of a request that is no longer solo).
#[test]
fn names_joined_before_the_attempt_link_are_materialized_once() {
    let mut c = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
    let t = 1_795_986_940 * S;
    let trace = "000000000000000000000000000000c1";
    c.observe(&ev(t, Stage::Router, Kind::Received).with_request_id("rc-c"));
    c.observe(
        &ev(t + 500_000, Stage::Prefill, Kind::Admitted)
            .with_trace_id(trace)
            .with_room(7302),
    );
    let v = c.observe(
        &ev(t + 100_000, Stage::Router, Kind::Dispatched)
            .with_request_id("rc-c")
            .with_trace_id(trace)
            .with_room(7302)
            .with_to(Stage::Decode),
    );
    assert!(v.is_empty(), "{v:#?}");
    assert_eq!(c.stats().correlate.requests_merged, 1);
}

/// Skew and lateness of 50 ms (the order property's), so the 1 s linger is what compacts.
fn fifty_ms() -> CheckerConfig {
    CheckerConfig {
        clock_skew: Duration::from_millis(50),
        allowed_lateness: Duration::from_millis(50),
        ..CheckerConfig::default()
    }
}

/// The (rule, room) of every verdict `events` give in this order, once every deadline passed.
fn verdicts(events: &[LifecycleEvent]) -> Vec<(String, Option<u64>)> {
    let mut c = Checker::new(RuleSet::embedded_defaults(), fifty_ms());
    let mut out: Vec<Violation> = events.iter().flat_map(|e| c.observe(e)).collect();
    out.extend(c.tick(c.stats().max_event_ns + 60 * S));
    let mut v: Vec<_> = out
        .into_iter()
        .map(|v| (v.rule, v.attempt.bootstrap_room))
        .collect();
    v.sort();
    v
}

/// An event of room `room` at `t + dt`, seen by eBPF.
fn on_room(t: u64, dt: u64, room: u64, stage: Stage, kind: Kind) -> LifecycleEvent {
    LifecycleEvent::new(t + dt, stage, kind, Source::Ebpf).with_room(room)
}

/// A room whose attempt no router dispatched and no prefill saw, ended within 0.4 s of `t`:
/// transfer traffic for it while it is live is an unknown room's, on its tombstone late
/// activity.
fn ended_room(t: u64, room: u64) -> Vec<LifecycleEvent> {
    vec![
        on_room(t, 0, room, Stage::Router, Kind::Admitted),
        on_room(t, 100 * MS, room, Stage::Transfer, Kind::Dispatched),
        on_room(t, 300 * MS, room, Stage::Transfer, Kind::Aborted),
        on_room(t, 400 * MS, room, Stage::Decode, Kind::Completed).with_status(200),
        on_room(t, 400 * MS, room, Stage::Router, Kind::Completed).with_status(200),
    ]
}

fn then(first: &[LifecycleEvent], rest: &[&LifecycleEvent]) -> Vec<LifecycleEvent> {
    first
        .iter()
        .cloned()
        .chain(rest.iter().map(|&e| e.clone()))
        .collect()
}

fn unknown_room(v: &[(String, Option<u64>)], room: u64) -> bool {
    v.contains(&("unknown-room".to_string(), Some(room)))
}

/// Activity on an attempt that ended longer than the linger before it is judged on the attempt's
/// tombstone whatever the sweep did meanwhile: here a transfer receipt 2 s after the attempt
/// ended, for a room no router dispatched, arrives before or after another room's event that
/// lets the sweep compact the attempt. Both orders give the same verdicts (the receipt is late
/// activity: no unknown-room on the tombstone); the receipt arriving while the attempt is
/// still live, 0.5 s after its end, is judged on it (unknown-room after the grace).
#[test]
fn late_activity_is_judged_on_the_tombstone_whatever_the_sweep_did() {
    let t = 1_795_986_920 * S;
    let ended = ended_room(t, 1);
    let receipt = on_room(t, 2400 * MS, 1, Stage::Transfer, Kind::Received);
    let other = on_room(t, 2410 * MS, 2, Stage::Prefill, Kind::Admitted);
    let first = verdicts(&then(&ended, &[&receipt, &other]));
    let second = verdicts(&then(&ended, &[&other, &receipt]));
    assert_eq!(first, second);
    assert!(!unknown_room(&first, 1), "{first:?}");
    // Within the linger the attempt is live for it: transfer traffic no router dispatched.
    let soon = on_room(t, 900 * MS, 1, Stage::Transfer, Kind::Received);
    let v = verdicts(&then(&ended, &[&soon, &other]));
    assert!(unknown_room(&v, 1), "{v:?}");
}

/// The router's answer naming only the x-request-id reaches the attempt through its solo
/// request: 2 s after the attempt ended it finds the attempt as an event naming the room would,
/// compacted, whether or not another room's event let the sweep compact it first. (Were the
/// answer to find it live, it would keep it so, and the transfer receipt that follows would be
/// judged on a live attempt no router dispatched.)
#[test]
fn an_answer_by_request_id_finds_the_attempt_as_its_room_would() {
    let t = 1_795_986_920 * S;
    let mut ended = ended_room(t, 1);
    ended[0] = ended[0].clone().with_request_id("req-1");
    let answer = LifecycleEvent::new(t + 2400 * MS, Stage::Router, Kind::Completed, Source::Otlp)
        .with_request_id("req-1")
        .with_status(200);
    let receipt = on_room(t, 2410 * MS, 1, Stage::Transfer, Kind::Received);
    let other = on_room(t, 2440 * MS, 2, Stage::Prefill, Kind::Admitted);
    let first = verdicts(&then(&ended, &[&answer, &receipt, &other]));
    let second = verdicts(&then(&ended, &[&other, &answer, &receipt]));
    assert_eq!(first, second);
    assert!(!unknown_room(&first, 1), "{first:?}");
}

/// An event older than the watermark finds an attempt live or compacted as the sweep would at
/// that watermark, whether or not the sweep's hand reached the attempt: here the same late
/// transfer receipt 0.6 s after the attempt ended, with 0 to 11 other attempts in the sweep's
/// round, arrives once another room's event put the watermark 1.55 s past the attempt's end.
#[test]
fn late_events_find_the_attempt_as_the_sweep_would_wherever_its_hand_is() {
    let t = 1_795_986_920 * S;
    let receipt = on_room(t, 1000 * MS, 1, Stage::Transfer, Kind::Received);
    let runs: Vec<_> = (0..12)
        .map(|others| {
            let mut events: Vec<_> = (0..others)
                .map(|k| on_room(t, 50 * MS, 100 + k, Stage::Prefill, Kind::Received))
                .collect();
            events.extend(ended_room(t, 1));
            events.push(on_room(t, 2000 * MS, 2, Stage::Prefill, Kind::Received));
            events.push(receipt.clone());
            verdicts(&events)
        })
        .collect();
    for v in &runs {
        assert_eq!(v, &runs[0], "{runs:?}");
    }
    assert!(!unknown_room(&runs[0], 1), "{runs:?}");
}

/// Whether a pending deadline still holds an ended attempt live does not depend on arrival
/// order: not on whether the required event came before or after the terminal one (settled
/// either way), nor on whether the watermark passed the deadline before the next event of the
/// attempt arrived or only with it (judging a deadline is activity at its time). The witness
/// is an admission over the prefill's capacity: judged on a live attempt only.
#[test]
fn a_deadline_holds_its_attempt_whichever_arrived_first() {
    let t = 1_795_986_920 * S;
    let mut cap =
        LifecycleEvent::new(t, Stage::Prefill, Kind::Capacity, Source::Otlp).with_worker("w");
    cap.max_total_tokens = Some(9000);
    let over = |dt: u64| {
        on_room(t, dt, 1, Stage::Prefill, Kind::Admitted)
            .with_worker("w")
            .with_input_tokens(20_000)
    };

    // The router's receipt is required by the transfer receipt before it (unknown-room); the
    // router's answer ends the attempt 10 ms after, the receipt arriving just before or after.
    let transfer = on_room(t, 100 * MS, 1, Stage::Transfer, Kind::Received);
    let required = on_room(t, 120 * MS, 1, Stage::Router, Kind::Received);
    let end = on_room(t, 130 * MS, 1, Stage::Router, Kind::Completed).with_status(200);
    let late = over(2000 * MS);
    let settled = verdicts(&[
        cap.clone(),
        transfer.clone(),
        required.clone(),
        end.clone(),
        late.clone(),
    ]);
    assert_eq!(
        settled,
        verdicts(&[cap.clone(), transfer, end, required, late])
    );
    assert!(
        settled.is_empty(),
        "late activity, on the tombstone: {settled:?}"
    );

    // No router saw it: unknown-room is due 5 s after the transfer receipt and keeps the ended
    // attempt live until judged. The admission 5.02 s after the receipt comes before or after
    // another room's event that lets the watermark pass the deadline; so does one 5.2 s after.
    let unknown = [
        cap,
        on_room(t, 100 * MS, 1, Stage::Transfer, Kind::Received),
        on_room(t, 130 * MS, 1, Stage::Decode, Kind::Completed).with_status(200),
    ];
    for dt in [5120 * MS, 5300 * MS] {
        let admitted = over(dt);
        let other = on_room(t, dt + 40 * MS, 2, Stage::Prefill, Kind::Received);
        let first = verdicts(&then(&unknown, &[&admitted, &other]));
        assert_eq!(first, verdicts(&then(&unknown, &[&other, &admitted])));
        assert!(
            first.contains(&("over-capacity-admitted".to_string(), Some(1))),
            "{first:?}"
        );
        assert!(unknown_room(&first, 1), "{first:?}");
    }
}

/// A shard of a split engine follows the whole input's newest event: its deadlines pass, and
/// its events count as late, where one checker's would, though its own events are older.
#[test]
fn following_the_newest_event_moves_the_watermark_as_that_event_would() {
    const S: u64 = 1_000_000_000;
    let transfer =
        || LifecycleEvent::new(10 * S, Stage::Transfer, Kind::Received, Source::Ebpf).with_room(7);
    let decode =
        || LifecycleEvent::new(11 * S, Stage::Decode, Kind::Work, Source::Ebpf).with_room(7);
    // One checker given an event 100 s later (another attempt's): the transfer no router
    // dispatched is judged, and the room's next event is late.
    let mut one = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
    one.observe(&transfer());
    let found = one.observe(&ev(110 * S, Stage::Router, Kind::Dispatched).with_room(8));
    assert_eq!(
        found.iter().map(|v| v.rule.as_str()).collect::<Vec<_>>(),
        ["unknown-room"]
    );
    one.observe(&decode());
    // A shard that saw only room 7's events, told of the newest time before each.
    let mut shard = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
    shard.observe(&transfer());
    let found = shard.follow(110 * S);
    assert_eq!(
        found.iter().map(|v| v.rule.as_str()).collect::<Vec<_>>(),
        ["unknown-room"]
    );
    assert!(shard.follow(110 * S).is_empty(), "nothing newer");
    shard.observe(&decode());
    assert_eq!(shard.stats().events_late, one.stats().events_late);
    assert_eq!(shard.stats().events_late, 1);
    assert_eq!(shard.watermark_ns(), one.watermark_ns());
}
