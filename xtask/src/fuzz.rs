//! The fuzz targets (`fuzz/`, cargo-fuzz): a bounded run of each, one after another on one core,
//! failing on the first crash. `cargo xtask test` runs every target for [`TEST_SECONDS`];
//! `cargo xtask fuzz` runs the ones named (all by default) for as long or as many executions as
//! asked, and both print executions, executions per second and corpus size per target.
//!
//! Each target starts from its seeds in `fuzz/corpus/<target>` (kept in the repository) and
//! grows a scratch corpus in `fuzz/work/<target>` (ignored by git), so a run never dirties the
//! tree. A crash leaves its input in `fuzz/artifacts/<target>/` and the command to replay it.
//!
//! `cargo xtask test` runs [`ci`]: every target built once (one cargo invocation), then each
//! built binary run directly, no cargo in between: its corpus replayed (every seed once), then
//! [`CI_RUNS`] executions of fuzzing from it with a fixed seed, so that a run of the same code
//! finds the same thing every time (a crash is never a flake). The long campaigns, with fresh
//! seeds, stay here (`cargo xtask fuzz`).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};

/// Seconds each target runs in `cargo xtask fuzz` by default.
pub const TEST_SECONDS: u64 = 20;

/// Executions each target fuzzes in `cargo xtask test`, after its corpus is replayed: a short
/// run from the corpus (under a second for the stream parsers, about 30 s for `replay_jsonl` and
/// `rules_yaml`, whose inputs are kilobytes of text, at 650–900 executions/s on one core of a
/// slow VM of this kind). The corpus replay is what holds every input ever found; the campaigns
/// that find new ones are `cargo xtask fuzz`'s.
pub const CI_RUNS: u64 = 20_000;

/// libFuzzer's seed in `cargo xtask test`: the same mutations on every run.
const CI_SEED: u64 = 1;

/// How long a run lasts: wall-clock seconds, or a number of executions.
#[derive(Debug, Clone, Copy)]
pub enum Budget {
    Seconds(u64),
    Runs(u64),
}

/// What one run did, from libFuzzer's final statistics.
#[derive(Debug, Clone)]
pub struct Figures {
    pub target: String,
    pub executions: u64,
    pub exec_per_sec: u64,
    pub corpus_inputs: u64,
    pub corpus_bytes: String,
    pub wall_secs: f64,
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the repository root")
        .to_path_buf()
}

/// `cargo +nightly fuzz …` from the repository root, in the environment a shell would give it.
///
/// `cargo` is rustup's proxy (on PATH), not `$CARGO`: only the proxy understands `+nightly`.
/// What `cargo run` set for xtask itself goes: cargo-fuzz builds with the cargo `CARGO` names
/// (the stable one here, which would build the targets with stable rustc), and build scripts
/// that watch `CARGO_PKG_*` (ring's does) would rebuild the whole tree whenever a run from a
/// shell and one from xtask meet in `fuzz/target`.
pub fn cargo_fuzz() -> Command {
    let mut cmd = Command::new("cargo");
    cmd.current_dir(root());
    crate::cargo::scrub(&mut cmd);
    for key in ["CARGO", "RUSTUP_TOOLCHAIN"] {
        cmd.env_remove(key);
    }
    cmd.args(["+nightly", "fuzz"]);
    cmd
}

/// The targets `fuzz/Cargo.toml` declares.
pub fn targets() -> Result<Vec<String>> {
    let out = cargo_fuzz()
        .args(["list", "--fuzz-dir", "fuzz"])
        .stderr(Stdio::inherit())
        .output()
        .context("running `cargo +nightly fuzz list`")?;
    if !out.status.success() {
        bail!("`cargo +nightly fuzz list` failed with {}", out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect())
}

/// The flags every build and run uses. No sanitizer: the code under test is safe Rust (its one
/// `unsafe` read is bounds-checked first), so ASan would halve the executions and find nothing
/// the Rust checks miss; debug assertions and overflow checks are on (cargo-fuzz's default).
const BUILD_FLAGS: [&str; 3] = ["--fuzz-dir", "fuzz", "--sanitizer=none"];

/// Builds every target (one cargo invocation; later runs reuse it).
pub fn build() -> Result<()> {
    build_with(false)
}

/// The profile settings of `cargo xtask test`'s fuzz build: optimization level 1, no ThinLTO
/// across codegen units (as the main build's `ci` profile). Measured on a 2-vCPU VM: the targets
/// build in 206 CPU s against 299 with cargo-fuzz's release profile (223 at level 1 with LTO),
/// and the CI runs (every seed, then 20 000 executions a target) take 32 s against 34; at level 0
/// they build in 134 s but run for 475. The campaigns of `cargo xtask fuzz` keep the release
/// profile: they run for minutes, and executions per second are what they buy.
const CI_PROFILE: [(&str, &str); 2] = [
    ("CARGO_PROFILE_RELEASE_OPT_LEVEL", "1"),
    ("CARGO_PROFILE_RELEASE_LTO", "off"),
];

/// [`build`], for `cargo xtask test` when `ci`: at the lowest CPU priority (beside the tests)
/// and with [`CI_PROFILE`].
fn build_with(ci: bool) -> Result<()> {
    eprintln!("xtask: building the fuzz targets (cargo +nightly fuzz build --sanitizer=none)");
    let mut cmd = cargo_fuzz();
    if ci {
        cmd.envs(CI_PROFILE);
        let args: Vec<std::ffi::OsString> = std::iter::once(cmd.get_program().to_owned())
            .chain(cmd.get_args().map(|a| a.to_owned()))
            .collect();
        let mut niced = Command::new("nice");
        niced.args(["-n", "19"]).args(&args).current_dir(root());
        for (k, v) in cmd.get_envs() {
            match v {
                Some(v) => niced.env(k, v),
                None => niced.env_remove(k),
            };
        }
        cmd = niced;
    }
    let status = cmd
        .arg("build")
        .args(BUILD_FLAGS)
        .status()
        .context("running `cargo +nightly fuzz build`")?;
    if !status.success() {
        bail!("building the fuzz targets failed with {status}");
    }
    Ok(())
}

/// Copies the seeds into the scratch corpus and returns its path.
fn scratch_corpus(target: &str) -> Result<(PathBuf, PathBuf)> {
    let seeds = root().join("fuzz/corpus").join(target);
    let work = root().join("fuzz/work").join(target);
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    for entry in
        std::fs::read_dir(&seeds).with_context(|| format!("reading {}", seeds.display()))?
    {
        let entry = entry?;
        let to = work.join(entry.file_name());
        std::fs::copy(entry.path(), &to)
            .with_context(|| format!("copying {} to {}", entry.path().display(), to.display()))?;
    }
    Ok((work, seeds))
}

/// Runs one target for `budget` on one core; an error when it found a crash (or could not run).
pub fn run(target: &str, budget: Budget) -> Result<Figures> {
    let (work, seeds) = scratch_corpus(target)?;
    let limit = match budget {
        Budget::Seconds(s) => format!("-max_total_time={s}"),
        Budget::Runs(n) => format!("-runs={n}"),
    };
    eprintln!("xtask: fuzz {target} ({limit})");
    let started = Instant::now();
    let out = cargo_fuzz()
        .args(["run", target])
        .args(BUILD_FLAGS)
        .arg(&work)
        .arg(&seeds)
        .args([
            "--",
            &limit,
            "-print_final_stats=1",
            // An input that takes ten seconds is a hang worth failing on.
            "-timeout=10",
            "-rss_limit_mb=2048",
        ])
        .stdout(Stdio::inherit())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("running `cargo +nightly fuzz run {target}`"))?;
    let wall_secs = started.elapsed().as_secs_f64();
    let log = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        // libFuzzer's report: the panic, the backtrace and the artifact path.
        let tail: Vec<&str> = log.lines().rev().take(60).collect();
        for line in tail.into_iter().rev() {
            eprintln!("{line}");
        }
        bail!(
            "fuzz target {target} failed ({}): the input is in fuzz/artifacts/{target}/; \
             replay it with `cargo +nightly fuzz run {target} --sanitizer=none fuzz/artifacts/{target}/<file>`",
            out.status
        );
    }
    figures(target, &log, wall_secs).with_context(|| {
        let tail: Vec<&str> = log.lines().rev().take(20).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        format!(
            "no final statistics in the output of fuzz target {target}; its last lines:\n{}",
            tail.join("\n")
        )
    })
}

/// Reads libFuzzer's `stat::` lines and the corpus of its `DONE` line.
fn figures(target: &str, log: &str, wall_secs: f64) -> Option<Figures> {
    let stat = |name: &str| -> Option<u64> {
        log.lines()
            .find_map(|l| l.strip_prefix(&format!("stat::{name}:")))
            .and_then(|v| v.trim().parse().ok())
    };
    // "#1234	DONE   cov: 567 ft: 890 corp: 12/3456b lim: … exec/s: 789 rss: 45Mb": the last
    // status line, which starts with '#'. The recommended dictionary printed after it quotes
    // input bytes, and those can spell anything (an SSE stream's `[DONE]`, even "corp: ").
    let corp = status_corpus(log)?;
    let (inputs, bytes) = corp.split_once('/')?;
    Some(Figures {
        target: target.to_owned(),
        executions: stat("number_of_executed_units")?,
        exec_per_sec: stat("average_exec_per_sec")?,
        corpus_inputs: inputs.parse().ok()?,
        corpus_bytes: bytes.to_owned(),
        wall_secs,
    })
}

/// The `corp: N/SIZE` field of libFuzzer's last status line (`#<executions>\t<EVENT> …`).
fn status_corpus(log: &str) -> Option<&str> {
    log.lines()
        .rev()
        .filter(|l| {
            l.strip_prefix('#')
                .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
        })
        .find_map(|l| l.split("corp: ").nth(1))
        .and_then(|s| s.split_whitespace().next())
}

/// Runs `targets` (all when empty) one after another and prints a table; stops at the first
/// crash.
pub fn run_all(names: &[String], budget: Budget) -> Result<Vec<Figures>> {
    let all = targets()?;
    let chosen: Vec<String> = if names.is_empty() {
        all
    } else {
        for n in names {
            if !all.contains(n) {
                bail!("no fuzz target {n:?} (there are: {})", all.join(", "));
            }
        }
        names.to_vec()
    };
    build()?;
    let mut done = Vec::new();
    for t in &chosen {
        done.push(run(t, budget)?);
    }
    print_table(&done);
    Ok(done)
}

/// The binary `cargo fuzz build` made for `target` (release, for the host).
fn binary(target: &str) -> Result<PathBuf> {
    let out = Command::new("rustc")
        .arg("-vV")
        .output()
        .context("running rustc -vV")?;
    let host = String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_owned))
        .context("no host in rustc -vV")?;
    let bin = root()
        .join("fuzz/target")
        .join(host)
        .join("release")
        .join(target);
    if !bin.is_file() {
        bail!("{} was not built", bin.display());
    }
    Ok(bin)
}

/// libFuzzer's arguments every run takes: an input that takes ten seconds is a hang worth
/// failing on.
const RUN_FLAGS: [&str; 3] = ["-print_final_stats=1", "-timeout=10", "-rss_limit_mb=2048"];

/// `cargo xtask test`'s fuzz stage: the targets built once (at the lowest CPU priority), then
/// for each, its corpus replayed (`-runs=0`: every seed once) and `runs` executions of fuzzing
/// from [`CI_SEED`], running the built binary directly at the lowest priority. Fails on the first
/// crash.
pub fn ci(runs: u64) -> Result<Vec<Figures>> {
    let all = targets()?;
    build_with(true)?;
    let mut done = Vec::new();
    for t in &all {
        let bin = binary(t)?;
        let (work, seeds) = scratch_corpus(t)?;
        let replay = Command::new("nice")
            .args(["-n", "19"])
            .arg(&bin)
            .arg("-runs=0")
            .args(RUN_FLAGS)
            .arg(&seeds)
            .current_dir(root())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .with_context(|| format!("replaying the corpus of {t}"))?;
        if !replay.status.success() {
            report_crash(t, &String::from_utf8_lossy(&replay.stderr));
            bail!(
                "fuzz target {t}: a seed of fuzz/corpus/{t} fails ({})",
                replay.status
            );
        }
        std::fs::create_dir_all(root().join("fuzz/artifacts").join(t))?;
        let started = Instant::now();
        let out = Command::new("nice")
            .args(["-n", "19"])
            .arg(&bin)
            .arg(format!("-runs={runs}"))
            .arg(format!("-seed={CI_SEED}"))
            .arg(format!("-artifact_prefix=fuzz/artifacts/{t}/"))
            .args(RUN_FLAGS)
            .arg(&work)
            .arg(&seeds)
            .current_dir(root())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .with_context(|| format!("running fuzz target {t}"))?;
        let log = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            report_crash(t, &log);
            bail!(
                "fuzz target {t} failed ({}): the input is in fuzz/artifacts/{t}/; replay it \
                 with `cargo +nightly fuzz run {t} --fuzz-dir fuzz --sanitizer=none \
                 fuzz/artifacts/{t}/<file>`",
                out.status
            );
        }
        let f = figures(t, &log, started.elapsed().as_secs_f64())
            .with_context(|| format!("no final statistics from fuzz target {t}"))?;
        eprintln!(
            "xtask: fuzz {t}: corpus replayed, {} executions in {:.0} s",
            f.executions, f.wall_secs
        );
        done.push(f);
    }
    print_table(&done);
    Ok(done)
}

/// libFuzzer's report of a crash: the panic, the backtrace and the artifact path.
fn report_crash(target: &str, log: &str) {
    eprintln!("xtask: fuzz target {target}:");
    let tail: Vec<&str> = log.lines().rev().take(60).collect();
    for line in tail.into_iter().rev() {
        eprintln!("{line}");
    }
}

pub fn print_table(figures: &[Figures]) {
    println!(
        "{:<14} {:>12} {:>9} {:>8} {:>10} {:>7}",
        "target", "executions", "exec/s", "corpus", "bytes", "wall"
    );
    for f in figures {
        println!(
            "{:<14} {:>12} {:>9} {:>8} {:>10} {:>6.0}s",
            f.target, f.executions, f.exec_per_sec, f.corpus_inputs, f.corpus_bytes, f.wall_secs
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_libfuzzer_final_statistics() {
        let log = "#2	INITED cov: 10 ft: 11 corp: 3/120b exec/s: 0 rss: 40Mb\n\
                   #4096	pulse  cov: 12 ft: 14 corp: 4/130b lim: 4 exec/s: 2048 rss: 41Mb\n\
                   #81920	DONE   cov: 12 ft: 14 corp: 5/141b lim: 4096 exec/s: 4096 rss: 41Mb\n\
                   Done 81920 runs in 20 second(s)\n\
                   stat::number_of_executed_units: 81920\n\
                   stat::average_exec_per_sec:     4096\n\
                   stat::new_units_added:          2\n";
        let f = figures("t", log, 21.0).unwrap();
        assert_eq!(
            (f.executions, f.exec_per_sec, f.corpus_inputs),
            (81920, 4096, 5)
        );
        assert_eq!(f.corpus_bytes, "141b");
    }

    /// The end of a real run's stderr: the DONE status line, then a recommended dictionary whose
    /// entries quote input bytes (here an SSE terminator and a "corp: " look-alike), then stats.
    const LOG: &str = "#2432600\tDONE   cov: 1203 ft: 5120 corp: 2275/481Kb lim: 4096 exec/s: 115838 rss: 85Mb\n\
###### Recommended dictionary. ######\n\
\"data: [DONE]\" # Uses: 580\n\
\"corp: 9/9b\" # Uses: 12\n\
###### End of recommended dictionary. ######\n\
Done 2432600 runs in 21 second(s)\n\
stat::number_of_executed_units: 2432600\n\
stat::average_exec_per_sec:     115838\n\
stat::new_units_added:          1278\n";

    #[test]
    fn figures_come_from_the_status_line_not_the_dictionary() {
        let f = figures("http_stream", LOG, 21.0).expect("figures");
        assert_eq!(f.executions, 2_432_600);
        assert_eq!(f.exec_per_sec, 115_838);
        assert_eq!(f.corpus_inputs, 2275);
        assert_eq!(f.corpus_bytes, "481Kb");
    }

    #[test]
    fn a_log_without_statistics_has_no_figures() {
        assert!(figures("t", "\"DONE\" # Uses: 3\nDone 5 runs in 1 second(s)\n", 1.0).is_none());
    }
}
