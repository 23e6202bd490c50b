//! Notifications sent once by processes that may find the same breach again: cluster mode's
//! checkers read their partitions again after a restart, or take over another replica's
//! partitions, and re-open incidents whose notifications an earlier life already sent.
//!
//! The dispatcher asks before it spools a notification and records it after the spool has it:
//! delivery stays at least once (a process killed between the two sends it again), and a
//! notification that was sent is not sent twice. One that cannot be looked up (the claims'
//! store away) is held and asked about again, for up to [`CLAIM_HOLD`]; then it is sent: a
//! repeat is better than a loss.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use super::notification::{Notification, Update};

pub type ClaimFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// How long a notification whose claim cannot be looked up waits for the claims' store before
/// it is sent anyway. Covers an outage of the store's NATS of a minute (during which a checker
/// receives no new events either).
pub const CLAIM_HOLD: Duration = Duration::from_secs(60);

/// Where notifications are claimed (cluster mode: a JetStream key-value bucket).
pub trait NotificationClaims: Send + Sync {
    /// Per key: whether that notification was sent before; `None` when it cannot be looked up
    /// now (the dispatcher asks again later).
    fn sent_before<'a>(&'a self, keys: &'a [String]) -> ClaimFuture<'a, Vec<Option<bool>>>;
    /// Records that these notifications are spooled.
    fn record<'a>(&'a self, keys: &'a [String]) -> ClaimFuture<'a, ()>;
}

impl Notification {
    /// What makes a notification the same one when another process sends it: the incident and
    /// why it is notified (opened; escalated to a severity; repeated as its `sequence`).
    /// Suppression summaries are per process and window: `None`, never claimed.
    pub fn claim_key(&self) -> Option<String> {
        match self {
            Notification::Incident(a) => Some(match a.update {
                None => format!("{}.opened", a.incident),
                Some(Update::Escalated) => {
                    format!("{}.escalated.{}", a.incident, a.violation.severity.as_str())
                }
                Some(Update::Repeated) => format!("{}.repeated.{}", a.incident, a.sequence),
            }),
            Notification::Suppressed(_) => None,
        }
    }
}
