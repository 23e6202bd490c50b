//! What the end-to-end runs make of revenant's notifications, shared by `cargo xtask demo` and
//! the end-to-end tests; the processes themselves come from `test-harness`.

use serde_json::Value;

/// The distinct sources in a notification's evidence, sorted ("ebpf", "otlp").
pub fn evidence_sources(n: &Value) -> Vec<String> {
    let mut s: Vec<String> = n["evidence"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|e| e["source"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    s.sort();
    s.dedup();
    s
}

/// One readable line for a notification: rule, request, attempt, stages, evidence sources.
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
    let room = n["attempt"]["bootstrap_room"]
        .as_u64()
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
    let mut line = format!(
        "[{}] {} request {}{}: {} (evidence: {})",
        n["severity"].as_str().unwrap_or("?"),
        n["rule"].as_str().unwrap_or("?"),
        request,
        room,
        stages.join(" -> "),
        evidence_sources(n).join("+"),
    );
    if n["occurrences"].as_u64().unwrap_or(1) > 1 {
        line.push_str(&format!(" x{}", n["occurrences"]));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_liner_names_rule_request_stages_and_sources() {
        let n: Value = serde_json::json!({
            "type": "violation", "severity": "critical", "rule": "activity-after-rejection",
            "request": {"request_id": "load-7"}, "attempt": {"bootstrap_room": 255},
            "occurrences": 1,
            "evidence": [
                {"stage": "prefill", "kind": "rejected", "status": 400, "source": "otlp"},
                {"stage": "transfer", "kind": "work", "source": "ebpf"}
            ]
        });
        assert_eq!(
            one_liner(&n),
            "[critical] activity-after-rejection request load-7 room 0xff: prefill rejected 400 -> transfer work (evidence: ebpf+otlp)"
        );
    }
}
