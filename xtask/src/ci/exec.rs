//! Running one test executable as cargo would (in its package's directory, with cargo's
//! variables), its output to a log file of its own, within a time limit; and the figures of
//! what it took.

use std::io::{BufRead as _, BufReader};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::build::TestExe;

/// How a run ended.
#[derive(Debug, Clone)]
pub struct Ran {
    pub label: String,
    pub ok: bool,
    pub wall: Duration,
    /// CPU seconds (user + system) of the executable and everything it waited for.
    pub cpu: f64,
    pub log: PathBuf,
    /// `test result:` lines and the names of failed tests, for the summary.
    pub result: String,
}

/// What to run and how.
#[derive(Debug, Clone)]
pub struct Invocation<'a> {
    pub exe: &'a TestExe,
    /// Arguments to the test harness (`--ignored`).
    pub args: &'a [String],
    pub env: &'a [(String, PathBuf)],
    /// Runs at the lowest CPU priority (builds that may take what the tests leave).
    pub nice: bool,
    pub limit: Duration,
    pub label: String,
}

pub fn run(inv: &Invocation<'_>, logs: &Path) -> Result<Ran> {
    std::fs::create_dir_all(logs)?;
    let log = logs.join(format!("{}.log", inv.label.replace(['/', ' '], "-")));
    let file =
        std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let mut cmd = if inv.nice {
        let mut c = Command::new("nice");
        c.args(["-n", "19"]).arg(&inv.exe.exe);
        c
    } else {
        Command::new(&inv.exe.exe)
    };
    cmd.args(inv.args)
        .current_dir(&inv.exe.manifest_dir)
        .env("CARGO", super::build::cargo())
        .env("CARGO_MANIFEST_DIR", &inv.exe.manifest_dir)
        .env("CARGO_PKG_NAME", &inv.exe.package)
        .env("CARGO_CRATE_NAME", inv.exe.target.replace('-', "_"))
        .stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .process_group(0);
    for (k, v) in inv.env {
        cmd.env(k, v);
    }
    let started = Instant::now();
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}", inv.exe.exe.display()))?;
    let pid = child.id() as libc::pid_t;
    let deadline = started + inv.limit;
    let (status, cpu) = loop {
        let mut status = 0;
        // SAFETY: an all-zero rusage is valid; wait4 fills it for the child it reaps.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: waits for our own child, without blocking.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        if r == pid {
            let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
            break (status, secs(usage.ru_utime) + secs(usage.ru_stime));
        }
        if r < 0 {
            // Reaped elsewhere (cannot happen: nothing else waits for it).
            let s = child.wait()?;
            break (if s.success() { 0 } else { 1 }, 0.0);
        }
        if Instant::now() > deadline {
            // SAFETY: the group is the executable's own (process_group(0)).
            unsafe { libc::kill(-pid, libc::SIGKILL) };
            let _ = child.wait();
            let ran = finish(inv, &log, false, started.elapsed(), 0.0)?;
            return Ok(Ran {
                result: format!("killed after {:?} (limit)", inv.limit),
                ..ran
            });
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let ok = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
    finish(inv, &log, ok, started.elapsed(), cpu)
}

fn finish(inv: &Invocation<'_>, log: &Path, ok: bool, wall: Duration, cpu: f64) -> Result<Ran> {
    let lines: Vec<String> = std::fs::File::open(log)
        .map(|f| BufReader::new(f).lines().map_while(Result::ok).collect())
        .unwrap_or_default();
    let mut result: Vec<String> = lines
        .iter()
        .filter(|l| l.starts_with("test result:"))
        .cloned()
        .collect();
    // The names libtest lists under the last `failures:`.
    if let Some(at) = lines.iter().rposition(|l| l == "failures:") {
        result.extend(
            lines[at + 1..]
                .iter()
                .take_while(|l| !l.is_empty())
                .filter(|l| l.starts_with("    "))
                .map(|l| l.trim().to_owned()),
        );
    }
    Ok(Ran {
        label: inv.label.clone(),
        ok,
        wall,
        cpu,
        log: log.to_path_buf(),
        result: result.join("; "),
    })
}

/// The last `n` lines of a log.
pub fn tail(log: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
