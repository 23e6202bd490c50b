//! The replay source: recorded events as JSON Lines, one [`LifecycleEvent`] per line.
//!
//! ```json
//! {"time":"2026-10-26T10:00:00.000000123Z","stage":"prefill","kind":"rejected","ids":{"bootstrap_room":"0x314783f6bef71155"},"status":400,"reason":"exceeds max tokens"}
//! ```
//! `time` (RFC 3339, up to ns) or `time_unix_nano` (integer) is required; so are `stage` and
//! `kind`. Unknown fields are errors, so a typo never silently drops a fact.
//!
//! A file written by `revenant run --events-jsonl` starts (each run appending to it, each run's
//! part starts) with a [`RunHeader`] comment line, which readers that skip `#` lines ignore:
//! ```text
//! # revenant-run {"version":"0.1.0","allowed_lateness_ns":2000000000,"clock_skew_ns":50000000,"rules":null,"rules_fingerprint":"9c1e…"}
//! ```
//! `revenant check` takes the lateness and skew from the first one unless given as flags.

use std::io::BufRead;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::event::{
    Ids, Kind, LifecycleEvent, Peer, ProtocolBreach, Source, Stage, truncate_reason,
};

/// One line of the replay format, as written on disk.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplayRecord {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_unix_nano: Option<u64>,
    pub stage: Stage,
    pub kind: Kind,
    #[serde(default)]
    pub ids: Ids,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<Source>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<Stage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<Peer>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol_breach: Option<ProtocolBreach>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_input_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_total_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("line {line}: {message}")]
    Line { line: u64, message: String },
    #[error("reading events: {0}")]
    Io(#[from] std::io::Error),
}

/// What starts a run header line.
pub const RUN_HEADER_PREFIX: &str = "# revenant-run ";

/// The engine settings of the run that recorded a file: what changes verdicts on replay.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunHeader {
    /// revenant's version.
    pub version: String,
    pub allowed_lateness_ns: u64,
    pub clock_skew_ns: u64,
    /// The `--rules` file of the run; `null` for the embedded defaults.
    pub rules: Option<String>,
    /// [`rules_fingerprint`] of the compiled rule set.
    pub rules_fingerprint: String,
}

impl RunHeader {
    /// The header line, newline included.
    pub fn line(&self) -> String {
        let json = serde_json::to_string(self).unwrap_or_default();
        format!("{RUN_HEADER_PREFIX}{json}\n")
    }

    /// A run header line, or `None` for any other line (other comments included).
    pub fn parse(line: &str) -> Option<RunHeader> {
        let line = line.strip_prefix('\u{feff}').unwrap_or(line);
        serde_json::from_str(line.trim_end().strip_prefix(RUN_HEADER_PREFIX)?).ok()
    }

    /// The first run header among the leading comment lines of `input`.
    pub fn read(input: impl BufRead) -> Option<RunHeader> {
        for line in input.lines().take(64) {
            let line = line.ok()?;
            let t = line.trim_start_matches('\u{feff}').trim();
            if t.is_empty() {
                continue;
            }
            if !t.starts_with('#') {
                return None;
            }
            if let Some(h) = RunHeader::parse(t) {
                return Some(h);
            }
        }
        None
    }
}

/// A digest of a compiled rule set (first 16 hex digits of SHA-256 over its rules): equal
/// fingerprints mean the same rules, whatever file they came from. Computed from the rules' debug
/// form, so a different revenant version may give another fingerprint for the same file.
pub fn rules_fingerprint<'a>(
    rules: impl Iterator<Item = &'a crate::engine::rules::Rule>,
) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    for r in rules {
        h.update(format!("{r:?}").as_bytes());
        h.update(b"\n");
    }
    h.finalize()
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Parses one line. Empty lines and `#` comments give `Ok(None)`.
pub fn parse_line(line: &str) -> Result<Option<LifecycleEvent>, String> {
    let t = line.trim();
    if t.is_empty() || t.starts_with('#') {
        return Ok(None);
    }
    let r: ReplayRecord = serde_json::from_str(t).map_err(|e| {
        // The line number is the file's (the caller's); within one line only the column counts.
        let full = e.to_string();
        let position = format!(" at line {} column {}", e.line(), e.column());
        let message = full.strip_suffix(&position).unwrap_or(&full);
        format!("{message} (column {})", e.column())
    })?;
    r.into_event().map(Some)
}

impl ReplayRecord {
    pub fn into_event(self) -> Result<LifecycleEvent, String> {
        let time_ns = match (&self.time, self.time_unix_nano) {
            (Some(_), Some(_)) => {
                return Err("give either `time` or `time_unix_nano`, not both".into());
            }
            (None, Some(ns)) => ns,
            (Some(s), None) => parse_rfc3339(s)?,
            (None, None) => return Err("missing `time` (RFC 3339) or `time_unix_nano`".into()),
        };
        if self.to.is_some() && !matches!(self.kind, Kind::Dispatched | Kind::Cancelled) {
            return Err("`to` is only meaningful on `dispatched` and `cancelled` events".into());
        }
        let mut e = LifecycleEvent::new(
            time_ns,
            self.stage,
            self.kind,
            self.source.unwrap_or(Source::Replay),
        );
        e.ids = self.ids;
        e.node = self.node.map(Into::into);
        e.pid = self.pid;
        e.worker = self.worker.map(Into::into);
        e.status = self.status;
        e.reason = self.reason.as_deref().map(|r| truncate_reason(r).into());
        e.detail = self.detail.as_deref().map(|r| truncate_reason(r).into());
        e.to = self.to;
        e.peer = self.peer;
        e.protocol_breach = self.protocol_breach;
        e.input_tokens = self.input_tokens;
        e.context_tokens = self.context_tokens;
        e.max_input_tokens = self.max_input_tokens;
        e.max_total_tokens = self.max_total_tokens;
        Ok(e)
    }

    pub fn from_event(e: &LifecycleEvent) -> ReplayRecord {
        ReplayRecord {
            time: None,
            time_unix_nano: Some(e.time_ns),
            stage: e.stage,
            kind: e.kind,
            ids: e.ids.clone(),
            node: e.node.as_deref().map(Into::into),
            pid: e.pid,
            source: Some(e.source),
            status: e.status,
            reason: e.reason.as_deref().map(Into::into),
            detail: e.detail.as_deref().map(Into::into),
            to: e.to,
            peer: e.peer,
            protocol_breach: e.protocol_breach,
            input_tokens: e.input_tokens,
            context_tokens: e.context_tokens,
            max_input_tokens: e.max_input_tokens,
            max_total_tokens: e.max_total_tokens,
            worker: e.worker.as_deref().map(Into::into),
        }
    }
}

fn parse_rfc3339(s: &str) -> Result<u64, String> {
    let t = OffsetDateTime::parse(s, &Rfc3339)
        .map_err(|e| format!("invalid time {s:?}: {e} (expected RFC 3339)"))?;
    u64::try_from(t.unix_timestamp_nanos()).map_err(|_| format!("time {s:?} is before 1970"))
}

/// Reads events line by line, calling `on_event` for each good one and `on_error` for each bad
/// line (with its 1-based number). Bad lines never stop the rest of the file. A UTF-8 byte order
/// mark at the start is skipped.
pub fn read_events(
    input: impl BufRead,
    mut on_event: impl FnMut(LifecycleEvent),
    mut on_error: impl FnMut(ReplayError),
) -> Result<(), std::io::Error> {
    let mut line_no = 0u64;
    let mut raw = Vec::new();
    let mut input = input;
    loop {
        raw.clear();
        // Lines that are not UTF-8 are reported, not fatal.
        let n = input.read_until(b'\n', &mut raw)?;
        if n == 0 {
            return Ok(());
        }
        line_no += 1;
        // A UTF-8 byte order mark (editors on Windows write one) is not part of the first line.
        let raw = match raw.strip_prefix(b"\xEF\xBB\xBF") {
            Some(rest) if line_no == 1 => rest,
            _ => &raw[..],
        };
        let Ok(line) = std::str::from_utf8(raw) else {
            on_error(ReplayError::Line {
                line: line_no,
                message: "not valid UTF-8".into(),
            });
            continue;
        };
        match parse_line(line) {
            Ok(Some(e)) => on_event(e),
            Ok(None) => {}
            Err(message) => on_error(ReplayError::Line {
                line: line_no,
                message,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_time_forms_and_both_room_spellings() {
        let a = parse_line(r#"{"time":"2026-10-26T10:00:00.000000123Z","stage":"prefill","kind":"rejected","ids":{"bootstrap_room":"0x314783f6bef71155"},"status":400}"#).unwrap().unwrap();
        let b = parse_line(r#"{"time_unix_nano":1793008800000000123,"stage":"prefill","kind":"rejected","ids":{"bootstrap_room":3550951926993981781}}"#).unwrap().unwrap();
        assert_eq!(a.time_ns, b.time_ns);
        assert_eq!(a.ids.bootstrap_room, b.ids.bootstrap_room);
        assert_eq!(a.source, Source::Replay);
        assert_eq!(a.status, Some(400));
    }

    #[test]
    fn errors_are_clear() {
        let e = parse_line(r#"{"stage":"prefill","kind":"rejected"}"#).unwrap_err();
        assert!(e.contains("missing `time`"), "{e}");
        let e =
            parse_line(r#"{"time_unix_nano":1,"stage":"prefil","kind":"rejected"}"#).unwrap_err();
        assert!(e.contains("prefil"), "{e}");
        let e = parse_line(r#"{"time_unix_nano":1,"stage":"prefill","kind":"work","colour":1}"#)
            .unwrap_err();
        assert!(e.contains("colour"), "{e}");
        let e =
            parse_line(r#"{"time_unix_nano":1,"stage":"prefill","kind":"work","ids":{"room":1}}"#)
                .unwrap_err();
        assert!(e.contains("room"), "{e}");
        assert!(parse_line("# comment").unwrap().is_none());
    }

    #[test]
    fn bad_lines_do_not_stop_the_file() {
        let input: &[u8] = b"{\"time_unix_nano\":1,\"stage\":\"router\",\"kind\":\"received\"}\nnot json\n\xff\n{\"time_unix_nano\":2,\"stage\":\"router\",\"kind\":\"completed\"}\n";
        let mut good = 0;
        let mut bad = Vec::new();
        read_events(input, |_| good += 1, |e| bad.push(e.to_string())).unwrap();
        assert_eq!(good, 2);
        assert_eq!(bad.len(), 2);
        assert!(bad[0].starts_with("line 2:"), "{bad:?}");
    }

    #[test]
    fn a_byte_order_mark_keeps_the_first_line() {
        let input: &[u8] = b"\xEF\xBB\xBF{\"time_unix_nano\":1,\"stage\":\"router\",\"kind\":\"received\"}\n\xEF\xBB\xBF\n";
        let mut good = 0;
        let mut bad = Vec::new();
        read_events(input, |_| good += 1, |e| bad.push(e.to_string())).unwrap();
        assert_eq!(good, 1);
        // Only at the start of the file: elsewhere it is a bad line.
        assert_eq!(bad.len(), 1, "{bad:?}");
        assert!(bad[0].starts_with("line 2:"), "{bad:?}");
    }

    #[test]
    fn run_header_is_found_among_leading_comments_and_skipped_by_the_reader() {
        let h = RunHeader {
            version: "0.1.0".into(),
            allowed_lateness_ns: 15_000_000_000,
            clock_skew_ns: 50_000_000,
            rules: None,
            rules_fingerprint: "00ff".into(),
        };
        let line = h.line();
        assert!(
            line.starts_with("# revenant-run {") && line.ends_with('\n'),
            "{line}"
        );
        let file = format!(
            "\u{feff}# a note\n{line}{{\"time_unix_nano\":1,\"stage\":\"prefill\",\"kind\":\"rejected\"}}\n"
        );
        assert_eq!(RunHeader::read(file.as_bytes()), Some(h.clone()));
        let (mut events, mut errors) = (0, 0);
        read_events(file.as_bytes(), |_| events += 1, |_| errors += 1).unwrap();
        assert_eq!((events, errors), (1, 0));
        // A header after the first event belongs to a later run appended to the file.
        let late =
            format!("{{\"time_unix_nano\":1,\"stage\":\"prefill\",\"kind\":\"rejected\"}}\n{line}");
        assert_eq!(RunHeader::read(late.as_bytes()), None);
        assert_eq!(RunHeader::parse("# revenant-run {broken"), None);
    }

    #[test]
    fn round_trips() {
        let e = LifecycleEvent::new(42, Stage::Router, Kind::Dispatched, Source::Ebpf)
            .with_room(7)
            .with_to(Stage::Decode)
            .with_request_id("r");
        let line = serde_json::to_string(&ReplayRecord::from_event(&e)).unwrap();
        assert_eq!(parse_line(&line).unwrap().unwrap(), e);
        // A room above 2^53 is recorded as a decimal string with its hex, and reads back exactly.
        let e = e.with_room(9_066_467_638_188_682_269);
        let line = serde_json::to_string(&ReplayRecord::from_event(&e)).unwrap();
        assert!(
            line.contains(
                r#""bootstrap_room":"9066467638188682269","bootstrap_room_hex":"0x7dd29047ddcfac1d""#
            ),
            "{line}"
        );
        assert_eq!(parse_line(&line).unwrap().unwrap(), e);
    }

    #[test]
    fn peer_round_trips_and_unknown_peers_are_errors() {
        let e = LifecycleEvent::new(42, Stage::Transfer, Kind::Received, Source::Ebpf)
            .with_peer(crate::event::Peer::Foreign);
        let line = serde_json::to_string(&ReplayRecord::from_event(&e)).unwrap();
        assert!(line.contains(r#""peer":"foreign""#), "{line}");
        assert_eq!(parse_line(&line).unwrap().unwrap(), e);
        let err = parse_line(
            r#"{"time_unix_nano":1,"stage":"transfer","kind":"received","peer":"stranger"}"#,
        )
        .unwrap_err();
        assert!(err.contains("stranger"), "{err}");
    }
}
