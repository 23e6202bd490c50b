"""Record what the real vllm-router exports over OTLP in vLLM PD mode, as a revenant fixture.

Starts, all on loopback:
  - a minimal OTLP/gRPC trace receiver (vllm-router 0.1.17 exports with opentelemetry-otlp's
    tonic exporter, i.e. gRPC);
  - two tiny fake vLLM workers (prefill, decode) answering `/health`, `/v1/models`, `/metrics`
    and `/v1/completions` with real vLLM shapes (contract-14: `kv_transfer_params` on the
    prefill answer, the vLLM 400 "maximum context length" error for long prompts);
  - the real router (`vllm_router.Router(vllm_pd_disaggregation=True, enable_trace=True,
    otlp_traces_endpoint=...)`) in its own process.
Then sends one request that succeeds and one whose prefill answers 400, waits for the router's
batch exporter, and writes every span as one JSON line: the span in OTLP/JSON (protobuf JSON
mapping: base64 ids, string int64s) plus `_resource` (flat map of string attributes) and
`_scope` (scope name), the shape `monitor/src/normalize/tests.rs` loads.

Run (two interpreters: the router's own venv and a scratch venv with grpcio):
  python3 -m venv /tmp/otlprec && /tmp/otlprec/bin/pip install grpcio opentelemetry-proto
  /tmp/otlprec/bin/python tests/otlp/record_vllm_router.py \
      --router-python /tmp/vr/bin/python \
      --out monitor/src/normalize/testdata/vllm-router-0.1.17-spans.jsonl
where /tmp/vr is a venv with `pip install vllm-router==0.1.17`. Prints a JSON summary on stdout
(ids, what each worker received: headers and body keys only, never prompt text).

The fake workers export no spans themselves: the fixture holds only what the router sent.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

MODEL = "fake-model"
MAX_MODEL_LEN = 64
BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 128


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- OTLP receiver ----

class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.lines = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                resource = {}
                for kv in rs.resource.attributes:
                    v = kv.value
                    which = v.WhichOneof("value")
                    resource[kv.key] = str(getattr(v, which)) if which else ""
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        d = MessageToDict(sp)
                        d["_resource"] = resource
                        d["_scope"] = ss.scope.name
                        d["_scope_version"] = ss.scope.version
                        self.lines.append(d)
        return trace_service_pb2.ExportTraceServiceResponse()


# ---- fake vLLM workers ----

def count_tokens(body):
    p = body.get("prompt", "")
    if isinstance(p, list):
        return len(p)
    return len(str(p).split())


def make_worker(role, seen):
    side_port = free_port()

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def send(self, code, obj=None, ctype="application/json", raw=None):
            data = raw if raw is not None else (b"" if obj is None else json.dumps(obj).encode())
            self.send_response(code)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            path = self.path.split("?")[0]
            if path == "/health":
                self.send(200, raw=b"")
            elif path == "/v1/models":
                self.send(200, {"object": "list", "data": [{
                    "id": MODEL, "object": "model", "created": int(time.time()),
                    "owned_by": "vllm", "root": MODEL, "parent": None,
                    "max_model_len": MAX_MODEL_LEN, "permission": []}]})
            elif path == "/metrics":
                text = (
                    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
                    "# TYPE vllm:cache_config_info gauge\n"
                    f'vllm:cache_config_info{{block_size="{BLOCK_SIZE}",cache_dtype="auto",'
                    'enable_prefix_caching="True",gpu_memory_utilization="0.9",'
                    f'num_cpu_blocks="0",num_gpu_blocks="{NUM_GPU_BLOCKS}"}} 1.0\n'
                    "# HELP vllm:num_requests_running Number of requests running.\n"
                    "# TYPE vllm:num_requests_running gauge\n"
                    f'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0\n'
                    "# HELP vllm:num_requests_waiting Number of requests waiting.\n"
                    "# TYPE vllm:num_requests_waiting gauge\n"
                    f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0.0\n'
                )
                self.send(200, ctype="text/plain; version=0.0.4", raw=text.encode())
            else:
                self.send(404, {"detail": "Not Found"})

        def do_POST(self):
            n = int(self.headers.get("content-length") or 0)
            body = json.loads(self.rfile.read(n) or b"{}")
            path = self.path.split("?")[0]
            x = self.headers.get("x-request-id", "")
            p = count_tokens(body)
            max_tokens = int(body.get("max_tokens") or 16)
            seen.append({
                "role": role, "path": path, "x-request-id": x,
                "traceparent": self.headers.get("traceparent"),
                "body_keys": sorted(body.keys()),
                "max_tokens": body.get("max_tokens"), "stream": body.get("stream"),
                "kv_transfer_params": body.get("kv_transfer_params"),
                "prompt_tokens": p,
            })
            if path not in ("/v1/completions", "/v1/chat/completions"):
                self.send(404, {"detail": "Not Found"})
                return
            if p + max_tokens > MAX_MODEL_LEN:
                self.send(400, {
                    "object": "error",
                    "message": f"This model's maximum context length is {MAX_MODEL_LEN} tokens. "
                    f"However, you requested {p + max_tokens} tokens ({p} in the messages, "
                    f"{max_tokens} in the completion). Please reduce the length of the messages "
                    "or completion.",
                    "type": "BadRequestError", "param": None, "code": 400})
                return
            rid = ("chatcmpl-" if "chat" in path else "cmpl-") + x
            kv_in = body.get("kv_transfer_params") or {}
            c = 1 if kv_in.get("do_remote_decode") else max_tokens
            ans = {
                "id": rid, "object": "text_completion", "created": int(time.time()),
                "model": MODEL,
                "choices": [{"index": 0, "text": " ok" * c, "logprobs": None,
                             "finish_reason": "length", "stop_reason": None}],
                "usage": {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c},
                "kv_transfer_params": None,
            }
            if kv_in.get("do_remote_decode"):
                ans["kv_transfer_params"] = {
                    "do_remote_prefill": True, "do_remote_decode": False,
                    "remote_engine_id": str(uuid.uuid4()),
                    "remote_block_ids": list(range((p + BLOCK_SIZE - 1) // BLOCK_SIZE)),
                    "remote_request_id": rid, "remote_host": "127.0.0.1",
                    "remote_port": side_port, "tp_size": 1}
            self.send(200, ans)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


ROUTER_CODE = r"""
import sys
from vllm_router import Router
port, otlp, pre, dec = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
Router(worker_urls=[], host="127.0.0.1", port=int(port), vllm_pd_disaggregation=True,
       prefill_urls=[(pre, None)], decode_urls=[dec], enable_trace=True,
       otlp_traces_endpoint=otlp, worker_startup_check_interval=1,
       worker_startup_timeout_secs=60, log_level="warning").start()
"""


def post(url, body, headers):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"null")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--router-python", default="/tmp/vr/bin/python")
    ap.add_argument("--out", required=True)
    ap.add_argument("--wait", type=float, default=12.0, help="seconds to wait for the export")
    args = ap.parse_args()

    col = Collector()
    gsrv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(col, gsrv)
    otlp_port = gsrv.add_insecure_port("127.0.0.1:0")
    gsrv.start()

    seen = []
    pre = make_worker("prefill", seen)
    dec = make_worker("decode", seen)
    pre_url = f"http://127.0.0.1:{pre.server_address[1]}"
    dec_url = f"http://127.0.0.1:{dec.server_address[1]}"
    rport = free_port()
    router = subprocess.Popen(
        [args.router_python, "-c", ROUTER_CODE, str(rport), f"http://127.0.0.1:{otlp_port}",
         pre_url, dec_url],
        stdout=subprocess.DEVNULL, stderr=open("/tmp/record_vllm_router.log", "w"),
        start_new_session=True)
    summary = {"otlp_port": otlp_port, "prefill": pre_url, "decode": dec_url}
    try:
        base = f"http://127.0.0.1:{rport}"
        deadline = time.time() + 90
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            if router.poll() is not None or time.time() > deadline:
                raise SystemExit("router did not become ready; see /tmp/record_vllm_router.log")
            time.sleep(0.3)
        seen.clear()
        ok = post(base + "/v1/completions",
                  {"model": MODEL, "prompt": "one two three four", "max_tokens": 8},
                  {"x-request-id": "client-ok-1"})
        rej = post(base + "/v1/completions",
                   {"model": MODEL, "prompt": " ".join(["w"] * 80), "max_tokens": 8},
                   {"x-request-id": "client-rej-1"})
        summary["ok"] = {"status": ok[0], "id": (ok[2] or {}).get("id"),
                         "x-request-id": ok[1].get("x-request-id")}
        summary["rej"] = {"status": rej[0], "x-request-id": rej[1].get("x-request-id"),
                          "body": rej[2]}
        end = time.time() + args.wait
        while time.time() < end:
            time.sleep(0.5)
    finally:
        try:
            os.killpg(router.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            router.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(router.pid, signal.SIGKILL)
        # The batch exporter flushes on shutdown; give it a moment to arrive.
        time.sleep(1.0)
        gsrv.stop(0)
        pre.shutdown()
        dec.shutdown()
    for s in seen:
        if s.get("kv_transfer_params"):
            s["kv_transfer_params"] = {k: ("…" if k == "remote_block_ids" else v)
                                       for k, v in s["kv_transfer_params"].items()}
    summary["worker_requests"] = seen
    with col.lock:
        spans = [l for l in col.lines]
    spans.sort(key=lambda d: int(d.get("startTimeUnixNano", "0")))
    with open(args.out, "w") as f:
        for d in spans:
            f.write(json.dumps(d) + "\n")
    summary["spans"] = [{"name": d["name"], "kind": d.get("kind"),
                         "scope": d["_scope"], "attrs": sorted(a["key"] for a in d.get("attributes", []))}
                        for d in spans]
    json.dump(summary, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
