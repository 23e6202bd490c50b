use std::collections::BTreeMap;

/// One Prometheus/OpenMetrics sample.
#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Parses the text exposition format (enough of it for revenant's own /metrics).
pub fn parse_metrics(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let (series, value) = match line.rsplit_once(' ') {
            Some(x) => x,
            None => continue,
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        let (name, labels) = match series.split_once('{') {
            Some((n, rest)) => (n, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        let mut map = BTreeMap::new();
        for kv in split_labels(labels) {
            if let Some((k, v)) = kv.split_once('=') {
                map.insert(k.to_string(), v.trim_matches('"').to_string());
            }
        }
        out.push(Sample {
            name: name.to_string(),
            labels: map,
            value,
        });
    }
    out
}

fn split_labels(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut start, mut quoted) = (0, false);
    for (i, c) in s.char_indices() {
        match c {
            '"' => quoted = !quoted,
            ',' if !quoted => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if start < s.len() {
        parts.push(&s[start..]);
    }
    parts
}

/// Sum of `name`'s samples whose labels include every `(key, value)` of `filter`.
pub fn metric_sum(samples: &[Sample], name: &str, filter: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            filter
                .iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
        // Not `.sum()`: an empty f64 sum is -0.0.
        .fold(0.0, |a, b| a + b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_metrics_with_quoted_commas() {
        let m = parse_metrics(
            "# HELP x\nrevenant_events_total{source=\"otlp\",stage=\"a,b\"} 3\nrevenant_ready 1\n",
        );
        assert_eq!(
            metric_sum(&m, "revenant_events_total", &[("stage", "a,b")]),
            3.0
        );
        assert_eq!(metric_sum(&m, "revenant_ready", &[]), 1.0);
    }
}
