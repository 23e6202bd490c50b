//! Alerting flags of `revenant run` (`#[command(flatten)]`); they add to the `alert` section of
//! the run config, or to `--alert-config`.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::{AlertConfig, AlertError, AlertmanagerConfig, JsonlConfig, WebhookConfig};

/// Alerting flags for `revenant run`. Flags add to the file's configuration.
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
    /// Re-post active alerts to Alertmanager this often [default: 1m].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub alertmanager_resend: Option<Duration>,
    /// Append alerts as JSON Lines to this file; `-` for standard output.
    #[arg(long, value_name = "PATH")]
    pub alerts_jsonl: Option<PathBuf>,
    /// Durable alert spool directory [default: <state dir>/spool, state dir from
    /// $STATE_DIRECTORY, $XDG_STATE_HOME/revenant, ~/.local/state/revenant or /var/lib/revenant].
    #[arg(long, value_name = "DIR")]
    pub spool_dir: Option<PathBuf>,
    /// Most notifications kept in the spool; beyond it new ones are dropped (counted)
    /// [default: 10000].
    #[arg(long, value_name = "N")]
    pub spool_max_entries: Option<usize>,
    /// Do not fsync spool entries (survives a crash of revenant, not of the machine).
    #[arg(long)]
    pub spool_no_fsync: bool,
    /// At start, drop alerts the spool holds for sinks no longer configured, instead of
    /// re-routing them to the sinks configured now (counted, logged at ERROR, in the summary).
    #[arg(long)]
    pub spool_discard_removed_sinks: bool,
    /// An incident notified within this window is not notified again for later findings of the
    /// same request (merged into it), unless one raises its severity [default: 5m].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub dedup_window: Option<Duration>,
    /// Incident notifications per lead rule per --rate-limit-window, 0 = unlimited [default: 50].
    #[arg(long, value_name = "N")]
    pub rate_limit: Option<u32>,
    /// The window --rate-limit counts notifications in, per lead rule [default: 1m].
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
    /// `cluster` label on alerts [default: default].
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
        let mut cfg = self.load_file()?.unwrap_or_default();
        self.apply(&mut cfg, default_external_url);
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads `--alert-config` if given.
    pub fn load_file(&self) -> Result<Option<AlertConfig>, AlertError> {
        let Some(p) = &self.alert_config else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(p).map_err(|e| AlertError::File {
            path: p.clone(),
            message: e.to_string(),
        })?;
        AlertConfig::from_yaml(&text)
            .map(Some)
            .map_err(|source| AlertError::Parse {
                path: p.clone(),
                source,
            })
    }

    /// Applies the flags over `cfg`: lists are added to, single values replaced. Validation is
    /// the caller's.
    pub fn apply(&self, cfg: &mut AlertConfig, default_external_url: Option<String>) {
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
        if self.spool_discard_removed_sinks {
            cfg.spool.discard_removed_sinks = true;
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let e = args.to_config(None).unwrap_err();
        assert!(
            matches!(
                &e,
                AlertError::Webhook(crate::alert::webhook::WebhookConfigError::SecretFileRead { path, .. })
                    if path.ends_with("missing")
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("missing"), "{e}");
        std::fs::write(&file, "webhooks: [{url: x, bogus: 1}]\n").unwrap();
        let args = AlertArgs {
            alert_config: Some(file),
            ..AlertArgs::default()
        };
        let e = args.to_config(None).unwrap_err().to_string();
        assert!(e.contains("bogus"), "{e}");
    }
}
