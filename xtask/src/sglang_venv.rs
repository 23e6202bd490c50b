//! target/sglang-venv: SGLang 0.5.23 for the SGLang truth source (`tests/sglang-harness`), whose
//! workers run SGLang's own HTTP server, tokenizer manager, detokenizer, bootstrap server,
//! Mooncake KV managers and tracing module on the CPU.
//!
//! The wheel is installed without its dependencies (they pull CUDA kernels, flashinfer, ...),
//! then exactly what the modules the harness runs import, at the versions the harness was
//! verified with (SGLang's own pins where its metadata has one: transformers, tokenizers,
//! openai, xgrammar, sentencepiece, soundfile, compressed-tensors, apache-tvm-ffi, torch).
//! Mooncake's TCP transport needs Debian's `libibverbs1` (its module links it even without
//! RDMA); `cargo xtask setup` installs it.
//!
//! Measured on the 2-core CI box: about 200 s and 6.2 GB, nearly all of it torch 2.14.1 and the
//! NVIDIA libraries it depends on (PyPI has no CPU-only torch for Linux x86_64). The readiness
//! check reads installed versions only (`importlib.metadata`), well under a second.

use std::path::PathBuf;

/// `pip install --no-deps` first.
const SGLANG: &str = "sglang==0.5.23";

/// Then these, with their own dependencies.
const PACKAGES: &[&str] = &[
    "torch==2.14.1",
    "torchvision==0.29.2",
    "mooncake-transfer-engine-non-cuda==0.3.13.post1",
    "pyzmq==27.3.0",
    "msgspec==0.23.0",
    "aiohttp==3.14.5",
    "requests==2.34.2",
    "numpy==2.4.6",
    "orjson==3.13.0",
    "psutil==7.2.2",
    "pybase64==1.5.1",
    "packaging==26.4",
    "pillow==13.0.0",
    "pydantic==2.14.4",
    "prometheus-client==0.26.0",
    "tqdm==4.70.1",
    "IPython==9.19.1",
    "transformers==5.19.0",
    "tokenizers==0.23.2",
    "dill==0.4.1",
    "apache-tvm-ffi==0.1.11",
    "sentencepiece==0.2.1",
    "compressed-tensors==0.18.0",
    "gguf==0.19.0",
    "fastapi==0.165.0",
    "uvicorn==0.55.0",
    "uvloop==0.23.0",
    "openai==2.8.0",
    "partial_json_parser==0.2.1.1.post7",
    "setproctitle==1.3.8",
    "einops==0.8.2",
    "jsonschema==4.26.0",
    "xgrammar==0.2.7",
    "soundfile==0.13.1",
    "python-multipart==0.0.34",
    // srt/observability/trace.py imports both exporters (gRPC and HTTP) or traces nothing.
    "opentelemetry-sdk==1.45.2",
    "opentelemetry-exporter-otlp-proto-grpc==1.45.2",
    "opentelemetry-exporter-otlp-proto-http==1.45.2",
];

/// The venv's interpreter, the venv created (or completed) first when a pinned version is
/// missing.
pub fn python() -> anyhow::Result<PathBuf> {
    let pins: Vec<String> = std::iter::once(SGLANG)
        .chain(PACKAGES.iter().copied())
        .map(|p| {
            let (dist, version) = p.split_once("==").expect("pinned");
            format!("({dist:?}, {version:?})")
        })
        .collect();
    let ready = format!(
        "import importlib.metadata as m, sys; \
         sys.exit(any(m.version(d) != v for d, v in [{}]))",
        pins.join(", ")
    );
    let started = std::time::Instant::now();
    let venv =
        crate::venv::ensure_steps("sglang-venv", &[&["--no-deps", SGLANG], PACKAGES], &ready)?;
    if started.elapsed().as_secs() > 10 {
        eprintln!(
            "xtask: {} ready after {:.0} s",
            venv.display(),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(venv.join("bin/python"))
}
