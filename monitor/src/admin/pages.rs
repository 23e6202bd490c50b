//! The pages for people: `/requests/{alias}` (one request's swimlanes, every attempt) and
//! `/incidents` (recent violations, filtered by rule and severity, each linking to its request).
//! Drawing is `crate::report`'s; this file only reads the shared state and answers HTML behind
//! the same token as `/api`.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::state::AdminState;
use crate::report::html::{Esc, page, url_segment};
use crate::report::incidents::{self, IncidentsPage, request_href};
use crate::report::request::{self, RequestPage};
use crate::violation::{Severity, Violation};

/// Violations read from the ring to find a request's breaches (the ring's own bound is lower
/// in practice; this keeps one page's work bounded whatever it is configured to).
const MAX_SCANNED: usize = 10_000;

fn html(status: StatusCode, body: String) -> Response {
    (
        status,
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CONTENT_SECURITY_POLICY, crate::report::html::CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            // Pages name request ids: not for shared caches.
            (header::CACHE_CONTROL, "no-store"),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        body,
    )
        .into_response()
}

fn nav(up: &str) -> String {
    format!(
        "<nav><a href=\"{up}incidents\">incidents</a><a href=\"{up}api/violations\">/api/violations</a></nav>"
    )
}

pub(super) async fn request_page(State(s): State<AdminState>, Path(id): Path<String>) -> Response {
    if id.is_empty() || id.len() > 256 {
        return html(
            StatusCode::BAD_REQUEST,
            page(
                "revenant: bad alias",
                &format!(
                    "{}<h1>Bad alias</h1><p>An alias is 1..=256 bytes.</p>",
                    nav("../")
                ),
            ),
        );
    }
    let Some(t) = s.timeline.timeline(&id) else {
        return html(
            StatusCode::NOT_FOUND,
            page(
                "revenant: unknown request",
                &format!(
                    "{}<h1>Unknown request</h1><p>No event names <span class=\"id\">{}</span>: never seen, or evicted from the recent-events index (<code>--timeline-events</code>).</p>",
                    nav("../"),
                    Esc(&id)
                ),
            ),
        );
    };
    let (recent, _) = s.violations.list(MAX_SCANNED, None, None);
    let violations: Vec<Violation> = recent
        .into_iter()
        .map(|r| r.violation)
        .filter(|v| request::concerns(v, &t))
        .rev()
        .collect();
    let windows = s.windows.get().map(Vec::as_slice).unwrap_or_default();
    let body = format!(
        "{}<h1>Request timeline</h1><p><a href=\"../api/requests/{}\">the same as JSON</a></p>{}",
        nav("../"),
        Esc(&url_segment(&id)),
        request::render(
            &RequestPage {
                timeline: &t,
                violations: &violations,
                windows,
            },
            "",
        )
    );
    html(StatusCode::OK, page("revenant: request timeline", &body))
}

#[derive(Debug, Deserialize)]
pub(super) struct IncidentQuery {
    limit: Option<usize>,
    rule: Option<String>,
    severity: Option<String>,
}

pub(super) async fn incidents_page(
    State(s): State<AdminState>,
    q: Result<Query<IncidentQuery>, QueryRejection>,
) -> Response {
    let bad = |msg: String| {
        html(
            StatusCode::BAD_REQUEST,
            page(
                "revenant: incidents",
                &format!(
                    "{}<h1>Incidents</h1><p class=\"notice\">{}</p>",
                    nav(""),
                    Esc(&msg)
                ),
            ),
        )
    };
    let q = match q {
        Ok(Query(q)) => q,
        Err(e) => {
            return bad(format!(
                "{}: limit is a count (1..), rule and severity are names",
                e.body_text()
            ));
        }
    };
    // An empty choice in the form means "any".
    let rule = q.rule.as_deref().filter(|r| !r.is_empty());
    let severity = match q.severity.as_deref().filter(|r| !r.is_empty()) {
        None => None,
        Some("critical") => Some(Severity::Critical),
        Some("warning") => Some(Severity::Warning),
        Some("info") => Some(Severity::Info),
        Some(other) => {
            return bad(format!(
                "unknown severity {other:?}: critical, warning or info"
            ));
        }
    };
    let known = s
        .violations
        .rules()
        .map(<[String]>::to_vec)
        .unwrap_or_default();
    if let Some(r) = rule
        && !known.is_empty()
        && !known.iter().any(|k| k == r)
    {
        return bad(format!(
            "unknown rule {r:?}: the rules are {}",
            known.join(", ")
        ));
    }
    let limit = q.limit.unwrap_or(100).clamp(1, 10_000);
    let (items, total) = s.violations.list(MAX_SCANNED, rule, None);
    let rows: Vec<(u64, &Violation)> = items
        .iter()
        .filter(|r| severity.is_none_or(|x| r.violation.severity == x))
        .take(limit)
        .map(|r| (r.received_at_ns, &r.violation))
        .collect();
    let link = |a: &str| request_href(a);
    let body = format!(
        "{}<h1>Incidents</h1>{}",
        nav(""),
        incidents::render(&IncidentsPage {
            rows: &rows,
            rules: &known,
            rule,
            severity,
            total_seen: total,
            limit,
            link: &link,
        })
    );
    html(StatusCode::OK, page("revenant: incidents", &body))
}
