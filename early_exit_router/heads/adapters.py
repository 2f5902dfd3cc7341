"""Exit adapters: small zero-initialised residual maps around the model's own final norm and LM head.

An untrained adapter is the identity, so an untrained head is exactly the logit lens (`lm_head(final_norm(h_e))`).
Most adapters sit before the final norm (`lm_head(final_norm(A h))`, tuned-lens style). The `postnorm` adapter sits
after it (`lm_head(M final_norm(h))`, no bias), which is what lets `export-draft` fold it exactly into a standalone
checkpoint's LM head (`lm_head.weight @ M`); a map before a normalisation cannot be folded into stock modules. Block
adapters (a decoder layer at the exit) are in `block.py`.
"""

from __future__ import annotations

import torch
from torch import nn


class IdentityAdapter(nn.Module):
    """No parameters: the logit lens."""

    post_norm = False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


class LinearAdapter(nn.Module):
    """`h + W h + b`, zero-initialised (tuned-lens style translator)."""

    post_norm = False

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, hidden_size, bias=True)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.proj(hidden)


class LowRankAdapter(nn.Module):
    """`h + B A h + b` with rank r; `B` and `b` start at zero so the untrained head is the logit lens."""

    post_norm = False

    def __init__(self, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(hidden_size, rank, bias=False)
        self.up = nn.Linear(rank, hidden_size, bias=True)
        nn.init.normal_(self.down.weight, std=hidden_size**-0.5)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.up(self.down(hidden))


class PostNormAdapter(nn.Module):
    """`x + W x` on the final norm's output, zero-initialised and without bias, so that it folds into the LM head."""

    post_norm = True

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, hidden_size, bias=False)
        nn.init.zeros_(self.proj.weight)

    def forward(self, normed: torch.Tensor) -> torch.Tensor:
        return normed + self.proj(normed)

    def folded_matrix(self) -> torch.Tensor:
        """M = I + W, so that `lm_head(M x) = (lm_head.weight @ M) x`."""
        eye = torch.eye(self.proj.weight.shape[0], dtype=self.proj.weight.dtype, device=self.proj.weight.device)
        return eye + self.proj.weight


def needs_context(adapter: nn.Module | None) -> bool:
    """Whether an adapter reads the context (a block adapter), so that it runs over chunks with a cache."""
    return bool(getattr(adapter, "needs_context", False))
