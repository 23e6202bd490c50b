//! Real Alertmanager (Debian `prometheus-alertmanager`) receives revenant's alerts: one alert per
//! incident (two rules firing for one request), visible via its v2 API with the documented labels
//! and annotations, re-posted while active, forwarded through Alertmanager's own routing to a
//! webhook receiver, and an escalation replacing the incident's alert (the previous label set
//! resolved).
//! Run: `cargo test -p revenant --test alertmanager_e2e`.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use revenant::alert::{AlertConfig, AlertPipeline, AlertmanagerConfig};
use revenant::telemetry::Metrics;

use support::alerts::*;
use support::prometheus::start_prometheus_server;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alertmanager_receives_reposts_and_routes_alerts() {
    let am_bin = system_bin("prometheus-alertmanager");
    let tmp = tempfile::tempdir().unwrap();
    let receiver = Receiver::new(None, Duration::ZERO);
    let (hook, hook_task) = receiver.serve_any().await;

    let am_cfg = tmp.path().join("alertmanager.yml");
    std::fs::write(
        &am_cfg,
        format!(
            "route:\n  receiver: test\n  group_by: ['alertname', 'fingerprint']\n  group_wait: 1s\n  group_interval: 1s\n  repeat_interval: 1h\nreceivers:\n  - name: test\n    webhook_configs:\n      - url: http://{hook}/am\n        send_resolved: true\n"
        ),
    )
    .unwrap();
    let http = revenant::alert::webhook::http_client(Duration::from_secs(5)).unwrap();
    let (_am, am) = start_prometheus_server(
        &am_bin,
        "alertmanager",
        tmp.path(),
        &am_cfg,
        "--storage.path",
        // No gossip: a single instance on loopback.
        &["--cluster.listen-address="],
        &http,
    )
    .await;

    let metrics = Arc::new(Metrics::new());
    let mut amc = AlertmanagerConfig::new(am.clone());
    amc.resend_interval = Duration::from_secs(1);
    let mut cfg = AlertConfig {
        alertmanagers: vec![amc],
        external_url: Some("http://127.0.0.1:9464".into()),
        cluster: "test-cluster".into(),
        node: Some("node-a".into()),
        ..AlertConfig::default()
    };
    cfg.spool.dir = Some(tmp.path().join("spool"));
    cfg.spool.fsync = false;
    let p = AlertPipeline::start(&cfg, metrics.clone(), None, None).unwrap();
    // Two rules per request: one incident, one alert each.
    for i in 0..3 {
        revenant::alert::offer(&p.sender, violation(i), &metrics);
        revenant::alert::offer(
            &p.sender,
            violation_rule("activity-after-request-failed", i),
            &metrics,
        );
    }

    let get_alerts = || {
        let http = http.clone();
        let am = am.clone();
        async move {
            let v: serde_json::Value = http
                .get(format!("{am}/api/v2/alerts"))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            v.as_array().cloned().unwrap_or_default()
        }
    };
    let alerts = eventually(
        "3 alerts in Alertmanager",
        Duration::from_secs(20),
        async || {
            let a = get_alerts().await;
            (a.len() >= 3).then_some(a)
        },
    )
    .await;
    assert_eq!(alerts.len(), 3, "one alert per incident: {alerts:#?}");
    let mut fps = Vec::new();
    for a in &alerts {
        let l = &a["labels"];
        assert_eq!(l["alertname"], "activity-after-rejection", "{a}");
        assert_eq!(l["severity"], "critical");
        assert_eq!(l["stage"], "decode", "offender stage");
        assert_eq!(l["node"], "node-a");
        assert_eq!(l["cluster"], "test-cluster");
        assert_eq!(l["incident"].as_str().unwrap().len(), 16, "{a}");
        fps.push(l["fingerprint"].as_str().unwrap().to_string());
        let an = &a["annotations"];
        assert_eq!(
            an["rules"], "activity-after-rejection, activity-after-request-failed",
            "{an}"
        );
        let findings = an["findings"].as_str().unwrap();
        assert_eq!(findings.lines().count(), 2, "{an}");
        assert!(
            findings.starts_with("critical activity-after-rejection room 0x"),
            "{an}"
        );
        let i: u64 = an["incident_key"]
            .as_str()
            .unwrap()
            .strip_prefix("request_id:req-")
            .unwrap_or_else(|| panic!("{an}"))
            .parse()
            .unwrap();
        // The room (above 2^53) with every digit, and its hex.
        assert_eq!(an["bootstrap_room"], (ROOM + i).to_string(), "{an}");
        assert_eq!(an["bootstrap_room_hex"], format!("{:#x}", ROOM + i), "{an}");
        assert!(
            an["summary"]
                .as_str()
                .unwrap()
                .contains("rejected by prefill")
        );
        assert!(
            an["evidence"]
                .as_str()
                .unwrap()
                .contains("prefill/rejected via otlp status=400"),
            "{an}"
        );
        assert!(
            an["timeline"]
                .as_str()
                .unwrap()
                .starts_with("http://127.0.0.1:9464/api/requests/req-")
        );
        // The link a person follows: the request's page, not its JSON.
        assert!(
            an["request_page"]
                .as_str()
                .unwrap()
                .starts_with("http://127.0.0.1:9464/requests/req-"),
            "{an}"
        );
        assert_eq!(a["generatorURL"], an["request_page"], "{a}");
        assert_eq!(a["status"]["state"], "active");
    }
    fps.sort();
    let mut want: Vec<String> = (0..3).map(|i| violation(i).fingerprint).collect();
    want.sort();
    assert_eq!(fps, want);

    // Re-posted while active: Alertmanager's updatedAt moves forward.
    let updated = |a: &[serde_json::Value]| {
        let mut u: Vec<String> = a
            .iter()
            .map(|x| x["updatedAt"].as_str().unwrap().to_string())
            .collect();
        u.sort();
        u
    };
    let before = updated(&alerts);
    eventually("a re-post", Duration::from_secs(10), async || {
        let now = updated(&get_alerts().await);
        (now.len() == 3 && now.iter().zip(&before).all(|(a, b)| a > b)).then_some(())
    })
    .await;

    // Routed by Alertmanager to our webhook (its own payload format).
    let routed = eventually(
        "Alertmanager webhook notifications",
        Duration::from_secs(20),
        async || {
            // The receiver unpacks `alerts[]` of Alertmanager's webhook envelope.
            let got: Vec<String> = receiver
                .alerts()
                .iter()
                .filter(|a| a["status"] == "firing" && a["labels"]["source"] == "revenant")
                .map(|a| {
                    a["labels"]["fingerprint"]
                        .as_str()
                        .unwrap_or("")
                        .to_string()
                })
                .collect();
            let mut u = got.clone();
            u.sort();
            u.dedup();
            (u.len() == 3).then_some(u)
        },
    )
    .await;
    assert_eq!(routed, want);

    // Escalation: a warning incident, then a critical finding for the same request. The alert
    // under the critical lead replaces the warning one, which is resolved at once.
    let mut warning = violation_rule("orphaned-leg", 7);
    warning.severity = revenant::violation::Severity::Warning;
    revenant::alert::offer(&p.sender, warning, &metrics);
    let incident = eventually("the warning alert", Duration::from_secs(20), async || {
        get_alerts().await.into_iter().find_map(|a| {
            (a["labels"]["alertname"] == "orphaned-leg").then(|| a["labels"]["incident"].clone())
        })
    })
    .await;
    revenant::alert::offer(&p.sender, violation(7), &metrics);
    let escalated = eventually(
        "the critical alert replacing the warning",
        Duration::from_secs(20),
        async || {
            let mine: Vec<_> = get_alerts()
                .await
                .into_iter()
                .filter(|a| a["labels"]["incident"] == incident)
                .collect();
            (mine.len() == 1 && mine[0]["labels"]["alertname"] == "activity-after-rejection")
                .then(|| mine[0].clone())
        },
    )
    .await;
    assert_eq!(escalated["labels"]["severity"], "critical", "{escalated}");
    assert_eq!(
        escalated["annotations"]["rules"], "orphaned-leg, activity-after-rejection",
        "{escalated}"
    );
    drop(p.sender);
    let report = p.handle.await.unwrap();
    assert_eq!(report.undelivered_at_exit, 0);

    // The same through the real binary: `revenant run --alertmanager`, fed over OTLP.
    let mut rv = tokio::task::block_in_place(|| {
        Revenant::start(
            "alertmanager",
            &[
                "--alertmanager",
                &am,
                "--cluster",
                "e2e",
                "--spool-no-fsync",
            ],
        )
    });
    let (ok, out, err) = tokio::task::block_in_place(|| {
        rv.emit(&[
            "--transport",
            "grpc",
            "--scenario",
            "reject-then-decode",
            "--tag",
            "0a11",
        ])
    });
    assert!(ok, "{out} {err}");
    let rid = out["rid"].as_str().unwrap().to_string();
    let mine = eventually(
        "revenant run's alert in Alertmanager",
        Duration::from_secs(20),
        async || {
            get_alerts().await.into_iter().find(|a| {
                a["labels"]["cluster"] == "e2e"
                    && a["annotations"]["rules"]
                        .as_str()
                        .is_some_and(|r| r.contains("activity-after-rejection"))
                    && a.to_string().contains(&rid)
            })
        },
    )
    .await;
    assert_eq!(mine["labels"]["severity"], "critical", "{mine}");
    assert!(
        mine["generatorURL"]
            .as_str()
            .unwrap()
            .starts_with(&format!("http://{}/", rv.admin)),
        "links point at this revenant's admin server: {mine}"
    );
    assert!(tokio::task::block_in_place(|| rv.stop()).success());
    hook_task.abort();
}
