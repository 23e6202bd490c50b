use super::limit::SAMPLE;
use super::*;
use crate::alert::notification::{Lead, Links, Update};
use crate::event::{Kind, Source, Stage};
use crate::violation::{AttemptAliases, Evidence, Severity, Violation};
use crate::violation::{EvidenceRole, RequestAliases};

const S: u64 = 1_000_000_000;
const AAR: &str = "activity-after-rejection";
const AARF: &str = "activity-after-request-failed";
const ORPHAN: &str = "orphaned-leg";

fn ev(source: Source, t: u64) -> Evidence {
    Evidence {
        role: EvidenceRole::Offender,
        time_ns: t,
        stage: Stage::Decode,
        kind: Kind::Work,
        source,
        status: None,
        reason: None,
    }
}

/// A finding of `rule` about request `req` (None: names no request) and attempt `room`.
fn finding(rule: &str, req: Option<&str>, room: Option<u64>, severity: Severity) -> Violation {
    let alias = req
        .map(|r| format!("request_id:{r}"))
        .or(room.map(|r| format!("room:{r}")))
        .unwrap_or_default();
    Violation {
        rule: rule.into(),
        severity,
        summary: format!("{rule} on {alias}"),
        request: RequestAliases {
            request_id: req.map(str::to_string),
            trace_id: None,
        },
        attempt: AttemptAliases {
            bootstrap_room: room,
            rid: None,
        },
        worker: None,
        detected_at_ns: 1,
        fingerprint: format!(
            "{:016x}",
            crate::violation::fnv1a(&[rule.as_bytes(), alias.as_bytes()])
        ),
        evidence: vec![ev(Source::Otlp, 10)],
        corroborates: false,
    }
}

fn crit(rule: &str, req: &str, room: u64) -> Violation {
    finding(rule, Some(req), Some(room), Severity::Critical)
}

fn links() -> Links {
    Links {
        timeline: None,
        page: None,
        violations: None,
    }
}

fn flood(cfg: FloodConfig) -> FloodControl {
    FloodControl::new(cfg, 0)
}

fn grouping(secs: u64) -> FloodConfig {
    FloodConfig {
        group_wait: Duration::from_secs(secs),
        rate_limit: 0,
        ..Default::default()
    }
}

fn no_grouping() -> FloodConfig {
    FloodConfig {
        group_wait: Duration::ZERO,
        rate_limit: 0,
        ..Default::default()
    }
}

fn notes(r: Vec<Release>) -> Vec<IncidentAlert> {
    r.into_iter()
        .map(|r| match r {
            Release::Notify(a) => a,
            other => panic!("expected a notification: {other:?}"),
        })
        .collect()
}

#[test]
fn two_rules_for_one_request_within_the_wait_are_one_notification() {
    let mut f = flood(grouping(2));
    assert_eq!(
        f.admit(&crit(AAR, "req-1", 1), links(), 0, false),
        Admission::Opened { held: false }
    );
    // Another request: an incident of its own.
    assert_eq!(
        f.admit(&crit(AAR, "req-2", 2), links(), S / 10, false),
        Admission::Opened { held: false }
    );
    assert_eq!(
        f.admit(&crit(AARF, "req-1", 1), links(), S / 2, false),
        Admission::Merged(Merge::Pending)
    );
    assert_eq!(f.next_release_ns(), Some(2 * S));
    assert!(f.release_due(2 * S - 1).is_empty(), "group wait not over");
    assert!(f.active().is_empty(), "pending: not sent, not active");
    let out = notes(f.release_due(2 * S));
    assert_eq!(out.len(), 1);
    let a = &out[0];
    assert_eq!(a.rules, [AAR, AARF]);
    assert_eq!(a.findings.len(), 2);
    assert_eq!(a.incident_key, "request_id:req-1");
    assert_eq!(a.violation.rule, AAR, "lead: first among equals");
    assert_eq!(a.sequence, 1);
    assert_eq!(a.update, None);
    assert_eq!(a.received_at_ns, 0, "latency counts from the first finding");
    assert!(a.findings.iter().all(|f| f.first_sequence == 1));
    let out = notes(f.release_due(3 * S));
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].incident_key, "request_id:req-2");
    assert_ne!(out[0].incident, a.incident);
    assert_eq!(f.active().len(), 2);
    assert!(f.release_due(10 * S).is_empty(), "each sent once");
}

#[test]
fn the_lead_is_the_highest_severity() {
    let mut f = flood(grouping(2));
    let w = finding(ORPHAN, Some("req-1"), Some(1), Severity::Warning);
    f.admit(&w, links(), 0, false);
    f.admit(&crit(AAR, "req-1", 1), links(), S, false);
    let a = &notes(f.release_due(2 * S))[0];
    assert_eq!(a.violation.rule, AAR);
    assert_eq!(a.violation.severity, Severity::Critical);
    assert_eq!(a.rules, [ORPHAN, AAR], "findings stay in arrival order");
    assert_eq!(a.violation.fingerprint, crit(AAR, "req-1", 1).fingerprint);
}

#[test]
fn an_escalation_after_sending_is_exactly_one_update() {
    let mut f = flood(grouping(2));
    let w = finding(ORPHAN, Some("req-1"), Some(1), Severity::Warning);
    f.admit(&w, links(), 0, false);
    let first = notes(f.release_due(2 * S)).remove(0);
    assert_eq!(first.violation.severity, Severity::Warning);
    // Critical findings after the warning went out: one update for both.
    assert_eq!(
        f.admit(&crit(AAR, "req-1", 1), links(), 3 * S, false),
        Admission::Merged(Merge::Escalated)
    );
    assert_eq!(
        f.admit(&crit(AARF, "req-1", 1), links(), 3 * S + S / 2, false),
        Admission::Merged(Merge::Pending)
    );
    assert!(f.release_due(5 * S - 1).is_empty());
    let mut out = notes(f.release_due(5 * S));
    assert_eq!(out.len(), 1, "{out:#?}");
    let u = out.remove(0);
    assert_eq!(u.update, Some(Update::Escalated));
    assert_eq!(u.sequence, 2);
    assert_eq!(u.incident, first.incident);
    assert_ne!(u.id, first.id);
    assert_eq!(u.violation.severity, Severity::Critical);
    assert_eq!(u.violation.rule, AAR);
    assert_eq!(u.rules, [ORPHAN, AAR, AARF]);
    assert_eq!(u.received_at_ns, 3 * S);
    assert_eq!(
        u.escalated_from,
        Some(Lead {
            rule: ORPHAN.into(),
            severity: Severity::Warning,
            fingerprint: w.fingerprint.clone(),
        })
    );
    assert_eq!(u.previous_lead().unwrap().violation.rule, ORPHAN);
    let seqs: Vec<u32> = u.findings.iter().map(|f| f.first_sequence).collect();
    assert_eq!(seqs, [1, 2, 2]);
    // Nothing more: a finding of equal or lower severity, or a repeat, only joins the record.
    let w2 = finding("stuck-attempt", Some("req-1"), Some(1), Severity::Warning);
    assert_eq!(
        f.admit(&w2, links(), 6 * S, false),
        Admission::Merged(Merge::Notified)
    );
    assert_eq!(
        f.admit(&crit(AAR, "req-1", 9), links(), 6 * S, false),
        Admission::Duplicate { occurrences: 2 }
    );
    assert!(f.release_due(60 * S).is_empty());
    let active = f.active();
    assert_eq!(active.len(), 1);
    assert_eq!(active[0].alert.id, u.id, "the last notification, re-posted");
    assert_eq!(active[0].alert.findings.len(), 4, "with what merged since");
    assert_eq!(active[0].alert.occurrences, 2);
}

#[test]
fn group_wait_zero_is_one_notification_per_finding() {
    let mut f = flood(no_grouping());
    assert_eq!(
        f.admit(&crit(AAR, "req-1", 1), links(), 0, false),
        Admission::Opened { held: false }
    );
    assert_eq!(
        f.admit(&crit(AARF, "req-1", 1), links(), 0, false),
        Admission::Opened { held: false }
    );
    assert_eq!(f.next_release_ns(), Some(0), "due at once");
    let out = notes(f.release_due(0));
    assert_eq!(out.len(), 2);
    assert_eq!(out[0].rules, [AAR]);
    assert_eq!(out[1].rules, [AARF]);
    assert_ne!(
        out[0].incident, out[1].incident,
        "the rule is part of the key"
    );
    assert_eq!(out[0].incident_key, out[1].incident_key);
    // A retry breaking the same rule is still a repeat of its notification.
    assert_eq!(
        f.admit(&crit(AAR, "req-1", 2), links(), S, false),
        Admission::Duplicate { occurrences: 2 }
    );
    assert!(f.release_due(S).is_empty());
}

#[test]
fn repeats_within_the_dedup_window_fold_and_after_it_notify_again() {
    let mut f = flood(FloodConfig {
        dedup_window: Duration::from_secs(10),
        ..no_grouping()
    });
    let a = |room| crit(AAR, "req-a", room);
    f.admit(&a(1), links(), 0, false);
    assert_eq!(notes(f.release_due(0)).len(), 1);
    assert_eq!(
        f.admit(&a(2), links(), S, false),
        Admission::Duplicate { occurrences: 2 }
    );
    assert_eq!(
        f.admit(&a(3), links(), 2 * S, false),
        Admission::Duplicate { occurrences: 3 }
    );
    f.admit(&crit(AAR, "req-b", 7), links(), 2 * S, false);
    assert_eq!(notes(f.release_due(2 * S)).len(), 1);
    // After the window the incident is notified again, with its occurrences so far.
    assert_eq!(
        f.admit(&a(4), links(), 11 * S, false),
        Admission::Duplicate { occurrences: 4 }
    );
    let out = notes(f.release_due(11 * S));
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].update, Some(Update::Repeated));
    assert_eq!(out[0].sequence, 2);
    assert_eq!(out[0].occurrences, 4);
    // Quiet for a whole window: resolved.
    let (_, resolved) = f.tick(30 * S);
    assert_eq!(resolved.len(), 2);
    assert!(f.active().is_empty());
    assert_eq!(f.tracked(), 0);
}

#[test]
fn rate_limit_counts_notifications_and_summarises_suppressed() {
    let mut f = flood(FloodConfig {
        dedup_window: Duration::from_secs(1),
        rate_limit: 2,
        rate_limit_window: Duration::from_secs(60),
        max_tracked: 100,
        ..grouping(1)
    });
    for i in 0..10 {
        let req = format!("req-{i}");
        f.admit(&crit(AAR, &req, i), links(), i, false);
        // Two findings per request: still one notification, one slot.
        f.admit(&crit(AARF, &req, i), links(), i, false);
    }
    let out = f.release_due(2 * S);
    let sent = out
        .iter()
        .filter(|r| matches!(r, Release::Notify(_)))
        .count();
    assert_eq!(sent, 2);
    let limited: Vec<_> = out
        .iter()
        .filter_map(|r| match r {
            Release::RateLimited { lead_rule, rules } => Some((lead_rule.clone(), rules.len())),
            _ => None,
        })
        .collect();
    assert_eq!(limited.len(), 8);
    assert!(limited.iter().all(|(r, n)| r == AAR && *n == 2));
    // Another lead rule is not affected.
    f.admit(&crit("calm", "req-c", 99), links(), 2 * S, false);
    assert_eq!(notes(f.release_due(3 * S)).len(), 1);
    let (none, _) = f.tick(61 * S);
    assert!(none.is_empty(), "window still open");
    let (sums, _) = f.tick(63 * S);
    assert_eq!(sums.len(), 1);
    assert_eq!(sums[0].rule, AAR);
    assert_eq!(sums[0].suppressed, 8);
    assert_eq!(sums[0].findings, 16);
    assert_eq!(sums[0].fingerprints_sample.len(), SAMPLE);
}

#[test]
fn an_escalation_is_never_rate_limited() {
    let mut f = flood(FloodConfig {
        rate_limit: 1,
        ..grouping(1)
    });
    let w = finding(ORPHAN, Some("req-1"), Some(1), Severity::Warning);
    f.admit(&w, links(), 0, false);
    assert_eq!(notes(f.release_due(S)).len(), 1);
    let w2 = finding(ORPHAN, Some("req-2"), Some(2), Severity::Warning);
    f.admit(&w2, links(), S, false);
    assert!(matches!(
        f.release_due(2 * S)[..],
        [Release::RateLimited { .. }]
    ));
    f.admit(
        &finding(AAR, Some("req-1"), Some(1), Severity::Critical),
        links(),
        2 * S,
        false,
    );
    let out = notes(f.release_due(3 * S));
    assert_eq!(out[0].update, Some(Update::Escalated));
}

#[test]
fn findings_of_a_suppressed_update_are_counted_once() {
    let mut f = flood(FloodConfig {
        rate_limit: 1,
        dedup_window: Duration::from_secs(10),
        ..grouping(1)
    });
    f.admit(&crit(AAR, "req-1", 1), links(), 0, false);
    assert_eq!(notes(f.release_due(S)).len(), 1);
    // Past the dedup window: a repeated update, over the limit.
    f.admit(&crit(AARF, "req-1", 1), links(), 12 * S, false);
    let out = f.release_due(13 * S);
    assert!(
        matches!(&out[..], [Release::RateLimited { rules, .. }] if rules.len() == 1),
        "{out:?}"
    );
    f.admit(&crit(AAR, "req-1", 2), links(), 30 * S, false);
    let out = f.release_due(31 * S);
    assert!(
        matches!(&out[..], [Release::RateLimited { rules, .. }] if rules.is_empty()),
        "{out:?}"
    );
}

/// The original (OTLP evidence) and its follow-up confirmed by eBPF.
fn pair(req: &str) -> (Violation, Violation) {
    let mut v = crit(AAR, req, 7);
    v.evidence = vec![ev(Source::Otlp, 10)];
    let mut c = v.clone();
    c.corroborates = true;
    c.evidence = vec![ev(Source::Otlp, 10), ev(Source::Ebpf, 12)];
    (v, c)
}

fn sources(v: &Violation) -> Vec<Source> {
    v.evidence.iter().map(|e| e.source).collect()
}

#[test]
fn corroboration_is_not_a_repeat_and_takes_no_rate_slot() {
    let mut f = flood(FloodConfig {
        rate_limit: 2,
        ..no_grouping()
    });
    let (v, c) = pair("req-a");
    f.admit(&v, links(), 0, false);
    assert_eq!(notes(f.release_due(0)).len(), 1);
    // Already sent: merged into the active alert (what Alertmanager re-posts), no notification.
    assert_eq!(
        f.admit(&c, links(), S, false),
        Admission::Corroborated(Corroboration::Late { merged: true })
    );
    assert!(f.release_due(S).is_empty());
    let active = f.active();
    assert_eq!(active.len(), 1);
    assert_eq!(active[0].alert.occurrences, 1, "not counted as a repeat");
    assert_eq!(
        sources(&active[0].alert.violation),
        [Source::Otlp, Source::Ebpf]
    );
    assert_eq!(
        sources(&active[0].alert.findings[0].violation),
        [Source::Otlp, Source::Ebpf]
    );
    // The same confirmation again adds nothing.
    assert_eq!(
        f.admit(&c, links(), S, false),
        Admission::Corroborated(Corroboration::Late { merged: false })
    );
    // A real repeat still counts.
    let mut v2 = v.clone();
    v2.attempt.bootstrap_room = Some(8);
    assert_eq!(
        f.admit(&v2, links(), 2 * S, false),
        Admission::Duplicate { occurrences: 2 }
    );
    // The limit is 2: the first notification took one slot, the corroborations none, so one
    // more incident still goes out and only the next is limited.
    f.admit(&crit(AAR, "req-b", 1), links(), 2 * S, false);
    assert_eq!(notes(f.release_due(2 * S)).len(), 1);
    f.admit(&crit(AAR, "req-c", 2), links(), 2 * S, false);
    assert!(matches!(
        f.release_due(2 * S)[..],
        [Release::RateLimited { .. }]
    ));
    let sums = f.flush_summaries(3 * S);
    assert_eq!(sums[0].suppressed, 1);
}

#[test]
fn corroboration_of_another_attempt_does_not_merge_and_unknown_is_unmatched() {
    let mut f = flood(no_grouping());
    let (v, mut c) = pair("req-a");
    f.admit(&v, links(), 0, false);
    f.release_due(0);
    // Same request (another attempt of it), but no finding about that attempt.
    c.attempt.bootstrap_room = Some(99);
    assert_eq!(
        f.admit(&c, links(), S, false),
        Admission::Corroborated(Corroboration::Unmatched)
    );
    assert_eq!(f.active()[0].alert.violation.evidence.len(), 1);
    let (_, mut c) = pair("never-seen");
    c.attempt.bootstrap_room = Some(1234);
    assert_eq!(
        f.admit(&c, links(), S, false),
        Admission::Corroborated(Corroboration::Unmatched)
    );
    // The other source named the request by another alias, but the attempt is the same,
    // known by one shared alias: the original is found and completed.
    let (_, mut c) = pair("req-by-other-alias");
    c.request = RequestAliases {
        request_id: None,
        trace_id: Some("trace-1".into()),
    };
    c.attempt.rid = Some("rid-1".into());
    assert_eq!(
        f.admit(&c, links(), S, false),
        Admission::Corroborated(Corroboration::Late { merged: true })
    );
    let a = &f.active()[0].alert;
    assert_eq!(
        a.violation.fingerprint, v.fingerprint,
        "the original's fingerprint stays"
    );
    assert_eq!(a.violation.attempt.rid.as_deref(), Some("rid-1"));
    assert_eq!(a.violation.request.trace_id.as_deref(), Some("trace-1"));
    assert_eq!(a.violation.evidence.len(), 2);
}

#[test]
fn held_notification_goes_out_once_merged_when_corroborated() {
    let mut f = flood(FloodConfig {
        corroboration_window: Duration::from_secs(2),
        ..no_grouping()
    });
    let (v, c) = pair("req-a");
    assert_eq!(
        f.admit(&v, links(), 0, true),
        Admission::Opened { held: true }
    );
    assert_eq!(f.next_release_ns(), Some(2 * S));
    assert!(f.release_due(S / 4).is_empty(), "held");
    assert!(f.active().is_empty(), "held: not sent, not active");
    // A repeat while held rides on the held notification.
    let mut again = v.clone();
    again.attempt.bootstrap_room = Some(8);
    assert_eq!(
        f.admit(&again, links(), S / 2, true),
        Admission::Duplicate { occurrences: 2 }
    );
    assert_eq!(
        f.admit(&c, links(), S, true),
        Admission::Corroborated(Corroboration::MergedPending)
    );
    let out = notes(f.release_due(S));
    assert_eq!(out.len(), 1, "released by its corroboration");
    assert_eq!(sources(&out[0].violation), [Source::Otlp, Source::Ebpf]);
    assert_eq!(out[0].occurrences, 2);
    assert!(
        !out[0].violation.corroborates,
        "it is the original notification"
    );
    assert_eq!(f.next_release_ns(), None);
    assert!(f.release_due(10 * S).is_empty(), "sent once");
    assert_eq!(f.active().len(), 1);
}

#[test]
fn held_incident_waits_for_every_finding_and_its_group_wait() {
    let mut f = flood(FloodConfig {
        corroboration_window: Duration::from_secs(5),
        ..grouping(2)
    });
    let (v, c) = pair("req-a");
    let mut v2 = v.clone();
    v2.rule = AARF.into();
    let mut c2 = c.clone();
    c2.rule = AARF.into();
    assert_eq!(
        f.admit(&v, links(), 0, true),
        Admission::Opened { held: true }
    );
    assert_eq!(
        f.admit(&v2, links(), 0, true),
        Admission::Merged(Merge::Pending)
    );
    f.admit(&c, links(), S / 2, true);
    assert!(
        f.release_due(3 * S).is_empty(),
        "the second finding is not corroborated yet"
    );
    f.admit(&c2, links(), 3 * S, true);
    let out = notes(f.release_due(3 * S));
    assert_eq!(out.len(), 1);
    for fi in &out[0].findings {
        assert_eq!(sources(&fi.violation), [Source::Otlp, Source::Ebpf]);
    }
    // Corroborated within the group wait: out when the group wait ends, not before.
    let (v, c) = pair("req-b");
    f.admit(&v, links(), 10 * S, true);
    f.admit(&c, links(), 10 * S, true);
    assert!(f.release_due(11 * S).is_empty());
    assert_eq!(notes(f.release_due(12 * S)).len(), 1);
}

#[test]
fn held_notification_is_released_after_the_window_and_only_when_allowed() {
    let mut f = flood(FloodConfig {
        corroboration_window: Duration::from_secs(2),
        ..no_grouping()
    });
    let (v, c) = pair("req-a");
    f.admit(&v, links(), 0, true);
    assert!(f.release_due(S).is_empty());
    // Not forgotten by expiry while held, even past the dedup window.
    let _ = f.tick(0);
    let out = notes(f.release_due(2 * S));
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].violation.evidence.len(), 1);
    // The confirmation arriving after the window merges into the active alert instead.
    assert_eq!(
        f.admit(&c, links(), 3 * S, true),
        Admission::Corroborated(Corroboration::Late { merged: true })
    );
    // Caller says one source only: no hold. Evidence with two sources: no hold either.
    assert_eq!(
        f.admit(&crit(AAR, "req-b", 1), links(), 0, false),
        Admission::Opened { held: false }
    );
    let (_, mut both) = pair("req-c");
    both.corroborates = false;
    assert_eq!(
        f.admit(&both, links(), 0, true),
        Admission::Opened { held: false }
    );
    assert_eq!(notes(f.release_due(3 * S)).len(), 2);
    // Shutdown sends what is held or waiting.
    assert_eq!(
        f.admit(&crit(AAR, "req-d", 2), links(), 3 * S, true),
        Admission::Opened { held: true }
    );
    assert_eq!(notes(f.release_all(3 * S)).len(), 1);
}

#[test]
fn a_request_named_by_another_alias_later_is_still_one_incident() {
    let mut f = flood(grouping(2));
    // First finding: only the trace id was known.
    let mut first = crit(AAR, "unused", 1);
    first.request = RequestAliases {
        request_id: None,
        trace_id: Some("t1".into()),
    };
    f.admit(&first, links(), 0, false);
    // A later one once the x-request-id was known too: same incident.
    let mut later = crit(AARF, "req-1", 1);
    later.request.trace_id = Some("t1".into());
    assert_eq!(
        f.admit(&later, links(), S, false),
        Admission::Merged(Merge::Pending)
    );
    let a = notes(f.release_due(2 * S)).remove(0);
    assert_eq!(a.incident_key, "trace_id:t1");
    assert_eq!(a.rules, [AAR, AARF]);
    assert_eq!(
        a.violation.request.request_id.as_deref(),
        Some("req-1"),
        "the lead shows every alias the incident's findings knew"
    );
    // Known by the x-request-id alone now: still this incident.
    let mut by_id = crit(ORPHAN, "req-1", 1);
    by_id.severity = Severity::Warning;
    assert_eq!(
        f.admit(&by_id, links(), 3 * S, false),
        Admission::Merged(Merge::Notified)
    );
    // Forgotten with its incident: the index does not outlive it.
    let _ = f.tick(3600 * S);
    assert!(f.by_alias.is_empty());
    assert_eq!(
        f.admit(&later, links(), 3601 * S, false),
        Admission::Opened { held: false }
    );
}

#[test]
fn findings_naming_no_request_are_keyed_by_attempt() {
    let mut f = flood(grouping(2));
    f.admit(&crit(AAR, "req-1", 5), links(), 0, false);
    // Same attempt, request unknown to this finding: the attempt's incident.
    let anon = finding(ORPHAN, None, Some(5), Severity::Warning);
    assert_eq!(
        f.admit(&anon, links(), S, false),
        Admission::Merged(Merge::Pending)
    );
    // Another attempt with no request: its own incident, keyed by the room.
    let other = finding(ORPHAN, None, Some(6), Severity::Warning);
    assert_eq!(
        f.admit(&other, links(), S, false),
        Admission::Opened { held: false }
    );
    // A finding about another request that reuses a room does not join the first.
    assert_eq!(
        f.admit(&crit(AARF, "req-9", 5), links(), S, false),
        Admission::Opened { held: false }
    );
    let out = notes(f.release_due(3 * S));
    let keys: Vec<&str> = out.iter().map(|a| a.incident_key.as_str()).collect();
    assert_eq!(keys, ["request_id:req-1", "room:6", "request_id:req-9"]);
    assert_eq!(out[0].rules, [AAR, ORPHAN]);
}

#[test]
fn max_tracked_forgets_the_least_recent_notified_incident() {
    let mut f = flood(FloodConfig {
        max_tracked: 2,
        ..no_grouping()
    });
    f.admit(&crit(AAR, "req-1", 1), links(), 0, false);
    f.admit(&crit(AAR, "req-2", 2), links(), S, false);
    f.release_due(S);
    f.admit(&crit(AAR, "req-3", 3), links(), 2 * S, false);
    assert_eq!(f.tracked(), 2);
    assert_eq!(f.evictions, 1);
    let (_, resolved) = f.tick(2 * S);
    assert_eq!(resolved.len(), 1, "reported resolved to Alertmanager");
    assert_eq!(resolved[0].alert.incident_key, "request_id:req-1");
    assert_eq!(notes(f.release_due(2 * S)).len(), 1);
}
