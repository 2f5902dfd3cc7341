"""What the n-gram tier's proposal costs per decoding step at a long context (`early-exit-router profile`).

A step asks the tier for a proposal once per row: the context's own match (`routing.ngram.ContextIndex`) and the
router's store (`SuffixStore`), with the token tree of every continuation found where trees are drafted, then appends
the step's tokens. Both are indexes, so the cost should not grow with the context; this times it on a synthetic
context of `context` tokens and a full store, to report beside the plain step it must stay small against.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from early_exit_router.config import RouterConfig
from early_exit_router.decode.drafters import TREE_OCCURRENCES
from early_exit_router.routing.ngram import ContextIndex, SuffixStore, ngram_match, prefer_stored, propose_tree


@dataclass
class ProposalCost:
    context: int
    index_ms: float  # per step, with the index (a chain's proposal)
    tree_ms: float  # per step, with the index and the proposal's token tree (verify mode, one sequence)
    scan_ms: float  # per step, scanning the context instead (`ngram_match`: the cost the index removes)
    build_ms: float  # indexing the prompt, once per call


def measure_proposal_cost(config: RouterConfig, context: int = 8192, steps: int = 64, seed: int = 0) -> ProposalCost:
    """Per-step proposal time at `context` tokens: a text of repeated phrases (matches are common, as in grounded
    output) over a 4,096-token vocabulary, and a store filled to `ngram_store_tokens` with text like it."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(4096) for _ in range(rng.randrange(3, 12))] for _ in range(400)]

    def text(length: int) -> list[int]:
        out: list[int] = []
        while len(out) < length:
            out += rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(4096)]
        return out[:length]

    store = SuffixStore(config.ngram_store_tokens, config.ngram_size, config.ngram_min_size)
    while store.num_tokens + 2048 <= config.ngram_store_tokens:
        store.add(text(2048))
    tokens, upcoming = text(context), text(steps)
    index = ContextIndex(config.ngram_size, config.ngram_min_size)
    start = time.perf_counter()
    index.lookup(tokens, 1)
    build_ms = (time.perf_counter() - start) * 1000

    def per_step(propose) -> float:
        grown, times = list(tokens), []
        for token in upcoming:
            start = time.perf_counter()
            propose(grown)
            times.append(time.perf_counter() - start)
            grown.append(token)
        index.cut(grown, len(tokens))  # the next measurement starts from the same context again
        return statistics.median(times) * 1000

    d = config.ngram_draft
    index_ms = per_step(lambda grown: prefer_stored(index.lookup(grown, d), store, grown, d))
    tree_ms = per_step(lambda grown: propose_tree(index.continuations(grown, d, TREE_OCCURRENCES), store, grown, d,
                                                  TREE_OCCURRENCES, config.ngram_tree_nodes))  # fmt: skip
    scan = per_step(lambda grown: prefer_stored(ngram_match(grown, config.ngram_size, d, config.ngram_min_size),
                                               store, grown, d))  # fmt: skip
    return ProposalCost(context, index_ms, tree_ms, scan, build_ms)
