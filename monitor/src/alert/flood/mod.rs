//! Incidents, dedup and flood control, sans-IO: `admit(violation, now)`, `release_due(now)` and
//! `tick(now)`.
//!
//! **Incidents.** Findings (violations) about one client request become one incident, keyed by
//! the request's primary alias (the alias the checker's fingerprint uses besides the rule: the
//! x-request-id, else the trace id; a violation naming no request is keyed by its attempt, else
//! its worker). The first finding opens the incident and starts its group wait; findings arriving
//! meanwhile join the pending notification, which then lists every rule that fired. Once sent,
//! the incident is remembered for the dedup window: later findings are merged into its record
//! (visible to Alertmanager re-posts and the next notification) without a new notification,
//! except when one raises the incident's severity (one update, `update: escalated`) or arrives
//! after the dedup window of the last notification (`update: repeated`). A finding of a rule the
//! incident already lists (another attempt of the request breaking it again) is a repeat: it
//! bumps that finding's `occurrences`. With a group wait of 0 grouping is off: each (rule,
//! request) pair is an incident of its own, sent at once.
//!
//! **Rate limit.** Per lead rule (the rule of a notification's lead finding), fixed windows:
//! beyond `rate_limit` notifications per window, incident notifications are counted instead and a
//! single summary reports them when the window closes. An escalation takes a slot but is never
//! suppressed (at most one per severity step per incident).
//!
//! **Corroboration.** When a second source (eBPF after OTLP, or the reverse) confirms a (rule,
//! attempt) already reported, the checker emits a follow-up with `corroborates: true`. It is not
//! a repeat: it bumps no count and takes no rate-limit slot. Its evidence is merged into the
//! finding it confirms: into the pending notification when that is not sent yet (with a
//! corroboration window, a first notification whose evidence shows one source is held for it),
//! else into the incident's record that Alertmanager re-posts (the webhook/JSONL notification
//! already went out; sending a second one would be the duplicate dedup exists to prevent).
//!
//! Layout: `incident` groups findings into incidents (admission, corroboration, release of
//! due notifications, expiry); `limit` holds the rate windows, their summaries and the tick.

use std::collections::HashMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::notification::IncidentAlert;

use incident::Incident;
use limit::RuleWindow;

mod incident;
mod limit;
#[cfg(test)]
mod tests;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FloodConfig {
    /// An incident notified within this window is not notified again for later findings (they
    /// are merged into it), unless they raise its severity.
    #[serde(with = "crate::duration")]
    pub dedup_window: Duration,
    /// Incident notifications per lead rule per `rate_limit_window`; 0 disables the limit.
    pub rate_limit: u32,
    #[serde(with = "crate::duration")]
    pub rate_limit_window: Duration,
    /// Incidents remembered for dedup (and re-posting to Alertmanager).
    pub max_tracked: usize,
    /// Hold a first notification this long when more than one source is live, so that a second
    /// source's confirmation can be merged into it; 0 (default) sends at once. A held
    /// notification goes out as soon as every finding in it is corroborated (and its group wait
    /// is over). The price is alert latency (up to the window) for violations only one source
    /// ever sees.
    #[serde(with = "crate::duration")]
    pub corroboration_window: Duration,
    /// How long an incident's notification waits for the other findings of the same request
    /// (and an update for the findings that come with the escalating one); 0 turns grouping off:
    /// one notification per (rule, request), sent at once.
    #[serde(with = "crate::duration")]
    pub group_wait: Duration,
}

/// Default group wait: covers the findings of one breach (the orphaned-leg deadline fires about
/// the cancellation window + the allowed lateness + up to one 1 s checker tick after the
/// rejection that also triggers activity-after-rejection).
pub const DEFAULT_GROUP_WAIT: Duration = Duration::from_secs(2);

impl Default for FloodConfig {
    fn default() -> Self {
        FloodConfig {
            dedup_window: Duration::from_secs(300),
            rate_limit: 50,
            rate_limit_window: Duration::from_secs(60),
            max_tracked: 10_000,
            corroboration_window: Duration::ZERO,
            group_wait: DEFAULT_GROUP_WAIT,
        }
    }
}

/// Longest group wait: every alert waits that long.
const MAX_GROUP_WAIT: Duration = Duration::from_secs(600);

/// A flood-control setting that cannot work.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FloodConfigError {
    #[error("rate_limit_window must be > 0 when rate_limit is set")]
    ZeroRateLimitWindow { rate_limit: u32 },
    #[error("max_tracked must be > 0")]
    ZeroMaxTracked,
    #[error(
        "group_wait {} delays every alert by that much: at most 10m",
        humantime::format_duration(*value)
    )]
    GroupWait { value: Duration },
}

impl FloodConfig {
    pub fn validate(&self) -> Result<(), FloodConfigError> {
        if self.rate_limit > 0 && self.rate_limit_window.is_zero() {
            return Err(FloodConfigError::ZeroRateLimitWindow {
                rate_limit: self.rate_limit,
            });
        }
        if self.max_tracked == 0 {
            return Err(FloodConfigError::ZeroMaxTracked);
        }
        if self.group_wait > MAX_GROUP_WAIT {
            return Err(FloodConfigError::GroupWait {
                value: self.group_wait,
            });
        }
        Ok(())
    }

    fn grouping(&self) -> bool {
        !self.group_wait.is_zero()
    }
}

/// What became of one (non-follow-up) violation.
#[derive(Debug, Clone, PartialEq)]
pub enum Admission {
    /// It opened an incident; its notification is pending (group wait, and `held` for the
    /// corroboration window) and comes out of [`FloodControl::release_due`].
    Opened { held: bool },
    /// A rule the incident did not list yet: merged into it.
    Merged(Merge),
    /// A rule the incident already lists (another attempt of the request): a repeat, folded into
    /// that finding's `occurrences`.
    Duplicate { occurrences: u64 },
    /// A follow-up confirmed by another source (`corroborates: true`): never a repeat.
    Corroborated(Corroboration),
}

/// Where a merged finding went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Merge {
    /// Into a notification not sent yet: it goes out listing this finding too.
    Pending,
    /// Into an incident notified within the dedup window: its record (Alertmanager re-posts, the
    /// next notification) shows it; no notification of its own.
    Notified,
    /// It raised the incident's severity: one update notification (after the group wait).
    Escalated,
    /// The incident's last notification is older than the dedup window: notified again.
    Repeated,
}

impl Merge {
    /// Bounded label value for metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Merge::Pending => "pending",
            Merge::Notified => "notified",
            Merge::Escalated => "escalated",
            Merge::Repeated => "repeated",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Corroboration {
    /// The finding's notification was not sent yet: it goes out with the merged evidence (at
    /// once when that was all its corroboration hold waited for and the group wait is over).
    MergedPending,
    /// The notification already went out: the incident's record (Alertmanager re-posts) now
    /// carries the merged evidence; no new notification.
    Late { merged: bool },
    /// No tracked finding about this (rule, attempt): rate-limited, forgotten past the dedup
    /// window or `max_tracked`, or a repeat about another attempt.
    Unmatched,
}

impl Corroboration {
    /// Bounded label value for metrics.
    pub fn outcome(&self) -> &'static str {
        match self {
            Corroboration::MergedPending => "merged_held",
            Corroboration::Late { merged: true } => "merged_active",
            Corroboration::Late { merged: false } => "late",
            Corroboration::Unmatched => "unmatched",
        }
    }
}

/// What [`FloodControl::release_due`] hands out.
// Returned by value once per notification and consumed at once.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Release {
    /// Send this notification.
    Notify(IncidentAlert),
    /// Over the lead rule's rate limit: summarised when the window closes. `rules`: the rules of
    /// the findings it would have carried for the first time.
    RateLimited {
        lead_rule: String,
        rules: Vec<String>,
    },
}

/// An incident still firing (seen within the dedup window), as re-posted to Alertmanager: its
/// last notification, with every finding merged since.
#[derive(Debug, Clone, PartialEq)]
pub struct ActiveAlert {
    pub alert: IncidentAlert,
    pub last_seen_ns: u64,
}

#[derive(Debug)]
pub struct FloodControl {
    cfg: FloodConfig,
    incidents: HashMap<u64, Incident>,
    /// Alias index key → incident. Request aliases (x-request-id, trace id) first: a request's
    /// first finding may name it by its trace id only (the router's span with the x-request-id
    /// comes last) and a later one by both; any shared alias makes them one incident. Attempt
    /// aliases (room, rid) and workers index what names no request. With grouping off, the keys
    /// are qualified by the rule.
    by_alias: HashMap<String, u64>,
    rules: HashMap<String, RuleWindow>,
    next_incident: u64,
    /// Makes notification ids unique within this process; combined with the start time, across
    /// restarts too.
    seq: u64,
    epoch_ns: u64,
    /// Notified incidents forgotten early because `max_tracked` was reached (reported as
    /// resolved by the next tick).
    evicted: Vec<ActiveAlert>,
    pub evictions: u64,
}

impl FloodControl {
    pub fn new(cfg: FloodConfig, epoch_ns: u64) -> FloodControl {
        FloodControl {
            cfg,
            incidents: HashMap::new(),
            by_alias: HashMap::new(),
            rules: HashMap::new(),
            next_incident: 0,
            seq: 0,
            epoch_ns,
            evicted: Vec::new(),
            evictions: 0,
        }
    }

    pub fn config(&self) -> &FloodConfig {
        &self.cfg
    }

    fn next_id(seq: &mut u64, epoch_ns: u64, prefix: &str) -> String {
        *seq += 1;
        format!("{prefix}-{epoch_ns:x}-{seq}")
    }
}
