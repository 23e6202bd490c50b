"""Emit SGLang- and smg-shaped traces with the real OpenTelemetry Python SDK into `revenant run`.

Span shapes follow the real captures in shared/fixtures/sglang-router-0.3.2: SGLang roots
"{role} Req {rid[:8]}" carry `rid` and a hex `bootstrap_room`; the abort (ERROR status +
`reason`) sits on the scheduler thread span below; children end (so are exported) before their
root. The router span is smg's `http_request` with `request_id` and a string `status_code`.

Scenarios (--scenario):
  reject-then-decode  prefill rejects an attempt for capacity, yet its decode leg receives KV
                      and decodes (the sglang-router 0.3.2 bug); the router answers 400.
  retry-storm         one client request (one trace, one x-request-id) whose --count attempts each
                      get a new room and rid; prefill rejects every attempt and each decode leg
                      still works: one fingerprint, --count violations (gRPC / HTTP protobuf only).
  failed-then-decode  one trace: prefill rejects the attempt, the router answers the client 400
                      at once, and the decode leg still receives KV and decodes 200 ms later: both
                      activity-after-rejection and activity-after-request-failed, one request
                      (gRPC / HTTP protobuf only).
  backpressure        N router spans, one export each, while revenant's pipeline is paused:
                      the SDK must see retryable errors, and every export must succeed in the end.
Transport (--transport): grpc | http-protobuf | http-json (fixture-shaped JSON via urllib).
--secure: TLS, configured by the OTEL_EXPORTER_OTLP_* environment (CERTIFICATE, CLIENT_KEY,
CLIENT_CERTIFICATE, HEADERS) as a deployment would.

Prints one JSON object on stdout: what was sent (ids) and what the exporter saw.
"""

import argparse
import base64
import json
import logging
import os
import sys
import time
import urllib.request

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.trace import Status, StatusCode, set_span_in_context

MS = 1_000_000


class TransientCounter(logging.Handler):
    """Counts the exporters' 'retrying' warnings: the SDK saw a retryable status."""

    def __init__(self, marker):
        super().__init__()
        self.count = 0
        self.marker = marker
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())
        msg = record.getMessage().lower()
        if "transient" in msg or "retrying" in msg or "retry" in msg:
            self.count += 1
            if self.marker and self.count == 1:
                with open(self.marker, "w") as f:
                    f.write("1")


class RecordingExporter:
    """Wraps the real exporter to record each export's result."""

    def __init__(self, inner):
        self.inner = inner
        self.results = []

    def export(self, spans):
        r = self.inner.export(spans)
        self.results.append(r.name)
        return r

    def shutdown(self):
        self.inner.shutdown()

    def force_flush(self, timeout_millis=30000):
        return True


def make_exporter(args):
    # --secure: https endpoints, and everything else (CA, client certificate, the token header)
    # from the OTEL_EXPORTER_OTLP_* environment, as a deployment configures the exporters.
    if args.transport == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        if args.secure:
            return OTLPSpanExporter(endpoint=f"https://{args.grpc}", timeout=args.timeout)
        return OTLPSpanExporter(endpoint=args.grpc, insecure=True, timeout=args.timeout)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    scheme = "https" if args.secure else "http"
    return OTLPSpanExporter(endpoint=f"{scheme}://{args.http}/v1/traces", timeout=args.timeout)


def provider(args, service, host, exporters):
    exp = RecordingExporter(make_exporter(args))
    exporters.append(exp)
    tp = TracerProvider(resource=Resource.create({"service.name": service, "host.name": host}))
    # SimpleSpanProcessor exports each span as it ends: children strictly before their root.
    tp.add_span_processor(SimpleSpanProcessor(exp))
    return tp


def sglang_leg(tp, role, rid, room, t0, steps, error_reason=None, host="h", parent=None):
    """One SGLang worker leg: root, thread span, stage slices at offsets (ms) from t0.
    `parent`: the router's span context, propagated as SGLang does with traceparent."""
    tracer = tp.get_tracer("sglang server")
    root = tracer.start_span(
        f"{role} Req {rid[:8]}",
        context=parent,
        start_time=t0,
        attributes={"rid": rid, "bootstrap_room": hex(room), "module": "sglang::request"},
    )
    label = "Prefill Scheduler" if role == "prefill" else "Decode Scheduler"
    th = tracer.start_span(
        f"{label} [TP 0] (host:{host[:8]} | pid:4242)",
        context=set_span_in_context(root),
        start_time=t0 + 1 * MS,
        attributes={"tp_rank": 0, "host_id": host, "pid": 4242, "thread_label": label},
    )
    end = t0 + 2 * MS
    for name, a, b in steps:
        s = tracer.start_span(name, context=set_span_in_context(th), start_time=t0 + a * MS)
        s.end(end_time=t0 + b * MS)
        end = max(end, t0 + b * MS)
    if error_reason:
        th.set_attribute("reason", error_reason)
        th.set_status(Status(StatusCode.ERROR))
    th.end(end_time=end + 1 * MS)
    root.end(end_time=end + 2 * MS)
    return end + 1 * MS


def router_span(tp, request_id, status, t0, dispatch=True):
    tracer = tp.get_tracer("smg")
    s = tracer.start_span(
        "http_request",
        start_time=t0,
        attributes={"method": "POST", "uri": "/generate", "module": "smg", "request_id": request_id},
    )
    if dispatch:
        s.add_event(
            "Sending concurrent requests",
            {"prefill_url": "http://127.0.0.1:31001", "decode_url": "http://127.0.0.1:31002"},
            timestamp=t0 + 1 * MS,
        )
    s.set_attribute("status_code", str(status))
    s.end(end_time=t0 + 3 * MS)


def reject_then_decode(args):
    exporters = []
    t0 = time.time_ns()
    rid = "8f3c2b1a9d7e4f60a1b2c3d4e5f6" + args.tag
    room = 0x314783F6BEF70000 + int(args.tag, 16)
    request_id = f"e2e-{args.transport}-{args.tag}"
    p = provider(args, "sglang", "prefill-node", exporters)
    d = provider(args, "sglang", "decode-node", exporters)
    r = provider(args, "smg", "router-node", exporters)
    reason = f"Request {rid} exceeds the maximum number of tokens: 9000 > 8192"
    rejected_at = sglang_leg(p, "prefill", rid, room, t0, [("prefill_prepare", 2, 3)], error_reason=reason, host="prefill-node")
    # The decode leg was sent at the same moment and is not cancelled: 200 ms after the
    # rejection it still receives KV and decodes (well beyond the checker's clock skew).
    dt = rejected_at + 200 * MS
    sglang_leg(d, "decode", rid, room, t0, [("decode_bootstrap", 1, 2), ("decode_transferred", (dt - t0) // MS, (dt - t0) // MS + 5), ("decode_loop", (dt - t0) // MS + 5, (dt - t0) // MS + 20)], host="decode-node")
    router_span(r, request_id, 400, t0)
    for tp in (p, d, r):
        tp.shutdown()
    return {"rid": rid, "room": room, "request_id": request_id, "results": [x for e in exporters for x in e.results]}


def retry_storm(args):
    exporters = []
    t0 = time.time_ns()
    request_id = f"storm-{args.transport}-{args.tag}"
    p = provider(args, "sglang", "prefill-node", exporters)
    d = provider(args, "sglang", "decode-node", exporters)
    r = provider(args, "smg", "router-node", exporters)
    router = r.get_tracer("smg").start_span(
        "http_request",
        start_time=t0,
        attributes={"method": "POST", "uri": "/generate", "module": "smg", "request_id": request_id},
    )
    ctx = set_span_in_context(router)
    attempts = []
    end = t0
    for i in range(args.count):
        ta = t0 + i * 300 * MS
        rid = f"{args.tag}{i:04x}" + "5a" * 12
        room = 0x5EED000000000000 + (int(args.tag, 16) << 16) + i
        reason = f"Request {rid} exceeds the maximum number of tokens: 9000 > 8192"
        router.add_event("Sending concurrent requests", {"prefill_url": "http://127.0.0.1:31001", "decode_url": "http://127.0.0.1:31002"}, timestamp=ta + MS)
        rejected_at = sglang_leg(p, "prefill", rid, room, ta, [("prefill_prepare", 2, 3)], error_reason=reason, host="prefill-node", parent=ctx)
        dt = rejected_at + 200 * MS
        end = sglang_leg(d, "decode", rid, room, ta, [("decode_bootstrap", 1, 2), ("decode_transferred", (dt - ta) // MS, (dt - ta) // MS + 5), ("decode_loop", (dt - ta) // MS + 5, (dt - ta) // MS + 20)], host="decode-node", parent=ctx)
        attempts.append({"rid": rid, "room": room})
    router.set_attribute("status_code", "400")
    router.end(end_time=end + 5 * MS)
    for tp in (p, d, r):
        tp.shutdown()
    return {"request_id": request_id, "trace_id": format(router.get_span_context().trace_id, "032x"), "attempts": attempts, "results": [x for e in exporters for x in e.results]}


def failed_then_decode(args):
    exporters = []
    t0 = time.time_ns()
    request_id = f"failed-{args.transport}-{args.tag}"
    rid = f"{args.tag}" + "fd" * 14
    room = 0xFA11ED0000000000 + int(args.tag, 16)
    p = provider(args, "sglang", "prefill-node", exporters)
    d = provider(args, "sglang", "decode-node", exporters)
    r = provider(args, "smg", "router-node", exporters)
    router = r.get_tracer("smg").start_span(
        "http_request",
        start_time=t0,
        attributes={"method": "POST", "uri": "/generate", "module": "smg", "request_id": request_id},
    )
    ctx = set_span_in_context(router)
    router.add_event("Sending concurrent requests", {"prefill_url": "http://127.0.0.1:31001", "decode_url": "http://127.0.0.1:31002"}, timestamp=t0 + MS)
    reason = f"Request {rid} exceeds the maximum number of tokens: 9000 > 8192"
    rejected_at = sglang_leg(p, "prefill", rid, room, t0, [("prefill_prepare", 2, 3)], error_reason=reason, host="prefill-node", parent=ctx)
    # The router fails the request as soon as prefill rejects it; the decode leg goes on.
    router.set_attribute("status_code", "400")
    router.end(end_time=rejected_at + 1 * MS)
    dt = rejected_at + 200 * MS
    sglang_leg(d, "decode", rid, room, t0, [("decode_bootstrap", 1, 2), ("decode_transferred", (dt - t0) // MS, (dt - t0) // MS + 5), ("decode_loop", (dt - t0) // MS + 5, (dt - t0) // MS + 20)], host="decode-node", parent=ctx)
    for tp in (p, d, r):
        tp.shutdown()
    return {"rid": rid, "room": room, "request_id": request_id, "trace_id": format(router.get_span_context().trace_id, "032x"), "results": [x for e in exporters for x in e.results]}


def backpressure(args):
    exporters = []
    r = provider(args, "smg", "router-node", exporters)
    ids = []
    t0 = time.time_ns()
    for i in range(args.count):
        rid = f"bp-{args.transport}-{i}"
        ids.append(rid)
        router_span(r, rid, 200, t0 + i * 10 * MS, dispatch=False)
    r.shutdown()
    return {"request_ids": ids, "results": [x for e in exporters for x in e.results]}


def oversized(args):
    """One span far over the receiver's --max-message-bytes: a permanent refusal."""
    exporters = []
    tp = provider(args, "smg", "router-node", exporters)
    span = tp.get_tracer("emit").start_span("big", attributes={"blob": "x" * 8000})
    span.end()
    tp.shutdown()
    return {"results": [x for e in exporters for x in e.results]}


# ---- OTLP/JSON over urllib, in the fixture's shape (base64 ids, enum names, string ints) ----


def b64(n, width):
    return base64.b64encode(n.to_bytes(width, "big")).decode()


def json_span(trace_id, span_id, parent, name, start, end, attrs, error=False):
    s = {
        "traceId": b64(trace_id, 16),
        "spanId": b64(span_id, 8),
        "name": name,
        "kind": "SPAN_KIND_INTERNAL",
        "startTimeUnixNano": str(start),
        "endTimeUnixNano": str(end),
        "attributes": [
            {"key": k, "value": {"intValue": str(v)} if isinstance(v, int) else {"stringValue": v}}
            for k, v in attrs.items()
        ],
        "status": {"code": "STATUS_CODE_ERROR"} if error else {},
    }
    if parent:
        s["parentSpanId"] = b64(parent, 8)
    return s


def post_json(args, service, host, scope, spans):
    doc = {
        "resourceSpans": [
            {
                "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": service}}, {"key": "host.name", "value": {"stringValue": host}}]},
                "scopeSpans": [{"scope": {"name": scope}, "spans": spans}],
            }
        ]
    }
    req = urllib.request.Request(f"http://{args.http}/v1/traces", data=json.dumps(doc).encode(), headers={"Content-Type": "application/json"})
    for attempt in range(20):
        try:
            with urllib.request.urlopen(req, timeout=args.timeout) as resp:
                return resp.status
        except urllib.error.HTTPError as e:
            if e.code in (429, 503):
                time.sleep(float(e.headers.get("Retry-After", "1")))
                continue
            return e.code
    return 503


def reject_then_decode_json(args):
    t0 = time.time_ns()
    rid = "8f3c2b1a9d7e4f60a1b2c3d4e5f6" + args.tag
    room = 0x314783F6BEF70000 + int(args.tag, 16)
    request_id = f"e2e-{args.transport}-{args.tag}"
    tp, td, tr = int.from_bytes(os.urandom(16), "big"), int.from_bytes(os.urandom(16), "big"), int.from_bytes(os.urandom(16), "big")
    reason = f"Request {rid} exceeds the maximum number of tokens: 9000 > 8192"
    # Children first, as SGLang exports them; the root's parent is a remote span not sent.
    prefill = [
        json_span(tp, 3, 2, "prefill_prepare", t0 + 2 * MS, t0 + 3 * MS, {}),
        json_span(tp, 2, 1, "Prefill Scheduler [TP 0] (host:prefill- | pid:4242)", t0 + 1 * MS, t0 + 4 * MS, {"thread_label": "Prefill Scheduler", "pid": 4242, "reason": reason}, error=True),
        json_span(tp, 1, 99, f"prefill Req {rid[:8]}", t0, t0 + 5 * MS, {"rid": rid, "bootstrap_room": hex(room)}),
    ]
    dt = t0 + 204 * MS
    decode = [
        json_span(td, 3, 2, "decode_transferred", dt, dt + 5 * MS, {}),
        json_span(td, 4, 2, "decode_loop", dt + 5 * MS, dt + 20 * MS, {}),
        json_span(td, 2, 1, "Decode Scheduler [TP 0] (host:decode-n | pid:4243)", t0 + 1 * MS, dt + 21 * MS, {"thread_label": "Decode Scheduler", "pid": 4243}),
        json_span(td, 1, 0, f"decode Req {rid[:8]}", t0, dt + 22 * MS, {"rid": rid, "bootstrap_room": hex(room)}),
    ]
    router = json_span(tr, 1, 0, "http_request", t0, t0 + 3 * MS, {"request_id": request_id, "status_code": "400", "uri": "/generate"})
    router["events"] = [{"timeUnixNano": str(t0 + MS), "name": "Sending concurrent requests", "attributes": [{"key": "prefill_url", "value": {"stringValue": "http://127.0.0.1:31001"}}, {"key": "decode_url", "value": {"stringValue": "http://127.0.0.1:31002"}}]}]
    codes = [
        post_json(args, "sglang", "prefill-node", "sglang server", prefill),
        post_json(args, "sglang", "decode-node", "sglang server", decode),
        post_json(args, "smg", "router-node", "smg", [router]),
    ]
    return {"rid": rid, "room": room, "request_id": request_id, "results": ["SUCCESS" if c == 200 else f"HTTP {c}" for c in codes]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grpc")
    ap.add_argument("--http")
    ap.add_argument("--transport", choices=["grpc", "http-protobuf", "http-json"], required=True)
    ap.add_argument("--scenario", choices=["reject-then-decode", "retry-storm", "failed-then-decode", "backpressure", "oversized"], required=True)
    ap.add_argument("--tag", default="0001", help="4 hex digits making rid/room unique per run")
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--timeout", type=int, default=30)
    ap.add_argument("--transient-marker", help="file created when the first retryable error is seen")
    ap.add_argument("--secure", action="store_true", help="TLS; CA, client certificate and headers from OTEL_EXPORTER_OTLP_*")
    args = ap.parse_args()

    counter = TransientCounter(args.transient_marker)
    for name in ("opentelemetry.exporter.otlp.proto.grpc.exporter", "opentelemetry.exporter.otlp.proto.http.trace_exporter", "opentelemetry.exporter.otlp.proto.http"):
        lg = logging.getLogger(name)
        lg.addHandler(counter)
        lg.setLevel(logging.DEBUG)

    if args.scenario == "reject-then-decode":
        out = reject_then_decode_json(args) if args.transport == "http-json" else reject_then_decode(args)
    elif args.scenario == "retry-storm":
        out = retry_storm(args)
    elif args.scenario == "failed-then-decode":
        out = failed_then_decode(args)
    elif args.scenario == "oversized":
        out = oversized(args)
    else:
        out = backpressure(args)
    out["transient_errors"] = counter.count
    out["exporter_log"] = counter.messages
    print(json.dumps(out))
    return 0 if all(r == "SUCCESS" for r in out["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
