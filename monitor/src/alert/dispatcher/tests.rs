use std::sync::Mutex;

use super::*;
use crate::alert::notification::IncidentAlert;
use crate::alert::sink::SinkError;
use crate::alert::spool::SpoolConfig;
use crate::event::{Kind, Source, Stage};
use crate::violation::Severity;
use crate::violation::{AttemptAliases, Evidence, EvidenceRole, RequestAliases};

/// Records deliveries and refreshes, like an Alertmanager that re-posts active alerts.
#[derive(Default)]
struct Recorder {
    delivered: Mutex<Vec<Notification>>,
    refreshed: Mutex<Vec<Vec<ActiveAlert>>>,
}

struct RecordingSink(Arc<Recorder>);

impl Sink for RecordingSink {
    fn name(&self) -> &str {
        "recorder"
    }
    fn deliver<'a>(
        &'a self,
        batch: &'a [Arc<Notification>],
    ) -> super::super::sink::BoxFuture<'a, Result<(), SinkError>> {
        let r = self.0.clone();
        Box::pin(async move {
            let mut g = r.delivered.lock().unwrap();
            g.extend(batch.iter().map(|n| (**n).clone()));
            Ok(())
        })
    }
    fn refresh_interval(&self) -> Option<Duration> {
        // Only a forced refresh can happen within the test.
        Some(Duration::from_secs(3600))
    }
    fn refresh<'a>(
        &'a self,
        active: &'a [ActiveAlert],
        _resolved: &'a [ActiveAlert],
    ) -> super::super::sink::BoxFuture<'a, Result<(), SinkError>> {
        let r = self.0.clone();
        let active = active.to_vec();
        Box::pin(async move {
            r.refreshed.lock().unwrap().push(active);
            Ok(())
        })
    }
}

fn evidence(source: Source, t: u64, stage: Stage, kind: Kind) -> Evidence {
    Evidence {
        role: EvidenceRole::Offender,
        time_ns: t,
        stage,
        kind,
        source,
        status: None,
        reason: None,
    }
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn finding(rule: &str, req: &str, severity: Severity) -> Violation {
    Violation {
        rule: rule.into(),
        severity,
        summary: format!("{rule} on {req}"),
        request: RequestAliases {
            request_id: Some(req.into()),
            trace_id: None,
        },
        attempt: AttemptAliases {
            bootstrap_room: Some(42),
            rid: None,
        },
        worker: None,
        detected_at_ns: 2,
        fingerprint: format!("{rule}/{req}"),
        evidence: vec![evidence(Source::Otlp, 1, Stage::Decode, Kind::Work)],
        corroborates: false,
    }
}

/// A dispatcher over a fresh spool in `dir` (no fsync) delivering to one recorder, its ticks
/// every 20 ms.
fn recording(
    dir: &std::path::Path,
    flood: FloodConfig,
    metrics: Arc<Metrics>,
) -> (Dispatcher, Arc<Recorder>) {
    let spool_cfg = SpoolConfig {
        dir: Some(dir.to_path_buf()),
        fsync: false,
        ..SpoolConfig::default()
    };
    let (spool, _) = Spool::open(&spool_cfg, &["recorder".to_string()]).unwrap();
    let rec = Arc::new(Recorder::default());
    let d = Dispatcher::new(
        DispatchConfig {
            tick: Duration::from_millis(20),
            ..DispatchConfig::default()
        },
        flood,
        LinkBase::default(),
        spool,
        vec![Arc::new(RecordingSink(rec.clone()))],
        metrics,
    );
    (d, rec)
}

/// The group wait is timer-driven: two rules about one request become one notification,
/// another request its own; an escalation after delivery is exactly one update.
#[tokio::test]
async fn findings_of_one_request_are_one_notification_and_escalate_once() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = Arc::new(Metrics::new());
    let wait = Duration::from_millis(300);
    let flood = FloodConfig {
        group_wait: wait,
        ..FloodConfig::default()
    };
    let (d, rec) = recording(dir.path(), flood, metrics.clone());
    let (tx, rx) = mpsc::channel(16);
    let handle = tokio::spawn(d.run(rx));
    let t0 = Instant::now();
    tx.send(finding("orphaned-leg", "req-1", Severity::Warning))
        .await
        .unwrap();
    tx.send(finding("stuck-attempt", "req-1", Severity::Warning))
        .await
        .unwrap();
    tx.send(finding("orphaned-leg", "req-2", Severity::Warning))
        .await
        .unwrap();
    until("two notifications", || {
        rec.delivered.lock().unwrap().len() == 2
    })
    .await;
    assert!(t0.elapsed() >= wait, "sent before the group wait ended");
    tokio::time::sleep(wait * 2).await;
    let incidents = |n: &Notification| match n {
        Notification::Incident(a) => a.clone(),
        other => panic!("{other:?}"),
    };
    let got: Vec<IncidentAlert> = rec
        .delivered
        .lock()
        .unwrap()
        .iter()
        .map(incidents)
        .collect();
    assert_eq!(got.len(), 2, "{got:#?}");
    let one = got
        .iter()
        .find(|a| a.incident_key == "request_id:req-1")
        .unwrap();
    assert_eq!(one.rules, ["orphaned-leg", "stuck-attempt"]);
    assert_eq!(one.violation.severity, Severity::Warning);
    // Critical findings for req-1 after its notification: one escalation.
    tx.send(finding(
        "activity-after-rejection",
        "req-1",
        Severity::Critical,
    ))
    .await
    .unwrap();
    tx.send(finding(
        "activity-after-request-failed",
        "req-1",
        Severity::Critical,
    ))
    .await
    .unwrap();
    until("the update", || rec.delivered.lock().unwrap().len() == 3).await;
    tokio::time::sleep(wait * 2).await;
    drop(tx);
    let report = handle.await.unwrap();
    let got: Vec<IncidentAlert> = rec
        .delivered
        .lock()
        .unwrap()
        .iter()
        .map(incidents)
        .collect();
    assert_eq!(got.len(), 3, "{got:#?}");
    let u = &got[2];
    assert_eq!(u.incident, one.incident);
    assert_eq!(
        u.update,
        Some(crate::alert::notification::Update::Escalated)
    );
    assert_eq!(u.sequence, 2);
    assert_eq!(u.violation.rule, "activity-after-rejection");
    assert_eq!(u.findings.len(), 4);
    assert_eq!(
        (
            report.received,
            report.incidents,
            report.merged,
            report.notified
        ),
        (5, 2, 3, 3)
    );
    let text = metrics.render();
    for line in [
        "revenant_alerts_incidents_opened_total{rule=\"orphaned-leg\"} 2",
        "revenant_alerts_findings_merged_total{rule=\"stuck-attempt\",outcome=\"pending\"} 1",
        "revenant_alerts_findings_merged_total{rule=\"activity-after-rejection\",outcome=\"escalated\"} 1",
        "revenant_alerts_findings_merged_total{rule=\"activity-after-request-failed\",outcome=\"pending\"} 1",
    ] {
        assert!(text.contains(line), "{line} not in\n{text}");
    }
}

/// Without a corroboration window the notification goes out at once; the second source's
/// confirmation then sends nothing new but is re-posted at once as the one active alert
/// (what Alertmanager receives), with both sources in its evidence.
#[tokio::test]
async fn late_corroboration_is_reposted_merged_not_notified_again() {
    let dir = tempfile::tempdir().unwrap();
    let (d, rec) = recording(dir.path(), FloodConfig::default(), Arc::new(Metrics::new()));
    let (tx, rx) = mpsc::channel(16);
    let handle = tokio::spawn(d.run(rx));
    let v = Violation {
        rule: "activity-after-rejection".into(),
        severity: Severity::Critical,
        summary: "s".into(),
        request: RequestAliases {
            request_id: Some("req-1".into()),
            trace_id: None,
        },
        attempt: AttemptAliases {
            bootstrap_room: Some(42),
            rid: None,
        },
        worker: None,
        detected_at_ns: 2,
        fingerprint: "fp".into(),
        evidence: vec![
            evidence(Source::Otlp, 1, Stage::Prefill, Kind::Rejected),
            evidence(Source::Otlp, 2, Stage::Transfer, Kind::Work),
        ],
        corroborates: false,
    };
    tx.send(v.clone()).await.unwrap();
    until("the first notification", || {
        rec.delivered.lock().unwrap().len() == 1
    })
    .await;
    assert!(rec.refreshed.lock().unwrap().is_empty());
    let mut c = v.clone();
    c.corroborates = true;
    c.evidence
        .push(evidence(Source::Ebpf, 3, Stage::Transfer, Kind::Work));
    tx.send(c).await.unwrap();
    until("a re-post of the active alert", || {
        !rec.refreshed.lock().unwrap().is_empty()
    })
    .await;
    let active = rec.refreshed.lock().unwrap()[0].clone();
    assert_eq!(active.len(), 1, "one alert");
    assert_eq!(active[0].alert.occurrences, 1);
    let sources: Vec<Source> = active[0]
        .alert
        .violation
        .evidence
        .iter()
        .map(|e| e.source)
        .collect();
    assert_eq!(sources, [Source::Otlp, Source::Otlp, Source::Ebpf]);
    drop(tx);
    let report = handle.await.unwrap();
    assert_eq!(rec.delivered.lock().unwrap().len(), 1, "not notified again");
    assert_eq!(report.corroborated, 1);
    assert_eq!(report.deduplicated, 0);
}

/// In-memory claims shared by dispatchers, as lives and replicas of a checker share the
/// bucket: per key, whether its claimer has marked it spooled.
#[derive(Default)]
struct MemoryClaims {
    keys: Mutex<std::collections::BTreeMap<String, bool>>,
    /// Bytes in the spool's files when each batch was marked spooled (marks come after the
    /// spool).
    spooled_at_mark: Mutex<Vec<usize>>,
    spool_dir: Mutex<Option<std::path::PathBuf>>,
    /// The store cannot be reached: every claim answers "unknown".
    away: std::sync::atomic::AtomicBool,
}

impl crate::alert::claims::NotificationClaims for MemoryClaims {
    fn claim<'a>(
        &'a self,
        keys: &'a [String],
    ) -> crate::alert::claims::ClaimFuture<'a, Vec<crate::alert::claims::Claim>> {
        use crate::alert::claims::Claim;
        let mut held = self.keys.lock().unwrap();
        let away = self.away.load(std::sync::atomic::Ordering::SeqCst);
        let r = keys
            .iter()
            .map(|k| match (away, held.get(k)) {
                (true, _) => Claim::Unknown,
                (false, None) => {
                    held.insert(k.clone(), false);
                    Claim::Ours
                }
                (false, Some(true)) => Claim::SentBefore,
                (false, Some(false)) => Claim::Pending,
            })
            .collect();
        Box::pin(async move { r })
    }
    fn spooled<'a>(&'a self, keys: &'a [String]) -> crate::alert::claims::ClaimFuture<'a, ()> {
        let dir = self.spool_dir.lock().unwrap().clone();
        let bytes: u64 = dir.map_or(0, |d| {
            std::fs::read_dir(d)
                .unwrap()
                .map(|e| e.unwrap().metadata().unwrap().len())
                .sum()
        });
        self.spooled_at_mark.lock().unwrap().push(bytes as usize);
        let mut held = self.keys.lock().unwrap();
        for k in keys {
            held.insert(k.clone(), true);
        }
        Box::pin(async {})
    }
}

/// A dispatcher over a fresh spool in `dir` that releases every notification at once (one per
/// finding), claiming through `claims` when given, running: its input, its end, what it
/// delivered.
fn running(
    dir: &std::path::Path,
    claims: Option<Arc<MemoryClaims>>,
) -> (
    mpsc::Sender<Violation>,
    tokio::task::JoinHandle<DispatchReport>,
    Arc<Recorder>,
) {
    let flood = FloodConfig {
        group_wait: Duration::ZERO,
        ..FloodConfig::default()
    };
    let (mut d, rec) = recording(dir, flood, Arc::new(Metrics::new()));
    if let Some(c) = claims {
        d = d.with_claims(c);
    }
    let (tx, rx) = mpsc::channel(64);
    (tx, tokio::spawn(d.run(rx)), rec)
}

/// The claim keys of the notifications `rec` was delivered, in order.
fn delivered_keys(rec: &Recorder) -> Vec<String> {
    rec.delivered
        .lock()
        .unwrap()
        .iter()
        .filter_map(Notification::claim_key)
        .collect()
}

/// A second life that finds the same breaches again sends none of the notifications the first
/// sent, and only the new one; each key is marked spooled once the spool holds its notification.
#[tokio::test]
async fn notifications_claimed_by_an_earlier_life_are_not_sent_again() {
    let claims = Arc::new(MemoryClaims::default());
    let life = |claims: Arc<MemoryClaims>, findings: Vec<Violation>| async move {
        let dir = tempfile::tempdir().unwrap();
        *claims.spool_dir.lock().unwrap() = Some(dir.path().to_path_buf());
        let (tx, handle, rec) = running(dir.path(), Some(claims));
        for f in findings {
            tx.send(f).await.unwrap();
        }
        drop(tx);
        (handle.await.unwrap(), delivered_keys(&rec))
    };
    let first = vec![
        finding("orphaned-leg", "req-1", Severity::Warning),
        finding("activity-after-rejection", "req-2", Severity::Critical),
    ];
    let (r1, sent1) = life(claims.clone(), first.clone()).await;
    assert_eq!((r1.notified, r1.sent_before, sent1.len()), (2, 0, 2));
    let mut again = first;
    again.push(finding("orphaned-leg", "req-3", Severity::Warning));
    let (r2, sent2) = life(claims.clone(), again).await;
    assert_eq!((r2.notified, r2.sent_before), (1, 2), "{r2:?}");
    assert_eq!(sent2.len(), 1);
    assert!(!sent1.contains(&sent2[0]));
    assert_eq!(claims.keys.lock().unwrap().len(), 3);
    assert!(claims.keys.lock().unwrap().values().all(|spooled| *spooled));
    let at_mark = claims.spooled_at_mark.lock().unwrap().clone();
    assert_eq!(
        at_mark.len(),
        2,
        "one mark per intake batch that spooled: {at_mark:?}"
    );
    assert!(
        at_mark.iter().all(|n| *n > 0),
        "a key marked spooled before its notification was spooled: {at_mark:?}"
    );
}

/// While the claims cannot be answered, released notifications wait (none sent) and are claimed
/// again each tick: once the store answers, the one sent before is dropped and the new one
/// sent. What is still unsettled when the dispatcher stops is sent (a repeat is better than a
/// loss).
#[tokio::test]
async fn notifications_wait_for_claims_that_cannot_be_looked_up() {
    use std::sync::atomic::Ordering::SeqCst;
    let claims = Arc::new(MemoryClaims::default());
    let life = |claims: Arc<MemoryClaims>| {
        let dir = tempfile::tempdir().unwrap();
        let (tx, handle, rec) = running(dir.path(), Some(claims));
        (dir, tx, handle, rec)
    };
    let known = finding("orphaned-leg", "req-1", Severity::Warning);
    let (_dir, tx, handle, rec) = life(claims.clone());
    tx.send(known.clone()).await.unwrap();
    drop(tx);
    assert_eq!(handle.await.unwrap().notified, 1);
    let known_key = delivered_keys(&rec).pop().unwrap();

    claims.away.store(true, SeqCst);
    let (_dir, tx, handle, rec) = life(claims.clone());
    tx.send(known.clone()).await.unwrap();
    tx.send(finding("orphaned-leg", "req-2", Severity::Warning))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        rec.delivered.lock().unwrap().is_empty(),
        "sent before its claim could be looked up"
    );
    claims.away.store(false, SeqCst);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while delivered_keys(&rec).is_empty() {
        assert!(std::time::Instant::now() < deadline, "never sent");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(tx);
    let report = handle.await.unwrap();
    assert_eq!((report.notified, report.sent_before), (1, 1), "{report:?}");
    let sent = delivered_keys(&rec);
    assert_eq!(sent.len(), 1);
    assert_ne!(sent[0], known_key);

    claims.away.store(true, SeqCst);
    let (_dir, tx, handle, rec) = life(claims.clone());
    tx.send(finding("orphaned-leg", "req-3", Severity::Warning))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(rec.delivered.lock().unwrap().is_empty());
    drop(tx);
    let report = handle.await.unwrap();
    assert_eq!((report.notified, report.sent_before), (1, 0), "{report:?}");
    assert_eq!(delivered_keys(&rec).len(), 1, "held at stop and never sent");
}

/// A notification another process has claimed but not yet marked spooled (it is between its
/// claim and its spool) is held, not sent: once that process marks it, it counts as sent
/// before. Two checkers that find one breach at once send it once.
#[tokio::test]
async fn a_notification_claimed_elsewhere_waits_for_its_claimer() {
    let claims = Arc::new(MemoryClaims::default());
    let dir = tempfile::tempdir().unwrap();
    let (tx, handle, rec) = running(dir.path(), Some(claims.clone()));
    let found = finding("activity-after-rejection", "req-9", Severity::Critical);
    let key = {
        // The other checker's claim, from the notification this one is about to make.
        let dir2 = tempfile::tempdir().unwrap();
        let (tx2, h2, rec2) = running(dir2.path(), None);
        tx2.send(found.clone()).await.unwrap();
        drop(tx2);
        h2.await.unwrap();
        let key = delivered_keys(&rec2).remove(0);
        claims.keys.lock().unwrap().insert(key.clone(), false);
        key
    };
    tx.send(found).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        rec.delivered.lock().unwrap().is_empty(),
        "sent while another checker held its claim"
    );
    claims.keys.lock().unwrap().insert(key, true);
    drop(tx);
    let report = handle.await.unwrap();
    assert_eq!((report.notified, report.sent_before), (0, 1), "{report:?}");
    assert!(rec.delivered.lock().unwrap().is_empty());
}

/// Two checkers that find the same breaches at the same moment (a partition's old owner still
/// sending what it found while its successor reads the partition again) send each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_dispatchers_finding_the_same_breaches_at_once_send_each_once() {
    let claims = Arc::new(MemoryClaims::default());
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (tx_a, ha, rec_a) = running(dir_a.path(), Some(claims.clone()));
    let (tx_b, hb, rec_b) = running(dir_b.path(), Some(claims.clone()));
    let found: Vec<Violation> = (0..40)
        .map(|i| {
            finding(
                "activity-after-rejection",
                &format!("req-{i}"),
                Severity::Critical,
            )
        })
        .collect();
    for f in &found {
        tokio::join!(async { tx_a.send(f.clone()).await.unwrap() }, async {
            tx_b.send(f.clone()).await.unwrap()
        });
    }
    drop((tx_a, tx_b));
    let (ra, rb) = (ha.await.unwrap(), hb.await.unwrap());
    let mut sent: Vec<String> = [rec_a, rec_b]
        .iter()
        .flat_map(|r| delivered_keys(r))
        .collect();
    sent.sort();
    let n = sent.len();
    sent.dedup();
    assert_eq!(n, sent.len(), "a notification sent by both");
    assert_eq!(n, found.len(), "{ra:?} {rb:?}");
    assert_eq!(ra.sent_before + rb.sent_before, found.len() as u64);
}
