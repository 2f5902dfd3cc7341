"""Acceptance rules: which drafts a deep pass keeps. Pure functions; the decoder applies them row by row.

A deep pass over a chunk gives the full model's prediction at every drafted position. A row keeps the longest prefix
of its drafts the full model agrees with (`accept_greedy`); when sampling, the full model's token at each position is
its draw there with that position's noise, the draw plain sampling makes from the same generator state, and a draft
is kept where it equals it (`accept_sampled`). A copy x is thus kept with probability p(x), as speculative sampling
(Leviathan et al. 2023) keeps it, every row's tokens follow the full model's law, and with a seed they are the
tokens plain sampling gives, whatever was drafted (`noise.py`).
A batch then reconciles its rows' verdicts: the synchronous design keeps one length for every row
(`shortest_prefix`), the per-row design lets each row keep its own and masks the rest (`longest_prefix` is how far the
batch's slots reach).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_greedy(choices: Sequence[int], drafts: Sequence[int]) -> int:
    """How many drafts lead the full model's choices (`choices[j]`: its token after the j-th draft's prefix)."""
    return next((j for j, (c, d) in enumerate(zip(choices, drafts)) if c != d), len(drafts))


def accept_sampled(p: torch.Tensor, noise: torch.Tensor, drafts: Sequence[int]) -> tuple[list[bool], list[int]]:
    """Sampling over one row's chunk. `p` (m, vocab): the full model's laws at the m predicted positions; `noise`
    (m, vocab): those positions' draws (`noise.SamplingNoise`); `drafts`: n <= m drafted tokens, at the first n
    positions. The full model's token at each position is argmax(p / noise), what `torch.multinomial` draws with that
    noise. Returns the verdicts up to and including the first refusal, and the full model's token at every position:
    the one after a kept prefix of k drafts is `tokens[k]` (none where k = m), also where a synchronous batch keeps
    fewer drafts than this row accepted (each position's draw is plain sampling's, whatever the row kept)."""
    tokens = (p / noise).argmax(dim=-1).tolist()  # one host sync
    kept = accept_greedy(tokens, drafts)
    verdicts = [True] * kept + ([False] if kept < len(drafts) else [])
    return verdicts, tokens


def shortest_prefix(accepted: Sequence[int], active: Sequence[bool], n: int) -> int:
    """Synchronous batches: every row keeps the shortest accepted prefix among the unfinished rows (`n` if none),
    so all rows keep one length and every layer's cache stays rectangular."""
    return min((a for a, on in zip(accepted, active) if on), default=n)


def longest_prefix(accepted: Sequence[int], active: Sequence[bool]) -> int:
    """Per-row batches: each row keeps its own prefix; the batch's slots reach as far as the longest one (the rows
    that kept less have holes up to there)."""
    return max((a for a, on in zip(accepted, active) if on), default=0)
