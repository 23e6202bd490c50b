//! PD (prefill/decode) disaggregated serving simulator. See README.md for the wire formats.

pub mod cluster;
pub mod fault;
pub mod http;
pub mod ids;
pub mod kvlink;
pub mod load;
pub mod msgpack;
pub mod router;
pub mod serve;
pub mod smg;
pub mod spans;
pub mod te;
pub mod trace_ctx;
pub mod vllm;
pub mod worker;
pub mod zmtp;

/// Whose wire formats a process speaks: SGLang's (bootstrap server, `/generate`, rooms) or
/// vLLM's (OpenAI API, `kv_transfer_params`, NIXL's side channel). See README.md.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Flavour {
    #[default]
    Sglang,
    Vllm,
}
