//! The command line of `revenant run` (which `agent` and `checker` flatten into theirs), which of
//! its flags were given, and why a configuration does not make a start (exit code 2).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use clap::parser::ValueSource;

use super::memory::BudgetTooSmall;
use crate::access::AccessArgs;
use crate::admin::AdminArgs;
use crate::alert::AlertArgs;
use crate::config::ConfigFileError;
use crate::ingest::ebpf::EbpfArgs;
use crate::ingest::otlp;
use crate::telemetry::logging::LogArgs;

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// YAML file with a section per component (node, otlp, ebpf, normalize, engine, alert,
    /// admin; every key in docs/config.md); flags given on the command line override it.
    #[arg(long, value_name = "FILE", help_heading = "Configuration")]
    pub config: Option<PathBuf>,
    /// OTLP/gRPC listen address (`off` disables) [default: 127.0.0.1:4317].
    #[arg(long, value_name = "ADDR", help_heading = "OTLP source")]
    pub otlp_grpc: Option<String>,
    /// OTLP/HTTP listen address (`off` disables) [default: 127.0.0.1:4318].
    #[arg(long, value_name = "ADDR", help_heading = "OTLP source")]
    pub otlp_http: Option<String>,
    /// Also record every normalized event, in the replay format `revenant check` reads.
    #[arg(long, value_name = "PATH", help_heading = "Configuration")]
    pub events_jsonl: Option<PathBuf>,
    /// Rules file (YAML) extending or overriding the embedded defaults.
    #[arg(long, value_name = "FILE", help_heading = "Checker")]
    pub rules: Option<PathBuf>,
    /// Bounded channel between sources and checker, in batches [default: 1024].
    #[arg(long, value_name = "N", help_heading = "Capacity")]
    pub channel_capacity: Option<usize>,
    /// Largest OTLP request body in bytes [default: 8388608].
    #[arg(long, value_name = "BYTES", help_heading = "OTLP source")]
    pub max_message_bytes: Option<usize>,
    /// Events from different nodes count as later only beyond this skew [default: 50ms].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration, help_heading = "Checker")]
    pub clock_skew: Option<Duration>,
    /// How late (after its event time) an event may arrive and still count for deadline rules.
    /// OTLP exporters batch for seconds, and SGLang root completions wait out their grace
    /// [default: 15s].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration, help_heading = "Checker")]
    pub allowed_lateness: Option<Duration>,
    /// Memory revenant may use (`512MiB`, `1GiB`, bytes): split among the engine's attempts and
    /// tombstones, the span tree, the event channel and the admin rings, each evicting its oldest
    /// (counted) or refusing at its share [default: 512MiB].
    #[arg(long, value_name = "SIZE", value_parser = crate::config::parse_size, help_heading = "Capacity")]
    pub memory_budget: Option<u64>,
    /// Checkers judging side by side, each on a thread of its own with its share of the memory
    /// budget: 1 to 64, or `auto` (one per core this process may use, at most 8) [default: 1].
    #[arg(long, value_name = "N|auto", help_heading = "Checker")]
    pub engine_shards: Option<crate::config::EngineShards>,
    /// How long shutdown may take to drain queued events through the checker [default: 10s].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration, help_heading = "Configuration")]
    pub drain_timeout: Option<Duration>,
    /// Write the bound addresses as JSON here once every receiver listens (readiness latch for
    /// scripts and tests that bind port 0).
    #[arg(long, value_name = "PATH", help_heading = "Configuration")]
    pub ready_file: Option<PathBuf>,
    /// Testing aid: the checker stops taking batches while this file exists (saturates the
    /// pipeline on purpose to exercise back-pressure).
    #[arg(long, hide = true)]
    pub pause_file: Option<PathBuf>,
    #[command(flatten, next_help_heading = "eBPF source")]
    pub ebpf: EbpfArgs,
    #[command(flatten, next_help_heading = "Admin server")]
    pub admin: AdminArgs,
    #[command(flatten, next_help_heading = "TLS and token (OTLP and admin servers)")]
    pub access: AccessArgs,
    #[command(flatten, next_help_heading = "Alerts")]
    pub alert: AlertArgs,
    #[command(flatten, next_help_heading = "Logs")]
    pub log: LogArgs,
    /// Which of the flags above were given explicitly (set by `main` from the parsed matches).
    #[arg(skip)]
    pub given: Given,
}

/// Why `revenant run` cannot start with this configuration (exit code 2).
#[derive(Debug, thiserror::Error)]
pub enum RunConfigError {
    #[error(transparent)]
    File(#[from] ConfigFileError),
    #[error("--{flag}: {message}, or `off`")]
    Addr { flag: &'static str, message: String },
    #[error(transparent)]
    Otlp(#[from] otlp::config::OtlpConfigError),
    #[error("normalize: {0}")]
    Normalize(#[from] crate::normalize::ConfigError),
    #[error("rules: {0}")]
    Rules(#[from] crate::engine::check::RulesError),
    #[error("checker: {0}")]
    Checker(#[from] crate::engine::check::ConfigError),
    #[error("--memory-budget: {0}")]
    MemoryBudget(#[from] BudgetTooSmall),
    #[error("channel_capacity must be > 0")]
    Capacity,
    #[error("alerting: {0}")]
    Alert(#[from] crate::alert::AlertError),
    #[error("admin: {0}")]
    Admin(#[from] crate::admin::config::AdminConfigError),
    #[error("eBPF: {0}")]
    Ebpf(#[from] crate::ingest::ebpf::LoadError),
    #[error(transparent)]
    Access(#[from] crate::access::AccessError),
    #[error(
        "{given}: this revenant was built without the eBPF source (the `ebpf` cargo feature); \
         use a default build, or --ebpf off|auto"
    )]
    NoEbpfInBuild { given: String },
}

/// The ids of the arguments given explicitly (not from a clap default), so that a flag with a
/// default does not hide the file's value. Filled in by `main` from the parsed matches.
#[derive(Debug, Clone, Default)]
pub struct Given(BTreeSet<String>);

impl Given {
    pub fn from_matches(m: &clap::ArgMatches) -> Given {
        Given(
            m.ids()
                .filter(|id| {
                    matches!(
                        m.value_source(id.as_str()),
                        Some(ValueSource::CommandLine | ValueSource::EnvVariable)
                    )
                })
                .map(|id| id.as_str().to_owned())
                .collect(),
        )
    }

    /// Whether flag `id` (its clap id: `ebpf`, `log_level`) was given on the command line or
    /// through its environment variable.
    pub fn contains(&self, id: &str) -> bool {
        self.0.contains(id)
    }

    /// Whether flag `id` was given. A value other than its default was given too, whether or
    /// not the matches were recorded (arguments built in code).
    pub(super) fn has<T: PartialEq>(&self, id: &str, value: &T, default: &T) -> bool {
        self.0.contains(id) || value != default
    }

    /// Sets `target` to the flag's value when flag `id` was given.
    pub(super) fn set<T: PartialEq + Clone>(
        &self,
        id: &str,
        target: &mut T,
        value: &T,
        default: &T,
    ) {
        if self.has(id, value, default) {
            *target = value.clone();
        }
    }
}
