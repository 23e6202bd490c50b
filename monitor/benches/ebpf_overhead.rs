//! Overhead of eBPF capture on a monitored HTTP server, side by side in one run:
//! no tracing, revenant's probes + parsing + normalization, and a bpftrace peer that only copies
//! payload heads of recvfrom/writev for the server's pid.
//!
//! Run (root, after `cargo xtask setup --bench`, which installs nginx, wrk and bpftrace):
//!     cargo bench -p revenant --bench ebpf_overhead
//! Knobs: EBPF_BENCH_SECS (saturation window, default 5), EBPF_BENCH_ROUNDS (saturation rounds,
//! default 3), EBPF_BENCH_RATE (fixed-load requests/s, default 2000), EBPF_BENCH_CYCLES (fixed-load
//! cycles, default 15), EBPF_BENCH_WINDOW_SECS (fixed-load window per mode, default 2),
//! EBPF_BENCH_PHASES (`sat,fixed`), EBPF_BENCH_MODES (`none,revenant,bpftrace`).
//! Figures are printed; BENCHMARKS.md records them.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use monitor_common::counter;
use revenant::ingest::ebpf::{Discovery, EbpfConfig, EbpfSource, EbpfStats, Role};

// Same allocator as the revenant binary, so that revenant's CPU figures are the binary's.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    // `cargo test --all-targets` runs bench binaries without `--bench`: nothing to measure there.
    if !std::env::args().any(|a| a == "--bench") {
        println!("ebpf_overhead: run with `cargo bench -p revenant --bench ebpf_overhead`");
        return;
    }
    for tool in ["nginx", "wrk", "bpftrace"] {
        if which(tool).is_none() {
            eprintln!("ebpf_overhead: {tool} not found; run `cargo xtask setup --bench` first");
            std::process::exit(2);
        }
    }
    let secs = env_num("EBPF_BENCH_SECS", 5);
    let rounds = env_num("EBPF_BENCH_ROUNDS", 3);
    let rate = env_num("EBPF_BENCH_RATE", 2000);
    let cycles = env_num("EBPF_BENCH_CYCLES", 15);
    let window = env_num("EBPF_BENCH_WINDOW_SECS", 2);
    let phases = std::env::var("EBPF_BENCH_PHASES").unwrap_or_else(|_| "sat,fixed".into());
    let modes_var =
        std::env::var("EBPF_BENCH_MODES").unwrap_or_else(|_| "none,revenant,bpftrace".into());
    let modes: Vec<(usize, &str)> = MODES
        .into_iter()
        .enumerate()
        .filter(|(_, m)| modes_var.split(',').any(|x| x == *m))
        .collect();
    let nginx = Nginx::start();
    let pids = nginx.pids();
    println!("nginx on 127.0.0.1:{} pids {pids:?}", nginx.port);
    let _stats_fd = aya::sys::enable_stats(aya::sys::Stats::RunTime).ok();
    if phases.split(',').any(|p| p == "sat") {
        saturation(&nginx, &pids, &modes, rounds, secs);
    }
    if phases.split(',').any(|p| p == "fixed") {
        fixed(&nginx, &pids, &modes, cycles, window, rate);
    }
}

const MODES: [&str; 3] = ["none", "revenant", "bpftrace"];

/// `wrk` at saturation, each mode in turn per round; ratios are taken within the run.
fn saturation(nginx: &Nginx, pids: &[u32], modes: &[(usize, &str)], rounds: u64, secs: u64) {
    println!("== saturation: {rounds} rounds of {secs}s per mode ==");
    let mut sat: [Vec<f64>; 3] = Default::default();
    let mut rev_events_per_s: Vec<f64> = Vec::new();
    let mut kernel_ns: Vec<f64> = Vec::new();
    let mut rev_cpu_s: Vec<f64> = Vec::new();
    let mut rev_losses = 0;
    let mut rev_rss_kb = 0;
    for round in 0..rounds {
        for &(i, mode) in modes {
            let tracer = Tracer::start(mode, pids);
            let cpu0 = tracer.cpu_ns();
            let stats0 = tracer.stats().map(snapshot);
            let prog0 = program_runtime();
            let (rps, reqs) = wrk(nginx.port, secs);
            let prog1 = program_runtime();
            let cpu1 = tracer.cpu_ns();
            sat[i].push(rps);
            print!("round {round} {mode:9} wrk {rps:>9.0} req/s ({reqs} reqs)");
            if let (Some(s0), Some(st)) = (stats0, tracer.stats()) {
                let s1 = snapshot(st);
                rev_events_per_s.push((s1.events - s0.events) as f64 / secs as f64);
                rev_losses += s1.losses - s0.losses;
                rev_cpu_s.push((cpu1 - cpu0) as f64 / 1e9);
                let calls = (s1.seen - s0.seen).max(1);
                kernel_ns.push((prog1.0 - prog0.0) as f64 / calls as f64);
                rev_rss_kb = rev_rss_kb.max(rss_kb());
                print!(
                    "  revenant cpu {:.2}s  events {}  losses {}",
                    (cpu1 - cpu0) as f64 / 1e9,
                    s1.events - s0.events,
                    s1.losses - s0.losses
                );
                print_losses(st);
            }
            println!();
            drop(tracer);
        }
    }
    let base = median(&sat[0]);
    println!("-- saturation summary (medians over {rounds} rounds) --");
    println!("untraced : {base:.0} req/s");
    for &(i, name) in &modes[1..] {
        println!(
            "{name:9}: {:.0} req/s = {:.2} of untraced (per round: {})",
            median(&sat[i]),
            median(&sat[i]) / base,
            sat[i]
                .iter()
                .zip(&sat[0])
                .map(|(r, b)| format!("{:.2}", r / b))
                .collect::<Vec<_>>()
                .join(" "),
        );
    }
    if !rev_events_per_s.is_empty() {
        println!(
            "revenant at saturation: {:.0} events/s delivered, {rev_losses} lost, kernel {:.0} ns per \
             traced syscall (enter+exit programs), {:.2} s CPU per {secs} s round, RSS {rev_rss_kb} KiB",
            median(&rev_events_per_s),
            median(&kernel_ns),
            median(&rev_cpu_s),
        );
    }
}

/// Latency at a fixed rate. Loopback latency on a 2-core VM drifts by 2x between minutes (vCPU
/// wake-ups, host noise), more than the effect under study; so the modes alternate in short
/// windows, in rotating order, and each mode's samples are pooled over all its windows: slow
/// drift then weighs the same on every mode.
fn fixed(
    nginx: &Nginx,
    pids: &[u32],
    modes: &[(usize, &str)],
    cycles: u64,
    window: u64,
    rate: u64,
) {
    println!(
        "== fixed load: {rate} req/s, {cycles} cycles of one {window}s window per mode, rotating order =="
    );
    let mut pooled: [Vec<u64>; 3] = Default::default();
    let mut per_cycle_p99: [Vec<f64>; 3] = Default::default();
    let mut rev_cpu_ns = 0u64;
    let mut rev_reqs = 0u64;
    let mut rev_losses = 0;
    for cycle in 0..cycles as usize {
        for k in 0..modes.len() {
            let (i, mode) = modes[(cycle + k) % modes.len()];
            let tracer = Tracer::start(mode, pids);
            // The source's first /proc scan runs right after start: not part of the steady state.
            std::thread::sleep(SETTLE);
            let cpu0 = tracer.cpu_ns();
            let stats0 = tracer.stats().map(snapshot);
            let mut lat = fixed_load(nginx.port, rate, window);
            let cpu1 = tracer.cpu_ns();
            if let (Some(s0), Some(st)) = (stats0, tracer.stats()) {
                rev_cpu_ns += cpu1 - cpu0;
                rev_reqs += lat.len() as u64;
                rev_losses += snapshot(st).losses - s0.losses;
            }
            lat.sort_unstable();
            per_cycle_p99[i].push(quantile(&lat, 0.99) as f64);
            pooled[i].extend(lat);
            drop(tracer);
        }
        let p: Vec<String> = modes
            .iter()
            .map(|&(i, m)| format!("{m} {:.0}", per_cycle_p99[i].last().unwrap()))
            .collect();
        println!("cycle {cycle:2}: p99 us {}", p.join("  "));
    }
    println!("-- fixed-load summary (pooled over {cycles} windows per mode) --");
    for v in pooled.iter_mut() {
        v.sort_unstable();
    }
    let base_p99 = quantile(&pooled[0], 0.99) as f64;
    for &(i, name) in modes {
        let v = &pooled[i];
        let ratios: Vec<f64> = per_cycle_p99[i]
            .iter()
            .zip(&per_cycle_p99[0])
            .map(|(x, b)| x / b)
            .collect();
        println!(
            "{name:9}: {} requests, latency us p50 {} p90 {} p99 {} p99.9 {} max {}  p99 = {:.2}x untraced (median of per-cycle ratios {:.2}x)",
            v.len(),
            quantile(v, 0.5),
            quantile(v, 0.9),
            quantile(v, 0.99),
            quantile(v, 0.999),
            v.last().copied().unwrap_or(0),
            quantile(v, 0.99) as f64 / base_p99,
            median(&ratios),
        );
    }
    if rev_reqs > 0 {
        println!(
            "revenant at {rate} req/s: {:.1} ms CPU per 1k requests, {rev_losses} lost",
            rev_cpu_ns as f64 / 1e6 / (rev_reqs as f64 / 1000.0)
        );
    }
}

fn quantile(sorted: &[u64], q: f64) -> u64 {
    sorted
        .get(((sorted.len() as f64) * q) as usize)
        .or(sorted.last())
        .copied()
        .unwrap_or(0)
}

fn print_losses(st: &EbpfStats) {
    print!(
        "\n    losses: ringbuf {} active_full {} socks_full {} read_fail {} pipeline {} decode {} evicted {} | desyncs {} gap_bytes {} records {} conns {}",
        st.kernel(counter::RINGBUF_DROPS),
        st.kernel(counter::ACTIVE_FULL),
        st.kernel(counter::SOCKS_FULL),
        st.kernel(counter::READ_FAILURES),
        st.events_dropped.load(Relaxed),
        st.decode_errors.load(Relaxed),
        st.conns_evicted.load(Relaxed),
        st.http_desyncs.load(Relaxed),
        st.gap_bytes.load(Relaxed),
        st.records.load(Relaxed),
        st.connections.load(Relaxed),
    );
}

#[derive(Clone, Copy)]
struct Snap {
    events: u64,
    losses: u64,
    seen: u64,
}

fn snapshot(s: &EbpfStats) -> Snap {
    Snap {
        events: s.events.load(Relaxed),
        losses: s.losses(),
        seen: s.kernel(counter::SEEN),
    }
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

fn rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("VmRSS:")
                    .map(|v| v.trim().trim_end_matches(" kB").trim().parse().unwrap_or(0))
            })
        })
        .unwrap_or(0)
}

/// Sum of run time (ns) and run count of this object's programs, from the kernel's BPF stats.
fn program_runtime() -> (u64, u64) {
    let names: Vec<String> = revenant::ingest::ebpf::loader::PROGRAMS
        .iter()
        .filter(|(n, _)| n.starts_with("sys_"))
        .map(|(n, _)| n.chars().take(15).collect())
        .collect();
    let mut t = (0, 0);
    for p in aya::programs::loaded_programs().flatten() {
        if p.name_as_str()
            .is_some_and(|n| names.iter().any(|x| x == n))
        {
            t.0 += p.run_time().as_nanos() as u64;
            t.1 += p.run_count();
        }
    }
    t
}

struct Nginx {
    child: Child,
    port: u16,
    _dir: PathBuf,
}

impl Nginx {
    fn start() -> Nginx {
        let dir = std::env::temp_dir().join(format!("revenant-nginx-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("logs")).unwrap();
        let port = test_harness::free_port().expect("a free loopback port");
        let conf = format!(
            "worker_processes 1;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/logs/error.log;\n\
             events {{ worker_connections 1024; }}\n\
             http {{ access_log off; keepalive_requests 100000000; client_body_temp_path {d}/body;\n\
               server {{ listen 127.0.0.1:{port};\n\
                 location /generate {{ default_type application/json; return 200 '{{\"text\":\"ok\",\"meta_info\":{{\"id\":\"r\",\"prompt_tokens\":12}}}}'; }}\n\
                 location / {{ return 200 'ok'; }} }} }}\n",
            d = dir.display()
        );
        std::fs::write(dir.join("nginx.conf"), conf).unwrap();
        let child = Command::new(which("nginx").unwrap())
            .args([
                "-p",
                &dir.display().to_string(),
                "-c",
                &dir.join("nginx.conf").display().to_string(),
            ])
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start nginx");
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "nginx did not listen on {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
        Nginx {
            child,
            port,
            _dir: dir,
        }
    }

    /// The master and its workers.
    fn pids(&self) -> Vec<u32> {
        let master = self.child.id();
        let mut pids = vec![master];
        for pid in revenant::ingest::ebpf::procs::all_pids() {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let ppid = stat
                .rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            if ppid == Some(master) {
                pids.push(pid);
            }
        }
        pids
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // Workers are found by their parent: list them before the master goes.
        let workers: Vec<u32> = self.pids().into_iter().skip(1).collect();
        let _ = self.child.kill();
        let _ = self.child.wait();
        for pid in workers {
            // SAFETY: plain syscall on a pid this bench started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }
}

enum Tracer {
    None,
    Revenant {
        stop: Arc<AtomicBool>,
        thread: Option<std::thread::JoinHandle<()>>,
        stats: Arc<EbpfStats>,
        consumed: Arc<AtomicU64>,
        /// Kernel task id of the thread running the source (and its consumer).
        tid: Arc<AtomicU64>,
    },
    Bpftrace(Child),
}

const BPFTRACE: &str = r#"
tracepoint:syscalls:sys_enter_recvfrom /pid == $1/ { @rbuf[tid] = args->ubuf; }
tracepoint:syscalls:sys_exit_recvfrom /pid == $1 && @rbuf[tid] != 0/ {
  if (args->ret > 0) { printf("r %d %r\n", args->ret, buf(@rbuf[tid], 64)); }
  delete(@rbuf[tid]);
}
tracepoint:syscalls:sys_enter_writev /pid == $1/ { @wvec[tid] = args->vec; }
tracepoint:syscalls:sys_exit_writev /pid == $1 && @wvec[tid] != 0/ {
  if (args->ret > 0) { $iov = (struct iovec *)@wvec[tid]; printf("w %d %r\n", args->ret, buf($iov->iov_base, 64)); }
  delete(@wvec[tid]);
}
"#;

impl Tracer {
    fn start(mode: &str, pids: &[u32]) -> Tracer {
        match mode {
            "revenant" => {
                let cfg = EbpfConfig {
                    discovery: Discovery {
                        conventions: false,
                        ..Default::default()
                    },
                    node: Some("bench".into()),
                    ..Default::default()
                };
                let mut src = EbpfSource::start(cfg)
                    .expect("eBPF probes must load (root, cargo xtask setup)");
                for &p in pids {
                    src.watch(p, Role::Prefill).expect("watch nginx");
                }
                let stats = src.stats();
                let stop = Arc::new(AtomicBool::new(false));
                let consumed = Arc::new(AtomicU64::new(0));
                let (stop2, consumed2) = (Arc::clone(&stop), Arc::clone(&consumed));
                let tid = Arc::new(AtomicU64::new(0));
                let tid2 = Arc::clone(&tid);
                // Named, so that `perf record --comm revenant-ebpf` can single it out.
                let thread = std::thread::Builder::new()
                    .name("revenant-ebpf".into())
                    .spawn(move || {
                        // SAFETY: plain syscall.
                        tid2.store(unsafe { libc::gettid() } as u64, Relaxed);
                        let rt = tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()
                            .unwrap();
                        rt.block_on(async move {
                            let (tx, mut rx) =
                                tokio::sync::mpsc::channel::<revenant::pipeline::EventBatch>(64);
                            let consumer = tokio::spawn(async move {
                                while let Some(b) = rx.recv().await {
                                    consumed2.fetch_add(b.len() as u64, Relaxed);
                                }
                            });
                            let shutdown = async move {
                                while !stop2.load(Relaxed) {
                                    tokio::time::sleep(Duration::from_millis(20)).await;
                                }
                            };
                            src.run(tx, shutdown).await.expect("run");
                            let _ = consumer.await;
                        });
                    })
                    .expect("spawn the revenant thread");
                while tid.load(Relaxed) == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Tracer::Revenant {
                    stop,
                    thread: Some(thread),
                    stats,
                    consumed,
                    tid,
                }
            }
            "bpftrace" => {
                let pid = pids.get(1).or(pids.first()).copied().unwrap();
                let mut child = Command::new(which("bpftrace").unwrap())
                    .args(["-e", BPFTRACE, &pid.to_string()])
                    .stdout(Stdio::piped())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("start bpftrace");
                let mut out = BufReader::new(child.stdout.take().unwrap());
                let mut line = String::new();
                let deadline = Instant::now() + Duration::from_secs(30);
                while !line.starts_with("Attaching") {
                    line.clear();
                    if out.read_line(&mut line).unwrap_or(0) == 0 || Instant::now() > deadline {
                        panic!("bpftrace did not attach");
                    }
                }
                std::thread::spawn(move || {
                    let mut sink = [0u8; 65536];
                    while out.read(&mut sink).map(|n| n > 0).unwrap_or(false) {}
                });
                Tracer::Bpftrace(child)
            }
            _ => Tracer::None,
        }
    }

    fn stats(&self) -> Option<&EbpfStats> {
        match self {
            Tracer::Revenant { stats, .. } => Some(stats),
            _ => None,
        }
    }

    /// CPU time of revenant's own thread (the load generator runs in this process too).
    fn cpu_ns(&self) -> u64 {
        match self {
            Tracer::Revenant { tid, .. } => {
                let path = format!("/proc/self/task/{}/schedstat", tid.load(Relaxed));
                std::fs::read_to_string(path)
                    .ok()
                    .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
                    .unwrap_or(0)
            }
            _ => 0,
        }
    }
}

impl Drop for Tracer {
    fn drop(&mut self) {
        match self {
            Tracer::Revenant {
                stop,
                thread,
                consumed,
                ..
            } => {
                stop.store(true, Relaxed);
                if let Some(t) = thread.take() {
                    let _ = t.join();
                }
                let _ = consumed.load(Relaxed);
            }
            Tracer::Bpftrace(c) => {
                // SIGINT lets it detach cleanly; it may then sit printing maps, so bound the wait.
                unsafe { libc::kill(c.id() as i32, libc::SIGINT) };
                let deadline = Instant::now() + Duration::from_secs(5);
                while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(50));
                }
                let _ = c.kill();
                let _ = c.wait();
            }
            Tracer::None => {}
        }
    }
}

/// Saturation: wrk, one thread, 32 connections, POST /generate with a small JSON body.
fn wrk(port: u16, secs: u64) -> (f64, u64) {
    let script = std::env::temp_dir().join("revenant-wrk-post.lua");
    std::fs::write(
        &script,
        "wrk.method = \"POST\"\nwrk.headers[\"Content-Type\"] = \"application/json\"\nwrk.headers[\"X-Request-Id\"] = \"bench-1\"\n\
         wrk.body = '{\"text\": \"a prompt of a realistic length for a benchmark request body\", \"sampling_params\": {\"max_new_tokens\": 8}, \"bootstrap_host\": \"127.0.0.1\", \"bootstrap_port\": 8998, \"bootstrap_room\": 9066467638188682269}'\n",
    )
    .unwrap();
    let out = Command::new(which("wrk").unwrap())
        .args([
            "-t1",
            "-c32",
            &format!("-d{secs}s"),
            "-s",
            &script.display().to_string(),
        ])
        .arg(format!("http://127.0.0.1:{port}/generate"))
        .output()
        .expect("run wrk");
    let text = String::from_utf8_lossy(&out.stdout);
    let rps = text
        .lines()
        .find_map(|l| l.strip_prefix("Requests/sec:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0);
    let reqs = text
        .lines()
        .find_map(|l| {
            l.split_whitespace()
                .next()
                .filter(|_| l.contains("requests in"))
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or(0);
    (rps, reqs)
}

/// Fixed load: 4 keep-alive connections, `rate` requests/s in all; returns p99 latency (us).
/// Pause between attaching a tracer and the first measured request of a window.
const SETTLE: Duration = Duration::from_millis(300);

/// Requests sent in the first part of a window are not measured.
const WARMUP: Duration = Duration::from_millis(250);

/// Latencies (us) of requests sent at `rate` over 4 keep-alive connections for `secs`, after
/// [`WARMUP`].
fn fixed_load(port: u16, rate: u64, secs: u64) -> Vec<u64> {
    let conns = 4;
    let per_conn_interval = Duration::from_nanos(1_000_000_000 * conns / rate.max(1));
    let req = b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nX-Request-Id: fixed-1\r\nContent-Length: 60\r\n\r\n{\"text\": \"fixed load prompt text\", \"bootstrap_room\": 123456}";
    let handles: Vec<_> = (0..conns)
        .map(|_| {
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
                s.set_nodelay(true).unwrap();
                let mut lat = Vec::new();
                let start = Instant::now();
                let mut next = start;
                let mut buf = [0u8; 4096];
                while start.elapsed() < Duration::from_secs(secs) {
                    let now = Instant::now();
                    if now < next {
                        std::thread::sleep(next - now);
                    }
                    next += per_conn_interval;
                    let t0 = Instant::now();
                    s.write_all(req).unwrap();
                    // The response is small and fits one read; read until the body is in.
                    let mut got = 0;
                    loop {
                        let n = s.read(&mut buf[got..]).unwrap();
                        assert!(n > 0, "nginx closed the connection");
                        got += n;
                        if let Some(h) = buf[..got].windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&buf[..h]).to_ascii_lowercase();
                            let len: usize = head
                                .lines()
                                .find_map(|l| l.strip_prefix("content-length:"))
                                .and_then(|v| v.trim().parse().ok())
                                .unwrap_or(0);
                            if got >= h + 4 + len {
                                break;
                            }
                        }
                    }
                    // New connections and a just-attached tracer settle first.
                    if t0 - start >= WARMUP {
                        lat.push(t0.elapsed().as_micros() as u64);
                    }
                }
                lat
            })
        })
        .collect();
    handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect()
}
