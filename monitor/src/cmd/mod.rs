//! The subcommands that are not the daemon: offline `check`, `rules` inspection and
//! validation, `config validate`. `revenant run` lives in [`crate::run`].

pub mod check;
pub mod config;
pub mod rules;

use std::io::Write as _;
use std::process::ExitCode;

use crate::exit::Exit;

/// Writes `text` to standard output. A reader that went away (`revenant rules list | head -1`)
/// ends the command quietly with 0; any other failure is reported, exit code 2.
pub fn write_stdout(text: &[u8]) -> ExitCode {
    let mut out = std::io::stdout().lock();
    match out.write_all(text).and_then(|()| out.flush()) {
        Ok(()) => Exit::Success.into(),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Exit::Success.into(),
        Err(e) => {
            crate::telemetry::console::error(&format!("writing to standard output: {e}"));
            Exit::Usage.into()
        }
    }
}
