"""Bytes a model holds: its tensors' storages (tied weights once, quantized tensors by their parts) and its KV
cache per position, measured on a short probe rather than derived from config fields."""

from __future__ import annotations

from typing import Any

import torch

PROBE_POSITIONS = 8


def tensor_bytes(tensors: Any) -> int:
    """Bytes of distinct storages among `tensors` (tied or shared weights count once; a quantized tensor counts
    the storages it is made of: packed values, scales, zero points)."""
    seen: dict[int, int] = {}
    for t in tensors:
        for part in _stored_parts(t):
            storage = part.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _stored_parts(tensor: torch.Tensor | None) -> Any:
    if tensor is None:
        return
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()  # a tensor subclass: its inner tensors hold the bytes
        for name in names:
            yield from _stored_parts(getattr(tensor, name))
        return
    yield tensor


def cache_bytes(cache: Any) -> int:
    """Bytes the keys and values of every layer of a DynamicCache hold now."""
    return tensor_bytes(
        t for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
    )


@torch.no_grad()
def kv_bytes_per_position(stack: Any) -> list[int]:
    """Per layer, the bytes one position adds to the cache: measured on a short probe."""
    cache = stack.new_cache()
    ids = torch.zeros((1, PROBE_POSITIONS), dtype=torch.long, device=stack.device)
    positions = torch.arange(PROBE_POSITIONS, device=stack.device).unsqueeze(0)
    stack.run(stack.embed(ids), 0, stack.num_layers, cache, positions)
    out = []
    for layer in cache.layers:
        size = sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
        out.append(size // PROBE_POSITIONS)
    return out
