//! The request page of a heavy request: 10 attempts (retries, each a new room) and 1,000
//! events from eBPF and OTLP, with a refusal and a breach on every attempt. Measures what
//! `/requests/{alias}` does per call (the timeline lookup in the recent-events index, then the
//! drawing), the page's size, and headless Chromium loading it from disk (`--dump-dom`) next to
//! an empty page (the browser's own start-up), so the difference is the page's cost.
//!
//! Run: `cargo bench -p revenant --bench pages` (the Chromium part needs `chromium`, which
//! `cargo xtask setup` installs; without it that part is skipped and says so).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use revenant::admin::{RecentEvents, RecentEventsLimits, TimelineProvider};
use revenant::event::{Kind, LifecycleEvent, Source, Stage};
use revenant::report::CancelWindow;
use revenant::report::html::page;
use revenant::report::request::{self, RequestPage};
use revenant::violation::{
    AttemptAliases, Evidence, EvidenceRole, RequestAliases, Severity, Violation,
};

const ATTEMPTS: u64 = 10;
const EVENTS_PER_ATTEMPT: u64 = 100;
const MS: u64 = 1_000_000;

fn workload() -> (Vec<LifecycleEvent>, Vec<Violation>) {
    let t0 = 1_795_986_930_000_000_000u64;
    let mut events = Vec::new();
    let mut violations = Vec::new();
    for a in 0..ATTEMPTS {
        let room = 0x314783F6BEF70000 + a;
        let base = t0 + a * 200 * MS;
        let src = |i: u64| {
            if i.is_multiple_of(2) {
                Source::Ebpf
            } else {
                Source::Otlp
            }
        };
        let ev = |t: u64, stage, kind, source| {
            LifecycleEvent::new(t, stage, kind, source).with_room(room)
        };
        events.push(
            ev(base, Stage::Router, Kind::Dispatched, Source::Ebpf).with_request_id("req-heavy"),
        );
        events.push(
            ev(base + MS, Stage::Router, Kind::Dispatched, Source::Otlp)
                .with_request_id("req-heavy"),
        );
        events.push(
            ev(base + 2 * MS, Stage::Prefill, Kind::Received, Source::Otlp)
                .with_rid(format!("rid-{a}")),
        );
        events
            .push(ev(base + 3 * MS, Stage::Prefill, Kind::Rejected, Source::Otlp).with_status(400));
        events
            .push(ev(base + 4 * MS, Stage::Prefill, Kind::Rejected, Source::Ebpf).with_status(400));
        events.push(ev(
            base + 5 * MS,
            Stage::Transfer,
            Kind::Received,
            Source::Ebpf,
        ));
        for i in 6..EVENTS_PER_ATTEMPT {
            let stage = if i % 5 == 0 {
                Stage::Transfer
            } else {
                Stage::Decode
            };
            events.push(ev(base + i * MS, stage, Kind::Work, src(i)));
        }
        violations.push(Violation {
            rule: "activity-after-rejection".into(),
            severity: Severity::Critical,
            summary: String::new(),
            request: RequestAliases {
                request_id: Some("req-heavy".into()),
                trace_id: None,
            },
            attempt: AttemptAliases {
                bootstrap_room: Some(room),
                rid: None,
            },
            worker: None,
            detected_at_ns: base + 6 * MS,
            fingerprint: "f".into(),
            evidence: vec![
                Evidence {
                    role: EvidenceRole::Trigger,
                    time_ns: base + 3 * MS,
                    stage: Stage::Prefill,
                    kind: Kind::Rejected,
                    source: Source::Otlp,
                    status: Some(400),
                    reason: None,
                },
                Evidence {
                    role: EvidenceRole::Offender,
                    time_ns: base + 6 * MS,
                    stage: Stage::Decode,
                    kind: Kind::Work,
                    source: src(6),
                    status: None,
                    reason: None,
                },
            ],
            corroborates: false,
        });
    }
    (events, violations)
}

fn render(index: &RecentEvents, violations: &[Violation], windows: &[CancelWindow]) -> String {
    let t = index.timeline("req-heavy").expect("indexed");
    page(
        "revenant: request timeline",
        &request::render(
            &RequestPage {
                timeline: &t,
                violations,
                windows,
            },
            "",
        ),
    )
}

/// Wall time of `chromium --headless --dump-dom file://PATH`, best of `runs`.
fn chromium_load(bin: &std::path::Path, path: &std::path::Path, runs: usize) -> Duration {
    let profile = tempfile::tempdir().unwrap();
    (0..runs)
        .map(|_| {
            let t = Instant::now();
            let out = Command::new(bin)
                .args([
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--no-first-run",
                    "--dump-dom",
                ])
                .arg(format!("--user-data-dir={}", profile.path().display()))
                .arg(format!("file://{}", path.display()))
                .stderr(Stdio::null())
                .output()
                .expect("chromium");
            assert!(out.status.success());
            t.elapsed()
        })
        .min()
        .unwrap()
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let (events, violations) = workload();
    let index = RecentEvents::new(RecentEventsLimits::default());
    index.record(&events);
    let windows = CancelWindow::of_set(&revenant::engine::check::RuleSet::embedded_defaults());
    let html = render(&index, &violations, &windows);
    // The lookup found every event of every attempt.
    assert!(
        html.contains(&format!("All events ({})", events.len())),
        "{} events indexed",
        events.len()
    );
    if !bench {
        println!(
            "pages: {} bytes; run with `cargo bench -p revenant --bench pages`",
            html.len()
        );
        return;
    }
    let iters = 200;
    let t = Instant::now();
    for _ in 0..iters {
        std::hint::black_box(render(&index, &violations, &windows));
    }
    let per = t.elapsed() / iters;
    println!(
        "pages: {} attempts, {} events: page {} bytes ({:.1} KiB), lookup + render {:.2} ms per page (mean of {iters})",
        ATTEMPTS,
        events.len(),
        html.len(),
        html.len() as f64 / 1024.0,
        per.as_secs_f64() * 1e3
    );
    let Some(bin) = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join("chromium"))
        .find(|p| p.is_file())
    else {
        println!(
            "pages: chromium not on PATH: the browser load is not measured (cargo xtask setup installs it)"
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let heavy = dir.path().join("heavy.html");
    let empty = dir.path().join("empty.html");
    std::fs::write(&heavy, &html).unwrap();
    std::fs::write(&empty, page("empty", "<p>empty</p>")).unwrap();
    let runs = 5;
    let e = chromium_load(&bin, &empty, runs);
    let h = chromium_load(&bin, &heavy, runs);
    println!(
        "pages: chromium --headless --dump-dom, best of {runs}: empty page {:.0} ms, this page {:.0} ms (the page's own cost {:.0} ms)",
        e.as_secs_f64() * 1e3,
        h.as_secs_f64() * 1e3,
        h.saturating_sub(e).as_secs_f64() * 1e3
    );
}
