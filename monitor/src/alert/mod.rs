//! Alert delivery: violations → incidents (one per client request within the group wait), dedup
//! and flood control → durable spool → sinks (webhook, Alertmanager, JSON Lines), at least once.
//!
//! Wiring (what `revenant run` does): the run config's `alert` section (or `--alert-config`) with
//! the flags applied ([`AlertArgs::apply`]) and validated, binding nothing →
//! `OpenedAlerts::open(cfg)` (sinks built, spool locked and read back; before any port is bound)
//! → `.start(cfg, metrics, readiness, recent)` (or `AlertPipeline::start`, both at once) → send violations into the returned
//! `mpsc::Sender<Violation>` with [`offer`] → drop the sender and await the handle to drain.

pub mod alertmanager;
pub mod args;
pub mod claims;
pub mod dispatcher;
pub mod events;
pub mod flood;
pub mod jsonl;
pub mod notification;
pub mod sink;
pub mod spool;
pub mod webhook;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

pub use alertmanager::{AlertmanagerConfig, AlertmanagerSink};
pub use args::AlertArgs;
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
    /// `cluster` label on Alertmanager alerts. `revenant run` sets it from the run config's
    /// `node` section; a value here (from `--alert-config`) is read when that section has none.
    pub cluster: String,
    /// `node` label when a violation names no worker; default: this host's name. `revenant run`
    /// sets it from the run config's `node` section, as `cluster`.
    pub node: Option<String>,
    /// Capacity of the violation channel into the dispatcher.
    pub channel_capacity: usize,
    /// First retry delay after a failed delivery (doubles up to `retry_max`, with jitter).
    #[serde(with = "crate::duration")]
    pub retry_initial: Duration,
    #[serde(with = "crate::duration")]
    pub retry_max: Duration,
    /// On shutdown, how long to keep delivering; what is left stays spooled for the next start.
    #[serde(with = "crate::duration")]
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
    /// A check of the alert section itself (external_url, retry, channel capacity).
    #[error("invalid alert configuration: {0}")]
    Config(String),
    #[error("invalid alert configuration: {0}")]
    WebhookSink(#[from] webhook::WebhookSinkError),
    #[error("invalid alert configuration: {0}")]
    AlertmanagerSink(#[from] alertmanager::AlertmanagerSinkError),
    #[error("invalid alert configuration: {0}")]
    JsonlSink(#[from] jsonl::JsonlSinkError),
    #[error("alert config file {}: {source}", .path.display())]
    Parse {
        path: PathBuf,
        source: Box<serde_saphyr::Error>,
    },
    #[error("invalid alert configuration: {0}")]
    Webhook(#[from] webhook::WebhookConfigError),
    #[error("invalid alert configuration: {0}")]
    Alertmanager(#[from] alertmanager::AlertmanagerConfigError),
    #[error("invalid alert configuration: {0}")]
    Jsonl(#[from] jsonl::JsonlConfigError),
    #[error("invalid alert configuration: {0}")]
    SpoolConfig(#[from] spool::SpoolConfigError),
    #[error("invalid alert configuration: {0}")]
    Flood(#[from] flood::FloodConfigError),
    #[error("alert config file {path}: {message}")]
    File { path: PathBuf, message: String },
    #[error(transparent)]
    Spool(#[from] spool::SpoolError),
}

impl AlertConfig {
    pub fn from_yaml(text: &str) -> Result<AlertConfig, Box<serde_saphyr::Error>> {
        serde_saphyr::from_str(text).map_err(Box::new)
    }

    /// Checks everything that can be checked without binding or connecting.
    pub fn validate(&self) -> Result<(), AlertError> {
        let c = |e: String| AlertError::Config(e);
        for w in &self.webhooks {
            w.validate()?;
            w.resolve_secret()?;
        }
        for a in &self.alertmanagers {
            a.validate()?;
        }
        if let Some(j) = &self.jsonl {
            j.validate()?;
        }
        self.spool.validate()?;
        self.flood.validate()?;
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
        self.node.clone().unwrap_or_else(crate::node::hostname)
    }

    /// Builds the sinks (no network I/O: HTTP clients connect lazily). Names (the `sink` metric
    /// label): `webhook-<i>`, `alertmanager-<i>`, `jsonl`; spool identities: [`sink_identities`].
    pub fn build_sinks(&self) -> Result<Vec<Arc<dyn Sink>>, AlertError> {
        let sinks = self.build_sinks_by_position()?;
        Ok(sinks
            .into_iter()
            .zip(sink_identities(self))
            .map(|(inner, identity)| Arc::new(Identified { inner, identity }) as Arc<dyn Sink>)
            .collect())
    }

    fn build_sinks_by_position(&self) -> Result<Vec<Arc<dyn Sink>>, AlertError> {
        let mut sinks: Vec<Arc<dyn Sink>> = Vec::new();
        for (i, w) in self.webhooks.iter().enumerate() {
            sinks.push(Arc::new(WebhookSink::new(format!("webhook-{i}"), w)?));
        }
        let node = self.node_name();
        for (i, a) in self.alertmanagers.iter().enumerate() {
            sinks.push(Arc::new(AlertmanagerSink::new(
                format!("alertmanager-{i}"),
                a,
                &node,
                &self.cluster,
            )?));
        }
        if let Some(j) = &self.jsonl {
            sinks.push(Arc::new(JsonlSink::new("jsonl", j)?));
        }
        Ok(sinks)
    }
}

/// The spool identity of each sink `build_sinks` builds, in the same order: the kind and a
/// digest of the destination, `webhook:<16 hex>` (SHA-256 of the URL), `alertmanager:<16 hex>`,
/// `jsonl:<path>` (`jsonl:-` for standard output). A digest rather than the URL because webhook
/// URLs often carry their token. The same destination configured twice gets `#2`, `#3`, ….
/// Reordering sinks or adding one keeps what is pending routed to the same destination; changing
/// a URL makes it another sink (what was pending for the old one is re-routed, see
/// [`spool`]).
pub fn sink_identities(cfg: &AlertConfig) -> Vec<String> {
    use sha2::Digest;
    let digest = |kind: &str, url: &str| {
        let h = sha2::Sha256::digest(url.as_bytes());
        let hex: String = h.iter().take(8).map(|b| format!("{b:02x}")).collect();
        format!("{kind}:{hex}")
    };
    let mut out: Vec<String> = Vec::new();
    let mut push = |id: String| {
        let n = out
            .iter()
            .filter(|o| o.split('#').next() == Some(&id))
            .count();
        out.push(if n == 0 {
            id
        } else {
            format!("{id}#{}", n + 1)
        });
    };
    for w in &cfg.webhooks {
        push(digest("webhook", &w.url));
    }
    for a in &cfg.alertmanagers {
        push(digest("alertmanager", &a.url));
    }
    if let Some(j) = &cfg.jsonl {
        push(format!("jsonl:{}", j.path.display()));
    }
    out
}

/// A sink under its spool identity.
struct Identified {
    inner: Arc<dyn Sink>,
    identity: String,
}

impl Sink for Identified {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn identity(&self) -> &str {
        &self.identity
    }
    fn max_batch(&self) -> usize {
        self.inner.max_batch()
    }
    fn deliver<'a>(
        &'a self,
        batch: &'a [Arc<Notification>],
    ) -> sink::BoxFuture<'a, Result<(), SinkError>> {
        self.inner.deliver(batch)
    }
    fn refresh_interval(&self) -> Option<Duration> {
        self.inner.refresh_interval()
    }
    fn refresh<'a>(
        &'a self,
        active: &'a [flood::ActiveAlert],
        resolved: &'a [flood::ActiveAlert],
    ) -> sink::BoxFuture<'a, Result<(), SinkError>> {
        self.inner.refresh(active, resolved)
    }
}

/// A running dispatcher.
pub struct AlertPipeline {
    pub sender: mpsc::Sender<Violation>,
    pub handle: JoinHandle<DispatchReport>,
    pub spool_dir: PathBuf,
}

/// The sinks built and the spool opened (its lock held, what it holds read back), nothing
/// spawned: what `revenant run` sets up before it binds a port, so that a spool held by another
/// instance or a sink file that cannot be opened fails before anything listens.
pub struct OpenedAlerts {
    sinks: Vec<Arc<dyn Sink>>,
    spool: Spool,
    recovered: spool::Recovered,
    claims: Option<Arc<dyn claims::NotificationClaims>>,
}

impl OpenedAlerts {
    /// Validates `cfg`, builds its sinks and opens (locks, creating) the spool.
    pub fn open(cfg: &AlertConfig) -> Result<OpenedAlerts, AlertError> {
        cfg.validate()?;
        let sinks = cfg.build_sinks()?;
        let names: Vec<String> = sinks.iter().map(|s| s.identity().to_string()).collect();
        let (spool, recovered) = Spool::open(&cfg.spool, &names)?;
        Ok(OpenedAlerts {
            sinks,
            spool,
            recovered,
            claims: None,
        })
    }

    /// Notifications another process may have sent already are not sent again
    /// ([`claims::NotificationClaims`]).
    pub fn with_claims(mut self, claims: Arc<dyn claims::NotificationClaims>) -> OpenedAlerts {
        self.claims = Some(claims);
        self
    }

    pub fn spool_dir(&self) -> &std::path::Path {
        self.spool.dir()
    }

    /// Spawns the dispatcher over what [`OpenedAlerts::open`] built; `cfg` gives the delivery
    /// settings and the base of alert links (`external_url`).
    pub fn start(
        self,
        cfg: &AlertConfig,
        metrics: Arc<Metrics>,
        readiness: Option<&Readiness>,
        recent: Option<Arc<RecentViolations>>,
    ) -> AlertPipeline {
        let OpenedAlerts {
            sinks,
            spool,
            recovered: rec,
            claims,
        } = self;
        let handles: Vec<_> = readiness
            .map(|r| {
                sinks
                    .iter()
                    .map(|s| r.register(s.name().to_string(), ComponentKind::Sink))
                    .collect()
            })
            .unwrap_or_default();
        if rec.corrupt > 0 {
            ItemsDropped {
                point: DropPoint::Spool,
                reason: DropReason::Corrupt,
                count: rec.corrupt as u64,
            }
            .emit(&metrics);
        }
        if rec.discarded > 0 {
            tracing::error!(
                count = rec.discarded,
                dir = %spool.dir().display(),
                "discarding alerts pending for sinks no longer configured (--spool-discard-removed-sinks)"
            );
            ItemsDropped {
                point: DropPoint::Spool,
                reason: DropReason::SinkRemoved,
                count: rec.discarded as u64,
            }
            .emit(&metrics);
        }
        if rec.rerouted > 0 {
            tracing::warn!(
                count = rec.rerouted,
                dir = %spool.dir().display(),
                "alerts pending for sinks no longer configured are re-routed to the sinks configured now"
            );
        }
        if rec.stranded > 0 {
            tracing::error!(
                count = rec.stranded,
                dir = %spool.dir().display(),
                "alerts pending for sinks no longer configured, and no sink to take them: kept in the spool \
                 until one is configured (or --spool-discard-removed-sinks drops them)"
            );
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
        d = d.with_spool_discarded(rec.discarded as u64);
        if let Some(r) = recent {
            d = d.with_recent(r);
        }
        if let Some(r) = readiness {
            d = d.with_readiness(r.clone());
        }
        if let Some(c) = claims {
            d = d.with_claims(c);
        }
        let (tx, rx) = mpsc::channel(cfg.channel_capacity);
        let handle = tokio::spawn(d.run(rx));
        // Sinks are usable once built: their receivers may be down, which the spool absorbs.
        for h in handles {
            h.ready();
        }
        AlertPipeline {
            sender: tx,
            handle,
            spool_dir,
        }
    }
}

impl AlertPipeline {
    /// Opens the spool (resuming what it holds), builds the sinks and spawns the dispatcher.
    pub fn start(
        cfg: &AlertConfig,
        metrics: Arc<Metrics>,
        readiness: Option<&Readiness>,
        recent: Option<Arc<RecentViolations>>,
    ) -> Result<AlertPipeline, AlertError> {
        Ok(OpenedAlerts::open(cfg)?.start(cfg, metrics, readiness, recent))
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
        assert!(
            matches!(
                e,
                AlertError::Flood(flood::FloodConfigError::GroupWait { value })
                    if value == Duration::from_secs(3600)
            ),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "invalid alert configuration: group_wait 1h delays every alert by that much: at most 10m"
        );
        assert_eq!(ok.spool.max_entries, 100);
        assert!(ok.spool.fsync, "fsync stays on by default");

        let e = AlertConfig::from_yaml("webhook: []\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("webhook"), "{e}");
        let e = AlertConfig::from_yaml("flood:\n  dedup_window: soon\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("soon") || e.contains("duration") || e.contains("unknown"),
            "{e}"
        );
        let bad = AlertConfig {
            alertmanagers: vec![AlertmanagerConfig::new("gopher://x")],
            ..AlertConfig::default()
        };
        let e = bad.validate().unwrap_err();
        assert!(
            matches!(
                &e,
                AlertError::Alertmanager(alertmanager::AlertmanagerConfigError::Scheme { url })
                    if url == "gopher://x"
            ),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            r#"invalid alert configuration: alertmanager url "gopher://x": scheme must be http or https"#
        );
        let bad = AlertConfig {
            spool: SpoolConfig {
                max_entries: 0,
                ..SpoolConfig::default()
            },
            ..AlertConfig::default()
        };
        let e = bad.validate().unwrap_err();
        assert!(
            matches!(
                e,
                AlertError::SpoolConfig(spool::SpoolConfigError::ZeroMaxEntries)
            ),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "invalid alert configuration: spool max_entries must be > 0"
        );
    }

    #[test]
    fn sink_config_errors_are_typed_and_keep_their_messages() {
        use alertmanager::AlertmanagerConfigError;
        let e = AlertmanagerConfig {
            resend_interval: Duration::from_millis(500),
            ..AlertmanagerConfig::new("http://127.0.0.1:9093")
        }
        .validate()
        .unwrap_err();
        assert_eq!(
            e,
            AlertmanagerConfigError::ResendInterval {
                value: Duration::from_millis(500)
            }
        );
        assert_eq!(
            e.to_string(),
            "alertmanager resend_interval must be at least 1s"
        );
        let e = AlertmanagerConfig::new("::").validate().unwrap_err();
        assert!(
            matches!(&e, AlertmanagerConfigError::Url { url, .. } if url == "::"),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            r#"alertmanager url "::": relative URL without a base"#
        );
        let e = AlertmanagerConfig {
            timeout: Duration::ZERO,
            ..AlertmanagerConfig::new("http://127.0.0.1:9093")
        }
        .validate()
        .unwrap_err();
        assert_eq!(e, AlertmanagerConfigError::ZeroTimeout);
        assert_eq!(e.to_string(), "alertmanager timeout must be > 0");

        use jsonl::JsonlConfigError;
        let e = JsonlConfig { path: "".into() }.validate().unwrap_err();
        assert_eq!(e, JsonlConfigError::EmptyPath);
        assert_eq!(e.to_string(), "alerts jsonl path is empty");
        let e = JsonlConfig {
            path: "/nonexistent-revenant-dir/alerts.jsonl".into(),
        }
        .validate()
        .unwrap_err();
        assert_eq!(
            e,
            JsonlConfigError::MissingDirectory {
                dir: "/nonexistent-revenant-dir".into()
            }
        );
        assert_eq!(
            e.to_string(),
            "alerts jsonl: directory /nonexistent-revenant-dir does not exist"
        );
        assert_eq!(JsonlConfig { path: "-".into() }.validate(), Ok(()));

        use spool::SpoolConfigError;
        let e = SpoolConfig {
            max_bytes: 4095,
            ..SpoolConfig::default()
        }
        .validate()
        .unwrap_err();
        assert_eq!(e, SpoolConfigError::MaxBytes { value: 4095 });
        assert_eq!(e.to_string(), "spool max_bytes must be at least 4096");

        use flood::FloodConfigError;
        let e = FloodConfig {
            rate_limit_window: Duration::ZERO,
            ..FloodConfig::default()
        }
        .validate()
        .unwrap_err();
        assert_eq!(e, FloodConfigError::ZeroRateLimitWindow { rate_limit: 50 });
        assert_eq!(
            e.to_string(),
            "rate_limit_window must be > 0 when rate_limit is set"
        );
        let e = FloodConfig {
            max_tracked: 0,
            ..FloodConfig::default()
        }
        .validate()
        .unwrap_err();
        assert_eq!(e, FloodConfigError::ZeroMaxTracked);
        assert_eq!(e.to_string(), "max_tracked must be > 0");
    }
}

#[cfg(test)]
mod identity_tests {
    use super::*;

    #[test]
    fn sink_identities_follow_the_destination_not_the_position() {
        let hook = |url: &str| WebhookConfig {
            url: url.into(),
            secret: None,
            secret_file: None,
            timeout: Duration::from_secs(1),
            max_batch: 10,
        };
        let a = hook("http://127.0.0.1:9/a");
        let b = hook("http://127.0.0.1:9/b");
        let one = AlertConfig {
            webhooks: vec![a.clone(), b.clone()],
            jsonl: Some(JsonlConfig { path: "-".into() }),
            ..AlertConfig::default()
        };
        let swapped = AlertConfig {
            webhooks: vec![b.clone(), a.clone()],
            ..one.clone()
        };
        let ids = sink_identities(&one);
        let ids2 = sink_identities(&swapped);
        assert_eq!(ids[0], ids2[1]);
        assert_eq!(ids[1], ids2[0]);
        assert_ne!(ids[0], ids[1]);
        assert!(ids[0].starts_with("webhook:"), "{ids:?}");
        assert!(
            !ids[0].contains("127.0.0.1"),
            "URLs may hold tokens: {ids:?}"
        );
        assert_eq!(ids[2], "jsonl:-");
        let twice = AlertConfig {
            webhooks: vec![a.clone(), a],
            ..AlertConfig::default()
        };
        let ids = sink_identities(&twice);
        assert_eq!(ids[1], format!("{}#2", ids[0]));
        let built = one.build_sinks().unwrap();
        let got: Vec<&str> = built.iter().map(|s| s.identity()).collect();
        assert_eq!(got, sink_identities(&one));
        assert_eq!(built[0].name(), "webhook-0");
    }
}
