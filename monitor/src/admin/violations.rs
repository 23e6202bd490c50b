//! `/api/violations`: the most recent violations (newest first), optionally of one rule or one
//! fingerprint, read from the dispatcher's ring ([`crate::telemetry::recent::RecentViolations`]).
//! A rule that is none of the engine's is a 400 naming the rules.

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::state::{AdminState, error};

#[derive(Debug, Deserialize)]
pub(super) struct ViolationQuery {
    limit: Option<usize>,
    rule: Option<String>,
    fingerprint: Option<String>,
}

pub(super) async fn violations(
    State(s): State<AdminState>,
    q: Result<Query<ViolationQuery>, QueryRejection>,
) -> Response {
    let q = match q {
        Ok(Query(q)) => q,
        Err(e) => {
            return error(
                axum::http::StatusCode::BAD_REQUEST,
                &format!(
                    "{}: limit is a count (0..), rule and fingerprint are strings",
                    e.body_text()
                ),
            );
        }
    };
    if let (Some(rule), Some(known)) = (&q.rule, s.violations.rules())
        && !known.contains(rule)
    {
        return error(
            axum::http::StatusCode::BAD_REQUEST,
            &format!("unknown rule {rule:?}: the rules are {}", known.join(", ")),
        );
    }
    let limit = q.limit.unwrap_or(100).min(10_000);
    let (items, total) = s
        .violations
        .list(limit, q.rule.as_deref(), q.fingerprint.as_deref());
    Json(serde_json::json!({ "total_seen": total, "violations": items })).into_response()
}
