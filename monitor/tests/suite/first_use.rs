//! What an operator meets in a first half hour with `revenant`, through the real binary: the
//! build it says it is, help and flags that mean what they say, `check` over per-node recordings
//! and over whatever file it is given, blindness that shows in `/readyz`, `/metrics` and the log,
//! and the commands for CI (`config validate`, `rules validate`, `completions`).

use crate::support;

use std::collections::BTreeSet;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use support::*;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_revenant"))
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn scenario(name: &str) -> PathBuf {
    root().join("tests/scenarios").join(name)
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Polls `f` every 50 ms until it returns `Some`, at most `timeout`.
fn wait_until<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Each violation line as (rule, fingerprint), sorted.
fn verdicts(stdout: &str) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = stdout
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["rule"].as_str().unwrap().to_owned(),
                v["fingerprint"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    v.sort();
    v
}

fn check(args: &[&Path]) -> Output {
    bin().arg("check").args(args).output().unwrap()
}

#[test]
fn the_license_file_is_the_apache_license_cargo_toml_names() {
    let license = std::fs::read_to_string(root().join("LICENSE")).expect("a LICENSE file");
    assert!(
        license.trim_start().starts_with("Apache License")
            && license.contains("Version 2.0, January 2004"),
        "{}",
        &license[..200.min(license.len())]
    );
    let cargo = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    assert!(cargo.contains("license = \"Apache-2.0\""), "{cargo}");
}

#[test]
fn version_names_the_commit_the_build_date_the_compiler_and_the_ebpf_object() {
    let o = bin().arg("--version").output().unwrap();
    let (out, _) = text(&o);
    assert_eq!(o.status.code(), Some(0));
    assert!(
        out.starts_with(&format!("revenant {}", env!("CARGO_PKG_VERSION"))),
        "{out}"
    );
    let field = |k: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(k))
            .unwrap_or_else(|| panic!("no {k} in {out}"))
            .trim()
            .to_owned()
    };
    let commit = field("commit:");
    if let Ok(head) = Command::new("git")
        .arg("-C")
        .arg(root())
        .args(["rev-parse", "HEAD"])
        .output()
        && head.status.success()
    {
        let head = String::from_utf8_lossy(&head.stdout).trim().to_owned();
        assert!(commit.starts_with(&head), "{commit} is not HEAD {head}");
    }
    assert!(field("built:").len() >= 20, "{out}");
    assert!(field("rustc:").starts_with("rustc "), "{out}");
    let ebpf = field("ebpf object:");
    assert!(
        ebpf.starts_with("sha256:") && ebpf.len() == "sha256:".len() + 64,
        "a default build embeds the kernel programs: {ebpf}"
    );
}

/// One recording split per node (router and prefill on one, decode and the KV transfer on the
/// other) gives the verdicts of the whole recording, whichever order the files come in; each
/// evidence event names the file it was read from.
#[test]
fn per_node_recordings_give_the_verdicts_of_the_whole_in_any_order() {
    let dir = tempfile::tempdir().unwrap();
    for name in [
        "pair-ends-together",
        "orphaned-and-stuck",
        "stranded-kv",
        "smg-prefill-400-decode-alive",
    ] {
        let whole = scenario(&format!("{name}.jsonl"));
        let (a, b) = (
            dir.path().join(format!("{name}.router-prefill.jsonl")),
            dir.path().join(format!("{name}.decode.jsonl")),
        );
        let (mut fa, mut fb) = (
            std::fs::File::create(&a).unwrap(),
            std::fs::File::create(&b).unwrap(),
        );
        for line in std::fs::read_to_string(&whole).unwrap().lines() {
            let t = line.trim();
            if t.is_empty() || t.starts_with('#') {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(t).unwrap();
            let f = match v["stage"].as_str().unwrap() {
                "router" | "prefill" => &mut fa,
                _ => &mut fb,
            };
            writeln!(f, "{t}").unwrap();
        }
        drop((fa, fb));
        let expected = verdicts(&text(&check(&[&whole])).0);
        for order in [[&a, &b], [&b, &a]] {
            let o = check(&[order[0], order[1]]);
            let (out, err) = text(&o);
            assert_eq!(
                verdicts(&out),
                expected,
                "{name}, files in the order {order:?}: {err}"
            );
            for line in out.lines() {
                let v: serde_json::Value = serde_json::from_str(line).unwrap();
                let names: Vec<&str> = v["files"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|f| f.as_str().unwrap())
                    .collect();
                assert!(!names.is_empty(), "{line}");
                for e in v["evidence"].as_array().unwrap() {
                    let file = e["file"].as_str().unwrap();
                    let wanted = if matches!(e["stage"].as_str(), Some("router" | "prefill")) {
                        &a
                    } else {
                        &b
                    };
                    assert_eq!(file, wanted.display().to_string(), "{line}");
                    assert!(names.contains(&file), "{line}");
                }
            }
        }
    }
    // The split shows the difference: router and prefill alone find what has no decode side.
    let alone = check(&[&dir.path().join("orphaned-and-stuck.router-prefill.jsonl")]);
    assert_ne!(
        verdicts(&text(&alone).0),
        verdicts(&text(&check(&[&scenario("orphaned-and-stuck.jsonl")])).0)
    );
}

/// `--per-file`: unrelated recordings in one call, each judged as if checked alone.
#[test]
fn per_file_checks_each_recording_alone() {
    let files: Vec<PathBuf> = [
        "room-collision",
        "stranded-kv",
        "unknown-room",
        "cross-node-skew",
    ]
    .iter()
    .map(|n| scenario(&format!("{n}.jsonl")))
    .collect();
    let mut alone = Vec::new();
    for f in &files {
        alone.extend(verdicts(&text(&check(&[f])).0));
    }
    alone.sort();
    let o = bin()
        .args(["check", "--per-file"])
        .args(&files)
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(verdicts(&out), alone);
    for line in out.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["files"].as_array().unwrap().len(), 1, "{line}");
    }
}

/// `agent` sends no alerts and judges nothing; `checker` listens for no telemetry: what does
/// nothing there is not offered in their help, and is refused (exit 2, one sentence naming the
/// flag and where it belongs) instead of being accepted and ignored.
#[test]
fn agent_and_checker_neither_offer_nor_accept_flags_that_do_nothing_there() {
    let help = |sub: &str| {
        let o = bin().args([sub, "--help"]).output().unwrap();
        assert_eq!(o.status.code(), Some(0));
        text(&o).0
    };
    let agent = help("agent");
    for flag in [
        "--webhook ",
        "--alertmanager ",
        "--group-wait",
        "--rules ",
        "--allowed-lateness",
        "--alerts-jsonl",
    ] {
        assert!(
            !agent.contains(flag),
            "agent --help offers {flag}:\n{agent}"
        );
    }
    for flag in [
        "--nats",
        "--otlp-grpc",
        "--ebpf <MODE>",
        "--replay",
        "--node",
    ] {
        assert!(agent.contains(flag), "agent --help lacks {flag}");
    }
    let checker = help("checker");
    for flag in ["--ebpf", "--otlp-grpc", "--otlp-http", "--watch", "--pid"] {
        assert!(
            !checker.contains(flag),
            "checker --help offers {flag}:\n{checker}"
        );
    }
    for flag in ["--nats", "--webhook", "--rules", "--owned-partitions"] {
        assert!(checker.contains(flag), "checker --help lacks {flag}");
    }
    for (args, needle) in [
        (
            &[
                "agent",
                "--nats",
                "nats://127.0.0.1:1",
                "--webhook",
                "https://hooks.example/x",
                "--group-wait",
                "9s",
            ][..],
            "--webhook has no effect on `revenant agent`: the agent sends no alerts",
        ),
        (
            &["agent", "--rules", "r.yaml"],
            "--rules has no effect on `revenant agent`: the agent judges nothing",
        ),
        (
            &["checker", "--nats", "nats://127.0.0.1:1", "--ebpf", "on"],
            "--ebpf has no effect on `revenant checker`: the checker listens for no telemetry",
        ),
        (
            &["checker", "--otlp-grpc", "127.0.0.1:4317"],
            "--otlp-grpc has no effect on `revenant checker`",
        ),
    ] {
        let o = bin().args(args).stdin(Stdio::null()).output().unwrap();
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "one sentence: {err}");
    }
}

/// A checker whose config file names an eBPF mode (one file for a whole deployment) says
/// nothing about eBPF: it has no source, and no log line blames a flag it was not given.
#[test]
fn a_checker_blames_no_flag_it_was_not_given() {
    let nats = Nats::single().unwrap();
    let dir = ScratchDir::new("first-use-checker").unwrap();
    let config = dir.path().join("deployment.yaml");
    std::fs::write(
        &config,
        "ebpf:\n  mode: auto\n  watch: ['decode=sglang.*']\n",
    )
    .unwrap();
    let bus = cluster::Bus {
        nats: nats.urls(),
        stream: "FIRSTUSE".into(),
        partitions: 1,
    };
    let mut checker = cluster::Member::checker(
        &bus,
        &dir.path().join("checker"),
        &[0],
        &["--config", config.to_str().unwrap()],
    );
    checker.stop();
    let log = std::fs::read_to_string(dir.path().join("checker/stderr")).unwrap();
    assert!(log.contains("\"message\":\"stopped\""), "{log}");
    for needle in ["--ebpf", "eBPF source", "--watch"] {
        assert!(
            !log.contains(needle),
            "{needle} in the checker's log:\n{log}"
        );
    }
}

/// Spans from a service that matches no profile (a custom `OTEL_SERVICE_NAME`) are accepted
/// and not checked: the log says so with the fix, `/readyz` shows the OTLP source degraded,
/// and so does `/metrics`.
#[test]
fn spans_from_a_service_no_profile_knows_are_said_not_swallowed() {
    let mut rv = Revenant::start("first-use-unmapped", &[]);
    let export = r#"{"resourceSpans":[{"resource":{"attributes":[{"key":"service.name","value":{"stringValue":"myllm"}}]},"scopeSpans":[{"scope":{"name":"myllm.tracer"},"spans":[{"traceId":"0102030405060708090a0b0c0d0e0f10","spanId":"0102030405060708","name":"prefill","startTimeUnixNano":"1795986920000000000","endTimeUnixNano":"1795986920100000000"}]}]}]}"#;
    let (code, body) = http_post(
        &format!("http://{}/v1/traces", rv.otlp_http),
        "application/json",
        export.as_bytes(),
    )
    .unwrap();
    assert_eq!(code, 200, "{body}");
    let ready: serde_json::Value = wait_until("/readyz degraded", Duration::from_secs(10), || {
        let (_, body) = admin_get(&rv.admin, "/readyz");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        v["degraded"]["otlp"].is_string().then_some(v)
    });
    let note = ready["degraded"]["otlp"].as_str().unwrap();
    assert!(
        note.starts_with("1 OTLP spans matched no profile"),
        "{ready}"
    );
    assert!(note.contains("normalize.by_service_name"), "{ready}");
    assert_eq!(ready["ready"], true, "degraded, not unready: {ready}");
    let (_, metrics) = admin_get(&rv.admin, "/metrics");
    assert!(
        metrics.contains("revenant_component_degraded{component=\"otlp\"} 1"),
        "{metrics}"
    );
    let warn = wait_until("the WARN", Duration::from_secs(10), || {
        rv.log_text()
            .lines()
            .find(|l| l.contains("WARN") && l.contains("matches no profile"))
            .map(str::to_owned)
    });
    assert!(
        warn.contains("by_service_name")
            && warn.contains("spans=1")
            && warn.contains("service=myllm")
            && warn.contains("scope=myllm.tracer"),
        "{warn}"
    );
    assert!(rv.stop().success(), "{}", rv.stderr());
}

/// A `run` with no source at all (OTLP off, eBPF off) is not ready: `/readyz` answers 503 with
/// the reason, `revenant_ready` is 0, the log says it at ERROR. It also shows what it is built
/// from, its process, series at 0 before their first use, a 400 for a rule filter that names no
/// rule, and round figures in its start-up log and summary.
#[test]
fn a_run_that_sees_nothing_is_not_ready() {
    let mut rv = Revenant::start(
        "first-use-blind",
        &["--otlp-grpc", "off", "--otlp-http", "off"],
    );
    let (code, body) = admin_get(&rv.admin, "/readyz");
    assert_eq!(code, 503, "{body}");
    let ready: serde_json::Value = serde_json::from_str(&body).unwrap();
    let why = ready["down"]["sources"]
        .as_str()
        .unwrap_or_else(|| panic!("{body}"));
    assert!(
        why.contains("--otlp-grpc off --otlp-http off") && why.contains("--ebpf off"),
        "{why}"
    );
    assert_eq!(ready["expected_sources"], serde_json::json!([]), "{body}");
    let (_, metrics) = admin_get(&rv.admin, "/metrics");
    for needle in [
        "revenant_ready 0",
        "revenant_sources_live 0",
        "revenant_component_down{component=\"sources\"} 1",
        "revenant_build_info{version=\"",
        "revision=\"",
        "ebpf_sha256=\"",
        "process_resident_memory_bytes ",
        "process_open_fds ",
        "process_start_time_seconds ",
        "process_cpu_seconds_total ",
        "revenant_alerts_findings_merged_total{rule=\"orphaned-leg\",outcome=\"pending\"} 0",
    ] {
        assert!(metrics.contains(needle), "{needle} missing in\n{metrics}");
    }
    // A filter on a rule that does not exist is a mistake, said with the rules' names.
    let (code, body) = admin_get(&rv.admin, "/api/violations?rule=nope");
    assert_eq!(code, 400, "{body}");
    let error: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(
        error["error"]
            .as_str()
            .unwrap()
            .starts_with("unknown rule \"nope\": the rules are activity-after-rejection,"),
        "{body}"
    );
    let (code, body) = admin_get(&rv.admin, "/api/violations?rule=orphaned-leg");
    assert_eq!(code, 200, "{body}");
    let log = rv.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("ERROR") && l.contains("no source: revenant sees nothing")),
        "{log}"
    );
    let plan = log
        .lines()
        .find(|l| l.contains("memory budget split"))
        .unwrap();
    let attempts = plan
        .split_whitespace()
        .find_map(|w| w.strip_prefix("attempts_mib="))
        .unwrap();
    assert!(
        attempts.split('.').nth(1).is_none_or(|d| d.len() <= 1),
        "{plan}"
    );
    assert!(rv.stop().success(), "{}", rv.stderr());
    assert!(rv.log_text().contains("0 events checked, 0 violations;"));
}

/// An empty input is not a clean one: `check` says no event was read and exits 3 (the README's
/// exit-code table has the column).
#[test]
fn an_empty_input_says_so_and_exits_3() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "# only a comment\n\n").unwrap();
    let o = check(&[&empty]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert_eq!(out, "");
    assert!(err.contains("warning: no events read"), "{err}");
    let mut child = bin()
        .args(["check", "-"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdin.take());
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(3), "{:?}", text(&o));
    // One empty recording among others: said, and the verdicts are the others'.
    let o = check(&[&empty, &scenario("smg-prefill-400-decode-alive.jsonl")]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("no events read from {}", empty.display())),
        "{err}"
    );
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let table = readme.split("## Exit codes").nth(1).unwrap();
    assert!(table.contains("| command | 0 | 1 | 2 | 3 |"), "{table}");
    let row = table
        .lines()
        .find(|l| l.starts_with("| `check` |"))
        .unwrap();
    assert!(
        row.trim_end()
            .trim_end_matches('|')
            .trim_end()
            .ends_with("no event read"),
        "{row}"
    );
}

/// Random bytes: one line saying the file is not JSON Lines (not one error per line); a gzip
/// recording is read as the plain one; a file of bad lines shows ten and counts the rest.
#[test]
fn binary_gzip_and_garbage_inputs_get_bounded_answers() {
    let dir = tempfile::tempdir().unwrap();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let random: Vec<u8> = (0..2_000_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let bin_file = dir.path().join("g2.bin");
    std::fs::write(&bin_file, &random).unwrap();
    let o = check(&[&bin_file]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("not a JSON Lines file"), "{err}");

    let plain = scenario("smg-prefill-400-decode-alive.jsonl");
    let gz = dir.path().join("oc.jsonl.gz");
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(&std::fs::read(&plain).unwrap()).unwrap();
    std::fs::write(&gz, enc.finish().unwrap()).unwrap();
    let (o_gz, o_plain) = (check(&[&gz]), check(&[&plain]));
    assert_eq!(o_gz.status.code(), Some(1), "{:?}", text(&o_gz));
    assert_eq!(verdicts(&text(&o_gz).0), verdicts(&text(&o_plain).0));

    let garbage = dir.path().join("garbage.jsonl");
    std::fs::write(&garbage, "not json\n".repeat(50)).unwrap();
    let o = check(&[&garbage]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.matches(": line ").count(), 10, "{err}");
    assert!(err.contains("…and 40 more bad lines (not shown)"), "{err}");
    assert!(err.contains("50 bad lines skipped"), "{err}");
}

/// A line over `--max-line-bytes` is skipped with an error saying so (and the next line read),
/// instead of being held in memory whole.
#[test]
fn a_line_over_the_bound_is_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("long.jsonl");
    let rid = "a".repeat(100 * 1024);
    std::fs::write(
        &f,
        format!(
            "{{\"time_unix_nano\":1,\"stage\":\"prefill\",\"kind\":\"rejected\",\"ids\":{{\"rid\":\"{rid}\"}},\"status\":400}}\n\
             {{\"time_unix_nano\":2,\"stage\":\"router\",\"kind\":\"received\",\"ids\":{{\"request_id\":\"r\"}}}}\n"
        ),
    )
    .unwrap();
    let o = bin()
        .args(["check", "--stats", "--max-line-bytes", "64KiB"])
        .arg(&f)
        .output()
        .unwrap();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!(
            "{}: line 1: longer than 65536 bytes (--max-line-bytes)",
            f.display()
        )),
        "{err}"
    );
    assert!(
        err.contains("revenant: 1 event ("),
        "the next line is read: {err}"
    );
    // The default bound (1 MiB) takes it.
    let o = check(&[&f]);
    assert_eq!(o.status.code(), Some(0), "{:?}", text(&o));
}

/// `revenant check tests/scenarios/*.jsonl` reads events only (the expected verdicts are not
/// `.jsonl`), and a file of violations given as events says what it is.
#[test]
fn the_scenario_glob_reads_events_only_and_violations_say_what_they_are() {
    let mut events: Vec<PathBuf> = std::fs::read_dir(root().join("tests/scenarios"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
        .collect();
    events.sort();
    assert!(events.len() >= 20);
    let o = bin()
        .args(["check", "--per-file"])
        .args(&events)
        .output()
        .unwrap();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(!err.contains("bad line"), "{err}");
    let expected = scenario("smg-prefill-400-decode-alive.expected");
    let o = check(&[&expected]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("this is a violation (what `revenant check` prints) or an expected verdict"),
        "{err}"
    );
}

#[test]
fn completions_are_printed_for_every_shell() {
    for (shell, needle) in [
        ("bash", "_revenant()"),
        ("zsh", "#compdef revenant"),
        ("fish", "complete -c revenant"),
        ("elvish", "revenant"),
        ("powershell", "revenant"),
    ] {
        let o = bin().args(["completions", shell]).output().unwrap();
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(0), "{shell}: {err}");
        assert!(
            out.contains(needle),
            "{shell}: {}",
            &out[..out.len().min(300)]
        );
        for sub in ["check", "run", "agent", "checker", "rules", "config"] {
            assert!(out.contains(sub), "{shell} completes no {sub}");
        }
    }
    let o = bin().args(["completions", "tcsh"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
}

/// For CI: `config validate` loads everything `run` would (no port, no probe) and says what it
/// would run, or why not, exit 2; `rules validate` checks rules files on their own.
#[test]
fn config_and_rules_validate_for_ci() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("revenant.yaml");
    std::fs::write(
        &cfg,
        "otlp:\n  grpc: 127.0.0.1:14317\n  http: null\nnormalize:\n  by_service_name: {myllm: sglang}\n",
    )
    .unwrap();
    let o = bin()
        .args(["config", "validate", "--ebpf", "off", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(out.starts_with("configuration valid\n"), "{out}");
    assert!(out.contains("grpc 127.0.0.1:14317, http off"), "{out}");
    let defaults = revenant::RuleSet::embedded_defaults().rules.len();
    assert!(
        out.contains(&format!("rules:   {defaults} enabled")),
        "{out}"
    );
    // Nothing was bound: the port is free.
    std::net::TcpListener::bind("127.0.0.1:14317").expect("config validate bound no port");

    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "otlp:\n  grcp: 127.0.0.1:1\n").unwrap();
    let o = bin()
        .args(["config", "validate", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("grcp"), "{err}");
    let o = bin()
        .args(["config", "validate", "--for", "checker", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(!out.contains("otlp:"), "a checker has no sources: {out}");

    let good = dir.path().join("rules.yaml");
    std::fs::write(
        &good,
        "rules:\n  - name: stuck-attempt\n    enabled: false\n",
    )
    .unwrap();
    let broken = dir.path().join("broken.yaml");
    std::fs::write(
        &broken,
        "rules:\n  - name: orphaned-leg\n    enabeld: false\n",
    )
    .unwrap();
    let o = bin()
        .args(["rules", "validate"])
        .arg(&good)
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(
        out.contains(&format!(
            "valid: {defaults} rules, {} enabled, fingerprint ",
            defaults - 1
        )),
        "{out}"
    );
    let o = bin()
        .args(["rules", "validate"])
        .arg(&good)
        .arg(&broken)
        .output()
        .unwrap();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("enabeld") && err.contains("line 3"), "{err}");
}

/// `--log-level` wins over `RUST_LOG` and `REVENANT_LOG` (a stray variable in a base image does
/// not silence what the command line asks for); without the flag the variable applies.
#[test]
fn the_log_level_flag_wins_over_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let not_a_dir = dir.path().join("spool-is-a-file");
    std::fs::write(&not_a_dir, "").unwrap();
    let run = |flag: Option<&str>| {
        let mut c = bin();
        c.args([
            "run",
            "--ebpf",
            "off",
            "--otlp-grpc",
            "off",
            "--otlp-http",
            "off",
        ])
        .args(["--admin", "127.0.0.1:0", "--spool-dir"])
        .arg(&not_a_dir)
        .env("RUST_LOG", "error")
        .env("REVENANT_LOG", "error");
        if let Some(l) = flag {
            c.args(["--log-level", l]);
        }
        let o = c.output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
        text(&o).1
    };
    assert!(run(Some("info")).contains("memory budget split"));
    assert!(!run(None).contains("memory budget split"));
}

/// `rules list` prints each description whole (a terminal wraps it, a pipe keeps it), and
/// `--yaml` only the fields a rule has.
#[test]
fn rules_list_prints_whole_descriptions() {
    let o = bin().args(["rules", "list"]).output().unwrap();
    let (out, _) = text(&o);
    let unknown = out.lines().find(|l| l.starts_with("unknown-room")).unwrap();
    assert!(!unknown.ends_with("..."), "{unknown}");
    assert!(unknown.len() > 160, "{unknown}");
    // The YAML names each rule's one shape, not the twelve it does not have.
    let o = bin().args(["rules", "list", "--yaml"]).output().unwrap();
    let (yaml, _) = text(&o);
    assert!(
        yaml.contains("never:"),
        "foreign-bootstrap-writer is a never rule: {yaml}"
    );
    assert!(!yaml.contains(": null"), "{yaml}");
}

/// `run --help` in the groups of `docs/run.md`, value names alike.
#[test]
fn run_help_is_grouped() {
    let o = bin().args(["run", "--help"]).output().unwrap();
    let (out, _) = text(&o);
    let headings: BTreeSet<&str> = out
        .lines()
        .filter(|l| !l.starts_with(' ') && l.ends_with(':'))
        .collect();
    for h in [
        "OTLP source:",
        "eBPF source:",
        "Checker:",
        "Alerts:",
        "Admin server:",
        "Logs:",
    ] {
        assert!(headings.contains(h), "no {h} in {headings:?}");
    }
    assert!(out.contains("--capture-head-bytes <BYTES>"), "{out}");
    let check = text(&bin().args(["check", "--help"]).output().unwrap()).0;
    assert!(check.contains("--clock-skew <DURATION>"), "{check}");
}

/// `check --format text` for a person (detection time, severity, summary); the JSON lines carry
/// `detected_at` as RFC 3339 next to `detected_at_ns`, as alerts do.
#[test]
fn check_prints_text_for_a_person_and_rfc3339_times() {
    let f = scenario("smg-prefill-400-decode-alive.jsonl");
    let json = text(&check(&[&f])).0;
    let first: serde_json::Value = serde_json::from_str(json.lines().next().unwrap()).unwrap();
    let at = first["detected_at"].as_str().unwrap();
    let ns = first["detected_at_ns"].as_u64().unwrap();
    let parsed =
        time::OffsetDateTime::parse(at, &time::format_description::well_known::Rfc3339).unwrap();
    assert_eq!(parsed.unix_timestamp_nanos(), i128::from(ns), "{at}");
    let o = bin()
        .args(["check", "--format", "text"])
        .arg(&f)
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), json.lines().count(), "{out}");
    assert!(
        lines[0].starts_with(&format!("{at} critical activity-after-rejection: ")),
        "{out}"
    );
    assert!(!out.contains('{'), "{out}");
}

/// A config file's error snippet names the file (as a rules file's does), and rule-file shape
/// mistakes say what was expected instead of the parser's state.
#[test]
fn file_errors_name_the_file_and_say_what_was_expected() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("badcfg.yaml");
    std::fs::write(&cfg, "otlp:\n  grpc: 127.0.0.1:1\n  grcp: x\n").unwrap();
    let o = bin()
        .args(["config", "validate", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains(&format!("--> {}:3:3", cfg.display())), "{err}");
    assert!(!err.contains("<input>"), "{err}");
    for (name, yaml, needle) in [
        (
            "scalar.yaml",
            "rules:\n  - name: x\n    description: d\n    severity: warning\n    never:\n      event: [{stage: decode}]\n",
            "expected sequence start (a list is expected here, in brackets: `stage: [decode]`",
        ),
        (
            "empty.yaml",
            "",
            "the file is empty: a rules file is a mapping with a `rules:` list",
        ),
        (
            "no-rules-key.yaml",
            "- name: x\n",
            "(the file must be a mapping with a `rules:` list)",
        ),
    ] {
        let f = dir.path().join(name);
        std::fs::write(&f, yaml).unwrap();
        let o = bin().args(["rules", "validate"]).arg(&f).output().unwrap();
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{name}: {err}");
        assert!(err.contains(needle), "{name}: {err}");
    }
}
