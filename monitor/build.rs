//! Builds the kernel programs (`monitor-ebpf`) for the BPF target and leaves the object in
//! `OUT_DIR/monitor-ebpf`, where `ingest::ebpf::loader` embeds it; and records what the build was
//! made from (`telemetry::build`): the git commit and its date, the build date, the compiler and
//! the SHA-256 of the embedded object.
//!
//! With the `ebpf` feature (the default) it needs what `cargo xtask setup` installs: the nightly
//! toolchain with rust-src and `bpf-linker`. Without it (`--no-default-features --features
//! runtime`, for `revenant check` and CI pipelines) the object is empty, nothing BPF is built,
//! and `revenant run` says the build has no eBPF source.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context as _;

fn main() -> anyhow::Result<()> {
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").context("OUT_DIR not set")?);
    let object = out_dir.join("monitor-ebpf");
    build_object(&object)?;
    let bytes = std::fs::read(&object).with_context(|| format!("reading {}", object.display()))?;
    let sha = if bytes.is_empty() {
        String::new()
    } else {
        use sha2::Digest as _;
        sha2::Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    };
    println!("cargo:rustc-env=REVENANT_EBPF_SHA256={sha}");
    build_info();
    Ok(())
}

#[cfg(feature = "ebpf")]
fn build_object(object: &Path) -> anyhow::Result<()> {
    use anyhow::anyhow;
    let cargo_metadata::Metadata { packages, .. } = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .context("cargo metadata")?;
    let pkg = packages
        .into_iter()
        .find(|p| p.name.as_str() == "monitor-ebpf")
        .ok_or_else(|| anyhow!("monitor-ebpf package not found in the workspace"))?;
    let root_dir = pkg
        .manifest_path
        .parent()
        .ok_or_else(|| anyhow!("no parent for {}", pkg.manifest_path))?;
    if which("bpf-linker").is_none() {
        return Err(anyhow!(
            "bpf-linker not found on PATH: run `cargo xtask setup` first (it installs LLVM 22, \
             bpf-linker and nightly rust-src), or build without the eBPF source: \
             `cargo build -p revenant --no-default-features --features runtime` (enough for \
             `revenant check`)"
        ));
    }
    let ebpf = aya_build::Package {
        name: "monitor-ebpf",
        root_dir: root_dir.as_str(),
        ..Default::default()
    };
    aya_build::build_ebpf([ebpf], aya_build::Toolchain::default())?;
    // AYA_BUILD_SKIP=1 builds nothing: the loader still needs a file to embed.
    if !object.exists() {
        std::fs::write(object, b"")?;
    }
    Ok(())
}

/// Without the `ebpf` feature: an empty object, so the loader compiles and this build is known
/// to have no kernel programs.
#[cfg(not(feature = "ebpf"))]
fn build_object(object: &Path) -> anyhow::Result<()> {
    std::fs::write(object, b"").with_context(|| format!("writing {}", object.display()))
}

#[cfg(feature = "ebpf")]
fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

/// Output of `cmd`, trimmed, when it ran and succeeded.
fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        .filter(|s| !s.is_empty())
}

/// `REVENANT_GIT_COMMIT`, `REVENANT_GIT_COMMIT_DATE`, `REVENANT_BUILD_DATE`, `REVENANT_RUSTC`.
/// The commit comes from git when the sources are a checkout (or from `REVENANT_GIT_COMMIT` in
/// the environment, for builds from an archive); the build date from `SOURCE_DATE_EPOCH` when set
/// (reproducible builds), else the time this script ran.
fn build_info() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    for var in [
        "REVENANT_GIT_COMMIT",
        "REVENANT_GIT_COMMIT_DATE",
        "SOURCE_DATE_EPOCH",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let git = |args: &[&str]| output(Command::new("git").arg("-C").arg(&manifest).args(args));
    let commit = std::env::var("REVENANT_GIT_COMMIT")
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| git(&["rev-parse", "HEAD"]))
        .unwrap_or_else(|| "unknown".into());
    let commit_date = std::env::var("REVENANT_GIT_COMMIT_DATE")
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| git(&["log", "-1", "--format=%cI", "HEAD"]))
        .unwrap_or_else(|| "unknown".into());
    // A new commit (or a checkout) runs this again: watch HEAD, the branch it names, packed refs.
    let mut watched = vec![git(&["rev-parse", "--git-path", "HEAD"])];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.push(git(&["rev-parse", "--git-path", &branch]));
    }
    watched.push(git(&["rev-parse", "--git-path", "packed-refs"]));
    for p in watched.into_iter().flatten() {
        let p = manifest.join(p);
        // A path that does not exist would run this script on every build.
        if p.exists() {
            println!("cargo:rerun-if-changed={}", p.display());
        }
    }
    let epoch = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs() as i64)
                .unwrap_or(0)
        });
    let build_date = time::OffsetDateTime::from_unix_timestamp(epoch)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| "unknown".into());
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let rustc = output(Command::new(rustc).arg("--version")).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=REVENANT_GIT_COMMIT={commit}");
    println!("cargo:rustc-env=REVENANT_GIT_COMMIT_DATE={commit_date}");
    println!("cargo:rustc-env=REVENANT_BUILD_DATE={build_date}");
    println!("cargo:rustc-env=REVENANT_RUSTC={rustc}");
}
