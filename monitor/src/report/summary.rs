//! `revenant check --report FILE`: one self-contained HTML document (no external resource, no
//! script) with a summary of the recorded file's violations (per rule, a histogram over event
//! time) and the page of every violating request, as the admin server would draw it.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::html::{Esc, page};
use super::model::{CancelWindow, Timeline};
use super::request::{self, RequestPage, severity_colour};
use crate::alert::notification::rfc3339;
use crate::violation::{Severity, Violation};

/// Bars of the histogram of detection times.
const BINS: usize = 40;

pub struct Report<'a> {
    pub files: &'a [String],
    pub events: u64,
    /// Every violation printed (follow-ups of a second source left out).
    pub violations: &'a [Violation],
    /// The violating requests' timelines, in order of first violation.
    pub requests: &'a [Timeline],
    /// Violating requests without a page (beyond the report's bound).
    pub requests_left_out: usize,
    pub windows: &'a [CancelWindow],
}

fn histogram(vs: &[Violation]) -> String {
    let (Some(lo), Some(hi)) = (
        vs.iter().map(|v| v.detected_at_ns).min(),
        vs.iter().map(|v| v.detected_at_ns).max(),
    ) else {
        return String::new();
    };
    let width = (hi - lo).max(1);
    let mut bins = [[0u64; 3]; BINS];
    for v in vs {
        let b = (((v.detected_at_ns - lo) as u128 * BINS as u128) / (width as u128 + 1)) as usize;
        bins[b.min(BINS - 1)][v.severity as usize] += 1;
    }
    let max = bins
        .iter()
        .map(|b| b.iter().sum::<u64>())
        .max()
        .unwrap_or(1)
        .max(1);
    let (w, h, left, bar) = (860.0, 120.0, 40.0, 20.0);
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"histogram\" width=\"{}\" height=\"{}\" role=\"img\" aria-label=\"violations over event time\">",
        w + 20.0,
        h + 40.0
    );
    let _ = write!(
        out,
        "<text x=\"{left}\" y=\"12\">{max}</text><text x=\"{left}\" y=\"{:.0}\">{}</text><text x=\"{:.0}\" y=\"{:.0}\" text-anchor=\"end\">{}</text>",
        h + 34.0,
        rfc3339(lo),
        left + BINS as f64 * bar,
        h + 34.0,
        rfc3339(hi)
    );
    for (i, b) in bins.iter().enumerate() {
        let mut y = h + 16.0;
        for s in [Severity::Info, Severity::Warning, Severity::Critical] {
            let n = b[s as usize];
            if n == 0 {
                continue;
            }
            let bh = n as f64 * h / max as f64;
            y -= bh;
            let _ = write!(
                out,
                "<rect class=\"bar\" data-severity=\"{}\" x=\"{:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{bh:.1}\" fill=\"{}\"><title>{n} {} from {}</title></rect>",
                s.as_str(),
                left + i as f64 * bar,
                bar - 2.0,
                severity_colour(s),
                s.as_str(),
                rfc3339(lo + (width as u128 * i as u128 / BINS as u128) as u64)
            );
        }
    }
    out.push_str("</svg>");
    out
}

/// The whole document.
pub fn render(r: &Report<'_>) -> String {
    let mut body = String::with_capacity(64 * 1024);
    body.push_str(
        "<h1>revenant check report</h1><section class=\"summary\" id=\"summary\"><h2>Summary</h2>",
    );
    let _ = write!(
        body,
        "<p>{} events read from {} file(s): <span class=\"id\">{}</span>. {} violation(s) about {} request(s).</p>",
        r.events,
        r.files.len(),
        Esc(&r.files.join(", ")),
        r.violations.len(),
        r.requests.len() + r.requests_left_out
    );
    let mut per_rule: BTreeMap<(&str, Severity), u64> = BTreeMap::new();
    for v in r.violations {
        *per_rule.entry((&v.rule, v.severity)).or_default() += 1;
    }
    body.push_str(
        "<table class=\"rules\"><tr><th>rule</th><th>severity</th><th>violations</th></tr>",
    );
    for ((rule, sev), n) in &per_rule {
        let _ = write!(
            body,
            "<tr class=\"rule-row\" data-rule=\"{}\"><td class=\"rule\">{}</td><td><span class=\"sev sev-{}\">{}</span></td><td class=\"count\">{n}</td></tr>",
            Esc(rule),
            Esc(rule),
            sev.as_str(),
            sev.as_str()
        );
    }
    body.push_str("</table>");
    if !r.violations.is_empty() {
        body.push_str("<h3>Violations over event time</h3>");
        body.push_str(&histogram(r.violations));
    }
    if r.requests_left_out > 0 {
        let _ = write!(
            body,
            "<p class=\"notice\">{} more violating requests have no page here (the report draws the first {}); `revenant check` prints every violation.</p>",
            r.requests_left_out,
            r.requests.len()
        );
    }
    body.push_str("<h3>Violating requests</h3><ol class=\"request-index\">");
    for (n, t) in r.requests.iter().enumerate() {
        let mut rules: Vec<String> = r
            .violations
            .iter()
            .filter(|v| request::concerns(v, t))
            .map(|v| format!("{} ({})", v.rule, v.severity.as_str()))
            .collect();
        rules.dedup();
        let _ = write!(
            body,
            "<li><a href=\"#r{}\">request {}</a>: {}</li>",
            n + 1,
            n + 1,
            Esc(&rules.join(", "))
        );
    }
    body.push_str("</ol></section>\n");
    for (n, t) in r.requests.iter().enumerate() {
        let _ = write!(
            body,
            "<section class=\"request\" id=\"r{}\"><h2>Request {} <a href=\"#summary\">↑</a></h2>",
            n + 1,
            n + 1
        );
        body.push_str(&request::render(
            &RequestPage {
                timeline: t,
                violations: r.violations,
                windows: r.windows,
            },
            &format!("r{}-", n + 1),
        ));
        body.push_str("</section>\n");
    }
    page("revenant check report", &body)
}
