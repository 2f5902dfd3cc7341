"""`early-exit-router profile`: its subparser and its run function."""

from __future__ import annotations

import argparse
import json

from early_exit_router.cli.options import add_load_options, add_router_options, load_options, router_overrides
from early_exit_router.models.loading import DEFAULT_MODEL, parse_dtype
from early_exit_router.models.shapes import SHAPES


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    profile = sub.add_parser(
        "profile",
        help="Measure (or show the cached) cost model the router decides from on this device.",
        description="Times one decoder layer at chunk lengths 1..N, the full LM head at 1..N rows, an exit's trimmed "
        "draft head and its gate, on the device and dtype in use; caches the table on disk and prints it with what "
        "the cost policy would do at a few acceptance rates.",
    )
    profile.add_argument("--model", default=DEFAULT_MODEL, help="Alias, saved router folder, HF folder or .gguf.")
    profile.add_argument(
        "--shape",
        choices=list(SHAPES),
        help="Instead of --model, a published model's shape with random weights (timings do not depend on them), "
        "fresh heads at --exit-layers (default: an eighth, a quarter and half the depth): the costs of a model users "
        "deploy, for projections. Llama-3-8B needs 32 GB in float32 (16 in bfloat16, without --no-pack-weights 32).",
    )
    profile.add_argument("--refresh", action="store_true", help="Measure again even when a cached table exists.")
    profile.add_argument("--json", action="store_true", help="Print the cost model as JSON.")
    profile.add_argument(
        "--long-context",
        type=int,
        default=0,
        metavar="N",
        help="Also time a plain step at N cached positions, with the router's cache and with a concatenating one "
        "(as plain HF generate keeps it).",
    )
    add_load_options(profile)
    add_router_options(profile)


def run(args: argparse.Namespace) -> int:
    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.bench.long_context import measure_long_context_step
    from early_exit_router.bench.proposal_cost import measure_proposal_cost
    from early_exit_router.routing.ngram import Proposal
    from early_exit_router.routing.policy import AcceptanceTracker, DraftPolicy

    if args.long_context < 0:
        raise SystemExit("--long-context takes a number of cached positions, 1 or more (0: skip).")
    if args.shape:
        router = _shape_router(args)
    else:
        overrides = router_overrides(args)
        router = EarlyExitRouter.from_pretrained(args.model, warm_up=False, **load_options(args), **overrides)
    costs = router.costs(refresh=args.refresh)
    if args.json:
        print(json.dumps(costs.to_dict(), indent=2))
        return 0
    print(router.describe())
    print(costs.markdown())
    exits = router.config.consulted_exit_layers()
    policy = DraftPolicy.for_config(costs, router.config, router.heads)
    budget, reach = router.config.max_pending, router.config.ngram_draft
    print(
        f"\nWhat the cost policy chooses for a cycle (expected tokens per plain step; an exit drafts up to {budget}):\n"
    )
    print(f"| acceptance | n-gram tier (proposal of {reach}) | " + " | ".join(f"exit L{e}" for e in exits) + " |")
    print("|---|---|" + "---|" * len(exits))
    for a in (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98):
        cells = []
        ngram_d, ngram_rate = policy.best_draft(a, policy.ngram_cycle_ms, reach)
        cells.append(f"d={ngram_d}: {ngram_rate / policy.plain_rate:.2f}x")
        for i in range(len(exits)):
            d, rate = policy.best_draft(a, lambda d, i=i: policy.exit_cycle_ms(i, d), budget)
            cells.append(f"d={d}: {rate / policy.plain_rate:.2f}x")
        print(f"| {a:.2f} | " + " | ".join(cells) + " |")
    chosen = policy.plan(AcceptanceTracker(prior=router.config.acceptance_prior), budget, [Proposal([0] * 8, 2)])
    print(
        f"\nAt the prior acceptance {router.config.acceptance_prior:.2f}, a cycle with an n-gram proposal runs: "
        f"{chosen.kind}" + (f", {chosen.max_draft} drafts" if chosen.max_draft else "")
    )
    rates = ", ".join(f"L{e} {policy.break_even_exit_rate(i):.2f}" for i, e in enumerate(exits))
    print(f"Exit mode asks an exit while the share of tokens asked that leave there is at least: {rates}")
    if router.config.ngram_tier:
        cost = measure_proposal_cost(router.config)
        print(
            f"The n-gram tier's proposal at a context of {cost.context:,} tokens (and a full store): "
            f"{cost.index_ms:.3f} ms per step, {cost.index_ms / costs.plain_step():.2%} of a plain step; with its "
            f"token tree {cost.tree_ms:.3f} ms, {cost.tree_ms / costs.plain_step():.2%} (scanning the context "
            f"instead: {cost.scan_ms:.2f} ms; indexing the prompt, once: {cost.build_ms:.0f} ms)"
        )
    if args.long_context:
        try:
            step = measure_long_context_step(router.stack, args.long_context)
        except ValueError as err:
            raise SystemExit(f"--long-context: {err}") from None
        print(
            f"A plain step at a context of {step.context:,} tokens: {step.growing_ms:.1f} ms with the router's cache, "
            f"{step.concatenating_ms:.1f} ms with a concatenating one as plain HF generate keeps "
            f"({step.concatenating_ms / step.growing_ms:.2f}x); same logits: {'yes' if step.same_logits else 'NO'}"
        )
    return 0


def _shape_router(args: argparse.Namespace) -> object:
    """A router on a random model of `args.shape`, with fresh heads (only their costs are used)."""
    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.models.shapes import default_exit_layers, random_model

    if args.quantize:
        raise ValueError("--shape times a dense model: drop --quantize.")
    options = load_options(args)
    overrides = router_overrides(args)
    model = random_model(args.shape, parse_dtype(options["dtype"]), options["device"] or "cpu")
    overrides.setdefault("exit_layers", default_exit_layers(model.config.num_hidden_layers))
    return EarlyExitRouter.from_model(model, None, pack_weights=options["pack_weights"], **overrides)
