"""`early-exit-router train-heads`: its subparser and its run function."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from early_exit_router.cli.options import (
    add_corpus_options,
    add_router_options,
    check_out_folder,
    corpus_from_args,
    int_list,
    read_prompts,
    router_overrides,
)
from early_exit_router.models.loading import DEFAULT_MODEL


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    train = sub.add_parser(
        "train-heads",
        help="Train the exit heads (and gates) by self-distillation and save the router.",
        description="Train exit adapters by KL self-distillation to the frozen full model, on the model's own "
        "answers to a prompt set plus READMEs of installed packages; fit a learned gate per exit; pick "
        "high_conf_threshold for a target agreement on held-out positions; save the router folder.",
    )
    train.add_argument("--model", default=DEFAULT_MODEL, help="Base model: alias, HF folder or .gguf file.")
    train.add_argument("--out", required=True, help="Folder to save the trained router into.")
    train.add_argument("--max-steps", type=int, default=600, help="Optimiser steps (default: %(default)s).")
    train.add_argument(
        "--max-seconds", type=float, default=None, help="A wall-clock training budget instead of --max-steps."
    )
    train.add_argument("--batch-tokens", type=int, default=512, help="Positions per step (default: %(default)s).")
    train.add_argument("--lr", type=float, default=2e-3, help="Learning rate (default: %(default)s).")
    train.add_argument("--ce-weight", type=float, default=0.0, help="Weight of next-token cross-entropy.")
    train.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default: %(default)s).")
    train.add_argument(
        "--train-share",
        type=float,
        default=1.0,
        help="Learn from this seeded share of the training text, the held-out text unchanged: with --hidden-states, "
        "a learning curve over the corpus' size in one command per share (default: all of it).",
    )
    add_corpus_options(train, max_tokens=120_000, self_gen_tokens=96)
    train.add_argument("--no-gates", action="store_true", help="Do not fit learned gates.")
    train.add_argument(
        "--pre-head-gates",
        action="store_true",
        help="Fit gates that run before the head (they can skip it) instead of head gates (a learned confidence "
        "from the head's output, the state and the n-gram tier: more exits at the same agreement).",
    )
    train.add_argument(
        "--target-agreement",
        type=float,
        default=0.9,
        help="Pick high_conf_threshold so held-out exits agree this often (default: %(default)s; 0 keeps it).",
    )
    train.add_argument(
        "--init-from",
        default=None,
        help="Warm start: a saved router folder or alias whose trained adapters load into the new heads (same kind "
        "whole; a postnorm head into a residual_block's post-norm map) and learn at --warm-lr-scale of the rate.",
    )
    train.add_argument(
        "--train-exits",
        type=int_list,
        default=None,
        metavar="E1,E2",
        help="Train only these exits' adapters; the others keep what --init-from loaded (default: all).",
    )
    train.add_argument(
        "--warm-lr-scale", type=float, default=0.1, help="Rate factor of warm-started parameters (default: 0.1)."
    )
    train.add_argument(
        "--hidden-states",
        default=None,
        help="A file for the corpus' hidden states: reused when it exists (the corpus is then not built again), "
        "written after the corpus pass when it does not.",
    )
    train.add_argument(
        "--gate-prompts",
        type=int,
        default=0,
        help="Fit the gates also on the model's greedy and sampled answers to this many fresh prompts (built "
        "offline, none of them a training prompt), text no adapter trains on (default: %(default)s).",
    )
    train.add_argument(
        "--gate-hidden-states",
        default=None,
        help="A file for the gate text's hidden states: reused when it exists, written when it does not.",
    )
    train.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice).")
    train.add_argument("--quiet", action="store_true", help="No progress bars.")
    add_router_options(train)


def run(args: argparse.Namespace) -> int:
    import torch

    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.training.config import TrainingConfig
    from early_exit_router.training.corpus import TRAIN_PROMPTS
    from early_exit_router.training.distill import distill_router, warm_start
    from early_exit_router.training.hidden_states import HiddenStateCache, build_cache

    # The files first: a mistake in them is reported before the model loads and the heads train, not after.
    if args.prompts:
        read_prompts(args.prompts, TRAIN_PROMPTS)  # only checked here: the corpus reads the file itself
    check_out_folder(args.out)
    cfg = TrainingConfig(  # a bad setting is reported before the model loads
        max_steps=args.max_steps,
        max_seconds=args.max_seconds,
        batch_tokens=args.batch_tokens,
        lr=args.lr,
        ce_weight=args.ce_weight,
        weight_decay=args.weight_decay,
        seed=args.seed,
        head_gates=not args.pre_head_gates,
        train_exits=args.train_exits,
        warm_lr_scale=args.warm_lr_scale,
        train_share=args.train_share,
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = router_overrides(args)
    router = EarlyExitRouter.from_pretrained(args.model, fresh_heads=True, warm_up=False, **overrides)
    print(router.describe(), file=sys.stderr)
    warm = []
    if args.init_from:
        warm = warm_start(router, router.load_saved_heads(args.init_from), router.exit_layers)
    elif args.train_exits is not None:
        raise ValueError("--train-exits leaves the other exits untrained unless --init-from loads them: add it.")
    start = time.perf_counter()
    states = Path(args.hidden_states) if args.hidden_states else None
    if states is not None and states.exists():
        sequences, cache = None, HiddenStateCache.load(states, router.exit_layers)
        manifest = {"hidden_states": str(states), "note": "reused: the corpus was not built again"}
    else:
        sequences, manifest = corpus_from_args(router, args)
        cache = None
        if states is not None:
            cache = build_cache(router.stack, router.exit_layers, sequences, cfg.chunk_len, progress=not args.quiet)
            cache.save(states)
    gate_cache, gate_manifest = _gate_cache(router, args, cfg.chunk_len if cache is None else cache.chunk_len)
    result = distill_router(
        router,
        sequences,
        cfg,
        gates=not args.no_gates,
        target_agreement=args.target_agreement or None,
        progress=not args.quiet,
        cache=cache,
        warm=warm,
        gate_cache=gate_cache,
    )
    result["corpus"] = manifest
    if gate_manifest:
        result["gate_corpus"] = gate_manifest
    result["wall_seconds"] = round(time.perf_counter() - start, 1)
    router.save_pretrained(args.out)
    (Path(args.out) / "training_report.json").write_text(json.dumps(result, indent=2) + "\n")
    from early_exit_router.training.head_report import ExitQuality, format_table

    print(
        format_table("held-out positions of the training corpus", [ExitQuality(**r) for r in result["holdout_quality"]])
    )
    own = ", ".join(f"L{e} {a:.3f}" for e, a in result["own_text_agreement"].items())
    print(f"top-1 agreement on the heads' own training text: {own}")
    print(f"saved to {args.out}; thresholds {result.get('thresholds')}; {result['wall_seconds']} s in all")
    return 0


def _gate_cache(router: Any, args: argparse.Namespace, chunk_len: int) -> tuple[Any, dict[str, Any]]:
    """train-heads' gate-only text (`--gate-prompts`) as hidden states, read from `--gate-hidden-states` when that
    file exists; (None, {}) without it."""
    from early_exit_router.training.corpus import MEASURED_PROMPT_SETS, generated_prompts, load_prompts
    from early_exit_router.training.hidden_states import HiddenStateCache, build_cache
    from early_exit_router.training.sequences import gate_sequences

    states = Path(args.gate_hidden_states) if args.gate_hidden_states else None
    if states is not None and states.exists():
        cache = HiddenStateCache.load(states, router.exit_layers)
        if cache.chunk_len != chunk_len:  # checked now, before the adapters train, not when the gates fit
            raise ValueError(
                f"The gate text's hidden states in {states} come in chunks of {cache.chunk_len} positions, the "
                f"corpus's in chunks of {chunk_len}: remove the file, so that they are computed again."
            )
        return cache, {"hidden_states": str(states), "note": "reused"}
    if args.gate_prompts <= 0:
        return None, {}
    # Never the training prompts, nor those measured or tuned on.
    exclude = load_prompts(args.prompts) + generated_prompts(args.generated_prompts, args.seed)
    exclude += [p for name in MEASURED_PROMPT_SETS for p in load_prompts(shipped=name)]
    sequences, manifest = gate_sequences(
        router, args.gate_prompts, args.self_gen_tokens or 96, args.seed, exclude, progress=not args.quiet
    )
    cache = build_cache(router.stack, router.exit_layers, sequences, chunk_len, progress=not args.quiet)
    if states is not None:
        cache.save(states)
    return cache, manifest
