//! `cargo xtask setup`: install what building revenant (the eBPF toolchain) and running its tests
//! (Prometheus, Alertmanager, nats-server for cluster mode) need, idempotently. The tests
//! themselves install nothing.
//!
//! Every step first checks whether its result is already there, so CI can run this on every
//! build at the cost of a few `dpkg -s` calls. Each step prints what it checks and what it does.

use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

/// The LLVM that `bpf-linker` links against; Debian bookworm-security ships 22.
const LLVM_VERSION: &str = "22";

/// Debian packages `bpf-linker` needs to build against the system LLVM.
fn apt_packages() -> Vec<String> {
    vec![
        format!("llvm-{LLVM_VERSION}-dev"),
        format!("libpolly-{LLVM_VERSION}-dev"),
        "libzstd-dev".into(),
        "zlib1g-dev".into(),
        "libxml2-dev".into(),
        "libffi-dev".into(),
    ]
}

const TRACEFS: &str = "/sys/kernel/tracing";

pub fn run() -> Result<()> {
    build_prereqs()?;
    test_tools()?;
    image_tools()?;
    fuzz_tools()?;
    mount_tracefs()?;
    println!("setup: done");
    Ok(())
}

/// What building `revenant` needs (it embeds the eBPF programs), each step skipped when present.
pub fn build_prereqs() -> Result<()> {
    install_apt_packages(&apt_packages())?;
    install_rust_src()?;
    install_bpf_linker()
}

/// Whether building needs no installation at all (quiet check, for the demo).
pub fn build_prereqs_present() -> bool {
    apt_packages().iter().all(|p| dpkg_installed(p))
        && Command::new("bpf-linker")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
        && Command::new("rustup")
            .args(["component", "list", "--installed", "--toolchain", "nightly"])
            .output()
            .is_ok_and(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .any(|l| l.starts_with("rust-src"))
            })
}

/// Shared libraries the tests' Python components load: Mooncake's transfer engine
/// (target/sglang-venv, the SGLang truth source) links `libibverbs.so.1` even for its TCP
/// transport.
const TEST_LIBRARIES: &[&str] = &["libibverbs1"];

/// The system programs the end-to-end tests run (`test_harness::SYSTEM_TOOLS`: nats-server, Prometheus,
/// promtool, Alertmanager): the Debian packages of those not on PATH; and [`TEST_LIBRARIES`].
pub fn test_tools() -> Result<()> {
    install_apt_packages(
        &TEST_LIBRARIES
            .iter()
            .map(|p| p.to_string())
            .collect::<Vec<_>>(),
    )?;
    let mut missing: Vec<String> = test_harness::SYSTEM_TOOLS
        .iter()
        .filter(|(binary, _)| test_harness::on_path(binary).is_none())
        .map(|(_, package)| package.to_string())
        .collect();
    missing.dedup();
    if missing.is_empty() {
        let names: Vec<&str> = test_harness::SYSTEM_TOOLS.iter().map(|(b, _)| *b).collect();
        println!("setup: test tools already on PATH: {}", names.join(" "));
        return Ok(());
    }
    install_apt_packages(&missing)
}

/// podman, which builds the OCI image (`cargo xtask image`) and mounts its root filesystem
/// for the image test.
pub fn image_tools() -> Result<()> {
    if test_harness::on_path("podman").is_some() {
        println!("setup: podman already on PATH");
        return Ok(());
    }
    install_apt_packages(&["podman".into()])
}

/// cargo-fuzz, which builds and runs the fuzz targets (`fuzz/`) on the nightly toolchain that
/// `install_rust_src` already requires.
pub fn fuzz_tools() -> Result<()> {
    if let Ok(out) = crate::fuzz::cargo_fuzz().arg("--version").output()
        && out.status.success()
    {
        println!(
            "setup: {} already installed",
            String::from_utf8_lossy(&out.stdout).trim()
        );
        return Ok(());
    }
    println!("setup: cargo install cargo-fuzz --locked");
    run_cmd(Command::new("cargo").args(["install", "cargo-fuzz", "--locked"]))
}

/// Tools of `cargo bench -p revenant --bench ebpf_overhead` (not needed by the tests).
pub fn bench_tools() -> Result<()> {
    install_apt_packages(&["nginx-light".into(), "wrk".into(), "bpftrace".into()])
}

fn dpkg_installed(pkg: &str) -> bool {
    // `dpkg -s` exits 0 also for removed-but-configured packages; the Status line tells.
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", pkg])
        .stderr(Stdio::null())
        .output()
        .map(|o| {
            o.status.success()
                && String::from_utf8_lossy(&o.stdout).contains("install ok installed")
        })
        .unwrap_or(false)
}

/// Installs the given Debian packages, running `apt-get update` once, only if one is missing.
pub fn install_apt_packages(pkgs: &[String]) -> Result<()> {
    let missing: Vec<&String> = pkgs.iter().filter(|p| !dpkg_installed(p)).collect();
    if missing.is_empty() {
        println!("setup: apt packages already installed: {}", pkgs.join(" "));
        return Ok(());
    }
    let names: Vec<&str> = missing.iter().map(|s| s.as_str()).collect();
    println!("setup: apt-get update, then install {}", names.join(" "));
    run_cmd(Command::new("apt-get").arg("update").arg("-q"))?;
    run_cmd(
        Command::new("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&names),
    )
}

fn install_rust_src() -> Result<()> {
    let out = Command::new("rustup")
        .args(["component", "list", "--installed", "--toolchain", "nightly"])
        .output()
        .context("running rustup (is rustup on PATH?)")?;
    if !out.status.success() {
        bail!(
            "`rustup component list --toolchain nightly` failed: the eBPF programs need the nightly \
             toolchain: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    if String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.starts_with("rust-src"))
    {
        println!("setup: rust-src already installed for nightly");
        return Ok(());
    }
    println!("setup: rustup component add rust-src --toolchain nightly");
    run_cmd(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]))
}

fn install_bpf_linker() -> Result<()> {
    if let Ok(out) = Command::new("bpf-linker").arg("--version").output()
        && out.status.success()
    {
        println!(
            "setup: {} already installed",
            String::from_utf8_lossy(&out.stdout).trim()
        );
        return Ok(());
    }
    let prefix = format!("/usr/lib/llvm-{LLVM_VERSION}");
    println!(
        "setup: LLVM_PREFIX={prefix} cargo install bpf-linker --no-default-features --features llvm-{LLVM_VERSION}"
    );
    run_cmd(
        Command::new("cargo")
            .env("LLVM_PREFIX", &prefix)
            .args([
                "install",
                "bpf-linker",
                "--no-default-features",
                "--features",
            ])
            .arg(format!("llvm-{LLVM_VERSION}")),
    )
}

pub fn mount_tracefs() -> Result<()> {
    // The syscall and sched tracepoints are attached by name through tracefs.
    if Path::new(TRACEFS).join("events").is_dir() {
        println!("setup: tracefs already mounted at {TRACEFS}");
        return Ok(());
    }
    println!("setup: mount -t tracefs tracefs {TRACEFS}");
    run_cmd(Command::new("mount").args(["-t", "tracefs", "tracefs", TRACEFS]))
        .context("mounting tracefs (needs root)")
}

fn run_cmd(cmd: &mut Command) -> Result<()> {
    let shown = format!("{cmd:?}");
    let status = cmd.status().with_context(|| format!("starting {shown}"))?;
    if !status.success() {
        bail!("{shown} failed with {status}");
    }
    Ok(())
}
