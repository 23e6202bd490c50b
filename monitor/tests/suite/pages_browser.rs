//! The pages for people, in a real browser: a real `revenant run` gets OTLP spans (a generic
//! mapping) of a request whose prefill refused it while decode worked on, and of a request whose
//! every id and span attribute is markup; headless Chromium loads `/requests/{alias}`,
//! `/incidents` and a `revenant check --report` file from disk, and the dumped DOM is checked:
//! lanes, marks, the breach with its rule and severity, the ids, and that no markup from an id
//! became an element or ran (the page's title is what revenant wrote). Screenshots go to
//! `target/pages-browser/`.
//!
//! Chromium (`chromium`, Debian) is one of the system tools `cargo xtask setup` installs; a
//! missing one fails the test, as every missing system tool does.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};
use test_harness::{Revenant, ScratchDir, system_bin};

/// Markup an attacker can put in an id: an element with a handler, and a script that would
/// change the title if it ever ran. Shorter than the 128 bytes an id is clipped to.
const EVIL: &str = "<img src=x onerror=\"document.title='pwned'\"></script><script>document.title='pwned'</script>";
const TITLE_REQUEST: &str = "<title>revenant: request timeline</title>";

fn b64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn attr(k: &str, v: &Value) -> Value {
    match v {
        Value::Number(n) => json!({"key": k, "value": {"intValue": n.to_string()}}),
        other => json!({"key": k, "value": {"stringValue": other.as_str().unwrap()}}),
    }
}

#[allow(clippy::too_many_arguments)]
fn span(
    trace: u128,
    id: u64,
    name: &str,
    start: u128,
    end: u128,
    attrs: Value,
    error: bool,
) -> Value {
    let attrs: Vec<Value> = attrs
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| attr(k, v))
        .collect();
    json!({
        "traceId": b64(&trace.to_be_bytes()),
        "spanId": b64(&id.to_be_bytes()),
        "name": name,
        "kind": "SPAN_KIND_SERVER",
        "startTimeUnixNano": start.to_string(),
        "endTimeUnixNano": end.to_string(),
        "attributes": attrs,
        "status": if error { json!({"code": "STATUS_CODE_ERROR"}) } else { json!({}) },
    })
}

fn post(http: &str, host: &str, spans: Vec<Value>) {
    let doc = json!({"resourceSpans": [{
        "resource": {"attributes": [
            {"key": "service.name", "value": {"stringValue": "pages-stack"}},
            {"key": "host.name", "value": {"stringValue": host}},
        ]},
        "scopeSpans": [{"scope": {"name": "pages"}, "spans": spans}],
    }]})
    .to_string();
    let mut s = TcpStream::connect(http).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST /v1/traces HTTP/1.1\r\nHost: {http}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{doc}",
        doc.len()
    )
    .unwrap();
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

const MS: u128 = 1_000_000;

/// One request: the router receives it, prefill refuses its attempt (400), decode works on it
/// 30 ms later anyway.
fn send_request(http: &str, trace: u128, request_id: &str, rid: &str, room: u64, text: &str) {
    let t0 = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let ids = |extra: Value| {
        let mut m = json!({"x-request-id": request_id, "req.id": rid, "room": room, "server.address": text});
        for (k, v) in extra.as_object().unwrap() {
            m[k] = v.clone();
        }
        m
    };
    post(
        http,
        text,
        vec![
            span(
                trace,
                1,
                "route",
                t0,
                t0 + 60 * MS,
                json!({"x-request-id": request_id}),
                false,
            ),
            span(
                trace,
                2,
                "handle",
                t0 + MS,
                t0 + 3 * MS,
                ids(json!({"http.response.status_code": 400})),
                true,
            ),
            span(
                trace,
                3,
                "decode_step",
                t0 + 30 * MS,
                t0 + 31 * MS,
                ids(json!({})),
                false,
            ),
        ],
    );
}

const CONFIG: &str = "normalize:
  generic:
    - name: pages
      select: { service_name: pages-stack }
      ids: { request_id: [x-request-id], rid: [req.id], bootstrap_room: [room] }
      status: [http.response.status_code]
      worker: [server.address]
      rules:
        - { name: route, stage: router, kind: received, at: start }
        - { name: handle, stage: prefill, kind: received, at: start }
        - { name: handle, error: true, stage: prefill, kind: rejected }
        - { name: decode_step, stage: decode, kind: work }
";

fn shots() -> PathBuf {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/pages-browser");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Headless Chromium on `url`: its DOM after load (`--dump-dom`), and a screenshot at `shot`.
/// Each run is bounded (60 s) and killed past it.
fn chromium(profile: &Path, url: &str, shot: &Path) -> String {
    let bin = system_bin("chromium");
    let run = |extra: &[String]| -> String {
        let mut child = Command::new(&bin)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-dev-shm-usage",
                "--hide-scrollbars",
                "--window-size=1280,1600",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .args(extra)
            .arg(url)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromium");
        let mut out = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = out.read_to_string(&mut s);
            s
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                assert!(status.success(), "chromium {extra:?} {url}: {status}");
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("chromium {extra:?} {url} took over 60 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        reader.join().unwrap()
    };
    run(&[format!("--screenshot={}", shot.display())]);
    assert!(shot.is_file(), "no screenshot at {}", shot.display());
    let dom = run(&["--dump-dom".to_string()]);
    assert!(dom.contains("</html>"), "{url}: {dom}");
    dom
}

fn url_segment(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Nothing an id carried became an element or ran: the title is revenant's, no `img`, `script`
/// or `blink` element exists, the markup is there as text.
fn assert_inert(dom: &str, title: &str) {
    assert!(dom.contains(title), "title changed: {dom}");
    assert!(!dom.contains("pwned</title>"), "{dom}");
    for tag in ["<img", "<script"] {
        assert!(!dom.contains(tag), "{tag} became an element: {dom}");
    }
    assert!(dom.contains("&lt;img src=x onerror="), "{dom}");
    assert!(dom.contains("&lt;/script&gt;&lt;script&gt;"), "{dom}");
}

#[test]
fn pages_render_in_a_real_browser() {
    let scratch = ScratchDir::new("pages-browser").unwrap();
    let dir = scratch.path();
    let profile = dir.join("chromium-profile");
    let cfg = dir.join("config.yaml");
    std::fs::write(&cfg, CONFIG).unwrap();
    let bin = Path::new(env!("CARGO_BIN_EXE_revenant"));
    let mut rv = Revenant::start(
        bin,
        dir,
        &[
            "--config".as_ref(),
            cfg.as_os_str(),
            "--group-wait".as_ref(),
            "0s".as_ref(),
            "--allowed-lateness".as_ref(),
            "1s".as_ref(),
        ],
    )
    .unwrap();
    let room: u64 = 0x314783F6BEF70001;
    send_request(
        &rv.otlp_http,
        0x11 << 64 | 1,
        "req-page-1",
        "rid-page-1",
        room,
        "worker-1",
    );
    send_request(
        &rv.otlp_http,
        0x22 << 64 | 2,
        EVIL,
        &format!("rid{EVIL}"),
        4242,
        EVIL,
    );
    // Every finding the two requests make, so the pages below see a set that no longer
    // changes: each request's activity after its refusal at once (critical), and its decode leg,
    // which never ends, once orphaned-leg's 6 s window has passed (warning).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (code, v) = rv.admin_json("/api/violations").unwrap();
        assert_eq!(code, 200, "{v}");
        let rules: Vec<&str> = v["violations"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|x| x["rule"].as_str())
            .collect();
        let count = |rule: &str| rules.iter().filter(|r| **r == rule).count();
        if count("activity-after-rejection") >= 2 && count("orphaned-leg") >= 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no violations: {v}\n{}",
            rv.log_tail(30)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let base = format!("http://{}", rv.admin);
    let out = shots();

    // The breached request: its lanes, marks, the refusal, the breach, the ids once each.
    let dom = chromium(
        &profile,
        &format!("{base}/requests/req-page-1"),
        &out.join("request.png"),
    );
    assert!(dom.contains(TITLE_REQUEST), "{dom}");
    for stage in ["router", "prefill", "transfer", "decode"] {
        assert!(
            dom.contains(&format!(
                "class=\"lane\" data-stage=\"{stage}\" data-attempt=\"1\""
            )),
            "{stage}: {dom}"
        );
    }
    assert!(dom.matches("<g class=\"mark otlp\"").count() >= 3, "{dom}");
    assert!(dom.contains("class=\"refusal\""), "{dom}");
    assert!(
        dom.contains("class=\"cancel-window\" data-rule=\"handoff-after-rejection\""),
        "{dom}"
    );
    assert!(
        dom.contains(
            "<g class=\"breach\" data-rule=\"activity-after-rejection\" data-severity=\"critical\">"
        ),
        "{dom}"
    );
    assert!(dom.contains("activity-after-rejection · critical"), "{dom}");
    for id in [
        "req-page-1".to_string(),
        "rid-page-1".to_string(),
        room.to_string(),
        format!("{room:#x}"),
        "00000000000000110000000000000001".to_string(),
    ] {
        assert_eq!(
            dom.matches(&format!(">{id}<")).count(),
            1,
            "{id} once: {dom}"
        );
    }

    // The incidents, newest first, linking to the request pages; filters by rule and severity.
    let dom = chromium(
        &profile,
        &format!("{base}/incidents"),
        &out.join("incidents.png"),
    );
    assert!(dom.contains("<title>revenant: incidents</title>"), "{dom}");
    assert!(dom.matches("<tr class=\"incident\" data-rule=\"activity-after-rejection\" data-severity=\"critical\">").count() >= 2, "{dom}");
    assert!(dom.contains("href=\"requests/req-page-1\""), "{dom}");
    assert_inert(&dom, "<title>revenant: incidents</title>");
    let dom = chromium(
        &profile,
        &format!("{base}/incidents?severity=warning"),
        &out.join("incidents-warning.png"),
    );
    assert_eq!(
        dom.matches("<tr class=\"incident\" data-rule=\"orphaned-leg\" data-severity=\"warning\">")
            .count(),
        2,
        "{dom}"
    );
    assert!(!dom.contains("data-severity=\"critical\""), "{dom}");
    let dom = chromium(
        &profile,
        &format!("{base}/incidents?severity=info"),
        &out.join("incidents-info.png"),
    );
    assert!(dom.contains("No incident matches"), "{dom}");
    let dom = chromium(
        &profile,
        &format!("{base}/incidents?rule=activity-after-rejection&severity=critical"),
        &out.join("incidents-filtered.png"),
    );
    assert!(dom.contains("href=\"requests/req-page-1\""), "{dom}");

    // The request whose ids are markup: text on the page, nothing ran.
    let dom = chromium(
        &profile,
        &format!("{base}/requests/{}", url_segment(EVIL)),
        &out.join("request-markup.png"),
    );
    assert!(
        dom.contains("data-rule=\"activity-after-rejection\""),
        "{dom}"
    );
    assert_inert(&dom, TITLE_REQUEST);

    // The same events recorded, with eBPF's view of the refusal beside OTLP's: `check --report`.
    let recorded = dir.join("recorded.jsonl");
    let t0 = 1_795_986_930_000_000_000u64;
    let line = |dt: u64, stage: &str, kind: &str, source: &str, rid: &str, status: Option<u16>| {
        let mut l = json!({"time_unix_nano": t0 + dt, "stage": stage, "kind": kind,
            "ids": {"request_id": EVIL, "rid": rid, "bootstrap_room": 77}, "source": source,
            "worker": EVIL, "reason": EVIL});
        if let Some(s) = status {
            l["status"] = json!(s);
        }
        l.to_string()
    };
    let rid = format!("rid{EVIL}");
    let lines = [
        line(0, "router", "dispatched", "ebpf", &rid, None),
        line(1_000_000, "prefill", "rejected", "otlp", &rid, Some(400)),
        line(2_000_000, "prefill", "rejected", "ebpf", &rid, Some(400)),
        line(40_000_000, "decode", "work", "ebpf", &rid, None),
    ];
    std::fs::write(&recorded, lines.join("\n") + "\n").unwrap();
    let report = dir.join("report.html");
    let status = Command::new(bin)
        .args(["check", "--report"])
        .arg(&report)
        .arg(&recorded)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(1), "violations found");
    let dom = chromium(
        &profile,
        &format!("file://{}", report.display()),
        &out.join("report.png"),
    );
    assert_inert(&dom, "<title>revenant check report</title>");
    assert!(
        dom.contains("<tr class=\"rule-row\" data-rule=\"activity-after-rejection\">"),
        "{dom}"
    );
    assert!(dom.contains("class=\"bar\""), "histogram: {dom}");
    assert!(
        dom.contains("<section class=\"request\" id=\"r1\">"),
        "{dom}"
    );
    assert!(
        dom.contains("<g class=\"mark both\" data-kind=\"rejected\">"),
        "both witnesses: {dom}"
    );
    assert!(
        dom.contains("<g class=\"breach\" data-rule=\"activity-after-rejection\""),
        "{dom}"
    );

    assert!(rv.stop().unwrap().success(), "{}", rv.log_tail(30));
}
