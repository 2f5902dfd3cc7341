"""The memory budget of a routed model at a context length: what a limited-VRAM deployment has to fit.

Weights are counted from the tensors themselves (tied weights once). The KV cache is measured, not derived from
config fields: a short probe runs every layer into a fresh cache, and each layer's bytes per position are read off
its tensors, so grouped-query attention, per-layer head dims and quantized caches count as they are stored.
Sliding-window layers hold at most their window.
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass
from typing import Any

import torch

from early_exit_router.models.sizes import cache_bytes, kv_bytes_per_position, tensor_bytes


@dataclass
class MemoryBudget:
    """Bytes per part, for one sequence whose cache holds `context` positions."""

    context: int
    base_weights: int
    heads: int  # exit adapters and gates
    draft_head: int  # the trimmed draft head's slice of the LM head (a copy)
    kv_cache: int
    fill_workspace: int  # a deep pass over max_pending + 1 positions: its logits rows and waiting hidden states
    packed_weights: int = 0  # prepacked copies of the base weights (`models/packed.py`; `pack_weights=False`: none)

    @property
    def total(self) -> int:
        return (
            self.base_weights + self.heads + self.draft_head + self.kv_cache + self.fill_workspace + self.packed_weights
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}

    def markdown(self) -> str:
        rows = [
            ("base weights", self.base_weights),
            ("exit heads and gates", self.heads),
            ("trimmed draft head", self.draft_head),
            (f"KV cache ({self.context} positions)", self.kv_cache),
            ("fill workspace", self.fill_workspace),
            ("prepacked weights", self.packed_weights),
            ("total", self.total),
        ]
        lines = ["| part | MiB | share of base weights |", "|---|---|---|"]
        for name, size in rows:
            lines.append(f"| {name} | {size / 2**20:.2f} | {size / max(1, self.base_weights):.1%} |")
        return "\n".join(lines)


def memory_budget(router: Any, context: int) -> MemoryBudget:
    """The budget of `router`'s model for one sequence of `context` positions (while it decodes, each cache layer
    also keeps room for up to an eighth more positions and 64: `_compat.GrowingLayer`)."""
    stack, config = router.stack, router.config
    model = router.model
    base = tensor_bytes(list(model.parameters()) + list(model.buffers()))
    heads, draft_bytes = router.heads.nbytes(stack, config.draft_vocab_size, config.half_draft_head)
    window = getattr(stack.config, "sliding_window", None)
    kv = 0
    for kind, per_position in zip(stack.mask_kinds, kv_bytes_per_position(stack)):
        held = min(context, window) if kind == "sliding_attention" and window else context
        kv += per_position * held
    element = torch.finfo(stack.dtype).bits // 8
    rows = config.max_pending + 1
    workspace = rows * stack.vocab_size * 4 + rows * stack.hidden_size * element * (len(router.exit_layers) + 1)
    return MemoryBudget(context, base, heads, draft_bytes, kv, workspace, packed_bytes(router))


def packed_bytes(router: Any) -> int:
    """Prepacked copies: of the model's weights and of each block adapter's layer (packed now if not yet run)."""
    stack = router.stack
    blocks = [stack.packed_module(layer) for layer in router.heads.block_layers()]
    return sum(packed.nbytes for packed in [stack.packed_weights, *blocks] if packed is not None)


@torch.no_grad()
def measured_bytes(router: Any, context: int) -> int:
    """What one routed generation at `context` positions holds once it decodes (a prompt of `context` tokens and one
    new one, so that the cache holds `context` positions): on CUDA the allocator's live bytes with the output held;
    elsewhere the bytes of the weights, heads, draft head, prepacked copies and the returned cache."""
    return generation_bytes(router, context)[0]


@torch.no_grad()
def generation_bytes(router: Any, context: int) -> tuple[int, int]:
    """(held, peak) of one routed generation at `context` positions: held as `measured_bytes`; peak, on CUDA, the
    allocator's peak, which the prefill's transient activations set (elsewhere the held bytes again)."""
    stack = router.stack
    ids = torch.randint(0, min(stack.vocab_size, 1000), (1, context), generator=torch.Generator().manual_seed(0))
    cuda = stack.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(stack.device)
        torch.cuda.reset_peak_memory_stats(stack.device)
    out = router.generate(ids.to(stack.device), max_new_tokens=1, mode="verify", do_sample=False)
    if cuda:
        # The budget counts what decoding holds; the peak also holds the prompt's activations (the first GPU run
        # measured 2-3x the budget at 4096 positions that way), so it is reported apart.
        gc.collect()  # the finished decoder's reference cycles
        torch.cuda.synchronize(stack.device)
        return int(torch.cuda.memory_allocated(stack.device)), int(torch.cuda.max_memory_allocated(stack.device))
    draft = router.heads.draft_head(stack, router.config.draft_vocab_size, router.config.half_draft_head)
    weights = list(router.model.parameters()) + list(router.model.buffers()) + list(router.heads.parameters())
    held = tensor_bytes(weights + ([] if draft is None else [draft.weight, draft.bias])) + cache_bytes(out.cache)
    held += packed_bytes(router)  # opaque tensors: counted as their weights' size, which is what they hold
    return held, held
