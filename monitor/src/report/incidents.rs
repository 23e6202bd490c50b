//! The incidents page: recent violations, newest first, each linking to its request's page,
//! filtered by rule and severity with a plain form (query parameters, no script).

use std::fmt::Write as _;

use super::html::{Esc, url_segment};
use crate::alert::notification::{primary_alias, rfc3339};
use crate::violation::{Severity, Violation};

/// What the list shows and how it was filtered.
pub struct IncidentsPage<'a> {
    /// (received at, violation), newest first.
    pub rows: &'a [(u64, &'a Violation)],
    /// The rules that can fire, for the filter's choices.
    pub rules: &'a [String],
    pub rule: Option<&'a str>,
    pub severity: Option<Severity>,
    /// Violations the server received since start (the ring keeps the most recent).
    pub total_seen: u64,
    /// Rows asked for; when `rows` is that long, older matches may exist.
    pub limit: usize,
    /// Prefix of request page links (`requests/` from `/incidents`, `#` anchors in a report).
    pub link: &'a dyn Fn(&str) -> String,
}

/// The link of a violation's request page under `/requests/`, relative to the admin root.
pub fn request_href(alias: &str) -> String {
    format!("requests/{}", url_segment(alias))
}

pub fn render(p: &IncidentsPage<'_>) -> String {
    let mut out = String::with_capacity(4096 + p.rows.len() * 300);
    out.push_str("<form method=\"get\" action=\"incidents\" class=\"filters\"><label>rule <select name=\"rule\"><option value=\"\">any</option>");
    for r in p.rules {
        let _ = write!(
            out,
            "<option value=\"{}\"{}>{}</option>",
            Esc(r),
            if p.rule == Some(r.as_str()) {
                " selected"
            } else {
                ""
            },
            Esc(r)
        );
    }
    out.push_str("</select></label> <label>severity <select name=\"severity\"><option value=\"\">any</option>");
    for s in [Severity::Critical, Severity::Warning, Severity::Info] {
        let _ = write!(
            out,
            "<option value=\"{0}\"{1}>{0}</option>",
            s.as_str(),
            if p.severity == Some(s) {
                " selected"
            } else {
                ""
            }
        );
    }
    let _ = write!(
        out,
        "</select></label> <label>limit <input name=\"limit\" type=\"number\" min=\"1\" max=\"10000\" value=\"{}\"></label> <button type=\"submit\">filter</button></form>",
        p.limit
    );
    let _ = write!(
        out,
        "<p>{} shown, newest first; {} received since start (the most recent are kept).</p>",
        p.rows.len(),
        p.total_seen
    );
    if p.rows.is_empty() {
        out.push_str("<p class=\"empty\">No incident matches.</p>");
        return out;
    }
    out.push_str("<table class=\"incidents\"><tr><th>detected</th><th>rule</th><th>severity</th><th>request</th><th>summary</th></tr>");
    for (_, v) in p.rows {
        let request = match primary_alias(v) {
            Some(a) => format!(
                "<a class=\"request-link\" href=\"{}\"><span class=\"id\">{}</span></a>",
                Esc(&(p.link)(&a)),
                Esc(&a)
            ),
            None => v
                .worker
                .as_deref()
                .map(|w| format!("worker <span class=\"id\">{}</span>", Esc(w)))
                .unwrap_or_else(|| "-".into()),
        };
        let _ = write!(
            out,
            "<tr class=\"incident\" data-rule=\"{}\" data-severity=\"{}\"><td>{}</td><td class=\"rule\">{}</td><td><span class=\"sev sev-{}\">{}</span></td><td>{}</td><td>{}</td></tr>",
            Esc(&v.rule),
            v.severity.as_str(),
            rfc3339(v.detected_at_ns),
            Esc(&v.rule),
            v.severity.as_str(),
            v.severity.as_str(),
            request,
            Esc(&v.summary)
        );
    }
    out.push_str("</table>");
    if p.rows.len() >= p.limit {
        let _ = write!(
            out,
            "<p class=\"notice\">Only the newest {} are shown: raise limit for more.</p>",
            p.limit
        );
    }
    out
}
