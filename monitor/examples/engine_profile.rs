//! Feeds the benchmark mix through the engine once, for profilers:
//! `cargo build --release -p revenant --example engine_profile && perf record ./target/release/examples/engine_profile`.

use std::time::Instant;

use revenant::checker::{Checker, CheckerConfig, RuleSet};
use revenant::workload::{Mix, stream};

fn main() {
    let attempts = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(300_000);
    let t = Instant::now();
    let events = stream(&Mix {
        attempts,
        ..Mix::default()
    });
    eprintln!("generated in {:.2} s", t.elapsed().as_secs_f64());
    let mut checker = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
    let start = Instant::now();
    let mut violations = 0;
    for e in &events {
        violations += checker.observe(e).len();
    }
    let dt = start.elapsed();
    println!(
        "{} events in {:.3} s = {:.0} events/s, {violations} violations",
        events.len(),
        dt.as_secs_f64(),
        events.len() as f64 / dt.as_secs_f64()
    );
}
