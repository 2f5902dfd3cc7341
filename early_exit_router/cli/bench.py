"""`early-exit-router bench`: its subparser and its run function."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from early_exit_router.cli.options import (
    add_load_options,
    add_router_options,
    check_out_folder,
    float_list,
    int_list,
    load_options,
    read_prompts,
    router_overrides,
    str_list,
)
from early_exit_router.config import MODES
from early_exit_router.models.loading import DEFAULT_MODEL


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser(
        "bench",
        help="Side by side: plain HF generate, HF compiled, the router (threshold sweep), HF assisted early exit and "
        "prompt lookup.",
        description="A/B benchmark in one process on the same prompts: the control (plain HF greedy), HF's static "
        "cache + torch.compile (the anchor: speedups over it too), the router with exits off, the router in each "
        "mode over a threshold sweep (and with the n-gram tier), HF assisted generation with assistant_early_exit, "
        "and HF prompt lookup. Prints a markdown table per category (speed, routing, compute, quality against the "
        "control) and writes JSON and a PNG plot.",
    )
    bench.add_argument("--model", default=DEFAULT_MODEL, help="Alias, saved router folder, HF folder or .gguf.")
    bench.add_argument(
        "--prompts",
        default=None,
        help="JSONL: id, category, kind (text|chat), prompt, optional check (bench/checks.py) (default: dev).",
    )
    bench.add_argument("--max-new-tokens", type=int, default=64, help="New tokens per prompt (default: %(default)s).")
    bench.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="Interleaved repeats; each arm's tokens/s is the median over them (default: %(default)s).",
    )
    bench.add_argument(
        "--modes", type=str_list, default=["exit", "verify"], metavar="M1,M2", help="Router modes (default: both)."
    )
    bench.add_argument(
        "--thresholds",
        type=float_list,
        default=[0.3, 0.5, 0.7, 0.9],
        metavar="T1,T2",
        help="high_conf_threshold sweep; the loaded threshold is always added (default: 0.3,0.5,0.7,0.9).",
    )
    bench.add_argument("--no-ngram", action="store_true", help="Skip the 'n-gram tier only' rows.")
    bench.add_argument(
        "--no-fixed-cascade", action="store_true", help="Skip the 'fixed cascade, no n-gram' rows (the old default)."
    )
    bench.add_argument(
        "--assistant-early-exit",
        type=int_list,
        default=None,
        metavar="E1,E2",
        help="HF assisted generation with the first E layers as draft (default: deepest exit + 1; '' skips).",
    )
    bench.add_argument(
        "--prompt-lookup", type=int, default=10, help="HF prompt_lookup_num_tokens; 0 skips (default: %(default)s)."
    )
    bench.add_argument(
        "--no-hf-compiled",
        action="store_true",
        help="Skip the anchor arm, HF generate with a static cache and torch.compile (its first call compiles, "
        "about a minute on 2 CPU cores); every table otherwise shows speedups over it beside those over plain HF.",
    )
    bench.add_argument(
        "--no-llama-cpp",
        action="store_true",
        help="Skip the reference arm 'llama.cpp greedy, same GGUF', which greedy runs add where llama-cpp-python is "
        "installed and the model came from a GGUF file (the file as llama.cpp runs it, weights in their own format).",
    )
    bench.add_argument(
        "--no-compiled",
        action="store_true",
        help="Skip the router's compiled arms (exits off and each mode's loaded config with compile=True), which "
        "run where its passes compile (float32 on a CPU, and CUDA).",
    )
    bench.add_argument(
        "--reference-dtype",
        default="auto",
        choices=["auto", "float32", "none"],
        help="Also score every output by its teacher-forced agreement with the same base model loaded in this dtype "
        "(auto: float32 when --dtype or --quantize lowers the precision; none: skip).",
    )
    bench.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="Sample every arm at this temperature (no top-k or top-p; one seed per prompt shared by the arms); "
        "0 decodes greedily (default).",
    )
    bench.add_argument(
        "--compare-heads",
        type=str_list,
        default=[],
        metavar="DIR1,DIR2",
        help="Saved router folders (or aliases) with other heads for the same base: each runs at its loaded config "
        "in every mode, on its own copy of the model, beside the --model heads in this one process.",
    )
    bench.add_argument("--out", default="bench-results", help="Folder for bench.json and bench.png.")
    add_load_options(bench)
    bench.add_argument("--quiet", action="store_true", help="No progress bar.")
    add_router_options(bench)


def run(args: argparse.Namespace) -> int:
    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.bench.bench import BenchConfig, run_bench
    from early_exit_router.bench.checks import validate_check
    from early_exit_router.training.corpus import DEV_PROMPTS

    # The files first: a mistake in them is reported before the model loads, not after.
    prompts = read_prompts(args.prompts, DEV_PROMPTS, ("id", "category", "kind", "prompt"))
    for item in prompts:  # a prompt's answer check (`bench/checks.py`), refused before the model loads
        if item.get("check") is not None:
            try:
                validate_check(item["check"])
            except ValueError as exc:
                raise ValueError(f"--prompts {args.prompts}, prompt {item['id']!r}: {exc}") from None
    check_out_folder(args.out)
    labels = _compared_heads(args.compare_heads)
    router = EarlyExitRouter.from_pretrained(args.model, **load_options(args), **router_overrides(args))
    print(router.describe(), file=sys.stderr)
    others = {}
    for label, source in labels.items():
        others[label] = EarlyExitRouter.from_pretrained(source, **load_options(args), **router_overrides(args))
        print(f"heads {label}: {others[label].describe()}", file=sys.stderr)
    cfg = BenchConfig(
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        modes=tuple(args.modes),
        thresholds=tuple(args.thresholds),
        ngram=not args.no_ngram,
        fixed_cascade=not args.no_fixed_cascade,
        assistant_early_exit=None if args.assistant_early_exit is None else tuple(args.assistant_early_exit),
        prompt_lookup_num_tokens=args.prompt_lookup,
        hf_compiled=not args.no_hf_compiled,
        compiled=not args.no_compiled,
        llama_cpp=not args.no_llama_cpp,
        temperature=args.temperature,
    )
    for mode in cfg.modes:
        if mode not in MODES:
            raise ValueError(f"Unknown mode {mode!r} in --modes: use {', '.join(MODES)}.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = _reference_dtype(args, router)
    reference = None if dtype is None else lambda: _reference_model(args, router, dtype)
    result = run_bench(router, prompts, cfg, progress=not args.quiet, reference=reference, others=others)
    print(result.markdown())
    result.write_json(out / "bench.json")
    result.plot(out / "bench.png")
    print(f"\nwrote {out / 'bench.json'} and {out / 'bench.png'}")
    return 0


def _compared_heads(sources: list[str]) -> dict[str, str]:
    """--compare-heads as label -> source (the folder's name, or the alias), refused before any model loads where a
    source holds no heads."""
    from early_exit_router.heads.checkpoint import is_router_dir, shipped_checkpoint

    labels: dict[str, str] = {}
    for source in sources:
        if not is_router_dir(source) and shipped_checkpoint(source) is None:
            raise ValueError(
                f"--compare-heads {source}: not a saved router folder (early_exit_config.json and its heads) nor an "
                "alias with shipped heads: give what `train-heads --out` or `calibrate --out` wrote."
            )
        label = Path(source).name or source
        labels[label if label not in labels else f"{label}#{len(labels) + 1}"] = source
    return labels


def _reference_dtype(args: argparse.Namespace, router: Any) -> str | None:
    """The dtype outputs are also scored in: float32 where the bench lowers the precision (or --reference-dtype)."""
    import torch

    lowered = router.stack.dtype != torch.float32 or args.quantize is not None
    if args.reference_dtype == "none" or (args.reference_dtype == "auto" and not lowered):
        return None
    return "float32"


def _reference_model(args: argparse.Namespace, router: Any, dtype: str) -> Any:
    """The base model again in `dtype`, dense (adapted, for an adapt-base router): the model whose judgement a bf16 or
    quantized arm is held to."""
    from early_exit_router.heads.adapted_base import apply_adaptation
    from early_exit_router.models.loading import load_base_model, parse_dtype

    model, _, _ = load_base_model(router.name_or_path, parse_dtype(dtype), args.device, None)
    if router.adapted_from is not None:  # an adapt-base router is held to its adapted model
        model = apply_adaptation(model, *router.adapted_from)
    return model.eval()
