"""Fitting the learned gates in front of the exit heads, on cached hidden states, with the features the decoder
serves them (`routing/gate_context.py`, `heads.gates.head_features`), and scoring them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from early_exit_router.heads.gates import LearnedGate, head_features
from early_exit_router.routing.gate_context import context_features, exit_prior, replay_acceptance, replay_next_copies
from early_exit_router.routing.policy import AcceptanceTracker
from early_exit_router.training.config import TrainingConfig
from early_exit_router.training.hidden_states import (
    HiddenStateCache,
    batch_size_for,
    exit_top1,
    head_logits,
    teacher_top1,
)


def ngram_proposals(cache: HiddenStateCache, ngram_max: int = 4, ngram_min: int = 2) -> torch.Tensor:
    """(N,) the token the n-gram tier would copy at every cached position (-1: no match), replayed within each chunk
    as the decoder sees it (`gate_context.replay_next_copies`). Without chunks: -1 everywhere."""
    proposals = torch.full((len(cache),), -1, dtype=torch.long)
    n = cache.chunk_len
    for c in range(cache.num_chunks if n else 0):
        tokens = [-1] + cache.next_token[c * n : (c + 1) * n - 1].tolist()  # the token at each position
        proposals[c * n : (c + 1) * n] = torch.tensor(replay_next_copies(tokens, ngram_max, ngram_min))
    return proposals


def gate_context(
    cache: HiddenStateCache,
    agree: torch.Tensor,
    proposals: torch.Tensor,
    prior: float,
    rate: float = AcceptanceTracker.rate,
) -> torch.Tensor:
    """(N, len(GATE_CONTEXT)) the gate's context features at every cached position, replayed as the decoder computes
    them (`routing/gate_context.py`): whether the n-gram tier would copy a token here (`proposals`, from
    `ngram_proposals`), and the exit's running acceptance, a tracker from `prior` (`gate_context.exit_prior`) fed
    the previous positions' verdicts `agree` within the chunk. Without chunks: no match, acceptance `prior`."""
    if not cache.chunk_len:
        return context_features([-1] * len(cache), prior, torch.device("cpu"))
    n = cache.chunk_len
    acceptance = [a for c in range(cache.num_chunks) for a in replay_acceptance(agree[c * n : (c + 1) * n].tolist(),
                                                                               prior, rate)]  # fmt: skip
    return context_features(proposals.tolist(), acceptance, torch.device("cpu"))


@torch.no_grad()
def exit_head_features(router: Any, cache: HiddenStateCache, layer: int, proposals: torch.Tensor) -> torch.Tensor:
    """(N, len(HEAD_FEATURES)) what a head gate reads off exit `layer`'s draft head at every cached position, with
    the n-gram tier's replayed `proposals` (N,)."""
    stack, batch = router.stack, batch_size_for(cache)
    draft = router.heads.draft_head(stack, router.config.draft_vocab_size, router.config.half_draft_head)
    adapter = router.heads.adapter(layer)
    return torch.cat(
        [
            head_features(
                head_logits(stack, adapter, cache.exits[layer][s : s + batch], cache.chunk_len, draft),
                proposals[s : s + batch],
                None if draft is None else draft.token_ids,
            ).cpu()
            for s in range(0, len(cache), batch)
        ]
    )


def train_gates(
    router: Any,
    train: HiddenStateCache,
    holdout: HiddenStateCache,
    cfg: TrainingConfig,
    context: bool = True,
    head: bool = False,
) -> dict[int, dict[str, float]]:
    """Fit a logistic gate per exit predicting agreement with the full model (with the context features of
    `gate_context` unless `context` is False; with `head`, also the head's output: a head gate, see `LearnedGate`).

    Returns, per exit, held-out `accuracy` at 0.5, `auc`, `saved_at_recall` (the share of head calls the gate skips
    at a threshold that still lets 95% of the agreeing positions through; 0 for a head gate, which runs after the
    head), `confidence_auc`: the AUC of the head's own confidence, and the share of positions that can exit at 0.95
    agreement when ranked by the gate (`exit_share_at_95`) and by the confidence (`confidence_exit_share_at_95`);
    `fit_positions`: how many positions the gate fit on (at most `cfg.gate_max_positions`, whole chunks)."""
    g = torch.Generator().manual_seed(cfg.seed)
    max_positions = cfg.gate_max_positions
    if train.chunk_len:
        train = train.select_chunks(
            torch.randperm(train.num_chunks, generator=g)[: max(1, max_positions // train.chunk_len)]
        )
    else:
        train = train.select(torch.randperm(len(train), generator=g)[:max_positions])
    config = router.config
    target, target_hold = teacher_top1(router, train), teacher_top1(router, holdout)
    # What the n-gram tier would copy depends on the text alone: replayed once per cache, shared by every exit.
    proposals = [ngram_proposals(c, config.ngram_size, config.ngram_min_size) for c in (train, holdout)]
    router.heads.add_gates(router.stack.hidden_size, context, head)
    quality = {}
    for layer in router.heads.exit_layers:
        gate: LearnedGate = router.heads.gate(layer).float()
        inputs = {}
        for name, cache, teacher, replayed in (
            ("train", train, target, proposals[0]),
            ("holdout", holdout, target_hold, proposals[1]),
        ):
            top, confidence = exit_top1(router, cache, layer, with_confidence=True)
            agree = top == teacher
            features = gate_context(cache, agree.float(), replayed, exit_prior(config)) if context else None
            heads = exit_head_features(router, cache, layer, replayed) if head else None
            inputs[name] = (cache.exits[layer], features, heads, agree, confidence)
        x, features, heads, agree, _ = inputs["train"]
        y = agree.float()
        if heads is not None:  # standardised with the training set's statistics, kept in the gate's buffers
            gate.head_mean.copy_(heads.mean(0))
            gate.head_scale.copy_(heads.std(0).clamp(min=1e-3))
        optimizer = torch.optim.Adam(gate.parameters(), lr=1e-2)
        # A pre-head gate weighs the rarer class up, so that it neither always says yes nor always no. A head gate
        # is a confidence the thresholds compare, so it stays an unweighted (calibrated) estimate of P(agree).
        pos = y.mean().clamp(1e-3, 1 - 1e-3)
        weights = None if head else torch.where(y > 0, 0.5 / pos, 0.5 / (1 - pos))
        for _ in range(cfg.gate_steps):
            prob = gate(x, features, heads).clamp(1e-6, 1 - 1e-6)
            loss = nn.functional.binary_cross_entropy(prob, y, weight=weights)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            x, features, heads, y_hold, confidence = inputs["holdout"]
            score = gate(x, features, heads)
            quality[layer] = {
                "accuracy": float(((score >= 0.5) == y_hold).float().mean()),
                "auc": roc_auc(score, y_hold),
                "saved_at_recall": 0.0 if head else saved_at_recall(score, y_hold, 0.95),
                "confidence_auc": roc_auc(confidence, y_hold),
                "exit_share_at_95": coverage_at(score, y_hold, 0.95),
                "confidence_exit_share_at_95": coverage_at(confidence, y_hold, 0.95),
                "fit_positions": len(train),
            }
        gate.to(device=router.stack.device, dtype=router.stack.dtype)
    return quality


def coverage_at(score: torch.Tensor, correct: torch.Tensor, precision: float) -> float:
    """Largest share of positions that, taken highest score first, agree with the full model at `precision`."""
    order = score.argsort(descending=True)
    running = correct[order].float().cumsum(0) / torch.arange(1, len(order) + 1)
    ok = (running >= precision).nonzero()
    return float(ok.max() + 1) / len(order) if len(ok) else 0.0


def roc_auc(score: torch.Tensor, positive: torch.Tensor) -> float:
    """Area under the ROC curve: the chance that a random positive scores above a random negative (ties: half)."""
    pos, neg = score[positive].float(), score[~positive].float()
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    both = torch.cat([pos, neg])
    # Mann-Whitney U from ranks; tied scores share their average rank, so a tie counts half.
    _, inverse, counts = torch.unique(both, return_inverse=True, return_counts=True)  # sorted distinct values
    ends = counts.cumsum(0).to(both.dtype)
    ranks = (ends - (counts.to(both.dtype) - 1) / 2)[inverse]
    u = ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2
    return float(u / (len(pos) * len(neg)))


def saved_at_recall(score: torch.Tensor, positive: torch.Tensor, recall: float) -> float:
    """Share of all positions scored below the threshold that keeps `recall` of the positives above it."""
    pos = score[positive].float().sort().values
    if len(pos) == 0:
        return 1.0
    threshold = pos[int((1 - recall) * len(pos))]
    return float((score.float() < threshold).float().mean())
