//! Isolation breaches on demand (`--fault NAME --fault-rate R`), so the demo and the tests can
//! show each invariant being broken; without `--fault` the cluster stays clean.
//!
//! - `unknown-room`: decode, for a share of its legs, also sends prefill a `BOOTSTRAP` for a room
//!   nobody created (what a client talking to prefill's KV port directly does: orphan rooms that
//!   prefill keeps transfer state for). Decode's `/sim/rooms` lists each injected room with
//!   outcome `injected-unknown-room`: the oracle for what a monitor must report.

use rand::RngExt;
use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fault {
    UnknownRoom,
}

impl Fault {
    pub fn as_str(self) -> &'static str {
        match self {
            Fault::UnknownRoom => "unknown-room",
        }
    }

    /// The room-log outcome of what this fault injected.
    pub fn outcome(self) -> &'static str {
        match self {
            Fault::UnknownRoom => "injected-unknown-room",
        }
    }
}

#[derive(clap::Args, Clone, Debug, Default)]
pub struct FaultArgs {
    /// Isolation breach to inject (repeatable): unknown-room. None by default.
    #[arg(long = "fault", value_enum)]
    pub faults: Vec<Fault>,
    /// Share (0..=1) of the requests each `--fault` hits.
    #[arg(long, default_value_t = 0.01)]
    pub fault_rate: f64,
}

impl FaultArgs {
    pub fn validate(&self) -> anyhow::Result<()> {
        if !(0.0..=1.0).contains(&self.fault_rate) {
            anyhow::bail!("--fault-rate must be within 0..=1, not {}", self.fault_rate);
        }
        Ok(())
    }

    /// Whether this request is hit by `fault` (a fresh draw per call).
    pub fn hits(&self, fault: Fault) -> bool {
        self.faults.contains(&fault)
            && self.fault_rate > 0.0
            && rand::rng().random::<f64>() < self.fault_rate
    }

    /// The same flags, for a child process.
    pub fn to_args(&self) -> Vec<String> {
        let mut v = Vec::new();
        for f in &self.faults {
            v.extend(["--fault".to_string(), f.as_str().to_string()]);
        }
        if !self.faults.is_empty() {
            v.extend(["--fault-rate".to_string(), self.fault_rate.to_string()]);
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_bounds_and_child_flags() {
        let off = FaultArgs::default();
        assert!(!off.hits(Fault::UnknownRoom));
        assert!(off.to_args().is_empty());
        let all = FaultArgs {
            faults: vec![Fault::UnknownRoom],
            fault_rate: 1.0,
        };
        assert!(all.hits(Fault::UnknownRoom));
        assert_eq!(
            all.to_args(),
            ["--fault", "unknown-room", "--fault-rate", "1"]
        );
        let none = FaultArgs {
            fault_rate: 0.0,
            ..all.clone()
        };
        assert!(!none.hits(Fault::UnknownRoom));
        assert!(
            FaultArgs {
                fault_rate: 1.5,
                ..all
            }
            .validate()
            .is_err()
        );
    }
}
