"""pd-sim's SGLang wire protocol against real libzmq (pyzmq) and, when SGLang is importable,
against SGLang 0.5.23's own builders and parsers.

Usage: python zmq_interop.py PREFILL_HTTP PREFILL_BOOTSTRAP_PORT DECODE_HTTP [--require-sglang]

PREFILL_* is a standalone `pd-sim prefill` run with `--max-req-input-len 100`, DECODE_HTTP a
standalone `pd-sim decode` (see tests/suite/zmq_interop.rs, which starts both). This script plays:

1. the decode in front of pd-sim's prefill: both `GET /route`, the 20-frame registration and
   the 10-frame destinations (built by SGLang's `build_receiver_registration_message` /
   `build_receiver_metadata_message` when available), the transfer engine's listener that
   receives the KV (Mooncake's 24-byte headers), the status `[room, "4", "0"]` (parsed by
   `CommonKVManager.parse_kv_status_message` and applied by `apply_prefill_status`), an ABORT
   with a generation and its ABORT_ACK (`AbortNotification.to_zmq`, `AbortAck.from_zmq`);
2. the prefill behind pd-sim's decode: a bootstrap server, a rank port whose PULL socket is
   read by SGLang's real prefill bootstrap thread (`MooncakeKVManager.start_prefill_thread` on a
   manager holding only what that thread uses) or, without SGLang, by this script; the KV written
   to decode's transfer engine, Success and Failed statuses sent by SGLang's
   `send_kv_status_message`, and decode's ABORT answered by SGLang's deferred ABORT_ACK.

Prints one JSON line of what it saw; exits non-zero on any mismatch.
"""

import json
import socket
import struct
import sys
import threading
import time
import types
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import zmq

args = [a for a in sys.argv[1:] if not a.startswith("--")]
REQUIRE_SGLANG = "--require-sglang" in sys.argv
PREFILL_HTTP, PREFILL_BOOT, DECODE_HTTP = args[0], int(args[1]), args[2]

try:
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import (
        AbortAck,
        AbortNotification,
        CommonKVManager,
        PrefillServerInfo,
    )
    from sglang.srt.disaggregation.mooncake.conn import (
        KVArgsRegisterInfo,
        MooncakeKVManager,
        TransferInfo,
    )

    SGLANG = True
except ImportError as e:
    if REQUIRE_SGLANG:
        sys.exit(f"SGLang is required but not importable: {e}")
    SGLANG = False

seen = {"sglang": SGLANG}
HEADER = struct.Struct("<QQB7x")  # Mooncake TcpTransport's SessionHeader


def check(cond, what):
    if not cond:
        sys.exit(f"mismatch: {what}")


def http(method, url, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def in_thread(fn, *a):
    out = {}

    def run():
        out["v"] = fn(*a)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def read_exact(conn, n):
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise EOFError("transfer engine connection closed")
        buf += chunk
    return buf


ctx = zmq.Context()

# ---------------------------------------------------------------------------------------------
# 1. pd-sim prefill, this script as decode.
# ---------------------------------------------------------------------------------------------
boot = f"http://127.0.0.1:{PREFILL_BOOT}"
q = "prefill_dp_rank={0}&prefill_cp_rank={0}&target_tp_rank={0}&target_pp_rank={0}"
status, body = http("GET", f"{boot}/route?" + q.format(-1))
check(status == 200, f"GET /route -1: {status} {body!r}")
info = json.loads(body)
check(info["decode_allocation_policy"] == "early", info)
check(info["prefill_http_port"] == int(PREFILL_HTTP.rsplit(":", 1)[1]), info)
if SGLANG:
    PrefillServerInfo(**info)  # what SGLang's decode does with it (`common/conn.py:1307`)
status, body = http("GET", f"{boot}/route?" + q.format(0))
check(status == 200, f"GET /route 0: {status} {body!r}")
rank = json.loads(body)
check(set(rank) == {"rank_ip", "rank_port"}, rank)
status, _ = http("GET", f"{boot}/route?prefill_dp_rank=0")
check(status == 400, "a partial query is refused")

pull = ctx.socket(zmq.PULL)
pull.setsockopt(zmq.RCVTIMEO, 10000)
my_port = pull.bind_to_random_port("tcp://127.0.0.1")
te = socket.socket()
te.bind(("127.0.0.1", 0))
te.listen()
te_port = te.getsockname()[1]
session = f"127.0.0.1:{te_port}"
push = ctx.socket(zmq.PUSH)
push.connect(f"tcp://{rank['rank_ip']}:{rank['rank_port']}")

KV_PTRS = [0x7F0000000000, 0x7F4000000000]
AUX_PTRS = [0x7F8000000000]
ITEM = 4

if SGLANG:
    stub = types.SimpleNamespace(
        get_session_id=lambda: session,
        kv_args=types.SimpleNamespace(
            kv_data_ptrs=KV_PTRS,
            aux_data_ptrs=AUX_PTRS,
            state_data_ptrs=[],
            state_item_lens=[],
            state_dim_per_tensor=[],
            state_layer_ids=[],
            kv_layer_ids=[],
            engine_rank=0,
            kv_item_lens=[ITEM] * len(KV_PTRS),
        ),
        attn_tp_size=1,
        dcp_size=1,
        dcp_rank=0,
        enable_staging=False,
        local_ip="127.0.0.1",
        rank_port=my_port,
    )
    registration = MooncakeKVManager.build_receiver_registration_message(stub)
else:
    registration = [
        b"None", b"127.0.0.1", str(my_port).encode(), session.encode(),
        b"".join(struct.pack("<Q", p) for p in KV_PTRS),
        b"".join(struct.pack("<Q", p) for p in AUX_PTRS),
        b"", b"0", b"1", str(ITEM).encode(), b"", b"", b"", b"", b"", b"", b"1", b"0", b"",
        struct.pack(f"<{len(KV_PTRS)}Q", *([ITEM] * len(KV_PTRS))),
    ]
check(len(registration) == 20, "SGLang's registration is 20 frames")
push.send_multipart(registration)

room = 123456789
tokens = 5
t, out = in_thread(
    http,
    "POST",
    f"{PREFILL_HTTP}/generate",
    {"text": " ".join(["w"] * tokens), "bootstrap_host": "127.0.0.1",
     "bootstrap_port": PREFILL_BOOT, "bootstrap_room": room},
)
first_page = 100
if SGLANG:
    destinations = MooncakeKVManager.build_receiver_metadata_message(
        stub,
        bootstrap_room=room,
        required_dst_info_num=1,
        kv_indices=np.arange(first_page, first_page + tokens, dtype=np.int32),
        aux_index=7,
        state_indices=None,
        decode_prefix_len=None,
        is_dummy=False,
    )
else:
    destinations = [
        str(room).encode(), b"127.0.0.1", str(my_port).encode(), session.encode(),
        struct.pack(f"<{tokens}i", *range(first_page, first_page + tokens)),
        b"7", b"", b"1", b"0", b"",
    ]
check(len(destinations) == 10, "SGLang's destinations are 10 frames")
push.send_multipart(destinations)

# The KV arrives on the transfer engine, not over ZMTP: one block per KV buffer, then aux.
te.settimeout(10)
conn, _ = te.accept()
conn.settimeout(10)
blocks = []
while len(blocks) < len(KV_PTRS) + 1:
    size, addr, opcode = HEADER.unpack(read_exact(conn, HEADER.size))
    check(opcode == 1, f"a WRITE block, not opcode {opcode}")
    read_exact(conn, size)
    blocks.append((addr, size))
check(blocks[0] == (KV_PTRS[0] + first_page * ITEM, tokens * ITEM), blocks)
check(blocks[1] == (KV_PTRS[1] + first_page * ITEM, tokens * ITEM), blocks)
check(blocks[2][0] == AUX_PTRS[0] + 7 * 64, blocks)
seen["kv_blocks"] = len(blocks)

msg = pull.recv_multipart()
check(msg == [str(room).encode(), b"4", b"0"], f"Success status: {msg}")
if SGLANG:
    parsed = CommonKVManager.parse_kv_status_message(
        types.SimpleNamespace(kv_status_msg_tag=None), msg
    )
    check(parsed == (room, KVPoll.Success, 0, None), parsed)
    dec = types.SimpleNamespace(
        request_status={room: KVPoll.WaitingForInput},
        prefill_response_tracker={room: set()},
        required_prefill_response_num_table={room: 1},
        defer_decode_allocation=False,
        enable_staging=False,
        _staging_handler=None,
    )
    dec.update_status = lambda r, s: CommonKVManager.update_status(dec, r, s)
    dec._deferred_ack_targets, dec._deferred_ack_poisoned_rooms = {}, set()
    dec._staging_outstanding, dec.deferred_bootstrap = {}, None
    CommonKVManager.apply_prefill_status(
        dec, bootstrap_room=room, status=parsed[1], prefill_rank=parsed[2]
    )
    check(dec.request_status[room] == KVPoll.Success, dec.request_status)
t.join(30)
status, body = out["v"]
check(status == 200, f"prefill answers once the KV is over: {status} {body!r}")
check(json.loads(body)["meta_info"]["finish_reason"]["type"] == "length", body)

# An armed ABORT for a room prefill never saw: acknowledged at once.
abort = [b"ABORT", b"42", b"127.0.0.1", str(my_port).encode(), b"7"]
if SGLANG:
    abort = AbortNotification(
        room=42, decode_ip="127.0.0.1", decode_port=my_port, generation=7
    ).to_zmq()
push.send_multipart(abort)
ack = pull.recv_multipart()
check(ack == [b"ABORT_ACK", b"42", b"0", b"7"], ack)
if SGLANG:
    check(AbortAck.from_zmq(ack) == AbortAck(room=42, prefill_rank=0, generation=7), ack)

status, body = http(
    "POST", f"{PREFILL_HTTP}/generate",
    {"text": " ".join(["w"] * 200), "bootstrap_host": "127.0.0.1",
     "bootstrap_port": PREFILL_BOOT, "bootstrap_room": 99},
)
check(status == 400 and b"exceeds the maximum allowed length" in body, (status, body))
seen["prefill"] = "ok"

# ---------------------------------------------------------------------------------------------
# 2. pd-sim decode, this script (and SGLang's bootstrap thread) as prefill.
# ---------------------------------------------------------------------------------------------
rank_pull = ctx.socket(zmq.PULL)
rank_pull.setsockopt(zmq.RCVTIMEO, 10000)
p_rank_port = rank_pull.bind_to_random_port("tcp://127.0.0.1")


class Boot(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        if "prefill_dp_rank=-1" in self.path:
            payload = {"attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1,
                       "page_size": 1, "kv_cache_dtype": "auto", "follow_bootstrap_room": True,
                       "enable_dsa_cache_layer_split": False, "decode_allocation_policy": "early",
                       "enable_kv_cache_sharding": False, "prefill_http_port": None}
        else:
            payload = {"rank_ip": "127.0.0.1", "rank_port": p_rank_port}
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json; charset=utf-8")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


boot_server = ThreadingHTTPServer(("127.0.0.1", 0), Boot)
threading.Thread(target=boot_server.serve_forever, daemon=True).start()
boot_port = boot_server.server_address[1]

mgr = None
if SGLANG:
    # A Mooncake KV manager holding only what its bootstrap thread, `update_status`, the
    # deferred ABORT_ACK and `send_kv_status_message` use; its registration check (which reads
    # process-wide server state) is reduced to recording the peer.
    mgr = object.__new__(MooncakeKVManager)
    mgr.server_socket = rank_pull
    mgr.deferred_bootstrap = None
    mgr.server_args = types.SimpleNamespace(enable_pd_role_switch=False)
    mgr._stopped = False
    mgr._worker_threads = []
    mgr._staging_ctx = None
    mgr.request_status = {}
    mgr.transfer_infos = {}
    mgr.req_to_decode_prefix_len = {}
    mgr.decode_kv_args_table = {}
    mgr.is_mla_backend = False
    mgr.dcp_size, mgr.dcp_rank = 1, 0
    mgr.enable_deferred_decode_kv_release = True
    mgr._deferred_ack_targets, mgr._deferred_ack_poisoned_rooms = {}, set()
    mgr._staging_outstanding = {}
    mgr.failure_records, mgr.failure_lock = {}, threading.Lock()
    mgr.kv_status_msg_tag, mgr.kv_status_msg_carries_reason = None, False
    mgr.attn_tp_rank = mgr.pp_rank = mgr.attn_cp_rank = 0
    mgr.pp_size = mgr.attn_cp_size = 1
    mgr._zmq_ctx = ctx
    mgr._socket_cache, mgr._monitor_cache, mgr._socket_send_locks = {}, {}, {}
    mgr._socket_lock = threading.Lock()
    mgr.defer_decode_allocation = False

    def publish(session_id, info):
        mgr.decode_kv_args_table[session_id] = info

    mgr._publish_peer_registration = publish
    mgr.start_prefill_thread()


def wait_for(what, pred, timeout=10):
    end = time.time() + timeout
    while time.time() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    sys.exit(f"timed out waiting for {what}")


def decode_request(room, tokens):
    return in_thread(
        http,
        "POST",
        f"{DECODE_HTTP}/generate",
        {"text": " ".join(["w"] * tokens), "sampling_params": {"max_new_tokens": 3},
         "bootstrap_host": "127.0.0.1", "bootstrap_port": boot_port, "bootstrap_room": room},
    )


def registration_and_destinations(room):
    """(KVArgsRegisterInfo-like, TransferInfo-like) as prefill received them."""
    if SGLANG:
        reg = wait_for("registration", lambda: next(iter(mgr.decode_kv_args_table.values()), None))
        check(isinstance(reg, KVArgsRegisterInfo), type(reg))
        infos = wait_for("destinations", lambda: mgr.transfer_infos.get(room))
        check(mgr.request_status.get(room) == KVPoll.WaitingForInput, mgr.request_status)
        (dest,) = infos.values()
        check(isinstance(dest, TransferInfo) and dest.room == room, dest)
        return (reg.endpoint, reg.dst_port, reg.mooncake_session_id, reg.dst_kv_ptrs,
                reg.dst_aux_ptrs, reg.dst_kv_item_len), (
            dest.endpoint, dest.dst_port, [int(i) for i in dest.dst_kv_indices],
            dest.dst_aux_index)
    while True:
        m = rank_pull.recv_multipart()
        if m[0] == b"None":
            check(len(m) == 20, f"registration frames: {len(m)}")
            ptrs = list(struct.unpack(f"<{len(m[4]) // 8}Q", m[4]))
            aux = list(struct.unpack(f"<{len(m[5]) // 8}Q", m[5]))
            registration_and_destinations.reg = (
                m[1].decode(), int(m[2]), m[3].decode(), ptrs, aux, int(m[9]))
            continue
        check(len(m) == 10 and int(m[0]) == room, f"destinations: {m[:4]}")
        idx = list(struct.unpack(f"<{len(m[4]) // 4}i", m[4]))
        return registration_and_destinations.reg, (m[1].decode(), int(m[2]), idx, int(m[5]))


def send_status(endpoint, port, room, status):
    if SGLANG:
        mgr.send_kv_status_message(targets=[(endpoint, port)], bootstrap_room=room, status=status)
    else:
        p = ctx.socket(zmq.PUSH)
        p.connect(f"tcp://{endpoint}:{port}")
        p.send_multipart([str(room).encode(), str(int(status)).encode(), b"0"])
        p.close(linger=1000)


def sim_room(room):
    _, body = http("GET", f"{DECODE_HTTP}/sim/rooms?room={room}")
    return (json.loads(body) or [{}])[0]


SUCCESS, FAILED = (KVPoll.Success, KVPoll.Failed) if SGLANG else (4, 0)
room, tokens = 777, 6
t, out = decode_request(room, tokens)
reg, dest = registration_and_destinations(room)
ip, port, sess, kv_ptrs, aux_ptrs, item = reg
d_ip, d_port, idx, aux_index = dest
check((d_ip, d_port) == (ip, port), (reg, dest))
check(len(idx) == tokens and idx == list(range(idx[0], idx[0] + tokens)), idx)
# The KV, through decode's transfer engine (the session id names it), then Success.
host, te_p = sess.rsplit(":", 1)
w = socket.create_connection((host, int(te_p)))
for ptr in kv_ptrs:
    w.sendall(HEADER.pack(tokens * item, ptr + idx[0] * item, 1) + b"\0" * (tokens * item))
w.sendall(HEADER.pack(64, aux_ptrs[0] + aux_index * 64, 1) + b"\0" * 64)
send_status(ip, port, room, SUCCESS)
t.join(30)
status, body = out["v"]
check(status == 200, f"decode generates once Success came: {status} {body!r}")
check(json.loads(body)["meta_info"]["completion_tokens"] == 3, body)
r = wait_for("decode's KV bytes", lambda: sim_room(room).get("kv_bytes_received") == tokens * item * 2 + 64 and sim_room(room))
check(r["statuses_received"] == [4], r)

# A Failed status: decode answers 500 and withdraws the room with an armed ABORT, which the
# prefill acknowledges once nothing of it is in flight.
room2 = 778
t, out = decode_request(room2, 4)
registration_and_destinations(room2)
send_status(ip, port, room2, FAILED)
t.join(30)
status, body = out["v"]
check(status == 500 and b"Decode transfer failed" in body, (status, body))
if SGLANG:
    r = wait_for("SGLang's ABORT_ACK at decode", lambda: sim_room(room2).get("abort_acks_received") == 1 and sim_room(room2))
    check(mgr.request_status.get(room2) == KVPoll.Failed, mgr.request_status)
else:
    m = rank_pull.recv_multipart()
    check(m[0] == b"ABORT" and len(m) == 5, m)
    check((m[1], m[2], int(m[3])) == (str(room2).encode(), ip.encode(), port), m)
    p = ctx.socket(zmq.PUSH)
    p.connect(f"tcp://{ip}:{port}")
    p.send_multipart([b"ABORT_ACK", m[1], b"0", m[4]])
    p.close(linger=1000)
    r = wait_for("ABORT_ACK at decode", lambda: sim_room(room2).get("abort_acks_received") == 1 and sim_room(room2))
check(r["aborts_sent"] == 1 and r["abort_generation"] is not None, r)
seen["decode"] = "ok"
print(json.dumps(seen))
