"""Exit mode's quality target: the estimate of the output's agreement with the full model since the thresholds last
moved, and what the threshold controller does about it.

Only early tokens that stay final without verification can disagree with the full model: deep tokens are its own
choice and verified drafts were accepted by it. So the output's disagreement rate is

    d = h * (1 - a)

with `h` the share of tokens that left early unverified and `a` the exit agreement of the checks. The controller
tightens quickly and loosens slowly: it raises the thresholds by four steps as soon as the estimate of `d` exceeds
the budget `1 - target_agreement` (a quality loss is what the user sees), and lowers them by one step only when a
one-sided 90% upper confidence bound on `d` (Wilson's) is within it; otherwise it holds. Each move starts the
evidence afresh (the checks before it describe other thresholds), so a move is never taken twice on the same
evidence. When it would tighten beyond the strictest thresholds, nothing holds the target on this text: exits stop
until the decoder empties.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

Z_ONE_SIDED_90 = 1.2816  # the one-sided bound holds with probability 0.9


def wilson_upper(failures: int, trials: int, z: float = Z_ONE_SIDED_90) -> float:
    """Wilson's one-sided upper confidence bound on a rate from `failures` in `trials` (1 with no trial)."""
    if trials == 0:
        return 1.0
    p, z2 = failures / trials, z * z
    centre = p + z2 / (2 * trials)
    spread = z * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials))
    return min(1.0, (centre + spread) / (1 + z2 / trials))


@dataclass
class QualityWindow:
    """The tokens (whether each left early unverified) and the exit checks (whether each agreed) since the thresholds
    last moved, the most recent `size` checks (and 4 x `size` tokens) of them."""

    size: int
    tokens: deque = field(default_factory=deque)
    checks: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.tokens = deque(maxlen=4 * self.size)
        self.checks = deque(maxlen=self.size)

    def add_tokens(self, early: int, other: int) -> None:
        """Tokens that became final: `early` left early unverified, `other` are deep or verified."""
        self.tokens.extend([True] * early + [False] * other)

    def add_checks(self, verdicts: list[bool]) -> None:
        self.checks.extend(verdicts)

    def clear(self) -> None:
        self.tokens.clear()
        self.checks.clear()

    def disagreement(self) -> tuple[float, float]:
        """(estimate, upper bound) of the output's disagreement rate; (0, 1) before the first check."""
        if not self.checks:
            return 0.0, 1.0
        h = sum(self.tokens) / len(self.tokens) if self.tokens else 1.0
        misses = len(self.checks) - sum(self.checks)
        return h * misses / len(self.checks), h * wilson_upper(misses, len(self.checks))


def controller_move(window: QualityWindow, target: float) -> int:
    """+1: tighten (the estimate misses the target), -1: loosen (the upper bound is within it), 0: hold."""
    estimate, high = window.disagreement()
    budget = 1.0 - target
    if estimate > budget:
        return 1
    return -1 if high <= budget else 0
