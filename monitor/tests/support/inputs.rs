//! Inputs the engine's splits are held to one checker's with (`cluster_equivalence`, the suite's
//! `engine_shards`): the scenario files, read as `revenant check` reads them, and a generated
//! stream of request-level events around their attempts.

use std::path::{Path, PathBuf};

use revenant::ingest::replay;
use revenant::{Kind, LifecycleEvent, Source, Stage};

/// `tests/scenarios`: events (`NAME.jsonl`) and their expected verdicts (`NAME.expected`).
pub fn scenario_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/scenarios")
}

/// `tests/scenarios/*.jsonl`, sorted.
pub fn scenario_files() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(scenario_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
        .collect();
    v.sort();
    assert!(v.len() >= 20, "scenario files missing: {v:?}");
    v
}

/// The events of a replay file; a line that does not read fails the test.
pub fn load(path: &Path) -> Vec<LifecycleEvent> {
    let text = std::fs::read(path).unwrap();
    let mut events = Vec::new();
    replay::read_events(
        &text[..],
        |e| events.push(e),
        |e| panic!("{}: {e}", path.display()),
    )
    .unwrap();
    events
}

/// Requests of one or two attempts with request-level router events around them: failures of
/// the whole request (some followed by an attempt's activity), retries in other rooms.
pub fn request_level_stream(requests: u64) -> Vec<LifecycleEvent> {
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
