//! `revenant rules list`: the active rule set (embedded defaults plus `--rules FILE`), as a table
//! or, with `--yaml`, as the full definitions; `revenant rules validate FILE…`: each file loads
//! over the defaults (for CI).
//!
//! Exit codes: 0 listed or valid, 2 usage error or a rules file that does not load.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::exit::Exit;

#[derive(Debug, clap::Subcommand)]
pub enum RulesCommand {
    /// List the active rules (embedded defaults plus `--rules FILE`).
    List {
        /// Rules file (YAML) extending or overriding the embedded defaults.
        #[arg(long, value_name = "FILE")]
        rules: Option<PathBuf>,
        /// Print the full rule definitions as YAML instead of a table.
        #[arg(long)]
        yaml: bool,
    },
    /// Check rules files as `run` and `check --rules` load them (over the embedded defaults),
    /// each on its own: errors with file, line and column; exit 0 when every file is valid.
    Validate {
        /// Rules files (YAML).
        #[arg(value_name = "FILE", required = true)]
        files: Vec<PathBuf>,
    },
}

pub fn run(command: RulesCommand) -> ExitCode {
    match command {
        RulesCommand::List { rules, yaml } => list(rules, yaml),
        RulesCommand::Validate { files } => validate(&files),
    }
}

fn validate(files: &[PathBuf]) -> ExitCode {
    let mut out = String::new();
    let mut bad = 0;
    for f in files {
        match crate::engine::check::RuleSet::from_file(f) {
            Ok(set) => {
                let (total, enabled) = (set.rules.len(), set.enabled().count());
                // The fingerprint a run with these rules writes in its recording's header.
                let checker = crate::engine::check::Checker::new(set, Default::default());
                out.push_str(&format!(
                    "{}: valid: {total} rules, {enabled} enabled, fingerprint {}\n",
                    f.display(),
                    crate::ingest::replay::rules_fingerprint(checker.rules())
                ));
            }
            Err(e) => {
                bad += 1;
                crate::telemetry::console::error(&e);
            }
        }
    }
    let code = super::write_stdout(out.as_bytes());
    if bad > 0 { Exit::Usage.into() } else { code }
}

fn list(path: Option<PathBuf>, yaml: bool) -> ExitCode {
    let rules = match super::check::load_rules(path.as_ref()) {
        Ok(r) => r,
        Err(code) => return code,
    };
    if yaml {
        #[derive(serde::Serialize)]
        struct Doc {
            rules: Vec<crate::engine::rules::RuleDef>,
        }
        match serde_saphyr::to_string(&Doc {
            rules: rules.to_defs(),
        }) {
            Ok(s) => return super::write_stdout(s.as_bytes()),
            Err(e) => {
                crate::telemetry::console::error(&format!("cannot print rules: {e}"));
                return Exit::Usage.into();
            }
        }
    }
    let mut out = format!(
        "{:<32} {:<9} {:<8} {:<16} {:<8} DESCRIPTION\n",
        "NAME", "SEVERITY", "SCOPE", "SHAPE", "ENABLED"
    );
    // The description is the last column, whole: a terminal wraps it, a pipe keeps it.
    for r in &rules.rules {
        let desc = &r.description;
        out.push_str(&format!(
            "{:<32} {:<9} {:<8} {:<16} {:<8} {desc}\n",
            r.name,
            r.severity.as_str(),
            r.scope.as_str(),
            r.shape.kind_name(),
            if r.enabled { "yes" } else { "no" }
        ));
    }
    super::write_stdout(out.as_bytes())
}
