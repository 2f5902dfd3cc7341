"""Grouped-query attention on the CPU without copying the cache: the stack's passes call torch's SDPA with
`enable_gqa` where HF's `sdpa` attention would repeat every cached key and value head first.

HF's `sdpa` attention repeats the cached keys and values once per query head of a group (`repeat_kv`) whenever a
mask is given, because CUDA's fused kernels take grouped heads only without one. A plain decoding step has no mask
and is spared the copy; a verify pass or a token tree over several positions has one, and pays the copy in every
layer in proportion to the context. Measured on a 2-core x86_64 CPU (SmolLM2-135M: 9 query heads on 3 key/value
heads, 8 positions), one layer's attention takes 126 us against 67 at 300 cached positions, 539 against 219 at
1,000 and 2.4 ms against 1.2 at 4,000; a pass runs 30 layers. Torch's CPU kernels take grouped heads with a mask and
give bitwise the same numbers (checked by the tests).

So, for the length of one of the stack's own passes on a CPU, the model's configs that name "sdpa" name
`NATIVE_GQA_SDPA` instead: an attention function registered with transformers (with sdpa's mask builder under the
same name) that takes that path for a masked call on the CPU and hands every other call to HF's own `sdpa`. A
`finally` puts every config's value back; the model itself never changes. Some families' attention code tests for
"sdpa" by name (Falcon) and would take another path, so a model is checked once (`check_native_gqa`): a masked chunk
must reach the function in every layer and give bitwise the numbers of HF's `sdpa`, or the stack keeps HF's path.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F

NATIVE_GQA_SDPA = "early_exit_router_sdpa"
_native_calls = [0]  # masked calls served natively, read by `check_native_gqa`


class _PassMasks(threading.local):
    """The current pass's masks as SDPA adds them, by the bool mask HF built: converted once per pass, where SDPA
    would convert a bool mask again in every layer (1-2% of a bf16 pass over 8 positions, measured)."""

    def __init__(self) -> None:
        self.masks: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


_pass_masks = _PassMasks()


def native_gqa_supported(device: torch.device) -> bool:
    """Whether the stack's passes run grouped heads through SDPA natively on `device` (a CPU, torch 2.5+)."""
    return device.type == "cpu" and _torch_has_enable_gqa()


@cache
def _torch_has_enable_gqa() -> bool:
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 5)


def sdpa_native_gqa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's `sdpa` attention, with a masked call on the CPU over grouped heads computed without `repeat_kv`."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    plain = (
        attention_mask is None  # HF's sdpa already passes enable_gqa, or is_causal
        or getattr(module, "num_key_value_groups", 1) == 1
        or query.device.type != "cpu"
        or any(kwargs.get(name) for name in ("position_bias", "softcap", "output_attentions"))
    )
    if plain:
        sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
        return sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    if not torch.compiler.is_compiling():  # a count in a graph would be a guard that fails at every call
        _native_calls[0] += 1
    mask = _additive_mask(attention_mask, query.dtype)
    # With a mask HF's sdpa never sets is_causal; (b, heads, q, d) -> (b, q, heads, d) as it returns it.
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def _additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`mask` as SDPA adds it: a bool mask becomes 0 where True and -inf elsewhere, in the query's dtype (as SDPA's
    own conversion gives it, so the numbers stay bitwise); kept for the rest of the pass (`native_gqa`)."""
    if mask.dtype != torch.bool:
        return mask
    key = (id(mask), dtype)
    hit = _pass_masks.masks.get(key)
    if hit is not None and hit[0] is mask:  # the reference held below keeps the id from being reused
        return hit[1]
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    _pass_masks.masks[key] = (mask, additive)
    return additive


@cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NATIVE_GQA_SDPA, sdpa_native_gqa)
    AttentionMaskInterface.register(NATIVE_GQA_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def _configs(config: Any) -> Iterator[Any]:
    """`config` and its sub-configs, depth first."""
    yield config
    for name in getattr(config, "sub_configs", None) or ():
        sub = getattr(config, name, None)
        if sub is not None:
            yield from _configs(sub)


@contextmanager
def native_gqa(config: Any) -> Iterator[None]:
    """Within the block, the configs under `config` whose attention is "sdpa" name `NATIVE_GQA_SDPA`; each value
    is put back after, exactly (the setter recurses into sub-configs, so the stored attribute is set directly), and
    the block's converted masks are dropped."""
    _register()
    swapped = []
    try:
        for each in _configs(config):
            if getattr(each, "_attn_implementation_internal", None) == "sdpa":
                each._attn_implementation_internal = NATIVE_GQA_SDPA
                swapped.append(each)
        yield
    finally:
        for each in swapped:
            each._attn_implementation_internal = "sdpa"
        _pass_masks.masks.clear()


@torch.no_grad()
def check_native_gqa(stack: Any) -> bool:
    """Whether `stack`'s layers, given a masked chunk, reach `sdpa_native_gqa` in every layer and return bitwise the
    numbers HF's `sdpa` gives (False also for a model without grouped heads: it has nothing to gain)."""
    config = stack.config
    heads, groups = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if not (heads and groups and heads > groups) or not native_gqa_supported(stack.device):
        return False
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 7, stack.hidden_size, generator=generator).to(device=stack.device, dtype=stack.dtype)
    positions = torch.arange(7, device=stack.device).unsqueeze(0)

    def chunk(scope: Any) -> torch.Tensor:
        """The last 3 positions over a cache of the first 4 (a masked chunk, as a verify pass runs)."""
        cache = stack.new_cache()
        with scope:
            stack.run(hidden[:, :4], 0, stack.num_layers, cache, positions[:, :4])
            return stack.run(hidden[:, 4:], 0, stack.num_layers, cache, positions[:, 4:])

    before = _native_calls[0]
    try:
        native = chunk(native_gqa(config))
    except Exception:  # noqa: BLE001 - a family whose attention code takes another path under another name
        return False
    reached = _native_calls[0] - before == stack.num_layers
    return reached and torch.equal(native, chunk(nullcontext()))
