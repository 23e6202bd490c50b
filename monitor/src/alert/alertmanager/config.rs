use std::time::Duration;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AlertmanagerConfig {
    /// Base URL of Alertmanager (`http://host:9093`); alerts go to `<url>/api/v2/alerts`.
    pub url: String,
    /// Active alerts are re-posted this often, like Prometheus' `resend_delay`; each post sets
    /// `endsAt` four intervals ahead so Alertmanager resolves them if revenant goes away.
    #[serde(default = "default_resend", with = "crate::duration")]
    pub resend_interval: Duration,
    #[serde(default = "default_timeout", with = "crate::duration")]
    pub timeout: Duration,
}

fn default_resend() -> Duration {
    Duration::from_secs(60)
}

fn default_timeout() -> Duration {
    Duration::from_secs(10)
}

/// An Alertmanager setting that cannot work.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AlertmanagerConfigError {
    #[error("alertmanager url {url:?}: {source}")]
    Url {
        url: String,
        source: crate::alert::webhook::config::UrlParseError,
    },
    #[error("alertmanager url {url:?}: scheme must be http or https")]
    Scheme { url: String },
    #[error("alertmanager resend_interval must be at least 1s")]
    ResendInterval { value: Duration },
    #[error("alertmanager timeout must be > 0")]
    ZeroTimeout,
}

impl AlertmanagerConfig {
    pub fn new(url: impl Into<String>) -> AlertmanagerConfig {
        AlertmanagerConfig {
            url: url.into(),
            resend_interval: default_resend(),
            timeout: default_timeout(),
        }
    }

    pub fn validate(&self) -> Result<(), AlertmanagerConfigError> {
        let u = reqwest::Url::parse(&self.url).map_err(|source| AlertmanagerConfigError::Url {
            url: self.url.clone(),
            source,
        })?;
        if !matches!(u.scheme(), "http" | "https") {
            return Err(AlertmanagerConfigError::Scheme {
                url: self.url.clone(),
            });
        }
        if self.resend_interval < Duration::from_secs(1) {
            return Err(AlertmanagerConfigError::ResendInterval {
                value: self.resend_interval,
            });
        }
        if self.timeout.is_zero() {
            return Err(AlertmanagerConfigError::ZeroTimeout);
        }
        Ok(())
    }
}
