//! The `access` section and its flags.
//!
//! ```yaml
//! access:
//!   tls: { cert: /etc/revenant/tls/tls.crt, key: /etc/revenant/tls/tls.key, client_ca: /etc/revenant/tls/ca.crt }
//!   auth_token_file: /etc/revenant/token/token
//! ```

use std::path::PathBuf;

use serde::Deserialize;

/// `access`: TLS for the OTLP receivers and the admin server, and the bearer token.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AccessConfig {
    /// Serve TLS with this certificate and key; `client_ca` also requires client certificates
    /// signed by it (mutual TLS).
    pub tls: Option<TlsFiles>,
    /// A file holding the bearer token every OTLP export and `/api/*` request must carry
    /// (`authorization: Bearer <token>`).
    pub auth_token_file: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    /// PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// PEM CA certificates client certificates must chain to.
    #[serde(default)]
    pub client_ca: Option<PathBuf>,
}

/// The access flags (flattened into `run`, `agent` and `checker`); each wins over the file.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct AccessArgs {
    /// Serve TLS on the OTLP receivers and the admin server with this PEM certificate chain
    /// (needs --tls-key; re-read when it changes).
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates signed by these PEM CA certificates (mutual TLS).
    #[arg(long, value_name = "FILE")]
    pub tls_client_ca: Option<PathBuf>,
    /// Require `authorization: Bearer <token>` on every OTLP export and /api/* request, the
    /// token being this file's content (surrounding whitespace ignored; re-read when it
    /// changes).
    #[arg(long, value_name = "FILE")]
    pub auth_token_file: Option<PathBuf>,
}

impl AccessArgs {
    /// Applies the flags over the file's section.
    pub fn apply(&self, cfg: &mut AccessConfig) -> Result<(), AccessError> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => {
                cfg.tls = Some(TlsFiles {
                    cert: cert.clone(),
                    key: key.clone(),
                    client_ca: cfg.tls.as_ref().and_then(|t| t.client_ca.clone()),
                });
            }
            (None, None) => {}
            (Some(_), None) => return Err(AccessError::Missing("--tls-cert needs --tls-key")),
            (None, Some(_)) => return Err(AccessError::Missing("--tls-key needs --tls-cert")),
        }
        if let Some(ca) = &self.tls_client_ca {
            match cfg.tls.as_mut() {
                Some(t) => t.client_ca = Some(ca.clone()),
                None => {
                    return Err(AccessError::Missing(
                        "--tls-client-ca needs --tls-cert and --tls-key",
                    ));
                }
            }
        }
        if let Some(f) = &self.auth_token_file {
            cfg.auth_token_file = Some(f.clone());
        }
        Ok(())
    }
}

/// Why the access files cannot be used (exit 2 at start; at a reload, the previous ones stay).
#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    #[error("{0}")]
    Missing(&'static str),
    #[error("{what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what} {path}: {message}")]
    Invalid {
        what: &'static str,
        path: PathBuf,
        message: String,
    },
    #[error("TLS: {0}")]
    Tls(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(cert: bool, key: bool, ca: bool) -> AccessArgs {
        AccessArgs {
            tls_cert: cert.then(|| "c.pem".into()),
            tls_key: key.then(|| "k.pem".into()),
            tls_client_ca: ca.then(|| "ca.pem".into()),
            auth_token_file: None,
        }
    }

    #[test]
    fn flags_need_their_partners_and_win_over_the_file() {
        for (a, want) in [
            (args(true, false, false), "--tls-cert needs --tls-key"),
            (args(false, true, false), "--tls-key needs --tls-cert"),
            (args(false, false, true), "--tls-client-ca needs"),
        ] {
            let err = a.apply(&mut AccessConfig::default()).unwrap_err();
            assert!(err.to_string().starts_with(want), "{err}");
        }
        let mut cfg = AccessConfig {
            tls: Some(TlsFiles {
                cert: "file-c.pem".into(),
                key: "file-k.pem".into(),
                client_ca: Some("file-ca.pem".into()),
            }),
            auth_token_file: Some("file-token".into()),
        };
        args(true, true, false).apply(&mut cfg).unwrap();
        let tls = cfg.tls.as_ref().unwrap();
        assert_eq!(tls.cert, PathBuf::from("c.pem"));
        assert_eq!(tls.client_ca, Some(PathBuf::from("file-ca.pem")));
        assert_eq!(cfg.auth_token_file, Some(PathBuf::from("file-token")));
        // A client CA flag alone completes the file's TLS section.
        args(false, false, true).apply(&mut cfg).unwrap();
        assert_eq!(cfg.tls.unwrap().client_ca, Some(PathBuf::from("ca.pem")));
    }
}
