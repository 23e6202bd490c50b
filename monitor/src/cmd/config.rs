//! `revenant config validate`: loads and checks everything `revenant run` (or `agent`, or
//! `checker`) would at start-up (the config file with the flags over it, the rules, the alert
//! configuration and its secret files, TLS and token files, listen addresses, the memory budget)
//! without binding a port, opening the spool or loading a probe, and says what it would run.
//! For CI and before a rollout.
//!
//! Exit codes: 0 valid, 2 invalid (the reason on standard error, as `run` would say it).

use std::process::ExitCode;

use crate::engine::check::Checker;
use crate::exit::Exit;
use crate::run::{Prepared, Role, RunArgs, prepare_for};
use crate::telemetry::console;

#[derive(Debug, clap::Subcommand)]
pub enum ConfigCommand {
    /// Check a configuration as `revenant run` would load it (the same flags: `--config`,
    /// `--rules`, `--alert-config`, addresses, …), without binding a port or loading a probe;
    /// print what it would run. Exit 0 when valid, 2 otherwise.
    Validate(Box<ValidateArgs>),
}

#[derive(Debug, clap::Args)]
pub struct ValidateArgs {
    /// Validate for this command: `run`, `agent` (sources only) or `checker` (no sources).
    #[arg(long = "for", value_name = "COMMAND", value_enum, default_value_t = ForCommand::Run)]
    pub for_command: ForCommand,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ForCommand {
    Run,
    Agent,
    Checker,
}

impl ConfigCommand {
    /// Records which flags were given (set by `main` from the parsed matches), as for `run`.
    pub fn record_given(&mut self, m: &clap::ArgMatches) {
        match self {
            ConfigCommand::Validate(a) => {
                a.run.given = crate::run::Given::from_matches(m);
            }
        }
    }
}

pub fn run(command: ConfigCommand) -> ExitCode {
    match command {
        ConfigCommand::Validate(args) => validate(&args),
    }
}

fn validate(args: &ValidateArgs) -> ExitCode {
    // Warnings about settings that do nothing are part of the answer: log them.
    let self_traces = match args.run.log.init() {
        Ok(g) => g,
        Err(e) => {
            console::error(&e);
            return Exit::Usage.into();
        }
    };
    let role = match args.for_command {
        ForCommand::Run => Role::Run,
        ForCommand::Agent => Role::Agent,
        ForCommand::Checker => Role::Checker,
    };
    let code = match prepare_for(&args.run, role) {
        Ok(p) => crate::cmd::write_stdout(summary(&p, role).as_bytes()),
        Err(e) => {
            console::error(&e);
            Exit::Usage.into()
        }
    };
    if let Some(t) = self_traces {
        t.shutdown();
    }
    code
}

/// What the configuration would run, one line per component.
fn summary(p: &Prepared, role: Role) -> String {
    let addr = |a: Option<std::net::SocketAddr>| a.map_or("off".to_owned(), |a| a.to_string());
    let mut out = String::from("configuration valid\n");
    if role != Role::Checker {
        out.push_str(&format!(
            "  otlp:    grpc {}, http {}\n  ebpf:    {}\n",
            addr(p.cfg.otlp.grpc),
            addr(p.cfg.otlp.http),
            format!("{:?}", p.cfg.ebpf.mode).to_lowercase(),
        ));
    }
    if role != Role::Agent {
        out.push_str(&rules_line(&p.checker));
        let a = &p.alert;
        let mut sinks = Vec::new();
        if !a.webhooks.is_empty() {
            sinks.push(format!("{} webhook(s)", a.webhooks.len()));
        }
        if !a.alertmanagers.is_empty() {
            sinks.push(format!("{} alertmanager(s)", a.alertmanagers.len()));
        }
        if let Some(j) = &a.jsonl {
            sinks.push(format!("JSON Lines to {}", j.path.display()));
        }
        out.push_str(&format!("  alerts:  {}\n", sinks.join(", ")));
    }
    out.push_str(&format!(
        "  admin:   {}\n  memory:  {} bytes\n",
        if p.admin.no_admin {
            "off".to_owned()
        } else {
            p.admin.admin.to_string()
        },
        p.memory.budget
    ));
    out
}

fn rules_line(checker: &Checker) -> String {
    let n = checker.rules().count();
    format!(
        "  rules:   {n} enabled, fingerprint {}\n",
        crate::ingest::replay::rules_fingerprint(checker.rules())
    )
}
