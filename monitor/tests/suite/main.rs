//! The light integration tests of `revenant`, one module per test file, built as one
//! executable: as crates of their own, each compiled `support/` again and linked the whole
//! dependency graph again (164 CPU s for these sixteen files, 90 s as one). The tests that load
//! the machine or judge timing (eBPF, the property runs, the cluster's leases and equivalence)
//! stay executables of their own, so that a plain `cargo test` never runs two of them at once.
//!
//! One module: `cargo test --release -p revenant --test suite -- run_cli::` (a filter matches
//! anywhere in a test's path, so no module's name ends another's: `cargo xtask test` checks it).
//! `cargo xtask test` runs one module per job, `--exact` with the module's test names.

#[path = "../support/mod.rs"]
mod support;
mod traffic;

mod access_e2e;
mod agent_otlp;
mod alert_delivery;
mod alertmanager_e2e;
mod binary;
mod cluster_faults;
mod docs_examples;
mod engine_shards;
mod first_use;
mod layering;
mod metrics_exposition;
mod otlp_e2e;
mod otlp_props;
mod pages_browser;
mod prometheus_e2e;
mod run_cli;
mod scenarios;
