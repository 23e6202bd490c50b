//! The `revenant` binary's contract: output, exit codes, error messages.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_revenant"))
}

fn scenario(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/scenarios")
        .join(name)
}

fn tmp(name: &str, content: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("revenant-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, content).unwrap();
    p
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// `revenant check --events <scenario> <extra>`: exit code, violations printed, standard error.
fn check_scenario(name: &str, extra: &[&str]) -> (Option<i32>, Vec<serde_json::Value>, String) {
    let o = bin()
        .args(["check", "--events"])
        .arg(scenario(name))
        .args(extra)
        .output()
        .unwrap();
    let (out, err) = text(&o);
    let lines = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (o.status.code(), lines, err)
}

#[test]
fn check_exits_1_with_violations_as_json_lines() {
    let (code, lines, err) = check_scenario("smg-prefill-400-decode-alive.jsonl", &[]);
    assert_eq!(code, Some(1), "{err}");
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["rule"], "activity-after-rejection");
    assert_eq!(lines[0]["evidence"][0]["role"], "trigger");
}

/// SGLang's rooms span the u64 range: `check` writes them as decimal strings with their hex, so
/// jq and JavaScript keep every digit (they would round a JSON number above 2^53).
#[test]
fn check_writes_rooms_as_decimal_strings_with_hex() {
    let (code, lines, err) = check_scenario("smg-prefill-400-decode-alive.jsonl", &[]);
    assert_eq!(code, Some(1), "{err}");
    assert_eq!(lines.len(), 2);
    for v in &lines {
        assert_eq!(v["attempt"]["bootstrap_room"], "9066467638188682269", "{v}");
        assert_eq!(
            v["attempt"]["bootstrap_room_hex"], "0x7dd29047ddcfac1d",
            "{v}"
        );
        assert_eq!(
            test_harness::notifications::unsafe_numbers(v),
            Vec::<String>::new(),
            "{v}"
        );
    }
}

/// eBPF proves the breach, OTLP proves it again later: one line per (rule, attempt) unless the
/// follow-ups are asked for.
#[test]
fn check_prints_a_corroborated_breach_once() {
    let run = |extra: &[&str]| {
        let (code, lines, err) = check_scenario("corroborated-by-otlp.jsonl", extra);
        assert_eq!(code, Some(1), "{err}");
        (lines, err)
    };
    let (lines, err) = run(&["--stats"]);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["rule"], "activity-after-rejection");
    assert!(lines[0].get("corroborates").is_none());
    assert!(
        err.contains("1 violation, 1 corroborating follow-up"),
        "{err}"
    );
    let (lines, _) = run(&["--corroborations"]);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[1]["corroborates"], true);
    assert_eq!(lines[0]["fingerprint"], lines[1]["fingerprint"]);
}

#[test]
fn check_exits_0_without_violations() {
    let o = bin()
        .args(["check", "--events"])
        .arg(scenario("legit-retry-succeeds.jsonl"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{:?}", text(&o));
    assert!(o.stdout.is_empty());
}

#[test]
fn check_reads_stdin() {
    let mut child = bin()
        .args(["check", "--events", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let events = std::fs::read(scenario("handoff-after-reject-out-of-order.jsonl")).unwrap();
    child.stdin.take().unwrap().write_all(&events).unwrap();
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(String::from_utf8_lossy(&o.stdout).lines().count(), 1);
}

#[test]
fn bad_lines_are_reported_and_the_rest_is_checked() {
    let good =
        std::fs::read_to_string(scenario("handoff-after-reject-out-of-order.jsonl")).unwrap();
    let mut lines: Vec<&str> = good.lines().collect();
    lines.insert(
        2,
        "{\"time_unix_nano\": 1, \"stage\": \"prefil\", \"kind\": \"work\"}",
    );
    lines.insert(4, "garbage");
    let p = tmp("bad.jsonl", &lines.join("\n"));
    let o = bin().args(["check", "--events"]).arg(&p).output().unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("line 3:") && err.contains("prefil"), "{err}");
    assert!(err.contains("line 5:"), "{err}");
    assert_eq!(
        out.lines().count(),
        1,
        "the rest of the file was still checked: {out}"
    );
}

#[test]
fn broken_rules_are_usage_errors_with_position() {
    let p = tmp(
        "rules.yaml",
        "rules:\n  - name: orphaned-leg\n    enabeld: false\n",
    );
    let o = bin()
        .args(["check", "--events"])
        .arg(scenario("legit-retry-succeeds.jsonl"))
        .arg("--rules")
        .arg(&p)
        .output()
        .unwrap();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2));
    assert!(err.contains("enabeld") && err.contains("line 3"), "{err}");
    let o = bin()
        .args(["rules", "list", "--rules"])
        .arg(&p)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn rules_file_can_disable_a_default() {
    let p = tmp(
        "disable.yaml",
        "rules:\n  - name: activity-after-rejection\n    enabled: false\n  - name: activity-after-request-failed\n    enabled: false\n",
    );
    let o = bin()
        .args(["check", "--events"])
        .arg(scenario("smg-prefill-400-decode-alive.jsonl"))
        .arg("--rules")
        .arg(&p)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{:?}", text(&o));
    let o = bin()
        .args(["rules", "list", "--rules"])
        .arg(&p)
        .output()
        .unwrap();
    let (out, _) = text(&o);
    assert!(
        out.lines()
            .any(|l| l.starts_with("activity-after-rejection") && l.contains(" no ")),
        "{out}"
    );
}

#[test]
fn usage_errors_exit_2() {
    assert_eq!(
        bin().args(["check"]).output().unwrap().status.code(),
        Some(2)
    );
    assert_eq!(
        bin()
            .args(["check", "--events", "/nonexistent/x.jsonl"])
            .output()
            .unwrap()
            .status
            .code(),
        Some(2)
    );
    assert_eq!(
        bin()
            .args(["check", "--events", "-", "--clock-skew", "soon"])
            .output()
            .unwrap()
            .status
            .code(),
        Some(2)
    );
}

/// `revenant check … | head -1`: the reader goes away after one line; check stops quietly, 0.
#[test]
fn check_into_a_closed_pipe_exits_0_quietly() {
    let mut events = String::new();
    for i in 0..20_000u64 {
        let t = 1_795_986_920_000_000_000u64 + i * 1_000_000;
        events.push_str(&format!(
            "{{\"time_unix_nano\":{t},\"stage\":\"prefill\",\"kind\":\"rejected\",\"ids\":{{\"bootstrap_room\":{i}}},\"status\":400}}\n\
             {{\"time_unix_nano\":{},\"stage\":\"decode\",\"kind\":\"work\",\"ids\":{{\"bootstrap_room\":{i}}}}}\n",
            t + 1000
        ));
    }
    let file = tmp("many.jsonl", &events);
    let mut child = bin()
        .args(["check", "--events"])
        .arg(&file)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut first).unwrap();
    assert!(first.contains("activity-after-rejection"), "{first}");
    drop(stdout);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.is_empty(), "{err}");
}

#[test]
fn rules_list_into_a_closed_pipe_exits_0() {
    let mut child = bin()
        .args(["rules", "list", "--yaml"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// A file saved with a UTF-8 byte order mark: the mark is skipped, the first line kept.
#[test]
fn check_keeps_the_first_line_after_a_bom() {
    let events = std::fs::read(scenario("smg-prefill-400-decode-alive.jsonl")).unwrap();
    let mut bom = b"\xEF\xBB\xBF".to_vec();
    bom.extend_from_slice(&events);
    let dir = std::env::temp_dir().join(format!("revenant-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("bom.jsonl");
    std::fs::write(&file, bom).unwrap();
    let o = bin()
        .args(["check", "--events"])
        .arg(&file)
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.is_empty(), "{err}");
    assert_eq!(out.lines().count(), 2, "{out}");
}

#[test]
fn rules_errors_carry_line_and_column_and_every_unknown_placeholder() {
    let rules = tmp(
        "r_placeholder.yaml",
        "rules:\n  - name: my-rule\n    description: d\n    severity: warning\n    output: \"{event.node} {foo}\"\n    never_after:\n      trigger: [{kind: [rejected]}]\n      forbidden: [{kind: [work]}]\n",
    );
    let o = bin()
        .args(["rules", "list", "--rules"])
        .arg(&rules)
        .output()
        .unwrap();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("at line 5, column 13: unknown placeholders {event.node}, {foo}"),
        "{err}"
    );
}

/// Every option's long help, keyed by its flag (`--rules`): the text below its header line.
fn long_help(args: &[&str]) -> Vec<(String, String)> {
    let o = bin().args(args).arg("--help").output().unwrap();
    assert_eq!(o.status.code(), Some(0));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let mut options: Vec<(String, String)> = Vec::new();
    for line in out.lines() {
        let t = line.trim_start();
        // Headers are indented 2 (`-h, --help`) or 6 columns; possible values more.
        if line.len() - t.len() <= 6 && line.starts_with("  ") && t.starts_with('-') {
            let flag = t
                .split([' ', ','])
                .find(|w| w.starts_with("--"))
                .unwrap_or(t)
                .to_owned();
            // A short help puts the description on the header line, after two spaces.
            let inline = t.split_once("  ").map_or("", |(_, d)| d.trim());
            options.push((flag, inline.to_owned()));
        } else if let Some((_, text)) = options.last_mut() {
            text.push_str(t);
            text.push(' ');
        }
    }
    options
}

#[test]
fn help_describes_every_flag_and_shows_documented_defaults() {
    for cmd in [&["run"][..], &["check"], &["rules", "list"]] {
        for (flag, text) in long_help(cmd) {
            assert!(!text.trim().is_empty(), "{cmd:?} {flag} has no description");
            assert!(!text.contains("RunConfig"), "{cmd:?} {flag}: {text}");
        }
    }
    let run: std::collections::HashMap<String, String> = long_help(&["run"]).into_iter().collect();
    for (flag, default) in [
        ("--channel-capacity", "1024"),
        ("--max-message-bytes", "8388608"),
        ("--clock-skew", "50ms"),
        ("--allowed-lateness", "15s"),
        ("--drain-timeout", "10s"),
        ("--alertmanager-resend", "1m"),
        ("--spool-max-entries", "10000"),
        ("--rate-limit-window", "1m"),
        ("--otlp-grpc", "127.0.0.1:4317"),
        ("--admin", "127.0.0.1:9464"),
    ] {
        assert!(
            run[flag].contains(&format!("[default: {default}]")),
            "{flag}: {}",
            run[flag]
        );
    }
    assert!(run["--config"].contains("YAML"), "{}", run["--config"]);
    let o = bin().arg("--help").output().unwrap();
    let top = String::from_utf8_lossy(&o.stdout);
    assert!(
        top.contains("eBPF"),
        "the run summary names its sources:\n{top}"
    );
}

#[test]
fn self_traces_sample_ratio_is_range_checked() {
    for bad in ["2", "-0.1", "x"] {
        let o = bin()
            .args(["run", &format!("--self-traces-sample-ratio={bad}")])
            .output()
            .unwrap();
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{bad}: {err}");
        assert!(err.contains("--self-traces-sample-ratio"), "{err}");
    }
}

/// `--pid`/`--watch` with `--ebpf off`, and `--admin 0.0.0.0:P` without `--external-url`, are
/// said at start-up. (The run stops before binding anything: its spool directory is a file.)
#[test]
fn pointless_settings_are_warned_about() {
    let not_a_dir = tmp("not-a-dir", "");
    let o = bin()
        .args([
            "run",
            "--ebpf",
            "off",
            "--pid",
            "999999",
            "--watch",
            "prefill=sglang.*",
        ])
        .args(["--admin", "0.0.0.0:9", "--spool-dir"])
        .arg(&not_a_dir)
        .output()
        .unwrap();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("which is off (--ebpf off): they do nothing"),
        "{err}"
    );
    assert!(
        err.contains("alert links will say http://0.0.0.0:9/…") && err.contains("--external-url"),
        "{err}"
    );
}

/// Files as arguments, several of them: one stream, in order; errors name the file and the
/// column within the line.
#[test]
fn check_takes_several_files_as_one_stream() {
    let rejected = tmp(
        "part1.jsonl",
        "{\"time_unix_nano\":1000,\"stage\":\"prefill\",\"kind\":\"rejected\",\"ids\":{\"bootstrap_room\":7},\"status\":400}\n",
    );
    let worked = tmp(
        "part2.jsonl",
        "{\"time_unix_nano\":2000,\"stage\":\"decode\",\"kind\":\"work\",\"ids\":{\"bootstrap_room\":7}}\n",
    );
    let o = bin()
        .arg("check")
        .arg(&rejected)
        .arg(&worked)
        .arg("--stats")
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(out.lines().count(), 1, "{out}");
    assert!(err.contains("revenant: 2 events ("), "{err}");
    assert!(err.contains("0 bad lines"), "{err}");
    assert!(
        err.contains("1 violation, 0 corroborating follow-ups"),
        "{err}"
    );

    let bad = tmp(
        "bad-status.jsonl",
        "{\"time_unix_nano\":1,\"stage\":\"prefill\",\"kind\":\"rejected\",\"status\":99999}\n",
    );
    let o = bin().args(["check", "-e"]).arg(&bad).output().unwrap();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!(
            "{}: line 1: invalid value: integer `99999`",
            bad.display()
        )),
        "{err}"
    );
    assert!(err.contains("(column "), "{err}");
    assert!(!err.contains("at line 1 column"), "{err}");

    let o = bin().arg("check").output().unwrap();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("no events file"), "{err}");
}

/// `--admin` and `--otlp-*` refuse a host name with the same message, which says what to give.
#[test]
fn listen_addresses_are_refused_alike() {
    for (flag, value) in [
        ("--admin", "localhost:9464"),
        ("--otlp-grpc", "localhost:4317"),
    ] {
        let o = bin()
            .args(["run", "--ebpf", "off", flag, value])
            .output()
            .unwrap();
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(
            err.contains(&format!(
                "\"{value}\" is not a listen address: give IP:PORT"
            )),
            "{flag}: {err}"
        );
        assert!(!err.contains("HOST:PORT"), "{err}");
    }
    // The config file says the same, with the key's position.
    for (name, yaml, value) in [
        (
            "admin-host.yaml",
            "admin:\n  addr: localhost:9464\n",
            "localhost:9464",
        ),
        (
            "otlp-host.yaml",
            "otlp:\n  grpc: localhost:4317\n",
            "localhost:4317",
        ),
    ] {
        let cfg = tmp(name, yaml);
        let o = bin()
            .args(["run", "--ebpf", "off", "--config"])
            .arg(&cfg)
            .output()
            .unwrap();
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(
            err.contains(&format!(
                "\"{value}\" is not a listen address: give IP:PORT"
            )),
            "{name}: {err}"
        );
        assert!(err.contains("line 2"), "{name}: {err}");
    }
    let cfg = tmp(
        "admin-null.yaml",
        "admin:\n  addr: null\notlp:\n  grpc: null\n  http: null\n",
    );
    let o = bin()
        .args(["run", "--ebpf", "off", "--config"])
        .arg(&cfg)
        .arg("--spool-dir")
        .arg(&cfg)
        .output()
        .unwrap();
    let (_, err) = text(&o);
    // null is still "off": the run gets as far as the spool (a file here, so it stops there).
    assert!(err.contains("is not a directory"), "{err}");
}

/// The README has one exit-code table with a row per subcommand, and says what the tests of
/// this crate and `run_cli` check: a port in use is 2, a broken pipe on `check` is 0.
#[test]
fn readme_has_the_exit_code_table() {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"))
            .unwrap();
    let section = readme
        .split("## Exit codes")
        .nth(1)
        .expect("an Exit codes section")
        .split("\n## ")
        .next()
        .unwrap();
    let rows: Vec<&str> = section.lines().filter(|l| l.starts_with("| `")).collect();
    let row = |cmd: &str| {
        rows.iter()
            .find(|r| r.starts_with(&format!("| `{cmd}` |")))
            .unwrap_or_else(|| panic!("no row for {cmd}:\n{section}"))
            .split(" | ")
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let run = row("run");
    assert!(run[3].contains("a port in use"), "{run:?}");
    assert!(run[1].contains("SIGHUP"), "{run:?}");
    let check = row("check");
    assert!(check[1].contains("went away"), "{check:?}");
    assert!(check[2].contains("violations found"), "{check:?}");
    row("rules list");
}

/// An admission whose end the file never shows leaves a deadline open: `--stats` reports it as
/// pending under its rule, and counts in the singular say so.
#[test]
fn stats_report_deadlines_still_open_at_end_of_input() {
    let f = tmp(
        "open-deadline.jsonl",
        "{\"time_unix_nano\":1000000000,\"stage\":\"prefill\",\"kind\":\"admitted\",\"ids\":{\"rid\":\"r1\",\"bootstrap_room\":\"0x10\"}}\n",
    );
    let o = bin().args(["check", "--stats"]).arg(&f).output().unwrap();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let stuck = err
        .lines()
        .find(|l| l.contains("stuck-attempt"))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(
        stuck.ends_with(" 0 (1 deadline still open at end of input: pending)"),
        "{err}"
    );
    assert!(
        err.contains("revenant: 1 deadline pending: the input ends before it can be judged"),
        "{err}"
    );
    assert!(err.contains("revenant: 1 event ("), "{err}");
    assert!(err.contains("revenant: 0 violations,"), "{err}");
    assert!(err.contains("revenant: 1 attempt created,"), "{err}");
    // The same attempt ended: nothing pending.
    let f = tmp(
        "closed-deadline.jsonl",
        "{\"time_unix_nano\":1000000000,\"stage\":\"prefill\",\"kind\":\"admitted\",\"ids\":{\"rid\":\"r1\",\"bootstrap_room\":\"0x10\"}}\n\
         {\"time_unix_nano\":2000000000,\"stage\":\"prefill\",\"kind\":\"completed\",\"ids\":{\"rid\":\"r1\",\"bootstrap_room\":\"0x10\"}}\n",
    );
    let o = bin().args(["check", "--stats"]).arg(&f).output().unwrap();
    let (_, err) = text(&o);
    assert!(!err.contains("pending"), "{err}");
}

/// A rejection that names a reason but no status (or a status but no reason): the summary shows
/// what is known, no `-` placeholder in the parentheses.
#[test]
fn summaries_show_only_the_known_status_and_reason() {
    let f = tmp(
        "no-status.jsonl",
        "{\"time_unix_nano\":1000000000,\"stage\":\"prefill\",\"kind\":\"rejected\",\"ids\":{\"bootstrap_room\":\"0x20\"},\"reason\":\"Input length (6189 tokens) exceeds\"}\n\
         {\"time_unix_nano\":1100000000,\"stage\":\"decode\",\"kind\":\"work\",\"ids\":{\"bootstrap_room\":\"0x20\"}}\n\
         {\"time_unix_nano\":1000000000,\"stage\":\"prefill\",\"kind\":\"rejected\",\"ids\":{\"bootstrap_room\":\"0x21\"},\"status\":400}\n\
         {\"time_unix_nano\":1100000000,\"stage\":\"decode\",\"kind\":\"work\",\"ids\":{\"bootstrap_room\":\"0x21\"}}\n",
    );
    let o = bin().arg("check").arg(&f).output().unwrap();
    let (out, err) = text(&o);
    let summaries: Vec<String> = out
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["summary"].as_str().unwrap().to_owned()
        })
        .filter(|s| s.starts_with("activity-after-rejection"))
        .collect();
    assert_eq!(summaries.len(), 2, "{out}\n{err}");
    assert!(
        summaries
            .iter()
            .any(|s| s.contains("(Input length (6189 tokens) exceeds)")),
        "{summaries:?}"
    );
    assert!(
        summaries.iter().any(|s| s.contains("(400)")),
        "{summaries:?}"
    );
    assert!(
        summaries
            .iter()
            .all(|s| !s.contains("(- ") && !s.contains(" -)")),
        "{summaries:?}"
    );
}

/// Events that name no request or attempt cannot be judged by request or attempt rules: `check`
/// says how many there were instead of passing over them silently.
#[test]
fn check_warns_about_events_that_name_nothing() {
    let file = tmp(
        "no-ids.jsonl",
        "{\"time_unix_nano\":1,\"stage\":\"decode\",\"kind\":\"work\",\"ids\":{}}\n\
         {\"time_unix_nano\":2,\"stage\":\"decode\",\"kind\":\"work\"}\n\
         {\"time_unix_nano\":3,\"stage\":\"decode\",\"kind\":\"work\",\"ids\":{\"rid\":\"r1\"}}\n",
    );
    let o = bin().arg("check").arg(&file).output().unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_eq!(out, "");
    assert!(
        err.contains("warning: 2 events named no request or attempt"),
        "{err}"
    );
    let named = tmp(
        "ids.jsonl",
        "{\"time_unix_nano\":3,\"stage\":\"decode\",\"kind\":\"work\",\"ids\":{\"rid\":\"r1\"}}\n",
    );
    let o = bin().arg("check").arg(&named).output().unwrap();
    let (_, err) = text(&o);
    assert!(!err.contains("named no request"), "{err}");
}
