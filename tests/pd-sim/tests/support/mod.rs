//! What pd-sim's tests share: `pd-sim cluster` on ephemeral loopback ports (from
//! `test_harness`, always stopped), a tiny async HTTP client, bounded waits
//! ([`test_harness::eventually`]), a ZMTP tap and a tiny OTLP/HTTP receiver.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use pd_sim::http::HttpClient;
pub use test_harness::eventually;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub const BIN: &str = env!("CARGO_BIN_EXE_pd-sim");

/// The cluster under test; dropping it stops every process.
pub struct Cluster {
    inner: test_harness::Cluster,
    pub ready: serde_json::Value,
    pub router: String,
    pub prefill: String,
    pub decode: String,
    pub pids: Vec<u32>,
}

impl Cluster {
    pub async fn start(mode: &str, extra: &[&str]) -> Cluster {
        let mut args = vec!["--mode", mode];
        args.extend_from_slice(extra);
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let start = move || test_harness::Cluster::start(std::path::Path::new(BIN), &args, None);
        // The children carry PR_SET_PDEATHSIG, which fires when the *thread* that forked them
        // exits: a spawn_blocking thread retires after 10 s idle and would take the cluster
        // with it. On a multi-thread runtime fork from this worker thread instead.
        let inner = match tokio::runtime::Handle::current().runtime_flavor() {
            tokio::runtime::RuntimeFlavor::CurrentThread => {
                tokio::task::spawn_blocking(start).await.unwrap()
            }
            _ => tokio::task::block_in_place(start),
        }
        .expect("cluster starts");
        Cluster {
            ready: inner.ready.clone(),
            router: inner.router.clone(),
            prefill: inner.prefill.clone(),
            decode: inner.decode.clone(),
            pids: inner.pids.iter().map(|(_, pid)| *pid).collect(),
            inner,
        }
    }
}

impl std::ops::Deref for Cluster {
    type Target = test_harness::Cluster;
    fn deref(&self) -> &Self::Target {
        &self.inner
    }
}

pub async fn wait_healthy(client: &HttpClient, base: &str) {
    eventually(
        &format!("{base} healthy"),
        Duration::from_secs(30),
        async || matches!(get(client, &format!("{base}/health")).await, Ok((200, _))).then_some(()),
    )
    .await
}

pub async fn get(client: &HttpClient, url: &str) -> Result<(u16, Bytes), String> {
    pd_sim::http::get(client, url, Duration::from_secs(10))
        .await
        .map(|(status, body)| (status.as_u16(), body))
        .map_err(|e| e.to_string())
}

pub async fn get_json(client: &HttpClient, url: &str) -> serde_json::Value {
    let (s, b) = get(client, url).await.expect("GET");
    assert_eq!(s, 200, "GET {url}");
    serde_json::from_slice(&b).expect("json")
}

pub async fn post(
    client: &HttpClient,
    url: &str,
    request_id: &str,
    body: serde_json::Value,
) -> (u16, Bytes) {
    let req = hyper::Request::post(url)
        .header("content-type", "application/json")
        .header("x-request-id", request_id)
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    // Long enough for a router that retries an attempt whose decode leg holds for seconds.
    let resp = tokio::time::timeout(Duration::from_secs(90), client.request(req))
        .await
        .expect("timeout")
        .expect("POST");
    let status = resp.status().as_u16();
    (status, resp.into_body().collect().await.unwrap().to_bytes())
}

/// POST `/generate` to the cluster's router.
pub async fn generate(
    client: &HttpClient,
    c: &Cluster,
    request_id: &str,
    body: serde_json::Value,
) -> (u16, Bytes) {
    post(client, &format!("{}/generate", c.router), request_id, body).await
}

pub fn words(n: usize) -> String {
    vec!["word"; n].join(" ")
}

pub async fn rooms(client: &HttpClient, base: &str) -> Vec<serde_json::Value> {
    get_json(client, &format!("{base}/sim/rooms"))
        .await
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// `revenant run` for the end-to-end tests, from the workspace's binary next to this test (or
/// `REVENANT_BIN`): OTLP alone on ephemeral ports (the harness's defaults), no rate limit, the
/// normalized events in DIR/events.jsonl, then `extra`. Forked from this worker thread, which
/// outlives it (the children's PDEATHSIG follows the forking thread).
pub fn start_revenant(dir: &std::path::Path, extra: &[&str]) -> test_harness::Revenant {
    let bin =
        test_harness::workspace_bin("revenant", "REVENANT_BIN").unwrap_or_else(|e| panic!("{e}"));
    let mut args = vec!["--rate-limit", "0", "--spool-no-fsync"];
    args.extend_from_slice(extra);
    tokio::task::block_in_place(|| {
        test_harness::Revenant::start_recording(&bin, dir, &args, Duration::from_secs(60))
    })
    .unwrap_or_else(|e| panic!("revenant: {e}"))
}

/// Run the `pd-sim load` binary against the router (quiet, at most 10 minutes) and return its
/// summary JSON.
pub fn run_load(router: &str, args: &[&str]) -> serde_json::Value {
    test_harness::run_load_quiet(
        std::path::Path::new(BIN),
        router,
        args,
        Duration::from_secs(600),
    )
    .expect("load runs")
}

/// A TCP proxy in front of a worker's rank port that decodes the ZMTP stream into it (in front
/// of prefill: what decode sends, registration, destinations, BOOTSTRAP, ABORT; in front of
/// decode: what prefill sends, statuses and ABORT_ACKs), so tests see the frames on the wire
/// independently of the simulator's bookkeeping.
pub struct ZmtpTap {
    pub port: u16,
    upstream: Arc<Mutex<Option<SocketAddr>>>,
    pub messages: Arc<Mutex<Vec<Vec<Bytes>>>>,
}

impl ZmtpTap {
    pub async fn start() -> ZmtpTap {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let upstream: Arc<Mutex<Option<SocketAddr>>> = Arc::default();
        let messages: Arc<Mutex<Vec<Vec<Bytes>>>> = Arc::default();
        let (up, msgs) = (upstream.clone(), messages.clone());
        tokio::spawn(async move {
            while let Ok((down, _)) = l.accept().await {
                let to = up.lock().unwrap().expect("tap upstream set before traffic");
                let msgs = msgs.clone();
                tokio::spawn(async move {
                    let upc = TcpStream::connect(to).await.unwrap();
                    let (mut dr, mut dw) = down.into_split();
                    let (mut ur, mut uw) = upc.into_split();
                    tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut ur, &mut dw).await;
                    });
                    let mut dec = pd_sim::zmtp::StreamDecoder::default();
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match dr.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        dec.push(&buf[..n]);
                        while let Ok(Some(m)) = dec.next_message() {
                            msgs.lock().unwrap().push(m);
                        }
                        if uw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        ZmtpTap {
            port,
            upstream,
            messages,
        }
    }

    pub fn set_upstream(&self, a: SocketAddr) {
        *self.upstream.lock().unwrap() = Some(a);
    }

    /// A cluster whose prefill advertises this tap as its KV port (`prefill_args` are added
    /// after `--advertise-kv-port`), with the tap forwarding to prefill's real one.
    pub async fn cluster(mode: &str, prefill_args: &str, extra: &[&str]) -> (ZmtpTap, Cluster) {
        let tap = ZmtpTap::start().await;
        let adv = format!("--advertise-kv-port {} {prefill_args}", tap.port);
        let mut args = vec!["--prefill-args", adv.as_str()];
        args.extend_from_slice(extra);
        let c = Cluster::start(mode, &args).await;
        let kv_port = c.ready["prefill_kv_port"].as_u64().unwrap() as u16;
        tap.set_upstream(([127, 0, 0, 1], kv_port).into());
        (tap, c)
    }

    /// Both directions: a cluster whose prefill and decode each announce a tap as their rank
    /// port. Returns (frames to prefill, frames to decode, the cluster).
    pub async fn cluster_both(
        mode: &str,
        prefill_args: &str,
        decode_args: &str,
        extra: &[&str],
    ) -> (ZmtpTap, ZmtpTap, Cluster) {
        let (to_p, to_d) = (ZmtpTap::start().await, ZmtpTap::start().await);
        let pa = format!("--advertise-kv-port {} {prefill_args}", to_p.port);
        let da = format!("--advertise-kv-port {} {decode_args}", to_d.port);
        let mut args = vec!["--prefill-args", pa.as_str(), "--decode-args", da.as_str()];
        args.extend_from_slice(extra);
        let c = Cluster::start(mode, &args).await;
        let port = |k: &str| c.ready[k].as_u64().unwrap() as u16;
        to_p.set_upstream(([127, 0, 0, 1], port("prefill_kv_port")).into());
        to_d.set_upstream(([127, 0, 0, 1], port("decode_kv_port")).into());
        (to_p, to_d, c)
    }

    pub fn all(&self) -> Vec<Vec<Bytes>> {
        self.messages.lock().unwrap().clone()
    }

    /// Rooms of the 10-frame destinations messages (frame 0 is the room).
    pub fn destination_rooms(&self) -> Vec<u64> {
        self.all()
            .iter()
            .filter(|m| m.len() == 10)
            .filter_map(|m| std::str::from_utf8(&m[0]).ok()?.parse().ok())
            .collect()
    }

    /// Decode's 20-frame registrations (`b"None"` first).
    pub fn registrations(&self) -> usize {
        self.all()
            .iter()
            .filter(|m| m.len() == 20 && &m[0][..] == b"None")
            .count()
    }

    /// The status values `[room, status, rank]` carried for `room`, in order.
    pub fn statuses(&self, room: u64) -> Vec<u8> {
        let r = room.to_string();
        self.all()
            .iter()
            .filter(|m| m.len() == 3 && m[0] == r.as_bytes())
            .filter_map(|m| std::str::from_utf8(&m[1]).ok()?.parse().ok())
            .collect()
    }

    /// Every ABORT for `room`: its frames.
    pub fn aborts(&self, room: u64) -> Vec<Vec<Bytes>> {
        let r = room.to_string();
        self.all()
            .into_iter()
            .filter(|m| {
                m.first().is_some_and(|v| &v[..] == b"ABORT")
                    && m.get(1).is_some_and(|x| x == r.as_bytes())
            })
            .collect()
    }

    /// [`Self::aborts`] once at least one is on the wire, or after 10 s: an ABORT travels after
    /// the answer a test has just read, and the tap records it a moment later.
    pub async fn aborts_seen(&self, room: u64) -> Vec<Vec<Bytes>> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let a = self.aborts(room);
            if !a.is_empty() || std::time::Instant::now() > deadline {
                return a;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    pub fn rooms_with_verb(&self, verb: &[u8]) -> Vec<u64> {
        self.messages
            .lock()
            .unwrap()
            .iter()
            .filter(|m| m.first().map(|v| &v[..] == verb).unwrap_or(false))
            .filter_map(|m| {
                m.get(1)
                    .and_then(|r| std::str::from_utf8(r).ok()?.parse().ok())
            })
            .collect()
    }
}

/// Minimal OTLP/HTTP protobuf receiver: accepts POST /v1/traces and keeps the spans.
pub struct OtlpReceiver {
    pub url: String,
    pub spans: Arc<Mutex<Vec<(String, opentelemetry_proto::tonic::trace::v1::Span)>>>,
}

impl OtlpReceiver {
    pub async fn start() -> OtlpReceiver {
        use prost::Message;
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let spans: Arc<Mutex<Vec<(String, opentelemetry_proto::tonic::trace::v1::Span)>>> =
            Arc::default();
        let s2 = spans.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: Bytes| {
                let s2 = s2.clone();
                async move {
                    let Ok(req) =
                        opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest::decode(body)
                    else {
                        return axum::http::StatusCode::BAD_REQUEST;
                    };
                    let mut g = s2.lock().unwrap();
                    for rs in req.resource_spans {
                        let svc = rs
                            .resource
                            .iter()
                            .flat_map(|r| r.attributes.iter())
                            .find(|kv| kv.key == "service.name")
                            .and_then(|kv| kv.value.as_ref())
                            .and_then(|v| match &v.value {
                                Some(opentelemetry_proto::tonic::common::v1::any_value::Value::StringValue(s)) => {
                                    Some(s.clone())
                                }
                                _ => None,
                            })
                            .unwrap_or_default();
                        for ss in rs.scope_spans {
                            for sp in ss.spans {
                                g.push((svc.clone(), sp));
                            }
                        }
                    }
                    axum::http::StatusCode::OK
                }
            }),
        );
        tokio::spawn(async move {
            let _ = axum::serve(l, app).await;
        });
        OtlpReceiver { url, spans }
    }
}

pub fn attr<'a>(s: &'a opentelemetry_proto::tonic::trace::v1::Span, key: &str) -> Option<&'a str> {
    s.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| match &v.value {
            Some(opentelemetry_proto::tonic::common::v1::any_value::Value::StringValue(s)) => {
                Some(s.as_str())
            }
            _ => None,
        })
}

/// A child process killed when dropped.
pub struct Proc(pub Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A standalone worker on ephemeral ports and its READY object.
pub fn worker(role: &str, extra: &[&str]) -> (Proc, serde_json::Value) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_pd-sim"))
        .args([role, "--port", "0", "--kv-port", "0"])
        .args(extra)
        .env("PD_SIM_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn worker");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let ready = serde_json::from_str(line.trim().strip_prefix("READY ").expect("READY")).unwrap();
    (Proc(child), ready)
}

/// Run `interop/zmq_interop.py` with `python` against a standalone prefill and decode; what it
/// printed.
pub fn run_interop(python: &str, extra: &[&str]) -> serde_json::Value {
    let (_prefill, p) = worker(
        "prefill",
        &[
            "--disaggregation-bootstrap-port",
            "0",
            "--max-req-input-len",
            "100",
        ],
    );
    let (_decode, d) = worker("decode", &["--te-port", "0"]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/interop/zmq_interop.py");
    let mut py = Proc(
        Command::new(python)
            .arg(script)
            .arg(p["http"].as_str().unwrap())
            .arg(p["bootstrap_port"].to_string())
            .arg(d["http"].as_str().unwrap())
            .args(extra)
            .stdout(Stdio::piped())
            .spawn()
            .expect("run python"),
    );
    // SGLang's import alone takes ~15 s on this box.
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(s) = py.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "python interop timed out"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut out = String::new();
    py.0.stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert!(status.success(), "interop script failed: {out}");
    serde_json::from_str(out.trim().lines().last().unwrap_or("")).unwrap()
}

/// A TCP proxy that decodes the ZMTP stream both ways (after each side's greeting and READY):
/// `up` what the connecting side sent, `down` what the listening side answered, in order.
pub struct DuplexTap {
    pub port: u16,
    upstream: Arc<Mutex<Option<SocketAddr>>>,
    pub up: Frames,
    pub down: Frames,
}

/// ZMTP messages as a tap saw them, each a list of frames.
pub type Frames = Arc<Mutex<Vec<Vec<Bytes>>>>;

impl DuplexTap {
    pub async fn start() -> DuplexTap {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let upstream: Arc<Mutex<Option<SocketAddr>>> = Arc::default();
        let up: Frames = Arc::default();
        let down: Frames = Arc::default();
        let (to, u2, d2) = (upstream.clone(), up.clone(), down.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = l.accept().await {
                let addr = to.lock().unwrap().expect("tap upstream set before traffic");
                let (u2, d2) = (u2.clone(), d2.clone());
                tokio::spawn(async move {
                    let server = TcpStream::connect(addr).await.unwrap();
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::spawn(Self::pump(sr, cw, d2));
                    Self::pump(cr, sw, u2).await;
                });
            }
        });
        DuplexTap {
            port,
            upstream,
            up,
            down,
        }
    }

    async fn pump(
        mut r: tokio::net::tcp::OwnedReadHalf,
        mut w: tokio::net::tcp::OwnedWriteHalf,
        into: Frames,
    ) {
        let mut dec = pd_sim::zmtp::StreamDecoder::default();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            dec.push(&buf[..n]);
            while let Ok(Some(m)) = dec.next_message() {
                into.lock().unwrap().push(m);
            }
            if w.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    }

    pub fn set_upstream(&self, a: SocketAddr) {
        *self.upstream.lock().unwrap() = Some(a);
    }

    /// A vLLM mooncake cluster whose prefill registers this tap as its sender's address, the tap
    /// forwarding to prefill's real ROUTER.
    pub async fn mooncake_cluster(
        mode: &str,
        prefill_args: &str,
        extra: &[&str],
    ) -> (DuplexTap, Cluster) {
        let tap = DuplexTap::start().await;
        let adv = format!("--advertise-kv-port {} {prefill_args}", tap.port);
        let mut args = vec![
            "--flavour",
            "vllm",
            "--kv-connector",
            "mooncake",
            "--prefill-args",
            adv.as_str(),
        ];
        args.extend_from_slice(extra);
        let c = Cluster::start(mode, &args).await;
        let side = c.ready["prefill_side_channel_port"].as_u64().unwrap() as u16;
        tap.set_upstream(([127, 0, 0, 1], side).into());
        (tap, c)
    }
}

/// The real vllm-router 0.1.17 (`PD_SIM_VLLM_ROUTER`; the tests that call this must run against
/// the real binary, so it panics with what to set when it is missing).
pub fn vllm_router() -> std::path::PathBuf {
    test_harness::router_from_env("PD_SIM_VLLM_ROUTER", "vllm-router 0.1.17")
}

/// `vllm-router --vllm-pd-disaggregation` in front of the cluster's workers, with
/// `--kv-connector mooncake` and prefill's bootstrap port when `mooncake` names it; its output
/// to `log`; dropped, stopped. Returns it and its URL.
pub fn start_vllm_router(
    bin: &std::path::Path,
    c: &Cluster,
    mooncake: Option<u64>,
    log: &std::path::Path,
) -> (test_harness::Proc, String) {
    let port = test_harness::free_port().unwrap();
    let prom = test_harness::free_port().unwrap();
    let out = std::fs::File::create(log).unwrap();
    let err = out.try_clone().unwrap();
    let mut cmd = Command::new(bin);
    cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args([
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            &prom.to_string(),
        ])
        .arg("--vllm-pd-disaggregation")
        .args(["--prefill", &c.prefill]);
    if let Some(boot) = mooncake {
        cmd.arg(boot.to_string())
            .args(["--kv-connector", "mooncake"]);
    }
    cmd.args(["--decode", &c.decode])
        .args(["--policy", "round_robin"])
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    // Forked from this long-lived worker thread (the child's PDEATHSIG follows the thread).
    let proc = tokio::task::block_in_place(|| test_harness::Proc::spawn("vllm-router", &mut cmd))
        .unwrap()
        .with_grace(Duration::from_secs(3));
    (proc, format!("http://127.0.0.1:{port}"))
}
