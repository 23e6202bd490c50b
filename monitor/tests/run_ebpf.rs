//! `revenant run --ebpf on` as a process (root only, like CI): a watched HTTP server's traffic
//! becomes lifecycle events, and when the checker stalls, the losses are counted at /metrics and
//! `/readyz` says the eBPF source is degraded — a monitor that goes blind says so.
//! Run: `sudo cargo test -p revenant --test run_ebpf`.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{Revenant, admin_get, metric_sum, parse_metrics, spawn};

/// One POST /generate on a fresh connection; Python's http.server answers 501 (a failure after
/// the request was taken on: an abort, as a 5xx other than 503 is).
fn post_generate(port: u16, i: u32) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let body = format!("{{\"text\":\"CANARY-run-ebpf\",\"rid\":\"run-ebpf-{i}\"}}");
    let req = format!(
        "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).is_ok()
}

#[test]
fn ebpf_source_counts_losses_and_readyz_says_degraded() {
    assert!(
        unsafe { libc::geteuid() } == 0,
        "this test loads eBPF probes and must run as root (CI does); it is not skipped"
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let server = spawn(
        "python3 -m http.server",
        Command::new("python3")
            .args([
                "-m",
                "http.server",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "http.server did not listen");
        std::thread::sleep(Duration::from_millis(50));
    }
    let pause =
        std::env::temp_dir().join(format!("revenant-run-ebpf-pause-{}", std::process::id()));
    std::fs::write(&pause, b"").unwrap();
    let watch = format!("prefill=http\\.server {port}");
    let pause_arg = pause.display().to_string();
    let mut rv = Revenant::start(
        "run-ebpf",
        &[
            "--ebpf",
            "on",
            "--watch",
            &watch,
            "--otlp-grpc",
            "off",
            "--otlp-http",
            "off",
            "--channel-capacity",
            "1",
            "--pause-file",
            &pause_arg,
        ],
    );
    let ready = std::fs::read_to_string(rv.dir.join("revenant-ready.json")).unwrap_or_default();
    assert!(rv.stderr().contains("eBPF source: live"), "{}", rv.stderr());
    let _ = ready;
    // The checker is paused: the one-batch channel fills and the source must count what it
    // cannot hand over.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut i = 0;
    loop {
        for _ in 0..50 {
            post_generate(port, i);
            i += 1;
        }
        let (_, m) = admin_get(&rv.admin, "/metrics");
        let drops = metric_sum(
            &parse_metrics(&m),
            "revenant_dropped_items_total",
            &[("point", "event_channel")],
        );
        if drops > 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no event_channel drop counted after {i} requests:\n{m}\n{}",
            rv.stderr()
        );
    }
    // The drop publisher runs once a second.
    let deadline = Instant::now() + Duration::from_secs(10);
    let ready = loop {
        let (code, body) = admin_get(&rv.admin, "/readyz");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        if v["degraded"]["ebpf"].is_string() {
            assert_eq!(code, 200, "degraded is not down: {v}");
            break v;
        }
        assert!(
            Instant::now() < deadline,
            "/readyz never said degraded: {v}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let (_, m) = admin_get(&rv.admin, "/metrics");
    let samples = parse_metrics(&m);
    assert_eq!(
        metric_sum(&samples, "revenant_ebpf_coverage_degraded", &[]),
        1.0,
        "{m}"
    );
    assert!(
        metric_sum(&samples, "revenant_ebpf_batches_dropped_total", &[]) > 0.0,
        "{m}"
    );
    assert!(
        metric_sum(&samples, "revenant_ebpf_watched_processes", &[]) >= 1.0,
        "{m}"
    );
    // Unpause: what is queued gets checked, the run stops cleanly, and the canary prompt text
    // never reached a log line, metric, event or alert.
    std::fs::remove_file(&pause).unwrap();
    // The one batch that fit in the channel while paused holds whatever the source had parsed
    // by then (it can be a single request's start), so the prefill's answer is looked for in
    // requests made once events flow again. The file is flushed every checker tick.
    let is_answer = |e: &serde_json::Value| {
        e["source"] == "ebpf"
            && e["stage"] == "prefill"
            && e["kind"] == "aborted"
            && e["status"] == 501
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        post_generate(port, i);
        i += 1;
        let flowing = test_harness::read_jsonl(&rv.dir.join("events.jsonl"))
            .is_ok_and(|events| events.iter().any(is_answer));
        if flowing {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "eBPF derived no prefill answer within 30 s of unpausing ({i} requests):\n{}",
            rv.stderr()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(rv.stop().success(), "{}", rv.stderr());
    for text in [
        rv.stderr(),
        m,
        ready.to_string(),
        std::fs::read_to_string(rv.dir.join("events.jsonl")).unwrap_or_default(),
        std::fs::read_to_string(rv.dir.join("alerts.jsonl")).unwrap_or_default(),
    ] {
        assert!(
            !text.contains("CANARY-run-ebpf"),
            "prompt text leaked: {text}"
        );
    }
    let events = rv.lines("events.jsonl");
    assert!(
        events.iter().any(is_answer),
        "eBPF derived no prefill answer from {} events",
        events.len()
    );
    drop(server);
}

/// A watched SGLang decode whose environment waits longer for KV than `held-decode-slot` gives
/// it (`SGLANG_DISAGGREGATION_WAITING_TIMEOUT=600` against 330 s) is named at start, with the
/// fix; one with SGLang's default is not.
#[test]
fn a_worker_timeout_longer_than_the_rule_window_is_named() {
    assert!(
        unsafe { libc::geteuid() } == 0,
        "this test loads eBPF probes and must run as root (CI does); it is not skipped"
    );
    let worker = |tag: &str, timeout: Option<&str>| {
        let mut cmd = Command::new("python3");
        cmd.args([
            "-c",
            "import time; time.sleep(60)",
            "--disaggregation-mode",
            "decode",
            tag,
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        if let Some(t) = timeout {
            cmd.env("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", t);
        }
        spawn("python3 decode stand-in", &mut cmd)
    };
    let tag = format!("rv-timeouts-{}", std::process::id());
    let long = worker(&format!("{tag}-long"), Some("600"));
    let stock = worker(&format!("{tag}-stock"), None);
    let watch = format!("decode={tag}");
    let mut rv = Revenant::start(
        "run-ebpf-timeouts",
        &[
            "--ebpf",
            "on",
            "--no-sglang-conventions",
            "--watch",
            &watch,
            "--otlp-grpc",
            "off",
            "--otlp-http",
            "off",
        ],
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let long_pid = long.pid().to_string();
    let stock_pid = stock.pid().to_string();
    loop {
        let log = rv.stderr();
        let watched = log.matches("eBPF: watching process").count() >= 2;
        if watched && log.contains("SGLANG_DISAGGREGATION_WAITING_TIMEOUT=600 s") {
            let warned: Vec<&str> = log
                .lines()
                .filter(|l| l.contains("SGLANG_DISAGGREGATION_WAITING_TIMEOUT"))
                .collect();
            assert_eq!(warned.len(), 1, "{log}");
            assert!(warned[0].contains(&long_pid), "{log}");
            assert!(!warned[0].contains(&stock_pid), "{log}");
            assert!(warned[0].contains("held-decode-slot"), "{log}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no warning about the worker's timeout within 20 s:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(rv.stop().success(), "{}", rv.stderr());
    drop((long, stock));
}

/// A signal that comes in while the kernel verifies a probe makes `BPF_PROG_LOAD` give up with
/// EAGAIN; the load is tried again, so a SIGSTOP/SIGCONT (a debugger, a job-control shell) at
/// start-up does not fail it. Four stops 300 ms apart from the start of the load (which takes
/// about 0.8 s here, two workers verifying most of it): fewer than the attempts a program gets,
/// so the load must succeed; without the retry a stop lands in a verification and revenant
/// exits.
#[test]
fn signals_while_the_probes_load_do_not_fail_it() {
    assert!(
        unsafe { libc::geteuid() } == 0,
        "this test loads eBPF probes and must run as root (CI does); it is not skipped"
    );
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("stderr");
    let mut child = Command::new(env!("CARGO_BIN_EXE_revenant"))
        .args([
            "run",
            "--ebpf",
            "on",
            "--otlp-grpc",
            "off",
            "--otlp-http",
            "off",
        ])
        .args(["--admin", "127.0.0.1:0", "--spool-dir"])
        .arg(dir.path().join("spool"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let text = || std::fs::read_to_string(&log).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(30);
    // The budget is logged just before the probes load.
    while !text().contains("memory budget split") {
        assert!(child.try_wait().unwrap().is_none(), "{}", text());
        assert!(
            Instant::now() < deadline,
            "no start-up within 30 s:\n{}",
            text()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    for _ in 0..4 {
        std::thread::sleep(Duration::from_millis(280));
        // SAFETY: signals to our own child, not reaped before `try_wait` sees it exit.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        std::thread::sleep(Duration::from_millis(20));
        unsafe { libc::kill(pid, libc::SIGCONT) };
    }
    loop {
        let t = text();
        if t.contains("eBPF probes attached") {
            assert!(!t.contains("kernel rejected"), "{t}");
            break;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("revenant exited ({status}) while its probes loaded:\n{t}");
        }
        assert!(
            Instant::now() < deadline,
            "probes not attached within 30 s:\n{t}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    unsafe { libc::kill(pid, libc::SIGTERM) };
    assert!(child.wait().unwrap().success(), "{}", text());
}
