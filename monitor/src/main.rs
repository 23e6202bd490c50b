//! The `revenant` command line: parses the arguments and dispatches to one subcommand.
//!
//! Exit codes: [`revenant::exit::Exit`], one meaning each (the README's table).
//!
//! A command line clap cannot parse is exit code 2, and so is a flag given to a subcommand it
//! does nothing for (`agent --webhook`: `run::flags`); `--help` and `--version` are 0.

use std::process::ExitCode;
use std::sync::LazyLock;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

use revenant::cmd::{check, config, rules};
use revenant::exit::Exit;

// The OTLP path allocates many small strings per span; glibc malloc showed as ~45% of the
// receiver's profile, mimalloc is much cheaper for that pattern.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `--version`: the version, commit, build date, compiler and eBPF object.
static LONG_VERSION: LazyLock<String> = LazyLock::new(revenant::telemetry::build::long_version);

#[derive(Parser)]
#[command(
    name = "revenant",
    version,
    about = "Runtime invariant monitor for disaggregated (prefill/decode) LLM serving"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check recorded lifecycle events (JSON Lines) against the rules, offline.
    Check(check::CheckArgs),
    /// Run everything on one node: eBPF capture and OTLP receivers → normalize → checker →
    /// alerts (webhook, Alertmanager, JSON Lines), with an admin server.
    Run(Box<revenant::run::RunArgs>),
    /// Cluster mode, one per node: `run`'s sources (eBPF, OTLP; `--replay FILE` for recorded
    /// events) → normalize → batches on NATS JetStream, partitioned by attempt.
    Agent(Box<revenant::run::agent::AgentArgs>),
    /// Cluster mode, N replicas: the partitions this replica owns from JetStream → the checker
    /// → alerts (the same sinks and spool as `run`).
    Checker(Box<revenant::run::checker::CheckerArgs>),
    /// Inspect and validate the rule set.
    Rules {
        #[command(subcommand)]
        command: rules::RulesCommand,
    },
    /// Validate a configuration (for CI and before a rollout).
    Config {
        #[command(subcommand)]
        command: config::ConfigCommand,
    },
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell) on standard output.
    Completions {
        /// The shell to complete for.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

/// The command line, with what does not apply to `agent` and `checker` hidden from their help.
fn command() -> clap::Command {
    revenant::run::flags::polish(Cli::command()).long_version(LONG_VERSION.as_str())
}

/// Whether the command line asks for `--log-format json` (read before clap could parse it).
fn json_log_format_asked() -> bool {
    let args: Vec<String> = std::env::args().collect();
    args.windows(2)
        .any(|w| w[0] == "--log-format" && w[1] == "json")
        || args.iter().any(|a| a == "--log-format=json")
}

fn main() -> ExitCode {
    let parsed = command()
        .try_get_matches()
        .and_then(|m| Ok((Cli::from_arg_matches(&m)?, m)));
    let (cli, matches) = match parsed {
        Ok(c) => c,
        Err(e) => {
            if e.use_stderr() && json_log_format_asked() {
                // `run --log-format json`: even a command line it cannot parse is one JSON line.
                let text = e.render().to_string();
                revenant::telemetry::console::write_line(
                    &revenant::telemetry::console::json_record(
                        revenant::telemetry::console::Level::Error,
                        text.trim_end(),
                        serde_json::Map::new(),
                    ),
                );
                return Exit::Usage.into();
            }
            let _ = e.print();
            return if e.use_stderr() {
                Exit::Usage.into()
            } else {
                Exit::Success.into()
            };
        }
    };
    if let Some((sub, m)) = matches.subcommand() {
        let cmd = command();
        let Some(sub_cmd) = cmd.find_subcommand(sub) else {
            return Exit::Usage.into();
        };
        if let Err(e) = revenant::run::flags::refuse_inapplicable(sub, sub_cmd, m) {
            revenant::telemetry::console::error(&e);
            return Exit::Usage.into();
        }
    }
    match cli.command {
        Command::Check(args) => check::run(args),
        // Logging is set up by `run` from its --log-format / --log-level flags.
        Command::Run(mut args) => {
            if let Some(("run", m)) = matches.subcommand() {
                args.given = revenant::run::Given::from_matches(m);
            }
            revenant::run::run(*args)
        }
        Command::Agent(mut args) => {
            if let Some(("agent", m)) = matches.subcommand() {
                args.run.given = revenant::run::Given::from_matches(m);
            }
            revenant::run::agent::run(*args)
        }
        Command::Checker(mut args) => {
            if let Some(("checker", m)) = matches.subcommand() {
                args.run.given = revenant::run::Given::from_matches(m);
            }
            revenant::run::checker::run(*args)
        }
        Command::Rules { command } => rules::run(command),
        Command::Config { mut command } => {
            if let Some(("config", m)) = matches.subcommand()
                && let Some((_, m)) = m.subcommand()
            {
                command.record_given(m);
            }
            config::run(command)
        }
        Command::Completions { shell } => {
            let mut out = Vec::new();
            clap_complete::generate(shell, &mut command(), "revenant", &mut out);
            revenant::cmd::write_stdout(&out)
        }
    }
}
