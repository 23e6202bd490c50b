//! Generic profile: a YAML mapping from span (or log record) shapes to lifecycle events, so a
//! stack without a built-in profile can be monitored without code changes.
//!
//! ```yaml
//! name: mystack
//! select: { service_name: my-prefill }        # which exports use this mapping
//! ids: { request_id: [x-request-id], rid: [req.id], bootstrap_room: [room] }
//! tokens: { input_tokens: [gen_ai.usage.input_tokens], max_input_tokens: [limits.max_input] }
//! status: [http.response.status_code]
//! worker: [server.address]
//! rules:
//!   - { name: handle, stage: prefill, kind: received, at: start }
//!   - { name: handle, error: true, stage: prefill, kind: rejected }
//!   - { name_prefix: "forward", stage: prefill, kind: work }
//! ```
//!
//! Every rule that matches a span emits one event. For log records the "name" is the record's
//! `event_name` (or its `event.name` attribute) and the time is the record's time; bodies are
//! never read.

use opentelemetry_proto::tonic::common::v1::{KeyValue, any_value::Value};
use opentelemetry_proto::tonic::logs::v1::LogRecord;
use opentelemetry_proto::tonic::trace::v1::Span;
use serde::Deserialize;
use std::collections::BTreeMap;

use super::{ConfigError, ProfileLabel, SpanCtx, Tally, Unmapped, attrs};
use crate::event::{Kind, LifecycleEvent, Source, Stage};

const P: ProfileLabel = ProfileLabel::Generic;

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Mapping {
    pub name: String,
    #[serde(default)]
    pub select: Select,
    #[serde(default)]
    pub ids: IdKeys,
    #[serde(default)]
    pub tokens: TokenKeys,
    #[serde(default)]
    pub status: Vec<String>,
    #[serde(default)]
    pub worker: Vec<String>,
    pub rules: Vec<Rule>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Select {
    pub service_name: Option<String>,
    pub scope_name: Option<String>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct IdKeys {
    #[serde(default)]
    pub request_id: Vec<String>,
    #[serde(default)]
    pub rid: Vec<String>,
    #[serde(default)]
    pub bootstrap_room: Vec<String>,
    /// Put the span's trace id in `ids.trace_id` (it names the request, never an attempt).
    #[serde(default = "yes")]
    pub trace_id: bool,
}

fn yes() -> bool {
    true
}

impl Default for IdKeys {
    fn default() -> Self {
        IdKeys {
            request_id: vec![],
            rid: vec![],
            bootstrap_room: vec![],
            trace_id: true,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TokenKeys {
    #[serde(default)]
    pub input_tokens: Vec<String>,
    #[serde(default)]
    pub context_tokens: Vec<String>,
    #[serde(default)]
    pub max_input_tokens: Vec<String>,
    #[serde(default)]
    pub max_total_tokens: Vec<String>,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum At {
    Start,
    #[default]
    End,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Exact span name (or log event name).
    pub name: Option<String>,
    pub name_prefix: Option<String>,
    /// Attributes that must equal these values (numbers compare by their decimal text).
    #[serde(default)]
    pub attributes: BTreeMap<String, String>,
    #[serde(default)]
    pub has_attributes: Vec<String>,
    /// Match only spans with (true) or without (false) ERROR status.
    pub error: Option<bool>,
    pub stage: Stage,
    pub kind: Kind,
    #[serde(default)]
    pub at: At,
    pub to: Option<Stage>,
}

impl Mapping {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |msg: &str| ConfigError::Generic {
            name: self.name.clone(),
            msg: msg.into(),
        };
        if self.name.is_empty() {
            return Err(err("name must not be empty"));
        }
        if self.rules.is_empty() {
            return Err(err("needs at least one rule"));
        }
        for (i, r) in self.rules.iter().enumerate() {
            if r.name.is_none()
                && r.name_prefix.is_none()
                && r.attributes.is_empty()
                && r.has_attributes.is_empty()
            {
                return Err(err(&format!(
                    "rule {i} matches everything: give name, name_prefix or attributes"
                )));
            }
            if r.to.is_some() && r.kind != Kind::Dispatched {
                return Err(err(&format!(
                    "rule {i}: `to` only makes sense with kind dispatched"
                )));
            }
        }
        Ok(())
    }

    pub fn selects(&self, ctx: &SpanCtx<'_>) -> bool {
        let s = &self.select;
        if s.service_name.is_none() && s.scope_name.is_none() {
            return false;
        }
        s.service_name
            .as_deref()
            .is_none_or(|n| ctx.service_name == Some(n))
            && s.scope_name.as_deref().is_none_or(|n| ctx.scope_name == n)
    }

    fn matching<'r>(
        &'r self,
        name: &'r str,
        a: &'r [KeyValue],
        error: bool,
    ) -> impl Iterator<Item = &'r Rule> + 'r {
        self.rules.iter().filter(move |r| {
            r.name.as_deref().is_none_or(|n| n == name)
                && r.name_prefix.as_deref().is_none_or(|p| name.starts_with(p))
                && r.error.is_none_or(|e| e == error)
                && r.has_attributes.iter().all(|k| attrs::has(a, k))
                && r.attributes.iter().all(|(k, v)| attr_equals(a, k, v))
        })
    }

    fn fill(&self, e: &mut LifecycleEvent, a: &[KeyValue], trace_id: &[u8]) {
        let first_id = |keys: &[String]| keys.iter().find_map(|k| attrs::id(a, k));
        e.ids.request_id = first_id(&self.ids.request_id);
        e.ids.rid = first_id(&self.ids.rid);
        e.ids.bootstrap_room = self
            .ids
            .bootstrap_room
            .iter()
            .find_map(|k| attrs::room(a, k));
        if self.ids.trace_id {
            e.ids.trace_id = attrs::trace_id_hex(trace_id);
        }
        let num = |keys: &[String]| keys.iter().find_map(|k| attrs::u64(a, k));
        e.input_tokens = num(&self.tokens.input_tokens);
        e.context_tokens = num(&self.tokens.context_tokens);
        e.max_input_tokens = num(&self.tokens.max_input_tokens);
        e.max_total_tokens = num(&self.tokens.max_total_tokens);
        e.status = num(&self.status).and_then(|s| u16::try_from(s).ok());
        e.worker = self
            .worker
            .iter()
            .find_map(|k| attrs::str(a, k))
            .map(|w| attrs::clip_id(w).into());
    }

    pub fn map_span(
        &self,
        ctx: &SpanCtx<'_>,
        span: &Span,
        out: &mut Vec<LifecycleEvent>,
        tally: &mut Tally,
    ) {
        let error = super::span_is_error(span);
        let before = out.len();
        for r in self.matching(&span.name, &span.attributes, error) {
            let t = match r.at {
                At::Start => span.start_time_unix_nano,
                At::End => span.end_time_unix_nano,
            };
            let mut e = LifecycleEvent::new(t, r.stage, r.kind, Source::Otlp);
            self.fill(&mut e, &span.attributes, &span.trace_id);
            e.node = ctx.node.map(Into::into);
            e.to = r.to;
            if error {
                e.reason = span
                    .status
                    .as_ref()
                    .map(|s| crate::event::truncate_reason(&s.message).into());
            }
            out.push(e);
        }
        self.after(before, out, tally);
    }

    pub fn map_log(
        &self,
        ctx: &SpanCtx<'_>,
        rec: &LogRecord,
        out: &mut Vec<LifecycleEvent>,
        tally: &mut Tally,
    ) {
        let name = if rec.event_name.is_empty() {
            attrs::str(&rec.attributes, "event.name").unwrap_or("")
        } else {
            rec.event_name.as_str()
        };
        let time = if rec.time_unix_nano != 0 {
            rec.time_unix_nano
        } else {
            rec.observed_time_unix_nano
        };
        if time == 0 {
            tally.unmapped(P, Unmapped::BadTime);
            return;
        }
        // Severity ERROR (17) and above stands for an error status.
        let error = rec.severity_number >= 17;
        let before = out.len();
        for r in self.matching(name, &rec.attributes, error) {
            let mut e = LifecycleEvent::new(time, r.stage, r.kind, Source::Otlp);
            self.fill(&mut e, &rec.attributes, &rec.trace_id);
            e.node = ctx.node.map(Into::into);
            e.to = r.to;
            out.push(e);
        }
        self.after(before, out, tally);
    }

    fn after(&self, before: usize, out: &mut Vec<LifecycleEvent>, tally: &mut Tally) {
        if out.len() == before {
            tally.unmapped(P, Unmapped::UnknownSpan);
        } else if out[before..].iter().all(|e| !identified(e)) {
            out.truncate(before);
            tally.unmapped(P, Unmapped::MissingIds);
        }
    }
}

/// A request event needs an id to be attributed; a capacity report is about a worker, not a
/// request, so it needs the worker (or node) the checker keys capacity by instead.
fn identified(e: &LifecycleEvent) -> bool {
    if e.kind == Kind::Capacity {
        e.worker.is_some() || e.node.is_some()
    } else {
        !e.ids.is_empty()
    }
}

fn attr_equals(a: &[KeyValue], k: &str, want: &str) -> bool {
    match attrs::get(a, k) {
        Some(Value::StringValue(s)) => s == want,
        Some(Value::IntValue(i)) => want.parse::<i64>().is_ok_and(|w| w == *i),
        Some(Value::BoolValue(b)) => want.parse::<bool>().is_ok_and(|w| w == *b),
        Some(Value::DoubleValue(d)) => want.parse::<f64>().is_ok_and(|w| w == *d),
        _ => false,
    }
}
