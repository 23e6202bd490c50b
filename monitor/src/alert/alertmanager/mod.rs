//! Alertmanager sink: `POST /api/v2/alerts`, one alert per incident, re-posted while active.
//!
//! Labels come from the incident's lead finding (highest severity): `alertname` (= its rule, so
//! routes and silences written per rule keep matching), `severity`, `stage` (of the offending
//! event), `node` (the worker named by the violation, else this monitor's node), `cluster`,
//! `fingerprint` (the lead finding's), `incident` (what keeps two requests apart in Alertmanager)
//! and `source="revenant"`. Annotations: `summary`, `rules` and `findings` (every rule that fired
//! for the request, with severity, attempt and summary), `evidence` (the lead's excerpt),
//! `timeline` (link), `request_id`, `bootstrap_room` (decimal) and `bootstrap_room_hex`,
//! `occurrences`. An escalation changes the lead, hence the label set: the previous alert is
//! posted resolved in the same request.

pub mod config;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

pub use config::{AlertmanagerConfig, AlertmanagerConfigError};

use super::flood::ActiveAlert;
use super::notification::{
    Finding, IncidentAlert, Notification, evidence_excerpt, now_unix_ns, rfc3339,
};
use super::sink::{BoxFuture, Sink, SinkError};
use super::webhook::{http_client, read_answer, transport_error};
use crate::violation::{EvidenceRole, Violation};

/// Most findings listed in the `findings` annotation.
const MAX_FINDING_LINES: usize = 20;

/// One line per finding: `critical activity-after-rejection room 0x1000: <summary>`.
pub fn findings_excerpt(findings: &[Finding]) -> String {
    let mut lines: Vec<String> = findings
        .iter()
        .take(MAX_FINDING_LINES)
        .map(|f| {
            let v = &f.violation;
            let mut l = format!("{} {}", v.severity.as_str(), v.rule);
            if let Some(r) = v.attempt.bootstrap_room {
                l.push_str(&format!(" room {r:#x}"));
            } else if let Some(r) = &v.attempt.rid {
                l.push_str(&format!(" rid {r}"));
            }
            if f.occurrences > 1 {
                l.push_str(&format!(" x{}", f.occurrences));
            }
            l.push_str(": ");
            l.push_str(&v.summary);
            l
        })
        .collect();
    if findings.len() > MAX_FINDING_LINES {
        lines.push(format!("… {} more", findings.len() - MAX_FINDING_LINES));
    }
    lines.join("\n")
}

#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PostableAlert {
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    pub starts_at: String,
    pub ends_at: String,
    #[serde(rename = "generatorURL", skip_serializing_if = "String::is_empty")]
    pub generator_url: String,
}

pub struct AlertmanagerSink {
    name: String,
    endpoint: reqwest::Url,
    resend: Duration,
    node: String,
    cluster: String,
    client: reqwest::Client,
}

/// Why an Alertmanager sink cannot be built (at start-up, before any port is bound).
#[derive(Debug, thiserror::Error)]
pub enum AlertmanagerSinkError {
    #[error(transparent)]
    Config(#[from] AlertmanagerConfigError),
    #[error(transparent)]
    Client(#[from] crate::alert::webhook::HttpClientError),
}

impl AlertmanagerSink {
    pub fn new(
        name: impl Into<String>,
        cfg: &AlertmanagerConfig,
        node: &str,
        cluster: &str,
    ) -> Result<AlertmanagerSink, AlertmanagerSinkError> {
        cfg.validate()?;
        let base = cfg.url.trim_end_matches('/');
        let endpoint = format!("{base}/api/v2/alerts");
        Ok(AlertmanagerSink {
            name: name.into(),
            endpoint: reqwest::Url::parse(&endpoint).map_err(|source| {
                AlertmanagerConfigError::Url {
                    url: endpoint,
                    source,
                }
            })?,
            resend: cfg.resend_interval,
            node: node.to_string(),
            cluster: cluster.to_string(),
            client: http_client(cfg.timeout)?,
        })
    }

    /// `endsAt` for a firing alert: four resend intervals ahead, as Prometheus does, so that it
    /// resolves on its own if revenant stops re-posting.
    fn horizon(&self, now_ns: u64) -> u64 {
        now_ns + 4 * self.resend.as_nanos() as u64
    }

    /// The incident as one alert, labelled by its lead finding.
    pub fn to_alert(&self, a: &IncidentAlert, ends_at_ns: u64) -> PostableAlert {
        self.alert_led_by(a, &a.violation, a.occurrences, ends_at_ns)
    }

    /// The incident as one alert labelled by `v` (the lead, or the previous lead an escalation
    /// replaces).
    fn alert_led_by(
        &self,
        a: &IncidentAlert,
        v: &Violation,
        occurrences: u64,
        ends_at_ns: u64,
    ) -> PostableAlert {
        let stage = v
            .evidence
            .iter()
            .find(|e| e.role == EvidenceRole::Offender)
            .or(v.evidence.last())
            .map(|e| e.stage.as_str())
            .unwrap_or("unknown");
        let mut labels = BTreeMap::new();
        labels.insert("alertname".into(), v.rule.clone());
        labels.insert("severity".into(), v.severity.as_str().into());
        labels.insert("stage".into(), stage.into());
        labels.insert(
            "node".into(),
            v.worker.clone().unwrap_or_else(|| self.node.clone()),
        );
        labels.insert("cluster".into(), self.cluster.clone());
        labels.insert("fingerprint".into(), v.fingerprint.clone());
        labels.insert("incident".into(), a.incident.clone());
        labels.insert("source".into(), "revenant".into());
        let mut ann = BTreeMap::new();
        ann.insert("summary".into(), v.summary.clone());
        ann.insert("rules".into(), a.rules.join(", "));
        ann.insert("findings".into(), findings_excerpt(&a.findings));
        ann.insert("evidence".into(), evidence_excerpt(&v.evidence, 6));
        ann.insert("occurrences".into(), occurrences.to_string());
        ann.insert("incident_key".into(), a.incident_key.clone());
        if let Some(t) = &a.links.timeline {
            ann.insert("timeline".into(), t.clone());
        }
        if let Some(p) = &a.links.page {
            ann.insert("request_page".into(), p.clone());
        }
        if let Some(r) = &a.violation.request.request_id {
            ann.insert("request_id".into(), r.clone());
        }
        if let Some(r) = v.attempt.bootstrap_room {
            // The pair every output names a room by: decimal and hex.
            ann.insert("bootstrap_room".into(), r.to_string());
            ann.insert("bootstrap_room_hex".into(), format!("{r:#x}"));
        }
        PostableAlert {
            labels,
            annotations: ann,
            starts_at: rfc3339(v.detected_at_ns.min(a.received_at_ns).max(1)),
            ends_at: rfc3339(ends_at_ns),
            // Alertmanager's UI shows this as the alert's source: the page a person can read.
            generator_url: a
                .links
                .page
                .clone()
                .or_else(|| a.links.timeline.clone())
                .or_else(|| a.links.violations.clone())
                .unwrap_or_default(),
        }
    }

    async fn post(&self, alerts: &[PostableAlert]) -> Result<(), SinkError> {
        if alerts.is_empty() {
            return Ok(());
        }
        let resp = self
            .client
            .post(self.endpoint.clone())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(
                serde_json::to_vec(alerts).map_err(|e| SinkError::Permanent {
                    reason: format!("cannot encode alerts: {e}"),
                    status: None,
                })?,
            )
            .send()
            .await
            .map_err(transport_error)?;
        read_answer(resp).await
    }
}

impl Sink for AlertmanagerSink {
    fn name(&self) -> &str {
        &self.name
    }

    fn deliver<'a>(
        &'a self,
        batch: &'a [Arc<Notification>],
    ) -> BoxFuture<'a, Result<(), SinkError>> {
        Box::pin(async move {
            let now = now_unix_ns();
            let mut alerts: Vec<PostableAlert> = Vec::with_capacity(batch.len());
            for n in batch {
                let alert = match n.as_ref() {
                    Notification::Incident(a) => {
                        if let Some(prev) = a.previous_lead() {
                            // The escalated alert has another label set: end the previous one.
                            alerts.push(self.alert_led_by(
                                a,
                                &prev.violation,
                                prev.occurrences,
                                now,
                            ));
                        }
                        self.to_alert(a, self.horizon(now))
                    }
                    Notification::Suppressed(s) => {
                        let mut labels = BTreeMap::new();
                        labels.insert("alertname".into(), "RevenantAlertsSuppressed".into());
                        labels.insert("rule".into(), s.rule.clone());
                        labels.insert("severity".into(), "warning".into());
                        labels.insert("node".into(), self.node.clone());
                        labels.insert("cluster".into(), self.cluster.clone());
                        labels.insert("source".into(), "revenant".into());
                        let mut ann = BTreeMap::new();
                        ann.insert(
                            "summary".into(),
                            format!(
                                "{} incident notifications led by {} were not sent (limit {} per window)",
                                s.suppressed, s.rule, s.limit
                            ),
                        );
                        ann.insert(
                            "fingerprints_sample".into(),
                            s.fingerprints_sample.join(", "),
                        );
                        ann.insert("findings".into(), s.findings.to_string());
                        PostableAlert {
                            labels,
                            annotations: ann,
                            starts_at: rfc3339(s.window_start_ns.max(1)),
                            // A summary is a one-off: it resolves after one horizon.
                            ends_at: rfc3339(self.horizon(now)),
                            generator_url: String::new(),
                        }
                    }
                };
                alerts.push(alert);
            }
            self.post(&alerts).await
        })
    }

    fn refresh_interval(&self) -> Option<Duration> {
        Some(self.resend)
    }

    fn refresh<'a>(
        &'a self,
        active: &'a [ActiveAlert],
        resolved: &'a [ActiveAlert],
    ) -> BoxFuture<'a, Result<(), SinkError>> {
        Box::pin(async move {
            let now = now_unix_ns();
            let mut alerts: Vec<PostableAlert> = active
                .iter()
                .map(|a| self.to_alert(&a.alert, self.horizon(now)))
                .collect();
            alerts.extend(resolved.iter().map(|a| self.to_alert(&a.alert, now)));
            for chunk in alerts.chunks(500) {
                self.post(chunk).await?;
            }
            Ok(())
        })
    }
}
