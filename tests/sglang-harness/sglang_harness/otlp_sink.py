"""`python -m sglang_harness otlp-sink --host H --port P --out FILE`: an OTLP/HTTP trace
receiver (`POST /v1/traces`, protobuf) that writes one JSON object per span, so a test can
read what SGLang's tracing module exported (run the workers with
`--enable-trace --otlp-protocol http/protobuf --otlp-endpoint http://H:P/v1/traces`).

Each line: service, scope, name, trace_id, span_id, parent_span_id, start/end ns, status code,
attributes (string/int/bool/double values), event names and the number of links.

`--forward URL` also posts every export, as received, to another OTLP/HTTP receiver (revenant's
`/v1/traces`) and answers the exporter with that receiver's status, so a refusal there (429,
503) makes SGLang's exporter retry as it would against the receiver itself.
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


def serve(host: str, port: int, out: str, forward_to: str = None) -> None:
    lock = threading.Lock()
    sink = open(out, "a", buffering=1)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            try:
                spans = list(spans_of(body))
            except Exception:
                self.send_response(400)
                self.end_headers()
                return
            with lock:
                for s in spans:
                    sink.write(json.dumps(s, sort_keys=True) + "\n")
                sink.flush()
            status = 200
            if forward_to:
                status = forward(
                    forward_to,
                    body,
                    self.headers.get("Content-Type", "application/x-protobuf"),
                )
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
    print(f"READY otlp-sink http://{host}:{port}/v1/traces", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        sys.exit(0)
