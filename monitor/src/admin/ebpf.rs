//! Renders the eBPF source's counters ([`EbpfStats`]: the kernel's per-CPU counters summed, and
//! the user-space tracker's) at scrape time, zeros included, so dashboards show the source from
//! its start and `increase()` sees the first loss.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

use monitor_common::counter;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;

use crate::ingest::ebpf::EbpfStats;
use crate::telemetry::metrics::{counter as counter_metric, gauge as gauge_metric};

#[derive(Debug, Default)]
pub(crate) struct EbpfCollector {
    pub(crate) stats: Mutex<Option<Arc<EbpfStats>>>,
}

impl Collector for EbpfCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let g = self.stats.lock().unwrap_or_else(|p| p.into_inner());
        let Some(s) = g.as_ref() else { return Ok(()) };
        let mut m = enc.encode_descriptor(
            "revenant_ebpf_kernel",
            "Kernel-side counters of the eBPF probes, summed over CPUs (seen, sent, ringbuf_drops, \
             read_failures, active_full, socks_full, iov_truncated, bytes_captured)",
            None,
            MetricType::Counter,
        )?;
        for (i, name) in counter::NAMES.iter().enumerate() {
            let labels = [("counter", *name)];
            let f = m.encode_family(&labels)?;
            ConstCounter::new(s.kernel(i as u32)).encode(f)?;
        }
        for (name, help, v) in [
            (
                "revenant_ebpf_records",
                "Ring-buffer records read by user space",
                s.records.load(Relaxed),
            ),
            (
                "revenant_ebpf_decode_errors",
                "Ring-buffer records that could not be decoded (dropped)",
                s.decode_errors.load(Relaxed),
            ),
            (
                "revenant_ebpf_lifecycle_events",
                "Lifecycle events derived from kernel capture",
                s.events.load(Relaxed),
            ),
            (
                "revenant_ebpf_batches_dropped",
                "Event batches dropped because the pipeline channel was full",
                s.batches_dropped.load(Relaxed),
            ),
            (
                "revenant_ebpf_connections_evicted",
                "Tracked connections evicted from the bounded connection table",
                s.conns_evicted.load(Relaxed),
            ),
            (
                "revenant_ebpf_http_desyncs",
                "Times the HTTP parser lost a stream's framing and resynchronised",
                s.http_desyncs.load(Relaxed),
            ),
            (
                "revenant_ebpf_gap_bytes",
                "Stream bytes not captured (payload between the captured head and tail)",
                s.gap_bytes.load(Relaxed),
            ),
        ] {
            counter_metric(&mut enc, name, help, v)?;
        }
        gauge_metric(
            &mut enc,
            "revenant_ebpf_watched_processes",
            "Processes the probes currently watch",
            s.watched_processes.load(Relaxed) as f64,
        )?;
        gauge_metric(
            &mut enc,
            "revenant_ebpf_connections",
            "Connections the eBPF tracker currently holds state for",
            s.connections.load(Relaxed) as f64,
        )?;
        gauge_metric(
            &mut enc,
            "revenant_ebpf_coverage_degraded",
            "1 while kernel capture is losing data (ring buffer or tables full, pipeline full)",
            f64::from(u8::from(s.coverage_degraded())),
        )
    }
}

#[cfg(test)]
mod tests {
    use crate::admin::Metrics;
    use crate::ingest::ebpf::EbpfStats;
    use std::sync::Arc;
    use std::sync::atomic::Ordering::Relaxed;

    #[test]
    fn renders_kernel_and_tracker_counters() {
        let m = Metrics::new();
        assert!(!m.render().contains("revenant_ebpf_kernel"));
        let s = Arc::new(EbpfStats::default());
        s.kernel[monitor_common::counter::RINGBUF_DROPS as usize].store(7, Relaxed);
        s.watched_processes.store(3, Relaxed);
        s.coverage_degraded.store(true, Relaxed);
        m.attach_ebpf(s);
        let text = m.render();
        assert!(
            text.contains("revenant_ebpf_kernel_total{counter=\"ringbuf_drops\"} 7"),
            "{text}"
        );
        assert!(text.contains("revenant_ebpf_watched_processes 3"), "{text}");
        assert!(text.contains("revenant_ebpf_coverage_degraded 1"), "{text}");
        assert!(text.contains("revenant_ebpf_records_total 0"), "{text}");
    }
}
