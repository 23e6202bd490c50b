//! OTLP/JSON decoding (`ingest::otlp::json`, both the spec's and the protobuf-JSON spellings) and
//! normalization: the bytes as a trace export and as a logs export.
//!
//! Holds: no panic; a refused document has a message; prompt and completion text planted in
//! every attribute set and log body reaches no event (`revenant_fuzz::normalize_checked`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use revenant::ingest::otlp::json;

fuzz_target!(|data: &[u8]| {
    if revenant_fuzz::has_canary(data) {
        return;
    }
    let traces = json::decode_traces(data);
    let logs = json::decode_logs(data);
    for msg in [traces.as_ref().err(), logs.as_ref().err()]
        .into_iter()
        .flatten()
        .map(ToString::to_string)
    {
        assert!(!msg.is_empty(), "an error without a message");
    }
    revenant_fuzz::normalize_checked(traces.ok(), logs.ok());
});
