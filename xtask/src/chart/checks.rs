//! What a rendered chart must hold, read from the manifests: valid for the oldest and newest
//! Kubernetes, checkov's findings exactly the accepted ones, least privilege per mode, the
//! PrometheusRule, cluster mode's checkers alike (partitions shared through leases), and values it cannot honour refused.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, anyhow, bail, ensure};
use serde_json::Value;

use super::tools::{Tools, helm_template, render, run_quiet, to_json};
use super::{CASES, EBPF_CAPABILITIES};

/// The chart ships copies of dashboards/ (helm reads only files inside the chart).
pub(super) fn copies_match(root: &Path) -> Result<()> {
    for f in ["revenant-alerts.yaml", "revenant-overview.json"] {
        let source = root.join("dashboards").join(f);
        let copy = root.join("deploy/helm/revenant/files").join(f);
        ensure!(
            std::fs::read(&source)? == std::fs::read(&copy)?,
            "{} differs from {}: cp {} {}",
            copy.display(),
            source.display(),
            source.display(),
            copy.display()
        );
    }
    Ok(())
}

/// `(case, check)` pairs of checkov-accepted.txt; every line needs a reason.
pub(super) fn accepted_findings(path: &Path) -> Result<BTreeSet<(String, String)>> {
    let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    let mut set = BTreeSet::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut f = line.split_whitespace();
        let (Some(case), Some(check), Some(_reason)) = (f.next(), f.next(), f.next()) else {
            bail!(
                "{}:{}: want `CASE CHECK REASON…`, got {line:?}",
                path.display(),
                n + 1
            );
        };
        ensure!(
            CASES.iter().any(|c| c.0 == case),
            "{}:{}: unknown case {case:?}",
            path.display(),
            n + 1
        );
        set.insert((case.to_string(), check.to_string()));
    }
    Ok(set)
}

/// Every manifest valid for Kubernetes `k`; only the Prometheus Operator's kinds (CRDs) may lack
/// a schema.
pub(super) fn validate(tools: &Tools, file: &Path, k: &str) -> Result<()> {
    let out = Command::new(&tools.kubernetes_validate)
        .args(["--strict", "-k", k])
        .arg(file)
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        out.status.success(),
        "kubernetes-validate --strict -k {k}:\n{text}"
    );
    let passed = text.lines().filter(|l| l.contains(" passed for ")).count();
    ensure!(passed > 0, "kubernetes-validate validated nothing:\n{text}");
    for line in text.lines().filter(|l| l.contains("Couldn't find schema")) {
        ensure!(
            line.contains("api version monitoring.coreos.com/v1"),
            "kubernetes-validate has no schema for a core kind: {line}"
        );
    }
    Ok(())
}

/// checkov's failed checks on `file` must be exactly the accepted ones for `case`.
pub(super) fn checkov(
    tools: &Tools,
    file: &Path,
    case: &str,
    accepted: &BTreeSet<(String, String)>,
) -> Result<()> {
    let out = Command::new(&tools.checkov)
        .args([
            "--framework",
            "kubernetes",
            "--skip-download",
            "-o",
            "json",
            "-f",
        ])
        .arg(file)
        .stderr(Stdio::null())
        .output()?;
    let report: Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("checkov printed no JSON report ({})", out.status))?;
    let results = &report["results"];
    let passed = results["passed_checks"].as_array().map_or(0, Vec::len);
    ensure!(passed > 0, "checkov ran no check on {}", file.display());
    let failed: BTreeSet<(String, String)> = results["failed_checks"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            (
                c["check_id"].as_str().unwrap_or("?").to_string(),
                c["resource"].as_str().unwrap_or("?").to_string(),
            )
        })
        .collect();
    let found: BTreeSet<&str> = failed.iter().map(|(c, _)| c.as_str()).collect();
    let unexplained: Vec<String> = failed
        .iter()
        .filter(|(c, _)| !accepted.contains(&(case.to_string(), c.clone())))
        .map(|(c, r)| format!("{c} on {r}"))
        .collect();
    ensure!(
        unexplained.is_empty(),
        "checkov ({case}): failed checks not in deploy/helm/checkov-accepted.txt: {}",
        unexplained.join(", ")
    );
    let stale: Vec<&str> = accepted
        .iter()
        .filter(|(c, _)| c == case)
        .map(|(_, check)| check.as_str())
        .filter(|check| !found.contains(check))
        .collect();
    ensure!(
        stale.is_empty(),
        "checkov ({case}): accepted findings no longer found, remove them from \
         deploy/helm/checkov-accepted.txt: {}",
        stale.join(", ")
    );
    Ok(())
}

pub(super) fn kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

pub(super) fn one<'a>(docs: &'a [Value], k: &str) -> Result<&'a Value> {
    match kind(docs, k).as_slice() {
        [d] => Ok(d),
        other => bail!("expected one {k}, rendered {}", other.len()),
    }
}

pub(super) fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect()
}

pub(super) fn component<'a>(docs: &'a [Value], k: &str, component: &str) -> Result<&'a Value> {
    match kind(docs, k)
        .into_iter()
        .filter(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] == component)
        .collect::<Vec<_>>()
        .as_slice()
    {
        [d] => Ok(d),
        other => bail!("expected one {component} {k}, rendered {}", other.len()),
    }
}

/// The value of `--flag=VALUE` among `args`.
pub(super) fn flag<'a>(args: &[&'a str], name: &str) -> Option<&'a str> {
    args.iter()
        .find_map(|a| a.strip_prefix(name).and_then(|r| r.strip_prefix('=')))
}

/// What the pod must hold: least privilege for its mode, node name from the downward API,
/// probes on /healthz and /readyz, a spool that outlives the pod.
pub(super) fn pod_spec_holds(docs: &[Value], case: &str, ebpf: bool) -> Result<()> {
    let ds = one(docs, "DaemonSet")?;
    let pod = &ds["spec"]["template"]["spec"];
    let c = pod["containers"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == "revenant"))
        .ok_or_else(|| anyhow!("{case}: no revenant container"))?;
    let sc = &c["securityContext"];
    ensure!(sc["privileged"] == false, "{case}: privileged");
    ensure!(
        sc["allowPrivilegeEscalation"] == false,
        "{case}: privilege escalation allowed"
    );
    ensure!(
        sc["readOnlyRootFilesystem"] == true,
        "{case}: writable root filesystem"
    );
    ensure!(
        strings(&sc["capabilities"]["drop"]) == ["ALL"],
        "{case}: capabilities not dropped"
    );
    ensure!(
        pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault",
        "{case}: seccomp is not RuntimeDefault"
    );
    let added = strings(&sc["capabilities"]["add"]);
    let args = strings(&c["args"]);
    let mounts: Vec<&str> = c["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["mountPath"].as_str())
        .collect();
    if ebpf {
        ensure!(added == EBPF_CAPABILITIES, "{case}: capabilities {added:?}");
        ensure!(pod["hostPID"] == true, "{case}: eBPF without hostPID");
        ensure!(args.contains(&"--ebpf=on"), "{case}: {args:?}");
        ensure!(
            mounts.contains(&"/sys/kernel/tracing"),
            "{case}: no tracefs"
        );
    } else {
        ensure!(
            added.is_empty(),
            "{case}: capabilities {added:?} without eBPF"
        );
        ensure!(pod["hostPID"].is_null(), "{case}: hostPID without eBPF");
        ensure!(
            pod["securityContext"]["runAsNonRoot"] == true,
            "{case}: runs as root"
        );
        ensure!(args.contains(&"--ebpf=off"), "{case}: {args:?}");
        ensure!(
            !mounts.contains(&"/sys/kernel/tracing"),
            "{case}: tracefs without eBPF"
        );
    }
    let command = if is_cluster(docs) { "agent" } else { "run" };
    ensure!(args.first() == Some(&command), "{case}: command {args:?}");
    ensure!(args.contains(&"--node=$(NODE_NAME)"), "{case}: no --node");
    let env = c["env"].as_array().cloned().unwrap_or_default();
    ensure!(
        env.iter().any(|e| e["name"] == "NODE_NAME"
            && e["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"),
        "{case}: NODE_NAME is not the downward API's spec.nodeName"
    );
    for (probe, path) in [
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
        ("startupProbe", "/healthz"),
    ] {
        ensure!(
            c[probe]["httpGet"]["path"] == path,
            "{case}: {probe} not on {path}"
        );
    }
    ensure!(
        !c["resources"]["limits"]["memory"].is_null(),
        "{case}: no memory limit"
    );
    let spool = pod["volumes"]
        .as_array()
        .and_then(|v| v.iter().find(|v| v["name"] == "spool"))
        .ok_or_else(|| anyhow!("{case}: no spool volume"))?;
    ensure!(
        spool["hostPath"]["path"]
            .as_str()
            .is_some_and(|p| p.starts_with("/var/lib/revenant/")),
        "{case}: the spool is not on the node: {spool}"
    );
    let svc = kind(docs, "Service")
        .into_iter()
        .find(|s| s["metadata"]["name"] == "revenant-otlp")
        .ok_or_else(|| anyhow!("{case}: no OTLP Service"))?;
    ensure!(
        svc["spec"]["internalTrafficPolicy"] == "Local",
        "{case}: OTLP Service not node-local"
    );
    Ok(())
}

/// The PrometheusRule's spec passes `promtool check rules` and selects the scrape job; the
/// Grafana ConfigMap holds the dashboard as it is in dashboards/.
pub(super) fn rules_check(tools: &Tools, docs: &[Value], out: &Path, case: &str) -> Result<()> {
    let rules = kind(docs, "PrometheusRule");
    let Some(rule) = rules.first() else {
        ensure!(case == "default", "{case}: no PrometheusRule rendered");
        return Ok(());
    };
    let file = out.join(format!("{case}-rules.json"));
    std::fs::write(&file, serde_json::to_vec(&rule["spec"])?)?;
    run_quiet(
        Command::new(&tools.promtool)
            .args(["check", "rules"])
            .arg(&file),
        &format!("promtool check rules ({case})"),
    )?;
    let dash = kind(docs, "ConfigMap")
        .into_iter()
        .find(|c| c["metadata"]["labels"]["grafana_dashboard"] == "1")
        .ok_or_else(|| anyhow!("{case}: no dashboard ConfigMap with the sidecar label"))?;
    let json: Value = serde_json::from_str(
        dash["data"]["revenant-overview.json"]
            .as_str()
            .ok_or_else(|| anyhow!("{case}: no dashboard in the ConfigMap"))?,
    )?;
    ensure!(
        json["uid"] == "revenant-overview",
        "{case}: dashboard {}",
        json["uid"]
    );
    Ok(())
}

/// The pod's probes use the port that answers them unauthenticated: `metrics` when the run
/// announced a metrics address, else `admin`.
pub(super) fn probes_use(container: &Value, ops: &str, admin: &str, case: &str) -> Result<()> {
    let want = if ops == admin { "admin" } else { "metrics" };
    for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
        let port = &container[probe]["httpGet"]["port"];
        ensure!(
            port == want,
            "{case}: {probe} uses port {port}, but /healthz and /readyz are on `{want}`"
        );
    }
    Ok(())
}

/// Cluster mode renders the checker StatefulSet.
pub(super) fn is_cluster(docs: &[Value]) -> bool {
    kind(docs, "StatefulSet")
        .iter()
        .any(|s| s["metadata"]["labels"]["app.kubernetes.io/component"] == "checker")
}

/// The checkers' one `--config` file (every replica reads it) and the replica count.
pub(super) fn checker_file(docs: &[Value]) -> Result<(String, u64)> {
    let sts = component(docs, "StatefulSet", "checker")?;
    let replicas = sts["spec"]["replicas"]
        .as_u64()
        .ok_or_else(|| anyhow!("the checker StatefulSet names no replica count"))?;
    let cm = component(docs, "ConfigMap", "checker")?;
    let data = cm["data"].as_object().cloned().unwrap_or_default();
    ensure!(
        data.len() == 1,
        "the checker ConfigMap holds {} files, not one for every replica",
        data.len()
    );
    let body = data
        .get("checker.yaml")
        .and_then(Value::as_str)
        .ok_or_else(|| anyhow!("no checker.yaml in the checker ConfigMap"))?;
    Ok((body.to_string(), replicas))
}

/// Cluster mode: agent and checkers agree on the bus, every partition is owned by exactly one
/// checker replica, the checker runs with no privilege and is probed and scraped, and the
/// chart's NATS (when rendered) is a clustered JetStream with a claim per server.
pub(super) fn cluster_holds(tools: &Tools, docs: &[Value], case: &str) -> Result<()> {
    let agent = &one(docs, "DaemonSet")?["spec"]["template"]["spec"]["containers"][0];
    let agent_args = strings(&agent["args"]);
    let sts = component(docs, "StatefulSet", "checker")?;
    let pod = &sts["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let args = strings(&c["args"]);
    ensure!(
        args.first() == Some(&"checker"),
        "{case}: checker command {args:?}"
    );
    for f in [
        "--nats",
        "--stream",
        "--partitions",
        "--replicas",
        "--retention",
    ] {
        ensure!(
            flag(&args, f).is_some() && flag(&args, f) == flag(&agent_args, f),
            "{case}: agent and checker differ on {f}: {:?} / {:?}",
            flag(&agent_args, f),
            flag(&args, f)
        );
    }
    let partitions: u64 = flag(&args, "--partitions")
        .unwrap_or_default()
        .parse()
        .context("--partitions")?;
    ensure!(partitions >= 1, "{case}: --partitions {partitions}");
    // No replica is pinned: the partitions are shared through leases, so the pods are alike
    // and the StatefulSet scales with its replica count alone.
    let (body, _) = checker_file(docs)?;
    let cfg = to_json(tools, &body)?;
    ensure!(
        cfg.first().is_none_or(|c| c["bus"]["owned"].is_null()),
        "{case}: the checkers' file pins partitions: {body}"
    );
    ensure!(
        args.contains(&"--config=/etc/revenant/checker/checker.yaml"),
        "{case}: the checkers do not read the one shared file: {args:?}"
    );
    ensure!(
        flag(&args, "--lease-ttl").is_some(),
        "{case}: the checker has no --lease-ttl: {args:?}"
    );
    let pdb = component(docs, "PodDisruptionBudget", "checker")?;
    ensure!(
        pdb["spec"]["maxUnavailable"] == 1,
        "{case}: the checkers' PodDisruptionBudget allows {} away",
        pdb["spec"]["maxUnavailable"]
    );
    let env = c["env"].as_array().cloned().unwrap_or_default();
    ensure!(
        env.iter().any(|e| e["name"] == "POD_NAME"
            && e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"),
        "{case}: POD_NAME is not the downward API's metadata.name"
    );
    let sc = &c["securityContext"];
    ensure!(
        sc["privileged"] == false
            && sc["allowPrivilegeEscalation"] == false
            && sc["readOnlyRootFilesystem"] == true
            && strings(&sc["capabilities"]["drop"]) == ["ALL"]
            && sc["capabilities"]["add"].is_null(),
        "{case}: checker security context {sc}"
    );
    ensure!(
        pod["securityContext"]["runAsNonRoot"] == true && pod["hostPID"].is_null(),
        "{case}: the checker runs as root or in the host's PID namespace"
    );
    for (probe, path) in [
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
        ("startupProbe", "/healthz"),
    ] {
        ensure!(
            c[probe]["httpGet"]["path"] == path,
            "{case}: checker {probe} not on {path}"
        );
    }
    ensure!(
        sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "spool",
        "{case}: the checker's spool has no claim"
    );
    let svc = component(docs, "Service", "checker")?;
    ensure!(
        svc["spec"]["clusterIP"] == "None"
            && svc["metadata"]["labels"]["revenant.io/service"] == "admin"
            && sts["spec"]["serviceName"] == svc["metadata"]["name"],
        "{case}: the checker's Service is not the StatefulSet's headless admin Service"
    );
    if let Some(sm) = kind(docs, "ServiceMonitor").first() {
        let sel = &sm["spec"]["selector"]["matchLabels"];
        let labels = &svc["metadata"]["labels"];
        for (k, v) in sel.as_object().into_iter().flatten() {
            ensure!(
                &labels[k] == v,
                "{case}: the ServiceMonitor does not select the checkers"
            );
        }
    }
    let nats: Vec<&Value> = kind(docs, "StatefulSet")
        .into_iter()
        .filter(|s| s["metadata"]["labels"]["app.kubernetes.io/component"] == "nats")
        .collect();
    let urls = flag(&args, "--nats").unwrap_or_default();
    if let [nats] = nats.as_slice() {
        let n = nats["spec"]["replicas"].as_u64().unwrap_or(0);
        let nargs = strings(&nats["spec"]["template"]["spec"]["containers"][0]["args"]);
        ensure!(
            nargs.contains(&"--jetstream"),
            "{case}: NATS without JetStream"
        );
        ensure!(
            urls.split(',').count() as u64 == n,
            "{case}: --nats {urls} for {n} servers"
        );
        if n > 1 {
            let routes = flag(&nargs, "--routes").unwrap_or_default();
            ensure!(
                routes.split(',').count() as u64 == n && flag(&nargs, "--cluster_name").is_some(),
                "{case}: NATS servers not clustered: {nargs:?}"
            );
        }
        let headless = component(docs, "Service", "nats")?;
        ensure!(
            headless["spec"]["clusterIP"] == "None"
                && nats["spec"]["serviceName"] == headless["metadata"]["name"],
            "{case}: NATS has no headless Service"
        );
        ensure!(
            nats["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data",
            "{case}: NATS has no claim for its store"
        );
    } else {
        ensure!(nats.is_empty(), "{case}: {} NATS StatefulSets", nats.len());
        ensure!(!urls.is_empty(), "{case}: no --nats");
    }
    Ok(())
}

/// serviceMonitor.jobLabel reaches the rules' selectors and the ServiceMonitor's relabelling.
pub(super) fn job_label_is_templated(tools: &Tools, chart: &Path) -> Result<()> {
    let yaml = render(
        tools,
        chart,
        &[],
        &[
            "serviceMonitor.enabled=true",
            "prometheusRule.enabled=true",
            "serviceMonitor.jobLabel=serving-revenant",
        ],
    )?;
    let docs = to_json(tools, &yaml)?;
    let rules = serde_json::to_string(&one(&docs, "PrometheusRule")?["spec"])?;
    ensure!(
        !rules.contains(r#"job=\"revenant\""#) && rules.contains(r#"job=\"serving-revenant\""#),
        "the PrometheusRule does not select serviceMonitor.jobLabel"
    );
    let sm = one(&docs, "ServiceMonitor")?;
    ensure!(
        sm["spec"]["endpoints"][0]["relabelings"][0]["replacement"] == "serving-revenant",
        "the ServiceMonitor does not set job to serviceMonitor.jobLabel"
    );
    Ok(())
}

/// Values the chart cannot honour fail `helm template` with a message saying what to change.
pub(super) fn bad_values_are_refused(tools: &Tools, chart: &Path) -> Result<()> {
    for (set, says) in [
        ("ebpf.mode=maybe", "ebpf.mode must be on, off or auto"),
        ("spool.type=nfs", "spool.type must be hostPath"),
        (
            "spool.type=persistentVolumeClaim",
            "needs spool.existingClaim",
        ),
        ("alerts.webhooks[0].secret=k", "every webhook needs a url"),
        (
            "config.alert.jsonl.path=x",
            "config.alert is set by the chart",
        ),
        ("mode=agents", "mode must be all-in-one or cluster"),
        (
            "mode=cluster,checker.replicas=0",
            "checker.replicas must be at least 1",
        ),
        (
            "mode=cluster,bus.partitions=0",
            "bus.partitions must be 1..1024",
        ),
        (
            "mode=cluster,config.bus.owned[0]=1",
            "config.bus.owned pins checkers to partitions",
        ),
        (
            "mode=cluster,nats.replicas=2",
            "nats.replicas must be 1, 3 or 5",
        ),
        (
            "mode=cluster,nats.replicas=1,bus.streamReplicas=3",
            "bus.streamReplicas (3) exceeds nats.replicas (1)",
        ),
    ] {
        let out = helm_template(tools, chart, &[], &[set])?;
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(
            !out.status.success() && err.contains(says),
            "--set {set}: expected a refusal saying {says:?}, got {} {err}",
            out.status
        );
    }
    Ok(())
}
