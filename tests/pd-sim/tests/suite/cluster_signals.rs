//! `pd-sim cluster` as a service manager or a shell script drives it: SIGTERM stops the cluster
//! and every child, and a log that is not a terminal carries no colour codes.

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only probes for the process.
    unsafe { libc::kill(pid, 0) == 0 }
}

#[test]
fn sigterm_stops_the_cluster_and_its_children_and_the_log_is_plain_text() {
    let err_path = std::env::temp_dir().join(format!("pd-sim-signals-{}.err", std::process::id()));
    let err = std::fs::File::create(&err_path).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_pd-sim"))
        .args(["cluster", "--ephemeral"])
        .stdout(Stdio::piped())
        .stderr(err)
        .spawn()
        .expect("starting pd-sim cluster");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = lines
        .find_map(|l| {
            l.ok()
                .and_then(|l| l.strip_prefix("READY ").map(String::from))
        })
        .expect("a READY line");
    let ready: serde_json::Value = serde_json::from_str(&ready).unwrap();
    let pids: Vec<i32> = ["router", "prefill", "decode"]
        .iter()
        .map(|k| ready["pids"][k].as_i64().expect("child pid") as i32)
        .collect();
    assert!(pids.iter().all(|&p| alive(p)), "children up: {pids:?}");

    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "pd-sim cluster still running 10 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "cluster exit after SIGTERM: {status}");
    // The children were reaped by the cluster before it exited: none may linger.
    let lingering: Vec<i32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    for &p in &lingering {
        // SAFETY: clean up what the assertion below reports.
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
    assert!(
        lingering.is_empty(),
        "children left after the cluster exited: {lingering:?}"
    );

    let mut log = Vec::new();
    std::fs::File::open(&err_path)
        .unwrap()
        .read_to_end(&mut log)
        .unwrap();
    let _ = std::fs::remove_file(&err_path);
    assert!(
        log.windows(b"worker ready".len())
            .any(|w| w == b"worker ready"),
        "the cluster's log has the workers' lines: {}",
        String::from_utf8_lossy(&log)
    );
    assert!(
        !log.contains(&0x1b),
        "colour codes in a log that is not a terminal: {}",
        String::from_utf8_lossy(&log)
    );
}
