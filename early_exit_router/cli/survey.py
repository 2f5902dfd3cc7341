"""`early-exit-router survey`: its subparser and its run function."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from early_exit_router.cli.options import add_load_options, check_out_file, int_list, load_options, str_list
from early_exit_router.config import ADAPTER_KINDS
from early_exit_router.models.loading import DEFAULT_MODEL


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    survey = sub.add_parser(
        "survey",
        help="Fit a cheap exit head at every layer and report agreement, coverage and what drafting there would pay.",
        description="Cache hidden states of the training corpus after every surveyed layer, fit a fresh adapter "
        "per layer by self-distillation on the trimmed draft vocabulary, and report per layer: held-out top-1 "
        "agreement (logit lens and trained), the share of positions that exit at a target precision, the draft "
        "cost from the measured cost model, the break-even acceptance and the speed-up at the measured agreement.",
    )
    survey.add_argument("--model", default=DEFAULT_MODEL, help="Alias, saved router folder, HF folder or .gguf.")
    survey.add_argument(
        "--layers", type=int_list, default=None, metavar="L1,L2", help="Layers to survey (default: every layer)."
    )
    survey.add_argument(
        "--adapter",
        type=_adapter_kinds,
        default=["postnorm"],
        metavar="KIND[,KIND]",
        help=f"Adapter kinds to fit, each at every layer, on one corpus and one cost table: any of "
        f"{', '.join(ADAPTER_KINDS)} (default: postnorm).",
    )
    survey.add_argument("--steps", type=int, default=300, help="Optimiser steps per layer (default: %(default)s).")
    survey.add_argument("--max-tokens", type=int, default=40_000, help="Corpus tokens (default: %(default)s).")
    survey.add_argument("--precision", type=float, default=0.95, help="Exit precision target (default: %(default)s).")
    survey.add_argument("--json", default=None, help="Also write the rows to this JSON file.")
    survey.add_argument("--quiet", action="store_true", help="No progress bars.")
    add_load_options(survey)


def _adapter_kinds(text: str) -> list[str]:
    kinds = str_list(text)
    unknown = [k for k in kinds if k not in ADAPTER_KINDS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(
            f"unknown adapter kind(s) {unknown or text!r}: give one or more of {', '.join(ADAPTER_KINDS)}, "
            "comma-separated (e.g. postnorm,residual_block)"
        )
    return list(dict.fromkeys(kinds))


def run(args: argparse.Namespace) -> int:
    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.training.head_report import as_dicts
    from early_exit_router.training.hidden_states import build_cache
    from early_exit_router.training.sequences import corpus_sequences
    from early_exit_router.training.survey import format_survey, survey_exits

    if args.json:
        check_out_file(args.json)  # before the layers' heads are fitted, not after
    router = EarlyExitRouter.from_pretrained(args.model, warm_up=False, **load_options(args))
    stack = router.stack
    layers = args.layers or list(range(stack.num_layers - 1))
    bad = [e for e in layers if not 0 <= e < stack.num_layers - 1]
    if bad:
        raise ValueError(f"--layers {bad} out of range: exits are layers 0..{stack.num_layers - 2} of this model.")
    costs = router.costs()
    sequences, manifest = corpus_sequences(router, args.max_tokens, progress=not args.quiet)
    cache = build_cache(stack, sorted(set(layers)), sequences, progress=not args.quiet)
    tables = []
    for kind in args.adapter:  # every kind on the same corpus, held-out chunks and cost table: comparable rows
        rows = survey_exits(router, cache, costs, adapter=kind, steps=args.steps, precision=args.precision)
        title = (
            f"{router.name_or_path}: '{kind}' adapters, {args.steps} steps, {len(cache)} positions "
            f"(20% of the chunks held out), draft vocabulary {router.config.draft_vocab_size}; plain step "
            f"{costs.plain_step():.1f} ms"
        )
        print(format_survey(rows, args.precision, title) + "\n")
        tables.append({"adapter": kind, "title": title, "rows": as_dicts(rows)})
    if args.json:
        report = {"corpus": manifest, "costs": costs.to_dict(), "tables": tables}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0
