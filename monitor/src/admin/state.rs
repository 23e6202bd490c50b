//! What every handler of the admin API shares: the state it reads and the shape of an error
//! answer. The server and the handlers beside it import this; it imports neither.

use std::sync::{Arc, OnceLock};

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::timeline::TimelineProvider;
use crate::access::Access;
use crate::report::CancelWindow;
use crate::telemetry::metrics::Metrics;
use crate::telemetry::ready::Readiness;
use crate::telemetry::recent::RecentViolations;

/// What the handlers read. Cheap to clone.
#[derive(Clone)]
pub struct AdminState {
    pub metrics: Arc<Metrics>,
    pub readiness: Readiness,
    pub violations: Arc<RecentViolations>,
    pub timeline: Arc<dyn TimelineProvider>,
    pub access: Access,
    /// The cancellation windows the rules allow after a refusal (set once the engine's rules
    /// are known; none in an agent), drawn on request pages.
    pub windows: Arc<OnceLock<Vec<CancelWindow>>>,
}

/// Every error the admin API answers: JSON `{"error": …}` with the status.
pub(super) fn error(status: StatusCode, message: &str) -> Response {
    (status, Json(serde_json::json!({ "error": message }))).into_response()
}
