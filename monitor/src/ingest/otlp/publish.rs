//! Bridges [`OtlpStats`] (plain atomics, totals) into the admin metric registry, which counts
//! increments: call [`Publisher::publish`] periodically (the run loop's one-second tick, or
//! before a scrape). Refused exports become `dropped{point="otlp_rejected",reason}` (a refusal
//! is not yet a loss: the client retries), unmapped spans and log records become
//! `unmapped{source="otlp",signal="span"|"log"}`.

use std::sync::atomic::Ordering::Relaxed;

use super::stats::{OtlpStats, RejectReason, Transport};
use crate::admin::metrics::{DropLabels, DropPoint, Metrics, UnmappedLabels};
use crate::normalize::{ProfileLabel, Unmapped};

/// Remembers the totals already published so each call adds only the increment.
#[derive(Debug, Default)]
pub struct Publisher {
    rejected: [[u64; RejectReason::ALL.len()]; Transport::ALL.len()],
    unmapped_spans: u64,
    unmapped_logs: u64,
}

impl Publisher {
    pub fn publish(&mut self, s: &OtlpStats, m: &Metrics) {
        for t in Transport::ALL {
            for r in RejectReason::ALL {
                let cur = s.get_rejected(t, r);
                let last = &mut self.rejected[t as usize][r as usize];
                if cur > *last {
                    m.dropped
                        .get_or_create(&DropLabels {
                            point: DropPoint::OtlpRejected.as_str(),
                            reason: r.as_str(),
                        })
                        .inc_by(cur - *last);
                    *last = cur;
                }
            }
        }
        let (mut spans, mut logs) = (0u64, 0u64);
        for p in ProfileLabel::ALL {
            for u in Unmapped::ALL {
                let v = s.unmapped[p as usize][u as usize].load(Relaxed);
                if u == Unmapped::LogNotMapped {
                    logs += v;
                } else {
                    spans += v;
                }
            }
        }
        for (signal, cur, last) in [
            ("span", spans, &mut self.unmapped_spans),
            ("log", logs, &mut self.unmapped_logs),
        ] {
            if cur > *last {
                m.unmapped
                    .get_or_create(&UnmappedLabels {
                        source: "otlp",
                        signal,
                    })
                    .inc_by(cur - *last);
                *last = cur;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publishes_increments_once() {
        let s = OtlpStats::default();
        let m = Metrics::new();
        let mut p = Publisher::default();
        s.rejected(Transport::Grpc, RejectReason::PipelineFull, 10);
        s.rejected(Transport::Http, RejectReason::PipelineFull, 10);
        s.unmapped[ProfileLabel::Sglang as usize][Unmapped::OrphanExpired as usize]
            .fetch_add(3, Relaxed);
        p.publish(&s, &m);
        p.publish(&s, &m);
        let text = m.render();
        let line = |needle: &str| {
            text.lines()
                .find(|l| l.contains(needle) && !l.starts_with('#'))
                .map(str::to_owned)
        };
        let dropped = line("reason=\"pipeline_full\"").unwrap_or_default();
        assert!(dropped.ends_with(" 2"), "{text}");
        let unmapped = line("signal=\"span\"").unwrap_or_default();
        assert!(unmapped.ends_with(" 3"), "{text}");
    }
}
