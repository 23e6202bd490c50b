//! Alert delivery against a real HTTP receiver on loopback: receiver down then up, 429 with
//! Retry-After, permanent refusals, revenant SIGKILLed mid-delivery then restarted on the same
//! spool, and incidents (findings of one request as one notification, escalation as one update,
//! no grouping with a group wait of 0). Run: `cargo test -p revenant --test alert_delivery`.

use crate::support;
use crate::traffic;

use std::collections::HashSet;
use std::io::BufRead;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use revenant::alert::{AlertConfig, AlertPipeline, WebhookConfig};
use revenant::telemetry::Metrics;

use support::alerts::*;
use support::*;
use test_harness::notifications::{room_of, unsafe_numbers};

fn config(spool: &std::path::Path, url: &str, secret: Option<&str>, batch: usize) -> AlertConfig {
    let mut w = WebhookConfig::new(url);
    w.secret = secret.map(str::to_string);
    w.max_batch = batch;
    w.timeout = Duration::from_secs(5);
    let mut cfg = AlertConfig {
        webhooks: vec![w],
        external_url: Some("http://127.0.0.1:9464".into()),
        retry_initial: Duration::from_millis(100),
        retry_max: Duration::from_millis(800),
        drain_timeout: Duration::from_secs(10),
        ..AlertConfig::default()
    };
    cfg.spool.dir = Some(spool.to_path_buf());
    cfg.spool.fsync = false;
    // Flood control has its own unit tests; here every fingerprint must be notified.
    cfg.flood.rate_limit = 0;
    cfg
}

/// Files in the spool directory other than its lock: entries and interrupted writes.
fn spool_entries(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name() != ".lock")
        .count()
}

fn metric(m: &Metrics, line_prefix: &str) -> f64 {
    m.render()
        .lines()
        .find(|l| l.starts_with(line_prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_down_then_up_delivers_each_fingerprint_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let port = test_harness::free_port().unwrap();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let metrics = Arc::new(Metrics::new());
    let cfg = config(
        dir.path(),
        &format!("http://{addr}/hook"),
        Some("s3cret"),
        7,
    );
    let p = AlertPipeline::start(&cfg, metrics.clone(), None, None).unwrap();
    const N: usize = 40;
    // Every fingerprint three times: repeats fold into the first notification.
    for round in 0..3 {
        for i in 0..N {
            assert!(
                revenant::alert::offer(&p.sender, violation(i), &metrics),
                "round {round}"
            );
        }
    }
    // Nothing listens yet: wait until delivery has really failed a few times.
    eventually("connection failures", Duration::from_secs(20), async || {
        (metric(
            &metrics,
            "revenant_alert_deliveries_total{sink=\"webhook-0\",outcome=\"retryable_error\"}",
        ) >= 3.0)
            .then_some(())
    })
    .await;
    assert_eq!(
        metric(&metrics, "revenant_spool_entries"),
        N as f64,
        "all spooled while down"
    );
    let rx = Receiver::new(Some("s3cret"), Duration::ZERO);
    let server = rx.serve(addr).await;
    eventually(
        "all fingerprints delivered",
        Duration::from_secs(30),
        async || (rx.counts_by("fingerprint").len() >= N).then_some(()),
    )
    .await;
    drop(p.sender);
    let report = p.handle.await.unwrap();
    server.abort();
    let counts = rx.counts_by("fingerprint");
    assert_eq!(counts.len(), N);
    assert!(counts.values().all(|c| *c == 1), "duplicates: {counts:?}");
    assert_eq!(*rx.bad_signatures.lock().unwrap(), 0);
    assert_eq!(report.received, 3 * N as u64);
    assert_eq!(report.deduplicated, 2 * N as u64);
    assert_eq!(report.undelivered_at_exit, 0);
    assert_eq!(spool_entries(dir.path()), 0, "spool emptied after acks");
    // The documented payload fields are present.
    let a = &rx.alerts()[0];
    assert_eq!(a["type"], "incident", "{a}");
    assert_eq!(a["sequence"], 1, "{a}");
    assert_eq!(a["rules"], serde_json::json!(["activity-after-rejection"]));
    assert_eq!(a["findings"][0]["rule"], "activity-after-rejection");
    assert_eq!(a["findings"][0]["evidence"], a["evidence"], "{a}");
    for k in [
        "type",
        "id",
        "incident",
        "incident_key",
        "sequence",
        "rules",
        "findings",
        "rule",
        "severity",
        "summary",
        "request",
        "attempt",
        "detected_at",
        "detected_at_ns",
        "fingerprint",
        "occurrences",
        "evidence",
        "links",
    ] {
        assert!(a.get(k).is_some(), "payload lacks {k}: {a}");
    }
    assert_eq!(a["evidence"][0]["source"], "otlp");
    // Rooms above 2^53 keep every digit in the body: a decimal string with its hex, and no id
    // as a JSON number a double would round.
    for a in rx.alerts() {
        let i: u64 = a["request"]["request_id"].as_str().unwrap()["req-".len()..]
            .parse()
            .unwrap();
        let room = ROOM + i;
        assert_eq!(a["attempt"]["bootstrap_room"], room.to_string(), "{a}");
        assert_eq!(
            a["attempt"]["bootstrap_room_hex"],
            format!("{room:#x}"),
            "{a}"
        );
        assert_eq!(room_of(&a["findings"][0]["attempt"]), Some(room), "{a}");
        assert_eq!(unsafe_numbers(&a), Vec::<String>::new(), "{a}");
    }
    assert!(
        a["links"]["timeline"]
            .as_str()
            .unwrap()
            .starts_with("http://127.0.0.1:9464/api/requests/req-")
    );
    assert!(
        a["links"]["page"]
            .as_str()
            .unwrap()
            .starts_with("http://127.0.0.1:9464/requests/req-"),
        "{a}"
    );
    let text = metrics.render();
    assert!(
        text.contains(&format!(
            "revenant_alert_delivered_notifications_total{{sink=\"webhook-0\"}} {N}"
        )),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn honours_retry_after_and_does_not_retry_permanent_refusals() {
    let dir = tempfile::tempdir().unwrap();
    let rx = Receiver::new(None, Duration::ZERO);
    rx.mode.store(429, Ordering::SeqCst);
    let (addr, server) = rx.serve_any().await;
    let metrics = Arc::new(Metrics::new());
    let cfg = config(dir.path(), &format!("http://{addr}/hook"), None, 10);
    let p = AlertPipeline::start(&cfg, metrics.clone(), None, None).unwrap();
    revenant::alert::offer(&p.sender, violation(1), &metrics);
    eventually("a 429", Duration::from_secs(10), async || {
        (*rx.requests.lock().unwrap() >= 1).then_some(())
    })
    .await;
    let t0 = std::time::Instant::now();
    eventually("the retry", Duration::from_secs(10), async || {
        (*rx.requests.lock().unwrap() >= 2).then_some(())
    })
    .await;
    // Retry-After: 1 beats the 100 ms backoff.
    assert!(
        t0.elapsed() >= Duration::from_millis(800),
        "retried after {:?}",
        t0.elapsed()
    );
    rx.mode.store(MODE_OK, Ordering::SeqCst);
    eventually("delivery after 429", Duration::from_secs(10), async || {
        (rx.alerts().len() == 1).then_some(())
    })
    .await;

    // 400: counted and dropped, never retried.
    rx.mode.store(400, Ordering::SeqCst);
    for i in 10..13 {
        revenant::alert::offer(&p.sender, violation(i), &metrics);
    }
    eventually(
        "permanent drops counted",
        Duration::from_secs(10),
        async || {
            (metric(
                &metrics,
                "revenant_dropped_items_total{point=\"sink\",reason=\"permanent_error\"}",
            ) == 3.0)
                .then_some(())
        },
    )
    .await;
    let requests = *rx.requests.lock().unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        *rx.requests.lock().unwrap(),
        requests,
        "a permanent refusal was retried"
    );
    assert_eq!(metric(&metrics, "revenant_spool_entries"), 0.0);
    drop(p.sender);
    p.handle.await.unwrap();
    server.abort();
}

/// Child half of the SIGKILL test: runs the dispatcher over the spool until killed.
/// Does nothing unless started by `sigkill_mid_delivery_loses_nothing`.
#[test]
fn spool_child() {
    let Ok(spool) = std::env::var("REVENANT_TEST_SPOOL") else {
        return;
    };
    let url = std::env::var("REVENANT_TEST_URL").unwrap();
    let produce: usize = std::env::var("REVENANT_TEST_PRODUCE")
        .unwrap()
        .parse()
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let metrics = Arc::new(Metrics::new());
        let mut cfg = config(std::path::Path::new(&spool), &url, None, 1);
        cfg.spool.fsync = true;
        let p = AlertPipeline::start(&cfg, metrics.clone(), None, None).unwrap();
        // Two rules per request: each spooled notification is a two-finding incident.
        for i in 0..produce {
            assert!(revenant::alert::offer(&p.sender, violation(i), &metrics));
            assert!(revenant::alert::offer(
                &p.sender,
                violation_rule("activity-after-request-failed", i),
                &metrics
            ));
        }
        let prefix = "revenant_alerts_notified_total{rule=\"activity-after-rejection\"}";
        while (metric(&metrics, prefix) as usize) < produce {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        println!("SPOOLED {produce}");
        use std::io::Write;
        std::io::stdout().flush().unwrap();
        // Deliver until killed.
        std::future::pending::<()>().await;
    });
}

/// Restarted on a spool of two-finding incidents: each is delivered (at least once, same id),
/// still listing both findings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_delivery_loses_nothing() {
    const N: usize = 60;
    let dir = tempfile::tempdir().unwrap();
    // Slow receiver: each request is recorded on arrival and answered 40 ms later.
    let rx = Receiver::new(None, Duration::from_millis(40));
    let (addr, server) = rx.serve_any().await;
    let child = |produce: usize| {
        let mut c = Command::new(std::env::current_exe().unwrap());
        let spool_child = match module_path!().split_once("::") {
            // libtest names a test by its path without the crate's name.
            Some((_crate, module)) => format!("{module}::spool_child"),
            None => "spool_child".to_owned(),
        };
        c.args(["--exact", &spool_child, "--nocapture", "--test-threads=1"])
            .env("REVENANT_TEST_SPOOL", dir.path())
            .env("REVENANT_TEST_URL", format!("http://{addr}/hook"))
            .env("REVENANT_TEST_PRODUCE", produce.to_string())
            .stdout(Stdio::piped());
        spawn("spool child", &mut c)
    };
    let mut first = child(N);
    // Wait (bounded) for the child to say everything is on disk.
    let out = first.child_mut().stdout.take().unwrap();
    let line = tokio::task::spawn_blocking(move || {
        std::io::BufReader::new(out)
            .lines()
            .map_while(Result::ok)
            .find_map(|l| l.find("SPOOLED").map(|i| l[i..].to_string()))
    });
    let line = tokio::time::timeout(Duration::from_secs(60), line)
        .await
        .expect("child never spooled")
        .unwrap();
    // libtest prints "test spool_child ... " on the same line.
    assert_eq!(line.as_deref(), Some(format!("SPOOLED {N}").as_str()));
    eventually("partial delivery", Duration::from_secs(30), async || {
        (rx.alerts().len() >= N / 4).then_some(())
    })
    .await;
    // SIGKILL: no destructor, no drain.
    let pid = first.pid() as i32;
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let _ = first.child_mut().wait();
    let before = rx.alerts().len();
    assert!(
        before < N,
        "the kill came too late to test anything ({before} of {N} delivered)"
    );
    let left = spool_entries(dir.path());
    assert!(left > 0, "spool should still hold undelivered alerts");

    let _second = child(0);
    eventually(
        "every fingerprint after restart",
        Duration::from_secs(60),
        async || (rx.counts_by("fingerprint").len() >= N).then_some(()),
    )
    .await;
    eventually("spool drained", Duration::from_secs(10), async || {
        (spool_entries(dir.path()) == 0).then_some(())
    })
    .await;
    let ids: HashSet<String> = rx
        .alerts()
        .iter()
        .map(|a| a["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids.len(), N, "every notification id arrived");
    for a in rx.alerts() {
        assert_eq!(
            a["rules"],
            serde_json::json!(["activity-after-rejection", "activity-after-request-failed"]),
            "spooled incidents come back whole: {a}"
        );
    }
    let dup = rx.alerts().len() - N;
    if dup > 0 {
        let order: Vec<String> = rx
            .alerts()
            .iter()
            .map(|a| {
                a["id"]
                    .as_str()
                    .unwrap()
                    .rsplit('-')
                    .next()
                    .unwrap()
                    .to_string()
            })
            .collect();
        eprintln!("arrival order (kill after {before}): {order:?}");
    }
    // At least once: what was in flight at the kill (one request, batch of one) arrives again,
    // and under load an ambiguous failure (request arrived, answer lost) can add one more retry.
    // Receivers deduplicate on `id`, which the assertion above shows is stable.
    assert!(dup <= 3, "{dup} duplicates");
    eprintln!(
        "sigkill: {before} delivered before the kill, {} after restart, {dup} duplicate(s)",
        rx.alerts().len() - before
    );
    server.abort();
}

/// A violation seen by OTLP only (trigger and offender), and its follow-up once eBPF confirmed it.
fn otlp_only_and_corroboration(
    i: usize,
) -> (
    revenant::violation::Violation,
    revenant::violation::Violation,
) {
    use revenant::event::Source;
    let mut v = violation(i);
    for e in &mut v.evidence {
        e.source = Source::Otlp;
    }
    let mut c = v.clone();
    c.corroborates = true;
    let mut seen_by_ebpf = c.evidence[1].clone();
    seen_by_ebpf.source = Source::Ebpf;
    seen_by_ebpf.time_ns += 1_000;
    c.evidence.push(seen_by_ebpf);
    (v, c)
}

fn evidence_sources(a: &serde_json::Value) -> HashSet<String> {
    a["evidence"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["source"].as_str().unwrap().to_string())
        .collect()
}

/// Two live sources and a corroboration window: an original held until the other source
/// confirms goes out once with both sources in its evidence; an unconfirmed one goes out when
/// the window ends; a confirmation after delivery sends nothing new and is not a repeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corroborations_merge_into_one_notification_and_are_never_repeats() {
    use revenant::telemetry::{ComponentKind, Readiness};
    let dir = tempfile::tempdir().unwrap();
    let metrics = Arc::new(Metrics::new());
    let rx = Receiver::new(None, Duration::ZERO);
    let (addr, server) = rx.serve_any().await;
    let mut cfg = config(dir.path(), &format!("http://{addr}/hook"), None, 50);
    cfg.flood.corroboration_window = Duration::from_secs(3);
    // A limit that a corroboration taking a slot would exceed.
    cfg.flood.rate_limit = 10;
    let readiness = Readiness::new(metrics.clone(), Duration::from_secs(60));
    for name in ["otlp", "ebpf"] {
        let h = readiness.register(name, ComponentKind::Source);
        h.ready();
        h.activity();
    }
    let p = AlertPipeline::start(&cfg, metrics.clone(), Some(&readiness), None).unwrap();
    const N: usize = 10;
    let pairs: Vec<_> = (0..N).map(otlp_only_and_corroboration).collect();
    for (v, _) in &pairs {
        assert!(revenant::alert::offer(&p.sender, v.clone(), &metrics));
    }
    // Half are confirmed by the second source while held.
    for (_, c) in &pairs[..N / 2] {
        assert!(revenant::alert::offer(&p.sender, c.clone(), &metrics));
    }
    eventually(
        "every fingerprint notified",
        Duration::from_secs(20),
        async || (rx.counts_by("fingerprint").len() >= N).then_some(()),
    )
    .await;
    // Confirmations of already delivered notifications: nothing new goes out.
    for (_, c) in &pairs[N / 2..] {
        assert!(revenant::alert::offer(&p.sender, c.clone(), &metrics));
    }
    eventually("late corroborations counted", Duration::from_secs(10), async || {
        (metric(
            &metrics,
            "revenant_alerts_corroborated_total{rule=\"activity-after-rejection\",outcome=\"merged_active\"}",
        ) >= (N / 2) as f64)
            .then_some(())
    })
    .await;
    drop(p.sender);
    let report = p.handle.await.unwrap();
    server.abort();
    let alerts = rx.alerts();
    assert_eq!(
        alerts.len(),
        N,
        "one notification per fingerprint: {alerts:#?}"
    );
    for a in &alerts {
        assert_eq!(a["occurrences"], 1, "a corroboration is not a repeat: {a}");
        assert!(a.get("corroborates").is_none(), "the original is sent: {a}");
        let i: usize = a["request"]["request_id"].as_str().unwrap()["req-".len()..]
            .parse()
            .unwrap();
        let want: HashSet<String> = if i < N / 2 {
            ["otlp", "ebpf"].map(String::from).into()
        } else {
            ["otlp"].map(String::from).into()
        };
        assert_eq!(evidence_sources(a), want, "{a}");
    }
    assert_eq!(report.received, 2 * N as u64);
    assert_eq!(report.corroborated, N as u64);
    assert_eq!(report.deduplicated, 0);
    assert_eq!(report.rate_limited, 0);
    assert_eq!(
        metric(
            &metrics,
            "revenant_alerts_held_total{rule=\"activity-after-rejection\"}"
        ),
        N as f64
    );
    assert_eq!(
        metric(
            &metrics,
            "revenant_alerts_corroborated_total{rule=\"activity-after-rejection\",outcome=\"merged_held\"}"
        ),
        (N / 2) as f64
    );
}

/// Started with a webhook and a group wait; `(pipeline, receiver, server task)`.
async fn grouped(
    dir: &std::path::Path,
    metrics: &Arc<Metrics>,
    group_wait: Duration,
) -> (AlertPipeline, Receiver, tokio::task::JoinHandle<()>) {
    let rx = Receiver::new(None, Duration::ZERO);
    let (addr, server) = rx.serve_any().await;
    let mut cfg = config(dir, &format!("http://{addr}/hook"), None, 50);
    cfg.flood.group_wait = group_wait;
    let p = AlertPipeline::start(&cfg, metrics.clone(), None, None).unwrap();
    (p, rx, server)
}

/// Two rules firing for one request within the group wait: one notification listing both
/// findings; each other request gets its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_rules_for_one_request_are_one_incident_notification() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = Arc::new(Metrics::new());
    let wait = Duration::from_millis(500);
    let (p, rx, server) = grouped(dir.path(), &metrics, wait).await;
    const N: usize = 8;
    for i in 0..N {
        assert!(revenant::alert::offer(&p.sender, violation(i), &metrics));
    }
    // The request-scope rule fires a little later for the same requests.
    tokio::time::sleep(Duration::from_millis(100)).await;
    for i in 0..N {
        let v = violation_rule("activity-after-request-failed", i);
        assert!(revenant::alert::offer(&p.sender, v, &metrics));
    }
    eventually(
        "one notification per request",
        Duration::from_secs(20),
        async || (rx.alerts().len() >= N).then_some(()),
    )
    .await;
    // Nothing else trails in.
    tokio::time::sleep(wait * 3).await;
    drop(p.sender);
    let report = p.handle.await.unwrap();
    server.abort();
    let alerts = rx.alerts();
    assert_eq!(alerts.len(), N, "{alerts:#?}");
    let mut keys = HashSet::new();
    for a in &alerts {
        assert_eq!(a["type"], "incident");
        assert!(
            keys.insert(a["incident"].as_str().unwrap().to_string()),
            "{a}"
        );
        let i: usize = a["request"]["request_id"].as_str().unwrap()["req-".len()..]
            .parse()
            .unwrap();
        assert_eq!(a["incident_key"], format!("request_id:req-{i}"));
        assert_eq!(a["severity"], "critical");
        assert_eq!(
            a["rules"],
            serde_json::json!(["activity-after-rejection", "activity-after-request-failed"])
        );
        let findings = a["findings"].as_array().unwrap();
        assert_eq!(findings.len(), 2, "{a}");
        for f in findings {
            for k in [
                "rule",
                "severity",
                "summary",
                "attempt",
                "evidence",
                "fingerprint",
            ] {
                assert!(f.get(k).is_some(), "finding lacks {k}: {f}");
            }
            let room = ROOM + i as u64;
            assert_eq!(f["attempt"]["bootstrap_room"], room.to_string(), "{f}");
            assert_eq!(
                f["attempt"]["bootstrap_room_hex"],
                format!("{room:#x}"),
                "{f}"
            );
        }
        assert_eq!(
            a["rule"], "activity-after-rejection",
            "the lead: first among equals"
        );
    }
    assert_eq!(report.received, 2 * N as u64);
    assert_eq!(report.incidents, N as u64);
    assert_eq!(report.merged, N as u64);
    assert_eq!(report.notified, N as u64);
    assert_eq!(
        metric(
            &metrics,
            "revenant_alerts_findings_merged_total{rule=\"activity-after-request-failed\",outcome=\"pending\"}"
        ),
        N as f64
    );
    assert_eq!(
        metric(
            &metrics,
            "revenant_alerts_incidents_opened_total{rule=\"activity-after-rejection\"}"
        ),
        N as f64
    );
}

/// A warning notified, then critical findings about the same request: exactly one update,
/// marked as an escalation; a later finding of no higher severity sends nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn severity_escalation_after_sending_is_exactly_one_update() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = Arc::new(Metrics::new());
    let wait = Duration::from_millis(300);
    let (p, rx, server) = grouped(dir.path(), &metrics, wait).await;
    let mut warning = violation_rule("orphaned-leg", 1);
    warning.severity = revenant::violation::Severity::Warning;
    assert!(revenant::alert::offer(&p.sender, warning, &metrics));
    eventually("the warning", Duration::from_secs(10), async || {
        (rx.alerts().len() == 1).then_some(())
    })
    .await;
    assert_eq!(rx.alerts()[0]["severity"], "warning");
    for rule in ["activity-after-rejection", "activity-after-request-failed"] {
        assert!(revenant::alert::offer(
            &p.sender,
            violation_rule(rule, 1),
            &metrics
        ));
    }
    eventually("the update", Duration::from_secs(10), async || {
        (rx.alerts().len() >= 2).then_some(())
    })
    .await;
    let mut stuck = violation_rule("stuck-attempt", 1);
    stuck.severity = revenant::violation::Severity::Warning;
    assert!(revenant::alert::offer(&p.sender, stuck, &metrics));
    tokio::time::sleep(wait * 3).await;
    drop(p.sender);
    p.handle.await.unwrap();
    server.abort();
    let alerts = rx.alerts();
    assert_eq!(alerts.len(), 2, "{alerts:#?}");
    let u = &alerts[1];
    assert_eq!(u["incident"], alerts[0]["incident"]);
    assert_eq!(u["update"], "escalated", "{u}");
    assert_eq!(u["sequence"], 2);
    assert_eq!(u["severity"], "critical");
    assert_eq!(u["rule"], "activity-after-rejection");
    assert_eq!(u["escalated_from"]["rule"], "orphaned-leg");
    assert_eq!(u["escalated_from"]["severity"], "warning");
    assert_eq!(
        u["rules"],
        serde_json::json!([
            "orphaned-leg",
            "activity-after-rejection",
            "activity-after-request-failed"
        ])
    );
    assert_eq!(
        metric(
            &metrics,
            "revenant_alerts_findings_merged_total{rule=\"stuck-attempt\",outcome=\"notified\"}"
        ),
        1.0,
        "merged into the record, counted, not notified"
    );
}

/// `group_wait: 0` turns grouping off: one notification per (rule, request), sent at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_wait_zero_notifies_each_finding() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = Arc::new(Metrics::new());
    let (p, rx, server) = grouped(dir.path(), &metrics, Duration::ZERO).await;
    for rule in ["activity-after-rejection", "activity-after-request-failed"] {
        assert!(revenant::alert::offer(
            &p.sender,
            violation_rule(rule, 3),
            &metrics
        ));
    }
    eventually("two notifications", Duration::from_secs(10), async || {
        (rx.alerts().len() == 2).then_some(())
    })
    .await;
    drop(p.sender);
    let report = p.handle.await.unwrap();
    server.abort();
    let alerts = rx.alerts();
    let mut rules: Vec<&str> = alerts.iter().map(|a| a["rule"].as_str().unwrap()).collect();
    rules.sort();
    assert_eq!(
        rules,
        ["activity-after-rejection", "activity-after-request-failed"]
    );
    for a in &alerts {
        assert_eq!(a["findings"].as_array().unwrap().len(), 1, "{a}");
        assert_eq!(a["incident_key"], "request_id:req-3");
    }
    assert_ne!(alerts[0]["incident"], alerts[1]["incident"]);
    assert_eq!((report.incidents, report.merged), (2, 0));
}

/// Runs `revenant run` in `dir` (its log and ready file there) on the spool `spool`.
fn run_on_spool(
    dir: &std::path::Path,
    spool: &std::path::Path,
    extra: &[&str],
) -> test_harness::Revenant {
    std::fs::create_dir_all(dir).unwrap();
    let mut args: Vec<&str> = vec![
        "--spool-dir",
        spool.to_str().unwrap(),
        "--spool-no-fsync",
        "--group-wait",
        "0s",
    ];
    args.extend_from_slice(extra);
    test_harness::Revenant::start_within(
        std::path::Path::new(env!("CARGO_BIN_EXE_revenant")),
        dir,
        &args,
        Duration::from_secs(20),
    )
    .unwrap_or_else(|e| panic!("{e:#}"))
}

fn jsonl_ids(path: &std::path::Path) -> Vec<String> {
    test_harness::read_jsonl_so_far(path)
        .iter()
        .map(|v| v["id"].as_str().unwrap().to_string())
        .collect()
}

fn wait_for_lines(path: &std::path::Path, n: usize, rv: &test_harness::Revenant) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while jsonl_ids(path).len() < n {
        assert!(
            std::time::Instant::now() < deadline,
            "{} has {} of {n} alerts:\n{}",
            path.display(),
            jsonl_ids(path).len(),
            rv.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The `stopped` summary line of a run's log.
fn summary(log: &str) -> String {
    log.lines()
        .rfind(|l| l.contains("stopped after draining"))
        .unwrap_or_else(|| panic!("no summary in\n{log}"))
        .to_string()
}

/// Alerts spooled for a webhook that refuses every connection survive a restart without that
/// webhook: the sink configured now gets each exactly once, a further restart sends nothing
/// again, and dropping them takes `--spool-discard-removed-sinks` (counted and summarised).
#[test]
fn spooled_alerts_for_a_removed_sink_are_rerouted_not_dropped() {
    const N: u64 = 3;
    let tmp = tempfile::tempdir().unwrap();
    let spool = tmp.path().join("spool");
    let first_jsonl = tmp.path().join("first.jsonl");
    let refused = "http://127.0.0.1:1/hook";

    let mut rv = run_on_spool(
        &tmp.path().join("run1"),
        &spool,
        &[
            "--webhook",
            refused,
            "--alerts-jsonl",
            first_jsonl.to_str().unwrap(),
        ],
    );
    for i in 0..N {
        traffic::reject_then_decode(&rv.otlp_http, i);
    }
    wait_for_lines(&first_jsonl, N as usize, &rv);
    let log = rv.stop_log().unwrap();
    let s = summary(&log);
    assert!(s.contains(&format!("{N} pending in the spool")), "{s}");
    let spooled = jsonl_ids(&first_jsonl);

    // Without the webhook: re-routed to the JSON Lines sink configured now.
    let second_jsonl = tmp.path().join("second.jsonl");
    let second = ["--alerts-jsonl", second_jsonl.to_str().unwrap()];
    let mut rv = run_on_spool(&tmp.path().join("run2"), &spool, &second);
    wait_for_lines(&second_jsonl, N as usize, &rv);
    let (_, metrics) = support::admin_get(&rv.admin, "/metrics");
    let log = rv.stop_log().unwrap();
    assert!(log.contains("re-routed"), "{log}");
    assert!(!log.contains("items dropped"), "{log}");
    let discarded = support::metric_sum(
        &support::parse_metrics(&metrics),
        "revenant_dropped_items_total",
        &[("reason", "sink_removed")],
    );
    assert_eq!(discarded, 0.0, "{metrics}");
    let s = summary(&log);
    assert!(s.contains("0 pending in the spool"), "{s}");
    assert!(s.contains(&format!("{N} delivered to every sink")), "{s}");
    let mut got = jsonl_ids(&second_jsonl);
    got.sort();
    let mut want = spooled.clone();
    want.sort();
    assert_eq!(got, want, "each spooled alert exactly once");

    // The same configuration again: nothing is sent twice.
    let mut rv = run_on_spool(&tmp.path().join("run3"), &spool, &second);
    std::thread::sleep(Duration::from_millis(500));
    let log = rv.stop_log().unwrap();
    assert!(!log.contains("re-routed"), "{log}");
    assert_eq!(jsonl_ids(&second_jsonl).len(), N as usize, "no duplicate");

    // Spool again for the refusing webhook, then discard on request.
    let mut rv = run_on_spool(
        &tmp.path().join("run4"),
        &spool,
        &[
            "--webhook",
            refused,
            "--alerts-jsonl",
            first_jsonl.to_str().unwrap(),
        ],
    );
    for i in 10..10 + N {
        traffic::reject_then_decode(&rv.otlp_http, i);
    }
    wait_for_lines(&first_jsonl, 2 * N as usize, &rv);
    rv.stop_log().unwrap();
    let third_jsonl = tmp.path().join("third.jsonl");
    let mut rv = run_on_spool(
        &tmp.path().join("run5"),
        &spool,
        &[
            "--alerts-jsonl",
            third_jsonl.to_str().unwrap(),
            "--spool-discard-removed-sinks",
        ],
    );
    let (_, metrics) = support::admin_get(&rv.admin, "/metrics");
    let log = rv.stop_log().unwrap();
    assert!(
        metrics.contains(&format!(
            "revenant_dropped_items_total{{point=\"spool\",reason=\"sink_removed\"}} {N}"
        )),
        "{metrics}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains("ERROR") && l.contains("--spool-discard-removed-sinks")),
        "{log}"
    );
    let s = summary(&log);
    assert!(
        s.contains(&format!("{N} discarded from the spool at your request")),
        "{s}"
    );
    assert!(jsonl_ids(&third_jsonl).is_empty());
    assert_eq!(spool_entries(&spool), 0);
}
