//! What the wire says about vLLM prefill/decode pairs (vllm-router in front of vLLM workers).
//!
//! - Ids: the router sends one `X-Request-Id` on both legs and vLLM names the request
//!   `cmpl-<X-Request-Id>` (`chatcmpl-` on `/v1/chat/completions`): that name is the attempt's
//!   rid, as in vLLM's own spans (`gen_ai.request.id`), so both legs and the spans are one attempt.
//!   A leg whose body names a rid or a `bootstrap_room` (SGLang) keeps those.
//! - Transfer: prefill's answer and decode's leg carry `kv_transfer_params.remote_request_id`,
//!   the name the side channel uses. When it differs from the leg's rid (builds that suffix the
//!   engine's id), the pair is remembered, bounded, so side-channel events get the leg's rid.
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
use super::{Endpoint, Tracker};
use crate::event::{Kind, LifecycleEvent};
use crate::ingest::ebpf::json_ids::{BodyWindow, KvLeg, RequestIds, ResponseInfo};
use crate::ingest::ebpf::procs::Role;
use crate::normalize::attrs::clip_id;

/// vLLM's name for a request it got on `path` with `X-Request-Id: x`.
pub(super) fn request_name(path: &str, x: &str) -> Option<String> {
    let prefix = match path {
        "/v1/completions" => "cmpl-",
        "/v1/chat/completions" => "chatcmpl-",
        _ => return None,
    };
    Some(clip_id(&format!("{prefix}{x}")).to_owned())
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

    pub(super) fn rid_of<'a>(&'a self, name: &'a str) -> &'a str {
        let name = clip_id(name);
        self.rid.get(name).map_or(name, String::as_str)
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.order.len()
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
    /// A request body ended: vLLM ids and roles. Returns the ids the leg's events carry.
    pub(super) fn vllm_request(
        &mut self,
        at: &mut Endpoint,
        path: &str,
        request_id: Option<&str>,
        mut ids: RequestIds,
    ) -> RequestIds {
        if ids.rid.is_none()
            && ids.bootstrap_room.is_none()
            && let Some(x) = request_id
        {
            ids.rid = request_name(path, x);
        }
        if let (Some(name), Some(rid)) = (&ids.remote_request_id, &ids.rid) {
            self.transfer_names.note(name, rid);
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
        ids
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
