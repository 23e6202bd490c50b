//! Developer tasks: `cargo xtask test` runs every test the project has, installing what the tests
//! need first (idempotently), exactly as CI does (`.ci/run` calls it).

use std::process::{Command, ExitCode};

use clap::{Parser, Subcommand};

mod setup;

#[derive(Parser)]
#[command(name = "xtask")]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install the eBPF toolchain (LLVM 22, bpf-linker, nightly rust-src) and mount tracefs;
    /// idempotent. `test` runs it first.
    Setup {
        /// Also install the overhead benchmark's tools (nginx, wrk, bpftrace).
        #[arg(long)]
        bench: bool,
    },
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
    let status = Command::new(&cargo)
        .args([
            "test",
            "--workspace",
            "--exclude",
            "monitor-ebpf",
            "--all-targets",
        ])
        .args(args)
        .status();
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
