//! From the flood to the spool: released notifications counted, spooled in one group commit,
//! then queued for every sink.

use std::sync::Arc;
use std::time::Instant;

use super::delivery::SinkQueue;
use super::{DispatchReport, Dispatcher};
use crate::alert::claims::{CLAIM_HOLD, Claim, NotificationClaims};
use crate::alert::events::{AlertRateLimited, AlertSentBefore, AlertSpooled};
use crate::alert::flood::Release;
use crate::alert::notification::Notification;
use crate::alert::spool::SpoolError;
use crate::telemetry::events::ItemsDropped;
use crate::telemetry::metrics::{DropPoint, DropReason, Metrics};

impl Dispatcher {
    /// Notifications the flood released: claimed (cluster mode), spooled, queued.
    pub(super) async fn spool_and_enqueue(
        &mut self,
        notes: Vec<Notification>,
        names: &[String],
        queues: &[Arc<SinkQueue>],
        report: &mut DispatchReport,
    ) {
        let now = Instant::now();
        let notes = notes.into_iter().map(|n| (n, now)).collect();
        self.claim_and_spool(notes, false, names, queues, report)
            .await;
    }

    /// Claims again the notifications whose claims were not settled; `last`: the dispatcher is
    /// stopping, and what is still unsettled is sent.
    pub(super) async fn retry_unconfirmed(
        &mut self,
        last: bool,
        names: &[String],
        queues: &[Arc<SinkQueue>],
        report: &mut DispatchReport,
    ) {
        let held = std::mem::take(&mut self.unconfirmed);
        self.claim_and_spool(held, last, names, queues, report)
            .await;
    }

    async fn claim_and_spool(
        &mut self,
        notes: Vec<(Notification, Instant)>,
        last: bool,
        names: &[String],
        queues: &[Arc<SinkQueue>],
        report: &mut DispatchReport,
    ) {
        if notes.is_empty() {
            return;
        }
        let (notes, keys) = match self.claims.clone() {
            Some(c) => self.unclaimed(c.as_ref(), notes, last, report).await,
            None => (notes.into_iter().map(|(n, _)| n).collect(), Vec::new()),
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
            c.spooled(&spooled_keys).await;
        }
    }

    /// The notifications this process holds the right to send, with their claim keys (`None`
    /// for those never claimed); those another process sent are counted and dropped here; those
    /// whose claims are not settled (the store away, or another process between its claim and
    /// its spool) are held in `unconfirmed` (since when they were released) until
    /// [`CLAIM_HOLD`] has passed, then sent; when `last`, those the store did not answer about
    /// are sent and those another process holds are left to it.
    async fn unclaimed(
        &mut self,
        claims: &dyn NotificationClaims,
        notes: Vec<(Notification, Instant)>,
        last: bool,
        report: &mut DispatchReport,
    ) -> (Vec<Notification>, Vec<Option<String>>) {
        let keys: Vec<Option<String>> = notes.iter().map(|(n, _)| n.claim_key()).collect();
        let asked: Vec<String> = keys.iter().flatten().cloned().collect();
        let mut found = claims.claim(&asked).await.into_iter();
        let mut kept = (
            Vec::with_capacity(notes.len()),
            Vec::with_capacity(notes.len()),
        );
        for ((n, since), k) in notes.into_iter().zip(keys) {
            if k.is_some() {
                match found.next().unwrap_or(Claim::Unknown) {
                    Claim::SentBefore => {
                        report.sent_before += 1;
                        AlertSentBefore { rule: n.rule() }.emit(&self.metrics);
                        continue;
                    }
                    Claim::Ours => {}
                    // Stopping: its claimer (alive a moment ago) sends it.
                    Claim::Pending if last => {
                        tracing::warn!(
                            rule = n.rule(),
                            "stopping while another checker holds a notification's claim: left to it"
                        );
                        report.sent_before += 1;
                        AlertSentBefore { rule: n.rule() }.emit(&self.metrics);
                        continue;
                    }
                    unsettled if last || since.elapsed() >= CLAIM_HOLD => {
                        tracing::warn!(
                            rule = n.rule(), held = ?since.elapsed(), claim = ?unsettled,
                            "notification claim not settled: sending it (it may repeat one another checker sent)"
                        );
                    }
                    _ => {
                        self.unconfirmed.push((n, since));
                        continue;
                    }
                }
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
