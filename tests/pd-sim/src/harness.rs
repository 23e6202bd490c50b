//! The real sglang-router (`smg`) in front of a simulated cluster, for tests and benches; the
//! simulator's and revenant's own processes come from `test-harness`.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};
use test_harness::{Cluster, Proc, free_port, wait_healthy};

/// The smallest model directory the real `smg` accepts for `--model-path`: a HuggingFace
/// `tokenizer.json` with a WordLevel model and a whitespace pre-tokenizer (one token per word,
/// like the simulator's own count), plus `config.json` / `tokenizer_config.json`.
pub fn write_tiny_model(dir: &Path) -> Result<()> {
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 0, "content": "[UNK]", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "word": 1}, "unk_token": "[UNK]"}
    });
    let io = |e: std::io::Error| anyhow::anyhow!("model dir {}: {e}", dir.display());
    std::fs::create_dir_all(dir).map_err(io)?;
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).map_err(io)?;
    std::fs::write(
        dir.join("config.json"),
        r#"{"model_type":"llama","architectures":["LlamaForCausalLM"]}"#,
    )
    .map_err(io)?;
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"unk_token":"[UNK]"}"#,
    )
    .map_err(io)?;
    Ok(())
}

/// The real sglang-router (`smg launch --pd-disaggregation`) in front of a simulator's prefill
/// and decode; dropping it stops it. Its output goes to `log`.
pub struct SmgProcess {
    pub proc: Proc,
    pub url: String,
}

impl SmgProcess {
    /// `trace` is the OTLP/gRPC `host:port` for `--enable-trace --otlp-traces-endpoint`.
    pub fn start(
        smg: &Path,
        cluster: &Cluster,
        model_dir: &Path,
        trace: Option<&str>,
        log: &Path,
        extra: &[&str],
    ) -> Result<SmgProcess> {
        let port = free_port()?;
        let bootstrap = cluster.ready["bootstrap_port"].to_string();
        let out = std::fs::File::create(log).with_context(|| log.display().to_string())?;
        let err = out.try_clone()?;
        let mut cmd = Command::new(smg);
        cmd.args(["launch", "--host", "127.0.0.1", "--port", &port.to_string()])
            .args([
                "--pd-disaggregation",
                "--prefill",
                &cluster.prefill,
                &bootstrap,
            ])
            .args(["--decode", &cluster.decode])
            .args(["--prometheus-port", &free_port()?.to_string()])
            .arg("--model-path")
            .arg(model_dir);
        if let Some(t) = trace {
            cmd.args(["--enable-trace", "--otlp-traces-endpoint", t]);
        }
        cmd.args(extra).stdin(Stdio::null()).stdout(out).stderr(err);
        let mut proc = Proc::spawn("smg", &mut cmd)?;
        proc.grace = Duration::from_secs(5);
        let s = SmgProcess {
            proc,
            url: format!("http://127.0.0.1:{port}"),
        };
        wait_healthy(&s.url, Duration::from_secs(60))?;
        Ok(s)
    }
}
