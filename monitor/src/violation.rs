//! What the checker concludes: a rule breached by one attempt (or request, or worker), with the
//! events that prove it, and the vocabulary of a verdict: its severity, the roles of its
//! evidence, and the summary template (its fields and their values).

use std::fmt::{self, Write as _};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::event::{
    BootstrapRoom, Kind, RoomFields, RoomFieldsError, RoomHex, Source, Stage, room_from_fields,
};

/// How bad a breach is; each rule declares one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Info,
    Warning,
    Critical,
}

impl Severity {
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Info => "info",
            Severity::Warning => "warning",
            Severity::Critical => "critical",
        }
    }
}

/// The aliases by which the request is known (any subset).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestAliases {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
}

impl RequestAliases {
    pub fn is_empty(&self) -> bool {
        self.request_id.is_none() && self.trace_id.is_none()
    }
}

/// The aliases by which the attempt is known (any subset). Written with the room as
/// [`RoomFields`] (decimal string plus hex); read with the room in any spelling, as a number
/// too (what older spool files and hand-written expectations hold).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(try_from = "AttemptAliasesWire")]
pub struct AttemptAliases {
    pub bootstrap_room: Option<u64>,
    pub rid: Option<String>,
}

impl AttemptAliases {
    pub fn is_empty(&self) -> bool {
        self.bootstrap_room.is_none() && self.rid.is_none()
    }
}

#[derive(Deserialize)]
struct AttemptAliasesWire {
    #[serde(default)]
    bootstrap_room: Option<BootstrapRoom>,
    #[serde(default)]
    bootstrap_room_hex: Option<RoomHex>,
    #[serde(default)]
    rid: Option<String>,
}

impl TryFrom<AttemptAliasesWire> for AttemptAliases {
    type Error = RoomFieldsError;
    fn try_from(w: AttemptAliasesWire) -> Result<Self, Self::Error> {
        Ok(AttemptAliases {
            bootstrap_room: room_from_fields(w.bootstrap_room, w.bootstrap_room_hex)?,
            rid: w.rid,
        })
    }
}

#[derive(Serialize)]
struct AttemptAliasesOut<'a> {
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    room: Option<RoomFields>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rid: Option<&'a str>,
}

impl Serialize for AttemptAliases {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        AttemptAliasesOut {
            room: self.bootstrap_room.map(RoomFields::new),
            rid: self.rid.as_deref(),
        }
        .serialize(s)
    }
}

/// Why an evidence event is in the proof.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EvidenceRole {
    /// The event that armed the rule (the rejection, the admission).
    Trigger,
    /// The event the rule forbids, or that breaks its condition.
    Offender,
    /// The expected event, seen too late.
    Expected,
    /// Context that makes the rule apply.
    Context,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Evidence {
    pub role: EvidenceRole,
    pub time_ns: u64,
    pub stage: Stage,
    pub kind: Kind,
    pub source: Source,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Violation {
    pub rule: String,
    pub severity: Severity,
    pub summary: String,
    /// Omitted when no alias of the request is known (a worker-level finding, an attempt seen
    /// only by its room).
    #[serde(default, skip_serializing_if = "RequestAliases::is_empty")]
    pub request: RequestAliases,
    #[serde(default, skip_serializing_if = "AttemptAliases::is_empty")]
    pub attempt: AttemptAliases,
    /// For worker-level rules (capacity reports): the worker or node concerned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    /// Event time at which the breach became provable (latest evidence, or the missed deadline).
    pub detected_at_ns: u64,
    /// Stable across runs: rule plus the request's primary alias. Attempts of one request share it,
    /// so a retry storm notifies once.
    pub fingerprint: String,
    /// Ordered by event time.
    pub evidence: Vec<Evidence>,
    /// A follow-up: a second source confirmed a (rule, attempt) already reported, and `evidence`
    /// now includes that source. Same fingerprint as the original; sinks merge it into the
    /// original notification rather than counting it as a repeat.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub corroborates: bool,
}

/// Whether the evidence comes from more than one source (e.g. OTLP and eBPF).
pub fn has_several_sources(evidence: &[Evidence]) -> bool {
    evidence
        .first()
        .is_some_and(|f| evidence.iter().any(|e| e.source != f.source))
}

/// 64-bit FNV-1a: stable across builds and platforms, unlike std's hasher.
pub fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in *p {
            h ^= *b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Placeholders an `output` template may use; [`TemplateContext::value`] answers each.
pub const TEMPLATE_FIELDS: &[&str] = &[
    "rule",
    "severity",
    "request",
    "attempt",
    "worker",
    "delay",
    "within",
    "breach",
    "trigger.stage",
    "trigger.kind",
    "trigger.source",
    "trigger.status",
    "trigger.reason",
    "event.stage",
    "event.kind",
    "event.source",
    "event.status",
    "event.reason",
];

/// One event as a template names it (`{trigger.*}`, `{event.*}`).
#[derive(Debug, Clone, Copy)]
pub struct TemplateEvent {
    pub time_ns: u64,
    pub stage: Stage,
    pub kind: Kind,
    pub source: Source,
    pub status: Option<u16>,
}

/// What a violation's `output` template can name.
pub struct TemplateContext<'a> {
    pub rule: &'a str,
    pub severity: Severity,
    pub request: &'a RequestAliases,
    pub attempt: &'a AttemptAliases,
    pub worker: Option<&'a str>,
    /// A must_follow rule's deadline (`{within}` is empty for other shapes).
    pub within: Option<Duration>,
    /// A predicate's breach, as "field value op limit".
    pub breach: Option<&'a dyn fmt::Display>,
    pub trigger: Option<TemplateEvent>,
    pub trigger_reason: Option<&'a str>,
    /// The offending event.
    pub event: Option<TemplateEvent>,
    /// What the offending event says of itself (its reason, else its detail).
    pub event_reason: Option<&'a str>,
}

impl TemplateContext<'_> {
    /// Fills `template` (validated at load by [`validate_template`]). Within parentheses only
    /// what is known is shown: `(400 -)` reads `(400)`, `(- reason)` reads `(reason)`, and a
    /// group of nothing known is left out.
    pub fn render(&self, template: &str) -> String {
        omit_unknown_in_groups(&render(template, |k| self.value(k)))
    }

    /// The text of placeholder `field`: "-" for a value this violation lacks, empty for an
    /// unknown field.
    pub fn value(&self, field: &str) -> String {
        let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
        match field {
            "rule" => self.rule.to_owned(),
            "severity" => self.severity.as_str().into(),
            "request" => opt(self
                .request
                .request_id
                .clone()
                .or_else(|| self.request.trace_id.clone())),
            "attempt" => match (&self.attempt.bootstrap_room, &self.attempt.rid) {
                (Some(room), Some(rid)) => format!("room {room} (rid {rid})"),
                (Some(room), None) => format!("room {room}"),
                (None, Some(rid)) => format!("rid {rid}"),
                (None, None) => "-".into(),
            },
            "worker" => opt(self.worker.map(str::to_owned)),
            "within" => self
                .within
                .map(|d| humantime::format_duration(d).to_string())
                .unwrap_or_default(),
            "delay" => match (self.trigger, self.event) {
                (Some(t), Some(o)) => format_nanos(o.time_ns.saturating_sub(t.time_ns)),
                _ => "-".into(),
            },
            "breach" => opt(self.breach.map(|b| b.to_string())),
            "trigger.stage" => opt(self.trigger.map(|t| t.stage.to_string())),
            "trigger.kind" => opt(self.trigger.map(|t| t.kind.to_string())),
            "trigger.source" => opt(self.trigger.map(|t| t.source.to_string())),
            "trigger.status" => opt(self.trigger.and_then(|t| t.status).map(|s| s.to_string())),
            "trigger.reason" => opt(self.trigger_reason.map(str::to_owned)),
            "event.reason" => opt(self.event_reason.map(str::to_owned)),
            "event.stage" => opt(self.event.map(|t| t.stage.to_string())),
            "event.kind" => opt(self.event.map(|t| t.kind.to_string())),
            "event.source" => opt(self.event.map(|t| t.source.to_string())),
            "event.status" => opt(self.event.and_then(|t| t.status).map(|s| s.to_string())),
            _ => String::new(),
        }
    }
}

/// A rule's output template that cannot be filled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// Every unknown placeholder of the template, in order.
    #[error(
        "unknown placeholder{} {} in output template (known: {})",
        if .names.len() == 1 { "" } else { "s" },
        braced(.names),
        TEMPLATE_FIELDS.join(", ")
    )]
    UnknownPlaceholder { names: Vec<String> },
    #[error("unclosed '{{' in output template {template:?}")]
    Unclosed { template: String },
}

/// `{a}, {b}`: placeholder names as a template writes them.
pub fn braced(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("{{{n}}}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Checks that every `{placeholder}` in `template` is known; the error lists all that are not.
pub fn validate_template(template: &str) -> Result<(), TemplateError> {
    let names: Vec<String> = placeholders(template)?
        .into_iter()
        .filter(|n| !TEMPLATE_FIELDS.contains(n))
        .map(str::to_owned)
        .collect();
    if names.is_empty() {
        Ok(())
    } else {
        Err(TemplateError::UnknownPlaceholder { names })
    }
}

/// The placeholders `template` names, in order (`{` without a `}` is an error).
pub fn placeholders(template: &str) -> Result<Vec<&str>, TemplateError> {
    let mut out = Vec::new();
    let mut rest = template;
    while let Some(start) = rest.find('{') {
        let after = &rest[start + 1..];
        let end = after.find('}').ok_or_else(|| TemplateError::Unclosed {
            template: template.to_owned(),
        })?;
        out.push(&after[..end]);
        rest = &after[end + 1..];
    }
    Ok(out)
}

/// Fills a template; `value` answers each placeholder (unknown ones were rejected at load).
pub fn render(template: &str, value: impl Fn(&str) -> String) -> String {
    let mut out = String::with_capacity(template.len() + 32);
    let mut rest = template;
    while let Some(start) = rest.find('{') {
        out.push_str(&rest[..start]);
        let after = &rest[start + 1..];
        match after.find('}') {
            Some(end) => {
                out.push_str(&value(&after[..end]));
                rest = &after[end + 1..];
            }
            None => {
                out.push_str(&rest[start..]);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

/// Drops the `-` of unknown values at the edges of a parenthesized group, and groups left empty
/// (with the space before them).
fn omit_unknown_in_groups(text: &str) -> String {
    let mut s = text.to_owned();
    for empty in [" (- -)", " (-)", "(- -)", "(-)"] {
        s = s.replace(empty, "");
    }
    s.replace("(- ", "(").replace(" -)", ")")
}

/// Human text for a nanosecond duration (used for `{delay}` and `{within}`).
pub fn format_nanos(ns: u64) -> String {
    let mut s = String::new();
    if ns >= 1_000_000_000 {
        let _ = write!(s, "{:.3}s", ns as f64 / 1e9);
    } else if ns >= 1_000_000 {
        let _ = write!(s, "{:.3}ms", ns as f64 / 1e6);
    } else if ns >= 1_000 {
        let _ = write!(s, "{:.1}µs", ns as f64 / 1e3);
    } else {
        let _ = write!(s, "{ns}ns");
    }
    s
}

#[cfg(test)]
mod tests {
    #[test]
    fn groups_show_only_what_is_known() {
        use super::omit_unknown_in_groups as o;
        assert_eq!(
            o("rejected room 0x1 (400 -), then"),
            "rejected room 0x1 (400), then"
        );
        assert_eq!(
            o("rejected rid r (- Input length (6189 tokens) exceeds), then"),
            "rejected rid r (Input length (6189 tokens) exceeds), then"
        );
        assert_eq!(o("rejected rid r (- -), then"), "rejected rid r, then");
        assert_eq!(o("failed - (completed 500)"), "failed - (completed 500)");
    }

    use super::*;

    #[test]
    fn unknown_aliases_are_omitted_not_empty_objects() {
        let mut v = Violation {
            rule: "capacity".into(),
            severity: Severity::Warning,
            summary: "s".into(),
            request: RequestAliases::default(),
            attempt: AttemptAliases::default(),
            worker: Some("prefill-0".into()),
            detected_at_ns: 1,
            fingerprint: "f".into(),
            evidence: Vec::new(),
            corroborates: false,
        };
        let json: serde_json::Value = serde_json::to_value(&v).unwrap();
        assert!(json.get("request").is_none(), "{json}");
        assert!(json.get("attempt").is_none(), "{json}");
        // What is omitted reads back as unknown.
        let back: Violation = serde_json::from_value(json).unwrap();
        assert_eq!(back, v);
        v.request.request_id = Some("req-1".into());
        let json = serde_json::to_value(&v).unwrap();
        assert_eq!(json["request"], serde_json::json!({"request_id": "req-1"}));
    }

    #[test]
    fn attempt_room_is_a_decimal_string_with_its_hex_and_reads_old_numbers() {
        let attempt = AttemptAliases {
            bootstrap_room: Some(9_066_467_638_188_682_269),
            rid: Some("r".into()),
        };
        let json = serde_json::to_value(&attempt).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "bootstrap_room": "9066467638188682269",
                "bootstrap_room_hex": "0x7dd29047ddcfac1d",
                "rid": "r",
            })
        );
        assert_eq!(
            serde_json::from_value::<AttemptAliases>(json).unwrap(),
            attempt
        );
        // What earlier versions wrote (spool files, expectations): a JSON number.
        let old: AttemptAliases =
            serde_json::from_str(r#"{"bootstrap_room": 9066467638188682269, "rid": "r"}"#).unwrap();
        assert_eq!(old, attempt);
        let err = serde_json::from_str::<AttemptAliases>(
            r#"{"bootstrap_room": "1", "bootstrap_room_hex": "0x2"}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("different rooms"), "{err}");
        let rid_only = AttemptAliases {
            bootstrap_room: None,
            rid: Some("r".into()),
        };
        assert_eq!(
            serde_json::to_value(&rid_only).unwrap(),
            serde_json::json!({"rid": "r"})
        );
    }

    #[test]
    fn templates_validate_and_render() {
        assert!(validate_template("{rule} on {attempt}").is_ok());
        let err = validate_template("{rule} {bogus}").unwrap_err();
        assert_eq!(
            err,
            TemplateError::UnknownPlaceholder {
                names: vec!["bogus".into()]
            }
        );
        assert!(err.to_string().contains("{bogus}"), "{err}");
        let err = validate_template("{event.node} {rule} {foo}").unwrap_err();
        assert!(
            err.to_string()
                .starts_with("unknown placeholders {event.node}, {foo} in output template"),
            "{err}"
        );
        let err = validate_template("{rule").unwrap_err();
        assert_eq!(
            err,
            TemplateError::Unclosed {
                template: "{rule".into()
            }
        );
        assert!(err.to_string().contains("unclosed"), "{err}");
        assert_eq!(render("a {x} b {y}", |k| k.to_uppercase()), "a X b Y");
    }

    #[test]
    fn every_template_field_has_a_value() {
        let event = TemplateEvent {
            time_ns: 1_000,
            stage: Stage::Decode,
            kind: Kind::Work,
            source: Source::Otlp,
            status: Some(200),
        };
        let request = RequestAliases {
            request_id: Some("req-1".into()),
            trace_id: None,
        };
        let attempt = AttemptAliases {
            bootstrap_room: Some(7),
            rid: None,
        };
        let ctx = TemplateContext {
            rule: "r",
            severity: Severity::Info,
            request: &request,
            attempt: &attempt,
            worker: Some("w"),
            within: Some(Duration::from_secs(5)),
            breach: Some(&"context_tokens 9 > 8"),
            trigger: Some(event),
            trigger_reason: Some("full"),
            event_reason: None,
            event: Some(event),
        };
        for field in TEMPLATE_FIELDS {
            assert!(!ctx.value(field).is_empty(), "{field}");
        }
        assert_eq!(ctx.value("bogus"), "");
        assert_eq!(ctx.render("{rule} on {attempt}"), "r on room 7");
    }

    #[test]
    fn fingerprint_is_stable() {
        assert_eq!(fnv1a(&[b"a", b"bc"]), fnv1a(&[b"a", b"bc"]));
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
        // Pinned so that a change of the function, which would re-notify every open alert, is seen.
        assert_eq!(
            format!("{:016x}", fnv1a(&[b"activity-after-rejection", b"req-1"])),
            "d6a990e3b13a53f9"
        );
    }

    #[test]
    fn durations_read_well() {
        assert_eq!(format_nanos(1_500_000_000), "1.500s");
        assert_eq!(format_nanos(2_000_000), "2.000ms");
        assert_eq!(format_nanos(999), "999ns");
    }
}
