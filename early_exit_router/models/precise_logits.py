"""The full model's top logits in float32 where its LM head runs in bfloat16 or float16.

A bf16 LM head accumulates each logit in float32 and then rounds it to bf16: about 3 significant digits, 0.06-0.125
apart at the logits' usual size. Two candidates the float32 product ranks apart can then come out tied or swapped,
and greedy decoding picks by that rounding. Recomputing the few leading candidates' logits in float32, from the
same normed hidden state and the same (bf16) head weights, ranks them as the exact product does. On SmolLM2-135M in
bf16, teacher-forced over 1,508 positions of its own greedy output (26 prompts), this took the positions where the
choice differs from the float32 model's from 39 to 22 (`examples/bf16_head_rounding.py`).

The cost is `top_k` dot products per row and a top-k over the vocabulary, next to a head that reads every row of the
weight. Quantized heads are left alone (their weights are not a plain tensor to index), as is float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

LOW_PRECISION = (torch.bfloat16, torch.float16)
TOP_K = 8  # candidates recomputed per row: the ones rounding can reorder lie within a few bf16 steps of the top


def refines(lm_head: nn.Module) -> bool:
    """Whether `precise_top_logits` changes this head's logits: a plain bf16/fp16 weight."""
    weight = lm_head.weight
    return weight.dtype in LOW_PRECISION and type(weight) in (torch.Tensor, nn.Parameter)


def precise_top_logits(
    raw: torch.Tensor,
    normed: torch.Tensor,
    lm_head: nn.Module,
    finish: Callable[[torch.Tensor], torch.Tensor],
    top_k: int = TOP_K,
) -> torch.Tensor:
    """Float32 logits (..., vocab) from the head's output `raw` (..., vocab) and its input `normed` (..., hidden): each
    row's `top_k` leading entries recomputed in float32, then `finish` (what the family does to the head's output)
    applied to all. The leading entries are chosen before `finish`, whose soft-cap would make ties of them."""
    out = raw.float()
    k = min(top_k, raw.shape[-1])
    top = raw.topk(k, dim=-1).indices  # (..., k)
    weight = lm_head.weight[top].float()  # (..., k, hidden)
    exact = torch.einsum("...d,...kd->...k", normed.float(), weight)  # (..., k)
    bias = getattr(lm_head, "bias", None)
    if bias is not None:
        exact = exact + bias[top].float()
    return finish(out.scatter_(-1, top, exact))
