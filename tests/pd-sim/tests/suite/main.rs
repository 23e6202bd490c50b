//! pd-sim's light tests, one module per test file, built as one executable (compiled and linked
//! once instead of once per file). `modes` and `smg_1_13`, which push load or judge timing, stay
//! executables of their own, so that a plain `cargo test` never runs them beside another.
//!
//! One module: `cargo test --release -p pd-sim --test suite -- vllm_modes::` (no module's name
//! ends another's); `cargo xtask test` runs one module per job (`--exact` with its test names,
//! labelled `pd-sim/<module>`).

#[path = "../support/mod.rs"]
mod support;

mod cluster_signals;
mod e2e_capacity;
mod e2e_real_router;
mod sglang_interop;
mod sglang_router;
mod vllm_faults;
mod vllm_interop;
mod vllm_modes;
mod vllm_mooncake;
mod vllm_real_router;
mod zmq_interop;
