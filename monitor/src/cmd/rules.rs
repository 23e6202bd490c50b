//! `revenant rules list`: the active rule set (embedded defaults plus `--rules FILE`), as a table
//! or, with `--yaml`, as the full definitions.
//!
//! Exit codes: 0 listed, 2 usage error or a rules file that does not load.

use std::path::PathBuf;
use std::process::ExitCode;

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
}

pub fn run(command: RulesCommand) -> ExitCode {
    match command {
        RulesCommand::List { rules, yaml } => list(rules, yaml),
    }
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
                return ExitCode::from(2);
            }
        }
    }
    let mut out = format!(
        "{:<32} {:<9} {:<8} {:<16} {:<8} DESCRIPTION\n",
        "NAME", "SEVERITY", "SCOPE", "SHAPE", "ENABLED"
    );
    for r in &rules.rules {
        let mut desc = r.description.clone();
        if desc.len() > 80 {
            let mut cut = 77;
            while !desc.is_char_boundary(cut) {
                cut -= 1;
            }
            desc.truncate(cut);
            desc.push_str("...");
        }
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
