//! revenant's own logs and traces: the logging flags (`#[command(flatten)]` them into
//! `revenant run`), the global subscriber, and the optional export of revenant's own spans
//! (`checker.batch`, `alert.deliver`) over OTLP/gRPC, so an operator can see where revenant
//! spends its time in the same tracing backend as the fleet.
//!
//! The SDK's batch processor exports from its own OS thread, and the tonic transport needs a
//! Tokio reactor there (without one it panics and every later span is silently dropped). The
//! exporter therefore owns a one-thread runtime and runs each export on it.

use std::time::Duration;

use clap::Args;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, SpanData, SpanExporter};

use super::console::{self, LogFormat};

#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// Format of everything on standard error: the log, and the ready line, shutdown summary,
    /// counters and errors (`json`: one JSON object per line).
    #[arg(long, value_enum, default_value_t = LogFormat::Human)]
    pub log_format: LogFormat,
    /// Log filter (tracing EnvFilter syntax: `info`, `debug`, `revenant=debug,warn`). Given,
    /// it wins; else `REVENANT_LOG`, else `RUST_LOG`, else `info`.
    #[arg(long, value_name = "FILTER")]
    pub log_level: Option<String>,
    /// Export revenant's own spans (checker batches, alert deliveries) to this OTLP/gRPC
    /// endpoint, e.g. http://127.0.0.1:4317 of a collector. Off by default.
    #[arg(long, value_name = "URL")]
    pub self_traces_otlp: Option<String>,
    /// Share of revenant's own traces exported (head sampling, 0..=1).
    #[arg(long, default_value_t = 0.1, value_name = "RATIO", value_parser = sample_ratio)]
    pub self_traces_sample_ratio: f64,
}

/// `--self-traces-sample-ratio`: a number within 0..=1.
fn sample_ratio(s: &str) -> Result<f64, String> {
    let r: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if (0.0..=1.0).contains(&r) {
        Ok(r)
    } else {
        Err(format!("{r} is not within 0..=1"))
    }
}

impl LogArgs {
    /// Installs the global subscriber (once per process; a second call is an error). Returns
    /// the self-traces exporter to shut down (flush) at exit, when one is configured.
    pub fn init(&self) -> Result<Option<SelfTraces>, String> {
        use std::io::IsTerminal;
        use tracing_subscriber::layer::SubscriberExt as _;
        use tracing_subscriber::util::SubscriberInitExt as _;
        use tracing_subscriber::{EnvFilter, Layer, Registry};
        type Base = tracing_subscriber::layer::Layered<EnvFilter, Registry>;
        // revenant's own lines (ready, summary, errors) follow the log's format.
        console::set_format(self.log_format);

        // The flag, then the environment, then `info`: a stray RUST_LOG in a base image does
        // not beat what the command line asks for.
        let filter = match &self.log_level {
            Some(level) => EnvFilter::try_new(level)
                .map_err(|e| format!("invalid --log-level {level:?}: {e}"))?,
            None => EnvFilter::try_from_env("REVENANT_LOG")
                .or_else(|_| EnvFilter::try_from_default_env())
                .unwrap_or_else(|_| EnvFilter::new("info")),
        };
        let fmt = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            // Colour codes only for a person at a terminal, not in files or journald.
            .with_ansi(std::io::stderr().is_terminal());
        let mut layers: Vec<Box<dyn Layer<Base> + Send + Sync>> = vec![match self.log_format {
            LogFormat::Human => fmt.boxed(),
            LogFormat::Json => fmt.json().boxed(),
        }];
        let mut guard = None;
        if let Some(url) = &self.self_traces_otlp {
            let (layer, g) =
                layer::<Base>(url, self.self_traces_sample_ratio).map_err(|e| e.to_string())?;
            layers.push(layer.boxed());
            guard = Some(g);
        }
        Registry::default()
            .with(filter)
            .with(layers)
            .try_init()
            .map_err(|e| e.to_string())?;
        Ok(guard)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SelfTracesError {
    #[error("--self-traces-otlp {url:?}: {message}")]
    Endpoint { url: String, message: String },
    #[error("--self-traces-sample-ratio must be within 0..=1, got {0}")]
    Ratio(f64),
    #[error("starting the exporter runtime: {0}")]
    Runtime(std::io::Error),
}

#[derive(Debug)]
struct OwnRuntimeExporter {
    rt: tokio::runtime::Runtime,
    inner: opentelemetry_otlp::SpanExporter,
}

impl SpanExporter for OwnRuntimeExporter {
    fn export(&self, batch: Vec<SpanData>) -> impl Future<Output = OTelSdkResult> + Send {
        let result = self.rt.block_on(self.inner.export(batch));
        if let Err(e) = &result {
            tracing::warn!(error = %e, "self-traces: export failed; those spans are lost");
        }
        std::future::ready(result)
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        let _g = self.rt.enter();
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// Keeps the provider alive; [`SelfTraces::shutdown`] flushes what is still batched.
pub struct SelfTraces {
    provider: SdkTracerProvider,
}

impl SelfTraces {
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            console::error(&format!("flushing self-traces: {e}"));
        }
    }
}

pub type OtelLayer<S> =
    tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::Tracer>;

/// Builds the exporter (no connection yet: tonic connects lazily) and the tracing layer.
pub fn layer<S>(url: &str, ratio: f64) -> Result<(OtelLayer<S>, SelfTraces), SelfTracesError>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    if !(0.0..=1.0).contains(&ratio) {
        return Err(SelfTracesError::Ratio(ratio));
    }
    let parsed: http::Uri =
        url.parse()
            .map_err(|e: http::uri::InvalidUri| SelfTracesError::Endpoint {
                url: url.into(),
                message: e.to_string(),
            })?;
    if !matches!(parsed.scheme_str(), Some("http" | "https")) || parsed.host().is_none() {
        return Err(SelfTracesError::Endpoint {
            url: url.into(),
            message: "expected http://HOST:PORT (an OTLP/gRPC endpoint)".into(),
        });
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("revenant-self-traces")
        .enable_all()
        .build()
        .map_err(SelfTracesError::Runtime)?;
    let inner = {
        let _g = rt.enter();
        opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(url)
            .with_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| SelfTracesError::Endpoint {
                url: url.into(),
                message: e.to_string(),
            })?
    };
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(OwnRuntimeExporter { rt, inner })
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            ratio,
        ))))
        .with_resource(
            Resource::builder_empty()
                .with_service_name("revenant")
                .build(),
        )
        .build();
    let tracer = provider.tracer("revenant");
    Ok((
        tracing_opentelemetry::layer().with_tracer(tracer),
        SelfTraces { provider },
    ))
}
