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

    pub fn validate(&self) -> Result<(), String> {
        let u = reqwest::Url::parse(&self.url)
            .map_err(|e| format!("webhook url {:?}: {e}", self.url))?;
        if !matches!(u.scheme(), "http" | "https") {
            return Err(format!(
                "webhook url {:?}: scheme must be http or https",
                self.url
            ));
        }
        if self.secret.is_some() && self.secret_file.is_some() {
            return Err("webhook: set secret or secret_file, not both".into());
        }
        if self.max_batch == 0 || self.max_batch > 10_000 {
            return Err("webhook max_batch must be within 1..=10000".into());
        }
        if self.timeout.is_zero() {
            return Err("webhook timeout must be > 0".into());
        }
        Ok(())
    }

    /// The signing key, reading `secret_file` if given.
    pub fn resolve_secret(&self) -> Result<Option<Vec<u8>>, String> {
        if let Some(s) = &self.secret {
            return Ok(Some(s.as_bytes().to_vec()));
        }
        if let Some(p) = &self.secret_file {
            let s = std::fs::read_to_string(p)
                .map_err(|e| format!("webhook secret_file {}: {e}", p.display()))?;
            let s = s.trim_end_matches(['\n', '\r']);
            if s.is_empty() {
                return Err(format!("webhook secret_file {} is empty", p.display()));
            }
            return Ok(Some(s.as_bytes().to_vec()));
        }
        Ok(None)
    }
}
