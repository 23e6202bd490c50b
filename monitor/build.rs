//! Builds the kernel programs (`monitor-ebpf`) for the BPF target and leaves the object in
//! `OUT_DIR/monitor-ebpf`, where `ingest::ebpf::loader` embeds it.
//!
//! Needs what `cargo xtask setup` installs: the nightly toolchain with rust-src and `bpf-linker`.

use anyhow::{Context as _, anyhow};

fn main() -> anyhow::Result<()> {
    let cargo_metadata::Metadata { packages, .. } = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .context("cargo metadata")?;
    let pkg = packages
        .into_iter()
        .find(|p| p.name.as_str() == "monitor-ebpf")
        .ok_or_else(|| anyhow!("monitor-ebpf package not found in the workspace"))?;
    let root_dir = pkg
        .manifest_path
        .parent()
        .ok_or_else(|| anyhow!("no parent for {}", pkg.manifest_path))?;
    if which_bpf_linker().is_none() {
        return Err(anyhow!(
            "bpf-linker not found on PATH: run `cargo xtask setup` first (it installs LLVM 22, \
             bpf-linker and nightly rust-src)"
        ));
    }
    let ebpf = aya_build::Package {
        name: "monitor-ebpf",
        root_dir: root_dir.as_str(),
        ..Default::default()
    };
    aya_build::build_ebpf([ebpf], aya_build::Toolchain::default())
}

fn which_bpf_linker() -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("bpf-linker"))
        .find(|p| p.is_file())
}
