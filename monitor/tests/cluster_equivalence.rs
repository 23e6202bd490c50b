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
use std::path::Path;

use revenant::engine::workload::{self, Mix};
use revenant::{LifecycleEvent, RuleSet, Stage};
use support::cluster::{Bus, Member, check, keys, wait_batches_taken, wait_metric, write};
use support::inputs::{load, request_level_stream, scenario_files};
use support::{Nats, ScratchDir};

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
