"""`early-exit-router export-draft`: its subparser and its run function."""

from __future__ import annotations

import argparse
import sys

from early_exit_router.cli.options import check_out_folder
from early_exit_router.models.loading import DEFAULT_MODEL


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    export = sub.add_parser(
        "export-draft",
        help="Write one exit (its first layers, norm and LM head with the adapter folded in) as an HF checkpoint.",
        description="Export exit layer E as a standalone HF model of E + 1 layers in the base architecture, for "
        "serving engines that take a separate draft model (vLLM draft_model, SGLang STANDALONE, transformers' "
        "assistant_model; a 'block' head adds its block as layer E + 1), with the base's tokenizer files, and print "
        "the serving commands. The adapter must fold exactly: 'postnorm', 'block', 'residual_block' or 'identity'.",
    )
    export.add_argument("--model", default=DEFAULT_MODEL, help="Alias or saved router folder with the heads.")
    export.add_argument("--exit-layer", type=int, required=True, help="The exit to export (0-based layer index).")
    export.add_argument("--out", required=True, help="Folder for the draft model.")
    export.add_argument(
        "--draft-tokens",
        type=_positive_int,
        default=4,
        help="Tokens the draft proposes per verification in the printed serving commands (vLLM "
        "num_speculative_tokens, SGLang --speculative-num-steps).",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.integrations.export import export_draft

    check_out_folder(args.out)  # before the model loads
    router = EarlyExitRouter.from_pretrained(args.model, warm_up=False)
    print(router.describe(), file=sys.stderr)
    result = export_draft(router, args.exit_layer, args.out)
    print(
        f"wrote {result.path}: {result.num_layers} of {result.base_layers} layers, {result.parameters:,} parameters "
        f"({result.bytes / 2**20:.0f} MiB in {result.dtype}), {result.adapter} adapter folded in"
    )
    snippets = result.serving_snippets(args.draft_tokens)
    print(f"base model (serve the draft beside it): {result.base}")
    print(f"vLLM:         {snippets['vllm']}")
    print(f"vLLM server:  {snippets['vllm_serve']}")
    print(f"SGLang:       {snippets['sglang']}")
    print(f"transformers: {snippets['transformers']}")
    return 0
