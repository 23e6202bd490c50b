//! Who may talk to revenant's servers once they listen beyond loopback: TLS on the OTLP
//! receivers and the admin server (mutual TLS with a client CA), and a bearer token on OTLP
//! exports and on `/api/*`. Both are off by default, since the listeners default to loopback.
//!
//! The files are read before anything binds (a bad file is exit 2, naming it) and re-read when
//! they change ([`reload`]): cert-manager rotates a Secret and the kubelet swaps the mounted
//! files, and a long-running DaemonSet must pick the new ones up without a restart. A file that
//! no longer loads keeps the previous certificate or token in force, said in the log and in
//! `revenant_access_reloads_total{result="error"}`.

pub mod config;
pub mod listener;
pub mod metrics;
pub mod reload;
pub mod tls;
pub mod token;

use std::sync::Arc;

pub use config::{AccessArgs, AccessConfig, AccessError, TlsFiles};
pub use listener::{Incoming, TlsConn, TlsListener};
pub use metrics::{AccessStats, Server};
pub use tls::{Alpn, ServerTls};
pub use token::BearerToken;

use crate::telemetry::metrics::Metrics;

/// TLS and token as loaded, shared by every server of the process.
#[derive(Clone)]
pub struct Access {
    pub tls: Option<Arc<ServerTls>>,
    pub token: Option<Arc<BearerToken>>,
    pub stats: Arc<AccessStats>,
}

impl Access {
    /// Loads the files `cfg` names (nothing when it names none).
    pub fn load(cfg: &AccessConfig) -> Result<Access, AccessError> {
        let tls = cfg
            .tls
            .as_ref()
            .map(|files| ServerTls::load(files.clone()).map(Arc::new))
            .transpose()?;
        let token = cfg
            .auth_token_file
            .as_ref()
            .map(|path| BearerToken::load(path.clone()).map(Arc::new))
            .transpose()?;
        Ok(Access {
            tls,
            token,
            stats: Arc::new(AccessStats::default()),
        })
    }

    /// No TLS and no token: every server answers as it always did.
    pub fn open() -> Access {
        Access {
            tls: None,
            token: None,
            stats: Arc::new(AccessStats::default()),
        }
    }

    /// `https` when the servers speak TLS (links in alerts, the ready file).
    pub fn scheme(&self) -> &'static str {
        if self.tls.is_some() { "https" } else { "http" }
    }

    /// What `server` accepts connections with: `tcp` itself, or TLS in front of it (starts
    /// the handshake task, so needs a runtime).
    pub fn incoming(
        &self,
        tcp: tokio::net::TcpListener,
        alpn: Alpn,
        server: Server,
    ) -> std::io::Result<Incoming> {
        match &self.tls {
            None => Ok(Incoming::Plain(tcp)),
            Some(tls) => Ok(Incoming::Tls(TlsListener::new(
                tcp,
                tls.clone(),
                alpn,
                server,
                self.stats.clone(),
            )?)),
        }
    }

    /// Counts refusals and reloads on `/metrics`.
    pub fn register(&self, metrics: &Metrics) {
        metrics::register(metrics, self.stats.clone());
    }

    /// Re-reads the files whenever they change, until `stop` resolves.
    pub async fn watch(self, stop: impl std::future::Future<Output = ()>) {
        if self.tls.is_none() && self.token.is_none() {
            return;
        }
        reload::watch(self, reload::RELOAD_INTERVAL, stop).await
    }
}
