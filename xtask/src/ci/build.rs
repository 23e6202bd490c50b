//! The one build every stage shares: `cargo test --release --no-run` over the whole workspace
//! (all targets), whose artifacts are the test executables, the benches (run once in test mode)
//! and the `revenant` and `pd-sim` binaries the end-to-end tests, the chart and the image use.
//! One profile and one package selection, so cargo resolves features once and compiles every
//! crate once; the binaries that ship are the ones tested.

use std::path::PathBuf;
use std::process::Stdio;

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;

/// `cargo test` arguments of the one build (and of every later cargo call that must find it
/// fresh).
pub const SELECTION: &[&str] = &[
    "--release",
    "--workspace",
    "--exclude",
    "monitor-ebpf",
    "--all-targets",
];

/// A test executable, as cargo would run it.
#[derive(Debug, Clone)]
pub struct TestExe {
    /// `package/target` (`revenant/cli`, `revenant/lib`, `pd-sim/modes`).
    pub name: String,
    pub package: String,
    /// The target's name (`cli`, `revenant`, `modes`).
    pub target: String,
    pub kind: String,
    pub exe: PathBuf,
    /// The package's directory: cargo runs tests there.
    pub manifest_dir: PathBuf,
}

#[derive(Debug, Clone)]
pub struct Built {
    pub revenant: PathBuf,
    pub pd_sim: PathBuf,
    pub tests: Vec<TestExe>,
}

pub fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

pub fn build() -> Result<Built> {
    let out = crate::cargo::command()
        .arg("test")
        .args(SELECTION)
        .args(["--no-run", "--message-format", "json-render-diagnostics"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .output()
        .context("running cargo test --no-run")?;
    if !out.status.success() {
        bail!("the build failed ({})", out.status);
    }
    let (mut revenant, mut pd_sim, mut tests) = (None, None, Vec::new());
    for line in out.stdout.split(|b| *b == b'\n') {
        let Ok(v) = serde_json::from_slice::<Value>(line) else {
            continue;
        };
        if v["reason"] != "compiler-artifact" {
            continue;
        }
        let Some(exe) = v["executable"].as_str().map(PathBuf::from) else {
            continue;
        };
        let target = v["target"]["name"].as_str().unwrap_or_default().to_owned();
        let kind = v["target"]["kind"][0]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        if v["profile"]["test"] != true {
            match (kind.as_str(), target.as_str()) {
                ("bin", "revenant") => revenant = Some(exe),
                ("bin", "pd-sim") => pd_sim = Some(exe),
                _ => {}
            }
            continue;
        }
        let manifest_dir = v["manifest_path"]
            .as_str()
            .map(PathBuf::from)
            .and_then(|p| p.parent().map(PathBuf::from))
            .ok_or_else(|| anyhow!("an artifact without manifest_path: {v}"))?;
        let package = manifest_dir
            .file_name()
            .and_then(|n| n.to_str())
            .map(|d| package_of(&v).unwrap_or(d).to_owned())
            .unwrap_or_default();
        let short = if kind == "lib" {
            "lib".to_owned()
        } else {
            target.clone()
        };
        tests.push(TestExe {
            name: format!("{package}/{short}"),
            package,
            target,
            kind,
            exe,
            manifest_dir,
        });
    }
    tests.sort_by(|a, b| a.name.cmp(&b.name));
    tests.dedup_by(|a, b| a.name == b.name && a.kind == b.kind);
    Ok(Built {
        revenant: revenant.ok_or_else(|| anyhow!("the build made no revenant binary"))?,
        pd_sim: pd_sim.ok_or_else(|| anyhow!("the build made no pd-sim binary"))?,
        tests,
    })
}

/// The package name in a `package_id` (`path+file:///…/monitor#revenant@0.1.0`, or the older
/// `revenant 0.1.0 (path+file:///…)`); `None` when it is the directory's name.
fn package_of(v: &Value) -> Option<&str> {
    let id = v["package_id"].as_str()?;
    match id.rsplit_once('#') {
        // `…/xtask#0.1.0`: the name is the directory's.
        Some((_, tail)) => tail.split_once('@').map(|(name, _)| name),
        None => id.split_whitespace().next(),
    }
}
