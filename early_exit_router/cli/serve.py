"""`early-exit-router serve`: its subparser and its run function."""

from __future__ import annotations

import argparse
import os

from early_exit_router.cli.options import add_load_options, add_router_options, load_options, router_overrides
from early_exit_router.models.loading import DEFAULT_MODEL


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    server = sub.add_parser(
        "serve",
        help="An OpenAI-compatible HTTP server over the router (needs the 'serve' extra).",
        description="Serves /v1/completions and /v1/chat/completions (with SSE streaming), /v1/models, /health and "
        "/metrics (Prometheus). Listens on localhost unless --host says otherwise. Requests wait in a bounded queue "
        "(a full one answers 503 with Retry-After) and are decoded by one worker, interleaved step by step. Each "
        "request may set its routing in the 'early_exit' field (openai client: extra_body={'early_exit': {...}}).",
    )
    server.add_argument("--model", default=DEFAULT_MODEL, help="Alias, saved router folder, HF folder or .gguf.")
    server.add_argument("--served-model-name", default=None, help="The model id clients send (default: --model).")
    server.add_argument("--host", default="127.0.0.1", help="Interface to listen on (default: 127.0.0.1).")
    server.add_argument("--port", type=_port, default=8000, help="Port (default: 8000).")
    server.add_argument(
        "--api-key",
        default=os.environ.get("EER_API_KEY"),
        help="Require 'Authorization: Bearer KEY' on every path but /health (default: $EER_API_KEY).",
    )
    server.add_argument(
        "--metrics-auth",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="With --api-key, /metrics needs the key too (default: on; --no-metrics-auth leaves it open to a "
        "scraper without the key: it shows load and routing statistics, never request text).",
    )
    server.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="Larger request bodies are refused with 413, never parsed (default: 4194304, 4 MiB).",
    )
    server.add_argument("--max-queue", type=int, default=64, help="Requests that may wait (default: 64).")
    server.add_argument(
        "--max-running", type=int, default=8, help="Requests decoded at once, interleaved (default: 8)."
    )
    server.add_argument("--default-max-tokens", type=int, default=256, help="Chat requests without max_tokens.")
    server.add_argument(
        "--no-batching",
        action="store_true",
        help="Decode every request on its own (interleaved step by step) instead of sharing a batch per mode.",
    )
    add_load_options(server)
    add_router_options(server)


def _port(text: str) -> int:
    """A TCP port, refused while the arguments are parsed: uvicorn finds a bad one only after the model has loaded,
    and fails with a traceback."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in 0..65535 (0: any free port), got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    try:
        from early_exit_router.integrations.server import serve
        from early_exit_router.integrations.server.app import ServerSettings
    except ImportError as exc:
        raise ImportError(
            f"serve needs the 'serve' extra ({exc.name} is missing): pip install 'early-exit-router[serve]'."
        ) from None
    from early_exit_router.api import EarlyExitRouter

    router = EarlyExitRouter.from_pretrained(args.model, **load_options(args), **router_overrides(args))
    limit = {} if args.max_request_bytes is None else {"max_request_bytes": args.max_request_bytes}
    settings = ServerSettings(  # the app measures (or loads) the cost table at start-up, before any request
        model_name=args.served_model_name or args.model,
        api_key=args.api_key or None,
        metrics_require_key=args.metrics_auth,
        **limit,
        max_queue=args.max_queue,
        max_running=args.max_running,
        default_max_tokens=args.default_max_tokens,
        batching=not args.no_batching,
    )
    print(router.describe())
    serve(router, settings, host=args.host, port=args.port)
    return 0
