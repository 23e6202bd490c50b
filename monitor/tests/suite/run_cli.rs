//! The `revenant run` binary's contract: what it validates before it binds a port, its exit codes,
//! its standard error (human and JSON), its signals. Run: `cargo test -p revenant --test suite --
//! run_cli::`.

use crate::support;
use crate::traffic;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use support::*;
use test_harness::notifications::unsafe_numbers;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_revenant"))
}

/// A fresh directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("revenant-run-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Loopback ports this test holds open: a `run` that binds them before it fails its
/// validation reports "Address already in use" instead of the validation error.
struct HeldPorts(Vec<TcpListener>);

impl HeldPorts {
    fn new() -> HeldPorts {
        HeldPorts(
            (0..3)
                .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
                .collect(),
        )
    }

    fn addr(&self, i: usize) -> String {
        self.0[i].local_addr().unwrap().to_string()
    }

    /// `--admin`, `--otlp-grpc`, `--otlp-http` on the held ports.
    fn flags(&self) -> Vec<String> {
        vec![
            "--admin".into(),
            self.addr(0),
            "--otlp-grpc".into(),
            self.addr(1),
            "--otlp-http".into(),
            self.addr(2),
        ]
    }
}

/// `revenant run --ebpf off` with `args` on the held ports; its output once it exited by itself.
fn run_on_held_ports(dir: &Path, args: &[&str]) -> (Option<i32>, String) {
    let held = HeldPorts::new();
    let out: Output = bin()
        .arg("run")
        .args(["--ebpf", "off", "--alerts-jsonl"])
        .arg(dir.join("alerts.jsonl"))
        .args(held.flags())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !err.contains("already in use") && !err.contains("listening"),
        "it bound a port before failing:\n{err}"
    );
    assert!(
        !err.contains("revenant: ready"),
        "it said ready before failing:\n{err}"
    );
    (out.status.code(), err)
}

#[test]
fn a_second_instance_on_the_same_spool_fails_before_binding() {
    let dir = scratch("spool-in-use");
    let spool = dir.join("spool");
    let spool_arg = spool.to_str().unwrap();
    let mut first = Revenant::start("spool-in-use-first", &["--spool-dir", spool_arg]);
    let (code, err) = run_on_held_ports(&dir, &["--spool-dir", spool_arg]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(&format!("spool directory {spool_arg} is in use")),
        "{err}"
    );
    assert!(first.stop().success());
}

#[test]
fn a_spool_dir_that_is_a_file_fails_before_binding_naming_it() {
    let dir = scratch("spool-file");
    let file = dir.join("empty.jsonl");
    std::fs::write(&file, "").unwrap();
    let (code, err) = run_on_held_ports(&dir, &["--spool-dir", file.to_str().unwrap()]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(&format!("{} is not a directory", file.display())),
        "{err}"
    );
}

#[test]
fn a_ready_file_in_a_missing_directory_fails_before_binding_naming_it() {
    let dir = scratch("ready-missing");
    let ready = dir.join("no/such/dir/ready.json");
    let spool = dir.join("spool");
    let (code, err) = run_on_held_ports(
        &dir,
        &[
            "--spool-dir",
            spool.to_str().unwrap(),
            "--ready-file",
            ready.to_str().unwrap(),
        ],
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(&format!("--ready-file {}", ready.display())),
        "{err}"
    );
}

#[test]
fn events_jsonl_in_a_missing_directory_is_a_config_error_before_binding() {
    let dir = scratch("events-missing");
    let events = dir.join("no/such/dir/a.jsonl");
    let spool = dir.join("spool");
    let (code, err) = run_on_held_ports(
        &dir,
        &[
            "--spool-dir",
            spool.to_str().unwrap(),
            "--events-jsonl",
            events.to_str().unwrap(),
        ],
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(&format!("--events-jsonl {}", events.display())),
        "{err}"
    );
}

#[test]
fn a_port_in_use_exits_2_naming_it() {
    let dir = scratch("port-in-use");
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = bin()
        .arg("run")
        .args(["--ebpf", "off", "--otlp-grpc", "off", "--otlp-http", "off"])
        .args(["--admin", &addr, "--alerts-jsonl"])
        .arg(dir.join("alerts.jsonl"))
        .arg("--spool-dir")
        .arg(dir.join("spool"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains(&format!("binding admin on {addr}")), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn sighup_drains_like_sigterm() {
    let mut rv = Revenant::start("sighup", &[]);
    let (status, in_time) = rv
        .proc
        .stop_in_time(libc::SIGHUP, std::time::Duration::from_secs(20));
    let log = rv.log_text();
    assert!(in_time, "did not stop on SIGHUP:\n{log}");
    assert!(status.unwrap().success(), "{log}");
    assert!(log.contains("signal=\"SIGHUP\""), "{log}");
    assert!(log.contains("revenant: stopped after draining"), "{log}");
}

/// Standard error is a pipe whose reader goes away (`revenant run 2>&1 | head -2`): the run goes
/// on, and stops cleanly on SIGTERM, writing its summary into nothing.
#[test]
fn a_closed_stderr_never_panics() {
    let dir = scratch("closed-stderr");
    let ready = dir.join("ready.json");
    let mut cmd = bin();
    cmd.arg("run")
        .args(["--ebpf", "off", "--admin", "127.0.0.1:0"])
        .args(["--otlp-grpc", "127.0.0.1:0", "--otlp-http", "127.0.0.1:0"])
        .arg("--alerts-jsonl")
        .arg(dir.join("alerts.jsonl"))
        .arg("--spool-dir")
        .arg(dir.join("spool"))
        .arg("--ready-file")
        .arg(&ready)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut proc = Proc::spawn("revenant", &mut cmd).unwrap();
    let stderr = proc.child_mut().stderr.take().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !ready.exists() {
        assert!(proc.exited().is_none(), "revenant exited before ready");
        assert!(std::time::Instant::now() < deadline, "not ready in 20 s");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    drop(stderr);
    let (status, in_time) = proc.stop_in_time(libc::SIGTERM, std::time::Duration::from_secs(20));
    assert!(in_time, "did not stop on SIGTERM");
    let status = status.unwrap();
    assert!(status.success(), "{status} (101 is a panic)");
}

/// `--log-format json`: every line on standard error is a JSON object, the ready line, the
/// shutdown summary and the counters included (as fields), and so is a start-up error.
#[test]
fn json_log_format_makes_every_stderr_line_json() {
    use std::io::{Read as _, Write as _};
    let mut rv = Revenant::start("json-log", &["--log-format", "json"]);
    // A malformed export moves an OTLP counter, so the counter dump has something to say.
    let mut s = std::net::TcpStream::connect(&rv.otlp_http).unwrap();
    write!(
        s,
        "POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n\
         Content-Length: 3\r\nConnection: close\r\n\r\n\x0f\x0f\x0f"
    )
    .unwrap();
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(rv.stop().success());
    let log = rv.log_text();
    let records: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}\n{log}")))
        .collect();
    let find = |message: &str| {
        records
            .iter()
            .find(|r| r["fields"]["message"] == message)
            .unwrap_or_else(|| panic!("no {message:?} record in\n{log}"))
    };
    assert_eq!(find("ready")["fields"]["admin"], rv.admin.as_str(), "{log}");
    let stopped = &find("stopped")["fields"];
    assert_eq!(stopped["events_checked"], 0, "{log}");
    assert_eq!(stopped["notifications_spooled"], 0, "{log}");
    assert_eq!(stopped["spool_left"], 0, "{log}");
    let counters = &find("otlp counters")["fields"]["counters"];
    assert_eq!(
        counters["revenant_otlp_requests_rejected_total{transport=\"http\",reason=\"malformed\"}"],
        1,
        "{log}"
    );

    let dir = scratch("json-log-error");
    let out = bin()
        .args(["run", "--log-format", "json", "--ebpf", "off"])
        .arg("--spool-dir")
        .arg(dir.join("spool"))
        .arg("--rules")
        .arg(dir.join("missing.yaml"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    for line in err.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line:?}"));
        if v["level"] == "ERROR" {
            assert!(
                v["fields"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("missing.yaml"),
                "{v}"
            );
        }
    }
    assert!(err.contains("\"level\":\"ERROR\""), "{err}");
}

/// A second signal during a drain that would take long (here the checker is paused, so the
/// drain would wait out its whole timeout) exits at once, with 1.
#[test]
fn a_second_signal_cuts_the_drain_short() {
    let dir = scratch("second-signal");
    let pause = dir.join("pause");
    std::fs::write(&pause, "").unwrap();
    let pause_arg = pause.to_str().unwrap();
    let mut rv = Revenant::start(
        "second-signal",
        &["--pause-file", pause_arg, "--drain-timeout", "60s"],
    );
    let pid = rv.pid() as i32;
    // SAFETY: kill(2) on the child this test started.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    futures_wait(|| rv.log_text().contains("shutting down: draining"));
    assert!(rv.proc.exited().is_none(), "the paused drain ended early");
    // The paused drain would take its whole 60 s: ending well within it is ending at once.
    let (status, in_time) = rv
        .proc
        .stop_in_time(libc::SIGTERM, std::time::Duration::from_secs(30));
    assert!(
        in_time,
        "a second SIGTERM did not end the drain:\n{}",
        rv.log_text()
    );
    assert_eq!(status.unwrap().code(), Some(1), "{}", rv.log_text());
    assert!(
        rv.log_text().contains("second signal: exiting"),
        "{}",
        rv.log_text()
    );
}

/// Polls `cond` every 20 ms for up to 20 s.
fn futures_wait(mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "condition not met in 20 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// A command line that does not parse, with `--log-format json`: still one JSON line.
#[test]
fn json_log_format_covers_usage_errors() {
    let out = bin()
        .args(["run", "--log-format", "json", "--no-such-flag"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    let v: serde_json::Value = serde_json::from_str(err.trim()).unwrap();
    assert_eq!(v["level"], "ERROR");
    assert!(
        v["fields"]["message"]
            .as_str()
            .unwrap()
            .contains("--no-such-flag"),
        "{v}"
    );
}

#[test]
fn alerts_jsonl_in_a_missing_directory_fails_before_binding_naming_it() {
    let dir = scratch("alerts-missing");
    let alerts = dir.join("no/such/dir/alerts.jsonl");
    let held = HeldPorts::new();
    let out = bin()
        .args(["run", "--ebpf", "off"])
        .args(held.flags())
        .arg("--alerts-jsonl")
        .arg(&alerts)
        .arg("--spool-dir")
        .arg(dir.join("spool"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let parent = alerts.parent().unwrap().display().to_string();
    assert!(
        err.contains(&format!("directory {parent} does not exist")),
        "{err}"
    );
    assert!(
        !err.contains("already in use") && !err.contains("listening"),
        "{err}"
    );
}

/// The `violations` figure of a run's shutdown summary.
fn summary_violations(log: &str) -> u64 {
    let line = log
        .lines()
        .rfind(|l| l.contains("stopped after draining"))
        .unwrap_or_else(|| panic!("no summary in\n{log}"));
    let before = line.split(" violations").next().unwrap();
    before.rsplit(' ').next().unwrap().parse().unwrap()
}

/// SGLang's rooms span the u64 range. Every output of a real run names a room above 2^53 by its
/// decimal string and hex (exact in jq and JavaScript, which read JSON numbers as doubles) and
/// holds no such id as a number: `/api/violations`, `/api/requests/{room}` in either spelling,
/// the alerts JSON Lines, the `--events-jsonl` recording and `check`'s verdicts on it.
#[test]
fn every_output_keeps_a_room_above_2_pow_53_exact() {
    let room = traffic::room(9);
    assert!(room > 1 << 53);
    let (dec, hex) = (room.to_string(), format!("{room:#x}"));
    let names_room = |named: &serde_json::Value| {
        named["bootstrap_room"] == dec.as_str() && named["bootstrap_room_hex"] == hex.as_str()
    };
    let no_unsafe_number = |v: &serde_json::Value| {
        assert_eq!(unsafe_numbers(v), Vec::<String>::new(), "{v}");
    };
    let mut rv = Revenant::start("rooms", &["--group-wait", "0s"]);
    traffic::reject_then_decode(&rv.otlp_http, 9);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while rv.lines("alerts.jsonl").is_empty() {
        assert!(std::time::Instant::now() < deadline, "{}", rv.stderr());
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let (code, body) = admin_get(&rv.admin, "/api/violations");
    assert_eq!(code, 200, "{body}");
    let listed: serde_json::Value = serde_json::from_str(&body).unwrap();
    no_unsafe_number(&listed);
    let violations = listed["violations"].as_array().unwrap();
    assert!(!violations.is_empty(), "{listed}");
    assert!(
        violations.iter().all(|v| names_room(&v["attempt"])),
        "{listed}"
    );
    for alias in [&dec, &hex] {
        let (code, body) = admin_get(&rv.admin, &format!("/api/requests/{alias}"));
        assert_eq!(code, 200, "{alias}: {body}");
        let t: serde_json::Value = serde_json::from_str(&body).unwrap();
        no_unsafe_number(&t);
        let rooms = t["aliases"]["bootstrap_rooms"].as_array().unwrap();
        assert!(rooms.len() == 1 && names_room(&rooms[0]), "{t}");
        let events = t["events"].as_array().unwrap();
        assert!(events.iter().any(&names_room), "{t}");
        assert!(
            events
                .iter()
                .all(|e| e.get("bootstrap_room").is_none() || names_room(e)),
            "{t}"
        );
    }
    assert!(rv.stop().success(), "{}", rv.stderr());
    let alerts = rv.lines("alerts.jsonl");
    for a in &alerts {
        no_unsafe_number(a);
        assert!(names_room(&a["attempt"]), "{a}");
        assert!(
            a["findings"]
                .as_array()
                .unwrap()
                .iter()
                .all(|f| names_room(&f["attempt"])),
            "{a}"
        );
    }
    let events = rv.dir.join("events.jsonl");
    let recorded: Vec<serde_json::Value> = std::fs::read_to_string(&events)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let with_room: Vec<_> = recorded
        .iter()
        .filter(|e| e["ids"].get("bootstrap_room").is_some())
        .collect();
    assert!(!with_room.is_empty(), "{recorded:#?}");
    for e in &with_room {
        no_unsafe_number(e);
        assert!(names_room(&e["ids"]), "{e}");
    }
    // The recording reads back: `check` finds the same breach, with the same room.
    let out = bin().arg("check").arg(&events).output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let verdicts: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(!verdicts.is_empty());
    for v in &verdicts {
        no_unsafe_number(v);
        assert!(names_room(&v["attempt"]), "{v}");
    }
}

/// `check` on a file recorded by `run --events-jsonl` (OTLP input arriving out of order) uses the
/// run's lateness from the file's header: nothing late, the run's violations. The same file
/// without its header still reads, and says how many events came late.
#[test]
fn check_reproduces_a_run_recorded_with_events_jsonl() {
    const N: u64 = 3;
    let mut rv = Revenant::start("check-replay", &["--group-wait", "0s"]);
    for i in 0..N {
        traffic::decode_reported_first(&rv.otlp_http, i);
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while rv.lines("alerts.jsonl").len() < N as usize {
        assert!(std::time::Instant::now() < deadline, "{}", rv.stderr());
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(rv.stop().success(), "{}", rv.stderr());
    let ran = summary_violations(&rv.stderr());
    assert!(ran >= N, "{}", rv.stderr());
    let events = rv.dir.join("events.jsonl");
    let text = std::fs::read_to_string(&events).unwrap();
    let header = text.lines().next().unwrap();
    assert!(header.starts_with("# revenant-run {"), "{header}");
    assert!(
        header.contains("\"allowed_lateness_ns\":15000000000"),
        "{header}"
    );

    let out = bin()
        .args(["check", "--stats"])
        .arg(&events)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(", 0 late)"), "{stderr}");
    assert!(!stderr.contains("warning"), "{stderr}");
    assert_eq!(stdout.lines().count() as u64, ran, "{stdout}\n{stderr}");

    // Without the header: the file still reads; the 50 ms default makes prefill's events late,
    // which `check` says without --stats.
    let bare = rv.dir.join("bare.jsonl");
    let body: String = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&bare, body).unwrap();
    let out = bin().arg("check").arg(&bare).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(matches!(out.status.code(), Some(0 | 1)), "{stderr}");
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("arrived later than"))
        .collect();
    assert_eq!(warnings.len(), 1, "{stderr}");
    assert!(warnings[0].contains("--allowed-lateness 50ms"), "{stderr}");

    // Other rules than the run's: said, with the flags that reproduce the run.
    let rules = rv.dir.join("rules.yaml");
    std::fs::write(
        &rules,
        "rules:\n  - name: activity-after-rejection\n    enabled: false\n",
    )
    .unwrap();
    let out = bin()
        .arg("check")
        .arg("--rules")
        .arg(&rules)
        .arg(&events)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("differ from the recording run's")
            && stderr.contains("no --rules (the embedded defaults)")
            && stderr.contains("--allowed-lateness 15s"),
        "{stderr}"
    );
}
