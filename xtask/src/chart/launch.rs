//! The rendered command lines run by the real binary with the rendered files: `revenant run`,
//! or in cluster mode `revenant agent` and every checker replica against the chart's NATS as
//! rendered, one `nats-server` per replica on loopback.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail, ensure};
use serde_json::Value;

use super::checks::{checker_file, component, kind, one, probes_use, strings};

/// The rendered command line, run by the real binary with the rendered configuration files:
/// every flag exists, every file loads, the admin server answers. Addresses move to loopback
/// port 0 and paths to a scratch directory; eBPF is off here (the probes' privileges are
/// measured, not assumed: docs/deploy.md).
pub(super) fn starts(revenant: &Path, docs: &[Value], out: &Path, case: &str) -> Result<()> {
    let ds = one(docs, "DaemonSet")?;
    let c = &ds["spec"]["template"]["spec"]["containers"][0];
    let dir = out.join(format!("{case}-run"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let secret = one(docs, "Secret")?;
    let alert_yaml = secret["stringData"]["alert.yaml"]
        .as_str()
        .ok_or_else(|| anyhow!("{case}: no alert.yaml in the Secret"))?;
    std::fs::write(dir.join("alert.yaml"), alert_yaml)?;
    if let Some(cm) = kind(docs, "ConfigMap")
        .into_iter()
        .find(|c| c["metadata"]["name"] == "revenant")
    {
        for (key, body) in cm["data"].as_object().into_iter().flatten() {
            std::fs::write(dir.join(key), body.as_str().unwrap_or_default())?;
        }
    }
    let pki = test_harness::Pki::new(&format!("chart-{case}"));
    let mut args = Vec::new();
    for a in strings(&c["args"]).into_iter().skip(1) {
        let (flag, value) = a.split_once('=').unwrap_or((a, ""));
        if let Some(local) = access_file(flag, &dir, &pki)? {
            args.extend([flag.to_string(), local]);
            continue;
        }
        let value = match flag {
            "--otlp-grpc" | "--otlp-http" | "--admin" | "--metrics-addr" => {
                "127.0.0.1:0".to_string()
            }
            "--node" => "chart-test".into(),
            "--external-url" => value.replace("$(POD_IP)", "127.0.0.1"),
            "--ebpf" => "off".into(),
            "--spool-dir" => dir.join("spool").display().to_string(),
            "--alert-config" => dir.join("alert.yaml").display().to_string(),
            "--config" => dir.join("config.yaml").display().to_string(),
            "--rules" => dir.join("rules.yaml").display().to_string(),
            _ => value.to_string(),
        };
        ensure!(!value.contains("$("), "{case}: {a} needs an unset variable");
        // Separate words: the harness looks flags up by name to fill in what is missing.
        args.push(flag.to_string());
        if a.contains('=') {
            args.push(value);
        }
    }
    let run = test_harness::Revenant::start_within(revenant, &dir, &args, Duration::from_secs(30))
        .with_context(|| format!("{case}: revenant run {}", args.join(" ")))?;
    let ops = run.ready["metrics"]
        .as_str()
        .unwrap_or(&run.admin)
        .to_string();
    probes_use(c, &ops, &run.admin, case)?;
    let (code, body) = test_harness::http_get(&format!("http://{ops}/healthz"))?;
    ensure!(code == 200, "{case}: /healthz {code} {body}");
    let (code, body) = test_harness::http_get(&format!("http://{ops}/readyz"))?;
    ensure!(code == 200, "{case}: /readyz {code} {body}");
    access_holds(&args, &run.admin, &dir, &pki, case)?;
    drop(run);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// The token the chart cases' runs are started with (`--auth-token-file`).
pub(super) const CHART_TOKEN: &str = "chart-test-token";

/// A local file in place of a Secret's mounted file, for the access flags: the PKI's server
/// certificate, key and CA, a token file in `dir`. `None` for every other flag.
pub(super) fn access_file(
    flag: &str,
    dir: &Path,
    pki: &test_harness::Pki,
) -> Result<Option<String>> {
    Ok(Some(match flag {
        "--tls-cert" => pki.path_str("server.crt"),
        "--tls-key" => pki.path_str("server.key"),
        "--tls-client-ca" => pki.path_str("ca.crt"),
        "--auth-token-file" => {
            std::fs::create_dir_all(dir)?;
            let path = dir.join("token");
            std::fs::write(&path, format!("{CHART_TOKEN}\n"))?;
            path.display().to_string()
        }
        _ => return Ok(None),
    }))
}

/// With TLS or a token among `args`, the admin API of the run at `admin` holds them: curl with
/// the CA (and the client certificate when one is required) and the token gets 200; without
/// the token, 401.
pub(super) fn access_holds(
    args: &[String],
    admin: &str,
    dir: &Path,
    pki: &test_harness::Pki,
    case: &str,
) -> Result<()> {
    let has = |f: &str| args.iter().any(|a| a == f);
    let (tls, mutual, token) = (
        has("--tls-cert"),
        has("--tls-client-ca"),
        has("--auth-token-file"),
    );
    if !tls && !token {
        return Ok(());
    }
    let scheme = if tls { "https" } else { "http" };
    let url = format!("{scheme}://{admin}/api/violations");
    let curl = |with_token: bool| -> Result<String> {
        let mut cmd = Command::new(test_harness::system_bin("curl"));
        cmd.args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--max-time",
            "10",
        ]);
        if tls {
            cmd.arg("--cacert").arg(pki.path("ca.crt"));
        }
        if mutual {
            cmd.arg("--cert").arg(pki.path("client.crt"));
            cmd.arg("--key").arg(pki.path("client.key"));
        }
        if with_token {
            cmd.args(["-H", &format!("Authorization: Bearer {CHART_TOKEN}")]);
        }
        let out = cmd
            .arg(&url)
            .current_dir(dir)
            .stdin(Stdio::null())
            .output()?;
        Ok(String::from_utf8_lossy(&out.stdout).to_string())
    };
    let with = curl(true)?;
    ensure!(
        with == "200",
        "{case}: {url} with the token answered {with}"
    );
    if token {
        let without = curl(false)?;
        ensure!(
            without == "401",
            "{case}: {url} without the token answered {without}"
        );
    }
    Ok(())
}

/// A rendered `agent`/`checker` argument list made local: listeners on loopback port 0, paths in
/// `dir`, NATS at `nats`, `$(VAR)`s from `vars`.
pub(super) fn local_args(
    args: &[&str],
    dir: &Path,
    nats: &str,
    vars: &[(&str, &str)],
    pki: &test_harness::Pki,
    case: &str,
) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for a in args.iter().skip(1) {
        let (flag, value) = a.split_once('=').unwrap_or((a, ""));
        if let Some(local) = access_file(flag, dir, pki)? {
            out.extend([flag.to_string(), local]);
            continue;
        }
        let mut value = value.to_string();
        for (k, v) in vars {
            value = value.replace(&format!("$({k})"), v);
        }
        let file = |v: &str| {
            dir.join(Path::new(v).file_name().unwrap_or_default())
                .display()
                .to_string()
        };
        let value = match flag {
            "--otlp-grpc" | "--otlp-http" | "--admin" | "--metrics-addr" => {
                "127.0.0.1:0".to_string()
            }
            "--nats" => nats.to_string(),
            "--ebpf" => "off".into(),
            "--spool-dir" => dir.join("spool").display().to_string(),
            "--alert-config" | "--config" | "--rules" => file(&value),
            _ => value,
        };
        ensure!(!value.contains("$("), "{case}: {a} needs an unset variable");
        out.push(flag.to_string());
        if a.contains('=') {
            out.push(value);
        }
    }
    Ok(out)
}

/// `revenant SUB args --ready-file DIR/ready`, ready file within 30 s, then `/readyz` 200
/// within 30 s. Returns the process (stopped on drop) and its ready file's object.
pub(super) fn start_member(
    revenant: &Path,
    dir: &Path,
    sub: &str,
    args: &[String],
) -> Result<(test_harness::Proc, Value)> {
    use std::time::Instant;
    let ready = dir.join("ready");
    let log = dir.join("stderr");
    let mut cmd = Command::new(revenant);
    cmd.arg(sub)
        .args(args)
        .arg("--ready-file")
        .arg(&ready)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(dir.join("stdout"))?)
        .stderr(std::fs::File::create(&log)?);
    let mut proc = test_harness::Proc::spawn(&format!("revenant {sub}"), &mut cmd)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let announced = loop {
        if let Ok(text) = std::fs::read_to_string(&ready)
            && let Ok(v) = serde_json::from_str::<Value>(&text)
        {
            break v;
        }
        if let Some(s) = proc.exited() {
            bail!(
                "revenant {sub} exited before it was ready ({s}):\n{}",
                test_harness::tail(&log, 30)
            );
        }
        ensure!(
            Instant::now() < deadline,
            "revenant {sub} not ready within 30 s:\n{}",
            test_harness::tail(&log, 30)
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    // Probes and scrapers use the metrics port when the admin port is behind TLS or a token.
    let admin = announced["metrics"]
        .as_str()
        .or(announced["admin"].as_str())
        .unwrap_or_default()
        .to_string();
    let (code, body) = test_harness::http_get(&format!("http://{admin}/healthz"))?;
    ensure!(code == 200, "revenant {sub}: /healthz {code} {body}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (code, body) = test_harness::http_get(&format!("http://{admin}/readyz"))?;
        if code == 200 {
            break;
        }
        ensure!(
            Instant::now() < deadline && proc.exited().is_none(),
            "revenant {sub}: /readyz {code} {body}\n{}",
            test_harness::tail(&log, 30)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok((proc, announced))
}

/// Cluster mode's rendered command lines run by the real binary against a real
/// `nats-server -js` on loopback (three clustered servers when the stream is R3): the agent, then
/// every checker replica (all with the one `--config` file), all running together, each
/// `/readyz` 200.
pub(super) fn cluster_starts(
    revenant: &Path,
    docs: &[Value],
    out: &Path,
    case: &str,
) -> Result<()> {
    let agent = &one(docs, "DaemonSet")?["spec"]["template"]["spec"]["containers"][0];
    let base = out.join(format!("{case}-run"));
    let _ = std::fs::remove_dir_all(&base);
    // The chart's NATS: its rendered command line, every server on loopback. An external one:
    // a `nats-server -js` of the harness.
    let (rendered_nats, harness_nats, url) = match kind(docs, "StatefulSet")
        .into_iter()
        .find(|s| s["metadata"]["labels"]["app.kubernetes.io/component"] == "nats")
    {
        Some(sts) => {
            let (servers, url) = nats_starts(sts, &base.join("nats"), case)?;
            (servers, None, url)
        }
        None => {
            let nats =
                test_harness::Nats::single().context("nats-server -js (cargo xtask setup)")?;
            let url = nats.urls();
            (Vec::new(), Some(nats), url)
        }
    };
    let write_files = |dir: &Path| -> Result<()> {
        std::fs::create_dir_all(dir)?;
        if let Some(secret) = kind(docs, "Secret").first() {
            let alert = secret["stringData"]["alert.yaml"].as_str().unwrap_or("{}");
            std::fs::write(dir.join("alert.yaml"), alert)?;
        }
        if let Some(cm) = kind(docs, "ConfigMap").into_iter().find(|c| {
            c["metadata"]["labels"]["app.kubernetes.io/component"] == "node-agent"
                && c["data"]["revenant-overview.json"].is_null()
        }) {
            for (key, body) in cm["data"].as_object().into_iter().flatten() {
                std::fs::write(dir.join(key), body.as_str().unwrap_or_default())?;
            }
        }
        Ok(())
    };
    let pki = test_harness::Pki::new(&format!("chart-{case}"));
    let dir = base.join("agent");
    write_files(&dir)?;
    let args = local_args(
        &strings(&agent["args"]),
        &dir,
        &url,
        &[("NODE_NAME", "chart-test")],
        &pki,
        case,
    )?;
    let (agent, announced) = start_member(revenant, &dir, "agent", &args)
        .with_context(|| format!("{case}: revenant agent {}", args.join(" ")))?;
    let admin = announced["admin"].as_str().unwrap_or_default();
    access_holds(&args, admin, &dir, &pki, &format!("{case} agent"))?;
    let checker =
        &component(docs, "StatefulSet", "checker")?["spec"]["template"]["spec"]["containers"][0];
    let mut checkers = Vec::new();
    let sts_name = component(docs, "StatefulSet", "checker")?["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let (body, replicas) = checker_file(docs)?;
    for k in 0..replicas {
        let pod = format!("{sts_name}-{k}");
        let dir = base.join(&pod);
        write_files(&dir)?;
        std::fs::write(dir.join("checker.yaml"), &body)?;
        let args = local_args(
            &strings(&checker["args"]),
            &dir,
            &url,
            &[("POD_NAME", &pod), ("POD_IP", "127.0.0.1")],
            &pki,
            case,
        )?;
        let (proc, announced) = start_member(revenant, &dir, "checker", &args)
            .with_context(|| format!("{case}: {pod}: revenant checker {}", args.join(" ")))?;
        let admin = announced["admin"].as_str().unwrap_or_default();
        access_holds(&args, admin, &dir, &pki, &format!("{case} {pod}"))?;
        // No pin: the replica shares the partitions with the others through leases.
        ensure!(
            announced["partitions"] == "leased",
            "{case}: {pod} announces partitions {}, not leased ones",
            announced["partitions"]
        );
        checkers.push(proc);
    }
    drop(checkers);
    drop(agent);
    drop(harness_nats);
    drop(rendered_nats);
    let _ = std::fs::remove_dir_all(&base);
    Ok(())
}

/// The chart's NATS StatefulSet as rendered, one `nats-server` per replica on loopback: the
/// rendered flags, with the addresses on 127.0.0.1 and free ports, the routes' stable names
/// mapped to the servers' route ports, the store in `dir`. Returns the servers once each one's
/// liveness check (`/healthz?js-enabled-only=true`) answers 200, and their client URLs.
pub(super) fn nats_starts(
    sts: &Value,
    dir: &Path,
    case: &str,
) -> Result<(Vec<test_harness::Proc>, String)> {
    use std::time::Instant;
    let name = sts["metadata"]["name"].as_str().unwrap_or_default();
    let n = sts["spec"]["replicas"].as_u64().unwrap_or(0) as usize;
    let c = &sts["spec"]["template"]["spec"]["containers"][0];
    let args = strings(&c["args"]);
    let live = c["livenessProbe"]["httpGet"]["path"]
        .as_str()
        .unwrap_or("/healthz");
    let mut ports = Vec::new();
    for _ in 0..n {
        ports.push((
            test_harness::free_port()?,
            test_harness::free_port()?,
            test_harness::free_port()?,
        ));
    }
    let mut servers = Vec::new();
    for (i, (client, route, monitor)) in ports.iter().enumerate() {
        let pod = format!("{name}-{i}");
        let store = dir.join(&pod);
        std::fs::create_dir_all(&store)?;
        let mut cmd = Command::new(test_harness::system_bin("nats-server"));
        for a in &args {
            let (f, v) = a.split_once('=').unwrap_or((a, ""));
            let v = match f {
                "--server_name" => v.replace("$(POD_NAME)", &pod),
                "--addr" => "127.0.0.1".into(),
                "--port" => client.to_string(),
                "--http_port" => monitor.to_string(),
                "--store_dir" => store.display().to_string(),
                "--cluster" => format!("nats://127.0.0.1:{route}"),
                "--routes" => {
                    let mut mapped = Vec::new();
                    for (j, r) in v.split(',').enumerate() {
                        ensure!(
                            r.starts_with(&format!("nats://{name}-{j}.{name}.")),
                            "{case}: route {r} is not server {j}'s stable name"
                        );
                        mapped.push(format!("nats://127.0.0.1:{}", ports[j].1));
                    }
                    mapped.join(",")
                }
                _ => v.to_string(),
            };
            ensure!(
                !v.contains("$("),
                "{case}: NATS {a} needs an unset variable"
            );
            cmd.arg(if a.contains('=') {
                format!("{f}={v}")
            } else {
                a.to_string()
            });
        }
        cmd.arg("-l")
            .arg(dir.join(format!("{pod}.log")))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        servers.push(test_harness::Proc::spawn(&pod, &mut cmd)?.with_grace(Duration::ZERO));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    for (i, (_, _, monitor)) in ports.iter().enumerate() {
        loop {
            if let Ok((200, _)) =
                test_harness::http_get(&format!("http://127.0.0.1:{monitor}{live}"))
            {
                break;
            }
            ensure!(
                Instant::now() < deadline && servers[i].exited().is_none(),
                "{case}: rendered NATS server {i} not healthy ({live}) within 30 s:\n{}",
                test_harness::tail(&dir.join(format!("{name}-{i}.log")), 20)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    let urls: Vec<String> = ports
        .iter()
        .map(|(client, _, _)| format!("nats://127.0.0.1:{client}"))
        .collect();
    Ok((servers, urls.join(",")))
}
