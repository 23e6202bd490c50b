//! Notifications sent once across checker lives and replicas (`alert::claims`), kept in a
//! JetStream key-value bucket, `<stream>_NOTIFIED`: one key per notification (its incident and
//! why it was notified), kept as long as a restarted checker may find the breach again (twice
//! the recovery window, at least the stream's retention).
//!
//! A checker that starts reads its partitions again from before where the last one stopped
//! (`consumer::recover`), and one that takes over a partition reads it again while the
//! partition's last owner may still be sending what it found there: both find the same
//! breaches. Before a notification is spooled its key is created with `claimed <life>` (only if
//! absent: JetStream decides it atomically, so of two checkers exactly one creates it); after
//! the spool has it the value becomes `spooled <life>`. A checker that finds the key already
//! there reads it: its own life's claim (an earlier create whose answer was lost) is its own; a
//! `spooled` one was sent; another life's `claimed` one is being sent (or its claimer died
//! between claim and spool) and is asked about again. A claim that cannot be answered (NATS
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
use crate::alert::claims::{Claim, ClaimFuture, NotificationClaims};
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
    pending: AtomicU64,
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
            "Notifications claimed before spooling (new: this checker sends it; sent_before: another checker life or replica sent it, skipped; \
             pending: another checker claimed it and has not spooled it yet, asked again; unavailable: the bucket did not answer, held and asked again) \
             and marked spooled after (unrecorded: the mark failed, another checker may send it again after a minute)",
            [
                ("new", &s.new),
                ("sent_before", &s.sent_before),
                ("pending", &s.pending),
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
    /// `claimed <life>`: this process life's claim.
    claimed: bytes::Bytes,
    /// `spooled <life>`.
    spooled: bytes::Bytes,
}

impl Claims {
    /// Claims with no bucket yet ([`Claims::open`] sets it); registers the counters.
    pub fn new(metrics: &Metrics) -> Arc<Claims> {
        let stats = Arc::new(ClaimStats::default());
        metrics.register_collector(ClaimCollector(stats.clone()));
        let life = super::life_token();
        Arc::new(Claims {
            store: OnceCell::new(),
            stats,
            claimed: format!("{CLAIMED}{life}").into(),
            spooled: format!("{SPOOLED}{life}").into(),
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

    async fn claim_one(&self, key: &str) -> Claim {
        let Some(store) = self.reachable() else {
            self.stats.unavailable.fetch_add(1, Relaxed);
            return Claim::Unknown;
        };
        let claim = match tokio::time::timeout(CLAIM_TIMEOUT, async {
            match store.create(key, self.claimed.clone()).await {
                Ok(_) => Ok(Claim::Ours),
                Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                    match store.get(key).await {
                        Ok(Some(v)) => Ok(self.holder(&v)),
                        // Gone between the create and the read (aged out): ask again.
                        Ok(None) => Ok(Claim::Unknown),
                        Err(e) => Err(e.to_string()),
                    }
                }
                Err(e) => Err(e.to_string()),
            }
        })
        .await
        {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "notification claim failed: held");
                Claim::Unknown
            }
            Err(_) => {
                tracing::warn!("notification claim timed out: held");
                Claim::Unknown
            }
        };
        let counter = match claim {
            Claim::Ours => &self.stats.new,
            Claim::SentBefore => &self.stats.sent_before,
            Claim::Pending => &self.stats.pending,
            Claim::Unknown => &self.stats.unavailable,
        };
        counter.fetch_add(1, Relaxed);
        claim
    }

    /// Who holds a key, from its value.
    fn holder(&self, value: &[u8]) -> Claim {
        if value == self.claimed.as_ref() {
            Claim::Ours
        } else if value.starts_with(CLAIMED.as_bytes()) {
            Claim::Pending
        } else {
            // `spooled <life>`, or a bucket written before claims had states ("1").
            Claim::SentBefore
        }
    }

    async fn mark_spooled(&self, key: &str) {
        let Some(store) = self.reachable() else {
            self.stats.unrecorded.fetch_add(1, Relaxed);
            tracing::warn!(
                "notification not marked spooled (NATS away): another checker may send it again"
            );
            return;
        };
        match tokio::time::timeout(CLAIM_TIMEOUT, store.put(key, self.spooled.clone())).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                self.stats.unrecorded.fetch_add(1, Relaxed);
                tracing::warn!(error = %e, "notification not marked spooled: another checker may send it again");
            }
            Err(_) => {
                self.stats.unrecorded.fetch_add(1, Relaxed);
                tracing::warn!(
                    "notification not marked spooled in time: another checker may send it again"
                );
            }
        }
    }
}

/// The value's prefix while a claimer has not spooled its notification.
const CLAIMED: &str = "claimed ";
/// The value's prefix once it has.
const SPOOLED: &str = "spooled ";

impl NotificationClaims for Claims {
    fn claim<'a>(&'a self, keys: &'a [String]) -> ClaimFuture<'a, Vec<Claim>> {
        Box::pin(join_all(keys.iter().map(|k| self.claim_one(k))))
    }

    fn spooled<'a>(&'a self, keys: &'a [String]) -> ClaimFuture<'a, ()> {
        Box::pin(async move {
            join_all(keys.iter().map(|k| self.mark_spooled(k))).await;
        })
    }
}
