"""Quality of a generation measured against the full model: the functions `bench` and `calibrate` score with.

Two kinds of comparison:

- against the control's output (plain HF greedy on the same prompt): token match, first divergence, ROUGE-L;
- against the full model's judgement of the output itself (one teacher-forced forward pass over prompt + output):
  agreement (the share of generated tokens that are the full model's greedy choice given the same prefix) and the
  mean negative log-likelihood of the generated tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


def first_divergence(reference: Sequence[int], candidate: Sequence[int]) -> int | None:
    """Index of the first position where the sequences differ (a length difference counts); None when equal."""
    for i, (a, b) in enumerate(zip(reference, candidate)):
        if a != b:
            return i
    if len(reference) != len(candidate):
        return min(len(reference), len(candidate))
    return None


def token_match(reference: Sequence[int], candidate: Sequence[int]) -> float:
    """Share of the reference's positions where the candidate has the same token (1.0 for two empty sequences)."""
    if not reference:
        return 1.0 if not candidate else 0.0
    same = sum(a == b for a, b in zip(reference, candidate))
    return same / len(reference)


def _lcs_length(a: Sequence, b: Sequence) -> int:
    """Longest common subsequence length, O(len(a) * len(b)) time and O(len(b)) memory."""
    if not a or not b:
        return 0
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0  # row[j - 1] of the previous row
        for j, y in enumerate(b, start=1):
            above = row[j]
            row[j] = diagonal + 1 if x == y else max(row[j], row[j - 1])
            diagonal = above
    return row[-1]


def rouge_l(reference: str | Sequence, candidate: str | Sequence) -> float:
    """ROUGE-L F1 (LCS-based, beta = 1). Strings are split on whitespace; sequences are compared as given.

    Two empty inputs score 1.0; one empty input scores 0.0.
    """
    ref = reference.split() if isinstance(reference, str) else list(reference)
    cand = candidate.split() if isinstance(candidate, str) else list(candidate)
    if not ref and not cand:
        return 1.0
    lcs = _lcs_length(ref, cand)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(cand), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def nll_ratio(candidate_nll: float, reference_nll: float) -> float:
    """Candidate mean NLL over the reference's: 1.02 means 2% more surprising to the full model."""
    if reference_nll <= 0:
        return 1.0 if candidate_nll <= 0 else float("inf")
    return candidate_nll / reference_nll


@dataclass
class TeacherForcedScore:
    """The full model's view of one generated continuation."""

    tokens: int  # generated tokens scored
    agreement: float  # share of them that are the full model's argmax given the same prefix
    mean_nll: float  # mean -log p(token | prefix) under the full model, in nats
    disagreements: int  # tokens - agreeing tokens (the loss that calibration bounds)


@torch.no_grad()
def teacher_forced_score(model: nn.Module, prompt_ids: Sequence[int], new_ids: Sequence[int]) -> TeacherForcedScore:
    """Score `new_ids` as a continuation of `prompt_ids` with one forward pass of the plain `model`.

    The model must be unpatched (inside `router.disabled()`) so that the scores are the full model's.
    """
    if not new_ids:
        return TeacherForcedScore(0, 1.0, 0.0, 0)
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(new_ids)], device=device)
    n_prompt, n_new = len(prompt_ids), len(new_ids)
    # logits at position t predict token t + 1: the rows from n_prompt - 1 predict the new tokens
    logits = model(input_ids=ids, logits_to_keep=n_new + 1).logits[0, :-1].float()  # (n_new, vocab)
    targets = ids[0, n_prompt:]
    log_probs = torch.log_softmax(logits, dim=-1)
    nll = -log_probs.gather(1, targets[:, None])[:, 0]
    agree = int((logits.argmax(dim=-1) == targets).sum())
    return TeacherForcedScore(n_new, agree / n_new, float(nll.mean()), n_new - agree)
