"""What a learned gate reads beyond the hidden state, defined once: the decoder computes it online, training replays
it offline on cached text, and both go through these functions.

- `ngram_match`: whether the n-gram tier would copy a token here. Online the decoder asks its context index
  (`routing.ngram.ContextIndex`, `ngram_match`'s answer on the context so far); offline `replay_next_copies` answers
  for every position of a text at once (incrementally, the same answer at every prefix).
- `recent_acceptance`: the exit's running acceptance estimate: an `AcceptanceTracker`'s, from the exit's prior. Online
  it is the decoder's own tracker; offline `replay_acceptance` feeds a tracker the previous positions' verdicts.

`context_features` packs both into the gate's input columns (`heads.gates.GATE_CONTEXT`).
"""

from __future__ import annotations

import torch

from early_exit_router.config import RouterConfig
from early_exit_router.routing.policy import AcceptanceTracker


def replay_next_copies(tokens: list[int], max_ngram: int, min_ngram: int) -> list[int]:
    """For every t, the token `ngram_match(tokens[: t + 1], max_ngram, 1, min_ngram)` copies (-1: none), in one
    pass: the latest earlier occurrence of the longest suffix of `max_ngram` down to `min_ngram` tokens, and the
    token after it (-1 marks an unknown token)."""
    sizes = range(max_ngram, min_ngram - 1, -1)
    latest: dict[tuple[int, ...], int] = {}  # n-gram -> its latest start whose follower is known
    out = []
    for t in range(len(tokens)):
        for k in sizes:
            if t - k >= 0:
                latest[tuple(tokens[t - k : t])] = t - k
        copy = -1
        for k in sizes:
            if t + 1 > k and (start := latest.get(tuple(tokens[t - k + 1 : t + 1]))) is not None:
                copy = tokens[start + k]
                break
        out.append(copy)
    return out


def exit_prior(config: RouterConfig) -> float:
    """An exit's acceptance estimate before any verdict, as the decoder's tracker starts it."""
    return config.acceptance_prior if config.exit_acceptance_prior is None else config.exit_acceptance_prior


def replay_acceptance(verdicts: list[bool], prior: float, rate: float = AcceptanceTracker.rate) -> list[float]:
    """The running estimate before each verdict in turn (what a gate sees there), from `prior`."""
    tracker, key, out = AcceptanceTracker(prior=prior, rate=rate), ("exit", 0), []
    for ok in verdicts:
        out.append(tracker.estimate(key))
        tracker.observe(key, bool(ok))
    return out


def context_features(ngram_tokens: list[int], acceptance: float | list[float], device: torch.device) -> torch.Tensor:
    """(rows, 2) a gate's context per row: whether the n-gram tier would copy a token there (`ngram_tokens[r]`, -1
    for none) and the exit's running acceptance estimate (one for all rows, or one per row)."""
    accept = acceptance if isinstance(acceptance, list) else [acceptance] * len(ngram_tokens)
    return torch.tensor([[float(t >= 0), a] for t, a in zip(ngram_tokens, accept)], device=device)
