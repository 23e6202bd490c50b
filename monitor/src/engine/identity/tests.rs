//! Store-level tests: solo requests and their records, and alias verification under forced
//! fingerprint collisions.

use super::*;
use crate::engine::mem::alias_table::with_fp_mask;
use crate::engine::state::Slot;
use crate::event::{BootstrapRoom, Ids, Kind, LifecycleEvent, Source, Stage};

fn store() -> Store {
    let limits = StoreLimits {
        max_attempts: 1000,
        max_tombstones: 1000,
        max_requests: 1000,
        attempt_ttl_ns: 60_000_000_000,
        linger_ns: 1_000_000_000,
        retention_ns: 600_000_000_000,
    };
    // One attempt spec linked to one request spec, as a request-scope rule has them.
    Store::new(
        limits,
        vec![Keep::Latest],
        vec![Keep::Latest],
        vec![(0, 0)],
        Vec::new(),
        0,
    )
}

fn ids(request_id: Option<&str>, trace_id: Option<&str>, room: Option<u64>) -> Ids {
    Ids {
        request_id: request_id.map(Into::into),
        trace_id: trace_id.map(Into::into),
        rid: None,
        bootstrap_room: room.map(BootstrapRoom),
    }
}

fn live(r: &Resolved) -> u32 {
    match r.attempt {
        Some(AttemptAt::Live(a)) => a,
        other => panic!("not a live attempt: {other:?}"),
    }
}

#[test]
fn a_single_attempt_request_has_no_record_until_something_needs_one() {
    let mut s = store();
    let first = s.resolve_t(&ids(Some("req-1"), None, Some(1)), 1_000);
    let a = live(&first);
    assert_eq!(first.request, None, "kept solo in its attempt");
    assert_eq!((s.live_requests(), s.requests.len()), (1, 0));
    // More events of the attempt, and the request id again with its room: still solo.
    for t in [2_000, 3_000] {
        assert_eq!(s.resolve_t(&ids(None, None, Some(1)), t).request, None);
    }
    assert_eq!(
        s.resolve_t(&ids(Some("req-1"), None, Some(1)), 4_000)
            .request,
        None
    );
    // A trace id for it is one more alias of the same solo request.
    assert_eq!(
        s.resolve_t(&ids(None, Some("tr"), Some(1)), 4_500).request,
        None
    );
    // The checker keeps the attempt's latest event in its slot (here, by hand).
    let work = LifecycleEvent::new(4_500, Stage::Decode, Kind::Work, Source::Ebpf);
    s.fold_attempt_slots(a, 1, Slot::from_event(&work, 0));
    assert_eq!(s.requests.len(), 0);

    // A retry: a new room under the same request id. Both attempts now share one record,
    // which has both ids.
    let retry = s.resolve_t(&ids(Some("req-1"), None, Some(2)), 5_000);
    let b = live(&retry);
    let r = retry.request.expect("a record now");
    assert!(
        retry.linked,
        "the new attempt's history must reach the request"
    );
    assert_eq!(s.stats.requests_materialized, 1);
    assert_eq!(s.request_record(a), Some(r));
    assert_eq!(s.request_record(b), Some(r));
    let req = &s.requests[r as usize];
    assert_eq!(
        (req.request_id(), req.trace_id()),
        (Some("req-1"), Some("tr"))
    );
    assert_eq!((req.refs, s.live_requests()), (2, 1));
    // The first attempt's latest event (time 4 500) reached the record's slot.
    assert_eq!(s.request_slots(r).get(0).time(), 4_500);
    // Either id leads to the record.
    assert_eq!(
        s.resolve_t(&ids(None, Some("tr"), None), 6_000).request,
        Some(r)
    );
    assert_eq!(
        s.resolve_t(&ids(Some("req-1"), None, None), 6_000).request,
        Some(r)
    );
}

#[test]
fn request_level_events_compaction_and_second_ids_give_solo_requests_a_record() {
    let mut s = store();
    // A request-level event (the router's answer, request id only) that is no trigger leaves
    // the request solo; one that may trigger a request-scope rule gives it a record.
    let a = live(&s.resolve_t(&ids(Some("q1"), None, Some(10)), 1_000));
    let answer = s.resolve_t(&ids(Some("q1"), None, None), 2_000);
    assert_eq!(
        (answer.attempt, answer.request, answer.solo),
        (None, None, true)
    );
    assert_eq!(
        s.attempts[a as usize].last_ns, 2_000,
        "the request is active"
    );
    let r = s.resolve(&ids(Some("q1"), None, None), 2_500, true).request;
    assert!(r.is_some());
    assert_eq!(r, s.request_record(a));

    // Compaction: the tombstone keeps a record of the request.
    let b = live(&s.resolve_t(&ids(Some("q2"), None, Some(20)), 1_000));
    s.compact(b, 10_000);
    let t = match s.resolve_t(&ids(None, None, Some(20)), 11_000) {
        Resolved {
            attempt: Some(AttemptAt::Tomb(seq)),
            request: Some(r),
            ..
        } => (seq, r),
        other => panic!("{other:?}"),
    };
    assert_eq!(s.requests[t.1 as usize].request_id(), Some("q2"));
    assert_eq!(
        s.resolve_t(&ids(Some("q2"), None, None), 12_000).request,
        Some(t.1)
    );

    // A second trace id on a solo request: a stub record merged into the request's.
    let c = live(&s.resolve_t(&ids(None, Some("t1"), Some(30)), 1_000));
    let r = s
        .resolve_t(&ids(None, Some("t2"), Some(30)), 2_000)
        .request
        .expect("a record");
    assert_eq!(s.request_record(c), Some(r));
    assert_eq!(s.requests[r as usize].trace_id(), Some("t1"));
    assert_eq!(
        s.resolve_t(&ids(None, Some("t2"), None), 3_000).request,
        Some(r)
    );
    assert_eq!(s.live_requests(), 4, "q1, q2, t1 and its stub t2");
}

#[test]
fn the_first_attempt_takes_over_the_record_a_request_level_event_made() {
    let mut s = store();
    // The router received the request (request id only: no room yet): a record.
    let got = s.resolve_t(&ids(Some("q"), Some("tr"), None), 1_000);
    let r = got.request.expect("a record");
    assert_eq!((s.requests.len(), s.live_requests()), (1, 1));
    // Its dispatch names the room: the attempt takes the request over, solo.
    let d = s.resolve_t(&ids(Some("q"), None, Some(5)), 2_000);
    let a = live(&d);
    assert_eq!((d.request, d.solo), (None, true));
    assert_eq!(s.stats.requests_adopted, 1);
    assert!(
        !s.requests[r as usize].is_live(),
        "the record is free again"
    );
    assert_eq!(s.live_requests(), 1);
    // Both ids still lead to it.
    assert!(s.resolve_t(&ids(None, Some("tr"), None), 2_500).solo);
    let retry = s.resolve_t(&ids(Some("q"), None, Some(6)), 3_000);
    let r2 = retry.request.expect("a second attempt needs a record");
    assert_eq!(s.request_record(a), Some(r2));
    assert_eq!(s.requests[r2 as usize].trace_id(), Some("tr"));

    // A record that already holds something (here a second attempt's reference) stays.
    let third = s.resolve_t(&ids(Some("q"), None, Some(7)), 4_000);
    assert_eq!(third.request, Some(r2));
    assert_eq!(s.requests[r2 as usize].refs, 3);
}

#[test]
fn a_merged_attempt_hands_its_solo_request_over() {
    let mut s = store();
    // A rid seen alone first (its own attempt, with the request id), then with a room.
    let with_rid = |rid: &str, request_id: Option<&str>, room: Option<u64>| Ids {
        rid: Some(rid.into()),
        ..ids(request_id, None, room)
    };
    let y = live(&s.resolve_t(&with_rid("r-1", Some("q"), None), 1_000));
    let x = live(&s.resolve_t(&ids(None, None, Some(7)), 1_500));
    assert_ne!(x, y);
    let merged = s.resolve_t(&with_rid("r-1", None, Some(7)), 2_000);
    assert_eq!(live(&merged), x);
    assert_eq!(
        merged.request, None,
        "still solo, now in the surviving attempt"
    );
    assert_eq!(s.requests.len(), 0);
    let r = s.resolve(&ids(Some("q"), None, None), 3_000, true).request;
    assert_eq!(r, s.request_record(x));
    assert_eq!(s.requests[r.unwrap() as usize].request_id(), Some("q"));
}

/// With every fingerprint forced equal, each alias still resolves to its own owner:
/// verification rejects the colliding aliases of other attempts, tombstones and requests.
#[test]
fn verification_rejects_a_colliding_alias_of_another_owner() {
    with_fp_mask(0, || {
        let limits = StoreLimits {
            max_attempts: 1 << 20,
            max_tombstones: 1 << 20,
            max_requests: 1 << 20,
            attempt_ttl_ns: u64::MAX,
            linger_ns: u64::MAX,
            retention_ns: 1_000_000_000_000,
        };
        let mut s = Store::new(limits, vec![], vec![], vec![], vec![], 0);
        let ids = |room: Option<u64>, rid: Option<&str>, req: Option<&str>| Ids {
            request_id: req.map(Into::into),
            trace_id: None,
            rid: rid.map(Into::into),
            bootstrap_room: room.map(BootstrapRoom),
        };
        let live = |r: Resolved| match r.attempt {
            Some(AttemptAt::Live(i)) => i,
            other => panic!("not live: {other:?}"),
        };
        let a = live(s.resolve_t(&ids(Some(1), None, Some("req-a")), 1));
        let b = live(s.resolve_t(&ids(Some(2), None, Some("req-b")), 2));
        assert_ne!(a, b);
        // First rids (hex and text), second rids, a rid-only attempt.
        let hex_a = "0123456789abcdef0123456789abcdef";
        assert_eq!(live(s.resolve_t(&ids(Some(1), Some(hex_a), None), 3)), a);
        assert_eq!(live(s.resolve_t(&ids(Some(2), Some("rid-b"), None), 4)), b);
        assert_eq!(live(s.resolve_t(&ids(Some(1), Some("rid-a2"), None), 5)), a);
        assert_eq!(live(s.resolve_t(&ids(Some(1), Some("rid-a3"), None), 5)), a);
        let c = live(s.resolve_t(&ids(None, Some("rid-c"), None), 6));
        assert!(c != a && c != b);
        for (rid, want) in [
            (hex_a, a),
            ("rid-b", b),
            ("rid-a2", a),
            ("rid-a3", a),
            ("rid-c", c),
        ] {
            assert_eq!(
                live(s.resolve_t(&ids(None, Some(rid), None), 7)),
                want,
                "{rid}"
            );
        }
        // Solo requests (kept by their attempts) answer to their own ids; a request-level
        // trigger gives each the record of the right attempt.
        assert!(s.resolve_t(&ids(None, None, Some("req-a")), 8).solo);
        let ra = s
            .resolve(&ids(None, None, Some("req-a")), 8, true)
            .request
            .unwrap();
        let rb = s
            .resolve(&ids(None, None, Some("req-b")), 8, true)
            .request
            .unwrap();
        assert_ne!(ra, rb);
        assert_eq!(s.request_record(a), Some(ra));
        assert_eq!(s.request_record(b), Some(rb));
        assert_eq!(s.requests[ra as usize].request_id(), Some("req-a"));
        // A new room and a new rid are new attempts, not a colliding neighbour.
        let d = live(s.resolve_t(&ids(Some(3), None, None), 9));
        let e = live(s.resolve_t(&ids(None, Some("rid-e"), None), 9));
        assert_eq!([a, b, c].iter().filter(|&&x| x == d || x == e).count(), 0);
        assert_ne!(d, e);
        // Tombstones: `a` compacted answers by its room; `b`, still live, by its own.
        s.compact(a, 10);
        assert!(matches!(
            s.resolve_t(&ids(Some(1), None, None), 11).attempt,
            Some(AttemptAt::Tomb(_))
        ));
        assert_eq!(live(s.resolve_t(&ids(Some(2), None, None), 11)), b);
        // Its rids left with it: a rid of `a` now makes a new attempt.
        let f = live(s.resolve_t(&ids(None, Some("rid-a2"), None), 12));
        assert!(![b, c, d, e].contains(&f));
        let entries = s.alias_entries();
        assert_eq!(live(s.resolve_t(&ids(None, Some("rid-a2"), None), 13)), f);
        assert_eq!(s.alias_entries(), entries);
    });
}

/// The whole engine gives the same verdicts and stats with 16 distinct fingerprints as
/// with full ones: collisions cost probes, never a wrong attribution.
#[test]
fn verdicts_do_not_depend_on_fingerprint_collisions() {
    use crate::engine::check::{Checker, CheckerConfig, RuleSet};
    use crate::engine::workload::{Mix, stream};
    let mix = Mix {
        attempts: 3_000,
        reject_every: 10,
        ..Mix::default()
    };
    let mut events = stream(&mix);
    // Some rid events without their room: rid-first attempts and merges.
    for (n, e) in events.iter_mut().enumerate() {
        if e.ids.rid.is_some() && n % 3 == 0 {
            e.ids.bootstrap_room = None;
        }
    }
    let run = || {
        let cfg = CheckerConfig {
            retention: std::time::Duration::from_secs(1),
            ..CheckerConfig::default()
        };
        let mut c = Checker::new(RuleSet::embedded_defaults(), cfg);
        let mut out = Vec::new();
        let mut last = 0;
        for e in &events {
            out.extend(c.observe(e).iter().map(|v| format!("{v:?}")));
            last = e.time_ns;
        }
        out.extend(
            c.tick(last + 3_600_000_000_000)
                .iter()
                .map(|v| format!("{v:?}")),
        );
        (out, format!("{:?}", c.stats()), c.alias_entries())
    };
    let full = run();
    let collided = with_fp_mask(0xf000_0000, run);
    assert!(!full.0.is_empty(), "the mix has violations");
    assert_eq!(full, collided);
}

/// Joins through a room are judged like events naming the room with a request id: a trace id
/// (a worker's span) or a rid (an attempt first seen without its room) that brings a second
/// client request to a room's attempt collides once; one request's ids joined through its room
/// (a retry's trace, its own rid) do not.
#[test]
fn joins_through_a_room_of_two_request_ids_collide() {
    let with_rid =
        |rid: &str, request_id: Option<&str>, trace: Option<&str>, room: Option<u64>| Ids {
            rid: Some(rid.into()),
            ..ids(request_id, trace, room)
        };
    let mut s = store();
    s.guard_room_request_ids();
    let a = live(&s.resolve_t(&ids(Some("req-a"), Some("ta"), Some(7)), 1_000));
    // The second request known by its router's span, then a worker's span naming the room.
    assert_eq!(
        s.resolve_t(&ids(Some("req-b"), Some("tb"), None), 2_000)
            .collision,
        None
    );
    let join = s.resolve_t(&with_rid("pb", None, Some("tb"), Some(7)), 3_000);
    assert_eq!(join.collision, Some(AttemptAt::Live(a)));
    assert_eq!(
        s.take_collided_with(),
        (Some("req-a".into()), Some("req-b".into()))
    );
    // An attempt seen by its rid with its request, then its rid with a room another request has.
    let c = live(&s.resolve_t(&ids(Some("req-c"), None, Some(8)), 4_000));
    assert_eq!(
        s.resolve_t(&with_rid("pd", Some("req-d"), None, None), 5_000)
            .collision,
        None
    );
    let merge = s.resolve_t(&with_rid("pd", None, None, Some(8)), 6_000);
    assert_eq!(merge.collision, Some(AttemptAt::Live(c)));
    assert_eq!(
        s.take_collided_with(),
        (Some("req-c".into()), Some("req-d".into()))
    );
    // One request: its trace and its rid joined through its room are no collision.
    let e = live(&s.resolve_t(&ids(Some("req-e"), None, Some(9)), 7_000));
    assert_eq!(
        s.resolve_t(&ids(Some("req-e"), Some("te"), None), 8_000)
            .collision,
        None
    );
    assert_eq!(
        s.resolve_t(&with_rid("pe", Some("req-e"), None, None), 8_500)
            .collision,
        None
    );
    let own = s.resolve_t(&with_rid("pe", None, Some("te"), Some(9)), 9_000);
    assert_eq!(
        (own.attempt, own.collision),
        (Some(AttemptAt::Live(e)), None)
    );
}

/// An OpenTelemetry client sends two requests under one trace (the router continues its
/// traceparent): each keeps its own x-request-id and room. The shared trace joins nothing: two
/// requests, no collision, each room's attempt keeps its own request id, and a worker's span
/// naming a room and the trace finds that room's request. A span naming the trace alone is
/// ambiguous and joins nothing either.
#[test]
fn two_requests_sharing_a_trace_stay_two_requests() {
    let with_rid = |rid: &str, trace: &str, room: u64| Ids {
        rid: Some(rid.into()),
        ..ids(None, Some(trace), Some(room))
    };
    let mut s = store();
    s.guard_room_request_ids();
    let a = s.resolve_t(&ids(Some("req-a"), Some("tr"), Some(1)), 1_000);
    let b = s.resolve_t(&ids(Some("req-b"), Some("tr"), Some(2)), 2_000);
    let (ia, ib) = (live(&a), live(&b));
    assert_ne!(ia, ib);
    assert_eq!((a.collision, b.collision), (None, None));
    assert_eq!((a.linked, b.linked), (false, false));
    assert!(
        a.solo && b.solo,
        "two requests, each in its attempt: {a:?} {b:?}"
    );
    // Worker spans (rid, room, trace) and the legs again, in any order: nothing collides.
    for (t, e) in [
        (3_000, with_rid("pa", "tr", 1)),
        (3_100, with_rid("pb", "tr", 2)),
        (3_200, ids(Some("req-b"), Some("tr"), Some(2))),
        (3_300, ids(Some("req-a"), Some("tr"), Some(1))),
        (3_400, with_rid("pb", "tr", 2)),
        (3_500, ids(Some("req-b"), Some("tr"), None)),
        (3_600, ids(Some("req-a"), Some("tr"), None)),
    ] {
        let r = s.resolve_t(&e, t);
        assert_eq!(r.collision, None, "{e:?}");
    }
    assert_eq!(live(&s.resolve_t(&with_rid("pa", "tr", 1), 4_000)), ia);
    assert_eq!(live(&s.resolve_t(&with_rid("pb", "tr", 2), 4_000)), ib);
    assert_eq!(
        s.room_request_id(AttemptAt::Live(ia)).as_deref(),
        Some("req-a")
    );
    assert_eq!(
        s.room_request_id(AttemptAt::Live(ib)).as_deref(),
        Some("req-b")
    );
    // Request-scope triggers give each request a record of its own.
    let ra = s.resolve(&ids(Some("req-a"), Some("tr"), None), 5_000, true);
    let rb = s.resolve(&ids(Some("req-b"), Some("tr"), None), 5_000, true);
    assert!(ra.request.is_some() && rb.request.is_some());
    assert_ne!(ra.request, rb.request);
    assert_eq!(s.request_record(ia), ra.request);
    assert_eq!(s.request_record(ib), rb.request);
    assert_eq!(s.stats.requests_merged, 0);
    // The trace alone names neither: no request, nothing merged.
    let alone = s.resolve(&ids(None, Some("tr"), None), 6_000, true);
    assert_eq!((alone.request, alone.solo), (None, false));
    // A new attempt named by the trace alone is left without a request.
    let orphan = s.resolve_t(&with_rid("pc", "tr", 3), 6_500);
    assert_eq!(
        (orphan.request, orphan.solo, orphan.collision),
        (None, false, None)
    );
    assert_eq!(s.stats.requests_merged, 0);
    // Both rooms still hold their own request ids.
    assert_eq!(
        s.room_request_id(AttemptAt::Live(ia)).as_deref(),
        Some("req-a")
    );
    assert_eq!(
        s.room_request_id(AttemptAt::Live(ib)).as_deref(),
        Some("req-b")
    );
}

/// Shared traces are remembered within bounds: at most `max_requests` of them, the stalest
/// forgotten first.
#[test]
fn shared_traces_are_bounded() {
    let mut s = store();
    for n in 0..5_000u64 {
        s.mark_shared_trace(n, n);
        assert!(s.shared_traces.len() <= 1_000);
    }
    assert!(s.shared_traces.contains_key(&4_999), "the latest is kept");
    assert!(!s.shared_traces.contains_key(&0), "the stalest went");
}
