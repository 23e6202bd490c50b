//! What sinks deliver: a notification about one violation fingerprint, or a summary of what a
//! rule's rate limit suppressed. This is also the documented webhook payload (see
//! `docs/alerts.md`): the JSON below is what a receiver gets, one object per alert.

use serde::{Deserialize, Serialize};

use crate::violation::{Evidence, Violation};

/// Unix nanoseconds as RFC 3339 (UTC, nanosecond precision).
pub fn rfc3339(unix_ns: u64) -> String {
    let t = time::OffsetDateTime::from_unix_timestamp_nanos(unix_ns as i128)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| "1970-01-01T00:00:00Z".to_string())
}

pub fn now_unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

// Notifications live behind an `Arc` in the spool; the size difference does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Notification {
    Violation(ViolationAlert),
    Suppressed(SuppressedSummary),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Links {
    /// The correlated timeline of the request (admin API), if an external URL is known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeline: Option<String>,
    /// Recent violations with this fingerprint (admin API).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub violations: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ViolationAlert {
    /// Unique per notification and stable across redelivery: receivers deduplicate on it.
    pub id: String,
    /// Violations folded into this notification: 1, or 1 + repeats since the previous one.
    pub occurrences: u64,
    /// `detected_at_ns` as RFC 3339.
    pub detected_at: String,
    /// Wall clock (unix ns) when the dispatcher accepted the violation.
    pub received_at_ns: u64,
    /// rule, severity, summary, request, attempt, worker, detected_at_ns, fingerprint, evidence.
    #[serde(flatten)]
    pub violation: Violation,
    pub links: Links,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SuppressedSummary {
    pub id: String,
    pub rule: String,
    /// Violations of `rule` not notified individually during the window.
    pub suppressed: u64,
    /// Distinct fingerprints among them (up to a sample).
    pub fingerprints_sample: Vec<String>,
    pub window_start_ns: u64,
    pub window_end_ns: u64,
    /// The limit that was exceeded: notifications per window.
    pub limit: u32,
    pub received_at_ns: u64,
}

impl Notification {
    pub fn id(&self) -> &str {
        match self {
            Notification::Violation(v) => &v.id,
            Notification::Suppressed(s) => &s.id,
        }
    }

    pub fn rule(&self) -> &str {
        match self {
            Notification::Violation(v) => &v.violation.rule,
            Notification::Suppressed(s) => &s.rule,
        }
    }

    pub fn received_at_ns(&self) -> u64 {
        match self {
            Notification::Violation(v) => v.received_at_ns,
            Notification::Suppressed(s) => s.received_at_ns,
        }
    }
}

/// Where alerts link to: the admin server as reachable by whoever reads the alert.
#[derive(Debug, Clone, Default)]
pub struct LinkBase(pub Option<String>);

impl LinkBase {
    pub fn links(&self, v: &Violation) -> Links {
        let Some(base) = self.0.as_deref() else {
            return Links {
                timeline: None,
                violations: None,
            };
        };
        let base = base.trim_end_matches('/');
        let alias = primary_alias(v);
        Links {
            timeline: alias.map(|a| format!("{base}/api/requests/{}", url_escape(&a))),
            violations: Some(format!(
                "{base}/api/violations?fingerprint={}",
                url_escape(&v.fingerprint)
            )),
        }
    }
}

/// The alias a human would search for: the client request id, else the trace, else the attempt.
pub fn primary_alias(v: &Violation) -> Option<String> {
    v.request
        .request_id
        .clone()
        .or_else(|| v.request.trace_id.clone())
        .or_else(|| v.attempt.rid.clone())
        .or_else(|| v.attempt.bootstrap_room.map(|r| format!("{r:#x}")))
}

fn url_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A short human excerpt of the evidence (for Alertmanager annotations and chat messages).
pub fn evidence_excerpt(evidence: &[Evidence], max_lines: usize) -> String {
    let mut lines: Vec<String> = evidence
        .iter()
        .take(max_lines)
        .map(|e| {
            let mut l = format!(
                "{} {} {}/{} via {}",
                rfc3339(e.time_ns),
                serde_json::to_value(e.role)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default(),
                e.stage.as_str(),
                e.kind.as_str(),
                e.source.as_str()
            );
            if let Some(s) = e.status {
                l.push_str(&format!(" status={s}"));
            }
            if let Some(r) = &e.reason {
                l.push_str(&format!(" reason={r:?}"));
            }
            l
        })
        .collect();
    if evidence.len() > max_lines {
        lines.push(format!("… {} more", evidence.len() - max_lines));
    }
    lines.join("\n")
}
