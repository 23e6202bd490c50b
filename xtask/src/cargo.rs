//! Cargo as xtask calls it: in the environment a shell would give it.
//!
//! `cargo xtask` runs under `cargo run`, which sets `CARGO_PKG_*`, `CARGO_MANIFEST_*` and friends
//! for xtask itself. A cargo started with those inherited sees them as changed environment for
//! every build script that watches them (ring's watches `CARGO_PKG_NAME` and the version
//! variables), and rebuilds those crates and everything above them: a run from a shell and one
//! from xtask would take turns rebuilding half the tree. So they are removed.

use std::process::Command;

/// `$CARGO` (the cargo that runs xtask), else `cargo`, with a clean environment.
pub fn command() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    scrub(&mut cmd);
    cmd.current_dir(test_harness::workspace_root());
    cmd
}

/// Removes what `cargo run` set for xtask from `cmd`'s environment.
pub fn scrub(cmd: &mut Command) {
    for (key, _) in std::env::vars_os() {
        let Some(key) = key.to_str() else { continue };
        if matches!(
            key,
            "CARGO_CRATE_NAME" | "CARGO_BIN_NAME" | "CARGO_PRIMARY_PACKAGE"
        ) || key.starts_with("CARGO_PKG_")
            || key.starts_with("CARGO_MANIFEST_")
        {
            cmd.env_remove(key);
        }
    }
}

/// The executable cargo's JSON messages (`--message-format json…`) name for the target `name`
/// (a bench's or a test's path carries a hash).
pub fn executable_of(messages: &[u8], name: &str) -> Option<std::path::PathBuf> {
    messages
        .split(|b| *b == b'\n')
        .filter_map(|l| serde_json::from_slice::<serde_json::Value>(l).ok())
        .filter(|v| v["reason"] == "compiler-artifact" && v["target"]["name"] == name)
        .find_map(|v| v["executable"].as_str().map(std::path::PathBuf::from))
}
