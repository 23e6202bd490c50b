//! Shared by the eBPF tests (`ebpf_probe`, `ebpf_sim`, `ebpf_real_router`): the simulator binary,
//! the real source and checker driven in-process, and a tracing capture for the privacy checks.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use revenant::ingest::ebpf::{EbpfConfig, EbpfSource, EbpfStats, Role};
use revenant::pipeline::EventBatch;
use revenant::{Checker, CheckerConfig, Kind, LifecycleEvent, RuleSet, Stage, Violation};

/// The `pd-sim` binary ([`test_harness::pd_sim_bin`]); panics (never skips) when it cannot be
/// had.
pub fn pd_sim_bin() -> PathBuf {
    test_harness::pd_sim_bin().unwrap_or_else(|e| panic!("{e:#}"))
}

pub fn start_source(cfg: EbpfConfig) -> EbpfSource {
    EbpfSource::start(cfg).unwrap_or_else(|e| {
        panic!("eBPF probes must load on this machine (run as root after `cargo xtask setup`): {e}")
    })
}

/// Drains (and rescans) until every pid is watched with the role `want` says, or panics.
pub fn wait_roles(src: &mut EbpfSource, want: &[(u32, Role)], sink: &mut Vec<LifecycleEvent>) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !want.iter().all(|(p, r)| src.watched().get(p) == Some(r)) {
        assert!(
            Instant::now() < deadline,
            "roles {want:?} never reached; watched: {:?}",
            src.watched()
        );
        src.rescan();
        src.drain(sink);
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Everything the tracing subscriber wrote, for the privacy checks.
#[derive(Clone, Default)]
pub struct LogCapture(Arc<Mutex<Vec<u8>>>);

impl LogCapture {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// The capture every thread of this test binary logs into: a global subscriber at TRACE,
    /// installed once. (A thread-local default misses callsites whose interest another test
    /// thread, logging to no subscriber, cached first.)
    pub fn global() -> LogCapture {
        static CAPTURE: OnceLock<LogCapture> = OnceLock::new();
        CAPTURE
            .get_or_init(|| {
                let c = LogCapture::default();
                tracing::subscriber::set_global_default(c.subscriber())
                    .expect("no other global tracing subscriber in this test binary");
                c
            })
            .clone()
    }

    /// A subscriber at TRACE that writes here.
    pub fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync + use<> {
        tracing_subscriber::fmt()
            .with_writer(self.clone())
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .finish()
    }
}

impl Write for LogCapture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogCapture {
    type Writer = LogCapture;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// What the live source delivered and what the checker made of it.
#[derive(Default)]
pub struct Observed {
    pub events: Vec<LifecycleEvent>,
    pub violations: Vec<Violation>,
}

impl Observed {
    pub fn count(&self, stage: Stage, kind: Kind) -> usize {
        self.events
            .iter()
            .filter(|e| e.stage == stage && e.kind == kind)
            .count()
    }

    pub fn per_rule(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for v in &self.violations {
            *m.entry(v.rule.clone()).or_default() += 1;
        }
        m
    }

    pub fn of_rule(&self, rule: &str) -> Vec<&Violation> {
        self.violations.iter().filter(|v| v.rule == rule).collect()
    }
}

/// Runs the source as `revenant run` does (its own task, a bounded channel, `try_send`) and
/// the default rules over what it sends, on a current-thread runtime. `drive` runs on a plain thread meanwhile (the
/// traffic); afterwards the source keeps running until `settled` holds for what was observed
/// (or 30 s passed), then the checker's clock is moved past every deadline.
pub fn run_live<T: Send + 'static>(
    src: EbpfSource,
    drive: impl FnOnce() -> T + Send + 'static,
    settled: impl Fn(&Observed, &T) -> bool,
) -> (Observed, T, Arc<EbpfStats>) {
    let stats = src.stats();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<EventBatch>(1024);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let source = tokio::spawn(src.run(tx, async {
            let _ = stop_rx.await;
        }));
        let mut checker = Checker::new(RuleSet::embedded_defaults(), CheckerConfig::default());
        let mut obs = Observed::default();
        let mut feed = |batch: EventBatch, obs: &mut Observed| {
            for e in batch {
                obs.violations.extend(checker.observe(&e));
                obs.events.push(e);
            }
        };
        let driver = std::thread::spawn(drive);
        while !driver.is_finished() {
            if let Ok(Some(b)) = tokio::time::timeout(Duration::from_millis(50), rx.recv()).await {
                feed(b, &mut obs);
            }
        }
        let out = driver.join().expect("traffic thread panicked");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !settled(&obs, &out) && Instant::now() < deadline {
            if let Ok(Some(b)) = tokio::time::timeout(Duration::from_millis(50), rx.recv()).await {
                feed(b, &mut obs);
            }
        }
        let _ = stop_tx.send(());
        source
            .await
            .expect("source task")
            .expect("source run failed");
        while let Some(b) = rx.recv().await {
            feed(b, &mut obs);
        }
        let last = obs.events.iter().map(|e| e.time_ns).max().unwrap_or(0);
        obs.violations
            .extend(checker.tick(last + Duration::from_secs(600).as_nanos() as u64));
        (obs, out, stats)
    })
}

/// Fails if `canary` shows in any event, violation (as alerts carry them) or log line.
pub fn assert_canary_absent(canary: &str, obs: &Observed, logs: &LogCapture) {
    for e in &obs.events {
        let json = serde_json::to_string(&revenant::ingest::replay::ReplayRecord::from_event(e))
            .expect("event json");
        assert!(
            !json.contains(canary),
            "prompt text reached an event: {json}"
        );
        assert!(!format!("{e:?}").contains(canary), "prompt text in {e:?}");
    }
    for v in &obs.violations {
        // As the alert sinks send it (JSONL, webhook): an incident listing the violation.
        use revenant::alert::notification::{IncidentAlert, LinkBase, Notification};
        let alert = Notification::Incident(IncidentAlert::for_violation(
            v.fingerprint.clone(),
            v,
            1,
            LinkBase(Some("http://127.0.0.1:9464".into())).links(v),
            v.detected_at_ns,
        ));
        let json = serde_json::to_string(&alert).expect("alert json");
        assert!(
            !json.contains(canary),
            "prompt text reached an alert: {json}"
        );
    }
    let text = logs.text();
    assert!(
        !text.contains(canary),
        "prompt text reached the source's log output"
    );
}

pub fn json_u64(v: &serde_json::Value, path: &[&str]) -> u64 {
    let mut cur = v;
    for k in path {
        cur = &cur[*k];
    }
    cur.as_u64()
        .unwrap_or_else(|| panic!("{path:?} not a number in {v}"))
}

/// For a failure message: the events of (at most 3) requests that have a `has` event at
/// `stage` but no `lacks` event there.
pub fn requests_missing(obs: &Observed, stage: Stage, has: Kind, lacks: Kind) -> String {
    let ids: BTreeMap<&str, ()> = obs
        .events
        .iter()
        .filter(|e| e.stage == stage && e.kind == has)
        .filter_map(|e| e.ids.request_id.as_deref())
        .filter(|id| {
            !obs.events.iter().any(|e| {
                e.stage == stage && e.kind == lacks && e.ids.request_id.as_deref() == Some(*id)
            })
        })
        .map(|id| (id, ()))
        .collect();
    let mut out = format!(
        "{} requests with {stage}/{has} but no {stage}/{lacks}",
        ids.len()
    );
    for id in ids.keys().take(3) {
        out.push_str(&format!("\n{id}:"));
        for e in obs
            .events
            .iter()
            .filter(|e| e.ids.request_id.as_deref() == Some(*id))
        {
            out.push_str(&format!(
                "\n  {}/{} room={:?} status={:?} pid={:?} detail={:?}",
                e.stage, e.kind, e.ids.bootstrap_room, e.status, e.pid, e.detail
            ));
        }
    }
    out
}

/// Minimal blocking `POST path` with a JSON body and an `x-request-id` (loopback only,
/// `Connection: close`): the status and the raw response.
pub fn http_post_json(base: &str, path: &str, request_id: &str, body: &str) -> (u16, String) {
    use std::io::Read;
    let host = base
        .strip_prefix("http://")
        .unwrap_or_else(|| panic!("not an http URL: {base}"));
    let mut s = std::net::TcpStream::connect(host).unwrap_or_else(|e| panic!("{base}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(120))).ok();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nx-request-id: {request_id}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("send request");
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).expect("read response");
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line from {base}{path}: {text:.200}"));
    (status, text)
}

/// A directory with a minimal WordLevel `tokenizer.json`, so that `smg --model-path` loads a
/// tokenizer without downloading one.
pub fn tokenizer_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut vocab = serde_json::Map::new();
    for (i, w) in ["[UNK]", "a", "b", "c", "the", "quick", "brown", "fox"]
        .iter()
        .enumerate()
    {
        vocab.insert((*w).into(), i.into());
    }
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    std::fs::write(dir.path().join("tokenizer.json"), tok.to_string()).expect("tokenizer.json");
    dir
}
