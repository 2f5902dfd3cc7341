"""Cached hidden states: one no-grad pass over a corpus stores, per token, the hidden state at every exit and the
final normed hidden state (`HiddenStateCache`, chunk after chunk of consecutive positions), and what the heads and
the full model predict from them.

The teacher's logits are recomputed from the stored final state, which is exact and far smaller than storing them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from early_exit_router.heads.adapters import needs_context
from early_exit_router.heads.draft import DraftHead, exit_normed, logits_from_normed


@dataclass
class HiddenStateCache:
    """Per-position hidden states of a frozen model over a corpus."""

    exits: dict[int, torch.Tensor]  # layer -> (N, hidden), output of that layer
    final_normed: torch.Tensor  # (N, hidden): final norm applied to the last layer's output
    next_token: torch.Tensor  # (N,) the corpus' next token, -1 at the end of a chunk
    chunk_len: int = 0  # positions come in chunks of this many consecutive ones (0: single positions, no order)

    def __len__(self) -> int:
        return self.final_normed.shape[0]

    @property
    def num_chunks(self) -> int:
        return len(self) // self.chunk_len if self.chunk_len else 0

    def split(self, holdout_share: float, seed: int) -> tuple[HiddenStateCache, HiddenStateCache]:
        """(train, held out): a seeded share of whole chunks held out (of positions, without chunks), so that no
        held-out position sits between training positions of the same text."""
        order, n_hold = self._draw(holdout_share, seed)
        return self._units(order[n_hold:]), self._units(order[:n_hold])

    def sample(self, share: float, seed: int) -> HiddenStateCache:
        """A seeded `share` of the whole chunks (of the positions, without chunks), at least one; all of it at 1: what
        `split` would hold out, without copying the rest."""
        if share >= 1.0:
            return self
        order, n = self._draw(share, seed)
        return self._units(order[:n])

    def _draw(self, share: float, seed: int) -> tuple[torch.Tensor, int]:
        """A seeded order of the chunks (of the positions, without chunks) and how many of them make `share`."""
        total = self.num_chunks if self.chunk_len else len(self)
        return torch.randperm(total, generator=torch.Generator().manual_seed(seed)), max(1, int(total * share))

    def _units(self, picked: torch.Tensor) -> HiddenStateCache:
        """The chunks `picked` (the positions, without chunks)."""
        return self.select_chunks(picked) if self.chunk_len else self.select(picked)

    def save(self, path: str | Path) -> None:
        """Write the cache to one file (reloaded by `load`, memory-mapped)."""
        torch.save(
            {"exits": self.exits, "final": self.final_normed, "next": self.next_token, "chunk_len": self.chunk_len},
            path,
        )

    @classmethod
    def load(cls, path: str | Path, exit_layers: list[int]) -> HiddenStateCache:
        """The cache saved at `path`, memory-mapped, keeping `exit_layers` (which it must cover)."""
        data = torch.load(path, mmap=True)
        missing = sorted(set(exit_layers) - set(data["exits"]))
        if missing:
            raise ValueError(
                f"The hidden states in {path} do not cover exit layers {missing} (they have {sorted(data['exits'])}): "
                "remove the file or pass another path, so that they are computed again."
            )
        exits = {e: data["exits"][e] for e in exit_layers}
        return cls(exits, data["final"], data["next"], data["chunk_len"])

    @classmethod
    def concat(cls, caches: list[HiddenStateCache]) -> HiddenStateCache:
        """The caches' positions one after the other; they must come in chunks of one length (or none)."""
        layers = [sorted(c.exits) for c in caches]
        if any(other != layers[0] for other in layers):
            raise ValueError(f"Cannot join hidden states of different exit layers ({layers}): build them alike.")
        lens = sorted({c.chunk_len for c in caches})
        if len(lens) > 1:
            raise ValueError(f"Cannot join hidden states cut in chunks of {lens} positions: build them alike.")
        chunk_len = lens[0]
        return cls(
            {e: torch.cat([c.exits[e] for c in caches]) for e in caches[0].exits},
            torch.cat([c.final_normed for c in caches]),
            torch.cat([c.next_token for c in caches]),
            chunk_len,
        )

    def select(self, idx: torch.Tensor) -> HiddenStateCache:
        """Positions `idx` (their chunk structure is lost)."""
        return HiddenStateCache(
            {e: h[idx] for e, h in self.exits.items()}, self.final_normed[idx], self.next_token[idx]
        )

    def select_chunks(self, chunks: torch.Tensor) -> HiddenStateCache:
        """Whole chunks, in the order given."""
        idx = chunk_positions(chunks, self.chunk_len)
        picked = self.select(idx)
        picked.chunk_len = self.chunk_len
        return picked


def chunk_positions(chunks: torch.Tensor, chunk_len: int) -> torch.Tensor:
    """(c,) chunk indices -> (c * chunk_len,) their positions, chunk after chunk."""
    return (chunks.unsqueeze(1) * chunk_len + torch.arange(chunk_len)).flatten()


def cut_chunks(sequences: list[list[int]], chunk_len: int) -> torch.Tensor:
    """(n, chunk_len): the sequences concatenated and cut into chunks, a shorter tail dropped (n may be 0)."""
    stream = torch.tensor([t for seq in sequences for t in seq], dtype=torch.long)
    n = len(stream) // chunk_len
    return stream[: n * chunk_len].view(n, chunk_len)


@torch.no_grad()
def build_cache(
    stack: Any,
    exit_layers: list[int],
    sequences: list[list[int]],
    chunk_len: int = 256,
    batch_size: int = 4,
    progress: bool = True,
) -> HiddenStateCache:
    """Run the frozen model over `sequences` (concatenated, cut into chunks) and keep the states training needs."""
    chunks = cut_chunks(sequences, chunk_len)  # (chunks, chunk_len)
    n_chunks = len(chunks)
    if not n_chunks:
        tokens = sum(map(len, sequences))
        raise ValueError(f"The text is {tokens} tokens, less than one {chunk_len}-token chunk: give more text.")
    exits: dict[int, list[torch.Tensor]] = {e: [] for e in exit_layers}
    finals, nexts = [], []
    bounds = [0] + [e + 1 for e in exit_layers] + [stack.num_layers]
    positions = torch.arange(chunk_len, device=stack.device).unsqueeze(0)
    for start in tqdm(range(0, n_chunks, batch_size), desc="caching hidden states", disable=not progress):
        ids = chunks[start : start + batch_size].to(stack.device)
        hidden = stack.embed(ids)
        for i, e in enumerate(exit_layers):
            hidden = stack.run(hidden, bounds[i], bounds[i + 1], None, positions)
            exits[e].append(hidden.reshape(-1, stack.hidden_size).float().cpu())
        hidden = stack.run(hidden, bounds[-2], bounds[-1], None, positions)
        finals.append(stack.final_norm(hidden).reshape(-1, stack.hidden_size).float().cpu())
        nxt = torch.full_like(ids, -1)
        nxt[:, :-1] = ids[:, 1:]
        nexts.append(nxt.reshape(-1).cpu())
    exits_cat = {e: torch.cat(v) for e, v in exits.items()}
    return HiddenStateCache(exits_cat, torch.cat(finals), torch.cat(nexts), chunk_len)


def head_logits(
    stack: Any,
    adapter: nn.Module | None,
    hidden: torch.Tensor,
    chunk_len: int = 0,
    draft: DraftHead | None = None,
) -> torch.Tensor:
    """Exit-head logits (N, vocab) in float32 for cached hidden states (N, hidden); adapter None is the logit lens.

    A block adapter reads the context: `hidden` is then whole chunks of `chunk_len` consecutive positions. With
    `draft`, the logits are the trimmed draft head's (-inf outside its ids), as the engine drafts."""
    hidden = hidden.to(device=stack.device, dtype=stack.dtype)
    if needs_context(adapter):
        if not chunk_len or hidden.shape[0] % chunk_len:
            raise ValueError("A block adapter runs over whole chunks: pass positions in chunks of chunk_len.")
        normed = exit_normed(stack, adapter, hidden.view(-1, chunk_len, hidden.shape[-1])).flatten(0, 1)
    else:
        normed = exit_normed(stack, adapter, hidden)
    return logits_from_normed(stack, draft, normed).float()


def batch_size_for(cache: HiddenStateCache, target: int = 1024) -> int:
    """Positions per evaluation batch: whole chunks when the cache has them."""
    return cache.chunk_len * max(1, target // cache.chunk_len) if cache.chunk_len else target


@torch.no_grad()
def teacher_top1(router: Any, cache: HiddenStateCache, batch: int = 1024) -> torch.Tensor:
    """(N,) the full model's top-1 token at every cached position, chosen as decoding chooses it (`precise_logits`)."""
    stack, precise = router.stack, router.config.precise_logits
    normed = cache.final_normed
    return torch.cat(
        [
            stack.unembed(normed[s : s + batch].to(stack.device, stack.dtype), precise).argmax(-1).cpu()
            for s in range(0, len(cache), batch)
        ]
    )


@torch.no_grad()
def exit_top1(
    router: Any, cache: HiddenStateCache, layer: int, trained: bool = True, with_confidence: bool = False
) -> Any:
    """(N,) the exit head's top-1 token (trained adapter, or the logit lens when `trained` is False), from the
    trimmed draft head where the router drafts from one; with `with_confidence`, also (N,) its probability."""
    adapter = router.heads.adapter(layer) if trained else None
    stack, batch = router.stack, batch_size_for(cache)
    draft = router.heads.draft_head(stack, router.config.draft_vocab_size, router.config.half_draft_head)
    tops, confidences = [], []
    for s in range(0, len(cache), batch):
        logits = head_logits(stack, adapter, cache.exits[layer][s : s + batch], cache.chunk_len, draft)
        confidence, top = torch.softmax(logits, dim=-1).max(dim=-1)
        tops.append(top.cpu())
        confidences.append(confidence.cpu())
    return (torch.cat(tops), torch.cat(confidences)) if with_confidence else torch.cat(tops)
