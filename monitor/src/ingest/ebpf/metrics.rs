//! The eBPF source's telemetry: its counters ([`EbpfStats`]: the kernel's per-CPU counters
//! summed, and the user-space tracker's) rendered at scrape time, zeros included, so dashboards
//! show the source from its start and `increase()` sees the first loss; and the publisher that
//! folds its losses into the shared drop metric and the readiness report.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use monitor_common::counter;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use super::EbpfStats;
use crate::telemetry::events::AbsoluteDrops;
use crate::telemetry::metrics::{
    DropPoint, DropReason, Metrics, counter as counter_metric, counters, gauge,
};
use crate::telemetry::ready::Readiness;

/// Renders one [`EbpfStats`] at every scrape.
#[derive(Debug)]
struct EbpfCollector {
    stats: Arc<EbpfStats>,
}

/// Renders the eBPF source's counters at every scrape from now on (once per `Metrics`).
pub fn register(metrics: &Metrics, stats: Arc<EbpfStats>) {
    metrics.register_collector(EbpfCollector { stats });
}

impl Collector for EbpfCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let s = &self.stats;
        counters(
            &mut enc,
            "revenant_ebpf_kernel",
            "Kernel-side counters of the eBPF probes, summed over CPUs (seen, sent, ringbuf_drops, \
             read_failures, active_full, socks_full, iov_truncated, bytes_captured, \
             connecting_full, stream_truncated, metrics_marked)",
            counter::NAMES
                .iter()
                .enumerate()
                .map(|(i, name)| ([("counter", *name)], s.kernel(i as u32))),
        )?;
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
            (
                "revenant_ebpf_zmtp_damaged_messages",
                "KV-transfer control messages left unread because a capture gap cut into their verb or key (read, they could name another room)",
                s.zmtp_damaged.load(Relaxed),
            ),
            (
                "revenant_ebpf_vllm_nixl_handshakes",
                "vLLM NixlConnector handshakes (get_meta_msg) seen: prefill/decode engine pairs that connected; they name no request",
                s.vllm_nixl_handshakes.load(Relaxed),
            ),
            (
                "revenant_ebpf_vllm_transfers_unattributed",
                "vLLM MooncakeConnector pulls or answers for a request whose HTTP legs were not seen on this node (not reported: the request is unknown)",
                s.vllm_transfers_unattributed.load(Relaxed),
            ),
            (
                "revenant_ebpf_zmtp_desyncs",
                "Times a capture gap cost a KV-transfer control stream its framing: the messages until the next syscall that starts a frame are lost",
                s.zmtp_desyncs.load(Relaxed),
            ),
            (
                "revenant_ebpf_answers_lost",
                "Requests left unanswered because the kernel lost their answers (after a loss, a connection with two requests waiting: the older ones' answers were lost, and are not paired with another's)",
                s.answers_lost.load(Relaxed),
            ),
            (
                "revenant_ebpf_room_states_evicted",
                "Rooms whose KV-transfer control-channel protocol state was forgotten because the bounded room table was full (their protocol breaches after that go unseen)",
                s.room_states_evicted.load(Relaxed),
            ),
            (
                "revenant_ebpf_zmtp_connections_captured_whole",
                "KV-transfer control connections whose syscalls the kernel captures whole (up to 4 KiB at each end), so that batched messages are all read",
                s.zmtp_captured_whole.load(Relaxed),
            ),
            (
                "revenant_ebpf_metrics_connections_captured_whole",
                "HTTP connections that carried a /metrics scrape, whose answers the kernel then captures whole (up to 128 KiB per syscall) so vLLM's vllm:cache_config_info is read wherever it lies",
                s.metrics_captured_whole.load(Relaxed),
            ),
            (
                "revenant_ebpf_accepts_unplaced",
                "Accepted connections whose listener was not found in /proc: whether their peer is a watched process is judged by its address alone (a foreign writer sharing a port with a watched connection to elsewhere reads as watched)",
                s.accepts_unplaced.load(Relaxed),
            ),
        ] {
            counter_metric(&mut enc, name, help, v)?;
        }
        gauge(
            &mut enc,
            "revenant_ebpf_watched_processes",
            "Processes the probes currently watch",
            s.watched_processes.load(Relaxed) as f64,
        )?;
        gauge(
            &mut enc,
            "revenant_ebpf_connections",
            "Connections the eBPF tracker currently holds state for",
            s.connections.load(Relaxed) as f64,
        )?;
        gauge(
            &mut enc,
            "revenant_ebpf_coverage_degraded",
            "1 while kernel capture is losing data (ring buffer or tables full, pipeline full)",
            f64::from(u8::from(s.coverage_degraded())),
        )
    }
}

/// One kind of loss: where it is counted, why, and how to read its running total.
type Loss = (DropPoint, DropReason, fn(&EbpfStats) -> u64);

/// Turns the eBPF source's absolute loss counters into the shared drop metric, once a second, so
/// that `revenant_dropped_items_total` (and the "blind" alert on it) covers the kernel side too,
/// and marks the source degraded in the readiness report while capture loses data. Returns once
/// `stop` turns true, after a last publication.
pub async fn publish_drops(
    stats: Arc<EbpfStats>,
    metrics: Arc<Metrics>,
    readiness: Readiness,
    stop: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(stop);
    let losses: [Loss; 6] = [
        (DropPoint::KernelRingbuf, DropReason::Full, |s| {
            s.kernel(counter::RINGBUF_DROPS)
        }),
        (
            DropPoint::KernelRingbuf,
            DropReason::SyscallTableFull,
            |s| s.kernel(counter::ACTIVE_FULL),
        ),
        (DropPoint::KernelRingbuf, DropReason::SocketTableFull, |s| {
            s.kernel(counter::SOCKS_FULL)
        }),
        (DropPoint::EventChannel, DropReason::Full, |s| {
            s.events_dropped.load(Relaxed)
        }),
        (DropPoint::EbpfTracker, DropReason::Undecodable, |s| {
            s.decode_errors.load(Relaxed)
        }),
        (DropPoint::EbpfTracker, DropReason::ConnectionEvicted, |s| {
            s.conns_evicted.load(Relaxed)
        }),
    ];
    let totals: [AbsoluteDrops; 6] = Default::default();
    let mut degraded = false;
    let mut iv = tokio::time::interval(Duration::from_secs(1));
    loop {
        let stopping = tokio::select! {
            _ = iv.tick() => false,
            _ = &mut stop => true,
        };
        for ((point, reason, read), total) in losses.iter().zip(&totals) {
            total.observe_total(&metrics, *point, *reason, read(&stats));
        }
        let now_degraded = stats.coverage_degraded();
        if now_degraded != degraded {
            degraded = now_degraded;
            if degraded {
                let losses = stats.losses();
                tracing::warn!(
                    losses,
                    "eBPF coverage DEGRADED: kernel capture lost data; verdicts may miss activity"
                );
                readiness.set_degraded(
                    "ebpf",
                    Some(format!(
                        "kernel capture lost data ({losses} records/events so far): verdicts may miss activity"
                    )),
                );
            } else {
                tracing::info!("eBPF coverage restored");
                readiness.set_degraded("ebpf", None);
            }
        }
        if stopping {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_kernel_and_tracker_counters() {
        let m = Metrics::new();
        assert!(!m.render().contains("revenant_ebpf_kernel"));
        let s = Arc::new(EbpfStats::default());
        s.kernel[monitor_common::counter::RINGBUF_DROPS as usize].store(7, Relaxed);
        s.watched_processes.store(3, Relaxed);
        s.coverage_degraded.store(true, Relaxed);
        register(&m, s);
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
