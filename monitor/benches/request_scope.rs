//! What cluster mode's broadcasting of request-level events costs against the repartition step
//! it stands in for, measured on recorded traffic rather than estimated.
//!
//! Run: `cargo bench -p revenant --bench request_scope -- --events FILE… [--rules FILE]`
//! (`FILE`: a `--events-jsonl` file of `revenant run`, or any file in the replay format).
//!
//! Each event is routed as the agents route it (`bus::partition`, one router per node, so the
//! rid → room links are the ones that node's agent would have): an event that names no attempt
//! goes to every partition (`N_all` of the `N` events), the rest to one. Broadcasting carries
//! `(N + (P − 1)·N_all) / N` of the unbroadcast volume at `P` partitions.
//!
//! A repartition step would publish each request-level event once, to a second tier keyed by
//! request, and then move two things between the tiers: every attempt-level event that a
//! request-scope rule reads, published again under the request's key (`N_rs`: it matches a
//! matcher of an enabled `scope: request` rule), and every request-level event that an
//! attempt-scope rule reads, forwarded to the partition of each of the request's attempts
//! (`N_all_a`, counted once: at least one attempt per request, so a lower bound). It carries at
//! least `(N + N_rs + N_all_a) / N`, and adds a consumer tier and its lag. So broadcasting is the
//! cheaper below `P* = 1 + (N_rs + N_all_a) / N_all` partitions (an upper bound on the
//! crossover when requests retry); printed with the figures it comes from.

use std::collections::HashMap;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use revenant::bus::partition::{Partitioner, Route};
use revenant::engine::matcher::any_matches;
use revenant::engine::rules::{RuleSet, Scope};
use revenant::ingest::replay::read_events;

const USAGE: &str =
    "usage: cargo bench -p revenant --bench request_scope -- --events FILE… [--rules FILE]";

fn fail(message: &str) -> ! {
    eprintln!("request_scope: {message}");
    std::process::exit(2)
}

struct Args {
    events: Vec<PathBuf>,
    rules: Option<PathBuf>,
}

fn args() -> Args {
    let mut a = Args {
        events: Vec::new(),
        rules: None,
    };
    let v: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < v.len() {
        match v[i].as_str() {
            "--events" => {
                while let Some(f) = v.get(i + 1).filter(|f| !f.starts_with("--")) {
                    a.events.push(f.into());
                    i += 1;
                }
            }
            "--rules" => {
                a.rules = v.get(i + 1).map(PathBuf::from);
                i += 1;
            }
            // `cargo bench` passes `--bench`.
            "--bench" => {}
            other => fail(&format!("unknown argument {other}: {USAGE}")),
        }
        i += 1;
    }
    a
}

/// Counts of one traffic sample.
#[derive(Debug, Default)]
struct Counts {
    events: u64,
    /// Events that name no attempt: sent to every partition.
    request_level: u64,
    /// Attempt-level events a request-scope rule reads: what a repartition step publishes again.
    republished: u64,
    /// Request-level events an attempt-scope rule reads: what it forwards to the attempts.
    forwarded: u64,
    bad_lines: u64,
}

fn main() {
    let mut a = args();
    // `cargo test --all-targets` runs bench binaries without `--bench` or files: then the real
    // smg 1.13.0 capture among the scenarios, whose router spans name no room.
    let smoke = a.events.is_empty() && !std::env::args().any(|a| a == "--bench");
    if smoke {
        a.events.push(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../tests/scenarios/smg-1.13.0-concurrent-cancel.jsonl"),
        );
    } else if a.events.is_empty() {
        fail(USAGE);
    }
    let rules = match &a.rules {
        Some(p) => RuleSet::from_file(p).unwrap_or_else(|e| fail(&format!("{}: {e}", p.display()))),
        None => RuleSet::embedded_defaults(),
    };
    let request_scope: Vec<_> = rules
        .enabled()
        .filter(|r| r.scope == Scope::Request)
        .collect();
    let names: Vec<&str> = request_scope.iter().map(|r| r.name.as_str()).collect();
    let matchers_of = |scope: Scope| -> Vec<_> {
        rules
            .enabled()
            .filter(|r| r.scope == scope)
            .flat_map(|r| r.shape.matchers())
            .map(|(_, m)| m)
            .collect()
    };
    let (request_rules, attempt_rules) = (matchers_of(Scope::Request), matchers_of(Scope::Attempt));
    let mut c = Counts::default();
    // The partition count does not change which events are request-level or read by a rule.
    let mut routers: HashMap<Option<Box<str>>, Partitioner> = HashMap::new();
    for f in &a.events {
        let file = std::fs::File::open(f).unwrap_or_else(|e| {
            fail(&format!(
                "{}: {e} (paths are from monitor/ under cargo)",
                f.display()
            ))
        });
        read_events(
            BufReader::new(file),
            |e| {
                c.events += 1;
                let route = routers
                    .entry(e.node.clone())
                    .or_insert_with(|| Partitioner::new(64, 1 << 16))
                    .route(&e);
                let read_by = |ms: &[&[_]]| ms.iter().any(|m| any_matches(m, &e));
                match route {
                    Route::All => {
                        c.request_level += 1;
                        if read_by(&attempt_rules) {
                            c.forwarded += 1;
                        }
                    }
                    Route::One(_) if read_by(&request_rules) => c.republished += 1,
                    Route::One(_) => {}
                }
            },
            |_| c.bad_lines += 1,
        )
        .unwrap_or_else(|e| fail(&format!("{}: {e}", f.display())));
    }
    if c.events == 0 {
        fail(&format!("no events in {:?}", a.events));
    }
    let n = c.events as f64;
    println!(
        "{} events ({} bad lines skipped); request-scope rules: {}",
        c.events,
        c.bad_lines,
        names.join(", ")
    );
    let pct = |k: u64| 100.0 * k as f64 / n;
    println!(
        "request-level (broadcast) N_all = {} ({:.1} %), of which read by an attempt-scope rule N_all_a = {} ({:.1} %); \
         attempt-level read by a request-scope rule N_rs = {} ({:.1} %)",
        c.request_level,
        pct(c.request_level),
        c.forwarded,
        pct(c.forwarded),
        c.republished,
        pct(c.republished)
    );
    let repartition = (n + (c.republished + c.forwarded) as f64) / n;
    println!("partitions  broadcast volume  repartition volume (at least)");
    for p in [1u32, 2, 4, 8, 16, 32] {
        println!(
            "{p:>10}  {:>15.2}x  {:>17.2}x",
            (n + f64::from(p - 1) * c.request_level as f64) / n,
            repartition
        );
    }
    if smoke {
        assert!(
            c.request_level > 0 && c.forwarded == c.request_level && c.republished > 0,
            "the smg capture's router spans are request-level and read by attempt-scope rules, \
             its workers' events by the request-scope rule: {c:?}"
        );
    }
    if c.request_level == 0 {
        println!("no request-level events: broadcasting costs nothing at any partition count");
    } else {
        println!(
            "broadcasting is the cheaper below P* = 1 + (N_rs + N_all_a) / N_all = {:.1} partitions",
            1.0 + (c.republished + c.forwarded) as f64 / c.request_level as f64
        );
    }
}
