//! The pages' promises: every id and span attribute escaped, marks per lane bounded with the
//! cut said, attempts and witnesses drawn, the cancellation window and breaches shown.

use super::html::page;
use super::incidents::{self, IncidentsPage, request_href};
use super::model::{CancelWindow, Timeline, TimelineEvent};
use super::request::{self, MAX_MARKS_PER_LANE, RequestPage};
use super::summary::{self, Report};
use crate::event::{Kind, RoomFields, Source, Stage};
use crate::violation::{
    AttemptAliases, Evidence, EvidenceRole, RequestAliases, Severity, Violation,
};

pub const EVIL: &str = "<img src=x onerror=\"document.title='pwned'\"></script><script>document.title='pwned'</script>'&";

fn ev(t: u64, stage: Stage, kind: Kind, source: Source) -> TimelineEvent {
    TimelineEvent {
        time_ns: t,
        stage,
        kind,
        source,
        request_id: None,
        trace_id: None,
        rid: None,
        room: None,
        node: None,
        worker: None,
        status: None,
        reason: None,
        to: None,
    }
}

fn timeline(events: Vec<TimelineEvent>) -> Timeline {
    Timeline {
        query: "q".into(),
        aliases: Default::default(),
        events,
        truncated: false,
    }
}

fn violation(rule: &str, room: u64, request_id: &str, trigger: u64, offender: u64) -> Violation {
    Violation {
        rule: rule.into(),
        severity: Severity::Critical,
        summary: format!("{rule}: {request_id}"),
        request: RequestAliases {
            request_id: Some(request_id.into()),
            trace_id: None,
        },
        attempt: AttemptAliases {
            bootstrap_room: Some(room),
            rid: None,
        },
        worker: None,
        detected_at_ns: offender,
        fingerprint: "f".into(),
        evidence: vec![
            Evidence {
                role: EvidenceRole::Trigger,
                time_ns: trigger,
                stage: Stage::Prefill,
                kind: Kind::Rejected,
                source: Source::Otlp,
                status: Some(400),
                reason: Some(EVIL.into()),
            },
            Evidence {
                role: EvidenceRole::Offender,
                time_ns: offender,
                stage: Stage::Decode,
                kind: Kind::Work,
                source: Source::Ebpf,
                status: None,
                reason: None,
            },
        ],
        corroborates: false,
    }
}

/// A request refused on its first attempt (room 7) and retried (room 8), decode working on the
/// refused one: seen by eBPF and OTLP.
fn retried() -> (Timeline, Vec<Violation>) {
    let ms = 1_000_000u64;
    let t0 = 1_700_000_000_000_000_000u64;
    let with = |mut e: TimelineEvent, room: Option<u64>| {
        e.request_id = Some("req-1".into());
        e.room = room.map(RoomFields::new);
        e
    };
    let mut events = vec![
        with(ev(t0, Stage::Router, Kind::Received, Source::Otlp), None),
        with(
            ev(t0 + ms, Stage::Router, Kind::Dispatched, Source::Ebpf),
            Some(7),
        ),
        with(
            ev(t0 + 2 * ms, Stage::Prefill, Kind::Rejected, Source::Otlp),
            Some(7),
        ),
        with(
            ev(t0 + 3 * ms, Stage::Prefill, Kind::Rejected, Source::Ebpf),
            Some(7),
        ),
        with(
            ev(t0 + 9 * ms, Stage::Decode, Kind::Work, Source::Ebpf),
            Some(7),
        ),
        with(
            ev(t0 + 20 * ms, Stage::Router, Kind::Dispatched, Source::Otlp),
            Some(8),
        ),
        with(
            ev(t0 + 25 * ms, Stage::Decode, Kind::Completed, Source::Otlp),
            Some(8),
        ),
    ];
    events[2].status = Some(400);
    events[2].rid = Some("rid-a".into());
    let v = violation(
        "activity-after-rejection",
        7,
        "req-1",
        t0 + 2 * ms,
        t0 + 9 * ms,
    );
    (timeline(events), vec![v])
}

fn windows() -> Vec<CancelWindow> {
    CancelWindow::of_set(&crate::engine::rules::RuleSet::embedded_defaults())
}

#[test]
fn cancellation_window_comes_from_the_rules() {
    assert_eq!(
        windows(),
        vec![CancelWindow {
            rule: "handoff-after-rejection".into(),
            grace_ns: 500_000_000
        }]
    );
}

#[test]
fn request_page_draws_attempts_witnesses_refusal_window_and_breach() {
    let (t, vs) = retried();
    let w = windows();
    let html = request::render(
        &RequestPage {
            timeline: &t,
            violations: &vs,
            windows: &w,
        },
        "",
    );
    // request-level block plus two attempts, four lanes each
    assert_eq!(html.matches("<g class=\"lane\"").count(), 12, "{html}");
    assert!(html.contains("data-attempt=\"1\"") && html.contains("data-attempt=\"2\""));
    // the two refusals 1 ms apart are one event seen by both witnesses
    assert_eq!(html.matches("<g class=\"mark both\"").count(), 1, "{html}");
    assert_eq!(html.matches("<g class=\"mark ").count(), 6);
    assert!(html.contains("class=\"refusal\""));
    assert!(html.contains("class=\"cancel-window\" data-rule=\"handoff-after-rejection\""));
    assert!(html.contains(
        "<g class=\"breach\" data-rule=\"activity-after-rejection\" data-severity=\"critical\">"
    ));
    assert_eq!(
        html.matches("class=\"breach-ring\"").count(),
        2,
        "trigger and offender"
    );
    // each id once: the request id, the room in decimal and hex, the rid
    for id in ["req-1", ">7<", ">0x7<", ">8<", ">0x8<", "rid-a"] {
        assert_eq!(html.matches(id).count(), 1, "{id} in {html}");
    }
}

/// Markup in every id field and in every span attribute reaches the page as text only.
#[test]
fn markup_in_ids_and_attributes_is_escaped_everywhere() {
    let mut events = Vec::new();
    for (i, stage) in Stage::ALL.into_iter().enumerate() {
        let mut e = ev(
            1_000 + i as u64 * 1_000_000,
            stage,
            if stage == Stage::Prefill {
                Kind::Rejected
            } else {
                Kind::Work
            },
            Source::Otlp,
        );
        e.request_id = Some(EVIL.into());
        e.trace_id = Some(format!("trace{EVIL}"));
        e.rid = Some(format!("rid{EVIL}"));
        e.room = Some(RoomFields::new(9));
        e.node = Some(format!("node{EVIL}"));
        e.worker = Some(format!("worker{EVIL}"));
        e.reason = Some(format!("reason{EVIL}"));
        events.push(e);
    }
    let t = timeline(events);
    let mut v = violation(
        &format!("rule{EVIL}"),
        9,
        EVIL,
        1_000_001_000,
        3_000_001_000,
    );
    v.worker = Some(EVIL.into());
    v.evidence[0].time_ns = 1_000_000 + 1_000;
    v.evidence[1].time_ns = 3_000_000 + 1_000;
    v.evidence[1].source = Source::Otlp;
    let vs = vec![v.clone()];
    let w = vec![CancelWindow {
        rule: format!("win{EVIL}"),
        grace_ns: 1,
    }];
    let body = request::render(
        &RequestPage {
            timeline: &t,
            violations: &vs,
            windows: &w,
        },
        "",
    );
    let rows = [(1u64, &v)];
    let link = |a: &str| request_href(a);
    let list = incidents::render(&IncidentsPage {
        rows: &rows,
        rules: &[format!("rule{EVIL}")],
        rule: None,
        severity: None,
        total_seen: 1,
        limit: 10,
        link: &link,
    });
    let report = summary::render(&Report {
        files: &[format!("file{EVIL}")],
        events: 4,
        violations: &vs,
        requests: std::slice::from_ref(&t),
        requests_left_out: 0,
        windows: &w,
    });
    for html in [page("t", &body), page("t", &list), report] {
        assert!(!html.contains("<img"), "{html}");
        assert!(!html.contains("<script"), "{html}");
        assert!(!html.contains("</script"), "{html}");
        assert!(!html.contains("onerror=\""), "{html}");
        assert!(
            html.contains("&lt;img src=x onerror=&quot;document.title=&#39;pwned&#39;&quot;&gt;")
        );
    }
    // the link carries the id percent-encoded: it cannot leave its attribute or its path
    assert!(list.contains("href=\"requests/%3Cimg%20src%3Dx"), "{list}");
}

/// A request with thousands of events: each lane capped, the cut said, the page bounded.
#[test]
fn thousands_of_events_are_bounded_and_the_cut_is_said() {
    let mut events = Vec::new();
    for i in 0..5_000u64 {
        let mut e = ev(i * 1_000_000, Stage::Decode, Kind::Work, Source::Otlp);
        e.room = Some(RoomFields::new(1));
        events.push(e);
    }
    let mut r = ev(
        2_500 * 1_000_000,
        Stage::Prefill,
        Kind::Rejected,
        Source::Otlp,
    );
    r.room = Some(RoomFields::new(1));
    events.push(r);
    events.sort_by_key(|e| e.time_ns);
    let v = violation("x", 1, "req", 2_500 * 1_000_000, 4_000 * 1_000_000);
    let mut v = v;
    v.evidence[1].source = Source::Otlp;
    let t = timeline(events);
    let html = request::render(
        &RequestPage {
            timeline: &t,
            violations: std::slice::from_ref(&v),
            windows: &[],
        },
        "",
    );
    assert_eq!(
        html.matches("<g class=\"mark ").count(),
        MAX_MARKS_PER_LANE + 1,
        "decode capped, the refusal drawn"
    );
    assert!(html.contains(&format!(
        "{} more events not drawn",
        5_000 - MAX_MARKS_PER_LANE
    )));
    assert!(html.contains("more events not listed"));
    // the breach's offender is drawn even though most work marks are not
    assert!(
        html.contains("<g class=\"breach\" data-rule=\"x\""),
        "offender kept"
    );
    assert!(html.len() < 200_000, "{} bytes", html.len());
}
