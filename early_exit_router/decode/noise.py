"""Sampling noise by position: what makes a sampled decode's tokens independent of what was drafted.

`torch.multinomial(p, 1)` draws a vector E of Exp(1) variables over the vocabulary and returns argmax(p / E) (for a
batch, one (b, vocab) block per call, which HF's sampling makes once per step). So a decode that draws the same
blocks in the same order, one per position of the new tokens, and chooses argmax(p / E_t) at position t, samples the
tokens plain sampling samples from the same generator state. A draft at position t, whatever proposed it (an exit's
own draw with that noise, a copy), is kept when it equals that token: a copy x then with probability p(x), as
speculative sampling keeps it, and every token follows the full model's law. The tokens depend on the generator's
state and the full model alone, not on the n-gram store or the cost table, which only change how many passes they
take; and a decode leaves the generator where plain sampling of the same tokens would (`settle`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from early_exit_router.decode.sampling import TokenSelector

DONE = math.inf  # `SamplingNoise.release`'s position for a row that has ended


class SamplingNoise:
    """The noise of the rows that sample from one generator: per new-token position, a (rows, vocab) block of
    Exp(1) draws, drawn in the order of the positions when one is first needed (by any row) and kept until every
    row's token there is final."""

    def __init__(
        self,
        generator: torch.Generator | None,
        rows: int,
        device: torch.device,
        batch_row: tuple[int, int] | None = None,
    ) -> None:
        self.generator = generator if generator is not None else _default_generator(device)
        self.rows, self.device, self.vocab = rows, device, 0
        self.batch_row = batch_row  # (r, b): one row decoded alone, row r of b-row blocks (`RowByRow`)
        self.drawn = 0  # blocks drawn
        self.first = 0  # the position of blocks[0]
        self.blocks: list[torch.Tensor] = []
        self.finals: list[float] = [0] * rows  # per row: its tokens before this position are final
        self.longest = 0  # new tokens the longest output has at least: `settle` rewinds to no fewer blocks
        self.start = self._state()  # the generator before any block ...
        self.states: dict[int, torch.Tensor | None] = {-1: self.start}  # ... after block k, for k >= longest - 1
        self.shared = False  # another decode drew from the generator between this one's draws: never rewind it

    def at(self, position: int, row: int, vocab: int) -> torch.Tensor:
        """(vocab,) float32 noise of `row`'s new token `position` (0-based), drawing the blocks before it first."""
        self.vocab = vocab
        while self.drawn <= position:
            if not self.shared and self.generator is not None:
                self.shared = not torch.equal(self.generator.get_state(), self.states[self.drawn - 1])
            self.blocks.append(self._draw())
            self.states[self.drawn] = self._state()
            self.drawn += 1
        return self.blocks[position - self.first][row]

    def release(self, row: int, final: float, length: int = 0) -> None:
        """`row`'s tokens before position `final` are final (`DONE`: the row has ended, with `length` new tokens);
        the blocks every row is past go, and the states no rewind can reach."""
        self.finals[row] = final
        self.longest = max(self.longest, length if final == DONE else int(final))
        drop = int(min(min(self.finals), self.drawn)) - self.first
        if drop > 0:
            del self.blocks[:drop]
            self.first += drop
        keep = min(self.longest, self.drawn) - 1
        if min(self.states) < keep:
            self.states = {k: v for k, v in self.states.items() if k >= keep}

    def settle(self, blocks: int) -> None:
        """Leave the generator as `blocks` plain sampling steps leave it (HF's draw one block a step, until the
        longest row ends), where blocks were drawn ahead for drafts past the end."""
        if self.generator is None or self.drawn <= blocks:
            return
        if self.shared or not torch.equal(self.generator.get_state(), self.states[self.drawn - 1]):
            return  # another decode drew from it too (the server's requests share the default one): leave it
        if blocks - 1 in self.states:
            self.generator.set_state(self.states[blocks - 1])
            return
        self.generator.set_state(self.start)  # fewer blocks than a final token had: draw them again
        for _ in range(blocks):
            self._draw()

    def _draw(self) -> torch.Tensor:
        rows = self.rows if self.batch_row is None else self.batch_row[1]
        block = torch.empty(rows, self.vocab, dtype=torch.float32, device=self.device)
        block.exponential_(generator=self.generator)
        if self.batch_row is None:
            return block
        r = self.batch_row[0]
        return block[r : r + 1].clone()  # the row alone: the others' draws are not held

    def _state(self) -> torch.Tensor | None:
        return None if self.generator is None else self.generator.get_state()


def noise_sources(selectors: Sequence[TokenSelector], device: torch.device) -> list[tuple[SamplingNoise | None, int]]:
    """Each row's noise (None: greedy) and its row in it. Sampling rows whose selectors share a generator (None:
    the device's default one, which HF's sampling uses) share one noise, in their order, as HF's batch shares its
    blocks."""
    groups: dict[int, list[int]] = {}
    for r, selector in enumerate(selectors):
        if selector.params.do_sample:
            groups.setdefault(id(_generator_of(selector, device)), []).append(r)
    sources: list[tuple[SamplingNoise | None, int]] = [(None, 0)] * len(selectors)
    for rows in groups.values():
        first = selectors[rows[0]]
        noise = SamplingNoise(first.generator, len(rows), device, first.batch_row if len(rows) == 1 else None)
        for k, r in enumerate(rows):
            sources[r] = (noise, k)
    return sources


def settle_generators(rows: Sequence[Any]) -> None:
    """At a decode's end, leave each generator its rows (`state.Row`) sampled from where plain sampling of their
    outputs leaves it (it draws one block a step until the longest row ends)."""
    for noise in {id(row.noise): row.noise for row in rows if row.noise is not None}.values():
        noise.settle(max(len(row.output()) for row in rows if row.noise is noise))


class RowByRow:
    """The generator of a sampled batch decoded one row after another (`output.run_rows_alone`): every row's decode
    starts from the generator's state before the batch and samples with its row of the (rows, vocab) blocks (its
    selector's `alone_in_batch`), so each row draws what HF's batched sampling draws for it; the batch leaves the
    generator where its longest row's decode left it, as HF's batch draws until its longest row ends."""

    def __init__(self, selector: TokenSelector, device: torch.device) -> None:
        self.generator = _generator_of(selector, device) if selector.params.do_sample else None
        self.start = None if self.generator is None else self.generator.get_state()
        self.longest, self.end = -1, None

    def before_row(self) -> None:
        if self.generator is not None:
            self.generator.set_state(self.start)

    def after_row(self, new_tokens: int) -> None:
        if self.generator is not None and new_tokens > self.longest:
            self.longest, self.end = new_tokens, self.generator.get_state()

    def finish(self) -> None:
        if self.end is not None:
            self.generator.set_state(self.end)


def skip_positions(generator: torch.Generator | None, count: int, vocab: int, device: torch.device) -> None:
    """Advance `generator` past the noise of `count` positions of one sequence, drawn before (a decode that
    continues another from the tokens it made: its positions then draw what they would have drawn there)."""
    if generator is not None:
        for _ in range(count):
            torch.empty(1, vocab, dtype=torch.float32, device=device).exponential_(generator=generator)


def _generator_of(selector: TokenSelector, device: torch.device) -> torch.Generator | None:
    """The generator `selector` samples from: its own (seeded), else the device's default one."""
    return selector.generator if selector.generator is not None else _default_generator(device)


def _default_generator(device: torch.device) -> torch.Generator | None:
    """The generator torch samples with on `device` when none is given (None where it is not reachable)."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return None
