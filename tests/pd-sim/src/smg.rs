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

/// The real router (`smg launch --pd-disaggregation`) in front of a simulator's prefill and
/// decode; dropping it stops it. Its output goes to `log`. One launcher for both wheels that
/// install an `smg` binary: `sglang-router` 0.3.2 and its successor `smg` 1.13.0 take the same
/// flags for this (both bind the router and the metrics listener to 127.0.0.1 here: their
/// defaults are 0.0.0.0) and accept [`write_tiny_model`]'s directory.
///
/// smg 1.13.0 renames its process (`setproctitle`): its command line reads `smg::router`, so
/// an eBPF `--watch` rule on `smg launch …` finds only 0.3.2; pass [`SmgProcess::pid`] instead.
pub struct SmgProcess {
    pub proc: Proc,
    pub url: String,
    /// What `smg --version` printed: `sgl-model-gateway 0.3.2`, `smg 1.13.0`.
    pub version: String,
}

/// `smg --version`, e.g. `sgl-model-gateway 0.3.2` or `smg 1.13.0`.
pub fn smg_version(smg: &Path) -> Result<String> {
    let out = Command::new(smg)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("{} --version", smg.display()))?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || text.is_empty() {
        anyhow::bail!(
            "{} --version failed ({}): {}",
            smg.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(text)
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
        let version = smg_version(smg)?;
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
            .args(["--prometheus-host", "127.0.0.1"])
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
            version,
        };
        wait_healthy(&s.url, Duration::from_secs(60))
            .and_then(|()| test_harness::sglang::wait_smg_workers(&s.url, Duration::from_secs(30)))
            .with_context(|| {
                format!(
                    "{} ({}); its log:\n{}",
                    smg.display(),
                    s.version,
                    test_harness::tail(log, 20)
                )
            })?;
        Ok(s)
    }

    /// The router's pid (the process that serves HTTP: `smg` execs no child).
    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }
}
