use clap::{Parser, Subcommand};

use pd_sim::{Flavour, cluster, load, router, vllm, worker};

// Per-request work is allocation-heavy (HTTP, JSON); glibc malloc showed up at ~12% of the
// router's profile.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "pd-sim",
    about = "PD disaggregated serving simulator (SGLang- or vLLM-shaped)",
    args_override_self = true
)]
struct Cli {
    /// Worker threads for the tokio runtime (default: number of CPUs; 1 for `load`).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Prefill worker (HTTP API, bootstrap server or side channel, KV sender).
    Prefill(WorkerCmd),
    /// Decode worker (HTTP API, KV receiver).
    Decode(WorkerCmd),
    /// PD router.
    Router(router::RouterArgs),
    /// Prefill + decode + router as child processes.
    Cluster(cluster::ClusterArgs),
    /// Open-loop load generator.
    Load(load::LoadArgs),
    /// One write to a prefill's bootstrap server from outside the cluster
    /// (`--fault foreign-route-put` starts it).
    Intrude(pd_sim::fault::IntrudeArgs),
}

/// A worker's flags: the common ones, plus the vLLM flavour's own (ignored by SGLang's).
#[derive(clap::Args)]
struct WorkerCmd {
    /// Wire formats: SGLang's (default) or vLLM's.
    #[arg(long, value_enum, default_value_t = Flavour::Sglang)]
    flavour: Flavour,
    #[command(flatten)]
    common: worker::WorkerArgs,
    #[command(flatten)]
    vllm: vllm::VllmArgs,
}

async fn run_worker(role: worker::Role, a: WorkerCmd) -> anyhow::Result<()> {
    match a.flavour {
        Flavour::Sglang => worker::run(role, a.common).await,
        Flavour::Vllm => vllm::worker::run(role, a.common, a.vllm).await,
    }
}

fn main() -> std::process::ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                std::process::ExitCode::from(2)
            } else {
                std::process::ExitCode::SUCCESS
            };
        }
    };
    // Colour codes only for a terminal: a cluster's log file or a test's pipe gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("PD_SIM_LOG")
                .unwrap_or_else(|_| "warn,pd_sim=info".into()),
        )
        .init();
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    rt.enable_all();
    // The load generator's per-request work is small; with one worker thread next to the
    // pacing loop it avoids cross-thread wake-ups (measured ~15 % less CPU per request at 3k/s
    // on the 2-core box). The servers keep the CPU-count default unless told (`cluster` passes
    // `--child-threads`).
    let default_threads = matches!(cli.cmd, Cmd::Load(_) | Cmd::Intrude(_)).then_some(1);
    if let Some(n) = cli.threads.or(default_threads) {
        rt.worker_threads(n.max(1));
    }
    let rt = match rt.build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("pd-sim: cannot start runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    let res = rt.block_on(async move {
        if !matches!(cli.cmd, Cmd::Load(_) | Cmd::Intrude(_)) {
            pd_sim::serve::install_shutdown_signals();
        }
        match cli.cmd {
            Cmd::Prefill(a) => run_worker(worker::Role::Prefill, a).await,
            Cmd::Decode(a) => run_worker(worker::Role::Decode, a).await,
            Cmd::Router(a) => router::run(a).await,
            Cmd::Cluster(a) => cluster::run(a).await,
            Cmd::Load(a) => load::run(a).await.map(|_| ()),
            Cmd::Intrude(a) => pd_sim::fault::intrude(&a),
        }
    });
    match res {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pd-sim: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}
