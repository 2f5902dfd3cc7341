"""Drafting from a base-exact adapted draft path (`heads/draft_path.py`): the adapted copies of layers 0..E run over
a KV cache of their own, exit E's head drafts a chain of tokens, and the untouched model verifies the chain from its
embeddings in one pass, as it verifies the n-gram tier's copies (`drafting.append_ngram`).

The draft cache follows the row's tokens by content: before each chain it keeps the longest prefix it shares with the
row's tokens (a position's keys and values depend only on the ids up to it, so whatever replaced the rest, a rejected
draft or a token the full model chose, is simply fed again) and feeds the rest in one pass. One sequence at a time.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from early_exit_router.heads.draft import DraftHead, draft_logits
from early_exit_router.heads.draft_path import DraftPath
from early_exit_router.models import _compat
from early_exit_router.models.architecture import LayerStack, run_in_place_of


class AdaptedDrafter:
    """Chains of drafts from the adapted draft path for one sequence, with their own cache."""

    def __init__(self, stack: LayerStack, path: DraftPath, adapter: torch.nn.Module | None, draft: DraftHead | None):
        self.stack, self.path, self.adapter, self.draft = stack, path, adapter, draft
        self.reset()

    @classmethod
    def for_decoder(cls, dec: Any, path: DraftPath | None) -> AdaptedDrafter | None:
        """The drafter of decoder `dec` for draft path `path`: verify mode, while the path's exit is consulted (its
        head is the exit's trained with the copies, where the heads have that exit); else None."""
        if path is None or dec.mode != "verify" or path.exit_layer not in dec.exits:
            return None
        at = path.exit_layer
        adapter = dec.heads.adapter(at) if at in dec.heads.exit_layers else None
        return cls(dec.stack, path, adapter, dec.exit_drafter.draft)

    def reset(self) -> None:
        """A new sequence: an empty cache."""
        self.cache = self.stack.new_cache()
        _compat.prepare_for_rollback(self.cache)  # sliding layers keep what a rejected tail needs to be cut back
        self.fed: list[int] = []  # the ids whose keys and values the cache holds

    def _keep(self, count: int) -> None:
        for layer_idx in range(len(self.path.layers)):
            _compat.crop_cache_layer(self.cache, layer_idx, count)
        del self.fed[count:]

    @torch.inference_mode()
    def propose(
        self, tokens: list[int], budget: int, threshold: float, end_ids: Collection[int] = frozenset()
    ) -> list[int]:
        """Up to `budget` tokens to follow `tokens` (the row's, prompt included): the draft head's greedy chain,
        ending before the first token whose probability is below `threshold`, or at the first of `end_ids` (the row
        stops there: a draft past it would only cost passes)."""
        shared = len(self.fed)
        if tokens[:shared] != self.fed:  # one comparison in the usual case: only the row's newest tokens are new
            pairs = enumerate(zip(self.fed, tokens))
            shared = next((i for i, (a, b) in pairs if a != b), min(len(self.fed), len(tokens)))
        self._keep(min(shared, len(tokens) - 1))  # the last token is fed again when nothing else is new
        feed, chain = tokens[len(self.fed) :], []
        device = self.stack.device
        while len(chain) < budget:
            start = len(self.fed)
            positions = torch.arange(start, start + len(feed), device=device).unsqueeze(0)  # (1, q)
            hidden = self.stack.embed(torch.tensor([feed], device=device), positions=positions)
            hidden = run_in_place_of(self.stack, self.path.layers, hidden, self.cache, positions)
            self.fed += feed
            logits = draft_logits(self.stack, self.adapter, self.draft, hidden[:, -1], trimmed=True)  # (1, K|vocab)
            best, index = torch.softmax(logits.float(), dim=-1).max(dim=-1)
            if float(best) < threshold:
                break
            token = int(index) if self.draft is None else int(self.draft.token_ids[index])
            chain.append(token)
            if token in end_ids:
                break
            feed = [token]
        return chain
