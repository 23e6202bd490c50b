//! The servers' TLS configuration, rebuilt whole from the files at every reload (certificate,
//! key and client CA may rotate together) and swapped in for the connections that follow.

use std::path::Path;
use std::sync::{Arc, RwLock};

use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ServerConfig, WebPkiClientVerifier};

use super::{AccessError, TlsFiles};

/// The application protocol a server speaks over TLS (its ALPN offer): gRPC needs HTTP/2, the
/// HTTP servers speak HTTP/1.1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alpn {
    H2,
    Http1,
}

struct Configs {
    h2: Arc<ServerConfig>,
    http1: Arc<ServerConfig>,
}

pub struct ServerTls {
    files: TlsFiles,
    configs: RwLock<Configs>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("files", &self.files)
            .finish()
    }
}

impl ServerTls {
    pub fn load(files: TlsFiles) -> Result<ServerTls, AccessError> {
        let configs = build(&files)?;
        Ok(ServerTls {
            files,
            configs: RwLock::new(configs),
        })
    }

    /// Reads the files again; on error the configuration in force stays.
    pub fn reload(&self) -> Result<(), AccessError> {
        let fresh = build(&self.files)?;
        *self.configs.write().unwrap_or_else(|p| p.into_inner()) = fresh;
        Ok(())
    }

    /// The configuration for the next connection.
    pub fn config(&self, alpn: Alpn) -> Arc<ServerConfig> {
        let c = self.configs.read().unwrap_or_else(|p| p.into_inner());
        match alpn {
            Alpn::H2 => c.h2.clone(),
            Alpn::Http1 => c.http1.clone(),
        }
    }

    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    pub fn mutual(&self) -> bool {
        self.files.client_ca.is_some()
    }
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, AccessError> {
    std::fs::read(path).map_err(|source| AccessError::Read {
        what,
        path: path.into(),
        source,
    })
}

fn invalid(what: &'static str, path: &Path, message: impl std::fmt::Display) -> AccessError {
    AccessError::Invalid {
        what,
        path: path.into(),
        message: message.to_string(),
    }
}

fn certificates(
    what: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, AccessError> {
    let pem = read(what, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(what, path, format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(invalid(what, path, "no CERTIFICATE block in it"));
    }
    Ok(certs)
}

fn build(files: &TlsFiles) -> Result<Configs, AccessError> {
    let chain = certificates("--tls-cert", &files.cert)?;
    let key_pem = read("--tls-key", &files.key)?;
    let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
        invalid(
            "--tls-key",
            &files.key,
            format!("no PEM private key (PKCS#8, PKCS#1 or SEC1): {e}"),
        )
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| AccessError::Tls(e.to_string()))?;
    let builder = match &files.client_ca {
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for cert in certificates("--tls-client-ca", ca)? {
                roots
                    .add(cert)
                    .map_err(|e| invalid("--tls-client-ca", ca, e))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| invalid("--tls-client-ca", ca, e))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let base = builder.with_single_cert(chain, key).map_err(|e| {
        invalid(
            "--tls-key",
            &files.key,
            format!(
                "cannot serve it with --tls-cert {}: {e}",
                files.cert.display()
            ),
        )
    })?;
    let with_alpn = |proto: &[u8]| {
        let mut c = base.clone();
        c.alpn_protocols = vec![proto.to_vec()];
        Arc::new(c)
    };
    Ok(Configs {
        h2: with_alpn(b"h2"),
        http1: with_alpn(b"http/1.1"),
    })
}
