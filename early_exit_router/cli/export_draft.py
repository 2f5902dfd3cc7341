"""`early-exit-router export-draft`: its subparser and its run function."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from early_exit_router.cli.options import check_out_folder
from early_exit_router.integrations.gguf_export import TENSOR_TYPES
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
    export.add_argument("--out", required=True, help="Folder for the draft model (with --gguf: a .gguf file).")
    export.add_argument(
        "--gguf",
        action="store_true",
        help="Write the draft as one GGUF file for llama.cpp's speculative decoding (-md), with the tokenizer "
        "copied from the base's GGUF (Llama, Mistral and Qwen2 layouts).",
    )
    export.add_argument(
        "--vocab-gguf",
        help="With --gguf: the base model's GGUF (the target llama.cpp serves) to copy the tokenizer from; "
        "default: the GGUF the base was loaded from.",
    )
    export.add_argument(
        "--gguf-type", choices=list(TENSOR_TYPES), default="f16", help="With --gguf: the matrices' type (f16)."
    )
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

    if args.gguf:
        _check_gguf_options(args)
    elif args.vocab_gguf is not None or args.gguf_type != "f16":
        raise ValueError("--vocab-gguf and --gguf-type apply to a GGUF draft: add --gguf.")
    else:
        check_out_folder(args.out)  # before the model loads
    router = EarlyExitRouter.from_pretrained(args.model, warm_up=False)
    print(router.describe(), file=sys.stderr)
    return _export_gguf(router, args) if args.gguf else _export_folder(router, args)


def _check_gguf_options(args: argparse.Namespace) -> None:
    out = Path(args.out)
    if out.suffix != ".gguf" or out.is_dir():
        raise ValueError(f"--out {args.out}: with --gguf, give a file name ending in .gguf.")
    check_out_folder(str(out.parent))
    if args.vocab_gguf is not None and not Path(args.vocab_gguf).is_file():
        raise ValueError(f"--vocab-gguf {args.vocab_gguf}: no such file; give the base model's GGUF.")


def _export_folder(router: object, args: argparse.Namespace) -> int:
    from early_exit_router.integrations.export import export_draft

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
    print("memory each engine sets aside for the draft:")
    for engine, note in result.engine_memory().items():
        print(f"  {engine}: {note}")
    return 0


def _export_gguf(router: object, args: argparse.Namespace) -> int:
    from early_exit_router.integrations.gguf_export import export_gguf_draft

    result = export_gguf_draft(
        router, args.exit_layer, args.out, vocab_gguf=args.vocab_gguf, tensor_type=args.gguf_type
    )
    print(
        f"wrote {result.path}: {result.num_layers} of {result.base_layers} layers, {result.parameters:,} parameters "
        f"({result.bytes / 2**20:.0f} MiB, {result.tensor_type}), {result.adapter} adapter folded in, "
        f"tokenizer from {result.vocab_from}"
    )
    commands = result.llama_cpp_commands(result.vocab_from, args.draft_tokens)
    print(f"llama.cpp server:           {commands['llama_server']}")
    print(f"llama.cpp CLI:              {commands['llama_cli']}")
    print(f"llama.cpp before the rename: {commands['llama_server_older']}")
    return 0
