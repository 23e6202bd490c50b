//! Scenario tests: `tests/scenarios/NAME.jsonl` events with `NAME.expected` verdicts (JSON
//! Lines; not named `.jsonl`, so that `revenant check tests/scenarios/*.jsonl` reads events only).
//!
//! Each expected line names a rule plus any of bootstrap_room (a decimal string, as `check` writes
//! it; a number or `0x` hex reads too) / rid / request_id / worker; every violation must match
//! exactly one expected line and vice versa. The same verdicts must come out whatever the arrival
//! order, once lateness covers the whole file.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use revenant::engine::check::{Checker, CheckerConfig, RuleSet};
use revenant::{BootstrapRoom, LifecycleEvent, Violation};

use crate::support::inputs::{load, scenario_dir, scenario_files};

/// The scenario files, none of them named as the expected verdicts' files must not be.
fn scenarios() -> Vec<PathBuf> {
    let v = scenario_files();
    for p in &v {
        assert!(
            !p.to_string_lossy().ends_with(".expected.jsonl"),
            "{}: expected verdicts are named NAME.expected, so that a glob over the events \
             (`revenant check tests/scenarios/*.jsonl`) does not read them",
            p.display()
        );
    }
    v
}

fn run(events: &[LifecycleEvent], cfg: CheckerConfig) -> Vec<Violation> {
    let lateness = cfg.allowed_lateness;
    let mut c = Checker::new(RuleSet::embedded_defaults(), cfg);
    let mut out = Vec::new();
    for e in events {
        out.extend(c.observe(e));
    }
    let end = c.stats().max_event_ns + lateness.as_nanos() as u64;
    out.extend(c.tick(end));
    out
}

/// The identity of a verdict: rule and what broke it. Request aliases are enrichment known only
/// once the event linking attempt and request arrived, so they are not part of it.
/// Request-scope rules are about the request: which attempt's event proved it first is enrichment.
/// An attempt is its room (SGLang) or, without one, its rid (vLLM: one attempt per request).
fn key(v: &Violation) -> (String, Option<u64>, Option<String>, Option<String>) {
    let set = RuleSet::embedded_defaults();
    let scope = set.rules.iter().find(|r| r.name == v.rule).unwrap().scope;
    match scope {
        revenant::engine::rules::Scope::Attempt => {
            let rid = match v.attempt.bootstrap_room {
                Some(_) => None,
                None => v.attempt.rid.clone(),
            };
            (
                v.rule.clone(),
                v.attempt.bootstrap_room,
                rid,
                v.worker.clone(),
            )
        }
        revenant::engine::rules::Scope::Request => {
            (v.rule.clone(), None, None, v.request.request_id.clone())
        }
    }
}

/// An expected room in any spelling the outputs are read in (a decimal string as `check`
/// writes it, a number, a `0x` hex string); a bad one fails the test rather than matching nothing.
fn expected_room(r: &serde_json::Value) -> u64 {
    let room: BootstrapRoom = serde_json::from_value(r.clone())
        .unwrap_or_else(|e| panic!("expected bootstrap_room {r}: {e}"));
    room.0
}

fn matches(expected: &serde_json::Value, v: &Violation) -> bool {
    let e = expected.as_object().unwrap();
    e.get("rule").and_then(|r| r.as_str()) == Some(v.rule.as_str())
        && e.get("bootstrap_room")
            .is_none_or(|r| Some(expected_room(r)) == v.attempt.bootstrap_room)
        && e.get("rid")
            .is_none_or(|r| r.as_str() == v.attempt.rid.as_deref())
        && e.get("request_id")
            .is_none_or(|r| r.as_str() == v.request.request_id.as_deref())
        && e.get("worker")
            .is_none_or(|r| r.as_str() == v.worker.as_deref())
        // A corroborating follow-up must be expected as one; absent means "not a follow-up".
        && e.get("corroborates").and_then(|c| c.as_bool()).unwrap_or(false) == v.corroborates
}

#[test]
fn every_scenario_yields_exactly_its_expected_verdicts() {
    for path in scenarios() {
        let events = load(&path);
        let got = run(&events, CheckerConfig::default());
        let exp_path = path.with_extension("expected");
        let expected: Vec<serde_json::Value> = std::fs::read_to_string(&exp_path)
            .unwrap_or_else(|e| panic!("{}: {e}", exp_path.display()))
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let mut unmatched: Vec<&Violation> = got.iter().collect();
        for exp in &expected {
            let pos = unmatched.iter().position(|v| matches(exp, v));
            assert!(
                pos.is_some(),
                "{}: expected {exp} not found in {got:#?}",
                path.display()
            );
            unmatched.remove(pos.unwrap());
        }
        assert!(
            unmatched.is_empty(),
            "{}: unexpected violations {unmatched:#?}",
            path.display()
        );
        for v in &got {
            assert!(
                !v.evidence.is_empty(),
                "{}: violation without evidence: {v:?}",
                path.display()
            );
            assert!(
                v.evidence.windows(2).all(|w| w[0].time_ns <= w[1].time_ns),
                "evidence not ordered: {v:?}"
            );
        }
    }
}

#[test]
fn verdicts_do_not_depend_on_arrival_order() {
    // Lateness spanning the whole file: any permutation must give the same verdicts.
    let cfg = || CheckerConfig {
        allowed_lateness: Duration::from_secs(3600),
        ..CheckerConfig::default()
    };
    for path in scenarios() {
        let events = load(&path);
        let reference: BTreeSet<_> = run(&events, cfg()).iter().map(key).collect();
        let mut rng = 0x9e3779b97f4a7c15u64;
        for _ in 0..25 {
            let mut shuffled = events.clone();
            for i in (1..shuffled.len()).rev() {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                shuffled.swap(i, (rng % (i as u64 + 1)) as usize);
            }
            let got: BTreeSet<_> = run(&shuffled, cfg()).iter().map(key).collect();
            assert_eq!(
                got,
                reference,
                "{}: verdicts changed with arrival order",
                path.display()
            );
        }
    }
}

#[test]
fn a_retry_storm_is_one_request_with_one_fingerprint() {
    let events = load(&scenario_dir().join("smg-503-retry-storm.jsonl"));
    let got = run(&events, CheckerConfig::default());
    assert_eq!(got.len(), 5);
    let rooms: BTreeSet<_> = got
        .iter()
        .map(|v| v.attempt.bootstrap_room.unwrap())
        .collect();
    assert_eq!(rooms.len(), 5, "five attempts");
    let fps: BTreeSet<_> = got.iter().map(|v| v.fingerprint.clone()).collect();
    assert_eq!(
        fps.len(),
        1,
        "attempts of one request share a fingerprint: {fps:?}"
    );
    assert!(
        got.iter()
            .all(|v| v.request.request_id.as_deref() == Some("storm-1"))
    );
}

/// Real arrival order over OTLP: the worker spans (trace id only) come first, smg's span with the
/// x-request-id last. The fingerprint must not change when the x-request-id turns up.
#[test]
fn a_retry_storm_seen_through_otlp_keeps_one_fingerprint() {
    let events = load(&scenario_dir().join("smg-503-retry-storm-otlp-arrival.jsonl"));
    let got = run(&events, CheckerConfig::default());
    assert_eq!(got.len(), 5);
    let fps: BTreeSet<_> = got.iter().map(|v| v.fingerprint.clone()).collect();
    assert_eq!(fps.len(), 1, "one request, one fingerprint: {got:#?}");
}

#[test]
fn a_shared_trace_id_never_merges_attempts() {
    // In legit-retry-succeeds both attempts carry the router's trace id; were they merged, the
    // rejection of the first would make the second's work a violation.
    let events = load(&scenario_dir().join("legit-retry-succeeds.jsonl"));
    let mut c = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
    for e in &events {
        assert!(c.observe(e).is_empty());
    }
    let s = c.stats();
    assert_eq!(s.correlate.attempts_created, 2);
    assert_eq!(
        s.live_requests, 1,
        "trace id and x-request-id are one request"
    );
}

/// A rejected attempt whose legs ended is compacted into a tombstone; activity that arrives later
/// (here 3 s after, past the 1 s linger) must still be caught, and only once.
#[test]
fn late_activity_on_a_tombstoned_rejected_attempt_is_caught() {
    use revenant::{Kind, Source, Stage};
    const S: u64 = 1_000_000_000;
    let t0 = 1_795_986_920 * S;
    let mut c = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
    let ev = |dt: u64, stage, kind| {
        LifecycleEvent::new(t0 + dt, stage, kind, Source::Ebpf).with_room(42)
    };
    assert!(c.observe(&ev(0, Stage::Prefill, Kind::Received)).is_empty());
    assert!(
        c.observe(&ev(500, Stage::Decode, Kind::Received))
            .is_empty()
    );
    assert!(
        c.observe(&ev(1_000, Stage::Prefill, Kind::Rejected).with_status(400))
            .is_empty()
    );
    assert!(
        c.observe(&ev(3_000, Stage::Decode, Kind::Cancelled))
            .is_empty()
    );
    // Let the watermark pass the linger so the ended attempt is compacted.
    assert!(c.tick(t0 + 2 * S).is_empty());
    let s = c.stats();
    assert_eq!((s.live_attempts, s.tombstones), (0, 1), "{s:?}");
    let v = c.observe(&ev(3 * S, Stage::Transfer, Kind::Work));
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].rule, "activity-after-rejection");
    assert_eq!(v[0].attempt.bootstrap_room, Some(42));
    assert_eq!(c.stats().events_on_tombstones, 1);
    // Repeats on the tombstone do not notify again.
    assert!(
        c.observe(&ev(3 * S + 1_000, Stage::Decode, Kind::Work))
            .is_empty()
    );
}

/// The other order: activity first, the attempt ends and is compacted, then the rejection that
/// precedes the activity in event time arrives late.
#[test]
fn a_late_rejection_finds_the_tombstoned_activity() {
    use revenant::{Kind, Source, Stage};
    const S: u64 = 1_000_000_000;
    let t0 = 1_795_986_920 * S;
    let cfg = CheckerConfig {
        allowed_lateness: Duration::from_secs(5),
        ..CheckerConfig::default()
    };
    let mut c = Checker::new(RuleSet::embedded_defaults(), cfg);
    let ev =
        |dt: u64, stage, kind| LifecycleEvent::new(t0 + dt, stage, kind, Source::Ebpf).with_room(7);
    assert!(
        c.observe(&ev(10_000, Stage::Decode, Kind::Received))
            .is_empty()
    );
    assert!(
        c.observe(&ev(20_000, Stage::Decode, Kind::Completed).with_status(200))
            .is_empty()
    );
    // Past the linger (which is at least the allowed lateness): compacted.
    assert!(c.tick(t0 + 12 * S).is_empty());
    assert_eq!(c.stats().tombstones, 1);
    let v = c.observe(&ev(5_000, Stage::Prefill, Kind::Rejected).with_status(400));
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].rule, "activity-after-rejection");
    assert_eq!(v[0].evidence[0].kind, Kind::Rejected);
}

/// The hard cap on live attempts evicts (into tombstones) with a counter, and TTL compacts idle
/// attempts that never end; neither loses a rejected attempt's verdict.
#[test]
fn caps_and_ttl_bound_the_state_and_are_counted() {
    use revenant::{Kind, Source, Stage};
    const S: u64 = 1_000_000_000;
    let t0 = 1_795_986_920 * S;
    let cfg = CheckerConfig {
        max_attempts: 2,
        attempt_ttl: Duration::from_secs(600),
        ..CheckerConfig::default()
    };
    let mut c = Checker::new(RuleSet::embedded_defaults(), cfg);
    let ev = |dt: u64, room, stage, kind| {
        LifecycleEvent::new(t0 + dt, stage, kind, Source::Ebpf).with_room(room)
    };
    c.observe(&ev(0, 1, Stage::Prefill, Kind::Rejected).with_status(400));
    c.observe(&ev(1, 2, Stage::Prefill, Kind::Received));
    c.observe(&ev(2, 3, Stage::Prefill, Kind::Received));
    let s = c.stats();
    assert_eq!(s.correlate.evicted_cap, 1, "{s:?}");
    assert_eq!(s.live_attempts, 2);
    // Room 1 was evicted first; its rejection still convicts later activity via the tombstone.
    let v = c.observe(&ev(3, 1, Stage::Decode, Kind::Work));
    assert_eq!(v.len(), 1, "{v:?}");
    // Idle attempts are compacted after the TTL even though they never ended.
    c.tick(t0 + 700 * S);
    let s = c.stats();
    assert_eq!(s.live_attempts, 0, "{s:?}");
    assert!(s.correlate.evicted_ttl >= 1, "{s:?}");
}

/// eBPF sees the breach first; OTLP's copy of the rejection, seconds later, corroborates it once:
/// same fingerprint and attempt, evidence from both sources. OTLP's copy of the decode work adds
/// no new source and is a plain repeat.
#[test]
fn a_second_source_corroborates_a_reported_breach_once() {
    use revenant::Source;
    let events = load(&scenario_dir().join("corroborated-by-otlp.jsonl"));
    let mut c = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
    let mut per_event = Vec::new();
    for e in &events {
        per_event.push(c.observe(e));
    }
    let fired: Vec<(usize, &Violation)> = per_event
        .iter()
        .enumerate()
        .flat_map(|(i, vs)| vs.iter().map(move |v| (i, v)))
        .collect();
    assert_eq!(fired.len(), 2, "{fired:#?}");
    let ((i0, first), (i1, follow)) = (fired[0], fired[1]);
    assert_eq!(events[i0].kind, revenant::Kind::Work);
    assert_eq!(events[i0].source, Source::Ebpf);
    assert!(!first.corroborates);
    assert!(first.evidence.iter().all(|e| e.source == Source::Ebpf));
    assert_eq!(
        (events[i1].kind, events[i1].source),
        (revenant::Kind::Rejected, Source::Otlp)
    );
    assert!(follow.corroborates);
    // Counted as a corroboration, not as a second violation of the rule.
    let (stats, per_rule) = (c.stats(), c.violations_per_rule().to_vec());
    assert_eq!(
        (stats.violations, stats.corroborations),
        (1, 1),
        "{stats:?}"
    );
    let rule_index = c.rules().position(|r| r.name == first.rule).unwrap();
    assert_eq!(per_rule[rule_index], 1);
    assert_eq!(follow.fingerprint, first.fingerprint);
    assert_eq!(follow.attempt.bootstrap_room, first.attempt.bootstrap_room);
    assert_eq!(follow.rule, first.rule);
    let sources: BTreeSet<_> = follow.evidence.iter().map(|e| e.source.as_str()).collect();
    assert_eq!(sources, BTreeSet::from(["ebpf", "otlp"]));
    // The original pair is kept (its trigger may now carry the reason OTLP brought), the new
    // event added.
    let fact = |e: &revenant::violation::Evidence| {
        (e.role, e.time_ns, e.stage, e.kind, e.source, e.status)
    };
    for ev in &first.evidence {
        assert!(
            follow.evidence.iter().any(|f| fact(f) == fact(ev)),
            "{ev:?} missing from {follow:#?}"
        );
    }
    assert_eq!(
        follow.evidence.len(),
        first.evidence.len() + 1,
        "{follow:#?}"
    );
    assert_eq!(c.stats().corroborations, 1);
    // Serialized only when true.
    let json = serde_json::to_value(follow).unwrap();
    assert_eq!(json["corroborates"], serde_json::json!(true));
    assert!(
        serde_json::to_value(first)
            .unwrap()
            .get("corroborates")
            .is_none()
    );
}
