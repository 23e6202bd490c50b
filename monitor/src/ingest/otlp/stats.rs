//! OTLP counters: a plain struct of atomics with bounded labels (transport, profile, reason),
//! read by the admin/metrics endpoint. No request ids ever become labels.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::normalize::{ProfileLabel, Tally, Unmapped};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Transport {
    Grpc = 0,
    Http = 1,
}

impl Transport {
    pub const ALL: [Transport; 2] = [Transport::Grpc, Transport::Http];
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Grpc => "grpc",
            Transport::Http => "http",
        }
    }
}

/// Why a whole export was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RejectReason {
    /// Retryable: the bounded channel was full (client told to retry).
    PipelineFull = 0,
    PipelineClosed = 1,
    TooManyItems = 2,
    /// Body larger than the configured maximum (compressed or decompressed).
    TooLarge = 3,
    /// Not valid protobuf / JSON for the OTLP message.
    Malformed = 4,
    /// gzip stream broken.
    BadEncoding = 5,
    UnsupportedMediaType = 6,
}

impl RejectReason {
    pub const ALL: [RejectReason; 7] = [
        RejectReason::PipelineFull,
        RejectReason::PipelineClosed,
        RejectReason::TooManyItems,
        RejectReason::TooLarge,
        RejectReason::Malformed,
        RejectReason::BadEncoding,
        RejectReason::UnsupportedMediaType,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::PipelineFull => "pipeline_full",
            RejectReason::PipelineClosed => "pipeline_closed",
            RejectReason::TooManyItems => "too_many_items",
            RejectReason::TooLarge => "too_large",
            RejectReason::Malformed => "malformed",
            RejectReason::BadEncoding => "bad_encoding",
            RejectReason::UnsupportedMediaType => "unsupported_media_type",
        }
    }
}

const NT: usize = Transport::ALL.len();
const NRJ: usize = RejectReason::ALL.len();
const NP: usize = ProfileLabel::ALL.len();
const NU: usize = Unmapped::ALL.len();

#[derive(Debug, Default)]
pub struct OtlpStats {
    /// Exports answered OK, by transport.
    pub requests_accepted: [AtomicU64; NT],
    /// Exports refused, by transport and reason (`revenant_otlp_requests_rejected_total`).
    pub requests_rejected: [[AtomicU64; NRJ]; NT],
    /// Spans/records in refused exports (what the client must resend). HTTP refusals before
    /// decoding (size, encoding, malformed) count 0 items: the body was never understood.
    pub items_rejected: [[AtomicU64; NRJ]; NT],
    /// gRPC responses with a non-OK status, by status code (0..=16), including those tonic
    /// produced itself before our handler ran (framing, size limit, decode errors).
    pub grpc_error_responses: [AtomicU64; 17],
    pub spans_received: [AtomicU64; NP],
    pub log_records_received: [AtomicU64; NP],
    /// Spans/records that produced no event, by profile and reason.
    pub unmapped: [[AtomicU64; NU]; NP],
    pub events_emitted: AtomicU64,
    pub orphans_buffered: AtomicU64,
    /// Gauge: orphans currently waiting for their root.
    pub orphans_waiting: AtomicU64,
}

impl OtlpStats {
    pub fn rejected(&self, t: Transport, r: RejectReason, items: u64) {
        self.requests_rejected[t as usize][r as usize].fetch_add(1, Relaxed);
        self.items_rejected[t as usize][r as usize].fetch_add(items, Relaxed);
    }

    pub fn add_tally(&self, tally: &Tally) {
        for p in 0..NP {
            for u in 0..NU {
                let n = tally.unmapped[p][u];
                if n != 0 {
                    self.unmapped[p][u].fetch_add(n, Relaxed);
                }
            }
        }
        self.events_emitted.fetch_add(tally.events, Relaxed);
        self.orphans_buffered
            .fetch_add(tally.orphans_buffered, Relaxed);
    }

    pub fn accepted(&self, t: Transport, tally: &Tally) {
        self.requests_accepted[t as usize].fetch_add(1, Relaxed);
        for p in 0..NP {
            if tally.spans[p] != 0 {
                self.spans_received[p].fetch_add(tally.spans[p], Relaxed);
            }
        }
        self.add_tally(tally);
    }

    pub fn accepted_logs(&self, t: Transport, tally: &Tally) {
        self.requests_accepted[t as usize].fetch_add(1, Relaxed);
        for p in 0..NP {
            if tally.spans[p] != 0 {
                self.log_records_received[p].fetch_add(tally.spans[p], Relaxed);
            }
        }
        self.add_tally(tally);
    }

    pub fn get_rejected(&self, t: Transport, r: RejectReason) -> u64 {
        self.requests_rejected[t as usize][r as usize].load(Relaxed)
    }

    pub fn get_unmapped(&self, p: ProfileLabel, u: Unmapped) -> u64 {
        self.unmapped[p as usize][u as usize].load(Relaxed)
    }

    /// One line per non-zero counter, `name{labels} value`: for the shutdown log and tests until
    /// the admin endpoint renders these.
    pub fn render(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        for t in Transport::ALL {
            let v = self.requests_accepted[t as usize].load(Relaxed);
            if v != 0 {
                let _ = writeln!(
                    s,
                    "revenant_otlp_requests_accepted_total{{transport=\"{}\"}} {v}",
                    t.as_str()
                );
            }
            for r in RejectReason::ALL {
                let v = self.get_rejected(t, r);
                if v != 0 {
                    let _ = writeln!(
                        s,
                        "revenant_otlp_requests_rejected_total{{transport=\"{}\",reason=\"{}\"}} {v}",
                        t.as_str(),
                        r.as_str()
                    );
                }
            }
        }
        for (code, c) in self.grpc_error_responses.iter().enumerate() {
            let v = c.load(Relaxed);
            if v != 0 {
                let _ = writeln!(
                    s,
                    "revenant_otlp_grpc_error_responses_total{{code=\"{code}\"}} {v}"
                );
            }
        }
        for p in ProfileLabel::ALL {
            let v = self.spans_received[p as usize].load(Relaxed);
            if v != 0 {
                let _ = writeln!(
                    s,
                    "revenant_otlp_spans_received_total{{profile=\"{}\"}} {v}",
                    p.as_str()
                );
            }
            let v = self.log_records_received[p as usize].load(Relaxed);
            if v != 0 {
                let _ = writeln!(
                    s,
                    "revenant_otlp_log_records_received_total{{profile=\"{}\"}} {v}",
                    p.as_str()
                );
            }
            for u in Unmapped::ALL {
                let v = self.get_unmapped(p, u);
                if v != 0 {
                    let _ = writeln!(
                        s,
                        "revenant_otlp_spans_unmapped_total{{profile=\"{}\",reason=\"{}\"}} {v}",
                        p.as_str(),
                        u.as_str()
                    );
                }
            }
        }
        let _ = writeln!(
            s,
            "revenant_otlp_events_emitted_total {}",
            self.events_emitted.load(Relaxed)
        );
        let _ = writeln!(
            s,
            "revenant_otlp_orphans_buffered_total {}",
            self.orphans_buffered.load(Relaxed)
        );
        let _ = writeln!(
            s,
            "revenant_otlp_orphans_waiting {}",
            self.orphans_waiting.load(Relaxed)
        );
        s
    }
}
