//! Real Prometheus scrapes a fleet: a `revenant run` fed with real OTLP exports (the Python SDK),
//! a second `revenant run` that is blind (no source at all), and a cluster-mode agent and checker
//! on a loopback NATS. Every query of `dashboards/revenant-overview.json` must return data through
//! Prometheus' HTTP API, and the node-level panels must show the blind node as its own line; the
//! alerting rules load in Prometheus and pass `promtool test rules`. Also exercises the admin
//! endpoints over HTTP. Run: `cargo test -p revenant --test prometheus_e2e`.

use crate::support;

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use support::alerts::*;
use support::otlp_venv::venv_python;
use support::prometheus::start_prometheus_server;
use support::*;

#[test]
fn alert_rules_pass_promtool() {
    let promtool = system_bin("promtool");
    let dir = workspace_root().join("dashboards");
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

/// Feeds the running revenant with real OTLP exports until told to stop: single rejected
/// requests, failed requests decoded anyway (two rules, one incident: a merged finding) and retry
/// storms (one fingerprint, repeats deduplicated), enough to trip the per-rule rate limit.
fn feeder(
    rv: &Revenant,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<usize> {
    let (grpc, http, dir) = (rv.otlp_grpc.clone(), rv.otlp_http.clone(), rv.dir.clone());
    std::thread::spawn(move || {
        let py = venv_python();
        let mut sent = 0;
        let mut i = 0u32;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let tag = format!("{:04x}", 0x100 + i);
            let scenario = match i % 4 {
                2 => "retry-storm",
                3 => "failed-then-decode",
                _ => "reject-then-decode",
            };
            let transport = ["grpc", "http-protobuf", "http-json"][i as usize % 3];
            let transport = if scenario == "reject-then-decode" {
                transport
            } else {
                "grpc"
            };
            let st = Command::new(&py)
                .arg(workspace_root().join("tests/otlp/emit.py"))
                .args(["--grpc", &grpc, "--http", &http])
                .args([
                    "--transport",
                    transport,
                    "--scenario",
                    scenario,
                    "--tag",
                    &tag,
                    "--count",
                    "3",
                ])
                .stdout(std::process::Stdio::null())
                .stderr(std::fs::File::create(dir.join(format!("emit-{tag}.log"))).unwrap())
                .status()
                .unwrap();
            assert!(
                st.success(),
                "emit.py {scenario} failed: see {}",
                dir.display()
            );
            sent += 1;
            i += 1;
            std::thread::sleep(Duration::from_millis(200));
        }
        sent
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_and_every_dashboard_query_has_data() {
    let prometheus = system_bin("prometheus");
    let tmp = tempfile::tempdir().unwrap();

    // --- revenant itself, alerting to a loopback webhook with a low rate limit (so the scenario
    // exercises the limiter too), fed over OTLP by the Python SDK.
    let receiver = Receiver::new(None, Duration::ZERO);
    let (hook, hook_task) = receiver.serve_any().await;
    let hook_url = format!("http://{hook}/hook");
    let mut rv = tokio::task::block_in_place(|| {
        Revenant::start(
            "prometheus",
            &[
                "--webhook",
                &hook_url,
                "--rate-limit",
                "3",
                "--spool-no-fsync",
            ],
        )
    });
    let admin_addr = rv.admin.clone();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let feed = feeder(&rv, stop.clone());
    // A node that sees nothing: no OTLP listener, eBPF off.
    let mut blind = tokio::task::block_in_place(|| {
        Revenant::start(
            "prometheus-blind",
            &["--otlp-grpc", "off", "--otlp-http", "off"],
        )
    });
    // Cluster mode: an agent publishing a recorded incident, a checker judging it.
    let (nats, mut agent, mut checker, cluster_dir) = tokio::task::block_in_place(|| {
        let nats = Nats::single().unwrap();
        let dir = ScratchDir::new("prometheus-cluster").unwrap();
        let bus = cluster::Bus {
            nats: nats.urls(),
            stream: "DASH".into(),
            partitions: 2,
        };
        let checker = cluster::Member::checker(&bus, &dir.path().join("checker"), &[0, 1], &[]);
        let agent = cluster::Member::agent(
            &bus,
            &dir.path().join("agent"),
            "node-c",
            Some(&workspace_root().join("tests/scenarios/smg-prefill-400-decode-alive.jsonl")),
        );
        (nats, agent, checker, dir)
    });

    // --- admin endpoints over real HTTP.
    let http = revenant::alert::webhook::http_client(Duration::from_secs(10)).unwrap();
    let base = format!("http://{admin_addr}");
    let get = |path: String| {
        let http = http.clone();
        async move { http.get(path).send().await.unwrap() }
    };
    assert_eq!(get(format!("{base}/healthz")).await.status(), 200);
    let ready: serde_json::Value =
        eventually("/readyz: otlp live", Duration::from_secs(30), async || {
            let r = get(format!("{base}/readyz")).await;
            let v: serde_json::Value = r.json().await.unwrap();
            (v["ready"] == true && v["live_sources"] == serde_json::json!(["otlp"])).then_some(v)
        })
        .await;
    assert_eq!(ready["disabled"]["ebpf"], "off (--ebpf off)", "{ready}");
    let violations: serde_json::Value =
        eventually("a violation", Duration::from_secs(30), async || {
            let v: serde_json::Value = get(format!(
                "{base}/api/violations?limit=5&rule=activity-after-rejection"
            ))
            .await
            .json()
            .await
            .unwrap();
            (!v["violations"].as_array().unwrap().is_empty()).then_some(v)
        })
        .await;
    let first = &violations["violations"][0];
    let rid = first["attempt"]["rid"].as_str().unwrap();
    let t: serde_json::Value = get(format!("{base}/api/requests/{rid}"))
        .await
        .json()
        .await
        .unwrap();
    assert_rejected_then_decoded(&t);
    assert_eq!(
        get(format!("{base}/api/requests/never-seen"))
            .await
            .status(),
        404
    );
    let text = get(format!("{base}/metrics")).await.text().await.unwrap();
    assert!(!text.contains(rid), "a request alias leaked into /metrics");

    // --- real Prometheus scraping it, with the alerting rules loaded.
    let rules = workspace_root().join("dashboards/revenant-alerts.yaml");
    let prom_cfg = tmp.path().join("prometheus.yml");
    std::fs::write(
        &prom_cfg,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: revenant\n    static_configs:\n      - targets: ['{admin_addr}', '{}', '{}', '{}']\n",
            rules.display(),
            blind.admin,
            agent.admin,
            checker.admin,
        ),
    )
    .unwrap();
    let (_prom, prom) = start_prometheus_server(
        &prometheus,
        "prometheus",
        tmp.path(),
        &prom_cfg,
        "--storage.tsdb.path",
        &[],
        &http,
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
    // Enough scrapes of every instance for rate() over the window used below.
    eventually(
        "5 successful scrapes of each of the 4 instances",
        Duration::from_secs(60),
        async || {
            let r = query(
                "count_over_time(up{job=\"revenant\"}[1m]) >= 5 and up{job=\"revenant\"} == 1"
                    .into(),
            )
            .await;
            (r["data"]["result"].as_array().unwrap().len() == 4).then_some(())
        },
    )
    .await;
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(workspace_root().join("dashboards/revenant-overview.json"))
            .unwrap(),
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
            .replace("$job", "revenant")
            .replace("$node", ".+");
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
    assert_node_panels_show_the_blind_node(&dash, &query, &admin_addr, &blind.admin).await;
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
    let written = std::fs::read_to_string(workspace_root().join("dashboards/revenant-alerts.yaml"))
        .unwrap()
        .lines()
        .filter(|l| l.trim_start().starts_with("- alert:"))
        .count();
    assert!(written >= 13, "the rules file lost its rules: {written}");
    assert_eq!(n, written, "{rules}");
    assert!(
        !receiver.alerts().is_empty(),
        "the webhook received nothing"
    );
    eprintln!(
        "{} dashboard queries returned data; {} alerts delivered",
        exprs.len(),
        receiver.alerts().len()
    );

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let fed = tokio::task::block_in_place(|| {
        agent.stop();
        checker.stop();
        drop((nats, cluster_dir));
        feed.join().unwrap()
    });
    assert!(rv.stop().success(), "{}", rv.stderr());
    assert!(blind.stop().success(), "{}", blind.stderr());
    eprintln!("{fed} OTLP scenarios fed");
    hook_task.abort();
}

/// The panel of `dash` titled `title` starting so, its first query with the variables set
/// (`$node` to the regex `node`).
fn panel_query(dash: &serde_json::Value, title: &str, node: &str) -> String {
    let p = dash["panels"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["title"].as_str().is_some_and(|t| t.starts_with(title)))
        .unwrap_or_else(|| panic!("no panel titled {title:?}"));
    p["targets"][0]["expr"]
        .as_str()
        .unwrap()
        .replace("$__rate_interval", "30s")
        .replace("$job", "revenant")
        .replace("$node", node)
}

/// `instance` → value of each series of an instant query's result.
fn by_instance(r: &serde_json::Value) -> std::collections::BTreeMap<String, f64> {
    r["data"]["result"]
        .as_array()
        .unwrap_or_else(|| panic!("{r}"))
        .iter()
        .map(|s| {
            (
                s["metric"]["instance"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                s["value"][1].as_str().unwrap().parse().unwrap(),
            )
        })
        .collect()
}

/// A fleet of a healthy node and a blind one: the node-level panels draw each as its own line
/// (where `min`/`max` over the fleet hid it), and the `node` variable selects one node.
async fn assert_node_panels_show_the_blind_node<F, Fut>(
    dash: &serde_json::Value,
    query: &F,
    healthy: &str,
    blind: &str,
) where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = serde_json::Value>,
{
    let node_var = dash["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "node")
        .expect("a node variable");
    let values = node_var["query"]["query"]
        .as_str()
        .unwrap()
        .replace("label_values(", "group by (instance) (")
        .replace(", instance)", ")")
        .replace("$job", "revenant");
    let nodes = by_instance(&query(values).await);
    assert!(
        nodes.contains_key(healthy) && nodes.contains_key(blind),
        "the node variable lists {nodes:?}"
    );
    let ready = by_instance(&query(panel_query(dash, "Ready, per node", ".+")).await);
    assert_eq!(ready.get(healthy), Some(&1.0), "{ready:?}");
    assert_eq!(
        ready.get(blind),
        Some(&0.0),
        "the blind node is not ready: {ready:?}"
    );
    let live = by_instance(&query(panel_query(dash, "Sources live per node", ".+")).await);
    assert_eq!(live.get(blind), Some(&0.0), "{live:?}");
    assert!(live.get(healthy).is_some_and(|n| *n >= 1.0), "{live:?}");
    // Selecting the blind node alone shows it alone.
    // As Grafana writes a selected value into the regex matcher (`\.` in a PromQL string).
    let only_blind = regex::escape(blind).replace('\\', "\\\\");
    let one = by_instance(&query(panel_query(dash, "Ready, per node", &only_blind)).await);
    assert_eq!(one.keys().collect::<Vec<_>>(), vec![blind], "{one:?}");
    let down = by_instance(
        &query(
            panel_query(dash, "Degraded or down components", ".+")
                .replace("revenant_component_degraded", "revenant_component_down"),
        )
        .await,
    );
    assert_eq!(
        down.get(blind),
        Some(&1.0),
        "the blind node is down: {down:?}"
    );
    assert_eq!(down.get(healthy), Some(&0.0), "{down:?}");
    // Each node against its own budget: under 100%, not N times over.
    let share = by_instance(&query(panel_query(dash, "Memory per node", ".+")).await);
    assert!(share.len() >= 2, "{share:?}");
    assert!(share.values().all(|s| *s < 1.0), "{share:?}");
}

/// Every series name and label the alert rules and their promtool cases use exists in the
/// `/metrics` of a real `revenant run` (after a malformed OTLP export and a refusing webhook) or,
/// for cluster mode's rules, of a real `revenant checker`, so renaming a metric or a label breaks
/// this test instead of silently disarming an alert.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alert_rules_use_only_series_and_labels_revenant_exposes() {
    // Port 9 on loopback (discard) is closed: every delivery attempt fails.
    let mut rv = tokio::task::block_in_place(|| {
        Revenant::start(
            "rule-names",
            &["--webhook", "http://127.0.0.1:9/hook", "--spool-no-fsync"],
        )
    });
    let http = revenant::alert::webhook::http_client(Duration::from_secs(10)).unwrap();
    let resp = http
        .post(format!("http://{}/v1/traces", rv.otlp_http))
        .header("content-type", "application/x-protobuf")
        .body(vec![0xff_u8, 0xff, 0xff])
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let text = http
        .get(format!("http://{}/metrics", rv.admin))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    // name -> label names seen on it in the exposition.
    let mut exposed: std::collections::HashMap<String, std::collections::HashSet<String>> =
        Default::default();
    let sample = regex::Regex::new(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s").unwrap();
    let label = regex::Regex::new(r#"([a-zA-Z_][a-zA-Z0-9_]*)=""#).unwrap();
    let mut absorb = |text: &str| {
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            if let Some(c) = sample.captures(line) {
                let labels = exposed.entry(c[1].to_string()).or_default();
                if let Some(ls) = c.get(3) {
                    labels.extend(label.captures_iter(ls.as_str()).map(|l| l[1].to_string()));
                }
            }
        }
    };
    absorb(&text);
    // Cluster mode's rules read what a `revenant checker` exposes besides.
    let checker_text = tokio::task::block_in_place(|| {
        let nats = Nats::single().unwrap();
        let dir = ScratchDir::new("rule-names-checker").unwrap();
        let bus = cluster::Bus {
            nats: nats.urls(),
            stream: "RULES".into(),
            partitions: 1,
        };
        let mut checker = cluster::Member::checker(&bus, dir.path(), &[0], &[]);
        let (status, body) = http_get(&format!("http://{}/metrics", checker.admin)).unwrap();
        assert_eq!(status, 200, "{body}");
        checker.stop();
        body
    });
    absorb(&checker_text);
    // The malformed export moved the counter the refusing-data alert reads.
    assert!(
        text.contains(
            "revenant_otlp_rejected_items_total{transport=\"http\",reason=\"malformed\"} 1"
        ),
        "{text}"
    );
    let root = workspace_root().join("dashboards");
    // A selector `name{labels}` or a bare name, in the rules and in the promtool cases.
    let selector = regex::Regex::new(r"\b(revenant_[a-z0-9_]+)(\{([^}]*)\})?").unwrap();
    let grouping = regex::Regex::new(r"by \(([^)]*)\) \(\w+\((revenant_[a-z0-9_]+)").unwrap();
    let negated = regex::Regex::new(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(!=|=~|!~)").unwrap();
    // Added by Prometheus (target labels) or by the rule itself, never by revenant.
    let external = ["job", "instance"];
    let mut checked = 0;
    for file in ["revenant-alerts.yaml", "revenant-alerts.test.yaml"] {
        let src = std::fs::read_to_string(root.join(file)).unwrap();
        let mut uses: Vec<(String, Vec<String>)> = Vec::new();
        for c in selector.captures_iter(&src) {
            let labels = c
                .get(3)
                .map(|ls| {
                    label
                        .captures_iter(ls.as_str())
                        .map(|l| l[1].to_string())
                        .chain(negated.captures_iter(ls.as_str()).map(|l| l[1].to_string()))
                        .collect()
                })
                .unwrap_or_default();
            uses.push((c[1].to_string(), labels));
        }
        for c in grouping.captures_iter(&src) {
            let labels = c[1].split(',').map(|l| l.trim().to_string()).collect();
            uses.push((c[2].to_string(), labels));
        }
        for (name, labels) in uses {
            let Some(have) = exposed.get(&name) else {
                panic!("{file} uses {name}, which revenant's /metrics does not expose:\n{text}");
            };
            for l in labels.iter().filter(|l| !external.contains(&l.as_str())) {
                assert!(
                    have.contains(l),
                    "{file}: {name} has no label {l:?} in /metrics (it has {have:?})"
                );
            }
            checked += 1;
        }
    }
    assert!(
        checked > 20,
        "only {checked} uses parsed: is the regex stale?"
    );
    assert!(rv.stop().success(), "{}", rv.stderr());
}
