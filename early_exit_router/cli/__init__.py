"""Command line: `early-exit-router generate ...`. Each command's module adds its own subparser and runs it; the
shared options live in `options`."""

from __future__ import annotations

import argparse
import sys
import warnings
from types import ModuleType

from early_exit_router.cli import (
    adapt_base,
    bench,
    bench_batch,
    calibrate,
    eval_heads,
    export_draft,
    generate,
    loadtest,
    memory,
    profile,
    serve,
    survey,
    train_heads,
)

# Command name -> the module that owns its parser (`add_parser(sub)`) and its body (`run(args)`), in help order.
COMMANDS: dict[str, ModuleType] = {
    "generate": generate,
    "train-heads": train_heads,
    "eval-heads": eval_heads,
    "adapt-base": adapt_base,
    "bench": bench,
    "loadtest": loadtest,
    "bench-batch": bench_batch,
    "profile": profile,
    "survey": survey,
    "memory": memory,
    "calibrate": calibrate,
    "serve": serve,
    "export-draft": export_draft,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="early-exit-router",
        description="One-model early-exit generation for Hugging Face causal LMs, with layer-wise KV filling.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # the command as given, for reports
    warnings.simplefilter("default", UserWarning)  # (torchao's import noise is quieted by the package's import)
    command = COMMANDS.get(args.command)
    if command is None:
        parser.error(f"unknown command {args.command}")
        return 2
    try:
        return command.run(args)
    except (ValueError, OSError, ImportError) as exc:  # OSError: a file that cannot be read or written
        print(f"error: {exc}", file=sys.stderr)
        return 2
