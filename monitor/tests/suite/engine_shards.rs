//! The engine split over shards (`revenant run --engine-shards N`) judges as one checker does:
//! every scenario file, each also with its events arriving out of order, and generated streams
//! (the benchmark mix with the router's request-level receipts; requests failed as a whole with
//! retries in other rooms) go through the engine task with one checker and with 2 and 3 shards,
//! in batches as the sources send them, and the violations must be the same, each one whole
//! (rule, ids, fingerprint, evidence, summary), as many times each. A request-scope rule fires
//! once per request: when two of its attempts breach it on two shards, the finding names the
//! attempt of whichever shard reported first, so for those the rule, fingerprint and request
//! must be the same.

use std::sync::Arc;
use std::time::Duration;

use revenant::engine::check::CheckerConfig;
use revenant::engine::partition::room_partition;
use revenant::engine::rules::Scope;
use revenant::engine::workload::{self, Mix};
use revenant::pipeline::{Engine, EngineTask, ViolationSender, WatermarkClock, event_channel};
use revenant::telemetry::Metrics;
use revenant::{LifecycleEvent, RuleSet, Violation};

use crate::support::inputs::{load, request_level_stream, scenario_files};

/// Every violation the engine task emits for `events`, sent in batches of `batch`, with `shards`
/// checkers; each as its JSON, sorted.
fn judge(events: &[LifecycleEvent], shards: usize, batch: usize) -> Vec<String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (tx, rx) = event_channel(64);
        let (vtx, mut vrx) = tokio::sync::mpsc::channel::<Violation>(1 << 20);
        let task = EngineTask {
            engine: Engine::new(
                &RuleSet::embedded_defaults(),
                &CheckerConfig::default(),
                shards,
            ),
            events: rx,
            violations: ViolationSender::new(vtx, Arc::new(Metrics::new())),
            taps: vec![],
            lateness: CheckerConfig::default().allowed_lateness,
            pause_file: None,
            clock: WatermarkClock::Event,
            upstream: None,
        };
        assert_eq!(task.engine.shards(), shards);
        let handle = tokio::spawn(task.run(std::future::pending()));
        for b in events.chunks(batch) {
            tx.send(b.to_vec()).await.unwrap();
        }
        drop(tx);
        let totals = tokio::time::timeout(Duration::from_secs(60), handle)
            .await
            .expect("the engine task ends once its input does")
            .unwrap()
            .unwrap();
        assert_eq!(totals.events, events.len() as u64);
        let rules = RuleSet::embedded_defaults();
        let mut out = Vec::new();
        let mut fingerprints = std::collections::BTreeMap::new();
        while let Ok(mut v) = vrx.try_recv() {
            // One fingerprint per request and rule; which alias it is made of depends on which
            // finding came first, which the shards race for.
            for alias in [&v.request.request_id, &v.request.trace_id]
                .into_iter()
                .flatten()
            {
                fingerprints
                    .entry((v.rule.clone(), alias.clone()))
                    .or_insert_with(std::collections::BTreeSet::new)
                    .insert(v.fingerprint.clone());
            }
            if !v.request.is_empty() {
                v.fingerprint.clear();
            }
            let rule = rules.rules.iter().find(|r| r.name == v.rule).unwrap();
            out.push(match rule.scope {
                Scope::Attempt => serde_json::to_string(&v).unwrap(),
                Scope::Request => {
                    serde_json::to_string(&(&v.rule, &v.fingerprint, &v.request, v.corroborates))
                        .unwrap()
                }
            });
        }
        assert_eq!(
            totals.violations,
            out.len() as u64,
            "every violation counted once"
        );
        for ((rule, alias), f) in &fingerprints {
            assert!(
                f.len() == 1 || shards == 1,
                "{rule} on {alias}: {} fingerprints with {shards} shards",
                f.len()
            );
        }
        out.sort();
        out
    })
}

fn same_verdicts(name: &str, events: &[LifecycleEvent]) -> usize {
    let one = judge(events, 1, 16);
    for (shards, batch) in [(2, 16), (3, 5)] {
        let split = judge(events, shards, batch);
        if split != one {
            let missing: Vec<_> = one.iter().filter(|v| !split.contains(v)).collect();
            let extra: Vec<_> = split.iter().filter(|v| !one.contains(v)).collect();
            panic!(
                "{name}: {shards} shards found {} violations, one checker {}\n\
                 only one checker ({}, the first three): {:#?}\n\
                 only the shards ({}, the first three): {:#?}",
                split.len(),
                one.len(),
                missing.len(),
                &missing[..missing.len().min(3)],
                extra.len(),
                &extra[..extra.len().min(3)],
            );
        }
    }
    one.len()
}

/// Out of order within the allowed lateness: each run of five events reversed.
fn reversed_in_fives(events: &[LifecycleEvent]) -> Vec<LifecycleEvent> {
    events
        .chunks(5)
        .flat_map(|c| c.iter().rev().cloned())
        .collect()
}

#[test]
fn sharded_engines_judge_every_scenario_as_one_checker() {
    let mut found = 0;
    for path in scenario_files() {
        let events = load(&path);
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        found += same_verdicts(&name, &events);
        found += same_verdicts(
            &format!("{name}, reversed in fives"),
            &reversed_in_fives(&events),
        );
    }
    assert!(found > 40, "the scenarios hold violations: {found}");
}

#[test]
fn sharded_engines_judge_late_events_as_one_checker() {
    // Attempts 2 ms apart over 40 s. A few attempts live on a shard of their own (shard 0 with
    // both 2 and 3 shards: no other attempt goes there), and the second half of their events
    // arrives 20 s late, beyond the allowed lateness. One checker's watermark has passed their
    // deadlines by then, moved by the other attempts' events; shard 0 sees none of those, only
    // the newest time it is given with each of its own.
    let mix = workload::stream(&Mix {
        attempts: 20_000,
        reject_every: 10,
        spacing_ns: 2_000_000,
        ..Mix::default()
    });
    let alone = |e: &LifecycleEvent| {
        e.ids
            .bootstrap_room
            .is_some_and(|r| room_partition(r.0, 2) == 0 && room_partition(r.0, 3) == 0)
    };
    let mut kept_rooms = std::collections::BTreeMap::<u64, usize>::new();
    let mut events = Vec::new();
    for e in &mix {
        if !alone(e) {
            events.push(e.clone());
            continue;
        }
        let room = e.ids.bootstrap_room.unwrap().0;
        if kept_rooms.len() >= 20 && !kept_rooms.contains_key(&room) {
            continue;
        }
        let seen = kept_rooms.entry(room).or_default();
        *seen += 1;
        let mut e = e.clone();
        if *seen > 5 {
            // Arrives late: placed by a time 20 s past its own.
            e.time_ns += 20_000_000_000;
            events.push(e);
        } else {
            events.push(e);
        }
    }
    // The late ones' own times back, in their late arrival order.
    let mut order: Vec<(u64, usize)> = events
        .iter()
        .enumerate()
        .map(|(i, e)| (e.time_ns, i))
        .collect();
    order.sort();
    let late: Vec<LifecycleEvent> = order
        .into_iter()
        .map(|(_, i)| {
            let mut e = events[i].clone();
            if alone(&e) && e.time_ns > mix.last().unwrap().time_ns {
                e.time_ns -= 20_000_000_000;
            }
            e
        })
        .collect();
    let found = same_verdicts("benchmark mix, a lone shard's events 20 s late", &late);
    assert!(found >= 150, "the late events' breaches: {found}");
}

#[test]
fn sharded_engines_judge_generated_streams_as_one_checker() {
    let mix = workload::stream(&Mix {
        attempts: 20_000,
        reject_every: 10,
        receipts: true,
        ..Mix::default()
    });
    let found = same_verdicts("benchmark mix with receipts", &mix);
    assert!(found >= 150, "the mix's breaches: {found}");
    let requests = request_level_stream(3_000);
    let found = same_verdicts("request-level stream", &requests);
    assert!(found >= 100, "the request-level breaches: {found}");
    let found = same_verdicts(
        "request-level stream, reversed in fives",
        &reversed_in_fives(&requests),
    );
    assert!(found >= 100, "the request-level breaches: {found}");
}
