#!/usr/bin/env python3
"""Writes the seed corpora under fuzz/corpus/<target>/ from the repository's real fixtures.

Sources: the OTLP span captures in monitor/src/normalize/testdata (real SGLang 0.5.23,
sglang-router 0.3.2 and smg 1.13.0 exports), the HTTP requests sglang-router 0.3.2 sent its
workers (fuzz/fixtures), the scenario files in tests/scenarios, the rules in
monitor/rules and the rules examples of docs/rules.md. Wire-level seeds (HTTP answers, ZMTP frames,
kernel records) follow what the parsers' unit tests feed them. Deterministic: running it again
rewrites the same files. Run from anywhere: python3 fuzz/make_corpus.py
"""

import base64
import json
import os
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "fuzz" / "corpus"
ROUTER_REQUESTS = ROOT / "fuzz" / "fixtures" / "sglang-router-0.3.2"


def put(target, name, data):
    d = OUT / target
    d.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    (d / name).write_bytes(data)


# ---- HTTP messages -------------------------------------------------------------------------

def http_request(method, path, headers, body):
    body = json.dumps(body).encode() if not isinstance(body, bytes) else body
    h = dict(headers)
    h["content-length"] = str(len(body))
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
    return head.encode() + body


def http_response(status, reason, body, headers=None, chunked=False):
    headers = dict(headers or {"content-type": "application/json"})
    body = json.dumps(body).encode() if not isinstance(body, bytes) else body
    if chunked:
        headers["transfer-encoding"] = "chunked"
        payload = b""
        for i in range(0, len(body), 40):
            part = body[i:i + 40]
            payload += b"%x\r\n" % len(part) + part + b"\r\n"
        payload += b"0\r\n\r\n"
    else:
        headers["content-length"] = str(len(body))
        payload = body
    head = f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    return head.encode() + payload


ROOM = 9066467638188682269
GENERATE = {
    "text": "Hello",
    "sampling_params": {"max_new_tokens": 4},
    "stream": False,
    "rid": "8f3c2b1a9d7e4f60a1b2c3d4e5f60718",
    "bootstrap_host": "127.0.0.1",
    "bootstrap_port": 8998,
    "bootstrap_room": ROOM,
}
HDRS = {"content-type": "application/json", "host": "127.0.0.1:31001", "x-request-id": "req-1"}

requests = [http_request("POST", "/generate", HDRS, GENERATE)]
for f in ["logs_prefill.jsonl", "logs_decode.jsonl"]:
    lines = [json.loads(x) for x in (ROUTER_REQUESTS / f).read_text().splitlines()]
    for r in [r for r in lines if "headers" in r][:3]:
        h = {k: v for k, v in r["headers"].items() if k != "content-length"}
        requests.append(http_request(r["method"], r["path"], h, r["body"]))
requests.append(http_request(
    "POST", "/v1/completions",
    {"content-type": "application/json", "x-request-id": "vllm-7"},
    {"model": "m", "prompt": "Hi", "max_tokens": 4,
     "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}))
requests.append(http_request(
    "POST", "/v1/chat/completions", {"x-request-id": "vllm-8"},
    {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
     "kv_transfer_params": {"do_remote_prefill": True, "remote_request_id": "cmpl-vllm-7-0",
                            "remote_engine_id": "e", "remote_host": "10.0.0.2", "remote_port": 5600}}))
requests.append(b"GET /server_info HTTP/1.1\r\nhost: 127.0.0.1:31001\r\n\r\n")
requests.append(b"GET /v1/models HTTP/1.1\r\nhost: 127.0.0.1:8000\r\n\r\n")
requests.append(b"GET /route?bootstrap_room=77 HTTP/1.1\r\nhost: 127.0.0.1:8998\r\n\r\n")

responses = [
    http_response(400, "Bad Request", {"error": {"message": "Input length (9000 tokens) exceeds the maximum allowed length (8192 tokens)."}}),
    http_response(503, "Service Unavailable", {"object": "error", "message": "The server is overloaded", "code": 503}),
    http_response(200, "OK", {"text": " world", "meta_info": {"id": "8f3c", "prompt_tokens": 5, "completion_tokens": 4}}),
    http_response(200, "OK", b"data: {\"text\":\" a\"}\n\ndata: {\"text\":\" b\"}\n\ndata: [DONE]\n\n",
                  {"content-type": "text/event-stream"}, chunked=True),
    http_response(200, "OK", {"disaggregation_mode": "prefill", "max_total_num_tokens": 65536, "context_length": 8192}),
    http_response(200, "OK", {"object": "list", "data": [{"id": "m", "max_model_len": 8192}]}),
    http_response(200, "OK", {"id": "cmpl-vllm-7-0", "kv_transfer_params": {"remote_request_id": "cmpl-vllm-7-0", "remote_engine_id": "e"},
                              "usage": {"prompt_tokens": 5}}, chunked=True),
    b"HTTP/1.1 204 No Content\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{\"until\":\"close\"}",
]

# http_stream: `[n][n control bytes][payload]` (revenant_fuzz::stream_ops).
for i, m in enumerate(requests):
    put("http_stream", f"request-{i}", b"\0" + m)
for i, m in enumerate(responses):
    put("http_stream", f"response-{i}", b"\0" + m)
# Pipelined keep-alive, cut into pieces with a gap inside the body and a close at the end.
pipelined = requests[0] + requests[0]
ctrl = bytes([(5 << 2) | 0, (3 << 2) | 1, (2 << 2) | 2, (7 << 2) | 1, 3])
put("http_stream", "pipelined-chunked-gap", bytes([len(ctrl)]) + ctrl + pipelined)
sse = responses[3]
ctrl = bytes([(k << 2) | (0 if i == 0 else 1) for i, k in enumerate([4, 1, 3, 2, 6])])
put("http_stream", "sse-split", bytes([len(ctrl)]) + ctrl + sse)

# ---- ZMTP ----------------------------------------------------------------------------------

def zmtp_frame(body, more=False, command=False):
    flags = (1 if more else 0) | (4 if command else 0)
    if len(body) > 255:
        return bytes([flags | 2]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def zmtp_msg(parts):
    return b"".join(zmtp_frame(p, more=i + 1 < len(parts)) for i, p in enumerate(parts))


greeting = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31
assert len(greeting) == 64
ready = zmtp_frame(b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 4) + b"PUSH", command=True)
room = str(ROOM).encode()
zmtp_seeds = {
    "bootstrap": greeting + ready + zmtp_msg([b"BOOTSTRAP", room, b"127.0.0.1", b"31002"]),
    "transfer-info": greeting + ready + zmtp_msg([room, b"127.0.0.1", b"31002", b"0"]),
    "abort": greeting + ready + zmtp_msg([b"ABORT", room]),
    "kv": greeting + ready + zmtp_msg([b"KV", room, b"0", b"\x00" * 300]) + zmtp_msg([b"KV_DONE", room, b"5"]),
    "nixl": greeting + ready + zmtp_msg([b"NIXL_READ", b"cmpl-vllm-7-0"]) + zmtp_msg([b"NIXL_KV", b"cmpl-vllm-7-0", b"0", b"x" * 40])
    + zmtp_msg([b"NIXL_DONE", b"cmpl-vllm-7-0", b"5"]),
    "mid-stream": zmtp_msg([b"BOOTSTRAP", room, b"127.0.0.1", b"31002"]) + zmtp_msg([b"ABORT", room]),
    # Mooncake destinations as build_receiver_metadata_message writes them (session, then
    # required_dst_info_num in part 7), from two sessions of a room that asks for one.
    "destinations-two-owners": greeting + ready
    + zmtp_msg([room, b"127.0.0.1", b"31002", b"127.0.0.1:15001", struct.pack("<3i", 4, 5, 6),
                b"3", b"", b"1", b"0", b""])
    + zmtp_msg([room, b"127.0.0.1", b"31009", b"127.0.0.1:15009", struct.pack("<3i", 4, 5, 6),
                b"3", b"", b"1", b"0", b""]),
    # prefill_complete: readiness twice for one room.
    "readiness-twice": greeting + ready + zmtp_msg([room, b"2", b"0"]) + zmtp_msg([room, b"2", b"0"]),
}
for name, data in zmtp_seeds.items():
    put("zmtp_stream", name, b"\0" + data)
ctrl = bytes([(3 << 2) | 0, (5 << 2) | 1, (2 << 2) | 2, (6 << 2) | 0])
put("zmtp_stream", "kv-gap", bytes([len(ctrl)]) + ctrl + zmtp_seeds["kv"])

# ---- kernel records (monitor-common layouts, little endian) --------------------------------

def header(kind, tgid=200, tid=200, ts=1_000_000):
    return struct.pack("<IIIIQ", kind, tgid, tid, 0, ts)


def data_record(payload, fd=3, syscall=4, total=None, off=0):
    total = len(payload) if total is None else total
    return header(1) + struct.pack("<IIQII", fd, syscall, total, off, len(payload)) + payload


def conn_record(kind, family, port, addr, fd=3):
    return header(kind) + struct.pack("<IiHHI", fd, 0, family, port, 0) + addr.ljust(16, b"\0")


put("ebpf_record", "data-request", data_record(requests[0][:512], total=len(requests[0])))
put("ebpf_record", "data-tail", data_record(requests[0][-64:], total=len(requests[0]), off=len(requests[0]) - 64))
put("ebpf_record", "data-response", data_record(responses[0], syscall=3))
put("ebpf_record", "connect-v4", conn_record(2, 2, 31001, bytes([127, 0, 0, 1])))
put("ebpf_record", "accept-v6", conn_record(3, 10, 8998, b"\0" * 15 + b"\x01"))
put("ebpf_record", "close", header(4) + struct.pack("<II", 3, 0))
put("ebpf_record", "exec", header(5) + struct.pack("<II", 0, 0))
put("ebpf_record", "exit", header(6) + struct.pack("<II", 0, 0))
put("ebpf_record", "fork", header(7) + struct.pack("<II", 201, 0))

# ---- tracker op sequences (see fuzz_targets/ebpf_tracker.rs) ----------------------------------
# processes: 0 router, 1 prefill, 2 decode, 3 unknown role; peers: 0 prefill, 1 decode,
# 2 local prefill, 3 local decode, 4 client, 5 bootstrap.

def sel(proc, fd_index=0):
    return proc + 5 * fd_index


def t_connect(proc, fd, peer):
    return bytes([0 | (1 << 3), sel(proc, fd), peer])


def t_accept(proc, fd, peer):
    return bytes([1 | (1 << 3), sel(proc, fd), peer])


def t_close(proc, fd):
    return bytes([2 | (1 << 3), sel(proc, fd)])


def t_data(proc, fd, payload, egress, extra=0, op=None, ms=0):
    op = (5 if egress else 4) if op is None else op
    return bytes([op | (ms << 3), sel(proc, fd)]) + struct.pack("<HH", len(payload), extra) + payload


def captured(proc, fd, msg, egress, head=512, tail=512):
    """A syscall as the kernel captures it: head piece, and a tail piece when it is longer."""
    if len(msg) <= head:
        return t_data(proc, fd, msg, egress)
    out = t_data(proc, fd, msg[:head], egress, extra=len(msg) - head)
    t = msg[-tail:] if len(msg) - head > tail else msg[head:]
    return out + t_data(proc, fd, t, egress, op=6)


req = requests[0]
rej = responses[0]
ok = responses[2]
tracker = {
    # router → prefill (400) and decode (SSE answer); the router sees both answers.
    "router-prefill-reject-decode-alive": (
        t_connect(0, 0, 0) + t_connect(0, 1, 1)
        + captured(0, 0, req, True) + captured(0, 1, req, True)
        + captured(0, 0, rej, False) + captured(0, 1, responses[3], False)
        + t_close(0, 0) + t_close(0, 1)),
    # The workers' side of the same request.
    "workers-accept": (
        t_accept(1, 0, 4) + captured(1, 0, req, False) + captured(1, 0, rej, True)
        + t_accept(2, 0, 4) + captured(2, 0, req, False) + captured(2, 0, responses[3], True)
        + t_close(2, 0)),
    # Decode bootstraps over ZMTP with prefill, then the KV flows back.
    "zmtp-bootstrap-kv": (
        t_connect(2, 2, 5) + t_data(2, 2, zmtp_seeds["bootstrap"], True)
        + t_accept(1, 2, 5) + t_data(1, 2, zmtp_seeds["bootstrap"], False)
        + t_data(1, 2, zmtp_seeds["kv"], True) + t_close(1, 2)),
    # Prefill reads destinations for one room from a second decode session (a second owner).
    "zmtp-second-owner": (
        t_accept(1, 3, 5) + t_data(1, 3, zmtp_seeds["destinations-two-owners"], False)
        + t_accept(1, 4, 5) + t_data(1, 4, zmtp_seeds["readiness-twice"], False)),
    # An unknown-role server learns it is prefill from its /server_info answer.
    "server-info-learns-role": (
        t_accept(3, 0, 4) + t_data(3, 0, requests[-3], False) + t_data(3, 0, responses[4], True)
        + t_data(3, 0, req, False) + t_data(3, 0, ok, True)),
    # vLLM pair behind vllm-router.
    "vllm-pair": (
        t_connect(0, 3, 0) + captured(0, 3, requests[-5], True) + captured(0, 3, responses[6], False)
        + t_connect(0, 4, 1) + captured(0, 4, requests[-4], True) + captured(0, 4, responses[3], False)
        + t_connect(0, 5, 2) + t_data(0, 5, requests[-2], True) + t_data(0, 5, responses[5], False)),
    # The router closes a leg before any answer (a cancel), then the process exits.
    "router-cancel-exit": (
        t_connect(0, 0, 1) + captured(0, 0, req, True) + t_close(0, 0) + bytes([3, sel(0, 0)])),
    # Prompt text (0x01 = the canary member) in a request body that prefill refuses.
    "prompt-in-body": (
        t_accept(1, 1, 4)
        + t_data(1, 1, http_request("POST", "/generate", HDRS, b"{\x01\"rid\":\"r1\",\"bootstrap_room\":77}"), False)
        + t_data(1, 1, http_response(400, "Bad Request", b"{\"error\":{\x01\"message\":\"too long\"}}"), True)),
}
for name, data in tracker.items():
    put("ebpf_tracker", name, data)

# ---- OTLP exports ----------------------------------------------------------------------------

def exports_from_spans(path):
    """Groups a span capture (one span per line, `_resource` and `_scope` beside it) into one
    OTLP/JSON trace export."""
    groups = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        span = json.loads(line)
        res = span.pop("_resource", {})
        scope = span.pop("_scope", "")
        key = (json.dumps(res, sort_keys=True), scope)
        groups.setdefault(key, []).append(span)
    rs = []
    for (res, scope), spans in groups.items():
        attrs = [{"key": k, "value": {"stringValue": str(v)}} for k, v in json.loads(res).items()]
        rs.append({"resource": {"attributes": attrs},
                   "scopeSpans": [{"scope": {"name": scope}, "spans": spans}]})
    return {"resourceSpans": rs}


span_files = sorted((ROOT / "monitor/src/normalize/testdata").glob("*.jsonl"))
exports = {p.stem: exports_from_spans(p) for p in span_files}

generic_logs = {"resourceLogs": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "my-decode"}}]},
    "scopeLogs": [{"scope": {"name": "x"}, "logRecords": [
        {"timeUnixNano": "100", "eventName": "kv_received", "body": {"stringValue": "text"},
         "attributes": [{"key": "rid", "value": {"stringValue": "r1"}}]},
        {"timeUnixNano": "200", "severityNumber": "SEVERITY_NUMBER_ERROR",
         "attributes": [{"key": "event.name", "value": {"stringValue": "abort"}}, {"key": "rid", "value": {"stringValue": "r1"}}]}]}]}]}
generic_spans = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "my-prefill"}}]},
    "scopeSpans": [{"scope": {"name": "mine"}, "spans": [
        {"traceId": "0102030405060708090a0b0c0d0e0f10", "spanId": "0102030405060708", "name": "handle",
         "kind": 2, "startTimeUnixNano": "10", "endTimeUnixNano": "20", "status": {"code": 2, "message": "too long"},
         "attributes": [{"key": "x-request-id", "value": {"stringValue": "q"}}, {"key": "req.id", "value": {"stringValue": "a1"}},
                        {"key": "room", "value": {"stringValue": "77"}}, {"key": "gen_ai.usage.input_tokens", "value": {"intValue": "9000"}},
                        {"key": "limit", "value": {"intValue": 8192}}, {"key": "http.response.status_code", "value": {"intValue": "400"}}]}]}]}]}
for name, doc in list(exports.items()) + [("generic-spans", generic_spans)]:
    put("otlp_json", name + ".json", json.dumps(doc))
put("otlp_json", "generic-logs.json", json.dumps(generic_logs))

# Protobuf encodings of the same exports (opentelemetry/proto field numbers).

def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field(num, wire, payload):
    return varint((num << 3) | wire) + payload


def ld(num, payload):
    if isinstance(payload, str):
        payload = payload.encode()
    return field(num, 2, varint(len(payload)) + payload)


def vi(num, n):
    return field(num, 0, varint(n & 0xFFFFFFFFFFFFFFFF))


def f64(num, n):
    return field(num, 1, struct.pack("<Q", n))


def ident(s):
    try:
        if len(s) in (16, 32) and all(c in "0123456789abcdef" for c in s):
            return bytes.fromhex(s)
    except ValueError:
        pass
    return base64.b64decode(s)


def any_value(v):
    if "stringValue" in v:
        return ld(1, v["stringValue"])
    if "boolValue" in v:
        return vi(2, int(bool(v["boolValue"])))
    if "intValue" in v:
        return vi(3, int(v["intValue"]))
    if "doubleValue" in v:
        return field(4, 1, struct.pack("<d", float(v["doubleValue"])))
    if "arrayValue" in v:
        return ld(5, b"".join(ld(1, any_value(x)) for x in v["arrayValue"].get("values", [])))
    if "kvlistValue" in v:
        return ld(6, b"".join(ld(1, key_value(x)) for x in v["kvlistValue"].get("values", [])))
    return b""


def key_value(kv):
    return ld(1, kv["key"]) + ld(2, any_value(kv.get("value", {})))


KINDS = {"SPAN_KIND_UNSPECIFIED": 0, "SPAN_KIND_INTERNAL": 1, "SPAN_KIND_SERVER": 2,
         "SPAN_KIND_CLIENT": 3, "SPAN_KIND_PRODUCER": 4, "SPAN_KIND_CONSUMER": 5}
CODES = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}


def span_pb(s):
    out = ld(1, ident(s["traceId"])) + ld(2, ident(s["spanId"]))
    if s.get("parentSpanId"):
        out += ld(4, ident(s["parentSpanId"]))
    out += ld(5, s["name"])
    k = s.get("kind", 0)
    out += vi(6, KINDS.get(k, k) if isinstance(k, str) else k)
    out += f64(7, int(s["startTimeUnixNano"])) + f64(8, int(s["endTimeUnixNano"]))
    for a in s.get("attributes", []):
        out += ld(9, key_value(a))
    for e in s.get("events", []):
        ev = f64(1, int(e.get("timeUnixNano", 0))) + ld(2, e.get("name", ""))
        for a in e.get("attributes", []):
            ev += ld(3, key_value(a))
        out += ld(11, ev)
    st = s.get("status") or {}
    if st:
        code = st.get("code", 0)
        out += ld(15, (ld(2, st["message"]) if st.get("message") else b"")
                  + vi(3, CODES.get(code, code) if isinstance(code, str) else code))
    return out


def export_pb(doc):
    out = b""
    for rs in doc["resourceSpans"]:
        res = b"".join(ld(1, key_value(a)) for a in rs["resource"]["attributes"])
        body = ld(1, res)
        for ss in rs["scopeSpans"]:
            scope = ld(1, ss["scope"]["name"])
            body += ld(2, ld(1, scope) + b"".join(ld(2, span_pb(s)) for s in ss["spans"]))
        out += ld(1, body)
    return out


for name, doc in list(exports.items()) + [("generic-spans", generic_spans)]:
    put("otlp_proto", name + ".pb", export_pb(doc))

# ---- replay JSON Lines ------------------------------------------------------------------------

for p in sorted((ROOT / "tests/scenarios").glob("*.jsonl")):
    if p.stat().st_size > 16 * 1024:
        continue
    put("replay_jsonl", p.name, p.read_bytes())
put("replay_jsonl", "readme-example.jsonl",
    '{"time":"2026-10-26T10:00:00.000412Z","stage":"prefill","kind":"rejected","ids":{"rid":"8f3c2b1a9d7e4f60a1b2c3d4e5f60718","bootstrap_room":"0x314783f6bef71155"},"source":"otlp","status":400,"reason":"exceeds the maximum number of tokens: 9000 > 8192"}\n'
    '{"time_unix_nano":1793008800002000000,"stage":"decode","kind":"work","ids":{"bootstrap_room":3550951926993981781},"source":"ebpf","node":"gpu-node-7"}\n'
    '{"time_unix_nano":1793008800003000000,"stage":"decode","kind":"completed","ids":{"bootstrap_room":"3550951926993981781","bootstrap_room_hex":"0x314783f6bef71155"},"source":"ebpf","status":200}\n'
    '# a comment\n\n{"time_unix_nano":1,"stage":"prefill","kind":"capacity","worker":"w","context_tokens":8192,"max_input_tokens":8191,"max_total_tokens":65536}\n')

# ---- bus messages ------------------------------------------------------------------------------
# A batch as an agent publishes it (monitor/src/bus/wire.rs, WIRE_VERSION 2: the field numbers and
# shape bits below are the ones wire.rs defines).

STAGES = ["router", "prefill", "transfer", "decode"]
KINDS = ["received", "dispatched", "admitted", "rejected", "work", "completed", "aborted",
         "cancelled", "capacity"]
SOURCES = ["ebpf", "otlp", "replay"]
PEERS = ["member", "foreign", "unattributed"]
PROTOCOL_BREACHES = ["surplus-decode-owner", "repeated-readiness", "destinations-before-readiness",
                     "foreign-kv-handoff", "unissued-kv-handoff"]
BIT = {"room": 1 << 8, "rid": 1 << 9, "request_id": 1 << 10, "trace_id": 1 << 11,
       "node": 1 << 12, "status": 1 << 13, "pid": 1 << 19, "worker": 1 << 20,
       "reason": 1 << 21, "detail": 1 << 22, "input_tokens": 1 << 23,
       "context_tokens": 1 << 24, "max_input_tokens": 1 << 25, "max_total_tokens": 1 << 26}
TOKENS = ["input_tokens", "context_tokens", "max_input_tokens", "max_total_tokens"]


def packed(num, values, enc=varint):
    return ld(num, b"".join(enc(v) for v in values))


def zigzag(n):
    return ((n << 1) ^ (n >> 63)) & 0xFFFFFFFFFFFFFFFF


def bus_batch(events, seq=0, partition=0, broadcast=(), version=2, first_event=0, final=False):
    time, shape, rooms, pids, statuses, tokens = [], [], [], [], [], []
    id_len, ids, names, name_ref = [], b"", [], []
    last = 0
    for e in events:
        d = (e["time"] - last) & 0xFFFFFFFFFFFFFFFF
        time.append(zigzag(d - (1 << 64) if d >= 1 << 63 else d))
        last = e["time"]
        s = STAGES.index(e["stage"]) | KINDS.index(e["kind"]) << 2 | SOURCES.index(e["source"]) << 6
        if "room" in e:
            s |= BIT["room"]
            rooms.append(e["room"])
        for k in ("request_id", "trace_id", "rid"):
            if k in e:
                s |= BIT[k]
                id_len.append(len(e[k].encode()))
                ids += e[k].encode()
        for k in ("node", "worker", "reason", "detail"):
            if k in e:
                s |= BIT[k]
                if e[k] not in names:
                    names.append(e[k])
                name_ref.append(names.index(e[k]))
        if "status" in e:
            s |= BIT["status"]
            statuses.append(e["status"])
        if "pid" in e:
            s |= BIT["pid"]
            pids.append(e["pid"])
        if "to" in e:
            s |= (STAGES.index(e["to"]) + 1) << 14
        if "peer" in e:
            s |= (PEERS.index(e["peer"]) + 1) << 17
        if "protocol_breach" in e:
            s |= (PROTOCOL_BREACHES.index(e["protocol_breach"]) + 1) << 27
        for k in TOKENS:
            if k in e:
                s |= BIT[k]
                tokens.append(e[k])
        shape.append(s)
    newest = max([e["time"] for e in events], default=1795986920376000000)
    header = (vi(1, version) + ld(2, "gpu-7") + vi(3, 1795986920376000000) + vi(4, partition)
              + vi(5, seq) + vi(6, first_event) + packed(7, [3 * i for i in range(len(events))])
              + packed(8, list(broadcast)) + vi(9, newest) + vi(10, newest + 20000000)
              + (vi(11, 1) if final else b""))
    columns = (packed(1, time) + packed(2, shape)
               + ld(3, b"".join(struct.pack("<Q", r) for r in rooms)) + packed(4, pids)
               + packed(5, statuses) + packed(6, tokens) + packed(7, id_len) + ld(8, ids)
               + b"".join(ld(9, n) for n in names) + packed(10, name_ref))
    return ld(1, header) + ld(2, columns)


T0 = 1795986920376000000
attempt = [
    dict(time=T0, stage="router", kind="dispatched", source="ebpf", room=ROOM,
         request_id="req-000000000001", to="prefill", input_tokens=900),
    dict(time=T0, stage="router", kind="dispatched", source="ebpf", room=ROOM,
         request_id="req-000000000001", to="decode"),
    dict(time=T0 + 1000000, stage="prefill", kind="received", source="ebpf", room=ROOM),
    dict(time=T0 + 1000000, stage="decode", kind="received", source="ebpf", room=ROOM),
    dict(time=T0 + 2000000, stage="prefill", kind="rejected", source="otlp", room=ROOM,
         rid="7dd29047ddcfac1d0000000000000001", status=400,
         reason="exceeds the maximum number of tokens"),
    dict(time=T0 + 3000000, stage="decode", kind="cancelled", source="ebpf", room=ROOM,
         to="decode"),
]
put("bus_wire", "attempt", bus_batch(attempt, seq=41, partition=2))
every = [dict(time=T0 + i, stage=STAGES[i % 4], kind=KINDS[i % 9], source=SOURCES[i % 3])
         for i in range(36)]
every.append(dict(time=0, stage="transfer", kind="dispatched", source="ebpf", room=(1 << 64) - 1,
                  request_id="r", trace_id="4bf92f3577b34da6a3ce929d0e0e4736", rid="8f3c",
                  node="gpu-7", worker="http://10.0.0.5:30001", reason="overloaded",
                  detail="/generate", status=503, pid=4242, to="decode", peer="foreign",
                  input_tokens=1 << 53, context_tokens=131072, max_input_tokens=131072,
                  max_total_tokens=(1 << 64) - 1))
every += [dict(time=T0, stage="prefill", kind="received", source="ebpf", node="gpu-7",
               peer=p, worker="10.0.0.5:8998") for p in PEERS]
every += [dict(time=T0, stage="transfer", kind="admitted", source="ebpf", room=ROOM,
               worker="10.0.0.9:17001", protocol_breach=b) for b in PROTOCOL_BREACHES]
put("bus_wire", "every-field", bus_batch(every, seq=7))
put("bus_wire", "request-level", bus_batch(
    [dict(time=T0, stage="router", kind="received", source="otlp", request_id="q-1"),
     dict(time=T0 + 5, stage="decode", kind="capacity", source="otlp", worker="w",
          context_tokens=4096, max_total_tokens=8192),
     dict(time=T0 + 9, stage="router", kind="completed", source="otlp", request_id="q-1",
          status=200)],
    seq=3, partition=1, broadcast=[0, 1, 2], first_event=100))
put("bus_wire", "final-empty", bus_batch([], seq=9, partition=3, final=True))
put("bus_wire", "v1-json",
    '{"v":1,"node":"a","boot":1,"partition":0,"seq":0,"first_event":0,"offsets":[0]}\n'
    '{"time_unix_nano":1,"stage":"router","kind":"received"}')

# ---- rules YAML ---------------------------------------------------------------------------------

put("rules_yaml", "default.yaml", (ROOT / "monitor/rules/default.yaml").read_bytes())
rules_doc = (ROOT / "docs/rules.md").read_text()
blocks = rules_doc.split("```yaml\n")[1:]
for i, b in enumerate(blocks):
    text = b.split("```")[0]
    if text.lstrip().startswith("rules:"):
        put("rules_yaml", f"docs-rules-{i}.yaml", text)
put("rules_yaml", "predicate.yaml", """rules:
  - name: big-input
    description: input above the stage's capacity
    severity: critical
    scope: request
    output: "{rule}: {event.stage} {event.kind} of {attempt} ({breach})"
    predicate:
      on: [{stage: [prefill, decode], kind: [admitted, work], source: [ebpf, otlp]}]
      any:
        - {field: input_tokens, gt: {capacity: processable}}
        - {field: context_tokens, ge: {field: max_total_tokens}, plus: 1}
        - {field: input_tokens, lt: {value: 0}}
""")
put("rules_yaml", "never-after.yaml", """rules:
  - name: handoff
    description: dispatched after a rejection
    severity: warning
    never_after:
      trigger: [{stage: [prefill], kind: [rejected], status_at_least: 400}]
      forbidden: [{stage: [router], kind: [dispatched], to: [decode], status_below: 400}]
      grace: 250ms
  - name: stuck-attempt
    enabled: false
""")
