//! Bounded polling, the one wait the async tests use instead of a sleep: a condition checked
//! every 50 ms until it holds, a panic naming what never came once the bound is reached. Any
//! runtime: the pause between polls is a timer thread, so this crate needs no tokio.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

const POLL: Duration = Duration::from_millis(50);

/// Polls `f` every 50 ms until it returns `Some`; panics after `timeout`, naming `what`.
pub async fn eventually<T>(
    what: &str,
    timeout: Duration,
    mut f: impl AsyncFnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        Sleep::new(POLL).await;
    }
}

/// A pause that a thread ends by waking the task: works under any executor.
struct Sleep {
    until: Instant,
    waker: Option<Arc<Mutex<Waker>>>,
}

impl Sleep {
    fn new(d: Duration) -> Sleep {
        Sleep {
            until: Instant::now() + d,
            waker: None,
        }
    }
}

impl Future for Sleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if Instant::now() >= self.until {
            return Poll::Ready(());
        }
        match &self.waker {
            // Polled again before the timer fired: wake whichever task polled last.
            Some(w) => w
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone_from(cx.waker()),
            None => {
                let w = Arc::new(Mutex::new(cx.waker().clone()));
                let (shared, until) = (w.clone(), self.until);
                std::thread::spawn(move || {
                    std::thread::sleep(until.saturating_duration_since(Instant::now()));
                    shared
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .wake_by_ref();
                });
                self.waker = Some(w);
            }
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "waiting for never")]
    fn names_what_never_came() {
        block_on(eventually(
            "never",
            Duration::from_millis(120),
            async || None::<()>,
        ));
    }

    #[test]
    fn async_polls_without_a_runtime_timer() {
        // A minimal executor: the future must wake itself through Sleep's thread.
        let mut n = 0;
        let fut = eventually("two polls", Duration::from_secs(5), async || {
            n += 1;
            (n == 2).then_some(n)
        });
        assert_eq!(block_on(fut), 2);
    }

    fn block_on<F: Future>(fut: F) -> F::Output {
        struct Unpark(std::thread::Thread);
        impl std::task::Wake for Unpark {
            fn wake(self: Arc<Self>) {
                self.0.unpark();
            }
        }
        let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
        let mut cx = Context::from_waker(&waker);
        let mut fut = std::pin::pin!(fut);
        loop {
            if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
                return v;
            }
            std::thread::park();
        }
    }
}
