//! Isolation breaches on demand (`--fault NAME --fault-rate R`), so the demo and the tests can
//! show each invariant being broken; without `--fault` the cluster stays clean. Each plays out on
//! SGLang 0.5.23's wire protocol (see `crate::kvlink`).
//!
//! - `room-collision`: the router, for a share of its attempts, sends both legs on the room of
//!   an attempt of another request that just succeeded, as a router that keeps client-supplied
//!   rooms does when two clients chose the same one (SGLang #40125). Only ended rooms are
//!   reused, so the simulated workers (which key a transfer by its room) serve both requests;
//!   the wire shows two x-request-ids on one room. The router's `/sim/stats` lists each reused
//!   room in `collided_rooms`.
//! - `unknown-room`: decode, for a share of its legs, also sends prefill destinations (the
//!   10-frame message) for a room nobody created, straight to prefill's rank port (what a client
//!   talking to it directly does, SGLang #39428: prefill keeps `transfer_infos` and a
//!   WaitingForInput status for it that nothing ever clears). Decode's `/sim/rooms` lists each
//!   injected room with outcome `injected-unknown-room`: the oracle for what a monitor must report.
//! - `success-after-abort`: prefill, for a share of its rooms, fails the transfer it started (part
//!   of the KV goes through the transfer engine, then the status `[room, "0", rank]`), reports the
//!   abort in its spans and still answers 200 with a normal finish reason (SGLang #33507). Decode
//!   fails the room (500), sends `ABORT` with a generation and gets `ABORT_ACK`. Prefill's room
//!   log: `injected-success-after-abort`.
//! - `stranded-kv`: one side of a pair ends and the other holds the request for
//!   `--fault-hold-ms`. Which rooms and which side follow from the room itself, so prefill and
//!   decode (separate processes) agree: on half of the hit rooms decode gives up at once (answers
//!   an abort, never publishes destinations) and prefill's sender keeps waiting for them; on the
//!   other half prefill aborts its sender at once and decode, told nothing under `early`
//!   (`common/conn.py:2458`), keeps waiting for KV that cannot come, then sends `ABORT`. The
//!   holding side's room log: `injected-stranded-kv`. (Under `prefill_complete` prefill's abort
//!   reaches decode as `[room, "0", rank]`, so decode is not stranded.)
//! - `foreign-route-put`: for a share of its requests prefill first registers its own rank
//!   again (`PUT /route` to its own bootstrap server, as SGLang's ranks do: a member's write),
//!   then has a process that is none of the cluster's write there: `pd-sim cluster` (not a
//!   worker, and not the parent of any process a monitor follows into its children) spawns a
//!   short-lived `pd-sim intrude`, which `PUT`s `/route` (SGLang #39400: the bootstrap server
//!   takes unauthenticated writes) with SGLang's registration of the rank prefill advertises, so
//!   the cluster keeps working. The bootstrap server counts each intruder's write in prefill's
//!   `/sim/stats` (`worker.foreign_route_puts`) and on the room that caused it (`/sim/rooms`:
//!   `foreign_route_puts`); the intruder's write names no room itself.
//! - `stub-intake`: SGLang ≤ 0.5.20 at prefill's intake. A request the scheduler refuses
//!   (`Input length … exceeds the maximum allowed length`, or over the KV capacity) keeps a
//!   one-token stub (`set_finish_with_abort`, `managers/schedule_batch.py:2221`) and still gets a
//!   sender: it waits for decode's destinations, runs its forward, moves the stub's KV and sends
//!   Success, and only then is its refusal answered (400, or 200 with the abort chunk when
//!   streamed). Decode, which got Success, generates and answers. 0.5.23 retires such requests
//!   at the door (`disaggregation/prefill.py:452`). Prefill's room log:
//!   `injected-stub-intake`. Needs a router that sends both legs at once (the refusal comes after
//!   decode's destinations).
//!
//! vLLM flavour (prefill faults, so they work behind the real vllm-router; which requests are
//! hit follows from their `X-Request-Id`, so a rerun hits the same ones):
//! - `stale-kv-params`: prefill's 200 for request A carries the `kv_transfer_params` it issued
//!   to the request before (B): the router forwards them and A's decode reads B's KV. A's
//!   own blocks are never read and expire with their lease. Prefill's record of A:
//!   `fault: injected-stale-kv-params`, `params_of`: B's engine id,
//!   `answered_remote_request_id`: B's internal id.
//! - `forged-kv-params`: prefill's 200 names a `remote_request_id` it never issued
//!   (`cmpl-forged-<16 hex>`): decode reads and notifies an id prefill does not hold
//!   (`vllm:nixl_num_notifications_after_expiry`). Record: `fault: injected-forged-kv-params`.
//! - `mooncake-pull-error` (`--kv-connector mooncake`): prefill answers a hit pull as vLLM does
//!   when its transfer engine fails the batch (`mooncake_connector.py:1944-1985`): `FINISH`
//!   with decode's id in `err_reqs` and `err_msg: "Mooncake transfer engine returned -1"`.
//!   Decode fails the request (500, `kv_load_failure_policy: fail`); prefill keeps the blocks
//!   until their lease ends. Which pulls are hit follows from the transfer id. Prefill's
//!   record: `fault: injected-mooncake-pull-error`.

use std::net::{IpAddr, SocketAddr};

use rand::RngExt;
use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fault {
    RoomCollision,
    UnknownRoom,
    SuccessAfterAbort,
    StrandedKv,
    ForeignRoutePut,
    StubIntake,
    StaleKvParams,
    ForgedKvParams,
    MooncakePullError,
}

impl Fault {
    pub fn as_str(self) -> &'static str {
        match self {
            Fault::RoomCollision => "room-collision",
            Fault::UnknownRoom => "unknown-room",
            Fault::SuccessAfterAbort => "success-after-abort",
            Fault::StrandedKv => "stranded-kv",
            Fault::ForeignRoutePut => "foreign-route-put",
            Fault::StubIntake => "stub-intake",
            Fault::StaleKvParams => "stale-kv-params",
            Fault::ForgedKvParams => "forged-kv-params",
            Fault::MooncakePullError => "mooncake-pull-error",
        }
    }

    /// The room-log outcome of what this fault injected.
    pub fn outcome(self) -> &'static str {
        match self {
            Fault::RoomCollision => "injected-room-collision",
            Fault::UnknownRoom => "injected-unknown-room",
            Fault::SuccessAfterAbort => "injected-success-after-abort",
            Fault::StrandedKv => "injected-stranded-kv",
            Fault::ForeignRoutePut => "injected-foreign-route-put",
            Fault::StubIntake => "injected-stub-intake",
            Fault::StaleKvParams => "injected-stale-kv-params",
            Fault::ForgedKvParams => "injected-forged-kv-params",
            Fault::MooncakePullError => "injected-mooncake-pull-error",
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
    /// success-after-abort, stranded-kv, foreign-route-put, stub-intake (SGLang flavour);
    /// stale-kv-params, forged-kv-params (vLLM flavour, prefill, NIXL); mooncake-pull-error
    /// (vLLM flavour, prefill, `--kv-connector mooncake`). None by default.
    #[arg(long = "fault", value_enum)]
    pub faults: Vec<Fault>,
    /// Share (0..=1) of the requests each `--fault` hits.
    #[arg(long, default_value_t = 0.01)]
    pub fault_rate: f64,
    /// `stranded-kv`: how long the holding side keeps the request after the other ended, ms.
    #[arg(long, default_value_t = 45_000)]
    pub fault_hold_ms: u64,
    /// `foreign-route-put`: where prefill asks for an intruder (the cluster's UDP socket, which
    /// `pd-sim cluster` sets).
    #[arg(long, hide = true)]
    pub fault_intruder: Option<SocketAddr>,
}

impl FaultArgs {
    /// The vLLM flavour's faults.
    pub fn vllm_only(f: Fault) -> bool {
        matches!(
            f,
            Fault::StaleKvParams | Fault::ForgedKvParams | Fault::MooncakePullError
        )
    }

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
        if let Some(a) = self.fault_intruder {
            v.extend(["--fault-intruder".to_string(), a.to_string()]);
        }
        v
    }
}

/// `pd-sim intrude`: one write to a prefill's bootstrap server by a process that is none of the
/// cluster's, then exit (0 once the server answered 200).
#[derive(clap::Args, Clone, Debug)]
pub struct IntrudeArgs {
    /// The bootstrap server, `HOST:PORT`.
    #[arg(long)]
    pub bootstrap: SocketAddr,
    /// The rank address to register (prefill's own: the cluster keeps working).
    #[arg(long)]
    pub rank_ip: IpAddr,
    #[arg(long)]
    pub rank_port: u16,
    /// Prefill's HTTP port, as its own registration names it.
    #[arg(long)]
    pub prefill_http_port: u16,
    /// The cluster's allocation policy (the bootstrap server refuses another one).
    #[arg(long, default_value = "early")]
    pub decode_allocation_policy: String,
    /// The room of the request that caused this write: the bootstrap server counts the write
    /// on it (the oracle), the write itself names no room.
    #[arg(long)]
    pub room: u64,
}

pub fn intrude(a: &IntrudeArgs) -> anyhow::Result<()> {
    use std::io::{Read, Write};
    let body = crate::worker::registration_body(
        a.rank_ip,
        a.rank_port,
        a.prefill_http_port,
        &a.decode_allocation_policy,
        Some(a.room),
    );
    let mut s =
        std::net::TcpStream::connect_timeout(&a.bootstrap, std::time::Duration::from_secs(5))?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
    write!(
        s,
        "PUT /route HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        a.bootstrap,
        body.len()
    )?;
    let mut answer = Vec::new();
    s.read_to_end(&mut answer)?;
    let head = String::from_utf8_lossy(&answer[..answer.len().min(64)]).into_owned();
    if !head.starts_with("HTTP/1.1 200") {
        anyhow::bail!("bootstrap server answered {head:?}");
    }
    Ok(())
}

/// Asks the cluster for an intruder's write caused by `room`, to register `rank` (with
/// prefill's HTTP port and allocation policy, as its own registration says).
pub fn request_intruder(
    launcher: SocketAddr,
    room: u64,
    rank: SocketAddr,
    http_port: u16,
    policy: &str,
) {
    let msg = format!("{room} {} {} {http_port} {policy}", rank.ip(), rank.port());
    match std::net::UdpSocket::bind(("127.0.0.1", 0))
        .and_then(|s| s.send_to(msg.as_bytes(), launcher))
    {
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "foreign-route-put: cannot ask for an intruder"),
    }
}

/// The cluster's side of `foreign-route-put`: for every request prefill sends to `sock`, a
/// short-lived `pd-sim intrude` against the bootstrap server at `bootstrap`, started by this
/// process (which no monitor follows into its children: it is not a worker).
pub async fn launch_intruders(sock: tokio::net::UdpSocket, bootstrap: SocketAddr) {
    let mut buf = [0u8; 256];
    loop {
        let Ok((n, _)) = sock.recv_from(&mut buf).await else {
            return;
        };
        let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
        let mut it = msg.split_whitespace();
        let (Some(room), Some(ip), Some(port), Some(http), Some(policy)) =
            (it.next(), it.next(), it.next(), it.next(), it.next())
        else {
            tracing::warn!(%msg, "foreign-route-put: bad intruder request");
            continue;
        };
        let args = vec![
            "--bootstrap".to_string(),
            bootstrap.to_string(),
            "--rank-ip".to_string(),
            ip.to_string(),
            "--rank-port".to_string(),
            port.to_string(),
            "--prefill-http-port".to_string(),
            http.to_string(),
            "--decode-allocation-policy".to_string(),
            policy.to_string(),
            "--room".to_string(),
            room.to_string(),
        ];
        let mut cmd = crate::cluster::command("intrude", args);
        cmd.stdout(std::process::Stdio::null());
        match cmd.spawn() {
            Ok(mut child) => {
                tokio::spawn(async move {
                    match child.wait().await {
                        Ok(s) if s.success() => {}
                        other => tracing::warn!(?other, "foreign-route-put: intruder failed"),
                    }
                });
            }
            Err(e) => tracing::warn!(error = %e, "foreign-route-put: cannot start an intruder"),
        }
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
            fault_intruder: None,
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
            fault_intruder: None,
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
                ..all.clone()
            }
            .validate()
            .is_err()
        );
        // The cluster's intruder launcher reaches prefill through its flags.
        let intruding = FaultArgs {
            faults: vec![Fault::ForeignRoutePut],
            fault_intruder: Some("127.0.0.1:4000".parse().unwrap()),
            ..all
        };
        assert_eq!(intruding.to_args()[..2], ["--fault", "foreign-route-put"]);
        assert!(
            intruding
                .to_args()
                .ends_with(&["--fault-intruder".to_string(), "127.0.0.1:4000".to_string()])
        );
    }

    #[test]
    fn an_intruders_registration_is_sglangs_marked_and_names_no_room() {
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let own = crate::worker::registration_body(ip, 30011, 30001, "early", None);
        assert!(
            own.starts_with(r#"{"attn_tp_size": 1, "attn_tp_rank": 0, "#),
            "Python's json.dumps layout, SGLang's key order: {own}"
        );
        let v: serde_json::Value = serde_json::from_str(&own).unwrap();
        assert_eq!(v["rank_port"], 30011);
        assert_eq!(v["prefill_http_port"], 30001);
        assert_eq!(v["decode_allocation_policy"], "early");
        assert!(v.get("injected_room").is_none());
        let foreign = crate::worker::registration_body(ip, 30011, 30001, "early", Some(42));
        let v: serde_json::Value = serde_json::from_str(&foreign).unwrap();
        assert_eq!(v["injected_room"], 42);
        // A monitor reads rooms from a `bootstrap_room` key: the intruder's write has none
        // (SGLang's own registration does say `"load_balance_method": "follow_bootstrap_room"`).
        assert!(!foreign.contains(r#""bootstrap_room""#));
    }
}
