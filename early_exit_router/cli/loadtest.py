"""`early-exit-router loadtest`: its subparser and its run function."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from early_exit_router.cli.options import (
    add_load_options,
    add_router_options,
    check_out_folder,
    load_options,
    read_prompts,
    router_overrides,
)
from early_exit_router.models.loading import DEFAULT_MODEL


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    load = sub.add_parser(
        "loadtest",
        help="Concurrent streaming clients against the server (routing on and off); checks every response.",
        description="Starts the server in-process on loopback, sends chat requests from N concurrent streaming clients "
        "with the official openai client, once with the router's config and once with routing off, checks that "
        "every (greedy) response equals the same request run alone, and reports throughput and p50/p99 latency.",
    )
    load.add_argument("--model", default=DEFAULT_MODEL, help="Alias, saved router folder, HF folder or .gguf.")
    load.add_argument("--prompts", default=None, help="JSONL: id, category, kind, prompt (default: dev).")
    load.add_argument("--clients", type=int, default=8, help="Concurrent streaming clients (default: 8).")
    load.add_argument("--requests-per-client", type=int, default=2, help="Requests each client sends (default: 2).")
    load.add_argument("--max-tokens", type=int, default=32, help="max_tokens per request (default: 32).")
    load.add_argument("--out", default=None, help="Write loadtest.json into this folder.")
    add_load_options(load)
    add_router_options(load)


def run(args: argparse.Namespace) -> int:
    try:
        from early_exit_router.integrations.server.loadtest import LoadtestConfig, run_loadtest
    except ImportError as exc:
        raise ImportError(f"loadtest needs the 'serve' extra and openai ({exc.name} is missing).") from None
    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.training.corpus import DEV_PROMPTS

    # The files first: a mistake in them is reported before the model loads and the clients run, not after.
    prompts = [p["prompt"] for p in read_prompts(args.prompts, DEV_PROMPTS)]
    if args.out:
        check_out_folder(args.out)
    router = EarlyExitRouter.from_pretrained(args.model, **load_options(args), **router_overrides(args))
    if router.config.policy == "cost":
        router.costs()  # measured (or loaded) before the load, not inside a request
    result = run_loadtest(router, prompts, LoadtestConfig(args.clients, args.requests_per_client, args.max_tokens))
    print(result.markdown())
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "loadtest.json").write_text(json.dumps(result.to_dict(), indent=2))
    return 0 if result.passed else 1
