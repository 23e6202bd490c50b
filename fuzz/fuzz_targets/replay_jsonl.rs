//! The replay JSON Lines reader (`ingest::replay`, what `revenant check --events` reads and
//! `revenant run --events-jsonl` writes).
//!
//! Holds: no panic; bad lines are reported with a message and their 1-based line number, in
//! order; every event read is written back in the replay format and reads back equal (a file
//! recorded by `run` checks the same as the events `run` saw); the fast decoder gives every line
//! the result serde gives it, event or message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use revenant::ingest::replay::{self, ReplayError, ReplayRecord};

fuzz_target!(|data: &[u8]| {
    let lines = data.split(|&b| b == b'\n').count() as u64;
    let mut last_bad = 0;
    let mut events = Vec::new();
    replay::read_events(
        data,
        |e| events.push(e),
        |e| match e {
            ReplayError::Line { line, message } => {
                assert!(
                    !message.is_empty(),
                    "line {line}: an error without a message"
                );
                assert!(line > last_bad && line <= lines, "line {line} of {lines}");
                last_bad = line;
            }
            other => panic!("unexpected error from an in-memory reader: {other}"),
        },
    )
    .expect("reading from memory cannot fail");
    for line in data.split(|&b| b == b'\n') {
        if let Ok(line) = std::str::from_utf8(line) {
            assert_eq!(
                replay::parse_line(line),
                replay::parse_line_serde(line),
                "{line:?}"
            );
        }
    }
    for e in &events {
        let line = serde_json::to_string(&ReplayRecord::from_event(e)).expect("serializable");
        match replay::parse_line(&line) {
            Ok(Some(back)) => assert_eq!(&back, e, "{line}"),
            other => panic!("{line} does not read back: {other:?}"),
        }
    }
});
