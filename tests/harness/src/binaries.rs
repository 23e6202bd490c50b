use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Where the binaries are: `REVENANT_BIN` / `PD_SIM_BIN` (set by `cargo xtask test`), or built
/// now with cargo (release: the runs push thousands of requests through them).
#[derive(Debug, Clone)]
pub struct Binaries {
    pub revenant: PathBuf,
    pub pd_sim: PathBuf,
}

impl Binaries {
    /// From the environment, if both variables are set; a set variable naming a missing file is
    /// an error, not a fallback.
    pub fn from_env() -> Result<Option<Binaries>> {
        match (
            std::env::var_os("REVENANT_BIN"),
            std::env::var_os("PD_SIM_BIN"),
        ) {
            (Some(r), Some(p)) => {
                let b = Binaries {
                    revenant: r.into(),
                    pd_sim: p.into(),
                };
                for f in [&b.revenant, &b.pd_sim] {
                    if !f.is_file() {
                        bail!(
                            "{} (from REVENANT_BIN/PD_SIM_BIN) does not exist",
                            f.display()
                        );
                    }
                }
                Ok(Some(b))
            }
            (None, None) => Ok(None),
            _ => bail!("set both REVENANT_BIN and PD_SIM_BIN, or neither"),
        }
    }

    /// `cargo build [--release] -p revenant -p pd-sim --bins`, paths taken from cargo's own
    /// artifact messages (so a custom CARGO_TARGET_DIR is honoured).
    pub fn build(release: bool) -> Result<Binaries> {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(&cargo);
        scrub_cargo_env(&mut cmd);
        cmd.current_dir(workspace_root())
            .args(["build", "-p", "revenant", "-p", "pd-sim", "--bins"])
            .args(["--message-format", "json-render-diagnostics"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if release {
            cmd.arg("--release");
        }
        let out = cmd
            .output()
            .with_context(|| format!("running {cargo} build"))?;
        if !out.status.success() {
            bail!("cargo build -p revenant -p pd-sim failed ({})", out.status);
        }
        let (mut revenant, mut pd_sim) = (None, None);
        for line in out.stdout.split(|b| *b == b'\n') {
            let Ok(v) = serde_json::from_slice::<Value>(line) else {
                continue;
            };
            if v["reason"] != "compiler-artifact" {
                continue;
            }
            let Some(exe) = v["executable"].as_str() else {
                continue;
            };
            match v["target"]["name"].as_str() {
                Some("revenant") => revenant = Some(PathBuf::from(exe)),
                Some("pd-sim") => pd_sim = Some(PathBuf::from(exe)),
                _ => {}
            }
        }
        Ok(Binaries {
            revenant: revenant.ok_or_else(|| anyhow!("cargo built no revenant binary"))?,
            pd_sim: pd_sim.ok_or_else(|| anyhow!("cargo built no pd-sim binary"))?,
        })
    }

    /// The environment's binaries, else a release build.
    pub fn locate() -> Result<Binaries> {
        match Binaries::from_env()? {
            Some(b) => Ok(b),
            None => Binaries::build(true),
        }
    }
}

/// A binary of this workspace next to the running test or bench executable
/// (`target/{profile}/deps/x-hash` → `target/{profile}/NAME`), or the path in `env_var`.
/// Cargo only hands `CARGO_BIN_EXE_*` to tests of the binary's own package, so end-to-end tests
/// elsewhere find it this way; a missing binary is an error that says how to build it.
pub fn workspace_bin(name: &str, env_var: &str) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(env_var) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            bail!("{env_var}={} does not exist", p.display())
        };
    }
    let exe = std::env::current_exe()?;
    let mut dir = exe.parent();
    while let Some(d) = dir {
        let candidate = d.join(name);
        if candidate.is_file() && d.file_name().is_some_and(|n| n != "deps") {
            return Ok(candidate);
        }
        if d.file_name().is_some_and(|n| n == "target") {
            break;
        }
        dir = d.parent();
    }
    bail!(
        "no `{name}` binary next to {} — build it (`cargo build -p {name}` with the same profile) or set {env_var}",
        exe.display()
    )
}

/// Removes from a cargo command the variables cargo sets for the running test or `cargo run`
/// (`CARGO_PKG_*`, `CARGO_MANIFEST_*`, …): build scripts that watch them (ring's) would see a
/// changed environment and rebuild their crate and everything above it.
fn scrub_cargo_env(cmd: &mut Command) {
    for (key, _) in std::env::vars_os() {
        let Some(key) = key.to_str() else { continue };
        if matches!(
            key,
            "CARGO_CRATE_NAME" | "CARGO_BIN_NAME" | "CARGO_PRIMARY_PACKAGE"
        ) || key.starts_with("CARGO_PKG_")
            || key.starts_with("CARGO_MANIFEST_")
        {
            cmd.env_remove(key);
        }
    }
}

/// The `pd-sim` binary for tests of other packages (cargo hands `CARGO_BIN_EXE_pd-sim` only to
/// pd-sim's own): `PD_SIM_BIN` if set, else built now, once per test executable, with the cargo
/// that runs the test, into the target directory and profile that executable lives in.
pub fn pd_sim_bin() -> Result<PathBuf> {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    if let Some(p) = BIN.get() {
        return Ok(p.clone());
    }
    let bin = build_pd_sim()?;
    Ok(BIN.get_or_init(|| bin).clone())
}

fn build_pd_sim() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("PD_SIM_BIN") {
        let p = PathBuf::from(p);
        if !p.exists() {
            bail!("PD_SIM_BIN={} does not exist", p.display());
        }
        return Ok(p);
    }
    let profile = BuildProfile::of(&std::env::current_exe()?)?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(&cargo);
    scrub_cargo_env(&mut cmd);
    cmd.args(["build", "-p", "pd-sim", "--bin", "pd-sim", "--profile"])
        .arg(&profile.name)
        .arg("--target-dir")
        .arg(&profile.target_dir)
        .current_dir(workspace_root());
    let status = cmd
        .status()
        .with_context(|| format!("cannot run {cargo} to build pd-sim"))?;
    if !status.success() {
        bail!("`cargo build -p pd-sim` failed: {status}");
    }
    let bin = profile.target_dir.join(&profile.dir).join("pd-sim");
    if !bin.exists() {
        bail!("pd-sim not found at {} after building it", bin.display());
    }
    Ok(bin)
}

/// The cargo profile a test executable was built in, read from where it lies
/// (`<target dir>/<profile's directory>/deps/<executable>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildProfile {
    pub target_dir: PathBuf,
    /// The profile's directory in the target directory: `debug` for `dev`, else its name.
    pub dir: String,
    /// The profile's name, for `cargo --profile`.
    pub name: String,
}

impl BuildProfile {
    pub fn of(exe: &Path) -> Result<BuildProfile> {
        let mut up = exe.ancestors().skip(1);
        let (Some(deps), Some(profile_dir), Some(target_dir)) = (up.next(), up.next(), up.next())
        else {
            bail!("{} is not in <target>/<profile>/deps", exe.display());
        };
        if deps.file_name().is_none_or(|n| n != "deps") {
            bail!("{} is not in <target>/<profile>/deps", exe.display());
        }
        let dir = profile_dir
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| anyhow!("no profile directory above {}", exe.display()))?
            .to_owned();
        let name = if dir == "debug" {
            "dev".into()
        } else {
            dir.clone()
        };
        Ok(BuildProfile {
            target_dir: target_dir.to_path_buf(),
            dir,
            name,
        })
    }
}

/// The system programs the end-to-end tests run, with the Debian package of each: `cargo xtask
/// setup` installs what is missing; the tests install nothing themselves.
pub const SYSTEM_TOOLS: &[(&str, &str)] = &[
    ("prometheus", "prometheus"),
    ("promtool", "prometheus"),
    ("prometheus-alertmanager", "prometheus-alertmanager"),
    ("amtool", "prometheus-alertmanager"),
    ("nats-server", "nats-server"),
    // TLS tests: a throwaway PKI, and a client that shows the handshake.
    ("openssl", "openssl"),
    ("curl", "curl"),
    // The pages for people (`/requests/{alias}`, `/incidents`, `check --report`), loaded headless.
    ("chromium", "chromium"),
];

/// Where `binary` is on PATH, if it is.
pub fn on_path(binary: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(binary))
        .find(|p| p.is_file())
}

/// A system program a test needs (one of [`SYSTEM_TOOLS`]), from PATH. Panics, naming `cargo
/// xtask setup`, when it is not there.
#[track_caller]
pub fn system_bin(binary: &str) -> PathBuf {
    on_path(binary).unwrap_or_else(|| {
        let package = SYSTEM_TOOLS
            .iter()
            .find(|(b, _)| *b == binary)
            .map_or("?", |(_, p)| p);
        panic!(
            "`{binary}` is not on PATH: run `cargo xtask setup` (it installs the Debian package \
             {package}); the tests do not install packages"
        )
    })
}

/// A real router binary (or interpreter) the caller names by environment variable (`PD_SIM_SMG`
/// for sglang-router 0.3.2, `PD_SIM_SMG113` for smg 1.13.0, `PD_SIM_VLLM_ROUTER` /
/// `PD_SIM_VLLM_ROUTER_PYTHON` for vllm-router 0.1.17; `cargo xtask test` creates their venvs and
/// sets them all). Panics with what to set when it is missing: the tests that call this are the
/// ones that must run against the real wheel.
pub fn router_from_env(var: &str, what: &str) -> std::path::PathBuf {
    let p = std::env::var_os(var).unwrap_or_else(|| {
        panic!(
            "{var} is not set: point it at {what} in its venv \
             (`cargo xtask test` creates the venv under target/ and sets it)"
        )
    });
    let p = std::path::PathBuf::from(p);
    assert!(p.is_file(), "{var}={} does not exist", p.display());
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_build_profile_is_read_from_where_the_executable_lies() {
        let p = BuildProfile::of(Path::new("/w/target/ci/deps/suite-0123")).unwrap();
        assert_eq!(p.target_dir, Path::new("/w/target"));
        assert_eq!((p.dir.as_str(), p.name.as_str()), ("ci", "ci"));
        let p = BuildProfile::of(Path::new("/w/target/debug/deps/suite-0123")).unwrap();
        assert_eq!(
            (p.dir.as_str(), p.name.as_str()),
            ("debug", "dev"),
            "dev builds live in debug/"
        );
        let err = BuildProfile::of(Path::new("/w/target/ci/revenant")).unwrap_err();
        assert!(
            err.to_string().contains("not in <target>/<profile>/deps"),
            "{err}"
        );
    }
}
