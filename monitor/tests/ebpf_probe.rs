//! Real probe tests: load the kernel programs and watch real processes on loopback.
//!
//! They need root (or CAP_BPF + CAP_PERFMON), python3, and what `cargo xtask setup` installs.
//! They FAIL, loudly, when the probes cannot load: a node where the probes silently do nothing
//! is exactly what this suite must catch. Run: `cargo test -p revenant --test ebpf_probe`.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod support;

use monitor_common::counter;
use revenant::ingest::ebpf::{CaptureConfig, Discovery, EbpfConfig, EbpfSource, Probes, Role};
use revenant::{Kind, LifecycleEvent, Stage};
use support::ebpf::start_source;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn free_port() -> u16 {
    test_harness::free_port().unwrap()
}

/// A fake worker or router (tests/fixtures, python3) that says READY (the router then waits
/// for a line on stdin, see `go`); killed when the test ends, however it ends.
struct Fake {
    child: test_harness::Proc,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl Fake {
    /// Starts it and waits for READY; `None` when it exited first (a port another process took
    /// between `free_port` and its bind: the caller retries with new ports).
    fn spawn(args: &[String]) -> Option<Fake> {
        let mut child = test_harness::Proc::spawn(
            "python3",
            Command::new("python3")
                .args(args)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit()),
        )
        .expect("python3 must be installed for the probe tests")
        .with_grace(Duration::ZERO);
        let stdout = child.child_mut().stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stdin = child.child_mut().stdin.take();
        let mut p = Fake {
            child,
            stdin,
            lines,
        };
        match p.next_line("READY") {
            Ok(_) => Some(p),
            Err(mpsc::RecvTimeoutError::Disconnected) => None,
            Err(e) => panic!("process {} never printed READY: {e}", p.child.pid()),
        }
    }

    fn pid(&self) -> u32 {
        self.child.pid()
    }

    fn next_line(&mut self, prefix: &str) -> Result<String, mpsc::RecvTimeoutError> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return Ok(l),
                Ok(_) => continue,
                Err(e) => return Err(e),
            }
        }
    }

    fn expect_line(&mut self, prefix: &str) -> String {
        self.next_line(prefix).unwrap_or_else(|e| {
            panic!("process {} never printed {prefix:?}: {e}", self.child.pid())
        })
    }

    fn go(&mut self) {
        self.send_line("go");
    }

    fn send_line(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        stdin.write_all(format!("{line}\n").as_bytes()).unwrap();
        stdin.flush().unwrap();
    }
}

/// A connection to `to` from a socket with `SO_REUSEADDR`, so that another process's socket
/// with it may take the same local port for a connection elsewhere.
fn connect_sharing_its_port(to: std::net::SocketAddr) -> std::net::TcpStream {
    use std::os::fd::FromRawFd;
    let std::net::SocketAddr::V4(to) = to else {
        panic!("an IPv4 listener")
    };
    // SAFETY: plain socket calls on a descriptor this function owns until it hands it over.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let one: libc::c_int = 1;
        let set = libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
        assert_eq!(set, 0, "SO_REUSEADDR: {}", std::io::Error::last_os_error());
        let sin = |port: u16| libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from_ne_bytes(to.ip().octets()),
            },
            sin_zero: [0; 8],
        };
        // Bound before the connect: a port the connect picks for an unbound socket may already
        // be shared with other sockets that lack SO_REUSEADDR, and the outsider's bind to it
        // would then fail.
        let local = sin(0);
        let rc = libc::bind(
            fd,
            (&local as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        );
        assert_eq!(rc, 0, "bind: {}", std::io::Error::last_os_error());
        let sin = sin(to.port());
        let rc = libc::connect(
            fd,
            (&sin as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        );
        assert_eq!(rc, 0, "connect: {}", std::io::Error::last_os_error());
        std::net::TcpStream::from_raw_fd(fd)
    }
}

struct Pd {
    prefill: Fake,
    decode: Fake,
    router: Fake,
    room: u64,
}

/// Starts fake prefill (rejecting with 400) and decode workers and a fake router in front; with
/// new ports when one of them was taken before a fake could bind it.
fn start_pd(
    canary: &str,
    request_id: &str,
    repeat: u32,
    prompt_bytes: usize,
    router_extra: &[&str],
) -> Pd {
    for _ in 0..5 {
        if let Some(pd) = try_start_pd(canary, request_id, repeat, prompt_bytes, router_extra) {
            return pd;
        }
    }
    panic!("the fake workers and router could not bind their ports in 5 tries");
}

fn try_start_pd(
    canary: &str,
    request_id: &str,
    repeat: u32,
    prompt_bytes: usize,
    router_extra: &[&str],
) -> Option<Pd> {
    let (pp, dp, bp, kp) = (free_port(), free_port(), free_port(), free_port());
    let worker = fixture("fake_worker.py").display().to_string();
    let prefill = Fake::spawn(&[
        worker.clone(),
        "--role".into(),
        "prefill".into(),
        "--port".into(),
        pp.to_string(),
        "--bootstrap-port".into(),
        bp.to_string(),
        "--kv-port".into(),
        kp.to_string(),
    ])?;
    let decode = Fake::spawn(&[
        worker,
        "--role".into(),
        "decode".into(),
        "--port".into(),
        dp.to_string(),
    ])?;
    let room = 9066467638188682269u64 - u64::from(pp);
    let router = Fake::spawn(
        &[
            fixture("fake_router.py").display().to_string(),
            "--prefill".into(),
            pp.to_string(),
            "--decode".into(),
            dp.to_string(),
            "--bootstrap-port".into(),
            bp.to_string(),
            "--room".into(),
            room.to_string(),
            "--prompt-bytes".into(),
            prompt_bytes.to_string(),
            "--canary".into(),
            canary.into(),
            "--request-id".into(),
            request_id.into(),
            "--repeat".into(),
            repeat.to_string(),
        ]
        .into_iter()
        .chain(router_extra.iter().map(|a| a.to_string()))
        .collect::<Vec<_>>(),
    )?;
    Some(Pd {
        prefill,
        decode,
        router,
        room,
    })
}

fn pd_discovery(pd: &Pd) -> Discovery {
    Discovery {
        pids: vec![
            revenant::ingest::ebpf::PidRule {
                role: Role::Prefill,
                pid: pd.prefill.pid(),
            },
            revenant::ingest::ebpf::PidRule {
                role: Role::Decode,
                pid: pd.decode.pid(),
            },
            revenant::ingest::ebpf::PidRule {
                role: Role::Router,
                pid: pd.router.pid(),
            },
        ],
        watch: vec![],
        conventions: false,
    }
}

fn wait_watched(src: &mut EbpfSource, pids: &[u32]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut sink = Vec::new();
    while !pids.iter().all(|p| src.watched().contains_key(p)) {
        assert!(
            Instant::now() < deadline,
            "processes {pids:?} never watched: {:?}",
            src.watched()
        );
        src.rescan();
        src.drain(&mut sink);
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn has(events: &[LifecycleEvent], stage: Stage, kind: Kind, room: Option<u64>) -> bool {
    events.iter().any(|e| {
        e.stage == stage
            && e.kind == kind
            && (room.is_none() || e.ids.bootstrap_room.map(|r| r.0) == room)
    })
}

#[test]
fn probes_load_and_attach() {
    let mut probes = Probes::load(&CaptureConfig::default()).unwrap_or_else(|e| {
        panic!("eBPF probes must load on this machine (run as root after `cargo xtask setup`): {e}")
    });
    probes.watch(std::process::id()).expect("watch self");
    assert!(probes.watched_ids().contains(&std::process::id()));
    probes.counters().expect("kernel counters readable");
}

/// Runs the fake router once against a rejecting prefill and a working decode, and returns the
/// events derived from eBPF alone, after checking that the whole lifecycle of the room is there:
/// dispatch to both, prefill received + rejected (400), decode received, KV bootstrap, decode
/// work and completion, every event carrying the request's x-request-id and trace id.
fn reject_then_decode(
    canary: &str,
    request_id: &str,
    prompt_bytes: usize,
    router_extra: &[&str],
) -> (Vec<LifecycleEvent>, EbpfSource) {
    let mut pd = start_pd(canary, request_id, 1, prompt_bytes, router_extra);
    let cfg = EbpfConfig {
        discovery: pd_discovery(&pd),
        node: Some("test-node".into()),
        ..Default::default()
    };
    let mut src = start_source(cfg);
    wait_watched(
        &mut src,
        &[pd.prefill.pid(), pd.decode.pid(), pd.router.pid()],
    );
    pd.router.go();
    let outcome = pd.router.expect_line("{");
    assert!(
        outcome.contains("\"prefill\": 400") && outcome.contains("\"decode\": 200"),
        "{outcome}"
    );

    let room = Some(pd.room);
    let want = [
        (Stage::Router, Kind::Dispatched, room),
        (Stage::Prefill, Kind::Received, room),
        (Stage::Prefill, Kind::Rejected, room),
        (Stage::Decode, Kind::Received, room),
        (Stage::Transfer, Kind::Received, room),
        (Stage::Transfer, Kind::Received, None),
        (Stage::Decode, Kind::Work, room),
        (Stage::Decode, Kind::Completed, room),
    ];
    let mut events = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !want.iter().all(|(s, k, r)| has(&events, *s, *k, *r)) && Instant::now() < deadline {
        src.drain(&mut events);
        std::thread::sleep(Duration::from_millis(20));
    }
    let shown: Vec<String> = events
        .iter()
        .map(|e| {
            format!(
                "{:?}/{:?} room={:?} status={:?} to={:?} detail={:?}",
                e.stage, e.kind, e.ids.bootstrap_room, e.status, e.to, e.detail
            )
        })
        .collect();
    for (s, k, r) in want {
        assert!(
            has(&events, s, k, r),
            "missing {s}/{k} room={r:?}; got:\n{}",
            shown.join("\n")
        );
    }
    let dispatched: Vec<_> = events
        .iter()
        .filter(|e| e.kind == Kind::Dispatched)
        .collect();
    assert_eq!(dispatched.len(), 2, "{shown:#?}");
    assert!(
        dispatched
            .iter()
            .all(|e| e.ids.bootstrap_room.map(|r| r.0) == room)
    );
    assert!(dispatched.iter().any(|e| e.to == Some(Stage::Prefill)));
    assert!(dispatched.iter().any(|e| e.to == Some(Stage::Decode)));
    let rejected = events.iter().find(|e| e.kind == Kind::Rejected).unwrap();
    assert_eq!(rejected.status, Some(400));
    assert_eq!(
        rejected.reason.as_deref(),
        Some("Prefill rejected: over capacity")
    );
    for e in events.iter().filter(|e| e.stage != Stage::Transfer) {
        assert_eq!(e.ids.request_id.as_deref(), Some(request_id), "{e:?}");
        assert_eq!(
            e.ids.trace_id.as_deref(),
            Some("0af7651916cd43dd8448eb211c80319c")
        );
    }
    for e in &events {
        assert_eq!(e.source, revenant::Source::Ebpf);
        assert_eq!(e.node.as_deref(), Some("test-node"));
    }
    (events, src)
}

/// The disclosed bug, seen from the kernel only: the router sends one 300 KB prompt to prefill and
/// decode at once with `bootstrap_room` at the very end of the body; prefill rejects it (400) while
/// decode bootstraps the KV transfer and answers. Also the privacy check: a canary at both ends
/// of the prompt never shows up in any event.
#[test]
fn big_prompt_room_at_the_end_prefill_rejects_decode_works() {
    const CANARY: &str = "CANARY-b7e1d2-PROMPT-TEXT";
    // Every log line of the source, at TRACE, for the privacy check.
    let logs = support::ebpf::LogCapture::global();
    let (events, mut src) = reject_then_decode(CANARY, "req-ebpf-big", 300_000, &[]);
    // The canary sits at both ends of the prompt, so in the captured head and tail windows: it
    // went through the parser, and must reach no event, violation, alert or log line.
    let mut checker = revenant::Checker::new(
        revenant::RuleSet::embedded_defaults(),
        revenant::CheckerConfig::default(),
    );
    let mut violations: Vec<_> = events.iter().flat_map(|e| checker.observe(e)).collect();
    let last = events.iter().map(|e| e.time_ns).max().unwrap_or(0);
    violations.extend(checker.tick(last + 60_000_000_000));
    eprintln!(
        "big prompt: {} events, violations {:?}",
        events.len(),
        violations
            .iter()
            .map(|v| v.rule.as_str())
            .collect::<Vec<_>>()
    );
    let obs = support::ebpf::Observed {
        events: events.clone(),
        violations,
    };
    support::ebpf::assert_canary_absent("CANARY", &obs, &logs);
    assert!(
        logs.text().contains("eBPF: watching process"),
        "the log capture works: {:?}",
        logs.text()
    );
    src.rescan();
    let stats = src.stats();
    assert_eq!(stats.kernel(counter::RINGBUF_DROPS), 0);
    assert!(stats.kernel(counter::SENT) > 0);
    assert!(!stats.coverage_degraded());
}

/// A router whose connections to both workers were open before revenant started (its
/// keep-alive pool across an agent restart): the sockets are found in /proc, in the table of
/// the router's own network namespace, and the request sent on them afterwards is dispatched to
/// both workers. (The workers' ends of those connections are followed too, but the first request
/// on each is read by a `recv` that was already waiting when the watch began: the kernel never
/// reported its entry, so that one request is not seen at the workers; docs/deploy.md.)
#[test]
fn connections_open_before_the_watch_are_followed() {
    let mut pd = start_pd("", "req-ebpf-keepalive", 1, 3000, &["--keep-alive"]);
    let cfg = EbpfConfig {
        discovery: pd_discovery(&pd),
        node: Some("test-node".into()),
        ..Default::default()
    };
    let mut src = start_source(cfg);
    wait_watched(
        &mut src,
        &[pd.prefill.pid(), pd.decode.pid(), pd.router.pid()],
    );
    pd.router.go();
    let outcome = pd.router.expect_line("{");
    assert!(
        outcome.contains("\"prefill\": 400") && outcome.contains("\"decode\": 200"),
        "{outcome}"
    );
    let dispatched_to = |events: &[LifecycleEvent]| {
        let mut to: Vec<Stage> = events
            .iter()
            .filter(|e| {
                e.kind == Kind::Dispatched && e.ids.bootstrap_room.map(|r| r.0) == Some(pd.room)
            })
            .filter_map(|e| e.to)
            .collect();
        to.sort_by_key(|s| format!("{s:?}"));
        to
    };
    let mut events = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while dispatched_to(&events).len() < 2 && Instant::now() < deadline {
        src.drain(&mut events);
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        dispatched_to(&events),
        vec![Stage::Decode, Stage::Prefill],
        "{events:#?}"
    );
    assert!(
        events
            .iter()
            .filter(|e| e.stage == Stage::Router)
            .all(|e| e.ids.request_id.as_deref() == Some("req-ebpf-keepalive"))
    );
}

/// A router whose main thread leaves with `pthread_exit` while a thread it started goes on
/// serving: the kernel reports the leader's exit, but the process is alive, stays watched
/// (without a rescan to watch it again) and its request is seen.
#[test]
fn a_process_whose_leader_thread_exits_stays_watched() {
    let mut pd = start_pd("", "req-ebpf-leader", 1, 3000, &["--leader-exits"]);
    let router = pd.router.pid();
    let cfg = EbpfConfig {
        discovery: pd_discovery(&pd),
        rescan_every: Duration::from_secs(3600),
        ..Default::default()
    };
    let mut src = start_source(cfg);
    wait_watched(&mut src, &[pd.prefill.pid(), pd.decode.pid(), router]);
    // The leader leaves; its thread waits for the next line.
    pd.router.go();
    let status =
        |pid: u32| std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !status(router).contains("State:\tZ") {
        assert!(
            Instant::now() < deadline,
            "the leader never exited: {}",
            status(router)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        !status(router).contains("Threads:\t1\n"),
        "{}",
        status(router)
    );
    let mut events = Vec::new();
    for _ in 0..10 {
        src.drain(&mut events);
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        src.watched().get(&router),
        Some(&Role::Router),
        "a leader thread's exit was taken for the process's"
    );
    pd.router.go();
    let outcome = pd.router.expect_line("{");
    assert!(outcome.contains("\"decode\": 200"), "{outcome}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !has(&events, Stage::Router, Kind::Dispatched, Some(pd.room)) && Instant::now() < deadline
    {
        src.drain(&mut events);
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        has(&events, Stage::Router, Kind::Dispatched, Some(pd.room)),
        "the router's request after its leader left was not seen: {events:#?}"
    );
}

/// A router that writes each request with one `sendmsg` over a dozen iovecs (request line,
/// each header, uneven body pieces, `bootstrap_room` cut across the last two): the kernel gathers
/// each window across iovecs, and the router's own capture still yields the room.
#[test]
fn vectored_writes_are_gathered_across_iovecs() {
    let (_events, mut src) = reject_then_decode("", "req-ebpf-vectored", 3000, &["--vectored"]);
    src.rescan();
    let stats = src.stats();
    assert_eq!(stats.kernel(counter::RINGBUF_DROPS), 0);
    assert_eq!(stats.kernel(counter::READ_FAILURES), 0);
    assert_eq!(stats.kernel(counter::IOV_TRUNCATED), 0);
    assert!(!stats.coverage_degraded());
}

/// A stalled consumer: the kernel ring buffer overflows and a full pipeline channel drops
/// batches; both are counted and raise the "coverage degraded" signal.
#[test]
fn drops_are_counted_and_degrade_coverage() {
    let mut pd = start_pd("", "req-ebpf-drops", 20, 200_000, &[]);
    let cfg = EbpfConfig {
        capture: CaptureConfig {
            head_bytes: 4096,
            tail_bytes: 4096,
            ring_bytes: 16 * 1024,
            wakeup_bytes: 0,
        },
        discovery: pd_discovery(&pd),
        rescan_every: Duration::from_millis(50),
        ..Default::default()
    };
    let mut src = start_source(cfg);
    wait_watched(
        &mut src,
        &[pd.prefill.pid(), pd.decode.pid(), pd.router.pid()],
    );
    let stats = src.stats();
    src.rescan();
    assert!(!stats.coverage_degraded(), "nothing lost yet");
    // Stall: nobody drains the ring buffer while 40 large requests go by.
    pd.router.go();
    pd.router.expect_line("{");
    src.rescan();
    assert!(
        stats.kernel(counter::RINGBUF_DROPS) > 0,
        "a 16 KiB ring must overflow"
    );
    assert!(
        stats.coverage_degraded(),
        "kernel drops must degrade coverage"
    );

    // A pipeline that never takes anything: batches are dropped, counted, never waited on.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // Empty what the stall left in the ring first, so the second phase's records fit in it
    // (otherwise they can all be dropped in the kernel and no batch ever reaches the channel).
    let mut leftovers = Vec::new();
    while src.drain(&mut leftovers) > 0 {
        leftovers.clear();
    }
    let (tx, _rx) = tokio::sync::mpsc::channel(1);
    tx.try_send(Vec::new()).unwrap();
    let mut router2 = start_pd("", "req-ebpf-drops-2", 2, 1000, &[]);
    src.watch(router2.prefill.pid(), Role::Prefill).unwrap();
    src.watch(router2.decode.pid(), Role::Decode).unwrap();
    src.watch(router2.router.pid(), Role::Router).unwrap();
    router2.router.go();
    router2.router.expect_line("{");
    rt.block_on(async {
        let shutdown = tokio::time::sleep(Duration::from_millis(500));
        src.run(tx, shutdown).await.expect("run");
    });
    assert!(
        stats
            .batches_dropped
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
    assert!(
        stats
            .events_dropped
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
    assert!(stats.losses() > 0);
}

/// Writes to a bootstrap server are attributed by the kernel's report of every connection a
/// watched process opens: this test process (watched as prefill) serves `PUT /route`, writes
/// one itself (a member's), and a python3 started before the watch, so not followed into as a
/// child, writes two more (foreign): one from a port of its own, one from the port of a
/// connection this process holds open to another of its listeners (a port is shared by
/// connections to different destinations; the source knows which listener the write came in on).
#[test]
fn bootstrap_writers_are_attributed_by_their_connections() {
    use std::io::Read;
    use std::net::TcpListener;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let body = r#"{"role": "Prefill", "rank_ip": "127.0.0.1", "rank_port": 1, "engine_rank": 0}"#;
    let put = format!(
        "PUT /route HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    // The outsider: twice, waits for a line on stdin (`go`, or a local port to share), then
    // writes and reads the answer.
    let script = format!(
        "import socket, sys\nsys.stdout.write('READY\\n'); sys.stdout.flush()\n\
         for _ in range(2):\n  \
           line = sys.stdin.readline().strip()\n  \
           s = socket.socket()\n  \
           if line != 'go':\n    \
             s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n    \
             s.bind(('127.0.0.1', int(line)))\n  \
           s.connect(('127.0.0.1', {}))\n  s.sendall({:?}.encode())\n  s.recv(100)\n  \
           sys.stdout.write('DONE %d\\n' % s.getsockname()[1]); sys.stdout.flush()\n",
        addr.port(),
        put
    );
    let mut outsider = Fake::spawn(&["-c".to_string(), script]).expect("python3 started");
    let me = std::process::id();
    let cfg = EbpfConfig {
        discovery: Discovery {
            pids: vec![revenant::ingest::ebpf::PidRule {
                role: Role::Prefill,
                pid: me,
            }],
            watch: vec![],
            conventions: false,
        },
        rescan_every: Duration::from_millis(50),
        ..Default::default()
    };
    let mut src = start_source(cfg);
    wait_watched(&mut src, &[me]);
    // Bounded: a writer that never comes fails the test instead of hanging it.
    listener.set_nonblocking(true).unwrap();
    let serve = |listener: &TcpListener| {
        let deadline = Instant::now() + Duration::from_secs(20);
        let (mut conn, peer) = loop {
            match listener.accept() {
                Ok(accepted) => break accepted,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    assert!(Instant::now() < deadline, "no writer came within 20 s");
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => panic!("accept: {e}"),
            }
        };
        conn.set_nonblocking(false).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        while !got.ends_with(body.as_bytes()) {
            let n = conn.read(&mut buf).unwrap();
            assert!(n > 0, "the writer went away");
            got.extend_from_slice(&buf[..n]);
        }
        conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nOK")
            .unwrap();
        peer
    };
    // Our own write: a watched connection.
    let mut own = std::net::TcpStream::connect(addr).unwrap();
    own.write_all(put.as_bytes()).unwrap();
    let own_peer = serve(&listener);
    let mut answer = [0u8; 64];
    let _ = own.read(&mut answer).unwrap();
    // The outsider's.
    outsider.go();
    let foreign_peer = serve(&listener);
    outsider.expect_line("DONE");
    // The outsider's again, from the port of our open connection to another listener.
    let elsewhere = TcpListener::bind("127.0.0.1:0").unwrap();
    let ours = connect_sharing_its_port(elsewhere.local_addr().unwrap());
    let _held = elsewhere.accept().unwrap();
    let shared = ours.local_addr().unwrap();
    outsider.send_line(&shared.port().to_string());
    let sharing_peer = serve(&listener);
    assert_eq!(
        sharing_peer, shared,
        "the outsider wrote from our connection's port"
    );
    outsider.expect_line("DONE");
    let mut events = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    let writes = |events: &[LifecycleEvent]| {
        events
            .iter()
            .filter(|e| e.stage == Stage::Transfer && e.peer.is_some())
            .filter_map(|e| Some((e.worker.as_deref()?.to_string(), e.peer?)))
            .collect::<Vec<_>>()
    };
    while writes(&events).len() < 3 {
        assert!(
            Instant::now() < deadline,
            "three writes expected, got {:?}",
            writes(&events)
        );
        src.drain(&mut events);
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        writes(&events),
        vec![
            (own_peer.to_string(), revenant::Peer::Member),
            (foreign_peer.to_string(), revenant::Peer::Foreign),
            (sharing_peer.to_string(), revenant::Peer::Foreign)
        ]
    );
    let s = src.stats();
    assert_eq!(s.kernel(counter::CONNECTING_FULL), 0);
    assert_eq!(
        s.accepts_unplaced
            .load(std::sync::atomic::Ordering::Relaxed),
        0,
        "every accept's listener is found"
    );
    drop(ours);
}

/// `fake_zmtp.py`'s prefill (listening, watched by a fresh eBPF source) and its decode
/// (connecting, 20 destinations to send), neither started yet.
fn zmtp_pair() -> (Fake, Fake, EbpfSource) {
    let port = free_port();
    let script = fixture("fake_zmtp.py").display().to_string();
    let prefill = Fake::spawn(&[script.clone(), "prefill".into(), port.to_string()])
        .expect("the fake prefill could not bind its port");
    let src = start_source(EbpfConfig {
        capture: CaptureConfig::default(),
        discovery: Discovery {
            pids: vec![revenant::ingest::ebpf::PidRule {
                role: Role::Prefill,
                pid: prefill.pid(),
            }],
            watch: vec![],
            conventions: false,
        },
        ..Default::default()
    });
    let decode = Fake::spawn(&[script, "decode".into(), port.to_string(), "20".into()])
        .expect("the fake decode could not start");
    (prefill, decode, src)
}

/// Drains `src` until the 20 rooms of `fake_zmtp.py`'s batch are read (10 s at most), then
/// checks that the stream never lost sync and the kernel dropped nothing.
fn read_all_twenty_rooms(src: &mut EbpfSource, events: &mut Vec<LifecycleEvent>) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let rooms = |events: &[LifecycleEvent]| -> Vec<u64> {
        let mut r: Vec<u64> = events
            .iter()
            .filter(|e| e.stage == Stage::Transfer && e.kind == Kind::Admitted)
            .filter_map(|e| e.ids.bootstrap_room.map(|r| r.0))
            .collect();
        r.sort_unstable();
        r.dedup();
        r
    };
    while rooms(events).len() < 20 {
        assert!(
            Instant::now() < deadline,
            "destinations read: {:?}",
            rooms(events)
        );
        src.drain(events);
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(rooms(events), (1000..1020).collect::<Vec<_>>());
    src.rescan();
    let stats = src.stats();
    assert_eq!(
        stats
            .zmtp_desyncs
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    assert_eq!(stats.kernel(counter::RINGBUF_DROPS), 0);
}

/// libzmq batches queued control messages into one write (up to 8 KiB). Once the tracker has
/// seen a connection's ZMTP greeting, the kernel captures that socket's syscalls whole (up to
/// 4 KiB at each end), so every one of 20 destinations messages sent in one ~6 KB write is read,
/// where the default 512-byte head and tail windows would keep three or four.
#[test]
fn a_zmtp_connection_is_captured_whole() {
    let (mut prefill, mut decode, mut src) = zmtp_pair();
    let mut events = Vec::new();
    wait_watched(&mut src, &[prefill.pid()]);
    prefill.go();
    decode.expect_line("GREETED");
    // The prefill end is watched: it reads the greeting, and the source marks its socket.
    let deadline = Instant::now() + Duration::from_secs(10);
    while src
        .stats()
        .zmtp_captured_whole
        .load(std::sync::atomic::Ordering::Relaxed)
        == 0
    {
        assert!(
            Instant::now() < deadline,
            "the ZMTP connection was never captured whole"
        );
        src.drain(&mut events);
        std::thread::sleep(Duration::from_millis(10));
    }
    decode.go();
    decode.expect_line("SENT");
    decode.go();
    prefill.expect_line("DONE");
    read_all_twenty_rooms(&mut src, &mut events);
}

/// A peer writes its first batch right behind its greeting, before user space could have read
/// the greeting from the ring: the kernel marks the socket itself on the syscall that reads the
/// greeting, so that batch is captured whole too. The source is not drained between the greeting
/// and the batch here, so only the kernel can have marked the socket; with the default 512-byte
/// head and tail windows the ~6 KB batch would give three or four of its 20 rooms.
#[test]
fn a_batch_right_behind_the_greeting_is_captured_whole() {
    let (mut prefill, mut decode, mut src) = zmtp_pair();
    wait_watched(&mut src, &[prefill.pid()]);
    prefill.go();
    decode.expect_line("GREETED");
    // The prefill's first read took the greeting (and READY) alone: the batch is not sent yet.
    let first = prefill.expect_line("FIRST");
    let n: usize = first["FIRST ".len()..].parse().unwrap();
    assert!(
        (10..=92).contains(&n),
        "a first read of {n} bytes is not the greeting alone"
    );
    decode.go();
    decode.expect_line("SENT");
    decode.go();
    prefill.expect_line("DONE");
    let mut events = Vec::new();
    read_all_twenty_rooms(&mut src, &mut events);
}

/// vLLM's `/metrics` is tens of KB written in one syscall, and its `vllm:cache_config_info`
/// sample lies in the middle, beyond the edge windows. The kernel switches a connection to
/// `capture::STREAM` on the syscall that reads the `GET /metrics` request, so the very first
/// answer is sent whole, its sample read and the worker's KV capacity reported.
#[test]
fn a_metrics_connection_is_captured_whole_and_its_page_read() {
    use std::io::Read;
    let port = free_port();
    let script = fixture("fake_metrics.py").display().to_string();
    let mut server = Fake::spawn(&[script, port.to_string(), "2731".into()])
        .expect("the fake metrics server could not bind its port");
    let mut src = start_source(EbpfConfig {
        capture: CaptureConfig::default(),
        discovery: Discovery {
            pids: vec![revenant::ingest::ebpf::PidRule {
                role: Role::Prefill,
                pid: server.pid(),
            }],
            watch: vec![],
            conventions: false,
        },
        ..Default::default()
    });
    let mut events = Vec::new();
    wait_watched(&mut src, &[server.pid()]);
    server.go();
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let scrape = |conn: &mut std::net::TcpStream| {
        conn.write_all(b"GET /metrics HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
            .unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 65536];
        let len = loop {
            let n = conn.read(&mut buf).unwrap();
            assert!(n > 0, "the fake server closed");
            got.extend_from_slice(&buf[..n]);
            if let Some(h) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&got[..h]).to_lowercase();
                let cl: usize = head
                    .split("content-length: ")
                    .nth(1)
                    .and_then(|v| v.split("\r\n").next())
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap();
                if got.len() >= h + 4 + cl {
                    break cl;
                }
            }
        };
        assert!(len > 40_000, "a vLLM-sized page: {len} bytes");
    };
    scrape(&mut conn);
    let kv = |events: &[LifecycleEvent]| {
        events
            .iter()
            .filter(|e| e.kind == Kind::Capacity)
            .filter_map(|e| e.max_total_tokens)
            .collect::<Vec<_>>()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while kv(&events).is_empty() {
        if Instant::now() >= deadline {
            src.rescan();
            panic!(
                "no capacity report from the whole page: {:?}",
                (0..counter::COUNT)
                    .map(|i| (counter::NAMES[i as usize], src.stats().kernel(i)))
                    .collect::<Vec<_>>()
            );
        }
        src.drain(&mut events);
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(kv(&events), vec![2731 * 16]);
    // A second scrape on the connection says nothing new.
    scrape(&mut conn);
    drop(conn);
    server.expect_line("DONE 2");
    src.drain(&mut events);
    assert_eq!(kv(&events), vec![2731 * 16]);
    src.rescan();
    let stats = src.stats();
    // Marked by the kernel when it read the first request (user space marks it again, later).
    assert_eq!(stats.kernel(counter::METRICS_MARKED), 1);
    assert_eq!(stats.kernel(counter::RINGBUF_DROPS), 0);
    assert_eq!(stats.kernel(counter::STREAM_TRUNCATED), 0);
}
