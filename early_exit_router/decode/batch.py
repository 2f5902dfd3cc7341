"""The slots a batch's rows share, and rows joining, leaving, padding and compacting.

Every row feeds its tokens into the same columns (slots) of one rectangular tensor per layer. Left-padded slots, and
in the per-row design the holes its rejected drafts leave, are masked out of attention with a 2D attention mask, and
each row's positions count its real tokens only (HF's `cumsum(mask) - 1`), so every row is decoded as it would be
alone. One sequence without padding keeps no mask at all (the model then takes its fast causal path).

The two batch designs differ only in how a deep pass reconciles the rows' verdicts (`verify.py`): the synchronous
design cuts every row back to the shortest accepted prefix (every layer stays rectangular without holes); the per-row
design lets each row keep its own and turns the slots a row did not keep into holes. When holes make the cache much
longer than its longest row, `compact` gathers each row's real slots to the right end, in order.

Rows join and leave between steps (continuous batching, as the server does): a joining row is prefilled alone and
left-padded into the batch (`join`), a leaving row is dropped from every per-row tensor, and slots that are padding in
every row are dropped from the front (`remove`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from early_exit_router.config import RouterConfig
from early_exit_router.heads.adapters import needs_context
from early_exit_router.heads.exit_heads import ExitHeads
from early_exit_router.models import _compat


def batch_layout(
    config: RouterConfig, heads: ExitHeads, mode: str, sampling: bool, stack: Any
) -> tuple[RouterConfig, str] | None:
    """The config and design (`"synchronous"` or `"per_row"`) several rows decode under together, or None when they
    must run one after another.

    Block adapters keep a KV cache of their own per sequence, which batches do not carry: a batch consults the other
    exits (verify mode stays exact whichever exits draft), and only when every consulted exit has a block do the rows
    run alone. Verify mode runs per row under `batch_design="per_row"`, and always when sampling (one accepted prefix
    for a batch cannot keep each row's distribution); where the cache's rows cannot hold holes (a sliding window
    keeps the last slots, holes included: asked of `stack`'s cache), greedy batches fall back to the synchronous
    design and sampled ones run alone."""
    consulted = config.consulted_exit_layers()
    plain = [e for e in consulted if not needs_context(heads.adapter(e))]
    if not plain and consulted:
        return None
    if len(plain) < len(consulted):
        config = config.replace(active_exit_layers=plain)
    per_row = mode == "verify" and (sampling or config.batch_design == "per_row")
    if per_row and not _compat.cache_rows_can_change(stack.new_cache()):
        return None if sampling else (config, "synchronous")
    return config, "per_row" if per_row else "synchronous"


COMPACT_WASTE = 0.25  # compact when holes make the cache this share longer than its longest row's real slots
COMPACT_MIN = 16  # ... and at least this many slots longer


class Slots:
    """Token ids per row and slot, which slots are real, and each row's position offset."""

    def __init__(self, seq: torch.Tensor, mask: torch.Tensor | None, length: int, pad_token_id: int) -> None:
        self.seq = seq  # (b, capacity) token ids; finished rows and holes hold the pad token
        self.mask = mask  # (b, capacity), 1 for real slots; None while every slot of every row is real
        self.offset = None if mask is None else (length - mask[:, :length].sum(dim=1)).unsqueeze(1)  # (b, 1)
        self.length = length  # slots holding tokens (the same for every row)
        self.pad_token_id = pad_token_id
        self.holes = False  # a row has masked slots after its first generated token

    @classmethod
    def for_prompts(cls, ids: torch.Tensor, mask: torch.Tensor, pad_token_id: int, capacity: int) -> Slots:
        """Slots for (b, n) left-padded prompts; `capacity` slots in all, grown on demand."""
        b, n = ids.shape
        seq = torch.full((b, max(capacity, n)), pad_token_id, dtype=torch.long, device=ids.device)
        seq[:, :n] = ids
        full = None
        if not bool(mask.all()):
            full = torch.ones_like(seq)  # generated slots are real
            full[:, :n] = mask
        return cls(seq, full, n, pad_token_id)

    @property
    def rows(self) -> int:
        return self.seq.shape[0]

    def positions(self, first: int, end: int) -> torch.Tensor:
        """(b, end - first) positions of slots first..end-1: each row counts its real tokens only."""
        positions = torch.arange(first, end, device=self.seq.device).unsqueeze(0)
        if self.offset is not None:
            return positions - self.offset
        return positions if self.rows == 1 else positions.expand(self.rows, -1)

    def attention_mask(self, end: int) -> torch.Tensor | None:
        return None if self.mask is None else self.mask[:, :end]

    def real_mask(self) -> torch.Tensor:
        """The mask, made explicit (all ones) where none was kept."""
        if self.mask is None:
            self.mask = torch.ones_like(self.seq)
            self.offset = torch.zeros((self.rows, 1), dtype=torch.long, device=self.seq.device)
        return self.mask

    def grow(self, width: int) -> None:
        extra = width - self.seq.shape[1]
        if extra > 0:
            self.seq = torch.cat([self.seq, self.seq.new_full((self.rows, extra), self.pad_token_id)], dim=1)
            if self.mask is not None:
                self.mask = torch.cat([self.mask, self.mask.new_ones((self.rows, extra))], dim=1)

    def append(self, tokens: torch.Tensor, real: Sequence[bool] | None = None) -> None:
        """Write (b,) tokens into the next slot; rows with `real[r]` False get a hole there (masked for good)."""
        if self.length >= self.seq.shape[1]:  # doubling keeps appends amortized O(1) past the first capacity
            self.grow(max(self.length + 1, 2 * self.seq.shape[1]))
        self.seq[:, self.length] = tokens
        holes = real is not None and not all(real)
        if holes or self.mask is not None:  # a slot cut off by a rollback may have been a hole before
            mask = self.real_mask()
            mask[:, self.length] = 1 if not holes else torch.tensor(real, dtype=mask.dtype, device=mask.device)
            self.holes = self.holes or holes
        self.length += 1

    def hole(self, r: int, first: int, end: int) -> None:
        """Mask slots first..end-1 of row r for good (rejected drafts it did not keep); its later slots move up."""
        if end <= first:
            return
        self.real_mask()[r, first:end] = 0
        self.offset[r] += end - first
        self.holes = True

    def row_ids(self, r: int, end: int, prompt_ids: torch.Tensor, start: int, new: list[int]) -> torch.Tensor:
        """(1, n) what HF's processors and stopping criteria see for row r up to slot `end`: its padded prompt and its
        generated tokens so far (holes skipped)."""
        count = end - start if not self.holes else int(self.mask[r, start:end].sum())
        return self.ids_through(r, count, prompt_ids, start, new)

    def ids_through(self, r: int, count: int, prompt_ids: torch.Tensor, start: int, new: list[int]) -> torch.Tensor:
        """(1, n) as `row_ids`, through row r's `count`-th generated token."""
        if not self.holes:
            return self.seq[r : r + 1, : start + count]
        generated = torch.tensor([new[:count]], dtype=prompt_ids.dtype, device=prompt_ids.device)
        return torch.cat([prompt_ids, generated], dim=1)

    # ------------------------------------------------------------------------------------- rows in and out
    def pad_front(self, count: int) -> None:
        """Prepend `count` padding slots to every row; positions are unchanged."""
        if count <= 0:
            return
        mask = self.real_mask()
        self.seq = torch.cat([self.seq.new_full((self.rows, count), self.pad_token_id), self.seq], dim=1)
        self.mask = torch.cat([mask.new_zeros((self.rows, count)), mask], dim=1)
        self.offset = self.offset + count
        self.length += count

    def drop_front(self, count: int) -> None:
        self.seq, self.offset = self.seq[:, count:], self.offset - count
        self.mask = self.mask[:, count:]
        self.length -= count

    def common_padding(self) -> int:
        """Leading slots that are padding in every row."""
        if self.mask is None:
            return 0
        first_real = torch.where(self.mask[:, : self.length].bool().any(dim=0))[0]
        return int(first_real[0]) if first_real.numel() else 0

    def select(self, index: torch.Tensor) -> None:
        self.seq = self.seq[index]
        if self.mask is not None:
            self.mask, self.offset = self.mask[index], self.offset[index]

    def concat(self, other: Slots) -> None:
        width = max(self.seq.shape[1], other.seq.shape[1])
        self.grow(width)
        other.grow(width)
        mask, other_mask = self.real_mask(), other.real_mask()
        self.seq = torch.cat([self.seq, other.seq])
        self.mask = torch.cat([mask, other_mask])
        self.offset = torch.cat([self.offset, other.offset])
        self.holes = self.holes or other.holes


def join(batch: Any, single: Any) -> None:
    """Left-pad a prefilled one-row decoder `single` into `batch` (both have nothing waiting)."""
    behind = (batch.slots.length - 1) - (single.slots.length - 1)  # slots the newcomer is shorter by
    if behind < 0:
        _pad_front(batch, -behind)
    else:
        _pad_front(single, behind)
    batch.slots.concat(single.slots)
    _compat.concat_cache_rows(batch.fill.cache, single.fill.cache)
    batch.rows.append(single.rows[0])
    single.rows[0].passes_from = batch.passes.copy()  # its statistics count the batch's passes from here on


def _pad_front(decoder: Any, count: int) -> None:
    if count <= 0:
        return
    decoder.slots.pad_front(count)
    _compat.pad_cache_front(decoder.fill.cache, count)
    decoder.fill.deep_len += count
    for row in decoder.rows:
        row.start += count


def remove(decoder: Any, rows: list[Any]) -> None:
    """Drop `rows` (finished or cancelled) from every per-row tensor, then the padding every row left shares. Rows
    may leave with drafts in flight (a cancelled request): what is keyed by slot (the cycle's first slot, each row's
    drafts) moves with the dropped slots, so the next deep pass verifies the same drafts at the same positions."""
    keep = [k for k, row in enumerate(decoder.rows) if row not in rows]
    if len(keep) == len(decoder.rows):
        return
    for row in decoder.rows:
        if row in rows:  # its statistics end here
            row.passes_to = decoder.passes.copy()
    decoder.rows = [decoder.rows[k] for k in keep]
    if not decoder.rows:
        decoder.reset()
        return
    # the controller stops loosening for an output that diverged, not for the rows that outlive it
    decoder.routing.diverged = any(row.counters.diverged is not None for row in decoder.rows)
    index = torch.tensor(keep, device=decoder.slots.seq.device)
    decoder.slots.select(index)
    decoder.fill.cache.batch_select_indices(index)
    decoder.fill.waiting_rows(index)
    count = decoder.slots.common_padding()
    if count > 0:
        decoder.slots.drop_front(count)
        _compat.drop_cache_front(decoder.fill.cache, count)
        decoder.fill.deep_len -= count
        if decoder.cycle is not None:
            decoder.cycle.start -= count
        for row in decoder.rows:
            row.start -= count
            row.drafts = {slot - count: draft for slot, draft in row.drafts.items()}


def maybe_compact(decoder: Any) -> bool:
    """Gather each row's real slots to the right end when holes have made the cache much longer than needed (nothing
    may wait). Returns whether it compacted."""
    slots = decoder.slots
    if not slots.holes:
        return False
    cached = slots.length - 1  # slots in the cache (the current token's is not yet)
    real = slots.mask[:, :cached].sum(dim=1)  # (b,)
    widest = int(real.max())
    if cached - widest < max(COMPACT_MIN, COMPACT_WASTE * widest):
        return False
    # A stable sort puts each row's masked slots first and its real ones after, both in slot order; the last
    # `widest` entries are then the row's real slots, right-aligned, behind masked (padding) slots.
    order = torch.sort(slots.mask[:, :cached], dim=1, stable=True).indices[:, cached - widest :]  # (b, widest)
    prompt_real = [int(slots.mask[r, : row.start].sum()) for r, row in enumerate(decoder.rows)]
    _compat.gather_cache_slots(decoder.fill.cache, order)
    slots.seq = torch.cat([slots.seq.gather(1, order), slots.seq[:, cached:]], dim=1)
    slots.mask = torch.cat([slots.mask.gather(1, order), slots.mask[:, cached:]], dim=1)
    slots.offset = (widest - real).unsqueeze(1)
    for r, row in enumerate(decoder.rows):
        row.start = int(slots.offset[r]) + prompt_real[r]
    slots.length, decoder.fill.deep_len = widest + 1, widest
    return True
