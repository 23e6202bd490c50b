"""python -m sglang_harness worker ... | model-dir DIR | otlp-sink ..."""

import argparse
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(prog="sglang_harness")
    sub = p.add_subparsers(dest="command", required=True)
    from . import worker

    worker.add_arguments(sub.add_parser("worker", help="run a prefill or decode worker"))
    md = sub.add_parser("model-dir", help="write the tiny model directory (for smg)")
    md.add_argument("dir")
    sink = sub.add_parser("otlp-sink", help="an OTLP/HTTP span sink writing JSON Lines")
    sink.add_argument("--host", default="127.0.0.1")
    sink.add_argument("--port", type=int, required=True)
    sink.add_argument("--out", required=True)
    sink.add_argument(
        "--forward",
        action="append",
        default=[],
        help="also post every export to this OTLP/HTTP traces URL (revenant's); repeatable",
    )
    sink.add_argument(
        "--grpc-port", type=int, default=0, help="also take OTLP/gRPC exports on this port"
    )
    args = p.parse_args()
    if args.command == "worker":
        worker.run(args)
    elif args.command == "otlp-sink":
        from . import otlp_sink

        otlp_sink.serve(args.host, args.port, args.out, args.forward, args.grpc_port)
    else:
        from . import model_dir

        print(model_dir.write(Path(args.dir)))


if __name__ == "__main__":
    main()
