//! The configuration examples in docs/monitoring.md are valid for the real tools: the
//! Prometheus block passes `promtool check config` (with the shipped rules file in place of the
//! path it names), the Alertmanager block `amtool check-config`, and the Grafana provisioning
//! block is YAML with the keys Grafana reads. Both tools come from `cargo xtask setup`; the test
//! fails when they are missing.

use crate::support;

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The fenced block whose info string is ```` ```yaml <tag> ````.
fn block(doc: &str, tag: &str) -> String {
    let fence = format!("```yaml {tag}\n");
    let start = doc
        .find(&fence)
        .unwrap_or_else(|| panic!("docs/monitoring.md has no ```yaml {tag} block"))
        + fence.len();
    let len = doc[start..].find("```").expect("the block is closed");
    doc[start..start + len].to_string()
}

fn doc() -> String {
    std::fs::read_to_string(root().join("docs/monitoring.md")).expect("docs/monitoring.md")
}

fn check(tool: &str, args: &[&str], file: &Path) {
    let bin = support::system_bin(tool);
    let out = Command::new(&bin)
        .args(args)
        .arg(file)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", bin.display()));
    assert!(
        out.status.success(),
        "{tool} {args:?} rejects the example in docs/monitoring.md:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_prometheus_example_passes_promtool_with_the_shipped_rules() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("revenant-alerts.yaml");
    std::fs::copy(root().join("dashboards/revenant-alerts.yaml"), &rules).unwrap();
    let example = block(&doc(), "prometheus");
    assert!(
        example.contains("job_name: revenant"),
        "the shipped rules select job=\"revenant\": the example must scrape that job"
    );
    let config = example.replace(
        "/etc/prometheus/revenant-alerts.yaml",
        rules.to_str().unwrap(),
    );
    let path = dir.path().join("prometheus.yml");
    std::fs::write(&path, config).unwrap();
    // promtool also checks the rule files the config names.
    check("promtool", &["check", "config"], &path);
}

#[test]
fn the_alertmanager_example_passes_amtool() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("alertmanager.yml");
    let example = block(&doc(), "alertmanager");
    assert!(
        example.contains("'alertname', 'incident'"),
        "the violation route groups by incident (one notification per client request)"
    );
    std::fs::write(&path, example).unwrap();
    check("amtool", &["check-config"], &path);
}

#[test]
fn the_grafana_provisioning_example_names_a_file_provider() {
    let example: serde_json::Value = serde_saphyr::from_str(&block(&doc(), "grafana")).unwrap();
    assert_eq!(example["apiVersion"], 1);
    let provider = &example["providers"][0];
    assert_eq!(provider["type"], "file");
    assert!(provider["options"]["path"].as_str().is_some());
    // The dashboard it points at declares the variables the page describes.
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("dashboards/revenant-overview.json")).unwrap(),
    )
    .unwrap();
    let vars: Vec<&str> = dashboard["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert_eq!(vars, ["datasource", "job", "node", "admin_url"]);
}

/// Every rules file the docs show (a ```` ```yaml ```` block that starts with `rules:`, in
/// README.md and docs/) loads on top of the embedded defaults, as `--rules FILE` loads it.
#[test]
fn every_rules_example_in_the_docs_loads() {
    let mut files = vec![root().join("README.md")];
    for entry in std::fs::read_dir(root().join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            files.push(path);
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let mut checked = 0;
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for (i, block) in text.split("```yaml\n").skip(1).enumerate() {
            let body = &block[..block.find("```").expect("the block is closed")];
            if !body.starts_with("rules:") {
                continue;
            }
            let path = dir.path().join(format!("rules-{checked}.yaml"));
            std::fs::write(&path, body).unwrap();
            let out = Command::new(env!("CARGO_BIN_EXE_revenant"))
                .args(["rules", "list", "--rules"])
                .arg(&path)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{} yaml block {i} does not load: {}\n{body}",
                file.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            checked += 1;
        }
    }
    assert!(checked >= 3, "only {checked} rules examples found");
}
