//! Which checker judges which partition: leases in a JetStream key-value bucket,
//! `<stream>_LEASES`, that their holders must renew.
//!
//! **The bucket.** One key per partition (`p<k>`, its value the holder's token) and one per
//! live checker (`m.<token>`), in a stream laid out as a key-value bucket whose `max_age` is
//! nine tenths of `--lease-ttl` (the last tenth is the other checkers' look for free keys, so
//! that a partition is taken within the TTL of its owner's last renewal) and that keeps one
//! value per key: an entry nobody rewrites is removed by the
//! server that long after it was written, and the key is free. Every write of a partition key is a
//! compare-and-set on the key's last revision (`Nats-Expected-Last-Subject-Sequence`):
//! taking a free key expects "no entry" (or the deletion marker a release left), renewing one
//! expects the revision this holder last wrote. JetStream decides each of them atomically on
//! the stream's leader (through its Raft log at R3), so of two checkers racing for one key one
//! wins and the other is told "wrong last sequence". (JetStream 2.9 has no per-message TTL and
//! no lock primitive; a bucket with an age limit and revision-checked writes are the
//! lease.)
//!
//! **Fencing.** A holder takes the time `t0` on its own monotonic clock before it sends a
//! write; the server stores the entry at or after `t0`, and removes it no earlier than the age
//! limit `A` after that. The holder counts its lease valid until `t0 + A − margin` (a fifth of
//! `A`, for the clocks' rates and the time between a check and what it guards), so its
//! validity ends before the entry can be gone, and a successor can only write the key (a
//! create that expects no entry) after that. A checker judges a partition only while its
//! [`Fence`] holds: every verdict is checked against it just before it leaves the engine's
//! side of the checker, and so is every acknowledgement and every re-opening of the
//! partition's consumer. A paused process (SIGSTOP, a long GC-like stall, a VM frozen) finds
//! its fence expired by its own clock when it resumes, before anything it still had in
//! flight can be judged. A release revokes the fence first: on rebalancing the key is then left to
//! expire (what this checker found of the partition has a TTL to reach the sinks and the
//! notification claims before the next owner finds it again), at shutdown it is deleted once
//! the alert dispatcher has drained.
//!
//! **Spreading.** Checkers list the live member keys; sorted by token, member `i` of `N`
//! should hold `P/N` partitions, one more if `i < P mod N`. A checker above its share
//! releases its highest partitions, one below takes free ones, lowest first. Shares add up to
//! `P`, so a free partition is always someone's to take; a newcomer waits two looks before
//! taking anything so that checkers started together see each other first.
//!
//! The checker (`run/checker.rs`) rebuilds its engine whenever its set changes: it reads its
//! partitions again from the recovery window, as a restarted checker does, so what a takeover
//! brings is judged with the state it needs, and what the previous owner found and notified
//! is found again and not sent twice (`claims`).

use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use async_nats::jetstream::kv;
use futures_util::StreamExt;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use tokio::sync::watch;

use super::{BusConfig, BusError};
use crate::telemetry::metrics::{Metrics, counter, counters, gauge};

/// The bucket's name for a stream.
pub fn bucket(stream: &str) -> String {
    format!("{stream}_LEASES")
}

/// The key of partition `k`.
fn partition_key(k: u32) -> String {
    format!("p{k}")
}

fn base() -> Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    *BASE.get_or_init(Instant::now)
}

/// Nanoseconds of `t` since this process's base instant (monotonic), at least 1.
fn mono_ns(t: Instant) -> u64 {
    (t.saturating_duration_since(base()).as_nanos() as u64).max(1)
}

/// Until when this checker may judge the partitions of one ownership: a deadline on the
/// process's monotonic clock (0: revoked). Cloned into every place that acts for a partition.
#[derive(Debug, Clone)]
pub struct Fence(Arc<AtomicU64>);

impl Fence {
    /// A fence that always holds (`--owned-partitions`: the operator owns the split).
    pub fn always() -> Fence {
        Fence(Arc::new(AtomicU64::new(u64::MAX)))
    }

    fn until(deadline: Instant) -> Fence {
        Fence(Arc::new(AtomicU64::new(mono_ns(deadline))))
    }

    /// Whether the leases behind it are still provably held, by this process's clock now.
    pub fn holds(&self) -> bool {
        mono_ns(Instant::now()) < self.0.load(Ordering::Acquire)
    }

    /// Ends it for good (never extended again).
    pub fn revoke(&self) {
        self.0.store(0, Ordering::Release);
    }

    /// Moves the deadline (renewals), unless it was revoked.
    fn extend(&self, deadline: Instant) {
        let d = mono_ns(deadline);
        let _ = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                (v != 0).then_some(d)
            });
    }
}

/// The partitions this checker may judge now, and the fence they are judged under. A new
/// `epoch` is a new set: the checker's engine is rebuilt for it.
#[derive(Debug, Clone)]
pub struct Ownership {
    pub epoch: u64,
    pub partitions: Vec<u32>,
    pub fence: Fence,
}

/// Counters and the gauge of the leases, rendered at every scrape.
#[derive(Debug, Default)]
pub struct LeaseStats {
    pub owned: AtomicU64,
    /// The stream's partitions (what the checkers together should hold).
    pub partitions: AtomicU64,
    pub acquired: AtomicU64,
    pub released: AtomicU64,
    pub lost_expired: AtomicU64,
    pub lost_taken: AtomicU64,
    pub requests: AtomicU64,
    pub failed_requests: AtomicU64,
    pub members: AtomicU64,
    /// Verdicts dropped because the fence no longer held (the partition's next owner judges them).
    pub fenced_verdicts: AtomicU64,
    /// Ownership changes, each a rebuild of the engine.
    pub rebuilds: AtomicU64,
}

#[derive(Debug)]
struct LeaseCollector(Arc<LeaseStats>);

impl Collector for LeaseCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let s = &self.0;
        gauge(
            &mut enc,
            "revenant_checker_owned_partitions",
            "Partitions this checker holds the lease of (or is pinned to) and judges",
            s.owned.load(Relaxed) as i64,
        )?;
        gauge(
            &mut enc,
            "revenant_checker_stream_partitions",
            "Partitions of the stream this checker reads (the checkers of a stream together hold them all)",
            s.partitions.load(Relaxed) as i64,
        )?;
        gauge(
            &mut enc,
            "revenant_checker_lease_members",
            "Live checkers sharing this stream's partitions, as this checker last listed them",
            s.members.load(Relaxed) as i64,
        )?;
        counter(
            &mut enc,
            "revenant_checker_leases_acquired",
            "Partition leases taken (at start, after an owner stopped renewing, or handed over)",
            s.acquired.load(Relaxed),
        )?;
        counter(
            &mut enc,
            "revenant_checker_leases_released",
            "Partition leases given up on purpose (rebalancing, shutdown)",
            s.released.load(Relaxed),
        )?;
        counters(
            &mut enc,
            "revenant_checker_leases_lost",
            "Partition leases lost (expired: not renewed in time by this checker's clock; taken: another checker wrote the key)",
            [("expired", &s.lost_expired), ("taken", &s.lost_taken)]
                .into_iter()
                .map(|(r, n)| ([("reason", r)], n.load(Relaxed))),
        )?;
        counter(
            &mut enc,
            "revenant_checker_lease_requests",
            "Requests to the lease bucket (its cost on NATS)",
            s.requests.load(Relaxed),
        )?;
        counter(
            &mut enc,
            "revenant_checker_lease_request_failures",
            "Requests to the lease bucket that failed or timed out",
            s.failed_requests.load(Relaxed),
        )?;
        counter(
            &mut enc,
            "revenant_checker_fenced_verdicts",
            "Verdicts not sent because this checker could no longer prove it held their partitions' leases",
            s.fenced_verdicts.load(Relaxed),
        )?;
        counter(
            &mut enc,
            "revenant_checker_ownership_changes",
            "Changes of the partition set, each one a rebuild of the engine from the recovery window",
            s.rebuilds.load(Relaxed),
        )
    }
}

/// Registers the lease series (pinned checkers too, so dashboards read the same names).
pub fn register(metrics: &Metrics) -> Arc<LeaseStats> {
    let stats = Arc::new(LeaseStats::default());
    metrics.register_collector(LeaseCollector(stats.clone()));
    stats
}

/// One lease this checker holds.
#[derive(Debug, Clone, Copy)]
struct Held {
    revision: u64,
    /// Until when it is provably ours.
    valid_until: Instant,
    /// When the write behind `valid_until` was sent.
    written: Instant,
}

/// Timing, all from `--lease-ttl`, the longest a partition goes unjudged after its owner's
/// last renewal: the bucket removes an entry `expiry` (nine tenths of it) after it was written,
/// and a free key is found within one look (the last tenth).
#[derive(Debug, Clone, Copy)]
struct Timing {
    /// The bucket's age limit.
    expiry: Duration,
    margin: Duration,
    renew_every: Duration,
    look_every: Duration,
    request: Duration,
}

impl Timing {
    /// The lease a write sent at `sent` and stored as `revision` gives: provably ours until the
    /// age limit after `sent` less the margin (the server stores it no earlier than `sent`, so it
    /// cannot expire, and no successor can take the key, before then).
    fn held(&self, revision: u64, sent: Instant) -> Held {
        Held {
            revision,
            valid_until: sent + self.expiry - self.margin,
            written: sent,
        }
    }

    fn of(ttl: Duration) -> Timing {
        let look_every = ttl / 10;
        let expiry = ttl - look_every;
        Timing {
            expiry,
            margin: expiry / 5,
            // Three tries before the fence drops (at 4/5 of the expiry).
            renew_every: expiry / 4,
            look_every,
            request: (expiry / 5).max(Duration::from_millis(200)),
        }
    }
}

/// Why a look at the bucket did not complete.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("lease bucket: {0}")]
    Bucket(String),
    #[error("lease bucket: no answer within {0:?}")]
    Timeout(Duration),
}

/// The lease loop's state.
pub struct Leases {
    store: kv::Store,
    kv_stream: async_nats::jetstream::stream::Stream,
    bucket: String,
    token: String,
    value: bytes::Bytes,
    partitions: u32,
    timing: Timing,
    held: BTreeMap<u32, Held>,
    member_written: Option<Instant>,
    joined: Instant,
    /// Whether a look completed once (the first ownership, even empty, is published then).
    looked: bool,
    epoch: u64,
    fence: Fence,
    tx: watch::Sender<Ownership>,
    stats: Arc<LeaseStats>,
}

impl Leases {
    /// Opens the bucket (created when missing, with the stream's replicas and file storage: a
    /// NATS restart must not forget a lease a live checker still counts on), and returns the
    /// loop and the ownership it publishes (empty at first).
    pub async fn open(
        js: &async_nats::jetstream::Context,
        cfg: &BusConfig,
        node: &str,
        stats: Arc<LeaseStats>,
    ) -> Result<(Leases, watch::Receiver<Ownership>), BusError> {
        use async_nats::jetstream::stream;
        let name = bucket(&cfg.stream);
        let err = |e: &dyn std::fmt::Display| BusError::Stream {
            stream: format!("KV_{name}"),
            message: e.to_string(),
        };
        // Laid out as a key-value bucket, created as a stream (as `claims` does: the client's
        // bucket creation asks a 2.9 server for account details it cannot read).
        let kv_stream = js
            .get_or_create_stream(stream::Config {
                name: format!("KV_{name}"),
                description: Some("revenant: checker partition leases".into()),
                subjects: vec![format!("$KV.{name}.>")],
                max_messages_per_subject: 1,
                max_age: Timing::of(cfg.lease_ttl).expiry,
                storage: stream::StorageType::File,
                num_replicas: cfg.replicas,
                allow_rollup: true,
                allow_direct: true,
                ..Default::default()
            })
            .await
            .map_err(|e| err(&e))?;
        let found = kv_stream.cached_info().config.max_age;
        if found != Timing::of(cfg.lease_ttl).expiry {
            return Err(BusError::LeaseTtl {
                bucket: name,
                // The TTL whose nine tenths the bucket's age limit is.
                found: found * 10 / 9,
                given: cfg.lease_ttl,
            });
        }
        let store = js.get_key_value(&name).await.map_err(|e| err(&e))?;
        let token = super::life_token();
        let value = bytes::Bytes::from(format!("{token} {node} {}", std::process::id()));
        let fence = Fence::until(Instant::now());
        fence.revoke();
        let (tx, rx) = watch::channel(Ownership {
            epoch: 0,
            partitions: Vec::new(),
            fence: fence.clone(),
        });
        Ok((
            Leases {
                store,
                kv_stream,
                bucket: name,
                token,
                value,
                partitions: cfg.partitions,
                timing: Timing::of(cfg.lease_ttl),
                held: BTreeMap::new(),
                member_written: None,
                joined: Instant::now(),
                looked: false,
                epoch: 0,
                fence,
                tx,
                stats,
            },
            rx,
        ))
    }

    /// This checker's token (the value of the keys it holds starts with it).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// Looks at the bucket every tenth of the TTL until `stop`, then releases what it holds
    /// (the fence first; the checker stops it once its verdicts are delivered) so that the next
    /// owners need not wait for the TTL.
    pub async fn run(mut self, stop: impl std::future::Future<Output = ()>) {
        let mut stop = std::pin::pin!(stop);
        let mut iv = tokio::time::interval(self.timing.look_every);
        iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = &mut stop => break,
                _ = iv.tick() => {}
            }
            if let Err(e) = self.round().await {
                tracing::warn!(error = %e, "partition leases: look at the bucket failed");
            }
        }
        self.release_all().await;
    }

    async fn timed<T, E: std::fmt::Display>(
        &self,
        f: impl std::future::Future<Output = Result<T, E>>,
    ) -> Result<T, LeaseError> {
        self.stats.requests.fetch_add(1, Relaxed);
        match tokio::time::timeout(self.timing.request, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                self.stats.failed_requests.fetch_add(1, Relaxed);
                Err(LeaseError::Bucket(e.to_string()))
            }
            Err(_) => {
                self.stats.failed_requests.fetch_add(1, Relaxed);
                Err(LeaseError::Timeout(self.timing.request))
            }
        }
    }

    /// One look: drop what expired, renew what is due, list the members, then release or take
    /// to reach this checker's share; publishes a new ownership when the set changed.
    async fn round(&mut self) -> Result<(), LeaseError> {
        let mut changed = self.expire(Instant::now());
        // The member key first: it then expires no later than the partitions written after it,
        // so that a dead checker's share is recounted by the time its partitions are free.
        let due = |w: Option<Instant>| w.is_none_or(|w| w.elapsed() >= self.timing.renew_every);
        if due(self.member_written) {
            let key = format!("m.{}", self.token);
            let sent = Instant::now();
            if self
                .timed(self.store.put(&key, self.value.clone()))
                .await
                .is_ok()
            {
                self.member_written = Some(sent);
            }
        }
        changed |= self.renew().await;
        let members = self.members().await;
        let result = match members {
            Ok(members) => {
                self.stats.members.store(members.len() as u64, Relaxed);
                changed |= !std::mem::replace(&mut self.looked, true);
                let share = share(self.partitions, &members, &self.token);
                if self.held.len() > share {
                    changed |= self.release_extra(share).await;
                } else if self.held.len() < share
                    && self.joined.elapsed() >= self.timing.look_every * 2
                {
                    changed |= self.take(share).await;
                }
                Ok(())
            }
            Err(e) => Err(e),
        };
        changed |= self.expire(Instant::now());
        self.publish(changed);
        result
    }

    /// Drops every lease whose validity ran out on this clock.
    fn expire(&mut self, now: Instant) -> bool {
        let before = self.held.len();
        self.held.retain(|k, h| {
            let ok = h.valid_until > now;
            if !ok {
                tracing::warn!(
                    partition = k,
                    "partition lease expired before it was renewed: no longer judged here"
                );
            }
            ok
        });
        let lost = before - self.held.len();
        self.stats.lost_expired.fetch_add(lost as u64, Relaxed);
        lost > 0
    }

    async fn renew(&mut self) -> bool {
        let mut changed = false;
        let due: Vec<(u32, Held)> = self
            .held
            .iter()
            .filter(|(_, h)| h.written.elapsed() >= self.timing.renew_every)
            .map(|(k, h)| (*k, *h))
            .collect();
        for (k, h) in due {
            let sent = Instant::now();
            let key = partition_key(k);
            self.stats.requests.fetch_add(1, Relaxed);
            let r = tokio::time::timeout(
                self.timing.request,
                self.store.update(&key, self.value.clone(), h.revision),
            )
            .await;
            match r {
                Ok(Ok(revision)) => {
                    self.held.insert(k, self.timing.held(revision, sent));
                }
                Ok(Err(e)) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                    // Either an earlier renewal of ours was stored but its answer lost (the
                    // entry is still ours: go on from its revision, keeping the older, safe
                    // deadline), or the key expired and another checker took it.
                    match self.timed(self.store.entry(&key)).await {
                        Ok(Some(e))
                            if e.operation == kv::Operation::Put && self.is_ours(&e.value) =>
                        {
                            if let Some(h) = self.held.get_mut(&k) {
                                h.revision = e.revision;
                            }
                        }
                        Ok(_) => {
                            self.held.remove(&k);
                            self.stats.lost_taken.fetch_add(1, Relaxed);
                            tracing::warn!(
                                partition = k,
                                "partition lease taken by another checker: no longer judged here"
                            );
                            changed = true;
                        }
                        // Unknown: the fence decides when the deadline passes.
                        Err(_) => {}
                    }
                }
                Ok(Err(e)) => {
                    self.stats.failed_requests.fetch_add(1, Relaxed);
                    tracing::warn!(partition = k, error = %e, "partition lease not renewed; retrying");
                }
                Err(_) => {
                    self.stats.failed_requests.fetch_add(1, Relaxed);
                    tracing::warn!(partition = k, "partition lease renewal timed out; retrying");
                }
            }
        }
        changed
    }

    fn is_ours(&self, value: &[u8]) -> bool {
        value.split(|b| *b == b' ').next() == Some(self.token.as_bytes())
    }

    /// The live members' tokens, sorted (this checker's included even before its key is seen).
    async fn members(&self) -> Result<Vec<String>, LeaseError> {
        let prefix = format!("$KV.{}.m.", self.bucket);
        let mut info = self
            .timed(self.kv_stream.info_with_subjects(format!("{prefix}>")))
            .await?;
        let mut members = vec![self.token.clone()];
        // The first page came with the info (a page holds thousands of subjects).
        loop {
            let next = tokio::time::timeout(self.timing.request, info.next()).await;
            match next {
                Ok(Some(Ok((subject, _)))) => {
                    if let Some(t) = subject.strip_prefix(&prefix) {
                        members.push(t.to_owned());
                    }
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => return Err(LeaseError::Bucket(e.to_string())),
                Err(_) => return Err(LeaseError::Timeout(self.timing.request)),
            }
        }
        members.sort_unstable();
        members.dedup();
        Ok(members)
    }

    /// Gives up the highest partitions above `share`: the fence first (nothing of them is
    /// judged here from now), then they are no longer renewed, and the next owner takes each
    /// when its key expires. Not deleted: the TTL also lets what this checker had already
    /// found of them reach the sinks and the notification claims before the next owner, which
    /// finds it again, looks them up.
    async fn release_extra(&mut self, share: usize) -> bool {
        let extra: Vec<u32> = self
            .held
            .keys()
            .rev()
            .take(self.held.len() - share)
            .copied()
            .collect();
        if extra.is_empty() {
            return false;
        }
        self.fence.revoke();
        for k in extra {
            self.held.remove(&k);
            self.stats.released.fetch_add(1, Relaxed);
            tracing::info!(
                partition = k,
                "partition lease given up (rebalancing): no longer renewed"
            );
        }
        true
    }

    async fn release(&self, k: u32, h: Held) {
        self.stats.released.fetch_add(1, Relaxed);
        let key = partition_key(k);
        match self
            .timed(self.store.delete_expect_revision(&key, Some(h.revision)))
            .await
        {
            Ok(()) => tracing::info!(partition = k, "partition lease released"),
            // Not deleted: it expires after the TTL, and is taken then.
            Err(e) => {
                tracing::warn!(partition = k, error = %e, "partition lease not released (it expires)")
            }
        }
    }

    /// Takes free partitions, lowest first, until `share` are held.
    async fn take(&mut self, share: usize) -> bool {
        let mut changed = false;
        for k in 0..self.partitions {
            if self.held.len() >= share {
                break;
            }
            if self.held.contains_key(&k) {
                continue;
            }
            let key = partition_key(k);
            let free = match self.timed(self.store.entry(&key)).await {
                Ok(None) => true,
                Ok(Some(e)) => e.operation != kv::Operation::Put,
                Err(_) => false,
            };
            if !free {
                continue;
            }
            let sent = Instant::now();
            self.stats.requests.fetch_add(1, Relaxed);
            match tokio::time::timeout(
                self.timing.request,
                self.store.create(&key, self.value.clone()),
            )
            .await
            {
                Ok(Ok(revision)) => {
                    self.held.insert(k, self.timing.held(revision, sent));
                    self.stats.acquired.fetch_add(1, Relaxed);
                    tracing::info!(partition = k, "partition lease taken: judged here from now");
                    changed = true;
                }
                // Another checker was first.
                Ok(Err(e)) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
                Ok(Err(e)) => {
                    self.stats.failed_requests.fetch_add(1, Relaxed);
                    tracing::warn!(partition = k, error = %e, "partition lease not taken");
                }
                // Unknown whether it was written: if it was, it expires unrenewed after the TTL.
                Err(_) => {
                    self.stats.failed_requests.fetch_add(1, Relaxed);
                }
            }
        }
        changed
    }

    /// A new ownership (the old fence revoked) when the set changed; else the fence extended
    /// to the earliest validity of what is held.
    fn publish(&mut self, changed: bool) {
        let valid = self.held.values().map(|h| h.valid_until).min();
        self.stats.owned.store(self.held.len() as u64, Relaxed);
        if changed {
            self.fence.revoke();
            self.fence = Fence::until(valid.unwrap_or_else(Instant::now));
            if valid.is_none() {
                self.fence.revoke();
            }
            self.epoch += 1;
            self.stats.rebuilds.fetch_add(1, Relaxed);
            let partitions: Vec<u32> = self.held.keys().copied().collect();
            tracing::info!(partitions = ?partitions, epoch = self.epoch, "partition ownership changed");
            self.tx.send_replace(Ownership {
                epoch: self.epoch,
                partitions,
                fence: self.fence.clone(),
            });
        } else if let Some(v) = valid {
            self.fence.extend(v);
        }
    }

    async fn release_all(&mut self) {
        self.fence.revoke();
        let held = std::mem::take(&mut self.held);
        for (k, h) in held {
            self.release(k, h).await;
        }
        self.stats.owned.store(0, Relaxed);
        // The member key purged outright (no deletion marker that would count as a member).
        let subject = format!("$KV.{}.m.{}", self.bucket, self.token);
        let _ = self
            .timed(std::future::IntoFuture::into_future(
                self.kv_stream.purge().filter(subject),
            ))
            .await;
    }
}

/// How many partitions the member `me` should hold: `P/N`, one more for the first `P mod N`
/// members in token order.
fn share(partitions: u32, members: &[String], me: &str) -> usize {
    let n = members.len().max(1);
    let i = members.iter().position(|m| m == me).unwrap_or(n - 1);
    let p = partitions as usize;
    p / n + usize::from(i < p % n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partition_is_free_within_the_ttl_and_its_holder_stops_before_it_is() {
        for ttl in [1, 3, 15, 600].map(Duration::from_secs) {
            let t = Timing::of(ttl);
            // Entry removed at most `expiry` after the last write, found within a look.
            assert!(t.expiry + t.look_every <= ttl, "{ttl:?}");
            // The holder's validity ends before the server can remove its entry.
            assert!(t.expiry - t.margin < t.expiry);
            // At least three renewals fit in the validity.
            assert!(t.renew_every * 3 <= t.expiry - t.margin, "{ttl:?}");
        }
    }

    #[test]
    fn shares_add_up_to_the_partitions_and_differ_by_at_most_one() {
        for p in 1..20u32 {
            for n in 1..8usize {
                let members: Vec<String> = (0..n).map(|i| format!("m{i:02}")).collect();
                let shares: Vec<usize> = members.iter().map(|m| share(p, &members, m)).collect();
                assert_eq!(shares.iter().sum::<usize>(), p as usize, "{p} over {n}");
                let (lo, hi) = (shares.iter().min().unwrap(), shares.iter().max().unwrap());
                assert!(hi - lo <= 1, "{p} over {n}: {shares:?}");
            }
        }
    }

    #[test]
    fn a_fence_holds_until_its_deadline_and_never_after_a_revoke() {
        let f = Fence::until(Instant::now() + Duration::from_secs(60));
        assert!(f.holds());
        f.extend(Instant::now() + Duration::from_secs(120));
        assert!(f.holds());
        f.revoke();
        assert!(!f.holds());
        f.extend(Instant::now() + Duration::from_secs(120));
        assert!(!f.holds(), "a revoked fence is never extended again");
        let past = Fence::until(Instant::now());
        assert!(!past.holds());
        assert!(Fence::always().holds());
    }
}
