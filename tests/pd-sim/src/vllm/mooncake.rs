//! The Mooncake connector's control wire, as vLLM 0.34 uses it (`--kv-connector mooncake`).
//! Paths are inside the `vllm==0.34.0` wheel; `mc/` is
//! `distributed/kv_transfer/kv_connector/v1/mooncake/`.
//!
//! - Bootstrap (`mc/mooncake_utils.py:35-178`): prefill's worker process hosts an HTTP server
//!   on `VLLM_MOONCAKE_BOOTSTRAP_PORT` (8998; `mc/mooncake_connector.py:1505-1508`), and its
//!   sender listener `POST /register`s `{engine_id, dp_rank, tp_rank, pp_rank, addr}` there,
//!   `addr` being `tcp://<host>:<ROUTER port>` (`:1614-1662`). `GET /query` answers
//!   `{"<dp_rank>": {"engine_id", "worker_addr": {"<tp>": {"<pp>": addr}}}}`: the router reads it
//!   once at start for `remote_engine_id`, decode once per bootstrap address (`:2810-2858`).
//! - Per request, after prefill answered: decode's worker connects a ZMQ DEALER to that addr and
//!   sends ONE frame, msgspec-msgpack `MooncakeXferMetadata` (`:630-655`, built at
//!   `:3216-3257`, sent at `:2653-2700`; a new socket per pull). Prefill's ROUTER answers one
//!   frame `MooncakeXferResponse` per settled batch (`:669-680`, `:1755-1990`). Both Structs are
//!   `omit_defaults`: a field at its default is not on the wire.
//! - A `MooncakeLeaseHeartbeat{lease_transfer_ids}` on the same socket renews a lease
//!   (`:682-693`, `:1664-1731`); a pull decodes as a heartbeat with no ids.
//! - The KV moves by the Mooncake transfer engine, prefill writing into decode's registered
//!   memory (RDMA; nothing pd-sim puts on a socket): played as a delay before the answer.
//!
//! | direction | one ZMTP frame (DEALER → ROUTER, no delimiter) |
//! |---|---|
//! | decode → prefill | `{remote_hostname, remote_port, remote_tp_size, remote_tp_rank, req_blocks: {<decode internal id>: [<transfer_id>, [[block ids]]]}, kv_caches_base_addr, block_lens, kv_block_lens, registered_*…, layout_id}` |
//! | prefill → decode | `{status: 0 FINISH / 1 CONTINUE / 2 ERROR / 3 LAYOUT_MISS, ok_reqs?, err_reqs?, err_msg?, layout_id?}` |

use crate::msgpack::{self, Value};

/// `MooncakeXferResponseStatus` (`mc/mooncake_connector.py:657-666`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Finish = 0,
    Continue = 1,
    Error = 2,
    LayoutMiss = 3,
}

impl Status {
    pub fn from_int(i: i64) -> Option<Status> {
        Some(match i {
            0 => Status::Finish,
            1 => Status::Continue,
            2 => Status::Error,
            3 => Status::LayoutMiss,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Status::Finish => "FINISH",
            Status::Continue => "CONTINUE",
            Status::Error => "ERROR",
            Status::LayoutMiss => "LAYOUT_MISS",
        }
    }
}

/// The `err_msg`s vLLM's prefill answers with.
pub const EXPIRED: &str = "KV expired on P side before the pull.";
pub const NOT_READY: &str = "Timeout waiting for P side ready.";
/// A transfer engine batch that failed (`:1944-1955`): `TransferEngine` returns -1.
pub const ENGINE_FAILED: &str = "Mooncake transfer engine returned -1";
/// Decode's reason when a FINISH named neither list for a request (`:2719-2726`).
pub const UNREPORTED: &str = "peer finished without reporting a transfer result";

/// Decode's registered KV regions (`registered_*` parallel lists, one entry per region).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Layout {
    pub kv_caches_base_addr: Vec<i64>,
    pub block_lens: Vec<i64>,
    pub kv_block_lens: Vec<i64>,
    pub layer_names: Vec<String>,
    pub layer_indices: Vec<i64>,
    pub group_indices: Vec<i64>,
    pub shared_group_ids: Vec<Vec<i64>>,
    pub row_offsets: Vec<i64>,
}

impl Layout {
    /// pd-sim's tiny model: `layers` full-attention layers of one KV group, K and V of 2 heads of
    /// 64 bf16 in one block row each (FlashAttention's layout: one region per layer).
    pub fn tiny(layers: usize, block_size: u64, base: i64) -> Layout {
        let block_len = (block_size * 2 * 64 * 2 * 2) as i64;
        Layout {
            kv_caches_base_addr: (0..layers as i64).map(|l| base + l * 0x1000_0000).collect(),
            block_lens: vec![block_len; layers],
            kv_block_lens: vec![block_len / 2; layers],
            layer_names: (0..layers)
                .map(|l| format!("model.layers.{l}.self_attn.attn"))
                .collect(),
            layer_indices: (0..layers as i64).collect(),
            group_indices: vec![0; layers],
            shared_group_ids: vec![Vec::new(); layers],
            row_offsets: vec![0; layers],
        }
    }
}

/// One request of a pull: decode's internal id, the router's transfer id, decode's blocks
/// (one list per KV cache group).
#[derive(Clone, Debug, PartialEq)]
pub struct ReqBlocks {
    pub decode_request_id: String,
    pub transfer_id: String,
    pub block_ids: Vec<Vec<i64>>,
}

/// `MooncakeXferMetadata` (`:630-655`). `layout: None` is a pull that leaves the layout out
/// (`:3225-3237`: empty address lists, no `registered_*`), which a peer that acked
/// `layout_id` already holds.
#[derive(Clone, Debug, PartialEq)]
pub struct XferMetadata {
    pub remote_hostname: String,
    /// Decode's transfer engine RPC port (where prefill writes), not a ZMQ port.
    pub remote_port: i64,
    pub remote_tp_size: i64,
    pub remote_tp_rank: i64,
    pub req_blocks: Vec<ReqBlocks>,
    pub layout: Option<Layout>,
    pub remote_pp_size: i64,
    pub layout_id: i64,
}

fn strs(v: &[String]) -> Value {
    Value::Array(v.iter().map(|s| Value::str(s.as_str())).collect())
}

impl XferMetadata {
    /// msgspec's bytes: fields in declaration order, those at their default left out.
    pub fn encode(&self) -> Vec<u8> {
        let req_blocks = Value::Map(
            self.req_blocks
                .iter()
                .map(|r| {
                    (
                        Value::str(r.decode_request_id.as_str()),
                        Value::Array(vec![
                            Value::str(r.transfer_id.as_str()),
                            Value::Array(
                                r.block_ids
                                    .iter()
                                    .map(|g| Value::ints(g.iter().copied()))
                                    .collect(),
                            ),
                        ]),
                    )
                })
                .collect(),
        );
        let empty = Layout::default();
        let l = self.layout.as_ref().unwrap_or(&empty);
        let mut m: Vec<(Value, Value)> = vec![
            (
                Value::str("remote_hostname"),
                Value::str(self.remote_hostname.as_str()),
            ),
            (Value::str("remote_port"), Value::Int(self.remote_port)),
            (
                Value::str("remote_tp_size"),
                Value::Int(self.remote_tp_size),
            ),
            (
                Value::str("remote_tp_rank"),
                Value::Int(self.remote_tp_rank),
            ),
            (Value::str("req_blocks"), req_blocks),
            (
                Value::str("kv_caches_base_addr"),
                Value::ints(l.kv_caches_base_addr.iter().copied()),
            ),
            (
                Value::str("block_lens"),
                Value::ints(l.block_lens.iter().copied()),
            ),
            (
                Value::str("kv_block_lens"),
                Value::ints(l.kv_block_lens.iter().copied()),
            ),
        ];
        let mut opt = |k: &str, empty: bool, v: Value| {
            if !empty {
                m.push((Value::str(k), v));
            }
        };
        opt(
            "registered_layer_names",
            l.layer_names.is_empty(),
            strs(&l.layer_names),
        );
        opt(
            "registered_layer_indices",
            l.layer_indices.is_empty(),
            Value::ints(l.layer_indices.iter().copied()),
        );
        opt(
            "registered_group_indices",
            l.group_indices.is_empty(),
            Value::ints(l.group_indices.iter().copied()),
        );
        opt(
            "registered_shared_group_ids",
            l.shared_group_ids.is_empty(),
            Value::Array(
                l.shared_group_ids
                    .iter()
                    .map(|g| Value::ints(g.iter().copied()))
                    .collect(),
            ),
        );
        opt(
            "registered_row_offsets",
            l.row_offsets.is_empty(),
            Value::ints(l.row_offsets.iter().copied()),
        );
        opt(
            "remote_pp_size",
            self.remote_pp_size == 1,
            Value::Int(self.remote_pp_size),
        );
        opt("layout_id", self.layout_id == 0, Value::Int(self.layout_id));
        Value::Map(m).encode()
    }

    /// Read a pull as vLLM's typed decoder does: a required field missing or of the wrong type
    /// is an error (in msgspec's words), unknown fields are skipped.
    pub fn decode(b: &[u8]) -> Result<XferMetadata, String> {
        let v = msgpack::decode(b).map_err(|e| e.to_string())?;
        if !matches!(v, Value::Map(_)) {
            return Err("Expected `object`, got `other`".into());
        }
        let missing = |k: &str| format!("Object missing required field `{k}`");
        let int = |k: &'static str| -> Result<i64, String> {
            v.get(k)
                .ok_or_else(|| missing(k))?
                .as_int()
                .ok_or_else(|| format!("Expected `int`, got `other` - at `$.{k}`"))
        };
        let ints = |k: &'static str, required: bool| -> Result<Vec<i64>, String> {
            match v.get(k) {
                None if !required => Ok(Vec::new()),
                None => Err(missing(k)),
                Some(x) => x
                    .as_array()
                    .and_then(|a| a.iter().map(Value::as_int).collect::<Option<Vec<_>>>())
                    .ok_or_else(|| format!("Expected `array` of `int` - at `$.{k}`")),
            }
        };
        let remote_hostname = v
            .get("remote_hostname")
            .ok_or_else(|| missing("remote_hostname"))?
            .as_str()
            .ok_or("Expected `str`, got `other` - at `$.remote_hostname`")?
            .to_owned();
        let remote_port = int("remote_port")?;
        let remote_tp_size = int("remote_tp_size")?;
        let remote_tp_rank = int("remote_tp_rank")?;
        let Some(Value::Map(rb)) = v.get("req_blocks") else {
            return Err(missing("req_blocks"));
        };
        let mut req_blocks = Vec::with_capacity(rb.len());
        for (k, x) in rb {
            let bad = || "Expected `array` of length 2 - at `$.req_blocks[...]`".to_string();
            let (Some(id), Some([t, groups])) = (k.as_str(), x.as_array()) else {
                return Err(bad());
            };
            let groups = groups
                .as_array()
                .and_then(|gs| {
                    gs.iter()
                        .map(|g| {
                            g.as_array()?
                                .iter()
                                .map(Value::as_int)
                                .collect::<Option<Vec<_>>>()
                        })
                        .collect::<Option<Vec<_>>>()
                })
                .ok_or_else(bad)?;
            req_blocks.push(ReqBlocks {
                decode_request_id: id.to_owned(),
                transfer_id: t.as_str().ok_or_else(bad)?.to_owned(),
                block_ids: groups,
            });
        }
        let layout = Layout {
            kv_caches_base_addr: ints("kv_caches_base_addr", true)?,
            block_lens: ints("block_lens", true)?,
            kv_block_lens: ints("kv_block_lens", true)?,
            layer_names: v
                .get("registered_layer_names")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|s| s.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default(),
            layer_indices: ints("registered_layer_indices", false)?,
            group_indices: ints("registered_group_indices", false)?,
            shared_group_ids: v
                .get("registered_shared_group_ids")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .map(|g| {
                            g.as_array()
                                .map(|x| x.iter().filter_map(Value::as_int).collect())
                                .unwrap_or_default()
                        })
                        .collect()
                })
                .unwrap_or_default(),
            row_offsets: ints("registered_row_offsets", false)?,
        };
        Ok(XferMetadata {
            remote_hostname,
            remote_port,
            remote_tp_size,
            remote_tp_rank,
            req_blocks,
            layout: (!layout.kv_caches_base_addr.is_empty()).then_some(layout),
            remote_pp_size: v.get("remote_pp_size").and_then(Value::as_int).unwrap_or(1),
            layout_id: v.get("layout_id").and_then(Value::as_int).unwrap_or(0),
        })
    }
}

/// `MooncakeXferResponse` (`:669-680`).
#[derive(Clone, Debug, PartialEq)]
pub struct XferResponse {
    pub status: Status,
    pub ok_reqs: Option<Vec<String>>,
    pub err_reqs: Option<Vec<String>>,
    pub err_msg: Option<String>,
    pub layout_id: i64,
}

impl XferResponse {
    pub fn new(status: Status) -> XferResponse {
        XferResponse {
            status,
            ok_reqs: None,
            err_reqs: None,
            err_msg: None,
            layout_id: 0,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut m = vec![(Value::str("status"), Value::Int(self.status as i64))];
        if let Some(ok) = &self.ok_reqs {
            m.push((Value::str("ok_reqs"), strs(ok)));
        }
        if let Some(err) = &self.err_reqs {
            m.push((Value::str("err_reqs"), strs(err)));
        }
        if let Some(msg) = &self.err_msg {
            m.push((Value::str("err_msg"), Value::str(msg.as_str())));
        }
        if self.layout_id != 0 {
            m.push((Value::str("layout_id"), Value::Int(self.layout_id)));
        }
        Value::Map(m).encode()
    }

    pub fn decode(b: &[u8]) -> Result<XferResponse, String> {
        let v = msgpack::decode(b).map_err(|e| e.to_string())?;
        let status = v
            .get("status")
            .ok_or("Object missing required field `status`")?
            .as_int()
            .and_then(Status::from_int)
            .ok_or("Invalid enum value - at `$.status`")?;
        let list = |k: &str| {
            v.get(k).and_then(Value::as_array).map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect()
            })
        };
        Ok(XferResponse {
            status,
            ok_reqs: list("ok_reqs"),
            err_reqs: list("err_reqs"),
            err_msg: v.get("err_msg").and_then(Value::as_str).map(str::to_owned),
            layout_id: v.get("layout_id").and_then(Value::as_int).unwrap_or(0),
        })
    }
}

/// `MooncakeLeaseHeartbeat` (`:682-693`).
pub fn heartbeat(transfer_ids: &[String]) -> Vec<u8> {
    if transfer_ids.is_empty() {
        return Value::Map(Vec::new()).encode();
    }
    Value::map([("lease_transfer_ids", strs(transfer_ids))]).encode()
}

/// The transfer ids of a heartbeat; `None` for anything else, a pull included (it decodes as a
/// heartbeat with no ids, `:1710-1716`).
pub fn parse_heartbeat(b: &[u8]) -> Option<Vec<String>> {
    let v = msgpack::decode(b).ok()?;
    let ids: Vec<String> = v
        .get("lease_transfer_ids")?
        .as_array()?
        .iter()
        .map(|s| s.as_str().map(str::to_owned))
        .collect::<Option<_>>()?;
    (!ids.is_empty()).then_some(ids)
}

/// `RegisterWorkerPayload` (`mc/mooncake_utils.py:20-25`), as `model_dump()` posts it.
pub fn register_body(engine_id: &str, addr: &str) -> serde_json::Value {
    serde_json::json!({"engine_id": engine_id, "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": addr})
}

/// The worker address of `engine` (tp 0, pp 0) in a `/query` answer.
pub fn worker_addr(query: &serde_json::Value, engine: &str) -> Option<String> {
    query.as_object()?.values().find_map(|dp| {
        (dp.get("engine_id")?.as_str()? == engine)
            .then(|| dp.pointer("/worker_addr/0/0")?.as_str().map(str::to_owned))?
    })
}

/// The engine id of dp rank 0 in a `/query` answer (what vllm-router reads at start).
pub fn engine_of_rank0(query: &serde_json::Value) -> Option<String> {
    query
        .get("0")?
        .get("engine_id")?
        .as_str()
        .map(str::to_owned)
}

/// `tcp://host:port` → (host, port).
pub fn parse_tcp_addr(addr: &str) -> Option<(String, u16)> {
    let rest = addr.strip_prefix("tcp://")?;
    let (h, p) = rest.rsplit_once(':')?;
    Some((
        h.trim_start_matches('[').trim_end_matches(']').to_owned(),
        p.parse().ok()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    /// Bytes msgspec 0.19 wrote for the same Structs (vLLM 0.34.0's classes).
    #[test]
    fn frames_are_msgspecs() {
        let m = XferMetadata {
            remote_hostname: "127.0.0.1".into(),
            remote_port: 1234,
            remote_tp_size: 1,
            remote_tp_rank: 0,
            req_blocks: vec![ReqBlocks {
                decode_request_id: "cmpl-a-0-12345678".into(),
                transfer_id: "xfer-1".into(),
                block_ids: vec![vec![1, 2]],
            }],
            layout: Some(Layout {
                kv_caches_base_addr: vec![1],
                block_lens: vec![2],
                kv_block_lens: vec![3],
                ..Layout::default()
            }),
            remote_pp_size: 1,
            layout_id: 0,
        };
        assert_eq!(
            hex(&m.encode()),
            "88af72656d6f74655f686f73746e616d65a93132372e302e302e31ab72656d6f74655f706f7274cd04d2ae72656d6f74655f74705f73697a6501ae72656d6f74655f74705f72616e6b00aa7265715f626c6f636b7381b1636d706c2d612d302d313233343536373892a6786665722d3191920102b36b765f6361636865735f626173655f616464729101aa626c6f636b5f6c656e739102ad6b765f626c6f636b5f6c656e739103"
        );
        assert_eq!(XferMetadata::decode(&m.encode()).unwrap(), m);
        let mut ok = XferResponse::new(Status::Finish);
        ok.ok_reqs = Some(vec!["cmpl-a-0-12345678".into()]);
        assert_eq!(
            hex(&ok.encode()),
            "82a673746174757300a76f6b5f7265717391b1636d706c2d612d302d3132333435363738"
        );
        let mut err = XferResponse::new(Status::Error);
        err.err_reqs = Some(vec!["x".into()]);
        err.err_msg = Some("boom".into());
        assert_eq!(
            hex(&err.encode()),
            "83a673746174757302a86572725f7265717391a178a76572725f6d7367a4626f6f6d"
        );
        assert_eq!(XferResponse::decode(&err.encode()).unwrap(), err);
        let hb = heartbeat(&["a".into()]);
        assert_eq!(hex(&hb), "81b26c656173655f7472616e736665725f69647391a161");
        assert_eq!(parse_heartbeat(&hb), Some(vec!["a".to_string()]));
        assert_eq!(parse_heartbeat(&m.encode()), None);
        assert!(
            XferMetadata::decode(&hb)
                .unwrap_err()
                .contains("remote_hostname")
        );
    }

    #[test]
    fn query_answers() {
        let q: serde_json::Value = serde_json::from_str(
            r#"{"0":{"engine_id":"e1","worker_addr":{"0":{"0":"tcp://127.0.0.1:5600"}}}}"#,
        )
        .unwrap();
        assert_eq!(
            worker_addr(&q, "e1").as_deref(),
            Some("tcp://127.0.0.1:5600")
        );
        assert_eq!(worker_addr(&q, "e2"), None);
        assert_eq!(engine_of_rank0(&q).as_deref(), Some("e1"));
        assert_eq!(
            parse_tcp_addr("tcp://127.0.0.1:5600"),
            Some(("127.0.0.1".into(), 5600))
        );
    }
}
