"""vllm-router with OTLP tracing on.

vllm-router's command line has no tracing flag; its Python API does
(`Router(enable_trace=True, otlp_traces_endpoint="host:port")`). This launcher takes the
endpoint (or `off`: no tracing, exactly as the `vllm-router` command), then exactly the
`vllm-router` command line, and starts the router as its own launcher does (the process
retitles itself `vllm::router`).

    python vllm_router_traced.py 127.0.0.1:4317 --host 127.0.0.1 --port 8000 \
        --vllm-pd-disaggregation --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
"""

import sys

import setproctitle
from vllm_router.launch_router import parse_router_args
from vllm_router.router import Router


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: vllm_router_traced.py OTLP_ENDPOINT|off [vllm-router arguments...]")
    endpoint = sys.argv[1]
    args = parse_router_args(sys.argv[2:])
    args._validate_router_args()
    if endpoint != "off":
        args.enable_trace = True
        args.otlp_traces_endpoint = endpoint
    setproctitle.setproctitle("vllm::router")
    Router.from_args(args).start()


if __name__ == "__main__":
    main()
