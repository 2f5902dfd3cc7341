"""`early-exit-router bench-batch`: its subparser and its run function."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from early_exit_router.cli.options import (
    add_load_options,
    add_router_options,
    check_out_folder,
    int_list,
    load_options,
    read_prompts,
    router_overrides,
)
from early_exit_router.models.loading import DEFAULT_MODEL


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    batch = sub.add_parser(
        "bench-batch",
        help="Batched generation against HF batched generate, at several batch sizes, side by side.",
        description="Left-pads the first B prompts into one batch for each batch size and runs plain HF batched "
        "generate, the router in verify mode and in exit mode (batch-synchronous), greedy; reports throughput, "
        "per-request latency and whether each row equals the control's.",
    )
    batch.add_argument("--model", default=DEFAULT_MODEL, help="Alias, saved router folder, HF folder or .gguf.")
    batch.add_argument("--prompts", default=None, help="JSONL: id, category, kind (text|chat), prompt (default: dev).")
    batch.add_argument(
        "--batch-sizes", type=int_list, default=[1, 4, 8, 16], metavar="B1,B2", help="Default: 1,4,8,16."
    )
    batch.add_argument("--max-new-tokens", type=int, default=32, help="New tokens per row (default: 32).")
    batch.add_argument("--repeats", type=int, default=2, help="Repeats per batch size; medians reported (default: 2).")
    batch.add_argument("--out", default=None, help="Write bench-batch.json into this folder.")
    add_load_options(batch)
    add_router_options(batch)


def run(args: argparse.Namespace) -> int:
    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.bench.batch_bench import BatchBenchConfig, run_batch_bench
    from early_exit_router.training.corpus import DEV_PROMPTS

    # The files first: a mistake in them is reported before the model loads and the batches run, not after.
    prompts = read_prompts(args.prompts, DEV_PROMPTS)
    if args.out:
        check_out_folder(args.out)
    router = EarlyExitRouter.from_pretrained(args.model, **load_options(args), **router_overrides(args))
    cfg = BatchBenchConfig(tuple(args.batch_sizes), args.max_new_tokens, args.repeats)
    result = run_batch_bench(router, prompts, cfg)
    print(result.markdown())
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench-batch.json").write_text(json.dumps(result.to_dict(), indent=2))
        print(f"\nwrote {out / 'bench-batch.json'}")
    return 0
