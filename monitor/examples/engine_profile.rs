//! Feeds the benchmark mix through the engine once, for profilers and for comparing builds on a
//! busy machine: `cargo run --release -p revenant --example engine_profile [ATTEMPTS] [PASSES]`.
//! Besides wall time it reports the thread's CPU time, which other processes on the same cores
//! inflate far less than wall time. `REVENANT_BENCH_DISABLE=NAME,…` leaves the rules named out,
//! as in the `checker` bench (under callgrind: the instructions a rule costs).

use std::time::Instant;

use revenant::engine::check::{Checker, CheckerConfig, RuleSet};
use revenant::engine::workload::{Mix, stream};

fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

fn main() {
    let mut args = std::env::args().skip(1);
    let attempts = args.next().and_then(|a| a.parse().ok()).unwrap_or(300_000);
    let passes: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1);
    let t = Instant::now();
    let events = stream(&Mix {
        attempts,
        ..Mix::default()
    });
    eprintln!("generated in {:.2} s", t.elapsed().as_secs_f64());
    let disable = std::env::var("REVENANT_BENCH_DISABLE").unwrap_or_default();
    let rules = RuleSet::embedded_defaults_without(&disable)
        .unwrap_or_else(|name| panic!("REVENANT_BENCH_DISABLE: no rule {name:?}"));
    for _ in 0..passes {
        let mut checker = Checker::new(rules.clone(), CheckerConfig::default());
        let start = Instant::now();
        let cpu = thread_cpu_s();
        let mut violations = 0;
        for e in &events {
            violations += checker.observe(e).len();
        }
        let cpu = thread_cpu_s() - cpu;
        let dt = start.elapsed();
        println!(
            "{} events in {:.3} s = {:.0} events/s wall, {:.0} events per CPU second, {violations} violations",
            events.len(),
            dt.as_secs_f64(),
            events.len() as f64 / dt.as_secs_f64(),
            events.len() as f64 / cpu,
        );
    }
}
