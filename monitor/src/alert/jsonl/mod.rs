//! JSON Lines sink: one notification (incident or summary) per line (the same objects as the
//! webhook's `alerts[]`), to a file opened for append or to standard output.

pub mod config;

use std::io::Write;
use std::sync::{Arc, Mutex};

pub use config::{JsonlConfig, JsonlConfigError};

use super::notification::Notification;
use super::sink::{BoxFuture, Sink, SinkError};

enum Out {
    Stdout,
    File(std::fs::File),
}

pub struct JsonlSink {
    name: String,
    out: Arc<Mutex<Out>>,
}

/// Why the JSON Lines sink cannot be built (at start-up, before any port is bound).
#[derive(Debug, thiserror::Error)]
pub enum JsonlSinkError {
    #[error(transparent)]
    Config(#[from] JsonlConfigError),
    #[error("alerts jsonl {}: {source}", .path.display())]
    Open {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

impl JsonlSink {
    pub fn new(name: impl Into<String>, cfg: &JsonlConfig) -> Result<JsonlSink, JsonlSinkError> {
        cfg.validate()?;
        let out = if cfg.path.as_os_str() == "-" {
            Out::Stdout
        } else {
            Out::File(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&cfg.path)
                    .map_err(|source| JsonlSinkError::Open {
                        path: cfg.path.clone(),
                        source,
                    })?,
            )
        };
        Ok(JsonlSink {
            name: name.into(),
            out: Arc::new(Mutex::new(out)),
        })
    }
}

impl Sink for JsonlSink {
    fn name(&self) -> &str {
        &self.name
    }

    fn max_batch(&self) -> usize {
        256
    }

    fn deliver<'a>(
        &'a self,
        batch: &'a [Arc<Notification>],
    ) -> BoxFuture<'a, Result<(), SinkError>> {
        let out = self.out.clone();
        let mut buf = Vec::with_capacity(batch.len() * 512);
        for n in batch {
            // Serializing our own types cannot fail; skip rather than panic if it ever does.
            if serde_json::to_writer(&mut buf, n.as_ref()).is_ok() {
                buf.push(b'\n');
            }
        }
        Box::pin(async move {
            tokio::task::spawn_blocking(move || {
                let mut g = out.lock().unwrap_or_else(|p| p.into_inner());
                let r = match &mut *g {
                    Out::Stdout => {
                        let mut so = std::io::stdout().lock();
                        so.write_all(&buf).and_then(|_| so.flush())
                    }
                    Out::File(f) => f.write_all(&buf).and_then(|_| f.flush()),
                };
                // Disk full or a closed pipe may clear up; the spool keeps the alerts meanwhile.
                r.map_err(|e| SinkError::Retryable {
                    reason: format!("write failed: {e}"),
                    status: None,
                    retry_after: None,
                })
            })
            .await
            .unwrap_or_else(|e| {
                Err(SinkError::Retryable {
                    reason: format!("writer task failed: {e}"),
                    status: None,
                    retry_after: None,
                })
            })
        })
    }
}
