"""`TrainingConfig`: the budget and optimiser settings of head and gate training."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainingConfig:
    """Budget and optimiser settings of `train_heads`."""

    max_steps: int = 600  # optimiser steps; each sees `batch_tokens` positions at every exit
    max_seconds: float | None = None  # a wall-clock budget instead: the step count is set from the first steps' time
    batch_tokens: int = 512
    lr: float = 2e-3
    weight_decay: float = 0.0
    ce_weight: float = 0.0  # 0: pure KL to the full model; >0 adds cross-entropy on the corpus' next token
    seed: int = 0
    holdout_share: float = 0.05  # positions kept out of training, for the report and the gate check
    gate_steps: int = 1000  # held-out AUC at L4 / 16 / 24: 0.841 / 0.850 / 0.869 after 300 steps, 0.843 / 0.853 / 0.869
    # Gates fit on this share of the held-out chunks, text the adapters never saw, and are scored on the rest. Fit
    # on the adapters' own training text, where a head that has learned the text is right far more often (measured:
    # a residual block at L16 agreed 0.91 there and 0.69 held out), a gate learns to trust the head too much.
    gate_share: float = 0.5
    # Positions a gate fits on at most (whole chunks, drawn at random). The gates' held-out AUC rose steeply with
    # data (measured, L4 / 16 / 24: 0.78 / 0.80 / 0.82 from 3k positions, 0.84 / 0.85 / 0.87 from 6.4k), so text for
    # the gates alone (`distill_router`'s `gate_cache`) is worth having and this bound is generous.
    gate_max_positions: int = 200_000
    # Gates after the head (a learned confidence from the head's output, the state and the context), or, when False,
    # before it (they can skip the head, but see less).
    head_gates: bool = True
    chunk_len: int = 256  # positions per forward pass when caching hidden states
    draft_vocab_only: bool = True  # distil over the router's trimmed draft vocabulary, when it has one
    train_exits: list[int] | None = None  # the exits whose adapters train (None: all); the others stay as loaded
    warm_lr_scale: float = 0.1  # warm-started parameters (`warm_start`) learn at this fraction of `lr`
    # The share of the training chunks (those left once the held-out ones are set aside) that the heads learn from,
    # drawn with the seed: a learning curve over the corpus' size with the held-out text and the steps held fixed.
    train_share: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.train_share <= 1.0:
            raise ValueError(
                f"train_share is {self.train_share}: give the share of the training text to learn from, in (0, 1]."
            )
