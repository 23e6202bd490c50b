//! Developer tasks: `cargo xtask setup` (and, later, test/demo).

use anyhow::Result;
use clap::{Parser, Subcommand};

mod setup;

#[derive(Parser)]
#[command(name = "xtask", about = "revenant developer tasks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install the eBPF toolchain (LLVM, bpf-linker, nightly rust-src) and mount tracefs; idempotent.
    Setup,
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Setup => setup::run(),
    }
}
