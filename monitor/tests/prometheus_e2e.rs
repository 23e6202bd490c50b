//! Real Prometheus scrapes a running admin server fed by a real checker and alert pipeline; every
//! query of `dashboards/revenant-overview.json` must return data through Prometheus' HTTP API,
//! and the alerting rules load in Prometheus and pass `promtool test rules`. Also exercises the
//! admin endpoints over HTTP. Run: `cargo test -p revenant --test prometheus_e2e`.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use revenant::admin::events::EventObserved;
use revenant::admin::{
    AdminServer, AdminState, ComponentKind, Metrics, Readiness, RecentEvents, RecentEventsLimits,
    RecentViolations,
};
use revenant::alert::notification::now_unix_ns;
use revenant::alert::{AlertConfig, AlertPipeline, WebhookConfig};
use revenant::checker::{Checker, CheckerConfig, RuleSet};
use revenant::event::{Kind, LifecycleEvent, Source, Stage};
use revenant::workload::{Mix, attempt_events};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

#[test]
fn alert_rules_pass_promtool() {
    let promtool = ensure_debian_package("promtool", "prometheus");
    let dir = repo().join("dashboards");
    for args in [
        vec!["check", "rules", "revenant-alerts.yaml"],
        vec!["test", "rules", "revenant-alerts.test.yaml"],
    ] {
        let out = Command::new(&promtool)
            .args(&args)
            .current_dir(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// One rejected-then-still-decoding request: what the default rules catch.
fn offending_request(j: u64, t0: u64) -> Vec<LifecycleEvent> {
    const MS: u64 = 1_000_000;
    let room = 0xfeed_0000 + j;
    let req = format!("bad-{j}");
    vec![
        LifecycleEvent::new(t0, Stage::Router, Kind::Received, Source::Otlp)
            .with_request_id(req.as_str()),
        LifecycleEvent::new(t0 + MS, Stage::Router, Kind::Dispatched, Source::Otlp)
            .with_request_id(req.as_str())
            .with_room(room)
            .with_to(Stage::Prefill),
        LifecycleEvent::new(t0 + 2 * MS, Stage::Prefill, Kind::Rejected, Source::Otlp)
            .with_room(room)
            .with_rid(format!("p-{j}"))
            .with_status(400)
            .with_reason("capacity"),
        LifecycleEvent::new(t0 + 30 * MS, Stage::Decode, Kind::Work, Source::Ebpf)
            .with_room(room)
            .with_rid(format!("d-{j}")),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_and_every_dashboard_query_has_data() {
    let prometheus = ensure_debian_package("prometheus", "prometheus");
    let tmp = tempfile::tempdir().unwrap();

    // --- revenant side: admin server, checker, alert pipeline to a loopback webhook.
    let metrics = Arc::new(Metrics::new());
    let readiness = Readiness::new(metrics.clone(), Duration::from_secs(60));
    let src = readiness.register("otlp", ComponentKind::Source);
    let ebpf = readiness.register("ebpf", ComponentKind::Source);
    let srv = readiness.register("admin", ComponentKind::Server);
    metrics.declare_source(Source::Otlp);
    metrics.declare_source(Source::Ebpf);
    // The OTLP receivers' own counters, as `revenant run` attaches them.
    let otlp = Arc::new(revenant::ingest::otlp::OtlpStats::default());
    metrics.attach_otlp(otlp.clone());
    let recent = Arc::new(RecentViolations::new(100));
    let timeline = Arc::new(RecentEvents::new(RecentEventsLimits::default()));
    let admin = AdminServer::bind(([127, 0, 0, 1], 0).into()).await.unwrap();
    let admin_addr = admin.local_addr();
    let state = AdminState {
        metrics: metrics.clone(),
        readiness: readiness.clone(),
        violations: recent.clone(),
        timeline: timeline.clone(),
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let admin_task = tokio::spawn(admin.serve(state, async move {
        let _ = stop_rx.await;
    }));
    srv.ready();

    let receiver = Receiver::new(None, Duration::ZERO);
    let (hook, hook_task) = receiver.serve_any().await;
    let mut cfg = AlertConfig {
        webhooks: vec![WebhookConfig::new(format!("http://{hook}/hook"))],
        external_url: Some(format!("http://{admin_addr}")),
        ..AlertConfig::default()
    };
    cfg.spool.dir = Some(tmp.path().join("spool"));
    cfg.spool.fsync = false;
    // Low enough that the scenario exercises the rate limiter too.
    cfg.flood.rate_limit = 3;
    let pipeline = AlertPipeline::start(
        &cfg,
        metrics.clone(),
        Some(&readiness),
        Some(recent.clone()),
    )
    .unwrap();
    let tx = pipeline.sender.clone();

    // The run loop in miniature: events → metrics + timeline index → checker → alerts.
    let (m2, tl2) = (metrics.clone(), timeline.clone());
    let feeder = tokio::spawn(async move {
        let mut checker = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
        let mut i = 0u64;
        loop {
            let now = now_unix_ns();
            let mix = Mix {
                attempts: 1,
                reject_every: 3,
                spacing_ns: 0,
                epoch_ns: now - 200_000_000,
            };
            let mut batch = attempt_events(&mix, i);
            if i.is_multiple_of(4) {
                batch.extend(offending_request(i, now - 150_000_000));
            }
            tl2.record(&batch);
            for e in &batch {
                EventObserved {
                    event: e,
                    arrival_ns: now,
                }
                .emit(&m2);
                for v in checker.observe(e) {
                    // Twice: the second one is deduplicated.
                    revenant::alert::offer(&tx, v.clone(), &m2);
                    revenant::alert::offer(&tx, v, &m2);
                }
            }
            for v in checker.tick(now) {
                revenant::alert::offer(&tx, v, &m2);
            }
            m2.publish_checker(&checker, now);
            {
                use revenant::ingest::otlp::{RejectReason, Transport};
                use std::sync::atomic::Ordering::Relaxed;
                otlp.requests_accepted[Transport::Grpc as usize].fetch_add(1, Relaxed);
                otlp.spans_received[0].fetch_add(batch.len() as u64, Relaxed);
                if i.is_multiple_of(10) {
                    otlp.rejected(Transport::Grpc, RejectReason::PipelineFull, 100);
                }
            }
            // Sources report in once their first batch went through (later calls are no-ops).
            src.ready();
            ebpf.ready();
            src.activity();
            ebpf.activity();
            i += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });

    // --- admin endpoints over real HTTP.
    let http = revenant::alert::webhook::http_client(Duration::from_secs(10)).unwrap();
    let base = format!("http://{admin_addr}");
    let get = |path: String| {
        let http = http.clone();
        async move { http.get(path).send().await.unwrap() }
    };
    assert_eq!(get(format!("{base}/healthz")).await.status(), 200);
    let ready: serde_json::Value = wait_for(Duration::from_secs(10), "/readyz 200", async || {
        let r = get(format!("{base}/readyz")).await;
        if r.status() == 200 {
            Some(r.json().await.unwrap())
        } else {
            None
        }
    })
    .await;
    assert_eq!(ready["ready"], true);
    let live: Vec<&str> = ready["live_sources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(live.contains(&"otlp") && live.contains(&"ebpf"), "{ready}");
    let violations: serde_json::Value =
        wait_for(Duration::from_secs(10), "a violation", async || {
            let v: serde_json::Value = get(format!("{base}/api/violations?limit=5"))
                .await
                .json()
                .await
                .unwrap();
            (!v["violations"].as_array().unwrap().is_empty()).then_some(v)
        })
        .await;
    let first = &violations["violations"][0];
    assert_eq!(first["rule"], "activity-after-rejection", "{first}");
    let req = first["request"]["request_id"].as_str().unwrap();
    let t: serde_json::Value = get(format!("{base}/api/requests/{req}"))
        .await
        .json()
        .await
        .unwrap();
    let kinds: Vec<&str> = t["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["received", "dispatched", "rejected", "work"], "{t}");
    assert_eq!(
        get(format!("{base}/api/requests/never-seen"))
            .await
            .status(),
        404
    );
    let text = get(format!("{base}/metrics")).await.text().await.unwrap();
    assert!(!text.contains("bad-0"), "a request id leaked into /metrics");

    // --- real Prometheus scraping it, with the alerting rules loaded.
    let prom_port = free_port();
    let rules = repo().join("dashboards/revenant-alerts.yaml");
    let prom_cfg = tmp.path().join("prometheus.yml");
    std::fs::write(
        &prom_cfg,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: revenant\n    static_configs:\n      - targets: ['{admin_addr}']\n",
            rules.display()
        ),
    )
    .unwrap();
    let _prom = spawn(
        Command::new(&prometheus)
            .arg(format!("--config.file={}", prom_cfg.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                tmp.path().join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(tmp.path().join("prometheus.log")).unwrap()),
    );
    let prom = format!("http://127.0.0.1:{prom_port}");
    wait_for(
        Duration::from_secs(60),
        "Prometheus ready",
        async || match http.get(format!("{prom}/-/ready")).send().await {
            Ok(r) if r.status() == 200 => Some(()),
            _ => None,
        },
    )
    .await;
    let query = |q: String| {
        let http = http.clone();
        let prom = prom.clone();
        async move {
            let r: serde_json::Value = http
                .get(format!("{prom}/api/v1/query"))
                .query(&[("query", q.as_str())])
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            r
        }
    };
    // Enough scrapes for rate() over the window used below.
    wait_for(
        Duration::from_secs(60),
        "5 successful scrapes",
        async || {
            let r = query(
                "count_over_time(up{job=\"revenant\"}[1m]) >= 5 and up{job=\"revenant\"} == 1"
                    .into(),
            )
            .await;
            (!r["data"]["result"].as_array().unwrap().is_empty()).then_some(())
        },
    )
    .await;
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("dashboards/revenant-overview.json")).unwrap(),
    )
    .unwrap();
    let mut exprs = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            exprs.push((
                p["title"].as_str().unwrap().to_string(),
                t["expr"].as_str().unwrap().to_string(),
            ));
        }
    }
    assert!(exprs.len() >= 20, "dashboard has {} queries", exprs.len());
    let mut empty = Vec::new();
    for (title, e) in &exprs {
        let q = e
            .replace("$__rate_interval", "30s")
            .replace("$job", "revenant");
        let r = query(q.clone()).await;
        assert_eq!(r["status"], "success", "{title}: {q}: {r}");
        if r["data"]["result"].as_array().is_none_or(|a| a.is_empty()) {
            empty.push(format!("{title}: {q}"));
        }
    }
    assert!(
        empty.is_empty(),
        "dashboard queries without data:\n{}",
        empty.join("\n")
    );
    // The rules loaded into the real Prometheus too.
    let rules: serde_json::Value = http
        .get(format!("{prom}/api/v1/rules"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let n = rules["data"]["groups"][0]["rules"]
        .as_array()
        .map(|a| a.len())
        .unwrap_or(0);
    assert_eq!(n, 10, "{rules}");
    eprintln!(
        "{} dashboard queries returned data; {} alerts delivered",
        exprs.len(),
        receiver.alerts().len()
    );

    feeder.abort();
    drop(pipeline.sender);
    let _ = stop_tx.send(());
    let _ = admin_task.await;
    hook_task.abort();
}
