//! Developer tasks: `cargo xtask test` runs every test the project has, installing what the tests
//! need first (idempotently), exactly as CI does (`.ci/run` calls it).

use std::process::{Command, ExitCode};

use clap::{Parser, Subcommand};

mod demo;
mod setup;

#[derive(Parser)]
#[command(name = "xtask")]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install the eBPF toolchain (LLVM 22, bpf-linker, nightly rust-src) and the programs the
    /// tests run (Prometheus, Alertmanager), and mount tracefs; idempotent. `test` runs it first.
    Setup {
        /// Also install the overhead benchmark's tools (nginx, wrk, bpftrace).
        #[arg(long)]
        bench: bool,
    },
    /// The simulated PD cluster with the buggy router, revenant watching it: alerts live, then a
    /// summary. Ctrl-C stops everything.
    Demo(demo::DemoArgs),
    /// Run the whole test suite (unit, scenario, CLI and end-to-end tests).
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
    // With a filter the caller wants a subset: the real-component suite runs on full runs only.
    let status = match status {
        Ok(s) if s.success() && args.is_empty() => real_component_tests(&cargo),
        other => other,
    };
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

/// Tests against real third-party components that come from PyPI: the `sglang-router` 0.3.2
/// wheel (`smg`) in front of the simulator, pyzmq (libzmq) against the simulator's ZMTP, and its
/// successor `smg` 1.13.0. Both wheels install a binary named `smg`, so 1.13.0 has a venv of
/// its own. The venvs are created once under `target/`; failing to create one fails the run
/// loudly.
fn real_component_tests(cargo: &str) -> std::io::Result<std::process::ExitStatus> {
    let venv = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/xtask-venv");
    let python = venv.join("bin/python");
    let smg = venv.join("bin/smg");
    let ready = smg.exists()
        && Command::new(&python)
            .args(["-c", "import zmq"])
            .status()
            .is_ok_and(|s| s.success());
    if !ready {
        eprintln!(
            "xtask: creating {} (sglang-router==0.3.2, pyzmq)",
            venv.display()
        );
        let ok = Command::new("python3")
            .arg("-m")
            .arg("venv")
            .arg(&venv)
            .status()?
            .success()
            && Command::new(venv.join("bin/pip"))
                .args(["install", "--quiet", "sglang-router==0.3.2", "pyzmq"])
                .status()?
                .success();
        if !ok {
            return Err(std::io::Error::other(
                "could not create the real-component venv (pip install sglang-router==0.3.2 pyzmq)",
            ));
        }
    }
    // smg 1.13.0: ready when the venv holds exactly that version (a stale venv is reinstalled).
    let venv113 =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/xtask-venv-smg113");
    let smg113 = venv113.join("bin/smg");
    let ready113 = smg113.exists()
        && Command::new(venv113.join("bin/python"))
            .args([
                "-c",
                "import importlib.metadata as m, sys; sys.exit(m.version('smg') != '1.13.0')",
            ])
            .status()
            .is_ok_and(|s| s.success());
    if !ready113 {
        eprintln!("xtask: creating {} (smg==1.13.0)", venv113.display());
        let ok = Command::new("python3")
            .arg("-m")
            .arg("venv")
            .arg(&venv113)
            .status()?
            .success()
            && Command::new(venv113.join("bin/pip"))
                .args(["install", "--quiet", "smg==1.13.0"])
                .status()?
                .success();
        if !ok {
            return Err(std::io::Error::other(
                "could not create the smg 1.13.0 venv (pip install smg==1.13.0)",
            ));
        }
    }
    eprintln!("xtask: real-component tests (sglang-router 0.3.2 smg, smg 1.13.0, pyzmq)");
    // Ignored tests that need the venvs (pd-sim's, and revenant's `ebpf_real_router`). The eBPF
    // ones need root, as CI runs; they fail (never skip) when the probes cannot load.
    const IGNORED: &[&str] = &[
        "real_router",
        "interop",
        "e2e_real_router",
        "e2e_capacity",
        "smg_1_13",
        "ebpf_real_router",
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
        .status()
}
