//! What the fuzz targets share: how an input becomes a sequence of stream operations, and the
//! privacy check run on everything the OTLP normalizer emits.
//!
//! The targets themselves are in `fuzz_targets/`; `README.md` says how to run them.

use opentelemetry_proto::tonic::collector::logs::v1::ExportLogsServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use revenant::LifecycleEvent;
use revenant::normalize::{NormalizeConfig, Normalizer, Tally};
use std::sync::LazyLock;

/// A prompt nobody would write: the harnesses put it where prompt or completion text lives and
/// check that it never comes out. Inputs that already contain it are skipped.
pub const CANARY: &str = "PRIVATE-PROMPT-7f3a9c";

/// True when `data` contains [`CANARY`] (such an input could put it in an id legitimately).
pub fn has_canary(data: &[u8]) -> bool {
    data.windows(CANARY.len()).any(|w| w == CANARY.as_bytes())
}

/// One thing that happens to one direction of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op<'a> {
    /// Captured bytes; `syscall_start` when they begin a syscall's payload.
    Feed {
        bytes: &'a [u8],
        syscall_start: bool,
    },
    /// Bytes that went by uncaptured.
    Gap(u64),
    /// The connection closed.
    Close,
}

/// Splits an input `[n][n control bytes][payload]` into operations on the payload.
///
/// Each control byte `c` is one operation: `c & 3` picks feed-at-a-syscall-start (0), feed
/// continuing a syscall (1), gap (2) or close (3); `c >> 2` (`k`, 0–63) sizes it: a feed takes
/// `k² + 1` payload bytes (1–3970), a gap skips `k³` bytes (`k = 63`: 2⁴⁰). Payload left when the
/// control bytes run out is fed as one syscall. So a seed is a raw capture behind one `0` byte,
/// and the fuzzer finds the chunkings and gaps itself.
pub fn stream_ops(data: &[u8]) -> Vec<Op<'_>> {
    let Some((&n, rest)) = data.split_first() else {
        return Vec::new();
    };
    let n = (n as usize).min(rest.len());
    let (ctrl, mut payload) = rest.split_at(n);
    let mut ops = Vec::with_capacity(ctrl.len() + 1);
    for &c in ctrl {
        let k = (c >> 2) as u64;
        match c & 3 {
            0 | 1 => {
                if payload.is_empty() {
                    continue;
                }
                let take = ((k * k + 1) as usize).min(payload.len());
                let (bytes, tail) = payload.split_at(take);
                payload = tail;
                ops.push(Op::Feed {
                    bytes,
                    syscall_start: c & 3 == 0,
                });
            }
            2 => ops.push(Op::Gap(if k == 63 { 1 << 40 } else { k * k * k })),
            _ => ops.push(Op::Close),
        }
    }
    if !payload.is_empty() {
        ops.push(Op::Feed {
            bytes: payload,
            syscall_start: true,
        });
    }
    ops
}

/// The normalizer's configuration in the OTLP targets: the built-in profiles plus two generic
/// mappings (one for spans, one for log records), so the generic profile is exercised too.
static CONFIG: LazyLock<NormalizeConfig> = LazyLock::new(|| {
    serde_saphyr::from_str(
        r#"
generic:
  - name: mystack
    select: { service_name: my-prefill }
    ids: { request_id: [x-request-id], rid: [req.id], bootstrap_room: [room] }
    tokens: { input_tokens: [gen_ai.usage.input_tokens], max_input_tokens: [limit] }
    status: [http.response.status_code]
    worker: [server.address]
    rules:
      - { name: handle, stage: prefill, kind: received, at: start }
      - { name: handle, error: true, stage: prefill, kind: rejected }
      - { name: handle, error: false, stage: prefill, kind: completed }
      - { name_prefix: "fwd", stage: prefill, kind: work }
  - name: logs
    select: { service_name: my-decode }
    ids: { rid: [rid] }
    rules:
      - { name: kv_received, stage: transfer, kind: work }
      - { name: abort, stage: decode, kind: aborted }
"#,
    )
    .expect("the fuzz normalizer config is valid")
});

/// Attribute keys under which real stacks put prompt and completion text; none is mapped.
const TEXT_KEYS: [&str; 4] = [
    "gen_ai.prompt",
    "gen_ai.completion",
    "input.value",
    "output.value",
];

fn canary_attrs(attrs: &mut Vec<KeyValue>) {
    for key in TEXT_KEYS {
        attrs.push(KeyValue {
            key: key.into(),
            value: Some(AnyValue {
                value: Some(any_value::Value::StringValue(CANARY.into())),
            }),
            ..Default::default()
        });
    }
}

/// Runs a decoded export through a fresh normalizer (spans, then the timers that release what
/// waits, then shutdown's flush) after planting [`CANARY`] in every resource, span, span event
/// and log record (attributes and log bodies), and asserts it reaches no event.
pub fn normalize_checked(
    traces: Option<ExportTraceServiceRequest>,
    logs: Option<ExportLogsServiceRequest>,
) {
    let mut normalizer = Normalizer::new(&CONFIG).expect("the fuzz normalizer config is valid");
    let mut out = Vec::new();
    let mut tally = Tally::default();
    let now = 1_800_000_000_000_000_000;
    if let Some(mut req) = traces {
        for rs in &mut req.resource_spans {
            if let Some(r) = &mut rs.resource {
                canary_attrs(&mut r.attributes);
            }
            for ss in &mut rs.scope_spans {
                for span in &mut ss.spans {
                    canary_attrs(&mut span.attributes);
                    for ev in &mut span.events {
                        canary_attrs(&mut ev.attributes);
                    }
                }
            }
        }
        normalizer.traces(&req, now, &mut out, &mut tally);
    }
    if let Some(mut req) = logs {
        for rl in &mut req.resource_logs {
            for sl in &mut rl.scope_logs {
                for rec in &mut sl.log_records {
                    canary_attrs(&mut rec.attributes);
                    rec.body = Some(AnyValue {
                        value: Some(any_value::Value::StringValue(CANARY.into())),
                    });
                }
            }
        }
        normalizer.logs(&req, &mut out, &mut tally);
    }
    normalizer.tick(now + 3_600_000_000_000, &mut out, &mut tally);
    normalizer.flush(&mut out);
    assert_eq!(
        normalizer.pending_completions(),
        0,
        "flush releases everything"
    );
    for e in &out {
        assert_private(e);
    }
}

/// No field of `e` carries [`CANARY`].
pub fn assert_private(e: &LifecycleEvent) {
    let text = format!("{e:?}");
    assert!(
        !text.contains(CANARY),
        "prompt text reached an event: {text}"
    );
}
