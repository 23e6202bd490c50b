//! revenant's own lines on standard error besides the log: the ready line, the shutdown summary,
//! the counter dump, the error a command exits with. They are written whatever the log filter,
//! in the log's format (`--log-format json`: one JSON object per line, shaped like the log's
//! records: `timestamp`, `level`, `fields` with `message`, `target`), and a closed or broken
//! standard error never stops the process: a line that cannot be written is dropped.

use std::io::Write as _;
use std::sync::OnceLock;

use serde_json::{Map, Value};

/// The format of everything revenant writes on standard error: its log (`telemetry::logging`
/// installs the subscriber in it) and its own lines (ready, summary, errors).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    #[default]
    Human,
    Json,
}

static FORMAT: OnceLock<LogFormat> = OnceLock::new();

/// Sets the format of every later line (once per process; `revenant run` sets it from
/// `--log-format` before anything else is written).
pub fn set_format(format: LogFormat) {
    let _ = FORMAT.set(format);
}

/// The format lines are written in.
pub fn format() -> LogFormat {
    FORMAT.get().copied().unwrap_or_default()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Info,
    Warn,
    Error,
}

impl Level {
    fn as_str(self) -> &'static str {
        match self {
            Level::Info => "INFO",
            Level::Warn => "WARN",
            Level::Error => "ERROR",
        }
    }
}

/// Writes `text` and a newline to standard error in one call; a failure is ignored.
pub fn write_line(text: &str) {
    let mut line = String::with_capacity(text.len() + 1);
    line.push_str(text);
    line.push('\n');
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// One line: `revenant: {human}` in the human format; in JSON, a record with `message` and
/// `fields`.
pub fn say(level: Level, human: &str, message: &str, fields: Map<String, Value>) {
    match format() {
        LogFormat::Human => write_line(&format!("revenant: {human}")),
        LogFormat::Json => write_line(&json_record(level, message, fields)),
    }
}

/// The error a command exits with.
pub fn error(e: &dyn std::fmt::Display) {
    let text = e.to_string();
    say(Level::Error, &text, &text, Map::new());
}

/// A JSON record shaped like the log's (tracing-subscriber's JSON format).
pub fn json_record(level: Level, message: &str, fields: Map<String, Value>) -> String {
    let timestamp = time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default();
    let mut all = Map::with_capacity(fields.len() + 1);
    all.insert("message".into(), message.into());
    all.extend(fields);
    serde_json::json!({
        "timestamp": timestamp,
        "level": level.as_str(),
        "fields": all,
        "target": "revenant",
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_records_look_like_the_log() {
        let mut fields = Map::new();
        fields.insert("admin".into(), "127.0.0.1:9464".into());
        let v: Value = serde_json::from_str(&json_record(Level::Info, "ready", fields)).unwrap();
        assert_eq!(v["level"], "INFO");
        assert_eq!(v["target"], "revenant");
        assert_eq!(v["fields"]["message"], "ready");
        assert_eq!(v["fields"]["admin"], "127.0.0.1:9464");
        assert!(v["timestamp"].as_str().unwrap().ends_with('Z'), "{v}");
    }
}
