//! OTLP receiver configuration: validated before any port is bound.

use std::net::SocketAddr;

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OtlpConfig {
    /// OTLP/gRPC listen address; `null` disables the receiver.
    #[serde(
        default = "default_grpc",
        deserialize_with = "crate::addr::deserialize_option"
    )]
    pub grpc: Option<SocketAddr>,
    /// OTLP/HTTP listen address; `null` disables the receiver.
    #[serde(
        default = "default_http",
        deserialize_with = "crate::addr::deserialize_option"
    )]
    pub http: Option<SocketAddr>,
    /// Largest request body (gRPC message, HTTP body as sent).
    #[serde(default = "default_max_message")]
    pub max_message_bytes: usize,
    /// Largest body after gzip decompression (HTTP; gRPC applies `max_message_bytes` to both).
    #[serde(default = "default_max_decompressed")]
    pub max_decompressed_bytes: usize,
    /// Most spans (or log records) in one export.
    #[serde(default = "default_max_items")]
    pub max_items_per_request: usize,
}

pub const DEFAULT_GRPC: &str = "127.0.0.1:4317";
pub const DEFAULT_HTTP: &str = "127.0.0.1:4318";

fn default_grpc() -> Option<SocketAddr> {
    DEFAULT_GRPC.parse().ok()
}
fn default_http() -> Option<SocketAddr> {
    DEFAULT_HTTP.parse().ok()
}
fn default_max_message() -> usize {
    8 << 20
}
fn default_max_decompressed() -> usize {
    32 << 20
}
fn default_max_items() -> usize {
    100_000
}

impl Default for OtlpConfig {
    fn default() -> Self {
        OtlpConfig {
            grpc: default_grpc(),
            http: default_http(),
            max_message_bytes: default_max_message(),
            max_decompressed_bytes: default_max_decompressed(),
            max_items_per_request: default_max_items(),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum OtlpConfigError {
    #[error("otlp.{0} must be greater than 0")]
    Zero(&'static str),
    #[error("otlp.max_decompressed_bytes ({0}) must be >= otlp.max_message_bytes ({1})")]
    DecompressedBelowMessage(usize, usize),
    #[error("otlp.grpc and otlp.http both use {0}")]
    SameAddress(SocketAddr),
}

impl OtlpConfig {
    pub fn validate(&self) -> Result<(), OtlpConfigError> {
        if self.max_message_bytes == 0 {
            return Err(OtlpConfigError::Zero("max_message_bytes"));
        }
        if self.max_items_per_request == 0 {
            return Err(OtlpConfigError::Zero("max_items_per_request"));
        }
        if self.max_decompressed_bytes < self.max_message_bytes {
            return Err(OtlpConfigError::DecompressedBelowMessage(
                self.max_decompressed_bytes,
                self.max_message_bytes,
            ));
        }
        if let (Some(g), Some(h)) = (self.grpc, self.http)
            && g == h
            && g.port() != 0
        {
            return Err(OtlpConfigError::SameAddress(g));
        }
        Ok(())
    }
}
