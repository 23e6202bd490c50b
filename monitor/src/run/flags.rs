//! Which of `run`'s flags mean something to `agent` and `checker`. They share `run`'s argument
//! structs; the flags that would do nothing in a subcommand are hidden from its `--help` and
//! refused when given on its command line (exit 2, one sentence saying why and where the flag
//! belongs), so that no flag is accepted and then quietly ignored.
//!
//! A config file may still hold sections a subcommand does not use (one file for a whole
//! deployment): those are not refused.

use clap::Command;
use clap::parser::ValueSource;

/// Flags (clap argument ids) that have no effect on one subcommand, and why.
#[derive(Debug)]
pub struct NotHere {
    pub ids: &'static [&'static str],
    pub why: &'static str,
}

/// What `revenant agent` does not use: it publishes events, it neither judges nor alerts.
pub const AGENT: &[NotHere] = &[
    NotHere {
        ids: &[
            "alert_config",
            "webhooks",
            "webhook_secret_file",
            "alertmanagers",
            "alertmanager_resend",
            "alerts_jsonl",
            "spool_max_entries",
            "spool_no_fsync",
            "spool_discard_removed_sinks",
            "dedup_window",
            "rate_limit",
            "rate_limit_window",
            "corroboration_window",
            "group_wait",
            "external_url",
            "cluster",
        ],
        why: "the agent sends no alerts, the checkers do (give it to `revenant checker`)",
    },
    NotHere {
        ids: &["rules", "clock_skew", "allowed_lateness", "engine_shards"],
        why: "the agent judges nothing, the checkers run the rules (give it to `revenant checker`)",
    },
    NotHere {
        ids: &["events_jsonl"],
        why: "the agent records no events file, its batches go to NATS \
              (`revenant checker --events-jsonl` records what the checker judged)",
    },
    NotHere {
        ids: &["recent_violations", "timeline_events"],
        why: "the agent keeps no violations or request timelines, the checkers' admin servers do",
    },
];

/// What `revenant checker` does not use: it takes its events from NATS, not from telemetry.
pub const CHECKER: &[NotHere] = &[NotHere {
    ids: &[
        "otlp_grpc",
        "otlp_http",
        "max_message_bytes",
        "ebpf",
        "watch",
        "pid",
        "no_sglang_conventions",
        "capture_head_bytes",
        "capture_tail_bytes",
        "ring_bytes",
    ],
    why: "the checker listens for no telemetry, its events come from NATS \
          (give source flags to `revenant agent`)",
}];

fn table(subcommand: &str) -> &'static [NotHere] {
    match subcommand {
        "agent" => AGENT,
        "checker" => CHECKER,
        _ => &[],
    }
}

/// Hides from `agent --help` and `checker --help` the flags that do nothing there. Panics (in
/// any test that builds the command line) when an id names no flag.
pub fn hide_inapplicable(cmd: Command) -> Command {
    ["agent", "checker"].into_iter().fold(cmd, |cmd, sub| {
        cmd.mut_subcommand(sub, |mut c| {
            for not_here in table(sub) {
                for id in not_here.ids {
                    c = c.mut_arg(*id, |a| a.hide(true));
                }
            }
            c
        })
    })
}

/// Headings and value names of `run`'s flags that are defined with their component (the eBPF
/// source's, the node's identity): grouped as `docs/run.md` groups them, `<BYTES>` as elsewhere.
fn value_names(c: Command) -> Command {
    let c = [
        "ebpf",
        "watch",
        "pid",
        "no_sglang_conventions",
        "capture_head_bytes",
        "capture_tail_bytes",
        "ring_bytes",
    ]
    .into_iter()
    .fold(c, |c, id| c.mut_arg(id, |a| a.help_heading("eBPF source")));
    let c = ["capture_head_bytes", "capture_tail_bytes", "ring_bytes"]
        .into_iter()
        .fold(c, |c, id| c.mut_arg(id, |a| a.value_name("BYTES")));
    ["node", "cluster"]
        .into_iter()
        .fold(c.mut_arg("ebpf", |a| a.value_name("MODE")), |c, id| {
            c.mut_arg(id, |a| a.help_heading("Node identity"))
        })
}

/// The command line as `--help` shows it: what does nothing in `agent` and `checker` hidden
/// there (see [`hide_inapplicable`]), value names made consistent.
pub fn polish(cmd: Command) -> Command {
    let cmd = hide_inapplicable(cmd)
        .mut_subcommand("run", value_names)
        .mut_subcommand("agent", |c| {
            // The agent's spool directory holds its outbox.
            value_names(c).mut_arg("spool_dir", |a| {
                a.help_heading("Cluster mode (NATS JetStream)")
            })
        })
        .mut_subcommand("checker", value_names);
    if cmd.find_subcommand("config").is_some() {
        cmd.mut_subcommand("config", |c| c.mut_subcommand("validate", value_names))
    } else {
        cmd
    }
}

/// A flag given to a subcommand it does nothing for (exit code 2).
#[derive(Debug, thiserror::Error)]
#[error("--{flag} has no effect on `revenant {subcommand}`: {why}")]
pub struct NotApplicable {
    pub flag: String,
    pub subcommand: String,
    pub why: &'static str,
}

/// The first flag on the command line of `subcommand` (its matches `m`, its command `cmd`) that
/// does nothing there. Values from the environment (`REVENANT_WEBHOOK_SECRET_FILE` set for a
/// whole pod) are not refused.
pub fn refuse_inapplicable(
    subcommand: &str,
    cmd: &Command,
    m: &clap::ArgMatches,
) -> Result<(), NotApplicable> {
    for not_here in table(subcommand) {
        for id in not_here.ids {
            if m.value_source(id) == Some(ValueSource::CommandLine) {
                let flag = cmd
                    .get_arguments()
                    .find(|a| a.get_id() == id)
                    .and_then(|a| a.get_long())
                    .unwrap_or(id)
                    .to_owned();
                return Err(NotApplicable {
                    flag,
                    subcommand: subcommand.to_owned(),
                    why: not_here.why,
                });
            }
        }
    }
    Ok(())
}
