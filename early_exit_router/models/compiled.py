"""Compiled passes: positions through the decoder layers as torch.compile graphs over a static KV cache.

One graph per pass shape serves every group of `GROUP` consecutive decoder layers (and one more every single layer):
dynamo lifts a module's weights to graph inputs, and each layer sees its cache through a `LayerView` (its own static
buffers, whatever index its attention passes), so no layer index reaches a graph. Compiling then costs seconds once
per process (inductor keeps its artifacts on disk for the next), not a graph per layer range. A range's mask and
rotary tables are one more small graph, the final norm and LM head another. The mask is HF's own
(`_compat.build_mask` against the static cache); routing decisions stay in
Python between graphs.

Only what measured faster compiles: one position (a plain step) in float32 on a CPU, and on CUDA; wider chunks (the
fill and verify passes) run eagerly from the prepacked weights on the same static cache.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from early_exit_router.models import _compat
from early_exit_router.models.precise_logits import refines

logger = logging.getLogger(__name__)

COMPILED_ROWS = (1,)  # positions per pass that run compiled
# Consecutive layers per graph call (a range's rest runs one layer a call): fewer calls and fusion across layers.
# Measured, a float32 SmolLM2 step: 35.2 ms one layer a call, 30.0 in groups of 6 (12 s to compile), 30.3 of 15 (28 s).
GROUP = 6
# Graphs per compiled function: one per range start (mask graphs) and static length; dynamo's default of 8 would fall
# back to eager without a word once a model with several exits had used them up.
RECOMPILE_LIMIT = 64
_LIMIT_KEY = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"  # < 2.7


class LayerView:
    """One static cache layer as a decoder layer's attention sees a cache: every update goes to this layer's buffers
    (the attention's `layer_idx` is ignored, which keeps it out of the graph)."""

    is_compileable = True

    def __init__(self, layer: Any) -> None:
        self.layer = layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self.layer.update(key_states, value_states)


def compile_unsupported(stack: Any) -> str | None:
    """Why `stack`'s passes do not compile (None: they do)."""
    if not hasattr(torch, "compile"):
        return "this torch has no torch.compile"
    if any(kind != "full_attention" for kind in stack.mask_kinds):
        return "sliding-window layers keep a rolling cache that a rollback cannot reuse"
    if stack.quantized:
        return "quantized weights"
    if stack.device.type not in ("cpu", "cuda"):
        return f"device {stack.device.type} (compiled passes run on CPUs and CUDA)"
    implementation = getattr(stack.config, "_attn_implementation", None) or "eager"
    if implementation not in ("sdpa", "eager"):  # flash kernels take no mask: they would read the unwritten slots
        return f"attention implementation {implementation!r} (compiled passes take sdpa or eager attention)"
    if stack.device.type == "cpu" and stack.dtype != torch.float32:
        # measured on SmolLM2, Xeon with AMX: 47.9 ms a compiled step against 44.2 from the packed weights
        return f"{str(stack.dtype).replace('torch.', '')} on a CPU, where the prepacked products are faster"
    return None


def _range_inputs(stack: Any, hidden: torch.Tensor, cache: Any, positions: torch.Tensor, start: int) -> Any:
    kind = stack.mask_kinds[start]
    mask = _compat.build_mask(kind, stack.config, hidden, cache, positions, start)
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:  # as SDPA adds it, once for every layer
        mask = torch.zeros(mask.shape, dtype=hidden.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask, stack._position_embeddings(hidden, positions, kind)


def _layers_pass(
    stack: Any, layers: tuple[nn.Module, ...], hidden: torch.Tensor, mask: Any, positions: torch.Tensor, rotary: Any,
    views: tuple[Any, ...],
) -> torch.Tensor:  # fmt: skip
    for layer, view in zip(layers, views):
        hidden = stack._call_layer(layer, hidden, mask, positions, rotary, view)
    return hidden


def _head_pass(stack: Any, hidden: torch.Tensor) -> torch.Tensor:
    return stack.finish_logits(stack.lm_head(stack.final_norm(hidden)))


class CompiledLayers:
    """The compiled graphs of one `LayerStack`, and the reason they stopped being used (`failed`)."""

    def __init__(self, stack: Any) -> None:
        self.stack = stack
        self._layers_in_order = tuple(stack.layers)  # sliced per call (a ModuleList slice builds a module)
        self.failed: str | None = None
        self.compile_s = 0.0  # seconds spent in first calls (compiling), this process
        # The static length decodes take: the longest any needed so far (shorter ones reuse its graphs, as HF's
        # static cache does across generate calls).
        self.static_slots = 0
        self._announced = False
        # C++ wrappers: ~6% of a float32 step on 2 cores. No CUDA graphs yet ("reduce-overhead"): one graph serves
        # every layer, each call with other weights, which CUDA graph trees would record once per layer.
        options = {"cpp_wrapper": True} if stack.device.type == "cpu" else {}
        kwargs = {"fullgraph": True, "dynamic": False, "options": options}
        self._prep = torch.compile(_range_inputs, **kwargs)
        self._layers = torch.compile(_layers_pass, **kwargs)
        self._head = torch.compile(_head_pass, **kwargs)
        self._seen: set[tuple] = set()  # (graph, shape) pairs already compiled

    def serves(self, hidden: torch.Tensor, attention_mask: Any) -> bool:
        return self.failed is None and hidden.shape[0] * hidden.shape[1] in COMPILED_ROWS and attention_mask is None

    def run(self, hidden: torch.Tensor, start: int, stop: int, cache: Any, positions: torch.Tensor) -> torch.Tensor:
        """Layers [start, stop) over `hidden` (1, q, hidden_size) at `positions`; falls back to eager passes (and
        stays there, logged) where a graph fails to compile."""
        views = _views(cache)
        length = cache.layers[start].max_cache_len  # the static length: part of every graph's shapes
        held = cache.layers[start].cumulative_length.clone()  # every layer of the range holds these slots
        j, size = start, 1
        try:
            # Grouped heads attend without copying the static buffers (`attention.py`): a static cache's step has
            # a mask (the unwritten slots), which makes HF's sdpa repeat every key and value head over its length.
            with torch._dynamo.config.patch(**{_LIMIT_KEY: RECOMPILE_LIMIT}), self.stack._attention(2):
                mask, rotary = self._call(self._prep, ("range", start, length), self.stack, hidden, cache, positions,
                                          start)  # fmt: skip
                while j < stop:
                    size = GROUP if stop - j >= GROUP else 1  # two graphs in all: a group, one layer
                    layers, group_views = self._layers_in_order[j : j + size], tuple(views[j : j + size])
                    hidden = self._call(self._layers, ("layers", size, length), self.stack, layers, hidden, mask,
                                        positions, rotary, group_views)  # fmt: skip
                    j += size
        except Exception as error:  # noqa: BLE001 (any compiler failure: the eager pass is always there)
            self._fail(error)
            for k in range(j, min(j + size, stop)):  # a graph that failed after writing: its slots again
                cache.layers[k].cumulative_length.copy_(held)
            return self.stack._run(hidden, j, stop, cache, positions, None)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Final norm + LM head (+ the family's finish) over one position, or None where it does not compile."""
        if self.failed is not None:
            return None
        try:
            with torch._dynamo.config.patch(**{_LIMIT_KEY: RECOMPILE_LIMIT}):
                # a fresh tensor: a prefill's last row keeps the prompt's stride, a guard that would fail per length
                return self._call(self._head, ("head",), self.stack, hidden.new_empty(hidden.shape).copy_(hidden))
        except Exception as error:  # noqa: BLE001
            self._fail(error)
            return None

    def _call(self, graph: Any, shape: tuple, *args: Any) -> Any:
        """Call a compiled function, timing (and announcing, once) a first call of a new `shape`: the compile."""
        if shape in self._seen:
            return graph(*args)
        if not self._announced:
            self._announced = True
            logger.warning("early-exit-router: compiling the decode passes (a few graphs, seconds each, once per "
                           "process; inductor caches them on disk for the next)")  # fmt: skip
        started = time.perf_counter()
        out = graph(*args)
        self.compile_s += time.perf_counter() - started
        self._seen.add(shape)
        return out

    def _fail(self, error: Exception) -> None:
        self.failed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        logger.warning("early-exit-router: compiled passes failed (%s); eager passes from now on", self.failed)


def _views(cache: Any) -> list[LayerView]:
    """The per-layer views of `cache`, made once per cache."""
    views = getattr(cache, "_layer_views", None)
    if views is None or [v.layer for v in views] != cache.layers:  # identity: layers define no __eq__
        views = cache._layer_views = [LayerView(layer) for layer in cache.layers]
    return views


def compiled_layers(stack: Any) -> CompiledLayers | None:
    """`stack`'s compiled passes (made at the first ask), None where they do not compile here."""
    if stack._compiled is None and compile_unsupported(stack) is None:
        stack._compiled = CompiledLayers(stack)
    return stack._compiled


def run_range(
    stack: Any,
    hidden: torch.Tensor,
    start: int,
    stop: int,
    cache: Any,
    positions: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> torch.Tensor:
    """`LayerStack._run`, as graphs where the cache is static and the pass's shape compiles (room made first)."""
    if start < stop and _compat.is_static(cache):
        _compat.make_room(cache, start, _compat.static_held(cache, start) + hidden.shape[1])
        compiled = compiled_layers(stack)
        if compiled is not None:  # a grown cache: later decodes start at its length (its graphs are compiled)
            compiled.static_slots = max(compiled.static_slots, cache.layers[start].max_cache_len)
        if compiled is not None and compiled.serves(hidden, attention_mask):
            return compiled.run(hidden, start, stop, cache, positions)
    return stack._run(hidden, start, stop, cache, positions, attention_mask)


def compiled_logits(stack: Any, hidden: torch.Tensor, pad_to: int, precise: bool) -> torch.Tensor | None:
    """One position's final norm + LM head as a graph, or None where it does not run compiled (a float32 refinement
    of a bf16 head's leading logits stays eager)."""
    if hidden.shape[0] * hidden.shape[1] != 1 or pad_to > 1 or (precise and refines(stack.lm_head)):
        return None
    compiled = compiled_layers(stack)
    return None if compiled is None else compiled.logits(hidden)


_said: set[str] = set()


def say_eager(reason: str) -> None:
    """Log once per process and reason why a decode asked to compile runs its passes eagerly."""
    if reason not in _said:
        _said.add(reason)
        logger.warning("early-exit-router: compile=True, but this decode's passes run eagerly: %s", reason)
