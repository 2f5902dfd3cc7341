"""What an exit feeds its LM head, and the trimmed draft head (the LM head over the most frequent token ids only)."""

from __future__ import annotations

import platform
from functools import cache
from typing import Any

import torch
from torch import nn

from early_exit_router.heads.adapters import needs_context
from early_exit_router.models.architecture import dense


def exit_normed(stack: Any, adapter: nn.Module | None, hidden: torch.Tensor) -> torch.Tensor:
    """What an exit feeds its LM head: the adapter (before or after the final norm) and the final norm.

    A block adapter needs the context: `hidden` is then (b, m, hidden), one chunk of consecutive positions from the
    start of the text (as in training); the engine runs blocks through their `BlockContext` instead."""
    if adapter is None:
        return stack.final_norm(hidden)
    if getattr(adapter, "post_norm", False):
        return adapter(stack.final_norm(hidden))
    if needs_context(adapter):
        return after_block(adapter, stack.final_norm(adapter(hidden, stack)))
    return stack.final_norm(adapter(hidden))


def after_block(adapter: nn.Module, normed: torch.Tensor) -> torch.Tensor:
    """A block adapter's post-norm map (a `residual_block`'s), applied to the final norm of the block's output."""
    post = getattr(adapter, "post", None)
    return normed if post is None else post(normed)


def exit_logits(stack: Any, adapter: nn.Module | None, hidden: torch.Tensor) -> torch.Tensor:
    """Exit-head logits `(..., vocab)` for hidden states `(..., hidden)`; adapter None is the logit lens."""
    return stack.unembed(exit_normed(stack, adapter, hidden))


# Where a CPU multiplies a float16 weight fast (a matrix-vector product accumulating in float32), it is only for a
# few rows: wider products of a float16 weight fall to slower kernels (on an AVX2 host, SmolLM2's 4096-row head read
# from memory: 6 rows as fast as float32 rows, 8 rows 1.4x their time, 64 rows 4.5x), so those multiply by the rows
# upcast instead (8 rows 1.4x, 64 rows 1.2x the float32 rows' time: the upcast copy's traffic).
HALF_ROWS_ON_CPU = 6


@cache
def half_rows_pay(device_type: str) -> bool:
    """Whether float16 draft rows are faster than float32 ones on this kind of device: an x86 CPU whose torch has the
    float16 matrix-vector path with float32 accumulation (torch 2.6 on, pytorch#137918; before it, float16 products
    ran several times slower than float32 ones there). GPUs and other CPUs keep float32 rows until measured there."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return device_type == "cpu" and x86 and (major, minor) >= (2, 6)


def keeps_half_rows(stack: Any, half: bool) -> bool:
    """Whether a draft head asked for float16 rows (`half_draft_head`) keeps them on `stack`'s model: a float32
    model on a device where they pay (`half_rows_pay`); elsewhere the rows stay in the compute dtype."""
    return half and stack.dtype == torch.float32 and half_rows_pay(stack.device.type)


class DraftHead(nn.Module):
    """The model's LM head restricted to a fixed set of token ids (a vocabulary-trimmed draft head, as in FR-Spec).

    A draft only has to propose tokens the deep pass will check with the full head, so a head over the K most
    frequent ids proposes nearly every token the full one would, at K / vocab of its cost (and its slice of the
    weight stays in cache). The weight slice is a copy: K x hidden values beside the base model, in the head's
    compute dtype, or with `half` float16 where that is float32: half the bytes an ask reads, which are most of its
    cost, for logits within a few hundredths of float32's (the products accumulate in float32 and are rounded to
    float16; they come back in the compute dtype).
    """

    def __init__(self, lm_head: nn.Module, token_ids: torch.Tensor, half: bool = False) -> None:
        super().__init__()
        # dense(): a quantized LM head gives dense rows, in the compute dtype unless `half` asks for float16 ones.
        token_ids = token_ids.to(lm_head.weight.device)
        self.register_buffer("token_ids", token_ids, persistent=False)
        rows = dense(lm_head.weight.detach())[token_ids]
        dtype = torch.float16 if half and rows.dtype == torch.float32 else rows.dtype
        self.register_buffer("weight", rows.to(dtype, copy=True), persistent=False)
        bias = getattr(lm_head, "bias", None)
        rows = None if bias is None else dense(bias.detach())[token_ids].to(self.weight.dtype, copy=True)
        self.register_buffer("bias", rows, persistent=False)

    def forward(self, normed: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., K) logits over `token_ids`, in `normed`'s dtype."""
        weight, bias = self.weight, self.bias
        if weight.dtype == normed.dtype:
            return torch.nn.functional.linear(normed, weight, bias)
        if normed.device.type == "cpu" and normed[..., 0].numel() > HALF_ROWS_ON_CPU:
            upcast = None if bias is None else bias.to(normed.dtype)
            return torch.nn.functional.linear(normed, weight.to(normed.dtype), upcast)
        return torch.nn.functional.linear(normed.to(weight.dtype), weight, bias).to(normed.dtype)


def draft_logits(
    stack: Any, adapter: nn.Module | None, draft: DraftHead | None, hidden: torch.Tensor, trimmed: bool = False
) -> torch.Tensor:
    """An exit's draft logits `(..., vocab)`: the trimmed head's logits, -inf outside its token set (the full
    exit head when `draft` is None). Full-width rows keep logits processors, sampling and the speculative-sampling
    rule unchanged: a draft distribution that is zero outside the set is still a valid q. With `trimmed` (and a
    draft head): its `(..., K)` logits over `draft.token_ids` alone, for a greedy ask that needs no full row."""
    normed = exit_normed(stack, adapter, hidden)
    if trimmed and draft is not None:
        return stack.finish_logits(draft(normed))
    return logits_from_normed(stack, draft, normed)


def trimmed_top1(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """(..., K) trimmed logits over `token_ids` -> (...) the top-1 token id, the lowest id among equal maxima: the
    token the argmax of the full-width row (-inf outside the set) picks."""
    best = logits.max(dim=-1, keepdim=True).values
    candidates = torch.where(logits == best, token_ids, torch.iinfo(token_ids.dtype).max)
    return candidates.min(dim=-1).values


def logits_from_normed(stack: Any, draft: DraftHead | None, normed: torch.Tensor) -> torch.Tensor:
    """The head's logits `(..., vocab)` for normed states: the trimmed head's (-inf outside its ids), or the full
    LM head's when `draft` is None."""
    if draft is None:
        return stack.unembed(normed)
    sub = stack.finish_logits(draft(normed))  # (..., K)
    full = torch.full((*sub.shape[:-1], stack.vocab_size), float("-inf"), dtype=sub.dtype, device=sub.device)
    return full.index_copy_(-1, draft.token_ids, sub)


def draft_token_ranking(top1: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(vocab,) token ids ordered by how often they are the model's top-1 prediction in `top1` (ties: lower id
    first, so that ids never predicted keep their BPE order behind the predicted ones). FR-Spec's frequency-ranked
    vocabulary, from the model's own predictions."""
    counts = torch.bincount(top1.flatten().cpu(), minlength=vocab_size)[:vocab_size]
    # Stable descending sort: equal counts keep ascending id order.
    return torch.sort(-counts, stable=True).indices
