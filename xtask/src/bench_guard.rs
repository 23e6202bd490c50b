//! `cargo xtask bench-guard --baseline COMMIT`: what a change costs, against a
//! baseline commit, measured the same way on both builds in one sitting.
//!
//! The baseline is checked out in a git worktree of its own under `target/bench-guard/` and built
//! there with its own target directory (so neither build invalidates the other's); the candidate
//! is this working tree, built with the usual `target/`. The worktree stays for the next run
//! (a later run moves it to its commit; `git worktree remove` it when done). Then, per build:
//! - the engine's instructions per event: `engine_profile` under callgrind, counting only inside
//!   `Checker::observe` (deterministic, so one run each is the figure);
//! - `revenant check` on one generated replay file (the baseline's generator: a newer build reads
//!   what an older one wrote), CPU seconds and wall seconds per run, the two builds alternated
//!   round by round so that the machine's drift falls on both alike;
//! - the OTLP pipeline: each build's `otlp_load` bench against the `revenant run` built beside it,
//!   spans per second acknowledged and revenant's CPU seconds per million spans, the builds
//!   alternated the same way.
//!
//! It prints each figure with its ratio, candidate over baseline. It is a benchmark, not a test:
//! `cargo xtask test` does not run it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, anyhow, bail, ensure};
use clap::Args;

use crate::cargo;

/// The function callgrind counts in (and below): the engine's one per-event entry point.
const OBSERVE: &str = "revenant::engine::check::Checker::observe";

#[derive(Debug, Args, PartialEq)]
pub struct BenchGuardArgs {
    /// The commit (or any revision git knows) to compare against.
    #[arg(long)]
    pub baseline: String,
    /// Attempts of the synthetic workload `engine_profile` runs under callgrind (ten events each).
    #[arg(long, default_value_t = 100_000)]
    pub attempts: u64,
    /// Attempts in the replay file `revenant check` reads (0: skip the replay measurement).
    #[arg(long, default_value_t = 100_000)]
    pub replay_attempts: u64,
    /// Rounds of the replay measurement; each round runs the baseline, then the candidate.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Seconds each `otlp_load` run measures, after its 3 s warm-up (0: skip the OTLP
    /// measurement).
    #[arg(long, default_value_t = 10)]
    pub otlp_seconds: u64,
    /// Rules left out of both builds' engine runs (`REVENANT_BENCH_DISABLE`), e.g. to measure
    /// what some rules cost.
    #[arg(long, default_value = "")]
    pub disable: String,
    /// Fail (exit 1) when the candidate's instructions per event exceed the baseline's by more
    /// than this ratio, e.g. 1.10.
    #[arg(long)]
    pub fail_above: Option<f64>,
}

/// One build's binaries.
struct Build {
    name: &'static str,
    profile: PathBuf,
    gen_events: PathBuf,
    revenant: PathBuf,
    /// The `otlp_load` bench executable (it starts the `revenant` built beside it).
    otlp_load: PathBuf,
}

pub fn run(args: &BenchGuardArgs) -> Result<()> {
    ensure!(args.attempts > 0, "--attempts must be at least 1");
    ensure!(args.rounds > 0, "--rounds must be at least 1");
    which("valgrind")?;
    let root = test_harness::workspace_root().canonicalize()?;
    let commit = git(
        &root,
        &[
            "rev-parse",
            "--verify",
            &format!("{}^{{commit}}", args.baseline),
        ],
    )
    .with_context(|| format!("--baseline {}: not a commit", args.baseline))?;
    let short = &commit[..commit.len().min(10)];
    let guard_dir = root.join("target/bench-guard");
    let tree = guard_dir.join(format!("tree-{short}"));
    checkout(&root, &tree, &commit)?;
    let baseline = build("baseline", &tree, &guard_dir.join("target"))?;
    let candidate = build("candidate", &root, &root.join("target"))?;
    let head = git(&root, &["rev-parse", "--short", "HEAD"]).unwrap_or_default();
    let dirty = !git(&root, &["status", "--porcelain", "--untracked-files=no"])
        .unwrap_or_default()
        .is_empty();
    println!(
        "bench-guard: baseline {short} against the working tree ({head}{})",
        if dirty { ", uncommitted changes" } else { "" }
    );

    let base = instructions(&baseline, args, &guard_dir)?;
    let cand = instructions(&candidate, args, &guard_dir)?;
    let disabled = if args.disable.is_empty() {
        String::new()
    } else {
        format!(", without {}", args.disable)
    };
    println!(
        "engine instructions per event (callgrind, {} events, `observe` only{disabled}):",
        cand.events
    );
    print!(
        "{}",
        report_lines("", base.per_event(), cand.per_event(), 1)
    );

    if args.replay_attempts > 0 {
        replay(&baseline, &candidate, args, &guard_dir)?;
    }
    if args.otlp_seconds > 0 {
        otlp(&baseline, &candidate, args)?;
    }

    let ratio = cand.per_event() / base.per_event();
    if let Some(limit) = args.fail_above
        && ratio > limit
    {
        bail!("instructions per event rose by {ratio:.3}x, more than --fail-above {limit}");
    }
    Ok(())
}

/// A detached worktree of `commit` at `tree`, made or moved there.
fn checkout(root: &Path, tree: &Path, commit: &str) -> Result<()> {
    if tree.join(".git").exists() {
        let at = git(tree, &["rev-parse", "HEAD"])?;
        if at == commit {
            return Ok(());
        }
        git(tree, &["checkout", "--quiet", "--detach", commit])?;
        return Ok(());
    }
    // A folder left from a worktree git no longer knows (removed by hand, or a clean that kept
    // it) would make `worktree add` fail: forget stale registrations, then start it afresh.
    git(root, &["worktree", "prune"])?;
    if tree.exists() {
        std::fs::remove_dir_all(tree)?;
    }
    std::fs::create_dir_all(tree.parent().expect("under target/"))?;
    let path = tree.to_str().ok_or_else(|| anyhow!("non-UTF-8 path"))?;
    git(
        root,
        &["worktree", "add", "--quiet", "--detach", path, commit],
    )?;
    Ok(())
}

/// `cargo build --release` of the binaries measured, in `tree` with `target_dir`.
fn build(name: &'static str, tree: &Path, target_dir: &Path) -> Result<Build> {
    eprintln!("bench-guard: building the {name} in {}", tree.display());
    let out = cargo::command()
        .current_dir(tree)
        .env("CARGO_TARGET_DIR", target_dir)
        .args(["build", "--release", "-p", "revenant", "--bin", "revenant"])
        .args(["--example", "engine_profile", "--example", "gen_events"])
        .args(["--bench", "otlp_load"])
        .args(["--message-format", "json-render-diagnostics"])
        .stderr(Stdio::inherit())
        .output()?;
    ensure!(out.status.success(), "building the {name} failed");
    let otlp_load = cargo::executable_of(&out.stdout, "otlp_load")
        .ok_or_else(|| anyhow!("cargo named no otlp_load executable for the {name}"))?;
    let release = target_dir.join("release");
    Ok(Build {
        name,
        profile: release.join("examples/engine_profile"),
        gen_events: release.join("examples/gen_events"),
        revenant: release.join("revenant"),
        otlp_load,
    })
}

/// Instructions counted inside `observe` and the events they were spent on.
#[derive(Debug, PartialEq)]
struct Count {
    instructions: u64,
    events: u64,
}

impl Count {
    fn per_event(&self) -> f64 {
        self.instructions as f64 / self.events.max(1) as f64
    }
}

fn instructions(b: &Build, args: &BenchGuardArgs, dir: &Path) -> Result<Count> {
    eprintln!("bench-guard: callgrind on the {}", b.name);
    let out_file = dir.join(format!("callgrind.{}", b.name));
    let out = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg(format!("--toggle-collect={OBSERVE}"))
        .arg(format!("--callgrind-out-file={}", out_file.display()))
        .arg(&b.profile)
        .args([args.attempts.to_string(), "1".into()])
        .env("REVENANT_BENCH_DISABLE", &args.disable)
        .stderr(Stdio::null())
        .output()?;
    ensure!(out.status.success(), "callgrind on the {} failed", b.name);
    let events = profile_events(&String::from_utf8_lossy(&out.stdout))
        .ok_or_else(|| anyhow!("engine_profile printed no event count"))?;
    let instructions = callgrind_total(&std::fs::read_to_string(&out_file)?)
        .ok_or_else(|| anyhow!("no totals in {}", out_file.display()))?;
    Ok(Count {
        instructions,
        events,
    })
}

/// The event count of `engine_profile`'s first result line ("996200 events in 0.69 s = …").
fn profile_events(stdout: &str) -> Option<u64> {
    stdout
        .lines()
        .find_map(|l| l.split_once(" events in ")?.0.trim().parse().ok())
}

/// The instructions of a callgrind output file: its `totals:` line (or `summary:` in older
/// formats), first event column (`Ir`).
fn callgrind_total(file: &str) -> Option<u64> {
    let line = file
        .lines()
        .find(|l| l.starts_with("totals:"))
        .or_else(|| file.lines().find(|l| l.starts_with("summary:")))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// `measure` run `rounds` times on each build, the baseline first in every round so that the
/// machine's drift falls on both alike; each build's results in order.
fn alternated<T>(
    baseline: &Build,
    candidate: &Build,
    rounds: u32,
    what: &str,
    mut measure: impl FnMut(&Build) -> Result<T>,
) -> Result<[Vec<T>; 2]> {
    let mut results = [Vec::new(), Vec::new()];
    for round in 0..rounds {
        for (i, b) in [baseline, candidate].into_iter().enumerate() {
            eprintln!(
                "bench-guard: {what}, round {}/{rounds}, {}",
                round + 1,
                b.name
            );
            results[i].push(measure(b)?);
        }
    }
    Ok(results)
}

/// `revenant check` on one generated file, the builds alternated per round; CPU seconds (user +
/// system of the child) and wall seconds per run, the median of each build's. Both matter:
/// `check` decodes on threads of its own, so wall time falls where CPU time does not.
fn replay(baseline: &Build, candidate: &Build, args: &BenchGuardArgs, dir: &Path) -> Result<()> {
    let file = dir.join(format!("events-{}.jsonl", args.replay_attempts));
    let out = Command::new(&baseline.gen_events)
        .arg(args.replay_attempts.to_string())
        .output()?;
    ensure!(out.status.success(), "gen_events failed");
    let events = out.stdout.iter().filter(|&&b| b == b'\n').count() as u64;
    std::fs::write(&file, &out.stdout)?;
    let runs = alternated(baseline, candidate, args.rounds, "revenant check", |b| {
        child_usage(
            Command::new(&b.revenant)
                .arg("check")
                .arg("--events")
                .arg(&file)
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        )
    })?;
    let [base, cand] = runs.map(|v| {
        let (mut cpu, mut wall): (Vec<f64>, Vec<f64>) =
            v.iter().map(|u| (u.cpu_s, u.wall_s)).unzip();
        (median(&mut cpu), median(&mut wall))
    });
    println!(
        "revenant check, {events}-event file, {} rounds alternated (median):",
        args.rounds
    );
    let rate = |s: f64| events as f64 / s;
    println!(" events per CPU second:");
    print!("{}", report_lines("", rate(base.0), rate(cand.0), 0));
    println!(" events per second (wall):");
    print!("{}", report_lines("", rate(base.1), rate(cand.1), 0));
    Ok(())
}

/// One `otlp_load` run's figures.
#[derive(Debug, PartialEq)]
struct OtlpRun {
    spans_per_s: f64,
    cpu_s_per_million: f64,
}

/// Each build's `otlp_load` against its own `revenant run`, alternated per round; the medians of
/// spans/s acknowledged and of revenant's CPU seconds per million spans.
fn otlp(baseline: &Build, candidate: &Build, args: &BenchGuardArgs) -> Result<()> {
    let runs = alternated(baseline, candidate, args.rounds, "otlp_load", |b| {
        let out = Command::new(&b.otlp_load)
            .args(["--bench", "--seconds", &args.otlp_seconds.to_string()])
            .stderr(Stdio::null())
            .output()?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        ensure!(
            out.status.success(),
            "otlp_load of the {} failed ({}):\n{stdout}",
            b.name,
            out.status
        );
        otlp_figures(&stdout)
            .ok_or_else(|| anyhow!("otlp_load of the {} printed no figures:\n{stdout}", b.name))
    })?;
    let [base, cand] = runs.map(|v| {
        let (mut rate, mut cpu): (Vec<f64>, Vec<f64>) = v
            .iter()
            .map(|r| (r.spans_per_s, r.cpu_s_per_million))
            .unzip();
        (median(&mut rate), median(&mut cpu))
    });
    println!(
        "OTLP (otlp_load, {} s measured per run, {} rounds alternated, median):",
        args.otlp_seconds, args.rounds
    );
    println!(" spans/s acknowledged:");
    print!("{}", report_lines("", base.0, cand.0, 0));
    println!(" revenant CPU s per million spans:");
    print!("{}", report_lines("", base.1, cand.1, 2));
    Ok(())
}

/// The figures of `otlp_load`'s report: "sustained: N spans/s acknowledged" and "… = X CPU s
/// per million spans".
fn otlp_figures(stdout: &str) -> Option<OtlpRun> {
    let spans_per_s = stdout.lines().find_map(|l| {
        let rest = l.trim_start().strip_prefix("sustained:")?;
        rest.split_whitespace().next()?.parse().ok()
    })?;
    let cpu_s_per_million = stdout.lines().find_map(|l| {
        let (before, _) = l.split_once(" CPU s per million spans")?;
        before.rsplit(' ').next()?.parse().ok()
    })?;
    Some(OtlpRun {
        spans_per_s,
        cpu_s_per_million,
    })
}

/// What one run of a child cost.
struct Usage {
    /// User + system.
    cpu_s: f64,
    /// From spawn to exit.
    wall_s: f64,
}

/// Runs `cmd` and returns the CPU seconds (user + system) and wall seconds it used. `revenant
/// check` exits 1 when it found violations, which the workload has: any exit counts, a signal
/// does not.
fn child_usage(cmd: &mut Command) -> Result<Usage> {
    let start = std::time::Instant::now();
    let child = cmd.spawn()?;
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `pid` is our child, not waited for yet (std's `Child` only reaps in `wait`, which
    // is never called); wait4 writes the exit status and a whole `rusage` into buffers we own.
    let reaped = unsafe { libc::wait4(pid, &mut status, 0, usage.as_mut_ptr()) };
    ensure!(reaped == pid, "wait4: {}", std::io::Error::last_os_error());
    ensure!(
        libc::WIFEXITED(status),
        "revenant check died (wait status {status})"
    );
    // SAFETY: wait4 succeeded, so it filled the buffer (zeroed before in any case).
    let usage = unsafe { usage.assume_init() };
    Ok(Usage {
        cpu_s: tv_s(usage.ru_utime) + tv_s(usage.ru_stime),
        wall_s: start.elapsed().as_secs_f64(),
    })
}

fn tv_s(t: libc::timeval) -> f64 {
    t.tv_sec as f64 + t.tv_usec as f64 / 1e6
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The two lines of one figure: the baseline's, then the candidate's with the ratio (and the
/// change in per cent) beside it.
fn report_lines(unit: &str, base: f64, cand: f64, decimals: usize) -> String {
    let ratio = cand / base;
    format!(
        "  baseline   {base:>14.decimals$}{unit}\n  candidate  {cand:>14.decimals$}{unit}   ratio {ratio:.3} ({:+.1} %)\n",
        (ratio - 1.0) * 100.0
    )
}

fn git(dir: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new("git").current_dir(dir).args(args).output()?;
    ensure!(
        out.status.success(),
        "git {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}

fn which(program: &str) -> Result<()> {
    let found = Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    ensure!(found, "{program} not found (apt-get install {program})");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: BenchGuardArgs,
    }

    fn parse(argv: &[&str]) -> Result<BenchGuardArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("bench-guard").chain(argv.iter().copied()))
            .map(|c| c.args)
    }

    #[test]
    fn arguments() {
        let a = parse(&["--baseline", "98e4490"]).unwrap();
        assert_eq!(
            a,
            BenchGuardArgs {
                baseline: "98e4490".into(),
                attempts: 100_000,
                replay_attempts: 100_000,
                rounds: 3,
                otlp_seconds: 10,
                disable: String::new(),
                fail_above: None,
            }
        );
        let a = parse(&[
            "--baseline",
            "main",
            "--attempts",
            "1000",
            "--replay-attempts",
            "0",
            "--rounds",
            "5",
            "--disable",
            "room-collision,stranded-kv",
            "--fail-above",
            "1.1",
        ])
        .unwrap();
        assert_eq!(
            (a.attempts, a.replay_attempts, a.rounds, a.fail_above),
            (1000, 0, 5, Some(1.1))
        );
        assert_eq!(a.disable, "room-collision,stranded-kv");
        assert!(parse(&[]).is_err(), "the baseline is required");
        assert!(parse(&["--baseline", "x", "--attempts", "many"]).is_err());
    }

    #[test]
    fn reads_callgrind_and_profile_output() {
        let file = "# callgrind format\nversion: 1\nevents: Ir\nfn=(1) x\n3 5\nsummary: 1234\ntotals: 2568201234\n";
        assert_eq!(callgrind_total(file), Some(2_568_201_234));
        assert_eq!(callgrind_total("events: Ir\nsummary: 77\n"), Some(77));
        assert_eq!(callgrind_total("events: Ir\n"), None);
        let stdout = "996200 events in 0.694 s = 1435446 events/s wall, 1500000 events per CPU second, 1000 violations\n";
        assert_eq!(profile_events(stdout), Some(996_200));
        assert_eq!(profile_events("nothing\n"), None);
    }

    #[test]
    fn reads_otlp_load_and_cargo_output() {
        let report = "otlp_load: 4 connections, 1000 spans/export, channel capacity 16, 10 s measured after 3 s warmup\n  sustained:          326412 spans/s acknowledged (3264120 spans total)\n  refused (retried):  12 UNAVAILABLE answers\n  revenant CPU:       16.12 s over 10.0 s = 4.94 CPU s per million spans\n  generator CPU:      5.00 s (same machine, shares the cores)\n";
        assert_eq!(
            otlp_figures(report),
            Some(OtlpRun {
                spans_per_s: 326_412.0,
                cpu_s_per_million: 4.94,
            })
        );
        assert_eq!(otlp_figures("otlp_load: nothing measured\n"), None);
        let messages = concat!(
            r#"{"reason":"compiler-artifact","target":{"name":"revenant","kind":["bin"]},"executable":"/t/release/revenant"}"#,
            "\n",
            r#"{"reason":"compiler-artifact","target":{"name":"otlp_load","kind":["bench"]},"executable":"/t/release/deps/otlp_load-0123abcd"}"#,
            "\n",
            r#"{"reason":"build-finished","success":true}"#,
            "\n"
        );
        assert_eq!(
            cargo::executable_of(messages.as_bytes(), "otlp_load"),
            Some(PathBuf::from("/t/release/deps/otlp_load-0123abcd"))
        );
        assert_eq!(
            cargo::executable_of(messages.as_bytes(), "gen_events"),
            None
        );
    }

    #[test]
    fn ratios() {
        let c = Count {
            instructions: 2_578_000,
            events: 1000,
        };
        assert_eq!(c.per_event(), 2578.0);
        // A 10 % rise shows as such.
        let lines = report_lines("", 2000.0, 2200.0, 1);
        assert_eq!(
            lines,
            "  baseline           2000.0\n  candidate          2200.0   ratio 1.100 (+10.0 %)\n"
        );
        assert!(report_lines("", 1.0e6, 0.9e6, 0).contains("ratio 0.900 (-10.0 %)"));
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
