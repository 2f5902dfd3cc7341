"""`early-exit-router adapt-base`: its subparser and its run function."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from early_exit_router.cli.options import add_corpus_options, check_out_folder, corpus_from_args, int_list
from early_exit_router.models.loading import DEFAULT_MODEL

STOPPED = 3  # exit status of a run that stopped before --max-steps (--run-seconds): rerun the command to go on


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "adapt-base",
        help="Fine-tune the base so its shallow layers exit through its own head (LayerSkip, self-distilled).",
        description="Train a LoRA (PEFT) on the base with the LayerSkip recipe: early-exit loss at the exits through "
        "the model's own final norm and LM head, layer dropout, every loss a KL to the original model. Writes a "
        "router folder (the LoRA or the merged model, exits at --exit-layers, reports and a learning curve) that "
        "from_pretrained loads. Stops and resumes: rerun the same command on the same --out to continue (a run "
        f"stopped by --run-seconds exits with status {STOPPED}).",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="Base model: alias, HF folder or .gguf file.")
    p.add_argument("--out", required=True, help="Folder for the adapted router (and the resumable state).")
    p.add_argument(
        "--exit-layers", type=int_list, default=None, metavar="E1,E2", help="Exits (default: a quarter of the depth)."
    )
    p.add_argument("--max-steps", type=int, default=400, help="Optimiser steps in all (default: %(default)s).")
    p.add_argument("--seq-len", type=int, default=256, help="Tokens per sequence (default: %(default)s).")
    p.add_argument("--batch-size", type=int, default=4, help="Sequences per step (default: %(default)s).")
    p.add_argument("--lr", type=float, default=2e-4, help="Peak learning rate (default: %(default)s).")
    p.add_argument("--loss-scale", default="sum_l", help="uniform | linear | sum_l (default: %(default)s).")
    p.add_argument("--e-scale", type=float, default=1.0, help="Weight of the exits' terms (default: 1).")
    p.add_argument("--last-weight", type=float, default=1.0, help="Weight of the last layer's KL (default: 1).")
    p.add_argument("--curriculum", default="none", help="none | rotational | gradual (default: %(default)s).")
    p.add_argument("--layer-dropout", type=float, default=0.0, help="Last layer's skip rate (default: 0, off).")
    p.add_argument("--dropout-shape", default="exp", help="exp | linear (default: %(default)s).")
    p.add_argument("--ce-weight", type=float, default=0.0, help="Weight of next-token cross-entropy (default: 0).")
    p.add_argument("--method", default="lora", help="lora (PEFT) | full (default: %(default)s).")
    p.add_argument(
        "--scope",
        default="model",
        help="model: adapt the model itself (default) | draft: a LoRA on layers 0..E alone, trained with exit E's "
        "head (the --model's trained head where it has one), that only drafts run: the model stays bit-identical.",
    )
    p.add_argument("--lora-rank", type=int, default=16, help="LoRA rank (default: %(default)s).")
    p.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA alpha (default: %(default)s).")
    p.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Autocast to bfloat16, float32 master weights (default: where the device computes it natively).",
    )
    p.add_argument("--merge", action="store_true", help="Write the adapted model itself (an HF folder), not the LoRA.")
    p.add_argument("--save-every", type=int, default=50, help="Steps between resumable states and held-out checks.")
    p.add_argument("--run-seconds", type=float, default=None, help="Stop this run after N seconds (rerun to go on).")
    p.add_argument("--restart", action="store_true", help="Discard a saved state in --out and start over.")
    add_corpus_options(p, max_tokens=200_000, self_gen_tokens=128)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice).")
    p.add_argument("--quiet", action="store_true", help="No progress bars.")


def run(args: argparse.Namespace) -> int:
    import torch

    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.training.adapt_base import adapt_base, check_adapt_out
    from early_exit_router.training.config import AdaptConfig
    from early_exit_router.training.layerskip_trainer import STATE_DIR, token_chunks

    check_out_folder(args.out)
    check_adapt_out(Path(args.out), args.restart)  # a finished run or a foreign folder: refused before any work
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = dict(
        max_steps=args.max_steps,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        lr=args.lr,
        loss_scale=args.loss_scale,
        e_scale=args.e_scale,
        last_weight=args.last_weight,
        curriculum=args.curriculum,
        layer_dropout=args.layer_dropout,
        dropout_shape=args.dropout_shape,
        ce_weight=args.ce_weight,
        method=args.method,
        scope=args.scope,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        bf16=args.bf16,
        seed=args.seed,
        save_every=args.save_every,
    )
    AdaptConfig(exit_layers=args.exit_layers or [1], **settings)  # a bad setting is reported before the model loads
    draft = args.scope == "draft"  # a draft path starts from the model's trained head at its exit, where it has one
    router = EarlyExitRouter.from_pretrained(args.model, fresh_heads=not draft, warm_up=False, pack_weights=False)
    if router.adapted_from is not None:
        raise ValueError(
            f"--model {args.model} is already an adapted base, and a LoRA on it would be saved against the original: "
            "adapt a --merge folder instead (its weights are the adapted model's)."
        )
    layers = router.stack.num_layers
    cfg = AdaptConfig(exit_layers=args.exit_layers or [max(1, layers // 4 - 1)], **settings)
    state = Path(args.out) / STATE_DIR / "chunks.pt"
    chunks = None
    if args.restart or not state.is_file():  # a run to continue trains on its own saved text
        chunks = token_chunks(corpus_from_args(router, args)[0], cfg.seq_len)
    tokenizer, name = router.tokenizer, router.name_or_path
    at = cfg.exit_layers[0]
    trained = draft and router.config.heads_trained and at in router.exit_layers
    head, kind = (router.heads.adapter(at), router.config.adapter_for(at)) if trained else (None, "identity")
    model = router.unpatch()
    result = adapt_base(
        model,
        tokenizer,
        name,
        chunks,
        cfg,
        args.out,
        merge=args.merge,
        restart=args.restart,
        run_seconds=args.run_seconds,
        progress=not args.quiet,
        command="early-exit-router " + shlex.join(getattr(args, "argv", None) or sys.argv[1:]),
        head=head,
        head_kind=kind,
    )
    print(quality_table(result.report))
    if not result.finished:
        print(f"stopped at step {result.steps_done} of {cfg.max_steps}: rerun the same command to continue.")
        return STOPPED
    print(f"adapted router written to {args.out}: EarlyExitRouter.from_pretrained({args.out!r})")
    return 0


def quality_table(report: dict[str, Any]) -> str:
    """The held-out figures of an adaptation report as a Markdown table (exits before and after, the last layer)."""
    from early_exit_router.training.adapt_quality import quality_rows

    head = f"{report['steps']} steps, {report['tokens_trained']} tokens, {report['seconds']} s"
    return "\n".join([head, *quality_rows(report["heldout"])]) if report.get("heldout") else head
