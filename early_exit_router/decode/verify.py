"""Acceptance rules: which drafts a deep pass keeps. Pure functions; the decoder applies them row by row.

A deep pass over a chunk gives the full model's prediction at every drafted position. A row keeps the longest prefix
of its drafts the full model agrees with (`accept_greedy`), or, when sampling, each draft x with probability
min(1, p(x) / q(x)) in turn and, at the first refusal, a token drawn from max(0, p - q) renormalised
(`accept_sampled`: speculative sampling, Leviathan et al. 2023), so every row's tokens follow the full model's law.
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


def accept_sampled(
    p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, generator: torch.Generator | None
) -> tuple[list[bool], int | None]:
    """Speculative sampling over one row's chunk.

    `p` (m, vocab): the full model's distributions at the m predicted positions; `drafts` (n,), n <= m: the drafted
    tokens at the first n of them; `q` (n, vocab): the distributions they were drawn from (None: every draft was
    deterministic, q = a point mass on it, as the n-gram tier proposes). Returns the verdicts up to and including the
    first refusal, and the token that follows the accepted prefix: drawn from max(0, p - q) after a refusal, from
    p after a fully accepted chunk with a prediction left (m > n), else None."""
    n = drafts.shape[0]
    verdicts: list[bool] = []
    if n:
        u = torch.rand(n, device=p.device, generator=generator)
        p_x = p[:n].gather(1, drafts[:, None])[:, 0]
        q_x = torch.ones_like(p_x) if q is None else q.gather(1, drafts[:, None])[:, 0]
        verdicts = (u * q_x <= p_x).tolist()  # accept x with probability min(1, p(x) / q(x))
    accepted = next((j for j, ok in enumerate(verdicts) if not ok), n)
    if accepted < n:
        if q is None:  # max(0, p - point mass at x) is p without x
            residual = p[accepted].index_fill(0, drafts[accepted : accepted + 1], 0.0)
        else:
            residual = (p[accepted] - q[accepted]).clamp_min(0)
        residual = torch.where(residual.sum() > 0, residual, p[accepted])  # p == q up to rounding
        token = int(torch.multinomial(residual, 1, generator=generator))
        return verdicts[: accepted + 1], token
    if p.shape[0] > n:
        return verdicts, int(torch.multinomial(p[n], 1, generator=generator))
    return verdicts, None


def shortest_prefix(accepted: Sequence[int], active: Sequence[bool], n: int) -> int:
    """Synchronous batches: every row keeps the shortest accepted prefix among the unfinished rows (`n` if none),
    so all rows keep one length and every layer's cache stays rectangular."""
    return min((a for a, on in zip(accepted, active) if on), default=n)


def longest_prefix(accepted: Sequence[int], active: Sequence[bool]) -> int:
    """Per-row batches: each row keeps its own prefix; the batch's slots reach as far as the longest one (the rows
    that kept less have holes up to there)."""
    return max((a for a, on in zip(accepted, active) if on), default=0)
