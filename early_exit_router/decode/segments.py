"""Exit layer ranges and layer-wise KV filling, on (batch, positions, hidden) tensors.

Layers are split into segments at the exit points: with exits `e_0 < e_1 < ...`, segment 0 is layers `0..e_0`,
segment `i + 1` is layers `e_i + 1 .. e_{i+1}`, and the last segment ends at the last layer. Every layer of a
segment always holds the same slots in the cache.

A token that exits at exit `i` leaves its hidden state (the output of segment `i`) in `buffers[i + 1]`, in front of
segment `i + 1`. The slots in `buffers[s]` are exactly those segment `s - 1` has seen and segment `s` has not, so they
are consecutive; `buffers[0]` holds embeddings of slots the zero-layer n-gram tier drafted. When a later token reaches
segment `s`, the waiting slots join it and the whole chunk runs segment `s` in one batched pass: that is the
layer-wise KV fill. After the last segment, the chunk's final-layer states give the full model's prediction at every
waiting slot, and every layer's cache holds what a full forward pass over the same tokens would.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from early_exit_router.heads.block import BlockContext
from early_exit_router.heads.exit_heads import ExitHeads
from early_exit_router.models import _compat
from early_exit_router.models.architecture import LayerStack


class Reached(NamedTuple):
    """Where a walk through the segments stands: after exit `exit` (the number of exits: the full depth), with the
    chunk's states `hidden` (b, m, hidden) for slots `chunk_start`..."""

    exit: int
    hidden: torch.Tensor | None
    chunk_start: int


class LayerwiseFill:
    """The model's cache, the hidden states waiting in front of each segment, and the block adapters' contexts.

    `costs` pads one sequence's chunks to the cheapest measured length (its table is one row's); `blocks` (one
    sequence only) holds, per exit with a block adapter, its own KV cache: every position's state at that exit is
    queued for it in order."""

    def __init__(
        self,
        stack: LayerStack,
        heads: ExitHeads,
        exits: list[int],
        cache: Any,
        blocks: dict[int, BlockContext],
        costs: Any = None,
    ) -> None:
        self.stack, self.heads, self.exits, self.cache, self.blocks, self.costs = (
            stack,
            heads,
            exits,
            cache,
            blocks,
            costs,
        )
        self.starts = [0] + [e + 1 for e in exits] + [stack.num_layers]  # segment s runs [starts[s], starts[s + 1])
        self.buffers: list[torch.Tensor | None] = [None] * (len(exits) + 1)  # (b, m, hidden) waiting per segment
        self.deep_len = 0  # slots the last layer has seen

    @property
    def segments(self) -> int:
        return len(self.exits) + 1

    def prefill(
        self, hidden: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Every layer over the prompt (b, n, hidden), stopping only where a block adapter needs the states."""
        i = 0
        while i < self.segments:
            last = self.range_end(i, set())
            hidden = self.stack.run(hidden, self.starts[i], self.starts[last + 1], self.cache, positions,
                                    attention_mask=attention_mask)  # fmt: skip
            self._to_block(last, hidden, 0)
            i = last + 1
        self.deep_len = hidden.shape[1]
        return hidden

    def run(
        self,
        i: int,
        hidden: torch.Tensor | None,
        chunk_start: int,
        end: int,
        slots: Any,
        last: int | None = None,
    ) -> tuple[torch.Tensor | None, int]:
        """Run segment `i` (through segment `last`, when given) over the chunk, after the slots waiting in front of
        it: the layer-wise KV fill.

        `hidden` covers slots chunk_start..end-1 (None: nothing arrives from below); the waiting slots come just
        before them. Segments after `i` up to `last` must have nothing waiting. Returns the output of the last
        segment run and the chunk's new first slot."""
        last = i if last is None else last
        waiting = self.buffers[i]
        if waiting is not None:
            chunk_start -= waiting.shape[1]
            hidden = waiting if hidden is None else torch.cat([waiting, hidden], dim=1)  # (b, m, hidden)
            self.buffers[i] = None
        if hidden is None:
            return None, chunk_start
        pad_to = self.costs.layer_pad(hidden.shape[1]) if self.costs is not None and hidden.shape[0] == 1 else 0
        out = self.stack.run(hidden, self.starts[i], self.starts[last + 1], self.cache,
                             slots.positions(chunk_start, end), pad_to, slots.attention_mask(end))  # fmt: skip
        self._to_block(last, out, chunk_start)
        return out, chunk_start

    def walk(
        self, hidden: torch.Tensor | None, chunk_start: int, end: int, slots: Any, stops: set[int]
    ) -> Iterator[Reached]:
        """Run every segment in turn over the chunk ending at slot `end`, each after the slots waiting in front of it,
        and yield where it stands at every exit in `stops`, then at the full depth. A caller stops iterating where a
        token leaves."""
        i = 0
        while i < self.segments:
            last = self.range_end(i, stops)
            hidden, chunk_start = self.run(i, hidden, chunk_start, end, slots, last)
            i = last + 1
            if last in stops or last == len(self.exits):
                yield Reached(last, hidden, chunk_start)

    def range_end(self, i: int, stops: set[int]) -> int:
        """The last segment one layer range starting at segment `i` may cover: it ends at an exit in `stops`, at a
        block adapter's exit (the block needs every position's state there) and before waiting slots. One range runs
        with one mask and rotary table instead of one per segment."""
        last = i
        while last < len(self.exits) and last not in stops and last not in self.blocks:
            if self.buffers[last + 1] is not None:
                break
            last += 1
        return last

    def park(self, i: int, hidden: torch.Tensor) -> None:
        """An exit at exit `i`: the chunk's states wait in front of segment `i + 1`."""
        waiting = self.buffers[i + 1]
        self.buffers[i + 1] = hidden if waiting is None else torch.cat([waiting, hidden], dim=1)

    def queue(self, embedded: torch.Tensor) -> None:
        """Drafts of the zero-layer tier: their embeddings wait in front of segment 0."""
        self.park(-1, embedded)

    def rollback(self, keep: int) -> None:
        """Drop every slot from `keep` on, in every layer's cache and every block's context; nothing waits after."""
        for layer_idx in range(self.stack.num_layers):
            _compat.crop_cache_layer(self.cache, layer_idx, keep)
        for block in self.blocks.values():
            block.rollback(keep)
        self.deep_len = keep
        self.buffers = [None] * self.segments

    def waiting_rows(self, index: torch.Tensor) -> None:
        """Keep only the rows `index` of every waiting state (rows leaving a batch)."""
        self.buffers = [None if b is None else b[index] for b in self.buffers]

    def _to_block(self, i: int, states: torch.Tensor, first: int) -> None:
        if i in self.blocks:  # the block adapter at this exit sees every position once, in order
            self.blocks[i].push(states, first, self.stack, self.heads.adapter(self.exits[i]))
