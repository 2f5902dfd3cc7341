"""The copy ceiling: the speedup a perfect copy drafter could reach on the control's outputs, at this machine's costs.

Each output of the control is replayed token by token after its prompt. Where the n-gram tier's lookup (this
context, and for a sequence's later calls what the earlier calls stored, as the router's store holds them) proposes
a copy whose first token is right, an oracle drafts exactly the part the full model accepts (at most `ngram_draft`
tokens) and verifies it in one pass with the current token, which also yields the token after it. Elsewhere a plain
step makes one token, or a pass over a wrong draft where the cost table prices that below a plain step (prepacked
kernels can make a short chunk cheaper than one position). Each cycle costs what the cost table says
(`CostModel.pass_ms` over its plain step), at the cheapest draft length that holds the right part.

So the ceiling counts no wasted draft position, no rejected chain and no decode-loop overhead: it says how much of
an output copying could ever make cheaper on this machine. Beside it, the router's measured speedup shows what the
draft-length choice and the misses cost; a ceiling near the router's says the rest of the time goes to new text,
which no copy drafts.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from early_exit_router.config import RouterConfig
from early_exit_router.routing.costs import CostModel
from early_exit_router.routing.ngram import ContextIndex, SuffixStore, prefer_stored


def replay_cost(
    prompt: Sequence[int], output: Sequence[int], costs: CostModel, config: RouterConfig, store: SuffixStore | None
) -> float:
    """What making `output` after `prompt` costs, in plain steps, when every copy the n-gram tier could propose is
    drafted exactly as far as it is right (see the module docstring). `store`: earlier sequences to copy from."""
    index = ContextIndex(config.ngram_size, config.ngram_min_size)
    tokens, made, total = list(prompt), 0, 0.0
    plain = costs.plain_step()
    while made < len(output):
        proposal = prefer_stored(index.lookup(tokens, config.ngram_draft), store, tokens, config.ngram_draft)
        right = 0
        while right < len(proposal.tokens) and made + right < len(output):
            if proposal.tokens[right] != output[made + right]:
                break
            right += 1
        # The cheapest cycle that makes these tokens: plain steps, or one pass over at least the right drafts (a
        # longer or wrong draft can cost less where chunks run faster kernels than one position does).
        passes = (costs.pass_ms(1, 1 + d) / plain for d in range(max(right, 1), max(right, config.ngram_draft) + 1))
        total += min(right + 1.0, *passes)
        step = min(right + 1, len(output) - made)  # the drafts the full model accepts and its own token after them
        tokens += output[made : made + step]
        made += step
    return total


def copy_ceilings(
    prompts: Sequence[dict[str, Any]],
    encoded: Sequence[Any],
    control: dict[str, tuple[str, list[int]]],
    units: Sequence[Sequence[int]],
    costs: CostModel,
    config: RouterConfig,
) -> dict[str, float]:
    """Per category (and 'all'), the copy ceiling: tokens over replayed cost, summed over the prompts, as the bench's
    speedups are.

    `encoded`: each prompt's (1, n) ids; `control`: by prompt id, the category the control's run was reported under
    and its new ids; `units`: the prompts as the bench runs them (`request_units`): a sequence's calls
    in order, each later call able to copy what the earlier ones stored."""
    tokens: dict[str, int] = defaultdict(int)
    cost: dict[str, float] = defaultdict(float)
    for unit in units:
        store = SuffixStore(config.ngram_store_tokens, config.ngram_size, config.ngram_min_size)
        for k in unit:
            reported, output = control[prompts[k]["id"]]
            prompt = encoded[k][0].tolist()
            units_spent = replay_cost(prompt, output, costs, config, store)  # a store of 0 tokens keeps nothing
            for category in (reported, "all"):
                tokens[category] += len(output)
                cost[category] += units_spent
            store.add(prompt + output)
    return {category: tokens[category] / cost[category] for category in tokens if cost[category] > 0}
