//! Writes the realistic benchmark mix as a replay file:
//! `cargo run --release -p revenant --example gen_events -- ATTEMPTS > events.jsonl`
//! (about 10 events per attempt, 1% rejected by prefill).

use std::io::Write;

use revenant::engine::workload::{Mix, stream};
use revenant::ingest::replay::ReplayRecord;

fn main() -> std::io::Result<()> {
    let attempts = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(100_000);
    let mix = Mix {
        attempts,
        ..Mix::default()
    };
    let out = std::io::stdout();
    let mut out = std::io::BufWriter::new(out.lock());
    for e in stream(&mix) {
        serde_json::to_writer(&mut out, &ReplayRecord::from_event(&e))?;
        out.write_all(b"\n")?;
    }
    out.flush()
}
