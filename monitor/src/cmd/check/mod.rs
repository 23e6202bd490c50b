//! `revenant check`: replays recorded lifecycle events (JSON Lines, the replay format) through the
//! engine offline and prints the violations as JSON Lines; `--stats` summarises on standard error.
//!
//! Several files are one stream merged by event time (`merge`): per-node recordings give the
//! verdicts of the whole; `--per-file` checks each file on its own instead. Every violation names
//! the files its evidence was read from. Inputs are read with bounds (`input`): gzip is read,
//! binary data is refused in one line, long lines are skipped, errors are capped per file.
//!
//! Exit codes: 0 no violation, 1 violations found, 2 usage or input error (unreadable file or
//! rules, a bad line, a file that is not JSON Lines, a failed write), 3 no event read at all (an
//! empty input is not a clean one). A reader of standard output that went away (`| head`) ends
//! the check quietly with 0.

mod input;
mod merge;
mod report;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::Duration;

use crate::engine::check::{Checker, CheckerConfig, RuleSet};
use crate::exit::Exit;
use crate::ingest::replay;
use crate::telemetry::console;
use crate::violation::Violation;

use input::{BadLine, EventReader, ReadError};
use merge::{FileIndex, Merge};

/// A reader that ends (reads 0 bytes) once `gone` is set (an input's decoding thread reads
/// through it).
struct UntilGone {
    inner: Box<dyn Read + Send>,
    gone: Arc<AtomicBool>,
}

impl Read for UntilGone {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.gone.load(Relaxed) {
            return Ok(0);
        }
        self.inner.read(buf)
    }
}

/// Bad lines of one file shown on standard error; the rest are counted in one line at the end.
const BAD_LINES_SHOWN: u64 = 10;

/// How far back in event time the files of evidence events are remembered (the engine's
/// retention of ended attempts with room to spare), and how many events at most.
const FILE_INDEX_HORIZON: Duration = Duration::from_secs(3600);
const FILE_INDEX_MAX: usize = 4 << 20;

#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// Events file in the replay format (JSON Lines, or gzip of it); `-` reads standard input.
    /// Repeatable: several files are merged by event time into one stream (per-node
    /// recordings of one deployment), unless --per-file.
    #[arg(long = "events", short = 'e', value_name = "FILE")]
    pub events: Vec<PathBuf>,
    /// More events files, as `--events` (`revenant check a.jsonl b.jsonl`).
    #[arg(value_name = "FILE")]
    pub files: Vec<PathBuf>,
    /// Check each file on its own (a checker per file, its own recording settings) instead of
    /// merging them: for a directory of unrelated recordings.
    #[arg(long)]
    pub per_file: bool,
    /// Rules file (YAML) extending or overriding the embedded defaults.
    #[arg(long, value_name = "FILE")]
    pub rules: Option<PathBuf>,
    /// Events from different nodes count as later only beyond this skew [default: the recording
    /// run's (its `# revenant-run` header), else 50ms].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub clock_skew: Option<Duration>,
    /// How late (in event time) an event may arrive and still count for deadline rules
    /// [default: the recording run's (its header), else the clock skew].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub allowed_lateness: Option<Duration>,
    /// Longest line read (`64KiB`, `1MiB`, bytes); a longer one is skipped and reported as a
    /// bad line, without being held in memory.
    #[arg(long, value_name = "SIZE", value_parser = crate::config::parse_size, default_value = "1MiB")]
    pub max_line_bytes: u64,
    /// How violations are printed: `json` (one object per line, the `/api/violations` shape
    /// with `detected_at` and the files) or `text` (one line each, for a person).
    #[arg(long, value_name = "FORMAT", value_enum, default_value_t = Format::Json)]
    pub format: Format,
    /// Print a summary (events, violations per rule, state) to standard error at the end.
    #[arg(long)]
    pub stats: bool,
    /// Also print the follow-ups (`"corroborates": true`) in which a second source proves a
    /// breach already printed. Off by default: one line per (rule, attempt).
    #[arg(long)]
    pub corroborations: bool,
    /// Also write one self-contained HTML file: a summary (violations per rule, a histogram
    /// over event time) and the page of every violating request (swimlanes of its attempts),
    /// as the admin server's `/requests/{alias}` draws it.
    #[arg(long, value_name = "FILE")]
    pub report: Option<PathBuf>,
}

/// How `check` prints violations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Json,
    Text,
}

/// The embedded rules, extended or overridden by `path`; a bad file is exit code 2.
pub(crate) fn load_rules(path: Option<&PathBuf>) -> Result<RuleSet, ExitCode> {
    match path {
        None => Ok(RuleSet::embedded_defaults()),
        Some(p) => RuleSet::from_file(p).map_err(|e| {
            console::error(&e);
            Exit::Usage.into()
        }),
    }
}

/// Why `check` cannot read what it was given (exit code 2).
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("no events file: give --events FILE (or FILE; `-` is standard input)")]
    None,
    #[error("standard input (`-`) given more than once")]
    StdinTwice,
    #[error("cannot open events file {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Read { path: PathBuf, source: ReadError },
}

/// Opens every input (all before any is read: a missing one is found first). A file that is not
/// JSON Lines is reported in `refused` and left out; the others are checked.
fn open_inputs(
    paths: &[PathBuf],
    max_line: usize,
    wrap: impl Fn(Box<dyn Read + Send>) -> UntilGone,
    refused: &mut Vec<InputError>,
) -> Result<Vec<EventReader>, InputError> {
    if paths.is_empty() {
        return Err(InputError::None);
    }
    if paths.iter().filter(|p| p.as_os_str() == "-").count() > 1 {
        return Err(InputError::StdinTwice);
    }
    let mut readers = Vec::with_capacity(paths.len());
    for p in paths {
        let r: Box<dyn Read + Send> = if p.as_os_str() == "-" {
            Box::new(std::io::stdin())
        } else {
            Box::new(std::fs::File::open(p).map_err(|source| InputError::Open {
                path: p.clone(),
                source,
            })?)
        };
        match EventReader::new(p, Box::new(wrap(r)), max_line) {
            Ok(r) => readers.push(r),
            Err(source @ ReadError::NotJsonLines(_)) => refused.push(InputError::Read {
                path: p.clone(),
                source,
            }),
            Err(source) => {
                return Err(InputError::Read {
                    path: p.clone(),
                    source,
                });
            }
        }
    }
    Ok(readers)
}

/// The run header of a recorded file (gzip too); none from standard input (it cannot be read
/// twice).
fn read_header(path: &Path) -> Option<replay::RunHeader> {
    if path.as_os_str() == "-" {
        return None;
    }
    let mut f = BufReader::new(std::fs::File::open(path).ok()?);
    if f.fill_buf().ok()?.starts_with(b"\x1f\x8b") {
        return replay::RunHeader::read(BufReader::new(flate2::bufread::MultiGzDecoder::new(f)));
    }
    replay::RunHeader::read(f)
}

/// Standard output, written violation by violation, and whether its reader went away.
struct Output<'a> {
    out: std::io::BufWriter<std::io::StdoutLock<'a>>,
    write_failed: Option<std::io::Error>,
    reader_gone: Arc<AtomicBool>,
    corroborations: bool,
    format: Format,
    /// `--report`: what the HTML report is drawn from.
    report: Option<report::ReportCollector>,
}

impl Output<'_> {
    /// Prints `v` with the files its evidence came from (`names[file]`).
    fn emit(&mut self, v: &Violation, names: &[String], index: Option<&FileIndex>) {
        if let Some(r) = &mut self.report {
            r.violation(v);
        }
        if (v.corroborates && !self.corroborations) || self.write_failed.is_some() {
            return;
        }
        let line = annotated(v, names, index);
        let res = match self.format {
            Format::Json => serde_json::to_writer(&mut self.out, &line)
                .map_err(std::io::Error::from)
                .and_then(|_| self.out.write_all(b"\n")),
            Format::Text => writeln!(self.out, "{}", text_line(&line, names.len() > 1)),
        };
        if let Err(e) = res {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                self.reader_gone.store(true, Relaxed);
            }
            self.write_failed.get_or_insert(e);
        }
    }
}

/// A violation as `check` prints it: the `/api/violations` shape (same fields, same order),
/// each evidence event with the `file` it was read from, and the violation's `files` (argument
/// order). With one file every event is from it; with several, from the index (an event older
/// than its horizon names no file).
#[derive(serde::Serialize)]
struct Line<'a> {
    rule: &'a str,
    severity: crate::violation::Severity,
    summary: &'a str,
    #[serde(skip_serializing_if = "no_request")]
    request: &'a crate::violation::RequestAliases,
    #[serde(skip_serializing_if = "no_attempt")]
    attempt: &'a crate::violation::AttemptAliases,
    #[serde(skip_serializing_if = "Option::is_none")]
    worker: Option<&'a str>,
    detected_at_ns: u64,
    /// `detected_at_ns` as RFC 3339, as alerts carry it.
    detected_at: String,
    fingerprint: &'a str,
    evidence: Vec<EvidenceLine<'a>>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    corroborates: bool,
    files: Vec<&'a str>,
}

#[derive(serde::Serialize)]
struct EvidenceLine<'a> {
    #[serde(flatten)]
    event: &'a crate::violation::Evidence,
    #[serde(skip_serializing_if = "Option::is_none")]
    file: Option<&'a str>,
}

fn no_request(r: &&crate::violation::RequestAliases) -> bool {
    r.is_empty()
}

fn no_attempt(a: &&crate::violation::AttemptAliases) -> bool {
    a.is_empty()
}

fn annotated<'a>(v: &'a Violation, names: &'a [String], index: Option<&FileIndex>) -> Line<'a> {
    let files: Vec<Option<usize>> = v
        .evidence
        .iter()
        .map(|ev| match index {
            None => Some(0),
            Some(ix) => ix.file_of(ev),
        })
        .collect();
    let mut distinct: Vec<usize> = files.iter().flatten().copied().collect();
    distinct.sort_unstable();
    distinct.dedup();
    Line {
        rule: &v.rule,
        severity: v.severity,
        summary: &v.summary,
        request: &v.request,
        attempt: &v.attempt,
        worker: v.worker.as_deref(),
        detected_at_ns: v.detected_at_ns,
        detected_at: crate::alert::notification::rfc3339(v.detected_at_ns),
        fingerprint: &v.fingerprint,
        evidence: v
            .evidence
            .iter()
            .zip(&files)
            .map(|(event, f)| EvidenceLine {
                event,
                file: f.map(|f| names[f].as_str()),
            })
            .collect(),
        corroborates: v.corroborates,
        files: distinct.into_iter().map(|f| names[f].as_str()).collect(),
    }
}

/// `--format text`: detection time, severity, the summary, and the files when there are several.
fn text_line(l: &Line<'_>, several_files: bool) -> String {
    let mut line = format!("{} {:<8} {}", l.detected_at, l.severity.as_str(), l.summary);
    if l.corroborates {
        line.push_str(" (corroborated by another source)");
    }
    if several_files && !l.files.is_empty() {
        line.push_str(&format!(" [{}]", l.files.join(", ")));
    }
    line
}

/// What one checked stream (all files merged, or one file with --per-file) left to report.
#[derive(Default)]
struct Totals {
    events: u64,
    bad_lines: u64,
    read_errors: u64,
    violations: u64,
}

/// The engine settings for a stream whose first recorded file has `header`, warning when its
/// rules differ from the recording run's.
fn checker_config(
    args: &CheckArgs,
    rules: &RuleSet,
    header: Option<&replay::RunHeader>,
) -> CheckerConfig {
    let recorded = |ns: u64| Duration::from_nanos(ns);
    let clock_skew = args
        .clock_skew
        .or(header.map(|h| recorded(h.clock_skew_ns)))
        .unwrap_or(crate::config::DEFAULT_CLOCK_SKEW);
    let allowed_lateness = args
        .allowed_lateness
        .or(header.map(|h| recorded(h.allowed_lateness_ns)))
        .unwrap_or(clock_skew);
    if let Some(h) = header {
        let fingerprint = replay::rules_fingerprint(rules.rules.iter());
        if fingerprint != h.rules_fingerprint {
            let rules_flag = match &h.rules {
                Some(p) => format!("--rules {p}"),
                None => "no --rules (the embedded defaults)".into(),
            };
            console::write_line(&format!(
                "revenant: warning: these rules differ from the recording run's (fingerprint {} vs \
                 {fingerprint}); to reproduce it: {rules_flag} --allowed-lateness {:?} --clock-skew {:?}",
                h.rules_fingerprint,
                recorded(h.allowed_lateness_ns),
                recorded(h.clock_skew_ns),
            ));
        }
    }
    CheckerConfig {
        clock_skew,
        allowed_lateness,
        ..CheckerConfig::default()
    }
}

/// The recording settings of the first of `paths` that has a header; a later file recorded with
/// other settings is said.
fn stream_header(paths: &[&Path]) -> Option<replay::RunHeader> {
    let mut first: Option<(replay::RunHeader, &Path)> = None;
    for p in paths {
        let Some(h) = read_header(p) else { continue };
        match &first {
            None => first = Some((h, p)),
            Some((f, fp))
                if (f.allowed_lateness_ns, f.clock_skew_ns, &f.rules_fingerprint)
                    != (h.allowed_lateness_ns, h.clock_skew_ns, &h.rules_fingerprint) =>
            {
                console::write_line(&format!(
                    "revenant: warning: {} was recorded with other settings than {} (lateness, \
                     skew or rules); the first file's are used",
                    p.display(),
                    fp.display()
                ));
            }
            Some(_) => {}
        }
    }
    first.map(|(h, _)| h)
}

/// Checks `readers` as one stream (merged by event time), printing violations to `out` and the
/// stream's warnings and `--stats` to standard error.
fn check_stream(
    readers: Vec<EventReader>,
    rules: RuleSet,
    args: &CheckArgs,
    out: &mut Output<'_>,
) -> Totals {
    let paths: Vec<PathBuf> = readers.iter().map(|r| r.path.clone()).collect();
    let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    let header = stream_header(&paths.iter().map(PathBuf::as_path).collect::<Vec<_>>());
    let cfg = checker_config(args, &rules, header.as_ref());
    let lateness = cfg.allowed_lateness;
    let mut checker = Checker::new(rules, cfg);
    let mut index = (readers.len() > 1)
        .then(|| FileIndex::new(FILE_INDEX_HORIZON.as_nanos() as u64, FILE_INDEX_MAX));
    let mut totals = Totals::default();
    let mut shown = vec![0u64; readers.len()];
    let reader_gone = out.reader_gone.clone();
    let mut on_bad = |path: &Path, bad: BadLine| {
        // Input cut short once standard output is gone: its last line is no error.
        if reader_gone.load(Relaxed) {
            return;
        }
        totals.bad_lines += 1;
        let i = paths.iter().position(|p| p == path).unwrap_or(0);
        shown[i] += 1;
        if shown[i] <= BAD_LINES_SHOWN {
            console::error(&format!(
                "{}: line {}: {}",
                path.display(),
                bad.line,
                bad.message
            ));
        }
    };
    let reader_gone = out.reader_gone.clone();
    let mut read_errors = 0u64;
    let mut on_error = |path: &Path, e: ReadError| {
        if reader_gone.load(Relaxed) {
            return;
        }
        read_errors += 1;
        console::error(&format!("reading {}: {e}", path.display()));
    };
    let mut merge = Merge::new(readers);
    let mut newest = 0u64;
    if let Some(r) = &mut out.report {
        names.iter().for_each(|n| r.file(n));
    }
    while let Some((e, file)) = merge.next(&mut on_bad, &mut on_error) {
        if let Some(r) = &mut out.report {
            r.event(&e);
        }
        if let Some(ix) = &mut index {
            ix.insert(&e, file);
            if e.time_ns > newest.saturating_add(merge::BUCKET_NS) {
                newest = e.time_ns;
                ix.expire(newest);
            }
        }
        for v in checker.observe(&e) {
            out.emit(&v, &names, index.as_ref());
        }
    }
    // Judge what the input can still prove: every deadline up to the last event time.
    let end = checker
        .stats()
        .max_event_ns
        .saturating_add(lateness.as_nanos() as u64);
    for v in checker.tick(end) {
        out.emit(&v, &names, index.as_ref());
    }
    totals.read_errors = read_errors;
    totals.violations = checker.stats().violations;
    for r in &merge.readers {
        totals.events += r.events;
        let i = paths.iter().position(|p| *p == r.path).unwrap_or(0);
        if shown[i] > BAD_LINES_SHOWN {
            console::error(&format!(
                "{}: …and {} more bad lines (not shown)",
                r.path.display(),
                shown[i] - BAD_LINES_SHOWN
            ));
        }
        if r.events == 0 && !out.reader_gone.load(Relaxed) {
            console::write_line(&format!(
                "revenant: warning: no events read from {} (empty, or only comments{})",
                r.path.display(),
                if r.bad > 0 { " and bad lines" } else { "" }
            ));
        }
    }
    if args.stats {
        print_stats(&checker, totals.bad_lines, args.corroborations);
    }
    let late = checker.stats().events_late;
    if late > 0 && !args.stats {
        console::write_line(&format!(
            "revenant: warning: {} arrived later than --allowed-lateness {lateness:?} and did not \
             count for deadline rules (--stats for details)",
            count(late, "event"),
        ));
    }
    let unattributed = checker.stats().events_unattributed;
    if unattributed > 0 && !args.stats {
        console::write_line(&format!(
            "revenant: warning: {} named no request or attempt (ids: request_id, trace_id, rid, \
             bootstrap_room) and {} checked only against worker-level rules (--stats for details)",
            count(unattributed, "event"),
            if unattributed == 1 { "was" } else { "were" },
        ));
    }
    totals
}

pub fn run(args: CheckArgs) -> ExitCode {
    let rules = match load_rules(args.rules.as_ref()) {
        Ok(r) => r,
        Err(code) => return code,
    };
    let paths: Vec<PathBuf> = args.events.iter().chain(&args.files).cloned().collect();
    // Once standard output is gone (`| head`), reading on is pointless: the input ends there.
    let reader_gone = Arc::new(AtomicBool::new(false));
    let until_gone = |r: Box<dyn Read + Send>| UntilGone {
        inner: r,
        gone: reader_gone.clone(),
    };
    // A report that cannot be written is found before anything is read.
    if let Some(p) = &args.report
        && let Err(e) = std::fs::File::create(p)
    {
        console::error(&format!("cannot write the report {}: {e}", p.display()));
        return Exit::Usage.into();
    }
    let max_line = usize::try_from(args.max_line_bytes).unwrap_or(usize::MAX);
    let mut refused = Vec::new();
    let readers = match open_inputs(&paths, max_line, until_gone, &mut refused) {
        Ok(r) => r,
        Err(e) => {
            console::error(&e);
            return Exit::Usage.into();
        }
    };
    for e in &refused {
        console::error(e);
    }

    let stdout = std::io::stdout();
    let mut out = Output {
        out: std::io::BufWriter::with_capacity(1 << 16, stdout.lock()),
        write_failed: None,
        reader_gone: reader_gone.clone(),
        corroborations: args.corroborations,
        format: args.format,
        report: args.report.clone().map(report::ReportCollector::new),
    };
    let windows = crate::report::CancelWindow::of_set(&rules);
    let mut totals = Totals::default();
    let mut add = |t: Totals| {
        totals.events += t.events;
        totals.bad_lines += t.bad_lines;
        totals.read_errors += t.read_errors;
        totals.violations += t.violations;
    };
    if args.per_file {
        for r in readers {
            if args.stats {
                console::write_line(&format!("revenant: {}:", r.path.display()));
            }
            add(check_stream(vec![r], rules.clone(), &args, &mut out));
        }
    } else if !readers.is_empty() {
        add(check_stream(readers, rules, &args, &mut out));
    }
    let flushed = if out.write_failed.is_some() {
        Ok(())
    } else {
        out.out.flush()
    };
    if let Some(e) = out.write_failed.take().or(flushed.err()) {
        // The reader of standard output went away (`| head`): it has what it wanted.
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            return Exit::Success.into();
        }
        console::error(&format!("writing violations: {e}"));
        return Exit::Usage.into();
    }
    if let Some(r) = out.report.take() {
        let path = r.path.clone();
        if let Err(e) = r.write(&windows) {
            console::error(&e);
            return Exit::Usage.into();
        }
        console::write_line(&format!("revenant: report written to {}", path.display()));
    }
    if totals.read_errors > 0 || !refused.is_empty() {
        return Exit::Usage.into();
    }
    if totals.bad_lines > 0 {
        console::write_line(&format!(
            "revenant: {} skipped; the rest was checked",
            count(totals.bad_lines, "bad line")
        ));
        return Exit::Usage.into();
    }
    if totals.events == 0 {
        console::write_line(&format!(
            "revenant: warning: no events read: nothing was checked (exit code {}, not \
             a clean result)",
            Exit::NoEvents.code()
        ));
        return Exit::NoEvents.into();
    }
    if totals.violations > 0 {
        Exit::Violations.into()
    } else {
        Exit::Success.into()
    }
}

/// `--stats`: the stream's summary on standard error.
fn print_stats(checker: &Checker, bad_lines: u64, corroborations: bool) {
    let s = checker.stats();
    console::write_line(&format!(
        "revenant: {} ({} attempt, {} request-only, {} unattributed, {} capacity, {} on tombstones, {} late), {}",
        count(s.events, "event"),
        s.events_attempt,
        s.events_request_only,
        s.events_unattributed,
        s.capacity_reports,
        s.events_on_tombstones,
        s.events_late,
        count(bad_lines, "bad line")
    ));
    let open = checker.open_deadlines_per_rule();
    for ((rule, n), o) in checker
        .rules()
        .zip(checker.violations_per_rule())
        .zip(&open)
    {
        let pending = if *o > 0 {
            format!(
                " ({} still open at end of input: pending)",
                count(*o, "deadline")
            )
        } else {
            String::new()
        };
        console::write_line(&format!("revenant:   {:<32} {n}{pending}", rule.name));
    }
    let open_total: u64 = open.iter().sum();
    if open_total > 0 {
        console::write_line(&format!(
            "revenant: {} pending: the input ends before {} can be judged",
            count(open_total, "deadline"),
            if open_total == 1 { "it" } else { "they" }
        ));
    }
    console::write_line(&format!(
        "revenant: {}, {}{}",
        count(s.violations, "violation"),
        count(s.corroborations, "corroborating follow-up"),
        if corroborations {
            ""
        } else {
            " (not printed: --corroborations)"
        }
    ));
    console::write_line(&format!(
        "revenant: {} created, {} live, {}, {} live ({} with a record); evicted {} by ttl, {} by cap",
        count(s.correlate.attempts_created, "attempt"),
        s.live_attempts,
        count(s.tombstones, "tombstone"),
        count(s.live_requests, "request"),
        s.request_records,
        s.correlate.evicted_ttl,
        s.correlate.evicted_cap
    ));
}

/// `n thing` or `n things`.
fn count(n: u64, thing: &str) -> String {
    if n == 1 {
        format!("1 {thing}")
    } else {
        format!("{n} {thing}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Kind, Source, Stage};
    use crate::violation::{AttemptAliases, Evidence, EvidenceRole, RequestAliases, Severity};

    /// `check`'s line has every field of a violation, in the same order, plus `detected_at` and
    /// `files` (and `file` on each evidence event): a field added to `Violation` must be added
    /// here too.
    #[test]
    fn a_line_is_the_violation_plus_its_files() {
        let v = Violation {
            rule: "r".into(),
            severity: Severity::Warning,
            summary: "s".into(),
            request: RequestAliases {
                request_id: Some("q".into()),
                trace_id: Some("t".into()),
            },
            attempt: AttemptAliases {
                bootstrap_room: Some(7),
                rid: Some("rid".into()),
            },
            worker: Some("w".into()),
            detected_at_ns: 9,
            fingerprint: "f".into(),
            evidence: vec![Evidence {
                role: EvidenceRole::Trigger,
                time_ns: 1,
                stage: Stage::Prefill,
                kind: Kind::Rejected,
                source: Source::Otlp,
                status: Some(400),
                reason: Some("why".into()),
            }],
            corroborates: true,
        };
        let names = vec!["a.jsonl".to_string()];
        let line = serde_json::to_string(&annotated(&v, &names, None)).unwrap();
        let plain = serde_json::to_string(&v).unwrap();
        let expected = format!(
            "{},\"files\":[\"a.jsonl\"]}}",
            plain
                .strip_suffix('}')
                .unwrap()
                .replace(
                    "\"reason\":\"why\"}",
                    "\"reason\":\"why\",\"file\":\"a.jsonl\"}"
                )
                .replace(
                    "\"detected_at_ns\":9,",
                    "\"detected_at_ns\":9,\"detected_at\":\"1970-01-01T00:00:00.000000009Z\","
                )
        );
        assert_eq!(line, expected);
    }
}
