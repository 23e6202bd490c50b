"""`python -m sglang_harness otlp-sink --host H --port P --out FILE`: an OTLP/HTTP trace
receiver (`POST /v1/traces`, protobuf) that writes one JSON object per span, so a test can
read what SGLang's tracing module exported (run the workers with
`--enable-trace --otlp-protocol http/protobuf --otlp-endpoint http://H:P/v1/traces`).

Each line: service, scope, name, trace_id, span_id, parent_span_id, start/end ns, status code,
attributes (string/int/bool/double values), event names and the number of links.

`--grpc-port P` also takes OTLP/gRPC exports (`TraceService/Export`, e.g. smg's
`--enable-trace --otlp-traces-endpoint H:P`), written and forwarded the same way (as
OTLP/HTTP protobuf: the message is the same); a refusal downstream is answered UNAVAILABLE.

`--forward URL` (repeatable) also posts every export, as received, to another OTLP/HTTP
receiver (revenant's `/v1/traces`) and answers the exporter with that receiver's status (the
first refusal among several), so a refusal there (429, 503) makes SGLang's exporter retry as
it would against the receiver itself.
"""

import json
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def spans_of(body: bytes):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    for rs in req.resource_spans:
        service = next(
            (_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), None
        )
        for ss in rs.scope_spans:
            for s in ss.spans:
                yield {
                    "service": service,
                    "scope": ss.scope.name,
                    "name": s.name,
                    "trace_id": s.trace_id.hex(),
                    "span_id": s.span_id.hex(),
                    "parent_span_id": s.parent_span_id.hex(),
                    "start_ns": s.start_time_unix_nano,
                    "end_ns": s.end_time_unix_nano,
                    "status": s.status.code,
                    "attributes": {a.key: _value(a.value) for a in s.attributes},
                    "events": [e.name for e in s.events],
                    "links": len(s.links),
                }


def forward(url: str, body: bytes, content_type: str) -> int:
    """POSTs an export as received; the receiver's HTTP status (502 when unreachable)."""
    req = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": content_type}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 502


def serve(host: str, port: int, out: str, forward_to=(), grpc_port: int = 0) -> None:
    if isinstance(forward_to, str):
        forward_to = [forward_to]
    lock = threading.Lock()
    sink = open(out, "a", buffering=1)

    def take(body: bytes, content_type: str):
        """Writes an export's spans and forwards it; the status to answer (None: not OTLP)."""
        try:
            spans = list(spans_of(body))
        except Exception:
            return None
        with lock:
            for s in spans:
                sink.write(json.dumps(s, sort_keys=True) + "\n")
            sink.flush()
        status = 200
        for url in forward_to or ():
            got = forward(url, body, content_type)
            if status < 300 <= got:
                status = got
        return status

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            status = take(body, self.headers.get("Content-Type", "application/x-protobuf"))
            if status is None:
                self.send_response(400)
                self.end_headers()
                return
            self.send_response(status)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self):
            # Readiness.
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    ready = f"READY otlp-sink http://{host}:{port}/v1/traces"
    # Kept referenced: a gRPC server that is garbage-collected stops.
    grpc_server = serve_grpc(host, grpc_port, take) if grpc_port else None
    if grpc_server is not None:
        ready += f" grpc {host}:{grpc_port}"
    print(ready, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        if grpc_server is not None:
            grpc_server.stop(0)
        sys.exit(0)


def serve_grpc(host: str, port: int, take):
    """OTLP/gRPC `TraceService/Export` on `host:port`, handled by `take` (raw protobuf in, an
    empty `ExportTraceServiceResponse` out)."""
    from concurrent import futures

    import grpc

    def export(body: bytes, context):
        status = take(body, "application/x-protobuf")
        if status is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not an ExportTraceServiceRequest")
        if status >= 300:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"downstream answered {status}")
        return b""

    handler = grpc.method_handlers_generic_handler(
        "opentelemetry.proto.collector.trace.v1.TraceService",
        {"Export": grpc.unary_unary_rpc_method_handler(export)},
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server
