"""Ground truth from the worker's HTTP process: each request it got on a generate route and how
it was answered, next to the scheduler's records in the same truth log.

The scheduler never sees a request SGLang's tokenizer manager refused (the context-length
check answers from the HTTP process), and neither knows the client's `x-request-id` (SGLang
reads no such header). This observer does, without changing what SGLang does: a pure ASGI
middleware that reads the request body (and hands the same messages to SGLang's app), and
looks at the response as it goes out.

Records (`role`, `pid` of the HTTP process):
- `http_received`: `path`, `request_id` (the `x-request-id` header), `rooms` (the body's
  `bootstrap_room`, a list), `rid`, `bootstrap_host`, `stream`.
- `http_answered`: the same ids, `status`, `error_code` (the code of an error a 200 stream
  carries: `data: {"error": {..., "code": N}}`, or a chunk whose `meta_info.finish_reason` is
  an abort with a `status_code`; 0 when none) and `complete` (false when the response never
  finished, e.g. the client went away), at the time the answer ended; `head_ns`: when the
  response's status line was handed to the server (0 when none was), before it reached the wire.
"""

import json
import time

GENERATE_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


def stream_error_code(line: bytes) -> int:
    """The error code one SSE line carries, or 0."""
    if not line.startswith(b"data: "):
        return 0
    try:
        v = json.loads(line[6:])
    except ValueError:
        return 0
    if not isinstance(v, dict):
        return 0
    err = v.get("error")
    if isinstance(err, dict):
        code = err.get("code")
        return code if isinstance(code, int) else 400
    fr = (v.get("meta_info") or {}).get("finish_reason")
    if isinstance(fr, dict) and fr.get("type") == "abort":
        code = fr.get("status_code")
        if isinstance(code, int):
            return code
    return 0


def _ids(body: bytes) -> dict:
    try:
        v = json.loads(body) if body else {}
    except ValueError:
        return {}
    if not isinstance(v, dict):
        return {}
    room = v.get("bootstrap_room")
    rooms = room if isinstance(room, list) else ([] if room is None else [room])
    return {
        "rooms": rooms,
        "rid": v.get("rid"),
        "bootstrap_host": v.get("bootstrap_host"),
        "stream": bool(v.get("stream")),
    }


class HttpTruth:
    """ASGI middleware: `app.add_middleware(HttpTruth, truth=TruthLog(...))`."""

    def __init__(self, app, truth):
        self.app = app
        self.truth = truth

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or scope.get("path") not in GENERATE_PATHS
        ):
            await self.app(scope, receive, send)
            return
        # The whole body first (a few KB at most), then the same messages for SGLang's app;
        # after them `receive` is SGLang's own, so its disconnect checks see the client.
        buffered = []
        body = b""
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        ids = _ids(body)
        ids["path"] = scope["path"]
        ids["request_id"] = headers.get("x-request-id")
        self.truth.emit("http_received", **ids)

        async def replay():
            if buffered:
                return buffered.pop(0)
            return await receive()

        state = {"status": 0, "error_code": 0, "carry": b"", "done": False, "head_ns": 0}

        async def observe(message):
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                # Stamped before the server has it: the head reaches the wire after this.
                state["head_ns"] = time.time_ns()
            elif message["type"] == "http.response.body":
                if state["status"] == 200 and not state["error_code"]:
                    lines = (state["carry"] + message.get("body", b"")).split(b"\n")
                    state["carry"] = lines.pop()[-65536:]
                    for line in lines:
                        code = stream_error_code(line.strip())
                        if code:
                            state["error_code"] = code
                            break
                if not message.get("more_body") and not state["done"]:
                    state["done"] = True
                    self.truth.emit(
                        "http_answered",
                        status=state["status"],
                        error_code=state["error_code"],
                        head_ns=state["head_ns"],
                        complete=True,
                        **ids,
                    )
            await send(message)

        try:
            await self.app(scope, replay, observe)
        finally:
            if not state["done"]:
                self.truth.emit(
                    "http_answered",
                    status=state["status"],
                    error_code=state["error_code"],
                    head_ns=state["head_ns"],
                    complete=False,
                    **ids,
                )
