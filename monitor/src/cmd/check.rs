//! `revenant check`: replays recorded lifecycle events (JSON Lines, the replay format) through the
//! engine offline and prints the violations as JSON Lines; `--stats` summarises on standard error.
//!
//! Exit codes: 0 no violation, 1 violations found, 2 usage or input error (unreadable file or
//! rules, a bad line, a failed write). A reader of standard output that went away (`| head`)
//! ends the check quietly with 0.

use std::cell::Cell;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::rc::Rc;
use std::time::Duration;

use crate::engine::check::{Checker, CheckerConfig, RuleSet};
use crate::ingest::replay;
use crate::telemetry::console;

/// A reader that ends (reads 0 bytes) once `gone` is set.
struct UntilGone {
    inner: Box<dyn Read>,
    gone: Rc<Cell<bool>>,
}

impl Read for UntilGone {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.gone.get() {
            return Ok(0);
        }
        self.inner.read(buf)
    }
}

#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// Events file in the replay format (JSON Lines); `-` reads standard input. Repeatable:
    /// several files are checked as one stream, in the order given.
    #[arg(long = "events", short = 'e', value_name = "FILE")]
    pub events: Vec<PathBuf>,
    /// More events files, as `--events` (`revenant check a.jsonl b.jsonl`).
    #[arg(value_name = "FILE")]
    pub files: Vec<PathBuf>,
    /// Rules file (YAML) extending or overriding the embedded defaults.
    #[arg(long, value_name = "FILE")]
    pub rules: Option<PathBuf>,
    /// Events from different nodes count as later only beyond this skew [default: the recording
    /// run's (its `# revenant-run` header), else 50ms].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub clock_skew: Option<Duration>,
    /// How late (in event time) an event may arrive and still count for deadline rules
    /// [default: the recording run's (its header), else the clock skew].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub allowed_lateness: Option<Duration>,
    /// Print a summary (events, violations per rule, state) to standard error at the end.
    #[arg(long)]
    pub stats: bool,
    /// Also print the follow-ups (`"corroborates": true`) in which a second source proves a
    /// breach already printed. Off by default: one line per (rule, attempt).
    #[arg(long)]
    pub corroborations: bool,
}

/// The embedded rules, extended or overridden by `path`; a bad file is exit code 2.
pub(crate) fn load_rules(path: Option<&PathBuf>) -> Result<RuleSet, ExitCode> {
    match path {
        None => Ok(RuleSet::embedded_defaults()),
        Some(p) => RuleSet::from_file(p).map_err(|e| {
            console::error(&e);
            ExitCode::from(2)
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
}

/// One events file, opened, under the name it was given.
type Input<'a> = (&'a PathBuf, Box<dyn BufRead>);

/// The inputs in order, each opened (all before any is read: a missing one is found first).
fn open_inputs(
    paths: &[PathBuf],
    wrap: impl Fn(Box<dyn Read>) -> UntilGone,
) -> Result<Vec<Input<'_>>, InputError> {
    if paths.is_empty() {
        return Err(InputError::None);
    }
    if paths.iter().filter(|p| p.as_os_str() == "-").count() > 1 {
        return Err(InputError::StdinTwice);
    }
    paths
        .iter()
        .map(|p| {
            let r: Box<dyn Read> = if p.as_os_str() == "-" {
                Box::new(std::io::stdin().lock())
            } else {
                Box::new(std::fs::File::open(p).map_err(|source| InputError::Open {
                    path: p.clone(),
                    source,
                })?)
            };
            let input: Box<dyn BufRead> = Box::new(BufReader::with_capacity(1 << 20, wrap(r)));
            Ok((p, input))
        })
        .collect()
}

/// `n thing` or `n things`.
fn count(n: u64, thing: &str) -> String {
    if n == 1 {
        format!("1 {thing}")
    } else {
        format!("{n} {thing}s")
    }
}

pub fn run(args: CheckArgs) -> ExitCode {
    let rules = match load_rules(args.rules.as_ref()) {
        Ok(r) => r,
        Err(code) => return code,
    };
    let paths: Vec<PathBuf> = args.events.iter().chain(&args.files).cloned().collect();
    // The settings of the run that recorded the first file, when it says (standard input cannot
    // be read twice: no header from it).
    let header = paths
        .first()
        .filter(|p| p.as_os_str() != "-")
        .and_then(|p| std::fs::File::open(p).ok())
        .and_then(|f| replay::RunHeader::read(BufReader::new(f)));
    let recorded = |ns: u64| Duration::from_nanos(ns);
    let clock_skew = args
        .clock_skew
        .or(header.as_ref().map(|h| recorded(h.clock_skew_ns)))
        .unwrap_or(crate::config::DEFAULT_CLOCK_SKEW);
    let allowed_lateness = args
        .allowed_lateness
        .or(header.as_ref().map(|h| recorded(h.allowed_lateness_ns)))
        .unwrap_or(clock_skew);
    if let Some(h) = &header {
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
    let cfg = CheckerConfig {
        clock_skew,
        allowed_lateness,
        ..CheckerConfig::default()
    };
    let lateness = cfg.allowed_lateness;
    let mut checker = Checker::new(rules, cfg);

    // Once standard output is gone (`| head`), reading on is pointless: the input ends there.
    let reader_gone = Rc::new(Cell::new(false));
    let until_gone = |r: Box<dyn Read>| UntilGone {
        inner: r,
        gone: reader_gone.clone(),
    };
    let inputs = match open_inputs(&paths, until_gone) {
        Ok(i) => i,
        Err(e) => {
            console::error(&e);
            return ExitCode::from(2);
        }
    };

    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::with_capacity(1 << 16, stdout.lock());
    let mut bad_lines = 0u64;
    let mut write_failed = None;
    // The checker counts violations and follow-ups itself (see `--stats`); here only the
    // choice of what to print.
    let mut emit = |v: &crate::violation::Violation,
                    out: &mut std::io::BufWriter<std::io::StdoutLock<'_>>| {
        if (v.corroborates && !args.corroborations) || write_failed.is_some() {
            return;
        }
        let res = serde_json::to_writer(&mut *out, v)
            .map_err(std::io::Error::from)
            .and_then(|_| out.write_all(b"\n"));
        if let Err(e) = res {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                reader_gone.set(true);
            }
            write_failed.get_or_insert(e);
        }
    };
    let mut read = Ok(());
    for (path, input) in inputs {
        let r = replay::read_events(
            input,
            |e| {
                for v in checker.observe(&e) {
                    emit(&v, &mut out);
                }
            },
            |err| {
                // Input cut short once standard output is gone: its last line is no error.
                if reader_gone.get() {
                    return;
                }
                bad_lines += 1;
                console::error(&format!("{}: {err}", path.display()));
            },
        );
        if let Err(e) = r {
            read = Err((path, e));
            break;
        }
    }
    // Judge what the input can still prove: every deadline up to the last event time.
    let end = checker
        .stats()
        .max_event_ns
        .saturating_add(lateness.as_nanos() as u64);
    for v in checker.tick(end) {
        emit(&v, &mut out);
    }
    let flushed = if write_failed.is_some() {
        Ok(())
    } else {
        out.flush()
    };
    if let Some(e) = write_failed.or(flushed.err()) {
        // The reader of standard output went away (`| head`): it has what it wanted.
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            return ExitCode::SUCCESS;
        }
        console::error(&format!("writing violations: {e}"));
        return ExitCode::from(2);
    }
    if let Err((path, e)) = read {
        console::error(&format!("reading {}: {e}", path.display()));
        return ExitCode::from(2);
    }
    if args.stats {
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
            if args.corroborations {
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
             bootstrap_room) and were checked only against worker-level rules (--stats for details)",
            count(unattributed, "event"),
        ));
    }
    if bad_lines > 0 {
        console::write_line(&format!(
            "revenant: {bad_lines} bad line(s) skipped; the rest of the file was checked"
        ));
        return ExitCode::from(2);
    }
    if checker.stats().violations > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
