//! `cargo xtask image`: the OCI image of `revenant`, built offline with podman `FROM scratch`:
//! the release binary and exactly the shared libraries `ldd` says it loads, an `/etc/passwd`
//! naming the non-root default user, the spool directory, OCI labels. File times are fixed and
//! `--timestamp 0` fixes the image's own, so one commit's binary gives one image id.
//!
//! `podman run` cannot start containers on every host (it needs setrlimit), so the test runs the
//! image's root filesystem directly: `podman image mount`, then `unshare --mount` + `chroot` as
//! the image's user, with a scratch directory bound where the spool lives (the root filesystem
//! stays read-only, as the chart mounts it), and checks that `revenant run` starts, answers
//! `/healthz` and `/readyz`, and catches an incident replayed by the OpenTelemetry SDK.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};

/// The default (non-root) user; the chart runs uid 0 only when the eBPF source is on.
pub const USER: u32 = 65532;
/// Where the image keeps the binary.
const BIN: &str = "/usr/bin/revenant";
/// A fixed file time (2026-01-01T00:00:00Z) for every staged file.
const FILE_TIME: &str = "202601010000.00";

pub struct Built {
    pub reference: String,
    pub id: String,
}

/// Builds `localhost/revenant:<version>` from `revenant` (a release binary).
pub fn build(revenant: &Path) -> Result<Built> {
    let root = test_harness::workspace_root();
    let version = binary_version(revenant)?;
    let stage = root.join("target/image");
    let rootfs = stage.join("rootfs");
    let _ = std::fs::remove_dir_all(&stage);
    for d in [
        "usr/bin",
        "etc",
        "tmp",
        "var/lib/revenant",
        "proc",
        "sys",
        "dev",
    ] {
        std::fs::create_dir_all(rootfs.join(d))?;
    }
    // The release profile keeps debug info (for profiles of the benches): 100 MB the image
    // does not need.
    run(
        Command::new("objcopy")
            .arg("--strip-debug")
            .arg(revenant)
            .arg(rootfs.join(BIN.trim_start_matches('/'))),
        "objcopy --strip-debug",
    )?;
    for lib in shared_libraries(revenant)? {
        let dest = rootfs.join(lib.strip_prefix("/").unwrap_or(&lib));
        std::fs::create_dir_all(dest.parent().expect("a library path has a parent"))?;
        // The file itself, not the symlink ldd named.
        std::fs::copy(std::fs::canonicalize(&lib)?, &dest)
            .with_context(|| format!("copying {}", lib.display()))?;
    }
    std::fs::write(
        rootfs.join("etc/passwd"),
        format!(
            "root:x:0:0:root:/root:/sbin/nologin\nrevenant:x:{USER}:{USER}:revenant:/var/lib/revenant:/sbin/nologin\n"
        ),
    )?;
    std::fs::write(
        rootfs.join("etc/group"),
        format!("root:x:0:\nrevenant:x:{USER}:\n"),
    )?;
    let revision = git_head(&root).unwrap_or_else(|| "unknown".into());
    let reference = format!("localhost/revenant:{version}");
    std::fs::write(
        stage.join("Containerfile"),
        format!(
            r#"FROM scratch
COPY --chown=0:0 rootfs/ /
COPY --chown={USER}:{USER} rootfs/var/lib/revenant /var/lib/revenant
ENV STATE_DIRECTORY=/var/lib/revenant
USER {USER}:{USER}
WORKDIR /var/lib/revenant
EXPOSE 4317 4318 9464
ENTRYPOINT ["{BIN}"]
CMD ["run"]
LABEL org.opencontainers.image.title="revenant" \
      org.opencontainers.image.description="Runtime invariant monitor for disaggregated (prefill/decode) LLM serving" \
      org.opencontainers.image.version="{version}" \
      org.opencontainers.image.revision="{revision}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="scratch"
"#
        ),
    )?;
    // Fixed permissions and times: the layer's bytes depend on the staged files only.
    run(
        Command::new("chmod").arg("1777").arg(rootfs.join("tmp")),
        "chmod",
    )?;
    run(
        Command::new("find")
            .arg(&stage)
            .args(["-exec", "touch", "-h", "-t", FILE_TIME, "{}", "+"]),
        "touch",
    )?;
    let iidfile = stage.join("image-id");
    run(
        Command::new("podman")
            .args(["build", "--quiet", "--timestamp", "0", "--pull=never"])
            .args(["--tag", &reference, "--iidfile"])
            .arg(&iidfile)
            .arg("--file")
            .arg(stage.join("Containerfile"))
            .arg(&stage),
        "podman build",
    )?;
    let id = std::fs::read_to_string(&iidfile)?.trim().to_string();
    Ok(Built { reference, id })
}

fn binary_version(revenant: &Path) -> Result<String> {
    let out = Command::new(revenant)
        .arg("--version")
        .output()
        .with_context(|| format!("running {} --version", revenant.display()))?;
    ensure!(out.status.success(), "revenant --version failed");
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .nth(1)
        .map(str::to_string)
        .ok_or_else(|| anyhow!("revenant --version printed {text:?}"))
}

/// The absolute paths of every shared object `ldd` resolves for `bin`, the loader included.
fn shared_libraries(bin: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(bin)
        .output()
        .context("running ldd")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if text.contains("statically linked") || text.contains("not a dynamic executable") {
        return Ok(Vec::new());
    }
    ensure!(out.status.success(), "ldd {} failed: {text}", bin.display());
    let mut libs = Vec::new();
    for line in text.lines() {
        ensure!(!line.contains("not found"), "ldd: {line}");
        // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)` or `/lib64/ld-linux-x86-64.so.2 (0x…)`
        let path = match line.split_once("=>") {
            Some((_, rhs)) => rhs.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            libs.push(PathBuf::from(p));
        }
    }
    ensure!(!libs.is_empty(), "ldd listed no library: {text}");
    Ok(libs)
}

fn git_head(root: &Path) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(root)
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The image's labels, user, entrypoint and layer, then `revenant run` from its root filesystem.
pub fn test(built: &Built, otlp_python: &Path) -> Result<()> {
    let inspect = Command::new("podman")
        .args([
            "image",
            "inspect",
            "--format",
            "{{json .Config}}",
            &built.id,
        ])
        .output()?;
    ensure!(inspect.status.success(), "podman image inspect failed");
    let config: serde_json::Value = serde_json::from_slice(&inspect.stdout)?;
    ensure!(
        config["User"] == format!("{USER}:{USER}"),
        "user {}",
        config["User"]
    );
    ensure!(
        config["Entrypoint"] == serde_json::json!([BIN]),
        "{}",
        config["Entrypoint"]
    );
    for label in [
        "org.opencontainers.image.title",
        "org.opencontainers.image.version",
        "org.opencontainers.image.revision",
        "org.opencontainers.image.licenses",
    ] {
        ensure!(config["Labels"][label].is_string(), "no label {label}");
    }
    let mount = Command::new("podman")
        .args(["image", "mount", &built.id])
        .output()?;
    ensure!(
        mount.status.success(),
        "podman image mount: {}",
        String::from_utf8_lossy(&mount.stderr).trim()
    );
    let rootfs = PathBuf::from(String::from_utf8_lossy(&mount.stdout).trim());
    // The process gets the image's environment only, as a runtime gives it.
    let env: Vec<String> = config["Env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect();
    ensure!(
        env.iter().any(|e| e == "STATE_DIRECTORY=/var/lib/revenant"),
        "image environment {env:?}"
    );
    let result = run_from_rootfs(&rootfs, &env, otlp_python);
    let _ = Command::new("podman")
        .args(["image", "unmount", &built.id])
        .stdout(Stdio::null())
        .status();
    result
}

fn run_from_rootfs(rootfs: &Path, env: &[String], otlp_python: &Path) -> Result<()> {
    let env_words: String = env.iter().map(|e| format!(" '{e}'")).collect();
    // The smoke command, as the image's user.
    let version = Command::new("chroot")
        .env_clear()
        .envs(env.iter().filter_map(|e| e.split_once('=')))
        .arg(format!("--userspec={USER}:{USER}"))
        .arg(rootfs)
        .args([BIN, "--version"])
        .output()?;
    ensure!(
        version.status.success()
            && String::from_utf8_lossy(&version.stdout).starts_with("revenant "),
        "revenant --version in the image: {} {}",
        String::from_utf8_lossy(&version.stdout),
        String::from_utf8_lossy(&version.stderr)
    );
    let scratch = test_harness::ScratchDir::new("image-rootfs")?;
    let state = scratch.path().join("state");
    std::fs::create_dir_all(&state)?;
    std::os::unix::fs::chown(&state, Some(USER), Some(USER))?;
    let log = std::fs::File::create(scratch.path().join("revenant.log"))?;
    let alerts = state.join("alerts.jsonl");
    let ready = state.join("ready.json");
    // A private mount namespace: the spool directory bound in, /proc and /dev as a runtime
    // gives them; the image's own files stay read-only.
    let script = format!(
        "set -e; r='{root}'; mount --bind '{state}' \"$r/var/lib/revenant\"; \
         mount -t proc proc \"$r/proc\"; mount --rbind /dev \"$r/dev\"; \
         exec env -i{env_words} /usr/sbin/chroot --userspec={USER}:{USER} \"$r\" {BIN} run \
         --ebpf off --node image-test --otlp-grpc 127.0.0.1:0 --otlp-http 127.0.0.1:0 \
         --admin 127.0.0.1:0 --alerts-jsonl /var/lib/revenant/alerts.jsonl \
         --ready-file /var/lib/revenant/ready.json",
        root = rootfs.display(),
        state = state.display(),
    );
    let mut cmd = Command::new("unshare");
    cmd.args([
        "--mount",
        "--fork",
        "--kill-child",
        "--",
        "sh",
        "-c",
        &script,
    ])
    .stdout(Stdio::null())
    .stderr(log);
    let mut proc = test_harness::Proc::spawn("revenant (image rootfs)", &mut cmd)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let ready_line: serde_json::Value = loop {
        if let Ok(text) = std::fs::read_to_string(&ready)
            && let Ok(v) = serde_json::from_str(&text)
        {
            break v;
        }
        if let Some(status) = proc.exited() {
            bail!(
                "revenant from the image exited ({status}) before it was ready:\n{}",
                test_harness::tail(&scratch.path().join("revenant.log"), 30)
            );
        }
        ensure!(
            Instant::now() < deadline,
            "revenant from the image not ready in 30 s:\n{}",
            test_harness::tail(&scratch.path().join("revenant.log"), 30)
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let addr = |k: &str| {
        ready_line[k]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| anyhow!("ready file without {k}: {ready_line}"))
    };
    let (admin, grpc, http) = (addr("admin")?, addr("otlp_grpc")?, addr("otlp_http")?);
    for path in ["/healthz", "/readyz"] {
        let (code, body) = test_harness::http_get(&format!("http://{admin}{path}"))?;
        ensure!(
            code == 200,
            "{path} of revenant from the image: {code} {body}"
        );
    }
    // The disclosed failure, replayed by the real OpenTelemetry SDK: prefill rejects an attempt,
    // its decode leg still receives KV and decodes.
    let emitted = Command::new(otlp_python)
        .arg(test_harness::workspace_root().join("tests/otlp/emit.py"))
        .args(["--grpc", &grpc, "--http", &http])
        .args([
            "--transport",
            "grpc",
            "--scenario",
            "reject-then-decode",
            "--tag",
            "0ca7",
        ])
        .output()?;
    ensure!(
        emitted.status.success(),
        "emit.py: {}",
        String::from_utf8_lossy(&emitted.stderr)
    );
    let sent: serde_json::Value = String::from_utf8_lossy(&emitted.stdout)
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .ok_or_else(|| anyhow!("emit.py printed no summary"))?;
    let rid = sent["rid"]
        .as_str()
        .ok_or_else(|| anyhow!("emit.py sent no rid: {sent}"))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let caught = test_harness::read_jsonl_so_far(&alerts).iter().any(|a| {
            let text = a.to_string();
            text.contains(rid) && text.contains("activity-after-rejection")
        });
        if caught {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "no activity-after-rejection alert for {rid} from revenant in the image:\n{}",
            test_harness::tail(&scratch.path().join("revenant.log"), 30)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(proc);
    Ok(())
}

fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let out = cmd.output().with_context(|| format!("starting {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}
