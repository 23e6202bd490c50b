//! Admin server flags (`#[command(flatten)]` them into `revenant run`).

use std::net::SocketAddr;

use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct AdminArgs {
    /// Address of the admin server (/metrics, /healthz, /readyz, /api/violations,
    /// /api/requests/{id}).
    #[arg(long = "admin", value_name = "ADDR", default_value = "127.0.0.1:9464", value_parser = crate::addr::parse)]
    pub admin: SocketAddr,
    /// Do not start the admin server.
    #[arg(long)]
    pub no_admin: bool,
    /// Serve /metrics, /healthz and /readyz on this address of their own (plain HTTP, no
    /// token: for scrapers and probes); the admin address keeps / and /api/* [default: the
    /// admin address serves all].
    #[arg(long, value_name = "ADDR", value_parser = crate::addr::parse)]
    pub metrics_addr: Option<SocketAddr>,
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
            metrics_addr: None,
            recent_violations: 1000,
            timeline_events: 100_000,
            source_live_window: std::time::Duration::from_secs(60),
        }
    }
}

/// An admin setting out of its range.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AdminConfigError {
    #[error("--recent-violations must be within 1..={max}, not {value}")]
    RecentViolations { value: usize, max: usize },
    #[error("--timeline-events must be at most {max}, not {value}")]
    TimelineEvents { value: usize, max: usize },
    #[error("--metrics-addr {0} is the admin address too: give it a port of its own")]
    MetricsOnAdmin(SocketAddr),
}

/// Bounds of the admin server's in-memory rings.
const MAX_RECENT_VIOLATIONS: usize = 1_000_000;
const MAX_TIMELINE_EVENTS: usize = 10_000_000;

impl AdminArgs {
    pub fn validate(&self) -> Result<(), AdminConfigError> {
        if self.recent_violations == 0 || self.recent_violations > MAX_RECENT_VIOLATIONS {
            return Err(AdminConfigError::RecentViolations {
                value: self.recent_violations,
                max: MAX_RECENT_VIOLATIONS,
            });
        }
        if let Some(m) = self.metrics_addr
            && m == self.admin
            && m.port() != 0
        {
            return Err(AdminConfigError::MetricsOnAdmin(m));
        }
        if self.timeline_events > MAX_TIMELINE_EVENTS {
            return Err(AdminConfigError::TimelineEvents {
                value: self.timeline_events,
                max: MAX_TIMELINE_EVENTS,
            });
        }
        Ok(())
    }

    /// Base URL for links in alerts (`http://ADDR`).
    pub fn base_url(&self) -> String {
        format!("http://{}", self.admin)
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
        log: crate::telemetry::logging::LogArgs,
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
        assert_eq!(p.log.log_format, crate::telemetry::console::LogFormat::Json);
        assert!(Probe::try_parse_from(["x", "--admin", "nonsense"]).is_err());
    }

    #[test]
    fn out_of_range_rings_are_typed_errors() {
        use super::{AdminArgs, AdminConfigError};
        assert_eq!(AdminArgs::default().validate(), Ok(()));
        let zero = AdminArgs {
            recent_violations: 0,
            ..AdminArgs::default()
        };
        let err = zero.validate().unwrap_err();
        assert_eq!(
            err,
            AdminConfigError::RecentViolations {
                value: 0,
                max: 1_000_000
            }
        );
        assert_eq!(
            err.to_string(),
            "--recent-violations must be within 1..=1000000, not 0"
        );
        let huge = AdminArgs {
            timeline_events: 10_000_001,
            ..AdminArgs::default()
        };
        assert!(matches!(
            huge.validate(),
            Err(AdminConfigError::TimelineEvents {
                value: 10_000_001,
                ..
            })
        ));
    }
}
