"""A fake PD router for the eBPF probe tests: like sglang-router 0.3.2 (smg), it sends the same
POST /generate to prefill and decode at once, with bootstrap_host/port/room appended at the END of
the JSON body after the client's (long) prompt. Waits for a line on stdin before sending.
"""
import argparse
import http.client
import json
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


def send(name, port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("POST", "/generate", body=body, headers={
        "content-type": "application/json",
        "x-request-id": args.request_id,
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    })
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
