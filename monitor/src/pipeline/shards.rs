//! The engine the engine task drives: one checker on the task's own thread, or the engine split
//! over shards ([`crate::engine::shard`]), each shard a checker on a thread of its own.
//!
//! With shards the task routes each batch (the taps have seen it) and hands every shard the
//! batch, shared, not copied, with the indices of its part, through a bounded channel. A shard
//! that falls behind holds the task, which holds the event channel, which the sources answer as
//! they answer a slow engine. A tick goes to every shard behind what they were given and waits
//! for all of them: the deadlines are judged at one watermark, and the taps get the shards'
//! counters summed. Each shard hands its violations through the merge (one finding per identity
//! across shards) straight to the dispatcher.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use tokio::sync::{mpsc, oneshot};

use crate::engine::check::metrics::CheckerSnapshot;
use crate::engine::check::{Checker, CheckerConfig, RuleSet};
use crate::engine::shard::{Route, Sent, ShardMerge, ShardRouter};
use crate::event::EventBatch;
use crate::violation::Violation;

use super::ViolationSender;

/// Batches a shard may have queued before the task waits for it.
const SHARD_QUEUE: usize = 8;

/// The engine as the task is given it.
pub enum Engine {
    /// One checker, on the engine task's thread.
    One(Box<Checker>),
    /// Checkers with the same rules, each given its share of the limits, one per shard.
    Shards(Vec<Checker>),
}

impl Engine {
    /// `shards` checkers of `rules`, the attempt, tombstone and request limits of `cfg` split
    /// evenly between them; one shard is one checker on the task's thread.
    pub fn new(rules: &RuleSet, cfg: &CheckerConfig, shards: usize) -> Engine {
        if shards <= 1 {
            return Engine::One(Box::new(Checker::new(rules.clone(), cfg.clone())));
        }
        let share = |n: usize| n.div_ceil(shards).max(1);
        let part = CheckerConfig {
            max_attempts: share(cfg.max_attempts),
            max_tombstones: share(cfg.max_tombstones),
            max_requests: share(cfg.max_requests),
            ..cfg.clone()
        };
        Engine::Shards(
            (0..shards)
                .map(|_| Checker::new(rules.clone(), part.clone()))
                .collect(),
        )
    }

    /// How many checkers judge.
    pub fn shards(&self) -> usize {
        match self {
            Engine::One(_) => 1,
            Engine::Shards(c) => c.len(),
        }
    }

    pub(super) fn watermark_from_ticks_only(&mut self) {
        match self {
            Engine::One(c) => c.watermark_from_ticks_only(),
            Engine::Shards(cs) => cs.iter_mut().for_each(Checker::watermark_from_ticks_only),
        }
    }
}

/// What a shard is asked to do.
enum Work {
    /// A batch and the shard's part of it (and of the events that waited for their room).
    Events(Arc<EventBatch>, Vec<Item>),
    /// Judge deadlines up to the watermark (if any), then answer with the counters.
    Tick {
        watermark: Option<u64>,
        now_ns: u64,
        reply: oneshot::Sender<CheckerSnapshot>,
    },
}

/// One event for a shard, with the newest event time of the whole input before it.
enum Item {
    /// The batch's event at this index.
    At(u32, u64),
    /// An event that waited for its room.
    Own(Box<crate::event::LifecycleEvent>, u64),
}

/// Each shard's part of what the router sends on.
fn parts(n: usize, events: usize) -> Vec<Vec<Item>> {
    (0..n).map(|_| Vec::with_capacity(events / n + 1)).collect()
}

fn collect(parts: &mut [Vec<Item>]) -> impl FnMut(Route, u64, Sent<'_>) + '_ {
    move |route, newest_before_ns, sent| {
        let item = || match sent {
            Sent::Batch(i, _) => Item::At(i as u32, newest_before_ns),
            Sent::Waited(e) => Item::Own(Box::new(e.clone()), newest_before_ns),
        };
        match route {
            Route::One(k) => parts[k as usize].push(item()),
            Route::All => parts.iter_mut().for_each(|p| p.push(item())),
        }
    }
}

/// Where the shards' findings go: through the merge, to the dispatcher.
#[derive(Clone)]
struct Delivery {
    merge: Arc<Mutex<ShardMerge>>,
    violations: ViolationSender,
    delivered: Arc<AtomicU64>,
}

impl Delivery {
    fn deliver(&self, shard: u16, found: Vec<Violation>) {
        if found.is_empty() {
            return;
        }
        let mut merge = self.merge.lock().unwrap_or_else(|p| p.into_inner());
        for mut v in found {
            if merge.admit(shard, &mut v) {
                self.delivered.fetch_add(1, Ordering::Relaxed);
                self.violations.offer(v);
            }
        }
    }
}

/// The running shards.
pub(super) struct ShardPool {
    router: ShardRouter,
    queues: Vec<mpsc::Sender<Work>>,
    threads: Vec<JoinHandle<()>>,
    delivery: Delivery,
}

impl ShardPool {
    /// Starts a thread per checker; their findings go to `violations`. A rid-only event waits
    /// at most `hold` of event time for an event that names its room.
    pub(super) fn start(
        checkers: Vec<Checker>,
        violations: ViolationSender,
        hold: std::time::Duration,
    ) -> std::io::Result<ShardPool> {
        let merge = ShardMerge::new(checkers[0].rules());
        let delivery = Delivery {
            merge: Arc::new(Mutex::new(merge)),
            violations,
            delivered: Arc::new(AtomicU64::new(0)),
        };
        let n = checkers.len();
        let mut pool = ShardPool {
            router: ShardRouter::new(n, hold.as_nanos() as u64),
            queues: Vec::with_capacity(n),
            threads: Vec::with_capacity(n),
            delivery,
        };
        for (k, checker) in checkers.into_iter().enumerate() {
            let (tx, rx) = mpsc::channel(SHARD_QUEUE);
            let shard = Shard {
                me: k as u16,
                checker,
                out: pool.delivery.clone(),
            };
            let thread = std::thread::Builder::new()
                .name(format!("revenant-shard-{k}"))
                .spawn(move || shard.judge(rx))?;
            pool.queues.push(tx);
            pool.threads.push(thread);
        }
        Ok(pool)
    }

    /// The newest event time given so far.
    pub(super) fn newest_ns(&self) -> u64 {
        self.router.newest_ns()
    }

    /// Violations the shards handed on so far.
    pub(super) fn delivered(&self) -> u64 {
        self.delivery.delivered.load(Ordering::Relaxed)
    }

    /// Routes `batch` and hands each shard the batch with its part.
    pub(super) async fn observe(&mut self, batch: EventBatch) -> std::io::Result<()> {
        let mut parts = parts(self.queues.len(), batch.len());
        self.router.route(&batch, collect(&mut parts));
        self.send(Arc::new(batch), parts).await
    }

    async fn send(&mut self, batch: Arc<EventBatch>, parts: Vec<Vec<Item>>) -> std::io::Result<()> {
        for (k, part) in parts.into_iter().enumerate() {
            if part.is_empty() {
                continue;
            }
            self.queues[k]
                .send(Work::Events(batch.clone(), part))
                .await
                .map_err(|_| stopped(k))?;
        }
        Ok(())
    }

    /// Judges deadlines up to `watermark` on every shard, after what each was given (and the
    /// rid-only events whose wait ran out by then, or all of them at the `last` tick); the
    /// shards' counters, summed, with the findings the merge dropped taken off.
    pub(super) async fn tick(
        &mut self,
        watermark: Option<u64>,
        now_ns: u64,
        last: bool,
    ) -> std::io::Result<CheckerSnapshot> {
        let mut released = parts(self.queues.len(), 0);
        if last {
            self.router.release_all(collect(&mut released));
        } else if let Some(w) = watermark {
            self.router.release(w, collect(&mut released));
        }
        self.send(Arc::new(Vec::new()), released).await?;
        let mut replies = Vec::with_capacity(self.queues.len());
        for (k, q) in self.queues.iter().enumerate() {
            let (reply, rx) = oneshot::channel();
            q.send(Work::Tick {
                watermark,
                now_ns,
                reply,
            })
            .await
            .map_err(|_| stopped(k))?;
            replies.push(rx);
        }
        let mut sum: Option<CheckerSnapshot> = None;
        for (k, rx) in replies.into_iter().enumerate() {
            let snap = rx.await.map_err(|_| stopped(k))?;
            match &mut sum {
                Some(s) => s.absorb(&snap),
                None => sum = Some(snap),
            }
        }
        let mut sum = sum.unwrap_or_default();
        sum.waits = self.router.waits();
        let merge = self
            .delivery
            .merge
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        for ((_, _, n), dropped) in sum.per_rule.iter_mut().zip(merge.dropped_per_rule()) {
            *n = n.saturating_sub(*dropped);
            sum.stats.violations = sum.stats.violations.saturating_sub(*dropped);
        }
        Ok(sum)
    }
}

impl Drop for ShardPool {
    /// Closes the queues and waits for the threads, which end once their queue is empty.
    fn drop(&mut self) {
        self.queues.clear();
        for (k, t) in self.threads.drain(..).enumerate() {
            if t.join().is_err() {
                tracing::error!(shard = k, "an engine shard's thread panicked");
            }
        }
    }
}

fn stopped(k: usize) -> std::io::Error {
    std::io::Error::other(format!(
        "engine shard {k} stopped (its thread ended before the engine did)"
    ))
}

/// One shard's thread: its checker.
struct Shard {
    me: u16,
    checker: Checker,
    out: Delivery,
}

impl Shard {
    fn judge(mut self, mut queue: mpsc::Receiver<Work>) {
        let mut found = Vec::new();
        while let Some(work) = queue.blocking_recv() {
            match work {
                Work::Events(batch, items) => {
                    for item in &items {
                        let (newest_before_ns, e) = match item {
                            Item::At(i, n) => (*n, &batch[*i as usize]),
                            Item::Own(e, n) => (*n, &**e),
                        };
                        found.extend(self.checker.follow(newest_before_ns));
                        found.extend(self.checker.observe(e));
                    }
                }
                Work::Tick {
                    watermark,
                    now_ns,
                    reply,
                } => {
                    if let Some(w) = watermark {
                        found.extend(self.checker.tick(w));
                    }
                    self.out.deliver(self.me, std::mem::take(&mut found));
                    let _ = reply.send(CheckerSnapshot::of(&self.checker, now_ns));
                    continue;
                }
            }
            self.out.deliver(self.me, std::mem::take(&mut found));
        }
    }
}
