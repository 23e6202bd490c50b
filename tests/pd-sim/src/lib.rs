//! PD (prefill/decode) disaggregated serving simulator. See README.md for the wire formats.

pub mod cluster;
pub mod common;
pub mod harness;
pub mod kvlink;
pub mod load;
pub mod router;
pub mod serve;
pub mod spans;
pub mod worker;
pub mod zmtp;
