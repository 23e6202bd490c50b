//! Blindness that would otherwise look healthy, said in the log and in `/readyz`:
//! - no source at all (OTLP off and eBPF off or unavailable, no `--replay`): the process is not
//!   ready (`down.sources`), so a readiness probe and `revenant_ready` show it;
//! - OTLP spans from a service that matches no profile (an SGLang deployment with its own
//!   `OTEL_SERVICE_NAME`): answered 200 to the exporter, counted in
//!   `revenant_otlp_spans_unmapped_total{profile="none",reason="no_profile"}`, and checked by
//!   nothing. While such spans keep coming the OTLP source is `degraded` in `/readyz`, and a WARN
//!   (at most one a minute, with the count since the last) says how to map them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::ingest::otlp::OtlpStats;
use crate::normalize::{ProfileLabel, Unmapped};
use crate::telemetry::Readiness;

/// How often the WARN about spans without a profile may be written.
pub const NO_PROFILE_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// The readiness entry a process with no source at all is held back by.
pub const NO_SOURCE: &str = "sources";

/// Marks the process not ready because it has no source, saying why.
pub fn no_source(readiness: &Readiness, why: String) {
    tracing::error!(
        "no source: revenant sees nothing ({why}); /readyz answers 503 until it is restarted \
         with OTLP or eBPF on"
    );
    readiness.set_down(NO_SOURCE, Some(format!("no source: {why}")));
}

/// What to do after one look at the counter of spans without a profile.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Step {
    /// Write the WARN, with this many spans since the last one.
    pub warn: Option<u64>,
    /// Set (`Some(Some(note))`) or clear (`Some(None)`) the `degraded` entry.
    pub degraded: Option<Option<String>>,
}

/// Follows `revenant_otlp_spans_unmapped_total{profile="none",reason="no_profile"}` (a running
/// total) and decides when to warn and what `/readyz` says. Sans-IO: the caller reads the total
/// and the clock.
#[derive(Debug)]
pub struct NoProfileWatch {
    /// How long after the last such span the OTLP source stays `degraded`.
    window: Duration,
    total: u64,
    last_growth: Option<Instant>,
    last_warn: Option<Instant>,
    unwarned: u64,
    /// Spans counted within the current window (since the entry was set).
    in_window: u64,
    degraded: bool,
}

impl NoProfileWatch {
    pub fn new(window: Duration) -> NoProfileWatch {
        NoProfileWatch {
            window,
            total: 0,
            last_growth: None,
            last_warn: None,
            unwarned: 0,
            in_window: 0,
            degraded: false,
        }
    }

    pub fn observe(&mut self, total: u64, now: Instant) -> Step {
        let new = total.saturating_sub(self.total);
        self.total = total.max(self.total);
        let mut step = Step::default();
        if new > 0 {
            self.last_growth = Some(now);
            self.unwarned += new;
            self.in_window += new;
            let due = self
                .last_warn
                .is_none_or(|t| now.saturating_duration_since(t) >= NO_PROFILE_LOG_INTERVAL);
            if due {
                step.warn = Some(std::mem::take(&mut self.unwarned));
                self.last_warn = Some(now);
            }
            step.degraded = Some(Some(format!(
                "{} OTLP spans matched no profile (their service.name and scope name are none \
                 revenant knows) and were not checked; map the service in the config file: \
                 normalize.by_service_name {{SERVICE: sglang|smg|vllm|vllm-router}}",
                self.in_window
            )));
            self.degraded = true;
        } else if self.degraded
            && self
                .last_growth
                .is_some_and(|t| now.saturating_duration_since(t) >= self.window)
        {
            self.degraded = false;
            self.in_window = 0;
            step.degraded = Some(None);
        }
        step
    }
}

/// Every second until `stop`: the watch above over the OTLP counters, its verdicts to the log
/// and to `readiness`.
pub async fn watch_no_profile(
    stats: Arc<OtlpStats>,
    readiness: Readiness,
    window: Duration,
    stop: impl std::future::Future<Output = ()>,
) {
    let mut watch = NoProfileWatch::new(window);
    let mut iv = tokio::time::interval(Duration::from_secs(1));
    let mut stop = std::pin::pin!(stop);
    loop {
        tokio::select! {
            _ = iv.tick() => {}
            () = &mut stop => return,
        }
        let total = stats.get_unmapped(ProfileLabel::None, Unmapped::NoProfile);
        let step = watch.observe(total, Instant::now());
        if let Some(spans) = step.warn {
            let (service, scope) = stats.unclaimed().unwrap_or_default();
            tracing::warn!(
                spans,
                service = %service,
                scope = %scope,
                metric =
                    "revenant_otlp_spans_unmapped_total{profile=\"none\",reason=\"no_profile\"}",
                "otlp: spans from a service that matches no profile (service and scope \
                 above) were accepted and NOT checked: revenant knows a service by its resource service.name or scope name \
                 (sglang*, smg, sglang-router*, vllm*, vllm-router*); for any other name (a \
                 custom OTEL_SERVICE_NAME) say which stack it is in the config file, \
                 `normalize: {{by_service_name: {{SERVICE: sglang}}}}` (or by_scope_name, or a \
                 generic mapping: docs/otlp.md). At most one such line a minute."
            );
        }
        if let Some(note) = step.degraded {
            readiness.set_degraded("otlp", note);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warns_at_once_then_once_a_minute_and_stays_degraded_for_the_window() {
        let t0 = Instant::now();
        let mut w = NoProfileWatch::new(Duration::from_secs(60));
        assert_eq!(w.observe(0, t0), Step::default(), "nothing unmapped yet");
        let s = w.observe(3, t0 + Duration::from_secs(1));
        assert_eq!(s.warn, Some(3));
        assert!(matches!(&s.degraded, Some(Some(n)) if n.starts_with("3 OTLP spans")));
        // More within the minute: counted, not logged.
        let s = w.observe(10, t0 + Duration::from_secs(30));
        assert_eq!(s.warn, None);
        assert!(matches!(&s.degraded, Some(Some(n)) if n.starts_with("10 OTLP spans")));
        let s = w.observe(12, t0 + Duration::from_secs(61));
        assert_eq!(s.warn, Some(9), "the 7 not logged plus the 2 new");
        // Quiet: still degraded within the window, cleared after it.
        assert_eq!(
            w.observe(12, t0 + Duration::from_secs(100)),
            Step::default()
        );
        assert_eq!(
            w.observe(12, t0 + Duration::from_secs(121)).degraded,
            Some(None)
        );
        assert_eq!(
            w.observe(12, t0 + Duration::from_secs(200)),
            Step::default()
        );
        let s = w.observe(13, t0 + Duration::from_secs(201));
        assert_eq!(s.warn, Some(1));
        assert!(matches!(&s.degraded, Some(Some(n)) if n.starts_with("1 OTLP spans")));
    }
}
