//! Memory per live attempt and per tombstone, measured with a counting allocator (heap bytes
//! really allocated, not estimated), and how many allocations the engine makes per observed
//! event. Run: `cargo bench -p revenant --bench state_size`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, AtomicUsize, Ordering};

use revenant::engine::check::{Checker, CheckerConfig, RuleSet};
use revenant::engine::workload::{Mix, attempt_events};

struct Counting;
static LIVE_BYTES: AtomicIsize = AtomicIsize::new(0);
/// Allocations and reallocations made.
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(l.size() as isize, Ordering::Relaxed);
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE_BYTES.fetch_sub(l.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE_BYTES.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn main() {
    // `cargo test --all-targets` runs benches once in test mode; keep that quick.
    let n: u64 = if std::env::args().any(|a| a == "--bench") {
        100_000
    } else {
        2_000
    };
    let mix = Mix {
        attempts: n,
        reject_every: 100,
        ..Mix::default()
    };
    let mut checker = Checker::new(rules(), CheckerConfig::default());

    // Live: every attempt gets all but its last event, so none ends.
    let mut tails = Vec::with_capacity(n as usize);
    let mut all = Vec::new();
    for i in 0..n {
        let mut evs = attempt_events(&mix, i);
        tails.push(evs.pop().unwrap());
        all.extend(evs);
    }
    all.sort_by_key(|e| e.time_ns);
    let before = LIVE_BYTES.load(Ordering::Relaxed);
    let allocations = ALLOCATIONS.load(Ordering::Relaxed);
    for e in &all {
        checker.observe(e);
    }
    let allocations = ALLOCATIONS.load(Ordering::Relaxed) - allocations;
    let live_bytes = LIVE_BYTES.load(Ordering::Relaxed) - before;
    let s = checker.stats();
    println!(
        "live: {} attempts, {} requests, {} B heap -> {:.1} B per live attempt (request included)",
        s.live_attempts,
        s.live_requests,
        live_bytes,
        live_bytes as f64 / s.live_attempts as f64
    );
    // Per-attempt state (its solo request's ids, a rejection's reason) and table growth are
    // allocations too; anything above that is an allocation per event.
    println!(
        "allocations while observing: {allocations} for {} events -> {:.3} per event, {:.2} per attempt",
        all.len(),
        allocations as f64 / all.len() as f64,
        allocations as f64 / s.live_attempts as f64
    );
    drop(all);
    // Heap that is not the engine's (the tails kept for later), for the whole-heap figure below.
    let outside = LIVE_BYTES.load(Ordering::Relaxed) - live_bytes;
    // Where the bytes are (tables by capacity, per live attempt; the rest of the heap is the
    // request id strings and the side maps).
    let per = |b: usize| b as f64 / s.live_attempts as f64;
    let tables = checker.state_breakdown();
    let table_total: usize = tables.iter().map(|t| t.1).sum();
    for (name, bytes) in &tables {
        println!("  {name}: {:.1} B per live attempt", per(*bytes));
    }
    println!(
        "  other heap (strings, side maps): {:.1} B per live attempt; alias entries {}",
        per((live_bytes as usize).saturating_sub(table_total)),
        checker.alias_entries()
    );

    // Tombstones: end every attempt, then let the watermark pass the linger so all compact.
    let before_t = LIVE_BYTES.load(Ordering::Relaxed);
    for e in &tails {
        checker.observe(e);
    }
    let last = tails.iter().map(|e| e.time_ns).max().unwrap();
    let mut t = last;
    while checker.stats().live_attempts > 0 {
        t += 100_000_000;
        checker.tick(t + 2_000_000_000);
        assert!(t < last + 60_000_000_000, "attempts did not compact");
    }
    let s = checker.stats();
    println!(
        "tombstones: {} (live attempts {}, requests {}, alias entries {}), tombstone tables {} B -> {:.1} B per tombstone (queue, kept slots, alias index at its real capacity)",
        s.tombstones,
        s.live_attempts,
        s.live_requests,
        checker.alias_entries(),
        checker.tombstone_bytes(),
        checker.tombstone_bytes() as f64 / s.tombstones as f64
    );
    // The whole heap once only tombstones are left: besides the tombstone tables, each keeps its
    // request (a record, its slots and ids) for late activity, and the tables keep their peak
    // capacity.
    let _ = before_t;
    let heap = LIVE_BYTES.load(Ordering::Relaxed) - outside;
    println!(
        "whole engine heap with only tombstones left: {} B -> {:.1} B per tombstone (requests and tables' spare capacity included)",
        heap,
        heap as f64 / s.tombstones as f64
    );
    for (name, bytes) in &checker.state_breakdown() {
        println!(
            "  {name}: {:.1} B per tombstone",
            *bytes as f64 / s.tombstones as f64
        );
    }
    println!(
        "engine table bytes (capacity-based): {}",
        checker.state_bytes()
    );
    println!(
        "sizes: Attempt {} B, Request {} B, Tombstone {} B, stored slot 8 B (+ an 8 B base per row); wide rows {}",
        std::mem::size_of::<revenant::engine::identity::Attempt>(),
        std::mem::size_of::<revenant::engine::identity::Request>(),
        std::mem::size_of::<revenant::engine::identity::Tombstone>(),
        checker.stats().wide_slot_rows
    );
}

/// The default rules, minus those named in `REVENANT_BENCH_DISABLE` (comma-separated): the same
/// run without them shows what they cost.
fn rules() -> RuleSet {
    RuleSet::embedded_defaults_without(&std::env::var("REVENANT_BENCH_DISABLE").unwrap_or_default())
        .unwrap_or_else(|name| panic!("REVENANT_BENCH_DISABLE: no rule {name:?}"))
}
