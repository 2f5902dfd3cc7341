"""Learned gates: a logistic P(this exit's top-1 equals the full model's), and the head features they read.

The head features (`head_features`) and the context features (`routing/gate_context.py`) are each defined once: the
decoder computes them online and training replays them offline with the same functions.
"""

from __future__ import annotations

import torch
from torch import nn

from early_exit_router.heads.draft import DraftHead

GATE_CONTEXT = ("ngram_match", "recent_acceptance")  # what a gate reads beyond the hidden state: routing/gate_context


# What a head gate reads off the draft head's output: its five largest log probabilities, the largest probability,
# the entropy (nats), and whether its top-1 is the token the n-gram tier would copy here (two weak predictors that
# agree are right far more often than either).
HEAD_FEATURES = ("log_p1", "log_p2", "log_p3", "log_p4", "log_p5", "confidence", "entropy", "ngram_agrees")


def head_features(
    logits: torch.Tensor,
    ngram_token: torch.Tensor | None = None,
    draft_ids: torch.Tensor | None = None,
    trimmed: bool = False,
) -> torch.Tensor:
    """(..., vocab) head logits [and (...) the n-gram tier's proposed token, -1 for none] -> (...,
    len(HEAD_FEATURES)) float32 features for a head gate.

    With `draft_ids` (a trimmed head's token ids, the only finite logits), the features are computed on those K
    columns alone: the same values (the -inf columns have probability 0) at K / vocab of the cost. `trimmed`: the
    logits are those K columns already (..., K)."""
    if draft_ids is not None and not trimmed:
        logits = logits.index_select(-1, draft_ids)  # (..., K)
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    top, top_ids = log_probs.topk(5, dim=-1)
    if draft_ids is not None:
        top_ids = draft_ids[top_ids]  # back to token ids
    top = top.clamp(min=-30.0)  # a trimmed head's -inf tail stays finite
    entropy = torch.special.entr(log_probs.exp()).sum(dim=-1, keepdim=True)
    if ngram_token is None:
        agrees = torch.zeros_like(entropy)
    else:
        agrees = (top_ids[..., :1] == ngram_token.to(top_ids.device).reshape(*top_ids.shape[:-1], 1)).float()
    return torch.cat([top, top[..., :1].exp(), entropy, agrees], dim=-1)


class LearnedGate(nn.Module):
    """A logistic gate: P(this exit's top-1 equals the final top-1).

    The hidden state is RMS normalised first, so the gate is insensitive to the residual stream's growing scale with
    depth. With `context=True` it also weighs cheap signals the head does not see: the state's log RMS, whether the
    n-gram tier matched the text just before (`GATE_CONTEXT[0]`), and this exit's recent acceptance
    (`GATE_CONTEXT[1]`, the policy's running estimate).

    Without `head`, the gate runs before the head, so a confident "no" skips the draft head. With `head=True` it
    runs after the head and also weighs the head's output (`HEAD_FEATURES`, standardised with the training set's
    statistics): a learned confidence, which the router's confidence thresholds then compare instead of the head's
    maximum probability.
    """

    def __init__(self, hidden_size: int, context: bool = False, head: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.context = nn.Linear(1 + len(GATE_CONTEXT), 1, bias=False) if context else None
        if self.context is not None:
            nn.init.zeros_(self.context.weight)
        self.head = nn.Linear(len(HEAD_FEATURES), 1, bias=False) if head else None
        if self.head is not None:
            nn.init.zeros_(self.head.weight)
            self.register_buffer("head_mean", torch.zeros(len(HEAD_FEATURES)))
            self.register_buffer("head_scale", torch.ones(len(HEAD_FEATURES)))

    @property
    def uses_context(self) -> bool:
        return self.context is not None

    @property
    def uses_head(self) -> bool:
        return self.head is not None

    def forward(
        self, hidden: torch.Tensor, context: torch.Tensor | None = None, head: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(..., hidden) [and (..., len(GATE_CONTEXT)) context, (..., len(HEAD_FEATURES)) head features] -> (...)
        probabilities."""
        h = hidden.float()
        ms = h.pow(2).mean(-1, keepdim=True) + 1e-6
        h = h * torch.rsqrt(ms)
        logit = self.linear(h.to(self.linear.weight.dtype)).float()
        if self.context is not None:
            if context is None:  # no context known: the neutral values (no match, acceptance 0.5)
                context = torch.tensor([0.0, 0.5], device=h.device).expand(*h.shape[:-1], len(GATE_CONTEXT))
            features = torch.cat([0.5 * ms.log(), context.float()], dim=-1)  # log RMS, then the context
            logit = logit + self.context(features.to(self.context.weight.dtype)).float()
        if self.head is not None:
            if head is None:
                raise ValueError("This gate weighs the head's output: pass head_features(logits).")
            scaled = (head.float() - self.head_mean.float()) / self.head_scale.float()
            logit = logit + self.head(scaled.to(self.head.weight.dtype)).float()
        return torch.sigmoid(logit).squeeze(-1)


def uses_head(gate: nn.Module | None) -> bool:
    """True for a gate that runs after the head and weighs its output (a learned confidence)."""
    return bool(getattr(gate, "uses_head", False))


def gate_probability(
    gate: nn.Module,
    hidden: torch.Tensor,
    context: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
    ngram_token: torch.Tensor | None = None,
    draft: DraftHead | None = None,
    trimmed: bool = False,
) -> torch.Tensor:
    """A gate's probability for `hidden`: context features go only to gates that use them, head features (from
    `logits`, drawn from `draft` when trimmed, and the n-gram tier's `ngram_token`) only to head gates (custom gates
    take the hidden state alone). `trimmed`: `logits` are the draft head's K columns alone."""
    if uses_head(gate):
        if logits is None:
            raise ValueError("A head gate runs after the head: pass the head's logits.")
        features = head_features(logits, ngram_token, None if draft is None else draft.token_ids, trimmed)
        return gate(hidden, context if gate.uses_context else None, features)
    if getattr(gate, "uses_context", False):
        return gate(hidden, context)
    return gate(hidden)
