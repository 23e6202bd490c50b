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

mod fast;
use fast::Fields;

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
///
/// Lines in the shape the format's writers produce are decoded by a hand-written decoder
/// (`fast`), several times cheaper than serde; any other line by serde ([`parse_line_serde`]),
/// whose messages say what is wrong where. Both give the same result for every line.
pub fn parse_line(line: &str) -> Result<Option<LifecycleEvent>, String> {
    content(line)
        .map(|t| match fast::decode(t) {
            Some(fields) => into_event(fields),
            None => parse_record(t),
        })
        .transpose()
}

/// [`parse_line`] by serde alone: the reference the fast decoder is held to.
pub fn parse_line_serde(line: &str) -> Result<Option<LifecycleEvent>, String> {
    content(line).map(parse_record).transpose()
}

/// A line's content, trimmed; `None` for an empty line or a `#` comment.
fn content(line: &str) -> Option<&str> {
    let t = line.trim();
    (!t.is_empty() && !t.starts_with('#')).then_some(t)
}

/// One trimmed, non-comment line through serde.
fn parse_record(t: &str) -> Result<LifecycleEvent, String> {
    let r: ReplayRecord = serde_json::from_str(t).map_err(|e| {
        // The line number is the file's (the caller's); within one line only the column counts.
        let full = e.to_string();
        let position = format!(" at line {} column {}", e.line(), e.column());
        let message = full.strip_suffix(&position).unwrap_or(&full);
        format!("{message} (column {})", e.column())
    })?;
    r.into_event()
}

/// What a line's fields mean, whichever decoder read them.
fn into_event(f: Fields<'_>) -> Result<LifecycleEvent, String> {
    let time_ns = match (f.time, f.time_unix_nano) {
        (Some(_), Some(_)) => {
            return Err("give either `time` or `time_unix_nano`, not both".into());
        }
        (None, Some(ns)) => ns,
        (Some(s), None) => parse_rfc3339(s)?,
        (None, None) => return Err("missing `time` (RFC 3339) or `time_unix_nano`".into()),
    };
    if f.to.is_some() && !matches!(f.kind, Kind::Dispatched | Kind::Cancelled) {
        return Err("`to` is only meaningful on `dispatched` and `cancelled` events".into());
    }
    let mut e = LifecycleEvent::new(time_ns, f.stage, f.kind, f.source.unwrap_or(Source::Replay));
    e.ids = f.ids;
    e.node = f.node.map(Into::into);
    e.pid = f.pid;
    e.worker = f.worker.map(Into::into);
    e.status = f.status;
    e.reason = f.reason.map(|r| truncate_reason(r).into());
    e.detail = f.detail.map(|r| truncate_reason(r).into());
    e.to = f.to;
    e.peer = f.peer;
    e.protocol_breach = f.protocol_breach;
    e.input_tokens = f.input_tokens;
    e.context_tokens = f.context_tokens;
    e.max_input_tokens = f.max_input_tokens;
    e.max_total_tokens = f.max_total_tokens;
    Ok(e)
}

impl ReplayRecord {
    pub fn into_event(self) -> Result<LifecycleEvent, String> {
        into_event(Fields {
            time: self.time.as_deref(),
            time_unix_nano: self.time_unix_nano,
            stage: self.stage,
            kind: self.kind,
            ids: self.ids,
            node: self.node.as_deref(),
            pid: self.pid,
            source: self.source,
            status: self.status,
            reason: self.reason.as_deref(),
            detail: self.detail.as_deref(),
            to: self.to,
            peer: self.peer,
            protocol_breach: self.protocol_breach,
            input_tokens: self.input_tokens,
            context_tokens: self.context_tokens,
            max_input_tokens: self.max_input_tokens,
            max_total_tokens: self.max_total_tokens,
            worker: self.worker.as_deref(),
        })
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
        // A line that lies whole in the reader's buffer is decoded where it lies; only one cut
        // by the buffer's end is copied out first.
        let chunk = input.fill_buf()?;
        let parsed = match memchr::memchr(b'\n', chunk) {
            Some(i) => {
                line_no += 1;
                let parsed = parse_raw_line(&chunk[..i], line_no);
                input.consume(i + 1);
                parsed
            }
            None => {
                raw.clear();
                if input.read_until(b'\n', &mut raw)? == 0 {
                    return Ok(());
                }
                line_no += 1;
                parse_raw_line(&raw, line_no)
            }
        };
        match parsed {
            Ok(Some(e)) => on_event(e),
            Ok(None) => {}
            Err(message) => on_error(ReplayError::Line {
                line: line_no,
                message,
            }),
        }
    }
}

/// [`parse_line`] of line `line_no`'s bytes: a byte order mark skipped on line 1, and bytes that
/// are not UTF-8 an error (of the line, not of the file).
pub fn parse_raw_line(raw: &[u8], line_no: u64) -> Result<Option<LifecycleEvent>, String> {
    // A UTF-8 byte order mark (editors on Windows write one) is not part of the first line.
    let raw = match raw.strip_prefix(b"\xEF\xBB\xBF") {
        Some(rest) if line_no == 1 => rest,
        _ => raw,
    };
    let line = std::str::from_utf8(raw).map_err(|_| "not valid UTF-8".to_owned())?;
    parse_line(line)
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

    /// Lines of every shape the fast decoder gives up on, and some it reads: both decoders must
    /// give the same event or the same message.
    #[test]
    fn the_fast_decoder_agrees_with_serde_on_awkward_lines() {
        let base = r#""time_unix_nano":1,"stage":"router","kind":"dispatched""#;
        let lines = [
            format!("{{{base}}}"),
            format!("{{ {base} , \"to\" : \"decode\" }}"),
            format!("{{\t{base},\r\n\"to\":\"decode\"}}"),
            format!("{{{base},\"to\":\"decode\",\"to\":\"prefill\"}}"),
            format!("{{{base},\"pid\":null}}"),
            format!("{{{base},\"time\":null}}"),
            format!("{{{base},\"ids\":null}}"),
            format!("{{{base},\"node\":\"a\\\"b\"}}"),
            format!("{{{base},\"node\":\"\\u00e9\"}}"),
            format!("{{{base},\"node\":\"é ü\"}}"),
            format!("{{{base},\"node\":\"a\tb\"}}"),
            format!("{{{base},\"node\":\"\"}}"),
            format!("{{{base},\"reason\":\"{}\"}}", "é".repeat(100)),
            format!("{{{base},\"n\\u006fde\":\"a\"}}"),
            format!("{{{base},\"pid\":01}}"),
            format!("{{{base},\"pid\":0}}"),
            format!("{{{base},\"pid\":-1}}"),
            format!("{{{base},\"pid\":-0}}"),
            format!("{{{base},\"pid\":1.0}}"),
            format!("{{{base},\"pid\":1e3}}"),
            format!("{{{base},\"pid\":1E3}}"),
            format!("{{{base},\"pid\":4294967295}}"),
            format!("{{{base},\"pid\":4294967296}}"),
            format!("{{{base},\"status\":65536}}"),
            format!("{{{base},\"input_tokens\":18446744073709551615}}"),
            format!("{{{base},\"input_tokens\":18446744073709551616}}"),
            format!("{{{base},\"input_tokens\":\"5\"}}"),
            format!("{{{base},\"pid\":12x}}"),
            format!("{{{base},}}"),
            format!("{{{base}}},"),
            format!("{{{base}}} x"),
            format!("{{{base}}}{{}}"),
            format!("{{{base}"),
            format!("{{{base},\"colour\":1}}"),
            format!("{{{base},\"source\":\"ebpf\"}}"),
            format!("{{{base},\"source\":\"EBPF\"}}"),
            format!("{{{base},\"peer\":\"foreign\",\"protocol_breach\":\"repeated-readiness\"}}"),
            format!("{{{base},\"protocol_breach\":\"repeated_readiness\"}}"),
            format!("{{{base},\"to\":{{\"decode\":null}}}}"),
            format!("{{{base},\"ids\":{{}}}}"),
            format!("{{{base},\"ids\":{{\"rid\":\"r\",\"rid\":\"s\"}}}}"),
            format!("{{{base},\"ids\":{{\"room\":1}}}}"),
            format!("{{{base},\"ids\":{{\"bootstrap_room\":-3}}}}"),
            format!("{{{base},\"ids\":{{\"bootstrap_room\":1.5}}}}"),
            format!("{{{base},\"ids\":{{\"bootstrap_room\":18446744073709551616}}}}"),
            format!("{{{base},\"ids\":{{\"bootstrap_room\":\"0X1F\"}}}}"),
            format!("{{{base},\"ids\":{{\"bootstrap_room\":\"0x\"}}}}"),
            format!("{{{base},\"ids\":{{\"bootstrap_room\":\"0x+f\"}}}}"),
            format!("{{{base},\"ids\":{{\"bootstrap_room\":\"0x10000000000000000\"}}}}"),
            format!("{{{base},\"ids\":{{\"bootstrap_room\":\"0xffffffffffffffff\"}}}}"),
            format!("{{{base},\"ids\":{{\"bootstrap_room\":\" 12 \"}}}}"),
            format!("{{{base},\"ids\":{{\"bootstrap_room\":\"+12\"}}}}"),
            format!("{{{base},\"ids\":{{\"bootstrap_room\":\"007\"}}}}"),
            format!("{{{base},\"ids\":{{\"bootstrap_room\":\"12\",\"bootstrap_room_hex\":\"0xc\"}}}}"),
            format!("{{{base},\"ids\":{{\"bootstrap_room\":\"12\",\"bootstrap_room_hex\":\"0xd\"}}}}"),
            format!("{{{base},\"ids\":{{\"bootstrap_room_hex\":13}}}}"),
            format!("{{{base},\"ids\":{{\"bootstrap_room\":true}}}}"),
            r#"{"time":"2026-10-26T10:00:00.000000123Z","stage":"prefill","kind":"rejected"}"#.into(),
            r#"{"time":"2026-10-26 10:00:00Z","stage":"prefill","kind":"rejected"}"#.into(),
            r#"{"time":"1969-12-31T23:59:59Z","stage":"prefill","kind":"rejected"}"#.into(),
            r#"{"time":"2026-10-26T10:00:00Z","time_unix_nano":1,"stage":"prefill","kind":"rejected"}"#.into(),
            r#"{"time_unix_nano":1,"stage":"prefill","kind":"rejected","to":"decode"}"#.into(),
            r#"{"time_unix_nano":1,"stage":"prefill"}"#.into(),
            r#"{"stage":"prefill","kind":"rejected"}"#.into(),
            r#"[1,"prefill","rejected"]"#.into(),
            r#"{}"#.into(),
            "\u{feff}{\"time_unix_nano\":1,\"stage\":\"prefill\",\"kind\":\"rejected\"}".into(),
            "not json".into(),
        ];
        for line in &lines {
            assert_eq!(parse_line(line), parse_line_serde(line), "{line}");
        }
    }

    /// The shape every writer produces is the fast decoder's: were it to give up on them, reading
    /// would silently fall back to the slow path.
    #[test]
    fn the_fast_decoder_reads_what_the_writers_write() {
        let e = LifecycleEvent::new(42, Stage::Router, Kind::Dispatched, Source::Ebpf)
            .with_room(9_066_467_638_188_682_269)
            .with_to(Stage::Decode)
            .with_request_id("r")
            .with_trace_id("t")
            .with_rid("rid-1")
            .with_node("n")
            .with_worker("http://w:1")
            .with_status(200)
            .with_reason("fine")
            .with_peer(Peer::Member)
            .with_protocol_breach(ProtocolBreach::ForeignKvHandoff)
            .with_input_tokens(7);
        let line = serde_json::to_string(&ReplayRecord::from_event(&e)).unwrap();
        assert!(fast::decode(&line).is_some(), "{line}");
        assert_eq!(parse_line(&line).unwrap().unwrap(), e);
        let spans = r#"{"time":"2026-10-26T10:00:00.000000123Z","stage":"prefill","kind":"rejected","ids":{"bootstrap_room":"0x314783f6bef71155"},"status":400,"reason":"exceeds max tokens"}"#;
        assert!(fast::decode(spans).is_some());
        for e in crate::engine::workload::stream(&crate::engine::workload::Mix {
            attempts: 200,
            ..Default::default()
        }) {
            let line = serde_json::to_string(&ReplayRecord::from_event(&e)).unwrap();
            assert!(fast::decode(&line).is_some(), "{line}");
            assert_eq!(parse_line(&line).unwrap().unwrap(), e);
        }
    }

    mod agreement {
        use super::super::{parse_line, parse_line_serde};
        use proptest::prelude::*;

        fn quoted(s: &str) -> String {
            format!("\"{s}\"")
        }

        /// A value as writers spell them, and as they do not.
        fn value() -> impl Strategy<Value = String> {
            prop_oneof![
                any::<u64>().prop_map(|n| n.to_string()),
                (0u64..70_000).prop_map(|n| n.to_string()),
                prop::sample::select(vec![
                    "0",
                    "01",
                    "-1",
                    "1.5",
                    "1e3",
                    "null",
                    "true",
                    "[]",
                    "{}",
                    "18446744073709551616",
                    "4294967296",
                    "65536",
                ])
                .prop_map(String::from),
                prop::sample::select(vec![
                    "router",
                    "prefill",
                    "transfer",
                    "decode",
                    "received",
                    "dispatched",
                    "admitted",
                    "rejected",
                    "work",
                    "completed",
                    "aborted",
                    "cancelled",
                    "capacity",
                    "ebpf",
                    "otlp",
                    "replay",
                    "member",
                    "foreign",
                    "unattributed",
                    "repeated-readiness",
                    "surplus-decode-owner",
                    "Router",
                    "",
                    "2026-10-26T10:00:00.000000123Z",
                    "2026-10-26T10:00:00Z",
                    "0x1f",
                    "0X1F",
                    "12",
                    " 12",
                    "+12",
                    "0x",
                    "0xffffffffffffffff",
                    "0x10000000000000000",
                ])
                .prop_map(quoted),
                "[ -~é\\t]{0,10}".prop_map(|s| quoted(&s)),
                ids(),
            ]
        }

        fn ids() -> impl Strategy<Value = String> {
            let key = prop::sample::select(vec![
                "request_id",
                "trace_id",
                "rid",
                "bootstrap_room",
                "bootstrap_room_hex",
                "room",
            ]);
            let value = prop_oneof![
                any::<u64>().prop_map(|n| n.to_string()),
                any::<u64>().prop_map(|n| quoted(&n.to_string())),
                any::<u64>().prop_map(|n| quoted(&format!("{n:#x}"))),
                (0u64..4).prop_map(|n| quoted(&format!("{n:#x}"))),
                (0u64..4).prop_map(|n| n.to_string()),
                "[ -~]{0,6}".prop_map(|s| quoted(&s)),
                Just("null".to_owned()),
            ];
            prop::collection::vec((key, value), 0..4).prop_map(|kv| {
                let fields: Vec<String> = kv.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
                format!("{{{}}}", fields.join(","))
            })
        }

        fn key() -> impl Strategy<Value = String> {
            prop_oneof![
                8 => prop::sample::select(vec![
                    "time", "time_unix_nano", "stage", "kind", "ids", "node", "pid", "source",
                    "status", "reason", "detail", "to", "peer", "protocol_breach",
                    "input_tokens", "context_tokens", "max_input_tokens", "max_total_tokens",
                    "worker",
                ])
                .prop_map(String::from),
                1 => "[a-z_]{1,6}",
            ]
        }

        /// A line: fields usually led by a valid time, stage and kind, then mutated a little.
        fn line() -> impl Strategy<Value = String> {
            let head = prop::sample::select(vec![
                r#""time_unix_nano":5,"stage":"router","kind":"dispatched","#,
                r#""time_unix_nano":5,"stage":"decode","kind":"work","#,
                r#""time":"2026-10-26T10:00:00Z","stage":"prefill","kind":"rejected","#,
                "",
            ]);
            let fields = prop::collection::vec((key(), value()), 0..5);
            let ws = prop::sample::select(vec!["", "", "", " ", "\t", "\r\n "]);
            let edit = prop_oneof![
                4 => Just(None),
                1 => (any::<prop::sample::Index>(), prop::sample::select(vec![
                    "", "\"", "\\", "{", "}", ",", ":", " ", "0", "-", ".", "x", "\u{1}", "é",
                ]))
                .prop_map(Some),
            ];
            (head, fields, ws, edit).prop_map(|(head, fields, ws, edit)| {
                let body: Vec<String> = fields
                    .iter()
                    .map(|(k, v)| format!("{ws}\"{k}\"{ws}:{ws}{v}{ws}"))
                    .collect();
                let mut line = format!("{{{head}{}}}", body.join(","));
                if head.ends_with(',') && fields.is_empty() {
                    line = line.replacen(",}", "}", 1);
                }
                if let Some((at, with)) = edit {
                    // Replace one character (or delete it: `with` empty).
                    let chars: Vec<char> = line.chars().collect();
                    let at = at.index(chars.len());
                    let mut out: String = chars[..at].iter().collect();
                    out.push_str(with);
                    out.extend(&chars[at + 1..]);
                    line = out;
                }
                line
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(4096))]
            #[test]
            fn both_decoders_give_the_same_result(line in line()) {
                prop_assert_eq!(parse_line(&line), parse_line_serde(&line), "{}", line);
            }
        }
    }
}
