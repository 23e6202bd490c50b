"""pd-sim's vLLM flavour judged by vLLM 0.34.0's own code.

Usage: vllm_interop.py PREFILL_HTTP PREFILL_SIDE_PORT MAX_MODEL_LEN [MOONCAKE_JSON]

Against a running pd-sim prefill (`--flavour vllm`):
- the NIXL handshake: a ZMQ REQ sends vLLM's `(GET_META_MSG, 0, 0)`; the reply is read with
  vLLM's `msgspec.msgpack.Decoder(NixlHandshakePayload)` and `Decoder(NixlAgentMetadata)`,
  as `nixl/base_worker.py` does (typed decoders: a missing or mistyped field fails);
- kv_transfer_params: a prefill answer's params go through `NixlConnectorMetadata.
  add_new_req_to_recv`, which reads them as decode's worker does, and are compared with the
  fields `NixlPullConnectorScheduler.request_finished` returns;
- request ids: `InputProcessor.assign_request_id` on pd-sim's engine id gives an id of the
  shape pd-sim's `remote_request_id` has (and the id itself with randomization off);
- error bodies: vLLM's `TokenizeParams` raises the refusal and `create_error_response`
  builds the body, rendered by Starlette's `JSONResponse`: byte-equal to pd-sim's;
- `/metrics`: the `vllm:cache_config_info` labels are `CacheConfig.metrics_info()`'s keys;
- mooncake (MOONCAKE_JSON: frames a test captured off a pd-sim `--kv-connector mooncake`
  cluster, hex, with the legs' params and the bootstrap server's URL): every pull decodes with
  `Decoder(MooncakeXferMetadata)`, every answer with `Decoder(MooncakeXferResponse)`, and
  vLLM's `Encoder` writes the same bytes back; a pull is no `MooncakeLeaseHeartbeat`;
  `MooncakeConnectorMetadata.add_new_req` takes both legs' params; the bootstrap server takes
  a `RegisterWorkerPayload` and its `/query` validates as `dict[int, EngineEntry]`.

Prints one JSON line with what it checked; exits non-zero on the first difference.
"""

import inspect
import json
import os
import re
import sys
import types
import urllib.error
import urllib.request


def post(url, body, request_id):
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "x-request-id": request_id},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def fail(what, got, want=None):
    print(json.dumps({"ok": False, "check": what, "got": repr(got), "want": repr(want)}))
    sys.exit(1)


def main():
    http, side_port, max_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    import msgspec
    import zmq
    from starlette.responses import JSONResponse

    from vllm.config.cache import CacheConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import pull_scheduler
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        GET_META_MSG,
        NixlAgentMetadata,
        NixlConnectorMetadata,
        NixlHandshakePayload,
    )
    from vllm.entrypoints.serve.exception_handling.error_response import (
        create_error_response,
    )
    from vllm.exceptions import VLLMValidationError
    from vllm.renderers.params import TokenizeParams
    from vllm.v1.engine.input_processor import InputProcessor

    checked = []

    # 1. A prefill answer and its params.
    status, body = post(
        f"{http}/v1/completions",
        {
            "prompt": "a b c d e",
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        },
        "interop-1",
    )
    if status != 200:
        fail("prefill answer", (status, body))
    answer = json.loads(body)
    if answer["id"] != "cmpl-interop-1":
        fail("response id", answer["id"], "cmpl-interop-1")
    params = answer["kv_transfer_params"]
    # The keys request_finished returns, in its order (read from the source of the class).
    src = inspect.getsource(pull_scheduler.NixlPullConnectorScheduler.request_finished)
    tail = src[src.rindex("return delay_free_blocks, dict(") :]
    want_keys = re.findall(r"^\s+(\w+)=", tail, re.M)
    if list(params) != want_keys:
        fail("kv_transfer_params keys", list(params), want_keys)
    if params["transfer_mode"] != pull_scheduler.NixlPullConnectorScheduler._TRANSFER_MODE:
        fail("transfer_mode", params["transfer_mode"])
    meta = NixlConnectorMetadata()
    meta.add_new_req_to_recv("decode-req", ([1],), dict(params))
    remote = meta.reqs_to_recv["decode-req"].remote
    if (remote.engine_id, remote.request_id, remote.port) != (
        params["remote_engine_id"],
        params["remote_request_id"],
        side_port,
    ):
        fail("RemoteMeta", remote)
    if remote.num_tokens != 5:
        fail("remote_num_tokens", remote.num_tokens, 5)
    checked.append("kv_transfer_params")

    # 2. Request ids: pd-sim's internal id has the shape vLLM's assign_request_id gives.
    os.environ.pop("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", None)
    req = types.SimpleNamespace(request_id="cmpl-interop-1-0", external_req_id=None)
    InputProcessor.assign_request_id(req)
    shape = lambda s: re.sub(r"[0-9a-f]", "h", s)  # noqa: E731
    if shape(params["remote_request_id"]) != shape(req.request_id) or not params[
        "remote_request_id"
    ].startswith("cmpl-interop-1-0-"):
        fail("internal id", params["remote_request_id"], req.request_id)
    os.environ["VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"] = "1"
    req = types.SimpleNamespace(request_id="cmpl-interop-1-0", external_req_id=None)
    InputProcessor.assign_request_id(req)
    if req.request_id != "cmpl-interop-1-0":
        fail("internal id without randomization", req.request_id)
    checked.append("request_ids")

    # 3. The NIXL handshake, read with vLLM's typed decoders.
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{side_port}")
    sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
    parts = sock.recv_multipart()
    sock.close()
    if len(parts) != 2:
        fail("reply frames", len(parts), 2)
    payload = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(parts[0])
    agent = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(payload.agent_metadata_bytes)
    if agent.engine_id != params["remote_engine_id"]:
        fail("agent engine_id", agent.engine_id, params["remote_engine_id"])
    if not isinstance(msgspec.msgpack.decode(parts[1]), float):
        fail("perf_counter frame", parts[1])
    # And the bytes are what msgspec itself writes for those values.
    if msgspec.msgpack.encode(payload) != parts[0]:
        fail("handshake payload bytes", parts[0], msgspec.msgpack.encode(payload))
    if msgspec.msgpack.encode(agent) != payload.agent_metadata_bytes:
        fail("agent metadata bytes", payload.agent_metadata_bytes)
    checked.append("nixl_handshake")

    # 4. Error bodies: vLLM's own refusal, rendered as its API server does.
    def vllm_body(make):
        try:
            make()
        except VLLMValidationError as e:
            return JSONResponse(content=create_error_response(e).model_dump()).body
        fail("vLLM did not refuse", make)

    def tok(max_tokens):
        return TokenizeParams(
            max_total_tokens=max_len,
            max_output_tokens=max_tokens,
            max_total_tokens_param="max_model_len",
            max_output_tokens_param="max_tokens",
        )

    cases = [
        # Text: the tokenizer stops at max_model_len + 1.
        (
            {"prompt": " ".join(["w"] * (max_len + 50)), "max_tokens": 1},
            lambda: tok(1)._token_len_check(None, [0] * (max_len + 1)),
        ),
        (
            {"prompt": list(range(max_len + 50)), "max_tokens": 1},
            lambda: tok(1)._token_len_check(None, list(range(max_len + 50))),
        ),
        ({"prompt": "a", "max_tokens": max_len + 1}, lambda: tok(max_len + 1)),
    ]
    for i, (body, make) in enumerate(cases):
        status, got = post(f"{http}/v1/completions", body, f"interop-err-{i}")
        want = vllm_body(make)
        if status != 400 or got != want:
            fail(f"error body {i}", (status, got), want)
    checked.append("error_bodies")

    # 5. /metrics: the info line's labels are CacheConfig's fields, then engine.
    with urllib.request.urlopen(f"{http}/metrics", timeout=10) as r:
        page = r.read().decode()
    line = next(l for l in page.splitlines() if l.startswith("vllm:cache_config_info{"))
    keys = re.findall(r'([A-Za-z_]\w*)="', line)
    want = list(CacheConfig(block_size=16).metrics_info().keys()) + ["engine"]
    if keys != want:
        fail("cache_config_info labels", keys, want)
    checked.append("cache_config_info")

    if len(sys.argv) > 4:
        check_mooncake(sys.argv[4])
        checked.append("mooncake")

    print(json.dumps({"ok": True, "checked": checked}))


def check_mooncake(path):
    import msgspec
    import pydantic

    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
        mooncake_connector as mc,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils import (
        EngineEntry,
        RegisterWorkerPayload,
    )

    cap = json.load(open(path))
    enc = msgspec.msgpack.Encoder()
    meta_dec = msgspec.msgpack.Decoder(mc.MooncakeXferMetadata)
    resp_dec = msgspec.msgpack.Decoder(mc.MooncakeXferResponse)
    hb_dec = msgspec.msgpack.Decoder(mc.MooncakeLeaseHeartbeat)
    if not cap["pulls"] or len(cap["pulls"]) != len(cap["answers"]):
        fail("mooncake frames", cap)
    for i, h in enumerate(cap["pulls"]):
        b = bytes.fromhex(h)
        try:
            m = meta_dec.decode(b)
        except msgspec.DecodeError as e:
            fail(f"MooncakeXferMetadata #{i}", str(e), h)
        if enc.encode(m) != b:
            fail(f"MooncakeXferMetadata #{i} bytes", enc.encode(m).hex(), h)
        if hb_dec.decode(b).lease_transfer_ids:
            fail("a pull read as a heartbeat", h)
        for rid, (tid, blocks) in m.req_blocks.items():
            if rid != cap["decode_request_ids"][i] or tid != cap["transfer_ids"][i]:
                fail("req_blocks", (rid, tid), (cap["decode_request_ids"][i], cap["transfer_ids"][i]))
            if not all(isinstance(x, int) for g in blocks for x in g):
                fail("block ids", blocks)
        # The first pull to a peer carries the layout, later ones only its id.
        if bool(m.kv_caches_base_addr) != (i == 0) or m.layout_id % 2 != 1:
            fail(f"layout of pull #{i}", (m.kv_caches_base_addr, m.layout_id))
    for i, h in enumerate(cap["answers"]):
        b = bytes.fromhex(h)
        try:
            r = resp_dec.decode(b)
        except msgspec.DecodeError as e:
            fail(f"MooncakeXferResponse #{i}", str(e), h)
        if enc.encode(r) != b:
            fail(f"MooncakeXferResponse #{i} bytes", enc.encode(r).hex(), h)
        if r.status != mc.MooncakeXferResponseStatus.FINISH or r.ok_reqs != [
            cap["decode_request_ids"][i]
        ]:
            fail(f"answer #{i}", r)
    # The legs' params, read by the connector's metadata as the scheduler hands them over.
    md = mc.MooncakeConnectorMetadata()
    md.add_new_req("d-req", [[1, 2]], cap["decode_params"])
    pull = md.reqs_to_recv[cap["decode_params"]["remote_engine_id"]]["d-req"]
    if (pull.transfer_id, pull.remote_bootstrap_addr) != (
        cap["decode_params"]["transfer_id"],
        cap["bootstrap"],
    ):
        fail("decode leg params", pull)
    md.add_new_req("p-req", [[1]], cap["prefill_params"], load_remote_cache=False)
    if md.reqs_to_send["p-req"] != (cap["prefill_params"]["transfer_id"], [[1]]):
        fail("prefill leg params", md.reqs_to_send)
    # The bootstrap server: vLLM's registration payload, and /query as FastAPI's model reads it.
    reg = RegisterWorkerPayload(
        engine_id="interop-engine", dp_rank=7, tp_rank=0, pp_rank=0, addr="tcp://127.0.0.1:1"
    ).model_dump()
    status, body = post(cap["bootstrap"] + "/register", reg, "interop")
    if status != 200 or json.loads(body) != {"status": "ok"}:
        fail("register", (status, body))
    reg["addr"] = "tcp://127.0.0.1:2"
    status, body = post(cap["bootstrap"] + "/register", reg, "interop")
    if status != 400 or "already registered" not in json.loads(body)["detail"]:
        fail("register conflict", (status, body))
    with urllib.request.urlopen(cap["bootstrap"] + "/query", timeout=30) as r:
        q = pydantic.TypeAdapter(dict[int, EngineEntry]).validate_python(json.load(r))
    if q[0].engine_id != cap["decode_params"]["remote_engine_id"] or q[7].worker_addr != {
        0: {0: "tcp://127.0.0.1:1"}
    }:
        fail("query", q)


if __name__ == "__main__":
    main()
