"""`early-exit-router eval-heads`: its subparser and its run function."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from early_exit_router.cli.options import add_router_options, check_out_file, read_prompts, router_overrides
from early_exit_router.models.loading import DEFAULT_MODEL


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    report = sub.add_parser(
        "eval-heads",
        help="Report exit-head agreement with the full model, logit lens vs trained, on held-out text.",
        description="For each exit layer: top-1 agreement with the final layer for the logit lens and the loaded "
        "heads over all tokens, the share of tokens the router's cascade lets exit there at the loaded thresholds, "
        "and the agreement among those. Sources: the model's answers to the development prompts, Debian's "
        "common licenses and CPython standard-library source (none of them used in training).",
    )
    report.add_argument("--model", default=DEFAULT_MODEL, help="Alias, saved router folder, HF folder or .gguf.")
    report.add_argument("--prompts", default=None, help="Development prompts JSONL (default: the shipped set).")
    report.add_argument("--answer-tokens", type=int, default=96, help="Answer length per development prompt.")
    report.add_argument("--max-tokens", type=int, default=6000, help="Tokens per held-out text source.")
    report.add_argument("--json", default=None, help="Also write the tables to this JSON file.")
    add_router_options(report)


def run(args: argparse.Namespace) -> int:
    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.training.corpus import DEV_PROMPTS, held_out_texts, self_generated
    from early_exit_router.training.head_report import as_dicts, exit_signals, format_table, quality_table
    from early_exit_router.training.hidden_states import build_cache

    # The files first: a mistake in them is reported before the model loads and the tables are computed.
    prompts = read_prompts(args.prompts, DEV_PROMPTS)
    if args.json:
        check_out_file(args.json)
    router = EarlyExitRouter.from_pretrained(args.model, warm_up=False, **router_overrides(args))
    print(router.describe(), file=sys.stderr)
    tok = router.tokenizer
    if tok is None:
        raise ValueError("eval-heads needs the model's tokenizer.")
    with router.disabled() as model:
        label = "development prompts" if args.prompts is None else Path(args.prompts).name  # what the answers answer
        sources = {f"{label} (model answers)": self_generated(model, tok, prompts, args.answer_tokens)}
    for name, text in held_out_texts().items():
        sources[name] = [tok(text, add_special_tokens=False).input_ids[: args.max_tokens]]
    tables = {}
    for name, sequences in sources.items():
        cache = build_cache(router.stack, router.exit_layers, sequences, chunk_len=256, progress=False)
        rows = quality_table(exit_signals(router, cache))
        tables[name] = {"positions": len(cache), "rows": as_dicts(rows)}
        print(format_table(f"{name}: {len(cache)} positions", rows) + "\n")
    against: dict = {}
    key = "draft_path" if router.draft_path is not None else "against_original"
    if router.adapted_from is not None:  # an adapt-base folder: its model against the original, or its draft path
        from early_exit_router.training.adapt_quality import against_original, draft_path_agreement

        compare = draft_path_agreement if router.draft_path is not None else against_original
        text, against = compare(router, sources)
        print(text)
    if args.json:
        report = {"model": router.describe(), "config": router.config.to_dict(), "tables": tables}
        with open(args.json, "w") as f:
            json.dump(report | ({key: against} if against else {}), f, indent=2)
    return 0
