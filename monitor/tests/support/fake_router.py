"""A fake PD router for the eBPF probe tests: like sglang-router 0.3.2 (smg), it sends the same
POST /generate to prefill and decode at once, with bootstrap_host/port/room appended at the END of
the JSON body after the client's (long) prompt. Waits for a line on stdin before sending.
"""
import argparse
import http.client
import json
import socket
import sys
import threading

p = argparse.ArgumentParser()
p.add_argument("--prefill", type=int, required=True)
p.add_argument("--decode", type=int, required=True)
p.add_argument("--bootstrap-port", type=int, required=True)
p.add_argument("--room", type=int, required=True)
p.add_argument("--prompt-bytes", type=int, default=300000)
p.add_argument("--canary", default="")
p.add_argument("--request-id", default="req-ebpf-1")
p.add_argument("--repeat", type=int, default=1)
p.add_argument("--vectored", action="store_true",
               help="send each request with one sendmsg over many iovecs (head and tail split across them)")
args = p.parse_args()

filler = "lorem ipsum dolor sit amet "
prompt = args.canary + " " + (filler * (args.prompt_bytes // len(filler) + 1))[: args.prompt_bytes] + " " + args.canary
body = json.dumps({
    "text": prompt,
    "sampling_params": {"max_new_tokens": 4},
    "stream": False,
    "bootstrap_host": "127.0.0.1",
    "bootstrap_port": args.bootstrap_port,
    "bootstrap_room": args.room,
}).encode()
print("READY", flush=True)
sys.stdin.readline()

results = {}


HEADERS = {
    "content-type": "application/json",
    "x-request-id": args.request_id,
    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
}


def send_vectored(name, port):
    """One sendmsg, many iovecs: the request line, each header, and the body cut into uneven
    pieces with `bootstrap_room` split across the last two, as vectored writers (hyper) do."""
    head = [b"POST /generate HTTP/1.1\r\n", b"Host: 127.0.0.1\r\n"]
    head += [f"{k}: {v}\r\n".encode() for k, v in HEADERS.items()]
    head += [f"content-length: {len(body)}\r\n".encode(), b"\r\n"]
    cuts = [0, 7, 100, 101, len(body) // 2, len(body) - 12, len(body)]
    pieces = head + [body[a:b] for a, b in zip(cuts, cuts[1:])]
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    total = sum(len(x) for x in pieces)
    sent = s.sendmsg(pieces)
    if sent != total:
        s.sendall(b"".join(pieces)[sent:])
    r = http.client.HTTPResponse(s)
    r.begin()
    r.read()
    results[name] = r.status
    s.close()


def send(name, port):
    if args.vectored:
        return send_vectored(name, port)
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("POST", "/generate", body=body, headers=HEADERS)
    r = c.getresponse()
    r.read()
    results[name] = r.status
    c.close()


for _ in range(args.repeat):
    threads = [threading.Thread(target=send, args=(n, port)) for n, port in (("prefill", args.prefill), ("decode", args.decode))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
print(json.dumps(results), flush=True)
