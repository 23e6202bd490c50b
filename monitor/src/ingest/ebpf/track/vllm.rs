//! What the wire says about vLLM prefill/decode pairs (vllm-router in front of vLLM 0.34 workers;
//! the map with file references is docs/routers.md).
//!
//! - Ids: the router sends one `X-Request-Id` X on both legs. vLLM names the request `cmpl-X`
//!   (`chatcmpl-X` on chat: `serve/engine/serving.py` `_base_request_id`) and hands its engine
//!   `cmpl-X-0` (the prompt's index, `completion/serving.py`; chat keeps `chatcmpl-X`): that engine
//!   id is the attempt's rid, as in vLLM's own `llm_request` span (`gen_ai.request.id`) and its
//!   logs, so both legs and the spans are one attempt. A leg whose body names a rid or a
//!   `bootstrap_room` (SGLang) keeps those.
//! - Transfer: prefill's answer carries `kv_transfer_params.remote_request_id`, prefill's
//!   internal id (`cmpl-X-0-<8 random chars>` since vLLM 0.14, `v1/engine/input_processor.py`
//!   `assign_request_id`; the engine id itself under `VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`), and
//!   the router copies the params into decode's leg; MooncakeConnector legs also carry the
//!   router's `transfer_id`. Each such name is remembered with the leg's rid, bounded, so
//!   side-channel messages that name it get the rid.
//! - Handoff: the KV a decode leg names must be KV prefill issued to the same request. The names
//!   prefill's answers issued are remembered with the request they answered ([`IssuedKv`]); a
//!   decode leg naming another request's KV, or (when this request's own answer was seen) KV no
//!   answer issued, is a [`ProtocolBreach`] on the leg's event.
//! - Roles: `do_remote_decode: true` in a leg's body means the server is a prefill,
//!   `do_remote_prefill: true` a decode (NIXL workers run `kv_both`: their command line says
//!   nothing).
//! - Capacity: `/v1/models` names `max_model_len`, `/metrics` the KV cache
//!   (`vllm:cache_config_info`: `num_gpu_blocks` × `block_size` tokens). Each change is one
//!   `capacity` report of that worker: `context_tokens` = max_model_len, `max_total_tokens` = KV
//!   tokens.

use std::collections::VecDeque;

use foldhash::HashMap;

use super::lifecycle::PathKind;
use super::{Endpoint, HandoffBreach, Tracker};
use crate::event::{Kind, LifecycleEvent, ProtocolBreach, Stage};
use crate::ingest::ebpf::json_ids::{BodyWindow, KvLeg, RequestIds, ResponseInfo};
use crate::ingest::ebpf::procs::Role;
use crate::ingest::ebpf::zmtp::Control;
use crate::normalize::attrs::clip_id;

/// The id vLLM's engine gives a request it got on `path` with `X-Request-Id: x`: `cmpl-x-0` on
/// `/v1/completions` (the first prompt's; a PD leg has one), `chatcmpl-x` on chat.
pub(super) fn request_name(path: &str, x: &str) -> Option<String> {
    let name = match path {
        "/v1/completions" => format!("cmpl-{x}-0"),
        "/v1/chat/completions" => format!("chatcmpl-{x}"),
        _ => return None,
    };
    Some(clip_id(&name).to_owned())
}

/// Side-channel names that differ from their leg's rid, oldest forgotten first.
#[derive(Debug, Default)]
pub(super) struct TransferNames {
    rid: HashMap<String, String>,
    order: VecDeque<String>,
}

impl TransferNames {
    const MAX: usize = 16_384;

    fn note(&mut self, name: &str, rid: &str) {
        let name = clip_id(name);
        if name == rid || self.rid.contains_key(name) {
            return;
        }
        if self.order.len() >= Self::MAX
            && let Some(old) = self.order.pop_front()
        {
            self.rid.remove(&old);
        }
        self.rid.insert(name.to_owned(), rid.to_owned());
        self.order.push_back(name.to_owned());
    }

    /// The rid a name was noted with; `None` for a name never noted (or forgotten).
    fn known(&self, name: &str) -> Option<&str> {
        self.rid.get(clip_id(name)).map(String::as_str)
    }
}

/// The KV prefill's answers issued: each `remote_request_id` with the requests (rids) answers
/// named it for, in the order seen, and each request's latest, bounded (oldest forgotten first:
/// a decode leg naming forgotten KV is not judged).
#[derive(Debug, Default)]
pub(super) struct IssuedKv {
    owner: HashMap<String, Vec<String>>,
    latest: HashMap<String, String>,
    order: VecDeque<(String, String)>,
}

impl IssuedKv {
    const MAX: usize = 16_384;
    /// Requests remembered per KV name: one on a correct deployment; more are the breach.
    const MAX_SHARERS: usize = 4;

    fn issue(&mut self, name: &str, rid: &str) {
        let name = clip_id(name);
        // KV is one request's: answers naming it for two requests hand both the same KV, and
        // which of them prefill computed it for is not on the wire (their answers may leave in
        // either order), so each one's decode leg is judged against the other.
        match self.owner.get_mut(name) {
            Some(rids) => {
                if rids.len() < Self::MAX_SHARERS && !rids.iter().any(|r| r == rid) {
                    rids.push(rid.to_owned());
                }
            }
            None => {
                if self.order.len() >= Self::MAX
                    && let Some((old, old_rid)) = self.order.pop_front()
                {
                    self.owner.remove(&old);
                    if self.latest.get(&old_rid).is_some_and(|n| *n == old) {
                        self.latest.remove(&old_rid);
                    }
                }
                self.owner.insert(name.to_owned(), vec![rid.to_owned()]);
                self.order.push_back((name.to_owned(), rid.to_owned()));
            }
        }
        if self.latest.len() < 2 * Self::MAX || self.latest.contains_key(rid) {
            self.latest.insert(rid.to_owned(), name.to_owned());
        }
    }

    /// A successful answer to `rid` whose KV name was not read (not there, or lost to a capture
    /// gap): what it issued is unknown, so an earlier answer's must not stand for it.
    pub(super) fn forget_latest(&mut self, rid: &str) {
        self.latest.remove(rid);
    }

    /// What a decode leg of `rid` naming KV `name` breaks, with another request the KV was
    /// issued to (foreign: the first such) or the KV this request was issued (unissued).
    fn judge(&self, name: &str, rid: &str) -> Option<(ProtocolBreach, String)> {
        let name = clip_id(name);
        match self.owner.get(name) {
            Some(rids) => rids
                .iter()
                .find(|r| *r != rid)
                .map(|other| (ProtocolBreach::ForeignKvHandoff, other.clone())),
            None => self
                .latest
                .get(rid)
                .map(|own| (ProtocolBreach::UnissuedKvHandoff, own.clone())),
        }
    }
}

/// The last capacity a worker reported, per worker key.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct WorkerCapacity {
    context: Option<u64>,
    kv_tokens: Option<u64>,
}

/// Workers whose capacity is remembered; beyond that the table starts over (a report is then
/// repeated once, never lost).
const MAX_CAPACITY_WORKERS: usize = 4096;

impl Tracker {
    /// A request body ended: vLLM ids and roles. Returns the ids the leg's events carry and,
    /// for a decode leg, the handoff it breaks.
    pub(super) fn vllm_request(
        &mut self,
        at: &mut Endpoint,
        path: &str,
        request_id: Option<&str>,
        mut ids: RequestIds,
    ) -> (RequestIds, Option<HandoffBreach>) {
        if ids.rid.is_none()
            && ids.bootstrap_room.is_none()
            && let Some(x) = request_id
        {
            ids.rid = request_name(path, x);
        }
        let mut handoff = None;
        if let Some(rid) = &ids.rid {
            if let Some(name) = &ids.remote_request_id {
                if ids.kv_leg == Some(KvLeg::Decode) {
                    // The other request first: reasons are cut at their end, and ids behind
                    // vllm-router are over 100 bytes.
                    handoff = self.issued_kv.judge(name, rid).map(|(breach, other)| {
                        let reason = match breach {
                            ProtocolBreach::ForeignKvHandoff => {
                                format!("decode leg reads the KV prefill issued to {other}")
                            }
                            _ => format!(
                                "decode leg names KV that no prefill answer issued: {}",
                                clip_id(name)
                            ),
                        };
                        HandoffBreach { breach, reason }
                    });
                }
                self.transfer_names.note(name, rid);
            }
            if let Some(t) = &ids.transfer_id {
                self.transfer_names.note(t, rid);
            }
        }
        if let Some(leg) = ids.kv_leg {
            let role = match leg {
                KvLeg::Prefill => "prefill",
                KvLeg::Decode => "decode",
            };
            let unknown = if at.client {
                self.worker_of(at.peer)
                    .is_none_or(|w| w.role == Role::Unknown)
            } else {
                at.role == Role::Unknown
            };
            if unknown {
                self.learn(at, Some(role));
                if !at.client {
                    at.role = self.role(at.tgid).unwrap_or(at.role);
                }
            }
        }
        (ids, handoff)
    }

    /// A vLLM KV-connector message (see [`crate::ingest::ebpf::zmtp::vllm_control`]), `report`ed
    /// by this end or not: the NIXL handshake is counted (it pairs engines, it names no
    /// request); a MooncakeConnector pull is the transfer `admitted` for each request it names,
    /// prefill's answer `completed` (`ok_reqs`) or `aborted` (`err_reqs`). A request is named by
    /// its leg's rid, learnt from the legs' `transfer_id`; one no leg here named is counted, not
    /// reported (its request is not known). Both counts are kept by the reporting end only, so
    /// a message both ends of this node read counts once.
    pub(super) fn vllm_transfer(
        &mut self,
        tgid: u32,
        ts: u64,
        ctl: Control,
        report: bool,
        out: &mut Vec<LifecycleEvent>,
    ) {
        let mut emit = |t: &mut Self, rid: Option<String>, kind: Kind, what: &str| {
            if !report {
                return;
            }
            let Some(rid) = rid else {
                t.stats.vllm_transfers_unattributed += 1;
                return;
            };
            let mut e = t
                .event(ts, Stage::Transfer, kind, tgid)
                .with_rid(rid.as_str());
            e.detail = Some(format!("zmtp mooncake {what}").into());
            out.push(e);
        };
        match ctl {
            Control::NixlHandshake => self.stats.vllm_nixl_handshakes += u64::from(report),
            Control::MooncakePull { reqs } => {
                for (d_req, transfer) in reqs {
                    let rid = self.transfer_names.known(&transfer).map(str::to_owned);
                    if let Some(rid) = &rid {
                        self.transfer_names.note(&d_req, rid);
                    }
                    emit(self, rid, Kind::Admitted, "pull");
                }
            }
            Control::MooncakeStatus { ok, err } => {
                for (ids, kind, what) in [
                    (ok, Kind::Completed, "ok_reqs"),
                    (err, Kind::Aborted, "err_reqs"),
                ] {
                    for d_req in ids {
                        let rid = self.transfer_names.known(&d_req).map(str::to_owned);
                        emit(self, rid, kind, what);
                    }
                }
            }
            _ => {}
        }
    }

    /// A response ended with a success status: what a vLLM answer tells beyond the request's
    /// own lifecycle.
    pub(super) fn vllm_answer(
        &mut self,
        at: &Endpoint,
        kind: PathKind,
        rid: Option<&str>,
        (body, info): (&BodyWindow, &ResponseInfo),
        ts: u64,
        out: &mut Vec<LifecycleEvent>,
    ) {
        if let (Some(name), Some(rid)) = (&info.remote_request_id, rid) {
            self.transfer_names.note(name, rid);
            self.issued_kv.issue(name, rid);
        }
        let report = match kind {
            PathKind::Models => info.max_model_len.map(|c| WorkerCapacity {
                context: Some(c),
                kv_tokens: None,
            }),
            PathKind::Metrics => body.vllm_cache_config().map(|c| WorkerCapacity {
                context: None,
                kv_tokens: Some(c.tokens()),
            }),
            _ => None,
        };
        if let Some(report) = report {
            self.capacity_report(at, report, ts, out);
        }
    }

    /// Merges a worker's report into what it said before and emits a `capacity` event when
    /// that changed. The worker is the server: the peer when this end asked (its address keys
    /// the report), this process when it answered (reported only when no router here reads
    /// it, so that one poll is one report).
    fn capacity_report(
        &mut self,
        at: &Endpoint,
        report: WorkerCapacity,
        ts: u64,
        out: &mut Vec<LifecycleEvent>,
    ) {
        let (stage, worker) = if at.client {
            let Some(peer) = at.peer else { return };
            let Some(stage) = self.worker_of(Some(peer)).and_then(|w| w.role.stage()) else {
                return;
            };
            (stage, Some(peer.to_string()))
        } else {
            if self.has_role(Role::Router) {
                return;
            }
            let Some(stage) = at.role.stage() else { return };
            (stage, None)
        };
        let key = worker.clone().unwrap_or_else(|| format!("pid:{}", at.tgid));
        let before = self.capacity.get(&key).copied().unwrap_or_default();
        let now = WorkerCapacity {
            context: report.context.or(before.context),
            kv_tokens: report.kv_tokens.or(before.kv_tokens),
        };
        if now == before {
            return;
        }
        if self.capacity.len() >= MAX_CAPACITY_WORKERS && !self.capacity.contains_key(&key) {
            self.capacity.clear();
        }
        self.capacity.insert(key, now);
        let mut e = self.event(ts, stage, Kind::Capacity, at.tgid);
        e.context_tokens = now.context;
        e.max_total_tokens = now.kv_tokens;
        e.detail = Some("vllm".into());
        if let Some(w) = worker {
            e = e.with_worker(w);
        }
        out.push(e);
    }
}

/// Capacity reports remembered per worker key.
pub(super) type CapacityTable = HashMap<String, WorkerCapacity>;
