"""The exit rule: decides, per token or per block, whether a token leaves at an exit or goes deeper.

The cascade at one exit (all thresholds from `RouterConfig`):

1. Learned gate (optional, runs before the head): if P(agree) < `gate_threshold`, go deeper without computing
   the full-vocabulary head at all.
2. Confidence `c = max softmax(logits)`: exit if `c >= high_conf_threshold`; go deeper if `c < low_conf_threshold`.
   A head gate (`LearnedGate(head=True)`) runs after the head instead, and its P(agree), learned from the head's
   output, the hidden state and the context, is the `c` the thresholds compare.
3. Between the two, entropy `H` (in nats, or `H / log(vocab)` when normalised): exit if `H <= entropy_threshold`.
4. Repeat guard (exit mode, where tokens may reach the caller unchecked): a head token that is a word among the last
   `repeat_guard` generated tokens goes deeper; shallow heads copy the previous list item, which then cascades.

Window rules, checked before the cascade: at most `max_pending` exited tokens may wait for the deep layers, and an
optional window of recent exit confidences whose mean falls below `window_min_confidence` forces a deep pass.

Learned-gate hook: a gate is any module mapping the exit's hidden state `(1, hidden)` to a probability `(1,)`;
`ExitHeads.gates` holds trained `LearnedGate`s, and `EarlyExitRouter.set_gate(layer, module)` installs a custom one.
A gate whose `uses_context` is True also receives `(1, 2)` context features (`routing/gate_context.py`: whether the
n-gram tier matches the text just before, and the exit's running acceptance estimate); one whose `uses_head` is
True runs after the head and also receives `heads.head_features` of its logits (see step 2).
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from early_exit_router.config import RouterConfig
from early_exit_router.routing.quality_target import QualityWindow, controller_move

FULL_DEPTH = -1  # block target meaning "the full model"
TIGHTEN_STEPS = 4  # the controller raises the thresholds this many steps at once, and lowers them one at a time
_WORDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (its size, its word ids)


def word_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of `tokenizer`'s tokens that are words to the repeat guard: three or more letters once the leading
    space is stripped, as the tokenizer itself decodes each token (byte-level and SentencePiece vocabularies alike).
    Read once per tokenizer (half a second for 49k tokens); none without a tokenizer (the guard then never fires)."""
    if tokenizer is None:
        return frozenset()
    size = len(tokenizer)
    try:
        known, words = _WORDS[tokenizer]
        if known == size:  # else tokens were added since
            return words
    except (KeyError, TypeError):  # TypeError: a tokenizer that cannot be weakly referenced is read every time
        pass
    texts = tokenizer.batch_decode([[i] for i in range(size)])
    words = frozenset(i for i, text in enumerate(texts) if len(word := text.strip()) >= 3 and word.isalpha())
    try:
        _WORDS[tokenizer] = (size, words)
    except TypeError:
        pass
    return words


def guards_repeats(config: RouterConfig, mode: str) -> bool:
    """Whether a decode in `mode` runs the repeat guard: exit mode where an exited token may reach the caller
    unchecked (a holdback other than None, which repairs every wrong one), with a window."""
    return mode == "exit" and config.holdback is not None and config.repeat_guard > 0


@dataclass
class RoutingState:
    """Per-sequence routing memory: recent exit confidences and the current block's decision."""

    recent_confidences: deque = field(default_factory=deque)
    block_remaining: int = 0
    block_target: int = FULL_DEPTH  # exit index chosen by the block's first token, or FULL_DEPTH
    threshold_shift: float = 0.0  # the controller's offset on both confidence thresholds
    quality: QualityWindow = field(default_factory=lambda: QualityWindow(1))  # the evidence the controller reads
    exits_suspended: str | None = None  # why exits stopped (no threshold held the target), else None
    diverged: bool = False  # a final token was found wrong: the output has left the full model's
    guarded_at: int = -1  # the slot the repeat guard last refused an exit at (it counts tokens, not asks)


class ExitRule:
    """The exit decisions of one config; stateless apart from `RoutingState`, which is per decode."""

    def __init__(self, config: RouterConfig, vocab_size: int, words: frozenset[int] = frozenset()) -> None:
        self.config = config
        self.log_vocab = math.log(vocab_size)
        self.words = words  # the repeat guard's vocabulary: ids of tokens that are words (`word_ids`)

    def new_state(self) -> RoutingState:
        return RoutingState(
            recent_confidences=deque(maxlen=max(1, self.config.confidence_window)),
            quality=QualityWindow(self.config.controller_window),
        )

    def forced_deep(self, state: RoutingState, pending: int) -> bool:
        """Window rule: True when the next token must run the full depth."""
        cfg = self.config
        if pending >= cfg.max_pending:
            return True
        if cfg.confidence_window and len(state.recent_confidences) == cfg.confidence_window:
            mean = sum(state.recent_confidences) / cfg.confidence_window
            if mean < cfg.window_min_confidence:
                state.recent_confidences.clear()
                return True
        return False

    def block_target(self, state: RoutingState) -> int | None:
        """The exit index (or FULL_DEPTH) this token must follow inside a block, or None to run the cascade."""
        if state.block_remaining > 0:
            state.block_remaining -= 1
            return state.block_target
        return None

    def start_block(self, state: RoutingState, target: int) -> None:
        state.block_remaining = self.config.block_size - 1
        state.block_target = target

    def end_block(self, state: RoutingState) -> None:
        state.block_remaining = 0

    def repeats(self, rows: Sequence[tuple[Sequence[int], int]], tokens: Sequence[float]) -> bool:
        """Repeat guard (exit mode): whether a row's exit token is a word among its last `repeat_guard` generated
        tokens. `rows`: each deciding row's (prompt + generated tokens, prompt length); `tokens`: their exits' ids."""
        window = self.config.repeat_guard
        if not (window and self.words):
            return False
        for (seq, start), token in zip(rows, tokens):
            if int(token) in self.words and int(token) in seq[max(start, len(seq) - window) :]:
                return True
        return False

    def gate_allows(self, gate_prob: torch.Tensor) -> torch.Tensor:
        """Gate probabilities -> bool tensor of the same shape (on device, no sync)."""
        return gate_prob >= self.config.gate_threshold

    def confidence_entropy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(..., vocab) logits -> max probability and entropy (normalised when configured), shape (...)."""
        probs = torch.softmax(logits.float(), dim=-1)
        # entr(0) = 0: a trimmed draft head's -inf logits (probability 0) add nothing, where p * log p would be NaN.
        entropy = torch.special.entr(probs).sum(dim=-1)
        if self.config.entropy_normalized:
            entropy = entropy / self.log_vocab
        return probs.amax(dim=-1), entropy

    def exit_rule(
        self, confidence: torch.Tensor, entropy: torch.Tensor, shift: float = 0.0, bars: Any = None
    ) -> torch.Tensor:
        """The confidence -> entropy cascade as a bool tensor; `shift` moves both confidence thresholds. `bars`: the
        (high, low) thresholds already shifted (`bars`), as 0-d tensors in a graph (a float there is a constant)."""
        high, low = self.bars(shift) if bars is None else bars
        return (confidence >= high) | ((confidence >= low) & (entropy <= self.config.entropy_threshold))

    def bars(self, shift: float = 0.0) -> tuple[float, float]:
        """The (high, low) confidence thresholds, moved by `shift` and clamped to [0, 1]."""
        cfg = self.config
        return min(1.0, max(0.0, cfg.high_conf_threshold + shift)), min(1.0, max(0.0, cfg.low_conf_threshold + shift))

    def head_signal(
        self,
        logits: torch.Tensor,
        shift: float = 0.0,
        learned: torch.Tensor | None = None,
        columns: torch.Tensor | None = None,
        bars: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(..., vocab) head logits -> (exit flags, confidences) of shape (...), on the logits' device (no sync).

        `learned`, a head gate's P(agree) of shape (...), replaces the maximum probability as the confidence the
        thresholds compare (the entropy rule still reads the logits, where it can decide anything). `columns`: the
        only finite logits' ids (a trimmed draft head's), read alone: the same values at K / vocab of the cost.
        `bars`: the shifted thresholds in place of `shift` (`exit_rule`)."""
        if learned is not None and not self.entropy_decides:  # no softmax at all: the learned confidence decides
            confidence = learned.reshape(logits.shape[:-1]).float()
            return self.exit_rule(confidence, torch.zeros_like(confidence), shift, bars), confidence
        if columns is not None:
            logits = logits.index_select(-1, columns)  # (..., K)
        confidence, entropy = self.confidence_entropy(logits)
        if learned is not None:
            confidence = learned.reshape(confidence.shape).float()
        return self.exit_rule(confidence, entropy, shift, bars), confidence

    @property
    def entropy_decides(self) -> bool:
        """Whether the entropy rule can change a decision: only with a low threshold under the high one (a calibrated
        config uses the confidence rule alone, low = high, and thresholds shift together)."""
        return self.config.low_conf_threshold < self.config.high_conf_threshold

    def adjust(self, state: RoutingState) -> None:
        """Threshold controller: a move toward `target_agreement` on the evidence in `state.quality`
        (`quality_target.controller_move`); where it reaches the strictest thresholds, exits stop.

        The shift stays within what can matter: thresholds clamp to [0, 1] in `exit_rule`."""
        cfg = self.config
        if cfg.target_agreement is None or state.exits_suspended:
            return
        move = controller_move(state.quality, cfg.target_agreement)
        # Once the output has left the full model's, later checks read a prefix it never wrote, and it agrees with
        # its own broken pattern (a wrong list item cascades while every check passes): no evidence to loosen on.
        if move == 0 or (move < 0 and state.diverged):
            return
        low_bound, high_bound = -cfg.high_conf_threshold, 1.0 - cfg.low_conf_threshold
        step = cfg.controller_step * (TIGHTEN_STEPS if move > 0 else -1)
        state.threshold_shift = min(high_bound, max(low_bound, state.threshold_shift + step))
        # the strictest thresholds (to rounding: 0.85 + 0.15 is 1, 1 - 0.85 is a hair above 0.15): only certainty exits
        if move > 0 and state.threshold_shift >= high_bound - 1e-9:
            estimate, _ = state.quality.disagreement()
            state.exits_suspended = (
                f"no threshold held target_agreement {cfg.target_agreement:g} (the output's disagreement rate was "
                f"{estimate:.3f} as the thresholds reached their strictest)"
            )
        state.quality.clear()

    def record_exit(self, state: RoutingState, confidence: float) -> None:
        if self.config.confidence_window:
            state.recent_confidences.append(confidence)
