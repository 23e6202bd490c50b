//! The bus flags `agent` and `checker` share, applied over the config file's `bus` section.

use std::time::Duration;

use crate::bus::BusConfig;

/// The bus flags `agent` and `checker` share (over the config file's `bus` section).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct BusArgs {
    /// NATS server URLs, comma-separated (required here or as `bus.nats` in --config).
    #[arg(long, value_name = "URL")]
    pub nats: Option<String>,
    /// JetStream stream (created when missing; also the subject prefix) [default: REVENANT].
    #[arg(long, value_name = "NAME")]
    pub stream: Option<String>,
    /// Partitions (subjects `<stream>.p<k>`), the same on every agent and checker [default: 4].
    #[arg(long, value_name = "N")]
    pub partitions: Option<u32>,
    /// Stream replicas when this process creates it: 1, or 3 on a NATS cluster [default: 1].
    #[arg(long, value_name = "N")]
    pub replicas: Option<usize>,
    /// Events per message [default: 512].
    #[arg(long, value_name = "N")]
    pub batch_events: Option<usize>,
    /// How long an open batch may wait for more events [default: 20ms].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub batch_linger: Option<Duration>,
    /// How long the stream keeps events when this process creates it [default: 1h].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub retention: Option<Duration>,
}

impl BusArgs {
    /// The config file's `bus` section with these flags over it.
    pub fn apply(&self, b: &mut BusConfig) {
        if let Some(v) = &self.nats {
            b.nats = Some(v.clone());
        }
        if let Some(v) = &self.stream {
            b.stream = v.clone();
        }
        if let Some(v) = self.partitions {
            b.partitions = v;
        }
        if let Some(v) = self.replicas {
            b.replicas = v;
        }
        if let Some(v) = self.batch_events {
            b.batch_events = v;
        }
        if let Some(v) = self.batch_linger {
            b.batch_linger = v;
        }
        if let Some(v) = self.retention {
            b.retention = v;
        }
    }
}
