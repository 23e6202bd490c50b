//! Alert delivery: violations → incidents (one per client request within the group wait), dedup
//! and flood control → durable spool → sinks (webhook, Alertmanager, JSON Lines), at least once.
//!
//! Wiring (what `revenant run` does): `AlertArgs::to_config()` (validates, binds nothing) →
//! `AlertPipeline::start(cfg, metrics, readiness, recent)` → send violations into the returned
//! `mpsc::Sender<Violation>` with [`offer`] → drop the sender and await the handle to drain.

pub mod alertmanager;
pub mod dispatcher;
pub mod flood;
pub mod jsonl;
pub mod notification;
pub mod sink;
pub mod spool;
pub mod webhook;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

pub use alertmanager::{AlertmanagerConfig, AlertmanagerSink};
pub use dispatcher::{DispatchConfig, DispatchReport, Dispatcher};
pub use flood::FloodConfig;
pub use jsonl::{JsonlConfig, JsonlSink};
pub use notification::{IncidentAlert, LinkBase, Notification};
pub use sink::{Sink, SinkError};
pub use spool::{Spool, SpoolConfig};
pub use webhook::{WebhookConfig, WebhookSink};

use crate::telemetry::events::ItemsDropped;
use crate::telemetry::metrics::{DropPoint, DropReason, Metrics};
use crate::telemetry::{ComponentKind, Readiness, RecentViolations};
use crate::violation::Violation;

/// The whole alerting configuration (YAML via `--alert-config`, or built from flags).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlertConfig {
    pub webhooks: Vec<WebhookConfig>,
    pub alertmanagers: Vec<AlertmanagerConfig>,
    pub jsonl: Option<JsonlConfig>,
    pub spool: SpoolConfig,
    pub flood: FloodConfig,
    /// Base URL of the admin server as readers of the alerts reach it (for timeline links).
    pub external_url: Option<String>,
    /// `cluster` label on Alertmanager alerts.
    pub cluster: String,
    /// `node` label when a violation names no worker; default: this host's name.
    pub node: Option<String>,
    /// Capacity of the violation channel into the dispatcher.
    pub channel_capacity: usize,
    /// First retry delay after a failed delivery (doubles up to `retry_max`, with jitter).
    #[serde(with = "flood::humantime_serde_compat")]
    pub retry_initial: Duration,
    #[serde(with = "flood::humantime_serde_compat")]
    pub retry_max: Duration,
    /// On shutdown, how long to keep delivering; what is left stays spooled for the next start.
    #[serde(with = "flood::humantime_serde_compat")]
    pub drain_timeout: Duration,
}

impl Default for AlertConfig {
    fn default() -> Self {
        AlertConfig {
            webhooks: vec![],
            alertmanagers: vec![],
            jsonl: None,
            spool: SpoolConfig::default(),
            flood: FloodConfig::default(),
            external_url: None,
            cluster: "default".into(),
            node: None,
            channel_capacity: 4096,
            retry_initial: Duration::from_millis(500),
            retry_max: Duration::from_secs(30),
            drain_timeout: Duration::from_secs(5),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AlertError {
    #[error("invalid alert configuration: {0}")]
    Config(String),
    #[error("alert config file {path}: {message}")]
    File { path: PathBuf, message: String },
    #[error(transparent)]
    Spool(#[from] spool::SpoolError),
}

impl AlertConfig {
    pub fn from_yaml(text: &str) -> Result<AlertConfig, String> {
        serde_saphyr::from_str(text).map_err(|e| e.to_string())
    }

    /// Checks everything that can be checked without binding or connecting.
    pub fn validate(&self) -> Result<(), AlertError> {
        let c = |e: String| AlertError::Config(e);
        for w in &self.webhooks {
            w.validate().map_err(c)?;
            w.resolve_secret().map_err(c)?;
        }
        for a in &self.alertmanagers {
            a.validate().map_err(c)?;
        }
        if let Some(j) = &self.jsonl {
            j.validate().map_err(c)?;
        }
        self.spool.validate().map_err(c)?;
        self.flood.validate().map_err(c)?;
        if let Some(u) = &self.external_url {
            let p = reqwest::Url::parse(u).map_err(|e| c(format!("external_url {u:?}: {e}")))?;
            if !matches!(p.scheme(), "http" | "https") {
                return Err(c(format!(
                    "external_url {u:?}: scheme must be http or https"
                )));
            }
        }
        if self.retry_initial.is_zero() || self.retry_max < self.retry_initial {
            return Err(c("retry_initial must be > 0 and <= retry_max".into()));
        }
        if self.channel_capacity == 0 {
            return Err(c("channel_capacity must be > 0".into()));
        }
        Ok(())
    }

    pub fn node_name(&self) -> String {
        self.node.clone().unwrap_or_else(hostname)
    }

    /// Builds the sinks (no network I/O: HTTP clients connect lazily). Names: `webhook-<i>`,
    /// `alertmanager-<i>`, `jsonl`.
    pub fn build_sinks(&self) -> Result<Vec<Arc<dyn Sink>>, AlertError> {
        let c = |e: String| AlertError::Config(e);
        let mut sinks: Vec<Arc<dyn Sink>> = Vec::new();
        for (i, w) in self.webhooks.iter().enumerate() {
            sinks.push(Arc::new(
                WebhookSink::new(format!("webhook-{i}"), w).map_err(c)?,
            ));
        }
        let node = self.node_name();
        for (i, a) in self.alertmanagers.iter().enumerate() {
            sinks.push(Arc::new(
                AlertmanagerSink::new(format!("alertmanager-{i}"), a, &node, &self.cluster)
                    .map_err(c)?,
            ));
        }
        if let Some(j) = &self.jsonl {
            sinks.push(Arc::new(JsonlSink::new("jsonl", j).map_err(c)?));
        }
        Ok(sinks)
    }
}

fn hostname() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|s| s.trim().to_string())
        })
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// Alerting flags for `revenant run` (`#[command(flatten)]`). Flags add to `--alert-config`.
#[derive(Debug, Clone, Default, Args)]
pub struct AlertArgs {
    /// YAML file with the full alerting configuration (webhooks, alertmanagers, jsonl, spool,
    /// flood); the flags below add to it or override it.
    #[arg(long, value_name = "FILE")]
    pub alert_config: Option<PathBuf>,
    /// POST alerts as JSON to this URL (repeatable).
    #[arg(long = "webhook", value_name = "URL")]
    pub webhooks: Vec<String>,
    /// File holding the HMAC-SHA256 key for webhook signatures (applies to --webhook URLs).
    #[arg(long, value_name = "FILE", env = "REVENANT_WEBHOOK_SECRET_FILE")]
    pub webhook_secret_file: Option<PathBuf>,
    /// Send alerts to this Alertmanager (base URL, repeatable).
    #[arg(long = "alertmanager", value_name = "URL")]
    pub alertmanagers: Vec<String>,
    /// Re-post active alerts to Alertmanager this often.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub alertmanager_resend: Option<Duration>,
    /// Append alerts as JSON Lines to this file; `-` for standard output.
    #[arg(long, value_name = "PATH")]
    pub alerts_jsonl: Option<PathBuf>,
    /// Durable alert spool directory [default: <state dir>/spool, state dir from
    /// $STATE_DIRECTORY, $XDG_STATE_HOME/revenant, ~/.local/state/revenant or /var/lib/revenant].
    #[arg(long, value_name = "DIR")]
    pub spool_dir: Option<PathBuf>,
    /// Most notifications kept in the spool; beyond it new ones are dropped (counted).
    #[arg(long, value_name = "N")]
    pub spool_max_entries: Option<usize>,
    /// Do not fsync spool entries (survives a crash of revenant, not of the machine).
    #[arg(long)]
    pub spool_no_fsync: bool,
    /// An incident notified within this window is not notified again for later findings of the
    /// same request (merged into it), unless one raises its severity [default: 5m].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub dedup_window: Option<Duration>,
    /// Incident notifications per lead rule per --rate-limit-window, 0 = unlimited [default: 50].
    #[arg(long, value_name = "N")]
    pub rate_limit: Option<u32>,
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub rate_limit_window: Option<Duration>,
    /// Hold a first notification up to this long while two or more sources are live, so that
    /// the other source's confirmation is merged into it (one alert showing both sources);
    /// 0 sends at once [default: 0]. Costs that much latency on alerts only one source sees.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub corroboration_window: Option<Duration>,
    /// Wait this long after a request's first finding for its other findings (other rules
    /// firing on the same breach), so that one notification lists them all; 0 = no grouping:
    /// one notification per rule and request, sent at once [default: 2s].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub group_wait: Option<Duration>,
    /// Base URL of the admin server for links in alerts [default: http://<--admin>].
    #[arg(long, value_name = "URL")]
    pub external_url: Option<String>,
    /// `cluster` label on alerts.
    #[arg(long, value_name = "NAME")]
    pub cluster: Option<String>,
    /// `node` label on alerts [default: host name].
    #[arg(long, value_name = "NAME")]
    pub node: Option<String>,
}

impl AlertArgs {
    /// Loads `--alert-config`, applies the flags, validates. `default_external_url` is the admin
    /// server's URL, used for links when no `--external-url` is given.
    pub fn to_config(
        &self,
        default_external_url: Option<String>,
    ) -> Result<AlertConfig, AlertError> {
        let mut cfg = match &self.alert_config {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|e| AlertError::File {
                    path: p.clone(),
                    message: e.to_string(),
                })?;
                AlertConfig::from_yaml(&text).map_err(|message| AlertError::File {
                    path: p.clone(),
                    message,
                })?
            }
            None => AlertConfig::default(),
        };
        for u in &self.webhooks {
            let mut w = WebhookConfig::new(u.clone());
            w.secret_file = self.webhook_secret_file.clone();
            cfg.webhooks.push(w);
        }
        for u in &self.alertmanagers {
            let mut a = AlertmanagerConfig::new(u.clone());
            if let Some(r) = self.alertmanager_resend {
                a.resend_interval = r;
            }
            cfg.alertmanagers.push(a);
        }
        if let Some(p) = &self.alerts_jsonl {
            cfg.jsonl = Some(JsonlConfig { path: p.clone() });
        }
        if let Some(d) = &self.spool_dir {
            cfg.spool.dir = Some(d.clone());
        }
        if let Some(n) = self.spool_max_entries {
            cfg.spool.max_entries = n;
        }
        if self.spool_no_fsync {
            cfg.spool.fsync = false;
        }
        if let Some(d) = self.dedup_window {
            cfg.flood.dedup_window = d;
        }
        if let Some(n) = self.rate_limit {
            cfg.flood.rate_limit = n;
        }
        if let Some(d) = self.rate_limit_window {
            cfg.flood.rate_limit_window = d;
        }
        if let Some(d) = self.corroboration_window {
            cfg.flood.corroboration_window = d;
        }
        if let Some(d) = self.group_wait {
            cfg.flood.group_wait = d;
        }
        if let Some(u) = &self.external_url {
            cfg.external_url = Some(u.clone());
        } else if cfg.external_url.is_none() {
            cfg.external_url = default_external_url;
        }
        if let Some(c) = &self.cluster {
            cfg.cluster = c.clone();
        }
        if let Some(n) = &self.node {
            cfg.node = Some(n.clone());
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

/// A running dispatcher.
pub struct AlertPipeline {
    pub sender: mpsc::Sender<Violation>,
    pub handle: JoinHandle<DispatchReport>,
    pub spool_dir: PathBuf,
}

impl AlertPipeline {
    /// Opens the spool (resuming what it holds), builds the sinks and spawns the dispatcher.
    /// Must run inside a tokio runtime.
    pub fn start(
        cfg: &AlertConfig,
        metrics: Arc<Metrics>,
        readiness: Option<&Readiness>,
        recent: Option<Arc<RecentViolations>>,
    ) -> Result<AlertPipeline, AlertError> {
        cfg.validate()?;
        let sinks = cfg.build_sinks()?;
        let handles: Vec<_> = readiness
            .map(|r| {
                sinks
                    .iter()
                    .map(|s| r.register(s.name().to_string(), ComponentKind::Sink))
                    .collect()
            })
            .unwrap_or_default();
        let names: Vec<String> = sinks.iter().map(|s| s.name().to_string()).collect();
        let (spool, rec) = Spool::open(&cfg.spool, &names)?;
        if rec.corrupt > 0 {
            ItemsDropped {
                point: DropPoint::Spool,
                reason: DropReason::Corrupt,
                count: rec.corrupt as u64,
            }
            .emit(&metrics);
        }
        if rec.orphaned_acks > 0 {
            ItemsDropped {
                point: DropPoint::Spool,
                reason: DropReason::SinkRemoved,
                count: rec.orphaned_acks as u64,
            }
            .emit(&metrics);
        }
        if rec.entries > 0 {
            tracing::info!(entries = rec.entries, dir = %spool.dir().display(), "resuming alert delivery from the spool");
        }
        let spool_dir = spool.dir().to_path_buf();
        let mut d = Dispatcher::new(
            DispatchConfig {
                retry_initial: cfg.retry_initial,
                retry_max: cfg.retry_max,
                drain_timeout: cfg.drain_timeout,
                ..DispatchConfig::default()
            },
            cfg.flood.clone(),
            LinkBase(cfg.external_url.clone()),
            spool,
            sinks,
            metrics,
        );
        if let Some(r) = recent {
            d = d.with_recent(r);
        }
        if let Some(r) = readiness {
            d = d.with_readiness(r.clone());
        }
        let (tx, rx) = mpsc::channel(cfg.channel_capacity);
        let handle = tokio::spawn(d.run(rx));
        // Sinks are usable once built: their receivers may be down, which the spool absorbs.
        for h in handles {
            h.ready();
        }
        Ok(AlertPipeline {
            sender: tx,
            handle,
            spool_dir,
        })
    }
}

/// Hands a violation to the dispatcher without ever blocking the checker; a full channel is a
/// counted drop (`revenant_dropped_items_total{point="violation_channel"}`).
pub fn offer(tx: &mpsc::Sender<Violation>, v: Violation, metrics: &Metrics) -> bool {
    match tx.try_send(v) {
        Ok(()) => true,
        Err(mpsc::error::TrySendError::Full(_)) => {
            ItemsDropped {
                point: DropPoint::ViolationChannel,
                reason: DropReason::Full,
                count: 1,
            }
            .emit(metrics);
            false
        }
        Err(mpsc::error::TrySendError::Closed(_)) => {
            ItemsDropped {
                point: DropPoint::ViolationChannel,
                reason: DropReason::Closed,
                count: 1,
            }
            .emit(metrics);
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_config_rejects_unknown_fields_and_bad_values() {
        let ok = AlertConfig::from_yaml(
            "webhooks:\n  - url: https://hooks.example/revenant\n    secret: s\n    timeout: 3s\nalertmanagers:\n  - url: http://127.0.0.1:9093\n    resend_interval: 30s\nspool:\n  max_entries: 100\nflood:\n  dedup_window: 10m\n  rate_limit: 5\n",
        )
        .unwrap();
        ok.validate().unwrap();
        assert_eq!(ok.webhooks[0].timeout, Duration::from_secs(3));
        assert_eq!(ok.flood.dedup_window, Duration::from_secs(600));
        assert_eq!(ok.flood.group_wait, flood::DEFAULT_GROUP_WAIT);
        let gw = AlertConfig::from_yaml("flood:\n  group_wait: 500ms\n").unwrap();
        assert_eq!(gw.flood.group_wait, Duration::from_millis(500));
        let e = AlertConfig::from_yaml("flood:\n  group_wait: 1h\n")
            .unwrap()
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("group_wait"), "{e}");
        assert_eq!(ok.spool.max_entries, 100);
        assert!(ok.spool.fsync, "fsync stays on by default");

        let e = AlertConfig::from_yaml("webhook: []\n").unwrap_err();
        assert!(e.contains("webhook"), "{e}");
        let e = AlertConfig::from_yaml("flood:\n  dedup_window: soon\n").unwrap_err();
        assert!(
            e.contains("soon") || e.contains("duration") || e.contains("unknown"),
            "{e}"
        );
        let bad = AlertConfig {
            alertmanagers: vec![AlertmanagerConfig::new("gopher://x")],
            ..AlertConfig::default()
        };
        assert!(bad.validate().unwrap_err().to_string().contains("scheme"));
        let bad = AlertConfig {
            spool: SpoolConfig {
                max_entries: 0,
                ..SpoolConfig::default()
            },
            ..AlertConfig::default()
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn flags_add_to_the_file_and_missing_secret_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("alerts.yaml");
        std::fs::write(
            &file,
            "webhooks:\n  - url: http://127.0.0.1:1/a\ncluster: prod\n",
        )
        .unwrap();
        let args = AlertArgs {
            alert_config: Some(file.clone()),
            webhooks: vec!["http://127.0.0.1:1/b".into()],
            alerts_jsonl: Some("-".into()),
            dedup_window: Some(Duration::from_secs(60)),
            group_wait: Some(Duration::ZERO),
            ..AlertArgs::default()
        };
        let cfg = args
            .to_config(Some("http://127.0.0.1:9464".into()))
            .unwrap();
        assert_eq!(cfg.webhooks.len(), 2);
        assert_eq!(cfg.cluster, "prod");
        assert_eq!(
            cfg.flood.group_wait,
            Duration::ZERO,
            "--group-wait 0 turns grouping off"
        );
        assert_eq!(cfg.external_url.as_deref(), Some("http://127.0.0.1:9464"));
        assert_eq!(
            cfg.build_sinks()
                .unwrap()
                .iter()
                .map(|s| s.name().to_string())
                .collect::<Vec<_>>(),
            ["webhook-0", "webhook-1", "jsonl"]
        );
        let args = AlertArgs {
            webhooks: vec!["http://127.0.0.1:1/b".into()],
            webhook_secret_file: Some(dir.path().join("missing")),
            ..AlertArgs::default()
        };
        assert!(
            args.to_config(None)
                .unwrap_err()
                .to_string()
                .contains("missing")
        );
        std::fs::write(&file, "webhooks: [{url: x, bogus: 1}]\n").unwrap();
        let args = AlertArgs {
            alert_config: Some(file),
            ..AlertArgs::default()
        };
        let e = args.to_config(None).unwrap_err().to_string();
        assert!(e.contains("bogus"), "{e}");
    }
}
