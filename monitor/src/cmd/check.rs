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
    /// Events file in the replay format (JSON Lines); `-` reads standard input.
    #[arg(long, short = 'e')]
    pub events: PathBuf,
    /// Rules file (YAML) extending or overriding the embedded defaults.
    #[arg(long, value_name = "FILE")]
    pub rules: Option<PathBuf>,
    /// Events from different nodes count as later only beyond this skew.
    #[arg(long, default_value = "50ms", value_parser = humantime::parse_duration)]
    pub clock_skew: Duration,
    /// How late (in event time) an event may arrive and still count for deadline rules.
    /// Defaults to the clock skew.
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

pub fn run(args: CheckArgs) -> ExitCode {
    let rules = match load_rules(args.rules.as_ref()) {
        Ok(r) => r,
        Err(code) => return code,
    };
    let cfg = CheckerConfig {
        clock_skew: args.clock_skew,
        allowed_lateness: args.allowed_lateness.unwrap_or(args.clock_skew),
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
    let input: Box<dyn BufRead> = if args.events.as_os_str() == "-" {
        Box::new(BufReader::with_capacity(
            1 << 20,
            until_gone(Box::new(std::io::stdin().lock())),
        ))
    } else {
        match std::fs::File::open(&args.events) {
            Ok(f) => Box::new(BufReader::with_capacity(1 << 20, until_gone(Box::new(f)))),
            Err(e) => {
                console::error(&format!(
                    "cannot open events file {}: {e}",
                    args.events.display()
                ));
                return ExitCode::from(2);
            }
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
    let read = replay::read_events(
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
            console::error(&format!("{}: {err}", args.events.display()));
        },
    );
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
    if let Err(e) = read {
        console::error(&format!("reading {}: {e}", args.events.display()));
        return ExitCode::from(2);
    }
    if args.stats {
        let s = checker.stats();
        console::write_line(&format!(
            "revenant: {} events ({} attempt, {} request-only, {} unattributed, {} capacity, {} on tombstones, {} late), {} bad lines",
            s.events,
            s.events_attempt,
            s.events_request_only,
            s.events_unattributed,
            s.capacity_reports,
            s.events_on_tombstones,
            s.events_late,
            bad_lines
        ));
        for (rule, n) in checker.rules().zip(checker.violations_per_rule()) {
            console::write_line(&format!("revenant:   {:<32} {n}", rule.name));
        }
        console::write_line(&format!(
            "revenant: {} violations, {} corroborating follow-ups{}",
            s.violations,
            s.corroborations,
            if args.corroborations {
                ""
            } else {
                " (not printed: --corroborations)"
            }
        ));
        console::write_line(&format!(
            "revenant: {} attempts created, {} live, {} tombstones, {} requests live ({} with a record); evicted {} by ttl, {} by cap",
            s.correlate.attempts_created,
            s.live_attempts,
            s.tombstones,
            s.live_requests,
            s.request_records,
            s.correlate.evicted_ttl,
            s.correlate.evicted_cap
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
