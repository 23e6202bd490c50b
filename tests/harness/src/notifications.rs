//! What the end-to-end runs make of revenant's notifications, shared by `cargo xtask demo` and
//! the end-to-end tests.
//!
//! A notification (`type: incident`) is about one client request and lists every rule that fired
//! for it in `findings`; its top-level violation fields are the lead finding's.

use serde_json::Value;

/// The room an object names (a violation's `attempt`, an event's `ids`, a timeline event or
/// alias, Alertmanager annotations): revenant writes `bootstrap_room` as a decimal string and
/// `bootstrap_room_hex` next to it. Either field alone is read, in any spelling (a number, as
/// older versions wrote it, a decimal or `0x` hex string); `None` when neither is there, or when
/// the two name different rooms.
pub fn room_of(named: &Value) -> Option<u64> {
    let dec = room_value(&named["bootstrap_room"]);
    let hex = room_value(&named["bootstrap_room_hex"]);
    match (dec, hex) {
        (Some(d), Some(h)) if d != h => None,
        (d, h) => d.or(h),
    }
}

/// A room value: a JSON number, a decimal string or a `0x` hex string.
fn room_value(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
            Some(h) => u64::from_str_radix(h, 16).ok(),
            None => s.parse().ok(),
        },
        _ => None,
    }
}

/// Numbers in `v` (at any depth) that a double cannot hold exactly (above 2^53), with their
/// paths, leaving out nanosecond timestamps (`*_ns`, `time_unix_nano`): those are counts of
/// time, documented as numbers, not ids. revenant writes every id above 2^53 as a string.
pub fn unsafe_numbers(v: &Value) -> Vec<String> {
    fn walk(v: &Value, path: &str, out: &mut Vec<String>) {
        match v {
            Value::Number(n) if n.as_u64().is_some_and(|u| u > 1 << 53) => {
                out.push(format!("{path} = {n}"));
            }
            Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    walk(x, &format!("{path}[{i}]"), out);
                }
            }
            Value::Object(m) => {
                for (k, x) in m {
                    if k.ends_with("_ns") || k == "time_unix_nano" {
                        continue;
                    }
                    walk(x, &format!("{path}.{k}"), out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(v, "$", &mut out);
    out
}

/// Whether `n` is an incident notification (not a rate-limit summary).
pub fn is_incident(n: &Value) -> bool {
    n["type"] == "incident"
}

/// The findings of a notification: an incident's `findings`; a finding (or a violation) is its
/// own single finding.
pub fn findings(n: &Value) -> Vec<&Value> {
    match n["findings"].as_array() {
        Some(f) => f.iter().collect(),
        None if n.get("rule").is_some() && n["type"] != "suppressed" => vec![n],
        None => Vec::new(),
    }
}

/// The finding of `rule` in a notification, if it lists one.
pub fn finding<'a>(n: &'a Value, rule: &str) -> Option<&'a Value> {
    findings(n).into_iter().find(|f| f["rule"] == rule)
}

/// The rules of a notification's findings, in its order.
pub fn rules(n: &Value) -> Vec<String> {
    findings(n)
        .iter()
        .filter_map(|f| f["rule"].as_str().map(str::to_string))
        .collect()
}

/// The distinct sources in the evidence of a notification's findings (of a single finding when
/// given one), sorted ("ebpf", "otlp").
pub fn evidence_sources(n: &Value) -> Vec<String> {
    let mut s: Vec<String> = findings(n)
        .iter()
        .flat_map(|f| f["evidence"].as_array().into_iter().flatten())
        .filter_map(|e| e["source"].as_str().map(str::to_string))
        .collect();
    s.sort();
    s.dedup();
    s
}

/// One readable line for a notification: severity, request, the rules that fired, the lead's
/// attempt and stages, evidence sources, and what kind of update it is.
pub fn one_liner(n: &Value) -> String {
    if n["type"] == "suppressed" {
        return format!(
            "[suppressed] {}: {} more violations over the rate limit of {} (sample: {})",
            n["rule"].as_str().unwrap_or("?"),
            n["suppressed"],
            n["limit"],
            n["fingerprints_sample"]
                .as_array()
                .map(|a| a
                    .iter()
                    .filter_map(|f| f.as_str())
                    .collect::<Vec<_>>()
                    .join(","))
                .unwrap_or_default()
        );
    }
    let request = n["request"]["request_id"]
        .as_str()
        .map(str::to_string)
        .or_else(|| {
            n["request"]["trace_id"]
                .as_str()
                .map(|t| format!("trace {}", &t[..t.len().min(16)]))
        })
        .unwrap_or_else(|| "-".into());
    let room = room_of(&n["attempt"])
        .map(|r| format!(" room {r:#x}"))
        .unwrap_or_default();
    let stages: Vec<String> = n["evidence"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|e| {
                    let mut s = format!(
                        "{} {}",
                        e["stage"].as_str().unwrap_or("?"),
                        e["kind"].as_str().unwrap_or("?")
                    );
                    if let Some(st) = e["status"].as_u64() {
                        s.push_str(&format!(" {st}"));
                    }
                    s
                })
                .collect()
        })
        .unwrap_or_default();
    let rules = rules(n);
    let rules = if rules.is_empty() {
        n["rule"].as_str().unwrap_or("?").to_string()
    } else {
        rules.join(" + ")
    };
    let mut line = format!(
        "[{}] request {}{}: {}: {} (evidence: {})",
        n["severity"].as_str().unwrap_or("?"),
        request,
        room,
        rules,
        stages.join(" -> "),
        evidence_sources(n).join("+"),
    );
    if n["occurrences"].as_u64().unwrap_or(1) > 1 {
        line.push_str(&format!(" x{}", n["occurrences"]));
    }
    if let Some(u) = n["update"].as_str() {
        line.push_str(&format!(" [update: {u}]"));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_liner_names_request_rules_stages_and_sources() {
        let lead = serde_json::json!({
            "severity": "critical", "rule": "activity-after-rejection",
            "request": {"request_id": "load-7"},
            "attempt": {"bootstrap_room": "255", "bootstrap_room_hex": "0xff"},
            "occurrences": 1,
            "evidence": [
                {"stage": "prefill", "kind": "rejected", "status": 400, "source": "otlp"},
                {"stage": "transfer", "kind": "work", "source": "ebpf"}
            ]
        });
        let mut n = lead.clone();
        n["type"] = "incident".into();
        n["findings"] = serde_json::json!([
            lead,
            {"rule": "activity-after-request-failed", "severity": "critical",
             "evidence": [{"stage": "router", "kind": "completed", "status": 400, "source": "otlp"}]}
        ]);
        assert!(is_incident(&n));
        assert_eq!(
            rules(&n),
            ["activity-after-rejection", "activity-after-request-failed"]
        );
        assert_eq!(
            finding(&n, "activity-after-request-failed").unwrap()["severity"],
            "critical"
        );
        assert_eq!(
            evidence_sources(finding(&n, "activity-after-request-failed").unwrap()),
            ["otlp"]
        );
        assert_eq!(
            one_liner(&n),
            "[critical] request load-7 room 0xff: activity-after-rejection + activity-after-request-failed: prefill rejected 400 -> transfer work (evidence: ebpf+otlp)"
        );
        n["update"] = "escalated".into();
        assert!(one_liner(&n).ends_with(" [update: escalated]"));
    }

    #[test]
    fn room_of_reads_every_spelling_and_refuses_a_disagreeing_pair() {
        let big = 9_066_467_638_188_682_269u64;
        for named in [
            serde_json::json!({"bootstrap_room": "9066467638188682269", "bootstrap_room_hex": "0x7dd29047ddcfac1d"}),
            serde_json::json!({"bootstrap_room": 9066467638188682269u64}),
            serde_json::json!({"bootstrap_room": "0x7dd29047ddcfac1d"}),
            serde_json::json!({"bootstrap_room_hex": "0x7dd29047ddcfac1d"}),
        ] {
            assert_eq!(room_of(&named), Some(big), "{named}");
        }
        assert_eq!(
            room_of(&serde_json::json!({"bootstrap_room": "1", "bootstrap_room_hex": "0x2"})),
            None
        );
        assert_eq!(room_of(&serde_json::json!({"rid": "r"})), None);
        assert_eq!(room_of(&serde_json::json!({"bootstrap_room": "x"})), None);
    }

    #[test]
    fn unsafe_numbers_finds_ids_above_2_pow_53_but_not_timestamps() {
        let v = serde_json::json!({
            "detected_at_ns": 1793008800002000000u64,
            "evidence": [{"time_ns": 1793008800002000000u64}],
            "attempt": {"bootstrap_room": 9066467638188682269u64},
            "ids": [{"room": 9007199254740993u64}, {"room": 9007199254740992u64}],
            "occurrences": 3,
        });
        assert_eq!(
            unsafe_numbers(&v),
            [
                "$.attempt.bootstrap_room = 9066467638188682269",
                "$.ids[0].room = 9007199254740993"
            ]
        );
    }
}
