"""Interop check of pd-sim's ZMTP implementation against real libzmq (pyzmq).

Usage: python zmq_interop.py PREFILL_HTTP_URL PREFILL_KV_PORT
The prefill must run with --transfer-after-reject --max-req-input-len 100 (see the Rust test
`pyzmq_interop` in tests/interop.rs, which starts it). Exits non-zero on any mismatch.
"""
import json
import sys
import urllib.error
import urllib.request

import zmq

http, kv_port = sys.argv[1], int(sys.argv[2])
ctx = zmq.Context()
pull = ctx.socket(zmq.PULL)
port = pull.bind_to_random_port("tcp://127.0.0.1")
pull.setsockopt(zmq.RCVTIMEO, 5000)
push = ctx.socket(zmq.PUSH)
push.connect(f"tcp://127.0.0.1:{kv_port}")
room = 123456789
body = json.dumps({"text": " ".join(["w"] * 5000), "bootstrap_host": "127.0.0.1",
                   "bootstrap_port": 8998, "bootstrap_room": room}).encode()
try:
    urllib.request.urlopen(urllib.request.Request(f"{http}/generate", data=body,
                                                  headers={"content-type": "application/json"}))
    sys.exit("expected a 400 rejection")
except urllib.error.HTTPError as e:
    assert e.code == 400, e.code
# libzmq PUSH -> pd-sim PULL: decode's BOOTSTRAP as pyzmq sends it.
push.send_multipart([b"BOOTSTRAP", str(room).encode(), b"127.0.0.1", str(port).encode()])
# pd-sim PUSH -> libzmq PULL: the KV chunks (long frames) and KV_DONE.
chunks = 0
while True:
    m = pull.recv_multipart()
    assert m[1] == str(room).encode(), m[:2]
    if m[0] == b"KV":
        assert len(m) == 4
        chunks += 1
    elif m[0] == b"KV_DONE":
        assert m[2] == b"5000", m
        break
    else:
        sys.exit(f"unexpected message {m[0]!r}")
push.send_multipart([b"ABORT", b"42"])
print(json.dumps({"kv_chunks": chunks}))
