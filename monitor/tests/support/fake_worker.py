"""A fake SGLang PD worker for the eBPF probe tests (stdlib only, loopback only).

--role prefill: POST /generate answers --status (default 400, a capacity rejection); a bootstrap
  server on --bootstrap-port answers GET /route; a raw TCP "KV control" port reads ZMTP bytes.
--role decode: POST /generate first asks the prefill bootstrap server GET /route, pushes a ZMTP
  [BOOTSTRAP, room, ip, port] message to the prefill KV port, then answers 200 with a completion.
Prints "READY" on stdout once every port listens.
"""
import argparse
import http.client
import json
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("--role", required=True, choices=["prefill", "decode"])
p.add_argument("--port", type=int, required=True)
p.add_argument("--status", type=int, default=400)
p.add_argument("--bootstrap-port", type=int, default=0)
p.add_argument("--kv-port", type=int, default=0)
args = p.parse_args()


def zmtp_frame(body, more):
    flags = 1 if more else 0
    if len(body) > 255:
        return bytes([flags | 2]) + len(body).to_bytes(8, "big") + body
    return bytes([flags, len(body)]) + body


def zmtp_push(port, parts):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
    s.sendall(greeting)
    ready = b"\x05READY\x0bSocket-Type\x00\x00\x00\x04PUSH"
    s.sendall(bytes([0x04, len(ready)]) + ready)
    msg = b"".join(zmtp_frame(p, i + 1 < len(parts)) for i, p in enumerate(parts))
    s.sendall(msg)
    s.close()


class Worker(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def reply(self, status, obj):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.startswith("/route"):
            self.reply(200, {"rank_ip": "127.0.0.1", "rank_port": args.kv_port})
        else:
            self.reply(200, {"ok": True})

    def do_POST(self):
        n = int(self.headers.get("content-length", "0"))
        req = json.loads(self.rfile.read(n))
        room = req.get("bootstrap_room")
        if args.role == "prefill":
            if args.status >= 400:
                self.reply(args.status, {"object": "error", "message": "Prefill rejected: over capacity", "code": args.status})
            else:
                self.reply(args.status, {"text": "", "meta_info": {"prompt_tokens": len(req.get("text", ""))}})
            return
        # decode: ask the bootstrap server where the KV is, register for the room, answer.
        c = http.client.HTTPConnection("127.0.0.1", req.get("bootstrap_port"), timeout=5)
        c.request("GET", "/route?engine_rank=0&target_dp_group=0")
        route = json.loads(c.getresponse().read())
        c.close()
        zmtp_push(route["rank_port"], [b"BOOTSTRAP", str(room).encode(), b"127.0.0.1", b"17001"])
        text = req.get("text", "")
        self.reply(200, {"text": "echo " + text[:64], "meta_info": {"id": "rid-decode", "prompt_tokens": len(text)}})


def kv_sink(port):
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(16)

    def serve():
        while True:
            c, _ = srv.accept()
            while c.recv(65536):
                pass
            c.close()

    threading.Thread(target=serve, daemon=True).start()


servers = [ThreadingHTTPServer(("127.0.0.1", args.port), Worker)]
if args.role == "prefill" and args.bootstrap_port:
    servers.append(ThreadingHTTPServer(("127.0.0.1", args.bootstrap_port), Worker))
if args.role == "prefill" and args.kv_port:
    kv_sink(args.kv_port)
for s in servers[1:]:
    threading.Thread(target=s.serve_forever, daemon=True).start()
print("READY", flush=True)
servers[0].serve_forever()
