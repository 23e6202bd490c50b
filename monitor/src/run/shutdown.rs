//! How `revenant run` stops: one [`Shutdown`] signal in phases that every task watches, the
//! drain budget shared by the phases, and the wait for a signal or the first failed receiver.

use std::future::Future;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio::task::JoinSet;

/// The phases of a shutdown, in order. A task stops at the phase that concerns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    Running,
    /// Sources stop: receivers refuse new requests and finish in-flight ones, the eBPF source
    /// sends what its ring still holds.
    StopSources,
    /// The engine task refuses new batches and drains what is queued.
    CloseEngine,
    /// The admin server stops (it outlives the rest: scrapes during the drain still answer).
    StopAdmin,
}

/// The shutdown signal; clones of [`Shutdown::at`] futures are handed to every task.
pub struct Shutdown {
    tx: watch::Sender<Phase>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Shutdown::new()
    }
}

impl Shutdown {
    pub fn new() -> Shutdown {
        Shutdown {
            tx: watch::Sender::new(Phase::Running),
        }
    }

    /// Moves to `phase` (never back).
    pub fn advance(&self, phase: Phase) {
        self.tx.send_if_modified(|p| {
            let later = phase > *p;
            if later {
                *p = phase;
            }
            later
        });
    }

    /// Resolves once the shutdown reached `phase`.
    pub fn at(&self, phase: Phase) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.tx.subscribe();
        async move {
            let _ = rx.wait_for(|p| *p >= phase).await;
        }
    }
}

/// The drain's time budget, started when the shutdown starts.
pub struct Drain {
    started: Instant,
    budget: Duration,
}

impl Drain {
    pub fn start(budget: Duration) -> Drain {
        Drain {
            started: Instant::now(),
            budget,
        }
    }

    /// What the receivers get to finish in-flight requests: half the budget. A client that keeps
    /// its connection open past that is cut off (its unacknowledged export will be retried).
    pub fn source_grace(&self) -> Duration {
        self.budget / 2
    }

    /// What is left of the budget.
    pub fn remaining(&self) -> Duration {
        self.budget.saturating_sub(self.started.elapsed())
    }

    pub fn budget(&self) -> Duration {
        self.budget
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

/// Resolves with the error of the first receiver task that ends (a receiver only ends early on
/// failure); pending forever when there is none.
pub async fn first_failure(servers: &mut JoinSet<Result<(), String>>) -> String {
    match servers.join_next().await {
        None => std::future::pending().await,
        Some(Ok(Ok(()))) => "receiver stopped unexpectedly".into(),
        Some(Ok(Err(e))) => e,
        Some(Err(e)) => e.to_string(),
    }
}

/// Waits up to `grace` for every task of `set` to end, then aborts the rest (with `warning`);
/// the first error is returned.
pub async fn join_within<T: 'static>(
    set: &mut JoinSet<Result<T, String>>,
    grace: Duration,
    warning: &str,
) -> Option<String> {
    let mut failure = None;
    let deadline = tokio::time::Instant::now() + grace;
    loop {
        match tokio::time::timeout_at(deadline, set.join_next()).await {
            Ok(None) => break,
            Ok(Some(Ok(Ok(_)))) => {}
            Ok(Some(Ok(Err(e)))) => {
                failure.get_or_insert(e);
            }
            Ok(Some(Err(e))) => {
                failure.get_or_insert(e.to_string());
            }
            Err(_) => {
                tracing::warn!(?grace, "{warning}");
                set.abort_all();
                break;
            }
        }
    }
    failure
}

/// Stop signals received since [`listen`] (the count only grows).
static RECEIVED: std::sync::OnceLock<watch::Receiver<u32>> = std::sync::OnceLock::new();

/// Listens for Ctrl-C (SIGINT), SIGTERM and SIGHUP from now on, for the rest of the process,
/// and counts them. Called once the runtime runs, before anything is announced ready: a signal
/// that comes between two waits (after start-up's, before the main loop's) is counted, not
/// lost (once tokio listens for a signal, its default action no longer ends the process).
/// SIGHUP is a stop, not a reload (revenant reads its configuration once): a closed terminal or
/// a supervisor's hang-up must not kill it without draining.
pub fn listen() -> watch::Receiver<u32> {
    RECEIVED
        .get_or_init(|| {
            let (tx, rx) = watch::channel(0u32);
            #[cfg(unix)]
            {
                use tokio::signal::unix::{SignalKind, signal};
                // Registered here, synchronously: from this call on no delivery is missed.
                let listen = |kind: SignalKind, name: &'static str| match signal(kind) {
                    Ok(s) => Some((s, name)),
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot listen for {name}; it will not stop revenant gracefully");
                        None
                    }
                };
                let mut kinds: Vec<_> = [
                    (SignalKind::interrupt(), "SIGINT"),
                    (SignalKind::terminate(), "SIGTERM"),
                    (SignalKind::hangup(), "SIGHUP"),
                ]
                .into_iter()
                .filter_map(|(k, n)| listen(k, n))
                .collect();
                tokio::spawn(async move {
                    while !kinds.is_empty() {
                        let next = kinds.iter_mut().map(|(s, name)| {
                            Box::pin(async move {
                                s.recv().await;
                                *name
                            })
                        });
                        let (name, _, _) = futures_util::future::select_all(next).await;
                        tracing::info!(signal = name, "signal received");
                        tx.send_modify(|n| *n += 1);
                    }
                });
            }
            #[cfg(not(unix))]
            tokio::spawn(async move {
                while tokio::signal::ctrl_c().await.is_ok() {
                    tracing::info!(signal = "Ctrl-C", "signal received");
                    tx.send_modify(|n| *n += 1);
                }
            });
            rx
        })
        .clone()
}

/// Once the `n`th stop signal since [`listen`] has come (at once if it already has).
pub async fn received(n: u32) {
    let mut rx = listen();
    let _ = rx.wait_for(|c| *c >= n).await;
}

/// A stop signal (SIGINT, SIGTERM or SIGHUP): each starts the same drain.
pub async fn signal() {
    received(1).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A signal that comes while nothing waits (between start-up's wait and the main loop's) is
    /// counted from `listen` on and ends the next wait at once. (Listening only while waiting
    /// lost it: the process, its default action replaced by tokio's handler, never stopped.)
    #[cfg(unix)]
    #[tokio::test]
    async fn a_signal_before_anyone_waits_is_not_lost() {
        let before = *listen().borrow();
        // SIGHUP, a stop for revenant: counted by the listener, harmless to the test process.
        assert_eq!(unsafe { libc::raise(libc::SIGHUP) }, 0);
        tokio::time::sleep(Duration::from_millis(50)).await;
        tokio::time::timeout(Duration::from_secs(5), received(before + 1))
            .await
            .expect("the signal raised before anyone waited was lost");
        assert!(
            tokio::time::timeout(Duration::from_millis(100), received(before + 2))
                .await
                .is_err(),
            "one signal counted twice"
        );
    }

    #[tokio::test]
    async fn phases_only_move_forward_and_wake_later_watchers() {
        let s = Shutdown::new();
        let sources = tokio::spawn(s.at(Phase::StopSources));
        let admin = s.at(Phase::StopAdmin);
        s.advance(Phase::CloseEngine);
        s.advance(Phase::StopSources);
        sources.await.unwrap();
        assert!(
            tokio::time::timeout(Duration::from_millis(20), admin)
                .await
                .is_err()
        );
        let mut none = JoinSet::new();
        assert!(
            tokio::time::timeout(Duration::from_millis(20), first_failure(&mut none))
                .await
                .is_err()
        );
        let mut one = JoinSet::new();
        one.spawn(async { Err::<(), _>("bind lost".to_string()) });
        assert_eq!(first_failure(&mut one).await, "bind lost");
    }
}
