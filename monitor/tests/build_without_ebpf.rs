//! `revenant` builds without the eBPF toolchain (`--no-default-features --features runtime`: no
//! `ebpf` feature) for `check` and CI pipelines: with `bpf-linker` off `PATH`, the build
//! succeeds, `check` gives the verdicts the default build gives, `--version` says there is no
//! eBPF object, `run --ebpf on` is refused (exit 2) and `run` (`--ebpf auto`) says in `/readyz`
//! why it has no eBPF source.
//!
//! The build shares the intermediate artifacts of the build this test executable came from
//! (cargo's `build-dir`: the same profile, the whole workspace selected and test targets built,
//! so cargo resolves the dependencies' features as that build did and compiles none of them
//! again) and puts its binary in a target directory of its own (`no-ebpf/` beside them), so the
//! default build's binary is left alone. Only `revenant` itself is compiled, without the
//! optimizer: seconds, where a target directory of its own compiled every dependency again
//! (minutes on 2 cores). It waits for cargo's lock while another build holds that directory.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::*;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `PATH` with every directory that holds `bpf-linker` replaced by a copy of it (symlinks)
/// without `bpf-linker`: cargo and rustc stay reachable, bpf-linker does not.
fn path_without_bpf_linker(scratch: &Path) -> std::ffi::OsString {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let dirs: Vec<PathBuf> = std::env::split_paths(&path)
        .enumerate()
        .map(|(i, d)| {
            if !d.join("bpf-linker").exists() {
                return d;
            }
            let copy = scratch.join(format!("path-{i}"));
            std::fs::create_dir_all(&copy).unwrap();
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                if e.file_name() != "bpf-linker" {
                    let _ = std::os::unix::fs::symlink(e.path(), copy.join(e.file_name()));
                }
            }
            copy
        })
        .collect();
    std::env::join_paths(dirs).unwrap()
}

/// The profile and build directory this executable was built in (`<dir>/<profile>/deps/<this>`):
/// the dependencies it holds were compiled for the whole workspace's tests, in this profile.
fn built_in() -> test_harness::BuildProfile {
    let exe = std::env::current_exe().unwrap();
    test_harness::BuildProfile::of(&exe).unwrap_or_else(|e| panic!("{e:#}"))
}

#[test]
fn a_build_without_the_ebpf_feature_needs_no_bpf_linker_and_checks() {
    let scratch = tempfile::tempdir().unwrap();
    let path = path_without_bpf_linker(scratch.path());
    assert!(
        std::env::split_paths(&path).all(|d| !d.join("bpf-linker").exists()),
        "bpf-linker still on PATH"
    );
    let profile = built_in();
    let build_dir = &profile.target_dir;
    let target = build_dir.join("no-ebpf");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let log = scratch.path().join("build.log");
    let mut cmd = Command::new(cargo);
    cmd.current_dir(root())
        // `cargo test --no-run` over the workspace, as the build that made this executable: the
        // same packages and dev-dependencies, so the same features for every dependency.
        .args([
            "test",
            "--no-run",
            "--workspace",
            "--exclude",
            "monitor-ebpf",
        ])
        .args(["--no-default-features", "--features", "revenant/runtime"])
        // An integration test of `revenant` makes cargo build its binary (`CARGO_BIN_EXE_*`).
        .args(["--test", "build_without_ebpf"])
        .arg("--config")
        .arg(format!(
            "build.build-dir={:?}",
            build_dir.display().to_string()
        ))
        .args(["--profile", &profile.name])
        .arg("--config")
        .arg(format!(
            "profile.{}.package.revenant.opt-level=0",
            profile.name
        ))
        .arg("--target-dir")
        .arg(&target)
        .env("PATH", &path)
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_BUILD_DIR")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    let mut build = cmd.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(40 * 60);
    let status = loop {
        if let Some(s) = build.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = build.kill();
            let _ = build.wait();
            panic!("the build took over 40 min:\n{}", tail(&log, 30));
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(status.success(), "build failed:\n{}", tail(&log, 40));
    let bin = target.join(&profile.dir).join("revenant");

    let o = Command::new(&bin).arg("--version").output().unwrap();
    let version = String::from_utf8_lossy(&o.stdout);
    assert!(
        version.contains("ebpf object: none (built without the `ebpf` feature"),
        "{version}"
    );

    let scenario = root().join("tests/scenarios/smg-prefill-400-decode-alive.jsonl");
    let plain = Command::new(&bin)
        .arg("check")
        .arg(&scenario)
        .output()
        .unwrap();
    let default = Command::new(env!("CARGO_BIN_EXE_revenant"))
        .arg("check")
        .arg(&scenario)
        .output()
        .unwrap();
    assert_eq!(plain.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&plain.stdout),
        String::from_utf8_lossy(&default.stdout)
    );

    let o = Command::new(&bin)
        .args(["run", "--ebpf", "on", "--admin", "127.0.0.1:0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--ebpf on: this revenant was built without the eBPF source"),
        "{err}"
    );

    let dir = scratch.path().join("run");
    std::fs::create_dir_all(&dir).unwrap();
    let mut rv =
        test_harness::Revenant::start(&bin, &dir, &["--ebpf", "auto", "--otlp-grpc", "off"])
            .unwrap();
    assert_eq!(rv.ready["ebpf"], "unavailable", "{}", rv.ready);
    let (code, body) = admin_get(&rv.admin, "/readyz");
    assert_eq!(code, 200, "OTLP is on: {body}");
    let ready: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(
        ready["disabled"]["ebpf"]
            .as_str()
            .is_some_and(|w| w.contains("built without the eBPF source")),
        "{body}"
    );
    let (_, metrics) = admin_get(&rv.admin, "/metrics");
    assert!(metrics.contains("ebpf_sha256=\"none\""), "{metrics}");
    assert!(
        rv.stop_within(Duration::from_secs(20)).unwrap().success(),
        "{}",
        rv.log_text()
    );
}
