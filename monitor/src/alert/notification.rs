//! What sinks deliver: a notification about one incident (every finding about one client request
//! within the group wait), or a summary of what a rule's rate limit suppressed. This is also the
//! documented webhook payload (see `docs/alerts.md`): the JSON below is what a receiver gets, one
//! object per alert.

use serde::{Deserialize, Serialize};

use crate::violation::Severity;
use crate::violation::{Evidence, Violation, fnv1a};

/// Unix nanoseconds as RFC 3339 (UTC, nanosecond precision).
pub fn rfc3339(unix_ns: u64) -> String {
    let t = time::OffsetDateTime::from_unix_timestamp_nanos(unix_ns as i128)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| "1970-01-01T00:00:00Z".to_string())
}

pub use crate::event::now_unix_ns;

// Notifications live behind an `Arc` in the spool; the size difference does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Notification {
    Incident(IncidentAlert),
    Suppressed(SuppressedSummary),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Links {
    /// The correlated timeline of the request (admin API, JSON), if an external URL is known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeline: Option<String>,
    /// The same request as a page for people (`/requests/{alias}`: swimlanes of every attempt,
    /// the refusal and the breaches), if an external URL is known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page: Option<String>,
    /// Recent violations with this fingerprint (admin API).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub violations: Option<String>,
}

/// Why an incident is notified again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Update {
    /// A finding raised the incident's severity above what its last notification said.
    Escalated,
    /// Findings kept arriving after the dedup window of the last notification had passed.
    Repeated,
}

impl Update {
    pub fn as_str(self) -> &'static str {
        match self {
            Update::Escalated => "escalated",
            Update::Repeated => "repeated",
        }
    }
}

/// The lead finding of an earlier notification of the incident (what an escalation replaces).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lead {
    pub rule: String,
    pub severity: Severity,
    pub fingerprint: String,
}

/// One rule's finding about the incident's request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Finding {
    /// rule, severity, summary, request, attempt, worker, detected_at_ns, fingerprint, evidence
    /// (evidence merged with the other source's confirmation when it came).
    #[serde(flatten)]
    pub violation: Violation,
    /// Violations of this rule folded into the finding since the incident opened: 1, or more when
    /// the request's retries broke the same rule again.
    pub occurrences: u64,
    /// The `sequence` of the incident's notification that first listed this finding.
    pub first_sequence: u32,
}

/// One notification about one incident: every finding about one client request (its primary
/// alias) within the group wait, listed with its rule, severity, summary, attempt and evidence.
/// The top-level violation fields are those of the lead finding (the highest severity, the first
/// to arrive among equals), so that readers of single-violation alerts keep working.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IncidentAlert {
    /// Unique per notification and stable across redelivery: receivers deduplicate on it.
    pub id: String,
    /// Stable incident id: hash of the incident key (and of the rule when grouping is off).
    pub incident: String,
    /// What the incident is about: `request_id:<x-request-id>`, `trace_id:<id>`, else the
    /// attempt (`room:<n>`, `rid:<rid>`) or the worker (`worker:<name>`).
    pub incident_key: String,
    /// 1 for the incident's first notification, then 2, 3… for its updates.
    pub sequence: u32,
    /// Set on updates: why the incident is notified again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update: Option<Update>,
    /// On an escalation: the previous notification's lead finding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub escalated_from: Option<Lead>,
    /// The lead finding's occurrences.
    pub occurrences: u64,
    /// The lead finding's `detected_at_ns` as RFC 3339.
    pub detected_at: String,
    /// Wall clock (unix ns) when the dispatcher accepted the first finding this notification is
    /// sent for (the incident's first finding, or the one that caused the update).
    pub received_at_ns: u64,
    /// The rules of `findings`, in the same order.
    pub rules: Vec<String>,
    /// Every finding of the incident, in arrival order.
    pub findings: Vec<Finding>,
    /// The lead finding: rule, severity (the incident's highest), summary, request (every alias
    /// any finding knew), attempt, worker, detected_at_ns, fingerprint, evidence.
    #[serde(flatten)]
    pub violation: Violation,
    pub links: Links,
}

impl IncidentAlert {
    /// A one-finding incident about `v` (e.g. to show what a sink would send for it).
    pub fn for_violation(
        id: String,
        v: &Violation,
        occurrences: u64,
        links: Links,
        received_at_ns: u64,
    ) -> IncidentAlert {
        let key = incident_alias(v);
        IncidentAlert {
            id,
            incident: incident_id(None, &key),
            incident_key: key,
            sequence: 1,
            update: None,
            escalated_from: None,
            occurrences,
            detected_at: rfc3339(v.detected_at_ns),
            received_at_ns,
            rules: vec![v.rule.clone()],
            findings: vec![Finding {
                violation: v.clone(),
                occurrences,
                first_sequence: 1,
            }],
            violation: v.clone(),
            links,
        }
    }

    /// The finding that was the lead of the previous notification, on an escalation.
    pub fn previous_lead(&self) -> Option<&Finding> {
        let from = self.escalated_from.as_ref()?;
        self.findings
            .iter()
            .find(|f| f.violation.rule == from.rule && f.violation.fingerprint == from.fingerprint)
    }
}

/// What an incident is keyed by: the request's primary alias as the checker's fingerprint uses it
/// (x-request-id, else trace id), else the attempt (room, else rid), else the worker, else the
/// fingerprint itself.
pub fn incident_alias(v: &Violation) -> String {
    if let Some(r) = &v.request.request_id {
        return format!("request_id:{r}");
    }
    if let Some(t) = &v.request.trace_id {
        return format!("trace_id:{t}");
    }
    if let Some(r) = v.attempt.bootstrap_room {
        return format!("room:{r}");
    }
    if let Some(r) = &v.attempt.rid {
        return format!("rid:{r}");
    }
    if let Some(w) = &v.worker {
        return format!("worker:{w}");
    }
    format!("fingerprint:{}", v.fingerprint)
}

/// The stable incident id: FNV-1a of the key, and of the rule when grouping is off (then each
/// rule's findings about a request are an incident of their own).
pub fn incident_id(rule: Option<&str>, key: &str) -> String {
    let h = match rule {
        Some(r) => fnv1a(&[b"incident", r.as_bytes(), key.as_bytes()]),
        None => fnv1a(&[b"incident", key.as_bytes()]),
    };
    format!("{h:016x}")
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SuppressedSummary {
    pub id: String,
    /// The lead rule of the incidents not notified.
    pub rule: String,
    /// Incident notifications led by `rule` not sent during the window.
    pub suppressed: u64,
    /// Findings those notifications would have carried (first listed, not repeats).
    #[serde(default)]
    pub findings: u64,
    /// Lead fingerprints among them (up to a sample).
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
            Notification::Incident(v) => &v.id,
            Notification::Suppressed(s) => &s.id,
        }
    }

    /// The lead rule.
    pub fn rule(&self) -> &str {
        match self {
            Notification::Incident(v) => &v.violation.rule,
            Notification::Suppressed(s) => &s.rule,
        }
    }

    pub fn received_at_ns(&self) -> u64 {
        match self {
            Notification::Incident(v) => v.received_at_ns,
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
                page: None,
                violations: None,
            };
        };
        let base = base.trim_end_matches('/');
        let alias = primary_alias(v);
        Links {
            timeline: alias
                .as_ref()
                .map(|a| format!("{base}/api/requests/{}", url_escape(a))),
            page: alias.map(|a| format!("{base}/requests/{}", url_escape(&a))),
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
