//! Notifications sent once by processes that may find the same breach again: cluster mode's
//! checkers read their partitions again after a restart, or take over another replica's
//! partitions, and re-open incidents whose notifications an earlier life or another replica
//! is sending or already sent.
//!
//! The right to send is taken before the notification is spooled: the dispatcher claims its
//! key (an atomic create in a store every checker shares), spools it only if the claim is its
//! own, then marks it spooled. Two processes that find one breach at once race on the create
//! and exactly one sends; one that finds a claim another process holds but has not marked
//! spooled waits and asks again (that process is between its claim and its spool, or died
//! there). A claim that cannot be answered (the store away), or one still unmarked, is held
//! for up to [`CLAIM_HOLD`]; then it is sent: a repeat is better than a loss.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use super::notification::{Notification, Update};

pub type ClaimFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// How long a notification whose claim cannot be settled waits before it is sent anyway.
/// Covers an outage of the store's NATS of a minute (during which a checker receives no new
/// events either), and a claimer that died between its claim and its spool.
pub const CLAIM_HOLD: Duration = Duration::from_secs(60);

/// What a claim on one notification found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// This process holds the right to send it (claimed now, or by an earlier attempt of this
    /// process whose answer was lost): spool it, then mark it spooled.
    Ours,
    /// Another process (or an earlier life) spooled it: not sent again.
    SentBefore,
    /// Another process claimed it and has not marked it spooled yet: ask again.
    Pending,
    /// The store did not answer: ask again.
    Unknown,
}

/// Where notifications are claimed (cluster mode: a JetStream key-value bucket).
pub trait NotificationClaims: Send + Sync {
    /// Per key: takes the right to send that notification, or says who has it.
    fn claim<'a>(&'a self, keys: &'a [String]) -> ClaimFuture<'a, Vec<Claim>>;
    /// Marks these notifications spooled (their claims settled for every other process).
    fn spooled<'a>(&'a self, keys: &'a [String]) -> ClaimFuture<'a, ()>;
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
