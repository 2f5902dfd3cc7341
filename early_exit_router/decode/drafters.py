"""Where drafts come from: the exits (a shallow layer's head) and the suffix tier (text seen before), each asked
through `propose`.

- `ExitDrafter`: an exit's draft logits for every row at once (its adapter, or its block adapter's context, the final
  norm and the trimmed draft head), and its learned gate's probability, with the gate's context features.
- `SuffixDrafter`: the zero-layer tier: the tokens that followed the latest earlier occurrence of the context's
  longest matching suffix, in this context or in the router's earlier sequences (`routing/ngram.py`).

Whether a draft is taken is the exit rule's and the policy's call (`routing/`), drafting it into a decode is
`drafting.py`'s, and the deep pass judges it (`verify.py`).
Compare transformers' `CandidateGenerator` (`get_candidates` / `update_candidate_strategy`): here a drafter proposes,
and the decoder books every verdict in the acceptance estimates the policy reads.
"""

from __future__ import annotations

from typing import Any

import torch

from early_exit_router.config import RouterConfig
from early_exit_router.heads.block import BlockContext
from early_exit_router.heads.draft import draft_logits
from early_exit_router.heads.exit_heads import ExitHeads
from early_exit_router.heads.gates import gate_probability, uses_head
from early_exit_router.models.architecture import LayerStack
from early_exit_router.routing.gate_context import context_features
from early_exit_router.routing.ngram import (
    NO_PROPOSAL,
    ContextIndex,
    Proposal,
    SuffixStore,
    prefer_stored,
    propose_tree,
)
from early_exit_router.routing.token_tree import TokenTree

NGRAM_LAYER = -1  # exit-histogram key of the zero-layer n-gram tier
TREE_OCCURRENCES = 8  # earlier occurrences per source whose continuations a token tree merges


class SuffixDrafter:
    """The n-gram tier: proposes what followed the same tokens earlier (prompt lookup, plus the router's store)."""

    def __init__(self, config: RouterConfig, store: SuffixStore | None) -> None:
        self.config = config
        self.store = store

    def index(self) -> ContextIndex:
        """A fresh index of one context (`Row.index`), for this tier's n-gram sizes."""
        return ContextIndex(self.config.ngram_size, self.config.ngram_min_size)

    def propose(
        self, tokens: list[int], index: ContextIndex, budget: int, tree: bool = False
    ) -> tuple[Proposal, int, TokenTree | None]:
        """Up to `budget` tokens to follow `tokens` (indexed by `index`): the longer match of the context and the
        store (then the longer run; on a tie, the longer proposal; then the context's); with `tree`, also the token
        tree of every continuation found, as deep as a tree may have nodes (`ngram.propose_tree`). Also returns the
        token the context's own match copies first (-1: none), which a gate reads."""
        if budget <= 0:
            return NO_PROPOSAL, -1, None
        if tree:  # the first continuation is the lookup's proposal: one pass over the index serves both
            found = index.continuations(tokens, budget, TREE_OCCURRENCES)
            copy = found[0].tokens[0] if found else -1
            depth = self.config.ngram_tree_nodes
            proposal, token_tree = propose_tree(found, self.store, tokens, budget, TREE_OCCURRENCES, depth)
            return proposal, copy, token_tree
        lookup = index.lookup(tokens, budget)
        copy = lookup.tokens[0] if lookup.tokens else -1
        return prefer_stored(lookup, self.store, tokens, budget), copy, None

    def remember(self, tokens: list[int]) -> None:
        """A finished sequence (prompt and output) for later calls to copy from."""
        if self.store is not None:
            self.store.add(tokens)


class ExitDrafter:
    """An exit's draft for every row: (b, hidden) exit states -> (b, vocab) draft logits, and its gate."""

    def __init__(self, stack: LayerStack, heads: ExitHeads, config: RouterConfig, exits: list[int]) -> None:
        self.stack, self.heads, self.config, self.exits = stack, heads, config, exits
        self.draft = heads.draft_head(stack, config.draft_vocab_size, config.half_draft_head)
        self.draft_ids = None if self.draft is None else self.draft.token_ids  # the draft logits' finite columns

    def gate(self, i: int) -> torch.nn.Module | None:
        """Exit `i`'s learned gate, when it has one in use."""
        return self.heads.gate(self.exits[i]) if self.config.use_gate else None

    def logits(
        self, i: int, last: torch.Tensor, blocks: dict[int, BlockContext], trimmed: bool = False
    ) -> torch.Tensor:
        """Exit `i`'s draft logits (b, vocab) for the current slot, whose exit states are `last` (b, hidden); with
        `trimmed` (and a trimmed head: `can_trim`), the (b, K) logits over `draft_ids` alone.

        A block adapter first runs over its queued positions (the current one is the last of them)."""
        adapter = self.heads.adapter(self.exits[i])
        if i in blocks:
            out = blocks[i].run(self.stack, adapter)  # the current position is always the last queued
            assert out is not None
            last, adapter = out[:, -1], getattr(adapter, "post", None)  # the block ran: only its post-norm map is left
        return draft_logits(self.stack, adapter, self.draft, last, trimmed)

    @property
    def can_trim(self) -> bool:
        """Whether asks may stay at the trimmed head's K columns (there is a trimmed head)."""
        return self.draft is not None

    def gate_probability(
        self,
        gate: torch.nn.Module,
        last: torch.Tensor,
        ngram_tokens: list[int] | None,
        acceptance: float,
        logits: torch.Tensor | None = None,
        trimmed: bool = False,
    ) -> torch.Tensor:
        """(b,) the gate's probability for exit states `last` (b, hidden). A gate that weighs the context gets
        `context_features` (the n-gram tier's next token per row, -1 for none; the exit's acceptance estimate); a
        head gate also the head's `logits`."""
        context, proposed = self.gate_inputs(gate, last, ngram_tokens, acceptance)
        return gate_probability(gate, last, context, logits, proposed, self.draft, trimmed).reshape(-1)

    @staticmethod
    def gate_inputs(
        gate: torch.nn.Module, last: torch.Tensor, ngram_tokens: list[int] | None, acceptance: float
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A gate's context features (b, 2) and the n-gram tier's tokens (b,), where it reads them (else None)."""
        if ngram_tokens is None or not (getattr(gate, "uses_context", False) or uses_head(gate)):
            return None, None
        return context_features(ngram_tokens, acceptance, last.device), torch.tensor(ngram_tokens, device=last.device)

    @staticmethod
    def needs_context(gate: Any) -> bool:
        """Whether the gate reads the context features (or the n-gram token, as a head gate does)."""
        return bool(getattr(gate, "uses_context", False) or uses_head(gate))
