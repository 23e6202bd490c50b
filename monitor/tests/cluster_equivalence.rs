//! Cluster mode judges as `revenant check` does: for every scenario file and for generated
//! streams, the events are split over three `revenant agent`s (router, prefill and decode as
//! three nodes, each node's events to its own agent, recorded node clocks shifted by up to 14 ms,
//! inside the 50 ms skew bound), published to a real `nats-server -js` on loopback, and judged by
//! `revenant checker`s with 1, 2 and 4 partitions (two checkers sharing the partitions when
//! there are several); the set of violations they write equals the set `revenant check` prints
//! for the same events as one file.
//!
//! A violation's identity is its rule and what broke it (attempt-scope: room, else rid, and
//! worker; request-scope: the request id), as in `scenarios.rs`; corroborating follow-ups are
//! left out on both sides.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use revenant::engine::workload::{self, Mix};
use revenant::{Kind, LifecycleEvent, RuleSet, Source, Stage};
use support::cluster::{Bus, Member, check, keys, load, wait_batches_taken, wait_metric, write};
use support::{Nats, ScratchDir};

fn scenario_files() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/scenarios");
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
        .collect();
    v.sort();
    assert!(v.len() >= 20, "scenario files missing: {v:?}");
    v
}

/// Which of the three agents sees an event: a recorded node's events all go to one agent (in
/// order of first appearance); events of no node go by stage (router, prefill and the
/// transfer it serves, decode), as three nodes would see them. Recorded nodes' clocks are
/// shifted by 0, 7 or 14 ms with their agent.
fn split(events: &[LifecycleEvent]) -> (Vec<LifecycleEvent>, [Vec<LifecycleEvent>; 3]) {
    let mut nodes: Vec<Box<str>> = Vec::new();
    let mut merged = Vec::with_capacity(events.len());
    let mut parts: [Vec<LifecycleEvent>; 3] = Default::default();
    for e in events {
        let mut e = e.clone();
        let agent = match &e.node {
            Some(n) => {
                let i = nodes.iter().position(|m| m == n).unwrap_or_else(|| {
                    nodes.push(n.clone());
                    nodes.len() - 1
                });
                e.time_ns += (i % 3) as u64 * 7_000_000;
                i % 3
            }
            None => match e.stage {
                Stage::Router => 0,
                Stage::Prefill | Stage::Transfer => 1,
                Stage::Decode => 2,
            },
        };
        parts[agent].push(e.clone());
        merged.push(e);
    }
    (merged, parts)
}

/// One run: agents publish `parts`, checkers with `partitions` judge; their violations.
fn cluster(
    nats: &str,
    dir: &Path,
    name: &str,
    parts: &[Vec<LifecycleEvent>; 3],
    partitions: u32,
) -> String {
    let bus = Bus {
        nats: nats.into(),
        stream: format!("{name}-p{partitions}"),
        partitions,
    };
    let run = dir.join(&bus.stream);
    let owned: Vec<Vec<u32>> = if partitions == 1 {
        vec![vec![0]]
    } else {
        vec![
            (0..partitions).filter(|k| k % 2 == 0).collect(),
            (0..partitions).filter(|k| k % 2 == 1).collect(),
        ]
    };
    let checkers: Vec<Member> = owned
        .iter()
        .enumerate()
        .map(|(i, own)| Member::checker(&bus, &run.join(format!("checker{i}")), own, &[]))
        .collect();
    let mut batches = 0u64;
    for (i, events) in parts.iter().enumerate() {
        if events.is_empty() {
            continue;
        }
        let d = run.join(format!("agent{i}"));
        std::fs::create_dir_all(&d).unwrap();
        write(&d.join("events.jsonl"), events);
        let mut agent = Member::agent(
            &bus,
            &d,
            &format!("agent-{i}"),
            Some(&d.join("events.jsonl")),
        );
        wait_metric(
            &format!("agent {i} of {} routing its file", bus.stream),
            &[&agent.admin],
            "revenant_agent_events_total",
            events.len() as f64,
        );
        // Stopping publishes what the batcher and the outbox still hold, then exits.
        agent.stop();
        batches += agent.published();
    }
    let admins: Vec<&str> = checkers.iter().map(|c| c.admin.as_str()).collect();
    wait_batches_taken(
        &format!("checkers of {} taking every batch", bus.stream),
        &admins,
        batches as f64,
    );
    let mut out = String::new();
    for mut c in checkers {
        c.stop();
        out.push_str(&c.violations());
    }
    out
}

/// Requests of one or two attempts with request-level router events around them: failures of
/// the whole request (some followed by an attempt's activity), retries in other rooms.
fn request_level_stream(requests: u64) -> Vec<LifecycleEvent> {
    const MS: u64 = 1_000_000;
    let mut v = Vec::new();
    for i in 0..requests {
        let t0 = 1_795_986_920_000_000_000 + i * 3 * MS;
        let q = format!("gen-{i}");
        let rooms: Vec<u64> = (0..1 + i % 2).map(|a| i * 1_000_003 + a * 7 + 1).collect();
        v.push(
            LifecycleEvent::new(t0, Stage::Router, Kind::Received, Source::Otlp)
                .with_request_id(q.as_str()),
        );
        for (a, room) in rooms.iter().enumerate() {
            let t = t0 + a as u64 * 10 * MS;
            for to in [Stage::Prefill, Stage::Decode] {
                v.push(
                    LifecycleEvent::new(t, Stage::Router, Kind::Dispatched, Source::Ebpf)
                        .with_request_id(q.as_str())
                        .with_room(*room)
                        .with_to(to),
                );
            }
            v.push(
                LifecycleEvent::new(t + MS, Stage::Prefill, Kind::Received, Source::Ebpf)
                    .with_room(*room),
            );
            if i % 3 == 0 {
                v.push(
                    LifecycleEvent::new(t + 2 * MS, Stage::Prefill, Kind::Rejected, Source::Otlp)
                        .with_room(*room)
                        .with_status(503),
                );
            }
            v.push(
                LifecycleEvent::new(t + 4 * MS, Stage::Decode, Kind::Work, Source::Ebpf)
                    .with_room(*room),
            );
        }
        if i % 5 == 0 {
            v.push(
                LifecycleEvent::new(t0 + 3 * MS, Stage::Router, Kind::Completed, Source::Otlp)
                    .with_request_id(q.as_str())
                    .with_status(502),
            );
        }
    }
    v.sort_by_key(|e| e.time_ns);
    v
}

#[test]
fn every_split_over_agents_and_partitions_judges_as_check_does() {
    let nats = Nats::single().unwrap();
    let url = nats.urls();
    let dir = ScratchDir::new("cluster-equivalence").unwrap();
    let rules = RuleSet::embedded_defaults();
    let mut inputs: Vec<(String, Vec<LifecycleEvent>)> = scenario_files()
        .iter()
        .map(|p| {
            let name = p.file_stem().unwrap().to_string_lossy().replace('.', "_");
            (name, load(p))
        })
        .collect();
    inputs.push((
        "generated-workload".into(),
        workload::stream(&Mix {
            attempts: 1500,
            reject_every: 7,
            spacing_ns: 200_000,
            ..Mix::default()
        }),
    ));
    inputs.push(("generated-requests".into(), request_level_stream(400)));

    // REVENANT_EQUIVALENCE_ONLY=NAME: that input only (the rest of the test's checks still run).
    let only = std::env::var("REVENANT_EQUIVALENCE_ONLY").ok();
    let mut failures = Vec::new();
    let mut judged = BTreeMap::new();
    for (name, events) in &inputs {
        if only.as_ref().is_some_and(|o| o != name) {
            continue;
        }
        let (merged, parts) = split(events);
        let merged_file = dir.path().join(format!("{name}.merged.jsonl"));
        write(&merged_file, &merged);
        let expected = keys(&rules, &check(&merged_file));
        judged.insert(name.clone(), expected.len());
        for partitions in [1u32, 2, 4] {
            let got = keys(&rules, &cluster(&url, dir.path(), name, &parts, partitions));
            if got != expected {
                let missing: Vec<_> = expected.difference(&got).collect();
                let extra: Vec<_> = got.difference(&expected).collect();
                failures.push(format!(
                    "{name}, {partitions} partitions: {} missing (first: {:?}), {} extra (first: {:?})",
                    missing.len(),
                    &missing[..missing.len().min(3)],
                    extra.len(),
                    &extra[..extra.len().min(3)],
                ));
            }
        }
    }
    eprintln!("violations per input (check = cluster): {judged:?}");
    assert!(
        only.is_some() || judged.values().filter(|n| **n > 0).count() >= 15,
        "too few inputs with violations to tell anything: {judged:?}"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
