"""What exit trees (`exit_branches`) buy, on SmolLM2-135M-Instruct with its shipped heads, in verify mode.

An exit tree verifies each token an exit drafted together with its head's next choice, in the one pass that
verifies the chain (`decode/tree.py`). Whether that pays depends on what wider passes cost: on this project's 2-core
CPU an exit's drafts rarely pay, so the script also runs every prompt under a flat synthetic cost table (a pass
costs the same at any width, as on a bandwidth-bound GPU) and compares chains (`exit_branches=0`) with trees
(`exit_branches=1`) there, with the exits drafting as such a device would let them: the n-gram tier off, and no
confidence, entropy or gate bar (the policy still picks the exit and the draft length from its estimates). For each
dev and held-out open-text prompt (64 new tokens) it reports deep passes, tokens per pass, how often a refused draft
had the full model's token among its alternatives, and checks every output against plain greedy. (What the default
config drafts on this machine, exit trees included, `bench` reports under "cycles by plan".)

    python examples/exit_trees.py   # about 6 minutes on 2 CPU cores
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import early_exit_router.data
from early_exit_router import EarlyExitRouter
from early_exit_router.routing.costs import CostModel
from early_exit_router.routing.policy import AcceptanceTracker

NEW_TOKENS = 64
# the exits alone, drafting wherever the policy finds it pays
EXITS_ALONE = {
    "ngram_tier": False,
    "high_conf_threshold": 0.0,
    "low_conf_threshold": 0.0,
    "entropy_threshold": 1.0,
    "use_gate": False,
}


def main() -> None:
    router = EarlyExitRouter.from_pretrained("smollm2-135m")
    router.cost_model = CostModel.synthetic(router.stack.num_layers, [1.0] * 16, [6.0] * 16, draft_head_ms=0.1)
    verdicts: list[bool] = []
    observe = AcceptanceTracker.observe

    def spy(self: AcceptanceTracker, key: tuple[str, int], accepted: bool) -> None:
        if key[0] == "exit branch":
            verdicts.append(bool(accepted))
        observe(self, key, accepted)

    AcceptanceTracker.observe = spy  # counts the alternatives' verdicts; restored below
    try:
        for name in ("dev_prompts.jsonl", "heldout_prompts.jsonl"):
            path = Path(early_exit_router.data.__file__).parent / name
            items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            totals: dict[str, list[int]] = {}
            verdicts.clear()
            for item in items:
                ids = router.encode(item["prompt"], chat=item.get("kind") == "chat")
                with router.disabled() as model:
                    ref = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
                for arm, branches in (("chains", 0), ("trees", 1)):
                    config = {**EXITS_ALONE, "exit_branches": branches}
                    out = router.generate(ids, max_new_tokens=NEW_TOKENS, mode="verify", config=config)
                    same = torch.equal(out.sequences, ref)
                    t = totals.setdefault(arm, [0, 0, 0])
                    t[0] += out.stats.new_tokens
                    t[1] += out.stats.deep_passes
                    t[2] += int(same)
            print(f"\n{name}: {len(items)} prompts, {NEW_TOKENS} new tokens, verify mode, flat cost table, exits alone")
            print("| arm | tokens | deep passes | tokens per pass | identical to greedy |")
            print("|---|---|---|---|---|")
            for arm, (tokens, passes, same) in totals.items():
                print(f"| {arm} | {tokens} | {passes} | {tokens / max(passes, 1):.2f} | {same}/{len(items)} |")
            right = sum(verdicts)
            print(f"refused drafts with alternatives beside them (trees arm): {len(verdicts)}, the full model's token")
            print(f"among the alternatives: {right} ({right / max(len(verdicts), 1):.0%})")
    finally:
        AcceptanceTracker.observe = observe


if __name__ == "__main__":
    main()
