"""The static KV cache the compiled passes run on, over transformers' `StaticCache` (5.20-5.25).

Each `StaticLayer` holds preallocated (b, heads, max_cache_len, dim) buffers and its own length (`cumulative_length`,
a tensor updated in place), so the layer-wise fill keeps working: deep layers hold fewer slots than shallow ones,
and a layer writes a chunk at its own length. A rollback is a length update (`drop_static_slots`); the rejected slots
stay until overwritten, and no query sees them: a layer's queries start at its length (`get_query_offset`), and
causal masking hides every slot after a query's own.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, StaticCache, StaticLayer

STATIC_ROOM = 256  # static lengths are multiples of this: every call of similar length reuses the same graphs


def static_length(needed: int) -> int:
    """The static cache length for `needed` slots: the next multiple of `STATIC_ROOM`."""
    return -(-needed // STATIC_ROOM) * STATIC_ROOM


def new_static_cache(config: Any, needed: int) -> StaticCache | None:
    """An empty static cache with room for `needed` slots per layer, or None where the config's layers are not all
    plain static layers (sliding windows keep a rolling buffer whose slots a rollback cannot reuse)."""
    cache = StaticCache(config=config, max_cache_len=static_length(needed))
    return cache if all(type(layer) is StaticLayer for layer in cache.layers) else None


def is_static(cache: Any) -> bool:
    return isinstance(cache, StaticCache)


def static_held(cache: StaticCache, layer_idx: int) -> int:
    """Slots layer `layer_idx` holds."""
    return int(cache.layers[layer_idx].get_seq_length())


def drop_static_slots(layer: StaticLayer, count: int) -> None:
    """A rollback of `count` slots: a length update in place (5.20's `StaticLayer` has no `crop`; the tensor keeps
    its address for the graphs). The slots stay until overwritten."""
    layer.cumulative_length.sub_(count)


def make_room(cache: StaticCache, layer_idx: int, needed: int) -> None:
    """Let every layer hold `needed` slots: larger buffers (a longer static length, so new graphs) where they fall
    short, the states copied over. A decode sizes its cache for its `max_new_tokens` (up to a bound, past which
    "until EOS" callers grow it here)."""
    layers = cache.layers
    if needed <= layers[layer_idx].max_cache_len:
        return
    length = max(static_length(needed), 2 * layers[layer_idx].max_cache_len)  # doubling: few lengths, few graphs
    for layer in layers:
        layer.max_cache_len = length
        if not layer.is_initialized:
            continue
        for name in ("keys", "values"):
            old = getattr(layer, name)
            new = old.new_zeros((*old.shape[:2], length, old.shape[3]))
            new[:, :, : old.shape[2]] = old
            setattr(layer, name, new)
            torch._dynamo.mark_static_address(new)


def pad_custom_mask(mask: torch.Tensor, cache: StaticCache, layer_idx: int) -> torch.Tensor:
    """A custom 4D mask (b, 1, q, slots so far + q) widened to the layer's static length: the slots after blocked."""
    extra = cache.layers[layer_idx].max_cache_len - mask.shape[-1]
    if extra <= 0:
        return mask
    blocked = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
    return torch.cat([mask, mask.new_full((*mask.shape[:3], extra), blocked)], dim=-1)


def as_dynamic(cache: StaticCache, config: Any) -> DynamicCache:
    """A dynamic cache holding what each layer of `cache` holds (copies): what a decode returns to its caller, who
    may grow it, crop it or pass it to `generate` as any other."""
    out = DynamicCache(config=config)
    for layer_idx, layer in enumerate(cache.layers):
        if layer.is_initialized:
            length = static_held(cache, layer_idx)
            out.update(layer.keys[:, :, :length].clone(), layer.values[:, :, :length].clone(), layer_idx)
    return out
