//! Notifications sent once across checker lives and replicas (`alert::claims`), kept in a
//! JetStream key-value bucket, `<stream>_NOTIFIED`: one key per notification sent (its
//! incident and why it was notified), kept as long as a restarted checker may find the breach
//! again (twice the recovery window, at least the stream's retention).
//!
//! A checker that starts reads its partitions again from before where the last one stopped
//! (`consumer::recover`), so its engine finds again what an earlier life found, and its
//! dispatcher opens those incidents again: their notifications are looked up here before they
//! are spooled, and only the ones not found are sent. A lookup that cannot be answered (NATS
//! disconnected, or no answer within [`CLAIM_TIMEOUT`]) is counted and left to the dispatcher,
//! which asks again and sends after `alert::claims::CLAIM_HOLD`: a repeat is better than a loss.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use async_nats::jetstream::kv;
use futures_util::future::join_all;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use tokio::sync::OnceCell;

use super::{BusConfig, BusError};
use crate::alert::claims::{ClaimFuture, NotificationClaims};
use crate::telemetry::metrics::{Metrics, counters};

/// How long one lookup or record may take.
pub const CLAIM_TIMEOUT: Duration = Duration::from_secs(2);

/// The bucket's name for a stream.
pub fn bucket(stream: &str) -> String {
    format!("{stream}_NOTIFIED")
}

#[derive(Debug, Default)]
struct ClaimStats {
    new: AtomicU64,
    sent_before: AtomicU64,
    unavailable: AtomicU64,
    unrecorded: AtomicU64,
}

#[derive(Debug)]
struct ClaimCollector(Arc<ClaimStats>);

impl Collector for ClaimCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let s = &self.0;
        counters(
            &mut enc,
            "revenant_checker_notification_claims",
            "Notifications looked up before spooling (new: sent; sent_before: another checker life or replica sent it, skipped; \
             unavailable: the bucket did not answer, held and asked again) and recorded after (unrecorded: the record failed, a restart may send it again)",
            [
                ("new", &s.new),
                ("sent_before", &s.sent_before),
                ("unavailable", &s.unavailable),
                ("unrecorded", &s.unrecorded),
            ]
            .into_iter()
            .map(|(r, n)| ([("result", r)], n.load(Relaxed))),
        )
    }
}

/// The checker's claims: the bucket, once open, and the connection it is reached by.
pub struct Claims {
    store: OnceCell<(kv::Store, async_nats::Client)>,
    stats: Arc<ClaimStats>,
}

impl Claims {
    /// Claims with no bucket yet ([`Claims::open`] sets it); registers the counters.
    pub fn new(metrics: &Metrics) -> Arc<Claims> {
        let stats = Arc::new(ClaimStats::default());
        metrics.register_collector(ClaimCollector(stats.clone()));
        Arc::new(Claims {
            store: OnceCell::new(),
            stats,
        })
    }

    /// Opens the bucket, created when missing (file storage, one value per key, the stream's
    /// replicas, entries kept for `keep`). Its stream is created as a stream, laid out as a
    /// key-value bucket is: the client's bucket creation first asks for account details that a
    /// 2.9 server answers in a shape the client does not read.
    pub async fn open(
        &self,
        client: &async_nats::Client,
        js: &async_nats::jetstream::Context,
        cfg: &BusConfig,
        keep: Duration,
    ) -> Result<(), BusError> {
        use async_nats::jetstream::stream;
        if self.store.initialized() {
            return Ok(());
        }
        let name = bucket(&cfg.stream);
        let err = |e: &dyn std::fmt::Display| BusError::Stream {
            stream: format!("KV_{name}"),
            message: e.to_string(),
        };
        js.get_or_create_stream(stream::Config {
            name: format!("KV_{name}"),
            description: Some("revenant: notifications already sent".into()),
            subjects: vec![format!("$KV.{name}.>")],
            max_messages_per_subject: 1,
            max_age: keep,
            storage: stream::StorageType::File,
            num_replicas: cfg.replicas,
            allow_rollup: true,
            deny_delete: true,
            allow_direct: true,
            discard: stream::DiscardPolicy::New,
            ..Default::default()
        })
        .await
        .map_err(|e| err(&e))?;
        let store = js.get_key_value(&name).await.map_err(|e| err(&e))?;
        let _ = self.store.set((store, client.clone()));
        Ok(())
    }

    /// The bucket while its connection is up (a request on a dropped connection would only
    /// wait out its timeout).
    fn reachable(&self) -> Option<&kv::Store> {
        self.store
            .get()
            .filter(|(_, c)| c.connection_state() == async_nats::connection::State::Connected)
            .map(|(s, _)| s)
    }

    async fn sent_before_one(&self, key: &str) -> Option<bool> {
        let Some(store) = self.reachable() else {
            self.stats.unavailable.fetch_add(1, Relaxed);
            return None;
        };
        match tokio::time::timeout(CLAIM_TIMEOUT, store.get(key)).await {
            Ok(Ok(found)) => {
                let c = if found.is_some() {
                    &self.stats.sent_before
                } else {
                    &self.stats.new
                };
                c.fetch_add(1, Relaxed);
                Some(found.is_some())
            }
            Ok(Err(e)) => {
                self.stats.unavailable.fetch_add(1, Relaxed);
                tracing::warn!(error = %e, "notification claim lookup failed: held");
                None
            }
            Err(_) => {
                self.stats.unavailable.fetch_add(1, Relaxed);
                tracing::warn!("notification claim lookup timed out: held");
                None
            }
        }
    }

    async fn record_one(&self, key: &str) {
        let Some(store) = self.reachable() else {
            self.stats.unrecorded.fetch_add(1, Relaxed);
            tracing::warn!(
                "notification claim not recorded (NATS away): a restart may send it again"
            );
            return;
        };
        // Only if absent (JetStream decides it atomically): of two processes racing on one key,
        // one records it and the other finds it there.
        match tokio::time::timeout(CLAIM_TIMEOUT, store.create(key, "1".into())).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
            Ok(Err(e)) => {
                self.stats.unrecorded.fetch_add(1, Relaxed);
                tracing::warn!(error = %e, "notification claim not recorded: a restart may send it again");
            }
            Err(_) => {
                self.stats.unrecorded.fetch_add(1, Relaxed);
                tracing::warn!(
                    "notification claim not recorded in time: a restart may send it again"
                );
            }
        }
    }
}

impl NotificationClaims for Claims {
    fn sent_before<'a>(&'a self, keys: &'a [String]) -> ClaimFuture<'a, Vec<Option<bool>>> {
        Box::pin(join_all(keys.iter().map(|k| self.sent_before_one(k))))
    }

    fn record<'a>(&'a self, keys: &'a [String]) -> ClaimFuture<'a, ()> {
        Box::pin(async move {
            join_all(keys.iter().map(|k| self.record_one(k))).await;
        })
    }
}
