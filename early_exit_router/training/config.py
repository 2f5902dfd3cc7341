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


@dataclass
class AdaptConfig:
    """Settings of `adapt_base`: the LayerSkip recipe (`layerskip.py`), self-distilled, on a LoRA or the whole base.

    Saved in the output folder's `adapt_report.json`; a resumed run must name the same settings."""

    exit_layers: list[int]  # 0-based layers the router exits at; their losses are the early-exit loss
    max_steps: int = 400  # optimiser steps over the whole run (the learning-rate schedule spans them)
    seq_len: int = 256  # tokens per training sequence
    batch_size: int = 4  # sequences per step
    lr: float = 2e-4
    warmup_share: float = 0.05  # linear warm-up over this share of the steps, then cosine decay to 10% of `lr`
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    loss_scale: str = "sum_l"  # uniform | linear | sum_l
    e_scale: float = 1.0  # the exits' terms against the last layer's, before normalising
    last_weight: float = 1.0  # the last layer's term (KL to the original model): raise it to stay closer
    curriculum: str = "none"  # none | rotational | gradual
    rotation: int = 2  # rotational: every this-many-th exit is supervised at a step
    gradual_share: float = 0.5  # gradual: all exits are on after this share of the steps
    # skip probability of the last layer; 0 (the default) turns layer dropout off. Measured on SmolLM2 (exits 4 and
    # 6, 100 steps of 4 x 256 tokens): with 0.1 the held-out last-layer agreement with the original fell to 0.821 and
    # the exits reached 0.115 / 0.144; without, 0.874 and 0.144 / 0.175 at the same NLL. Self-distillation wants the
    # model kept; layer dropout trains it to run with layers missing, which this router never does.
    layer_dropout: float = 0.0
    dropout_shape: str = "exp"  # exp | linear: how the rate rises with depth
    ce_weight: float = 0.0  # >0 adds next-token cross-entropy on the text at every supervised layer
    draft_vocab_only: bool = True  # the exits' KL over the router's trimmed draft vocabulary (the last layer's: all)
    draft_vocab_size: int = 4096
    method: str = "lora"  # lora (PEFT) | full (every weight but the embeddings, norm and LM head trains)
    # model: the adaptation is the model's (every layer, self-distilled, the last layer kept close); draft: a LoRA on
    # layers 0..E alone, with exit E's head, that only the draft path runs (the model stays bit-identical)
    scope: str = "model"
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    # autocast to bfloat16 (float32 master weights); None: where the device computes it natively (measured on a
    # 2-core AVX512-BF16 CPU: a SmolLM2 step of 4 x 256 tokens 3.6 s against 9.0 in float32)
    bf16: bool | None = None
    seed: int = 0
    save_every: int = 50  # steps between resumable states
    heldout_share: float = 0.05  # sequences kept out of training for the report

    def __post_init__(self) -> None:
        from early_exit_router.training.layerskip import CURRICULA, DROPOUT_SHAPES, LOSS_SCALES

        choices = {
            "loss_scale": LOSS_SCALES,
            "curriculum": CURRICULA,
            "dropout_shape": DROPOUT_SHAPES,
            "method": ("lora", "full"),
            "scope": ("model", "draft"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} is {getattr(self, name)!r}: use one of {', '.join(allowed)}.")
        if not self.exit_layers or sorted(set(self.exit_layers)) != list(self.exit_layers):
            raise ValueError(f"exit_layers {self.exit_layers}: give strictly increasing 0-based layers, at least one.")
        for name in ("max_steps", "seq_len", "batch_size", "lora_rank", "save_every", "rotation"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} is {getattr(self, name)}: give a positive integer.")
        if self.exit_layers[0] < 0:
            raise ValueError(f"exit_layers {self.exit_layers}: layers are 0-based indices, none below 0.")
        for name in ("e_scale", "last_weight", "ce_weight", "weight_decay", "grad_clip", "lora_dropout"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} is {getattr(self, name)}: give a value >= 0.")
        for name in ("warmup_share", "gradual_share", "heldout_share"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} is {getattr(self, name)}: give a share in [0, 1).")
        if self.draft_vocab_only and self.draft_vocab_size < 1:
            raise ValueError("draft_vocab_size must be >= 1 where the exits' KL runs over the draft vocabulary.")
        if not 0.0 <= self.layer_dropout < 1.0:
            raise ValueError(f"layer_dropout is {self.layer_dropout}: give a probability in [0, 1).")
        if self.scope == "draft" and (self.method != "lora" or len(self.exit_layers) != 1):
            raise ValueError("scope 'draft' trains one exit's draft path as a LoRA: give one exit layer, method lora.")
        if self.scope == "draft" and (self.layer_dropout or self.curriculum != "none"):
            raise ValueError("scope 'draft' runs layers 0..E alone: layer dropout and curricula do not apply to it.")
        if self.lr <= 0:
            raise ValueError(f"lr is {self.lr}: give a positive learning rate.")

    def resume_key(self) -> dict[str, object]:
        """The settings a resumed run must share with the run it continues (all but the saving cadence)."""
        from dataclasses import asdict

        return {k: v for k, v in asdict(self).items() if k != "save_every"}
