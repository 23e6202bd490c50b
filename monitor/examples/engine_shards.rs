//! How the engine scales when its input is split the way cluster mode splits it: the benchmark mix
//! routed by `bus::partition` (rooms and rids to one shard, request-level events to every
//! shard), one `Checker` per shard on a thread of its own, against one `Checker` on the whole
//! stream, alternated. `cargo run --release -p revenant --example engine_shards [ATTEMPTS]
//! [SHARDS] [ROUNDS]` (300 000, 2, 3).
//!
//! It prints the wall time of each and the speed-up, and the violations each found (the same
//! count: the split keeps every attempt's events together; `cluster_equivalence` holds the
//! split's verdicts to `revenant check`'s one by one).

use std::time::Instant;

use revenant::bus::partition::{Partitioner, Route};
use revenant::engine::check::{Checker, CheckerConfig, RuleSet};
use revenant::engine::workload::{Mix, stream};
use revenant::event::LifecycleEvent;

fn main() {
    let mut args = std::env::args().skip(1);
    let mut arg = |default: usize| args.next().and_then(|a| a.parse().ok()).unwrap_or(default);
    let (attempts, shards, rounds) = (arg(300_000), arg(2).max(1), arg(3).max(1));
    let events = stream(&Mix {
        attempts: attempts as u64,
        ..Mix::default()
    });
    let rules = RuleSet::embedded_defaults_without("").expect("the default rules load");
    let mut router = Partitioner::new(shards as u32, 1 << 20);
    let mut parts: Vec<Vec<LifecycleEvent>> = vec![Vec::new(); shards];
    let mut everywhere = 0usize;
    for e in &events {
        match router.route(e) {
            Route::One(k) => parts[k as usize].push(e.clone()),
            Route::All => {
                everywhere += 1;
                parts.iter_mut().for_each(|p| p.push(e.clone()));
            }
        }
    }
    println!(
        "{} events, {everywhere} to every shard; per shard {:?}",
        events.len(),
        parts.iter().map(Vec::len).collect::<Vec<_>>()
    );
    let check = |events: &[LifecycleEvent]| {
        let mut c = Checker::new(rules.clone(), CheckerConfig::default());
        events.iter().map(|e| c.observe(e).len()).sum::<usize>()
    };
    for _ in 0..rounds {
        let t = Instant::now();
        let one = check(&events);
        let one_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let split: usize = std::thread::scope(|s| {
            let threads: Vec<_> = parts.iter().map(|p| s.spawn(|| check(p))).collect();
            threads
                .into_iter()
                .map(|t| t.join().expect("a shard's thread"))
                .sum()
        });
        let split_s = t.elapsed().as_secs_f64();
        println!(
            "one checker {one_s:.3} s ({one} violations); {shards} shards {split_s:.3} s ({split} violations): {:.2}x",
            one_s / split_s
        );
    }
}
