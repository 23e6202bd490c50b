//! The vLLM flavour (`--flavour vllm`): workers with vLLM 0.34's OpenAI API, its length rules
//! and error bodies, `kv_transfer_params`, and the NIXL connector's side channel; a router
//! shaped like vllm-router 0.1.17 (sequential, prefill first); their OTLP spans. Paths in
//! comments are inside the `vllm==0.34.0` wheel (`nixl/` is
//! `distributed/kv_transfer/kv_connector/v1/nixl/`).
//!
//! Names of one request whose `X-Request-Id` is X (`ids`):
//! - the response `id`: `cmpl-X` (chat: `chatcmpl-X`);
//! - the engine request (`gen_ai.request.id` of its `llm_request` span, the key of
//!   `/sim/requests`): `cmpl-X-i` for prompt i of a completions request, `chatcmpl-X` for chat;
//! - the internal id, which `kv_transfer_params.remote_request_id` carries: the engine id plus
//!   `-` and 8 random hex digits, or the engine id itself with
//!   `--disable-request-id-randomization` (`VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1`).
//!
//! Lifecycle of one PD request:
//! - prefill gets the client body with `max_tokens: 1` and `kv_transfer_params
//!   {do_remote_decode: true}`; it applies vLLM's length rules, computes the prompt, answers
//!   200 with the params `request_finished` builds (`remote_request_id` = its internal id,
//!   `remote_host:remote_port` = its side channel) and holds the KV for `--kv-lease-ms`.
//! - decode gets the client body plus those params. The first time it sees a
//!   `remote_engine_id` it connects a ZMQ REQ to `remote_host:remote_port` and asks for the
//!   engine's NIXL agent metadata (`nixl`); no request id ever crosses that socket. It then
//!   reads the blocks (UCX one-sided reads: shared memory on one host, played here as a delay)
//!   and notifies prefill `"<remote_request_id>:1"` (a UCX active message; here a Unix datagram,
//!   never an inet socket), which frees the blocks. A notification for an id prefill does not
//!   hold is counted (`vllm:nixl_num_notifications_after_expiry`); a hold nobody read expires
//!   with its lease (`vllm:nixl_num_kv_expired_reqs`).
//!
//! `worker` has the state and HTTP handlers, `api` the bodies, `metrics` the `/metrics` page,
//! `nixl` the side channel, `ids` the names, `router` the router.

pub mod api;
pub mod ids;
pub mod metrics;
pub mod mooncake;
pub mod nixl;
pub mod router;
pub mod worker;

use std::path::PathBuf;

/// Which KV connector the workers run (`kv_transfer_config.kv_connector`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum KvConnector {
    /// NixlConnector: decode reads (`nixl`).
    #[default]
    Nixl,
    /// MooncakeConnector: decode asks, prefill writes (`mooncake`).
    Mooncake,
}

impl KvConnector {
    pub fn as_str(self) -> &'static str {
        match self {
            KvConnector::Nixl => "nixl",
            KvConnector::Mooncake => "mooncake",
        }
    }
}

/// The vLLM flavour's own worker flags (ignored by the SGLang flavour).
#[derive(clap::Args, Clone, Debug)]
pub struct VllmArgs {
    /// vLLM: the KV connector. `nixl`: the NIXL side channel and notifications. `mooncake`:
    /// prefill hosts the Mooncake bootstrap server on `--disaggregation-bootstrap-port` (8998,
    /// `VLLM_MOONCAKE_BOOTSTRAP_PORT`) and a ZMQ ROUTER on `--side-channel-port` that decode's
    /// per-request pulls reach; the router must send `transfer_id`s (`--kv-connector
    /// mooncake` on the router).
    #[arg(long, value_enum, default_value_t = KvConnector::Nixl)]
    pub kv_connector: KvConnector,
    /// vLLM, mooncake: how long prefill waits for the request a pull names to be ready, and
    /// how long it remembers an expired transfer (`VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`, s).
    #[arg(
        long,
        env = "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT",
        default_value_t = 480
    )]
    pub mooncake_abort_request_timeout_secs: u64,
    /// vLLM: the model's context length L. A prompt longer than L is refused (400), so is a
    /// max_tokens above L; a max_tokens that does not fit next to the prompt is clamped.
    #[arg(long, default_value_t = 8192)]
    pub max_model_len: u64,
    /// vLLM: KV cache blocks (capacity = blocks × block size tokens). Default: enough for
    /// one request of max_model_len.
    #[arg(long)]
    pub num_gpu_blocks: Option<u64>,
    /// vLLM: tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: u64,
    /// vLLM: the NIXL side channel's ZMQ ROUTER port (`VLLM_NIXL_SIDE_CHANNEL_PORT`), or with
    /// mooncake prefill's sender ROUTER (decode binds none); 0 = ephemeral. Default 5600
    /// (prefill) / 5601 (decode).
    #[arg(long)]
    pub side_channel_port: Option<u16>,
    /// vLLM: error bodies and length rule: `current` (≥ 0.10.1) or `legacy` (the flat
    /// `{"object":"error",…}` and the prompt + max_tokens > max_model_len refusal).
    #[arg(long, value_enum, default_value_t = api::ErrorShape::Current)]
    pub error_shape: api::ErrorShape,
    /// vLLM: internal request ids are the engine ids unchanged (no `-<8 hex>` suffix).
    #[arg(long, env = "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", value_parser = parse_env_bool, num_args = 0..=1, default_missing_value = "1", default_value = "0")]
    pub disable_request_id_randomization: bool,
    /// vLLM: how long prefill keeps blocks no decode has read (`kv_lease_duration`, 30 s;
    /// mooncake: its lease, renewed by heartbeats).
    #[arg(long, default_value_t = 30_000)]
    pub kv_lease_ms: u64,
    /// vLLM: the simulated KV move of a request's blocks (NIXL: decode's UCX read; mooncake:
    /// prefill's transfer engine write, before it answers the pull), µs.
    #[arg(long, default_value_t = 200)]
    pub kv_read_delay_us: u64,
    /// vLLM: where prefill's notification endpoints live (`<dir>/<engine id>.sock`: decode's
    /// "<id>:<n>" notifications, UCX active messages on a real host). Default: the temp dir.
    #[arg(long)]
    pub nixl_notify_dir: Option<PathBuf>,
}

/// vLLM reads its boolean environment variables as `bool(int(value))`.
fn parse_env_bool(s: &str) -> Result<bool, String> {
    match s.trim() {
        "" | "0" | "false" | "False" => Ok(false),
        "1" | "true" | "True" => Ok(true),
        other => Err(format!("{other:?} is not 0 or 1")),
    }
}

impl VllmArgs {
    pub fn num_gpu_blocks(&self) -> u64 {
        self.num_gpu_blocks
            .unwrap_or_else(|| self.max_model_len.div_ceil(self.block_size.max(1)))
    }

    pub fn notify_dir(&self) -> PathBuf {
        self.nixl_notify_dir
            .clone()
            .unwrap_or_else(|| std::env::temp_dir().join("pd-sim-nixl"))
    }
}
