//! Alert delivery benchmark: detection-to-delivery latency under a steady stream, and delivery
//! throughput for a burst, through the real dispatcher, spool and webhook sink to an axum receiver
//! on loopback.
//!
//!     cargo bench -p revenant --bench alert_delivery
//!
//! Latency = from handing the violation to the dispatcher (what the checker does the moment it
//! detects) to the webhook request arriving at the receiver.

use std::sync::Arc;
use std::time::{Duration, Instant};

use revenant::alert::{AlertConfig, AlertPipeline, WebhookConfig};
use revenant::telemetry::Metrics;

#[path = "../tests/support/alerts.rs"]
mod alerts;
use alerts::{Receiver, violation};

struct Run {
    latencies: Vec<Duration>,
    elapsed: Duration,
}

async fn run(n: usize, rate_per_s: Option<f64>, fsync: bool, batch: usize) -> Run {
    let receiver = Receiver::new(None, Duration::ZERO);
    let (addr, server) = receiver.serve_any().await;
    let tmp = tempfile::tempdir().unwrap();
    let mut w = WebhookConfig::new(format!("http://{addr}/hook"));
    w.max_batch = batch;
    let mut cfg = AlertConfig {
        webhooks: vec![w],
        channel_capacity: n.max(1),
        ..AlertConfig::default()
    };
    cfg.spool.dir = Some(tmp.path().to_path_buf());
    cfg.spool.fsync = fsync;
    cfg.spool.max_entries = n + 1;
    cfg.spool.max_bytes = 1 << 30;
    cfg.flood.rate_limit = 0;
    let metrics = Arc::new(Metrics::new());
    let p = AlertPipeline::start(&cfg, metrics.clone(), None, None).unwrap();
    let mut sent = Vec::with_capacity(n);
    let start = Instant::now();
    for i in 0..n {
        if let Some(r) = rate_per_s {
            let due = start + Duration::from_secs_f64(i as f64 / r);
            tokio::time::sleep_until(due.into()).await;
        }
        sent.push(Instant::now());
        assert!(revenant::alert::offer(&p.sender, violation(i), &metrics));
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    while receiver.first_seen.lock().unwrap().len() < n {
        assert!(Instant::now() < deadline, "not all delivered");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let elapsed = start.elapsed();
    drop(p.sender);
    p.handle.await.unwrap();
    server.abort();
    let g = receiver.first_seen.lock().unwrap();
    let mut latencies: Vec<Duration> = (0..n)
        .map(|i| g[&violation(i).fingerprint] - sent[i])
        .collect();
    latencies.sort();
    Run { latencies, elapsed }
}

fn pct(v: &[Duration], p: f64) -> f64 {
    v[((v.len() as f64 * p) as usize).min(v.len() - 1)].as_secs_f64() * 1e3
}

/// Per-event cost the admin layer adds to the run loop: metrics (`EventsObserved`) and the
/// timeline index (`RecentEvents::record`), one batch of 1000 at a time.
fn hot_path() {
    use revenant::admin::{RecentEvents, RecentEventsLimits};
    use revenant::telemetry::events::EventsObserved;
    let mix = revenant::engine::workload::Mix {
        attempts: 100_000,
        ..Default::default()
    };
    let events = revenant::engine::workload::stream(&mix);
    let metrics = Metrics::new();
    let index = RecentEvents::new(RecentEventsLimits::default());
    let now = revenant::alert::notification::now_unix_ns();
    let t = Instant::now();
    for batch in events.chunks(1000) {
        EventsObserved {
            events: batch,
            arrival_ns: now,
        }
        .emit(&metrics);
    }
    let metrics_ns = t.elapsed().as_nanos() as f64 / events.len() as f64;
    let t = Instant::now();
    for batch in events.chunks(1000) {
        index.record(batch);
    }
    let index_ns = t.elapsed().as_nanos() as f64 / events.len() as f64;
    // Look up the decode rids of recent attempts (still in the 100k-event window): each
    // lookup follows rid → room → request and returns the attempt's indexed events.
    let recent: Vec<String> = events
        .iter()
        .rev()
        .filter_map(|e| e.ids.rid.as_deref().map(str::to_string))
        .step_by(50)
        .take(200)
        .collect();
    let t = Instant::now();
    let mut found = 0;
    for rid in &recent {
        found +=
            revenant::admin::TimelineProvider::timeline(&index, rid).map_or(0, |t| t.events.len());
    }
    let lookup_us = t.elapsed().as_secs_f64() * 1e6 / recent.len() as f64;
    println!(
        "hot path over {} events: EventsObserved {:.0} ns/event, timeline index (100k cap) {:.0} ns/event, \
         lookup by rid {:.1} µs ({:.1} events per timeline)",
        events.len(),
        metrics_ns,
        index_ns,
        lookup_us,
        found as f64 / recent.len() as f64
    );
}

fn main() {
    // `cargo test --all-targets` runs bench binaries without `--bench`: no measurement there
    // (the delivery guarantees themselves are tested in tests/suite/alert_delivery.rs).
    if !std::env::args().any(|a| a == "--bench") {
        println!("alert_delivery: run with `cargo bench -p revenant --bench alert_delivery`");
        return;
    }
    hot_path();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    println!("alert delivery (webhook on loopback, spool enabled)");
    println!(
        "{:<44} {:>9} {:>9} {:>9} {:>12}",
        "scenario", "p50 ms", "p99 ms", "max ms", "alerts/s"
    );
    for (name, n, rate, fsync, batch) in [
        (
            "steady 200/s, fsync, batch 50",
            2_000,
            Some(200.0),
            true,
            50,
        ),
        (
            "steady 200/s, no fsync, batch 50",
            2_000,
            Some(200.0),
            false,
            50,
        ),
        (
            "steady 1000/s, fsync, batch 50",
            5_000,
            Some(1000.0),
            true,
            50,
        ),
        ("burst 20000, fsync, batch 50", 20_000, None, true, 50),
        ("burst 20000, no fsync, batch 50", 20_000, None, false, 50),
        ("burst 5000, fsync, batch 1", 5_000, None, true, 1),
    ] {
        let r = rt.block_on(run(n, rate, fsync, batch));
        println!(
            "{:<44} {:>9.2} {:>9.2} {:>9.2} {:>12.0}",
            name,
            pct(&r.latencies, 0.5),
            pct(&r.latencies, 0.99),
            r.latencies.last().unwrap().as_secs_f64() * 1e3,
            n as f64 / r.elapsed.as_secs_f64()
        );
    }
}
