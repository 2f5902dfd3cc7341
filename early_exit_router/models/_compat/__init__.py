"""Everything that differs between transformers releases lives here, and nowhere else.

* The decoder layers' cache keyword: `cache=` in transformers 5.x (with `past_key_values=` deprecated),
  `past_key_values=` before.
* Mask builders take `layer_idx`, so that a mask is sized against one layer's cache even while the shallow layers
  hold more tokens than the deep ones (which is the normal state during early exit).
* `Cache.crop` takes a negative count ("remove this many"); a positive count meant "keep this many" in 4.x and is
  refused in 5.x. We always crop per layer, by a negative count.
* Decoder layers return a tensor in 5.x and a tuple in older releases.
* Sliding-window cache layers keep recorded past states only until the next `crop`: `drop_last_positions` removes
  padding without that trim (it reads the layer's `keys`, `values` and `cumulative_length`).
* `generate()` and forward passes keep their cache under `cache` (model kwargs and output field) in newer 5.x
  releases, `past_key_values` before; the mask builders take `cache=` or `past_key_values=` likewise.
* Cache layers: `GrowingLayer` is a `DynamicLayer` (its `update`, `crop`, `reset` and `keys`/`values` attributes)
  whose states are views of buffers with room to grow.
* Static caches (`static_cache.py`, the compiled passes' cache): `StaticLayer`'s buffers, per-layer length tensor
  and `max_cache_len`.
* PEFT (adapt-base's LoRA) reads `is_gradient_checkpointing`, which 5.x deprecates with a FutureWarning on every
  wrap (`quiet_peft`).
* Saved folders other releases read: 5.x writes RoPE settings only as `rope_parameters` and names its fast tokenizer
  `TokenizersBackend`, neither of which 4.x knows (`add_legacy_config_fields`, `portable_tokenizer_class`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import warnings
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import masking_utils
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

MIN_TRANSFORMERS = "5.20.0"


def transformers_version() -> str:
    return transformers.__version__


@cache
def cache_kwarg_for(layer_cls: type) -> str:
    """The keyword a decoder layer class takes its cache under."""
    params = inspect.signature(layer_cls.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    if "layer_past" in params:
        return "layer_past"
    raise TypeError(
        f"{layer_cls.__name__}.forward takes no cache argument; this transformers release "
        f"({transformers_version()}) is not supported."
    )


@cache
def required_layer_inputs(layer_cls: type) -> tuple[str, ...]:
    """The parameters of a decoder layer's forward that have no default (the hidden states among them)."""
    params = inspect.signature(layer_cls.forward).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(p.name for p in params if p.default is inspect.Parameter.empty and p.kind in kinds)


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """PEFT's wrapping and loading, without transformers' deprecation notice for the attribute PEFT reads."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def layer_output_hidden(output: Any) -> torch.Tensor:
    """The hidden states a decoder layer returned (a tensor in 5.x, the first element of a tuple before)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def with_layer_hidden(output: Any, hidden: torch.Tensor) -> Any:
    """A decoder layer's `output` with its hidden states replaced by `hidden`, in the same form."""
    return (hidden, *output[1:]) if isinstance(output, (tuple, list)) else hidden


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of buffers with room to grow, so that appending copies only
    the new positions where `DynamicLayer` concatenates (copies) the whole layer at every step.

    That copy grows with the context: `early-exit-router profile --long-context 8000` timed SmolLM2's plain step at
    169.7 ms with these layers against 207.4 with `DynamicLayer` (2-core AMD EPYC VM, float32, same logits). A
    buffer holds an eighth more positions than it was sized for, and 64, and grows by copying into a larger one
    when full. A crop stays a view of the buffer, and the next append overwrites what
    was cropped, as a full forward pass would have it. Anything else that replaces the states (rows joining or
    leaving a batch) is noticed and adopted into a new buffer at the next append. With autograd recording it appends
    as `DynamicLayer` does: writing into a buffer would change what an earlier step saved for the backward pass."""

    ROOM = 64  # positions a buffer holds beyond its size and an eighth of it

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            self._buffers = None
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        total = held + key_states.shape[-2]
        if not self._has_room(key_states, value_states, held, total):
            self._buffers = tuple(
                self._buffer_for(new, old, held, total)
                for new, old in ((key_states, self.keys), (value_states, self.values))
            )
        keys, values = self._buffers
        keys[:, :, held:total].copy_(key_states)  # (b, heads, capacity, dim): the new positions after the held ones
        values[:, :, held:total].copy_(value_states)
        self.keys, self.values = keys[:, :, :total], values[:, :, :total]
        return self.keys, self.values

    def _has_room(self, key_states: torch.Tensor, value_states: torch.Tensor, held: int, total: int) -> bool:
        """Whether the buffers hold the layer's states as their first `held` positions and fit `total`."""
        if self._buffers is None:
            return False
        if self._buffers[0].is_inference() and not torch.is_inference_mode_enabled():
            return False  # outside inference mode an inference tensor takes no writes
        for buffer, held_states, new in zip(self._buffers, (self.keys, self.values), (key_states, value_states)):
            fits = buffer.shape[2] >= total and (buffer.shape[:2], buffer.shape[3]) == (new.shape[:2], new.shape[3])
            same = (buffer.dtype, buffer.device) == (new.dtype, new.device)
            start = (held_states.data_ptr(), held_states.stride())
            view = held == 0 or start == (buffer.data_ptr(), buffer.stride())
            if not (fits and same and view):
                return False
        return True

    def _buffer_for(self, new: torch.Tensor, held_states: torch.Tensor, held: int, total: int) -> torch.Tensor:
        """A buffer for `total` positions and room, holding the layer's `held` states first."""
        b, heads, _, dim = new.shape
        buffer = new.new_empty((b, heads, total + total // 8 + self.ROOM, dim))
        if held:
            buffer[:, :, :held].copy_(held_states)
        return buffer

    def release_room(self) -> None:
        """Drop the buffers (the states stay): the next append copies the states into new ones."""
        self._buffers = None

    def reset(self) -> None:
        self._buffers = None
        super().reset()


def new_cache(config: Any) -> DynamicCache:
    """An empty dynamic cache laid out for `config` (sliding layers where the config has them), its plain layers
    `GrowingLayer`s."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def new_block_cache() -> DynamicCache:
    """An empty cache for one block adapter: `GrowingLayer`s, created as the block writes to them."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    return cache


def can_adopt_layers(cache: Any) -> bool:
    """Whether a cache can take a decode's layers as they are (`adopt_layers`): an empty `DynamicCache` of plain or
    sliding layers that does not offload. A cache holding states, and static, quantized and offloading caches,
    cannot."""
    plain = (DynamicLayer, DynamicSlidingWindowLayer)
    return (
        type(cache) is DynamicCache
        and not cache.offloading
        and cache.get_seq_length() == 0
        and all(type(layer) in plain for layer in cache.layers)
    )


def adopt_layers(cache: DynamicCache, source: DynamicCache) -> None:
    """Give a caller's empty `cache` the layers of the decode's `source`, as generate() leaves the cache a caller
    passed it holding the run's states."""
    cache.layers = list(source.layers)


def prepare_for_rollback(cache: DynamicCache) -> None:
    """Let sliding-window layers keep evicted states until `trim_sliding` (verify mode may roll back into them)."""
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) and hasattr(layer, "activate_past_recording"):
            layer.activate_past_recording()


def trim_sliding(cache: DynamicCache) -> None:
    """Drop the states sliding-window layers kept for a rollback that can no longer happen."""
    for layer in cache.layers:
        if getattr(layer, "record_past", False) and layer.get_seq_length() >= layer.sliding_window:
            layer.crop(0)


def crop_cache_layer(cache: DynamicCache, layer_idx: int, keep: int) -> None:
    """Crop one layer of `cache` to its first `keep` positions (a negative count: the same meaning in 4.x and 5.x)."""
    remove = cache.get_seq_length(layer_idx) - keep
    if remove > 0 and is_static(cache):
        drop_static_slots(cache.layers[layer_idx], int(remove))
    elif remove > 0:
        cache.layers[layer_idx].crop(-remove)


def released(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or an ordinary copy of it where decoding made it an inference tensor: those refuse autograd and
    in-place updates outside `torch.inference_mode`, which a caller's next step may need (a caller in inference mode
    itself can use them as they are)."""
    return tensor.clone() if tensor.is_inference() and not torch.is_inference_mode_enabled() else tensor


def release_inference_tensors(cache: Any) -> None:
    """Make the tensors `cache`'s layers hold `released` ones (compact copies: room to grow is dropped)."""
    if torch.is_inference_mode_enabled():  # a caller in inference mode can use them, room and all
        return
    for layer in getattr(cache, "layers", ()):
        if isinstance(layer, GrowingLayer):
            layer.release_room()
        for name, value in list(vars(layer).items()):
            if isinstance(value, torch.Tensor):
                setattr(layer, name, released(value))


def handed_back(cache: Any, config: Any) -> Any:
    """A finished decode's cache as its caller gets it: dynamic (a static one's states copied), `released`."""
    if is_static(cache):
        cache = as_dynamic(cache, config)
    release_inference_tensors(cache)
    return cache


def drop_last_positions(cache: DynamicCache, layer_idx: int, count: int) -> None:
    """Remove the last `count` positions of one layer, keeping every state a later rollback may need.

    `crop` on a sliding-window layer past its window also trims the states it recorded for rollbacks (down to the
    window), so a rollback after it would find them gone; throw-away padding positions are sliced off instead."""
    if count <= 0:
        return
    layer = cache.layers[layer_idx]
    if getattr(layer, "is_sliding", False) and layer.get_seq_length() >= layer.sliding_window:
        if not getattr(layer, "record_past", False):
            raise RuntimeError("Padding a sliding-window layer needs prepare_for_rollback() on its cache first.")
        layer.keys = layer.keys[:, :, :-count, :]
        layer.values = layer.values[:, :, :-count, :]
        layer.cumulative_length -= count
        return
    crop_cache_layer(cache, layer_idx, cache.get_seq_length(layer_idx) - count)


MASK_BUILDERS: dict[str, Callable[..., Any]] = {
    "full_attention": masking_utils.create_causal_mask,
    "sliding_attention": masking_utils.create_sliding_window_causal_mask,
}
# The mask builders' cache keyword: `cache` in newer 5.x releases, `past_key_values` up to 5.20.
MASK_CACHE_KWARG = (
    "cache" if "cache" in inspect.signature(masking_utils.create_causal_mask).parameters else "past_key_values"
)


def build_mask(
    kind: str,
    config: Any,
    hidden: torch.Tensor,
    cache: DynamicCache,
    position_ids: torch.Tensor,
    layer_idx: int,
    attention_mask: torch.Tensor | None = None,
) -> Any:
    """The attention mask of one layer kind, sized against layer `layer_idx` of `cache`; `attention_mask` (b, slots)
    marks the real slots of left-padded rows."""
    try:
        builder = MASK_BUILDERS[kind]
    except KeyError:
        raise NotImplementedError(f"Attention layer type {kind!r} is not supported yet.") from None
    if attention_mask is not None and attention_mask.dim() == 4 and is_static(cache):  # a tree's, over static slots
        attention_mask = pad_custom_mask(attention_mask, cache, layer_idx)
    return builder(
        config=config,
        inputs_embeds=hidden,
        attention_mask=attention_mask,
        position_ids=position_ids,
        layer_idx=layer_idx,
        **{MASK_CACHE_KWARG: cache},
    )


def tree_attention_mask(config: Any, allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """A custom (b, 1, q, kv) attention mask from `allowed` (b, q, kv) booleans, in the form the model's attention
    implementation reads: booleans for sdpa, 0 / the dtype's minimum added to the scores for eager; None for the
    implementations that take no custom mask (flash attention, ...). The mask builders pass a 4D mask on as it is."""
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation == "sdpa":
        return allowed[:, None]
    if implementation == "eager":
        blocked = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return blocked.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]
    return None


def check_supported() -> None:
    """Raise a clear error on a transformers release whose APIs this package does not speak."""
    params = inspect.signature(masking_utils.create_causal_mask).parameters
    if "layer_idx" not in params:
        raise ImportError(
            f"early-exit-router needs transformers >= {MIN_TRANSFORMERS} (found {transformers_version()}): "
            f"pip install 'transformers>={MIN_TRANSFORMERS},<6'."
        )


GENERATE_CACHE_KWARG = "cache"  # the model_kwargs key generate() prepares its cache under


def forward_cache(output: Any) -> Any:
    """The cache a model's forward returned: `cache` in 5.x (reading `past_key_values` warns), else the old field."""
    if "cache" in getattr(output, "keys", dict)():
        return output["cache"]
    return getattr(output, "past_key_values", None)


def merged_generation_config(model: Any, config: Any, kwargs: dict[str, Any]) -> Any:
    """The generation config `model.generate(generation_config=config, **kwargs)` decodes under: a passed config's
    unset fields filled from `model.generation_config`, then the kwargs, as generate() merges them (a copy)."""
    prepare = getattr(model, "_prepare_generation_config", None)
    if prepare is not None:
        try:
            return prepare(config, **kwargs)[0]
        except TypeError:  # a signature of another release: merge as below
            pass
    merged = copy.deepcopy(config or model.generation_config)
    merged.update(**{k: v for k, v in kwargs.items() if hasattr(merged, k)})
    return merged


def compiled_generate_kwargs(max_cache_len: int, device: torch.device) -> dict[str, Any]:
    """generate() arguments for HF's own fast path: a static cache of `max_cache_len` slots (one size for every call,
    so the compiled step is not compiled again for a longer prompt) and the decode step compiled by torch.compile
    with transformers' CompileConfig. generate() compiles on its own only on accelerators; elsewhere (a CPU) it
    compiles when the config's private `_compile_all_devices` says so (5.20-5.25), which is what a user asking for
    compilation means. CUDA graphs ("reduce-overhead", HF's default mode) exist only on CUDA."""
    from transformers.generation.configuration_utils import CompileConfig

    compile_config = CompileConfig() if device.type == "cuda" else CompileConfig(mode="default")
    compile_config._compile_all_devices = True
    return {"cache_implementation": "static", "max_cache_len": max_cache_len, "compile_config": compile_config}


def syncs_gpus(model: Any, synced_gpus: bool | None) -> bool:
    """Whether `model.generate(synced_gpus=synced_gpus)` keeps several processes stepping together, as generate()
    decides it (None: under DeepSpeed ZeRO-3 or FSDP with more than one process)."""
    if synced_gpus is not None:
        return bool(synced_gpus)
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return False
    from transformers.distributed.fsdp import is_fsdp_managed_module
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    sharded = is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model)
    return bool(sharded) and torch.distributed.get_world_size() > 1


def generate_output(sequences: torch.Tensor, scores: Any, logits: Any, cache: Any) -> Any:
    """HF's decoder-only generate output, with the cache under this release's field name."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    fields = GenerateDecoderOnlyOutput.__dataclass_fields__
    cache_field = "cache" if "cache" in fields else "past_key_values"
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits, **{cache_field: cache})


def cache_rows_can_change(cache: Any) -> bool:
    """Whether rows can join, leave and be left-padded in `cache`: plain growing layers only (a sliding window keeps
    a rolling slice whose slots do not line up across rows)."""
    return all(type(layer) in (DynamicLayer, GrowingLayer) for layer in cache.layers)


def _layers_with_states(cache: Any) -> list[Any]:
    if not cache_rows_can_change(cache):
        raise NotImplementedError("Rows can join or leave a batch only with plain (non-sliding) cache layers.")
    return [layer for layer in cache.layers if layer.is_initialized and layer.keys.numel() > 0]


def pad_cache_front(cache: Any, count: int) -> None:
    """Prepend `count` zero slots to every layer (left padding: the attention mask hides them)."""
    for layer in _layers_with_states(cache):
        b, heads, _, dim = layer.keys.shape
        layer.keys = torch.cat([layer.keys.new_zeros((b, heads, count, dim)), layer.keys], dim=-2)
        b, heads, _, dim = layer.values.shape
        layer.values = torch.cat([layer.values.new_zeros((b, heads, count, dim)), layer.values], dim=-2)


def drop_cache_front(cache: Any, count: int) -> None:
    """Drop the first `count` slots of every layer (padding in every row)."""
    for layer in _layers_with_states(cache):
        layer.keys = layer.keys[:, :, count:]
        layer.values = layer.values[:, :, count:]


def concat_cache_rows(cache: Any, other: Any) -> None:
    """Append `other`'s rows to `cache`, layer by layer (both hold the same slots)."""
    ours, theirs = _layers_with_states(cache), _layers_with_states(other)
    if len(ours) != len(theirs):
        raise ValueError("The caches hold different layers: rows can join only between steps.")
    for mine, new in zip(ours, theirs):
        mine.keys = torch.cat([mine.keys, new.keys], dim=0)
        mine.values = torch.cat([mine.values, new.values], dim=0)


def gather_cache_slots(cache: Any, index: torch.Tensor) -> None:
    """Keep, per row, the slots `index` (b, w) names, in that order, in every layer (a ragged batch's compaction)."""
    for layer in _layers_with_states(cache):
        for name in ("keys", "values"):
            states = getattr(layer, name)  # (b, heads, slots, dim)
            take = index[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[3])
            setattr(layer, name, states.gather(2, take))


def keep_slots_after(cache: Any, first: int, slots: list[int]) -> None:
    """Every layer keeps its slots before `first`, then `slots` (each >= `first`, increasing), and nothing else: a
    verified token tree's path moved next to the context. Copies only the path's entries."""
    in_place = slots == list(range(first, first + len(slots)))
    index = torch.tensor(slots)
    for layer_idx, layer in enumerate(cache.layers):
        if not in_place:
            index = index.to(layer.keys.device)  # a no-op after the first layer, unless layers sit on several devices
            for name in ("keys", "values"):
                states = getattr(layer, name)  # (b, heads, slots, dim)
                states[:, :, first : first + len(slots)] = states.index_select(2, index)
        crop_cache_layer(cache, layer_idx, first + len(slots))


def add_legacy_config_fields(path: Path) -> None:
    """Mirror transformers 5's `rope_parameters` into the fields transformers 4 reads (`rope_theta`, `rope_scaling`,
    Gemma 3's `rope_local_base_freq`). transformers 5 reads `rope_parameters` first and ignores these."""
    config = json.loads(path.read_text())
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict):
        return
    per_layer_type = bool(rope) and all(isinstance(v, dict) for v in rope.values())
    full = rope.get("full_attention", {}) if per_layer_type else rope
    sliding = rope.get("sliding_attention", {}) if per_layer_type else {}
    legacy: dict[str, Any] = {}
    if "rope_theta" in full:
        legacy["rope_theta"] = full["rope_theta"]
    if full.get("rope_type", "default") != "default":
        legacy["rope_scaling"] = {k: v for k, v in full.items() if k != "rope_theta"}
    if "rope_theta" in sliding:
        legacy["rope_local_base_freq"] = sliding["rope_theta"]
    added = {k: v for k, v in legacy.items() if config.get(k) is None}
    if added:
        path.write_text(json.dumps({**config, **added}, indent=2, sort_keys=True) + "\n")


def portable_tokenizer_class(out: Path) -> None:
    """transformers 5 names its fast tokenizer `TokenizersBackend`, a class transformers 4 does not have; both know
    it as `PreTrainedTokenizerFast`, which loads the same `tokenizer.json`."""
    path = out / "tokenizer_config.json"
    if not (path.exists() and (out / "tokenizer.json").exists()):
        return
    config = json.loads(path.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


from early_exit_router.models._compat.static_cache import (  # noqa: E402, F401 (this module's names too)
    as_dynamic,
    drop_static_slots,
    is_static,
    make_room,
    new_static_cache,
    pad_custom_mask,
    static_held,
)
