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
    ensure_on(name, None, installs, ready)
}

/// A venv that sees `base`'s packages (its site-packages through a `.pth` file) under its own:
/// what it installs with `--no-deps` reuses the base's heavy dependencies (torch) instead of
/// installing them again. A change of the base's location builds a new venv.
pub fn ensure_layered(
    name: &str,
    base_python: &Path,
    installs: &[&[&str]],
    ready: &str,
) -> Result<PathBuf> {
    let out = Command::new(base_python)
        .args(["-c", "import site; print(site.getsitepackages()[0])"])
        .output()
        .with_context(|| format!("running {}", base_python.display()))?;
    if !out.status.success() {
        bail!("{} cannot name its site-packages", base_python.display());
    }
    let site = std::fs::canonicalize(String::from_utf8_lossy(&out.stdout).trim())?;
    ensure_on(name, Some(&site), installs, ready)
}

fn ensure_on(
    name: &str,
    base_site: Option<&Path>,
    installs: &[&[&str]],
    ready: &str,
) -> Result<PathBuf> {
    let link = target_dir().join(name);
    if is_ready(&link, ready) {
        return Ok(link);
    }
    let base = base_site.map(|b| b.display().to_string());
    let mut keyed: Vec<&[&str]> = installs.to_vec();
    let base_arg = base.as_deref().map(|b| [b]);
    if let Some(b) = &base_arg {
        keyed.push(b);
    }
    let cached = cache_dir()
        .join("venvs")
        .join(format!("{name}-{:016x}", digest(&keyed)));
    std::fs::create_dir_all(cached.parent().expect("a parent"))?;
    {
        let _lock = Lock::take(&cached.with_extension("lock"))?;
        if !is_ready(&cached, ready) {
            build(&cached, base_site, installs)?;
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

fn build(venv: &Path, base_site: Option<&Path>, installs: &[&[&str]]) -> Result<()> {
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
    if ok && let Some(base) = base_site {
        let out = Command::new(venv.join("bin/python"))
            .args(["-c", "import site; print(site.getsitepackages()[0])"])
            .output()?;
        let own = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        std::fs::write(own.join("base-venv.pth"), format!("{}\n", base.display()))
            .with_context(|| format!("linking {} to {}", venv.display(), base.display()))?;
    }
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
    let vllm_python = vllm_python(&sglang_python)?;
    Ok(vec![
        ("PD_SIM_SMG", venv.join("bin/smg")),
        ("PD_SIM_SMG113", venv113.join("bin/smg")),
        ("PD_SIM_PYTHON", venv.join("bin/python")),
        ("PD_SIM_VLLM_ROUTER", venv_vllm.join("bin/vllm-router")),
        ("PD_SIM_VLLM_ROUTER_PYTHON", venv_vllm.join("bin/python")),
        ("SGLANG_HARNESS_PYTHON", sglang_python.clone()),
        // pd-sim's frames read by SGLang's own builders and parsers (`sglang_interop`).
        ("PD_SIM_SGLANG_PYTHON", sglang_python),
        // pd-sim's vLLM wire judged by vLLM's own code (`vllm_interop`).
        ("PD_SIM_VLLM_PYTHON", vllm_python),
    ])
}

/// vLLM 0.34.0's Python code without its engine: the wheel with `--no-deps`, the few
/// pure-Python modules its connector, API and config modules import, and the SGLang venv's
/// torch, pydantic, fastapi, msgspec and pyzmq underneath (`ensure_layered`).
pub fn vllm_python(sglang_python: &Path) -> Result<PathBuf> {
    let ready = format!(
        "{}; import cachetools, cbor2, cloudpickle, cpuinfo, llguidance, torch, zmq",
        has_version("vllm", "0.34.0")
    );
    let venv = ensure_layered(
        "vllm-venv",
        sglang_python,
        &[&[
            "--no-deps",
            "vllm==0.34.0",
            "cachetools==8.0.3",
            "cbor2==6.3.0",
            "cloudpickle==3.1.3",
            "py-cpuinfo==9.0.0",
            "llguidance==1.9.1",
        ]],
        &ready,
    )?;
    Ok(venv.join("bin/python"))
}

#[cfg(test)]
mod tests {
    /// Builds (or finds) `target/vllm-venv` over the SGLang venv and imports what the interop
    /// test needs: `cargo test -p xtask --release -- --ignored vllm_venv_imports`.
    #[test]
    #[ignore = "builds a venv (pip, network)"]
    fn vllm_venv_imports() {
        let sglang = crate::sglang_venv::python().unwrap();
        let python = super::vllm_python(&sglang).unwrap();
        let ok = std::process::Command::new(python)
            .args([
                "-c",
                "from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlHandshakePayload; \
                 from vllm.v1.engine.input_processor import InputProcessor; \
                 from vllm.entrypoints.serve.exception_handling.error_response import create_error_response",
            ])
            .status()
            .unwrap();
        assert!(ok.success());
    }
}
