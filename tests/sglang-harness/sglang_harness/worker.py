"""`python -m sglang_harness worker`: one SGLang 0.5.23 PD worker (prefill or decode) whose
scheduler process is played by `scheduler.py`.

Everything but the scheduler process is SGLang's: `launch_server`
(srt/entrypoints/http_server.py) starts the FastAPI/uvicorn HTTP server, the
`TokenizerManager` (which on prefill also starts the bootstrap server,
srt/managers/disagg_service.py), the `DetokenizerManager` process, and SGLang's own warmup.
"""

import argparse
import os
import sys
from pathlib import Path

from . import model_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--host", default="127.0.0.1", help="HTTP, ZMQ and Mooncake address")
    p.add_argument("--port", type=int, required=True, help="HTTP port")
    p.add_argument(
        "--bootstrap-port",
        type=int,
        default=8998,
        help="prefill's bootstrap server port (--disaggregation-bootstrap-port)",
    )
    p.add_argument("--context-length", type=int, required=True)
    p.add_argument("--kv-pages", type=int, default=512, help="KV pool size in pages")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--metadata-slots", type=int, default=64, help="metadata buffer rows")
    p.add_argument(
        "--decode-allocation-policy",
        choices=["early", "prefill_complete"],
        default="early",
        help="--disaggregation-decode-allocation-policy",
    )
    p.add_argument(
        "--intake-reject",
        choices=["fixed", "stub"],
        default="fixed",
        help="prefill: fixed = 0.5.21+ (an intake reject gets no sender); stub = <= 0.5.20 "
        "(it bootstraps and transfers a one-token stub, then answers 400)",
    )
    p.add_argument("--enable-trace", action="store_true")
    p.add_argument(
        "--otlp-endpoint",
        default="localhost:4317",
        help="--otlp-traces-endpoint: host:port for gRPC, a URL for http/protobuf",
    )
    p.add_argument("--otlp-protocol", choices=["grpc", "http/protobuf"], default="grpc")
    p.add_argument("--trace-modules", default="request,mooncake")
    p.add_argument(
        "--waiting-timeout",
        type=int,
        default=None,
        help="SGLANG_DISAGGREGATION_WAITING_TIMEOUT seconds (SGLang: 300)",
    )
    p.add_argument(
        "--bootstrap-timeout",
        type=int,
        default=None,
        help="SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT seconds (SGLang: 300)",
    )
    p.add_argument("--no-warmup", action="store_true", help="--skip-server-warmup")
    p.add_argument(
        "--truth-log", default=None, help="JSON Lines file of what happened per room"
    )
    p.add_argument(
        "--model-dir",
        default=None,
        help="the tiny model directory (written if missing; default: a temp dir)",
    )
    p.add_argument("--forward-ms", type=float, default=2.0, help="played prefill forward")
    p.add_argument("--decode-step-ms", type=float, default=5.0, help="played decode step")
    p.add_argument("--log-level", default="warning")


def run(args: argparse.Namespace) -> None:
    # Environment first: SGLang reads these at import time and in spawned children.
    env = os.environ
    # Every socket of this worker (scheduler ZMQ PULL, Mooncake TE) binds args.host.
    env["SGLANG_HOST_IP"] = args.host
    env["MOONCAKE_PROTOCOL"] = "tcp"
    if args.waiting_timeout is not None:
        env["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] = str(args.waiting_timeout)
    if args.bootstrap_timeout is not None:
        env["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"] = str(args.bootstrap_timeout)
    if args.enable_trace:
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = args.otlp_protocol
    env["SGLANG_HARNESS_KV_PAGES"] = str(args.kv_pages)
    env["SGLANG_HARNESS_METADATA_SLOTS"] = str(args.metadata_slots)
    env["SGLANG_HARNESS_INTAKE_REJECT"] = args.intake_reject
    env["SGLANG_HARNESS_FORWARD_MS"] = str(args.forward_ms)
    env["SGLANG_HARNESS_DECODE_STEP_MS"] = str(args.decode_step_ms)
    if args.truth_log:
        env["SGLANG_HARNESS_TRUTH_LOG"] = os.path.abspath(args.truth_log)
    # The spawned scheduler process imports this package by name.
    here = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    if here not in sys.path:
        sys.path.insert(0, here)

    if args.model_dir:
        mdir = model_dir.write(Path(args.model_dir))
    else:
        import tempfile

        mdir = model_dir.write(Path(tempfile.mkdtemp(prefix="sglang-harness-model-")))

    from sglang.srt.entrypoints.http_server import app, launch_server
    from sglang.srt.server_args import ServerArgs

    from .scheduler import run_scheduler_process

    if args.truth_log:
        # The HTTP process's side of the ground truth (requests the tokenizer refused, the
        # client's x-request-id, what each request was answered), in the same log.
        from .http_truth import HttpTruth
        from .truth import TruthLog

        app.add_middleware(
            HttpTruth, truth=TruthLog(os.path.abspath(args.truth_log), args.role)
        )

    server_args = ServerArgs(
        model_path=str(mdir),
        device="cpu",
        host=args.host,
        port=args.port,
        context_length=args.context_length,
        page_size=args.page_size,
        disaggregation_mode=args.role,
        disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=args.bootstrap_port,
        disaggregation_decode_allocation_policy=args.decode_allocation_policy,
        enable_trace=args.enable_trace,
        otlp_traces_endpoint=args.otlp_endpoint,
        trace_modules=args.trace_modules,
        skip_server_warmup=args.no_warmup,
        log_level=args.log_level,
    )
    try:
        launch_server(server_args, run_scheduler_process_func=run_scheduler_process)
    except BaseException:
        # A scheduler that died at start leaves the detokenizer (and the bootstrap
        # server thread) running: take the whole tree down, as SGLang's launcher does.
        from sglang.srt.utils import kill_process_tree

        import traceback

        traceback.print_exc()
        kill_process_tree(os.getpid(), include_parent=False)
        os._exit(1)
