//! Developer tasks: `cargo xtask test` runs every test the project has, installing what the tests
//! need first (idempotently), exactly as CI does (`.ci/run` calls it; `ci`, `docs/testing.md`);
//! `cargo xtask fuzz` runs the fuzz targets for longer; `cargo xtask bench-guard` compares the
//! engine's cost with a baseline commit's.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench_guard;
mod cargo;
mod chart;
mod ci;
mod demo;
mod fuzz;
mod image;
mod setup;
mod sglang_venv;
mod venv;

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
    /// What a change costs against a baseline commit: the engine's instructions per event
    /// (callgrind), `revenant check` events per CPU second and the OTLP pipeline's spans/s and
    /// CPU per span, both builds measured in one sitting, with the ratios. A benchmark: `test`
    /// does not run it. Needs valgrind.
    BenchGuard(bench_guard::BenchGuardArgs),
    /// Run the whole test suite as CI does: one release build, then side by side the chart and
    /// image checks, every test executable, the tests against real routers and SGLang, and
    /// every fuzz target's corpus and a short run (docs/testing.md).
    Test {
        /// Run `cargo test` over the same build with these arguments appended instead (a test
        /// name filter).
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
                    image::test(&built, &venv::otlp_python()?)?;
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
        Task::BenchGuard(args) => match bench_guard::run(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("xtask: bench-guard failed: {e:#}");
                ExitCode::FAILURE
            }
        },
        // Setup comes first in both: building `revenant` builds the kernel programs.
        Task::Test { args } => {
            let result = if args.is_empty() {
                ci::run()
            } else {
                ci::filtered(&args)
            };
            match result {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("xtask: tests failed: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// `cargo build --release -p revenant` (alone: with pd-sim in the same build cargo resolves
/// other features and builds every shared crate again), the binary's path from cargo's own
/// artifact messages.
fn release_revenant() -> anyhow::Result<std::path::PathBuf> {
    let out = cargo::command()
        .args(["build", "--release", "-p", "revenant", "--bin", "revenant"])
        .args(["--message-format", "json-render-diagnostics"])
        .stderr(std::process::Stdio::inherit())
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "cargo build --release -p revenant failed"
    );
    cargo::executable_of(&out.stdout, "revenant")
        .ok_or_else(|| anyhow::anyhow!("cargo built no revenant binary"))
}
