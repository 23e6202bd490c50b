//! Developer tasks: `cargo xtask test` runs every test the project has, installing what the tests
//! need first (idempotently), exactly as CI does (`.ci/run` calls it); `cargo xtask fuzz` runs
//! the fuzz targets for longer.

use std::process::{Command, ExitCode};

use clap::{Parser, Subcommand};

mod chart;
mod demo;
mod fuzz;
mod image;
mod setup;
mod sglang_venv;

#[derive(Parser)]
#[command(name = "xtask")]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install the eBPF toolchain (LLVM 22, bpf-linker, nightly rust-src), cargo-fuzz and the
    /// programs the tests run (Prometheus, Alertmanager), and mount tracefs; idempotent. `test`
    /// runs it first.
    Setup {
        /// Also install the overhead benchmark's tools (nginx, wrk, bpftrace).
        #[arg(long)]
        bench: bool,
    },
    /// The simulated PD cluster with the buggy router, revenant watching it: alerts live, then a
    /// summary. Ctrl-C stops everything.
    Demo(demo::DemoArgs),
    /// Run the fuzz targets (fuzz/) one after another on one core and print executions, exec/s
    /// and corpus size per target; fails on the first crash.
    Fuzz {
        /// Seconds per target.
        #[arg(long, default_value_t = fuzz::TEST_SECONDS, conflicts_with = "runs")]
        seconds: u64,
        /// Executions per target instead of a time limit (e.g. 10000000).
        #[arg(long)]
        runs: Option<u64>,
        /// Targets to run (default: all of them).
        targets: Vec<String>,
    },
    /// Lint, render and check the Helm chart (deploy/helm/revenant) for each values file:
    /// helm lint, kubernetes-validate, checkov, promtool, and the rendered command line run by
    /// the real binary. `test` runs it too.
    Chart {
        /// The revenant binary to run the rendered command line with [default: a release build].
        #[arg(long, value_name = "PATH")]
        revenant: Option<std::path::PathBuf>,
        /// Also measure that the chart's eBPF capabilities are enough and each needed (root;
        /// `test` does).
        #[arg(long)]
        measure: bool,
    },
    /// Build the OCI image (localhost/revenant:VERSION) with podman, FROM scratch: the release
    /// binary and the shared libraries it loads, non-root by default. Prints its reference and id.
    Image {
        /// Also run `revenant run` from the image's root filesystem and replay an incident into
        /// it (as `test` does).
        #[arg(long)]
        test: bool,
    },
    /// Run the whole test suite (unit, scenario, CLI and end-to-end tests, then a short run of
    /// every fuzz target).
    Test {
        /// Extra arguments passed to `cargo test` (e.g. a test name filter).
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Task::Setup { bench } => {
            match setup::run().and_then(|()| if bench { setup::bench_tools() } else { Ok(()) }) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("xtask: setup failed: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        Task::Demo(args) => match demo::run(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("xtask: demo failed: {e:#}");
                ExitCode::FAILURE
            }
        },
        Task::Fuzz {
            seconds,
            runs,
            targets,
        } => {
            let budget = runs.map_or(fuzz::Budget::Seconds(seconds), fuzz::Budget::Runs);
            match setup::fuzz_tools().and_then(|()| fuzz::run_all(&targets, budget)) {
                Ok(_) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("xtask: fuzz failed: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        Task::Chart { revenant, measure } => {
            let bin = match revenant {
                Some(b) => Ok(b),
                None => release_revenant(),
            };
            match bin.and_then(|b| {
                chart::run(&b)?;
                if measure {
                    chart::privileges(&b)?;
                }
                Ok(())
            }) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("xtask: chart checks failed: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        Task::Image { test } => {
            let built = release_revenant().and_then(|b| image::build(&b));
            let result = built.and_then(|built| {
                println!("{} {}", built.reference, built.id);
                if test {
                    image::test(&built, &otlp_venv()?)?;
                    eprintln!("xtask: image test passed");
                }
                Ok(())
            });
            match result {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("xtask: image failed: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        Task::Test { args } => {
            // Building `revenant` builds the kernel programs: the toolchain must be there first.
            if let Err(e) = setup::run() {
                eprintln!("xtask: setup failed: {e:#}");
                return ExitCode::FAILURE;
            }
            run_tests(&args)
        }
    }
}

fn run_tests(args: &[String]) -> ExitCode {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // The end-to-end tests (tests/e2e) push thousands of requests through real revenant and
    // pd-sim processes: release builds, made here and handed over by path.
    let bins = match test_harness::Binaries::build(true) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("xtask: cannot build the end-to-end binaries: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    // The Helm chart needs no test build: checked first, on full runs.
    if args.is_empty()
        && let Err(e) = chart::run(&bins.revenant).and_then(|()| chart::privileges(&bins.revenant))
    {
        eprintln!("xtask: chart checks failed: {e:#}");
        return ExitCode::FAILURE;
    }
    if args.is_empty() {
        let tested = image::build(&bins.revenant).and_then(|built| {
            image::test(&built, &otlp_venv()?)?;
            eprintln!("xtask: image {} ({}) tested", built.reference, built.id);
            Ok(())
        });
        if let Err(e) = tested {
            eprintln!("xtask: image test failed: {e:#}");
            return ExitCode::FAILURE;
        }
    }
    let status = Command::new(&cargo)
        .args([
            "test",
            "--workspace",
            "--exclude",
            "monitor-ebpf",
            "--all-targets",
        ])
        .args(args)
        .env("REVENANT_BIN", &bins.revenant)
        .env("PD_SIM_BIN", &bins.pd_sim)
        .status();
    // With a filter the caller wants a subset: the real-component suite and the fuzz targets
    // run on full runs only.
    let status = match status {
        Ok(s) if s.success() && args.is_empty() => real_component_tests(&cargo, &bins),
        other => other,
    };
    if matches!(&status, Ok(s) if s.success()) && args.is_empty() {
        let started = std::time::Instant::now();
        match fuzz::run_all(&[], fuzz::Budget::Seconds(fuzz::TEST_SECONDS)) {
            Ok(_) => eprintln!(
                "xtask: fuzz targets clean ({:.0} s)",
                started.elapsed().as_secs_f64()
            ),
            Err(e) => {
                eprintln!("xtask: fuzzing failed: {e:#}");
                return ExitCode::FAILURE;
            }
        }
    }
    match status {
        Ok(s) if s.success() => ExitCode::SUCCESS,
        Ok(s) => {
            eprintln!("xtask: tests failed ({s})");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("xtask: cannot run {cargo}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A venv under `target/` holding `packages`, (re)created unless `ready` (a Python snippet that
/// exits 0) says it is already what it must be.
fn ensure_venv(name: &str, packages: &[&str], ready: &str) -> std::io::Result<std::path::PathBuf> {
    ensure_venv_steps(name, &[packages], ready)
}

/// [`ensure_venv`] with several `pip install` runs, in order (each a list of pip arguments).
fn ensure_venv_steps(
    name: &str,
    installs: &[&[&str]],
    ready: &str,
) -> std::io::Result<std::path::PathBuf> {
    let venv = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target")
        .join(name);
    let python = venv.join("bin/python");
    let is_ready = python.exists()
        && Command::new(&python)
            .args(["-c", ready])
            .status()
            .is_ok_and(|s| s.success());
    if !is_ready {
        let shown: Vec<String> = installs.iter().map(|i| i.join(" ")).collect();
        eprintln!("xtask: creating {} ({})", venv.display(), shown.join("; "));
        let mut ok = Command::new("python3")
            .arg("-m")
            .arg("venv")
            .arg(&venv)
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
            return Err(std::io::Error::other(format!(
                "could not create the venv {} (pip install {})",
                venv.display(),
                shown.join("; pip install ")
            )));
        }
    }
    Ok(venv)
}

/// `cargo build --release -p revenant` (alone: with pd-sim in the same build cargo resolves
/// other features and builds every shared crate again), the binary's path from cargo's own
/// artifact messages.
fn release_revenant() -> anyhow::Result<std::path::PathBuf> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(&cargo)
        .current_dir(test_harness::workspace_root())
        .args(["build", "--release", "-p", "revenant", "--bin", "revenant"])
        .args(["--message-format", "json-render-diagnostics"])
        .stderr(std::process::Stdio::inherit())
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "cargo build --release -p revenant failed"
    );
    out.stdout
        .split(|b| *b == b'\n')
        .filter_map(|l| serde_json::from_slice::<serde_json::Value>(l).ok())
        .filter(|v| v["reason"] == "compiler-artifact" && v["target"]["name"] == "revenant")
        .find_map(|v| v["executable"].as_str().map(std::path::PathBuf::from))
        .ok_or_else(|| anyhow::anyhow!("cargo built no revenant binary"))
}

/// The OpenTelemetry SDK venv the crate's end-to-end tests use (target/otlp-venv, the same
/// pinned exporters), for replaying incidents into `revenant run`.
fn otlp_venv() -> anyhow::Result<std::path::PathBuf> {
    let venv = ensure_venv(
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

/// `ready` snippet: the venv holds exactly this version of that distribution (a stale venv is
/// reinstalled).
fn has_version(dist: &str, version: &str) -> String {
    format!("import importlib.metadata as m, sys; sys.exit(m.version('{dist}') != '{version}')")
}

/// Tests against real third-party components that come from PyPI: the `sglang-router` 0.3.2
/// wheel (`smg`) in front of the simulator, pyzmq (libzmq) against the simulator's ZMTP, its
/// successor `smg` 1.13.0, `vllm-router` 0.1.17 in front of the simulator's vLLM workers, and
/// smg 1.13.0 in front of SGLang 0.5.23's own PD code (`tests/sglang-harness`, target/sglang-venv).
/// Both smg wheels install a binary named `smg`, so each router has a venv of its own. The venvs
/// are created once under `target/`; failing to create one fails the run loudly.
fn real_component_tests(
    cargo: &str,
    bins: &test_harness::Binaries,
) -> std::io::Result<std::process::ExitStatus> {
    let ready = format!("{}; import zmq", has_version("sglang-router", "0.3.2"));
    let venv = ensure_venv("xtask-venv", &["sglang-router==0.3.2", "pyzmq"], &ready)?;
    let python = venv.join("bin/python");
    let smg = venv.join("bin/smg");
    let venv113 = ensure_venv(
        "xtask-venv-smg113",
        &["smg==1.13.0"],
        &has_version("smg", "1.13.0"),
    )?;
    let smg113 = venv113.join("bin/smg");
    let venv_vllm = ensure_venv(
        "xtask-venv-vllm-router",
        &["vllm-router==0.1.17"],
        &has_version("vllm-router", "0.1.17"),
    )?;
    let sglang_python = sglang_venv::python()?;
    eprintln!(
        "xtask: real-component tests (sglang-router 0.3.2 smg, smg 1.13.0, vllm-router 0.1.17, pyzmq, sglang 0.5.23)"
    );
    // Ignored tests that need the venvs (pd-sim's, and revenant's `ebpf_real_router`). The eBPF
    // ones need root, as CI runs; they fail (never skip) when the probes cannot load.
    const IGNORED: &[&str] = &[
        "real_router",
        "interop",
        "e2e_real_router",
        "e2e_capacity",
        "smg_1_13",
        "ebpf_real_router",
        "vllm_pd",
        "vllm_real_router",
        "sglang_harness",
        "sglang_interop",
    ];
    // The same package selection as the first run (`--workspace`): cargo resolves features per
    // selection, so `-p pd-sim` or `-p revenant` would build every crate again, a second ~5 GB
    // of test executables. The pd-sim end-to-end tests run the debug revenant binary next to
    // their own executable, which that selection builds too.
    let mut cmd = Command::new(cargo);
    cmd.args(["test", "--workspace", "--exclude", "monitor-ebpf"]);
    for t in IGNORED {
        cmd.args(["--test", t]);
    }
    cmd.args(["--", "--ignored"])
        .env("PD_SIM_SMG", &smg)
        .env("PD_SIM_SMG113", &smg113)
        .env("PD_SIM_PYTHON", &python)
        .env("PD_SIM_VLLM_ROUTER", venv_vllm.join("bin/vllm-router"))
        .env("PD_SIM_VLLM_ROUTER_PYTHON", venv_vllm.join("bin/python"))
        .env("SGLANG_HARNESS_PYTHON", &sglang_python)
        // pd-sim's frames read by SGLang's own builders and parsers (`sglang_interop`).
        .env("PD_SIM_SGLANG_PYTHON", &sglang_python)
        // The end-to-end tests among them (tests/e2e vllm_pd) use the release builds made above.
        .env("REVENANT_BIN", &bins.revenant)
        .env("PD_SIM_BIN", &bins.pd_sim)
        .status()
}
