//! `/metrics` as a vLLM 0.34 server renders it: prometheus_client's text format (HELP and TYPE
//! of a counter named `…_total`, a `_created` series per counter and histogram), the
//! families `v1/metrics/loggers.py` registers (labels `model_name`, `engine`), histograms with
//! vLLM's buckets, `vllm:cache_config_info` with every `CacheConfig` field as a label
//! (`loggers.py:1114-1136`, `config/cache.py` `metrics_info`: `str()` of each field in
//! declaration order, then `engine`), and the NIXL connector's counters (`nixl/stats.py`).
//! The page is tens of KB, like the real one, so whoever looks for one line reads a big body.

use std::fmt::Write as _;

/// What a worker reports on `/metrics`.
pub struct MetricsView<'a> {
    pub model: &'a str,
    pub max_model_len: u64,
    pub block_size: u64,
    pub num_gpu_blocks: u64,
    pub running: u64,
    pub waiting: u64,
    pub kv_usage: f64,
    pub prompt_tokens: u64,
    /// Prompt tokens by where their KV came from (`loggers.py:757-769`).
    pub prompt_local_compute: u64,
    pub prompt_external_kv: u64,
    pub generation_tokens: u64,
    pub success: u64,
    pub started_s: f64,
    pub nixl: NixlCounters,
}

#[derive(Clone, Copy, Default)]
pub struct NixlCounters {
    pub failed_transfers: u64,
    pub failed_notifications: u64,
    pub kv_expired_reqs: u64,
    pub notifications_after_expiry: u64,
    pub transfers: u64,
    pub bytes: u64,
}

/// `CacheConfig().metrics_info()` of vLLM 0.34 after an engine start, keys in declaration
/// order; `{bs}`, `{blocks}`, `{tokens}`, `{conc}` are filled in. The interop test checks the
/// keys against `vllm.config.cache.CacheConfig`.
pub const CACHE_CONFIG_KEYS: [&str; 39] = [
    "block_size",
    "user_specified_block_size",
    "kv_cache_layout",
    "prefix_match_unit",
    "gpu_memory_utilization",
    "cache_dtype",
    "is_attention_free",
    "num_gpu_blocks_override",
    "sliding_window",
    "enable_prefix_caching",
    "prefix_caching_hash_algo",
    "prefix_cache_retention_interval",
    "kv_cache_dtype_skip_layers",
    "mamba_page_size_padded",
    "skip_page_size_padded",
    "mamba_block_size",
    "mamba_cache_dtype",
    "mamba_ssm_cache_dtype",
    "mamba_cache_mode",
    "enable_mamba_shared_prefix_checkpoint",
    "replayssm_buffer_len",
    "use_replayssm",
    "use_kda_recoverssm",
    "num_gpu_blocks",
    "num_cpu_blocks",
    "simple_cpu_offload_num_blocks",
    "effective_attention_block_size",
    "kv_cache_size_tokens",
    "kv_cache_max_concurrency",
    "hash_block_size",
    "cache_hit_alignment_tokens",
    "kv_sharing_fast_prefill",
    "swa_bounded_replay",
    "kv_cache_memory_bytes",
    "enable_extensible_kv_cache",
    "kv_offloading_size",
    "kv_offloading_backend",
    "_block_size_resolved",
    "_extensible_kv_cache_resolved",
];

fn cache_config_value(key: &str, m: &MetricsView<'_>) -> String {
    let tokens = m.num_gpu_blocks * m.block_size;
    match key {
        "block_size" | "effective_attention_block_size" | "hash_block_size" => {
            m.block_size.to_string()
        }
        "num_gpu_blocks" => m.num_gpu_blocks.to_string(),
        "num_cpu_blocks" => "0".into(),
        "kv_cache_size_tokens" => tokens.to_string(),
        "kv_cache_max_concurrency" => {
            format!("{:?}", tokens as f64 / m.max_model_len.max(1) as f64)
        }
        "gpu_memory_utilization" => "0.9".into(),
        "cache_dtype" | "mamba_cache_dtype" | "mamba_ssm_cache_dtype" => "auto".into(),
        "enable_prefix_caching" | "swa_bounded_replay" | "_block_size_resolved" => "True".into(),
        "prefix_caching_hash_algo" => "sha256".into(),
        "prefix_cache_retention_interval" => "0".into(),
        "kv_cache_dtype_skip_layers" => "[]".into(),
        "mamba_cache_mode" => "none".into(),
        "replayssm_buffer_len" => "16".into(),
        "kv_offloading_backend" => "native".into(),
        "user_specified_block_size"
        | "is_attention_free"
        | "enable_mamba_shared_prefix_checkpoint"
        | "use_replayssm"
        | "use_kda_recoverssm"
        | "kv_sharing_fast_prefill"
        | "_extensible_kv_cache_resolved" => "False".into(),
        _ => "None".into(),
    }
}

/// `build_1_2_5_buckets(max_model_len)` (`v1/metrics/loggers.py`): 1, 2, 5, 10, 20, 50, … up
/// to the limit.
fn buckets_1_2_5(max: u64) -> Vec<f64> {
    let mut out = Vec::new();
    let mut exp = 1u64;
    'outer: loop {
        for m in [1, 2, 5] {
            let v = m * exp;
            if v > max {
                break 'outer;
            }
            out.push(v as f64);
        }
        exp *= 10;
    }
    out
}

const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: [f64; 18] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0,
];
const LATENCY_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// Python's `repr(float)` for the values a page holds (`1.0`, `0.25`, `1e-05`-free here).
fn pyf(v: f64) -> String {
    format!("{v:?}")
}

struct Page<'a> {
    s: String,
    labels: String,
    started: &'a str,
}

impl Page<'_> {
    fn head(&mut self, name: &str, help: &str, kind: &str) {
        let _ = write!(self.s, "# HELP {name} {help}\n# TYPE {name} {kind}\n");
    }

    fn gauge(&mut self, name: &str, help: &str, v: f64) {
        self.head(name, help, "gauge");
        let _ = writeln!(self.s, "{name}{{{}}} {}", self.labels, pyf(v));
    }

    /// A counter `name`: `name_total` and `name_created`, one series per `extra` label set.
    fn counter(&mut self, name: &str, help: &str, series: &[(&str, u64)]) {
        self.head(&format!("{name}_total"), help, "counter");
        for (extra, v) in series {
            let _ = writeln!(
                self.s,
                "{name}_total{{{}{extra}}} {}",
                self.labels,
                pyf(*v as f64)
            );
        }
        for (extra, _) in series {
            let _ = writeln!(
                self.s,
                "{name}_created{{{}{extra}}} {}",
                self.labels, self.started
            );
        }
    }

    /// A histogram with `count` observations of about `typical` each.
    fn histogram(&mut self, name: &str, help: &str, buckets: &[f64], count: u64, typical: f64) {
        self.head(name, help, "histogram");
        let sum = count as f64 * typical;
        let _ = writeln!(self.s, "{name}_sum{{{}}} {}", self.labels, pyf(sum));
        for b in buckets {
            let n = if *b >= typical { count } else { 0 };
            let _ = writeln!(
                self.s,
                "{name}_bucket{{{},le=\"{}\"}} {}",
                self.labels,
                pyf(*b),
                pyf(n as f64)
            );
        }
        let _ = writeln!(
            self.s,
            "{name}_bucket{{{},le=\"+Inf\"}} {}",
            self.labels,
            pyf(count as f64)
        );
        let _ = writeln!(
            self.s,
            "{name}_count{{{}}} {}",
            self.labels,
            pyf(count as f64)
        );
        self.head(&format!("{name}_created"), help, "gauge");
        let _ = writeln!(self.s, "{name}_created{{{}}} {}", self.labels, self.started);
    }
}

/// The whole page: the Python process collectors first, then vLLM's families in the order the
/// logger registers them, `vllm:cache_config_info` (registered last, at start), then NIXL's.
pub fn render(m: &MetricsView<'_>) -> String {
    let started = format!("{:.9e}", m.started_s)
        .replace("e9", "e+09")
        .to_string();
    let mut p = Page {
        s: String::with_capacity(48 * 1024),
        labels: format!("model_name=\"{}\",engine=\"0\"", m.model),
        started: &started,
    };
    // prometheus_client's default collectors.
    p.s.push_str("# HELP python_gc_objects_collected_total Objects collected during gc\n# TYPE python_gc_objects_collected_total counter\n");
    for (g, v) in [(0, 12_873.0), (1, 4_021.0), (2, 1_337.0)] {
        let _ = writeln!(
            p.s,
            "python_gc_objects_collected_total{{generation=\"{g}\"}} {v:?}"
        );
    }
    p.s.push_str("# HELP python_gc_objects_uncollectable_total Uncollectable objects found during GC\n# TYPE python_gc_objects_uncollectable_total counter\n");
    for g in 0..3 {
        let _ = writeln!(
            p.s,
            "python_gc_objects_uncollectable_total{{generation=\"{g}\"}} 0.0"
        );
    }
    p.s.push_str("# HELP python_gc_collections_total Number of times this generation was collected\n# TYPE python_gc_collections_total counter\n");
    for (g, v) in [(0, 3_112.0), (1, 282.0), (2, 17.0)] {
        let _ = writeln!(
            p.s,
            "python_gc_collections_total{{generation=\"{g}\"}} {v:?}"
        );
    }
    p.s.push_str("# HELP python_info Python platform information\n# TYPE python_info gauge\npython_info{implementation=\"CPython\",major=\"3\",minor=\"12\",patchlevel=\"11\",version=\"3.12.11\"} 1.0\n");
    for (name, help, v) in [
        (
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
            "6.1341736960e+010",
        ),
        (
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            "2.148270080e+09",
        ),
        (
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            started.as_str(),
        ),
        (
            "process_cpu_seconds_total",
            "Total user and system CPU time spent in seconds.",
            "184.21",
        ),
        (
            "process_open_fds",
            "Number of open file descriptors.",
            "94.0",
        ),
        (
            "process_max_fds",
            "Maximum number of open file descriptors.",
            "1.048576e+06",
        ),
    ] {
        let kind = if name.ends_with("_total") {
            "counter"
        } else {
            "gauge"
        };
        let _ = write!(
            p.s,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
        );
    }
    p.gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        m.running as f64,
    );
    p.gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        m.waiting as f64,
    );
    p.gauge(
        "vllm:engine_sleep_state",
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
        1.0,
    );
    p.gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        m.kv_usage,
    );
    let reqs = m.success;
    p.counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        &[("", m.prompt_tokens)],
    );
    p.counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        &[("", 0)],
    );
    p.counter(
        "vllm:external_prefix_cache_queries",
        "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.",
        &[("", m.prompt_external_kv)],
    );
    p.counter(
        "vllm:external_prefix_cache_hits",
        "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.",
        &[("", m.prompt_external_kv)],
    );
    p.counter(
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        &[("", 0)],
    );
    p.counter(
        "vllm:prompt_tokens",
        "Number of prefill tokens processed.",
        &[("", m.prompt_tokens)],
    );
    p.counter(
        "vllm:prompt_tokens_by_source",
        "Number of prompt tokens by source.",
        &[
            (",source=\"local_compute\"", m.prompt_local_compute),
            (",source=\"local_cache_hit\"", 0),
            (",source=\"external_kv_transfer\"", m.prompt_external_kv),
        ],
    );
    p.counter(
        "vllm:prompt_tokens_cached",
        "Number of cached prompt tokens (local + external).",
        &[("", m.prompt_external_kv)],
    );
    p.counter(
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        &[("", m.generation_tokens)],
    );
    p.counter(
        "vllm:request_success",
        "Count of successfully processed requests.",
        &[
            (",finished_reason=\"stop\"", 0),
            (",finished_reason=\"length\"", reqs),
            (",finished_reason=\"abort\"", 0),
            (",finished_reason=\"error\"", 0),
            (",finished_reason=\"repetition\"", 0),
        ],
    );
    let tok = buckets_1_2_5(m.max_model_len);
    let avg_prompt = m.prompt_tokens.checked_div(reqs).unwrap_or(0) as f64;
    let avg_gen = m.generation_tokens.checked_div(reqs).unwrap_or(0) as f64;
    p.histogram(
        "vllm:request_prompt_tokens",
        "Number of prefill tokens processed.",
        &tok,
        reqs,
        avg_prompt,
    );
    p.histogram(
        "vllm:request_generation_tokens",
        "Number of generation tokens processed.",
        &tok,
        reqs,
        avg_gen,
    );
    let iter = [
        1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
    ];
    p.histogram(
        "vllm:iteration_tokens_total",
        "Histogram of number of tokens per engine_step.",
        &iter,
        m.generation_tokens,
        1.0,
    );
    p.histogram(
        "vllm:request_max_num_generation_tokens",
        "Histogram of maximum number of requested generation tokens.",
        &tok,
        reqs,
        avg_gen,
    );
    p.histogram(
        "vllm:request_params_n",
        "Histogram of the n request parameter.",
        &[1.0, 2.0, 5.0, 10.0, 20.0],
        reqs,
        1.0,
    );
    p.histogram(
        "vllm:request_params_max_tokens",
        "Histogram of the max_tokens request parameter.",
        &tok,
        reqs,
        avg_gen,
    );
    for (name, help, buckets, typical) in [
        (
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &TTFT_BUCKETS[..],
            0.02,
        ),
        (
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &ITL_BUCKETS[..],
            0.01,
        ),
        (
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            &ITL_BUCKETS[..],
            0.01,
        ),
        (
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &LATENCY_BUCKETS[..],
            0.3,
        ),
        (
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            &LATENCY_BUCKETS[..],
            0.3,
        ),
        (
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            &LATENCY_BUCKETS[..],
            0.3,
        ),
        (
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            &LATENCY_BUCKETS[..],
            0.3,
        ),
        (
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            &LATENCY_BUCKETS[..],
            0.3,
        ),
    ] {
        p.histogram(name, help, buckets, reqs, typical);
    }
    p.histogram(
        "vllm:request_prefill_kv_computed_tokens",
        "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
        &tok,
        reqs,
        avg_prompt,
    );
    // `log_metrics_info("cache_config", …)`: an info gauge, every CacheConfig field a label.
    p.head(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        "gauge",
    );
    let labels: Vec<String> = CACHE_CONFIG_KEYS
        .iter()
        .map(|k| format!("{k}=\"{}\"", cache_config_value(k, m)))
        .chain(std::iter::once("engine=\"0\"".to_string()))
        .collect();
    let _ = writeln!(p.s, "vllm:cache_config_info{{{}}} 1.0", labels.join(","));
    // The NIXL connector's stats logger (`nixl/stats.py`).
    let n = m.nixl;
    p.histogram(
        "vllm:nixl_xfer_time_seconds",
        "Histogram of transfer duration for NIXL KV Cache transfers.",
        &[
            0.001, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0,
        ],
        n.transfers,
        0.001,
    );
    p.histogram(
        "vllm:nixl_bytes_transferred",
        "Histogram of bytes transferred per NIXL KV Cache transfers.",
        &[
            1048576.0,
            4194304.0,
            16777216.0,
            67108864.0,
            268435456.0,
            1073741824.0,
        ],
        n.transfers,
        n.bytes.checked_div(n.transfers).unwrap_or(0) as f64,
    );
    p.counter(
        "vllm:nixl_num_failed_transfers",
        "Number of failed NIXL KV Cache transfers, including handshake and notification failures. NOTE: KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs.",
        &[("", n.failed_transfers)],
    );
    p.counter(
        "vllm:nixl_num_failed_notifications",
        "Number of failed NIXL KV Cache notifications. Retained for compatibility; these failures are also included in vllm:nixl_num_failed_transfers.",
        &[("", n.failed_notifications)],
    );
    p.counter(
        "vllm:nixl_num_kv_expired_reqs",
        "Number of requests that had their KV expire. NOTE: This metric is tracked on the P instance.",
        &[("", n.kv_expired_reqs)],
    );
    p.counter(
        "vllm:nixl_num_notifications_after_expiry",
        "Number of completion notifications for requests that were no longer tracked, usually because their KV lease expired. The KV blocks may have been reused before the transfer finished. Counted per notification (one per remote rank), not per request.",
        &[("", n.notifications_after_expiry)],
    );
    p.s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_is_big_and_holds_one_cache_config_line() {
        let page = render(&MetricsView {
            model: "m",
            max_model_len: 4096,
            block_size: 16,
            num_gpu_blocks: 256,
            running: 0,
            waiting: 0,
            kv_usage: 0.0,
            prompt_tokens: 30,
            prompt_local_compute: 30,
            prompt_external_kv: 0,
            generation_tokens: 3,
            success: 3,
            started_s: 1_765_000_000.25,
            nixl: NixlCounters::default(),
        });
        assert!(page.len() > 20_000, "{}", page.len());
        let info: Vec<&str> = page
            .lines()
            .filter(|l| l.starts_with("vllm:cache_config_info{"))
            .collect();
        assert_eq!(info.len(), 1);
        assert!(
            info[0].starts_with(
                "vllm:cache_config_info{block_size=\"16\",user_specified_block_size=\"False\","
            ),
            "{}",
            info[0]
        );
        assert!(info[0].contains(",num_gpu_blocks=\"256\","));
        assert!(
            info[0].contains(",kv_cache_size_tokens=\"4096\",kv_cache_max_concurrency=\"1.0\",")
        );
        assert!(info[0].ends_with(",engine=\"0\"} 1.0"));
        assert!(page.contains(
            "vllm:nixl_num_notifications_after_expiry_total{model_name=\"m\",engine=\"0\"} 0.0\n"
        ));
        assert!(page.contains("vllm:num_requests_running{model_name=\"m\",engine=\"0\"} 0.0\n"));
        assert_eq!(buckets_1_2_5(60), [1.0, 2.0, 5.0, 10.0, 20.0, 50.0]);
    }
}
