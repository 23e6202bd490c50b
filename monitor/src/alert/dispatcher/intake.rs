//! From the flood to the spool: released notifications counted, spooled in one group commit,
//! then queued for every sink.

use std::sync::Arc;

use super::delivery::SinkQueue;
use super::{DispatchReport, Dispatcher};
use crate::alert::claims::NotificationClaims;
use crate::alert::flood::Release;
use crate::alert::notification::Notification;
use crate::alert::spool::SpoolError;
use crate::telemetry::events::{AlertRateLimited, AlertSentBefore, AlertSpooled, ItemsDropped};
use crate::telemetry::metrics::{DropPoint, DropReason, Metrics};

impl Dispatcher {
    pub(super) async fn spool_and_enqueue(
        &self,
        notes: Vec<Notification>,
        names: &[String],
        queues: &[Arc<SinkQueue>],
        report: &mut DispatchReport,
    ) {
        if notes.is_empty() {
            return;
        }
        let (notes, keys) = match &self.claims {
            Some(c) => self.unclaimed(c.as_ref(), notes, report).await,
            None => (notes, Vec::new()),
        };
        if notes.is_empty() {
            return;
        }
        let rules: Vec<String> = notes.iter().map(|n| n.rule().to_string()).collect();
        let spool = self.spool.clone();
        let names_owned = names.to_vec();
        let n = notes.len();
        // File writes and the sync can take milliseconds: keep them off the async workers.
        let results = tokio::task::spawn_blocking(move || spool.put_many(notes, &names_owned))
            .await
            .unwrap_or_else(|e| {
                (0..n)
                    .map(|_| {
                        Err(SpoolError::Write {
                            path: Default::default(),
                            source: std::io::Error::other(e.to_string()),
                        })
                    })
                    .collect()
            });
        let mut spooled_keys = Vec::with_capacity(keys.len());
        for (i, (res, rule)) in results.into_iter().zip(&rules).enumerate() {
            match res {
                Ok(seq) => {
                    if let Some(Some(k)) = keys.get(i) {
                        spooled_keys.push(k.clone());
                    }
                    report.notified += 1;
                    let (entries, bytes) = self.spool.size();
                    AlertSpooled {
                        rule,
                        entries,
                        bytes,
                    }
                    .emit(&self.metrics);
                    for q in queues {
                        q.push(seq);
                    }
                }
                Err(e) => {
                    report.spool_dropped += 1;
                    let reason = match e {
                        SpoolError::Full { .. } => DropReason::Full,
                        _ => DropReason::WriteError,
                    };
                    tracing::error!(error = %e, rule, "cannot spool alert; dropped");
                    ItemsDropped {
                        point: DropPoint::Spool,
                        reason,
                        count: 1,
                    }
                    .emit(&self.metrics);
                }
            }
        }
        if let Some(c) = &self.claims
            && !spooled_keys.is_empty()
        {
            c.record(&spooled_keys).await;
        }
    }

    /// The notifications the claims do not know as sent before, with their claim keys (`None`
    /// for those never claimed); the others are counted as deduplicated and dropped here.
    async fn unclaimed(
        &self,
        claims: &dyn NotificationClaims,
        notes: Vec<Notification>,
        report: &mut DispatchReport,
    ) -> (Vec<Notification>, Vec<Option<String>>) {
        let keys: Vec<Option<String>> = notes.iter().map(Notification::claim_key).collect();
        let asked: Vec<String> = keys.iter().flatten().cloned().collect();
        let mut before = claims.sent_before(&asked).await.into_iter();
        let mut kept = (
            Vec::with_capacity(notes.len()),
            Vec::with_capacity(notes.len()),
        );
        for (n, k) in notes.into_iter().zip(keys) {
            if k.is_some() && before.next().unwrap_or(false) {
                report.sent_before += 1;
                AlertSentBefore { rule: n.rule() }.emit(&self.metrics);
                continue;
            }
            kept.0.push(n);
            kept.1.push(k);
        }
        kept
    }
}

/// The notifications among `released`; rate-limited ones are counted per finding.
pub(super) fn released(
    released: Vec<Release>,
    metrics: &Metrics,
    report: &mut DispatchReport,
) -> Vec<Notification> {
    let mut notes = Vec::with_capacity(released.len());
    for r in released {
        match r {
            Release::Notify(a) => notes.push(Notification::Incident(a)),
            Release::RateLimited { lead_rule, rules } => {
                tracing::debug!(rule = %lead_rule, findings = rules.len(), "incident notification rate-limited");
                for rule in &rules {
                    report.rate_limited += 1;
                    AlertRateLimited { rule }.emit(metrics);
                }
            }
        }
    }
    notes
}
