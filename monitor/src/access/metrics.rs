//! Refusals and reloads: `revenant_unauthenticated_requests_total{server}`,
//! `revenant_tls_handshake_failures_total{server}`, `revenant_access_reloads_total{file,result}`.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet};

use crate::telemetry::metrics::{Metrics, counters};

/// The servers access applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    OtlpGrpc = 0,
    OtlpHttp = 1,
    Admin = 2,
}

impl Server {
    pub const ALL: [Server; 3] = [Server::OtlpGrpc, Server::OtlpHttp, Server::Admin];
    pub fn as_str(self) -> &'static str {
        match self {
            Server::OtlpGrpc => "otlp_grpc",
            Server::OtlpHttp => "otlp_http",
            Server::Admin => "admin",
        }
    }
}

/// The files a reload reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reloaded {
    Tls = 0,
    Token = 1,
}

#[derive(Debug, Default)]
pub struct AccessStats {
    /// Requests refused for a missing or wrong bearer token, by server.
    pub unauthenticated: [AtomicU64; 3],
    /// Connections that did not complete the TLS handshake (no or bad client certificate, a
    /// client speaking plain text, timeouts), by server.
    pub handshake_failures: [AtomicU64; 3],
    /// Reloads after a file changed: `[file][0 = ok, 1 = error]`.
    pub reloads: [[AtomicU64; 2]; 2],
}

impl AccessStats {
    pub fn unauthenticated(&self, server: Server) {
        self.unauthenticated[server as usize].fetch_add(1, Relaxed);
    }

    pub fn handshake_failed(&self, server: Server) {
        self.handshake_failures[server as usize].fetch_add(1, Relaxed);
    }

    pub fn reloaded(&self, file: Reloaded, ok: bool) {
        self.reloads[file as usize][usize::from(!ok)].fetch_add(1, Relaxed);
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServerLabels {
    server: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReloadLabels {
    file: &'static str,
    result: &'static str,
}

struct AccessCollector(Arc<AccessStats>);

impl std::fmt::Debug for AccessCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AccessCollector")
    }
}

impl Collector for AccessCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let s = &self.0;
        let by_server = |v: &[AtomicU64; 3]| {
            Server::ALL.map(|k| {
                (
                    ServerLabels { server: k.as_str() },
                    v[k as usize].load(Relaxed),
                )
            })
        };
        counters(
            &mut enc,
            "revenant_unauthenticated_requests",
            "Requests refused for a missing or wrong bearer token (nothing of them reached the engine)",
            by_server(&s.unauthenticated),
        )?;
        counters(
            &mut enc,
            "revenant_tls_handshake_failures",
            "Connections closed before their TLS handshake completed",
            by_server(&s.handshake_failures),
        )?;
        let mut rows = Vec::with_capacity(4);
        for (file, f) in [("tls", Reloaded::Tls), ("token", Reloaded::Token)] {
            for (result, r) in [("ok", 0), ("error", 1)] {
                rows.push((
                    ReloadLabels { file, result },
                    s.reloads[f as usize][r].load(Relaxed),
                ));
            }
        }
        counters(
            &mut enc,
            "revenant_access_reloads",
            "Reloads of the TLS or token files after they changed; on error the previous ones stay in force",
            rows,
        )
    }
}

pub fn register(metrics: &Metrics, stats: Arc<AccessStats>) {
    metrics.register_collector(AccessCollector(stats));
}
