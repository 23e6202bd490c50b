//! Engine throughput on a realistic mix: ~10 events per attempt, 1% rejected, 100k attempts live
//! at once (1 µs apart, 100 ms each). Run: `cargo bench -p revenant --bench checker`.

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use revenant::engine::check::{Checker, CheckerConfig, RuleSet};
use revenant::engine::workload::{Mix, stream};

fn engine(c: &mut Criterion) {
    let mix = Mix {
        attempts: 300_000,
        ..Mix::default()
    };
    let events = stream(&mix);
    let mut g = c.benchmark_group("checker");
    g.throughput(Throughput::Elements(events.len() as u64));
    g.sample_size(10);
    g.bench_function("observe_realistic_mix_100k_live", |b| {
        b.iter_batched(
            || Checker::new(rules(), CheckerConfig::default()),
            |mut checker| {
                let mut violations = 0usize;
                for e in &events {
                    violations += checker.observe(e).len();
                }
                assert!(
                    violations > 0,
                    "the mix contains no breach; the workload is broken"
                );
                checker
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

criterion_group!(benches, engine);
criterion_main!(benches);

/// The default rules, minus those named in `REVENANT_BENCH_DISABLE` (comma-separated): the same
/// run without them shows what they cost.
fn rules() -> RuleSet {
    RuleSet::embedded_defaults_without(&std::env::var("REVENANT_BENCH_DISABLE").unwrap_or_default())
        .unwrap_or_else(|name| panic!("REVENANT_BENCH_DISABLE: no rule {name:?}"))
}
