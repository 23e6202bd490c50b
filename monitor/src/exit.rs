//! revenant's exit codes, one meaning each (the README's table): every subcommand and `main`
//! answer with an [`Exit`], and this is the one place that turns it into a number.
//!
//! - `run`, `agent`, `checker`: 0 stopped by a signal and drained, 1 a failure once running (a
//!   receiver died, the drain timed out, a second signal), 2 a usage or configuration error found
//!   before anything was served (a bad flag or file, a port in use, a spool held by another
//!   instance, `--ebpf on` without probes, a stream made with another partition count).
//! - `check`: 0 no violation, 1 violations found, 2 a usage or input error, 3 no event read.
//! - `rules`, `config validate`, `completions`: 0 done, 2 a usage error or a file that does not
//!   load.

use std::process::ExitCode;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// 0: done as asked (a daemon stopped by a signal and drained; `check` found nothing).
    Success,
    /// 1: a daemon failed once running.
    Failure,
    /// 1: `check` found violations.
    Violations,
    /// 2: usage, configuration or input error, found before anything was served.
    Usage,
    /// 3: `check` read no event at all: an empty input is not a clean one.
    NoEvents,
}

impl Exit {
    pub fn code(self) -> u8 {
        match self {
            Exit::Success => 0,
            Exit::Failure | Exit::Violations => 1,
            Exit::Usage => 2,
            Exit::NoEvents => 3,
        }
    }
}

impl From<Exit> for ExitCode {
    fn from(e: Exit) -> ExitCode {
        ExitCode::from(e.code())
    }
}
