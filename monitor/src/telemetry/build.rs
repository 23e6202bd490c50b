//! What this binary was built from (`monitor/build.rs` records it): shown by `revenant --version`
//! and exported as the labels of `revenant_build_info`, so a fleet can be told apart by commit and
//! by the kernel programs it carries.

/// revenant's version (Cargo.toml).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The git commit the sources were at (`unknown` outside a checkout without
/// `REVENANT_GIT_COMMIT`).
pub const COMMIT: &str = env!("REVENANT_GIT_COMMIT");
/// That commit's date (RFC 3339).
pub const COMMIT_DATE: &str = env!("REVENANT_GIT_COMMIT_DATE");
/// When the binary was built (RFC 3339; `SOURCE_DATE_EPOCH` when the build set it).
pub const BUILD_DATE: &str = env!("REVENANT_BUILD_DATE");
/// `rustc --version` of the compiler that built it.
pub const RUSTC: &str = env!("REVENANT_RUSTC");
/// SHA-256 of the embedded eBPF object, hex; empty in a build without the `ebpf` feature.
pub const EBPF_SHA256: &str = env!("REVENANT_EBPF_SHA256");

/// Whether this build carries the kernel programs (the `ebpf` cargo feature).
pub const fn has_ebpf() -> bool {
    !EBPF_SHA256.is_empty()
}

/// The first 12 hex digits of the commit (all of `unknown`).
pub fn short_commit() -> &'static str {
    COMMIT.get(..12).unwrap_or(COMMIT)
}

/// The eBPF object's digest as a label value: the hex digest, or `none`.
pub fn ebpf_label() -> &'static str {
    if has_ebpf() { EBPF_SHA256 } else { "none" }
}

/// `revenant --version`: the version, then one line per fact.
pub fn long_version() -> String {
    let ebpf = if has_ebpf() {
        format!("sha256:{EBPF_SHA256}")
    } else {
        "none (built without the `ebpf` feature: no eBPF source)".to_owned()
    };
    format!(
        "{VERSION}\ncommit:      {COMMIT} ({COMMIT_DATE})\nbuilt:       {BUILD_DATE}\n\
         rustc:       {RUSTC}\nebpf object: {ebpf}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_long_version_names_every_fact() {
        let v = long_version();
        assert!(v.starts_with(VERSION), "{v}");
        for key in ["commit:", "built:", "rustc:", "ebpf object:"] {
            assert!(v.contains(key), "{key} missing in {v}");
        }
        assert!(!BUILD_DATE.is_empty() && RUSTC.starts_with("rustc"), "{v}");
        if !cfg!(feature = "ebpf") {
            assert!(
                !has_ebpf() && v.contains("built without the `ebpf` feature"),
                "{v}"
            );
        }
    }
}
