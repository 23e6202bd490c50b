//! Open-loop load generator: requests leave on a fixed schedule (rate R) regardless of how
//! fast answers come back, up to `--max-inflight` outstanding requests.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use serde::Serialize;
use tokio::sync::Semaphore;

use crate::http::http_client;

#[derive(Clone, Debug)]
pub struct Range {
    pub min: u64,
    pub max: u64,
}

impl std::str::FromStr for Range {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (a, b) = s
            .split_once("..")
            .ok_or_else(|| format!("expected MIN..MAX, got {s:?}"))?;
        let min: u64 = a
            .trim()
            .parse()
            .map_err(|e| format!("bad MIN in {s:?}: {e}"))?;
        let max: u64 = b
            .trim()
            .trim_start_matches('=')
            .parse()
            .map_err(|e| format!("bad MAX in {s:?}: {e}"))?;
        if min > max || min == 0 {
            return Err(format!("need 1 <= MIN <= MAX, got {s:?}"));
        }
        Ok(Range { min, max })
    }
}

/// Which request bodies the load generator sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LoadApi {
    /// SGLang's `/generate` (`text`, `sampling_params.max_new_tokens`); chat as below.
    Sglang,
    /// OpenAI's `/v1/completions` (`prompt`, `max_tokens`), as vLLM serves it.
    Openai,
    /// Each request `/generate` or `/v1/completions`, with equal chance (chat as above).
    Mixed,
}

#[derive(clap::Args, Clone, Debug)]
pub struct LoadArgs {
    /// Request bodies: `sglang` (`/generate`), `openai` (`/v1/completions`) or `mixed` (either,
    /// with equal chance); chat requests (`--chat-share`) go to `/v1/chat/completions` with
    /// `messages` and `max_tokens` whichever is chosen.
    #[arg(long, value_enum, default_value_t = LoadApi::Sglang)]
    pub api: LoadApi,
    /// Router base URL, e.g. http://127.0.0.1:30000
    #[arg(long)]
    pub router: String,
    /// Requests per second (open loop).
    #[arg(long, default_value_t = 100.0)]
    pub rate: f64,
    #[arg(long, default_value_t = 1000)]
    pub requests: u64,
    /// Prompt length in words (= tokens) for ordinary requests.
    #[arg(long, default_value = "16..256")]
    pub prompt_len: Range,
    /// Share of requests made over capacity (length drawn from --over-capacity-len).
    #[arg(long, default_value_t = 0.0)]
    pub over_capacity_share: f64,
    /// Prompt length of over-capacity requests: a range, or several separated by commas (each
    /// request draws one of them with equal chance, e.g. `91..127,128..200` for both of
    /// SGLang's refusal paths). The default sits between the simulator's default prefill
    /// max_req_input_len (4096, set by `cluster`) and its context length (8192); for `cluster
    /// --flavour vllm` it is above prefill's max_model_len (4096) and below decode's (32768).
    #[arg(long, default_value = "4200..8000", value_delimiter = ',')]
    pub over_capacity_len: Vec<Range>,
    /// Share of requests sent with `"stream": true`.
    #[arg(long, default_value_t = 0.0)]
    pub stream_share: f64,
    /// Share of requests sent to /v1/chat/completions instead of /generate (/v1/completions).
    #[arg(long, default_value_t = 0.0)]
    pub chat_share: f64,
    #[arg(long, default_value_t = 8)]
    pub max_new_tokens: u64,
    /// The `model` of OpenAI request bodies (a router may route by it: smg wants the served
    /// model's name).
    #[arg(long, default_value = "pd-sim")]
    pub model: String,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// A marker inserted into every prompt, for privacy tests (it must never leave the
    /// parsing layer of a monitor).
    #[arg(long)]
    pub canary: Option<String>,
    #[arg(long, default_value_t = 4096)]
    pub max_inflight: usize,
    /// Prefix of the x-request-id of request i: "{prefix}-{i}".
    #[arg(long, default_value = "load")]
    pub request_id_prefix: String,
    #[arg(long)]
    pub summary_json: Option<std::path::PathBuf>,
    /// One JSON line per request once all are done: `i`, `request_id`, `path`, `stream`,
    /// `words`, `over_capacity`, `sent_ns` (Unix time), `status`, `error_code` (a streamed
    /// answer's in-stream error), `latency_ms`, or `error` (the transport failure's kind).
    #[arg(long)]
    pub results_jsonl: Option<std::path::PathBuf>,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 60)]
    pub timeout_secs: u64,
    #[arg(long)]
    pub quiet: bool,
}

#[derive(Serialize, Debug, Default)]
pub struct Summary {
    pub sent: u64,
    pub ok: u64,
    pub rejected_by_status: BTreeMap<u16, u64>,
    /// Streamed answers with status 200 that carry an error (SGLang's `data: {"error": …}` or a
    /// chunk whose `finish_reason` is an abort with a status code), by that code. Not in `ok`.
    pub failed_in_stream: BTreeMap<u16, u64>,
    pub errors: u64,
    /// Transport failures by kind: connect, request, body, timeout.
    pub errors_by_kind: BTreeMap<String, u64>,
    pub over_capacity_sent: u64,
    pub streamed: u64,
    pub duration_s: f64,
    pub target_rate: f64,
    pub achieved_rate: f64,
    pub latency_ms_p50: f64,
    pub latency_ms_p99: f64,
    pub latency_ms_max: f64,
}

/// The status code of the error a streamed (SSE) answer carries, if any: SGLang's
/// `data: {"error": {…, "code": N}}` event, or a chunk whose `meta_info.finish_reason` is an
/// abort with a `status_code`.
pub fn stream_error_code(body: &[u8]) -> Option<u16> {
    let text = std::str::from_utf8(body).ok()?;
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else {
            continue;
        };
        if let Some(e) = v.get("error") {
            return Some(e.get("code").and_then(|c| c.as_u64()).unwrap_or(400) as u16);
        }
        let fr = &v["meta_info"]["finish_reason"];
        if fr["type"] == "abort"
            && let Some(code) = fr["status_code"].as_u64()
        {
            return Some(code as u16);
        }
    }
    None
}

#[derive(Default)]
struct Counters {
    sent: AtomicU64,
    done: AtomicU64,
    ok: AtomicU64,
    errors: AtomicU64,
    rejected: AtomicU64,
}

const VOCAB: [&str; 32] = [
    "alpha", "river", "stone", "cloud", "maple", "north", "quiet", "ember", "lumen", "orbit",
    "pixel", "cedar", "delta", "frost", "grove", "harbor", "ivory", "jade", "kite", "lotus",
    "meadow", "nova", "opal", "prism", "quartz", "raven", "sable", "tide", "umber", "vivid",
    "willow", "zephyr",
];

fn prompt(rng: &mut SmallRng, words: u64, canary: Option<&str>) -> String {
    let mut s = String::with_capacity(words as usize * 7);
    let canary_at = canary.map(|_| rng.random_range(0..words));
    for i in 0..words {
        if i > 0 {
            s.push(' ');
        }
        match (canary_at, canary) {
            (Some(at), Some(c)) if at == i => s.push_str(c),
            _ => s.push_str(VOCAB[rng.random_range(0..VOCAB.len())]),
        }
    }
    s
}

pub async fn run(args: LoadArgs) -> anyhow::Result<Summary> {
    if args.rate <= 0.0 {
        anyhow::bail!("--rate must be > 0");
    }
    for (n, v) in [
        ("--over-capacity-share", args.over_capacity_share),
        ("--stream-share", args.stream_share),
        ("--chat-share", args.chat_share),
    ] {
        if !(0.0..=1.0).contains(&v) {
            anyhow::bail!("{n} must be within 0..=1");
        }
    }
    if let Some(c) = &args.canary
        && c.split_whitespace().count() != 1
    {
        anyhow::bail!("--canary must be one word (it counts as one token)");
    }
    let base = args.router.trim_end_matches('/').to_string();
    base.parse::<hyper::Uri>()?;
    let client = http_client(args.max_inflight);
    let sem = Arc::new(Semaphore::new(args.max_inflight.max(1)));
    let counters = Arc::new(Counters::default());
    if args.over_capacity_len.is_empty() {
        anyhow::bail!("--over-capacity-len needs at least one range");
    }
    let (lat_tx, mut lat_rx) = tokio::sync::mpsc::unbounded_channel::<Outcome>();
    // What each request was, for `--results-jsonl`.
    let mut sent_meta: Vec<RequestMeta> = Vec::new();
    let first_error_logged = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut rng = SmallRng::seed_from_u64(args.seed);
    let start = Instant::now();
    let interval = Duration::from_secs_f64(1.0 / args.rate);

    let progress = {
        let c = counters.clone();
        let total = args.requests;
        let quiet = args.quiet;
        tokio::spawn(async move {
            let tty = std::io::stderr().is_terminal();
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.tick().await;
            let mut last_done = 0;
            loop {
                tick.tick().await;
                if quiet {
                    continue;
                }
                let done = c.done.load(Ordering::Relaxed);
                let line = format!(
                    "[{:>5.1}s] sent {}/{} done {} ok {} rejected {} errors {} ({} req/s)",
                    start.elapsed().as_secs_f64(),
                    c.sent.load(Ordering::Relaxed),
                    total,
                    done,
                    c.ok.load(Ordering::Relaxed),
                    c.rejected.load(Ordering::Relaxed),
                    c.errors.load(Ordering::Relaxed),
                    done - last_done
                );
                last_done = done;
                if tty {
                    eprint!("\r{line}\x1b[K");
                } else {
                    eprintln!("{line}");
                }
            }
        })
    };

    let mut over = 0u64;
    let mut streamed = 0u64;
    let mut handles = Vec::with_capacity(args.requests as usize);
    for i in 0..args.requests {
        let due = start + interval.mul_f64(i as f64);
        let now = Instant::now();
        if due > now {
            tokio::time::sleep(due - now).await;
        }
        let permit = sem.clone().acquire_owned().await?;
        let is_over = rng.random::<f64>() < args.over_capacity_share;
        let r = if is_over {
            // One range draws nothing: a seed gives the sequence it gave before ranges.
            match args.over_capacity_len.as_slice() {
                [one] => one,
                ranges => &ranges[rng.random_range(0..ranges.len())],
            }
        } else {
            &args.prompt_len
        };
        let words = rng.random_range(r.min..=r.max);
        let stream = rng.random::<f64>() < args.stream_share;
        let chat = rng.random::<f64>() < args.chat_share;
        let completions = match args.api {
            LoadApi::Sglang => false,
            LoadApi::Openai => true,
            LoadApi::Mixed => rng.random::<bool>(),
        };
        over += is_over as u64;
        streamed += stream as u64;
        let text = prompt(&mut rng, words, args.canary.as_deref());
        let (path, body) = if chat {
            (
                "/v1/chat/completions",
                serde_json::json!({"model": args.model, "messages": [{"role": "user", "content": text}],
                                   "max_tokens": args.max_new_tokens, "stream": stream}),
            )
        } else if completions {
            (
                "/v1/completions",
                serde_json::json!({"model": args.model, "prompt": text, "max_tokens": args.max_new_tokens, "stream": stream}),
            )
        } else {
            (
                "/generate",
                serde_json::json!({"text": text, "sampling_params": {"max_new_tokens": args.max_new_tokens}, "stream": stream}),
            )
        };
        let request_id = format!("{}-{i}", args.request_id_prefix);
        if args.results_jsonl.is_some() {
            sent_meta.push(RequestMeta {
                i,
                request_id: request_id.clone(),
                path,
                stream,
                words,
                over_capacity: is_over,
                sent_ns: crate::ids::now_ns(),
            });
        }
        let req = hyper::Request::post(format!("{base}{path}"))
            .header("content-type", "application/json")
            .header("x-request-id", request_id)
            .body(Full::new(Bytes::from(body.to_string())))?;
        let client = client.clone();
        let c = counters.clone();
        let lat_tx = lat_tx.clone();
        let timeout = Duration::from_secs(args.timeout_secs);
        c.sent.fetch_add(1, Ordering::Relaxed);
        let logged = first_error_logged.clone();
        handles.push(tokio::spawn(async move {
            let _permit = permit;
            let t = Instant::now();
            let res = tokio::time::timeout(timeout, async {
                let resp = client.request(req).await.map_err(|e| {
                    let kind = if e.is_connect() { "connect" } else { "request" };
                    (kind, e.to_string())
                })?;
                let status = resp.status().as_u16();
                let body = resp
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| ("body", e.to_string()))?
                    .to_bytes();
                // A streamed refusal is a 200 whose stream carries the error.
                let in_stream = (stream && status == 200)
                    .then(|| stream_error_code(&body))
                    .flatten();
                Ok::<(u16, Option<u16>), (&'static str, String)>((status, in_stream))
            })
            .await
            .unwrap_or_else(|_| Err(("timeout", "request timed out".to_string())));
            let el = t.elapsed();
            match res {
                Ok((status, in_stream)) => {
                    if (200..300).contains(&status) && in_stream.is_none() {
                        c.ok.fetch_add(1, Ordering::Relaxed);
                    } else {
                        c.rejected.fetch_add(1, Ordering::Relaxed);
                    }
                    let _ = lat_tx.send((i, Ok((status, in_stream)), el));
                }
                Err((kind, msg)) => {
                    c.errors.fetch_add(1, Ordering::Relaxed);
                    // One line for the first failure, not one per request.
                    if !logged.swap(true, Ordering::Relaxed) {
                        tracing::warn!(kind, error = %msg, "first failed request (others are only counted)");
                    }
                    let _ = lat_tx.send((i, Err(kind), el));
                }
            }
            c.done.fetch_add(1, Ordering::Relaxed);
        }));
    }
    for h in handles {
        let _ = h.await;
    }
    let duration = start.elapsed();
    progress.abort();
    if !args.quiet && std::io::stderr().is_terminal() {
        eprintln!();
    }
    drop(lat_tx);
    let mut lat = Vec::with_capacity(args.requests as usize);
    let mut summary = Summary {
        target_rate: args.rate,
        over_capacity_sent: over,
        streamed,
        ..Default::default()
    };
    let mut results: Vec<Outcome> = Vec::new();
    while let Some((i, res, el)) = lat_rx.recv().await {
        if args.results_jsonl.is_some() {
            results.push((i, res, el));
        }
        summary.sent += 1;
        let (status, in_stream) = match res {
            Ok(s) => s,
            Err(kind) => {
                summary.errors += 1;
                *summary.errors_by_kind.entry(kind.to_string()).or_default() += 1;
                continue;
            }
        };
        lat.push(el.as_secs_f64() * 1000.0);
        if let Some(code) = in_stream {
            *summary.failed_in_stream.entry(code).or_default() += 1;
        } else if (200..300).contains(&status) {
            summary.ok += 1;
        } else {
            *summary.rejected_by_status.entry(status).or_default() += 1;
        }
    }
    lat.sort_by(|a, b| a.total_cmp(b));
    let pct = |q: f64| {
        if lat.is_empty() {
            0.0
        } else {
            lat[((lat.len() as f64 - 1.0) * q).round() as usize]
        }
    };
    summary.latency_ms_p50 = pct(0.5);
    summary.latency_ms_p99 = pct(0.99);
    summary.latency_ms_max = lat.last().copied().unwrap_or(0.0);
    summary.duration_s = duration.as_secs_f64();
    summary.achieved_rate = summary.sent as f64 / summary.duration_s.max(1e-9);
    print_summary(&summary);
    if let Some(p) = &args.summary_json {
        std::fs::write(p, serde_json::to_vec_pretty(&summary)?)?;
    }
    if let Some(p) = &args.results_jsonl {
        write_results(p, &sent_meta, results)?;
    }
    Ok(summary)
}

/// What came back for request `i`: status and in-stream error code, or the transport
/// failure's kind; and how long it took.
type Outcome = (u64, Result<(u16, Option<u16>), &'static str>, Duration);

/// What one request was (`--results-jsonl`).
struct RequestMeta {
    i: u64,
    request_id: String,
    path: &'static str,
    stream: bool,
    words: u64,
    over_capacity: bool,
    sent_ns: u64,
}

/// `--results-jsonl`: each request with what came back, in the order they were sent.
fn write_results(
    path: &std::path::Path,
    meta: &[RequestMeta],
    mut results: Vec<Outcome>,
) -> anyhow::Result<()> {
    use std::io::Write;
    results.sort_by_key(|r| r.0);
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    for (m, (i, res, el)) in meta.iter().zip(&results) {
        debug_assert_eq!(m.i, *i);
        let mut v = serde_json::json!({
            "i": m.i, "request_id": m.request_id, "path": m.path, "stream": m.stream,
            "words": m.words, "over_capacity": m.over_capacity, "sent_ns": m.sent_ns,
            "latency_ms": el.as_secs_f64() * 1000.0,
        });
        match res {
            Ok((status, in_stream)) => {
                v["status"] = (*status).into();
                v["error_code"] = in_stream.unwrap_or(0).into();
            }
            Err(kind) => v["error"] = (*kind).into(),
        }
        writeln!(out, "{v}")?;
    }
    out.flush()?;
    Ok(())
}

fn print_summary(s: &Summary) {
    let rejected: Vec<String> = s
        .rejected_by_status
        .iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect();
    let in_stream: Vec<String> = s
        .failed_in_stream
        .iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect();
    let errors: Vec<String> = s
        .errors_by_kind
        .iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect();
    eprintln!(
        "pd-sim load: sent {} in {:.2}s ({:.0} req/s, target {:.0}); ok {}; rejected {{{}}}; failed in stream {{{}}}; errors {} {{{}}}; over-capacity sent {}; streamed {}; latency p50 {:.2} ms p99 {:.2} ms max {:.2} ms",
        s.sent,
        s.duration_s,
        s.achieved_rate,
        s.target_rate,
        s.ok,
        rejected.join(", "),
        in_stream.join(", "),
        s.errors,
        errors.join(", "),
        s.over_capacity_sent,
        s.streamed,
        s.latency_ms_p50,
        s.latency_ms_p99,
        s.latency_ms_max
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_and_reject_nonsense() {
        let r: Range = "16..256".parse().unwrap();
        assert_eq!((r.min, r.max), (16, 256));
        let r: Range = "5..=5".parse().unwrap();
        assert_eq!((r.min, r.max), (5, 5));
        assert!("9..3".parse::<Range>().is_err());
        assert!("0..3".parse::<Range>().is_err());
        assert!("x".parse::<Range>().is_err());
    }

    #[test]
    fn prompts_have_the_requested_word_count_and_the_canary() {
        let mut rng = SmallRng::seed_from_u64(7);
        let p = prompt(&mut rng, 50, Some("CANARY123"));
        assert_eq!(crate::ids::count_tokens(&p), 50);
        assert!(p.contains("CANARY123"));
    }
}
