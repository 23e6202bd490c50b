//! OTLP counters: [`OtlpStats`], plain atomics with bounded labels (transport, profile, reason)
//! kept by the ingest path, and their collector. Every label combination is rendered at scrape
//! time, zeros included, so `increase()` sees the first rejection and dashboards show a receiver
//! before its first export. No request ids ever become labels.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use crate::normalize::vllm_router::JoinOutcome;
use crate::normalize::{ProfileLabel, Tally, Unmapped};
use crate::telemetry::metrics::{Metrics, counters, gauge};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Transport {
    Grpc = 0,
    Http = 1,
}

impl Transport {
    pub const ALL: [Transport; 2] = [Transport::Grpc, Transport::Http];
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Grpc => "grpc",
            Transport::Http => "http",
        }
    }
}

/// Why a whole export was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RejectReason {
    /// Retryable: the bounded channel was full (client told to retry).
    PipelineFull = 0,
    PipelineClosed = 1,
    TooManyItems = 2,
    /// Body larger than the configured maximum (compressed or decompressed).
    TooLarge = 3,
    /// Not valid protobuf / JSON for the OTLP message.
    Malformed = 4,
    /// gzip stream broken.
    BadEncoding = 5,
    UnsupportedMediaType = 6,
    /// No or a wrong bearer token (`--auth-token-file`): gRPC UNAUTHENTICATED, HTTP 401.
    Unauthenticated = 7,
}

impl RejectReason {
    pub const ALL: [RejectReason; 8] = [
        RejectReason::PipelineFull,
        RejectReason::PipelineClosed,
        RejectReason::TooManyItems,
        RejectReason::TooLarge,
        RejectReason::Malformed,
        RejectReason::BadEncoding,
        RejectReason::UnsupportedMediaType,
        RejectReason::Unauthenticated,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::PipelineFull => "pipeline_full",
            RejectReason::PipelineClosed => "pipeline_closed",
            RejectReason::TooManyItems => "too_many_items",
            RejectReason::TooLarge => "too_large",
            RejectReason::Malformed => "malformed",
            RejectReason::BadEncoding => "bad_encoding",
            RejectReason::UnsupportedMediaType => "unsupported_media_type",
            RejectReason::Unauthenticated => "unauthenticated",
        }
    }
}

const NT: usize = Transport::ALL.len();
const NRJ: usize = RejectReason::ALL.len();
const NP: usize = ProfileLabel::ALL.len();
const NU: usize = Unmapped::ALL.len();
const NJ: usize = JoinOutcome::ALL.len();

#[derive(Debug, Default)]
pub struct OtlpStats {
    /// Exports answered OK, by transport.
    pub requests_accepted: [AtomicU64; NT],
    /// Exports refused, by transport and reason (`revenant_otlp_requests_rejected_total`).
    pub requests_rejected: [[AtomicU64; NRJ]; NT],
    /// Spans/records in refused exports (what the client must resend). HTTP refusals before
    /// decoding (size, encoding, malformed) count 0 items: the body was never understood.
    pub items_rejected: [[AtomicU64; NRJ]; NT],
    /// gRPC responses with a non-OK status, by status code (0..=16), including those tonic
    /// produced itself before our handler ran (framing, size limit, decode errors).
    pub grpc_error_responses: [AtomicU64; 17],
    pub spans_received: [AtomicU64; NP],
    pub log_records_received: [AtomicU64; NP],
    /// Spans/records that produced no event, by profile and reason.
    pub unmapped: [[AtomicU64; NU]; NP],
    pub events_emitted: AtomicU64,
    pub orphans_buffered: AtomicU64,
    /// Gauge: orphans currently waiting for their root.
    pub orphans_waiting: AtomicU64,
    /// What became of trace-join entries (`revenant_otlp_trace_join_total{outcome}`).
    pub trace_join: [AtomicU64; NJ],
    /// Gauge: router rejections waiting for their trace's rid.
    pub trace_join_pending: AtomicU64,
    /// The service and scope of the last spans no profile claimed, for the warning that says
    /// which name to map.
    pub unclaimed: std::sync::Mutex<Option<(String, String)>>,
}

impl OtlpStats {
    pub fn rejected(&self, t: Transport, r: RejectReason, items: u64) {
        self.requests_rejected[t as usize][r as usize].fetch_add(1, Relaxed);
        self.items_rejected[t as usize][r as usize].fetch_add(items, Relaxed);
    }

    /// The service and scope of the last spans no profile claimed, if any.
    pub fn unclaimed(&self) -> Option<(String, String)> {
        self.unclaimed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn add_tally(&self, tally: &Tally) {
        if let Some(u) = &tally.unclaimed {
            *self.unclaimed.lock().unwrap_or_else(|p| p.into_inner()) = Some(u.clone());
        }
        for p in 0..NP {
            for u in 0..NU {
                let n = tally.unmapped[p][u];
                if n != 0 {
                    self.unmapped[p][u].fetch_add(n, Relaxed);
                }
            }
        }
        self.events_emitted.fetch_add(tally.events, Relaxed);
        self.orphans_buffered
            .fetch_add(tally.orphans_buffered, Relaxed);
        for (c, n) in self.trace_join.iter().zip(tally.join) {
            if n != 0 {
                c.fetch_add(n, Relaxed);
            }
        }
    }

    pub fn accepted(&self, t: Transport, tally: &Tally) {
        self.requests_accepted[t as usize].fetch_add(1, Relaxed);
        for p in 0..NP {
            if tally.spans[p] != 0 {
                self.spans_received[p].fetch_add(tally.spans[p], Relaxed);
            }
        }
        self.add_tally(tally);
    }

    pub fn accepted_logs(&self, t: Transport, tally: &Tally) {
        self.requests_accepted[t as usize].fetch_add(1, Relaxed);
        for p in 0..NP {
            if tally.spans[p] != 0 {
                self.log_records_received[p].fetch_add(tally.spans[p], Relaxed);
            }
        }
        self.add_tally(tally);
    }

    pub fn get_rejected(&self, t: Transport, r: RejectReason) -> u64 {
        self.requests_rejected[t as usize][r as usize].load(Relaxed)
    }

    pub fn get_unmapped(&self, p: ProfileLabel, u: Unmapped) -> u64 {
        self.unmapped[p as usize][u as usize].load(Relaxed)
    }

    /// One line per non-zero counter, `name{labels} value`: for the shutdown log and tests.
    pub fn render(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        for t in Transport::ALL {
            let v = self.requests_accepted[t as usize].load(Relaxed);
            if v != 0 {
                let _ = writeln!(
                    s,
                    "revenant_otlp_requests_accepted_total{{transport=\"{}\"}} {v}",
                    t.as_str()
                );
            }
            for r in RejectReason::ALL {
                let v = self.get_rejected(t, r);
                if v != 0 {
                    let _ = writeln!(
                        s,
                        "revenant_otlp_requests_rejected_total{{transport=\"{}\",reason=\"{}\"}} {v}",
                        t.as_str(),
                        r.as_str()
                    );
                }
            }
        }
        for (code, c) in self.grpc_error_responses.iter().enumerate() {
            let v = c.load(Relaxed);
            if v != 0 {
                let _ = writeln!(
                    s,
                    "revenant_otlp_grpc_error_responses_total{{code=\"{code}\"}} {v}"
                );
            }
        }
        for p in ProfileLabel::ALL {
            let v = self.spans_received[p as usize].load(Relaxed);
            if v != 0 {
                let _ = writeln!(
                    s,
                    "revenant_otlp_spans_received_total{{profile=\"{}\"}} {v}",
                    p.as_str()
                );
            }
            let v = self.log_records_received[p as usize].load(Relaxed);
            if v != 0 {
                let _ = writeln!(
                    s,
                    "revenant_otlp_log_records_received_total{{profile=\"{}\"}} {v}",
                    p.as_str()
                );
            }
            for u in Unmapped::ALL {
                let v = self.get_unmapped(p, u);
                if v != 0 {
                    let _ = writeln!(
                        s,
                        "revenant_otlp_spans_unmapped_total{{profile=\"{}\",reason=\"{}\"}} {v}",
                        p.as_str(),
                        u.as_str()
                    );
                }
            }
        }
        let _ = writeln!(
            s,
            "revenant_otlp_events_emitted_total {}",
            self.events_emitted.load(Relaxed)
        );
        let _ = writeln!(
            s,
            "revenant_otlp_orphans_buffered_total {}",
            self.orphans_buffered.load(Relaxed)
        );
        let _ = writeln!(
            s,
            "revenant_otlp_orphans_waiting {}",
            self.orphans_waiting.load(Relaxed)
        );
        for o in JoinOutcome::ALL {
            let v = self.trace_join[o as usize].load(Relaxed);
            if v != 0 {
                let _ = writeln!(
                    s,
                    "revenant_otlp_trace_join_total{{outcome=\"{}\"}} {v}",
                    o.as_str()
                );
            }
        }
        let _ = writeln!(
            s,
            "revenant_otlp_trace_join_pending {}",
            self.trace_join_pending.load(Relaxed)
        );
        s
    }
}

/// Renders one [`OtlpStats`] at every scrape.
#[derive(Debug)]
struct OtlpCollector {
    stats: Arc<OtlpStats>,
}

/// Renders the OTLP receivers' counters at every scrape from now on (once per `Metrics`).
pub fn register(metrics: &Metrics, stats: Arc<OtlpStats>) {
    metrics.register_collector(OtlpCollector { stats });
}

impl Collector for OtlpCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let s = &self.stats;
        counters(
            &mut enc,
            "revenant_otlp_requests_accepted",
            "OTLP exports answered OK, by transport",
            Transport::ALL.map(|t| {
                (
                    vec![("transport", t.as_str().to_string())],
                    s.requests_accepted[t as usize].load(Relaxed),
                )
            }),
        )?;
        let rej = |arr: &[[std::sync::atomic::AtomicU64; RejectReason::ALL.len()];
                        Transport::ALL.len()]| {
            Transport::ALL
                .iter()
                .flat_map(|t| {
                    RejectReason::ALL.iter().map(move |r| {
                        (
                            vec![
                                ("transport", t.as_str().to_string()),
                                ("reason", r.as_str().to_string()),
                            ],
                            arr[*t as usize][*r as usize].load(Relaxed),
                        )
                    })
                })
                .collect::<Vec<_>>()
        };
        counters(
            &mut enc,
            "revenant_otlp_requests_rejected",
            "OTLP exports refused, by transport and reason (pipeline_full is retryable back-pressure)",
            rej(&s.requests_rejected),
        )?;
        counters(
            &mut enc,
            "revenant_otlp_rejected_items",
            "Spans/log records in refused OTLP exports, by transport and reason",
            rej(&s.items_rejected),
        )?;
        counters(
            &mut enc,
            "revenant_otlp_grpc_error_responses",
            "gRPC responses with a non-OK status, by code",
            s.grpc_error_responses
                .iter()
                .enumerate()
                .filter(|(_, c)| c.load(Relaxed) != 0)
                .map(|(code, c)| (vec![("code", code.to_string())], c.load(Relaxed))),
        )?;
        counters(
            &mut enc,
            "revenant_otlp_spans_received",
            "Spans received, by profile",
            ProfileLabel::ALL.map(|p| {
                (
                    vec![("profile", p.as_str().to_string())],
                    s.spans_received[p as usize].load(Relaxed),
                )
            }),
        )?;
        counters(
            &mut enc,
            "revenant_otlp_log_records_received",
            "Log records received, by profile",
            ProfileLabel::ALL.map(|p| {
                (
                    vec![("profile", p.as_str().to_string())],
                    s.log_records_received[p as usize].load(Relaxed),
                )
            }),
        )?;
        counters(
            &mut enc,
            "revenant_otlp_spans_unmapped",
            "Spans/log records that produced no lifecycle event, by profile and reason",
            ProfileLabel::ALL.iter().flat_map(|p| {
                Unmapped::ALL.iter().map(move |u| {
                    (
                        vec![
                            ("profile", p.as_str().to_string()),
                            ("reason", u.as_str().to_string()),
                        ],
                        s.unmapped[*p as usize][*u as usize].load(Relaxed),
                    )
                })
            }),
        )?;
        counters(
            &mut enc,
            "revenant_otlp_events_emitted",
            "Lifecycle events the OTLP receivers produced",
            [(Vec::<(&str, String)>::new(), s.events_emitted.load(Relaxed))],
        )?;
        counters(
            &mut enc,
            "revenant_otlp_orphans_buffered",
            "Child spans buffered until their root arrived",
            [(
                Vec::<(&str, String)>::new(),
                s.orphans_buffered.load(Relaxed),
            )],
        )?;
        gauge(
            &mut enc,
            "revenant_otlp_orphans_waiting",
            "Child spans currently waiting for their root",
            s.orphans_waiting.load(Relaxed) as i64,
        )?;
        counters(
            &mut enc,
            "revenant_otlp_trace_join",
            "vllm-router rejections and trace rids in the trace join, by outcome (evicted_* are drops)",
            JoinOutcome::ALL.map(|o| {
                (
                    vec![("outcome", o.as_str().to_string())],
                    s.trace_join[o as usize].load(Relaxed),
                )
            }),
        )?;
        gauge(
            &mut enc,
            "revenant_otlp_trace_join_pending",
            "vllm-router rejections currently waiting for their trace's rid",
            s.trace_join_pending.load(Relaxed) as i64,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_reason_zeros_included() {
        let m = Metrics::new();
        assert!(!m.render().contains("revenant_otlp_"));
        let otlp = Arc::new(OtlpStats::default());
        otlp.rejected(Transport::Grpc, RejectReason::PipelineFull, 10);
        register(&m, otlp);
        let text = m.render();
        for needle in [
            "revenant_otlp_requests_rejected_total{transport=\"grpc\",reason=\"pipeline_full\"} 1",
            "revenant_otlp_rejected_items_total{transport=\"grpc\",reason=\"pipeline_full\"} 10",
            "revenant_otlp_requests_rejected_total{transport=\"http\",reason=\"malformed\"} 0",
            "revenant_otlp_orphans_waiting 0\n",
            "revenant_otlp_trace_join_total{outcome=\"evicted_pending\"} 0",
            "revenant_otlp_trace_join_pending 0\n",
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
    }
}
