//! SGLang-shaped spans of one request.

use super::*;

/// Spans of one request, collected while serving and emitted as one group at the end.
/// SGLang's layout: root "{role} Req {rid8}" → thread spans ("{Role}Tokenizer(...)",
/// "{Role} Scheduler [TP 0] (...)") → stage spans.
pub(super) struct ReqTrace {
    pub(super) on: bool,
    pub(super) trace_id: [u8; 16],
    pub(super) parent: Option<[u8; 8]>,
    pub(super) root: [u8; 8],
    pub(super) spans: Vec<opentelemetry_proto::tonic::trace::v1::Span>,
    /// Put on the root as `gen_ai.usage.input_tokens` (the GenAI semantic convention revenant's
    /// sglang profile reads). SGLang 0.5.2x does not export it; the simulator does so that
    /// `over-capacity-admitted` has a token count on the OTLP path.
    pub(super) input_tokens: u64,
}

impl ReqTrace {
    pub(super) fn new(on: bool, tp: Option<TraceParent>) -> Self {
        ReqTrace {
            on,
            trace_id: tp.map(|t| t.trace_id).unwrap_or_else(random_trace_id),
            parent: tp.map(|t| t.span_id),
            root: random_span_id(),
            spans: Vec::new(),
            input_tokens: 0,
        }
    }

    pub(super) fn thread(
        &mut self,
        w: &Worker,
        scheduler: bool,
        start: u64,
        end: u64,
        err: Option<&str>,
    ) -> [u8; 8] {
        let id = random_span_id();
        if !self.on {
            return id;
        }
        let host8 = &w.host_id[..8];
        let (name, label) = if scheduler {
            (
                format!(
                    "{} Scheduler [TP 0] (host:{host8} | pid:{})",
                    w.role.title(),
                    w.pid
                ),
                format!("{} Scheduler", w.role.title()),
            )
        } else {
            (
                format!("{}Tokenizer(host:{host8} | pid:{})", w.role.title(), w.pid),
                format!("{}Tokenizer", w.role.title()),
            )
        };
        let mut attributes = Vec::with_capacity(5);
        if scheduler {
            attributes.push(kv_int("tp_rank", 0));
        }
        attributes.push(kv_str("host_id", w.host_id.clone()));
        attributes.push(kv_int("pid", w.pid as i64));
        attributes.push(kv_str("thread_label", label));
        self.spans.push(
            SpanSpec {
                trace_id: self.trace_id,
                span_id: id,
                parent: Some(self.root),
                name,
                start_ns: start,
                end_ns: end,
                attributes,
                events: Vec::new(),
                error: err,
            }
            .build(),
        );
        id
    }

    pub(super) fn stage(&mut self, parent: [u8; 8], name: &str, start: u64, end: u64) {
        if !self.on {
            return;
        }
        self.spans.push(
            SpanSpec {
                trace_id: self.trace_id,
                span_id: random_span_id(),
                parent: Some(parent),
                name: name.into(),
                start_ns: start,
                end_ns: end,
                attributes: Vec::new(),
                events: Vec::new(),
                error: None,
            }
            .build(),
        );
    }

    pub(super) fn finish(mut self, w: &Worker, rid: &str, room: Option<u64>, start: u64, end: u64) {
        if !self.on {
            return;
        }
        let mut attributes = vec![kv_str("rid", rid), kv_str("module", "sglang::request")];
        if let Some(r) = room {
            attributes.push(kv_str("bootstrap_room", room_hex(r)));
        }
        attributes.push(kv_str("gen_ai.request.id", rid));
        attributes.push(kv_int(
            "gen_ai.usage.input_tokens",
            self.input_tokens as i64,
        ));
        // Children precede the root, as SGLang's exporter emits them.
        self.spans.push(
            SpanSpec {
                trace_id: self.trace_id,
                span_id: self.root,
                parent: self.parent,
                name: format!("{} Req {}", w.role.as_str(), &rid[..rid.len().min(8)]),
                start_ns: start,
                end_ns: end,
                attributes,
                events: Vec::new(),
                error: None,
            }
            .build(),
        );
        w.spans.emit(self.spans);
    }
}
