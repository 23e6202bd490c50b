//! The Python venvs the tests run real components from (routers, SGLang, the OpenTelemetry SDK,
//! the chart's checkers), idempotent and cached across clones.
//!
//! `target/<name>` is what tests and docs name. A venv is built once per set of pins in the
//! cache (`$REVENANT_XTASK_CACHE`, else `$XDG_CACHE_HOME/revenant-xtask`, else
//! `~/.cache/revenant-xtask`), under `venvs/<name>-<digest of its pins>`, and `target/<name>` is
//! a symlink to it: a clean clone (or `cargo clean`) costs a symlink, not a reinstall (the SGLang
//! venv is 6 GB and takes minutes), and a change of pins builds a new venv beside the old one.
//! A `target/<name>` that is already a venv of the right versions (made by hand, or by an older
//! xtask) is used as it is. Building one holds a lock, so two runs never build the same venv at
//! once.

use std::io::Write as _;
use std::os::unix::io::AsRawFd as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// Where cached venvs (and other downloaded tools) live, outside any clone.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("REVENANT_XTASK_CACHE") {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("revenant-xtask")
}

fn target_dir() -> PathBuf {
    test_harness::workspace_root().join("target")
}

/// A venv holding `packages` at `target/<name>`, built unless `ready` (a Python snippet that
/// exits 0) says it already is what it must be.
pub fn ensure(name: &str, packages: &[&str], ready: &str) -> Result<PathBuf> {
    ensure_steps(name, &[packages], ready)
}

/// [`ensure`] with several `pip install` runs, in order (each a list of pip arguments).
pub fn ensure_steps(name: &str, installs: &[&[&str]], ready: &str) -> Result<PathBuf> {
    let link = target_dir().join(name);
    if is_ready(&link, ready) {
        return Ok(link);
    }
    let cached = cache_dir()
        .join("venvs")
        .join(format!("{name}-{:016x}", digest(installs)));
    std::fs::create_dir_all(cached.parent().expect("a parent"))?;
    {
        let _lock = Lock::take(&cached.with_extension("lock"))?;
        if !is_ready(&cached, ready) {
            build(&cached, installs)?;
            if !is_ready(&cached, ready) {
                bail!(
                    "{} was built but its check still fails: {ready}",
                    cached.display()
                );
            }
        }
    }
    std::fs::create_dir_all(target_dir())?;
    match std::fs::symlink_metadata(&link) {
        Ok(m) if m.file_type().is_symlink() => std::fs::remove_file(&link)?,
        Ok(_) => std::fs::remove_dir_all(&link)
            .with_context(|| format!("removing the stale venv {}", link.display()))?,
        Err(_) => {}
    }
    std::os::unix::fs::symlink(&cached, &link)
        .with_context(|| format!("linking {} to {}", link.display(), cached.display()))?;
    Ok(link)
}

fn is_ready(venv: &Path, ready: &str) -> bool {
    let python = venv.join("bin/python");
    python.exists()
        && Command::new(&python)
            .args(["-c", ready])
            .status()
            .is_ok_and(|s| s.success())
}

fn build(venv: &Path, installs: &[&[&str]]) -> Result<()> {
    let shown: Vec<String> = installs.iter().map(|i| i.join(" ")).collect();
    eprintln!("xtask: creating {} ({})", venv.display(), shown.join("; "));
    let started = std::time::Instant::now();
    let _ = std::fs::remove_dir_all(venv);
    let mut ok = Command::new("python3")
        .arg("-m")
        .arg("venv")
        .arg(venv)
        .status()?
        .success();
    for install in installs {
        ok = ok
            && Command::new(venv.join("bin/pip"))
                .args(["install", "--quiet"])
                .args(*install)
                .status()?
                .success();
    }
    if !ok {
        bail!(
            "could not create the venv {} (pip install {})",
            venv.display(),
            shown.join("; pip install ")
        );
    }
    eprintln!(
        "xtask: {} created in {:.0} s",
        venv.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// FNV-1a over the pins: the same on every run and every Rust version.
fn digest(installs: &[&[&str]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for install in installs {
        for arg in install.iter().chain(std::iter::once(&"\n")) {
            for b in arg.bytes().chain(std::iter::once(0)) {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        }
    }
    h
}

/// An exclusive `flock` on a file, released on drop.
struct Lock(std::fs::File);

impl Lock {
    fn take(path: &Path) -> Result<Lock> {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            bail!(
                "locking {}: {}",
                path.display(),
                std::io::Error::last_os_error()
            );
        }
        let _ = writeln!(f, "{}", std::process::id());
        Ok(Lock(f))
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        // SAFETY: as in `take`.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// `ready` snippet: the venv holds exactly this version of that distribution (a stale venv is
/// rebuilt).
pub fn has_version(dist: &str, version: &str) -> String {
    format!("import importlib.metadata as m, sys; sys.exit(m.version('{dist}') != '{version}')")
}

/// The OpenTelemetry SDK venv the crate's end-to-end tests use (target/otlp-venv, the same
/// pinned exporters), for replaying incidents into `revenant run`.
pub fn otlp_python() -> Result<PathBuf> {
    let venv = ensure(
        "otlp-venv",
        &[
            "opentelemetry-sdk==1.45.2",
            "opentelemetry-exporter-otlp-proto-grpc==1.45.2",
            "opentelemetry-exporter-otlp-proto-http==1.45.2",
        ],
        "import opentelemetry.sdk, opentelemetry.exporter.otlp.proto.grpc.trace_exporter, \
         opentelemetry.exporter.otlp.proto.http.trace_exporter",
    )?;
    Ok(venv.join("bin/python"))
}

/// The real routers' venvs (both smg wheels install a binary named `smg`, so each router has a
/// venv of its own) and SGLang's, with the environment the real-component tests read.
pub fn real_components() -> Result<Vec<(&'static str, PathBuf)>> {
    let ready = format!("{}; import zmq", has_version("sglang-router", "0.3.2"));
    let venv = ensure("xtask-venv", &["sglang-router==0.3.2", "pyzmq"], &ready)?;
    let venv113 = ensure(
        "xtask-venv-smg113",
        &["smg==1.13.0"],
        &has_version("smg", "1.13.0"),
    )?;
    let venv_vllm = ensure(
        "xtask-venv-vllm-router",
        &["vllm-router==0.1.17"],
        &has_version("vllm-router", "0.1.17"),
    )?;
    let sglang_python = crate::sglang_venv::python()?;
    Ok(vec![
        ("PD_SIM_SMG", venv.join("bin/smg")),
        ("PD_SIM_SMG113", venv113.join("bin/smg")),
        ("PD_SIM_PYTHON", venv.join("bin/python")),
        ("PD_SIM_VLLM_ROUTER", venv_vllm.join("bin/vllm-router")),
        ("PD_SIM_VLLM_ROUTER_PYTHON", venv_vllm.join("bin/python")),
        ("SGLANG_HARNESS_PYTHON", sglang_python.clone()),
        // pd-sim's frames read by SGLang's own builders and parsers (`sglang_interop`).
        ("PD_SIM_SGLANG_PYTHON", sglang_python),
    ])
}
