//! OTLP/gRPC load generator: sustained spans/s through a real `revenant run` process
//! (gRPC receiver → profile → span tree → bounded channel → checker), its CPU seconds per
//! million spans and its peak RSS.
//!
//! Run: `cargo bench -p revenant --bench otlp_load -- [--seconds 20] [--connections 4]
//!       [--batch 1000] [--channel-capacity 16] [--memory-budget 256MiB]`
//!
//! The workload is SGLang-shaped: per attempt a root ("prefill Req …" with `rid` and a hex
//! `bootstrap_room`), the scheduler thread span and three stage slices, exported children first
//! in one batch, plus one smg `http_request` span with its dispatch event per attempt. Every id is
//! unique (no attempt repeats), one attempt in 50 is rejected by prefill (ERROR + reason on the
//! thread span). The channel is kept small so acknowledged spans/s equals what the checker
//! sustains, not what a queue can absorb. Refusals (UNAVAILABLE when the pipeline is full) are
//! retried after 1 ms and counted.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_client::TraceServiceClient;
use opentelemetry_proto::tonic::common::v1::{
    AnyValue, InstrumentationScope, KeyValue, any_value::Value,
};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span, Status, span::Event};

// Same allocator as the revenant binary, so the in-process figures compare.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

struct Args {
    seconds: u64,
    warmup: u64,
    connections: usize,
    batch: usize,
    channel_capacity: usize,
    /// `--memory-budget` passed to revenant (its default when absent).
    memory_budget: Option<String>,
}

fn parse_args() -> Args {
    let argv: Vec<String> = std::env::args().collect();
    // `cargo bench` passes --bench; `cargo test --all-targets` runs this binary without it: then
    // only a short smoke run proves the tool and the pipeline work.
    let mut a = if argv.iter().any(|a| a == "--bench") {
        Args {
            seconds: 20,
            warmup: 3,
            connections: 4,
            batch: 1000,
            channel_capacity: 16,
            memory_budget: None,
        }
    } else {
        Args {
            seconds: 1,
            warmup: 0,
            connections: 1,
            batch: 120,
            channel_capacity: 16,
            memory_budget: None,
        }
    };
    let mut i = 1;
    while i < argv.len() {
        let next = || argv.get(i + 1).and_then(|v| v.parse().ok());
        match argv[i].as_str() {
            "--seconds" => a.seconds = next().unwrap_or(a.seconds as usize) as u64,
            "--warmup" => a.warmup = next().unwrap_or(a.warmup as usize) as u64,
            "--connections" => a.connections = next().unwrap_or(a.connections),
            "--batch" => a.batch = next().unwrap_or(a.batch),
            "--channel-capacity" => a.channel_capacity = next().unwrap_or(a.channel_capacity),
            "--memory-budget" => a.memory_budget = argv.get(i + 1).cloned(),
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    a
}

fn kv(k: &str, v: Value) -> KeyValue {
    KeyValue {
        key: k.into(),
        value: Some(AnyValue { value: Some(v) }),
        key_strindex: 0,
    }
}
fn s(k: &str, v: String) -> KeyValue {
    kv(k, Value::StringValue(v))
}

fn span(
    trace: u128,
    id: u64,
    parent: u64,
    name: String,
    start: u64,
    end: u64,
    attributes: Vec<KeyValue>,
) -> Span {
    Span {
        trace_id: trace.to_be_bytes().to_vec(),
        span_id: id.to_be_bytes().to_vec(),
        parent_span_id: if parent == 0 {
            vec![]
        } else {
            parent.to_be_bytes().to_vec()
        },
        name,
        kind: 1,
        start_time_unix_nano: start,
        end_time_unix_nano: end,
        attributes,
        ..Default::default()
    }
}

fn resource(service: &str) -> Option<Resource> {
    Some(Resource {
        attributes: vec![
            s("service.name", service.into()),
            s("host.name", format!("{service}-node")),
        ],
        ..Default::default()
    })
}

/// One export of about `n` spans: whole attempts (5 SGLang spans) plus their router spans.
fn build_batch(n: usize, first_attempt: u64, now: u64) -> (ExportTraceServiceRequest, usize) {
    let attempts = (n / 6).max(1) as u64;
    let mut sg = Vec::with_capacity(attempts as usize * 5);
    let mut rt = Vec::with_capacity(attempts as usize);
    for a in first_attempt..first_attempt + attempts {
        let trace = (a as u128) << 64 | 0x5eed;
        let rid = format!("{a:032x}");
        let t0 = now + a % 1000;
        let root = a << 8 | 1;
        let thread = a << 8 | 2;
        for (k, name) in [
            "prefill_bootstrap",
            "prefill_forward",
            "prefill_transfer_kv_cache",
        ]
        .iter()
        .enumerate()
        {
            let k = k as u64;
            sg.push(span(
                trace,
                a << 8 | (3 + k),
                thread,
                (*name).into(),
                t0 + 10 + k * 10,
                t0 + 15 + k * 10,
                vec![],
            ));
        }
        let mut th = span(
            trace,
            thread,
            root,
            "Prefill Scheduler [TP 0] (host:bench | pid:1)".into(),
            t0 + 5,
            t0 + 50,
            vec![
                s("thread_label", "Prefill Scheduler".into()),
                kv("pid", Value::IntValue(1)),
            ],
        );
        if a % 50 == 0 {
            th.attributes.push(s(
                "reason",
                format!("Request {rid} exceeds the maximum number of tokens: 9000 > 8192"),
            ));
            th.status = Some(Status {
                message: String::new(),
                code: 2,
            });
        }
        sg.push(th);
        sg.push(span(
            trace,
            root,
            0,
            format!("prefill Req {}", &rid[..8]),
            t0,
            t0 + 60,
            vec![s("rid", rid), s("bootstrap_room", format!("{a:#x}"))],
        ));
        let mut r = span(
            trace ^ 1,
            a << 8 | 9,
            0,
            "http_request".into(),
            t0,
            t0 + 70,
            vec![
                s("request_id", format!("bench-{a}")),
                s("status_code", "200".into()),
            ],
        );
        r.events.push(Event {
            time_unix_nano: t0 + 1,
            name: "Sending concurrent requests".into(),
            attributes: vec![
                s("prefill_url", "http://p:1".into()),
                s("decode_url", "http://d:1".into()),
            ],
            dropped_attributes_count: 0,
        });
        rt.push(r);
    }
    let spans = sg.len() + rt.len();
    let req = ExportTraceServiceRequest {
        resource_spans: vec![
            ResourceSpans {
                resource: resource("sglang"),
                scope_spans: vec![ScopeSpans {
                    scope: Some(InstrumentationScope {
                        name: "sglang server".into(),
                        ..Default::default()
                    }),
                    spans: sg,
                    schema_url: String::new(),
                }],
                schema_url: String::new(),
            },
            ResourceSpans {
                resource: resource("smg"),
                scope_spans: vec![ScopeSpans {
                    scope: Some(InstrumentationScope {
                        name: "smg".into(),
                        ..Default::default()
                    }),
                    spans: rt,
                    schema_url: String::new(),
                }],
                schema_url: String::new(),
            },
        ],
    };
    (req, spans)
}

/// (utime + stime) seconds of a process, from /proc.
fn cpu_seconds(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // Fields after the command: state=0, …, utime=11, stime=12 (clock ticks, 100 Hz on Linux).
    (ticks(11) + ticks(12)) / 100.0
}

/// The `revenant_memory_*` samples of the admin server's `/metrics`.
fn memory_lines(admin: &str) -> Vec<String> {
    use std::io::{Read, Write};
    let Ok(mut c) = std::net::TcpStream::connect(admin) else {
        return vec!["admin server unreachable".into()];
    };
    let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = write!(c, "GET /metrics HTTP/1.0\r\nHost: {admin}\r\n\r\n");
    let mut text = String::new();
    let _ = c.read_to_string(&mut text);
    text.lines()
        .filter(|l| {
            l.starts_with("revenant_memory_") || l.starts_with("revenant_checker_evictions")
        })
        .map(str::to_owned)
        .collect()
}

fn status_kb(pid: &str, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// In-process, one thread: protobuf decode + normalize (profile, span tree) only, on pre-encoded
/// exports — the receiver-side CPU cost without network, checker or contention.
fn inproc(args: &Args) {
    use prost::Message;
    let base = 1_800_000_000_000_000_000u64;
    let encoded: Vec<(bytes::Bytes, usize)> = (0..64u64)
        .map(|i| {
            let (req, n) = build_batch(args.batch, 1 + i * 1000, base);
            (bytes::Bytes::from(req.encode_to_vec()), n)
        })
        .collect();
    let mut n = revenant::normalize::Normalizer::new(&Default::default()).unwrap();
    let mut total = 0usize;
    let mut events = 0usize;
    let start = Instant::now();
    let cpu0 = cpu_seconds("self");
    let mut round = 0u64;
    while start.elapsed() < Duration::from_secs(args.seconds.min(5)) {
        for (b, spans) in &encoded {
            let req = ExportTraceServiceRequest::decode(b.clone()).unwrap();
            let mut out = Vec::with_capacity(spans * 2);
            n.traces(
                &req,
                round + 1,
                &mut out,
                &mut revenant::normalize::Tally::default(),
            );
            events += out.len();
            total += spans;
        }
        round += 1;
    }
    let el = start.elapsed().as_secs_f64();
    let cpu = cpu_seconds("self") - cpu0;
    println!(
        "otlp_load --inproc: decode + normalize, one thread: {:.0} spans/s wall, {:.2} CPU s per million spans ({:.0} spans per CPU second), {} events",
        total as f64 / el,
        cpu / (total as f64 / 1e6),
        total as f64 / cpu,
        events
    );
}

fn main() {
    let args = parse_args();
    if std::env::args().any(|a| a == "--inproc") {
        inproc(&args);
        return;
    }
    let dir = std::env::temp_dir().join(format!("revenant-otlp-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ready = dir.join("ready.json");
    let mut child = Command::new(env!("CARGO_BIN_EXE_revenant"))
        .args(["run", "--otlp-grpc", "127.0.0.1:0", "--otlp-http", "off"])
        .arg("--ready-file")
        .arg(&ready)
        .arg("--alerts-jsonl")
        .arg(dir.join("alerts.jsonl"))
        .arg("--spool-dir")
        .arg(dir.join("spool"))
        .args(["--admin", "127.0.0.1:0", "--ebpf", "off"])
        .args([
            "--channel-capacity",
            &args.channel_capacity.to_string(),
            "--drain-timeout",
            "60s",
        ])
        .args(
            args.memory_budget
                .iter()
                .flat_map(|b| ["--memory-budget", b.as_str()]),
        )
        .env("REVENANT_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("stderr.log")).unwrap())
        .spawn()
        .expect("spawn revenant (build it first: cargo build --release -p revenant)");
    let deadline = Instant::now() + Duration::from_secs(20);
    let (addr, admin) = loop {
        if let Ok(t) = std::fs::read_to_string(&ready) {
            let v: serde_json::Value = serde_json::from_str(&t).unwrap();
            break (
                v["otlp_grpc"].as_str().unwrap().to_owned(),
                v["admin"].as_str().unwrap().to_owned(),
            );
        }
        assert!(Instant::now() < deadline, "revenant did not become ready");
        std::thread::sleep(Duration::from_millis(20));
    };
    let pid = child.id().to_string();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let acked = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let next_attempt = Arc::new(AtomicU64::new(1));
    let base = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;

    let mut tasks = Vec::new();
    for _ in 0..args.connections {
        let (acked, refused, stop, next) = (
            acked.clone(),
            refused.clone(),
            stop.clone(),
            next_attempt.clone(),
        );
        let (addr, batch) = (addr.clone(), args.batch);
        tasks.push(rt.spawn(async move {
            let mut client = TraceServiceClient::connect(format!("http://{addr}"))
                .await
                .unwrap()
                .max_encoding_message_size(64 << 20);
            while !stop.load(Relaxed) {
                let attempts = (batch / 6).max(1) as u64;
                let first = next.fetch_add(attempts, Relaxed);
                let (req, n) = build_batch(batch, first, base);
                loop {
                    match client.export(req.clone()).await {
                        Ok(_) => {
                            acked.fetch_add(n as u64, Relaxed);
                            break;
                        }
                        Err(st) if st.code() == tonic::Code::Unavailable => {
                            refused.fetch_add(1, Relaxed);
                            if stop.load(Relaxed) {
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                        Err(st) => panic!("export failed: {st}"),
                    }
                }
            }
        }));
    }

    std::thread::sleep(Duration::from_secs(args.warmup));
    let (a0, r0, c0, g0, t0) = (
        acked.load(Relaxed),
        refused.load(Relaxed),
        cpu_seconds(&pid),
        cpu_seconds("self"),
        Instant::now(),
    );
    std::thread::sleep(Duration::from_secs(args.seconds));
    let (a1, r1, c1, g1, el) = (
        acked.load(Relaxed),
        refused.load(Relaxed),
        cpu_seconds(&pid),
        cpu_seconds("self"),
        t0.elapsed(),
    );
    let memory = memory_lines(&admin);
    stop.store(true, Relaxed);
    rt.block_on(async {
        for t in tasks {
            let _ = t.await;
        }
    });
    let hwm = status_kb(&pid, "VmHWM:");
    let _ = Command::new("kill").args(["-TERM", &pid]).status();
    let st = child.wait().unwrap();
    let stderr = std::fs::read_to_string(dir.join("stderr.log")).unwrap_or_default();

    let spans = (a1 - a0) as f64;
    let secs = el.as_secs_f64();
    println!(
        "otlp_load: {} connections, {} spans/export, channel capacity {}, {} s measured after {} s warmup",
        args.connections, args.batch, args.channel_capacity, args.seconds, args.warmup
    );
    println!(
        "  sustained:          {:.0} spans/s acknowledged ({:.0} spans total)",
        spans / secs,
        spans
    );
    println!("  refused (retried):  {} UNAVAILABLE answers", r1 - r0);
    println!(
        "  revenant CPU:       {:.2} s over {:.1} s = {:.2} CPU s per million spans",
        c1 - c0,
        secs,
        (c1 - c0) / (spans / 1e6)
    );
    println!(
        "  generator CPU:      {:.2} s (same machine, shares the cores)",
        g1 - g0
    );
    let budget = args.memory_budget.as_deref().unwrap_or("512MiB (default)");
    println!(
        "  revenant peak RSS:  {:.1} MiB (memory budget {budget})",
        hwm as f64 / 1024.0
    );
    println!("  revenant exit:      {st}");
    println!("  memory budget's account at the end of the measurement (/metrics):");
    for l in &memory {
        println!("  | {l}");
    }
    for l in stderr.lines().filter(|l| {
        l.starts_with("revenant: stopped")
            || l.contains("spans_received")
            || l.contains("rejected_total")
            || l.contains("events_emitted")
    }) {
        println!("  | {l}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(st.success(), "revenant did not shut down cleanly");
    assert!(spans > 0.0, "no span was acknowledged");
}
