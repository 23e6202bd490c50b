//! The configuration of `revenant run`: one YAML file (`--config FILE`) with a section per
//! component, flags applied over it (`run::overlay`), everything validated before any port is bound.
//!
//! ```yaml
//! node: { name: node-a, cluster: prod }
//! otlp: { grpc: 127.0.0.1:4317, http: 127.0.0.1:4318 }
//! ebpf: { mode: auto, watch: ["decode=sglang.*decode"] }
//! normalize: { sglang: { completion_grace: 5s } }
//! engine: { clock_skew: 50ms, allowed_lateness: 15s }
//! alert: { webhooks: [{ url: "https://hooks.example/revenant" }] }
//! admin: { addr: 127.0.0.1:9464 }
//! access: { tls: { cert: tls.crt, key: tls.key }, auth_token_file: token }
//! channel_capacity: 1024
//! drain_timeout: 10s
//! ```
//!
//! Unknown keys are errors (a typo never silently keeps a default), reported with the file's
//! line and column. Every key is documented in `docs/config.md`.

use crate::duration;
use crate::node::hostname;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::alert::AlertConfig;
use crate::ingest::ebpf::EbpfOptions;
use crate::ingest::otlp::OtlpConfig;
use crate::normalize::NormalizeConfig;

/// The whole run configuration. Sections are optional; each defaults to what the flags default to.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    #[serde(default)]
    pub node: NodeConfig,
    #[serde(default)]
    pub otlp: OtlpConfig,
    #[serde(default)]
    pub ebpf: EbpfOptions,
    #[serde(default)]
    pub normalize: NormalizeConfig,
    #[serde(default)]
    pub engine: EngineConfig,
    #[serde(default)]
    pub alert: AlertConfig,
    #[serde(default)]
    pub admin: AdminConfig,
    /// TLS and the bearer token for the OTLP receivers and the admin server.
    #[serde(default)]
    pub access: crate::access::AccessConfig,
    /// Cluster mode (`revenant agent`, `revenant checker`): NATS, stream, partitions, batches.
    #[serde(default)]
    pub bus: crate::bus::BusConfig,
    /// Bounded channel between sources and engine, in batches [default: 1024].
    #[serde(default)]
    pub channel_capacity: Option<usize>,
    /// How long shutdown may take to drain queued events through the engine [default: 10s].
    #[serde(default, with = "duration::option")]
    pub drain_timeout: Option<Duration>,
    /// Also record every normalized event here, in the replay format `revenant check` reads.
    #[serde(default)]
    pub events_jsonl: Option<PathBuf>,
    /// Top-level spellings of the `engine` keys (`rules`, `clock_skew`, `allowed_lateness`);
    /// giving a key in both places is an error.
    #[serde(default)]
    rules: Option<PathBuf>,
    #[serde(default, with = "duration::option")]
    clock_skew: Option<Duration>,
    #[serde(default, with = "duration::option")]
    allowed_lateness: Option<Duration>,
    #[serde(default, deserialize_with = "deserialize_size_option")]
    memory_budget: Option<u64>,
}

/// Who this revenant is: the `node` and `cluster` labels of its alerts and the node of the
/// events its eBPF source produces.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// Default: this host's name (`$HOSTNAME`, then the kernel's).
    #[serde(default)]
    pub name: Option<String>,
    /// Default: `default`.
    #[serde(default)]
    pub cluster: Option<String>,
}

/// The engine: rule set and the time bounds of its verdicts. Absent keys take the defaults of
/// the accessors.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// Rules file extending or overriding the embedded defaults.
    pub rules: Option<PathBuf>,
    /// Events from different nodes count as later only beyond this skew [default: 50ms].
    #[serde(with = "duration::option")]
    pub clock_skew: Option<Duration>,
    /// How late (after its event time) an event may arrive and still count for deadline rules
    /// [default: 15s].
    #[serde(with = "duration::option")]
    pub allowed_lateness: Option<Duration>,
    /// Memory the engine's state may use (`512MiB`, `1GiB` or bytes); its caps on live attempts
    /// and tombstones derive from it [default: 512MiB].
    #[serde(deserialize_with = "deserialize_size_option")]
    pub memory_budget: Option<u64>,
    /// How many checkers judge, each on a thread of its own with its share of the memory
    /// budget: a number from 1 to 64, or `auto` (one per core this process may use, at most 8)
    /// [default: 1].
    #[serde(deserialize_with = "deserialize_shards_option")]
    pub shards: Option<EngineShards>,
}

impl EngineConfig {
    pub fn memory_budget(&self) -> u64 {
        self.memory_budget.unwrap_or(DEFAULT_MEMORY_BUDGET)
    }

    pub fn clock_skew(&self) -> Duration {
        self.clock_skew.unwrap_or(DEFAULT_CLOCK_SKEW)
    }

    pub fn allowed_lateness(&self) -> Duration {
        self.allowed_lateness.unwrap_or(DEFAULT_ALLOWED_LATENESS)
    }

    /// The number of checkers, `auto` resolved.
    pub fn shards(&self) -> usize {
        self.shards.unwrap_or_default().count()
    }
}

/// How many checkers judge (`engine.shards`, `--engine-shards`). One checker takes well over
/// a million events per second; shards are for a node whose input comes near that.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineShards {
    /// One per core this process may use (its CPU affinity and cgroup quota), at most
    /// [`EngineShards::AUTO_MAX`].
    Auto,
    Count(usize),
}

impl Default for EngineShards {
    fn default() -> Self {
        EngineShards::Count(1)
    }
}

impl EngineShards {
    pub const MAX: usize = 64;
    pub const AUTO_MAX: usize = 8;

    pub fn count(self) -> usize {
        match self {
            EngineShards::Count(n) => n,
            EngineShards::Auto => std::thread::available_parallelism()
                .map_or(1, usize::from)
                .min(EngineShards::AUTO_MAX),
        }
    }
}

/// Why a shard count cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid shard count `{0}`: expected `auto` or a number from 1 to 64")]
pub struct ShardsError(pub String);

impl std::str::FromStr for EngineShards {
    type Err = ShardsError;

    fn from_str(text: &str) -> Result<EngineShards, ShardsError> {
        let t = text.trim();
        if t == "auto" {
            return Ok(EngineShards::Auto);
        }
        match t.parse::<usize>() {
            Ok(n) if (1..=EngineShards::MAX).contains(&n) => Ok(EngineShards::Count(n)),
            _ => Err(ShardsError(text.into())),
        }
    }
}

fn deserialize_shards_option<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<EngineShards>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Shards {
        Count(u64),
        Text(String),
    }
    match Option::<Shards>::deserialize(d)? {
        None => Ok(None),
        Some(Shards::Count(n)) => n.to_string().parse().map(Some),
        Some(Shards::Text(t)) => t.parse().map(Some),
    }
    .map_err(serde::de::Error::custom)
}

/// The admin server (`/metrics`, `/readyz`, `/api/...`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Listen address; `null` does not start the server (`--no-admin`).
    #[serde(deserialize_with = "crate::addr::deserialize_option")]
    pub addr: Option<SocketAddr>,
    /// `/metrics`, `/healthz`, `/readyz` on an address of their own (plain HTTP, no token).
    #[serde(deserialize_with = "crate::addr::deserialize_option")]
    pub metrics_addr: Option<SocketAddr>,
    /// Violations kept for /api/violations.
    pub recent_violations: usize,
    /// Events kept for /api/requests/{id}.
    pub timeline_events: usize,
    /// A source counts as live in /readyz if it produced an event within this window.
    #[serde(with = "duration")]
    pub source_live_window: Duration,
}

impl Default for AdminConfig {
    fn default() -> Self {
        let a = crate::admin::AdminArgs::default();
        AdminConfig {
            addr: Some(a.admin),
            metrics_addr: None,
            recent_violations: a.recent_violations,
            timeline_events: a.timeline_events,
            source_live_window: a.source_live_window,
        }
    }
}

pub const DEFAULT_CHANNEL_CAPACITY: usize = 1024;
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// A DaemonSet's usual limit leaves room for this with the receivers' buffers: about 570k live
/// attempts and 1.2M tombstones, minutes of never-ending attempts at thousands per second.
pub const DEFAULT_MEMORY_BUDGET: u64 = 512 << 20;

/// Why a size (`512MiB`, `1GiB`, `4096`) cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid size `{0}`: expected bytes or a number with KiB, MiB, GiB (or KB, MB, GB)")]
pub struct SizeError(pub String);

/// Parses a size in bytes: a plain number, or one with a binary (`KiB`, `MiB`, `GiB`) or decimal
/// (`KB`, `MB`, `GB`) unit.
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| SizeError(text.into()))?;
    let mul: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" | "Ki" | "K" => 1 << 10,
        "MiB" | "Mi" | "M" => 1 << 20,
        "GiB" | "Gi" | "G" => 1 << 30,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        _ => return Err(SizeError(text.into())),
    };
    n.checked_mul(mul).ok_or_else(|| SizeError(text.into()))
}

fn deserialize_size_option<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Bytes(u64),
        Text(String),
    }
    match Option::<Size>::deserialize(d)? {
        None => Ok(None),
        Some(Size::Bytes(n)) => Ok(Some(n)),
        Some(Size::Text(t)) => parse_size(&t).map(Some).map_err(serde::de::Error::custom),
    }
}

pub const DEFAULT_CLOCK_SKEW: Duration = Duration::from_millis(50);
/// Python's BatchSpanProcessor flushes every 5 s; SGLang root completions wait 5 s more.
pub const DEFAULT_ALLOWED_LATENESS: Duration = Duration::from_secs(15);

/// Why a config file cannot be used. Nothing is bound when one is returned.
#[derive(Debug, thiserror::Error)]
pub enum ConfigFileError {
    #[error("reading config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// `line`/`column` (1-based) when the parser knows where.
    #[error("config {path}: {msg}")]
    Parse {
        path: PathBuf,
        line: Option<u64>,
        column: Option<u64>,
        msg: String,
    },
    #[error("config {path}: `{key}` is given both at the top level and in `engine`")]
    Duplicate { path: PathBuf, key: &'static str },
}

impl RunConfig {
    /// Parses a config file's text; `path` names it in errors.
    pub fn from_yaml(path: &Path, text: &str) -> Result<RunConfig, ConfigFileError> {
        let mut cfg: RunConfig = serde_saphyr::from_str(text).map_err(|e| {
            let at = e.location();
            ConfigFileError::Parse {
                path: path.into(),
                line: at.map(|l| l.line()),
                column: at.map(|l| l.column()),
                msg: crate::engine::rules::parse_message(
                    &e.to_string(),
                    &path.display().to_string(),
                ),
            }
        })?;
        cfg.fold_top_level_engine_keys(path)?;
        Ok(cfg)
    }

    /// Reads `path`; `None` is the default configuration.
    pub fn load(path: Option<&Path>) -> Result<RunConfig, ConfigFileError> {
        let Some(path) = path else {
            return Ok(RunConfig::default());
        };
        let text = std::fs::read_to_string(path).map_err(|source| ConfigFileError::Read {
            path: path.into(),
            source,
        })?;
        RunConfig::from_yaml(path, &text)
    }

    fn fold_top_level_engine_keys(&mut self, path: &Path) -> Result<(), ConfigFileError> {
        fn fold<T>(
            top: &mut Option<T>,
            engine: &mut Option<T>,
            key: &'static str,
            path: &Path,
        ) -> Result<(), ConfigFileError> {
            if let Some(v) = top.take() {
                if engine.is_some() {
                    return Err(ConfigFileError::Duplicate {
                        path: path.into(),
                        key,
                    });
                }
                *engine = Some(v);
            }
            Ok(())
        }
        fold(&mut self.rules, &mut self.engine.rules, "rules", path)?;
        fold(
            &mut self.clock_skew,
            &mut self.engine.clock_skew,
            "clock_skew",
            path,
        )?;
        fold(
            &mut self.allowed_lateness,
            &mut self.engine.allowed_lateness,
            "allowed_lateness",
            path,
        )?;
        fold(
            &mut self.memory_budget,
            &mut self.engine.memory_budget,
            "memory_budget",
            path,
        )
    }

    pub fn channel_capacity(&self) -> usize {
        self.channel_capacity.unwrap_or(DEFAULT_CHANNEL_CAPACITY)
    }

    pub fn drain_timeout(&self) -> Duration {
        self.drain_timeout.unwrap_or(DEFAULT_DRAIN_TIMEOUT)
    }

    /// This node's name: the `node` section, else the host name.
    pub fn node_name(&self) -> String {
        self.node.name.clone().unwrap_or_else(hostname)
    }
}

#[cfg(test)]
mod tests;
