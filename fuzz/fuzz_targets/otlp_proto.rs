//! OTLP/protobuf decoding (what the gRPC and HTTP receivers hand `prost`) and normalization:
//! the bytes as an `ExportTraceServiceRequest` and as an `ExportLogsServiceRequest`, each run
//! through the normalizer (built-in profiles and generic mappings, its timers and flush).
//!
//! Holds: no panic; prompt and completion text planted in every attribute set and log body
//! reaches no event (`revenant_fuzz::normalize_checked`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use opentelemetry_proto::tonic::collector::logs::v1::ExportLogsServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use prost::Message as _;

fuzz_target!(|data: &[u8]| {
    if revenant_fuzz::has_canary(data) {
        return;
    }
    let traces = ExportTraceServiceRequest::decode(data).ok();
    let logs = ExportLogsServiceRequest::decode(data).ok();
    revenant_fuzz::normalize_checked(traces, logs);
});
