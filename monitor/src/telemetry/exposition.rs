//! The two text formats `/metrics` speaks, chosen from the scraper's `Accept` header as the
//! Prometheus client libraries choose: OpenMetrics 1.0 only when the client asks for
//! `application/openmetrics-text`, otherwise the Prometheus text format 0.0.4 (what `curl`,
//! `promtool check metrics` and most agents read).
//!
//! The registry encodes OpenMetrics; [`to_text_004`] rewrites that into 0.0.4: a counter's
//! `# HELP`/`# TYPE` name the sample (`foo_total`, where OpenMetrics names the family `foo`),
//! `# UNIT`, `# EOF`, `_created` samples and exemplars have no 0.0.4 form and are left out, and
//! the OpenMetrics-only types become their 0.0.4 equivalents (`unknown` → `untyped`,
//! `info` → a `gauge` named `foo_info`).

/// A `/metrics` exposition format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Prometheus text format 0.0.4: the default.
    Text,
    /// OpenMetrics 1.0 text: only when asked for.
    OpenMetrics,
}

impl Format {
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Text => "text/plain; version=0.0.4; charset=utf-8",
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }

    /// The format for an `Accept` header: the acceptable media range with the highest quality
    /// that is one of ours (ties go to the one listed first). `application/openmetrics-text`
    /// (versions 1.0.0 and 0.0.1, or no version) is OpenMetrics; `text/plain`, `text/*`, `*/*`,
    /// anything else and no header at all are the text format.
    pub fn negotiate(accept: Option<&str>) -> Format {
        let Some(accept) = accept else {
            return Format::Text;
        };
        let mut best: Option<(f32, Format)> = None;
        for range in accept.split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or_default().to_ascii_lowercase();
            let mut q = 1.0f32;
            let mut version = None;
            for p in parts {
                let Some((k, v)) = p.split_once('=') else {
                    continue;
                };
                let v = v.trim().trim_matches('"');
                match k.trim().to_ascii_lowercase().as_str() {
                    "q" => q = v.parse().unwrap_or(0.0),
                    "version" => version = Some(v.to_owned()),
                    _ => {}
                }
            }
            let format = match media.as_str() {
                "application/openmetrics-text"
                    if version
                        .as_deref()
                        .is_none_or(|v| v == "1.0.0" || v == "0.0.1") =>
                {
                    Format::OpenMetrics
                }
                "text/plain" if version.as_deref().is_none_or(|v| v == "0.0.4") => Format::Text,
                "text/*" | "*/*" => Format::Text,
                _ => continue,
            };
            if q > 0.0 && best.is_none_or(|(bq, _)| q > bq) {
                best = Some((q, format));
            }
        }
        best.map_or(Format::Text, |(_, f)| f)
    }
}

/// The Prometheus text format 0.0.4 of an OpenMetrics exposition (as the registry encodes it).
pub fn to_text_004(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    // The family being written and its OpenMetrics type.
    let (mut family, mut kind) = (String::new(), String::new());
    // A family's HELP waits for its TYPE, which decides the name both lines take.
    let mut help: Option<(String, String)> = None;
    let flush = |out: &mut String, help: &mut Option<(String, String)>| {
        if let Some((name, text)) = help.take() {
            out.push_str(&format!("# HELP {name} {text}\n"));
        }
    };
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# ") {
            let mut words = rest.splitn(3, ' ');
            let directive = words.next().unwrap_or_default();
            let name = words.next().unwrap_or_default();
            let tail = words.next().unwrap_or_default();
            match directive {
                "HELP" => {
                    flush(&mut out, &mut help);
                    help = Some((name.to_owned(), tail.to_owned()));
                }
                "TYPE" => {
                    family = name.to_owned();
                    kind = tail.to_owned();
                    let (text_name, ty) = text_name_and_type(&family, &kind);
                    if let Some((help_name, text)) = help.take() {
                        let help_name = if help_name == family {
                            &text_name
                        } else {
                            &help_name
                        };
                        out.push_str(&format!("# HELP {help_name} {text}\n"));
                    }
                    out.push_str(&format!("# TYPE {text_name} {ty}\n"));
                }
                // UNIT and EOF have no 0.0.4 form.
                _ => flush(&mut out, &mut help),
            }
            continue;
        }
        flush(&mut out, &mut help);
        if line.is_empty() {
            continue;
        }
        let sample = strip_exemplar(line);
        let name_end = sample.find(['{', ' ']).unwrap_or(sample.len());
        if matches!(kind.as_str(), "counter" | "histogram" | "summary")
            && sample[..name_end].strip_prefix(family.as_str()) == Some("_created")
        {
            continue;
        }
        out.push_str(sample);
        out.push('\n');
    }
    flush(&mut out, &mut help);
    out
}

/// The name and type a family's HELP/TYPE lines take in the text format.
fn text_name_and_type(family: &str, kind: &str) -> (String, &'static str) {
    match kind {
        "counter" => (format!("{family}_total"), "counter"),
        "gauge" => (family.to_owned(), "gauge"),
        "histogram" => (family.to_owned(), "histogram"),
        "summary" => (family.to_owned(), "summary"),
        "info" => (format!("{family}_info"), "gauge"),
        _ => (family.to_owned(), "untyped"),
    }
}

/// A sample line without its exemplar (` # {…} value`, after the value, outside any label
/// value's quotes).
fn strip_exemplar(line: &str) -> &str {
    let bytes = line.as_bytes();
    let (mut in_quotes, mut escaped) = (false, false);
    for (i, &b) in bytes.iter().enumerate() {
        if in_quotes {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_quotes = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_quotes = true,
            b' ' if bytes.get(i + 1) == Some(&b'#') => return &line[..i],
            _ => {}
        }
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negotiates_like_the_prometheus_client_libraries() {
        use Format::*;
        assert_eq!(Format::negotiate(None), Text);
        assert_eq!(Format::negotiate(Some("*/*")), Text);
        assert_eq!(Format::negotiate(Some("text/plain;version=0.0.4")), Text);
        assert_eq!(
            Format::negotiate(Some("application/openmetrics-text")),
            OpenMetrics
        );
        // What Prometheus sends by default: OpenMetrics preferred.
        assert_eq!(
            Format::negotiate(Some(
                "application/openmetrics-text;version=1.0.0;q=0.5,\
                 application/openmetrics-text;version=0.0.1;q=0.4,\
                 text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
            )),
            OpenMetrics
        );
        // Text preferred by quality, OpenMetrics refused, an unknown version ignored.
        assert_eq!(
            Format::negotiate(Some(
                "application/openmetrics-text;q=0.1, text/plain;version=0.0.4"
            )),
            Text
        );
        assert_eq!(
            Format::negotiate(Some("application/openmetrics-text;q=0")),
            Text
        );
        assert_eq!(
            Format::negotiate(Some("application/openmetrics-text; version=9.9.9")),
            Text
        );
        assert_eq!(
            Format::negotiate(Some("application/vnd.google.protobuf")),
            Text
        );
    }

    #[test]
    fn rewrites_openmetrics_into_the_text_format() {
        let om = "\
# HELP revenant_events Lifecycle events.
# TYPE revenant_events counter
revenant_events_total{source=\"otlp\"} 3
revenant_events_created{source=\"otlp\"} 1700000000.0
# HELP revenant_lag_seconds Lag.
# TYPE revenant_lag_seconds histogram
# UNIT revenant_lag_seconds seconds
revenant_lag_seconds_sum 0.5
revenant_lag_seconds_count 1
revenant_lag_seconds_bucket{le=\"+Inf\"} 1 # {trace_id=\"a # b\"} 0.5
# HELP revenant_ready Ready.
# TYPE revenant_ready gauge
revenant_ready{note=\"x # y\"} 1
# HELP revenant_build Build.
# TYPE revenant_build info
revenant_build_info{version=\"0.1.0\"} 1
# HELP revenant_odd Odd.
# TYPE revenant_odd unknown
revenant_odd 1
# EOF
";
        let text = to_text_004(om);
        assert_eq!(
            text,
            "\
# HELP revenant_events_total Lifecycle events.
# TYPE revenant_events_total counter
revenant_events_total{source=\"otlp\"} 3
# HELP revenant_lag_seconds Lag.
# TYPE revenant_lag_seconds histogram
revenant_lag_seconds_sum 0.5
revenant_lag_seconds_count 1
revenant_lag_seconds_bucket{le=\"+Inf\"} 1
# HELP revenant_ready Ready.
# TYPE revenant_ready gauge
revenant_ready{note=\"x # y\"} 1
# HELP revenant_build_info Build.
# TYPE revenant_build_info gauge
revenant_build_info{version=\"0.1.0\"} 1
# HELP revenant_odd Odd.
# TYPE revenant_odd untyped
revenant_odd 1
"
        );
    }
}
