//! Who may talk to revenant, end to end: TLS (and mutual TLS) on the OTLP receivers and the
//! admin server, the bearer token, the open metrics port, and rotation of all three files.
//! Clients are the real ones: the OpenTelemetry Python exporters configured through the
//! `OTEL_EXPORTER_OTLP_*` environment (as a deployment would), curl, and `openssl s_client`.
//! The PKI is made for each test with `openssl` in a temporary directory.

use crate::support;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::Revenant;
use test_harness::{Pki, Sample, metric_sum, parse_metrics, system_bin};

/// `curl -s` with `args`: exit code, HTTP status (0 when there was no HTTP answer) and body.
fn curl(args: &[&str]) -> (i32, u16, String) {
    let out = Command::new(system_bin("curl"))
        .args(["-s", "--max-time", "10", "-w", "\n%{http_code}"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("running curl");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (
        out.status.code().unwrap_or(-1),
        code.trim().parse().unwrap_or(0),
        body.to_string(),
    )
}

/// The subject of the certificate a TLS server at `addr` presents.
fn served_subject(addr: &str) -> String {
    let out = Command::new(system_bin("openssl"))
        .args(["s_client", "-connect", addr, "-showcerts"])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .expect("running openssl s_client");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    text.lines()
        .find(|l| l.trim_start().starts_with("0 s:"))
        .unwrap_or_default()
        .to_string()
}

fn metrics_at(addr: &str) -> Vec<Sample> {
    let (_, code, body) = curl(&[&format!("http://{addr}/metrics")]);
    assert_eq!(code, 200, "{body}");
    parse_metrics(&body)
}

fn wait_until(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !ok() {
        assert!(Instant::now() < deadline, "{what}: not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn alerted(rv: &Revenant, rid: &str) -> bool {
    rv.lines("alerts.jsonl").iter().any(|a| {
        let s = a.to_string();
        s.contains("activity-after-rejection") && s.contains(rid)
    })
}

fn write_token(path: &Path, token: &str) {
    // Written aside and renamed, as the kubelet swaps a Secret's files.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, format!("{token}\n")).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[test]
fn tls_and_token_admit_the_real_exporters_refuse_the_rest_and_rotate() {
    let pki = Pki::new("token");
    let token = pki.path("token");
    write_token(&token, "first-token-0123456789");
    let mut rv = Revenant::start(
        "access-token",
        &[
            "--tls-cert",
            &pki.path_str("server.crt"),
            "--tls-key",
            &pki.path_str("server.key"),
            "--auth-token-file",
            &token.display().to_string(),
            "--metrics-addr",
            "127.0.0.1:0",
        ],
    );
    let metrics_addr = rv.ready["metrics"]
        .as_str()
        .expect("metrics address")
        .to_owned();
    let ca = pki.path_str("ca.crt");
    let admin = format!("https://{}", rv.admin);

    // The exporters with the CA and the token: every export lands and the breach is caught.
    for (i, transport) in ["grpc", "http-protobuf"].iter().enumerate() {
        let tag = format!("{:04x}", 0xb0 + i);
        let (ok, out, err) = rv.emit_with_env(
            &[
                "--secure",
                "--transport",
                transport,
                "--scenario",
                "reject-then-decode",
                "--tag",
                &tag,
            ],
            &[
                ("OTEL_EXPORTER_OTLP_CERTIFICATE", &ca),
                (
                    "OTEL_EXPORTER_OTLP_HEADERS",
                    "authorization=Bearer%20first-token-0123456789",
                ),
            ],
        );
        assert!(ok, "{transport}: {out} {err}\n{}", rv.stderr());
        let rid = out["rid"].as_str().unwrap().to_owned();
        wait_until(
            &format!("{transport}: alert for {rid}"),
            Duration::from_secs(30),
            || alerted(&rv, &rid),
        );
    }
    let mut refused_rids = Vec::new();

    // A wrong token: refused for good (the exporters give up), counted, and nothing reaches
    // the engine.
    for (i, transport) in ["grpc", "http-protobuf"].iter().enumerate() {
        let tag = format!("{:04x}", 0xc0 + i);
        let (ok, out, _) = rv.emit_with_env(
            &[
                "--secure",
                "--transport",
                transport,
                "--scenario",
                "reject-then-decode",
                "--tag",
                &tag,
                "--timeout",
                "5",
            ],
            &[
                ("OTEL_EXPORTER_OTLP_CERTIFICATE", &ca),
                (
                    "OTEL_EXPORTER_OTLP_HEADERS",
                    "authorization=Bearer%20not-the-token",
                ),
            ],
        );
        assert!(!ok, "{transport}: a wrong token was accepted: {out}");
        refused_rids.push(out["rid"].as_str().unwrap().to_owned());
        assert_eq!(
            out["transient_errors"], 0,
            "{transport}: UNAUTHENTICATED/401 must not be retried: {out}"
        );
    }
    let after = metrics_at(&metrics_addr);
    for server in ["otlp_grpc", "otlp_http"] {
        assert!(
            metric_sum(
                &after,
                "revenant_unauthenticated_requests_total",
                &[("server", server)]
            ) >= 1.0,
            "{server} refusals not counted"
        );
    }
    assert!(
        metric_sum(
            &after,
            "revenant_otlp_requests_rejected_total",
            &[("reason", "unauthenticated")]
        ) >= 2.0
    );

    // The admin API: TLS only, the token required on /api, the metrics port open.
    let (_, code, body) = curl(&["--cacert", &ca, &format!("{admin}/api/violations")]);
    assert_eq!(code, 401, "{body}");
    assert!(body.contains("bearer token"), "{body}");
    let (_, code, body) = curl(&[
        "--cacert",
        &ca,
        "-H",
        "Authorization: Bearer first-token-0123456789",
        &format!("{admin}/api/violations?rule=activity-after-rejection"),
    ]);
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("activity-after-rejection"), "{body}");
    let (exit, code, _) = curl(&[&format!("{admin}/api/violations")]);
    assert!(
        exit != 0 && code == 0,
        "a client that does not trust the CA got an answer"
    );
    let (exit, code, _) = curl(&[&format!("http://{}/healthz", rv.admin)]);
    assert!(
        code != 200,
        "plain HTTP answered on the TLS admin port (exit {exit})"
    );
    let (_, code, _) = curl(&["--cacert", &ca, &format!("{admin}/metrics")]);
    assert_eq!(code, 404, "/metrics moved to the metrics port");
    for path in ["/healthz", "/readyz"] {
        let (_, code, body) = curl(&[&format!("http://{metrics_addr}{path}")]);
        assert_eq!(code, 200, "{path}: {body}");
    }
    let m = metrics_at(&metrics_addr);
    assert!(
        metric_sum(
            &m,
            "revenant_unauthenticated_requests_total",
            &[("server", "admin")]
        ) >= 1.0
    );
    assert!(
        metric_sum(
            &m,
            "revenant_tls_handshake_failures_total",
            &[("server", "admin")]
        ) >= 1.0
    );

    // Token rotation: the new one is in force within the reload interval, the old one is not.
    write_token(&token, "second-token-9876543210");
    let api = format!("{admin}/api/violations");
    wait_until(
        "the rotated token admitted",
        Duration::from_secs(10),
        || {
            curl(&[
                "--cacert",
                &ca,
                "-H",
                "Authorization: Bearer second-token-9876543210",
                &api,
            ])
            .1 == 200
        },
    );
    let (_, code, _) = curl(&[
        "--cacert",
        &ca,
        "-H",
        "Authorization: Bearer first-token-0123456789",
        &api,
    ]);
    assert_eq!(code, 401, "the old token still admitted");

    // Certificate rotation: a new server certificate in place of the old one is served to new
    // connections, on the admin port and the OTLP ports alike.
    assert!(
        served_subject(&rv.admin).contains("revenant-server-1"),
        "{}",
        served_subject(&rv.admin)
    );
    pki.leaf("server2", "revenant-server-2", "serverAuth");
    std::fs::rename(pki.path("server2.key"), pki.path("server.key")).unwrap();
    std::fs::rename(pki.path("server2.crt"), pki.path("server.crt")).unwrap();
    for addr in [&rv.admin, &rv.otlp_grpc, &rv.otlp_http] {
        wait_until(
            &format!("{addr} serves the new certificate"),
            Duration::from_secs(10),
            || served_subject(addr).contains("revenant-server-2"),
        );
    }
    let m = metrics_at(&metrics_addr);
    assert!(
        metric_sum(
            &m,
            "revenant_access_reloads_total",
            &[("file", "tls"), ("result", "ok")]
        ) >= 1.0
    );
    assert!(
        metric_sum(
            &m,
            "revenant_access_reloads_total",
            &[("file", "token"), ("result", "ok")]
        ) >= 1.0
    );
    // A broken rotation keeps the certificate in force.
    std::fs::write(pki.path("server.key"), "not a key\n").unwrap();
    wait_until("the failed reload counted", Duration::from_secs(10), || {
        metric_sum(
            &metrics_at(&metrics_addr),
            "revenant_access_reloads_total",
            &[("file", "tls"), ("result", "error")],
        ) >= 1.0
    });
    assert!(served_subject(&rv.admin).contains("revenant-server-2"));
    let st = rv.stop();
    assert!(st.success(), "{}", rv.stderr());
    // Nothing of a refused export reached the engine (the recording holds every event).
    let events = rv.lines("events.jsonl");
    assert!(!events.is_empty());
    for rid in &refused_rids {
        assert!(
            !events.iter().any(|e| e.to_string().contains(rid.as_str())),
            "an event of the refused export {rid}"
        );
    }
    let log = rv.stderr();
    for secret in ["first-token-0123456789", "second-token-9876543210"] {
        assert!(!log.contains(secret), "the token is in the log");
    }
}

#[test]
fn mutual_tls_admits_only_clients_with_a_certificate_from_the_ca() {
    let pki = Pki::new("mtls");
    let mut rv = Revenant::start(
        "access-mtls",
        &[
            "--tls-cert",
            &pki.path_str("server.crt"),
            "--tls-key",
            &pki.path_str("server.key"),
            "--tls-client-ca",
            &pki.path_str("ca.crt"),
        ],
    );
    let ca = pki.path_str("ca.crt");
    let (cert, key) = (pki.path_str("client.crt"), pki.path_str("client.key"));
    let (ok, out, err) = rv.emit_with_env(
        &[
            "--secure",
            "--transport",
            "grpc",
            "--scenario",
            "reject-then-decode",
            "--tag",
            "00d0",
        ],
        &[
            ("OTEL_EXPORTER_OTLP_CERTIFICATE", &ca),
            ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", &cert),
            ("OTEL_EXPORTER_OTLP_CLIENT_KEY", &key),
        ],
    );
    assert!(ok, "{out} {err}\n{}", rv.stderr());
    let rid = out["rid"].as_str().unwrap().to_owned();
    wait_until("alert over mutual TLS", Duration::from_secs(30), || {
        alerted(&rv, &rid)
    });
    let (ok, out, _) = rv.emit_with_env(
        &[
            "--secure",
            "--transport",
            "http-protobuf",
            "--scenario",
            "reject-then-decode",
            "--tag",
            "00d1",
            "--timeout",
            "5",
        ],
        &[("OTEL_EXPORTER_OTLP_CERTIFICATE", &ca)],
    );
    assert!(
        !ok,
        "an exporter without a client certificate was admitted: {out}"
    );
    let url = format!("https://{}/api/violations", rv.admin);
    let (exit, code, _) = curl(&["--cacert", &ca, &url]);
    assert!(
        exit != 0 && code == 0,
        "no client certificate, yet an answer ({code})"
    );
    let (_, code, body) = curl(&["--cacert", &ca, "--cert", &cert, "--key", &key, &url]);
    assert_eq!(code, 200, "{body}");
    let (_, code, body) = curl(&[
        "--cacert",
        &ca,
        "--cert",
        &cert,
        "--key",
        &key,
        &format!("https://{}/metrics", rv.admin),
    ]);
    assert_eq!(code, 200, "{body}");
    let m = parse_metrics(&body);
    assert!(
        metric_sum(
            &m,
            "revenant_tls_handshake_failures_total",
            &[("server", "admin")]
        ) >= 1.0
    );
    assert!(
        metric_sum(
            &m,
            "revenant_tls_handshake_failures_total",
            &[("server", "otlp_http")]
        ) >= 1.0
    );
    let st = rv.stop();
    assert!(st.success(), "{}", rv.stderr());
}

#[test]
fn unusable_access_files_exit_2_naming_them() {
    let pki = Pki::new("bad");
    std::fs::write(pki.path("empty-token"), "\n").unwrap();
    std::fs::write(pki.path("garbage.pem"), "not PEM at all\n").unwrap();
    let (server_crt, server_key, client_key) = (
        pki.path_str("server.crt"),
        pki.path_str("server.key"),
        pki.path_str("client.key"),
    );
    let missing = pki.path_str("missing.crt");
    let (garbage, empty) = (pki.path_str("garbage.pem"), pki.path_str("empty-token"));
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--tls-cert", &server_crt],
            "--tls-cert needs --tls-key",
        ),
        (
            vec!["--tls-client-ca", &server_crt],
            "--tls-client-ca needs",
        ),
        (
            vec!["--tls-cert", &missing, "--tls-key", &server_key],
            &missing,
        ),
        (
            vec!["--tls-cert", &garbage, "--tls-key", &server_key],
            &garbage,
        ),
        // A key that is not the certificate's.
        (
            vec!["--tls-cert", &server_crt, "--tls-key", &client_key],
            &client_key,
        ),
        (vec!["--auth-token-file", &empty], &empty),
    ];
    for (args, want) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_revenant"))
            .args([
                "run",
                "--ebpf",
                "off",
                "--otlp-grpc",
                "127.0.0.1:0",
                "--otlp-http",
                "127.0.0.1:0",
                "--admin",
                "127.0.0.1:0",
            ])
            .args(&args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {want} not in {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}
