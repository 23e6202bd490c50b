//! How `revenant run`'s engine scales with `--engine-shards`: the benchmark mix (with the
//! router's request-level receipts, which go to every shard) sent in batches of 1 024 events
//! through the engine task, as the sources send them, with one checker and with SHARDS
//! shards, alternated; the wall time from the first batch to the end of the drain.
//! `cargo run --release -p revenant --example engine_shards [ATTEMPTS] [SHARDS] [ROUNDS]`
//! (300 000, 2, 3).
//!
//! It prints the events per second of each and the speed-up, and the violations each found
//! (the same count: `tests/suite/engine_shards.rs` holds the verdicts to one checker's one by
//! one).

use std::sync::Arc;
use std::time::Instant;

use revenant::engine::check::{CheckerConfig, RuleSet};
use revenant::engine::workload::{Mix, stream};
use revenant::pipeline::{Engine, EngineTask, ViolationSender, WatermarkClock, event_channel};
use revenant::telemetry::Metrics;

fn main() {
    let mut args = std::env::args().skip(1);
    let mut arg = |default: usize| args.next().and_then(|a| a.parse().ok()).unwrap_or(default);
    let (attempts, shards, rounds) = (arg(300_000), arg(2).max(1), arg(3).max(1));
    let events = stream(&Mix {
        attempts: attempts as u64,
        receipts: true,
        ..Mix::default()
    });
    let batches: Vec<Vec<_>> = events.chunks(1024).map(<[_]>::to_vec).collect();
    let rules = RuleSet::embedded_defaults();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let run = |n: usize| {
        let batches = batches.clone();
        rt.block_on(async {
            let (tx, rx) = event_channel(64);
            let (vtx, mut vrx) = tokio::sync::mpsc::channel(1 << 20);
            let task = EngineTask {
                engine: Engine::new(&rules, &CheckerConfig::default(), n),
                events: rx,
                violations: ViolationSender::new(vtx, Arc::new(Metrics::new())),
                taps: vec![],
                lateness: CheckerConfig::default().allowed_lateness,
                pause_file: None,
                clock: WatermarkClock::Event,
                upstream: None,
            };
            let t = Instant::now();
            let handle = tokio::spawn(task.run(std::future::pending()));
            for b in batches {
                tx.send(b).await.expect("the engine task takes batches");
            }
            drop(tx);
            let totals = handle.await.expect("the task").expect("the engine");
            let secs = t.elapsed().as_secs_f64();
            let mut found = 0;
            while vrx.try_recv().is_ok() {
                found += 1;
            }
            assert_eq!(totals.violations, found);
            (secs, found)
        })
    };
    println!("{} events in {} batches", events.len(), batches.len());
    for _ in 0..rounds {
        let (one_s, one) = run(1);
        let (split_s, split) = run(shards);
        let rate = |s: f64| events.len() as f64 / s / 1e6;
        println!(
            "one checker {one_s:.3} s ({:.2}M events/s, {one} violations); {shards} shards {split_s:.3} s ({:.2}M events/s, {split} violations): {:.2}x",
            rate(one_s),
            rate(split_s),
            one_s / split_s
        );
    }
}
