"""`early-exit-router memory`: its subparser and its run function."""

from __future__ import annotations

import argparse
import json
from typing import Any

from early_exit_router.cli.options import add_load_options, add_router_options, load_options, router_overrides
from early_exit_router.models.loading import DEFAULT_MODEL


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    memory = sub.add_parser(
        "memory",
        help="Print the memory budget at a context length: weights, heads, trimmed head, KV cache, workspace.",
        description="Weights and heads are counted from their tensors; the KV cache per position is measured on a "
        "short probe through every layer (sliding-window layers capped at their window). --measure also runs one "
        "routed generation at that context and compares.",
    )
    memory.add_argument("--model", default=DEFAULT_MODEL, help="Alias, saved router folder, HF folder or .gguf.")
    memory.add_argument("--context", type=int, default=2048, help="Positions in the sequence (default: %(default)s).")
    memory.add_argument("--measure", action="store_true", help="Also measure one generation at that context.")
    memory.add_argument("--json", action="store_true", help="Print the budget as JSON.")
    add_load_options(memory)
    add_router_options(memory)


def run(args: argparse.Namespace) -> int:
    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.bench.memory import generation_bytes, memory_budget

    if args.context < 2:
        raise ValueError(f"--context must be at least 2 positions, got {args.context}.")
    router = EarlyExitRouter.from_pretrained(args.model, warm_up=False, **load_options(args), **router_overrides(args))
    budget = memory_budget(router, args.context)
    report: dict[str, Any] = budget.to_dict()
    if args.measure:
        held, peak = generation_bytes(router, args.context)
        report["measured"] = held
        if router.stack.device.type == "cuda":
            report["peak"] = peak
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(router.describe())
    print(budget.markdown())
    if args.measure:
        print(f"\nmeasured: {report['measured'] / 2**20:.2f} MiB ({report['measured'] / budget.total - 1:+.1%})")
        if "peak" in report:
            print(f"allocator peak (the prefill's activations included): {report['peak'] / 2**20:.2f} MiB")
    return 0
