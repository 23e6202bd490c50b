//! Configuration of the eBPF source: the `ebpf` section of the run config ([`EbpfOptions`]) and
//! the `revenant run` flags that override it ([`EbpfArgs`]).

use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

use super::loader::{CaptureConfig, LoadError};
use super::procs::{Discovery, PidRule, WatchRule};
use super::source::{EbpfConfig, EbpfSource, HoldWindows};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EbpfMode {
    On,
    Off,
    /// On when the probes load, off (said clearly in the log) when they cannot.
    #[default]
    Auto,
}

#[derive(Debug, Clone, clap::Args)]
pub struct EbpfArgs {
    /// Kernel capture of the serving processes' traffic.
    #[arg(long, value_enum, default_value_t = EbpfMode::Auto)]
    pub ebpf: EbpfMode,
    /// Watch processes whose command line matches REGEX, as ROLE (router, prefill, decode, or
    /// unknown: learned from the `disaggregation_mode` of its /server_info answer). Repeatable.
    #[arg(long = "watch", value_name = "ROLE=REGEX")]
    pub watch: Vec<WatchRule>,
    /// Watch process PID as ROLE (a bare PID: role unknown until /server_info names it). Repeatable.
    #[arg(long = "pid", value_name = "[ROLE=]PID")]
    pub pid: Vec<PidRule>,
    /// Do not apply the SGLang and vLLM command-line conventions (only --watch/--pid).
    #[arg(long)]
    pub no_sglang_conventions: bool,
    /// Leading payload bytes captured per syscall (1..=4096).
    #[arg(long, default_value_t = monitor_common::DEFAULT_HEAD_BYTES)]
    pub capture_head_bytes: u32,
    /// Trailing payload bytes captured per syscall that moved more (0..=4096).
    #[arg(long, default_value_t = monitor_common::DEFAULT_TAIL_BYTES)]
    pub capture_tail_bytes: u32,
    /// Kernel ring buffer size in bytes (power of two).
    #[arg(long, default_value_t = 16 << 20)]
    pub ring_bytes: u32,
}

/// The `ebpf` section of the run config; the flags of [`EbpfArgs`] have the same meaning.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EbpfOptions {
    /// `on`, `off` or `auto` (`--ebpf`).
    pub mode: EbpfMode,
    /// `ROLE=REGEX` rules (`--watch`); flags add to them.
    #[serde(deserialize_with = "parsed_list")]
    pub watch: Vec<WatchRule>,
    /// `[ROLE=]PID` rules (`--pid`); flags add to them.
    #[serde(deserialize_with = "parsed_list")]
    pub pid: Vec<PidRule>,
    /// Apply the SGLang and vLLM command-line conventions (`--no-sglang-conventions` turns them
    /// off).
    pub sglang_conventions: bool,
    pub capture_head_bytes: u32,
    pub capture_tail_bytes: u32,
    pub ring_bytes: u32,
}

impl Default for EbpfOptions {
    fn default() -> Self {
        EbpfOptions {
            mode: EbpfMode::Auto,
            watch: Vec::new(),
            pid: Vec::new(),
            sglang_conventions: true,
            capture_head_bytes: monitor_common::DEFAULT_HEAD_BYTES,
            capture_tail_bytes: monitor_common::DEFAULT_TAIL_BYTES,
            ring_bytes: 16 << 20,
        }
    }
}

/// A list of rules written as their flag spelling (`decode=regex`, `router=12`).
fn parsed_list<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr,
    T::Err: std::fmt::Display,
{
    Vec::<String>::deserialize(d)?
        .iter()
        .map(|s| s.parse().map_err(serde::de::Error::custom))
        .collect()
}

impl EbpfArgs {
    /// The flags alone, as options (what `revenant run` uses without a config file).
    pub fn options(&self) -> EbpfOptions {
        EbpfOptions {
            mode: self.ebpf,
            watch: self.watch.clone(),
            pid: self.pid.clone(),
            sglang_conventions: !self.no_sglang_conventions,
            capture_head_bytes: self.capture_head_bytes,
            capture_tail_bytes: self.capture_tail_bytes,
            ring_bytes: self.ring_bytes,
        }
    }

    /// The source configuration, validated (no kernel contact yet).
    pub fn config(&self, node: Option<String>) -> Result<EbpfConfig, LoadError> {
        self.options().config(node)
    }

    /// See [`EbpfOptions::start`].
    pub fn start(&self, node: Option<String>, hold: HoldWindows) -> Result<EbpfStart, LoadError> {
        self.options().start(node, hold)
    }
}

impl EbpfOptions {
    /// The source configuration, validated (no kernel contact yet).
    pub fn config(&self, node: Option<String>) -> Result<EbpfConfig, LoadError> {
        let capture = CaptureConfig {
            head_bytes: self.capture_head_bytes,
            tail_bytes: self.capture_tail_bytes,
            ring_bytes: self.ring_bytes,
            ..Default::default()
        };
        capture.validate()?;
        Ok(EbpfConfig {
            capture,
            discovery: Discovery {
                watch: self.watch.clone(),
                pids: self.pid.clone(),
                conventions: self.sglang_conventions,
            },
            node,
            rescan_every: Duration::from_secs(2),
            ..Default::default()
        })
    }

    /// Starts the source as the mode says. `Unavailable` only in `auto` mode (logged as a warning
    /// with the reason); with `on`, failing to load is an error.
    pub fn start(&self, node: Option<String>, hold: HoldWindows) -> Result<EbpfStart, LoadError> {
        if self.mode == EbpfMode::Off {
            tracing::info!("eBPF source: off (--ebpf off)");
            return Ok(EbpfStart::Off);
        }
        let cfg = EbpfConfig {
            hold_windows: hold,
            ..self.config(node)?
        };
        match EbpfSource::start(cfg) {
            Ok(src) => {
                tracing::info!("eBPF source: live");
                Ok(EbpfStart::Live(Box::new(src)))
            }
            Err(e) if self.mode == EbpfMode::Auto => {
                tracing::warn!(error = %e, "eBPF source: NOT live (--ebpf auto), continuing without kernel capture");
                Ok(EbpfStart::Unavailable(e))
            }
            Err(e) => Err(e),
        }
    }
}

/// What `--ebpf` led to.
pub enum EbpfStart {
    Live(Box<EbpfSource>),
    /// `--ebpf off`.
    Off,
    /// `--ebpf auto` and the probes could not load, for this reason.
    Unavailable(LoadError),
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        e: EbpfArgs,
    }

    #[test]
    fn parses_rules_and_validates_sizes() {
        let t = T::try_parse_from([
            "x",
            "--watch",
            "decode=fake.*decode",
            "--pid",
            "router=12",
            "--ebpf",
            "on",
        ])
        .unwrap();
        assert_eq!(t.e.ebpf, EbpfMode::On);
        let cfg = t.e.config(None).unwrap();
        assert_eq!(cfg.discovery.pids[0].pid, 12);
        assert!(T::try_parse_from(["x", "--watch", "chef=x"]).is_err());
        let t = T::try_parse_from(["x", "--capture-head-bytes", "9000"]).unwrap();
        assert!(matches!(t.e.config(None), Err(LoadError::Config(_))));
    }

    #[test]
    fn section_reads_the_flag_spellings() {
        let o: EbpfOptions = serde_saphyr::from_str(
            "mode: on\nwatch: [\"decode=fake.*decode\"]\npid: [\"router=12\", \"7\"]\nsglang_conventions: false\n",
        )
        .unwrap();
        assert_eq!(o.mode, EbpfMode::On);
        let cfg = o.config(None).unwrap();
        assert_eq!(cfg.discovery.pids[1].pid, 7);
        assert!(!cfg.discovery.conventions);
        let e = serde_saphyr::from_str::<EbpfOptions>("watch: [\"chef=x\"]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("chef"), "{e}");
    }

    #[test]
    fn off_starts_nothing() {
        let t = T::try_parse_from(["x", "--ebpf", "off"]).unwrap();
        assert!(matches!(
            t.e.start(None, HoldWindows::default()).unwrap(),
            EbpfStart::Off
        ));
    }

    /// A worker whose own timeout is at least the rule's window is named; SGLang's default
    /// (300 s) under the default windows (330 s) is not.
    #[test]
    fn worker_timeouts_against_the_rules_windows() {
        use super::super::procs::{Role, SglangTimeouts};
        let w = HoldWindows {
            decode_waits_for_kv: Some(Duration::from_secs(330)),
            prefill_waits_for_decode: Some(Duration::from_secs(330)),
        };
        let set = |waiting: u64, bootstrap: u64| SglangTimeouts {
            waiting: Some(Duration::from_secs(waiting)),
            bootstrap: Some(Duration::from_secs(bootstrap)),
        };
        assert_eq!(w.beyond(Role::Decode, SglangTimeouts::default()), None);
        assert_eq!(w.beyond(Role::Prefill, SglangTimeouts::default()), None);
        let (var, timeout, rule, _) = w.beyond(Role::Decode, set(600, 1)).unwrap();
        assert_eq!(
            (var, timeout.as_secs(), rule),
            (
                "SGLANG_DISAGGREGATION_WAITING_TIMEOUT",
                600,
                "held-decode-slot"
            )
        );
        let (_, _, rule, _) = w.beyond(Role::Prefill, set(1, 330)).unwrap();
        assert_eq!(rule, "stranded-kv");
        assert_eq!(w.beyond(Role::Router, set(900, 900)), None);
        let off = HoldWindows::default();
        assert_eq!(off.beyond(Role::Decode, set(900, 900)), None);
    }
}
