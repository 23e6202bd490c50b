//! One request's page: every attempt (a retry is a new room) as a block of four swimlanes
//! (router, prefill, transfer, decode) on one time axis, one mark per event coloured by the
//! witness that saw it, the refusal, the cancellation window after it and each breach with its
//! rule and severity drawn where its evidence is. Server-rendered SVG with `<title>` tooltips:
//! readable without JavaScript, and no script is ever part of a page.
//!
//! Every id appears once, in the ids tables: request and trace ids for the request, room
//! (decimal and hex) and rid per attempt. Marks, lanes and breaches name the attempt by its
//! number instead, so a page stays readable when ids are long.
//!
//! Bounded for a request with thousands of events: at most [`MAX_MARKS_PER_LANE`] marks per
//! lane (refusals, breaches and every kind other than `work` first) and [`MAX_TABLE_ROWS`]
//! rows in the event table, each cut said on the page with the number left out.

use std::collections::HashMap;
use std::fmt::Write as _;

use super::html::{Esc, rel_ms};
use super::model::{CancelWindow, Timeline, TimelineEvent};
use crate::event::{Kind, Source, Stage};
use crate::violation::{EvidenceRole, Severity, Violation};

/// Marks drawn per lane; the rest are counted in the lane.
pub const MAX_MARKS_PER_LANE: usize = 150;
/// Rows of the event table; the rest are counted under it.
pub const MAX_TABLE_ROWS: usize = 300;
/// An eBPF and an OTLP event of the same lane and kind this close are one event seen by both
/// witnesses: the default clock skew between nodes, within which revenant cannot order them.
const BOTH_WINDOW_NS: u64 = 50_000_000;

const LEFT: f64 = 110.0;
const PLOT_W: f64 = 900.0;
const RIGHT: f64 = 60.0;
const AXIS_H: f64 = 28.0;
const BLOCK_HEAD: f64 = 20.0;
const LANE_H: f64 = 24.0;
const BLOCK_GAP: f64 = 10.0;

/// What one request page is drawn from.
pub struct RequestPage<'a> {
    pub timeline: &'a Timeline,
    /// The violations about this request (any of its aliases); others are ignored.
    pub violations: &'a [Violation],
    pub windows: &'a [CancelWindow],
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Witness {
    Ebpf,
    Otlp,
    Both,
    Replay,
}

impl Witness {
    fn of(s: Source) -> Witness {
        match s {
            Source::Ebpf => Witness::Ebpf,
            Source::Otlp => Witness::Otlp,
            Source::Replay => Witness::Replay,
        }
    }
    fn class(self) -> &'static str {
        match self {
            Witness::Ebpf => "ebpf",
            Witness::Otlp => "otlp",
            Witness::Both => "both",
            Witness::Replay => "replay",
        }
    }
    fn label(self) -> &'static str {
        match self {
            Witness::Ebpf => "eBPF",
            Witness::Otlp => "OTLP",
            Witness::Both => "eBPF + OTLP",
            Witness::Replay => "replay",
        }
    }
    fn colour(self) -> &'static str {
        match self {
            Witness::Ebpf => "#2b6cb0",
            Witness::Otlp => "#dd6b20",
            Witness::Both => "#2f855a",
            Witness::Replay => "#718096",
        }
    }
}

pub(super) fn severity_colour(s: Severity) -> &'static str {
    match s {
        Severity::Critical => "#c53030",
        Severity::Warning => "#d69e2e",
        Severity::Info => "#3182ce",
    }
}

fn role_str(r: EvidenceRole) -> &'static str {
    match r {
        EvidenceRole::Trigger => "trigger",
        EvidenceRole::Offender => "offender",
        EvidenceRole::Expected => "expected",
        EvidenceRole::Context => "context",
    }
}

/// One drawn event: the event (or the pair of witnesses' events) at one place in one lane.
struct Mark {
    t: u64,
    /// The other witness's event, when both saw it.
    other: Option<usize>,
    ev: usize,
    witness: Witness,
    /// (violation, role) of each breach this event is evidence of.
    breaches: Vec<(usize, EvidenceRole)>,
}

/// One attempt of the request: the events joined by a room or a rid.
#[derive(Default)]
struct Attempt {
    rooms: Vec<u64>,
    rids: Vec<String>,
    events: Vec<usize>,
}

/// A block of lanes: an attempt, or the events that name no attempt (the router's receipt).
struct Block {
    /// 1-based attempt number; `None` for the request-level block.
    attempt: Option<usize>,
    lanes: [Vec<Mark>; 4],
}

fn find(parent: &mut [usize], mut i: usize) -> usize {
    while parent[i] != i {
        parent[i] = parent[parent[i]];
        i = parent[i];
    }
    i
}

/// Attempts by shared room or rid (union-find over the events, numbered by first event time);
/// the attempt of every event, `None` for events naming neither.
fn attempts(events: &[TimelineEvent]) -> (Vec<Option<usize>>, Vec<Attempt>) {
    #[derive(Hash, PartialEq, Eq)]
    enum Key<'a> {
        Room(u64),
        Rid(&'a str),
    }
    let mut parent: Vec<usize> = (0..events.len()).collect();
    let mut first: HashMap<Key<'_>, usize> = HashMap::new();
    for (i, e) in events.iter().enumerate() {
        let keys = e
            .room
            .map(|r| Key::Room(r.room()))
            .into_iter()
            .chain(e.rid.as_deref().map(Key::Rid));
        for k in keys {
            let j = *first.entry(k).or_insert(i);
            let (a, b) = (find(&mut parent, i), find(&mut parent, j));
            if a != b {
                parent[a.max(b)] = a.min(b);
            }
        }
    }
    let mut of = vec![None; events.len()];
    let mut number: HashMap<usize, usize> = HashMap::new();
    let mut list: Vec<Attempt> = Vec::new();
    for (i, e) in events.iter().enumerate() {
        if e.room.is_none() && e.rid.is_none() {
            continue;
        }
        let root = find(&mut parent, i);
        let n = *number.entry(root).or_insert_with(|| {
            list.push(Attempt::default());
            list.len() - 1
        });
        of[i] = Some(n);
        let a = &mut list[n];
        a.events.push(i);
        if let Some(r) = e.room
            && !a.rooms.contains(&r.room())
        {
            a.rooms.push(r.room());
        }
        if let Some(r) = &e.rid
            && !a.rids.contains(r)
        {
            a.rids.push(r.clone());
        }
    }
    (of, list)
}

/// Marks of one lane from its events (in time order): an eBPF and an OTLP event of one kind
/// within [`BOTH_WINDOW_NS`] become one mark of both witnesses.
fn lane_marks(events: &[TimelineEvent], idx: &[usize]) -> Vec<Mark> {
    let mut paired = vec![false; idx.len()];
    let mut marks = Vec::new();
    for (p, &i) in idx.iter().enumerate() {
        if paired[p] {
            continue;
        }
        let e = &events[i];
        let mut other = None;
        if matches!(e.source, Source::Ebpf | Source::Otlp) {
            for (q, &j) in idx.iter().enumerate().skip(p + 1) {
                let f = &events[j];
                if f.time_ns - e.time_ns > BOTH_WINDOW_NS {
                    break;
                }
                if !paired[q]
                    && f.kind == e.kind
                    && matches!(f.source, Source::Ebpf | Source::Otlp)
                    && f.source != e.source
                {
                    paired[q] = true;
                    other = Some(j);
                    break;
                }
            }
        }
        marks.push(Mark {
            t: e.time_ns,
            other,
            ev: i,
            witness: if other.is_some() {
                Witness::Both
            } else {
                Witness::of(e.source)
            },
            breaches: Vec::new(),
        });
    }
    marks
}

fn lane_of(s: Stage) -> usize {
    s as usize
}

/// Whether `v` is about this request: one of its aliases is among the timeline's ids.
pub fn concerns(v: &Violation, t: &Timeline) -> bool {
    let ev = &t.events;
    v.request
        .request_id
        .as_deref()
        .is_some_and(|r| ev.iter().any(|e| e.request_id.as_deref() == Some(r)))
        || v.request
            .trace_id
            .as_deref()
            .is_some_and(|r| ev.iter().any(|e| e.trace_id.as_deref() == Some(r)))
        || v.attempt
            .rid
            .as_deref()
            .is_some_and(|r| ev.iter().any(|e| e.rid.as_deref() == Some(r)))
        || v.attempt
            .bootstrap_room
            .is_some_and(|r| ev.iter().any(|e| e.room.map(|x| x.room()) == Some(r)))
}

/// A tick step (ns) giving at most about eight ticks over `span`: 1, 2 or 5 times a power of ten.
fn tick_step(span: u64) -> u64 {
    let mut step = 1_000u64;
    loop {
        for m in [1, 2, 5] {
            if span / (step * m) <= 8 {
                return step * m;
            }
        }
        step = step.saturating_mul(10);
    }
}

fn fmt_offset(d: u64) -> String {
    if d >= 10_000_000_000 {
        format!("+{:.0} s", d as f64 / 1e9)
    } else if d >= 1_000_000_000 {
        format!("+{:.1} s", d as f64 / 1e9)
    } else if d >= 1_000_000 {
        format!("+{} ms", d / 1_000_000)
    } else {
        format!("+{:.3} ms", d as f64 / 1e6)
    }
}

/// The marks to draw out of `n`: those in `priority` first (in order, up to `cap`), then others
/// spread evenly over the lane. Returns the chosen indices in time order.
fn choose(marks: &[Mark], events: &[TimelineEvent], cap: usize) -> Vec<usize> {
    if marks.len() <= cap {
        return (0..marks.len()).collect();
    }
    let important = |m: &Mark| !m.breaches.is_empty() || events[m.ev].kind != Kind::Work;
    let mut chosen: Vec<usize> = (0..marks.len())
        .filter(|&i| !marks[i].breaches.is_empty())
        .take(cap)
        .collect();
    for (i, m) in marks.iter().enumerate() {
        if chosen.len() >= cap {
            break;
        }
        if important(m) && m.breaches.is_empty() {
            chosen.push(i);
        }
    }
    let rest: Vec<usize> = (0..marks.len())
        .filter(|&i| !important(&marks[i]))
        .collect();
    let slots = cap - chosen.len();
    if slots > 0 && !rest.is_empty() {
        let step = rest.len() as f64 / slots as f64;
        let mut last = usize::MAX;
        for k in 0..slots {
            let i = rest[((k as f64 * step) as usize).min(rest.len() - 1)];
            if i != last {
                chosen.push(i);
                last = i;
            }
        }
    }
    chosen.sort_unstable();
    chosen.dedup();
    chosen
}

/// Renders the page body (no `<html>` shell): ids, breaches, the swimlanes, the event table.
/// `anchor` prefixes element ids, so that several requests can share one document.
pub fn render(p: &RequestPage<'_>, anchor: &str) -> String {
    let events = &p.timeline.events;
    let violations: Vec<&Violation> = p
        .violations
        .iter()
        .filter(|v| !v.corroborates && concerns(v, p.timeline))
        .collect();
    let (attempt_of, list) = attempts(events);
    let mut out = String::with_capacity(16 * 1024 + events.len() * 400);

    // Ids, each once.
    let distinct = |f: fn(&TimelineEvent) -> Option<&String>| {
        let mut v: Vec<&str> = Vec::new();
        for e in events {
            if let Some(s) = f(e)
                && !v.contains(&s.as_str())
            {
                v.push(s);
            }
        }
        v
    };
    let request_ids = distinct(|e| e.request_id.as_ref());
    let trace_ids = distinct(|e| e.trace_id.as_ref());
    let _ = write!(
        out,
        "<section class=\"ids\" id=\"{}ids\"><h2>Ids</h2><table>",
        Esc(anchor)
    );
    for (what, ids) in [("request id", &request_ids), ("trace id", &trace_ids)] {
        for id in ids.iter() {
            let _ = write!(
                out,
                "<tr><th>{what}</th><td class=\"id\" data-field=\"{}\">{}</td></tr>",
                what.replace(' ', "_"),
                Esc(id)
            );
        }
    }
    if request_ids.is_empty() && trace_ids.is_empty() {
        out.push_str(
            "<tr><th>request</th><td>no request or trace id seen: known by its attempts</td></tr>",
        );
    }
    out.push_str("</table><table class=\"attempts\"><tr><th>attempt</th><th>room (decimal)</th><th>room (hex)</th><th>rid</th><th>first event</th><th>events</th></tr>");
    let t0 = events.first().map_or(0, |e| e.time_ns);
    for (n, a) in list.iter().enumerate() {
        let rooms_dec: Vec<String> = a.rooms.iter().map(|r| r.to_string()).collect();
        let rooms_hex: Vec<String> = a.rooms.iter().map(|r| format!("{r:#x}")).collect();
        let _ = write!(
            out,
            "<tr class=\"attempt-row\" data-attempt=\"{}\"><td>attempt {}</td><td class=\"id\" data-field=\"room\">{}</td><td class=\"id\" data-field=\"room_hex\">{}</td><td class=\"id\" data-field=\"rid\">{}</td><td>{}</td><td>{}</td></tr>",
            n + 1,
            n + 1,
            Esc(&rooms_dec.join(", ")),
            Esc(&rooms_hex.join(", ")),
            Esc(&a.rids.join(", ")),
            rel_ms(events[a.events[0]].time_ns, t0),
            a.events.len()
        );
    }
    out.push_str("</table>");
    if let Some(e) = events.first() {
        let _ = write!(
            out,
            "<p>Times are relative to the first event, {} (event time).</p>",
            crate::alert::notification::rfc3339(e.time_ns)
        );
    }
    out.push_str("</section>\n");

    // Blocks and marks.
    let mut blocks: Vec<Block> = Vec::new();
    let request_level: Vec<usize> = (0..events.len())
        .filter(|&i| attempt_of[i].is_none())
        .collect();
    let mut block_of_attempt: Vec<usize> = Vec::with_capacity(list.len());
    let lanes_of = |idx: &[usize]| -> [Vec<Mark>; 4] {
        let by_stage = |s: Stage| -> Vec<usize> {
            idx.iter()
                .copied()
                .filter(|&i| events[i].stage == s)
                .collect()
        };
        Stage::ALL.map(|s| lane_marks(events, &by_stage(s)))
    };
    if !request_level.is_empty() {
        blocks.push(Block {
            attempt: None,
            lanes: lanes_of(&request_level),
        });
    }
    for (n, a) in list.iter().enumerate() {
        block_of_attempt.push(blocks.len());
        blocks.push(Block {
            attempt: Some(n + 1),
            lanes: lanes_of(&a.events),
        });
    }
    // Each violation's evidence onto the marks of its attempt (else of any block).
    let mut undrawn_evidence = vec![0usize; violations.len()];
    for (vi, v) in violations.iter().enumerate() {
        let attempt = list.iter().position(|a| {
            v.attempt
                .bootstrap_room
                .is_some_and(|r| a.rooms.contains(&r))
                || v.attempt.rid.as_ref().is_some_and(|r| a.rids.contains(r))
        });
        for ev in &v.evidence {
            let candidates: Vec<usize> = match attempt {
                Some(a) => vec![block_of_attempt[a]],
                None => (0..blocks.len()).collect(),
            };
            let mut found = false;
            'search: for b in candidates {
                for m in blocks[b].lanes[lane_of(ev.stage)].iter_mut() {
                    let hit = |i: usize| {
                        let e = &events[i];
                        e.time_ns == ev.time_ns && e.kind == ev.kind && e.source == ev.source
                    };
                    if hit(m.ev) || m.other.is_some_and(hit) {
                        m.breaches.push((vi, ev.role));
                        found = true;
                        break 'search;
                    }
                }
            }
            if !found {
                undrawn_evidence[vi] += 1;
            }
        }
    }

    // Breaches.
    let _ = write!(
        out,
        "<section class=\"breaches\" id=\"{}breaches\"><h2>Breaches ({})</h2>",
        Esc(anchor),
        violations.len()
    );
    if violations.is_empty() {
        out.push_str("<p>No violation about this request is known here (the admin server keeps the most recent ones).</p>");
    } else {
        out.push_str("<table><tr><th>rule</th><th>severity</th><th>attempt</th><th>detected</th><th>evidence</th></tr>");
        for (vi, v) in violations.iter().enumerate() {
            let attempt = list
                .iter()
                .position(|a| {
                    v.attempt
                        .bootstrap_room
                        .is_some_and(|r| a.rooms.contains(&r))
                        || v.attempt.rid.as_ref().is_some_and(|r| a.rids.contains(r))
                })
                .map_or_else(|| "request".to_string(), |n| format!("attempt {}", n + 1));
            let _ = write!(
                out,
                "<tr class=\"breach-row\" data-rule=\"{}\" data-severity=\"{}\"><td class=\"rule\">{}</td><td><span class=\"sev sev-{}\">{}</span></td><td>{}</td><td>{}</td><td><ul>",
                Esc(&v.rule),
                v.severity.as_str(),
                Esc(&v.rule),
                v.severity.as_str(),
                v.severity.as_str(),
                attempt,
                rel_ms(v.detected_at_ns, t0),
            );
            for e in &v.evidence {
                let _ = write!(
                    out,
                    "<li>{}: {} {} ({}){}{} at {}</li>",
                    role_str(e.role),
                    e.stage.as_str(),
                    e.kind.as_str(),
                    Witness::of(e.source).label(),
                    e.status
                        .map(|s| format!(", status {s}"))
                        .unwrap_or_default(),
                    e.reason
                        .as_deref()
                        .map(|r| format!(", reason {}", Esc(r)))
                        .unwrap_or_default(),
                    rel_ms(e.time_ns, t0)
                );
            }
            if undrawn_evidence[vi] > 0 {
                let _ = write!(
                    out,
                    "<li class=\"notice\">{} evidence event(s) not among the events shown (evicted from the recent-events index)</li>",
                    undrawn_evidence[vi]
                );
            }
            out.push_str("</ul></td></tr>");
        }
        out.push_str("</table>");
    }
    out.push_str("</section>\n");

    // Time range: the events, the windows after refusals, the detections.
    let grace = p.windows.iter().max_by_key(|w| w.grace_ns);
    let mut t_end = events.last().map_or(t0, |e| e.time_ns);
    if let Some(w) = grace {
        for e in events.iter().filter(|e| e.kind == Kind::Rejected) {
            t_end = t_end.max(e.time_ns.saturating_add(w.grace_ns));
        }
    }
    for v in &violations {
        t_end = t_end.max(v.detected_at_ns);
    }
    let span = (t_end.saturating_sub(t0)).max(1_000_000);
    let x = |t: u64| LEFT + (t.saturating_sub(t0)) as f64 * PLOT_W / span as f64;

    // Notices: nothing is cut silently.
    let mut notices: Vec<String> = Vec::new();
    if p.timeline.truncated {
        notices.push(format!(
            "More events are linked to this request than one answer carries: the oldest were left out ({} shown).",
            events.len()
        ));
    }

    let height = AXIS_H + blocks.len() as f64 * (BLOCK_HEAD + 4.0 * LANE_H + BLOCK_GAP) + 4.0;
    let width = LEFT + PLOT_W + RIGHT;
    let _ = write!(
        out,
        "<section class=\"lanes\" id=\"{}lanes\"><h2>Swimlanes</h2><p class=\"legend\">\
         <span><i class=\"sw\" style=\"background:{}\"></i>eBPF</span>\
         <span><i class=\"sw\" style=\"background:{}\"></i>OTLP</span>\
         <span><i class=\"sw\" style=\"background:{}\"></i>eBPF + OTLP (same event, both witnesses)</span>\
         <span><i class=\"sw\" style=\"background:{}\"></i>replay</span>\
         <span>◆ refusal</span><span>ring: breach evidence, coloured by severity</span>\
         <span>grey band: cancellation window</span></p>",
        Esc(anchor),
        Witness::Ebpf.colour(),
        Witness::Otlp.colour(),
        Witness::Both.colour(),
        Witness::Replay.colour()
    );
    let _ = write!(
        out,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"timeline\" width=\"{width:.0}\" height=\"{height:.0}\" viewBox=\"0 0 {width:.0} {height:.0}\" role=\"img\" aria-label=\"swimlanes of the request's attempts\">"
    );
    // Axis.
    let step = tick_step(span);
    let mut d = 0u64;
    while d <= span {
        let xx = x(t0 + d);
        let _ = write!(
            out,
            "<line x1=\"{xx:.1}\" y1=\"{:.1}\" x2=\"{xx:.1}\" y2=\"{height:.1}\" stroke=\"#e2e8f0\"/><text x=\"{xx:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
            AXIS_H - 6.0,
            AXIS_H - 10.0,
            fmt_offset(d)
        );
        d += step;
    }
    let mut not_drawn_total = 0usize;
    for (bi, block) in blocks.iter().enumerate() {
        let top = AXIS_H + bi as f64 * (BLOCK_HEAD + 4.0 * LANE_H + BLOCK_GAP);
        let lanes_top = top + BLOCK_HEAD;
        let lanes_bottom = lanes_top + 4.0 * LANE_H;
        let (label, attr) = match block.attempt {
            Some(n) => (format!("attempt {n}"), n.to_string()),
            None => ("request (no attempt id)".to_string(), "request".to_string()),
        };
        let _ = write!(
            out,
            "<g class=\"attempt\" data-attempt=\"{attr}\"><text x=\"4\" y=\"{:.1}\" font-weight=\"bold\">{label}</text>",
            top + 14.0
        );
        // Lane backgrounds under everything, then the windows, then the marks.
        for li in 0..4 {
            let _ = write!(
                out,
                "<rect x=\"{LEFT}\" y=\"{:.1}\" width=\"{PLOT_W}\" height=\"{LANE_H}\" fill=\"{}\"/>",
                lanes_top + li as f64 * LANE_H,
                if li % 2 == 0 { "#f7fafc" } else { "#edf2f7" },
            );
        }
        // Refusals: the cancellation window after each, then the refusal line.
        for lane in &block.lanes {
            for m in lane {
                if events[m.ev].kind != Kind::Rejected {
                    continue;
                }
                let xr = x(m.t);
                if let Some(w) = grace {
                    let xe = x(m.t.saturating_add(w.grace_ns));
                    let _ = write!(
                        out,
                        "<rect class=\"cancel-window\" data-rule=\"{}\" x=\"{xr:.1}\" y=\"{lanes_top:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"#a0aec0\" fill-opacity=\"0.35\"><title>cancellation window: {} after the refusal a dispatch still counts as in flight ({})</title></rect><text class=\"cancel-window-label\" x=\"{:.1}\" y=\"{:.1}\" fill=\"#4a5568\" text-anchor=\"end\">cancellation window {}</text>",
                        Esc(&w.rule),
                        (xe - xr).max(1.0),
                        4.0 * LANE_H,
                        humantime::format_duration(std::time::Duration::from_nanos(w.grace_ns)),
                        Esc(&w.rule),
                        xe - 3.0,
                        top + 14.0,
                        humantime::format_duration(std::time::Duration::from_nanos(w.grace_ns)),
                    );
                }
                let _ = write!(
                    out,
                    "<line class=\"refusal\" x1=\"{xr:.1}\" y1=\"{lanes_top:.1}\" x2=\"{xr:.1}\" y2=\"{lanes_bottom:.1}\" stroke=\"#c53030\" stroke-dasharray=\"4 3\"/><text class=\"refusal-label\" x=\"{:.1}\" y=\"{:.1}\" fill=\"#c53030\">refused by {}{}</text>",
                    xr + 3.0,
                    top + 14.0,
                    events[m.ev].stage.as_str(),
                    events[m.ev]
                        .status
                        .map(|s| format!(" ({s})"))
                        .unwrap_or_default(),
                );
            }
        }
        for (li, lane) in block.lanes.iter().enumerate() {
            let stage = Stage::ALL[li];
            let y0 = lanes_top + li as f64 * LANE_H;
            let cy = y0 + LANE_H / 2.0;
            let _ = write!(
                out,
                "<g class=\"lane\" data-stage=\"{}\" data-attempt=\"{attr}\"><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
                stage.as_str(),
                LEFT - 6.0,
                cy + 4.0,
                stage.as_str()
            );
            let chosen = choose(lane, events, MAX_MARKS_PER_LANE);
            for &mi in &chosen {
                let m = &lane[mi];
                let e = &events[m.ev];
                let xm = x(m.t);
                let mut tip = format!(
                    "{} · {} {} · {}",
                    rel_ms(m.t, t0),
                    e.stage.as_str(),
                    e.kind.as_str(),
                    m.witness.label()
                );
                if let Some(o) = m.other {
                    let _ = write!(
                        tip,
                        " ({} at {})",
                        Witness::of(events[o].source).label(),
                        rel_ms(events[o].time_ns, t0)
                    );
                }
                if let Some(s) = e.status {
                    let _ = write!(tip, " · status {s}");
                }
                if let Some(to) = e.to {
                    let _ = write!(tip, " · to {}", to.as_str());
                }
                for (k, v) in [
                    ("reason", &e.reason),
                    ("node", &e.node),
                    ("worker", &e.worker),
                ] {
                    if let Some(v) = v {
                        let _ = write!(tip, " · {k} {v}");
                    }
                }
                let _ = write!(
                    out,
                    "<g class=\"mark {}\" data-kind=\"{}\">",
                    m.witness.class(),
                    e.kind.as_str()
                );
                for (vi, role) in &m.breaches {
                    let v = violations[*vi];
                    let _ = write!(
                        out,
                        "<circle class=\"breach-ring\" data-role=\"{}\" cx=\"{xm:.1}\" cy=\"{cy:.1}\" r=\"9\" fill=\"none\" stroke=\"{}\" stroke-width=\"3\"/>",
                        role_str(*role),
                        severity_colour(v.severity)
                    );
                }
                if e.kind == Kind::Rejected {
                    let _ = write!(
                        out,
                        "<path class=\"refusal-mark\" d=\"M{xm:.1} {:.1}l6 6l-6 6l-6 -6z\" fill=\"{}\" stroke=\"#c53030\" stroke-width=\"2\"/>",
                        cy - 6.0,
                        m.witness.colour()
                    );
                } else {
                    let _ = write!(
                        out,
                        "<circle cx=\"{xm:.1}\" cy=\"{cy:.1}\" r=\"4.5\" fill=\"{}\"/>",
                        m.witness.colour()
                    );
                }
                let _ = write!(out, "<title>{}</title></g>", Esc(&tip));
                // The breach named where it happened: at its offender (else its last evidence).
                for (vi, role) in &m.breaches {
                    let v = violations[*vi];
                    let lead = matches!(role, EvidenceRole::Offender | EvidenceRole::Expected)
                        || (!v.evidence.iter().any(|e| {
                            matches!(e.role, EvidenceRole::Offender | EvidenceRole::Expected)
                        }) && v.evidence.last().is_some_and(|l| l.time_ns == m.t));
                    if lead {
                        let _ = write!(
                            out,
                            "<g class=\"breach\" data-rule=\"{}\" data-severity=\"{}\"><text x=\"{:.1}\" y=\"{:.1}\" fill=\"{}\" font-weight=\"bold\">{} · {}</text></g>",
                            Esc(&v.rule),
                            v.severity.as_str(),
                            xm + 11.0,
                            cy - 2.0,
                            severity_colour(v.severity),
                            Esc(&v.rule),
                            v.severity.as_str()
                        );
                    }
                }
            }
            let omitted = lane.len() - chosen.len();
            if omitted > 0 {
                not_drawn_total += omitted;
                let _ = write!(
                    out,
                    "<text class=\"not-drawn\" x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\" fill=\"#744210\">{omitted} more events not drawn</text>",
                    LEFT + PLOT_W - 4.0,
                    y0 + 10.0
                );
            }
            out.push_str("</g>");
        }
        out.push_str("</g>");
    }
    out.push_str("</svg>");
    if not_drawn_total > 0 {
        notices.push(format!(
            "{not_drawn_total} more events not drawn: each lane shows at most {MAX_MARKS_PER_LANE} marks (refusals, breach evidence and every kind but work first, then work spread evenly); the event table and /api/requests have them."
        ));
    }
    for n in &notices {
        let _ = write!(out, "<p class=\"notice\">{}</p>", Esc(n));
    }
    out.push_str("</section>\n");

    // The event table.
    let _ = write!(
        out,
        "<section class=\"events\" id=\"{}events\"><details><summary>All events ({})</summary><table><tr><th>time</th><th>attempt</th><th>stage</th><th>kind</th><th>witness</th><th>status</th><th>to</th><th>node</th><th>worker</th><th>reason</th></tr>",
        Esc(anchor),
        events.len()
    );
    for (i, e) in events.iter().enumerate().take(MAX_TABLE_ROWS) {
        let opt = |v: &Option<String>| v.as_deref().map(|s| Esc(s).to_string()).unwrap_or_default();
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            rel_ms(e.time_ns, t0),
            attempt_of[i]
                .map(|n| (n + 1).to_string())
                .unwrap_or_else(|| "-".into()),
            e.stage.as_str(),
            e.kind.as_str(),
            Witness::of(e.source).label(),
            e.status.map(|s| s.to_string()).unwrap_or_default(),
            e.to.map(|s| s.as_str()).unwrap_or_default(),
            opt(&e.node),
            opt(&e.worker),
            opt(&e.reason),
        );
    }
    out.push_str("</table>");
    if events.len() > MAX_TABLE_ROWS {
        let _ = write!(
            out,
            "<p class=\"notice\">{} more events not listed (the first {MAX_TABLE_ROWS} are)</p>",
            events.len() - MAX_TABLE_ROWS
        );
    }
    out.push_str("</details></section>\n");
    out
}
