//! Renders the OTLP receivers' counters ([`OtlpStats`], plain atomics kept by the ingest path) at
//! scrape time. Every label combination is emitted, zeros included, so `increase()` sees the first
//! rejection and dashboards show a receiver before its first export.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use crate::ingest::otlp::{OtlpStats, RejectReason, Transport};
use crate::normalize::{ProfileLabel, Unmapped};

#[derive(Debug, Default)]
pub(crate) struct OtlpCollector {
    pub(crate) stats: Mutex<Option<Arc<OtlpStats>>>,
}

fn family(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = (Vec<(&'static str, String)>, u64)>,
) -> std::fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, v) in rows {
        let f = m.encode_family(&labels)?;
        ConstCounter::new(v).encode(f)?;
    }
    Ok(())
}

impl Collector for OtlpCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let g = self.stats.lock().unwrap_or_else(|p| p.into_inner());
        let Some(s) = g.as_ref() else { return Ok(()) };
        family(
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
        family(
            &mut enc,
            "revenant_otlp_requests_rejected",
            "OTLP exports refused, by transport and reason (pipeline_full is retryable back-pressure)",
            rej(&s.requests_rejected),
        )?;
        family(
            &mut enc,
            "revenant_otlp_rejected_items",
            "Spans/log records in refused OTLP exports, by transport and reason",
            rej(&s.items_rejected),
        )?;
        family(
            &mut enc,
            "revenant_otlp_grpc_error_responses",
            "gRPC responses with a non-OK status, by code",
            s.grpc_error_responses
                .iter()
                .enumerate()
                .filter(|(_, c)| c.load(Relaxed) != 0)
                .map(|(code, c)| (vec![("code", code.to_string())], c.load(Relaxed))),
        )?;
        family(
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
        family(
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
        family(
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
        family(
            &mut enc,
            "revenant_otlp_events_emitted",
            "Lifecycle events the OTLP receivers produced",
            [(vec![], s.events_emitted.load(Relaxed))],
        )?;
        family(
            &mut enc,
            "revenant_otlp_orphans_buffered",
            "Child spans buffered until their root arrived",
            [(vec![], s.orphans_buffered.load(Relaxed))],
        )?;
        let g = ConstGauge::new(s.orphans_waiting.load(Relaxed) as i64);
        let m = enc.encode_descriptor(
            "revenant_otlp_orphans_waiting",
            "Child spans currently waiting for their root",
            None,
            g.metric_type(),
        )?;
        g.encode(m)
    }
}
