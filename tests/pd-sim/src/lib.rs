//! PD (prefill/decode) disaggregated serving simulator. See README.md for the wire formats.

pub mod cluster;
pub mod http;
pub mod ids;
pub mod kvlink;
pub mod load;
pub mod router;
pub mod serve;
pub mod smg;
pub mod spans;
pub mod trace_ctx;
pub mod worker;
pub mod zmtp;
