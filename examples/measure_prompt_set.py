"""Measure the router against plain HF generation on a prompt set, side by side in one process.

    python examples/measure_prompt_set.py [--prompts FILE.jsonl] [--max-new-tokens 64]

For every prompt, in interleaved order: plain HF `generate` (greedy), the router with exits switched off (the
engine's own cost), the router in `exit` mode (with and without its learned gates) and in `verify` mode at the
configured thresholds, and both modes again with the zero-layer n-gram tier. Prints a markdown
table per category: tokens/s and the ratio to plain HF measured in the same run, hit rate, agreement, and whether
the output is token-identical to plain HF. Speed numbers depend on the machine; ratios are the thing to compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings
from collections import defaultdict
from pathlib import Path

import torch

from early_exit_router import EarlyExitRouter
from early_exit_router.corpus import DEV_PROMPTS, load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--prompts", type=Path, default=None, help="JSONL: id, category, kind, prompt (default: the dev set)"
    )
    parser.add_argument("--model", default="smollm2-135m", help="Alias, HF folder, GGUF file or router folder")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json-out", type=Path, default=None, help="Also write every measurement here")
    args = parser.parse_args()

    warnings.simplefilter("ignore", UserWarning)
    torch.manual_seed(0)
    router = EarlyExitRouter.from_pretrained(args.model)
    print(router.describe())
    prompts = load_prompts(args.prompts, shipped=DEV_PROMPTS)
    configured = router.config

    # arm -> (mode, RouterConfig overrides); None is plain HF generate on the unpatched model
    variants: dict[str, tuple[str, dict] | None] = {
        "plain HF generate": None,
        "router, exits off": ("exit", dict(active_exit_layers=[])),  # heads loaded, never consulted
        "router exit": ("exit", {}),
        "router exit, gates off": ("exit", dict(use_gate=False)),
        "router verify": ("verify", {}),
        "router exit + n-gram tier": ("exit", dict(ngram_tier=True)),
        "router verify + n-gram tier": ("verify", dict(ngram_tier=True)),
    }
    arms = list(variants)

    def run(name: str, ids: torch.Tensor):
        if variants[name] is None:
            with router.disabled():
                return router.generate(ids, max_new_tokens=args.max_new_tokens)
        mode, overrides = variants[name]
        router.config = configured.replace(**overrides)
        try:
            return router.generate(ids, max_new_tokens=args.max_new_tokens, mode=mode)
        finally:
            router.config = configured

    ids0 = router.encode("Warm up.", chat=True)
    for arm in arms:  # warm-up: first-call allocations stay out of the numbers
        run(arm, ids0)

    rows: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    records = []
    for item in prompts:
        ids = router.encode(item["prompt"], chat=item["kind"] == "chat")
        results = {arm: run(arm, ids) for arm in arms}
        plain = results["plain HF generate"]
        for arm, out in results.items():
            s = out.stats
            identical = torch.equal(out.sequences, plain.sequences)
            for key in (item["category"], "all"):
                rows[key][arm].append((s.new_tokens, s.wall_time_s, s.hit_rate, s.agreement, identical))
            records.append(
                {
                    "id": item["id"],
                    "category": item["category"],
                    "arm": arm,
                    **s.to_dict(),
                    "identical_to_plain": identical,
                }
            )
        print(f"{item['id']}: " + ", ".join(f"{a}: {r.stats.tokens_per_s:.1f} tok/s" for a, r in results.items()))

    print(f"\nmax_new_tokens={args.max_new_tokens}, greedy, {len(prompts)} prompts\n")
    print("| category | arm | tok/s | ratio to plain | hit rate | agreement | identical to plain |")
    print("|---|---|---|---|---|---|---|")
    for category, by_arm in rows.items():
        plain_tps = _tps(by_arm["plain HF generate"])
        for arm in arms:
            runs = by_arm[arm]
            tps = _tps(runs)
            hit = statistics.mean(r[2] for r in runs)
            agreements = [r[3] for r in runs if r[3] is not None]
            agreement = f"{statistics.mean(agreements):.3f}" if agreements else "n/a"
            identical = sum(r[4] for r in runs)
            print(
                f"| {category} | {arm} | {tps:.1f} | {tps / plain_tps:.2f} | {hit:.3f} | {agreement} | "
                f"{identical}/{len(runs)} |"
            )
    if args.json_out:
        args.json_out.write_text(json.dumps(records, indent=2))


def _tps(runs: list) -> float:
    """Tokens per second over all runs of an arm (total tokens / total time)."""
    return sum(r[0] for r in runs) / sum(r[1] for r in runs)


if __name__ == "__main__":
    main()
