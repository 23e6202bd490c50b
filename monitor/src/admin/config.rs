//! Admin server and logging flags (`#[command(flatten)]` them into `revenant run`).

use std::net::SocketAddr;

use clap::{Args, ValueEnum};

use super::self_traces::{self, SelfTraces};

#[derive(Debug, Clone, Args)]
pub struct AdminArgs {
    /// Address of the admin server (/metrics, /healthz, /readyz, /api/violations,
    /// /api/requests/{id}).
    #[arg(long = "admin", value_name = "ADDR", default_value = "127.0.0.1:9464")]
    pub admin: SocketAddr,
    /// Do not start the admin server.
    #[arg(long)]
    pub no_admin: bool,
    /// Violations kept for /api/violations.
    #[arg(long, default_value_t = 1000, value_name = "N")]
    pub recent_violations: usize,
    /// Events kept for /api/requests/{id} (oldest evicted first).
    #[arg(long, default_value_t = 100_000, value_name = "N")]
    pub timeline_events: usize,
    /// A source counts as live in /readyz if it produced an event within this window.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub source_live_window: std::time::Duration,
}

impl Default for AdminArgs {
    fn default() -> Self {
        AdminArgs {
            admin: SocketAddr::from(([127, 0, 0, 1], 9464)),
            no_admin: false,
            recent_violations: 1000,
            timeline_events: 100_000,
            source_live_window: std::time::Duration::from_secs(60),
        }
    }
}

impl AdminArgs {
    pub fn validate(&self) -> Result<(), String> {
        if self.recent_violations == 0 || self.recent_violations > 1_000_000 {
            return Err("--recent-violations must be within 1..=1000000".into());
        }
        if self.timeline_events > 10_000_000 {
            return Err("--timeline-events must be at most 10000000".into());
        }
        Ok(())
    }

    /// Base URL for links in alerts (`http://ADDR`).
    pub fn base_url(&self) -> String {
        format!("http://{}", self.admin)
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    #[default]
    Human,
    Json,
}

#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// Log format on standard error.
    #[arg(long, value_enum, default_value_t = LogFormat::Human)]
    pub log_format: LogFormat,
    /// Log filter (tracing EnvFilter syntax); `REVENANT_LOG` (or `RUST_LOG`) overrides it.
    #[arg(long, default_value = "info", value_name = "FILTER")]
    pub log_level: String,
    /// Export revenant's own spans (checker batches, alert deliveries) to this OTLP/gRPC
    /// endpoint, e.g. http://127.0.0.1:4317 of a collector. Off by default.
    #[arg(long, value_name = "URL")]
    pub self_traces_otlp: Option<String>,
    /// Share of revenant's own traces exported (head sampling, 0..=1).
    #[arg(long, default_value_t = 0.1, value_name = "RATIO")]
    pub self_traces_sample_ratio: f64,
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

        let filter = EnvFilter::try_from_env("REVENANT_LOG")
            .or_else(|_| EnvFilter::try_from_default_env())
            .or_else(|_| EnvFilter::try_new(&self.log_level))
            .map_err(|e| format!("invalid --log-level {:?}: {e}", self.log_level))?;
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
            let (layer, g) = self_traces::layer::<Base>(url, self.self_traces_sample_ratio)
                .map_err(|e| e.to_string())?;
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

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    /// The flags `revenant run` will flatten must not collide with each other.
    #[derive(Parser)]
    struct Probe {
        #[command(flatten)]
        admin: super::AdminArgs,
        #[command(flatten)]
        log: super::LogArgs,
        #[command(flatten)]
        alert: crate::alert::AlertArgs,
    }

    #[test]
    fn flattened_flags_do_not_collide_and_parse() {
        Probe::command().debug_assert();
        let p = Probe::try_parse_from([
            "x",
            "--admin",
            "127.0.0.1:0",
            "--webhook",
            "http://a/1",
            "--webhook",
            "http://b/2",
            "--alertmanager",
            "http://am:9093",
            "--spool-dir",
            "/tmp/s",
            "--log-format",
            "json",
            "--dedup-window",
            "2m",
        ])
        .unwrap();
        assert_eq!(p.alert.webhooks.len(), 2);
        assert_eq!(p.admin.admin.port(), 0);
        assert_eq!(p.log.log_format, super::LogFormat::Json);
        assert!(Probe::try_parse_from(["x", "--admin", "nonsense"]).is_err());
    }
}
