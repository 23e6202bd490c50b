//! The narrow interface between the dispatcher and a destination.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use super::flood::ActiveAlert;
use super::notification::Notification;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// How one delivery attempt failed. The dispatcher owns retries; a sink makes one attempt.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SinkError {
    /// Unreachable, timed out, 408/429/5xx, disk full: try again later.
    #[error("retryable: {reason}")]
    Retryable {
        reason: String,
        status: Option<u16>,
        /// The receiver asked for this delay (Retry-After).
        retry_after: Option<Duration>,
    },
    /// The receiver refused the payload itself (4xx other than 408/429): retrying cannot help.
    #[error("permanent: {reason}")]
    Permanent { reason: String, status: Option<u16> },
}

impl SinkError {
    pub fn status(&self) -> Option<u16> {
        match self {
            SinkError::Retryable { status, .. } | SinkError::Permanent { status, .. } => *status,
        }
    }
}

pub trait Sink: Send + Sync + 'static {
    /// Unique among configured sinks; the spool records acknowledgements under it and it is the
    /// `sink` metric label (bounded: it comes from the config).
    fn name(&self) -> &str;

    /// What the spool records acknowledgements under: stable across restarts for the same
    /// destination (see [`crate::alert::sink_identities`]), so that an entry stays routed to the
    /// destination it was meant for whatever the sinks' order.
    fn identity(&self) -> &str {
        self.name()
    }

    /// Largest batch one `deliver` call should get.
    fn max_batch(&self) -> usize {
        64
    }

    /// One attempt to deliver `batch`. `Ok` means the destination acknowledged all of it.
    fn deliver<'a>(
        &'a self,
        batch: &'a [std::sync::Arc<Notification>],
    ) -> BoxFuture<'a, Result<(), SinkError>>;

    /// Sinks with a notion of "still firing" (Alertmanager) are re-sent the active alerts every
    /// interval, plus those that just resolved. Not spooled: a lost refresh is replaced by the next.
    fn refresh_interval(&self) -> Option<Duration> {
        None
    }

    fn refresh<'a>(
        &'a self,
        _active: &'a [ActiveAlert],
        _resolved: &'a [ActiveAlert],
    ) -> BoxFuture<'a, Result<(), SinkError>> {
        Box::pin(async { Ok(()) })
    }
}

/// Classifies an HTTP answer the way the issue prescribes: 2xx ok; 408, 429 and 5xx retryable
/// (honouring Retry-After); every other status permanent.
pub fn classify_http(
    status: u16,
    retry_after: Option<&str>,
    body_excerpt: &str,
) -> Result<(), SinkError> {
    if (200..300).contains(&status) {
        return Ok(());
    }
    let reason = format!("HTTP {status}: {}", body_excerpt.trim());
    if status == 408 || status == 429 || status >= 500 {
        Err(SinkError::Retryable {
            reason,
            status: Some(status),
            retry_after: retry_after.and_then(parse_retry_after),
        })
    } else {
        Err(SinkError::Permanent {
            reason,
            status: Some(status),
        })
    }
}

/// `Retry-After` is either delay-seconds or an HTTP date.
pub fn parse_retry_after(v: &str) -> Option<Duration> {
    let v = v.trim();
    if let Ok(secs) = v.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    // IMF-fixdate is RFC 2822 with the zone spelled "GMT".
    let v = v.strip_suffix("GMT").map(|s| format!("{s}+0000"))?;
    let t = time::OffsetDateTime::parse(&v, &time::format_description::well_known::Rfc2822).ok()?;
    let now = time::OffsetDateTime::now_utc();
    let d = t - now;
    Some(if d.is_positive() {
        Duration::from_secs_f64(d.as_seconds_f64())
    } else {
        Duration::ZERO
    })
}

/// Exponential backoff with jitter ("equal jitter": half fixed, half random) so that a fleet of
/// monitors does not retry in lockstep, while the delay still grows.
#[derive(Debug, Clone)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
    attempt: u32,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Backoff {
        Backoff {
            initial,
            max,
            attempt: 0,
        }
    }

    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    pub fn next_delay(&mut self) -> Duration {
        let exp = self
            .initial
            .saturating_mul(1u32 << self.attempt.min(20))
            .min(self.max);
        self.attempt = self.attempt.saturating_add(1);
        let half = exp / 2;
        half + half.mul_f64(fastrand::f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_classes() {
        assert!(classify_http(204, None, "").is_ok());
        for s in [408, 429, 500, 503] {
            assert!(
                matches!(classify_http(s, None, ""), Err(SinkError::Retryable { .. })),
                "{s}"
            );
        }
        for s in [400, 401, 404, 413, 422] {
            assert!(
                matches!(classify_http(s, None, ""), Err(SinkError::Permanent { .. })),
                "{s}"
            );
        }
        match classify_http(429, Some("7"), "slow down") {
            Err(SinkError::Retryable { retry_after, .. }) => {
                assert_eq!(retry_after, Some(Duration::from_secs(7)))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn retry_after_http_date_in_the_past_is_zero() {
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("soon"), None);
    }

    #[test]
    fn backoff_grows_with_jitter_and_caps() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        let d: Vec<Duration> = (0..8).map(|_| b.next_delay()).collect();
        assert!(d[0] >= Duration::from_millis(50) && d[0] <= Duration::from_millis(100));
        assert!(d[3] >= Duration::from_millis(400) && d[3] <= Duration::from_millis(800));
        assert!(d.iter().all(|x| *x <= Duration::from_secs(2)));
        assert!(d[7] >= Duration::from_secs(1));
    }
}
