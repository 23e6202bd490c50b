//! Generic webhook sink: POST `{"version":"revenant.alerts/v2","alerts":[...]}` (see
//! `docs/alerts.md` for the schema), signed with HMAC-SHA256 when a secret is configured.

pub mod config;

use std::sync::Arc;

use hmac::{KeyInit, Mac};
use serde::Serialize;

pub use config::{WebhookConfig, WebhookConfigError};

use super::notification::Notification;
use super::sink::{BoxFuture, Sink, SinkError, classify_http};

pub const SIGNATURE_HEADER: &str = "x-revenant-signature";
pub const TIMESTAMP_HEADER: &str = "x-revenant-timestamp";
pub const PAYLOAD_VERSION: &str = "revenant.alerts/v2";

#[derive(Serialize)]
struct Body<'a> {
    version: &'static str,
    alerts: Vec<&'a Notification>,
}

pub struct WebhookSink {
    name: String,
    url: reqwest::Url,
    secret: Option<Vec<u8>>,
    max_batch: usize,
    client: reqwest::Client,
}

/// Hex HMAC-SHA256 of `"<timestamp>.<body>"`: binding the timestamp stops replay of an old body.
pub fn sign(secret: &[u8], timestamp: &str, body: &[u8]) -> String {
    let mut mac =
        hmac::Hmac::<sha2::Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(timestamp.as_bytes());
    mac.update(b".");
    mac.update(body);
    let out = mac.finalize().into_bytes();
    out.iter().map(|b| format!("{b:02x}")).collect()
}

/// The HTTP client of a sink could not be built (rustls or the system's configuration).
#[derive(Debug, thiserror::Error)]
#[error("cannot build HTTP client: {0}")]
pub struct HttpClientError(#[source] reqwest::Error);

/// Why a webhook sink cannot be built (at start-up, before any port is bound).
#[derive(Debug, thiserror::Error)]
pub enum WebhookSinkError {
    #[error(transparent)]
    Config(#[from] WebhookConfigError),
    #[error(transparent)]
    Client(#[from] HttpClientError),
}

/// The HTTP client shared by the HTTP sinks: rustls with the ring provider.
pub fn http_client(timeout: std::time::Duration) -> Result<reqwest::Client, HttpClientError> {
    // Another component may have installed a provider already; either way one is installed.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .timeout(timeout)
        .connect_timeout(timeout.min(std::time::Duration::from_secs(5)))
        .user_agent(concat!("revenant/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(HttpClientError)
}

impl WebhookSink {
    pub fn new(
        name: impl Into<String>,
        cfg: &WebhookConfig,
    ) -> Result<WebhookSink, WebhookSinkError> {
        cfg.validate()?;
        Ok(WebhookSink {
            name: name.into(),
            url: reqwest::Url::parse(&cfg.url).map_err(|source| WebhookConfigError::Url {
                url: cfg.url.clone(),
                source,
            })?,
            secret: cfg.resolve_secret()?,
            max_batch: cfg.max_batch,
            client: http_client(cfg.timeout)?,
        })
    }
}

/// A transport error is always worth retrying (refused, reset, timed out, DNS). The reason is
/// the error with its whole source chain (`error sending request for url (…): client error
/// (Connect): tcp connect error: Connection refused (os error 111)`): reqwest's own message never
/// says which of those it was.
pub fn transport_error(e: reqwest::Error) -> SinkError {
    SinkError::Retryable {
        reason: with_causes(&e),
        status: None,
        retry_after: None,
    }
}

/// `e: its source: its source's source…`, each cause once (wrappers often repeat their
/// source's message).
pub fn with_causes(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

pub async fn read_answer(resp: reqwest::Response) -> Result<(), SinkError> {
    let status = resp.status().as_u16();
    let retry_after = resp
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = if (200..300).contains(&status) {
        String::new()
    } else {
        let b = resp.text().await.unwrap_or_default();
        b.chars().take(200).collect()
    };
    classify_http(status, retry_after.as_deref(), &body)
}

impl Sink for WebhookSink {
    fn name(&self) -> &str {
        &self.name
    }

    fn max_batch(&self) -> usize {
        self.max_batch
    }

    fn deliver<'a>(
        &'a self,
        batch: &'a [Arc<Notification>],
    ) -> BoxFuture<'a, Result<(), SinkError>> {
        Box::pin(async move {
            let body = serde_json::to_vec(&Body {
                version: PAYLOAD_VERSION,
                alerts: batch.iter().map(|n| n.as_ref()).collect(),
            })
            .map_err(|e| SinkError::Permanent {
                reason: format!("cannot encode payload: {e}"),
                status: None,
            })?;
            let mut req = self
                .client
                .post(self.url.clone())
                .header(reqwest::header::CONTENT_TYPE, "application/json");
            if let Some(secret) = &self.secret {
                let ts = (super::notification::now_unix_ns() / 1_000_000_000).to_string();
                let sig = sign(secret, &ts, &body);
                req = req
                    .header(TIMESTAMP_HEADER, ts)
                    .header(SIGNATURE_HEADER, format!("sha256={sig}"));
            }
            let resp = req.body(body).send().await.map_err(transport_error)?;
            read_answer(resp).await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refused connection says so: the cause chain, not only "error sending request".
    #[tokio::test]
    async fn transport_errors_carry_their_cause() {
        // A port just released by the test: nothing listens there.
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let client = http_client(std::time::Duration::from_secs(5)).unwrap();
        let e = client
            .post(format!("http://{addr}/hook"))
            .send()
            .await
            .unwrap_err();
        let SinkError::Retryable { reason, .. } = transport_error(e) else {
            panic!("a transport error is retryable");
        };
        assert!(reason.starts_with("error sending request"), "{reason}");
        assert!(reason.contains("Connection refused"), "{reason}");
    }

    #[test]
    fn signature_is_hmac_sha256_over_timestamp_dot_body() {
        // Well-known vector: HMAC-SHA256("key", "The quick brown fox jumps over the lazy dog").
        // Split as timestamp "The quick brown fox jumps over the lazy dog" minus the body is not
        // possible with the "." separator, so check the separator form against a manual MAC.
        let manual = |msg: &[u8]| {
            let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(b"key").unwrap();
            mac.update(msg);
            mac.finalize()
                .into_bytes()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        };
        assert_eq!(
            manual(b"The quick brown fox jumps over the lazy dog"),
            "f7bc83f430538424b13298e6aa6fb143ef4d59a14946175997479dbc2d1a3cd8"
        );
        assert_eq!(sign(b"key", "1700000000", b"{}"), manual(b"1700000000.{}"));
        assert_ne!(sign(b"key", "1700000001", b"{}"), manual(b"1700000000.{}"));
    }

    #[test]
    fn config_is_validated() {
        let e = WebhookConfig::new("ftp://x").validate().unwrap_err();
        assert!(
            matches!(&e, WebhookConfigError::Scheme { url } if url == "ftp://x"),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            r#"webhook url "ftp://x": scheme must be http or https"#
        );
        let e = WebhookConfig::new("not a url").validate().unwrap_err();
        assert!(
            matches!(&e, WebhookConfigError::Url { url, .. } if url == "not a url"),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            r#"webhook url "not a url": relative URL without a base"#
        );
        let e = WebhookConfig {
            max_batch: 0,
            ..WebhookConfig::new("http://x")
        }
        .validate()
        .unwrap_err();
        assert!(
            matches!(e, WebhookConfigError::MaxBatch { value: 0 }),
            "{e:?}"
        );
        assert_eq!(e.to_string(), "webhook max_batch must be within 1..=10000");
        let e = WebhookConfig {
            secret: Some("s".into()),
            secret_file: Some("/s".into()),
            ..WebhookConfig::new("http://x")
        }
        .validate()
        .unwrap_err();
        assert!(
            matches!(e, WebhookConfigError::SecretAndSecretFile),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "webhook: set secret or secret_file, not both"
        );
        let e = WebhookConfig {
            timeout: std::time::Duration::ZERO,
            ..WebhookConfig::new("http://x")
        }
        .validate()
        .unwrap_err();
        assert!(matches!(e, WebhookConfigError::ZeroTimeout), "{e:?}");
        assert_eq!(e.to_string(), "webhook timeout must be > 0");
        assert!(
            WebhookConfig::new("http://127.0.0.1:1/hook")
                .validate()
                .is_ok()
        );
        let e = serde_saphyr::from_str::<WebhookConfig>("url: http://x\nbogus: 1\n").unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
    }
}
