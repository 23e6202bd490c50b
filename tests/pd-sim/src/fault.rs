//! Isolation breaches on demand (`--fault NAME --fault-rate R`), so the demo and the tests can
//! show each invariant being broken; without `--fault` the cluster stays clean.
//!
//! - `room-collision`: the router, for a share of its attempts, sends both legs on the room of
//!   an attempt of another request that just succeeded, as a router that keeps client-supplied
//!   rooms does when two clients chose the same one (SGLang #40125). Only ended rooms are
//!   reused, so the simulated workers (which key a transfer by its room) serve both requests;
//!   the wire shows two x-request-ids on one room. The router's `/sim/stats` lists each reused
//!   room in `collided_rooms`.
//! - `unknown-room`: decode, for a share of its legs, also sends prefill a `BOOTSTRAP` for a room
//!   nobody created (what a client talking to prefill's KV port directly does: orphan rooms that
//!   prefill keeps transfer state for). Decode's `/sim/rooms` lists each injected room with
//!   outcome `injected-unknown-room`: the oracle for what a monitor must report.
//! - `success-after-abort`: prefill, for a share of its rooms, aborts during the KV transfer (the
//!   KV chunks go, `KV_DONE` never does; its spans report the abort) and still answers 200 with
//!   a normal finish reason (SGLang #33507). Prefill's room log: `injected-success-after-abort`.
//! - `stranded-kv`: one side of a pair ends and the other holds the request for
//!   `--fault-hold-ms`. Which rooms and which side follow from the room itself, so prefill and
//!   decode (separate processes) agree: on half of the hit rooms decode gives up at once (answers
//!   an abort, never bootstraps) and prefill keeps waiting for it; on the other half prefill
//!   aborts at once and decode keeps waiting for KV that cannot come. The holding side's room
//!   log: `injected-stranded-kv`.

use rand::RngExt;
use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fault {
    RoomCollision,
    UnknownRoom,
    SuccessAfterAbort,
    StrandedKv,
}

impl Fault {
    pub fn as_str(self) -> &'static str {
        match self {
            Fault::RoomCollision => "room-collision",
            Fault::UnknownRoom => "unknown-room",
            Fault::SuccessAfterAbort => "success-after-abort",
            Fault::StrandedKv => "stranded-kv",
        }
    }

    /// The room-log outcome of what this fault injected.
    pub fn outcome(self) -> &'static str {
        match self {
            Fault::RoomCollision => "injected-room-collision",
            Fault::UnknownRoom => "injected-unknown-room",
            Fault::SuccessAfterAbort => "injected-success-after-abort",
            Fault::StrandedKv => "injected-stranded-kv",
        }
    }
}

/// Which side of a `stranded-kv` pair holds the request after the other ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holder {
    /// Decode gave up; prefill keeps the room (its KV) for a decode that is gone.
    Prefill,
    /// Prefill aborted; decode keeps its slot waiting for the KV.
    Decode,
}

#[derive(clap::Args, Clone, Debug, Default)]
pub struct FaultArgs {
    /// Isolation breach to inject (repeatable): room-collision, unknown-room,
    /// success-after-abort, stranded-kv.
    /// None by default.
    #[arg(long = "fault", value_enum)]
    pub faults: Vec<Fault>,
    /// Share (0..=1) of the requests each `--fault` hits.
    #[arg(long, default_value_t = 0.01)]
    pub fault_rate: f64,
    /// `stranded-kv`: how long the holding side keeps the request after the other ended, ms.
    #[arg(long, default_value_t = 45_000)]
    pub fault_hold_ms: u64,
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

    /// Whether `room` is hit by `fault`: decided by the room alone (a stable hash), so every
    /// process of the cluster decides alike.
    pub fn hits_room(&self, fault: Fault, room: u64) -> bool {
        self.faults.contains(&fault)
            && self.fault_rate > 0.0
            && unit(mix(room ^ fault as u64)) < self.fault_rate
    }

    /// `stranded-kv`: which side holds `room`, when the fault hits it.
    pub fn stranded_holder(&self, room: Option<u64>) -> Option<Holder> {
        room.filter(|&r| self.hits_room(Fault::StrandedKv, r))
            .map(|r| self.holder(r))
    }

    /// `stranded-kv`: the side that holds a hit room (an independent bit of the room's hash).
    pub fn holder(&self, room: u64) -> Holder {
        if mix(room.rotate_left(17) ^ 0x5bd1_e995) & 1 == 0 {
            Holder::Prefill
        } else {
            Holder::Decode
        }
    }

    /// The same flags, for a child process.
    pub fn to_args(&self) -> Vec<String> {
        let mut v = Vec::new();
        for f in &self.faults {
            v.extend(["--fault".to_string(), f.as_str().to_string()]);
        }
        if !self.faults.is_empty() {
            v.extend(["--fault-rate".to_string(), self.fault_rate.to_string()]);
            v.extend([
                "--fault-hold-ms".to_string(),
                self.fault_hold_ms.to_string(),
            ]);
        }
        v
    }
}

/// splitmix64's finalizer: rooms are often sequential, their hashes must not be.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The top 53 bits of `h` as a number in 0..1.
fn unit(h: u64) -> f64 {
    (h >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn room_draws_agree_across_processes_and_meet_the_rate() {
        let f = FaultArgs {
            faults: vec![Fault::StrandedKv],
            fault_rate: 0.1,
            fault_hold_ms: 1,
        };
        let hit: Vec<u64> = (1..=100_000u64)
            .filter(|&r| f.hits_room(Fault::StrandedKv, r))
            .collect();
        // The same answer every time (another process computes the same).
        assert!(hit.iter().all(|&r| f.hits_room(Fault::StrandedKv, r)));
        assert!((9_000..11_000).contains(&hit.len()), "{}", hit.len());
        assert!(!f.hits_room(Fault::SuccessAfterAbort, hit[0]) || f.faults.len() > 1);
        let prefill = hit
            .iter()
            .filter(|&&r| f.holder(r) == Holder::Prefill)
            .count();
        assert!(
            (hit.len() * 4 / 10..hit.len() * 6 / 10).contains(&prefill),
            "{prefill} of {}",
            hit.len()
        );
    }

    #[test]
    fn rate_bounds_and_child_flags() {
        let off = FaultArgs::default();
        assert!(!off.hits(Fault::UnknownRoom));
        assert!(off.to_args().is_empty());
        let all = FaultArgs {
            faults: vec![Fault::UnknownRoom],
            fault_rate: 1.0,
            fault_hold_ms: 3000,
        };
        assert!(all.hits(Fault::UnknownRoom));
        assert_eq!(
            all.to_args(),
            [
                "--fault",
                "unknown-room",
                "--fault-rate",
                "1",
                "--fault-hold-ms",
                "3000"
            ]
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
