//! The bus message decoder (`bus::wire::decode`: what a checker does with every message it
//! takes off JetStream, from any agent or anything else that can publish to the stream).
//!
//! Holds: no panic; a refused message says why; an accepted batch has one offset per event and
//! reasons and details of at most `MAX_REASON_BYTES`, and written again (`wire::columns`,
//! `wire::encode`, as the agent writes it) it reads back equal.
#![no_main]

use libfuzzer_sys::fuzz_target;
use revenant::bus::wire;
use revenant::event::MAX_REASON_BYTES;

fuzz_target!(|data: &[u8]| {
    let batch = match wire::decode(data) {
        Ok(b) => b,
        Err(e) => {
            assert!(!e.to_string().is_empty(), "an error without a message");
            return;
        }
    };
    assert_eq!(batch.events.len(), batch.header.offsets.len());
    for e in &batch.events {
        for text in [&e.reason, &e.detail].into_iter().flatten() {
            assert!(text.len() <= MAX_REASON_BYTES, "{} bytes", text.len());
        }
    }
    let again = wire::encode(batch.header.clone(), wire::columns(&batch.events));
    match wire::decode(&again) {
        Ok(back) => assert_eq!(back, batch),
        Err(e) => panic!("a decoded batch written again does not read back: {e}"),
    }
});
