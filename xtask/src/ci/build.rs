//! The one build every stage shares: `cargo test --profile ci --no-run` over the whole workspace
//! (all targets), whose artifacts are the test executables, the benches (run once in test mode)
//! and the `revenant` and `pd-sim` binaries the end-to-end tests, the chart and the image use.
//! One profile and one package selection, so cargo resolves features once and compiles every
//! crate once. The `ci` profile is the release profile without ThinLTO across each crate's
//! codegen units (`Cargo.toml` says what that saves and costs): the code that ships, compiled
//! as it ships but for that one pass.

use std::path::PathBuf;
use std::process::Stdio;

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;

/// `cargo test` arguments of the one build (and of every later cargo call that must find it
/// fresh).
pub const SELECTION: &[&str] = &[
    "--profile",
    "ci",
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

/// One artifact of the build, reported as soon as cargo has written it.
#[derive(Debug, Clone)]
pub enum Artifact {
    /// The `revenant` binary.
    Revenant(PathBuf),
    /// The `pd-sim` binary.
    PdSim(PathBuf),
    Test(TestExe),
}

pub fn build() -> Result<Built> {
    build_reporting(false, &[], |_| {})
}

/// The build, `on` called with each executable as it lands, so that the test executables can
/// start while the rest still compiles. `waves`: test targets built before everything else, each
/// wave in a cargo run of its own (the first with the two binaries: it must hold an integration
/// test of `revenant` and one of `pd-sim`) over the same packages and
/// profile, whose artifacts the later runs reuse as they are (cargo resolves the same features
/// for every run: each builds test targets, so each activates the dev-dependencies); cargo's own
/// order would leave them to the end. `nice`: the compilers run below the tests' priority (a
/// test that judges timing keeps the CPU it would have on a quiet machine).
pub fn build_reporting(
    nice: bool,
    waves: &[Vec<&str>],
    mut on: impl FnMut(Artifact),
) -> Result<Built> {
    let (mut revenant, mut pd_sim, mut tests) = (None, None, Vec::new());
    let mut runs: Vec<Vec<String>> = Vec::new();
    for wave in waves {
        // No `--bin`: in `cargo test` it builds a binary's unit tests; cargo builds the binaries
        // themselves for their packages' integration tests (`CARGO_BIN_EXE_*`), and the first
        // wave holds one of each package whose binary the tests run.
        let mut run: Vec<String> = SELECTION
            .iter()
            .filter(|a| **a != "--all-targets")
            .map(|a| a.to_string())
            .collect();
        for t in wave {
            run.extend(["--test".to_owned(), t.to_string()]);
        }
        runs.push(run);
    }
    runs.push(SELECTION.iter().map(|a| a.to_string()).collect());
    for selection in &runs {
        let mut found = |a: Artifact| {
            match &a {
                Artifact::Revenant(p) => revenant = Some(p.clone()),
                Artifact::PdSim(p) => pd_sim = Some(p.clone()),
                Artifact::Test(t) => {
                    // The second run reports again what the first made.
                    if tests
                        .iter()
                        .any(|o: &TestExe| o.name == t.name && o.kind == t.kind)
                    {
                        return;
                    }
                    tests.push(t.clone());
                }
            }
            on(a);
        };
        cargo_test_no_run(selection, nice, &mut found)?;
    }
    tests.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(Built {
        revenant: revenant.ok_or_else(|| anyhow!("the build made no revenant binary"))?,
        pd_sim: pd_sim.ok_or_else(|| anyhow!("the build made no pd-sim binary"))?,
        tests,
    })
}

/// One `cargo test --no-run` over `selection`, each executable it announces handed to `on`.
fn cargo_test_no_run(selection: &[String], nice: bool, on: &mut dyn FnMut(Artifact)) -> Result<()> {
    let mut cmd = crate::cargo::command();
    cmd.arg("test")
        .args(selection)
        .args(["--no-run", "--message-format", "json-render-diagnostics"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if nice {
        use std::os::unix::process::CommandExt as _;
        // SAFETY: nice(2) is async-signal-safe; the child only lowers its own priority (to the
        // lowest: the compilers take only what the tests leave), which
        // cargo and every compiler it starts inherit.
        unsafe {
            cmd.pre_exec(|| {
                libc::nice(19);
                Ok(())
            })
        };
    }
    let mut child = cmd.spawn().context("running cargo test --no-run")?;
    let stdout = child.stdout.take().expect("piped stdout");
    for line in std::io::BufRead::split(std::io::BufReader::new(stdout), b'\n') {
        let line = line.context("reading cargo's messages")?;
        if let Some(artifact) = artifact(&line)? {
            on(artifact);
        }
    }
    let status = child.wait().context("waiting for cargo")?;
    if !status.success() {
        bail!(
            "the build failed ({status}): cargo test {}",
            selection.join(" ")
        );
    }
    Ok(())
}

/// The executable one line of cargo's JSON messages announces, if any.
fn artifact(line: &[u8]) -> Result<Option<Artifact>> {
    let Ok(v) = serde_json::from_slice::<Value>(line) else {
        return Ok(None);
    };
    if v["reason"] != "compiler-artifact" {
        return Ok(None);
    }
    let Some(exe) = v["executable"].as_str().map(PathBuf::from) else {
        return Ok(None);
    };
    let target = v["target"]["name"].as_str().unwrap_or_default().to_owned();
    let kind = v["target"]["kind"][0]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    if v["profile"]["test"] != true {
        return Ok(match (kind.as_str(), target.as_str()) {
            ("bin", "revenant") => Some(Artifact::Revenant(exe)),
            ("bin", "pd-sim") => Some(Artifact::PdSim(exe)),
            _ => None,
        });
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
    Ok(Some(Artifact::Test(TestExe {
        name: format!("{package}/{short}"),
        package,
        target,
        kind,
        exe,
        manifest_dir,
    })))
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
