//! The vLLM flavour (`--flavour vllm`): workers with vLLM's OpenAI API, its context-length
//! check and error bodies, `kv_transfer_params` and a NIXL-style side channel; a router
//! shaped like vllm-router 0.1.17 (sequential, prefill first); their OTLP spans.
//!
//! Lifecycle of one PD request X (the router's `X-Request-Id`), named N = `cmpl-X` by the
//! workers:
//! - prefill gets the client body with `max_tokens: 1` and `kv_transfer_params
//!   {do_remote_decode: true}`; it checks P + max_tokens ≤ `--max-model-len`, computes the
//!   prompt, answers 200 with `kv_transfer_params {do_remote_prefill: true, remote_host,
//!   remote_port (its side channel), remote_request_id: N, …}` and holds N's KV.
//! - decode gets the client body plus those params, sends `NIXL_READ N` to
//!   `remote_host:remote_port`, receives `NIXL_KV` chunks and `NIXL_DONE N`, then generates.
//!   Without params it computes the prompt itself. A client gone before the KV came →
//!   `NIXL_ABORT N`.
//!
//! `worker` has the flags, state and HTTP handlers, `api` the bodies (in and out), `side` the
//! side channel, `router` the router.

pub mod api;
pub mod router;
pub mod side;
pub mod worker;

/// The vLLM flavour's own worker flags (ignored by the SGLang flavour).
#[derive(clap::Args, Clone, Debug)]
pub struct VllmArgs {
    /// vLLM: the model's context length L; a request with P prompt tokens and max_tokens C
    /// is rejected (400) when P + C > L.
    #[arg(long, default_value_t = 8192)]
    pub max_model_len: u64,
    /// vLLM: KV cache blocks (capacity = blocks × block size tokens). Default: enough for
    /// one request of max_model_len.
    #[arg(long)]
    pub num_gpu_blocks: Option<u64>,
    /// vLLM: tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: u64,
    /// vLLM: the side channel's ZMTP port (NIXL_READ in on prefill, NIXL_KV in on decode);
    /// 0 = ephemeral. Default 5600 (prefill) / 5601 (decode).
    #[arg(long)]
    pub side_channel_port: Option<u16>,
}

impl VllmArgs {
    pub fn num_gpu_blocks(&self) -> u64 {
        self.num_gpu_blocks
            .unwrap_or_else(|| self.max_model_len.div_ceil(self.block_size.max(1)))
    }
}
