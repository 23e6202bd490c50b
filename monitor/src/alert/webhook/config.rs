use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookConfig {
    /// http:// or https:// URL the alerts are POSTed to.
    pub url: String,
    /// HMAC-SHA256 key; when set, requests carry `X-Revenant-Timestamp` and
    /// `X-Revenant-Signature: sha256=<hex>` over `"<timestamp>.<body>"`.
    #[serde(default)]
    pub secret: Option<String>,
    /// Read the key from a file instead (trailing newline trimmed).
    #[serde(default)]
    pub secret_file: Option<PathBuf>,
    #[serde(default = "default_timeout", with = "crate::duration")]
    pub timeout: Duration,
    /// Notifications per request.
    #[serde(default = "default_batch")]
    pub max_batch: usize,
}

fn default_timeout() -> Duration {
    Duration::from_secs(10)
}

fn default_batch() -> usize {
    50
}

/// Most notifications one request may carry.
const MAX_BATCH: usize = 10_000;

/// The error of `reqwest::Url::parse` (`url::ParseError`, named without depending on `url`).
pub type UrlParseError = <reqwest::Url as std::str::FromStr>::Err;

/// A webhook setting that cannot work, or a signing key that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum WebhookConfigError {
    #[error("webhook url {url:?}: {source}")]
    Url { url: String, source: UrlParseError },
    #[error("webhook url {url:?}: scheme must be http or https")]
    Scheme { url: String },
    #[error("webhook: set secret or secret_file, not both")]
    SecretAndSecretFile,
    #[error("webhook max_batch must be within 1..={MAX_BATCH}")]
    MaxBatch { value: usize },
    #[error("webhook timeout must be > 0")]
    ZeroTimeout,
    #[error("webhook secret_file {}: {source}", path.display())]
    SecretFileRead {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("webhook secret_file {} is empty", path.display())]
    SecretFileEmpty { path: PathBuf },
}

impl WebhookConfig {
    pub fn new(url: impl Into<String>) -> WebhookConfig {
        WebhookConfig {
            url: url.into(),
            secret: None,
            secret_file: None,
            timeout: default_timeout(),
            max_batch: default_batch(),
        }
    }

    pub fn validate(&self) -> Result<(), WebhookConfigError> {
        let u = reqwest::Url::parse(&self.url).map_err(|source| WebhookConfigError::Url {
            url: self.url.clone(),
            source,
        })?;
        if !matches!(u.scheme(), "http" | "https") {
            return Err(WebhookConfigError::Scheme {
                url: self.url.clone(),
            });
        }
        if self.secret.is_some() && self.secret_file.is_some() {
            return Err(WebhookConfigError::SecretAndSecretFile);
        }
        if self.max_batch == 0 || self.max_batch > MAX_BATCH {
            return Err(WebhookConfigError::MaxBatch {
                value: self.max_batch,
            });
        }
        if self.timeout.is_zero() {
            return Err(WebhookConfigError::ZeroTimeout);
        }
        Ok(())
    }

    /// The signing key, reading `secret_file` if given.
    pub fn resolve_secret(&self) -> Result<Option<Vec<u8>>, WebhookConfigError> {
        if let Some(s) = &self.secret {
            return Ok(Some(s.as_bytes().to_vec()));
        }
        if let Some(p) = &self.secret_file {
            let s = std::fs::read_to_string(p).map_err(|source| {
                WebhookConfigError::SecretFileRead {
                    path: p.clone(),
                    source,
                }
            })?;
            let s = s.trim_end_matches(['\n', '\r']);
            if s.is_empty() {
                return Err(WebhookConfigError::SecretFileEmpty { path: p.clone() });
            }
            return Ok(Some(s.as_bytes().to_vec()));
        }
        Ok(None)
    }
}
