//! Cluster mode's transport: normalized events from `revenant agent`s to `revenant checker`s
//! over NATS JetStream (an existing distributed log: ordering per subject, retention,
//! replication, publish deduplication by message id).
//!
//! ```text
//! agent (one per node)                         JetStream stream REVENANT            checker (N replicas)
//! sources ─► normalize ─► batcher ─► outbox ─► subjects REVENANT.p0 … p{P-1} ─► durable pull consumer
//!            (run's)      (partition,  (disk,   (one message = one batch)        per owned partition ─►
//!                          batch)      bounded)                                   dedup ─► engine ─► sinks
//! ```
//!
//! - [`partition`]: which partition an event goes to (pure; the rules of the split).
//! - [`wire`]: one message, a batch of events in the replay format with their ids.
//! - [`batcher`]: per-partition batches, sealed by size or linger.
//! - [`spool`]: the agent's bounded outbox on disk.
//! - [`publisher`]: the agent's publish loop (message ids, retries, readiness).
//! - [`progress`]: which batches a checker took and how far every agent's stream came (the
//!   watermark's bound).
//! - [`consumer`]: the checker's consumers, the hand-off to the engine, the start-up replay.
//! - [`claims`]: each violation notified once across checker lives and replicas.
//! - [`lease`]: which checker judges which partition (leases renewed in a key-value bucket,
//!   spread evenly, fenced by the holder's own clock).
//!
//! The engine knows nothing of this: the checker feeds it the same `EventBatch`es `run` does.

pub mod batcher;
pub mod claims;
pub mod consumer;
pub mod lease;
pub use crate::engine::partition;
pub mod progress;
pub mod publisher;
pub mod spool;
pub mod wire;

use std::time::Duration;

use serde::Deserialize;

use crate::duration;

/// The `bus` section of the config file (flags of `agent` and `checker` override it).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BusConfig {
    /// NATS server URLs, comma-separated (`nats://10.0.0.5:4222,nats://10.0.0.6:4222`).
    pub nats: Option<String>,
    /// JetStream stream name; also the subjects' prefix (`<stream>.p<k>`).
    pub stream: String,
    /// Partitions: subjects, and the unit a checker owns. Fixed for a stream's life (recorded
    /// in its description; an agent or checker with another count refuses to start).
    pub partitions: u32,
    /// Stream replicas (1, or 3 on a three-node NATS cluster).
    pub replicas: usize,
    /// Events per message.
    pub batch_events: usize,
    /// How long an open batch may wait for more events.
    #[serde(with = "duration")]
    pub batch_linger: Duration,
    /// How long the stream keeps events (checkers that were down catch up within it).
    #[serde(with = "duration")]
    pub retention: Duration,
    /// The agent's outbox bound, bytes.
    pub outbox_bytes: u64,
    /// The partitions this checker owns (`null`: all).
    pub owned: Option<Vec<u32>>,
    /// How far back, before where its consumers had come, a starting checker reads its
    /// partitions again to rebuild the engine's state (`null`: the engine's retention of ended
    /// attempts plus the allowed lateness, so that late activity is still caught after a
    /// restart).
    #[serde(with = "duration::option")]
    pub recovery_window: Option<Duration>,
    /// An agent stream heard nothing from for this long, while the checker is connected and
    /// caught up, stops holding the watermark back (the agent was killed or its node is gone);
    /// a batch its agent dropped is skipped after as long. Until then, verdicts that wait for
    /// the watermark wait for that agent.
    #[serde(with = "duration")]
    pub agent_silence: Duration,
    /// How long a checker's partition lease lasts unrenewed (`lease`): a partition whose owner
    /// stopped is taken by another checker about this long after its last renewal. The same on
    /// every checker of a stream (the lease bucket records it).
    #[serde(with = "duration")]
    pub lease_ttl: Duration,
}

impl Default for BusConfig {
    fn default() -> Self {
        BusConfig {
            nats: None,
            stream: "REVENANT".into(),
            partitions: 4,
            replicas: 1,
            batch_events: 512,
            batch_linger: Duration::from_millis(20),
            retention: Duration::from_secs(3600),
            outbox_bytes: 1 << 30,
            owned: None,
            recovery_window: None,
            agent_silence: Duration::from_secs(30),
            lease_ttl: Duration::from_secs(15),
        }
    }
}

/// Why the bus settings cannot be used (exit 2 before anything connects).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusConfigError {
    #[error("--nats is required (the NATS server URLs, e.g. nats://127.0.0.1:4222)")]
    NoUrl,
    #[error("--nats: {url:?} is not a NATS server URL: {message}")]
    Url { url: String, message: String },
    #[error("--stream {0:?}: a JetStream name (letters, digits, - and _; no spaces, dots, * or >)")]
    Stream(String),
    #[error("--partitions must be between 1 and 1024, got {0}")]
    Partitions(u32),
    #[error("--replicas must be between 1 and 5, got {0}")]
    Replicas(usize),
    #[error("--batch-events must be between 1 and 65536, got {0}")]
    BatchEvents(usize),
    #[error("--owned-partitions: partition {got} is not below --partitions {partitions}")]
    Owned { got: u32, partitions: u32 },
    #[error("--owned-partitions is empty")]
    NoneOwned,
    #[error(
        "--agent-silence {0:?} is shorter than two agent heartbeats ({heartbeat:?}): every idle agent would count as gone",
        heartbeat = batcher::HEARTBEAT * 2
    )]
    AgentSilence(Duration),
    #[error("--lease-ttl must be between 1s and 10m, got {0:?}")]
    LeaseTtl(Duration),
}

impl BusConfig {
    pub fn validate(&self) -> Result<(), BusConfigError> {
        if self.nats.as_deref().is_none_or(|u| u.trim().is_empty()) {
            return Err(BusConfigError::NoUrl);
        }
        self.servers()?;
        let ok_name = !self.stream.is_empty()
            && self
                .stream
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !ok_name {
            return Err(BusConfigError::Stream(self.stream.clone()));
        }
        if !(1..=1024).contains(&self.partitions) {
            return Err(BusConfigError::Partitions(self.partitions));
        }
        if !(1..=5).contains(&self.replicas) {
            return Err(BusConfigError::Replicas(self.replicas));
        }
        if !(1..=wire::MAX_EVENTS).contains(&self.batch_events) {
            return Err(BusConfigError::BatchEvents(self.batch_events));
        }
        if self.agent_silence < batcher::HEARTBEAT * 2 {
            return Err(BusConfigError::AgentSilence(self.agent_silence));
        }
        if !(Duration::from_secs(1)..=Duration::from_secs(600)).contains(&self.lease_ttl) {
            return Err(BusConfigError::LeaseTtl(self.lease_ttl));
        }
        if let Some(owned) = &self.owned {
            if owned.is_empty() {
                return Err(BusConfigError::NoneOwned);
            }
            if let Some(&got) = owned.iter().find(|k| **k >= self.partitions) {
                return Err(BusConfigError::Owned {
                    got,
                    partitions: self.partitions,
                });
            }
        }
        Ok(())
    }

    /// The server URLs of `nats`, each parsed.
    pub fn servers(&self) -> Result<Vec<async_nats::ServerAddr>, BusConfigError> {
        self.nats
            .as_deref()
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(|u| {
                u.parse::<async_nats::ServerAddr>()
                    .map_err(|e| BusConfigError::Url {
                        url: u.into(),
                        message: e.to_string(),
                    })
            })
            .collect()
    }

    /// The partitions this checker consumes, ascending, without repeats.
    pub fn owned_partitions(&self) -> Vec<u32> {
        let mut v = self
            .owned
            .clone()
            .unwrap_or_else(|| (0..self.partitions).collect());
        v.sort_unstable();
        v.dedup();
        v
    }

    /// What the stream's description records; a mismatch means another partition count.
    fn description(&self) -> String {
        format!("revenant lifecycle events; partitions={}", self.partitions)
    }
}

/// What can go wrong talking to JetStream.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("NATS {url}: {message}")]
    Connect { url: String, message: String },
    #[error("stream {stream}: {message}")]
    Stream { stream: String, message: String },
    #[error(
        "stream {stream} was created with {found:?}, this process is configured for partitions={partitions}: \
         give every agent and checker the same --partitions (or a new --stream)"
    )]
    Partitions {
        stream: String,
        found: String,
        partitions: u32,
    },
    #[error("consumer {name}: {message}")]
    Consumer { name: String, message: String },
    #[error(
        "lease bucket {bucket} was created with a TTL of {found:?}, this checker has --lease-ttl {given:?}: \
         give every checker of a stream the same --lease-ttl (or delete the stream KV_{bucket} while no checker runs)"
    )]
    LeaseTtl {
        bucket: String,
        found: Duration,
        given: Duration,
    },
}

/// A token unique to this process life (a restarted checker is a new member and a new
/// claimer): the pid and the start time.
pub(crate) fn life_token() -> String {
    static TOKEN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TOKEN
        .get_or_init(|| {
            format!(
                "{:08x}{:016x}",
                std::process::id(),
                crate::event::now_unix_ns()
            )
        })
        .clone()
}

/// Connects (in the background: an unreachable server is retried, not an error) and returns the
/// client.
pub async fn connect(cfg: &BusConfig, name: &str) -> Result<async_nats::Client, BusError> {
    let url = cfg.nats.clone().unwrap_or_default();
    let servers = cfg.servers().map_err(|e| BusError::Connect {
        url: url.clone(),
        message: e.to_string(),
    })?;
    async_nats::ConnectOptions::new()
        .name(name)
        .retry_on_initial_connect()
        .max_reconnects(None)
        .connect(servers)
        .await
        .map_err(|e| BusError::Connect {
            url,
            message: e.to_string(),
        })
}

/// The stream, created when missing (file storage, the configured replicas, retention and a
/// two-minute duplicate window); one whose description names another partition count is an
/// error.
pub async fn ensure_stream(
    js: &async_nats::jetstream::Context,
    cfg: &BusConfig,
) -> Result<async_nats::jetstream::stream::Stream, BusError> {
    use async_nats::jetstream::stream;
    let err = |e: &dyn std::fmt::Display| BusError::Stream {
        stream: cfg.stream.clone(),
        message: e.to_string(),
    };
    let mut s = js
        .get_or_create_stream(stream::Config {
            name: cfg.stream.clone(),
            description: Some(cfg.description()),
            subjects: vec![format!("{}.*", cfg.stream)],
            storage: stream::StorageType::File,
            num_replicas: cfg.replicas,
            max_age: cfg.retention,
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .map_err(|e| err(&e))?;
    let info = s.info().await.map_err(|e| err(&e))?;
    let found = info.config.description.clone().unwrap_or_default();
    if found != cfg.description() {
        return Err(BusError::Partitions {
            stream: cfg.stream.clone(),
            found,
            partitions: cfg.partitions,
        });
    }
    Ok(s)
}

/// The durable consumer of partition `k`: `<stream>-p<k>`, filtered on that one subject (a 2.9
/// server ignores multi-subject filters, so one consumer per partition), explicit acks.
pub async fn ensure_consumer(
    stream: &async_nats::jetstream::stream::Stream,
    cfg: &BusConfig,
    k: u32,
) -> Result<async_nats::jetstream::consumer::PullConsumer, BusError> {
    use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
    let name = format!("{}-p{k}", cfg.stream);
    stream
        .get_or_create_consumer(
            &name,
            pull::Config {
                durable_name: Some(name.clone()),
                filter_subject: batcher::subject(&cfg.stream, k),
                ack_policy: AckPolicy::Explicit,
                deliver_policy: DeliverPolicy::All,
                ack_wait: Duration::from_secs(30),
                max_ack_pending: 4096,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| BusError::Consumer {
            name,
            message: e.to_string(),
        })
}

/// How far a partition's durable consumer had come when this checker took the partition:
/// what [`consumer::recover`] reads again up to, and from before.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Resume {
    /// The last stream sequence it had delivered (0: nothing yet).
    pub delivered: u64,
    /// The last stream sequence acknowledged with everything before it (0: none).
    pub ack_floor: u64,
}

/// Partition `k`'s durable consumer as a checker finds it when it starts on the partition.
pub async fn resume_of(
    consumer: &async_nats::jetstream::consumer::PullConsumer,
) -> Result<Resume, BusError> {
    let mut c = consumer.clone();
    let info = c.info().await.map_err(|e| BusError::Consumer {
        name: consumer.cached_info().name.clone(),
        message: e.to_string(),
    })?;
    Ok(Resume {
        delivered: info.delivered.stream_sequence,
        ack_floor: info.ack_floor.stream_sequence,
    })
}

/// Partition `k`'s durable consumer for a checker that has just taken its lease: where the
/// previous incarnation had come is read, then it is deleted and created again to deliver from
/// after its acknowledgement floor. Deleting it ends every pull the previous owner may still
/// have open on it (a paused process's, say), so nothing of the partition is delivered to a
/// checker that no longer holds it and left waiting there for the acknowledgement timeout.
pub async fn take_over_consumer(
    stream: &async_nats::jetstream::stream::Stream,
    cfg: &BusConfig,
    k: u32,
) -> Result<(async_nats::jetstream::consumer::PullConsumer, Resume), BusError> {
    use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
    use async_nats::jetstream::context::ConsumerInfoErrorKind;
    let name = format!("{}-p{k}", cfg.stream);
    let err = |e: &dyn std::fmt::Display| BusError::Consumer {
        name: name.clone(),
        message: e.to_string(),
    };
    let resume = match stream.consumer_info(&name).await {
        Ok(info) => {
            stream.delete_consumer(&name).await.map_err(|e| err(&e))?;
            Resume {
                delivered: info.delivered.stream_sequence,
                ack_floor: info.ack_floor.stream_sequence,
            }
        }
        Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => Resume::default(),
        Err(e) => return Err(err(&e)),
    };
    let deliver_policy = match resume.ack_floor {
        0 => DeliverPolicy::All,
        a => DeliverPolicy::ByStartSequence {
            start_sequence: a + 1,
        },
    };
    let c = stream
        .create_consumer(pull::Config {
            durable_name: Some(name.clone()),
            filter_subject: batcher::subject(&cfg.stream, k),
            ack_policy: AckPolicy::Explicit,
            deliver_policy,
            ack_wait: Duration::from_secs(30),
            max_ack_pending: 4096,
            ..Default::default()
        })
        .await
        .map_err(|e| err(&e))?;
    Ok((c, resume))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_once_a_url_is_given_and_bad_values_are_named() {
        let mut c = BusConfig {
            nats: Some("nats://127.0.0.1:4222".into()),
            ..BusConfig::default()
        };
        c.validate().unwrap();
        assert_eq!(c.owned_partitions(), vec![0, 1, 2, 3]);
        c.owned = Some(vec![3, 1, 3]);
        assert_eq!(c.owned_partitions(), vec![1, 3]);
        c.owned = Some(vec![4]);
        assert_eq!(
            c.validate(),
            Err(BusConfigError::Owned {
                got: 4,
                partitions: 4
            })
        );
        c.owned = None;
        c.agent_silence = Duration::from_millis(900);
        assert_eq!(
            c.validate(),
            Err(BusConfigError::AgentSilence(Duration::from_millis(900)))
        );
        c.agent_silence = Duration::from_secs(1);
        c.validate().unwrap();
        c.lease_ttl = Duration::from_millis(500);
        assert_eq!(
            c.validate(),
            Err(BusConfigError::LeaseTtl(Duration::from_millis(500)))
        );
        c.lease_ttl = Duration::from_secs(3);
        c.validate().unwrap();
        c.stream = "a.b".into();
        assert!(matches!(c.validate(), Err(BusConfigError::Stream(_))));
        c.stream = "S".into();
        c.partitions = 0;
        assert_eq!(c.validate(), Err(BusConfigError::Partitions(0)));
        assert_eq!(BusConfig::default().validate(), Err(BusConfigError::NoUrl));
        let y: BusConfig =
            serde_saphyr::from_str("stream: X\npartitions: 2\nbatch_linger: 5ms\n").unwrap();
        assert_eq!(
            (y.partitions, y.batch_linger),
            (2, Duration::from_millis(5))
        );
        assert!(serde_saphyr::from_str::<BusConfig>("partitons: 2\n").is_err());
    }
}
